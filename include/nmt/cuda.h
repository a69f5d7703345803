/* nmt/cuda.h — the CUDA backend's ops and per-device context, callable directly.
 *
 * These are the functions behind nmt_backend_cuda (cuda/backend.cu); the engine reaches them
 * through the table, tests may call them by name. Every op has exactly the semantics, shapes
 * and argument order of the matching nmt_backend field documented in nmt/backend.h and of its
 * fp32 reference nmt_ref_* (nmt/ref.h), which it is tested against (test/test_cuda_<op>.c):
 * fp32 row-major, backward ops accumulate (+=), pointers are device memory unless a name says
 * host. This header needs no CUDA header: the context is an opaque pointer.
 *
 * Context. `ctx` is a nmt_cuda_ctx from nmt_cuda_ctx_create: device index, the compute stream
 * (every op is enqueued on it, in call order, outside a stream-pool fork), a cuBLASLt handle
 * with a 32 MiB workspace, scratch buffers (op scratch and the 16-bit copies of GEMM inputs in
 * fp16/bf16 mode), the GEMM precision, the registered half copy of the weights (half_weights)
 * and a device-side error word. Every call first makes the
 * context's device current on the calling thread (the CUDA runtime's current device is
 * per-thread), so a context may be used from any thread, but by ONE THREAD AT A TIME: its
 * streams, handle and scratch are not shared. Ops are asynchronous: they return once the work
 * is enqueued. copy_d2h and synchronize wait for the compute stream (synchronize also for the
 * copy stream); copy_h2d also returns only when the host source may be reused. The context
 * also holds the comm stream and two events, used only by an NCCL group bound to it
 * (nmt/comm.h, cuda/nccl.cu); the copy stream and two staging slots (batch staging below); and
 * the aux stream pool, empty until stream_pool. Nsight Systems shows the streams as
 * "compute", "comm", "copy", "aux1".."auxN" (when built with NMT_NVTX).
 *
 * Waits. The host never blocks inside the driver: copy_h2d, copy_d2h, synchronize (and a
 * scratch growth or reservation that must drain the stream) poll cudaStreamQuery, spinning briefly and then
 * yielding the CPU. They give up with NMT_ERR_ABORTED once the flag registered with
 * nmt_cuda_ctx_set_abort is raised, or once an NCCL group bound to the context is aborted; a
 * bound group also turns an NCCL asynchronous error into NMT_ERR_DEVICE there. So a worker
 * whose stream waits for a collective that a dead peer never joins returns an error instead
 * of hanging. After NMT_ERR_ABORTED the stream may still hold work: abort the NCCL group
 * (which makes its kernels quit) before destroying the context.
 *
 * Errors. A failed CUDA or cuBLASLt call, or a failed kernel launch (checked after every
 * launch), returns NMT_ERR_DEVICE (NMT_ERR_NOMEM for cudaMalloc) with the call, file and line
 * in nmt_last_error(). Arguments only the device can see (token ids, key lengths, targets) are
 * checked by the kernels: a bad one sets a bit in the context's error word, the kernel skips
 * that element (no out-of-bounds access), and the next copy_d2h or synchronize (or d2h_wait
 * of a read-back issued after the op) returns NMT_ERR_INTERNAL naming the op and the bad
 * argument.
 *
 * Streams (docs/cuda.md "Streams"). Batch staging: h2d_async copies on the copy stream into
 * one of two slots; h2d_acquire makes the compute stream wait for it; h2d_release marks where
 * the compute stream is done with the slot's destination, which the slot's next h2d_async
 * waits for on the device. Stream pool: between stream_fork and stream_join, stream_use(i)
 * sends later ops to aux stream i (0 = compute); each aux stream has its own cuBLASLt
 * workspace and scratch, so ops on different streams share no buffer; memset, copies,
 * synchronize, the staging ops and the reads back are refused there (NMT_ERR_INTERNAL).
 * Nothing here blocks the host except h2d_wait_src and d2h_wait, which poll like copy_d2h
 * (abort-aware).
 *
 * defines: nmt_cuda_ctx, nmt_cuda_* (one per nmt_backend op), nmt_cuda_ctx_create,
 *          nmt_cuda_ctx_destroy, nmt_cuda_ctx_set_abort, nmt_cuda_comm_create,
 *          nmt_cuda_ctx_streams, nmt_cuda_reserve_scratch, nmt_cuda_counters,
 *          nmt_cuda_ctx_set_epilogues, nmt_cuda_ctx_set_attention_fused_impl,
 *          NMT_CUDA_GEMM_KEY*, nmt_cuda_gemm_bucket, nmt_cuda_gemm_bucket_key,
 *          nmt_cuda_gemm_alignment,
 *          nmt_cuda_set_precision, nmt_cuda_device_count, nmt_cuda_round_host
 */
#ifndef NMT_CUDA_H
#define NMT_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "nmt/atomic.h" /* atomic_int in C and C++ */

#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nmt_cuda_ctx nmt_cuda_ctx;

/* ---- the GEMM cache's keys (cuda/gemm.cu; pure C, so the CPU tests check them) ----
 * Every GEMM is described by NMT_CUDA_GEMM_KEY words, in this order: transa, transb, m, n, k,
 * lda, ldb, ldc, strideA, strideB, strideC (0 unless batch > 1), batch, compute type
 * (cublasComputeType_t), the alignments of A, B, C (bytes, powers of two, from
 * nmt_cuda_gemm_alignment: common to the pointer, the leading dimension and the batch
 * stride), the input type (cudaDataType_t of A and B), the epilogue (nmt__cuda_epilogue,
 * cuda/common.cuh), the bias alignment (0 without a bias vector: the BIAS kinds' input or
 * BGRADB's output; its batch stride included), the output type (cudaDataType_t of C and D:
 * CUDA_R_32F, or the input type when that is 16-bit), the alignment of the epilogue's aux
 * buffer (the ReLU bit-mask; 0 without one) and the bias batch stride in elements (0 unless
 * batch > 1 with a bias). The words
 * NMT_CUDA_GEMM_KEY_SIZE0 .. NMT_CUDA_GEMM_KEY_SIZE1 - 1 (m .. batch) are sizes.
 * nmt_cuda_gemm_bucket: a size rounded up to a coarse grid: x itself up to 16, else up to the
 *   next multiple of p/8 where p is the largest power of two <= x (8 buckets per octave, at
 *   most 12.5% above x; 512, 1536, 2048 stay themselves, 8000 -> 8192, 3000 -> 3072).
 *   Non-decreasing, and >= x, so a bucketed leading dimension still covers its bucketed rows.
 * nmt_cuda_gemm_bucket_key: the exact key with every size word bucketed. Batches of
 *   different lengths (tokens per batch, sentence lengths, B*H) then share a key, so the
 *   cuBLASLt heuristic runs once per bucket instead of once per shape: cuda/gemm.cu asks it
 *   for the bucket's shape (the sizes as bucketed) and checks the algorithm for each exact
 *   shape with cublasLtMatmulAlgoCheck, falling back to a heuristic query of the exact shape
 *   when the check fails. Transposes, compute, input and output types, alignments, the
 *   epilogue and the bias batch stride are never bucketed: an algorithm chosen for another
 *   alignment could fault, and the bias stride is no dimension of the problem. */
enum { NMT_CUDA_GEMM_KEY = 22, NMT_CUDA_GEMM_KEY_SIZE0 = 2, NMT_CUDA_GEMM_KEY_SIZE1 = 12 };

static inline int64_t nmt_cuda_gemm_bucket(int64_t x) {
  if (x <= 16) return x;
  int64_t p = 16;
  while (p <= x / 2) p *= 2;
  const int64_t step = p / 8;
  return (x + step - 1) / step * step;
}

/* The alignment word of one matrix in a GEMM key: the largest power of two in
 * [elem_bytes, 256] dividing the address, the leading dimension in bytes (ld x elem_bytes:
 * column j starts at addr + j x ld x elem_bytes) and, when batch > 1, the batch stride in
 * bytes (stride x elem_bytes). ld = 0 for a vector (the bias). Why all three: cuBLASLt's
 * alignment requirement covers the pointer, the leading dimension and the batch stride
 * (cuBLAS Library User Guide, cuBLASLt API: cublasLtMatmulPreferenceAttributes_t,
 * CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_{A,B,C,D}_BYTES, and cublasLtMatmulAlgoCheck), and the
 * key's sizes are bucketed (nmt_cuda_gemm_bucket_key) while this word is not: an algorithm
 * chosen for a bucket whose ld was 16-byte aligned must not serve an exact shape whose ld is
 * not. The result goes to the heuristic as the MIN_ALIGNMENT preference. An address that is
 * not a multiple of elem_bytes gives elem_bytes (cuda/gemm.cu refuses it before asking).
 * elem_bytes: 2 (fp16/bf16) or 4 (fp32), or 1 for the ReLU bit-mask (ld then in bytes), a
 * power of two <= 256. */
static inline uint32_t nmt_cuda_gemm_alignment(uintptr_t addr, int64_t ld, int64_t stride,
                                               int batch, uint32_t elem_bytes) {
  uint64_t bits = (uint64_t)addr | (uint64_t)ld * elem_bytes;
  if (batch > 1) bits |= (uint64_t)stride * elem_bytes;
  uint32_t al = 256;
  while (al > elem_bytes && (bits & (al - 1))) al >>= 1;
  return al;
}

static inline void nmt_cuda_gemm_bucket_key(const int64_t *exact, int64_t *out) {
  for (int i = 0; i < NMT_CUDA_GEMM_KEY; i++)
    out[i] = i >= NMT_CUDA_GEMM_KEY_SIZE0 && i < NMT_CUDA_GEMM_KEY_SIZE1
                 ? nmt_cuda_gemm_bucket(exact[i])
                 : exact[i];
}

/* ---- context (cuda/context.cu) ---- */
/* Number of usable CUDA devices in *out: 0 when there is no driver, no device, or the driver is
 * older than the runtime (cudaGetDeviceCount's error is then logged at debug level). Never
 * fails. */
nmt_status nmt_cuda_device_count(int *out);
/* Creates the context of `device` (see above). Errors: NMT_ERR_USAGE (NMT_ATTENTION_FUSED_IMPL
 * set to neither simt nor mma: refused before anything else, for any run), NMT_ERR_DEVICE
 * (bad index, driver or cuBLASLt failure), NMT_ERR_NOMEM. */
nmt_status nmt_cuda_ctx_create(int device, void **ctx);
/* Waits for the context's streams, then frees everything it owns. NULL is a no-op. An NCCL
 * group bound to the context must be destroyed first (its kernels may still wait for peers). */
void nmt_cuda_ctx_destroy(void *ctx);
/* Registers the run's abort flag (NULL: none, the default): every host wait of the context
 * (see "Waits" above) returns NMT_ERR_ABORTED once *abort is non-zero. The flag must outlive
 * the context or be unregistered first. Call it while no other thread uses the context.
 * Errors: NMT_ERR_INTERNAL for a NULL context. */
nmt_status nmt_cuda_ctx_set_abort(void *ctx, atomic_int *abort);
/* The table's comm_create (nmt/backend.h): n == 1, the host communicator
 * (nmt_comm_create_host; devices and ctxs not read); n > 1, the NCCL group
 * nmt_comm_create_nccl(n, devices, ctxs, abort, comms), rank r on devices[r] bound to ctxs[r].
 * Errors: those of the two (nmt/comm.h); n < 1 is NMT_ERR_INTERNAL. */
nmt_status nmt_cuda_comm_create(int n, const int *devices, void *const *ctxs, atomic_int *abort,
                                nmt_comm **comms);
/* The context's compute stream (every op) and comm stream (NCCL collectives) as cudaStream_t
 * values (void * so that this header needs no CUDA header), for code that enqueues its own
 * work in order with the ops: a test gating a stream, a profiler recording events. Either
 * output may be NULL. Errors: NMT_ERR_INTERNAL for a NULL context. */
nmt_status nmt_cuda_ctx_streams(void *ctx, void **compute, void **comm);
/* GEMM arithmetic for later ops (nmt/backend.h's set_precision contract): NMT_PRECISION_FP32
 * (exact fp32 GEMMs, the default); NMT_PRECISION_TF32 (tensor cores round GEMM inputs to TF32,
 * fp32 accumulation, in matmul and attention); NMT_PRECISION_FP16 / NMT_PRECISION_BF16
 * (matmul_fwd/bwd only: the GEMM inputs are cast to __half / __nv_bfloat16 with
 * __float2half_rn / __float2bfloat16_rn, cuBLASLt multiplies them with fp32 accumulation and
 * fp32 output; attention computes in fp32). The bias, the bias gradient and every non-GEMM op
 * stay fp32 in every mode. Errors: NMT_ERR_CONFIG for an unknown mode. */
nmt_status nmt_cuda_set_precision(void *ctx, nmt_precision mode);

/* The table's reserve_scratch and counters (nmt/backend.h). reserve_scratch sizes, for every
 * call within the plan, the compute stream's op scratch and 16-bit GEMM copies (the latter
 * only in fp16/bf16 mode), each aux stream's pair from plan->aux, and the ones vector of the
 * bias-gradient GEMV (the larger gemm_rows), with the ops' own size functions (cuda/common.cuh)
 * at the plan's bounds: exactly, with cudaMalloc, after waiting for the stream that owns the
 * old buffer. With half_acts, the op scratch also covers linear_half_bwd's bias gradient
 * (nmt__cuda_linear_half_scratch) for M <= gemm_rows rows and N <= ceil(gemm_out / gemm_rows)
 * columns: the widest output the plan's longest calls have (the model's plan bounds every
 * linear layer's M by the same max_tokens; nmt_model_scratch_plan). It keeps the element-wise
 * largest plan so far: set_precision to fp16/bf16 and a later stream_pool size their buffers
 * from it. A call beyond the plan grows its buffer (by a quarter more) inside the op: counted
 * in scratch_growths and logged at warn level.
 * counters: host-side counts. gemm_calls = cublasLtMatmul calls of cuda/gemm.cu made on this
 * context; casts = the matrices cuda/matmul.cu cast to the half type on it; launches = work
 * items put on a device by the CALLING HOST THREAD (kernel launches, each checked by
 * NMT_CUDA_LAUNCH_CHECK; cublasLtMatmul calls; the memsets and copies of cuda/memory.cu and
 * cuda/matmul.cu), counted per thread whatever context they went to (an op does not know its
 * thread's other contexts): the difference of two counters() calls made by one thread around
 * its own ops on one context is exact, which is how the profiler reads it (src/model/
 * profile.c). Not counted: kernels launched inside libraries (cuBLASLt's own, CUB's sort,
 * NCCL's) beyond their one call. Errors: NMT_ERR_INTERNAL (NULL ctx; between a fork and its
 * join), NMT_ERR_NOMEM, NMT_ERR_DEVICE. */
nmt_status nmt_cuda_reserve_scratch(void *ctx, const nmt_scratch_plan *plan);
nmt_status nmt_cuda_counters(void *ctx, nmt_backend_counters *out);
/* Test knob: on = 0 makes every GEMM that asks for a cuBLASLt epilogue (bias, ReLU, ReLU
 * mask, DRELU, BGRADB; cuda/gemm.cu) report it as not taken, so that the ops run their unfused
 * sequences; on = 1 (the default) restores the rule of docs/cuda.md "Bias and ReLU
 * epilogues". Lets the GPU tests hold both sequences to the reference on one device. Decided
 * per call, nothing cached. Errors: NMT_ERR_INTERNAL for a NULL context. */
nmt_status nmt_cuda_ctx_set_epilogues(void *ctx, int on);
/* The fused attention's kernels for half storage (docs/cuda.md "Fused attention"): mma = 1 the
 * tensor-core (WMMA) kernels of cuda/attention_fused_mma.cu where they serve the shape (Tk <=
 * 256), mma = 0 the SIMT kernels of cuda/attention_fused.cu. A context starts with the choice
 * of the environment variable NMT_ATTENTION_FUSED_IMPL (simt | mma; unset or empty: mma; any
 * other value: ctx_create fails with NMT_ERR_USAGE), read once by ctx_create; this knob lets the tests and bench/attention_fused.c run both on one
 * device. Errors: NMT_ERR_INTERNAL for a NULL context or mma outside {0, 1}. */
nmt_status nmt_cuda_ctx_set_attention_fused_impl(void *ctx, int mma);

/* out[i] = x[i] converted to fp16 (mode NMT_PRECISION_FP16) or bf16 (NMT_PRECISION_BF16) and
 * back to float by the CUDA toolkit's __float2half_rn / __float2bfloat16_rn, run on the HOST
 * (they are host-device functions); other modes copy. Needs no device: it lets a CPU test
 * check that nmt_half_round_fp16/bf16 (nmt/half.h) round as the CUDA kernels do
 * (cuda/matmul.cu). Host memory; out may equal x. */
void nmt_cuda_round_host(nmt_precision mode, float *out, const float *x, size_t n);

/* ---- memory (cuda/memory.cu) ----
 * copy_h2d / copy_d2h: blocking copies between device memory and any host memory, pageable
 * included, in compute-stream order. The stream is first drained by the polling wait (see
 * "Waits"), then the copy runs and is waited for the same way: cudaMemcpyAsync to or from
 * pageable memory is synchronous with respect to the host (CUDA Runtime API, "API
 * synchronization behavior"), and issued behind queued work it would wait for that work
 * inside the driver, deaf to the abort flag. copy_d2h then reads the error word. Errors:
 * NMT_ERR_ABORTED (the wait), NMT_ERR_DEVICE, and for copy_d2h NMT_ERR_INTERNAL for a bad
 * device-side argument of an earlier op. */
nmt_status nmt_cuda_malloc(void *ctx, size_t bytes, void **out);
void nmt_cuda_free(void *ctx, void *p);
nmt_status nmt_cuda_memset_zero(void *ctx, void *p, size_t bytes);
nmt_status nmt_cuda_copy_h2d(void *ctx, void *dst, const void *src, size_t bytes);
nmt_status nmt_cuda_copy_d2h(void *ctx, void *dst, const void *src, size_t bytes);
nmt_status nmt_cuda_copy_d2d(void *ctx, void *dst, const void *src, size_t bytes);
nmt_status nmt_cuda_synchronize(void *ctx);

/* ---- batch staging (cuda/memory.cu; contract: nmt/backend.h "batch staging") ----
 * host_alloc: `bytes` of page-locked host memory (cudaHostAlloc; 0 bytes still gives a
 *   pointer). Errors: NMT_ERR_NOMEM (with the driver's reason), NMT_ERR_INTERNAL for a NULL
 *   context. host_free: cudaFreeHost; NULL is a no-op; a failure is only logged.
 * h2d_async(slot, dst, src, bytes): dst (device) <- src (host) on the copy stream, after the
 *   compute stream has reached slot's last h2d_release (a device-side wait: the host returns at
 *   once). src should come from host_alloc (pageable memory works, but the driver then copies
 *   through a bounce buffer on the calling thread); it must stay unchanged until
 *   h2d_wait_src(slot).
 * h2d_acquire(slot): later ops on the compute stream wait for slot's last h2d_async.
 * h2d_release(slot): later h2d_async(slot) wait for the compute stream's work issued so far.
 * h2d_wait_src(slot): polls until slot's last h2d_async has run (spin, then sched_yield; the
 *   abort flag and an NCCL group's wait hook end it with their error, as in copy_d2h).
 * Errors (all four): NMT_ERR_INTERNAL for a slot outside {0, 1}, and for h2d_async,
 * h2d_acquire and h2d_release between stream_fork and stream_join; NMT_ERR_DEVICE from the
 * driver; h2d_wait_src also NMT_ERR_ABORTED. */
nmt_status nmt_cuda_host_alloc(void *ctx, size_t bytes, void **out);
void nmt_cuda_host_free(void *ctx, void *p);
nmt_status nmt_cuda_h2d_async(void *ctx, int slot, void *dst, const void *src, size_t bytes);
nmt_status nmt_cuda_h2d_acquire(void *ctx, int slot);
nmt_status nmt_cuda_h2d_release(void *ctx, int slot);
nmt_status nmt_cuda_h2d_wait_src(void *ctx, int slot);

/* ---- asynchronous reads back (cuda/memory.cu; contract: nmt/backend.h; docs/cuda.md "Step
 * control") ----
 * d2h_async(slot, host, dev, bytes): host <- dev on the compute stream, after every op issued
 *   so far, then a copy of the device error word into the slot's pinned int and a record of
 *   the slot's event; returns at once. host should come from host_alloc (from pageable memory
 *   the driver copies on the calling thread); it must not be read before d2h_wait(slot).
 * d2h_wait(slot): polls the slot's event until its last d2h_async has landed (spin, then
 *   sched_yield; the abort flag and an NCCL group's wait hook end it with their error, as in
 *   copy_d2h), then reads the error word copied with it: non-zero, and it returns
 *   NMT_ERR_INTERNAL naming the ops with bad device-side arguments (as copy_d2h; the word is
 *   then cleared). It never waits for the stream itself, so work issued after the slot's
 *   d2h_async keeps running. A slot never used returns at once.
 * Errors (both): NMT_ERR_INTERNAL for a slot outside [0, NMT_D2H_SLOTS) or a call between
 * stream_fork and stream_join; NMT_ERR_DEVICE from the driver; d2h_wait also NMT_ERR_ABORTED
 * and the device-side argument errors. */
nmt_status nmt_cuda_d2h_async(void *ctx, int slot, void *host, const void *dev, size_t bytes);
nmt_status nmt_cuda_d2h_wait(void *ctx, int slot);

/* ---- the comm stream's copies (cuda/memory.cu; contract: nmt/backend.h comm_d2h ...; used by
 * the host-staged communicator, src/comm/staged.c) ----
 * comm_d2h(host, dev, bytes): records ev_compute on the compute stream, makes the comm stream
 *   wait for it, then cudaMemcpyAsync device -> host there (host page-locked); at once.
 * comm_h2d(dev, host, bytes): cudaMemcpyAsync host -> device on the comm stream; at once.
 * comm_wait: polls the comm stream until it is idle (spin, then sched_yield; the abort flag
 *   ends it with NMT_ERR_ABORTED, as copy_d2h).
 * comm_join: records ev_comm on the comm stream, the compute stream waits for it; at once.
 * The same two events and the same stream as the NCCL communicator's collectives (cuda/nccl.cu):
 * a context is bound to one communicator or the other, never both.
 * Errors: NMT_ERR_INTERNAL (NULL ctx, a call between stream_fork and stream_join, a host buffer
 * that is not page-locked), NMT_ERR_DEVICE, NMT_ERR_ABORTED (comm_wait). */
nmt_status nmt_cuda_comm_d2h(void *ctx, void *host, const void *dev, size_t bytes);
nmt_status nmt_cuda_comm_h2d(void *ctx, void *dev, const void *host, size_t bytes);
nmt_status nmt_cuda_comm_wait(void *ctx);
nmt_status nmt_cuda_comm_join(void *ctx);

/* ---- aux stream pool (cuda/context.cu; contract: nmt/backend.h "stream pool") ----
 * stream_pool(n): n (0..8) non-blocking aux streams, each with its own 32 MiB cuBLASLt
 *   workspace and its own op/fp16 scratch (sized from the reserved plan's aux need, at once
 *   when reserve_scratch came first). Called again with another n
 *   it waits for the old aux streams and rebuilds the pool; with the same n it does nothing.
 *   Errors: NMT_ERR_CONFIG (n outside [0, 8]), NMT_ERR_INTERNAL (between a fork and its join),
 *   NMT_ERR_NOMEM, NMT_ERR_DEVICE.
 * stream_fork: records an event on the compute stream; every aux stream waits for it.
 *   NMT_ERR_INTERNAL when already forked.
 * stream_use(i): later ops go to stream i (0 = compute, 1..n = aux i), with that stream's
 *   workspace and scratch. NMT_ERR_INTERNAL for i outside [0, n] or without a fork.
 * stream_join: records an event on each aux stream and makes the compute stream wait for each;
 *   later ops go to the compute stream. NMT_ERR_INTERNAL without a fork.
 * None of them blocks the host. */
nmt_status nmt_cuda_stream_pool(void *ctx, int n);
nmt_status nmt_cuda_stream_fork(void *ctx);
nmt_status nmt_cuda_stream_use(void *ctx, int i);
nmt_status nmt_cuda_stream_join(void *ctx);

/* ---- embedding (cuda/embedding.cu) ---- */
nmt_status nmt_cuda_embedding_fwd(void *ctx, float *out, const int32_t *ids, const float *wte,
                                  const float *pos, int n_rows, int T, int C, float scale);
nmt_status nmt_cuda_embedding_bwd(void *ctx, float *dwte, const float *dout, const int32_t *ids,
                                  int n_rows, int C, float scale);

/* ---- linear (cuda/matmul.cu) ----
 * matmul_fwd with a bias, and matmul_bias_relu_fwd, run as one cuBLASLt GEMM with the BIAS /
 * RELU_BIAS (RELU without a bias) epilogue when the bias is 16-byte aligned and cuBLASLt has an
 * algorithm for it; otherwise as bias broadcast + GEMM (beta 1) + the ReLU kernel. Never
 * refused for alignment. The choice is fixed per shape and alignment (cuda/gemm.cu), so runs
 * stay bitwise repeatable. */
nmt_status nmt_cuda_matmul_fwd(void *ctx, float *out, const float *inp, const float *w,
                               const float *bias, int M, int K, int N);
nmt_status nmt_cuda_matmul_bwd(void *ctx, float *dinp, float *dw, float *dbias, const float *dout,
                               const float *inp, const float *w, int M, int K, int N);
nmt_status nmt_cuda_matmul_bias_relu_fwd(void *ctx, float *out, const float *inp, const float *w,
                                         const float *bias, int M, int K, int N);

/* ---- the half working copy of the weights (cuda/context.cu, cuda/matmul.cu; contract:
 * nmt/backend.h half_weights) ----
 * half_weights: records src, dst (__half or __nv_bfloat16 [n], device memory) and n in the
 *   context; no device work. matmul_fwd/bwd and matmul_bias_relu_fwd then pass a weight that
 *   lies wholly inside src[0, n) to cuBLASLt as its slice dst + (w - src) instead of casting
 *   it into the gemm16 scratch (the activations are still cast). The slice is aligned as the
 *   weight's offset makes it (2 * offset bytes past dst), where the cast copy was 256-byte
 *   aligned; the alignment is part of cuda/gemm.cu's key, so a weight at an offset that is
 *   not a multiple of 128 elements may run another (equally correct) algorithm than the cast.
 *   src == NULL unregisters. Errors: NMT_ERR_INTERNAL for a NULL ctx, fp32/tf32 mode, dst
 *   NULL, n == 0, a copy already registered. While registered, set_precision to another mode
 *   is NMT_ERR_INTERNAL.
 * cast_half: dst[i] = __float2half_rn(src[i]) (fp16 mode) or __float2bfloat16_rn(src[i])
 *   (bf16), by the kernel that casts GEMM inputs, on the current stream; returns at once.
 *   Errors: NMT_ERR_INTERNAL for a NULL ctx, fp32/tf32 mode, NULL pointers with n > 0;
 *   NMT_ERR_DEVICE. */
nmt_status nmt_cuda_half_weights(void *ctx, const float *src, void *dst, size_t n);
nmt_status nmt_cuda_cast_half(void *ctx, void *dst, const float *src, size_t n);
/* infer_weights (cuda/context.cu; contract: nmt/backend.h infer_weights): keeps nothing and
 *   does no device work: cuBLASLt multiplies by the (N, K) weights as a transposed operand
 *   (CUBLASLT_MATMUL_DESC_TRANSA, cuda/gemm.cu) with no packing pass to save. src == NULL is
 *   NMT_OK on any ctx. Errors: NMT_ERR_INTERNAL for a NULL ctx with src, n == 0 with src. */
nmt_status nmt_cuda_infer_weights(void *ctx, const float *src, size_t n);

/* ---- layer normalization (cuda/layernorm.cu) ---- */
nmt_status nmt_cuda_layernorm_fwd(void *ctx, float *out, float *mean, float *rstd,
                                  const float *inp, const float *gamma, const float *beta, int M,
                                  int C, float eps);
nmt_status nmt_cuda_layernorm_bwd(void *ctx, float *dinp, float *dgamma, float *dbeta,
                                  const float *dout, const float *inp, const float *gamma,
                                  const float *mean, const float *rstd, int M, int C);

/* ---- residual + dropout + LayerNorm, fused (cuda/residual.cu; contract in nmt/backend.h) ----
 * fwd: one block per row: sum = x + dropout(y) with the Philox mask of cuda/dropout.cu (one
 *   thread per 4-element Philox block of the row) and its roundings (__fmul_rn, __fadd_rn), so
 *   sum is bitwise nmt_ref_residual_dropout_ln_fwd's; then the LayerNorm of the row as
 *   cuda/layernorm.cu computes it (fp32 block sums, two passes; fp32 tolerance vs the ref).
 * bwd: one block per row for dx and dy (the mask regenerated, never stored); dgamma and dbeta
 *   by layernorm_bwd's deterministic column sums (nmt_cuda_layernorm_bwd with dinp NULL).
 * Both enqueue on the current stream and return at once. */
nmt_status nmt_cuda_residual_dropout_ln_fwd(void *ctx, float *out, float *sum, float *mean,
                                            float *rstd, const float *x, const float *y,
                                            const float *gamma, const float *beta, int M, int C,
                                            float eps, float p, uint64_t seed, uint64_t stream);
nmt_status nmt_cuda_residual_dropout_ln_bwd(void *ctx, float *dx, float *dy, float *dgamma,
                                            float *dbeta, const float *dout, const float *sum,
                                            const float *gamma, const float *mean,
                                            const float *rstd, int M, int C, float p,
                                            uint64_t seed, uint64_t stream);

/* ---- multi-head attention (cuda/attention.cu) ---- */
nmt_status nmt_cuda_attention_fwd(void *ctx, float *out, float *probs, const float *q, int ldq,
                                  const float *k, const float *v, int ldkv,
                                  const int32_t *k_lens, int B, int Tq, int Tk, int H, int dk,
                                  int causal, float p_drop, uint64_t seed, uint64_t stream);
nmt_status nmt_cuda_attention_bwd(void *ctx, float *dq, float *dkey, float *dv, float *dprobs,
                                  const float *dout, const float *probs, const float *q, int ldq,
                                  const float *k, const float *v, int ldkv,
                                  const int32_t *k_lens, int B, int Tq, int Tk, int H, int dk,
                                  int causal, float p_drop, uint64_t seed, uint64_t stream);

/* ---- fused attention (cuda/attention_fused.cu; contract: nmt/attention.h) ----
 * Enqueued on the current stream; no host sync, no allocation. dk in {32, 64, 128}. */
nmt_status nmt_cuda_attention_fused_fwd(void *ctx, void *out, float *lse, const nmt_attn_args *a);
nmt_status nmt_cuda_attention_fused_bwd(void *ctx, void *dq, void *dkey, void *dv, float *drow,
                                        const void *dout, const void *out, const float *lse,
                                        const nmt_attn_args *a);

/* ---- elementwise (cuda/relu.cu, cuda/dropout.cu) and reductions (cuda/reductions.cu: add,
 * axpy, sum_acc, sumsq; count_targets and argmax below) ---- */
nmt_status nmt_cuda_relu_fwd(void *ctx, float *out, const float *inp, size_t n);
nmt_status nmt_cuda_relu_bwd(void *ctx, float *dinp, const float *dout, const float *out,
                             size_t n);
nmt_status nmt_cuda_dropout_fwd(void *ctx, float *out, const float *inp, size_t n, float p,
                                uint64_t seed, uint64_t stream);
nmt_status nmt_cuda_dropout_bwd(void *ctx, float *dinp, const float *dout, size_t n, float p,
                                uint64_t seed, uint64_t stream);
nmt_status nmt_cuda_add(void *ctx, float *out, const float *a, const float *b, size_t n);
nmt_status nmt_cuda_axpy(void *ctx, float *y, const float *x, float alpha, size_t n);
nmt_status nmt_cuda_sum_acc(void *ctx, float *dst, const float *x, size_t n);
nmt_status nmt_cuda_sumsq(void *ctx, float *dst, const float *x, size_t n);

/* ---- the optimizer step's control (step_control: cuda/step.cu; count_targets:
 * cuda/reductions.cu; contract: nmt/backend.h) ----
 * count_targets: *dst (device float) += the number of targets[i] != NMT_PAD_ID, i < n
 *   (targets: (n) int32, device), counted as an integer by one block and added once, rounded
 *   to float (exact below 2^24). Bitwise nmt_ref_count_targets.
 * step_control: ctl (device nmt_step_ctl), grads (n + NMT_GRAD_EXTRA) device floats: the sum
 *   of squares of grads[0, n) into ctl->sumsq (the deterministic reduction of sumsq: double
 *   partials over a fixed grid, one rounding to float), then one thread applies the
 *   loss-scaling and clipping policy of nmt/backend.h to the block in double, with the
 *   reference's expressions (nmt_ref_step_control): for the same sumsq the block is bitwise
 *   the reference's. Micikevicius et al. 2018 §3.2 (dynamic loss scaling, as
 *   torch.cuda.amp.GradScaler); clipping as torch.nn.utils.clip_grad_norm_ on the per-token
 *   gradient. Nothing is read on the host. Errors: NMT_ERR_INTERNAL for step < 1 (or a NULL
 *   context); NMT_ERR_DEVICE, NMT_ERR_NOMEM (scratch for the partial sums).
 * Both enqueue on the current stream and return at once. */
nmt_status nmt_cuda_count_targets(void *ctx, float *dst, const int32_t *targets, size_t n);
nmt_status nmt_cuda_step_control(void *ctx, nmt_step_ctl *ctl, const float *grads, size_t n,
                                 nmt_step_policy policy, long step);
/* step_decide: nmt_ref_step_decide's twin (one-thread kernel on the compute stream). */
nmt_status nmt_cuda_step_decide(void *ctx, nmt_step_ctl *ctl, const float *sumsq,
                                const float *extra, nmt_step_policy policy, long step);

/* ---- softmax cross-entropy (cuda/xent.cu) and argmax (cuda/reductions.cu) ----
 * xent_fwd_bwd: dloss_scale NULL, or a device float (nmt_step_ctl.scale) read by the kernel:
 * the gradient is then that of dloss * *dloss_scale, the float product formed once, bitwise
 * as passing the product as dloss. */
nmt_status nmt_cuda_xent_fwd_bwd(void *ctx, float *logits, float *losses, float *nll,
                                 const int32_t *targets, int M, int V, float label_smoothing,
                                 float dloss, const float *dloss_scale, int write_grad);
nmt_status nmt_cuda_argmax(void *ctx, int32_t *out, const float *x, int M, int V);

/* ---- decoding's per-step selection (cuda/logp_topk.cu; contract: nmt/backend.h) ----
 * One block per row: block reductions for the row's max and its sum of exponentials (fp32
 * exponentials, the sum in double), then the top k by k block-wide arg-maxes, each over the
 * ids ranked after the previous winner (O(k V) per row: meant for beam-sized k). Enqueued on
 * the current stream; nothing waits. Errors: as nmt_ref_logp_topk, NMT_ERR_DEVICE. */
nmt_status nmt_cuda_logp_topk(void *ctx, int32_t *ids, float *logp, const float *x, int R, int V,
                              int k);
/* logp_at (nmt/backend.h): one block per row, the row's log-sum-exp by the same reductions
 * as nmt_cuda_logp_topk (the same bits), read at the given ids. Enqueued on the current
 * stream. Errors: as nmt_ref_logp_at, NMT_ERR_DEVICE. */
nmt_status nmt_cuda_logp_at(void *ctx, float *logp, const int32_t *ids, const float *x, int R,
                            int V, int k);

/* ---- AdamW (cuda/adamw.cu) ----
 * ctl: NULL (grad_scale multiplies the gradient), or a device nmt_step_ctl from step_control:
 * every thread reads ctl->skip and ctl->coef; skip != 0 writes nothing (params, m and v stay
 * bitwise unchanged), else coef replaces grad_scale (bitwise as passing it as grad_scale).
 * half_out: NULL, or the half working copy (n __half in fp16 mode, __nv_bfloat16 in bf16
 * mode), written in the same kernel with __float2half_rn / __float2bfloat16_rn of each new
 * parameter (nothing on a skipped step). Errors: NMT_ERR_INTERNAL for step < 1, a half_out in
 * fp32/tf32 mode, a NULL ctx; NMT_ERR_DEVICE. */
nmt_status nmt_cuda_adamw(void *ctx, float *params, const float *grads, float *m, float *v,
                          size_t n, float lr, float beta1, float beta2, float eps,
                          float weight_decay, float grad_scale, const nmt_step_ctl *ctl,
                          void *half_out, long step);

/* ---- the half-storage path (contract: nmt/backend.h "the half-storage path"; tested against
 * the nmt_ref_*_half* of nmt/ref.h in test/test_cuda_<op>.c). Half elements are __half in fp16
 * mode, __nv_bfloat16 in bf16 mode. ---- */
/* linear_half_fwd / linear_half_bwd (cuda/matmul.cu; cuBLASLt use and fallbacks: cuda/gemm.cu
 * and docs/cuda.md "Bias and ReLU epilogues"): one GEMM with A/B and D in the half type and
 * fp32 accumulation. Forward: the BIAS / RELU_BIAS / RELU epilogue with the half bias from the
 * registered copy (a batch: the bias batch stride, the shared input at batch stride 0),
 * RELU_AUX_BIAS / RELU_AUX when relu_mask is given (batch 1; *mask_written = 1 only when it
 * ran), else the half bias broadcast, the GEMM with beta 1 and a ReLU kernel. A weight or bias
 * outside the registered copy is cast per call into the 16-bit scratch (counters().casts).
 * Backward: the dinp GEMM with D half or fp32 (beta 1 for NMT_DINP_F32_ADD); DRELU with the
 * forward's mask when relu_scale == 1, else one kernel over the half dinp; the dW GEMM
 * (beta 1) with BGRADB into op scratch and an add into dbias, else a deterministic column-sum
 * kernel over dout. Errors: the contract's (nmt/backend.h), and NMT_ERR_INTERNAL for a batch
 * whose out_stride < M*N (outputs overlapping: the reference would write them in order). */
nmt_status nmt_cuda_linear_half_fwd(void *ctx, nmt_act *out, const nmt_act *inp, const float *w,
                                    const float *bias, int M, int K, int N, int relu,
                                    uint8_t *relu_mask, int *mask_written, int batch,
                                    size_t param_stride, size_t out_stride);
nmt_status nmt_cuda_linear_half_bwd(void *ctx, void *dinp, nmt_dinp_mode dinp_mode, float *dw,
                                    float *dbias, const nmt_act *dout, const nmt_act *inp,
                                    const float *w, const nmt_act *relu_out,
                                    const uint8_t *relu_mask, float relu_scale, int M, int K,
                                    int N);
nmt_status nmt_cuda_attention_half_fwd(void *ctx, nmt_act *out, float *probs, const nmt_act *q,
                                       int ldq, const nmt_act *k, const nmt_act *v, int ldkv,
                                       const int32_t *k_lens, int B, int Tq, int Tk, int H, int dk,
                                       int causal, float p_drop, uint64_t seed, uint64_t stream);
nmt_status nmt_cuda_attention_half_bwd(void *ctx, nmt_act *dq, nmt_act *dkey, nmt_act *dv,
                                       float *dprobs, const nmt_act *dout, const float *probs,
                                       const nmt_act *q, int ldq, const nmt_act *k,
                                       const nmt_act *v, int ldkv, const int32_t *k_lens, int B,
                                       int Tq, int Tk, int H, int dk, int causal, float p_drop,
                                       uint64_t seed, uint64_t stream);
nmt_status nmt_cuda_residual_ln_half_fwd(void *ctx, float *out, nmt_act *out_h, float *sum,
                                         float *mean, float *rstd, const float *x,
                                         const nmt_act *y, const float *gamma, const float *beta,
                                         int M, int C, float eps, float p, uint64_t seed,
                                         uint64_t stream);
nmt_status nmt_cuda_residual_ln_half_bwd(void *ctx, float *dx, nmt_act *dy, float *dgamma,
                                         float *dbeta, const float *dout, const float *sum,
                                         const float *gamma, const float *mean, const float *rstd,
                                         int M, int C, float p, uint64_t seed, uint64_t stream);
nmt_status nmt_cuda_layernorm_half_fwd(void *ctx, nmt_act *out, float *mean, float *rstd,
                                       const float *inp, const float *gamma, const float *beta,
                                       int M, int C, float eps);
nmt_status nmt_cuda_layernorm_half_bwd(void *ctx, float *dinp, int accumulate, nmt_act *dinp_h,
                                       float *dgamma, float *dbeta, const float *dout,
                                       const float *inp, const float *gamma, const float *mean,
                                       const float *rstd, int M, int C);
nmt_status nmt_cuda_xent_half_fwd_bwd(void *ctx, nmt_act *logits, float *losses, float *nll,
                                      const int32_t *targets, int M, int V, float label_smoothing,
                                      float dloss, const float *dloss_scale, int write_grad);
nmt_status nmt_cuda_embedding_half_fwd(void *ctx, float *out, nmt_act *out_h, const int32_t *ids,
                                       const float *wte, const float *pos, int n_rows, int T,
                                       int C, float scale, float p, uint64_t seed,
                                       uint64_t stream);
nmt_status nmt_cuda_dropout_half(void *ctx, nmt_act *out, const void *inp, int inp_f32, size_t n,
                                 float p, uint64_t seed, uint64_t stream);

#ifdef __cplusplus
}
#endif
#endif /* NMT_CUDA_H */
