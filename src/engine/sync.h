/* sync.h — what the threads of a training run write at once: the abort, shutdown and stop
 * flags, the step count, and the run's error record (src/engine/, not public).
 *
 * Every thread kind records its failure here (nmt__sync_record_error) and reads the flags;
 * none of them needs the trainer for it. The first error wins: it is what the run returns;
 * later ones are usually ABORTED echoes of it. Recording any error raises the abort flag
 * (collectives, rings and device waits give up) and the shutdown flag (the loaders stop
 * waiting).
 *
 * The stop request and the step it ends after share one word, so that the main thread's
 * request and rank 0's sealing of a step (the moment the step's stop slot goes out with its
 * last gradient bucket) are ordered: a request either is in that step's slot, or learns that
 * the step is sealed and it ends after a later one. Either way the step it names is the step
 * the run ends after.
 *
 * defines: nmt__sync, nmt__sync_record_error, nmt__sync_failed, nmt__stop_request,
 *          nmt__stop_pending, nmt__stop_pending_at, nmt__stop_open, nmt__stop_seal,
 *          nmt__stop_clear
 */
#ifndef NMT_ENGINE_SYNC_H
#define NMT_ENGINE_SYNC_H

#include <stdatomic.h>

#include "nmt/status.h"

/* Written by several threads at once: the only shared mutable state of a running segment. */
typedef struct {
  atomic_int abort;          /* raised on any error: collectives and rings give up */
  atomic_int shutdown;       /* the loaders stop waiting (workers done or aborted) */
  atomic_llong stop;         /* bit 0: a stop is requested; above it (stop >> 1): the step,
                                1-based, after which a request made now ends the run (local
                                rank 0 keeps it: nmt__stop_open, nmt__stop_seal) */
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
  atomic_long valid_failed_step; /* a worker's validation after this step failed (not ABORTED):
                                    main writes that step's checkpoint (trainer.c fail_run) */
} nmt__sync;

/* Records status st of `rank` (a global worker rank; -1 = the main thread or a loader) with
 * the calling thread's last error message (nmt_last_error), and raises abort and shutdown.
 * NMT_OK records nothing. A worker's NMT_ERR_ABORTED is kept apart as an echo (aborted_*);
 * any other status, and the main thread's ABORTED, claims the run's error if none has. */
void nmt__sync_record_error(nmt__sync *s, int rank, nmt_status st);

/* After the join: 1 when the segment failed. Workers that only saw ABORTED, with no error of
 * this process behind it, mean a peer elsewhere failed (another node, or the collective
 * library gave up): that becomes the run's error (exit 8), with the first such message. */
int nmt__sync_failed(nmt__sync *s);

/* Requests a stop (any thread; a repeat changes nothing). Returns the step after which the run
 * ends (1-based): the step whose stop slot is not yet sealed, as rank 0 last set it. */
long nmt__stop_request(nmt__sync *s);

/* 1 while a stop is requested. */
int nmt__stop_pending(nmt__sync *s);

/* 1 when a stop is requested and ends the run after `step`: that step can no longer be sealed
 * without it (a validation of that step may stop short). */
int nmt__stop_pending_at(nmt__sync *s, long step);

/* Sets the step a request made from now on ends after (a segment's start), keeping a request
 * already made. */
void nmt__stop_open(nmt__sync *s, long step);

/* Local rank 0, as a step's stop slot is about to be reduced: returns 1 if a stop is requested
 * (the slot must carry it); else 0, and from now on a request ends after `next` (the next
 * step that can still carry it). */
int nmt__stop_seal(nmt__sync *s, long next);

/* Forgets a request (a segment that ended on it, or one that ended otherwise). */
void nmt__stop_clear(nmt__sync *s);

#endif /* NMT_ENGINE_SYNC_H */
