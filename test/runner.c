/* test/runner.c — runs every registered test (see test/test.h) and prints the summary line.
 *
 * usage: test_nmt [FILTER...]: with no filter every test runs; otherwise the tests that match
 * any FILTER, each once, in name order. A FILTER matches the names that contain it, or, when
 * it ends in '$', the one name equal to it without the '$' (tools/gpu-check.sh first runs a
 * group as its exact names, so that cuda_train does not also run cuda_trainer_...). */
#include <dirent.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nmt/log.h"
#include "test.h"

#if defined(NMT_CUDA) && !defined(NMT_CUDA_TESTS_ON_REF)
#include <cuda_runtime_api.h>
#endif

#define MAX_TESTS 1024

typedef struct {
  const char *name;
  nmt_test_fn fn;
} test_entry;
static test_entry tests[MAX_TESTS];
static int n_tests;

static int cur_failed, cur_skipped;
static char cur_skip_reason[256];
static char cur_tmpdir[512];

void nmt_test_register(const char *name, nmt_test_fn fn) {
  if (n_tests < MAX_TESTS) {
    tests[n_tests].name = name;
    tests[n_tests].fn = fn;
    n_tests++;
  }
}

void nmt_test_fail(const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("# %s:%d: ", file, line);
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  fflush(stdout);
  cur_failed = 1;
}

void nmt_test_skip(const char *reason) {
  cur_skipped = 1;
  snprintf(cur_skip_reason, sizeof cur_skip_reason, "%s", reason);
}

int nmt_test_failed(void) { return cur_failed; }

const char *nmt_test_tmpdir(void) {
  if (!cur_tmpdir[0]) {
    const char *base = getenv("TMPDIR");
    snprintf(cur_tmpdir, sizeof cur_tmpdir, "%s/nmt-test-XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(cur_tmpdir)) {
      perror("mkdtemp");
      cur_tmpdir[0] = 0;
      return "/tmp";
    }
  }
  return cur_tmpdir;
}

const char *nmt_test_build_dir(void) {
  const char *d = getenv("NMT_BUILD_DIR");
  return d && *d ? d : "build";
}

static void rm_rf(const char *path) {
  struct stat st;
  if (lstat(path, &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    DIR *d = opendir(path);
    if (d) {
      struct dirent *e;
      while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char sub[1024];
        snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
        rm_rf(sub);
      }
      closedir(d);
    }
    rmdir(path);
  } else {
    unlink(path);
  }
}

static int close_impl(const char *file, int line, const char *what, const void *a, const void *b,
                      int is_double, size_t n, double atol, double rtol) {
  size_t wrong = 0, worst = 0;
  double worst_excess = -1, max_abs = 0, max_rel = 0;
  for (size_t i = 0; i < n; i++) {
    double x = is_double ? ((const double *)a)[i] : ((const float *)a)[i];
    double y = is_double ? ((const double *)b)[i] : ((const float *)b)[i];
    double d = fabs(x - y);
    double tol = atol + rtol * fabs(y);
    double rel = d / (fabs(y) > 0 ? fabs(y) : 1e-30);
    if (!(d <= tol)) { /* also catches NaN */
      wrong++;
      double excess = isnan(d) ? INFINITY : d - tol;
      if (excess > worst_excess) {
        worst_excess = excess;
        worst = i;
      }
    }
    if (d > max_abs || isnan(d)) max_abs = d;
    if (rel > max_rel || isnan(rel)) max_rel = rel;
  }
  if (wrong) {
    double x = is_double ? ((const double *)a)[worst] : ((const float *)a)[worst];
    double y = is_double ? ((const double *)b)[worst] : ((const float *)b)[worst];
    nmt_test_fail(file, line,
                  "%s: %zu of %zu wrong; worst [%zu] %.9g vs %.9g; max abs %.3g, max rel %.3g "
                  "(atol %g, rtol %g)",
                  what, wrong, n, worst, x, y, max_abs, max_rel, atol, rtol);
    return 0;
  }
  return 1;
}

int nmt_test_close(const char *file, int line, const char *what, const float *a, const float *b,
                   size_t n, double atol, double rtol) {
  return close_impl(file, line, what, a, b, 0, n, atol, rtol);
}

int nmt_test_close_d(const char *file, int line, const char *what, const double *a,
                     const double *b, size_t n, double atol, double rtol) {
  return close_impl(file, line, what, a, b, 1, n, atol, rtol);
}

/* NMT_TEST_SKIP="a,b": tests whose name contains any of the comma-separated substrings are
 * reported as skipped (the sanitizer runs leave out the long real-corpus training this way). */
static int skipped_by_env(const char *name) {
  const char *list = getenv("NMT_TEST_SKIP");
  if (!list) return 0;
  while (*list) {
    const char *end = strchr(list, ',');
    size_t n = end ? (size_t)(end - list) : strlen(list);
    char sub[256];
    if (n > 0 && n < sizeof sub) {
      memcpy(sub, list, n);
      sub[n] = 0;
      if (strstr(name, sub)) return 1;
    }
    if (!end) break;
    list = end + 1;
  }
  return 0;
}

/* NMT_EXPECT_GPU=1 (tools/gpu-check.sh sets it whenever nvidia-smi lists a GPU): the run is on
 * a machine that has a GPU, so a test that skips for want of one has not tested what it was run
 * for: it fails instead. Unset, empty or "0": such skips stay skips (every machine without a GPU,
 * CI included). */
static int expect_gpu(void) {
  const char *e = getenv("NMT_EXPECT_GPU");
  return e && *e && strcmp(e, "0") != 0;
}

/* The skip reasons that mean "no usable CUDA device here" (test/gpu_helpers.h, the model and
 * NCCL tests; a CPU-only build on a GPU machine is the same failure). "needs 2 GPUs" is not
 * among them: one GPU is a valid machine. */
static int skip_wants_gpu(const char *reason) {
  return strstr(reason, "no CUDA device") != NULL || strstr(reason, "CPU-only build") != NULL;
}

#if defined(NMT_CUDA) && !defined(NMT_CUDA_TESTS_ON_REF)
/* NMT_TEST_CUDA_RESET=1 (tools/gpu-check.sh under compute-sanitizer): destroy every device's
 * primary context before exit, so that memcheck's --leak-check reports what the tests left
 * allocated (compute-sanitizer reports leaks when the context is destroyed). */
static void reset_devices(void) {
  const char *e = getenv("NMT_TEST_CUDA_RESET");
  int n = 0;
  if (!e || !*e || !strcmp(e, "0") || cudaGetDeviceCount(&n) != cudaSuccess) return;
  for (int d = 0; d < n; d++)
    if (cudaSetDevice(d) == cudaSuccess) cudaDeviceReset();
}
#else
static void reset_devices(void) {}
#endif

/* 1 when name is selected by one of filters[0..n) (see the header); every name with n = 0. */
static int selected(const char *name, char **filters, int n) {
  if (n == 0) return 1;
  for (int i = 0; i < n; i++) {
    const char *f = filters[i];
    const size_t len = strlen(f);
    if (len > 0 && f[len - 1] == '$') {
      if (strlen(name) == len - 1 && !strncmp(name, f, len - 1)) return 1;
    } else if (strstr(name, f)) {
      return 1;
    }
  }
  return 0;
}

static int by_name(const void *a, const void *b) {
  return strcmp(((const test_entry *)a)->name, ((const test_entry *)b)->name);
}

int main(int argc, char **argv) {
  int passed = 0, failed = 0, skipped = 0, num = 0;
  /* Expected errors inside tests would flood the log; NMT_LOG=debug brings them back. */
  if (!getenv("NMT_LOG")) nmt_log_set_level((nmt_log_level)-1);
  qsort(tests, (size_t)n_tests, sizeof tests[0], by_name);
  setvbuf(stdout, NULL, _IOLBF, 0);
  for (int i = 0; i < n_tests; i++) {
    if (!selected(tests[i].name, argv + 1, argc - 1)) continue;
    num++;
    if (skipped_by_env(tests[i].name)) {
      printf("ok %d - %s # SKIP excluded by NMT_TEST_SKIP\n", num, tests[i].name);
      skipped++;
      continue;
    }
    cur_failed = cur_skipped = 0;
    cur_tmpdir[0] = 0;
    nmt_clear_error();
    tests[i].fn();
    if (cur_failed) {
      printf("not ok %d - %s\n", num, tests[i].name);
      failed++;
      if (cur_tmpdir[0]) printf("# kept %s\n", cur_tmpdir);
    } else if (cur_skipped && expect_gpu() && skip_wants_gpu(cur_skip_reason)) {
      printf("# NMT_EXPECT_GPU is set (a GPU machine), but the test skipped: %s\n",
             cur_skip_reason);
      printf("not ok %d - %s\n", num, tests[i].name);
      failed++;
    } else if (cur_skipped) {
      printf("ok %d - %s # SKIP %s\n", num, tests[i].name, cur_skip_reason);
      skipped++;
    } else {
      printf("ok %d - %s\n", num, tests[i].name);
      passed++;
    }
    if (!cur_failed && cur_tmpdir[0]) rm_rf(cur_tmpdir);
  }
  reset_devices();
  printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  return failed ? 1 : 0;
}
