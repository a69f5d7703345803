/* nmt/trainer.h — the training engine: threads, steps, accumulation, buckets, checkpoints.
 *
 * One process. The calling thread is the "main" thread of DESIGN.md: nmt_trainer_run starts
 * one loader thread and one worker thread per device, then serves (drains the metrics ring,
 * writes metrics.jsonl and status lines, writes the checkpoints worker 0 hands over, watches
 * for errors and stop requests) and joins. Workers own their model replica, flat parameter,
 * gradient and Adam buffers; they meet only in the communicator's collectives. Per optimizer
 * step, each worker runs train.accum_steps micro-batches; only the last one reduces gradients,
 * bucket by bucket as backward finalises them (DDP's no_sync for the others). The loss and the
 * target-token count ride in the gradient buffer's trailing slots, so the update divides by the
 * global token count without any extra collective.
 *
 * The batches of one optimizer step are the next devices*accum_steps batches of the epoch
 * order; they are dealt to workers so token counts balance, and each batch's dropout stream is
 * keyed by its index in that list, so (devices, accum_steps) = (4,1), (2,2) and (1,4) compute
 * the same update.
 *
 * The main thread also keeps run.out_dir/status.json for schedulers to poll: replaced
 * atomically (temp file + rename) when a segment starts, at every metrics record, after every
 * checkpoint and at the end; README.md "Embedding, schedulers and faults" lists its fields.
 *
 * defines: nmt_trainer, nmt_trainer_options, nmt_trainer_create, nmt_trainer_run,
 *          nmt_trainer_train, nmt_trainer_evaluate, nmt_trainer_save,
 *          nmt_trainer_request_stop, nmt_trainer_step, nmt_trainer_end_step,
 *          nmt_trainer_params, nmt_trainer_destroy, nmt_trainer_memory
 * (the learning-rate schedule, nmt_lr_at, is the model's: nmt/model.h)
 */
#ifndef NMT_TRAINER_H
#define NMT_TRAINER_H

#include <stddef.h>
#include <stdint.h>

#include "nmt/config.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nmt_trainer nmt_trainer;

/* One metrics record, emitted every train.log_every steps, after validation, and at the end. */
typedef struct {
  long step;            /* optimizer steps completed */
  long epoch;           /* the pass over the training data (from 1) that the step's last
                           batch belongs to; checkpoints hold the 0-based position */
  double train_loss;    /* label-smoothed loss per target token over the interval (nats) */
  double train_nll;     /* unsmoothed NLL per target token over the interval (nats) */
  double lr;            /* learning rate of the last step */
  double grad_norm;     /* global L2 norm of the last step's normalised gradient (before clip;
                           inf/NaN when the step overflowed and was skipped) */
  double loss_scale;    /* fp16 dynamic loss scale after the last step (1 in other modes) */
  long skipped_steps;   /* steps skipped on fp16 overflow since the run began */
  double mfu;           /* model FLOPs utilisation over the interval, a fraction: model FLOPs/s
                           (bench/README.md "model FLOPs", padded shapes, all devices) /
                           (devices x one device's peak FLOP/s); NAN when no peak is known */
  double peak_mem_mb;   /* peak memory so far, MiB (CPU: process peak RSS; NAN if unknown) */
  double tgt_tokens_per_s; /* target tokens per second over the interval, all devices */
  double step_ms;       /* wall time per optimizer step over the interval */
  double tgt_tokens;    /* target tokens in the interval, all devices */
  int has_valid;        /* 1 if the next three are set */
  double valid_loss;    /* label-smoothed, per target token */
  double valid_nll;
  double valid_ppl;     /* exp(valid_nll) */
  int has_bleu;         /* 1 if the next two are set (train.valid_bleu, at validations) */
  double valid_bleu;    /* sacreBLEU corpus BLEU of the decoded valid source, 0..100 */
  double valid_chrf;    /* sacreBLEU chrF2, 0..100 */
  long best_step;       /* step of the best validation so far by train.best_metric; 0 = none */
  double best_value;    /* its value */
  long best_bad;        /* validations since best_step without improvement (train.patience) */
  int improved;         /* this record's validation is the new best (checkpoint written) */
} nmt_metrics;

typedef void (*nmt_metrics_fn)(void *user, const nmt_metrics *m);

typedef struct {
  size_t size;              /* sizeof(nmt_trainer_options): extensible like ncclConfig_t */
  int handle_signals;       /* 1: create installs handlers for SIGINT/SIGTERM/SIGUSR1 (destroy
                               restores the old ones): a signal requests a stop after the
                               current step, a second SIGINT (or SIGTERM after one) 1 s or
                               more after the first aborts (sooner: a copy of the first, as
                               GNU timeout sends); the CLI sets this.
                               Signals the caller blocks are taken by sigtimedwait instead. */
  int quiet;                /* 1: no progress lines on stderr */
  nmt_metrics_fn on_metrics;/* optional callback on the main thread */
  void *user;
  int fail_rank;            /* testing: this rank fails at fail_step (-1 = never) */
  long fail_step;
  int fail_bucket;          /* testing: >= 0: instead of at the step's start, fail_rank fails
                               inside step fail_step's gradient collectives, on reaching this
                               bucket (its peers are waiting in that collective); -1 = off */
  int keep_last_grads;       /* testing: copy every step's reduced gradient to the host for
                               nmt_trainer_last_grads (a full D2H copy per step: off by default) */
  long nan_from_step;       /* testing: from this 0-based step on, every rank's reduced
                               gradient holds a NaN, as an fp16 overflow would (-1 = never) */
  long nan_steps;           /* testing: for this many steps (0 = every step from then on) */
  int step_delay_ms;        /* testing: every worker sleeps this long in each step, between
                               its last micro-batch's forward and backward (on CPU workers,
                               inside that step's time); 0 = off */
  int valid_delay_ms;       /* testing: every worker sleeps this long in each validation
                               (time the metrics records leave out); 0 = off */
  int lagged_reads;         /* testing: on CPU workers, read each step's control block while
                               the next step is enqueued, as device workers do (0, the
                               default there: a CPU worker's enqueue has already run the step,
                               so its block is read at once and a stop request ends the run
                               one step sooner); device workers always read late */
  int overwrite;            /* 1: a previous run in run.out_dir (checkpoints, metrics records,
                               a status.json past step 0) is discarded: its checkpoint files
                               are deleted. 0: create refuses such a directory unless
                               run.resume (NMT_ERR_CONFIG naming --resume and --overwrite). */
} nmt_trainer_options;

/* Options with every field at its default (no signals, no callback, no injected failure). */
void nmt_trainer_options_default(nmt_trainer_options *o);

/* Validates the config against the data (opens shards, vocab must match model.vocab), builds
 * the batchers, creates the run directory with config.ini, initialises parameters from
 * run.seed or, with run.resume, loads the newest valid checkpoint of run.out_dir/checkpoints
 * (none there: starts at step 0; files there but none valid, another model shape, or the
 * newest holds parameters only, without Adam moments: NMT_ERR_CHECKPOINT). The run directory
 * is locked (run.lock; node k > 0 of a multi-node run: run.node<k>.lock) until destroy: a
 * directory another live process trains in is refused (NMT_ERR_CONFIG naming its pid, host and
 * start time), and so is one that holds a previous run when neither run.resume nor
 * opt->overwrite is set. On failure after the run directory is claimed, status.json says
 * "failed" (a refused directory's status.json is left as it was).
 * Errors: NMT_ERR_CONFIG, NMT_ERR_DATA, NMT_ERR_IO, NMT_ERR_CHECKPOINT, NMT_ERR_DEVICE
 * (parallel.device = cuda in a build or machine without CUDA), NMT_ERR_NOMEM (the message
 * names data.max_tokens when activations or batch buffers do not fit). */
nmt_status nmt_trainer_create(const nmt_config *cfg, const nmt_trainer_options *opt,
                              nmt_trainer **out);

/* Trains until train.max_steps optimizer steps are done, early stopping ends the run or a stop
 * is requested; writes the final checkpoint. Returns NMT_OK when max_steps was reached or
 * train.patience validations in a row did not improve train.best_metric (logged with the
 * reason; nmt_trainer_end_step then tells the step), NMT_STOPPED after a requested stop (a
 * checkpoint of the last completed step is written), or the first worker error (the others
 * were aborted and joined). Same as nmt_trainer_train(t, 0). */
nmt_status nmt_trainer_run(nmt_trainer *t);

/* Trains at most n_steps more optimizer steps (n_steps <= 0: until train.max_steps), then
 * joins every thread and returns; the replicas keep their state, so a later call continues
 * exactly where this one ended (bitwise the same as one call: dropout streams and the data
 * position are keyed by the global step). A checkpoint is written at train.save_every steps and
 * at train.max_steps, not at the end of a shorter segment (nmt_trainer_save does that).
 * Returns NMT_OK when the segment's last step is done or early stopping ended training
 * (nmt_trainer_step == nmt_trainer_end_step tells whether training is finished; a call after
 * that trains nothing), NMT_STOPPED after a stop request (checkpoint written; the request is then
 * consumed, so a later call trains again), or the first error; after an error the trainer only
 * returns that error again. Not reentrant: one call at a time, from one thread. */
nmt_status nmt_trainer_train(nmt_trainer *t, long n_steps);

/* Validation loss of the current parameters over the whole [data] valid shard, computed by all
 * workers on disjoint batches and all-reduced, without dropout. Outputs (any may be NULL):
 * label-smoothed loss and NLL per target token (nats), and the number of target tokens.
 * Errors: NMT_ERR_CONFIG if [data] valid is empty, worker errors. Not while training. */
nmt_status nmt_trainer_evaluate(nmt_trainer *t, double *loss, double *nll, double *tokens);

/* Writes a checkpoint of the current state (step nmt_trainer_step) to
 * run.out_dir/checkpoints/step_N.ckpt and points `latest` at it (checkpoint.keep applies).
 * path_out (may be NULL) receives the file name; it has room for 1024 chars.
 * Errors: NMT_ERR_IO. Not while training. */
nmt_status nmt_trainer_save(nmt_trainer *t, char *path_out);

/* Asks the run to stop after the current step (thread-safe, async-signal-safe). */
void nmt_trainer_request_stop(nmt_trainer *t);

/* Optimizer steps completed so far. */
long nmt_trainer_step(const nmt_trainer *t);
/* The step training ends at: train.max_steps, or the step where early stopping (train.patience)
 * ended it. Training is finished when nmt_trainer_step reaches it. */
long nmt_trainer_end_step(const nmt_trainer *t);
/* Rank 0's parameters after the run (host memory, n floats written to *n). */
const float *nmt_trainer_params(const nmt_trainer *t, size_t *n);
/* Bytes worker `rank` allocated for its gradients (with the trailing slots) and for its Adam
 * moments (m and v): the replicated sizes with parallel.zero = 0, the shard's with ZeRO
 * (Rajbhandari et al. 2020: optimizer state / N). NMT_ERR_USAGE for a rank out of range. */
nmt_status nmt_trainer_memory(const nmt_trainer *t, int rank, size_t *grad_bytes,
                              size_t *optim_bytes);

/* Rank r's reduced, unnormalised gradient of the last step (n_params + NMT_GRAD_EXTRA floats;
 * for tests of the multi-worker equivalences). NULL unless options.keep_last_grads. */
const float *nmt_trainer_last_grads(const nmt_trainer *t, int rank, size_t *n);
/* The last metrics record. */
const nmt_metrics *nmt_trainer_last_metrics(const nmt_trainer *t);
void nmt_trainer_destroy(nmt_trainer *t);

#ifdef __cplusplus
}
#endif
#endif /* NMT_TRAINER_H */
