/* cuda/context.cu — the per-device context: device, compute and comm streams and their events,
 * cuBLASLt handle and workspace, scratch (op scratch and the fp16/bf16 GEMM-input copies), GEMM
 * precision, the device-side error word, the abort flag and the polling host wait;
 * CUDA/cuBLASLt error conversion. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "nmt/log.h"

nmt_status nmt__cuda_error(cudaError_t e, const char *what, const char *file, int line) {
  nmt_status s = e == cudaErrorMemoryAllocation ? NMT_ERR_NOMEM : NMT_ERR_DEVICE;
  return nmt_errorf(s, "CUDA error %s (%s) in %s at %s:%d", cudaGetErrorName(e),
                    cudaGetErrorString(e), what, file, line);
}

nmt_status nmt__cublas_error(cublasStatus_t st, const char *what, const char *file, int line) {
  nmt_status s = st == CUBLAS_STATUS_ALLOC_FAILED ? NMT_ERR_NOMEM : NMT_ERR_DEVICE;
  return nmt_errorf(s, "cuBLASLt error %d (%s) in %s at %s:%d", (int)st,
                    cublasLtGetStatusString(st), what, file, line);
}

nmt_status nmt__cuda_enter(void *ctx, const char *op) {
  if (!ctx)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: NULL context (create one with ctx_create)", op);
  NMT_CUDA_TRY(cudaSetDevice(nmt__cuda_ctx(ctx)->device));
  return NMT_OK;
}

nmt_status nmt_cuda_device_count(int *out) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    nmt_log(NMT_LOG_DEBUG, "cudaGetDeviceCount: %s (%s): treating as no CUDA device",
            cudaGetErrorName(e), cudaGetErrorString(e));
    (void)cudaGetLastError(); /* clear the sticky-free error so later calls start clean */
    n = 0;
  }
  *out = n < 0 ? 0 : n;
  return NMT_OK;
}

static void ctx_free(nmt_cuda_ctx *c) {
  if (c->stream) cudaStreamSynchronize(c->stream);
  if (c->comm_stream) cudaStreamSynchronize(c->comm_stream);
  if (c->lt) cublasLtDestroy(c->lt);
  cudaFree(c->workspace);
  cudaFree(c->scratch);
  cudaFree(c->gemm16);
  cudaFree(c->ones);
  cudaFree(c->d_err);
  cudaFreeHost(c->h_err);
  if (c->ev_compute) cudaEventDestroy(c->ev_compute);
  if (c->ev_comm) cudaEventDestroy(c->ev_comm);
  if (c->comm_stream) cudaStreamDestroy(c->comm_stream);
  if (c->stream) cudaStreamDestroy(c->stream);
  free(c);
}

static nmt_status ctx_init(nmt_cuda_ctx *c, int device) {
  int n = 0;
  NMT_TRY(nmt_cuda_device_count(&n));
  if (device < 0 || device >= n)
    return nmt_errorf(NMT_ERR_DEVICE, "cuda: device %d requested but %d CUDA device(s) present",
                      device, n);
  c->device = device;
  NMT_CUDA_TRY(cudaSetDevice(device));
  NMT_CUDA_TRY(cudaDeviceGetAttribute(&c->sm_count, cudaDevAttrMultiProcessorCount, device));
  NMT_CUDA_TRY(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  /* Collectives get their own stream so that they overlap the rest of backward; non-blocking
   * so that neither stream synchronizes with the legacy default stream. Timing is off: the
   * events only order the streams, which makes recording and waiting cheaper. */
  NMT_CUDA_TRY(cudaStreamCreateWithFlags(&c->comm_stream, cudaStreamNonBlocking));
  NMT_CUDA_TRY(cudaEventCreateWithFlags(&c->ev_compute, cudaEventDisableTiming));
  NMT_CUDA_TRY(cudaEventCreateWithFlags(&c->ev_comm, cudaEventDisableTiming));
  NMT_CUBLAS_TRY(cublasLtCreate(&c->lt));
  NMT_CUDA_TRY(cudaMalloc(&c->workspace, NMT_CUDA_WORKSPACE_BYTES));
  NMT_CUDA_TRY(cudaMalloc((void **)&c->d_err, sizeof(int)));
  NMT_CUDA_TRY(cudaMallocHost((void **)&c->h_err, sizeof(int)));
  NMT_CUDA_TRY(cudaMemsetAsync(c->d_err, 0, sizeof(int), c->stream));
  *c->h_err = 0;
  NMT_TRY(nmt__cuda_wait(c, c->stream, "ctx_create"));
  c->precision = NMT_PRECISION_FP32;
  return NMT_OK;
}

nmt_status nmt_cuda_ctx_create(int device, void **ctx) {
  *ctx = NULL;
  nmt_cuda_ctx *c = (nmt_cuda_ctx *)calloc(1, sizeof *c);
  if (!c) return nmt_errorf(NMT_ERR_NOMEM, "cuda: cannot allocate a device context");
  nmt_status s = ctx_init(c, device);
  if (s != NMT_OK) {
    ctx_free(c);
    return s;
  }
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess)
    nmt_log(NMT_LOG_DEBUG, "cuda: device %d %s (sm_%d%d, %d SMs, %.1f GiB)", device, prop.name,
            prop.major, prop.minor, c->sm_count, (double)prop.totalGlobalMem / 1073741824.0);
  *ctx = c;
  return NMT_OK;
}

void nmt_cuda_ctx_destroy(void *ctx) {
  if (!ctx) return;
  cudaSetDevice(nmt__cuda_ctx(ctx)->device);
  ctx_free(nmt__cuda_ctx(ctx));
}

nmt_status nmt_cuda_ctx_set_abort(void *ctx, atomic_int *abort) {
  if (!ctx)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda ctx_set_abort: NULL context (create one with "
                                        "ctx_create)");
  nmt__cuda_ctx(ctx)->abort = abort;
  return NMT_OK;
}

nmt_status nmt_cuda_ctx_streams(void *ctx, void **compute, void **comm) {
  if (!ctx)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda ctx_streams: NULL context (create one with "
                                        "ctx_create)");
  if (compute) *compute = (void *)nmt__cuda_ctx(ctx)->stream;
  if (comm) *comm = (void *)nmt__cuda_ctx(ctx)->comm_stream;
  return NMT_OK;
}

/* A driver call costs a microsecond or two: the first polls catch short waits (a copy at the
 * end of a step) without giving up the core; then each poll yields, so that 8 waiting workers
 * do not starve the threads they wait for (loaders, NCCL's proxy threads). */
enum { WAIT_SPINS = 2000, WAIT_HOOK_EVERY = 64 };

nmt_status nmt__cuda_wait(nmt_cuda_ctx *c, cudaStream_t s, const char *what) {
  for (unsigned long i = 0;; i++) {
    cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return NMT_OK;
    if (e != cudaErrorNotReady) {
      char call[96];
      snprintf(call, sizeof call, "cudaStreamQuery (waiting in %s on device %d)", what,
               c->device);
      return nmt__cuda_error(e, call, __FILE__, __LINE__);
    }
    /* Relaxed: the flag guards no data, it only ends the wait (as in src/comm/host.c). The
     * abort leaves work on the stream: the caller's buffers stay in use until the context's
     * NCCL group is aborted and the context destroyed. */
    if (c->abort && c->abort->load(std::memory_order_relaxed)) return NMT_ERR_ABORTED;
    /* Not on the first polls: a short wait (a small copy) should not call into NCCL. */
    if (c->wait_hook && i % WAIT_HOOK_EVERY == WAIT_HOOK_EVERY - 1)
      NMT_TRY(c->wait_hook(c->wait_arg));
    if (i >= WAIT_SPINS) sched_yield();
  }
}

nmt_status nmt_cuda_set_precision(void *ctx, nmt_precision mode) {
  NMT_TRY(nmt__cuda_enter(ctx, "set_precision"));
  if (mode != NMT_PRECISION_FP32 && mode != NMT_PRECISION_TF32 && mode != NMT_PRECISION_FP16 &&
      mode != NMT_PRECISION_BF16)
    return nmt_errorf(NMT_ERR_CONFIG, "cuda backend: unknown precision mode %d", (int)mode);
  nmt__cuda_ctx(ctx)->precision = mode;
  return NMT_OK;
}

/* A device buffer *buf of at least `bytes`, grown by a quarter more (shapes vary batch to
 * batch). The old buffer may still be read by enqueued kernels: wait for them first. */
static nmt_status grow(nmt_cuda_ctx *c, void **buf, size_t *cap, size_t bytes) {
  if (bytes > *cap) {
    NMT_TRY(nmt__cuda_wait(c, c->stream, "scratch growth"));
    NMT_CUDA_TRY(cudaFree(*buf));
    *buf = NULL;
    *cap = 0;
    const size_t want = bytes + bytes / 4;
    if (want < bytes)
      return nmt_errorf(NMT_ERR_NOMEM, "cuda: scratch of %zu bytes is too large", bytes);
    NMT_CUDA_TRY(cudaMalloc(buf, want));
    *cap = want;
  }
  return NMT_OK;
}

nmt_status nmt__cuda_scratch(nmt_cuda_ctx *c, size_t bytes, void **out) {
  NMT_TRY(grow(c, &c->scratch, &c->scratch_bytes, bytes));
  *out = c->scratch;
  return NMT_OK;
}

nmt_status nmt__cuda_gemm16_scratch(nmt_cuda_ctx *c, size_t bytes, void **out) {
  NMT_TRY(grow(c, &c->gemm16, &c->gemm16_bytes, bytes));
  *out = c->gemm16;
  return NMT_OK;
}

static __global__ void fill_ones(float *x, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] = 1.0f;
}

nmt_status nmt__cuda_ones(nmt_cuda_ctx *c, size_t n, const float **out) {
  if (n > c->ones_len) {
    NMT_TRY(nmt__cuda_wait(c, c->stream, "ones growth"));
    NMT_CUDA_TRY(cudaFree(c->ones));
    c->ones = NULL;
    c->ones_len = 0;
    size_t len = n < 4096 ? 4096 : n + n / 4;
    NMT_CUDA_TRY(cudaMalloc((void **)&c->ones, len * sizeof(float)));
    fill_ones<<<nmt__grid(len, 256), 256, 0, c->stream>>>(c->ones, len);
    NMT_CUDA_LAUNCH_CHECK("fill_ones");
    c->ones_len = len;
  }
  *out = c->ones;
  return NMT_OK;
}

nmt_status nmt__cuda_check_errors(nmt_cuda_ctx *c) {
  NMT_CUDA_TRY(cudaMemcpyAsync(c->h_err, c->d_err, sizeof(int), cudaMemcpyDeviceToHost,
                               c->stream));
  NMT_TRY(nmt__cuda_wait(c, c->stream, "copy_d2h/synchronize"));
  int e = *c->h_err;
  if (!e) return NMT_OK;
  *c->h_err = 0;
  NMT_CUDA_TRY(cudaMemsetAsync(c->d_err, 0, sizeof(int), c->stream));
  NMT_TRY(nmt__cuda_wait(c, c->stream, "clearing the error word"));
  return nmt_errorf(NMT_ERR_INTERNAL, "cuda: bad argument seen on the device:%s%s%s",
                    e & NMT_CUDA_ERR_EMB_ID ? " embedding token id < 0;" : "",
                    e & NMT_CUDA_ERR_ATT_KLEN ? " attention k_lens[b] outside [1, Tk];" : "",
                    e & NMT_CUDA_ERR_XENT_TARGET ? " xent target outside [0, V);" : "");
}
