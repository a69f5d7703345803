/* scaling_model.c — the weak-scaling model of `nmt bench scaling` (include/nmt/bench.h,
 * docs/scaling.md): buckets from a measured backward, one comm stream overlapping it, the
 * predicted step time. Pure functions of their inputs: tested without measuring anything.
 */
#include <math.h>
#include <string.h>

#include "nmt/bench.h"
#include "nmt/buckets.h"

/* ------------------------------------------------------------------------------------------ */
/* the model                                                                                  */

nmt_status nmt_scaling_predict(const nmt_scaling_profile *p, int n_devices,
                               const nmt_scaling_link *l, nmt_scaling_pred *out) {
  memset(out, 0, sizeof *out);
  if (n_devices < 1) return nmt_errorf(NMT_ERR_USAGE, "scaling model: %d devices", n_devices);
  if (!(p->fwd_ms >= 0 && p->bwd_ms >= 0 && p->opt_ms >= 0) || p->n_buckets < 0 ||
      (p->n_buckets > 0 && (!p->bytes || !p->ready_ms)) || !(l->latency_us >= 0))
    return nmt_errorf(NMT_ERR_USAGE, "scaling model: negative time, size or latency");
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
  const int comm = n_devices > 1;
  const int infinite = !(l->busbw_gbs > 0) || isinf(l->busbw_gbs);
  const double factor = nmt_bench_busbw_factor(n_devices);
  double end = 0, total = 0;
  for (int b = 0; b < p->n_buckets; b++) {
    double t = 0;
    if (comm) {
      /* bytes / (GB/s * 1e9) s = bytes / (GB/s * 1e6) ms */
      t = l->latency_us * 1e-3 + (infinite ? 0 : p->bytes[b] * factor / (l->busbw_gbs * 1e6));
    }
    double start = p->ready_ms[b] > end ? p->ready_ms[b] : end;
    end = start + t;
    total += t;
  }
  out->allreduce_ms = total;
  if (l->serial) {
    /* Each all-reduce runs on the compute thread between two pieces of backward. */
    out->exposed_ms = total;
    out->comm_end_ms = compute_end + total;
  } else {
    out->comm_end_ms = p->n_buckets > 0 ? end : compute_end;
    out->exposed_ms = end > compute_end ? end - compute_end : 0;
  }
  out->step_ms = compute_end + out->exposed_ms + p->opt_ms;
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
  int k = 0;
  for (int b = 0; b < plan.n_buckets; b++) {
    size_t begin, end;
    nmt_bucket_range(&plan, b, &begin, &end);
    while (k < n_events && ready_floats[k] < end) k++;
    if (k == n_events)
      return nmt_errorf(NMT_ERR_USAGE, "no grad-ready event covers floats [%zu, %zu) of %zu",
                        begin, end, total_floats);
    bytes_out[b] = (double)(end - begin) * sizeof(float);
    ready_out[b] = ready_ms[k];
  }
  *n_buckets = plan.n_buckets;
  return NMT_OK;
}

int nmt_scaling_best(const nmt_scaling_pred *preds, int n) {
  int best = n > 0 ? 0 : -1;
  for (int i = 1; i < n; i++)
    if (preds[i].step_ms < preds[best].step_ms) best = i;
  return best;
}
