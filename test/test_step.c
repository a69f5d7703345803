/* test/test_step.c — the optimizer step's device-side control on the reference backend
 * (nmt/backend.h: step_control, adamw's ctl, xent's dloss_scale, count_targets): every branch of
 * the loss-scaling and clipping policy against a direct computation in double, the sticky
 * verdicts, and the ops that read the control block. The CUDA versions are compared with these
 * on a device in test/test_cuda_step.c (and test_cuda_adamw.c, test_cuda_xent.c,
 * test_cuda_reductions.c). */
#include <math.h>
#include <string.h>

#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/ref.h"
#include "test.h"

enum { N = 1000 };

static uint64_t rng_state = 0x510e527fade682d1ull;
static float rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (float)((rng_state >> 40) * 0x1p-24 * 2.0 - 1.0);
}

/* N random gradients and the trailing slots (loss, tokens, nll, stop). */
static void fill(float *g, float tokens) {
  for (int i = 0; i < N; i++) g[i] = 3 * rnd();
  g[N + NMT_GRAD_SLOT_LOSS] = 2.5f * tokens;
  g[N + NMT_GRAD_SLOT_TOKENS] = tokens;
  g[N + NMT_GRAD_SLOT_NLL] = 2.0f * tokens;
  g[N + NMT_GRAD_SLOT_STOP] = 0.0f;
}

/* The norm of the unscaled per-token gradient, straight from the definition. */
static double direct_gnorm(const float *g, double tokens, double scale) {
  double s = 0;
  for (int i = 0; i < N; i++) s += (double)g[i] * g[i];
  return sqrt(s) / tokens / scale;
}

static const nmt_step_policy FP16 = {.scaling = 1, .clip_norm = 0.0f, .backoff = 0.5f,
                                     .floor = 1.0f, .growth_interval = 3};

NMT_TEST(step_control_clean_step_and_clip) {
  float g[N + NMT_GRAD_EXTRA];
  fill(g, 40.0f);
  nmt_step_ctl c = {.scale = 256.0f, .good = 1, .skipped = 5, .status = NMT_STEP_OK};
  NMT_ASSERT_OK(nmt_ref_step_control(NULL, &c, g, N, FP16, 7));
  const double gn = direct_gnorm(g, 40.0, 256.0);
  NMT_ASSERT_EQ_INT((long)c.step, 7);
  NMT_ASSERT_NEAR(c.gnorm, gn, 1e-6 * gn);
  NMT_ASSERT(c.skip == 0 && c.status == NMT_STEP_OK);
  NMT_ASSERT_NEAR(c.coef, 1.0 / 40.0 / 256.0, 1e-7 / 40.0 / 256.0);
  NMT_ASSERT(c.scale == 256.0f && c.scale_used == 256.0f);
  NMT_ASSERT_EQ_INT((long)c.good, 2);
  NMT_ASSERT_EQ_INT((long)c.skipped, 5);
  for (int i = 0; i < NMT_GRAD_EXTRA; i++) NMT_ASSERT(c.extra[i] == g[N + i]);

  /* Clipping at half the norm halves the multiplier (torch clip_grad_norm_ on the per-token
   * gradient); a clip_norm above the norm changes nothing. */
  nmt_step_policy p = FP16;
  p.clip_norm = (float)(gn / 2);
  c = (nmt_step_ctl){.scale = 256.0f};
  NMT_ASSERT_OK(nmt_ref_step_control(NULL, &c, g, N, p, 8));
  const double want = (double)p.clip_norm / gn / 40.0 / 256.0;
  NMT_ASSERT_NEAR(c.coef, want, 1e-6 * want);
  p.clip_norm = (float)(gn * 2);
  c = (nmt_step_ctl){.scale = 256.0f};
  NMT_ASSERT_OK(nmt_ref_step_control(NULL, &c, g, N, p, 9));
  NMT_ASSERT_NEAR(c.coef, 1.0 / 40.0 / 256.0, 1e-7 / 40.0 / 256.0);
}

/* growth_interval clean steps double the scale and restart the count; doubling stops at 2^126,
 * where one more would overflow fp32. */
NMT_TEST(step_control_growth) {
  float g[N + NMT_GRAD_EXTRA];
  fill(g, 10.0f);
  nmt_step_ctl c = {.scale = 8.0f};
  for (long s = 1; s <= 6; s++) NMT_ASSERT_OK(nmt_ref_step_control(NULL, &c, g, N, FP16, s));
  NMT_ASSERT(c.scale == 32.0f);
  NMT_ASSERT_EQ_INT((long)c.good, 0);
  NMT_ASSERT(c.scale_used == 16.0f); /* the last step's gradient carried the scale before growth */
  c = (nmt_step_ctl){.scale = 0x1p126f, .good = 2};
  NMT_ASSERT_OK(nmt_ref_step_control(NULL, &c, g, N, FP16, 1));
  NMT_ASSERT(c.scale == 0x1p126f && c.good == 0 && c.skip == 0);
  /* Without scaling the scale never moves. */
  nmt_step_policy off = FP16;
  off.scaling = 0;
  c = (nmt_step_ctl){.scale = 1.0f};
  for (long s = 1; s <= 6; s++) NMT_ASSERT_OK(nmt_ref_step_control(NULL, &c, g, N, off, s));
  NMT_ASSERT(c.scale == 1.0f && c.skip == 0);
}

/* An inf or NaN anywhere: with scaling, skip, back off, count; without, diverged. */
NMT_TEST(step_control_overflow_backs_off_or_diverges) {
  float g[N + NMT_GRAD_EXTRA];
  const float bad[2] = {INFINITY, NAN};
  for (int k = 0; k < 2; k++) {
    fill(g, 10.0f);
    g[N / 3] = bad[k];
    nmt_step_ctl c = {.scale = 64.0f, .good = 2, .skipped = 1};
    NMT_ASSERT_OK(nmt_ref_step_control(NULL, &c, g, N, FP16, 4));
    NMT_ASSERT(c.skip == 1 && c.status == NMT_STEP_OK && c.coef == 0.0f);
    NMT_ASSERT(c.scale == 32.0f && c.scale_used == 64.0f);
    NMT_ASSERT_EQ_INT((long)c.good, 0);
    NMT_ASSERT_EQ_INT((long)c.skipped, 2);
    NMT_ASSERT(!isfinite(c.gnorm));

    nmt_step_policy off = FP16;
    off.scaling = 0;
    c = (nmt_step_ctl){.scale = 1.0f};
    NMT_ASSERT_OK(nmt_ref_step_control(NULL, &c, g, N, off, 4));
    NMT_ASSERT(c.skip == 1 && c.status == NMT_STEP_NONFINITE);
    NMT_ASSERT(c.scale == 1.0f && c.skipped == 0);
  }
  /* At the floor: backing off would go below it, so the run has diverged (state unchanged). */
  fill(g, 10.0f);
  g[0] = INFINITY;
  nmt_step_ctl c = {.scale = 1.0f, .good = 3, .skipped = 9};
  NMT_ASSERT_OK(nmt_ref_step_control(NULL, &c, g, N, FP16, 12));
  NMT_ASSERT(c.skip == 1 && c.status == NMT_STEP_FLOOR);
  NMT_ASSERT(c.scale == 1.0f && c.good == 3 && c.skipped == 9 && c.scale_used == 1.0f);
}

/* A verdict that ends the run sticks: the steps enqueued before the host read it skip, and the
 * state stays as it was; no tokens is an engine bug, reported as its own verdict. */
NMT_TEST(step_control_sticky_status_and_no_tokens) {
  float g[N + NMT_GRAD_EXTRA];
  fill(g, 0.0f);
  nmt_step_ctl c = {.scale = 16.0f, .good = 1};
  NMT_ASSERT_OK(nmt_ref_step_control(NULL, &c, g, N, FP16, 3));
  NMT_ASSERT(c.skip == 1 && c.status == NMT_STEP_NO_TOKENS);
  fill(g, 12.0f); /* a clean step afterwards */
  NMT_ASSERT_OK(nmt_ref_step_control(NULL, &c, g, N, FP16, 4));
  NMT_ASSERT(c.skip == 1 && c.status == NMT_STEP_NO_TOKENS);
  NMT_ASSERT(c.scale == 16.0f && c.good == 1 && c.skipped == 0 && c.step == 4);
  NMT_ASSERT(c.extra[NMT_GRAD_SLOT_TOKENS] == 12.0f); /* the slots are still reported */
  NMT_ASSERT(isnan(c.gnorm));
  NMT_ASSERT_EQ_STATUS(nmt_ref_step_control(NULL, &c, g, N, FP16, 0), NMT_ERR_INTERNAL);
}

/* AdamW with a control block: the verdict's multiplier replaces grad_scale (bitwise the same
 * update), and a skip leaves parameters and both moments bitwise unchanged. */
NMT_TEST(step_adamw_reads_the_verdict) {
  float p1[N], m1[N], v1[N], p2[N], m2[N], v2[N], g[N];
  for (int i = 0; i < N; i++) {
    p1[i] = p2[i] = rnd();
    m1[i] = m2[i] = 0.1f * rnd();
    v1[i] = v2[i] = 0.01f * (rnd() + 1.0f);
    g[i] = 5 * rnd();
  }
  nmt_step_ctl c = {.coef = 0.0371f, .skip = 0};
  NMT_ASSERT_OK(nmt_ref_adamw(NULL, p1, g, m1, v1, N, 1e-3f, 0.9f, 0.98f, 1e-9f, 0.01f, 0.0371f,
                              NULL, NULL, 3));
  NMT_ASSERT_OK(nmt_ref_adamw(NULL, p2, g, m2, v2, N, 1e-3f, 0.9f, 0.98f, 1e-9f, 0.01f, 99.0f, &c,
                              NULL, 3));
  NMT_ASSERT(memcmp(p1, p2, sizeof p1) == 0 && memcmp(m1, m2, sizeof m1) == 0 &&
             memcmp(v1, v2, sizeof v1) == 0);
  c.skip = 1;
  NMT_ASSERT_OK(nmt_ref_adamw(NULL, p2, g, m2, v2, N, 1e-3f, 0.9f, 0.98f, 1e-9f, 0.01f, 1.0f, &c,
                              NULL, 4));
  NMT_ASSERT(memcmp(p1, p2, sizeof p1) == 0 && memcmp(m1, m2, sizeof m1) == 0 &&
             memcmp(v1, v2, sizeof v1) == 0);
}

/* xent's dloss_scale multiplies dloss: bitwise the gradient of dloss * scale passed directly. */
NMT_TEST(step_xent_device_loss_scale) {
  enum { M = 5, V = 13 };
  float a[M * V], b[M * V], la[M], lb[M];
  const int32_t t[M] = {3, NMT_PAD_ID, 12, 4, 7};
  for (int i = 0; i < M * V; i++) a[i] = b[i] = 4 * rnd();
  const float scale = 1024.0f;
  NMT_ASSERT_OK(nmt_ref_xent_fwd_bwd(NULL, a, la, NULL, t, M, V, 0.1f, 0.5f * scale, NULL, 1));
  NMT_ASSERT_OK(nmt_ref_xent_fwd_bwd(NULL, b, lb, NULL, t, M, V, 0.1f, 0.5f, &scale, 1));
  NMT_ASSERT(memcmp(a, b, sizeof a) == 0);
  NMT_ASSERT(memcmp(la, lb, sizeof la) == 0);
}

/* count_targets adds the number of non-PAD ids to what *dst holds. */
NMT_TEST(step_count_targets) {
  int32_t ids[300];
  long want = 0;
  for (int i = 0; i < 300; i++) {
    ids[i] = rnd() > 0.3f ? NMT_PAD_ID : 4 + i % 50;
    want += ids[i] != NMT_PAD_ID;
  }
  NMT_ASSERT(want > 10 && want < 290);
  float dst = 7.0f;
  NMT_ASSERT_OK(nmt_ref_count_targets(NULL, &dst, ids, 300));
  NMT_ASSERT(dst == 7.0f + (float)want);
  NMT_ASSERT_OK(nmt_ref_count_targets(NULL, &dst, ids, 0));
  NMT_ASSERT(dst == 7.0f + (float)want);
}

/* step_decide (ZeRO's global norm from the shards' partial sums) is step_control's policy on a
 * given sum of squares: fed step_control's own sumsq it writes bitwise the same block, over a
 * clean step, a clipped one, growth and an fp16 overflow; and it reads the given sum, not
 * the gradient (a different sum gives a different norm). */
NMT_TEST(step_decide_equals_step_control) {
  static float g[N + NMT_GRAD_EXTRA];
  const nmt_step_policy pols[] = {FP16, {.scaling = 0, .clip_norm = 0.01f, .backoff = 0.5f,
                                         .floor = 1.0f, .growth_interval = 1}};
  for (int pi = 0; pi < 2; pi++) {
    nmt_step_ctl a = {.scale = 1024.0f, .good = 1999}, b = a;
    for (int step = 1; step <= 4; step++) {
      fill(g, 300.0f);
      if (step == 3 && pols[pi].scaling) g[7] = INFINITY;
      NMT_ASSERT_OK(nmt_ref_step_control(NULL, &a, g, N, pols[pi], step));
      float sumsq = a.sumsq;
      NMT_ASSERT_OK(nmt_ref_step_decide(NULL, &b, &sumsq, g + N, pols[pi], step));
      if (memcmp(&a, &b, sizeof a))
        nmt_test_fail(__FILE__, __LINE__, "policy %d step %d: blocks differ (gnorm %g vs %g)", pi,
                      step, a.gnorm, b.gnorm);
    }
  }
  nmt_step_ctl c = {.scale = 1.0f};
  fill(g, 10.0f);
  float four = 4.0f;
  NMT_ASSERT_OK(nmt_ref_step_decide(NULL, &c, &four, g + N, pols[1], 1));
  NMT_ASSERT_NEAR(c.gnorm, 2.0 / 10.0, 1e-12);
  NMT_ASSERT_EQ_STATUS(nmt_ref_step_decide(NULL, &c, &four, g + N, pols[1], 0), NMT_ERR_INTERNAL);
}
