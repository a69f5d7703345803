/* prof.c — the profiler's core (include/nmt/prof.h): the profiler and its per-thread tracks,
 * interned range names, the per-op push/pop path (timed on the sampled steps, NVTX on every
 * step), the device clock and NVTX hooks, and read access to the recorded events. The outputs
 * are in prof_trace.c (trace.json) and prof_table.c (the per-module table), the CPU peak in
 * prof_peak.c, the cost formulas in prof_cost.c; the structs they share in prof_impl.h.
 *
 * Concurrency. Everything a push/pop touches belongs to its track, which one thread uses at a
 * time; the profiler-level fields read on that path (nvtx switch, hook, window) are written
 * before the threads start. Only the name table is shared while threads run, and it is only
 * written under its mutex; an id reaches another thread through that mutex (nmt_prof_intern)
 * or through the thread creation that follows setup, so the name bytes are visible before the
 * id is. Outputs read the tracks after the threads are joined.
 *
 * Event arrays are allocated at nmt_prof_add_track; a sampled push appends to the array or,
 * if it is full, counts a drop. The open-range stack holds the index of each open range's
 * event, or -1 for one that was not recorded (unsampled step, dropped), so pop stays balanced
 * across step boundaries and drops. */
#include "nmt/prof.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/nvtx.h"
#include "prof_impl.h"

const char *nmt_prof_phase_str(nmt_prof_phase ph) {
  return ph == NMT_PROF_FWD ? "fwd" : ph == NMT_PROF_BWD ? "bwd" : "other";
}

/* ------------------------------------------------------------------------------------------ */
/* profiler and tracks */

void nmt_prof_options_default(nmt_prof_options *o) {
  memset(o, 0, sizeof *o);
  o->size = sizeof *o;
  o->nvtx = 1;
}

void nmt_prof_options_from_config(const nmt_config *c, nmt_prof_options *o) {
  nmt_prof_options_default(o);
  o->start_step = c->profile_start_step;
  o->stop_step = c->profile_stop_step;
  o->nvtx = c->profile_nvtx;
}

nmt_status nmt_prof_create(const nmt_prof_options *o, nmt_prof **out) {
  *out = NULL;
  if (o->size != sizeof *o)
    return nmt_errorf(NMT_ERR_USAGE, "profiler: options size %zu, expected %zu (rebuild)",
                      o->size, sizeof *o);
  long start = o->start_step, stop = o->stop_step;
  if (start > 0 && stop == 0) stop = start + 9;
  if (start < 0 || stop < 0 || o->max_names < 0 || (start > 0 && stop < start))
    return nmt_errorf(NMT_ERR_USAGE,
                      "profiler: bad window start_step = %ld, stop_step = %ld (max_names %d)",
                      o->start_step, o->stop_step, o->max_names);
  nmt_prof *p = calloc(1, sizeof *p);
  if (!p) return nmt_errorf(NMT_ERR_NOMEM, "profiler: out of host memory");
  p->start = start;
  p->stop = start > 0 ? stop : 0;
  p->nvtx = o->nvtx != 0;
  p->max_names = o->max_names > 0 ? o->max_names : 4096;
  p->names = calloc((size_t)p->max_names, sizeof *p->names);
  if (!p->names || pthread_mutex_init(&p->mu, NULL) != 0) {
    free(p->names);
    free(p);
    return nmt_errorf(NMT_ERR_NOMEM, "profiler: out of host memory (%d names)", o->max_names);
  }
  p->epoch = nmt__prof_host_ns();
  *out = p;
  return NMT_OK;
}

void nmt_prof_destroy(nmt_prof *p) {
  if (!p) return;
  for (int i = 0; i < p->n_tracks; i++) {
    free(p->tracks[i]->ev);
    free(p->tracks[i]->marks);
    free(p->tracks[i]);
  }
  free(p->tracks);
  pthread_mutex_destroy(&p->mu);
  free(p->names);
  free(p);
}

int nmt_prof_in_window(const nmt_prof *p, long step) {
  return p->start > 0 && step >= p->start && step <= p->stop;
}
long nmt_prof_start_step(const nmt_prof *p) { return p->start; }
long nmt_prof_stop_step(const nmt_prof *p) { return p->stop; }
int nmt_prof_nvtx_on(const nmt_prof *p) { return p->nvtx; }
int64_t nmt_prof_epoch_ns(const nmt_prof *p) { return p->epoch; }

nmt_status nmt_prof_add_track(nmt_prof *p, const char *name, size_t events_per_step,
                              nmt_prof_track **out) {
  *out = NULL;
  size_t len = strlen(name);
  if (len == 0 || len >= sizeof(((nmt_prof_track *)0)->name))
    return nmt_errorf(NMT_ERR_USAGE, "profiler: track name '%s' must have 1..31 characters",
                      name);
  if (p->n_tracks == p->cap_tracks) {
    int cap = p->cap_tracks ? 2 * p->cap_tracks : 8;
    nmt_prof_track **t = realloc(p->tracks, (size_t)cap * sizeof *t);
    if (!t) return nmt_errorf(NMT_ERR_NOMEM, "profiler: out of host memory");
    p->tracks = t;
    p->cap_tracks = cap;
  }
  nmt_prof_track *t = calloc(1, sizeof *t);
  if (!t) return nmt_errorf(NMT_ERR_NOMEM, "profiler: out of host memory");
  size_t window = p->start > 0 ? (size_t)(p->stop - p->start + 1) : 0;
  size_t cap = 0;
  if (window > 0 && events_per_step > 0)
    cap = events_per_step > NMT_PROF_MAX_EVENTS / window ? NMT_PROF_MAX_EVENTS
                                                          : events_per_step * window;
  if (cap > 0 && !(t->ev = malloc(cap * sizeof *t->ev))) {
    free(t);
    return nmt_errorf(NMT_ERR_NOMEM, "profiler: no memory for %zu events of track '%s'", cap,
                      name);
  }
  memcpy(t->name, name, len + 1);
  t->p = p;
  t->cap = cap;
  t->index = p->n_tracks;
  t->nvtx = p->nvtx;
  p->tracks[p->n_tracks++] = t;
  *out = t;
  return NMT_OK;
}

const char *nmt_prof_track_name(const nmt_prof_track *t) { return t->name; }
nmt_prof *nmt_prof_track_profiler(nmt_prof_track *t) { return t->p; }
size_t nmt_prof_track_capacity(const nmt_prof_track *t) { return t->cap; }
int nmt_prof_n_tracks(const nmt_prof *p) { return p->n_tracks; }
nmt_prof_track *nmt_prof_get_track(nmt_prof *p, int i) {
  return i >= 0 && i < p->n_tracks ? p->tracks[i] : NULL;
}

nmt_status nmt_prof_intern(nmt_prof *p, const char *name, int *id) {
  size_t len = strlen(name);
  if (len == 0 || len >= NMT_PROF_NAME_MAX)
    return nmt_errorf(NMT_ERR_USAGE, "profiler: range name '%s' must have 1..%d bytes", name,
                      NMT_PROF_NAME_MAX - 1);
  nmt_status st = NMT_OK;
  pthread_mutex_lock(&p->mu);
  int i = 0;
  while (i < p->n_names && strcmp(p->names[i], name)) i++;
  if (i == p->n_names) {
    if (p->n_names == p->max_names) {
      st = NMT_ERR_NOMEM;
    } else {
      memcpy(p->names[i], name, len + 1);
      p->n_names++;
    }
  }
  pthread_mutex_unlock(&p->mu);
  if (st != NMT_OK)
    return nmt_errorf(st, "profiler: the name table is full (%d names) at '%s'", p->max_names,
                      name);
  *id = i;
  return NMT_OK;
}

/* Unlocked: ids come from nmt_prof_intern, which published the bytes (see the top). */
const char *nmt_prof_name(const nmt_prof *p, int id) {
  return id >= 0 && id < p->max_names && p->names[id][0] ? p->names[id] : NULL;
}

void nmt_prof_set_nvtx_hook(nmt_prof *p, nmt_prof_nvtx_hook fn, void *user) {
  p->hook = fn;
  p->hook_user = user;
}

nmt_status nmt_prof_track_set_clock(nmt_prof_track *t, const nmt_prof_clock *clock) {
  free(t->marks);
  t->marks = NULL;
  t->has_clock = 0;
  if (!clock) return NMT_OK;
  if (!clock->mark || !clock->resolve)
    return nmt_errorf(NMT_ERR_USAGE, "profiler: track '%s': a clock needs mark and resolve",
                      t->name);
  if (t->cap > 0 && !(t->marks = malloc(2 * t->cap * sizeof *t->marks)))
    return nmt_errorf(NMT_ERR_NOMEM, "profiler: no memory for the marks of track '%s'",
                      t->name);
  t->clock = *clock;
  t->has_clock = 1;
  return NMT_OK;
}

void nmt_prof_track_bind_thread(nmt_prof_track *t) {
  if (!t) return;
  nmt_nvtx_name_thread(t->nvtx, t->name);
}

/* ------------------------------------------------------------------------------------------ */
/* the per-op path */

void nmt_prof_step_begin(nmt_prof_track *t, long step) {
  if (!t) return;
  t->step = step;
  t->sampled = nmt_prof_in_window(t->p, step);
  if (!t->sampled) return;
  t->n_steps++;
  t->step_first = t->n;
  if (t->has_clock && t->clock.step_begin)
    t->clock.step_begin(t->clock.user, nmt__prof_host_ns());
}

nmt_status nmt_prof_step_end(nmt_prof_track *t) {
  if (!t || !t->sampled) return NMT_OK;
  t->sampled = 0;
  size_t first = t->step_first, n = t->n - first;
  if (!t->has_clock || n == 0) return NMT_OK;
  NMT_TRY(t->clock.resolve(t->clock.user, 2 * first, 2 * n, t->marks));
  for (size_t i = 0; i < n; i++) {
    t->ev[first + i].t0 = t->marks[2 * i];
    t->ev[first + i].t1 = t->marks[2 * i + 1];
  }
  return NMT_OK;
}

int nmt_prof_track_sampling(const nmt_prof_track *t) { return t && t->sampled; }

void nmt_prof_push(nmt_prof_track *t, int name, nmt_prof_phase ph, double flops, double bytes) {
  if (!t) return;
  /* A bad id is a caller bug; it still opens a range (named so) to keep pops balanced. */
  const int valid = name >= 0 && name < t->p->max_names;
  if (t->nvtx) {
    const char *s = valid ? t->p->names[name] : "(bad range id)";
    nmt_nvtx_push(1, s);
    if (t->p->hook) t->p->hook(t->p->hook_user, t, s);
  }
  int32_t idx = -1;
  if (t->sampled && valid) {
    if (t->n < t->cap) {
      idx = (int32_t)t->n++;
      nmt__prof_event *e = &t->ev[idx];
      e->name = name;
      e->phase = (uint16_t)ph;
      e->depth = (uint16_t)t->depth;
      e->parent = t->depth > 0 && t->depth <= NMT_PROF_MAX_DEPTH ? t->stack[t->depth - 1] : -1;
      e->step = t->step;
      e->flops = flops;
      e->bytes = bytes;
      e->t1 = -1;
      if (t->has_clock) {
        e->t0 = -1;
        t->clock.mark(t->clock.user, 2 * (size_t)idx);
      } else {
        e->t0 = nmt__prof_host_ns();
      }
    } else {
      t->dropped++;
    }
  }
  if (t->depth < NMT_PROF_MAX_DEPTH)
    t->stack[t->depth] = idx;
  else
    t->too_deep++;
  t->depth++;
}

void nmt_prof_pop(nmt_prof_track *t) {
  if (!t) return;
  if (t->depth == 0) {
    t->unbalanced++;
    return;
  }
  t->depth--;
  if (t->depth < NMT_PROF_MAX_DEPTH) {
    int32_t idx = t->stack[t->depth];
    if (idx >= 0) {
      if (t->has_clock)
        t->clock.mark(t->clock.user, 2 * (size_t)idx + 1);
      else
        t->ev[idx].t1 = nmt__prof_host_ns();
    }
  }
  if (t->nvtx) {
    nmt_nvtx_pop(1);
    if (t->p->hook) t->p->hook(t->p->hook_user, t, NULL);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* event access */

size_t nmt_prof_track_n_events(const nmt_prof_track *t) { return t->n; }
size_t nmt_prof_track_dropped(const nmt_prof_track *t) { return t->dropped; }
long nmt_prof_track_n_steps(const nmt_prof_track *t) { return t->n_steps; }


void nmt_prof_track_event(const nmt_prof_track *t, size_t i, nmt_prof_event *out) {
  const nmt__prof_event *e = &t->ev[i];
  out->name = nmt_prof_name(t->p, e->name);
  out->phase = (nmt_prof_phase)e->phase;
  out->step = e->step;
  out->depth = e->depth;
  out->parent = e->parent;
  out->t0_ns = e->t0 >= 0 ? e->t0 - t->p->epoch : -1;
  out->t1_ns = nmt__prof_closed(e) ? e->t1 - t->p->epoch : -1;
  out->flops = e->flops;
  out->bytes = e->bytes;
}
