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
 *   exp_neg (logp_topk_lanes.h: plain arithmetic on vectors; libm's expf is a call per
 *   element), summed in 8 double lanes added in a fixed tree at the end, then the log and each
 *   log-probability in double, rounded to float once. */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "nmt/ref.h"
#include "nmt/types.h"

/* The vector loops are written once, for vectors of LANES floats (GCC/Clang vector
 * extensions: the compiler does not vectorize these loops itself, because without -ffast-math
 * a floating-point compare or select may not be executed speculatively), in
 * logp_topk_lanes.h, included twice: 4 lanes for the x86-64 baseline (SSE2) and any other
 * target (NEON on arm64), 8 lanes compiled for AVX2 where the CPU has it (chosen at the first
 * call; nmt__ref_logp_topk_path). Each lane computes the same fp32 operations, and the double
 * sums keep the same 8 accumulators and the same final tree, so both give the same bits; a
 * test checks it (logp_topk_paths_are_bitwise_equal). No FMA is enabled anywhere (and
 * -std=c11 contracts nothing). A row is read in blocks of BLK = 16 floats. */
enum { BLK = 16 };
#define INL static inline __attribute__((always_inline))

/* <pad> and <s> are never outputs: no training target is one of them. */
INL int never_output(int v) { return v == NMT_PAD_ID || v == NMT_BOS_ID; }

/* NaN orders like -inf, so it never outranks a number. */
INL float key(float v) { return v == v ? v : -INFINITY; }

/* Inserts ids [v0, v1) of x into the sorted k best idx/kv (n of them so far); returns n. */
INL int insert_range(const float *x, int v0, int v1, int k, int n, int32_t *idx, float *kv) {
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

/* rows_4: 16-byte vectors, any target. */
#define LANES 4
#include "logp_topk_lanes.h"
#undef LANES

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_AVX2_PATH 1
/* rows_8, compiled for AVX2 (its 32-byte vectors in ymm registers). Every function taking or
 * returning them is inlined into it, so the calling convention of 32-byte vectors without
 * AVX, which GCC warns about, is never used. */
#pragma GCC diagnostic ignored "-Wpsabi"
#define LANES 8
#define LANES_TARGET __attribute__((target("avx2")))
#include "logp_topk_lanes.h"
#undef LANES_TARGET
#undef LANES
#else
#define HAVE_AVX2_PATH 0
#endif

/* -1: not chosen yet; else 1 for rows_8 (AVX2), 0 for rows_4. Chosen once, racing threads
 * write the same value. */
static _Atomic int path = -1;

static int avx2_supported(void) {
#if HAVE_AVX2_PATH
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
  return 0;
#endif
}

int nmt__ref_logp_topk_path(int want) {
  if (want == 1 && !avx2_supported()) return -1;
  if (want == 0 || want == 1) atomic_store(&path, want);
  else atomic_store(&path, avx2_supported());
  return atomic_load(&path);
}

// x: (R,V) logits; ids, logp: (R,k); logp may be NULL
nmt_status nmt_ref_logp_topk(void *ctx, int32_t *ids, float *logp, const float *x, int R, int V,
                             int k) {
  (void)ctx;
  if (R < 0 || V < 1 || k < 1 || k > NMT_TOPK_MAX || (R > 0 && (!ids || !x)))
    return nmt_errorf(NMT_ERR_INTERNAL, "ref logp_topk: bad arguments R=%d V=%d k=%d (k in "
                      "[1, %d])", R, V, k, NMT_TOPK_MAX);
  int p = atomic_load_explicit(&path, memory_order_relaxed);
  if (p < 0) p = nmt__ref_logp_topk_path(-1);
#if HAVE_AVX2_PATH
  if (p == 1) {
    rows_8(ids, logp, x, R, V, k);
    return NMT_OK;
  }
#endif
  rows_4(ids, logp, x, R, V, k);
  return NMT_OK;
}

// x: (R,V) logits; ids, logp: (R,k)
nmt_status nmt_ref_logp_at(void *ctx, float *logp, const int32_t *ids, const float *x, int R,
                           int V, int k) {
  (void)ctx;
  if (R < 0 || V < 1 || k < 1 || k > NMT_TOPK_MAX || (R > 0 && (!ids || !x || !logp)))
    return nmt_errorf(NMT_ERR_INTERNAL, "ref logp_at: bad arguments R=%d V=%d k=%d (k in "
                      "[1, %d])", R, V, k, NMT_TOPK_MAX);
  int p = atomic_load_explicit(&path, memory_order_relaxed);
  if (p < 0) p = nmt__ref_logp_topk_path(-1);
#if HAVE_AVX2_PATH
  if (p == 1) {
    rows_at_8(logp, ids, x, R, V, k);
    return NMT_OK;
  }
#endif
  rows_at_4(logp, ids, x, R, V, k);
  return NMT_OK;
}
