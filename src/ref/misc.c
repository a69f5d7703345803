/* ref/misc.c — memory ops (plain host memory) and small vector ops of the reference backend. */
#include <stdlib.h>
#include <string.h>

#include "nmt/ref.h"

nmt_status nmt_ref_device_count(int *out) {
  *out = 1;
  return NMT_OK;
}

nmt_status nmt_ref_ctx_create(int device, void **ctx) {
  (void)device;
  *ctx = NULL;
  return NMT_OK;
}

void nmt_ref_ctx_destroy(void *ctx) { (void)ctx; }

nmt_status nmt_ref_set_precision(void *ctx, nmt_precision mode) {
  (void)ctx;
  if (mode != NMT_PRECISION_FP32 && mode != NMT_PRECISION_TF32)
    return nmt_errorf(NMT_ERR_CONFIG, "ref backend: precision mode %d is not implemented (fp32 "
                                      "and tf32 are, both computed in fp32)", (int)mode);
  return NMT_OK;
}

nmt_status nmt_ref_malloc(void *ctx, size_t bytes, void **out) {
  (void)ctx;
  /* 64-byte alignment keeps rows SIMD- and cache-line-aligned; 0 bytes still gives a pointer. */
  size_t rounded = (bytes + 63) / 64 * 64;
  void *p = NULL;
  if (rounded == 0) rounded = 64;
  if (rounded < bytes || posix_memalign(&p, 64, rounded) != 0)
    return nmt_errorf(NMT_ERR_NOMEM, "ref backend: cannot allocate %zu bytes of host memory",
                      bytes);
  *out = p;
  return NMT_OK;
}

void nmt_ref_free(void *ctx, void *p) {
  (void)ctx;
  free(p);
}

nmt_status nmt_ref_memset_zero(void *ctx, void *p, size_t bytes) {
  (void)ctx;
  if (bytes) memset(p, 0, bytes);
  return NMT_OK;
}

nmt_status nmt_ref_copy_h2d(void *ctx, void *dst, const void *src, size_t bytes) {
  (void)ctx;
  if (bytes && dst != src) memmove(dst, src, bytes);
  return NMT_OK;
}

nmt_status nmt_ref_copy_d2h(void *ctx, void *dst, const void *src, size_t bytes) {
  (void)ctx;
  if (bytes && dst != src) memmove(dst, src, bytes);
  return NMT_OK;
}

nmt_status nmt_ref_synchronize(void *ctx) {
  (void)ctx;
  return NMT_OK;
}

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
