/* ref/logp_topk.c — the k most likely outputs of each row of logits and their
 * log-probabilities, the per-step selection of beam search and greedy decoding (Vaswani et al.
 * 2017 §6.1; the search itself is src/model/beam.c). cuda/logp_topk.cu is the CUDA twin;
 * the contract is nmt/backend.h's logp_topk.
 *
 * Per row: one pass keeps the k best outputtable ids in a sorted list (insertion behind a
 * threshold, so a row costs about V comparisons for the small k of beam search), and, when
 * log-probabilities are wanted, the log-sum-exp of the whole row in double (every id counts in
 * the normaliser, <pad> and <s> included, as fairseq's lprobs[:, pad] = -inf after
 * log_softmax). */
#include <math.h>

#include "nmt/ref.h"
#include "nmt/types.h"

/* <pad> and <s> are never outputs: no training target is one of them. */
static inline int never_output(int v) { return v == NMT_PAD_ID || v == NMT_BOS_ID; }

/* NaN orders like -inf, so it never outranks a number. */
static inline float key(float v) { return v == v ? v : -INFINITY; }

/* idx[0, n) = the k best ids of x (V) by key, largest first, lower id first on ties; returns
 * n = min(k, outputtable ids). kv holds their keys. */
static int topk_row(const float *x, int V, int k, int32_t *idx, float *kv) {
  int n = 0;
  for (int v = 0; v < V; v++) {
    const float xv = key(x[v]);
    /* Ids come in increasing order, so an equal key ranks after every kept one. */
    if (n == k && !(xv > kv[k - 1])) continue;
    if (never_output(v)) continue;
    int pos = n < k ? n++ : k - 1;
    while (pos > 0 && xv > kv[pos - 1]) {
      idx[pos] = idx[pos - 1];
      kv[pos] = kv[pos - 1];
      pos--;
    }
    idx[pos] = v;
    kv[pos] = xv;
  }
  return n;
}

/* log sum_v exp(key(x_v)) in double: -inf for a row of -inf/NaN only, NaN with a +inf. */
static double logsumexp(const float *x, int V) {
  float mx = -INFINITY;
  for (int v = 0; v < V; v++) mx = x[v] > mx ? x[v] : mx; /* NaN never compares greater */
  if (mx == -INFINITY) return -INFINITY;
  if (mx == INFINITY) return NAN;
  double s = 0;
  for (int v = 0; v < V; v++)
    if (x[v] == x[v]) s += exp((double)x[v] - mx);
  return mx + log(s);
}

// x: (R,V) logits; ids, logp: (R,k); logp may be NULL
nmt_status nmt_ref_logp_topk(void *ctx, int32_t *ids, float *logp, const float *x, int R, int V,
                             int k) {
  (void)ctx;
  if (R < 0 || V < 1 || k < 1 || k > NMT_TOPK_MAX || (R > 0 && (!ids || !x)))
    return nmt_errorf(NMT_ERR_INTERNAL, "ref logp_topk: bad arguments R=%d V=%d k=%d (k in "
                      "[1, %d])", R, V, k, NMT_TOPK_MAX);
  float kv[NMT_TOPK_MAX];
  for (int r = 0; r < R; r++) {
    const float *row = x + (size_t)r * V;
    int32_t *ri = ids + (size_t)r * k;
    const int n = topk_row(row, V, k, ri, kv);
    for (int j = n; j < k; j++) ri[j] = -1;
    if (!logp) continue;
    const double lse = logsumexp(row, V);
    float *rl = logp + (size_t)r * k;
    for (int j = 0; j < k; j++)
      rl[j] = j >= n || lse == -INFINITY ? -INFINITY : (float)((double)kv[j] - lse);
  }
  return NMT_OK;
}
