/* cuda/xent.cu — softmax cross-entropy with label smoothing (Szegedy et al. 2016; Vaswani et
 * al. 2017 §5.4) as torch.nn.CrossEntropyLoss(label_smoothing=eps, ignore_index=PAD,
 * reduction='none'), writing the logits' gradient in place (no second (M,V) buffer), as
 * src/ref/xent.c. One block per row; fp32 math with the log-sum-exp and the loss formed in
 * double. The half-storage op (xent_half_fwd_bwd, half logits and gradient) at the end. */
#include "common.cuh"
#include "half_scratch.cuh"
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

/* ---- the half-storage path (nmt/backend.h xent_half_fwd_bwd): the fused classifier on half
 * logits ----
 * One block of XH_THREADS per row, as xent_kernel (llm.c's fused_classifier keeps the same
 * shape: one pass computes the row's statistics, the next writes the gradient over the
 * logits). The row is read from global memory ONCE: widened to fp32 into dynamic shared memory
 * (V floats: 32000 B for V = 8000) while the max and the sum of x are taken; the exponentials
 * exp(x - max) (fp32 expf) are formed from shared memory and parked there, their sum taken in
 * double (per thread, then across the block; the reference sums in double); the loss and nll
 * as xent_kernel, in double; with write_grad, the gradient xent_kernel writes,
 * dloss * (e / se - eps/V) - dloss (1 - eps) at the target, in fp32, rounded ONCE into the row
 * in place. A row whose V floats exceed XH_SMEM_BYTES (the 48 KiB every architecture gives a
 * block without an opt-in, less the static part) is re-read from global memory in the later
 * passes instead (its exponentials recomputed in the last one). Rows are moved as 16-byte
 * vectors (8 elements) when V % 8 == 0 and the logits are 16-byte aligned (every row then is),
 * else element by element. Resources: XH_THREADS threads; static shared 384 B (the
 * reductions); dynamic shared V * 4 B when V <= XH_SMEM_BYTES / 4, else 0; no opt-in
 * (cudaFuncSetAttribute is not called). Per SM that is at most 3 blocks (sm_86: 1536
 * threads, 100 KB) or 4 (sm_80, sm_90: 2048 threads) at V = 8000. */

enum { XH_THREADS = 512, XH_SMEM_BYTES = 47 * 1024 };

/* Elements VEC at item i of row x (VEC = 8: one 16-byte load), widened. */
template <typename T, int VEC>
__device__ __forceinline__ void xh_load(float v[VEC], const T *x, int i) {
  if constexpr (VEC == 8) {
    const nmt__half8<T> h = reinterpret_cast<const nmt__half8<T> *>(x)[i];
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = nmt__half_to_float(h.v[j]);
  } else {
    v[0] = nmt__half_to_float(x[i]);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void xh_store(T *x, int i, const float v[VEC]) {
  if constexpr (VEC == 8) {
    nmt__half8<T> h;
#pragma unroll
    for (int j = 0; j < 8; j++) h.v[j] = nmt__float_to_half<T>(v[j]);
    reinterpret_cast<nmt__half8<T> *>(x)[i] = h;
  } else {
    x[i] = nmt__float_to_half<T>(v[0]);
  }
}

// logits: (M,V) half, overwritten by the rounded gradient if write_grad; losses, nll
// (nullable), targets: (M). use_smem: the row fits the dynamic shared memory (V floats).
template <typename T, int VEC>
static __global__ void __launch_bounds__(XH_THREADS)
    xent_half_kernel(T *logits, float *losses, float *nll, const int32_t *targets, int M, int V,
                     float eps, float dloss, const float *dloss_scale, int write_grad,
                     int use_smem, int *err) {
  extern __shared__ float xs[]; /* the row in fp32, V floats, when use_smem */
  __shared__ float shf[32];
  __shared__ double shd[32];
  const int r = blockIdx.x;
  if (r >= M) return;
  T *x = logits + (size_t)r * V;
  const int t = targets[r];
  const int items = V / VEC; /* VEC == 8 only when V % 8 == 0 */
  if (t == NMT_PAD_ID) {
    if (threadIdx.x == 0) {
      losses[r] = 0.0f;
      if (nll) nll[r] = 0.0f;
    }
    if (write_grad) {
      float z[VEC];
#pragma unroll
      for (int j = 0; j < VEC; j++) z[j] = 0.0f;
      for (int i = threadIdx.x; i < items; i += blockDim.x) xh_store<T, VEC>(x, i, z);
    }
    return; /* t is the same for the whole block: no barrier is left waiting */
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
  /* Read before any thread overwrites the row (the writes follow three barriers). */
  const float xt = threadIdx.x == 0 ? nmt__half_to_float(x[t]) : 0.0f;
  float mx = -INFINITY;
  double sx = 0.0;
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    float v[VEC];
    xh_load<T, VEC>(v, x, i);
#pragma unroll
    for (int j = 0; j < VEC; j++) {
      mx = fmaxf(mx, v[j]);
      sx += (double)v[j];
      if (use_smem) xs[i * VEC + j] = v[j];
    }
  }
  mx = nmt__block_max(mx, shf);
  sx = nmt__block_sum(sx, shd); /* its barriers also publish xs */
  double se = 0.0;
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    float v[VEC];
    if (use_smem) {
#pragma unroll
      for (int j = 0; j < VEC; j++) v[j] = xs[i * VEC + j];
    } else {
      xh_load<T, VEC>(v, x, i);
    }
#pragma unroll
    for (int j = 0; j < VEC; j++) {
      const float e = expf(v[j] - mx);
      if (use_smem) xs[i * VEC + j] = e; /* one expf per logit: park it (this thread's own) */
      se += (double)e;
    }
  }
  se = nmt__block_sum(se, shd);
  const double lse = (double)mx + log(se);
  if (threadIdx.x == 0) {
    /* -log p[v] = lse - x[v]; its mean over v is lse - mean(x). */
    losses[r] = (float)((1.0 - (double)eps) * (lse - xt) + (double)eps * (lse - sx / V));
    if (nll) nll[r] = (float)(lse - xt);
  }
  if (!write_grad) return;
  /* The loss scale of fp16 training (step_control's), one float product as xent_kernel. */
  if (dloss_scale) dloss *= *dloss_scale;
  const float inv = (float)(1.0 / se);
  const float off = (float)((double)eps / V), on = (float)(1.0 - (double)eps);
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    float e[VEC];
    if (use_smem) {
#pragma unroll
      for (int j = 0; j < VEC; j++) e[j] = xs[i * VEC + j];
    } else {
      xh_load<T, VEC>(e, x, i);
#pragma unroll
      for (int j = 0; j < VEC; j++) e[j] = expf(e[j] - mx);
    }
    float g[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j++) {
      g[j] = dloss * (e[j] * inv - off);
      if (i * VEC + j == t) g[j] -= dloss * on;
    }
    xh_store<T, VEC>(x, i, g);
  }
}
NMT_CUDA_PRELOAD(xent_half_kernel<__half, 8>);
NMT_CUDA_PRELOAD(xent_half_kernel<__half, 1>);
NMT_CUDA_PRELOAD(xent_half_kernel<__nv_bfloat16, 8>);
NMT_CUDA_PRELOAD(xent_half_kernel<__nv_bfloat16, 1>);

template <typename T>
static nmt_status xent_half_t(nmt_cuda_ctx *c, T *logits, float *losses, float *nll,
                              const int32_t *targets, int M, int V, float eps, float dloss,
                              const float *dloss_scale, int write_grad) {
  const int use_smem = (size_t)V * sizeof(float) <= XH_SMEM_BYTES;
  const size_t smem = use_smem ? (size_t)V * sizeof(float) : 0;
  cudaStream_t s = nmt__cuda_stream(c);
  /* One block of XH_THREADS per row: M <= 2^31 - 1 blocks; dynamic shared memory `smem`
   * (<= 47 KiB: within every architecture's default 48 KiB per block). */
  if (nmt__half_vec_ok(logits, (size_t)V))
    xent_half_kernel<T, 8><<<(unsigned)M, XH_THREADS, smem, s>>>(
        logits, losses, nll, targets, M, V, eps, dloss, dloss_scale, write_grad, use_smem,
        c->d_err);
  else
    xent_half_kernel<T, 1><<<(unsigned)M, XH_THREADS, smem, s>>>(
        logits, losses, nll, targets, M, V, eps, dloss, dloss_scale, write_grad, use_smem,
        c->d_err);
  NMT_CUDA_LAUNCH_CHECK("xent_half_kernel");
  return NMT_OK;
}

// logits: (M,V) half, overwritten by the rounded gradient if write_grad; losses, nll
// (nullable), targets: (M)
nmt_status nmt_cuda_xent_half_fwd_bwd(void *ctx, nmt_act *logits, float *losses, float *nll,
                                      const int32_t *targets, int M, int V,
                                      float label_smoothing, float dloss,
                                      const float *dloss_scale, int write_grad) {
  NMT_TRY(nmt__cuda_enter(ctx, "xent_half_fwd_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (M < 0 || V < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda xent_half: bad shape M=%d V=%d", M, V);
  NMT_TRY(nmt__cuda_half_op_check(c, "xent_half_fwd_bwd"));
  if (M == 0) return NMT_OK;
  if (nmt__cuda_half_bf16(c))
    return xent_half_t(c, (__nv_bfloat16 *)logits, losses, nll, targets, M, V, label_smoothing,
                       dloss, dloss_scale, write_grad);
  return xent_half_t(c, (__half *)logits, losses, nll, targets, M, V, label_smoothing, dloss,
                     dloss_scale, write_grad);
}
