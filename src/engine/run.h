/* run.h — the state one training run shares between its threads (src/engine/, not public).
 *
 * The trainer is four rooms, one per thread kind and concern, around this header:
 *   trainer.c — create / train / evaluate / save / destroy, resume, signals, the main thread's
 *               serving loop (what include/nmt/trainer.h promises);
 *   loader.c  — the loader threads: each step's batches, dealt to the workers (nmt_loader_deal);
 *   worker.c  — a worker thread's step loop (forward/backward, buckets, step control, AdamW) and
 *               the host's end of a step (metrics, validation, checkpoint snapshots);
 *   replica.c — one worker's device state: context, model, flat buffers, batch slots;
 *   buckets.c — which gradient slices are reduced when, in which wire type (nmt/buckets.h);
 *   rundir.c  — run.out_dir: config.ini, metrics.jsonl, status.json, checkpoint temp cleanup;
 *   valid.c   — validation BLEU, the best validation so far and early stopping (patience);
 *   warmup.c  — the create-time warm-up of a device backend's GEMM kernels.
 * Threads touch the shared parts below only as their comments say: fields written by main
 * between segments are read-only while threads run; the `sync` atomics are the only state
 * written by several threads at once.
 *
 * defines: nmt__batch_slot, nmt__msg, nmt__loss_scaler, nmt__step_info, nmt__best,
 *          nmt__valid_result, nmt__valid_bleu_setup, nmt__worker, nmt__loader,
 *          struct nmt_trainer, and the engine's internal functions (nmt__*).
 */
#ifndef NMT_ENGINE_RUN_H
#define NMT_ENGINE_RUN_H

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>

#include "nmt/backend.h"
#include "nmt/buckets.h"
#include "nmt/checkpoint.h"
#include "nmt/comm.h"
#include "nmt/data.h"
#include "nmt/model.h"
#include "nmt/prof.h"
#include "nmt/ring.h"
#include "nmt/trainer.h"
#include "translate_impl.h"

/* Runs `expr` (an nmt_status) inside profiler range `name` on `track` with cost `cost`; the
 * range is closed before an error is returned. */
#define NMT__PROFILED(track, name, phase, cost, expr)                \
  do {                                                               \
    nmt_prof_cost pc_ = (cost);                                      \
    nmt_prof_push((track), (name), (phase), pc_.flops, pc_.bytes);   \
    nmt_status ps_ = (expr);                                         \
    nmt_prof_pop(track);                                             \
    NMT_TRY(ps_);                                                    \
  } while (0)
#define NMT__NO_COST ((nmt_prof_cost){0, 0})

enum { NMT__MSG_POOL = 64 };

/* One host batch slot: filled by a loader, consumed by one worker, returned through its ring. */
typedef struct {
  nmt_batch b;        /* host batch, arrays inside buf */
  int32_t *buf;       /* page-locked (backend host_alloc) */
  long step;          /* optimizer step (0-based) the batch belongs to */
  int k;              /* index in the step's list of devices*accum batches: keys dropout */
  double step_flops;  /* model FLOPs of the whole step (all devices' batches), for MFU */
  long next_epoch;    /* data position after the whole step, for checkpoints */
  long next_index;
} nmt__batch_slot;

typedef enum { NMT__MSG_METRICS, NMT__MSG_CHECKPOINT } nmt__msg_kind;

/* Worker 0 -> main. */
typedef struct {
  nmt__msg_kind kind;
  nmt_metrics metrics;
  nmt_ckpt_header ckpt;
} nmt__msg;

/* Dynamic loss scaling for fp16 (Micikevicius et al. 2018 §3.2; the policy of PyTorch's
 * GradScaler), as the host mirrors it: gradients are computed for scale * loss; a step whose
 * reduced gradient holds an inf or NaN is skipped and the scale multiplied by
 * precision.backoff; growth_interval clean steps in a row double it. The device decides
 * (step_control); every rank reads the same reduced gradient, so all decide alike. Other
 * precisions: scale 1, never skip. */
typedef struct {
  int enabled;        /* precision.mode = fp16 */
  float scale;
  long good;          /* clean steps since the scale last changed */
  int64_t skipped;    /* steps skipped so far in the run */
} nmt__loss_scaler;

/* The best validation so far and the patience count (train.best_metric, train.patience;
 * valid.c). Every rank keeps its own copy and updates it from the same reduced numbers, so
 * every rank decides to stop early at the same step without another collective. Checkpoints
 * carry it (nmt_ckpt_header's best_*), so a resumed run continues the count. */
typedef struct {
  nmt_valid_metric metric; /* train.best_metric */
  long step;               /* step of the best validation; 0 = none yet */
  double value;            /* its metric value */
  long bad;                /* validations since `step` that did not improve on it */
} nmt__best;

/* One validation's results, the same on every rank. */
typedef struct {
  double x[NMT_GRAD_EXTRA]; /* the reduced loss slots (nmt__validate) */
  int has_bleu;             /* train.valid_bleu: the next two are set */
  double bleu, chrf;        /* sacreBLEU's corpus BLEU and chrF2 of the valid split, 0..100 */
  int improved;             /* the best metric improved at this validation */
} nmt__valid_result;

/* train.valid_bleu in the process of global rank 0, which decodes (valid.c). */
typedef struct {
  int on;
  char src[NMT_PATH_MAX + 64], ref[NMT_PATH_MAX + 64]; /* the valid split's raw text */
  nmt_spm *spm;             /* data.spm_model */
  nmt_config dcfg;          /* the run's config with decode.beam = the validation beam */
  int longest;              /* the valid source's longest line, SentencePiece ids */
  float *host_params;       /* n_params: rank 0's parameters, for the decoder */
  /* The decoder, on rank 0's device with the run's abort flag: opened (and its buffers sized
   * for the valid source) once at create, before any collective, and reused by every
   * validation, which so allocates no device memory while the other ranks wait in the
   * all-reduce (nmt__valid_open). */
  nmt__rig rig;
  /* Rank 0's account of what validation BLEU costs the segment that began at t_start
   * (valid.c's log line): decoding and scoring time, and the other ranks' waits (the longest
   * of each validation), in seconds. */
  double t_start, decode_s, wait_s;
} nmt__valid_bleu_setup;

/* What the host knows of a step it has enqueued, until it reads the step's control block. */
typedef struct {
  long step;                           /* 0-based */
  long next_epoch, next_index;         /* data position after the step */
  double lr, flops;                    /* the step's learning rate; model FLOPs of all ranks */
  double enqueued_s;                   /* nmt__now_s() when its enqueue returned: on a host
                                          backend (synchronous ops), when its work ended */
} nmt__step_info;

/* One worker thread and the device state it owns (replica.c sets it up, worker.c runs it). */
typedef struct nmt__worker {
  struct nmt_trainer *t;
  int rank;            /* local index in this process: its device, its rings */
  int grank;           /* global rank: its batches, its ZeRO slices, rank 0's duties */
  int started;
  nmt_ring batches;    /* loader -> worker: filled slots */
  nmt_ring free_slots; /* worker -> loader: slots to refill */
  nmt__batch_slot *slots;
  int n_slots;
  nmt_comm *comm;
  void *ctx;           /* the backend's device context (nmt_device_open) */
  int device;          /* the device index it was opened on */
  nmt_model *model;
  float *params, *grads, *m, *v; /* device memory (host on ref); with ZeRO m and v hold only
                                     the rank's shard (nmt/buckets.h); with ZeRO stage 2 grads
                                     is the shard's gradient accumulator (and the slots) */
  float *zero_part;    /* ZeRO: n_buckets + 1 floats, the slices' sums of squares and theirs */
  float *zero_windows; /* ZeRO stage 2: two gradient windows of plan.bucket_floats floats, which
                          the all-gather of the parameters reuses, then the embedding's
                          (nmt_grad_windows_floats) */
  nmt_grad_windows zero_grads; /* ZeRO stage 2: backward's sink, this step's windows */
  size_t bytes_grads, bytes_optim; /* what was allocated for gradients (stage 2: the windows
                                      included) and Adam moments */
  size_t bytes_grad_buf; /* of `grads`, which every step zeroes */
  /* fp16/bf16 modes: the half working copy of params that the GEMMs read (backend
   * half_weights), refreshed by adamw; NULL in fp32/tf32. */
  void *half_params;
  int32_t *dev_batch_buf; /* validation batches (copied synchronously) */
  /* Training batches: two staging slots on the device. The copy of micro-batch i+1 runs on
   * the copy stream while micro-batch i computes (backend h2d_async / acquire / release). */
  int32_t *dev_stage[2];
  nmt__batch_slot *ahead; /* popped and being copied into dev_stage[ahead_slot]; NULL = none */
  int ahead_slot;
  int ahead_copying;      /* its h2d_async was issued: the copy engine may be reading it */
  nmt__batch_slot *parked; /* after an error: the slot fetched ahead whose copy was not seen
                              to finish; in neither ring (the run is over), freed with the
                              replica */
  nmt_step_ctl *dev_ctl;  /* device: the step's control block (loss scaler state, verdict) */
  nmt_step_ctl *host_ctl; /* pinned, NMT_D2H_SLOTS: step s's block is read back into [s % 2] */
  nmt__step_info inflight[NMT_D2H_SLOTS]; /* the host's side of the steps being read back */
  float *dev_valid;    /* NMT_GRAD_EXTRA floats: validation loss slots */
  int32_t *valid_host_buf;
  nmt_bucket_reducer buckets; /* this backward's progress through the bucket plan */
  float *host_grads;   /* copy of the last reduced gradient (tests) */
  nmt__loss_scaler scaler;
  nmt__best best;       /* the best validation so far, as this rank counts it */
  nmt_prof_track *prof; /* this worker's profiler track ("cpu0", "gpu0", ...) */
  void *prof_clock;     /* GPU workers in a profile window: the device event clock */
  double mem_peak_mb;   /* device memory peak sampled at log steps (NAN at first) */
  int mfu_warned;       /* rank 0: the "MFU above 1" warning was given */
  nmt_status status;
} nmt__worker;

/* A loader thread: every loader computes each step's whole deal and fills only the rings of
 * the workers r with r % n_loaders == index, so each ring keeps one producer. */
typedef struct nmt__loader {
  struct nmt_trainer *t;
  int index;
  nmt_prof_track *prof;
  pthread_t thread;
} nmt__loader;

/* Where this process stands in a run over several processes (world.c). With nodes = 1 and no
 * rendezvous: world = local, first_rank = 0, multi = 0 (today's single process). */
typedef struct {
  int nodes, node_rank;
  int local;        /* workers in this process (parallel.devices) */
  int world;        /* nodes x local */
  int first_rank;   /* global rank of local worker 0: node_rank x local */
  int multi;        /* the ranks meet through the rendezvous store (nodes > 1, or asked) */
  char rendezvous[NMT_PATH_MAX];
  double timeout_s;
} nmt__world;

/* Range names the engine interns once (profiler ids). */
typedef struct {
  int step, micro_step, data_wait, h2d, forward, backward, optimizer, validate, checkpoint, load,
      metrics;
  int *allreduce; /* one per bucket: "allreduce.b<i>" */
} nmt__range_names;

/* Where the next segment starts and where the last one ended (main writes it between
 * segments; worker 0 writes the `end_*` fields after each step, main reads them after the
 * join). */
typedef struct {
  long start_step, start_epoch, start_index;
  nmt__loss_scaler scaler0;    /* scaler state at the start of the next segment */
  long end_step;               /* the current segment trains steps [start_step, end_step) */
  nmt__loss_scaler scaler_end; /* worker 0's after each step */
  long pos_epoch, pos_index;   /* worker 0, after each step: data position of the next step */
  int stopped;                 /* the segment ended on a stop request */
  nmt__best best0;             /* the best validation at the start of the next segment */
  nmt__best best_end;          /* worker 0's after each validation (checkpoint headers) */
  int early_stopped;           /* worker 0: train.patience ended the run at steps_done */
} nmt__position;

/* Written by several threads at once: the only shared mutable state of a running segment. */
typedef struct {
  atomic_int abort;          /* raised on any error: collectives and rings give up */
  atomic_int shutdown;       /* the loaders stop waiting (workers done or aborted) */
  atomic_int stop_requested;
  atomic_int workers_done;
  atomic_long steps_done;
  atomic_int error_claimed;  /* the first error wins: */
  nmt_status error;          /* written once, by the claimer */
  char error_msg[1024];
  int error_rank;            /* -1: the main thread */
  /* The first worker's ABORTED, kept apart: usually an echo of the error above, but when a
   * peer in another process failed it is the only error this process sees. */
  atomic_int aborted_claimed;
  char aborted_msg[1024];
  int aborted_rank;
  int dead;                  /* an error ended a segment: the communicator is aborted for good */
} nmt__sync;

/* run.out_dir and what main writes there (rundir.c). */
typedef struct {
  char ckpt_dir[NMT_PATH_MAX + 16];
  char last_ckpt[1024];  /* path of the newest checkpoint written or loaded ("" if none) */
  int out_dir_made;      /* run.out_dir is claimed (nmt__rundir_claim): status.json can be
                            written */
  int locked, lock_fd;   /* run.lock (node k: run.node<k>.lock) is held through lock_fd */
  const char *state;     /* the last state written to status.json */
  FILE *metrics_file;
  nmt_metrics last_metrics;
  double last_valid_loss; /* NAN until a validation ran */
  double last_valid_bleu; /* NAN until a validation with train.valid_bleu ran */
  nmt__best best;         /* the best validation as main last heard of it */
  char reason[512];       /* why the run is done or stopped (status.json "reason"); "" none */
  double progress_s;      /* when the progress line was last drawn (nmt__now_s) */
} nmt__rundir;

/* Worker 0 -> main: messages and the checkpoint snapshot (host copies of the state). */
typedef struct {
  nmt_ring full, free;
  nmt__msg pool[NMT__MSG_POOL];
  float *params, *m, *v; /* snapshot for the checkpoint writer */
  atomic_int busy;       /* the writer has not finished with the snapshot */
} nmt__mailbox;

struct nmt_trainer {
  nmt_config cfg;
  nmt_trainer_options opt;
  nmt_model_cfg mcfg;
  const nmt_backend *be;
  size_t n_params;
  int n_dev, accum;       /* n_dev: this process's workers; world.world: all processes' */
  nmt__world world;
  nmt_bucket_plan plan;   /* the gradient buffer's buckets, the same on every rank */
  double bucket_mb_resumed; /* bucket_mb = auto: the resumed checkpoint's choice (0: none) */

  nmt_shard *train_shard, *valid_shard;
  nmt_batcher *train_batcher, *valid_batcher;
  size_t batch_ints;      /* int32s in one batch buffer (nmt_batch_layout's 5 arrays) */

  nmt__worker *workers;   /* n_dev */
  nmt_comm **comms;       /* n_dev */
  nmt__loader *loaders;   /* n_loaders */
  int n_loaders;

  float *init_params, *init_m, *init_v; /* host: initial or resumed state */
  float *final_params;    /* host: rank 0's parameters after the last segment */
  nmt__position pos;
  nmt__sync sync;
  nmt__rundir dir;
  nmt__mailbox mail;
  nmt_ckpt_meta ckpt_meta; /* what every checkpoint embeds: config, SentencePiece model */
  nmt__valid_bleu_setup vbleu; /* train.valid_bleu */
  double t_start;
  double eval_out[NMT_GRAD_EXTRA]; /* nmt_trainer_evaluate: rank 0's reduced slots */

  nmt_prof *prof;         /* profile.*: NVTX ranges, the sampled window, trace and table */
  nmt_prof_track *main_track;
  nmt__range_names rn;
  double peak_flops;      /* one device's peak FLOP/s for MFU: profile.peak_tflops or measured */
  double peak_gbps;       /* one device's memory bandwidth (GB/s) for the profile table */

  struct sigaction old_actions[3]; /* handlers replaced by handle_signals, restored by destroy */
  int handlers_installed;
  /* on_signal: the pending stop came from SIGINT/SIGTERM (a second one aborts); the run was
   * aborted that way (fail_run says so instead of blaming a rank). */
  int stop_by_user, user_aborted;
};

/* trainer.c: the first error wins (it is what the run returns); later ones are usually
 * ABORTED echoes. Raises abort and shutdown. rank -1 = the main thread. */
void nmt__record_error(nmt_trainer *t, int rank, nmt_status s);
double nmt__now_s(void);

/* loader.c */
void *nmt__loader_main(void *arg);
/* data.loader_threads, but no more than one per worker (each worker's ring has one producer)
 * and no more than a Slurm allocation's CPUs (SLURM_CPUS_PER_TASK). */
int nmt__loader_threads(const nmt_config *cfg);

/* replica.c: one worker's device state, and its teardown (safe on a partial setup). */
nmt_status nmt__replica_setup(nmt_trainer *t, nmt__worker *w);
void nmt__replica_free(nmt_trainer *t, nmt__worker *w);
/* NMT_ERR_NOMEM naming the batch that did not fit, keeping the allocator's message. */
nmt_status nmt__batch_nomem(const nmt_trainer *t, int rank, const char *what);

/* worker.c */
void *nmt__worker_main(void *arg);
void *nmt__eval_main(void *arg);
/* The validation loss slots of this rank's share of the valid set, all-reduced. */
nmt_status nmt__validate(nmt__worker *w, double out[NMT_GRAD_EXTRA]);
/* A checkpoint header for the trainer's model at this position and scaler state. */
void nmt__ckpt_header(const nmt_trainer *t, const nmt__loss_scaler *ls, long step, long epoch,
                      long index, nmt_ckpt_header *h);

/* zero.c: ZeRO's optimizer step after the buckets were reduce-scattered (norm from the shards,
 * step_decide, AdamW on the owned slices, all-gather of the updated weights), and the copies
 * between a rank's shard of the moments and consolidated host arrays (checkpoints). */
nmt_status nmt__zero_update(nmt__worker *w, long step, float lr, nmt_step_policy policy);
nmt_status nmt__zero_load_moments(nmt__worker *w, const float *host_m, const float *host_v);
nmt_status nmt__zero_save_moments(nmt__worker *w, float *host_m, float *host_v);
/* Stage 2 (tests' keep_last_grads): the rank's reduced gradient slices at their parameter
 * offsets of host (n_params floats, zero elsewhere), then the trailing slots. */
nmt_status nmt__zero_copy_grads(nmt__worker *w, float *host);
/* 1 when stage-2 plan p's parameter all-gather can run in place with one flush: every bucket
 * but the last spans (n_ranks slices from its first parameter) no further than n_params.
 * Else (an embedding smaller than a bucket's pad) each bucket goes through a window with a
 * flush of its own. 0 for a plan of another stage. */
int nmt__zero_gathers_in_place(const nmt_bucket_plan *p);

/* world.c: the world from parallel.* and Slurm's environment; and the check, through the
 * rendezvous store under `prefix`, that every node runs the same config from the same step
 * (NMT_ERR_CONFIG naming the first differing key; NMT_ERR_ABORTED naming a node that did not
 * arrive within parallel.timeout_s). */
nmt_status nmt__world_resolve(const nmt_config *cfg, nmt__world *w);
nmt_status nmt__world_agree(nmt_trainer *t, const char *prefix);

/* valid.c: the validation keys checked against each other and the data (NMT_ERR_CONFIG naming
 * them), and train.valid_bleu's raw text, SentencePiece model and a trial run of sacreBLEU
 * (NMT_ERR_DATA / NMT_ERR_IO naming the files) in global rank 0's process; its teardown
 * (closes the decoder too). */
nmt_status nmt__valid_setup(nmt_trainer *t);
void nmt__valid_free(nmt_trainer *t);
/* train.valid_bleu, global rank 0's process: opens the decoder rig (t->vbleu.rig) on t->be's
 * rank-0 device with t->init_params and the run's abort flag, and sizes its buffers for the
 * valid source's longest line, so that validations allocate nothing. Call once, at create,
 * after nmt__valid_setup and before the communicator exists (no collective can be in flight);
 * a no-op elsewhere. Errors: nmt__rig_open_on's and nmt__rig_reserve's. */
nmt_status nmt__valid_open(nmt_trainer *t);
/* Rank 0 decodes the valid source with its parameters on the rig nmt__valid_open opened and
 * scores BLEU and chrF2; every rank gets the two numbers through an all-reduce (the others
 * wait there meanwhile). NMT_ERR_ABORTED when the run's abort flag is raised (also while
 * decoding). */
nmt_status nmt__valid_bleu(nmt__worker *w, nmt__valid_result *v);
/* Updates *b with validation v at step `step` (v->improved says whether it improved) and
 * returns 1 when train.patience validations in a row have not improved: the run ends here. */
int nmt__best_update(const nmt_config *cfg, nmt__best *b, long step, nmt__valid_result *v);
/* 1 when b has already used up train.patience (a resumed run that had stopped early). */
int nmt__best_exhausted(const nmt_config *cfg, const nmt__best *b);
/* The early-stopping sentence for logs and status.json, into buf. */
void nmt__best_reason(const nmt_config *cfg, const nmt__best *b, long step, char *buf,
                      size_t cap);
/* The resumed checkpoint's best validation into t->pos.best0 (another metric: starts anew). */
void nmt__best_resume(nmt_trainer *t, const nmt_ckpt_header *h);

/* warmup.c: on a device backend (not is_host, unless `force`: tests), every worker runs
 * forward + backward over two synthetic micro-batches of the run's config (the longest shape
 * data.max_tokens / data.max_len allow, and a short one) in the run's precision, with dropout
 * and no optimizer step and no collective, then waits for its device (abort-aware): the first
 * launch of the GEMM algorithms a step is likely to use (cuBLASLt loads each one's kernel
 * lazily, and a load may wait for the whole context) happens here rather than behind step
 * 1's gradient collectives. Call once the replicas exist and before the communicator does.
 * Leaves parameters, moments, the half copy, the control block, dropout streams and the
 * profiler track as it found them and the gradient buffer (and ZeRO-2 windows) zero; counts
 * logs one info line with its duration, shapes and workers. Errors:
 * NMT_ERR_NOMEM (the host batch), the model's and the backend's (NMT_ERR_ABORTED from the
 * wait). */
nmt_status nmt__warmup(nmt_trainer *t, int force);

/* warmup.c, for bucket_auto.c: on worker 0, an untimed then a timed forward + backward of the
 * longest warm-up shape, the flat gradient buffer's grad-ready events going to ready(user,
 * floats); every phase waited for (abort-aware). *t0_s: the timed forward's start
 * (nmt__now_s), *fwd_ms its length, *compute_ms forward + backward. Leaves the state as
 * nmt__warmup does. Errors: NMT_ERR_INTERNAL (ZeRO stage 2), NMT_ERR_NOMEM, the model's, the
 * backend's and the callback's. */
nmt_status nmt__warmup_time_backward(nmt_trainer *t, nmt_grad_ready_fn ready, void *user,
                                     double *t0_s, double *fwd_ms, double *compute_ms);

/* bucket_auto.c: parallel.bucket_mb = auto (docs/scaling.md). The size the plan is cut at
 * before the choice: the config's, or under auto the smallest candidate (the most buckets, so
 * every per-bucket capacity sized from it holds the chosen plan; the floats do not depend on
 * the size). */
double nmt__bucket_auto_provisional_mb(const nmt_config *cfg);
/* Under auto: takes the resumed checkpoint's config text (its [parallel] bucket_mb) as the
 * choice, so the resumed run cuts the same buckets. No-op otherwise. */
void nmt__bucket_auto_resumed(nmt_trainer *t, const char *config_text);
/* Under auto, once the communicator is bound and before the buckets' names and the wire's
 * reservation: measures and chooses (or takes the resumed choice), re-cuts t->plan, writes the
 * size into t->cfg, the checkpoints' config and config.ini, and logs why. No-op for a set
 * size. Errors: the probes' (backend, communicator: NMT_ERR_ABORTED), the rendezvous' (several
 * nodes), NMT_ERR_IO (config.ini). */
nmt_status nmt__bucket_auto(nmt_trainer *t);

/* estimate.c: on CPU workers with a known peak, logs the least time a step and n_steps can
 * take (mean step FLOPs / one worker's peak), as a warning when a step needs a minute or
 * more. */
void nmt__log_step_estimate(const nmt_trainer *t, long n_steps);

/* rundir.c */
nmt_status nmt__mkdir_p(const char *path);
/* Claims run.out_dir for this process before anything is written there: creates it, locks it
 * (run.lock, node k > 0: run.node<k>.lock; held until nmt__rundir_release), and unless
 * run.resume refuses a directory holding a previous run's work (checkpoints, metrics records,
 * a status.json past step 0) or, with t->opt.overwrite, deletes that run's checkpoint files.
 * Sets t->dir.ckpt_dir, and t->dir.out_dir_made once the directory is this run's.
 * Errors: NMT_ERR_CONFIG (locked by another process, naming its pid, host and start time; a
 * previous run there, naming what it left and --resume, a fresh run.out_dir and --overwrite;
 * run.resume with overwrite), NMT_ERR_IO (cannot create, lock, or delete). */
nmt_status nmt__rundir_claim(nmt_trainer *t);
/* Releases the lock nmt__rundir_claim took (a no-op when none is held). */
void nmt__rundir_release(nmt_trainer *t);
/* Writes run.out_dir/config.ini and opens metrics.jsonl (appending when resuming). */
nmt_status nmt__rundir_open(nmt_trainer *t);
/* (Re)writes run.out_dir/config.ini from t->cfg (node 0 only). Errors: NMT_ERR_IO. */
nmt_status nmt__rundir_write_config(nmt_trainer *t);
/* Replaces run.out_dir/status.json atomically; a failure only warns. */
void nmt__write_status(nmt_trainer *t, const char *state, nmt_status s, const char *error);
/* One metrics record: metrics.jsonl, the progress line, the callback. */
void nmt__write_metrics(nmt_trainer *t, const nmt_metrics *m);
/* On a terminal, redraws the progress line when it is 2 s old, from steps_done and the last
 * metrics record (main's serving loop calls it every tick). */
void nmt__progress_tick(nmt_trainer *t);
/* trace.json and the per-module table after a segment that reached the profile window. */
void nmt__write_profile(nmt_trainer *t);
/* Removes temp files a killed writer left in dir; whether dir holds any checkpoint file. */
void nmt__remove_stale_temps(const char *dir);
int nmt__has_checkpoints(const char *dir);

#endif /* NMT_ENGINE_RUN_H */
