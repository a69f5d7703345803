/* nmt/status.h — one status enum for the whole project, its strings and exit codes.
 *
 * Every fallible function returns nmt_status; outputs go last as pointers. NMT_TRY propagates
 * an error and logs "-> file:line" at each level it passes through, which gives a cheap
 * backtrace in the log (NCCL's NCCLCHECK does the same). Only main() turns a status into a
 * process exit code, through nmt_status_exit_code().
 *
 * defines: nmt_status, NMT_STATUS_LIST, nmt_status_str, nmt_status_exit_code, NMT_TRY,
 *          nmt_errorf, nmt_last_error
 */
#ifndef NMT_STATUS_H
#define NMT_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

/* X(name, exit code, description). Exit codes are documented in README.md:
 * 0 done, 1 internal, 2 config error, 3 data error, 4 device/out-of-memory, 5 diverged,
 * 6 I/O, 7 checkpoint, 8 aborted (a peer failed, or a second SIGINT/SIGTERM), 75 stopped
 * (preemption, checkpoint written), 9 missing dependency (an external program or Python module
 * a command runs is not installed: the message names what to install). Added last, so that
 * the values before it keep their numbers. */
#define NMT_STATUS_LIST(X)                                                        \
  X(NMT_OK, 0, "ok")                                                              \
  X(NMT_ERR_INTERNAL, 1, "internal error")                                        \
  X(NMT_ERR_USAGE, 2, "bad command line")                                         \
  X(NMT_ERR_CONFIG, 2, "config error")                                            \
  X(NMT_ERR_DATA, 3, "data error")                                                \
  X(NMT_ERR_NOMEM, 4, "out of memory")                                            \
  X(NMT_ERR_DEVICE, 4, "device error")                                            \
  X(NMT_ERR_DIVERGED, 5, "training diverged")                                     \
  X(NMT_ERR_IO, 6, "I/O error")                                                   \
  X(NMT_ERR_CHECKPOINT, 7, "checkpoint error")                                    \
  X(NMT_ERR_ABORTED, 8, "aborted")                                                \
  X(NMT_STOPPED, 75, "stopped on request, checkpoint written")                   \
  X(NMT_ERR_MISSING_DEP, 9, "missing dependency")

typedef enum {
#define NMT_X_ENUM(name, code, desc) name,
  NMT_STATUS_LIST(NMT_X_ENUM)
#undef NMT_X_ENUM
  NMT_STATUS_COUNT
} nmt_status;

/* The enum name as a string ("NMT_ERR_CONFIG"); "NMT_UNKNOWN" for out-of-range values. */
const char *nmt_status_str(nmt_status s);
/* A one-line description ("config error"). */
const char *nmt_status_desc(nmt_status s);
/* The process exit code main() uses for s (see NMT_STATUS_LIST). */
int nmt_status_exit_code(nmt_status s);

/* Records a formatted message as the calling thread's last error detail, logs it at error
 * level, and returns s, so call sites read `return nmt_errorf(NMT_ERR_DATA, "...", ...)`. */
nmt_status nmt_errorf(nmt_status s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The calling thread's last message recorded by nmt_errorf ("" if none). Thread-local. */
const char *nmt_last_error(void);
/* Clears the calling thread's last error message. */
void nmt_clear_error(void);

void nmt__trace(const char *file, int line, nmt_status s);

/* Propagate a failing status, logging "-> file:line" at debug level at each level. */
#define NMT_TRY(expr)                                   \
  do {                                                  \
    nmt_status nmt_try_s_ = (expr);                     \
    if (nmt_try_s_ != NMT_OK) {                         \
      nmt__trace(__FILE__, __LINE__, nmt_try_s_);       \
      return nmt_try_s_;                                \
    }                                                   \
  } while (0)

/* Like NMT_TRY but stores the status in `st` and jumps to `label` (cleanup paths). */
#define NMT_TRY_GOTO(st, expr, label)                   \
  do {                                                  \
    (st) = (expr);                                      \
    if ((st) != NMT_OK) {                               \
      nmt__trace(__FILE__, __LINE__, (st));             \
      goto label;                                       \
    }                                                   \
  } while (0)

#ifdef __cplusplus
}
#endif
#endif /* NMT_STATUS_H */
