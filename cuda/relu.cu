/* cuda/relu.cu — ReLU of the position-wise feed-forward network (Vaswani et al. 2017 §3.3), as
 * src/ref/relu.c: the backward reads the output, so the forward may run in place. */
#include "common.cuh"

static __global__ void relu_fwd_kernel(float *out, const float *inp, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const float x = inp[i];
    out[i] = x > 0.0f ? x : 0.0f;
  }
}
NMT_CUDA_PRELOAD(relu_fwd_kernel);

static __global__ void relu_bwd_kernel(float *dinp, const float *dout, const float *out,
                                       size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dinp[i] += out[i] > 0.0f ? dout[i] : 0.0f;
}
NMT_CUDA_PRELOAD(relu_bwd_kernel);

nmt_status nmt_cuda_relu_fwd(void *ctx, float *out, const float *inp, size_t n) {
  NMT_TRY(nmt__cuda_enter(ctx, "relu_fwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (n == 0) return NMT_OK;
  relu_fwd_kernel<<<nmt__grid(n, 256), 256, 0, nmt__cuda_stream(c)>>>(out, inp, n);
  NMT_CUDA_LAUNCH_CHECK("relu_fwd_kernel");
  return NMT_OK;
}

nmt_status nmt_cuda_relu_bwd(void *ctx, float *dinp, const float *dout, const float *out,
                             size_t n) {
  NMT_TRY(nmt__cuda_enter(ctx, "relu_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (!dinp || n == 0) return NMT_OK;
  relu_bwd_kernel<<<nmt__grid(n, 256), 256, 0, nmt__cuda_stream(c)>>>(dinp, dout, out, n);
  NMT_CUDA_LAUNCH_CHECK("relu_bwd_kernel");
  return NMT_OK;
}
