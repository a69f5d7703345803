/* prof_peak.c — the peaks of one CPU worker (nmt_prof_measure_cpu_peak, include/nmt/prof.h):
 * the roofline table's bound column and MFU when [profile] peak_tflops / peak_gbps are 0. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/prof.h"
#include "prof_impl.h"

/* OpenBLAS extensions; declared here too because a netlib cblas.h (another Debian
 * alternative) lacks them. */
int openblas_get_num_threads(void);
void openblas_set_num_threads(int num_threads);

nmt_status nmt_prof_measure_cpu_peak(double *tflops, double *gbps) {
  enum { N = 512, GEMM_REPS = 8, COPY_REPS = 4 };
  const size_t copy_bytes = (size_t)64 << 20;
  float *a = malloc(3 * (size_t)N * N * sizeof *a);
  char *src = malloc(copy_bytes), *dst = malloc(copy_bytes);
  if (!a || !src || !dst) {
    free(a);
    free(src);
    free(dst);
    return nmt_errorf(NMT_ERR_NOMEM, "profiler: no memory for the peak measurement");
  }
  float *b = a + (size_t)N * N, *c = b + (size_t)N * N;
  for (size_t i = 0; i < 2 * (size_t)N * N; i++) a[i] = (float)(i % 7) * 0.25f - 0.75f;
  int threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
  double best = INFINITY;
  for (int r = 0; r < GEMM_REPS + 1; r++) { /* the first call warms caches and code */
    int64_t t0 = nmt__prof_host_ns();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, N, N, 1.0f, a, N, b, N, 0.0f, c, N);
    double s = (double)(nmt__prof_host_ns() - t0) / 1e9;
    if (r > 0 && s < best) best = s;
  }
  openblas_set_num_threads(threads);
  *tflops = 2.0 * N * N * N / best / 1e12;
  memset(src, 1, copy_bytes); /* first touch outside the timing */
  memset(dst, 0, copy_bytes);
  best = INFINITY;
  for (int r = 0; r < COPY_REPS; r++) {
    src[r] = (char)r; /* a different copy each time, so none can be elided */
    int64_t t0 = nmt__prof_host_ns();
    memcpy(dst, src, copy_bytes);
    double s = (double)(nmt__prof_host_ns() - t0) / 1e9;
    if (dst[r] != (char)r) s = INFINITY;
    if (s < best) best = s;
  }
  *gbps = 2.0 * (double)copy_bytes / best / 1e9;
  free(a);
  free(src);
  free(dst);
  return NMT_OK;
}
