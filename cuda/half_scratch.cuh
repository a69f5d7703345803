/* cuda/half_scratch.cuh — what the half-storage path's non-GEMM ops (nmt/backend.h "the
 * half-storage path": attention, residual, layernorm, xent, embedding, dropout) share across
 * their files (not a public header): the scratch size of the LayerNorm backward's column
 * partials, and the row launchers cuda/residual.cu exports to cuda/layernorm.cu (one copy of
 * the LayerNorm row kernels for both ops, as src/ref/residual.c reuses src/ref/layernorm.c).
 *
 * Scratch per file (each op asks the current stream's op scratch, nmt__cuda_scratch, for
 * exactly the size below; reserve_scratch must cover it at the plan's bounds):
 *   attention.cu: attention_half_fwd / _bwd use the fp32 op's layout, fp32 head-major copies:
 *     nmt__cuda_attention_scratch(att_q, att_kv, att_scores) (cuda/common.cuh), unchanged.
 *   residual.cu (and layernorm.cu through it): nmt__cuda_ln_half_scratch(width), the
 *     per-block column partials of dgamma / dbeta, 2 x NMT_CUDA_LN_HALF_MAX_BLOCKS x width
 *     floats; a function of the width (C) alone. It never exceeds
 *     nmt__cuda_layernorm_scratch(width), which reserve_scratch already reserves for the plan's
 *     width, so a plan that covers layernorm_bwd covers it; reserve_scratch should still take
 *     the larger of the two when half_acts is set, so that neither depends on the other's
 *     constant.
 *   xent.cu, embedding.cu, dropout.cu: none.
 *
 * defines: nmt__cuda_half_op_check, NMT_CUDA_LN_HALF_MAX_BLOCKS, nmt__cuda_ln_half_scratch,
 *          nmt__cuda_ln_half_fwd, nmt__cuda_ln_half_bwd, nmt__cuda_ln_dh
 */
#ifndef NMT_CUDA_HALF_SCRATCH_CUH
#define NMT_CUDA_HALF_SCRATCH_CUH

#include <stddef.h>
#include <stdint.h>

#include "common.cuh"
#include "half.cuh"

/* NMT_ERR_INTERNAL naming `op` unless the context computes in fp16 or bf16 (the half-storage
 * ops need its half type). */
static inline nmt_status nmt__cuda_half_op_check(const nmt_cuda_ctx *c, const char *op) {
  if (!nmt__cuda_half_mode(c))
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda %s: needs a context in fp16 or bf16 mode (the half-storage path has "
                      "no half type in fp32/tf32)",
                      op);
  return NMT_OK;
}

/* ---- cuda/residual.cu ---- */

/* The most row blocks of the LayerNorm backward's dgamma / dbeta partials (each block adds its
 * rows' per-column sums into one partial row; a small kernel then adds the blocks' rows in
 * block order). */
enum { NMT_CUDA_LN_HALF_MAX_BLOCKS = 256 };

/* Bytes of op scratch the half-storage LayerNorm backwards (residual_ln_half_bwd,
 * layernorm_half_bwd) ask for at width C: the partials of dgamma and dbeta, one (2, C) fp32
 * block row per row block, at most NMT_CUDA_LN_HALF_MAX_BLOCKS; 0 for width 0. Non-decreasing
 * in width. */
size_t nmt__cuda_ln_half_scratch(size_t width);

/* The forward rows of residual_ln_half_fwd and layernorm_half_fwd, on c's current stream, for
 * a context in half mode (arguments already checked): for each row r < M of (M, C),
 *   s = y ? x + dropout(v(y)) : x   (residual_dropout_ln_fwd's expressions and mask, element
 *                                    r*C + c; p = 0: x + v(y))
 *   sum (may be NULL; required with y) = s
 *   with gamma: out (fp32, may be NULL) = LN(s) as layernorm_fwd, out_h (half, may be NULL)
 *   = round(out), mean / rstd (may be NULL).
 * Errors: NMT_ERR_DEVICE (launch). */
nmt_status nmt__cuda_ln_half_fwd(nmt_cuda_ctx *c, float *out, void *out_h, float *sum,
                                 float *mean, float *rstd, const float *x, const void *y,
                                 const float *gamma, const float *beta, int M, int C, float eps,
                                 float p, uint64_t seed, uint64_t stream);

/* What the backward writes in half (dh). */
typedef enum {
  NMT_CUDA_LN_DH_DROPOUT = 0, /* round(keep ? dsum * (1/(1-p)) : 0) (p = 0: round(dsum)) */
  NMT_CUDA_LN_DH_DINP = 1     /* round(the new fp32 df), df required */
} nmt__cuda_ln_dh;

/* The backward rows of residual_ln_half_bwd and layernorm_half_bwd, on c's current stream:
 * with dsum = LN'(dout) of the forward's input xin (sum or inp), mean and rstd (as
 * layernorm_bwd forms it),
 *   df (fp32, may be NULL) = dsum, or df += dsum when df_add;
 *   dh (half, may be NULL) as dh_mode says;
 *   dgamma += sum_rows dout * xhat, dbeta += sum_rows dout (each may be NULL).
 * Uses the current stream's op scratch (nmt__cuda_ln_half_scratch(C) when a parameter
 * gradient is asked for on the warp path; layernorm_bwd's on the scalar path). Errors:
 * NMT_ERR_DEVICE, NMT_ERR_NOMEM (scratch growth), NMT_ERR_INTERNAL (a shape beyond a grid). */
nmt_status nmt__cuda_ln_half_bwd(nmt_cuda_ctx *c, float *df, int df_add, void *dh,
                                 nmt__cuda_ln_dh dh_mode, float *dgamma, float *dbeta,
                                 const float *dout, const float *xin, const float *gamma,
                                 const float *mean, const float *rstd, int M, int C, float p,
                                 uint64_t seed, uint64_t stream);

#endif /* NMT_CUDA_HALF_SCRATCH_CUH */
