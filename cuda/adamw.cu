/* cuda/adamw.cu — AdamW over the flat fp32 buffers: Adam (Kingma & Ba 2015, algorithm 1,
 * bias-corrected moments) with decoupled weight decay (Loshchilov & Hutter 2019), decay scaled
 * by lr as in torch.optim.AdamW; as src/ref/adamw.c, one thread per element. The bias
 * corrections are formed on the host in double, as the reference does. With a step control
 * block (cuda/step.cu) the gradient multiplier and the skip come from device memory, so the
 * host decides nothing per step. In fp16/bf16 mode the same pass writes the half working copy
 * of the new weights (half_out: __float2half_rn / __float2bfloat16_rn, the GEMMs' cast), so
 * the GEMMs of the next step need no cast of their own and the copy costs no extra read. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

#include "common.cuh"

/* half_out: NULL, or n __nv_bfloat16 (bf16 != 0) / __half elements. */
static __global__ void adamw_kernel(float *params, const float *grads, float *m, float *v,
                                    size_t n, float lr, float beta1, float beta2, float eps,
                                    float weight_decay, float grad_scale,
                                    const nmt_step_ctl *ctl, void *half_out, int bf16, float bc1,
                                    float bc2) {
  /* Every thread reads the verdict (one cached broadcast load): a skipped step writes nothing,
   * so parameters and moments stay bitwise as they were. */
  if (ctl) {
    if (ctl->skip) return;
    grad_scale = ctl->coef;
  }
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const float g = grads[i] * grad_scale;
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float mhat = mi / bc1, vhat = vi / bc2;
    const float p = params[i];
    const float np = p - lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * p);
    params[i] = np;
    if (half_out) {
      if (bf16) ((__nv_bfloat16 *)half_out)[i] = __float2bfloat16_rn(np);
      else ((__half *)half_out)[i] = __float2half_rn(np);
    }
  }
}
NMT_CUDA_PRELOAD(adamw_kernel);

nmt_status nmt_cuda_adamw(void *ctx, float *params, const float *grads, float *m, float *v,
                          size_t n, float lr, float beta1, float beta2, float eps,
                          float weight_decay, float grad_scale, const nmt_step_ctl *ctl,
                          void *half_out, long step) {
  NMT_TRY(nmt__cuda_enter(ctx, "adamw"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (step < 1) return nmt_errorf(NMT_ERR_INTERNAL, "cuda adamw: step %ld < 1", step);
  const int bf16 = c->precision == NMT_PRECISION_BF16;
  if (half_out && !bf16 && c->precision != NMT_PRECISION_FP16)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda adamw: half_out given, but the context's precision has no half type "
                      "(fp16/bf16 only)");
  if (n == 0) return NMT_OK;
  /* In double: 1 - beta2^t is ~1e-3 at t = 1 and would lose digits in float. */
  const float bc1 = (float)(1.0 - pow((double)beta1, (double)step));
  const float bc2 = (float)(1.0 - pow((double)beta2, (double)step));
  adamw_kernel<<<nmt__grid(n, 256), 256, 0, nmt__cuda_stream(c)>>>(
      params, grads, m, v, n, lr, beta1, beta2, eps, weight_decay, grad_scale, ctl, half_out,
      bf16, bc1, bc2);
  NMT_CUDA_LAUNCH_CHECK("adamw_kernel");
  return NMT_OK;
}
