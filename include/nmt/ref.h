/* nmt/ref.h — the fp32 CPU reference backend's ops, callable directly.
 *
 * These are the functions behind nmt_backend_ref (src/ref/backend.c); tests and the CUDA parity
 * tests call them by name. Every op has exactly the semantics, shapes and argument order of the
 * matching nmt_backend field documented in nmt/backend.h (read that header for the contract):
 * fp32 row-major, backward ops accumulate (+=) into every non-NULL gradient output, linear
 * weights are (out_features, in_features). GEMMs go through OpenBLAS (cblas_sgemm) and use the
 * thread count the engine set. `ctx` is unused (pass NULL). Ops return NMT_OK, NMT_ERR_INTERNAL
 * on bad arguments (negative sizes, out-of-range ids, p_drop outside [0,1)), or NMT_ERR_NOMEM
 * when a scratch allocation fails.
 *
 * Dropout rounding contract (the CUDA backend must match bit for bit): element e is kept iff
 * nmt_rng_uniform(seed, stream, e) >= p, and a kept value x becomes x * (1.0f / (1.0f - p))
 * computed in fp32.
 *
 * defines: nmt_ref_* (one per nmt_backend op), nmt_ref_dropout_keep
 */
#ifndef NMT_REF_H
#define NMT_REF_H

#include <stddef.h>
#include <stdint.h>

#include "nmt/backend.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- context (src/ref/misc.c): the host needs none ----
 * device_count: 1 (the host). ctx_create: *ctx = NULL. ctx_destroy: no-op. set_precision:
 * fp32 and tf32 are accepted and both computed in exact fp32 (tf32 only permits less);
 * fp16/bf16 are NMT_ERR_CONFIG. */
nmt_status nmt_ref_device_count(int *out);
nmt_status nmt_ref_ctx_create(int device, void **ctx);
void nmt_ref_ctx_destroy(void *ctx);
nmt_status nmt_ref_set_precision(void *ctx, nmt_precision mode);

/* ---- memory (plain host memory, 64-byte aligned; src/ref/misc.c) ---- */
nmt_status nmt_ref_malloc(void *ctx, size_t bytes, void **out);
void nmt_ref_free(void *ctx, void *p);
nmt_status nmt_ref_memset_zero(void *ctx, void *p, size_t bytes);
nmt_status nmt_ref_copy_h2d(void *ctx, void *dst, const void *src, size_t bytes);
nmt_status nmt_ref_copy_d2h(void *ctx, void *dst, const void *src, size_t bytes);
nmt_status nmt_ref_synchronize(void *ctx);

/* ---- embedding (src/ref/embedding.c): out (B*T,C) = scale*wte[ids] + pos[r % T] ---- */
nmt_status nmt_ref_embedding_fwd(void *ctx, float *out, const int32_t *ids, const float *wte,
                                 const float *pos, int n_rows, int T, int C, float scale);
nmt_status nmt_ref_embedding_bwd(void *ctx, float *dwte, const float *dout, const int32_t *ids,
                                 int n_rows, int C, float scale);

/* ---- linear (src/ref/matmul.c): out (M,N) = inp (M,K) @ w (N,K)^T + bias (N) ---- */
nmt_status nmt_ref_matmul_fwd(void *ctx, float *out, const float *inp, const float *w,
                              const float *bias, int M, int K, int N);
nmt_status nmt_ref_matmul_bwd(void *ctx, float *dinp, float *dw, float *dbias, const float *dout,
                              const float *inp, const float *w, int M, int K, int N);

/* ---- layer normalization (src/ref/layernorm.c; Ba et al. 2016) ---- */
nmt_status nmt_ref_layernorm_fwd(void *ctx, float *out, float *mean, float *rstd, const float *inp,
                                 const float *gamma, const float *beta, int M, int C, float eps);
nmt_status nmt_ref_layernorm_bwd(void *ctx, float *dinp, float *dgamma, float *dbeta,
                                 const float *dout, const float *inp, const float *gamma,
                                 const float *mean, const float *rstd, int M, int C);

/* ---- multi-head attention (src/ref/attention.c; Vaswani et al. 2017 §3.2.1-3.2.2) ---- */
nmt_status nmt_ref_attention_fwd(void *ctx, float *out, float *probs, const float *q, int ldq,
                                 const float *k, const float *v, int ldkv, const int32_t *k_lens,
                                 int B, int Tq, int Tk, int H, int dk, int causal, float p_drop,
                                 uint64_t seed, uint64_t stream);
nmt_status nmt_ref_attention_bwd(void *ctx, float *dq, float *dkey, float *dv, float *dprobs,
                                 const float *dout, const float *probs, const float *q, int ldq,
                                 const float *k, const float *v, int ldkv, const int32_t *k_lens,
                                 int B, int Tq, int Tk, int H, int dk, int causal, float p_drop,
                                 uint64_t seed, uint64_t stream);

/* ---- elementwise (src/ref/relu.c, src/ref/dropout.c, src/ref/misc.c) ---- */
nmt_status nmt_ref_relu_fwd(void *ctx, float *out, const float *inp, size_t n);
nmt_status nmt_ref_relu_bwd(void *ctx, float *dinp, const float *dout, const float *out, size_t n);
nmt_status nmt_ref_dropout_fwd(void *ctx, float *out, const float *inp, size_t n, float p,
                               uint64_t seed, uint64_t stream);
nmt_status nmt_ref_dropout_bwd(void *ctx, float *dinp, const float *dout, size_t n, float p,
                               uint64_t seed, uint64_t stream);
nmt_status nmt_ref_add(void *ctx, float *out, const float *a, const float *b, size_t n);
nmt_status nmt_ref_axpy(void *ctx, float *y, const float *x, float alpha, size_t n);
nmt_status nmt_ref_sum_acc(void *ctx, float *dst, const float *x, size_t n);
nmt_status nmt_ref_sumsq(void *ctx, float *dst, const float *x, size_t n);

/* ---- softmax cross-entropy with label smoothing (src/ref/xent.c; §5.4) ---- */
nmt_status nmt_ref_xent_fwd_bwd(void *ctx, float *logits, float *losses, float *nll,
                                const int32_t *targets,
                                int M, int V, float label_smoothing, float dloss, int write_grad);
nmt_status nmt_ref_argmax(void *ctx, int32_t *out, const float *x, int M, int V);

/* ---- AdamW (src/ref/adamw.c; Kingma & Ba 2015 alg. 1, Loshchilov & Hutter 2019) ---- */
nmt_status nmt_ref_adamw(void *ctx, float *params, const float *grads, float *m, float *v,
                         size_t n, float lr, float beta1, float beta2, float eps,
                         float weight_decay, float grad_scale, long step);

/* The dropout keep mask of elements e0 .. e0+n-1: keep[i] = 1 iff
 * nmt_rng_uniform(seed, stream, e0 + i) >= p, else 0. Draws each Philox block once for its four
 * elements (4x fewer blocks than calling nmt_rng_uniform per element). src/ref/dropout.c. */
void nmt_ref_dropout_keep(uint8_t *keep, uint64_t e0, size_t n, float p, uint64_t seed,
                          uint64_t stream);

#ifdef __cplusplus
}
#endif
#endif /* NMT_REF_H */
