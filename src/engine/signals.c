/* signals.c — a training run's stop signals (signals.h): counting handlers, and the main
 * thread's poll that turns the counts into a stop request or an abort. */
#include "signals.h"

#include <string.h>
#include <time.h>

#include "nmt/log.h"

static const int stop_signals[NMT__STOP_SIGNALS] = {SIGINT, SIGTERM, SIGUSR1};
static atomic_int signal_counts[NMT__STOP_SIGNALS];

static void count_signal(int sig) {
  for (int i = 0; i < NMT__STOP_SIGNALS; i++)
    if (stop_signals[i] == sig) atomic_fetch_add(&signal_counts[i], 1);
}

void nmt__signals_install(nmt__signals *s) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = count_signal;
  sa.sa_flags = SA_RESTART; /* the host program's system calls are not interrupted */
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < NMT__STOP_SIGNALS; i++) {
    atomic_store(&signal_counts[i], 0);
    sigaction(stop_signals[i], &sa, &s->old_actions[i]);
  }
  s->installed = 1;
}

void nmt__signals_restore(nmt__signals *s) {
  if (!s->installed) return;
  for (int i = 0; i < NMT__STOP_SIGNALS; i++) {
    sigaction(stop_signals[i], &s->old_actions[i], NULL);
    atomic_store(&signal_counts[i], 0);
  }
  s->installed = 0;
}

/* One signal: stop after the step, then write a checkpoint. A second SIGINT or SIGTERM (the
 * user's second Ctrl-C, or a scheduler's second TERM) while that stop is pending: abort now,
 * without that checkpoint. The GEMMs of a CPU worker and every host wait look at the abort
 * flag (nmt/backend.h set_abort), so the workers return within a fraction of a second even
 * mid-step. A SIGTERM after a SIGUSR1 (a scheduler's preemption notice, then its end-of-time
 * TERM) still waits for the checkpoint the notice asked for. */
static void on_signal(nmt__signals *s, nmt__sync *sync, const char *last_ckpt, int sig) {
  const int user = sig == SIGINT || sig == SIGTERM;
  if (atomic_load(&sync->stop_requested) && user && (sig == SIGINT || s->stop_by_user)) {
    const char *name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    const long step = atomic_load(&sync->steps_done);
    nmt_log(NMT_LOG_WARN, "second %s: aborting without a checkpoint", name);
    nmt__sync_record_error(sync, -1, nmt_errorf(NMT_ERR_ABORTED,
                                                "stopped by the user: a second %s during step "
                                                "%ld; no checkpoint of it was written (%s%s)",
                                                name, step + 1, last_ckpt[0] ? "the last is " :
                                                "none was written before", last_ckpt));
    s->user_aborted = 1;
  } else {
    nmt_log(NMT_LOG_WARN, "signal %d: stopping after this step, then writing a checkpoint", sig);
    if (!atomic_load(&sync->stop_requested)) s->stop_by_user = user;
    atomic_store(&sync->stop_requested, 1);
  }
}

void nmt__signals_poll(nmt__signals *s, nmt__sync *sync, const char *last_ckpt) {
  for (int i = 0; i < NMT__STOP_SIGNALS; i++)
    for (int k = atomic_exchange(&signal_counts[i], 0); k > 0; k--)
      on_signal(s, sync, last_ckpt, stop_signals[i]);
  sigset_t sigs;
  sigemptyset(&sigs);
  for (int i = 0; i < NMT__STOP_SIGNALS; i++) sigaddset(&sigs, stop_signals[i]);
  struct timespec zero = {0, 0};
  int sig;
  while ((sig = sigtimedwait(&sigs, NULL, &zero)) > 0) on_signal(s, sync, last_ckpt, sig);
}
