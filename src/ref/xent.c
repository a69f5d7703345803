/* ref/xent.c — softmax cross-entropy with label smoothing (Szegedy et al. 2016; Vaswani et al.
 * 2017 §5.4) exactly as torch.nn.CrossEntropyLoss(label_smoothing=eps, ignore_index=PAD,
 * reduction='none'), writing the logits' gradient in place. */
#include <math.h>

#include "nmt/half.h"
#include "nmt/ref.h"
#include "nmt/types.h"

/* One row x (V) with target t: the loss into *loss (and *nll), and with write_grad the
 * gradient dloss * (p - (1-eps) onehot(t) - eps/V) over x. */
static void xent_row(float *x, int t, int V, float label_smoothing, float dloss, int write_grad,
                     float *loss, float *nll) {
  const double eps = label_smoothing;
  if (t == NMT_PAD_ID) {
    *loss = 0.0f;
    if (nll) *nll = 0.0f;
    if (write_grad)
      for (int j = 0; j < V; j++) x[j] = 0.0f;
    return;
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
  *loss = (float)((1.0 - eps) * (lse - xt) + eps * (lse - sx / V));
  if (nll) *nll = (float)(lse - xt);
  if (write_grad) {
    float inv = (float)(1.0 / se);
    float off = (float)(eps / V);
    float on = (float)(1.0 - eps);
    for (int j = 0; j < V; j++) x[j] = dloss * (x[j] * inv - off);
    x[t] -= dloss * on;
  }
}

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
  for (int r = 0; r < M; r++)
    xent_row(logits + (size_t)r * V, targets[r], V, label_smoothing, dloss, write_grad, losses + r,
             nll ? nll + r : NULL);
  return NMT_OK;
}

/* ---- the half-storage path (nmt/backend.h xent_half_fwd_bwd): each row widened, the row above,
 * its gradient rounded back in place ---- */

// logits: (M,V) half, overwritten by the rounded gradient if write_grad; losses, nll, targets: (M)
nmt_status nmt_ref_xent_half_fwd_bwd(void *ctx, nmt_act *logits, float *losses, float *nll,
                                     const int32_t *targets, int M, int V, float label_smoothing,
                                     float dloss, const float *dloss_scale, int write_grad) {
  if (dloss_scale) dloss *= *dloss_scale;
  if (M < 0 || V < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref xent_half: bad shape M=%d V=%d", M, V);
  int bf16;
  NMT_TRY(nmt__ref_half_mode(ctx, "xent_half_fwd_bwd", &bf16));
  for (int r = 0; r < M; r++)
    if (targets[r] < 0 || targets[r] >= V)
      return nmt_errorf(NMT_ERR_INTERNAL, "ref xent_half: target %d at row %d outside [0, %d)",
                        (int)targets[r], r, V);
  if (M == 0) return NMT_OK;
  float *x;
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_XENT_ROW, (size_t)V, &x));
  for (int r = 0; r < M; r++) {
    nmt_act *row = logits + (size_t)r * V;
    nmt_half_decode_array(bf16, x, row, (size_t)V);
    xent_row(x, targets[r], V, label_smoothing, dloss, write_grad, losses + r,
             nll ? nll + r : NULL);
    if (write_grad) nmt_half_encode_array(bf16, row, x, (size_t)V);
  }
  return NMT_OK;
}
