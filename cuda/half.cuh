/* cuda/half.cuh — the half-storage path's element types on the device (not a public header):
 * nmt_act (nmt/backend.h, uint16_t bits) is read and written as __half in fp16 mode and
 * __nv_bfloat16 in bf16 mode. Kernels of that path are templates on the element type T
 * (__half or __nv_bfloat16) and convert with the two functions below, which are exactly
 * the reference's rounding (nmt/half.h: round to nearest even; fp16 keeps subnormals and turns
 * |x| >= 65520 into +-inf; NaN stays NaN) and its decoding (exact). A launcher picks T from the
 * context's precision with nmt__cuda_half_bf16.
 *
 * Vector access: 16 bytes = 8 elements per load/store (nmt__half8), for rows whose length is a
 * multiple of 8 and whose base is 16-byte aligned (nmt__half_vec_ok); kernels keep a scalar
 * path for the rest.
 *
 * defines: nmt__half_to_float, nmt__float_to_half, nmt__half8, nmt__half_vec_ok,
 *          nmt__cuda_half_bf16, nmt__cuda_half_mode
 */
#ifndef NMT_CUDA_HALF_CUH
#define NMT_CUDA_HALF_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stddef.h>
#include <stdint.h>

#include "common.cuh"

/* 1 when the context's half type is bfloat16 (bf16 mode), 0 for fp16; the caller has checked
 * that the context is in one of the two. */
static inline int nmt__cuda_half_bf16(const nmt_cuda_ctx *c) {
  return c->precision == NMT_PRECISION_BF16;
}

/* 1 when the context computes in fp16 or bf16 (the half-storage ops need it). */
static inline int nmt__cuda_half_mode(const nmt_cuda_ctx *c) {
  return c->precision == NMT_PRECISION_FP16 || c->precision == NMT_PRECISION_BF16;
}

/* 1 when p is 16-byte aligned and n (elements of 2 bytes) a multiple of 8: 16-byte vectors. */
static inline int nmt__half_vec_ok(const void *p, size_t n) {
  return ((uintptr_t)p & 15) == 0 && n % 8 == 0;
}

#ifdef __CUDACC__

__device__ __forceinline__ float nmt__half_to_float(__half h) { return __half2float(h); }
__device__ __forceinline__ float nmt__half_to_float(__nv_bfloat16 h) {
  return __bfloat162float(h);
}

/* The nearest T to x (round to nearest even), as __float2half_rn / __float2bfloat16_rn. */
template <typename T>
__device__ __forceinline__ T nmt__float_to_half(float x);
template <>
__device__ __forceinline__ __half nmt__float_to_half<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 nmt__float_to_half<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

/* Eight half elements moved as one 16-byte load or store. */
template <typename T>
struct __align__(16) nmt__half8 {
  T v[8];
};

#endif /* __CUDACC__ */
#endif /* NMT_CUDA_HALF_CUH */
