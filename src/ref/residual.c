/* ref/residual.c — the sublayer connection LN(x + Dropout(y)) fused (Vaswani et al. 2017 §3.1,
 * §5.4 "residual dropout"; Ba et al. 2016), row by row, so each row is made and normalised
 * while it is in cache.
 *
 * Bitwise the composition the model ran before (dropout_fwd, add, layernorm_fwd; layernorm_bwd
 * into a zeroed buffer, then dropout_bwd of it): the dropout values use dropout.c's mask and
 * fp32 expressions with the element index r*C + c, and the LayerNorm of each row is
 * nmt_ref_layernorm_fwd / _bwd itself called on that row (its statistics are per row, and its
 * dgamma/dbeta add the rows in the same order). test/test_residual.c checks the equality. */
#include <stdlib.h>
#include <string.h>

#include "nmt/half.h"
#include "nmt/ref.h"

enum { CHUNK = 4096 }; /* mask bytes per pass, as dropout.c */

static nmt_status check_args(const char *op, int M, int C, float p) {
  if (M < 0 || C < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: bad shape M=%d C=%d", op, M, C);
  if (!(p >= 0.0f && p < 1.0f))
    return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: dropout probability %g outside [0, 1)", op,
                      (double)p);
  return NMT_OK;
}

/* One row r of the forward (row = r*C, the first element's index in the mask's stream):
 * sr = xr + dropout(yr), then with gamma the LayerNorm of sr into outr (and meanr, rstdr). */
static nmt_status row_fwd(float *outr, float *sr, float *meanr, float *rstdr, const float *xr,
                          const float *yr, const float *gamma, const float *beta, size_t row,
                          int C, float eps, float p, uint64_t seed, uint64_t stream) {
  const float scale = 1.0f / (1.0f - p);
  uint8_t keep[CHUNK];
  if (p == 0.0f) {
    for (int c = 0; c < C; c++) sr[c] = xr[c] + yr[c];
  } else {
    for (int c0 = 0; c0 < C; c0 += CHUNK) {
      const int len = C - c0 < CHUNK ? C - c0 : CHUNK;
      nmt_ref_dropout_keep(keep, row + (size_t)c0, (size_t)len, p, seed, stream);
      for (int i = 0; i < len; i++)
        sr[c0 + i] = xr[c0 + i] + (keep[i] ? yr[c0 + i] * scale : 0.0f);
    }
  }
  if (gamma) NMT_TRY(nmt_ref_layernorm_fwd(NULL, outr, meanr, rstdr, sr, gamma, beta, 1, C, eps));
  return NMT_OK;
}

// out, sum, x, y: (M,C); mean, rstd: (M); gamma, beta: (C)
nmt_status nmt_ref_residual_dropout_ln_fwd(void *ctx, float *out, float *sum, float *mean,
                                           float *rstd, const float *x, const float *y,
                                           const float *gamma, const float *beta, int M, int C,
                                           float eps, float p, uint64_t seed, uint64_t stream) {
  (void)ctx;
  NMT_TRY(check_args("residual_dropout_ln_fwd", M, C, p));
  if (!sum) return nmt_errorf(NMT_ERR_INTERNAL, "ref residual_dropout_ln_fwd: sum is NULL");
  if (gamma && (!out || !beta))
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref residual_dropout_ln_fwd: gamma given without out or beta");
  for (int r = 0; r < M; r++) {
    const size_t row = (size_t)r * C;
    NMT_TRY(row_fwd(gamma ? out + row : NULL, sum + row, mean ? mean + r : NULL,
                    rstd ? rstd + r : NULL, x + row, y + row, gamma, beta, row, C, eps, p, seed,
                    stream));
  }
  return NMT_OK;
}

// dx, dy, dout, sum: (M,C); mean, rstd: (M); gamma, dgamma, dbeta: (C)
nmt_status nmt_ref_residual_dropout_ln_bwd(void *ctx, float *dx, float *dy, float *dgamma,
                                           float *dbeta, const float *dout, const float *sum,
                                           const float *gamma, const float *mean,
                                           const float *rstd, int M, int C, float p,
                                           uint64_t seed, uint64_t stream) {
  NMT_TRY(check_args("residual_dropout_ln_bwd", M, C, p));
  if (M == 0) return NMT_OK;
  /* dsum of one row, formed as the model formed it: LN' accumulated into zeros; in the
   * context's row scratch (reserve_scratch's width), so that a step does not allocate. */
  float *ds = NULL;
  void *owned = NULL;
  if (dx || dy) NMT_TRY(nmt__ref_scratch_or_malloc(ctx, NMT_REF_SLOT_ROW, (size_t)C, &ds, &owned));
  const float scale = 1.0f / (1.0f - p);
  uint8_t keep[CHUNK];
  nmt_status st = NMT_OK;
  for (int r = 0; r < M && st == NMT_OK; r++) {
    const size_t row = (size_t)r * C;
    if (ds) memset(ds, 0, (size_t)C * sizeof *ds);
    st = nmt_ref_layernorm_bwd(NULL, ds, dgamma, dbeta, dout + row, sum + row, gamma, mean + r,
                               rstd + r, 1, C);
    if (st != NMT_OK) break;
    if (dx)
      for (int c = 0; c < C; c++) dx[row + c] += ds[c];
    if (!dy) continue;
    float *dyr = dy + row;
    if (p == 0.0f) {
      for (int c = 0; c < C; c++) dyr[c] += ds[c];
      continue;
    }
    for (int c0 = 0; c0 < C; c0 += CHUNK) {
      const int len = C - c0 < CHUNK ? C - c0 : CHUNK;
      nmt_ref_dropout_keep(keep, row + (size_t)c0, (size_t)len, p, seed, stream);
      for (int i = 0; i < len; i++) dyr[c0 + i] += keep[i] ? ds[c0 + i] * scale : 0.0f;
    }
  }
  free(owned);
  return st;
}

/* ---- the half-storage path (nmt/backend.h residual_ln_half_fwd / _bwd): the rows above with y
 * widened and dy rounded; out_h is the rounding of out ---- */

// out, sum, x: (M,C) fp32; out_h, y: (M,C) half; mean, rstd: (M); gamma, beta: (C)
nmt_status nmt_ref_residual_ln_half_fwd(void *ctx, float *out, nmt_act *out_h, float *sum,
                                        float *mean, float *rstd, const float *x, const nmt_act *y,
                                        const float *gamma, const float *beta, int M, int C,
                                        float eps, float p, uint64_t seed, uint64_t stream) {
  NMT_TRY(check_args("residual_ln_half_fwd", M, C, p));
  int bf16;
  NMT_TRY(nmt__ref_half_mode(ctx, "residual_ln_half_fwd", &bf16));
  if (!sum) return nmt_errorf(NMT_ERR_INTERNAL, "ref residual_ln_half_fwd: sum is NULL");
  if (gamma && (!out || !beta))
    return nmt_errorf(NMT_ERR_INTERNAL, "ref residual_ln_half_fwd: gamma given without out or beta");
  if (M == 0) return NMT_OK;
  float *yr;
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_ROW, (size_t)C, &yr));
  for (int r = 0; r < M; r++) {
    const size_t row = (size_t)r * C;
    nmt_half_decode_array(bf16, yr, y + row, (size_t)C);
    /* One row of the fp32 op: its element indices are row + c, so the mask is the same. */
    NMT_TRY(row_fwd(out ? out + row : NULL, sum + row, mean ? mean + r : NULL,
                    rstd ? rstd + r : NULL, x + row, yr, gamma, beta, row, C, eps, p, seed,
                    stream));
    if (gamma && out_h) nmt_half_encode_array(bf16, out_h + row, out + row, (size_t)C);
  }
  return NMT_OK;
}

// dx, dout, sum: (M,C) fp32; dy: (M,C) half; mean, rstd: (M); gamma, dgamma, dbeta: (C)
nmt_status nmt_ref_residual_ln_half_bwd(void *ctx, float *dx, nmt_act *dy, float *dgamma,
                                        float *dbeta, const float *dout, const float *sum,
                                        const float *gamma, const float *mean, const float *rstd,
                                        int M, int C, float p, uint64_t seed, uint64_t stream) {
  NMT_TRY(check_args("residual_ln_half_bwd", M, C, p));
  int bf16;
  NMT_TRY(nmt__ref_half_mode(ctx, "residual_ln_half_bwd", &bf16));
  if (M == 0) return NMT_OK;
  float *ds;
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_ROW, (size_t)C, &ds));
  const float scale = 1.0f / (1.0f - p);
  uint8_t keep[CHUNK];
  for (int r = 0; r < M; r++) {
    const size_t row = (size_t)r * C;
    memset(ds, 0, (size_t)C * sizeof *ds);
    NMT_TRY(nmt_ref_layernorm_bwd(NULL, ds, dgamma, dbeta, dout + row, sum + row, gamma, mean + r,
                                  rstd + r, 1, C));
    if (dx) memcpy(dx + row, ds, (size_t)C * sizeof *ds);
    if (!dy) continue;
    if (p > 0.0f)
      for (int c0 = 0; c0 < C; c0 += CHUNK) {
        const int len = C - c0 < CHUNK ? C - c0 : CHUNK;
        nmt_ref_dropout_keep(keep, row + (size_t)c0, (size_t)len, p, seed, stream);
        for (int i = 0; i < len; i++) ds[c0 + i] = keep[i] ? ds[c0 + i] * scale : 0.0f;
      }
    nmt_half_encode_array(bf16, dy + row, ds, (size_t)C);
  }
  return NMT_OK;
}
