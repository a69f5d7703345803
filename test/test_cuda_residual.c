/* test/test_cuda_residual.c — the fused sublayer connection LN(x + Dropout(y))
 * (cuda/residual.cu) against the reference fused op (src/ref/residual.c): the dropout mask
 * and the sum bitwise, the LayerNorm outputs and every gradient within rtol 1e-4, with gamma
 * and dy given or NULL, and the arguments the launchers refuse; the half-storage path's
 * residual_ln_half_fwd / _bwd (below). Harness: test/gpu_helpers.h. */
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

/* ------------------------------------------------------------------------------------------ */
/* residual_ln_half_fwd / _bwd (the half-storage path, nmt/backend.h) against the reference's,
 * in fp16 and bf16, y and dy in the half type:
 *  - forward: sum and its mask BITWISE (the same fp32 expressions on the same values); out,
 *    mean, rstd within rtol 1e-4 (the LayerNorm's sums in another order, as the fp32 op's
 *    test); out_h the reference rounding of the device's own out, bit for bit (the rounding
 *    site), and within one half ulp of the reference's out_h (its out differs by rounding
 *    noise), at least 90% equal; gamma NULL writes sum only (out, out_h, mean stay poisoned);
 *  - backward: dx WRITTEN (poisoned first) within 1e-4; dy = round(keep ? dx * 1/(1-p) : 0)
 *    of the device's own dx bit for bit (mask, product, rounding), and within one half ulp of
 *    the reference's dy; dgamma / dbeta accumulated within 1e-4; dx or dy NULL; parameter
 *    gradients alone;
 *  - both paths: the warp path (C % 8 == 0 up to 1024: one, two and four chunks per lane; M of
 *    several partial blocks) and the block path (C % 8 != 0, C above 1024, a row tensor 4 bytes
 *    off 16-byte alignment);
 *  - two runs bitwise equal (the partials' order is the shape's), no scratch growth after the
 *    plan's reserve_scratch, and the arguments the launchers refuse. */

typedef struct {
  int M, C;
  float p;
  int off; /* floats / halves by which x, sum, out, dout, dx (and y, out_h, dy) are shifted */
} rh_case;

/* Host dy = round(keep ? dx * scale : 0) (p = 0: round(dx)) with the reference's mask. */
static float *rh_dy_of(nmt_tg_gpu *g, const float *dx, int M, int C, float p, uint64_t seed,
                       uint64_t stream) {
  const size_t n = (size_t)M * C;
  float *v = nmt_tg_halloc(g, n * 4);
  uint8_t *keep = nmt_tg_halloc(g, n);
  if (!v || !keep) return NULL;
  nmt_ref_dropout_keep(keep, 0, n, p, seed, stream);
  const float scale = 1.0f / (1.0f - p);
  for (size_t i = 0; i < n; i++) v[i] = p > 0.0f ? (keep[i] ? dx[i] * scale : 0.0f) : dx[i];
  return v;
}

static void rh_case_run(nmt_tg_gpu *g, nmt_precision mode, void *rc, const rh_case *a,
                        uint64_t tag) {
  char what[160];
  const int M = a->M, C = a->C, bf16 = nmt_tg_half_bf16(mode);
  const float p = a->p;
  const size_t n = (size_t)M * C, o = (size_t)a->off, nt = n + o;
  const uint64_t seed = 0x4a1f0000ull + tag, stream = nmt_rng_stream(6, 0x3001 + (uint32_t)tag);
  const char *mn = bf16 ? "bf16" : "fp16";
  float *x = nmt_tg_randn(g, n, 50 * tag + 1, 1.5f, 2.0f);
  float *yf = nmt_tg_randn(g, n, 50 * tag + 2, 1.0f, 0.0f);
  float *gamma = nmt_tg_randn(g, C, 50 * tag + 3, 0.3f, 1.0f),
        *beta = nmt_tg_randn(g, C, 50 * tag + 4, 0.3f, 0.0f);
  float *dout = nmt_tg_randn(g, n, 50 * tag + 5, 1.0f, 0.0f);
  float *dg = nmt_tg_randn(g, C, 50 * tag + 6, 1.0f, 0.0f),
        *db = nmt_tg_randn(g, C, 50 * tag + 7, 1.0f, 0.0f);
  uint16_t *y = nmt_tg_half_encode(g, mode, yf, n);
  float *want_sum = nmt_tg_halloc(g, n * 4), *want = nmt_tg_halloc(g, n * 4);
  float *want_mu = nmt_tg_halloc(g, (size_t)M * 4), *want_rs = nmt_tg_halloc(g, (size_t)M * 4);
  float *want_dx = nmt_tg_halloc(g, n * 4), *want_dg = nmt_tg_hcopy(g, dg, C),
        *want_db = nmt_tg_hcopy(g, db, C);
  uint16_t *want_h = nmt_tg_halloc(g, n * 2), *want_dy = nmt_tg_halloc(g, n * 2);
  NMT_TG_SETUP_OK();
  /* Device buffers with room for the offset: the op sees base + off. */
  float *d_x = nmt_tg_dalloc(g, nt * 4), *d_sum = nmt_tg_dalloc(g, nt * 4),
        *d_out = nmt_tg_dalloc(g, nt * 4), *d_dout = nmt_tg_dalloc(g, nt * 4),
        *d_dx = nmt_tg_dalloc(g, nt * 4), *d_dx2 = nmt_tg_dalloc(g, nt * 4);
  uint16_t *d_y = nmt_tg_dalloc(g, nt * 2), *d_h = nmt_tg_dalloc(g, nt * 2),
           *d_dy = nmt_tg_dalloc(g, nt * 2), *d_dy2 = nmt_tg_dalloc(g, nt * 2);
  float *d_mu = nmt_tg_dalloc(g, (size_t)M * 4), *d_rs = nmt_tg_dalloc(g, (size_t)M * 4);
  float *d_gamma = nmt_tg_dup_dev(g, gamma, C * 4), *d_beta = nmt_tg_dup_dev(g, beta, C * 4);
  float *d_dg = nmt_tg_dup_dev(g, dg, C * 4), *d_db = nmt_tg_dup_dev(g, db, C * 4),
        *d_dg2 = nmt_tg_dup_dev(g, dg, C * 4), *d_db2 = nmt_tg_dup_dev(g, db, C * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_x + o, x, n * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_y + o, y, n * 2));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_dout + o, dout, n * 4));
  nmt_backend_counters c0, c1;
  NMT_ASSERT_OK(g->be->counters(g->ctx, &c0));

  /* gamma NULL (the pre-LN residual): sum only. */
  nmt_tg_poison(g, d_sum, nt);
  nmt_tg_poison(g, d_out, nt);
  nmt_tg_poison(g, d_mu, M);
  nmt_tg_half_poison(g, d_h, nt);
  NMT_ASSERT_OK(g->be->residual_ln_half_fwd(g->ctx, d_out + o, d_h + o, d_sum + o, d_mu, d_rs,
                                            d_x + o, d_y + o, NULL, NULL, M, C, 1e-5f, p, seed,
                                            stream));
  NMT_ASSERT_OK(nmt_ref_residual_ln_half_fwd(rc, NULL, NULL, want_sum, NULL, NULL, x, y, NULL,
                                             NULL, M, C, 1e-5f, p, seed, stream));
  snprintf(what, sizeof what, "%s residual_ln_half_fwd sum, gamma NULL, M=%d C=%d p=%g off %zu",
           mn, M, C, (double)p, o);
  const float *h_sum = nmt_tg_fetch(g, d_sum, nt * 4);
  NMT_TG_SETUP_OK();
  CHECK_MASK(what, h_sum + o, want_sum, x, n);
  NMT_TG_EXACT(what, h_sum + o, want_sum, n);
  const float *h_out = nmt_tg_fetch(g, d_out, nt * 4), *h_mu = nmt_tg_fetch(g, d_mu, M * 4);
  const uint16_t *h_h = nmt_tg_fetch(g, d_h, nt * 2);
  NMT_TG_SETUP_OK();
  for (size_t i = 0; i < nt; i++)
    if (!isnan(h_out[i]) || h_h[i] != 0xffff) {
      nmt_test_fail(__FILE__, __LINE__, "%s: wrote out or out_h[%zu]", what, i);
      return;
    }
  for (int r = 0; r < M; r++) NMT_ASSERT(isnan(h_mu[r]));

  /* gamma given (post-LN). */
  nmt_tg_poison(g, d_sum, nt);
  NMT_ASSERT_OK(g->be->residual_ln_half_fwd(g->ctx, d_out + o, d_h + o, d_sum + o, d_mu, d_rs,
                                            d_x + o, d_y + o, d_gamma, d_beta, M, C, 1e-5f, p,
                                            seed, stream));
  NMT_ASSERT_OK(nmt_ref_residual_ln_half_fwd(rc, want, want_h, want_sum, want_mu, want_rs, x, y,
                                             gamma, beta, M, C, 1e-5f, p, seed, stream));
  snprintf(what, sizeof what, "%s residual_ln_half_fwd sum, M=%d C=%d p=%g off %zu", mn, M, C,
           (double)p, o);
  h_sum = nmt_tg_fetch(g, d_sum, nt * 4);
  h_out = nmt_tg_fetch(g, d_out, nt * 4);
  h_h = nmt_tg_fetch(g, d_h, nt * 2);
  NMT_TG_SETUP_OK();
  CHECK_MASK(what, h_sum + o, want_sum, x, n);
  NMT_TG_EXACT(what, h_sum + o, want_sum, n);
  snprintf(what, sizeof what, "%s residual_ln_half_fwd out, M=%d C=%d p=%g off %zu", mn, M, C,
           (double)p, o);
  NMT_TG_CLOSE(what, h_out + o, want, n, 1e-4);
  NMT_TG_CLOSE("residual_ln_half_fwd mean", nmt_tg_fetch(g, d_mu, M * 4), want_mu, M, 1e-4);
  NMT_TG_CLOSE("residual_ln_half_fwd rstd", nmt_tg_fetch(g, d_rs, M * 4), want_rs, M, 1e-4);
  snprintf(what, sizeof what, "%s residual_ln_half_fwd out_h = round(out), M=%d C=%d", mn, M, C);
  if (!nmt_tg_same_half(mode, what, h_h + o, h_out + o, n)) return;
  snprintf(what, sizeof what, "%s residual_ln_half_fwd out_h vs the reference's, M=%d C=%d", mn,
           M, C);
  /* rtol 1e-5: the fp32 values differ by the backends' sum orders (the device's mean and
   * variance in fp32 warp sums, the reference's in double; CUDA's expf and fused products
   * in the classifier), ~1e-7 absolute, which is several half ulps for |x| near 0 (fp16
   * subnormals, bf16's cancelled gradients); still far under one half ulp of the array's
   * largest values. The rounding site itself is held bitwise elsewhere in this test. */
  if (!NMT_TG_HALF_CLOSE(mode, what, h_h + o, want_h, n, 1e-5, 0.9)) return;
  /* Again, out_h NULL and no statistics: out bitwise as before (deterministic). */
  nmt_tg_poison(g, d_out, nt);
  NMT_ASSERT_OK(g->be->residual_ln_half_fwd(g->ctx, d_out + o, NULL, d_sum + o, NULL, NULL,
                                            d_x + o, d_y + o, d_gamma, d_beta, M, C, 1e-5f, p,
                                            seed, stream));
  const float *h_out2 = nmt_tg_fetch(g, d_out, nt * 4);
  NMT_TG_SETUP_OK();
  NMT_TG_EXACT("residual_ln_half_fwd out, second run", h_out2 + o, h_out + o, n);

  /* Backward from the reference's sum, mean and rstd on both sides. */
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_sum + o, want_sum, n * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_mu, want_mu, (size_t)M * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_rs, want_rs, (size_t)M * 4));
  for (int run = 0; run < 2; run++) {
    float *ddx = run ? d_dx2 : d_dx, *ddg = run ? d_dg2 : d_dg, *ddb = run ? d_db2 : d_db;
    uint16_t *ddy = run ? d_dy2 : d_dy;
    nmt_tg_poison(g, ddx, nt);
    nmt_tg_half_poison(g, ddy, nt);
    NMT_ASSERT_OK(g->be->residual_ln_half_bwd(g->ctx, ddx + o, ddy + o, ddg, ddb, d_dout + o,
                                              d_sum + o, d_gamma, d_mu, d_rs, M, C, p, seed,
                                              stream));
  }
  NMT_ASSERT_OK(nmt_ref_residual_ln_half_bwd(rc, want_dx, want_dy, want_dg, want_db, dout,
                                             want_sum, gamma, want_mu, want_rs, M, C, p, seed,
                                             stream));
  const float *h_dx = nmt_tg_fetch(g, d_dx, nt * 4);
  const uint16_t *h_dy = nmt_tg_fetch(g, d_dy, nt * 2);
  NMT_TG_SETUP_OK();
  snprintf(what, sizeof what, "%s residual_ln_half_bwd dx, M=%d C=%d p=%g off %zu", mn, M, C,
           (double)p, o);
  NMT_TG_CLOSE(what, h_dx + o, want_dx, n, 1e-4);
  snprintf(what, sizeof what, "%s residual_ln_half_bwd dy = round(dropout'(dx)), M=%d C=%d p=%g",
           mn, M, C, (double)p);
  const float *dy_v = rh_dy_of(g, h_dx + o, M, C, p, seed, stream);
  NMT_TG_SETUP_OK();
  if (!nmt_tg_same_half(mode, what, h_dy + o, dy_v, n)) return;
  snprintf(what, sizeof what, "%s residual_ln_half_bwd dy vs the reference's, M=%d C=%d p=%g", mn,
           M, C, (double)p);
  if (!NMT_TG_HALF_CLOSE(mode, what, h_dy + o, want_dy, n, 1e-4, 0.9)) return;
  NMT_TG_CLOSE("residual_ln_half_bwd dgamma", nmt_tg_fetch(g, d_dg, C * 4), want_dg, C, 1e-4);
  NMT_TG_CLOSE("residual_ln_half_bwd dbeta", nmt_tg_fetch(g, d_db, C * 4), want_db, C, 1e-4);
  /* Two runs: the same bits everywhere. */
  const float *h_dx2 = nmt_tg_fetch(g, d_dx2, nt * 4);
  NMT_TG_SETUP_OK();
  NMT_TG_EXACT("residual_ln_half_bwd dx, second run", h_dx2 + o, h_dx + o, n);
  NMT_TG_EXACT("residual_ln_half_bwd dgamma, second run", nmt_tg_fetch(g, d_dg2, C * 4),
               nmt_tg_fetch(g, d_dg, C * 4), C);
  NMT_TG_EXACT("residual_ln_half_bwd dbeta, second run", nmt_tg_fetch(g, d_db2, C * 4),
               nmt_tg_fetch(g, d_db, C * 4), C);
  const uint16_t *h_dy2 = nmt_tg_fetch(g, d_dy2, nt * 2);
  NMT_TG_SETUP_OK();
  NMT_ASSERT(memcmp(h_dy2, h_dy, nt * 2) == 0);
  /* dy alone, dx alone (no dropout after the sublayer), parameter gradients alone. */
  nmt_tg_half_poison(g, d_dy2, nt);
  NMT_ASSERT_OK(g->be->residual_ln_half_bwd(g->ctx, NULL, d_dy2 + o, NULL, NULL, d_dout + o,
                                            d_sum + o, d_gamma, d_mu, d_rs, M, C, p, seed,
                                            stream));
  h_dy2 = nmt_tg_fetch(g, d_dy2, nt * 2);
  NMT_TG_SETUP_OK();
  NMT_ASSERT(memcmp(h_dy2, h_dy, nt * 2) == 0);
  nmt_tg_poison(g, d_dx2, nt);
  NMT_ASSERT_OK(g->be->residual_ln_half_bwd(g->ctx, d_dx2 + o, NULL, NULL, NULL, d_dout + o,
                                            d_sum + o, d_gamma, d_mu, d_rs, M, C, p, seed,
                                            stream));
  h_dx2 = nmt_tg_fetch(g, d_dx2, nt * 4);
  NMT_TG_SETUP_OK();
  NMT_TG_EXACT("residual_ln_half_bwd dx, dy NULL", h_dx2 + o, h_dx + o, n);
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_dg2, dg, C * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_db2, db, C * 4));
  NMT_ASSERT_OK(g->be->residual_ln_half_bwd(g->ctx, NULL, NULL, d_dg2, d_db2, d_dout + o,
                                            d_sum + o, d_gamma, d_mu, d_rs, M, C, p, seed,
                                            stream));
  NMT_TG_EXACT("residual_ln_half_bwd dgamma alone", nmt_tg_fetch(g, d_dg2, C * 4),
               nmt_tg_fetch(g, d_dg, C * 4), C);
  NMT_TG_EXACT("residual_ln_half_bwd dbeta alone", nmt_tg_fetch(g, d_db2, C * 4),
               nmt_tg_fetch(g, d_db, C * 4), C);
  NMT_ASSERT_OK(g->be->counters(g->ctx, &c1));
  NMT_ASSERT_EQ_INT(c1.scratch_growths - c0.scratch_growths, 0);
}

static const rh_case rh_cases[] = {
    /* M, C, p, off */
    {7, 33, 0.1f, 0},    {7, 33, 0.0f, 0},   {5, 64, 0.1f, 0},   {300, 512, 0.1f, 0},
    {300, 512, 0.0f, 0}, {20, 1024, 0.3f, 0}, {40, 1000, 0.1f, 0}, {3000, 256, 0.1f, 0},
    {3, 4100, 0.3f, 0},  {9, 2048, 0.1f, 0},  {64, 512, 0.1f, 1},  {1, 1, 0.2f, 0},
};

/* The plan of rh_cases: every shape within gemm_rows and width (the op scratch of the LayerNorm
 * backwards' partials and column sums). */
static nmt_scratch_plan rh_plan(void) {
  nmt_scratch_plan plan;
  memset(&plan, 0, sizeof plan);
  plan.main.gemm_rows = 3000;
  plan.main.width = 4100;
  plan.main.half_acts = 1;
  return plan;
}

static void rh_mode(nmt_tg_gpu *g, nmt_precision mode) {
  const nmt_scratch_plan plan = rh_plan();
  void *rc = nmt_tg_half_twin(g, mode, &plan);
  if (!rc) return;
  for (size_t i = 0; i < sizeof rh_cases / sizeof *rh_cases; i++) {
    rh_case_run(g, mode, rc, &rh_cases[i], 100 * (uint64_t)nmt_tg_half_bf16(mode) + i + 1);
    if (nmt_test_failed()) break;
  }
  nmt_ref_ctx_destroy(rc);
}

NMT_TG_TEST(cuda_residual_ln_half_fp16_matches_ref) { rh_mode(g, NMT_PRECISION_FP16); }
NMT_TG_TEST(cuda_residual_ln_half_bf16_matches_ref) { rh_mode(g, NMT_PRECISION_BF16); }

NMT_TG_TEST(cuda_residual_ln_half_refuses_misuse) {
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_BF16));
  /* Arguments the launchers refuse, as the reference does; and an fp32 context. */
  float *d = nmt_tg_dalloc(g, 64 * 4);
  uint16_t *h = nmt_tg_dalloc(g, 64 * 2);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_EQ_STATUS(g->be->residual_ln_half_fwd(g->ctx, d, h, d + 16, NULL, NULL, d + 32, h,
                                                   NULL, NULL, 2, 8, 1e-5f, 1.0f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->residual_ln_half_fwd(g->ctx, d, h, d + 16, NULL, NULL, d + 32, h,
                                                   NULL, NULL, -1, 8, 1e-5f, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->residual_ln_half_fwd(g->ctx, d, h, NULL, NULL, NULL, d + 32, h,
                                                   NULL, NULL, 2, 8, 1e-5f, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->residual_ln_half_fwd(g->ctx, NULL, h, d + 16, NULL, NULL, d + 32, h,
                                                   d, d, 2, 8, 1e-5f, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->residual_ln_half_bwd(g->ctx, d, h, NULL, NULL, d + 16, d + 32,
                                                   d + 48, d, d, 2, 0, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->residual_ln_half_bwd(g->ctx, d, h, NULL, NULL, d + 16, d + 32,
                                                   d + 48, d, d, 2, 8, -0.5f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_FP32));
  NMT_ASSERT_EQ_STATUS(g->be->residual_ln_half_fwd(g->ctx, d, h, d + 16, NULL, NULL, d + 32, h,
                                                   NULL, NULL, 2, 8, 1e-5f, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->residual_ln_half_bwd(g->ctx, d, h, NULL, NULL, d + 16, d + 32,
                                                   d + 48, d, d, 2, 8, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
}
