/* ref/relu.c — ReLU of the position-wise feed-forward network (Vaswani et al. 2017 §3.3). */
#include "nmt/ref.h"

nmt_status nmt_ref_relu_fwd(void *ctx, float *out, const float *inp, size_t n) {
  (void)ctx;
  for (size_t i = 0; i < n; i++) out[i] = inp[i] > 0.0f ? inp[i] : 0.0f;
  return NMT_OK;
}

/* Uses the output, not the input, so out may have overwritten inp in place. */
nmt_status nmt_ref_relu_bwd(void *ctx, float *dinp, const float *dout, const float *out,
                            size_t n) {
  (void)ctx;
  if (!dinp) return NMT_OK;
  for (size_t i = 0; i < n; i++) dinp[i] += out[i] > 0.0f ? dout[i] : 0.0f;
  return NMT_OK;
}
