/* test/test_cuda_residual.c — the fused sublayer connection LN(x + Dropout(y))
 * (cuda/residual.cu) against the reference fused op (src/ref/residual.c): the dropout mask
 * and the sum bitwise, the LayerNorm outputs and every gradient within rtol 1e-4, with gamma
 * and dy given or NULL, and the arguments the launchers refuse. Harness: test/gpu_helpers.h. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

/* Elements dropped on one side only: dropped means got[i] == base[i] bitwise (sum == x in the
 * forward, dy unchanged in the backward). The mask must match exactly. */
static size_t mask_mismatches(const float *got, const float *want, const float *base, size_t n,
                              size_t *first) {
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    const int dg = memcmp(&got[i], &base[i], sizeof *got) == 0;
    const int dw = memcmp(&want[i], &base[i], sizeof *got) == 0;
    if (dg != dw && !bad++) *first = i;
  }
  return bad;
}

#define CHECK_MASK(what, got, want, base, n)                                                 \
  do {                                                                                       \
    const float *got_m = (got);                                                              \
    NMT_ASSERT(got_m != NULL);                                                               \
    size_t first_ = 0, bad_ = mask_mismatches(got_m, (want), (base), (n), &first_);          \
    if (bad_) {                                                                              \
      nmt_test_fail(__FILE__, __LINE__, "%s: %zu of %zu elements dropped on one side only; " \
                    "first at %zu", (what), bad_, (size_t)(n), first_);                      \
      return;                                                                                \
    }                                                                                        \
  } while (0)

/* One shape and p: forward with gamma NULL and given, backward with dy NULL and given, from
 * non-zero gradients, against the reference fused op (itself bitwise the separate ops,
 * test/test_residual.c). */
static void residual_case(nmt_tg_gpu *g, int M, int C, float p, uint64_t tag) {
  char what[128];
  const size_t n = (size_t)M * C;
  const uint64_t seed = 0x7e5d0000ull + tag, stream = nmt_rng_stream(5, 0x20011 + (uint32_t)tag);
  float *x = nmt_tg_randn(g, n, 40 * tag + 1, 1.5f, 2.0f),
        *y = nmt_tg_randn(g, n, 40 * tag + 2, 1.0f, 0.0f);
  float *gamma = nmt_tg_randn(g, C, 40 * tag + 3, 0.3f, 1.0f),
        *beta = nmt_tg_randn(g, C, 40 * tag + 4, 0.3f, 0.0f);
  float *dout = nmt_tg_randn(g, n, 40 * tag + 5, 1.0f, 0.0f),
        *dx = nmt_tg_randn(g, n, 40 * tag + 6, 1.0f, 0.0f);
  float *dy = nmt_tg_randn(g, n, 40 * tag + 7, 1.0f, 0.0f),
        *dg = nmt_tg_randn(g, C, 40 * tag + 8, 1.0f, 0.0f);
  float *db = nmt_tg_randn(g, C, 40 * tag + 9, 1.0f, 0.0f);
  float *want_sum = nmt_tg_halloc(g, n * 4), *want = nmt_tg_halloc(g, n * 4),
        *want_mu = nmt_tg_halloc(g, (size_t)M * 4);
  float *want_rs = nmt_tg_halloc(g, (size_t)M * 4), *want_dx = nmt_tg_hcopy(g, dx, n),
        *want_dy = nmt_tg_hcopy(g, dy, n);
  float *want_dg = nmt_tg_hcopy(g, dg, C), *want_db = nmt_tg_hcopy(g, db, C),
        *want_dx2 = nmt_tg_hcopy(g, dx, n);
  NMT_TG_SETUP_OK();
  float *d_x = nmt_tg_dup_dev(g, x, n * 4), *d_y = nmt_tg_dup_dev(g, y, n * 4),
        *d_sum = nmt_tg_dalloc(g, n * 4);
  float *d_out = nmt_tg_dalloc(g, n * 4), *d_mu = nmt_tg_dalloc(g, (size_t)M * 4),
        *d_rs = nmt_tg_dalloc(g, (size_t)M * 4);
  float *d_gamma = nmt_tg_dup_dev(g, gamma, C * 4), *d_beta = nmt_tg_dup_dev(g, beta, C * 4);
  float *d_dout = nmt_tg_dup_dev(g, dout, n * 4), *d_dx = nmt_tg_dup_dev(g, dx, n * 4),
        *d_dy = nmt_tg_dup_dev(g, dy, n * 4);
  float *d_dg = nmt_tg_dup_dev(g, dg, C * 4), *d_db = nmt_tg_dup_dev(g, db, C * 4),
        *d_dx2 = nmt_tg_dup_dev(g, dx, n * 4);
  NMT_TG_SETUP_OK();

  /* gamma NULL (the pre-LN residual): sum only; out, mean, rstd stay poisoned. */
  nmt_tg_poison(g, d_sum, n);
  nmt_tg_poison(g, d_out, n);
  nmt_tg_poison(g, d_mu, M);
  nmt_tg_poison(g, d_rs, M);
  NMT_ASSERT_OK(g->be->residual_dropout_ln_fwd(g->ctx, d_out, d_sum, d_mu, d_rs, d_x, d_y, NULL,
                                               NULL, M, C, 1e-5f, p, seed, stream));
  NMT_ASSERT_OK(nmt_ref_residual_dropout_ln_fwd(NULL, NULL, want_sum, NULL, NULL, x, y, NULL, NULL,
                                                M, C, 1e-5f, p, seed, stream));
  snprintf(what, sizeof what, "residual fwd sum, gamma NULL, M=%d C=%d p=%g", M, C, (double)p);
  CHECK_MASK(what, nmt_tg_fetch(g, d_sum, n * 4), want_sum, x, n);
  NMT_TG_EXACT(what, nmt_tg_fetch(g, d_sum, n * 4), want_sum, n);
  const float *h_out = nmt_tg_fetch(g, d_out, n * 4), *h_mu = nmt_tg_fetch(g, d_mu, (size_t)M * 4);
  NMT_TG_SETUP_OK();
  for (size_t i = 0; i < n; i++)
    if (!isnan(h_out[i])) {
      nmt_test_fail(__FILE__, __LINE__, "residual fwd, gamma NULL: wrote out[%zu]", i);
      return;
    }
  for (int r = 0; r < M; r++) NMT_ASSERT(isnan(h_mu[r]));

  /* gamma given (post-LN): sum, out, mean, rstd. */
  nmt_tg_poison(g, d_sum, n);
  NMT_ASSERT_OK(g->be->residual_dropout_ln_fwd(g->ctx, d_out, d_sum, d_mu, d_rs, d_x, d_y, d_gamma,
                                               d_beta, M, C, 1e-5f, p, seed, stream));
  NMT_ASSERT_OK(nmt_ref_residual_dropout_ln_fwd(NULL, want, want_sum, want_mu, want_rs, x, y, gamma,
                                                beta, M, C, 1e-5f, p, seed, stream));
  snprintf(what, sizeof what, "residual fwd sum, M=%d C=%d p=%g", M, C, (double)p);
  CHECK_MASK(what, nmt_tg_fetch(g, d_sum, n * 4), want_sum, x, n);
  NMT_TG_EXACT(what, nmt_tg_fetch(g, d_sum, n * 4), want_sum, n);
  snprintf(what, sizeof what, "residual fwd out, M=%d C=%d p=%g", M, C, (double)p);
  NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_out, n * 4), want, n, 1e-4);
  NMT_TG_CLOSE("residual fwd mean", nmt_tg_fetch(g, d_mu, (size_t)M * 4), want_mu, M, 1e-4);
  NMT_TG_CLOSE("residual fwd rstd", nmt_tg_fetch(g, d_rs, (size_t)M * 4), want_rs, M, 1e-4);
  /* mean and rstd are optional. */
  nmt_tg_poison(g, d_out, n);
  NMT_ASSERT_OK(g->be->residual_dropout_ln_fwd(g->ctx, d_out, d_sum, NULL, NULL, d_x, d_y, d_gamma,
                                               d_beta, M, C, 1e-5f, p, seed, stream));
  NMT_TG_CLOSE("residual fwd out (no stats)", nmt_tg_fetch(g, d_out, n * 4), want, n, 1e-4);

  /* Backward from the reference's saved sum, mean, rstd on both sides (so only the backward
   * is compared), into non-zero gradients. */
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_sum, want_sum, n * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_mu, want_mu, (size_t)M * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_rs, want_rs, (size_t)M * 4));
  NMT_ASSERT_OK(g->be->residual_dropout_ln_bwd(g->ctx, d_dx, d_dy, d_dg, d_db, d_dout, d_sum,
                                               d_gamma, d_mu, d_rs, M, C, p, seed, stream));
  NMT_ASSERT_OK(nmt_ref_residual_dropout_ln_bwd(NULL, want_dx, want_dy, want_dg, want_db, dout,
                                                want_sum, gamma, want_mu, want_rs, M, C, p, seed,
                                                stream));
  snprintf(what, sizeof what, "residual bwd dx, M=%d C=%d p=%g", M, C, (double)p);
  NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_dx, n * 4), want_dx, n, 1e-4);
  snprintf(what, sizeof what, "residual bwd dy, M=%d C=%d p=%g", M, C, (double)p);
  CHECK_MASK(what, nmt_tg_fetch(g, d_dy, n * 4), want_dy, dy, n);
  NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_dy, n * 4), want_dy, n, 1e-4);
  NMT_TG_CLOSE("residual bwd dgamma", nmt_tg_fetch(g, d_dg, C * 4), want_dg, C, 1e-4);
  NMT_TG_CLOSE("residual bwd dbeta", nmt_tg_fetch(g, d_db, C * 4), want_db, C, 1e-4);
  /* dy NULL (no dropout in the model): dx alone; parameter gradients NULL too. */
  NMT_ASSERT_OK(g->be->residual_dropout_ln_bwd(g->ctx, d_dx2, NULL, NULL, NULL, d_dout, d_sum,
                                               d_gamma, d_mu, d_rs, M, C, p, seed, stream));
  NMT_ASSERT_OK(nmt_ref_residual_dropout_ln_bwd(NULL, want_dx2, NULL, NULL, NULL, dout, want_sum,
                                                gamma, want_mu, want_rs, M, C, p, seed, stream));
  snprintf(what, sizeof what, "residual bwd dx, dy NULL, M=%d C=%d p=%g", M, C, (double)p);
  NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_dx2, n * 4), want_dx2, n, 1e-4);
}

NMT_TG_TEST(cuda_residual_dropout_ln_matches_ref) {
  /* C = 33: rows start inside a Philox block; 4100: longer than the reference's mask chunk;
   * 300 x 512 with p = 0.1: the base model's sublayer output. */
  const struct {
    int M, C;
    float p;
  } cases[] = {{7, 33, 0.0f}, {7, 33, 0.1f}, {7, 33, 0.5f}, {3, 4100, 0.3f},
               {5, 64, 0.1f}, {1, 1, 0.2f},  {300, 512, 0.1f}, {300, 512, 0.0f}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    residual_case(g, cases[i].M, cases[i].C, cases[i].p, i + 1);
    if (nmt_test_failed()) return;
  }
  /* Arguments the launchers refuse, as the reference does. */
  float *d = nmt_tg_dalloc(g, 64 * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_EQ_STATUS(g->be->residual_dropout_ln_fwd(g->ctx, d, d + 16, NULL, NULL, d + 32, d + 48,
                                                      NULL, NULL, 2, 8, 1e-5f, 1.0f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->residual_dropout_ln_fwd(g->ctx, d, d + 16, NULL, NULL, d + 32, d + 48,
                                                      NULL, NULL, -1, 8, 1e-5f, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->residual_dropout_ln_fwd(g->ctx, d, NULL, NULL, NULL, d + 32, d + 48,
                                                      NULL, NULL, 2, 8, 1e-5f, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->residual_dropout_ln_fwd(g->ctx, NULL, d + 16, NULL, NULL, d + 32,
                                                      d + 48, d, d, 2, 8, 1e-5f, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->residual_dropout_ln_bwd(g->ctx, d, NULL, NULL, NULL, d + 16, d + 32,
                                                      d + 48, d, d, 2, 0, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->residual_dropout_ln_bwd(g->ctx, d, NULL, NULL, NULL, d + 16, d + 32,
                                                      d + 48, d, d, 2, 8, -0.5f, 1, 2),
                       NMT_ERR_INTERNAL);
}
