/* test/test_cuda_reductions.c — the reductions (cuda/reductions.cu: sum_acc, sumsq, argmax;
 * count_targets, whose launcher is in cuda/step.cu) against the reference
 * (src/ref/reductions.c), and the bitwise repeatability of every op that reduces (embedding
 * and LayerNorm backward, sumsq). Harness: test/gpu_helpers.h. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

NMT_TG_TEST(cuda_sums_match_ref) {
  const size_t sizes[4] = {0, 1, 1000, 1000003};
  for (int k = 0; k < 4; k++) {
    const size_t n = sizes[k];
    float *x = nmt_tg_randn(g, n ? n : 1, 61 + k, 1.0f, 0.25f);
    NMT_TG_SETUP_OK();
    float *d_x = nmt_tg_dup_dev(g, x, (n ? n : 1) * 4), *d_s = nmt_tg_dalloc(g, 8);
    NMT_TG_SETUP_OK();
    float start[2] = {1.5f, NAN}, got[2], want[2] = {1.5f, 0};
    NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_s, start, 8));
    NMT_ASSERT_OK(g->be->sum_acc(g->ctx, d_s, d_x, n));
    NMT_ASSERT_OK(g->be->sumsq(g->ctx, d_s + 1, d_x, n));
    NMT_ASSERT_OK(g->be->copy_d2h(g->ctx, got, d_s, 8));
    NMT_ASSERT_OK(nmt_ref_sum_acc(NULL, &want[0], x, n));
    NMT_ASSERT_OK(nmt_ref_sumsq(NULL, &want[1], x, n));
    char what[64];
    snprintf(what, sizeof what, "sum_acc, sumsq n=%zu", n);
    /* Both sum in double: equal up to the final rounding. */
    NMT_ASSERT_CLOSE(what, got, want, 2, 1e-6, 1e-6);
  }
}

NMT_TG_TEST(cuda_argmax_matches_ref) {
  const int M = 9, V = 1031;
  float *x = nmt_tg_randn(g, (size_t)M * V, 71, 1.0f, 0.0f);
  NMT_TG_SETUP_OK();
  /* Row 1: a tie (first index wins); row 2: NaNs around the max; row 3: all NaN (-> 0);
   * row 4: +0 and -0 only; row 5: max at the last index. */
  x[1 * V + 10] = x[1 * V + 700] = 50.0f;
  for (int j = 0; j < V; j += 3) x[2 * V + j] = NAN;
  x[2 * V + 500] = 40.0f;
  for (int j = 0; j < V; j++) x[3 * V + j] = NAN;
  for (int j = 0; j < V; j++) x[4 * V + j] = (j & 1) ? -0.0f : 0.0f;
  x[5 * V + V - 1] = 99.0f;
  int32_t want[9], got[9];
  float *d_x = nmt_tg_dup_dev(g, x, (size_t)M * V * 4);
  int32_t *d_out = nmt_tg_dalloc(g, M * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->argmax(g->ctx, d_out, d_x, M, V));
  NMT_ASSERT_OK(g->be->copy_d2h(g->ctx, got, d_out, sizeof got));
  NMT_ASSERT_OK(nmt_ref_argmax(NULL, want, x, M, V));
  for (int r = 0; r < M; r++) NMT_ASSERT_EQ_INT(got[r], want[r]);
  NMT_ASSERT_EQ_INT(got[1], 10);
  NMT_ASSERT_EQ_INT(got[3], 0);
}

NMT_TG_TEST(cuda_count_targets_matches_ref) {
  const size_t sizes[4] = {0, 1, 1000, 100003};
  for (int k = 0; k < 4; k++) {
    const size_t n = sizes[k];
    int32_t *t = nmt_tg_halloc(g, (n ? n : 1) * 4);
    NMT_TG_SETUP_OK();
    size_t count = 0;
    for (size_t i = 0; i < n; i++) {
      const uint32_t u = nmt_rng_u32(13, (uint64_t)k, i);
      t[i] = u % 4 == 0 ? NMT_PAD_ID : (int32_t)(1 + u % 30000);
      count += t[i] != NMT_PAD_ID;
    }
    int32_t *d_t = nmt_tg_dup_dev(g, t, (n ? n : 1) * 4);
    const float start = 5.0f;
    float *d_s = nmt_tg_dup_dev(g, &start, 4);
    NMT_TG_SETUP_OK();
    /* Two micro-batches into one slot, as the model counts them. */
    float got = NAN, want = start;
    NMT_ASSERT_OK(g->be->count_targets(g->ctx, d_s, d_t, n));
    NMT_ASSERT_OK(g->be->count_targets(g->ctx, d_s, d_t, n));
    NMT_ASSERT_OK(g->be->copy_d2h(g->ctx, &got, d_s, 4));
    NMT_ASSERT_OK(nmt_ref_count_targets(NULL, &want, t, n));
    NMT_ASSERT_OK(nmt_ref_count_targets(NULL, &want, t, n));
    char what[64];
    snprintf(what, sizeof what, "count_targets n=%zu", n);
    NMT_TG_EXACT(what, &got, &want, 1);
    NMT_ASSERT_EQ_INT((long long)got, 5 + 2 * (long long)count);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* repeatability */

/* The ops with reductions give bitwise the same result when run twice. */
NMT_TG_TEST(cuda_reductions_are_repeatable) {
  const int n_rows = 5000, C = 64, V = 7, M = 2000;
  const size_t no = (size_t)n_rows * C;
  int32_t *ids = nmt_tg_halloc(g, (size_t)n_rows * 4);
  NMT_TG_SETUP_OK();
  for (int r = 0; r < n_rows; r++) ids[r] = (int32_t)(nmt_rng_u32(3, 3, (uint64_t)r) % V);
  float *dout = nmt_tg_randn(g, no, 101, 1.0f, 0.0f),
        *x = nmt_tg_randn(g, (size_t)M * C, 102, 1.0f, 0.0f);
  float *gam = nmt_tg_randn(g, C, 103, 1.0f, 1.0f);
  NMT_TG_SETUP_OK();
  int32_t *d_ids = nmt_tg_dup_dev(g, ids, (size_t)n_rows * 4);
  float *d_dout = nmt_tg_dup_dev(g, dout, no * 4), *d_x = nmt_tg_dup_dev(g, x, (size_t)M * C * 4);
  float *d_gam = nmt_tg_dup_dev(g, gam, C * 4), *d_bet = nmt_tg_dup_dev(g, gam, C * 4);
  float *d_y = nmt_tg_dalloc(g, (size_t)M * C * 4), *d_mu = nmt_tg_dalloc(g, M * 4),
        *d_rs = nmt_tg_dalloc(g, M * 4);
  float *d_dw = nmt_tg_dalloc(g, (size_t)V * C * 4), *d_dg = nmt_tg_dalloc(g, C * 4),
        *d_s = nmt_tg_dalloc(g, 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->layernorm_fwd(g->ctx, d_y, d_mu, d_rs, d_x, d_gam, d_bet, M, C, 1e-5f));
  float *res[2][3];
  for (int rep = 0; rep < 2; rep++) {
    NMT_ASSERT_OK(g->be->memset_zero(g->ctx, d_dw, (size_t)V * C * 4));
    NMT_ASSERT_OK(g->be->memset_zero(g->ctx, d_dg, C * 4));
    NMT_ASSERT_OK(g->be->embedding_bwd(g->ctx, d_dw, d_dout, d_ids, n_rows, C, 0.7f));
    NMT_ASSERT_OK(g->be->layernorm_bwd(g->ctx, NULL, d_dg, NULL, d_dout, d_x, d_gam, d_mu, d_rs, M,
                                       C));
    NMT_ASSERT_OK(g->be->sumsq(g->ctx, d_s, d_dout, no));
    res[rep][0] = nmt_tg_fetch(g, d_dw, (size_t)V * C * 4);
    res[rep][1] = nmt_tg_fetch(g, d_dg, C * 4);
    res[rep][2] = nmt_tg_fetch(g, d_s, 4);
    NMT_TG_SETUP_OK();
  }
  NMT_ASSERT(!memcmp(res[0][0], res[1][0], (size_t)V * C * 4));
  NMT_ASSERT(!memcmp(res[0][1], res[1][1], C * 4));
  NMT_ASSERT(!memcmp(res[0][2], res[1][2], 4));
}
