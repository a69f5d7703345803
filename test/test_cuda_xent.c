/* test/test_cuda_xent.c — softmax cross-entropy with label smoothing (cuda/xent.cu) against
 * the reference (src/ref/xent.c): losses, nll and the gradient written in place within rtol
 * 1e-4, and the loss scale read on the device (the step control's) bitwise as passing the
 * product; the half-storage path's xent_half_fwd_bwd (below). Harness: test/gpu_helpers.h. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/half.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

NMT_TG_TEST(cuda_xent_matches_ref) {
  /* (M, V, smoothing, write_grad, with nll) */
  const struct {
    int M, V;
    float eps;
    int grad, nll;
  } cases[] = {{23, 1000, 0.1f, 1, 1}, {23, 1000, 0.0f, 1, 0}, {7, 33001, 0.1f, 1, 1},
               {16, 37, 0.3f, 0, 1}};
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
    const int M = cases[k].M, V = cases[k].V;
    const size_t n = (size_t)M * V;
    float *x = nmt_tg_randn(g, n, 81 + k, 3.0f, 0.0f), *want = nmt_tg_hcopy(g, x, n);
    float *want_l = nmt_tg_halloc(g, (size_t)M * 4), *want_n = nmt_tg_halloc(g, (size_t)M * 4);
    int32_t *t = nmt_tg_halloc(g, (size_t)M * 4);
    NMT_TG_SETUP_OK();
    for (int r = 0; r < M; r++)
      t[r] = r % 5 == 2 ? NMT_PAD_ID
                        : (int32_t)(1 + nmt_rng_u32(5, k, (uint64_t)r) % (uint32_t)(V - 1));
    float *d_x = nmt_tg_dup_dev(g, x, n * 4), *d_l = nmt_tg_dalloc(g, (size_t)M * 4);
    float *d_n = nmt_tg_dalloc(g, (size_t)M * 4);
    int32_t *d_t = nmt_tg_dup_dev(g, t, (size_t)M * 4);
    NMT_TG_SETUP_OK();
    nmt_tg_poison(g, d_l, M);
    nmt_tg_poison(g, d_n, M);
    NMT_ASSERT_OK(g->be->xent_fwd_bwd(g->ctx, d_x, d_l, cases[k].nll ? d_n : NULL, d_t, M, V,
                                      cases[k].eps, 0.5f, NULL, cases[k].grad));
    NMT_ASSERT_OK(nmt_ref_xent_fwd_bwd(NULL, want, want_l, cases[k].nll ? want_n : NULL, t, M, V,
                                       cases[k].eps, 0.5f, NULL, cases[k].grad));
    char what[96];
    snprintf(what, sizeof what, "xent losses M=%d V=%d eps=%g", M, V, (double)cases[k].eps);
    NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_l, (size_t)M * 4), want_l, M, 1e-4);
    if (cases[k].nll) {
      snprintf(what, sizeof what, "xent nll M=%d V=%d", M, V);
      NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_n, (size_t)M * 4), want_n, M, 1e-4);
    }
    /* The gradient in place (or the logits untouched without write_grad). */
    snprintf(what, sizeof what, "xent logits/grad M=%d V=%d grad=%d", M, V, cases[k].grad);
    NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_x, n * 4), want, n, 1e-4);
  }
}

/* xent with the loss scale read on the device: bitwise the gradient of dloss * scale passed as
 * a number (the float product), and the reference's within 1e-4; the losses do not change. */
NMT_TG_TEST(cuda_xent_loss_scale_matches_ref) {
  const int M = 23, V = 1000;
  const size_t n = (size_t)M * V;
  const float dloss = 0.37f, scale = 1000.5f; /* the product rounds */
  const float prod = dloss * scale;
  float *x = nmt_tg_randn(g, n, 131, 3.0f, 0.0f), *want = nmt_tg_hcopy(g, x, n);
  float *want_l = nmt_tg_halloc(g, (size_t)M * 4);
  int32_t *t = nmt_tg_halloc(g, (size_t)M * 4);
  NMT_TG_SETUP_OK();
  for (int r = 0; r < M; r++)
    t[r] = r % 5 == 2 ? NMT_PAD_ID : (int32_t)(1 + nmt_rng_u32(6, 0, (uint64_t)r) % (V - 1));
  float *d_x = nmt_tg_dup_dev(g, x, n * 4), *d_x2 = nmt_tg_dup_dev(g, x, n * 4);
  float *d_l = nmt_tg_dalloc(g, (size_t)M * 4), *d_l2 = nmt_tg_dalloc(g, (size_t)M * 4);
  float *d_scale = nmt_tg_dup_dev(g, &scale, 4);
  int32_t *d_t = nmt_tg_dup_dev(g, t, (size_t)M * 4);
  NMT_TG_SETUP_OK();
  nmt_tg_poison(g, d_l, M);
  nmt_tg_poison(g, d_l2, M);
  NMT_ASSERT_OK(g->be->xent_fwd_bwd(g->ctx, d_x, d_l, NULL, d_t, M, V, 0.1f, dloss, d_scale, 1));
  NMT_ASSERT_OK(g->be->xent_fwd_bwd(g->ctx, d_x2, d_l2, NULL, d_t, M, V, 0.1f, prod, NULL, 1));
  NMT_ASSERT_OK(nmt_ref_xent_fwd_bwd(NULL, want, want_l, NULL, t, M, V, 0.1f, dloss, &scale, 1));
  float *got = nmt_tg_fetch(g, d_x, n * 4), *got_l = nmt_tg_fetch(g, d_l, (size_t)M * 4);
  NMT_TG_SETUP_OK();
  NMT_TG_EXACT("xent grad: scale on the device vs the product", got, nmt_tg_fetch(g, d_x2, n * 4),
               n);
  NMT_TG_EXACT("xent losses: scale on the device vs the product", got_l,
              nmt_tg_fetch(g, d_l2, (size_t)M * 4), M);
  NMT_TG_CLOSE("xent grad with dloss_scale", got, want, n, 1e-4);
  NMT_TG_CLOSE("xent losses with dloss_scale", got_l, want_l, M, 1e-4);
  /* The scale really multiplies: the gradient is not that of dloss alone. */
  float *d_x3 = nmt_tg_dup_dev(g, x, n * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->xent_fwd_bwd(g->ctx, d_x3, d_l2, NULL, d_t, M, V, 0.1f, dloss, NULL, 1));
  float *plain = nmt_tg_fetch(g, d_x3, n * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT(nmt_tg_max_abs(got, n) > 100.0 * nmt_tg_max_abs(plain, n));
}

/* 1 for a half inf of either sign. */
static int hc_decode_is_inf(nmt_precision mode, uint16_t h) {
  return (h & 0x7fff) == (mode == NMT_PRECISION_FP16 ? 0x7c00 : 0x7f80);
}

/* ------------------------------------------------------------------------------------------ */
/* xent_half_fwd_bwd (the half-storage path, nmt/backend.h): the classifier on half logits
 * against the reference's, in fp16 and bf16. Losses and nll are fp32 within rtol 1e-4 (as the
 * fp32 op's test: the same values, sums in another order, the device's expf within 2 ulps);
 * the gradient, written in place in half, within one half ulp of the reference's (the fp32
 * gradients differ by that noise and may straddle a rounding boundary), at least 90% equal
 * (which a wrong rounding would not be); PAD rows loss 0 and a zero gradient (their logits are
 * not zero, so an unwritten row fails); without write_grad the logits unchanged bit for bit.
 * Shapes: V % 8 == 0 (16-byte vectors) and not, the row in shared memory (V <= 12032) and
 * re-read from global memory (V = 16000, 33001), logits one element off alignment (the scalar
 * path), the base model's V = 8000. With the loss scale on the device (the step control's) at
 * 2^24, fp16's gradient overflows to inf on both sides (bf16's stays finite); two runs give
 * the same bits; a target outside [0, V) is reported as the fp32 op reports it. */

static void xh_case(nmt_tg_gpu *g, nmt_precision mode, void *rc, int M, int V, float eps,
                    int grad, int with_nll, int off, float scale, uint64_t k) {
  char what[160];
  const size_t n = (size_t)M * V, nt = n + (size_t)off;
  const char *mn = nmt_tg_half_bf16(mode) ? "bf16" : "fp16";
  float *xf = nmt_tg_randn(g, n, 181 + k, 3.0f, 0.0f);
  float *want_l = nmt_tg_halloc(g, (size_t)M * 4), *want_n = nmt_tg_halloc(g, (size_t)M * 4);
  int32_t *t = nmt_tg_halloc(g, (size_t)M * 4);
  NMT_TG_SETUP_OK();
  for (int r = 0; r < M; r++)
    t[r] = r % 5 == 2 ? NMT_PAD_ID
                      : (int32_t)(1 + nmt_rng_u32(15, k, (uint64_t)r) % (uint32_t)(V - 1));
  uint16_t *x = nmt_tg_half_encode(g, mode, xf, n);
  uint16_t *want = nmt_tg_halloc(g, n * 2);
  NMT_TG_SETUP_OK();
  memcpy(want, x, n * 2);
  uint16_t *d_x = nmt_tg_dalloc(g, nt * 2), *d_x2 = nmt_tg_dalloc(g, nt * 2);
  float *d_l = nmt_tg_dalloc(g, (size_t)M * 4), *d_n = nmt_tg_dalloc(g, (size_t)M * 4);
  float *d_scale = nmt_tg_dup_dev(g, &scale, 4);
  int32_t *d_t = nmt_tg_dup_dev(g, t, (size_t)M * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_x + off, x, n * 2));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_x2 + off, x, n * 2));
  nmt_tg_poison(g, d_l, M);
  nmt_tg_poison(g, d_n, M);
  const float dloss = 0.5f;
  NMT_ASSERT_OK(g->be->xent_half_fwd_bwd(g->ctx, d_x + off, d_l, with_nll ? d_n : NULL, d_t, M,
                                         V, eps, dloss, d_scale, grad));
  NMT_ASSERT_OK(g->be->xent_half_fwd_bwd(g->ctx, d_x2 + off, d_l, with_nll ? d_n : NULL, d_t, M,
                                         V, eps, dloss, d_scale, grad));
  NMT_ASSERT_OK(nmt_ref_xent_half_fwd_bwd(rc, want, want_l, with_nll ? want_n : NULL, t, M, V,
                                          eps, dloss, &scale, grad));
  snprintf(what, sizeof what, "%s xent_half losses M=%d V=%d eps=%g off %d", mn, M, V,
           (double)eps, off);
  NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_l, (size_t)M * 4), want_l, M, 1e-4);
  if (with_nll) {
    snprintf(what, sizeof what, "%s xent_half nll M=%d V=%d", mn, M, V);
    NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_n, (size_t)M * 4), want_n, M, 1e-4);
  }
  const uint16_t *got = nmt_tg_fetch(g, d_x, nt * 2), *got2 = nmt_tg_fetch(g, d_x2, nt * 2);
  NMT_TG_SETUP_OK();
  snprintf(what, sizeof what, "%s xent_half %s M=%d V=%d eps=%g scale=%g off %d", mn,
           grad ? "gradient" : "logits untouched", M, V, (double)eps, (double)scale, off);
  if (grad) {
    /* rtol 1e-5: the fp32 values differ by the backends' sum orders (the device's mean and
     * variance in fp32 warp sums, the reference's in double; CUDA's expf and fused products
     * in the classifier), ~1e-7 absolute, which is several half ulps for |x| near 0 (fp16
     * subnormals, bf16's cancelled gradients); still far under one half ulp of the array's
     * largest values. The rounding site itself is held bitwise elsewhere in this test. */
    if (!NMT_TG_HALF_CLOSE(mode, what, got + off, want, n, 1e-5, 0.9)) return;
  } else if (memcmp(got + off, x, n * 2) != 0) {
    nmt_test_fail(__FILE__, __LINE__, "%s: the logits changed", what);
    return;
  }
  NMT_ASSERT(memcmp(got, got2, nt * 2) == 0); /* two runs, the same bits */
  if (!grad) return;
  for (int r = 0; r < M; r++) /* PAD rows: exactly zero on the device too */
    if (t[r] == NMT_PAD_ID)
      for (int j = 0; j < V; j++) NMT_ASSERT((got[off + (size_t)r * V + j] & 0x7fff) == 0);
  size_t infs = 0, want_infs = 0;
  for (size_t i = 0; i < n; i++) {
    infs += hc_decode_is_inf(mode, got[off + i]);
    want_infs += hc_decode_is_inf(mode, want[i]);
  }
  if (scale > 1e6f && mode == NMT_PRECISION_FP16) {
    NMT_ASSERT(want_infs > 0); /* the overflow is there, on both sides */
    NMT_ASSERT(infs > 0);
  } else {
    NMT_ASSERT_EQ_INT(infs, 0);
    NMT_ASSERT_EQ_INT(want_infs, 0);
  }
}

static void xh_mode(nmt_tg_gpu *g, nmt_precision mode) {
  /* (M, V, eps, write_grad, nll, offset, loss scale) */
  const struct {
    int M, V;
    float eps;
    int grad, nll, off;
    float scale;
  } cases[] = {{23, 1000, 0.1f, 1, 1, 0, 1.0f},   {23, 1000, 0.0f, 1, 0, 0, 1.0f},
               {64, 8000, 0.1f, 1, 1, 0, 1.0f},   {9, 16000, 0.1f, 1, 1, 0, 1.0f},
               {7, 33001, 0.1f, 1, 1, 0, 1.0f},   {16, 37, 0.3f, 0, 1, 0, 1.0f},
               {5, 8000, 0.1f, 1, 1, 1, 1.0f},    {16, 37, 0.3f, 1, 1, 0, 1.0f},
               {23, 1000, 0.1f, 1, 1, 0, 16777216.0f}};
  nmt_scratch_plan plan;
  memset(&plan, 0, sizeof plan);
  plan.main.half_acts = 1;
  plan.main.xent_cols = 33001;
  void *rc = nmt_tg_half_twin(g, mode, &plan);
  if (!rc) return;
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
    xh_case(g, mode, rc, cases[k].M, cases[k].V, cases[k].eps, cases[k].grad, cases[k].nll,
            cases[k].off, cases[k].scale, 10 * (uint64_t)nmt_tg_half_bf16(mode) + k);
    if (nmt_test_failed()) break;
  }
  nmt_ref_ctx_destroy(rc);
}

NMT_TG_TEST(cuda_xent_half_fp16_matches_ref) { xh_mode(g, NMT_PRECISION_FP16); }
NMT_TG_TEST(cuda_xent_half_bf16_matches_ref) { xh_mode(g, NMT_PRECISION_BF16); }

/* A target outside [0, V): the reference refuses the call; the device reports it at the next
 * wait, as xent_fwd_bwd does (the row's loss NaN). Bad shapes and an fp32 context: refused. */
NMT_TG_TEST(cuda_xent_half_refuses_misuse) {
  const int M = 3, V = 40;
  uint16_t *d_x = nmt_tg_dalloc(g, (size_t)M * V * 2);
  float *d_l = nmt_tg_dalloc(g, M * 4);
  const int32_t t[3] = {1, V, 2};
  int32_t *d_t = nmt_tg_dup_dev(g, t, sizeof t);
  NMT_TG_SETUP_OK();
  nmt_tg_half_poison(g, d_x, (size_t)M * V); /* NaN logits are fine: the row with a bad target is left */
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_FP16));
  const nmt_status s1 = g->be->xent_half_fwd_bwd(g->ctx, d_x, d_l, NULL, d_t, M, V, 0.1f, 1.0f,
                                                 NULL, 1);
  const nmt_status s2 = g->be->synchronize(g->ctx);
  NMT_ASSERT(s1 == NMT_ERR_INTERNAL || s2 == NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->synchronize(g->ctx)); /* reported once */
  NMT_ASSERT_EQ_STATUS(g->be->xent_half_fwd_bwd(g->ctx, d_x, d_l, NULL, d_t, M, 0, 0.1f, 1.0f,
                                                NULL, 1),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->xent_half_fwd_bwd(g->ctx, d_x, d_l, NULL, d_t, -1, V, 0.1f, 1.0f,
                                                NULL, 1),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_FP32));
  NMT_ASSERT_EQ_STATUS(g->be->xent_half_fwd_bwd(g->ctx, d_x, d_l, NULL, d_t, M, V, 0.1f, 1.0f,
                                                NULL, 1),
                       NMT_ERR_INTERNAL);
}
