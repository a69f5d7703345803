/* cost.c — what one training pass of the model costs, from its shapes alone: model FLOPs (for
 * MFU and the scaling model) and an upper bound on the activation arena (to refuse absurd
 * sizes before the exact size_t count could wrap). The exact arena size is
 * nmt_model_arena_bytes (transformer.c); the per-module profiler costs are in profile.c. */
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
  /* Floats per row: the table at the top of transformer.c, every layer at its full size. */
  double row = c->enc_layers * (8 * C + 4 + H * L + F) +
               c->dec_layers * (14 * C + 6 + 2 * H * L + F) +
               12 * C + V + 9 + H * L + 2 * F;
  /* Checkpointing only shrinks that, except without any layer: the self-attention and FFN
   * workspaces are carved all the same. */
  if (c->checkpoint_activations && c->enc_layers + c->dec_layers == 0)
    row += 7 * C + 4 + H * L + F;
  /* Every piece starts on a 64-byte boundary (arena.c): under 64 bytes of padding each, for
   * at most 40 pieces outside the layers, 12 per encoder and 19 per decoder layer. */
  double pad = 64.0 * (40 + 12.0 * c->enc_layers + 19.0 * c->dec_layers);
  return 4.0 * (N * row + (double)c->max_positions * C) + pad;
}
