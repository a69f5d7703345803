/* transformer.c — forward and backward of the Transformer (Vaswani et al. 2017 §3) as a
 * sequence of backend op calls. The parameter layout is in params.c; incremental decoding,
 * greedy and beam search are in decode.c (sharing the struct in model_impl.h).
 *
 * Structure. Every layer is a list of sublayers (encoder: self-attention, FFN; decoder:
 * causal self-attention, cross-attention, FFN), each wrapped as
 *   post-LN (paper §3.1):  out = LN(x + Dropout(S(x)))
 *   pre-LN:                out = x + Dropout(S(LN(x)))      (+ a final LN per stack)
 * so one forward and one backward routine handle both variants and all three sublayer kinds.
 * The residual connection, its dropout and (post-LN) the LayerNorm are one backend op,
 * residual_dropout_ln_fwd / _bwd (one pass over the rows instead of three; nmt/backend.h).
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
 * The logits dominate for large vocabularies.
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
 * Q/K/V on streams (cfg.qkv_streams, parallel.qkv = streams). The fused (3C, C) weight's row
 * blocks W_q, W_k, W_v are three (C, C) GEMMs into separate (rows, C) buffers, forked onto
 * streams 0, 1, 2 of the backend's pool and joined before attention reads them. Backward:
 * attention writes dq, dk, dv into separate buffers; the three weight/bias gradients (disjoint
 * slices of the gradient buffer) go to the three streams, and the three input-gradient GEMMs,
 * which accumulate into one buffer, follow each other on stream 0. A backend without
 * stream_fork runs all of it in turn on its one stream.
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
#include "nmt/rng.h"
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

/* One sublayer's saved activations; `out` only when with_out. */
static void carve_acts(const nmt_model *m, nmt__arena *a, sublayer *s, int with_out) {
  const size_t N = (size_t)m->max_tokens, C = (size_t)m->cfg.d_model, F = (size_t)m->cfg.d_ff;
  const size_t NP = N * (size_t)m->cfg.n_heads * (size_t)m->max_keys;
  s->aux = nmt__arena_floats(a, N * C);
  s->out = with_out ? nmt__arena_floats(a, N * C) : NULL;
  s->mean = nmt__arena_floats(a, N);
  s->rstd = nmt__arena_floats(a, N);
  if (s->kind == SUB_FFN) {
    s->h = nmt__arena_floats(a, N * F);
  } else {
    s->proj = nmt__arena_floats(a, 3 * N * C);
    s->probs = nmt__arena_floats(a, NP);
    s->att = nmt__arena_floats(a, N * C);
  }
}

static void carve_all(void *obj, nmt__arena *a) {
  nmt_model *m = obj;
  const size_t N = (size_t)m->max_tokens, C = (size_t)m->cfg.d_model, F = (size_t)m->cfg.d_ff;
  const size_t H = (size_t)m->cfg.n_heads, L = (size_t)m->max_keys, V = (size_t)m->cfg.vocab;
  const size_t NP = N * H * L;
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
      s->att = w->att;
      s->h = w->h;
      s->out = s->kind == SUB_FFN ? nmt__arena_floats(a, N * C) : w->out;
    }
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
  m->d_probs = nmt__arena_floats(a, NP);
  m->f1 = nmt__arena_floats(a, N * F);
  m->f2 = nmt__arena_floats(a, N * F);
}

/* ------------------------------------------------------------------------------------------ */

nmt_status nmt_model_create(const nmt_model_cfg *cfg, const nmt_backend *be, void *ctx,
                            int max_tokens, int max_len, nmt_model **out) {
  *out = NULL;
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

  nmt_status st = NMT_OK;
  nmt_param_info *tab = NULL;
  float *pe_f = NULL;
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

  int n_tab = nmt_model_param_table(cfg, NULL);
  int n_enc = 2 * cfg->enc_layers, n_dec = 3 * cfg->dec_layers;
  m->n_stages = cfg->enc_layers + cfg->dec_layers + 3;
  tab = malloc((size_t)n_tab * sizeof *tab);
  m->enc = calloc((size_t)n_enc + 1, sizeof *m->enc);
  m->dec = calloc((size_t)n_dec + 1, sizeof *m->dec);
  m->ready_after = calloc((size_t)m->n_stages, sizeof *m->ready_after);
  if (!tab || !m->enc || !m->dec || !m->ready_after) {
    st = nmt_errorf(NMT_ERR_NOMEM, "model: out of host memory");
    goto fail;
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
      NMT_TRY_GOTO(st, sub_params(s, tab, n_tab, "encoder", l, k), fail);
    }
  for (int l = 0; l < cfg->dec_layers; l++)
    for (int k = 0; k < 3; k++) {
      sublayer *s = &m->dec[3 * l + k];
      s->kind = k == 0 ? SUB_SELF : k == 1 ? SUB_CROSS : SUB_FFN;
      s->causal = k == 0;
      s->site = (uint32_t)STACK_DEC << 20 | (uint32_t)l << 4 | (uint32_t)(4 * k);
      snprintf(s->prof_name, sizeof s->prof_name, "decoder.%d.%s", l,
               k == 0 ? "self_attn" : k == 1 ? "cross_attn" : "ffn");
      NMT_TRY_GOTO(st, sub_params(s, tab, n_tab, "decoder", l, k), fail);
    }
  if (cfg->norm == NMT_NORM_PRE) {
    NMT_TRY_GOTO(st, find_param(tab, n_tab, &m->enc_ln.w, "encoder.ln_f.weight"), fail);
    NMT_TRY_GOTO(st, find_param(tab, n_tab, &m->enc_ln.b, "encoder.ln_f.bias"), fail);
    NMT_TRY_GOTO(st, find_param(tab, n_tab, &m->dec_ln.w, "decoder.ln_f.weight"), fail);
    NMT_TRY_GOTO(st, find_param(tab, n_tab, &m->dec_ln.b, "decoder.ln_f.bias"), fail);
  }
  NMT_TRY_GOTO(st, find_param(tab, n_tab, &m->embed_off, "embed.weight"), fail);

  NMT_TRY_GOTO(st, nmt__arena_alloc(be, ctx, carve_all, m, &m->arena, &m->arena_bytes), fail);

  /* Sinusoids (§3.5): PE(pos, 2i) = sin(pos / 10000^(2i/C)), PE(pos, 2i+1) = cos(same). */
  {
    const int C = cfg->d_model;
    size_t n = (size_t)cfg->max_positions * (size_t)C;
    pe_f = malloc(n * sizeof *pe_f);
    if (!pe_f) {
      st = nmt_errorf(NMT_ERR_NOMEM, "model: out of host memory");
      goto fail;
    }
    for (int pos = 0; pos < cfg->max_positions; pos++)
      for (int c = 0; c < C; c++) {
        double freq = pow(10000.0, -(double)(c & ~1) / (double)C);
        double ang = (double)pos * freq;
        pe_f[(size_t)pos * C + c] = (float)((c & 1) ? cos(ang) : sin(ang));
      }
    NMT_TRY_GOTO(st, be->copy_h2d(ctx, m->pe, pe_f, n * sizeof *pe_f), fail);
    NMT_TRY_GOTO(st, be->synchronize(ctx), fail);
  }
  free(pe_f);
  free(tab);
  *out = m;
  return NMT_OK;

fail:
  free(pe_f);
  free(tab);
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

/* ------------------------------------------------------------------------------------------ */
/* profiling ranges (include/nmt/prof.h). Each module's forward and backward is one range whose
 * FLOPs and bytes are the sum of nmt_prof_cost_* over the op calls the module makes; the
 * *_cost functions below mirror the op sequences of the functions they are named after, so a
 * change to one is a change to the other. Ranges wrap whole functions and are popped on the
 * error path too, so the track's nesting survives a failing op. */

static const char *const mprof_names[MPROF_N] = {"encoder.embed",    "decoder.embed",
                                                 "encoder.final_ln", "decoder.final_ln",
                                                 "generator.proj",   "generator.xent"};

nmt_status nmt_model_set_profiler(nmt_model *m, nmt_prof_track *track) {
  m->prof = NULL;
  if (!track) return NMT_OK;
  nmt_prof *p = nmt_prof_track_profiler(track);
  for (int i = 0; i < MPROF_N; i++) NMT_TRY(nmt_prof_intern(p, mprof_names[i], &m->prof_ids[i]));
  for (int i = 0; i < 2 * m->cfg.enc_layers; i++)
    NMT_TRY(nmt_prof_intern(p, m->enc[i].prof_name, &m->enc[i].prof_id));
  for (int i = 0; i < 3 * m->cfg.dec_layers; i++)
    NMT_TRY(nmt_prof_intern(p, m->dec[i].prof_name, &m->dec[i].prof_id));
  m->prof = track;
  return NMT_OK;
}

int nmt_model_module_names(const nmt_model *m, nmt_prof_phase phase, const char **out) {
  const int pre = m->cfg.norm == NMT_NORM_PRE, Le = m->cfg.enc_layers, Ld = m->cfg.dec_layers;
  int n = 0;
#define PUT(s)              \
  do {                      \
    if (out) out[n] = (s);  \
    n++;                    \
  } while (0)
  if (phase == NMT_PROF_FWD) {
    PUT(mprof_names[MPROF_ENC_EMBED]);
    for (int i = 0; i < 2 * Le; i++) PUT(m->enc[i].prof_name);
    if (pre) PUT(mprof_names[MPROF_ENC_LN]);
    PUT(mprof_names[MPROF_DEC_EMBED]);
    for (int i = 0; i < 3 * Ld; i++) PUT(m->dec[i].prof_name);
    if (pre) PUT(mprof_names[MPROF_DEC_LN]);
    PUT(mprof_names[MPROF_PROJ]);
    PUT(mprof_names[MPROF_XENT]);
  } else if (phase == NMT_PROF_BWD) {
    /* With checkpointing each layer's backward starts with the re-run of its forward. */
    const int ck = m->cfg.checkpoint_activations;
    PUT(mprof_names[MPROF_PROJ]);
    if (pre) PUT(mprof_names[MPROF_DEC_LN]);
    for (int l = Ld - 1; l >= 0; l--) {
      for (int k = 0; ck && k < 3; k++) PUT(m->dec[3 * l + k].prof_name);
      for (int k = 2; k >= 0; k--) PUT(m->dec[3 * l + k].prof_name);
    }
    PUT(mprof_names[MPROF_DEC_EMBED]);
    if (pre) PUT(mprof_names[MPROF_ENC_LN]);
    for (int l = Le - 1; l >= 0; l--) {
      for (int k = 0; ck && k < 2; k++) PUT(m->enc[2 * l + k].prof_name);
      for (int k = 1; k >= 0; k--) PUT(m->enc[2 * l + k].prof_name);
    }
    PUT(mprof_names[MPROF_ENC_EMBED]);
  }
#undef PUT
  return n;
}

/* Costs are only worked out on sampled steps; other steps push NVTX names only. */
static int prof_costs(const nmt_model *m) { return nmt_prof_track_sampling(m->prof); }

static void prof_push(nmt_model *m, int id, nmt_prof_phase ph, nmt_prof_cost c) {
  nmt_prof_push(m->prof, id, ph, c.flops, c.bytes);
}

static nmt_prof_cost ew(double n, double reads, double writes, double flops) {
  return nmt_prof_cost_elementwise(n, reads, writes, flops);
}
#define COST_ADD(c, x) ((c) = nmt_prof_cost_add((c), (x)))

void nmt_model_destroy(nmt_model *m) {
  if (!m) return;
  if (m->arena) m->be->free(m->ctx, m->arena);
  free(m->enc);
  free(m->dec);
  free(m->ready_after);
  free(m);
}

/* ------------------------------------------------------------------------------------------ */
/* forward */

/* Shapes of one pass: B sentences; the sublayer's own rows have length T (tokens), the
 * keys of cross-attention come from the source (Ts, src_lens). */
typedef struct {
  int B, T, Ts;
  const int32_t *lens, *src_lens;
  const float *enc_out; /* cross-attention memory (B*Ts, C) */
  int train;
  uint64_t seed, step;
} pass;

static float p_or_zero(const pass *ps, float p) { return ps->train ? p : 0.0f; }

/* Runs fn(m, i, arg) for i = 0, 1, 2 on streams 0, 1, 2 of the backend's pool (in turn when
 * the backend has no stream_fork), then joins. The three calls must not write memory another
 * of them reads or writes (backend.h's stream contract). The join is issued after an error
 * too, so the context is never left forked. */
typedef nmt_status (*stream_fn)(nmt_model *m, int i, void *arg);
static nmt_status on_three_streams(nmt_model *m, stream_fn fn, void *arg) {
  const nmt_backend *be = m->be;
  const int fork = be->stream_fork != NULL;
  if (fork) NMT_TRY(be->stream_fork(m->ctx));
  nmt_status st = NMT_OK;
  for (int i = 0; i < 3 && st == NMT_OK; i++) {
    if (fork) st = be->stream_use(m->ctx, i);
    if (st == NMT_OK) st = fn(m, i, arg);
  }
  if (fork) {
    nmt_status js = be->stream_join(m->ctx);
    if (st == NMT_OK) st = js;
  }
  return st;
}

/* The per-stream Q/K/V work. Block i (0 = q, 1 = k, 2 = v) is rows [iC, (i+1)C) of the fused
 * (3C, C) qkv weight and of its bias (model.h), so its slices are contiguous. */
typedef struct {
  const sublayer *s;
  const float *P, *x;
  float *G;          /* backward: gradient buffer */
  const float *dqkv; /* backward: dq, dk, dv at dqkv + i*max_tokens*C */
  float *dx;         /* backward: input gradient (stream 0 only) */
  int rows;
} qkv_args;

static nmt_status qkv_fwd_one(nmt_model *m, int i, void *arg) {
  const qkv_args *a = arg;
  const int C = m->cfg.d_model;
  const size_t blk = (size_t)i * C;
  return m->be->matmul_fwd(m->ctx, a->s->proj + (size_t)i * m->max_tokens * C, a->x,
                           a->P + a->s->w1 + blk * C, a->P + a->s->b1 + blk, a->rows, C, C);
}

/* q, k, v = x W_i^T + b_i into proj's three (rows, C) blocks (parallel.qkv = streams). */
static nmt_status qkv_streams_fwd(nmt_model *m, const float *P, const sublayer *s, const float *x,
                                  int rows) {
  qkv_args a = {.s = s, .P = P, .x = x, .rows = rows};
  return on_three_streams(m, qkv_fwd_one, &a);
}

/* dW_i, db_i of block i on stream i. Stream 0 then also accumulates the input gradient of all
 * three blocks, in the order q, k, v, into dx: those share one buffer, so they cannot be
 * split across streams, but they overlap the weight gradients of streams 1 and 2 (dx is
 * neither read nor written by those). */
static nmt_status qkv_bwd_one(nmt_model *m, int i, void *arg) {
  const qkv_args *a = arg;
  const nmt_backend *be = m->be;
  const int C = m->cfg.d_model;
  const size_t NC = (size_t)m->max_tokens * C;
  const size_t w = a->s->w1 + (size_t)i * C * C, b = a->s->b1 + (size_t)i * C;
  NMT_TRY(be->matmul_bwd(m->ctx, NULL, a->G + w, a->G + b, a->dqkv + i * NC, a->x, a->P + w,
                         a->rows, C, C));
  if (i != 0) return NMT_OK;
  for (int j = 0; j < 3; j++)
    NMT_TRY(be->matmul_bwd(m->ctx, a->dx, NULL, NULL, a->dqkv + j * NC, a->x,
                           a->P + a->s->w1 + (size_t)j * C * C, a->rows, C, C));
  return NMT_OK;
}

/* S(x) into `o` (rows, C). */
static nmt_status sub_compute(nmt_model *m, const float *P, sublayer *s, const float *x, float *o,
                              const pass *ps) {
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int C = m->cfg.d_model, F = m->cfg.d_ff, H = m->cfg.n_heads, dk = C / H;
  const int rows = ps->B * ps->T;
  if (s->kind == SUB_FFN) {
    /* s->h keeps dropout(relu(.)) only: it is fc2's input, and (h > 0) there is exactly
     * "kept and ReLU-active" (scale > 1 cannot underflow), which is all the backward needs. */
    float pr = p_or_zero(ps, m->cfg.relu_dropout);
    /* fc1 and the ReLU in one op: a device backend adds the bias and takes the ReLU in the
     * GEMM's epilogue (ref: the two calls, bitwise as before). */
    NMT_TRY(be->matmul_bias_relu_fwd(ctx, s->h, x, P + s->w1, P + s->b1, rows, C, F));
    if (pr > 0)
      NMT_TRY(be->dropout_fwd(ctx, s->h, s->h, (size_t)rows * F, pr, ps->seed,
                              nmt_rng_stream(ps->step, s->site + PLACE_RELU)));
    NMT_TRY(be->matmul_fwd(ctx, o, s->h, P + s->w2, P + s->b2, rows, F, C));
    return NMT_OK;
  }
  float pa = p_or_zero(ps, m->cfg.attn_dropout);
  uint64_t stream = nmt_rng_stream(ps->step, s->site + PLACE_ATTN);
  if (s->kind == SUB_SELF) {
    const float *q, *k, *v;
    int ld;
    if (m->cfg.qkv_streams) {
      NMT_TRY(qkv_streams_fwd(m, P, s, x, rows));
      q = s->proj, k = q + (size_t)m->max_tokens * C, v = k + (size_t)m->max_tokens * C, ld = C;
    } else {
      NMT_TRY(be->matmul_fwd(ctx, s->proj, x, P + s->w1, P + s->b1, rows, C, 3 * C));
      q = s->proj, k = s->proj + C, v = s->proj + 2 * C, ld = 3 * C;
    }
    NMT_TRY(be->attention_fwd(ctx, s->att, s->probs, q, ld, k, v, ld, ps->lens, ps->B, ps->T,
                              ps->T, H, dk, s->causal, pa, ps->seed, stream));
  } else {
    float *q = s->proj, *kv = s->proj + (size_t)m->max_tokens * C;
    NMT_TRY(be->matmul_fwd(ctx, q, x, P + s->wq, P + s->bq, rows, C, C));
    NMT_TRY(be->matmul_fwd(ctx, kv, ps->enc_out, P + s->w1, P + s->b1, ps->B * ps->Ts, C, 2 * C));
    NMT_TRY(be->attention_fwd(ctx, s->att, s->probs, q, C, kv, kv + C, 2 * C, ps->src_lens, ps->B,
                              ps->T, ps->Ts, H, dk, 0, pa, ps->seed, stream));
  }
  NMT_TRY(be->matmul_fwd(ctx, o, s->att, P + s->w2, P + s->b2, rows, C, C));
  return NMT_OK;
}

static nmt_status sub_fwd_ops(nmt_model *m, const float *P, sublayer *s, const float *x,
                              const pass *ps) {
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int C = m->cfg.d_model;
  const int rows = ps->B * ps->T;
  const float pd = p_or_zero(ps, m->cfg.dropout);
  const uint64_t stream = nmt_rng_stream(ps->step, s->site + PLACE_OUT);
  /* S's output goes to the dropout-gradient scratch, which is free during forward; the fused
   * residual op reads it once and nothing reads it after. */
  float *o = m->d_drop;
  s->in = x;
  if (m->cfg.norm == NMT_NORM_POST) {
    NMT_TRY(sub_compute(m, P, s, x, o, ps));
    NMT_TRY(be->residual_dropout_ln_fwd(ctx, s->out, s->aux, s->mean, s->rstd, x, o, P + s->ln_w,
                                        P + s->ln_b, rows, C, m->cfg.ln_eps, pd, ps->seed,
                                        stream));
  } else {
    NMT_TRY(be->layernorm_fwd(ctx, s->aux, s->mean, s->rstd, x, P + s->ln_w, P + s->ln_b, rows, C,
                              m->cfg.ln_eps));
    NMT_TRY(sub_compute(m, P, s, s->aux, o, ps));
    /* gamma NULL: only the residual, out = x + Dropout(S(LN(x))). */
    NMT_TRY(be->residual_dropout_ln_fwd(ctx, NULL, s->out, NULL, NULL, x, o, NULL, NULL, rows, C,
                                        m->cfg.ln_eps, pd, ps->seed, stream));
  }
  return NMT_OK;
}

/* Cost of S(x) (sub_compute) or of its backward (sub_compute_bwd). */
static nmt_prof_cost sub_compute_cost(const nmt_model *m, const sublayer *s, const pass *ps,
                                      nmt_prof_phase ph) {
  const double C = m->cfg.d_model, F = m->cfg.d_ff, H = m->cfg.n_heads, dk = C / H;
  const double rows = (double)ps->B * ps->T, src_rows = (double)ps->B * ps->Ts;
  const double nc = rows * C, nf = rows * F;
  const int bwd = ph == NMT_PROF_BWD;
  nmt_prof_cost c = {0, 0};
  if (s->kind == SUB_FFN) {
    const float pr = bwd ? m->cfg.relu_dropout : p_or_zero(ps, m->cfg.relu_dropout);
    COST_ADD(c, nmt_prof_cost_matmul(ph, rows, C, F, 1));
    COST_ADD(c, nmt_prof_cost_matmul(ph, rows, F, C, 1));
    if (!bwd) {
      /* The ReLU is fused into fc1 (matmul_bias_relu_fwd): no pass over memory of its own,
       * and, as the bias add, not counted in the FLOPs (nmt/prof.h). */
      if (pr > 0) COST_ADD(c, ew(nf, 1, 1, 1));
    } else {
      COST_ADD(c, ew(nf, 0, 2, 0));    /* two memsets */
      COST_ADD(c, ew(nf, 3, 1, 1));    /* relu_bwd: dinp += dout * (out > 0) */
      if (pr > 0) COST_ADD(c, ew(nf, 2, 2, 2)); /* memset + axpy */
    }
    return c;
  }
  COST_ADD(c, nmt_prof_cost_matmul(ph, rows, C, C, 1)); /* out projection */
  if (bwd) COST_ADD(c, ew(nc, 0, 1, 0));
  if (s->kind == SUB_SELF) {
    /* qkv_streams: the same FLOPs in three GEMMs, which read x (and dout) three times */
    if (m->cfg.qkv_streams)
      for (int i = 0; i < 3; i++) COST_ADD(c, nmt_prof_cost_matmul(ph, rows, C, C, 1));
    else
      COST_ADD(c, nmt_prof_cost_matmul(ph, rows, C, 3 * C, 1));
    COST_ADD(c, nmt_prof_cost_attention(ph, ps->B, ps->T, ps->T, H, dk));
    if (bwd) COST_ADD(c, ew(3 * nc, 0, 1, 0));
  } else {
    COST_ADD(c, nmt_prof_cost_matmul(ph, rows, C, C, 1));
    COST_ADD(c, nmt_prof_cost_matmul(ph, src_rows, C, 2 * C, 1));
    COST_ADD(c, nmt_prof_cost_attention(ph, ps->B, ps->T, ps->Ts, H, dk));
    if (bwd) COST_ADD(c, ew(nc + 2 * src_rows * C, 0, 1, 0));
  }
  return c;
}

/* Cost of sub_fwd_ops / sub_bwd_ops: S plus dropout, residual and LayerNorm. The fused
 * residual_dropout_ln op moves each array once: post-LN forward reads x and y and writes sum
 * and out (the LayerNorm's own traffic, its input read, plus one more read and the write of
 * sum); its backward adds to LayerNorm's traffic only the read and write of dy when there is
 * dropout. 1 FLOP per element for the add, 1 for the dropout scale. */
static nmt_prof_cost sub_cost(const nmt_model *m, const sublayer *s, const pass *ps,
                              nmt_prof_phase ph) {
  const double rows = (double)ps->B * ps->T, n = rows * m->cfg.d_model;
  const int post = m->cfg.norm == NMT_NORM_POST;
  nmt_prof_cost c = sub_compute_cost(m, s, ps, ph);
  COST_ADD(c, nmt_prof_cost_layernorm(ph, rows, m->cfg.d_model));
  if (ph == NMT_PROF_BWD) {
    COST_ADD(c, ew(n, 0, 1, 0)); /* memset of the LN's or S's input gradient */
    if (m->cfg.dropout > 0)      /* memset of the dropout gradient, then post: the fused op's
                                  * dy += (read, write); pre: dropout_bwd (dout, dy read, dy) */
      COST_ADD(c, post ? ew(n, 1, 2, 1) : ew(n, 2, 2, 1));
  } else {
    const double pf = p_or_zero(ps, m->cfg.dropout) > 0 ? 1 : 0;
    /* post: y read and sum written on top of the LN's; pre (gamma NULL): x, y read, sum written */
    COST_ADD(c, post ? ew(n, 1, 1, 1 + pf) : ew(n, 2, 1, 1 + pf));
  }
  return c;
}

static nmt_status sub_fwd(nmt_model *m, const float *P, sublayer *s, const float *x,
                          const pass *ps) {
  if (!m->prof) return sub_fwd_ops(m, P, s, x, ps);
  nmt_prof_cost c = {0, 0};
  if (prof_costs(m)) c = sub_cost(m, s, ps, NMT_PROF_FWD);
  prof_push(m, s->prof_id, NMT_PROF_FWD, c);
  nmt_status st = sub_fwd_ops(m, P, s, x, ps);
  nmt_prof_pop(m->prof);
  return st;
}

/* Cost of embed_fwd_ops / embed_bwd_ops. */
static nmt_prof_cost embed_cost(const nmt_model *m, const pass *ps, nmt_prof_phase ph) {
  const double rows = (double)ps->B * ps->T, C = m->cfg.d_model;
  nmt_prof_cost c = nmt_prof_cost_embedding(ph, rows, C);
  if (ph == NMT_PROF_BWD && m->cfg.dropout > 0) COST_ADD(c, ew(rows * C, 2, 2, 1));
  if (ph == NMT_PROF_FWD && p_or_zero(ps, m->cfg.dropout) > 0) COST_ADD(c, ew(rows * C, 1, 1, 1));
  return c;
}

static nmt_status embed_fwd_ops(nmt_model *m, const float *P, float *out, const int32_t *ids,
                                const pass *ps, uint32_t place);

/* E[id] * sqrt(C) + PE, then dropout (§3.4, §3.5, §5.4). */
static nmt_status embed_fwd(nmt_model *m, const float *P, float *out, const int32_t *ids,
                            const pass *ps, uint32_t place) {
  if (!m->prof) return embed_fwd_ops(m, P, out, ids, ps, place);
  nmt_prof_cost c = {0, 0};
  if (prof_costs(m)) c = embed_cost(m, ps, NMT_PROF_FWD);
  prof_push(m, m->prof_ids[place ? MPROF_DEC_EMBED : MPROF_ENC_EMBED], NMT_PROF_FWD, c);
  nmt_status st = embed_fwd_ops(m, P, out, ids, ps, place);
  nmt_prof_pop(m->prof);
  return st;
}

static nmt_status embed_fwd_ops(nmt_model *m, const float *P, float *out, const int32_t *ids,
                                const pass *ps, uint32_t place) {
  const int C = m->cfg.d_model;
  const int rows = ps->B * ps->T;
  NMT_TRY(m->be->embedding_fwd(m->ctx, out, ids, P + m->embed_off, m->pe, rows, ps->T, C,
                               sqrtf((float)C)));
  float pd = p_or_zero(ps, m->cfg.dropout);
  if (pd > 0)
    NMT_TRY(m->be->dropout_fwd(m->ctx, out, out, (size_t)rows * C, pd, ps->seed,
                               nmt_rng_stream(ps->step, (uint32_t)STACK_EMBED << 20 | place)));
  return NMT_OK;
}

static nmt_status final_ln_fwd(nmt_model *m, const float *P, final_ln *f, const float *x, int rows,
                               const float **out) {
  if (m->prof) {
    nmt_prof_cost c = {0, 0};
    if (prof_costs(m)) c = nmt_prof_cost_layernorm(NMT_PROF_FWD, rows, m->cfg.d_model);
    prof_push(m, m->prof_ids[f == &m->enc_ln ? MPROF_ENC_LN : MPROF_DEC_LN], NMT_PROF_FWD, c);
  }
  f->in = x;
  nmt_status st = m->be->layernorm_fwd(m->ctx, f->out, f->mean, f->rstd, x, P + f->w, P + f->b,
                                       rows, m->cfg.d_model, m->cfg.ln_eps);
  nmt_prof_pop(m->prof);
  NMT_TRY(st);
  *out = f->out;
  return NMT_OK;
}

/* One encoder (n = 2) or decoder (n = 3) layer, sublayers s[0..n), on input x; returns the
 * layer's output (s[n-1].out, kept per layer also with checkpointing). Backward re-runs it
 * from s[0].in when checkpointing. */
static nmt_status layer_fwd(nmt_model *m, const float *P, sublayer *s, int n, const float *x,
                            const pass *ps, const float **out) {
  for (int k = 0; k < n; k++) {
    NMT_TRY(sub_fwd(m, P, &s[k], x, ps));
    x = s[k].out;
  }
  *out = x;
  return NMT_OK;
}

/* Encoder over src (B, Ts); sets m->enc_out. */
static nmt_status encode(nmt_model *m, const float *P, const int32_t *src, pass ps) {
  const float *x = m->emb_src;
  NMT_TRY(embed_fwd(m, P, m->emb_src, src, &ps, 0));
  for (int l = 0; l < m->cfg.enc_layers; l++)
    NMT_TRY(layer_fwd(m, P, &m->enc[2 * l], 2, x, &ps, &x));
  if (m->cfg.norm == NMT_NORM_PRE) NMT_TRY(final_ln_fwd(m, P, &m->enc_ln, x, ps.B * ps.T, &x));
  m->enc_out = x;
  return NMT_OK;
}

/* Decoder over tgt_in (B, Tt) attending to m->enc_out; sets m->dec_out. */
static nmt_status decode(nmt_model *m, const float *P, const int32_t *tgt_in, pass ps) {
  const float *x = m->emb_tgt;
  NMT_TRY(embed_fwd(m, P, m->emb_tgt, tgt_in, &ps, 1));
  for (int l = 0; l < m->cfg.dec_layers; l++)
    NMT_TRY(layer_fwd(m, P, &m->dec[3 * l], 3, x, &ps, &x));
  if (m->cfg.norm == NMT_NORM_PRE) NMT_TRY(final_ln_fwd(m, P, &m->dec_ln, x, ps.B * ps.T, &x));
  m->dec_out = x;
  return NMT_OK;
}

nmt_status nmt__model_encode_eval(nmt_model *m, const float *params, const nmt_batch *b) {
  NMT_TRY(nmt__model_check_shape(m, b->n_sent, b->src_len, "source"));
  m->fwd_train = 0;
  pass ps = {.B = b->n_sent, .T = b->src_len, .Ts = b->src_len, .lens = b->src_lens,
             .src_lens = b->src_lens};
  return encode(m, params, b->src, ps);
}

nmt_status nmt__model_check_shape(const nmt_model *m, int B, int T, const char *side) {
  if (B < 1 || T < 1 || T > m->max_len || (long)B * T > m->max_tokens)
    return nmt_errorf(NMT_ERR_DATA,
                      "model: %s batch %d x %d exceeds the sizes given at create (max_tokens %d, "
                      "max_len %d)",
                      side, B, T, m->max_tokens, m->max_len);
  return NMT_OK;
}

/* Output projection with the shared embedding (§3.4): logits = h E^T, rows = B*Tt. */
static nmt_status generator_proj(nmt_model *m, const float *params, int rows) {
  const int C = m->cfg.d_model, V = m->cfg.vocab;
  if (m->prof) {
    nmt_prof_cost c = {0, 0};
    if (prof_costs(m)) c = nmt_prof_cost_matmul(NMT_PROF_FWD, rows, C, V, 0);
    prof_push(m, m->prof_ids[MPROF_PROJ], NMT_PROF_FWD, c);
  }
  nmt_status st =
      m->be->matmul_fwd(m->ctx, m->logits, m->dec_out, params + m->embed_off, NULL, rows, C, V);
  nmt_prof_pop(m->prof);
  return st;
}

/* Label-smoothed loss of the logits (and their gradient in place when training), summed into
 * grad_extra with the token count. */
static nmt_status generator_xent_ops(nmt_model *m, const nmt_batch *b, int rows, int train,
                                     float *grad_extra) {
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  NMT_TRY(be->xent_fwd_bwd(ctx, m->logits, m->losses, m->nll, b->tgt_out, rows, m->cfg.vocab,
                           m->cfg.label_smoothing, train ? m->loss_scale : 1.0f,
                           train ? m->loss_scale_dev : NULL, train ? 1 : 0));
  NMT_TRY(be->sum_acc(ctx, grad_extra + NMT_GRAD_SLOT_LOSS, m->losses, (size_t)rows));
  NMT_TRY(be->sum_acc(ctx, grad_extra + NMT_GRAD_SLOT_NLL, m->nll, (size_t)rows));
  /* Counted on the device: a copy of b->tgt_tokens from the host would wait for the stream. */
  NMT_TRY(be->count_targets(ctx, grad_extra + NMT_GRAD_SLOT_TOKENS, b->tgt_out, (size_t)rows));
  return NMT_OK;
}

static nmt_status generator_xent(nmt_model *m, const nmt_batch *b, int rows, int train,
                                 float *grad_extra) {
  if (!m->prof) return generator_xent_ops(m, b, rows, train, grad_extra);
  nmt_prof_cost c = {0, 0};
  if (prof_costs(m)) {
    c = nmt_prof_cost_xent(rows, m->cfg.vocab);
    COST_ADD(c, ew(2.0 * rows, 1, 0, 1)); /* the two sums */
  }
  prof_push(m, m->prof_ids[MPROF_XENT], NMT_PROF_FWD, c);
  nmt_status st = generator_xent_ops(m, b, rows, train, grad_extra);
  nmt_prof_pop(m->prof);
  return st;
}

nmt_status nmt_model_forward(nmt_model *m, const float *params, const nmt_batch *b, int train,
                             uint64_t seed, uint64_t step, float *grad_extra) {
  const int B = b->n_sent, Ts = b->src_len, Tt = b->tgt_len;
  m->fwd_train = 0;
  NMT_TRY(nmt__model_check_shape(m, B, Ts, "source"));
  NMT_TRY(nmt__model_check_shape(m, B, Tt, "target"));

  pass ps = {.B = B,
             .T = Ts,
             .Ts = Ts,
             .lens = b->src_lens,
             .src_lens = b->src_lens,
             .train = train,
             .seed = seed,
             .step = step};
  NMT_TRY(encode(m, params, b->src, ps));
  ps.T = Tt;
  ps.lens = b->tgt_lens;
  ps.enc_out = m->enc_out;
  NMT_TRY(decode(m, params, b->tgt_in, ps));

  const int rows = B * Tt;
  NMT_TRY(generator_proj(m, params, rows));
  NMT_TRY(generator_xent(m, b, rows, train, grad_extra));

  m->fwd_train = train ? 1 : 0;
  m->fwd_seed = seed;
  m->fwd_step = step;
  m->fwd_B = B;
  m->fwd_Ts = Ts;
  m->fwd_Tt = Tt;
  return NMT_OK;
}

nmt_status nmt_model_logits(nmt_model *m, const float *params, const nmt_batch *b,
                            const float **logits) {
  const int B = b->n_sent, Ts = b->src_len, Tt = b->tgt_len;
  m->fwd_train = 0;
  NMT_TRY(nmt__model_check_shape(m, B, Ts, "source"));
  NMT_TRY(nmt__model_check_shape(m, B, Tt, "target"));
  pass ps = {.B = B, .T = Ts, .Ts = Ts, .lens = b->src_lens, .src_lens = b->src_lens};
  NMT_TRY(encode(m, params, b->src, ps));
  ps.T = Tt;
  ps.lens = b->tgt_lens;
  ps.enc_out = m->enc_out;
  NMT_TRY(decode(m, params, b->tgt_in, ps));
  NMT_TRY(generator_proj(m, params, B * Tt));
  *logits = m->logits;
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* backward */

/* Accumulates the gradient of S's input into dx, given dout = d S(x) (rows, C). Reads dout
 * only in its first matmul, so dout may alias dx (the post-LN residual uses that). */
static nmt_status sub_compute_bwd(nmt_model *m, const float *P, float *G, sublayer *s,
                                  const float *x, const float *dout, float *dx, float *d_enc,
                                  const pass *ps) {
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int C = m->cfg.d_model, F = m->cfg.d_ff, H = m->cfg.n_heads, dk = C / H;
  const int rows = ps->B * ps->T;
  if (s->kind == SUB_FFN) {
    /* d fc1 = (hd > 0) * d hd / (1-p) with hd = dropout(relu(.)) as saved: no mask to
     * regenerate (see sub_compute). */
    const float pr = m->cfg.relu_dropout;
    const size_t nf = (size_t)rows * F;
    NMT_TRY(be->memset_zero(ctx, m->f2, nf * sizeof(float)));
    NMT_TRY(be->matmul_bwd(ctx, m->f2, G + s->w2, G + s->b2, dout, s->h, P + s->w2, rows, F, C));
    NMT_TRY(be->memset_zero(ctx, m->f1, nf * sizeof(float)));
    NMT_TRY(be->relu_bwd(ctx, m->f1, m->f2, s->h, nf));
    const float *dz = m->f1;
    if (pr > 0) {
      /* The same fp32 scale as the dropout op's (include/nmt/ref.h). */
      NMT_TRY(be->memset_zero(ctx, m->f2, nf * sizeof(float)));
      NMT_TRY(be->axpy(ctx, m->f2, m->f1, 1.0f / (1.0f - pr), nf));
      dz = m->f2;
    }
    NMT_TRY(be->matmul_bwd(ctx, dx, G + s->w1, G + s->b1, dz, x, P + s->w1, rows, C, F));
    return NMT_OK;
  }
  const float pa = m->cfg.attn_dropout;
  const uint64_t stream = nmt_rng_stream(ps->step, s->site + PLACE_ATTN);
  const size_t nc = (size_t)rows * C;
  NMT_TRY(be->memset_zero(ctx, m->d_att, nc * sizeof(float)));
  NMT_TRY(be->matmul_bwd(ctx, m->d_att, G + s->w2, G + s->b2, dout, s->att, P + s->w2, rows, C, C));
  if (s->kind == SUB_SELF && m->cfg.qkv_streams) {
    const size_t NC = (size_t)m->max_tokens * C;
    const float *q = s->proj, *k = q + NC, *v = k + NC;
    float *dq = m->d_proj, *dkey = dq + NC, *dv = dkey + NC;
    NMT_TRY(be->memset_zero(ctx, dq, nc * sizeof(float)));
    NMT_TRY(be->memset_zero(ctx, dkey, nc * sizeof(float)));
    NMT_TRY(be->memset_zero(ctx, dv, nc * sizeof(float)));
    NMT_TRY(be->attention_bwd(ctx, dq, dkey, dv, m->d_probs, m->d_att, s->probs, q, C, k, v, C,
                              ps->lens, ps->B, ps->T, ps->T, H, dk, s->causal, pa, ps->seed,
                              stream));
    qkv_args a = {.s = s, .P = P, .x = x, .G = G, .dqkv = m->d_proj, .dx = dx, .rows = rows};
    NMT_TRY(on_three_streams(m, qkv_bwd_one, &a));
    return NMT_OK;
  }
  if (s->kind == SUB_SELF) {
    NMT_TRY(be->memset_zero(ctx, m->d_proj, 3 * nc * sizeof(float)));
    NMT_TRY(be->attention_bwd(ctx, m->d_proj, m->d_proj + C, m->d_proj + 2 * C, m->d_probs,
                              m->d_att, s->probs, s->proj, 3 * C, s->proj + C, s->proj + 2 * C,
                              3 * C, ps->lens, ps->B, ps->T, ps->T, H, dk, s->causal, pa, ps->seed,
                              stream));
    NMT_TRY(be->matmul_bwd(ctx, dx, G + s->w1, G + s->b1, m->d_proj, x, P + s->w1, rows, C, 3 * C));
    return NMT_OK;
  }
  const size_t ns = (size_t)ps->B * ps->Ts;
  const float *q = s->proj, *kv = s->proj + (size_t)m->max_tokens * C;
  float *dq = m->d_proj, *dkv = m->d_proj + (size_t)m->max_tokens * C;
  NMT_TRY(be->memset_zero(ctx, dq, nc * sizeof(float)));
  NMT_TRY(be->memset_zero(ctx, dkv, 2 * ns * C * sizeof(float)));
  NMT_TRY(be->attention_bwd(ctx, dq, dkv, dkv + C, m->d_probs, m->d_att, s->probs, q, C, kv, kv + C,
                            2 * C, ps->src_lens, ps->B, ps->T, ps->Ts, H, dk, 0, pa, ps->seed,
                            stream));
  NMT_TRY(be->matmul_bwd(ctx, d_enc, G + s->w1, G + s->b1, dkv, ps->enc_out, P + s->w1, (int)ns, C,
                         2 * C));
  NMT_TRY(be->matmul_bwd(ctx, dx, G + s->wq, G + s->bq, dq, x, P + s->wq, rows, C, C));
  return NMT_OK;
}

/* On entry *g holds d out; on return *g holds d x (the buffers *g and *t may be swapped). */
static nmt_status sub_bwd_ops(nmt_model *m, const float *P, float *G, sublayer *s, float **g,
                              float **t, float *d_enc, const pass *ps) {
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int C = m->cfg.d_model;
  const int rows = ps->B * ps->T;
  const size_t n = (size_t)rows * C;
  const float pd = m->cfg.dropout;
  const uint64_t stream = nmt_rng_stream(ps->step, s->site + PLACE_OUT);
  if (m->cfg.norm == NMT_NORM_POST) {
    /* dr = LN'(dout); dx = dr + S'(dropout'(dr)), accumulated in the same buffer. One fused
     * op forms dr and dropout'(dr) (into d_drop; without dropout S' reads dr itself). */
    float *dr = *t;
    NMT_TRY(be->memset_zero(ctx, dr, n * sizeof(float)));
    const float *dout = dr;
    if (pd > 0) {
      NMT_TRY(be->memset_zero(ctx, m->d_drop, n * sizeof(float)));
      dout = m->d_drop;
    }
    NMT_TRY(be->residual_dropout_ln_bwd(ctx, dr, pd > 0 ? m->d_drop : NULL, G + s->ln_w,
                                        G + s->ln_b, *g, s->aux, P + s->ln_w, s->mean, s->rstd,
                                        rows, C, pd, ps->seed, stream));
    NMT_TRY(sub_compute_bwd(m, P, G, s, s->in, dout, dr, d_enc, ps));
    *t = *g;
    *g = dr;
  } else {
    /* dx = dout + LN'(S'(dropout'(dout))); the LN backward accumulates into dout's buffer. */
    const float *dout = *g;
    if (pd > 0) {
      NMT_TRY(be->memset_zero(ctx, m->d_drop, n * sizeof(float)));
      NMT_TRY(be->dropout_bwd(ctx, m->d_drop, *g, n, pd, ps->seed, stream));
      dout = m->d_drop;
    }
    float *dn = *t;
    NMT_TRY(be->memset_zero(ctx, dn, n * sizeof(float)));
    NMT_TRY(sub_compute_bwd(m, P, G, s, s->aux, dout, dn, d_enc, ps));
    NMT_TRY(be->layernorm_bwd(ctx, *g, G + s->ln_w, G + s->ln_b, dn, s->in, P + s->ln_w, s->mean,
                              s->rstd, rows, C));
  }
  return NMT_OK;
}

static nmt_status sub_bwd(nmt_model *m, const float *P, float *G, sublayer *s, float **g, float **t,
                          float *d_enc, const pass *ps) {
  if (!m->prof) return sub_bwd_ops(m, P, G, s, g, t, d_enc, ps);
  nmt_prof_cost c = {0, 0};
  if (prof_costs(m)) c = sub_cost(m, s, ps, NMT_PROF_BWD);
  prof_push(m, s->prof_id, NMT_PROF_BWD, c);
  nmt_status st = sub_bwd_ops(m, P, G, s, g, t, d_enc, ps);
  nmt_prof_pop(m->prof);
  return st;
}

/* *g holds d(final LN output); on return d(final LN input), buffers swapped. */
static nmt_status final_ln_bwd(nmt_model *m, const float *P, float *G, final_ln *f, float **g,
                               float **t, int rows) {
  const int C = m->cfg.d_model;
  if (m->prof) {
    nmt_prof_cost c = {0, 0};
    if (prof_costs(m)) {
      c = nmt_prof_cost_layernorm(NMT_PROF_BWD, rows, C);
      COST_ADD(c, ew((double)rows * C, 0, 1, 0));
    }
    prof_push(m, m->prof_ids[f == &m->enc_ln ? MPROF_ENC_LN : MPROF_DEC_LN], NMT_PROF_BWD, c);
  }
  nmt_status st = m->be->memset_zero(m->ctx, *t, (size_t)rows * C * sizeof(float));
  if (st == NMT_OK)
    st = m->be->layernorm_bwd(m->ctx, *t, G + f->w, G + f->b, *g, f->in, P + f->w, f->mean,
                              f->rstd, rows, C);
  nmt_prof_pop(m->prof);
  NMT_TRY(st);
  float *tmp = *g;
  *g = *t;
  *t = tmp;
  return NMT_OK;
}

static nmt_status embed_bwd_ops(nmt_model *m, float *G, const float *dout, const int32_t *ids,
                                const pass *ps, uint32_t place) {
  const int C = m->cfg.d_model;
  const int rows = ps->B * ps->T;
  const size_t n = (size_t)rows * C;
  const float pd = m->cfg.dropout;
  if (pd > 0) {
    NMT_TRY(m->be->memset_zero(m->ctx, m->d_drop, n * sizeof(float)));
    NMT_TRY(m->be->dropout_bwd(m->ctx, m->d_drop, dout, n, pd, ps->seed,
                               nmt_rng_stream(ps->step, (uint32_t)STACK_EMBED << 20 | place)));
    dout = m->d_drop;
  }
  NMT_TRY(m->be->embedding_bwd(m->ctx, G + m->embed_off, dout, ids, rows, C, sqrtf((float)C)));
  return NMT_OK;
}

static nmt_status embed_bwd(nmt_model *m, float *G, const float *dout, const int32_t *ids,
                            const pass *ps, uint32_t place) {
  if (!m->prof) return embed_bwd_ops(m, G, dout, ids, ps, place);
  nmt_prof_cost c = {0, 0};
  if (prof_costs(m)) c = embed_cost(m, ps, NMT_PROF_BWD);
  prof_push(m, m->prof_ids[place ? MPROF_DEC_EMBED : MPROF_ENC_EMBED], NMT_PROF_BWD, c);
  nmt_status st = embed_bwd_ops(m, G, dout, ids, ps, place);
  nmt_prof_pop(m->prof);
  return st;
}

/* Backward of the output projection into g (rows, C), zeroed first; the logits hold
 * d(sum loss)/d logits since the forward. */
static nmt_status generator_proj_bwd(nmt_model *m, const float *params, float *grads, float *g,
                                     int rows) {
  const int C = m->cfg.d_model, V = m->cfg.vocab;
  if (m->prof) {
    nmt_prof_cost c = {0, 0};
    if (prof_costs(m)) {
      c = nmt_prof_cost_matmul(NMT_PROF_BWD, rows, C, V, 0);
      COST_ADD(c, ew((double)rows * C, 0, 1, 0));
    }
    prof_push(m, m->prof_ids[MPROF_PROJ], NMT_PROF_BWD, c);
  }
  nmt_status st = m->be->memset_zero(m->ctx, g, (size_t)rows * C * sizeof(float));
  if (st == NMT_OK)
    st = m->be->matmul_bwd(m->ctx, g, grads + m->embed_off, NULL, m->logits, m->dec_out,
                           params + m->embed_off, rows, C, V);
  nmt_prof_pop(m->prof);
  return st;
}

/* Checkpointing: rebuilds the workspace activations of the layer s[0..n) from its kept input
 * s[0].in, with the forward's dropout (ps carries its seed and step, train = 1), so they are
 * bitwise the forward's. The layer's output, which it also rewrites, gets the values it
 * already holds; nothing reads it any more (later layers are done). No-op without
 * checkpointing, where every sublayer kept its own activations. */
static nmt_status recompute_layer(nmt_model *m, const float *P, sublayer *s, int n,
                                  const pass *ps) {
  if (!m->cfg.checkpoint_activations) return NMT_OK;
  const float *out;
  return layer_fwd(m, P, s, n, s[0].in, ps, &out);
}

/* Calls ready only when the final prefix grew (post-LN has no ln_f stages). */
static nmt_status report(nmt_grad_ready_fn ready, void *user, size_t n, size_t *last) {
  if (!ready || n <= *last) return NMT_OK;
  *last = n;
  return ready(user, n);
}

nmt_status nmt_model_backward(nmt_model *m, const float *params, float *grads, const nmt_batch *b,
                              nmt_grad_ready_fn ready, void *user) {
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const nmt_model_cfg *cfg = &m->cfg;
  const int C = cfg->d_model;
  if (!m->fwd_train)
    return nmt_errorf(NMT_ERR_INTERNAL, "model: backward without a forward(train=1) before it");
  if (b->n_sent != m->fwd_B || b->src_len != m->fwd_Ts || b->tgt_len != m->fwd_Tt)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "model: backward batch %dx%d/%d differs from the forward's %dx%d/%d",
                      b->n_sent, b->src_len, b->tgt_len, m->fwd_B, m->fwd_Ts, m->fwd_Tt);
  const int B = b->n_sent, Ts = b->src_len, Tt = b->tgt_len;
  pass ps = {.B = B,
             .T = Tt,
             .Ts = Ts,
             .lens = b->tgt_lens,
             .src_lens = b->src_lens,
             .enc_out = m->enc_out,
             .train = 1,
             .seed = m->fwd_seed,
             .step = m->fwd_step};
  float *g = m->g[0], *t = m->g[1], *d_enc = m->g[2];
  int stage = 0;
  size_t reported = 0;

  NMT_TRY(generator_proj_bwd(m, params, grads, g, B * Tt));
  if (cfg->norm == NMT_NORM_PRE)
    NMT_TRY(final_ln_bwd(m, params, grads, &m->dec_ln, &g, &t, B * Tt));
  NMT_TRY(report(ready, user, m->ready_after[stage++], &reported));

  NMT_TRY(be->memset_zero(ctx, d_enc, (size_t)B * Ts * C * sizeof(float)));
  for (int l = cfg->dec_layers - 1; l >= 0; l--) {
    NMT_TRY(recompute_layer(m, params, &m->dec[3 * l], 3, &ps));
    for (int k = 2; k >= 0; k--)
      NMT_TRY(sub_bwd(m, params, grads, &m->dec[3 * l + k], &g, &t, d_enc, &ps));
    NMT_TRY(report(ready, user, m->ready_after[stage++], &reported));
  }
  NMT_TRY(embed_bwd(m, grads, g, b->tgt_in, &ps, 1));

  /* Encoder: its output's gradient is what the cross-attentions accumulated. */
  ps.T = Ts;
  ps.lens = b->src_lens;
  float *spare = g;
  g = d_enc;
  t = spare;
  if (cfg->norm == NMT_NORM_PRE)
    NMT_TRY(final_ln_bwd(m, params, grads, &m->enc_ln, &g, &t, B * Ts));
  NMT_TRY(report(ready, user, m->ready_after[stage++], &reported));
  for (int l = cfg->enc_layers - 1; l >= 0; l--) {
    NMT_TRY(recompute_layer(m, params, &m->enc[2 * l], 2, &ps));
    for (int k = 1; k >= 0; k--)
      NMT_TRY(sub_bwd(m, params, grads, &m->enc[2 * l + k], &g, &t, NULL, &ps));
    NMT_TRY(report(ready, user, m->ready_after[stage++], &reported));
  }
  NMT_TRY(embed_bwd(m, grads, g, b->src, &ps, 0));
  /* The trailing slots were written by the forward, so everything is final now. */
  NMT_TRY(report(ready, user, m->n_params + NMT_GRAD_EXTRA, &reported));
  m->fwd_train = 0; /* the logits no longer hold a gradient for this batch's forward */
  return NMT_OK;
}
