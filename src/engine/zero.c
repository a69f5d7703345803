/* zero.c — the sharded optimizer step of ZeRO stage 1 and 2 (Rajbhandari et al. 2020 §5;
 * parallel.zero; the layouts are nmt/buckets.h's): each rank owns slice r of every gradient
 * bucket, keeps the Adam moments only for those slices (its shard, stored slice after slice),
 * and after backward has reduce-scattered the buckets:
 *   1. the global gradient norm from the shards: each slice's sum of squares, summed into one
 *      float, all-reduced (the one small collective ZeRO adds), and step_decide applies the
 *      loss-scaling and clipping policy to it, so every rank takes the same decision;
 *   2. AdamW on each owned slice (parameters at the slice's place in the flat buffer,
 *      moments at its place in the shard; the reduced gradient at the slice's place in the
 *      flat buffer with stage 1, in the shard accumulator with 2);
 *   3. the updated fp32 slices all-gathered, bucket by bucket (the model reads fp32 LayerNorm,
 *      bias and embedding weights), and in fp16/bf16 modes the half working copy the GEMMs
 *      read re-rounded from them (cast_half: bitwise adamw's half_out, a local pass instead
 *      of a 16-bit all-gather). Every gather is enqueued before the one flush that joins them
 *      all, so they run back to back on the comm stream. Stage 1 gathers in place in the
 *      padded flat buffer. Stage 2's parameter buffer has no pad: each bucket but the last is
 *      gathered in place from its first parameter, in reverse order, so that the pad slices
 *      running into the next bucket carry that bucket's already gathered values; the last
 *      (the embedding), whose pad would run past the buffer, goes through its gradient window
 *      (free once backward is done) and is copied back after the flush.
 * Elementwise AdamW on the same reduced gradient with the same multiplier gives the same
 * numbers as the replicated step; only the norm's summation order differs (partial sums per
 * slice), which moves the clip factor in its last bits when clipping is active. Stage 2's
 * gradient itself is summed in another order (nmt/buckets.h).
 */
#include <string.h>

#include "nmt/log.h"
#include "zero.h"

/* The backend's device-to-device copy of n floats, on the compute stream. */
static nmt_status copy_floats(const nmt_backend *be, void *ctx, float *dst, const float *src,
                              size_t n) {
  return be->copy_d2d(ctx, dst, src, n * sizeof(float));
}

/* Where rank r's reduced gradient of its slice of bucket b lies: in the flat buffer at the
 * slice's parameters (stage 1), or in the shard accumulator (stage 2). */
static float *slice_grads(const nmt__replica *r, size_t begin, size_t shard_off) {
  return r->plan->zero == 2 ? r->grads + shard_off : r->grads + begin;
}

int nmt__zero_gathers_in_place(const nmt_bucket_plan *p) {
  if (p->zero != 2) return 0;
  for (int b = 0; b + 1 < p->n_buckets; b++) {
    size_t begin, end;
    nmt_bucket_range(p, b, &begin, &end);
    if (begin + (size_t)p->n_ranks * nmt_bucket_slice_floats(p, b) > p->n_params) return 0;
  }
  return 1;
}

/* Stage 2's all-gather when some bucket's pad would run past the parameters (an embedding
 * smaller than a pad, n_ranks x NMT_SHARD_ALIGN floats): bucket by bucket through the two
 * windows: bucket b's slice is copied into window b % 2 and gathered there while bucket b+1's
 * slice is copied into the other; the compute stream joins bucket b's gather (flush) before
 * copying it back, one flush per bucket. */
static nmt_status gather_stage2_windows(nmt__replica *r) {
  const nmt_backend *be = r->be;
  const nmt_bucket_plan *p = r->plan;
  float *win[2] = {r->zero_windows, r->zero_windows + p->bucket_floats};
  for (int b = 0; b <= p->n_buckets; b++) {
    if (b < p->n_buckets) {
      size_t begin, len, off;
      nmt_bucket_slice(p, b, r->grank, &begin, &len, &off);
      const size_t slice = nmt_bucket_slice_floats(p, b);
      NMT_TRY(copy_floats(be, r->ctx, win[b % 2] + (size_t)r->grank * slice, r->params + begin,
                          len));
    }
    if (b > 0) { /* bucket b-1 back into the parameters */
      size_t pb, pe;
      nmt_bucket_range(p, b - 1, &pb, &pe);
      NMT_TRY(nmt_comm_flush(r->comm));
      NMT_TRY(copy_floats(be, r->ctx, r->params + pb, win[(b - 1) % 2], pe - pb));
      if (r->half_params)
        NMT_TRY(be->cast_half(r->ctx, (uint16_t *)r->half_params + pb, r->params + pb, pe - pb));
    }
    if (b < p->n_buckets)
      NMT_TRY(nmt_comm_all_gather(r->comm, win[b % 2], nmt_bucket_slice_floats(p, b),
                                  NMT_GRAD_FP32));
  }
  return NMT_OK;
}

/* Stage 2's all-gather of the parameters with one flush. Bucket b < last is gathered in place
 * at its first parameter: its n_ranks slices span its parameters and its pad, which lies over
 * the first parameters of the buckets after it. Gathering from the last bucket down, those
 * are final when b is gathered, on every rank alike, so the pad slices carry exactly the
 * values already there (nmt__zero_gathers_in_place: the span stays inside the buffer). The
 * last bucket (the embedding's) goes through its own window, copied in before any gather
 * writes over the start of its parameters and copied back after the flush, which also
 * restores what the pad of bucket last - 1 wrote there. */
static nmt_status gather_stage2(nmt__replica *r) {
  const nmt_backend *be = r->be;
  const nmt_bucket_plan *p = r->plan;
  if (!nmt__zero_gathers_in_place(p)) return gather_stage2_windows(r);
  const int last = p->n_buckets - 1;
  float *held = r->zero_grads.window[2];
  const size_t held_slice = nmt_bucket_slice_floats(p, last);
  size_t begin, len, off, pb, pe;
  nmt_bucket_slice(p, last, r->grank, &begin, &len, &off);
  NMT_TRY(copy_floats(be, r->ctx, held + (size_t)r->grank * held_slice, r->params + begin, len));
  NMT_TRY(nmt_comm_all_gather(r->comm, held, held_slice, NMT_GRAD_FP32));
  for (int b = last - 1; b >= 0; b--) {
    nmt_bucket_range(p, b, &pb, &pe);
    NMT_TRY(nmt_comm_all_gather(r->comm, r->params + pb, nmt_bucket_slice_floats(p, b),
                                NMT_GRAD_FP32));
  }
  NMT_TRY(nmt_comm_flush(r->comm));
  nmt_bucket_range(p, last, &pb, &pe);
  NMT_TRY(copy_floats(be, r->ctx, r->params + pb, held, pe - pb));
  return r->half_params ? be->cast_half(r->ctx, r->half_params, r->params, p->n_params) : NMT_OK;
}

nmt_status nmt__zero_update(nmt__replica *r, const nmt_config *cfg, long step, float lr,
                            nmt_step_policy policy) {
  const nmt_backend *be = r->be;
  const nmt_bucket_plan *p = r->plan;
  const int nb = p->n_buckets;
  /* 1. The norm: slice partials, their sum, the all-reduce across ranks. */
  for (int b = 0; b < nb; b++) {
    size_t begin, len, off;
    nmt_bucket_slice(p, b, r->grank, &begin, &len, &off);
    NMT_TRY(be->sumsq(r->ctx, r->zero_part + b, slice_grads(r, begin, off),
                      nmt_bucket_slice_floats(p, b)));
  }
  NMT_TRY(be->memset_zero(r->ctx, r->zero_part + nb, sizeof(float)));
  NMT_TRY(be->sum_acc(r->ctx, r->zero_part + nb, r->zero_part, (size_t)nb));
  if (r->world > 1) {
    NMT_TRY(nmt_comm_allreduce_sum(r->comm, r->zero_part + nb, 1));
    NMT_TRY(nmt_comm_flush(r->comm));
  } else if (atomic_load(r->abort)) {
    return NMT_ERR_ABORTED;
  }
  NMT_TRY(be->step_decide(r->ctx, r->dev_ctl, r->zero_part + nb, r->grads + p->extra_offset,
                          policy, step + 1));
  /* 2. AdamW on the owned slices (stage 2: the parameters among them). With several ranks
   * the half copy is re-rounded from the gathered weights in step 3, so AdamW skips it. */
  const int gathered = r->world > 1;
  for (int b = 0; b < nb; b++) {
    size_t begin, len, off;
    nmt_bucket_slice(p, b, r->grank, &begin, &len, &off);
    if (len == 0) continue;
    void *half = r->half_params && !gathered ? (uint16_t *)r->half_params + begin : NULL;
    NMT_TRY(be->adamw(r->ctx, r->params + begin, slice_grads(r, begin, off), r->m + off,
                      r->v + off, len, lr, cfg->train_adam_beta1, cfg->train_adam_beta2,
                      cfg->train_adam_eps, cfg->train_weight_decay, 1.0f, r->dev_ctl, half,
                      step + 1));
  }
  /* 3. Every rank gets every slice back; the next forward waits for them (flush). The half
   * copy is cast from the gathered fp32 weights (cast_half: bitwise adamw's half_out), which
   * costs a local pass instead of a second, 16-bit all-gather. */
  if (!gathered) return NMT_OK;
  if (p->zero == 2) return gather_stage2(r);
  for (int b = 0; b < nb; b++) {
    size_t begin, end;
    nmt_bucket_range(p, b, &begin, &end);
    const size_t slice = (end - begin) / (size_t)p->n_ranks;
    NMT_TRY(nmt_comm_all_gather(r->comm, r->params + begin, slice, NMT_GRAD_FP32));
  }
  NMT_TRY(nmt_comm_flush(r->comm));
  return r->half_params ? be->cast_half(r->ctx, r->half_params, r->params, p->total_floats)
                        : NMT_OK;
}

/* Copies between one rank's shard (device) and the consolidated host arrays (n_params
 * floats): the rank's slices, clipped to the parameters (the pad is not in a checkpoint). */
static nmt_status copy_slices(nmt__replica *r, float *host_m, float *host_v, int to_host) {
  const nmt_bucket_plan *p = r->plan;
  for (int b = 0; b < p->n_buckets; b++) {
    size_t begin, len, off;
    nmt_bucket_slice(p, b, r->grank, &begin, &len, &off);
    if (begin >= p->n_params) continue;
    if (begin + len > p->n_params) len = p->n_params - begin;
    const size_t bytes = len * sizeof(float);
    if (bytes == 0) continue;
    if (to_host) {
      NMT_TRY(r->be->copy_d2h(r->ctx, host_m + begin, r->m + off, bytes));
      NMT_TRY(r->be->copy_d2h(r->ctx, host_v + begin, r->v + off, bytes));
    } else {
      NMT_TRY(r->be->copy_h2d(r->ctx, r->m + off, host_m + begin, bytes));
      NMT_TRY(r->be->copy_h2d(r->ctx, r->v + off, host_v + begin, bytes));
    }
  }
  return NMT_OK;
}

nmt_status nmt__zero_load_moments(nmt__replica *r, const float *host_m, const float *host_v) {
  NMT_TRY(r->be->memset_zero(r->ctx, r->m, r->plan->shard_floats * sizeof(float)));
  NMT_TRY(r->be->memset_zero(r->ctx, r->v, r->plan->shard_floats * sizeof(float)));
  return copy_slices(r, (float *)host_m, (float *)host_v, 0);
}

nmt_status nmt__zero_save_moments(nmt__replica *r, float *host_m, float *host_v) {
  return copy_slices(r, host_m, host_v, 1);
}

nmt_status nmt__zero_copy_grads(nmt__replica *r, float *host) {
  const nmt_bucket_plan *p = r->plan;
  memset(host, 0, p->n_params * sizeof(float));
  for (int b = 0; b < p->n_buckets; b++) {
    size_t begin, len, off;
    nmt_bucket_slice(p, b, r->grank, &begin, &len, &off);
    if (len) NMT_TRY(r->be->copy_d2h(r->ctx, host + begin, r->grads + off, len * sizeof(float)));
  }
  return r->be->copy_d2h(r->ctx, host + p->n_params, r->grads + p->extra_offset,
                         NMT_GRAD_EXTRA * sizeof(float));
}
