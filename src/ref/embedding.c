/* ref/embedding.c — token embedding times scale plus the positional table
 * (Vaswani et al. 2017 §3.4 scales the embedding by sqrt(d_model); §3.5 sinusoids). */
#include "nmt/half.h"
#include "nmt/ref.h"

// out: (B*T,C); ids: (B*T); wte: (V,C); pos: (>=T,C)
nmt_status nmt_ref_embedding_fwd(void *ctx, float *out, const int32_t *ids, const float *wte,
                                 const float *pos, int n_rows, int T, int C, float scale) {
  (void)ctx;
  if (n_rows < 0 || T < 1 || C < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref embedding_fwd: bad shape n_rows=%d T=%d C=%d",
                      n_rows, T, C);
  for (int r = 0; r < n_rows; r++) {
    if (ids[r] < 0)
      return nmt_errorf(NMT_ERR_INTERNAL, "ref embedding_fwd: negative token id %d at row %d",
                        (int)ids[r], r);
    const float *e = wte + (size_t)ids[r] * C;
    const float *p = pos + (size_t)(r % T) * C;
    float *o = out + (size_t)r * C;
    for (int c = 0; c < C; c++) o[c] = scale * e[c] + p[c];
  }
  return NMT_OK;
}

// dwte: (V,C); dout: (B*T,C). Rows in order, so repeated ids sum deterministically; rows of
// NMT_PAD_ID are skipped (no gradient for padding, as torch.nn.Embedding's padding_idx).
nmt_status nmt_ref_embedding_bwd(void *ctx, float *dwte, const float *dout, const int32_t *ids,
                                 int n_rows, int C, float scale) {
  (void)ctx;
  if (n_rows < 0 || C < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref embedding_bwd: bad shape n_rows=%d C=%d", n_rows,
                      C);
  if (!dwte) return NMT_OK;
  for (int r = 0; r < n_rows; r++) {
    if (ids[r] < 0)
      return nmt_errorf(NMT_ERR_INTERNAL, "ref embedding_bwd: negative token id %d at row %d",
                        (int)ids[r], r);
    if (ids[r] == NMT_PAD_ID) continue;
    float *d = dwte + (size_t)ids[r] * C;
    const float *g = dout + (size_t)r * C;
    for (int c = 0; c < C; c++) d[c] += scale * g[c];
  }
  return NMT_OK;
}

/* ---- the half-storage path (nmt/backend.h embedding_half_fwd): the two fp32 ops, then the
 * half copy of their result ---- */

// out: (B*T,C) fp32; out_h: (B*T,C) half or NULL; ids: (B*T); wte: (V,C); pos: (>=T,C)
nmt_status nmt_ref_embedding_half_fwd(void *ctx, float *out, nmt_act *out_h, const int32_t *ids,
                                      const float *wte, const float *pos, int n_rows, int T, int C,
                                      float scale, float p, uint64_t seed, uint64_t stream) {
  int bf16;
  NMT_TRY(nmt__ref_half_mode(ctx, "embedding_half_fwd", &bf16));
  NMT_TRY(nmt_ref_embedding_fwd(ctx, out, ids, wte, pos, n_rows, T, C, scale));
  const size_t n = (size_t)n_rows * (size_t)C;
  if (p > 0.0f) NMT_TRY(nmt_ref_dropout_fwd(ctx, out, out, n, p, seed, stream));
  else if (!(p == 0.0f))
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref embedding_half_fwd: dropout probability %g outside [0, 1)", (double)p);
  if (out_h) nmt_half_encode_array(bf16, out_h, out, n);
  return NMT_OK;
}
