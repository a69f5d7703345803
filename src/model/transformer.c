/* transformer.c — the Transformer (Vaswani et al. 2017 §3) as an object: nmt_model_create
 * binds the sublayers to their parameter offsets (the layout is params.c's), assigns dropout
 * sites and profiler names, lays out the activation arena, uploads the sinusoids and reserves
 * the backend's op scratch for its shapes (nmt_model_scratch_plan, cost.c); nmt_model_destroy
 * frees it. The model's rooms (model_impl.h has the struct they share):
 *   forward.c      forward pass, loss, eval logits      backward.c  backward, ready prefixes
 *   qkv_streams.c  Q/K/V on three streams               profile.c   profiler ranges and costs
 *   decode.c       incremental decoding, greedy, beam   cost.c      model FLOPs, memory bound
 *
 * Every layer is a list of sublayers (encoder: self-attention, FFN; decoder: causal
 * self-attention, cross-attention, FFN), each wrapped as post-LN LN(x + Dropout(S(x))) or
 * pre-LN x + Dropout(S(LN(x))) (forward.c), so one forward and one backward routine handle
 * both variants and all three sublayer kinds.
 *
 * Activation memory (floats), allocated once at create for N = max_tokens rows per side,
 * L = min(max_len, max_tokens) keys, C = d_model, F = d_ff, H = n_heads, V = vocab:
 *   every sublayer      2*N*C + 2*N        (post: LN input r and output; pre: LN output and
 *                                           output; LN mean and rstd)
 *   attention sublayer  3*N*C + N*C + N*H*L (projections: self fused qkv (N, 3C), or q, k, v
 *                                           (N, C) each with qkv_streams; cross q (N, C) and
 *                                           kv (N, 2C); head outputs; softmax probs)
 *   FFN sublayer        N*F                (hidden after ReLU and dropout)
 *   pre-LN final LNs    2*(N*C + 2*N)
 *   embeddings          2*N*C;  sinusoid table max_positions*C;  logits N*V;  losses, nll 2*N
 *   backward scratch    8*N*C + N*H*L + 2*N*F  (3 gradient streams, dropout grad, head-output
 *                                           grad, q/k/v grad (3C), probs grad, 2 FFN grads)
 * i.e. per layer and row about 8C+F+4+H*L floats (encoder) and 14C+F+6+2*H*L (decoder).
 * The logits dominate for large vocabularies. Fused attention (cfg.fused_attention,
 * nmt/attention.h) keeps each query row's log-sum-exp, N*H floats, in place of the softmax
 * probs, and its backward's row sums D, N*H, in place of the probs grad: every H*L above
 * becomes H (cost.c's bound follows).
 *
 * Activation checkpointing (cfg.checkpoint_activations; Chen et al. 2016, "Training Deep Nets
 * with Sublinear Memory Cost" §4). Backward needs every sublayer's activations, but only one
 * layer's at a time. So the sublayer sets above exist ONCE, as a workspace per sublayer kind
 * (self-attention; cross-attention when there is a decoder; FFN without its output), and each
 * layer keeps only its output N*C (the next layer's input; the last one is the stack's
 * output, which the final LN, the cross-attentions and the generator read). Per layer and row
 * that is C floats instead of the figures above, plus one workspace of 13C+F+6+2*H*L per row
 * (7C+F+4+H*L without a decoder) for the whole model. The training forward runs as usual,
 * each layer overwriting the workspace; backward, before the backward of layer l, re-runs
 * layer l's forward from its kept input (same ops, same buffers, same dropout masks: the RNG
 * is counter based), which rebuilds exactly the activations the forward had. So the loss,
 * every gradient and the ready-prefix calls are bitwise those without checkpointing, for one
 * more forward of the layers per step. The re-run pushes the layer's forward profiler ranges
 * (it is forward work) and stays inside the layer's backward stage, so bucket all-reduces
 * overlap it as they overlap the rest of backward. Eval passes use the same workspace; what
 * decode.c reads (enc_out, the parameter offsets) is kept either way.
 *
 * Q/K/V on streams (cfg.qkv_streams): the self-attention projection buffer holds q, k, v as
 * three (N, C) blocks instead of one (N, 3C) qkv; the same floats (qkv_streams.c).
 *
 * Dropout sites: site = stack << 20 | layer << 4 | place, stack 0 = embeddings (place 0
 * source, 1 target), 1 = encoder, 2 = decoder; place = 4*sublayer + {0 attention weights,
 * 1 sublayer output, 2 FFN hidden}. Masks are never stored: backward regenerates them from
 * (seed, step, site), except the FFN's, which is implicit in the saved hidden activation.
 * tools/make-fixture.py mirrors these ids. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/config.h"
#include "nmt/model.h"
#include "model_impl.h"

/* ------------------------------------------------------------------------------------------ */
/* layout lookups */

static nmt_status find_param(const nmt_param_info *tab, int n, size_t *out, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static nmt_status find_param(const nmt_param_info *tab, int n, size_t *out, const char *fmt, ...) {
  char name[96];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(name, sizeof name, fmt, ap);
  va_end(ap);
  for (int i = 0; i < n; i++)
    if (!strcmp(tab[i].name, name)) {
      *out = tab[i].offset;
      return NMT_OK;
    }
  return nmt_errorf(NMT_ERR_INTERNAL, "model: parameter '%s' missing from the layout", name);
}

/* Backward finishes parameters in stages: 0 decoder.ln_f, 1 + (Ld-1-l) decoder layer l,
 * Ld+1 encoder.ln_f, Ld+2 + (Le-1-l) encoder layer l, Ld+Le+2 the embedding. */
static int stage_of(const nmt_model_cfg *cfg, const char *name) {
  int l;
  if (!strncmp(name, "decoder.ln_f", 12)) return 0;
  if (sscanf(name, "decoder.layers.%d.", &l) == 1) return 1 + (cfg->dec_layers - 1 - l);
  if (!strncmp(name, "encoder.ln_f", 12)) return cfg->dec_layers + 1;
  if (sscanf(name, "encoder.layers.%d.", &l) == 1)
    return cfg->dec_layers + 2 + (cfg->enc_layers - 1 - l);
  return cfg->dec_layers + cfg->enc_layers + 2;
}

int nmt_model_grad_stages(const nmt_model_cfg *cfg, size_t *bounds) {
  const int n_tab = nmt_model_param_table(cfg, NULL);
  const int n_st = cfg->enc_layers + cfg->dec_layers + 3;
  nmt_param_info *tab = malloc((size_t)n_tab * sizeof *tab);
  size_t *first = malloc((size_t)n_st * sizeof *first);
  int count = 0;
  if (tab && first) {
    /* The layout is in stage order, so the nonempty stages' first offsets cut it in turn. */
    nmt_model_param_table(cfg, tab);
    for (int s = 0; s < n_st; s++) first[s] = SIZE_MAX;
    for (int i = 0; i < n_tab; i++) {
      const int s = stage_of(cfg, tab[i].name);
      if (tab[i].offset < first[s]) first[s] = tab[i].offset;
    }
    for (int s = 0; s < n_st; s++)
      if (first[s] != SIZE_MAX) {
        if (bounds) bounds[count] = first[s];
        count++;
      }
    if (bounds) bounds[count] = nmt_model_num_params(cfg);
  }
  free(tab);
  free(first);
  return count;
}

static nmt_status sub_params(sublayer *s, const nmt_param_info *tab, int n, const char *stack,
                             int layer, int idx) {
  const char *p = stack;
  if (s->kind == SUB_SELF) {
    NMT_TRY(find_param(tab, n, &s->w1, "%s.layers.%d.self_attn.qkv.weight", p, layer));
    NMT_TRY(find_param(tab, n, &s->b1, "%s.layers.%d.self_attn.qkv.bias", p, layer));
    NMT_TRY(find_param(tab, n, &s->w2, "%s.layers.%d.self_attn.out.weight", p, layer));
    NMT_TRY(find_param(tab, n, &s->b2, "%s.layers.%d.self_attn.out.bias", p, layer));
  } else if (s->kind == SUB_CROSS) {
    NMT_TRY(find_param(tab, n, &s->wq, "%s.layers.%d.cross_attn.q.weight", p, layer));
    NMT_TRY(find_param(tab, n, &s->bq, "%s.layers.%d.cross_attn.q.bias", p, layer));
    NMT_TRY(find_param(tab, n, &s->w1, "%s.layers.%d.cross_attn.kv.weight", p, layer));
    NMT_TRY(find_param(tab, n, &s->b1, "%s.layers.%d.cross_attn.kv.bias", p, layer));
    NMT_TRY(find_param(tab, n, &s->w2, "%s.layers.%d.cross_attn.out.weight", p, layer));
    NMT_TRY(find_param(tab, n, &s->b2, "%s.layers.%d.cross_attn.out.bias", p, layer));
  } else {
    NMT_TRY(find_param(tab, n, &s->w1, "%s.layers.%d.ffn.fc1.weight", p, layer));
    NMT_TRY(find_param(tab, n, &s->b1, "%s.layers.%d.ffn.fc1.bias", p, layer));
    NMT_TRY(find_param(tab, n, &s->w2, "%s.layers.%d.ffn.fc2.weight", p, layer));
    NMT_TRY(find_param(tab, n, &s->b2, "%s.layers.%d.ffn.fc2.bias", p, layer));
  }
  NMT_TRY(find_param(tab, n, &s->ln_w, "%s.layers.%d.ln%d.weight", p, layer, idx + 1));
  NMT_TRY(find_param(tab, n, &s->ln_b, "%s.layers.%d.ln%d.bias", p, layer, idx + 1));
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* activation layout in the arena (arena.c), in the order of the table at the top */

/* What an attention sublayer keeps of its softmax for backward: the probs (B, H, Tq, Tk), or
 * with fused attention the rows' log-sum-exp (B, H, Tq) alone (B*Tq <= N). */
static void carve_softmax(const nmt_model *m, nmt__arena *a, sublayer *s) {
  const size_t NH = (size_t)m->max_tokens * (size_t)m->cfg.n_heads;
  if (m->cfg.fused_attention) s->lse = nmt__arena_floats(a, NH);
  else s->probs = nmt__arena_floats(a, NH * (size_t)m->max_keys);
}

/* The backward's softmax scratch, in the place of the layout where the probs grad goes:
 * d probs (B, H, Tq, Tk), or with fused attention the row sums D (B, H, Tq). */
static void carve_softmax_grad(nmt_model *m, nmt__arena *a) {
  const size_t NH = (size_t)m->max_tokens * (size_t)m->cfg.n_heads;
  if (m->cfg.fused_attention) m->d_row = nmt__arena_floats(a, NH);
  else m->d_probs = nmt__arena_floats(a, NH * (size_t)m->max_keys);
}

/* One sublayer's saved activations on the half-storage path (the table at the top, in
 * bytes): fp32 what stays fp32 (post-LN: the LN input and the output, the residual stream;
 * pre-LN: the output), the rest in half; `out` (and post-LN its half copy) only when
 * with_out. */
static void carve_acts_half(const nmt_model *m, nmt__arena *a, sublayer *s, int with_out) {
  const size_t N = (size_t)m->max_tokens, C = (size_t)m->cfg.d_model, F = (size_t)m->cfg.d_ff;
  const int post = m->cfg.norm == NMT_NORM_POST;
  if (post) s->aux = nmt__arena_floats(a, N * C);
  else s->aux_h = nmt__arena_acts(a, N * C);
  s->out = with_out ? nmt__arena_floats(a, N * C) : NULL;
  s->out_h = with_out && post ? nmt__arena_acts(a, N * C) : NULL;
  s->mean = nmt__arena_floats(a, N);
  s->rstd = nmt__arena_floats(a, N);
  if (s->kind == SUB_FFN) {
    s->h_h = nmt__arena_acts(a, N * F);
    s->relu_mask = nmt__arena_carve(a, nmt_relu_mask_bytes((int)N, (int)F));
  } else {
    s->proj_h = nmt__arena_acts(a, (s->kind == SUB_SELF ? 3 : 1) * N * C);
    carve_softmax(m, a, s);
    s->att_h = nmt__arena_acts(a, N * C);
  }
}

/* One sublayer's saved activations; `out` only when with_out. */
static void carve_acts(const nmt_model *m, nmt__arena *a, sublayer *s, int with_out) {
  if (m->cfg.act_half) {
    carve_acts_half(m, a, s, with_out);
    return;
  }
  const size_t N = (size_t)m->max_tokens, C = (size_t)m->cfg.d_model, F = (size_t)m->cfg.d_ff;
  s->aux = nmt__arena_floats(a, N * C);
  s->out = with_out ? nmt__arena_floats(a, N * C) : NULL;
  s->mean = nmt__arena_floats(a, N);
  s->rstd = nmt__arena_floats(a, N);
  if (s->kind == SUB_FFN) {
    s->h = nmt__arena_floats(a, N * F);
  } else {
    s->proj = nmt__arena_floats(a, 3 * N * C);
    carve_softmax(m, a, s);
    s->att = nmt__arena_floats(a, N * C);
  }
}

/* Everything outside the layers on the half-storage path: the final LNs' half outputs and
 * statistics (pre-LN), the embeddings (post-LN with their half copies), every decoder layer's
 * cross K/V, the half logits, and the backward's buffers (fp32 residual gradients, half
 * activation gradients). */
static void carve_half_rest(nmt_model *m, nmt__arena *a) {
  const size_t N = (size_t)m->max_tokens, C = (size_t)m->cfg.d_model, F = (size_t)m->cfg.d_ff;
  const size_t V = (size_t)m->cfg.vocab;
  const int post = m->cfg.norm == NMT_NORM_POST;
  if (!post) {
    final_ln *f[2] = {&m->enc_ln, &m->dec_ln};
    for (int i = 0; i < 2; i++) {
      f[i]->out_h = nmt__arena_acts(a, N * C);
      f[i]->mean = nmt__arena_floats(a, N);
      f[i]->rstd = nmt__arena_floats(a, N);
    }
  }
  if (post) {
    m->emb_src_h = nmt__arena_acts(a, N * C);
    m->emb_tgt_h = nmt__arena_acts(a, N * C);
  }
  m->kv_h = nmt__arena_acts(a, (size_t)m->cfg.dec_layers * N * 2 * C);
  m->logits_h = nmt__arena_acts(a, N * V);
  m->losses = nmt__arena_floats(a, N);
  m->nll = nmt__arena_floats(a, N);
  for (int i = 0; i < 3; i++) m->g[i] = nmt__arena_floats(a, N * C);
  m->d_drop = nmt__arena_floats(a, N * C);
  carve_softmax_grad(m, a);
  m->dy_h = nmt__arena_acts(a, N * C);
  m->datt_h = nmt__arena_acts(a, N * C);
  m->dproj_h = nmt__arena_acts(a, 3 * N * C);
  m->dh_h = nmt__arena_acts(a, N * F);
  if (!post) m->g_h = nmt__arena_acts(a, N * C);
}

static void carve_all(void *obj, nmt__arena *a) {
  nmt_model *m = obj;
  const size_t N = (size_t)m->max_tokens, C = (size_t)m->cfg.d_model, F = (size_t)m->cfg.d_ff;
  const size_t V = (size_t)m->cfg.vocab;
  m->pe = nmt__arena_floats(a, (size_t)m->cfg.max_positions * C);
  m->emb_src = nmt__arena_floats(a, N * C);
  m->emb_tgt = nmt__arena_floats(a, N * C);
  int n_enc = 2 * m->cfg.enc_layers, n_dec = 3 * m->cfg.dec_layers;
  if (!m->cfg.checkpoint_activations) {
    for (int i = 0; i < n_enc + n_dec; i++)
      carve_acts(m, a, i < n_enc ? &m->enc[i] : &m->dec[i - n_enc], 1);
  } else {
    /* The workspace, indexed by kind; an FFN's output is the layer's and kept per layer. */
    sublayer ws[3] = {{.kind = SUB_SELF}, {.kind = SUB_CROSS}, {.kind = SUB_FFN}};
    for (int k = 0; k < 3; k++)
      if (k != SUB_CROSS || n_dec > 0) carve_acts(m, a, &ws[k], k != SUB_FFN);
    for (int i = 0; i < n_enc + n_dec; i++) {
      sublayer *s = i < n_enc ? &m->enc[i] : &m->dec[i - n_enc];
      const sublayer *w = &ws[s->kind];
      s->aux = w->aux;
      s->mean = w->mean;
      s->rstd = w->rstd;
      s->proj = w->proj;
      s->probs = w->probs;
      s->lse = w->lse;
      s->att = w->att;
      s->h = w->h;
      s->out = s->kind == SUB_FFN ? nmt__arena_floats(a, N * C) : w->out;
      s->aux_h = w->aux_h;
      s->proj_h = w->proj_h;
      s->att_h = w->att_h;
      s->h_h = w->h_h;
      s->relu_mask = w->relu_mask;
      /* post-LN half storage: the layer output's half copy is the next layer's input too */
      if (s->kind != SUB_FFN) s->out_h = w->out_h;
      else if (m->cfg.act_half && m->cfg.norm == NMT_NORM_POST) s->out_h = nmt__arena_acts(a, N * C);
    }
  }
  if (m->cfg.act_half) {
    carve_half_rest(m, a);
    return;
  }
  if (m->cfg.norm == NMT_NORM_PRE) {
    final_ln *f[2] = {&m->enc_ln, &m->dec_ln};
    for (int i = 0; i < 2; i++) {
      f[i]->out = nmt__arena_floats(a, N * C);
      f[i]->mean = nmt__arena_floats(a, N);
      f[i]->rstd = nmt__arena_floats(a, N);
    }
  }
  m->logits = nmt__arena_floats(a, N * V);
  m->losses = nmt__arena_floats(a, N);
  m->nll = nmt__arena_floats(a, N);
  for (int i = 0; i < 3; i++) m->g[i] = nmt__arena_floats(a, N * C);
  m->d_drop = nmt__arena_floats(a, N * C);
  m->d_att = nmt__arena_floats(a, N * C);
  m->d_proj = nmt__arena_floats(a, 3 * N * C);
  carve_softmax_grad(m, a);
  m->f1 = nmt__arena_floats(a, N * F);
  m->f2 = nmt__arena_floats(a, N * F);
}

/* ------------------------------------------------------------------------------------------ */
/* create */

/* NMT_ERR_CONFIG unless the shapes are ones the model can be built for. */
static nmt_status check_shapes(const nmt_model_cfg *cfg, int max_tokens, int max_len) {
  /* Layer indices take 16 bits of the dropout site id. */
  if (cfg->vocab <= NMT_EOS_ID || cfg->d_model <= 0 || cfg->n_heads <= 0 || cfg->d_ff <= 0 ||
      cfg->enc_layers < 0 || cfg->dec_layers < 0 || cfg->max_positions <= 0 ||
      cfg->enc_layers > 65535 || cfg->dec_layers > 65535)
    return nmt_errorf(NMT_ERR_CONFIG,
                      "model: bad shape vocab=%d d_model=%d n_heads=%d d_ff=%d layers=%d+%d "
                      "max_positions=%d",
                      cfg->vocab, cfg->d_model, cfg->n_heads, cfg->d_ff, cfg->enc_layers,
                      cfg->dec_layers, cfg->max_positions);
  if (cfg->d_model % cfg->n_heads)
    return nmt_errorf(NMT_ERR_CONFIG, "model: d_model %d is not a multiple of n_heads %d",
                      cfg->d_model, cfg->n_heads);
  if (max_len < 1 || max_tokens < 1)
    return nmt_errorf(NMT_ERR_CONFIG, "model: max_len %d and max_tokens %d must be >= 1", max_len,
                      max_tokens);
  if (max_len > cfg->max_positions)
    return nmt_errorf(NMT_ERR_CONFIG, "model: max_len %d > model.max_positions %d", max_len,
                      cfg->max_positions);
  if (!(cfg->dropout >= 0 && cfg->dropout < 1 && cfg->attn_dropout >= 0 && cfg->attn_dropout < 1 &&
        cfg->relu_dropout >= 0 && cfg->relu_dropout < 1 && cfg->label_smoothing >= 0 &&
        cfg->label_smoothing < 1))
    return nmt_errorf(NMT_ERR_CONFIG, "model: dropout and label smoothing must be in [0, 1)");
  return NMT_OK;
}

/* Builds the sublayer lists (kind, dropout site, range name, parameter offsets), the final
 * LayerNorms' and the embedding's offsets, and the ready prefix after each backward stage,
 * from the parameter table. Errors: NMT_ERR_NOMEM, NMT_ERR_INTERNAL (a tensor missing). */
static nmt_status bind_params(nmt_model *m) {
  const nmt_model_cfg *cfg = &m->cfg;
  nmt_status st = NMT_OK;
  int n_tab = nmt_model_param_table(cfg, NULL);
  int n_enc = 2 * cfg->enc_layers, n_dec = 3 * cfg->dec_layers;
  m->n_stages = cfg->enc_layers + cfg->dec_layers + 3;
  nmt_param_info *tab = malloc((size_t)n_tab * sizeof *tab);
  m->enc = calloc((size_t)n_enc + 1, sizeof *m->enc);
  m->dec = calloc((size_t)n_dec + 1, sizeof *m->dec);
  m->ready_after = calloc((size_t)m->n_stages, sizeof *m->ready_after);
  if (!tab || !m->enc || !m->dec || !m->ready_after) {
    st = nmt_errorf(NMT_ERR_NOMEM, "model: out of host memory");
    goto out;
  }
  nmt_model_param_table(cfg, tab);

  /* Ready prefix after stage s: the lowest offset of any tensor finished in a later stage. */
  for (int s = 0; s < m->n_stages; s++) m->ready_after[s] = m->n_params;
  for (int i = 0; i < n_tab; i++) {
    int stage = stage_of(cfg, tab[i].name);
    for (int s = 0; s < stage; s++)
      if (tab[i].offset < m->ready_after[s]) m->ready_after[s] = tab[i].offset;
  }

  for (int l = 0; l < cfg->enc_layers; l++)
    for (int k = 0; k < 2; k++) {
      sublayer *s = &m->enc[2 * l + k];
      s->kind = k == 0 ? SUB_SELF : SUB_FFN;
      s->site = (uint32_t)STACK_ENC << 20 | (uint32_t)l << 4 | (uint32_t)(4 * k);
      snprintf(s->prof_name, sizeof s->prof_name, "encoder.%d.%s", l,
               k == 0 ? "self_attn" : "ffn");
      NMT_TRY_GOTO(st, sub_params(s, tab, n_tab, "encoder", l, k), out);
    }
  for (int l = 0; l < cfg->dec_layers; l++)
    for (int k = 0; k < 3; k++) {
      sublayer *s = &m->dec[3 * l + k];
      s->kind = k == 0 ? SUB_SELF : k == 1 ? SUB_CROSS : SUB_FFN;
      s->causal = k == 0;
      s->site = (uint32_t)STACK_DEC << 20 | (uint32_t)l << 4 | (uint32_t)(4 * k);
      snprintf(s->prof_name, sizeof s->prof_name, "decoder.%d.%s", l,
               k == 0 ? "self_attn" : k == 1 ? "cross_attn" : "ffn");
      NMT_TRY_GOTO(st, sub_params(s, tab, n_tab, "decoder", l, k), out);
    }
  if (cfg->norm == NMT_NORM_PRE) {
    NMT_TRY_GOTO(st, find_param(tab, n_tab, &m->enc_ln.w, "encoder.ln_f.weight"), out);
    NMT_TRY_GOTO(st, find_param(tab, n_tab, &m->enc_ln.b, "encoder.ln_f.bias"), out);
    NMT_TRY_GOTO(st, find_param(tab, n_tab, &m->dec_ln.w, "decoder.ln_f.weight"), out);
    NMT_TRY_GOTO(st, find_param(tab, n_tab, &m->dec_ln.b, "decoder.ln_f.bias"), out);
  }
  NMT_TRY_GOTO(st, find_param(tab, n_tab, &m->embed_off, "embed.weight"), out);
  /* The decoder layers' cross K/V weights and biases one stride apart (the layout repeats
   * layer by layer, L-1 first), so that the half-storage path projects the encoder output
   * for every layer with one batched GEMM. */
  m->kv_stride = 0;
  if (cfg->dec_layers >= 2) {
    const sublayer *last = &m->dec[3 * (cfg->dec_layers - 1) + 1];
    const size_t stride = m->dec[3 * (cfg->dec_layers - 2) + 1].w1 - last->w1;
    int uniform = m->dec[3 * (cfg->dec_layers - 2) + 1].w1 > last->w1;
    for (int l = 0; l < cfg->dec_layers && uniform; l++) {
      const sublayer *c = &m->dec[3 * l + 1];
      const size_t k = (size_t)(cfg->dec_layers - 1 - l);
      uniform = c->w1 == last->w1 + k * stride && c->b1 == last->b1 + k * stride;
    }
    if (uniform) m->kv_stride = stride;
  }
out:
  free(tab);
  return st;
}

/* Sinusoids (§3.5) into m->pe: PE(pos, 2i) = sin(pos / 10000^(2i/C)), PE(pos, 2i+1) =
 * cos(same), computed in double on the host. Errors: NMT_ERR_NOMEM, the backend's. */
static nmt_status upload_sinusoids(nmt_model *m) {
  const nmt_model_cfg *cfg = &m->cfg;
  const int C = cfg->d_model;
  size_t n = (size_t)cfg->max_positions * (size_t)C;
  float *pe_f = malloc(n * sizeof *pe_f);
  if (!pe_f) return nmt_errorf(NMT_ERR_NOMEM, "model: out of host memory");
  for (int pos = 0; pos < cfg->max_positions; pos++)
    for (int c = 0; c < C; c++) {
      double freq = pow(10000.0, -(double)(c & ~1) / (double)C);
      double ang = (double)pos * freq;
      pe_f[(size_t)pos * C + c] = (float)((c & 1) ? cos(ang) : sin(ang));
    }
  nmt_status st;
  NMT_TRY_GOTO(st, m->be->copy_h2d(m->ctx, m->pe, pe_f, n * sizeof *pe_f), out);
  NMT_TRY_GOTO(st, m->be->synchronize(m->ctx), out);
out:
  free(pe_f);
  return st;
}

nmt_status nmt_model_create(const nmt_model_cfg *cfg, const nmt_backend *be, void *ctx,
                            int max_tokens, int max_len, nmt_model **out) {
  *out = NULL;
  NMT_TRY(check_shapes(cfg, max_tokens, max_len));
  if (cfg->fused_attention && (!be->attention_fused_fwd || !be->attention_fused_bwd))
    return nmt_errorf(NMT_ERR_USAGE, "model: fused attention (kernels.attention = fused) asked "
                      "for, but the %s backend has no attention_fused_fwd/bwd", be->name);
  nmt_model *m = calloc(1, sizeof *m);
  if (!m) return nmt_errorf(NMT_ERR_NOMEM, "model: out of host memory");
  m->cfg = *cfg;
  m->loss_scale = 1.0f;
  m->be = be;
  m->ctx = ctx;
  m->max_tokens = max_tokens;
  m->max_len = max_len;
  m->max_keys = max_len < max_tokens ? max_len : max_tokens;
  m->n_params = nmt_model_num_params(cfg);
  nmt_status st;
  NMT_TRY_GOTO(st, bind_params(m), fail);
  NMT_TRY_GOTO(st, nmt__arena_alloc(be, ctx, carve_all, m, &m->arena, &m->arena_bytes), fail);
  NMT_TRY_GOTO(st, upload_sinusoids(m), fail);
  if (be->reserve_scratch) {
    /* Every scratch buffer of the ops sized now: a step never allocates (nmt/backend.h). */
    nmt_scratch_plan plan;
    nmt_model_scratch_plan(cfg, max_tokens, max_len, &plan);
    NMT_TRY_GOTO(st, be->reserve_scratch(ctx, &plan), fail);
  }
  *out = m;
  return NMT_OK;

fail:
  nmt_model_destroy(m);
  return st;
}

void nmt_model_set_loss_scale(nmt_model *m, float scale) { m->loss_scale = scale; }
void nmt_model_set_loss_scale_dev(nmt_model *m, const float *scale) { m->loss_scale_dev = scale; }

size_t nmt_model_activation_bytes(const nmt_model *m) { return m->arena_bytes; }

size_t nmt_model_arena_bytes(const nmt_model_cfg *cfg, int max_tokens, int max_len) {
  /* The measuring pass of nmt_model_create on a model that only has its shapes and kinds. */
  nmt_model m = {.cfg = *cfg, .max_tokens = max_tokens, .max_len = max_len};
  m.max_keys = max_len < max_tokens ? max_len : max_tokens;
  int n_enc = 2 * cfg->enc_layers, n_dec = 3 * cfg->dec_layers;
  m.enc = calloc((size_t)n_enc + 1, sizeof *m.enc);
  m.dec = calloc((size_t)n_dec + 1, sizeof *m.dec);
  size_t bytes = 0;
  if (m.enc && m.dec) {
    for (int i = 0; i < n_enc; i++) m.enc[i].kind = i % 2 == 0 ? SUB_SELF : SUB_FFN;
    for (int i = 0; i < n_dec; i++)
      m.dec[i].kind = i % 3 == 0 ? SUB_SELF : i % 3 == 1 ? SUB_CROSS : SUB_FFN;
    bytes = nmt__arena_measure(carve_all, &m);
  }
  free(m.enc);
  free(m.dec);
  return bytes;
}

void nmt_model_destroy(nmt_model *m) {
  if (!m) return;
  if (m->arena) m->be->free(m->ctx, m->arena);
  free(m->enc);
  free(m->dec);
  free(m->ready_after);
  free(m);
}

nmt_status nmt__model_check_shape(const nmt_model *m, int B, int T, const char *side) {
  if (B < 1 || T < 1 || T > m->max_len || (long)B * T > m->max_tokens)
    return nmt_errorf(NMT_ERR_DATA,
                      "model: %s batch %d x %d exceeds the sizes given at create (max_tokens %d, "
                      "max_len %d)",
                      side, B, T, m->max_tokens, m->max_len);
  return NMT_OK;
}
