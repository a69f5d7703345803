/* buckets.c — the bucket plan and the per-backward reducer (include/nmt/buckets.h). */
#include "nmt/buckets.h"

#include <math.h>

#include "nmt/backend.h" /* NMT_GRAD_EXTRA */

nmt_status nmt_bucket_plan_make(double bucket_mb, size_t n_params, size_t extra,
                                size_t max_buckets, nmt_bucket_plan *out) {
  *out = (nmt_bucket_plan){.n_params = n_params, .total_floats = n_params + extra, .n_ranks = 1,
                           .extra_offset = n_params, .shard_floats = n_params + extra};
  if (!(bucket_mb > 0))
    return nmt_errorf(NMT_ERR_USAGE, "[parallel] bucket_mb = %g (must be > 0)", bucket_mb);
  const size_t total = out->total_floats;
  double bf = bucket_mb * 1048576.0 / sizeof(float);
  size_t per = bf < 1 ? 1 : (size_t)bf;
  if (per > total) per = total;
  if (per == 0) return NMT_OK; /* an empty buffer has no bucket */
  /* In double first: a tiny bucket size over a huge buffer must not wrap the count. */
  double n = ceil((double)total / (double)per);
  if (max_buckets > 0 && n > (double)max_buckets)
    return nmt_errorf(NMT_ERR_USAGE, "[parallel] bucket_mb = %g gives %.0f buckets of %zu floats; "
                      "at most %zu are supported", bucket_mb, n, per, max_buckets);
  out->bucket_floats = per;
  out->n_buckets = (int)((total + per - 1) / per);
  return NMT_OK;
}

nmt_status nmt_bucket_plan_make_sharded(double bucket_mb, size_t n_params, int n_ranks, int zero,
                                        size_t max_buckets, nmt_bucket_plan *out) {
  if (n_ranks < 1 || (zero != 1 && zero != 2))
    return nmt_errorf(NMT_ERR_CONFIG, "ZeRO plan: %d ranks, stage %d (need >= 1 ranks, stage 1 "
                      "or 2)", n_ranks, zero);
  const size_t unit = (size_t)n_ranks * NMT_SHARD_ALIGN;
  const size_t span = (n_params + unit - 1) / unit * unit; /* the parameters, padded */
  NMT_TRY(nmt_bucket_plan_make(bucket_mb, span, 0, max_buckets, out));
  size_t per = (out->bucket_floats + unit - 1) / unit * unit;
  if (per > span) per = span;
  size_t nb = per ? (n_params + per - 1) / per : 0;
  if (max_buckets > 0 && nb > max_buckets)
    return nmt_errorf(NMT_ERR_USAGE, "[parallel] bucket_mb = %g gives %zu buckets; at most %zu "
                      "are supported", bucket_mb, nb, max_buckets);
  size_t last = nb ? n_params - (nb - 1) * per : 0;
  size_t total = nb ? (nb - 1) * per + (last + unit - 1) / unit * unit : 0;
  *out = (nmt_bucket_plan){.n_params = n_params, .total_floats = total, .bucket_floats = per,
                           .n_buckets = (int)nb, .zero = zero, .n_ranks = n_ranks,
                           .extra_offset = total, .shard_floats = total / (size_t)n_ranks};
  return NMT_OK;
}

void nmt_bucket_slice(const nmt_bucket_plan *p, int b, int rank, size_t *begin, size_t *len,
                      size_t *shard_off) {
  size_t bb, be;
  nmt_bucket_range(p, b, &bb, &be);
  if (!p->zero) {
    *begin = bb, *len = be - bb, *shard_off = bb;
    return;
  }
  const size_t slice = (be - bb) / (size_t)p->n_ranks;
  *begin = bb + (size_t)rank * slice;
  *len = slice;
  *shard_off = (size_t)b * (p->bucket_floats / (size_t)p->n_ranks);
}

void nmt_bucket_range(const nmt_bucket_plan *p, int b, size_t *begin, size_t *end) {
  size_t s = (size_t)b * p->bucket_floats;
  *begin = s;
  *end = s + p->bucket_floats < p->total_floats ? s + p->bucket_floats : p->total_floats;
}

nmt_status nmt_bucket_reduce(const nmt_bucket_plan *plan, nmt_comm *comm, int n_ranks,
                             nmt_grad_dtype wire, atomic_int *abort, float *grads, size_t begin,
                             size_t end) {
  /* The host communicator works on host memory. With one rank there is nothing to reduce, and
   * skipping the call keeps device buffers (CUDA backend, one GPU) away from it. */
  if (n_ranks == 1) return abort && atomic_load(abort) ? NMT_ERR_ABORTED : NMT_OK;
  if (plan->zero)
    return nmt_comm_reduce_scatter_sum_as(comm, grads + begin, (end - begin) / (size_t)n_ranks,
                                          wire);
  const size_t n = plan->n_params;
  if (wire == NMT_GRAD_FP32) return nmt_comm_allreduce_sum(comm, grads + begin, end - begin);
  if (begin < n)
    NMT_TRY(nmt_comm_allreduce_sum_as(comm, grads + begin, (end < n ? end : n) - begin, wire));
  if (end > n) {
    size_t b = begin > n ? begin : n;
    NMT_TRY(nmt_comm_allreduce_sum(comm, grads + b, end - b));
  }
  return NMT_OK;
}

void nmt_bucket_reducer_init(nmt_bucket_reducer *r, const nmt_bucket_plan *plan, nmt_comm *comm,
                             int n_ranks, nmt_grad_dtype wire, atomic_int *abort, float *grads,
                             nmt_prof_track *prof, const int *range_ids) {
  *r = (nmt_bucket_reducer){.plan = plan, .comm = comm, .n_ranks = n_ranks, .wire = wire,
                            .abort = abort, .grads = grads, .prof = prof,
                            .range_ids = range_ids, .fail_at_bucket = -1};
}

void nmt_bucket_reducer_begin(nmt_bucket_reducer *r, int active) {
  r->active = active;
  r->next = 0;
  r->extras_done = 0;
}

/* ZeRO: the trailing slots, fp32, all ranks (with one rank: only the abort check). */
static nmt_status reduce_extras(nmt_bucket_reducer *r) {
  r->extras_done = 1;
  if (r->n_ranks == 1) return r->abort && atomic_load(r->abort) ? NMT_ERR_ABORTED : NMT_OK;
  return nmt_comm_allreduce_sum(r->comm, r->grads + r->plan->extra_offset, NMT_GRAD_EXTRA);
}

nmt_status nmt_bucket_reducer_on_ready(void *user, size_t ready) {
  nmt_bucket_reducer *r = user;
  if (!r->active) return NMT_OK;
  while (r->next < r->plan->n_buckets) {
    size_t begin, end;
    nmt_bucket_range(r->plan, r->next, &begin, &end);
    /* ZeRO: the pad past the parameters is never written, so a bucket is ready when its
     * parameters are. */
    const size_t needed = r->plan->zero && end > r->plan->n_params ? r->plan->n_params : end;
    if (needed > ready) break;
    if (r->next == r->fail_at_bucket)
      return nmt_errorf(NMT_ERR_INTERNAL, "injected failure on rank %d in the collective of "
                        "bucket %d", r->comm ? nmt_comm_rank(r->comm) : 0, r->next);
    const int ranged = r->prof && r->range_ids;
    if (ranged) {
      nmt_prof_cost c = nmt_prof_cost_allreduce((double)(end - begin), r->n_ranks);
      nmt_prof_push(r->prof, r->range_ids[r->next], NMT_PROF_BWD, c.flops, c.bytes);
    }
    nmt_status s = nmt_bucket_reduce(r->plan, r->comm, r->n_ranks, r->wire, r->abort, r->grads,
                                     begin, end);
    if (ranged) nmt_prof_pop(r->prof);
    NMT_TRY(s);
    r->next++;
  }
  if (r->plan->zero && !r->extras_done && r->next == r->plan->n_buckets &&
      ready >= r->plan->n_params + NMT_GRAD_EXTRA)
    NMT_TRY(reduce_extras(r));
  return NMT_OK;
}

nmt_status nmt_bucket_reducer_finish(const nmt_bucket_reducer *r, int rank) {
  if (r->next != r->plan->n_buckets || (r->plan->zero && !r->extras_done))
    return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: backward reported %d of %d buckets ready", rank,
                      r->next, r->plan->n_buckets);
  return NMT_OK;
}
