/* prof_table.c — the profiler's per-module table (include/nmt/prof.h): every track's events
 * aggregated per (name, phase) into time, FLOPs and bytes per step, achieved TFLOP/s and GB/s
 * and the roofline bound (nmt_prof_summarize), printed as text (profile.txt), with the
 * backend's counts the model reports (GEMM launches per micro-batch, scratch growths). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/prof.h"
#include "prof_impl.h"

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

/* Adds track k's closed events to the accumulators (index name * 3 + phase) and its counts to
 * *sum. child: scratch of t->n doubles, zeroed. Returns the track's ms per sampled step in its
 * outermost ranges (0 without sampled steps). */
static double add_track(const nmt_prof_track *t, int k, acc *a, double *child,
                        nmt_prof_summary *sum) {
  if (t->n_steps > sum->sampled_steps) sum->sampled_steps = t->n_steps;
  sum->events += t->n;
  sum->dropped += t->dropped;
  /* Children follow their parent in push order, so one pass in reverse sees every child's
   * duration before its parent's. */
  for (size_t i = t->n; i-- > 0;) {
    const nmt__prof_event *e = &t->ev[i];
    if (nmt__prof_closed(e) && e->parent >= 0) child[e->parent] += (double)(e->t1 - e->t0);
  }
  double outer_ns = 0;
  for (size_t i = 0; i < t->n; i++) {
    const nmt__prof_event *e = &t->ev[i];
    if (!nmt__prof_closed(e)) {
      sum->unclosed++;
      continue;
    }
    double d = (double)(e->t1 - e->t0);
    acc *r = &a[(size_t)e->name * 3 + e->phase];
    r->calls++;
    r->ns += d;
    r->self_ns += d - child[i];
    r->flops += nmt__prof_finite_or_zero(e->flops);
    r->bytes += nmt__prof_finite_or_zero(e->bytes);
    if (r->last_track != k) {
      r->last_track = k;
      r->steps += t->n_steps;
    }
    if (e->depth == 0) outer_ns += d;
  }
  return t->n_steps > 0 ? outer_ns / 1e6 / (double)t->n_steps : 0;
}

void nmt_prof_track_add_backend(nmt_prof_track *t, nmt_prof_phase ph,
                                const nmt_prof_backend_counts *c) {
  if (!t || !c || !t->sampled || (int)ph < 0 || (int)ph > 2) return;
  t->gemm_calls[ph] += c->gemm_calls;
  t->launches[ph] += c->launches;
  t->casts[ph] += c->casts;
  t->gemm_passes[ph]++;
  t->half_storage = c->half_storage;
  if (c->scratch_growths > t->scratch_growths) t->scratch_growths = c->scratch_growths;
}

/* The backend counts of every track into sum: per pass of each phase, their sum per
 * micro-batch (NAN where no pass was reported). */
static void add_backend(const nmt_prof *p, nmt_prof_summary *sum) {
  double calls[3] = {0, 0, 0}, launches[3] = {0, 0, 0}, casts[3] = {0, 0, 0};
  long passes[3] = {0, 0, 0};
  sum->half_storage = -1;
  for (int k = 0; k < p->n_tracks; k++) {
    const nmt_prof_track *t = p->tracks[k];
    for (int ph = 0; ph < 3; ph++) {
      calls[ph] += t->gemm_calls[ph];
      launches[ph] += t->launches[ph];
      casts[ph] += t->casts[ph];
      passes[ph] += t->gemm_passes[ph];
    }
    if (t->scratch_growths > sum->scratch_growths) sum->scratch_growths = t->scratch_growths;
    if (t->gemm_passes[NMT_PROF_FWD] + t->gemm_passes[NMT_PROF_BWD] > 0)
      sum->half_storage = t->half_storage;
  }
  const long pf = passes[NMT_PROF_FWD], pb = passes[NMT_PROF_BWD];
  sum->gemm_per_fwd = pf ? calls[NMT_PROF_FWD] / pf : NAN;
  sum->gemm_per_bwd = pb ? calls[NMT_PROF_BWD] / pb : NAN;
  sum->gemm_per_micro_batch = sum->gemm_per_fwd + sum->gemm_per_bwd;
  sum->launches_per_fwd = pf ? launches[NMT_PROF_FWD] / pf : NAN;
  sum->launches_per_bwd = pb ? launches[NMT_PROF_BWD] / pb : NAN;
  sum->launches_per_micro_batch = sum->launches_per_fwd + sum->launches_per_bwd;
  sum->casts_per_micro_batch =
      (pf ? casts[NMT_PROF_FWD] / pf : NAN) + (pb ? casts[NMT_PROF_BWD] / pb : NAN);
}

/* The step time the %step column divides by: the "step" range's ms per step when one was
 * recorded, else outer_ms (the largest per-step sum of a track's outermost ranges). */
static double step_ms(const nmt_prof *p, int n_names, const acc *a, double outer_ms) {
  int step_id = -1;
  for (int i = 0; i < n_names; i++)
    if (!strcmp(p->names[i], "step")) step_id = i;
  if (step_id >= 0) {
    for (int ph = 0; ph < 3; ph++) {
      const acc *r = &a[(size_t)step_id * 3 + ph];
      if (r->calls > 0 && r->steps > 0) return r->ns / 1e6 / (double)r->steps;
    }
  }
  return outer_ms;
}

/* Row w from accumulator r of (name, ph), against sum's step time and peaks. */
static void fill_row(const acc *r, const char *name, nmt_prof_phase ph,
                     const nmt_prof_summary *sum, nmt_prof_row *w) {
  double steps = r->steps > 0 ? (double)r->steps : 1.0;
  w->name = name;
  w->phase = ph;
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
    double roof = compute ? sum->peak_tflops : w->intensity * sum->peak_gbps * 1e9 / 1e12;
    w->pct_roof = roof > 0 ? 100.0 * w->tflops / roof : 0;
    if (r->flops == 0) w->pct_roof = 100.0 * w->gbps / sum->peak_gbps;
  }
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
  if (!a) return nmt_errorf(NMT_ERR_NOMEM, "profiler: out of host memory");
  for (size_t i = 0; i < n_acc; i++) a[i].last_track = -1;

  double outer_ms = 0;
  for (int k = 0; k < p->n_tracks; k++) {
    const nmt_prof_track *t = p->tracks[k];
    double *child = calloc(t->n ? t->n : 1, sizeof *child);
    if (!child) {
      free(a);
      return nmt_errorf(NMT_ERR_NOMEM, "profiler: out of host memory");
    }
    double ms = add_track(t, k, a, child, sum);
    free(child);
    if (ms > outer_ms) outer_ms = ms;
  }
  sum->step_ms = step_ms(p, n_names, a, outer_ms);
  add_backend(p, sum);

  int n = 0;
  for (size_t i = 0; i < n_acc; i++) n += a[i].calls > 0;
  nmt_prof_row *out = calloc(n ? (size_t)n : 1, sizeof *out);
  if (!out) {
    free(a);
    return nmt_errorf(NMT_ERR_NOMEM, "profiler: out of host memory");
  }
  int j = 0;
  for (size_t i = 0; i < n_acc; i++)
    if (a[i].calls > 0) fill_row(&a[i], p->names[i / 3], (nmt_prof_phase)(i % 3), sum, &out[j++]);
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
  if (!isnan(s.gemm_per_micro_batch))
    fprintf(f, "# GEMM calls per micro-batch: %.1f (forward %.1f, backward %.1f; the backend's "
               "launch counter on sampled steps, a batched call counting once); scratch growths "
               "after setup: %.0f\n", s.gemm_per_micro_batch, s.gemm_per_fwd, s.gemm_per_bwd,
            s.scratch_growths);
  if (!isnan(s.launches_per_micro_batch))
    fprintf(f, "# device kernels per micro-batch: %.1f (forward %.1f, backward %.1f); cast kernels "
               "per micro-batch: %.1f; activation storage: %s\n",
            s.launches_per_micro_batch, s.launches_per_fwd, s.launches_per_bwd,
            s.casts_per_micro_batch, s.half_storage == 1 ? "half" : "fp32");
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
