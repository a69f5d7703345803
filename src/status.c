/* status.c — status strings, exit codes and the per-thread last-error message. */
#include "nmt/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "nmt/log.h"

static const struct {
  const char *name;
  int code;
  const char *desc;
} table[] = {
#define NMT_X_ROW(name, code, desc) {#name, code, desc},
    NMT_STATUS_LIST(NMT_X_ROW)
#undef NMT_X_ROW
};

static _Thread_local char last_error[1024];

const char *nmt_status_str(nmt_status s) {
  return (unsigned)s < NMT_STATUS_COUNT ? table[s].name : "NMT_UNKNOWN";
}

const char *nmt_status_desc(nmt_status s) {
  return (unsigned)s < NMT_STATUS_COUNT ? table[s].desc : "unknown status";
}

int nmt_status_exit_code(nmt_status s) { return (unsigned)s < NMT_STATUS_COUNT ? table[s].code : 1; }

nmt_status nmt_errorf(nmt_status s, const char *fmt, ...) {
  /* Formatted apart first: callers wrap the previous message, nmt_errorf(s, "...: %s",
   * nmt_last_error()), and vsnprintf must not read the buffer it writes. */
  char msg[sizeof last_error];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  memcpy(last_error, msg, sizeof msg);
  nmt__log_new_error(last_error);
  return s;
}

const char *nmt_last_error(void) { return last_error; }

void nmt_clear_error(void) { last_error[0] = 0; }

void nmt__trace(const char *file, int line, nmt_status s) {
  nmt_log(NMT_LOG_DEBUG, "-> %s:%d (%s)", file, line, nmt_status_str(s));
}
