/* ref/embedding.c — token embedding times scale plus the positional table
 * (Vaswani et al. 2017 §3.4 scales the embedding by sqrt(d_model); §3.5 sinusoids). */
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

/* ---- STUB: the half-storage ops, to be implemented ---- */
nmt_status nmt_ref_embedding_half_fwd(void *ctx, float *out, nmt_act *out_h, const int32_t *ids, const float *wte, const float *pos, int n_rows, int T, int C, float scale, float p, uint64_t seed, uint64_t stream) {
  (void)ctx; (void)out; (void)out_h; (void)ids; (void)wte; (void)pos; (void)n_rows; (void)T; (void)C; (void)scale; (void)p; (void)seed; (void)stream;
  return nmt_errorf(NMT_ERR_INTERNAL, "ref embedding_half_fwd: not implemented yet");
}
