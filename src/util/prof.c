/* prof.c — the built-in profiler (include/nmt/prof.h): per-thread tracks of nested ranges,
 * timed on the sampled steps, NVTX on every step; Chrome trace and roofline table writers;
 * the peak measurement of a CPU worker; the FLOP/byte formulas of the ops.
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

#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nmt/nvtx.h"

/* OpenBLAS extensions; declared here too because a netlib cblas.h (another Debian
 * alternative) lacks them. */
int openblas_get_num_threads(void);
void openblas_set_num_threads(int num_threads);

typedef struct {
  int64_t t0, t1; /* ns, CLOCK_MONOTONIC; t1 = -1 while open */
  double flops, bytes;
  long step;
  int32_t name, parent;
  uint16_t phase, depth;
} prof_event;

struct nmt_prof_track {
  nmt_prof *p;
  char name[32];
  int index;
  prof_event *ev;
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

static int64_t host_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

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
  p->epoch = host_ns();
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
  if (t->has_clock && t->clock.step_begin) t->clock.step_begin(t->clock.user, host_ns());
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
      prof_event *e = &t->ev[idx];
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
        e->t0 = host_ns();
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
        t->ev[idx].t1 = host_ns();
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

static int closed(const prof_event *e) { return e->t0 >= 0 && e->t1 >= e->t0; }

void nmt_prof_track_event(const nmt_prof_track *t, size_t i, nmt_prof_event *out) {
  const prof_event *e = &t->ev[i];
  out->name = nmt_prof_name(t->p, e->name);
  out->phase = (nmt_prof_phase)e->phase;
  out->step = e->step;
  out->depth = e->depth;
  out->parent = e->parent;
  out->t0_ns = e->t0 >= 0 ? e->t0 - t->p->epoch : -1;
  out->t1_ns = closed(e) ? e->t1 - t->p->epoch : -1;
  out->flops = e->flops;
  out->bytes = e->bytes;
}

/* ------------------------------------------------------------------------------------------ */
/* Chrome trace */

/* JSON string contents: quote, backslash and every byte outside printable ASCII escaped
 * (bytes >= 0x7f as \u00XX, i.e. read as Latin-1), so the file is valid JSON whatever the
 * names hold. */
static void json_escaped(FILE *f, const char *s) {
  for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
    if (*c == '"' || *c == '\\')
      fprintf(f, "\\%c", *c);
    else if (*c < 0x20 || *c >= 0x7f)
      fprintf(f, "\\u%04x", *c);
    else
      fputc(*c, f);
  }
}

static double finite_or_zero(double x) { return isfinite(x) ? x : 0.0; }

nmt_status nmt_prof_write_trace(const nmt_prof *p, const char *path) {
  FILE *f = fopen(path, "w");
  if (!f) return nmt_errorf(NMT_ERR_IO, "profiler: cannot write the trace '%s'", path);
  fprintf(f, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
  fprintf(f, "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 1, \"tid\": 0, "
             "\"args\": {\"name\": \"nmt\"}}");
  for (int k = 0; k < p->n_tracks; k++) {
    const nmt_prof_track *t = p->tracks[k];
    fprintf(f, ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 1, \"tid\": %d, "
               "\"args\": {\"name\": \"", k + 1);
    json_escaped(f, t->name);
    fprintf(f, "\"}},\n{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": 1, \"tid\": %d, "
               "\"args\": {\"sort_index\": %d}}", k + 1, k);
  }
  for (int k = 0; k < p->n_tracks; k++) {
    const nmt_prof_track *t = p->tracks[k];
    for (size_t i = 0; i < t->n; i++) {
      const prof_event *e = &t->ev[i];
      if (!closed(e)) continue;
      const char *ph = nmt_prof_phase_str((nmt_prof_phase)e->phase);
      fprintf(f, ",\n{\"name\": \"");
      json_escaped(f, p->names[e->name]);
      fprintf(f,
              "\", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": 1, \"tid\": %d, \"ts\": %.3f, "
              "\"dur\": %.3f, \"args\": {\"step\": %ld, \"phase\": \"%s\", \"flops\": %.17g, "
              "\"bytes\": %.17g}}",
              ph, k + 1, (double)(e->t0 - p->epoch) / 1e3, (double)(e->t1 - e->t0) / 1e3, e->step,
              ph, finite_or_zero(e->flops), finite_or_zero(e->bytes));
    }
  }
  fprintf(f, "\n]}\n");
  int bad = ferror(f);
  if (fclose(f) != 0 || bad)
    return nmt_errorf(NMT_ERR_IO, "profiler: error writing the trace '%s'", path);
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* the per-module table */

typedef struct {
  long calls;
  double ns, self_ns, flops, bytes;
  long steps;     /* sum of n_steps of the tracks that recorded the row */
  int last_track; /* to add each track's steps once */
} acc;

static int cmp_rows(const void *a, const void *b) {
  const nmt_prof_row *x = a, *y = b;
  if (x->ms_per_step != y->ms_per_step) return x->ms_per_step < y->ms_per_step ? 1 : -1;
  int c = strcmp(x->name, y->name);
  return c ? c : (int)x->phase - (int)y->phase;
}

nmt_status nmt_prof_summarize(const nmt_prof *p, double peak_tflops, double peak_gbps,
                              nmt_prof_summary *sum, nmt_prof_row **rows, int *n_rows) {
  *rows = NULL;
  *n_rows = 0;
  memset(sum, 0, sizeof *sum);
  sum->peak_tflops = peak_tflops;
  sum->peak_gbps = peak_gbps;
  if (peak_tflops > 0 && peak_gbps > 0) sum->ridge = peak_tflops * 1e12 / (peak_gbps * 1e9);

  pthread_mutex_lock((pthread_mutex_t *)&p->mu);
  int n_names = p->n_names;
  pthread_mutex_unlock((pthread_mutex_t *)&p->mu);
  size_t n_acc = (size_t)n_names * 3;
  acc *a = calloc(n_acc ? n_acc : 1, sizeof *a);
  double *child = NULL;
  if (!a) return nmt_errorf(NMT_ERR_NOMEM, "profiler: out of host memory");
  for (size_t i = 0; i < n_acc; i++) a[i].last_track = -1;

  double outer_ms = 0;
  for (int k = 0; k < p->n_tracks; k++) {
    const nmt_prof_track *t = p->tracks[k];
    if (t->n_steps > sum->sampled_steps) sum->sampled_steps = t->n_steps;
    sum->events += t->n;
    sum->dropped += t->dropped;
    free(child);
    child = calloc(t->n ? t->n : 1, sizeof *child);
    if (!child) {
      free(a);
      return nmt_errorf(NMT_ERR_NOMEM, "profiler: out of host memory");
    }
    /* Children follow their parent in push order, so one pass in reverse sees every child's
     * duration before its parent's. */
    for (size_t i = t->n; i-- > 0;) {
      const prof_event *e = &t->ev[i];
      if (closed(e) && e->parent >= 0) child[e->parent] += (double)(e->t1 - e->t0);
    }
    double outer_ns = 0;
    for (size_t i = 0; i < t->n; i++) {
      const prof_event *e = &t->ev[i];
      if (!closed(e)) {
        sum->unclosed++;
        continue;
      }
      double d = (double)(e->t1 - e->t0);
      acc *r = &a[(size_t)e->name * 3 + e->phase];
      r->calls++;
      r->ns += d;
      r->self_ns += d - child[i];
      r->flops += finite_or_zero(e->flops);
      r->bytes += finite_or_zero(e->bytes);
      if (r->last_track != k) {
        r->last_track = k;
        r->steps += t->n_steps;
      }
      if (e->depth == 0) outer_ns += d;
    }
    if (t->n_steps > 0 && outer_ns / 1e6 / (double)t->n_steps > outer_ms)
      outer_ms = outer_ns / 1e6 / (double)t->n_steps;
  }
  free(child);

  int n = 0, step_id = -1;
  for (int i = 0; i < n_names; i++)
    if (!strcmp(p->names[i], "step")) step_id = i;
  for (size_t i = 0; i < n_acc; i++) n += a[i].calls > 0;
  sum->step_ms = outer_ms;
  if (step_id >= 0) {
    for (int ph = 0; ph < 3; ph++) {
      const acc *r = &a[(size_t)step_id * 3 + ph];
      if (r->calls > 0 && r->steps > 0) {
        sum->step_ms = r->ns / 1e6 / (double)r->steps;
        break;
      }
    }
  }

  nmt_prof_row *out = calloc(n ? (size_t)n : 1, sizeof *out);
  if (!out) {
    free(a);
    return nmt_errorf(NMT_ERR_NOMEM, "profiler: out of host memory");
  }
  int j = 0;
  for (size_t i = 0; i < n_acc; i++) {
    const acc *r = &a[i];
    if (r->calls == 0) continue;
    nmt_prof_row *w = &out[j++];
    double steps = r->steps > 0 ? (double)r->steps : 1.0;
    w->name = p->names[i / 3];
    w->phase = (nmt_prof_phase)(i % 3);
    w->calls = r->calls;
    w->steps = r->steps;
    w->calls_per_step = (double)r->calls / steps;
    w->ms_per_step = r->ns / 1e6 / steps;
    w->self_ms_per_step = r->self_ns / 1e6 / steps;
    w->pct_step = sum->step_ms > 0 ? 100.0 * w->ms_per_step / sum->step_ms : 0;
    w->gflop_per_step = r->flops / 1e9 / steps;
    w->gb_per_step = r->bytes / 1e9 / steps;
    double s = r->ns / 1e9;
    w->tflops = s > 0 ? r->flops / s / 1e12 : 0;
    w->gbps = s > 0 ? r->bytes / s / 1e9 : 0;
    w->intensity = r->bytes > 0 ? r->flops / r->bytes : 0;
    w->bound = "-";
    if ((r->flops > 0 || r->bytes > 0) && sum->ridge > 0) {
      int compute = r->bytes == 0 || w->intensity >= sum->ridge;
      w->bound = compute ? "compute" : "memory";
      /* Roofline (Williams et al. 2009): attainable = min(peak, intensity * bandwidth). */
      double roof = compute ? peak_tflops : w->intensity * peak_gbps * 1e9 / 1e12;
      w->pct_roof = roof > 0 ? 100.0 * w->tflops / roof : 0;
      if (r->flops == 0) w->pct_roof = 100.0 * w->gbps / peak_gbps;
    }
  }
  free(a);
  qsort(out, (size_t)n, sizeof *out, cmp_rows);
  *rows = out;
  *n_rows = n;
  return NMT_OK;
}

nmt_status nmt_prof_print_table(const nmt_prof *p, double peak_tflops, double peak_gbps,
                                FILE *f) {
  nmt_prof_summary s;
  nmt_prof_row *rows;
  int n;
  NMT_TRY(nmt_prof_summarize(p, peak_tflops, peak_gbps, &s, &rows, &n));
  int w = 24;
  for (int i = 0; i < n; i++)
    if ((int)strlen(rows[i].name) > w) w = (int)strlen(rows[i].name);
  if (p->start > 0)
    fprintf(f, "# nmt profile: window steps %ld..%ld, %ld sampled step(s)\n", p->start, p->stop,
            s.sampled_steps);
  else
    fprintf(f, "# nmt profile: no window ([profile] start_step = 0): nothing sampled\n");
  fprintf(f, "# tracks:");
  for (int k = 0; k < p->n_tracks; k++)
    fprintf(f, "%s %s (%ld steps, %zu events, %zu dropped)", k ? "," : "", p->tracks[k]->name,
            p->tracks[k]->n_steps, p->tracks[k]->n, p->tracks[k]->dropped);
  fprintf(f, "\n");
  if (s.dropped > 0 || s.unclosed > 0)
    fprintf(f, "# WARNING: %zu event(s) dropped (full arrays), %zu never closed: figures are low\n",
            s.dropped, s.unclosed);
  if (s.ridge > 0)
    fprintf(f, "# peak per device: %.4g TFLOP/s, %.4g GB/s: ridge point %.3g FLOP/B "
               "(intensity >= ridge: compute-bound)\n", peak_tflops, peak_gbps, s.ridge);
  else
    fprintf(f, "# peaks unknown: no bound column\n");
  fprintf(f, "# per step and track (device); time inclusive (ranges nest), self = minus the "
             "ranges inside; %%step of %.3f ms\n", s.step_ms);
  fprintf(f, "%-*s %-5s %9s %10s %10s %6s %11s %9s %9s %9s %9s %6s %s\n", w, "name", "phase",
          "calls", "ms", "self_ms", "%step", "GFLOP", "GB", "TFLOP/s", "GB/s", "FLOP/B", "%roof",
          "bound");
  for (int i = 0; i < n; i++) {
    const nmt_prof_row *r = &rows[i];
    fprintf(f, "%-*s %-5s %9.2f %10.3f %10.3f %6.1f %11.4f %9.4f %9.4f %9.2f %9.2f %6.1f %s\n",
            w, r->name, nmt_prof_phase_str(r->phase), r->calls_per_step, r->ms_per_step,
            r->self_ms_per_step, r->pct_step, r->gflop_per_step, r->gb_per_step, r->tflops,
            r->gbps, r->intensity, r->pct_roof, r->bound);
  }
  free(rows);
  if (ferror(f)) return nmt_errorf(NMT_ERR_IO, "profiler: error writing the table");
  return NMT_OK;
}

nmt_status nmt_prof_write_table(const nmt_prof *p, double peak_tflops, double peak_gbps,
                                const char *path) {
  FILE *f = fopen(path, "w");
  if (!f) return nmt_errorf(NMT_ERR_IO, "profiler: cannot write the table '%s'", path);
  nmt_status st = nmt_prof_print_table(p, peak_tflops, peak_gbps, f);
  if (fclose(f) != 0 && st == NMT_OK)
    st = nmt_errorf(NMT_ERR_IO, "profiler: error writing the table '%s'", path);
  return st;
}

/* ------------------------------------------------------------------------------------------ */
/* peaks of one CPU worker */

nmt_status nmt_prof_measure_cpu_peak(double *tflops, double *gbps) {
  enum { N = 512, GEMM_REPS = 8, COPY_REPS = 4 };
  const size_t copy_bytes = (size_t)64 << 20;
  float *a = malloc(3 * (size_t)N * N * sizeof *a);
  char *src = malloc(copy_bytes), *dst = malloc(copy_bytes);
  if (!a || !src || !dst) {
    free(a);
    free(src);
    free(dst);
    return nmt_errorf(NMT_ERR_NOMEM, "profiler: no memory for the peak measurement");
  }
  float *b = a + (size_t)N * N, *c = b + (size_t)N * N;
  for (size_t i = 0; i < 2 * (size_t)N * N; i++) a[i] = (float)(i % 7) * 0.25f - 0.75f;
  int threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
  double best = INFINITY;
  for (int r = 0; r < GEMM_REPS + 1; r++) { /* the first call warms caches and code */
    int64_t t0 = host_ns();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, N, N, 1.0f, a, N, b, N, 0.0f, c, N);
    double s = (double)(host_ns() - t0) / 1e9;
    if (r > 0 && s < best) best = s;
  }
  openblas_set_num_threads(threads);
  *tflops = 2.0 * N * N * N / best / 1e12;
  memset(src, 1, copy_bytes); /* first touch outside the timing */
  memset(dst, 0, copy_bytes);
  best = INFINITY;
  for (int r = 0; r < COPY_REPS; r++) {
    src[r] = (char)r; /* a different copy each time, so none can be elided */
    int64_t t0 = host_ns();
    memcpy(dst, src, copy_bytes);
    double s = (double)(host_ns() - t0) / 1e9;
    if (dst[r] != (char)r) s = INFINITY;
    if (s < best) best = s;
  }
  *gbps = 2.0 * (double)copy_bytes / best / 1e9;
  free(a);
  free(src);
  free(dst);
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* cost formulas (sources in include/nmt/prof.h and docs/profiling.md) */

static nmt_prof_cost cost(double flops, double bytes) {
  nmt_prof_cost c = {flops, bytes};
  return c;
}

nmt_prof_cost nmt_prof_cost_matmul(nmt_prof_phase ph, double M, double K, double N, int bias) {
  if (ph == NMT_PROF_BWD)
    return cost(4 * M * N * K + (bias ? M * N : 0),
                4 * (M * N + 3 * M * K + 3 * N * K + (bias ? 2 * N : 0)));
  return cost(2 * M * N * K, 4 * (M * K + N * K + M * N + (bias ? N : 0)));
}

nmt_prof_cost nmt_prof_cost_attention(nmt_prof_phase ph, double B, double Tq, double Tk,
                                      double H, double dk) {
  const double C = H * dk, P = H * Tq * Tk;
  const double fwd = B * (4 * Tq * Tk * C + 3 * P);
  if (ph == NMT_PROF_BWD) return cost(2 * fwd, 4 * B * (4 * Tq * C + 6 * Tk * C + 3 * P));
  return cost(fwd, 4 * B * (2 * Tq * C + 2 * Tk * C + P));
}

nmt_prof_cost nmt_prof_cost_layernorm(nmt_prof_phase ph, double M, double C) {
  if (ph == NMT_PROF_BWD) return cost(12 * M * C, 4 * (4 * M * C + 5 * C + 2 * M));
  return cost(8 * M * C, 4 * (2 * M * C + 2 * C + 2 * M));
}

nmt_prof_cost nmt_prof_cost_embedding(nmt_prof_phase ph, double n_rows, double C) {
  (void)ph; /* the same tally both ways (see the header) */
  return cost(2 * n_rows * C, 4 * (3 * n_rows * C + n_rows));
}

nmt_prof_cost nmt_prof_cost_xent(double M, double V) {
  return cost(7 * M * V, 4 * (2 * M * V + 4 * M));
}

nmt_prof_cost nmt_prof_cost_elementwise(double n, double reads, double writes, double flops) {
  return cost(n * flops, 4 * n * (reads + writes));
}

nmt_prof_cost nmt_prof_cost_adamw(double n) { return cost(17 * n, 28 * n); }

nmt_prof_cost nmt_prof_cost_allreduce(double count, double ranks) {
  if (ranks <= 1) return cost(0, 0);
  double f = (ranks - 1) / ranks;
  return cost(f * count, 2 * f * 4 * count);
}

nmt_prof_cost nmt_prof_cost_copy(double bytes) { return cost(0, bytes); }
