/* test/test_cuda_relu.c — ReLU forward and backward (cuda/relu.cu) against the reference
 * (src/ref/relu.c), bitwise, run as the model runs it (the backward reads the output); the
 * same test checks the elementwise add (out aliasing an input) and axpy of
 * cuda/reductions.cu. Harness: test/gpu_helpers.h. */
#include <stddef.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/ref.h"
#include "test.h"

NMT_TG_TEST(cuda_elementwise_match_ref) {
  const size_t n = 70001;
  float *x = nmt_tg_randn(g, n, 51, 1.0f, 0.0f), *y = nmt_tg_randn(g, n, 52, 1.0f, 0.0f);
  float *base = nmt_tg_randn(g, n, 53, 1.0f, 0.0f);
  float *want = nmt_tg_halloc(g, n * 4), *want_b = nmt_tg_hcopy(g, base, n),
        *want_y = nmt_tg_hcopy(g, y, n);
  NMT_TG_SETUP_OK();
  float *d_x = nmt_tg_dup_dev(g, x, n * 4), *d_y = nmt_tg_dup_dev(g, y, n * 4),
        *d_out = nmt_tg_dalloc(g, n * 4);
  float *d_b = nmt_tg_dup_dev(g, base, n * 4);
  NMT_TG_SETUP_OK();
  /* relu forward, then backward from the output (the model runs it in place). */
  nmt_tg_poison(g, d_out, n);
  NMT_ASSERT_OK(g->be->relu_fwd(g->ctx, d_out, d_x, n));
  NMT_ASSERT_OK(nmt_ref_relu_fwd(NULL, want, x, n));
  NMT_TG_EXACT("relu_fwd", nmt_tg_fetch(g, d_out, n * 4), want, n);
  NMT_ASSERT_OK(g->be->relu_bwd(g->ctx, d_b, d_y, d_out, n));
  NMT_ASSERT_OK(nmt_ref_relu_bwd(NULL, want_b, y, want, n));
  NMT_TG_EXACT("relu_bwd", nmt_tg_fetch(g, d_b, n * 4), want_b, n);
  /* add with out aliasing an input */
  NMT_ASSERT_OK(g->be->add(g->ctx, d_y, d_x, d_y, n));
  NMT_ASSERT_OK(nmt_ref_add(NULL, want_y, x, want_y, n));
  NMT_TG_EXACT("add (out = b)", nmt_tg_fetch(g, d_y, n * 4), want_y, n);
  /* axpy (a fused multiply-add may differ by an ulp) */
  NMT_ASSERT_OK(g->be->axpy(g->ctx, d_y, d_x, -0.37f, n));
  NMT_ASSERT_OK(nmt_ref_axpy(NULL, want_y, x, -0.37f, n));
  NMT_TG_CLOSE("axpy", nmt_tg_fetch(g, d_y, n * 4), want_y, n, 1e-6);
}
