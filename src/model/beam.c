/* beam.c — beam search (Vaswani et al. 2017 §6.1: beam 4, length penalty 0.6) on the
 * incremental decoder of decode.c, with two ways of refilling the beam (nmt_beam_rule).
 *
 * Per step the device does the per-row work: the decoder step over the live hypotheses only
 * (a sentence's slots beyond its live ones are idle: nmt__decoder_step_live), then the
 * selection op (logp_topk: each row's best k outputtable ids and their log-probabilities), and
 * only those rows x k ids and floats come back (decode.c nmt__decoder_select). The host does what is per
 * sentence and small: each live row's running score (double) plus the row's candidates, a
 * sort of at most beam x k candidates, the length penalty of the few that finish, the stop
 * test, and the next step's parents and tokens.
 *
 * Rules (docs/decoding.md "Beam search"):
 * - shrink (Marian): of the candidates, the best k = beam - (finished so far) survive; an
 *   EOS among them finishes. A row's own top k suffices, so the op runs with k = beam.
 * - full (fairseq's sequence_generator, CTranslate2): beam live hypotheses per sentence at
 *   every step. Of the best 2 x beam candidates, an EOS within the first beam finishes, and
 *   the best beam that do not end (in order) live on; one row can supply all 2 x beam, so the
 *   op runs with k = 2 x beam.
 * Both: a live hypothesis reaching the length limit is finished without EOS; a sentence stops
 * when beam hypotheses have finished (shrink: its beam is used up; full: fairseq's
 * `len(finalized) == beam_size`, CTranslate2's patience 1), or earlier when no live hypothesis
 * can still enter its nbest finished ones (s / lp(limit) bounds what it can reach, log p <= 0
 * and alpha >= 0), which does not change the result. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model_impl.h"
#include "nmt/config.h"
#include "nmt/model.h"

/* GNMT length penalty lp(n) = ((5 + n) / 6)^alpha (Wu et al. 2016, eq. 14). */
static double length_penalty(int n, double alpha) { return pow((5.0 + n) / 6.0, alpha); }

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
  int beam, K, S, kr;        /* kr: candidates per row asked of the selection op */
  int min_len;               /* no EOS before this many tokens (nmt_decoder_set_min_len) */
  int stride, no_eos;        /* this step's: ids per row of the selection; EOS passed over */
  nmt_beam_rule rule;
  double alpha;
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
  cand *cands;               /* (beam * kr) */
} beam_host;

static void beam_host_free(beam_host *h) {
  free(h->lim), free(h->n_fin), free(h->alive), free(h->n_best), free(h->best);
  free(h->best_logp), free(h->best_len), free(h->best_ids), free(h->score), free(h->score2);
  free(h->pre), free(h->pre2), free(h->act), free(h->act2), free(h->parent), free(h->tokens);
  free(h->cands);
}

static nmt_status beam_host_alloc(beam_host *h, int B, int beam, int K, int S, int kr) {
  const size_t R = (size_t)B * beam, BK = (size_t)B * K;
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
  h->cands = malloc((size_t)beam * kr * sizeof(cand));
  if (!h->lim || !h->n_fin || !h->alive || !h->n_best || !h->best || !h->best_logp ||
      !h->best_len || !h->best_ids || !h->score || !h->score2 || !h->pre || !h->pre2 || !h->act ||
      !h->act2 || !h->parent || !h->tokens || !h->cands) {
    beam_host_free(h);
    return nmt_errorf(NMT_ERR_NOMEM, "beam search: out of host memory (%zu rows)", R);
  }
  return NMT_OK;
}

/* Records a finished hypothesis (ids[0..len), score = log p, |y| = ylen) of sentence i among
 * its K best by normalised score; a later one ranks after an equal earlier one. */
static void finish(beam_host *h, int i, const int32_t *ids, int len, double score, int ylen) {
  const int K = h->K, S = h->S;
  const double norm = score / length_penalty(ylen, h->alpha);
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

/* The candidates of active sentence a (live slots a*beam + j, j < alive, which the step
 * computed as rows first + j): each row's first `per_row` selected ids (EOS passed over below
 * the minimum length) with its score plus their log-probabilities, sorted best first.
 * Returns their number. */
static int gather_cands(beam_host *h, int a, int i, int first, int per_row, const int32_t *ids,
                        const float *logp) {
  int nc = 0;
  for (int j = 0; j < h->alive[i]; j++) {
    const int row = a * h->beam + j;
    const int32_t *ri = ids + (size_t)(first + j) * h->stride;
    const float *rl = logp + (size_t)(first + j) * h->stride;
    for (int r = 0, taken = 0; r < h->stride && taken < per_row && ri[r] >= 0; r++) {
      if (h->no_eos && ri[r] == NMT_EOS_ID) continue;
      const double lp = rl[r] == rl[r] ? (double)rl[r] : -INFINITY; /* a row holding +inf */
      h->cands[nc++] = (cand){h->score[row] + lp, row, r, ri[r]};
      taken++;
    }
  }
  qsort(h->cands, (size_t)nc, sizeof *h->cands, cand_cmp);
  return nc;
}

/* Candidate x of sentence i at step t lives on in slot base + alive of the next layout, or
 * finishes there at the length limit. Returns 1 if it lives. */
static int extend(beam_host *h, int i, int t, const cand *x, int slot) {
  const int S = h->S;
  int32_t *np = h->pre2 + (size_t)slot * S;
  memcpy(np, h->pre + (size_t)x->row * S, (size_t)t * sizeof(int32_t));
  np[t] = x->tok;
  if (t + 1 >= h->lim[i]) {
    finish(h, i, np, t + 1, x->score, t + 1);
    return 0;
  }
  h->score2[slot] = x->score;
  h->parent[slot] = x->row;
  h->tokens[slot] = x->tok;
  return 1;
}

/* One step's selection for active sentence a (sentence i; its live hypotheses are the
 * step's rows first..): returns the number alive afterwards and whether the sentence is done.
 * base: its first slot in the next layout. */
static int select_step(beam_host *h, int a, int i, int t, int first, const int32_t *ids,
                       const float *logp, int base, int *done) {
  const int beam = h->beam, K = h->K;
  int alive = 0;
  if (h->rule == NMT_BEAM_SHRINK) {
    /* The best k = beam - finished survive: EOS finishes, the others live on. */
    const int k = beam - h->n_fin[i];
    const int nc = gather_cands(h, a, i, first, k, ids, logp);
    for (int c = 0; c < nc && c < k; c++) {
      const cand *x = &h->cands[c];
      if (x->tok == NMT_EOS_ID) finish(h, i, h->pre + (size_t)x->row * h->S, t, x->score, t + 1);
      else alive += extend(h, i, t, x, base + alive);
    }
  } else {
    /* Of the best 2 x beam: an EOS in the first beam finishes, the first beam others live on
     * (at the length limit, those in the first beam finish instead). */
    const int nc = gather_cands(h, a, i, first, 2 * beam, ids, logp);
    int used = 0; /* candidates that do not end, taken so far */
    for (int c = 0; c < nc && c < 2 * beam && used < beam; c++) {
      const cand *x = &h->cands[c];
      if (x->tok == NMT_EOS_ID) {
        if (c < beam) finish(h, i, h->pre + (size_t)x->row * h->S, t, x->score, t + 1);
        continue;
      }
      used++;
      if (t + 1 >= h->lim[i] && c >= beam) continue;
      alive += extend(h, i, t, x, base + alive);
    }
  }
  /* Done when no live hypothesis is left, or beam have finished, or none can still enter the
   * K best finished ones: its normalised score can reach at most s / lp(limit). */
  *done = alive == 0 || h->n_fin[i] >= beam;
  if (!*done && h->n_best[i] == K) {
    const double lp = length_penalty(h->lim[i], h->alpha), kth = h->best[(size_t)i * K + K - 1];
    *done = 1;
    for (int j = 0; j < alive; j++)
      if (h->score2[base + j] / lp > kth) *done = 0;
  }
  return alive;
}

static nmt_status check_args(int beam, int K, float alpha, int max_out, int B,
                             nmt_beam_rule rule) {
  if (max_out < 0) return nmt_errorf(NMT_ERR_USAGE, "beam search: max_out %d < 0", max_out);
  if (beam < 1 || beam > NMT_TOPK_MAX / 2)
    return nmt_errorf(NMT_ERR_USAGE, "beam search: beam %d outside [1, %d]", beam,
                      NMT_TOPK_MAX / 2);
  if (K < 1 || K > beam)
    return nmt_errorf(NMT_ERR_USAGE, "beam search: n-best %d outside [1, beam %d]", K, beam);
  if (!(alpha >= 0.0f && alpha <= 100.0f))
    return nmt_errorf(NMT_ERR_USAGE, "beam search: length penalty alpha %g outside [0, 100]",
                      (double)alpha);
  if (rule != NMT_BEAM_SHRINK && rule != NMT_BEAM_FULL)
    return nmt_errorf(NMT_ERR_USAGE, "beam search: rule %d is neither shrink (%d) nor full (%d)",
                      (int)rule, NMT_BEAM_SHRINK, NMT_BEAM_FULL);
  if (B < 1) return nmt_errorf(NMT_ERR_DATA, "beam search: empty batch");
  return NMT_OK;
}

/* The search proper, from BOS to the last sentence done. */
static nmt_status search(nmt_decoder *d, const float *params, beam_host *h, int B) {
  const int beam = h->beam;
  int n_act = 0;
  /* Step 0: one live hypothesis (BOS) per sentence; the other slots are idle (token -1). */
  for (int i = 0; i < B; i++) {
    if (h->lim[i] == 0) continue;
    h->alive[i] = 1;
    h->score[(size_t)n_act * beam] = 0.0;
    for (int j = 0; j < beam; j++) h->tokens[(size_t)n_act * beam + j] = j ? -1 : NMT_BOS_ID;
    h->act[n_act++] = i;
  }
  for (int t = 0; n_act > 0; t++) {
    const float *dl, *logp;
    const int32_t *ids;
    int rows, live = 0;
    NMT_TRY(nmt__decoder_step_live(d, params, n_act, h->act, h->parent, h->tokens, &dl, &rows));
    for (int a = 0; a < n_act; a++) live += h->alive[h->act[a]];
    if (rows != live)
      return nmt_errorf(NMT_ERR_INTERNAL, "beam search: the step computed %d rows for %d live "
                        "hypotheses", rows, live);
    /* Below the minimum length EOS is no candidate: shrink then needs a row's best beam
     * others, within its best beam + 1; full's best beam others are within its 2 x beam. */
    h->no_eos = t < h->min_len;
    h->stride = h->no_eos && h->rule == NMT_BEAM_SHRINK ? h->kr + 1 : h->kr;
    NMT_TRY(nmt__decoder_select(d, dl, rows, h->stride, 1, &ids, &logp));
    int n_next = 0;
    for (int a = 0, first = 0; a < n_act; a++) {
      const int i = h->act[a], base = n_next * beam, live_i = h->alive[i];
      int done;
      const int alive = select_step(h, a, i, t, first, ids, logp, base, &done);
      first += live_i;
      if (done) continue;
      h->alive[i] = alive;
      for (int j = alive; j < beam; j++) {
        h->parent[base + j] = h->parent[base];
        h->tokens[base + j] = -1; /* idle */
      }
      h->act2[n_next++] = i;
    }
    /* Swap current and next layouts. */
    n_act = n_next;
    int32_t *ti = h->act;
    h->act = h->act2, h->act2 = ti;
    ti = h->pre;
    h->pre = h->pre2, h->pre2 = ti;
    double *td = h->score;
    h->score = h->score2, h->score2 = td;
  }
  return NMT_OK;
}

nmt_status nmt_decoder_beam_nbest(nmt_decoder *d, const float *params, const nmt_batch *b,
                                  int beam, float alpha, nmt_beam_rule rule, int max_out,
                                  int extra_len, int nbest, int32_t *out_ids, int32_t *out_lens,
                                  int32_t *out_n, float *out_scores, float *out_logp) {
  nmt_model *m = nmt__decoder_model(d);
  const int B = b->n_sent, K = nbest;
  NMT_TRY(check_args(beam, K, alpha, max_out, B, rule));
  for (size_t i = 0; i < (size_t)B * K; i++) {
    out_lens[i] = 0;
    if (out_scores) out_scores[i] = 0.0f;
    if (out_logp) out_logp[i] = 0.0f;
    for (int j = 0; j < max_out; j++) out_ids[i * max_out + j] = NMT_PAD_ID;
  }
  for (int i = 0; i < B; i++) if (out_n) out_n[i] = 0;
  int32_t *src_lens = malloc((size_t)B * sizeof(int32_t));
  if (!src_lens) return nmt_errorf(NMT_ERR_NOMEM, "beam search: out of host memory");
  /* copy_d2h returns once the data is there. */
  nmt_status st = m->be->copy_d2h(m->ctx, src_lens, b->src_lens, (size_t)B * sizeof(int32_t));
  if (st != NMT_OK) {
    free(src_lens);
    return st;
  }
  const int S = nmt__decode_limits(m, src_lens, B, max_out, extra_len, src_lens);
  beam_host h = {.beam = beam, .K = K, .S = S, .kr = rule == NMT_BEAM_FULL ? 2 * beam : beam,
                 .min_len = nmt__decoder_min_len(d), .rule = rule, .alpha = alpha};
  if (S == 0 || (st = beam_host_alloc(&h, B, beam, K, S, h.kr)) != NMT_OK) {
    free(src_lens);
    return st;
  }
  memcpy(h.lim, src_lens, (size_t)B * sizeof(int32_t));
  free(src_lens);
  NMT_TRY_GOTO(st, nmt_decoder_begin(d, params, b, beam, S), out);
  NMT_TRY_GOTO(st, search(d, params, &h, B), out);
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
                            float alpha, nmt_beam_rule rule, int max_out, int extra_len,
                            int32_t *out_ids, int32_t *out_lens, float *out_scores) {
  return nmt_decoder_beam_nbest(d, params, b, beam, alpha, rule, max_out, extra_len, 1, out_ids,
                                out_lens, NULL, out_scores, NULL);
}
