/* trainer.c — the engine's front door and the main thread (include/nmt/trainer.h).
 *
 * Thread map (DESIGN.md "Threads"; the trainer's state is src/engine/run.h, each thread
 * kind's own struct loader.h and worker.h, the flags and error record they share sync.h):
 *   main   — nmt_trainer_train's caller: starts the loaders (loader.c) and one worker per
 *            device (worker.c), then serves: drains worker 0's message ring (metrics ->
 *            metrics.jsonl and the progress line, rundir.c; checkpoint snapshots ->
 *            checkpoints/step_N.ckpt), takes the stop signals, aborts the communicator once
 *            anything failed, and joins.
 *   loader — forms each step's devices*accum_steps batches and deals them to the workers.
 *   worker — one per device: its micro-batches' forward/backward, the bucketed all-reduce
 *            during the last backward, step control and AdamW on the device.
 * This file keeps what outlives the threads: create (data, backend, run directory, replicas,
 * the GEMM warm-up, communicator), train / evaluate / save between segments, destroy. The
 * resume (resume.c) and the stop signals (signals.c) are rooms of their own.
 */
#include "nmt/trainer.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nmt/clock.h"
#include "nmt/device.h"
#include "nmt/log.h"
#include "preflight.h"
#include "run.h"
#include "zero.h"

void openblas_set_num_threads(int num_threads);
char *openblas_get_corename(void);

void nmt_trainer_options_default(nmt_trainer_options *o) {
  memset(o, 0, sizeof *o);
  o->size = sizeof *o;
  o->fail_rank = -1;
  o->fail_step = -1;
  o->nan_from_step = -1;
  o->fail_bucket = -1;
}

/* ------------------------------------------------------------------------------------------ */
/* create                                                                                     */

/* The profiler (profile.*), its loader and main tracks and the engine's range names. The
 * peaks for MFU and the table are profile.peak_* when set, else measured on rank 0's device by
 * its replica setup. */
static nmt_status setup_profiler(nmt_trainer *t) {
  const nmt_config *cfg = &t->cfg;
  nmt_prof_options po;
  nmt_prof_options_from_config(cfg, &po);
  NMT_TRY(nmt_prof_create(&po, &t->prof));
  size_t K = (size_t)t->world.world * (size_t)t->accum;
  for (int j = 0; j < t->n_loaders; j++) {
    char name[32];
    snprintf(name, sizeof name, t->n_loaders > 1 ? "loader%d" : "loader", j);
    NMT_TRY(nmt_prof_add_track(t->prof, name, 4 * K + 8, &t->loaders[j].prof));
  }
  NMT_TRY(nmt_prof_add_track(t->prof, "main", 16, &t->main_track));
  struct {
    int *id;
    const char *name;
  } names[] = {{&t->rn.step, "step"},           {&t->rn.micro_step, "micro_step"},
               {&t->rn.data_wait, "data_wait"}, {&t->rn.h2d, "h2d"},
               {&t->rn.forward, "forward"},     {&t->rn.backward, "backward"},
               {&t->rn.optimizer, "optimizer"}, {&t->rn.validate, "validate"},
               {&t->rn.checkpoint, "checkpoint"}, {&t->rn.load, "load"},
               {&t->rn.metrics, "metrics"}};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    NMT_TRY(nmt_prof_intern(t->prof, names[i].name, names[i].id));
  t->peak_flops = cfg->profile_peak_tflops > 0 ? cfg->profile_peak_tflops * 1e12 : 0;
  t->peak_gbps = cfg->profile_peak_gbps > 0 ? cfg->profile_peak_gbps : 0;
  return NMT_OK;
}

/* "allreduce.b<i>" for every bucket, bound to every worker's reducer. */
static nmt_status intern_bucket_names(nmt_trainer *t) {
  int nb = t->plan.n_buckets;
  t->rn.allreduce = calloc(nb > 0 ? (size_t)nb : 1, sizeof *t->rn.allreduce);
  if (!t->rn.allreduce) return nmt_errorf(NMT_ERR_NOMEM, "profiler bucket names");
  for (int b = 0; b < nb; b++) {
    char name[32];
    snprintf(name, sizeof name, "allreduce.b%d", b);
    NMT_TRY(nmt_prof_intern(t->prof, name, &t->rn.allreduce[b]));
  }
  for (int r = 0; r < t->n_dev; r++)
    t->workers[r].rep.buckets.range_ids = t->workers[r].rep.zero_grads.range_ids =
        t->rn.allreduce;
  return NMT_OK;
}

/* The training and validation shards and their batchers. */
static nmt_status open_data(nmt_trainer *t) {
  const nmt_config *cfg = &t->cfg;
  NMT_TRY(nmt_shard_open(cfg->data_train, 0, &t->train_shard));
  if (nmt_shard_vocab(t->train_shard) != cfg->model_vocab)
    return nmt_errorf(NMT_ERR_CONFIG, "[model] vocab = %d but %s has vocab %d", cfg->model_vocab,
                      cfg->data_train, nmt_shard_vocab(t->train_shard));
  NMT_TRY(nmt_batcher_create(t->train_shard, cfg->data_max_tokens, cfg->data_max_len,
                             cfg->run_seed, &t->train_batcher));
  if (nmt_batcher_num_dropped(t->train_batcher) > 0)
    nmt_log(NMT_LOG_WARN, "%s: %ld pairs longer than [data] max_len = %d dropped", cfg->data_train,
            nmt_batcher_num_dropped(t->train_batcher), cfg->data_max_len);
  if (cfg->data_valid[0]) {
    NMT_TRY(nmt_shard_open(cfg->data_valid, cfg->model_vocab, &t->valid_shard));
    NMT_TRY(nmt_batcher_create(t->valid_shard, cfg->data_max_tokens, cfg->data_max_len,
                               cfg->run_seed, &t->valid_batcher));
  }
  return NMT_OK;
}

/* Host copies of the state: initial/resumed, checkpoint snapshot, final parameters. */
static nmt_status alloc_host_state(nmt_trainer *t) {
  size_t bytes = t->n_params * sizeof(float);
  t->init_params = malloc(bytes), t->init_m = calloc(t->n_params, sizeof(float));
  t->init_v = calloc(t->n_params, sizeof(float));
  t->mail.params = malloc(bytes), t->mail.m = malloc(bytes), t->mail.v = malloc(bytes);
  t->final_params = malloc(bytes);
  if (!t->init_params || !t->init_m || !t->init_v || !t->mail.params || !t->mail.m ||
      !t->mail.v || !t->final_params)
    return nmt_errorf(NMT_ERR_NOMEM, "host copies of %zu parameters", t->n_params);
  return NMT_OK;
}

/* A worker's share of its device's peak: 1, but 1/k for k workers on one GPU (a GPU listed k
 * times in parallel.devices, comm = host). MFU divides the step's FLOP/s by the workers' peaks
 * summed, which then must add up to the GPUs', not count GPU 0 twice. */
static double worker_peak_share(const nmt_trainer *t) {
  const nmt_config *c = &t->cfg;
  if (t->be->is_host || c->parallel_device_ids_n < 2 || t->n_dev < 1) return 1.0;
  int distinct = 0;
  for (int i = 0; i < c->parallel_device_ids_n; i++) {
    int seen = 0;
    for (int j = 0; j < i && !seen; j++)
      seen = c->parallel_device_ids[j] == c->parallel_device_ids[i];
    distinct += !seen;
  }
  return (double)distinct / (double)t->n_dev;
}

/* What each thread kind gets of the run, and no more: a worker the config, the test options,
 * the validation batches, the profiler and its range ids, the MFU peak and the checkpoint
 * header base, and the shared parts it names (flags, position, mailbox, BLEU's decoder); a
 * loader the batcher, the model config, the world's shape, the feeds and the flags. */
static void bind_threads(nmt_trainer *t) {
  for (int r = 0; r < t->n_dev; r++) {
    nmt__worker *w = &t->workers[r];
    w->cfg = &t->cfg, w->opt = &t->opt, w->valid = t->valid_batcher;
    w->profiler = t->prof, w->rn = &t->rn, w->accum = t->accum;
    w->peak_flops = t->peak_flops * worker_peak_share(t), w->ckpt_base = &t->ckpt_base;
    w->sync = &t->sync, w->pos = &t->pos, w->mail = &t->mail, w->vbleu = &t->vbleu;
  }
  for (int j = 0; j < t->n_loaders; j++) {
    nmt__loader *L = &t->loaders[j];
    L->batcher = t->train_batcher, L->mcfg = &t->mcfg;
    L->world = t->world.world, L->first_rank = t->world.first_rank;
    L->n_local = t->n_dev, L->accum = t->accum, L->feeds = t->feeds;
    L->index = j, L->n_loaders = t->n_loaders, L->sync = &t->sync;
    L->range_data_wait = t->rn.data_wait, L->range_load = t->rn.load;
  }
}

/* The fields every checkpoint header of the run repeats: the model's shape, n_params, the
 * moments' presence, the seed and the embedded config and SentencePiece model
 * (nmt__ckpt_header adds the position, the loss scaler and the best validation). */
static void make_ckpt_base(nmt_trainer *t) {
  const nmt_model_cfg *c = &t->mcfg;
  nmt_ckpt_header *h = &t->ckpt_base;
  memset(h, 0, sizeof *h);
  h->vocab = c->vocab, h->d_model = c->d_model, h->n_heads = c->n_heads, h->d_ff = c->d_ff;
  h->enc_layers = c->enc_layers, h->dec_layers = c->dec_layers, h->norm = (int32_t)c->norm;
  h->n_params = t->n_params;
  h->has_moments = 1;
  h->seed = t->cfg.run_seed;
  h->meta = &t->ckpt_meta;
}

/* Rank 0's parameters into the host's final copy (nmt_trainer_params). */
static nmt_status copy_final_params(nmt_trainer *t) {
  const nmt__replica *r0 = &t->workers[0].rep;
  return t->be->copy_d2h(r0->ctx, t->final_params, r0->params, t->n_params * sizeof(float));
}

/* The most bytes of buffers one rank hands to collectives between two flushes, for a
 * communicator that stages them (nmt_comm_reserve_staging): every bucket of a step and the
 * trailing slots (replicated; ZeRO 1's padded buckets, and its all-gathers of the whole
 * parameter buffer), plus ZeRO 2's windows in flight. A bound, not an exact count: a
 * communicator that runs out of room runs its pending collectives early. */
static size_t staging_bytes(const nmt_bucket_plan *p) {
  size_t floats = p->extra_offset + NMT_GRAD_EXTRA;
  if (p->total_floats + NMT_GRAD_EXTRA > floats) floats = p->total_floats + NMT_GRAD_EXTRA;
  return (floats + nmt_grad_windows_floats(p)) * sizeof(float);
}

/* Loaders, workers (each with its replica), the GEMM warm-up of a device backend, and the
 * communicator group, made by the backend once every worker's device context exists (CPU
 * workers and one GPU: the host communicator, which one GPU never calls; several GPUs: NCCL). */
static nmt_status create_workers(nmt_trainer *t) {
  const nmt_config *cfg = &t->cfg;
  t->n_loaders = nmt__loader_threads(cfg);
  t->loaders = calloc((size_t)t->n_loaders, sizeof *t->loaders);
  t->workers = calloc((size_t)t->n_dev, sizeof *t->workers);
  t->feeds = calloc((size_t)t->n_dev, sizeof *t->feeds);
  t->comms = calloc((size_t)t->n_dev, sizeof *t->comms);
  if (!t->workers || !t->feeds || !t->comms || !t->loaders)
    return nmt_errorf(NMT_ERR_NOMEM, "workers");
  NMT_TRY(setup_profiler(t));
  int dev[t->n_dev];
  void *ctx[t->n_dev];
  for (int r = 0; r < t->n_dev; r++) {
    NMT_TRY(nmt__replica_setup(t, r, &t->feeds[r], &t->workers[r].rep));
    dev[r] = t->workers[r].rep.device;
    ctx[r] = t->workers[r].rep.ctx;
  }
  /* Device backends: cuBLASLt's GEMM kernels loaded now, while no collective can be in
   * flight, instead of behind step 1's gradient buckets (warmup.c). Not on CPU workers. */
  NMT_TRY(nmt__warmup(t, 0));
  /* Validation BLEU's decoder, once for the run and before the communicator: no collective is
   * in flight while it allocates, and no validation allocates again (valid.c). */
  NMT_TRY(nmt__valid_open(&t->vbleu, t->be, &t->sync.abort, t->init_params));
  if (t->world.multi) {
    /* Every node runs the same config from the same step, or none starts. */
    NMT_TRY(nmt__world_agree(t, "nmt"));
    NMT_TRY(nmt_device_comm_create_world(cfg, t->be, t->world.rendezvous, "nmt",
                                         t->world.timeout_s, t->n_dev, t->world.first_rank,
                                         t->world.world, dev, ctx, &t->sync.abort, t->comms));
    nmt_log(NMT_LOG_INFO, "node %d of %d: ranks %d..%d of %d, %s communicator, rendezvous %s",
            t->world.node_rank, t->world.nodes, t->world.first_rank,
            t->world.first_rank + t->n_dev - 1, t->world.world,
            t->be->is_host ? "Gloo" : "NCCL", t->world.rendezvous);
  } else {
    NMT_TRY(nmt_device_comm_create(cfg, t->be, t->n_dev, dev, ctx, &t->sync.abort, t->comms));
  }
  for (int r = 0; r < t->n_dev; r++) {
    nmt__replica *rep = &t->workers[r].rep;
    rep->comm = rep->buckets.comm = rep->zero_grads.comm = t->comms[r];
  }
  /* parallel.bucket_mb = auto: measured on this run's replicas and communicator, before the
   * buckets get their names, the wire its reservation and the memory report its plan. */
  NMT_TRY(nmt__bucket_auto(t));
  /* A communicator that stages through host memory allocates it now (for the plan as cut),
   * never in the step; the others ignore it. */
  for (int r = 0; t->n_dev > 1 && r < t->n_dev; r++)
    NMT_TRY(nmt_comm_reserve_staging(t->comms[r], staging_bytes(&t->plan)));
  nmt__replica_log_memory(&t->workers[0].rep);
  if (t->n_dev > 1 && !t->world.multi && (!t->be->is_host || cfg->parallel_comm != NMT_COMM_AUTO)) {
    char list[NMT_MAX_DEVICE_IDS * 6] = "";
    if (cfg->parallel_device_ids_n) nmt_config_devices_str(cfg, list, sizeof list);
    nmt_log(NMT_LOG_INFO, "%s communicator over %d %s%s%s", nmt_comm_name(t->comms[0]),
            t->n_dev, t->be->is_host ? "CPU workers" : "GPU workers", *list ? " on GPUs " : "",
            list);
  }
  /* A half-precision wire needs a cast buffer per rank (NCCL: device memory), sized once
   * here for the largest bucket, never in the step. */
  if (t->world.world > 1 && cfg->parallel_grad_dtype != NMT_GRAD_FP32)
    for (int r = 0; r < t->n_dev; r++)
      NMT_TRY(nmt_comm_reserve(t->comms[r], t->plan.bucket_floats));
  NMT_TRY(intern_bucket_names(t));
  bind_threads(t);
  return NMT_OK;
}


static nmt_status create(nmt_trainer *t) {
  const nmt_config *cfg = &t->cfg;
  t->n_dev = cfg->parallel_devices;
  t->accum = cfg->train_accum_steps;
  NMT_TRY(nmt__world_resolve(cfg, &t->world));
  if (t->world.multi && cfg->parallel_zero)
    return nmt_errorf(NMT_ERR_CONFIG, "[parallel] zero = %d with nodes = %d: ZeRO's consolidated "
                      "checkpoints are gathered in one process's memory; use zero = 0 across "
                      "nodes (docs/multinode.md)", cfg->parallel_zero, t->world.nodes);
  nmt_model_cfg_from_config(cfg, &t->mcfg);
  /* fp16/bf16: activations in half unless precision.activations = fp32 (docs/cuda.md). */
  t->mcfg.act_half = nmt_model_half_storage(cfg);
  t->n_params = nmt_model_num_params(&t->mcfg);
  if (cfg->parallel_zero == 2)
    NMT_TRY(nmt_bucket_plan_make_model_stages(&t->mcfg, t->world.world, &t->plan));
  else if (cfg->parallel_zero)
    NMT_TRY(nmt_bucket_plan_make_sharded(nmt__bucket_auto_provisional_mb(cfg), t->n_params,
                                         t->world.world, cfg->parallel_zero, 0, &t->plan));
  else
    NMT_TRY(nmt_bucket_plan_make(nmt__bucket_auto_provisional_mb(cfg), t->n_params,
                                 NMT_GRAD_EXTRA, 0, &t->plan));
  t->batch_ints = 5 * (size_t)cfg->data_max_tokens + 16; /* nmt_batch_layout's 5 arrays */
  t->dir.last_valid_loss = NAN;
  t->dir.last_valid_bleu = NAN;
  t->pos.scaler0.enabled = cfg->precision_mode == NMT_PRECISION_FP16;
  t->pos.scaler0.scale = t->pos.scaler0.enabled ? cfg->precision_loss_scale : 1.0f;
  /* One BLAS thread per worker: the workers are the parallelism. */
  openblas_set_num_threads(1);
  NMT_TRY(open_data(t));
  /* The validation keys; BLEU's text, model and sacreBLEU. */
  NMT_TRY(nmt__valid_setup(cfg, t->world.first_rank, t->n_params, &t->vbleu));
  t->pos.best0 = (nmt__best){.metric = cfg->train_best_metric};
  NMT_TRY(nmt_data_check_spm(cfg)); /* data.spm_model: loadable, [model] vocab, the shards' */
  /* After the checks of config and data (a refused config leaves no directory behind), before
   * anything is read from or written there: another live run's directory, or a previous run's
   * work without --resume, is refused here. */
  NMT_TRY(nmt__rundir_claim(t));
  NMT_TRY(alloc_host_state(t));
  NMT_TRY(nmt_ckpt_meta_from_config(cfg, &t->ckpt_meta));
  NMT_TRY(nmt_ckpt_data_of(cfg, nmt_shard_num_pairs(t->train_shard),
                           nmt_batcher_num_batches(t->train_batcher), t->world.world,
                           &t->ckpt_meta.data));
  make_ckpt_base(t);
  /* Room for a checkpoint now, not at the first one (preflight.c); node 0 writes them. */
  if (t->world.node_rank == 0) NMT_TRY(nmt__preflight_checkpoint(t->dir.ckpt_dir, &t->ckpt_base));
  nmt_model_init_params(&t->mcfg, cfg->run_seed, t->init_params);
  if (cfg->run_resume) NMT_TRY(nmt__resume(t));
  t->pos.best_end = t->dir.best = t->pos.best0;
  NMT_TRY(create_workers(t));
  NMT_TRY(nmt_ring_init(&t->mail.full, NMT__MSG_POOL));
  NMT_TRY(nmt_ring_init(&t->mail.free, NMT__MSG_POOL));
  /* Last: config.ini and metrics.jsonl are the accepted run's; a setup that failed above
   * leaves the previous ones as they were. */
  NMT_TRY(nmt__rundir_open(t));
  for (int i = 0; i < NMT__MSG_POOL - 1; i++) nmt_ring_try_push(&t->mail.free, &t->mail.pool[i]);
  atomic_store(&t->sync.steps_done, t->pos.start_step);
  t->pos.scaler_end = t->pos.scaler0;
  t->pos.pos_epoch = t->pos.start_epoch, t->pos.pos_index = t->pos.start_index;
  memcpy(t->final_params, t->init_params, t->n_params * sizeof(float));
  if (t->opt.handle_signals) nmt__signals_install(&t->signals);
  return NMT_OK;
}

nmt_status nmt_trainer_create(const nmt_config *cfg, const nmt_trainer_options *opt,
                              nmt_trainer **out) {
  *out = NULL;
  const nmt_backend *be;
  NMT_TRY(nmt_device_select(cfg, cfg->parallel_devices, NMT_DEVICE_TRAIN, &be));
  if (!cfg->data_train[0])
    return nmt_errorf(NMT_ERR_CONFIG, "[data] train is empty: name a training shard");
  nmt_trainer *t = calloc(1, sizeof *t);
  if (!t) return nmt_errorf(NMT_ERR_NOMEM, "trainer");
  t->cfg = *cfg;
  if (opt) t->opt = *opt;
  else nmt_trainer_options_default(&t->opt);
  t->be = be;
  nmt_status s = create(t);
  if (s == NMT_OK) {
    *out = t;
    return NMT_OK;
  }
  /* A scheduler polling status.json should see why, also when setup failed; only once this
   * run has claimed the directory (a refused one's status.json belongs to the run that holds
   * it or left it), and not over the status of a run a refused --resume meant to continue
   * (keep_status): the command failed, that run did not. */
  if (t->dir.out_dir_made && !t->dir.keep_status)
    nmt__write_status(t, "failed", s, nmt_last_error());
  nmt_trainer_destroy(t);
  return s;
}

/* ------------------------------------------------------------------------------------------ */
/* the main thread                                                                            */

/* Drains worker 0's messages: metrics records and checkpoint snapshots (a checkpoint of the
 * best validation also points checkpoints/best at itself: nmt_ckpt_save_step). */
static nmt_status serve_msgs(nmt_trainer *t) {
  void *p;
  nmt_status first = NMT_OK;
  while (nmt_ring_try_pop(&t->mail.full, &p)) {
    nmt__msg *m = p;
    const int metrics = m->kind == NMT__MSG_METRICS;
    nmt_prof_step_begin(t->main_track, metrics ? m->metrics.step : m->ckpt.step);
    nmt_prof_push(t->main_track, metrics ? t->rn.metrics : t->rn.checkpoint, NMT_PROF_OTHER, 0,
                  0);
    if (metrics) {
      const nmt_metrics *mt = &m->metrics;
      if (mt->has_valid) t->dir.last_valid_loss = mt->valid_loss;
      if (mt->has_bleu) t->dir.last_valid_bleu = mt->valid_bleu;
      t->dir.best.step = mt->best_step, t->dir.best.value = mt->best_value;
      t->dir.best.bad = mt->best_bad;
      nmt__write_metrics(t, mt);
      nmt__write_status(t, "running", NMT_OK, NULL);
    } else {
      char path[1024];
      nmt_status s = nmt_ckpt_save_step(t->dir.ckpt_dir, &m->ckpt, t->mail.params, t->mail.m,
                                        t->mail.v, t->cfg.checkpoint_keep, path);
      if (s == NMT_OK) {
        const int best = m->ckpt.best_step > 0 && m->ckpt.best_step == m->ckpt.step;
        nmt_log(NMT_LOG_INFO, "checkpoint %s%s", path, best ? " (best: checkpoints/best)" : "");
        snprintf(t->dir.last_ckpt, sizeof t->dir.last_ckpt, "%s", path);
        nmt__write_status(t, "running", NMT_OK, NULL);
      } else if (first == NMT_OK) {
        first = s;
      }
      atomic_store_explicit(&t->mail.busy, 0, memory_order_release);
    }
    nmt_prof_pop(t->main_track);
    nmt_prof_step_end(t->main_track); /* host clock: cannot fail */
    nmt_ring_try_push(&t->mail.free, m);
  }
  return first;
}

/* The serving loop while `started` threads run: drains worker 0's messages, handles signals,
 * aborts the communicator once anything failed, draws the training progress line (`training`:
 * not during nmt_trainer_evaluate, whose workers run no steps), and joins the threads when they
 * have all returned. */
static void serve_and_join(nmt_trainer *t, pthread_t *threads, const int *started, int n,
                           int training) {
  int live = 0;
  for (int r = 0; r < n; r++) live += started[r];
  const struct timespec tick = {0, 2000000};
  while (atomic_load(&t->sync.workers_done) < live) {
    nmt_status ms = serve_msgs(t);
    if (ms != NMT_OK) nmt__sync_record_error(&t->sync, -1, ms);
    if (t->opt.handle_signals) nmt__signals_poll(&t->signals, &t->sync);
    if (atomic_load(&t->sync.abort)) nmt_comm_abort(t->comms[0]);
    if (training) nmt__progress_tick(t); /* on a terminal: every 2 s, not only at log steps */
    nanosleep(&tick, NULL);
  }
  for (int r = 0; r < n; r++)
    if (started[r]) pthread_join(threads[r], NULL);
}

/* The devices' state after `step` (rank 0's parameters and moments; with ZeRO every rank's
 * shard of them) through the host snapshot into checkpoints/step_<step>.ckpt, with data
 * position (epoch, index), loss scaler ls and the best validation pos.best_end; path: the
 * file. Only while no worker runs: between segments, or after the join. */
static nmt_status write_checkpoint(nmt_trainer *t, long step, long epoch, long index,
                                   const nmt__loss_scaler *ls, char path[1024]) {
  const size_t bytes = t->n_params * sizeof(float);
  const nmt__replica *r0 = &t->workers[0].rep;
  NMT_TRY(t->be->copy_d2h(r0->ctx, t->mail.params, r0->params, bytes));
  if (t->plan.zero) {
    /* No worker runs: their contexts are free to gather every rank's shard here. */
    for (int r = 0; r < t->n_dev; r++)
      NMT_TRY(nmt__zero_save_moments(&t->workers[r].rep, t->mail.m, t->mail.v));
  } else {
    NMT_TRY(t->be->copy_d2h(r0->ctx, t->mail.m, r0->m, bytes));
    NMT_TRY(t->be->copy_d2h(r0->ctx, t->mail.v, r0->v, bytes));
  }
  nmt_ckpt_header h;
  nmt__ckpt_header(&t->ckpt_base, &t->pos.best_end, ls, step, epoch, index, &h);
  NMT_TRY(nmt_ckpt_save_step(t->dir.ckpt_dir, &h, t->mail.params, t->mail.m, t->mail.v,
                             t->cfg.checkpoint_keep, path));
  snprintf(t->dir.last_ckpt, sizeof t->dir.last_ckpt, "%s", path);
  return NMT_OK;
}

/* After a validation failed (sync.valid_failed_step, a worker's record): when that is the
 * step rank 0 finished last, the devices hold its state whole (no later step was enqueued),
 * and it is written now rather than lost with every step since the last checkpoint. The
 * best validation is the one before the failed one. A failure here only warns: the run's
 * error stays the validation's. */
static void keep_failed_validation(nmt_trainer *t) {
  const long step = atomic_load(&t->sync.valid_failed_step);
  if (step <= 0 || step != atomic_load(&t->sync.steps_done) || t->world.node_rank > 0) return;
  char path[1024];
  if (write_checkpoint(t, step, t->pos.pos_epoch, t->pos.pos_index, &t->pos.scaler_end,
                       path) == NMT_OK)
    nmt_log(NMT_LOG_INFO, "checkpoint step_%ld written before exiting: %s (--resume continues "
            "from it)", step, path);
  else
    nmt_log(NMT_LOG_WARN, "the checkpoint of step %ld could not be written before exiting: %s",
            step, nmt_last_error());
}

/* Marks the trainer dead after an error (the communicator is aborted for good) and reports. */
static nmt_status fail_run(nmt_trainer *t) {
  t->sync.dead = 1;
  nmt_status s = t->sync.error;
  if (t->signals.user_aborted && s == NMT_ERR_ABORTED) {
    /* After the last drain (nmt_trainer_train): the checkpoint named is the last one. */
    nmt__signals_abort_message(&t->signals, atomic_load(&t->sync.steps_done), t->dir.last_ckpt,
                               t->sync.error_msg, sizeof t->sync.error_msg);
    nmt_log(NMT_LOG_ERROR, "run aborted: %s", t->sync.error_msg); /* no worker failed */
  } else {
    nmt_log(NMT_LOG_ERROR, "run failed on %s%d: %s: %s",
            t->sync.error_rank >= 0 ? "rank " : "main ", t->sync.error_rank, nmt_status_str(s),
            t->sync.error_msg);
  }
  keep_failed_validation(t);
  nmt__write_status(t, "failed", s, t->sync.error_msg);
  /* The caller's thread gets the first error's message, whichever thread recorded it. */
  return nmt_errorf(s, "%s", t->sync.error_msg);
}

/* Starts one thread per worker running fn; started[r] says which did. */
static void start_workers(nmt_trainer *t, void *(*fn)(void *), const char *what,
                          pthread_t *threads, int *started) {
  for (int r = 0; r < t->n_dev; r++) started[r] = 0;
  for (int r = 0; r < t->n_dev; r++) {
    if (pthread_create(&threads[r], NULL, fn, &t->workers[r]) != 0) {
      nmt__sync_record_error(&t->sync, r, nmt_errorf(NMT_ERR_INTERNAL, "cannot start %s thread %d",
                                                     what, r));
      break;
    }
    started[r] = 1;
  }
}

/* Starts the loaders; on a failure joins those started and returns the error. */
static nmt_status start_loaders(nmt_trainer *t) {
  for (int j = 0; j < t->n_loaders; j++) {
    nmt__loader *L = &t->loaders[j];
    L->start_step = t->pos.start_step, L->end_step = t->pos.end_step;
    L->start_epoch = t->pos.start_epoch, L->start_index = t->pos.start_index;
    if (pthread_create(&L->thread, NULL, nmt__loader_main, L) != 0) {
      nmt__sync_record_error(&t->sync, -1,
                             nmt_errorf(NMT_ERR_INTERNAL, "cannot start loader thread %d", j));
      atomic_store(&t->sync.shutdown, 1);
      for (int i = 0; i < j; i++) pthread_join(t->loaders[i].thread, NULL);
      return NMT_ERR_INTERNAL;
    }
  }
  return NMT_OK;
}

/* Ready for a segment: batches a previous segment that stopped early left in the rings go
 * back (the loader restarts from the data position of the last completed step). */
static void reset_segment(nmt_trainer *t, long n_steps) {
  const long max = t->cfg.train_max_steps;
  t->pos.end_step = n_steps > 0 && n_steps < max - t->pos.start_step ? t->pos.start_step + n_steps
                                                                     : max;
  for (int r = 0; r < t->n_dev; r++) {
    void *p;
    nmt__feed *f = &t->feeds[r];
    while (nmt_ring_try_pop(&f->batches, &p)) nmt_ring_try_push(&f->free_slots, p);
    t->workers[r].started = 0;
  }
  atomic_store(&t->sync.shutdown, 0);
  atomic_store(&t->sync.workers_done, 0);
  nmt__stop_open(&t->sync, t->pos.start_step + 1); /* until worker 0 says better */
  t->pos.stopped = 0;
  t->pos.early_stopped = 0;
  t->dir.reason[0] = 0;
  t->pos.t_start = nmt_clock_now_s();
}

nmt_status nmt_trainer_train(nmt_trainer *t, long n_steps) {
  if (t->sync.dead) return nmt_errorf(t->sync.error, "%s", t->sync.error_msg);
  const long max = t->cfg.train_max_steps;
  const int early = nmt__best_exhausted(&t->cfg, &t->pos.best0);
  if (t->pos.start_step >= max || early) {
    if (early) {
      nmt__best_reason(&t->cfg, &t->pos.best0, t->pos.start_step, t->dir.reason,
                       sizeof t->dir.reason);
      nmt_log(NMT_LOG_INFO, "%s: nothing to train", t->dir.reason);
    } else {
      snprintf(t->dir.reason, sizeof t->dir.reason, "train.max_steps = %ld reached", max);
      nmt_log(NMT_LOG_INFO, "already at step %ld of %ld: nothing to train", t->pos.start_step,
              max);
    }
    NMT_TRY(copy_final_params(t));
    nmt__write_status(t, "done", NMT_OK, NULL);
    return NMT_OK;
  }
  reset_segment(t, n_steps);
  nmt__write_status(t, "running", NMT_OK, NULL);
  nmt__log_step_estimate(t, t->pos.end_step - t->pos.start_step);
  /* OpenBLAS picks its sgemm kernels per CPU (OPENBLAS_CORETYPE overrides): CPU workers with
   * other kernels train to other bits, so the run says which (docs/determinism.md). */
  if (t->be->is_host)
    nmt_log(NMT_LOG_INFO, "OpenBLAS kernels: %s (OPENBLAS_CORETYPE=%s)", openblas_get_corename(),
            getenv("OPENBLAS_CORETYPE") ? getenv("OPENBLAS_CORETYPE") : "unset: chosen for this CPU");
  nmt_log(NMT_LOG_INFO, "training %zu parameters on %d %s worker(s), %d loader thread(s), "
          "accum_steps %d, steps %ld..%ld", t->n_params, t->n_dev, t->be->name, t->n_loaders,
          t->accum, t->pos.start_step + 1, t->pos.end_step);
  if (start_loaders(t) != NMT_OK) return fail_run(t);
  pthread_t threads[t->n_dev];
  int started[t->n_dev];
  start_workers(t, nmt__worker_main, "worker", threads, started);
  for (int r = 0; r < t->n_dev; r++) t->workers[r].started = started[r];
  serve_and_join(t, threads, started, t->n_dev, 1);
  atomic_store(&t->sync.shutdown, 1);
  for (int j = 0; j < t->n_loaders; j++) pthread_join(t->loaders[j].thread, NULL);
  nmt_status ms = serve_msgs(t);
  if (ms != NMT_OK) nmt__sync_record_error(&t->sync, -1, ms);
  if (nmt__sync_failed(&t->sync)) return fail_run(t);

  t->pos.start_step = atomic_load(&t->sync.steps_done);
  t->pos.start_epoch = t->pos.pos_epoch;
  t->pos.start_index = t->pos.pos_index;
  t->pos.scaler0 = t->pos.scaler_end;
  t->pos.best0 = t->pos.best_end;
  NMT_TRY(copy_final_params(t));
  nmt_log_progress_end(); /* the last progress line stays on screen */
  nmt__write_profile(t);
  nmt_log(NMT_LOG_INFO, "at step %ld of %ld after %.1f s", t->pos.start_step, max,
          nmt_clock_now_s() - t->pos.t_start);
  if (t->pos.early_stopped) {
    /* Not a pause: a stop request that came meanwhile has nothing left to stop. */
    nmt__stop_clear(&t->sync);
    nmt__best_reason(&t->cfg, &t->pos.best0, t->pos.start_step, t->dir.reason,
                     sizeof t->dir.reason);
    nmt_log(NMT_LOG_INFO, "%s; checkpoint %s", t->dir.reason, t->dir.last_ckpt);
    nmt__write_status(t, "done", NMT_OK, NULL);
    return NMT_OK;
  }
  if (t->pos.stopped) {
    nmt__stop_clear(&t->sync);
    snprintf(t->dir.reason, sizeof t->dir.reason, "stop requested after step %ld",
             t->pos.start_step);
    nmt__write_status(t, "stopped", NMT_STOPPED, NULL);
    return NMT_STOPPED;
  }
  if (t->pos.start_step >= max)
    snprintf(t->dir.reason, sizeof t->dir.reason, "train.max_steps = %ld reached", max);
  nmt__write_status(t, t->pos.start_step >= max ? "done" : "running", NMT_OK, NULL);
  return NMT_OK;
}

nmt_status nmt_trainer_run(nmt_trainer *t) { return nmt_trainer_train(t, 0); }

nmt_status nmt_trainer_evaluate(nmt_trainer *t, double *loss, double *nll, double *tokens) {
  if (t->sync.dead) return nmt_errorf(t->sync.error, "%s", t->sync.error_msg);
  if (!t->valid_batcher)
    return nmt_errorf(NMT_ERR_CONFIG, "evaluate: [data] valid is empty: name a validation shard");
  atomic_store(&t->sync.workers_done, 0);
  pthread_t threads[t->n_dev];
  int started[t->n_dev];
  start_workers(t, nmt__eval_main, "evaluation", threads, started);
  serve_and_join(t, threads, started, t->n_dev, 0);
  if (nmt__sync_failed(&t->sync)) return fail_run(t);
  const double *out = t->workers[0].valid_out; /* the same reduced slots on every rank */
  double tok = out[NMT_GRAD_SLOT_TOKENS];
  if (!(tok > 0))
    return nmt_errorf(NMT_ERR_DATA, "evaluate: %s has no target tokens", t->cfg.data_valid);
  if (loss) *loss = out[NMT_GRAD_SLOT_LOSS] / tok;
  if (nll) *nll = out[NMT_GRAD_SLOT_NLL] / tok;
  if (tokens) *tokens = tok;
  t->dir.last_valid_loss = out[NMT_GRAD_SLOT_LOSS] / tok;
  return NMT_OK;
}

nmt_status nmt_trainer_save(nmt_trainer *t, char *path_out) {
  if (t->sync.dead) return nmt_errorf(t->sync.error, "%s", t->sync.error_msg);
  if (t->world.node_rank > 0) { /* checkpoints are global rank 0's to write */
    if (path_out) path_out[0] = 0;
    return NMT_OK;
  }
  char path[1024];
  NMT_TRY(write_checkpoint(t, t->pos.start_step, t->pos.start_epoch, t->pos.start_index,
                           &t->pos.scaler0, path));
  nmt_log(NMT_LOG_INFO, "checkpoint %s", path);
  nmt__write_status(t, t->dir.state ? t->dir.state : "running", NMT_OK, NULL);
  if (path_out) snprintf(path_out, 1024, "%s", path);
  return NMT_OK;
}

void nmt_trainer_request_stop(nmt_trainer *t) { (void)nmt__stop_request(&t->sync); }

long nmt_trainer_step(const nmt_trainer *t) {
  return atomic_load(&((nmt_trainer *)t)->sync.steps_done);
}

long nmt_trainer_end_step(const nmt_trainer *t) {
  /* Between segments pos.best0 is the state after the last step trained. */
  return nmt__best_exhausted(&t->cfg, &t->pos.best0) ? t->pos.start_step
                                                      : t->cfg.train_max_steps;
}

const float *nmt_trainer_params(const nmt_trainer *t, size_t *n) {
  if (n) *n = t->n_params;
  return t->final_params;
}

const float *nmt_trainer_last_grads(const nmt_trainer *t, int rank, size_t *n) {
  if (n) *n = t->n_params + NMT_GRAD_EXTRA;
  return rank >= 0 && rank < t->n_dev ? t->workers[rank].rep.host_grads : NULL;
}

nmt_status nmt_trainer_memory(const nmt_trainer *t, int rank, size_t *grad_bytes,
                              size_t *optim_bytes) {
  if (rank < 0 || rank >= t->n_dev)
    return nmt_errorf(NMT_ERR_USAGE, "trainer memory: rank %d not in [0, %d)", rank, t->n_dev);
  if (grad_bytes) *grad_bytes = t->workers[rank].rep.bytes_grads;
  if (optim_bytes) *optim_bytes = t->workers[rank].rep.bytes_optim;
  return NMT_OK;
}

const nmt_metrics *nmt_trainer_last_metrics(const nmt_trainer *t) { return &t->dir.last_metrics; }

void nmt_trainer_destroy(nmt_trainer *t) {
  if (!t) return;
  nmt__signals_restore(&t->signals);
  nmt__world_release(t);
  /* The communicator first: an NCCL group must not outlive (or be waited on by) the device
   * contexts' teardown, which synchronizes the devices. */
  if (t->comms && t->comms[0]) nmt_comm_destroy(t->comms, t->n_dev);
  if (t->workers)
    for (int r = 0; r < t->n_dev; r++) nmt__replica_free(&t->workers[r].rep);
  nmt_prof_destroy(t->prof); /* after the models, which point at its tracks */
  free(t->rn.allreduce);
  nmt_bucket_plan_free(&t->plan);
  free(t->comms);
  free(t->workers);
  free(t->feeds);
  free(t->loaders);
  nmt_ring_free(&t->mail.full);
  nmt_ring_free(&t->mail.free);
  if (t->train_batcher) nmt_batcher_destroy(t->train_batcher);
  if (t->valid_batcher) nmt_batcher_destroy(t->valid_batcher);
  if (t->train_shard) nmt_shard_close(t->train_shard);
  if (t->valid_shard) nmt_shard_close(t->valid_shard);
  if (t->dir.metrics_file) fclose(t->dir.metrics_file);
  nmt_tb_close(t->dir.tb);
  nmt__rundir_release(t);
  free(t->init_params), free(t->init_m), free(t->init_v);
  free(t->mail.params), free(t->mail.m), free(t->mail.v);
  free(t->final_params);
  nmt_ckpt_meta_free(&t->ckpt_meta);
  nmt__valid_free(&t->vbleu);
  free(t);
}
