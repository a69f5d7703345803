/* cuda/layernorm.cu — layer normalization (Ba et al. 2016): biased variance, eps inside the
 * sqrt, two-pass statistics, as src/ref/layernorm.c.
 *
 * Forward and the input gradient: one block per row, block reductions in a fixed order.
 * dgamma / dbeta are column sums over all rows; they are formed without atomics in two passes
 * (per-chunk partial sums in a fixed row order, then the chunks in order), so the result is
 * bitwise repeatable. The half-storage ops (layernorm_half_fwd / _bwd) at the end run
 * cuda/residual.cu's half row kernels. */
#include "common.cuh"
#include "half_scratch.cuh"

enum { LN_THREADS = 256, COL_TILE = 32, COL_ROWS = 8 };

// out, inp: (M,C); mean, rstd: (M) or NULL; gamma, beta: (C)
static __global__ void __launch_bounds__(LN_THREADS)
    layernorm_fwd_kernel(float *out, float *mean, float *rstd, const float *inp,
                         const float *gamma, const float *beta, int M, int C, float eps) {
  __shared__ float sh[32];
  const int r = blockIdx.x;
  if (r >= M) return;
  const float *x = inp + (size_t)r * C;
  float s = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) s += x[c];
  const float mu = nmt__block_sum(s, sh) / (float)C;
  float ss = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = x[c] - mu;
    ss += d * d;
  }
  const float var = nmt__block_sum(ss, sh) / (float)C;
  const float rs = (float)(1.0 / sqrt((double)var + (double)eps));
  float *o = out + (size_t)r * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = (x[c] - mu) * rs * gamma[c] + beta[c];
  if (threadIdx.x == 0) {
    if (mean) mean[r] = mu;
    if (rstd) rstd[r] = rs;
  }
}
NMT_CUDA_PRELOAD(layernorm_fwd_kernel);

nmt_status nmt_cuda_layernorm_fwd(void *ctx, float *out, float *mean, float *rstd,
                                  const float *inp, const float *gamma, const float *beta, int M,
                                  int C, float eps) {
  NMT_TRY(nmt__cuda_enter(ctx, "layernorm_fwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (M < 0 || C < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda layernorm_fwd: bad shape M=%d C=%d", M, C);
  if (M == 0) return NMT_OK;
  layernorm_fwd_kernel<<<(unsigned)M, LN_THREADS, 0, nmt__cuda_stream(c)>>>(
      out, mean, rstd, inp, gamma, beta, M, C, eps);
  NMT_CUDA_LAUNCH_CHECK("layernorm_fwd_kernel");
  return NMT_OK;
}

/* dinp += rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dout * gamma. */
static __global__ void __launch_bounds__(LN_THREADS)
    layernorm_dinp_kernel(float *dinp, const float *dout, const float *inp, const float *gamma,
                          const float *mean, const float *rstd, int M, int C) {
  __shared__ float sh[32];
  const int r = blockIdx.x;
  if (r >= M) return;
  const float *x = inp + (size_t)r * C, *g = dout + (size_t)r * C;
  const float mu = mean[r], rs = rstd[r];
  float sg = 0.0f, sgx = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float xh = (x[c] - mu) * rs, gg = g[c] * gamma[c];
    sg += gg;
    sgx += gg * xh;
  }
  const float mg = nmt__block_sum(sg, sh) / (float)C;
  const float mgx = nmt__block_sum(sgx, sh) / (float)C;
  float *dx = dinp + (size_t)r * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float xh = (x[c] - mu) * rs;
    dx[c] += rs * (g[c] * gamma[c] - mg - xh * mgx);
  }
}
NMT_CUDA_PRELOAD(layernorm_dinp_kernel);

/* Partial column sums of dout * xhat (-> pg) and dout (-> pb) over rows [ch*rows_per, ...) of
 * chunk ch = blockIdx.y, for columns blockIdx.x*32 + threadIdx.x. pg, pb: (n_chunks, C). */
static __global__ void layernorm_colsum_partial(float *pg, float *pb, const float *dout,
                                                const float *inp, const float *mean,
                                                const float *rstd, int M, int C, int rows_per) {
  __shared__ float sg[COL_ROWS][COL_TILE + 1], sb[COL_ROWS][COL_TILE + 1];
  const int col = blockIdx.x * COL_TILE + threadIdx.x, ch = blockIdx.y;
  const int r0 = ch * rows_per, r1 = r0 + rows_per < M ? r0 + rows_per : M;
  float ag = 0.0f, ab = 0.0f;
  if (col < C)
    for (int r = r0 + threadIdx.y; r < r1; r += COL_ROWS) {
      const size_t i = (size_t)r * C + col;
      const float g = dout[i];
      ag += g * ((inp[i] - mean[r]) * rstd[r]);
      ab += g;
    }
  sg[threadIdx.y][threadIdx.x] = ag;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < C) {
    float tg = 0.0f, tb = 0.0f;
    for (int k = 0; k < COL_ROWS; k++) {
      tg += sg[k][threadIdx.x];
      tb += sb[k][threadIdx.x];
    }
    pg[(size_t)ch * C + col] = tg;
    pb[(size_t)ch * C + col] = tb;
  }
}
NMT_CUDA_PRELOAD(layernorm_colsum_partial);

static __global__ void layernorm_colsum_final(float *dgamma, float *dbeta, const float *pg,
                                              const float *pb, int n_chunks, int C) {
  for (int col = blockIdx.x * blockDim.x + threadIdx.x; col < C; col += gridDim.x * blockDim.x) {
    float tg = 0.0f, tb = 0.0f;
    for (int k = 0; k < n_chunks; k++) {
      tg += pg[(size_t)k * C + col];
      tb += pb[(size_t)k * C + col];
    }
    if (dgamma) dgamma[col] += tg;
    if (dbeta) dbeta[col] += tb;
  }
}
NMT_CUDA_PRELOAD(layernorm_colsum_final);

enum { MAX_CHUNKS = 128 };

size_t nmt__cuda_layernorm_scratch(size_t width) {
  return 2 * (size_t)MAX_CHUNKS * width * sizeof(float);
}

nmt_status nmt_cuda_layernorm_bwd(void *ctx, float *dinp, float *dgamma, float *dbeta,
                                  const float *dout, const float *inp, const float *gamma,
                                  const float *mean, const float *rstd, int M, int C) {
  NMT_TRY(nmt__cuda_enter(ctx, "layernorm_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (M < 0 || C < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda layernorm_bwd: bad shape M=%d C=%d", M, C);
  if (M == 0) return NMT_OK;
  if (dinp) {
    layernorm_dinp_kernel<<<(unsigned)M, LN_THREADS, 0, nmt__cuda_stream(c)>>>(
        dinp, dout, inp, gamma, mean, rstd, M, C);
    NMT_CUDA_LAUNCH_CHECK("layernorm_dinp_kernel");
  }
  if (dgamma || dbeta) {
    /* Up to MAX_CHUNKS chunks of at least 32 rows: enough blocks to fill a GPU for C = 512. */
    int n_chunks = (M + 31) / 32;
    if (n_chunks > MAX_CHUNKS) n_chunks = MAX_CHUNKS;
    const int rows_per = (M + n_chunks - 1) / n_chunks;
    void *scratch;
    /* The bound (MAX_CHUNKS chunks), which reserve_scratch sized: no growth for a small M. */
    NMT_TRY(nmt__cuda_scratch(c, nmt__cuda_layernorm_scratch((size_t)C), &scratch));
    float *pg = (float *)scratch, *pb = pg + (size_t)n_chunks * C;
    dim3 grid((unsigned)((C + COL_TILE - 1) / COL_TILE), (unsigned)n_chunks);
    dim3 block(COL_TILE, COL_ROWS);
    layernorm_colsum_partial<<<grid, block, 0, nmt__cuda_stream(c)>>>(
        pg, pb, dout, inp, mean, rstd, M, C, rows_per);
    NMT_CUDA_LAUNCH_CHECK("layernorm_colsum_partial");
    layernorm_colsum_final<<<nmt__grid((size_t)C, 256), 256, 0, nmt__cuda_stream(c)>>>(
        dgamma, dbeta, pg, pb, n_chunks, C);
    NMT_CUDA_LAUNCH_CHECK("layernorm_colsum_final");
  }
  return NMT_OK;
}

/* ---- the half-storage path (nmt/backend.h layernorm_half_fwd / _bwd): the row kernels of
 * cuda/residual.cu (nmt__cuda_ln_half_fwd / _bwd, cuda/half_scratch.cuh) without the residual
 * and the dropout: a warp per row with 16-byte vectors where C % 8 == 0, C <= 1024 and the
 * rows are 16-byte aligned, else a block per row; dgamma / dbeta from per-block column
 * partials on the warp path (no float atomics, block order), this file's column-sum kernels
 * on the other. ---- */

// out: (M,C) half; inp: (M,C) fp32; mean, rstd: (M) or NULL; gamma, beta: (C)
nmt_status nmt_cuda_layernorm_half_fwd(void *ctx, nmt_act *out, float *mean, float *rstd,
                                       const float *inp, const float *gamma, const float *beta,
                                       int M, int C, float eps) {
  NMT_TRY(nmt__cuda_enter(ctx, "layernorm_half_fwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (M < 0 || C < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda layernorm_half_fwd: bad shape M=%d C=%d", M, C);
  NMT_TRY(nmt__cuda_half_op_check(c, "layernorm_half_fwd"));
  if (M > 0 && (!out || !inp || !gamma || !beta))
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda layernorm_half_fwd: NULL out, inp, gamma or beta");
  return nmt__cuda_ln_half_fwd(c, NULL, out, NULL, mean, rstd, inp, NULL, gamma, beta, M, C, eps,
                               0.0f, 0, 0);
}

// dinp: (M,C) fp32, = or += (accumulate); dinp_h: (M,C) half or NULL; dout, inp: (M,C) fp32
nmt_status nmt_cuda_layernorm_half_bwd(void *ctx, float *dinp, int accumulate, nmt_act *dinp_h,
                                       float *dgamma, float *dbeta, const float *dout,
                                       const float *inp, const float *gamma, const float *mean,
                                       const float *rstd, int M, int C) {
  NMT_TRY(nmt__cuda_enter(ctx, "layernorm_half_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (M < 0 || C < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda layernorm_half_bwd: bad shape M=%d C=%d", M, C);
  if (dinp_h && !dinp)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda layernorm_half_bwd: dinp_h without dinp");
  NMT_TRY(nmt__cuda_half_op_check(c, "layernorm_half_bwd"));
  return nmt__cuda_ln_half_bwd(c, dinp, accumulate != 0, dinp_h, NMT_CUDA_LN_DH_DINP, dgamma,
                               dbeta, dout, inp, gamma, mean, rstd, M, C, 0.0f, 0, 0);
}
