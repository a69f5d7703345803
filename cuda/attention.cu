/* cuda/attention.cu — multi-head scaled dot-product attention (Vaswani et al. 2017 §3.2.1
 * eq. 1, §3.2.2) with key-padding and causal masks and dropout on the attention weights (§5.4),
 * as src/ref/attention.c.
 *
 * First version, correctness before speed: the two products per head are cuBLASLt GEMMs
 * batched over sentences (one call per head; the leading dimensions step over the fused QKV /
 * KV buffers, so no head is copied out), and the masking + softmax + dropout of each score row
 * (b, h, i) is one block of one fused kernel. The backward regenerates the dropout mask from
 * (seed, stream, element) instead of storing it. A fused flash-style kernel is the next step
 * (docs/cuda.md).
 *
 * Row-major (R, S) matrices are column-major (S, R); per (b, h), with S = scores (Tq, Tk):
 *   S^T (Tk x Tq)   = K_c^T . Q_c            K_c: dk x Tk (ld ldkv), Q_c: dk x Tq (ld ldq)
 *   O^T (dk x Tq)   = V_c . A^T              A = dropout(P), A^T: Tk x Tq (ld Tk)
 *   dV^T (dk x Tk) += dO_c . A               dO_c: dk x Tq (ld C)
 *   dA^T (Tk x Tq)  = V_c^T . dO_c
 *   dQ^T (dk x Tq) += scale K_c . dS^T
 *   dK^T (dk x Tk) += scale Q_c . dS */
#include "common.cuh"

enum { ROW_THREADS = 128 };

static nmt_status check_args(const char *op, int ldq, int ldkv, int B, int Tq, int Tk, int H,
                             int dk, float p_drop) {
  if (B < 0 || Tq < 0 || Tk < 1 || H < 1 || dk < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: bad shape B=%d Tq=%d Tk=%d H=%d dk=%d", op, B,
                      Tq, Tk, H, dk);
  if ((long long)H * dk > ldq || (long long)H * dk > ldkv)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: ldq=%d / ldkv=%d smaller than H*dk=%lld", op,
                      ldq, ldkv, (long long)H * dk);
  if (!(p_drop >= 0.0f && p_drop < 1.0f))
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: dropout probability %g outside [0, 1)", op,
                      (double)p_drop);
  if ((long long)B * H * Tq > 0x7fffffffLL)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: %lld score rows exceed one grid", op,
                      (long long)B * H * Tq);
  return NMT_OK;
}

/* Softmax of score row (b, h, i) of probs (B,H,Tq,Tk) in place over the visible keys
 * j < limit (exact zeros beyond), and its dropped copy into pd when pd != NULL. */
static __global__ void __launch_bounds__(ROW_THREADS)
    softmax_rows(float *probs, float *pd, const int32_t *k_lens, int H, int Tq, int Tk,
                 int causal, float p_drop, float dscale, uint64_t seed, uint64_t stream,
                 int *err) {
  __shared__ float sh[32];
  const size_t row = blockIdx.x;
  const int i = (int)(row % (size_t)Tq);
  const size_t b = row / ((size_t)H * (size_t)Tq);
  int kl = k_lens[b];
  if (kl < 1 || kl > Tk) {
    if (threadIdx.x == 0) atomicOr(err, NMT_CUDA_ERR_ATT_KLEN);
    kl = kl < 1 ? 1 : Tk; /* stay in bounds; the error is reported at the next sync */
  }
  const int lim = causal && i + 1 < kl ? i + 1 : kl;
  float *P = probs + row * (size_t)Tk;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < lim; j += blockDim.x) mx = fmaxf(mx, P[j]);
  mx = nmt__block_max(mx, sh);
  float s = 0.0f;
  for (int j = threadIdx.x; j < lim; j += blockDim.x) {
    const float e = expf(P[j] - mx);
    P[j] = e;
    s += e;
  }
  const float inv = 1.0f / nmt__block_sum(s, sh);
  for (int j = threadIdx.x; j < Tk; j += blockDim.x) {
    /* Masked keys get an exact 0 (softmax of -inf), hence exactly zero gradient. */
    const float v = j < lim ? P[j] * inv : 0.0f;
    P[j] = v;
    if (pd) {
      const uint64_t e = (uint64_t)row * (uint64_t)Tk + (uint64_t)j;
      pd[e] = nmt__keep(seed, stream, e, p_drop) ? v * dscale : 0.0f;
    }
  }
}

/* pd = dropout(probs) over all B*H*Tq*Tk elements (the mask of the forward). */
static __global__ void drop_probs(float *pd, const float *probs, size_t n, float p_drop,
                                  float dscale, uint64_t seed, uint64_t stream) {
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += (size_t)gridDim.x * blockDim.x)
    pd[e] = nmt__keep(seed, stream, e, p_drop) ? probs[e] * dscale : 0.0f;
}

/* In place on dP (B,H,Tq,Tk): dA -> dS = P * (dP - sum_j P dP) with dP = dropout'(dA). */
static __global__ void __launch_bounds__(ROW_THREADS)
    softmax_bwd_rows(float *dprobs, const float *probs, int Tk, float p_drop, float dscale,
                     uint64_t seed, uint64_t stream) {
  __shared__ float sh[32];
  const size_t row = blockIdx.x;
  const float *P = probs + row * (size_t)Tk;
  float *dP = dprobs + row * (size_t)Tk;
  float dot = 0.0f;
  for (int j = threadIdx.x; j < Tk; j += blockDim.x) {
    float d = dP[j];
    if (p_drop > 0.0f) {
      const uint64_t e = (uint64_t)row * (uint64_t)Tk + (uint64_t)j;
      d = nmt__keep(seed, stream, e, p_drop) ? d * dscale : 0.0f;
      dP[j] = d;
    }
    dot += P[j] * d;
  }
  dot = nmt__block_sum(dot, sh);
  for (int j = threadIdx.x; j < Tk; j += blockDim.x) dP[j] = P[j] * (dP[j] - dot);
}

// out: (B,Tq,H*dk); probs: (B,H,Tq,Tk); q: rows of ldq; k, v: rows of ldkv; k_lens: (B)
nmt_status nmt_cuda_attention_fwd(void *ctx, float *out, float *probs, const float *q, int ldq,
                                  const float *k, const float *v, int ldkv,
                                  const int32_t *k_lens, int B, int Tq, int Tk, int H, int dk,
                                  int causal, float p_drop, uint64_t seed, uint64_t stream) {
  NMT_TRY(nmt__cuda_enter(ctx, "attention_fwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_args("attention_fwd", ldq, ldkv, B, Tq, Tk, H, dk, p_drop));
  if (Tq == 0 || B == 0) return NMT_OK;
  const int C = H * dk;
  const float scale = (float)(1.0 / sqrt((double)dk));
  const int64_t n = (int64_t)Tq * Tk;
  const size_t rows = (size_t)B * H * Tq;
  for (int h = 0; h < H; h++)
    NMT_TRY(nmt__cuda_gemm(c, 1, 0, Tk, Tq, dk, scale, k + (size_t)h * dk, ldkv,
                           (int64_t)Tk * ldkv, q + (size_t)h * dk, ldq, (int64_t)Tq * ldq, 0.0f,
                           probs + (size_t)h * n, Tk, (int64_t)H * n, B, 1));
  float *pd = NULL;
  const float dscale = p_drop > 0.0f ? 1.0f / (1.0f - p_drop) : 1.0f;
  if (p_drop > 0.0f) NMT_TRY(nmt__cuda_scratch(c, rows * (size_t)Tk * sizeof(float), (void **)&pd));
  softmax_rows<<<(unsigned)rows, ROW_THREADS, 0, nmt__cuda_stream(c)>>>(
      probs, pd, k_lens, H, Tq, Tk, causal, p_drop, dscale, seed, stream, c->d_err);
  NMT_CUDA_LAUNCH_CHECK("softmax_rows");
  const float *A = pd ? pd : probs;
  for (int h = 0; h < H; h++)
    NMT_TRY(nmt__cuda_gemm(c, 0, 0, dk, Tq, Tk, 1.0f, v + (size_t)h * dk, ldkv,
                           (int64_t)Tk * ldkv, A + (size_t)h * n, Tk, (int64_t)H * n, 0.0f,
                           out + (size_t)h * dk, C, (int64_t)Tq * C, B, 1));
  return NMT_OK;
}

nmt_status nmt_cuda_attention_bwd(void *ctx, float *dq, float *dkey, float *dv, float *dprobs,
                                  const float *dout, const float *probs, const float *q, int ldq,
                                  const float *k, const float *v, int ldkv,
                                  const int32_t *k_lens, int B, int Tq, int Tk, int H, int dk,
                                  int causal, float p_drop, uint64_t seed, uint64_t stream) {
  (void)k_lens; /* the masks are already in probs as exact zeros */
  (void)causal;
  NMT_TRY(nmt__cuda_enter(ctx, "attention_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_args("attention_bwd", ldq, ldkv, B, Tq, Tk, H, dk, p_drop));
  if (Tq == 0 || B == 0 || (!dq && !dkey && !dv)) return NMT_OK;
  const int C = H * dk;
  const float scale = (float)(1.0 / sqrt((double)dk));
  const float dscale = p_drop > 0.0f ? 1.0f / (1.0f - p_drop) : 1.0f;
  const int64_t n = (int64_t)Tq * Tk;
  const size_t rows = (size_t)B * H * Tq, total = rows * (size_t)Tk;
  const float *A = probs;
  if (p_drop > 0.0f && dv) {
    float *pd;
    NMT_TRY(nmt__cuda_scratch(c, total * sizeof(float), (void **)&pd));
    drop_probs<<<nmt__grid(total, 256), 256, 0, nmt__cuda_stream(c)>>>(
        pd, probs, total, p_drop, dscale, seed, stream);
    NMT_CUDA_LAUNCH_CHECK("drop_probs");
    A = pd;
  }
  if (dv)
    for (int h = 0; h < H; h++)
      NMT_TRY(nmt__cuda_gemm(c, 0, 1, dk, Tk, Tq, 1.0f, dout + (size_t)h * dk, C,
                             (int64_t)Tq * C, A + (size_t)h * n, Tk, (int64_t)H * n, 1.0f,
                             dv + (size_t)h * dk, ldkv, (int64_t)Tk * ldkv, B, 1));
  if (!dq && !dkey) return NMT_OK;
  for (int h = 0; h < H; h++)
    NMT_TRY(nmt__cuda_gemm(c, 1, 0, Tk, Tq, dk, 1.0f, v + (size_t)h * dk, ldkv,
                           (int64_t)Tk * ldkv, dout + (size_t)h * dk, C, (int64_t)Tq * C, 0.0f,
                           dprobs + (size_t)h * n, Tk, (int64_t)H * n, B, 1));
  softmax_bwd_rows<<<(unsigned)rows, ROW_THREADS, 0, nmt__cuda_stream(c)>>>(
      dprobs, probs, Tk, p_drop, dscale, seed, stream);
  NMT_CUDA_LAUNCH_CHECK("softmax_bwd_rows");
  if (dq)
    for (int h = 0; h < H; h++)
      NMT_TRY(nmt__cuda_gemm(c, 0, 0, dk, Tq, Tk, scale, k + (size_t)h * dk, ldkv,
                             (int64_t)Tk * ldkv, dprobs + (size_t)h * n, Tk, (int64_t)H * n,
                             1.0f, dq + (size_t)h * dk, ldq, (int64_t)Tq * ldq, B, 1));
  if (dkey)
    for (int h = 0; h < H; h++)
      NMT_TRY(nmt__cuda_gemm(c, 0, 1, dk, Tk, Tq, scale, q + (size_t)h * dk, ldq,
                             (int64_t)Tq * ldq, dprobs + (size_t)h * n, Tk, (int64_t)H * n, 1.0f,
                             dkey + (size_t)h * dk, ldkv, (int64_t)Tk * ldkv, B, 1));
  return NMT_OK;
}
