/* bucket_auto.c — parallel.bucket_mb = auto: the gradient bucket size, chosen at the start of
 * a run from what the run's own devices measure (docs/scaling.md, "bucket_mb = auto").
 *
 * What is measured, once the replicas and the communicator exist and before any step:
 *   - one backward on rank 0's replica: the time each gradient prefix becomes final (the
 *     model's grad-ready events), from a forward + backward of the longest synthetic
 *     micro-batch the config allows (warmup.c's shape; on a device every event is waited for,
 *     so the times are completion times);
 *   - the communicator the run will use (NCCL's, or the host's between CPU workers) at message
 *     sizes doubling from 256 KiB to the whole gradient (at most 64 MiB): the collective the
 *     plan runs (all-reduce; reduce-scatter with ZeRO stage 1), the slowest rank's mean.
 * What is chosen: the candidate size (nmt_bucket_candidates_mb) whose plan the scaling model
 * (nmt_bucket_choose) predicts to leave the least communication exposed: on CPU workers every
 * collective blocks compute, so the least total; on GPUs the comm stream overlaps backward.
 * The choice, with the numbers behind it, is one log line; it replaces "auto" in the run's
 * config (config.ini, every checkpoint's config), so a resume takes it from the checkpoint
 * instead of measuring again: the same buckets, the same sums.
 *
 * With several nodes every node measures (the collectives span the world), node 0 decides,
 * and the others read its choice from the rendezvous store, so every rank cuts the same
 * buckets. With ZeRO stage 2 the buckets are the model's backward stages: auto has nothing to
 * choose and says so. With one rank there is no collective: the default size is kept.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/bench.h"
#include "nmt/clock.h"
#include "nmt/log.h"
#include "nmt/rendezvous.h"
#include "run.h"
#include "zero.h"

/* The size a run without a choice keeps (one rank, ZeRO stage 2): the schema's default. */
static const double DEFAULT_MB = 25;

enum { MAX_COST = 24 };

/* The grad-ready events of the probe's backward, in ms from the start of its forward. */
typedef struct {
  const nmt_backend *be;
  void *ctx;
  double t0_s;
  int n;
  size_t floats[NMT_SCALING_MAX_EVENTS];
  double ms[NMT_SCALING_MAX_EVENTS];
} ready_log;

static nmt_status on_ready(void *user, size_t ready) {
  ready_log *l = user;
  /* A device returns before its kernels finish: wait, so this is a completion time. */
  if (!l->be->is_host) NMT_TRY(l->be->synchronize(l->ctx));
  if (l->n >= NMT_SCALING_MAX_EVENTS)
    return nmt_errorf(NMT_ERR_INTERNAL, "bucket_mb = auto: more than %d grad-ready events",
                      NMT_SCALING_MAX_EVENTS);
  l->floats[l->n] = ready;
  l->ms[l->n] = 1e3 * (nmt_clock_now_s() - l->t0_s);
  l->n++;
  return NMT_OK;
}

/* The communicator's cost table for the plan's collective (every local rank takes part). */
static nmt_status measure_comm(nmt_trainer *t, nmt_bucket_cost_point *cost, int *n_cost) {
  nmt_bench_allreduce_opts o;
  nmt_bench_allreduce_opts_default(&o);
  o.wire = t->cfg.parallel_grad_dtype;
  /* The bench's sizes are bytes on the wire: up to the one-bucket plan (the next doubling past
   * the gradient), at most 64 MiB, so a half wire does not make it allocate twice as much. */
  const size_t grad_bytes = (t->n_params + NMT_GRAD_EXTRA) * nmt_comm_wire_size(o.wire);
  o.min_bytes = 256 * 1024;
  o.max_bytes = 2 * grad_bytes < ((size_t)64 << 20) ? 2 * grad_bytes : (size_t)64 << 20;
  if (o.max_bytes < 2 * o.min_bytes) o.min_bytes = o.max_bytes / 4 / 4 * 4;
  o.warmup = 1, o.iters = 5;
  o.op = t->plan.zero == 1 ? NMT_BENCH_REDUCE_SCATTER : NMT_BENCH_ALLREDUCE;
  void **ctxs = calloc((size_t)t->n_dev, sizeof *ctxs);
  if (!ctxs) return nmt_errorf(NMT_ERR_NOMEM, "bucket_mb = auto: %d contexts", t->n_dev);
  for (int r = 0; r < t->n_dev; r++) ctxs[r] = t->workers[r].rep.ctx;
  nmt_bench_allreduce_row rows[MAX_COST];
  int n = 0;
  /* The host communicator reduces host memory: the bench allocates it without contexts. */
  nmt_status s = nmt_bench_allreduce_run(t->comms, t->n_dev, t->be, t->be->is_host ? NULL : ctxs,
                                         &o, rows, MAX_COST, &n);
  free(ctxs);
  NMT_TRY(s);
  /* Sizes in the gradients' fp32 bytes, as the plan counts them (any wire type). */
  *n_cost = 0;
  for (int i = 0; i < n; i++)
    cost[(*n_cost)++] = (nmt_bucket_cost_point){4.0 * (double)rows[i].count,
                                                rows[i].time_us * 1e-3};
  if (*n_cost < 2)
    return nmt_errorf(NMT_ERR_INTERNAL, "bucket_mb = auto: %d communicator sizes measured "
                      "(need 2)", *n_cost);
  return NMT_OK;
}

/* Measures, predicts and picks; logs the choice (rank 0's process, or every node with
 * `log`). *mb: the chosen size. */
static nmt_status measure_and_choose(nmt_trainer *t, double *mb) {
  ready_log *l = calloc(1, sizeof *l);
  if (!l) return nmt_errorf(NMT_ERR_NOMEM, "bucket_mb = auto: event log");
  l->be = t->be, l->ctx = t->workers[0].rep.ctx;
  double fwd_ms = 0, compute_ms = 0;
  nmt_status s = nmt__warmup_time_backward(t, on_ready, l, &l->t0_s, &fwd_ms, &compute_ms);
  nmt_bucket_cost_point cost[MAX_COST];
  int n_cost = 0;
  if (s == NMT_OK) s = measure_comm(t, cost, &n_cost);
  /* The bench refuses a sweep it could not check (a bf16 wire over more than 8 local ranks,
   * fp16 over more than 64: the exact-sum pattern no longer fits) or memory for its buffers:
   * nothing is in flight then, so keep the default size rather than refuse the run. */
  if (s == NMT_ERR_USAGE || s == NMT_ERR_NOMEM) {
    nmt_log(NMT_LOG_WARN, "parallel.bucket_mb = auto: the communicator could not be measured "
            "(%s); keeping %g MiB", nmt_last_error(), DEFAULT_MB);
    nmt_clear_error();
    free(l);
    *mb = DEFAULT_MB;
    return NMT_OK;
  }
  for (int k = 0; s == NMT_OK && k < l->n; k++)
    if (l->ms[k] > compute_ms) l->ms[k] = compute_ms; /* the clock read after the last wait */
  nmt_bucket_choice_row rows[NMT_BUCKET_CANDIDATES];
  int n_rows = 0, best = -1;
  if (s == NMT_OK) {
    const nmt_bucket_choice_in in = {
        .ready_floats = l->floats, .ready_ms = l->ms, .n_events = l->n,
        .compute_end_ms = compute_ms, .n_params = t->n_params, .zero = t->plan.zero,
        .n_ranks = t->world.world, .cost = cost, .n_cost = n_cost, .serial = t->be->is_host};
    s = nmt_bucket_choose(&in, rows, &n_rows, &best);
  }
  free(l);
  NMT_TRY(s);
  *mb = rows[best].bucket_mb;
  /* "... (1 MiB: 2.9 ms, 2 MiB: ...)": every distinct plan's exposed time. */
  char others[640] = "";
  size_t len = 0;
  for (int i = 0; i < n_rows && len < sizeof others; i++) {
    int k = snprintf(others + len, sizeof others - len, "%s%g MiB%s: %.2f ms", i ? ", " : "",
                     rows[i].bucket_mb, rows[i].n_buckets == 1 ? " (1 bucket)" : "",
                     rows[i].exposed_ms);
    if (k < 0) break;
    len += (size_t)k;
  }
  const nmt_bucket_cost_point *lo = &cost[0], *hi = &cost[n_cost - 1];
  nmt_log(NMT_LOG_INFO, "parallel.bucket_mb = auto = %g: %d bucket(s), exposed comm %.2f ms of "
          "%.2f ms (%s); measured: backward %.1f ms after a %.1f ms forward on rank 0, %s "
          "%.2f ms at %.2f MiB .. %.2f ms at %.2f MiB over %d rank(s), %s", *mb,
          rows[best].n_buckets, rows[best].exposed_ms, rows[best].comm_ms, others,
          compute_ms - fwd_ms, fwd_ms, t->plan.zero == 1 ? "reduce-scatter" : "all-reduce",
          lo->ms, lo->bytes / 1048576.0, hi->ms, hi->bytes / 1048576.0, t->world.world,
          t->be->is_host ? "collectives block the CPU workers (exposed = all)"
                         : "overlapped with backward on the comm stream");
  return NMT_OK;
}

/* Several nodes: node 0's choice, read by the others from the rendezvous store. */
static nmt_status agree(nmt_trainer *t, double *mb) {
  nmt_rendezvous *rv = NULL;
  NMT_TRY(nmt_rendezvous_open(t->world.rendezvous, "nmt", t->world.timeout_s, &rv));
  nmt_rendezvous_watch(rv, &t->sync.abort);
  char text[64];
  nmt_status s;
  if (t->world.node_rank == 0) {
    int n = snprintf(text, sizeof text, "%.17g", *mb);
    s = nmt_rendezvous_set(rv, "bucket_mb", text, (size_t)n);
  } else {
    size_t len = 0;
    s = nmt_rendezvous_get(rv, "bucket_mb", text, sizeof text - 1, &len);
    if (s == NMT_OK) {
      text[len] = 0;
      char *end;
      double v = strtod(text, &end);
      if (end == text || *end || !(v > 0))
        s = nmt_errorf(NMT_ERR_INTERNAL, "bucket_mb = auto: node 0 published \"%s\"", text);
      else if (v != *mb)
        nmt_log(NMT_LOG_INFO, "parallel.bucket_mb = auto: node 0 chose %g MiB (this node's "
                "measurements: %g)", v, *mb);
      if (s == NMT_OK) *mb = v;
    }
  }
  nmt_rendezvous_close(rv);
  return s;
}

void nmt__bucket_auto_resumed(nmt_trainer *t, const char *config_text) {
  if (t->cfg.parallel_bucket_mb != NMT_BUCKET_MB_AUTO || !config_text) return;
  /* The checkpoint's [parallel] bucket_mb line (nmt_config_dump's "key = value"). */
  const char *sec = strstr(config_text, "\n[parallel]");
  const char *p = sec ? strstr(sec, "\nbucket_mb = ") : NULL;
  const char *next = sec ? strstr(sec + 1, "\n[") : NULL;
  if (!p || (next && p > next)) return;
  char *end;
  double v = strtod(p + strlen("\nbucket_mb = "), &end);
  if (!(v > 0) || (*end != '\n' && *end)) return; /* "auto": that run chose nothing */
  /* The buffers are sized for the smallest candidate's plan: a smaller size (set by hand
   * before, now auto) is measured anew. */
  if (v < nmt_bucket_candidates_mb[0]) {
    nmt_log(NMT_LOG_WARN, "parallel.bucket_mb = auto: the checkpoint's run used %g MiB, below "
            "auto's smallest candidate (%g MiB); choosing anew", v, nmt_bucket_candidates_mb[0]);
    return;
  }
  t->bucket_mb_resumed = v;
}

nmt_status nmt__bucket_auto(nmt_trainer *t) {
  if (t->cfg.parallel_bucket_mb != NMT_BUCKET_MB_AUTO) return NMT_OK;
  double mb = DEFAULT_MB;
  if (t->plan.zero == 2) {
    nmt_log(NMT_LOG_INFO, "parallel.bucket_mb = auto: nothing to choose with parallel.zero = 2, "
            "whose buckets are the model's backward stages (%d)", t->plan.n_buckets);
  } else if (t->bucket_mb_resumed > 0) {
    mb = t->bucket_mb_resumed;
    nmt_log(NMT_LOG_INFO, "parallel.bucket_mb = auto = %g, as the checkpoint's run chose it "
            "(the same buckets as before the resume)", mb);
  } else if (t->world.world < 2) {
    nmt_log(NMT_LOG_INFO, "parallel.bucket_mb = auto: one rank, no collective to size; %g "
            "MiB", mb);
  } else {
    NMT_TRY(measure_and_choose(t, &mb));
    if (t->world.multi) NMT_TRY(agree(t, &mb));
  }
  if (t->plan.zero != 2) {
    nmt_bucket_plan plan;
    if (t->plan.zero == 1)
      NMT_TRY(nmt_bucket_plan_make_sharded(mb, t->n_params, t->world.world, 1, 0, &plan));
    else
      NMT_TRY(nmt_bucket_plan_make(mb, t->n_params, NMT_GRAD_EXTRA, 0, &plan));
    /* The buffers were sized by the provisional plan (nmt__bucket_auto_provisional_mb): the
     * same floats, no more buckets. */
    if (plan.total_floats != t->plan.total_floats || plan.n_buckets > t->plan.n_buckets)
      return nmt_errorf(NMT_ERR_INTERNAL, "bucket_mb = auto: the plan of %g MiB (%zu floats, "
                        "%d buckets) does not fit the provisional one (%zu floats, %d buckets)",
                        mb, plan.total_floats, plan.n_buckets, t->plan.total_floats,
                        t->plan.n_buckets);
    t->plan = plan;
    /* ZeRO stage 1: a shard's moments are laid out by the plan (each bucket's slice), and the
     * replicas loaded the resumed ones under the provisional plan: load them again. */
    if (plan.zero == 1)
      for (int r = 0; r < t->n_dev; r++)
        NMT_TRY(nmt__zero_load_moments(&t->workers[r].rep, t->init_m, t->init_v));
  }
  /* The run's config says what it ran: the checkpoints' config, and config.ini (written from
   * t->cfg once setup is done: nmt__rundir_open). */
  t->cfg.parallel_bucket_mb = (float)mb;
  return nmt_ckpt_meta_set_config(&t->cfg, &t->ckpt_meta);
}

double nmt__bucket_auto_provisional_mb(const nmt_config *cfg) {
  return cfg->parallel_bucket_mb == NMT_BUCKET_MB_AUTO ? nmt_bucket_candidates_mb[0]
                                                       : cfg->parallel_bucket_mb;
}
