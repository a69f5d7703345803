/* test/test_cuda_attention.c — multi-head attention (cuda/attention.cu) against the reference
 * (src/ref/attention.c), forward (probabilities and output) and backward: fused QKV and
 * separate q / kv buffers, causal and key-padding masks, dropout on the weights, the base
 * model's head shape, a single query, and backward passes asked for one gradient only; rtol
 * 1e-4 in fp32 and 1e-3 with TF32 GEMMs (NMT_TG_CLOSE, test/gpu_helpers.h). The backward
 * makes one batched cuBLASLt launch per product (the context's counter). The half-storage
 * path's attention_half_fwd / _bwd (below). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/half.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

typedef struct {
  int B, Tq, Tk, H, dk, causal, fused; /* fused: q, k, v are slices of one (B*T, 3C) buffer */
  float p;
  int32_t lens[4];
  int only; /* backward requests only dq (1), dkey (2) or dv (3); 0: all three */
} att_case;

static void attention_case(nmt_tg_gpu *g, const att_case *a, double rtol, uint64_t seed) {
  char what[128];
  const int B = a->B, Tq = a->Tq, Tk = a->Tk, H = a->H, dk = a->dk, C = H * dk;
  const int ldq = a->fused ? 3 * C : C, ldkv = a->fused ? 3 * C : 2 * C;
  /* Query buffer (B*Tq rows of ldq) and key/value buffer (B*Tk rows of ldkv); fused: one. */
  const size_t nq = (size_t)B * Tq * ldq, nkv = a->fused ? 0 : (size_t)B * Tk * ldkv;
  const size_t no = (size_t)B * Tq * C, np = (size_t)B * H * Tq * Tk;
  const uint64_t dseed = 4242 + seed, dstream = nmt_rng_stream(3, 17);
  float *qb = nmt_tg_randn(g, nq, seed, 0.5f, 0.0f),
        *kvb = nmt_tg_randn(g, nkv ? nkv : 1, seed + 1, 0.5f, 0.0f);
  float *dout = nmt_tg_randn(g, no, seed + 2, 1.0f, 0.0f);
  float *dqb = nmt_tg_randn(g, nq, seed + 3, 1.0f, 0.0f),
        *dkvb = nmt_tg_randn(g, nkv ? nkv : 1, seed + 4, 1.0f, 0.0f);
  float *want = nmt_tg_halloc(g, no * 4), *want_p = nmt_tg_halloc(g, np * 4),
        *scratch = nmt_tg_halloc(g, np * 4);
  float *want_dq = nmt_tg_hcopy(g, dqb, nq), *want_dkv = nmt_tg_hcopy(g, dkvb, nkv ? nkv : 1);
  NMT_TG_SETUP_OK();
  int32_t *d_lens = nmt_tg_dup_dev(g, a->lens, (size_t)B * 4);
  float *d_q = nmt_tg_dup_dev(g, qb, nq * 4), *d_kv = nkv ? nmt_tg_dup_dev(g, kvb, nkv * 4) : d_q;
  float *d_out = nmt_tg_dalloc(g, no * 4), *d_p = nmt_tg_dalloc(g, np * 4),
        *d_dp = nmt_tg_dalloc(g, np * 4);
  float *d_dout = nmt_tg_dup_dev(g, dout, no * 4), *d_dq = nmt_tg_dup_dev(g, dqb, nq * 4);
  float *d_dkv = nkv ? nmt_tg_dup_dev(g, dkvb, nkv * 4) : d_dq;
  NMT_TG_SETUP_OK();
  /* Slices: fused (q | k | v) per row; else q alone and (k | v). */
  const size_t ko = a->fused ? (size_t)C : 0, vo = a->fused ? 2 * (size_t)C : (size_t)C;
  const float *hk = (a->fused ? qb : kvb) + ko, *hv = (a->fused ? qb : kvb) + vo;
  float *hdk = (a->fused ? want_dq : want_dkv) + ko, *hdv = (a->fused ? want_dq : want_dkv) + vo;
  nmt_tg_poison(g, d_out, no);
  nmt_tg_poison(g, d_p, np);
  nmt_tg_poison(g, d_dp, np);
  nmt_backend_counters f0 = {0}, f1 = {0};
  if (g->ctx) NMT_ASSERT_OK(g->be->counters(g->ctx, &f0));
  NMT_ASSERT_OK(g->be->attention_fwd(g->ctx, d_out, d_p, d_q, ldq, d_kv + ko, d_kv + vo, ldkv,
                                     d_lens, B, Tq, Tk, H, dk, a->causal, a->p, dseed, dstream));
  if (g->ctx) NMT_ASSERT_OK(g->be->counters(g->ctx, &f1));
  if (g->ctx) NMT_ASSERT_EQ_INT(f1.gemm_calls - f0.gemm_calls, 2); /* scores, weighted sum */
  NMT_ASSERT_OK(nmt_ref_attention_fwd(NULL, want, want_p, qb, ldq, hk, hv, ldkv, a->lens, B, Tq,
                                      Tk, H, dk, a->causal, a->p, dseed, dstream));
  snprintf(what, sizeof what, "attention_fwd probs B=%d Tq=%d Tk=%d H=%d dk=%d causal=%d p=%g", B,
           Tq, Tk, H, dk, a->causal, (double)a->p);
  NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_p, np * 4), want_p, np, rtol);
  snprintf(what, sizeof what, "attention_fwd out B=%d Tq=%d Tk=%d H=%d dk=%d causal=%d p=%g", B,
           Tq, Tk, H, dk, a->causal, (double)a->p);
  NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_out, no * 4), want, no, rtol);
  float *gd[3] = {d_dq, d_dkv + ko, d_dkv + vo}, *gh[3] = {want_dq, hdk, hdv};
  for (int i = 0; i < 3; i++)
    if (a->only && a->only != i + 1) gd[i] = gh[i] = NULL;
  nmt_backend_counters c0 = {0}, c1 = {0};
  if (g->ctx) NMT_ASSERT_OK(g->be->counters(g->ctx, &c0)); /* a NULL ctx: the ref plays it */
  NMT_ASSERT_OK(g->be->attention_bwd(g->ctx, gd[0], gd[1], gd[2], d_dp, d_dout, d_p, d_q, ldq,
                                     d_kv + ko, d_kv + vo, ldkv, d_lens, B, Tq, Tk, H, dk,
                                     a->causal, a->p, dseed, dstream));
  if (g->ctx) NMT_ASSERT_OK(g->be->counters(g->ctx, &c1));
  NMT_ASSERT_OK(nmt_ref_attention_bwd(NULL, gh[0], gh[1], gh[2], scratch, dout, want_p, qb, ldq,
                                      hk, hv, ldkv, a->lens, B, Tq, Tk, H, dk, a->causal, a->p,
                                      dseed, dstream));
  /* One batched GEMM per product: dv; the weights' gradient, dq, dkey. */
  const long launches = a->only == 0 ? 4 : a->only == 3 ? 1 : 2;
  if (g->ctx) NMT_ASSERT_EQ_INT(c1.gemm_calls - c0.gemm_calls, launches);
  snprintf(what, sizeof what, "attention_bwd %s B=%d Tq=%d Tk=%d H=%d dk=%d causal=%d p=%g",
           a->fused ? "dqkv" : "dq", B, Tq, Tk, H, dk, a->causal, (double)a->p);
  NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_dq, nq * 4), want_dq, nq, rtol);
  if (nkv) {
    snprintf(what, sizeof what, "attention_bwd dkv B=%d Tq=%d Tk=%d H=%d dk=%d p=%g", B, Tq, Tk, H,
             dk, (double)a->p);
    NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_dkv, nkv * 4), want_dkv, nkv, rtol);
  }
}

static const att_case att_cases[] = {
    /* B, Tq, Tk, H, dk, causal, fused, p, k_lens, only */
    {3, 9, 9, 2, 8, 1, 1, 0.0f, {9, 4, 1, 0}, 0},   /* decoder self-attention */
    {3, 9, 9, 2, 8, 1, 1, 0.1f, {9, 4, 1, 0}, 0},
    {2, 5, 11, 4, 4, 0, 0, 0.2f, {11, 3, 0, 0}, 0},  /* cross-attention, q and kv buffers */
    {4, 7, 7, 2, 16, 0, 1, 0.0f, {7, 7, 2, 5}, 0},   /* encoder self-attention, padding */
    {4, 40, 40, 8, 64, 0, 1, 0.1f, {40, 33, 17, 1}, 0}, /* base-model head shape */
    {1, 1, 6, 1, 3, 1, 0, 0.0f, {6, 0, 0, 0}, 0},   /* one query (greedy step) */
    {3, 6, 10, 4, 8, 0, 0, 0.1f, {10, 7, 2, 0}, 1}, /* backward of dq alone */
    {3, 6, 10, 4, 8, 0, 0, 0.1f, {10, 7, 2, 0}, 2}, /* dkey alone */
    {3, 6, 10, 4, 8, 0, 0, 0.1f, {10, 7, 2, 0}, 3}, /* dv alone */
};

NMT_TG_TEST(cuda_attention_matches_ref) {
  for (size_t i = 0; i < sizeof att_cases / sizeof *att_cases; i++) {
    attention_case(g, &att_cases[i], 1e-4, 300 + 10 * i);
    if (nmt_test_failed()) return;
  }
}

NMT_TG_TEST(cuda_attention_tf32_matches_ref) {
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_TF32));
  for (size_t i = 0; i < sizeof att_cases / sizeof *att_cases; i++) {
    attention_case(g, &att_cases[i], 1e-3, 400 + 10 * i);
    if (nmt_test_failed()) return;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* attention_half_fwd / _bwd (the half-storage path, nmt/backend.h), in fp16 and bf16. q, k, v
 * and dout are half; the op is the fp32 op on their values with one rounding per stored
 * element. Two references:
 *  - the device's own fp32 op on the decoded inputs (the same layouts): the half op runs the
 *    same GEMMs and row kernels on the same fp32 head-major copies, so its probabilities must
 *    EQUAL the fp32 op's and every half output be the reference rounding of the fp32 op's
 *    output (out; dq, dkey, dv accumulated into zeros), bit for bit: this pins the rounding
 *    sites and the "written, not added" gradients;
 *  - the CPU reference's half op: probabilities within rtol 1e-4 (as the fp32 op's test), half
 *    outputs within one half ulp or rtol 1e-4 of the array's largest (the fp32 values differ by
 *    GEMM rounding noise; elements much smaller than the largest carry it as absolute error),
 *    at least 80% of them equal.
 * Shapes: T in {1, 31, 40, 64, 65}; self-attention on one fused QKV buffer and cross-attention
 * (Tq != Tk) on separate q and kv buffers, every buffer with 4 spare columns per row that no
 * gradient may write (poisoned, checked); causal and key-padding masks; dropout on the weights;
 * the base model's head shape (8 x 64); backward passes asked for one gradient. The GEMM calls
 * are the fp32 op's; two runs give the same bits; no scratch growth after the plan's reserve. */

typedef struct {
  int B, Tq, Tk, H, dk, causal, fused;
  float p;
  int32_t lens[4];
  int only; /* backward: only dq (1), dkey (2) or dv (3); 0: all three */
} ah_case;

static const ah_case ah_cases[] = {
    /* B, Tq, Tk, H, dk, causal, fused, p, k_lens, only */
    {3, 31, 31, 2, 8, 1, 1, 0.1f, {31, 17, 1, 0}, 0},   /* decoder self-attention */
    {2, 40, 40, 8, 64, 0, 1, 0.1f, {40, 33, 0, 0}, 0},  /* the base model's heads */
    {2, 64, 64, 4, 16, 1, 1, 0.0f, {64, 50, 0, 0}, 0},
    {2, 65, 65, 2, 32, 0, 1, 0.1f, {65, 1, 0, 0}, 0},
    {4, 1, 1, 2, 8, 1, 1, 0.0f, {1, 1, 1, 1}, 0},       /* T = 1 */
    {3, 1, 31, 4, 8, 0, 0, 0.0f, {31, 5, 12, 0}, 0},    /* one query (a decoding step) */
    {3, 40, 65, 8, 16, 0, 0, 0.2f, {65, 12, 40, 0}, 0}, /* cross-attention, Tq != Tk */
    {3, 6, 10, 4, 8, 0, 0, 0.1f, {10, 7, 2, 0}, 1},     /* dq alone */
    {3, 6, 10, 4, 8, 0, 0, 0.1f, {10, 7, 2, 0}, 2},     /* dkey alone */
    {3, 6, 10, 4, 8, 0, 0, 0.1f, {10, 7, 2, 0}, 3},     /* dv alone */
};

enum { AH_SPARE = 4 }; /* spare columns per row of every q / kv buffer */

/* x (expected values, n) = NaN (the poison stays) except rows r < rows, columns [c0, c0 + C)
 * of rows ld apart, which take src (same layout). */
static void ah_expect(float *x, const float *src, int rows, int ld, int c0, int C) {
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < C; c++) x[(size_t)r * ld + c0 + c] = src[(size_t)r * ld + c0 + c];
}

static void ah_case_run(nmt_tg_gpu *g, nmt_precision mode, void *rc, const ah_case *a,
                        uint64_t seed) {
  char what[200];
  const int B = a->B, Tq = a->Tq, Tk = a->Tk, H = a->H, dk = a->dk, C = H * dk;
  const int ldq = a->fused ? 3 * C + AH_SPARE : C + AH_SPARE;
  const int ldkv = a->fused ? ldq : 2 * C + AH_SPARE;
  const size_t nq = (size_t)B * Tq * ldq, nkv = a->fused ? nq : (size_t)B * Tk * ldkv;
  const size_t no = (size_t)B * Tq * C, np = (size_t)B * H * Tq * Tk;
  const size_t ko = a->fused ? (size_t)C : 0, vo = a->fused ? 2 * (size_t)C : (size_t)C;
  const uint64_t dseed = 777 + seed, dstream = nmt_rng_stream(4, 19);
  const char *mn = nmt_tg_half_bf16(mode) ? "bf16" : "fp16";
  snprintf(what, sizeof what, "%s B=%d Tq=%d Tk=%d H=%d dk=%d causal=%d %s p=%g only=%d", mn, B,
           Tq, Tk, H, dk, a->causal, a->fused ? "fused" : "cross", (double)a->p, a->only);
  char w2[300];
  /* Inputs: half bits, and their values for the fp32 runs. */
  uint16_t *qh = nmt_tg_half_encode(g, mode, nmt_tg_randn(g, nq, seed, 0.5f, 0.0f), nq);
  uint16_t *kvh =
      a->fused ? qh : nmt_tg_half_encode(g, mode, nmt_tg_randn(g, nkv, seed + 1, 0.5f, 0.0f), nkv);
  uint16_t *douth = nmt_tg_half_encode(g, mode, nmt_tg_randn(g, no, seed + 2, 1.0f, 0.0f), no);
  float *qd = nmt_tg_half_decode(g, mode, qh, nq), *kvd = nmt_tg_half_decode(g, mode, kvh, nkv),
        *doutd = nmt_tg_half_decode(g, mode, douth, no);
  uint16_t *want_o = nmt_tg_halloc(g, no * 2), *want_dq = nmt_tg_halloc(g, nq * 2),
           *want_dkv = nmt_tg_halloc(g, nkv * 2);
  float *want_p = nmt_tg_halloc(g, np * 4), *ref_dp = nmt_tg_halloc(g, np * 4);
  float *ex_q = nmt_tg_halloc(g, nq * 4), *ex_kv = nmt_tg_halloc(g, nkv * 4);
  NMT_TG_SETUP_OK();
  int32_t *d_lens = nmt_tg_dup_dev(g, a->lens, (size_t)B * 4);
  uint16_t *d_qh = nmt_tg_dup_dev(g, qh, nq * 2),
           *d_kvh = a->fused ? d_qh : nmt_tg_dup_dev(g, kvh, nkv * 2);
  uint16_t *d_douth = nmt_tg_dup_dev(g, douth, no * 2);
  float *d_qd = nmt_tg_dup_dev(g, qd, nq * 4),
        *d_kvd = a->fused ? d_qd : nmt_tg_dup_dev(g, kvd, nkv * 4);
  float *d_doutd = nmt_tg_dup_dev(g, doutd, no * 4);
  uint16_t *d_o = nmt_tg_dalloc(g, no * 2), *d_o2 = nmt_tg_dalloc(g, no * 2);
  float *d_o32 = nmt_tg_dalloc(g, no * 4), *d_p = nmt_tg_dalloc(g, np * 4),
        *d_p2 = nmt_tg_dalloc(g, np * 4), *d_p32 = nmt_tg_dalloc(g, np * 4),
        *d_dp = nmt_tg_dalloc(g, np * 4);
  /* Gradients: half (poisoned) twice, fp32 (zeros) once; fused: the three share one buffer. */
  uint16_t *d_gq[2], *d_gkv[2];
  for (int i = 0; i < 2; i++) {
    d_gq[i] = nmt_tg_dalloc(g, nq * 2);
    d_gkv[i] = a->fused ? d_gq[i] : nmt_tg_dalloc(g, nkv * 2);
  }
  float *d_gq32 = nmt_tg_dalloc(g, nq * 4),
        *d_gkv32 = a->fused ? d_gq32 : nmt_tg_dalloc(g, nkv * 4);
  NMT_TG_SETUP_OK();
  nmt_tg_half_poison(g, d_o, no);
  nmt_tg_half_poison(g, d_o2, no);
  nmt_tg_poison(g, d_p, np);
  nmt_tg_poison(g, d_p2, np);
  nmt_tg_poison(g, d_p32, np);
  for (int i = 0; i < 2; i++) {
    nmt_tg_half_poison(g, d_gq[i], nq);
    if (!a->fused) nmt_tg_half_poison(g, d_gkv[i], nkv);
  }
  NMT_ASSERT_OK(g->be->memset_zero(g->ctx, d_gq32, nq * 4));
  if (!a->fused) NMT_ASSERT_OK(g->be->memset_zero(g->ctx, d_gkv32, nkv * 4));
  for (size_t i = 0; i < nq; i++) want_dq[i] = 0xffff;
  for (size_t i = 0; i < nkv; i++) want_dkv[i] = 0xffff;
  nmt_backend_counters c0, c1, c2;
  NMT_ASSERT_OK(g->be->counters(g->ctx, &c0));

  /* Forward: half twice, fp32 on the values once. */
  for (int run = 0; run < 2; run++)
    NMT_ASSERT_OK(g->be->attention_half_fwd(g->ctx, run ? d_o2 : d_o, run ? d_p2 : d_p, d_qh, ldq,
                                            d_kvh + ko, d_kvh + vo, ldkv, d_lens, B, Tq, Tk, H,
                                            dk, a->causal, a->p, dseed, dstream));
  NMT_ASSERT_OK(g->be->counters(g->ctx, &c1));
  NMT_ASSERT_EQ_INT(c1.gemm_calls - c0.gemm_calls, 4); /* 2 per call: scores, weighted sum */
  NMT_ASSERT_OK(g->be->attention_fwd(g->ctx, d_o32, d_p32, d_qd, ldq, d_kvd + ko, d_kvd + vo,
                                     ldkv, d_lens, B, Tq, Tk, H, dk, a->causal, a->p, dseed,
                                     dstream));
  NMT_ASSERT_OK(nmt_ref_attention_half_fwd(rc, want_o, want_p, qh, ldq, kvh + ko, kvh + vo, ldkv,
                                           a->lens, B, Tq, Tk, H, dk, a->causal, a->p, dseed,
                                           dstream));
  const float *h_p = nmt_tg_fetch(g, d_p, np * 4), *h_o32 = nmt_tg_fetch(g, d_o32, no * 4);
  const uint16_t *h_o = nmt_tg_fetch(g, d_o, no * 2), *h_o2 = nmt_tg_fetch(g, d_o2, no * 2);
  NMT_TG_SETUP_OK();
  snprintf(w2, sizeof w2, "attention_half_fwd probs vs the fp32 op, %s", what);
  NMT_TG_EXACT(w2, h_p, nmt_tg_fetch(g, d_p32, np * 4), np);
  snprintf(w2, sizeof w2, "attention_half_fwd out = round(the fp32 op's out), %s", what);
  if (!nmt_tg_same_half(mode, w2, h_o, h_o32, no)) return;
  snprintf(w2, sizeof w2, "attention_half_fwd probs vs the reference, %s", what);
  NMT_TG_CLOSE(w2, h_p, want_p, np, 1e-4);
  snprintf(w2, sizeof w2, "attention_half_fwd out vs the reference, %s", what);
  if (!NMT_TG_HALF_CLOSE(mode, w2, h_o, want_o, no, 1e-4, 0.8)) return;
  NMT_TG_EXACT("attention_half_fwd probs, second run", nmt_tg_fetch(g, d_p2, np * 4), h_p, np);
  NMT_ASSERT(memcmp(h_o2, h_o, no * 2) == 0);

  /* Backward: half twice (from the half forward's probs), fp32 on the values into zeros. */
  uint16_t *gq[2], *gk[2], *gv[2];
  for (int i = 0; i < 2; i++) {
    gq[i] = a->only == 0 || a->only == 1 ? d_gq[i] : NULL;
    gk[i] = a->only == 0 || a->only == 2 ? d_gkv[i] + ko : NULL;
    gv[i] = a->only == 0 || a->only == 3 ? d_gkv[i] + vo : NULL;
    NMT_ASSERT_OK(g->be->attention_half_bwd(g->ctx, gq[i], gk[i], gv[i], d_dp, d_douth, d_p, d_qh,
                                            ldq, d_kvh + ko, d_kvh + vo, ldkv, d_lens, B, Tq, Tk,
                                            H, dk, a->causal, a->p, dseed, dstream));
  }
  NMT_ASSERT_OK(g->be->counters(g->ctx, &c2));
  const long launches = a->only == 0 ? 4 : a->only == 3 ? 1 : 2; /* as attention_bwd */
  /* Since c1: the fp32 forward (2) and the two half backwards. */
  NMT_ASSERT_EQ_INT(c2.gemm_calls - c1.gemm_calls, 2 * launches + 2);
  NMT_ASSERT_OK(g->be->attention_bwd(g->ctx, gq[0] ? d_gq32 : NULL, gk[0] ? d_gkv32 + ko : NULL,
                                     gv[0] ? d_gkv32 + vo : NULL, d_dp, d_doutd, d_p32, d_qd, ldq,
                                     d_kvd + ko, d_kvd + vo, ldkv, d_lens, B, Tq, Tk, H, dk,
                                     a->causal, a->p, dseed, dstream));
  NMT_ASSERT_OK(nmt_ref_attention_half_bwd(
      rc, gq[0] ? want_dq : NULL, gk[0] ? (a->fused ? want_dq : want_dkv) + ko : NULL,
      gv[0] ? (a->fused ? want_dq : want_dkv) + vo : NULL, ref_dp, douth, want_p, qh, ldq,
      kvh + ko, kvh + vo, ldkv, a->lens, B, Tq, Tk, H, dk, a->causal, a->p, dseed, dstream));
  const float *h_gq32 = nmt_tg_fetch(g, d_gq32, nq * 4),
              *h_gkv32 = a->fused ? h_gq32 : nmt_tg_fetch(g, d_gkv32, nkv * 4);
  const uint16_t *h_gq = nmt_tg_fetch(g, d_gq[0], nq * 2),
                 *h_gkv = a->fused ? h_gq : nmt_tg_fetch(g, d_gkv[0], nkv * 2);
  const uint16_t *h_gq2 = nmt_tg_fetch(g, d_gq[1], nq * 2),
                 *h_gkv2 = a->fused ? h_gq2 : nmt_tg_fetch(g, d_gkv[1], nkv * 2);
  NMT_TG_SETUP_OK();
  /* The expected values: the fp32 op's gradient in the written head columns, poison elsewhere
   * (the spare columns, and the slices of gradients not asked for). */
  for (size_t i = 0; i < nq; i++) ex_q[i] = NAN;
  for (size_t i = 0; i < nkv; i++) ex_kv[i] = NAN;
  float *ex_k = a->fused ? ex_q : ex_kv;
  if (gq[0]) ah_expect(ex_q, h_gq32, B * Tq, ldq, 0, C);
  if (gk[0]) ah_expect(ex_k, h_gkv32, B * Tk, ldkv, (int)ko, C);
  if (gv[0]) ah_expect(ex_k, h_gkv32, B * Tk, ldkv, (int)vo, C);
  snprintf(w2, sizeof w2, "attention_half_bwd %s = round(the fp32 op's gradient), %s",
           a->fused ? "dqkv" : "dq", what);
  if (!nmt_tg_same_half(mode, w2, h_gq, ex_q, nq)) return;
  for (size_t i = 0; i < nq; i++) /* unwritten elements kept their poison exactly */
    if (isnan(ex_q[i])) NMT_ASSERT(h_gq[i] == 0xffff);
  if (!a->fused) {
    snprintf(w2, sizeof w2, "attention_half_bwd dkv = round(the fp32 op's gradient), %s", what);
    if (!nmt_tg_same_half(mode, w2, h_gkv, ex_kv, nkv)) return;
    for (size_t i = 0; i < nkv; i++)
      if (isnan(ex_kv[i])) NMT_ASSERT(h_gkv[i] == 0xffff);
  }
  snprintf(w2, sizeof w2, "attention_half_bwd %s vs the reference, %s", a->fused ? "dqkv" : "dq",
           what);
  if (!NMT_TG_HALF_CLOSE(mode, w2, h_gq, want_dq, nq, 1e-4, 0.8)) return;
  if (!a->fused) {
    snprintf(w2, sizeof w2, "attention_half_bwd dkv vs the reference, %s", what);
    if (!NMT_TG_HALF_CLOSE(mode, w2, h_gkv, want_dkv, nkv, 1e-4, 0.8)) return;
  }
  NMT_ASSERT(memcmp(h_gq2, h_gq, nq * 2) == 0); /* two runs, the same bits */
  NMT_ASSERT(memcmp(h_gkv2, h_gkv, nkv * 2) == 0);
  /* The test can fail: the gradients asked for are not all zero. */
  NMT_ASSERT(nmt_tg_max_abs(h_gq32, nq) > 0.0 || !gq[0]);
  NMT_ASSERT(nmt_tg_max_abs(h_gkv32, nkv) > 0.0 || (!gk[0] && !gv[0]));
}

static void ah_mode(nmt_tg_gpu *g, nmt_precision mode) {
  const size_t n_cases = sizeof ah_cases / sizeof *ah_cases;
  nmt_scratch_plan plan;
  memset(&plan, 0, sizeof plan);
  plan.main.half_acts = 1;
  for (size_t i = 0; i < n_cases; i++) {
    const ah_case *a = &ah_cases[i];
    const size_t C = (size_t)a->H * a->dk, q = (size_t)a->B * a->Tq * C;
    const size_t kv = (size_t)a->B * a->Tk * C, sc = (size_t)a->B * a->H * a->Tq * a->Tk;
    plan.main.att_q = q > plan.main.att_q ? q : plan.main.att_q;
    plan.main.att_kv = kv > plan.main.att_kv ? kv : plan.main.att_kv;
    if (a->p > 0.0f) plan.main.att_scores = sc > plan.main.att_scores ? sc : plan.main.att_scores;
  }
  void *rc = nmt_tg_half_twin(g, mode, &plan);
  if (!rc) return;
  nmt_backend_counters c0, c1;
  NMT_ASSERT_OK(g->be->counters(g->ctx, &c0));
  for (size_t i = 0; i < n_cases; i++) {
    ah_case_run(g, mode, rc, &ah_cases[i], 500 + 10 * i + 1000 * (uint64_t)nmt_tg_half_bf16(mode));
    if (nmt_test_failed()) break;
  }
  nmt_ref_ctx_destroy(rc);
  if (nmt_test_failed()) return;
  NMT_ASSERT_OK(g->be->counters(g->ctx, &c1));
  NMT_ASSERT_EQ_INT(c1.scratch_growths - c0.scratch_growths, 0);
}

NMT_TG_TEST(cuda_attention_half_fp16_matches_ref) { ah_mode(g, NMT_PRECISION_FP16); }
NMT_TG_TEST(cuda_attention_half_bf16_matches_ref) { ah_mode(g, NMT_PRECISION_BF16); }

/* The arguments the half ops refuse, as the fp32 ops and the reference: bad shapes, strides
 * below H*dk, p outside [0, 1), and an fp32 context. */
NMT_TG_TEST(cuda_attention_half_refuses_misuse) {
  uint16_t *h = nmt_tg_dalloc(g, 4096);
  float *f = nmt_tg_dalloc(g, 4096);
  int32_t lens[2] = {4, 4};
  int32_t *d_lens = nmt_tg_dup_dev(g, lens, sizeof lens);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_BF16));
  NMT_ASSERT_EQ_STATUS(g->be->attention_half_fwd(g->ctx, h, f, h, 8, h, h, 8, d_lens, 2, 4, 0, 2,
                                                 4, 0, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL); /* Tk = 0 */
  NMT_ASSERT_EQ_STATUS(g->be->attention_half_fwd(g->ctx, h, f, h, 7, h, h, 8, d_lens, 2, 4, 4, 2,
                                                 4, 0, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL); /* ldq < H*dk */
  NMT_ASSERT_EQ_STATUS(g->be->attention_half_bwd(g->ctx, h, h, h, f, h, f, h, 8, h, h, 8, d_lens,
                                                 2, 4, 4, 2, 4, 0, 1.0f, 1, 2),
                       NMT_ERR_INTERNAL); /* p = 1 */
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_FP32));
  NMT_ASSERT_EQ_STATUS(g->be->attention_half_fwd(g->ctx, h, f, h, 8, h, h, 8, d_lens, 2, 4, 4, 2,
                                                 4, 0, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->attention_half_bwd(g->ctx, h, h, h, f, h, f, h, 8, h, h, 8, d_lens,
                                                 2, 4, 4, 2, 4, 0, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
}
