/* nmt/half.h — IEEE binary16 (fp16) and bfloat16 on the CPU: the nearest half to a float,
 * its 16-bit pattern and its value (src/util/half.c). Integer arithmetic on the float's bits,
 * so the results do not depend on the FPU's rounding mode or flush-to-zero settings.
 *
 * Below the backends and the communicators: the reference backend rounds its fp16/bf16 GEMM
 * inputs and writes its half weight copy with these (src/ref/matmul.c, adamw.c), and the host
 * and Gloo communicators round their half wires with them (src/comm/), so that every CPU
 * computation of a half is one definition, which the CUDA backend is tested against.
 *
 * defines: nmt_half_round_fp16, nmt_half_round_bf16, nmt_half_round_fp16_array,
 *          nmt_half_round_bf16_array, nmt_half_fp16_bits, nmt_half_bf16_bits,
 *          nmt_half_fp16_value, nmt_half_bf16_value, nmt_half_encode_array,
 *          nmt_half_decode_array
 */
#ifndef NMT_HALF_H
#define NMT_HALF_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The value of the nearest IEEE binary16 (fp16) to x, as a float: round to nearest, ties to
 * even, exactly a float -> half conversion (__float2half_rn, F16C vcvtps2ph) read back as
 * float. Subnormal halves (multiples of 2^-24) are kept, |x| < 2^-25 (and 2^-25 itself, a tie
 * to even) becomes a signed 0, |x| >= 65520 becomes +-inf (65504 is the largest half; 65520 is
 * the tie with 2^16 and goes to even, i.e. overflows), inf stays inf, NaN stays NaN. */
float nmt_half_round_fp16(float x);
/* The value of the nearest bfloat16 to x (the top 16 bits of the float, round to nearest, ties
 * to even, as __float2bfloat16_rn): 8 significant bits, fp32's exponent range (subnormals
 * kept, only values within half a bf16 ulp of FLT_MAX or above become inf), NaN stays NaN. */
float nmt_half_round_bf16(float x);
/* out[i] = nmt_half_round_fp16(x[i]) / nmt_half_round_bf16(x[i]) for i < n; out may equal x. */
void nmt_half_round_fp16_array(float *out, const float *x, size_t n);
void nmt_half_round_bf16_array(float *out, const float *x, size_t n);
/* The 16-bit patterns of those roundings, as __float2half_rn / __float2bfloat16_rn store them:
 * nmt_half_fp16_bits(x) is the IEEE binary16 encoding of nmt_half_round_fp16(x) (sign, 5-bit
 * exponent biased by 15, 10-bit fraction; subnormals with exponent 0), nmt_half_bf16_bits(x)
 * the top 16 bits of nmt_half_round_bf16(x); a NaN becomes the canonical 0x7fff in both (the
 * CUDA toolkit's choice; the payload and sign are not kept). The _value functions decode:
 * nmt_half_fp16_value(nmt_half_fp16_bits(x)) == nmt_half_round_fp16(x) bitwise for every non-NaN
 * x (likewise bf16), NaN for NaN. */
/* Arrays of bit patterns: out[i] = the bf16 (bf16 != 0) or fp16 bits of in[i]
 * (nmt_half_*_bits), and back: out[i] = nmt_half_*_value(in[i]). out may not overlap in. */
void nmt_half_encode_array(int bf16, uint16_t *out, const float *in, size_t n);
void nmt_half_decode_array(int bf16, float *out, const uint16_t *in, size_t n);
uint16_t nmt_half_fp16_bits(float x);
uint16_t nmt_half_bf16_bits(float x);
float nmt_half_fp16_value(uint16_t h);
float nmt_half_bf16_value(uint16_t h);

#ifdef __cplusplus
}
#endif
#endif /* NMT_HALF_H */
