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
 * dinp NULL), not a second copy here. */
#include "common.cuh"

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

/* ---- STUB: the half-storage ops, to be implemented ---- */
nmt_status nmt_cuda_residual_ln_half_fwd(void *ctx, float *out, nmt_act *out_h, float *sum, float *mean, float *rstd, const float *x, const nmt_act *y, const float *gamma, const float *beta, int M, int C, float eps, float p, uint64_t seed, uint64_t stream) {
  (void)ctx; (void)out; (void)out_h; (void)sum; (void)mean; (void)rstd; (void)x; (void)y; (void)gamma; (void)beta; (void)M; (void)C; (void)eps; (void)p; (void)seed; (void)stream;
  return nmt_errorf(NMT_ERR_INTERNAL, "cuda residual_ln_half_fwd: not implemented yet");
}

nmt_status nmt_cuda_residual_ln_half_bwd(void *ctx, float *dx, nmt_act *dy, float *dgamma, float *dbeta, const float *dout, const float *sum, const float *gamma, const float *mean, const float *rstd, int M, int C, float p, uint64_t seed, uint64_t stream) {
  (void)ctx; (void)dx; (void)dy; (void)dgamma; (void)dbeta; (void)dout; (void)sum; (void)gamma; (void)mean; (void)rstd; (void)M; (void)C; (void)p; (void)seed; (void)stream;
  return nmt_errorf(NMT_ERR_INTERNAL, "cuda residual_ln_half_bwd: not implemented yet");
}
