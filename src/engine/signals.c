/* signals.c — a training run's stop signals (signals.h): counting handlers, and the main
 * thread's poll that turns the counts into a stop request or an abort. */
#include "signals.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

#include "nmt/log.h"

static const int stop_signals[NMT__STOP_SIGNALS] = {SIGINT, SIGTERM, SIGUSR1};
/* Per signal since the last poll: the copies counted, and the monotonic arrival times (ns) of
 * the first and the last of them (0: none). */
static atomic_int signal_counts[NMT__STOP_SIGNALS];
static atomic_llong signal_first_ns[NMT__STOP_SIGNALS];
static atomic_llong signal_last_ns[NMT__STOP_SIGNALS];

static long long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts); /* async-signal-safe (POSIX.1-2008, signal-safety(7)) */
  return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The handler, on whichever thread the signal lands (several at once when each thread gets a
 * copy): the times are written before the count, so a poll that takes the count finds them. */
static void count_signal(int sig) {
  const long long t = now_ns();
  for (int i = 0; i < NMT__STOP_SIGNALS; i++)
    if (stop_signals[i] == sig) {
      long long zero = 0;
      atomic_compare_exchange_strong(&signal_first_ns[i], &zero, t);
      atomic_store(&signal_last_ns[i], t);
      atomic_fetch_add(&signal_counts[i], 1);
    }
}

void nmt__signals_install(nmt__signals *s) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = count_signal;
  sa.sa_flags = SA_RESTART; /* the host program's system calls are not interrupted */
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < NMT__STOP_SIGNALS; i++) {
    atomic_store(&signal_counts[i], 0);
    atomic_store(&signal_first_ns[i], 0);
    atomic_store(&signal_last_ns[i], 0);
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

static const char *signal_name(int sig) {
  return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "SIGUSR1";
}

/* One signal that arrived at t_ns. The first asks to stop after the step in progress (the
 * step it names, whose stop slot has not gone out yet: sync.h), then write a checkpoint. A
 * SIGINT or SIGTERM (the user's second Ctrl-C, or a scheduler's second TERM) while that stop
 * is pending, NMT__SIGNAL_GRACE_S or more after the signal that asked for it:
 * abort now, without that checkpoint. The GEMMs of a CPU worker and every host wait look at
 * the abort flag (nmt/backend.h set_abort), so the workers return within a fraction of a
 * second even mid-step. Sooner, it is a copy of the first (signals.h): nothing more. A
 * SIGTERM after a SIGUSR1 (a scheduler's preemption notice, then its end-of-time TERM) still
 * waits for the checkpoint the notice asked for. */
static void on_signal(nmt__signals *s, nmt__sync *sync, int sig, long long t_ns) {
  const int user = sig == SIGINT || sig == SIGTERM;
  if (!nmt__stop_pending(sync)) {
    s->stop_by_user = user;
    s->stop_ns = t_ns;
    s->copy_noted = 0;
    const long after = nmt__stop_request(sync);
    nmt_log(NMT_LOG_WARN, "signal %d: stopping after step %ld, then writing a checkpoint", sig,
            after);
    return;
  }
  if (s->user_aborted) return;
  const double after_s = 1e-9 * (double)(t_ns - s->stop_ns);
  if (!user || (sig == SIGTERM && !s->stop_by_user)) {
    if (!s->copy_noted)
      nmt_log(NMT_LOG_INFO, "%s: the stop already requested goes on (a checkpoint after the "
              "step)", signal_name(sig));
    s->copy_noted = 1;
    return;
  }
  if (after_s < NMT__SIGNAL_GRACE_S) {
    if (!s->copy_noted)
      nmt_log(NMT_LOG_INFO, "%s %.3f s after the stop request: a copy of the same request "
              "(a second one %.0f s or more after the first aborts the run)", signal_name(sig),
              after_s, NMT__SIGNAL_GRACE_S);
    s->copy_noted = 1;
    return;
  }
  nmt_log(NMT_LOG_WARN, "second %s, %.1f s after the first: aborting now", signal_name(sig),
          after_s);
  s->abort_sig = sig;
  s->user_aborted = 1;
  /* Provisional: a checkpoint already on its way to the main thread is still written, so the
   * run's message is made after the join (nmt__signals_abort_message). */
  nmt__sync_record_error(sync, -1, nmt_errorf(NMT_ERR_ABORTED, "stopped by the user: a second "
                                              "%s", signal_name(sig)));
}

/* A signal's copies since the last poll, as (signal, arrival) events. */
typedef struct {
  int sig;
  long long t_ns;
} arrival;

void nmt__signals_poll(nmt__signals *s, nmt__sync *sync) {
  arrival ev[2 * NMT__STOP_SIGNALS];
  int n = 0;
  for (int i = 0; i < NMT__STOP_SIGNALS; i++) {
    if (atomic_exchange(&signal_counts[i], 0) <= 0) continue;
    long long first = atomic_exchange(&signal_first_ns[i], 0);
    long long last = atomic_exchange(&signal_last_ns[i], 0);
    /* A copy whose handler ran between an earlier poll's count and its times: that poll took
     * its times (handled then, at its arrival), this count is all that is left of it. Taking
     * it as arriving now could make a copy a second request after a long checkpoint write. */
    if (!first) continue;
    if (!last || last < first) last = first;
    ev[n++] = (arrival){stop_signals[i], first};
    if (last != first) ev[n++] = (arrival){stop_signals[i], last};
  }
  /* Oldest first: a SIGTERM after a SIGUSR1 is not the same as one before it. */
  for (int a = 1; a < n; a++)
    for (int b = a; b > 0 && ev[b].t_ns < ev[b - 1].t_ns; b--) {
      arrival x = ev[b];
      ev[b] = ev[b - 1], ev[b - 1] = x;
    }
  for (int i = 0; i < n; i++) on_signal(s, sync, ev[i].sig, ev[i].t_ns);
  sigset_t sigs;
  sigemptyset(&sigs);
  for (int i = 0; i < NMT__STOP_SIGNALS; i++) sigaddset(&sigs, stop_signals[i]);
  struct timespec zero = {0, 0};
  int sig;
  while ((sig = sigtimedwait(&sigs, NULL, &zero)) > 0) on_signal(s, sync, sig, now_ns());
}

void nmt__signals_abort_message(const nmt__signals *s, long steps_done, const char *last_ckpt,
                                char *msg, size_t cap) {
  snprintf(msg, cap, "stopped by the user: a second %s after step %ld; %s%s",
           signal_name(s->abort_sig), steps_done,
           last_ckpt[0] ? "the last checkpoint is " : "no checkpoint was written", last_ckpt);
}
