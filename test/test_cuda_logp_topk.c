/* test/test_cuda_logp_topk.c — decoding's per-step selection (cuda/logp_topk.cu) against the
 * reference (src/ref/logp_topk.c): the same ids on every row (ties, NaN, infinite rows, k past
 * the outputtable ids), log-probabilities within 1e-5, and the errors. Harness:
 * test/gpu_helpers.h. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "nmt/types.h"
#include "test.h"

/* Device and reference on R rows of V logits for one k, with and without logp. */
static void compare(nmt_tg_gpu *g, const float *x, int R, int V, int k) {
  const size_t n = (size_t)R * k;
  float *d_x = nmt_tg_dup_dev(g, x, (size_t)R * V * 4);
  int32_t *d_ids = nmt_tg_dalloc(g, n * 4), *want = nmt_tg_halloc(g, n * 4);
  float *d_lp = nmt_tg_dalloc(g, n * 4), *wlp = nmt_tg_halloc(g, n * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(nmt_ref_logp_topk(NULL, want, wlp, x, R, V, k));
  for (int with = 0; with < 2; with++) {
    NMT_ASSERT_OK(g->be->logp_topk(g->ctx, d_ids, with ? d_lp : NULL, d_x, R, V, k));
    const int32_t *got = nmt_tg_fetch(g, d_ids, n * 4);
    const float *glp = with ? nmt_tg_fetch(g, d_lp, n * 4) : NULL;
    NMT_TG_SETUP_OK();
    for (size_t i = 0; i < n; i++) {
      if (got[i] != want[i]) {
        nmt_test_fail(__FILE__, __LINE__, "R=%d V=%d k=%d row %zu slot %zu: id %d, ref %d", R, V,
                      k, i / k, i % k, (int)got[i], (int)want[i]);
        return;
      }
      if (!glp) continue;
      const double a = glp[i], b = wlp[i];
      const int same = isnan(b) ? isnan(a) : isinf(b) ? a == b : fabs(a - b) <= 1e-5 * (1 + fabs(b));
      if (!same) {
        nmt_test_fail(__FILE__, __LINE__, "R=%d V=%d k=%d row %zu slot %zu (id %d): logp %.9g, "
                      "ref %.9g", R, V, k, i / k, i % k, (int)got[i], a, b);
        return;
      }
    }
  }
}

NMT_TG_TEST(cuda_logp_topk_matches_ref) {
  enum { R = 37, V = 8003 };
  float *x = nmt_tg_randn(g, (size_t)R * V, 131, 4.0f, 0.0f);
  NMT_TG_SETUP_OK();
  /* Row 1: coarse values, ties everywhere; row 2: <pad>/<s> win; row 3: NaNs around the max;
   * row 4: all -inf but one NaN; row 5: a +inf; row 6: signed zeros; row 7: -inf but one. */
  for (int v = 0; v < V; v++) x[1 * V + v] = (float)(nmt_rng_u32(3, 1, (uint64_t)v) % 7);
  x[2 * V + NMT_PAD_ID] = x[2 * V + NMT_BOS_ID] = 100.0f;
  for (int v = 0; v < V; v += 3) x[3 * V + v] = NAN;
  x[3 * V + 4000] = 60.0f;
  for (int v = 0; v < V; v++) x[4 * V + v] = -INFINITY;
  x[4 * V + 17] = NAN;
  x[5 * V + 999] = INFINITY;
  for (int v = 0; v < V; v++) x[6 * V + v] = (v & 1) ? -0.0f : 0.0f;
  for (int v = 0; v < V; v++) x[7 * V + v] = -INFINITY;
  x[7 * V + V - 1] = 2.0f;
  const int ks[5] = {1, 4, 8, 33, 300};
  for (int c = 0; c < 5 && !nmt_test_failed(); c++) compare(g, x, R, V, ks[c]);
  /* A vocabulary smaller than k: -1 slots with -inf. */
  const float y[2 * 5] = {1, 2, 3, 4, 5, 5, 4, 3, 2, 1};
  if (!nmt_test_failed()) compare(g, y, 2, 5, 6);
  if (!nmt_test_failed()) compare(g, y, 2, 1, 2);
}

NMT_TG_TEST(cuda_logp_topk_errors) {
  float *d_x = nmt_tg_dalloc(g, 64);
  int32_t *d_ids = nmt_tg_dalloc(g, 64);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_EQ_STATUS(g->be->logp_topk(g->ctx, d_ids, NULL, d_x, -1, 4, 1), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->logp_topk(g->ctx, d_ids, NULL, d_x, 1, 0, 1), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->logp_topk(g->ctx, d_ids, NULL, d_x, 1, 4, 0), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->logp_topk(g->ctx, d_ids, NULL, d_x, 1, 4, NMT_TOPK_MAX + 1),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->logp_topk(g->ctx, d_ids, NULL, d_x, 0, 4, 1));
  NMT_ASSERT_OK(g->be->synchronize(g->ctx));
}

/* logp_at (ensemble decoding): at the device's own logp_topk ids it gives the device's
 * logp_topk logp bitwise (the same row reductions), and at any ids (-1, pad, repeats) the
 * reference's logp_at within 1e-5; rows of ties, NaN, +inf and -inf among them. */
NMT_TG_TEST(cuda_logp_at_matches_logp_topk_and_ref) {
  enum { R = 9, V = 8003, K = 8 };
  float *x = nmt_tg_randn(g, (size_t)R * V, 137, 4.0f, 0.0f);
  NMT_TG_SETUP_OK();
  for (int v = 0; v < V; v++) x[1 * V + v] = (float)(nmt_rng_u32(5, 1, (uint64_t)v) % 7);
  for (int v = 0; v < V; v += 3) x[2 * V + v] = NAN;
  x[3 * V + 999] = INFINITY;
  for (int v = 0; v < V; v++) x[4 * V + v] = -INFINITY;
  int32_t *any = nmt_tg_halloc(g, R * K * 4);
  float *want = nmt_tg_halloc(g, R * K * 4);
  NMT_TG_SETUP_OK();
  for (int i = 0; i < R * K; i++) any[i] = i % 5 == 2 ? -1 : (int32_t)((i * 7919u) % V);
  NMT_ASSERT_OK(nmt_ref_logp_at(NULL, want, any, x, R, V, K));
  float *d_x = nmt_tg_dup_dev(g, x, (size_t)R * V * 4);
  int32_t *d_ids = nmt_tg_dalloc(g, R * K * 4), *d_any = nmt_tg_dup_dev(g, any, R * K * 4);
  float *d_lp = nmt_tg_dalloc(g, R * K * 4), *d_at = nmt_tg_dalloc(g, R * K * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->logp_topk(g->ctx, d_ids, d_lp, d_x, R, V, K));
  NMT_ASSERT_OK(g->be->logp_at(g->ctx, d_at, d_ids, d_x, R, V, K));
  const float *lp = nmt_tg_fetch(g, d_lp, R * K * 4), *at = nmt_tg_fetch(g, d_at, R * K * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT(memcmp(lp, at, (size_t)R * K * 4) == 0);
  NMT_ASSERT_OK(g->be->logp_at(g->ctx, d_at, d_any, d_x, R, V, K));
  const float *got = nmt_tg_fetch(g, d_at, R * K * 4);
  NMT_TG_SETUP_OK();
  for (int i = 0; i < R * K; i++) {
    const double a = got[i], b = want[i];
    const int same = isnan(b) ? isnan(a) : isinf(b) ? a == b : fabs(a - b) <= 1e-5 * (1 + fabs(b));
    if (!same) {
      nmt_test_fail(__FILE__, __LINE__, "row %d slot %d (id %d): logp_at %.9g, ref %.9g", i / K,
                    i % K, (int)any[i], a, b);
      return;
    }
  }
  NMT_ASSERT_EQ_STATUS(g->be->logp_at(g->ctx, d_at, d_any, d_x, 1, 4, 0), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->logp_at(g->ctx, d_at, d_any, d_x, 0, 4, 1));
}
