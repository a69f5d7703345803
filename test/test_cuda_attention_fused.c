/* test/test_cuda_attention_fused.c — fused attention (cuda/attention_fused.cu, contract
 * nmt/attention.h) against the CPU reference (src/ref/attention_fused.c) and the device's
 * unfused op (cuda/attention.cu), in fp32 (half = 0) and in fp16 / bf16 storage (half = 1).
 * For half the entries run the context's default implementation, the tensor-core kernels of
 * cuda/attention_fused_mma.cu (test_cuda_attention_fused_mma.c holds them to SIMT as well).
 *
 * Per case and mode: the forward twice on the device (out and lse poisoned first) and once on
 * the reference; the backward on the device into two gradient buffers that start alike and
 * once on the reference. Checks:
 *  - fp32: out and lse within rtol 2e-5 of the reference (NMT_TG_CLOSE: of the array's
 *    largest; the sums differ only in order and FMA contraction), the gradients (ACCUMULATED
 *    into random values) within 5e-5; half: out and the gradients (WRITTEN into poisoned
 *    buffers) within one half ulp or rtol 2e-3 (fp16) / 4e-3 (bf16) of the array's largest,
 *    at least 70% equal (NMT_TG_HALF_CLOSE): A and dS are rounded to half at the same sites on
 *    both backends, and an fp32-noise difference that straddles a rounding boundary moves one
 *    term by a half ulp; lse within 2e-5;
 *  - out against the device's unfused attention_fwd / attention_half_fwd on the same inputs
 *    (the same dropout mask: a different mask moves out by O(1)): fp32 rtol 1e-4; half rtol
 *    1e-2 (bf16) / 2e-3 (fp16), 50% equal (the unfused op keeps A in fp32);
 *  - two runs bitwise equal (memcmp) for out, lse and every gradient;
 *  - elements outside the gradients' rows and head columns (4 spare columns per row, and the
 *    slices of a gradient passed as NULL) untouched: fp32 bitwise the initial values, half the
 *    poison (0xffff);
 *  - the gradients asked for are not all zero (the test can fail).
 * Shapes: T in {1, 31, 40, 64, 65, 128, 255, 256}; self-attention on one fused QKV buffer and
 * cross-attention (Tq != Tk) on separate q and kv buffers; causal; k_lens < Tk; one (b, h)
 * tile and thousands; every dk in {32, 64, 128}; dropout p = 0.1; backward passes asked for one
 * gradient. The errors: dk = 48 (NMT_ERR_USAGE), bad shapes, half in an fp32 context. */
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

typedef struct {
  int B, Tq, Tk, H, dk, causal, self; /* self: q, k, v slices of one (B*T, 3C + 4) buffer */
  float p;
  int pad; /* 1: k_lens[b] = Tk - (b * 7) % Tk (some < Tk); 0: all Tk */
  int only; /* backward: only dq (1), dkey (2) or dv (3); 0: all three */
} af_case;

static const af_case af_cases[] = {
    /* B, Tq, Tk, H, dk, causal, self, p, pad, only */
    {2, 40, 40, 8, 64, 0, 1, 0.1f, 1, 0},     /* the base model's encoder self-attention */
    {2, 40, 40, 8, 64, 1, 1, 0.1f, 1, 0},     /* and its decoder's */
    {3, 31, 31, 2, 32, 1, 1, 0.1f, 1, 0},
    {4, 1, 1, 2, 64, 1, 1, 0.0f, 0, 0},       /* T = 1 */
    {2, 64, 64, 2, 128, 1, 1, 0.0f, 1, 0},
    {2, 65, 65, 2, 64, 0, 1, 0.1f, 1, 0},     /* one key past two tiles */
    {1, 128, 128, 2, 32, 1, 1, 0.0f, 0, 0},
    {2, 255, 255, 1, 64, 1, 1, 0.1f, 1, 0},
    {1, 256, 256, 2, 128, 0, 1, 0.1f, 0, 0},
    {3, 40, 65, 4, 64, 0, 0, 0.1f, 1, 0},     /* cross-attention, Tq != Tk */
    {2, 65, 40, 2, 128, 0, 0, 0.0f, 1, 0},
    {3, 1, 31, 4, 32, 0, 0, 0.0f, 1, 0},      /* one query (a decoding step) */
    {200, 40, 40, 8, 64, 1, 1, 0.1f, 1, 0},   /* thousands of (b, h) tiles */
    {3, 6, 10, 4, 32, 0, 0, 0.1f, 1, 1},      /* dq alone */
    {3, 6, 10, 4, 32, 0, 0, 0.1f, 1, 2},      /* dkey alone */
    {3, 6, 10, 4, 32, 0, 0, 0.1f, 1, 3},      /* dv alone */
};

enum { AF_SPARE = 4 }; /* spare columns per row of every q / kv buffer */

/* The host values of n device elements: floats (half = 0) or half bits decoded. */
static float *af_values(nmt_tg_gpu *g, nmt_precision mode, int half, const void *d, size_t n) {
  const void *h = nmt_tg_fetch(g, d, n * (half ? 2 : 4));
  if (!h) return NULL;
  return half ? nmt_tg_half_decode(g, mode, h, n) : (float *)h;
}

/* Device got vs reference want (host, the same element type), n elements. */
static int af_close(nmt_tg_gpu *g, nmt_precision mode, int half, const char *what,
                    const void *d_got, const void *want, size_t n, double rtol32,
                    double rtol_half, double min_exact) {
  if (half) {
    const uint16_t *got = nmt_tg_fetch(g, d_got, n * 2);
    if (!got) return 0;
    return NMT_TG_HALF_CLOSE(mode, what, got, want, n, rtol_half, min_exact);
  }
  const float *got = nmt_tg_fetch(g, d_got, n * 4);
  if (!got) return 0;
  const double atol = rtol32 * nmt_tg_max_abs(want, n);
  return nmt_test_close(__FILE__, __LINE__, what, got, want, n, atol, rtol32);
}

static void af_case_run(nmt_tg_gpu *g, nmt_precision mode, void *rc, const af_case *c,
                        uint64_t seed) {
  char what[200], w2[320];
  const int half = mode != NMT_PRECISION_FP32, es = half ? 2 : 4;
  const int B = c->B, Tq = c->Tq, Tk = c->Tk, H = c->H, dk = c->dk, C = H * dk;
  const int ldq = c->self ? 3 * C + AF_SPARE : C + AF_SPARE;
  const int ldkv = c->self ? ldq : 2 * C + AF_SPARE;
  const size_t nq = (size_t)B * Tq * ldq, nkv = c->self ? nq : (size_t)B * Tk * ldkv;
  const size_t no = (size_t)B * Tq * C, nr = (size_t)B * H * Tq, np = nr * (size_t)Tk;
  const size_t ko = c->self ? (size_t)C : 0, vo = c->self ? 2 * (size_t)C : (size_t)C;
  const char *mn = mode == NMT_PRECISION_FP32 ? "fp32" : nmt_tg_half_bf16(mode) ? "bf16" : "fp16";
  const double rh = mode == NMT_PRECISION_BF16 ? 4e-3 : 2e-3;
  snprintf(what, sizeof what, "%s B=%d Tq=%d Tk=%d H=%d dk=%d causal=%d %s p=%g only=%d", mn, B,
           Tq, Tk, H, dk, c->causal, c->self ? "self" : "cross", (double)c->p, c->only);
  int32_t *lens = nmt_tg_halloc(g, (size_t)B * 4);
  NMT_TG_SETUP_OK();
  for (int b = 0; b < B; b++) lens[b] = c->pad ? Tk - (b * 7) % Tk : Tk;

  /* Inputs in the storage type: fp32 values, or half bits (and the values they stand for). */
  float *qv = nmt_tg_randn(g, nq, seed, 0.5f, 0.0f);
  float *kvv = c->self ? qv : nmt_tg_randn(g, nkv, seed + 1, 0.5f, 0.0f);
  float *doutv = nmt_tg_randn(g, no, seed + 2, 1.0f, 0.0f);
  /* fp32 gradients start from random values (the op adds); half ones poisoned (it writes).
   * Small ones (0.01, beside gradients of ~0.02-0.06), so that the tolerance relative to the
   * largest result stays a bound on the op's own part, not on the starting values. */
  float *gq0 = nmt_tg_randn(g, nq, seed + 3, 0.01f, 0.0f);
  float *gkv0 = c->self ? gq0 : nmt_tg_randn(g, nkv, seed + 4, 0.01f, 0.0f);
  NMT_TG_SETUP_OK();
  const void *hq = qv, *hkv = kvv, *hdout = doutv;
  if (half) {
    hq = nmt_tg_half_encode(g, mode, qv, nq);
    hkv = c->self ? hq : nmt_tg_half_encode(g, mode, kvv, nkv);
    hdout = nmt_tg_half_encode(g, mode, doutv, no);
    NMT_TG_SETUP_OK();
  }
  /* The reference's outputs and gradients (host, storage type). */
  void *want_o = nmt_tg_halloc(g, no * es), *want_gq = nmt_tg_halloc(g, nq * es);
  void *want_gkv = c->self ? want_gq : nmt_tg_halloc(g, nkv * es);
  float *want_lse = nmt_tg_halloc(g, nr * 4), *ref_drow = nmt_tg_halloc(g, nr * 4);
  NMT_TG_SETUP_OK();
  if (half) {
    memset(want_gq, 0xff, nq * 2);
    if (!c->self) memset(want_gkv, 0xff, nkv * 2);
  } else {
    memcpy(want_gq, gq0, nq * 4);
    if (!c->self) memcpy(want_gkv, gkv0, nkv * 4);
  }

  int32_t *d_lens = nmt_tg_dup_dev(g, lens, (size_t)B * 4);
  void *d_q = nmt_tg_dup_dev(g, hq, nq * es);
  void *d_kv = c->self ? d_q : nmt_tg_dup_dev(g, hkv, nkv * es);
  void *d_dout = nmt_tg_dup_dev(g, hdout, no * es);
  void *d_o[2] = {nmt_tg_dalloc(g, no * es), nmt_tg_dalloc(g, no * es)};
  float *d_lse[2] = {nmt_tg_dalloc(g, nr * 4), nmt_tg_dalloc(g, nr * 4)};
  float *d_drow = nmt_tg_dalloc(g, nr * 4);
  void *d_uo = nmt_tg_dalloc(g, no * es);
  float *d_probs = nmt_tg_dalloc(g, np * 4);
  void *d_gq[2], *d_gkv[2];
  for (int i = 0; i < 2; i++) {
    d_gq[i] = half ? nmt_tg_dalloc(g, nq * 2) : nmt_tg_dup_dev(g, gq0, nq * 4);
    d_gkv[i] = c->self ? d_gq[i] : half ? nmt_tg_dalloc(g, nkv * 2) : nmt_tg_dup_dev(g, gkv0, nkv * 4);
  }
  NMT_TG_SETUP_OK();
  for (int i = 0; i < 2; i++) {
    if (half) {
      nmt_tg_half_poison(g, d_o[i], no);
      nmt_tg_half_poison(g, d_gq[i], nq);
      if (!c->self) nmt_tg_half_poison(g, d_gkv[i], nkv);
    } else {
      nmt_tg_poison(g, d_o[i], no);
    }
    nmt_tg_poison(g, d_lse[i], nr);
  }
  nmt_tg_poison(g, d_drow, nr);
  const int esz = es; /* byte offsets of the k and v slices */
  nmt_attn_args a = {0};
  a.q = d_q;
  a.k = (const char *)d_kv + ko * esz;
  a.v = (const char *)d_kv + vo * esz;
  a.ldq = ldq;
  a.ldkv = ldkv;
  a.k_lens = d_lens;
  a.B = B, a.Tq = Tq, a.Tk = Tk, a.H = H, a.dk = dk;
  a.causal = c->causal;
  a.p_drop = c->p;
  a.seed = 31337 + seed;
  a.stream = nmt_rng_stream(5, 23);
  a.half = half;
  nmt_attn_args ra = a; /* the reference's: host pointers */
  ra.q = hq;
  ra.k = (const char *)hkv + ko * esz;
  ra.v = (const char *)hkv + vo * esz;
  ra.k_lens = lens;

  /* ---- forward ---- */
  for (int run = 0; run < 2; run++)
    NMT_ASSERT_OK(g->be->attention_fused_fwd(g->ctx, d_o[run], d_lse[run], &a));
  NMT_ASSERT_OK(nmt_ref_attention_fused_fwd(rc, want_o, want_lse, &ra));
  snprintf(w2, sizeof w2, "attention_fused_fwd out vs the reference, %s", what);
  if (!af_close(g, mode, half, w2, d_o[0], want_o, no, 2e-5, rh, 0.7)) return;
  snprintf(w2, sizeof w2, "attention_fused_fwd lse vs the reference, %s", what);
  NMT_TG_CLOSE(w2, nmt_tg_fetch(g, d_lse[0], nr * 4), want_lse, nr, 2e-5);
  {
    const void *o0 = nmt_tg_fetch(g, d_o[0], no * es), *o1 = nmt_tg_fetch(g, d_o[1], no * es);
    const void *l0 = nmt_tg_fetch(g, d_lse[0], nr * 4), *l1 = nmt_tg_fetch(g, d_lse[1], nr * 4);
    NMT_TG_SETUP_OK();
    NMT_ASSERT(memcmp(o0, o1, no * es) == 0); /* two runs, the same bits */
    NMT_ASSERT(memcmp(l0, l1, nr * 4) == 0);
  }
  /* The device's unfused op on the same inputs and mask. */
  if (half)
    NMT_ASSERT_OK(g->be->attention_half_fwd(g->ctx, d_uo, d_probs, d_q, ldq, a.k, a.v, ldkv,
                                            d_lens, B, Tq, Tk, H, dk, c->causal, c->p, a.seed,
                                            a.stream));
  else
    NMT_ASSERT_OK(g->be->attention_fwd(g->ctx, d_uo, d_probs, d_q, ldq, a.k, a.v, ldkv, d_lens, B,
                                       Tq, Tk, H, dk, c->causal, c->p, a.seed, a.stream));
  {
    const void *uo = nmt_tg_fetch(g, d_uo, no * es);
    NMT_TG_SETUP_OK();
    snprintf(w2, sizeof w2, "attention_fused_fwd out vs the unfused op, %s", what);
    /* at least a quarter equal: the unfused op keeps A in fp32 where the fused one rounds it
     * (a simulation of these inputs gave 55-60% equal elements) */
    if (!af_close(g, mode, half, w2, d_o[0], uo, no, 1e-4,
                  mode == NMT_PRECISION_BF16 ? 1e-2 : 2e-3, 0.25))
      return;
  }

  /* ---- backward ---- */
  const int wq = c->only == 0 || c->only == 1, wk = c->only == 0 || c->only == 2,
            wv = c->only == 0 || c->only == 3;
  for (int run = 0; run < 2; run++)
    NMT_ASSERT_OK(g->be->attention_fused_bwd(
        g->ctx, wq ? d_gq[run] : NULL, wk ? (char *)d_gkv[run] + ko * esz : NULL,
        wv ? (char *)d_gkv[run] + vo * esz : NULL, d_drow, d_dout, d_o[0], d_lse[0], &a));
  NMT_ASSERT_OK(nmt_ref_attention_fused_bwd(
      rc, wq ? want_gq : NULL, wk ? (char *)want_gkv + ko * esz : NULL,
      wv ? (char *)want_gkv + vo * esz : NULL, ref_drow, hdout, want_o, want_lse, &ra));
  snprintf(w2, sizeof w2, "attention_fused_bwd %s vs the reference, %s",
           c->self ? "dqkv" : "dq", what);
  if (!af_close(g, mode, half, w2, d_gq[0], want_gq, nq, 5e-5, rh, 0.7)) return;
  if (!c->self) {
    snprintf(w2, sizeof w2, "attention_fused_bwd dkv vs the reference, %s", what);
    if (!af_close(g, mode, half, w2, d_gkv[0], want_gkv, nkv, 5e-5, rh, 0.7)) return;
  }
  const uint8_t *gq_a = nmt_tg_fetch(g, d_gq[0], nq * es), *gq_b = nmt_tg_fetch(g, d_gq[1], nq * es);
  const uint8_t *gkv_a = c->self ? gq_a : nmt_tg_fetch(g, d_gkv[0], nkv * es);
  const uint8_t *gkv_b = c->self ? gq_b : nmt_tg_fetch(g, d_gkv[1], nkv * es);
  NMT_TG_SETUP_OK();
  NMT_ASSERT(memcmp(gq_a, gq_b, nq * es) == 0); /* two runs, the same bits */
  NMT_ASSERT(memcmp(gkv_a, gkv_b, nkv * es) == 0);
  /* Elements no gradient owns are untouched: spare columns, slices passed as NULL. */
  const uint8_t *init_q = half ? NULL : (const uint8_t *)gq0;
  const uint8_t *init_kv = half ? NULL : (const uint8_t *)gkv0;
  long bad = 0;
  for (int pass = 0; pass < (c->self ? 1 : 2); pass++) {
    const int rows = pass == 0 ? B * Tq : B * Tk, ld = pass == 0 ? ldq : ldkv;
    const uint8_t *got = pass == 0 ? gq_a : gkv_a, *init = pass == 0 ? init_q : init_kv;
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
        if (owned) continue;
        const size_t e = (size_t)r * ld + col;
        if (half ? ((const uint16_t *)got)[e] != 0xffff
                 : memcmp(got + e * 4, init + e * 4, 4) != 0)
          bad++;
      }
  }
  if (bad) {
    nmt_test_fail(__FILE__, __LINE__, "%s: %ld elements outside the gradients written", what, bad);
    return;
  }
  /* The test can fail: the gradients asked for are not all zero (fp32: they moved). */
  const float *vq = af_values(g, mode, half, d_gq[0], nq);
  NMT_TG_SETUP_OK();
  double mx = 0.0;
  for (size_t e = 0; e < nq; e++) {
    const float init = half ? 0.0f : gq0[e];
    if (!isnan(vq[e])) mx = fmax(mx, fabs((double)vq[e] - init));
  }
  NMT_ASSERT(mx > 0.0 || !(wq || (c->self && (wk || wv))));
}

static void af_mode(nmt_tg_gpu *g, nmt_precision mode) {
  nmt_scratch_plan plan;
  memset(&plan, 0, sizeof plan);
  void *rc = nmt_tg_half_twin(g, mode, &plan);
  if (!rc) return;
  const size_t n_cases = sizeof af_cases / sizeof *af_cases;
  for (size_t i = 0; i < n_cases; i++) {
    af_case_run(g, mode, rc, &af_cases[i], 900 + 10 * i + 1000 * (uint64_t)mode);
    if (nmt_test_failed()) break;
  }
  nmt_ref_ctx_destroy(rc);
}

NMT_TG_TEST(cuda_attention_fused_fp32_matches_ref) { af_mode(g, NMT_PRECISION_FP32); }
NMT_TG_TEST(cuda_attention_fused_fp16_matches_ref) { af_mode(g, NMT_PRECISION_FP16); }
NMT_TG_TEST(cuda_attention_fused_bf16_matches_ref) { af_mode(g, NMT_PRECISION_BF16); }

/* The arguments the fused ops refuse: dk outside {32, 64, 128} (NMT_ERR_USAGE: the config
 * check's), bad shapes, strides below H*dk, p outside [0, 1), half in an fp32 context
 * (NMT_ERR_INTERNAL). */
NMT_TG_TEST(cuda_attention_fused_refuses_misuse) {
  void *h = nmt_tg_dalloc(g, 1 << 16);
  float *f = nmt_tg_dalloc(g, 1 << 16);
  int32_t lens[2] = {4, 4};
  int32_t *d_lens = nmt_tg_dup_dev(g, lens, sizeof lens);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_FP32));
  nmt_attn_args a = {0};
  a.q = a.k = a.v = h;
  a.ldq = a.ldkv = 2 * 48;
  a.k_lens = d_lens;
  a.B = 2, a.Tq = 4, a.Tk = 4, a.H = 2, a.dk = 48;
  a.p_drop = 0.1f;
  NMT_ASSERT_EQ_STATUS(g->be->attention_fused_fwd(g->ctx, h, f, &a), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(g->be->attention_fused_bwd(g->ctx, h, h, h, f, h, h, f, &a),
                       NMT_ERR_USAGE);
  a.dk = 32, a.ldq = a.ldkv = 64;
  nmt_attn_args b = a;
  b.Tk = 0;
  NMT_ASSERT_EQ_STATUS(g->be->attention_fused_fwd(g->ctx, h, f, &b), NMT_ERR_INTERNAL);
  b = a, b.ldq = 63;
  NMT_ASSERT_EQ_STATUS(g->be->attention_fused_fwd(g->ctx, h, f, &b), NMT_ERR_INTERNAL);
  b = a, b.p_drop = 1.0f;
  NMT_ASSERT_EQ_STATUS(g->be->attention_fused_bwd(g->ctx, h, h, h, f, h, h, f, &b),
                       NMT_ERR_INTERNAL);
  b = a, b.half = 1; /* the context is fp32: no half type */
  NMT_ASSERT_EQ_STATUS(g->be->attention_fused_fwd(g->ctx, h, f, &b), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->attention_fused_bwd(g->ctx, h, h, h, f, h, h, f, &b),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->attention_fused_fwd(g->ctx, h, f, &a)); /* the valid call runs */
  NMT_ASSERT_OK(g->be->synchronize(g->ctx));
}
