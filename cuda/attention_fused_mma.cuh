/* cuda/attention_fused_mma.cuh — the tensor-core (WMMA) variant of the fused attention ops
 * for half storage (cuda/attention_fused_mma.cu), called by the entries of
 * cuda/attention_fused.cu. The contract is nmt/attention.h's; the selection rule is
 * nmt__cuda_attention_fused_mma_serves, decided there once per call.
 *
 * defines: nmt__cuda_attention_fused_mma_serves, nmt__cuda_attention_fused_mma_fwd,
 *          nmt__cuda_attention_fused_mma_bwd
 */
#ifndef NMT_CUDA_ATTENTION_FUSED_MMA_CUH
#define NMT_CUDA_ATTENTION_FUSED_MMA_CUH

#include "common.cuh"
#include "nmt/attention.h"

/* 1 when the WMMA kernels serve these (already checked) arguments on this context: half = 1,
 * the context's choice (NMT_ATTENTION_FUSED_IMPL, nmt_cuda_ctx_set_attention_fused_impl) is
 * mma, Tk <= 256 (a query tile's whole score row in shared memory) and the grids of 16-row
 * tiles fit in x. 0: the SIMT kernels serve the call. */
int nmt__cuda_attention_fused_mma_serves(const nmt_cuda_ctx *c, const nmt_attn_args *a);

/* The ops of nmt/attention.h for half = 1, on arguments af_check has accepted, B, Tq > 0 and
 * non-NULL out / lse (fwd), dout / lse and, with dq or dkey, out / drow (bwd). */
nmt_status nmt__cuda_attention_fused_mma_fwd(nmt_cuda_ctx *c, void *out, float *lse,
                                             const nmt_attn_args *a);
nmt_status nmt__cuda_attention_fused_mma_bwd(nmt_cuda_ctx *c, void *dq, void *dkey, void *dv,
                                             float *drow, const void *dout, const void *out,
                                             const float *lse, const nmt_attn_args *a);

#endif /* NMT_CUDA_ATTENTION_FUSED_MMA_CUH */
