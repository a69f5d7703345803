/* cost.c — what one training pass of the model costs, from its shapes alone: model FLOPs (for
 * MFU and the scaling model), an upper bound on the activation arena (to refuse absurd
 * sizes before the exact size_t count could wrap), and the scratch plan (the largest shapes
 * its ops are called with, from which the backend sizes its scratch once). The exact arena
 * size is nmt_model_arena_bytes (transformer.c); the per-module profiler costs are in
 * profile.c. */
#include <string.h>

#include "nmt/model.h"

double nmt_model_train_flops(const nmt_model_cfg *c, int B, int Ts, int Tt) {
  double C = c->d_model, F = c->d_ff, V = c->vocab, ns = (double)B * Ts, nt = (double)B * Tt;
  double enc = 2 * ns * C * 3 * C + 2 * ns * C * C + 4.0 * B * Ts * Ts * C + 4 * ns * C * F;
  double dec = 2 * nt * C * 3 * C + 2 * nt * C * C + 4.0 * B * Tt * Tt * C /* self-attention */
               + 2 * nt * C * C + 2 * ns * C * 2 * C + 2 * nt * C * C +
               4.0 * B * Tt * Ts * C /* cross-attention: q, kv (on the source), out, scores */
               + 4 * nt * C * F;      /* FFN */
  return 3 * (c->enc_layers * enc + c->dec_layers * dec + 2 * nt * C * V);
}

double nmt_model_activation_bytes_bound(const nmt_model_cfg *c, int max_tokens, int max_len) {
  double N = max_tokens, C = c->d_model, F = c->d_ff, H = c->n_heads;
  double L = max_len < max_tokens ? max_len : N, V = c->vocab;
  /* What an attention sublayer keeps of its softmax per row, and the backward's scratch for
   * it: the probs H*L, or with fused attention the log-sum-exp and the row sums, H each. */
  double HL = c->fused_attention ? H : H * L;
  /* Floats per row: the table at the top of transformer.c, every layer at its full size. */
  double row = c->enc_layers * (8 * C + 4 + HL + F) + c->dec_layers * (14 * C + 6 + 2 * HL + F) +
               12 * C + V + 9 + HL + 2 * F;
  /* Checkpointing only shrinks that, except without any layer: the self-attention and FFN
   * workspaces are carved all the same. */
  if (c->checkpoint_activations && c->enc_layers + c->dec_layers == 0)
    row += 7 * C + 4 + HL + F;
  /* Half storage keeps fewer bytes per layer in all but the FFN sublayer, whose output gains a
   * half copy and the ReLU mask: a generous allowance for those (in floats). */
  if (c->act_half) row += (c->enc_layers + c->dec_layers + 2) * (C + F / 16 + 4);
  /* Every piece starts on a 64-byte boundary (arena.c): under 64 bytes of padding each, for
   * at most 40 pieces outside the layers, 16 per encoder and 24 per decoder layer (half
   * storage carves a few more than the fp32 path's 12 and 19). */
  double pad = 64.0 * (40 + 16.0 * c->enc_layers + 24.0 * c->dec_layers);
  return 4.0 * (N * row + (double)c->max_positions * C) + pad;
}

static size_t max3(size_t a, size_t b, size_t c) {
  size_t m = a > b ? a : b;
  return m > c ? m : c;
}

/* Every op call of nmt_model_forward (train or eval), nmt_model_backward and nmt_model_logits
 * has B*T <= N rows per side (nmt__model_check_shape) and T <= L keys, so with N = max_tokens,
 * L = min(max_len, max_tokens):
 *   linear layers (forward.c, backward.c): M <= N rows; (K, N) in {(C, 3C) fused Q/K/V,
 *     (C, C) out and cross q (and the three Q/K/V blocks with qkv_streams), (C, 2C) cross kv
 *     (on the source's B*Ts <= N rows), (C, F) fc1, (F, C) fc2, (C, V) the generator};
 *   attention: B*Tq <= N and B*Tk <= N rows of H*dk = C, B*H*Tq*Tk <= H*N*L scores (dropout
 *     scratch only with attn_dropout > 0: eval passes have none);
 *   embedding_bwd: N rows of C; layernorm_bwd, residual_dropout_ln_bwd: rows of C.
 * With qkv_streams the aux streams run only the Q/K/V blocks' GEMMs (qkv_streams.c): M <= N,
 * K = N = C. Nothing else runs on them. */
void nmt_model_scratch_plan(const nmt_model_cfg *cfg, int max_tokens, int max_len,
                            nmt_scratch_plan *out) {
  memset(out, 0, sizeof *out);
  const size_t N = (size_t)max_tokens, C = (size_t)cfg->d_model, F = (size_t)cfg->d_ff;
  const size_t H = (size_t)cfg->n_heads, V = (size_t)cfg->vocab;
  const size_t L = max_len < max_tokens ? (size_t)max_len : N;
  nmt_scratch_need *m = &out->main;
  m->gemm_rows = N;
  m->gemm_inp = N * (C > F ? C : F);
  m->gemm_w = C * max3(3 * C, F, V);
  m->gemm_out = N * max3(3 * C, F, V);
  m->att_q = N * C;
  m->att_kv = N * C;
  m->att_scores = cfg->attn_dropout > 0 ? N * H * L : 0;
  m->emb_rows = N;
  m->width = C;
  /* The half-storage ops: their extra needs follow from the bounds above and V. */
  m->half_acts = cfg->act_half ? 1 : 0;
  m->xent_cols = cfg->act_half ? V : 0;
  if (cfg->qkv_streams) {
    nmt_scratch_need *a = &out->aux;
    a->gemm_rows = N;
    a->gemm_inp = N * C;
    a->gemm_w = C * C;
    a->gemm_out = N * C;
    a->half_acts = m->half_acts;
  }
}
