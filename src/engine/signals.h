/* signals.h — the stop signals of a training run (src/engine/, not public): SIGINT, SIGTERM
 * and SIGUSR1 counted by handlers on whichever thread they land, and taken by the main
 * thread's serving loop, which turns them into a stop request or an abort.
 *
 * Handlers, not a mask plus sigwait: OpenBLAS starts its thread pool before main() runs, so no
 * mask set later covers every thread, and a process-directed signal delivered to an unblocked
 * thread would run the default action (terminate). A handler only counts the signal
 * (lock-free atomics are async-signal-safe). Process-wide state by nature: one trainer with
 * handle_signals at a time.
 *
 * defines: nmt__signals, nmt__signals_install, nmt__signals_poll, nmt__signals_restore
 */
#ifndef NMT_ENGINE_SIGNALS_H
#define NMT_ENGINE_SIGNALS_H

#include <signal.h>

#include "sync.h"

enum { NMT__STOP_SIGNALS = 3 }; /* SIGINT, SIGTERM, SIGUSR1 */

/* One trainer's signal handling (nmt_trainer_options.handle_signals). */
typedef struct {
  struct sigaction old_actions[NMT__STOP_SIGNALS]; /* replaced by install, back at restore */
  int installed;
  int stop_by_user; /* the pending stop came from SIGINT/SIGTERM (a second one aborts) */
  int user_aborted; /* the run was aborted that way (the failure report says so instead of
                       blaming a rank) */
} nmt__signals;

/* Installs the counting handlers (SA_RESTART: the host program's system calls are not
 * interrupted) and forgets counts from before. */
void nmt__signals_install(nmt__signals *s);

/* Takes the stop signals that arrived since the last poll, counted by the handlers or left
 * pending by a caller that blocks them in every thread, and acts on each in order: the first
 * asks the run to stop after the step (sync->stop_requested; a checkpoint follows); a second
 * SIGINT, or a second SIGTERM after a SIGINT/SIGTERM stop, aborts the run now, recorded as the
 * main thread's NMT_ERR_ABORTED (sync's error record, naming the step and `last_ckpt`, the
 * newest checkpoint or ""). A SIGTERM after a SIGUSR1 (a scheduler's preemption notice, then
 * its end-of-time TERM) still waits for the checkpoint the notice asked for. Main thread. */
void nmt__signals_poll(nmt__signals *s, nmt__sync *sync, const char *last_ckpt);

/* Puts back the handlers install replaced (a no-op when none were installed); a signal that
 * came after the last step has nothing left to stop. */
void nmt__signals_restore(nmt__signals *s);

#endif /* NMT_ENGINE_SIGNALS_H */
