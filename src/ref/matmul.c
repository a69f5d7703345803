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
  nmt__ref_count_cast(ctx, 1); /* the GPU's cast kernel of this matrix */
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

/* ---- the half-storage path (nmt/backend.h linear_half_fwd / linear_half_bwd) ---- */

/* The half-type values of the fp32 master tensor x (n floats) into r: decoded from the
 * registered half copy when it covers x (the GPU reads that slice), else rounded here (the
 * GPU casts it: counted). */
static void half_values(void *ctx, int bf16, float *r, const float *x, size_t n) {
  const uint16_t *h = nmt__ref_half_copy(ctx, x, n);
  if (h) {
    nmt_half_decode_array(bf16, r, h, n);
    return;
  }
  if (bf16) nmt_half_round_bf16_array(r, x, n);
  else nmt_half_round_fp16_array(r, x, n);
  nmt__ref_count_cast(ctx, 1);
}

// out: batch x (M,N) half at out + b*out_stride; inp: (M,K) half; w: (N,K) and bias: (N) fp32
// at + b*param_stride
nmt_status nmt_ref_linear_half_fwd(void *ctx, nmt_act *out, const nmt_act *inp, const float *w,
                                   const float *bias, int M, int K, int N, int relu,
                                   uint8_t *relu_mask, int *mask_written, int batch,
                                   size_t param_stride, size_t out_stride) {
  (void)relu_mask; /* the reference keeps no mask: linear_half_bwd reads relu_out */
  if (mask_written) *mask_written = 0;
  if (M < 0 || K < 0 || N < 0 || batch < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref linear_half_fwd: bad shape M=%d K=%d N=%d batch=%d",
                      M, K, N, batch);
  if (batch > 1 && out_stride < (size_t)M * N)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref linear_half_fwd: out_stride %zu under M*N = %zu: the batch's outputs "
                      "would overlap", out_stride, (size_t)M * N);
  int bf16;
  NMT_TRY(nmt__ref_half_mode(ctx, "linear_half_fwd", &bf16));
  if (M == 0 || N == 0) return NMT_OK;
  const size_t mk = (size_t)M * K, nk = (size_t)N * K, mn = (size_t)M * N;
  float *a = NULL, *wf = NULL, *o;
  if (K > 0) {
    NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_GEMM_A, mk, &a));
    NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_GEMM_W, nk, &wf));
    nmt_half_decode_array(bf16, a, inp, mk);
  }
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_GEMM_OUT, mn, &o));
  for (int b = 0; b < batch; b++) {
    if (K > 0) {
      half_values(ctx, bf16, wf, w + (size_t)b * param_stride, nk);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, a, K, wf, K, 0.0f, o,
                  N);
    } else {
      memset(o, 0, mn * sizeof(float));
    }
    /* The bias's half values, from the copy (or rounded: a cast), added once to the sums. */
    const float *bb = bias ? bias + (size_t)b * param_stride : NULL;
    const uint16_t *bh = bb ? nmt__ref_half_copy(ctx, bb, (size_t)N) : NULL;
    if (bb && !bh) nmt__ref_count_cast(ctx, 1);
    for (int m = 0; m < M; m++) {
      float *row = o + (size_t)m * N;
      if (bb)
        for (int n = 0; n < N; n++)
          row[n] += bh ? (bf16 ? nmt_half_bf16_value(bh[n]) : nmt_half_fp16_value(bh[n]))
                       : (bf16 ? nmt_half_round_bf16(bb[n]) : nmt_half_round_fp16(bb[n]));
      if (relu)
        for (int n = 0; n < N; n++) row[n] = row[n] > 0.0f ? row[n] : 0.0f;
    }
    nmt_half_encode_array(bf16, out + (size_t)b * out_stride, o, mn);
  }
  if (K > 0) nmt__ref_count_gemm(ctx, 1); /* one logical (batched) call, as matmul_fwd */
  return NMT_OK;
}

// dinp: (M,K) half or fp32 by dinp_mode; dw: (N,K) +=; dbias: (N) +=; dout: (M,N) half;
// inp: (M,K) half; w: (N,K) fp32; relu_out: (M,K) half or NULL
nmt_status nmt_ref_linear_half_bwd(void *ctx, void *dinp, nmt_dinp_mode dinp_mode, float *dw,
                                   float *dbias, const nmt_act *dout, const nmt_act *inp,
                                   const float *w, const nmt_act *relu_out,
                                   const uint8_t *relu_mask, float relu_scale, int M, int K,
                                   int N) {
  (void)relu_mask; /* the same result as relu_out's: v(relu_out) > 0 is read instead */
  if (M < 0 || K < 0 || N < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref linear_half_bwd: bad shape M=%d K=%d N=%d", M, K, N);
  if (dinp_mode != NMT_DINP_HALF && dinp_mode != NMT_DINP_F32 && dinp_mode != NMT_DINP_F32_ADD)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref linear_half_bwd: unknown dinp mode %d",
                      (int)dinp_mode);
  if (relu_out && dinp_mode != NMT_DINP_HALF)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref linear_half_bwd: a ReLU backward (relu_out) needs a half dinp");
  int bf16;
  NMT_TRY(nmt__ref_half_mode(ctx, "linear_half_bwd", &bf16));
  if (M == 0 || N == 0) {
    /* Nothing flows back: a written dinp is zeros. */
    if (dinp && M > 0 && K > 0) {
      if (dinp_mode == NMT_DINP_HALF) memset(dinp, 0, (size_t)M * K * sizeof(nmt_act));
      else if (dinp_mode == NMT_DINP_F32) memset(dinp, 0, (size_t)M * K * sizeof(float));
    }
    return NMT_OK;
  }
  const size_t mk = (size_t)M * K, nk = (size_t)N * K, mn = (size_t)M * N;
  float *g;
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_GEMM_A, mn, &g));
  nmt_half_decode_array(bf16, g, dout, mn);
  if (K > 0 && dinp) {
    float *wf;
    NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_GEMM_W, nk, &wf));
    half_values(ctx, bf16, wf, w, nk);
    if (dinp_mode == NMT_DINP_HALF) {
      float *o;
      NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_GEMM_OUT, mk, &o));
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, K, N, 1.0f, g, N, wf, K, 0.0f, o,
                  K);
      nmt_act *d = dinp;
      nmt_half_encode_array(bf16, d, o, mk);
      if (relu_out) {
        /* round(round(acc) * scale) on the kept-and-active set, 0 elsewhere. */
        for (size_t i = 0; i < mk; i++) {
          const float r = bf16 ? nmt_half_bf16_value(relu_out[i]) : nmt_half_fp16_value(relu_out[i]);
          if (!(r > 0.0f)) {
            d[i] = 0;
          } else if (relu_scale != 1.0f) {
            const float v = bf16 ? nmt_half_bf16_value(d[i]) : nmt_half_fp16_value(d[i]);
            d[i] = bf16 ? nmt_half_bf16_bits(v * relu_scale) : nmt_half_fp16_bits(v * relu_scale);
          }
        }
      }
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, K, N, 1.0f, g, N, wf, K,
                  dinp_mode == NMT_DINP_F32_ADD ? 1.0f : 0.0f, dinp, K);
    }
    nmt__ref_count_gemm(ctx, 1);
  }
  if (K > 0 && dw) {
    float *a;
    NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_GEMM_B, mk, &a));
    nmt_half_decode_array(bf16, a, inp, mk);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, N, K, M, 1.0f, g, N, a, K, 1.0f, dw, K);
    nmt__ref_count_gemm(ctx, 1);
  }
  /* The bias gradient rides on the dw GEMM on the GPU (no call of its own). */
  if (dbias)
    for (int m = 0; m < M; m++) {
      const float *r = g + (size_t)m * N;
      for (int n = 0; n < N; n++) dbias[n] += r[n];
    }
  return NMT_OK;
}
