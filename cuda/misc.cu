/* cuda/misc.cu — memory ops (device memory, the compute stream), batch staging (pinned host
 * memory, the copy stream and the two slots' events), asynchronous reads back (d2h_async /
 * d2h_wait) and the small vector ops of the CUDA backend, as src/ref/misc.c.
 *
 * Sums (sum_acc, sumsq) are deterministic: a fixed grid (a function of n only) forms per-block
 * partial sums in double in a fixed order, then one block adds the partials in order. */
#include <float.h>

#include "common.cuh"

nmt_status nmt_cuda_malloc(void *ctx, size_t bytes, void **out) {
  NMT_TRY(nmt__cuda_enter(ctx, "malloc"));
  *out = NULL;
  /* 0 bytes still gives a distinct pointer, as on the reference backend. */
  cudaError_t e = cudaMalloc(out, bytes ? bytes : 256);
  if (e != cudaSuccess) {
    size_t free_b = 0, total_b = 0;
    (void)cudaGetLastError();
    (void)cudaMemGetInfo(&free_b, &total_b);
    return nmt_errorf(e == cudaErrorMemoryAllocation ? NMT_ERR_NOMEM : NMT_ERR_DEVICE,
                      "cuda: cannot allocate %zu bytes of device memory on device %d: %s "
                      "(%.1f of %.1f GiB free)",
                      bytes, nmt__cuda_ctx(ctx)->device, cudaGetErrorString(e),
                      (double)free_b / 1073741824.0, (double)total_b / 1073741824.0);
  }
  return NMT_OK;
}

void nmt_cuda_free(void *ctx, void *p) {
  /* cudaFree waits for the device; a failure here has nowhere to go but the log. */
  if (p) {
    if (ctx) cudaSetDevice(nmt__cuda_ctx(ctx)->device);
    cudaError_t e = cudaFree(p);
    if (e != cudaSuccess) nmt__cuda_error(e, "cudaFree", __FILE__, __LINE__);
  }
}

nmt_status nmt_cuda_memset_zero(void *ctx, void *p, size_t bytes) {
  NMT_TRY(nmt__cuda_enter(ctx, "memset_zero"));
  NMT_TRY(nmt__cuda_main_only(nmt__cuda_ctx(ctx), "memset_zero"));
  if (bytes) NMT_CUDA_TRY(cudaMemsetAsync(p, 0, bytes, nmt__cuda_ctx(ctx)->stream));
  return NMT_OK;
}

nmt_status nmt_cuda_copy_h2d(void *ctx, void *dst, const void *src, size_t bytes) {
  NMT_TRY(nmt__cuda_enter(ctx, "copy_h2d"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(nmt__cuda_main_only(c, "copy_h2d"));
  if (!bytes) return NMT_OK;
  /* Waiting makes `src` reusable on return whether it is pageable or pinned (callers pass
   * stack variables). */
  NMT_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream));
  return nmt__cuda_wait(c, c->stream, "copy_h2d");
}

nmt_status nmt_cuda_copy_d2h(void *ctx, void *dst, const void *src, size_t bytes) {
  NMT_TRY(nmt__cuda_enter(ctx, "copy_d2h"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(nmt__cuda_main_only(c, "copy_d2h"));
  if (bytes) NMT_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
  return nmt__cuda_check_errors(c); /* waits for the stream (polling, see nmt__cuda_wait) */
}

nmt_status nmt_cuda_synchronize(void *ctx) {
  NMT_TRY(nmt__cuda_enter(ctx, "synchronize"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(nmt__cuda_main_only(c, "synchronize"));
  /* "Every op issued so far" includes a staging copy nothing has acquired yet. The pool's
   * streams are idle or joined into the compute stream (no fork is open). */
  NMT_TRY(nmt__cuda_wait(c, c->copy_stream, "synchronize"));
  return nmt__cuda_check_errors(c);
}

/* ------------------------------------------------------------------------------------------ */
/* Batch staging: two slots, each a (copy, compute) hand-off ordered by two events.
 *
 *   copy   : wait freed[s] -> H2D(s) -> record ready[s]
 *   compute:                            wait ready[s] (acquire) -> ops reading dst -> record
 *            freed[s] (release)
 *
 * so the copy of micro-batch k+1 (slot 1) runs while compute works on k (slot 0), and the
 * copy of k+2 into slot 0 cannot overwrite what k still reads. */

static nmt_status check_slot(const char *op, int slot) {
  if (slot != 0 && slot != 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: staging slot %d is not 0 or 1", op, slot);
  return NMT_OK;
}

nmt_status nmt_cuda_host_alloc(void *ctx, size_t bytes, void **out) {
  NMT_TRY(nmt__cuda_enter(ctx, "host_alloc"));
  *out = NULL;
  /* Page-locked: the copy engine reads it directly, so cudaMemcpyAsync is truly asynchronous
   * (from pageable memory the driver stages through its own buffer, in the host's time). */
  cudaError_t e = cudaHostAlloc(out, bytes ? bytes : 1, cudaHostAllocDefault);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    *out = NULL;
    return nmt_errorf(NMT_ERR_NOMEM, "cuda: cannot allocate %zu bytes of pinned host memory: %s",
                      bytes, cudaGetErrorString(e));
  }
  return NMT_OK;
}

void nmt_cuda_host_free(void *ctx, void *p) {
  if (!p) return;
  if (ctx) cudaSetDevice(nmt__cuda_ctx(ctx)->device);
  cudaError_t e = cudaFreeHost(p);
  if (e != cudaSuccess) nmt__cuda_error(e, "cudaFreeHost", __FILE__, __LINE__);
}

nmt_status nmt_cuda_h2d_async(void *ctx, int slot, void *dst, const void *src, size_t bytes) {
  NMT_TRY(nmt__cuda_enter(ctx, "h2d_async"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_slot("h2d_async", slot));
  NMT_TRY(nmt__cuda_main_only(c, "h2d_async"));
  NMT_CUDA_TRY(cudaStreamWaitEvent(c->copy_stream, c->ev_freed[slot], 0));
  if (bytes)
    NMT_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->copy_stream));
  NMT_CUDA_TRY(cudaEventRecord(c->ev_ready[slot], c->copy_stream));
  return NMT_OK;
}

nmt_status nmt_cuda_h2d_acquire(void *ctx, int slot) {
  NMT_TRY(nmt__cuda_enter(ctx, "h2d_acquire"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_slot("h2d_acquire", slot));
  NMT_TRY(nmt__cuda_main_only(c, "h2d_acquire"));
  NMT_CUDA_TRY(cudaStreamWaitEvent(c->stream, c->ev_ready[slot], 0));
  return NMT_OK;
}

nmt_status nmt_cuda_h2d_release(void *ctx, int slot) {
  NMT_TRY(nmt__cuda_enter(ctx, "h2d_release"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_slot("h2d_release", slot));
  NMT_TRY(nmt__cuda_main_only(c, "h2d_release"));
  NMT_CUDA_TRY(cudaEventRecord(c->ev_freed[slot], c->stream));
  return NMT_OK;
}

nmt_status nmt_cuda_h2d_wait_src(void *ctx, int slot) {
  NMT_TRY(nmt__cuda_enter(ctx, "h2d_wait_src"));
  NMT_TRY(check_slot("h2d_wait_src", slot));
  /* ready[slot] follows the copy, which has then read all of src. */
  return nmt__cuda_wait_event(nmt__cuda_ctx(ctx), nmt__cuda_ctx(ctx)->ev_ready[slot],
                              "h2d_wait_src");
}

/* ------------------------------------------------------------------------------------------ */
/* Asynchronous reads back (docs/cuda.md "Step control"): the trainer copies step s's control
 * block into pinned memory behind step s's optimizer and reads it while step s+1 runs.
 *
 *   compute: ... step_control, adamw ─► D2H(host ◄ dev) ─► D2H(d2h_err[s] ◄ error word) ─►
 *            record ev_d2h[s]
 *   host   : d2h_wait(s) polls ev_d2h[s], then reads d2h_err[s]
 *
 * The error word travels with the data, so the fast path (no error) costs one event query and
 * no second wait; only an error takes the slow path through nmt__cuda_check_errors, which
 * writes the message and clears the word. */

static nmt_status check_d2h_slot(const char *op, int slot) {
  if (slot < 0 || slot >= NMT_D2H_SLOTS)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: read-back slot %d outside [0, %d)", op, slot,
                      (int)NMT_D2H_SLOTS);
  return NMT_OK;
}

nmt_status nmt_cuda_d2h_async(void *ctx, int slot, void *host, const void *dev, size_t bytes) {
  NMT_TRY(nmt__cuda_enter(ctx, "d2h_async"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_d2h_slot("d2h_async", slot));
  NMT_TRY(nmt__cuda_main_only(c, "d2h_async"));
  if (bytes) NMT_CUDA_TRY(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, c->stream));
  NMT_CUDA_TRY(cudaMemcpyAsync(&c->d2h_err[slot], c->d_err, sizeof(int), cudaMemcpyDeviceToHost,
                               c->stream));
  NMT_CUDA_TRY(cudaEventRecord(c->ev_d2h[slot], c->stream));
  return NMT_OK;
}

nmt_status nmt_cuda_d2h_wait(void *ctx, int slot) {
  NMT_TRY(nmt__cuda_enter(ctx, "d2h_wait"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_d2h_slot("d2h_wait", slot));
  NMT_TRY(nmt__cuda_main_only(c, "d2h_wait"));
  NMT_TRY(nmt__cuda_wait_event(c, c->ev_d2h[slot], "d2h_wait"));
  if (!c->d2h_err[slot]) return NMT_OK;
  /* The slot's copy has landed, so nothing writes d2h_err[slot] until the next d2h_async. The
   * word may have been reported and cleared since (by a synchronize): then this is OK too. */
  c->d2h_err[slot] = 0;
  return nmt__cuda_check_errors(c);
}

/* ------------------------------------------------------------------------------------------ */

static __global__ void add_kernel(float *out, const float *a, const float *b, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = a[i] + b[i];
}

static __global__ void axpy_kernel(float *y, const float *x, float alpha, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    y[i] += alpha * x[i];
}

nmt_status nmt_cuda_add(void *ctx, float *out, const float *a, const float *b, size_t n) {
  NMT_TRY(nmt__cuda_enter(ctx, "add"));
  if (n == 0) return NMT_OK;
  add_kernel<<<nmt__grid(n, 256), 256, 0, nmt__cuda_stream(nmt__cuda_ctx(ctx))>>>(out, a, b, n);
  NMT_CUDA_LAUNCH_CHECK("add_kernel");
  return NMT_OK;
}

nmt_status nmt_cuda_axpy(void *ctx, float *y, const float *x, float alpha, size_t n) {
  NMT_TRY(nmt__cuda_enter(ctx, "axpy"));
  if (n == 0) return NMT_OK;
  axpy_kernel<<<nmt__grid(n, 256), 256, 0, nmt__cuda_stream(nmt__cuda_ctx(ctx))>>>(y, x, alpha, n);
  NMT_CUDA_LAUNCH_CHECK("axpy_kernel");
  return NMT_OK;
}

enum { SUM_THREADS = 256, SUM_MAX_BLOCKS = 1024 };

/* partial[blockIdx.x] = sum (or sum of squares) of this block's grid-stride share, in double. */
static __global__ void __launch_bounds__(SUM_THREADS)
    sum_partial(double *partial, const float *x, size_t n, int square) {
  __shared__ double sh[32];
  double s = 0.0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const double v = x[i];
    s += square ? v * v : v;
  }
  s = nmt__block_sum(s, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

/* *dst = (accumulate ? *dst : 0) + sum of the partials, rounded to float once. */
static __global__ void __launch_bounds__(SUM_THREADS)
    sum_final(float *dst, const double *partial, int n_partial, int accumulate) {
  __shared__ double sh[32];
  double s = 0.0;
  for (int i = threadIdx.x; i < n_partial; i += blockDim.x) s += partial[i];
  s = nmt__block_sum(s, sh);
  if (threadIdx.x == 0) *dst = (float)((accumulate ? (double)*dst : 0.0) + s);
}

nmt_status nmt__cuda_sum(nmt_cuda_ctx *c, float *dst, const float *x, size_t n, int square,
                         int accumulate) {
  size_t blocks = (n + SUM_THREADS - 1) / SUM_THREADS;
  if (blocks > SUM_MAX_BLOCKS) blocks = SUM_MAX_BLOCKS;
  double *partial = NULL;
  if (blocks > 0) {
    NMT_TRY(nmt__cuda_scratch(c, blocks * sizeof(double), (void **)&partial));
    sum_partial<<<(unsigned)blocks, SUM_THREADS, 0, nmt__cuda_stream(c)>>>(partial, x, n, square);
    NMT_CUDA_LAUNCH_CHECK("sum_partial");
  }
  sum_final<<<1, SUM_THREADS, 0, nmt__cuda_stream(c)>>>(dst, partial, (int)blocks, accumulate);
  NMT_CUDA_LAUNCH_CHECK("sum_final");
  return NMT_OK;
}

nmt_status nmt_cuda_sum_acc(void *ctx, float *dst, const float *x, size_t n) {
  NMT_TRY(nmt__cuda_enter(ctx, "sum_acc"));
  return nmt__cuda_sum(nmt__cuda_ctx(ctx), dst, x, n, 0, 1);
}

nmt_status nmt_cuda_sumsq(void *ctx, float *dst, const float *x, size_t n) {
  NMT_TRY(nmt__cuda_enter(ctx, "sumsq"));
  return nmt__cuda_sum(nmt__cuda_ctx(ctx), dst, x, n, 1, 0);
}

/* ------------------------------------------------------------------------------------------ */
/* argmax: the reference's "first index of the largest non-NaN value; 0 if all are NaN" as a
 * strict total order, so the block reduction's result does not depend on its order. */

enum { ARGMAX_THREADS = 256 };

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  const bool vn = v != v, bn = bv != bv;
  if (vn != bn) return bn;            /* a number beats NaN */
  if (vn) return i < bi;              /* both NaN: the first */
  return v > bv || (v == bv && i < bi);
}

static __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_kernel(int32_t *out, const float *x, int M, int V) {
  __shared__ float sv[ARGMAX_THREADS];
  __shared__ int si[ARGMAX_THREADS];
  const int r = blockIdx.x;
  if (r >= M) return;
  const float *row = x + (size_t)r * V;
  float bv = __int_as_float(0x7fc00000); /* NaN with index INT_MAX: loses to any element */
  int bi = 0x7fffffff;
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    const float v = row[j];
    if (better(v, j, bv, bi)) bv = v, bi = j;
  }
  sv[threadIdx.x] = bv;
  si[threadIdx.x] = bi;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s && better(sv[threadIdx.x + s], si[threadIdx.x + s], sv[threadIdx.x],
                                  si[threadIdx.x])) {
      sv[threadIdx.x] = sv[threadIdx.x + s];
      si[threadIdx.x] = si[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[r] = si[0];
}

nmt_status nmt_cuda_argmax(void *ctx, int32_t *out, const float *x, int M, int V) {
  NMT_TRY(nmt__cuda_enter(ctx, "argmax"));
  if (M < 0 || V < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda argmax: bad shape M=%d V=%d", M, V);
  if (M == 0) return NMT_OK;
  argmax_kernel<<<(unsigned)M, ARGMAX_THREADS, 0, nmt__cuda_stream(nmt__cuda_ctx(ctx))>>>(
      out, x, M, V);
  NMT_CUDA_LAUNCH_CHECK("argmax_kernel");
  return NMT_OK;
}
