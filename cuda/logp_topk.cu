/* cuda/logp_topk.cu — decoding's per-step selection: the k most likely outputs of each row of
 * logits and their log-probabilities, as src/ref/logp_topk.c (contract: nmt/backend.h).
 *
 * One block per row. The row's log-sum-exp: a block max, then a block sum of fp32
 * exponentials accumulated per thread in fp32 and across threads in double. The top k: k
 * block-wide arg-maxes, pass j taking the best id ranked strictly after pass j-1's winner in
 * the total order (key descending, id ascending), so no id is marked or written back and
 * every pass reads the row once. O(k V) per row: beam search asks k = beam or 2 x beam; a
 * large k (hundreds) would want a radix select instead. Greedy decoding runs k = 1 without
 * the log-sum-exp: one pass, the cost of the argmax op. */
#include <climits>

#include "common.cuh"
#include "nmt/types.h"

enum { TOPK_THREADS = 256 };

__device__ __forceinline__ float topk_key(float v) { return v == v ? v : -INFINITY; }

/* (ka, ia) ranks before (kb, ib): larger key, or the same key and a lower id. */
__device__ __forceinline__ bool ranks_before(float ka, int ia, float kb, int ib) {
  return ka > kb || (ka == kb && ia < ib);
}

/* The block's best (key, id) pair; every thread gets it. sk/si: __shared__ [32]. */
__device__ void block_best(float &bk, int &bi, float *sk, int *si) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ok = __shfl_down_sync(0xffffffffu, bk, o);
    const int oi = __shfl_down_sync(0xffffffffu, bi, o);
    if (ranks_before(ok, oi, bk, bi)) bk = ok, bi = oi;
  }
  __syncthreads(); /* sk/si may still be read by the previous call */
  if (lane == 0) sk[wid] = bk, si[wid] = bi;
  __syncthreads();
  if (wid == 0) {
    float k = lane < nw ? sk[lane] : -INFINITY;
    int i = lane < nw ? si[lane] : INT_MAX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ok = __shfl_down_sync(0xffffffffu, k, o);
      const int oi = __shfl_down_sync(0xffffffffu, i, o);
      if (ranks_before(ok, oi, k, i)) k = ok, i = oi;
    }
    if (lane == 0) sk[0] = k, si[0] = i;
  }
  __syncthreads();
  bk = sk[0];
  bi = si[0];
}

/* The row's log sum_v exp(key(x_v)) (every thread gets it): a block max, then fp32
 * exponentials summed per thread and across threads in double; -inf for a row of -inf
 * keys only, NaN with a +inf. logp_topk and logp_at share it, so their bits agree. */
static __device__ double row_lse(const float *row, int V, float *shf, double *shd) {
  float m = -INFINITY;
  for (int v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, topk_key(row[v]));
  m = nmt__block_max(m, shf);
  if (m == -INFINITY) return -INFINITY;
  if (m == INFINITY) return NAN;
  double s = 0.0;
  for (int v = threadIdx.x; v < V; v += blockDim.x) s += (double)expf(topk_key(row[v]) - m);
  return (double)m + log(nmt__block_sum(s, shd));
}

static __global__ void __launch_bounds__(TOPK_THREADS)
    logp_topk_kernel(int32_t *ids, float *logp, const float *x, int V, int k) {
  __shared__ float shf[32], sk[32];
  __shared__ double shd[32];
  __shared__ int si[32];
  const size_t r = blockIdx.x;
  const float *row = x + r * (size_t)V;
  const double lse = logp ? row_lse(row, V, shf, shd) : 0.0;
  float pk = INFINITY; /* the previous winner; pass 0 has none */
  int pi = -1;
  for (int j = 0; j < k; j++) {
    float bk = -INFINITY;
    int bi = INT_MAX; /* loses to every real id, -inf keys included */
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
      if (v == NMT_PAD_ID || v == NMT_BOS_ID) continue;
      const float kv = topk_key(row[v]);
      if (j > 0 && !ranks_before(pk, pi, kv, v)) continue;
      if (ranks_before(kv, v, bk, bi)) bk = kv, bi = v;
    }
    block_best(bk, bi, sk, si);
    if (threadIdx.x == 0) {
      const bool found = bi != INT_MAX;
      ids[r * k + j] = found ? bi : -1;
      if (logp)
        logp[r * k + j] = !found || lse == -INFINITY ? -INFINITY : (float)((double)bk - lse);
    }
    pk = bk, pi = bi;
  }
}
NMT_CUDA_PRELOAD(logp_topk_kernel);

nmt_status nmt_cuda_logp_topk(void *ctx, int32_t *ids, float *logp, const float *x, int R, int V,
                              int k) {
  NMT_TRY(nmt__cuda_enter(ctx, "logp_topk"));
  if (R < 0 || V < 1 || k < 1 || k > NMT_TOPK_MAX || (R > 0 && (!ids || !x)))
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda logp_topk: bad arguments R=%d V=%d k=%d (k in "
                      "[1, %d])", R, V, k, NMT_TOPK_MAX);
  if (R == 0) return NMT_OK;
  logp_topk_kernel<<<(unsigned)R, TOPK_THREADS, 0, nmt__cuda_stream(nmt__cuda_ctx(ctx))>>>(
      ids, logp, x, V, k);
  NMT_CUDA_LAUNCH_CHECK("logp_topk_kernel");
  return NMT_OK;
}

/* logp_at: one block per row; thread j < k reads id j once the row's lse is known. */
static __global__ void __launch_bounds__(TOPK_THREADS)
    logp_at_kernel(float *logp, const int32_t *ids, const float *x, int V, int k) {
  __shared__ float shf[32];
  __shared__ double shd[32];
  const size_t r = blockIdx.x;
  const float *row = x + r * (size_t)V;
  const double lse = row_lse(row, V, shf, shd);
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const int32_t id = ids[r * k + j];
    logp[r * k + j] =
        id < 0 || lse == -INFINITY ? -INFINITY : (float)((double)topk_key(row[id]) - lse);
  }
}
NMT_CUDA_PRELOAD(logp_at_kernel);

nmt_status nmt_cuda_logp_at(void *ctx, float *logp, const int32_t *ids, const float *x, int R,
                            int V, int k) {
  NMT_TRY(nmt__cuda_enter(ctx, "logp_at"));
  if (R < 0 || V < 1 || k < 1 || k > NMT_TOPK_MAX || (R > 0 && (!ids || !x || !logp)))
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda logp_at: bad arguments R=%d V=%d k=%d (k in "
                      "[1, %d])", R, V, k, NMT_TOPK_MAX);
  if (R == 0) return NMT_OK;
  logp_at_kernel<<<(unsigned)R, TOPK_THREADS, 0, nmt__cuda_stream(nmt__cuda_ctx(ctx))>>>(
      logp, ids, x, V, k);
  NMT_CUDA_LAUNCH_CHECK("logp_at_kernel");
  return NMT_OK;
}
