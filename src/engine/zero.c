/* zero.c — the sharded optimizer step of ZeRO stage 1 and 2 (Rajbhandari et al. 2020 §5;
 * parallel.zero; the layout is nmt/buckets.h's): each rank owns slice r of every gradient
 * bucket, keeps the Adam moments only for those slices (its shard, stored slice after slice),
 * and after backward has reduce-scattered the buckets:
 *   1. the global gradient norm from the shards: each slice's sum of squares, summed into one
 *      float, all-reduced (the one small collective ZeRO adds), and step_decide applies the
 *      loss-scaling and clipping policy to it, so every rank takes the same decision;
 *   2. AdamW on each owned slice (parameters and the fp16/bf16 working copy at the slice's
 *      place in the flat buffers, moments at its place in the shard);
 *   3. the updated slices all-gathered, in place, bucket by bucket: the fp32 parameters (the
 *      model reads fp32 LayerNorm, bias and embedding weights), and in fp16/bf16 modes the
 *      half working copy the GEMMs read.
 * Elementwise AdamW on the same reduced gradient with the same multiplier gives the same
 * numbers as the replicated step; only the norm's summation order differs (partial sums per
 * slice), which moves the clip factor in its last bits when clipping is active.
 */
#include <string.h>

#include "nmt/log.h"
#include "run.h"

/* The working copy's element type: the all-gather moves its bits. */
static nmt_grad_dtype half_dtype(const nmt_config *cfg) {
  return cfg->precision_mode == NMT_PRECISION_BF16 ? NMT_GRAD_BF16 : NMT_GRAD_FP16;
}

nmt_status nmt__zero_update(nmt__worker *w, long step, float lr, nmt_step_policy policy) {
  nmt_trainer *t = w->t;
  const nmt_config *cfg = &t->cfg;
  const nmt_backend *be = t->be;
  const nmt_bucket_plan *p = &t->plan;
  const int nb = p->n_buckets;
  /* 1. The norm: slice partials, their sum, the all-reduce across ranks. */
  for (int b = 0; b < nb; b++) {
    size_t begin, len, off;
    nmt_bucket_slice(p, b, w->grank, &begin, &len, &off);
    NMT_TRY(be->sumsq(w->ctx, w->zero_part + b, w->grads + begin, len));
  }
  NMT_TRY(be->memset_zero(w->ctx, w->zero_part + nb, sizeof(float)));
  NMT_TRY(be->sum_acc(w->ctx, w->zero_part + nb, w->zero_part, (size_t)nb));
  if (t->world.world > 1) {
    NMT_TRY(nmt_comm_allreduce_sum(w->comm, w->zero_part + nb, 1));
    NMT_TRY(nmt_comm_flush(w->comm));
  } else if (atomic_load(&t->sync.abort)) {
    return NMT_ERR_ABORTED;
  }
  NMT_TRY(be->step_decide(w->ctx, w->dev_ctl, w->zero_part + nb, w->grads + p->extra_offset,
                          policy, step + 1));
  /* 2. AdamW on the owned slices. */
  for (int b = 0; b < nb; b++) {
    size_t begin, len, off;
    nmt_bucket_slice(p, b, w->grank, &begin, &len, &off);
    void *half = w->half_params ? (uint16_t *)w->half_params + begin : NULL;
    NMT_TRY(be->adamw(w->ctx, w->params + begin, w->grads + begin, w->m + off, w->v + off, len,
                      lr, cfg->train_adam_beta1, cfg->train_adam_beta2, cfg->train_adam_eps,
                      cfg->train_weight_decay, 1.0f, w->dev_ctl, half, step + 1));
  }
  /* 3. Every rank gets every slice back; the next forward waits for them (flush). */
  if (t->world.world == 1) return NMT_OK;
  for (int b = 0; b < nb; b++) {
    size_t begin, end;
    nmt_bucket_range(p, b, &begin, &end);
    const size_t slice = (end - begin) / (size_t)p->n_ranks;
    NMT_TRY(nmt_comm_all_gather(w->comm, w->params + begin, slice, NMT_GRAD_FP32));
    if (w->half_params)
      NMT_TRY(nmt_comm_all_gather(w->comm, (uint16_t *)w->half_params + begin, slice,
                                  half_dtype(cfg)));
  }
  return nmt_comm_flush(w->comm);
}

/* Copies between one rank's shard (device) and the consolidated host arrays (n_params
 * floats): the rank's slices, clipped to the parameters (the pad is not in a checkpoint). */
static nmt_status copy_slices(nmt__worker *w, float *host_m, float *host_v, int to_host) {
  nmt_trainer *t = w->t;
  const nmt_bucket_plan *p = &t->plan;
  for (int b = 0; b < p->n_buckets; b++) {
    size_t begin, len, off;
    nmt_bucket_slice(p, b, w->grank, &begin, &len, &off);
    if (begin >= p->n_params) continue;
    if (begin + len > p->n_params) len = p->n_params - begin;
    const size_t bytes = len * sizeof(float);
    if (to_host) {
      NMT_TRY(t->be->copy_d2h(w->ctx, host_m + begin, w->m + off, bytes));
      NMT_TRY(t->be->copy_d2h(w->ctx, host_v + begin, w->v + off, bytes));
    } else {
      NMT_TRY(t->be->copy_h2d(w->ctx, w->m + off, host_m + begin, bytes));
      NMT_TRY(t->be->copy_h2d(w->ctx, w->v + off, host_v + begin, bytes));
    }
  }
  return NMT_OK;
}

nmt_status nmt__zero_load_moments(nmt__worker *w, const float *host_m, const float *host_v) {
  NMT_TRY(w->t->be->memset_zero(w->ctx, w->m, w->t->plan.shard_floats * sizeof(float)));
  NMT_TRY(w->t->be->memset_zero(w->ctx, w->v, w->t->plan.shard_floats * sizeof(float)));
  return copy_slices(w, (float *)host_m, (float *)host_v, 0);
}

nmt_status nmt__zero_save_moments(nmt__worker *w, float *host_m, float *host_v) {
  return copy_slices(w, host_m, host_v, 1);
}
