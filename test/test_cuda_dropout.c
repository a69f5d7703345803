/* test/test_cuda_dropout.c — inverted dropout (cuda/dropout.cu) against the reference
 * (src/ref/dropout.c): the Philox port gives bitwise the reference's mask and values, forward
 * (also in place, as the model calls it) and backward, and the stream really selects the mask.
 * Harness and skip: test/gpu_helpers.h. */
#include <stdint.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

NMT_TG_TEST(cuda_dropout_matches_ref_bitwise) {
  const size_t n = 100003; /* not a multiple of the 4-element Philox block */
  const float ps[3] = {0.1f, 0.5f, 0.0f};
  for (int k = 0; k < 3; k++) {
    const float p = ps[k];
    const uint64_t seed = 0x1234abcdULL + (uint64_t)k, stream = nmt_rng_stream(77, 3);
    float *x = nmt_tg_randn(g, n, 11 + k, 1.0f, 0.0f),
          *base = nmt_tg_randn(g, n, 12 + k, 1.0f, 0.0f);
    float *want = nmt_tg_hcopy(g, x, n), *want_in = nmt_tg_hcopy(g, x, n),
          *want_d = nmt_tg_hcopy(g, base, n);
    NMT_TG_SETUP_OK();
    float *dx = nmt_tg_dup_dev(g, x, n * 4), *dout = nmt_tg_dalloc(g, n * 4),
          *db = nmt_tg_dup_dev(g, base, n * 4);
    NMT_TG_SETUP_OK();
    nmt_tg_poison(g, dout, n);
    NMT_ASSERT_OK(g->be->dropout_fwd(g->ctx, dout, dx, n, p, seed, stream));
    NMT_ASSERT_OK(nmt_ref_dropout_fwd(NULL, want, x, n, p, seed, stream));
    NMT_TG_EXACT("dropout_fwd", nmt_tg_fetch(g, dout, n * 4), want, n);
    /* In place, as the model calls it. */
    NMT_ASSERT_OK(g->be->dropout_fwd(g->ctx, dx, dx, n, p, seed, stream));
    NMT_ASSERT_OK(nmt_ref_dropout_fwd(NULL, want_in, want_in, n, p, seed, stream));
    NMT_TG_EXACT("dropout_fwd in place", nmt_tg_fetch(g, dx, n * 4), want_in, n);
    /* Backward accumulates with the same mask. */
    NMT_ASSERT_OK(g->be->dropout_bwd(g->ctx, db, dout, n, p, seed, stream));
    NMT_ASSERT_OK(nmt_ref_dropout_bwd(NULL, want_d, want, n, p, seed, stream));
    NMT_TG_EXACT("dropout_bwd", nmt_tg_fetch(g, db, n * 4), want_d, n);
  }
  /* A different stream gives a different mask (the stream is really used). */
  float *ones = nmt_tg_halloc(g, 4096 * 4);
  NMT_TG_SETUP_OK();
  for (int i = 0; i < 4096; i++) ones[i] = 1.0f;
  float *d1 = nmt_tg_dup_dev(g, ones, 4096 * 4), *d2 = nmt_tg_dup_dev(g, ones, 4096 * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->dropout_fwd(g->ctx, d1, d1, 4096, 0.5f, 5, 1));
  NMT_ASSERT_OK(g->be->dropout_fwd(g->ctx, d2, d2, 4096, 0.5f, 5, 2));
  float *h1 = nmt_tg_fetch(g, d1, 4096 * 4), *h2 = nmt_tg_fetch(g, d2, 4096 * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT(memcmp(h1, h2, 4096 * 4) != 0);
}
