/* ref/adamw.c — AdamW: Adam (Kingma & Ba 2015, algorithm 1, bias-corrected moments) with
 * decoupled weight decay (Loshchilov & Hutter 2019), decay scaled by lr as in torch.optim.AdamW. */
#include <math.h>

#include "nmt/ref.h"

nmt_status nmt_ref_adamw(void *ctx, float *params, const float *grads, float *m, float *v,
                         size_t n, float lr, float beta1, float beta2, float eps,
                         float weight_decay, float grad_scale, const nmt_step_ctl *ctl,
                         long step) {
  (void)ctx;
  if (step < 1) return nmt_errorf(NMT_ERR_INTERNAL, "ref adamw: step %ld < 1", step);
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
  }
  return NMT_OK;
}
