/* ref/matmul.c — the linear layer y = x W^T + b (torch.nn.Linear layout) via OpenBLAS sgemm. */
#include <cblas.h>
#include <string.h>

#include "nmt/ref.h"

// out: (M,N); inp: (M,K); w: (N,K); bias: (N) or NULL
nmt_status nmt_ref_matmul_fwd(void *ctx, float *out, const float *inp, const float *w,
                              const float *bias, int M, int K, int N) {
  (void)ctx;
  if (M < 0 || K < 0 || N < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref matmul_fwd: bad shape M=%d K=%d N=%d", M, K, N);
  if (M == 0 || N == 0) return NMT_OK;
  /* The bias is broadcast into out first so the GEMM adds onto it (beta = 1). */
  if (bias) {
    for (int m = 0; m < M; m++) memcpy(out + (size_t)m * N, bias, (size_t)N * sizeof(float));
  } else if (K == 0) {
    memset(out, 0, (size_t)M * N * sizeof(float));
  }
  if (K == 0) return NMT_OK;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, inp, K, w, K,
              bias ? 1.0f : 0.0f, out, N);
  return NMT_OK;
}

// dinp: (M,K) += dout @ w; dw: (N,K) += dout^T @ inp; dbias: (N) += sum over rows of dout
nmt_status nmt_ref_matmul_bwd(void *ctx, float *dinp, float *dw, float *dbias, const float *dout,
                              const float *inp, const float *w, int M, int K, int N) {
  (void)ctx;
  if (M < 0 || K < 0 || N < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref matmul_bwd: bad shape M=%d K=%d N=%d", M, K, N);
  if (M == 0 || N == 0) return NMT_OK;
  if (K > 0) {
    if (dinp)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, K, N, 1.0f, dout, N, w, K, 1.0f,
                  dinp, K);
    if (dw)
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, N, K, M, 1.0f, dout, N, inp, K, 1.0f,
                  dw, K);
  }
  if (dbias) {
    for (int m = 0; m < M; m++) {
      const float *g = dout + (size_t)m * N;
      for (int n = 0; n < N; n++) dbias[n] += g[n];
    }
  }
  return NMT_OK;
}
