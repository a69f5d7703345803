/* replica.h — one worker's device state (src/engine/, not public): its context, model replica,
 * flat buffers, step control block and batch staging, set up once at create (replica.c) and
 * then owned by the worker thread (worker.c). The ZeRO step (zero.c) and validation BLEU
 * (valid.c) work on a replica alone.
 *
 * defines: nmt__replica, nmt__replica_setup, nmt__replica_free, nmt__replica_log_memory,
 *          nmt__batch_nomem
 */
#ifndef NMT_ENGINE_REPLICA_H
#define NMT_ENGINE_REPLICA_H

#include <stdatomic.h>

#include "loader.h"
#include "nmt/backend.h"
#include "nmt/buckets.h"
#include "nmt/comm.h"
#include "nmt/model.h"
#include "nmt/prof.h"
#include "nmt/trainer.h"

/* One worker's device state. */
typedef struct {
  /* What it was made for (replica setup; read-only afterwards). */
  const nmt_backend *be;
  const nmt_bucket_plan *plan; /* the run's buckets, the same on every rank */
  int rank;            /* local index in this process: its device, its feed */
  int grank;           /* global rank: its batches, its ZeRO slices, rank 0's duties */
  int world;           /* ranks of the run, all processes */
  atomic_int *abort;   /* the run's abort flag (sync.h): every wait gives up on it */
  void *ctx;           /* the backend's device context (nmt_device_open) */
  int device;          /* the device index it was opened on */
  nmt_comm *comm;      /* bound once the communicator exists */
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
  int32_t *dev_batch_buf;  /* validation batches (copied synchronously) */
  int32_t *valid_host_buf; /* their host side */
  /* Training batches: two staging slots on the device. The copy of micro-batch i+1 runs on
   * the copy stream while micro-batch i computes (backend h2d_async / acquire / release). */
  int32_t *dev_stage[2];
  nmt__feed *feed;        /* its rings with the loaders; the slots are allocated here */
  nmt_step_ctl *dev_ctl;  /* device: the step's control block (loss scaler state, verdict) */
  nmt_step_ctl *host_ctl; /* pinned, NMT_D2H_SLOTS: step s's block is read back into [s % 2] */
  float *dev_valid;       /* NMT_GRAD_EXTRA floats: validation loss slots */
  nmt_bucket_reducer buckets; /* this backward's progress through the bucket plan */
  float *host_grads;      /* copy of the last reduced gradient (tests) */
  nmt_prof_track *prof;   /* its profiler track ("cpu0", "gpu0", ...) */
  void *prof_clock;       /* GPU workers in a profile window: the device event clock */
  double mem_peak_mb;     /* device memory peak sampled at log steps (NAN at first) */
} nmt__replica;

/* Sets up local worker `rank`'s replica from the run t (create, main thread): opens its
 * device, creates the model, allocates every buffer a step touches (parameters and moments
 * from t's initial or resumed state) and the host batch slots of `feed`, adds its profiler
 * track. Rank 0 also measures the device peaks for MFU (t->peak_*) unless profile.peak_* set
 * them. The communicator is bound later (r->comm, and the reducers'). Errors: NMT_ERR_NOMEM
 * (nmt__batch_nomem's message for batch-sized buffers), the backend's and the model's. */
nmt_status nmt__replica_setup(nmt_trainer *t, int rank, nmt__feed *feed, nmt__replica *r);
/* Frees what setup allocated, the feed's slots included, then closes the device context;
 * safe on a partial setup and on a zeroed replica. */
void nmt__replica_free(nmt__replica *r);
/* Logs what replica r (worker 0's) allocated for gradients and Adam moments against the
 * replicated layout of its plan: ZeRO's saving, measured from the allocations themselves. */
void nmt__replica_log_memory(const nmt__replica *r);
/* NMT_ERR_NOMEM naming the batch-sized buffer `what` of `rank` that did not fit, with the
 * data.max_tokens / data.max_len that sized it, the activation estimate and the way out,
 * keeping the allocator's message. */
nmt_status nmt__batch_nomem(const nmt_trainer *t, int rank, const char *what);

#endif /* NMT_ENGINE_REPLICA_H */
