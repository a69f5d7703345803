/* test/test_adamw.c — AdamW against a straightforward double implementation of Kingma & Ba
 * alg. 1 with bias correction and decoupled weight decay, over three steps. */
#include <math.h>

#include "nmt/ref.h"
#include "test.h"

static uint64_t rng_state = 0x3c6ef372fe94f82bull;
static float rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (float)((rng_state >> 40) * 0x1p-24 * 2.0 - 1.0);
}

enum { N = 50 };

NMT_TEST(adamw_three_steps_vs_double) {
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.98f, eps = 1e-9f, wd = 0.1f, gs = 0.25f;
  float p[N], m[N] = {0}, v[N] = {0}, g[N];
  double pd[N], md[N] = {0}, vd[N] = {0}, got[N];
  for (int i = 0; i < N; i++) pd[i] = p[i] = rnd();
  for (long t = 1; t <= 3; t++) {
    for (int i = 0; i < N; i++) g[i] = 4 * rnd();
    NMT_ASSERT_OK(nmt_ref_adamw(NULL, p, g, m, v, N, lr, b1, b2, eps, wd, gs, NULL, NULL, t));
    for (int i = 0; i < N; i++) {
      double gi = (double)g[i] * gs;
      md[i] = b1 * md[i] + (1 - (double)b1) * gi;
      vd[i] = b2 * vd[i] + (1 - (double)b2) * gi * gi;
      double mh = md[i] / (1 - pow(b1, (double)t)), vh = vd[i] / (1 - pow(b2, (double)t));
      pd[i] -= lr * (mh / (sqrt(vh) + eps) + wd * pd[i]);
    }
    for (int i = 0; i < N; i++) got[i] = m[i];
    if (!nmt_test_close_d(__FILE__, __LINE__, "adamw m", got, md, N, 1e-6, 1e-5)) return;
    for (int i = 0; i < N; i++) got[i] = v[i];
    if (!nmt_test_close_d(__FILE__, __LINE__, "adamw v", got, vd, N, 1e-8, 1e-5)) return;
    for (int i = 0; i < N; i++) got[i] = p[i];
    if (!nmt_test_close_d(__FILE__, __LINE__, "adamw params", got, pd, N, 1e-6, 1e-5)) return;
  }
}

NMT_TEST(adamw_bad_step) {
  float p = 1, g = 1, m = 0, v = 0;
  NMT_ASSERT_EQ_STATUS(
      nmt_ref_adamw(NULL, &p, &g, &m, &v, 1, 1e-3f, 0.9f, 0.98f, 1e-9f, 0, 1, NULL, NULL, 0),
      NMT_ERR_INTERNAL);
}
