/* nmt/ref.h — the fp32 CPU reference backend's ops, callable directly.
 *
 * These are the functions behind nmt_backend_ref (src/ref/backend.c); tests and the CUDA parity
 * tests call them by name. Every op has exactly the semantics, shapes and argument order of the
 * matching nmt_backend field documented in nmt/backend.h (read that header for the contract):
 * fp32 row-major, backward ops accumulate (+=) into every non-NULL gradient output, linear
 * weights are (out_features, in_features). GEMMs go through OpenBLAS (cblas_sgemm) and use the
 * thread count the engine set. Ops return NMT_OK, NMT_ERR_INTERNAL on bad arguments (negative
 * sizes, out-of-range ids, p_drop outside [0,1)), or NMT_ERR_NOMEM when a scratch allocation
 * fails.
 *
 * Context. `ctx` is NULL (plain fp32: what most callers and tests pass) or a context from
 * nmt_ref_ctx_create, which holds the GEMM precision, the scratch for the rounded copies of
 * the fp16/bf16 emulation and the registered half copy of the weights (half_weights); it is
 * used by one thread at a time. Only matmul_fwd/bwd and matmul_bias_relu_fwd, half_weights,
 * cast_half, adamw with a half_out (and the stream-pool bookkeeping and the main-stream-only
 * checks below) read its precision; attention (dropout scratch) and residual_dropout_ln_bwd
 * (a row of scratch) take their scratch from it, as matmul does in fp16/bf16 mode (with a
 * NULL ctx they allocate per call instead); matmul and attention count their GEMM calls in it
 * (nmt_ref_counters). A context of another backend must not be passed (matmul refuses it with
 * NMT_ERR_INTERNAL; the others treat it as NULL).
 *
 * fp16/bf16 emulation (the arithmetic contract of nmt/backend.h's set_precision, which the CUDA
 * backend implements with real half-precision GEMMs): matmul_fwd/bwd round every GEMM input
 * matrix to the half type with nmt_half_round_fp16 / nmt_half_round_bf16 (nmt/half.h), then
 * run the same fp32 sgemm on the rounded copies. A product of two halves is exact in fp32, so the result is that
 * of a half-input GEMM with fp32 accumulation, up to the order of the sums.
 *
 * Half working copy of the weights (nmt/backend.h half_weights, cast_half, adamw's half_out),
 * implemented for real so that the CPU tests see what a GPU would: the copy holds the uint16
 * bit patterns (nmt_half_fp16_bits / nmt_half_bf16_bits), and a GEMM whose weight lies inside
 * the registered buffer decodes them (nmt_half_fp16_value / nmt_half_bf16_value) instead of
 * rounding the fp32 weight. With a current copy that is bitwise the same input; with a stale
 * one it is the stale values.
 *
 * Dropout rounding contract (the CUDA backend must match bit for bit): element e is kept iff
 * nmt_rng_uniform(seed, stream, e) >= p, and a kept value x becomes x * (1.0f / (1.0f - p))
 * computed in fp32.
 *
 * defines: nmt_ref_* (one per nmt_backend op, the half-storage ones included), nmt_ref_dropout_keep (the half-precision
 *          rounding it emulates with is nmt/half.h's), nmt__ref_gemm_precision, nmt__ref_scratch, nmt__ref_half_copy,
 *          nmt__ref_infer_copy, nmt__ref_main_stream_only, nmt__ref_count_gemm,
 *          nmt__ref_count_cast, nmt__ref_half_mode,
 *          nmt__ref_scratch_or_malloc, NMT_REF_SLOT_*
 */
#ifndef NMT_REF_H
#define NMT_REF_H

#include <stddef.h>
#include <stdint.h>

#include "nmt/attention.h"
#include "nmt/backend.h"
#include "nmt/status.h"
#include "nmt/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- context (src/ref/context.c) ----
 * device_count: 1 (the host).
 * ctx_create: a small context (any device index: CPU workers pass their rank) with precision
 *   fp32; NMT_ERR_NOMEM. Its scratch buffers are sized by reserve_scratch (below), grow when a
 *   call needs more (counted), and are freed by ctx_destroy.
 * ctx_destroy: frees a context; NULL is a no-op.
 * set_precision: with a context, fp32, tf32 (computed as exact fp32: tf32 only permits less),
 *   fp16 and bf16 (emulated, see above). With ctx == NULL only fp32 and tf32 (a NULL context
 *   has nowhere to keep the mode and always means fp32); fp16/bf16 or an unknown mode are
 *   NMT_ERR_CONFIG.
 * ctx_set_abort (the table's set_abort): keeps the flag in a reference context (no ref op
 *   waits, and the host communicator polls the flag it was created with, but every GEMM op
 *   returns NMT_ERR_ABORTED at its start once it is raised, so a CPU step of minutes ends
 *   within one GEMM: the largest of conf/base.ini, its output projection, is 6250 x 8000 x
 *   512 multiply-adds, 0.43 s at one core's 118 GFLOP/s FMA peak measured here); NMT_OK for any ctx, NULL and foreign ones (nothing kept) included. One GEMM
 *   is never split to look more often: OpenBLAS gives a sub-block other bits than the whole
 *   (row slices changed make run's losses from step 60).
 * comm_create: nmt_comm_create_host(n, abort, comms); devices and ctxs are not read. */
nmt_status nmt_ref_device_count(int *out);
nmt_status nmt_ref_ctx_create(int device, void **ctx);
void nmt_ref_ctx_destroy(void *ctx);
nmt_status nmt_ref_set_precision(void *ctx, nmt_precision mode);
nmt_status nmt_ref_ctx_set_abort(void *ctx, atomic_int *abort);
nmt_status nmt_ref_comm_create(int n, const int *devices, void *const *ctxs, atomic_int *abort,
                               nmt_comm **comms);

/* ---- scratch plan and counters (src/ref/context.c; contract: nmt/backend.h
 * reserve_scratch, counters) ----
 * reserve_scratch: sizes the context's scratch slots (NMT_REF_SLOT_*, below) for every call
 *   within plan->main and plan->aux (ref runs every stream's ops on one thread, so the larger
 *   of the two): the dropout weights and mask of attention (att_scores floats and bytes), one
 *   row (width) for residual_dropout_ln_bwd, and in fp16/bf16 mode the rounded GEMM inputs
 *   (inp or dout: max(gemm_inp, gemm_out); w: gemm_w; inp of dw: gemm_inp). Grows, never
 *   shrinks; keeps the plan so that a later set_precision to fp16/bf16 sizes the GEMM copies
 *   from it. NULL ctx: NMT_OK (no scratch: its ops allocate per call). NMT_ERR_NOMEM;
 *   NMT_ERR_INTERNAL for a foreign ctx or between a fork and its join.
 * counters: gemm_calls (the logical calls of nmt/backend.h's nmt_backend_counters) and
 *   scratch_growths (slots an op grew past the reserved size) since ctx_create.
 *   NMT_ERR_INTERNAL for a NULL or foreign ctx. */
nmt_status nmt_ref_reserve_scratch(void *ctx, const nmt_scratch_plan *plan);
nmt_status nmt_ref_counters(void *ctx, nmt_backend_counters *out);

/* ---- profiling (src/ref/profile.c; contract: nmt/backend.h "profiling") ----
 * measure_peaks: nmt_prof_measure_cpu_peak (one OpenBLAS thread's sgemm, memcpy), the same in
 *   every precision mode (NMT_ERR_CONFIG for an unknown one); ctx not read. NMT_ERR_NOMEM.
 * mem_peak_mb: max(in, getrusage(RUSAGE_SELF).ru_maxrss / 1024) MiB, the process's peak
 *   resident set; NMT_ERR_INTERNAL (and NAN) if getrusage fails.
 * profiler_capture: NMT_OK, nothing to capture.
 * clock_create: *clock = NULL; the track keeps the host clock. clock_destroy: nothing. */
nmt_status nmt_ref_measure_peaks(void *ctx, nmt_precision mode, double *tflops, double *gbps);
nmt_status nmt_ref_mem_peak_mb(void *ctx, double *inout_peak_mb);
nmt_status nmt_ref_profiler_capture(int on);
nmt_status nmt_ref_clock_create(void *ctx, nmt_prof_track *track, void **clock);
void nmt_ref_clock_destroy(void *clock);

/* ---- memory (plain host memory, 64-byte aligned; src/ref/memory.c) ---- */
nmt_status nmt_ref_malloc(void *ctx, size_t bytes, void **out);
void nmt_ref_free(void *ctx, void *p);
nmt_status nmt_ref_memset_zero(void *ctx, void *p, size_t bytes);
nmt_status nmt_ref_copy_h2d(void *ctx, void *dst, const void *src, size_t bytes);
nmt_status nmt_ref_copy_d2h(void *ctx, void *dst, const void *src, size_t bytes);
nmt_status nmt_ref_copy_d2d(void *ctx, void *dst, const void *src, size_t bytes);
nmt_status nmt_ref_synchronize(void *ctx);

/* ---- batch staging (src/ref/memory.c) and the stream pool (src/ref/context.c); contract in
 * nmt/backend.h ----
 * The reference backend runs every op at once on the calling thread, so:
 * host_alloc: malloc (any alignment malloc gives; 0 bytes still gives a pointer);
 *   NMT_ERR_NOMEM. host_free: free; NULL is a no-op.
 * h2d_async: copies at once (memmove); h2d_acquire, h2d_release, h2d_wait_src do nothing.
 *   All four: NMT_ERR_INTERNAL for a slot outside {0, 1}.
 * stream_pool / stream_fork / stream_use / stream_join: bookkeeping only, with the checks of
 *   the CUDA backend so that a CPU run catches a misuse that would race on a GPU:
 *   stream_pool: NMT_ERR_CONFIG for n outside [0, 8]; NMT_ERR_INTERNAL between a fork and its
 *   join. stream_fork while forked, stream_join without a fork, stream_use(i) without a fork
 *   or with i outside [0, n]: NMT_ERR_INTERNAL, with a message naming the misuse.
 *   Between a fork and its join, memset_zero, copy_h2d, copy_d2h, synchronize, h2d_async,
 *   h2d_acquire, h2d_release, d2h_async and d2h_wait (main-stream operations) are
 *   NMT_ERR_INTERNAL as well.
 * d2h_async: copies at once (memmove); d2h_wait does nothing. Both: NMT_ERR_INTERNAL for a
 *   slot outside [0, NMT_D2H_SLOTS).
 * With ctx == NULL (the fp32 default) there is no state to keep: the stream ops succeed after
 *   the checks that need none (n in [0, 8]; i in [0, 8]). A context of another backend is
 *   NMT_ERR_INTERNAL. */
nmt_status nmt_ref_host_alloc(void *ctx, size_t bytes, void **out);
void nmt_ref_host_free(void *ctx, void *p);
nmt_status nmt_ref_h2d_async(void *ctx, int slot, void *dst, const void *src, size_t bytes);
nmt_status nmt_ref_h2d_acquire(void *ctx, int slot);
nmt_status nmt_ref_h2d_release(void *ctx, int slot);
nmt_status nmt_ref_h2d_wait_src(void *ctx, int slot);
nmt_status nmt_ref_d2h_async(void *ctx, int slot, void *host, const void *dev, size_t bytes);
nmt_status nmt_ref_d2h_wait(void *ctx, int slot);
/* The comm stream's copies (contract: nmt/backend.h comm_d2h ...): comm_d2h and comm_h2d copy
 * at once (memmove); comm_wait and comm_join do nothing. All four: NMT_ERR_INTERNAL between a
 * fork and its join (main-stream operations, as on the GPU). */
nmt_status nmt_ref_comm_d2h(void *ctx, void *host, const void *dev, size_t bytes);
nmt_status nmt_ref_comm_h2d(void *ctx, void *dev, const void *host, size_t bytes);
nmt_status nmt_ref_comm_wait(void *ctx);
nmt_status nmt_ref_comm_join(void *ctx);
nmt_status nmt_ref_stream_pool(void *ctx, int n);
nmt_status nmt_ref_stream_fork(void *ctx);
nmt_status nmt_ref_stream_use(void *ctx, int i);
nmt_status nmt_ref_stream_join(void *ctx);

/* ---- embedding (src/ref/embedding.c): out (B*T,C) = scale*wte[ids] + pos[r % T] ---- */
nmt_status nmt_ref_embedding_fwd(void *ctx, float *out, const int32_t *ids, const float *wte,
                                 const float *pos, int n_rows, int T, int C, float scale);
nmt_status nmt_ref_embedding_bwd(void *ctx, float *dwte, const float *dout, const int32_t *ids,
                                 int n_rows, int C, float scale);

/* ---- linear (src/ref/matmul.c): out (M,N) = inp (M,K) @ w (N,K)^T + bias (N) ----
 * In fp16/bf16 mode (a context set so) inp, w (fwd) and dout, w, inp (bwd) enter the GEMMs
 * rounded to the half type (w decoded from the registered half copy when one covers it, see
 * half_weights below); bias, dbias (fp32 row sums of the UNROUNDED dout) and every output
 * stay fp32. fp32/tf32 mode and ctx == NULL make no copies. */
nmt_status nmt_ref_matmul_fwd(void *ctx, float *out, const float *inp, const float *w,
                              const float *bias, int M, int K, int N);
nmt_status nmt_ref_matmul_bwd(void *ctx, float *dinp, float *dw, float *dbias, const float *dout,
                              const float *inp, const float *w, int M, int K, int N);
/* out (M,N) = relu(inp @ w^T + bias): nmt_ref_matmul_fwd, then nmt_ref_relu_fwd on out in
 * place, so it is bitwise the two calls (the fp16/bf16 emulation included: only inp and w are
 * rounded; the bias add and the ReLU are fp32). src/ref/matmul.c. */
nmt_status nmt_ref_matmul_bias_relu_fwd(void *ctx, float *out, const float *inp, const float *w,
                                        const float *bias, int M, int K, int N);

/* ---- the half working copy of the weights (contract: nmt/backend.h half_weights) ----
 * half_weights (src/ref/context.c): records src, dst (uint16_t[n], host memory) and n in the
 *   context; matmul_fwd/bwd and matmul_bias_relu_fwd then decode a weight lying wholly inside
 *   src[0, n) from dst's bits. src == NULL unregisters (also on a NULL ctx: nothing to do).
 *   Errors (NMT_ERR_INTERNAL): a NULL ctx (fp32) or a context in fp32/tf32 mode, dst NULL,
 *   n == 0, a copy already registered, a context of another backend. While registered,
 *   set_precision to another mode is NMT_ERR_INTERNAL.
 * cast_half (src/ref/matmul.c): dst[i] = nmt_half_fp16_bits(src[i]) in fp16 mode,
 *   nmt_half_bf16_bits(src[i]) in bf16 mode. Errors (NMT_ERR_INTERNAL): a NULL ctx or fp32/tf32
 *   mode, NULL pointers with n > 0, a context of another backend. */
nmt_status nmt_ref_half_weights(void *ctx, const float *src, void *dst, size_t n);
nmt_status nmt_ref_cast_half(void *ctx, void *dst, const float *src, size_t n);

/* ---- an inference context's weights, transposed (contract: nmt/backend.h infer_weights) ----
 * infer_weights (src/ref/context.c): first forgets the earlier declaration (also when the
 *   call then fails), then records src and n, allocates (or keeps, when large enough) a host
 *   buffer of n floats; matmul_fwd and matmul_bias_relu_fwd in fp32/tf32 mode then read a
 *   weight w (N, K) lying wholly inside src[0, n) as W^T (K, N) at buffer + (w - src),
 *   transposed there at its first use (nmt__ref_infer_copy), and multiply with OpenBLAS's
 *   NoTrans x NoTrans sgemm. src == NULL frees the buffer (a no-op on the NULL ctx). Errors
 *   (NMT_ERR_INTERNAL): a foreign ctx (with or without src), the NULL ctx with src, n == 0
 *   with src; NMT_ERR_NOMEM. */
nmt_status nmt_ref_infer_weights(void *ctx, const float *src, size_t n);

/* ---- layer normalization (src/ref/layernorm.c; Ba et al. 2016) ---- */
nmt_status nmt_ref_layernorm_fwd(void *ctx, float *out, float *mean, float *rstd, const float *inp,
                                 const float *gamma, const float *beta, int M, int C, float eps);
nmt_status nmt_ref_layernorm_bwd(void *ctx, float *dinp, float *dgamma, float *dbeta,
                                 const float *dout, const float *inp, const float *gamma,
                                 const float *mean, const float *rstd, int M, int C);

/* ---- residual + dropout + LayerNorm, fused (src/ref/residual.c; contract in nmt/backend.h) ----
 * Bitwise equal to the composition the model used before the fusion: forward
 * dropout_fwd(y) + add(x, .) + layernorm_fwd; backward layernorm_bwd into a zeroed buffer,
 * added to dx, and dropout_bwd of that buffer into dy (the same fp32 expressions, in the same
 * order, with the same double accumulations; test/test_residual.c). */
nmt_status nmt_ref_residual_dropout_ln_fwd(void *ctx, float *out, float *sum, float *mean,
                                           float *rstd, const float *x, const float *y,
                                           const float *gamma, const float *beta, int M, int C,
                                           float eps, float p, uint64_t seed, uint64_t stream);
nmt_status nmt_ref_residual_dropout_ln_bwd(void *ctx, float *dx, float *dy, float *dgamma,
                                           float *dbeta, const float *dout, const float *sum,
                                           const float *gamma, const float *mean,
                                           const float *rstd, int M, int C, float p,
                                           uint64_t seed, uint64_t stream);

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

/* ---- fused attention (src/ref/attention_fused.c; contract: nmt/attention.h) ----
 * Every sum in index order; half = 1 rounds with the context's half type (ctx in fp16/bf16
 * mode). The dropout mask draws nmt_rng_uniform per element, as attention_fwd. */
nmt_status nmt_ref_attention_fused_fwd(void *ctx, void *out, float *lse, const nmt_attn_args *a);
nmt_status nmt_ref_attention_fused_bwd(void *ctx, void *dq, void *dkey, void *dv, float *drow,
                                       const void *dout, const void *out, const float *lse,
                                       const nmt_attn_args *a);

/* ---- elementwise (src/ref/relu.c, src/ref/dropout.c) and reductions (src/ref/reductions.c:
 * add, axpy, sum_acc, sumsq, count_targets; argmax below) ---- */
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
nmt_status nmt_ref_count_targets(void *ctx, float *dst, const int32_t *targets, size_t n);

/* ---- the optimizer step's control (src/ref/step.c; contract in nmt/backend.h) ---- */
nmt_status nmt_ref_step_control(void *ctx, nmt_step_ctl *ctl, const float *grads, size_t n,
                                nmt_step_policy policy, long step);
/* step_decide (nmt/backend.h): step_control's policy on a given reduced sum of squares. */
nmt_status nmt_ref_step_decide(void *ctx, nmt_step_ctl *ctl, const float *sumsq,
                               const float *extra, nmt_step_policy policy, long step);

/* ---- softmax cross-entropy with label smoothing (src/ref/xent.c; §5.4) and argmax
 * (src/ref/reductions.c) ---- */
nmt_status nmt_ref_xent_fwd_bwd(void *ctx, float *logits, float *losses, float *nll,
                                const int32_t *targets, int M, int V, float label_smoothing,
                                float dloss, const float *dloss_scale, int write_grad);
nmt_status nmt_ref_argmax(void *ctx, int32_t *out, const float *x, int M, int V);

/* ---- decoding's per-step selection (src/ref/logp_topk.c; contract: nmt/backend.h) ----
 * One pass per row keeps the k best ids (insertion behind the k-th key); with logp, a second
 * pass forms the row's log-sum-exp (fp32 exponentials summed in double). */
nmt_status nmt_ref_logp_topk(void *ctx, int32_t *ids, float *logp, const float *x, int R, int V,
                             int k);
/* Which compilation of logp_topk's row loop runs (x86-64: the SSE2 baseline or AVX2, the
 * same fp32 and double operations per lane, so the same bits): want 0 = SSE2, 1 = AVX2, any
 * other value = the best this CPU has (what the op picks by itself at its first call).
 * Returns the path now in effect (0 or 1), or -1 when AVX2 was asked for and the CPU (or the
 * build: not x86-64) lacks it, the path then unchanged. For tests; process-wide. */
int nmt__ref_logp_topk_path(int want);
/* logp_at (nmt/backend.h): the same row pass for the log-sum-exp (the same path, the same bits
 * as nmt_ref_logp_topk's logp), read at the given ids. */
nmt_status nmt_ref_logp_at(void *ctx, float *logp, const int32_t *ids, const float *x, int R,
                           int V, int k);

/* ---- AdamW (src/ref/adamw.c; Kingma & Ba 2015 alg. 1, Loshchilov & Hutter 2019) ----
 * half_out (uint16_t[n] or NULL): after each element's update, its cast_half bits of the new
 * parameter; needs a context in fp16/bf16 mode (NMT_ERR_INTERNAL otherwise, also on a skipped
 * step, which writes nothing). */
nmt_status nmt_ref_adamw(void *ctx, float *params, const float *grads, float *m, float *v,
                         size_t n, float lr, float beta1, float beta2, float eps,
                         float weight_decay, float grad_scale, const nmt_step_ctl *ctl,
                         void *half_out, long step);

/* ---- the half-storage path (contract: nmt/backend.h "the half-storage path"; each in the file
 * of the fp32 op it mirrors) ----
 * The half elements (nmt_act) are held as the uint16 bit patterns a GPU holds
 * (nmt_half_fp16_bits / nmt_half_bf16_bits of nmt/half.h, decoded with the _value functions),
 * so the CPU computes on exactly the values the device stores. Each op widens its half inputs
 * into fp32 working copies (the context's scratch, sized by reserve_scratch from the plan's
 * half_acts), runs the fp32 op it mirrors (the same code, hence the same sums), and rounds
 * at the contract's sites. linear_half_fwd never records a ReLU mask (*mask_written = 0) and
 * linear_half_bwd reads v(relu_out) > 0. */
nmt_status nmt_ref_linear_half_fwd(void *ctx, nmt_act *out, const nmt_act *inp, const float *w,
                                   const float *bias, int M, int K, int N, int relu,
                                   uint8_t *relu_mask, int *mask_written, int batch,
                                   size_t param_stride, size_t out_stride);
nmt_status nmt_ref_linear_half_bwd(void *ctx, void *dinp, nmt_dinp_mode dinp_mode, float *dw,
                                   float *dbias, const nmt_act *dout, const nmt_act *inp,
                                   const float *w, const nmt_act *relu_out,
                                   const uint8_t *relu_mask, float relu_scale, int M, int K,
                                   int N);
nmt_status nmt_ref_attention_half_fwd(void *ctx, nmt_act *out, float *probs, const nmt_act *q,
                                      int ldq, const nmt_act *k, const nmt_act *v, int ldkv,
                                      const int32_t *k_lens, int B, int Tq, int Tk, int H, int dk,
                                      int causal, float p_drop, uint64_t seed, uint64_t stream);
nmt_status nmt_ref_attention_half_bwd(void *ctx, nmt_act *dq, nmt_act *dkey, nmt_act *dv,
                                      float *dprobs, const nmt_act *dout, const float *probs,
                                      const nmt_act *q, int ldq, const nmt_act *k,
                                      const nmt_act *v, int ldkv, const int32_t *k_lens, int B,
                                      int Tq, int Tk, int H, int dk, int causal, float p_drop,
                                      uint64_t seed, uint64_t stream);
nmt_status nmt_ref_residual_ln_half_fwd(void *ctx, float *out, nmt_act *out_h, float *sum,
                                        float *mean, float *rstd, const float *x, const nmt_act *y,
                                        const float *gamma, const float *beta, int M, int C,
                                        float eps, float p, uint64_t seed, uint64_t stream);
nmt_status nmt_ref_residual_ln_half_bwd(void *ctx, float *dx, nmt_act *dy, float *dgamma,
                                        float *dbeta, const float *dout, const float *sum,
                                        const float *gamma, const float *mean, const float *rstd,
                                        int M, int C, float p, uint64_t seed, uint64_t stream);
nmt_status nmt_ref_layernorm_half_fwd(void *ctx, nmt_act *out, float *mean, float *rstd,
                                      const float *inp, const float *gamma, const float *beta,
                                      int M, int C, float eps);
nmt_status nmt_ref_layernorm_half_bwd(void *ctx, float *dinp, int accumulate, nmt_act *dinp_h,
                                      float *dgamma, float *dbeta, const float *dout,
                                      const float *inp, const float *gamma, const float *mean,
                                      const float *rstd, int M, int C);
nmt_status nmt_ref_xent_half_fwd_bwd(void *ctx, nmt_act *logits, float *losses, float *nll,
                                     const int32_t *targets, int M, int V, float label_smoothing,
                                     float dloss, const float *dloss_scale, int write_grad);
nmt_status nmt_ref_embedding_half_fwd(void *ctx, float *out, nmt_act *out_h, const int32_t *ids,
                                      const float *wte, const float *pos, int n_rows, int T, int C,
                                      float scale, float p, uint64_t seed, uint64_t stream);
nmt_status nmt_ref_dropout_half(void *ctx, nmt_act *out, const void *inp, int inp_f32, size_t n,
                                float p, uint64_t seed, uint64_t stream);

/* The dropout keep mask of elements e0 .. e0+n-1: keep[i] = 1 iff
 * nmt_rng_uniform(seed, stream, e0 + i) >= p, else 0. Draws each Philox block once for its four
 * elements (4x fewer blocks than calling nmt_rng_uniform per element). src/ref/dropout.c. */
void nmt_ref_dropout_keep(uint8_t *keep, uint64_t e0, size_t n, float p, uint64_t seed,
                          uint64_t stream);

/* ---- internal to src/ref (context.c defines them for matmul.c and memory.c; not for other
 * callers) ----
 * nmt__ref_gemm_precision: the GEMM precision of ctx in *out (NMT_PRECISION_FP32 for NULL);
 *   NMT_ERR_INTERNAL naming `op` when ctx is not a reference context; NMT_ERR_ABORTED (no
 *   message: the run's error is whoever raised it) once the flag of set_abort is raised.
 * nmt__ref_scratch: scratch buffer `slot` (NMT_REF_SLOT_*) of a reference context with room
 *   for at least n floats, valid until the next call for that slot (never shrinks). Sized by
 *   reserve_scratch; a call beyond that grows it and counts a growth (nmt_ref_counters; a warn
 *   line once a plan was reserved). NMT_ERR_NOMEM; NMT_ERR_INTERNAL for a NULL or foreign ctx.
 * nmt__ref_scratch_or_malloc: nmt__ref_scratch for a reference context (*owned = NULL);
 *   otherwise (NULL ctx: ops callable without one) n floats from malloc, which the caller
 *   frees through *owned. NMT_ERR_NOMEM.
 * nmt__ref_count_gemm: adds n to ctx's GEMM count (nmt_backend_counters.gemm_calls); nothing
 *   for a NULL or foreign ctx.
 * nmt__ref_half_copy: the registered half bits of w[0, len) (dst + (w - src)) when the copy
 *   registered in ctx covers all of them; NULL otherwise (nothing registered, NULL or foreign
 *   ctx, len == 0, w outside or straddling the registered buffer).
 * nmt__ref_infer_copy: W^T (K, N) of the weight w (N, K) from the copy infer_weights
 *   registered in ctx, transposed now if this is the matrix's first use since the
 *   registration; NULL when nothing is registered (NULL or foreign ctx included), w[0, N*K)
 *   is not wholly inside the registered weights, N or K < 1, the range overlaps a matrix
 *   already copied in another shape, or the table of copied matrices (in ctx, grown by
 *   doubling: the encoder's and the decoder's, 4 + 8 per layer pair) cannot grow: the caller
 *   then reads w itself. Each call scans the matrices copied so far.
 * nmt__ref_main_stream_only: NMT_ERR_INTERNAL naming `op` when ctx is a reference context
 *   between stream_fork and stream_join (the memory ops that are main-stream only, above);
 *   NMT_OK otherwise (NULL or foreign ctx included). */
nmt_status nmt__ref_gemm_precision(void *ctx, const char *op, nmt_precision *out);
/* Scratch slots: the fp16/bf16 GEMM input copies (matmul.c: A = inp or dout, W = the weight,
 * B = inp of the dw GEMM), attention dropout's dropped weights and keep mask (attention.c; the
 * mask as bytes in a float slot), one row (residual.c). */
enum {
  NMT_REF_SLOT_GEMM_A = 0,
  NMT_REF_SLOT_GEMM_W = 1,
  NMT_REF_SLOT_GEMM_B = 2,
  NMT_REF_SLOT_ATT_DROP = 3,
  NMT_REF_SLOT_ATT_KEEP = 4,
  NMT_REF_SLOT_ROW = 5,
  /* the half-storage ops (reserved when the plan's half_acts is set) */
  NMT_REF_SLOT_GEMM_OUT = 6, /* a GEMM's fp32 result before it is rounded to the half type */
  NMT_REF_SLOT_ATT_Q = 7,    /* attention: widened q (B*Tq, H*dk) ... */
  NMT_REF_SLOT_ATT_K = 8,    /* ... k and v (B*Tk, H*dk) */
  NMT_REF_SLOT_ATT_V = 9,
  NMT_REF_SLOT_ATT_O = 10,   /* out (forward) or widened dout (backward), (B*Tq, H*dk) */
  NMT_REF_SLOT_ATT_DQ = 11,  /* the fp32 gradients before rounding */
  NMT_REF_SLOT_ATT_DK = 12,
  NMT_REF_SLOT_ATT_DV = 13,
  NMT_REF_SLOT_XENT_ROW = 14, /* one widened logits row (V) */
  NMT_REF_SCRATCH_SLOTS = 15
};
nmt_status nmt__ref_scratch(void *ctx, int slot, size_t n, float **out);
nmt_status nmt__ref_scratch_or_malloc(void *ctx, int slot, size_t n, float **out, void **owned);
void nmt__ref_count_gemm(void *ctx, unsigned n);
/* Adds n to ctx's cast count (nmt_backend_counters.casts: GEMM input matrices rounded inside a
 * GEMM op); nothing for a NULL or foreign ctx. */
void nmt__ref_count_cast(void *ctx, unsigned n);
/* NMT_OK and *bf16 (1: bf16, 0: fp16) when ctx is a reference context in fp16 or bf16 mode
 * (the half-storage ops need one); NMT_ERR_INTERNAL naming `op` otherwise; NMT_ERR_ABORTED as
 * nmt__ref_gemm_precision. */
nmt_status nmt__ref_half_mode(void *ctx, const char *op, int *bf16);
const uint16_t *nmt__ref_half_copy(void *ctx, const float *w, size_t len);
const float *nmt__ref_infer_copy(void *ctx, const float *w, int N, int K);
nmt_status nmt__ref_main_stream_only(void *ctx, const char *op);

#ifdef __cplusplus
}
#endif
#endif /* NMT_REF_H */
