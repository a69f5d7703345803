/* run.h — one training run as the main thread holds it (src/engine/, not public):
 * struct nmt_trainer, and the rooms that work on the whole of it at create and between
 * segments, all on the main thread.
 *
 * The engine is one room per thread kind and concern; each thread kind gets a struct of its
 * own with only what it needs from the run, and shares with the others only what its struct
 * names:
 *   trainer.c  — create / train / evaluate / save / destroy and the main thread's serving
 *                loop (what include/nmt/trainer.h promises);
 *   loader.c   — the loader threads: each step's batches, dealt to the workers (loader.h);
 *   worker.c   — a worker thread's step loop and the host's end of a step (worker.h);
 *   replica.c  — one worker's device state (replica.h); zero.c — ZeRO's step on it (zero.h);
 *   buckets.c  — which gradient slices are reduced when, in which wire type (nmt/buckets.h);
 *   valid.c    — validation BLEU, the best validation and early stopping (valid.h);
 *   preflight.c — at create, before any step: what the run needs later (preflight.h);
 *   sync.c     — the flags and the error record every thread shares (sync.h);
 *   signals.c  — the stop signals (signals.h); resume.c — run.resume;
 *   rundir.c   — run.out_dir: config.ini, metrics.jsonl, status.json, the lock;
 *   world.c    — several processes: ranks, the start check; warmup.c, estimate.c — create's
 *                GEMM warm-up and the step-time estimate.
 * Every arrow between these files points down (tools/check-layout: no circle of files): the
 * thread rooms never call back into trainer.c, and what they share lives below them.
 * Fields written by main between segments are read-only while threads run; the sync.h atomics
 * are the only state written by several threads at once.
 *
 * defines: nmt__world, nmt__rundir, struct nmt_trainer, and the main thread's rooms' functions
 *          (world.c, resume.c, warmup.c, estimate.c, rundir.c)
 */
#ifndef NMT_ENGINE_RUN_H
#define NMT_ENGINE_RUN_H

#include <stdio.h>

#include "loader.h"
#include "nmt/backend.h"
#include "nmt/buckets.h"
#include "nmt/checkpoint.h"
#include "nmt/comm.h"
#include "nmt/data.h"
#include "nmt/model.h"
#include "nmt/prof.h"
#include "nmt/tensorboard.h"
#include "nmt/trainer.h"
#include "replica.h"
#include "signals.h"
#include "sync.h"
#include "valid.h"
#include "worker.h"

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

/* run.out_dir and what main writes there (rundir.c). */
typedef struct {
  char ckpt_dir[NMT_PATH_MAX + 16];
  char last_ckpt[1024];  /* path of the newest checkpoint written or loaded ("" if none) */
  int out_dir_made;      /* run.out_dir is claimed (nmt__rundir_claim): status.json can be
                            written */
  int keep_status;       /* --resume on a run whose status.json is past step 0: a setup that
                            fails leaves it (it describes the run, which this one never
                            started) */
  int locked, lock_fd;   /* run.lock (node k: run.node<k>.lock) is held through lock_fd */
  const char *state;     /* the last state written to status.json */
  FILE *metrics_file;
  int metrics_failed;    /* a metrics.jsonl write failed: warned once (nmt__write_metrics) */
  nmt_tb_writer *tb;     /* run.out_dir/tb/'s event file (run.tensorboard); NULL: none */
  nmt_metrics last_metrics;
  double last_valid_loss; /* NAN until a validation ran */
  double last_valid_bleu; /* NAN until a validation with train.valid_bleu ran */
  nmt__best best;         /* the best validation as main last heard of it */
  char reason[512];       /* why the run is done or stopped (status.json "reason"); "" none */
  double progress_s;      /* when the progress line was last drawn (nmt_clock_now_s) */
} nmt__rundir;

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
  nmt__feed *feeds;       /* n_dev: worker r's rings with the loaders */
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
  nmt_ckpt_header ckpt_base; /* the fields every checkpoint header of the run repeats */
  nmt__valid_bleu_setup vbleu; /* train.valid_bleu */

  nmt_prof *prof;         /* profile.*: NVTX ranges, the sampled window, trace and table */
  nmt_prof_track *main_track;
  nmt__range_names rn;
  double peak_flops;      /* one device's peak FLOP/s for MFU: profile.peak_tflops or measured */
  double peak_gbps;       /* one device's memory bandwidth (GB/s) for the profile table */

  nmt__signals signals;    /* SIGINT, SIGTERM, SIGUSR1 (options.handle_signals) */
};

/* world.c: the world from parallel.* and Slurm's environment; and the check, through the
 * rendezvous store under `prefix`, that every node runs the same config from the same step
 * (NMT_ERR_CONFIG naming the first differing key; NMT_ERR_ABORTED naming a node that did not
 * arrive within parallel.timeout_s). */
nmt_status nmt__world_resolve(const nmt_config *cfg, nmt__world *w);
nmt_status nmt__world_agree(nmt_trainer *t, const char *prefix);
/* world.c, at destroy: node 0 removes the rendezvous directory named after the Slurm job when
 * the run trained and did not fail (parallel.rendezvous set by hand is the user's). */
void nmt__world_release(nmt_trainer *t);

/* resume.c: run.resume's initial state from the newest valid checkpoint of t->dir.ckpt_dir
 * (temp files a killed writer left removed first): parameters and moments into t->init_*,
 * step, data position (nmt_ckpt_data_resume), loss scaler and best validation into t->pos,
 * its path into t->dir.last_ckpt. No checkpoint file: logs it, changes nothing, NMT_OK.
 * Errors: NMT_ERR_CHECKPOINT (checkpoint files but none valid; parameters without moments),
 * nmt_ckpt_read's and nmt_ckpt_read_meta's. */
nmt_status nmt__resume(nmt_trainer *t);

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
 * (nmt_clock_now_s), *fwd_ms its length, *compute_ms forward + backward. Leaves the state as
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
/* Writes run.out_dir/config.ini from t->cfg and opens metrics.jsonl (appending when
 * resuming) and, with run.tensorboard, a new event file in run.out_dir/tb/ (a start from step
 * 0 deletes the old ones, as it rewrites metrics.jsonl); node 0 only. Called last in setup, once the run is accepted: a setup that fails
 * leaves the previous files as they were. Errors: NMT_ERR_IO. */
nmt_status nmt__rundir_open(nmt_trainer *t);
/* Replaces run.out_dir/status.json atomically; a failure only warns. */
void nmt__write_status(nmt_trainer *t, const char *state, nmt_status s, const char *error);
/* One metrics record: metrics.jsonl, the TensorBoard scalars, the progress line, the
 * callback. */
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
