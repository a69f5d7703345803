/* ref/profile.c — the reference backend's profiling entries (nmt/backend.h "profiling"): one
 * CPU worker's peaks (nmt_prof_measure_cpu_peak, src/util/prof.c), the process's peak resident
 * set, and no-ops for the device-only pieces (the Nsight capture window, a device clock: CPU
 * workers time their ranges with the host clock, as their ops are synchronous).
 * cuda/profile.cu is the CUDA counterpart. */
#include <errno.h>
#include <math.h>
#include <string.h>
#include <sys/resource.h>

#include "nmt/prof.h"
#include "nmt/ref.h"

nmt_status nmt_ref_measure_peaks(void *ctx, nmt_precision mode, double *tflops, double *gbps) {
  (void)ctx;
  *tflops = 0;
  *gbps = 0;
  if (mode != NMT_PRECISION_FP32 && mode != NMT_PRECISION_TF32 && mode != NMT_PRECISION_FP16 &&
      mode != NMT_PRECISION_BF16)
    return nmt_errorf(NMT_ERR_CONFIG, "ref measure_peaks: unknown precision mode %d", (int)mode);
  /* Every mode runs the same fp32 sgemm (fp16/bf16 only round its inputs first). */
  double tf = 0, gb = 0;
  NMT_TRY(nmt_prof_measure_cpu_peak(&tf, &gb));
  *tflops = tf;
  *gbps = gb;
  return NMT_OK;
}

nmt_status nmt_ref_mem_peak_mb(void *ctx, double *inout_peak_mb) {
  (void)ctx;
  const double prev = *inout_peak_mb;
  *inout_peak_mb = NAN;
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) != 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref mem_peak_mb: getrusage: %s", strerror(errno));
  const double now = (double)ru.ru_maxrss / 1024.0; /* Linux: kilobytes */
  *inout_peak_mb = prev > now ? prev : now;           /* NAN in: now */
  return NMT_OK;
}

nmt_status nmt_ref_profiler_capture(int on) {
  (void)on;
  return NMT_OK;
}

nmt_status nmt_ref_clock_create(void *ctx, nmt_prof_track *track, void **clock) {
  (void)ctx;
  (void)track;
  *clock = NULL;
  return NMT_OK;
}

void nmt_ref_clock_destroy(void *clock) { (void)clock; }
