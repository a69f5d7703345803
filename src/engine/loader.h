/* loader.h — the loader threads and the batch slots they hand to the workers (src/engine/,
 * not public; nmt_loader_deal, the deal itself, is public: nmt/loader.h).
 *
 * A loader sees only what forming and dealing batches needs: the training batcher, the model
 * config (a batch's FLOPs for MFU), the world's shape, the feeds of this process's workers,
 * the segment's bounds and the run's flags. It never sees the trainer or a worker.
 *
 * defines: nmt__batch_slot, nmt__feed, nmt__loader, nmt__loader_main, nmt__loader_threads
 */
#ifndef NMT_ENGINE_LOADER_H
#define NMT_ENGINE_LOADER_H

#include <pthread.h>

#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/model.h"
#include "nmt/prof.h"
#include "nmt/ring.h"
#include "sync.h"

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

/* One local worker's two rings with the loaders, and the slots that circulate in them (its
 * replica allocates and frees the slots: nmt__replica_setup). Between segments every slot is
 * in a ring, except one a failed worker parked (worker.c hand_back_ahead). */
typedef struct {
  nmt_ring batches;        /* loader -> worker: filled slots */
  nmt_ring free_slots;     /* worker -> loader: slots to refill */
  nmt__batch_slot *slots;  /* n_slots */
  int n_slots;
} nmt__feed;

/* A loader thread: every loader computes each step's whole deal and fills only the feeds of
 * the workers r with r % n_loaders == index, so each ring keeps one producer. */
typedef struct nmt__loader {
  /* From the run, set at create and read-only while the thread runs. */
  nmt_batcher *batcher;       /* the training batches */
  const nmt_model_cfg *mcfg;  /* a batch's model FLOPs (nmt_model_train_flops) */
  int world, first_rank;      /* ranks of the run; the global rank of local worker 0 */
  int n_local, accum;         /* this process's workers (feeds); micro-batches per step */
  nmt__feed *feeds;           /* n_local */
  int index, n_loaders;
  nmt__sync *sync;            /* shutdown and abort end its waits; it records its errors */
  nmt_prof_track *prof;       /* its own track, and the two range ids it uses */
  int range_data_wait, range_load;
  /* The segment, set before each start: steps [start_step, end_step) from data position
   * (start_epoch, start_index) of the epoch order. */
  long start_step, end_step, start_epoch, start_index;
  pthread_t thread;
} nmt__loader;

/* The thread function; arg is an nmt__loader. Returns at the segment's end, on shutdown or
 * abort, or after recording an error in L->sync (a data position outside the epoch order:
 * NMT_ERR_INTERNAL; no memory for the epoch order: NMT_ERR_NOMEM). */
void *nmt__loader_main(void *arg);

/* data.loader_threads, but no more than one per worker (each worker's ring has one producer)
 * and no more than a Slurm allocation's CPUs (SLURM_CPUS_PER_TASK). */
int nmt__loader_threads(const nmt_config *cfg);

#endif /* NMT_ENGINE_LOADER_H */
