/* params.c — the flat parameter layout of the Transformer and its initialisation.
 *
 * The layout (include/nmt/model.h) is in backward-completion order, so gradient buckets fill
 * front to back while backward runs:
 *   decoder.ln_f (pre-LN only), decoder.layers.{L-1..0}, encoder.ln_f (pre-LN only),
 *   encoder.layers.{L-1..0}, embed.weight.
 * Inside a layer, tensors are in forward order. tools/make-fixture.py mirrors this table and
 * test/test_model.c checks that the two agree tensor by tensor. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "nmt/config.h"
#include "nmt/model.h"
#include "nmt/rng.h"

enum { KIND_MATRIX, KIND_BIAS, KIND_LN_GAIN, KIND_LN_BIAS, KIND_EMBED };

typedef struct table_state table_state;
struct table_state {
  nmt_param_info *out; /* may be NULL */
  /* Called for every tensor in layout order (may be NULL). */
  void (*visit)(table_state *s, const nmt_param_info *p, int kind);
  int n;
  size_t offset;
  /* visitor state for nmt_model_init_params */
  uint64_t seed;
  float *params;
  int d_model;
};

static void push(table_state *s, int kind, int d0, int d1, const char *fmt, int layer,
                 const char *leaf) {
  nmt_param_info p;
  char prefix[64];
  snprintf(prefix, sizeof prefix, fmt, layer);
  /* Names are at most "decoder.layers.65535." + "cross_attn.out.weight": well inside 80. */
  if (snprintf(p.name, sizeof p.name, "%s%s", prefix, leaf) >= (int)sizeof p.name) p.name[0] = 0;
  p.offset = s->offset;
  p.numel = (size_t)d0 * (size_t)(d1 > 0 ? d1 : 1);
  p.ndim = d1 > 0 ? 2 : 1;
  p.shape[0] = d0;
  p.shape[1] = d1 > 0 ? d1 : 0;
  if (s->out) s->out[s->n] = p;
  if (s->visit) s->visit(s, &p, kind);
  s->n++;
  s->offset += p.numel;
}

static void push_linear(table_state *s, int out_f, int in_f, const char *fmt, int layer,
                        const char *what) {
  char leaf[64];
  snprintf(leaf, sizeof leaf, "%s.weight", what);
  push(s, KIND_MATRIX, out_f, in_f, fmt, layer, leaf);
  snprintf(leaf, sizeof leaf, "%s.bias", what);
  push(s, KIND_BIAS, out_f, 0, fmt, layer, leaf);
}

static void push_ln(table_state *s, int C, const char *fmt, int layer, const char *what) {
  char leaf[64];
  snprintf(leaf, sizeof leaf, "%s.weight", what);
  push(s, KIND_LN_GAIN, C, 0, fmt, layer, leaf);
  snprintf(leaf, sizeof leaf, "%s.bias", what);
  push(s, KIND_LN_BIAS, C, 0, fmt, layer, leaf);
}

static void build_table(const nmt_model_cfg *cfg, table_state *s) {
  const int C = cfg->d_model, F = cfg->d_ff;
  if (cfg->norm == NMT_NORM_PRE) push_ln(s, C, "decoder.", 0, "ln_f");
  for (int l = cfg->dec_layers - 1; l >= 0; l--) {
    const char *f = "decoder.layers.%d.";
    push_linear(s, 3 * C, C, f, l, "self_attn.qkv");
    push_linear(s, C, C, f, l, "self_attn.out");
    push_ln(s, C, f, l, "ln1");
    push_linear(s, C, C, f, l, "cross_attn.q");
    push_linear(s, 2 * C, C, f, l, "cross_attn.kv");
    push_linear(s, C, C, f, l, "cross_attn.out");
    push_ln(s, C, f, l, "ln2");
    push_linear(s, F, C, f, l, "ffn.fc1");
    push_linear(s, C, F, f, l, "ffn.fc2");
    push_ln(s, C, f, l, "ln3");
  }
  if (cfg->norm == NMT_NORM_PRE) push_ln(s, C, "encoder.", 0, "ln_f");
  for (int l = cfg->enc_layers - 1; l >= 0; l--) {
    const char *f = "encoder.layers.%d.";
    push_linear(s, 3 * C, C, f, l, "self_attn.qkv");
    push_linear(s, C, C, f, l, "self_attn.out");
    push_ln(s, C, f, l, "ln1");
    push_linear(s, F, C, f, l, "ffn.fc1");
    push_linear(s, C, F, f, l, "ffn.fc2");
    push_ln(s, C, f, l, "ln2");
  }
  push(s, KIND_EMBED, cfg->vocab, C, "embed.", 0, "weight");
}

void nmt_model_cfg_from_config(const nmt_config *c, nmt_model_cfg *out) {
  memset(out, 0, sizeof *out);
  out->vocab = c->model_vocab;
  out->d_model = c->model_d_model;
  out->n_heads = c->model_n_heads;
  out->d_ff = c->model_d_ff;
  out->enc_layers = c->model_enc_layers;
  out->dec_layers = c->model_dec_layers;
  out->max_positions = c->model_max_positions;
  out->dropout = c->model_dropout;
  out->attn_dropout = c->model_attn_dropout;
  out->relu_dropout = c->model_relu_dropout;
  out->label_smoothing = c->train_label_smoothing;
  out->norm = c->model_norm;
  out->ln_eps = 1e-5f;
  out->checkpoint_activations = c->train_checkpoint_activations ? 1 : 0;
  out->qkv_streams = c->parallel_qkv == NMT_QKV_STREAMS;
  out->fused_attention = c->kernels_attention == NMT_ATTN_FUSED;
}

int nmt_model_half_storage(const nmt_config *c) {
  return (c->precision_mode == NMT_PRECISION_FP16 || c->precision_mode == NMT_PRECISION_BF16) &&
         c->precision_activations == NMT_ACT_HALF;
}

size_t nmt_model_num_params(const nmt_model_cfg *cfg) {
  table_state s = {0};
  build_table(cfg, &s);
  return s.offset;
}

int nmt_model_param_table(const nmt_model_cfg *cfg, nmt_param_info *out) {
  table_state s = {0};
  s.out = out;
  build_table(cfg, &s);
  return s.n;
}

/* Streams for init live in the upper half of the 64-bit stream space; dropout streams are
 * nmt_rng_stream(step, site) with step < 2^39, so the two never share a stream. */
#define INIT_STREAM_BASE (1ull << 63)

static void init_tensor(table_state *s, const nmt_param_info *p, int kind) {
  float *w = s->params + p->offset;
  uint64_t stream = INIT_STREAM_BASE | (uint64_t)s->n;
  switch (kind) {
    case KIND_MATRIX: {
      /* Xavier-uniform (Glorot & Bengio 2010) over the stored (out, in) matrix, as
       * torch.nn.init.xavier_uniform_ does; for the fused qkv this equals torch's
       * MultiheadAttention in_proj init. */
      double a = sqrt(6.0 / (double)(p->shape[0] + p->shape[1]));
      for (size_t i = 0; i < p->numel; i++)
        w[i] = (float)(a * (2.0 * (double)nmt_rng_uniform(s->seed, stream, i) - 1.0));
      break;
    }
    case KIND_EMBED: {
      /* N(0, d_model^-0.5) for the tied embedding (fairseq), PAD row zero. */
      double sd = 1.0 / sqrt((double)s->d_model);
      for (size_t i = 0; i < p->numel; i++)
        w[i] = (float)(sd * (double)nmt_rng_normal(s->seed, stream, i));
      memset(w + (size_t)NMT_PAD_ID * (size_t)p->shape[1], 0, (size_t)p->shape[1] * sizeof *w);
      break;
    }
    case KIND_LN_GAIN:
      for (size_t i = 0; i < p->numel; i++) w[i] = 1.0f;
      break;
    default: /* biases and LayerNorm shifts */
      memset(w, 0, p->numel * sizeof *w);
      break;
  }
}

void nmt_model_init_params(const nmt_model_cfg *cfg, uint64_t seed, float *host_params) {
  table_state s = {0};
  s.visit = init_tensor;
  s.seed = seed;
  s.params = host_params;
  s.d_model = cfg->d_model;
  build_table(cfg, &s);
}
