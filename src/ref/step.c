/* ref/step.c — the optimizer step's control: gradient norm, fp16 overflow skip, dynamic loss
 * scaling and the clip factor, decided where the gradient is, so that no step waits for the
 * host. The policy itself is nmt/step_policy.h, shared with cuda/step.cu; the contract is
 * nmt/backend.h's step_control. */
#include "nmt/ref.h"
#include "nmt/step_policy.h"

nmt_status nmt_ref_step_control(void *ctx, nmt_step_ctl *ctl, const float *grads, size_t n,
                                nmt_step_policy policy, long step) {
  if (step < 1) return nmt_errorf(NMT_ERR_INTERNAL, "ref step_control: step %ld < 1", step);
  NMT_TRY(nmt_ref_sumsq(ctx, &ctl->sumsq, grads, n));
  /* step_control is step_decide on the sum of squares it just wrote. */
  return nmt_ref_step_decide(ctx, ctl, &ctl->sumsq, grads + n, policy, step);
}

nmt_status nmt_ref_step_decide(void *ctx, nmt_step_ctl *ctl, const float *sumsq,
                               const float *extra, nmt_step_policy policy, long step) {
  (void)ctx;
  if (step < 1) return nmt_errorf(NMT_ERR_INTERNAL, "ref step_decide: step %ld < 1", step);
  ctl->sumsq = *sumsq;
  nmt_step_policy_apply(ctl, extra, policy, step);
  return NMT_OK;
}
