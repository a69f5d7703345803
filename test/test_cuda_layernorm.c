/* test/test_cuda_layernorm.c — layer normalization (cuda/layernorm.cu) against the reference
 * (src/ref/layernorm.c): forward with and without the saved mean and rstd (a mean far from 0
 * checks the two-pass variance), backward into non-zero gradients, all of them and dgamma
 * alone; rtol 1e-4 (NMT_TG_CLOSE, test/gpu_helpers.h); the half-storage path's
 * layernorm_half_fwd / _bwd (below). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/half.h"
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

/* ------------------------------------------------------------------------------------------ */
/* layernorm_half_fwd / _bwd (the half-storage path, nmt/backend.h) against the reference's, in
 * fp16 and bf16:
 *  - forward: mean, rstd within rtol 1e-4; out (half only) within one half ulp of the
 *    reference's (the LayerNorm's sums differ in order, so the fp32 values differ by rounding
 *    noise), at least 90% equal; and bit for bit the rounding of the fp32 out that
 *    residual_ln_half_fwd computes for the same row (y = 0, p = 0: its sum is the input, and
 *    both ops are "layernorm_fwd of that row"; its own out_h = round(out) is held bitwise by
 *    test_cuda_residual.c), which pins the rounding site;
 *  - backward: dinp written (accumulate = 0, poisoned first) and added (accumulate = 1) within
 *    1e-4; dinp_h the reference rounding of the device's new dinp, bit for bit, and within one
 *    half ulp of the reference's; dgamma / dbeta accumulated within 1e-4; dinp_h NULL; dinp
 *    NULL (the parameter gradients alone);
 *  - the warp path (C % 8 == 0 up to 1024) and the block path (C % 8 != 0, C > 1024, a row
 *    tensor 4 bytes off alignment), M of many partial blocks; two runs bitwise equal; no
 *    scratch growth after the plan's reserve_scratch; the arguments it refuses. */

typedef struct {
  int M, C, off; /* off: floats / halves by which inp, dout, dinp (out, dinp_h) are shifted */
} lh_case;

static void lh_case_run(nmt_tg_gpu *g, nmt_precision mode, void *rc, const lh_case *a,
                        uint64_t tag) {
  char what[160];
  const int M = a->M, C = a->C;
  const size_t n = (size_t)M * C, o = (size_t)a->off, nt = n + o;
  const char *mn = nmt_tg_half_bf16(mode) ? "bf16" : "fp16";
  float *x = nmt_tg_randn(g, n, 60 * tag + 1, 2.0f, 3.0f),
        *gamma = nmt_tg_randn(g, C, 60 * tag + 2, 0.5f, 1.0f);
  float *beta = nmt_tg_randn(g, C, 60 * tag + 3, 0.5f, 0.0f),
        *dout = nmt_tg_randn(g, n, 60 * tag + 4, 1.0f, 0.0f);
  float *dinp = nmt_tg_randn(g, n, 60 * tag + 5, 1.0f, 0.0f),
        *dg = nmt_tg_randn(g, C, 60 * tag + 6, 1.0f, 0.0f);
  float *db = nmt_tg_randn(g, C, 60 * tag + 7, 1.0f, 0.0f);
  float *zeros = nmt_tg_halloc(g, n * 4), *want_mu = nmt_tg_halloc(g, (size_t)M * 4),
        *want_rs = nmt_tg_halloc(g, (size_t)M * 4);
  float *want_di = nmt_tg_halloc(g, n * 4), *want_da = nmt_tg_hcopy(g, dinp, n),
        *want_dg = nmt_tg_hcopy(g, dg, C), *want_db = nmt_tg_hcopy(g, db, C);
  uint16_t *want_h = nmt_tg_halloc(g, n * 2), *want_dh = nmt_tg_halloc(g, n * 2),
           *want_dah = nmt_tg_halloc(g, n * 2);
  NMT_TG_SETUP_OK();
  memset(zeros, 0, n * 4);
  uint16_t *zh = nmt_tg_half_encode(g, mode, zeros, n);
  float *d_x = nmt_tg_dalloc(g, nt * 4), *d_dout = nmt_tg_dalloc(g, nt * 4),
        *d_di = nmt_tg_dalloc(g, nt * 4), *d_da = nmt_tg_dalloc(g, nt * 4),
        *d_di2 = nmt_tg_dalloc(g, nt * 4);
  float *d_sum = nmt_tg_dalloc(g, nt * 4), *d_rout = nmt_tg_dalloc(g, nt * 4);
  uint16_t *d_h = nmt_tg_dalloc(g, nt * 2), *d_h2 = nmt_tg_dalloc(g, nt * 2),
           *d_zh = nmt_tg_dalloc(g, nt * 2), *d_dh = nmt_tg_dalloc(g, nt * 2),
           *d_dah = nmt_tg_dalloc(g, nt * 2);
  float *d_mu = nmt_tg_dalloc(g, (size_t)M * 4), *d_rs = nmt_tg_dalloc(g, (size_t)M * 4);
  float *d_gamma = nmt_tg_dup_dev(g, gamma, C * 4), *d_beta = nmt_tg_dup_dev(g, beta, C * 4);
  float *d_dg = nmt_tg_dup_dev(g, dg, C * 4), *d_db = nmt_tg_dup_dev(g, db, C * 4),
        *d_dg2 = nmt_tg_dup_dev(g, dg, C * 4), *d_db2 = nmt_tg_dup_dev(g, db, C * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_x + o, x, n * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_dout + o, dout, n * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_da + o, dinp, n * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_zh + o, zh, n * 2));
  nmt_backend_counters c0, c1;
  NMT_ASSERT_OK(g->be->counters(g->ctx, &c0));

  /* Forward. */
  nmt_tg_half_poison(g, d_h, nt);
  nmt_tg_half_poison(g, d_h2, nt);
  nmt_tg_poison(g, d_mu, M);
  nmt_tg_poison(g, d_rs, M);
  NMT_ASSERT_OK(g->be->layernorm_half_fwd(g->ctx, d_h + o, d_mu, d_rs, d_x + o, d_gamma, d_beta,
                                          M, C, 1e-5f));
  NMT_ASSERT_OK(g->be->layernorm_half_fwd(g->ctx, d_h2 + o, NULL, NULL, d_x + o, d_gamma,
                                          d_beta, M, C, 1e-5f));
  NMT_ASSERT_OK(nmt_ref_layernorm_half_fwd(rc, want_h, want_mu, want_rs, x, gamma, beta, M, C,
                                           1e-5f));
  const uint16_t *h_h = nmt_tg_fetch(g, d_h, nt * 2), *h_h2 = nmt_tg_fetch(g, d_h2, nt * 2);
  NMT_TG_SETUP_OK();
  snprintf(what, sizeof what, "%s layernorm_half_fwd out, M=%d C=%d off %zu", mn, M, C, o);
  /* rtol 1e-5: the fp32 values differ by the backends' sum orders (the device's mean and
   * variance in fp32 warp sums, the reference's in double; CUDA's expf and fused products
   * in the classifier), ~1e-7 absolute, which is several half ulps for |x| near 0 (fp16
   * subnormals, bf16's cancelled gradients); still far under one half ulp of the array's
   * largest values. The rounding site itself is held bitwise elsewhere in this test. */
  if (!NMT_TG_HALF_CLOSE(mode, what, h_h + o, want_h, n, 1e-5, 0.9)) return;
  for (size_t i = 0; i < o; i++) NMT_ASSERT(h_h[i] == 0xffff);
  NMT_ASSERT(memcmp(h_h, h_h2, nt * 2) == 0); /* statistics NULL; a second run */
  NMT_TG_CLOSE("layernorm_half_fwd mean", nmt_tg_fetch(g, d_mu, (size_t)M * 4), want_mu, M, 1e-4);
  NMT_TG_CLOSE("layernorm_half_fwd rstd", nmt_tg_fetch(g, d_rs, (size_t)M * 4), want_rs, M, 1e-4);
  NMT_ASSERT_OK(g->be->residual_ln_half_fwd(g->ctx, d_rout + o, NULL, d_sum + o, NULL, NULL,
                                            d_x + o, d_zh + o, d_gamma, d_beta, M, C, 1e-5f,
                                            0.0f, 0, 0));
  const float *h_rout = nmt_tg_fetch(g, d_rout, nt * 4);
  NMT_TG_SETUP_OK();
  snprintf(what, sizeof what, "%s layernorm_half_fwd out = round(LN(inp)), M=%d C=%d", mn, M, C);
  if (!nmt_tg_same_half(mode, what, h_h + o, h_rout + o, n)) return;

  /* Backward from the reference's statistics, written then added, twice each. */
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_mu, want_mu, (size_t)M * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_rs, want_rs, (size_t)M * 4));
  for (int run = 0; run < 2; run++) {
    float *ddi = run ? d_di2 : d_di, *ddg = run ? d_dg2 : d_dg, *ddb = run ? d_db2 : d_db;
    uint16_t *ddh = run ? d_h2 : d_dh;
    nmt_tg_poison(g, ddi, nt);
    nmt_tg_half_poison(g, ddh, nt);
    NMT_ASSERT_OK(g->be->layernorm_half_bwd(g->ctx, ddi + o, 0, ddh + o, ddg, ddb, d_dout + o,
                                            d_x + o, d_gamma, d_mu, d_rs, M, C));
  }
  NMT_ASSERT_OK(nmt_ref_layernorm_half_bwd(rc, want_di, 0, want_dh, want_dg, want_db, dout, x,
                                           gamma, want_mu, want_rs, M, C));
  const float *h_di = nmt_tg_fetch(g, d_di, nt * 4), *h_di2 = nmt_tg_fetch(g, d_di2, nt * 4);
  const uint16_t *h_dh = nmt_tg_fetch(g, d_dh, nt * 2);
  h_h2 = nmt_tg_fetch(g, d_h2, nt * 2);
  NMT_TG_SETUP_OK();
  snprintf(what, sizeof what, "%s layernorm_half_bwd dinp (written), M=%d C=%d off %zu", mn, M,
           C, o);
  NMT_TG_CLOSE(what, h_di + o, want_di, n, 1e-4);
  snprintf(what, sizeof what, "%s layernorm_half_bwd dinp_h = round(dinp), M=%d C=%d", mn, M, C);
  if (!nmt_tg_same_half(mode, what, h_dh + o, h_di + o, n)) return;
  snprintf(what, sizeof what, "%s layernorm_half_bwd dinp_h vs the reference's, M=%d C=%d", mn, M,
           C);
  if (!NMT_TG_HALF_CLOSE(mode, what, h_dh + o, want_dh, n, 1e-4, 0.9)) return;
  NMT_TG_CLOSE("layernorm_half_bwd dgamma", nmt_tg_fetch(g, d_dg, C * 4), want_dg, C, 1e-4);
  NMT_TG_CLOSE("layernorm_half_bwd dbeta", nmt_tg_fetch(g, d_db, C * 4), want_db, C, 1e-4);
  NMT_TG_EXACT("layernorm_half_bwd dinp, second run", h_di2 + o, h_di + o, n);
  NMT_ASSERT(memcmp(h_h2, h_dh, nt * 2) == 0);
  NMT_TG_EXACT("layernorm_half_bwd dgamma, second run", nmt_tg_fetch(g, d_dg2, C * 4),
               nmt_tg_fetch(g, d_dg, C * 4), C);
  NMT_TG_EXACT("layernorm_half_bwd dbeta, second run", nmt_tg_fetch(g, d_db2, C * 4),
               nmt_tg_fetch(g, d_db, C * 4), C);
  /* Added into a non-zero dinp (the pre-LN residual gradient), with its half copy. */
  nmt_tg_half_poison(g, d_dah, nt);
  NMT_ASSERT_OK(g->be->layernorm_half_bwd(g->ctx, d_da + o, 1, d_dah + o, NULL, NULL, d_dout + o,
                                          d_x + o, d_gamma, d_mu, d_rs, M, C));
  NMT_ASSERT_OK(nmt_ref_layernorm_half_bwd(rc, want_da, 1, want_dah, NULL, NULL, dout, x, gamma,
                                           want_mu, want_rs, M, C));
  const float *h_da = nmt_tg_fetch(g, d_da, nt * 4);
  const uint16_t *h_dah = nmt_tg_fetch(g, d_dah, nt * 2);
  NMT_TG_SETUP_OK();
  snprintf(what, sizeof what, "%s layernorm_half_bwd dinp (added), M=%d C=%d off %zu", mn, M, C,
           o);
  NMT_TG_CLOSE(what, h_da + o, want_da, n, 1e-4);
  snprintf(what, sizeof what, "%s layernorm_half_bwd dinp_h = round(dinp + g), M=%d C=%d", mn, M,
           C);
  if (!nmt_tg_same_half(mode, what, h_dah + o, h_da + o, n)) return;
  if (!NMT_TG_HALF_CLOSE(mode, what, h_dah + o, want_dah, n, 1e-4, 0.9)) return;
  /* dinp_h NULL: dinp alone, bitwise the first run; dinp NULL: the parameter gradients. */
  nmt_tg_poison(g, d_di2, nt);
  NMT_ASSERT_OK(g->be->layernorm_half_bwd(g->ctx, d_di2 + o, 0, NULL, NULL, NULL, d_dout + o,
                                          d_x + o, d_gamma, d_mu, d_rs, M, C));
  h_di2 = nmt_tg_fetch(g, d_di2, nt * 4);
  NMT_TG_SETUP_OK();
  NMT_TG_EXACT("layernorm_half_bwd dinp, dinp_h NULL", h_di2 + o, h_di + o, n);
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_dg2, dg, C * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_db2, db, C * 4));
  NMT_ASSERT_OK(g->be->layernorm_half_bwd(g->ctx, NULL, 0, NULL, d_dg2, d_db2, d_dout + o,
                                          d_x + o, d_gamma, d_mu, d_rs, M, C));
  NMT_TG_EXACT("layernorm_half_bwd dgamma alone", nmt_tg_fetch(g, d_dg2, C * 4),
               nmt_tg_fetch(g, d_dg, C * 4), C);
  NMT_TG_EXACT("layernorm_half_bwd dbeta alone", nmt_tg_fetch(g, d_db2, C * 4),
               nmt_tg_fetch(g, d_db, C * 4), C);
  NMT_ASSERT_OK(g->be->counters(g->ctx, &c1));
  NMT_ASSERT_EQ_INT(c1.scratch_growths - c0.scratch_growths, 0);
}

static const lh_case lh_cases[] = {
    /* M, C, off */
    {67, 96, 0}, {300, 512, 0}, {40, 1000, 0}, {2000, 512, 0}, {2, 1, 0},
    {13, 33, 0}, {5, 1536, 0},  {64, 256, 1},
};

static void lh_mode(nmt_tg_gpu *g, nmt_precision mode) {
  nmt_scratch_plan plan;
  memset(&plan, 0, sizeof plan);
  plan.main.gemm_rows = 2000;
  plan.main.width = 1536;
  plan.main.half_acts = 1;
  void *rc = nmt_tg_half_twin(g, mode, &plan);
  if (!rc) return;
  for (size_t i = 0; i < sizeof lh_cases / sizeof *lh_cases; i++) {
    lh_case_run(g, mode, rc, &lh_cases[i], 100 * (uint64_t)nmt_tg_half_bf16(mode) + i + 1);
    if (nmt_test_failed()) break;
  }
  nmt_ref_ctx_destroy(rc);
}

NMT_TG_TEST(cuda_layernorm_half_fp16_matches_ref) { lh_mode(g, NMT_PRECISION_FP16); }
NMT_TG_TEST(cuda_layernorm_half_bf16_matches_ref) { lh_mode(g, NMT_PRECISION_BF16); }

NMT_TG_TEST(cuda_layernorm_half_refuses_misuse) {
  float *d = nmt_tg_dalloc(g, 64 * 4);
  uint16_t *h = nmt_tg_dalloc(g, 64 * 2);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_FP16));
  NMT_ASSERT_EQ_STATUS(g->be->layernorm_half_fwd(g->ctx, h, NULL, NULL, d, d, d, 2, 0, 1e-5f),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->layernorm_half_fwd(g->ctx, h, NULL, NULL, d, d, d, -1, 8, 1e-5f),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->layernorm_half_bwd(g->ctx, NULL, 0, h, NULL, NULL, d, d, d, d, d, 2,
                                                 8),
                       NMT_ERR_INTERNAL); /* dinp_h without dinp */
  NMT_ASSERT_EQ_STATUS(g->be->layernorm_half_bwd(g->ctx, d, 0, h, NULL, NULL, d, d, d, d, d, 2, 0),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_FP32));
  NMT_ASSERT_EQ_STATUS(g->be->layernorm_half_fwd(g->ctx, h, NULL, NULL, d, d, d, 2, 8, 1e-5f),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->layernorm_half_bwd(g->ctx, d, 0, h, NULL, NULL, d, d, d, d, d, 2, 8),
                       NMT_ERR_INTERNAL);
}
