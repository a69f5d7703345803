/* trainer.c — the engine: main/loader/worker threads, accumulation, buckets, checkpoints.
 *
 * Thread map (DESIGN.md "Threads"):
 *   main   — nmt_trainer_run's caller: serves the metrics ring, writes metrics.jsonl and
 *            checkpoints, watches errors and signals, joins.
 *   loader — forms each step's devices*accum_steps batches, deals them to the workers
 *            (balanced by target tokens) through one SPSC ring per worker; slots come back
 *            through a return ring, so no allocation and no lock on the per-step path.
 *   worker — one per device: forward/backward of its micro-batches, bucketed all-reduce during
 *            the last micro-batch's backward, step control and AdamW on the device. The host
 *            never waits for the step it has just enqueued: it reads the previous step's
 *            control block (loss, tokens, verdict) while this one runs; on the ref backend
 *            every op is synchronous anyway.
 */
#include "nmt/trainer.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>

#include "nmt/backend.h"
#include "nmt/checkpoint.h"
#include "nmt/comm.h"
#include "nmt/cuda_prof.h"
#ifdef NMT_CUDA
#include "nmt/cuda.h"
#endif
#include "nmt/data.h"
#include "nmt/json.h"
#include "nmt/log.h"
#include "nmt/model.h"
#include "nmt/prof.h"
#include "nmt/ring.h"

void openblas_set_num_threads(int num_threads);

/* Runs `expr` (an nmt_status) inside profiler range `name` on `track` with cost `cost`; the
 * range is closed before an error is returned. */
#define PROFILED(track, name, phase, cost, expr)                     \
  do {                                                               \
    nmt_prof_cost pc_ = (cost);                                      \
    nmt_prof_push((track), (name), (phase), pc_.flops, pc_.bytes);   \
    nmt_status ps_ = (expr);                                         \
    nmt_prof_pop(track);                                             \
    NMT_TRY(ps_);                                                    \
  } while (0)
#define NO_COST ((nmt_prof_cost){0, 0})

enum { MSG_POOL = 64 };

typedef struct {
  nmt_batch b;        /* host batch, arrays inside buf */
  int32_t *buf;
  long step;          /* optimizer step (0-based) the batch belongs to */
  int k;              /* index in the step's list of devices*accum batches: keys dropout */
  double step_flops;  /* model FLOPs of the whole step (all devices' batches), for MFU */
  long next_epoch;    /* data position after the whole step, for checkpoints */
  long next_index;
} batch_slot;

typedef enum { MSG_METRICS, MSG_CHECKPOINT } msg_kind;

typedef struct {
  msg_kind kind;
  nmt_metrics metrics;
  nmt_ckpt_header ckpt;
} msg;

/* Dynamic loss scaling for fp16 (Micikevicius et al. 2018 §3.2; the policy of PyTorch's
 * GradScaler): gradients are computed for scale * loss; a step whose reduced gradient holds an
 * inf or NaN is skipped and the scale multiplied by precision.backoff; growth_interval clean
 * steps in a row double it. Every rank keeps its own copy and takes the same decisions: they
 * all read the same reduced gradient (an inf/NaN on one rank reaches every rank through the
 * sum), so no extra collective is needed. Other precisions: scale 1, never skip. */
typedef struct {
  int enabled;        /* precision.mode = fp16 */
  float scale;
  long good;          /* clean steps since the scale last changed */
  int64_t skipped;    /* steps skipped so far in the run */
} loss_scaler;

/* What the host knows of a step it has enqueued, until it reads the step's control block. */
typedef struct {
  long step;                           /* 0-based */
  long next_epoch, next_index, epoch;  /* data position after the step; the step's epoch */
  double lr, flops;                    /* the step's learning rate; model FLOPs of all ranks */
} step_info;

typedef struct worker {
  struct nmt_trainer *t;
  int rank;
  pthread_t thread;
  int started;
  nmt_ring batches;   /* loader -> worker: filled slots */
  nmt_ring free_slots;/* worker -> loader: slots to refill */
  batch_slot *slots;
  int n_slots;
  nmt_comm *comm;
  void *ctx;          /* the backend's device context (NULL on ref) */
  nmt_model *model;
  float *params, *grads, *m, *v; /* device memory (host on ref) */
  /* fp16/bf16 modes: the half working copy of params that the GEMMs read (backend
   * half_weights), refreshed by adamw; NULL in fp32/tf32. */
  void *half_params;
  int32_t *dev_batch_buf; /* validation batches (copied synchronously) */
  /* Training batches: two staging slots on the device. The copy of micro-batch i+1 runs on
   * the copy stream while micro-batch i computes (backend h2d_async / acquire / release). */
  int32_t *dev_stage[2];
  batch_slot *ahead;  /* popped and being copied into dev_stage[ahead_slot]; NULL = none */
  int ahead_slot;
  nmt_step_ctl *dev_ctl;  /* device: the step's control block (loss scaler state, verdict) */
  nmt_step_ctl *host_ctl; /* pinned, NMT_D2H_SLOTS: step s's block is read back into [s % 2] */
  step_info inflight[NMT_D2H_SLOTS]; /* the host's side of the steps being read back */
  float *dev_valid;   /* NMT_GRAD_EXTRA floats: validation loss slots */
  int32_t *valid_host_buf;
  size_t bucket_floats;
  int n_buckets;
  int next_bucket;
  int reduce_now;     /* reduce buckets during this backward (last micro-batch) */
  float *host_grads;  /* copy of the last reduced gradient (tests) */
  loss_scaler scaler;
  nmt_prof_track *prof; /* this worker's profiler track ("cpu0", "gpu0", ...) */
  void *prof_clock;     /* GPU workers in a profile window: the CUDA event clock */
  double mem_peak_mb;   /* GPU workers: device memory peak sampled at log steps (NAN at first) */
  nmt_status status;
} worker;


struct nmt_trainer {
  nmt_config cfg;
  nmt_trainer_options opt;
  nmt_model_cfg mcfg;
  const nmt_backend *be;
  size_t n_params;
  int n_dev;
  int accum;
  nmt_shard *train_shard, *valid_shard;
  nmt_batcher *train_batcher, *valid_batcher;
  size_t batch_ints;
  worker *workers;
  nmt_comm **comms;
  struct loader *loaders; /* n_loaders; loader j fills the rings of workers r % n_loaders == j */
  int n_loaders;

  float *init_params, *init_m, *init_v; /* host: initial or resumed state */
  long start_step;
  long start_epoch, start_index;
  loss_scaler scaler0; /* scaler state at the start of the next segment (from a checkpoint) */
  loss_scaler scaler_end; /* worker 0's after each step, read by main after the join */
  long end_step;        /* the current segment trains steps [start_step, end_step) */
  long pos_epoch, pos_index; /* worker 0, after each step: data position of the next step */
  int dead;             /* an error ended a segment: the communicator is aborted for good */
  double peak_flops;    /* one device's peak FLOP/s for MFU: profile.peak_tflops or measured */
  double peak_gbps;     /* one device's memory bandwidth (GB/s) for the profile table */
  nmt_prof *prof;       /* profile.*: NVTX ranges, the sampled window, trace and table */
  nmt_prof_track *main_track;
  struct {
    int step, micro_step, data_wait, h2d, forward, backward, optimizer, validate, checkpoint,
        load, metrics;
    int *allreduce; /* one per bucket: "allreduce.b<i>" */
  } rn;               /* interned range names */

  atomic_int abort;     /* raised on any error: collectives and rings give up */
  atomic_int shutdown;  /* the loader stops waiting (workers done or aborted) */
  atomic_int stop_requested;
  atomic_int workers_done;
  atomic_long steps_done;
  atomic_int error_claimed;
  nmt_status error;
  char error_msg[1024];
  int error_rank;
  int stopped;

  /* worker 0 -> main */
  nmt_ring msgs_full, msgs_free;
  msg msgs[MSG_POOL];
  float *snap_params, *snap_m, *snap_v; /* host snapshot for the checkpoint writer */
  atomic_int snap_busy;
  nmt_metrics last_metrics;

  char ckpt_dir[NMT_PATH_MAX + 16];
  char last_ckpt[1024]; /* path of the newest checkpoint written or loaded ("" if none) */
  int out_dir_made;     /* run.out_dir exists: status.json can be written */
  const char *state;    /* the last state written to status.json */
  struct sigaction old_actions[3]; /* handlers replaced by handle_signals, restored by destroy */
  int handlers_installed;
  double last_valid_loss; /* NAN until a validation ran */
  double eval_out[NMT_GRAD_EXTRA]; /* nmt_trainer_evaluate: rank 0's reduced slots */
  FILE *metrics_file;
  double t_start;
  float *final_params;
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static nmt_status mkdir_p(const char *path) {
  char tmp[NMT_PATH_MAX + 32];
  snprintf(tmp, sizeof tmp, "%s", path);
  for (char *p = tmp + 1; *p; p++) {
    if (*p != '/') continue;
    *p = 0;
    if (mkdir(tmp, 0777) != 0 && errno != EEXIST)
      return nmt_errorf(NMT_ERR_IO, "cannot create directory %s: %s", tmp, strerror(errno));
    *p = '/';
  }
  if (mkdir(tmp, 0777) != 0 && errno != EEXIST)
    return nmt_errorf(NMT_ERR_IO, "cannot create directory %s: %s", tmp, strerror(errno));
  return NMT_OK;
}

/* First error wins: it is what the run returns; later ones are usually ABORTED echoes. */
static void record_error(nmt_trainer *t, int rank, nmt_status s) {
  if (s == NMT_OK) return;
  int expected = 0;
  /* A worker's ABORTED is an echo of someone else's error; the main thread's is its own. */
  if ((s != NMT_ERR_ABORTED || rank < 0) &&
      atomic_compare_exchange_strong(&t->error_claimed, &expected, 1)) {
    t->error = s;
    t->error_rank = rank;
    snprintf(t->error_msg, sizeof t->error_msg, "%s", nmt_last_error());
  }
  atomic_store(&t->abort, 1);
  atomic_store(&t->shutdown, 1);
}

static void write_status(nmt_trainer *t, const char *state, nmt_status s, const char *error);

/* Stop signals. Handlers, not a mask plus sigwait: OpenBLAS starts its thread pool before
 * main() runs, so no mask set later covers every thread, and a process-directed signal
 * delivered to an unblocked thread would run the default action (terminate). A handler only
 * counts the signal (lock-free atomics are async-signal-safe), whichever thread it runs on;
 * the main thread's serving loop takes the counts. Process-wide state by nature: one trainer
 * with handle_signals at a time. */
enum { N_STOP_SIGNALS = 3 };
static const int stop_signals[N_STOP_SIGNALS] = {SIGINT, SIGTERM, SIGUSR1};
static atomic_int signal_counts[N_STOP_SIGNALS];

static void count_signal(int sig) {
  for (int i = 0; i < N_STOP_SIGNALS; i++)
    if (stop_signals[i] == sig) atomic_fetch_add(&signal_counts[i], 1);
}

double nmt_lr_at(const nmt_config *cfg, long step) {
  double s = step < 1 ? 1.0 : (double)step;
  double w = cfg->train_warmup_steps < 1 ? 1.0 : (double)cfg->train_warmup_steps;
  double a = 1.0 / sqrt(s), b = s * pow(w, -1.5);
  return cfg->train_lr_scale / sqrt((double)cfg->model_d_model) * (a < b ? a : b);
}

void nmt_trainer_options_default(nmt_trainer_options *o) {
  memset(o, 0, sizeof *o);
  o->size = sizeof *o;
  o->fail_rank = -1;
  o->fail_step = -1;
  o->nan_from_step = -1;
}

/* ------------------------------------------------------------------------------------------ */
/* loader                                                                                     */

/* Next data position; a new epoch reshuffles into the loader's own perm (no shared cache). */
static void advance(const nmt_trainer *t, long *epoch, long *index, long *perm) {
  if (++*index >= nmt_batcher_num_batches(t->train_batcher)) {
    *index = 0;
    ++*epoch;
    nmt_batcher_epoch_order(t->train_batcher, *epoch, perm);
  }
}

/* Model FLOPs of one training pass over a (B, Ts) -> (B, Tt) batch: 3x the forward pass's
 * matrix-multiply FLOPs (2*M*K*N per GEMM; backward = 2x forward) on the padded shapes, the
 * convention of bench/README.md "model FLOPs" (Kaplan et al. 2020 §2.1; Chowdhery et al. 2022
 * App. B); the same formula as bench/pytorch_baseline.py:train_flops. Elementwise work, softmax,
 * LayerNorm and the optimizer are not counted. */
static double train_flops(const nmt_model_cfg *c, int B, int Ts, int Tt) {
  double C = c->d_model, F = c->d_ff, V = c->vocab, ns = (double)B * Ts, nt = (double)B * Tt;
  double enc = 2 * ns * C * 3 * C + 2 * ns * C * C + 4.0 * B * Ts * Ts * C + 4 * ns * C * F;
  double dec = 2 * nt * C * 3 * C + 2 * nt * C * C + 4.0 * B * Tt * Tt * C /* self-attention */
               + 2 * nt * C * C + 2 * ns * C * 2 * C + 2 * nt * C * C +
               4.0 * B * Tt * Ts * C /* cross-attention */
               + 4 * nt * C * F;      /* FFN */
  return 3 * (c->enc_layers * enc + c->dec_layers * dec + 2 * nt * C * V);
}

/* Every loader computes each step's whole deal (cheap: a sort of devices*accum numbers) and
 * fills only its own workers' slots, so each per-worker ring keeps one producer. */
typedef struct loader {
  nmt_trainer *t;
  int index;
  nmt_prof_track *prof;
  pthread_t thread;
  int started;
} loader;

static void *loader_main(void *arg) {
  loader *L = arg;
  nmt_trainer *t = L->t;
  int K = t->n_dev * t->accum;
  long ids[K], tok[K];
  int order[K], owner[K], count[t->n_dev];
  long load[t->n_dev];
  long epoch = t->start_epoch, index = t->start_index;
  long *perm = malloc((size_t)nmt_batcher_num_batches(t->train_batcher) * sizeof *perm);
  if (!perm) {
    record_error(t, -1, nmt_errorf(NMT_ERR_NOMEM, "loader: epoch order"));
    return NULL;
  }
  nmt_batcher_epoch_order(t->train_batcher, epoch, perm);
  nmt_prof_track_bind_thread(L->prof);
  for (long step = t->start_step; step < t->end_step; step++) {
    nmt_prof_step_begin(L->prof, step + 1);
    double step_flops = 0;
    for (int k = 0; k < K; k++) {
      int ns, sl, tl;
      ids[k] = perm[index];
      nmt_batcher_shape(t->train_batcher, ids[k], &ns, &sl, &tl, &tok[k]);
      step_flops += train_flops(&t->mcfg, ns, sl, tl);
      order[k] = k;
      advance(t, &epoch, &index, perm);
    }
    /* Deal: largest batch first to the least-loaded worker that still needs batches. */
    for (int i = 1; i < K; i++)
      for (int j = i; j > 0 && tok[order[j]] > tok[order[j - 1]]; j--) {
        int x = order[j];
        order[j] = order[j - 1];
        order[j - 1] = x;
      }
    for (int d = 0; d < t->n_dev; d++) load[d] = 0, count[d] = 0;
    for (int i = 0; i < K; i++) {
      int best = -1;
      for (int d = 0; d < t->n_dev; d++)
        if (count[d] < t->accum && (best < 0 || load[d] < load[best])) best = d;
      owner[order[i]] = best;
      load[best] += tok[order[i]];
      count[best]++;
    }
    /* Push in k order per worker, so micro-batch order is a function of the step only. */
    for (int k = 0; k < K; k++) {
      if (owner[k] % t->n_loaders != L->index) continue;
      worker *w = &t->workers[owner[k]];
      void *p;
      nmt_prof_push(L->prof, t->rn.data_wait, NMT_PROF_OTHER, 0, 0);
      nmt_status ws = nmt_ring_pop(&w->free_slots, &p, &t->shutdown);
      nmt_prof_pop(L->prof);
      if (ws != NMT_OK) goto out;
      batch_slot *s = p;
      int ns, sl, tl;
      long tt;
      nmt_batcher_shape(t->train_batcher, ids[k], &ns, &sl, &tl, &tt);
      nmt_batch_layout(&s->b, s->buf, ns, sl, tl);
      nmt_prof_push(L->prof, t->rn.load, NMT_PROF_OTHER, 0, 0);
      nmt_batcher_fill(t->train_batcher, ids[k], &s->b);
      nmt_prof_pop(L->prof);
      s->step = step;
      s->k = k;
      s->step_flops = step_flops;
      s->next_epoch = epoch;
      s->next_index = index;
      if (nmt_ring_push(&w->batches, s, &t->shutdown) != NMT_OK) goto out;
    }
    nmt_prof_step_end(L->prof); /* host clock: cannot fail */
  }
out:
  free(perm);
  return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* worker                                                                                     */

/* The host communicator works on host memory. With one rank there is nothing to reduce, and
 * skipping the call keeps device buffers (CUDA backend, one GPU) away from it. */
static nmt_status reduce_sum(worker *w, float *buf, size_t count) {
  if (w->t->n_dev == 1) return atomic_load(&w->t->abort) ? NMT_ERR_ABORTED : NMT_OK;
  return nmt_comm_allreduce_sum(w->comm, buf, count);
}

/* One bucket [begin, end) of the flat gradient buffer. Gradients travel in
 * parallel.grad_dtype; the trailing slots (loss and token sums, NLL, stop flag) always in fp32:
 * a step's token count and loss sum exceed what fp16 holds exactly, or at all. Every rank
 * splits the same way, so the collectives match. */
static nmt_status reduce_bucket(worker *w, size_t begin, size_t end) {
  const size_t n = w->t->n_params;
  const nmt_grad_dtype wire = w->t->cfg.parallel_grad_dtype;
  if (w->t->n_dev == 1 || wire == NMT_GRAD_FP32) return reduce_sum(w, w->grads + begin, end - begin);
  if (begin < n)
    NMT_TRY(nmt_comm_allreduce_sum_as(w->comm, w->grads + begin, (end < n ? end : n) - begin, wire));
  if (end > n) {
    size_t b = begin > n ? begin : n;
    NMT_TRY(nmt_comm_allreduce_sum(w->comm, w->grads + b, end - b));
  }
  return NMT_OK;
}

static nmt_status on_grads_ready(void *user, size_t ready) {
  worker *w = user;
  if (!w->reduce_now) return NMT_OK;
  size_t total = w->t->n_params + NMT_GRAD_EXTRA;
  while (w->next_bucket < w->n_buckets) {
    size_t begin = (size_t)w->next_bucket * w->bucket_floats;
    size_t end = begin + w->bucket_floats < total ? begin + w->bucket_floats : total;
    if (end > ready) break;
    PROFILED(w->prof, w->t->rn.allreduce[w->next_bucket], NMT_PROF_BWD,
             nmt_prof_cost_allreduce((double)(end - begin), w->t->n_dev),
             reduce_bucket(w, begin, end));
    w->next_bucket++;
  }
  return NMT_OK;
}

static void dev_batch_from_host(worker *w, const nmt_batch *h, nmt_batch *d) {
  nmt_batch_layout(d, w->dev_batch_buf, h->n_sent, h->src_len, h->tgt_len);
  d->src_tokens = h->src_tokens;
  d->tgt_tokens = h->tgt_tokens;
  d->epoch = h->epoch;
  d->index = h->index;
}

/* Host and device batches share nmt_batch_layout over their own buffers, so one copy of the
 * block from the host buffer's start to the end of its last array moves the whole batch:
 * these are its bytes. */
static size_t batch_bytes(const int32_t *host_buf, const nmt_batch *h) {
  const int32_t *end = h->src + (size_t)h->n_sent * h->src_len;
  const int32_t *e[] = {h->tgt_in + (size_t)h->n_sent * h->tgt_len,
                        h->tgt_out + (size_t)h->n_sent * h->tgt_len, h->src_lens + h->n_sent,
                        h->tgt_lens + h->n_sent};
  for (int i = 0; i < 4; i++)
    if (e[i] > end) end = e[i];
  return (size_t)(end - host_buf) * sizeof(int32_t);
}

/* Validation: a synchronous copy into the validation buffer. */
static nmt_status copy_batch(worker *w, const int32_t *host_buf, const nmt_batch *h, nmt_batch *d) {
  dev_batch_from_host(w, h, d);
  return w->t->be->copy_h2d(w->ctx, w->dev_batch_buf, host_buf, batch_bytes(host_buf, h));
}

/* Training: pops the next batch of this worker (it must belong to `step`) and starts its copy
 * into staging slot `slot` on the copy stream. The host slot (page-locked memory) stays with
 * the worker until the copy has read it (take_batch). */
static nmt_status fetch_batch(worker *w, long step, int slot) {
  nmt_trainer *t = w->t;
  void *p;
  PROFILED(w->prof, t->rn.data_wait, NMT_PROF_OTHER, NO_COST,
           nmt_ring_pop(&w->batches, &p, &t->abort));
  batch_slot *s = p;
  w->ahead = s, w->ahead_slot = slot;
  if (s->step != step)
    return nmt_errorf(NMT_ERR_INTERNAL, "rank %d expected a batch of step %ld, got %ld",
                      w->rank, step, s->step);
  size_t bytes = batch_bytes(s->buf, &s->b);
  PROFILED(w->prof, t->rn.h2d, NMT_PROF_OTHER, nmt_prof_cost_copy((double)bytes),
           t->be->h2d_async(w->ctx, slot, w->dev_stage[slot], s->buf, bytes));
  return NMT_OK;
}

/* Makes the batch fetched ahead the current one: the compute stream waits for its copy, and
 * once the copy has read the host slot, the slot goes back to the loader. *d describes the
 * batch in dev_stage[*slot]; *out keeps the host slot's bookkeeping (step, k, positions). */
static nmt_status take_batch(worker *w, nmt_batch *d, batch_slot *out, int *slot) {
  const nmt_backend *be = w->t->be;
  batch_slot *s = w->ahead;
  *slot = w->ahead_slot;
  NMT_TRY(be->h2d_acquire(w->ctx, *slot));
  NMT_TRY(be->h2d_wait_src(w->ctx, *slot));
  *out = *s;
  nmt_batch_layout(d, w->dev_stage[*slot], s->b.n_sent, s->b.src_len, s->b.tgt_len);
  d->src_tokens = s->b.src_tokens;
  d->tgt_tokens = s->b.tgt_tokens;
  d->epoch = s->b.epoch;
  d->index = s->b.index;
  w->ahead = NULL;
  return nmt_ring_push(&w->free_slots, s, &w->t->abort);
}

static nmt_status validate(worker *w, double out[NMT_GRAD_EXTRA]) {
  nmt_trainer *t = w->t;
  const nmt_backend *be = t->be;
  NMT_TRY(be->memset_zero(w->ctx, w->dev_valid, NMT_GRAD_EXTRA * sizeof(float)));
  long nb = nmt_batcher_num_batches(t->valid_batcher);
  nmt_batch hb, db;
  for (long i = w->rank; i < nb; i += t->n_dev) {
    int ns, sl, tl;
    long tt;
    nmt_batcher_shape(t->valid_batcher, i, &ns, &sl, &tl, &tt);
    nmt_batch_layout(&hb, w->valid_host_buf, ns, sl, tl);
    nmt_batcher_fill(t->valid_batcher, i, &hb);
    NMT_TRY(copy_batch(w, w->valid_host_buf, &hb, &db));
    NMT_TRY(nmt_model_forward(w->model, w->params, &db, 0, t->cfg.run_seed, 0, w->dev_valid));
  }
  NMT_TRY(reduce_sum(w, w->dev_valid, NMT_GRAD_EXTRA));
  if (t->n_dev > 1) NMT_TRY(nmt_comm_flush(w->comm));
  float h[NMT_GRAD_EXTRA];
  NMT_TRY(be->copy_d2h(w->ctx, h, w->dev_valid, sizeof h));
  for (int i = 0; i < NMT_GRAD_EXTRA; i++) out[i] = h[i];
  return NMT_OK;
}

static nmt_status send_msg(nmt_trainer *t, const msg *m) {
  void *p;
  NMT_TRY(nmt_ring_pop(&t->msgs_free, &p, &t->abort));
  *(msg *)p = *m;
  return nmt_ring_push(&t->msgs_full, p, &t->abort);
}

static void ckpt_header(const nmt_trainer *t, const loss_scaler *ls, long step, long epoch,
                        long index, nmt_ckpt_header *h) {
  const nmt_model_cfg *c = &t->mcfg;
  memset(h, 0, sizeof *h);
  h->vocab = c->vocab, h->d_model = c->d_model, h->n_heads = c->n_heads, h->d_ff = c->d_ff;
  h->enc_layers = c->enc_layers, h->dec_layers = c->dec_layers, h->norm = (int32_t)c->norm;
  h->n_params = t->n_params;
  h->has_moments = 1;
  h->step = step;
  h->data_epoch = epoch;
  h->data_index = index;
  h->seed = t->cfg.run_seed;
  h->loss_scale = ls->enabled ? ls->scale : 0.0f;
  h->skipped_steps = ls->skipped;
  h->scale_good_steps = ls->good;
}

static nmt_status snapshot(worker *w, long step, long epoch, long index) {
  nmt_trainer *t = w->t;
  /* The writer may still be busy with the previous checkpoint: wait, but never past an abort. */
  while (atomic_load_explicit(&t->snap_busy, memory_order_acquire)) {
    if (atomic_load(&t->abort)) return NMT_ERR_ABORTED;
    sched_yield();
  }
  size_t bytes = t->n_params * sizeof(float);
  NMT_TRY(t->be->copy_d2h(w->ctx, t->snap_params, w->params, bytes));
  NMT_TRY(t->be->copy_d2h(w->ctx, t->snap_m, w->m, bytes));
  NMT_TRY(t->be->copy_d2h(w->ctx, t->snap_v, w->v, bytes));
  msg m = {.kind = MSG_CHECKPOINT};
  ckpt_header(t, &w->scaler, step, epoch, index, &m.ckpt);
  atomic_store_explicit(&t->snap_busy, 1, memory_order_release);
  return send_msg(t, &m);
}

/* Peak memory in MiB: the process's peak resident set on CPU workers (all of them share it);
 * on GPU workers the device's used memory, sampled at log steps. */
static double peak_mem_mb(worker *w) {
  if (w->t->be != &nmt_backend_ref) {
    /* Sampled cudaMemGetInfo of the device: includes the CUDA context and other processes. */
    if (nmt_cuda_mem_peak_mb(w->ctx, &w->mem_peak_mb) != NMT_OK) nmt_clear_error();
    return w->mem_peak_mb;
  }
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) != 0) return NAN;
  return (double)ru.ru_maxrss / 1024.0; /* Linux: kilobytes */
}

/* The metrics of the steps read back since the last log line. */
typedef struct {
  double loss, nll, tokens, flops, t0;
  long steps;
} interval;

/* Steps whose end needs the device state after exactly that step (validation, a checkpoint,
 * the end of the run or of the segment): their control block is read before the next step is
 * enqueued. Every other step's block is read while the next step runs. Deterministic, so
 * every rank reads at the same steps (each rank's validation forward joins a collective). */
static int read_now(const nmt_trainer *t, long done) {
  const nmt_config *cfg = &t->cfg;
  return done == cfg->train_max_steps || done == t->end_step ||
         (t->valid_batcher && cfg->train_valid_every > 0 && done % cfg->train_valid_every == 0) ||
         (cfg->train_save_every > 0 && done % cfg->train_save_every == 0);
}

/* The host's end of a step: reads the control block step_control wrote (waiting for the
 * device only if the step has not finished), turns a diverged verdict into an error, mirrors
 * the loss scaler, and logs, validates and checkpoints where due. `final`: no later step has
 * been enqueued (the device state is this step's), which read_now guarantees for validation
 * and checkpoint steps. `stop_seen`: an earlier block carried the stop flag, so this step is
 * the last. *stop: this step ends the loop, or (not final) the next one must. */
static nmt_status finish_step(worker *w, const step_info *si, int final, int stop_seen,
                              interval *iv, int *stop) {
  nmt_trainer *t = w->t;
  const nmt_config *cfg = &t->cfg;
  const int slot = (int)(si->step % NMT_D2H_SLOTS);
  const long done = si->step + 1;
  NMT_TRY(t->be->d2h_wait(w->ctx, slot));
  const nmt_step_ctl *c = &w->host_ctl[slot];
  if (c->step != done)
    return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: read the control block of step %lld, expected "
                      "step %ld", w->rank, (long long)c->step, done);
  const double tokens = c->extra[NMT_GRAD_SLOT_TOKENS];
  const double loss = c->extra[NMT_GRAD_SLOT_LOSS] / tokens;
  loss_scaler *ls = &w->scaler;
  switch ((nmt_step_status)c->status) {
    case NMT_STEP_OK: break;
    case NMT_STEP_NO_TOKENS:
      return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: step %ld has no target tokens", w->rank,
                        si->step);
    case NMT_STEP_NONFINITE:
      return nmt_errorf(NMT_ERR_DIVERGED, "step %ld: gradient norm is %g (loss %g)", done,
                        c->gnorm, loss);
    case NMT_STEP_FLOOR:
      return nmt_errorf(NMT_ERR_DIVERGED,
                        "step %ld: the gradient overflowed at loss scale %g, and backing off "
                        "(precision.backoff = %g) would go below precision.floor = %g: "
                        "diverged after %lld skipped steps (loss %g)",
                        done, c->scale_used, cfg->precision_backoff, cfg->precision_floor,
                        (long long)c->skipped + 1, loss);
    default:
      return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: step %ld: unknown step status %d", w->rank,
                        done, (int)c->status);
  }
  if (c->skip && w->rank == 0)
    nmt_log(NMT_LOG_WARN, "step %ld: fp16 gradient overflow, step skipped; loss scale -> %g", done,
            c->scale);
  ls->scale = c->scale;
  ls->good = (long)c->good;
  ls->skipped = c->skipped;

  *stop = stop_seen || c->extra[NMT_GRAD_SLOT_STOP] > 0;
  const int last = final && (done == cfg->train_max_steps || *stop);
  const int seg_end = done == t->end_step; /* a shorter nmt_trainer_train segment ends here */
  if (w->rank == 0) {
    t->pos_epoch = si->next_epoch, t->pos_index = si->next_index; /* read by main after the join */
    t->scaler_end = *ls;
    atomic_store(&t->steps_done, done);
  }
  iv->loss += c->extra[NMT_GRAD_SLOT_LOSS], iv->nll += c->extra[NMT_GRAD_SLOT_NLL];
  iv->tokens += tokens, iv->flops += si->flops;
  iv->steps++;
  const int valid_due = t->valid_batcher && cfg->train_valid_every > 0 &&
                        (done % cfg->train_valid_every == 0 || last);
  const int save_due = last || (cfg->train_save_every > 0 && done % cfg->train_save_every == 0);
  if ((valid_due || save_due) && !final)
    return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: step %ld needs its own parameters, but the next "
                      "step was enqueued before its control block was read", w->rank, done);
  double vx[NMT_GRAD_EXTRA] = {0};
  if (valid_due) {
    /* Evaluation forwards are not training modules: keep them out of the module rows. */
    NMT_TRY(nmt_model_set_profiler(w->model, NULL));
    PROFILED(w->prof, t->rn.validate, NMT_PROF_OTHER, NO_COST, validate(w, vx));
    NMT_TRY(nmt_model_set_profiler(w->model, w->prof));
  }
  const int log_due = done % cfg->train_log_every == 0 || valid_due || last || seg_end;
  if (w->rank == 0 && log_due) {
    double dt = now_s() - iv->t0;
    msg m = {.kind = MSG_METRICS};
    nmt_metrics *mt = &m.metrics;
    mt->step = done;
    mt->epoch = si->epoch;
    mt->train_loss = iv->loss / iv->tokens;
    mt->train_nll = iv->nll / iv->tokens;
    mt->lr = si->lr;
    mt->grad_norm = c->gnorm;
    mt->loss_scale = ls->scale;
    mt->skipped_steps = ls->skipped;
    mt->mfu = dt > 0 && t->peak_flops > 0 ? iv->flops / dt / (t->peak_flops * t->n_dev) : NAN;
    mt->peak_mem_mb = peak_mem_mb(w);
    mt->tgt_tokens = iv->tokens;
    mt->tgt_tokens_per_s = dt > 0 ? iv->tokens / dt : 0;
    mt->step_ms = 1e3 * dt / (double)iv->steps;
    if (valid_due && vx[NMT_GRAD_SLOT_TOKENS] > 0) {
      mt->has_valid = 1;
      mt->valid_loss = vx[NMT_GRAD_SLOT_LOSS] / vx[NMT_GRAD_SLOT_TOKENS];
      mt->valid_nll = vx[NMT_GRAD_SLOT_NLL] / vx[NMT_GRAD_SLOT_TOKENS];
      mt->valid_ppl = exp(mt->valid_nll);
    }
    NMT_TRY(send_msg(t, &m));
    *iv = (interval){.t0 = now_s()};
  }
  if (w->rank == 0 && save_due)
    PROFILED(w->prof, t->rn.checkpoint, NMT_PROF_OTHER, NO_COST,
             snapshot(w, done, si->next_epoch, si->next_index));
  if (last && *stop && w->rank == 0) t->stopped = 1;
  return NMT_OK;
}

/* One segment of training: steps [start_step, end_step). Per step the host enqueues the
 * micro-batches' forward and backward (the last one's backward starts the bucket
 * all-reduces), step_control (norm, fp16 skip, loss scale, clip: on the device) and AdamW,
 * then the asynchronous read of the control block; it then reads the PREVIOUS step's block,
 * which is complete or nearly so: the device always has the step just enqueued to work on, and
 * no step waits for the host. A stop flag seen in step s-1's block ends the loop after step s
 * (already enqueued), on every rank alike. */
static nmt_status worker_loop(worker *w) {
  nmt_trainer *t = w->t;
  const nmt_config *cfg = &t->cfg;
  const nmt_backend *be = t->be;
  const size_t n = t->n_params, total = n + NMT_GRAD_EXTRA;
  const int K = t->n_dev * t->accum;
  nmt_batch db;
  interval iv = {.t0 = now_s()};
  loss_scaler *ls = &w->scaler;
  *ls = t->scaler0;
  /* The loss scaler lives on the device from here to the segment's end. */
  nmt_step_ctl ctl0 = {.scale = ls->scale, .good = ls->good, .skipped = ls->skipped};
  NMT_TRY(be->copy_h2d(w->ctx, w->dev_ctl, &ctl0, sizeof ctl0));
  const nmt_step_policy policy = {.scaling = ls->enabled,
                                  .clip_norm = cfg->train_clip_norm,
                                  .backoff = cfg->precision_backoff,
                                  .floor = cfg->precision_floor,
                                  .growth_interval = cfg->precision_growth_interval};
  long unread = -1; /* a step whose control block the host has not read yet */

  nmt_prof_track *pt = w->prof;
  const int gpu = be != &nmt_backend_ref;
  int capturing = 0;
  for (long step = t->start_step; step < t->end_step; step++) {
    if (w->rank == t->opt.fail_rank && step == t->opt.fail_step)
      return nmt_errorf(NMT_ERR_INTERNAL, "injected failure on rank %d at step %ld", w->rank, step);
    /* Ranges: NVTX on every step (for nsys), timed events only inside the profile window. */
    nmt_prof_step_begin(pt, step + 1);
    nmt_prof_push(pt, t->rn.step, NMT_PROF_OTHER, 0, 0);
    NMT_TRY(be->memset_zero(w->ctx, w->grads, total * sizeof(float)));
    /* nsys --capture-range=cudaProfilerApi: the window only (after the step's first op made
     * this thread's device current). */
    if (gpu && !capturing && nmt_prof_in_window(t->prof, step + 1)) {
      NMT_TRY(nmt_cuda_profiler_capture(1));
      capturing = 1;
    }
    if (w->rank == 0 && atomic_load(&t->stop_requested)) {
      float one = 1.0f;
      NMT_TRY(be->copy_h2d(w->ctx, w->grads + n + NMT_GRAD_SLOT_STOP, &one, sizeof one));
    }
    step_info *si = &w->inflight[step % NMT_D2H_SLOTS];
    *si = (step_info){.step = step, .lr = nmt_lr_at(cfg, step + 1)};
    for (int a = 0; a < t->accum; a++) {
      nmt_prof_push(pt, t->rn.micro_step, NMT_PROF_OTHER, 0, 0);
      /* The first batch of a segment is fetched here; every later one was fetched ahead. */
      if (!w->ahead) NMT_TRY(fetch_batch(w, step, 0));
      batch_slot bs;
      int slot;
      NMT_TRY(take_batch(w, &db, &bs, &slot));
      /* Start copying the next micro-batch (of this step or the next one in the segment)
       * into the other slot, behind this one's compute. */
      if (a + 1 < t->accum) NMT_TRY(fetch_batch(w, step, 1 - slot));
      else if (step + 1 < t->end_step) NMT_TRY(fetch_batch(w, step + 1, 1 - slot));
      uint64_t rng_step = (uint64_t)step * (uint64_t)K + (uint64_t)bs.k;
      si->next_epoch = bs.next_epoch, si->next_index = bs.next_index, si->epoch = bs.b.epoch;
      if (a == 0) si->flops = bs.step_flops;
      w->reduce_now = (a == t->accum - 1);
      w->next_bucket = 0;
      PROFILED(pt, t->rn.forward, NMT_PROF_FWD, NO_COST,
               nmt_model_forward(w->model, w->params, &db, 1, cfg->run_seed, rng_step,
                                 w->grads + n));
      PROFILED(pt, t->rn.backward, NMT_PROF_BWD, NO_COST,
               nmt_model_backward(w->model, w->params, w->grads, &db, on_grads_ready, w));
      NMT_TRY(be->h2d_release(w->ctx, slot)); /* the slot may take the batch after next */
      nmt_prof_pop(pt); /* micro_step */
    }
    if (w->next_bucket != w->n_buckets)
      return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: backward reported %d of %d buckets ready",
                        w->rank, w->next_bucket, w->n_buckets);
    /* NCCL buckets were only enqueued: the optimizer's work waits for the comm stream. */
    if (t->n_dev > 1) NMT_TRY(nmt_comm_flush(w->comm));

    if (t->opt.nan_from_step >= 0 && step >= t->opt.nan_from_step &&
        (t->opt.nan_steps <= 0 || step < t->opt.nan_from_step + t->opt.nan_steps)) {
      float nan = NAN;
      NMT_TRY(be->copy_h2d(w->ctx, w->grads, &nan, sizeof nan));
    }
    /* The update, decided on the device: no host read here. */
    nmt_prof_cost oc = nmt_prof_cost_adamw((double)n);
    nmt_prof_push(pt, t->rn.optimizer, NMT_PROF_OTHER, oc.flops, oc.bytes);
    NMT_TRY(be->step_control(w->ctx, w->dev_ctl, w->grads, n, policy, step + 1));
    NMT_TRY(be->adamw(w->ctx, w->params, w->grads, w->m, w->v, n, (float)si->lr,
                      cfg->train_adam_beta1, cfg->train_adam_beta2, cfg->train_adam_eps,
                      cfg->train_weight_decay, 1.0f, w->dev_ctl, w->half_params, step + 1));
    NMT_TRY(be->d2h_async(w->ctx, (int)(step % NMT_D2H_SLOTS), &w->host_ctl[step % NMT_D2H_SLOTS],
                          w->dev_ctl, sizeof *w->host_ctl));
    nmt_prof_pop(pt); /* optimizer */
    if (w->host_grads) /* tests: a blocking copy */
      NMT_TRY(be->copy_d2h(w->ctx, w->host_grads, w->grads, total * sizeof(float)));

    /* The previous step's block (its work ran while this step was enqueued), then this one's
     * where its end needs it now or a stop makes this step the last. */
    int stop = 0;
    if (unread >= 0) {
      NMT_TRY(finish_step(w, &w->inflight[unread % NMT_D2H_SLOTS], 0, 0, &iv, &stop));
      unread = -1;
    }
    if (stop || read_now(t, step + 1))
      NMT_TRY(finish_step(w, si, 1, stop, &iv, &stop));
    else
      unread = step;
    nmt_prof_pop(pt); /* step */
    /* The device clock resolves its events at step_end: wait here with the backend's
     * abort-aware synchronize, so a dead peer cannot hang the wait. */
    if (w->prof_clock && nmt_prof_track_sampling(pt)) NMT_TRY(be->synchronize(w->ctx));
    NMT_TRY(nmt_prof_step_end(pt));
    if (capturing && step + 1 == nmt_prof_stop_step(t->prof)) {
      NMT_TRY(nmt_cuda_profiler_capture(0));
      capturing = 0;
    }
    if (stop) break;
  }
  return NMT_OK;
}

static void *worker_main(void *arg) {
  worker *w = arg;
  nmt_trainer *t = w->t;
  nmt_prof_track_bind_thread(w->prof);
  nmt_status s = worker_loop(w);
  if (w->ahead) {
    /* A stop left the next step's batch fetched: hand its host slot back (once its copy has
     * read it) for the next segment, which restarts from the last completed step. */
    if (s == NMT_OK) s = t->be->h2d_wait_src(w->ctx, w->ahead_slot);
    nmt_ring_try_push(&w->free_slots, w->ahead);
    w->ahead = NULL;
  }
  if (t->be != &nmt_backend_ref) {
    /* Closes a capture window cut short by a stop, an error or the segment's end. */
    if (nmt_cuda_profiler_capture(0) != NMT_OK) nmt_clear_error();
  }
  w->status = s;
  if (s != NMT_OK) record_error(t, w->rank, s);
  atomic_fetch_add(&t->workers_done, 1);
  return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* setup                                                                                      */

/* data.loader_threads, but no more than one per worker (each worker's ring has one producer)
 * and no more than a Slurm allocation's CPUs (SLURM_CPUS_PER_TASK), which CPU workers share. */
static int loader_threads(const nmt_config *cfg) {
  int n = cfg->data_loader_threads < cfg->parallel_devices ? cfg->data_loader_threads
                                                             : cfg->parallel_devices;
  const char *e = getenv("SLURM_CPUS_PER_TASK");
  char *end;
  long cpus = e && *e ? strtol(e, &end, 10) : 0;
  if (e && *e && !*end && cpus >= 1) {
    if (n > cpus) {
      nmt_log(NMT_LOG_INFO, "SLURM_CPUS_PER_TASK = %ld: %ld loader thread(s) instead of %d",
              cpus, cpus, n);
      n = (int)cpus;
    }
    if (cfg->parallel_device == NMT_DEVICE_CPU && cfg->parallel_devices > cpus)
      nmt_log(NMT_LOG_WARN, "parallel.devices = %d CPU workers on SLURM_CPUS_PER_TASK = %ld "
              "CPUs: oversubscribed, steps will be slower", cfg->parallel_devices, cpus);
  }
  return n < 1 ? 1 : n;
}

/* Removes temp files a killed writer left in the checkpoint directory ("step_N.ckpt.tmp.PID.TID",
 * "latest.tmp.PID.TID"): never read (names differ), but they would pile up. */
static void remove_stale_temps(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  while ((e = readdir(d))) {
    if ((strncmp(e->d_name, "step_", 5) && strncmp(e->d_name, "latest", 6)) ||
        !strstr(e->d_name, ".tmp."))
      continue;
    char p[NMT_PATH_MAX + 300];
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    if (unlink(p) == 0) nmt_log(NMT_LOG_INFO, "removed %s left by an interrupted write", p);
  }
  closedir(d);
}

/* Whether dir holds `latest` or any step_*.ckpt, valid or not. */
static int has_checkpoints(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return 0;
  struct dirent *e;
  int found = 0;
  while (!found && (e = readdir(d))) {
    size_t n = strlen(e->d_name);
    found = !strcmp(e->d_name, "latest") ||
            (!strncmp(e->d_name, "step_", 5) && n > 10 && !strcmp(e->d_name + n - 5, ".ckpt"));
  }
  closedir(d);
  return found;
}

/* An upper bound on the activation bytes of one replica (the table in model/transformer.c's
 * header comment, without activation checkpointing, which only shrinks it), in double so that
 * absurd configs give a huge number instead of a wrapped size_t. Guards the exact size_t
 * count (nmt_model_arena_bytes) against wrapping. */
static double activation_bytes_bound(const nmt_trainer *t) {
  const nmt_model_cfg *c = &t->mcfg;
  double N = t->cfg.data_max_tokens, C = c->d_model, F = c->d_ff, H = c->n_heads;
  double L = t->cfg.data_max_len < t->cfg.data_max_tokens ? t->cfg.data_max_len : N, V = c->vocab;
  double row = c->enc_layers * (8 * C + 4 + H * L + F) +
               c->dec_layers * (14 * C + 6 + 2 * H * L + F) +
               12 * C + V + 9 + H * L + 2 * F;
  return 4.0 * (N * row + (double)c->max_positions * C);
}

/* The model's activation arena per worker, exact (checkpointing included) unless absurd. */
static double activation_bytes(const nmt_trainer *t) {
  double bound = activation_bytes_bound(t);
  if (bound > 0x1p60) return bound;
  return (double)nmt_model_arena_bytes(&t->mcfg, t->cfg.data_max_tokens, t->cfg.data_max_len);
}

/* NMT_ERR_NOMEM naming the batch that did not fit, keeping the allocator's message. */
static nmt_status batch_nomem(const nmt_trainer *t, int rank, const char *what) {
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

static nmt_status worker_setup(nmt_trainer *t, worker *w) {
  const nmt_backend *be = t->be;
  const nmt_config *cfg = &t->cfg;
  size_t n = t->n_params, total = n + NMT_GRAD_EXTRA, bytes = n * sizeof(float);
  /* The model sums its buffer sizes in size_t: refuse before that sum could wrap around. */
  if (activation_bytes_bound(t) > 0x1p60) {
    nmt_clear_error();
    return batch_nomem(t, w->rank, "activations");
  }
  if (be->ctx_create) {
    /* parallel.devices: a count picks the first N visible GPUs, a list names them. */
    int device = cfg->parallel_device_ids_n ? cfg->parallel_device_ids[w->rank] : w->rank;
    NMT_TRY(be->ctx_create(device, &w->ctx));
    if (be->set_precision) NMT_TRY(be->set_precision(w->ctx, cfg->precision_mode));
    /* parallel.aux_streams: the pool parallel.qkv = streams forks onto. */
    NMT_TRY(be->stream_pool(w->ctx, cfg->parallel_aux_streams));
#ifdef NMT_CUDA
    /* Host waits on this device poll the run's abort flag instead of blocking forever. */
    if (be != &nmt_backend_ref) NMT_TRY(nmt_cuda_ctx_set_abort(w->ctx, &t->abort));
#endif
  }
  w->mem_peak_mb = NAN;
  /* GPU peaks for MFU and the profile table, measured before the model takes memory. */
  if (w->rank == 0 && be != &nmt_backend_ref &&
      (cfg->profile_peak_tflops <= 0 || cfg->profile_peak_gbps <= 0)) {
    double tf = 0, gb = 0;
    nmt_status ps = nmt_cuda_measure_peaks(w->ctx, cfg->precision_mode, &tf, &gb);
    if (ps == NMT_OK) {
      if (cfg->profile_peak_tflops <= 0) t->peak_flops = tf * 1e12;
      if (cfg->profile_peak_gbps <= 0) t->peak_gbps = gb;
      nmt_log(NMT_LOG_INFO, "measured device peaks: %.1f TFLOP/s (GEMM, precision.mode), %.0f GB/s",
              t->peak_flops / 1e12, t->peak_gbps);
    } else if (ps == NMT_ERR_NOMEM) {
      nmt_log(NMT_LOG_WARN, "no memory to measure the device peaks: MFU unknown (%s)",
              nmt_last_error());
      nmt_clear_error();
    } else {
      return ps;
    }
  }
  nmt_status ms = nmt_model_create(&t->mcfg, be, w->ctx, cfg->data_max_tokens, cfg->data_max_len,
                                   &w->model);
  if (ms == NMT_ERR_NOMEM) return batch_nomem(t, w->rank, "activations");
  NMT_TRY(ms);
  if (w->rank == 0)
    nmt_log(NMT_LOG_INFO, "activations: %.1f MiB per worker (data.max_tokens = %d, "
            "train.checkpoint_activations = %s)",
            (double)nmt_model_activation_bytes(w->model) / 1048576.0, cfg->data_max_tokens,
            t->mcfg.checkpoint_activations ? "on" : "off");
  NMT_TRY(be->malloc(w->ctx, bytes, (void **)&w->params));
  NMT_TRY(be->malloc(w->ctx, total * sizeof(float), (void **)&w->grads));
  NMT_TRY(be->malloc(w->ctx, bytes, (void **)&w->m));
  NMT_TRY(be->malloc(w->ctx, bytes, (void **)&w->v));
  NMT_TRY(be->malloc(w->ctx, sizeof *w->dev_ctl, (void **)&w->dev_ctl));
  NMT_TRY(be->host_alloc(w->ctx, NMT_D2H_SLOTS * sizeof *w->host_ctl, (void **)&w->host_ctl));
  /* The training xent reads the loss scale that step_control keeps on the device. */
  nmt_model_set_loss_scale_dev(w->model, &w->dev_ctl->scale);
  NMT_TRY(be->malloc(w->ctx, NMT_GRAD_EXTRA * sizeof(float), (void **)&w->dev_valid));
  if (be->malloc(w->ctx, t->batch_ints * sizeof(int32_t), (void **)&w->dev_batch_buf) != NMT_OK)
    return batch_nomem(t, w->rank, "the device batch buffer");
  for (int i = 0; i < 2; i++)
    if (be->malloc(w->ctx, t->batch_ints * sizeof(int32_t), (void **)&w->dev_stage[i]) != NMT_OK)
      return batch_nomem(t, w->rank, "the device batch staging buffers");
  NMT_TRY(be->copy_h2d(w->ctx, w->params, t->init_params, bytes));
  NMT_TRY(be->copy_h2d(w->ctx, w->m, t->init_m, bytes));
  NMT_TRY(be->copy_h2d(w->ctx, w->v, t->init_v, bytes));
  if (cfg->precision_mode == NMT_PRECISION_FP16 || cfg->precision_mode == NMT_PRECISION_BF16) {
    /* Mixed precision: the GEMMs read a half copy of the weights, rounded once per step by
     * adamw (half_out) instead of at every GEMM. It starts as the rounding of the parameters
     * just copied in; nothing but adamw writes w->params after this. */
    NMT_TRY(be->malloc(w->ctx, n * 2, &w->half_params));
    NMT_TRY(be->cast_half(w->ctx, w->half_params, w->params, n));
    NMT_TRY(be->half_weights(w->ctx, w->params, w->half_params, n));
  }
  if (t->valid_batcher) {
    w->valid_host_buf = malloc(t->batch_ints * sizeof(int32_t));
    if (!w->valid_host_buf) return batch_nomem(t, w->rank, "the validation batch buffer");
  }
  double bf = (double)cfg->parallel_bucket_mb * 1048576.0 / sizeof(float);
  w->bucket_floats = bf < 1 ? 1 : (size_t)bf;
  if (w->bucket_floats > total) w->bucket_floats = total;
  w->n_buckets = (int)((total + w->bucket_floats - 1) / w->bucket_floats);
  {
    char name[32];
    snprintf(name, sizeof name, "%s%d", be == &nmt_backend_ref ? "cpu" : "gpu", w->rank);
    /* Events per step: every module range per micro-batch plus the engine's own. */
    size_t per_step = (size_t)t->accum * ((size_t)nmt_model_module_names(w->model, NMT_PROF_FWD, NULL) +
                                          (size_t)nmt_model_module_names(w->model, NMT_PROF_BWD, NULL) +
                                          (size_t)w->n_buckets + 8) + 16;
    NMT_TRY(nmt_prof_add_track(t->prof, name, per_step, &w->prof));
    NMT_TRY(nmt_model_set_profiler(w->model, w->prof));
    if (be != &nmt_backend_ref && nmt_prof_start_step(t->prof) > 0) {
      nmt_prof_clock clk;
      NMT_TRY(nmt_cuda_prof_clock_create(w->ctx, w->prof, &clk, &w->prof_clock));
      NMT_TRY(nmt_prof_track_set_clock(w->prof, &clk));
    }
  }
  /* Slots: one step of micro-batches in flight, one being prepared. */
  w->n_slots = 2 * t->accum + 1;
  size_t cap = 2;
  while (cap < (size_t)w->n_slots + 1) cap *= 2;
  NMT_TRY(nmt_ring_init(&w->batches, cap));
  NMT_TRY(nmt_ring_init(&w->free_slots, cap));
  w->slots = calloc((size_t)w->n_slots, sizeof *w->slots);
  if (!w->slots) return nmt_errorf(NMT_ERR_NOMEM, "batch slots");
  for (int i = 0; i < w->n_slots; i++) {
    /* Page-locked (backend host_alloc), so the copy stream reads them without staging. */
    if (be->host_alloc(w->ctx, t->batch_ints * sizeof(int32_t), (void **)&w->slots[i].buf) !=
        NMT_OK)
      return batch_nomem(t, w->rank, "host batch slots");
    nmt_ring_try_push(&w->free_slots, &w->slots[i]);
  }
  if (t->opt.keep_last_grads) {
    w->host_grads = malloc(total * sizeof(float));
    if (!w->host_grads) return nmt_errorf(NMT_ERR_NOMEM, "gradient copy");
  }
  return NMT_OK;
}

/* parallel.device: cpu = the reference backend; cuda = the CUDA backend, which must be built
 * in and see every device parallel.devices names; auto = cuda when it is built in and sees
 * them, else cpu. Several GPUs reduce through NCCL (nmt_comm_create_nccl). */
static nmt_status select_backend(const nmt_config *cfg, const nmt_backend **out) {
  *out = &nmt_backend_ref;
  if (cfg->parallel_device == NMT_DEVICE_CPU) return NMT_OK;
  const nmt_backend *cuda = nmt_backend_cuda_get();
  int n = 0, need = cfg->parallel_devices;
  for (int i = 0; i < cfg->parallel_device_ids_n; i++)
    if (cfg->parallel_device_ids[i] + 1 > need) need = cfg->parallel_device_ids[i] + 1;
  if (cuda) NMT_TRY(cuda->device_count(&n));
  int fits = cuda && n >= need;
  if (cfg->parallel_device == NMT_DEVICE_AUTO) {
    if (fits) *out = cuda;
    else if (cuda && n > 0)
      nmt_log(NMT_LOG_INFO, "[parallel] device = auto: %d GPU(s) do not cover devices = %d: "
              "training on CPU threads", n, cfg->parallel_devices);
    return NMT_OK;
  }
  if (!cuda)
    return nmt_errorf(NMT_ERR_DEVICE, "[parallel] device = cuda: this build has no CUDA backend "
                                      "(built with CUDA=0 or without nvcc); use device = cpu");
  if (n < 1)
    return nmt_errorf(NMT_ERR_DEVICE, "[parallel] device = cuda: no CUDA device is visible (no "
                                      "GPU, no driver, or CUDA_VISIBLE_DEVICES hides them)");
  if (n < need)
    return nmt_errorf(NMT_ERR_DEVICE, "[parallel] devices: device index %d is not visible (%d "
                      "CUDA device(s); CUDA_VISIBLE_DEVICES renumbers them from 0)", need - 1, n);
  *out = cuda;
  return NMT_OK;
}

/* The profiler (profile.*), its loader and main tracks, the engine's range names, and the
 * peaks for MFU and the table: profile.peak_* when set, else measured once here on the CPU
 * reference (one thread, as each CPU worker runs). The CUDA backend's peaks are not measured
 * here: worker_setup measures it on rank 0's device (nmt_cuda_measure_peaks). */
static nmt_status setup_profiler(nmt_trainer *t) {
  const nmt_config *cfg = &t->cfg;
  nmt_prof_options po;
  nmt_prof_options_from_config(cfg, &po);
  NMT_TRY(nmt_prof_create(&po, &t->prof));
  size_t K = (size_t)t->n_dev * (size_t)t->accum;
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
  double tf = cfg->profile_peak_tflops, gb = cfg->profile_peak_gbps;
  if ((tf <= 0 || gb <= 0) && t->be == &nmt_backend_ref) {
    double mtf = 0, mgb = 0;
    NMT_TRY(nmt_prof_measure_cpu_peak(&mtf, &mgb));
    if (tf <= 0) tf = mtf;
    if (gb <= 0) gb = mgb;
  }
  t->peak_flops = tf > 0 ? tf * 1e12 : 0;
  t->peak_gbps = gb > 0 ? gb : 0;
  return NMT_OK;
}

/* "allreduce.b<i>" for every bucket (worker 0's count; all workers have the same). */
static nmt_status intern_bucket_names(nmt_trainer *t) {
  int nb = t->workers[0].n_buckets;
  t->rn.allreduce = calloc((size_t)nb, sizeof *t->rn.allreduce);
  if (!t->rn.allreduce) return nmt_errorf(NMT_ERR_NOMEM, "profiler bucket names");
  for (int b = 0; b < nb; b++) {
    char name[32];
    snprintf(name, sizeof name, "allreduce.b%d", b);
    NMT_TRY(nmt_prof_intern(t->prof, name, &t->rn.allreduce[b]));
  }
  return NMT_OK;
}

/* After a segment that reached the profile window: trace.json and the per-module table
 * (profile.txt and stderr). Cumulative over segments: the tracks keep their events. */
static void write_profile(nmt_trainer *t) {
  const nmt_config *cfg = &t->cfg;
  long start = nmt_prof_start_step(t->prof);
  if (start <= 0 || atomic_load(&t->steps_done) < start) return;
  char path[NMT_PATH_MAX + 32];
  if (cfg->profile_timeline) {
    snprintf(path, sizeof path, "%s/trace.json", cfg->run_out_dir);
    if (nmt_prof_write_trace(t->prof, path) == NMT_OK)
      nmt_log(NMT_LOG_INFO, "timeline of steps %ld..%ld: %s (Perfetto, chrome://tracing)", start,
              nmt_prof_stop_step(t->prof), path);
    else
      nmt_log(NMT_LOG_WARN, "trace not written: %s", nmt_last_error());
  }
  if (cfg->profile_table) {
    double tf = t->peak_flops / 1e12;
    snprintf(path, sizeof path, "%s/profile.txt", cfg->run_out_dir);
    if (nmt_prof_write_table(t->prof, tf, t->peak_gbps, path) != NMT_OK)
      nmt_log(NMT_LOG_WARN, "profile table not written: %s", nmt_last_error());
    if (!t->opt.quiet) {
      nmt_log_progress_end();
      nmt_prof_print_table(t->prof, tf, t->peak_gbps, stderr);
    }
    nmt_log(NMT_LOG_INFO, "per-module table: %s", path);
  }
}

static nmt_status check_model_vs_data(const nmt_config *cfg, const nmt_shard *s, const char *path) {
  if (nmt_shard_vocab(s) != cfg->model_vocab)
    return nmt_errorf(NMT_ERR_CONFIG, "[model] vocab = %d but %s has vocab %d", cfg->model_vocab,
                      path, nmt_shard_vocab(s));
  return NMT_OK;
}

nmt_status nmt_trainer_create(const nmt_config *cfg, const nmt_trainer_options *opt,
                              nmt_trainer **out) {
  *out = NULL;
  const nmt_backend *be;
  NMT_TRY(select_backend(cfg, &be));
  if (!cfg->data_train[0])
    return nmt_errorf(NMT_ERR_CONFIG, "[data] train is empty: name a training shard");
  nmt_trainer *t = calloc(1, sizeof *t);
  if (!t) return nmt_errorf(NMT_ERR_NOMEM, "trainer");
  nmt_status s = NMT_OK;
  t->cfg = *cfg;
  if (opt) t->opt = *opt;
  else nmt_trainer_options_default(&t->opt);
  t->be = be;
  t->n_dev = cfg->parallel_devices;
  t->accum = cfg->train_accum_steps;
  nmt_model_cfg_from_config(cfg, &t->mcfg);
  t->n_params = nmt_model_num_params(&t->mcfg);
  t->batch_ints = 5 * (size_t)cfg->data_max_tokens + 16; /* nmt_batch_layout's 5 arrays */
  t->last_valid_loss = NAN;
  t->scaler0.enabled = cfg->precision_mode == NMT_PRECISION_FP16;
  t->scaler0.scale = t->scaler0.enabled ? cfg->precision_loss_scale : 1.0f;
  /* One BLAS thread per worker: the workers are the parallelism. */
  openblas_set_num_threads(1);

  NMT_TRY_GOTO(s, nmt_shard_open(cfg->data_train, 0, &t->train_shard), fail);
  NMT_TRY_GOTO(s, check_model_vs_data(cfg, t->train_shard, cfg->data_train), fail);
  NMT_TRY_GOTO(s, nmt_batcher_create(t->train_shard, cfg->data_max_tokens, cfg->data_max_len,
                                     cfg->run_seed, &t->train_batcher), fail);
  if (nmt_batcher_num_dropped(t->train_batcher) > 0)
    nmt_log(NMT_LOG_WARN, "%s: %ld pairs longer than [data] max_len = %d dropped", cfg->data_train,
            nmt_batcher_num_dropped(t->train_batcher), cfg->data_max_len);
  if (cfg->data_valid[0]) {
    NMT_TRY_GOTO(s, nmt_shard_open(cfg->data_valid, cfg->model_vocab, &t->valid_shard), fail);
    NMT_TRY_GOTO(s, nmt_batcher_create(t->valid_shard, cfg->data_max_tokens, cfg->data_max_len,
                                       cfg->run_seed, &t->valid_batcher), fail);
  }

  size_t bytes = t->n_params * sizeof(float);
  t->init_params = malloc(bytes), t->init_m = calloc(t->n_params, sizeof(float));
  t->init_v = calloc(t->n_params, sizeof(float));
  t->snap_params = malloc(bytes), t->snap_m = malloc(bytes), t->snap_v = malloc(bytes);
  t->final_params = malloc(bytes);
  if (!t->init_params || !t->init_m || !t->init_v || !t->snap_params || !t->snap_m ||
      !t->snap_v || !t->final_params) {
    s = nmt_errorf(NMT_ERR_NOMEM, "host copies of %zu parameters", t->n_params);
    goto fail;
  }
  snprintf(t->ckpt_dir, sizeof t->ckpt_dir, "%s/checkpoints", cfg->run_out_dir);
  NMT_TRY_GOTO(s, mkdir_p(cfg->run_out_dir), fail);
  t->out_dir_made = 1;

  nmt_model_init_params(&t->mcfg, cfg->run_seed, t->init_params);
  if (cfg->run_resume) {
    char path[1024];
    nmt_ckpt_header expect = {0}, h;
    const nmt_model_cfg *c = &t->mcfg;
    expect.vocab = c->vocab, expect.d_model = c->d_model, expect.n_heads = c->n_heads;
    expect.d_ff = c->d_ff, expect.enc_layers = c->enc_layers, expect.dec_layers = c->dec_layers;
    expect.norm = (int32_t)c->norm, expect.n_params = t->n_params;
    remove_stale_temps(t->ckpt_dir);
    /* No checkpoint file at all is the normal first start: say so as info, without asking
     * find_latest (whose "no valid checkpoint" is an error). */
    int any = has_checkpoints(t->ckpt_dir);
    s = any ? nmt_ckpt_find_latest(t->ckpt_dir, path) : NMT_ERR_CHECKPOINT;
    if (s == NMT_OK) {
      NMT_TRY_GOTO(s, nmt_ckpt_read(path, &expect, &h, t->init_params, t->init_m, t->init_v), fail);
      t->start_step = h.step;
      t->start_epoch = h.data_epoch;
      t->start_index = h.data_index;
      t->scaler0.skipped = h.skipped_steps;
      if (t->scaler0.enabled && isfinite(h.loss_scale) && h.loss_scale > 0) {
        t->scaler0.scale = h.loss_scale;
        t->scaler0.good = h.scale_good_steps;
      }
      snprintf(t->last_ckpt, sizeof t->last_ckpt, "%s", path);
      nmt_log(NMT_LOG_INFO, "resuming from %s (step %ld)", path, (long)h.step);
    } else if (any) {
      /* Starting over would silently throw away the run (and soon overwrite its files). */
      s = nmt_errorf(NMT_ERR_CHECKPOINT,
                     "run.resume: %s holds checkpoint files but none is valid (the warnings above "
                     "name each problem); move them away to start from step 0",
                     t->ckpt_dir);
      goto fail;
    } else {
      nmt_clear_error();
      nmt_log(NMT_LOG_INFO, "no checkpoint in %s: starting from step 0", t->ckpt_dir);
      s = NMT_OK;
    }
  }

  /* The effective config, so a run directory says exactly what produced it. */
  {
    char path[NMT_PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/config.ini", cfg->run_out_dir);
    FILE *f = fopen(path, "w");
    if (!f) {
      s = nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
      goto fail;
    }
    nmt_config_dump(cfg, f);
    fclose(f);
    snprintf(path, sizeof path, "%s/metrics.jsonl", cfg->run_out_dir);
    t->metrics_file = fopen(path, t->start_step > 0 ? "a" : "w");
    if (!t->metrics_file) {
      s = nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
      goto fail;
    }
  }

  t->n_loaders = loader_threads(cfg);
  t->loaders = calloc((size_t)t->n_loaders, sizeof *t->loaders);
  t->workers = calloc((size_t)t->n_dev, sizeof *t->workers);
  t->comms = calloc((size_t)t->n_dev, sizeof *t->comms);
  if (!t->workers || !t->comms || !t->loaders) {
    s = nmt_errorf(NMT_ERR_NOMEM, "workers");
    goto fail;
  }
  /* CPU workers and one GPU: the host communicator (one GPU never calls it); several GPUs:
   * NCCL, created below once every worker's device context exists. */
  const int use_nccl = be != &nmt_backend_ref && t->n_dev > 1;
  if (!use_nccl) NMT_TRY_GOTO(s, nmt_comm_create_host(t->n_dev, &t->abort, t->comms), fail);
  NMT_TRY_GOTO(s, setup_profiler(t), fail);
  for (int r = 0; r < t->n_dev; r++) {
    t->workers[r].t = t;
    t->workers[r].rank = r;
    t->workers[r].comm = t->comms[r];
    NMT_TRY_GOTO(s, worker_setup(t, &t->workers[r]), fail);
  }
  if (use_nccl) {
    int dev[t->n_dev];
    void *ctx[t->n_dev];
    for (int r = 0; r < t->n_dev; r++) {
      dev[r] = cfg->parallel_device_ids_n ? cfg->parallel_device_ids[r] : r;
      ctx[r] = t->workers[r].ctx;
    }
    NMT_TRY_GOTO(s, nmt_comm_create_nccl(t->n_dev, dev, ctx, &t->abort, t->comms), fail);
    for (int r = 0; r < t->n_dev; r++) t->workers[r].comm = t->comms[r];
    nmt_log(NMT_LOG_INFO, "NCCL communicator over %d GPUs", t->n_dev);
  }
  /* A half-precision wire needs a cast buffer per rank (NCCL: device memory), sized once
   * here for the largest bucket, never in the step. */
  if (t->n_dev > 1 && cfg->parallel_grad_dtype != NMT_GRAD_FP32)
    for (int r = 0; r < t->n_dev; r++)
      NMT_TRY_GOTO(s, nmt_comm_reserve(t->comms[r], t->workers[r].bucket_floats), fail);
  NMT_TRY_GOTO(s, intern_bucket_names(t), fail);
  NMT_TRY_GOTO(s, nmt_ring_init(&t->msgs_full, MSG_POOL), fail);
  NMT_TRY_GOTO(s, nmt_ring_init(&t->msgs_free, MSG_POOL), fail);
  for (int i = 0; i < MSG_POOL - 1; i++) nmt_ring_try_push(&t->msgs_free, &t->msgs[i]);
  atomic_store(&t->steps_done, t->start_step);
  t->scaler_end = t->scaler0;
  t->pos_epoch = t->start_epoch, t->pos_index = t->start_index;
  memcpy(t->final_params, t->init_params, bytes);
  if (t->opt.handle_signals) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = count_signal;
    sa.sa_flags = SA_RESTART; /* the host program's system calls are not interrupted */
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < N_STOP_SIGNALS; i++) {
      atomic_store(&signal_counts[i], 0);
      sigaction(stop_signals[i], &sa, &t->old_actions[i]);
    }
    t->handlers_installed = 1;
  }
  *out = t;
  return NMT_OK;
fail:
  /* A scheduler polling status.json should see why, also when setup failed (a previous run's
   * status would be stale); only where the run directory already exists. */
  {
    struct stat sb;
    if (t->out_dir_made || (stat(cfg->run_out_dir, &sb) == 0 && S_ISDIR(sb.st_mode))) {
      t->out_dir_made = 1;
      write_status(t, "failed", s, nmt_last_error());
    }
  }
  nmt_trainer_destroy(t);
  return s;
}

/* ------------------------------------------------------------------------------------------ */
/* main thread                                                                                */

static void fmt_eta(double s, char *buf, size_t n) {
  if (!(s >= 0) || s > 1e7) {
    snprintf(buf, n, "?");
    return;
  }
  long x = (long)s;
  if (x >= 3600) snprintf(buf, n, "%ldh%02ldm", x / 3600, x / 60 % 60);
  else snprintf(buf, n, "%ldm%02lds", x / 60, x % 60);
}

static void write_metrics(nmt_trainer *t, const nmt_metrics *m) {
  t->last_metrics = *m;
  FILE *f = t->metrics_file;
  if (f) {
    fprintf(f,
            "{\"step\": %ld, \"epoch\": %ld, \"train_loss\": %.6f, \"train_nll\": %.6f, "
            "\"lr\": %.6g", m->step, m->epoch, m->train_loss, m->train_nll, m->lr);
    nmt_json_num(f, "grad_norm", m->grad_norm, "%.6g");
    fprintf(f, ", \"tgt_tokens_per_s\": %.1f, \"step_ms\": %.2f, \"loss_scale\": %.9g, "
            "\"skipped_steps\": %ld", m->tgt_tokens_per_s, m->step_ms, m->loss_scale,
            m->skipped_steps);
    nmt_json_num(f, "mfu", m->mfu, "%.4f");
    nmt_json_num(f, "peak_mem_mb", m->peak_mem_mb, "%.1f");
    if (m->has_valid)
      fprintf(f, ", \"valid_loss\": %.6f, \"valid_nll\": %.6f, \"valid_ppl\": %.4f", m->valid_loss,
              m->valid_nll, m->valid_ppl);
    fprintf(f, "}\n");
    fflush(f);
  }
  if (!t->opt.quiet) {
    char eta[32], scale[64] = "";
    double left = (double)(t->cfg.train_max_steps - m->step) * m->step_ms / 1e3;
    fmt_eta(left, eta, sizeof eta);
    if (t->scaler0.enabled && m->skipped_steps)
      snprintf(scale, sizeof scale, " | scale %g (%ld skipped)", m->loss_scale, m->skipped_steps);
    else if (t->scaler0.enabled)
      snprintf(scale, sizeof scale, " | scale %g", m->loss_scale);
    /* On a terminal this line is rewritten in place; validation results stay as lines. */
    nmt_log_progress("step %ld/%ld | epoch %ld | loss %.3f | lr %.3g | gnorm %.3f%s | "
                     "%.0f tgt tok/s | %.0f ms/step | ETA %s",
                     m->step, t->cfg.train_max_steps, m->epoch, m->train_loss, m->lr,
                     m->grad_norm, scale, m->tgt_tokens_per_s, m->step_ms, eta);
    if (m->has_valid)
      nmt_log(NMT_LOG_INFO, "step %ld | valid loss %.3f | valid ppl %.2f", m->step,
              m->valid_loss, m->valid_ppl);
  }
  if (t->opt.on_metrics) t->opt.on_metrics(t->opt.user, m);
}

/* Replaces run.out_dir/status.json (fields: README.md "Embedding, schedulers and faults").
 * Written to a temp file in the same directory and renamed over the old one, so a poller reads
 * the old or the new file, never half of one. No fsync: the file describes a live process;
 * after a power cut the checkpoints, not this file, are the truth. A failure here only warns:
 * it must not end a run. */
static void write_status(nmt_trainer *t, const char *state, nmt_status s, const char *error) {
  if (!t->out_dir_made) return;
  t->state = state;
  char path[NMT_PATH_MAX + 32], tmp[NMT_PATH_MAX + 64];
  snprintf(path, sizeof path, "%s/status.json", t->cfg.run_out_dir);
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
  FILE *f = fopen(tmp, "w");
  if (!f) {
    nmt_log(NMT_LOG_WARN, "cannot write %s: %s", tmp, strerror(errno));
    return;
  }
  const nmt_metrics *m = &t->last_metrics;
  long step = atomic_load(&t->steps_done), max = t->cfg.train_max_steps;
  int have = m->step > 0, live = !strcmp(state, "running");
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  fprintf(f, "{\"state\": \"%s\", \"step\": %ld, \"max_steps\": %ld", state, step, max);
  nmt_json_num(f, "train_loss", have ? m->train_loss : NAN, "%.6f");
  nmt_json_num(f, "valid_loss", t->last_valid_loss, "%.6f");
  nmt_json_num(f, "tgt_tokens_per_s", have ? m->tgt_tokens_per_s : NAN, "%.1f");
  nmt_json_num(f, "step_ms", have ? m->step_ms : NAN, "%.2f");
  nmt_json_num(f, "loss_scale", have ? m->loss_scale : NAN, "%.9g");
  fprintf(f, ", \"skipped_steps\": %ld", have ? m->skipped_steps : 0L);
  nmt_json_num(f, "eta_s", have && live ? (double)(max - step) * m->step_ms / 1e3 : live ? NAN : 0,
           "%.0f");
  fputs(", \"last_checkpoint\": ", f);
  if (t->last_ckpt[0]) nmt_json_str(f, t->last_ckpt);
  else fputs("null", f);
  fprintf(f, ", \"status\": \"%s\", \"exit_code\": %d", nmt_status_str(s),
          nmt_status_exit_code(s));
  fputs(", \"error\": ", f);
  if (error && *error) nmt_json_str(f, error);
  else fputs("null", f);
  fprintf(f, ", \"pid\": %ld, \"updated_unix\": %.3f}\n", (long)getpid(),
          (double)now.tv_sec + 1e-9 * (double)now.tv_nsec);
  int bad = ferror(f);
  if (fclose(f) != 0 || bad || rename(tmp, path) != 0) {
    nmt_log(NMT_LOG_WARN, "cannot write %s: %s", path, strerror(errno));
    unlink(tmp);
  }
}

static nmt_status serve_msgs(nmt_trainer *t) {
  void *p;
  nmt_status first = NMT_OK;
  while (nmt_ring_try_pop(&t->msgs_full, &p)) {
    msg *m = p;
    nmt_prof_step_begin(t->main_track, m->kind == MSG_METRICS ? m->metrics.step : m->ckpt.step);
    nmt_prof_push(t->main_track, m->kind == MSG_METRICS ? t->rn.metrics : t->rn.checkpoint,
                  NMT_PROF_OTHER, 0, 0);
    if (m->kind == MSG_METRICS) {
      write_metrics(t, &m->metrics);
      if (m->metrics.has_valid) t->last_valid_loss = m->metrics.valid_loss;
      write_status(t, "running", NMT_OK, NULL);
    } else {
      char path[1024];
      nmt_status s = nmt_ckpt_save_step(t->ckpt_dir, &m->ckpt, t->snap_params, t->snap_m,
                                        t->snap_v, t->cfg.checkpoint_keep, path);
      if (s == NMT_OK) {
        nmt_log(NMT_LOG_INFO, "checkpoint %s", path);
        snprintf(t->last_ckpt, sizeof t->last_ckpt, "%s", path);
        write_status(t, "running", NMT_OK, NULL);
      } else if (first == NMT_OK) {
        first = s;
      }
      atomic_store_explicit(&t->snap_busy, 0, memory_order_release);
    }
    nmt_prof_pop(t->main_track);
    nmt_prof_step_end(t->main_track); /* host clock: cannot fail */
    nmt_ring_try_push(&t->msgs_free, m);
  }
  return first;
}

/* The main thread's serving loop while `started` threads run: drains worker 0's messages,
 * handles signals (one: stop after the step; a second SIGINT: abort), aborts the communicator
 * once anything failed, and joins the threads when they have all returned. */
static void on_signal(nmt_trainer *t, int sig) {
  if (atomic_load(&t->stop_requested) && sig == SIGINT) {
    nmt_log(NMT_LOG_WARN, "second SIGINT: aborting without a checkpoint");
    record_error(t, -1, nmt_errorf(NMT_ERR_ABORTED, "interrupted twice"));
  } else {
    nmt_log(NMT_LOG_WARN, "signal %d: stopping after this step, then writing a checkpoint", sig);
    nmt_trainer_request_stop(t);
  }
}

/* Takes the stop signals that arrived since the last poll: counted by the handlers, or left
 * pending by a caller that blocks them in every thread. */
static void poll_signals(nmt_trainer *t) {
  for (int i = 0; i < N_STOP_SIGNALS; i++)
    for (int k = atomic_exchange(&signal_counts[i], 0); k > 0; k--) on_signal(t, stop_signals[i]);
  sigset_t sigs;
  sigemptyset(&sigs);
  for (int i = 0; i < N_STOP_SIGNALS; i++) sigaddset(&sigs, stop_signals[i]);
  struct timespec zero = {0, 0};
  int sig;
  while ((sig = sigtimedwait(&sigs, NULL, &zero)) > 0) on_signal(t, sig);
}

static void serve_and_join(nmt_trainer *t, pthread_t *threads, const int *started, int n) {
  int live = 0;
  for (int r = 0; r < n; r++) live += started[r];
  const struct timespec tick = {0, 2000000};
  while (atomic_load(&t->workers_done) < live) {
    nmt_status ms = serve_msgs(t);
    if (ms != NMT_OK) record_error(t, -1, ms);
    if (t->opt.handle_signals) poll_signals(t);
    if (atomic_load(&t->abort)) nmt_comm_abort(t->comms[0]);
    nanosleep(&tick, NULL);
  }
  for (int r = 0; r < n; r++)
    if (started[r]) pthread_join(threads[r], NULL);
}

/* Marks the trainer dead after an error (the communicator is aborted for good) and reports. */
static nmt_status fail_run(nmt_trainer *t) {
  t->dead = 1;
  nmt_status s = t->error;
  nmt_log(NMT_LOG_ERROR, "run failed on %s%d: %s: %s", t->error_rank >= 0 ? "rank " : "main ",
          t->error_rank, nmt_status_str(s), t->error_msg);
  write_status(t, "failed", s, t->error_msg);
  /* The caller's thread gets the first error's message, whichever thread recorded it. */
  return nmt_errorf(s, "%s", t->error_msg);
}

nmt_status nmt_trainer_train(nmt_trainer *t, long n_steps) {
  if (t->dead) return nmt_errorf(t->error, "%s", t->error_msg);
  const long max = t->cfg.train_max_steps;
  const size_t bytes = t->n_params * sizeof(float);
  if (t->start_step >= max) {
    nmt_log(NMT_LOG_INFO, "already at step %ld of %ld: nothing to train", t->start_step, max);
    NMT_TRY(t->be->copy_d2h(t->workers[0].ctx, t->final_params, t->workers[0].params, bytes));
    write_status(t, "done", NMT_OK, NULL);
    return NMT_OK;
  }
  t->end_step = n_steps > 0 && n_steps < max - t->start_step ? t->start_step + n_steps : max;
  /* A previous segment that stopped early may have left batches of later steps in the rings;
   * the loader restarts from the data position of the last completed step. */
  for (int r = 0; r < t->n_dev; r++) {
    void *p;
    while (nmt_ring_try_pop(&t->workers[r].batches, &p))
      nmt_ring_try_push(&t->workers[r].free_slots, p);
    t->workers[r].started = 0;
  }
  atomic_store(&t->shutdown, 0);
  atomic_store(&t->workers_done, 0);
  t->stopped = 0;
  t->t_start = now_s();
  write_status(t, "running", NMT_OK, NULL);
  nmt_log(NMT_LOG_INFO, "training %zu parameters on %d %s worker(s), %d loader thread(s), "
          "accum_steps %d, steps %ld..%ld", t->n_params, t->n_dev, t->be->name, t->n_loaders,
          t->accum, t->start_step + 1, t->end_step);
  for (int j = 0; j < t->n_loaders; j++) {
    loader *L = &t->loaders[j];
    L->t = t, L->index = j;
    if (pthread_create(&L->thread, NULL, loader_main, L) != 0) {
      record_error(t, -1, nmt_errorf(NMT_ERR_INTERNAL, "cannot start loader thread %d", j));
      atomic_store(&t->shutdown, 1);
      for (int i = 0; i < j; i++) pthread_join(t->loaders[i].thread, NULL);
      return fail_run(t);
    }
  }
  pthread_t threads[t->n_dev];
  int started[t->n_dev];
  for (int r = 0; r < t->n_dev; r++) started[r] = 0;
  for (int r = 0; r < t->n_dev; r++) {
    if (pthread_create(&threads[r], NULL, worker_main, &t->workers[r]) != 0) {
      record_error(t, r, nmt_errorf(NMT_ERR_INTERNAL, "cannot start worker thread %d", r));
      break;
    }
    started[r] = t->workers[r].started = 1;
  }
  serve_and_join(t, threads, started, t->n_dev);
  atomic_store(&t->shutdown, 1);
  for (int j = 0; j < t->n_loaders; j++) pthread_join(t->loaders[j].thread, NULL);
  nmt_status ms = serve_msgs(t);
  if (ms != NMT_OK) record_error(t, -1, ms);
  if (atomic_load(&t->error_claimed)) return fail_run(t);

  t->start_step = atomic_load(&t->steps_done);
  t->start_epoch = t->pos_epoch;
  t->start_index = t->pos_index;
  t->scaler0 = t->scaler_end;
  NMT_TRY(t->be->copy_d2h(t->workers[0].ctx, t->final_params, t->workers[0].params, bytes));
  nmt_log_progress_end(); /* the last progress line stays on screen */
  write_profile(t);
  nmt_log(NMT_LOG_INFO, "at step %ld of %ld after %.1f s", t->start_step, max,
          now_s() - t->t_start);
  if (t->stopped) {
    atomic_store(&t->stop_requested, 0);
    write_status(t, "stopped", NMT_STOPPED, NULL);
    return NMT_STOPPED;
  }
  write_status(t, t->start_step >= max ? "done" : "running", NMT_OK, NULL);
  return NMT_OK;
}

nmt_status nmt_trainer_run(nmt_trainer *t) { return nmt_trainer_train(t, 0); }

static void *eval_main(void *arg) {
  worker *w = arg;
  nmt_trainer *t = w->t;
  double vx[NMT_GRAD_EXTRA];
  nmt_status s = validate(w, vx);
  if (s == NMT_OK && w->rank == 0) memcpy(t->eval_out, vx, sizeof vx);
  if (s != NMT_OK) record_error(t, w->rank, s);
  atomic_fetch_add(&t->workers_done, 1);
  return NULL;
}

nmt_status nmt_trainer_evaluate(nmt_trainer *t, double *loss, double *nll, double *tokens) {
  if (t->dead) return nmt_errorf(t->error, "%s", t->error_msg);
  if (!t->valid_batcher)
    return nmt_errorf(NMT_ERR_CONFIG, "evaluate: [data] valid is empty: name a validation shard");
  atomic_store(&t->workers_done, 0);
  pthread_t threads[t->n_dev];
  int started[t->n_dev];
  for (int r = 0; r < t->n_dev; r++) started[r] = 0;
  for (int r = 0; r < t->n_dev; r++) {
    if (pthread_create(&threads[r], NULL, eval_main, &t->workers[r]) != 0) {
      record_error(t, r, nmt_errorf(NMT_ERR_INTERNAL, "cannot start evaluation thread %d", r));
      break;
    }
    started[r] = 1;
  }
  serve_and_join(t, threads, started, t->n_dev);
  if (atomic_load(&t->error_claimed)) return fail_run(t);
  double tok = t->eval_out[NMT_GRAD_SLOT_TOKENS];
  if (!(tok > 0))
    return nmt_errorf(NMT_ERR_DATA, "evaluate: %s has no target tokens", t->cfg.data_valid);
  if (loss) *loss = t->eval_out[NMT_GRAD_SLOT_LOSS] / tok;
  if (nll) *nll = t->eval_out[NMT_GRAD_SLOT_NLL] / tok;
  if (tokens) *tokens = tok;
  t->last_valid_loss = t->eval_out[NMT_GRAD_SLOT_LOSS] / tok;
  return NMT_OK;
}

nmt_status nmt_trainer_save(nmt_trainer *t, char *path_out) {
  if (t->dead) return nmt_errorf(t->error, "%s", t->error_msg);
  const size_t bytes = t->n_params * sizeof(float);
  worker *w = &t->workers[0];
  NMT_TRY(t->be->copy_d2h(w->ctx, t->snap_params, w->params, bytes));
  NMT_TRY(t->be->copy_d2h(w->ctx, t->snap_m, w->m, bytes));
  NMT_TRY(t->be->copy_d2h(w->ctx, t->snap_v, w->v, bytes));
  nmt_ckpt_header h;
  ckpt_header(t, &t->scaler0, t->start_step, t->start_epoch, t->start_index, &h);
  char path[1024];
  NMT_TRY(nmt_ckpt_save_step(t->ckpt_dir, &h, t->snap_params, t->snap_m, t->snap_v,
                             t->cfg.checkpoint_keep, path));
  nmt_log(NMT_LOG_INFO, "checkpoint %s", path);
  snprintf(t->last_ckpt, sizeof t->last_ckpt, "%s", path);
  write_status(t, t->state ? t->state : "running", NMT_OK, NULL);
  if (path_out) snprintf(path_out, 1024, "%s", path);
  return NMT_OK;
}

void nmt_trainer_request_stop(nmt_trainer *t) { atomic_store(&t->stop_requested, 1); }

long nmt_trainer_step(const nmt_trainer *t) { return atomic_load(&((nmt_trainer *)t)->steps_done); }

const float *nmt_trainer_params(const nmt_trainer *t, size_t *n) {
  if (n) *n = t->n_params;
  return t->final_params;
}

const float *nmt_trainer_last_grads(const nmt_trainer *t, int rank, size_t *n) {
  if (n) *n = t->n_params + NMT_GRAD_EXTRA;
  return rank >= 0 && rank < t->n_dev ? t->workers[rank].host_grads : NULL;
}

const nmt_metrics *nmt_trainer_last_metrics(const nmt_trainer *t) { return &t->last_metrics; }

void nmt_trainer_destroy(nmt_trainer *t) {
  if (!t) return;
  if (t->handlers_installed) {
    /* A signal that came after the last step has nothing left to stop. */
    for (int i = 0; i < N_STOP_SIGNALS; i++) {
      sigaction(stop_signals[i], &t->old_actions[i], NULL);
      atomic_store(&signal_counts[i], 0);
    }
  }
  /* The communicator first: an NCCL group must not outlive (or be waited on by) the device
   * contexts' teardown, which synchronizes the devices. */
  if (t->comms && t->comms[0]) nmt_comm_destroy(t->comms, t->n_dev);
  if (t->workers) {
    for (int r = 0; r < t->n_dev; r++) {
      worker *w = &t->workers[r];
      const nmt_backend *be = t->be;
      if (w->model) nmt_model_destroy(w->model);
      if (w->half_params) {
        /* Unregistered before it is freed: the context must not point at freed memory. */
        (void)be->half_weights(w->ctx, NULL, NULL, 0);
        be->free(w->ctx, w->half_params);
      }
      be->free(w->ctx, w->params);
      be->free(w->ctx, w->grads);
      be->free(w->ctx, w->m);
      be->free(w->ctx, w->v);
      be->free(w->ctx, w->dev_ctl);
      be->host_free(w->ctx, w->host_ctl);
      be->free(w->ctx, w->dev_valid);
      be->free(w->ctx, w->dev_batch_buf);
      for (int i = 0; i < 2; i++) be->free(w->ctx, w->dev_stage[i]);
      /* Before the context: host_free takes it. (cudaFreeHost waits for copies still reading.) */
      if (w->slots)
        for (int i = 0; i < w->n_slots; i++) be->host_free(w->ctx, w->slots[i].buf);
      free(w->slots);
      nmt_cuda_prof_clock_destroy(w->prof_clock);
      if (be->ctx_destroy) be->ctx_destroy(w->ctx);
      free(w->valid_host_buf);
      free(w->host_grads);
      nmt_ring_free(&w->batches);
      nmt_ring_free(&w->free_slots);
    }
  }
  nmt_prof_destroy(t->prof); /* after the models, which point at its tracks */
  free(t->rn.allreduce);
  free(t->comms);
  free(t->workers);
  free(t->loaders);
  nmt_ring_free(&t->msgs_full);
  nmt_ring_free(&t->msgs_free);
  if (t->train_batcher) nmt_batcher_destroy(t->train_batcher);
  if (t->valid_batcher) nmt_batcher_destroy(t->valid_batcher);
  if (t->train_shard) nmt_shard_close(t->train_shard);
  if (t->valid_shard) nmt_shard_close(t->valid_shard);
  if (t->metrics_file) fclose(t->metrics_file);
  free(t->init_params), free(t->init_m), free(t->init_v);
  free(t->snap_params), free(t->snap_m), free(t->snap_v);
  free(t->final_params);
  free(t);
}
