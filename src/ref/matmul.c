/* ref/matmul.c — the linear layer y = x W^T + b (torch.nn.Linear layout) via OpenBLAS sgemm, its
 * ReLU-fused variant (the FFN's first layer: matmul then relu, as two calls), and the fp16/bf16
 * emulation of its GEMMs: inputs rounded to the half type (nmt_half_round_fp16 /
 * nmt_half_round_bf16, src/util/half.c), then the same fp32 sgemm. A product of two halves is exact in
 * fp32 (11 + 11 or 8 + 8 significant bits <= 24), so a fused multiply-add in the BLAS kernel
 * and a separate multiply and add give the same sums: the result is a half-input GEMM with fp32
 * accumulation, as cuBLASLt computes it with CUBLAS_COMPUTE_32F (cuda/matmul.cu).
 *
 * An inference context's weights (nmt/backend.h infer_weights) are read transposed, (K, N),
 * by a NoTrans x NoTrans sgemm: OpenBLAS then packs them with a plain copy instead of a
 * transpose (decoding pays the pack once per call for few rows).
 *
 * The half working copy of the weights (nmt/backend.h half_weights) is kept as the 16-bit
 * patterns a GPU would hold, and a weight found in it is DECODED from those bits rather than
 * rounded from its fp32 master: a copy the engine forgot to refresh then gives wrong numbers
 * on the CPU as it would on the GPU, so the CPU tests catch it. */
#include <cblas.h>
#include <stdint.h>
#include <string.h>

#include "nmt/half.h"
#include "nmt/ref.h"

/* x (n floats) as the GEMM sees it: itself in fp32/tf32 mode (no copy), else a rounded copy in
 * scratch `slot` of ctx. */
static nmt_status gemm_input(void *ctx, nmt_precision mode, int slot, const float *x, size_t n,
                             const float **out) {
  if (mode != NMT_PRECISION_FP16 && mode != NMT_PRECISION_BF16) {
    *out = x;
    return NMT_OK;
  }
  float *r;
  NMT_TRY(nmt__ref_scratch(ctx, slot, n, &r));
  if (mode == NMT_PRECISION_FP16) nmt_half_round_fp16_array(r, x, n);
  else nmt_half_round_bf16_array(r, x, n);
  *out = r;
  return NMT_OK;
}

/* The weight w (n floats) as the GEMM sees it: in fp16/bf16 mode, when a registered half copy
 * covers it, the values decoded from that copy's bits (bitwise the rounding of w while the copy
 * is current); otherwise gemm_input's. */
static nmt_status weight_input(void *ctx, nmt_precision mode, int slot, const float *w, size_t n,
                               const float **out) {
  const uint16_t *h = NULL;
  if (mode == NMT_PRECISION_FP16 || mode == NMT_PRECISION_BF16) h = nmt__ref_half_copy(ctx, w, n);
  if (!h) return gemm_input(ctx, mode, slot, w, n, out);
  float *r;
  NMT_TRY(nmt__ref_scratch(ctx, slot, n, &r));
  if (mode == NMT_PRECISION_FP16)
    for (size_t i = 0; i < n; i++) r[i] = nmt_half_fp16_value(h[i]);
  else
    for (size_t i = 0; i < n; i++) r[i] = nmt_half_bf16_value(h[i]);
  *out = r;
  return NMT_OK;
}

nmt_status nmt_ref_cast_half(void *ctx, void *dst, const float *src, size_t n) {
  nmt_precision mode;
  NMT_TRY(nmt__ref_gemm_precision(ctx, "cast_half", &mode));
  if (mode != NMT_PRECISION_FP16 && mode != NMT_PRECISION_BF16)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref cast_half: the context's precision has no half type (fp16/bf16 only)");
  if (n == 0) return NMT_OK;
  if (!dst || !src) return nmt_errorf(NMT_ERR_INTERNAL, "ref cast_half: NULL pointer");
  uint16_t *o = dst;
  if (mode == NMT_PRECISION_FP16)
    for (size_t i = 0; i < n; i++) o[i] = nmt_half_fp16_bits(src[i]);
  else
    for (size_t i = 0; i < n; i++) o[i] = nmt_half_bf16_bits(src[i]);
  return NMT_OK;
}

// out: (M,N); inp: (M,K); w: (N,K); bias: (N) or NULL
nmt_status nmt_ref_matmul_fwd(void *ctx, float *out, const float *inp, const float *w,
                              const float *bias, int M, int K, int N) {
  if (M < 0 || K < 0 || N < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref matmul_fwd: bad shape M=%d K=%d N=%d", M, K, N);
  nmt_precision mode;
  NMT_TRY(nmt__ref_gemm_precision(ctx, "matmul_fwd", &mode));
  if (M == 0 || N == 0) return NMT_OK;
  /* The bias is broadcast into out first so the GEMM adds onto it (beta = 1); it stays fp32 in
   * every mode. */
  if (bias) {
    for (int m = 0; m < M; m++) memcpy(out + (size_t)m * N, bias, (size_t)N * sizeof(float));
  } else if (K == 0) {
    memset(out, 0, (size_t)M * N * sizeof(float));
  }
  if (K == 0) return NMT_OK;
  const float *a, *b;
  NMT_TRY(gemm_input(ctx, mode, NMT_REF_SLOT_GEMM_A, inp, (size_t)M * K, &a));
  /* The weight as W (N, K), read transposed; or, in an inference context, its copy W^T
   * (K, N), made once (nmt/backend.h infer_weights: fp32/tf32 only, where w is read as it is;
   * fp16/bf16 read the half copy). */
  const float *wt = mode == NMT_PRECISION_FP32 || mode == NMT_PRECISION_TF32
                        ? nmt__ref_infer_copy(ctx, w, N, K)
                        : NULL;
  if (wt) b = wt;
  else NMT_TRY(weight_input(ctx, mode, NMT_REF_SLOT_GEMM_W, w, (size_t)N * K, &b));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, wt ? CblasNoTrans : CblasTrans, M, N, K, 1.0f, a, K,
              b, wt ? N : K, bias ? 1.0f : 0.0f, out, N);
  nmt__ref_count_gemm(ctx, 1);
  return NMT_OK;
}

// out: (M,N) = relu(inp @ w^T + bias); inp: (M,K); w: (N,K); bias: (N) or NULL
nmt_status nmt_ref_matmul_bias_relu_fwd(void *ctx, float *out, const float *inp, const float *w,
                                        const float *bias, int M, int K, int N) {
  /* The two ops, unchanged, so the CPU trains bitwise as before the CUDA backend fused them. */
  NMT_TRY(nmt_ref_matmul_fwd(ctx, out, inp, w, bias, M, K, N));
  return nmt_ref_relu_fwd(ctx, out, out, (size_t)M * (size_t)N);
}

// dinp: (M,K) += dout @ w; dw: (N,K) += dout^T @ inp; dbias: (N) += sum over rows of dout
nmt_status nmt_ref_matmul_bwd(void *ctx, float *dinp, float *dw, float *dbias, const float *dout,
                              const float *inp, const float *w, int M, int K, int N) {
  if (M < 0 || K < 0 || N < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref matmul_bwd: bad shape M=%d K=%d N=%d", M, K, N);
  nmt_precision mode;
  NMT_TRY(nmt__ref_gemm_precision(ctx, "matmul_bwd", &mode));
  if (M == 0 || N == 0) return NMT_OK;
  if (K > 0 && (dinp || dw)) {
    const float *g;
    NMT_TRY(gemm_input(ctx, mode, NMT_REF_SLOT_GEMM_A, dout, (size_t)M * N, &g));
    if (dinp) {
      const float *b;
      NMT_TRY(weight_input(ctx, mode, NMT_REF_SLOT_GEMM_W, w, (size_t)N * K, &b));
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, K, N, 1.0f, g, N, b, K, 1.0f,
                  dinp, K);
      nmt__ref_count_gemm(ctx, 1);
    }
    if (dw) {
      const float *a;
      NMT_TRY(gemm_input(ctx, mode, NMT_REF_SLOT_GEMM_B, inp, (size_t)M * K, &a));
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, N, K, M, 1.0f, g, N, a, K, 1.0f, dw,
                  K);
      nmt__ref_count_gemm(ctx, 1);
    }
  }
  /* The bias gradient is not a GEMM: fp32 sums of the unrounded dout in every mode (the CUDA
   * backend's fp32 GEMV with a ones vector sums the same values, and is counted as the GEMM
   * call it is there). */
  if (dbias) {
    nmt__ref_count_gemm(ctx, 1);
    for (int m = 0; m < M; m++) {
      const float *g = dout + (size_t)m * N;
      for (int n = 0; n < N; n++) dbias[n] += g[n];
    }
  }
  return NMT_OK;
}

/* ---- STUB: the half-storage ops, to be implemented ---- */
nmt_status nmt_ref_linear_half_fwd(void *ctx, nmt_act *out, const nmt_act *inp, const float *w, const float *bias, int M, int K, int N, int relu, uint8_t *relu_mask, int *mask_written, int batch, size_t param_stride, size_t out_stride) {
  (void)ctx; (void)out; (void)inp; (void)w; (void)bias; (void)M; (void)K; (void)N; (void)relu; (void)relu_mask; (void)mask_written; (void)batch; (void)param_stride; (void)out_stride;
  return nmt_errorf(NMT_ERR_INTERNAL, "ref linear_half_fwd: not implemented yet");
}

nmt_status nmt_ref_linear_half_bwd(void *ctx, void *dinp, nmt_dinp_mode dinp_mode, float *dw, float *dbias, const nmt_act *dout, const nmt_act *inp, const float *w, const nmt_act *relu_out, const uint8_t *relu_mask, float relu_scale, int M, int K, int N) {
  (void)ctx; (void)dinp; (void)dinp_mode; (void)dw; (void)dbias; (void)dout; (void)inp; (void)w; (void)relu_out; (void)relu_mask; (void)relu_scale; (void)M; (void)K; (void)N;
  return nmt_errorf(NMT_ERR_INTERNAL, "ref linear_half_bwd: not implemented yet");
}
