/* qkv_streams.c — the self-attention Q/K/V projections as three GEMMs on three streams
 * (cfg.qkv_streams, parallel.qkv = streams), for forward.c and backward.c.
 *
 * The fused (3C, C) weight's row blocks W_q, W_k, W_v are three (C, C) GEMMs into separate
 * (rows, C) buffers, forked onto streams 0, 1, 2 of the backend's pool and joined before
 * attention reads them. Backward: attention writes dq, dk, dv into separate buffers; the three
 * weight/bias gradients (disjoint slices of the gradient buffer) go to the three streams, and
 * the three input-gradient GEMMs, which accumulate into one buffer, follow each other on
 * stream 0. A backend without stream_fork runs all of it in turn on its one stream. */
#include "model_impl.h"

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
  nmt__grad_win G;   /* backward: the stage's gradient window */
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
nmt_status nmt__model_qkv_streams_fwd(nmt_model *m, const float *P, const sublayer *s,
                                       const float *x, int rows) {
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
  NMT_TRY(be->matmul_bwd(m->ctx, NULL, nmt__grad_at(a->G, w), nmt__grad_at(a->G, b),
                         a->dqkv + i * NC, a->x, a->P + w, a->rows, C, C));
  if (i != 0) return NMT_OK;
  for (int j = 0; j < 3; j++)
    NMT_TRY(be->matmul_bwd(m->ctx, a->dx, NULL, NULL, a->dqkv + j * NC, a->x,
                           a->P + a->s->w1 + (size_t)j * C * C, a->rows, C, C));
  return NMT_OK;
}

nmt_status nmt__model_qkv_streams_bwd(nmt_model *m, const float *P, const sublayer *s,
                                       const float *x, nmt__grad_win G, const float *dqkv,
                                       float *dx, int rows) {
  qkv_args a = {.s = s, .P = P, .x = x, .G = G, .dqkv = dqkv, .dx = dx, .rows = rows};
  return on_three_streams(m, qkv_bwd_one, &a);
}

/* ---- the half-storage path (cfg.act_half): the same split on half tensors ---- */

typedef struct {
  const sublayer *s;
  const float *P;
  const nmt_act *in_h;  /* the GEMMs' input (rows, C) */
  nmt__grad_win G;      /* backward: the stage's gradient window */
  const nmt_act *dqkv;  /* backward: dq, dk, dv at dqkv + i*max_tokens*C */
  float *dx;            /* backward: input gradient (stream 0 only) */
  nmt_dinp_mode first;  /* backward: how the first of the three delivers into dx */
  int rows;
} qkv_half_args;

static nmt_status qkv_half_fwd_one(nmt_model *m, int i, void *arg) {
  const qkv_half_args *a = arg;
  const int C = m->cfg.d_model;
  const size_t blk = (size_t)i * C;
  return m->be->linear_half_fwd(m->ctx, a->s->proj_h + (size_t)i * m->max_tokens * C, a->in_h,
                                a->P + a->s->w1 + blk * C, a->P + a->s->b1 + blk, a->rows, C, C,
                                0, NULL, NULL, 1, 0, 0);
}

nmt_status nmt__model_qkv_streams_half_fwd(nmt_model *m, const float *P, const sublayer *s,
                                            const nmt_act *in_h, int rows) {
  qkv_half_args a = {.s = s, .P = P, .in_h = in_h, .rows = rows};
  return on_three_streams(m, qkv_half_fwd_one, &a);
}

static nmt_status qkv_half_bwd_one(nmt_model *m, int i, void *arg) {
  const qkv_half_args *a = arg;
  const nmt_backend *be = m->be;
  const int C = m->cfg.d_model;
  const size_t NC = (size_t)m->max_tokens * C;
  const size_t w = a->s->w1 + (size_t)i * C * C, b = a->s->b1 + (size_t)i * C;
  NMT_TRY(be->linear_half_bwd(m->ctx, NULL, NMT_DINP_F32, nmt__grad_at(a->G, w),
                              nmt__grad_at(a->G, b), a->dqkv + i * NC, a->in_h, a->P + w, NULL,
                              NULL, 1.0f, a->rows, C, C));
  if (i != 0) return NMT_OK;
  for (int j = 0; j < 3; j++)
    NMT_TRY(be->linear_half_bwd(m->ctx, a->dx, j == 0 ? a->first : NMT_DINP_F32_ADD, NULL, NULL,
                                a->dqkv + j * NC, a->in_h, a->P + a->s->w1 + (size_t)j * C * C,
                                NULL, NULL, 1.0f, a->rows, C, C));
  return NMT_OK;
}

nmt_status nmt__model_qkv_streams_half_bwd(nmt_model *m, const float *P, const sublayer *s,
                                            const nmt_act *in_h, nmt__grad_win G,
                                            const nmt_act *dqkv_h, float *dx,
                                            nmt_dinp_mode first, int rows) {
  qkv_half_args a = {.s = s, .P = P, .in_h = in_h, .G = G, .dqkv = dqkv_h, .dx = dx,
                     .first = first, .rows = rows};
  return on_three_streams(m, qkv_half_bwd_one, &a);
}
