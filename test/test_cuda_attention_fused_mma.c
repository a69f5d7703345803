/* test/test_cuda_attention_fused_mma.c — the tensor-core (WMMA) fused attention for half
 * storage (cuda/attention_fused_mma.cu, contract nmt/attention.h) against the CPU reference
 * (src/ref/attention_fused.c) and the SIMT kernels (cuda/attention_fused.cu) on the same
 * device, in fp16 and bf16 (half = 1). The implementation is picked per call through the test
 * knob nmt_cuda_ctx_set_attention_fused_impl (nmt/cuda.h); test_cuda_attention_fused.c holds
 * the default (mma) to the reference as well.
 *
 * Per case and mode: the mma forward twice (out and lse poisoned first), the SIMT forward
 * once, the reference once; the mma backward twice into poisoned gradient buffers, the SIMT
 * backward once, the reference once. Checks:
 *  - out and the gradients within one half ulp or rtol 2e-3 (fp16) / 4e-3 (bf16) of the
 *    array's largest, at least 70% equal (NMT_TG_HALF_CLOSE), against the reference and
 *    against SIMT: A and dS are rounded at the same sites, only the fp32 sums' order differs
 *    (tensor-core adds vs index order), and a difference that straddles a rounding boundary
 *    moves one term by a half ulp; lse within 2e-5 of both;
 *  - two mma runs bitwise equal (memcmp) for out, lse and every gradient;
 *  - elements outside the gradients' rows and head columns (4 spare columns per row, the
 *    slices of a gradient passed as NULL) still the poison (0xffff);
 *  - the gradients asked for are not all zero (the test can fail);
 *  - Tk = 257 (past the mma path's 256 keys): bitwise the SIMT result (the fallback).
 * Shapes: T in {1, 31, 40, 64, 65, 128, 255, 256}; self-attention on one fused QKV buffer and
 * cross-attention (Tq != Tk); causal; k_lens < Tk; dk in {32, 64, 128}; dropout 0.1; backward
 * passes asked for one gradient. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/attention.h"
#include "nmt/backend.h"
#include "nmt/half.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

/* The test knob (nmt/cuda.h). Weak: a CPU-only build links without it; the reference playing
 * the device (NMT_CUDA_TESTS_ON_REF) has one implementation and runs both passes alike. */
extern nmt_status nmt_cuda_ctx_set_attention_fused_impl(void *ctx, int mma)
    __attribute__((weak));

static int afm_impl(nmt_tg_gpu *g, int mma) {
  if (g->be->is_host || !nmt_cuda_ctx_set_attention_fused_impl) return 1;
  const nmt_status s = nmt_cuda_ctx_set_attention_fused_impl(g->ctx, mma);
  if (s != NMT_OK)
    nmt_test_fail(__FILE__, __LINE__, "set_attention_fused_impl: %s", nmt_last_error());
  return s == NMT_OK;
}

typedef struct {
  int B, Tq, Tk, H, dk, causal, self; /* self: q, k, v slices of one (B*T, 3C + 4) buffer */
  float p;
  int pad;  /* 1: k_lens[b] = Tk - (b * 7) % Tk (some < Tk); 0: all Tk */
  int only; /* backward: only dq (1), dkey (2) or dv (3); 0: all three */
} afm_case;

static const afm_case afm_cases[] = {
    /* B, Tq, Tk, H, dk, causal, self, p, pad, only */
    {2, 40, 40, 8, 64, 0, 1, 0.1f, 1, 0},   /* the base model's encoder self-attention */
    {2, 40, 40, 8, 64, 1, 1, 0.1f, 1, 0},   /* and its decoder's */
    {3, 31, 31, 2, 32, 1, 1, 0.1f, 1, 0},
    {4, 1, 1, 2, 64, 1, 1, 0.0f, 0, 0},     /* T = 1 */
    {2, 64, 64, 2, 128, 1, 1, 0.0f, 1, 0},
    {2, 65, 65, 2, 64, 0, 1, 0.1f, 1, 0},   /* one key past four tiles */
    {1, 128, 128, 2, 32, 1, 1, 0.0f, 0, 0},
    {2, 255, 255, 1, 64, 1, 1, 0.1f, 1, 0},
    {1, 256, 256, 2, 128, 0, 1, 0.1f, 0, 0}, /* the mma path's longest key row */
    {2, 256, 256, 2, 32, 1, 1, 0.1f, 1, 0},
    {3, 40, 65, 4, 64, 0, 0, 0.1f, 1, 0},   /* cross-attention, Tq != Tk */
    {2, 65, 40, 2, 128, 0, 0, 0.0f, 1, 0},
    {3, 1, 31, 4, 32, 0, 0, 0.0f, 1, 0},    /* one query (a decoding step) */
    {2, 31, 256, 2, 64, 0, 0, 0.1f, 1, 0},
    {200, 40, 40, 8, 64, 1, 1, 0.1f, 1, 0}, /* thousands of (b, h) tiles */
    {3, 6, 10, 4, 32, 0, 0, 0.1f, 1, 1},    /* dq alone */
    {3, 6, 10, 4, 32, 0, 0, 0.1f, 1, 2},    /* dkey alone */
    {3, 6, 10, 4, 32, 0, 0, 0.1f, 1, 3},    /* dv alone */
    {2, 40, 257, 2, 64, 0, 0, 0.1f, 1, 0},  /* past 256 keys: the SIMT fallback */
};

enum { AFM_SPARE = 4 }; /* spare columns per row of every q / kv buffer */

/* The buffers of one case (device unless named h*). */
typedef struct {
  size_t nq, nkv, no, nr;
  void *d_q, *d_kv, *d_dout, *d_o[3], *d_gq[3], *d_gkv[3]; /* [0], [1]: mma; [2]: SIMT */
  float *d_lse[3], *d_drow;
} afm_bufs;

/* Forward then backward with implementation mma (1) or SIMT (0) into slot s, outputs and
 * gradients poisoned first; the backward reads slot 0's out and lse (the mma forward's). */
static void afm_pass(nmt_tg_gpu *g, const afm_case *c, const nmt_attn_args *a, afm_bufs *u,
                     int s, int mma) {
  const int wq = c->only == 0 || c->only == 1, wk = c->only == 0 || c->only == 2,
            wv = c->only == 0 || c->only == 3, C = c->H * c->dk;
  const size_t ko = c->self ? (size_t)C : 0, vo = c->self ? 2 * (size_t)C : (size_t)C;
  if (!afm_impl(g, mma)) return;
  nmt_tg_half_poison(g, u->d_o[s], u->no);
  nmt_tg_poison(g, u->d_lse[s], u->nr);
  nmt_tg_half_poison(g, u->d_gq[s], u->nq);
  if (!c->self) nmt_tg_half_poison(g, u->d_gkv[s], u->nkv);
  nmt_tg_poison(g, u->d_drow, u->nr);
  NMT_ASSERT_OK(g->be->attention_fused_fwd(g->ctx, u->d_o[s], u->d_lse[s], a));
  NMT_ASSERT_OK(g->be->attention_fused_bwd(
      g->ctx, wq ? u->d_gq[s] : NULL, wk ? (char *)u->d_gkv[s] + ko * 2 : NULL,
      wv ? (char *)u->d_gkv[s] + vo * 2 : NULL, u->d_drow, u->d_dout, u->d_o[0], u->d_lse[0],
      a));
  afm_impl(g, 1);
}

/* got (device) vs want (host bits) and, for the second, device vs device. */
static int afm_close(nmt_tg_gpu *g, nmt_precision mode, const char *what, const void *d_got,
                     const void *want, size_t n, double rtol) {
  const uint16_t *got = nmt_tg_fetch(g, d_got, n * 2);
  if (!got) return 0;
  return NMT_TG_HALF_CLOSE(mode, what, got, want, n, rtol, 0.7);
}

static int afm_same(nmt_tg_gpu *g, const char *what, const void *d_a, const void *d_b,
                    size_t bytes) {
  const void *x = nmt_tg_fetch(g, d_a, bytes), *y = nmt_tg_fetch(g, d_b, bytes);
  if (!x || !y) return 0;
  if (memcmp(x, y, bytes) == 0) return 1;
  nmt_test_fail(__FILE__, __LINE__, "%s: not bitwise equal", what);
  return 0;
}

/* Elements no gradient owns (spare columns, slices passed as NULL) still hold the poison. */
static long afm_unowned(const afm_case *c, const uint16_t *gq, const uint16_t *gkv, int ldq,
                        int ldkv) {
  const int C = c->H * c->dk, wq = c->only == 0 || c->only == 1,
            wk = c->only == 0 || c->only == 2, wv = c->only == 0 || c->only == 3;
  long bad = 0;
  for (int pass = 0; pass < (c->self ? 1 : 2); pass++) {
    const int rows = pass == 0 ? c->B * c->Tq : c->B * c->Tk, ld = pass == 0 ? ldq : ldkv;
    const uint16_t *got = pass == 0 ? gq : gkv;
    for (int r = 0; r < rows; r++)
      for (int col = 0; col < ld; col++) {
        int owned;
        if (c->self)
          owned = (col < C && wq) || (col >= C && col < 2 * C && wk) ||
                  (col >= 2 * C && col < 3 * C && wv);
        else if (pass == 0)
          owned = col < C && wq;
        else
          owned = (col < C && wk) || (col >= C && col < 2 * C && wv);
        if (!owned && got[(size_t)r * ld + col] != 0xffff) bad++;
      }
  }
  return bad;
}

static void afm_case_run(nmt_tg_gpu *g, nmt_precision mode, void *rc, const afm_case *c,
                         uint64_t seed) {
  char what[200], w2[320];
  const int B = c->B, Tq = c->Tq, Tk = c->Tk, H = c->H, dk = c->dk, C = H * dk;
  const int ldq = c->self ? 3 * C + AFM_SPARE : C + AFM_SPARE;
  const int ldkv = c->self ? ldq : 2 * C + AFM_SPARE;
  afm_bufs u;
  memset(&u, 0, sizeof u);
  u.nq = (size_t)B * Tq * ldq, u.nkv = c->self ? u.nq : (size_t)B * Tk * ldkv;
  u.no = (size_t)B * Tq * C, u.nr = (size_t)B * H * Tq;
  const size_t ko = c->self ? (size_t)C : 0, vo = c->self ? 2 * (size_t)C : (size_t)C;
  const char *mn = nmt_tg_half_bf16(mode) ? "bf16" : "fp16";
  const double rh = mode == NMT_PRECISION_BF16 ? 4e-3 : 2e-3;
  const int mma_serves = Tk <= 256; /* cuda/attention_fused_mma.cuh */
  snprintf(what, sizeof what, "%s B=%d Tq=%d Tk=%d H=%d dk=%d causal=%d %s p=%g only=%d", mn, B,
           Tq, Tk, H, dk, c->causal, c->self ? "self" : "cross", (double)c->p, c->only);
  int32_t *lens = nmt_tg_halloc(g, (size_t)B * 4);
  NMT_TG_SETUP_OK();
  for (int b = 0; b < B; b++) lens[b] = c->pad ? Tk - (b * 7) % Tk : Tk;
  const float *qv = nmt_tg_randn(g, u.nq, seed, 0.5f, 0.0f);
  const float *kvv = c->self ? qv : nmt_tg_randn(g, u.nkv, seed + 1, 0.5f, 0.0f);
  const float *doutv = nmt_tg_randn(g, u.no, seed + 2, 1.0f, 0.0f);
  NMT_TG_SETUP_OK();
  uint16_t *hq = nmt_tg_half_encode(g, mode, qv, u.nq);
  uint16_t *hkv = c->self ? hq : nmt_tg_half_encode(g, mode, kvv, u.nkv);
  const uint16_t *hdout = nmt_tg_half_encode(g, mode, doutv, u.no);
  NMT_TG_SETUP_OK();
  /* Padded keys (j >= k_lens[b]) hold NaN in their k and v columns: no backend may let them
   * into a product (the mma kernels stage them as zeros, SIMT and the reference skip them). */
  for (int b = 0; b < B; b++)
    for (int j = lens[b]; j < Tk; j++)
      for (int col = 0; col < C; col++) {
        hkv[((size_t)b * Tk + j) * ldkv + ko + col] = 0xffff;
        hkv[((size_t)b * Tk + j) * ldkv + vo + col] = 0xffff;
      }
  uint16_t *want_o = nmt_tg_halloc(g, u.no * 2), *want_gq = nmt_tg_halloc(g, u.nq * 2);
  uint16_t *want_gkv = c->self ? want_gq : nmt_tg_halloc(g, u.nkv * 2);
  float *want_lse = nmt_tg_halloc(g, u.nr * 4), *ref_drow = nmt_tg_halloc(g, u.nr * 4);
  NMT_TG_SETUP_OK();
  memset(want_gq, 0xff, u.nq * 2);
  if (!c->self) memset(want_gkv, 0xff, u.nkv * 2);
  int32_t *d_lens = nmt_tg_dup_dev(g, lens, (size_t)B * 4);
  u.d_q = nmt_tg_dup_dev(g, hq, u.nq * 2);
  u.d_kv = c->self ? u.d_q : nmt_tg_dup_dev(g, hkv, u.nkv * 2);
  u.d_dout = nmt_tg_dup_dev(g, hdout, u.no * 2);
  for (int s = 0; s < 3; s++) {
    u.d_o[s] = nmt_tg_dalloc(g, u.no * 2);
    u.d_lse[s] = nmt_tg_dalloc(g, u.nr * 4);
    u.d_gq[s] = nmt_tg_dalloc(g, u.nq * 2);
    u.d_gkv[s] = c->self ? u.d_gq[s] : nmt_tg_dalloc(g, u.nkv * 2);
  }
  u.d_drow = nmt_tg_dalloc(g, u.nr * 4);
  NMT_TG_SETUP_OK();
  nmt_attn_args a = {0};
  a.q = u.d_q;
  a.k = (const char *)u.d_kv + ko * 2;
  a.v = (const char *)u.d_kv + vo * 2;
  a.ldq = ldq, a.ldkv = ldkv, a.k_lens = d_lens;
  a.B = B, a.Tq = Tq, a.Tk = Tk, a.H = H, a.dk = dk;
  a.causal = c->causal, a.p_drop = c->p;
  a.seed = 4242 + seed, a.stream = nmt_rng_stream(5, 23), a.half = 1;
  nmt_attn_args ra = a; /* the reference's: host pointers */
  ra.q = hq;
  ra.k = (const char *)hkv + ko * 2;
  ra.v = (const char *)hkv + vo * 2;
  ra.k_lens = lens;
  const int wq = c->only == 0 || c->only == 1, wk = c->only == 0 || c->only == 2,
            wv = c->only == 0 || c->only == 3;

  afm_pass(g, c, &a, &u, 0, 1);
  NMT_TG_SETUP_OK();
  afm_pass(g, c, &a, &u, 1, 1);
  NMT_TG_SETUP_OK();
  afm_pass(g, c, &a, &u, 2, 0);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(nmt_ref_attention_fused_fwd(rc, want_o, want_lse, &ra));
  NMT_ASSERT_OK(nmt_ref_attention_fused_bwd(
      rc, wq ? want_gq : NULL, wk ? (char *)want_gkv + ko * 2 : NULL,
      wv ? (char *)want_gkv + vo * 2 : NULL, ref_drow, hdout, want_o, want_lse, &ra));
  /* Two mma runs, the same bits; past 256 keys the "mma" choice runs SIMT: its bits. */
  if (!afm_same(g, what, u.d_o[0], u.d_o[1], u.no * 2) ||
      !afm_same(g, what, u.d_lse[0], u.d_lse[1], u.nr * 4) ||
      !afm_same(g, what, u.d_gq[0], u.d_gq[1], u.nq * 2) ||
      !afm_same(g, what, u.d_gkv[0], u.d_gkv[1], u.nkv * 2))
    return;
  if (!mma_serves &&
      (!afm_same(g, what, u.d_o[0], u.d_o[2], u.no * 2) ||
       !afm_same(g, what, u.d_gq[0], u.d_gq[2], u.nq * 2) ||
       !afm_same(g, what, u.d_gkv[0], u.d_gkv[2], u.nkv * 2)))
    return;
  snprintf(w2, sizeof w2, "mma out vs the reference, %s", what);
  if (!afm_close(g, mode, w2, u.d_o[0], want_o, u.no, rh)) return;
  snprintf(w2, sizeof w2, "mma lse vs the reference, %s", what);
  NMT_TG_CLOSE(w2, nmt_tg_fetch(g, u.d_lse[0], u.nr * 4), want_lse, u.nr, 2e-5);
  snprintf(w2, sizeof w2, "mma lse vs SIMT, %s", what);
  NMT_TG_CLOSE(w2, nmt_tg_fetch(g, u.d_lse[0], u.nr * 4),
               nmt_tg_fetch(g, u.d_lse[2], u.nr * 4), u.nr, 2e-5);
  const uint16_t *so = nmt_tg_fetch(g, u.d_o[2], u.no * 2);
  const uint16_t *sgq = nmt_tg_fetch(g, u.d_gq[2], u.nq * 2);
  const uint16_t *sgkv = c->self ? sgq : nmt_tg_fetch(g, u.d_gkv[2], u.nkv * 2);
  NMT_TG_SETUP_OK();
  snprintf(w2, sizeof w2, "mma out vs SIMT, %s", what);
  if (!afm_close(g, mode, w2, u.d_o[0], so, u.no, rh)) return;
  snprintf(w2, sizeof w2, "mma %s vs the reference, %s", c->self ? "dqkv" : "dq", what);
  if (!afm_close(g, mode, w2, u.d_gq[0], want_gq, u.nq, rh)) return;
  snprintf(w2, sizeof w2, "mma %s vs SIMT, %s", c->self ? "dqkv" : "dq", what);
  if (!afm_close(g, mode, w2, u.d_gq[0], sgq, u.nq, rh)) return;
  if (!c->self) {
    snprintf(w2, sizeof w2, "mma dkv vs the reference, %s", what);
    if (!afm_close(g, mode, w2, u.d_gkv[0], want_gkv, u.nkv, rh)) return;
    snprintf(w2, sizeof w2, "mma dkv vs SIMT, %s", what);
    if (!afm_close(g, mode, w2, u.d_gkv[0], sgkv, u.nkv, rh)) return;
  }
  const uint16_t *gq = nmt_tg_fetch(g, u.d_gq[0], u.nq * 2);
  const uint16_t *gkv = c->self ? gq : nmt_tg_fetch(g, u.d_gkv[0], u.nkv * 2);
  NMT_TG_SETUP_OK();
  const long bad = afm_unowned(c, gq, gkv, ldq, ldkv);
  if (bad) {
    nmt_test_fail(__FILE__, __LINE__, "%s: %ld elements outside the gradients written", what, bad);
    return;
  }
  /* The test can fail: the gradients asked for are not all zero. */
  const float *vq = nmt_tg_half_decode(g, mode, gq, u.nq);
  const float *vkv = c->self ? vq : nmt_tg_half_decode(g, mode, gkv, u.nkv);
  NMT_TG_SETUP_OK();
  double mx = 0.0;
  for (size_t e = 0; e < u.nq && wq; e++)
    if (!isnan(vq[e])) mx = fmax(mx, fabs((double)vq[e]));
  for (size_t e = 0; e < u.nkv && (wk || wv); e++)
    if (!isnan(vkv[e])) mx = fmax(mx, fabs((double)vkv[e]));
  NMT_ASSERT(mx > 0.0);
}

static void afm_mode(nmt_tg_gpu *g, nmt_precision mode) {
  nmt_scratch_plan plan;
  memset(&plan, 0, sizeof plan);
  void *rc = nmt_tg_half_twin(g, mode, &plan);
  if (!rc) return;
  const size_t n_cases = sizeof afm_cases / sizeof *afm_cases;
  for (size_t i = 0; i < n_cases; i++) {
    afm_case_run(g, mode, rc, &afm_cases[i], 700 + 10 * i + 1000 * (uint64_t)mode);
    if (nmt_test_failed()) break;
  }
  nmt_ref_ctx_destroy(rc);
}

NMT_TG_TEST(cuda_attention_fused_mma_fp16_matches_ref_and_simt) {
  afm_mode(g, NMT_PRECISION_FP16);
}
NMT_TG_TEST(cuda_attention_fused_mma_bf16_matches_ref_and_simt) {
  afm_mode(g, NMT_PRECISION_BF16);
}

/* The knob refuses a NULL context and a choice outside {0, 1}. */
NMT_TG_TEST(cuda_attention_fused_mma_knob_refuses_misuse) {
  if (g->be->is_host || !nmt_cuda_ctx_set_attention_fused_impl) return;
  NMT_ASSERT_EQ_STATUS(nmt_cuda_ctx_set_attention_fused_impl(NULL, 1), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_cuda_ctx_set_attention_fused_impl(g->ctx, 2), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(nmt_cuda_ctx_set_attention_fused_impl(g->ctx, 0));
  NMT_ASSERT_OK(nmt_cuda_ctx_set_attention_fused_impl(g->ctx, 1));
}
