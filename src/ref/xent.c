/* ref/xent.c — softmax cross-entropy with label smoothing (Szegedy et al. 2016; Vaswani et al.
 * 2017 §5.4) exactly as torch.nn.CrossEntropyLoss(label_smoothing=eps, ignore_index=PAD,
 * reduction='none'), writing the logits' gradient in place. */
#include <math.h>

#include "nmt/ref.h"
#include "nmt/types.h"

// logits: (M,V), overwritten by the gradient if write_grad; losses, nll (nullable), targets: (M)
nmt_status nmt_ref_xent_fwd_bwd(void *ctx, float *logits, float *losses, float *nll,
                                const int32_t *targets, int M, int V, float label_smoothing,
                                float dloss, const float *dloss_scale, int write_grad) {
  (void)ctx;
  if (dloss_scale) dloss *= *dloss_scale; /* the device-held loss scale (step_control) */
  if (M < 0 || V < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref xent: bad shape M=%d V=%d", M, V);
  /* Validate every target before touching any row, so an error leaves logits intact. */
  for (int r = 0; r < M; r++)
    if (targets[r] < 0 || targets[r] >= V)
      return nmt_errorf(NMT_ERR_INTERNAL, "ref xent: target %d at row %d outside [0, %d)",
                        (int)targets[r], r, V);
  double eps = label_smoothing;
  for (int r = 0; r < M; r++) {
    float *x = logits + (size_t)r * V;
    int t = targets[r];
    if (t == NMT_PAD_ID) {
      losses[r] = 0.0f;
      if (nll) nll[r] = 0.0f;
      if (write_grad)
        for (int j = 0; j < V; j++) x[j] = 0.0f;
      continue;
    }
    float mx = x[0];
    for (int j = 1; j < V; j++) mx = x[j] > mx ? x[j] : mx;
    float xt = x[t];
    double se = 0, sx = 0;
    /* One expf per logit: with write_grad the exponentials are parked in the row itself. */
    if (write_grad) {
      for (int j = 0; j < V; j++) {
        sx += x[j];
        x[j] = expf(x[j] - mx);
        se += x[j];
      }
    } else {
      for (int j = 0; j < V; j++) {
        sx += x[j];
        se += expf(x[j] - mx);
      }
    }
    double lse = (double)mx + log(se);
    /* -log p[v] = lse - x[v]; its mean over v is lse - mean(x). */
    losses[r] = (float)((1.0 - eps) * (lse - xt) + eps * (lse - sx / V));
    if (nll) nll[r] = (float)(lse - xt);
    if (write_grad) {
      float inv = (float)(1.0 / se);
      float off = (float)(eps / V);
      float on = (float)(1.0 - eps);
      for (int j = 0; j < V; j++) x[j] = dloss * (x[j] * inv - off);
      x[t] -= dloss * on;
    }
  }
  return NMT_OK;
}

/* ---- STUB: the half-storage ops, to be implemented ---- */
nmt_status nmt_ref_xent_half_fwd_bwd(void *ctx, nmt_act *logits, float *losses, float *nll, const int32_t *targets, int M, int V, float label_smoothing, float dloss, const float *dloss_scale, int write_grad) {
  (void)ctx; (void)logits; (void)losses; (void)nll; (void)targets; (void)M; (void)V; (void)label_smoothing; (void)dloss; (void)dloss_scale; (void)write_grad;
  return nmt_errorf(NMT_ERR_INTERNAL, "ref xent_half_fwd_bwd: not implemented yet");
}
