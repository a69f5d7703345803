/* nmt/cuda_prof.h — the CUDA side of the profiler (nmt/prof.h): the device clock of a GPU
 * worker's track, the Nsight capture window, the device memory peak and the device's measured
 * GEMM and memory-bandwidth peaks (the roofline and MFU denominators). cuda/profile.cu; in a
 * CPU-only build (make CUDA=0) cuda/none.c has stubs that return NMT_ERR_DEVICE.
 *
 * Like nmt/cuda.h this header needs no CUDA header: contexts are the opaque `void *ctx` of
 * nmt_cuda_ctx_create, streams are returned as `void *`. Every function taking a context makes
 * its device current on the calling thread and, like the ops, must be called by the one thread
 * that uses the context at that time. docs/profiling.md ("GPU workers") shows how the engine
 * uses them.
 *
 * defines: nmt_cuda_prof_clock_create, nmt_cuda_prof_clock_destroy, nmt_cuda_clock_create,
 *          nmt_cuda_clock_destroy, nmt_cuda_prof_stream,
 *          nmt_cuda_prof_spin, nmt_cuda_profiler_capture, nmt_cuda_mem_peak_mb,
 *          nmt_cuda_measure_peaks
 */
#ifndef NMT_CUDA_PROF_H
#define NMT_CUDA_PROF_H

#include "nmt/config.h"
#include "nmt/prof.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The device clock of track `t` on context `ctx` (nmt/prof.h, "device clock"): fills *out
 * (install it with nmt_prof_track_set_clock(t, out) before the worker thread starts) and
 * returns its state in *state (free it with nmt_cuda_prof_clock_destroy after the last step).
 *
 *   step_begin (sampled steps only): records an anchor event on the context's stream.
 *   mark(i): cudaEventRecord of a timing event (cudaEventDefault) on the context's stream;
 *            no synchronisation, no allocation while the step has no more marks than the
 *            pool holds (see below). Ignored outside a sampled step.
 *   resolve: cudaEventSynchronize on the last recorded event (the host's one wait per sampled
 *            step), then each mark's time is host_ns(step_begin) + cudaEventElapsedTime(anchor,
 *            mark), in ns of CLOCK_MONOTONIC; -1 for a mark not recorded in this step.
 *
 * What the times mean: device time on the context's (compute) stream, i.e. when the stream
 * reached each mark, placed on the host timeline by pinning the anchor to the host time the
 * step began. When the device runs behind the host (an asynchronous queue), the device's step
 * is drawn shifted earlier than it really ran; durations and order within the step are exact
 * to the events' resolution (about 0.5 us, CUDA Runtime API, cudaEventElapsedTime). Work on
 * other streams (a communicator's) is seen only where the compute stream waits for it.
 *
 * Pool. Events are reused from one sampled step to the next (slot = mark index minus the
 * step's first mark index), so the pool needs the marks of one step, not of the window: it
 * is created up front with 2 x (track capacity / window length) + 2 events, and grows
 * (cudaEventCreate in mark) only in a step with more ranges than that average; it never holds
 * more than 2 x nmt_prof_track_capacity(t). A failure inside mark or step_begin (which return
 * nothing) is kept and returned by the step's resolve.
 *
 * Errors: NMT_ERR_INTERNAL (NULL ctx), NMT_ERR_DEVICE (event creation), NMT_ERR_NOMEM. */
nmt_status nmt_cuda_prof_clock_create(void *ctx, nmt_prof_track *t, nmt_prof_clock *out,
                                      void **state);
/* Destroys the events and the state (NULL is a no-op). After the track's last step; events
 * still pending on the device are released when it completes them. */
void nmt_cuda_prof_clock_destroy(void *state);

/* The table's clock_create / clock_destroy (nmt/backend.h "profiling"): the device clock of
 * track `track` on ctx, created by nmt_cuda_prof_clock_create and installed on the track
 * (nmt_prof_track_set_clock); *clock is its state (NULL on error, nothing installed then).
 * nmt_cuda_clock_destroy is nmt_cuda_prof_clock_destroy. Errors: those of the two. */
nmt_status nmt_cuda_clock_create(void *ctx, nmt_prof_track *track, void **clock);
void nmt_cuda_clock_destroy(void *clock);

/* The context's compute stream (a cudaStream_t) on which the clock records; NULL for a NULL
 * context. For code outside cuda/ that needs to order its own CUDA work after the ops. */
void *nmt_cuda_prof_stream(void *ctx);

/* Enqueues on the context's stream a one-thread kernel that spins (clock64) for
 * us * (peak SM clock, cudaDevAttrClockRate) cycles: at least `us` microseconds of device time
 * at any clock up to the peak, longer when the SM runs slower. A known-duration kernel for
 * testing the device clock. Errors: NMT_ERR_USAGE (us < 0 or > 1e8), NMT_ERR_DEVICE. */
nmt_status nmt_cuda_prof_spin(void *ctx, double us);

/* on = 1: cudaProfilerStart, on = 0: cudaProfilerStop (cuda_profiler_api.h), for
 * `nsys profile --capture-range=cudaProfilerApi`: collection covers what runs between the two.
 * They act on the calling thread's current context (CUDA Runtime API, "Profiler Control"),
 * so each GPU worker calls them on its own thread, after its first op made its device
 * current; without a profiler attached they do nothing. Repeated starts or stops have no
 * effect. Errors: NMT_ERR_DEVICE (no device or driver, or an earlier asynchronous error
 * surfacing). */
nmt_status nmt_cuda_profiler_capture(int on);

/* Device memory peak in MiB, SAMPLED: *mb is in/out. In: the peak seen so far (NAN or 0 on the
 * first call); out: max(in, total - free of cudaMemGetInfo now). So it is the largest use seen
 * at the calls (the engine calls it at each log step), not a true high-water mark between
 * them, and it counts the whole device: this process's CUDA context and cuBLASLt workspace,
 * and other processes on the same GPU. (A pool high-water attribute, cudaMemPoolAttrUsedMemHigh,
 * would be exact, but only covers cudaMallocAsync allocations; the backend uses cudaMalloc, and
 * its buffers are allocated at setup or grow monotonically, so sampling after the first step
 * sees the peak.) Errors: NMT_ERR_INTERNAL (NULL ctx), NMT_ERR_DEVICE; *mb is NAN then. */
nmt_status nmt_cuda_mem_peak_mb(void *ctx, double *mb);

/* Measured peaks of the context's device: *tflops, the best of several timed cuBLASLt GEMMs
 * C(N,N) = A(N,K)^T-layout B, N = K = 8192 (smaller if device memory is short), through the
 * backend's own GEMM path (cuda/gemm.cu: same algorithm choice, fp32 C and accumulation) with
 * inputs of the precision `mode`: NMT_PRECISION_FP16 / BF16 (16-bit inputs on tensor cores),
 * TF32 (fp32 inputs, TF32 tensor cores), FP32 (plain fp32); counted as 2 N^3 FLOP each. *gbps,
 * the best of several cudaMemcpyAsync device-to-device of 1 GiB counted as 2 GiB moved (read +
 * write, as STREAM Copy, McCalpin 1995), in 1e9 B/s. Timed with CUDA events after warm-up, on
 * the context's stream, which it synchronises; takes well under 2 s and about 2 GiB of device
 * memory for the moment (all freed). Call once per run at setup, before the model's buffers
 * exist, on the worker's context. These are achievable figures, a few % to 30 % under the
 * datasheet's. Errors: NMT_ERR_INTERNAL (NULL ctx), NMT_ERR_CONFIG (unknown mode),
 * NMT_ERR_NOMEM (not even 256 MiB free), NMT_ERR_DEVICE; both outputs are 0 then. */
nmt_status nmt_cuda_measure_peaks(void *ctx, nmt_precision mode, double *tflops, double *gbps);

#ifdef __cplusplus
}
#endif
#endif /* NMT_CUDA_PROF_H */
