/* valid.h — what a validation decides beyond its loss (src/engine/, not public; valid.c):
 * validation BLEU on global rank 0 (train.valid_bleu), the best validation so far
 * (train.best_metric, checkpoints/best) and early stopping (train.patience). Its functions
 * take the config, a replica or the BLEU setup, never the trainer.
 *
 * defines: nmt__best, nmt__valid_result, nmt__valid_bleu_setup, nmt__valid_setup,
 *          nmt__valid_open, nmt__valid_free, nmt__valid_bleu, nmt__best_update,
 *          nmt__best_exhausted, nmt__best_reason, nmt__best_resume
 */
#ifndef NMT_ENGINE_VALID_H
#define NMT_ENGINE_VALID_H

#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/spm.h"
#include "replica.h"
#include "translate_impl.h"

/* The best validation so far and the patience count (train.best_metric, train.patience).
 * Every rank keeps its own copy and updates it from the same reduced numbers, so every rank
 * decides to stop early at the same step without another collective. Checkpoints carry it
 * (nmt_ckpt_header's best_*), so a resumed run continues the count. */
typedef struct {
  nmt_valid_metric metric; /* train.best_metric */
  long step;               /* step of the best validation; 0 = none yet */
  double value;            /* its metric value */
  long bad;                /* validations since `step` that did not improve on it */
} nmt__best;

/* One validation's results, the same on every rank. */
typedef struct {
  double x[NMT_GRAD_EXTRA]; /* the reduced loss slots (worker.c validate) */
  int has_bleu;             /* train.valid_bleu: the next two are set */
  double bleu, chrf;        /* sacreBLEU's corpus BLEU and chrF2 of the valid split, 0..100 */
  int improved;             /* the best metric improved at this validation */
} nmt__valid_result;

/* train.valid_bleu in the process of global rank 0, which decodes. */
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
   * (nmt_clock_now_s; valid.c's log line): its decoding and scoring time, in seconds. */
  double t_start, decode_s;
} nmt__valid_bleu_setup;

/* The validation keys of cfg checked against each other and the data (NMT_ERR_CONFIG naming
 * them); and when train.valid_bleu is on and this process holds global rank 0
 * (first_rank == 0), *vb set up: the valid split's raw text, the SentencePiece model, a trial
 * run of sacreBLEU and a host buffer of n_params floats (NMT_ERR_DATA / NMT_ERR_IO naming the
 * files, NMT_ERR_NOMEM). Elsewhere vb stays off. */
nmt_status nmt__valid_setup(const nmt_config *cfg, int first_rank, size_t n_params,
                            nmt__valid_bleu_setup *vb);
/* train.valid_bleu, global rank 0's process: opens the decoder rig (vb->rig) on be's rank-0
 * device with parameters host_params and the run's abort flag, and sizes its buffers for the
 * valid source's longest line, so that validations allocate nothing. Call once, at create,
 * after nmt__valid_setup and before the communicator exists (no collective can be in flight);
 * a no-op where vb is off. Errors: nmt__rig_open_on's and nmt__rig_reserve's. */
nmt_status nmt__valid_open(nmt__valid_bleu_setup *vb, const nmt_backend *be, atomic_int *abort,
                           const float *host_params);
/* Closes the decoder and frees what setup allocated; vb is zeroed (off). */
void nmt__valid_free(nmt__valid_bleu_setup *vb);
/* Rank 0 decodes the valid source with replica r's parameters on the rig nmt__valid_open
 * opened and scores BLEU and chrF2; every rank gets the two numbers in *v through an
 * all-reduce over r's communicator (the others wait there meanwhile). Rank 0 then logs what
 * it cost at optimizer step `step` (1-based): its decoding and scoring seconds, the other
 * ranks' longest wait (one more all-reduce, max) and the totals since seg_start (the
 * segment's start, nmt_clock_now_s) as a share of the wall time. NMT_ERR_ABORTED when the
 * run's abort flag is raised (also while decoding); NMT_ERR_INTERNAL when rank 0's vb was not
 * set up. */
nmt_status nmt__valid_bleu(nmt__replica *r, nmt__valid_bleu_setup *vb, long step,
                           double seg_start, nmt__valid_result *v);
/* Updates *b with validation v at step `step` (v->improved says whether it improved) and
 * returns 1 when train.patience validations in a row have not improved: the run ends here. */
int nmt__best_update(const nmt_config *cfg, nmt__best *b, long step, nmt__valid_result *v);
/* 1 when b has already used up train.patience (a resumed run that had stopped early). */
int nmt__best_exhausted(const nmt_config *cfg, const nmt__best *b);
/* The early-stopping sentence for logs and status.json, into buf. */
void nmt__best_reason(const nmt_config *cfg, const nmt__best *b, long step, char *buf,
                      size_t cap);
/* The best validation of resumed checkpoint header h into *best when it is by cfg's
 * train.best_metric (another metric: *best is left as it is, and the count starts anew). */
void nmt__best_resume(const nmt_config *cfg, const nmt_ckpt_header *h, nmt__best *best);

#endif /* NMT_ENGINE_VALID_H */
