/* nmt/scratch.h — the scratch plan: upper bounds on the shapes of the ops a caller will issue
 * on a backend context, from which the backend sizes every buffer its ops use besides their
 * arguments once, at setup (nmt/backend.h reserve_scratch; docs/cuda.md "Scratch plan"). The
 * model computes its plan (nmt_model_scratch_plan, nmt/model.h).
 *
 * defines: nmt_scratch_need, nmt_scratch_plan, nmt_scratch_need_max, nmt_scratch_plan_max
 */
#ifndef NMT_SCRATCH_H
#define NMT_SCRATCH_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Upper bounds on the shapes of the ops a caller will issue on a context: the input of
 * reserve_scratch, from which a backend sizes every scratch buffer of its ops ONCE, at setup,
 * so that no op allocates inside a training step (a cudaMalloc/cudaFree there stalls the
 * stream and can deadlock against an NCCL kernel waiting for a peer). Counts of elements (not
 * bytes), each the largest over the calls it names; 0 = no such call. The model computes them
 * from data.max_tokens, data.max_len, d_model, n_heads, d_ff and vocab
 * (nmt_model_scratch_plan, nmt/model.h); each backend turns them into its own buffers. */
typedef struct nmt_scratch_need {
  size_t gemm_rows;  /* M of matmul_fwd / matmul_bwd / matmul_bias_relu_fwd */
  size_t gemm_inp;   /* M*K: elements of inp (and dinp) */
  size_t gemm_w;     /* N*K: elements of w (and dw) */
  size_t gemm_out;   /* M*N: elements of out (and dout) */
  size_t att_q;      /* B*Tq*H*dk of attention_fwd / _bwd: q, out, dq, dout in one head layout */
  size_t att_kv;     /* B*Tk*H*dk: k, v, dk, dv */
  size_t att_scores; /* B*H*Tq*Tk of the attention calls with p_drop > 0 (dropout scratch) */
  size_t emb_rows;   /* n_rows of embedding_bwd */
  size_t width;      /* C of embedding_bwd, layernorm_bwd and residual_dropout_ln_bwd */
  /* The half-storage ops (nmt_act below): 1 when they will be called, so that a backend sizes
   * what they need besides the fields above (ref: fp32 working copies of their half inputs
   * and outputs, from the same GEMM and attention bounds); 0 otherwise. */
  size_t half_acts;
  size_t xent_cols;  /* V of xent_half_fwd_bwd (ref: one row widened to fp32) */
} nmt_scratch_need;

/* What a context will run: `main` on the main (compute) stream, `aux` on EACH aux stream of
 * the stream pool (stream_use(i), i >= 1; zero when the pool runs nothing). */
typedef struct nmt_scratch_plan {
  nmt_scratch_need main;
  nmt_scratch_need aux;
} nmt_scratch_plan;

/* *dst = the element-wise larger of *dst and *src: a need covering both (one definition for
 * the model, which merges its passes' needs, and the backends, which keep the union of the
 * plans they were given). */
static inline void nmt_scratch_need_max(nmt_scratch_need *dst, const nmt_scratch_need *src) {
#define NMT_NEED_MAX_(f) dst->f = src->f > dst->f ? src->f : dst->f
  NMT_NEED_MAX_(gemm_rows);
  NMT_NEED_MAX_(gemm_inp);
  NMT_NEED_MAX_(gemm_w);
  NMT_NEED_MAX_(gemm_out);
  NMT_NEED_MAX_(att_q);
  NMT_NEED_MAX_(att_kv);
  NMT_NEED_MAX_(att_scores);
  NMT_NEED_MAX_(emb_rows);
  NMT_NEED_MAX_(width);
  NMT_NEED_MAX_(half_acts);
  NMT_NEED_MAX_(xent_cols);
#undef NMT_NEED_MAX_
}

/* dst = the element-wise larger of dst and src, for both lanes (a backend keeps the largest
 * plan reserve_scratch was given; a zeroed dst takes src). */
static inline void nmt_scratch_plan_max(nmt_scratch_plan *dst, const nmt_scratch_plan *src) {
  nmt_scratch_need_max(&dst->main, &src->main);
  nmt_scratch_need_max(&dst->aux, &src->aux);
}

#ifdef __cplusplus
}
#endif
#endif /* NMT_SCRATCH_H */
