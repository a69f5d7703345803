/* test/test_cuda_scratch.c — issue 15 on the device (cuda/context.cu, cuda/gemm.cu):
 * reserve_scratch sizes every buffer an op uses (op scratch, 16-bit GEMM copies, the ones
 * vector, each aux stream's pair, also for a pool made after the reservation) so that ops
 * within the plan never grow one, while a call beyond it grows and is counted; the launch
 * counter counts one per cuBLASLt call (attention: 2 forward, 4 backward); and the GEMM cache,
 * whose heuristic is asked per size BUCKET and checked per shape, still runs each shape with
 * one algorithm whatever order the shapes come in (bitwise equal outputs from two contexts
 * that see them in opposite orders), matching the reference. Harness and skip:
 * test/gpu_helpers.h (these tests make their own contexts, for their counters). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/ref.h"
#include "test.h"

enum { M = 256, C = 512, F = 1536, H = 8, DK = 64, B = 4, T = 32 };

/* Every op with scratch, within the plan: no growth; 14 GEMM launches. Then one attention
 * beyond the plan: a growth. */
NMT_TG_TEST(cuda_scratch_reserve_covers_ops) {
  const nmt_backend *be = g->be;
  void *ctx = NULL;
  NMT_ASSERT_OK(be->ctx_create(0, &ctx));
  nmt_scratch_plan plan;
  memset(&plan, 0, sizeof plan);
  plan.main = (nmt_scratch_need){.gemm_rows = M, .gemm_inp = (size_t)M * C,
                                 .gemm_w = (size_t)F * C, .gemm_out = (size_t)M * F,
                                 .att_q = (size_t)B * T * C, .att_kv = (size_t)B * T * C,
                                 .att_scores = (size_t)B * H * T * T, .emb_rows = M, .width = C};
  plan.aux = (nmt_scratch_need){.gemm_rows = M, .gemm_inp = (size_t)M * C,
                                .gemm_w = (size_t)C * C, .gemm_out = (size_t)M * C};
  float *x = nmt_tg_randn(g, (size_t)M * F, 1, 1.0f, 0.0f), *w = nmt_tg_randn(g, (size_t)F * C, 2, 0.05f, 0.0f);
  int32_t *ids = nmt_tg_halloc(g, M * 4), *lens = nmt_tg_halloc(g, B * 4);
  NMT_TG_SETUP_OK();
  for (int i = 0; i < M; i++) ids[i] = i % 7; /* PAD rows and repeats */
  for (int b = 0; b < B; b++) lens[b] = T - b;
  float *d_x = nmt_tg_dup_dev(g, x, (size_t)M * F * 4), *d_w = nmt_tg_dup_dev(g, w, (size_t)F * C * 4);
  float *d_b = nmt_tg_dup_dev(g, x, F * 4), *d_y = nmt_tg_dalloc(g, (size_t)M * F * 4);
  float *d_dx = nmt_tg_dalloc(g, (size_t)M * F * 4), *d_dw = nmt_tg_dalloc(g, (size_t)F * C * 4);
  float *d_db = nmt_tg_dalloc(g, F * 4), *d_p = nmt_tg_dalloc(g, (size_t)B * H * T * T * 4);
  float *d_dp = nmt_tg_dalloc(g, (size_t)B * H * T * T * 4), *d_s = nmt_tg_dalloc(g, 64);
  float *d_big = nmt_tg_dalloc(g, (size_t)B * H * 4 * T * T * 4);
  int32_t *d_ids = nmt_tg_dup_dev(g, ids, M * 4), *d_lens = nmt_tg_dup_dev(g, lens, B * 4);
  NMT_TG_SETUP_OK();
  nmt_backend_counters c0 = {0}, c1 = {0}, c2 = {0};
  nmt_status st = be->set_precision(ctx, NMT_PRECISION_FP16);
  if (st == NMT_OK) st = be->reserve_scratch(ctx, &plan);
  if (st == NMT_OK) st = be->stream_pool(ctx, 2); /* after the reservation: sized from the plan */
  if (st == NMT_OK) st = be->counters(ctx, &c0);
  /* linear forward and backward, 16-bit copies (M, C) x (F, C) */
  if (st == NMT_OK) st = be->matmul_fwd(ctx, d_y, d_x, d_w, d_b, M, C, F);
  if (st == NMT_OK) st = be->matmul_bwd(ctx, d_dx, d_dw, d_db, d_y, d_x, d_w, M, C, F);
  /* attention with dropout: q, k, v slices of one (B*T, 3C) buffer (d_x holds M*F >= B*T*3C) */
  if (st == NMT_OK)
    st = be->attention_fwd(ctx, d_y, d_p, d_x, 3 * C, d_x + C, d_x + 2 * C, 3 * C, d_lens, B, T, T,
                           H, DK, 1, 0.1f, 3, 4);
  if (st == NMT_OK)
    st = be->attention_bwd(ctx, d_dx, d_dx + C, d_dx + 2 * C, d_dp, d_y, d_p, d_x, 3 * C, d_x + C,
                           d_x + 2 * C, 3 * C, d_lens, B, T, T, H, DK, 1, 0.1f, 3, 4);
  if (st == NMT_OK) st = be->layernorm_bwd(ctx, d_dx, d_db, d_db + C, d_y, d_x, d_w, d_x, d_x, M, C);
  if (st == NMT_OK) st = be->layernorm_bwd(ctx, d_dx, d_db, d_db + C, d_y, d_x, d_w, d_x, d_x, 3, C);
  if (st == NMT_OK) st = be->embedding_bwd(ctx, d_dw, d_y, d_ids, M, C, 2.0f);
  if (st == NMT_OK) st = be->embedding_bwd(ctx, d_dw, d_y, d_ids, 10, C, 2.0f);
  if (st == NMT_OK) st = be->sumsq(ctx, d_s, d_x, (size_t)M * F);
  /* an aux stream's linear layer (C x C) */
  if (st == NMT_OK) st = be->stream_fork(ctx);
  if (st == NMT_OK) st = be->stream_use(ctx, 1);
  if (st == NMT_OK) st = be->matmul_fwd(ctx, d_y, d_x, d_w, d_b, M, C, C);
  if (st == NMT_OK) st = be->matmul_bwd(ctx, d_dx, d_dw, d_db, d_y, d_x, d_w, M, C, C);
  if (st == NMT_OK) st = be->stream_join(ctx);
  if (st == NMT_OK) st = be->synchronize(ctx);
  if (st == NMT_OK) st = be->counters(ctx, &c1);
  /* twice the length of the plan's sentences: the attention scratch must grow */
  if (st == NMT_OK)
    st = be->attention_fwd(ctx, d_y, d_big, d_x, C, d_x, d_x, C, d_lens, B, 2 * T, 2 * T, H, DK, 0,
                           0.1f, 3, 4);
  if (st == NMT_OK) st = be->synchronize(ctx);
  if (st == NMT_OK) st = be->counters(ctx, &c2);
  be->ctx_destroy(ctx);
  NMT_ASSERT_OK(st);
  NMT_ASSERT_EQ_INT(c1.scratch_growths - c0.scratch_growths, 0);
  /* matmul 1 + 3, attention 2 + 4, aux matmul 1 + 3 */
  NMT_ASSERT_EQ_INT(c1.gemm_calls - c0.gemm_calls, 14);
  NMT_ASSERT(c2.scratch_growths - c1.scratch_growths >= 1);
  NMT_ASSERT_EQ_INT(c2.gemm_calls - c1.gemm_calls, 2);
}

/* Linear layers of token counts in one size bucket (300..320 -> 320) and the next (333), and
 * attention over varying B and T, run on two fresh contexts in opposite orders: every output
 * is bitwise the same (the algorithm is a function of the exact shape, not of the shape the
 * bucket met first) and matches the reference (rtol 1e-4 fp32, 1e-3 tf32). */
static void order_case(nmt_tg_gpu *g, nmt_precision mode, double rtol) {
  enum { NS = 5, NA = 3 };
  static const int rows[NS] = {300, 301, 317, 320, 333};
  static const int att[NA][2] = {{3, 17}, {5, 20}, {2, 31}}; /* B, T */
  const nmt_backend *be = g->be;
  float *x = nmt_tg_randn(g, (size_t)400 * C, 11, 1.0f, 0.0f),
        *w = nmt_tg_randn(g, (size_t)C * C, 12, 0.05f, 0.0f);
  float *want = nmt_tg_halloc(g, (size_t)400 * C * 4);
  int32_t *lens = nmt_tg_halloc(g, 8 * 4);
  NMT_TG_SETUP_OK();
  float *d_x = nmt_tg_dup_dev(g, x, (size_t)400 * C * 4), *d_w = nmt_tg_dup_dev(g, w, (size_t)C * C * 4);
  float *out[2][NS + NA], *d_p = nmt_tg_dalloc(g, (size_t)8 * H * 32 * 32 * 4);
  for (int i = 0; i < 8; i++) lens[i] = 17 - i;
  int32_t *d_lens = nmt_tg_dup_dev(g, lens, 8 * 4);
  for (int r = 0; r < 2; r++)
    for (int i = 0; i < NS + NA; i++) out[r][i] = nmt_tg_dalloc(g, (size_t)400 * C * 4);
  NMT_TG_SETUP_OK();
  for (int r = 0; r < 2 && !nmt_test_failed(); r++) {
    void *ctx = NULL;
    NMT_ASSERT_OK(be->ctx_create(0, &ctx));
    nmt_status st = be->set_precision(ctx, mode);
    for (int j = 0; j < NS + NA && st == NMT_OK; j++) {
      const int i = r == 0 ? j : NS + NA - 1 - j;
      if (i < NS) {
        st = be->matmul_fwd(ctx, out[r][i], d_x, d_w, NULL, rows[i], C, C);
      } else {
        const int b = att[i - NS][0], t = att[i - NS][1];
        st = be->attention_fwd(ctx, out[r][i], d_p, d_x, 3 * C, d_x + C, d_x + 2 * C, 3 * C,
                               d_lens, b, t, t, H, DK, 0, 0.0f, 1, 2);
      }
    }
    if (st == NMT_OK) st = be->synchronize(ctx);
    be->ctx_destroy(ctx);
    NMT_ASSERT_OK(st);
  }
  char what[96];
  for (int i = 0; i < NS + NA; i++) {
    const size_t n = i < NS ? (size_t)rows[i] * C
                            : (size_t)att[i - NS][0] * att[i - NS][1] * C;
    snprintf(what, sizeof what, "%s output %d, two orders", mode == NMT_PRECISION_TF32 ? "tf32" : "fp32", i);
    const float *a = nmt_tg_fetch(g, out[0][i], n * 4);
    NMT_TG_EXACT(what, nmt_tg_fetch(g, out[1][i], n * 4), a, n);
    if (i < NS) {
      NMT_ASSERT_OK(nmt_ref_matmul_fwd(NULL, want, x, w, NULL, rows[i], C, C));
      snprintf(what, sizeof what, "matmul_fwd M=%d vs ref", rows[i]);
      NMT_TG_CLOSE(what, a, want, n, rtol);
    }
  }
}

NMT_TG_TEST(cuda_gemm_algo_fixed_per_shape_fp32) { order_case(g, NMT_PRECISION_FP32, 1e-4); }
NMT_TG_TEST(cuda_gemm_algo_fixed_per_shape_tf32) { order_case(g, NMT_PRECISION_TF32, 1e-3); }
