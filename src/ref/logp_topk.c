/* ref/logp_topk.c — the k most likely outputs of each row of logits and their
 * log-probabilities, the per-step selection of beam search and greedy decoding (Vaswani et al.
 * 2017 §6.1; the search itself is src/model/beam.c). cuda/logp_topk.cu is the CUDA twin;
 * the contract is nmt/backend.h's logp_topk.
 *
 * This op runs once per decoding step over every row of the (rows, vocab) logits, so on the
 * CPU it is a measurable part of beam search (issue 23: 17% of a beam-4 run before it was
 * written this way), and its loops are shaped for the compiler's vectorizer:
 * - the top k: a row is read in blocks of BLK; a block's maximum is one vector reduction, and
 *   only a block whose maximum beats the k-th best key so far is looked at id by id (insertion
 *   into the sorted k best). After the first blocks almost none is, so a row costs about one
 *   pass of vector compares for the small k of beam search;
 * - the log-sum-exp over the whole row (every id counts in the normaliser, <pad> and <s>
 *   included, as fairseq's lprobs[:, pad] = -inf after log_softmax): exp(x - max) in fp32 by
 *   exp_neg4 below (plain arithmetic on vectors; libm's expf is a call per element), summed in
 *   8 double lanes added pairwise in a fixed order at the end, then the log and each
 *   log-probability in double, rounded to float once. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "nmt/ref.h"
#include "nmt/types.h"

/* Vectors of 4 lanes (GCC/Clang vector extensions: SSE2 on any x86-64, NEON on arm64): the
 * compiler does not vectorize these loops itself, because without -ffast-math a
 * floating-point compare or select may not be executed speculatively. A row is read in blocks
 * of BLK = 4 vectors. */
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef float v2f __attribute__((vector_size(8)));
typedef double v2d __attribute__((vector_size(16)));
enum { BLK = 16 };

static inline v4f splat(float x) { return (v4f){x, x, x, x}; }
static inline v4f load4(const float *p) {
  v4f v;
  memcpy(&v, p, sizeof v);
  return v;
}
/* m ? a : b, lane by lane (m: all ones or all zeros per lane, as a vector compare gives). */
static inline v4f select4(v4i m, v4f a, v4f b) { return (v4f)((m & (v4i)a) | (~m & (v4i)b)); }
/* key() per lane: NaN becomes -inf. */
static inline v4f key4(v4f x) { return select4(x == x, x, splat(-INFINITY)); }
/* x > m ? x : m per lane (NaN never wins). */
static inline v4f max4(v4f x, v4f m) { return select4(x > m, x, m); }

/* e^x per lane, in fp32, for x <= 0 (x = -inf included; not NaN): 0 below -87 (e^-87 =
 * 1.6e-38, nothing next to the row's largest term, which is 1). Range reduction x = n ln2 + r,
 * |r| <= ln2 / 2, with ln2 in two parts, Cephes' degree-7 polynomial for e^r (S. L. Moshier,
 * Cephes Math Library, expf.c: relative error below 2e-7, as libm's expf within an ulp or
 * two), and 2^n built in the exponent bits. */
static inline v4f exp_neg4(v4f x) {
  const v4i small = x < splat(-87.0f);
  const v4f xc = select4(small, splat(-87.0f), x);
  /* nearest integer of xc log2(e) <= 0: truncation of t - 0.5 rounds toward zero, i.e. up */
  const v4i n = __builtin_convertvector(xc * splat(1.44269504088896341f) - splat(0.5f), v4i);
  const v4f fn = __builtin_convertvector(n, v4f);
  const v4f r = (xc - fn * splat(0.693359375f)) + fn * splat(2.12194440e-4f);
  v4f p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  const v4f scale = (v4f)((n + 127) << 23); /* n in [-126, 0]: a normal power of two */
  return (v4f)(~small & (v4i)(p * scale));
}

/* The largest of x[0, BLK) (NaN never wins; -inf when nothing beats it). */
static inline float block_max(const float *x) {
  v4f m = max4(max4(load4(x), load4(x + 4)), max4(load4(x + 8), load4(x + 12)));
  float b = m[0];
  for (int j = 1; j < 4; j++) b = m[j] > b ? m[j] : b;
  return b;
}

/* <pad> and <s> are never outputs: no training target is one of them. */
static inline int never_output(int v) { return v == NMT_PAD_ID || v == NMT_BOS_ID; }

/* NaN orders like -inf, so it never outranks a number. */
static inline float key(float v) { return v == v ? v : -INFINITY; }

/* Inserts ids [v0, v1) of x into the sorted k best idx/kv (n of them so far); returns n. */
static int insert_range(const float *x, int v0, int v1, int k, int n, int32_t *idx, float *kv) {
  for (int v = v0; v < v1; v++) {
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

/* idx[0, n) = the k best ids of x (V) by key, largest first, lower id first on ties; returns
 * n = min(k, outputtable ids). kv holds their keys; *mx gets the row's largest value (NaN
 * ignored; -inf if none). */
static int topk_row(const float *x, int V, int k, int32_t *idx, float *kv, float *mx) {
  int n = 0, v = 0;
  float m = -INFINITY;
  for (; v + BLK <= V; v += BLK) {
    const float bm = block_max(x + v);
    m = bm > m ? bm : m;
    /* No id of the block can enter: its best is not above the k-th (NaN keys are -inf). */
    if (n == k && !(bm > kv[k - 1])) continue;
    n = insert_range(x, v, v + BLK, k, n, idx, kv);
  }
  for (int t = v; t < V; t++) m = x[t] > m ? x[t] : m;
  *mx = m;
  return insert_range(x, v, V, k, n, idx, kv);
}

/* log sum_v exp(key(x_v)), given the row's largest value mx: -inf for a row of -inf/NaN
 * only, NaN with a +inf. The terms in fp32, summed in double: 8 lanes, then pairwise. */
static double logsumexp(const float *x, int V, float mx) {
  if (mx == -INFINITY) return -INFINITY;
  if (mx == INFINITY) return NAN;
  const v4f m = splat(mx);
  /* four named accumulators of two doubles: 16-byte vectors that stay in registers (an array
   * of them, more of them next to exp_neg4's constants, or 32-byte vectors without AVX, are
   * kept in memory) */
  v2d a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
  float tail[BLK];
  for (int v = 0; v < V; v += BLK) {
    const float *b = x + v;
    if (v + BLK > V) { /* the last, partial block: -inf beyond the row adds 0 */
      for (int j = 0; j < BLK; j++) tail[j] = v + j < V ? x[v + j] : -INFINITY;
      b = tail;
    }
#define ACC_(lo, hi, off)                                                            \
  do {                                                                               \
    const v4f e = exp_neg4(key4(load4(b + (off))) - m);                             \
    lo += __builtin_convertvector(__builtin_shufflevector(e, e, 0, 1), v2d);         \
    hi += __builtin_convertvector(__builtin_shufflevector(e, e, 2, 3), v2d);         \
  } while (0)
    ACC_(a0, a1, 0);
    ACC_(a2, a3, 4);
    ACC_(a0, a1, 8);
    ACC_(a2, a3, 12);
#undef ACC_
  }
  const v2d t = (a0 + a1) + (a2 + a3);
  const double s = t[0] + t[1];
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
    float mx;
    const int n = topk_row(row, V, k, ri, kv, &mx);
    for (int j = n; j < k; j++) ri[j] = -1;
    if (!logp) continue;
    const double lse = logsumexp(row, V, mx);
    float *rl = logp + (size_t)r * k;
    for (int j = 0; j < k; j++)
      rl[j] = j >= n || lse == -INFINITY ? -INFINITY : (float)((double)kv[j] - lse);
  }
  return NMT_OK;
}
