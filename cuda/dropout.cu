/* cuda/dropout.cu — inverted dropout (Srivastava et al. 2014; Vaswani et al. 2017 §5.4) with
 * the counter-based mask of src/ref/dropout.c: element e is kept iff
 * nmt_rng_uniform(seed, stream, e) >= p, and a kept x becomes x * (1.0f / (1.0f - p)) in fp32,
 * so the output is bitwise the reference's. One thread per Philox block: its four words are
 * the masks of four consecutive elements. */
#include "common.cuh"

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

/* ---- STUB: the half-storage ops, to be implemented ---- */
nmt_status nmt_cuda_dropout_half(void *ctx, nmt_act *out, const void *inp, int inp_f32, size_t n, float p, uint64_t seed, uint64_t stream) {
  (void)ctx; (void)out; (void)inp; (void)inp_f32; (void)n; (void)p; (void)seed; (void)stream;
  return nmt_errorf(NMT_ERR_INTERNAL, "cuda dropout_half: not implemented yet");
}
