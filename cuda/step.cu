/* cuda/step.cu — the optimizer step's control on the device (step_control), as src/ref/step.c;
 * the contract is nmt/backend.h's. (The loss normaliser of a micro-batch, count_targets, is in
 * cuda/reductions.cu.)
 *
 * step_control is the deterministic sum of squares of cuda/reductions.cu (nmt__cuda_sum) into
 * ctl->sumsq, then one thread that applies the loss-scaling and clipping policy to the control
 * block: nmt/step_policy.h, the very function the reference calls, so that the same sumsq gives
 * bitwise the same block on both backends. Nothing is
 * read by the host: AdamW reads the verdict (coef, skip), xent the next loss scale, and the
 * host reads the block back a step later (d2h_async / d2h_wait, docs/cuda.md "Step
 * control"). */
#include <math.h>

#include "common.cuh"
#include "nmt/step_policy.h"
#include "nmt/types.h"

nmt_status nmt_cuda_step_control(void *ctx, nmt_step_ctl *ctl, const float *grads, size_t n,
                                 nmt_step_policy policy, long step) {
  NMT_TRY(nmt__cuda_enter(ctx, "step_control"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (step < 1) return nmt_errorf(NMT_ERR_INTERNAL, "cuda step_control: step %ld < 1", step);
  NMT_TRY(nmt__cuda_sum(c, &ctl->sumsq, grads, n, 1, 0));
  /* step_control is step_decide on the sum of squares it just wrote. */
  return nmt_cuda_step_decide(ctx, ctl, &ctl->sumsq, grads + n, policy, step);
}

/* The scalar policy (nmt/step_policy.h, the same function the reference calls) on the reduced
 * slots `extra` and the given sum of squares, which it copies into ctl first (it may be
 * &ctl->sumsq). One thread: a few dozen flops per step. */
static __global__ void step_policy_given(nmt_step_ctl *ctl, const float *sumsq,
                                         const float *extra, nmt_step_policy p, int64_t step) {
  ctl->sumsq = *sumsq;
  nmt_step_policy_apply(ctl, extra, p, step);
}
NMT_CUDA_PRELOAD(step_policy_given);

nmt_status nmt_cuda_step_decide(void *ctx, nmt_step_ctl *ctl, const float *sumsq,
                                const float *extra, nmt_step_policy policy, long step) {
  NMT_TRY(nmt__cuda_enter(ctx, "step_decide"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (step < 1) return nmt_errorf(NMT_ERR_INTERNAL, "cuda step_decide: step %ld < 1", step);
  step_policy_given<<<1, 1, 0, nmt__cuda_stream(c)>>>(ctl, sumsq, extra, policy, (int64_t)step);
  NMT_CUDA_LAUNCH_CHECK("step_policy_given");
  return NMT_OK;
}
