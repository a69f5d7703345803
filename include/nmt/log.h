/* nmt/log.h — leveled logging to stderr, thread-safe (one fprintf per line).
 *
 * Lines look like "[nmt] error: message". The level is read from NMT_LOG (error, warn, info,
 * debug; default info) once, at the first call. Logging is never on the per-step path except
 * every train.log_every steps.
 *
 * defines: nmt_log_level, nmt_log, NMT_LOG_ERROR/WARN/INFO/DEBUG
 */
#ifndef NMT_LOG_H
#define NMT_LOG_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { NMT_LOG_ERROR = 0, NMT_LOG_WARN = 1, NMT_LOG_INFO = 2, NMT_LOG_DEBUG = 3 } nmt_log_level;

/* Logs one line at `level` if the configured level admits it. */
void nmt_log(nmt_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Overrides the level from NMT_LOG (tests use this to silence expected errors). */
void nmt_log_set_level(nmt_log_level level);
nmt_log_level nmt_log_get_level(void);

#ifdef __cplusplus
}
#endif
#endif /* NMT_LOG_H */
