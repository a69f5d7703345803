/* bench_scaling.c — `nmt bench scaling`: a weak-scaling model of data parallelism with bucketed
 * all-reduce overlapped with backward (include/nmt/bench.h, docs/scaling.md).
 *
 * One device is measured (forward, backward with the time of every grad-ready callback,
 * update) on real batches; everything about N devices is predicted from that, from a bus
 * bandwidth and a latency. Each input is printed with where it came from: measured here,
 * declared on the command line, or declared by a preset (and there: from a public figure, or
 * assumed).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nmt/backend.h"
#include "nmt/bench.h"
#include "nmt/json.h"
#include "nmt/data.h"
#include "nmt/model.h"
#include "nmt/trainer.h"

void openblas_set_num_threads(int num_threads);

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
  /* Exactly worker_setup's arithmetic (src/engine/trainer.c). */
  double bf = bucket_mb * 1048576.0 / sizeof(float);
  size_t per = bf < 1 ? 1 : (size_t)bf;
  if (per > total_floats) per = total_floats;
  size_t n = (total_floats + per - 1) / per;
  if (n > (size_t)cap)
    return nmt_errorf(NMT_ERR_USAGE, "%zu buckets of %g MiB exceed the %d this bench keeps", n,
                      bucket_mb, cap);
  int k = 0;
  for (size_t b = 0; b < n; b++) {
    size_t begin = b * per, end = begin + per < total_floats ? begin + per : total_floats;
    while (k < n_events && ready_floats[k] < end) k++;
    if (k == n_events)
      return nmt_errorf(NMT_ERR_USAGE, "no grad-ready event covers floats [%zu, %zu) of %zu",
                        begin, end, total_floats);
    bytes_out[b] = (double)(end - begin) * sizeof(float);
    ready_out[b] = ready_ms[k];
  }
  *n_buckets = (int)n;
  return NMT_OK;
}

int nmt_scaling_best(const nmt_scaling_pred *preds, int n) {
  int best = n > 0 ? 0 : -1;
  for (int i = 1; i < n; i++)
    if (preds[i].step_ms < preds[best].step_ms) best = i;
  return best;
}

double nmt_bench_train_flops(const nmt_model_cfg *c, int B, int Ts, int Tt) {
  double C = c->d_model, F = c->d_ff, V = c->vocab;
  double ns = (double)B * Ts, nt = (double)B * Tt;
  double enc = 2 * ns * C * 3 * C + 2 * ns * C * C + 4 * (double)B * Ts * Ts * C + 4 * ns * C * F;
  double dec = 2 * nt * C * 3 * C + 2 * nt * C * C + 4 * (double)B * Tt * Tt * C /* self-attn */
               + 2 * nt * C * C + 2 * ns * C * 2 * C + 2 * nt * C * C +
               4 * (double)B * Tt * Ts * C /* cross-attn: q, kv (on the source), out, scores */
               + 4 * nt * C * F;           /* FFN */
  double fwd = c->enc_layers * enc + c->dec_layers * dec + 2 * nt * C * V;
  return 3 * fwd;
}

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
  if (p->be->synchronize && p->be != &nmt_backend_ref) NMT_TRY(p->be->synchronize(p->ctx));
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

/* parallel.device as the trainer reads it, for one device. */
static nmt_status pick_backend(const nmt_config *cfg, const nmt_backend **out) {
  *out = &nmt_backend_ref;
  if (cfg->parallel_device == NMT_DEVICE_CPU) return NMT_OK;
  const nmt_backend *cuda = nmt_backend_cuda_get();
  int n = 0;
  if (cuda) NMT_TRY(cuda->device_count(&n));
  if (cuda && n > 0) {
    *out = cuda;
    return NMT_OK;
  }
  if (cfg->parallel_device == NMT_DEVICE_AUTO) return NMT_OK;
  return nmt_errorf(NMT_ERR_DEVICE, "[parallel] device = cuda: %s",
                    cuda ? "no CUDA device is visible" : "this build has no CUDA backend");
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
    if (r->be->ctx_destroy) r->be->ctx_destroy(r->ctx);
  }
  if (r->batcher) nmt_batcher_destroy(r->batcher);
  if (r->shard) nmt_shard_close(r->shard);
  free(r->host_buf), free(r->host_params), free(r->perm), free(r->sum_ms);
}

static nmt_status sync_if_device(const rig *r) {
  if (r->be != &nmt_backend_ref && r->be->synchronize) return r->be->synchronize(r->ctx);
  return NMT_OK;
}

static nmt_status measure(const nmt_config *cfg, int warmup, int steps, rig *r,
                          nmt_scaling_measurement *out) {
  NMT_TRY(pick_backend(cfg, &r->be));
  /* One BLAS thread, as a trainer worker has (the workers are the parallelism). */
  if (r->be == &nmt_backend_ref) openblas_set_num_threads(1);
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

  if (r->be->ctx_create) {
    /* The device rank 0 of a run would use. */
    int device = cfg->parallel_device_ids_n ? cfg->parallel_device_ids[0] : 0;
    NMT_TRY(r->be->ctx_create(device, &r->ctx));
    if (r->be->set_precision) NMT_TRY(r->be->set_precision(r->ctx, cfg->precision_mode));
    NMT_TRY(r->be->stream_pool(r->ctx, cfg->parallel_aux_streams)); /* parallel.qkv = streams */
  }
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
  ready_probe probe = {.be = be, .ctx = r->ctx, .m = out, .sum_ms = r->sum_ms, .first = 1};
  double fwd = 0, bwd = 0, opt = 0, step_s = 0, tokens = 0, flops = 0;
  long pos = 0;
  for (int step = 0; step < warmup + steps; step++) {
    const int timed = step >= warmup;
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
      step_flops += nmt_bench_train_flops(&mc, ns, sl, tl);

      t = nmt__bench_now_s();
      /* nmt_batch_layout packs the arrays from the buffer's start: one copy moves the batch. */
      NMT_TRY(be->copy_h2d(r->ctx, r->dev_buf, r->host_buf, ints * sizeof(int32_t)));
      uint64_t rng_step = (uint64_t)step * (uint64_t)accum + (uint64_t)a;
      NMT_TRY(nmt_model_forward(r->model, r->params, &db, 1, cfg->run_seed, rng_step,
                                r->grads + n));
      NMT_TRY(sync_if_device(r));
      f_s += nmt__bench_now_s() - t;

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
  if (steps < 1 || warmup < 0)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: steps %d (>= 1), warmup %d (>= 0)", steps,
                      warmup);
  rig r = {0};
  nmt_status s = measure(cfg, warmup, steps, &r, out);
  rig_free(&r);
  return s;
}

/* ------------------------------------------------------------------------------------------ */
/* the command                                                                                */

void nmt_bench_scaling_opts_default(nmt_bench_scaling_opts *o) {
  memset(o, 0, sizeof *o);
  o->size = sizeof *o;
  o->warmup = 2;
  o->steps = 5;
  o->busbw_gbs = 0;
  o->latency_us = -1;
  o->mfu = 0;
  o->preset = NMT_SCALING_PRESET_NONE;
  o->max_devices = 8;
}

/* The lab box of the seeds: 4x GeForce RTX 3090 on PCIe 4.0, no NVLink bridge. Every figure is
 * either a published specification or labelled as an assumption (docs/scaling.md discusses
 * each). */
typedef struct {
  const char *name;
  int gpus;
  double busbw_gbs;
  const char *busbw_origin;
  double latency_us;
  const char *latency_origin;
  double peak_tflops_fp32, peak_tflops_tf32, peak_tflops_half;
  const char *peak_origin;
  double mfu;
  const char *mfu_origin;
  double mem_gbs, mem_eff;
  const char *mem_origin;
} preset_spec;

static const preset_spec rtx3090x4 = {
    .name = "rtx3090x4",
    .gpus = 4,
    .busbw_gbs = 10.0,
    .busbw_origin = "preset rtx3090x4, ASSUMED: NCCL ring over PCIe 4.0 x16 without P2P (stock "
                    "GeForce driver: via host memory); between the ~4 GB/s SHM all-reduce on "
                    "PCIe 3.0 in NVIDIA/nccl#384 and the ~26 GB/s busbw of 4x RTX 4090 on "
                    "PCIe 4.0 with P2P enabled in tinygrad/open-gpu-kernel-modules#36",
    .latency_us = 30.0,
    .latency_origin = "preset rtx3090x4, ASSUMED: the 8-byte all-reduce of 8x RTX 4090 over "
                      "PCIe takes 40-42 us in NVIDIA/nccl#1530; 4 ranks have half the ring steps",
    .peak_tflops_fp32 = 35.6,
    .peak_tflops_tf32 = 35.6,
    .peak_tflops_half = 71.0,
    .peak_origin = "preset rtx3090x4, published: NVIDIA GA102 whitepaper, GeForce RTX 3090, "
                   "dense: FP32 35.6, TF32 tensor 35.6, FP16/BF16 tensor with FP32 "
                   "accumulate 71 TFLOPS",
    .mfu = 0.35,
    .mfu_origin = "preset rtx3090x4, ASSUMED (not measured on a 3090)",
    .mem_gbs = 936.0,
    .mem_eff = 0.7,
    .mem_origin = "preset rtx3090x4: 936 GB/s published GDDR6X bandwidth x ASSUMED 70% achieved",
};

static const double candidate_mb[] = {1, 2, 5, 10, 25, 50, 100};
#define N_CANDIDATES (int)(sizeof candidate_mb / sizeof candidate_mb[0])
#define MAX_SIZES (N_CANDIDATES + 1)
#define MAX_N 64

/* One host-communicator all-reduce size, quickly: time (us) and busbw (GB/s). */
static nmt_status quick_allreduce(int ranks, size_t bytes, int warmup, int iters,
                                  nmt_bench_allreduce_row *row) {
  nmt_comm *comms[MAX_N];
  NMT_TRY(nmt_comm_create_host(ranks, NULL, comms));
  nmt_bench_allreduce_opts o;
  nmt_bench_allreduce_opts_default(&o);
  o.min_bytes = o.max_bytes = bytes;
  o.warmup = warmup;
  o.iters = iters;
  int n_rows = 0;
  nmt_status s = nmt_bench_allreduce_run(comms, ranks, &nmt_backend_ref, NULL, &o, row, 1, &n_rows);
  nmt_comm_destroy(comms, ranks);
  if (s == NMT_OK && (n_rows != 1 || row->wrong))
    s = nmt_errorf(NMT_ERR_INTERNAL, "bench scaling: host all-reduce of %zu B: %lld wrong",
                   bytes, row->wrong);
  return s;
}

static const char *precision_name(nmt_precision p) {
  switch (p) {
    case NMT_PRECISION_TF32: return "tf32";
    case NMT_PRECISION_FP16: return "fp16";
    case NMT_PRECISION_BF16: return "bf16";
    default: return "fp32";
  }
}

nmt_status nmt_bench_scaling(const nmt_config *cfg, const char *config_label,
                             const nmt_bench_scaling_opts *o, const char *jsonl_path, FILE *out) {
  if (!o || o->size != sizeof *o)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: options struct of the wrong size");
  if (o->max_devices < 1 || o->max_devices > MAX_N)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: max devices %d (1..%d)", o->max_devices,
                      MAX_N);
  if (o->busbw_gbs < 0 || o->mfu < 0 || o->mfu > 1)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: busbw %g GB/s (> 0) or MFU %g (0..1]",
                      o->busbw_gbs, o->mfu);
  const preset_spec *ps = o->preset == NMT_SCALING_PRESET_RTX3090X4 ? &rtx3090x4 : NULL;
  if (o->mfu > 0 && !ps)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: --mfu rescales compute to a preset's GPU; "
                      "give --preset too");

  {
    /* Refuse a bucket size the tables below cannot hold before spending time measuring. */
    nmt_model_cfg c0;
    nmt_model_cfg_from_config(cfg, &c0);
    double per = cfg->parallel_bucket_mb * 1048576.0 / sizeof(float);
    double buckets = (double)(nmt_model_num_params(&c0) + NMT_GRAD_EXTRA) / (per < 1 ? 1 : per);
    if (buckets > (double)((size_t)1 << 22))
      return nmt_errorf(NMT_ERR_USAGE, "bench scaling: [parallel] bucket_mb = %g gives %.0f "
                        "buckets; this bench models at most %zu", cfg->parallel_bucket_mb,
                        ceil(buckets), (size_t)1 << 22);
  }
  nmt_scaling_measurement *me = malloc(sizeof *me);
  if (!me) return nmt_errorf(NMT_ERR_NOMEM, "bench scaling: measurement");
  double load0[3] = {-1, -1, -1}, load1[3] = {-1, -1, -1};
  getloadavg(load0, 3);
  nmt_status s = nmt_scaling_measure(cfg, o->warmup, o->steps, me);
  getloadavg(load1, 3);
  if (s != NMT_OK) {
    free(me);
    return s;
  }
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(cfg, &mc);

  /* Bucket sizes: the candidates and the config's, ascending, without duplicates. */
  double sizes[MAX_SIZES];
  int n_sizes = 0, cfg_idx = -1;
  double cfg_mb = cfg->parallel_bucket_mb;
  for (int i = 0; i <= N_CANDIDATES; i++) {
    double v = i < N_CANDIDATES ? candidate_mb[i] : cfg_mb;
    int dup = 0;
    for (int j = 0; j < n_sizes; j++) dup |= sizes[j] == v;
    if (!dup) sizes[n_sizes++] = v;
  }
  for (int i = 1; i < n_sizes; i++)
    for (int j = i; j > 0 && sizes[j] < sizes[j - 1]; j--) {
      double x = sizes[j];
      sizes[j] = sizes[j - 1];
      sizes[j - 1] = x;
    }
  for (int i = 0; i < n_sizes; i++)
    if (sizes[i] == cfg_mb) cfg_idx = i;

  /* Compute times: as measured, or rescaled to the preset's GPU. */
  double scale = 1, opt_ms = me->opt_ms, peak = 0, mfu = 0;
  if (ps) {
    peak = cfg->precision_mode == NMT_PRECISION_FP32   ? ps->peak_tflops_fp32
           : cfg->precision_mode == NMT_PRECISION_TF32 ? ps->peak_tflops_tf32
                                                       : ps->peak_tflops_half;
    mfu = o->mfu > 0 ? o->mfu : ps->mfu;
    double gpu_compute_ms = me->flops / (peak * 1e12 * mfu) * 1e3;
    scale = gpu_compute_ms / (me->fwd_ms + me->bwd_ms);
    /* zero grads (write 4 B), grad norm (read 4 B), AdamW (read p, g, m, v; write p, m, v). */
    opt_ms = (double)me->n_params * 36.0 / (ps->mem_gbs * 1e9 * ps->mem_eff) * 1e3;
  }
  const double fwd_ms = me->fwd_ms * scale, bwd_ms = me->bwd_ms * scale;

  /* The link. */
  double busbw = o->busbw_gbs, lat = o->latency_us;
  char busbw_origin[512], lat_origin[512];
  snprintf(busbw_origin, sizeof busbw_origin, "declared on the command line");
  snprintf(lat_origin, sizeof lat_origin, "declared on the command line");
  double max_bucket_bytes = sizes[n_sizes - 1] * 1048576.0;
  if (max_bucket_bytes > (double)me->total_floats * sizeof(float))
    max_bucket_bytes = (double)me->total_floats * sizeof(float);
  int ranks = cfg->parallel_devices < 2 ? 2 : cfg->parallel_devices > 8 ? 8 : cfg->parallel_devices;
  if (!(busbw > 0)) {
    if (ps) {
      busbw = ps->busbw_gbs;
      snprintf(busbw_origin, sizeof busbw_origin, "%s", ps->busbw_origin);
    } else {
      nmt_bench_allreduce_row row;
      size_t bytes = (size_t)max_bucket_bytes / 4 * 4;
      NMT_TRY_GOTO(s, quick_allreduce(ranks, bytes, 1, 3, &row), done);
      busbw = row.busbw_gbs;
      snprintf(busbw_origin, sizeof busbw_origin, "measured here: host communicator, %d ranks "
               "(threads), all-reduce of %zu B (the largest bucket), busbw = algbw*2(n-1)/n",
               ranks, bytes);
    }
  }
  if (lat < 0) {
    if (ps) {
      lat = ps->latency_us;
      snprintf(lat_origin, sizeof lat_origin, "%s", ps->latency_origin);
    } else {
      nmt_bench_allreduce_row row;
      NMT_TRY_GOTO(s, quick_allreduce(ranks, 4, 20, 200, &row), done);
      lat = row.time_us;
      snprintf(lat_origin, sizeof lat_origin, "measured here: host communicator, %d ranks, "
               "time of a 4 B all-reduce", ranks);
    }
  }

  /* Buckets per size, from the measured grad-ready events (ready times rescaled with compute).
   * The smallest size has the most buckets; the trainer's arithmetic bounds their number. */
  double min_per = sizes[0] * 1048576.0 / sizeof(float);
  size_t cap = (me->total_floats + (min_per < 1 ? 1 : (size_t)min_per) - 1) /
               (min_per < 1 ? 1 : (size_t)min_per);
  if (cap > ((size_t)1 << 22)) {
    s = nmt_errorf(NMT_ERR_USAGE, "bench scaling: [parallel] bucket_mb = %g gives %zu buckets; "
                   "this bench models at most %zu", cfg_mb, cap, (size_t)1 << 22);
    goto done;
  }
  double *bytes = calloc((size_t)n_sizes * cap, sizeof *bytes);
  double *ready = calloc((size_t)n_sizes * cap, sizeof *ready);
  double scaled_ready[NMT_SCALING_MAX_EVENTS];
  int nb[MAX_SIZES];
  if (!bytes || !ready) {
    free(bytes), free(ready);
    s = nmt_errorf(NMT_ERR_NOMEM, "bench scaling: bucket tables");
    goto done;
  }
  for (int k = 0; k < me->n_events; k++) scaled_ready[k] = me->ready_ms[k] * scale;
  for (int i = 0; i < n_sizes && s == NMT_OK; i++)
    s = nmt_scaling_buckets(me->total_floats, me->ready_floats, scaled_ready, me->n_events,
                            sizes[i], bytes + (size_t)i * cap, ready + (size_t)i * cap, (int)cap,
                            &nb[i]);
  /* parallel.grad_dtype: gradients travel in 2 bytes (the 4 fp32 slots of the last bucket are
   * a separate 16-byte reduce; their latency is not modelled). */
  const double wire = nmt_comm_wire_size(cfg->parallel_grad_dtype) / 4.0;
  for (int i = 0; i < n_sizes && s == NMT_OK; i++)
    for (int b = 0; b < nb[i]; b++) bytes[(size_t)i * cap + (size_t)b] *= wire;
  const int max_n = o->max_devices;
  nmt_scaling_pred pred[MAX_N][MAX_SIZES], serial[MAX_N][MAX_SIZES];
  nmt_scaling_link link = {.busbw_gbs = busbw, .latency_us = lat, .serial = 0};
  nmt_scaling_link slink = link;
  slink.serial = 1;
  for (int N = 1; N <= max_n && s == NMT_OK; N++)
    for (int i = 0; i < n_sizes && s == NMT_OK; i++) {
      nmt_scaling_profile p = {.fwd_ms = fwd_ms, .bwd_ms = bwd_ms, .opt_ms = opt_ms,
                               .n_buckets = nb[i], .bytes = bytes + (size_t)i * cap,
                               .ready_ms = ready + (size_t)i * cap};
      s = nmt_scaling_predict(&p, N, &link, &pred[N - 1][i]);
      if (s == NMT_OK) s = nmt_scaling_predict(&p, N, &slink, &serial[N - 1][i]);
    }
  if (s != NMT_OK) {
    free(bytes), free(ready);
    goto done;
  }

  /* ---- report ---- */
  char cpu[256], commit[64], date[32];
  nmt__bench_cpu_name(cpu, sizeof cpu);
  nmt__bench_commit(commit, sizeof commit);
  {
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tm);
  }
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  const char *where = ps ? "rescaled" : "measured here";
  fprintf(out, "# nmt bench scaling: weak scaling of data parallelism, bucketed all-reduce "
          "overlapped with backward (docs/scaling.md)\n");
  fprintf(out, "# config: %s; %.2f M parameters (d_model %d, %d heads, d_ff %d, %d+%d layers, "
          "vocab %d); precision %s\n", config_label, me->n_params / 1e6, mc.d_model, mc.n_heads,
          mc.d_ff, mc.enc_layers, mc.dec_layers, mc.vocab, precision_name(cfg->precision_mode));
  fprintf(out, "# batch per device: data.max_tokens = %d padded tokens per micro-batch x "
          "train.accum_steps = %d\n", cfg->data_max_tokens, me->accum);
  fprintf(out, "# measured on: %s backend, 1 worker%s, %s, %ld core(s); load average %.2f "
          "before, %.2f after\n", me->backend,
          me->backend && !strcmp(me->backend, "ref") ? " (1 BLAS thread)" : "", cpu, cores,
          load0[0], load1[0]);
  fprintf(out, "# commit %s, %s; %d timed steps after %d warmup, means\n", commit, date, me->steps,
          me->warmup);
  fprintf(out, "#\n# %-32s %12s     origin\n", "inputs", "value");
  char m_origin[160];
  snprintf(m_origin, sizeof m_origin, "measured here (%s backend, 1 device)", me->backend);
  if (ps) {
    fprintf(out, "#   %-30s %12.3f ms  %s\n", "forward, as measured", me->fwd_ms, m_origin);
    fprintf(out, "#   %-30s %12.3f ms  %s\n", "backward, as measured", me->bwd_ms, m_origin);
    fprintf(out, "#   %-30s %12.3f ms  %s\n", "update, as measured", me->opt_ms, m_origin);
    fprintf(out, "#   %-30s %12.1f TF/s  %s (%s GEMMs)\n", "GPU peak", peak, ps->peak_origin,
            precision_name(cfg->precision_mode));
    fprintf(out, "#   %-30s %12.2f     %s\n", "MFU", mfu,
            o->mfu > 0 ? "declared on the command line" : ps->mfu_origin);
    fprintf(out, "#   %-30s %12.4f     = model FLOPs/step / (peak x MFU) / measured "
            "(forward + backward); applied to forward, backward and every ready time\n",
            "compute scale", scale);
  }
  fprintf(out, "#   %-30s %12.3f ms  %s\n", "forward (all micro-batches)", fwd_ms, where);
  fprintf(out, "#   %-30s %12.3f ms  %s\n", "backward (all micro-batches)", bwd_ms, where);
  if (ps)
    fprintf(out, "#   %-30s %12.3f ms  36 B/parameter / (%s)\n", "update", opt_ms,
            ps->mem_origin);
  else
    fprintf(out, "#   %-30s %12.3f ms  %s (zero grads, grad norm, AdamW)\n", "update", opt_ms,
            where);
  if (!ps)
    fprintf(out, "#   %-30s %12.3f ms  %s (end to end, batch forming excluded; vs the sum of "
            "the three above)\n", "step, 1 device", me->step_ms, where);
  fprintf(out, "#   %-30s %12.1f     %s\n", "target tokens per step", me->tokens, m_origin);
  fprintf(out, "#   %-30s %12.4g     from the measured batches' padded shapes: 3 x forward "
          "GEMM FLOPs (bench/README.md)\n", "model FLOPs per step", me->flops);
  fprintf(out, "#   %-30s %12.0f B   %zu parameters in %s (parallel.grad_dtype) + %d fp32 "
          "slots\n", "gradient bytes per step",
          (double)me->n_params * (double)nmt_comm_wire_size(cfg->parallel_grad_dtype) +
              4.0 * NMT_GRAD_EXTRA,
          me->n_params, nmt_comm_wire_name(cfg->parallel_grad_dtype), NMT_GRAD_EXTRA);
  fprintf(out, "#   %-30s %12.3f GB/s  %s\n", "busbw", busbw, busbw_origin);
  fprintf(out, "#   %-30s %12.2f us  %s\n", "latency per all-reduce", lat, lat_origin);
  fprintf(out, "#\n# grad-ready events of the last backward (ms from the step's first forward; "
          "compute ends at %.3f)\n#   %14s %12s\n", fwd_ms + bwd_ms, "final floats", "ready ms");
  for (int k = 0; k < me->n_events; k++)
    fprintf(out, "#   %14zu %12.3f\n", me->ready_floats[k], scaled_ready[k]);

  fprintf(out, "#\n# predicted step time (ms), comm stream overlapped with backward; rows N "
          "devices, columns bucket MiB (buckets)%s\n", cfg_idx >= 0 ? "; * = config's" : "");
  fprintf(out, "%4s", "N");
  for (int i = 0; i < n_sizes; i++) {
    char h[48];
    snprintf(h, sizeof h, "%g(%d)%s", sizes[i], nb[i], i == cfg_idx ? "*" : "");
    fprintf(out, " %11s", h);
  }
  fprintf(out, " %6s\n", "best");
  for (int N = 1; N <= max_n; N++) {
    fprintf(out, "%4d", N);
    for (int i = 0; i < n_sizes; i++) fprintf(out, " %11.2f", pred[N - 1][i].step_ms);
    fprintf(out, " %6g\n", sizes[nmt_scaling_best(pred[N - 1], n_sizes)]);
  }
  fprintf(out, "#\n# per N at the best bucket size (ties: the smaller); serial_ms: the same "
          "buckets reduced without overlap, as today's CPU workers do\n");
  fprintf(out, "%4s %9s %7s %12s %11s %10s %10s %11s %10s\n", "N", "bucket_mb", "buckets",
          "allreduce_ms", "exposed_ms", "step_ms", "efficiency", "tgt_tok/s", "serial_ms");
  const double step1 = pred[0][0].step_ms;
  for (int N = 1; N <= max_n; N++) {
    int b = nmt_scaling_best(pred[N - 1], n_sizes);
    const nmt_scaling_pred *p = &pred[N - 1][b];
    fprintf(out, "%4d %9g %7d %12.3f %11.3f %10.3f %10.3f %11.1f %10.3f%s\n", N, sizes[b], nb[b],
            p->allreduce_ms, p->exposed_ms, p->step_ms, step1 / p->step_ms,
            N * me->tokens / p->step_ms * 1e3, serial[N - 1][b].step_ms,
            ps && N > ps->gpus ? "  (beyond the preset's GPUs: extrapolated)" : "");
  }
  if (cfg_idx >= 0 && max_n >= 2) {
    fprintf(out, "# at the config's bucket_mb = %g:", cfg_mb);
    for (int N = 2; N <= max_n && N <= 4; N++)
      fprintf(out, "%s N=%d %.3f ms (serial %.3f)", N > 2 ? ";" : "", N,
              pred[N - 1][cfg_idx].step_ms, serial[N - 1][cfg_idx].step_ms);
    fprintf(out, "\n");
  }
  fflush(out);

  if (jsonl_path) {
    FILE *f = fopen(jsonl_path, "a");
    if (!f) {
      s = nmt_errorf(NMT_ERR_IO, "bench scaling: cannot append to %s", jsonl_path);
    } else {
      for (int N = 1; N <= max_n; N++)
        for (int i = 0; i < n_sizes; i++) {
          const nmt_scaling_pred *p = &pred[N - 1][i];
          fprintf(f, "{\"date\": \"%s\", \"commit\": \"%s\", \"bench\": \"scaling\", "
                  "\"config\": ", date, commit);
          nmt_json_str(f, config_label);
          fprintf(f, ", \"device\": ");
          nmt_json_str(f, cpu);
          fprintf(f, ", \"backend\": \"%s\", \"precision\": \"%s\", \"preset\": \"%s\", "
                  "\"n_devices\": %d, \"bucket_mb\": %g, \"buckets\": %d, \"fwd_ms\": %.4f, "
                  "\"bwd_ms\": %.4f, \"opt_ms\": %.4f, \"tokens_per_step\": %.1f, "
                  "\"flops_per_step\": %.6g, \"busbw_gbs\": %.6g, \"latency_us\": %.4g, "
                  "\"busbw_origin\": ", me->backend, precision_name(cfg->precision_mode),
                  ps ? ps->name : "none", N, sizes[i], nb[i], fwd_ms, bwd_ms, opt_ms, me->tokens,
                  me->flops, busbw, lat);
          nmt_json_str(f, busbw_origin);
          fprintf(f, ", \"latency_origin\": ");
          nmt_json_str(f, lat_origin);
          fprintf(f, ", \"compute_scale\": %.6g, \"allreduce_ms\": %.4f, \"exposed_ms\": %.4f, "
                  "\"step_ms\": %.4f, \"serial_step_ms\": %.4f, \"efficiency\": %.5f, "
                  "\"tgt_tokens_per_s\": %.1f, \"loadavg\": %.2f}\n", scale, p->allreduce_ms,
                  p->exposed_ms, p->step_ms, serial[N - 1][i].step_ms, step1 / p->step_ms,
                  N * me->tokens / p->step_ms * 1e3, load1[0]);
        }
      int bad = ferror(f);
      if ((fclose(f) != 0 || bad) && s == NMT_OK)
        s = nmt_errorf(NMT_ERR_IO, "bench scaling: cannot write %s", jsonl_path);
    }
  }
  free(bytes), free(ready);
done:
  free(me);
  return s;
}
