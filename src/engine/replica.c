/* replica.c — one worker's device state (replica.h): context, model replica, flat buffers,
 * batch slots.
 *
 * Everything a step touches is allocated here, once, before the first step: the flat
 * parameter / gradient / Adam buffers (device memory; host memory on CPU workers), the step
 * control block and its pinned read-back slots, the device batch staging slots, the page-locked
 * host batch slots the loaders fill (the worker's feed), the profiler track and the bucket
 * reducer. The memory report at create says what the allocations came to.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/device.h"
#include "nmt/log.h"
#include "run.h"
#include "zero.h"

static double activation_bytes_bound(const nmt_trainer *t) {
  return nmt_model_activation_bytes_bound(&t->mcfg, t->cfg.data_max_tokens, t->cfg.data_max_len);
}

/* The model's activation arena per worker, exact (checkpointing included) unless absurd. */
static double activation_bytes(const nmt_trainer *t) {
  double bound = activation_bytes_bound(t);
  if (bound > 0x1p60) return bound;
  return (double)nmt_model_arena_bytes(&t->mcfg, t->cfg.data_max_tokens, t->cfg.data_max_len);
}

nmt_status nmt__batch_nomem(const nmt_trainer *t, int rank, const char *what) {
  char inner[512];
  snprintf(inner, sizeof inner, "%s", nmt_last_error());
  return nmt_errorf(NMT_ERR_NOMEM,
                    "rank %d: %s for micro-batches of data.max_tokens = %d padded tokens "
                    "(data.max_len = %d; activations about %.3g GiB per worker) do not fit%s%s; "
                    "lower data.max_tokens and raise train.accum_steps to keep the tokens per "
                    "step%s",
                    rank, what, t->cfg.data_max_tokens, t->cfg.data_max_len,
                    activation_bytes(t) / 1073741824.0, inner[0] ? ": " : "", inner,
                    t->mcfg.checkpoint_activations ? ""
                                                   : ", or set train.checkpoint_activations = on");
}

/* Peaks for MFU and the profile table (profile.peak_* when set), measured on rank 0's device
 * before the model takes memory. A GPU short of memory for it leaves MFU unknown. */
static nmt_status measure_peaks(nmt_trainer *t, nmt__replica *r) {
  const nmt_config *cfg = &t->cfg;
  if (r->rank != 0 || (cfg->profile_peak_tflops > 0 && cfg->profile_peak_gbps > 0))
    return NMT_OK;
  double tf = 0, gb = 0;
  nmt_status ps = t->be->measure_peaks(r->ctx, cfg->precision_mode, &tf, &gb);
  if (ps == NMT_OK) {
    if (cfg->profile_peak_tflops <= 0) t->peak_flops = tf * 1e12;
    if (cfg->profile_peak_gbps <= 0) t->peak_gbps = gb;
    nmt_log(t->be->is_host ? NMT_LOG_DEBUG : NMT_LOG_INFO,
            "measured device peaks: %.1f TFLOP/s (GEMM, precision.mode), %.0f GB/s",
            t->peak_flops / 1e12, t->peak_gbps);
  } else if (ps == NMT_ERR_NOMEM) {
    nmt_log(NMT_LOG_WARN, "no memory to measure the device peaks: MFU unknown (%s)",
            nmt_last_error());
    nmt_clear_error();
  } else {
    return ps;
  }
  return NMT_OK;
}

/* Parameters, gradients (with the trailing slots), Adam moments, the control block, the
 * validation slots and the device batch buffers; parameters and moments from the host's
 * initial (or resumed) state. */
static nmt_status alloc_buffers(nmt_trainer *t, nmt__replica *r) {
  const nmt_backend *be = t->be;
  const nmt_config *cfg = &t->cfg;
  const nmt_bucket_plan *p = &t->plan;
  const size_t n = t->n_params, bytes = n * sizeof(float);
  /* With ZeRO stage 1 the parameters span the padded buckets (the all-gather writes whole
   * buckets), the gradients are followed by the trailing slots, and the moments are the
   * shard. Stage 2 keeps no flat gradient: the gradients are the shard's accumulator with the
   * slots behind it (extra_offset), two windows of the largest padded stage, which also
   * carry the parameters' all-gather (so the parameters need no pad), and the embedding's
   * window (nmt_grad_windows_floats). */
  const size_t span = p->zero == 1 ? p->total_floats : n;
  const size_t windows = nmt_grad_windows_floats(p);
  nmt_plan_bytes pb;
  nmt_bucket_plan_bytes(p, 0, &pb); /* the same sizes `nmt bench scaling` predicts */
  r->bytes_grad_buf = pb.grad_buf;
  r->bytes_grads = pb.grads;
  r->bytes_optim = pb.optim;
  NMT_TRY(be->malloc(r->ctx, pb.weights, (void **)&r->params));
  NMT_TRY(be->malloc(r->ctx, r->bytes_grad_buf, (void **)&r->grads));
  NMT_TRY(be->malloc(r->ctx, r->bytes_optim / 2, (void **)&r->m));
  NMT_TRY(be->malloc(r->ctx, r->bytes_optim / 2, (void **)&r->v));
  if (p->zero)
    NMT_TRY(be->malloc(r->ctx, ((size_t)p->n_buckets + 1) * sizeof(float),
                       (void **)&r->zero_part));
  if (windows) {
    NMT_TRY(be->malloc(r->ctx, windows * sizeof(float), (void **)&r->zero_windows));
    nmt_grad_windows_init(&r->zero_grads, p, be, r->ctx, r->grank, cfg->parallel_grad_dtype,
                          &t->sync.abort, r->zero_windows, r->grads, NULL, NULL);
  }
  NMT_TRY(be->malloc(r->ctx, sizeof *r->dev_ctl, (void **)&r->dev_ctl));
  NMT_TRY(be->host_alloc(r->ctx, NMT_D2H_SLOTS * sizeof *r->host_ctl, (void **)&r->host_ctl));
  /* The training xent reads the loss scale that step_control keeps on the device. */
  nmt_model_set_loss_scale_dev(r->model, &r->dev_ctl->scale);
  NMT_TRY(be->malloc(r->ctx, NMT_GRAD_EXTRA * sizeof(float), (void **)&r->dev_valid));
  if (be->malloc(r->ctx, t->batch_ints * sizeof(int32_t), (void **)&r->dev_batch_buf) != NMT_OK)
    return nmt__batch_nomem(t, r->rank, "the device batch buffer");
  for (int i = 0; i < 2; i++)
    if (be->malloc(r->ctx, t->batch_ints * sizeof(int32_t), (void **)&r->dev_stage[i]) != NMT_OK)
      return nmt__batch_nomem(t, r->rank, "the device batch staging buffers");
  if (span > n) NMT_TRY(be->memset_zero(r->ctx, r->params, span * sizeof(float)));
  NMT_TRY(be->copy_h2d(r->ctx, r->params, t->init_params, bytes));
  if (p->zero) {
    NMT_TRY(nmt__zero_load_moments(r, t->init_m, t->init_v));
  } else {
    NMT_TRY(be->copy_h2d(r->ctx, r->m, t->init_m, bytes));
    NMT_TRY(be->copy_h2d(r->ctx, r->v, t->init_v, bytes));
  }
  if (cfg->precision_mode == NMT_PRECISION_FP16 || cfg->precision_mode == NMT_PRECISION_BF16) {
    /* Mixed precision: the GEMMs read a half copy of the weights, rounded once per step by
     * adamw (half_out), or with ZeRO over several ranks by cast_half after the gather, instead
     * of at every GEMM. It starts as the rounding of the parameters just copied in. */
    NMT_TRY(be->malloc(r->ctx, span * 2, &r->half_params));
    NMT_TRY(be->cast_half(r->ctx, r->half_params, r->params, span));
    NMT_TRY(be->half_weights(r->ctx, r->params, r->half_params, n));
  }
  if (t->valid_batcher) {
    r->valid_host_buf = malloc(t->batch_ints * sizeof(int32_t));
    if (!r->valid_host_buf) return nmt__batch_nomem(t, r->rank, "the validation batch buffer");
  }
  return NMT_OK;
}

/* The worker's profiler track ("cpu0", "gpu0", ...), sized for one step's events, and on a
 * GPU inside a profile window the device event clock. */
static nmt_status add_track(nmt_trainer *t, nmt__replica *r) {
  const nmt_backend *be = t->be;
  char name[32];
  snprintf(name, sizeof name, "%s%d", be->is_host ? "cpu" : "gpu", r->rank);
  /* Events per step: every module range per micro-batch plus the engine's own. */
  /* One collective per bucket (ZeRO stage 2: per backward stage, the embedding's once). */
  const size_t collectives = (size_t)t->plan.n_buckets;
  const size_t per_micro = (size_t)nmt_model_module_names(r->model, NMT_PROF_FWD, NULL) +
                           (size_t)nmt_model_module_names(r->model, NMT_PROF_BWD, NULL) +
                           collectives + 8;
  size_t per_step = (size_t)t->accum * per_micro + 16;
  NMT_TRY(nmt_prof_add_track(t->prof, name, per_step, &r->prof));
  NMT_TRY(nmt_model_set_profiler(r->model, r->prof));
  /* The device clock (the host clock on a host backend, whose ops are synchronous). */
  if (nmt_prof_start_step(t->prof) > 0)
    NMT_TRY(be->clock_create(r->ctx, r->prof, &r->prof_clock));
  return NMT_OK;
}

/* Slots: one step of micro-batches in flight, one being prepared; page-locked (backend
 * host_alloc), so the copy stream reads them without staging. */
static nmt_status alloc_slots(nmt_trainer *t, nmt__replica *r) {
  nmt__feed *f = r->feed;
  f->n_slots = 2 * t->accum + 1;
  size_t cap = 2;
  while (cap < (size_t)f->n_slots + 1) cap *= 2;
  NMT_TRY(nmt_ring_init(&f->batches, cap));
  NMT_TRY(nmt_ring_init(&f->free_slots, cap));
  f->slots = calloc((size_t)f->n_slots, sizeof *f->slots);
  if (!f->slots) return nmt_errorf(NMT_ERR_NOMEM, "batch slots");
  for (int i = 0; i < f->n_slots; i++) {
    if (r->be->host_alloc(r->ctx, t->batch_ints * sizeof(int32_t), (void **)&f->slots[i].buf) !=
        NMT_OK)
      return nmt__batch_nomem(t, r->rank, "host batch slots");
    nmt_ring_try_push(&f->free_slots, &f->slots[i]);
  }
  return NMT_OK;
}

void nmt__replica_log_memory(const nmt__replica *r) {
  const nmt_bucket_plan *p = r->plan;
  const double mib = 1048576.0, full = (double)p->n_params * sizeof(float);
  if (!p->zero) {
    nmt_log(NMT_LOG_INFO, "per worker: gradients %.1f MiB, Adam moments %.1f MiB (parallel.zero "
            "= 0, replicated)", (double)r->bytes_grads / mib, (double)r->bytes_optim / mib);
    return;
  }
  if (p->zero == 2) {
    const double shard = (double)p->shard_floats * sizeof(float);
    nmt_log(NMT_LOG_INFO, "ZeRO stage 2 over %d workers: per worker Adam moments %.1f MiB (%.3f "
            "of the replicated %.1f MiB), gradients %.1f MiB = shard %.1f MiB (%.3f of the "
            "replicated %.1f MiB) + 2 windows of %.1f MiB + the embedding's of %.1f MiB; %d "
            "buckets, one per backward stage "
            "(parallel.bucket_mb does not apply), reduce-scattered every micro-batch; shard %zu "
            "floats",
            r->world, (double)r->bytes_optim / mib, (double)r->bytes_optim / (2 * full),
            2 * full / mib, (double)r->bytes_grads / mib, shard / mib, shard / full, full / mib,
            (double)p->bucket_floats * sizeof(float) / mib,
            (double)(nmt_grad_windows_floats(p) - 2 * p->bucket_floats) *
                sizeof(float) / mib,
            p->n_buckets,
            p->shard_floats);
    return;
  }
  nmt_log(NMT_LOG_INFO, "ZeRO stage %d over %d workers: per worker Adam moments %.1f MiB (%.3f of "
          "the replicated %.1f MiB), gradients %.1f MiB; %d buckets of %zu floats, shard %zu "
          "floats", p->zero, r->world, (double)r->bytes_optim / mib,
          (double)r->bytes_optim / (2 * full), 2 * full / mib, (double)r->bytes_grads / mib,
          p->n_buckets, p->bucket_floats, p->shard_floats);
}

nmt_status nmt__replica_setup(nmt_trainer *t, int rank, nmt__feed *feed, nmt__replica *r) {
  r->be = t->be, r->plan = &t->plan, r->abort = &t->sync.abort, r->feed = feed;
  r->rank = rank, r->grank = t->world.first_rank + rank, r->world = t->world.world;
  /* The model sums its buffer sizes in size_t: refuse before that sum could wrap around. */
  if (activation_bytes_bound(t) > 0x1p60) {
    nmt_clear_error();
    return nmt__batch_nomem(t, r->rank, "activations");
  }
  nmt_device dev;
  NMT_TRY(nmt_device_open(&t->cfg, t->be, r->rank, NMT_DEVICE_TRAIN, &t->sync.abort, &dev));
  r->ctx = dev.ctx, r->device = dev.index;
  r->mem_peak_mb = NAN;
  NMT_TRY(measure_peaks(t, r));
  nmt_status ms = nmt_model_create(&t->mcfg, t->be, r->ctx, t->cfg.data_max_tokens,
                                   t->cfg.data_max_len, &r->model);
  if (ms == NMT_ERR_NOMEM) return nmt__batch_nomem(t, r->rank, "activations");
  NMT_TRY(ms);
  if (r->rank == 0)
    nmt_log(NMT_LOG_INFO, "activations: %.1f MiB per worker (data.max_tokens = %d, "
            "train.checkpoint_activations = %s)",
            (double)nmt_model_activation_bytes(r->model) / 1048576.0, t->cfg.data_max_tokens,
            t->mcfg.checkpoint_activations ? "on" : "off");
  NMT_TRY(alloc_buffers(t, r));
  NMT_TRY(add_track(t, r));
  /* The communicator and the range names are bound once they exist (create_workers). */
  nmt_bucket_reducer_init(&r->buckets, &t->plan, r->comm, r->world, t->cfg.parallel_grad_dtype,
                          r->abort, r->grads, r->prof, NULL);
  r->zero_grads.prof = r->prof;
  NMT_TRY(alloc_slots(t, r));
  if (t->opt.keep_last_grads) {
    r->host_grads = malloc((t->n_params + NMT_GRAD_EXTRA) * sizeof(float));
    if (!r->host_grads) return nmt_errorf(NMT_ERR_NOMEM, "gradient copy");
  }
  return NMT_OK;
}

void nmt__replica_free(nmt__replica *r) {
  const nmt_backend *be = r->be;
  if (!be) return; /* never set up */
  if (r->model) nmt_model_destroy(r->model);
  if (r->half_params) {
    /* Unregistered before it is freed: the context must not point at freed memory. */
    (void)be->half_weights(r->ctx, NULL, NULL, 0);
    be->free(r->ctx, r->half_params);
  }
  be->free(r->ctx, r->params);
  be->free(r->ctx, r->grads);
  be->free(r->ctx, r->m);
  be->free(r->ctx, r->v);
  be->free(r->ctx, r->zero_part);
  be->free(r->ctx, r->zero_windows);
  be->free(r->ctx, r->dev_ctl);
  be->host_free(r->ctx, r->host_ctl);
  be->free(r->ctx, r->dev_valid);
  be->free(r->ctx, r->dev_batch_buf);
  for (int i = 0; i < 2; i++) be->free(r->ctx, r->dev_stage[i]);
  /* Before the context: host_free takes it. (cudaFreeHost waits for copies still reading.) */
  nmt__feed *f = r->feed;
  if (f && f->slots)
    for (int i = 0; i < f->n_slots; i++) be->host_free(r->ctx, f->slots[i].buf);
  be->clock_destroy(r->prof_clock);
  nmt_device dev = {.be = be, .ctx = r->ctx};
  nmt_device_close(&dev);
  free(r->valid_host_buf);
  free(r->host_grads);
  if (f) {
    free(f->slots);
    nmt_ring_free(&f->batches);
    nmt_ring_free(&f->free_slots);
    memset(f, 0, sizeof *f);
  }
}
