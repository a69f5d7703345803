/* ref/reductions.c — the reference backend's small vector ops and reductions: add, axpy,
 * sum_acc, sumsq (double accumulation), count_targets and argmax. cuda/reductions.cu is the
 * CUDA counterpart. */
#include <stdint.h>

#include "nmt/config.h"
#include "nmt/ref.h"

nmt_status nmt_ref_add(void *ctx, float *out, const float *a, const float *b, size_t n) {
  (void)ctx;
  for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
  return NMT_OK;
}

nmt_status nmt_ref_axpy(void *ctx, float *y, const float *x, float alpha, size_t n) {
  (void)ctx;
  for (size_t i = 0; i < n; i++) y[i] += alpha * x[i];
  return NMT_OK;
}

nmt_status nmt_ref_sum_acc(void *ctx, float *dst, const float *x, size_t n) {
  (void)ctx;
  double s = 0;
  for (size_t i = 0; i < n; i++) s += x[i];
  *dst = (float)((double)*dst + s);
  return NMT_OK;
}

nmt_status nmt_ref_sumsq(void *ctx, float *dst, const float *x, size_t n) {
  (void)ctx;
  /* Double: this feeds the gradient norm over ~1e8 elements, where a float sum loses digits. */
  double s = 0;
  for (size_t i = 0; i < n; i++) s += (double)x[i] * x[i];
  *dst = (float)s;
  return NMT_OK;
}

nmt_status nmt_ref_count_targets(void *ctx, float *dst, const int32_t *targets, size_t n) {
  (void)ctx;
  int64_t c = 0;
  for (size_t i = 0; i < n; i++) c += targets[i] != NMT_PAD_ID;
  *dst += (float)c;
  return NMT_OK;
}

nmt_status nmt_ref_argmax(void *ctx, int32_t *out, const float *x, int M, int V) {
  (void)ctx;
  if (M < 0 || V < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref argmax: bad shape M=%d V=%d", M, V);
  for (int r = 0; r < M; r++) {
    const float *row = x + (size_t)r * V;
    int best = 0;
    float bv = row[0];
    /* Strict > keeps the first index on ties; NaN never wins. */
    for (int j = 1; j < V; j++)
      if (row[j] > bv || (bv != bv && row[j] == row[j])) {
        bv = row[j];
        best = j;
      }
    out[r] = best;
  }
  return NMT_OK;
}
