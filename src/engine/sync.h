/* sync.h — what the threads of a training run write at once: the abort, shutdown and stop
 * flags, the step count, and the run's error record (src/engine/, not public).
 *
 * Every thread kind records its failure here (nmt__sync_record_error) and reads the flags;
 * none of them needs the trainer for it. The first error wins: it is what the run returns;
 * later ones are usually ABORTED echoes of it. Recording any error raises the abort flag
 * (collectives, rings and device waits give up) and the shutdown flag (the loaders stop
 * waiting).
 *
 * defines: nmt__sync, nmt__sync_record_error, nmt__sync_failed
 */
#ifndef NMT_ENGINE_SYNC_H
#define NMT_ENGINE_SYNC_H

#include <stdatomic.h>

#include "nmt/status.h"

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

#endif /* NMT_ENGINE_SYNC_H */
