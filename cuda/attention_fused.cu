/* cuda/attention_fused.cu — fused multi-head attention (issue 35): the forward keeps each query
 * row's log-sum-exp instead of the (B,H,Tq,Tk) probabilities, the backward recomputes them
 * (FlashAttention-2, Dao 2023, Algorithms 1 and 2, with the softmax exact in separate passes
 * instead of online rescaling). The contract, with its rounding sites, is nmt/attention.h;
 * src/ref/attention_fused.c is the CPU reference and cuda/attention.cu the unfused authority.
 *
 * Design (SIMT: CUDA cores, fp32 math; every kernel 128 threads = 4 warps, __launch_bounds__).
 * Tiles: key tiles of KT = 32 keys, query tiles of QT = 32 / 16 / 8 queries for dk = 32 / 64 /
 * 128 (af_qt), so that every kernel's shared memory is static and at most ~42 KB on every
 * architecture (no opt-in above 48 KB, no cudaFuncSetAttribute). Inputs are widened to fp32 as
 * they are staged (exact for half). Score rows in shared memory are padded to dk + 1 floats so
 * that lane-per-key dot products hit 32 different banks.
 *   The pair mapping (every kernel): thread (warp w, lane) computes the pairs (query qq = w + 4r,
 *   key jj = lane), r < QT/4: a warp shares its query rows (q broadcast from shared memory),
 *   its lanes are the tile's keys, so a row's max and sum are warp shuffles (fixed xor tree).
 *   The element mapping: element el = tid + 128u of a (rows, dk) output tile is (el / dk,
 *   el % dk); a warp shares one row (dk >= 32), its lanes are consecutive columns.
 * af_fwd, one block per (b, h, query tile), grid x = B*H*ceil(Tq/QT): q of the tile staged once;
 *   sweep 1 over the visible key tiles: m = max_j s_j; sweep 2: l = sum_j expf(s_j - m),
 *   lse = m + logf(l) saved; sweep 3: P_j = expf(s_j - lse), dropout (nmt__keep: the unfused
 *   op's Philox mask, bitwise), A_j = round(a_j) into shared memory, then O += A V by element
 *   (each output element one thread's fp32 sum in key order); out = round(O) written. The
 *   scores are recomputed in each sweep (3 x the QK^T work) rather than rescaled online: m is
 *   exact, l is the contract's sum. With one key tile (Tk <= 32) K and V are staged once.
 * Backward, deterministic (no float atomics: each gradient element has one owning thread):
 *   af_drow: D = sum_d dout^ out^ per (b,h,i), one warp per row, into drow.
 *   af_bwd_kv, one block per (b, h, key tile): K, V of the tile staged; for each query tile
 *     (causal: from the first that sees the tile) q, dout, lse, D staged, the tile's pairs
 *     recompute s, P, a, A, dA, dP, dS = round(P (dP - D)) into shared memory; then each thread
 *     adds its dV (A dout) and dK (dS q) elements over the tile's queries in index order.
 *   af_bwd_q, one block per (b, h, query tile): q, dout staged; for each visible key tile the
 *     pairs recompute dS, then each thread adds its dQ (dS K) elements in key order.
 *   Outputs: half = 0 (E = float) +=, half = 1 (E = __half / __nv_bfloat16) written round(),
 *   over the rows and head columns only; scale applied once after the sum, as the contract.
 * Shared memory (static; ptxas -v, sm_86): fwd 38.0 / 22.7 / 16.5 KB, bwd_kv 43.3 / 29.1 /
 *   25.1 KB, bwd_q 42.3 / 27.0 / 21.0 KB for dk = 128 / 64 / 32; registers 102-214 per thread,
 *   no spills (bwd_kv at dk = 128 holds 2 x 32 accumulators). Grids: x only (at most INT_MAX
 *   blocks; the launcher refuses more).
 * The device error word (NMT_CUDA_ERR_ATT_KLEN) reports k_lens[b] outside [1, Tk], which is
 *   clamped so the kernels stay in bounds (as cuda/attention.cu); k_lens is never read on the
 *   host. No allocation, no host synchronisation, no scratch: the current stream only.
 *
 * The tensor-core variant for half = 1 (WMMA m16n16k16) is cuda/attention_fused_mma.cu, chosen
 * by the entries below (nmt__cuda_attention_fused_mma_serves; NMT_ATTENTION_FUSED_IMPL).
 * TODO (speed, after a GPU run shows this SIMT version correct): sweeps 1-2 merged by keeping
 * each row's scores in registers when Tk <= 32 x (registers per lane); K/V staged in the half
 * type to halve shared memory.
 *
 * Predicted speed (bf16 storage, d_model 512, 8 heads of 64; per (b, h) block of T x T, per
 * call fwd+bwd; bytes of global memory and FLOPs, L2 reuse ignored):
 *   unfused (cuda/attention.cu): packs of q, k, v (read 2 B, write 4 B per element, x3 T dk),
 *   fwd: scores written by the QK^T GEMM (4 T^2 B), softmax reads and writes them (8 T^2) and
 *   writes the dropped copy (4 T^2), PV reads them (4 T^2), O written and unpacked (4 + 4 + 2 B
 *   per T dk); bwd: dout/v/k/q packed again, dropped weights regenerated (8 T^2), dA written
 *   (4 T^2), softmax bwd reads P, dP and writes dS (12 T^2), dQ, dK GEMMs read dS (8 T^2), three
 *   gradient unpacks. About 52 T^2 + 60 T dk bytes and 10 launches + GEMM launches per block
 *   set; FLOPs 4 T^2 dk fwd + 8 T^2 dk bwd in fp32 GEMMs.
 *   fused: fwd reads q, k, v once (6 T dk B; K/V per query tile from L2) and writes O (2 T dk)
 *   and lse (4 T); bwd reads q, k, v, dout, out, lse, D and writes dq, dk, dv: ~22 T dk + 12 T
 *   bytes; FLOPs 8 T^2 dk fwd (three score sweeps + AV) and 12 T^2 dk bwd (scores and dA twice).
 *   T = 40, dk = 64: unfused ~83 KB + 154 KB per block set vs fused ~56 KB: the unfused path is
 *   bound by its ~20 launches and packs (small GEMMs at 40 x 40 x 64 run far under peak); expect
 *   the fused pair 2-4x faster end to end. T = 256: unfused ~3.4 MB + 1 MB vs fused ~0.4 MB,
 *   but 20 T^2 dk = 84 MFLOP per block on CUDA cores against the unfused 50 MFLOP in cuBLAS
 *   SIMT GEMMs: expect parity to 2x for this SIMT version, the tensor-core variant above to
 *   win clearly. bench/attention_fused.c measures both (tools/gpu-check.sh first). */
#include <climits>
#include <type_traits>

#include "attention_fused_common.cuh"
#include "attention_fused_mma.cuh"
#include "common.cuh"
#include "half.cuh"
#include "half_scratch.cuh"
#include "nmt/attention.h"

enum { AF_THREADS = 128, AF_KT = 32 };

/* Queries per tile for head dimension DK (a multiple of 4: each warp takes every 4th row). */
__host__ __device__ constexpr int af_qt(int dk) { return dk == 128 ? 8 : dk == 64 ? 16 : 32; }


/* E = float (half = 0) or the context's half type (half = 1). */
template <typename E>
__device__ __forceinline__ float ld_e(const E *p) {
  if constexpr (std::is_same_v<E, float>) return *p;
  else return nmt__half_to_float(*p);
}

/* round(): the half rounding for a half E, the identity for float. */
template <typename E>
__device__ __forceinline__ float rnd_e(float x) {
  if constexpr (std::is_same_v<E, float>) return x;
  else return nmt__half_to_float(nmt__float_to_half<E>(x));
}

/* A forward output: written (rounded for a half E). */
template <typename E>
__device__ __forceinline__ void st_e(E *p, float x) {
  if constexpr (std::is_same_v<E, float>) *p = x;
  else *p = nmt__float_to_half<E>(x);
}

/* A gradient output: fp32 accumulates (one rounding of the add), half writes round(x). */
template <typename E>
__device__ __forceinline__ void grad_e(E *p, float x) {
  if constexpr (std::is_same_v<E, float>) *p = __fadd_rn(*p, x);
  else *p = nmt__float_to_half<E>(x);
}


/* dst rows r < R (stride DS floats) <- the head columns [col0, col0 + DK) of source rows
 * b*T + t0 + r (stride ld), widened; zeros for rows t0 + r >= T. Block-wide. */
template <typename E, int DK, int DS, int R>
__device__ __forceinline__ void stage(float *dst, const E *src, int b, int T, int ld, int col0,
                                      int t0) {
  for (int e = threadIdx.x; e < R * DK; e += AF_THREADS) {
    const int r = e / DK, d = e % DK, t = t0 + r;
    dst[r * DS + d] = t < T ? ld_e(src + ((size_t)b * T + t) * (size_t)ld + col0 + d) : 0.0f;
  }
}

template <int DK>
__device__ __forceinline__ float dot(const float *a, const float *b) {
  float s = 0.0f;
#pragma unroll 16
  for (int d = 0; d < DK; d++) s += a[d] * b[d];
  return s;
}


template <typename E, int DK>
static __global__ void __launch_bounds__(AF_THREADS)
    af_fwd(E *out, float *lse, af_params p) {
  constexpr int QT = af_qt(DK), KT = AF_KT, KS = DK + 1, NR = QT / 4;
  constexpr int NO = QT * DK / AF_THREADS;
  __shared__ float qs[QT * DK];
  __shared__ float ks[KT * KS];
  __shared__ float vs[KT * DK];
  __shared__ float as[QT * KT];
  const int Tq = p.Tq, Tk = p.Tk;
  const int nqt = (Tq + QT - 1) / QT;
  const int bh = (int)(blockIdx.x / (unsigned)nqt), i0 = (int)(blockIdx.x % (unsigned)nqt) * QT;
  const int b = bh / p.H, col = (bh % p.H) * DK;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kl = af_klen(p, b);
  const int i_last = (i0 + QT < Tq ? i0 + QT : Tq) - 1;
  const int blim = p.causal && i_last + 1 < kl ? i_last + 1 : kl; /* keys any row here sees */
  const int ntiles = (blim + KT - 1) / KT;
  const E *q = (const E *)p.q, *k = (const E *)p.k, *v = (const E *)p.v;
  stage<E, DK, DK, QT>(qs, q, b, Tq, p.ldq, col, i0);
  const bool one = ntiles == 1;
  if (one) {
    stage<E, DK, KS, KT>(ks, k, b, Tk, p.ldkv, col, 0);
    stage<E, DK, DK, KT>(vs, v, b, Tk, p.ldkv, col, 0);
  }
  __syncthreads();
  float m[NR], l[NR];
  int lim[NR];
#pragma unroll
  for (int r = 0; r < NR; r++) {
    lim[r] = af_lim(p, i0 + warp + 4 * r, Tq, kl);
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  /* Sweep 1: the row max. */
  for (int t = 0; t < ntiles; t++) {
    const int j0 = t * KT, j = j0 + lane;
    if (!one) {
      __syncthreads();
      stage<E, DK, KS, KT>(ks, k, b, Tk, p.ldkv, col, j0);
      __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < NR; r++)
      if (j < lim[r])
        m[r] = fmaxf(m[r], __fmul_rn(p.scale, dot<DK>(qs + (warp + 4 * r) * DK, ks + lane * KS)));
  }
#pragma unroll
  for (int r = 0; r < NR; r++) m[r] = warp_allmax(m[r]);
  /* Sweep 2: the row sum and the log-sum-exp. */
  for (int t = 0; t < ntiles; t++) {
    const int j0 = t * KT, j = j0 + lane;
    if (!one) {
      __syncthreads();
      stage<E, DK, KS, KT>(ks, k, b, Tk, p.ldkv, col, j0);
      __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < NR; r++)
      if (j < lim[r])
        l[r] += expf(__fmul_rn(p.scale, dot<DK>(qs + (warp + 4 * r) * DK, ks + lane * KS)) - m[r]);
  }
  float ls[NR];
#pragma unroll
  for (int r = 0; r < NR; r++) {
    ls[r] = m[r] + logf(warp_allsum(l[r]));
    const int i = i0 + warp + 4 * r;
    if (lane == 0 && i < Tq) lse[(size_t)bh * Tq + i] = ls[r];
  }
  /* Sweep 3: A = round(dropout(P)) per tile, then O += A V by element. */
  float o[NO];
#pragma unroll
  for (int u = 0; u < NO; u++) o[u] = 0.0f;
  for (int t = 0; t < ntiles; t++) {
    const int j0 = t * KT, j = j0 + lane;
    if (!one) {
      __syncthreads();
      stage<E, DK, KS, KT>(ks, k, b, Tk, p.ldkv, col, j0);
      stage<E, DK, DK, KT>(vs, v, b, Tk, p.ldkv, col, j0);
      __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < NR; r++) {
      const int qq = warp + 4 * r;
      float a = 0.0f;
      if (j < lim[r]) {
        const float s = __fmul_rn(p.scale, dot<DK>(qs + qq * DK, ks + lane * KS));
        const float P = expf(s - ls[r]);
        const uint64_t e = ((uint64_t)bh * (uint64_t)Tq + (uint64_t)(i0 + qq)) * (uint64_t)Tk + j;
        a = rnd_e<E>(P * af_drop(p, e));
      }
      as[qq * KT + lane] = a;
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < NO; u++) {
      const int el = threadIdx.x + AF_THREADS * u, qq = el / DK, d = el % DK;
      const int lq = af_lim(p, i0 + qq, Tq, kl) - j0;
      const int nv = lq < KT ? lq : KT;
      for (int jj = 0; jj < nv; jj++) o[u] += as[qq * KT + jj] * vs[jj * DK + d];
    }
  }
  const int C = p.H * DK;
#pragma unroll
  for (int u = 0; u < NO; u++) {
    const int el = threadIdx.x + AF_THREADS * u, qq = el / DK, d = el % DK, i = i0 + qq;
    if (i < Tq) st_e(out + ((size_t)b * Tq + i) * (size_t)C + col + d, o[u]);
  }
}

/* D = sum_d dout^ out^ for each row (b, h, i): one warp per row, rows = B*H*Tq. */
template <typename E>
static __global__ void __launch_bounds__(AF_THREADS)
    af_drow(float *drow, const E *dout, const E *out, int Tq, int H, int dk, size_t rows) {
  const size_t row = (size_t)blockIdx.x * (AF_THREADS / 32) + (threadIdx.x >> 5);
  if (row >= rows) return; /* whole warps: no block-wide sync below */
  const int lane = threadIdx.x & 31;
  const size_t bh = row / (size_t)Tq, i = row % (size_t)Tq, b = bh / (size_t)H;
  const size_t base = (b * (size_t)Tq + i) * (size_t)H * dk + (bh % (size_t)H) * dk;
  float s = 0.0f;
  for (int d = lane; d < dk; d += 32) s += ld_e(dout + base + d) * ld_e(out + base + d);
  s = warp_allsum(s);
  if (lane == 0) drow[row] = s;
}

/* The pairs of one (query tile, key tile): A (as) and dS (ds, when want_ds) of pair (qq, jj)
 * recomputed, 0 for pairs not visible. qs/dos rows stride DK, ks/vs rows stride DK + 1. */
template <typename E, int DK, int QT>
__device__ __forceinline__ void af_pairs(const af_params &p, int bh, int i0, int j0, int kl,
                                         const float *qs, const float *dos, const float *ks,
                                         const float *vs, const float *lse_s, const float *d_s,
                                         float *as, float *ds, bool want_a, bool want_ds) {
  constexpr int KT = AF_KT, KS = DK + 1, NR = QT / 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, j = j0 + lane;
#pragma unroll
  for (int r = 0; r < NR; r++) {
    const int qq = warp + 4 * r;
    float a = 0.0f, dsv = 0.0f;
    if (j < af_lim(p, i0 + qq, p.Tq, kl)) {
      const float s = __fmul_rn(p.scale, dot<DK>(qs + qq * DK, ks + lane * KS));
      const float P = expf(s - lse_s[qq]);
      const uint64_t e =
          ((uint64_t)bh * (uint64_t)p.Tq + (uint64_t)(i0 + qq)) * (uint64_t)p.Tk + j;
      const float f = af_drop(p, e);
      a = rnd_e<E>(__fmul_rn(P, f));
      if (want_ds) {
        /* each product rounded as the contract's steps (no FMA across them), as the ref */
        const float dP = __fmul_rn(dot<DK>(dos + qq * DK, vs + lane * KS), f);
        dsv = rnd_e<E>(__fmul_rn(P, dP - d_s[qq]));
      }
    }
    if (want_a) as[qq * KT + lane] = a;
    if (want_ds) ds[qq * KT + lane] = dsv;
  }
}

/* lse and D of the query tile's rows (0 past Tq). */
template <int QT>
__device__ __forceinline__ void stage_rows(float *lse_s, float *d_s, const float *lse,
                                           const float *drow, int bh, int i0, int Tq) {
  for (int qq = threadIdx.x; qq < QT; qq += AF_THREADS) {
    const int i = i0 + qq;
    const size_t at = (size_t)bh * Tq + i;
    lse_s[qq] = i < Tq ? lse[at] : 0.0f;
    d_s[qq] = i < Tq && drow ? drow[at] : 0.0f;
  }
}

template <typename E, int DK>
static __global__ void __launch_bounds__(AF_THREADS)
    af_bwd_kv(E *dkey, E *dv, const float *lse, const float *drow, const E *dout, af_params p) {
  constexpr int QT = af_qt(DK), KT = AF_KT, KS = DK + 1, NE = KT * DK / AF_THREADS;
  __shared__ float ks[KT * KS];
  __shared__ float vs[KT * KS];
  __shared__ float qs[QT * DK];
  __shared__ float dos[QT * DK];
  __shared__ float as[QT * KT];
  __shared__ float ds[QT * KT];
  __shared__ float lse_s[QT], d_s[QT];
  const int Tq = p.Tq, Tk = p.Tk, C = p.H * DK;
  const int nkt = (Tk + KT - 1) / KT;
  const int bh = (int)(blockIdx.x / (unsigned)nkt), j0 = (int)(blockIdx.x % (unsigned)nkt) * KT;
  const int b = bh / p.H, col = (bh % p.H) * DK;
  const int kl = af_klen(p, b);
  const bool want_dk = dkey != NULL, want_dv = dv != NULL;
  const E *q = (const E *)p.q, *k = (const E *)p.k, *v = (const E *)p.v;
  float ak[NE], av[NE];
#pragma unroll
  for (int u = 0; u < NE; u++) ak[u] = av[u] = 0.0f;
  if (j0 < kl) { /* block-uniform: keys at or past k_lens[b] get zero gradients */
    stage<E, DK, KS, KT>(ks, k, b, Tk, p.ldkv, col, j0);
    if (want_dk) stage<E, DK, KS, KT>(vs, v, b, Tk, p.ldkv, col, j0);
    for (int i0 = p.causal ? j0 / QT * QT : 0; i0 < Tq; i0 += QT) {
      __syncthreads(); /* the previous tile's readers are done */
      stage<E, DK, DK, QT>(qs, q, b, Tq, p.ldq, col, i0);
      stage<E, DK, DK, QT>(dos, dout, b, Tq, C, col, i0);
      stage_rows<QT>(lse_s, d_s, lse, want_dk ? drow : NULL, bh, i0, Tq);
      __syncthreads();
      af_pairs<E, DK, QT>(p, bh, i0, j0, kl, qs, dos, ks, vs, lse_s, d_s, as, ds, want_dv,
                          want_dk);
      __syncthreads();
#pragma unroll
      for (int u = 0; u < NE; u++) {
        const int el = threadIdx.x + AF_THREADS * u, jj = el / DK, d = el % DK, j = j0 + jj;
        if (j >= kl) continue; /* warp-uniform: a warp shares jj */
        const int q0 = p.causal && j - i0 > 0 ? j - i0 : 0;
        const int qe = Tq - i0 < QT ? Tq - i0 : QT;
        for (int qq = q0; qq < qe; qq++) {
          if (want_dv) av[u] += as[qq * KT + jj] * dos[qq * DK + d];
          if (want_dk) ak[u] += ds[qq * KT + jj] * qs[qq * DK + d];
        }
      }
    }
  }
#pragma unroll
  for (int u = 0; u < NE; u++) {
    const int el = threadIdx.x + AF_THREADS * u, jj = el / DK, d = el % DK, j = j0 + jj;
    if (j >= Tk) continue;
    const size_t at = ((size_t)b * Tk + j) * (size_t)p.ldkv + col + d;
    if (want_dv) grad_e(dv + at, av[u]);
    if (want_dk) grad_e(dkey + at, __fmul_rn(p.scale, ak[u]));
  }
}

template <typename E, int DK>
static __global__ void __launch_bounds__(AF_THREADS)
    af_bwd_q(E *dq, const float *lse, const float *drow, const E *dout, af_params p) {
  constexpr int QT = af_qt(DK), KT = AF_KT, KS = DK + 1, NO = QT * DK / AF_THREADS;
  __shared__ float qs[QT * DK];
  __shared__ float dos[QT * DK];
  __shared__ float ks[KT * KS];
  __shared__ float vs[KT * KS];
  __shared__ float ds[QT * KT];
  __shared__ float lse_s[QT], d_s[QT];
  const int Tq = p.Tq, Tk = p.Tk, C = p.H * DK;
  const int nqt = (Tq + QT - 1) / QT;
  const int bh = (int)(blockIdx.x / (unsigned)nqt), i0 = (int)(blockIdx.x % (unsigned)nqt) * QT;
  const int b = bh / p.H, col = (bh % p.H) * DK;
  const int kl = af_klen(p, b);
  const int i_last = (i0 + QT < Tq ? i0 + QT : Tq) - 1;
  const int blim = p.causal && i_last + 1 < kl ? i_last + 1 : kl;
  const E *q = (const E *)p.q, *k = (const E *)p.k, *v = (const E *)p.v;
  stage<E, DK, DK, QT>(qs, q, b, Tq, p.ldq, col, i0);
  stage<E, DK, DK, QT>(dos, dout, b, Tq, C, col, i0);
  stage_rows<QT>(lse_s, d_s, lse, drow, bh, i0, Tq);
  float acc[NO];
#pragma unroll
  for (int u = 0; u < NO; u++) acc[u] = 0.0f;
  for (int j0 = 0; j0 < blim; j0 += KT) {
    __syncthreads(); /* the previous tile's readers are done (first: the rows are staged) */
    stage<E, DK, KS, KT>(ks, k, b, Tk, p.ldkv, col, j0);
    stage<E, DK, KS, KT>(vs, v, b, Tk, p.ldkv, col, j0);
    __syncthreads();
    af_pairs<E, DK, QT>(p, bh, i0, j0, kl, qs, dos, ks, vs, lse_s, d_s, NULL, ds, false, true);
    __syncthreads();
#pragma unroll
    for (int u = 0; u < NO; u++) {
      const int el = threadIdx.x + AF_THREADS * u, qq = el / DK, d = el % DK;
      const int lq = af_lim(p, i0 + qq, Tq, kl) - j0;
      const int nv = lq < KT ? lq : KT;
      for (int jj = 0; jj < nv; jj++) acc[u] += ds[qq * KT + jj] * ks[jj * KS + d];
    }
  }
#pragma unroll
  for (int u = 0; u < NO; u++) {
    const int el = threadIdx.x + AF_THREADS * u, qq = el / DK, d = el % DK, i = i0 + qq;
    if (i < Tq) grad_e(dq + ((size_t)b * Tq + i) * (size_t)p.ldq + col + d,
                       __fmul_rn(p.scale, acc[u]));
  }
}

/* Every instantiation the launchers below use (test/test_cuda_preload.c reads these). */
NMT_CUDA_PRELOAD(af_fwd<float, 32>);
NMT_CUDA_PRELOAD(af_fwd<float, 64>);
NMT_CUDA_PRELOAD(af_fwd<float, 128>);
NMT_CUDA_PRELOAD(af_bwd_kv<float, 32>);
NMT_CUDA_PRELOAD(af_bwd_kv<float, 64>);
NMT_CUDA_PRELOAD(af_bwd_kv<float, 128>);
NMT_CUDA_PRELOAD(af_bwd_q<float, 32>);
NMT_CUDA_PRELOAD(af_bwd_q<float, 64>);
NMT_CUDA_PRELOAD(af_bwd_q<float, 128>);
NMT_CUDA_PRELOAD(af_drow<float>);
NMT_CUDA_PRELOAD(af_fwd<__half, 32>);
NMT_CUDA_PRELOAD(af_fwd<__half, 64>);
NMT_CUDA_PRELOAD(af_fwd<__half, 128>);
NMT_CUDA_PRELOAD(af_bwd_kv<__half, 32>);
NMT_CUDA_PRELOAD(af_bwd_kv<__half, 64>);
NMT_CUDA_PRELOAD(af_bwd_kv<__half, 128>);
NMT_CUDA_PRELOAD(af_bwd_q<__half, 32>);
NMT_CUDA_PRELOAD(af_bwd_q<__half, 64>);
NMT_CUDA_PRELOAD(af_bwd_q<__half, 128>);
NMT_CUDA_PRELOAD(af_drow<__half>);
NMT_CUDA_PRELOAD(af_fwd<__nv_bfloat16, 32>);
NMT_CUDA_PRELOAD(af_fwd<__nv_bfloat16, 64>);
NMT_CUDA_PRELOAD(af_fwd<__nv_bfloat16, 128>);
NMT_CUDA_PRELOAD(af_bwd_kv<__nv_bfloat16, 32>);
NMT_CUDA_PRELOAD(af_bwd_kv<__nv_bfloat16, 64>);
NMT_CUDA_PRELOAD(af_bwd_kv<__nv_bfloat16, 128>);
NMT_CUDA_PRELOAD(af_bwd_q<__nv_bfloat16, 32>);
NMT_CUDA_PRELOAD(af_bwd_q<__nv_bfloat16, 64>);
NMT_CUDA_PRELOAD(af_bwd_q<__nv_bfloat16, 128>);
NMT_CUDA_PRELOAD(af_drow<__nv_bfloat16>);

/* ---- launchers ---- */

/* The checks both ops share: shapes (NMT_ERR_INTERNAL), head dimension (NMT_ERR_USAGE), the
 * half mode, and the grids (x only, at most INT_MAX blocks). */
static nmt_status af_check(const nmt_cuda_ctx *c, const char *op, const nmt_attn_args *a) {
  if (!a)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: no arguments", op);
  if (a->B < 0 || a->Tq < 0 || a->Tk < 1 || a->H < 1 || a->dk < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: bad shape B=%d Tq=%d Tk=%d H=%d dk=%d", op,
                      a->B, a->Tq, a->Tk, a->H, a->dk);
  if ((long long)a->H * a->dk > a->ldq || (long long)a->H * a->dk > a->ldkv)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: ldq=%d / ldkv=%d smaller than H*dk=%lld", op,
                      a->ldq, a->ldkv, (long long)a->H * a->dk);
  if (!(a->p_drop >= 0.0f && a->p_drop < 1.0f))
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: dropout probability %g outside [0, 1)", op,
                      (double)a->p_drop);
  if (a->half != 0 && a->half != 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: half = %d (0 or 1)", op, a->half);
  if (!nmt_attn_supported_dk(a->dk))
    return nmt_errorf(NMT_ERR_USAGE,
                      "cuda %s: head dimension %d: the fused kernels serve 32, 64 and 128 "
                      "(kernels.attention = unfused serves any)",
                      op, a->dk);
  if (a->half) NMT_TRY(nmt__cuda_half_op_check(c, op));
  const long long BH = (long long)a->B * a->H, qt = af_qt(a->dk);
  if (BH * ((a->Tq + qt - 1) / qt) > INT_MAX || BH * ((a->Tk + AF_KT - 1) / AF_KT) > INT_MAX ||
      BH * a->Tq > INT_MAX)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: B*H=%lld with Tq=%d Tk=%d exceeds one grid",
                      op, BH, a->Tq, a->Tk);
  if (a->B > 0 && a->Tq > 0 && (!a->q || !a->k || !a->v || !a->k_lens))
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: NULL q, k, v or k_lens", op);
  return NMT_OK;
}


template <typename E>
static nmt_status af_drow_launch(nmt_cuda_ctx *c, float *drow, const void *dout, const void *out,
                                 const af_params &p, int BH, int dk) {
  const size_t rows = (size_t)BH * p.Tq;
  af_drow<E><<<(unsigned)((rows + 3) / 4), AF_THREADS, 0, nmt__cuda_stream(c)>>>(
      drow, (const E *)dout, (const E *)out, p.Tq, p.H, dk, rows);
  NMT_CUDA_LAUNCH_CHECK("af_drow");
  return NMT_OK;
}

nmt_status nmt__cuda_attention_fused_drow(nmt_cuda_ctx *c, float *drow, const void *dout,
                                          const void *out, int half, const af_params &p, int BH,
                                          int dk) {
  if (!half) return af_drow_launch<float>(c, drow, dout, out, p, BH, dk);
  if (nmt__cuda_half_bf16(c)) return af_drow_launch<__nv_bfloat16>(c, drow, dout, out, p, BH, dk);
  return af_drow_launch<__half>(c, drow, dout, out, p, BH, dk);
}

/* Resources: 128 threads, static shared memory only (the header's table, <= 42 KB), grid x. */
template <typename E, int DK>
static nmt_status af_fwd_launch(nmt_cuda_ctx *c, void *out, float *lse, const af_params &p,
                                int BH) {
  const unsigned blocks = (unsigned)BH * (unsigned)((p.Tq + af_qt(DK) - 1) / af_qt(DK));
  af_fwd<E, DK><<<blocks, AF_THREADS, 0, nmt__cuda_stream(c)>>>((E *)out, lse, p);
  NMT_CUDA_LAUNCH_CHECK("af_fwd");
  return NMT_OK;
}

template <typename E, int DK>
static nmt_status af_bwd_launch(nmt_cuda_ctx *c, void *dq, void *dkey, void *dv, float *drow,
                                const void *dout, const void *out, const float *lse,
                                const af_params &p, int BH) {
  cudaStream_t s = nmt__cuda_stream(c);
  if (dq || dkey) {
    NMT_TRY(nmt__cuda_attention_fused_drow(c, drow, dout, out, !std::is_same_v<E, float>, p,
                                           BH, DK));
  }
  if (dkey || dv) {
    const unsigned blocks = (unsigned)BH * (unsigned)((p.Tk + AF_KT - 1) / AF_KT);
    af_bwd_kv<E, DK><<<blocks, AF_THREADS, 0, s>>>((E *)dkey, (E *)dv, lse, drow,
                                                   (const E *)dout, p);
    NMT_CUDA_LAUNCH_CHECK("af_bwd_kv");
  }
  if (dq) {
    const unsigned blocks = (unsigned)BH * (unsigned)((p.Tq + af_qt(DK) - 1) / af_qt(DK));
    af_bwd_q<E, DK><<<blocks, AF_THREADS, 0, s>>>((E *)dq, lse, drow, (const E *)dout, p);
    NMT_CUDA_LAUNCH_CHECK("af_bwd_q");
  }
  return NMT_OK;
}

template <typename E>
static nmt_status af_fwd_dk(nmt_cuda_ctx *c, void *out, float *lse, const af_params &p, int BH,
                            int dk) {
  if (dk == 32) return af_fwd_launch<E, 32>(c, out, lse, p, BH);
  if (dk == 64) return af_fwd_launch<E, 64>(c, out, lse, p, BH);
  return af_fwd_launch<E, 128>(c, out, lse, p, BH);
}

template <typename E>
static nmt_status af_bwd_dk(nmt_cuda_ctx *c, void *dq, void *dkey, void *dv, float *drow,
                            const void *dout, const void *out, const float *lse,
                            const af_params &p, int BH, int dk) {
  if (dk == 32) return af_bwd_launch<E, 32>(c, dq, dkey, dv, drow, dout, out, lse, p, BH);
  if (dk == 64) return af_bwd_launch<E, 64>(c, dq, dkey, dv, drow, dout, out, lse, p, BH);
  return af_bwd_launch<E, 128>(c, dq, dkey, dv, drow, dout, out, lse, p, BH);
}

// out: (B*Tq, H*dk) written; lse: (B,H,Tq) fp32; q, k, v: rows of ldq / ldkv (nmt/attention.h)
nmt_status nmt_cuda_attention_fused_fwd(void *ctx, void *out, float *lse, const nmt_attn_args *a) {
  NMT_TRY(nmt__cuda_enter(ctx, "attention_fused_fwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(af_check(c, "attention_fused_fwd", a));
  if (a->B == 0 || a->Tq == 0) return NMT_OK;
  if (!out || !lse)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda attention_fused_fwd: NULL out or lse");
  if (nmt__cuda_attention_fused_mma_serves(c, a))
    return nmt__cuda_attention_fused_mma_fwd(c, out, lse, a); /* WMMA: half = 1, Tk <= 256 */
  const af_params p = af_params_of(c, a);
  const int BH = a->B * a->H;
  if (!a->half) return af_fwd_dk<float>(c, out, lse, p, BH, a->dk);
  if (nmt__cuda_half_bf16(c)) return af_fwd_dk<__nv_bfloat16>(c, out, lse, p, BH, a->dk);
  return af_fwd_dk<__half>(c, out, lse, p, BH, a->dk);
}

// dq: rows of ldq, dkey, dv: rows of ldkv (+= fp32 / written half); drow: (B,H,Tq) scratch;
// dout, out: (B*Tq, H*dk); lse: the forward's
nmt_status nmt_cuda_attention_fused_bwd(void *ctx, void *dq, void *dkey, void *dv, float *drow,
                                        const void *dout, const void *out, const float *lse,
                                        const nmt_attn_args *a) {
  NMT_TRY(nmt__cuda_enter(ctx, "attention_fused_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(af_check(c, "attention_fused_bwd", a));
  if (a->B == 0 || a->Tq == 0 || (!dq && !dkey && !dv)) return NMT_OK;
  if (!dout || !lse || ((dq || dkey) && (!out || !drow)))
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda attention_fused_bwd: NULL dout or lse, or (with dq / dkey) out or "
                      "drow");
  if (nmt__cuda_attention_fused_mma_serves(c, a))
    return nmt__cuda_attention_fused_mma_bwd(c, dq, dkey, dv, drow, dout, out, lse, a);
  const af_params p = af_params_of(c, a);
  const int BH = a->B * a->H;
  if (!a->half) return af_bwd_dk<float>(c, dq, dkey, dv, drow, dout, out, lse, p, BH, a->dk);
  if (nmt__cuda_half_bf16(c))
    return af_bwd_dk<__nv_bfloat16>(c, dq, dkey, dv, drow, dout, out, lse, p, BH, a->dk);
  return af_bwd_dk<__half>(c, dq, dkey, dv, drow, dout, out, lse, p, BH, a->dk);
}
