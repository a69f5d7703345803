/* half_backward.c — the backward pass on the half-storage path (cfg.act_half; half_forward.c
 * has the forward and the storage of each tensor): backward.c's pieces, which it calls in
 * place of its own ops, inside its stages and profiler ranges.
 *
 * Gradients: every activation gradient that feeds a GEMM is written once in the half type by
 * the op that produces it (d S(x) by the residual op or the dropout, d att and d hidden by a
 * GEMM, d qkv by attention, the logits' gradient by the classifier), so nothing is zeroed
 * first; the residual stream's gradients (g, t, d_enc) stay fp32, each written by its first
 * writer (the generator's GEMM, the residual op, the LN backward, a sublayer's first input
 * GEMM, the first cross-attention for d_enc) and added to by the rest (GEMMs with beta = 1).
 * Parameter gradients accumulate (+=) in fp32 as on the fp32 path. The FFN's ReLU backward
 * rides on fc2's input-gradient GEMM (linear_half_bwd with relu_out = the saved hidden, which
 * also undoes its dropout: kept-and-active is hidden > 0), and every bias gradient on its
 * layer's weight-gradient GEMM. */
#include <math.h>
#include <stdint.h>

#include "nmt/model.h"
#include "nmt/rng.h"
#include "model_impl.h"

/* S's backward from dout = d S(x) (rows, C half), the gradient of its input delivered into dx
 * (fp32) by the sublayer's first input GEMM as `first` and added by the others. */
static nmt_status sub_compute_bwd(nmt_model *m, const float *P, nmt__grad_win G, sublayer *s,
                                  const nmt_act *dout, nmt_dinp_mode first, float *dx,
                                  float *d_enc, const pass *ps) {
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int C = m->cfg.d_model, F = m->cfg.d_ff, H = m->cfg.n_heads, dk = C / H;
  const int rows = ps->B * ps->T;
  if (s->kind == SUB_FFN) {
    const float pr = m->cfg.relu_dropout;
    /* The same fp32 scale as the dropout op's (include/nmt/ref.h). */
    const float scale = pr > 0 ? 1.0f / (1.0f - pr) : 1.0f;
    NMT_TRY(be->linear_half_bwd(ctx, m->dh_h, NMT_DINP_HALF, nmt__grad_at(G, s->w2),
                                nmt__grad_at(G, s->b2), dout, s->h_h, P + s->w2, s->h_h,
                                s->mask_written && pr == 0 ? s->relu_mask : NULL, scale, rows,
                                F, C));
    return be->linear_half_bwd(ctx, dx, first, nmt__grad_at(G, s->w1), nmt__grad_at(G, s->b1),
                               m->dh_h, s->in_h, P + s->w1, NULL, NULL, 1.0f, rows, C, F);
  }
  const float pa = m->cfg.attn_dropout;
  const uint64_t stream = nmt_rng_stream(ps->step, s->site + PLACE_ATTN);
  NMT_TRY(be->linear_half_bwd(ctx, m->datt_h, NMT_DINP_HALF, nmt__grad_at(G, s->w2),
                              nmt__grad_at(G, s->b2), dout, s->att_h, P + s->w2, NULL, NULL, 1.0f,
                              rows, C, C));
  const size_t NC = (size_t)m->max_tokens * C;
  if (s->kind == SUB_SELF && m->cfg.qkv_streams) {
    const nmt_act *q = s->proj_h, *k = q + NC, *v = k + NC;
    nmt_act *dq = m->dproj_h, *dkey = dq + NC, *dv = dkey + NC;
    if (m->cfg.fused_attention) {
      const nmt_attn_args a = nmt__attn_args(m, q, C, k, v, C, ps->lens, ps->B, ps->T, ps->T,
                                             s->causal, pa, ps->seed, stream, 1);
      NMT_TRY(be->attention_fused_bwd(ctx, dq, dkey, dv, m->d_row, m->datt_h, s->att_h, s->lse,
                                      &a));
    } else {
      NMT_TRY(be->attention_half_bwd(ctx, dq, dkey, dv, m->d_probs, m->datt_h, s->probs, q, C, k,
                                     v, C, ps->lens, ps->B, ps->T, ps->T, H, dk, s->causal, pa,
                                     ps->seed, stream));
    }
    return nmt__model_qkv_streams_half_bwd(m, P, s, s->in_h, G, m->dproj_h, dx, first, rows);
  }
  if (s->kind == SUB_SELF) {
    if (m->cfg.fused_attention) {
      const nmt_attn_args a = nmt__attn_args(m, s->proj_h, 3 * C, s->proj_h + C, s->proj_h + 2 * C,
                                             3 * C, ps->lens, ps->B, ps->T, ps->T, s->causal, pa,
                                             ps->seed, stream, 1);
      NMT_TRY(be->attention_fused_bwd(ctx, m->dproj_h, m->dproj_h + C, m->dproj_h + 2 * C,
                                      m->d_row, m->datt_h, s->att_h, s->lse, &a));
    } else {
      NMT_TRY(be->attention_half_bwd(ctx, m->dproj_h, m->dproj_h + C, m->dproj_h + 2 * C,
                                     m->d_probs, m->datt_h, s->probs, s->proj_h, 3 * C,
                                     s->proj_h + C, s->proj_h + 2 * C, 3 * C, ps->lens, ps->B,
                                     ps->T, ps->T, H, dk, s->causal, pa, ps->seed, stream));
    }
    return be->linear_half_bwd(ctx, dx, first, nmt__grad_at(G, s->w1), nmt__grad_at(G, s->b1),
                               m->dproj_h, s->in_h, P + s->w1, NULL, NULL, 1.0f, rows, C, 3 * C);
  }
  const int src_rows = ps->B * ps->Ts;
  nmt_act *dq = m->dproj_h, *dkv = m->dproj_h + NC;
  if (m->cfg.fused_attention) {
    const nmt_attn_args a = nmt__attn_args(m, s->proj_h, C, s->kv_h, s->kv_h + C, 2 * C,
                                           ps->src_lens, ps->B, ps->T, ps->Ts, 0, pa, ps->seed,
                                           stream, 1);
    NMT_TRY(be->attention_fused_bwd(ctx, dq, dkv, dkv + C, m->d_row, m->datt_h, s->att_h, s->lse,
                                    &a));
  } else {
    NMT_TRY(be->attention_half_bwd(ctx, dq, dkv, dkv + C, m->d_probs, m->datt_h, s->probs,
                                   s->proj_h, C, s->kv_h, s->kv_h + C, 2 * C, ps->src_lens, ps->B,
                                   ps->T, ps->Ts, H, dk, 0, pa, ps->seed, stream));
  }
  /* d_enc: the first cross-attention of the backward (the last decoder layer's) writes it. */
  NMT_TRY(be->linear_half_bwd(ctx, d_enc, m->d_enc_written ? NMT_DINP_F32_ADD : NMT_DINP_F32,
                              nmt__grad_at(G, s->w1), nmt__grad_at(G, s->b1), dkv, m->enc_out_h,
                              P + s->w1, NULL, NULL, 1.0f, src_rows, C, 2 * C));
  m->d_enc_written = 1;
  return be->linear_half_bwd(ctx, dx, first, nmt__grad_at(G, s->wq), nmt__grad_at(G, s->bq), dq,
                             s->in_h, P + s->wq, NULL, NULL, 1.0f, rows, C, C);
}

nmt_status nmt__half_sub_bwd(nmt_model *m, const float *P, nmt__grad_win G, sublayer *s,
                             float **g, float **t, float *d_enc, const pass *ps) {
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int C = m->cfg.d_model;
  const int rows = ps->B * ps->T;
  const size_t n = (size_t)rows * C;
  const float pd = m->cfg.dropout;
  const uint64_t stream = nmt_rng_stream(ps->step, s->site + PLACE_OUT);
  if (m->cfg.norm == NMT_NORM_POST) {
    /* dr = LN'(dout) (written), dy = dropout'(dr) in half; then S' adds into dr. */
    float *dr = *t;
    NMT_TRY(be->residual_ln_half_bwd(ctx, dr, m->dy_h, nmt__grad_at(G, s->ln_w),
                                     nmt__grad_at(G, s->ln_b), *g, s->aux, P + s->ln_w, s->mean,
                                     s->rstd, rows, C, pd, ps->seed, stream));
    NMT_TRY(sub_compute_bwd(m, P, G, s, m->dy_h, NMT_DINP_F32_ADD, dr, d_enc, ps));
    *t = *g;
    *g = dr;
    return NMT_OK;
  }
  /* pre-LN: dx = dout + LN'(S'(dropout'(dout))). dropout'(dout) in half: with dropout the
   * dropout op writes it; without, it is the half copy the LN backward that wrote dout made. */
  const nmt_act *dout = m->g_h;
  if (pd > 0) {
    NMT_TRY(be->dropout_half(ctx, m->dy_h, *g, 1, n, pd, ps->seed, stream));
    dout = m->dy_h;
  }
  float *dn = *t;
  NMT_TRY(sub_compute_bwd(m, P, G, s, dout, NMT_DINP_F32, dn, d_enc, ps));
  return be->layernorm_half_bwd(ctx, *g, 1, pd > 0 ? NULL : m->g_h, nmt__grad_at(G, s->ln_w),
                                nmt__grad_at(G, s->ln_b), dn, s->in, P + s->ln_w, s->mean,
                                s->rstd, rows, C);
}

nmt_status nmt__half_final_ln_bwd(nmt_model *m, const float *P, nmt__grad_win G, final_ln *f,
                                  float **g, float **t, int rows) {
  NMT_TRY(m->be->layernorm_half_bwd(m->ctx, *t, 0, m->cfg.dropout > 0 ? NULL : m->g_h,
                                    nmt__grad_at(G, f->w), nmt__grad_at(G, f->b), *g, f->in,
                                    P + f->w, f->mean, f->rstd, rows, m->cfg.d_model));
  float *tmp = *g;
  *g = *t;
  *t = tmp;
  return NMT_OK;
}

nmt_status nmt__half_generator_bwd(nmt_model *m, const float *P, nmt__grad_win G, float *g,
                                   int rows) {
  /* The logits hold the classifier's gradient (half) since the forward. */
  return m->be->linear_half_bwd(m->ctx, g, NMT_DINP_F32, nmt__grad_at(G, m->embed_off), NULL,
                                m->logits_h, m->dec_out_h, P + m->embed_off, NULL, NULL, 1.0f,
                                rows, m->cfg.d_model, m->cfg.vocab);
}

nmt_status nmt__half_embed_bwd(nmt_model *m, nmt__grad_win G, const float *dout,
                               const int32_t *ids, const pass *ps, uint32_t place) {
  const int C = m->cfg.d_model;
  const int rows = ps->B * ps->T;
  const float pd = m->cfg.dropout;
  if (pd > 0) {
    /* dropout' written (the forward's formula and mask): no zeroed buffer to add into. */
    NMT_TRY(m->be->dropout_fwd(m->ctx, m->d_drop, dout, (size_t)rows * C, pd, ps->seed,
                               nmt_rng_stream(ps->step, (uint32_t)STACK_EMBED << 20 | place)));
    dout = m->d_drop;
  }
  return m->be->embedding_bwd(m->ctx, nmt__grad_at(G, m->embed_off), dout, ids, rows, C,
                              sqrtf((float)C));
}
