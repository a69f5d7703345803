/* cuda/attention.cu — multi-head scaled dot-product attention (Vaswani et al. 2017 §3.2.1
 * eq. 1, §3.2.2) with key-padding and causal masks and dropout on the attention weights (§5.4),
 * as src/ref/attention.c.
 *
 * Each product is ONE strided-batched cuBLASLt GEMM over the B x H (sentence, head) blocks
 * (CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = B*H with a STRIDED_BATCH_OFFSET per operand; cuBLAS
 * Library User Guide, cublasLtMatrixLayoutAttribute_t): 2 launches forward, up to 4 backward,
 * instead of one per head and product (issue 15: ~860 launches per base micro-batch became
 * ~110). A strided batch needs one stride from block to block, but in the fused QKV / KV
 * buffers block (b, h) starts at b*T*ld + h*dk: two strides. So q, k, v (and dout) are first
 * copied head-major, (B, H, T, dk) contiguous (pack_heads: one coalesced pass each, small next
 * to the GEMMs), the products run on those copies and on the (B, H, Tq, Tk) weights, and the
 * head outputs and gradients are scattered back (unpack_heads; gradients added, as the op
 * accumulates). The masking + softmax + dropout of each score row (b, h, i) is one block of
 * one fused kernel; the backward regenerates the dropout mask from (seed, stream, element)
 * instead of storing it. A fused flash-style kernel is the next step (docs/cuda.md).
 *
 * Row-major (R, S) matrices are column-major (S, R); per block, with Qh, Kh, Vh, dOh the
 * head-major copies (column-major dk x T, ld dk) and S = scores (Tq, Tk) (column-major
 * Tk x Tq, ld Tk):
 *   S^T (Tk x Tq)   = scale Kh^T . Qh
 *   O^T (dk x Tq)   = Vh . A^T               A = dropout(P)
 *   dV^T (dk x Tk)  = dOh . A
 *   dA^T (Tk x Tq)  = Vh^T . dOh
 *   dQ^T (dk x Tq)  = scale Kh . dS^T
 *   dK^T (dk x Tk)  = scale Qh . dS
 * The gradient products write a head-major buffer with beta = 0 that unpack_heads adds into
 * dq / dkey / dv: the same sums as the reference up to fp32 rounding of the order.
 *
 * Scratch (nmt__cuda_attention_scratch, one buffer of the current stream): forward Qh, Kh, Vh,
 * Oh and the dropped weights; backward Qh, Kh, Vh, dOh, one gradient buffer and the dropped
 * weights.
 *
 * The half-storage ops (attention_half_fwd / _bwd, nmt/backend.h) are the same algorithm on
 * the same fp32 scratch, one body for both (att_fwd, att_bwd): only the copies at the ends
 * differ. Their packs read q, k, v and dout in the context's half type from the strided
 * layouts and widen them to fp32 as they copy (exact), so every GEMM and row kernel after them
 * is the fp32 op's, in fp32 (fp16/bf16 mode never asks cuBLASLt for TF32); their unpacks WRITE
 * round() of the result: out = round(O), and each gradient round(0 + G), the fp32 op's
 * gradient accumulated into zeros (0 + -0 is +0, as the reference's). So a half op's outputs
 * are bitwise the rounding of the fp32 op run on the widened inputs. Part 2 replaces the whole
 * sequence by a fused kernel (docs/cuda.md). */
#include <type_traits>

#include "common.cuh"
#include "half_scratch.cuh"

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
NMT_CUDA_PRELOAD(softmax_rows);

/* dst (B, H, T, dk), contiguous <- the heads of src, rows of ld: element (b, h, t, d) is
 * src[(b*T + t)*ld + h*dk + d]. n = B*H*T*dk. I: the index type (32-bit when n and the source
 * extent are below 2^31, which is every model-sized call: integer division is the kernel's
 * cost, and 64-bit division costs several times more). */
template <typename I>
static __global__ void pack_heads(float *dst, const float *src, I ld, I T, I H, I dk, I n) {
  for (I e = (I)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (I)gridDim.x * blockDim.x) {
    const I d = e % dk, t = e / dk % T, bh = e / (dk * T), h = bh % H, b = bh / H;
    dst[e] = src[(b * T + t) * ld + h * dk + d];
  }
}
NMT_CUDA_PRELOAD(pack_heads<uint32_t>);
NMT_CUDA_PRELOAD(pack_heads<size_t>);

/* The inverse scatter: the heads of dst (rows of ld) = src (B, H, T, dk), or += when
 * accumulate. */
template <typename I>
static __global__ void unpack_heads(float *dst, const float *src, I ld, I T, I H, I dk, I n,
                                    int accumulate) {
  for (I e = (I)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (I)gridDim.x * blockDim.x) {
    const I d = e % dk, t = e / dk % T, bh = e / (dk * T), h = bh % H, b = bh / H;
    float *o = dst + (b * T + t) * ld + h * dk + d;
    *o = accumulate ? __fadd_rn(*o, src[e]) : src[e];
  }
}
NMT_CUDA_PRELOAD(unpack_heads<uint32_t>);
NMT_CUDA_PRELOAD(unpack_heads<size_t>);

/* pack_heads reading half elements: dst (B, H, T, dk) fp32 <- v(src) (T = __half or
 * __nv_bfloat16; the conversion is exact). */
template <typename T, typename I>
static __global__ void pack_heads_half(float *dst, const T *src, I ld, I T_, I H, I dk, I n) {
  for (I e = (I)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (I)gridDim.x * blockDim.x) {
    const I d = e % dk, t = e / dk % T_, bh = e / (dk * T_), h = bh % H, b = bh / H;
    dst[e] = nmt__half_to_float(src[(b * T_ + t) * ld + h * dk + d]);
  }
}
NMT_CUDA_PRELOAD(pack_heads_half<__half, uint32_t>);
NMT_CUDA_PRELOAD(pack_heads_half<__half, size_t>);
NMT_CUDA_PRELOAD(pack_heads_half<__nv_bfloat16, uint32_t>);
NMT_CUDA_PRELOAD(pack_heads_half<__nv_bfloat16, size_t>);

/* unpack_heads writing half elements: the heads of dst = round(src) (grad = 0: the head
 * outputs) or round(0 + src) (grad = 1: a gradient the fp32 op would add into zeros). */
template <typename T, typename I>
static __global__ void unpack_heads_half(T *dst, const float *src, I ld, I T_, I H, I dk, I n,
                                         int grad) {
  for (I e = (I)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (I)gridDim.x * blockDim.x) {
    const I d = e % dk, t = e / dk % T_, bh = e / (dk * T_), h = bh % H, b = bh / H;
    const float v = grad ? __fadd_rn(0.0f, src[e]) : src[e];
    dst[(b * T_ + t) * ld + h * dk + d] = nmt__float_to_half<T>(v);
  }
}
NMT_CUDA_PRELOAD(unpack_heads_half<__half, uint32_t>);
NMT_CUDA_PRELOAD(unpack_heads_half<__half, size_t>);
NMT_CUDA_PRELOAD(unpack_heads_half<__nv_bfloat16, uint32_t>);
NMT_CUDA_PRELOAD(unpack_heads_half<__nv_bfloat16, size_t>);

/* pd = dropout(probs) over all B*H*Tq*Tk elements (the mask of the forward). */
static __global__ void drop_probs(float *pd, const float *probs, size_t n, float p_drop,
                                  float dscale, uint64_t seed, uint64_t stream) {
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += (size_t)gridDim.x * blockDim.x)
    pd[e] = nmt__keep(seed, stream, e, p_drop) ? probs[e] * dscale : 0.0f;
}
NMT_CUDA_PRELOAD(drop_probs);

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
NMT_CUDA_PRELOAD(softmax_bwd_rows);

/* The pieces of one call's scratch, byte offsets of q floats of queries, kv of keys/values and
 * `scores` of weights: head-major q and k/v copies (and the forward's head outputs or the
 * backward's dout), one gradient buffer, the dropped weights; `total` is the size. The one
 * layout both the reserve (nmt__cuda_attention_scratch) and the ops (att_scratch_get) use. */
typedef struct {
  size_t qh, kh, vh, oh, g, pd, total;
} att_layout;

static att_layout att_layout_of(size_t q, size_t kv, size_t scores) {
  const size_t f = sizeof(float), pq = nmt__cuda_pad(q * f), pkv = nmt__cuda_pad(kv * f);
  att_layout l;
  l.qh = 0;
  l.kh = l.qh + pq;
  l.vh = l.kh + pkv;
  l.oh = l.vh + pkv;
  l.g = l.oh + pq;
  l.pd = l.g + nmt__cuda_pad((q > kv ? q : kv) * f);
  l.total = l.pd + nmt__cuda_pad(scores * f);
  return l;
}

size_t nmt__cuda_attention_scratch(size_t q, size_t kv, size_t scores) {
  return att_layout_of(q, kv, scores).total;
}

typedef struct {
  float *qh, *kh, *vh, *oh, *g, *pd;
} att_scratch;

static nmt_status att_scratch_get(nmt_cuda_ctx *c, size_t q, size_t kv, size_t scores,
                                  att_scratch *s) {
  const att_layout l = att_layout_of(q, kv, scores);
  char *p;
  NMT_TRY(nmt__cuda_scratch(c, l.total, (void **)&p));
  s->qh = (float *)(p + l.qh);
  s->kh = (float *)(p + l.kh);
  s->vh = (float *)(p + l.vh);
  s->oh = (float *)(p + l.oh);
  s->g = (float *)(p + l.g);
  s->pd = (float *)(p + l.pd);
  return NMT_OK;
}

/* Where an op's q, k, v, dout, out and gradients live: fp32 (attention_fwd / _bwd) or the
 * context's half type (attention_half_fwd / _bwd). The scratch is fp32 either way. */
typedef enum { ATT_F32 = 0, ATT_FP16 = 1, ATT_BF16 = 2 } att_io;

/* One pack (unpack = 0) or unpack launch for element type E (float or a half type) and index
 * type I. grad: fp32 adds into dst, half writes round(0 + src); else both write. */
template <typename E, typename I>
static void heads_launch(cudaStream_t s, unsigned grid, int unpack, void *dst, const void *src,
                         I ld, I T, I H, I dk, I n, int grad) {
  if constexpr (std::is_same_v<E, float>) {
    if (unpack)
      unpack_heads<I><<<grid, 256, 0, s>>>((float *)dst, (const float *)src, ld, T, H, dk, n,
                                           grad);
    else
      pack_heads<I><<<grid, 256, 0, s>>>((float *)dst, (const float *)src, ld, T, H, dk, n);
  } else {
    if (unpack)
      unpack_heads_half<E, I><<<grid, 256, 0, s>>>((E *)dst, (const float *)src, ld, T, H, dk, n,
                                                   grad);
    else
      pack_heads_half<E, I><<<grid, 256, 0, s>>>((float *)dst, (const E *)src, ld, T, H, dk, n);
  }
}

template <typename E>
static void heads_typed(cudaStream_t s, unsigned grid, int unpack, void *dst, const void *src,
                        int ld, int B, int T, int H, int dk, int grad) {
  const size_t n = (size_t)B * H * T * dk, extent = (size_t)B * T * (size_t)ld;
  /* Below 2^31 the grid-stride index cannot wrap a 32-bit counter either. */
  if (n <= 0x7fffffffu && extent <= 0x7fffffffu)
    heads_launch<E, uint32_t>(s, grid, unpack, dst, src, (uint32_t)ld, (uint32_t)T, (uint32_t)H,
                              (uint32_t)dk, (uint32_t)n, grad);
  else
    heads_launch<E, size_t>(s, grid, unpack, dst, src, (size_t)ld, (size_t)T, (size_t)H,
                            (size_t)dk, n, grad);
}

/* The head-major copy of a (B*T, ld) buffer's heads (unpack = 0: dst fp32 scratch, src of
 * io's type), or the scatter of one back into it (unpack = 1: src fp32 scratch, dst of io's
 * type; grad as heads_launch), on the current stream. 256 threads, a grid-stride grid of at
 * most 65535 blocks (nmt__grid). */
static nmt_status heads(nmt_cuda_ctx *c, att_io io, int unpack, void *dst, const void *src,
                        int ld, int B, int T, int H, int dk, int grad) {
  const size_t n = (size_t)B * H * T * dk;
  const unsigned grid = nmt__grid(n, 256);
  cudaStream_t s = nmt__cuda_stream(c);
  if (io == ATT_F32) heads_typed<float>(s, grid, unpack, dst, src, ld, B, T, H, dk, grad);
  else if (io == ATT_FP16) heads_typed<__half>(s, grid, unpack, dst, src, ld, B, T, H, dk, grad);
  else heads_typed<__nv_bfloat16>(s, grid, unpack, dst, src, ld, B, T, H, dk, grad);
  NMT_CUDA_LAUNCH_CHECK("pack_heads/unpack_heads");
  return NMT_OK;
}

static nmt_status pack(nmt_cuda_ctx *c, att_io io, float *dst, const void *src, int ld, int B,
                       int T, int H, int dk) {
  return heads(c, io, 0, dst, src, ld, B, T, H, dk, 0);
}

static nmt_status unpack(nmt_cuda_ctx *c, att_io io, void *dst, const float *src, int ld, int B,
                         int T, int H, int dk, int grad) {
  return heads(c, io, 1, dst, src, ld, B, T, H, dk, grad);
}

/* The forward of both storages (arguments checked, B, Tq > 0). */
static nmt_status att_fwd(nmt_cuda_ctx *c, att_io io, void *out, float *probs, const void *q,
                          int ldq, const void *k, const void *v, int ldkv, const int32_t *k_lens,
                          int B, int Tq, int Tk, int H, int dk, int causal, float p_drop,
                          uint64_t seed, uint64_t stream) {
  const int C = H * dk, BH = B * H;
  const float scale = (float)(1.0 / sqrt((double)dk));
  const int64_t n = (int64_t)Tq * Tk, sq = (int64_t)Tq * dk, skv = (int64_t)Tk * dk;
  const size_t rows = (size_t)B * H * Tq;
  att_scratch s;
  NMT_TRY(att_scratch_get(c, (size_t)B * Tq * C, (size_t)B * Tk * C,
                          p_drop > 0.0f ? rows * (size_t)Tk : 0, &s));
  NMT_TRY(pack(c, io, s.qh, q, ldq, B, Tq, H, dk));
  NMT_TRY(pack(c, io, s.kh, k, ldkv, B, Tk, H, dk));
  NMT_TRY(pack(c, io, s.vh, v, ldkv, B, Tk, H, dk));
  NMT_TRY(nmt__cuda_gemm(c, 1, 0, Tk, Tq, dk, scale, s.kh, dk, skv, s.qh, dk, sq, 0.0f, probs, Tk,
                         n, BH, 1));
  const float dscale = p_drop > 0.0f ? 1.0f / (1.0f - p_drop) : 1.0f;
  float *pd = p_drop > 0.0f ? s.pd : NULL;
  /* One block of ROW_THREADS per score row; rows < 2^31 (check_args). */
  softmax_rows<<<(unsigned)rows, ROW_THREADS, 0, nmt__cuda_stream(c)>>>(
      probs, pd, k_lens, H, Tq, Tk, causal, p_drop, dscale, seed, stream, c->d_err);
  NMT_CUDA_LAUNCH_CHECK("softmax_rows");
  NMT_TRY(nmt__cuda_gemm(c, 0, 0, dk, Tq, Tk, 1.0f, s.vh, dk, skv, pd ? pd : probs, Tk, n, 0.0f,
                         s.oh, dk, sq, BH, 1));
  return unpack(c, io, out, s.oh, C, B, Tq, H, dk, 0);
}

/* The backward of both storages (arguments checked, B, Tq > 0, some gradient asked for). */
static nmt_status att_bwd(nmt_cuda_ctx *c, att_io io, void *dq, void *dkey, void *dv,
                          float *dprobs, const void *dout, const float *probs, const void *q,
                          int ldq, const void *k, const void *v, int ldkv, int B, int Tq, int Tk,
                          int H, int dk, float p_drop, uint64_t seed, uint64_t stream) {
  const int C = H * dk, BH = B * H;
  const float scale = (float)(1.0 / sqrt((double)dk));
  const float dscale = p_drop > 0.0f ? 1.0f / (1.0f - p_drop) : 1.0f;
  const int64_t n = (int64_t)Tq * Tk, sq = (int64_t)Tq * dk, skv = (int64_t)Tk * dk;
  const size_t rows = (size_t)B * H * Tq, total = rows * (size_t)Tk;
  att_scratch s;
  NMT_TRY(att_scratch_get(c, (size_t)B * Tq * C, (size_t)B * Tk * C, p_drop > 0.0f ? total : 0,
                          &s));
  float *doh = s.oh; /* the head-major dout takes the forward's output slot */
  NMT_TRY(pack(c, io, doh, dout, C, B, Tq, H, dk));
  if (dv) {
    const float *A = probs;
    if (p_drop > 0.0f) {
      drop_probs<<<nmt__grid(total, 256), 256, 0, nmt__cuda_stream(c)>>>(
          s.pd, probs, total, p_drop, dscale, seed, stream);
      NMT_CUDA_LAUNCH_CHECK("drop_probs");
      A = s.pd;
    }
    NMT_TRY(nmt__cuda_gemm(c, 0, 1, dk, Tk, Tq, 1.0f, doh, dk, sq, A, Tk, n, 0.0f, s.g, dk, skv,
                           BH, 1));
    NMT_TRY(unpack(c, io, dv, s.g, ldkv, B, Tk, H, dk, 1));
  }
  if (!dq && !dkey) return NMT_OK;
  NMT_TRY(pack(c, io, s.vh, v, ldkv, B, Tk, H, dk));
  NMT_TRY(nmt__cuda_gemm(c, 1, 0, Tk, Tq, dk, 1.0f, s.vh, dk, skv, doh, dk, sq, 0.0f, dprobs, Tk,
                         n, BH, 1));
  softmax_bwd_rows<<<(unsigned)rows, ROW_THREADS, 0, nmt__cuda_stream(c)>>>(
      dprobs, probs, Tk, p_drop, dscale, seed, stream);
  NMT_CUDA_LAUNCH_CHECK("softmax_bwd_rows");
  if (dq) {
    NMT_TRY(pack(c, io, s.kh, k, ldkv, B, Tk, H, dk));
    NMT_TRY(nmt__cuda_gemm(c, 0, 0, dk, Tq, Tk, scale, s.kh, dk, skv, dprobs, Tk, n, 0.0f, s.g, dk,
                           sq, BH, 1));
    NMT_TRY(unpack(c, io, dq, s.g, ldq, B, Tq, H, dk, 1));
  }
  if (dkey) {
    NMT_TRY(pack(c, io, s.qh, q, ldq, B, Tq, H, dk));
    NMT_TRY(nmt__cuda_gemm(c, 0, 1, dk, Tk, Tq, scale, s.qh, dk, sq, dprobs, Tk, n, 0.0f, s.g, dk,
                           skv, BH, 1));
    NMT_TRY(unpack(c, io, dkey, s.g, ldkv, B, Tk, H, dk, 1));
  }
  return NMT_OK;
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
  return att_fwd(c, ATT_F32, out, probs, q, ldq, k, v, ldkv, k_lens, B, Tq, Tk, H, dk, causal,
                 p_drop, seed, stream);
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
  return att_bwd(c, ATT_F32, dq, dkey, dv, dprobs, dout, probs, q, ldq, k, v, ldkv, B, Tq, Tk, H,
                 dk, p_drop, seed, stream);
}

/* ---- the half-storage path (nmt/backend.h attention_half_fwd / _bwd): att_fwd / att_bwd with
 * half copies at the ends (the top of this file) ---- */

static att_io half_io(const nmt_cuda_ctx *c) {
  return nmt__cuda_half_bf16(c) ? ATT_BF16 : ATT_FP16;
}

// out: (B,Tq,H*dk) half; probs: (B,H,Tq,Tk) fp32; q: rows of ldq, k, v: rows of ldkv, half
nmt_status nmt_cuda_attention_half_fwd(void *ctx, nmt_act *out, float *probs, const nmt_act *q,
                                       int ldq, const nmt_act *k, const nmt_act *v, int ldkv,
                                       const int32_t *k_lens, int B, int Tq, int Tk, int H,
                                       int dk, int causal, float p_drop, uint64_t seed,
                                       uint64_t stream) {
  NMT_TRY(nmt__cuda_enter(ctx, "attention_half_fwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_args("attention_half_fwd", ldq, ldkv, B, Tq, Tk, H, dk, p_drop));
  NMT_TRY(nmt__cuda_half_op_check(c, "attention_half_fwd"));
  if (Tq == 0 || B == 0) return NMT_OK;
  return att_fwd(c, half_io(c), out, probs, q, ldq, k, v, ldkv, k_lens, B, Tq, Tk, H, dk, causal,
                 p_drop, seed, stream);
}

// dq: rows of ldq, dkey, dv: rows of ldkv, half, written; dout: (B,Tq,H*dk) half
nmt_status nmt_cuda_attention_half_bwd(void *ctx, nmt_act *dq, nmt_act *dkey, nmt_act *dv,
                                       float *dprobs, const nmt_act *dout, const float *probs,
                                       const nmt_act *q, int ldq, const nmt_act *k,
                                       const nmt_act *v, int ldkv, const int32_t *k_lens, int B,
                                       int Tq, int Tk, int H, int dk, int causal, float p_drop,
                                       uint64_t seed, uint64_t stream) {
  (void)k_lens; /* the masks are already in probs as exact zeros */
  (void)causal;
  NMT_TRY(nmt__cuda_enter(ctx, "attention_half_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_args("attention_half_bwd", ldq, ldkv, B, Tq, Tk, H, dk, p_drop));
  NMT_TRY(nmt__cuda_half_op_check(c, "attention_half_bwd"));
  if (Tq == 0 || B == 0 || (!dq && !dkey && !dv)) return NMT_OK;
  return att_bwd(c, half_io(c), dq, dkey, dv, dprobs, dout, probs, q, ldq, k, v, ldkv, B, Tq, Tk,
                 H, dk, p_drop, seed, stream);
}
