/* test/test_cuda_step.c — the optimizer step's control (cuda/step.cu's step_control;
 * docs/cuda.md "Step control") against the reference (nmt_ref_step_control, src/ref/step.c).
 *
 * The control block step_control writes is compared with the reference's field by field,
 * bitwise, on gradients whose squares add exactly in any order (so both sums agree to the
 * bit), and on random gradients against the contract applied to the device's own sum; the
 * whole step without a host read (step_control -> adamw -> d2h_async / d2h_wait) against the
 * same sequence on the reference. Harness: test/gpu_helpers.h. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

static int same_f64(double a, double b) { return (isnan(a) && isnan(b)) || !memcmp(&a, &b, 8); }
static int same_f32(float a, float b) { return (isnan(a) && isnan(b)) || !memcmp(&a, &b, 4); }

/* The whole control block but the sumsq scratch, field by field and bitwise (NaN equals NaN);
 * the first difference is reported. 1 if equal. */
static int same_ctl(const char *what, const nmt_step_ctl *got, const nmt_step_ctl *want) {
  char field[32] = "";
  double a = 0, b = 0;
#define CTL_INT(f)                                                \
  if (!field[0] && got->f != want->f) {                           \
    snprintf(field, sizeof field, "%s", #f);                      \
    a = (double)got->f, b = (double)want->f;                      \
  }
#define CTL_FLT(f, same)                                          \
  if (!field[0] && !same(got->f, want->f)) {                      \
    snprintf(field, sizeof field, "%s", #f);                      \
    a = (double)got->f, b = (double)want->f;                      \
  }
  CTL_FLT(gnorm, same_f64)
  CTL_INT(skipped)
  CTL_INT(good)
  CTL_INT(step)
  CTL_FLT(scale, same_f32)
  CTL_FLT(scale_used, same_f32)
  CTL_FLT(coef, same_f32)
  CTL_INT(skip)
  CTL_INT(status)
  for (int i = 0; i < NMT_GRAD_EXTRA; i++) CTL_FLT(extra[i], same_f32)
#undef CTL_INT
#undef CTL_FLT
  if (!field[0]) return 1;
  nmt_test_fail(__FILE__, __LINE__, "%s: ctl.%s: device %.17g, expected %.17g", what, field, a,
                b);
  return 0;
}

/* n + NMT_GRAD_EXTRA host floats: x[i] = k_i * 2^e with integers |k_i| <= 1023 (every square
 * and every partial sum is exact in double, so any order of summation gives the same sumsq),
 * then the slots (loss, tokens, nll, stop). */
static float *exact_grads(nmt_tg_gpu *g, size_t n, uint64_t seed, int e, float tokens) {
  float *x = nmt_tg_halloc(g, (n + NMT_GRAD_EXTRA) * 4);
  if (!x) return NULL;
  for (size_t i = 0; i < n; i++)
    x[i] = ldexpf((float)((int)(nmt_rng_u32(seed, 5, i) % 2047u) - 1023), e);
  x[n + NMT_GRAD_SLOT_LOSS] = 3.25f * tokens + (float)seed;
  x[n + NMT_GRAD_SLOT_TOKENS] = tokens;
  x[n + NMT_GRAD_SLOT_NLL] = 2.5f * tokens;
  x[n + NMT_GRAD_SLOT_STOP] = (float)(seed % 2);
  return x;
}

/* One step_control on the device block d_ctl and on the host block *ref (the reference), both
 * carried from call to call; the device's sumsq must equal the reference's bitwise (the grads
 * are exact_grads) and the rest of the block too. The device block lands in *got. */
static int step_case(nmt_tg_gpu *g, nmt_step_ctl *d_ctl, nmt_step_ctl *ref, nmt_step_ctl *got,
                     const float *grads, const float *d_grads, size_t n, nmt_step_policy p,
                     long step, const char *what) {
  nmt_status s = g->be->step_control(g->ctx, d_ctl, d_grads, n, p, step);
  if (s == NMT_OK) s = g->be->copy_d2h(g->ctx, got, d_ctl, sizeof *got);
  if (s == NMT_OK) s = nmt_ref_step_control(NULL, ref, grads, n, p, step);
  if (s != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "%s: %s: %s", what, nmt_status_str(s), nmt_last_error());
    return 0;
  }
  float sq = NAN;
  (void)nmt_ref_sumsq(NULL, &sq, grads, n);
  if (!same_f32(got->sumsq, sq)) {
    nmt_test_fail(__FILE__, __LINE__, "%s: sumsq: device %.9g, reference %.9g", what,
                  (double)got->sumsq, (double)sq);
    return 0;
  }
  return same_ctl(what, got, ref);
}

/* Every branch of the policy (nmt/backend.h's step_control) against the reference, the state
 * carried on the device from step to step as in training: a clean step, clipping, fp16
 * overflow (inf, then NaN) backing off, growth after growth_interval clean steps, growth
 * capped at 2^126, the floor (state unchanged), inf/NaN without scaling, no tokens, and the
 * sticky statuses. Each verdict is also checked by name, so a reference that drifted would show
 * too. */
NMT_TG_TEST(cuda_step_control_matches_ref) {
  const size_t n = 300007; /* several blocks of the sumsq reduction, a ragged last one */
  const float tokens = 100.0f;
  float *g_small = exact_grads(g, n, 1, -10, tokens); /* gnorm ~3e-3: no clipping */
  float *g_big = exact_grads(g, n, 2, 0, tokens);     /* gnorm ~3: clipped to 1 */
  float *g_inf = exact_grads(g, n, 3, -10, tokens), *g_nan = exact_grads(g, n, 4, -10, tokens);
  float *g_none = exact_grads(g, n, 5, -10, 0.0f);
  NMT_TG_SETUP_OK();
  g_inf[n / 2] = INFINITY;
  g_nan[7] = NAN;
  const size_t bytes = (n + NMT_GRAD_EXTRA) * 4;
  float *d_g_small = nmt_tg_dup_dev(g, g_small, bytes), *d_g_big = nmt_tg_dup_dev(g, g_big, bytes);
  float *d_g_inf = nmt_tg_dup_dev(g, g_inf, bytes), *d_g_nan = nmt_tg_dup_dev(g, g_nan, bytes);
  float *d_g_none = nmt_tg_dup_dev(g, g_none, bytes);
  nmt_step_ctl *d_ctl = nmt_tg_dalloc(g, sizeof(nmt_step_ctl));
  NMT_TG_SETUP_OK();
  nmt_step_ctl ref, got;
  const nmt_step_policy fp16 = {.scaling = 1, .clip_norm = 1.0f, .backoff = 0.5f, .floor = 1.0f,
                                .growth_interval = 3};
  const nmt_step_policy fp32 = {.scaling = 0, .clip_norm = 0.0f, .backoff = 0.5f, .floor = 1.0f,
                                .growth_interval = 3};
#define STEP(grads, p, step, what)                                                          \
  if (!step_case(g, d_ctl, &ref, &got, grads, d_##grads, n, p, step, what)) return

  /* fp16 scaling, scale 1024, clip 1. */
  ref = nmt_tg_ctl_init(1024.0f, 0, 0);
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_ctl, &ref, sizeof ref));
  STEP(g_small, fp16, 1, "clean step");
  NMT_ASSERT(got.skip == 0 && got.status == NMT_STEP_OK && got.good == 1);
  NMT_ASSERT(got.gnorm > 0 && got.gnorm < 1.0);
  NMT_ASSERT(got.coef == (float)(1.0 / 100.0 / 1024.0));
  STEP(g_big, fp16, 2, "clipping");
  NMT_ASSERT(got.skip == 0 && got.gnorm > 1.0 && got.good == 2);
  NMT_ASSERT(got.coef == (float)(1.0 / got.gnorm / 100.0 / 1024.0));
  STEP(g_inf, fp16, 3, "fp16 overflow (inf)");
  NMT_ASSERT(got.skip == 1 && got.status == NMT_STEP_OK && isinf(got.gnorm));
  NMT_ASSERT(got.scale == 512.0f && got.scale_used == 1024.0f && got.good == 0);
  NMT_ASSERT(got.skipped == 1 && got.coef == 0.0f);
  STEP(g_small, fp16, 4, "clean after overflow");
  STEP(g_small, fp16, 5, "clean");
  NMT_ASSERT(got.scale == 512.0f && got.good == 2);
  STEP(g_small, fp16, 6, "growth at growth_interval");
  NMT_ASSERT(got.skip == 0 && got.scale == 1024.0f && got.scale_used == 512.0f && got.good == 0);
  STEP(g_nan, fp16, 7, "fp16 overflow (NaN)");
  NMT_ASSERT(got.skip == 1 && isnan(got.gnorm) && got.scale == 512.0f && got.skipped == 2);

  /* The floor: backing off 1.5 would give 0.75 < 1; the state stays, the status sticks. */
  ref = nmt_tg_ctl_init(1.5f, 2, 5);
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_ctl, &ref, sizeof ref));
  STEP(g_inf, fp16, 1, "floor reached");
  NMT_ASSERT(got.status == NMT_STEP_FLOOR && got.skip == 1);
  NMT_ASSERT(got.scale == 1.5f && got.good == 2 && got.skipped == 5);
  STEP(g_small, fp16, 2, "sticky floor");
  NMT_ASSERT(got.status == NMT_STEP_FLOOR && got.skip == 1 && isnan(got.gnorm));
  NMT_ASSERT(got.step == 2 && got.extra[NMT_GRAD_SLOT_LOSS] == g_small[n + NMT_GRAD_SLOT_LOSS]);

  /* Growth stops at 2^126. */
  const nmt_step_policy every = {.scaling = 1, .clip_norm = 1.0f, .backoff = 0.5f,
                                 .floor = 1.0f, .growth_interval = 1};
  ref = nmt_tg_ctl_init(0x1p125f, 0, 0);
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_ctl, &ref, sizeof ref));
  STEP(g_small, every, 1, "growth to 2^126");
  NMT_ASSERT(got.scale == 0x1p126f && got.good == 0);
  STEP(g_small, every, 2, "growth capped at 2^126");
  NMT_ASSERT(got.skip == 0 && got.scale == 0x1p126f && got.good == 0);

  /* No scaling, no clipping: a clean step, then a NaN is NONFINITE, and it sticks. */
  ref = nmt_tg_ctl_init(1.0f, 0, 0);
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_ctl, &ref, sizeof ref));
  STEP(g_big, fp32, 1, "no scaling, no clipping");
  NMT_ASSERT(got.skip == 0 && got.gnorm > 1.0 && got.coef == (float)(1.0 / 100.0));
  NMT_ASSERT(got.good == 0 && got.scale == 1.0f);
  STEP(g_nan, fp32, 2, "non-finite without scaling");
  NMT_ASSERT(got.status == NMT_STEP_NONFINITE && got.skip == 1 && got.scale == 1.0f);
  STEP(g_small, fp32, 3, "sticky non-finite");
  NMT_ASSERT(got.status == NMT_STEP_NONFINITE && got.skip == 1 && got.step == 3);

  /* No target tokens. */
  ref = nmt_tg_ctl_init(1024.0f, 1, 0);
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_ctl, &ref, sizeof ref));
  STEP(g_none, fp16, 1, "no tokens");
  NMT_ASSERT(got.status == NMT_STEP_NO_TOKENS && got.skip == 1 && isnan(got.gnorm));
  NMT_ASSERT(got.scale == 1024.0f && got.good == 1);
#undef STEP
  NMT_ASSERT_EQ_STATUS(g->be->step_control(g->ctx, d_ctl, d_g_small, n, fp16, 0),
                       NMT_ERR_INTERNAL);
}

/* nmt/backend.h's step_control from a given sum of squares, transcribed: the block the device
 * must produce from its own sumsq when the gradient's squares do not add exactly (the device
 * adds in another order than the reference). */
static void expect_step(nmt_step_ctl *c, float sumsq, const float *extra, nmt_step_policy p,
                        long step) {
  c->sumsq = sumsq;
  c->step = step;
  memcpy(c->extra, extra, sizeof c->extra);
  const float scale = c->scale;
  c->scale_used = scale;
  c->skip = 1;
  c->coef = 0.0f;
  c->gnorm = NAN;
  if (c->status != NMT_STEP_OK) return;
  const double tokens = c->extra[NMT_GRAD_SLOT_TOKENS];
  if (!(tokens > 0)) {
    c->status = NMT_STEP_NO_TOKENS;
    return;
  }
  c->gnorm = sqrt((double)sumsq) / tokens / scale;
  if (!isfinite(c->gnorm)) {
    const float next = scale * p.backoff;
    if (!p.scaling) c->status = NMT_STEP_NONFINITE;
    else if (next < p.floor) c->status = NMT_STEP_FLOOR;
    else {
      c->scale = next;
      c->good = 0;
      c->skipped++;
    }
    return;
  }
  const double clip = p.clip_norm > 0 && c->gnorm > p.clip_norm ? p.clip_norm / c->gnorm : 1.0;
  c->coef = (float)(clip / tokens / scale);
  c->skip = 0;
  if (p.scaling && ++c->good >= p.growth_interval) {
    if (scale < 0x1p126f) c->scale = scale * 2.0f;
    c->good = 0;
  }
}

/* Random gradients (sums that round): the device's sumsq within 1e-6 of the reference's, and
 * the block exactly what the contract gives for the device's own sumsq, over steps that clip,
 * grow the scale and back off. */
NMT_TG_TEST(cuda_step_control_random_grads) {
  const size_t n = 1000003;
  float *x = nmt_tg_randn(g, n + NMT_GRAD_EXTRA, 111, 1.0f, 0.0f);
  NMT_TG_SETUP_OK();
  x[n + NMT_GRAD_SLOT_LOSS] = 12345.5f;
  x[n + NMT_GRAD_SLOT_TOKENS] = 100.0f;
  x[n + NMT_GRAD_SLOT_NLL] = 11111.25f;
  x[n + NMT_GRAD_SLOT_STOP] = 0.0f;
  float *d_x = nmt_tg_dup_dev(g, x, (n + NMT_GRAD_EXTRA) * 4);
  nmt_step_ctl *d_ctl = nmt_tg_dalloc(g, sizeof(nmt_step_ctl));
  NMT_TG_SETUP_OK();
  const nmt_step_policy p = {.scaling = 1, .clip_norm = 0.5f, .backoff = 0.5f, .floor = 1.0f,
                             .growth_interval = 2};
  nmt_step_ctl want = nmt_tg_ctl_init(8.0f, 0, 0), got;
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_ctl, &want, sizeof want));
  float sq = NAN;
  NMT_ASSERT_OK(nmt_ref_sumsq(NULL, &sq, x, n));
  for (long step = 1; step <= 3; step++) {
    if (step == 3) { /* an overflow: one element to inf */
      const float inf = INFINITY;
      NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_x + 5, &inf, 4));
    }
    NMT_ASSERT_OK(g->be->step_control(g->ctx, d_ctl, d_x, n, p, step));
    NMT_ASSERT_OK(g->be->copy_d2h(g->ctx, &got, d_ctl, sizeof got));
    if (step < 3) NMT_ASSERT_CLOSE("step_control sumsq", &got.sumsq, &sq, 1, 0.0, 1e-6);
    expect_step(&want, got.sumsq, x + n, p, step);
    char what[64];
    snprintf(what, sizeof what, "random gradient, step %ld", step);
    if (!same_ctl(what, &got, &want)) return;
    /* gnorm ~ sqrt(1e6) / 100 / 8 ~ 1.25: clipped to 0.5, then the scale grows to 16 at
     * step 2 and backs off to 8 at the overflow. */
    if (step == 1) NMT_ASSERT(got.skip == 0 && got.gnorm > 0.5 && got.scale == 8.0f);
    if (step == 2) NMT_ASSERT(got.skip == 0 && got.scale == 16.0f && got.good == 0);
    if (step == 3) NMT_ASSERT(got.skip == 1 && got.skipped == 1 && got.scale == 8.0f);
  }
}

/* step_decide on the device: for the same given sum of squares the block is bitwise the
 * reference's, over a clean, a clipped-and-grown and an overflowed step. */
NMT_TG_TEST(cuda_step_decide_matches_ref) {
  float slots[NMT_GRAD_EXTRA] = {12345.5f, 100.0f, 11111.25f, 0.0f};
  float *d_slots = nmt_tg_dup_dev(g, slots, sizeof slots);
  float *d_sq = nmt_tg_dalloc(g, sizeof(float));
  nmt_step_ctl *d_ctl = nmt_tg_dalloc(g, sizeof(nmt_step_ctl));
  NMT_TG_SETUP_OK();
  const nmt_step_policy p = {.scaling = 1, .clip_norm = 0.5f, .backoff = 0.5f, .floor = 1.0f,
                             .growth_interval = 2};
  nmt_step_ctl want = nmt_tg_ctl_init(8.0f, 0, 0), got;
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_ctl, &want, sizeof want));
  const float sums[] = {1.0e6f, 2.5e5f, INFINITY};
  for (long step = 1; step <= 3; step++) {
    NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_sq, &sums[step - 1], sizeof(float)));
    NMT_ASSERT_OK(g->be->step_decide(g->ctx, d_ctl, d_sq, d_slots, p, step));
    NMT_ASSERT_OK(g->be->copy_d2h(g->ctx, &got, d_ctl, sizeof got));
    NMT_ASSERT_OK(nmt_ref_step_decide(NULL, &want, &sums[step - 1], slots, p, step));
    char what[64];
    snprintf(what, sizeof what, "step_decide, step %ld", step);
    if (!same_ctl(what, &got, &want)) return;
  }
  NMT_ASSERT(got.skip == 1 && got.skipped == 1);
}

/* ------------------------------------------------------------------------------------------ */
/* the whole step without a host read */

/* The trainer's optimizer step without a host read, three steps (clean, fp16 overflow, clean):
 * step_control -> adamw(ctl) -> d2h_async(block of step s) and d2h_wait of step s-1's block,
 * against the same sequence on the reference. Parameters within 1e-5 (AdamW), blocks bitwise
 * (exact gradients), the skipped step leaves the parameters as they were. */
NMT_TG_TEST(cuda_step_pipeline_matches_ref) {
  const size_t n = 50021;
  const nmt_step_policy p = {.scaling = 1, .clip_norm = 1.0f, .backoff = 0.5f, .floor = 1.0f,
                             .growth_interval = 2};
  float *gr[3] = {exact_grads(g, n, 21, -12, 64.0f), exact_grads(g, n, 22, -12, 64.0f),
                  exact_grads(g, n, 23, -12, 64.0f)};
  float *prm = nmt_tg_randn(g, n, 151, 0.1f, 0.0f), *mv = nmt_tg_halloc(g, n * 4);
  NMT_TG_SETUP_OK();
  gr[1][n - 1] = INFINITY;
  memset(mv, 0, n * 4);
  float *wp = nmt_tg_hcopy(g, prm, n), *wm = nmt_tg_hcopy(g, mv, n), *wv = nmt_tg_hcopy(g, mv, n);
  nmt_step_ctl *blk[2] = {(nmt_step_ctl *)nmt_tg_pinned(g, sizeof(nmt_step_ctl) / 4 + 1),
                          (nmt_step_ctl *)nmt_tg_pinned(g, sizeof(nmt_step_ctl) / 4 + 1)};
  float *d_p = nmt_tg_dup_dev(g, prm, n * 4), *d_m = nmt_tg_dup_dev(g, mv, n * 4),
        *d_v = nmt_tg_dup_dev(g, mv, n * 4);
  float *d_g[3];
  for (int s = 0; s < 3; s++) d_g[s] = nmt_tg_dup_dev(g, gr[s], (n + NMT_GRAD_EXTRA) * 4);
  nmt_step_ctl ref = nmt_tg_ctl_init(256.0f, 0, 0), want[3];
  nmt_step_ctl *d_ctl = nmt_tg_dup_dev(g, &ref, sizeof ref);
  NMT_TG_SETUP_OK();
  float *before_skip = NULL;
  for (long step = 1; step <= 3; step++) {
    const int s = (int)(step - 1), slot = (int)(step % 2);
    if (step == 2) {
      before_skip = nmt_tg_fetch(g, d_p, n * 4);
      NMT_TG_SETUP_OK();
    }
    NMT_ASSERT_OK(g->be->step_control(g->ctx, d_ctl, d_g[s], n, p, step));
    NMT_ASSERT_OK(g->be->adamw(g->ctx, d_p, d_g[s], d_m, d_v, n, 1e-3f, 0.9f, 0.98f, 1e-9f,
                               0.01f, 1.0f, d_ctl, NULL, step));
    NMT_ASSERT_OK(g->be->d2h_async(g->ctx, slot, blk[slot], d_ctl, sizeof(nmt_step_ctl)));
    NMT_ASSERT_OK(nmt_ref_step_control(NULL, &ref, gr[s], n, p, step));
    NMT_ASSERT_OK(nmt_ref_adamw(NULL, wp, gr[s], wm, wv, n, 1e-3f, 0.9f, 0.98f, 1e-9f, 0.01f,
                                1.0f, &ref, NULL, step));
    want[s] = ref;
    if (step > 1) { /* the previous step's block, read while this step runs */
      NMT_ASSERT_OK(g->be->d2h_wait(g->ctx, 1 - slot));
      char what[48];
      snprintf(what, sizeof what, "pipelined block of step %ld", step - 1);
      if (!same_ctl(what, blk[1 - slot], &want[s - 1])) return;
    }
    if (step == 2) {
      NMT_TG_EXACT("params after the skipped step", nmt_tg_fetch(g, d_p, n * 4), before_skip, n);
    }
  }
  NMT_ASSERT_OK(g->be->d2h_wait(g->ctx, 1));
  if (!same_ctl("pipelined block of step 3", blk[1], &want[2])) return;
  NMT_ASSERT(want[1].skip == 1 && want[2].skip == 0 && want[2].scale_used == 128.0f);
  NMT_TG_CLOSE("pipelined params", nmt_tg_fetch(g, d_p, n * 4), wp, n, 1e-5);
  NMT_TG_CLOSE("pipelined m", nmt_tg_fetch(g, d_m, n * 4), wm, n, 1e-5);
  NMT_TG_CLOSE("pipelined v", nmt_tg_fetch(g, d_v, n * 4), wv, n, 1e-5);
}
