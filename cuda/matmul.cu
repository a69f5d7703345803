/* cuda/matmul.cu — the linear layer y = x W^T + b (torch.nn.Linear layout) on cuBLASLt, and
 * its ReLU-fused variant relu(x W^T + b) (the FFN's first layer); and the half-storage path's
 * linear layer (linear_half_fwd / linear_half_bwd: half activations, at the end of the file).
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
#include <string.h>

#include "common.cuh"
#include "half.cuh"

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
  c->counters.casts += (uint64_t)n;
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
    nmt__cuda_launched(1);
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

/* ========================================================================================== */
/* The half-storage path's linear layer (nmt/backend.h linear_half_fwd / linear_half_bwd;
 * docs/cuda.md "Precision", "Bias and ReLU epilogues"). Activations are nmt_act in the
 * context's half type T (__half in fp16 mode, __nv_bfloat16 in bf16: cuda/half.cuh); weights
 * and biases are read through the registered half copy (a slice outside it is cast into the
 * gemm16 scratch per call and counted in counters().casts, as the reference counts it).
 *
 * Forward, per batch entry b (the same inp; w, bias param_stride apart; out out_stride apart):
 *   D = out_b^T (N x M, T) = W_b (N x K) . inp^T (K x M), fp32 accumulation, one rounding.
 * Fused where cuda/gemm.cu takes it: BIAS / RELU_BIAS / RELU with a half bias of the copy (the
 * bias batch stride for a batch), RELU_AUX_BIAS / RELU_AUX when the caller gives a mask (batch
 * 1; *mask_written = 1 only then), falling back to the mask-less epilogue, then to the unfused
 * sequence with the contract's single rounding: bias_h broadcast into out (T), the GEMM with
 * beta = 1 reading it back (C = D = out, T: round(acc + v(bias_h)) in fp32, as the epilogue),
 * then the ReLU in place on the half values (round(x) <= 0 exactly when x <= 0, so ReLU after
 * the rounding is the rounding of the ReLU; NaN -> 0 as the reference).
 *
 * Backward: dinp (M,K) = dout . W: D = dinp^T (K x M) = W^T (K x N) . dout^T (N x M), written
 * in T (NMT_DINP_HALF, beta 0) or fp32 (NMT_DINP_F32 beta 0, NMT_DINP_F32_ADD beta 1). The
 * ReLU's backward: the DRELU epilogue when the forward's mask is given, relu_scale == 1 (no
 * dropout after the ReLU: the mask knows nothing of it) and it is taken; otherwise one kernel
 * in place over the half dinp: v(relu_out) > 0 ? round(v(dinp) * relu_scale) : 0, the
 * reference's expression bit for bit. dW (N,K) += dout^T . inp: D = dW^T (K x N) = inp^T
 * (K x M) . dout (M x N), fp32 with beta 1; dbias on it with BGRADB into the op scratch
 * (written) and one add kernel into dbias, or, where BGRADB is not taken (or dW is not
 * wanted), the column sums of dout below (fixed order, fp32, no atomics). */

/* The context computes in fp16/bf16: the half-storage ops need a half type. */
static nmt_status half_op_check(const nmt_cuda_ctx *c, const char *op) {
  if (!half_mode(c))
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda %s: needs a context in fp16 or bf16 mode (the half-storage path has "
                      "no half type in fp32/tf32)",
                      op);
  return NMT_OK;
}

template <typename T>
__device__ __forceinline__ T half_zero() {
  return nmt__float_to_half<T>(0.0f); /* +0 */
}

// out_b: (rows, N) at out + b*out_stride <- bias_b (N) at bias + b*bias_stride broadcast over
// rows, or +0 without a bias; b < batch
template <typename T>
static __global__ void broadcast_half(T *out, size_t out_stride, const T *bias,
                                      size_t bias_stride, size_t rows, int N, int batch) {
  const size_t mn = rows * (size_t)N, total = mn * (size_t)batch;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t b = i / mn, e = i - b * mn;
    out[b * out_stride + e] = bias ? bias[b * bias_stride + e % (size_t)N] : half_zero<T>();
  }
}
NMT_CUDA_PRELOAD(broadcast_half<__half>);
NMT_CUDA_PRELOAD(broadcast_half<__nv_bfloat16>);

// x_b: (mn) at x + b*stride, in place: x > 0 ? x : +0 (NaN -> 0); b < batch
template <typename T>
static __global__ void relu_half(T *x, size_t stride, size_t mn, int batch) {
  const size_t total = mn * (size_t)batch;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t b = i / mn;
    T *p = x + b * stride + (i - b * mn);
    if (!(nmt__half_to_float(*p) > 0.0f)) *p = half_zero<T>();
  }
}
NMT_CUDA_PRELOAD(relu_half<__half>);
NMT_CUDA_PRELOAD(relu_half<__nv_bfloat16>);

/* The ReLU (and dropout) backward of one element: the reference's
 * r > 0 ? round(v(d) * scale) : 0, with the product rounded to fp32 first (__fmul_rn: never
 * contracted) as the reference's float product is. scale = 1 keeps d (v(d) is exact). */
template <typename T>
__device__ __forceinline__ T relu_grad(T d, T r, float scale) {
  return nmt__half_to_float(r) > 0.0f
             ? nmt__float_to_half<T>(__fmul_rn(nmt__half_to_float(d), scale))
             : half_zero<T>();
}

// d: (n) half, in place; r: (n) half, the ReLU's output after its dropout. VEC = 8: n_items
// groups of 8 elements moved as 16-byte vectors (both pointers 16-byte aligned); VEC = 1: n
// elements.
template <typename T, int VEC>
static __global__ void relu_bwd_half(T *d, const T *r, size_t n_items, float scale) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n_items;
       i += (size_t)gridDim.x * blockDim.x) {
    if constexpr (VEC == 8) {
      nmt__half8<T> dv = reinterpret_cast<const nmt__half8<T> *>(d)[i];
      const nmt__half8<T> rv = reinterpret_cast<const nmt__half8<T> *>(r)[i];
#pragma unroll
      for (int j = 0; j < 8; j++) dv.v[j] = relu_grad(dv.v[j], rv.v[j], scale);
      reinterpret_cast<nmt__half8<T> *>(d)[i] = dv;
    } else {
      d[i] = relu_grad(d[i], r[i], scale);
    }
  }
}
NMT_CUDA_PRELOAD(relu_bwd_half<__half, 8>);
NMT_CUDA_PRELOAD(relu_bwd_half<__half, 1>);
NMT_CUDA_PRELOAD(relu_bwd_half<__nv_bfloat16, 8>);
NMT_CUDA_PRELOAD(relu_bwd_half<__nv_bfloat16, 1>);

/* The bias gradient without BGRADB: dbias[n] += sum over rows m of v(dout[m][n]), in fp32, in
 * an order fixed by the shape (nmt's determinism rule: no float atomics). The rows are cut
 * into `chunks` chunks (colsum_chunks: a function of M alone) of rows_per_chunk rows; block
 * (x, y) owns a tile of CS_LANES x VEC columns in chunk y: its 8 row lanes (CS_ROW_LANES) each
 * sum every 8th row of the chunk in row order, one thread per VEC consecutive columns (VEC = 8:
 * one 16-byte load per row, when N % 8 == 0 and dout is 16-byte aligned, so every row starts
 * aligned), then the 8 lane sums of each column are added in lane order. One chunk: added
 * into dbias at once; more: each chunk's sums are written to an fp32 partial row of the op
 * scratch and colsum_finish adds the chunks in order. Resources: 256 threads, static shared
 * memory CS_ROW_LANES x CS_LANES x VEC floats (8 KiB for VEC = 8), no dynamic shared memory;
 * grid (ceil(N / (32 VEC)), chunks <= 64). */
enum { CS_LANES = 32, CS_ROW_LANES = 8, CS_THREADS = CS_LANES * CS_ROW_LANES };
enum { CS_MIN_ROWS = 256, CS_MAX_CHUNKS = 64 };

/* At least CS_MIN_ROWS rows per chunk (so the partials are at most M*N/256 floats), at most
 * CS_MAX_CHUNKS chunks. */
static size_t colsum_chunks(size_t rows) {
  size_t ch = rows / CS_MIN_ROWS;
  if (ch < 1) ch = 1;
  if (ch > CS_MAX_CHUNKS) ch = CS_MAX_CHUNKS;
  return ch;
}

size_t nmt__cuda_linear_half_scratch(size_t rows, size_t cols) {
  const size_t ch = colsum_chunks(rows);
  const size_t bgrad = nmt__cuda_pad(cols * sizeof(float));
  const size_t part = ch > 1 ? nmt__cuda_pad(ch * cols * sizeof(float)) : 0;
  return bgrad > part ? bgrad : part;
}

// dst: (N) += column sums (add = 1, one chunk) or (chunks, N) row blockIdx.y written (add =
// 0); x: (M, N) half
template <typename T, int VEC>
static __global__ void __launch_bounds__(CS_THREADS)
    colsum_half(float *dst, int add, const T *x, int M, int N, int rows_per_chunk) {
  __shared__ float sh[CS_ROW_LANES][CS_LANES * VEC];
  const int lane = (int)threadIdx.x % CS_LANES, ry = (int)threadIdx.x / CS_LANES;
  const int tile0 = (int)blockIdx.x * CS_LANES * VEC;
  const int col = tile0 + lane * VEC;
  const int r0 = (int)blockIdx.y * rows_per_chunk;
  const int r1 = M - r0 < rows_per_chunk ? M : r0 + rows_per_chunk;
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; j++) acc[j] = 0.0f;
  if (col < N) {
    for (int r = r0 + ry; r < r1; r += CS_ROW_LANES) {
      const T *p = x + (size_t)r * (size_t)N + col;
      if constexpr (VEC == 8) {
        const nmt__half8<T> v = *reinterpret_cast<const nmt__half8<T> *>(p);
#pragma unroll
        for (int j = 0; j < 8; j++) acc[j] += nmt__half_to_float(v.v[j]);
      } else {
        acc[0] += nmt__half_to_float(*p);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; j++) sh[ry][lane * VEC + j] = acc[j];
  __syncthreads();
  for (int t = (int)threadIdx.x; t < CS_LANES * VEC; t += (int)blockDim.x) {
    const int cc = tile0 + t;
    if (cc >= N) continue;
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < CS_ROW_LANES; k++) s += sh[k][t];
    if (add) dst[cc] += s;
    else dst[(size_t)blockIdx.y * (size_t)N + cc] = s;
  }
}
NMT_CUDA_PRELOAD(colsum_half<__half, 8>);
NMT_CUDA_PRELOAD(colsum_half<__half, 1>);
NMT_CUDA_PRELOAD(colsum_half<__nv_bfloat16, 8>);
NMT_CUDA_PRELOAD(colsum_half<__nv_bfloat16, 1>);

// dbias: (N) += sum over c < chunks of partial (chunks, N), in chunk order
static __global__ void colsum_finish(float *dbias, const float *partial, int chunks, int N) {
  for (int n = (int)(blockIdx.x * blockDim.x + threadIdx.x); n < N;
       n += (int)(gridDim.x * blockDim.x)) {
    float s = 0.0f;
    for (int ch = 0; ch < chunks; ch++) s += partial[(size_t)ch * (size_t)N + n];
    dbias[n] += s;
  }
}
NMT_CUDA_PRELOAD(colsum_finish);

template <typename T>
static nmt_status colsum_t(nmt_cuda_ctx *c, float *dbias, const T *x, int M, int N,
                           float *partial) {
  const int vec = nmt__half_vec_ok(x, (size_t)N) ? 8 : 1;
  const int chunks = (int)colsum_chunks((size_t)M);
  const int rows_per_chunk = (M + chunks - 1) / chunks;
  const size_t tiles = ((size_t)N + (size_t)(CS_LANES * vec) - 1) / (size_t)(CS_LANES * vec);
  /* grid.x up to 2^31 - 1 tiles: any int N; grid.y = chunks <= 64. */
  const dim3 grid((unsigned)tiles, (unsigned)chunks);
  float *dst = chunks > 1 ? partial : dbias;
  cudaStream_t s = nmt__cuda_stream(c);
  if (vec == 8)
    colsum_half<T, 8><<<grid, CS_THREADS, 0, s>>>(dst, chunks == 1, x, M, N, rows_per_chunk);
  else
    colsum_half<T, 1><<<grid, CS_THREADS, 0, s>>>(dst, chunks == 1, x, M, N, rows_per_chunk);
  NMT_CUDA_LAUNCH_CHECK("colsum_half");
  if (chunks > 1) {
    colsum_finish<<<nmt__grid((size_t)N, 256), 256, 0, s>>>(dbias, partial, chunks, N);
    NMT_CUDA_LAUNCH_CHECK("colsum_finish");
  }
  return NMT_OK;
}

template <typename T>
static nmt_status relu_bwd_t(nmt_cuda_ctx *c, T *d, const T *r, size_t n, float scale) {
  cudaStream_t s = nmt__cuda_stream(c);
  if (nmt__half_vec_ok(d, n) && nmt__half_vec_ok(r, n))
    relu_bwd_half<T, 8><<<nmt__grid(n / 8, 256), 256, 0, s>>>(d, r, n / 8, scale);
  else
    relu_bwd_half<T, 1><<<nmt__grid(n, 256), 256, 0, s>>>(d, r, n, scale);
  NMT_CUDA_LAUNCH_CHECK("relu_bwd_half");
  return NMT_OK;
}

template <typename T>
static nmt_status broadcast_t(nmt_cuda_ctx *c, T *out, size_t out_stride, const T *bias,
                              size_t bias_stride, int M, int N, int batch) {
  const size_t total = (size_t)M * (size_t)N * (size_t)batch;
  broadcast_half<T><<<nmt__grid(total, 256), 256, 0, nmt__cuda_stream(c)>>>(
      out, out_stride, bias, bias_stride, (size_t)M, N, batch);
  NMT_CUDA_LAUNCH_CHECK("broadcast_half");
  return NMT_OK;
}

template <typename T>
static nmt_status relu_t(nmt_cuda_ctx *c, T *x, size_t stride, size_t mn, int batch) {
  relu_half<T><<<nmt__grid(mn * (size_t)batch, 256), 256, 0, nmt__cuda_stream(c)>>>(
      x, stride, mn, batch);
  NMT_CUDA_LAUNCH_CHECK("relu_half");
  return NMT_OK;
}

/* batch slices src + b*src_stride (len floats each) cast to T at dst + b*dst_stride elements:
 * a weight or bias outside the registered copy (one cast per slice, counted as the reference
 * counts its roundings). */
template <typename T>
static nmt_status cast_slices(nmt_cuda_ctx *c, T *dst, size_t dst_stride, const float *src,
                              size_t src_stride, size_t len, int batch) {
  for (int b = 0; b < batch; b++) {
    cast_to_16<T><<<nmt__grid(len, 256), 256, 0, nmt__cuda_stream(c)>>>(
        dst + (size_t)b * dst_stride, src + (size_t)b * src_stride, len);
    NMT_CUDA_LAUNCH_CHECK("cast_to_16");
  }
  c->counters.casts += (uint64_t)batch;
  return NMT_OK;
}

/* The same, choosing T from the context's mode. */
static nmt_status cast_slices_mode(nmt_cuda_ctx *c, void *dst, size_t dst_stride,
                                   const float *src, size_t src_stride, size_t len, int batch) {
  if (nmt__cuda_half_bf16(c))
    return cast_slices(c, (__nv_bfloat16 *)dst, dst_stride, src, src_stride, len, batch);
  return cast_slices(c, (__half *)dst, dst_stride, src, src_stride, len, batch);
}

// out: batch x (M,N) half at out + b*out_stride; inp: (M,K) half; w: (N,K), bias: (N) fp32
// at + b*param_stride, read through the half copy
nmt_status nmt_cuda_linear_half_fwd(void *ctx, nmt_act *out, const nmt_act *inp, const float *w,
                                    const float *bias, int M, int K, int N, int relu,
                                    uint8_t *relu_mask, int *mask_written, int batch,
                                    size_t param_stride, size_t out_stride) {
  if (mask_written) *mask_written = 0;
  NMT_TRY(nmt__cuda_enter(ctx, "linear_half_fwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(half_op_check(c, "linear_half_fwd"));
  if (M < 0 || K < 0 || N < 0 || batch < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda linear_half_fwd: bad shape M=%d K=%d N=%d batch=%d",
                      M, K, N, batch);
  if (M == 0 || N == 0) return NMT_OK;
  const size_t mn = (size_t)M * (size_t)N, nk = (size_t)N * (size_t)K;
  if (!out || (K > 0 && (!inp || !w)))
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda linear_half_fwd: NULL %s",
                      !out ? "out" : !inp ? "inp" : "w");
  if (batch > 1 && out_stride < mn)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda linear_half_fwd: out_stride %zu < M*N = %zu: the batch's outputs "
                      "would overlap",
                      out_stride, mn);
  if (batch > 1 && (param_stride > (size_t)INT64_MAX / (size_t)batch ||
                    out_stride > (size_t)INT64_MAX / (size_t)batch))
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda linear_half_fwd: batch strides too large");
  const int bf16 = nmt__cuda_half_bf16(c);
  const cudaDataType_t t = bf16 ? CUDA_R_16BF : CUDA_R_16F;
  const size_t span = (size_t)(batch - 1) * param_stride; /* first to last slice */

  /* The half weights and bias: slices of the registered copy (param_stride apart, as in the
   * fp32 master buffer), else cast per call into gemm16 (each slice 256-byte aligned). */
  const void *wh = K > 0 ? cached_weight(c, w, span + nk) : NULL;
  const void *bh = bias ? cached_weight(c, bias, span + (size_t)N) : NULL;
  int64_t w_stride = (int64_t)param_stride, b_stride = (int64_t)param_stride;
  const int cast_w = K > 0 && !wh, cast_b = bias && !bh;
  if (cast_w || cast_b) {
    const size_t w_slice = cast_w ? nmt__cuda_pad(2 * nk) : 0;
    const size_t b_slice = cast_b ? nmt__cuda_pad(2 * (size_t)N) : 0;
    if (w_slice + b_slice > SIZE_MAX / (size_t)batch)
      return nmt_errorf(NMT_ERR_NOMEM, "cuda linear_half_fwd: weights of %zu elements are too "
                        "large to cast", nk);
    char *base;
    NMT_TRY(nmt__cuda_gemm16_scratch(c, (w_slice + b_slice) * (size_t)batch, (void **)&base));
    if (cast_w) {
      NMT_TRY(cast_slices_mode(c, base, w_slice / 2, w, param_stride, nk, batch));
      wh = base;
      w_stride = (int64_t)(w_slice / 2);
    }
    if (cast_b) {
      char *bb = base + w_slice * (size_t)batch;
      NMT_TRY(cast_slices_mode(c, bb, b_slice / 2, bias, param_stride, (size_t)N, batch));
      bh = bb;
      b_stride = (int64_t)(b_slice / 2);
    }
  }

  nmt__cuda_gemm_desc g;
  memset(&g, 0, sizeof g);
  g.transa = 1, g.transb = 0, g.m = N, g.n = M, g.k = K, g.alpha = 1.0f;
  g.A = wh, g.lda = K, g.strideA = w_stride;
  g.B = inp, g.ldb = K, g.strideB = 0; /* every batch entry reads the same input */
  g.ab_type = t, g.C = out, g.ldc = N, g.strideC = (int64_t)out_stride, g.cd_type = t;
  g.batch = batch, g.allow_tf32 = 0;
  int done = 0;
  if (K > 0 && (bias || relu)) {
    /* The mask's epilogue first when asked for, then the same without the mask. */
    const int mask = relu && relu_mask && batch == 1;
    nmt__cuda_epilogue tries[2];
    int n_tries = 0;
    if (mask) tries[n_tries++] = bias ? NMT_CUDA_EPI_RELU_AUX_BIAS : NMT_CUDA_EPI_RELU_AUX;
    tries[n_tries++] = bias ? (relu ? NMT_CUDA_EPI_RELU_BIAS : NMT_CUDA_EPI_BIAS)
                            : NMT_CUDA_EPI_RELU;
    for (int i = 0; i < n_tries && !done; i++) {
      g.epi = tries[i];
      g.bias = bias ? bh : NULL;
      g.bias_stride = b_stride;
      g.aux = mask && i == 0 ? relu_mask : NULL;
      NMT_TRY(nmt__cuda_gemm_lt(c, &g, &done));
      if (done && g.aux && mask_written) *mask_written = 1;
    }
  }
  if (done) return NMT_OK;

  /* Unfused: bias_h broadcast into out, the GEMM adding onto it (beta 1), the ReLU. */
  if (bias || K == 0) {
    if (bf16)
      NMT_TRY(broadcast_t(c, (__nv_bfloat16 *)out, out_stride, (const __nv_bfloat16 *)bh,
                          (size_t)b_stride, M, N, batch));
    else
      NMT_TRY(broadcast_t(c, (__half *)out, out_stride, (const __half *)bh, (size_t)b_stride, M,
                          N, batch));
  }
  if (K > 0) {
    g.epi = NMT_CUDA_EPI_NONE, g.bias = NULL, g.bias_stride = 0, g.aux = NULL;
    g.beta = bias ? 1.0f : 0.0f;
    NMT_TRY(nmt__cuda_gemm_lt(c, &g, &done));
  }
  if (relu && (K > 0 || bias)) {
    if (bf16) NMT_TRY(relu_t(c, (__nv_bfloat16 *)out, out_stride, mn, batch));
    else NMT_TRY(relu_t(c, (__half *)out, out_stride, mn, batch));
  }
  return NMT_OK;
}

// dinp: (M,K) half or fp32 by dinp_mode; dw: (N,K) +=; dbias: (N) +=; dout: (M,N) half;
// inp: (M,K) half; w: (N,K) fp32 (through the half copy); relu_out: (M,K) half or NULL
nmt_status nmt_cuda_linear_half_bwd(void *ctx, void *dinp, nmt_dinp_mode dinp_mode, float *dw,
                                    float *dbias, const nmt_act *dout, const nmt_act *inp,
                                    const float *w, const nmt_act *relu_out,
                                    const uint8_t *relu_mask, float relu_scale, int M, int K,
                                    int N) {
  NMT_TRY(nmt__cuda_enter(ctx, "linear_half_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(half_op_check(c, "linear_half_bwd"));
  if (M < 0 || K < 0 || N < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda linear_half_bwd: bad shape M=%d K=%d N=%d", M, K,
                      N);
  if (dinp_mode != NMT_DINP_HALF && dinp_mode != NMT_DINP_F32 && dinp_mode != NMT_DINP_F32_ADD)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda linear_half_bwd: unknown dinp mode %d",
                      (int)dinp_mode);
  if (relu_out && dinp_mode != NMT_DINP_HALF)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda linear_half_bwd: a ReLU backward (relu_out) needs a half dinp");
  const size_t mk = (size_t)M * (size_t)K, nk = (size_t)N * (size_t)K;
  cudaStream_t s = nmt__cuda_stream(c);
  if (M == 0 || N == 0) {
    /* Nothing flows back: a written dinp is zeros (+0 in both half types and in fp32). */
    if (dinp && mk > 0 && dinp_mode != NMT_DINP_F32_ADD) {
      const size_t bytes = mk * (dinp_mode == NMT_DINP_HALF ? sizeof(nmt_act) : sizeof(float));
      NMT_CUDA_TRY(cudaMemsetAsync(dinp, 0, bytes, s));
      nmt__cuda_launched(1);
    }
    return NMT_OK;
  }
  if (!dout || (K > 0 && dinp && !w) || (K > 0 && dw && !inp))
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda linear_half_bwd: NULL %s",
                      !dout ? "dout" : (dinp && !w) ? "w" : (dw && !inp) ? "inp" : "dinp");
  const int bf16 = nmt__cuda_half_bf16(c);
  const cudaDataType_t t = bf16 ? CUDA_R_16BF : CUDA_R_16F;
  nmt__cuda_gemm_desc g;

  if (K > 0 && dinp) {
    const void *wh = cached_weight(c, w, nk);
    if (!wh) {
      void *h;
      NMT_TRY(nmt__cuda_gemm16_scratch(c, nmt__cuda_pad(2 * nk), &h));
      NMT_TRY(cast_slices_mode(c, h, 0, w, 0, nk, 1));
      wh = h;
    }
    const int half_out = dinp_mode == NMT_DINP_HALF;
    memset(&g, 0, sizeof g);
    g.transa = 0, g.transb = 0, g.m = K, g.n = M, g.k = N, g.alpha = 1.0f;
    g.A = wh, g.lda = K, g.B = dout, g.ldb = N, g.ab_type = t;
    g.beta = dinp_mode == NMT_DINP_F32_ADD ? 1.0f : 0.0f;
    g.C = dinp, g.ldc = K, g.cd_type = half_out ? t : CUDA_R_32F, g.batch = 1;
    int done = 0, relu_done = 0;
    /* DRELU reads the forward's mask, which holds the pre-activation's sign and knows nothing
     * of a dropout after the ReLU: only with relu_scale == 1 (no dropout). */
    if (half_out && relu_out && relu_mask && relu_scale == 1.0f) {
      g.epi = NMT_CUDA_EPI_DRELU;
      g.aux = (void *)relu_mask; /* read, not written: DRELU's input */
      NMT_TRY(nmt__cuda_gemm_lt(c, &g, &done));
      relu_done = done;
    }
    if (!done) {
      g.epi = NMT_CUDA_EPI_NONE, g.aux = NULL;
      NMT_TRY(nmt__cuda_gemm_lt(c, &g, &done));
    }
    if (relu_out && !relu_done) {
      if (bf16)
        NMT_TRY(relu_bwd_t(c, (__nv_bfloat16 *)dinp, (const __nv_bfloat16 *)relu_out, mk,
                           relu_scale));
      else
        NMT_TRY(relu_bwd_t(c, (__half *)dinp, (const __half *)relu_out, mk, relu_scale));
    }
  }

  /* The op scratch of the bias gradient (BGRADB's output or the column sums' partials), asked
   * for at its one size so that reserve_scratch covers it. */
  float *bscratch = NULL;
  if (dbias)
    NMT_TRY(nmt__cuda_scratch(c, nmt__cuda_linear_half_scratch((size_t)M, (size_t)N),
                              (void **)&bscratch));
  int dbias_done = 0;
  if (K > 0 && dw) {
    memset(&g, 0, sizeof g);
    g.transa = 0, g.transb = 1, g.m = K, g.n = N, g.k = M, g.alpha = 1.0f;
    g.A = inp, g.lda = K, g.B = dout, g.ldb = N, g.ab_type = t;
    g.beta = 1.0f; /* weight gradients accumulate across micro-batches */
    g.C = dw, g.ldc = K, g.cd_type = CUDA_R_32F, g.batch = 1;
    int done = 0;
    if (dbias) {
      g.epi = NMT_CUDA_EPI_BGRADB;
      g.bias = bscratch; /* written: the sums over the M tokens */
      NMT_TRY(nmt__cuda_gemm_lt(c, &g, &done));
      if (done) {
        NMT_TRY(nmt_cuda_add(c, dbias, dbias, bscratch, (size_t)N));
        dbias_done = 1;
      }
    }
    if (!done) {
      g.epi = NMT_CUDA_EPI_NONE, g.bias = NULL;
      NMT_TRY(nmt__cuda_gemm_lt(c, &g, &done));
    }
  }
  if (dbias && !dbias_done) {
    if (bf16) NMT_TRY(colsum_t(c, dbias, (const __nv_bfloat16 *)dout, M, N, bscratch));
    else NMT_TRY(colsum_t(c, dbias, (const __half *)dout, M, N, bscratch));
  }
  return NMT_OK;
}
