/* nmt/backend.h — the op table: every computation the model does, behind function pointers.
 *
 * One table per backend ("ref" = fp32 CPU reference, the authority on correctness; "cuda" = the
 * fast path). model/ calls only these, never a device header. Ops pair fwd/bwd with the same
 * argument order; op X's ref is src/ref/X.c (nmt_ref_X_fwd / _bwd), tested in test/test_X.c.
 *
 * Conventions (all ops):
 * - fp32, row-major, batch dimension outermost. Shapes are given in comments as (B,T,C).
 * - `ctx` is the per-device state (ref: may be NULL, meaning fp32 GEMMs).
 * - Backward ops ACCUMULATE (+=) into every gradient output, inputs' gradients included;
 *   callers zero gradient buffers. A NULL gradient pointer means "not needed".
 * - Linear weights are stored (out_features, in_features) as in torch.nn.Linear.
 * - Ops return NMT_OK or a device error; the ref ops cannot fail except on bad arguments.
 * - Device backends (cuda) need a per-device context (ctx_create, for a device index). Its
 *   owner (one worker) uses it from one thread at a time: it holds that device's stream,
 *   cuBLASLt handle and scratch, which are not shared. Create it on the thread that will use
 *   it where the threads allow; the cuda backend also makes the context's device current on
 *   whichever thread calls (the trainer's segment and evaluation threads are short-lived), so
 *   a hand-over between threads is safe once the previous thread is done with it. ref's
 *   context is small (the GEMM precision, scratch for the fp16/bf16 emulation and the
 *   registered half copy of the weights) and optional: a NULL ctx means fp32, and every ref
 *   op but matmul, half_weights, cast_half and adamw's half_out ignores ctx.
 * - What differs by device beyond the ops is a table entry too (is_host, set_abort,
 *   comm_create, measure_peaks, mem_peak_mb, profiler_capture, clock_create/destroy), so the
 *   engine drives every backend through the table alone: no comparison with a particular
 *   table, no #ifdef NMT_CUDA, no nmt_cuda_* call above cuda/.
 *
 * defines: nmt_backend, nmt_backend_ref, nmt_backend_cuda, nmt_backend_cuda_get, NMT_GRAD_SLOT_*,
 *   nmt_step_status, nmt_step_policy, nmt_step_ctl, NMT_D2H_SLOTS, NMT_TOPK_MAX, nmt_act,
 *   nmt_backend_counters (scratch plan types: nmt/scratch.h), nmt_dinp_mode, nmt_relu_mask_bytes
 */
#ifndef NMT_BACKEND_H
#define NMT_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "nmt/attention.h"
#include "nmt/scratch.h"
#include "nmt/status.h"
#include "nmt/types.h"

/* The run-level entries take the run's abort flag (atomic_int, in C and in the .cu files) and
 * make communicators (nmt_comm); the profiler's track is only passed through. */
#include "nmt/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nmt_prof_track nmt_prof_track; /* nmt/prof.h */

/* Trailing slots of the gradient buffer, after the n_params gradients (model.h). The model's
 * forward sums into them, they are reduced with the last bucket (so the loss and the loss
 * normaliser travel with the gradients: no separate collective), and step_control reads them. */
enum {
  NMT_GRAD_SLOT_LOSS = 0,    /* sum of label-smoothed loss over target tokens */
  NMT_GRAD_SLOT_TOKENS = 1,  /* number of non-pad target tokens */
  NMT_GRAD_SLOT_NLL = 2,     /* sum of plain NLL (no smoothing), for perplexity */
  NMT_GRAD_SLOT_STOP = 3,    /* > 0 after reduction: some rank was asked to stop (all stop) */
  NMT_GRAD_EXTRA = 4
};

/* step_control's verdicts that end a run. Sticky: once set, every later step_control skips. */
typedef enum {
  NMT_STEP_OK = 0,
  NMT_STEP_NONFINITE = 1, /* inf/NaN gradient without loss scaling: diverged */
  NMT_STEP_FLOOR = 2,     /* fp16 overflow, and backing off would go below the floor: diverged */
  NMT_STEP_NO_TOKENS = 3  /* the reduced token count is not > 0 (an engine bug) */
} nmt_step_status;

/* The fp16 loss-scaling and clipping policy (precision.*, train.clip_norm), passed by value. */
typedef struct nmt_step_policy {
  int32_t scaling;          /* 1: dynamic loss scaling (precision.mode = fp16); 0: scale stays */
  float clip_norm;          /* train.clip_norm; <= 0: no clipping */
  float backoff;            /* precision.backoff, in (0, 1) */
  float floor;              /* precision.floor: the smallest scale an overflow may back off to */
  int64_t growth_interval;  /* precision.growth_interval: clean steps that double the scale */
} nmt_step_policy;

/* The optimizer step's control block, in device memory (host memory on ref): the loss scaler's
 * state, carried from step to step on the device, and the last step's verdict, which AdamW
 * reads (adamw's ctl) and the host reads back asynchronously (d2h_async). Written by the host
 * only at the start of a segment (scale, good, skipped; the rest zero). A fixed layout (no
 * pointers, explicit widths) shared by C and CUDA C++. */
typedef struct nmt_step_ctl {
  double gnorm;       /* out: L2 norm of the unscaled gradient per target token (inf/NaN on
                       * overflow; NaN when skipped for a status) */
  int64_t skipped;    /* state: steps skipped for fp16 overflow so far in the run */
  int64_t good;       /* state: clean steps since the scale last changed */
  int64_t step;       /* out: the 1-based step of the last step_control */
  float scale;        /* state: the loss scale of the next backward (1 without scaling); the
                       * model's xent reads it (xent_fwd_bwd's dloss_scale) */
  float scale_used;   /* out: the scale the last step's gradient carries */
  float coef;         /* out: AdamW's gradient multiplier clip / (tokens * scale_used) */
  int32_t skip;       /* out: 1 = AdamW leaves parameters and moments unchanged */
  int32_t status;     /* state, sticky: nmt_step_status */
  float sumsq;        /* scratch: sum of squared (scaled) gradients */
  float extra[NMT_GRAD_EXTRA]; /* out: the step's reduced trailing slots */
} nmt_step_ctl;

/* One element of an activation stored in the half type of the context (the half-storage ops
 * below; precision.activations = half): IEEE binary16 bits in fp16 mode, bfloat16 bits in bf16
 * mode, as the half working copy of the weights holds them (half_weights). A distinct pointer
 * type, so that an fp32 buffer cannot be passed where a half one is meant. */
typedef uint16_t nmt_act;

/* How linear_half_bwd delivers the input gradient. */
typedef enum {
  NMT_DINP_HALF = 0,    /* written in the half type (nmt_act): the next GEMM's input */
  NMT_DINP_F32 = 1,     /* written in fp32 (float): a residual-stream gradient's first writer */
  NMT_DINP_F32_ADD = 2  /* added in fp32 (+=): a residual-stream gradient's later writers */
} nmt_dinp_mode;

/* Bytes of the ReLU mask linear_half_fwd may record for an (M, N) output (cuBLASLt's
 * RELU_AUX bit-mask: one bit per element, a leading dimension of N rounded up to 128 bits,
 * per row of the row-major output; cublasLt.h, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD). */
static inline size_t nmt_relu_mask_bytes(int M, int N) {
  if (M <= 0 || N <= 0) return 0;
  return (size_t)M * (((size_t)N + 127) / 128 * 128) / 8;
}

/* Slots of d2h_async / d2h_wait: the host reads step s's control block while step s+1 runs. */
enum { NMT_D2H_SLOTS = 2 };

/* The largest k of logp_topk: 2 x the largest decode.beam (1024), what beam search's full
 * rule asks per row (src/model/beam.c). */
enum { NMT_TOPK_MAX = 2048 };

/* Monotonic counts of a context since ctx_create (the `counters` entry). Read them before and
 * after the work of interest and take the difference. */
typedef struct nmt_backend_counters {
  /* GEMM launches: every call into the GEMM library counts once, a batched or strided-batched
   * call included (cuda: each cublasLtMatmul). ref counts the same LOGICAL calls, so both
   * backends give the same figure for the same ops: matmul_fwd and matmul_bias_relu_fwd 1
   * (when M, N, K > 0); matmul_bwd 1 per non-NULL dinp and dw (K > 0) and 1 for dbias (cuda's
   * GEMV with a ones vector); attention_fwd 2 (scores, weighted sum); attention_bwd 1 for dv,
   * and with dq or dkey 1 for the weights' gradient plus 1 per non-NULL dq and dkey (B, Tq >
   * 0). The peak measurement's GEMMs (measure_peaks) count on cuda too. */
  uint64_t gemm_calls;
  /* Scratch buffers an op had to grow (allocate) because they were smaller than its call
   * needed: 0 after reserve_scratch with a plan that covers every call. Growth stays correct
   * (the op still runs), is counted here and, after a reserve_scratch, logged at warn level. */
  uint64_t scratch_growths;
  /* Cast kernels: fp32 -> half conversions of GEMM input matrices made inside a GEMM op (the
   * fp32-storage path in fp16/bf16 mode, precision.activations = fp32: one per matrix cast; a
   * weight inside the registered half copy needs none). ref counts the same logical casts (each
   * matrix it rounds). 0 in fp32/tf32 mode, and on the half-storage path, whose GEMM inputs are
   * already half, except a weight outside the registered copy. */
  uint64_t casts;
  /* Work items the ops put on the device: kernel launches of the backend's own kernels, GEMM
   * library calls, memsets and device copies (cuda; what `first` reports as kernels per
   * micro-batch); ref: 0 (it launches nothing). */
  uint64_t launches;
} nmt_backend_counters;

typedef struct nmt_backend {
  const char *name;
  /* 1 (ref): memory from malloc is host memory and every op has completed when it returns, so
   *   the host may read a result at once, host timing is op timing (no synchronize needed),
   *   and the workers share the host's cores (one BLAS thread each).
   * 0 (cuda): device memory; ops are enqueued on the context's streams and return at once. */
  int is_host;

  /* ---- per-device context (see the conventions above) ----
   * device_count: usable devices in *out (0 when none or no driver; never fails).
   * ctx_create: a context for device index `device` (ref: any index, CPU workers pass their
   *   rank).
   * ctx_destroy: waits for the device's pending work, frees the context; NULL is a no-op.
   * set_precision: GEMM arithmetic of later ops (nmt_precision); NMT_ERR_CONFIG for a mode the
   *   backend does not implement (ref with a NULL ctx: fp16/bf16). The contract, the same on
   *   every backend so that the CPU reference is the authority for mixed-precision parity
   *   (docs/cuda.md "Precision"):
   *   - fp32: exact fp32 GEMMs. tf32: GEMM inputs may be rounded to TF32 (cuda: matmul and
   *     attention; ref computes fp32).
   *   - The fp32 ops below in fp16 / bf16 mode (the half-storage ops at the end of the table
   *     take half tensors instead; docs/cuda.md "Precision"):
   *     fp16 / bf16 change ONLY matmul_fwd / matmul_bwd: every GEMM input matrix (fwd: inp
   *     and w; bwd: dout, w, inp) is rounded to the half type, round to nearest even (fp16:
   *     subnormals kept, |x| >= 65520 becomes +-inf exactly as a float->half conversion; bf16:
   *     the top 16 bits, rounded; NaN stays NaN in both); products are exact in fp32, the
   *     sums are fp32, outputs fp32. The bias is added in fp32 to the fp32 output; dbias is the
   *     fp32 row sum of the UNROUNDED dout. Every other op (attention included) computes as in
   *     fp32 mode. So a large fp16 loss scale overflows a backward GEMM input to inf, the
   *     gradient becomes inf/NaN and the engine skips the step, on the CPU as on the GPU. */
  nmt_status (*device_count)(int *out);
  nmt_status (*ctx_create)(int device, void **ctx);
  void (*ctx_destroy)(void *ctx);
  nmt_status (*set_precision)(void *ctx, nmt_precision mode);
  /* set_abort: registers the run's abort flag (NULL: none, the default) with the context:
   *   every host wait of the context (copy_d2h, synchronize, h2d_wait_src, d2h_wait, ...)
   *   returns NMT_ERR_ABORTED once *abort is non-zero, so a worker waiting on a dead peer
   *   returns instead of hanging. The flag must outlive the context or be unregistered first;
   *   call it while no other thread uses the context.
   *   cuda: nmt_cuda_ctx_set_abort; NMT_ERR_INTERNAL for a NULL ctx.
   *   ref: no op waits (each completes before it returns), but each GEMM op returns
   *   NMT_ERR_ABORTED at its start once *abort is raised, so a CPU step of minutes ends within
   *   one GEMM; NMT_OK for any ctx, NULL included. */
  nmt_status (*set_abort)(void *ctx, atomic_int *abort);
  /* reserve_scratch: sizes the context's scratch (every buffer an op uses besides its
   *   arguments: cuda's op scratch, 16-bit GEMM copies and ones vector, per aux stream too;
   *   ref's rounded GEMM copies, dropout masks and row scratch) for every call within `plan`,
   *   allocating now, so that such calls never allocate. Monotonic: a buffer never shrinks, so
   *   several models on one context each reserve theirs. The plan is kept: a later
   *   set_precision to fp16/bf16 (whose GEMMs need the 16-bit copies) and a later stream_pool
   *   size their buffers from it too. Call on an idle context (no fork). Errors:
   *   NMT_ERR_NOMEM (device or host memory), NMT_ERR_DEVICE, NMT_ERR_INTERNAL (between a fork
   *   and its join; cuda: NULL ctx). ref: a NULL ctx has no scratch: NMT_OK, nothing kept.
   * counters: the context's nmt_backend_counters into *out. Errors: NMT_ERR_INTERNAL for a
   *   NULL ctx or another backend's context (*out zeroed). Host-side counts: no wait. */
  nmt_status (*reserve_scratch)(void *ctx, const nmt_scratch_plan *plan);
  nmt_status (*counters)(void *ctx, nmt_backend_counters *out);

  /* ---- memory (device memory for cuda, host memory for ref) ----
   * Copies and memset are ordered after every op issued before them on the same ctx.
   * copy_h2d returns once `src` may be reused; copy_d2h returns once `dst` holds the data;
   * copy_d2d (dst <- src, both memory of ctx, bit for bit; the host does not wait: cuda
   * enqueues cudaMemcpyAsync on the compute stream; the regions may overlap on ref only);
   * synchronize waits for every op issued so far. A device backend reports errors that its
   * kernels detected (bad ids, lengths, targets) from copy_d2h and synchronize. */
  nmt_status (*malloc)(void *ctx, size_t bytes, void **out);
  void (*free)(void *ctx, void *p);
  nmt_status (*memset_zero)(void *ctx, void *p, size_t bytes);
  nmt_status (*copy_h2d)(void *ctx, void *dst, const void *src, size_t bytes);
  nmt_status (*copy_d2h)(void *ctx, void *dst, const void *src, size_t bytes);
  nmt_status (*copy_d2d)(void *ctx, void *dst, const void *src, size_t bytes);
  nmt_status (*synchronize)(void *ctx);

  /* ---- batch staging: pinned host memory and the copy stream (docs/cuda.md "Streams") ----
   * Two staging slots (slot 0 or 1) let the copy of the next micro-batch run on the copy
   * stream while the compute stream still works on the current one.
   * host_alloc: `bytes` of host memory that the device reads fastest (cuda: page-locked,
   *   cudaHostAlloc; ref: malloc). Errors: NMT_ERR_NOMEM. host_free: NULL is a no-op.
   * h2d_async: dst (device) <- src (host, from host_alloc) on the copy stream, after the
   *   compute stream has passed the last h2d_release(slot) (so dst is no longer read);
   *   returns without waiting. `src` must stay unchanged until h2d_wait_src(slot) returns.
   * h2d_acquire: later ops on the compute stream wait for slot's last h2d_async.
   * h2d_release: marks the point on the compute stream after which slot's dst may be
   *   overwritten (issue it after the last op that reads dst).
   * h2d_wait_src: returns once slot's last h2d_async has read its source (the host buffer may
   *   be refilled); polls, honouring the abort flag like copy_d2h (NMT_ERR_ABORTED).
   * ref: h2d_async copies at once (memcpy); acquire, release and wait_src do nothing.
   * Errors: NMT_ERR_INTERNAL for a slot outside {0, 1}, or (cuda) a src that is not
   *   page-locked; NMT_ERR_DEVICE from the driver. */
  nmt_status (*host_alloc)(void *ctx, size_t bytes, void **out);
  void (*host_free)(void *ctx, void *p);
  nmt_status (*h2d_async)(void *ctx, int slot, void *dst, const void *src, size_t bytes);
  nmt_status (*h2d_acquire)(void *ctx, int slot);
  nmt_status (*h2d_release)(void *ctx, int slot);
  nmt_status (*h2d_wait_src)(void *ctx, int slot);

  /* ---- asynchronous reads back (docs/cuda.md "Step control") ----
   * d2h_async: host (from host_alloc) <- dev, `bytes`, enqueued on the compute stream after
   *   every op issued so far; returns without waiting. `slot` in [0, NMT_D2H_SLOTS) names the
   *   read; host must not be read until d2h_wait(slot).
   * d2h_wait: returns once slot's last d2h_async has landed; polls, honouring the abort flag
   *   (NMT_ERR_ABORTED), and reports errors the kernels detected before the copy (as copy_d2h).
   *   A slot never used returns at once.
   * ref: d2h_async copies at once (memcpy); d2h_wait checks the slot.
   * Errors: NMT_ERR_INTERNAL for a slot outside [0, NMT_D2H_SLOTS), a call between
   *   stream_fork and stream_join, or (cuda) a host buffer that is not page-locked (a copy to
   *   pageable memory may wait inside the driver, past the abort flag); NMT_ERR_DEVICE from
   *   the driver. */
  nmt_status (*d2h_async)(void *ctx, int slot, void *host, const void *dev, size_t bytes);
  nmt_status (*d2h_wait)(void *ctx, int slot);

  /* ---- the comm stream's copies (the host-staged communicator, nmt_comm_create_staged in
   * nmt/comm.h; docs/cuda.md "Several workers on one GPU") ----
   * A communicator that reduces on the host moves each collective's device buffer to pinned
   * host memory and back on the context's comm stream, ordered as NCCL's collectives are:
   * comm_d2h: host (from host_alloc) <- dev, `bytes`, on the comm stream AFTER every op issued
   *   so far on the compute stream (an event recorded there, which the comm stream waits for:
   *   the bucket's gradients are final); returns without waiting. Neither buffer may be
   *   touched until comm_wait returns.
   * comm_h2d: dev <- host (from host_alloc), on the comm stream after everything issued there
   *   before (so after earlier comm_d2h copies); returns without waiting. The compute stream
   *   sees dev only after comm_join; host must stay unchanged until the next comm_wait.
   * comm_wait: returns once everything issued so far on the comm stream has run; polls,
   *   honouring the abort flag like copy_d2h (NMT_ERR_ABORTED).
   * comm_join: later ops on the compute stream wait for everything issued so far on the comm
   *   stream (an event); returns without waiting.
   * ref: comm_d2h and comm_h2d copy at once (memmove); comm_wait and comm_join do nothing.
   * Errors: NMT_ERR_INTERNAL between stream_fork and stream_join, or (cuda) for a host buffer
   *   that is not page-locked (a pageable copy would wait inside the driver, past the abort
   *   flag) or a NULL ctx; NMT_ERR_DEVICE from the driver. */
  nmt_status (*comm_d2h)(void *ctx, void *host, const void *dev, size_t bytes);
  nmt_status (*comm_h2d)(void *ctx, void *dev, const void *host, size_t bytes);
  nmt_status (*comm_wait)(void *ctx);
  nmt_status (*comm_join)(void *ctx);

  /* ---- stream pool: independent ops on extra streams (parallel.aux_streams) ----
   * stream_pool: gives the context n auxiliary streams (0 <= n <= 8), each with its own GEMM
   *   workspace and scratch, so ops on different streams share no buffer. Call once, before
   *   the first fork, on an idle context. Errors: NMT_ERR_CONFIG (n out of range),
   *   NMT_ERR_NOMEM, NMT_ERR_DEVICE.
   * stream_fork: every aux stream waits for all work issued so far (one event on the main
   *   stream); later ops still go to the main stream until stream_use.
   * stream_use: later ops go to stream i: 0 = main (compute) stream, 1..n = aux stream i.
   *   Errors: NMT_ERR_INTERNAL for i outside [0, n] or without a fork.
   * stream_join: the main stream waits for the work issued so far on every aux stream
   *   (events), and later ops go to the main stream again. Every fork needs its join before
   *   copies, synchronize or the next fork.
   * Ops issued to different streams between a fork and its join must not write memory another
   *   of them reads or writes; copies, memset and synchronize are main-stream only.
   * ref: every op runs at once on the calling thread, so the three are bookkeeping only (the
   *   same argument checks, so CPU tests catch a misuse that would race on a GPU). */
  nmt_status (*stream_pool)(void *ctx, int n);
  nmt_status (*stream_fork)(void *ctx);
  nmt_status (*stream_use)(void *ctx, int i);
  nmt_status (*stream_join)(void *ctx);

  /* ---- communicator (nmt/comm.h) ----
   * comm_create: the communicator group of a run's n ranks (rank r = worker r); comms[r] gets
   *   rank r's handle (destroy the group with nmt_comm_destroy before the contexts). `abort`
   *   (may be NULL) is the run's shared abort flag, polled while waiting. Call it on the main
   *   thread before any worker starts.
   *   ref: the host communicator, nmt_comm_create_host(n, abort, comms); devices and ctxs are
   *     not read (may be NULL).
   *   cuda: n == 1: the host communicator as well (one GPU never reduces; devices and ctxs not
   *     read). n > 1: the NCCL group, nmt_comm_create_nccl(n, devices, ctxs, abort, comms):
   *     rank r on device devices[r], bound to ctxs[r] (its ctx_create(devices[r]) context), so
   *     call it once every rank's context exists. (Several workers on one GPU take the
   *     host-staged communicator instead, nmt_comm_create_staged; nmt_device_comm_create in
   *     nmt/device.h decides which.)
   *   Errors: NMT_ERR_INTERNAL (n < 1, NULL comms; cuda n > 1: NULL devices or ctxs, a context
   *   on another device, a device listed twice), NMT_ERR_NOMEM, NMT_ERR_DEVICE (NCCL). */
  nmt_status (*comm_create)(int n, const int *devices, void *const *ctxs, atomic_int *abort,
                            nmt_comm **comms);

  /* ---- profiling (nmt/prof.h; docs/profiling.md) ----
   * measure_peaks: the achievable peaks of the context's device, for MFU and the profile
   *   table's roofline: *tflops, GEMM TFLOP/s (1e12 FLOP/s) with inputs of precision `mode`,
   *   and *gbps, memory bandwidth in 1e9 B/s (a copy counted as read + write, as STREAM Copy,
   *   McCalpin 1995). Call once per run at setup, before the model's buffers exist and before
   *   the workers run.
   *   cuda: nmt_cuda_measure_peaks (cuBLASLt GEMMs of 8192^3 through the backend's GEMM path,
   *     1 GiB device copies; well under 2 s and ~2 GiB of device memory for the moment).
   *   ref: one CPU worker's peaks, nmt_prof_measure_cpu_peak (the best of several 512^3
   *     cblas_sgemm on one OpenBLAS thread and of several 64 MiB memcpy; about 0.2 s). The
   *     reference GEMM is that fp32 sgemm in every mode (fp16/bf16 round its inputs first), so
   *     `mode` does not change the figure; ctx is not read (may be NULL).
   *   Errors: NMT_ERR_CONFIG (unknown mode), NMT_ERR_NOMEM, NMT_ERR_DEVICE, NMT_ERR_INTERNAL
   *   (cuda: NULL ctx); both outputs are 0 then.
   * mem_peak_mb: the memory peak in MiB (2^20 B), in/out: *inout_peak_mb in is the peak seen
   *   so far (NAN or 0 on the first call), out max(in, now).
   *   cuda: nmt_cuda_mem_peak_mb: total - free of cudaMemGetInfo, SAMPLED at the calls (the
   *     whole device: this process's CUDA context and other processes included).
   *   ref: the process's peak resident set (getrusage ru_maxrss / 1024; Linux counts it in
   *     KiB), a true high-water mark shared by all CPU workers; ctx is not read.
   *   Errors: NMT_ERR_INTERNAL (cuda: NULL ctx; ref: getrusage failed), NMT_ERR_DEVICE;
   *   *inout_peak_mb is NAN then.
   * profiler_capture: on = 1 starts, 0 stops the Nsight capture window (nsys
   *   --capture-range=cudaProfilerApi). It acts on the calling thread's current device: each
   *   worker calls it on its own thread, after its first op; repeated starts or stops have no
   *   effect. cuda: nmt_cuda_profiler_capture (NMT_ERR_DEVICE). ref: NMT_OK, nothing to capture.
   * clock_create: the device clock of the worker's profiler track `track` on context ctx,
   *   installed on the track (nmt_prof_track_set_clock), so that the track's ranges are timed
   *   by when the device reached them; *clock is its state for clock_destroy. Before the
   *   worker thread starts.
   *   cuda: nmt_cuda_prof_clock_create (events on the compute stream, resolved once per sampled
   *     step; nmt/cuda_prof.h) and nmt_prof_track_set_clock. Errors: NMT_ERR_INTERNAL (NULL
   *     ctx), NMT_ERR_USAGE (NULL track), NMT_ERR_DEVICE, NMT_ERR_NOMEM; *clock NULL then.
   *   ref: *clock = NULL and the track keeps the host clock (ops are synchronous, so host time
   *     is op time); NMT_OK.
   * clock_destroy: frees a clock_create state after the track's last step; NULL is a no-op. */
  nmt_status (*measure_peaks)(void *ctx, nmt_precision mode, double *tflops, double *gbps);
  nmt_status (*mem_peak_mb)(void *ctx, double *inout_peak_mb);
  nmt_status (*profiler_capture)(int on);
  nmt_status (*clock_create)(void *ctx, nmt_prof_track *track, void **clock);
  void (*clock_destroy)(void *clock);

  /* ---- embedding (Vaswani et al. 2017 §3.4, §3.5) ----
   * out(r,:) = scale * wte(ids[r],:) + pos(r % T, :)     r in [0, n_rows), n_rows = B*T
   * out (B*T, C); ids (B*T) int32 < V; wte (V, C); pos (>=T, C) sinusoidal table.
   * bwd: dwte(ids[r],:) += scale * dout(r,:) for every row whose id is not NMT_PAD_ID (the
   *   padding gets no gradient, as torch.nn.Embedding's padding_idx; the model's gradient at
   *   padded positions is zero anyway). Rows of one id are summed in row order: ref one by
   *   one; cuda the same for an id with at most 32 rows (bitwise), in chunks of 32 rows whose
   *   sums are then added in order for a more frequent id (deterministic, fp32 rounding of the
   *   one sequential sum; cuda/embedding.cu). */
  nmt_status (*embedding_fwd)(void *ctx, float *out, const int32_t *ids, const float *wte,
                              const float *pos, int n_rows, int T, int C, float scale);
  nmt_status (*embedding_bwd)(void *ctx, float *dwte, const float *dout, const int32_t *ids,
                              int n_rows, int C, float scale);

  /* ---- linear: out(M,N) = inp(M,K) @ w(N,K)^T + bias(N) (bias may be NULL) ----
   * bwd: dinp += dout @ w;  dw += dout^T @ inp;  dbias += sum_rows(dout).
   * The GEMMs follow the context's precision (set_precision above); bias and dbias are fp32. */
  nmt_status (*matmul_fwd)(void *ctx, float *out, const float *inp, const float *w,
                           const float *bias, int M, int K, int N);
  nmt_status (*matmul_bwd)(void *ctx, float *dinp, float *dw, float *dbias, const float *dout,
                           const float *inp, const float *w, int M, int K, int N);

  /* ---- linear + ReLU, fused: out(M,N) = relu(inp(M,K) @ w(N,K)^T + bias(N)) ----
   * The first layer of the position-wise feed-forward network, max(0, x W1 + b1) (Vaswani et
   * al. 2017 §3.3, eq. 2), in one op so that a device backend can apply bias and ReLU in the
   * GEMM's epilogue instead of two more passes over the (M, N) output. Exactly matmul_fwd and
   * then relu_fwd in place: the GEMM follows the context's precision as matmul_fwd does
   * (fp16/bf16 round inp and w only), bias (N) or NULL is added in fp32 to the fp32 product,
   * and the ReLU (x > 0 ? x : 0) is taken of that fp32 sum. All arrays fp32, row-major; out
   * must not overlap inp, w or bias. The backward is relu_bwd on out, then matmul_bwd.
   * ref: bitwise nmt_ref_matmul_fwd followed by nmt_ref_relu_fwd. cuda: one cuBLASLt GEMM with
   * CUBLASLT_EPILOGUE_RELU_BIAS (RELU without a bias) where cuBLASLt takes it, else the unfused
   * sequence (cuBLAS Library User Guide, cuBLASLt API, cublasLtEpilogue_t; the rule is in
   * cuda/gemm.cu and docs/cuda.md "Bias and ReLU epilogues"). Errors: NMT_ERR_INTERNAL for M, K or N < 0 (and
   * a ref ctx of another backend, as matmul_fwd); NMT_ERR_NOMEM, NMT_ERR_DEVICE. */
  nmt_status (*matmul_bias_relu_fwd)(void *ctx, float *out, const float *inp, const float *w,
                                     const float *bias, int M, int K, int N);

  /* ---- the fp16/bf16 working copy of the weights (mixed precision, Micikevicius et al. 2018
   * §3.1: fp32 master weights, half-precision copies for the forward and backward GEMMs) ----
   * In fp16/bf16 mode every GEMM rounds its weight to the half type. Without a cached copy
   * each call rounds w again, in every micro-batch's forward and again in its backward; with
   * one, the weight is rounded once per optimizer step, by the AdamW pass that writes it.
   * "The half type" below is the context's: IEEE binary16 bits in fp16 mode, bfloat16 bits in
   * bf16 mode (as set_precision set it); one element is 2 bytes (uint16 bit patterns), and
   * round(x) is the rounding the GEMMs apply (set_precision's contract: round to nearest even;
   * fp16 keeps subnormals and turns |x| >= 65520 into +-inf; bf16 the top 16 bits; NaN stays
   * NaN, the payload not kept: ref writes 0x7fff, the CUDA toolkit's canonical NaN).
   *
   * half_weights: registers dst (device memory from this backend's malloc, at least 2 * n
   *   bytes) as the half copy of the fp32 buffer src[0, n) (device memory; the flat parameter
   *   buffer). From then on matmul_fwd, matmul_bwd and matmul_bias_relu_fwd, given a weight w
   *   whose whole (N, K) matrix [w, w + N*K) lies inside [src, src + n), read its rounded
   *   values from the half elements dst[(w - src) .. (w - src) + N*K) instead of rounding w
   *   (the inputs inp and dout are still rounded per call). The GEMM inputs are bitwise those
   *   of rounding w (so are ref's results; cuda's up to the order of the fp32 sums where the
   *   slice's alignment picks another cuBLASLt algorithm, nmt/cuda.h) as long as dst[i] ==
   *   round(src[i]): keeping it so is the CALLER's job (adamw's half_out after each update,
   *   cast_half after any other write to src); a stale copy is read as it is. Only
   *   registers: nothing is copied. src == NULL unregisters (dst and n
   *   are ignored; a no-op when nothing is registered; allowed in every mode and on ref's NULL
   *   ctx). While a copy is registered, set_precision to another mode is refused
   *   (NMT_ERR_INTERNAL): the copy's bits are of the current half type. The registration
   *   lives in ctx; unregister before freeing dst or src. Errors: NMT_ERR_INTERNAL for fp32 or
   *   tf32 mode (GEMMs do not round: nothing to cache; ref's NULL ctx is fp32), dst == NULL,
   *   n == 0, or a copy already registered (one per context: unregister first); cuda also for
   *   a NULL ctx.
   * cast_half: dst[i] = round(src[i]) for i < n, in the context's half type, bitwise the
   *   rounding the GEMMs apply; enqueued on the current stream, in order with the ops. For
   *   filling a registered copy after src was written other than by adamw (the trainer's setup
   *   copies the initial or resumed parameters in). src (n) fp32 and dst (n) half elements,
   *   device memory, not overlapping; n == 0 does nothing. Errors: NMT_ERR_INTERNAL in fp32 /
   *   tf32 mode (no half type) or for NULL pointers with n > 0; NMT_ERR_DEVICE. */
  nmt_status (*half_weights)(void *ctx, const float *src, void *dst, size_t n);
  nmt_status (*cast_half)(void *ctx, void *dst, const float *src, size_t n);

  /* ---- the weights of an inference context, in the layout its GEMMs read fastest ----
   * infer_weights: declares the fp32 weights src[0, n) (device memory: a decoder's flat
   *   parameter buffer) unchanged until the next call, so that the backend may keep a copy of
   *   them in another layout for matmul_fwd and matmul_bias_relu_fwd in fp32 / tf32 mode
   *   (fp16 / bf16 read the registered half copy instead). A call forgets what an earlier one
   *   copied: call it again after every write to src (the decoder rig does, at each load);
   *   src == NULL forgets all and frees the copy (n is ignored; allowed on ref's NULL ctx and
   *   on any context of the backend). Training never calls it: its weights change at every
   *   step. The products are the same; the order
   *   of the fp32 sums may differ where the library picks another kernel for the layout.
   *   ref: each weight matrix w (N, K) that lies wholly inside [src, src + n) is read as its
   *   transpose (K, N) from a host copy of n floats made by this call, each matrix transposed
   *   at its first use after the call (a matrix overlapping another one already copied in
   *   another shape is read from src). OpenBLAS packs a (K, N) operand with a plain copy
   *   and an (N, K) one with a transpose; at the few rows of a decoding step the packing is
   *   paid once per call whatever the rows, and the transposing pack was 30% of a greedy
   *   decode's CPU samples (docs/decoding.md, "On the CPU"). The sums are bitwise the
   *   same where OpenBLAS runs its blocked kernel on both layouts; for a few rows it may take
   *   its GEMV or small-matrix kernels, which sum in another order.
   *   cuda: records nothing (cuBLASLt reads the (N, K) layout as a transposed operand at the
   *   same speed, without a copy); only checks its arguments.
   *   Errors: NMT_ERR_INTERNAL for a NULL ctx with src (ref's NULL context has nowhere to keep
   *   the copy), n == 0 with src, and on ref a context of another backend; NMT_ERR_NOMEM (ref).
   *   ref forgets the earlier declaration before anything can fail. */
  nmt_status (*infer_weights)(void *ctx, const float *src, size_t n);

  /* ---- layer normalization (Ba et al. 2016), eps inside the sqrt, biased variance ----
   * out (M,C) = (inp - mean) * rstd * gamma + beta; saves mean (M), rstd (M). */
  nmt_status (*layernorm_fwd)(void *ctx, float *out, float *mean, float *rstd, const float *inp,
                              const float *gamma, const float *beta, int M, int C, float eps);
  nmt_status (*layernorm_bwd)(void *ctx, float *dinp, float *dgamma, float *dbeta,
                              const float *dout, const float *inp, const float *gamma,
                              const float *mean, const float *rstd, int M, int C);

  /* ---- residual + dropout + LayerNorm, fused (Vaswani et al. 2017 §3.1 and §5.4 "residual
   * dropout"; Ba et al. 2016) ----
   * The sublayer connection LN(x + Dropout(y)) in one pass over the rows instead of three.
   * fwd: sum (M,C) = x + dropout(y), element e = r*C + c kept exactly as dropout_fwd keeps it
   *   (nmt_rng_uniform(seed, stream, e) >= p; kept: x + y * (1.0f / (1.0f - p)) in fp32;
   *   dropped: x + 0.0f; p == 0: x + y). Then, if gamma != NULL, out (M,C), mean (M), rstd (M)
   *   = layernorm_fwd(sum, gamma, beta, eps) exactly as that op (mean, rstd may be NULL);
   *   with gamma == NULL only sum is written (out, beta, mean, rstd unused: the pre-LN
   *   residual x + Dropout(S(LN(x)))). x, y, sum, out: (M,C) fp32; gamma, beta: (C).
   *   sum may alias x or y; out must not overlap x, y or sum.
   * bwd: with dsum = LN'(dout) (layernorm_bwd's dinp of the forward's sum, mean, rstd):
   *   dx += dsum; dy += keep(e) ? dsum * (1.0f / (1.0f - p)) : 0 (dropout_bwd; p == 0:
   *   dy += dsum); dgamma += sum_rows dout * xhat and dbeta += sum_rows dout as
   *   layernorm_bwd. Any of dx, dy, dgamma, dbeta may be NULL (not needed). dout, sum, dx,
   *   dy: (M,C); gamma, dgamma, dbeta: (C); mean, rstd: (M). dx and dy must not overlap each
   *   other or the inputs.
   * Errors: NMT_ERR_INTERNAL for M < 0, C < 1, p outside [0, 1); fwd also for a NULL sum, or
   *   a gamma without out or beta. */
  nmt_status (*residual_dropout_ln_fwd)(void *ctx, float *out, float *sum, float *mean,
                                        float *rstd, const float *x, const float *y,
                                        const float *gamma, const float *beta, int M, int C,
                                        float eps, float p, uint64_t seed, uint64_t stream);
  nmt_status (*residual_dropout_ln_bwd)(void *ctx, float *dx, float *dy, float *dgamma,
                                        float *dbeta, const float *dout, const float *sum,
                                        const float *gamma, const float *mean,
                                        const float *rstd, int M, int C, float p, uint64_t seed,
                                        uint64_t stream);

  /* ---- multi-head scaled dot-product attention (§3.2.1 eq. 1, §3.2.2) ----
   * Head h of query row (b,i) is q[(b*Tq + i)*ldq + h*dk + 0..dk); keys/values likewise with
   * ldkv, so q/k/v may be column slices of one fused QKV (ldq = ldkv = 3C) or KV (2C) buffer.
   * S = q k^T / sqrt(dk); key j of batch b is masked (-inf) iff j >= k_lens[b], or j > i when
   * `causal`; P = softmax(S) saved in probs (B,H,Tq,Tk); out(b,i,h*dk..) = dropout(P) @ v with
   * row stride C = H*dk. Dropout keeps P element e = ((b*H+h)*Tq+i)*Tk+j iff
   * nmt_rng_uniform(seed, stream, e) >= p_drop, and scales kept ones by 1/(1-p_drop).
   * bwd: dq, dkey, dv (same layouts and strides as q, k, v) +=; dprobs is caller scratch
   * (B,H,Tq,Tk). k_lens[b] >= 1. */
  nmt_status (*attention_fwd)(void *ctx, float *out, float *probs, const float *q, int ldq,
                              const float *k, const float *v, int ldkv, const int32_t *k_lens,
                              int B, int Tq, int Tk, int H, int dk, int causal, float p_drop,
                              uint64_t seed, uint64_t stream);
  nmt_status (*attention_bwd)(void *ctx, float *dq, float *dkey, float *dv, float *dprobs,
                              const float *dout, const float *probs, const float *q, int ldq,
                              const float *k, const float *v, int ldkv, const int32_t *k_lens,
                              int B, int Tq, int Tk, int H, int dk, int causal, float p_drop,
                              uint64_t seed, uint64_t stream);

  /* ---- fused attention (contract and arguments: nmt/attention.h) ---- fwd: out (B*Tq, C),
   * lse (B,H,Tq) fp32; bwd: drow caller scratch (B,H,Tq) fp32. Errors: NMT_ERR_INTERNAL (bad
   * shapes; half outside fp16/bf16), cuda NMT_ERR_USAGE (dk: nmt_attn_supported_dk). */
  nmt_status (*attention_fused_fwd)(void *ctx, void *out, float *lse, const nmt_attn_args *a);
  nmt_status (*attention_fused_bwd)(void *ctx, void *dq, void *dkey, void *dv, float *drow,
                                    const void *dout, const void *out, const float *lse,
                                    const nmt_attn_args *a);

  /* ---- elementwise ---- (n elements; out may alias inp) */
  nmt_status (*relu_fwd)(void *ctx, float *out, const float *inp, size_t n);
  /* dinp += dout * (out > 0) */
  nmt_status (*relu_bwd)(void *ctx, float *dinp, const float *dout, const float *out, size_t n);
  /* out[e] = keep(e) ? inp[e] / (1-p) : 0 with keep as in attention; p == 0 copies. */
  nmt_status (*dropout_fwd)(void *ctx, float *out, const float *inp, size_t n, float p,
                            uint64_t seed, uint64_t stream);
  /* dinp[e] += keep(e) ? dout[e] / (1-p) : 0 */
  nmt_status (*dropout_bwd)(void *ctx, float *dinp, const float *dout, size_t n, float p,
                            uint64_t seed, uint64_t stream);
  /* out = a + b (out may alias a or b) */
  nmt_status (*add)(void *ctx, float *out, const float *a, const float *b, size_t n);
  /* y += alpha * x */
  nmt_status (*axpy)(void *ctx, float *y, const float *x, float alpha, size_t n);
  /* *dst += sum(x) (dst is device memory; one scalar) */
  nmt_status (*sum_acc)(void *ctx, float *dst, const float *x, size_t n);
  /* *dst = sum(x^2) (dst is device memory), accumulated in double on ref */
  nmt_status (*sumsq)(void *ctx, float *dst, const float *x, size_t n);
  /* *dst += number of targets[i] != NMT_PAD_ID, i < n (dst is device memory; one scalar,
   * exact below 2^24). The loss normaliser of a micro-batch, counted where the targets are, so
   * that the host issues no copy for it. */
  nmt_status (*count_targets)(void *ctx, float *dst, const int32_t *targets, size_t n);
  /* The optimizer step's control, on the device (no host read): grads (n + NMT_GRAD_EXTRA)
   * holds the reduced gradient of scale * loss and the trailing slots. With
   * scale = ctl->scale (a float: backoff and doubling are float products, compared in float
   * with the floor) and tokens = extra[NMT_GRAD_SLOT_TOKENS] (a double, as gnorm and clip):
   *   ctl->step = step; ctl->extra = the slots; ctl->scale_used = scale; skip = 1, coef = 0;
   *   status already set:     nothing else (gnorm NaN)
   *   !(tokens > 0):          status = NMT_STEP_NO_TOKENS
   *   gnorm = sqrt(sum g^2) / tokens / scale not finite (sum g^2 in double, stored as float):
   *     without scaling:      status = NMT_STEP_NONFINITE
   *     scale*backoff < floor: status = NMT_STEP_FLOOR
   *     else (fp16 overflow): scale *= backoff, good = 0, skipped += 1
   *   else: clip = clip_norm > 0 && gnorm > clip_norm ? clip_norm / gnorm : 1;
   *     coef = (float)(clip / tokens / scale); skip = 0; with scaling, ++good reaching
   *     growth_interval doubles the scale (while scale < 2^126) and resets good.
   * Dynamic loss scaling as Micikevicius et al. 2018 §3.2 and torch.cuda.amp.GradScaler;
   * clipping as torch.nn.utils.clip_grad_norm_ (on the per-token gradient). step >= 1.
   * Deterministic (the sum as sumsq). Errors: NMT_ERR_INTERNAL for step < 1. */
  nmt_status (*step_control)(void *ctx, nmt_step_ctl *ctl, const float *grads, size_t n,
                             nmt_step_policy policy, long step);
  /* step_decide: step_control with the sum of squares already reduced (ZeRO, Rajbhandari et
   * al. 2020: each rank holds only its shard of the reduced gradient, so the ranks add their
   * shards' partial sums with one small all-reduce first): ctl->sumsq = *sumsq (one device
   * float), then exactly step_control's policy on the trailing slots extra[NMT_GRAD_EXTRA]
   * (device floats). For the same sumsq the block is bitwise step_control's. Errors:
   * NMT_ERR_INTERNAL for step < 1. */
  nmt_status (*step_decide)(void *ctx, nmt_step_ctl *ctl, const float *sumsq, const float *extra,
                            nmt_step_policy policy, long step);

  /* ---- softmax cross-entropy with label smoothing (§5.4), padding ignored ----
   * logits (M,V); targets (M) int32, rows with target == NMT_PAD_ID are ignored (loss 0,
   * gradient 0). Smoothing as torch.nn.CrossEntropyLoss(label_smoothing=eps):
   * loss_r = (1-eps) * (-log p[t]) + eps * mean_v(-log p[v]).
   * Writes losses (M) and, if nll != NULL, the unsmoothed nll (M) = -log p[t] (0 for PAD rows),
   * for perplexity without a second pass. If write_grad, overwrites logits IN PLACE with
   * dloss * d loss_r / d logits = dloss * (p - (1-eps) onehot(t) - eps/V) (no second (M,V)
   * buffer), where dloss is multiplied by *dloss_scale when dloss_scale != NULL (a device
   * scalar: the loss scale held by step_control, nmt_step_ctl.scale). Math in fp32 (double
   * accumulation on ref). */
  nmt_status (*xent_fwd_bwd)(void *ctx, float *logits, float *losses, float *nll,
                             const int32_t *targets, int M, int V, float label_smoothing,
                             float dloss, const float *dloss_scale, int write_grad);
  /* out[r] = argmax_v x(r,v) (first index on ties); x (M,V). */
  nmt_status (*argmax)(void *ctx, int32_t *out, const float *x, int M, int V);

  /* ---- the per-step selection of decoding: the k most likely outputs of each row and their
   * log-probabilities (Vaswani et al. 2017 §6.1; beam search and greedy decoding,
   * src/model/beam.c and decode.c, call it once per step) ----
   * For row r of x (R,V) fp32 logits, key(v) = x(r,v) with NaN read as -inf:
   * ids (R,k) int32: the k ids with the largest key among the ids that may be output (all but
   *   NMT_PAD_ID and NMT_BOS_ID, which are never training targets), largest first, lower id
   *   first on ties; slots past the row's outputtable ids (k > V minus those two) get -1. A
   *   row's first k' < k ids are its top-k' exactly.
   * logp (R,k) fp32, or NULL for ids only (greedy: k = 1 is the argmax over the outputtable
   *   ids, and no normaliser is computed): log_softmax(x_r) at those ids, key - log sum_v
   *   exp(key(v)) with the sum over ALL V ids (<pad> and <s> count in the normaliser, as
   *   fairseq's lprobs[:, pad] = -inf after log_softmax); -inf in the -1 slots and in a row
   *   whose keys are all -inf; NaN in a row holding +inf. Both backends: the exponentials of
   *   key - max in fp32, their sum, its log and each difference in double, rounded to float
   *   once (ref and cuda agree within 1e-5: the sums' order differs). The ids are the same on
   *   both backends (fp32 key comparisons).
   * ids and logp must not overlap x or each other. 1 <= k <= NMT_TOPK_MAX.
   * Errors: NMT_ERR_INTERNAL for R < 0, V < 1, k outside [1, NMT_TOPK_MAX], or NULL ids or x
   *   with R > 0. */
  nmt_status (*logp_topk)(void *ctx, int32_t *ids, float *logp, const float *x, int R, int V,
                          int k);
  /* logp_at: logp (R,k) = log_softmax(x_r) at given ids (R,k) (ensembles, src/model/decode.c),
   *   as logp_topk computes its logp (bitwise at its own ids); -inf at id -1 and in a row of
   *   -inf keys; ids in [-1, V). Errors: as logp_topk's (NULL logp, ids or x with R > 0). */
  nmt_status (*logp_at)(void *ctx, float *logp, const int32_t *ids, const float *x, int R, int V,
                        int k);

  /* ---- optimizer: AdamW (Kingma & Ba 2015 alg. 1; Loshchilov & Hutter 2019) ----
   * g = grads * grad_scale (grad_scale folds loss normalisation 1/tokens and clipping);
   * m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; mhat = m/(1-b1^t); vhat = v/(1-b2^t);
   * p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p). t = step >= 1.
   * ctl (device memory, may be NULL): the step_control verdict: grad_scale is replaced by
   * ctl->coef, and nothing is written when ctl->skip (fp16 overflow or a status), so the
   * update needs no host decision.
   * half_out (device memory, n half elements, may be NULL): the working copy, refreshed in the
   * same pass: half_out[i] = round(params[i]) of the NEW params[i], in the context's half type
   * (cast_half's rounding, bitwise). A skipped step writes nothing there either (params are
   * unchanged, so a current copy stays current). Errors: NMT_ERR_INTERNAL for step < 1, and
   * for a half_out in fp32/tf32 mode (no half type; ref's NULL ctx is fp32). */
  nmt_status (*adamw)(void *ctx, float *params, const float *grads, float *m, float *v,
                      size_t n, float lr, float beta1, float beta2, float eps,
                      float weight_decay, float grad_scale, const nmt_step_ctl *ctl,
                      void *half_out, long step);

  /* ==== the half-storage path (precision.activations = half; docs/cuda.md "Precision") ====
   * In fp16/bf16 mode the model keeps every activation and activation gradient that feeds a
   * GEMM in the half type (nmt_act), written directly by the op that produces it: a GEMM's
   * output, LayerNorm's, attention's, the classifier's gradient (llm.c's floatX; PyTorch
   * autocast keeps the same tensors in half but casts its inputs per op). So no cast kernel
   * runs before a GEMM, and each such tensor moves 2 bytes per element instead of 4. What
   * autocast keeps in fp32 stays fp32 (float below): the residual stream and its gradient,
   * LayerNorm statistics, softmax probabilities, losses, master weights, weight gradients
   * (accumulated across micro-batches) and optimizer state.
   * Conventions of the ops below. v(h) is the value of a half element (exact in fp32); round(x)
   * the nearest half, as half_weights/cast_half round (to nearest even; fp16 keeps subnormals
   * and turns |x| >= 65520 into +-inf; NaN stays NaN). Each op computes in fp32 exactly what
   * the fp32 op it mirrors computes (named per op), on the values v() of its half inputs, and
   * rounds once where it stores a half output: those stores are the rounding sites, listed in
   * docs/cuda.md and emulated by the reference bit for bit (its sums in its own order). Weights
   * are the fp32 master buffer's, read through the registered half copy (half_weights; a weight
   * outside it is rounded per call and counted in counters().casts). Outputs are WRITTEN, not
   * accumulated, unless the op says +=: each half activation gradient has exactly one writer,
   * so no buffer is zeroed first. Every op needs a context in fp16 or bf16 mode (ref: a
   * reference context, not NULL): NMT_ERR_INTERNAL otherwise, for negative sizes and for the
   * argument errors of the fp32 op it mirrors; NMT_ERR_NOMEM, NMT_ERR_DEVICE.
   *
   * linear_half_fwd: for b < batch (>= 1), the linear layer with weight w_b = w + b*param_stride
   *   (N,K) and bias bias_b = bias + b*param_stride (N) or none (bias NULL):
   *     out_b (M,N) = round(r(v(inp) (M,K) @ v(w_b)^T + v(bias_b))),  out_b = out + b*out_stride
   *   products exact, sums fp32, the bias (rounded to the half type, as the copy holds it) added
   *   once to the fp32 sum, r = the ReLU (x > 0 ? x : 0) when relu, else identity; one rounding.
   *   The batch shares inp: the decoder layers' cross-attention K/V projections of the one
   *   encoder output (Vaswani et al. 2017 §3.2.3) as one GEMM; with batch > 1, out_stride >=
   *   M*N (the outputs must not overlap: NMT_ERR_INTERNAL). relu_mask (relu, batch 1; may be
   *   NULL, nmt_relu_mask_bytes(M, N) bytes, 16-byte aligned; only for a ReLU with no dropout
   *   after it, since the mask does not see a dropout): where a backend's GEMM epilogue
   *   may record the ReLU's positive set for linear_half_bwd (cuda: cuBLASLt's RELU_AUX_BIAS
   *   bit-mask, an opaque layout); *mask_written (may be NULL) = 1 when it did, 0 when not (ref:
   *   always 0), and a mask not written must not be passed to linear_half_bwd. out must not
   *   overlap inp, w or bias. GEMM calls: 1 when K > 0 (a batch counts once). Mirrors matmul_fwd /
   *   matmul_bias_relu_fwd.
   * linear_half_bwd: the backward of a batch-1 linear_half_fwd, dout (M,N) half, inp (M,K) half:
   *   acc (M,K) = v(dout) @ v(w) in fp32, delivered by dinp_mode:
   *     NMT_DINP_HALF:    dinp (nmt_act) = round(acc); with relu_out (nmt_act (M,K), the
   *                       output of the linear_half_fwd whose ReLU this undoes, after any
   *                       dropout applied to it; may be NULL): round(round(acc) * relu_scale)
   *                       where v(relu_out) > 0, else 0 (the ReLU's backward and, relu_scale
   *                       = 1/(1-p), the backward of a dropout applied after it: kept-and-active
   *                       is v(relu_out) > 0; relu_scale = 1 without one). relu_mask: the mask
   *                       that forward wrote (*mask_written = 1), or NULL: the same result
   *                       (the mask holds the fp32 pre-activation's sign, which differs from
   *                       v(relu_out) > 0 only where a positive sum rounds to 0: fp16 below
   *                       2^-25, where the mask passes the gradient; never in bf16).
   *     NMT_DINP_F32:     dinp (float) = acc;   NMT_DINP_F32_ADD: dinp (float) += acc
   *   dw (N,K) += v(dout)^T @ v(inp) in fp32; dbias (N) += the fp32 sums over rows of v(dout).
   *   NULL dinp, dw or dbias: not wanted. relu_out with an fp32 dinp_mode: NMT_ERR_INTERNAL.
   *   dinp must not overlap dout, inp, w or relu_out. GEMM calls: 1 per non-NULL dinp and dw
   *   (dbias rides on the dw GEMM: cuda's BGRADB epilogue, else a reduction kernel). Mirrors
   *   matmul_bwd (and relu_bwd, dropout_bwd before it).
   * attention_half_fwd / attention_half_bwd: attention_fwd / attention_bwd (the same shapes,
   *   strides, masks, dropout stream and probs/dprobs, fp32) on v(q), v(k), v(v) and v(dout):
   *   out = round(the fp32 op's out); bwd writes dq, dkey, dv = round(the fp32 op's gradient
   *   accumulated into zeros), each one that is not NULL, over its rows and head columns only.
   * residual_ln_half_fwd: residual_dropout_ln_fwd with y half: sum = x + dropout(v(y)) (fp32;
   *   kept: v(y) * (1.0f / (1.0f - p))), then with gamma out = LN(sum) fp32 exactly as that op
   *   and out_h = round(out) (may be NULL: the next GEMM's input); gamma NULL: only sum (pre-LN's
   *   residual). x, sum, out (M,C) fp32; y, out_h (M,C) half.
   * residual_ln_half_bwd: with dsum = LN'(dout) as residual_dropout_ln_bwd forms it: dx = dsum
   *   (fp32, WRITTEN; may be NULL) and dy = round(keep ? dsum * (1/(1-p)) : 0) (half, written;
   *   p = 0: round(dsum); may be NULL); dgamma, dbeta += as that op. dout, sum fp32.
   * layernorm_half_fwd: out (half) = round(layernorm_fwd's out of inp (fp32)); mean, rstd fp32.
   * layernorm_half_bwd: g = layernorm_bwd's dinp contribution of dout (fp32): accumulate ?
   *   dinp += g : dinp = g (fp32), then dinp_h (half, may be NULL) = round(the new dinp);
   *   dgamma, dbeta += as layernorm_bwd.
   * xent_half_fwd_bwd: xent_fwd_bwd on v(logits) (M,V half): losses and nll (fp32) as it; with
   *   write_grad the logits are overwritten by round(the gradient xent_fwd_bwd writes), the
   *   classifier's gradient in half (fp16: beyond 65504 it is inf, which the loss scale's
   *   overflow check sees). Never an fp32 (M,V) tensor.
   * embedding_half_fwd: out (fp32, the residual stream's start) = embedding_fwd then
   *   dropout_fwd in place with (p, seed, stream), bitwise the two ops (p = 0: no dropout);
   *   out_h (may be NULL) = round(out). Mirrors embedding_fwd + dropout_fwd.
   * dropout_half: out (half, n) = round(keep(e) ? x * (1.0f / (1.0f - p)) : 0.0f) with x =
   *   v(inp) (inp_f32 = 0: inp is nmt_act) or inp's float (inp_f32 = 1), keep(e) as
   *   dropout_fwd; p = 0: round(x). In place when out == inp (half); an fp32 inp must not
   *   overlap out (NMT_ERR_INTERNAL). Inverted dropout's forward
   *   and backward alike. */
  nmt_status (*linear_half_fwd)(void *ctx, nmt_act *out, const nmt_act *inp, const float *w,
                                const float *bias, int M, int K, int N, int relu,
                                uint8_t *relu_mask, int *mask_written, int batch,
                                size_t param_stride, size_t out_stride);
  nmt_status (*linear_half_bwd)(void *ctx, void *dinp, nmt_dinp_mode dinp_mode, float *dw,
                                float *dbias, const nmt_act *dout, const nmt_act *inp,
                                const float *w, const nmt_act *relu_out,
                                const uint8_t *relu_mask, float relu_scale, int M, int K, int N);
  nmt_status (*attention_half_fwd)(void *ctx, nmt_act *out, float *probs, const nmt_act *q,
                                   int ldq, const nmt_act *k, const nmt_act *v, int ldkv,
                                   const int32_t *k_lens, int B, int Tq, int Tk, int H, int dk,
                                   int causal, float p_drop, uint64_t seed, uint64_t stream);
  nmt_status (*attention_half_bwd)(void *ctx, nmt_act *dq, nmt_act *dkey, nmt_act *dv,
                                   float *dprobs, const nmt_act *dout, const float *probs,
                                   const nmt_act *q, int ldq, const nmt_act *k, const nmt_act *v,
                                   int ldkv, const int32_t *k_lens, int B, int Tq, int Tk, int H,
                                   int dk, int causal, float p_drop, uint64_t seed,
                                   uint64_t stream);
  nmt_status (*residual_ln_half_fwd)(void *ctx, float *out, nmt_act *out_h, float *sum,
                                     float *mean, float *rstd, const float *x, const nmt_act *y,
                                     const float *gamma, const float *beta, int M, int C,
                                     float eps, float p, uint64_t seed, uint64_t stream);
  nmt_status (*residual_ln_half_bwd)(void *ctx, float *dx, nmt_act *dy, float *dgamma,
                                     float *dbeta, const float *dout, const float *sum,
                                     const float *gamma, const float *mean, const float *rstd,
                                     int M, int C, float p, uint64_t seed, uint64_t stream);
  nmt_status (*layernorm_half_fwd)(void *ctx, nmt_act *out, float *mean, float *rstd,
                                   const float *inp, const float *gamma, const float *beta,
                                   int M, int C, float eps);
  nmt_status (*layernorm_half_bwd)(void *ctx, float *dinp, int accumulate, nmt_act *dinp_h,
                                   float *dgamma, float *dbeta, const float *dout,
                                   const float *inp, const float *gamma, const float *mean,
                                   const float *rstd, int M, int C);
  nmt_status (*xent_half_fwd_bwd)(void *ctx, nmt_act *logits, float *losses, float *nll,
                                  const int32_t *targets, int M, int V, float label_smoothing,
                                  float dloss, const float *dloss_scale, int write_grad);
  nmt_status (*embedding_half_fwd)(void *ctx, float *out, nmt_act *out_h, const int32_t *ids,
                                   const float *wte, const float *pos, int n_rows, int T, int C,
                                   float scale, float p, uint64_t seed, uint64_t stream);
  nmt_status (*dropout_half)(void *ctx, nmt_act *out, const void *inp, int inp_f32, size_t n,
                             float p, uint64_t seed, uint64_t stream);
} nmt_backend;

/* The fp32 CPU reference backend (src/ref/). ctx may be NULL (fp32) or from its ctx_create
 * (needed for the fp16/bf16 emulation; nmt/ref.h). */
extern const nmt_backend nmt_backend_ref;

/* The CUDA backend (cuda/, include/nmt/cuda.h). Defined only in builds with CUDA (nvcc found
 * and not `make CUDA=0`); code that must also link without it uses nmt_backend_cuda_get. */
extern const nmt_backend nmt_backend_cuda;

/* &nmt_backend_cuda in a build with CUDA, NULL in a CPU-only build (cuda/none.c). Says nothing
 * about whether a device is present: ask its device_count. */
const nmt_backend *nmt_backend_cuda_get(void);

/* half_weights' "lies inside": 1 and *off = w - src (in floats) when w[0, len) is within the
 * registered src[0, n) (len > 0, w float-aligned to src), else 0. One definition for both
 * backends' GEMMs. Compared as integers: ordering pointers into different allocations is
 * undefined in C. */
static inline int nmt_half_copy_offset(const float *src, size_t n, const float *w, size_t len,
                                       size_t *off) {
  if (!src || len == 0) return 0;
  const uintptr_t a = (uintptr_t)w, lo = (uintptr_t)src;
  if (a < lo || (a - lo) % sizeof(float)) return 0;
  *off = (a - lo) / sizeof(float);
  return *off <= n && len <= n - *off;
}

#ifdef __cplusplus
}
#endif
#endif /* NMT_BACKEND_H */
