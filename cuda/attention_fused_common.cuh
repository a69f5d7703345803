/* cuda/attention_fused_common.cuh — what the fused attention's two implementations share
 * (cuda/attention_fused.cu: SIMT; cuda/attention_fused_mma.cu: WMMA): the kernels' scalar
 * arguments, the warp reductions, the key limits, the dropout factor, and the D = rowsum(dout *
 * out) kernel's launch (one kernel, so both give D in one order). Contract: nmt/attention.h.
 *
 * defines: af_params, af_params_of, warp_allmax, warp_allsum, af_klen, af_lim, af_drop,
 *          nmt__cuda_attention_fused_drow
 */
#ifndef NMT_CUDA_ATTENTION_FUSED_COMMON_CUH
#define NMT_CUDA_ATTENTION_FUSED_COMMON_CUH

#include <cmath>

#include "common.cuh"
#include "nmt/attention.h"

/* The kernels' scalar arguments (one copy per launch, in the parameter space). */
typedef struct {
  const void *q, *k, *v;
  int ldq, ldkv;
  const int32_t *k_lens;
  int Tq, Tk, H;
  int causal;
  float p_drop, r, scale;
  uint64_t seed, stream;
  int *err;
} af_params;

static inline af_params af_params_of(nmt_cuda_ctx *c, const nmt_attn_args *a) {
  af_params p;
  p.q = a->q;
  p.k = a->k;
  p.v = a->v;
  p.ldq = a->ldq;
  p.ldkv = a->ldkv;
  p.k_lens = a->k_lens;
  p.Tq = a->Tq;
  p.Tk = a->Tk;
  p.H = a->H;
  p.causal = a->causal != 0;
  p.p_drop = a->p_drop;
  p.r = a->p_drop > 0.0f ? 1.0f / (1.0f - a->p_drop) : 1.0f;
  p.scale = (float)(1.0 / sqrt((double)a->dk));
  p.seed = a->seed;
  p.stream = a->stream;
  p.err = c->d_err;
  return p;
}

__device__ __forceinline__ float warp_allmax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_allsum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* k_lens[b], clamped into [1, Tk] with the error bit set when it was outside. */
__device__ __forceinline__ int af_klen(const af_params &p, int b) {
  int kl = p.k_lens[b];
  if (kl < 1 || kl > p.Tk) {
    if (threadIdx.x == 0) atomicOr(p.err, NMT_CUDA_ERR_ATT_KLEN);
    kl = kl < 1 ? 1 : p.Tk;
  }
  return kl;
}

/* Keys visible to query i (0 for a row past Tq). */
__device__ __forceinline__ int af_lim(const af_params &p, int i, int Tq, int kl) {
  if (i >= Tq) return 0;
  return p.causal && i + 1 < kl ? i + 1 : kl;
}

/* The dropout factor of element e: r when kept, 0 when dropped; 1 without dropout. Not
 * inlined: Philox's 10 rounds inlined at each of the kernels' call sites made up a quarter of
 * the object (30 instantiations), and a call per element costs little beside them. */
static __device__ __noinline__ float af_drop(const af_params &p, uint64_t e) {
  if (p.p_drop > 0.0f) return nmt__keep(p.seed, p.stream, e, p.p_drop) ? p.r : 0.0f;
  return 1.0f;
}

/* drow[(b*H + h)*Tq + i] = sum_d dout^ out^ (fp32; out as stored) for the BH*Tq rows, one warp
 * per row in lane order, on the current stream: elements are float (half = 0) or the context's
 * half type (half = 1). dk is the head size. */
nmt_status nmt__cuda_attention_fused_drow(nmt_cuda_ctx *c, float *drow, const void *dout,
                                          const void *out, int half, const af_params &p, int BH,
                                          int dk);

#endif /* NMT_CUDA_ATTENTION_FUSED_COMMON_CUH */
