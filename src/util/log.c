/* log.c — leveled logging to stderr; one fprintf per line so threads do not interleave.
 *
 * What reaches the terminal is decided under one mutex: the progress line (kept, so that it
 * can be drawn again below any other line) and, with nmt_log_errors_once, the error texts
 * already printed. Lines to a sink bypass both. */
#include "nmt/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { LINE_MAX_BYTES = 2048, ERRORS_KEPT = 16 };

static atomic_int level = -2; /* -2: not yet read from NMT_LOG */
/* One pointer, so a logging thread sees either the old sink or the new one, never a mix. */
static _Atomic(const nmt_log_sink *) sink;
static atomic_int errors_once;

/* The terminal's state, under `term`. */
static pthread_mutex_t term = PTHREAD_MUTEX_INITIALIZER;
static int progress_open;               /* a progress line sits on the terminal, no newline */
static char progress[LINE_MAX_BYTES];   /* its text, drawn again after any other line */
static char printed[ERRORS_KEPT][LINE_MAX_BYTES]; /* error texts printed (errors_once) */
static int n_printed;

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

void nmt_log_errors_once(int on) { atomic_store(&errors_once, on != 0); }

int nmt_log_progress_live(void) {
  const nmt_log_sink *k = atomic_load(&sink);
  return !(k && k->fn) && (int)NMT_LOG_INFO <= (int)nmt_log_get_level() &&
         isatty(STDERR_FILENO);
}

/* 1 when `text` equals, or ends one of, the error texts already printed (under `term`):
 * "run failed on rank 0: NMT_ERR_IO: X" and then "X" again are one error. With `wraps`, also
 * when `text` ends with one printed: a report of that error ("run failed on rank 0: ...: X"
 * after "X"). A new error that wraps a printed one with its context is not a report, and
 * passes wraps = 0. */
static int already_printed(const char *text, int wraps) {
  size_t n = strlen(text);
  for (int i = 0; i < n_printed && i < ERRORS_KEPT; i++) {
    size_t m = strlen(printed[i]);
    if (m >= n && !strcmp(printed[i] + m - n, text)) return 1;
    if (wraps && n > m && !strcmp(text + n - m, printed[i])) return 1;
  }
  return 0;
}

enum { LINE_PLAIN, LINE_PROGRESS, LINE_NEW_ERROR };

/* One admitted line: to the sink, or to stderr; a progress line rewrites the terminal line in
 * place (stderr a terminal, no sink), and any other line first erases an open progress line,
 * then draws it again below, so the progress stays in view. */
static void emit(nmt_log_level l, const char *buf, int kind) {
  static const char *names[] = {"error", "warn", "info", "debug"};
  const nmt_log_sink *k = atomic_load(&sink);
  if (k && k->fn) {
    k->fn(k->user, l, buf);
    return;
  }
  const int tty = kind == LINE_PROGRESS && isatty(STDERR_FILENO);
  pthread_mutex_lock(&term);
  if (tty) {
    fprintf(stderr, "\r\033[K[nmt] %s", buf);
    fflush(stderr);
    snprintf(progress, sizeof progress, "%s", buf);
    progress_open = 1;
  } else if (l == NMT_LOG_ERROR && atomic_load(&errors_once) &&
             already_printed(buf, kind != LINE_NEW_ERROR)) {
    /* printed once already */
  } else {
    if (l == NMT_LOG_ERROR && atomic_load(&errors_once))
      snprintf(printed[n_printed++ % ERRORS_KEPT], LINE_MAX_BYTES, "%s", buf);
    if (progress_open)
      fprintf(stderr, "\r\033[K[nmt] %s: %s\n[nmt] %s", names[l], buf, progress);
    else
      fprintf(stderr, "[nmt] %s: %s\n", names[l], buf);
    fflush(stderr);
  }
  pthread_mutex_unlock(&term);
}

void nmt_log(nmt_log_level l, const char *fmt, ...) {
  if ((int)l > (int)nmt_log_get_level()) return;
  char buf[LINE_MAX_BYTES];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  emit(l, buf, LINE_PLAIN);
}

void nmt__log_new_error(const char *text) {
  if ((int)NMT_LOG_ERROR > (int)nmt_log_get_level()) return;
  emit(NMT_LOG_ERROR, text, LINE_NEW_ERROR);
}

void nmt_log_progress(const char *fmt, ...) {
  if ((int)NMT_LOG_INFO > (int)nmt_log_get_level()) return;
  char buf[LINE_MAX_BYTES];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  emit(NMT_LOG_INFO, buf, LINE_PROGRESS);
}

void nmt_log_progress_end(void) {
  pthread_mutex_lock(&term);
  if (progress_open) fputc('\n', stderr);
  progress_open = 0;
  progress[0] = 0;
  pthread_mutex_unlock(&term);
}
