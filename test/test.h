/* test/test.h — the one test registry and its assertions (libuv / nccl-tests style).
 *
 * A test is `NMT_TEST(name) { ... }` in any test/test_*.c; a constructor registers it, so adding
 * a file adds its tests. The runner (test/runner.c) prints one line per test: "ok N - name",
 * "not ok N - name" or "ok N - name # SKIP reason", then "N passed, N failed, N skipped".
 * `build/test_nmt [substring]` runs the tests whose name contains substring;
 * NMT_TEST_SKIP="sub1,sub2" reports the tests whose name contains any of them as skipped.
 * NMT_TEST_LONG=1 asks tests with a long variant (e.g. 200 kill -9 trials instead of 20) for it.
 * NMT_EXPECT_GPU=1 says the machine has a GPU (tools/gpu-check.sh sets it whenever nvidia-smi
 * lists one): a test that skips with a reason containing "no CUDA device" or "CPU-only build"
 * is then reported "not ok" and counted as failed, since on such a machine that skip means the
 * build or the driver is broken, not that the test does not apply. Skips by NMT_TEST_SKIP stay
 * skips. NMT_TEST_CUDA_RESET=1 (CUDA builds) resets every device after the last test, so that
 * compute-sanitizer's leak check sees the contexts destroyed.
 *
 * Assertions print both expressions and both values and fail the test (return from it).
 * NMT_ASSERT_CLOSE compares arrays with |a-b| <= atol + rtol*|b| and reports the number of
 * wrong elements, the worst index and the max abs/rel error with the tolerance used.
 *
 * defines: NMT_TEST, NMT_SKIP, NMT_ASSERT, NMT_ASSERT_EQ_INT, NMT_ASSERT_EQ_STATUS,
 *          NMT_ASSERT_NEAR, NMT_ASSERT_CLOSE, nmt_test_close, nmt_test_tmpdir, nmt_test_fail
 */
#ifndef NMT_TEST_H
#define NMT_TEST_H

#include <stddef.h>
#include <stdio.h>

#include "nmt/status.h"

typedef void (*nmt_test_fn)(void);
void nmt_test_register(const char *name, nmt_test_fn fn);
/* Marks the running test failed with a message (printed as a "# " comment line). */
void nmt_test_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Marks the running test skipped with a reason. */
void nmt_test_skip(const char *reason);
/* Non-zero once the running test has failed. */
int nmt_test_failed(void);
/* A fresh empty directory for the running test (under $TMPDIR), removed if the test passes. */
const char *nmt_test_tmpdir(void);
/* The directory holding the built nmt binary ("build"), from NMT_BUILD_DIR or default. */
const char *nmt_test_build_dir(void);
/* |a-b| <= atol + rtol*|b| over n elements; on failure records a message naming `what`, the
 * count of wrong elements, the worst index, both values and max abs/rel error. Returns 1 if
 * all close. */
int nmt_test_close(const char *file, int line, const char *what, const float *a, const float *b,
                   size_t n, double atol, double rtol);
int nmt_test_close_d(const char *file, int line, const char *what, const double *a,
                     const double *b, size_t n, double atol, double rtol);

#define NMT_TEST(name)                                                      \
  static void nmt_test_##name(void);                                        \
  __attribute__((constructor)) static void nmt_test_reg_##name(void) {      \
    nmt_test_register(#name, nmt_test_##name);                              \
  }                                                                         \
  static void nmt_test_##name(void)

#define NMT_SKIP(reason) \
  do {                   \
    nmt_test_skip(reason); \
    return;              \
  } while (0)

#define NMT_ASSERT(cond)                                              \
  do {                                                                \
    if (!(cond)) {                                                    \
      nmt_test_fail(__FILE__, __LINE__, "assertion failed: %s", #cond); \
      return;                                                         \
    }                                                                 \
  } while (0)

#define NMT_ASSERT_EQ_INT(a, b)                                                          \
  do {                                                                                   \
    long long nmt_a_ = (long long)(a), nmt_b_ = (long long)(b);                          \
    if (nmt_a_ != nmt_b_) {                                                              \
      nmt_test_fail(__FILE__, __LINE__, "%s == %s: %lld != %lld", #a, #b, nmt_a_, nmt_b_); \
      return;                                                                            \
    }                                                                                    \
  } while (0)

#define NMT_ASSERT_EQ_STATUS(a, b)                                                     \
  do {                                                                                 \
    nmt_status nmt_a_ = (a), nmt_b_ = (b);                                             \
    if (nmt_a_ != nmt_b_) {                                                            \
      nmt_test_fail(__FILE__, __LINE__, "%s == %s: %s != %s (last error: %s)", #a, #b, \
                    nmt_status_str(nmt_a_), nmt_status_str(nmt_b_), nmt_last_error()); \
      return;                                                                          \
    }                                                                                  \
  } while (0)

#define NMT_ASSERT_OK(expr) NMT_ASSERT_EQ_STATUS((expr), NMT_OK)

#define NMT_ASSERT_NEAR(a, b, tol)                                                          \
  do {                                                                                      \
    double nmt_a_ = (double)(a), nmt_b_ = (double)(b);                                      \
    if (!(nmt_a_ - nmt_b_ <= (tol) && nmt_b_ - nmt_a_ <= (tol))) {                          \
      nmt_test_fail(__FILE__, __LINE__, "%s ~= %s: %.9g vs %.9g (tol %g)", #a, #b, nmt_a_, \
                    nmt_b_, (double)(tol));                                                 \
      return;                                                                               \
    }                                                                                       \
  } while (0)

#define NMT_ASSERT_CLOSE(what, a, b, n, atol, rtol)                          \
  do {                                                                       \
    if (!nmt_test_close(__FILE__, __LINE__, (what), (a), (b), (n), (atol), (rtol))) \
      return;                                                                \
  } while (0)

#endif /* NMT_TEST_H */
