/* clock.c — the host's monotonic clock in seconds (include/nmt/clock.h). */
#include "nmt/clock.h"

#include <time.h>

double nmt_clock_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
