/* test/test_cuda_adamw.c — AdamW (cuda/adamw.cu) against the reference (src/ref/adamw.c):
 * three steps within rtol 1e-5; with a step control block (skip writes nothing, coef replaces
 * grad_scale, bitwise the host-argument path); and the half working copy it writes in
 * fp16/bf16 mode (half_out), held to the reference's 16-bit patterns of the device's own new
 * parameters bitwise. Harness: test/gpu_helpers.h. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

NMT_TG_TEST(cuda_adamw_matches_ref) {
  const size_t n = 100003;
  float *p = nmt_tg_randn(g, n, 91, 0.1f, 0.0f), *gr = nmt_tg_randn(g, n, 92, 1.0f, 0.0f);
  float *m = nmt_tg_randn(g, n, 93, 0.01f, 0.0f), *v = nmt_tg_halloc(g, n * 4);
  NMT_TG_SETUP_OK();
  for (size_t i = 0; i < n; i++) v[i] = 1e-4f * (1.0f + fabsf(nmt_rng_normal(94, 0, i)));
  float *wp = nmt_tg_hcopy(g, p, n), *wm = nmt_tg_hcopy(g, m, n), *wv = nmt_tg_hcopy(g, v, n);
  NMT_TG_SETUP_OK();
  float *d_p = nmt_tg_dup_dev(g, p, n * 4), *d_g = nmt_tg_dup_dev(g, gr, n * 4),
        *d_m = nmt_tg_dup_dev(g, m, n * 4);
  float *d_v = nmt_tg_dup_dev(g, v, n * 4);
  NMT_TG_SETUP_OK();
  for (long step = 1; step <= 3; step++) {
    NMT_ASSERT_OK(g->be->adamw(g->ctx, d_p, d_g, d_m, d_v, n, 1e-3f, 0.9f, 0.98f, 1e-9f, 0.01f,
                               0.5f, NULL, NULL, step));
    NMT_ASSERT_OK(nmt_ref_adamw(NULL, wp, gr, wm, wv, n, 1e-3f, 0.9f, 0.98f, 1e-9f, 0.01f, 0.5f,
                                NULL, NULL, step));
  }
  NMT_TG_CLOSE("adamw params", nmt_tg_fetch(g, d_p, n * 4), wp, n, 1e-5);
  NMT_TG_CLOSE("adamw m", nmt_tg_fetch(g, d_m, n * 4), wm, n, 1e-5);
  NMT_TG_CLOSE("adamw v", nmt_tg_fetch(g, d_v, n * 4), wv, n, 1e-5);
  NMT_ASSERT_EQ_STATUS(g->be->adamw(g->ctx, d_p, d_g, d_m, d_v, n, 1e-3f, 0.9f, 0.98f, 1e-9f,
                                    0.0f, 1.0f, NULL, NULL, 0),
                       NMT_ERR_INTERNAL);
}

/* AdamW with a control block: skip writes nothing (bitwise), coef is grad_scale (bitwise the
 * host-argument path on the device, and the reference within 1e-5). */
NMT_TG_TEST(cuda_adamw_step_control_matches_ref) {
  const size_t n = 100003;
  float *p = nmt_tg_randn(g, n, 121, 0.1f, 0.0f), *gr = nmt_tg_randn(g, n, 122, 1.0f, 0.0f);
  float *m = nmt_tg_randn(g, n, 123, 0.01f, 0.0f), *v = nmt_tg_halloc(g, n * 4);
  NMT_TG_SETUP_OK();
  for (size_t i = 0; i < n; i++) v[i] = 1e-4f * (1.0f + fabsf(nmt_rng_normal(124, 0, i)));
  float *wp = nmt_tg_hcopy(g, p, n), *wm = nmt_tg_hcopy(g, m, n), *wv = nmt_tg_hcopy(g, v, n);
  NMT_TG_SETUP_OK();
  nmt_step_ctl skip = nmt_tg_ctl_init(1.0f, 0, 0), go = nmt_tg_ctl_init(1.0f, 0, 0);
  skip.skip = 1;
  skip.coef = 0.5f; /* would change everything if it were applied */
  go.coef = 0.37f;
  float *d_p = nmt_tg_dup_dev(g, p, n * 4), *d_g = nmt_tg_dup_dev(g, gr, n * 4),
        *d_m = nmt_tg_dup_dev(g, m, n * 4);
  float *d_v = nmt_tg_dup_dev(g, v, n * 4);
  float *d_p2 = nmt_tg_dup_dev(g, p, n * 4), *d_m2 = nmt_tg_dup_dev(g, m, n * 4),
        *d_v2 = nmt_tg_dup_dev(g, v, n * 4);
  nmt_step_ctl *d_skip = nmt_tg_dup_dev(g, &skip, sizeof skip),
               *d_go = nmt_tg_dup_dev(g, &go, sizeof go);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->adamw(g->ctx, d_p, d_g, d_m, d_v, n, 1e-3f, 0.9f, 0.98f, 1e-9f, 0.01f,
                             1.0f, d_skip, NULL, 1));
  NMT_TG_EXACT("adamw skipped: params", nmt_tg_fetch(g, d_p, n * 4), p, n);
  NMT_TG_EXACT("adamw skipped: m", nmt_tg_fetch(g, d_m, n * 4), m, n);
  NMT_TG_EXACT("adamw skipped: v", nmt_tg_fetch(g, d_v, n * 4), v, n);
  for (long step = 1; step <= 3; step++) {
    /* grad_scale 123 must be ignored for coef 0.37. */
    NMT_ASSERT_OK(g->be->adamw(g->ctx, d_p, d_g, d_m, d_v, n, 1e-3f, 0.9f, 0.98f, 1e-9f, 0.01f,
                               123.0f, d_go, NULL, step));
    NMT_ASSERT_OK(g->be->adamw(g->ctx, d_p2, d_g, d_m2, d_v2, n, 1e-3f, 0.9f, 0.98f, 1e-9f,
                               0.01f, 0.37f, NULL, NULL, step));
    NMT_ASSERT_OK(nmt_ref_adamw(NULL, wp, gr, wm, wv, n, 1e-3f, 0.9f, 0.98f, 1e-9f, 0.01f, 123.0f,
                                &go, NULL, step));
  }
  float *got_p = nmt_tg_fetch(g, d_p, n * 4), *got_m = nmt_tg_fetch(g, d_m, n * 4);
  float *got_v = nmt_tg_fetch(g, d_v, n * 4);
  NMT_TG_SETUP_OK();
  NMT_TG_EXACT("adamw coef vs grad_scale: params", got_p, nmt_tg_fetch(g, d_p2, n * 4), n);
  NMT_TG_EXACT("adamw coef vs grad_scale: m", got_m, nmt_tg_fetch(g, d_m2, n * 4), n);
  NMT_TG_EXACT("adamw coef vs grad_scale: v", got_v, nmt_tg_fetch(g, d_v2, n * 4), n);
  NMT_TG_CLOSE("adamw ctl params", got_p, wp, n, 1e-5);
  NMT_TG_CLOSE("adamw ctl m", got_m, wm, n, 1e-5);
  NMT_TG_CLOSE("adamw ctl v", got_v, wv, n, 1e-5);
}

/* AdamW's half_out: bitwise the reference's bits of the device's own new parameters (so any
 * difference in the fp32 update itself, which cuda_adamw_matches_ref bounds, does not enter);
 * the update bitwise the same with and without half_out; a skipped step leaves the copy. */
NMT_TG_TEST(cuda_half_adamw_half_out_matches_ref) {
  const size_t n = 100003;
  float *p = nmt_tg_randn(g, n, 141, 0.1f, 0.0f), *gr = nmt_tg_randn(g, n, 142, 1.0f, 0.0f);
  float *m = nmt_tg_randn(g, n, 143, 0.01f, 0.0f), *v = nmt_tg_halloc(g, n * 4);
  uint16_t *pattern = nmt_tg_halloc(g, n * 2);
  NMT_TG_SETUP_OK();
  for (size_t i = 0; i < n; i++) v[i] = 1e-4f * (1.0f + fabsf(nmt_rng_normal(144, 0, i)));
  p[1] = 7e4f, p[2] = -7e4f, p[3] = 3e-6f; /* fp16: +-inf and a subnormal */
  memset(pattern, 0x5a, n * 2);
  nmt_step_ctl skip = nmt_tg_ctl_init(1.0f, 0, 0);
  skip.skip = 1;
  skip.coef = 0.5f;
  for (int k = 0; k < 2; k++) {
    const nmt_precision mode = nmt_tg_half_modes[k];
    NMT_ASSERT_OK(g->be->set_precision(g->ctx, mode));
    float *d_p = nmt_tg_dup_dev(g, p, n * 4), *d_g = nmt_tg_dup_dev(g, gr, n * 4),
          *d_m = nmt_tg_dup_dev(g, m, n * 4);
    float *d_v = nmt_tg_dup_dev(g, v, n * 4), *d_p2 = nmt_tg_dup_dev(g, p, n * 4);
    float *d_m2 = nmt_tg_dup_dev(g, m, n * 4), *d_v2 = nmt_tg_dup_dev(g, v, n * 4);
    uint16_t *d_h = nmt_tg_dup_dev(g, pattern, n * 2);
    nmt_step_ctl *d_skip = nmt_tg_dup_dev(g, &skip, sizeof skip);
    NMT_TG_SETUP_OK();
    for (long step = 1; step <= 3; step++) {
      NMT_ASSERT_OK(g->be->adamw(g->ctx, d_p, d_g, d_m, d_v, n, 1e-3f, 0.9f, 0.98f, 1e-9f,
                                 0.01f, 0.5f, NULL, d_h, step));
      NMT_ASSERT_OK(g->be->adamw(g->ctx, d_p2, d_g, d_m2, d_v2, n, 1e-3f, 0.9f, 0.98f, 1e-9f,
                                 0.01f, 0.5f, NULL, NULL, step));
    }
    float *got_p = nmt_tg_fetch(g, d_p, n * 4);
    const uint16_t *got_h = nmt_tg_fetch(g, d_h, n * 2);
    NMT_TG_SETUP_OK();
    NMT_TG_EXACT("adamw with half_out vs without: params", got_p, nmt_tg_fetch(g, d_p2, n * 4), n);
    if (!nmt_tg_same_half(mode, k ? "bf16 adamw half_out" : "fp16 adamw half_out", got_h, got_p, n))
      return;
    NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_h, pattern, n * 2));
    NMT_ASSERT_OK(g->be->adamw(g->ctx, d_p, d_g, d_m, d_v, n, 1e-3f, 0.9f, 0.98f, 1e-9f, 0.01f,
                               0.5f, d_skip, d_h, 4));
    const uint16_t *after = nmt_tg_fetch(g, d_h, n * 2);
    NMT_TG_SETUP_OK();
    NMT_ASSERT(memcmp(after, pattern, n * 2) == 0);
    NMT_TG_EXACT("adamw skipped: params", nmt_tg_fetch(g, d_p, n * 4), got_p, n);
  }
}
