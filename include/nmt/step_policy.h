/* nmt/step_policy.h — the optimizer step's control policy as one function that both backends
 * compile: src/ref/step.c calls it on the host, cuda/step.cu in a one-thread kernel. One source
 * makes the two verdicts bitwise equal for the same sum of squares (the contract is
 * nmt/backend.h's step_control): the norm and the clip factor in double, the loss scale in
 * float, in this order.
 *
 * defines: nmt_step_policy_apply, NMT_HOST_DEVICE */
#ifndef NMT_STEP_POLICY_H
#define NMT_STEP_POLICY_H

#include <math.h>
#include <stdint.h>

#include "nmt/backend.h"

#ifdef __CUDACC__
#define NMT_HOST_DEVICE __host__ __device__
#else
#define NMT_HOST_DEVICE
#endif

/* Applies the policy to ctl for step `step` (1-based), with ctl->sumsq already the sum of
 * squares of the reduced (scaled) gradient and extra[NMT_GRAD_EXTRA] its trailing slots.
 * Dynamic loss scaling as Micikevicius et al. 2018 §3.2 and torch.cuda.amp.GradScaler;
 * clipping as torch.nn.utils.clip_grad_norm_ on the per-token gradient. */
static inline NMT_HOST_DEVICE void nmt_step_policy_apply(nmt_step_ctl *ctl, const float *extra,
                                                         nmt_step_policy policy, int64_t step) {
  ctl->step = step;
  for (int i = 0; i < NMT_GRAD_EXTRA; i++) ctl->extra[i] = extra[i];
  const float scale = ctl->scale;
  ctl->scale_used = scale;
  ctl->skip = 1;
  ctl->coef = 0.0f;
  ctl->gnorm = (double)NAN;
  /* A run that has diverged stays stopped: the steps the host enqueued before it read the
   * verdict must not move the parameters. */
  if (ctl->status != NMT_STEP_OK) return;
  const double tokens = ctl->extra[NMT_GRAD_SLOT_TOKENS];
  if (!(tokens > 0)) {
    ctl->status = NMT_STEP_NO_TOKENS;
    return;
  }
  /* Norm of the unscaled gradient per target token; the sum of squares is the inf/NaN check. */
  const double gnorm = sqrt((double)ctl->sumsq) / tokens / scale;
  ctl->gnorm = gnorm;
  if (!isfinite(gnorm)) {
    if (!policy.scaling) {
      ctl->status = NMT_STEP_NONFINITE;
      return;
    }
    /* fp16 overflow: skip the update, back off. The step still counts (data, dropout streams
     * and the schedule move on, as with GradScaler). */
    const float next = scale * policy.backoff;
    if (next < policy.floor) {
      ctl->status = NMT_STEP_FLOOR;
      return;
    }
    ctl->scale = next;
    ctl->good = 0;
    ctl->skipped++;
    return;
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
}

#endif /* NMT_STEP_POLICY_H */
