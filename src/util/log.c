/* log.c — leveled logging to stderr; one fprintf per line so threads do not interleave. */
#include "nmt/log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static atomic_int level = -2; /* -2: not yet read from NMT_LOG */
/* One pointer, so a logging thread sees either the old sink or the new one, never a mix. */
static _Atomic(const nmt_log_sink *) sink;
/* 1 while a progress line sits on the terminal without its newline. */
static atomic_int progress_open;

static int read_env(void) {
  const char *e = getenv("NMT_LOG");
  if (!e) return NMT_LOG_INFO;
  if (!strcmp(e, "error")) return NMT_LOG_ERROR;
  if (!strcmp(e, "warn")) return NMT_LOG_WARN;
  if (!strcmp(e, "debug")) return NMT_LOG_DEBUG;
  return NMT_LOG_INFO;
}

nmt_log_level nmt_log_get_level(void) {
  int l = atomic_load(&level);
  if (l == -2) {
    l = read_env();
    atomic_store(&level, l);
  }
  return (nmt_log_level)l;
}

void nmt_log_set_level(nmt_log_level l) { atomic_store(&level, (int)l); }

void nmt_log_set_sink(const nmt_log_sink *s) { atomic_store(&sink, s); }

/* One admitted line: to the sink, or to stderr; `progress` rewrites the terminal line in
 * place (stderr a terminal, no sink), and any other line first erases an open progress line. */
static void emit(nmt_log_level l, const char *buf, int progress) {
  static const char *names[] = {"error", "warn", "info", "debug"};
  const nmt_log_sink *k = atomic_load(&sink);
  if (k && k->fn) {
    k->fn(k->user, l, buf);
  } else if (progress && isatty(STDERR_FILENO)) {
    fprintf(stderr, "\r\033[K[nmt] %s", buf);
    fflush(stderr);
    atomic_store(&progress_open, 1);
  } else {
    const char *erase = atomic_exchange(&progress_open, 0) ? "\r\033[K" : "";
    fprintf(stderr, "%s[nmt] %s: %s\n", erase, names[l], buf);
  }
}

void nmt_log(nmt_log_level l, const char *fmt, ...) {
  if ((int)l > (int)nmt_log_get_level()) return;
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  emit(l, buf, 0);
}

void nmt_log_progress(const char *fmt, ...) {
  if ((int)NMT_LOG_INFO > (int)nmt_log_get_level()) return;
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  emit(NMT_LOG_INFO, buf, 1);
}

void nmt_log_progress_end(void) {
  if (atomic_exchange(&progress_open, 0)) fputc('\n', stderr);
}
