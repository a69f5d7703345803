/* nmt/nmt.h — libnmt's public C API: train the Transformer from an INI config inside another
 * program (a lab scheduler's agent, a notebook kernel, a hyper-parameter search).
 *
 * A session is one training run: nmt_session_open loads the config (a file, or with
 * nmt_session_open_files several, + "section.key=value" overrides, exactly as `nmt train`
 * takes them), validates it against the data and sets up the workers; nmt_session_train
 * runs N optimizer steps or until train.max_steps; evaluate, save and request_stop do what
 * they say; nmt_session_close frees everything. `nmt train` is a
 * thin client of these calls (src/main.c), and tools/embed_example.c is a complete example.
 *
 * Every call returns an nmt_status (nmt_status_str gives its name, nmt_status_desc a phrase,
 * nmt_status_exit_code the process exit code the CLI would use); on an error,
 * nmt_last_error() on the calling thread holds a message naming the file, key, value or size
 * involved. The run directory (run.out_dir) holds config.ini, metrics.jsonl, checkpoints/ and
 * status.json (README.md "Embedding, schedulers and faults").
 *
 * Threads: the calling thread is the trainer's main thread while nmt_session_train or
 * nmt_session_evaluate runs (callbacks run on it); the library starts and joins its own loader
 * and worker threads inside those calls, so none runs between calls. One call at a time per
 * session; nmt_session_request_stop may be called from any thread or a signal handler.
 *
 * defines: nmt_session, nmt_session_options, nmt_session_options_default, nmt_session_open,
 *          nmt_session_open_files, nmt_session_train, nmt_session_evaluate, nmt_session_save,
 *          nmt_session_request_stop, nmt_session_progress, nmt_session_params,
 *          nmt_session_close
 */
#ifndef NMT_NMT_H
#define NMT_NMT_H

#include <stddef.h>

#include "nmt/log.h"
#include "nmt/status.h"
#include "nmt/trainer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nmt_session nmt_session;

typedef struct {
  size_t size;               /* sizeof(nmt_session_options); set by nmt_session_options_default
                                (lets later versions append fields, like ncclConfig_t) */
  int resume;                /* 1: continue from the newest valid checkpoint (run.resume = true) */
  int handle_signals;        /* 1: SIGINT, SIGTERM and SIGUSR1 finish the current step, write a
                                checkpoint and make train return NMT_STOPPED; a second SIGINT
                                (or SIGTERM after one), 1 s or more after the first, aborts
                                (NMT_ERR_ABORTED; sooner it is a copy of the first). open
                                installs handlers for the three (they only count the signal
                                and note its arrival, so any thread may take it) and
                                close restores the program's; a signal between train calls
                                stops the next call after its first step. One session at a
                                time may set this. */
  int quiet;                 /* 1: no progress line per log interval */
  nmt_metrics_fn on_metrics; /* every train.log_every steps, after validation and at the end */
  nmt_log_fn on_log;         /* log lines go here instead of stderr; the log is process-wide,
                                so at most one open session should set it */
  void *user;                /* passed to both callbacks */
  long inject_nan_step;      /* testing: from this 0-based step on, the reduced gradient holds
                                a NaN (what an fp16 overflow looks like); -1 = never */
  int overwrite;             /* 1: discard a previous run in run.out_dir (nmt train --overwrite);
                                0: open refuses a run.out_dir that holds one unless resuming */
} nmt_session_options;

/* Fills *o with the defaults: no resume, no signal handling, progress lines on, no callbacks.
 * Errors: NMT_ERR_USAGE if o is NULL. */
nmt_status nmt_session_options_default(nmt_session_options *o);

/* Loads ini_path (NULL: schema defaults only), applies n_overrides "section.key=value" strings,
 * expands `{job}` in run.out_dir (SLURM_JOB_ID, see README), validates, opens the shards,
 * creates and locks run.out_dir (until close), creates the workers, and loads the newest valid
 * checkpoint if resuming (nmt_trainer_create). opt may be NULL (defaults). Errors:
 * NMT_ERR_USAGE (NULL arguments, opt->size too small), NMT_ERR_CONFIG (also: run.out_dir is
 * locked by another live training, or holds a previous run and neither resume nor overwrite
 * is set), NMT_ERR_DATA, NMT_ERR_IO, NMT_ERR_CHECKPOINT (every checkpoint damaged, the newest
 * has another model shape or no Adam moments), NMT_ERR_NOMEM (naming data.max_tokens),
 * NMT_ERR_DEVICE. */
nmt_status nmt_session_open(const char *ini_path, const char *const *overrides, int n_overrides,
                            const nmt_session_options *opt, nmt_session **out);

/* nmt_session_open over several INI files (`nmt train conf/bible-small.ini data/x/data.ini`):
 * paths[0..n_paths) apply in order, a later file's value of a key replacing an earlier one's,
 * then the overrides; only the value that takes effect is parsed (nmt_config_load_files,
 * nmt/config.h). An error in a value names the file that holds it, a cross-key error every
 * source ("a.ini + b.ini + command line"). run.out_dir/config.ini holds the merged config, so
 * it alone resumes the run. nmt_session_open(p, ...) is this with the one file p (none when p
 * is NULL); n_paths = 0: schema defaults and overrides. Errors: those of nmt_session_open;
 * NMT_ERR_USAGE also for n_paths < 0, paths NULL with n_paths > 0, or a NULL path;
 * NMT_ERR_CONFIG naming a file that is missing, unreadable or not an INI config. */
nmt_status nmt_session_open_files(const char *const *paths, int n_paths,
                                  const char *const *overrides, int n_overrides,
                                  const nmt_session_options *opt, nmt_session **out);

/* Trains n_steps more optimizer steps, or until train.max_steps if n_steps <= 0 (or fewer
 * remain). Calls in sequence give bitwise the same parameters as one call. Returns NMT_OK when
 * the steps are done or early stopping (train.patience) ended training; nmt_session_progress
 * tells whether training is finished (then a later call trains nothing). NMT_STOPPED
 * after a stop request or signal (a checkpoint of the last step was written; a later call
 * trains on), NMT_ERR_DIVERGED on a non-finite gradient norm, or another error, after which the
 * session only returns that error again and should be closed. */
nmt_status nmt_session_train(nmt_session *s, long n_steps);

/* Validation loss over the whole [data] valid shard with the current parameters (no dropout):
 * label-smoothed loss and plain NLL per target token, in nats (either pointer may be NULL;
 * perplexity is exp(nll)). Errors: NMT_ERR_CONFIG if [data] valid is empty; worker errors. */
nmt_status nmt_session_evaluate(nmt_session *s, double *valid_loss, double *valid_nll);

/* Writes a checkpoint of the current step to run.out_dir/checkpoints/step_N.ckpt (atomic) and
 * points `latest` at it; its path goes to path_out (cap bytes; may be NULL).
 * Errors: NMT_ERR_IO, NMT_ERR_USAGE if cap is too small for the path. */
nmt_status nmt_session_save(nmt_session *s, char *path_out, size_t cap);

/* Asks a running nmt_session_train to stop after the current step, or the next call to stop
 * after its first step. Async-signal-safe. Errors: NMT_ERR_USAGE if s is NULL. */
nmt_status nmt_session_request_stop(nmt_session *s);

/* Optimizer steps completed and the step training ends at (either pointer may be NULL):
 * train.max_steps, or, once early stopping (train.patience) ended the run, that step; training
 * is finished when the two are equal. */
nmt_status nmt_session_progress(const nmt_session *s, long *step, long *max_steps);

/* The parameters after the last train call (host fp32, flat layout of nmt/model.h), valid
 * until the next call on s. */
nmt_status nmt_session_params(const nmt_session *s, const float **params, size_t *n);

/* Frees the session (no threads are running between calls), removes its log callback and
 * restores the signal mask open changed. NULL is fine. */
nmt_status nmt_session_close(nmt_session *s);

#ifdef __cplusplus
}
#endif
#endif /* NMT_NMT_H */
