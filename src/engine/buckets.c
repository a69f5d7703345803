/* buckets.c — the bucket plan, the per-backward reducer, and ZeRO stage 2's gradient windows
 * (include/nmt/buckets.h). */
#include "nmt/buckets.h"

#include <math.h>
#include <stdlib.h>

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
  if (n_ranks < 1 || zero != 1)
    return nmt_errorf(NMT_ERR_CONFIG, "ZeRO plan: %d ranks, stage %d (need >= 1 ranks, stage 1; "
                      "stage 2's plan is nmt_bucket_plan_make_stages')", n_ranks, zero);
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

nmt_status nmt_bucket_plan_make_stages(const size_t *bounds, int n_stages, int n_ranks,
                                       nmt_bucket_plan *out) {
  *out = (nmt_bucket_plan){0};
  if (n_ranks < 1 || n_stages < 1)
    return nmt_errorf(NMT_ERR_CONFIG, "ZeRO stage 2 plan: %d ranks, %d stages (need >= 1 of "
                      "each)", n_ranks, n_stages);
  if (bounds[0] != 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "ZeRO stage 2 plan: the first stage starts at %zu, "
                      "not 0", bounds[0]);
  for (int i = 0; i < n_stages; i++)
    if (bounds[i + 1] <= bounds[i])
      return nmt_errorf(NMT_ERR_INTERNAL, "ZeRO stage 2 plan: stage %d is [%zu, %zu)", i,
                        bounds[i], bounds[i + 1]);
  size_t *arr = malloc(2 * ((size_t)n_stages + 1) * sizeof *arr);
  if (!arr) return nmt_errorf(NMT_ERR_NOMEM, "ZeRO stage 2 plan of %d buckets", n_stages);
  const size_t unit = (size_t)n_ranks * NMT_SHARD_ALIGN;
  size_t *offs = arr + n_stages + 1, widest = 0;
  offs[0] = 0;
  for (int i = 0; i <= n_stages; i++) arr[i] = bounds[i];
  for (int i = 0; i < n_stages; i++) {
    const size_t padded = (bounds[i + 1] - bounds[i] + unit - 1) / unit * unit;
    if (padded > widest) widest = padded;
    offs[i + 1] = offs[i] + padded / (size_t)n_ranks;
  }
  *out = (nmt_bucket_plan){.n_params = bounds[n_stages],
                           .total_floats = offs[n_stages] * (size_t)n_ranks,
                           .bucket_floats = widest, .n_buckets = n_stages, .zero = 2,
                           .n_ranks = n_ranks, .extra_offset = offs[n_stages],
                           .shard_floats = offs[n_stages], .bounds = arr, .shard_offs = offs};
  return NMT_OK;
}

void nmt_bucket_plan_free(nmt_bucket_plan *p) {
  free(p->bounds); /* shard_offs lives in the same allocation */
  p->bounds = p->shard_offs = NULL;
}

size_t nmt_bucket_slice_floats(const nmt_bucket_plan *p, int b) {
  if (p->bounds) return p->shard_offs[b + 1] - p->shard_offs[b];
  size_t bb, be;
  nmt_bucket_range(p, b, &bb, &be);
  return p->zero ? (be - bb) / (size_t)p->n_ranks : be - bb;
}

void nmt_bucket_slice(const nmt_bucket_plan *p, int b, int rank, size_t *begin, size_t *len,
                      size_t *shard_off) {
  size_t bb, be;
  nmt_bucket_range(p, b, &bb, &be);
  if (!p->zero) {
    *begin = bb, *len = be - bb, *shard_off = bb;
    return;
  }
  const size_t slice = nmt_bucket_slice_floats(p, b);
  if (p->bounds) { /* stage 2: the slice's parameters only */
    const size_t s = (size_t)rank * slice;
    *begin = s < be - bb ? bb + s : be;
    *len = s < be - bb ? (be - bb - s < slice ? be - bb - s : slice) : 0;
    *shard_off = p->shard_offs[b];
    return;
  }
  *begin = bb + (size_t)rank * slice;
  *len = slice;
  *shard_off = (size_t)b * (p->bucket_floats / (size_t)p->n_ranks);
}

void nmt_bucket_range(const nmt_bucket_plan *p, int b, size_t *begin, size_t *end) {
  if (p->bounds) {
    *begin = p->bounds[b], *end = p->bounds[b + 1];
    return;
  }
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
/* The trailing slots (loss, tokens, NLL, stop) all-reduced in fp32 over n_ranks; with one
 * rank there is nothing to sum, only the abort flag to honour. */
static nmt_status reduce_slots(nmt_comm *comm, int n_ranks, atomic_int *abort, float *slots) {
  if (n_ranks == 1) return abort && atomic_load(abort) ? NMT_ERR_ABORTED : NMT_OK;
  return nmt_comm_allreduce_sum(comm, slots, NMT_GRAD_EXTRA);
}

static nmt_status reduce_extras(nmt_bucket_reducer *r) {
  r->extras_done = 1;
  return reduce_slots(r->comm, r->n_ranks, r->abort, r->grads + r->plan->extra_offset);
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
      /* ZeRO reduce-scatters the bucket: half an all-reduce's traffic. */
      nmt_prof_cost c = r->plan->zero
                            ? nmt_prof_cost_reduce_scatter((double)(end - begin), r->n_ranks)
                            : nmt_prof_cost_allreduce((double)(end - begin), r->n_ranks);
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

/* ------------------------------------------------------------------------------------------ */
/* ZeRO stage 2: gradient windows                                                              */

void nmt_grad_windows_init(nmt_grad_windows *g, const nmt_bucket_plan *plan,
                           const nmt_backend *be, void *ctx, int rank, nmt_grad_dtype wire,
                           atomic_int *abort, float *windows, float *shard,
                           nmt_prof_track *prof, const int *range_ids) {
  *g = (nmt_grad_windows){.plan = plan, .be = be, .ctx = ctx, .rank = rank, .wire = wire,
                          .abort = abort, .shard = shard, .prof = prof,
                          .range_ids = range_ids, .fail_at_bucket = -1};
  g->window[0] = windows;
  g->window[1] = windows ? windows + plan->bucket_floats : NULL;
  g->window[2] = windows ? windows + 2 * plan->bucket_floats : NULL;
  g->held_bucket = plan->n_buckets - 1;
  nmt_grad_windows_begin(g);
}

nmt_status nmt_bucket_plan_make_model_stages(const nmt_model_cfg *mc, int n_ranks,
                                             nmt_bucket_plan *out) {
  *out = (nmt_bucket_plan){0};
  const int n = nmt_model_grad_stages(mc, NULL);
  size_t *bounds = n > 0 ? malloc(((size_t)n + 1) * sizeof *bounds) : NULL;
  if (!bounds || nmt_model_grad_stages(mc, bounds) != n) {
    free(bounds);
    return nmt_errorf(NMT_ERR_NOMEM, "ZeRO stage 2: the model's backward stages");
  }
  nmt_status s = nmt_bucket_plan_make_stages(bounds, n, n_ranks, out);
  free(bounds);
  return s;
}

void nmt_bucket_plan_bytes(const nmt_bucket_plan *p, int half, nmt_plan_bytes *out) {
  const size_t span = p->zero == 1 ? p->total_floats : p->n_params;
  out->weights = span * sizeof(float) + (half ? span * 2 : 0);
  out->grad_buf = (p->extra_offset + NMT_GRAD_EXTRA) * sizeof(float);
  out->grads = out->grad_buf + nmt_grad_windows_floats(p) * sizeof(float);
  out->optim = 2 * (p->zero ? p->shard_floats : p->n_params) * sizeof(float);
}

size_t nmt_grad_windows_floats(const nmt_bucket_plan *p) {
  if (p->zero != 2 || p->n_buckets < 1) return 0;
  return 2 * p->bucket_floats + nmt_bucket_slice_floats(p, p->n_buckets - 1) * (size_t)p->n_ranks;
}

void nmt_grad_windows_begin(nmt_grad_windows *g) {
  g->open_bucket = g->open_window = -1;
  g->pending_bucket = g->pending_window = -1;
  g->held_open = 0;
  g->closed = 0;
}

/* The bucket whose parameters are exactly [begin, end), or -1. */
static int bucket_of(const nmt_bucket_plan *p, size_t begin, size_t end) {
  int lo = 0, hi = p->n_buckets - 1;
  while (lo <= hi) {
    const int mid = lo + (hi - lo) / 2;
    if (p->bounds[mid] < begin) lo = mid + 1;
    else if (p->bounds[mid] > begin) hi = mid - 1;
    else return p->bounds[mid + 1] == end ? mid : -1;
  }
  return -1;
}

/* The pending window's slice (its reduce-scatter joined) added into the shard. */
static nmt_status add_pending(nmt_grad_windows *g) {
  if (g->pending_bucket < 0) return NMT_OK;
  const nmt_bucket_plan *p = g->plan;
  const int b = g->pending_bucket;
  const size_t slice = nmt_bucket_slice_floats(p, b);
  if (p->n_ranks > 1) NMT_TRY(nmt_comm_flush(g->comm));
  float *acc = g->shard + p->shard_offs[b];
  NMT_TRY(g->be->add(g->ctx, acc, acc, g->window[g->pending_window] + (size_t)g->rank * slice,
                     slice));
  g->pending_bucket = g->pending_window = -1;
  return NMT_OK;
}

nmt_status nmt_grad_windows_open(void *user, size_t begin, size_t end, float **window) {
  nmt_grad_windows *g = user;
  const nmt_bucket_plan *p = g->plan;
  const int b = p->bounds ? bucket_of(p, begin, end) : -1;
  if (b < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: gradient window for parameters [%zu, %zu) is "
                      "not a bucket of the ZeRO stage 2 plan", g->rank, begin, end);
  const size_t padded = nmt_bucket_slice_floats(p, b) * (size_t)p->n_ranks;
  if (b == g->held_bucket) { /* the embedding's: open through the whole backward */
    if (g->held_open || g->open_bucket >= 0)
      return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: gradient window of bucket %d opened %s",
                        g->rank, b, g->held_open ? "twice" : "while another is open");
    /* The previous micro-batch's backward ended with this window's reduce-scatter: its slice
     * goes into the shard before the window is zeroed for this one. */
    if (g->pending_window == 2) NMT_TRY(add_pending(g));
    NMT_TRY(g->be->memset_zero(g->ctx, g->window[2], padded * sizeof(float)));
    g->held_open = 1;
    *window = g->window[2];
    return NMT_OK;
  }
  if (g->open_bucket >= 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: gradient window of bucket %d opened while "
                      "bucket %d's is open", g->rank, b, g->open_bucket);
  /* The window other than the pending one: its last reduce-scatter was joined and added into
   * the shard before the pending one was issued, in stream order before this memset. */
  const int w = g->pending_window == 0 ? 1 : 0;
  NMT_TRY(g->be->memset_zero(g->ctx, g->window[w], padded * sizeof(float)));
  g->open_bucket = b, g->open_window = w;
  *window = g->window[w];
  return NMT_OK;
}

nmt_status nmt_grad_windows_close(void *user, size_t begin, size_t end) {
  nmt_grad_windows *g = user;
  const nmt_bucket_plan *p = g->plan;
  const int h = g->held_bucket;
  const int held = g->held_open && g->open_bucket < 0 && p->bounds[h] == begin &&
                   p->bounds[h + 1] == end;
  const int b = held ? h : g->open_bucket, win = held ? 2 : g->open_window;
  if (b < 0 || p->bounds[b] != begin || p->bounds[b + 1] != end)
    return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: closing gradient window [%zu, %zu), but the "
                      "open one is bucket %d", g->rank, begin, end, b);
  NMT_TRY(add_pending(g));
  if (b == g->fail_at_bucket)
    return nmt_errorf(NMT_ERR_INTERNAL, "injected failure on rank %d in the collective of "
                      "bucket %d", g->rank, b);
  const size_t padded = nmt_bucket_slice_floats(p, b) * (size_t)p->n_ranks;
  const int ranged = g->prof && g->range_ids;
  if (ranged) {
    nmt_prof_cost c = nmt_prof_cost_reduce_scatter((double)padded, p->n_ranks);
    nmt_prof_push(g->prof, g->range_ids[b], NMT_PROF_BWD, c.flops, c.bytes);
  }
  nmt_status s = nmt_bucket_reduce(p, g->comm, p->n_ranks, g->wire, g->abort, g->window[win],
                                   0, padded);
  if (ranged) nmt_prof_pop(g->prof);
  NMT_TRY(s);
  g->pending_bucket = b, g->pending_window = win;
  if (held) g->held_open = 0;
  else g->open_bucket = g->open_window = -1;
  g->closed++;
  return NMT_OK;
}

nmt_status nmt_grad_windows_finish(nmt_grad_windows *g) {
  const nmt_bucket_plan *p = g->plan;
  if (g->open_bucket >= 0 || g->held_open || g->closed < p->n_buckets)
    return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: backward closed %d gradient windows of the "
                      "plan's %d buckets%s", g->rank, g->closed, p->n_buckets,
                      g->open_bucket >= 0 || g->held_open ? " and left one open" : "");
  NMT_TRY(add_pending(g));
  return reduce_slots(g->comm, p->n_ranks, g->abort, g->shard + p->extra_offset);
}
