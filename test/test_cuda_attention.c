/* test/test_cuda_attention.c — multi-head attention (cuda/attention.cu) against the reference
 * (src/ref/attention.c), forward (probabilities and output) and backward: fused QKV and
 * separate q / kv buffers, causal and key-padding masks, dropout on the weights, the base
 * model's head shape, a single query, and backward passes asked for one gradient only; rtol
 * 1e-4 in fp32 and 1e-3 with TF32 GEMMs (NMT_TG_CLOSE, test/gpu_helpers.h). The backward
 * makes one batched cuBLASLt launch per product (the context's counter). */
#include <stdint.h>
#include <stdio.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
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
