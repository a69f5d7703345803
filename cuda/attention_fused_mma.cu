/* cuda/attention_fused_mma.cu — fused multi-head attention on tensor cores (issue 35): the
 * WMMA variant (nvcuda::wmma, m16n16k16, fp16 / bf16 inputs, fp32 accumulators) of
 * cuda/attention_fused.cu's SIMT kernels for half storage (half = 1), beside them. The contract
 * is nmt/attention.h: every product's inputs are half values (q, k, v, dout as stored; A and dS
 * rounded to the half type before they are multiplied), every sum fp32, in the order the
 * tensor cores add (the backend's order), the scale applied once after each sum.
 *
 * Selection (nmt__cuda_attention_fused_mma_serves, called by the entries of
 * cuda/attention_fused.cu): half = 1, the context's implementation is mma (the default; the
 * environment variable NMT_ATTENTION_FUSED_IMPL = simt | mma, read once when the context is
 * created, or nmt_cuda_ctx_set_attention_fused_impl), and Tk <= 256: the forward keeps a query
 * tile's whole score row in shared memory. Beyond 256 keys both ops fall back to SIMT.
 *
 * Design: 128 threads = 4 warps per block, tiles of 16 queries x 16 keys (one WMMA tile), the
 * inputs staged in the half type (rows strided by DK + 8 elements: 16-byte aligned rows, WMMA
 * loads off one bank pattern), rows past Tq and keys past k_lens zero-filled (the MMAs read
 * them as zeros times zero weights). A warp owns the output column fragments f = warp + 4u of
 * a 16 x DK tile (DK = 32: warps 0-1).
 *   afm_fwd, one block per (b, h, 16 queries): S = Q K^T by WMMA over the visible keys
 *     (rounded up to 16; K staged in chunks of 4096 / DK keys) into shared fp32 (16 x 264);
 *     per row (one warp per 4 rows) the exact max and sum over the visible keys, lse, then
 *     A = round(dropout(expf(scale S - lse))) as half (zeros for invisible keys); O = A V by
 *     WMMA (V staged in chunks), out = round(O).
 *   D = rowsum(dout * out): the SIMT file's kernel (nmt__cuda_attention_fused_drow), so both
 *     variants' D are bitwise equal.
 *   afm_bwd_kv, one block per (b, h, 16 keys): for every query tile that sees the keys
 *     (causal: from the key tile's own index), S = Q K^T (warp 0) and dA = dout V^T (warp 1)
 *     by WMMA, then per pair P, A, dP, dS = round(P (dP - D)) into shared memory; dV += A^T dout
 *     and dK += dS^T Q by WMMA into fragments held across query tiles (one owner per element,
 *     no atomics); dv = round(dV), dkey = round(scale dK).
 *   afm_bwd_q, one block per (b, h, 16 queries): for every visible key tile the same S, dA,
 *     dS, then dQ += dS K by WMMA; dq = round(scale dQ).
 * Shared memory (static, no opt-in; ptxas -v, every arch; registers in docs/cuda.md, no
 *   spills): afm_fwd 36.0 / 36.0 / 37.5 KB, afm_bwd_kv 11.4 / 17.4 / 29.4 KB, afm_bwd_q
 *   10.6 / 16.6 / 28.6 KB for dk = 32 / 64 / 128.
 * The device error word (NMT_CUDA_ERR_ATT_KLEN) reports k_lens[b] outside [1, Tk], clamped.
 * No allocation, no host synchronisation: the current stream only. */
#include <mma.h>

#include <climits>

#include "attention_fused_common.cuh"
#include "attention_fused_mma.cuh"
#include "common.cuh"
#include "half.cuh"
#include "nmt/attention.h"

using namespace nvcuda;

enum {
  AFM_THREADS = 128,
  AFM_T = 16,        /* queries and keys per tile: one WMMA tile */
  AFM_TK_MAX = 256,  /* keys a forward score row holds */
  AFM_SS = AFM_TK_MAX + 8, /* the forward's score / weight rows (floats / halves) */
  AFM_PS = AFM_T + 4,      /* a 16 x 16 fp32 tile's row stride */
  AFM_PA = AFM_T + 8,      /* a 16 x 16 half tile's row stride */
};

/* The kernels' scalar arguments (one copy per launch, in the parameter space). */

using frag_c = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
template <typename E, typename L>
using frag_a = wmma::fragment<wmma::matrix_a, 16, 16, 16, E, L>;
template <typename E, typename L>
using frag_b = wmma::fragment<wmma::matrix_b, 16, 16, 16, E, L>;


/* dst rows r < R (stride LD elements) <- the head columns [col0, col0 + DK) of source rows
 * b*T + t0 + r (stride ld), as stored; zeros for rows t0 + r >= lim (<= T), never read. Keys
 * are staged with lim = k_lens[b]: a padded key's row is multiplied by a zero weight in the
 * tile's products, and a zero there keeps a non-finite value out of them (the SIMT kernels
 * skip those keys). Block-wide. */
template <typename E, int DK, int LD>
__device__ __forceinline__ void afm_stage(E *dst, const E *src, int R, int b, int T, int lim,
                                          int ld, int col0, int t0) {
  const E zero = nmt__float_to_half<E>(0.0f);
  for (int e = threadIdx.x; e < R * DK; e += AFM_THREADS) {
    const int r = e / DK, d = e % DK, t = t0 + r;
    dst[r * LD + d] = t < lim ? src[((size_t)b * T + t) * (size_t)ld + col0 + d] : zero;
  }
}

/* acc (zeroed first) = A B^T over DK: a (16 x DK) and b (16 x DK) row-major of stride LD, so
 * b read column-major is B^T. One warp. */
template <typename E, int DK, int LD>
__device__ __forceinline__ void afm_abt(frag_c &acc, const E *a, const E *b) {
  wmma::fill_fragment(acc, 0.0f);
#pragma unroll
  for (int d0 = 0; d0 < DK; d0 += 16) {
    frag_a<E, wmma::row_major> fa;
    frag_b<E, wmma::col_major> fb;
    wmma::load_matrix_sync(fa, a + d0, LD);
    wmma::load_matrix_sync(fb, b + d0, LD);
    wmma::mma_sync(acc, fa, fb, acc);
  }
}

/* The forward's score rows: ss[qq][j] = sum_d q_d k_jd (unscaled) for keys j < nk (a multiple
 * of 16), K staged in chunks of KC keys into kvs. Ends with the block synchronized. */
template <typename E, int DK, int LD, int KC>
__device__ __forceinline__ void afm_fwd_scores(float *ss, E *kvs, const E *qs, const E *k,
                                               int nk, int b, int Tk, int kl, int ldkv,
                                               int col) {
  const int warp = threadIdx.x >> 5;
  for (int j0 = 0; j0 < nk; j0 += KC) {
    const int nr = nk - j0 < KC ? nk - j0 : KC;
    __syncthreads(); /* the previous chunk's readers are done (first: q staged) */
    afm_stage<E, DK, LD>(kvs, k, nr, b, Tk, kl, ldkv, col, j0);
    __syncthreads();
    for (int f = warp; f < nr / 16; f += AFM_THREADS / 32) {
      frag_c acc;
      afm_abt<E, DK, LD>(acc, qs, kvs + f * 16 * LD);
      wmma::store_matrix_sync(ss + j0 + f * 16, acc, AFM_SS, wmma::mem_row_major);
    }
  }
  __syncthreads();
}

/* The forward's softmax: warp w takes rows w + 4r. m, l over the visible keys (lane-strided,
 * xor-tree reduced), lse written, A = round(dropout(P)) into as for keys < nk (0 invisible). */
template <typename E>
__device__ __forceinline__ void afm_fwd_softmax(const af_params &p, E *as, const float *ss,
                                                float *lse, int bh, int i0, int kl, int nk) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll 1
  for (int qq = warp; qq < AFM_T; qq += AFM_THREADS / 32) {
    const int i = i0 + qq, lim = af_lim(p, i, p.Tq, kl);
    const float *srow = ss + qq * AFM_SS;
    float m = -INFINITY, l = 0.0f;
    for (int j = lane; j < lim; j += 32) m = fmaxf(m, __fmul_rn(p.scale, srow[j]));
    m = warp_allmax(m);
    for (int j = lane; j < lim; j += 32) l += expf(__fmul_rn(p.scale, srow[j]) - m);
    l = warp_allsum(l);
    const float ls = m + logf(l);
    if (lane == 0 && lim > 0) lse[(size_t)bh * p.Tq + i] = ls;
    const uint64_t e0 = ((uint64_t)bh * (uint64_t)p.Tq + (uint64_t)i) * (uint64_t)p.Tk;
    for (int j = lane; j < nk; j += 32) {
      float a = 0.0f;
      if (j < lim) a = expf(__fmul_rn(p.scale, srow[j]) - ls) * af_drop(p, e0 + j);
      as[qq * AFM_SS + j] = nmt__float_to_half<E>(a);
    }
  }
}

template <typename E, int DK>
static __global__ void __launch_bounds__(AFM_THREADS)
    afm_fwd(E *out, float *lse, af_params p) {
  constexpr int LD = DK + 8, KC = 4096 / DK, NF = DK / 16, NW = AFM_THREADS / 32;
  constexpr int NFW = (NF + NW - 1) / NW, OS = DK + 4;
  __shared__ __align__(32) E qs[AFM_T * LD];
  __shared__ __align__(32) E kvs[KC * LD];
  __shared__ __align__(32) float ss[AFM_T * AFM_SS];
  __shared__ __align__(32) E as[AFM_T * AFM_SS];
  const int Tq = p.Tq, Tk = p.Tk, C = p.H * DK;
  const int nqt = (Tq + AFM_T - 1) / AFM_T;
  const int bh = (int)(blockIdx.x / (unsigned)nqt);
  const int i0 = (int)(blockIdx.x % (unsigned)nqt) * AFM_T;
  const int b = bh / p.H, col = (bh % p.H) * DK, warp = threadIdx.x >> 5;
  const int kl = af_klen(p, b);
  const int i_last = (i0 + AFM_T < Tq ? i0 + AFM_T : Tq) - 1;
  const int blim = p.causal && i_last + 1 < kl ? i_last + 1 : kl; /* keys any row here sees */
  const int nk = (blim + 15) / 16 * 16;                          /* <= 256: Tk <= 256 */
  const E *q = (const E *)p.q, *k = (const E *)p.k, *v = (const E *)p.v;
  afm_stage<E, DK, LD>(qs, q, AFM_T, b, Tq, Tq, p.ldq, col, i0);
  afm_fwd_scores<E, DK, LD, KC>(ss, kvs, qs, k, nk, b, Tk, kl, p.ldkv, col);
  afm_fwd_softmax<E>(p, as, ss, lse, bh, i0, kl, nk);
  frag_c o[NFW];
#pragma unroll
  for (int u = 0; u < NFW; u++) wmma::fill_fragment(o[u], 0.0f);
  for (int j0 = 0; j0 < nk; j0 += KC) {
    const int nr = nk - j0 < KC ? nk - j0 : KC;
    __syncthreads(); /* the softmax (first) or the previous chunk's readers are done */
    afm_stage<E, DK, LD>(kvs, v, nr, b, Tk, kl, p.ldkv, col, j0);
    __syncthreads();
    for (int s0 = 0; s0 < nr; s0 += 16) {
      frag_a<E, wmma::row_major> fa;
      wmma::load_matrix_sync(fa, as + j0 + s0, AFM_SS);
#pragma unroll
      for (int u = 0; u < NFW; u++) {
        const int f = warp + NW * u;
        if (f >= NF) continue; /* warp-uniform */
        frag_b<E, wmma::row_major> fb;
        wmma::load_matrix_sync(fb, kvs + s0 * LD + f * 16, LD);
        wmma::mma_sync(o[u], fa, fb, o[u]);
      }
    }
  }
  /* O through shared memory (the score rows are dead: the softmax is behind a barrier). */
#pragma unroll
  for (int u = 0; u < NFW; u++) {
    const int f = warp + NW * u;
    if (f < NF) wmma::store_matrix_sync(ss + f * 16, o[u], OS, wmma::mem_row_major);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < AFM_T * DK; e += AFM_THREADS) {
    const int qq = e / DK, d = e % DK, i = i0 + qq;
    if (i < Tq)
      out[((size_t)b * Tq + i) * (size_t)C + col + d] = nmt__float_to_half<E>(ss[qq * OS + d]);
  }
}


/* lse and D of the query tile's rows (0 past Tq; D 0 without drow). */
__device__ __forceinline__ void afm_stage_rows(float *lse_s, float *d_s, const float *lse,
                                               const float *drow, int bh, int i0, int Tq) {
  for (int qq = threadIdx.x; qq < AFM_T; qq += AFM_THREADS) {
    const int i = i0 + qq;
    const size_t at = (size_t)bh * Tq + i;
    lse_s[qq] = i < Tq ? lse[at] : 0.0f;
    d_s[qq] = i < Tq && drow ? drow[at] : 0.0f;
  }
}

/* The pairs of one (16 queries from i0, 16 keys from j0) tile: S = Q K^T (warp 0) and, with
 * want_ds, dA = dout V^T (warp 1) by WMMA into ss / das; then per pair P = expf(scale S - lse),
 * A = round(P f) into as (want_a) and dS = round(P (f dA - D)) into dss (want_ds), 0 for pairs
 * not visible. Starts and ends with the block synchronized. */
template <typename E, int DK, int LD>
__device__ __forceinline__ void afm_pairs(const af_params &p, int bh, int i0, int j0, int kl,
                                          const E *qs, const E *dos, const E *ks, const E *vs,
                                          const float *lse_s, const float *d_s, float *ss,
                                          float *das, E *as, E *dss, bool want_a,
                                          bool want_ds) {
  const int warp = threadIdx.x >> 5;
  if (warp == 0 || (warp == 1 && want_ds)) {
    frag_c acc;
    afm_abt<E, DK, LD>(acc, warp == 0 ? qs : dos, warp == 0 ? ks : vs);
    wmma::store_matrix_sync(warp == 0 ? ss : das, acc, AFM_PS, wmma::mem_row_major);
  }
  __syncthreads();
  for (int t = threadIdx.x; t < AFM_T * AFM_T; t += AFM_THREADS) {
    const int qq = t / AFM_T, jj = t % AFM_T, i = i0 + qq, j = j0 + jj;
    float a = 0.0f, dsv = 0.0f;
    if (j < af_lim(p, i, p.Tq, kl)) {
      const float P = expf(__fmul_rn(p.scale, ss[qq * AFM_PS + jj]) - lse_s[qq]);
      const uint64_t e = ((uint64_t)bh * (uint64_t)p.Tq + (uint64_t)i) * (uint64_t)p.Tk + j;
      const float f = af_drop(p, e);
      a = P * f;
      /* dP = dA f rounded on its own (no contraction into the subtraction), as the contract */
      if (want_ds) dsv = P * (__fmul_rn(das[qq * AFM_PS + jj], f) - d_s[qq]);
    }
    if (want_a) as[qq * AFM_PA + jj] = nmt__float_to_half<E>(a);
    if (want_ds) dss[qq * AFM_PA + jj] = nmt__float_to_half<E>(dsv);
  }
  __syncthreads();
}

/* A 16 x DK tile of fragments (warp w: column fragments w + 4u) written to global rows
 * t0 + r < T (stride ld, head columns from col): round(x), or round(scale x) with scaled.
 * Through os (16 x (DK + 4) floats). Block-wide; starts with a barrier. */
template <typename E, int DK, int NFW>
__device__ __forceinline__ void afm_write(E *g, frag_c (&acc)[NFW], float *os, bool scaled,
                                          float scale, int b, int T, int ld, int col, int t0) {
  constexpr int NF = DK / 16, NW = AFM_THREADS / 32, OS = DK + 4;
  const int warp = threadIdx.x >> 5;
  __syncthreads(); /* os's previous readers are done */
#pragma unroll
  for (int u = 0; u < NFW; u++) {
    const int f = warp + NW * u;
    if (f < NF) wmma::store_matrix_sync(os + f * 16, acc[u], OS, wmma::mem_row_major);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < AFM_T * DK; e += AFM_THREADS) {
    const int r = e / DK, d = e % DK, t = t0 + r;
    const float x = os[r * OS + d];
    if (t < T)
      g[((size_t)b * T + t) * (size_t)ld + col + d] =
          nmt__float_to_half<E>(scaled ? __fmul_rn(scale, x) : x);
  }
}

template <typename E, int DK>
static __global__ void __launch_bounds__(AFM_THREADS)
    afm_bwd_kv(E *dkey, E *dv, const float *lse, const float *drow, const E *dout,
               af_params p) {
  constexpr int LD = DK + 8, NF = DK / 16, NW = AFM_THREADS / 32, NFW = (NF + NW - 1) / NW;
  __shared__ __align__(32) E ks[AFM_T * LD];
  __shared__ __align__(32) E vs[AFM_T * LD];
  __shared__ __align__(32) E qs[AFM_T * LD];
  __shared__ __align__(32) E dos[AFM_T * LD];
  __shared__ __align__(32) float ss[AFM_T * AFM_PS];
  __shared__ __align__(32) float das[AFM_T * AFM_PS];
  __shared__ __align__(32) E as[AFM_T * AFM_PA];
  __shared__ __align__(32) E dss[AFM_T * AFM_PA];
  __shared__ __align__(32) float os[AFM_T * (DK + 4)];
  __shared__ float lse_s[AFM_T], d_s[AFM_T];
  const int Tq = p.Tq, Tk = p.Tk, C = p.H * DK;
  const int nkt = (Tk + AFM_T - 1) / AFM_T;
  const int bh = (int)(blockIdx.x / (unsigned)nkt);
  const int j0 = (int)(blockIdx.x % (unsigned)nkt) * AFM_T;
  const int b = bh / p.H, col = (bh % p.H) * DK, warp = threadIdx.x >> 5;
  const int kl = af_klen(p, b);
  const bool want_dk = dkey != NULL, want_dv = dv != NULL;
  const E *q = (const E *)p.q, *k = (const E *)p.k, *v = (const E *)p.v;
  frag_c ak[NFW], av[NFW];
#pragma unroll
  for (int u = 0; u < NFW; u++) {
    wmma::fill_fragment(ak[u], 0.0f);
    wmma::fill_fragment(av[u], 0.0f);
  }
  if (j0 < kl) { /* block-uniform: keys at or past k_lens[b] get zero gradients */
    afm_stage<E, DK, LD>(ks, k, AFM_T, b, Tk, kl, p.ldkv, col, j0);
    if (want_dk) afm_stage<E, DK, LD>(vs, v, AFM_T, b, Tk, kl, p.ldkv, col, j0);
    /* causal: query i sees key j only for j <= i, so tiles before j0 see none of these keys */
    for (int i0 = p.causal ? j0 : 0; i0 < Tq; i0 += AFM_T) {
      __syncthreads(); /* the previous tile's readers are done */
      afm_stage<E, DK, LD>(qs, q, AFM_T, b, Tq, Tq, p.ldq, col, i0);
      afm_stage<E, DK, LD>(dos, dout, AFM_T, b, Tq, Tq, C, col, i0);
      afm_stage_rows(lse_s, d_s, lse, want_dk ? drow : NULL, bh, i0, Tq);
      __syncthreads();
      afm_pairs<E, DK, LD>(p, bh, i0, j0, kl, qs, dos, ks, vs, lse_s, d_s, ss, das, as, dss,
                           want_dv, want_dk);
#pragma unroll
      for (int u = 0; u < NFW; u++) {
        const int f = warp + NW * u;
        if (f >= NF) continue; /* warp-uniform */
        frag_a<E, wmma::col_major> fa; /* A^T, dS^T: the (query, key) tiles read transposed */
        frag_b<E, wmma::row_major> fb;
        if (want_dv) {
          wmma::load_matrix_sync(fa, as, AFM_PA);
          wmma::load_matrix_sync(fb, dos + f * 16, LD);
          wmma::mma_sync(av[u], fa, fb, av[u]);
        }
        if (want_dk) {
          wmma::load_matrix_sync(fa, dss, AFM_PA);
          wmma::load_matrix_sync(fb, qs + f * 16, LD);
          wmma::mma_sync(ak[u], fa, fb, ak[u]);
        }
      }
    }
  }
  if (want_dv) afm_write<E, DK, NFW>(dv, av, os, false, p.scale, b, Tk, p.ldkv, col, j0);
  if (want_dk) afm_write<E, DK, NFW>(dkey, ak, os, true, p.scale, b, Tk, p.ldkv, col, j0);
}

template <typename E, int DK>
static __global__ void __launch_bounds__(AFM_THREADS)
    afm_bwd_q(E *dq, const float *lse, const float *drow, const E *dout, af_params p) {
  constexpr int LD = DK + 8, NF = DK / 16, NW = AFM_THREADS / 32, NFW = (NF + NW - 1) / NW;
  __shared__ __align__(32) E qs[AFM_T * LD];
  __shared__ __align__(32) E dos[AFM_T * LD];
  __shared__ __align__(32) E ks[AFM_T * LD];
  __shared__ __align__(32) E vs[AFM_T * LD];
  __shared__ __align__(32) float ss[AFM_T * AFM_PS];
  __shared__ __align__(32) float das[AFM_T * AFM_PS];
  __shared__ __align__(32) E dss[AFM_T * AFM_PA];
  __shared__ __align__(32) float os[AFM_T * (DK + 4)];
  __shared__ float lse_s[AFM_T], d_s[AFM_T];
  const int Tq = p.Tq, Tk = p.Tk, C = p.H * DK;
  const int nqt = (Tq + AFM_T - 1) / AFM_T;
  const int bh = (int)(blockIdx.x / (unsigned)nqt);
  const int i0 = (int)(blockIdx.x % (unsigned)nqt) * AFM_T;
  const int b = bh / p.H, col = (bh % p.H) * DK, warp = threadIdx.x >> 5;
  const int kl = af_klen(p, b);
  const int i_last = (i0 + AFM_T < Tq ? i0 + AFM_T : Tq) - 1;
  const int blim = p.causal && i_last + 1 < kl ? i_last + 1 : kl;
  const E *q = (const E *)p.q, *k = (const E *)p.k, *v = (const E *)p.v;
  afm_stage<E, DK, LD>(qs, q, AFM_T, b, Tq, Tq, p.ldq, col, i0);
  afm_stage<E, DK, LD>(dos, dout, AFM_T, b, Tq, Tq, C, col, i0);
  afm_stage_rows(lse_s, d_s, lse, drow, bh, i0, Tq);
  frag_c acc[NFW];
#pragma unroll
  for (int u = 0; u < NFW; u++) wmma::fill_fragment(acc[u], 0.0f);
  for (int j0 = 0; j0 < blim; j0 += AFM_T) {
    __syncthreads(); /* the previous tile's readers are done (first: the rows are staged) */
    afm_stage<E, DK, LD>(ks, k, AFM_T, b, Tk, kl, p.ldkv, col, j0);
    afm_stage<E, DK, LD>(vs, v, AFM_T, b, Tk, kl, p.ldkv, col, j0);
    __syncthreads();
    afm_pairs<E, DK, LD>(p, bh, i0, j0, kl, qs, dos, ks, vs, lse_s, d_s, ss, das, NULL, dss,
                         false, true);
#pragma unroll
    for (int u = 0; u < NFW; u++) {
      const int f = warp + NW * u;
      if (f >= NF) continue; /* warp-uniform */
      frag_a<E, wmma::row_major> fa;
      frag_b<E, wmma::row_major> fb;
      wmma::load_matrix_sync(fa, dss, AFM_PA);
      wmma::load_matrix_sync(fb, ks + f * 16, LD);
      wmma::mma_sync(acc[u], fa, fb, acc[u]);
    }
  }
  afm_write<E, DK, NFW>(dq, acc, os, true, p.scale, b, Tq, p.ldq, col, i0);
}

/* Every instantiation the launchers below use (test/test_cuda_preload.c reads these). */
NMT_CUDA_PRELOAD(afm_fwd<__half, 32>);
NMT_CUDA_PRELOAD(afm_fwd<__half, 64>);
NMT_CUDA_PRELOAD(afm_fwd<__half, 128>);
NMT_CUDA_PRELOAD(afm_bwd_kv<__half, 32>);
NMT_CUDA_PRELOAD(afm_bwd_kv<__half, 64>);
NMT_CUDA_PRELOAD(afm_bwd_kv<__half, 128>);
NMT_CUDA_PRELOAD(afm_bwd_q<__half, 32>);
NMT_CUDA_PRELOAD(afm_bwd_q<__half, 64>);
NMT_CUDA_PRELOAD(afm_bwd_q<__half, 128>);
NMT_CUDA_PRELOAD(afm_fwd<__nv_bfloat16, 32>);
NMT_CUDA_PRELOAD(afm_fwd<__nv_bfloat16, 64>);
NMT_CUDA_PRELOAD(afm_fwd<__nv_bfloat16, 128>);
NMT_CUDA_PRELOAD(afm_bwd_kv<__nv_bfloat16, 32>);
NMT_CUDA_PRELOAD(afm_bwd_kv<__nv_bfloat16, 64>);
NMT_CUDA_PRELOAD(afm_bwd_kv<__nv_bfloat16, 128>);
NMT_CUDA_PRELOAD(afm_bwd_q<__nv_bfloat16, 32>);
NMT_CUDA_PRELOAD(afm_bwd_q<__nv_bfloat16, 64>);
NMT_CUDA_PRELOAD(afm_bwd_q<__nv_bfloat16, 128>);

/* ---- launchers ---- */

int nmt__cuda_attention_fused_mma_serves(const nmt_cuda_ctx *c, const nmt_attn_args *a) {
  if (a->half != 1 || c->attn_fused_simt || a->Tk > AFM_TK_MAX) return 0;
  const long long BH = (long long)a->B * a->H;
  return BH * ((a->Tq + AFM_T - 1) / AFM_T) <= INT_MAX &&
         BH * ((a->Tk + AFM_T - 1) / AFM_T) <= INT_MAX;
}


/* Resources: 128 threads, static shared memory only (<= 37.5 KB: no opt-in), grid x of
 * B*H*ceil(Tq/16) blocks (serves() keeps it <= INT_MAX). */
template <typename E, int DK>
static nmt_status afm_fwd_launch(nmt_cuda_ctx *c, void *out, float *lse, const af_params &p,
                                 int BH) {
  const unsigned blocks = (unsigned)BH * (unsigned)((p.Tq + AFM_T - 1) / AFM_T);
  afm_fwd<E, DK><<<blocks, AFM_THREADS, 0, nmt__cuda_stream(c)>>>((E *)out, lse, p);
  NMT_CUDA_LAUNCH_CHECK("afm_fwd");
  return NMT_OK;
}

/* Resources: 128 threads each, static shared memory (<= 29.4 KB), grids x: B*H*Tq/4 rows of
 * the D kernel, B*H*ceil(Tk/16) afm_bwd_kv, B*H*ceil(Tq/16) afm_bwd_q. */
template <typename E, int DK>
static nmt_status afm_bwd_launch(nmt_cuda_ctx *c, void *dq, void *dkey, void *dv, float *drow,
                                 const void *dout, const void *out, const float *lse,
                                 const af_params &p, int BH) {
  cudaStream_t s = nmt__cuda_stream(c);
  if (dq || dkey) {
    NMT_TRY(nmt__cuda_attention_fused_drow(c, drow, dout, out, 1, p, BH, DK));
  }
  if (dkey || dv) {
    const unsigned blocks = (unsigned)BH * (unsigned)((p.Tk + AFM_T - 1) / AFM_T);
    afm_bwd_kv<E, DK><<<blocks, AFM_THREADS, 0, s>>>((E *)dkey, (E *)dv, lse, drow,
                                                     (const E *)dout, p);
    NMT_CUDA_LAUNCH_CHECK("afm_bwd_kv");
  }
  if (dq) {
    const unsigned blocks = (unsigned)BH * (unsigned)((p.Tq + AFM_T - 1) / AFM_T);
    afm_bwd_q<E, DK><<<blocks, AFM_THREADS, 0, s>>>((E *)dq, lse, drow, (const E *)dout, p);
    NMT_CUDA_LAUNCH_CHECK("afm_bwd_q");
  }
  return NMT_OK;
}

template <typename E>
static nmt_status afm_fwd_dk(nmt_cuda_ctx *c, void *out, float *lse, const af_params &p,
                             int BH, int dk) {
  if (dk == 32) return afm_fwd_launch<E, 32>(c, out, lse, p, BH);
  if (dk == 64) return afm_fwd_launch<E, 64>(c, out, lse, p, BH);
  return afm_fwd_launch<E, 128>(c, out, lse, p, BH);
}

template <typename E>
static nmt_status afm_bwd_dk(nmt_cuda_ctx *c, void *dq, void *dkey, void *dv, float *drow,
                             const void *dout, const void *out, const float *lse,
                             const af_params &p, int BH, int dk) {
  if (dk == 32) return afm_bwd_launch<E, 32>(c, dq, dkey, dv, drow, dout, out, lse, p, BH);
  if (dk == 64) return afm_bwd_launch<E, 64>(c, dq, dkey, dv, drow, dout, out, lse, p, BH);
  return afm_bwd_launch<E, 128>(c, dq, dkey, dv, drow, dout, out, lse, p, BH);
}

nmt_status nmt__cuda_attention_fused_mma_fwd(nmt_cuda_ctx *c, void *out, float *lse,
                                             const nmt_attn_args *a) {
  const af_params p = af_params_of(c, a);
  const int BH = a->B * a->H;
  if (nmt__cuda_half_bf16(c)) return afm_fwd_dk<__nv_bfloat16>(c, out, lse, p, BH, a->dk);
  return afm_fwd_dk<__half>(c, out, lse, p, BH, a->dk);
}

nmt_status nmt__cuda_attention_fused_mma_bwd(nmt_cuda_ctx *c, void *dq, void *dkey, void *dv,
                                             float *drow, const void *dout, const void *out,
                                             const float *lse, const nmt_attn_args *a) {
  const af_params p = af_params_of(c, a);
  const int BH = a->B * a->H;
  if (nmt__cuda_half_bf16(c))
    return afm_bwd_dk<__nv_bfloat16>(c, dq, dkey, dv, drow, dout, out, lse, p, BH, a->dk);
  return afm_bwd_dk<__half>(c, dq, dkey, dv, drow, dout, out, lse, p, BH, a->dk);
}
