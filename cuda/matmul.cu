/* cuda/matmul.cu — the linear layer y = x W^T + b (torch.nn.Linear layout) on cuBLASLt.
 *
 * cuBLASLt is column-major; a row-major (R, S) matrix is the column-major (S, R) matrix with
 * the same leading dimension, i.e. its transpose. So with x_c = x^T, W_c = W^T, y_c = y^T:
 *   forward   y_c (N x M)  = W_c^T (N x K) . x_c (K x M)                 + bias
 *   dinp      dx_c (K x M) += W_c (K x N) . dy_c (N x M)
 *   dw        dW_c (K x N) += x_c (K x M) . dy_c^T (M x N)
 *   dbias     db (N x 1)   += dy_c (N x M) . ones (M x 1)      (GEMV: deterministic, fp32)
 * The bias is broadcast into y first and the GEMM adds onto it (beta = 1), as the reference
 * does. */
#include "common.cuh"

// out: (M,N) <- bias (N) broadcast over rows
static __global__ void broadcast_rows(float *out, const float *bias, size_t rows, int N) {
  const size_t n = rows * (size_t)N;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = bias[i % (size_t)N];
}

// out: (M,N); inp: (M,K); w: (N,K); bias: (N) or NULL
nmt_status nmt_cuda_matmul_fwd(void *ctx, float *out, const float *inp, const float *w,
                               const float *bias, int M, int K, int N) {
  NMT_TRY(nmt__cuda_enter(ctx, "matmul_fwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (M < 0 || K < 0 || N < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda matmul_fwd: bad shape M=%d K=%d N=%d", M, K, N);
  if (M == 0 || N == 0) return NMT_OK;
  const size_t n = (size_t)M * (size_t)N;
  if (bias) {
    broadcast_rows<<<nmt__grid(n, 256), 256, 0, c->stream>>>(out, bias, (size_t)M, N);
    NMT_CUDA_LAUNCH_CHECK("broadcast_rows");
  } else if (K == 0) {
    NMT_CUDA_TRY(cudaMemsetAsync(out, 0, n * sizeof(float), c->stream));
  }
  if (K == 0) return NMT_OK;
  return nmt__cuda_gemm(c, 1, 0, N, M, K, 1.0f, w, K, 0, inp, K, 0, bias ? 1.0f : 0.0f, out, N,
                        0, 1, 1);
}

// dinp: (M,K) += dout @ w; dw: (N,K) += dout^T @ inp; dbias: (N) += sum over rows of dout
nmt_status nmt_cuda_matmul_bwd(void *ctx, float *dinp, float *dw, float *dbias, const float *dout,
                               const float *inp, const float *w, int M, int K, int N) {
  NMT_TRY(nmt__cuda_enter(ctx, "matmul_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (M < 0 || K < 0 || N < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda matmul_bwd: bad shape M=%d K=%d N=%d", M, K, N);
  if (M == 0 || N == 0) return NMT_OK;
  if (K > 0) {
    if (dinp) NMT_TRY(nmt__cuda_gemm(c, 0, 0, K, M, N, 1.0f, w, K, 0, dout, N, 0, 1.0f, dinp, K, 0, 1, 1));
    if (dw) NMT_TRY(nmt__cuda_gemm(c, 0, 1, K, N, M, 1.0f, inp, K, 0, dout, N, 0, 1.0f, dw, K, 0, 1, 1));
  }
  if (dbias) {
    const float *ones;
    NMT_TRY(nmt__cuda_ones(c, (size_t)M, &ones));
    NMT_TRY(nmt__cuda_gemm(c, 0, 0, N, 1, M, 1.0f, dout, N, 0, ones, M, 0, 1.0f, dbias, N, 0, 1, 0));
  }
  return NMT_OK;
}
