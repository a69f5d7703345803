/* half.c — IEEE binary16 (fp16) and bfloat16 as the CPU computes them (include/nmt/half.h):
 * rounding a float to the nearest half, the 16-bit patterns, and their values. The reference
 * backend's fp16/bf16 GEMM emulation and half weight copy, and the host and Gloo
 * communicators' half wires all round here, so the CPU's halves are one definition (the CUDA
 * kernels' __float2half_rn / __float2bfloat16_rn are tested against it). */
#include "nmt/half.h"

#include <string.h>

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
float nmt_half_round_fp16(float x) {
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

float nmt_half_round_bf16(float x) {
  const uint32_t u = bits_of(x);
  /* Without this, a NaN whose payload is only in the low bits would round to inf. */
  if ((u & 0x7fffffffu) > 0x7f800000u) return x;
  /* Ties to even on bit 16; a carry into the exponent is right (up to inf near FLT_MAX) and
   * never reaches the sign bit. */
  return float_of((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

/* The float value r = nmt_half_round_fp16(x) is a half, so its binary16 fields are fields of
 * r's float encoding: exponent rebiased from 127 to 15, the top 10 fraction bits (the low 13
 * are zero after the rounding), or for a subnormal half the multiple of 2^-24. */
uint16_t nmt_half_fp16_bits(float x) {
  const uint32_t u = bits_of(nmt_half_round_fp16(x)), sign = (u >> 16) & 0x8000u,
                 a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fffu; /* the canonical NaN __float2half_rn returns */
  if (a == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
  if (a >= 0x38800000u) return (uint16_t)(sign | (((a >> 23) - 112u) << 10) | ((a >> 13) & 0x3ffu));
  return (uint16_t)(sign | (uint32_t)(float_of(a) * 0x1p24f)); /* exact: q < 1024 */
}

float nmt_half_fp16_value(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 31) return float_of(sign | 0x7f800000u | (m << 13)); /* inf, or NaN when m != 0 */
  if (e == 0) return float_of(sign | bits_of((float)m * 0x1p-24f));
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t nmt_half_bf16_bits(float x) {
  if ((bits_of(x) & 0x7fffffffu) > 0x7f800000u) return 0x7fffu; /* as __float2bfloat16_rn */
  return (uint16_t)(bits_of(nmt_half_round_bf16(x)) >> 16);
}

float nmt_half_bf16_value(uint16_t h) { return float_of((uint32_t)h << 16); }

void nmt_half_round_fp16_array(float *out, const float *x, size_t n) {
  for (size_t i = 0; i < n; i++) out[i] = nmt_half_round_fp16(x[i]);
}

void nmt_half_round_bf16_array(float *out, const float *x, size_t n) {
  for (size_t i = 0; i < n; i++) out[i] = nmt_half_round_bf16(x[i]);
}

void nmt_half_encode_array(int bf16, uint16_t *out, const float *in, size_t n) {
  if (bf16)
    for (size_t i = 0; i < n; i++) out[i] = nmt_half_bf16_bits(in[i]);
  else
    for (size_t i = 0; i < n; i++) out[i] = nmt_half_fp16_bits(in[i]);
}

void nmt_half_decode_array(int bf16, float *out, const uint16_t *in, size_t n) {
  if (bf16)
    for (size_t i = 0; i < n; i++) out[i] = nmt_half_bf16_value(in[i]);
  else
    for (size_t i = 0; i < n; i++) out[i] = nmt_half_fp16_value(in[i]);
}
