/* prof_impl.h — the profiler's structs, shared by its files in src/util/ (internal).
 *
 * prof.c owns them (create, tracks, names, the per-op path); prof_trace.c and prof_table.c
 * read them after the threads are joined; prof_peak.c only needs the clock. The concurrency
 * rules are at the top of prof.c.
 *
 * defines: nmt__prof_event, struct nmt_prof_track, struct nmt_prof, nmt__prof_host_ns,
 *          nmt__prof_closed, nmt__prof_finite_or_zero
 */
#ifndef NMT_PROF_IMPL_H
#define NMT_PROF_IMPL_H

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "nmt/prof.h"

/* One recorded range: host times, or a device clock's once resolved at step end. */
typedef struct {
  int64_t t0, t1; /* ns, CLOCK_MONOTONIC; t1 = -1 while open */
  double flops, bytes;
  long step;
  int32_t name, parent;
  uint16_t phase, depth;
} nmt__prof_event;

struct nmt_prof_track {
  nmt_prof *p;
  char name[32];
  int index;
  nmt__prof_event *ev;
  size_t cap, n, dropped;
  int32_t stack[NMT_PROF_MAX_DEPTH];
  int depth;
  size_t too_deep, unbalanced;
  int sampled;
  long step, n_steps;
  size_t step_first; /* first event of the current sampled step (device clock resolve) */
  int nvtx;
  int has_clock;
  nmt_prof_clock clock;
  int64_t *marks; /* 2*cap resolve scratch, with a device clock */
  /* nmt_prof_track_add_backend (prof_table.c): GEMM launches and passes per phase, and the
   * largest scratch growth count reported, on sampled steps. */
  double gemm_calls[3], launches[3], casts[3];
  long gemm_passes[3];
  double scratch_growths;
  int half_storage; /* the last pass's (-1: none reported) */
};

struct nmt_prof {
  long start, stop; /* window; start = 0: none */
  int nvtx;
  int64_t epoch;
  nmt_prof_nvtx_hook hook;
  void *hook_user;
  pthread_mutex_t mu; /* the name table */
  char (*names)[NMT_PROF_NAME_MAX];
  int n_names, max_names;
  nmt_prof_track **tracks;
  int n_tracks, cap_tracks;
};

/* CLOCK_MONOTONIC in ns. Inline: the per-op path reads it on every sampled push and pop. */
static inline int64_t nmt__prof_host_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* 1 iff the event has both times (closed, and resolved with a device clock). */
static inline int nmt__prof_closed(const nmt__prof_event *e) {
  return e->t0 >= 0 && e->t1 >= e->t0;
}

/* Costs are summed and written as JSON numbers, which have no inf or NaN. */
static inline double nmt__prof_finite_or_zero(double x) { return isfinite(x) ? x : 0.0; }

#endif /* NMT_PROF_IMPL_H */
