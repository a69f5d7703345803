/* decode.c — incremental decoding of the Transformer decoder (Vaswani et al. 2017 §3.1, §3.2.3)
 * and greedy and beam search (§6.1) on top of it.
 *
 * Caches. Decoding feeds one new position per hypothesis per step. Position t of a decoder
 * layer needs (a) the keys/values of its self-attention at positions 0..t of the same
 * hypothesis and (b) the cross-attention keys/values of the source, which never change. So:
 *   cross_kv[l]  (n_act*Ts, 2C)     kv projection of the encoder output, computed once per
 *                                   batch; rows of finished sentences are dropped (compaction)
 *   self_kv[l]   (rows*t, 2C)       [K|V] of positions 0..t-1 of every row, row r's position j
 *                                   at r*t + j: a compact (B=rows, Tk=t) layout, exactly what
 *                                   the attention op reads with ldkv = 2C.
 * At step t each layer projects the new position's K|V (rows, 2C) into the free space after
 * the cache, then one gather builds the (rows, t+1) layout from it: row r's positions j < t
 * come from its parent row (beam search reorders hypotheses), position t is the new row. The
 * gather is the backend's embedding op with scale 1 and a zero position row
 * (out[i] = 1 * src[idx[i]] + 0, exact in fp32), on rows of width C (K and V halves), so any
 * backend runs it. The layout is rebuilt each step, which costs O(rows * t * C) per layer —
 * the same order as the attention itself — and keeps the attention free of masked keys.
 * Out-of-place gathers need a second buffer: one spare shared by all layers, swapped with
 * each layer's buffer after its gather.
 *
 * Rows of one sentence are adjacent (row = a*beam + j), so the cross-attention is one call
 * with B = active sentences and Tq = beam queries per sentence: no per-hypothesis copy of the
 * source keys. Self-attention is B = rows, Tq = 1, Tk = t+1, no mask needed.
 *
 * Memory (floats) for R = n_sent*beam rows, S = max_steps, Ts = source length, L layers:
 *   (L+1) * R*S*2C self caches + (L+1) * n_sent*Ts*2C cross caches
 *   + R*(5C + F + V + 2 + H*max(S,Ts)) per-step activations; grown on demand, kept between
 *   batches. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model_impl.h"
#include "nmt/config.h"
#include "nmt/model.h"

struct nmt_decoder {
  nmt_model *m;
  /* device arena and the sizes it was carved for */
  void *arena;
  int cap_rows, cap_steps, cap_src_rows, cap_sent;
  float **self_kv, **cross_kv; /* dec_layers pointers each, into the arena */
  float *self_spare, *cross_spare;
  float *x, *y, *o, *att, *q, *h, *mean, *rstd, *logits, *probs, *zero;
  /* per-step uploads in one block, so a step costs one host-to-device copy:
   * up = [ids (cap_rows) | klen_self (cap_rows) | gidx (cap_rows*cap_steps*2)] */
  int32_t *up, *ids, *klen_self, *gidx;
  int32_t *klen_cross, *cidx, *amax;
  /* host scratch; separate arrays per upload, so that no host buffer is rewritten while a
   * copy from it may still be pending on an asynchronous backend */
  int32_t *h_up, *h_cidx, *h_klen_cross, *h_src_lens, *h_act;
  /* batch state */
  int B, Ts, beam, max_steps;
  int t;            /* steps taken */
  int n_act, rows;  /* layout of the last step (or of begin) */
};

/* ------------------------------------------------------------------------------------------ */
/* allocation */

static size_t up_ints(int rows, int steps) { return (size_t)rows * (2 + (size_t)steps * 2); }

/* The caches and step buffers, in one arena (arena.c). */
static void carve_all(void *obj, nmt__arena *a) {
  nmt_decoder *d = obj;
  const nmt_model_cfg *cfg = &d->m->cfg;
  const size_t R = (size_t)d->cap_rows, S = (size_t)d->cap_steps, SR = (size_t)d->cap_src_rows;
  const size_t C = (size_t)cfg->d_model, F = (size_t)cfg->d_ff, H = (size_t)cfg->n_heads;
  const size_t V = (size_t)cfg->vocab;
  const size_t keys = S > SR ? S : SR; /* a cross-attention row has at most Ts <= SR keys */
  for (int l = 0; l < cfg->dec_layers; l++) {
    d->self_kv[l] = nmt__arena_floats(a, R * S * 2 * C);
    d->cross_kv[l] = nmt__arena_floats(a, SR * 2 * C);
  }
  d->self_spare = nmt__arena_floats(a, R * S * 2 * C);
  d->cross_spare = nmt__arena_floats(a, SR * 2 * C);
  d->x = nmt__arena_floats(a, R * C);
  d->y = nmt__arena_floats(a, R * C);
  d->o = nmt__arena_floats(a, R * C);
  d->att = nmt__arena_floats(a, R * C);
  d->q = nmt__arena_floats(a, R * C);
  d->h = nmt__arena_floats(a, R * F);
  d->mean = nmt__arena_floats(a, R);
  d->rstd = nmt__arena_floats(a, R);
  d->logits = nmt__arena_floats(a, R * V);
  d->probs = nmt__arena_floats(a, R * H * keys);
  d->zero = nmt__arena_floats(a, C);
  d->up = nmt__arena_ints(a, up_ints(d->cap_rows, d->cap_steps));
  d->ids = d->up;
  d->klen_self = d->up + R;
  d->gidx = d->up + 2 * R;
  d->amax = nmt__arena_ints(a, R);
  d->klen_cross = nmt__arena_ints(a, d->cap_sent);
  d->cidx = nmt__arena_ints(a, SR * 2);
}

nmt_status nmt_decoder_create(nmt_model *m, nmt_decoder **out) {
  *out = NULL;
  nmt_decoder *d = calloc(1, sizeof *d);
  int L = m->cfg.dec_layers;
  if (d) {
    d->self_kv = calloc((size_t)L + 1, sizeof *d->self_kv);
    d->cross_kv = calloc((size_t)L + 1, sizeof *d->cross_kv);
  }
  if (!d || !d->self_kv || !d->cross_kv) {
    nmt_decoder_destroy(d);
    return nmt_errorf(NMT_ERR_NOMEM, "decoder: out of host memory");
  }
  d->m = m;
  *out = d;
  return NMT_OK;
}

void nmt_decoder_destroy(nmt_decoder *d) {
  if (!d) return;
  if (d->arena) d->m->be->free(d->m->ctx, d->arena);
  free(d->self_kv);
  free(d->cross_kv);
  free(d->h_up);
  free(d->h_cidx);
  free(d->h_klen_cross);
  free(d->h_src_lens);
  free(d->h_act);
  free(d);
}

/* The largest op shapes of a batch of the arena's capacity (decoder_begin's cross K/V
 * projection, nmt_decoder_step's ops; the encoder's are the model's plan): linear layers on R
 * rows (K in {C, F}; N in {C, 2C, F, V}) and on the source's rows (C -> 2C); self-attention B =
 * R, Tq = 1, Tk <= S; cross-attention B <= n_sent, Tq = beam, Tk = Ts (n_sent*Ts <= src rows).
 * No dropout, no backward. */
static void decoder_plan(const nmt_decoder *d, nmt_scratch_plan *p) {
  const nmt_model_cfg *cfg = &d->m->cfg;
  const size_t C = (size_t)cfg->d_model, F = (size_t)cfg->d_ff, V = (size_t)cfg->vocab;
  const size_t R = (size_t)d->cap_rows, S = (size_t)d->cap_steps, SR = (size_t)d->cap_src_rows;
  size_t wide = 2 * C > F ? 2 * C : F;
  wide = wide > V ? wide : V;
  memset(p, 0, sizeof *p);
  p->main.gemm_rows = R > SR ? R : SR;
  p->main.gemm_inp = R * (C > F ? C : F) > SR * C ? R * (C > F ? C : F) : SR * C;
  p->main.gemm_w = C * wide;
  p->main.gemm_out = R * wide > SR * 2 * C ? R * wide : SR * 2 * C;
  p->main.att_q = R * C;
  p->main.att_kv = (R * S > SR ? R * S : SR) * C;
}

/* Grows the arena (never shrinks) to hold `rows` rows, `steps` steps, n_sent sentences and
 * src_rows source rows, and the context's scratch for the ops on them (decoder_plan), so that
 * steps do not allocate. Contents are not preserved. */
static nmt_status reserve(nmt_decoder *d, int rows, int steps, int n_sent, int src_rows) {
  if (d->arena && rows <= d->cap_rows && steps <= d->cap_steps && n_sent <= d->cap_sent &&
      src_rows <= d->cap_src_rows)
    return NMT_OK;
  const nmt_backend *be = d->m->be;
  void *ctx = d->m->ctx;
  if (d->arena) be->free(ctx, d->arena);
  d->arena = NULL;
  free(d->h_up), free(d->h_cidx), free(d->h_klen_cross), free(d->h_src_lens), free(d->h_act);
  d->h_up = d->h_cidx = d->h_klen_cross = d->h_src_lens = d->h_act = NULL;
  if (rows > d->cap_rows) d->cap_rows = rows;
  if (steps > d->cap_steps) d->cap_steps = steps;
  if (n_sent > d->cap_sent) d->cap_sent = n_sent;
  if (src_rows > d->cap_src_rows) d->cap_src_rows = src_rows;
  NMT_TRY(nmt__arena_alloc(be, ctx, carve_all, d, &d->arena, NULL));
  NMT_TRY(be->memset_zero(ctx, d->zero, (size_t)d->m->cfg.d_model * sizeof(float)));
  d->h_up = malloc(up_ints(d->cap_rows, d->cap_steps) * sizeof(int32_t));
  d->h_cidx = malloc((size_t)d->cap_src_rows * 2 * sizeof(int32_t));
  d->h_klen_cross = malloc((size_t)d->cap_sent * sizeof(int32_t));
  d->h_src_lens = malloc((size_t)d->cap_sent * sizeof(int32_t));
  d->h_act = malloc((size_t)d->cap_sent * sizeof(int32_t));
  if (!d->h_up || !d->h_cidx || !d->h_klen_cross || !d->h_src_lens || !d->h_act)
    return nmt_errorf(NMT_ERR_NOMEM, "decoder: out of host memory");
  if (be->reserve_scratch) {
    nmt_scratch_plan plan;
    decoder_plan(d, &plan);
    NMT_TRY(be->reserve_scratch(ctx, &plan));
  }
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* begin and step */

nmt_status nmt_decoder_begin(nmt_decoder *d, const float *params, const nmt_batch *b, int beam,
                             int max_steps) {
  nmt_model *m = d->m;
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int C = m->cfg.d_model, B = b->n_sent, Ts = b->src_len;
  d->t = 0;
  d->n_act = 0;
  d->max_steps = 0;
  if (beam < 1 || (long)B * beam > (1L << 30))
    return nmt_errorf(NMT_ERR_USAGE, "decoder: beam %d for %d sentences", beam, B);
  if (max_steps < 1 || max_steps > m->cfg.max_positions)
    return nmt_errorf(NMT_ERR_USAGE, "decoder: max_steps %d outside [1, max_positions %d]",
                      max_steps, m->cfg.max_positions);
  NMT_TRY(nmt__model_encode_eval(m, params, b));
  NMT_TRY(reserve(d, B * beam, max_steps, B, B * Ts));
  for (int l = 0; l < m->cfg.dec_layers; l++) {
    const sublayer *s = &m->dec[3 * l + 1];
    NMT_TRY(be->matmul_fwd(ctx, d->cross_kv[l], m->enc_out, params + s->w1, params + s->b1,
                           B * Ts, C, 2 * C));
  }
  NMT_TRY(be->copy_d2h(ctx, d->h_src_lens, b->src_lens, (size_t)B * sizeof(int32_t)));
  NMT_TRY(be->synchronize(ctx));
  memcpy(d->h_klen_cross, d->h_src_lens, (size_t)B * sizeof(int32_t));
  NMT_TRY(be->copy_h2d(ctx, d->klen_cross, d->h_klen_cross, (size_t)B * sizeof(int32_t)));
  for (int i = 0; i < B; i++) d->h_act[i] = i;
  d->B = B;
  d->Ts = Ts;
  d->beam = beam;
  d->max_steps = max_steps;
  d->n_act = B;
  d->rows = B * beam;
  return NMT_OK;
}

/* Row gather through the embedding op: out row i = src row idx[i] (rows of width C). */
static nmt_status gather(nmt_decoder *d, float *out, const float *src, const int32_t *idx,
                         int n_rows) {
  const nmt_model *m = d->m;
  return m->be->embedding_fwd(m->ctx, out, idx, src, d->zero, n_rows, 1, m->cfg.d_model, 1.0f);
}

static nmt_status check_step(const nmt_decoder *d, int n_act, const int32_t *act,
                             const int32_t *parent, const int32_t *tokens) {
  if (d->max_steps == 0) return nmt_errorf(NMT_ERR_USAGE, "decoder: step before begin");
  if (d->t >= d->max_steps)
    return nmt_errorf(NMT_ERR_USAGE, "decoder: step %d beyond max_steps %d", d->t + 1,
                      d->max_steps);
  if (n_act < 1 || n_act > d->n_act)
    return nmt_errorf(NMT_ERR_USAGE, "decoder: %d active sentences (previous step: %d)", n_act,
                      d->n_act);
  /* act must be an increasing subsequence of the previous act (two pointers). */
  for (int a = 0, p = 0; a < n_act; a++) {
    if (a > 0 && act[a] <= act[a - 1])
      return nmt_errorf(NMT_ERR_USAGE, "decoder: active sentences not increasing at %d", a);
    while (p < d->n_act && d->h_act[p] < act[a]) p++;
    if (p == d->n_act || d->h_act[p] != act[a])
      return nmt_errorf(NMT_ERR_USAGE, "decoder: sentence %d is not active", (int)act[a]);
  }
  const int rows = n_act * d->beam;
  for (int r = 0; r < rows; r++) {
    if (tokens[r] < 0 || tokens[r] >= d->m->cfg.vocab)
      return nmt_errorf(NMT_ERR_USAGE, "decoder: token %d at row %d outside [0, %d)",
                        (int)tokens[r], r, d->m->cfg.vocab);
    if (d->t == 0) continue;
    if (parent[r] < 0 || parent[r] >= d->rows || d->h_act[parent[r] / d->beam] != act[r / d->beam])
      return nmt_errorf(NMT_ERR_USAGE, "decoder: parent %d of row %d is not a row of sentence %d",
                        (int)parent[r], r, (int)act[r / d->beam]);
  }
  return NMT_OK;
}

/* x (rows, C) = LN(x + o) (post-LN) or x + o (pre-LN). y is scratch. */
static nmt_status residual(nmt_decoder *d, const float *P, const sublayer *s, int rows) {
  const nmt_model *m = d->m;
  const int C = m->cfg.d_model;
  const size_t n = (size_t)rows * C;
  if (m->cfg.norm == NMT_NORM_PRE) return m->be->add(m->ctx, d->x, d->x, d->o, n);
  NMT_TRY(m->be->add(m->ctx, d->y, d->x, d->o, n));
  return m->be->layernorm_fwd(m->ctx, d->x, d->mean, d->rstd, d->y, P + s->ln_w, P + s->ln_b, rows,
                              C, m->cfg.ln_eps);
}

/* The sublayer's input: x (post-LN) or LN(x) into y (pre-LN). */
static nmt_status sub_input(nmt_decoder *d, const float *P, const sublayer *s, int rows,
                            const float **in) {
  const nmt_model *m = d->m;
  if (m->cfg.norm == NMT_NORM_POST) {
    *in = d->x;
    return NMT_OK;
  }
  *in = d->y;
  return m->be->layernorm_fwd(m->ctx, d->y, d->mean, d->rstd, d->x, P + s->ln_w, P + s->ln_b, rows,
                              m->cfg.d_model, m->cfg.ln_eps);
}

nmt_status nmt_decoder_step(nmt_decoder *d, const float *params, int n_act, const int32_t *act,
                            const int32_t *parent, const int32_t *tokens, const float **logits) {
  nmt_model *m = d->m;
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const float *P = params;
  const int C = m->cfg.d_model, F = m->cfg.d_ff, H = m->cfg.n_heads, V = m->cfg.vocab;
  const int dk = C / H, L = m->cfg.dec_layers, beam = d->beam, Ts = d->Ts, t = d->t;
  NMT_TRY(check_step(d, n_act, act, parent, tokens));
  const int R = n_act * beam, prev_rows = d->rows;

  /* Compaction: drop the cross-attention rows of sentences that left. */
  if (n_act != d->n_act) {
    int32_t *idx = d->h_cidx, *lens = d->h_klen_cross;
    for (int a = 0, p = 0; a < n_act; a++) {
      while (d->h_act[p] != act[a]) p++;
      for (int s = 0; s < Ts; s++)
        for (int k = 0; k < 2; k++)
          idx[((size_t)a * Ts + s) * 2 + k] = (int32_t)(((size_t)p * Ts + s) * 2 + k);
      lens[a] = d->h_src_lens[act[a]];
    }
    NMT_TRY(be->copy_h2d(ctx, d->cidx, idx, (size_t)n_act * Ts * 2 * sizeof(int32_t)));
    NMT_TRY(be->copy_h2d(ctx, d->klen_cross, lens, (size_t)n_act * sizeof(int32_t)));
    for (int l = 0; l < L; l++) {
      NMT_TRY(gather(d, d->cross_spare, d->cross_kv[l], d->cidx, n_act * Ts * 2));
      float *tmp = d->cross_kv[l];
      d->cross_kv[l] = d->cross_spare;
      d->cross_spare = tmp;
    }
  }
  /* Self-attention cache layout (R, t+1): positions j < t from the parent row, t from the new
   * rows written at offset prev_rows*t. */
  const int CR = d->cap_rows;
  int32_t *h_ids = d->h_up, *h_klen = d->h_up + CR, *idx = d->h_up + 2 * CR;
  memcpy(h_ids, tokens, (size_t)R * sizeof *tokens);
  for (int r = 0; r < R; r++) h_klen[r] = t + 1;
  if (t > 0) {
    const size_t fresh = (size_t)prev_rows * t;
    for (int r = 0; r < R; r++)
      for (int j = 0; j <= t; j++) {
        size_t src = j < t ? (size_t)parent[r] * t + j : fresh + r;
        size_t dst = (size_t)r * (t + 1) + j;
        idx[dst * 2] = (int32_t)(src * 2);
        idx[dst * 2 + 1] = (int32_t)(src * 2 + 1);
      }
  }
  const size_t n_up = 2 * (size_t)CR + (t > 0 ? (size_t)R * (t + 1) * 2 : 0);
  NMT_TRY(be->copy_h2d(ctx, d->up, d->h_up, n_up * sizeof(int32_t)));

  /* Embedding of position t (§3.4, §3.5): the position table row t for every row. */
  NMT_TRY(be->embedding_fwd(ctx, d->x, d->ids, P + m->embed_off, m->pe + (size_t)t * C, R, 1, C,
                            sqrtf((float)C)));
  for (int l = 0; l < L; l++) {
    const sublayer *sa = &m->dec[3 * l], *ca = &m->dec[3 * l + 1], *ff = &m->dec[3 * l + 2];
    const float *in;
    /* causal self-attention over the cache */
    NMT_TRY(sub_input(d, P, sa, R, &in));
    float *fresh = d->self_kv[l] + (size_t)prev_rows * t * 2 * C;
    if (t == 0) fresh = d->self_kv[l];
    /* qkv weight rows are [W_q; W_k; W_v]: q from the first C rows, k|v from the other 2C. */
    NMT_TRY(be->matmul_fwd(ctx, d->q, in, P + sa->w1, P + sa->b1, R, C, C));
    NMT_TRY(be->matmul_fwd(ctx, fresh, in, P + sa->w1 + (size_t)C * C, P + sa->b1 + C, R, C,
                           2 * C));
    if (t > 0) {
      NMT_TRY(gather(d, d->self_spare, d->self_kv[l], d->gidx, R * (t + 1) * 2));
      float *tmp = d->self_kv[l];
      d->self_kv[l] = d->self_spare;
      d->self_spare = tmp;
    }
    NMT_TRY(be->attention_fwd(ctx, d->att, d->probs, d->q, C, d->self_kv[l], d->self_kv[l] + C,
                              2 * C, d->klen_self, R, 1, t + 1, H, dk, 0, 0.0f, 0, 0));
    NMT_TRY(be->matmul_fwd(ctx, d->o, d->att, P + sa->w2, P + sa->b2, R, C, C));
    NMT_TRY(residual(d, P, sa, R));
    /* cross-attention: beam queries per sentence against its source */
    NMT_TRY(sub_input(d, P, ca, R, &in));
    NMT_TRY(be->matmul_fwd(ctx, d->q, in, P + ca->wq, P + ca->bq, R, C, C));
    NMT_TRY(be->attention_fwd(ctx, d->att, d->probs, d->q, C, d->cross_kv[l], d->cross_kv[l] + C,
                              2 * C, d->klen_cross, n_act, beam, Ts, H, dk, 0, 0.0f, 0, 0));
    NMT_TRY(be->matmul_fwd(ctx, d->o, d->att, P + ca->w2, P + ca->b2, R, C, C));
    NMT_TRY(residual(d, P, ca, R));
    /* feed-forward */
    NMT_TRY(sub_input(d, P, ff, R, &in));
    NMT_TRY(be->matmul_bias_relu_fwd(ctx, d->h, in, P + ff->w1, P + ff->b1, R, C, F));
    NMT_TRY(be->matmul_fwd(ctx, d->o, d->h, P + ff->w2, P + ff->b2, R, F, C));
    NMT_TRY(residual(d, P, ff, R));
  }
  const float *out = d->x;
  if (m->cfg.norm == NMT_NORM_PRE) {
    NMT_TRY(be->layernorm_fwd(ctx, d->y, d->mean, d->rstd, d->x, P + m->dec_ln.w, P + m->dec_ln.b,
                              R, C, m->cfg.ln_eps));
    out = d->y;
  }
  /* Output projection with the shared embedding (§3.4). */
  NMT_TRY(be->matmul_fwd(ctx, d->logits, out, P + m->embed_off, NULL, R, C, V));
  memcpy(d->h_act, act, (size_t)n_act * sizeof *act);
  d->n_act = n_act;
  d->rows = R;
  d->t = t + 1;
  *logits = d->logits;
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* greedy */

/* Per-sentence output limits min(max_out, src_len + extra_len, max_positions), >= 0, from the
 * host copy of the source lengths that begin made; returns the longest. */
static int limits(const nmt_model *m, const int32_t *src_lens, int B, int max_out, int extra_len,
                  int32_t *lim) {
  int longest = 0;
  for (int i = 0; i < B; i++) {
    long l = (long)src_lens[i] + extra_len;
    if (l > max_out) l = max_out;
    if (l > m->cfg.max_positions) l = m->cfg.max_positions;
    if (l < 0) l = 0;
    lim[i] = (int32_t)l;
    if (l > longest) longest = (int)l;
  }
  return longest;
}

/* <pad> and <s> are never outputs: PAD only fills batches and BOS is the decoder's first input
 * (tgt_in = BOS y), so training never targets them and their logits carry no meaning. Greedy
 * decoding and beam search both skip them (issue 19: greedy emitted <s>). <unk> and </s> may be
 * output. */
static inline int never_output(int32_t v) { return v == NMT_PAD_ID || v == NMT_BOS_ID; }

/* NaN orders like -inf, so it never wins (as the argmax op). */
static inline float key(float v) { return v == v ? v : -INFINITY; }

/* The argmax of x (V) over the ids that may be output; lower id on ties (as the argmax op). */
static int32_t best_output(const float *x, int V) {
  int32_t best = -1;
  for (int v = 0; v < V; v++)
    if (!never_output(v) && (best < 0 || key(x[v]) > key(x[best]))) best = v;
  return best;
}

typedef struct {
  int32_t *lim, *act, *parent, *tokens, *next;
  float *row; /* (V) host copy of a row whose device argmax was a never-output id */
} greedy_host;

nmt_status nmt_decoder_greedy(nmt_decoder *d, const float *params, const nmt_batch *b,
                              int max_out, int extra_len, int32_t *out_ids, int32_t *out_lens) {
  nmt_model *m = d->m;
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int B = b->n_sent, V = m->cfg.vocab;
  if (max_out < 0) return nmt_errorf(NMT_ERR_USAGE, "decoder: greedy max_out %d < 0", max_out);
  if (B < 1) return nmt_errorf(NMT_ERR_DATA, "decoder: empty batch");
  nmt_status st = NMT_OK;
  greedy_host g;
  int32_t *all = malloc((size_t)B * 5 * sizeof(int32_t));
  if (!all) return nmt_errorf(NMT_ERR_NOMEM, "decoder: out of host memory");
  g.lim = all, g.act = all + B, g.parent = all + 2 * B, g.tokens = all + 3 * B, g.next = all + 4 * B;
  g.row = NULL;
  for (int i = 0; i < B; i++) {
    out_lens[i] = 0;
    for (int j = 0; j < max_out; j++) out_ids[(size_t)i * max_out + j] = NMT_PAD_ID;
  }
  NMT_TRY_GOTO(st, be->copy_d2h(ctx, g.lim, b->src_lens, (size_t)B * sizeof(int32_t)), out);
  NMT_TRY_GOTO(st, be->synchronize(ctx), out);
  int longest = limits(m, g.lim, B, max_out, extra_len, g.lim);
  if (longest == 0) goto out;
  NMT_TRY_GOTO(st, nmt_decoder_begin(d, params, b, 1, longest), out);
  int n_act = 0;
  for (int i = 0; i < B; i++)
    if (g.lim[i] > 0) {
      g.act[n_act] = i;
      g.tokens[n_act++] = NMT_BOS_ID;
    }
  while (n_act > 0) {
    const float *logits;
    NMT_TRY_GOTO(st, nmt_decoder_step(d, params, n_act, g.act, g.parent, g.tokens, &logits), out);
    NMT_TRY_GOTO(st, be->argmax(ctx, d->amax, logits, n_act, V), out);
    NMT_TRY_GOTO(st, be->copy_d2h(ctx, g.next, d->amax, (size_t)n_act * sizeof(int32_t)), out);
    NMT_TRY_GOTO(st, be->synchronize(ctx), out);
    /* The device argmax ranges over the whole vocabulary; the rare row whose winner may not be
     * output is re-ranked on the host without it (one row copy, no extra op). */
    for (int a = 0; a < n_act; a++) {
      if (!never_output(g.next[a])) continue;
      if (!g.row && !(g.row = malloc((size_t)V * sizeof(float)))) {
        st = nmt_errorf(NMT_ERR_NOMEM, "decoder: out of host memory");
        goto out;
      }
      NMT_TRY_GOTO(st, be->copy_d2h(ctx, g.row, logits + (size_t)a * V, (size_t)V * sizeof(float)),
                   out);
      NMT_TRY_GOTO(st, be->synchronize(ctx), out);
      g.next[a] = best_output(g.row, V);
    }
    int k = 0;
    for (int a = 0; a < n_act; a++) {
      int i = g.act[a];
      int32_t tok = g.next[a];
      if (tok == NMT_EOS_ID) continue;
      out_ids[(size_t)i * max_out + out_lens[i]++] = tok;
      if (out_lens[i] >= g.lim[i]) continue;
      g.act[k] = i;
      g.parent[k] = a;
      g.tokens[k++] = tok;
    }
    n_act = k;
  }
out:
  free(g.row);
  free(all);
  return st;
}

nmt_status nmt_model_greedy(nmt_model *m, const float *params, const nmt_batch *b, int max_out,
                            int extra_len, int32_t *out_ids, int32_t *out_lens) {
  nmt_decoder *d;
  NMT_TRY(nmt_decoder_create(m, &d));
  nmt_status st = nmt_decoder_greedy(d, params, b, max_out, extra_len, out_ids, out_lens);
  nmt_decoder_destroy(d);
  return st;
}

/* ------------------------------------------------------------------------------------------ */
/* beam search */

/* GNMT length penalty lp(n) = ((5 + n) / 6)^alpha (Wu et al. 2016, eq. 14). */
static double length_penalty(int n, double alpha) { return pow((5.0 + n) / 6.0, alpha); }

/* Indices of the k largest entries of x (V) among the ids that may be output, largest first,
 * lower index first on ties. Returns min(k, number of such ids). */
static int topk_row(const float *x, int V, int k, int32_t *idx) {
  int n = 0;
  for (int v = 0; v < V; v++) {
    if (never_output(v)) continue;
    float xv = key(x[v]);
    if (n == k && !(xv > key(x[idx[n - 1]]))) continue;
    int pos = n < k ? n++ : k - 1;
    while (pos > 0 && xv > key(x[idx[pos - 1]])) {
      idx[pos] = idx[pos - 1];
      pos--;
    }
    idx[pos] = v;
  }
  return n;
}

/* log sum_v exp(x_v) in double. */
static double logsumexp(const float *x, int V) {
  double mx = -INFINITY, s = 0;
  for (int v = 0; v < V; v++) mx = key(x[v]) > mx ? key(x[v]) : mx;
  if (mx == -INFINITY) return mx;
  for (int v = 0; v < V; v++) s += exp((double)key(x[v]) - mx);
  return mx + log(s);
}

typedef struct {
  double score;
  int32_t row, rank, tok; /* parent row (previous step layout), rank within it, token */
} cand;

static int cand_cmp(const void *pa, const void *pb) {
  const cand *a = pa, *b = pb;
  if (a->score != b->score) return a->score > b->score ? -1 : 1;
  if (a->row != b->row) return a->row < b->row ? -1 : 1;
  return a->rank < b->rank ? -1 : a->rank > b->rank;
}

/* Host state of one beam-search batch (R = B*beam rows, S = max steps, K = n-best kept). */
typedef struct {
  int32_t *lim;              /* (B) output length limit */
  int32_t *n_fin;            /* (B) finished hypotheses */
  int32_t *alive;            /* (B) live hypotheses (rows 0..alive-1 of its block) */
  int32_t *n_best;           /* (B) finished hypotheses kept, <= K */
  double *best, *best_logp;  /* (B, K) kept finished ones, best first: normalised score, log p */
  int32_t *best_len;         /* (B, K) */
  int32_t *best_ids;         /* (B, K, S) */
  double *score, *score2;    /* (R) live scores: current layout, next layout */
  int32_t *pre, *pre2;       /* (R, S) prefixes: current, next */
  int32_t *act, *act2, *parent, *tokens; /* step inputs */
  float *logits;             /* (R, V) host copy */
  cand *cands;               /* (beam*beam) */
  int32_t *top;              /* (beam) */
} beam_host;

static void beam_host_free(beam_host *h) {
  free(h->lim), free(h->n_fin), free(h->alive), free(h->n_best), free(h->best);
  free(h->best_logp), free(h->best_len), free(h->best_ids), free(h->score), free(h->score2);
  free(h->pre), free(h->pre2), free(h->act), free(h->act2), free(h->parent), free(h->tokens);
  free(h->logits), free(h->cands), free(h->top);
}

static nmt_status beam_host_alloc(beam_host *h, int B, int beam, int K, int S, int V) {
  const size_t R = (size_t)B * beam, BK = (size_t)B * K;
  memset(h, 0, sizeof *h);
  h->lim = malloc((size_t)B * sizeof(int32_t));
  h->n_fin = calloc((size_t)B, sizeof(int32_t));
  h->alive = calloc((size_t)B, sizeof(int32_t));
  h->n_best = calloc((size_t)B, sizeof(int32_t));
  h->best = malloc(BK * sizeof(double));
  h->best_logp = malloc(BK * sizeof(double));
  h->best_len = calloc(BK, sizeof(int32_t));
  h->best_ids = malloc(BK * S * sizeof(int32_t));
  h->score = malloc(R * sizeof(double));
  h->score2 = malloc(R * sizeof(double));
  h->pre = malloc(R * S * sizeof(int32_t));
  h->pre2 = malloc(R * S * sizeof(int32_t));
  h->act = malloc((size_t)B * sizeof(int32_t));
  h->act2 = malloc((size_t)B * sizeof(int32_t));
  h->parent = malloc(R * sizeof(int32_t));
  h->tokens = malloc(R * sizeof(int32_t));
  h->logits = malloc(R * V * sizeof(float));
  h->cands = malloc((size_t)beam * beam * sizeof(cand));
  h->top = malloc((size_t)beam * sizeof(int32_t));
  if (!h->lim || !h->n_fin || !h->alive || !h->n_best || !h->best || !h->best_logp ||
      !h->best_len || !h->best_ids || !h->score || !h->score2 || !h->pre || !h->pre2 || !h->act ||
      !h->act2 || !h->parent || !h->tokens || !h->logits || !h->cands || !h->top) {
    beam_host_free(h);
    return nmt_errorf(NMT_ERR_NOMEM, "beam search: out of host memory (%zu rows x vocab %d)", R, V);
  }
  return NMT_OK;
}

/* Records a finished hypothesis (ids[0..len), score = log p, |y| = ylen) of sentence i among
 * its K best by normalised score; a later one ranks after an equal earlier one. */
static void finish(beam_host *h, int i, int K, int S, const int32_t *ids, int len, double score,
                   int ylen, double alpha) {
  const double norm = score / length_penalty(ylen, alpha);
  double *best = h->best + (size_t)i * K, *logp = h->best_logp + (size_t)i * K;
  int32_t *blen = h->best_len + (size_t)i * K, *bids = h->best_ids + (size_t)i * K * S;
  h->n_fin[i]++;
  int n = h->n_best[i], pos = n;
  while (pos > 0 && norm > best[pos - 1]) pos--;
  if (pos >= K) return;
  if (n == K) n--; /* the K-th falls off */
  for (int j = n; j > pos; j--) {
    best[j] = best[j - 1], logp[j] = logp[j - 1], blen[j] = blen[j - 1];
    memcpy(bids + (size_t)j * S, bids + (size_t)(j - 1) * S, (size_t)blen[j] * sizeof(int32_t));
  }
  best[pos] = norm, logp[pos] = score, blen[pos] = len;
  memcpy(bids + (size_t)pos * S, ids, (size_t)len * sizeof(int32_t));
  h->n_best[i] = n + 1;
}

/* One step's selection for active sentence a (sentence i): candidates from its live rows, the
 * best k = beam - finished survive or finish; returns the number alive afterwards and whether
 * the sentence is done. base: its first row in the next layout. */
static int select_step(beam_host *h, int a, int i, int t, int beam, int K, int S, int V,
                       double alpha, int base, int *done) {
  const int k = beam - h->n_fin[i];
  int nc = 0, alive = 0;
  for (int j = 0; j < h->alive[i]; j++) {
    const int row = a * beam + j;
    const float *x = h->logits + (size_t)row * V;
    const double lse = logsumexp(x, V);
    int n = topk_row(x, V, k, h->top);
    for (int r = 0; r < n; r++)
      h->cands[nc++] = (cand){h->score[row] + ((double)key(x[h->top[r]]) - lse), row, r, h->top[r]};
  }
  qsort(h->cands, (size_t)nc, sizeof *h->cands, cand_cmp);
  /* The best k survive: EOS finishes, the others live on (or finish at the limit). */
  for (int c = 0; c < nc && c < k; c++) {
    const cand *x = &h->cands[c];
    const int32_t *prefix = h->pre + (size_t)x->row * S;
    if (x->tok == NMT_EOS_ID) {
      finish(h, i, K, S, prefix, t, x->score, t + 1, alpha);
      continue;
    }
    int32_t *np = h->pre2 + (size_t)(base + alive) * S;
    memcpy(np, prefix, (size_t)t * sizeof(int32_t));
    np[t] = x->tok;
    if (t + 1 >= h->lim[i]) {
      finish(h, i, K, S, np, t + 1, x->score, t + 1, alpha);
      continue;
    }
    h->score2[base + alive] = x->score;
    h->parent[base + alive] = x->row;
    h->tokens[base + alive] = x->tok;
    alive++;
  }
  /* Done when the beam is used up or no live hypothesis can still enter the K best finished
   * ones: its normalised score can reach at most s / lp(limit). */
  *done = alive == 0 || h->n_fin[i] >= beam;
  if (!*done && h->n_best[i] == K) {
    const double lp = length_penalty(h->lim[i], alpha), kth = h->best[(size_t)i * K + K - 1];
    *done = 1;
    for (int j = 0; j < alive; j++)
      if (h->score2[base + j] / lp > kth) *done = 0;
  }
  return alive;
}

nmt_status nmt_decoder_beam_nbest(nmt_decoder *d, const float *params, const nmt_batch *b,
                                  int beam, float alpha, int max_out, int extra_len, int nbest,
                                  int32_t *out_ids, int32_t *out_lens, int32_t *out_n,
                                  float *out_scores, float *out_logp) {
  nmt_model *m = d->m;
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int B = b->n_sent, V = m->cfg.vocab, K = nbest;
  if (max_out < 0) return nmt_errorf(NMT_ERR_USAGE, "beam search: max_out %d < 0", max_out);
  if (beam < 1 || beam > (1 << 16))
    return nmt_errorf(NMT_ERR_USAGE, "beam search: beam %d outside [1, 65536]", beam);
  if (K < 1 || K > beam)
    return nmt_errorf(NMT_ERR_USAGE, "beam search: n-best %d outside [1, beam %d]", K, beam);
  if (!(alpha >= 0.0f && alpha <= 100.0f))
    return nmt_errorf(NMT_ERR_USAGE, "beam search: length penalty alpha %g outside [0, 100]",
                      (double)alpha);
  if (B < 1) return nmt_errorf(NMT_ERR_DATA, "beam search: empty batch");
  for (size_t i = 0; i < (size_t)B * K; i++) {
    out_lens[i] = 0;
    if (out_scores) out_scores[i] = 0.0f;
    if (out_logp) out_logp[i] = 0.0f;
    for (int j = 0; j < max_out; j++) out_ids[i * max_out + j] = NMT_PAD_ID;
  }
  for (int i = 0; i < B; i++) if (out_n) out_n[i] = 0;
  int32_t *src_lens = malloc((size_t)B * sizeof(int32_t));
  if (!src_lens) return nmt_errorf(NMT_ERR_NOMEM, "beam search: out of host memory");
  nmt_status st = be->copy_d2h(ctx, src_lens, b->src_lens, (size_t)B * sizeof(int32_t));
  if (st == NMT_OK) st = be->synchronize(ctx);
  if (st != NMT_OK) {
    free(src_lens);
    return st;
  }
  const int S = limits(m, src_lens, B, max_out, extra_len, src_lens);
  beam_host h;
  if (S == 0 || (st = beam_host_alloc(&h, B, beam, K, S, V)) != NMT_OK) {
    free(src_lens);
    return st;
  }
  memcpy(h.lim, src_lens, (size_t)B * sizeof(int32_t));
  free(src_lens);
  NMT_TRY_GOTO(st, nmt_decoder_begin(d, params, b, beam, S), out);

  /* Step 0: one live hypothesis (BOS) per sentence; the other rows are idle. */
  int n_act = 0;
  for (int i = 0; i < B; i++) {
    if (h.lim[i] == 0) continue;
    h.alive[i] = 1;
    h.score[(size_t)n_act * beam] = 0.0;
    for (int j = 0; j < beam; j++) h.tokens[(size_t)n_act * beam + j] = NMT_BOS_ID;
    h.act[n_act++] = i;
  }
  for (int t = 0; n_act > 0; t++) {
    const float *dl;
    const int R = n_act * beam;
    NMT_TRY_GOTO(st, nmt_decoder_step(d, params, n_act, h.act, h.parent, h.tokens, &dl), out);
    NMT_TRY_GOTO(st, be->copy_d2h(ctx, h.logits, dl, (size_t)R * V * sizeof(float)), out);
    NMT_TRY_GOTO(st, be->synchronize(ctx), out);
    int n_next = 0;
    for (int a = 0; a < n_act; a++) {
      const int i = h.act[a], base = n_next * beam;
      int done;
      const int alive = select_step(&h, a, i, t, beam, K, S, V, alpha, base, &done);
      if (done) continue;
      h.alive[i] = alive;
      for (int j = alive; j < beam; j++) {
        h.parent[base + j] = h.parent[base];
        h.tokens[base + j] = NMT_PAD_ID;
      }
      h.act2[n_next++] = i;
    }
    /* Swap current and next layouts. */
    n_act = n_next;
    int32_t *ti = h.act;
    h.act = h.act2, h.act2 = ti;
    ti = h.pre;
    h.pre = h.pre2, h.pre2 = ti;
    double *td = h.score;
    h.score = h.score2, h.score2 = td;
  }
  for (int i = 0; i < B; i++) {
    if (out_n) out_n[i] = h.n_best[i];
    for (int r = 0; r < h.n_best[i]; r++) {
      const size_t q = (size_t)i * K + r;
      int len = h.best_len[q] < max_out ? h.best_len[q] : max_out;
      memcpy(out_ids + q * max_out, h.best_ids + q * S, (size_t)len * sizeof(int32_t));
      out_lens[q] = len;
      if (out_scores) out_scores[q] = (float)h.best[q];
      if (out_logp) out_logp[q] = (float)h.best_logp[q];
    }
  }
out:
  beam_host_free(&h);
  return st;
}

nmt_status nmt_decoder_beam(nmt_decoder *d, const float *params, const nmt_batch *b, int beam,
                            float alpha, int max_out, int extra_len, int32_t *out_ids,
                            int32_t *out_lens, float *out_scores) {
  return nmt_decoder_beam_nbest(d, params, b, beam, alpha, max_out, extra_len, 1, out_ids,
                                out_lens, NULL, out_scores, NULL);
}
