/* test/test_reductions.c — the ref backend's small vector ops and reductions
 * (src/ref/reductions.c): add, axpy, sum_acc and sumsq in double, argmax's first index on ties.
 * (Names keep their historical misc_ prefix: the runbook and scripts select tests by name.) */
#include <stdint.h>
#include <stdlib.h>

#include "nmt/ref.h"
#include "test.h"

NMT_TEST(misc_add_axpy) {
  float a[33], b[33], out[33];
  for (int i = 0; i < 33; i++) a[i] = (float)i - 7.25f, b[i] = 0.5f * (float)i;
  NMT_ASSERT_OK(nmt_ref_add(NULL, out, a, b, 33));
  for (int i = 0; i < 33; i++) NMT_ASSERT(out[i] == a[i] + b[i]);
  NMT_ASSERT_OK(nmt_ref_add(NULL, a, a, b, 33)); /* out aliases a */
  NMT_ASSERT_CLOSE("add in place", a, out, 33, 0, 0);
  NMT_ASSERT_OK(nmt_ref_axpy(NULL, out, b, -2.0f, 33));
  for (int i = 0; i < 33; i++) NMT_ASSERT_NEAR(out[i], (double)i - 7.25 - 0.5 * i, 1e-6);
}

NMT_TEST(misc_sum_acc_sumsq_double) {
  /* 1e6 values of 0.1: a float running sum drifts by ~1e-2 relative, a double one does not. */
  enum { N = 1000000 };
  float *x = malloc(sizeof(float) * N);
  double s = 0, s2 = 0;
  for (int i = 0; i < N; i++) {
    x[i] = 0.1f + (float)(i % 3) * 0.01f;
    s += x[i];
    s2 += (double)x[i] * x[i];
  }
  float acc = 5.0f, sq = 123.0f;
  NMT_ASSERT_OK(nmt_ref_sum_acc(NULL, &acc, x, N));
  NMT_ASSERT_OK(nmt_ref_sum_acc(NULL, &acc, x, N));
  NMT_ASSERT_NEAR(acc, 5.0 + 2 * s, 1e-6 * (5.0 + 2 * s));
  NMT_ASSERT_OK(nmt_ref_sumsq(NULL, &sq, x, N)); /* overwrites */
  NMT_ASSERT_NEAR(sq, s2, 1e-6 * s2);
  free(x);
}

NMT_TEST(misc_argmax_first_on_ties) {
  float x[3 * 5] = {1, 3, 3, 2, 0, -5, -4, -4.5f, -4, -9, 7, 1, 2, 3, 7};
  int32_t out[3];
  NMT_ASSERT_OK(nmt_ref_argmax(NULL, out, x, 3, 5));
  NMT_ASSERT_EQ_INT(out[0], 1);
  NMT_ASSERT_EQ_INT(out[1], 1);
  NMT_ASSERT_EQ_INT(out[2], 0);
}
