/* test/test_cuda_xent.c — softmax cross-entropy with label smoothing (cuda/xent.cu) against
 * the reference (src/ref/xent.c): losses, nll and the gradient written in place within rtol
 * 1e-4, and the loss scale read on the device (the step control's) bitwise as passing the
 * product. Harness: test/gpu_helpers.h. */
#include <stdint.h>
#include <stdio.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/config.h"
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
