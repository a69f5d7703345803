/* cuda/none.c — linked instead of the cuda/ objects in a CPU-only build (make CUDA=0, or no nvcc):
 * the CUDA backend is absent, so parallel.device = cuda fails with NMT_ERR_DEVICE and
 * device = auto picks the CPU. The CUDA profiler functions (nmt/cuda_prof.h) fail the same way,
 * so callers need no #ifdef. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "nmt/backend.h"
#include "nmt/cuda_prof.h"
#include "nmt/device.h"

const nmt_backend *nmt_backend_cuda_get(void) { return 0; }

void nmt_cuda_versions(char *out, size_t cap) { snprintf(out, cap, "none (built without CUDA)"); }

static nmt_status no_cuda(const char *what) {
  return nmt_errorf(NMT_ERR_DEVICE, "%s: built without CUDA (make CUDA=0 or no nvcc)", what);
}

nmt_status nmt_cuda_prof_clock_create(void *ctx, nmt_prof_track *t, nmt_prof_clock *out,
                                      void **state) {
  (void)ctx;
  (void)t;
  memset(out, 0, sizeof *out);
  *state = 0;
  return no_cuda("cuda profiler clock");
}

void nmt_cuda_prof_clock_destroy(void *state) { (void)state; }

void *nmt_cuda_prof_stream(void *ctx) {
  (void)ctx;
  return 0;
}

nmt_status nmt_cuda_prof_spin(void *ctx, double us) {
  (void)ctx;
  (void)us;
  return no_cuda("cuda prof_spin");
}

nmt_status nmt_cuda_profiler_capture(int on) {
  return no_cuda(on ? "cudaProfilerStart" : "cudaProfilerStop");
}

nmt_status nmt_cuda_mem_peak_mb(void *ctx, double *mb) {
  (void)ctx;
  *mb = NAN;
  return no_cuda("cuda mem_peak_mb");
}

nmt_status nmt_cuda_measure_peaks(void *ctx, nmt_precision mode, double *tflops, double *gbps) {
  (void)ctx;
  (void)mode;
  *tflops = 0;
  *gbps = 0;
  return no_cuda("cuda measure_peaks");
}
