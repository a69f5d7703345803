/* cuda/residual.cu — the sublayer connection LN(x + Dropout(y)) fused (Vaswani et al. 2017
 * §3.1, §5.4 "residual dropout"; Ba et al. 2016), as src/ref/residual.c.
 *
 * One block per row. A thread owns whole 4-element Philox blocks of the row (element index
 * e = r*C + c, the indexing of cuda/dropout.cu), so each Philox block is drawn once, and it
 * keeps that ownership in every pass over the row: a pass re-reads only what the same thread
 * wrote (sum in the forward), and no pass needs a barrier besides the reductions'.
 *
 * Forward: sum = x + dropout(y) with dropout.cu's roundings (__fmul_rn, then __fadd_rn: no
 * fused multiply-add), so sum and its mask are bitwise the reference's; then the LayerNorm of
 * the row as cuda/layernorm.cu computes it (fp32 block sums, two-pass variance, rstd through
 * double). One pass over memory instead of dropout + add + layernorm's three.
 *
 * Backward: dsum = LN'(dout) from the row's mean(g) and mean(g * xhat), then dx += dsum and
 * dy += dropout'(dsum) with the mask regenerated. dgamma / dbeta are column sums over all
 * rows: layernorm_bwd's deterministic two-pass column kernels compute them (its launcher with
 * dinp NULL), not a second copy here.
 *
 * The half-storage ops (residual_ln_half_fwd / _bwd, and layernorm.cu's through the launchers
 * of cuda/half_scratch.cuh) are at the end: a warp per row with 16-byte vectors where the
 * shape allows, these kernels with half loads elsewhere, and dgamma / dbeta from per-block
 * column partials without a second pass over the matrix. */
#include "common.cuh"
#include "half_scratch.cuh"

enum { RES_THREADS = 256 };

static nmt_status check_args(const char *op, int M, int C, float p) {
  if (M < 0 || C < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: bad shape M=%d C=%d", op, M, C);
  if (!(p >= 0.0f && p < 1.0f))
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: dropout probability %g outside [0, 1)", op,
                      (double)p);
  return NMT_OK;
}

/* Threads per row block: one per Philox block of the row (C/4, +1 when the row starts inside
 * a block), rounded up to a warp, at most RES_THREADS (then a thread takes several). */
static unsigned row_threads(int C) {
  const int blocks = (C + 3) / 4 + 1;
  const int t = (blocks + 31) / 32 * 32;
  return (unsigned)(t < RES_THREADS ? t : RES_THREADS);
}

/* The Philox blocks [b0, b1) that cover the row's elements [e0, e1), dealt to the threads. */
#define FOR_ROW_BLOCKS(blk, b0, b1) \
  for (uint64_t blk = (b0) + threadIdx.x; blk < (b1); blk += blockDim.x)

// out, sum, x, y: (M,C); mean, rstd: (M) or NULL; gamma, beta: (C) or gamma NULL
static __global__ void __launch_bounds__(RES_THREADS)
    residual_fwd_kernel(float *out, float *sum, float *mean, float *rstd, const float *x,
                        const float *y, const float *gamma, const float *beta, int M, int C,
                        float eps, float p, float scale, uint64_t seed, uint64_t stream) {
  __shared__ float sh[32];
  const int r = blockIdx.x;
  if (r >= M) return;
  const uint64_t e0 = (uint64_t)r * (uint64_t)C, e1 = e0 + (uint64_t)C;
  const uint64_t b0 = e0 >> 2, b1 = (e1 + 3) >> 2;
  float s = 0.0f;
  FOR_ROW_BLOCKS(blk, b0, b1) {
    uint32_t w[4] = {0, 0, 0, 0};
    if (p > 0.0f) nmt__rng_block(seed, stream, blk, w);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const uint64_t e = blk * 4 + (uint64_t)j;
      if (e < e0 || e >= e1) continue;
      float v = y[e];
      if (p > 0.0f) v = nmt__u32_uniform(w[j]) >= p ? __fmul_rn(v, scale) : 0.0f;
      const float sv = __fadd_rn(x[e], v);
      sum[e] = sv;
      s += sv;
    }
  }
  if (!gamma) return; /* the same for every thread of the grid: no barrier is left waiting */
  const float mu = nmt__block_sum(s, sh) / (float)C;
  float ss = 0.0f;
  FOR_ROW_BLOCKS(blk, b0, b1) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const uint64_t e = blk * 4 + (uint64_t)j;
      if (e < e0 || e >= e1) continue;
      const float d = sum[e] - mu;
      ss += d * d;
    }
  }
  const float var = nmt__block_sum(ss, sh) / (float)C;
  const float rs = (float)(1.0 / sqrt((double)var + (double)eps));
  FOR_ROW_BLOCKS(blk, b0, b1) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const uint64_t e = blk * 4 + (uint64_t)j;
      if (e < e0 || e >= e1) continue;
      const int c = (int)(e - e0);
      out[e] = (sum[e] - mu) * rs * gamma[c] + beta[c];
    }
  }
  if (threadIdx.x == 0) {
    if (mean) mean[r] = mu;
    if (rstd) rstd[r] = rs;
  }
}
NMT_CUDA_PRELOAD(residual_fwd_kernel);

nmt_status nmt_cuda_residual_dropout_ln_fwd(void *ctx, float *out, float *sum, float *mean,
                                            float *rstd, const float *x, const float *y,
                                            const float *gamma, const float *beta, int M, int C,
                                            float eps, float p, uint64_t seed, uint64_t stream) {
  NMT_TRY(nmt__cuda_enter(ctx, "residual_dropout_ln_fwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_args("residual_dropout_ln_fwd", M, C, p));
  if (!sum) return nmt_errorf(NMT_ERR_INTERNAL, "cuda residual_dropout_ln_fwd: sum is NULL");
  if (gamma && (!out || !beta))
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda residual_dropout_ln_fwd: gamma given without out or beta");
  if (M == 0) return NMT_OK;
  const float scale = 1.0f / (1.0f - p);
  residual_fwd_kernel<<<(unsigned)M, row_threads(C), 0, nmt__cuda_stream(c)>>>(
      out, sum, mean, rstd, x, y, gamma, beta, M, C, eps, p, scale, seed, stream);
  NMT_CUDA_LAUNCH_CHECK("residual_fwd_kernel");
  return NMT_OK;
}

/* dsum = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dout * gamma (layernorm.cu's
 * dinp); dx += dsum; dy += keep ? dsum * scale : 0 (p == 0: dy += dsum). dx or dy may be NULL. */
static __global__ void __launch_bounds__(RES_THREADS)
    residual_bwd_kernel(float *dx, float *dy, const float *dout, const float *sum,
                        const float *gamma, const float *mean, const float *rstd, int M, int C,
                        float p, float scale, uint64_t seed, uint64_t stream) {
  __shared__ float sh[32];
  const int r = blockIdx.x;
  if (r >= M) return;
  const uint64_t e0 = (uint64_t)r * (uint64_t)C, e1 = e0 + (uint64_t)C;
  const uint64_t b0 = e0 >> 2, b1 = (e1 + 3) >> 2;
  const float mu = mean[r], rs = rstd[r];
  float sg = 0.0f, sgx = 0.0f;
  FOR_ROW_BLOCKS(blk, b0, b1) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const uint64_t e = blk * 4 + (uint64_t)j;
      if (e < e0 || e >= e1) continue;
      const int c = (int)(e - e0);
      const float xh = (sum[e] - mu) * rs, gg = dout[e] * gamma[c];
      sg += gg;
      sgx += gg * xh;
    }
  }
  const float mg = nmt__block_sum(sg, sh) / (float)C;
  const float mgx = nmt__block_sum(sgx, sh) / (float)C;
  const bool drop = dy && p > 0.0f;
  FOR_ROW_BLOCKS(blk, b0, b1) {
    uint32_t w[4] = {0, 0, 0, 0};
    if (drop) nmt__rng_block(seed, stream, blk, w);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const uint64_t e = blk * 4 + (uint64_t)j;
      if (e < e0 || e >= e1) continue;
      const int c = (int)(e - e0);
      const float xh = (sum[e] - mu) * rs;
      const float d = rs * (dout[e] * gamma[c] - mg - xh * mgx);
      if (dx) dx[e] += d;
      if (dy) dy[e] += drop ? (nmt__u32_uniform(w[j]) >= p ? __fmul_rn(d, scale) : 0.0f) : d;
    }
  }
}
NMT_CUDA_PRELOAD(residual_bwd_kernel);

nmt_status nmt_cuda_residual_dropout_ln_bwd(void *ctx, float *dx, float *dy, float *dgamma,
                                            float *dbeta, const float *dout, const float *sum,
                                            const float *gamma, const float *mean,
                                            const float *rstd, int M, int C, float p,
                                            uint64_t seed, uint64_t stream) {
  NMT_TRY(nmt__cuda_enter(ctx, "residual_dropout_ln_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_args("residual_dropout_ln_bwd", M, C, p));
  if (M == 0) return NMT_OK;
  if (dx || dy) {
    const float scale = 1.0f / (1.0f - p);
    residual_bwd_kernel<<<(unsigned)M, row_threads(C), 0, nmt__cuda_stream(c)>>>(
        dx, dy, dout, sum, gamma, mean, rstd, M, C, p, scale, seed, stream);
    NMT_CUDA_LAUNCH_CHECK("residual_bwd_kernel");
  }
  if (dgamma || dbeta)
    NMT_TRY(nmt_cuda_layernorm_bwd(ctx, NULL, dgamma, dbeta, dout, sum, gamma, mean, rstd, M, C));
  return NMT_OK;
}

/* ==== the half-storage path (nmt/backend.h residual_ln_half_fwd / _bwd; layernorm.cu's
 * layernorm_half_fwd / _bwd run the same row kernels through nmt__cuda_ln_half_fwd / _bwd,
 * cuda/half_scratch.cuh) ====
 *
 * Two kernels per direction, chosen per call:
 *  - the warp path (C % 8 == 0, C <= 1024, every row tensor 16-byte aligned: the model's
 *    d_model 256, 512 and 1024): one warp per row, lane l owning the 8-column chunks
 *    l, l + 32, ... (K <= 4 chunks), each moved as 16-byte vectors (two float4 for fp32, one
 *    nmt__half8 for half); the row stays in registers between the passes and the row
 *    reductions are warp shuffles: no shared memory and no barrier in the forward. A chunk
 *    starts at a multiple of 8 elements, so it covers exactly two Philox blocks: the mask is
 *    drawn once per block, as the fp32 kernel draws it;
 *  - the scalar path (any C; also what a misaligned slice takes): one block per row, a thread
 *    owning whole 4-element Philox blocks of the row, exactly the fp32 kernels above with half
 *    loads and stores.
 * Each half output is the rounding (nmt__float_to_half) of the fp32 value computed for the
 * fp32 output in the same expression, so out_h = round(out) and dh = round(what the fp32 op
 * adds) hold bit for bit.
 *
 * dgamma / dbeta on the warp path, without float atomics and without a second pass over the
 * (M, C) matrix: the rows are cut into nb <= NMT_CUDA_LN_HALF_MAX_BLOCKS blocks of
 * rows_per = ceil(M / nb) rows (both a function of M alone, so the sums' order is fixed by the
 * shape); each lane keeps its columns' sums of dout * xhat and dout over its warp's rows in
 * registers, the warps of a block add theirs into shared memory in warp order, the block
 * writes one (2, C) partial row to the op scratch (nmt__cuda_ln_half_scratch), and
 * ln_partials_finish adds the blocks' rows in block order into dgamma / dbeta. The scalar path
 * keeps layernorm_bwd's column-sum kernels (a second read of dout and the input). */

enum { LNW_THREADS = 256, LNW_ROWS = LNW_THREADS / 32, LNW_MAX_C = 1024 };
/* At least this many rows per partial block (fewer blocks for a small M). */
enum { LNB_MIN_ROWS = 16 };

size_t nmt__cuda_ln_half_scratch(size_t width) {
  return nmt__cuda_pad(2 * (size_t)NMT_CUDA_LN_HALF_MAX_BLOCKS * width * sizeof(float));
}

/* The sum over the warp, in every lane (a butterfly: each step adds a lane's value and its
 * partner's, the same two numbers in both lanes, so all lanes hold the same bits). */
template <typename F>
__device__ __forceinline__ F warp_allsum(F v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ void load8(float v[8], const float *p) {
  const float4 a = reinterpret_cast<const float4 *>(p)[0];
  const float4 b = reinterpret_cast<const float4 *>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ void store8(float *p, const float v[8]) {
  reinterpret_cast<float4 *>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4 *>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

template <typename T>
__device__ __forceinline__ void store8h(T *p, const float v[8]) {
  nmt__half8<T> h;
#pragma unroll
  for (int j = 0; j < 8; j++) h.v[j] = nmt__float_to_half<T>(v[j]);
  *reinterpret_cast<nmt__half8<T> *>(p) = h;
}

/* The two Philox blocks of the 8 elements from e0 (a multiple of 8). */
__device__ __forceinline__ void rng8(uint32_t w[8], uint64_t seed, uint64_t stream, uint64_t e0) {
  nmt__rng_block(seed, stream, e0 >> 2, w);
  nmt__rng_block(seed, stream, (e0 >> 2) + 1, w + 4);
}

/* The warp path's forward (nmt__cuda_ln_half_fwd): warp w of block b takes row
 * r = b * LNW_ROWS + w. K: chunks per lane, C <= 256 K. y NULL: s = x (layernorm_half_fwd).
 * Resources: LNW_THREADS threads, no shared memory, 8 K + 8 floats of row per lane. */
template <typename T, int K>
static __global__ void __launch_bounds__(LNW_THREADS)
    ln_fwd_warp(float *out, T *out_h, float *sum, float *mean, float *rstd, const float *x,
                const T *y, const float *gamma, const float *beta, int M, int C, float eps,
                float p, float scale, uint64_t seed, uint64_t stream) {
  const int lane = (int)threadIdx.x & 31;
  const int r = (int)blockIdx.x * LNW_ROWS + ((int)threadIdx.x >> 5);
  if (r >= M) return; /* the whole warp: nothing below waits for another warp */
  const size_t row = (size_t)r * (size_t)C;
  float s[K][8];
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < K; i++) {
    const int c0 = (i * 32 + lane) * 8;
    if (c0 >= C) continue;
    load8(s[i], x + row + c0);
    if (y) {
      const nmt__half8<T> yv = *reinterpret_cast<const nmt__half8<T> *>(y + row + c0);
      uint32_t w[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (p > 0.0f) rng8(w, seed, stream, row + (size_t)c0);
#pragma unroll
      for (int j = 0; j < 8; j++) {
        float v = nmt__half_to_float(yv.v[j]);
        if (p > 0.0f) v = nmt__u32_uniform(w[j]) >= p ? __fmul_rn(v, scale) : 0.0f;
        s[i][j] = __fadd_rn(s[i][j], v);
      }
    }
    if (sum) store8(sum + row + c0, s[i]);
#pragma unroll
    for (int j = 0; j < 8; j++) acc += s[i][j];
  }
  if (!gamma) return;
  const float mu = warp_allsum(acc) / (float)C;
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < K; i++) {
    if ((i * 32 + lane) * 8 >= C) continue;
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const float d = s[i][j] - mu;
      ss += d * d;
    }
  }
  const float var = warp_allsum(ss) / (float)C;
  const float rs = (float)(1.0 / sqrt((double)var + (double)eps));
#pragma unroll
  for (int i = 0; i < K; i++) {
    const int c0 = (i * 32 + lane) * 8;
    if (c0 >= C) continue;
    float o[8];
#pragma unroll
    for (int j = 0; j < 8; j++) o[j] = (s[i][j] - mu) * rs * gamma[c0 + j] + beta[c0 + j];
    if (out) store8(out + row + c0, o);
    if (out_h) store8h(out_h + row + c0, o);
  }
  if (lane == 0) {
    if (mean) mean[r] = mu;
    if (rstd) rstd[r] = rs;
  }
}
NMT_CUDA_PRELOAD(ln_fwd_warp<__half, 1>);
NMT_CUDA_PRELOAD(ln_fwd_warp<__half, 2>);
NMT_CUDA_PRELOAD(ln_fwd_warp<__half, 4>);
NMT_CUDA_PRELOAD(ln_fwd_warp<__nv_bfloat16, 1>);
NMT_CUDA_PRELOAD(ln_fwd_warp<__nv_bfloat16, 2>);
NMT_CUDA_PRELOAD(ln_fwd_warp<__nv_bfloat16, 4>);

/* The scalar path's forward: residual_fwd_kernel with y half or NULL (s = x), sum, out and
 * out_h each optional (sum required with y: the later passes re-read s from sum, else from x,
 * each thread only what it wrote or read itself). Resources: row_threads(C) threads, 256 B of
 * static shared memory. */
template <typename T>
static __global__ void __launch_bounds__(RES_THREADS)
    ln_fwd_rows(float *out, T *out_h, float *sum, float *mean, float *rstd, const float *x,
                const T *y, const float *gamma, const float *beta, int M, int C, float eps,
                float p, float scale, uint64_t seed, uint64_t stream) {
  __shared__ float sh[32];
  const int r = blockIdx.x;
  if (r >= M) return;
  const uint64_t e0 = (uint64_t)r * (uint64_t)C, e1 = e0 + (uint64_t)C;
  const uint64_t b0 = e0 >> 2, b1 = (e1 + 3) >> 2;
  const float *src = sum ? sum : x;
  float s = 0.0f;
  FOR_ROW_BLOCKS(blk, b0, b1) {
    uint32_t w[4] = {0, 0, 0, 0};
    if (y && p > 0.0f) nmt__rng_block(seed, stream, blk, w);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const uint64_t e = blk * 4 + (uint64_t)j;
      if (e < e0 || e >= e1) continue;
      float sv = x[e];
      if (y) {
        float v = nmt__half_to_float(y[e]);
        if (p > 0.0f) v = nmt__u32_uniform(w[j]) >= p ? __fmul_rn(v, scale) : 0.0f;
        sv = __fadd_rn(sv, v);
      }
      if (sum) sum[e] = sv;
      s += sv;
    }
  }
  if (!gamma) return; /* the same for every thread of the grid */
  const float mu = nmt__block_sum(s, sh) / (float)C;
  float ss = 0.0f;
  FOR_ROW_BLOCKS(blk, b0, b1) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const uint64_t e = blk * 4 + (uint64_t)j;
      if (e < e0 || e >= e1) continue;
      const float d = src[e] - mu;
      ss += d * d;
    }
  }
  const float var = nmt__block_sum(ss, sh) / (float)C;
  const float rs = (float)(1.0 / sqrt((double)var + (double)eps));
  FOR_ROW_BLOCKS(blk, b0, b1) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const uint64_t e = blk * 4 + (uint64_t)j;
      if (e < e0 || e >= e1) continue;
      const int c = (int)(e - e0);
      const float o = (src[e] - mu) * rs * gamma[c] + beta[c];
      if (out) out[e] = o;
      if (out_h) out_h[e] = nmt__float_to_half<T>(o);
    }
  }
  if (threadIdx.x == 0) {
    if (mean) mean[r] = mu;
    if (rstd) rstd[r] = rs;
  }
}
NMT_CUDA_PRELOAD(ln_fwd_rows<__half>);
NMT_CUDA_PRELOAD(ln_fwd_rows<__nv_bfloat16>);

static int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* The warp path serves C % 8 == 0 up to LNW_MAX_C with every row pointer 16-byte aligned
 * (then every row is: 8 elements are 32 bytes of fp32 and 16 of half). */
static int warp_path(int C, const void *const *ptrs, int n) {
  if (C % 8 != 0 || C > LNW_MAX_C) return 0;
  for (int i = 0; i < n; i++)
    if (ptrs[i] && !aligned16(ptrs[i])) return 0;
  return 1;
}

/* Chunks of 8 columns per lane for width C: 1, 2 or 4 (C <= 256, 512, 1024). */
static int lanes_k(int C) { return C <= 256 ? 1 : C <= 512 ? 2 : 4; }

template <typename T>
static nmt_status ln_fwd_t(nmt_cuda_ctx *c, float *out, T *out_h, float *sum, float *mean,
                           float *rstd, const float *x, const T *y, const float *gamma,
                           const float *beta, int M, int C, float eps, float p, uint64_t seed,
                           uint64_t stream) {
  const float scale = 1.0f / (1.0f - p);
  cudaStream_t s = nmt__cuda_stream(c);
  const void *ptrs[5] = {out, out_h, sum, x, y};
  if (warp_path(C, ptrs, 5)) {
    /* LNW_THREADS threads (LNW_ROWS rows) per block, ceil(M / LNW_ROWS) <= 2^28 blocks; no
     * shared memory. */
    const unsigned grid = (unsigned)((M + LNW_ROWS - 1) / LNW_ROWS);
    switch (lanes_k(C)) {
      case 1:
        ln_fwd_warp<T, 1><<<grid, LNW_THREADS, 0, s>>>(out, out_h, sum, mean, rstd, x, y, gamma,
                                                       beta, M, C, eps, p, scale, seed, stream);
        break;
      case 2:
        ln_fwd_warp<T, 2><<<grid, LNW_THREADS, 0, s>>>(out, out_h, sum, mean, rstd, x, y, gamma,
                                                       beta, M, C, eps, p, scale, seed, stream);
        break;
      default:
        ln_fwd_warp<T, 4><<<grid, LNW_THREADS, 0, s>>>(out, out_h, sum, mean, rstd, x, y, gamma,
                                                       beta, M, C, eps, p, scale, seed, stream);
    }
    NMT_CUDA_LAUNCH_CHECK("ln_fwd_warp");
    return NMT_OK;
  }
  /* One block of row_threads(C) <= 256 threads per row, M <= 2^31 - 1 blocks. */
  ln_fwd_rows<T><<<(unsigned)M, row_threads(C), 0, s>>>(out, out_h, sum, mean, rstd, x, y, gamma,
                                                         beta, M, C, eps, p, scale, seed, stream);
  NMT_CUDA_LAUNCH_CHECK("ln_fwd_rows");
  return NMT_OK;
}

nmt_status nmt__cuda_ln_half_fwd(nmt_cuda_ctx *c, float *out, void *out_h, float *sum,
                                 float *mean, float *rstd, const float *x, const void *y,
                                 const float *gamma, const float *beta, int M, int C, float eps,
                                 float p, uint64_t seed, uint64_t stream) {
  if (M == 0) return NMT_OK;
  if (nmt__cuda_half_bf16(c))
    return ln_fwd_t(c, out, (__nv_bfloat16 *)out_h, sum, mean, rstd, x,
                    (const __nv_bfloat16 *)y, gamma, beta, M, C, eps, p, seed, stream);
  return ln_fwd_t(c, out, (__half *)out_h, sum, mean, rstd, x, (const __half *)y, gamma, beta, M,
                  C, eps, p, seed, stream);
}

/* One element's half gradient: DINP rounds the new fp32 df (o); DROPOUT rounds dsum (d)
 * through the dropout's backward (keep ? d * scale : 0; drop = 0 when p == 0). */
template <typename T>
__device__ __forceinline__ T dh_value(int dh_mode, float o, float d, bool drop, uint32_t w,
                                      float p, float scale) {
  if (dh_mode == NMT_CUDA_LN_DH_DINP) return nmt__float_to_half<T>(o);
  if (drop) d = nmt__u32_uniform(w) >= p ? __fmul_rn(d, scale) : 0.0f;
  return nmt__float_to_half<T>(d);
}

/* Threads of the warp path's backward: 16 warps for K <= 2, 8 for K = 4 (the row, its xhat
 * and the column partials are 32 K floats per lane: 255 registers at most at 256 threads). */
#define LNB_THREADS(K) ((K) <= 2 ? 512 : 256)

/* The warp path's backward (nmt__cuda_ln_half_bwd): block b takes rows [b*rows_per,
 * min((b+1)*rows_per, M)), its warp w every nw-th of them from w. With part (dgamma or dbeta
 * asked for): each lane sums dout * xhat and dout of its columns over its warp's rows, the
 * warps add theirs into sh in warp order, and the block writes row b of part (nb, 2, C).
 * Resources: LNB_THREADS(K) threads, 8 KiB of static shared memory (2 x LNW_MAX_C floats). */
template <typename T, int K>
static __global__ void __launch_bounds__(LNB_THREADS(K))
    ln_bwd_warp(float *df, int df_add, T *dh, int dh_mode, float *part, const float *dout,
                const float *xin, const float *gamma, const float *mean, const float *rstd,
                int M, int C, int rows_per, float p, float scale, uint64_t seed,
                uint64_t stream) {
  __shared__ float sh[2][LNW_MAX_C];
  const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
  const int nw = (int)blockDim.x >> 5;
  const int r0 = (int)blockIdx.x * rows_per;
  const int r1 = M - r0 < rows_per ? M : r0 + rows_per;
  const bool drop = dh && dh_mode == NMT_CUDA_LN_DH_DROPOUT && p > 0.0f;
  float pg[K][8], pb[K][8];
#pragma unroll
  for (int i = 0; i < K; i++)
#pragma unroll
    for (int j = 0; j < 8; j++) pg[i][j] = pb[i][j] = 0.0f;
  for (int r = r0 + warp; r < r1; r += nw) { /* warp-uniform: no barrier inside */
    const size_t row = (size_t)r * (size_t)C;
    const float mu = mean[r], rs = rstd[r];
    float g[K][8], xh[K][8];
    float sg = 0.0f, sgx = 0.0f;
#pragma unroll
    for (int i = 0; i < K; i++) {
      const int c0 = (i * 32 + lane) * 8;
      if (c0 >= C) continue;
      float xv[8];
      load8(g[i], dout + row + c0);
      load8(xv, xin + row + c0);
#pragma unroll
      for (int j = 0; j < 8; j++) {
        xh[i][j] = (xv[j] - mu) * rs;
        const float gg = g[i][j] * gamma[c0 + j];
        sg += gg;
        sgx += gg * xh[i][j];
        if (part) {
          pg[i][j] += g[i][j] * xh[i][j];
          pb[i][j] += g[i][j];
        }
      }
    }
    const float mg = warp_allsum(sg) / (float)C;
    const float mgx = warp_allsum(sgx) / (float)C;
    if (!df && !dh) continue;
#pragma unroll
    for (int i = 0; i < K; i++) {
      const int c0 = (i * 32 + lane) * 8;
      if (c0 >= C) continue;
      float d[8], o[8];
#pragma unroll
      for (int j = 0; j < 8; j++) d[j] = rs * (g[i][j] * gamma[c0 + j] - mg - xh[i][j] * mgx);
      if (df && df_add) {
        load8(o, df + row + c0);
#pragma unroll
        for (int j = 0; j < 8; j++) o[j] = __fadd_rn(o[j], d[j]);
      }
      /* Written, not added: the reference's 0 + d (accumulated into zeros), so that a -0
       * comes out +0 as there; the dropout's input too. */
#pragma unroll
      for (int j = 0; j < 8; j++) d[j] = __fadd_rn(0.0f, d[j]);
      if (!(df && df_add)) {
#pragma unroll
        for (int j = 0; j < 8; j++) o[j] = d[j];
      }
      if (df) store8(df + row + c0, o);
      if (dh) {
        uint32_t w[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (drop) rng8(w, seed, stream, row + (size_t)c0);
        nmt__half8<T> h;
#pragma unroll
        for (int j = 0; j < 8; j++) h.v[j] = dh_value<T>(dh_mode, o[j], d[j], drop, w[j], p, scale);
        *reinterpret_cast<nmt__half8<T> *>(dh + row + c0) = h;
      }
    }
  }
  if (!part) return; /* the same for every thread of the grid: no barrier is left waiting */
  for (int w = 0; w < nw; w++) {
    __syncthreads(); /* warp w-1's adds are in sh */
    if (warp == w) {
#pragma unroll
      for (int i = 0; i < K; i++) {
        const int c0 = (i * 32 + lane) * 8;
        if (c0 >= C) continue;
#pragma unroll
        for (int j = 0; j < 8; j++) {
          sh[0][c0 + j] = w == 0 ? pg[i][j] : sh[0][c0 + j] + pg[i][j];
          sh[1][c0 + j] = w == 0 ? pb[i][j] : sh[1][c0 + j] + pb[i][j];
        }
      }
    }
  }
  __syncthreads();
  float *dst = part + (size_t)blockIdx.x * 2 * (size_t)C;
  for (int col = (int)threadIdx.x; col < C; col += (int)blockDim.x) {
    dst[col] = sh[0][col];
    dst[C + col] = sh[1][col];
  }
}
NMT_CUDA_PRELOAD(ln_bwd_warp<__half, 1>);
NMT_CUDA_PRELOAD(ln_bwd_warp<__half, 2>);
NMT_CUDA_PRELOAD(ln_bwd_warp<__half, 4>);
NMT_CUDA_PRELOAD(ln_bwd_warp<__nv_bfloat16, 1>);
NMT_CUDA_PRELOAD(ln_bwd_warp<__nv_bfloat16, 2>);
NMT_CUDA_PRELOAD(ln_bwd_warp<__nv_bfloat16, 4>);

// dgamma, dbeta: (C) += the column sums of part (nb, 2, C), blocks in order
static __global__ void ln_partials_finish(float *dgamma, float *dbeta, const float *part, int nb,
                                          int C) {
  for (int col = (int)(blockIdx.x * blockDim.x + threadIdx.x); col < C;
       col += (int)(gridDim.x * blockDim.x)) {
    float tg = 0.0f, tb = 0.0f;
    for (int b = 0; b < nb; b++) {
      tg += part[(size_t)b * 2 * (size_t)C + col];
      tb += part[(size_t)b * 2 * (size_t)C + (size_t)C + col];
    }
    if (dgamma) dgamma[col] += tg;
    if (dbeta) dbeta[col] += tb;
  }
}
NMT_CUDA_PRELOAD(ln_partials_finish);

/* The scalar path's backward rows: residual_bwd_kernel with df written or added and dh in
 * half. Resources: row_threads(C) threads, 256 B of static shared memory. */
template <typename T>
static __global__ void __launch_bounds__(RES_THREADS)
    ln_bwd_rows(float *df, int df_add, T *dh, int dh_mode, const float *dout, const float *xin,
                const float *gamma, const float *mean, const float *rstd, int M, int C, float p,
                float scale, uint64_t seed, uint64_t stream) {
  __shared__ float sh[32];
  const int r = blockIdx.x;
  if (r >= M) return;
  const uint64_t e0 = (uint64_t)r * (uint64_t)C, e1 = e0 + (uint64_t)C;
  const uint64_t b0 = e0 >> 2, b1 = (e1 + 3) >> 2;
  const float mu = mean[r], rs = rstd[r];
  float sg = 0.0f, sgx = 0.0f;
  FOR_ROW_BLOCKS(blk, b0, b1) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const uint64_t e = blk * 4 + (uint64_t)j;
      if (e < e0 || e >= e1) continue;
      const int c = (int)(e - e0);
      const float xh = (xin[e] - mu) * rs, gg = dout[e] * gamma[c];
      sg += gg;
      sgx += gg * xh;
    }
  }
  const float mg = nmt__block_sum(sg, sh) / (float)C;
  const float mgx = nmt__block_sum(sgx, sh) / (float)C;
  const bool drop = dh && dh_mode == NMT_CUDA_LN_DH_DROPOUT && p > 0.0f;
  FOR_ROW_BLOCKS(blk, b0, b1) {
    uint32_t w[4] = {0, 0, 0, 0};
    if (drop) nmt__rng_block(seed, stream, blk, w);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const uint64_t e = blk * 4 + (uint64_t)j;
      if (e < e0 || e >= e1) continue;
      const int c = (int)(e - e0);
      const float xh = (xin[e] - mu) * rs;
      const float dr = rs * (dout[e] * gamma[c] - mg - xh * mgx);
      /* written: the reference's 0 + d (a -0 comes out +0); added: df + d */
      const float d = __fadd_rn(0.0f, dr);
      float o = d;
      if (df) {
        if (df_add) o = __fadd_rn(df[e], dr);
        df[e] = o;
      }
      if (dh) dh[e] = dh_value<T>(dh_mode, o, d, drop, w[j], p, scale);
    }
  }
}
NMT_CUDA_PRELOAD(ln_bwd_rows<__half>);
NMT_CUDA_PRELOAD(ln_bwd_rows<__nv_bfloat16>);

template <typename T>
static nmt_status ln_bwd_t(nmt_cuda_ctx *c, float *df, int df_add, T *dh, nmt__cuda_ln_dh dh_mode,
                           float *dgamma, float *dbeta, const float *dout, const float *xin,
                           const float *gamma, const float *mean, const float *rstd, int M,
                           int C, float p, uint64_t seed, uint64_t stream) {
  const float scale = 1.0f / (1.0f - p);
  const int params = dgamma || dbeta;
  cudaStream_t s = nmt__cuda_stream(c);
  const void *ptrs[4] = {df, dh, dout, xin};
  if (warp_path(C, ptrs, 4)) {
    const int K = lanes_k(C), threads = LNB_THREADS(K), warps = threads / 32;
    /* Rows per block: with parameter gradients, nb <= NMT_CUDA_LN_HALF_MAX_BLOCKS blocks of at
     * least LNB_MIN_ROWS rows (a function of M alone: the partials' order is the shape's);
     * without, one row per warp. */
    int nb, rows_per;
    float *part = NULL;
    if (params) {
      nb = (M + LNB_MIN_ROWS - 1) / LNB_MIN_ROWS;
      if (nb > NMT_CUDA_LN_HALF_MAX_BLOCKS) nb = NMT_CUDA_LN_HALF_MAX_BLOCKS;
      rows_per = (M + nb - 1) / nb;
      nb = (M + rows_per - 1) / rows_per;
      /* The bound, which reserve_scratch sized for the plan's width: no growth for a small M. */
      void *scratch;
      NMT_TRY(nmt__cuda_scratch(c, nmt__cuda_ln_half_scratch((size_t)C), &scratch));
      part = (float *)scratch;
    } else {
      rows_per = warps;
      nb = (M + warps - 1) / warps;
    }
    const int mode = (int)dh_mode;
    switch (K) {
      case 1:
        ln_bwd_warp<T, 1><<<(unsigned)nb, threads, 0, s>>>(df, df_add, dh, mode, part, dout, xin,
                                                            gamma, mean, rstd, M, C, rows_per, p,
                                                            scale, seed, stream);
        break;
      case 2:
        ln_bwd_warp<T, 2><<<(unsigned)nb, threads, 0, s>>>(df, df_add, dh, mode, part, dout, xin,
                                                            gamma, mean, rstd, M, C, rows_per, p,
                                                            scale, seed, stream);
        break;
      default:
        ln_bwd_warp<T, 4><<<(unsigned)nb, threads, 0, s>>>(df, df_add, dh, mode, part, dout, xin,
                                                            gamma, mean, rstd, M, C, rows_per, p,
                                                            scale, seed, stream);
    }
    NMT_CUDA_LAUNCH_CHECK("ln_bwd_warp");
    if (params) {
      ln_partials_finish<<<nmt__grid((size_t)C, 256), 256, 0, s>>>(dgamma, dbeta, part, nb, C);
      NMT_CUDA_LAUNCH_CHECK("ln_partials_finish");
    }
    return NMT_OK;
  }
  if (df || dh) {
    /* One block of row_threads(C) <= 256 threads per row, M <= 2^31 - 1 blocks. */
    ln_bwd_rows<T><<<(unsigned)M, row_threads(C), 0, s>>>(df, df_add, dh, (int)dh_mode, dout, xin,
                                                          gamma, mean, rstd, M, C, p, scale, seed,
                                                          stream);
    NMT_CUDA_LAUNCH_CHECK("ln_bwd_rows");
  }
  if (params)
    NMT_TRY(nmt_cuda_layernorm_bwd(c, NULL, dgamma, dbeta, dout, xin, gamma, mean, rstd, M, C));
  return NMT_OK;
}

nmt_status nmt__cuda_ln_half_bwd(nmt_cuda_ctx *c, float *df, int df_add, void *dh,
                                 nmt__cuda_ln_dh dh_mode, float *dgamma, float *dbeta,
                                 const float *dout, const float *xin, const float *gamma,
                                 const float *mean, const float *rstd, int M, int C, float p,
                                 uint64_t seed, uint64_t stream) {
  if (M == 0 || (!df && !dh && !dgamma && !dbeta)) return NMT_OK;
  if (nmt__cuda_half_bf16(c))
    return ln_bwd_t(c, df, df_add, (__nv_bfloat16 *)dh, dh_mode, dgamma, dbeta, dout, xin, gamma,
                    mean, rstd, M, C, p, seed, stream);
  return ln_bwd_t(c, df, df_add, (__half *)dh, dh_mode, dgamma, dbeta, dout, xin, gamma, mean,
                  rstd, M, C, p, seed, stream);
}

// out, sum, x: (M,C) fp32; out_h, y: (M,C) half; mean, rstd: (M); gamma, beta: (C)
nmt_status nmt_cuda_residual_ln_half_fwd(void *ctx, float *out, nmt_act *out_h, float *sum,
                                         float *mean, float *rstd, const float *x,
                                         const nmt_act *y, const float *gamma, const float *beta,
                                         int M, int C, float eps, float p, uint64_t seed,
                                         uint64_t stream) {
  NMT_TRY(nmt__cuda_enter(ctx, "residual_ln_half_fwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_args("residual_ln_half_fwd", M, C, p));
  NMT_TRY(nmt__cuda_half_op_check(c, "residual_ln_half_fwd"));
  if (!sum) return nmt_errorf(NMT_ERR_INTERNAL, "cuda residual_ln_half_fwd: sum is NULL");
  if (gamma && (!out || !beta))
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda residual_ln_half_fwd: gamma given without out or beta");
  if (M > 0 && (!x || !y))
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda residual_ln_half_fwd: x or y is NULL");
  return nmt__cuda_ln_half_fwd(c, gamma ? out : NULL, gamma ? out_h : NULL, sum, mean, rstd, x,
                               y, gamma, beta, M, C, eps, p, seed, stream);
}

// dx, dout, sum: (M,C) fp32; dy: (M,C) half; mean, rstd: (M); gamma, dgamma, dbeta: (C)
nmt_status nmt_cuda_residual_ln_half_bwd(void *ctx, float *dx, nmt_act *dy, float *dgamma,
                                         float *dbeta, const float *dout, const float *sum,
                                         const float *gamma, const float *mean,
                                         const float *rstd, int M, int C, float p,
                                         uint64_t seed, uint64_t stream) {
  NMT_TRY(nmt__cuda_enter(ctx, "residual_ln_half_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_args("residual_ln_half_bwd", M, C, p));
  NMT_TRY(nmt__cuda_half_op_check(c, "residual_ln_half_bwd"));
  return nmt__cuda_ln_half_bwd(c, dx, 0, dy, NMT_CUDA_LN_DH_DROPOUT, dgamma, dbeta, dout, sum,
                               gamma, mean, rstd, M, C, p, seed, stream);
}
