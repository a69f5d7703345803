/* half_forward.c — the forward pass on the half-storage path (cfg.act_half, precision.activations
 * = half in fp16/bf16; docs/cuda.md "Precision"): forward.c's pieces with every tensor that feeds
 * a GEMM in the context's half type, written by the op that produces it (nmt/backend.h, "the
 * half-storage path"). forward.c calls these in place of its own ops, inside its profiler
 * ranges; the sublayer structure, dropout sites and streams are forward.c's.
 *
 * What each sublayer reads and writes (post-LN, LN(x + Dropout(S(x))); T = the half type):
 *   x (fp32, the residual stream) and m->cur_h = round(x) (T): written by the previous
 *     sublayer's residual op, or by the embedding;
 *   S(x) from cur_h: SELF qkv (T) = linear(cur_h), att (T) = attention(qkv), o (T) = linear(att);
 *     CROSS q (T) = linear(cur_h), K/V (T) of every layer projected once from the encoder
 *     output (nmt__half_cross_kv_fwd), att, o as SELF; FFN h (T) = relu(linear(cur_h)), its
 *     dropout in place, o (T) = linear(h);
 *   residual_ln_half_fwd: sum (fp32, saved for backward) = x + dropout(o), out (fp32) = LN(sum)
 *     and out_h = round(out), the next sublayer's cur_h.
 * pre-LN, x + Dropout(S(LN(x))): aux_h (T) = LN(x) is S's input, and the residual op writes the
 * fp32 output only; each stack's final LN writes its output in T only (the cross K/V and the
 * generator read nothing else). The generator writes the logits in T and the classifier's
 * gradient replaces them in T (xent_half_fwd_bwd). */
#include <math.h>
#include <stdint.h>

#include "nmt/model.h"
#include "nmt/rng.h"
#include "model_impl.h"

nmt_status nmt__half_embed_fwd(nmt_model *m, const float *P, float *out, nmt_act *out_h,
                               const int32_t *ids, const pass *ps, uint32_t place) {
  const int C = m->cfg.d_model;
  const int rows = ps->B * ps->T;
  const float pd = nmt__pass_dropout(ps, m->cfg.dropout);
  NMT_TRY(m->be->embedding_half_fwd(m->ctx, out, out_h, ids, P + m->embed_off, m->pe, rows, ps->T,
                                    C, sqrtf((float)C), pd, ps->seed,
                                    nmt_rng_stream(ps->step, (uint32_t)STACK_EMBED << 20 | place)));
  m->cur_h = out_h;
  return NMT_OK;
}

/* S(in_h) into m->dy_h (rows, C), the residual op's y. */
static nmt_status sub_compute(nmt_model *m, const float *P, sublayer *s, const nmt_act *in_h,
                              const pass *ps) {
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int C = m->cfg.d_model, F = m->cfg.d_ff, H = m->cfg.n_heads, dk = C / H;
  const int rows = ps->B * ps->T;
  nmt_act *o = m->dy_h; /* free during forward: the residual op reads it once */
  s->in_h = in_h;
  if (s->kind == SUB_FFN) {
    const float pr = nmt__pass_dropout(ps, m->cfg.relu_dropout);
    /* The ReLU mask serves the backward only without a dropout after the ReLU (it cannot see
     * one); with one, the saved hidden (> 0: kept and active) is what the backward reads. */
    s->mask_written = 0;
    NMT_TRY(be->linear_half_fwd(ctx, s->h_h, in_h, P + s->w1, P + s->b1, rows, C, F, 1,
                                m->cfg.relu_dropout > 0 ? NULL : s->relu_mask,
                                &s->mask_written, 1, 0, 0));
    if (pr > 0)
      NMT_TRY(be->dropout_half(ctx, s->h_h, s->h_h, 0, (size_t)rows * F, pr, ps->seed,
                               nmt_rng_stream(ps->step, s->site + PLACE_RELU)));
    return be->linear_half_fwd(ctx, o, s->h_h, P + s->w2, P + s->b2, rows, F, C, 0, NULL, NULL, 1,
                               0, 0);
  }
  const float pa = nmt__pass_dropout(ps, m->cfg.attn_dropout);
  const uint64_t stream = nmt_rng_stream(ps->step, s->site + PLACE_ATTN);
  if (s->kind == SUB_SELF) {
    const nmt_act *q, *k, *v;
    int ld;
    if (m->cfg.qkv_streams) {
      const size_t NC = (size_t)m->max_tokens * C;
      NMT_TRY(nmt__model_qkv_streams_half_fwd(m, P, s, in_h, rows));
      q = s->proj_h, k = q + NC, v = k + NC, ld = C;
    } else {
      NMT_TRY(be->linear_half_fwd(ctx, s->proj_h, in_h, P + s->w1, P + s->b1, rows, C, 3 * C, 0,
                                  NULL, NULL, 1, 0, 0));
      q = s->proj_h, k = s->proj_h + C, v = s->proj_h + 2 * C, ld = 3 * C;
    }
    if (m->cfg.fused_attention) {
      const nmt_attn_args a = nmt__attn_args(m, q, ld, k, v, ld, ps->lens, ps->B, ps->T, ps->T,
                                             s->causal, pa, ps->seed, stream, 1);
      NMT_TRY(be->attention_fused_fwd(ctx, s->att_h, s->lse, &a));
    } else {
      NMT_TRY(be->attention_half_fwd(ctx, s->att_h, s->probs, q, ld, k, v, ld, ps->lens, ps->B,
                                     ps->T, ps->T, H, dk, s->causal, pa, ps->seed, stream));
    }
  } else {
    NMT_TRY(be->linear_half_fwd(ctx, s->proj_h, in_h, P + s->wq, P + s->bq, rows, C, C, 0, NULL,
                                NULL, 1, 0, 0));
    if (m->cfg.fused_attention) {
      const nmt_attn_args a = nmt__attn_args(m, s->proj_h, C, s->kv_h, s->kv_h + C, 2 * C,
                                             ps->src_lens, ps->B, ps->T, ps->Ts, 0, pa, ps->seed,
                                             stream, 1);
      NMT_TRY(be->attention_fused_fwd(ctx, s->att_h, s->lse, &a));
    } else {
      NMT_TRY(be->attention_half_fwd(ctx, s->att_h, s->probs, s->proj_h, C, s->kv_h, s->kv_h + C,
                                     2 * C, ps->src_lens, ps->B, ps->T, ps->Ts, H, dk, 0, pa,
                                     ps->seed, stream));
    }
  }
  return be->linear_half_fwd(ctx, o, s->att_h, P + s->w2, P + s->b2, rows, C, C, 0, NULL, NULL, 1,
                             0, 0);
}

nmt_status nmt__half_sub_fwd(nmt_model *m, const float *P, sublayer *s, const float *x,
                             const pass *ps) {
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int C = m->cfg.d_model;
  const int rows = ps->B * ps->T;
  const float pd = nmt__pass_dropout(ps, m->cfg.dropout);
  const uint64_t stream = nmt_rng_stream(ps->step, s->site + PLACE_OUT);
  s->in = x;
  if (m->cfg.norm == NMT_NORM_POST) {
    if (!m->cur_h)
      return nmt_errorf(NMT_ERR_INTERNAL, "model: %s has no half copy of its input",
                        s->prof_name);
    NMT_TRY(sub_compute(m, P, s, m->cur_h, ps));
    NMT_TRY(be->residual_ln_half_fwd(ctx, s->out, s->out_h, s->aux, s->mean, s->rstd, x, m->dy_h,
                                     P + s->ln_w, P + s->ln_b, rows, C, m->cfg.ln_eps, pd,
                                     ps->seed, stream));
    m->cur_h = s->out_h;
  } else {
    NMT_TRY(be->layernorm_half_fwd(ctx, s->aux_h, s->mean, s->rstd, x, P + s->ln_w, P + s->ln_b,
                                   rows, C, m->cfg.ln_eps));
    NMT_TRY(sub_compute(m, P, s, s->aux_h, ps));
    NMT_TRY(be->residual_ln_half_fwd(ctx, NULL, NULL, s->out, NULL, NULL, x, m->dy_h, NULL, NULL,
                                     rows, C, m->cfg.ln_eps, pd, ps->seed, stream));
    m->cur_h = NULL;
  }
  return NMT_OK;
}

nmt_status nmt__half_final_ln_fwd(nmt_model *m, const float *P, final_ln *f, const float *x,
                                  int rows) {
  f->in = x;
  NMT_TRY(m->be->layernorm_half_fwd(m->ctx, f->out_h, f->mean, f->rstd, x, P + f->w, P + f->b,
                                    rows, m->cfg.d_model, m->cfg.ln_eps));
  m->cur_h = f->out_h;
  return NMT_OK;
}

nmt_status nmt__half_cross_kv_fwd(nmt_model *m, const float *P, const pass *ps) {
  const int C = m->cfg.d_model, L = m->cfg.dec_layers;
  const int src_rows = ps->B * ps->Ts;
  const size_t slot = (size_t)m->max_tokens * 2 * C; /* one layer's K/V in kv_h */
  if (L == 0) return NMT_OK;
  if (!m->enc_out_h)
    return nmt_errorf(NMT_ERR_INTERNAL, "model: no half copy of the encoder output");
  /* kv_h holds the layers in parameter order (L-1 first), so batch entry i is layer L-1-i. */
  for (int l = 0; l < L; l++) m->dec[3 * l + 1].kv_h = m->kv_h + (size_t)(L - 1 - l) * slot;
  const sublayer *first = &m->dec[3 * (L - 1) + 1];
  if (m->kv_stride)
    return m->be->linear_half_fwd(m->ctx, m->kv_h, m->enc_out_h, P + first->w1, P + first->b1,
                                  src_rows, C, 2 * C, 0, NULL, NULL, L, m->kv_stride, slot);
  for (int l = 0; l < L; l++) {
    const sublayer *s = &m->dec[3 * l + 1];
    NMT_TRY(m->be->linear_half_fwd(m->ctx, (nmt_act *)s->kv_h, m->enc_out_h, P + s->w1, P + s->b1,
                                   src_rows, C, 2 * C, 0, NULL, NULL, 1, 0, 0));
  }
  return NMT_OK;
}

nmt_status nmt__half_generator_fwd(nmt_model *m, const float *P, int rows) {
  if (!m->dec_out_h)
    return nmt_errorf(NMT_ERR_INTERNAL, "model: no half copy of the decoder output");
  return m->be->linear_half_fwd(m->ctx, m->logits_h, m->dec_out_h, P + m->embed_off, NULL, rows,
                                m->cfg.d_model, m->cfg.vocab, 0, NULL, NULL, 1, 0, 0);
}

nmt_status nmt__half_xent(nmt_model *m, const nmt_batch *b, int rows, int train,
                          float *grad_extra) {
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  NMT_TRY(be->xent_half_fwd_bwd(ctx, m->logits_h, m->losses, m->nll, b->tgt_out, rows,
                                m->cfg.vocab, m->cfg.label_smoothing,
                                train ? m->loss_scale : 1.0f, train ? m->loss_scale_dev : NULL,
                                train ? 1 : 0));
  NMT_TRY(be->sum_acc(ctx, grad_extra + NMT_GRAD_SLOT_LOSS, m->losses, (size_t)rows));
  NMT_TRY(be->sum_acc(ctx, grad_extra + NMT_GRAD_SLOT_NLL, m->nll, (size_t)rows));
  return be->count_targets(ctx, grad_extra + NMT_GRAD_SLOT_TOKENS, b->tgt_out, (size_t)rows);
}
