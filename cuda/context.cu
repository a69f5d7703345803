/* cuda/context.cu — the per-device context: the kernel preload (common.cuh: every kernel is
 * loaded at creation, not lazily at its first launch), device, compute, comm and copy streams
 * and their events, the aux stream pool (stream_pool/fork/use/join), cuBLASLt handle and
 * workspaces, scratch (op scratch and the fp16/bf16 GEMM-input copies, one set per stream, and
 * the ones vector), sized once by reserve_scratch from the scratch plan (growth beyond it is
 * counted and logged), the counters (GEMM launches, scratch growths, and the per-thread
 * launch count), the epilogue test knob, GEMM precision, the
 * registered half copy of the weights (half_weights), the device-side error word, the
 * read-back slots' events, the abort flag and the polling host waits; CUDA/cuBLASLt error
 * conversion; and the communicator factory (comm_create: NCCL over several GPUs), as
 * src/ref/context.c. */
#include <dlfcn.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "half_scratch.cuh"
#include "nmt/comm.h"
#include "nmt/log.h"

/* Stream names in the Nsight Systems timeline. NVTX v3 is header-only and costs nothing until
 * Nsight injects its library; compiled in when NMT_NVTX is defined, as in include/nmt/nvtx.h. */
#ifdef NMT_NVTX
#include <nvtx3/nvToolsExtCudaRt.h>
static void name_stream(cudaStream_t s, const char *name) { nvtxNameCudaStreamA(s, name); }
#else
static void name_stream(cudaStream_t s, const char *name) { (void)s, (void)name; }
#endif

nmt_status nmt__cuda_error(cudaError_t e, const char *what, const char *file, int line) {
  nmt_status s = e == cudaErrorMemoryAllocation ? NMT_ERR_NOMEM : NMT_ERR_DEVICE;
  /* A failed runtime call also leaves its error as the thread's last error; reported here, it
   * must not be reported again by the next NMT_CUDA_LAUNCH_CHECK (a tolerated failure, such as
   * a reserve that set_precision rolls back, would fail an unrelated launch). Sticky errors
   * (a fault in a kernel) stay: cudaGetLastError cannot clear them. */
  (void)cudaGetLastError();
  return nmt_errorf(s, "CUDA error %s (%s) in %s at %s:%d", cudaGetErrorName(e),
                    cudaGetErrorString(e), what, file, line);
}

nmt_status nmt__cublas_error(cublasStatus_t st, const char *what, const char *file, int line) {
  nmt_status s = st == CUBLAS_STATUS_ALLOC_FAILED ? NMT_ERR_NOMEM : NMT_ERR_DEVICE;
  return nmt_errorf(s, "cuBLASLt error %d (%s) in %s at %s:%d", (int)st,
                    cublasLtGetStatusString(st), what, file, line);
}

/* The kernel preload list (common.cuh): constant-initialized (empty before any constructor
 * runs), filled by the entries' constructors during static initialization, read-only after. */
static const nmt__cuda_preload_entry *preload_head = nullptr;

nmt__cuda_preload_entry::nmt__cuda_preload_entry(const void *f, const char *n)
    : func(f), name(n), next(preload_head) {
  preload_head = this;
}

nmt_status nmt__cuda_preload(int *n) {
  *n = 0;
  for (const nmt__cuda_preload_entry *e = preload_head; e; e = e->next) {
    cudaFuncAttributes a;
    cudaError_t err = cudaFuncGetAttributes(&a, e->func);
    if (err != cudaSuccess) {
      char what[160];
      snprintf(what, sizeof what, "cudaFuncGetAttributes(%s) (loading the kernels)", e->name);
      return nmt__cuda_error(err, what, __FILE__, __LINE__);
    }
    ++*n;
  }
  return NMT_OK;
}

nmt_status nmt__cuda_enter(void *ctx, const char *op) {
  if (!ctx)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: NULL context (create one with ctx_create)", op);
  NMT_CUDA_TRY(cudaSetDevice(nmt__cuda_ctx(ctx)->device));
  return NMT_OK;
}

/* How loud a failed cudaGetDeviceCount is. WARN where a GPU is expected: NMT_EXPECT_GPU is set
 * (tools/gpu-check.sh), or the driver library libcuda.so.1 is installed, so a driver is there and
 * refused (too old for this runtime, no device node, ...). DEBUG where no driver is installed
 * (CI, CPU machines): there "no CUDA device" is the normal answer of a CUDA build. */
static nmt_log_level no_device_level(void) {
  const char *e = getenv("NMT_EXPECT_GPU");
  if (e && *e && strcmp(e, "0") != 0) return NMT_LOG_WARN;
  void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (!h) return NMT_LOG_DEBUG;
  dlclose(h);
  return NMT_LOG_WARN;
}

nmt_status nmt_cuda_device_count(int *out) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    int drv = 0;
    char dv[48] = "no CUDA driver found";
    if (cudaDriverGetVersion(&drv) == cudaSuccess && drv > 0)
      snprintf(dv, sizeof dv, "the driver supports CUDA %d.%d", drv / 1000, drv % 1000 / 10);
    nmt_log(no_device_level(), "cudaGetDeviceCount: %s (%s): treating as no CUDA device (%s; "
            "this build's runtime is CUDA %d.%d)", cudaGetErrorName(e), cudaGetErrorString(e), dv,
            CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
    (void)cudaGetLastError(); /* clear the sticky-free error so later calls start clean */
    n = 0;
  }
  *out = n < 0 ? 0 : n;
  return NMT_OK;
}

/* Frees what a lane holds (NULL members are skipped, so a half-built lane is fine) after its
 * stream has run everything, and zeroes it. */
static void lane_free(nmt__cuda_lane *l) {
  if (l->stream) cudaStreamSynchronize(l->stream);
  cudaFree(l->workspace);
  cudaFree(l->scratch);
  cudaFree(l->gemm16);
  if (l->ev_join) cudaEventDestroy(l->ev_join);
  if (l->stream) cudaStreamDestroy(l->stream);
  memset(l, 0, sizeof *l);
}

static void ctx_free(nmt_cuda_ctx *c) {
  if (c->stream) cudaStreamSynchronize(c->stream);
  if (c->comm_stream) cudaStreamSynchronize(c->comm_stream);
  if (c->copy_stream) cudaStreamSynchronize(c->copy_stream);
  for (int i = 0; i < c->n_aux; i++) lane_free(&c->aux[i]);
  for (int i = 0; i < 2; i++) {
    if (c->ev_ready[i]) cudaEventDestroy(c->ev_ready[i]);
    if (c->ev_freed[i]) cudaEventDestroy(c->ev_freed[i]);
  }
  for (int i = 0; i < NMT_D2H_SLOTS; i++)
    if (c->ev_d2h[i]) cudaEventDestroy(c->ev_d2h[i]);
  cudaFreeHost(c->d2h_err);
  if (c->ev_fork) cudaEventDestroy(c->ev_fork);
  if (c->copy_stream) cudaStreamDestroy(c->copy_stream);
  nmt__cuda_gemm_cache_free(c);
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

/* NMT_ATTENTION_FUSED_IMPL (nmt/cuda.h, nmt_cuda_ctx_set_attention_fused_impl): *simt = 1
 * for "simt", 0 for "mma", unset or empty; any other value is refused. */
static nmt_status attention_fused_impl_env(int *simt) {
  const char *e = getenv("NMT_ATTENTION_FUSED_IMPL");
  *simt = 0;
  if (!e || !*e || strcmp(e, "mma") == 0) return NMT_OK;
  if (strcmp(e, "simt") == 0) {
    *simt = 1;
    return NMT_OK;
  }
  return nmt_errorf(NMT_ERR_USAGE, "cuda: NMT_ATTENTION_FUSED_IMPL=%s: expected simt or mma", e);
}

static nmt_status ctx_init(nmt_cuda_ctx *c, int device) {
  NMT_TRY(attention_fused_impl_env(&c->attn_fused_simt));
  int n = 0;
  NMT_TRY(nmt_cuda_device_count(&n));
  if (device < 0 || device >= n)
    return nmt_errorf(NMT_ERR_DEVICE, "cuda: device %d requested but %d CUDA device(s) present",
                      device, n);
  c->device = device;
  NMT_CUDA_TRY(cudaSetDevice(device));
  NMT_CUDA_TRY(cudaDeviceGetAttribute(&c->sm_count, cudaDevAttrMultiProcessorCount, device));
  /* Every kernel now, while no stream holds work: loaded lazily, a kernel's first launch could
   * wait for the whole context (common.cuh, "Kernel preload"). */
  int n_kernels = 0;
  NMT_TRY(nmt__cuda_preload(&n_kernels));
  NMT_CUDA_TRY(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  /* Collectives get their own stream so that they overlap the rest of backward; non-blocking
   * so that neither stream synchronizes with the legacy default stream. Timing is off: the
   * events only order the streams, which makes recording and waiting cheaper. */
  /* At the device's greatest priority: a collective's blocks are scheduled before pending
   * blocks of backward's kernels, so a bucket's reduction starts when its gradients are ready
   * rather than after the GEMMs queued behind them (CUDA Programming Guide, Stream
   * Priorities). */
  int least_prio = 0, greatest_prio = 0;
  NMT_CUDA_TRY(cudaDeviceGetStreamPriorityRange(&least_prio, &greatest_prio));
  NMT_CUDA_TRY(cudaStreamCreateWithPriority(&c->comm_stream, cudaStreamNonBlocking,
                                            greatest_prio));
  NMT_CUDA_TRY(cudaEventCreateWithFlags(&c->ev_compute, cudaEventDisableTiming));
  NMT_CUDA_TRY(cudaEventCreateWithFlags(&c->ev_comm, cudaEventDisableTiming));
  /* Batch staging: the copy engine moves the next micro-batch while the SMs compute. An event
   * never recorded counts as complete, so the first copy into a slot waits for nothing. */
  NMT_CUDA_TRY(cudaStreamCreateWithFlags(&c->copy_stream, cudaStreamNonBlocking));
  for (int i = 0; i < 2; i++) {
    NMT_CUDA_TRY(cudaEventCreateWithFlags(&c->ev_ready[i], cudaEventDisableTiming));
    NMT_CUDA_TRY(cudaEventCreateWithFlags(&c->ev_freed[i], cudaEventDisableTiming));
  }
  /* Read-back slots: an event never recorded counts as complete and the error copies start at
   * 0, so d2h_wait on a slot never used returns at once. */
  for (int i = 0; i < NMT_D2H_SLOTS; i++)
    NMT_CUDA_TRY(cudaEventCreateWithFlags(&c->ev_d2h[i], cudaEventDisableTiming));
  NMT_CUDA_TRY(cudaMallocHost((void **)&c->d2h_err, NMT_D2H_SLOTS * sizeof(int)));
  memset(c->d2h_err, 0, NMT_D2H_SLOTS * sizeof(int));
  NMT_CUDA_TRY(cudaEventCreateWithFlags(&c->ev_fork, cudaEventDisableTiming));
  name_stream(c->stream, "compute");
  name_stream(c->comm_stream, "comm");
  name_stream(c->copy_stream, "copy");
  NMT_CUBLAS_TRY(cublasLtCreate(&c->lt));
  NMT_CUDA_TRY(cudaMalloc(&c->workspace, NMT_CUDA_WORKSPACE_BYTES));
  NMT_CUDA_TRY(cudaMalloc((void **)&c->d_err, sizeof(int)));
  NMT_CUDA_TRY(cudaMallocHost((void **)&c->h_err, sizeof(int)));
  NMT_CUDA_TRY(cudaMemsetAsync(c->d_err, 0, sizeof(int), c->stream));
  *c->h_err = 0;
  /* CUB's radix sort (embedding_bwd) launches kernels this file cannot name: run it once. */
  NMT_TRY(nmt__cuda_embedding_preload(c));
  NMT_TRY(nmt__cuda_wait(c, c->stream, "ctx_create"));
  c->precision = NMT_PRECISION_FP32;
  nmt_log(NMT_LOG_DEBUG, "cuda: device %d: %d kernels and CUB's sort loaded", device, n_kernels);
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
  else
    (void)cudaGetLastError(); /* tolerated (a log line lost): not left for the next launch */
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

nmt_status nmt_cuda_comm_create(int n, const int *devices, void *const *ctxs, atomic_int *abort,
                                nmt_comm **comms) {
  /* One GPU never reduces: the host communicator costs nothing and needs no NCCL. */
  if (n == 1) return nmt_comm_create_host(n, abort, comms);
  return nmt_comm_create_nccl(n, devices, ctxs, abort, comms);
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

/* Polls a stream (ev == NULL) or an event until it has completed. */
static nmt_status poll(nmt_cuda_ctx *c, cudaStream_t s, cudaEvent_t ev, const char *what) {
  for (unsigned long i = 0;; i++) {
    cudaError_t e = ev ? cudaEventQuery(ev) : cudaStreamQuery(s);
    if (e == cudaSuccess) return NMT_OK;
    /* Not an error, but the runtime keeps cudaErrorNotReady as the thread's last error: left
     * there, the next NMT_CUDA_LAUNCH_CHECK (cudaGetLastError) would report "cudaErrorNotReady
     * in launch of ..." after any wait that polled once (PyTorch clears it the same way,
     * pytorch#18584). */
    if (e == cudaErrorNotReady) (void)cudaGetLastError();
    if (e != cudaErrorNotReady) {
      char call[96];
      snprintf(call, sizeof call, "%s (waiting in %s on device %d)",
               ev ? "cudaEventQuery" : "cudaStreamQuery", what, c->device);
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

nmt_status nmt__cuda_wait(nmt_cuda_ctx *c, cudaStream_t s, const char *what) {
  return poll(c, s, NULL, what);
}

nmt_status nmt__cuda_wait_event(nmt_cuda_ctx *c, cudaEvent_t e, const char *what) {
  return poll(c, NULL, e, what);
}

/* Every stream an op may have used: compute, then the pool's. */
static nmt_status wait_all(nmt_cuda_ctx *c, const char *what) {
  NMT_TRY(nmt__cuda_wait(c, c->stream, what));
  for (int i = 0; i < c->n_aux; i++) NMT_TRY(nmt__cuda_wait(c, c->aux[i].stream, what));
  return NMT_OK;
}

nmt_status nmt__cuda_main_only(const nmt_cuda_ctx *c, const char *op) {
  if (c->forked)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda %s: called between stream_fork and stream_join (copies, memset, "
                      "synchronize, staging and read-backs are main-stream only: join first)",
                      op);
  return NMT_OK;
}

static nmt_status reserve_all(nmt_cuda_ctx *c);

nmt_status nmt_cuda_set_precision(void *ctx, nmt_precision mode) {
  NMT_TRY(nmt__cuda_enter(ctx, "set_precision"));
  if (mode != NMT_PRECISION_FP32 && mode != NMT_PRECISION_TF32 && mode != NMT_PRECISION_FP16 &&
      mode != NMT_PRECISION_BF16)
    return nmt_errorf(NMT_ERR_CONFIG, "cuda backend: unknown precision mode %d", (int)mode);
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (c->half_src && mode != c->precision)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda set_precision: a half copy of the weights is registered "
                      "(half_weights) in another half type; unregister it first");
  /* fp16/bf16 GEMMs cast their inputs into the 16-bit scratch: size it now, not in a step.
   * A failed reserve keeps the old mode (the buffers only grow, so the context stays whole). */
  const nmt_precision was = c->precision;
  c->precision = mode;
  nmt_status s = c->planned ? reserve_all(c) : NMT_OK;
  if (s != NMT_OK) c->precision = was;
  return s;
}

nmt_status nmt_cuda_half_weights(void *ctx, const float *src, void *dst, size_t n) {
  NMT_TRY(nmt__cuda_enter(ctx, "half_weights"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (!src) {
    c->half_src = NULL;
    c->half_dst = NULL;
    c->half_n = 0;
    return NMT_OK;
  }
  if (c->precision != NMT_PRECISION_FP16 && c->precision != NMT_PRECISION_BF16)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda half_weights: the context's precision does not round GEMM inputs: "
                      "there is no half copy to keep (fp16/bf16 only)");
  if (!dst || n == 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda half_weights: %s", !dst ? "dst is NULL" : "n is 0");
  if (c->half_src)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda half_weights: a copy is already registered (one per context: "
                      "unregister it with src = NULL first)");
  c->half_src = src;
  c->half_dst = dst;
  c->half_n = n;
  return NMT_OK;
}

nmt_status nmt_cuda_infer_weights(void *ctx, const float *src, size_t n) {
  /* Nothing to keep: cuBLASLt reads the (N, K) weights as a transposed operand (nmt/cuda.h). */
  if (!src) return NMT_OK;
  if (!ctx)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda infer_weights: NULL context (create one with ctx_create)");
  if (n == 0) return nmt_errorf(NMT_ERR_INTERNAL, "cuda infer_weights: n is 0");
  return NMT_OK;
}

/* *buf (capacity *cap bytes, used by kernels on stream `owner` only) replaced by exactly
 * `bytes` when it holds less: waits for `owner` first (the old buffer may still be read). */
static nmt_status realloc_buf(nmt_cuda_ctx *c, cudaStream_t owner, void **buf, size_t *cap,
                              size_t bytes, const char *what) {
  if (bytes <= *cap) return NMT_OK;
  NMT_TRY(nmt__cuda_wait(c, owner, what));
  NMT_CUDA_TRY(cudaFree(*buf));
  *buf = NULL;
  *cap = 0;
  NMT_CUDA_TRY(cudaMalloc(buf, bytes));
  *cap = bytes;
  return NMT_OK;
}

/* An op's scratch of at least `bytes`. reserve_scratch sized it for every call within the
 * plan; a call beyond it grows the buffer here, by a quarter more (shapes vary batch to
 * batch): correct, but it allocates inside a step (the stream drains and cudaMalloc/cudaFree
 * can deadlock against an NCCL kernel), so it is counted and, after a reserve, logged. */
static nmt_status grow(nmt_cuda_ctx *c, cudaStream_t owner, void **buf, size_t *cap,
                       size_t bytes, const char *what) {
  if (bytes <= *cap) return NMT_OK;
  const size_t want = bytes + bytes / 4;
  if (want < bytes)
    return nmt_errorf(NMT_ERR_NOMEM, "cuda: scratch of %zu bytes is too large", bytes);
  c->counters.scratch_growths++;
  if (c->planned)
    nmt_log(NMT_LOG_WARN,
            "cuda: %s grew from %zu to %zu bytes inside a step on device %d (the scratch plan "
            "did not cover this call: nmt_model_scratch_plan)",
            what, *cap, want, c->device);
  return realloc_buf(c, owner, buf, cap, want, "scratch growth");
}

nmt_status nmt__cuda_scratch(nmt_cuda_ctx *c, size_t bytes, void **out) {
  if (c->cur) {
    nmt__cuda_lane *l = &c->aux[c->cur - 1];
    NMT_TRY(grow(c, l->stream, &l->scratch, &l->scratch_bytes, bytes, "aux stream op scratch"));
    *out = l->scratch;
  } else {
    NMT_TRY(grow(c, c->stream, &c->scratch, &c->scratch_bytes, bytes, "op scratch"));
    *out = c->scratch;
  }
  return NMT_OK;
}

nmt_status nmt__cuda_gemm16_scratch(nmt_cuda_ctx *c, size_t bytes, void **out) {
  if (c->cur) {
    nmt__cuda_lane *l = &c->aux[c->cur - 1];
    NMT_TRY(grow(c, l->stream, &l->gemm16, &l->gemm16_bytes, bytes,
                 "aux stream 16-bit GEMM copies"));
    *out = l->gemm16;
  } else {
    NMT_TRY(grow(c, c->stream, &c->gemm16, &c->gemm16_bytes, bytes, "16-bit GEMM copies"));
    *out = c->gemm16;
  }
  return NMT_OK;
}

static __global__ void fill_ones(float *x, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] = 1.0f;
}
NMT_CUDA_PRELOAD(fill_ones);

/* c->ones replaced by `len` ones. Every stream may read the old vector, and may read the new
 * one as soon as this returns (no event orders another stream after the fill): drain them
 * all, fill, wait for the fill. */
static nmt_status ones_resize(nmt_cuda_ctx *c, size_t len) {
  NMT_TRY(wait_all(c, "ones growth"));
  NMT_CUDA_TRY(cudaFree(c->ones));
  c->ones = NULL;
  c->ones_len = 0;
  NMT_CUDA_TRY(cudaMalloc((void **)&c->ones, len * sizeof(float)));
  cudaStream_t s = nmt__cuda_stream(c);
  fill_ones<<<nmt__grid(len, 256), 256, 0, s>>>(c->ones, len);
  NMT_CUDA_LAUNCH_CHECK("fill_ones");
  NMT_TRY(nmt__cuda_wait(c, s, "ones growth"));
  c->ones_len = len;
  return NMT_OK;
}

nmt_status nmt__cuda_ones(nmt_cuda_ctx *c, size_t n, const float **out) {
  if (n > c->ones_len) {
    /* Beyond the plan (reserve_scratch sized it for gemm_rows): counted as a growth. */
    c->counters.scratch_growths++;
    if (c->planned)
      nmt_log(NMT_LOG_WARN,
              "cuda: the ones vector grew from %zu to %zu inside a step on device %d (the "
              "scratch plan did not cover this call: nmt_model_scratch_plan)",
              c->ones_len, n, c->device);
    NMT_TRY(ones_resize(c, n < 4096 ? 4096 : n + n / 4));
  }
  *out = c->ones;
  return NMT_OK;
}

/* Bytes of op scratch and of 16-bit GEMM copies for every call within need: the largest of
 * the ops' own requests at the bounds (common.cuh: the same functions the ops ask with). */
static nmt_status need_bytes(nmt_cuda_ctx *c, const nmt_scratch_need *n, size_t *op,
                             size_t *g16) {
  size_t emb = 0, b = nmt__cuda_sum_scratch();
  NMT_TRY(nmt__cuda_embedding_scratch(c, n->emb_rows, n->width, &emb));
  const size_t att = n->att_q || n->att_kv || n->att_scores
                         ? nmt__cuda_attention_scratch(n->att_q, n->att_kv, n->att_scores)
                         : 0;
  size_t ln = n->width ? nmt__cuda_layernorm_scratch(n->width) : 0;
  /* The half-storage LayerNorm backwards' per-block partials (cuda/half_scratch.cuh). */
  if (n->half_acts && n->width) {
    const size_t lnh = nmt__cuda_ln_half_scratch(n->width);
    ln = ln > lnh ? ln : lnh;
  }
  /* linear_half_bwd's bias gradient: M <= gemm_rows, N <= the plan's widest output row
   * (nmt/cuda.h reserve_scratch). */
  const size_t lh = n->half_acts && n->gemm_rows
                        ? nmt__cuda_linear_half_scratch(
                              n->gemm_rows, (n->gemm_out + n->gemm_rows - 1) / n->gemm_rows)
                        : 0;
  b = b > att ? b : att;
  b = b > emb ? b : emb;
  b = b > lh ? b : lh;
  *op = b > ln ? b : ln;
  const int half = c->precision == NMT_PRECISION_FP16 || c->precision == NMT_PRECISION_BF16;
  *g16 = half && n->gemm_rows ? nmt__cuda_gemm16_bytes(n->gemm_inp, n->gemm_w, n->gemm_out) : 0;
  return NMT_OK;
}

/* Sizes aux lane l from the kept plan's aux need. */
static nmt_status reserve_lane(nmt_cuda_ctx *c, nmt__cuda_lane *l) {
  size_t op = 0, g16 = 0;
  NMT_TRY(need_bytes(c, &c->plan.aux, &op, &g16));
  NMT_TRY(realloc_buf(c, l->stream, &l->scratch, &l->scratch_bytes, op, "reserve_scratch"));
  NMT_TRY(realloc_buf(c, l->stream, &l->gemm16, &l->gemm16_bytes, g16, "reserve_scratch"));
  return NMT_OK;
}

/* Every buffer from the kept plan (c->plan), for the current precision. */
static nmt_status reserve_all(nmt_cuda_ctx *c) {
  size_t op = 0, g16 = 0;
  NMT_TRY(need_bytes(c, &c->plan.main, &op, &g16));
  NMT_TRY(realloc_buf(c, c->stream, &c->scratch, &c->scratch_bytes, op, "reserve_scratch"));
  NMT_TRY(realloc_buf(c, c->stream, &c->gemm16, &c->gemm16_bytes, g16, "reserve_scratch"));
  for (int i = 0; i < c->n_aux; i++) NMT_TRY(reserve_lane(c, &c->aux[i]));
  const size_t rows = c->plan.main.gemm_rows > c->plan.aux.gemm_rows ? c->plan.main.gemm_rows
                                                                     : c->plan.aux.gemm_rows;
  if (rows > c->ones_len) NMT_TRY(ones_resize(c, rows));
  return NMT_OK;
}

nmt_status nmt_cuda_reserve_scratch(void *ctx, const nmt_scratch_plan *plan) {
  NMT_TRY(nmt__cuda_enter(ctx, "reserve_scratch"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (!plan) return nmt_errorf(NMT_ERR_INTERNAL, "cuda reserve_scratch: NULL plan");
  if (c->forked)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda reserve_scratch: called between stream_fork and stream_join (reserve "
                      "on an idle context)");
  nmt_scratch_plan_max(&c->plan, plan); /* the context starts zeroed */
  c->planned = 1;
  nmt_status s = reserve_all(c);
  if (s == NMT_OK)
    nmt_log(NMT_LOG_DEBUG,
            "cuda: device %d scratch reserved: op %zu B, 16-bit copies %zu B, ones %zu, per aux "
            "stream op %zu B, 16-bit %zu B",
            c->device, c->scratch_bytes, c->gemm16_bytes, c->ones_len,
            c->n_aux ? c->aux[0].scratch_bytes : 0, c->n_aux ? c->aux[0].gemm16_bytes : 0);
  return s;
}

/* The calling thread's launches (common.cuh): thread_local, zero at the thread's start. */
static thread_local uint64_t thread_launches = 0;

void nmt__cuda_launched(unsigned n) { thread_launches += n; }

uint64_t nmt__cuda_launch_count(void) { return thread_launches; }

nmt_status nmt_cuda_counters(void *ctx, nmt_backend_counters *out) {
  memset(out, 0, sizeof *out);
  if (!ctx)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda counters: NULL context (create one with "
                                        "ctx_create)");
  *out = nmt__cuda_ctx(ctx)->counters;
  /* Per host thread (nmt/cuda.h): the caller's own launches, on whatever context. */
  out->launches = thread_launches;
  return NMT_OK;
}

nmt_status nmt_cuda_ctx_set_epilogues(void *ctx, int on) {
  if (!ctx)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda ctx_set_epilogues: NULL context (create one with "
                                        "ctx_create)");
  nmt__cuda_ctx(ctx)->epilogues_off = !on;
  return NMT_OK;
}

nmt_status nmt_cuda_ctx_set_attention_fused_impl(void *ctx, int mma) {
  if (!ctx)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda ctx_set_attention_fused_impl: NULL context "
                                        "(create one with ctx_create)");
  if (mma != 0 && mma != 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda ctx_set_attention_fused_impl: mma = %d (0 or 1)",
                      mma);
  nmt__cuda_ctx(ctx)->attn_fused_simt = !mma;
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

/* ------------------------------------------------------------------------------------------ */
/* The aux stream pool (nmt/backend.h: stream_pool, stream_fork, stream_use, stream_join). */

static nmt_status lane_init(nmt__cuda_lane *l, int index) {
  NMT_CUDA_TRY(cudaStreamCreateWithFlags(&l->stream, cudaStreamNonBlocking));
  NMT_CUDA_TRY(cudaEventCreateWithFlags(&l->ev_join, cudaEventDisableTiming));
  /* Its own workspace: two GEMMs running at once must not share cuBLASLt's scratch. */
  NMT_CUDA_TRY(cudaMalloc(&l->workspace, NMT_CUDA_WORKSPACE_BYTES));
  char name[16];
  snprintf(name, sizeof name, "aux%d", index);
  name_stream(l->stream, name);
  return NMT_OK;
}

nmt_status nmt_cuda_stream_pool(void *ctx, int n) {
  NMT_TRY(nmt__cuda_enter(ctx, "stream_pool"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (n < 0 || n > NMT_CUDA_MAX_AUX)
    return nmt_errorf(NMT_ERR_CONFIG, "cuda stream_pool: %d aux streams, want 0..%d", n,
                      NMT_CUDA_MAX_AUX);
  if (c->forked)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda stream_pool: called between stream_fork and stream_join (the pool "
                      "must be set on an idle context)");
  if (n == c->n_aux) return NMT_OK;
  /* A different size rebuilds the pool; lane_free waits for each old stream. */
  while (c->n_aux > 0) lane_free(&c->aux[--c->n_aux]);
  for (int i = 0; i < n; i++) {
    nmt_status s = lane_init(&c->aux[i], i + 1);
    /* A pool made after reserve_scratch gets its scratch from the kept plan at once. */
    if (s == NMT_OK && c->planned) s = reserve_lane(c, &c->aux[i]);
    if (s != NMT_OK) {
      lane_free(&c->aux[i]);
      return s;
    }
    c->n_aux = i + 1;
  }
  return NMT_OK;
}

nmt_status nmt_cuda_stream_fork(void *ctx) {
  NMT_TRY(nmt__cuda_enter(ctx, "stream_fork"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (c->forked)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda stream_fork: already forked (every fork needs its stream_join "
                      "first)");
  NMT_CUDA_TRY(cudaEventRecord(c->ev_fork, c->stream));
  for (int i = 0; i < c->n_aux; i++)
    NMT_CUDA_TRY(cudaStreamWaitEvent(c->aux[i].stream, c->ev_fork, 0));
  c->forked = 1;
  c->cur = 0;
  return NMT_OK;
}

nmt_status nmt_cuda_stream_use(void *ctx, int i) {
  NMT_TRY(nmt__cuda_enter(ctx, "stream_use"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (i < 0 || i > c->n_aux)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda stream_use: stream %d outside [0, %d] (0 = main, 1..n = aux)", i,
                      c->n_aux);
  if (!c->forked)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda stream_use(%d): no stream_fork before it (aux streams have not "
                      "waited for the main stream's work)",
                      i);
  c->cur = i;
  return NMT_OK;
}

nmt_status nmt_cuda_stream_join(void *ctx) {
  NMT_TRY(nmt__cuda_enter(ctx, "stream_join"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (!c->forked) return nmt_errorf(NMT_ERR_INTERNAL, "cuda stream_join: no stream_fork to join");
  /* Back to main first: whatever fails below, later ops go to the compute stream. */
  c->cur = 0;
  c->forked = 0;
  for (int i = 0; i < c->n_aux; i++) {
    NMT_CUDA_TRY(cudaEventRecord(c->aux[i].ev_join, c->aux[i].stream));
    NMT_CUDA_TRY(cudaStreamWaitEvent(c->stream, c->aux[i].ev_join, 0));
  }
  return NMT_OK;
}
