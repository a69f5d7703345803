/* scaling_model.c — the weak-scaling model of `nmt bench scaling` (include/nmt/bench.h,
 * docs/scaling.md): buckets from a measured backward, one comm stream overlapping it, the
 * collectives of ZeRO's stages, the time of a collective within one node or across several,
 * the predicted step time. Pure functions of their inputs: tested without measuring anything.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/backend.h" /* NMT_GRAD_EXTRA */
#include "nmt/bench.h"
#include "nmt/buckets.h"
#include "nmt/comm.h"

/* ------------------------------------------------------------------------------------------ */
/* the model                                                                                  */

static int infinite_bw(double gbs) { return !(gbs > 0) || isinf(gbs); }

/* bytes / (GB/s * 1e9) s = bytes / (GB/s * 1e6) ms */
static double transfer_ms(double bytes, double gbs) {
  return infinite_bw(gbs) ? 0 : bytes / (gbs * 1e6);
}

double nmt_scaling_collective_ms(const nmt_scaling_link *l, nmt_bench_op op, int n_devices,
                                 double bytes) {
  if (op != NMT_BENCH_ALLREDUCE && op != NMT_BENCH_REDUCE_SCATTER && op != NMT_BENCH_ALL_GATHER)
    return NAN;
  if (n_devices < 2) return 0;
  const double f = nmt_bench_op_busbw_factor(op, n_devices), lat_ms = l->latency_us * 1e-3;
  if (l->nodes < 2) return lat_ms + transfer_ms(bytes * f, l->busbw_gbs);
  const int K = l->nodes, G = l->gpus_per_node;
  if (G < 1 || (long long)K * G != n_devices) return NAN;
  if (l->algo == NMT_SCALING_TWO_LEVEL && op == NMT_BENCH_ALLREDUCE)
    return lat_ms + 2.0 * (K - 1) * l->net_step_us * 1e-3 +
           2.0 * transfer_ms(bytes * (G - 1) / G, l->busbw_gbs) +
           transfer_ms(bytes * 2.0 * (K - 1) / K, l->net_busbw_gbs);
  const double passes = op == NMT_BENCH_ALLREDUCE ? 2 : 1;
  double bw = l->busbw_gbs;
  if (infinite_bw(bw) || (!infinite_bw(l->net_busbw_gbs) && l->net_busbw_gbs < bw))
    bw = l->net_busbw_gbs;
  return lat_ms + passes * (K - 1) * (l->net_step_us + (G - 1) * l->intra_step_us) * 1e-3 +
         transfer_ms(bytes * f, bw);
}

static nmt_status check_profile(const nmt_scaling_profile *p, int n_devices,
                                const nmt_scaling_link *l) {
  if (n_devices < 1) return nmt_errorf(NMT_ERR_USAGE, "scaling model: %d devices", n_devices);
  if (!(p->fwd_ms >= 0 && p->bwd_ms >= 0 && p->opt_ms >= 0) || p->n_buckets < 0 ||
      (p->n_buckets > 0 && (!p->bytes || !p->ready_ms)) || !(l->latency_us >= 0))
    return nmt_errorf(NMT_ERR_USAGE, "scaling model: negative time, size or latency");
  if (l->nodes >= 2 && (l->gpus_per_node < 1 || (long long)l->nodes * l->gpus_per_node != n_devices ||
                        !(l->net_step_us >= 0) || !(l->intra_step_us >= 0)))
    return nmt_errorf(NMT_ERR_USAGE, "scaling model: %d devices on %d nodes of %d GPUs (or a "
                      "negative step latency)", n_devices, l->nodes, l->gpus_per_node);
  const double compute_end = p->fwd_ms + p->bwd_ms;
  /* Averaged measurements may round a hair past the backward's end. */
  const double slack = 1e-9 * compute_end + 1e-12;
  for (int b = 0; b < p->n_buckets; b++) {
    if (!(p->bytes[b] >= 0) || !(p->ready_ms[b] >= 0) || p->ready_ms[b] > compute_end + slack ||
        (b > 0 && p->ready_ms[b] < p->ready_ms[b - 1]))
      return nmt_errorf(NMT_ERR_USAGE, "scaling model: bucket %d (%g bytes, ready at %g ms) is "
                        "not within the step's %g ms of compute or not in order", b,
                        p->bytes[b], p->ready_ms[b], compute_end);
  }
  return NMT_OK;
}

nmt_status nmt_scaling_predict_zero(const nmt_scaling_profile *p, int n_devices,
                                    const nmt_scaling_link *l, const nmt_scaling_zero *z,
                                    nmt_scaling_pred *out) {
  memset(out, 0, sizeof *out);
  NMT_TRY(check_profile(p, n_devices, l));
  if (z->zero < 0 || z->zero > 2 || z->accum < 1 || !(z->period_ms >= 0) ||
      (z->zero >= 1 && p->n_buckets > 0 && !z->gather_bytes))
    return nmt_errorf(NMT_ERR_USAGE, "scaling model: zero %d, accum %d, period %g ms%s", z->zero,
                      z->accum, z->period_ms,
                      z->zero >= 1 && !z->gather_bytes ? ", no all-gather sizes" : "");
  const double compute_end = p->fwd_ms + p->bwd_ms;
  const nmt_bench_op op = z->zero ? NMT_BENCH_REDUCE_SCATTER : NMT_BENCH_ALLREDUCE;
  const int passes = z->zero == 2 ? z->accum : 1;
  double end = 0, total = 0;
  for (int a = 0; a < passes; a++) {
    const double shift = (passes - 1 - a) * z->period_ms;
    for (int b = 0; b < p->n_buckets; b++) {
      double t = nmt_scaling_collective_ms(l, op, n_devices, p->bytes[b]);
      double ready = p->ready_ms[b] - shift > 0 ? p->ready_ms[b] - shift : 0;
      double start = ready > end ? ready : end;
      end = start + t;
      total += t;
    }
    if (z->zero && p->n_buckets > 0) {
      /* The trailing slots (loss, tokens, ...) follow the last bucket, in fp32. */
      double t = nmt_scaling_collective_ms(l, NMT_BENCH_ALLREDUCE, n_devices,
                                           4.0 * NMT_GRAD_EXTRA);
      end += t;
      total += t;
    }
  }
  out->allreduce_ms = total;
  if (l->serial) {
    /* Each collective runs on the compute thread between two pieces of backward. */
    out->exposed_ms = total;
    out->comm_end_ms = compute_end + total;
  } else {
    out->comm_end_ms = p->n_buckets > 0 ? end : compute_end;
    out->exposed_ms = end > compute_end ? end - compute_end : 0;
  }
  if (z->zero) {
    out->norm_ms = nmt_scaling_collective_ms(l, NMT_BENCH_ALLREDUCE, n_devices, 4.0);
    for (int b = 0; b < p->n_buckets; b++) {
      out->gather_ms += nmt_scaling_collective_ms(l, NMT_BENCH_ALL_GATHER, n_devices,
                                                  z->gather_bytes[b]);
    }
  }
  out->opt_ms = p->opt_ms;
  out->step_ms = compute_end + out->exposed_ms + out->norm_ms + p->opt_ms + out->gather_ms;
  return NMT_OK;
}

nmt_status nmt_scaling_zero_bytes(const nmt_bucket_plan *plan, int n_ranks, int accum,
                                  nmt_grad_dtype wire, nmt_scaling_step_bytes *out) {
  memset(out, 0, sizeof *out);
  if (accum < 1 || n_ranks < 1 || (plan->zero && plan->n_ranks != n_ranks))
    return nmt_errorf(NMT_ERR_USAGE, "step bytes: accum %d, %d ranks (plan cut for %d)", accum,
                      n_ranks, plan->n_ranks);
  const int n = n_ranks;
  const double w = (double)nmt_comm_wire_size(wire), slots = 4.0 * NMT_GRAD_EXTRA;
  const double f_ar = nmt_bench_op_busbw_factor(NMT_BENCH_ALLREDUCE, n);
  const double f_rs = nmt_bench_op_busbw_factor(NMT_BENCH_REDUCE_SCATTER, n);
  const double f_ag = nmt_bench_op_busbw_factor(NMT_BENCH_ALL_GATHER, n);
  if (!plan->zero) {
    /* The slots travel in the last bucket in fp32, or alone beside a 16-bit wire. */
    out->backward_bytes = (double)plan->n_params * w + slots;
    size_t begin = 0, end = 0;
    if (plan->n_buckets > 0) nmt_bucket_range(plan, plan->n_buckets - 1, &begin, &end);
    out->calls = plan->n_buckets + (w < 4 && plan->n_buckets > 0 && begin < plan->n_params);
    out->bus_bytes = out->backward_bytes * f_ar;
    return NMT_OK;
  }
  const double span = (double)plan->total_floats;
  const int passes = plan->zero == 2 ? accum : 1;
  out->backward_bytes = passes * (span * w + slots);
  out->gather_bytes = 4.0 * span + 4.0;
  out->calls = passes * (plan->n_buckets + 1) + 1 + plan->n_buckets;
  out->bus_bytes = passes * (span * w * f_rs + slots * f_ar) + 4.0 * f_ar + 4.0 * span * f_ag;
  return NMT_OK;
}

nmt_status nmt_scaling_predict(const nmt_scaling_profile *p, int n_devices,
                               const nmt_scaling_link *l, nmt_scaling_pred *out) {
  const nmt_scaling_zero z0 = {.zero = 0, .accum = 1};
  return nmt_scaling_predict_zero(p, n_devices, l, &z0, out);
}

nmt_status nmt_scaling_buckets_plan(const nmt_bucket_plan *plan, const size_t *ready_floats,
                                    const double *ready_ms, int n_events, double *bytes_out,
                                    double *ready_out, int cap, int *n_buckets) {
  *n_buckets = 0;
  if (plan->n_buckets > cap)
    return nmt_errorf(NMT_ERR_USAGE, "%d buckets for a table of %d", plan->n_buckets, cap);
  /* The gradients a bucket waits for: ZeRO's pad is never written, its slots travel alone. */
  const size_t written = plan->zero ? plan->n_params : plan->total_floats;
  int k = 0;
  for (int b = 0; b < plan->n_buckets; b++) {
    size_t begin, end;
    nmt_bucket_range(plan, b, &begin, &end);
    const size_t needed = end < written ? end : written;
    while (k < n_events && ready_floats[k] < needed) k++;
    if (k == n_events)
      return nmt_errorf(NMT_ERR_USAGE, "no grad-ready event covers floats [%zu, %zu) of %zu",
                        begin, needed, written);
    bytes_out[b] = (double)(end - begin) * sizeof(float);
    ready_out[b] = ready_ms[k];
  }
  *n_buckets = plan->n_buckets;
  return NMT_OK;
}

nmt_status nmt_scaling_buckets(size_t total_floats, const size_t *ready_floats,
                               const double *ready_ms, int n_events, double bucket_mb,
                               double *bytes_out, double *ready_out, int cap, int *n_buckets) {
  *n_buckets = 0;
  if (!(bucket_mb > 0)) return nmt_errorf(NMT_ERR_USAGE, "bucket size %g MiB (must be > 0)", bucket_mb);
  if (total_floats == 0) return NMT_OK;
  /* The trainer's plan (nmt/buckets.h); the trailing slots are part of total_floats. */
  nmt_bucket_plan plan;
  if (cap < 1) return nmt_errorf(NMT_ERR_USAGE, "bucket table of capacity %d", cap);
  NMT_TRY(nmt_bucket_plan_make(bucket_mb, total_floats, 0, (size_t)cap, &plan));
  return nmt_scaling_buckets_plan(&plan, ready_floats, ready_ms, n_events, bytes_out, ready_out,
                                  cap, n_buckets);
}

size_t nmt_scaling_largest_stage(const size_t *ready_floats, int n_events, size_t n_params) {
  size_t prev = 0, best = 0;
  for (int k = 0; k < n_events; k++) {
    size_t r = ready_floats[k] < n_params ? ready_floats[k] : n_params;
    if (r > prev && r - prev > best) best = r - prev;
    if (r > prev) prev = r;
  }
  return best;
}

int nmt_scaling_best(const nmt_scaling_pred *preds, int n) {
  int best = n > 0 ? 0 : -1;
  for (int i = 1; i < n; i++)
    if (preds[i].step_ms < preds[best].step_ms) best = i;
  return best;
}

/* ------------------------------------------------------------------------------------------ */
/* parallel.bucket_mb = auto                                                                  */

const double nmt_bucket_candidates_mb[NMT_BUCKET_CANDIDATES] = {1,  2,  4,  8,   16,
                                                                25, 32, 64, 128, 256};

/* The cost table's time for `bytes`: piecewise linear, the end segments' slopes (>= 0) beyond. */
static double cost_ms(const nmt_bucket_cost_point *c, int n, double bytes) {
  int i = 0;
  while (i < n - 2 && bytes > c[i + 1].bytes) i++;
  const double db = c[i + 1].bytes - c[i].bytes;
  double slope = db > 0 ? (c[i + 1].ms - c[i].ms) / db : 0;
  const int outside = bytes < c[0].bytes || bytes > c[n - 1].bytes;
  if (outside && slope < 0) slope = 0;
  const double t = c[i].ms + slope * (bytes - c[i].bytes);
  return t > 0 ? t : 0;
}

static nmt_status check_choice_in(const nmt_bucket_choice_in *in) {
  if (in->n_cost < 2 || (in->zero != 0 && in->zero != 1) || in->n_ranks < 1 ||
      in->n_events < 1 || !(in->compute_end_ms >= 0))
    return nmt_errorf(NMT_ERR_USAGE, "bucket choice: %d cost points (need >= 2), zero %d (0 or "
                      "1), %d ranks, %d grad-ready events", in->n_cost, in->zero, in->n_ranks,
                      in->n_events);
  for (int i = 0; i < in->n_cost; i++)
    if (!(in->cost[i].ms >= 0) || !(in->cost[i].bytes > 0) ||
        (i > 0 && !(in->cost[i].bytes > in->cost[i - 1].bytes)))
      return nmt_errorf(NMT_ERR_USAGE, "bucket choice: cost point %d (%g bytes, %g ms) is "
                        "negative or not ascending", i, in->cost[i].bytes, in->cost[i].ms);
  for (int k = 0; k < in->n_events; k++)
    if (!(in->ready_ms[k] >= 0) || in->ready_ms[k] > in->compute_end_ms * (1 + 1e-9) + 1e-12 ||
        (k > 0 && in->ready_ms[k] < in->ready_ms[k - 1]))
      return nmt_errorf(NMT_ERR_USAGE, "bucket choice: grad-ready event %d at %g ms is out of "
                        "order or past the compute's end (%g ms)", k, in->ready_ms[k],
                        in->compute_end_ms);
  return NMT_OK;
}

/* One candidate's plan through the recurrence. bytes/ready: scratch of cap entries. */
static nmt_status predict_choice(const nmt_bucket_choice_in *in, double mb, double *bytes,
                                 double *ready, int cap, nmt_bucket_choice_row *row) {
  nmt_bucket_plan plan;
  if (in->zero) NMT_TRY(nmt_bucket_plan_make_sharded(mb, in->n_params, in->n_ranks, 1,
                                                     (size_t)cap, &plan));
  else NMT_TRY(nmt_bucket_plan_make(mb, in->n_params, NMT_GRAD_EXTRA, (size_t)cap, &plan));
  int nb = 0;
  NMT_TRY(nmt_scaling_buckets_plan(&plan, in->ready_floats, in->ready_ms, in->n_events, bytes,
                                   ready, cap, &nb));
  double end = 0, total = 0;
  for (int b = 0; b < nb; b++) {
    const double t = cost_ms(in->cost, in->n_cost, bytes[b]);
    const double start = ready[b] > end ? ready[b] : end;
    end = start + t;
    total += t;
  }
  *row = (nmt_bucket_choice_row){.bucket_mb = mb, .n_buckets = nb, .comm_ms = total};
  row->exposed_ms = in->serial ? total : end > in->compute_end_ms ? end - in->compute_end_ms : 0;
  return NMT_OK;
}

nmt_status nmt_bucket_choose(const nmt_bucket_choice_in *in, nmt_bucket_choice_row *rows,
                             int *n_rows, int *best) {
  *n_rows = 0, *best = -1;
  NMT_TRY(check_choice_in(in));
  /* The most buckets any candidate makes: the smallest size's plan. */
  const double floats_mb = 1048576.0 / sizeof(float);
  const size_t most = (in->n_params + NMT_GRAD_EXTRA) /
                          (size_t)(nmt_bucket_candidates_mb[0] * floats_mb) + 2;
  const int cap = most > (size_t)1 << 24 ? 1 << 24 : (int)most;
  double *bytes = malloc((size_t)cap * sizeof *bytes), *ready = malloc((size_t)cap * sizeof *ready);
  nmt_status s = bytes && ready ? NMT_OK
                                 : nmt_errorf(NMT_ERR_NOMEM, "bucket choice: %d buckets", cap);
  for (int i = 0; s == NMT_OK && i < NMT_BUCKET_CANDIDATES; i++) {
    nmt_bucket_choice_row r;
    s = predict_choice(in, nmt_bucket_candidates_mb[i], bytes, ready, cap, &r);
    /* A size past the whole gradient repeats the one-bucket plan. */
    if (s == NMT_OK && (*n_rows == 0 || r.n_buckets != rows[*n_rows - 1].n_buckets))
      rows[(*n_rows)++] = r;
  }
  free(bytes), free(ready);
  NMT_TRY(s);
  double least = INFINITY;
  for (int i = 0; i < *n_rows; i++)
    if (rows[i].exposed_ms < least) least = rows[i].exposed_ms;
  const double tol = least * 0.01 > 0.01 ? least * 0.01 : 0.01;
  for (int i = 0; i < *n_rows; i++) {
    if (rows[i].exposed_ms > least + tol) continue;
    if (*best < 0 || rows[i].comm_ms <= rows[*best].comm_ms) *best = i;
  }
  return NMT_OK;
}
