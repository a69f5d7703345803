/* ref/dropout.c — inverted dropout (Srivastava et al. 2014; Vaswani et al. 2017 §5.4) with a
 * counter-based mask: element e is kept iff nmt_rng_uniform(seed, stream, e) >= p, so backward
 * regenerates the mask instead of storing it. */
#include <string.h>

#include "nmt/half.h"
#include "nmt/ref.h"
#include "nmt/rng.h"

enum { LANES = 8 }; /* Philox blocks computed side by side */

/* LANES consecutive Philox4x32-10 blocks blk0.. of one stream: the rounds of nmt_philox4x32
 * written lane-wise (structure of arrays) so that -O2 vectorizes them, ~2.4x faster than one
 * block at a time. out[w][l] = word w of block blk0 + l; equality with nmt_rng_uniform is
 * tested in test/test_dropout.c. */
static void philox_lanes(uint64_t blk0, const uint32_t stream[2], const uint32_t key[2],
                         uint32_t out[4][LANES]) {
  uint32_t c0[LANES], c1[LANES], c2[LANES], c3[LANES], k0 = key[0], k1 = key[1];
  for (int l = 0; l < LANES; l++) {
    uint64_t b = blk0 + (uint64_t)l;
    c0[l] = (uint32_t)b, c1[l] = (uint32_t)(b >> 32), c2[l] = stream[0], c3[l] = stream[1];
  }
  for (int r = 0; r < 10; r++) {
    for (int l = 0; l < LANES; l++) {
      uint64_t p0 = (uint64_t)0xD2511F53u * c0[l], p1 = (uint64_t)0xCD9E8D57u * c2[l];
      uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1[l] ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3[l] ^ k1;
      c1[l] = (uint32_t)p1, c3[l] = (uint32_t)p0, c0[l] = n0, c2[l] = n2;
    }
    k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
  }
  for (int l = 0; l < LANES; l++)
    out[0][l] = c0[l], out[1][l] = c1[l], out[2][l] = c2[l], out[3][l] = c3[l];
}

/* Same float and comparison as nmt_rng_uniform(...) >= p. */
static inline uint8_t keep_of(uint32_t w, float p) { return (float)(w >> 8) * 0x1p-24f >= p; }

void nmt_ref_dropout_keep(uint8_t *keep, uint64_t e0, size_t n, float p, uint64_t seed,
                          uint64_t stream) {
  const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
  const uint32_t st[2] = {(uint32_t)stream, (uint32_t)(stream >> 32)};
  size_t i = 0;
  while (i < n) {
    uint64_t e = e0 + i, blk = e >> 2;
    if ((e & 3) == 0 && n - i >= 4 * LANES) {
      uint32_t w[4][LANES];
      philox_lanes(blk, st, key, w);
      for (int l = 0; l < LANES; l++)
        for (int j = 0; j < 4; j++) keep[i + 4 * l + j] = keep_of(w[j][l], p);
      i += 4 * LANES;
      continue;
    }
    /* Unaligned head and short tail: one block at a time. */
    uint32_t ctr[4] = {(uint32_t)blk, (uint32_t)(blk >> 32), st[0], st[1]}, w[4];
    nmt_philox4x32(ctr, key, w);
    for (unsigned j = (unsigned)(e & 3); j < 4 && i < n; j++, i++) keep[i] = keep_of(w[j], p);
  }
}

static nmt_status check_p(const char *op, float p) {
  if (!(p >= 0.0f && p < 1.0f))
    return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: dropout probability %g outside [0, 1)", op,
                      (double)p);
  return NMT_OK;
}

enum { CHUNK = 4096 }; /* mask bytes per pass: stays in L1, a multiple of the 4-word block */

nmt_status nmt_ref_dropout_fwd(void *ctx, float *out, const float *inp, size_t n, float p,
                               uint64_t seed, uint64_t stream) {
  (void)ctx;
  NMT_TRY(check_p("dropout_fwd", p));
  if (p == 0.0f) {
    if (out != inp && n) memmove(out, inp, n * sizeof(float));
    return NMT_OK;
  }
  float scale = 1.0f / (1.0f - p);
  uint8_t keep[CHUNK];
  for (size_t s = 0; s < n; s += CHUNK) {
    size_t len = n - s < CHUNK ? n - s : CHUNK;
    nmt_ref_dropout_keep(keep, s, len, p, seed, stream);
    for (size_t i = 0; i < len; i++) out[s + i] = keep[i] ? inp[s + i] * scale : 0.0f;
  }
  return NMT_OK;
}

nmt_status nmt_ref_dropout_bwd(void *ctx, float *dinp, const float *dout, size_t n, float p,
                               uint64_t seed, uint64_t stream) {
  (void)ctx;
  NMT_TRY(check_p("dropout_bwd", p));
  if (!dinp) return NMT_OK;
  if (p == 0.0f) {
    for (size_t i = 0; i < n; i++) dinp[i] += dout[i];
    return NMT_OK;
  }
  float scale = 1.0f / (1.0f - p);
  uint8_t keep[CHUNK];
  for (size_t s = 0; s < n; s += CHUNK) {
    size_t len = n - s < CHUNK ? n - s : CHUNK;
    nmt_ref_dropout_keep(keep, s, len, p, seed, stream);
    for (size_t i = 0; i < len; i++) dinp[s + i] += keep[i] ? dout[s + i] * scale : 0.0f;
  }
  return NMT_OK;
}

/* ---- the half-storage path (nmt/backend.h dropout_half) ---- */

// out: (n) half; inp: (n) half (inp_f32 = 0) or fp32 (inp_f32 = 1); out may equal a half inp
nmt_status nmt_ref_dropout_half(void *ctx, nmt_act *out, const void *inp, int inp_f32, size_t n,
                                float p, uint64_t seed, uint64_t stream) {
  NMT_TRY(check_p("dropout_half", p));
  int bf16;
  NMT_TRY(nmt__ref_half_mode(ctx, "dropout_half", &bf16));
  if (n == 0) return NMT_OK;
  if (!out || !inp) return nmt_errorf(NMT_ERR_INTERNAL, "ref dropout_half: NULL pointer");
  if (inp_f32) {
    /* Compared as integers (nmt/backend.h nmt_half_copy_offset says why). */
    const uintptr_t o0 = (uintptr_t)out, o1 = o0 + n * sizeof(nmt_act);
    const uintptr_t i0 = (uintptr_t)inp, i1 = i0 + n * sizeof(float);
    if (o0 < i1 && i0 < o1)
      return nmt_errorf(NMT_ERR_INTERNAL,
                        "ref dropout_half: the fp32 input overlaps the half output");
  }
  const float scale = 1.0f / (1.0f - p);
  const nmt_act *ih = inp;
  const float *ifl = inp;
  uint8_t keep[CHUNK];
  float x[CHUNK];
  for (size_t s = 0; s < n; s += CHUNK) {
    const size_t len = n - s < CHUNK ? n - s : CHUNK;
    if (inp_f32) memcpy(x, ifl + s, len * sizeof *x);
    else nmt_half_decode_array(bf16, x, ih + s, len);
    if (p > 0.0f) {
      nmt_ref_dropout_keep(keep, s, len, p, seed, stream);
      for (size_t i = 0; i < len; i++) x[i] = keep[i] ? x[i] * scale : 0.0f;
    }
    nmt_half_encode_array(bf16, out + s, x, len);
  }
  return NMT_OK;
}
