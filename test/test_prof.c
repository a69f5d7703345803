/* test/test_prof.c — the built-in profiler (src/util/prof.c) and the model's ranges.
 *
 * Independent checks: the trace is parsed by Python's json module (a separate JSON parser),
 * with its thread_name metadata matched against the tracks that recorded; the model's range
 * names are compared with a list this file builds from the config (not with the model's own
 * list alone), in push order, and with the names NVTX was given; the generator's FLOPs with
 * 2·M·N·K worked out here from the batch shape; the self-time column with the inclusive times
 * it is derived from; losses and gradients with and without the profiler bitwise. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/model.h"
#include "nmt/prof.h"
#include "nmt/rng.h"
#include "test.h"

static const nmt_backend *BE = &nmt_backend_ref;

static nmt_prof *make_prof(long start, long stop, int nvtx) {
  nmt_prof_options o;
  nmt_prof_options_default(&o);
  o.start_step = start;
  o.stop_step = stop;
  o.nvtx = nvtx;
  nmt_prof *p = NULL;
  return nmt_prof_create(&o, &p) == NMT_OK ? p : NULL;
}

/* Records the NVTX names the profiler emits (the hook runs on the pushing thread). */
typedef struct {
  const char *names[4096];
  int n_push, n_pop;
} nvtx_log;

static void log_nvtx(void *user, const nmt_prof_track *t, const char *name) {
  (void)t;
  nvtx_log *l = user;
  if (!name) {
    l->n_pop++;
    return;
  }
  if (l->n_push < 4096) l->names[l->n_push] = name;
  l->n_push++;
}

static void spin_us(double us) {
  double t0 = (double)clock() / CLOCKS_PER_SEC;
  volatile double x = 0;
  while (((double)clock() / CLOCKS_PER_SEC - t0) * 1e6 < us) x += 1;
}

/* ------------------------------------------------------------------------------------------ */
/* a small model and batch on the ref backend */

typedef struct {
  nmt_model_cfg cfg;
  nmt_model *m;
  float *params, *grads;
  size_t n_params;
  int32_t *buf;
  nmt_batch b;
} rig;

static nmt_status rig_create(rig *r, nmt_norm_kind norm) {
  memset(r, 0, sizeof *r);
  nmt_model_cfg *c = &r->cfg;
  c->vocab = 29, c->d_model = 16, c->n_heads = 2, c->d_ff = 24, c->enc_layers = 2;
  c->dec_layers = 3, c->max_positions = 32, c->dropout = 0.1f, c->attn_dropout = 0.1f;
  c->relu_dropout = 0.1f, c->label_smoothing = 0.1f, c->norm = norm, c->ln_eps = 1e-5f;
  const int B = 3, Ts = 5, Tt = 6;
  r->n_params = nmt_model_num_params(c);
  NMT_TRY(nmt_model_create(c, BE, NULL, B * 8, 8, &r->m));
  NMT_TRY(BE->malloc(NULL, r->n_params * sizeof(float), (void **)&r->params));
  NMT_TRY(BE->malloc(NULL, (r->n_params + NMT_GRAD_EXTRA) * sizeof(float), (void **)&r->grads));
  nmt_model_init_params(c, 7, r->params); /* ref: device memory is host memory */
  NMT_TRY(BE->malloc(NULL, nmt_batch_ints(B, 8) * sizeof(int32_t), (void **)&r->buf));
  nmt_batch_layout(&r->b, r->buf, B, Ts, Tt);
  const int sl[3] = {5, 3, 4}, tl[3] = {6, 2, 5};
  uint64_t k = 0;
  for (int i = 0; i < B; i++) {
    r->b.src_lens[i] = sl[i];
    r->b.tgt_lens[i] = tl[i];
    for (int j = 0; j < Ts; j++)
      r->b.src[i * Ts + j] = j < sl[i] ? 4 + (int32_t)(nmt_rng_u32(3, 1, k++) % 25) : NMT_PAD_ID;
    for (int j = 0; j < Tt; j++) {
      r->b.tgt_in[i * Tt + j] =
          j >= tl[i] ? NMT_PAD_ID : j == 0 ? NMT_BOS_ID : 4 + (int32_t)(nmt_rng_u32(3, 2, k++) % 25);
      r->b.tgt_out[i * Tt + j] = j < tl[i] ? 4 + (int32_t)(nmt_rng_u32(3, 3, k++) % 25) : NMT_PAD_ID;
      r->b.tgt_tokens += j < tl[i];
    }
    r->b.src_tokens += sl[i];
  }
  return NMT_OK;
}

static void rig_free(rig *r) {
  nmt_model_destroy(r->m);
  if (r->params) BE->free(NULL, r->params);
  if (r->grads) BE->free(NULL, r->grads);
  if (r->buf) BE->free(NULL, r->buf);
  memset(r, 0, sizeof *r);
}

/* Zeroed grads, forward(train) + backward; host copy of grads and extra slots into out. */
static nmt_status rig_step(rig *r, uint64_t step, float *out) {
  size_t ng = r->n_params + NMT_GRAD_EXTRA;
  NMT_TRY(BE->memset_zero(NULL, r->grads, ng * sizeof(float)));
  NMT_TRY(nmt_model_forward(r->m, r->params, &r->b, 1, 11, step, r->grads + r->n_params));
  NMT_TRY(nmt_model_backward(r->m, r->params, r->grads, &r->b, NULL, NULL));
  return BE->copy_d2h(NULL, out, r->grads, ng * sizeof(float));
}

/* The module list from the config alone, in push order (see nmt/model.h). */
static int expected_names(const nmt_model_cfg *c, nmt_prof_phase ph, char out[][40]) {
  int n = 0, pre = c->norm == NMT_NORM_PRE;
  const char *enc[2] = {"self_attn", "ffn"}, *dec[3] = {"self_attn", "cross_attn", "ffn"};
  if (ph == NMT_PROF_FWD) {
    strcpy(out[n++], "encoder.embed");
    for (int l = 0; l < c->enc_layers; l++)
      for (int k = 0; k < 2; k++) snprintf(out[n++], 40, "encoder.%d.%s", l, enc[k]);
    if (pre) strcpy(out[n++], "encoder.final_ln");
    strcpy(out[n++], "decoder.embed");
    for (int l = 0; l < c->dec_layers; l++)
      for (int k = 0; k < 3; k++) snprintf(out[n++], 40, "decoder.%d.%s", l, dec[k]);
    if (pre) strcpy(out[n++], "decoder.final_ln");
    strcpy(out[n++], "generator.proj");
    strcpy(out[n++], "generator.xent");
  } else {
    strcpy(out[n++], "generator.proj");
    if (pre) strcpy(out[n++], "decoder.final_ln");
    for (int l = c->dec_layers - 1; l >= 0; l--)
      for (int k = 2; k >= 0; k--) snprintf(out[n++], 40, "decoder.%d.%s", l, dec[k]);
    strcpy(out[n++], "decoder.embed");
    if (pre) strcpy(out[n++], "encoder.final_ln");
    for (int l = c->enc_layers - 1; l >= 0; l--)
      for (int k = 1; k >= 0; k--) snprintf(out[n++], 40, "encoder.%d.%s", l, enc[k]);
    strcpy(out[n++], "encoder.embed");
  }
  return n;
}

/* ------------------------------------------------------------------------------------------ */

/* One sampled forward+backward: the recorded ranges are exactly the module list per
 * direction, in order, each once, top level, closed; NVTX saw the same names, balanced. */
static void model_ranges_case(nmt_norm_kind norm) {
  rig r;
  nmt_prof *p = make_prof(1, 1, 1);
  nvtx_log *log = calloc(1, sizeof *log);
  nmt_prof_track *t = NULL;
  float *g = NULL;
  NMT_ASSERT(p && log);
  nmt_prof_set_nvtx_hook(p, log_nvtx, log);
  nmt_status st = rig_create(&r, norm);
  if (st == NMT_OK) st = nmt_prof_add_track(p, "cpu0", 256, &t);
  if (st == NMT_OK) st = nmt_model_set_profiler(r.m, t);
  g = malloc((r.n_params + NMT_GRAD_EXTRA) * sizeof *g);
  if (st == NMT_OK && g) {
    nmt_prof_step_begin(t, 1);
    st = rig_step(&r, 1, g);
    if (st == NMT_OK) st = nmt_prof_step_end(t);
  }
  if (st != NMT_OK || !g) {
    nmt_test_fail(__FILE__, __LINE__, "step failed: %s", nmt_last_error());
    goto out;
  }
  char want[2][64][40];
  int n_want[2] = {expected_names(&r.cfg, NMT_PROF_FWD, want[0]),
                   expected_names(&r.cfg, NMT_PROF_BWD, want[1])};
  /* the model's own list agrees with the config's */
  for (int d = 0; d < 2; d++) {
    const char *got[64];
    int n = nmt_model_module_names(r.m, d ? NMT_PROF_BWD : NMT_PROF_FWD, got);
    if (n != n_want[d]) {
      nmt_test_fail(__FILE__, __LINE__, "module list %d: %d names, expected %d", d, n, n_want[d]);
      goto out;
    }
    for (int i = 0; i < n; i++)
      if (strcmp(got[i], want[d][i])) {
        nmt_test_fail(__FILE__, __LINE__, "module %d.%d: '%s', expected '%s'", d, i, got[i],
                      want[d][i]);
        goto out;
      }
    for (int i = 0; i < n; i++)
      for (int j = 0; j < i; j++)
        if (!strcmp(want[d][i], want[d][j])) {
          nmt_test_fail(__FILE__, __LINE__, "name '%s' twice", want[d][i]);
          goto out;
        }
  }
  size_t ne = nmt_prof_track_n_events(t);
  if (ne != (size_t)(n_want[0] + n_want[1]) || nmt_prof_track_dropped(t) != 0) {
    nmt_test_fail(__FILE__, __LINE__, "%zu events (%zu dropped), expected %d", ne,
                  nmt_prof_track_dropped(t), n_want[0] + n_want[1]);
    goto out;
  }
  for (size_t i = 0; i < ne; i++) {
    nmt_prof_event e;
    nmt_prof_track_event(t, i, &e);
    int d = i >= (size_t)n_want[0];
    const char *w = want[d][d ? i - (size_t)n_want[0] : i];
    if (strcmp(e.name, w) || e.phase != (d ? NMT_PROF_BWD : NMT_PROF_FWD) || e.depth != 0 ||
        e.parent != -1 || e.step != 1 || e.t1_ns < e.t0_ns || e.t0_ns < 0 || !(e.bytes > 0)) {
      nmt_test_fail(__FILE__, __LINE__,
                    "event %zu: '%s' %s depth %d step %ld t %lld..%lld bytes %g; expected '%s' %s",
                    i, e.name, nmt_prof_phase_str(e.phase), e.depth, e.step, (long long)e.t0_ns,
                    (long long)e.t1_ns, e.bytes, w, d ? "bwd" : "fwd");
      goto out;
    }
  }
  if (log->n_push != n_want[0] + n_want[1] || log->n_pop != log->n_push) {
    nmt_test_fail(__FILE__, __LINE__, "NVTX: %d pushes, %d pops, expected %d", log->n_push,
                  log->n_pop, n_want[0] + n_want[1]);
    goto out;
  }
  for (int i = 0; i < log->n_push; i++) {
    int d = i >= n_want[0];
    if (strcmp(log->names[i], want[d][d ? i - n_want[0] : i])) {
      nmt_test_fail(__FILE__, __LINE__, "NVTX name %d: '%s'", i, log->names[i]);
      goto out;
    }
  }
out:
  free(g);
  free(log);
  rig_free(&r);
  nmt_prof_destroy(p);
}

NMT_TEST(prof_model_ranges_post) { model_ranges_case(NMT_NORM_POST); }
NMT_TEST(prof_model_ranges_pre) { model_ranges_case(NMT_NORM_PRE); }

/* The generator's projection is one matmul (B*Tt, C) x (V, C)^T: its FLOPs in the table are
 * 2·M·N·K forward and 4·M·N·K backward, worked out here from the batch and the config. */
NMT_TEST(prof_matmul_flops) {
  rig r;
  nmt_prof *p = make_prof(2, 3, 0);
  nmt_prof_track *t = NULL;
  nmt_prof_row *rows = NULL;
  float *g = NULL;
  int n_rows = 0;
  NMT_ASSERT(p);
  nmt_status st = rig_create(&r, NMT_NORM_PRE);
  if (st == NMT_OK) st = nmt_prof_add_track(p, "cpu0", 128, &t);
  if (st == NMT_OK) st = nmt_model_set_profiler(r.m, t);
  g = malloc((r.n_params + NMT_GRAD_EXTRA) * sizeof *g);
  /* steps 1..3: the first is outside the window, the other two are averaged */
  for (long s = 1; s <= 3 && st == NMT_OK && g; s++) {
    nmt_prof_step_begin(t, s);
    st = rig_step(&r, (uint64_t)s, g);
    if (st == NMT_OK) st = nmt_prof_step_end(t);
  }
  nmt_prof_summary sum;
  if (st == NMT_OK && g) st = nmt_prof_summarize(p, 1.0, 100.0, &sum, &rows, &n_rows);
  if (st != NMT_OK || !g) {
    nmt_test_fail(__FILE__, __LINE__, "failed: %s", nmt_last_error());
  } else {
    const double M = (double)r.b.n_sent * r.b.tgt_len, K = r.cfg.d_model, N = r.cfg.vocab;
    int found = 0;
    for (int i = 0; i < n_rows; i++) {
      if (strcmp(rows[i].name, "generator.proj")) continue;
      double want = (rows[i].phase == NMT_PROF_FWD ? 2 : 4) * M * N * K;
      found++;
      if (rows[i].steps != 2 || rows[i].calls != 2 || rows[i].calls_per_step != 1.0)
        nmt_test_fail(__FILE__, __LINE__, "generator.proj %s: %ld calls over %ld steps",
                      nmt_prof_phase_str(rows[i].phase), rows[i].calls, rows[i].steps);
      if (fabs(rows[i].gflop_per_step * 1e9 - want) > 1e-9 * want)
        nmt_test_fail(__FILE__, __LINE__, "generator.proj %s: %.17g FLOP per step, expected %.17g",
                      nmt_prof_phase_str(rows[i].phase), rows[i].gflop_per_step * 1e9, want);
    }
    if (found != 2) nmt_test_fail(__FILE__, __LINE__, "%d generator.proj rows, expected 2", found);
    /* the raw events carry the exact integer count */
    for (size_t i = 0; i < nmt_prof_track_n_events(t); i++) {
      nmt_prof_event e;
      nmt_prof_track_event(t, i, &e);
      if (!strcmp(e.name, "generator.proj") && e.phase == NMT_PROF_FWD && e.flops != 2 * M * N * K)
        nmt_test_fail(__FILE__, __LINE__, "event flops %.17g != %.17g", e.flops, 2 * M * N * K);
    }
    if (sum.sampled_steps != 2) nmt_test_fail(__FILE__, __LINE__, "%ld sampled", sum.sampled_steps);
    /* ridge = 1e12 / 100e9 = 10 FLOP/B: a 16-wide projection is memory-bound, bound is set */
    for (int i = 0; i < n_rows; i++)
      if (strcmp(rows[i].bound, rows[i].intensity >= 10.0 ? "compute" : "memory"))
        nmt_test_fail(__FILE__, __LINE__, "%s: intensity %g, bound %s", rows[i].name,
                      rows[i].intensity, rows[i].bound);
  }
  free(rows);
  free(g);
  rig_free(&r);
  nmt_prof_destroy(p);
}

/* The profiler only observes: losses and gradients are bitwise the same with it off, on a
 * sampled step and on an unsampled one (dropout on, so the RNG sites are exercised). */
NMT_TEST(prof_model_bitwise) {
  for (int norm = 0; norm < 2; norm++) {
    rig r;
    nmt_prof *p = make_prof(1, 1, 1);
    nmt_prof_track *t = NULL;
    NMT_ASSERT(p);
    nmt_status st = rig_create(&r, norm ? NMT_NORM_PRE : NMT_NORM_POST);
    size_t ng = r.n_params + NMT_GRAD_EXTRA;
    float *off = malloc(ng * sizeof *off), *on = malloc(ng * sizeof *on);
    float *un = malloc(ng * sizeof *un);
    if (st == NMT_OK && off && on && un) st = rig_step(&r, 5, off);
    if (st == NMT_OK) st = nmt_prof_add_track(p, "cpu0", 256, &t);
    if (st == NMT_OK) st = nmt_model_set_profiler(r.m, t);
    if (st == NMT_OK) {
      nmt_prof_step_begin(t, 1);
      st = rig_step(&r, 5, on);
      if (st == NMT_OK) st = nmt_prof_step_end(t);
    }
    if (st == NMT_OK) {
      nmt_prof_step_begin(t, 2);
      st = rig_step(&r, 5, un);
      if (st == NMT_OK) st = nmt_prof_step_end(t);
    }
    if (st != NMT_OK || !off || !on || !un) {
      nmt_test_fail(__FILE__, __LINE__, "failed: %s", nmt_last_error());
    } else {
      size_t bad = 0, first = 0;
      for (size_t i = 0; i < ng; i++)
        if (memcmp(&off[i], &on[i], sizeof(float)) || memcmp(&off[i], &un[i], sizeof(float))) {
          if (!bad) first = i;
          bad++;
        }
      if (bad)
        nmt_test_fail(__FILE__, __LINE__, "norm %d: %zu of %zu floats differ, first at %zu: %.9g "
                      "/ %.9g / %.9g", norm, bad, ng, first, off[first], on[first], un[first]);
      if (!(off[r.n_params + NMT_GRAD_SLOT_LOSS] > 0))
        nmt_test_fail(__FILE__, __LINE__, "loss %g", off[r.n_params + NMT_GRAD_SLOT_LOSS]);
      if (nmt_prof_track_n_events(t) == 0)
        nmt_test_fail(__FILE__, __LINE__, "the sampled step recorded nothing");
    }
    free(off);
    free(on);
    free(un);
    rig_free(&r);
    nmt_prof_destroy(p);
    if (nmt_test_failed()) return;
  }
}

/* Outside the window nothing is recorded (NVTX still is); a full event array drops and counts;
 * nesting deeper than the stack and stray pops stay balanced. */
NMT_TEST(prof_unsampled_and_overflow) {
  nmt_prof *p = make_prof(5, 6, 1);
  nvtx_log *log = calloc(1, sizeof *log);
  NMT_ASSERT(p && log);
  nmt_prof_set_nvtx_hook(p, log_nvtx, log);
  nmt_prof_track *t;
  int a, b;
  NMT_ASSERT_OK(nmt_prof_add_track(p, "cpu0", 8, &t));
  NMT_ASSERT_EQ_INT(nmt_prof_track_capacity(t), 16); /* 8 per step x 2 window steps */
  NMT_ASSERT_OK(nmt_prof_intern(p, "a", &a));
  NMT_ASSERT_OK(nmt_prof_intern(p, "b", &b));

  nmt_prof_step_begin(t, 4);
  NMT_ASSERT(!nmt_prof_track_sampling(t));
  for (int i = 0; i < 5; i++) {
    nmt_prof_push(t, a, NMT_PROF_FWD, 1, 1);
    nmt_prof_pop(t);
  }
  NMT_ASSERT_OK(nmt_prof_step_end(t));
  NMT_ASSERT_EQ_INT(nmt_prof_track_n_events(t), 0);
  NMT_ASSERT_EQ_INT(nmt_prof_track_dropped(t), 0);
  NMT_ASSERT_EQ_INT(log->n_push, 5); /* NVTX on every step */
  NMT_ASSERT_EQ_INT(log->n_pop, 5);

  /* a range opened on an unsampled step and closed on a sampled one is not recorded */
  nmt_prof_push(t, b, NMT_PROF_OTHER, 0, 0);
  nmt_prof_step_begin(t, 5);
  NMT_ASSERT(nmt_prof_track_sampling(t));
  for (int i = 0; i < 10; i++) {
    nmt_prof_push(t, a, NMT_PROF_BWD, i, 2 * i);
    nmt_prof_pop(t);
  }
  nmt_prof_pop(t);
  NMT_ASSERT_OK(nmt_prof_step_end(t));
  NMT_ASSERT_EQ_INT(nmt_prof_track_n_events(t), 10);
  NMT_ASSERT_EQ_INT(nmt_prof_track_dropped(t), 0);
  for (size_t i = 0; i < 10; i++) {
    nmt_prof_event e;
    nmt_prof_track_event(t, i, &e);
    NMT_ASSERT(!strcmp(e.name, "a"));
    NMT_ASSERT_EQ_INT(e.depth, 1);
    NMT_ASSERT_EQ_INT(e.parent, -1);
    NMT_ASSERT_EQ_INT(e.flops, (double)i);
    NMT_ASSERT(e.t1_ns >= e.t0_ns && e.t0_ns >= 0);
  }

  /* step 6: deeper than the stack, then one stray pop; 6 more events fit, the rest drop */
  nmt_prof_step_begin(t, 6);
  int deep = NMT_PROF_MAX_DEPTH + 6;
  for (int i = 0; i < deep; i++) nmt_prof_push(t, b, NMT_PROF_OTHER, 0, 0);
  for (int i = 0; i < deep; i++) nmt_prof_pop(t);
  nmt_prof_pop(t); /* stray: counted, ignored */
  nmt_prof_push(t, a, NMT_PROF_FWD, 0, 0);
  nmt_prof_pop(t);
  NMT_ASSERT_OK(nmt_prof_step_end(t));
  NMT_ASSERT_EQ_INT(nmt_prof_track_n_events(t), 16);
  NMT_ASSERT_EQ_INT(nmt_prof_track_dropped(t), (deep - 6) + 1);
  nmt_prof_event e;
  nmt_prof_track_event(t, 10, &e);
  NMT_ASSERT_EQ_INT(e.depth, 0);
  NMT_ASSERT_EQ_INT(e.parent, -1);
  nmt_prof_track_event(t, 15, &e);
  NMT_ASSERT_EQ_INT(e.depth, 5);
  NMT_ASSERT_EQ_INT(e.parent, 14);
  NMT_ASSERT(e.t1_ns >= e.t0_ns && e.t0_ns >= 0); /* closed by the matching pop */
  NMT_ASSERT_EQ_INT(nmt_prof_track_n_steps(t), 2);

  /* step 7 is past the window */
  nmt_prof_step_begin(t, 7);
  nmt_prof_push(t, a, NMT_PROF_FWD, 0, 0);
  nmt_prof_pop(t);
  NMT_ASSERT_OK(nmt_prof_step_end(t));
  NMT_ASSERT_EQ_INT(nmt_prof_track_n_events(t), 16);
  NMT_ASSERT_EQ_INT(nmt_prof_track_dropped(t), (deep - 6) + 1);
  NMT_ASSERT_EQ_INT(nmt_prof_track_n_steps(t), 2);
  /* NVTX balanced: every push popped (the stray pop emitted nothing) */
  NMT_ASSERT_EQ_INT(log->n_pop, log->n_push);
  NMT_ASSERT_EQ_INT(log->n_push, 5 + 1 + 10 + deep + 1 + 1);

  /* NVTX off: the hook is not called; a NULL track is a no-op everywhere */
  nmt_prof_destroy(p);
  p = make_prof(1, 1, 0);
  NMT_ASSERT(p);
  memset(log, 0, sizeof *log);
  nmt_prof_set_nvtx_hook(p, log_nvtx, log);
  NMT_ASSERT_OK(nmt_prof_add_track(p, "cpu0", 4, &t));
  NMT_ASSERT_OK(nmt_prof_intern(p, "a", &a));
  nmt_prof_step_begin(t, 1);
  nmt_prof_push(t, a, NMT_PROF_FWD, 0, 0);
  nmt_prof_pop(t);
  NMT_ASSERT_OK(nmt_prof_step_end(t));
  NMT_ASSERT_EQ_INT(log->n_push + log->n_pop, 0);
  NMT_ASSERT_EQ_INT(nmt_prof_track_n_events(t), 1);
  nmt_prof_step_begin(NULL, 1);
  nmt_prof_push(NULL, a, NMT_PROF_FWD, 0, 0);
  nmt_prof_pop(NULL);
  NMT_ASSERT_OK(nmt_prof_step_end(NULL));
  nmt_prof_destroy(p);
  free(log);
}

/* ------------------------------------------------------------------------------------------ */
/* the trace: several threads, parsed by Python */

typedef struct {
  nmt_prof_track *t;
  int ids[4];
  long steps;
} thread_arg;

static void *track_thread(void *arg) {
  thread_arg *a = arg;
  nmt_prof_track_bind_thread(a->t);
  for (long s = 1; s <= a->steps; s++) {
    nmt_prof_step_begin(a->t, s);
    nmt_prof_push(a->t, a->ids[0], NMT_PROF_OTHER, 0, 0);
    for (int k = 1; k < 4; k++) {
      nmt_prof_push(a->t, a->ids[k], k == 2 ? NMT_PROF_BWD : NMT_PROF_FWD, 1e6 * k, 4e3 * k);
      spin_us(20);
      nmt_prof_pop(a->t);
    }
    nmt_prof_pop(a->t);
    if (nmt_prof_step_end(a->t) != NMT_OK) return a;
  }
  return NULL;
}

static const char CHECK_PY[] =
    "import json, sys\n"
    "d = json.load(open(sys.argv[1]))\n"
    "ev = d['traceEvents']\n"
    "names = {e['tid']: e['args']['name'] for e in ev if e['ph'] == 'M' and e['name'] == "
    "'thread_name'}\n"
    "x = [e for e in ev if e['ph'] == 'X']\n"
    "for e in x:\n"
    "    assert e['pid'] == 1 and e['dur'] >= 0 and e['ts'] >= 0, e\n"
    "    assert e['tid'] in names, e\n"
    "    assert e['args']['step'] in (1, 2), e\n"
    "    assert e['cat'] in ('fwd', 'bwd', 'other') and e['args']['flops'] >= 0, e\n"
    "recorded = sorted(set(names[e['tid']] for e in x))\n"
    "want = sorted(sys.argv[2].split(','))\n"
    "assert recorded == want, (recorded, want)\n"
    "assert sorted(names.values()) == sorted(want + sys.argv[3].split(',')), names\n"
    "assert any(e['name'] == 'we\"ird\\\\name\\n\\t\\u00e9' for e in x), 'escaping'\n"
    "assert len(x) == int(sys.argv[4]), len(x)\n";

NMT_TEST(prof_trace_json) {
  if (access("/usr/bin/python3", X_OK) != 0) NMT_SKIP("no /usr/bin/python3 to parse the JSON");
  nmt_prof *p = make_prof(1, 2, 1);
  NMT_ASSERT(p);
  const char *tn[3] = {"cpu0", "cpu1", "loader"};
  thread_arg args[3];
  nmt_prof_track *main_t, *idle;
  const char *rn[5] = {"step", "encoder.0.self_attn", "decoder.1.ffn", "we\"ird\\name\n\t\xe9",
                       "checkpoint"};
  int ids[5];
  for (int i = 0; i < 5; i++) NMT_ASSERT_OK(nmt_prof_intern(p, rn[i], &ids[i]));
  for (int i = 0; i < 3; i++) {
    NMT_ASSERT_OK(nmt_prof_add_track(p, tn[i], 8, &args[i].t));
    memcpy(args[i].ids, ids, sizeof args[i].ids);
    args[i].steps = 3; /* step 3 is outside the window */
  }
  NMT_ASSERT_OK(nmt_prof_add_track(p, "main", 4, &main_t));
  NMT_ASSERT_OK(nmt_prof_add_track(p, "idle", 4, &idle));
  pthread_t th[3];
  for (int i = 0; i < 3; i++) NMT_ASSERT(pthread_create(&th[i], NULL, track_thread, &args[i]) == 0);
  nmt_prof_track_bind_thread(main_t);
  nmt_prof_step_begin(main_t, 2);
  nmt_prof_push(main_t, ids[4], NMT_PROF_OTHER, 0, 1e6);
  spin_us(20);
  nmt_prof_pop(main_t);
  NMT_ASSERT_OK(nmt_prof_step_end(main_t));
  int failed = 0;
  for (int i = 0; i < 3; i++) {
    void *ret;
    pthread_join(th[i], &ret);
    failed |= ret != NULL;
  }
  NMT_ASSERT(!failed);
  for (int i = 0; i < 3; i++) {
    NMT_ASSERT_EQ_INT(nmt_prof_track_n_events(args[i].t), 8); /* 4 per sampled step */
    NMT_ASSERT_EQ_INT(nmt_prof_track_dropped(args[i].t), 0);
  }
  char path[1024], py[1024], cmd[4096];
  snprintf(path, sizeof path, "%s/trace.json", nmt_test_tmpdir());
  snprintf(py, sizeof py, "%s/check.py", nmt_test_tmpdir());
  NMT_ASSERT_OK(nmt_prof_write_trace(p, path));
  FILE *f = fopen(py, "w");
  NMT_ASSERT(f);
  fputs(CHECK_PY, f);
  fclose(f);
  snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s %s cpu0,cpu1,loader,main idle %d", py, path,
           3 * 8 + 1);
  int rc = system(cmd);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "%s: exit status %d", cmd, rc);
  NMT_ASSERT_EQ_STATUS(nmt_prof_write_trace(p, "/nonexistent-dir/trace.json"), NMT_ERR_IO);
  nmt_prof_destroy(p);
}

/* ------------------------------------------------------------------------------------------ */
/* the table */

/* Rows, self time and %step follow from the recorded times: step = gemm + copy + self. */
NMT_TEST(prof_table) {
  nmt_prof *p = make_prof(1, 3, 0);
  NMT_ASSERT(p);
  nmt_prof_track *t;
  int step, gemm, copy;
  NMT_ASSERT_OK(nmt_prof_add_track(p, "cpu0", 4, &t));
  NMT_ASSERT_OK(nmt_prof_intern(p, "step", &step));
  NMT_ASSERT_OK(nmt_prof_intern(p, "gemm", &gemm));
  NMT_ASSERT_OK(nmt_prof_intern(p, "copy", &copy));
  for (long s = 1; s <= 3; s++) {
    nmt_prof_step_begin(t, s);
    nmt_prof_push(t, step, NMT_PROF_OTHER, 0, 0);
    spin_us(100);
    nmt_prof_push(t, gemm, NMT_PROF_FWD, 2e9, 1e6); /* 2000 FLOP/B */
    spin_us(300);
    nmt_prof_pop(t);
    nmt_prof_push(t, copy, NMT_PROF_OTHER, 0, 4e8);
    spin_us(200);
    nmt_prof_pop(t);
    nmt_prof_pop(t);
    NMT_ASSERT_OK(nmt_prof_step_end(t));
  }
  nmt_prof_summary sum;
  nmt_prof_row *rows;
  int n;
  NMT_ASSERT_OK(nmt_prof_summarize(p, 2.0, 50.0, &sum, &rows, &n)); /* ridge 40 FLOP/B */
  int ok = n == 3;
  const nmt_prof_row *rs = NULL, *rg = NULL, *rc = NULL;
  for (int i = 0; ok && i < n; i++) {
    if (!strcmp(rows[i].name, "step")) rs = &rows[i];
    if (!strcmp(rows[i].name, "gemm")) rg = &rows[i];
    if (!strcmp(rows[i].name, "copy")) rc = &rows[i];
    if (i > 0 && rows[i].ms_per_step > rows[i - 1].ms_per_step) ok = 0; /* sorted */
  }
  ok = ok && rs && rg && rc;
  if (!ok) {
    free(rows);
    nmt_prof_destroy(p);
    NMT_ASSERT(ok);
  }
  NMT_ASSERT_NEAR(sum.ridge, 40.0, 1e-12);
  NMT_ASSERT_EQ_INT(sum.sampled_steps, 3);
  NMT_ASSERT_NEAR(rs->pct_step, 100.0, 1e-9);
  NMT_ASSERT_NEAR(sum.step_ms, rs->ms_per_step, 1e-12);
  NMT_ASSERT_NEAR(rs->self_ms_per_step + rg->ms_per_step + rc->ms_per_step, rs->ms_per_step,
                  1e-9 * rs->ms_per_step);
  NMT_ASSERT_NEAR(rg->self_ms_per_step, rg->ms_per_step, 1e-12);
  NMT_ASSERT(rs->self_ms_per_step > 0 && rg->ms_per_step > 0 && rc->ms_per_step > 0);
  NMT_ASSERT_NEAR(rg->calls_per_step, 1.0, 0);
  NMT_ASSERT_NEAR(rg->gflop_per_step, 2.0, 1e-12);
  NMT_ASSERT_NEAR(rc->gb_per_step, 0.4, 1e-12);
  NMT_ASSERT_NEAR(rg->tflops, 2.0 / rg->ms_per_step, 1e-9 * rg->tflops); /* 2e9 FLOP / ms */
  NMT_ASSERT_NEAR(rc->gbps, 0.4e3 / rc->ms_per_step, 1e-9 * rc->gbps);
  NMT_ASSERT(!strcmp(rg->bound, "compute"));
  NMT_ASSERT(!strcmp(rc->bound, "memory"));
  NMT_ASSERT(!strcmp(rs->bound, "-"));
  NMT_ASSERT_NEAR(rg->pct_roof, 100.0 * rg->tflops / 2.0, 1e-9 * rg->pct_roof);
  NMT_ASSERT_NEAR(rc->pct_roof, 100.0 * rc->gbps / 50.0, 1e-9 * rc->pct_roof);
  free(rows);

  char path[1024];
  snprintf(path, sizeof path, "%s/profile.txt", nmt_test_tmpdir());
  NMT_ASSERT_OK(nmt_prof_write_table(p, 2.0, 50.0, path));
  {
    FILE *f = fopen(path, "r");
    NMT_ASSERT(f);
    char line[512];
    int header = 0, gemm_line = 0, lines = 0;
    while (fgets(line, sizeof line, f)) {
      lines++;
      if (strstr(line, "window steps 1..3")) header = 1;
      if (!strncmp(line, "gemm ", 5) && strstr(line, " fwd ") && strstr(line, "compute")) gemm_line = 1;
    }
    fclose(f);
    NMT_ASSERT(header && gemm_line);
    NMT_ASSERT(lines >= 3 + 4);
  }
  nmt_prof_destroy(p);
}

/* A device clock: marks only on sampled steps, resolved once per sampled step, and the
 * events take the resolved times. The fake clock's time of mark i is 1000 * (i + 1) ns
 * after the step's anchor. */
typedef struct {
  long marks, resolves, begins;
  int64_t anchor;
  size_t max_mark;
} fake_clock;

static void fc_mark(void *u, size_t i) {
  fake_clock *c = u;
  c->marks++;
  if (i > c->max_mark) c->max_mark = i;
}
static void fc_begin(void *u, int64_t host) {
  fake_clock *c = u;
  c->begins++;
  c->anchor = host;
}
static nmt_status fc_resolve(void *u, size_t first, size_t n, int64_t *t) {
  fake_clock *c = u;
  c->resolves++;
  for (size_t k = 0; k < n; k++) t[k] = c->anchor + 1000 * (int64_t)(first + k + 1);
  return NMT_OK;
}

NMT_TEST(prof_device_clock) {
  nmt_prof *p = make_prof(2, 2, 0);
  NMT_ASSERT(p);
  nmt_prof_track *t;
  int a;
  fake_clock fc = {0};
  nmt_prof_clock clk = {.user = &fc, .mark = fc_mark, .step_begin = fc_begin,
                        .resolve = fc_resolve};
  NMT_ASSERT_OK(nmt_prof_add_track(p, "gpu0", 4, &t));
  NMT_ASSERT_OK(nmt_prof_track_set_clock(t, &clk));
  NMT_ASSERT_OK(nmt_prof_intern(p, "a", &a));
  for (long s = 1; s <= 3; s++) {
    nmt_prof_step_begin(t, s);
    for (int i = 0; i < 2; i++) {
      nmt_prof_push(t, a, NMT_PROF_FWD, 0, 0);
      nmt_prof_pop(t);
    }
    NMT_ASSERT_OK(nmt_prof_step_end(t));
  }
  NMT_ASSERT_EQ_INT(fc.begins, 1);
  NMT_ASSERT_EQ_INT(fc.marks, 4);
  NMT_ASSERT_EQ_INT(fc.resolves, 1);
  NMT_ASSERT_EQ_INT(fc.max_mark, 3);
  NMT_ASSERT_EQ_INT(nmt_prof_track_n_events(t), 2);
  for (size_t i = 0; i < 2; i++) {
    nmt_prof_event e;
    nmt_prof_track_event(t, i, &e);
    int64_t base = fc.anchor - nmt_prof_epoch_ns(p);
    NMT_ASSERT_EQ_INT(e.t0_ns, base + 1000 * (int64_t)(2 * i + 1));
    NMT_ASSERT_EQ_INT(e.t1_ns, base + 1000 * (int64_t)(2 * i + 2));
  }
  nmt_prof_clock bad = {.user = &fc, .mark = fc_mark};
  NMT_ASSERT_EQ_STATUS(nmt_prof_track_set_clock(t, &bad), NMT_ERR_USAGE);
  nmt_prof_destroy(p);
}

NMT_TEST(prof_errors) {
  nmt_prof_options o;
  nmt_prof *p = NULL;
  nmt_prof_options_default(&o);
  o.start_step = 5, o.stop_step = 4;
  NMT_ASSERT_EQ_STATUS(nmt_prof_create(&o, &p), NMT_ERR_USAGE);
  o.stop_step = 0, o.size = 8;
  NMT_ASSERT_EQ_STATUS(nmt_prof_create(&o, &p), NMT_ERR_USAGE);
  nmt_prof_options_default(&o);
  o.start_step = 5, o.max_names = 3;
  NMT_ASSERT_OK(nmt_prof_create(&o, &p));
  NMT_ASSERT_EQ_INT(nmt_prof_stop_step(p), 14); /* 0 = start + 9 */
  NMT_ASSERT(!nmt_prof_in_window(p, 4) && nmt_prof_in_window(p, 5) && nmt_prof_in_window(p, 14));
  NMT_ASSERT(!nmt_prof_in_window(p, 15));
  int x, y;
  NMT_ASSERT_OK(nmt_prof_intern(p, "x", &x));
  NMT_ASSERT_OK(nmt_prof_intern(p, "y", &y));
  NMT_ASSERT(x != y);
  NMT_ASSERT_OK(nmt_prof_intern(p, "x", &y));
  NMT_ASSERT_EQ_INT(x, y);
  NMT_ASSERT(!strcmp(nmt_prof_name(p, x), "x"));
  NMT_ASSERT_EQ_STATUS(nmt_prof_intern(p, "", &y), NMT_ERR_USAGE);
  char longname[NMT_PROF_NAME_MAX + 1];
  memset(longname, 'n', sizeof longname - 1);
  longname[sizeof longname - 1] = 0;
  NMT_ASSERT_EQ_STATUS(nmt_prof_intern(p, longname, &y), NMT_ERR_USAGE);
  NMT_ASSERT_OK(nmt_prof_intern(p, "z", &y));
  NMT_ASSERT_EQ_STATUS(nmt_prof_intern(p, "w", &y), NMT_ERR_NOMEM); /* 3 names */
  nmt_prof_track *t;
  NMT_ASSERT_EQ_STATUS(nmt_prof_add_track(p, "a-track-name-longer-than-31-chars", 1, &t),
                       NMT_ERR_USAGE);
  NMT_ASSERT_OK(nmt_prof_add_track(p, "cpu0", 1, &t));
  /* a model needs more names than are left */
  rig r;
  nmt_status st = rig_create(&r, NMT_NORM_POST);
  if (st == NMT_OK) st = nmt_model_set_profiler(r.m, t);
  rig_free(&r);
  nmt_prof_destroy(p);
  NMT_ASSERT_EQ_STATUS(st, NMT_ERR_NOMEM);
}

/* The CPU peaks are finite and positive (their size is the machine's business). */
NMT_TEST(prof_peak_cpu) {
  double tf = 0, gb = 0;
  NMT_ASSERT_OK(nmt_prof_measure_cpu_peak(&tf, &gb));
  NMT_ASSERT(isfinite(tf) && tf > 0 && isfinite(gb) && gb > 0);
  const double fma = nmt_prof_cpu_fma_gflops();
  printf("# one CPU worker: peak %.1f GFLOP/s (%s), %.1f GB/s memcpy\n", tf * 1e3,
         fma > 0 ? "FMA throughput" : "sgemm: no AVX2/AVX-512 here", gb);
  NMT_ASSERT(fma >= 0 && isfinite(fma));
  /* Measured once per process: a second call returns the same figures. */
  double tf2 = 0, gb2 = 0;
  NMT_ASSERT_OK(nmt_prof_measure_cpu_peak(&tf2, &gb2));
  NMT_ASSERT(tf2 == tf && gb2 == gb);
}

/* The collectives' costs against nccl-tests' busbw conventions (doc/PERFORMANCE.md): an
 * all-reduce moves 2(n-1)/n x 4 count bytes per rank, a reduce-scatter (n-1)/n x 4 count;
 * one rank moves nothing. */
NMT_TEST(prof_cost_collectives) {
  nmt_prof_cost a = nmt_prof_cost_allreduce(1000, 4), r = nmt_prof_cost_reduce_scatter(1000, 4);
  NMT_ASSERT_NEAR(a.bytes, 2 * 0.75 * 4000, 0);
  NMT_ASSERT_NEAR(r.bytes, 0.75 * 4000, 0);
  NMT_ASSERT_NEAR(a.flops, 750, 0);
  NMT_ASSERT_NEAR(r.flops, 750, 0);
  r = nmt_prof_cost_reduce_scatter(1000, 1);
  NMT_ASSERT(r.bytes == 0 && r.flops == 0);
}
