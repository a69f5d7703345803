/* test/test_cuda_embedding.c — the embedding and its backward (cuda/embedding.cu) against the
 * reference (src/ref/embedding.c). Forward: bitwise. Backward: PAD rows skipped on both sides;
 * an id with at most 32 rows (one chunk) is summed as the reference sums it, bitwise; a more
 * frequent id is summed in chunks of 32 rows, deterministic but reassociated, so cases with
 * long runs compare with rtol 1e-5 (fp32 rounding of sums of thousands of rows) and check that
 * two runs on the device agree bitwise. Cases: few repeats (exact), many repeats and long runs
 * per id, runs of exactly 32 and 33 rows (the chunk boundary), a batch that is mostly padding
 * with one id repeated thousands of times. Harness and skip: test/gpu_helpers.h. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

/* ids of case k: random below V (kind 0), or `kind` rows of id 7 first, the rest random (run
 * boundary cases), or (kind -1) 60% PAD, 30% id 7, 10% random. */
static void fill_ids(int32_t *ids, int n_rows, int V, int kind, uint64_t k) {
  for (int r = 0; r < n_rows; r++) {
    const uint32_t u = nmt_rng_u32(9, k, (uint64_t)r);
    if (kind > 0) {
      ids[r] = r < kind ? 7 : 8 + (int32_t)(u % (uint32_t)(V - 8));
    } else if (kind < 0) {
      const uint32_t pct = u % 100;
      ids[r] = pct < 60 ? NMT_PAD_ID : pct < 90 ? 7 : (int32_t)(u % (uint32_t)V);
    } else {
      ids[r] = (int32_t)(u % (uint32_t)V);
    }
  }
}

NMT_TG_TEST(cuda_embedding_matches_ref) {
  /* (n_rows, T, C, V, kind, exact) */
  const int cases[][6] = {{91, 7, 48, 50, 0, 1},  {3000, 30, 64, 5, 0, 0}, {1, 1, 3, 2, 0, 1},
                          {200, 10, 40, 300, 32, 1}, {200, 10, 40, 300, 33, 0},
                          {5000, 50, 512, 40, -1, 0}};
  const int n_cases = (int)(sizeof cases / sizeof *cases);
  char what[96];
  for (int k = 0; k < n_cases; k++) {
    const int n_rows = cases[k][0], T = cases[k][1], C = cases[k][2], V = cases[k][3];
    const int exact = cases[k][5];
    const size_t no = (size_t)n_rows * C, nw = (size_t)V * C;
    const float scale = sqrtf((float)C);
    int32_t *ids = nmt_tg_halloc(g, (size_t)n_rows * 4);
    NMT_TG_SETUP_OK();
    fill_ids(ids, n_rows, V, cases[k][4], (uint64_t)k);
    float *wte = nmt_tg_randn(g, nw, 21 + k, 0.5f, 0.0f);
    float *pos = nmt_tg_randn(g, (size_t)(T + 3) * C, 22 + k, 1.0f, 0.0f);
    float *dout = nmt_tg_randn(g, no, 23 + k, 1.0f, 0.0f),
          *dwte = nmt_tg_randn(g, nw, 24 + k, 1.0f, 0.0f);
    float *want = nmt_tg_halloc(g, no * 4), *want_d = nmt_tg_hcopy(g, dwte, nw);
    NMT_TG_SETUP_OK();
    int32_t *d_ids = nmt_tg_dup_dev(g, ids, (size_t)n_rows * 4);
    float *d_wte = nmt_tg_dup_dev(g, wte, nw * 4),
          *d_pos = nmt_tg_dup_dev(g, pos, (size_t)(T + 3) * C * 4);
    float *d_out = nmt_tg_dalloc(g, no * 4), *d_dout = nmt_tg_dup_dev(g, dout, no * 4);
    float *d_dwte = nmt_tg_dup_dev(g, dwte, nw * 4), *d_dwte2 = nmt_tg_dup_dev(g, dwte, nw * 4);
    NMT_TG_SETUP_OK();
    nmt_tg_poison(g, d_out, no);
    NMT_ASSERT_OK(g->be->embedding_fwd(g->ctx, d_out, d_ids, d_wte, d_pos, n_rows, T, C, scale));
    NMT_ASSERT_OK(nmt_ref_embedding_fwd(NULL, want, ids, wte, pos, n_rows, T, C, scale));
    NMT_TG_EXACT("embedding_fwd", nmt_tg_fetch(g, d_out, no * 4), want, no);
    NMT_ASSERT_OK(g->be->embedding_bwd(g->ctx, d_dwte, d_dout, d_ids, n_rows, C, scale));
    NMT_ASSERT_OK(g->be->embedding_bwd(g->ctx, d_dwte2, d_dout, d_ids, n_rows, C, scale));
    NMT_ASSERT_OK(nmt_ref_embedding_bwd(NULL, want_d, dout, ids, n_rows, C, scale));
    snprintf(what, sizeof what, "embedding_bwd n_rows=%d C=%d V=%d case %d", n_rows, C, V, k);
    const float *got = nmt_tg_fetch(g, d_dwte, nw * 4);
    if (exact) NMT_TG_EXACT(what, got, want_d, nw);
    else NMT_TG_CLOSE(what, got, want_d, nw, 1e-5);
    /* Deterministic: the same call twice gives the same bits. */
    NMT_TG_EXACT("embedding_bwd repeated", nmt_tg_fetch(g, d_dwte2, nw * 4), got, nw);
    /* The PAD row is exactly where it started. */
    NMT_TG_EXACT("embedding_bwd PAD row", got + (size_t)NMT_PAD_ID * C,
                 dwte + (size_t)NMT_PAD_ID * C, (size_t)C);
  }
}
