/* cuda/reductions.cu — the CUDA backend's small vector ops and reductions: add, axpy, sum_acc,
 * sumsq, count_targets and argmax, as src/ref/reductions.c.
 *
 * Sums (sum_acc, sumsq) are deterministic: a fixed grid (a function of n only) forms per-block
 * partial sums in double in a fixed order, then one block adds the partials in order. */
#include "common.cuh"
#include "nmt/config.h"

static __global__ void add_kernel(float *out, const float *a, const float *b, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = a[i] + b[i];
}
NMT_CUDA_PRELOAD(add_kernel);

static __global__ void axpy_kernel(float *y, const float *x, float alpha, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    y[i] += alpha * x[i];
}
NMT_CUDA_PRELOAD(axpy_kernel);

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
NMT_CUDA_PRELOAD(sum_partial);

/* *dst = (accumulate ? *dst : 0) + sum of the partials, rounded to float once. */
static __global__ void __launch_bounds__(SUM_THREADS)
    sum_final(float *dst, const double *partial, int n_partial, int accumulate) {
  __shared__ double sh[32];
  double s = 0.0;
  for (int i = threadIdx.x; i < n_partial; i += blockDim.x) s += partial[i];
  s = nmt__block_sum(s, sh);
  if (threadIdx.x == 0) *dst = (float)((accumulate ? (double)*dst : 0.0) + s);
}
NMT_CUDA_PRELOAD(sum_final);

size_t nmt__cuda_sum_scratch(void) { return SUM_MAX_BLOCKS * sizeof(double); }

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

enum { COUNT_THREADS = 1024 };

/* One block: *dst += (float)(number of targets != NMT_PAD_ID). An integer count is exact in
 * any order; one block keeps the final add a single ordered write. A micro-batch has some 10^4
 * targets, so one block is plenty. */
static __global__ void __launch_bounds__(COUNT_THREADS)
    count_kernel(float *dst, const int32_t *targets, size_t n) {
  __shared__ long long sh[32];
  long long k = 0;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) k += targets[i] != NMT_PAD_ID;
  k = nmt__block_sum(k, sh);
  if (threadIdx.x == 0) *dst += (float)k;
}
NMT_CUDA_PRELOAD(count_kernel);

nmt_status nmt_cuda_count_targets(void *ctx, float *dst, const int32_t *targets, size_t n) {
  NMT_TRY(nmt__cuda_enter(ctx, "count_targets"));
  count_kernel<<<1, COUNT_THREADS, 0, nmt__cuda_stream(nmt__cuda_ctx(ctx))>>>(dst, targets, n);
  NMT_CUDA_LAUNCH_CHECK("count_kernel");
  return NMT_OK;
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
NMT_CUDA_PRELOAD(argmax_kernel);

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
