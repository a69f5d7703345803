/* buckets.c — the bucket plan and the per-backward reducer (include/nmt/buckets.h). */
#include "nmt/buckets.h"

#include <math.h>

nmt_status nmt_bucket_plan_make(double bucket_mb, size_t n_params, size_t extra,
                                size_t max_buckets, nmt_bucket_plan *out) {
  *out = (nmt_bucket_plan){.n_params = n_params, .total_floats = n_params + extra};
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
                            .range_ids = range_ids};
}

void nmt_bucket_reducer_begin(nmt_bucket_reducer *r, int active) {
  r->active = active;
  r->next = 0;
}

nmt_status nmt_bucket_reducer_on_ready(void *user, size_t ready) {
  nmt_bucket_reducer *r = user;
  if (!r->active) return NMT_OK;
  while (r->next < r->plan->n_buckets) {
    size_t begin, end;
    nmt_bucket_range(r->plan, r->next, &begin, &end);
    if (end > ready) break;
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
  return NMT_OK;
}

nmt_status nmt_bucket_reducer_finish(const nmt_bucket_reducer *r, int rank) {
  if (r->next != r->plan->n_buckets)
    return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: backward reported %d of %d buckets ready", rank,
                      r->next, r->plan->n_buckets);
  return NMT_OK;
}
