/* test/test_cuda_embedding.c — the embedding and its backward (cuda/embedding.cu) against the
 * reference (src/ref/embedding.c), bitwise: the same rows in the same order with the same
 * roundings, also with many repeated ids and long runs per id. Harness and skip:
 * test/gpu_helpers.h. */
#include <math.h>
#include <stdint.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

NMT_TG_TEST(cuda_embedding_matches_ref) {
  /* (n_rows, T, C, V): one with many repeated ids and long runs per id. */
  const int cases[3][4] = {{91, 7, 48, 50}, {3000, 30, 64, 5}, {1, 1, 3, 2}};
  for (int k = 0; k < 3; k++) {
    const int n_rows = cases[k][0], T = cases[k][1], C = cases[k][2], V = cases[k][3];
    const size_t no = (size_t)n_rows * C;
    const float scale = sqrtf((float)C);
    int32_t *ids = nmt_tg_halloc(g, (size_t)n_rows * 4);
    NMT_TG_SETUP_OK();
    for (int r = 0; r < n_rows; r++)
      ids[r] = (int32_t)(nmt_rng_u32(9, k, (uint64_t)r) % (uint32_t)V);
    float *wte = nmt_tg_randn(g, (size_t)V * C, 21 + k, 0.5f, 0.0f);
    float *pos = nmt_tg_randn(g, (size_t)(T + 3) * C, 22 + k, 1.0f, 0.0f);
    float *dout = nmt_tg_randn(g, no, 23 + k, 1.0f, 0.0f),
          *dwte = nmt_tg_randn(g, (size_t)V * C, 24 + k, 1.0f, 0.0f);
    float *want = nmt_tg_halloc(g, no * 4), *want_d = nmt_tg_hcopy(g, dwte, (size_t)V * C);
    NMT_TG_SETUP_OK();
    int32_t *d_ids = nmt_tg_dup_dev(g, ids, (size_t)n_rows * 4);
    float *d_wte = nmt_tg_dup_dev(g, wte, (size_t)V * C * 4),
          *d_pos = nmt_tg_dup_dev(g, pos, (size_t)(T + 3) * C * 4);
    float *d_out = nmt_tg_dalloc(g, no * 4), *d_dout = nmt_tg_dup_dev(g, dout, no * 4);
    float *d_dwte = nmt_tg_dup_dev(g, dwte, (size_t)V * C * 4);
    NMT_TG_SETUP_OK();
    nmt_tg_poison(g, d_out, no);
    NMT_ASSERT_OK(g->be->embedding_fwd(g->ctx, d_out, d_ids, d_wte, d_pos, n_rows, T, C, scale));
    NMT_ASSERT_OK(nmt_ref_embedding_fwd(NULL, want, ids, wte, pos, n_rows, T, C, scale));
    NMT_TG_EXACT("embedding_fwd", nmt_tg_fetch(g, d_out, no * 4), want, no);
    NMT_ASSERT_OK(g->be->embedding_bwd(g->ctx, d_dwte, d_dout, d_ids, n_rows, C, scale));
    NMT_ASSERT_OK(nmt_ref_embedding_bwd(NULL, want_d, dout, ids, n_rows, C, scale));
    /* Same rows in the same order with the same roundings: bitwise. */
    NMT_TG_EXACT("embedding_bwd", nmt_tg_fetch(g, d_dwte, (size_t)V * C * 4), want_d,
                 (size_t)V * C);
  }
}
