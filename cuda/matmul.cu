/* cuda/matmul.cu — the linear layer y = x W^T + b (torch.nn.Linear layout) on cuBLASLt, and
 * its ReLU-fused variant relu(x W^T + b) (the FFN's first layer).
 *
 * cuBLASLt is column-major; a row-major (R, S) matrix is the column-major (S, R) matrix with
 * the same leading dimension, i.e. its transpose. So with x_c = x^T, W_c = W^T, y_c = y^T:
 *   forward   y_c (N x M)  = W_c^T (N x K) . x_c (K x M)                 + bias
 *   dinp      dx_c (K x M) += W_c (K x N) . dy_c (N x M)
 *   dw        dW_c (K x N) += x_c (K x M) . dy_c^T (M x N)
 *   dbias     db (N x 1)   += dy_c (N x M) . ones (M x 1)      (GEMV: deterministic, fp32)
 * y_c has N rows, one per output feature, so the bias is a vector along y_c's rows: exactly
 * what cuBLASLt's BIAS epilogue adds ("bias vector length must match matrix D rows",
 * broadcast to all columns). The forward therefore runs as ONE GEMM with the BIAS epilogue
 * (matmul_fwd with a bias) or RELU_BIAS / RELU (matmul_bias_relu_fwd) where cuda/gemm.cu takes
 * it (a 16-byte aligned bias, an algorithm for the key), and otherwise unfused, as the
 * reference computes it: the bias broadcast into y, the GEMM adding onto it (beta = 1), then
 * the ReLU kernel of cuda/relu.cu. Both add the fp32 bias to the fp32 accumulator once.
 *
 * fp16/bf16 mode (nmt/backend.h set_precision; docs/cuda.md "Precision"): the GEMM inputs (x
 * and W forward; dy, W and x backward) are cast to __half / __nv_bfloat16 copies in the
 * context's gemm16 scratch by cast_to_16 (__float2half_rn / __float2bfloat16_rn: round to
 * nearest even, fp16 overflow to inf, NaN kept), and the GEMMs read those with fp32
 * accumulation and fp32 output (nmt__cuda_gemm_ex). The bias, the output and every gradient
 * stay fp32; dbias is the fp32 GEMV of the unrounded dy. The CPU reference emulates exactly
 * this (src/ref/matmul.c). A weight inside the registered half copy of the weights
 * (half_weights: the flat parameter buffer, refreshed by adamw's half_out) is not cast: the
 * GEMM reads its slice of the copy, which holds the same __float2half_rn / __float2bfloat16_rn
 * values while it is current. The activations (x, dy) are cast at every call. cast_half fills
 * the copy with the same cast kernel. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

// out: (M,N) <- bias (N) broadcast over rows
static __global__ void broadcast_rows(float *out, const float *bias, size_t rows, int N) {
  const size_t n = rows * (size_t)N;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = bias[i % (size_t)N];
}
NMT_CUDA_PRELOAD(broadcast_rows);

static __host__ __device__ __forceinline__ void to16(__half *o, float x) {
  *o = __float2half_rn(x);
}
static __host__ __device__ __forceinline__ void to16(__nv_bfloat16 *o, float x) {
  *o = __float2bfloat16_rn(x);
}

// out: (n) 16-bit copy of in: (n)
template <typename T>
static __global__ void cast_to_16(T *out, const float *in, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    to16(&out[i], in[i]);
}
NMT_CUDA_PRELOAD(cast_to_16<__half>);
NMT_CUDA_PRELOAD(cast_to_16<__nv_bfloat16>);

static int half_mode(const nmt_cuda_ctx *c) {
  return c->precision == NMT_PRECISION_FP16 || c->precision == NMT_PRECISION_BF16;
}

enum { MAX_CASTS = 3 };

/* The registered half copy of the weight w (len elements): its slice of the copy when the
 * whole of w lies inside the registered fp32 buffer, else NULL (cast it). */
static const void *cached_weight(const nmt_cuda_ctx *c, const float *w, size_t len) {
  size_t off;
  if (!nmt_half_copy_offset(c->half_src, c->half_n, w, len, &off)) return NULL;
  return (const char *)c->half_dst + off * 2;
}

nmt_status nmt_cuda_cast_half(void *ctx, void *dst, const float *src, size_t n) {
  NMT_TRY(nmt__cuda_enter(ctx, "cast_half"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (!half_mode(c))
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda cast_half: the context's precision has no half type (fp16/bf16 only)");
  if (n == 0) return NMT_OK;
  if (!dst || !src) return nmt_errorf(NMT_ERR_INTERNAL, "cuda cast_half: NULL pointer");
  const unsigned grid = nmt__grid(n, 256);
  if (c->precision == NMT_PRECISION_BF16) {
    cast_to_16<__nv_bfloat16><<<grid, 256, 0, nmt__cuda_stream(c)>>>((__nv_bfloat16 *)dst, src, n);
    NMT_CUDA_LAUNCH_CHECK("cast_to_16<bf16>");
  } else {
    cast_to_16<__half><<<grid, 256, 0, nmt__cuda_stream(c)>>>((__half *)dst, src, n);
    NMT_CUDA_LAUNCH_CHECK("cast_to_16<fp16>");
  }
  return NMT_OK;
}

size_t nmt__cuda_gemm16_bytes(size_t inp, size_t w, size_t out) {
  return nmt__cuda_pad(2 * inp) + nmt__cuda_pad(2 * w) + nmt__cuda_pad(2 * out);
}

/* 16-bit copies of the n fp32 arrays src[i] (len[i] elements, each > 0) in the current
 * stream's gemm16 scratch, each starting on a 256-byte boundary (cuBLASLt's preferred
 * alignment), in dst[i]; *type is the cuBLASLt type of the copies. Enqueued on the current
 * stream (so GEMMs on different pool streams never share the copies). */
static nmt_status cast_inputs(nmt_cuda_ctx *c, int n, const float *const *src, const size_t *len,
                              const void **dst, cudaDataType_t *type) {
  const int bf16 = c->precision == NMT_PRECISION_BF16;
  size_t off[MAX_CASTS], total = 0;
  for (int i = 0; i < n; i++) {
    off[i] = total;
    const size_t bytes = len[i] * 2;
    if (len[i] > SIZE_MAX / 4 || total > SIZE_MAX / 2)
      return nmt_errorf(NMT_ERR_NOMEM, "cuda matmul: GEMM inputs of %zu elements are too large",
                        len[i]);
    total += nmt__cuda_pad(bytes); /* as nmt__cuda_gemm16_bytes sums them */
  }
  char *base;
  NMT_TRY(nmt__cuda_gemm16_scratch(c, total, (void **)&base));
  for (int i = 0; i < n; i++) {
    const unsigned grid = nmt__grid(len[i], 256);
    if (bf16) {
      __nv_bfloat16 *o = (__nv_bfloat16 *)(base + off[i]);
      cast_to_16<__nv_bfloat16><<<grid, 256, 0, nmt__cuda_stream(c)>>>(o, src[i], len[i]);
      NMT_CUDA_LAUNCH_CHECK("cast_to_16<bf16>");
    } else {
      __half *o = (__half *)(base + off[i]);
      cast_to_16<__half><<<grid, 256, 0, nmt__cuda_stream(c)>>>(o, src[i], len[i]);
      NMT_CUDA_LAUNCH_CHECK("cast_to_16<fp16>");
    }
    dst[i] = base + off[i];
  }
  *type = bf16 ? CUDA_R_16BF : CUDA_R_16F;
  return NMT_OK;
}

/* out (M,N) = inp (M,K) @ w (N,K)^T [+ bias (N)], then max(., 0) when relu: one GEMM with an
 * epilogue where cuda/gemm.cu takes it, else bias broadcast + GEMM (beta 1) + ReLU kernel. */
static nmt_status linear_fwd(nmt_cuda_ctx *c, const char *op, float *out, const float *inp,
                             const float *w, const float *bias, int M, int K, int N, int relu) {
  if (M < 0 || K < 0 || N < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: bad shape M=%d K=%d N=%d", op, M, K, N);
  if (M == 0 || N == 0) return NMT_OK;
  const size_t n = (size_t)M * (size_t)N;
  /* GEMM inputs: the fp32 arrays, or their 16-bit copies in fp16/bf16 mode (TF32 applies only
   * to fp32 inputs). */
  const void *a = w, *b = inp;
  cudaDataType_t t = CUDA_R_32F;
  const int tf32_ok = !half_mode(c);
  if (K > 0 && half_mode(c)) {
    /* The weight from the registered copy when it is there: only inp is cast. */
    const void *hw = cached_weight(c, w, (size_t)N * K);
    const float *src[2] = {inp, w};
    const size_t len[2] = {(size_t)M * K, (size_t)N * K};
    const void *h[2] = {NULL, NULL};
    NMT_TRY(cast_inputs(c, hw ? 1 : 2, src, len, h, &t));
    b = h[0];
    a = hw ? hw : h[1];
  }
  if (K > 0 && (bias || relu)) {
    const nmt__cuda_epilogue epi = bias ? (relu ? NMT_CUDA_EPI_RELU_BIAS : NMT_CUDA_EPI_BIAS)
                                        : NMT_CUDA_EPI_RELU;
    int fused = 0;
    NMT_TRY(nmt__cuda_gemm_epilogue(c, 1, 0, N, M, K, 1.0f, a, K, b, K, t, out, N, tf32_ok, epi,
                                    bias, &fused));
    if (fused) return NMT_OK;
  }
  /* Unfused (no epilogue wanted, or not taken): the reference's sequence. */
  if (bias) {
    broadcast_rows<<<nmt__grid(n, 256), 256, 0, nmt__cuda_stream(c)>>>(out, bias, (size_t)M, N);
    NMT_CUDA_LAUNCH_CHECK("broadcast_rows");
  } else if (K == 0) {
    NMT_CUDA_TRY(cudaMemsetAsync(out, 0, n * sizeof(float), nmt__cuda_stream(c)));
  }
  if (K > 0)
    NMT_TRY(nmt__cuda_gemm_ex(c, 1, 0, N, M, K, 1.0f, a, K, 0, b, K, 0, t, bias ? 1.0f : 0.0f,
                              out, N, 0, 1, tf32_ok));
  if (relu) NMT_TRY(nmt_cuda_relu_fwd(c, out, out, n));
  return NMT_OK;
}

// out: (M,N); inp: (M,K); w: (N,K); bias: (N) or NULL
nmt_status nmt_cuda_matmul_fwd(void *ctx, float *out, const float *inp, const float *w,
                               const float *bias, int M, int K, int N) {
  NMT_TRY(nmt__cuda_enter(ctx, "matmul_fwd"));
  return linear_fwd(nmt__cuda_ctx(ctx), "matmul_fwd", out, inp, w, bias, M, K, N, 0);
}

// out: (M,N) = relu(inp @ w^T + bias); inp: (M,K); w: (N,K); bias: (N) or NULL
nmt_status nmt_cuda_matmul_bias_relu_fwd(void *ctx, float *out, const float *inp, const float *w,
                                         const float *bias, int M, int K, int N) {
  NMT_TRY(nmt__cuda_enter(ctx, "matmul_bias_relu_fwd"));
  return linear_fwd(nmt__cuda_ctx(ctx), "matmul_bias_relu_fwd", out, inp, w, bias, M, K, N, 1);
}

// dinp: (M,K) += dout @ w; dw: (N,K) += dout^T @ inp; dbias: (N) += sum over rows of dout
nmt_status nmt_cuda_matmul_bwd(void *ctx, float *dinp, float *dw, float *dbias, const float *dout,
                               const float *inp, const float *w, int M, int K, int N) {
  NMT_TRY(nmt__cuda_enter(ctx, "matmul_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (M < 0 || K < 0 || N < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda matmul_bwd: bad shape M=%d K=%d N=%d", M, K, N);
  if (M == 0 || N == 0) return NMT_OK;
  if (K > 0 && (dinp || dw)) {
    if (!half_mode(c)) {
      if (dinp) NMT_TRY(nmt__cuda_gemm(c, 0, 0, K, M, N, 1.0f, w, K, 0, dout, N, 0, 1.0f, dinp, K, 0, 1, 1));
      if (dw) NMT_TRY(nmt__cuda_gemm(c, 0, 1, K, N, M, 1.0f, inp, K, 0, dout, N, 0, 1.0f, dw, K, 0, 1, 1));
    } else {
      /* dout once for both GEMMs, then w (unless the registered copy holds it) and/or inp:
       * only the copies that are needed. */
      const float *src[MAX_CASTS] = {dout};
      size_t len[MAX_CASTS] = {(size_t)M * N};
      int n = 1, iw = -1, ii = -1;
      const void *hw = dinp ? cached_weight(c, w, (size_t)N * K) : NULL;
      if (dinp && !hw) {
        iw = n++;
        src[iw] = w;
        len[iw] = (size_t)N * K;
      }
      if (dw) {
        ii = n++;
        src[ii] = inp;
        len[ii] = (size_t)M * K;
      }
      const void *h[MAX_CASTS] = {NULL, NULL, NULL};
      cudaDataType_t t = CUDA_R_16F;
      NMT_TRY(cast_inputs(c, n, src, len, h, &t));
      if (dinp)
        NMT_TRY(nmt__cuda_gemm_ex(c, 0, 0, K, M, N, 1.0f, hw ? hw : h[iw], K, 0, h[0], N, 0, t,
                                  1.0f, dinp, K, 0, 1, 0));
      if (dw)
        NMT_TRY(nmt__cuda_gemm_ex(c, 0, 1, K, N, M, 1.0f, h[ii], K, 0, h[0], N, 0, t, 1.0f, dw, K,
                                  0, 1, 0));
    }
  }
  if (dbias) {
    /* Not a GEMM of the model: fp32 in every mode (allow_tf32 = 0, fp32 inputs). */
    const float *ones;
    NMT_TRY(nmt__cuda_ones(c, (size_t)M, &ones));
    NMT_TRY(nmt__cuda_gemm(c, 0, 0, N, 1, M, 1.0f, dout, N, 0, ones, M, 0, 1.0f, dbias, N, 0, 1, 0));
  }
  return NMT_OK;
}

/* The toolkit's own conversions run on the host (both are __host__ __device__), so the CPU
 * tests can hold the reference's rounding to CUDA's without a GPU. */
void nmt_cuda_round_host(nmt_precision mode, float *out, const float *x, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (mode == NMT_PRECISION_BF16) {
      __nv_bfloat16 h;
      to16(&h, x[i]);
      out[i] = __bfloat162float(h);
    } else if (mode == NMT_PRECISION_FP16) {
      __half h;
      to16(&h, x[i]);
      out[i] = __half2float(h);
    } else {
      out[i] = x[i];
    }
  }
}

/* ---- STUB: the half-storage ops, to be implemented ---- */
nmt_status nmt_cuda_linear_half_fwd(void *ctx, nmt_act *out, const nmt_act *inp, const float *w, const float *bias, int M, int K, int N, int relu, uint8_t *relu_mask, int *mask_written, int batch, size_t param_stride, size_t out_stride) {
  (void)ctx; (void)out; (void)inp; (void)w; (void)bias; (void)M; (void)K; (void)N; (void)relu; (void)relu_mask; (void)mask_written; (void)batch; (void)param_stride; (void)out_stride;
  return nmt_errorf(NMT_ERR_INTERNAL, "cuda linear_half_fwd: not implemented yet");
}

nmt_status nmt_cuda_linear_half_bwd(void *ctx, void *dinp, nmt_dinp_mode dinp_mode, float *dw, float *dbias, const nmt_act *dout, const nmt_act *inp, const float *w, const nmt_act *relu_out, const uint8_t *relu_mask, float relu_scale, int M, int K, int N) {
  (void)ctx; (void)dinp; (void)dinp_mode; (void)dw; (void)dbias; (void)dout; (void)inp; (void)w; (void)relu_out; (void)relu_mask; (void)relu_scale; (void)M; (void)K; (void)N;
  return nmt_errorf(NMT_ERR_INTERNAL, "cuda linear_half_bwd: not implemented yet");
}
