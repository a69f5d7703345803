/* prof_peak.c — the peaks of one CPU worker (nmt_prof_measure_cpu_peak, include/nmt/prof.h):
 * the roofline table's bound column and MFU when [profile] peak_tflops / peak_gbps are 0.
 * The FLOP/s peak is one core's fused multiply-add throughput (nmt_prof_cpu_fma_gflops), the
 * same figure bench/cpu-throughput.sh divides by for the PyTorch comparison. */
#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "nmt/prof.h"
#include "prof_impl.h"

/* OpenBLAS extensions; declared here too because a netlib cblas.h (another Debian
 * alternative) lacks them. */
int openblas_get_num_threads(void);
void openblas_set_num_threads(int num_threads);

/* ---- one core's fused multiply-add throughput --------------------------------------------- */

#if defined(__x86_64__) || defined(__i386__)
enum { CHAINS = 12 }; /* > FMA latency (4) x FMA pipes (2): the pipes never wait on a result */

__attribute__((target("avx2,fma"))) static double fma256_flops(long iters, float *sink) {
  __m256 acc[CHAINS];
  for (int j = 0; j < CHAINS; j++) acc[j] = _mm256_set1_ps((float)j);
  const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  for (long i = 0; i < iters; i++)
#pragma GCC unroll 12
    for (int j = 0; j < CHAINS; j++) acc[j] = _mm256_fmadd_ps(acc[j], b, c);
  float out[8];
  for (int j = 1; j < CHAINS; j++) acc[0] = _mm256_add_ps(acc[0], acc[j]);
  _mm256_storeu_ps(out, acc[0]);
  *sink += out[0];
  return 2.0 * 8 * CHAINS * (double)iters;
}

__attribute__((target("avx512f"))) static double fma512_flops(long iters, float *sink) {
  __m512 acc[CHAINS];
  for (int j = 0; j < CHAINS; j++) acc[j] = _mm512_set1_ps((float)j);
  const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  for (long i = 0; i < iters; i++)
#pragma GCC unroll 12
    for (int j = 0; j < CHAINS; j++) acc[j] = _mm512_fmadd_ps(acc[j], b, c);
  for (int j = 1; j < CHAINS; j++) acc[0] = _mm512_add_ps(acc[0], acc[j]);
  *sink += _mm512_reduce_add_ps(acc[0]);
  return 2.0 * 16 * CHAINS * (double)iters;
}

double nmt_prof_cpu_fma_gflops(void) {
  float sink = 0;
  double best = 0;
  for (int w = 0; w < 2; w++) {
    if (w == 0 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) continue;
    if (w == 1 && !__builtin_cpu_supports("avx512f")) continue;
    for (int r = 0; r < 5; r++) {
      const int64_t t0 = nmt__prof_host_ns();
      const double f = w == 0 ? fma256_flops(2000000, &sink) : fma512_flops(1000000, &sink);
      const double g = f / (double)(nmt__prof_host_ns() - t0); /* FLOP/ns = GFLOP/s */
      if (g > best) best = g;
    }
  }
  return sink == 12345.0f ? best + 1e-9 : best; /* keeps sink (and the loops) alive */
}
#else
double nmt_prof_cpu_fma_gflops(void) { return 0; }
#endif

/* The measurement is a property of the machine: made once per process (a test binary or an
 * embedding application creates many trainers) and shared, under a mutex. */
static pthread_mutex_t peak_mu = PTHREAD_MUTEX_INITIALIZER;
static int peak_done;
static double peak_tflops, peak_gbps;

static nmt_status measure(double *tflops, double *gbps);

nmt_status nmt_prof_measure_cpu_peak(double *tflops, double *gbps) {
  pthread_mutex_lock(&peak_mu);
  nmt_status s = NMT_OK;
  if (!peak_done) {
    s = measure(&peak_tflops, &peak_gbps);
    peak_done = s == NMT_OK;
  }
  *tflops = peak_done ? peak_tflops : 0;
  *gbps = peak_done ? peak_gbps : 0;
  pthread_mutex_unlock(&peak_mu);
  return s;
}

static nmt_status measure(double *tflops, double *gbps) {
  /* FLOP/s: the FMA throughput where nmt can time one (x86 with AVX2+FMA or AVX-512F).
   * Elsewhere a 512^3 sgemm on one OpenBLAS thread, always below the core's peak (packing,
   * edges): GEMM_WARM_S of untimed calls first (an idle core runs below its sustained clock
   * for a while), then the best of at least GEMM_REPS calls and GEMM_MIN_S. */
  enum { N = 512, GEMM_REPS = 8, COPY_REPS = 4 };
  const double GEMM_WARM_S = 0.03, GEMM_MIN_S = 0.08;
  const size_t copy_bytes = (size_t)64 << 20;
  const double fma = nmt_prof_cpu_fma_gflops();
  float *a = fma > 0 ? NULL : malloc(3 * (size_t)N * N * sizeof *a);
  char *src = malloc(copy_bytes), *dst = malloc(copy_bytes);
  if ((fma <= 0 && !a) || !src || !dst) {
    free(a);
    free(src);
    free(dst);
    return nmt_errorf(NMT_ERR_NOMEM, "profiler: no memory for the peak measurement");
  }
  if (fma > 0) {
    *tflops = fma / 1e3;
  } else {
    float *b = a + (size_t)N * N, *c = b + (size_t)N * N;
    for (size_t i = 0; i < 2 * (size_t)N * N; i++) a[i] = (float)(i % 7) * 0.25f - 0.75f;
    int threads = openblas_get_num_threads();
    openblas_set_num_threads(1);
    double best = INFINITY;
    const int64_t start = nmt__prof_host_ns();
    do /* warm-up: caches, code, the core's clock */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, N, N, 1.0f, a, N, b, N, 0.0f, c, N);
    while ((double)(nmt__prof_host_ns() - start) / 1e9 < GEMM_WARM_S);
    const int64_t timed = nmt__prof_host_ns();
    for (int r = 0; r < GEMM_REPS || (double)(nmt__prof_host_ns() - timed) / 1e9 < GEMM_MIN_S;
         r++) {
      int64_t t0 = nmt__prof_host_ns();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, N, N, 1.0f, a, N, b, N, 0.0f, c, N);
      double s = (double)(nmt__prof_host_ns() - t0) / 1e9;
      if (s < best) best = s;
    }
    openblas_set_num_threads(threads);
    *tflops = 2.0 * N * N * N / best / 1e12;
  }
  memset(src, 1, copy_bytes); /* first touch outside the timing */
  memset(dst, 0, copy_bytes);
  double best = INFINITY;
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
