/* ref/step.c — the optimizer step's control: gradient norm, fp16 overflow skip, dynamic loss
 * scaling (Micikevicius et al. 2018 §3.2, the policy of torch.cuda.amp.GradScaler) and the clip
 * factor (torch.nn.utils.clip_grad_norm_), decided where the gradient is, so that no step waits
 * for the host. The contract, which cuda/step.cu follows expression for expression, is in
 * nmt/backend.h (step_control). */
#include <math.h>

#include "nmt/ref.h"

nmt_status nmt_ref_step_control(void *ctx, nmt_step_ctl *ctl, const float *grads, size_t n,
                                nmt_step_policy policy, long step) {
  if (step < 1) return nmt_errorf(NMT_ERR_INTERNAL, "ref step_control: step %ld < 1", step);
  NMT_TRY(nmt_ref_sumsq(ctx, &ctl->sumsq, grads, n));
  ctl->step = step;
  for (int i = 0; i < NMT_GRAD_EXTRA; i++) ctl->extra[i] = grads[n + i];
  const float scale = ctl->scale;
  ctl->scale_used = scale;
  ctl->skip = 1;
  ctl->coef = 0.0f;
  ctl->gnorm = NAN;
  /* A run that has diverged stays stopped: the steps the host enqueued before it read the
   * verdict must not move the parameters. */
  if (ctl->status != NMT_STEP_OK) return NMT_OK;
  const double tokens = ctl->extra[NMT_GRAD_SLOT_TOKENS];
  if (!(tokens > 0)) {
    ctl->status = NMT_STEP_NO_TOKENS;
    return NMT_OK;
  }
  /* Norm of the unscaled gradient per target token; the sum of squares is the inf/NaN check. */
  const double gnorm = sqrt((double)ctl->sumsq) / tokens / scale;
  ctl->gnorm = gnorm;
  if (!isfinite(gnorm)) {
    if (!policy.scaling) {
      ctl->status = NMT_STEP_NONFINITE;
      return NMT_OK;
    }
    /* fp16 overflow: skip the update, back off. The step still counts (data, dropout streams
     * and the schedule move on, as with GradScaler). */
    const float next = scale * policy.backoff;
    if (next < policy.floor) {
      ctl->status = NMT_STEP_FLOOR;
      return NMT_OK;
    }
    ctl->scale = next;
    ctl->good = 0;
    ctl->skipped++;
    return NMT_OK;
  }
  double clip = 1.0;
  if (policy.clip_norm > 0 && gnorm > policy.clip_norm) clip = policy.clip_norm / gnorm;
  ctl->coef = (float)(clip / tokens / scale);
  ctl->skip = 0;
  if (policy.scaling && ++ctl->good >= policy.growth_interval) {
    /* Growth stops where doubling would overflow fp32 itself. */
    if (scale < 0x1p126f) ctl->scale = scale * 2.0f;
    ctl->good = 0;
  }
  return NMT_OK;
}
