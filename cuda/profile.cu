/* cuda/profile.cu — the CUDA side of the profiler (include/nmt/cuda_prof.h): the device clock
 * that times a GPU worker's ranges with CUDA events, the Nsight capture window, the sampled
 * device memory peak, and the measured GEMM / copy peaks of a device (the table's profiling
 * entries; src/ref/profile.c is the reference counterpart).
 *
 * The clock follows nmt/prof.h's contract: mark() records an event on the context's stream
 * and never waits; resolve() is the one host wait of a sampled step. Unsampled steps never
 * reach it (prof.c calls mark and step_begin only between step_begin and step_end of a step in
 * the window), so outside the window the profiler adds no CUDA call at all. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_profiler_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "nmt/cuda_prof.h"

/* ------------------------------------------------------------------------------------------ */
/* device clock */

typedef struct {
  nmt_cuda_ctx *c;
  nmt_prof_track *t;
  cudaEvent_t anchor;
  cudaEvent_t *ev;   /* the pool: slot s holds mark base + s of the current step */
  uint32_t *gen;     /* gen[s] == step_gen: slot s was recorded in the current step */
  size_t n_ev;       /* events created */
  size_t max_ev;     /* 2 x track capacity: no step can need more */
  size_t base;       /* first mark index of the current step */
  uint32_t step_gen;
  int in_step;
  long last;         /* slot recorded last in this step (-1: none): done => all done */
  int64_t host0;     /* CLOCK_MONOTONIC ns at the step's begin: the anchor's host time */
  nmt_status err;    /* first failure inside mark/step_begin, returned by resolve */
  char err_msg[512];
} dev_clock;

static void clock_fail(dev_clock *k, nmt_status st) {
  if (k->err != NMT_OK) return;
  k->err = st;
  snprintf(k->err_msg, sizeof k->err_msg, "%s", nmt_last_error());
}

/* At least `need` events in the pool (need <= max_ev). */
static nmt_status clock_grow(dev_clock *k, size_t need) {
  if (need <= k->n_ev) return NMT_OK;
  size_t n = k->n_ev * 2 > need ? k->n_ev * 2 : need;
  if (n > k->max_ev) n = k->max_ev;
  cudaEvent_t *ev = (cudaEvent_t *)realloc(k->ev, n * sizeof *ev);
  if (!ev) return nmt_errorf(NMT_ERR_NOMEM, "cuda profiler: no memory for %zu events", n);
  k->ev = ev;
  uint32_t *gen = (uint32_t *)realloc(k->gen, n * sizeof *gen);
  if (!gen) return nmt_errorf(NMT_ERR_NOMEM, "cuda profiler: no memory for %zu events", n);
  k->gen = gen;
  NMT_TRY(nmt__cuda_enter(k->c, "prof clock"));
  while (k->n_ev < n) {
    /* Timing events: cudaEventDisableTiming would make cudaEventElapsedTime fail. */
    NMT_CUDA_TRY(cudaEventCreateWithFlags(&k->ev[k->n_ev], cudaEventDefault));
    k->gen[k->n_ev++] = 0;
  }
  return NMT_OK;
}

static void clock_step_begin(void *user, int64_t host_ns) {
  dev_clock *k = (dev_clock *)user;
  if (++k->step_gen == 0) { /* wrapped: no slot may look recorded in the new step */
    if (k->n_ev) memset(k->gen, 0, k->n_ev * sizeof *k->gen);
    k->step_gen = 1;
  }
  /* prof.c sets the step's first event before calling us; marks are 2e and 2e + 1. */
  k->base = 2 * nmt_prof_track_n_events(k->t);
  k->host0 = host_ns;
  k->last = -1;
  k->in_step = 1;
  if (k->err != NMT_OK) return;
  cudaError_t e = cudaEventRecord(k->anchor, k->c->stream);
  if (e != cudaSuccess)
    clock_fail(k, nmt__cuda_error(e, "cudaEventRecord (profiler anchor)", __FILE__, __LINE__));
}

static void clock_mark(void *user, size_t i) {
  dev_clock *k = (dev_clock *)user;
  /* A pop after step_end of a range left open, or of one pushed in an earlier step: such a
   * range cannot be resolved (nmt/prof.h), so it costs nothing here either. */
  if (!k->in_step || k->err != NMT_OK || i < k->base) return;
  const size_t s = i - k->base;
  if (s >= k->max_ev) return; /* beyond 2 x capacity: prof.c never marks there */
  if (s >= k->n_ev) {
    nmt_status st = clock_grow(k, s + 1);
    if (st != NMT_OK) {
      clock_fail(k, st);
      return;
    }
  }
  cudaError_t e = cudaEventRecord(k->ev[s], k->c->stream);
  if (e != cudaSuccess) {
    clock_fail(k, nmt__cuda_error(e, "cudaEventRecord (profiler mark)", __FILE__, __LINE__));
    return;
  }
  k->gen[s] = k->step_gen;
  k->last = (long)s;
}

static nmt_status clock_resolve(void *user, size_t first, size_t n, int64_t *t_ns) {
  dev_clock *k = (dev_clock *)user;
  k->in_step = 0;
  for (size_t j = 0; j < n; j++) t_ns[j] = -1;
  if (k->err != NMT_OK)
    return nmt_errorf(k->err, "cuda profiler, track '%s': %s", nmt_prof_track_name(k->t),
                      k->err_msg);
  if (k->last < 0) return NMT_OK;
  /* One stream: once the last recorded event is done, the anchor and every mark are. */
  NMT_CUDA_TRY(cudaEventSynchronize(k->ev[k->last]));
  for (size_t j = 0; j < n; j++) {
    const size_t i = first + j;
    if (i < k->base) continue;
    const size_t s = i - k->base;
    if (s >= k->n_ev || k->gen[s] != k->step_gen) continue;
    float ms = 0;
    NMT_CUDA_TRY(cudaEventElapsedTime(&ms, k->anchor, k->ev[s]));
    t_ns[j] = k->host0 + (int64_t)llround((double)ms * 1e6);
  }
  return NMT_OK;
}

void nmt_cuda_prof_clock_destroy(void *state) {
  dev_clock *k = (dev_clock *)state;
  if (!k) return;
  if (k->c) cudaSetDevice(k->c->device);
  for (size_t s = 0; s < k->n_ev; s++) cudaEventDestroy(k->ev[s]);
  if (k->anchor) cudaEventDestroy(k->anchor);
  free(k->ev);
  free(k->gen);
  free(k);
}

nmt_status nmt_cuda_prof_clock_create(void *ctx, nmt_prof_track *t, nmt_prof_clock *out,
                                      void **state) {
  *state = NULL;
  memset(out, 0, sizeof *out);
  NMT_TRY(nmt__cuda_enter(ctx, "prof_clock_create"));
  if (!t) return nmt_errorf(NMT_ERR_USAGE, "cuda profiler: the clock needs a track (NULL)");
  dev_clock *k = (dev_clock *)calloc(1, sizeof *k);
  if (!k) return nmt_errorf(NMT_ERR_NOMEM, "cuda profiler: out of host memory");
  k->c = nmt__cuda_ctx(ctx);
  k->t = t;
  k->last = -1;
  const size_t cap = nmt_prof_track_capacity(t);
  k->max_ev = 2 * cap;
  const nmt_prof *p = nmt_prof_track_profiler(t);
  const long start = nmt_prof_start_step(p), stop = nmt_prof_stop_step(p);
  const size_t window = start > 0 && stop >= start ? (size_t)(stop - start + 1) : 0;
  /* The pool serves one step at a time: the average step's marks, plus the usual extra. */
  size_t want = window > 0 && cap > 0 ? 2 * ((cap + window - 1) / window) + 2 : 0;
  if (want > k->max_ev) want = k->max_ev;
  cudaError_t e = cudaEventCreateWithFlags(&k->anchor, cudaEventDefault);
  nmt_status st = e == cudaSuccess
                      ? clock_grow(k, want)
                      : nmt__cuda_error(e, "cudaEventCreate (profiler anchor)", __FILE__, __LINE__);
  if (st != NMT_OK) {
    nmt_cuda_prof_clock_destroy(k);
    return st;
  }
  out->user = k;
  out->mark = clock_mark;
  out->step_begin = clock_step_begin;
  out->resolve = clock_resolve;
  *state = k;
  return NMT_OK;
}

nmt_status nmt_cuda_clock_create(void *ctx, nmt_prof_track *track, void **clock) {
  nmt_prof_clock clk;
  NMT_TRY(nmt_cuda_prof_clock_create(ctx, track, &clk, clock));
  nmt_status s = nmt_prof_track_set_clock(track, &clk);
  if (s != NMT_OK) {
    nmt_cuda_prof_clock_destroy(*clock);
    *clock = NULL;
  }
  return s;
}

void nmt_cuda_clock_destroy(void *clock) { nmt_cuda_prof_clock_destroy(clock); }

void *nmt_cuda_prof_stream(void *ctx) { return ctx ? (void *)nmt__cuda_ctx(ctx)->stream : NULL; }

/* ------------------------------------------------------------------------------------------ */
/* a known-duration kernel */

/* PTX ISA, "Special registers: %globaltimer": a 64-bit nanosecond timer, independent of the SM
 * clock (clock64 counts SM cycles, and boost clocks may exceed the reported peak). */
static __device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

static __global__ void spin_kernel(unsigned long long ns) {
  const unsigned long long t0 = global_ns();
  while (global_ns() - t0 < ns) {
  }
}
NMT_CUDA_PRELOAD(spin_kernel);

nmt_status nmt_cuda_prof_spin(void *ctx, double us) {
  NMT_TRY(nmt__cuda_enter(ctx, "prof_spin"));
  if (!(us >= 0 && us <= 1e8))
    return nmt_errorf(NMT_ERR_USAGE, "cuda prof_spin: %g us is outside [0, 1e8]", us);
  spin_kernel<<<1, 1, 0, nmt__cuda_ctx(ctx)->stream>>>((unsigned long long)ceil(us * 1e3));
  NMT_CUDA_LAUNCH_CHECK("spin_kernel");
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* capture window and memory */

nmt_status nmt_cuda_profiler_capture(int on) {
  cudaError_t e = on ? cudaProfilerStart() : cudaProfilerStop();
  if (e != cudaSuccess)
    return nmt__cuda_error(e, on ? "cudaProfilerStart" : "cudaProfilerStop", __FILE__, __LINE__);
  return NMT_OK;
}

nmt_status nmt_cuda_mem_peak_mb(void *ctx, double *mb) {
  const double prev = *mb;
  *mb = NAN;
  NMT_TRY(nmt__cuda_enter(ctx, "mem_peak_mb"));
  size_t free_b = 0, total_b = 0;
  NMT_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  const double used = (double)(total_b - free_b) / 1048576.0;
  *mb = prev >= used ? prev : used; /* a NAN prev compares false: the first sample */
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* measured peaks */

static const int PEAK_MAX_REPS = 32;

typedef struct {
  void *buf;
  cudaEvent_t ev[2 * PEAK_MAX_REPS];
  int n_ev;
} peak_res;

static __device__ __forceinline__ void store(float *p, float v) { *p = v; }
static __device__ __forceinline__ void store(__half *p, float v) { *p = __float2half_rn(v); }
static __device__ __forceinline__ void store(__nv_bfloat16 *p, float v) {
  *p = __float2bfloat16_rn(v);
}

/* Uniform-ish values in [-1, 1) from a hash of the index: nonzero data, since zeros would let
 * the tensor cores draw less power and clock higher than on real operands. */
template <typename T>
static __global__ void fill_kernel(T *x, size_t n, uint32_t seed) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 0x9E3779B1u ^ seed;
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    h ^= h >> 16;
    store(&x[i], (float)(h >> 8) * (1.0f / 8388608.0f) - 1.0f);
  }
}
NMT_CUDA_PRELOAD(fill_kernel<float>);
NMT_CUDA_PRELOAD(fill_kernel<__half>);
NMT_CUDA_PRELOAD(fill_kernel<__nv_bfloat16>);

template <typename T>
static nmt_status fill(nmt_cuda_ctx *c, void *x, size_t n, uint32_t seed) {
  fill_kernel<T><<<nmt__grid(n, 256), 256, 0, c->stream>>>((T *)x, n, seed);
  NMT_CUDA_LAUNCH_CHECK("fill_kernel");
  return NMT_OK;
}

/* Best time in ms of `reps` runs of op, each between two events; the runs are enqueued back to
 * back (the device never waits for the host between them), then the stream is synchronised. */
template <typename Op>
static nmt_status best_ms(nmt_cuda_ctx *c, peak_res *r, int reps, Op op, double *best) {
  for (int i = 0; i < reps; i++) {
    NMT_CUDA_TRY(cudaEventRecord(r->ev[2 * i], c->stream));
    NMT_TRY(op());
    NMT_CUDA_TRY(cudaEventRecord(r->ev[2 * i + 1], c->stream));
  }
  NMT_CUDA_TRY(cudaStreamSynchronize(c->stream));
  *best = INFINITY;
  for (int i = 0; i < reps; i++) {
    float ms = 0;
    NMT_CUDA_TRY(cudaEventElapsedTime(&ms, r->ev[2 * i], r->ev[2 * i + 1]));
    if (ms > 0 && ms < *best) *best = ms;
  }
  if (!isfinite(*best))
    return nmt_errorf(NMT_ERR_DEVICE, "cuda peaks: no run took measurable time");
  return NMT_OK;
}

/* Repetitions so that the timed runs take about `budget_ms`, from one run of t_ms. */
static int reps_for(double t_ms, double budget_ms) {
  const double r = t_ms > 0 ? budget_ms / t_ms : (double)PEAK_MAX_REPS;
  return r < 3 ? 3 : r > (double)PEAK_MAX_REPS ? PEAK_MAX_REPS : (int)r;
}

static nmt_status peaks_run(nmt_cuda_ctx *c, peak_res *r, nmt_precision mode, double *tflops,
                            double *gbps) {
  const cudaDataType_t ab = mode == NMT_PRECISION_FP16   ? CUDA_R_16F
                            : mode == NMT_PRECISION_BF16 ? CUDA_R_16BF
                                                         : CUDA_R_32F;
  const size_t elem = ab == CUDA_R_32F ? 4 : 2;
  /* 2 GiB: the 1 GiB copy's source and destination; the GEMM's A, B, C fit in it too. Halve
   * while the device cannot give that much (down to 256 MiB). */
  size_t total = (size_t)2 << 30;
  for (;;) {
    cudaError_t e = cudaMalloc(&r->buf, total);
    if (e == cudaSuccess) break;
    r->buf = NULL;
    (void)cudaGetLastError();
    if (e != cudaErrorMemoryAllocation || total <= ((size_t)256 << 20))
      return nmt__cuda_error(e, "cudaMalloc (peak measurement buffer)", __FILE__, __LINE__);
    total /= 2;
  }
  for (r->n_ev = 0; r->n_ev < 2 * PEAK_MAX_REPS; r->n_ev++)
    NMT_CUDA_TRY(cudaEventCreateWithFlags(&r->ev[r->n_ev], cudaEventDefault));

  /* GEMM: C(N,N) fp32 = op(A) B, the backend's path (transa as matmul_fwd uses it). */
  int N = 8192;
  while ((size_t)N * N * (2 * elem + 4) > total) N /= 2;
  const size_t nn = (size_t)N * N;
  char *A = (char *)r->buf, *B = A + nn * elem;
  float *C = (float *)(B + nn * elem);
  if (ab == CUDA_R_16F) {
    NMT_TRY(fill<__half>(c, A, nn, 1));
    NMT_TRY(fill<__half>(c, B, nn, 2));
  } else if (ab == CUDA_R_16BF) {
    NMT_TRY(fill<__nv_bfloat16>(c, A, nn, 1));
    NMT_TRY(fill<__nv_bfloat16>(c, B, nn, 2));
  } else {
    NMT_TRY(fill<float>(c, A, nn, 1));
    NMT_TRY(fill<float>(c, B, nn, 2));
  }
  auto gemm = [&]() {
    return nmt__cuda_gemm_ex(c, 1, 0, N, N, N, 1.0f, A, N, 0, B, N, 0, ab, 0.0f, C, N, 0, 1, 1);
  };
  /* The first call picks the algorithm and warms the clocks; one timed run sizes the rest. */
  NMT_TRY(gemm());
  double t_ms = 0;
  NMT_TRY(best_ms(c, r, 1, gemm, &t_ms));
  NMT_TRY(best_ms(c, r, reps_for(t_ms, 150), gemm, &t_ms));
  *tflops = 2.0 * (double)N * (double)N * (double)N / (t_ms * 1e-3) / 1e12;

  const size_t bytes = total / 2;
  char *src = (char *)r->buf, *dst = src + bytes;
  auto copy = [&]() -> nmt_status {
    NMT_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream));
    return NMT_OK;
  };
  NMT_TRY(copy());
  NMT_TRY(best_ms(c, r, 1, copy, &t_ms));
  NMT_TRY(best_ms(c, r, reps_for(t_ms, 100), copy, &t_ms));
  *gbps = 2.0 * (double)bytes / (t_ms * 1e-3) / 1e9;
  return NMT_OK;
}

nmt_status nmt_cuda_measure_peaks(void *ctx, nmt_precision mode, double *tflops, double *gbps) {
  *tflops = 0;
  *gbps = 0;
  NMT_TRY(nmt__cuda_enter(ctx, "measure_peaks"));
  if (mode != NMT_PRECISION_FP32 && mode != NMT_PRECISION_TF32 && mode != NMT_PRECISION_FP16 &&
      mode != NMT_PRECISION_BF16)
    return nmt_errorf(NMT_ERR_CONFIG, "cuda measure_peaks: unknown precision mode %d", (int)mode);
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  /* The GEMM path reads TF32 from the context: set the mode for the measurement only. */
  const nmt_precision saved = c->precision;
  c->precision = mode;
  peak_res r;
  memset(&r, 0, sizeof r);
  double tf = 0, gb = 0;
  nmt_status st = peaks_run(c, &r, mode, &tf, &gb);
  /* The stream may still run a GEMM if a later call failed: wait before freeing. */
  cudaStreamSynchronize(c->stream);
  for (int i = 0; i < r.n_ev; i++) cudaEventDestroy(r.ev[i]);
  cudaFree(r.buf);
  c->precision = saved;
  if (st == NMT_OK) {
    *tflops = tf;
    *gbps = gb;
  }
  return st;
}
