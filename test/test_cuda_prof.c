/* test/test_cuda_prof.c — the CUDA side of the profiler (nmt/cuda_prof.h): the device clock
 * against known-duration kernels and the host clock, the capture window, the memory peak and
 * the measured peaks.
 *
 * The device clock's times are checked against bounds that do not come from it: a range
 * around a spin kernel of d us (the kernel reads the GPU's nanosecond %globaltimer) lasts at
 * least d; every resolved time lies between the host time before the step began and the host
 * time after its step_end returned (the anchor cannot run before the host records it, and the
 * host has waited for the last mark); nesting and sequence order hold. The device is made to
 * run behind the host before a step, so the anchor's conversion is exercised when the queue is
 * not empty.
 *
 * Without a CUDA device (or in a CPU-only build) every GPU test prints "# SKIP no CUDA device";
 * what fails without a context is checked either way. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nmt/backend.h"
#include "nmt/cuda_prof.h"
#include "nmt/prof.h"
#include "test.h"

static int64_t host_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* 1: a context on device 0 in *ctx; 0: no CUDA backend or device (skip); -1: failure. */
static int open_device(const nmt_backend **be, void **ctx) {
  *ctx = NULL;
  *be = nmt_backend_cuda_get();
  int n = 0;
  if (!*be || (*be)->device_count(&n) != NMT_OK || n < 1) return 0;
  nmt_status s = (*be)->ctx_create(0, ctx);
  if (s != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "ctx_create(0): %s: %s", nmt_status_str(s),
                  nmt_last_error());
    return -1;
  }
  return 1;
}

#define GPU_PROF_TEST(name)                                   \
  static void name##_body(const nmt_backend *be, void *ctx);  \
  NMT_TEST(name) {                                            \
    const nmt_backend *be;                                    \
    void *ctx;                                                \
    int r = open_device(&be, &ctx);                           \
    if (r == 0) NMT_SKIP("no CUDA device");                   \
    if (r > 0) name##_body(be, ctx);                          \
    if (ctx) be->ctx_destroy(ctx);                            \
  }                                                           \
  static void name##_body(const nmt_backend *be, void *ctx)

/* A profiler with window [start, stop] and one track "gpu0" timed by the device clock of
 * ctx. Returns 0 (and records a failure) on error. */
typedef struct {
  nmt_prof *p;
  nmt_prof_track *t;
  void *clock;
} prof_setup;

static int prof_open(prof_setup *s, void *ctx, long start, long stop, size_t per_step) {
  memset(s, 0, sizeof *s);
  nmt_prof_options o;
  nmt_prof_options_default(&o);
  o.start_step = start;
  o.stop_step = stop;
  o.nvtx = 0;
  nmt_prof_clock clk;
  nmt_status st = nmt_prof_create(&o, &s->p);
  if (st == NMT_OK) st = nmt_prof_add_track(s->p, "gpu0", per_step, &s->t);
  if (st == NMT_OK) st = nmt_cuda_prof_clock_create(ctx, s->t, &clk, &s->clock);
  if (st == NMT_OK) st = nmt_prof_track_set_clock(s->t, &clk);
  if (st != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "profiler setup: %s: %s", nmt_status_str(st),
                  nmt_last_error());
    return 0;
  }
  return 1;
}

static void prof_close(prof_setup *s) {
  nmt_cuda_prof_clock_destroy(s->clock);
  nmt_prof_destroy(s->p);
}

static int intern(nmt_prof *p, const char *name) {
  int id = -1;
  if (nmt_prof_intern(p, name, &id) != NMT_OK) return -1;
  return id;
}

/* A range of d_us device time (spin kernel inside push/pop); d_us = 0: an empty range. */
static nmt_status spin_range(nmt_prof_track *t, void *ctx, int name, double d_us) {
  nmt_prof_push(t, name, NMT_PROF_OTHER, 0, 0);
  nmt_status s = d_us > 0 ? nmt_cuda_prof_spin(ctx, d_us) : NMT_OK;
  nmt_prof_pop(t);
  return s;
}

/* Without a context nothing works, and says so; without a device the capture fails too. */
NMT_TEST(cuda_prof_without_context) {
  double mb = 123, tf = 1, gb = 1;
  NMT_ASSERT(nmt_cuda_mem_peak_mb(NULL, &mb) != NMT_OK);
  NMT_ASSERT(isnan(mb));
  NMT_ASSERT(nmt_cuda_measure_peaks(NULL, NMT_PRECISION_BF16, &tf, &gb) != NMT_OK);
  NMT_ASSERT(tf == 0 && gb == 0);
  NMT_ASSERT(nmt_cuda_prof_spin(NULL, 1) != NMT_OK);
  NMT_ASSERT(nmt_cuda_prof_stream(NULL) == NULL);
  nmt_prof_options o;
  nmt_prof_options_default(&o);
  o.start_step = 1;
  nmt_prof *p;
  nmt_prof_track *t;
  NMT_ASSERT_OK(nmt_prof_create(&o, &p));
  nmt_status s = nmt_prof_add_track(p, "gpu0", 4, &t);
  nmt_prof_clock clk = {.user = &mb};
  void *state = &mb;
  nmt_status cs = NMT_OK;
  if (s == NMT_OK) cs = nmt_cuda_prof_clock_create(NULL, t, &clk, &state);
  nmt_prof_destroy(p);
  NMT_ASSERT_OK(s);
  NMT_ASSERT(cs != NMT_OK);
  NMT_ASSERT(state == NULL && clk.mark == NULL && clk.resolve == NULL);
  nmt_cuda_prof_clock_destroy(NULL);

  const nmt_backend *be = nmt_backend_cuda_get();
  int n = 0;
  if (be) NMT_ASSERT_OK(be->device_count(&n));
  if (n == 0) {
    NMT_ASSERT_EQ_STATUS(nmt_cuda_profiler_capture(1), NMT_ERR_DEVICE);
    NMT_ASSERT_EQ_STATUS(nmt_cuda_profiler_capture(0), NMT_ERR_DEVICE);
  }
}

/* One sampled step: outer > [spin of 5 ms, empty range], behind 20 ms of queued device work. */
GPU_PROF_TEST(cuda_prof_clock_spin) {
  (void)be;
  const double spin_us = 5000;
  prof_setup s;
  if (!prof_open(&s, ctx, 1, 1, 8)) return;
  int outer = intern(s.p, "outer"), spin = intern(s.p, "spin"), gap = intern(s.p, "gap");
  NMT_ASSERT(outer >= 0 && spin >= 0 && gap >= 0);
  NMT_ASSERT(nmt_cuda_prof_stream(ctx) != NULL);
  nmt_status st = nmt_cuda_prof_spin(ctx, 20000); /* the device runs behind the host */
  const int64_t epoch = nmt_prof_epoch_ns(s.p), h0 = host_ns() - epoch;
  nmt_prof_step_begin(s.t, 1);
  nmt_prof_push(s.t, outer, NMT_PROF_OTHER, 0, 0);
  if (st == NMT_OK) st = spin_range(s.t, ctx, spin, spin_us);
  if (st == NMT_OK) st = spin_range(s.t, ctx, gap, 0);
  nmt_prof_pop(s.t);
  if (st == NMT_OK) st = nmt_prof_step_end(s.t);
  const int64_t h1 = host_ns() - epoch;
  nmt_prof_event e[3];
  size_t n = nmt_prof_track_n_events(s.t);
  for (size_t i = 0; i < n && i < 3; i++) nmt_prof_track_event(s.t, i, &e[i]);
  prof_close(&s);
  NMT_ASSERT_OK(st);
  NMT_ASSERT_EQ_INT(n, 3);
  const int64_t slack = 50000; /* ns: event resolution (~0.5 us) and rounding */
  printf("# device clock: outer %.3f ms, spin %.3f ms (>= %.3f), gap %.4f ms; host step %.3f "
         "ms\n", (e[0].t1_ns - e[0].t0_ns) / 1e6, (e[1].t1_ns - e[1].t0_ns) / 1e6, spin_us / 1e3,
         (e[2].t1_ns - e[2].t0_ns) / 1e6, (h1 - h0) / 1e6);
  NMT_ASSERT(h0 <= e[0].t0_ns);
  NMT_ASSERT(e[0].t0_ns <= e[1].t0_ns);
  NMT_ASSERT(e[1].t0_ns <= e[1].t1_ns);
  NMT_ASSERT(e[1].t1_ns <= e[2].t0_ns);
  NMT_ASSERT(e[2].t0_ns <= e[2].t1_ns);
  NMT_ASSERT(e[2].t1_ns <= e[0].t1_ns);
  NMT_ASSERT(e[0].t1_ns <= h1 + slack);
  NMT_ASSERT((double)(e[1].t1_ns - e[1].t0_ns) >= spin_us * 1e3 - (double)slack);
  /* step_end waited for the device: the queued 20 ms and the spin are behind it. */
  NMT_ASSERT((double)(h1 - h0) >= (20000 + spin_us - 1000) * 1e3);
  NMT_ASSERT_EQ_INT(e[1].parent, 0);
  NMT_ASSERT_EQ_INT(e[2].parent, 0);
}

/* Several sampled steps reuse the event pool; a step with more ranges than the average grows
 * it; unsampled steps record nothing; a range left open at step_end is not resolved. */
GPU_PROF_TEST(cuda_prof_clock_steps) {
  (void)be;
  prof_setup s;
  /* Window 2..4, 2 events per step: capacity 6, a pool for 2 events (+1) per step. */
  if (!prof_open(&s, ctx, 2, 4, 2)) return;
  int a = intern(s.p, "a");
  NMT_ASSERT(a >= 0);
  const int n_ranges[5] = {1, 1, 4, 1, 1}; /* steps 1..5 */
  const double d_us = 300;
  nmt_status st = NMT_OK;
  int64_t begin[6] = {0};
  for (long step = 1; step <= 5 && st == NMT_OK; step++) {
    begin[step] = host_ns() - nmt_prof_epoch_ns(s.p);
    nmt_prof_step_begin(s.t, step);
    for (int r = 0; r < n_ranges[step - 1] && st == NMT_OK; r++) {
      if (step == 4) { /* open across step_end */
        nmt_prof_push(s.t, a, NMT_PROF_OTHER, 0, 0);
        st = nmt_cuda_prof_spin(ctx, d_us);
      } else {
        st = spin_range(s.t, ctx, a, d_us);
      }
    }
    if (st == NMT_OK) st = nmt_prof_step_end(s.t);
    if (step == 4) nmt_prof_pop(s.t);
  }
  nmt_prof_event e[6];
  size_t n = nmt_prof_track_n_events(s.t);
  for (size_t i = 0; i < n && i < 6; i++) nmt_prof_track_event(s.t, i, &e[i]);
  nmt_prof_summary sum;
  nmt_prof_row *rows = NULL;
  int n_rows = 0;
  if (st == NMT_OK) st = nmt_prof_summarize(s.p, 0, 0, &sum, &rows, &n_rows);
  free(rows);
  long steps = nmt_prof_track_n_steps(s.t);
  prof_close(&s);
  NMT_ASSERT_OK(st);
  NMT_ASSERT_EQ_INT(steps, 3);
  NMT_ASSERT_EQ_INT(n, 6);
  NMT_ASSERT_EQ_INT(sum.unclosed, 1);
  const long want_step[6] = {2, 3, 3, 3, 3, 4};
  for (int i = 0; i < 6; i++) {
    NMT_ASSERT_EQ_INT(e[i].step, want_step[i]);
    NMT_ASSERT(e[i].t0_ns >= begin[e[i].step]);
    if (i == 5) break;
    NMT_ASSERT((double)(e[i].t1_ns - e[i].t0_ns) >= d_us * 1e3 - 50000);
    NMT_ASSERT(e[i].t1_ns <= e[i + 1].t0_ns); /* sequential, also across steps */
  }
  NMT_ASSERT(e[5].t1_ns < 0); /* never closed inside its step */
}

GPU_PROF_TEST(cuda_prof_peaks) {
  (void)be;
  const nmt_precision modes[3] = {NMT_PRECISION_BF16, NMT_PRECISION_TF32, NMT_PRECISION_FP32};
  const char *names[3] = {"bf16", "tf32", "fp32"};
  double tf[3], gb[3];
  for (int m = 0; m < 3; m++) {
    int64_t t0 = host_ns();
    NMT_ASSERT_OK(nmt_cuda_measure_peaks(ctx, modes[m], &tf[m], &gb[m]));
    printf("# peaks %s: %.1f TFLOP/s, %.0f GB/s (%.2f s)\n", names[m], tf[m], gb[m],
           (double)(host_ns() - t0) / 1e9);
    /* Timings never decide a test: no floor and no ordering of the modes (under
     * compute-sanitizer the fp32 peak measured 0.9 TFLOP/s, and tensor cores need not beat fp32
     * there). What is checked is that a figure was measured: finite and positive, and under a
     * bound no device reaches (1e4 TFLOP/s, 1e5 GB/s), which a figure inflated by a unit
     * error would cross (an H100's figures x1000 do) while a slow run never can. */
    NMT_ASSERT(isfinite(tf[m]) && tf[m] > 0 && tf[m] < 1e4);
    NMT_ASSERT(isfinite(gb[m]) && gb[m] > 0 && gb[m] < 1e5);
  }
  printf("# bf16 / fp32 GEMM peak: %.1fx (not asserted)\n", tf[0] / tf[2]);
  double x = 1, y = 1;
  NMT_ASSERT_EQ_STATUS(nmt_cuda_measure_peaks(ctx, (nmt_precision)99, &x, &y), NMT_ERR_CONFIG);
  NMT_ASSERT(x == 0 && y == 0);
}

/* The peak is the largest sample: it rises with an allocation and stays after the free. */
GPU_PROF_TEST(cuda_prof_mem_peak) {
  double mb = NAN;
  NMT_ASSERT_OK(nmt_cuda_mem_peak_mb(ctx, &mb));
  NMT_ASSERT(isfinite(mb) && mb > 0);
  const double before = mb;
  const size_t bytes = (size_t)512 << 20;
  void *p = NULL;
  NMT_ASSERT_OK(be->malloc(ctx, bytes, &p));
  nmt_status st = be->memset_zero(ctx, p, bytes);
  if (st == NMT_OK) st = be->synchronize(ctx);
  if (st == NMT_OK) st = nmt_cuda_mem_peak_mb(ctx, &mb);
  const double with = mb;
  be->free(ctx, p);
  if (st == NMT_OK) st = nmt_cuda_mem_peak_mb(ctx, &mb);
  NMT_ASSERT_OK(st);
  printf("# memory: %.0f MiB, %.0f with 512 MiB more, peak %.0f after the free\n", before, with,
         mb);
  NMT_ASSERT(with >= before + 0.9 * 512);
  NMT_ASSERT(mb >= with); /* a peak, not the current use */
}

GPU_PROF_TEST(cuda_prof_capture) {
  (void)be;
  (void)ctx;
  NMT_ASSERT_OK(nmt_cuda_profiler_capture(1));
  NMT_ASSERT_OK(nmt_cuda_profiler_capture(1)); /* a second start has no effect */
  NMT_ASSERT_OK(nmt_cuda_profiler_capture(0));
  NMT_ASSERT_OK(nmt_cuda_profiler_capture(0));
}
