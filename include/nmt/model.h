/* nmt/model.h — the Transformer of Vaswani et al. 2017 (§3) as a sequence of backend op calls.
 *
 * Knows shapes, not devices: every computation goes through an nmt_backend table, every buffer
 * comes from that backend's malloc. Encoder-decoder; multi-head attention with source padding
 * masks and the causal mask; ReLU FFN; sinusoidal positions; embeddings scaled by sqrt(d_model);
 * one embedding matrix shared by source, target and the output projection (§3.4); residual +
 * LayerNorm, post-LN as the paper or pre-LN (then with a final LayerNorm per stack); dropout on
 * sublayer outputs, embedding sums, attention weights and FFN activations; label-smoothed
 * cross entropy that ignores padding.
 *
 * Parameters live in ONE flat fp32 buffer owned by the caller; gradients in a second one of the
 * same layout (plus NMT_GRAD_EXTRA trailing slots, see below). The layout is in backward
 * completion order so gradient buckets fill front to back during backward:
 *   decoder.ln_f (pre-LN only), decoder.layers.{L-1..0}, encoder.ln_f (pre-LN only),
 *   encoder.layers.{L-1..0}, embed.weight.
 * nmt_model_param_table() lists every tensor (name, offset, shape); docs/formats.md and
 * tools/make-fixture.py follow it. Tensor names inside a layer (forward order):
 *   encoder.layers.i.{self_attn.qkv.weight (3C,C), self_attn.qkv.bias (3C),
 *     self_attn.out.weight (C,C), self_attn.out.bias (C), ln1.weight (C), ln1.bias (C),
 *     ffn.fc1.weight (F,C), ffn.fc1.bias (F), ffn.fc2.weight (C,F), ffn.fc2.bias (C),
 *     ln2.weight (C), ln2.bias (C)}
 *   decoder.layers.i.{self_attn.qkv.*, self_attn.out.*, ln1.*, cross_attn.q.weight (C,C),
 *     cross_attn.q.bias (C), cross_attn.kv.weight (2C,C), cross_attn.kv.bias (2C),
 *     cross_attn.out.*, ln2.*, ffn.fc1.*, ffn.fc2.*, ln3.*}
 *   {encoder,decoder}.ln_f.{weight,bias} (C) with pre-LN; embed.weight (V,C).
 * qkv rows are [W_q; W_k; W_v]; heads are contiguous column blocks of d_k = C/H.
 *
 * defines: nmt_model_cfg, nmt_param_info, nmt_model, nmt_model_* , NMT_GRAD_EXTRA
 */
#ifndef NMT_MODEL_H
#define NMT_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Trailing slots of the gradient buffer, after the n_params gradients. They are reduced with
 * the last bucket, so the loss and the loss normaliser travel with the gradients (no separate
 * collective, no gather on one rank). */
enum {
  NMT_GRAD_SLOT_LOSS = 0,    /* sum of label-smoothed loss over target tokens */
  NMT_GRAD_SLOT_TOKENS = 1,  /* number of non-pad target tokens */
  NMT_GRAD_SLOT_NLL = 2,     /* sum of plain NLL (no smoothing), for perplexity */
  NMT_GRAD_SLOT_STOP = 3,    /* > 0 after reduction: some rank was asked to stop (all stop together) */
  NMT_GRAD_EXTRA = 4
};

typedef struct {
  int vocab, d_model, n_heads, d_ff, enc_layers, dec_layers, max_positions;
  float dropout, attn_dropout, relu_dropout, label_smoothing;
  nmt_norm_kind norm;
  float ln_eps; /* 1e-5 */
} nmt_model_cfg;

/* Copies the model keys of a run config (ln_eps = 1e-5). */
void nmt_model_cfg_from_config(const nmt_config *c, nmt_model_cfg *out);

typedef struct {
  char name[80];
  size_t offset; /* in floats from the start of the flat buffer */
  size_t numel;
  int ndim;      /* 1 or 2 */
  int shape[2];
} nmt_param_info;

/* Number of parameters (floats) in the flat buffer, excluding NMT_GRAD_EXTRA. */
size_t nmt_model_num_params(const nmt_model_cfg *cfg);
/* Writes the tensor table to `out` (may be NULL) and returns the number of tensors. */
int nmt_model_param_table(const nmt_model_cfg *cfg, nmt_param_info *out);
/* Initialises host_params (n_params floats): Xavier-uniform matrices, zero biases, LayerNorm
 * gain 1 / bias 0, embedding N(0, d_model^-0.5) (fairseq's choice for tied embeddings), the
 * PAD row zero. Deterministic in seed (nmt_rng). */
void nmt_model_init_params(const nmt_model_cfg *cfg, uint64_t seed, float *host_params);

typedef struct nmt_model nmt_model;

/* Called during backward each time the gradients of every parameter at flat offsets
 * [0, ready_floats) are final; ready_floats only grows within one backward. */
typedef nmt_status (*nmt_grad_ready_fn)(void *user, size_t ready_floats);

/* Allocates activations for micro-batches of up to max_tokens padded tokens per side and rows
 * of up to max_len positions, on backend `be` with device context `ctx`.
 * Errors: NMT_ERR_CONFIG (max_len > max_positions, d_model % n_heads), NMT_ERR_NOMEM. */
nmt_status nmt_model_create(const nmt_model_cfg *cfg, const nmt_backend *be, void *ctx,
                            int max_tokens, int max_len, nmt_model **out);
void nmt_model_destroy(nmt_model *m);

/* Forward pass and loss for batch `b` (device memory). Adds the summed label-smoothed loss,
 * the token count and the summed NLL into grad_extra[NMT_GRAD_SLOT_*] (device memory; pass
 * grads + n_params). train != 0 enables dropout with streams nmt_rng_stream(step, site) under
 * seed. Leaves d(sum loss)/d logits in place for nmt_model_backward when train != 0.
 * Errors: NMT_ERR_DATA if the batch exceeds the sizes given at create. */
nmt_status nmt_model_forward(nmt_model *m, const float *params, const nmt_batch *b, int train,
                             uint64_t seed, uint64_t step, float *grad_extra);

/* Backward of the last nmt_model_forward(train=1): ACCUMULATES d(sum of loss)/d params into
 * grads (same layout as params). Calls ready(user, n) as buckets' gradients become final (ready
 * may be NULL). The caller divides by the total token count (reduced across devices). */
nmt_status nmt_model_backward(nmt_model *m, const float *params, float *grads,
                              const nmt_batch *b, nmt_grad_ready_fn ready, void *user);

/* Greedy decoding (beam 1) for the sources of `b` (b->src, b->src_lens, n_sent, src_len):
 * out_ids (n_sent, max_out) host int32, out_lens (n_sent) host; generation stops at EOS (not
 * written) or at min(max_out, src_len_i + extra_len) tokens. Recomputes the decoder over the
 * prefix each step (incremental decoding is future work). */
nmt_status nmt_model_greedy(nmt_model *m, const float *params, const nmt_batch *b, int max_out,
                            int extra_len, int32_t *out_ids, int32_t *out_lens);

#ifdef __cplusplus
}
#endif
#endif /* NMT_MODEL_H */
