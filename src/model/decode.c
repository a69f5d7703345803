/* decode.c — incremental decoding of the Transformer decoder (Vaswani et al. 2017 §3.1, §3.2.3),
 * the per-step selection on the device, and greedy decoding on top of them (beam search, §6.1:
 * beam.c).
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
 * Host traffic per step (docs/decoding.md "On the device"): one upload from pinned memory on
 * the copy stream (staging slot 0: the fed tokens, key lengths and gather indices; slot 1
 * carries the cross-attention compaction when a sentence left), ordered by events, and one
 * read back of the step's selection (logp_topk: k ids and log-probabilities per row, or one id
 * per row for greedy) into pinned memory: d2h_async and one d2h_wait. The logits stay on the
 * device; nothing is allocated between begin and the batch's last step.
 *
 * Memory (floats) for R = n_sent*beam rows, S = max_steps, Ts = source length, L layers:
 *   (L+1) * R*S*2C self caches + (L+1) * n_sent*Ts*2C cross caches
 *   + R*(5C + F + V + 2 + H*max(S,Ts) + 4*beam) per-step activations and selections; grown on
 *   demand, kept between batches. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model_impl.h"
#include "nmt/config.h"
#include "nmt/log.h"
#include "nmt/model.h"

struct nmt_decoder {
  nmt_model *m;
  /* device arena and the sizes it was carved for */
  void *arena;
  int cap_rows, cap_steps, cap_src_rows, cap_sent, cap_k;
  float **self_kv, **cross_kv; /* dec_layers pointers each, into the arena */
  float *self_spare, *cross_spare;
  float *x, *y, *o, *att, *q, *h, *mean, *rstd, *logits, *probs, *zero;
  /* per-step uploads in one block, so a step costs one host-to-device copy (staging slot 0):
   * up = [ids | klen_self | expand | lrows (cap_rows each) | gidx (cap_rows*cap_steps*2)] */
  int32_t *up, *ids, *klen_self, *expand, *lrows, *gidx;
  /* the cross-attention's, rewritten at begin and when sentences leave (slot 1):
   * cmp = [klen_cross (cap_sent) | cidx (cap_src_rows*2)] */
  int32_t *cmp, *klen_cross, *cidx;
  /* the step's selection: (R, k) ids then (R, k) log-probabilities, R*k <= cap_rows*cap_k */
  int32_t *sel;
  /* pinned host twins of up, cmp and sel (host_alloc): each is rewritten only once the copy
   * that read it is known to be done (h2d_wait_src, d2h_wait) */
  int32_t *h_up, *h_cmp, *h_sel;
  int32_t *h_src_lens, *h_act; /* plain host memory */
  int32_t *h_pos, *h_pos_next;  /* (cap_rows) each slot's live row (-1: idle): last step, next */
  /* batch state */
  int B, Ts, beam, max_steps;
  int t;            /* steps taken */
  int n_act, rows;  /* layout of the last step (or of begin): sentences, slots */
  int live;         /* rows the last step computed (its live slots) */
  int min_len;      /* no EOS before this many output tokens (nmt_decoder_set_min_len) */
  /* ensemble (nmt_decoder_ensemble): the other models' decoders and parameters, and each
   * model's weight (w[0] this one's), normalised to sum to 1; n_mem 0: this model alone */
  int n_mem;
  nmt_decoder **mem;
  const float **mem_params;
  float *w;
  float *zsum;   /* (cap_rows, V) device: the weighted sum of the models' logits */
  float *h_comb; /* (cap_rows * cap_k) host: the weighted sum of their log-probabilities */
};

/* ------------------------------------------------------------------------------------------ */
/* allocation */

static size_t up_ints(int rows, int steps) { return (size_t)rows * (4 + (size_t)steps * 2); }
static size_t cmp_ints(const nmt_decoder *d) {
  return (size_t)d->cap_sent + (size_t)d->cap_src_rows * 2;
}
/* ids, then one log-probability per model (the ensemble's scores are their weighted sum) */
static size_t sel_ints(const nmt_decoder *d) {
  return (2 + (size_t)d->n_mem) * d->cap_rows * d->cap_k;
}

static void free_host(nmt_decoder *d) {
  const nmt_backend *be = d->m->be;
  be->host_free(d->m->ctx, d->h_up);
  be->host_free(d->m->ctx, d->h_cmp);
  be->host_free(d->m->ctx, d->h_sel);
  free(d->h_src_lens);
  free(d->h_act);
  free(d->h_pos);
  free(d->h_pos_next);
  free(d->h_comb);
  d->h_comb = NULL;
  d->h_up = d->h_cmp = d->h_sel = d->h_src_lens = d->h_act = d->h_pos = d->h_pos_next = NULL;
}

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
  d->expand = d->up + 2 * R;
  d->lrows = d->up + 3 * R;
  d->gidx = d->up + 4 * R;
  d->cmp = nmt__arena_ints(a, cmp_ints(d));
  d->klen_cross = d->cmp;
  d->cidx = d->cmp + d->cap_sent;
  d->sel = nmt__arena_ints(a, sel_ints(d));
  d->zsum = d->n_mem ? nmt__arena_floats(a, R * V) : NULL;
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

nmt_status nmt_decoder_set_min_len(nmt_decoder *d, int min_len) {
  if (min_len < 0) return nmt_errorf(NMT_ERR_USAGE, "decoder: min_len %d < 0", min_len);
  d->min_len = min_len;
  return NMT_OK;
}

int nmt__decoder_min_len(const nmt_decoder *d) { return d->min_len; }

void nmt_decoder_destroy(nmt_decoder *d) {
  if (!d) return;
  if (d->m) {
    if (d->arena) d->m->be->free(d->m->ctx, d->arena);
    free_host(d);
  }
  free(d->self_kv);
  free(d->cross_kv);
  free(d->mem);
  free(d->mem_params);
  free(d->w);
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

/* Grows the arena (never shrinks) to hold `rows` rows, `steps` steps, n_sent sentences,
 * src_rows source rows and selections of k per row, its pinned twins, and the context's
 * scratch for the ops on them (decoder_plan), so that steps do not allocate. Contents are not
 * preserved. */
static nmt_status reserve(nmt_decoder *d, int rows, int steps, int n_sent, int src_rows, int k) {
  /* Complete = every buffer of the last reservation exists: one that failed part-way (a
   * pinned allocation refused) is redone, not taken as sized. */
  const int complete = d->arena && d->h_up && d->h_cmp && d->h_sel && d->h_src_lens &&
                       d->h_act && d->h_pos && d->h_pos_next && (!d->n_mem || d->h_comb);
  if (complete && rows <= d->cap_rows && steps <= d->cap_steps && n_sent <= d->cap_sent &&
      src_rows <= d->cap_src_rows && k <= d->cap_k)
    return NMT_OK;
  const nmt_backend *be = d->m->be;
  void *ctx = d->m->ctx;
  /* The pinned buffers may still be read by a copy of the last batch. */
  if (d->arena) NMT_TRY(be->synchronize(ctx));
  if (d->arena) be->free(ctx, d->arena);
  d->arena = NULL;
  free_host(d);
  if (rows > d->cap_rows) d->cap_rows = rows;
  if (steps > d->cap_steps) d->cap_steps = steps;
  if (n_sent > d->cap_sent) d->cap_sent = n_sent;
  if (src_rows > d->cap_src_rows) d->cap_src_rows = src_rows;
  if (k > d->cap_k) d->cap_k = k;
  size_t bytes = 0;
  nmt_log(NMT_LOG_DEBUG, "decoder: %.1f MiB of %s memory for %d hypothesis rows (%d sentences) "
          "of up to %d steps, %d source rows", (double)nmt__arena_measure(carve_all, d) / (1 << 20),
          be->name, d->cap_rows, d->cap_sent, d->cap_steps, d->cap_src_rows);
  nmt_status st = nmt__arena_alloc(be, ctx, carve_all, d, &d->arena, &bytes);
  if (st != NMT_OK)
    return nmt_errorf(st, "decoder: %d hypothesis rows (%d sentences x beam) of up to %d steps "
                      "need %.2f GiB of %s memory for their caches and step buffers (%s)",
                      d->cap_rows, d->cap_sent, d->cap_steps, (double)bytes / (1 << 30),
                      be->name, nmt_last_error());
  NMT_TRY(be->memset_zero(ctx, d->zero, (size_t)d->m->cfg.d_model * sizeof(float)));
  NMT_TRY(be->host_alloc(ctx, up_ints(d->cap_rows, d->cap_steps) * sizeof(int32_t),
                         (void **)&d->h_up));
  NMT_TRY(be->host_alloc(ctx, cmp_ints(d) * sizeof(int32_t), (void **)&d->h_cmp));
  NMT_TRY(be->host_alloc(ctx, sel_ints(d) * sizeof(int32_t), (void **)&d->h_sel));
  d->h_src_lens = malloc((size_t)d->cap_sent * sizeof(int32_t));
  d->h_act = malloc((size_t)d->cap_sent * sizeof(int32_t));
  d->h_pos = malloc((size_t)d->cap_rows * sizeof(int32_t));
  d->h_pos_next = malloc((size_t)d->cap_rows * sizeof(int32_t));
  d->h_comb = d->n_mem ? malloc((size_t)d->cap_rows * d->cap_k * sizeof(float)) : NULL;
  if (!d->h_src_lens || !d->h_act || !d->h_pos || !d->h_pos_next || (d->n_mem && !d->h_comb))
    return nmt_errorf(NMT_ERR_NOMEM, "decoder: out of host memory");
  if (be->reserve_scratch) {
    nmt_scratch_plan plan;
    decoder_plan(d, &plan);
    NMT_TRY(be->reserve_scratch(ctx, &plan));
  }
  return NMT_OK;
}

/* The selection buffers' room per row: 2 x beam, beam.c's full rule. */
static int sel_k(int beam) { return 2 * beam < NMT_TOPK_MAX ? 2 * beam : NMT_TOPK_MAX; }

nmt_status nmt_decoder_reserve(nmt_decoder *d, int n_sent, int beam, int src_len,
                               int max_steps) {
  if (n_sent < 1 || src_len < 1 || beam < 1 || (long)n_sent * beam > (1L << 30) ||
      (long)n_sent * src_len > (1L << 30) || max_steps < 1 ||
      max_steps > d->m->cfg.max_positions)
    return nmt_errorf(NMT_ERR_USAGE, "decoder: reserve for %d sentences of %d positions, beam "
                      "%d, %d steps (max_positions %d)", n_sent, src_len, beam, max_steps,
                      d->m->cfg.max_positions);
  NMT_TRY(reserve(d, n_sent * beam, max_steps, n_sent, n_sent * src_len, sel_k(beam)));
  for (int i = 0; i < d->n_mem; i++)
    NMT_TRY(nmt_decoder_reserve(d->mem[i], n_sent, beam, src_len, max_steps));
  return NMT_OK;
}

nmt_status nmt_decoder_ensemble(nmt_decoder *d, nmt_decoder *const *members,
                                const float *const *member_params, const float *weights, int n) {
  if (n < 0 || (n > 0 && (!members || !member_params)))
    return nmt_errorf(NMT_ERR_USAGE, "decoder: an ensemble of %d further models", n);
  double total = 0;
  for (int i = 0; i <= n; i++) {
    const double w = weights ? weights[i] : 1.0;
    if (!(w > 0 && w < 1e30))
      return nmt_errorf(NMT_ERR_USAGE, "decoder: ensemble weight %d is %g (a positive number "
                        "needed)", i + 1, w);
    total += w;
  }
  for (int i = 0; i < n; i++) {
    const nmt_model *m = members[i] ? members[i]->m : NULL;
    if (!m || members[i] == d || members[i]->n_mem || !member_params[i])
      return nmt_errorf(NMT_ERR_USAGE, "decoder: ensemble member %d is not a single model's "
                        "decoder", i + 1);
    if (m->be != d->m->be || m->ctx != d->m->ctx || m->cfg.vocab != d->m->cfg.vocab)
      return nmt_errorf(NMT_ERR_USAGE, "decoder: ensemble member %d has another %s", i + 1,
                        m->cfg.vocab != d->m->cfg.vocab ? "vocabulary size" : "device context");
    for (int j = 0; j < i; j++)
      if (members[j] == members[i])
        return nmt_errorf(NMT_ERR_USAGE, "decoder: ensemble members %d and %d are one decoder "
                          "(it would step twice per step)", j + 1, i + 1);
  }
  /* The selection buffers change size: the next reserve makes them anew, and no step runs
   * before the next begin (the batch's buffers are gone). */
  d->max_steps = 0, d->t = 0, d->n_act = 0, d->live = 0;
  if (d->arena) {
    NMT_TRY(d->m->be->synchronize(d->m->ctx));
    d->m->be->free(d->m->ctx, d->arena);
    d->arena = NULL;
  }
  free_host(d);
  free(d->mem), free(d->mem_params), free(d->w);
  d->mem = NULL, d->mem_params = NULL, d->w = NULL, d->n_mem = 0;
  if (n == 0) return NMT_OK;
  d->mem = malloc((size_t)n * sizeof *d->mem);
  d->mem_params = malloc((size_t)n * sizeof *d->mem_params);
  d->w = malloc((size_t)(n + 1) * sizeof *d->w);
  if (!d->mem || !d->mem_params || !d->w) return nmt_errorf(NMT_ERR_NOMEM, "decoder: ensemble");
  for (int i = 0; i <= n; i++) d->w[i] = (float)((weights ? weights[i] : 1.0) / total);
  for (int i = 0; i < n; i++) d->mem[i] = members[i], d->mem_params[i] = member_params[i];
  d->n_mem = n;
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
  for (int i = 0; i < d->n_mem; i++)
    NMT_TRY(nmt_decoder_begin(d->mem[i], d->mem_params[i], b, beam, max_steps));
  NMT_TRY(nmt__model_encode_eval(m, params, b));
  NMT_TRY(reserve(d, B * beam, max_steps, B, B * Ts, sel_k(beam)));
  for (int l = 0; l < m->cfg.dec_layers; l++) {
    const sublayer *s = &m->dec[3 * l + 1];
    NMT_TRY(be->matmul_fwd(ctx, d->cross_kv[l], m->enc_out, params + s->w1, params + s->b1,
                           B * Ts, C, 2 * C));
  }
  /* copy_d2h returns with the data; the lengths then go back up as the key lengths of the
   * cross-attention (staging slot 1, which also carries each compaction). */
  NMT_TRY(be->copy_d2h(ctx, d->h_src_lens, b->src_lens, (size_t)B * sizeof(int32_t)));
  NMT_TRY(be->h2d_wait_src(ctx, 1));
  memcpy(d->h_cmp, d->h_src_lens, (size_t)B * sizeof(int32_t));
  NMT_TRY(be->h2d_async(ctx, 1, d->cmp, d->h_cmp, (size_t)B * sizeof(int32_t)));
  NMT_TRY(be->h2d_acquire(ctx, 1));
  for (int i = 0; i < B; i++) d->h_act[i] = i;
  d->B = B;
  d->Ts = Ts;
  d->beam = beam;
  d->max_steps = max_steps;
  d->n_act = B;
  d->rows = B * beam;
  d->live = 0;
  return NMT_OK;
}

/* Row gather through the embedding op: out row i = src row idx[i] (rows of width C). */
static nmt_status gather(nmt_decoder *d, float *out, const float *src, const int32_t *idx,
                         int n_rows) {
  const nmt_model *m = d->m;
  return m->be->embedding_fwd(m->ctx, out, idx, src, d->zero, n_rows, 1, m->cfg.d_model, 1.0f);
}

/* idle_ok: a token of -1 marks an idle slot (nmt__decoder_step_live). */
static nmt_status check_step(const nmt_decoder *d, int n_act, const int32_t *act,
                             const int32_t *parent, const int32_t *tokens, int idle_ok) {
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
  int live = 0;
  for (int r = 0; r < rows; r++) {
    if (idle_ok && tokens[r] == -1) continue;
    live++;
    if (tokens[r] < 0 || tokens[r] >= d->m->cfg.vocab)
      return nmt_errorf(NMT_ERR_USAGE, "decoder: token %d at row %d outside [0, %d)",
                        (int)tokens[r], r, d->m->cfg.vocab);
    if (d->t == 0) continue;
    if (parent[r] < 0 || parent[r] >= d->rows || d->h_act[parent[r] / d->beam] != act[r / d->beam])
      return nmt_errorf(NMT_ERR_USAGE, "decoder: parent %d of row %d is not a row of sentence %d",
                        (int)parent[r], r, (int)act[r / d->beam]);
    if (d->h_pos[parent[r]] < 0)
      return nmt_errorf(NMT_ERR_USAGE, "decoder: parent %d of row %d was idle", (int)parent[r], r);
  }
  if (live == 0) return nmt_errorf(NMT_ERR_USAGE, "decoder: a step with every row idle");
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

/* Compaction: drop the cross-attention rows of sentences that left. The previous upload
 * through slot 1 has been read (every op after its acquire has run: the last step's selection
 * was waited for), so the pinned block may be rewritten. */
static nmt_status compact_sources(nmt_decoder *d, int n_act, const int32_t *act) {
  const nmt_backend *be = d->m->be;
  void *ctx = d->m->ctx;
  const int Ts = d->Ts;
  NMT_TRY(be->h2d_wait_src(ctx, 1));
  int32_t *lens = d->h_cmp, *idx = d->h_cmp + d->cap_sent;
  for (int a = 0, p = 0; a < n_act; a++) {
    while (d->h_act[p] != act[a]) p++;
    for (int s = 0; s < Ts; s++)
      for (int k = 0; k < 2; k++)
        idx[((size_t)a * Ts + s) * 2 + k] = (int32_t)(((size_t)p * Ts + s) * 2 + k);
    lens[a] = d->h_src_lens[act[a]];
  }
  const size_t n_cmp = (size_t)d->cap_sent + (size_t)n_act * Ts * 2;
  NMT_TRY(be->h2d_async(ctx, 1, d->cmp, d->h_cmp, n_cmp * sizeof(int32_t)));
  NMT_TRY(be->h2d_acquire(ctx, 1));
  for (int l = 0; l < d->m->cfg.dec_layers; l++) {
    NMT_TRY(gather(d, d->cross_spare, d->cross_kv[l], d->cidx, n_act * Ts * 2));
    float *tmp = d->cross_kv[l];
    d->cross_kv[l] = d->cross_spare;
    d->cross_spare = tmp;
  }
  return NMT_OK;
}

/* The step's upload (slot 0): the live slots' tokens in slot order (the step's rows), their key
 * lengths, the slot -> row map `expand` (an idle slot reads row 0), the row -> slot map
 * `lrows`, and the self-attention cache's gather: row i's positions j < t from its parent's
 * row of the last step, position t from the new keys/values written after that step's cache.
 * Returns the number of rows. */
static nmt_status upload_step(nmt_decoder *d, int R, const int32_t *parent, const int32_t *tokens,
                              int *n_live) {
  const nmt_backend *be = d->m->be;
  const int CR = d->cap_rows, t = d->t;
  NMT_TRY(be->h2d_wait_src(d->m->ctx, 0));
  int32_t *ids = d->h_up, *klen = ids + CR, *expand = ids + 2 * CR, *lrows = ids + 3 * CR;
  int32_t *idx = ids + 4 * CR;
  int n = 0;
  for (int r = 0; r < R; r++) {
    d->h_pos_next[r] = tokens[r] >= 0 ? n : -1;
    expand[r] = tokens[r] >= 0 ? n : 0;
    if (tokens[r] < 0) continue;
    ids[n] = tokens[r];
    klen[n] = t + 1;
    lrows[n++] = r;
  }
  if (t > 0) {
    const size_t fresh = (size_t)d->live * t;
    for (int i = 0; i < n; i++)
      for (int j = 0; j <= t; j++) {
        const size_t src = j < t ? (size_t)d->h_pos[parent[lrows[i]]] * t + j : fresh + i;
        const size_t dst = (size_t)i * (t + 1) + j;
        idx[dst * 2] = (int32_t)(src * 2);
        idx[dst * 2 + 1] = (int32_t)(src * 2 + 1);
      }
  }
  const size_t n_up = 4 * (size_t)CR + (t > 0 ? (size_t)n * (t + 1) * 2 : 0);
  NMT_TRY(be->h2d_async(d->m->ctx, 0, d->up, d->h_up, n_up * sizeof(int32_t)));
  NMT_TRY(be->h2d_acquire(d->m->ctx, 0));
  *n_live = n;
  return NMT_OK;
}

/* Cross-attention of the n rows, in: their input (n, C): beam queries per sentence against its
 * source, so with idle slots (n < R) the queries are spread to the slots and the outputs
 * gathered back to the rows. Leaves the sublayer's output in o (n, C). */
static nmt_status cross_attention(nmt_decoder *d, const float *P, const sublayer *ca,
                                  const float *in, int l, int n_act, int n) {
  const nmt_model *m = d->m;
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int C = m->cfg.d_model, H = m->cfg.n_heads, R = n_act * d->beam;
  NMT_TRY(be->matmul_fwd(ctx, d->q, in, P + ca->wq, P + ca->bq, n, C, C));
  const float *q = d->q, *att = d->att;
  if (n < R) {
    NMT_TRY(gather(d, d->o, d->q, d->expand, R));
    q = d->o;
  }
  NMT_TRY(be->attention_fwd(ctx, d->att, d->probs, q, C, d->cross_kv[l], d->cross_kv[l] + C,
                            2 * C, d->klen_cross, n_act, d->beam, d->Ts, H, C / H, 0, 0.0f, 0,
                            0));
  if (n < R) {
    NMT_TRY(gather(d, d->q, d->att, d->lrows, n));
    att = d->q;
  }
  return be->matmul_fwd(ctx, d->o, att, P + ca->w2, P + ca->b2, n, C, C);
}

static nmt_status step_rows(nmt_decoder *d, const float *P, int n_act, const int32_t *act,
                            const int32_t *parent, const int32_t *tokens, int idle_ok,
                            const float **logits, int *n_live);

/* The ensemble's step, after this model's (its logits in d->logits, d->live rows): each
 * member's step on the same inputs, then *logits = zsum = sum_m w_m logits_m, in model order
 * from zero (exact for one model of weight 1, and for a model twice at 1/2 each). Ranking by
 * zsum is ranking by the weighted mean of log-probabilities, sum_m w_m (x_m - lse_m): the two
 * differ by a constant per row; nmt__decoder_select scores the ids it picks (logp_at). */
static nmt_status ensemble_step(nmt_decoder *d, int n_act, const int32_t *act,
                                const int32_t *parent, const int32_t *tokens, int idle_ok,
                                const float **logits) {
  const nmt_backend *be = d->m->be;
  void *ctx = d->m->ctx;
  const size_t n = (size_t)d->live * d->m->cfg.vocab;
  NMT_TRY(be->memset_zero(ctx, d->zsum, n * sizeof(float)));
  NMT_TRY(be->axpy(ctx, d->zsum, d->logits, d->w[0], n));
  for (int i = 0; i < d->n_mem; i++) {
    const float *lg;
    int live;
    NMT_TRY(step_rows(d->mem[i], d->mem_params[i], n_act, act, parent, tokens, idle_ok, &lg,
                      &live));
    if (live != d->live)
      return nmt_errorf(NMT_ERR_INTERNAL, "decoder: ensemble member %d stepped %d rows, not %d",
                        i + 1, live, d->live);
    NMT_TRY(be->axpy(ctx, d->zsum, lg, d->w[i + 1], n));
  }
  *logits = d->zsum;
  return NMT_OK;
}

/* One step over the live slots (tokens >= 0; -1 idle where idle_ok): *n_live rows, in slot
 * order, each computed as in the paper's decoder; *logits (n_live, vocab). */
static nmt_status step_rows(nmt_decoder *d, const float *P, int n_act, const int32_t *act,
                            const int32_t *parent, const int32_t *tokens, int idle_ok,
                            const float **logits, int *n_live) {
  nmt_model *m = d->m;
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int C = m->cfg.d_model, F = m->cfg.d_ff, H = m->cfg.n_heads, V = m->cfg.vocab;
  const int dk = C / H, L = m->cfg.dec_layers, t = d->t;
  NMT_TRY(check_step(d, n_act, act, parent, tokens, idle_ok));
  if (n_act != d->n_act) NMT_TRY(compact_sources(d, n_act, act));
  int n;
  NMT_TRY(upload_step(d, n_act * d->beam, parent, tokens, &n));
  /* Embedding of position t (§3.4, §3.5): the position table row t for every row. */
  NMT_TRY(be->embedding_fwd(ctx, d->x, d->ids, P + m->embed_off, m->pe + (size_t)t * C, n, 1, C,
                            sqrtf((float)C)));
  for (int l = 0; l < L; l++) {
    const sublayer *sa = &m->dec[3 * l], *ca = &m->dec[3 * l + 1], *ff = &m->dec[3 * l + 2];
    const float *in;
    /* causal self-attention over the cache; the new keys/values go after the last step's */
    NMT_TRY(sub_input(d, P, sa, n, &in));
    float *fresh = t == 0 ? d->self_kv[l] : d->self_kv[l] + (size_t)d->live * t * 2 * C;
    /* qkv weight rows are [W_q; W_k; W_v]: q from the first C rows, k|v from the other 2C. */
    NMT_TRY(be->matmul_fwd(ctx, d->q, in, P + sa->w1, P + sa->b1, n, C, C));
    NMT_TRY(be->matmul_fwd(ctx, fresh, in, P + sa->w1 + (size_t)C * C, P + sa->b1 + C, n, C,
                           2 * C));
    if (t > 0) {
      NMT_TRY(gather(d, d->self_spare, d->self_kv[l], d->gidx, n * (t + 1) * 2));
      float *tmp = d->self_kv[l];
      d->self_kv[l] = d->self_spare;
      d->self_spare = tmp;
    }
    NMT_TRY(be->attention_fwd(ctx, d->att, d->probs, d->q, C, d->self_kv[l], d->self_kv[l] + C,
                              2 * C, d->klen_self, n, 1, t + 1, H, dk, 0, 0.0f, 0, 0));
    NMT_TRY(be->matmul_fwd(ctx, d->o, d->att, P + sa->w2, P + sa->b2, n, C, C));
    NMT_TRY(residual(d, P, sa, n));
    NMT_TRY(sub_input(d, P, ca, n, &in));
    NMT_TRY(cross_attention(d, P, ca, in, l, n_act, n));
    NMT_TRY(residual(d, P, ca, n));
    /* feed-forward */
    NMT_TRY(sub_input(d, P, ff, n, &in));
    NMT_TRY(be->matmul_bias_relu_fwd(ctx, d->h, in, P + ff->w1, P + ff->b1, n, C, F));
    NMT_TRY(be->matmul_fwd(ctx, d->o, d->h, P + ff->w2, P + ff->b2, n, F, C));
    NMT_TRY(residual(d, P, ff, n));
  }
  const float *out = d->x;
  if (m->cfg.norm == NMT_NORM_PRE) {
    NMT_TRY(be->layernorm_fwd(ctx, d->y, d->mean, d->rstd, d->x, P + m->dec_ln.w, P + m->dec_ln.b,
                              n, C, m->cfg.ln_eps));
    out = d->y;
  }
  /* Output projection with the shared embedding (§3.4). */
  NMT_TRY(be->matmul_fwd(ctx, d->logits, out, P + m->embed_off, NULL, n, C, V));
  /* Every reader of this step's uploads is enqueued: the next ones may overwrite them. */
  NMT_TRY(be->h2d_release(ctx, 0));
  NMT_TRY(be->h2d_release(ctx, 1));
  memcpy(d->h_act, act, (size_t)n_act * sizeof *act);
  int32_t *tmp = d->h_pos;
  d->h_pos = d->h_pos_next, d->h_pos_next = tmp;
  d->n_act = n_act;
  d->rows = n_act * d->beam;
  d->live = n;
  d->t = t + 1;
  *logits = d->logits;
  *n_live = n;
  if (d->n_mem) NMT_TRY(ensemble_step(d, n_act, act, parent, tokens, idle_ok, logits));
  return NMT_OK;
}

nmt_status nmt_decoder_step(nmt_decoder *d, const float *params, int n_act, const int32_t *act,
                            const int32_t *parent, const int32_t *tokens, const float **logits) {
  int n;
  return step_rows(d, params, n_act, act, parent, tokens, 0, logits, &n);
}

nmt_status nmt__decoder_step_live(nmt_decoder *d, const float *params, int n_act,
                                  const int32_t *act, const int32_t *parent,
                                  const int32_t *tokens, const float **logits, int *n_live) {
  return step_rows(d, params, n_act, act, parent, tokens, 1, logits, n_live);
}

/* ------------------------------------------------------------------------------------------ */
/* the per-step selection and greedy */

nmt_model *nmt__decoder_model(nmt_decoder *d) { return d->m; }

int nmt__decode_limits(const nmt_model *m, const int32_t *src_lens, int B, int max_out,
                       int extra_len, int32_t *lim) {
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

nmt_status nmt__decoder_select(nmt_decoder *d, const float *logits, int R, int k, int with_logp,
                               const int32_t **ids, const float **logp) {
  nmt_model *m = d->m;
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  if (R < 1 || R > d->cap_rows || k < 1 || k > d->cap_k)
    return nmt_errorf(NMT_ERR_INTERNAL, "decoder: selection of %d per row over %d rows (room "
                      "for %d x %d)", k, R, d->cap_k, d->cap_rows);
  const size_t n = (size_t)R * k;
  const int ens = d->n_mem > 0 && with_logp;
  float *dev_logp = with_logp && !ens ? (float *)(d->sel + n) : NULL;
  NMT_TRY(be->logp_topk(ctx, d->sel, dev_logp, logits, R, m->cfg.vocab, k));
  /* An ensemble's ids come from the weighted logits; each model scores them (logp_at). */
  for (int i = 0; ens && i <= d->n_mem; i++)
    NMT_TRY(be->logp_at(ctx, (float *)(d->sel + (1 + i) * n), d->sel,
                        i ? d->mem[i - 1]->logits : d->logits, R, m->cfg.vocab, k));
  /* One copy into pinned memory behind the op, one wait: the step's only read back. */
  const size_t words = !with_logp ? 1 : ens ? 2 + (size_t)d->n_mem : 2;
  NMT_TRY(be->d2h_async(ctx, 0, d->h_sel, d->sel, words * n * sizeof(int32_t)));
  NMT_TRY(be->d2h_wait(ctx, 0));
  *ids = d->h_sel;
  if (logp) *logp = with_logp ? (const float *)(d->h_sel + n) : NULL;
  if (!ens) return NMT_OK;
  /* The ensemble's log-probability: sum_m w_m log p_m, in model order (fp32, as each term). */
  const float *g = (const float *)(d->h_sel + n);
  for (size_t i = 0; i < n; i++) {
    float acc = d->w[0] * g[i];
    for (int j = 1; j <= d->n_mem; j++) acc += d->w[j] * g[(size_t)j * n + i];
    d->h_comb[i] = acc;
  }
  if (logp) *logp = d->h_comb;
  return NMT_OK;
}

typedef struct {
  int32_t *lim, *act, *parent, *tokens;
} greedy_host;

nmt_status nmt_decoder_greedy(nmt_decoder *d, const float *params, const nmt_batch *b,
                              int max_out, int extra_len, int32_t *out_ids, int32_t *out_lens) {
  nmt_model *m = d->m;
  const nmt_backend *be = m->be;
  void *ctx = m->ctx;
  const int B = b->n_sent;
  if (max_out < 0) return nmt_errorf(NMT_ERR_USAGE, "decoder: greedy max_out %d < 0", max_out);
  if (B < 1) return nmt_errorf(NMT_ERR_DATA, "decoder: empty batch");
  nmt_status st = NMT_OK;
  greedy_host g;
  int32_t *all = malloc((size_t)B * 4 * sizeof(int32_t));
  if (!all) return nmt_errorf(NMT_ERR_NOMEM, "decoder: out of host memory");
  g.lim = all, g.act = all + B, g.parent = all + 2 * B, g.tokens = all + 3 * B;
  for (int i = 0; i < B; i++) {
    out_lens[i] = 0;
    for (int j = 0; j < max_out; j++) out_ids[(size_t)i * max_out + j] = NMT_PAD_ID;
  }
  /* copy_d2h returns once the data is there: no synchronize after it. */
  NMT_TRY_GOTO(st, be->copy_d2h(ctx, g.lim, b->src_lens, (size_t)B * sizeof(int32_t)), out);
  int longest = nmt__decode_limits(m, g.lim, B, max_out, extra_len, g.lim);
  if (longest == 0) goto out;
  NMT_TRY_GOTO(st, nmt_decoder_begin(d, params, b, 1, longest), out);
  int n_act = 0;
  for (int i = 0; i < B; i++)
    if (g.lim[i] > 0) {
      g.act[n_act] = i;
      g.tokens[n_act++] = NMT_BOS_ID;
    }
  for (int t = 0; n_act > 0; t++) {
    const float *logits;
    const int32_t *next;
    NMT_TRY_GOTO(st, nmt_decoder_step(d, params, n_act, g.act, g.parent, g.tokens, &logits), out);
    /* The best outputtable id of each row (never <pad> or <s>: nmt/backend.h logp_topk), the
     * step's only read back; below the minimum length the best two, and EOS is passed over
     * (a row's first id is the same either way). */
    const int kk = t < d->min_len ? 2 : 1;
    NMT_TRY_GOTO(st, nmt__decoder_select(d, logits, n_act, kk, 0, &next, NULL), out);
    int k = 0;
    for (int a = 0; a < n_act; a++) {
      int i = g.act[a];
      int32_t tok = next[(size_t)a * kk];
      if (kk == 2 && tok == NMT_EOS_ID) tok = next[(size_t)a * kk + 1];
      if (tok == NMT_EOS_ID || tok < 0) continue; /* -1: a vocabulary without outputs */
      out_ids[(size_t)i * max_out + out_lens[i]++] = tok;
      if (out_lens[i] >= g.lim[i]) continue;
      g.act[k] = i;
      g.parent[k] = a;
      g.tokens[k++] = tok;
    }
    n_act = k;
  }
out:
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

