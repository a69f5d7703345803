/* worker.h — a worker thread: one device's step loop and the host's end of each step
 * (src/engine/, not public; worker.c).
 *
 * A worker owns its replica (replica.h) and sees of the run only what the loop needs, named
 * in nmt__worker: the config and the test options, the validation batches, the profiler's
 * window and range ids, the peak for MFU, the header every checkpoint repeats; and the parts
 * it shares: the run's flags and error record (sync.h), the segment's position, the mailbox
 * to the main thread and, on global rank 0, validation BLEU's decoder. It never sees the
 * trainer, the loaders or another worker.
 *
 * defines: nmt__loss_scaler, nmt__position, nmt__range_names, nmt__msg, nmt__mailbox,
 *          nmt__step_info, nmt__worker, nmt__worker_main, nmt__eval_main, nmt__ckpt_header,
 *          NMT__MSG_POOL
 */
#ifndef NMT_ENGINE_WORKER_H
#define NMT_ENGINE_WORKER_H

#include <stdatomic.h>

#include "loader.h"
#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/prof.h"
#include "nmt/ring.h"
#include "nmt/trainer.h"
#include "replica.h"
#include "sync.h"
#include "valid.h"

enum { NMT__MSG_POOL = 64 };

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
  double t_start;              /* when the segment began (nmt_clock_now_s; main, between
                                  segments) */
} nmt__position;

/* Range names the engine interns once (profiler ids). */
typedef struct {
  int step, micro_step, data_wait, h2d, forward, backward, optimizer, validate, checkpoint, load,
      metrics;
  int *allreduce; /* one per bucket: "allreduce.b<i>" */
} nmt__range_names;

typedef enum { NMT__MSG_METRICS, NMT__MSG_CHECKPOINT } nmt__msg_kind;

/* Worker 0 -> main. */
typedef struct {
  nmt__msg_kind kind;
  nmt_metrics metrics;
  nmt_ckpt_header ckpt;
} nmt__msg;

/* Worker 0 -> main: messages and the checkpoint snapshot (host copies of the state). */
typedef struct {
  nmt_ring full, free;
  nmt__msg pool[NMT__MSG_POOL];
  float *params, *m, *v; /* snapshot for the checkpoint writer */
  atomic_int busy;       /* the writer has not finished with the snapshot */
} nmt__mailbox;

/* What the host knows of a step it has enqueued, until it reads the step's control block. */
typedef struct {
  long step;                           /* 0-based */
  long next_epoch, next_index;         /* data position after the step */
  double lr, flops;                    /* the step's learning rate; model FLOPs of all ranks */
  double enqueued_s;                   /* the training clock (nmt__worker.paused_s) when its
                                          enqueue returned: on a host backend (synchronous
                                          ops), when its work ended */
} nmt__step_info;

/* One worker thread. */
typedef struct nmt__worker {
  nmt__replica rep;               /* its device state (replica.c) */
  /* From the run, set at create and read-only while the thread runs. */
  const nmt_config *cfg;
  const nmt_trainer_options *opt; /* injected faults and step delays (tests) */
  nmt_batcher *valid;             /* the validation batches; NULL: none */
  const nmt_prof *profiler;       /* the profile window (profile.start_step..stop_step) */
  const nmt__range_names *rn;
  int accum;                      /* micro-batches per step */
  double peak_flops;              /* this worker's peak FLOP/s for MFU: its device's, or its
                                   * share of it with several workers on one GPU; 0: unknown */
  const nmt_ckpt_header *ckpt_base; /* the fields every checkpoint of the run repeats */
  /* Shared with the other threads of the run. */
  nmt__sync *sync;                /* flags, steps_done, the error record */
  nmt__position *pos;             /* the segment's bounds; worker 0 writes its end fields */
  nmt__mailbox *mail;             /* worker 0 -> main; with ZeRO every rank fills the snapshot */
  nmt__valid_bleu_setup *vbleu;   /* train.valid_bleu: global rank 0's decoder */
  /* Its own. */
  int started;                    /* its thread runs in this segment (main's bookkeeping) */
  nmt__batch_slot *ahead; /* popped and being copied into rep.dev_stage[ahead_slot]; NULL = none */
  int ahead_slot;
  int ahead_copying;      /* its h2d_async was issued: the copy engine may be reading it */
  nmt__batch_slot *parked; /* after an error: the slot fetched ahead whose copy was not seen
                              to finish; in neither ring (the run is over), freed with the
                              replica */
  nmt__step_info inflight[NMT_D2H_SLOTS]; /* the host's side of the steps being read back */
  nmt__loss_scaler scaler;
  nmt__best best;         /* the best validation so far, as this rank counts it */
  int mfu_warned;         /* rank 0: the "MFU above 1" warning was given */
  double paused_s;        /* seconds spent validating and writing checkpoints, which the
                             training clock (nmt_clock_now_s() - paused_s) leaves out, so that
                             step_ms, tokens/s and MFU time the steps alone */
  double valid_out[NMT_GRAD_EXTRA]; /* nmt__eval_main: the reduced validation loss slots */
  nmt_status status;
} nmt__worker;

/* The thread function of one segment of training (arg: an nmt__worker): steps
 * [pos->start_step, pos->end_step), or fewer on a stop or early stopping. Records its error
 * in w->sync (rank w->rep.grank) and sets w->status; counts itself in sync->workers_done. */
void *nmt__worker_main(void *arg);
/* The thread function of nmt_trainer_evaluate (arg: an nmt__worker): the validation loss
 * slots of this rank's share of the valid set, all-reduced, into w->valid_out. */
void *nmt__eval_main(void *arg);
/* A checkpoint header at this position and scaler state: the run's fixed fields from
 * *base (model shape, n_params, seed, meta), the best validation from *best. */
void nmt__ckpt_header(const nmt_ckpt_header *base, const nmt__best *best,
                      const nmt__loss_scaler *ls, long step, long epoch, long index,
                      nmt_ckpt_header *h);

#endif /* NMT_ENGINE_WORKER_H */
