/* ref/matmul.c — the linear layer y = x W^T + b (torch.nn.Linear layout) via OpenBLAS sgemm, its
 * ReLU-fused variant (the FFN's first layer: matmul then relu, as two calls), and the fp16/bf16
 * emulation of its GEMMs: inputs rounded to the half type (nmt_ref_round_fp16 /
 * nmt_ref_round_bf16, below), then the same fp32 sgemm. A product of two halves is exact in
 * fp32 (11 + 11 or 8 + 8 significant bits <= 24), so a fused multiply-add in the BLAS kernel
 * and a separate multiply and add give the same sums: the result is a half-input GEMM with fp32
 * accumulation, as cuBLASLt computes it with CUBLAS_COMPUTE_32F (cuda/matmul.cu).
 *
 * The half working copy of the weights (nmt/backend.h half_weights) is kept as the 16-bit
 * patterns a GPU would hold, and a weight found in it is DECODED from those bits rather than
 * rounded from its fp32 master: a copy the engine forgot to refresh then gives wrong numbers
 * on the CPU as it would on the GPU, so the CPU tests catch it. */
#include <cblas.h>
#include <stdint.h>
#include <string.h>

#include "nmt/ref.h"

static uint32_t bits_of(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

static float float_of(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

/* Integer arithmetic on the float's bits, so the result does not depend on the FPU's rounding
 * mode or on flush-to-zero settings. */
float nmt_ref_round_fp16(float x) {
  const uint32_t u = bits_of(x), sign = u & 0x80000000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return x;                         /* NaN stays NaN */
  if (a >= 0x477ff000u) return float_of(sign | 0x7f800000u); /* |x| >= 65520 (inf too): inf */
  if (a >= 0x38800000u) {
    /* Normal half (|x| >= 2^-14): keep 10 of the 23 fraction bits, ties to even. A carry out
     * of the fraction correctly bumps the exponent; below 65520 it never reaches 2^16. */
    return float_of(sign | ((a + 0xfffu + ((a >> 13) & 1u)) & ~0x1fffu));
  }
  /* Subnormal half: the nearest multiple of 2^-24. |x| = m * 2^(e-150) with the implicit bit
   * in m, so |x| / 2^-24 = m >> s with s = 126 - e >= 14. s >= 25 leaves less than a quarter:
   * 0 (float subnormals, e = 0, are far below too). */
  const uint32_t e = a >> 23;
  if (e < 102) return float_of(sign);
  const uint32_t m = (a & 0x7fffffu) | 0x800000u, s = 126u - e;
  uint32_t q = m >> s;
  const uint32_t rem = m & ((1u << s) - 1u), half = 1u << (s - 1u);
  if (rem > half || (rem == half && (q & 1u))) q++;
  /* q <= 1024 (2^-14, the smallest normal half, when rounding up): exact in float. */
  return float_of(sign | bits_of((float)q * 0x1p-24f));
}

float nmt_ref_round_bf16(float x) {
  const uint32_t u = bits_of(x);
  /* Without this, a NaN whose payload is only in the low bits would round to inf. */
  if ((u & 0x7fffffffu) > 0x7f800000u) return x;
  /* Ties to even on bit 16; a carry into the exponent is right (up to inf near FLT_MAX) and
   * never reaches the sign bit. */
  return float_of((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

/* The float value r = nmt_ref_round_fp16(x) is a half, so its binary16 fields are fields of
 * r's float encoding: exponent rebiased from 127 to 15, the top 10 fraction bits (the low 13
 * are zero after the rounding), or for a subnormal half the multiple of 2^-24. */
uint16_t nmt_ref_fp16_bits(float x) {
  const uint32_t u = bits_of(nmt_ref_round_fp16(x)), sign = (u >> 16) & 0x8000u,
                 a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fffu; /* the canonical NaN __float2half_rn returns */
  if (a == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
  if (a >= 0x38800000u) return (uint16_t)(sign | (((a >> 23) - 112u) << 10) | ((a >> 13) & 0x3ffu));
  return (uint16_t)(sign | (uint32_t)(float_of(a) * 0x1p24f)); /* exact: q < 1024 */
}

float nmt_ref_fp16_value(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 31) return float_of(sign | 0x7f800000u | (m << 13)); /* inf, or NaN when m != 0 */
  if (e == 0) return float_of(sign | bits_of((float)m * 0x1p-24f));
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t nmt_ref_bf16_bits(float x) {
  if ((bits_of(x) & 0x7fffffffu) > 0x7f800000u) return 0x7fffu; /* as __float2bfloat16_rn */
  return (uint16_t)(bits_of(nmt_ref_round_bf16(x)) >> 16);
}

float nmt_ref_bf16_value(uint16_t h) { return float_of((uint32_t)h << 16); }

void nmt_ref_round_fp16_array(float *out, const float *x, size_t n) {
  for (size_t i = 0; i < n; i++) out[i] = nmt_ref_round_fp16(x[i]);
}

void nmt_ref_round_bf16_array(float *out, const float *x, size_t n) {
  for (size_t i = 0; i < n; i++) out[i] = nmt_ref_round_bf16(x[i]);
}

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
  if (mode == NMT_PRECISION_FP16) nmt_ref_round_fp16_array(r, x, n);
  else nmt_ref_round_bf16_array(r, x, n);
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
    for (size_t i = 0; i < n; i++) r[i] = nmt_ref_fp16_value(h[i]);
  else
    for (size_t i = 0; i < n; i++) r[i] = nmt_ref_bf16_value(h[i]);
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
    for (size_t i = 0; i < n; i++) o[i] = nmt_ref_fp16_bits(src[i]);
  else
    for (size_t i = 0; i < n; i++) o[i] = nmt_ref_bf16_bits(src[i]);
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
  NMT_TRY(weight_input(ctx, mode, NMT_REF_SLOT_GEMM_W, w, (size_t)N * K, &b));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, a, K, b, K,
              bias ? 1.0f : 0.0f, out, N);
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
