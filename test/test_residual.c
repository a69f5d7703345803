/* test/test_residual.c — the fused residual + dropout + LayerNorm ops (src/ref/residual.c)
 * against the composition of the separate reference ops the model ran before the fusion:
 *   fwd: dropout_fwd(y) in place, add(sum = x + .), layernorm_fwd(sum);
 *   bwd: layernorm_bwd into a zeroed buffer dr, add(dx += dr), dropout_bwd(dy += drop'(dr)).
 * The fusion must not change a single bit of training on the CPU, so every output is compared
 * bitwise (memcmp, the first differing index reported), over p = 0 and p > 0, gamma NULL or
 * not, dy NULL or not, rows that start inside a 4-element Philox block (C % 4 != 0), rows longer
 * than the mask chunk, and gradients that start non-zero (accumulation). Also the argument
 * errors. The separate ops themselves are tested against naive mirrors and finite differences
 * in test_layernorm.c and test_dropout.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

/* n normal(0, scale) + shift floats from (seed, stream id), malloc'd. */
static float *randn(size_t n, uint64_t seed, float scale, float shift) {
  float *x = malloc((n ? n : 1) * sizeof *x);
  if (x)
    for (size_t i = 0; i < n; i++) x[i] = shift + scale * nmt_rng_normal(seed, 17, i);
  return x;
}

static float *copy_of(const float *x, size_t n) {
  float *y = malloc((n ? n : 1) * sizeof *y);
  if (y) memcpy(y, x, n * sizeof *y);
  return y;
}

static float *nans(size_t n) {
  float *y = malloc((n ? n : 1) * sizeof *y);
  if (y)
    for (size_t i = 0; i < n; i++) y[i] = NAN;
  return y;
}

/* 1 when got and want have the same bits; else records the count of differing elements and
 * the first one. */
static int same_bits(int line, const char *what, const float *got, const float *want, size_t n) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; i++)
    if (memcmp(&got[i], &want[i], sizeof got[i])) {
      if (!bad) first = i;
      bad++;
    }
  if (!bad) return 1;
  nmt_test_fail(__FILE__, line, "%s: %zu of %zu elements differ bitwise; first at %zu: %.9g vs %.9g",
                what, bad, n, first, (double)got[first], (double)want[first]);
  return 0;
}
#define SAME_BITS(what, got, want, n) \
  if (!same_bits(__LINE__, (what), (got), (want), (n))) goto out
/* NMT_ASSERT_OK that frees the case's buffers on failure. */
#define TRY_OK(expr)                                                                    \
  do {                                                                                  \
    nmt_status s_ = (expr);                                                             \
    if (s_ != NMT_OK) {                                                                 \
      nmt_test_fail(__FILE__, __LINE__, "%s: %s: %s", #expr, nmt_status_str(s_),       \
                    nmt_last_error());                                                  \
      goto out;                                                                         \
    }                                                                                   \
  } while (0)

typedef struct {
  int M, C;
  float p;
} res_case;

/* C = 33 starts rows inside Philox blocks; C = 4100 crosses the 4096-element mask chunk. */
static const res_case cases[] = {
    {7, 33, 0.0f}, {7, 33, 0.1f}, {7, 33, 0.5f}, {3, 4100, 0.3f}, {5, 64, 0.1f}, {1, 1, 0.2f},
};

static const float eps = 1e-5f;

/* One case, forward then backward, for gamma given or not (fwd) and dy given or not (bwd). */
static void run_case(const res_case *k, uint64_t tag) {
  const int M = k->M, C = k->C;
  const size_t n = (size_t)M * C;
  const float p = k->p;
  const uint64_t seed = 0x5eed0000ull + tag, stream = nmt_rng_stream(9, 0x20015 + (uint32_t)tag);
  char what[160];
  /* A large mean and small spread in the residual stream, as after a few layers. */
  float *x = randn(n, tag * 16 + 1, 1.5f, 2.0f), *y = randn(n, tag * 16 + 2, 1.0f, 0.0f);
  float *gamma = randn(C, tag * 16 + 3, 0.3f, 1.0f), *beta = randn(C, tag * 16 + 4, 0.3f, 0.0f);
  float *dout = randn(n, tag * 16 + 5, 1.0f, 0.0f);
  float *dx0 = randn(n, tag * 16 + 6, 1.0f, 0.0f), *dy0 = randn(n, tag * 16 + 7, 1.0f, 0.0f);
  float *dg0 = randn(C, tag * 16 + 8, 1.0f, 0.0f), *db0 = randn(C, tag * 16 + 9, 1.0f, 0.0f);
  /* the composition's buffers */
  float *w_o = copy_of(y, n), *w_sum = nans(n), *w_out = nans(n), *w_mu = nans(M);
  float *w_rs = nans(M), *w_dr = calloc(n ? n : 1, sizeof(float));
  float *w_dx = copy_of(dx0, n), *w_dy = copy_of(dy0, n), *w_dg = copy_of(dg0, C);
  float *w_db = copy_of(db0, C);
  /* the fused op's buffers, poisoned */
  float *sum = nans(n), *out = nans(n), *mu = nans(M), *rs = nans(M);
  float *dx = copy_of(dx0, n), *dy = copy_of(dy0, n), *dg = copy_of(dg0, C);
  float *db = copy_of(db0, C), *dx2 = copy_of(dx0, n), *dg2 = copy_of(dg0, C);
  float *db2 = copy_of(db0, C), *sum2 = copy_of(x, n);
  if (!x || !y || !gamma || !beta || !dout || !dx0 || !dy0 || !dg0 || !db0 || !w_o || !w_sum ||
      !w_out || !w_mu || !w_rs || !w_dr || !w_dx || !w_dy || !w_dg || !w_db || !sum || !out ||
      !mu || !rs || !dx || !dy || !dg || !db || !dx2 || !dg2 || !db2 || !sum2) {
    nmt_test_fail(__FILE__, __LINE__, "out of memory");
    goto out;
  }

  /* ---- forward: the model's post-LN composition ---- */
  if (p > 0) TRY_OK(nmt_ref_dropout_fwd(NULL, w_o, w_o, n, p, seed, stream));
  TRY_OK(nmt_ref_add(NULL, w_sum, x, w_o, n));
  TRY_OK(nmt_ref_layernorm_fwd(NULL, w_out, w_mu, w_rs, w_sum, gamma, beta, M, C, eps));

  /* gamma NULL (pre-LN residual): only sum is written, out/mean/rstd stay poisoned. */
  TRY_OK(nmt_ref_residual_dropout_ln_fwd(NULL, out, sum, mu, rs, x, y, NULL, NULL, M, C,
                                                eps, p, seed, stream));
  snprintf(what, sizeof what, "fwd sum, gamma NULL, M=%d C=%d p=%g", M, C, (double)p);
  SAME_BITS(what, sum, w_sum, n);
  for (size_t i = 0; i < n; i++)
    if (!isnan(out[i])) {
      nmt_test_fail(__FILE__, __LINE__, "gamma NULL wrote out[%zu] = %g", i, (double)out[i]);
      goto out;
    }
  for (int r = 0; r < M; r++)
    if (!isnan(mu[r]) || !isnan(rs[r])) {
      nmt_test_fail(__FILE__, __LINE__, "gamma NULL wrote mean or rstd of row %d", r);
      goto out;
    }

  /* gamma given: sum, out, mean, rstd */
  for (size_t i = 0; i < n; i++) sum[i] = NAN;
  TRY_OK(nmt_ref_residual_dropout_ln_fwd(NULL, out, sum, mu, rs, x, y, gamma, beta, M, C,
                                                eps, p, seed, stream));
  snprintf(what, sizeof what, "fwd sum, M=%d C=%d p=%g", M, C, (double)p);
  SAME_BITS(what, sum, w_sum, n);
  snprintf(what, sizeof what, "fwd out, M=%d C=%d p=%g", M, C, (double)p);
  SAME_BITS(what, out, w_out, n);
  SAME_BITS("fwd mean", mu, w_mu, (size_t)M);
  SAME_BITS("fwd rstd", rs, w_rs, (size_t)M);
  /* Without mean/rstd the same out; sum may be x itself (in place). */
  for (size_t i = 0; i < n; i++) out[i] = NAN;
  TRY_OK(nmt_ref_residual_dropout_ln_fwd(NULL, out, sum2, NULL, NULL, sum2, y, gamma, beta,
                                                M, C, eps, p, seed, stream));
  SAME_BITS("fwd sum in place of x", sum2, w_sum, n);
  SAME_BITS("fwd out without stats", out, w_out, n);
  /* The mask is really applied: with p > 0 some rows are not plain x + y. */
  if (p > 0 && n >= 64) {
    size_t dropped = 0;
    for (size_t i = 0; i < n; i++) dropped += sum[i] == x[i];
    if (!(dropped > 0 && dropped < n)) {
      nmt_test_fail(__FILE__, __LINE__, "p=%g: %zu of %zu elements dropped", (double)p, dropped,
                    n);
      goto out;
    }
  }

  /* ---- backward: the model's post-LN composition, from non-zero gradients ---- */
  TRY_OK(nmt_ref_layernorm_bwd(NULL, w_dr, w_dg, w_db, dout, w_sum, gamma, w_mu, w_rs, M,
                                      C));
  TRY_OK(nmt_ref_add(NULL, w_dx, w_dx, w_dr, n));
  TRY_OK(nmt_ref_dropout_bwd(NULL, w_dy, w_dr, n, p, seed, stream));

  TRY_OK(nmt_ref_residual_dropout_ln_bwd(NULL, dx, dy, dg, db, dout, sum, gamma, mu, rs, M,
                                                C, p, seed, stream));
  snprintf(what, sizeof what, "bwd dx, M=%d C=%d p=%g", M, C, (double)p);
  SAME_BITS(what, dx, w_dx, n);
  snprintf(what, sizeof what, "bwd dy, M=%d C=%d p=%g", M, C, (double)p);
  SAME_BITS(what, dy, w_dy, n);
  SAME_BITS("bwd dgamma", dg, w_dg, (size_t)C);
  SAME_BITS("bwd dbeta", db, w_db, (size_t)C);
  /* dy NULL (the model without dropout): dx, dgamma, dbeta as before. */
  TRY_OK(nmt_ref_residual_dropout_ln_bwd(NULL, dx2, NULL, dg2, db2, dout, sum, gamma, mu,
                                                rs, M, C, p, seed, stream));
  SAME_BITS("bwd dx, dy NULL", dx2, w_dx, n);
  SAME_BITS("bwd dgamma, dy NULL", dg2, w_dg, (size_t)C);
  SAME_BITS("bwd dbeta, dy NULL", db2, w_db, (size_t)C);
  /* Only the parameter gradients: dx and dy NULL. */
  memcpy(dg2, dg0, (size_t)C * sizeof *dg2);
  memcpy(db2, db0, (size_t)C * sizeof *db2);
  TRY_OK(nmt_ref_residual_dropout_ln_bwd(NULL, NULL, NULL, dg2, db2, dout, sum, gamma, mu,
                                                rs, M, C, p, seed, stream));
  SAME_BITS("bwd dgamma only", dg2, w_dg, (size_t)C);
  SAME_BITS("bwd dbeta only", db2, w_db, (size_t)C);

out:
  free(x), free(y), free(gamma), free(beta), free(dout), free(dx0), free(dy0), free(dg0);
  free(db0), free(w_o), free(w_sum), free(w_out), free(w_mu), free(w_rs), free(w_dr);
  free(w_dx), free(w_dy), free(w_dg), free(w_db), free(sum), free(out), free(mu), free(rs);
  free(dx), free(dy), free(dg), free(db), free(dx2), free(dg2), free(db2), free(sum2);
}

NMT_TEST(residual_matches_composition_bitwise) {
  for (size_t i = 0; i < sizeof cases / sizeof *cases && !nmt_test_failed(); i++)
    run_case(&cases[i], i + 1);
}

/* The test above can fail: a fused forward with another stream or seed is not the
 * composition's (the mask is keyed as dropout_fwd keys it, not by row alone). */
NMT_TEST(residual_mask_is_keyed_by_element) {
  enum { M = 6, C = 40 };
  float x[M * C], y[M * C], want[M * C], got[M * C], o[M * C];
  for (int i = 0; i < M * C; i++) x[i] = 0.0f, y[i] = 1.0f + (float)i;
  memcpy(o, y, sizeof o);
  NMT_ASSERT_OK(nmt_ref_dropout_fwd(NULL, o, o, M * C, 0.5f, 3, 4));
  NMT_ASSERT_OK(nmt_ref_add(NULL, want, x, o, M * C));
  NMT_ASSERT_OK(nmt_ref_residual_dropout_ln_fwd(NULL, NULL, got, NULL, NULL, x, y, NULL, NULL, M,
                                                C, 1e-5f, 0.5f, 3, 4));
  NMT_ASSERT(memcmp(got, want, sizeof got) == 0);
  NMT_ASSERT_OK(nmt_ref_residual_dropout_ln_fwd(NULL, NULL, got, NULL, NULL, x, y, NULL, NULL, M,
                                                C, 1e-5f, 0.5f, 3, 5));
  NMT_ASSERT(memcmp(got, want, sizeof got) != 0);
  /* Row r's elements are r*C + c: every row's mask differs from row 0's. */
  NMT_ASSERT_OK(nmt_ref_residual_dropout_ln_fwd(NULL, NULL, got, NULL, NULL, x, y, NULL, NULL, M,
                                                C, 1e-5f, 0.5f, 3, 4));
  for (int r = 1; r < M; r++) {
    int same = 1;
    for (int c = 0; c < C; c++) same &= (got[r * C + c] == 0.0f) == (got[c] == 0.0f);
    NMT_ASSERT(!same);
  }
}

NMT_TEST(residual_argument_errors) {
  float x[8] = {0}, y[8] = {0}, s[8], o[8], g[4] = {1, 1, 1, 1}, b[4] = {0}, mu[2], rs[2];
  float d[8] = {0}, dx[8] = {0}, dy[8] = {0};
  for (int r = 0; r < 2; r++) mu[r] = 0, rs[r] = 1;
  /* bad shapes and probabilities */
  NMT_ASSERT_EQ_STATUS(nmt_ref_residual_dropout_ln_fwd(NULL, o, s, mu, rs, x, y, g, b, -1, 4,
                                                       1e-5f, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_ref_residual_dropout_ln_fwd(NULL, o, s, mu, rs, x, y, g, b, 2, 0,
                                                       1e-5f, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  const float bad_p[3] = {1.0f, -0.1f, NAN};
  for (int i = 0; i < 3; i++) {
    NMT_ASSERT_EQ_STATUS(nmt_ref_residual_dropout_ln_fwd(NULL, o, s, mu, rs, x, y, g, b, 2, 4,
                                                         1e-5f, bad_p[i], 1, 2),
                         NMT_ERR_INTERNAL);
    NMT_ASSERT(strstr(nmt_last_error(), "dropout probability") != NULL);
    NMT_ASSERT_EQ_STATUS(nmt_ref_residual_dropout_ln_bwd(NULL, dx, dy, NULL, NULL, d, s, g, mu,
                                                         rs, 2, 4, bad_p[i], 1, 2),
                         NMT_ERR_INTERNAL);
  }
  NMT_ASSERT_EQ_STATUS(nmt_ref_residual_dropout_ln_bwd(NULL, dx, dy, NULL, NULL, d, s, g, mu, rs,
                                                       -1, 4, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_ref_residual_dropout_ln_bwd(NULL, dx, dy, NULL, NULL, d, s, g, mu, rs,
                                                       2, 0, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  /* missing outputs */
  NMT_ASSERT_EQ_STATUS(nmt_ref_residual_dropout_ln_fwd(NULL, o, NULL, mu, rs, x, y, g, b, 2, 4,
                                                       1e-5f, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_ref_residual_dropout_ln_fwd(NULL, NULL, s, mu, rs, x, y, g, b, 2, 4,
                                                       1e-5f, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_ref_residual_dropout_ln_fwd(NULL, o, s, mu, rs, x, y, g, NULL, 2, 4,
                                                       1e-5f, 0.1f, 1, 2),
                       NMT_ERR_INTERNAL);
  /* M = 0 is valid and writes nothing. */
  s[0] = 42.0f;
  NMT_ASSERT_OK(nmt_ref_residual_dropout_ln_fwd(NULL, o, s, mu, rs, x, y, g, b, 0, 4, 1e-5f, 0.1f,
                                                1, 2));
  NMT_ASSERT_OK(nmt_ref_residual_dropout_ln_bwd(NULL, dx, dy, NULL, NULL, d, s, g, mu, rs, 0, 4,
                                                0.1f, 1, 2));
  NMT_ASSERT(s[0] == 42.0f);
}
