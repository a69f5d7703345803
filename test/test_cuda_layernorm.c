/* test/test_cuda_layernorm.c — layer normalization (cuda/layernorm.cu) against the reference
 * (src/ref/layernorm.c): forward with and without the saved mean and rstd (a mean far from 0
 * checks the two-pass variance), backward into non-zero gradients, all of them and dgamma
 * alone; rtol 1e-4 (NMT_TG_CLOSE, test/gpu_helpers.h). */
#include <stddef.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/ref.h"
#include "test.h"

NMT_TG_TEST(cuda_layernorm_matches_ref) {
  const int cases[3][2] = {{67, 96}, {300, 512}, {2, 1}};
  for (int k = 0; k < 3; k++) {
    const int M = cases[k][0], C = cases[k][1];
    const size_t n = (size_t)M * C;
    /* A mean far from 0 checks the two-pass variance. */
    float *x = nmt_tg_randn(g, n, 31 + k, 2.0f, 3.0f),
          *gamma = nmt_tg_randn(g, C, 32 + k, 0.5f, 1.0f);
    float *beta = nmt_tg_randn(g, C, 33 + k, 0.5f, 0.0f),
          *dout = nmt_tg_randn(g, n, 34 + k, 1.0f, 0.0f);
    float *dinp = nmt_tg_randn(g, n, 35 + k, 1.0f, 0.0f),
          *dgamma = nmt_tg_randn(g, C, 36 + k, 1.0f, 0.0f);
    float *dbeta = nmt_tg_randn(g, C, 37 + k, 1.0f, 0.0f);
    float *want = nmt_tg_halloc(g, n * 4), *want_mu = nmt_tg_halloc(g, (size_t)M * 4);
    float *want_rs = nmt_tg_halloc(g, (size_t)M * 4), *want_di = nmt_tg_hcopy(g, dinp, n);
    float *want_dg = nmt_tg_hcopy(g, dgamma, C), *want_db = nmt_tg_hcopy(g, dbeta, C);
    NMT_TG_SETUP_OK();
    float *d_x = nmt_tg_dup_dev(g, x, n * 4), *d_gamma = nmt_tg_dup_dev(g, gamma, C * 4);
    float *d_beta = nmt_tg_dup_dev(g, beta, C * 4), *d_out = nmt_tg_dalloc(g, n * 4);
    float *d_mu = nmt_tg_dalloc(g, (size_t)M * 4), *d_rs = nmt_tg_dalloc(g, (size_t)M * 4);
    float *d_dout = nmt_tg_dup_dev(g, dout, n * 4), *d_dinp = nmt_tg_dup_dev(g, dinp, n * 4);
    float *d_dgamma = nmt_tg_dup_dev(g, dgamma, C * 4), *d_dbeta = nmt_tg_dup_dev(g, dbeta, C * 4);
    NMT_TG_SETUP_OK();
    nmt_tg_poison(g, d_out, n);
    nmt_tg_poison(g, d_mu, M);
    nmt_tg_poison(g, d_rs, M);
    NMT_ASSERT_OK(
        g->be->layernorm_fwd(g->ctx, d_out, d_mu, d_rs, d_x, d_gamma, d_beta, M, C, 1e-5f));
    NMT_ASSERT_OK(nmt_ref_layernorm_fwd(NULL, want, want_mu, want_rs, x, gamma, beta, M, C, 1e-5f));
    NMT_TG_CLOSE("layernorm_fwd out", nmt_tg_fetch(g, d_out, n * 4), want, n, 1e-4);
    NMT_TG_CLOSE("layernorm_fwd mean", nmt_tg_fetch(g, d_mu, (size_t)M * 4), want_mu, M, 1e-4);
    NMT_TG_CLOSE("layernorm_fwd rstd", nmt_tg_fetch(g, d_rs, (size_t)M * 4), want_rs, M, 1e-4);
    /* mean and rstd are optional outputs. */
    nmt_tg_poison(g, d_out, n);
    NMT_ASSERT_OK(
        g->be->layernorm_fwd(g->ctx, d_out, NULL, NULL, d_x, d_gamma, d_beta, M, C, 1e-5f));
    NMT_TG_CLOSE("layernorm_fwd out (no stats)", nmt_tg_fetch(g, d_out, n * 4), want, n, 1e-4);
    NMT_ASSERT_OK(g->be->layernorm_bwd(g->ctx, d_dinp, d_dgamma, d_dbeta, d_dout, d_x, d_gamma,
                                       d_mu, d_rs, M, C));
    NMT_ASSERT_OK(nmt_ref_layernorm_bwd(NULL, want_di, want_dg, want_db, dout, x, gamma, want_mu,
                                        want_rs, M, C));
    NMT_TG_CLOSE("layernorm_bwd dinp", nmt_tg_fetch(g, d_dinp, n * 4), want_di, n, 1e-4);
    NMT_TG_CLOSE("layernorm_bwd dgamma", nmt_tg_fetch(g, d_dgamma, C * 4), want_dg, C, 1e-4);
    NMT_TG_CLOSE("layernorm_bwd dbeta", nmt_tg_fetch(g, d_dbeta, C * 4), want_db, C, 1e-4);
    /* Each gradient alone (NULL = not needed). */
    float *dg2 = nmt_tg_hcopy(g, dgamma, C), *dg2_want = nmt_tg_hcopy(g, dgamma, C);
    NMT_TG_SETUP_OK();
    float *d_dg2 = nmt_tg_dup_dev(g, dg2, C * 4);
    NMT_TG_SETUP_OK();
    NMT_ASSERT_OK(g->be->layernorm_bwd(g->ctx, NULL, d_dg2, NULL, d_dout, d_x, d_gamma, d_mu, d_rs,
                                       M, C));
    NMT_ASSERT_OK(nmt_ref_layernorm_bwd(NULL, NULL, dg2_want, NULL, dout, x, gamma, want_mu,
                                        want_rs, M, C));
    NMT_TG_CLOSE("layernorm_bwd dgamma only", nmt_tg_fetch(g, d_dg2, C * 4), dg2_want, C, 1e-4);
  }
}
