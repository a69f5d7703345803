/* cuda/dropout.cu — inverted dropout (Srivastava et al. 2014; Vaswani et al. 2017 §5.4) with
 * the counter-based mask of src/ref/dropout.c: element e is kept iff
 * nmt_rng_uniform(seed, stream, e) >= p, and a kept x becomes x * (1.0f / (1.0f - p)) in fp32,
 * so the output is bitwise the reference's. One thread per Philox block: its four words are
 * the masks of four consecutive elements. The half-storage op (dropout_half) at the end. */
#include <type_traits>

#include "common.cuh"
#include "half_scratch.cuh"

static nmt_status check_p(const char *op, float p) {
  if (!(p >= 0.0f && p < 1.0f))
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: dropout probability %g outside [0, 1)", op,
                      (double)p);
  return NMT_OK;
}

/* accumulate = 0: out[e] = keep ? inp[e] * scale : 0 (out may alias inp).
 * accumulate = 1: out[e] += keep ? inp[e] * scale : 0. */
static __global__ void dropout_kernel(float *out, const float *inp, size_t n, float p,
                                      float scale, uint64_t seed, uint64_t stream,
                                      int accumulate) {
  const size_t n_blk = (n + 3) / 4;
  for (size_t blk = (size_t)blockIdx.x * blockDim.x + threadIdx.x; blk < n_blk;
       blk += (size_t)gridDim.x * blockDim.x) {
    uint32_t w[4];
    nmt__rng_block(seed, stream, (uint64_t)blk, w);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const size_t e = blk * 4 + (size_t)j;
      if (e < n) {
        const float v = nmt__u32_uniform(w[j]) >= p ? __fmul_rn(inp[e], scale) : 0.0f;
        if (accumulate) out[e] += v;
        else out[e] = v;
      }
    }
  }
}
NMT_CUDA_PRELOAD(dropout_kernel);

static __global__ void add_into(float *dst, const float *src, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] += src[i];
}
NMT_CUDA_PRELOAD(add_into);

nmt_status nmt_cuda_dropout_fwd(void *ctx, float *out, const float *inp, size_t n, float p,
                                uint64_t seed, uint64_t stream) {
  NMT_TRY(nmt__cuda_enter(ctx, "dropout_fwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_p("dropout_fwd", p));
  if (n == 0) return NMT_OK;
  if (p == 0.0f) {
    if (out != inp)
      NMT_CUDA_TRY(cudaMemcpyAsync(out, inp, n * sizeof(float), cudaMemcpyDeviceToDevice,
                                   nmt__cuda_stream(c)));
    return NMT_OK;
  }
  const float scale = 1.0f / (1.0f - p);
  dropout_kernel<<<nmt__grid((n + 3) / 4, 256), 256, 0, nmt__cuda_stream(c)>>>(
      out, inp, n, p, scale, seed, stream, 0);
  NMT_CUDA_LAUNCH_CHECK("dropout_kernel");
  return NMT_OK;
}

nmt_status nmt_cuda_dropout_bwd(void *ctx, float *dinp, const float *dout, size_t n, float p,
                                uint64_t seed, uint64_t stream) {
  NMT_TRY(nmt__cuda_enter(ctx, "dropout_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_p("dropout_bwd", p));
  if (!dinp || n == 0) return NMT_OK;
  if (p == 0.0f) {
    add_into<<<nmt__grid(n, 256), 256, 0, nmt__cuda_stream(c)>>>(dinp, dout, n);
    NMT_CUDA_LAUNCH_CHECK("add_into");
    return NMT_OK;
  }
  const float scale = 1.0f / (1.0f - p);
  dropout_kernel<<<nmt__grid((n + 3) / 4, 256), 256, 0, nmt__cuda_stream(c)>>>(
      dinp, dout, n, p, scale, seed, stream, 1);
  NMT_CUDA_LAUNCH_CHECK("dropout_kernel");
  return NMT_OK;
}

/* ---- the half-storage path (nmt/backend.h dropout_half) ----
 * dropout_kernel's layout: one thread per Philox block of 4 elements, a grid-stride loop, the
 * same mask (element e kept iff uniform(seed, stream, e) >= p) and the same fp32 product
 * (__fmul_rn), then one rounding to the half type. Each thread reads its 4 inputs before it
 * writes its 4 outputs, so out == inp (half) is safe. VEC = 4: a block's 4 elements moved as
 * one 8-byte (half) or 16-byte (fp32) load and one 8-byte store, when inp and out are aligned
 * so (every full block then is; a last partial block goes element by element). Resources: 256
 * threads, a grid of at most 65535 blocks (nmt__grid), no shared memory. */

/* Four half elements moved as one 8-byte load or store. */
template <typename T>
struct __align__(8) half_x4 {
  T v[4];
};

__device__ __forceinline__ float in_value(float x) { return x; }
__device__ __forceinline__ float in_value(__half x) { return nmt__half_to_float(x); }
__device__ __forceinline__ float in_value(__nv_bfloat16 x) { return nmt__half_to_float(x); }

/* The 4 inputs of the block at e0 (VEC = 4, a full block). */
template <typename I>
__device__ __forceinline__ void load4(float v[4], const I *inp, size_t e0) {
  if constexpr (std::is_same_v<I, float>) {
    const float4 a = *reinterpret_cast<const float4 *>(inp + e0);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  } else {
    const half_x4<I> h = *reinterpret_cast<const half_x4<I> *>(inp + e0);
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = in_value(h.v[j]);
  }
}

// out: (n) half; inp: (n) of I (the half type T, or float)
template <typename T, typename I, int VEC>
static __global__ void dropout_half_kernel(T *out, const I *inp, size_t n, float p, float scale,
                                           uint64_t seed, uint64_t stream) {
  const size_t n_blk = (n + 3) / 4;
  for (size_t blk = (size_t)blockIdx.x * blockDim.x + threadIdx.x; blk < n_blk;
       blk += (size_t)gridDim.x * blockDim.x) {
    uint32_t w[4] = {0, 0, 0, 0};
    if (p > 0.0f) nmt__rng_block(seed, stream, (uint64_t)blk, w);
    const size_t e0 = blk * 4;
    if (VEC == 4 && e0 + 4 <= n) {
      float v[4];
      load4(v, inp, e0);
      half_x4<T> h;
#pragma unroll
      for (int j = 0; j < 4; j++) {
        if (p > 0.0f) v[j] = nmt__u32_uniform(w[j]) >= p ? __fmul_rn(v[j], scale) : 0.0f;
        h.v[j] = nmt__float_to_half<T>(v[j]);
      }
      *reinterpret_cast<half_x4<T> *>(out + e0) = h;
    } else {
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const size_t e = e0 + (size_t)j;
        if (e >= n) break;
        float v = in_value(inp[e]);
        if (p > 0.0f) v = nmt__u32_uniform(w[j]) >= p ? __fmul_rn(v, scale) : 0.0f;
        out[e] = nmt__float_to_half<T>(v);
      }
    }
  }
}
NMT_CUDA_PRELOAD(dropout_half_kernel<__half, __half, 4>);
NMT_CUDA_PRELOAD(dropout_half_kernel<__half, __half, 1>);
NMT_CUDA_PRELOAD(dropout_half_kernel<__half, float, 4>);
NMT_CUDA_PRELOAD(dropout_half_kernel<__half, float, 1>);
NMT_CUDA_PRELOAD(dropout_half_kernel<__nv_bfloat16, __nv_bfloat16, 4>);
NMT_CUDA_PRELOAD(dropout_half_kernel<__nv_bfloat16, __nv_bfloat16, 1>);
NMT_CUDA_PRELOAD(dropout_half_kernel<__nv_bfloat16, float, 4>);
NMT_CUDA_PRELOAD(dropout_half_kernel<__nv_bfloat16, float, 1>);

template <typename T, typename I>
static nmt_status dropout_half_launch(nmt_cuda_ctx *c, T *out, const I *inp, size_t n, float p,
                                      uint64_t seed, uint64_t stream) {
  const float scale = 1.0f / (1.0f - p);
  const int vec = ((uintptr_t)out & 7) == 0 && ((uintptr_t)inp & (4 * sizeof(I) - 1)) == 0;
  const unsigned grid = nmt__grid((n + 3) / 4, 256);
  cudaStream_t s = nmt__cuda_stream(c);
  if (vec)
    dropout_half_kernel<T, I, 4><<<grid, 256, 0, s>>>(out, inp, n, p, scale, seed, stream);
  else
    dropout_half_kernel<T, I, 1><<<grid, 256, 0, s>>>(out, inp, n, p, scale, seed, stream);
  NMT_CUDA_LAUNCH_CHECK("dropout_half_kernel");
  return NMT_OK;
}

// out: (n) half; inp: (n) half (inp_f32 = 0) or fp32 (inp_f32 = 1); out may equal a half inp
nmt_status nmt_cuda_dropout_half(void *ctx, nmt_act *out, const void *inp, int inp_f32, size_t n,
                                 float p, uint64_t seed, uint64_t stream) {
  NMT_TRY(nmt__cuda_enter(ctx, "dropout_half"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_p("dropout_half", p));
  NMT_TRY(nmt__cuda_half_op_check(c, "dropout_half"));
  if (n == 0) return NMT_OK;
  if (!out || !inp) return nmt_errorf(NMT_ERR_INTERNAL, "cuda dropout_half: NULL pointer");
  /* An fp32 input may not overlap the half output: a thread's store would overwrite another's
   * input before it is read. */
  if (inp_f32) {
    const uintptr_t o0 = (uintptr_t)out, o1 = o0 + n * sizeof(nmt_act);
    const uintptr_t i0 = (uintptr_t)inp, i1 = i0 + n * sizeof(float);
    if (o0 < i1 && i0 < o1)
      return nmt_errorf(NMT_ERR_INTERNAL,
                        "cuda dropout_half: the fp32 input overlaps the half output");
  }
  /* In place without dropout: round(v(h)) is h (NaN payloads aside): nothing to do. */
  if (!inp_f32 && p == 0.0f && (const void *)out == inp) return NMT_OK;
  const int bf16 = nmt__cuda_half_bf16(c);
  if (inp_f32) {
    const float *x = (const float *)inp;
    return bf16 ? dropout_half_launch(c, (__nv_bfloat16 *)out, x, n, p, seed, stream)
                : dropout_half_launch(c, (__half *)out, x, n, p, seed, stream);
  }
  return bf16 ? dropout_half_launch(c, (__nv_bfloat16 *)out, (const __nv_bfloat16 *)inp, n, p,
                                    seed, stream)
              : dropout_half_launch(c, (__half *)out, (const __half *)inp, n, p, seed, stream);
}
