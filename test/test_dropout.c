/* test/test_dropout.c — counter-based dropout: mask = f(seed, stream, index) (determinism,
 * stream independence, agreement with nmt_rng_uniform at any offset), keep rate, scaling,
 * forward/backward mask agreement, accumulation, p = 0 and bad p. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

enum { N = 100000 };

static float *ramp(size_t n) { /* nonzero inputs so a kept element is never 0 */
  float *x = malloc(sizeof(float) * n);
  for (size_t i = 0; i < n; i++) x[i] = 0.5f + (float)(i % 97) / 97.0f;
  return x;
}

NMT_TEST(dropout_keep_matches_uniform) {
  /* Offsets and lengths cover the unaligned head, the multi-block body, the tail, and block
   * counters that carry into the high 32-bit counter word. */
  uint8_t keep[203];
  uint64_t offsets[] = {0, 1, 2, 3, 5, 1000003, 0xfffffffffffull, (0xffffffffull << 2) - 37};
  size_t lens[] = {203, 32, 31, 1, 97};
  for (size_t o = 0; o < sizeof offsets / sizeof offsets[0]; o++)
    for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++) {
      nmt_ref_dropout_keep(keep, offsets[o], lens[l], 0.37f, 0x1234567890ull, 88);
      for (size_t i = 0; i < lens[l]; i++)
        NMT_ASSERT_EQ_INT(keep[i], nmt_rng_uniform(0x1234567890ull, 88, offsets[o] + i) >= 0.37f);
    }
}

NMT_TEST(dropout_fwd_rate_scale_determinism) {
  const float p = 0.1f;
  float *x = ramp(N), *a = malloc(sizeof(float) * N), *b = malloc(sizeof(float) * N);
  float *c = malloc(sizeof(float) * N);
  NMT_ASSERT_OK(nmt_ref_dropout_fwd(NULL, a, x, N, p, 5, nmt_rng_stream(1, 2)));
  NMT_ASSERT_OK(nmt_ref_dropout_fwd(NULL, b, x, N, p, 5, nmt_rng_stream(1, 2)));
  NMT_ASSERT_OK(nmt_ref_dropout_fwd(NULL, c, x, N, p, 5, nmt_rng_stream(1, 3)));
  NMT_ASSERT(memcmp(a, b, sizeof(float) * N) == 0);
  size_t kept = 0, differ = 0;
  const float scale = 1.0f / (1.0f - p);
  for (size_t i = 0; i < N; i++) {
    int k = nmt_rng_uniform(5, nmt_rng_stream(1, 2), i) >= p;
    NMT_ASSERT(a[i] == (k ? x[i] * scale : 0.0f));
    kept += a[i] != 0.0f;
    differ += (a[i] != 0.0f) != (c[i] != 0.0f);
  }
  /* 5 standard errors of a binomial proportion around 1 - p. */
  double rate = (double)kept / N, se = sqrt(p * (1 - p) / N);
  NMT_ASSERT_NEAR(rate, 1.0 - p, 5 * se);
  /* Independent streams disagree on 2p(1-p) = 18% of elements. */
  NMT_ASSERT_NEAR((double)differ / N, 2 * p * (1 - p), 0.01);
  free(x), free(a), free(b), free(c);
}

NMT_TEST(dropout_bwd_matches_fwd_mask) {
  const float p = 0.3f;
  float *x = ramp(N), *out = malloc(sizeof(float) * N), *d = malloc(sizeof(float) * N);
  float *dout = ramp(N);
  NMT_ASSERT_OK(nmt_ref_dropout_fwd(NULL, out, x, N, p, 11, 12));
  for (size_t i = 0; i < N; i++) d[i] = 1.0f;
  NMT_ASSERT_OK(nmt_ref_dropout_bwd(NULL, d, dout, N, p, 11, 12));
  NMT_ASSERT_OK(nmt_ref_dropout_bwd(NULL, d, dout, N, p, 11, 12));
  const float scale = 1.0f / (1.0f - p);
  for (size_t i = 0; i < N; i++) {
    float want = 1.0f + (out[i] != 0.0f ? 2.0f * (dout[i] * scale) : 0.0f);
    if (fabsf(d[i] - want) > 1e-6f * fabsf(want)) {
      nmt_test_fail(__FILE__, __LINE__, "dinp[%zu] = %g, want %g", i, (double)d[i],
                    (double)want);
      break;
    }
  }
  free(x), free(out), free(d), free(dout);
}

NMT_TEST(dropout_in_place_and_p0) {
  float *x = ramp(1000), *y = ramp(1000), *z = malloc(sizeof(float) * 1000);
  NMT_ASSERT_OK(nmt_ref_dropout_fwd(NULL, z, x, 1000, 0.5f, 1, 2));
  NMT_ASSERT_OK(nmt_ref_dropout_fwd(NULL, x, x, 1000, 0.5f, 1, 2));
  NMT_ASSERT(memcmp(x, z, sizeof(float) * 1000) == 0);
  NMT_ASSERT_OK(nmt_ref_dropout_fwd(NULL, z, y, 1000, 0.0f, 1, 2));
  NMT_ASSERT(memcmp(y, z, sizeof(float) * 1000) == 0);
  NMT_ASSERT_EQ_STATUS(nmt_ref_dropout_fwd(NULL, z, y, 1000, 1.0f, 1, 2), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_ref_dropout_bwd(NULL, z, y, 1000, -0.1f, 1, 2), NMT_ERR_INTERNAL);
  free(x), free(y), free(z);
}
