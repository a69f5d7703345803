/* forward.c — the forward pass of the Transformer (Vaswani et al. 2017 §3) as a sequence of
 * backend op calls: training forward with the loss (nmt_model_forward), eval logits
 * (nmt_model_logits) and the eval encoder decode.c starts from. The activations it writes are
 * laid out by transformer.c; backward.c reads them, and re-runs layers through
 * nmt__model_layer_fwd when checkpointing.
 *
 * Every layer is a list of sublayers (encoder: self-attention, FFN; decoder: causal
 * self-attention, cross-attention, FFN), each wrapped as
 *   post-LN (paper §3.1):  out = LN(x + Dropout(S(x)))
 *   pre-LN:                out = x + Dropout(S(LN(x)))      (+ a final LN per stack)
 * so one routine handles both variants and all three sublayer kinds. The residual connection,
 * its dropout and (post-LN) the LayerNorm are one backend op, residual_dropout_ln_fwd (one
 * pass over the rows instead of three; nmt/backend.h). Dropout streams are
 * nmt_rng_stream(step, site) with the sites of transformer.c's top comment. */
#include <math.h>
#include <stdint.h>

#include "nmt/model.h"
#include "nmt/rng.h"
#include "model_impl.h"

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
    float pr = nmt__pass_dropout(ps, m->cfg.relu_dropout);
    /* fc1 and the ReLU in one op: a device backend adds the bias and takes the ReLU in the
     * GEMM's epilogue (ref: the two calls, bitwise as before). */
    NMT_TRY(be->matmul_bias_relu_fwd(ctx, s->h, x, P + s->w1, P + s->b1, rows, C, F));
    if (pr > 0)
      NMT_TRY(be->dropout_fwd(ctx, s->h, s->h, (size_t)rows * F, pr, ps->seed,
                              nmt_rng_stream(ps->step, s->site + PLACE_RELU)));
    NMT_TRY(be->matmul_fwd(ctx, o, s->h, P + s->w2, P + s->b2, rows, F, C));
    return NMT_OK;
  }
  float pa = nmt__pass_dropout(ps, m->cfg.attn_dropout);
  uint64_t stream = nmt_rng_stream(ps->step, s->site + PLACE_ATTN);
  if (s->kind == SUB_SELF) {
    const float *q, *k, *v;
    int ld;
    if (m->cfg.qkv_streams) {
      NMT_TRY(nmt__model_qkv_streams_fwd(m, P, s, x, rows));
      q = s->proj, k = q + (size_t)m->max_tokens * C, v = k + (size_t)m->max_tokens * C, ld = C;
    } else {
      NMT_TRY(be->matmul_fwd(ctx, s->proj, x, P + s->w1, P + s->b1, rows, C, 3 * C));
      q = s->proj, k = s->proj + C, v = s->proj + 2 * C, ld = 3 * C;
    }
    if (m->cfg.fused_attention) {
      const nmt_attn_args a = nmt__attn_args(m, q, ld, k, v, ld, ps->lens, ps->B, ps->T, ps->T,
                                             s->causal, pa, ps->seed, stream, 0);
      NMT_TRY(be->attention_fused_fwd(ctx, s->att, s->lse, &a));
    } else {
      NMT_TRY(be->attention_fwd(ctx, s->att, s->probs, q, ld, k, v, ld, ps->lens, ps->B, ps->T,
                                ps->T, H, dk, s->causal, pa, ps->seed, stream));
    }
  } else {
    float *q = s->proj, *kv = s->proj + (size_t)m->max_tokens * C;
    NMT_TRY(be->matmul_fwd(ctx, q, x, P + s->wq, P + s->bq, rows, C, C));
    NMT_TRY(be->matmul_fwd(ctx, kv, ps->enc_out, P + s->w1, P + s->b1, ps->B * ps->Ts, C, 2 * C));
    if (m->cfg.fused_attention) {
      const nmt_attn_args a = nmt__attn_args(m, q, C, kv, kv + C, 2 * C, ps->src_lens, ps->B,
                                             ps->T, ps->Ts, 0, pa, ps->seed, stream, 0);
      NMT_TRY(be->attention_fused_fwd(ctx, s->att, s->lse, &a));
    } else {
      NMT_TRY(be->attention_fwd(ctx, s->att, s->probs, q, C, kv, kv + C, 2 * C, ps->src_lens,
                                ps->B, ps->T, ps->Ts, H, dk, 0, pa, ps->seed, stream));
    }
  }
  NMT_TRY(be->matmul_fwd(ctx, o, s->att, P + s->w2, P + s->b2, rows, C, C));
  return NMT_OK;
}

static nmt_status sub_fwd_ops(nmt_model *m, const float *P, sublayer *s, const float *x,
                              const pass *ps) {
  if (m->cfg.act_half) return nmt__half_sub_fwd(m, P, s, x, ps);
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int C = m->cfg.d_model;
  const int rows = ps->B * ps->T;
  const float pd = nmt__pass_dropout(ps, m->cfg.dropout);
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

static nmt_status sub_fwd(nmt_model *m, const float *P, sublayer *s, const float *x,
                          const pass *ps) {
  if (!m->prof) return sub_fwd_ops(m, P, s, x, ps);
  nmt_prof_cost c = {0, 0};
  if (nmt__model_prof_costs(m)) c = nmt__model_sub_cost(m, s, ps, NMT_PROF_FWD);
  nmt__model_prof_push(m, s->prof_id, NMT_PROF_FWD, c);
  nmt_status st = sub_fwd_ops(m, P, s, x, ps);
  nmt_prof_pop(m->prof);
  return st;
}

static nmt_status embed_fwd_ops(nmt_model *m, const float *P, float *out, const int32_t *ids,
                                const pass *ps, uint32_t place) {
  if (m->cfg.act_half) {
    NMT_TRY(nmt__half_embed_fwd(m, P, out, place ? m->emb_tgt_h : m->emb_src_h, ids, ps, place));
    /* The decoder's: every layer's cross K/V of the encoder output too, inside this range. */
    return place ? nmt__half_cross_kv_fwd(m, P, ps) : NMT_OK;
  }
  const int C = m->cfg.d_model;
  const int rows = ps->B * ps->T;
  NMT_TRY(m->be->embedding_fwd(m->ctx, out, ids, P + m->embed_off, m->pe, rows, ps->T, C,
                               sqrtf((float)C)));
  float pd = nmt__pass_dropout(ps, m->cfg.dropout);
  if (pd > 0)
    NMT_TRY(m->be->dropout_fwd(m->ctx, out, out, (size_t)rows * C, pd, ps->seed,
                               nmt_rng_stream(ps->step, (uint32_t)STACK_EMBED << 20 | place)));
  return NMT_OK;
}

/* E[id] * sqrt(C) + PE, then dropout (§3.4, §3.5, §5.4). */
static nmt_status embed_fwd(nmt_model *m, const float *P, float *out, const int32_t *ids,
                            const pass *ps, uint32_t place) {
  if (!m->prof) return embed_fwd_ops(m, P, out, ids, ps, place);
  nmt_prof_cost c = {0, 0};
  if (nmt__model_prof_costs(m)) c = nmt__model_embed_cost(m, ps, NMT_PROF_FWD, place);
  nmt__model_prof_push(m, m->prof_ids[place ? MPROF_DEC_EMBED : MPROF_ENC_EMBED], NMT_PROF_FWD, c);
  nmt_status st = embed_fwd_ops(m, P, out, ids, ps, place);
  nmt_prof_pop(m->prof);
  return st;
}

static nmt_status final_ln_fwd(nmt_model *m, const float *P, final_ln *f, const float *x, int rows,
                               const float **out) {
  if (m->prof) {
    nmt_prof_cost c = {0, 0};
    if (nmt__model_prof_costs(m)) c = nmt__model_final_ln_cost(m, rows, NMT_PROF_FWD);
    nmt__model_prof_push(m, m->prof_ids[f == &m->enc_ln ? MPROF_ENC_LN : MPROF_DEC_LN],
                         NMT_PROF_FWD, c);
  }
  f->in = x;
  nmt_status st = m->cfg.act_half
                      ? nmt__half_final_ln_fwd(m, P, f, x, rows)
                      : m->be->layernorm_fwd(m->ctx, f->out, f->mean, f->rstd, x, P + f->w,
                                             P + f->b, rows, m->cfg.d_model, m->cfg.ln_eps);
  nmt_prof_pop(m->prof);
  NMT_TRY(st);
  *out = f->out; /* NULL on the half-storage path: its output is f->out_h alone */
  return NMT_OK;
}

/* One encoder (n = 2) or decoder (n = 3) layer, sublayers s[0..n), on input x; returns the
 * layer's output (s[n-1].out, kept per layer also with checkpointing). Backward re-runs it
 * from s[0].in when checkpointing. */
nmt_status nmt__model_layer_fwd(nmt_model *m, const float *P, sublayer *s, int n, const float *x,
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
    NMT_TRY(nmt__model_layer_fwd(m, P, &m->enc[2 * l], 2, x, &ps, &x));
  if (m->cfg.norm == NMT_NORM_PRE) NMT_TRY(final_ln_fwd(m, P, &m->enc_ln, x, ps.B * ps.T, &x));
  m->enc_out = x;
  m->enc_out_h = m->cur_h; /* half storage: the output's half copy (NULL otherwise) */
  return NMT_OK;
}

/* Decoder over tgt_in (B, Tt) attending to m->enc_out; sets m->dec_out. */
static nmt_status decode(nmt_model *m, const float *P, const int32_t *tgt_in, pass ps) {
  const float *x = m->emb_tgt;
  NMT_TRY(embed_fwd(m, P, m->emb_tgt, tgt_in, &ps, 1));
  for (int l = 0; l < m->cfg.dec_layers; l++)
    NMT_TRY(nmt__model_layer_fwd(m, P, &m->dec[3 * l], 3, x, &ps, &x));
  if (m->cfg.norm == NMT_NORM_PRE) NMT_TRY(final_ln_fwd(m, P, &m->dec_ln, x, ps.B * ps.T, &x));
  m->dec_out = x;
  m->dec_out_h = m->cur_h;
  return NMT_OK;
}

nmt_status nmt__model_encode_eval(nmt_model *m, const float *params, const nmt_batch *b) {
  if (m->cfg.act_half)
    return nmt_errorf(NMT_ERR_USAGE, "model: incremental decoding needs fp32 activations "
                      "(nmt_model_cfg.act_half = 0)");
  NMT_TRY(nmt__model_check_shape(m, b->n_sent, b->src_len, "source"));
  m->fwd_train = 0;
  pass ps = {.B = b->n_sent, .T = b->src_len, .Ts = b->src_len, .lens = b->src_lens,
             .src_lens = b->src_lens};
  return encode(m, params, b->src, ps);
}

/* Output projection with the shared embedding (§3.4): logits = h E^T, rows = B*Tt. */
static nmt_status generator_proj(nmt_model *m, const float *params, int rows) {
  const int C = m->cfg.d_model, V = m->cfg.vocab;
  if (m->prof) {
    nmt_prof_cost c = {0, 0};
    if (nmt__model_prof_costs(m)) c = nmt__model_proj_cost(m, rows, NMT_PROF_FWD);
    nmt__model_prof_push(m, m->prof_ids[MPROF_PROJ], NMT_PROF_FWD, c);
  }
  nmt_status st =
      m->cfg.act_half
          ? nmt__half_generator_fwd(m, params, rows)
          : m->be->matmul_fwd(m->ctx, m->logits, m->dec_out, params + m->embed_off, NULL, rows, C,
                              V);
  nmt_prof_pop(m->prof);
  return st;
}

/* Label-smoothed loss of the logits (and their gradient in place when training), summed into
 * grad_extra with the token count. */
static nmt_status generator_xent_ops(nmt_model *m, const nmt_batch *b, int rows, int train,
                                     float *grad_extra) {
  if (m->cfg.act_half) return nmt__half_xent(m, b, rows, train, grad_extra);
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
  if (nmt__model_prof_costs(m)) c = nmt__model_xent_cost(m, rows);
  nmt__model_prof_push(m, m->prof_ids[MPROF_XENT], NMT_PROF_FWD, c);
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
  nmt_backend_counters c0;
  const int counting = train && nmt__model_prof_counts(m, &c0);

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

  if (counting) nmt__model_prof_report(m, NMT_PROF_FWD, &c0);
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
  if (m->cfg.act_half)
    return nmt_errorf(NMT_ERR_USAGE, "model: nmt_model_logits needs fp32 activations "
                      "(nmt_model_cfg.act_half = 0; this model's logits are half)");
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
