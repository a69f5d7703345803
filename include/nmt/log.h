/* nmt/log.h — leveled logging to stderr, thread-safe (one fprintf per line).
 *
 * Lines look like "[nmt] error: message". The level is read from NMT_LOG (error, warn, info,
 * debug; default info) once, at the first call. Logging is never on the per-step path except
 * every train.log_every steps.
 *
 * An embedding program may install one process-wide sink (nmt_log_set_sink) that receives
 * each admitted line instead of stderr; the library's own threads call it, so it must be
 * thread-safe, must not call nmt_log itself, and must stay valid until it is removed.
 *
 * Progress (nmt_log_progress): on a terminal, one line rewritten in place ("\r" + erase);
 * anything else logged meanwhile erases it, prints normally, and draws the progress line again
 * below it, so the progress stays in view. Not a terminal, or a sink installed: progress lines
 * are ordinary info lines (plain text for logs and schedulers).
 *
 * defines: nmt_log_level, nmt_log, NMT_LOG_ERROR/WARN/INFO/DEBUG, nmt_log_sink,
 *          nmt_log_set_sink, nmt_log_progress, nmt_log_progress_end, nmt_log_progress_live,
 *          nmt_log_errors_once, nmt__log_new_error
 */
#ifndef NMT_LOG_H
#define NMT_LOG_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { NMT_LOG_ERROR = 0, NMT_LOG_WARN = 1, NMT_LOG_INFO = 2, NMT_LOG_DEBUG = 3 } nmt_log_level;

/* Logs one line at `level` if the configured level admits it. */
void nmt_log(nmt_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A progress line at info level: rewritten in place on a terminal (see above). */
void nmt_log_progress(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Ends an open progress line with a newline so that it stays on screen (no-op otherwise). */
void nmt_log_progress_end(void);
/* 1 when progress lines are rewritten in place (stderr is a terminal, no sink, info level
 * admitted): then a caller may refresh its progress line often (the trainer: every 2 s),
 * which would flood a log file otherwise. */
int nmt_log_progress_live(void);
/* on = 1: each error reaches stderr once. An error line whose text equals, or ends with, or is
 * the end of, one of the last 16 printed is dropped: a worker's error, the trainer's "run
 * failed on rank r: ...: <it>" and main's final report of <it> are one line. A new error
 * (nmt_errorf) that wraps a printed one with context ("node 1 ... did not reach the
 * rendezvous: <it>") is printed: it says more. Off (0) by default, so an embedding program
 * sees a repeated error each time; the CLI turns it on. Lines to a sink are never dropped. */
void nmt_log_errors_once(int on);
/* The line of a new error, from nmt_errorf (status.c): logged at error level like nmt_log, and
 * under nmt_log_errors_once dropped only when it equals or ends an error already printed. */
void nmt__log_new_error(const char *text);
/* Overrides the level from NMT_LOG (tests use this to silence expected errors). */
void nmt_log_set_level(nmt_log_level level);
nmt_log_level nmt_log_get_level(void);

/* Receives one formatted line (no "[nmt]" prefix, no newline) at `level`. */
typedef void (*nmt_log_fn)(void *user, nmt_log_level level, const char *line);
typedef struct {
  nmt_log_fn fn;
  void *user;
} nmt_log_sink;
/* Sends admitted lines to sink->fn instead of stderr; NULL restores stderr. *sink is used in
 * place (not copied) and must outlive every thread that may log until it is removed. */
void nmt_log_set_sink(const nmt_log_sink *sink);

#ifdef __cplusplus
}
#endif
#endif /* NMT_LOG_H */
