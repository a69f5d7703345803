/* test/test_cuda_dropout.c — inverted dropout (cuda/dropout.cu) against the reference
 * (src/ref/dropout.c): the Philox port gives bitwise the reference's mask and values, forward
 * (also in place, as the model calls it) and backward, and the stream really selects the mask;
 * and the half-storage path's dropout_half (below). Harness and skip: test/gpu_helpers.h. */
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

/* ------------------------------------------------------------------------------------------ */
/* dropout_half (the half-storage path, nmt/backend.h): out = round(keep ? x * (1/(1-p)) : 0)
 * with x the half input's value or an fp32 input, against nmt_ref_dropout_half. The mask and
 * the fp32 product are dropout_fwd's on both backends, and the rounding is the one each
 * backend's cast_half is held to, so the half bits must be EQUAL (a NaN as any NaN), in fp16 and
 * bf16: from half and from fp32 inputs, in place, p = 0 and p > 0, n not a multiple of the
 * 4-element Philox block, with the buffers aligned (8- and 16-byte vectors) and one element off
 * (the scalar path). fp32 inputs include values past 65504, inf in fp16 on both sides. The
 * elements around the n written ones must keep their poison, and two runs give the same bits. */

/* Bits got (device) and want (reference) equal, a NaN matching any NaN; the count and first
 * mismatch on failure. */
static int dh_same_bits(nmt_precision mode, const char *what, const uint16_t *got,
                        const uint16_t *want, size_t n) {
  const uint16_t inf = mode == NMT_PRECISION_FP16 ? 0x7c00 : 0x7f80;
  size_t wrong = 0, first = 0;
  for (size_t i = 0; i < n; i++) {
    const int gn = (got[i] & 0x7fff) > inf, wn = (want[i] & 0x7fff) > inf;
    if ((gn || wn) ? !(gn && wn) : got[i] != want[i])
      if (wrong++ == 0) first = i;
  }
  if (wrong)
    nmt_test_fail(__FILE__, __LINE__, "%s: %zu of %zu half elements differ; first at %zu: "
                  "device 0x%04x, reference 0x%04x", what, wrong, n, first, got[first],
                  want[first]);
  return wrong == 0;
}

enum { DH_PAD = 8, DH_POISON = 0xffff }; /* elements around the output; a NaN in both types */

static void dh_poison(nmt_tg_gpu *g, uint16_t *d, size_t n) {
  uint16_t *h = malloc(n * 2);
  if (!h) {
    nmt_test_fail(__FILE__, __LINE__, "poison: out of host memory");
    return;
  }
  for (size_t i = 0; i < n; i++) h[i] = DH_POISON;
  if (g->be->copy_h2d(g->ctx, d, h, n * 2) != NMT_OK)
    nmt_test_fail(__FILE__, __LINE__, "poison: %s", nmt_last_error());
  free(h);
}

/* The device's n + DH_PAD elements from d: [off, off + n) against want, the rest poisoned. */
static int dh_check(nmt_tg_gpu *g, nmt_precision mode, const char *what, const uint16_t *d,
                    size_t off, size_t n, const uint16_t *want) {
  const uint16_t *h = nmt_tg_fetch(g, d, (n + DH_PAD) * 2);
  if (!h) return 0;
  for (size_t i = 0; i < n + DH_PAD; i++)
    if ((i < off || i >= off + n) && h[i] != DH_POISON) {
      nmt_test_fail(__FILE__, __LINE__, "%s: wrote element %zu outside [%zu, %zu)", what, i, off,
                    off + n);
      return 0;
    }
  return dh_same_bits(mode, what, h + off, want, n);
}

static void dropout_half_mode(nmt_tg_gpu *g, nmt_precision mode, void *rc) {
  const int bf16 = mode == NMT_PRECISION_BF16;
  const size_t n = 100003, nt = n + DH_PAD;
  float *x = nmt_tg_randn(g, nt, 61 + bf16, 2.0f, 0.0f);
  uint16_t *xh = nmt_tg_halloc(g, nt * 2), *want = nmt_tg_halloc(g, n * 2),
           *want2 = nmt_tg_halloc(g, nt * 2);
  NMT_TG_SETUP_OK();
  for (size_t i = 0; i < nt; i += 997) x[i] = i % 2 ? 7.0e4f : -1.0e5f; /* fp16: +-inf */
  nmt_half_encode_array(bf16, xh, x, nt);
  uint16_t *d_xh = nmt_tg_dup_dev(g, xh, nt * 2), *d_out = nmt_tg_dalloc(g, nt * 2),
           *d_out2 = nmt_tg_dalloc(g, nt * 2), *d_io = nmt_tg_dalloc(g, nt * 2);
  float *d_x = nmt_tg_dup_dev(g, x, nt * 4);
  NMT_TG_SETUP_OK();
  const float ps[3] = {0.1f, 0.5f, 0.0f};
  char what[128];
  for (int k = 0; k < 3; k++)
    for (size_t off = 0; off < 2; off++) {
      const float p = ps[k];
      const uint64_t seed = 0x5eedull + (uint64_t)k, stream = nmt_rng_stream(78, 4 + (uint32_t)k);
      for (int f32 = 0; f32 < 2; f32++) {
        const void *d_in = f32 ? (const void *)(d_x + off) : (const void *)(d_xh + off);
        const void *h_in = f32 ? (const void *)(x + off) : (const void *)(xh + off);
        dh_poison(g, d_out, nt);
        dh_poison(g, d_out2, nt);
        NMT_TG_SETUP_OK();
        NMT_ASSERT_OK(g->be->dropout_half(g->ctx, d_out + off, d_in, f32, n, p, seed, stream));
        NMT_ASSERT_OK(g->be->dropout_half(g->ctx, d_out2 + off, d_in, f32, n, p, seed, stream));
        NMT_ASSERT_OK(nmt_ref_dropout_half(rc, want, h_in, f32, n, p, seed, stream));
        snprintf(what, sizeof what, "%s dropout_half from %s p=%g offset %zu",
                 bf16 ? "bf16" : "fp16", f32 ? "fp32" : "half", (double)p, off);
        if (!dh_check(g, mode, what, d_out, off, n, want)) return;
        snprintf(what, sizeof what, "%s dropout_half from %s p=%g offset %zu: second run",
                 bf16 ? "bf16" : "fp16", f32 ? "fp32" : "half", (double)p, off);
        if (!dh_check(g, mode, what, d_out2, off, n, want)) return;
        /* The test can fail: some elements kept, and with p > 0 some dropped. */
        size_t kept = 0, zeros = 0;
        for (size_t i = 0; i < n; i++) {
          kept += (want[i] & 0x7fff) != 0;
          zeros += (want[i] & 0x7fff) == 0;
        }
        NMT_ASSERT(kept > n / 4);
        if (p > 0.0f) NMT_ASSERT(zeros > n / 20);
      }
      /* In place on half elements, as the model calls it after the FFN's ReLU. */
      memcpy(want2, xh, nt * 2);
      NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_io, xh, nt * 2));
      NMT_ASSERT_OK(g->be->dropout_half(g->ctx, d_io + off, d_io + off, 0, n, p, seed, stream));
      NMT_ASSERT_OK(nmt_ref_dropout_half(rc, want2 + off, want2 + off, 0, n, p, seed, stream));
      const uint16_t *h = nmt_tg_fetch(g, d_io, nt * 2);
      NMT_TG_SETUP_OK();
      snprintf(what, sizeof what, "%s dropout_half in place p=%g offset %zu",
               bf16 ? "bf16" : "fp16", (double)p, off);
      if (!dh_same_bits(mode, what, h, want2, nt)) return;
    }
  if (!bf16) {
    /* fp16: the large fp32 inputs overflow to inf on both sides (checked bitwise above); say
     * that they were there. */
    NMT_ASSERT_OK(nmt_ref_dropout_half(rc, want, x, 1, n, 0.0f, 1, 2));
    NMT_ASSERT(want[997] == 0x7c00 && want[0] == 0xfc00);
  }
}

NMT_TG_TEST(cuda_dropout_half_matches_ref) {
  for (int m = 0; m < 2; m++) {
    const nmt_precision mode = nmt_tg_half_modes[m];
    void *rc = NULL;
    NMT_ASSERT_OK(g->be->set_precision(g->ctx, mode));
    NMT_ASSERT_OK(nmt_ref_ctx_create(0, &rc));
    if (nmt_ref_set_precision(rc, mode) == NMT_OK) dropout_half_mode(g, mode, rc);
    else nmt_test_fail(__FILE__, __LINE__, "ref set_precision: %s", nmt_last_error());
    nmt_ref_ctx_destroy(rc);
    if (nmt_test_failed()) return;
  }
  /* The arguments it refuses, as the reference: p outside [0, 1), an fp32 context. */
  uint16_t *d = nmt_tg_dalloc(g, 64);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_EQ_STATUS(g->be->dropout_half(g->ctx, d, d, 0, 8, 1.0f, 1, 2), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->dropout_half(g->ctx, d, d, 0, 8, -0.1f, 1, 2), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_FP32));
  NMT_ASSERT_EQ_STATUS(g->be->dropout_half(g->ctx, d, d, 0, 8, 0.1f, 1, 2), NMT_ERR_INTERNAL);
}
