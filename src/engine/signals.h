/* signals.h — the stop signals of a training run (src/engine/, not public): SIGINT, SIGTERM
 * and SIGUSR1 counted by handlers on whichever thread they land, and taken by the main
 * thread's serving loop, which turns them into a stop request or an abort.
 *
 * Handlers, not a mask plus sigwait: OpenBLAS starts its thread pool before main() runs, so no
 * mask set later covers every thread, and a process-directed signal delivered to an unblocked
 * thread would run the default action (terminate). A handler only counts the signal and notes
 * when it arrived (lock-free atomics and clock_gettime are async-signal-safe). Process-wide
 * state by nature: one trainer with handle_signals at a time.
 *
 * defines: nmt__signals, NMT__SIGNAL_GRACE_S, nmt__signals_install, nmt__signals_poll,
 *          nmt__signals_abort_message, nmt__signals_restore
 */
#ifndef NMT_ENGINE_SIGNALS_H
#define NMT_ENGINE_SIGNALS_H

#include <signal.h>
#include <stddef.h>

#include "sync.h"

enum { NMT__STOP_SIGNALS = 3 }; /* SIGINT, SIGTERM, SIGUSR1 */

/* Seconds after the signal that asked for a stop during which another SIGINT/SIGTERM is a copy
 * of it, not a second request. GNU timeout signals the process and then its process group, a
 * shell pipeline's Ctrl-C reaches every process of the pipeline, a signal sent to each thread
 * runs the handler once per thread: such copies arrive microseconds apart, and the main thread
 * may count several in one poll, or in two. A person who presses again, after reading the
 * "stopping after" line, takes longer than this; a scheduler's second TERM comes after its
 * grace period (Slurm's KillWait: 30 s by default). Measured between the handlers' arrival
 * times, so a main thread busy writing a checkpoint cannot merge two deliberate requests. */
#define NMT__SIGNAL_GRACE_S 1.0

/* One trainer's signal handling (nmt_trainer_options.handle_signals). */
typedef struct {
  struct sigaction old_actions[NMT__STOP_SIGNALS]; /* replaced by install, back at restore */
  int installed;
  int stop_by_user; /* the pending stop came from SIGINT/SIGTERM (a second one aborts) */
  long long stop_ns; /* when the signal that asked for the pending stop arrived (monotonic) */
  int copy_noted;    /* a copy of that signal was logged (once per request) */
  int user_aborted; /* the run was aborted that way (the failure report says so instead of
                       blaming a rank) */
  int abort_sig;    /* the signal that aborted it */
} nmt__signals;

/* Installs the counting handlers (SA_RESTART: the host program's system calls are not
 * interrupted) and forgets counts from before. */
void nmt__signals_install(nmt__signals *s);

/* Takes the stop signals that arrived since the last poll, counted (with their arrival times)
 * by the handlers or left pending by a caller that blocks them in every thread, and acts on
 * each in the order they arrived: the first asks the run to stop after the step in progress
 * (nmt__stop_request; the line names that step; a checkpoint follows); a SIGINT or SIGTERM
 * that arrives less than NMT__SIGNAL_GRACE_S after it is a copy of the same request (logged
 * once, nothing more); a
 * second SIGINT, or a second SIGTERM after a SIGINT/SIGTERM stop, arriving later aborts the
 * run now, recorded as the main thread's NMT_ERR_ABORTED (sync's error record; its message is
 * completed after the join: nmt__signals_abort_message). A SIGTERM after a SIGUSR1 (a
 * scheduler's preemption notice, then its end-of-time TERM) still waits for the checkpoint the
 * notice asked for. Main thread. */
void nmt__signals_poll(nmt__signals *s, nmt__sync *sync);

/* The message of a run the user aborted (s->user_aborted), once every thread has returned and
 * the checkpoints already on their way were written: the signal, the steps done and
 * `last_ckpt`, the checkpoint that is really the last ("" none), into msg (cap bytes). */
void nmt__signals_abort_message(const nmt__signals *s, long steps_done, const char *last_ckpt,
                                char *msg, size_t cap);

/* Puts back the handlers install replaced (a no-op when none were installed); a signal that
 * came after the last step has nothing left to stop. */
void nmt__signals_restore(nmt__signals *s);

#endif /* NMT_ENGINE_SIGNALS_H */
