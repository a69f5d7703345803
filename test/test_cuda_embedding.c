/* test/test_cuda_embedding.c — the embedding and its backward (cuda/embedding.cu) against the
 * reference (src/ref/embedding.c). Forward: bitwise. Backward: PAD rows skipped on both sides;
 * an id with at most 32 rows (one chunk) is summed as the reference sums it, bitwise; a more
 * frequent id is summed in chunks of 32 rows, deterministic but reassociated, so cases with
 * long runs compare with rtol 1e-5 (fp32 rounding of sums of thousands of rows) and check that
 * two runs on the device agree bitwise. Cases: few repeats (exact), many repeats and long runs
 * per id, runs of exactly 32 and 33 rows (the chunk boundary), a batch that is mostly padding
 * with one id repeated thousands of times. The half-storage path's embedding_half_fwd (below):
 * bitwise. Harness and skip: test/gpu_helpers.h. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/half.h"
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

/* ------------------------------------------------------------------------------------------ */
/* embedding_half_fwd (the half-storage path, nmt/backend.h): out = embedding_fwd then
 * dropout_fwd in place, bitwise both ops, and out_h = round(out). Every value is formed by the
 * same fp32 roundings on both backends, so out must EQUAL the reference's and the device's own
 * two fp32 ops, and out_h must be the reference rounding of the device's out (bits) and equal
 * the reference's out_h, in fp16 and bf16: C % 4 == 0 (one Philox block per row slice: the
 * vector path) and not (blocks straddling rows), an output one float off alignment (the scalar
 * path with C % 4 == 0), p = 0 and p > 0, out_h NULL, and an embedding scale that overflows
 * fp16 (inf in out_h on both sides). Outputs are poisoned first; two runs give the same bits. */

static void emb_half_poison(nmt_tg_gpu *g, uint16_t *d, size_t n) {
  uint16_t *h = malloc(n * 2);
  if (!h) {
    nmt_test_fail(__FILE__, __LINE__, "poison: out of host memory");
    return;
  }
  for (size_t i = 0; i < n; i++) h[i] = 0xffff; /* NaN in both half types */
  if (g->be->copy_h2d(g->ctx, d, h, n * 2) != NMT_OK)
    nmt_test_fail(__FILE__, __LINE__, "poison: %s", nmt_last_error());
  free(h);
}

static void emb_half_mode(nmt_tg_gpu *g, nmt_precision mode, void *rc) {
  const int bf16 = mode == NMT_PRECISION_BF16;
  /* (n_rows, T, C, V, p, embedding scale, output offset in elements) */
  const struct {
    int n_rows, T, C, V;
    float p, scale;
    int off;
  } cases[] = {{91, 7, 48, 50, 0.1f, 6.9f, 0},    {91, 7, 50, 50, 0.1f, 7.0f, 0},
               {300, 30, 512, 100, 0.1f, 22.6f, 0}, {300, 30, 512, 100, 0.0f, 22.6f, 0},
               {40, 8, 64, 30, 0.2f, 8.0f, 1},     {1, 1, 3, 2, 0.3f, 1.7f, 0},
               {50, 10, 16, 20, 0.1f, 3.0e5f, 0}};
  char what[160];
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
    const int n_rows = cases[k].n_rows, T = cases[k].T, C = cases[k].C, V = cases[k].V;
    const float p = cases[k].p, scale = cases[k].scale;
    const size_t off = (size_t)cases[k].off, no = (size_t)n_rows * C, nw = (size_t)V * C;
    const uint64_t seed = 0xe3bull + k, stream = nmt_rng_stream(12, 7 + (uint32_t)k);
    int32_t *ids = nmt_tg_halloc(g, (size_t)n_rows * 4);
    NMT_TG_SETUP_OK();
    fill_ids(ids, n_rows, V, 0, 100 + k);
    float *wte = nmt_tg_randn(g, nw, 51 + k, 0.5f, 0.0f);
    float *pos = nmt_tg_randn(g, (size_t)(T + 2) * C, 52 + k, 1.0f, 0.0f);
    float *want = nmt_tg_halloc(g, no * 4), *want2 = nmt_tg_halloc(g, no * 4);
    uint16_t *want_h = nmt_tg_halloc(g, no * 2);
    NMT_TG_SETUP_OK();
    int32_t *d_ids = nmt_tg_dup_dev(g, ids, (size_t)n_rows * 4);
    float *d_wte = nmt_tg_dup_dev(g, wte, nw * 4);
    float *d_pos = nmt_tg_dup_dev(g, pos, (size_t)(T + 2) * C * 4);
    float *d_out = nmt_tg_dalloc(g, (no + 1) * 4), *d_out2 = nmt_tg_dalloc(g, (no + 1) * 4),
          *d_f32 = nmt_tg_dalloc(g, no * 4);
    uint16_t *d_h = nmt_tg_dalloc(g, (no + 1) * 2), *d_h2 = nmt_tg_dalloc(g, (no + 1) * 2);
    NMT_TG_SETUP_OK();
    nmt_tg_poison(g, d_out, no + 1);
    nmt_tg_poison(g, d_out2, no + 1);
    emb_half_poison(g, d_h, no + 1);
    emb_half_poison(g, d_h2, no + 1);
    NMT_TG_SETUP_OK();
    NMT_ASSERT_OK(g->be->embedding_half_fwd(g->ctx, d_out + off, d_h + off, d_ids, d_wte, d_pos,
                                            n_rows, T, C, scale, p, seed, stream));
    NMT_ASSERT_OK(g->be->embedding_half_fwd(g->ctx, d_out2 + off, d_h2 + off, d_ids, d_wte,
                                            d_pos, n_rows, T, C, scale, p, seed, stream));
    NMT_ASSERT_OK(nmt_ref_embedding_half_fwd(rc, want, want_h, ids, wte, pos, n_rows, T, C,
                                             scale, p, seed, stream));
    /* The device's own two fp32 ops. */
    NMT_ASSERT_OK(g->be->embedding_fwd(g->ctx, d_f32, d_ids, d_wte, d_pos, n_rows, T, C, scale));
    NMT_ASSERT_OK(g->be->dropout_fwd(g->ctx, d_f32, d_f32, no, p, seed, stream));
    const float *got = nmt_tg_fetch(g, d_out, (no + 1) * 4);
    const uint16_t *got_h = nmt_tg_fetch(g, d_h, (no + 1) * 2);
    NMT_TG_SETUP_OK();
    snprintf(what, sizeof what, "%s embedding_half_fwd out n_rows=%d C=%d p=%g offset %zu",
             bf16 ? "bf16" : "fp16", n_rows, C, (double)p, off);
    NMT_TG_EXACT(what, got + off, want, no);
    NMT_TG_EXACT("embedding_half_fwd out vs the device's embedding_fwd + dropout_fwd", got + off,
                 nmt_tg_fetch(g, d_f32, no * 4), no);
    NMT_ASSERT(isnan(got[off ? 0 : no])); /* the element beside the output is untouched */
    NMT_ASSERT(got_h[off ? 0 : no] == 0xffff);
    snprintf(what, sizeof what, "%s embedding_half_fwd out_h = round(out) n_rows=%d C=%d p=%g",
             bf16 ? "bf16" : "fp16", n_rows, C, (double)p);
    if (!nmt_tg_same_half(mode, what, got_h + off, got + off, no)) return;
    if (memcmp(got_h + off, want_h, no * 2) != 0) {
      nmt_test_fail(__FILE__, __LINE__, "%s: out_h differs from the reference's bits", what);
      return;
    }
    if (p > 0.0f) { /* some elements dropped (the mask was applied) */
      size_t zeros = 0;
      for (size_t i = 0; i < no; i++) zeros += want[i] == 0.0f;
      NMT_ASSERT(zeros > 0);
    }
    if (scale > 1e5f && !bf16) { /* the overflow case: inf in fp16, on both sides */
      size_t infs = 0;
      for (size_t i = 0; i < no; i++) infs += (want_h[i] & 0x7fff) == 0x7c00;
      NMT_ASSERT(infs > 0);
    }
    const float *got_r2 = nmt_tg_fetch(g, d_out2, (no + 1) * 4);
    NMT_TG_SETUP_OK();
    NMT_ASSERT(memcmp(got_r2, got, (no + 1) * 4) == 0); /* a second run: the same bits */
    const uint16_t *got_h2 = nmt_tg_fetch(g, d_h2, (no + 1) * 2);
    NMT_TG_SETUP_OK();
    NMT_ASSERT(memcmp(got_h2, got_h, (no + 1) * 2) == 0);
    /* out_h NULL: out alone, the same. */
    nmt_tg_poison(g, d_out2, no + 1);
    NMT_ASSERT_OK(g->be->embedding_half_fwd(g->ctx, d_out2 + off, NULL, d_ids, d_wte, d_pos,
                                            n_rows, T, C, scale, p, seed, stream));
    NMT_ASSERT_OK(nmt_ref_embedding_half_fwd(rc, want2, NULL, ids, wte, pos, n_rows, T, C, scale,
                                             p, seed, stream));
    const float *got2 = nmt_tg_fetch(g, d_out2, (no + 1) * 4);
    NMT_TG_SETUP_OK();
    NMT_TG_EXACT("embedding_half_fwd out, out_h NULL", got2 + off, want2, no);
  }
}

NMT_TG_TEST(cuda_embedding_half_matches_ref) {
  for (int m = 0; m < 2; m++) {
    const nmt_precision mode = nmt_tg_half_modes[m];
    void *rc = NULL;
    NMT_ASSERT_OK(g->be->set_precision(g->ctx, mode));
    NMT_ASSERT_OK(nmt_ref_ctx_create(0, &rc));
    if (nmt_ref_set_precision(rc, mode) == NMT_OK) emb_half_mode(g, mode, rc);
    else nmt_test_fail(__FILE__, __LINE__, "ref set_precision: %s", nmt_last_error());
    nmt_ref_ctx_destroy(rc);
    if (nmt_test_failed()) return;
  }
  /* The arguments it refuses, as the reference: bad shapes, p outside [0, 1), fp32 mode. */
  float *d = nmt_tg_dalloc(g, 64 * 4);
  int32_t *ids = nmt_tg_dalloc(g, 16 * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_EQ_STATUS(g->be->embedding_half_fwd(g->ctx, d, NULL, ids, d, d, 2, 0, 4, 1.0f, 0.1f,
                                                 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->embedding_half_fwd(g->ctx, d, NULL, ids, d, d, 2, 2, 4, 1.0f, 1.0f,
                                                 1, 2),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_FP32));
  NMT_ASSERT_EQ_STATUS(g->be->embedding_half_fwd(g->ctx, d, NULL, ids, d, d, 2, 2, 4, 1.0f, 0.1f,
                                                 1, 2),
                       NMT_ERR_INTERNAL);
}
