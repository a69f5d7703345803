/* ref/adamw.c — AdamW: Adam (Kingma & Ba 2015, algorithm 1, bias-corrected moments) with
 * decoupled weight decay (Loshchilov & Hutter 2019), decay scaled by lr as in torch.optim.AdamW. */
#include <math.h>
#include <stdint.h>

#include "nmt/half.h"
#include "nmt/ref.h"

nmt_status nmt_ref_adamw(void *ctx, float *params, const float *grads, float *m, float *v,
                         size_t n, float lr, float beta1, float beta2, float eps,
                         float weight_decay, float grad_scale, const nmt_step_ctl *ctl,
                         void *half_out, long step) {
  if (step < 1) return nmt_errorf(NMT_ERR_INTERNAL, "ref adamw: step %ld < 1", step);
  /* The working copy's half type is the context's GEMM precision (nmt/backend.h half_weights). */
  uint16_t *fp16 = NULL, *bf16 = NULL;
  if (half_out) {
    nmt_precision mode;
    NMT_TRY(nmt__ref_gemm_precision(ctx, "adamw", &mode));
    if (mode == NMT_PRECISION_FP16) fp16 = half_out;
    else if (mode == NMT_PRECISION_BF16) bf16 = half_out;
    else
      return nmt_errorf(NMT_ERR_INTERNAL,
                        "ref adamw: half_out given, but the context's precision has no half type "
                        "(fp16/bf16 only)");
  }
  if (ctl) {
    /* step_control's verdict, as the GPU kernel reads it from device memory. */
    if (ctl->skip) return NMT_OK;
    grad_scale = ctl->coef;
  }
  /* In double: 1 - beta2^t is ~1e-3 at t = 1 and would lose digits in float. */
  float bc1 = (float)(1.0 - pow((double)beta1, (double)step));
  float bc2 = (float)(1.0 - pow((double)beta2, (double)step));
  for (size_t i = 0; i < n; i++) {
    float g = grads[i] * grad_scale;
    float mi = beta1 * m[i] + (1.0f - beta1) * g;
    float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    float mhat = mi / bc1, vhat = vi / bc2;
    params[i] -= lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * params[i]);
    if (fp16) fp16[i] = nmt_half_fp16_bits(params[i]);
    else if (bf16) bf16[i] = nmt_half_bf16_bits(params[i]);
  }
  return NMT_OK;
}
