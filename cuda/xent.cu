/* cuda/xent.cu — softmax cross-entropy with label smoothing (Szegedy et al. 2016; Vaswani et
 * al. 2017 §5.4) as torch.nn.CrossEntropyLoss(label_smoothing=eps, ignore_index=PAD,
 * reduction='none'), writing the logits' gradient in place (no second (M,V) buffer), as
 * src/ref/xent.c. One block per row; fp32 math with the log-sum-exp and the loss formed in
 * double. */
#include "common.cuh"
#include "nmt/types.h"

enum { XENT_THREADS = 512 };

// logits: (M,V), overwritten by the gradient if write_grad; losses, nll (nullable), targets: (M)
static __global__ void __launch_bounds__(XENT_THREADS)
    xent_kernel(float *logits, float *losses, float *nll, const int32_t *targets, int M, int V,
                float eps, float dloss, const float *dloss_scale, int write_grad, int *err) {
  __shared__ float sh[32];
  const int r = blockIdx.x;
  if (r >= M) return;
  float *x = logits + (size_t)r * V;
  const int t = targets[r];
  if (t == NMT_PAD_ID) {
    if (threadIdx.x == 0) {
      losses[r] = 0.0f;
      if (nll) nll[r] = 0.0f;
    }
    if (write_grad)
      for (int j = threadIdx.x; j < V; j += blockDim.x) x[j] = 0.0f;
    return;
  }
  if (t < 0 || t >= V) {
    /* Leave the row alone (the reference refuses the whole call) and make the loss loud. */
    if (threadIdx.x == 0) {
      atomicOr(err, NMT_CUDA_ERR_XENT_TARGET);
      losses[r] = __int_as_float(0x7fc00000);
      if (nll) nll[r] = __int_as_float(0x7fc00000);
    }
    return;
  }
  const float xt = x[t]; /* read before any thread overwrites the row */
  float mx = -INFINITY, sx = 0.0f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    const float v = x[j];
    mx = fmaxf(mx, v);
    sx += v;
  }
  mx = nmt__block_max(mx, sh);
  sx = nmt__block_sum(sx, sh);
  float se = 0.0f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    const float e = expf(x[j] - mx);
    if (write_grad) x[j] = e; /* one expf per logit: park it in the row */
    se += e;
  }
  se = nmt__block_sum(se, sh);
  const double lse = (double)mx + log((double)se);
  if (threadIdx.x == 0) {
    /* -log p[v] = lse - x[v]; its mean over v is lse - mean(x). */
    losses[r] = (float)((1.0 - (double)eps) * (lse - xt) + (double)eps * (lse - (double)sx / V));
    if (nll) nll[r] = (float)(lse - xt);
  }
  if (write_grad) {
    /* The loss scale of fp16 training, held on the device by step_control: one float product,
     * as a caller passing dloss * scale would form it. */
    if (dloss_scale) dloss *= *dloss_scale;
    const float inv = (float)(1.0 / (double)se);
    const float off = (float)((double)eps / V), on = (float)(1.0 - (double)eps);
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
      float g = dloss * (x[j] * inv - off);
      if (j == t) g -= dloss * on;
      x[j] = g;
    }
  }
}
NMT_CUDA_PRELOAD(xent_kernel);

nmt_status nmt_cuda_xent_fwd_bwd(void *ctx, float *logits, float *losses, float *nll,
                                 const int32_t *targets, int M, int V, float label_smoothing,
                                 float dloss, const float *dloss_scale, int write_grad) {
  NMT_TRY(nmt__cuda_enter(ctx, "xent_fwd_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (M < 0 || V < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda xent: bad shape M=%d V=%d", M, V);
  if (M == 0) return NMT_OK;
  xent_kernel<<<(unsigned)M, XENT_THREADS, 0, nmt__cuda_stream(c)>>>(
      logits, losses, nll, targets, M, V, label_smoothing, dloss, dloss_scale, write_grad,
      c->d_err);
  NMT_CUDA_LAUNCH_CHECK("xent_kernel");
  return NMT_OK;
}

/* ---- STUB: the half-storage ops, to be implemented ---- */
nmt_status nmt_cuda_xent_half_fwd_bwd(void *ctx, nmt_act *logits, float *losses, float *nll, const int32_t *targets, int M, int V, float label_smoothing, float dloss, const float *dloss_scale, int write_grad) {
  (void)ctx; (void)logits; (void)losses; (void)nll; (void)targets; (void)M; (void)V; (void)label_smoothing; (void)dloss; (void)dloss_scale; (void)write_grad;
  return nmt_errorf(NMT_ERR_INTERNAL, "cuda xent_half_fwd_bwd: not implemented yet");
}
