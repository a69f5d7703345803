/* backward.c — the backward pass of the Transformer (nmt_model_backward): the forward's ops
 * (forward.c) in reverse, accumulating d(loss scale * sum loss)/d params into the flat gradient
 * buffer, and reporting the ready prefix of that buffer after each stage (decoder.ln_f,
 * decoder layers L-1..0, encoder.ln_f, encoder layers L-1..0, the embedding: the parameter
 * layout's order, so the caller can all-reduce buckets while the rest of backward runs;
 * stage_of and ready_after in transformer.c). nmt_model_backward_sink runs the same ops in the
 * same order, but each stage writes into a window its sink opens for the stage's range and
 * closes once the stage is final (ZeRO stage 2: no flat gradient buffer exists); the tied
 * embedding, written by the output projection, the decoder input and the encoder input, keeps
 * one window open from the first op of backward to the last, beside each other stage's in
 * turn. Every op reaches its gradient through nmt__grad_at (model_impl.h).
 *
 * Dropout masks are never stored: backward regenerates them from (seed, step, site), except
 * the FFN's, which is implicit in the saved hidden activation. With checkpointing
 * (transformer.c's top comment) each layer's backward stage starts by re-running that layer's
 * forward (recompute_layer). */
#include <math.h>
#include <stdint.h>

#include "nmt/model.h"
#include "nmt/rng.h"
#include "model_impl.h"

/* Accumulates the gradient of S's input into dx, given dout = d S(x) (rows, C). Reads dout
 * only in its first matmul, so dout may alias dx (the post-LN residual uses that). */
static nmt_status sub_compute_bwd(nmt_model *m, const float *P, nmt__grad_win G, sublayer *s,
                                  const float *x, const float *dout, float *dx, float *d_enc,
                                  const pass *ps) {
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int C = m->cfg.d_model, F = m->cfg.d_ff, H = m->cfg.n_heads, dk = C / H;
  const int rows = ps->B * ps->T;
  if (s->kind == SUB_FFN) {
    /* d fc1 = (hd > 0) * d hd / (1-p) with hd = dropout(relu(.)) as saved: no mask to
     * regenerate (see forward.c's sub_compute). */
    const float pr = m->cfg.relu_dropout;
    const size_t nf = (size_t)rows * F;
    NMT_TRY(be->memset_zero(ctx, m->f2, nf * sizeof(float)));
    NMT_TRY(be->matmul_bwd(ctx, m->f2, nmt__grad_at(G, s->w2), nmt__grad_at(G, s->b2), dout,
                           s->h, P + s->w2, rows, F, C));
    NMT_TRY(be->memset_zero(ctx, m->f1, nf * sizeof(float)));
    NMT_TRY(be->relu_bwd(ctx, m->f1, m->f2, s->h, nf));
    const float *dz = m->f1;
    if (pr > 0) {
      /* The same fp32 scale as the dropout op's (include/nmt/ref.h). */
      NMT_TRY(be->memset_zero(ctx, m->f2, nf * sizeof(float)));
      NMT_TRY(be->axpy(ctx, m->f2, m->f1, 1.0f / (1.0f - pr), nf));
      dz = m->f2;
    }
    NMT_TRY(be->matmul_bwd(ctx, dx, nmt__grad_at(G, s->w1), nmt__grad_at(G, s->b1), dz, x,
                           P + s->w1, rows, C, F));
    return NMT_OK;
  }
  const float pa = m->cfg.attn_dropout;
  const uint64_t stream = nmt_rng_stream(ps->step, s->site + PLACE_ATTN);
  const size_t nc = (size_t)rows * C;
  NMT_TRY(be->memset_zero(ctx, m->d_att, nc * sizeof(float)));
  NMT_TRY(be->matmul_bwd(ctx, m->d_att, nmt__grad_at(G, s->w2), nmt__grad_at(G, s->b2), dout,
                         s->att, P + s->w2, rows, C, C));
  if (s->kind == SUB_SELF && m->cfg.qkv_streams) {
    const size_t NC = (size_t)m->max_tokens * C;
    const float *q = s->proj, *k = q + NC, *v = k + NC;
    float *dq = m->d_proj, *dkey = dq + NC, *dv = dkey + NC;
    NMT_TRY(be->memset_zero(ctx, dq, nc * sizeof(float)));
    NMT_TRY(be->memset_zero(ctx, dkey, nc * sizeof(float)));
    NMT_TRY(be->memset_zero(ctx, dv, nc * sizeof(float)));
    if (m->cfg.fused_attention) {
      const nmt_attn_args a = nmt__attn_args(m, q, C, k, v, C, ps->lens, ps->B, ps->T, ps->T,
                                             s->causal, pa, ps->seed, stream, 0);
      NMT_TRY(be->attention_fused_bwd(ctx, dq, dkey, dv, m->d_row, m->d_att, s->att, s->lse, &a));
    } else {
      NMT_TRY(be->attention_bwd(ctx, dq, dkey, dv, m->d_probs, m->d_att, s->probs, q, C, k, v, C,
                                ps->lens, ps->B, ps->T, ps->T, H, dk, s->causal, pa, ps->seed,
                                stream));
    }
    NMT_TRY(nmt__model_qkv_streams_bwd(m, P, s, x, G, m->d_proj, dx, rows));
    return NMT_OK;
  }
  if (s->kind == SUB_SELF) {
    NMT_TRY(be->memset_zero(ctx, m->d_proj, 3 * nc * sizeof(float)));
    if (m->cfg.fused_attention) {
      const nmt_attn_args a = nmt__attn_args(m, s->proj, 3 * C, s->proj + C, s->proj + 2 * C,
                                             3 * C, ps->lens, ps->B, ps->T, ps->T, s->causal, pa,
                                             ps->seed, stream, 0);
      NMT_TRY(be->attention_fused_bwd(ctx, m->d_proj, m->d_proj + C, m->d_proj + 2 * C, m->d_row,
                                      m->d_att, s->att, s->lse, &a));
    } else {
      NMT_TRY(be->attention_bwd(ctx, m->d_proj, m->d_proj + C, m->d_proj + 2 * C, m->d_probs,
                                m->d_att, s->probs, s->proj, 3 * C, s->proj + C,
                                s->proj + 2 * C, 3 * C, ps->lens, ps->B, ps->T, ps->T, H, dk,
                                s->causal, pa, ps->seed, stream));
    }
    NMT_TRY(be->matmul_bwd(ctx, dx, nmt__grad_at(G, s->w1), nmt__grad_at(G, s->b1), m->d_proj,
                           x, P + s->w1, rows, C, 3 * C));
    return NMT_OK;
  }
  const size_t ns = (size_t)ps->B * ps->Ts;
  const float *q = s->proj, *kv = s->proj + (size_t)m->max_tokens * C;
  float *dq = m->d_proj, *dkv = m->d_proj + (size_t)m->max_tokens * C;
  NMT_TRY(be->memset_zero(ctx, dq, nc * sizeof(float)));
  NMT_TRY(be->memset_zero(ctx, dkv, 2 * ns * C * sizeof(float)));
  if (m->cfg.fused_attention) {
    const nmt_attn_args a = nmt__attn_args(m, q, C, kv, kv + C, 2 * C, ps->src_lens, ps->B, ps->T,
                                           ps->Ts, 0, pa, ps->seed, stream, 0);
    NMT_TRY(be->attention_fused_bwd(ctx, dq, dkv, dkv + C, m->d_row, m->d_att, s->att, s->lse,
                                    &a));
  } else {
    NMT_TRY(be->attention_bwd(ctx, dq, dkv, dkv + C, m->d_probs, m->d_att, s->probs, q, C, kv,
                              kv + C, 2 * C, ps->src_lens, ps->B, ps->T, ps->Ts, H, dk, 0, pa,
                              ps->seed, stream));
  }
  NMT_TRY(be->matmul_bwd(ctx, d_enc, nmt__grad_at(G, s->w1), nmt__grad_at(G, s->b1), dkv,
                         ps->enc_out, P + s->w1, (int)ns, C, 2 * C));
  NMT_TRY(be->matmul_bwd(ctx, dx, nmt__grad_at(G, s->wq), nmt__grad_at(G, s->bq), dq, x,
                         P + s->wq, rows, C, C));
  return NMT_OK;
}

/* On entry *g holds d out; on return *g holds d x (the buffers *g and *t may be swapped). */
static nmt_status sub_bwd_ops(nmt_model *m, const float *P, nmt__grad_win G, sublayer *s,
                              float **g, float **t, float *d_enc, const pass *ps) {
  if (m->cfg.act_half) return nmt__half_sub_bwd(m, P, G, s, g, t, d_enc, ps);
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
    NMT_TRY(be->residual_dropout_ln_bwd(ctx, dr, pd > 0 ? m->d_drop : NULL,
                                        nmt__grad_at(G, s->ln_w), nmt__grad_at(G, s->ln_b), *g,
                                        s->aux, P + s->ln_w, s->mean, s->rstd, rows, C, pd,
                                        ps->seed, stream));
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
    NMT_TRY(be->layernorm_bwd(ctx, *g, nmt__grad_at(G, s->ln_w), nmt__grad_at(G, s->ln_b), dn,
                              s->in, P + s->ln_w, s->mean, s->rstd, rows, C));
  }
  return NMT_OK;
}

static nmt_status sub_bwd(nmt_model *m, const float *P, nmt__grad_win G, sublayer *s, float **g,
                          float **t, float *d_enc, const pass *ps) {
  if (!m->prof) return sub_bwd_ops(m, P, G, s, g, t, d_enc, ps);
  nmt_prof_cost c = {0, 0};
  if (nmt__model_prof_costs(m)) c = nmt__model_sub_cost(m, s, ps, NMT_PROF_BWD);
  nmt__model_prof_push(m, s->prof_id, NMT_PROF_BWD, c);
  nmt_status st = sub_bwd_ops(m, P, G, s, g, t, d_enc, ps);
  nmt_prof_pop(m->prof);
  return st;
}

/* *g holds d(final LN output); on return d(final LN input), buffers swapped. */
static nmt_status final_ln_bwd(nmt_model *m, const float *P, nmt__grad_win G, final_ln *f,
                               float **g, float **t, int rows) {
  const int C = m->cfg.d_model;
  if (m->prof) {
    nmt_prof_cost c = {0, 0};
    if (nmt__model_prof_costs(m)) c = nmt__model_final_ln_cost(m, rows, NMT_PROF_BWD);
    nmt__model_prof_push(m, m->prof_ids[f == &m->enc_ln ? MPROF_ENC_LN : MPROF_DEC_LN],
                         NMT_PROF_BWD, c);
  }
  if (m->cfg.act_half) {
    nmt_status hs = nmt__half_final_ln_bwd(m, P, G, f, g, t, rows);
    nmt_prof_pop(m->prof);
    return hs;
  }
  nmt_status st = m->be->memset_zero(m->ctx, *t, (size_t)rows * C * sizeof(float));
  if (st == NMT_OK)
    st = m->be->layernorm_bwd(m->ctx, *t, nmt__grad_at(G, f->w), nmt__grad_at(G, f->b), *g,
                              f->in, P + f->w, f->mean, f->rstd, rows, C);
  nmt_prof_pop(m->prof);
  NMT_TRY(st);
  float *tmp = *g;
  *g = *t;
  *t = tmp;
  return NMT_OK;
}

static nmt_status embed_bwd_ops(nmt_model *m, nmt__grad_win G, const float *dout,
                                const int32_t *ids, const pass *ps, uint32_t place) {
  if (m->cfg.act_half) return nmt__half_embed_bwd(m, G, dout, ids, ps, place);
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
  NMT_TRY(m->be->embedding_bwd(m->ctx, nmt__grad_at(G, m->embed_off), dout, ids, rows, C,
                               sqrtf((float)C)));
  return NMT_OK;
}

static nmt_status embed_bwd(nmt_model *m, nmt__grad_win G, const float *dout,
                            const int32_t *ids, const pass *ps, uint32_t place) {
  if (!m->prof) return embed_bwd_ops(m, G, dout, ids, ps, place);
  nmt_prof_cost c = {0, 0};
  if (nmt__model_prof_costs(m)) c = nmt__model_embed_cost(m, ps, NMT_PROF_BWD, place);
  nmt__model_prof_push(m, m->prof_ids[place ? MPROF_DEC_EMBED : MPROF_ENC_EMBED], NMT_PROF_BWD, c);
  nmt_status st = embed_bwd_ops(m, G, dout, ids, ps, place);
  nmt_prof_pop(m->prof);
  return st;
}

/* Backward of the output projection into g (rows, C), zeroed first; the logits hold
 * d(sum loss)/d logits since the forward. */
static nmt_status generator_proj_bwd(nmt_model *m, const float *params, nmt__grad_win G,
                                     float *g, int rows) {
  const int C = m->cfg.d_model, V = m->cfg.vocab;
  if (m->prof) {
    nmt_prof_cost c = {0, 0};
    if (nmt__model_prof_costs(m)) c = nmt__model_proj_cost(m, rows, NMT_PROF_BWD);
    nmt__model_prof_push(m, m->prof_ids[MPROF_PROJ], NMT_PROF_BWD, c);
  }
  nmt_status st = m->cfg.act_half
                      ? nmt__half_generator_bwd(m, params, G, g, rows)
                      : m->be->memset_zero(m->ctx, g, (size_t)rows * C * sizeof(float));
  if (st == NMT_OK && !m->cfg.act_half)
    st = m->be->matmul_bwd(m->ctx, g, nmt__grad_at(G, m->embed_off), NULL, m->logits, m->dec_out,
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
  /* Half storage, post-LN: the layer's input also as the half copy its first GEMM reads. */
  if (m->cfg.act_half) m->cur_h = s[0].in_h;
  return nmt__model_layer_fwd(m, P, s, n, s[0].in, ps, &out);
}

/* Calls ready only when the final prefix grew (post-LN has no ln_f stages). */
static nmt_status report(nmt_grad_ready_fn ready, void *user, size_t n, size_t *last) {
  if (!ready || n <= *last) return NMT_OK;
  *last = n;
  return ready(user, n);
}

/* Where one backward's parameter gradients go: the flat buffer with its ready reports
 * (nmt_model_backward), or a sink's windows (nmt_model_backward_sink). */
typedef struct {
  float *flat;
  nmt_grad_ready_fn ready;
  void *user;
  size_t reported;
  const nmt_grad_sink *sink; /* NULL: the flat buffer */
} dest;

/* Stage s's parameter range: the stages tile the layout in order, so it runs from the end of
 * the previous stage's ready prefix to its own (empty for post-LN's ln_f stages). */
static void stage_range(const nmt_model *m, int s, size_t *begin, size_t *end) {
  *begin = s > 0 ? m->ready_after[s - 1] : 0;
  *end = m->ready_after[s];
}

/* Opens stage s (range [begin, end)) for writing: *g is the flat buffer, or the window the
 * sink opened (none for an empty stage, which no op writes). */
static nmt_status dest_open(const nmt_model *m, dest *d, int s, nmt__grad_win *g) {
  size_t begin, end;
  stage_range(m, s, &begin, &end);
  if (!d->sink) {
    *g = (nmt__grad_win){.base = d->flat, .begin = 0};
    return NMT_OK;
  }
  *g = (nmt__grad_win){.base = NULL, .begin = begin};
  if (end <= begin) return NMT_OK;
  NMT_TRY(d->sink->open(d->sink->user, begin, end, &g->base));
  if (!g->base)
    return nmt_errorf(NMT_ERR_INTERNAL, "model: the gradient sink opened no window for "
                      "parameters [%zu, %zu)", begin, end);
  return NMT_OK;
}

/* Stage s's gradients are final: the sink's close, or with the flat buffer the ready report
 * of prefix `ready_to` (0: none, the prefix did not grow). */
static nmt_status dest_close(const nmt_model *m, dest *d, int s, size_t ready_to) {
  if (!d->sink) return ready_to ? report(d->ready, d->user, ready_to, &d->reported) : NMT_OK;
  size_t begin, end;
  stage_range(m, s, &begin, &end);
  return end > begin ? d->sink->close(d->sink->user, begin, end) : NMT_OK;
}

static nmt_status backward_ops(nmt_model *m, const float *params, const nmt_batch *b, dest *d) {
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
  const int embed = m->n_stages - 1; /* the tied embedding's stage, written at three points */
  int stage = 0;
  nmt__grad_win G, E; /* E: the tied embedding's window, open through the whole backward */

  /* The embedding's three parts (output projection, decoder input, encoder input) accumulate
   * into one window in the order nmt_model_backward adds them into the flat buffer, so a
   * sink receives the same sums (ZeRO stage 2 with one micro-batch: bitwise zero 0). */
  NMT_TRY(dest_open(m, d, embed, &E));
  NMT_TRY(generator_proj_bwd(m, params, E, g, B * Tt));
  NMT_TRY(dest_open(m, d, stage, &G));
  if (cfg->norm == NMT_NORM_PRE) NMT_TRY(final_ln_bwd(m, params, G, &m->dec_ln, &g, &t, B * Tt));
  NMT_TRY(dest_close(m, d, stage, m->ready_after[stage]));
  stage++;

  /* d_enc: zeroed for the cross-attentions to add into; on the half-storage path the first
   * of them writes it (and a model without decoder layers zeroes it below). */
  if (!cfg->act_half) NMT_TRY(be->memset_zero(ctx, d_enc, (size_t)B * Ts * C * sizeof(float)));
  m->d_enc_written = 0;
  for (int l = cfg->dec_layers - 1; l >= 0; l--, stage++) {
    NMT_TRY(dest_open(m, d, stage, &G));
    NMT_TRY(recompute_layer(m, params, &m->dec[3 * l], 3, &ps));
    for (int k = 2; k >= 0; k--)
      NMT_TRY(sub_bwd(m, params, G, &m->dec[3 * l + k], &g, &t, d_enc, &ps));
    NMT_TRY(dest_close(m, d, stage, m->ready_after[stage]));
  }
  NMT_TRY(embed_bwd(m, E, g, b->tgt_in, &ps, 1));
  if (cfg->act_half && !m->d_enc_written)
    NMT_TRY(be->memset_zero(ctx, d_enc, (size_t)B * Ts * C * sizeof(float)));

  /* Encoder: its output's gradient is what the cross-attentions accumulated. */
  ps.T = Ts;
  ps.lens = b->src_lens;
  float *spare = g;
  g = d_enc;
  t = spare;
  NMT_TRY(dest_open(m, d, stage, &G));
  if (cfg->norm == NMT_NORM_PRE) NMT_TRY(final_ln_bwd(m, params, G, &m->enc_ln, &g, &t, B * Ts));
  NMT_TRY(dest_close(m, d, stage, m->ready_after[stage]));
  stage++;
  for (int l = cfg->enc_layers - 1; l >= 0; l--, stage++) {
    NMT_TRY(dest_open(m, d, stage, &G));
    NMT_TRY(recompute_layer(m, params, &m->enc[2 * l], 2, &ps));
    for (int k = 1; k >= 0; k--)
      NMT_TRY(sub_bwd(m, params, G, &m->enc[2 * l + k], &g, &t, NULL, &ps));
    NMT_TRY(dest_close(m, d, stage, m->ready_after[stage]));
  }
  NMT_TRY(embed_bwd(m, E, g, b->src, &ps, 0));
  /* The trailing slots were written by the forward, so everything is final now. */
  NMT_TRY(dest_close(m, d, embed, m->n_params + NMT_GRAD_EXTRA));
  m->fwd_train = 0; /* the logits no longer hold a gradient for this batch's forward */
  return NMT_OK;
}

static nmt_status backward_counted(nmt_model *m, const float *params, const nmt_batch *b,
                                   dest *d) {
  nmt_backend_counters c0;
  const int counting = nmt__model_prof_counts(m, &c0);
  NMT_TRY(backward_ops(m, params, b, d));
  if (counting) nmt__model_prof_report(m, NMT_PROF_BWD, &c0);
  return NMT_OK;
}

nmt_status nmt_model_backward(nmt_model *m, const float *params, float *grads, const nmt_batch *b,
                              nmt_grad_ready_fn ready, void *user) {
  dest d = {.flat = grads, .ready = ready, .user = user};
  return backward_counted(m, params, b, &d);
}

nmt_status nmt_model_backward_sink(nmt_model *m, const float *params, const nmt_batch *b,
                                   const nmt_grad_sink *sink) {
  if (!sink || !sink->open || !sink->close)
    return nmt_errorf(NMT_ERR_INTERNAL, "model: backward with a gradient sink lacking open or "
                      "close");
  dest d = {.sink = sink};
  return backward_counted(m, params, b, &d);
}
