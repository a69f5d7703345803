/* test/test_relu.c — ReLU forward vs a direct computation (in place too), backward vs central
 * finite differences, accumulation. */
#include <math.h>
#include <string.h>

#include "nmt/ref.h"
#include "test.h"

static uint64_t rng_state = 0x6a09e667f3bcc909ull;
static float rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (float)((rng_state >> 40) * 0x1p-24 * 2.0 - 1.0);
}

enum { N = 37 };

NMT_TEST(relu_fwd_and_in_place) {
  float x[N], out[N], want[N];
  for (int i = 0; i < N; i++) x[i] = rnd(), want[i] = x[i] > 0 ? x[i] : 0;
  NMT_ASSERT_OK(nmt_ref_relu_fwd(NULL, out, x, N));
  NMT_ASSERT_CLOSE("relu out", out, want, N, 0, 0);
  NMT_ASSERT_OK(nmt_ref_relu_fwd(NULL, x, x, N));
  NMT_ASSERT_CLOSE("relu in place", x, want, N, 0, 0);
}

NMT_TEST(relu_bwd_fd_and_accumulate) {
  float x[N], out[N], R[N], d[N], base[N];
  double g[N], got[N];
  /* Keep inputs away from the kink so central differences are exact. */
  for (int i = 0; i < N; i++) {
    x[i] = rnd();
    if (fabsf(x[i]) < 0.05f) x[i] = 0.5f;
    R[i] = rnd(), base[i] = d[i] = rnd();
  }
  const double h = 1e-3;
  for (int i = 0; i < N; i++) {
    double lp = fmax(x[i] + h, 0) * R[i], lm = fmax(x[i] - h, 0) * R[i];
    g[i] = (lp - lm) / (2 * h);
  }
  NMT_ASSERT_OK(nmt_ref_relu_fwd(NULL, out, x, N));
  NMT_ASSERT_OK(nmt_ref_relu_bwd(NULL, d, R, out, N));
  NMT_ASSERT_OK(nmt_ref_relu_bwd(NULL, d, R, out, N));
  for (int i = 0; i < N; i++) got[i] = ((double)d[i] - base[i]) / 2;
  nmt_test_close_d(__FILE__, __LINE__, "relu dinp", got, g, N, 1e-6, 1e-5);
}
