/* scaling_measure.c — `nmt bench scaling`'s measurement of ONE device (include/nmt/bench.h):
 * forward, backward with the time of every grad-ready callback, and the update, on real
 * batches of the config's training shard, timed step by step. Everything about N devices is
 * predicted from it (scaling_model.c).
 */
#include <stdlib.h>
#include <string.h>

#include "nmt/backend.h"
#include "nmt/bench.h"
#include "nmt/data.h"
#include "nmt/device.h"
#include "nmt/log.h"
#include "nmt/model.h"
#include "nmt/trainer.h"

void openblas_set_num_threads(int num_threads);

/* ------------------------------------------------------------------------------------------ */
/* measuring one device                                                                       */

typedef struct {
  const nmt_backend *be;
  void *ctx;
  int record;      /* this backward's events count (last micro-batch of a timed step) */
  int first;       /* first recorded step: learn the prefixes */
  double t0;       /* start of this backward (s) */
  double offset_s; /* compute time of the step before this backward */
  int k;           /* events seen in this backward */
  nmt_scaling_measurement *m;
  double *sum_ms;  /* (NMT_SCALING_MAX_EVENTS) */
} ready_probe;

static nmt_status on_ready(void *user, size_t ready) {
  ready_probe *p = user;
  if (!p->record) return NMT_OK;
  /* A device backend returns before its kernels finish: wait, so this is a completion time. */
  if (!p->be->is_host) NMT_TRY(p->be->synchronize(p->ctx));
  double t = p->offset_s + (nmt__bench_now_s() - p->t0);
  nmt_scaling_measurement *m = p->m;
  if (p->k >= NMT_SCALING_MAX_EVENTS)
    return nmt_errorf(NMT_ERR_INTERNAL, "bench scaling: more than %d grad-ready events",
                      NMT_SCALING_MAX_EVENTS);
  if (p->first) {
    m->ready_floats[p->k] = ready;
    m->n_events = p->k + 1;
  } else if (p->k >= m->n_events || m->ready_floats[p->k] != ready) {
    return nmt_errorf(NMT_ERR_INTERNAL, "bench scaling: grad-ready event %d reported %zu floats, "
                      "an earlier step %zu", p->k, ready,
                      p->k < m->n_events ? m->ready_floats[p->k] : (size_t)0);
  }
  p->sum_ms[p->k] += 1e3 * t;
  p->k++;
  return NMT_OK;
}

typedef struct {
  const nmt_backend *be;
  void *ctx;
  nmt_model *model;
  float *params, *grads, *m, *v;
  nmt_step_ctl *ctl; /* the trainer's step control block */
  int32_t *dev_buf, *host_buf;
  float *host_params;
  nmt_shard *shard;
  nmt_batcher *batcher;
  long *perm;
  double *sum_ms;
} rig;

static void rig_free(rig *r) {
  if (r->model) nmt_model_destroy(r->model);
  if (r->be) {
    r->be->free(r->ctx, r->params), r->be->free(r->ctx, r->grads);
    r->be->free(r->ctx, r->m), r->be->free(r->ctx, r->v);
    r->be->free(r->ctx, r->ctl), r->be->free(r->ctx, r->dev_buf);
    nmt_device dev = {.be = r->be, .ctx = r->ctx};
    nmt_device_close(&dev);
  }
  if (r->batcher) nmt_batcher_destroy(r->batcher);
  if (r->shard) nmt_shard_close(r->shard);
  free(r->host_buf), free(r->host_params), free(r->perm), free(r->sum_ms);
}

static nmt_status sync_if_device(const rig *r) {
  if (!r->be->is_host) return r->be->synchronize(r->ctx);
  return NMT_OK;
}

static nmt_status measure(const nmt_config *cfg, int warmup, int steps, rig *r,
                          nmt_scaling_measurement *out) {
  /* The device rank 0 of a run would use. */
  nmt_device dev;
  NMT_TRY(nmt_device_open(cfg, NULL, 0, NMT_DEVICE_TRAIN, NULL, &dev));
  r->be = dev.be, r->ctx = dev.ctx;
  /* One BLAS thread, as a trainer worker has (the workers are the parallelism). */
  if (r->be->is_host) openblas_set_num_threads(1);
  out->backend = r->be->name;
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(cfg, &mc);
  const size_t n = nmt_model_num_params(&mc), total = n + NMT_GRAD_EXTRA;
  out->n_params = n, out->total_floats = total;
  if (!cfg->data_train[0])
    return nmt_errorf(NMT_ERR_CONFIG, "[data] train is empty: the bench trains on real batches");
  NMT_TRY(nmt_shard_open(cfg->data_train, 0, &r->shard));
  if (nmt_shard_vocab(r->shard) != cfg->model_vocab)
    return nmt_errorf(NMT_ERR_CONFIG, "[model] vocab = %d but %s has vocab %d", cfg->model_vocab,
                      cfg->data_train, nmt_shard_vocab(r->shard));
  NMT_TRY(nmt_batcher_create(r->shard, cfg->data_max_tokens, cfg->data_max_len, cfg->run_seed,
                             &r->batcher));
  long nb = nmt_batcher_num_batches(r->batcher);
  r->perm = malloc((size_t)nb * sizeof *r->perm);
  const size_t ints = 5 * (size_t)cfg->data_max_tokens + 16; /* as the trainer sizes it */
  r->host_buf = malloc(ints * sizeof(int32_t));
  r->host_params = malloc(n * sizeof(float));
  r->sum_ms = calloc(NMT_SCALING_MAX_EVENTS, sizeof *r->sum_ms);
  if (!r->perm || !r->host_buf || !r->host_params || !r->sum_ms)
    return nmt_errorf(NMT_ERR_NOMEM, "bench scaling: host buffers for %zu parameters", n);
  nmt_batcher_epoch_order(r->batcher, 0, r->perm);

  NMT_TRY(nmt_model_create(&mc, r->be, r->ctx, cfg->data_max_tokens, cfg->data_max_len,
                           &r->model));
  const nmt_backend *be = r->be;
  NMT_TRY(be->malloc(r->ctx, n * sizeof(float), (void **)&r->params));
  NMT_TRY(be->malloc(r->ctx, total * sizeof(float), (void **)&r->grads));
  NMT_TRY(be->malloc(r->ctx, n * sizeof(float), (void **)&r->m));
  NMT_TRY(be->malloc(r->ctx, n * sizeof(float), (void **)&r->v));
  NMT_TRY(be->malloc(r->ctx, sizeof *r->ctl, (void **)&r->ctl));
  const nmt_step_ctl ctl0 = {.scale = 1.0f};
  NMT_TRY(be->copy_h2d(r->ctx, r->ctl, &ctl0, sizeof ctl0));
  NMT_TRY(be->malloc(r->ctx, ints * sizeof(int32_t), (void **)&r->dev_buf));
  nmt_model_init_params(&mc, cfg->run_seed, r->host_params);
  NMT_TRY(be->copy_h2d(r->ctx, r->params, r->host_params, n * sizeof(float)));
  NMT_TRY(be->memset_zero(r->ctx, r->m, n * sizeof(float)));
  NMT_TRY(be->memset_zero(r->ctx, r->v, n * sizeof(float)));

  const int accum = cfg->train_accum_steps;
  out->warmup = warmup, out->steps = steps, out->accum = accum;
  out->measured_max_tokens = cfg->data_max_tokens, out->measured_accum = accum;
  ready_probe probe = {.be = be, .ctx = r->ctx, .m = out, .sum_ms = r->sum_ms, .first = 1};
  double fwd = 0, bwd = 0, opt = 0, step_s = 0, tokens = 0, flops = 0;
  long pos = 0;
  for (int step = 0; step < warmup + steps; step++) {
    const int timed = step >= warmup;
    /* On a CPU a base-model step takes seconds: say where the measurement is. */
    const char *kind = timed ? "timed" : "warmup";
    double t_step = nmt__bench_now_s(), fill_s = 0, f_s = 0, b_s = 0, o_s = 0;
    double t = nmt__bench_now_s();
    NMT_TRY(be->memset_zero(r->ctx, r->grads, total * sizeof(float)));
    NMT_TRY(sync_if_device(r));
    o_s += nmt__bench_now_s() - t;
    double step_tokens = 0, step_flops = 0;
    for (int a = 0; a < accum; a++) {
      /* Forming the batch is the loader thread's work in the trainer: not timed. */
      t = nmt__bench_now_s();
      long id = r->perm[pos++ % nb];
      int ns, sl, tl;
      long tt;
      nmt_batcher_shape(r->batcher, id, &ns, &sl, &tl, &tt);
      nmt_batch hb, db;
      nmt_batch_layout(&hb, r->host_buf, ns, sl, tl);
      nmt_batcher_fill(r->batcher, id, &hb);
      nmt_batch_layout(&db, r->dev_buf, ns, sl, tl);
      db.src_tokens = hb.src_tokens, db.tgt_tokens = hb.tgt_tokens;
      fill_s += nmt__bench_now_s() - t;
      step_tokens += (double)hb.tgt_tokens;
      step_flops += nmt_model_train_flops(&mc, ns, sl, tl);

      nmt_log_progress("bench scaling: measuring step %d/%d (%s): forward %d/%d", step + 1,
                       warmup + steps, kind, a + 1, accum);
      t = nmt__bench_now_s();
      /* nmt_batch_layout packs the arrays from the buffer's start: one copy moves the batch. */
      NMT_TRY(be->copy_h2d(r->ctx, r->dev_buf, r->host_buf, ints * sizeof(int32_t)));
      uint64_t rng_step = (uint64_t)step * (uint64_t)accum + (uint64_t)a;
      NMT_TRY(nmt_model_forward(r->model, r->params, &db, 1, cfg->run_seed, rng_step,
                                r->grads + n));
      NMT_TRY(sync_if_device(r));
      f_s += nmt__bench_now_s() - t;

      nmt_log_progress("bench scaling: measuring step %d/%d (%s): backward %d/%d", step + 1,
                       warmup + steps, kind, a + 1, accum);
      probe.record = timed && a == accum - 1;
      probe.k = 0;
      probe.offset_s = f_s + b_s;
      probe.t0 = nmt__bench_now_s();
      NMT_TRY(nmt_model_backward(r->model, r->params, r->grads, &db, on_ready, &probe));
      NMT_TRY(sync_if_device(r));
      b_s += nmt__bench_now_s() - probe.t0;
      if (probe.record) {
        if (probe.k != out->n_events)
          return nmt_errorf(NMT_ERR_INTERNAL, "bench scaling: %d grad-ready events, expected %d",
                            probe.k, out->n_events);
        probe.first = 0;
      }
    }
    /* The trainer's update: step control and AdamW, decided on the device (loss scale 1). */
    nmt_log_progress("bench scaling: measuring step %d/%d (%s): update", step + 1,
                     warmup + steps, kind);
    t = nmt__bench_now_s();
    const nmt_step_policy policy = {.clip_norm = cfg->train_clip_norm, .backoff = 0.5f,
                                    .floor = 1.0f, .growth_interval = 1};
    NMT_TRY(be->step_control(r->ctx, r->ctl, r->grads, n, policy, step + 1));
    NMT_TRY(be->adamw(r->ctx, r->params, r->grads, r->m, r->v, n, (float)nmt_lr_at(cfg, step + 1),
                      cfg->train_adam_beta1, cfg->train_adam_beta2, cfg->train_adam_eps,
                      cfg->train_weight_decay, 1.0f, r->ctl, NULL, step + 1));
    NMT_TRY(sync_if_device(r));
    o_s += nmt__bench_now_s() - t;
    if (timed) {
      fwd += f_s, bwd += b_s, opt += o_s;
      step_s += nmt__bench_now_s() - t_step - fill_s;
      tokens += step_tokens, flops += step_flops;
    }
  }
  out->fwd_ms = 1e3 * fwd / steps;
  out->bwd_ms = 1e3 * bwd / steps;
  out->opt_ms = 1e3 * opt / steps;
  out->step_ms = 1e3 * step_s / steps;
  out->tokens = tokens / steps;
  out->flops = flops / steps;
  for (int k = 0; k < out->n_events; k++) {
    double v = r->sum_ms[k] / steps;
    /* Sums of per-step offsets that were each within the step's compute time. */
    out->ready_ms[k] = v < out->fwd_ms + out->bwd_ms ? v : out->fwd_ms + out->bwd_ms;
  }
  if (out->n_events < 1 || out->ready_floats[out->n_events - 1] < total)
    return nmt_errorf(NMT_ERR_INTERNAL, "bench scaling: backward never reported all %zu gradient "
                      "floats final", total);
  return NMT_OK;
}

nmt_status nmt_scaling_measure(const nmt_config *cfg, int warmup, int steps,
                               nmt_scaling_measurement *out) {
  memset(out, 0, sizeof *out);
  out->extrapolated = 1;
  if (steps < 1 || warmup < 0)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: steps %d (>= 1), warmup %d (>= 0)", steps,
                      warmup);
  rig r = {0};
  nmt_status s = measure(cfg, warmup, steps, &r, out);
  rig_free(&r);
  return s;
}

/* Tokens and model FLOPs of cfg's batches at optimizer steps warmup+1 .. warmup+steps, as
 * measure() walks them (epoch-0 order from the first batch, accum micro-batches a step). */
static nmt_status full_batches(const nmt_config *cfg, int warmup, int steps, double *tokens,
                               double *flops) {
  nmt_shard *sh = NULL;
  nmt_batcher *b = NULL;
  long *perm = NULL;
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(cfg, &mc);
  nmt_status s = nmt_shard_open(cfg->data_train, 0, &sh);
  if (s == NMT_OK)
    s = nmt_batcher_create(sh, cfg->data_max_tokens, cfg->data_max_len, cfg->run_seed, &b);
  long nb = s == NMT_OK ? nmt_batcher_num_batches(b) : 0;
  if (s == NMT_OK && !(perm = malloc((size_t)(nb > 0 ? nb : 1) * sizeof *perm)))
    s = nmt_errorf(NMT_ERR_NOMEM, "bench scaling: batch order of %ld batches", nb);
  *tokens = *flops = 0;
  if (s == NMT_OK && nb < 1) s = nmt_errorf(NMT_ERR_DATA, "%s: no batches", cfg->data_train);
  if (s == NMT_OK) {
    nmt_batcher_epoch_order(b, 0, perm);
    const long a = cfg->train_accum_steps;
    for (long k = (long)warmup * a; k < (long)(warmup + steps) * a; k++) {
      int ns, sl, tl;
      long tt;
      nmt_batcher_shape(b, perm[k % nb], &ns, &sl, &tl, &tt);
      *tokens += (double)tt / steps;
      *flops += nmt_model_train_flops(&mc, ns, sl, tl) / steps;
    }
  }
  free(perm);
  if (b) nmt_batcher_destroy(b);
  if (sh) nmt_shard_close(sh);
  return s;
}

nmt_status nmt_scaling_extrapolate(const nmt_config *cfg, nmt_scaling_measurement *m) {
  if (m->accum != 1 || !(m->flops > 0))
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: extrapolating needs a measurement of one "
                      "micro-batch per step (got %d) with FLOPs", m->accum);
  double tokens, flops;
  NMT_TRY(full_batches(cfg, m->warmup, m->steps, &tokens, &flops));
  const double A = cfg->train_accum_steps, r = flops / A / m->flops;
  const double compute = m->fwd_ms + m->bwd_ms;
  for (int k = 0; k < m->n_events; k++) m->ready_ms[k] = (A - 1) * r * compute + r * m->ready_ms[k];
  m->step_ms += (A * r - 1) * compute;
  m->fwd_ms *= A * r;
  m->bwd_ms *= A * r;
  m->tokens = tokens;
  m->flops = flops;
  m->accum = cfg->train_accum_steps;
  m->extrapolated = r;
  return NMT_OK;
}
