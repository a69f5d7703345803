/* test/test_cuda_context.c — what the per-device context holds (cuda/context.cu): the aux
 * stream pool (stream_pool / fork / use / join; docs/cuda.md "Streams"), the registered half
 * working copy of the weights (half_weights) and the device-side error word.
 *
 * The pool is tested for ordering behind a gate that holds the compute stream (nmt_tg_gate,
 * test/gpu_helpers.h) and for results bitwise those of one stream. Matmul through the
 * registered copy is held to the device's own cast path (bitwise where the copy's slice is as
 * aligned as the cast); the misuses the contract names are refused. Arguments only a kernel
 * can see are reported at the next synchronization, once. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "test.h"

/* ------------------------------------------------------------------------------------------ */
/* the stream pool */

/* Three matmul_fwd on three aux streams give bitwise what the same three give on one stream
 * (fp32, and fp16, whose input casts use each stream's own scratch); the fork orders the aux
 * streams after the compute stream's work (their inputs are produced there, behind the gate),
 * and the join orders the compute stream after them (a sum of the three outputs). */
static void pool_case(nmt_tg_gpu *g, nmt_precision mode) {
  enum { S = 3 };
  const int M = 384, K = 512, N = 640;
  const size_t ni = (size_t)M * K, nw = (size_t)N * K, no = (size_t)M * N;
  float *inp[S], *w[S], *bias[S], *d_src[S], *d_inp[S], *d_w[S], *d_b[S], *d_out[S];
  float *one[S], *want_sum = nmt_tg_halloc(g, no * 4);
  float *d_zero = nmt_tg_dalloc(g, ni * 4), *d_sum = nmt_tg_dalloc(g, no * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, mode));
  NMT_ASSERT_OK(g->be->memset_zero(g->ctx, d_zero, ni * 4));
  for (int s = 0; s < S; s++) {
    inp[s] = nmt_tg_randn(g, ni, 301 + s, 1.0f, 0.0f);
    w[s] = nmt_tg_randn(g, nw, 311 + s, 0.05f, 0.0f);
    bias[s] = nmt_tg_randn(g, N, 321 + s, 1.0f, 0.0f);
    NMT_TG_SETUP_OK();
    d_src[s] = nmt_tg_dup_dev(g, inp[s], ni * 4);
    d_inp[s] = nmt_tg_dup_dev(g, inp[s], ni * 4);
    d_w[s] = nmt_tg_dup_dev(g, w[s], nw * 4);
    d_b[s] = nmt_tg_dup_dev(g, bias[s], N * 4);
    d_out[s] = nmt_tg_dalloc(g, no * 4);
    NMT_TG_SETUP_OK();
    nmt_tg_poison(g, d_out[s], no);
    NMT_TG_SETUP_OK();
    /* One stream: the reference result. */
    NMT_ASSERT_OK(g->be->matmul_fwd(g->ctx, d_out[s], d_inp[s], d_w[s], d_b[s], M, K, N));
    one[s] = nmt_tg_fetch(g, d_out[s], no * 4);
    NMT_TG_SETUP_OK();
  }
  for (size_t i = 0; i < no; i++) want_sum[i] = (one[0][i] + one[1][i]) + one[2][i];
  NMT_ASSERT_OK(g->be->stream_pool(g->ctx, S));

  /* Round 1, ungated: the aux streams' scratch grows here (growing waits for the stream). */
  for (int s = 0; s < S; s++) nmt_tg_poison(g, d_out[s], no);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->stream_fork(g->ctx));
  for (int s = 0; s < S; s++) {
    NMT_ASSERT_OK(g->be->stream_use(g->ctx, s + 1));
    NMT_ASSERT_OK(g->be->matmul_fwd(g->ctx, d_out[s], d_inp[s], d_w[s], d_b[s], M, K, N));
  }
  NMT_ASSERT_OK(g->be->stream_join(g->ctx));
  for (int s = 0; s < S; s++)
    NMT_TG_EXACT("aux stream vs one stream", nmt_tg_fetch(g, d_out[s], no * 4), one[s], no);

  /* Round 2, gated: inputs and outputs poisoned, the inputs rebuilt on the compute stream
   * behind the gate before the fork, the sum after the join. */
  for (int s = 0; s < S; s++) {
    nmt_tg_poison(g, d_out[s], no);
    nmt_tg_poison(g, d_inp[s], ni);
  }
  nmt_tg_poison(g, d_sum, no);
  NMT_TG_SETUP_OK();
  nmt_tg_gate gt;
  nmt_tg_first_err e = {NMT_OK, NULL, ""};
  if (!nmt_tg_gate_close(g, &gt, 20000)) return;
  for (int s = 0; s < S; s++)
    nmt_tg_keep(&e, g->be->add(g->ctx, d_inp[s], d_src[s], d_zero, ni), "add (input)");
  nmt_tg_keep(&e, g->be->stream_fork(g->ctx), "stream_fork");
  for (int s = S - 1; s >= 0; s--) {
    nmt_tg_keep(&e, g->be->stream_use(g->ctx, s + 1), "stream_use");
    nmt_tg_keep(&e, g->be->matmul_fwd(g->ctx, d_out[s], d_inp[s], d_w[s], d_b[s], M, K, N),
         "matmul_fwd");
  }
  nmt_tg_keep(&e, g->be->stream_join(g->ctx), "stream_join");
  nmt_tg_keep(&e, g->be->add(g->ctx, d_sum, d_out[0], d_out[1], no), "add (sum)");
  nmt_tg_keep(&e, g->be->add(g->ctx, d_sum, d_sum, d_out[2], no), "add (sum)");
  nmt_tg_gate_open(&gt);
  NMT_TG_NO_ERR(e);
  for (int s = 0; s < S; s++)
    NMT_TG_EXACT("gated aux stream vs one stream", nmt_tg_fetch(g, d_out[s], no * 4), one[s], no);
  NMT_TG_EXACT("sum on the compute stream after the join", nmt_tg_fetch(g, d_sum, no * 4), want_sum,
               no);
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_FP32));
}

NMT_TG_TEST(cuda_stream_pool_matches_one_stream_fp32) { pool_case(g, NMT_PRECISION_FP32); }

NMT_TG_TEST(cuda_stream_pool_matches_one_stream_fp16) { pool_case(g, NMT_PRECISION_FP16); }

/* The misuses nmt/backend.h lists, each refused with NMT_ERR_INTERNAL (NMT_ERR_CONFIG for the
 * pool size) and leaving the context usable. */
NMT_TG_TEST(cuda_stream_pool_misuse) {
  float h[4] = {1, 2, 3, 4};
  float *d = nmt_tg_dup_dev(g, h, sizeof h);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_EQ_STATUS(g->be->stream_pool(g->ctx, 9), NMT_ERR_CONFIG);
  NMT_ASSERT_EQ_STATUS(g->be->stream_pool(g->ctx, -1), NMT_ERR_CONFIG);
  NMT_ASSERT_OK(g->be->stream_pool(g->ctx, 2));
  NMT_ASSERT_EQ_STATUS(g->be->stream_use(g->ctx, 1), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->stream_join(g->ctx), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->stream_fork(g->ctx));
  NMT_ASSERT_EQ_STATUS(g->be->stream_fork(g->ctx), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->stream_use(g->ctx, 3), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->stream_use(g->ctx, -1), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->stream_pool(g->ctx, 1), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->stream_use(g->ctx, 2));
  NMT_ASSERT_EQ_STATUS(g->be->copy_h2d(g->ctx, d, h, sizeof h), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->copy_d2h(g->ctx, h, d, sizeof h), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->memset_zero(g->ctx, d, sizeof h), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->synchronize(g->ctx), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->h2d_async(g->ctx, 0, d, h, sizeof h), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->h2d_acquire(g->ctx, 0), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->h2d_release(g->ctx, 0), NMT_ERR_INTERNAL);
  /* An op on aux stream 2, then the join: the compute stream sees its result. */
  NMT_ASSERT_OK(g->be->axpy(g->ctx, d, d, 1.0f, 4));
  NMT_ASSERT_OK(g->be->stream_join(g->ctx));
  NMT_ASSERT_EQ_STATUS(g->be->stream_join(g->ctx), NMT_ERR_INTERNAL);
  float *back = nmt_tg_fetch(g, d, sizeof h);
  NMT_TG_SETUP_OK();
  const float want[4] = {2, 4, 6, 8};
  NMT_TG_EXACT("axpy on an aux stream", back, want, 4);
  /* A rebuilt pool of another size works, and none at all. */
  NMT_ASSERT_OK(g->be->stream_pool(g->ctx, 1));
  NMT_ASSERT_OK(g->be->stream_fork(g->ctx));
  NMT_ASSERT_EQ_STATUS(g->be->stream_use(g->ctx, 2), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->stream_use(g->ctx, 1));
  NMT_ASSERT_OK(g->be->stream_join(g->ctx));
  NMT_ASSERT_OK(g->be->stream_pool(g->ctx, 0));
  NMT_ASSERT_OK(g->be->stream_fork(g->ctx));
  NMT_ASSERT_OK(g->be->stream_join(g->ctx));
  NMT_ASSERT_OK(g->be->synchronize(g->ctx));
}

/* ------------------------------------------------------------------------------------------ */
/* the registered half copy of the weights (nmt/backend.h half_weights) */

/* Results of one linear layer on the device: fwd with a bias, fused bias+ReLU fwd, and bwd
 * (dinp, dw, dbias accumulated onto zeros), fetched to tracked host memory in r[0..4]. */
static void device_linear(nmt_tg_gpu *g, const float *d_w, const float *d_inp, const float *d_bias,
                          const float *d_dout, int M, int K, int N, float *r[5]) {
  const size_t no = (size_t)M * N, ni = (size_t)M * K, nw = (size_t)N * K;
  float *d_out = nmt_tg_dalloc(g, no * 4), *d_relu = nmt_tg_dalloc(g, no * 4),
        *d_di = nmt_tg_dalloc(g, ni * 4);
  float *d_dw = nmt_tg_dalloc(g, nw * 4), *d_db = nmt_tg_dalloc(g, (size_t)N * 4);
  if (nmt_test_failed()) return;
  nmt_tg_poison(g, d_out, no);
  nmt_tg_poison(g, d_relu, no);
  nmt_status s = g->be->memset_zero(g->ctx, d_di, ni * 4);
  if (s == NMT_OK) s = g->be->memset_zero(g->ctx, d_dw, nw * 4);
  if (s == NMT_OK) s = g->be->memset_zero(g->ctx, d_db, (size_t)N * 4);
  if (s == NMT_OK) s = g->be->matmul_fwd(g->ctx, d_out, d_inp, d_w, d_bias, M, K, N);
  if (s == NMT_OK) s = g->be->matmul_bias_relu_fwd(g->ctx, d_relu, d_inp, d_w, d_bias, M, K, N);
  if (s == NMT_OK)
    s = g->be->matmul_bwd(g->ctx, d_di, d_dw, d_db, d_dout, d_inp, d_w, M, K, N);
  if (s != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "linear layer: %s: %s", nmt_status_str(s),
                  nmt_last_error());
    return;
  }
  r[0] = nmt_tg_fetch(g, d_out, no * 4);
  r[1] = nmt_tg_fetch(g, d_relu, no * 4);
  r[2] = nmt_tg_fetch(g, d_di, ni * 4);
  r[3] = nmt_tg_fetch(g, d_dw, nw * 4);
  r[4] = nmt_tg_fetch(g, d_db, (size_t)N * 4);
}

/* matmul with a registered copy (filled by cast_half) against the same call without one, on the
 * device: the copy holds the cast the GEMM would make, so with the weight's offset a multiple of
 * 128 elements (the copy's slice as 256-byte aligned as the cast scratch: the same cuBLASLt
 * algorithm, cuda/gemm.cu) the results are bitwise equal; at an odd offset the slice is only
 * 2-byte aligned and cuBLASLt may pick another algorithm, so there within fp32 summation order
 * (rtol 1e-5). Then the fp32 weight changes without a refresh: the registered GEMMs must still
 * give the old weight's results (the copy is what they read) and differ from the new one's. */
static void half_copy_case(nmt_tg_gpu *g, nmt_precision mode, size_t off, int bitwise,
                           uint64_t seed) {
  const int M = 37, K = 64, N = 96;
  const size_t nw = (size_t)N * K, n_buf = off + nw + 300;
  const size_t len[5] = {(size_t)M * N, (size_t)M * N, (size_t)M * K, nw, (size_t)N};
  static const char *const names[5] = {"matmul_fwd", "matmul_bias_relu_fwd", "matmul_bwd dinp",
                                       "matmul_bwd dw", "matmul_bwd dbias"};
  float *buf = nmt_tg_randn(g, n_buf, seed, 0.2f, 0.0f);
  float *inp = nmt_tg_randn(g, (size_t)M * K, seed + 1, 1.0f, 0.0f);
  float *bias = nmt_tg_randn(g, (size_t)N, seed + 2, 0.3f, 0.0f);
  float *dout = nmt_tg_randn(g, (size_t)M * N, seed + 3, 1.0f, 0.0f),
        *moved = nmt_tg_halloc(g, nw * 4);
  NMT_TG_SETUP_OK();
  for (size_t i = 0; i < nw; i++) moved[i] = buf[off + i] * 1.5f + 0.01f;
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, mode));
  float *d_buf = nmt_tg_dup_dev(g, buf, n_buf * 4),
        *d_inp = nmt_tg_dup_dev(g, inp, (size_t)M * K * 4);
  float *d_bias = nmt_tg_dup_dev(g, bias, (size_t)N * 4),
        *d_dout = nmt_tg_dup_dev(g, dout, (size_t)M * N * 4);
  void *d_half = nmt_tg_dalloc(g, n_buf * 2);
  NMT_TG_SETUP_OK();
  float *plain[5] = {0}, *cached[5] = {0}, *stale[5] = {0}, *fresh[5] = {0};
  const float *d_w = d_buf + off;
  device_linear(g, d_w, d_inp, d_bias, d_dout, M, K, N, plain);
  NMT_ASSERT_OK(g->be->cast_half(g->ctx, d_half, d_buf, n_buf));
  NMT_ASSERT_OK(g->be->half_weights(g->ctx, d_buf, d_half, n_buf));
  device_linear(g, d_w, d_inp, d_bias, d_dout, M, K, N, cached);
  nmt_status s = g->be->copy_h2d(g->ctx, d_buf + off, moved, nw * 4);
  if (s == NMT_OK) device_linear(g, d_w, d_inp, d_bias, d_dout, M, K, N, stale);
  nmt_status u = g->be->half_weights(g->ctx, NULL, NULL, 0);
  if (s == NMT_OK && u == NMT_OK) device_linear(g, d_w, d_inp, d_bias, d_dout, M, K, N, fresh);
  NMT_ASSERT_OK(s);
  NMT_ASSERT_OK(u);
  NMT_TG_SETUP_OK();
  const char *mode_name = mode == NMT_PRECISION_FP16 ? "fp16" : "bf16";
  char what[128];
  for (int i = 0; i < 5; i++) {
    snprintf(what, sizeof what, "%s offset %zu: %s, current copy vs cast", mode_name, off,
             names[i]);
    if (bitwise) NMT_TG_EXACT(what, cached[i], plain[i], len[i]);
    else NMT_TG_CLOSE(what, cached[i], plain[i], len[i], 1e-5);
    snprintf(what, sizeof what, "%s offset %zu: %s, stale copy vs the old weight", mode_name,
             off, names[i]);
    if (bitwise) NMT_TG_EXACT(what, stale[i], plain[i], len[i]);
    else NMT_TG_CLOSE(what, stale[i], plain[i], len[i], 1e-5);
  }
  /* The new weight gives other outputs and dinp: the stale results were the copy's. (The ReLU
   * output is zero in about half its elements either way: any change will do.) */
  for (int i = 0; i < 3; i++) {
    size_t differ = 0;
    for (size_t e = 0; e < len[i]; e++) differ += fresh[i][e] != stale[i][e];
    if (differ <= (i == 1 ? 0 : len[i] / 2))
      nmt_test_fail(__FILE__, __LINE__, "%s: only %zu of %zu elements changed with the weight",
                    names[i], differ, len[i]);
  }
}

NMT_TG_TEST(cuda_half_matmul_copy_matches_cast) {
  for (int k = 0; k < 2 && !nmt_test_failed(); k++) {
    half_copy_case(g, nmt_tg_half_modes[k], 128 * 11, 1, 150 + 10 * k);
    if (!nmt_test_failed()) half_copy_case(g, nmt_tg_half_modes[k], 1357, 0, 170 + 10 * k);
  }
}

/* The misuses the contract names (nmt/backend.h half_weights, cast_half, adamw). */
NMT_TG_TEST(cuda_half_copy_misuse) {
  const size_t n = 256;
  float *d_w = nmt_tg_dalloc(g, n * 4), *d_g = nmt_tg_dalloc(g, n * 4),
        *d_m = nmt_tg_dalloc(g, n * 4);
  float *d_v = nmt_tg_dalloc(g, n * 4);
  void *d_h = nmt_tg_dalloc(g, n * 2);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->memset_zero(g->ctx, d_w, n * 4));
  NMT_ASSERT_OK(g->be->memset_zero(g->ctx, d_g, n * 4));
  NMT_ASSERT_OK(g->be->memset_zero(g->ctx, d_m, n * 4));
  NMT_ASSERT_OK(g->be->memset_zero(g->ctx, d_v, n * 4));
  /* A fresh context is fp32: no half type. */
  NMT_ASSERT_EQ_STATUS(g->be->half_weights(g->ctx, d_w, d_h, n), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->cast_half(g->ctx, d_h, d_w, n), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->adamw(g->ctx, d_w, d_g, d_m, d_v, n, 1e-3f, 0.9f, 0.98f, 1e-9f,
                                    0.0f, 1.0f, NULL, d_h, 1),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->half_weights(g->ctx, NULL, NULL, 0));
  NMT_ASSERT_EQ_STATUS(g->be->half_weights(NULL, d_w, d_h, n), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->cast_half(NULL, d_h, d_w, n), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_TF32));
  NMT_ASSERT_EQ_STATUS(g->be->half_weights(g->ctx, d_w, d_h, n), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_FP16));
  NMT_ASSERT_EQ_STATUS(g->be->half_weights(g->ctx, d_w, NULL, n), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->half_weights(g->ctx, d_w, d_h, 0), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->cast_half(g->ctx, NULL, d_w, n), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->cast_half(g->ctx, NULL, NULL, 0));
  NMT_ASSERT_OK(g->be->half_weights(g->ctx, d_w, d_h, n));
  NMT_ASSERT_EQ_STATUS(g->be->half_weights(g->ctx, d_w, d_h, n), NMT_ERR_INTERNAL);
  /* The copy's bits are fp16: no switch to bf16 under it; the same mode is fine. */
  NMT_ASSERT_EQ_STATUS(g->be->set_precision(g->ctx, NMT_PRECISION_BF16), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_FP16));
  NMT_ASSERT_OK(g->be->half_weights(g->ctx, NULL, NULL, 0));
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_BF16));
  NMT_ASSERT_OK(g->be->synchronize(g->ctx));
}

/* ------------------------------------------------------------------------------------------ */
/* the device-side error word: arguments only the device sees */

NMT_TG_TEST(cuda_bad_device_arguments_are_reported) {
#ifdef NMT_CUDA_TESTS_ON_REF
  return; /* the reference refuses these arguments at the call, not at the next sync */
#endif
  int32_t ids[4] = {1, -3, 2, 0}, lens[2] = {3, 0}, tgt[2] = {1, 9};
  float zeros[64] = {0};
  int32_t *d_ids = nmt_tg_dup_dev(g, ids, sizeof ids),
          *d_lens = nmt_tg_dup_dev(g, lens, sizeof lens);
  int32_t *d_tgt = nmt_tg_dup_dev(g, tgt, sizeof tgt);
  float *d_a = nmt_tg_dup_dev(g, zeros, sizeof zeros),
        *d_b = nmt_tg_dup_dev(g, zeros, sizeof zeros);
  float *d_c = nmt_tg_dup_dev(g, zeros, sizeof zeros);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->embedding_fwd(g->ctx, d_a, d_ids, d_b, d_c, 4, 4, 2, 1.0f));
  NMT_ASSERT_EQ_STATUS(g->be->synchronize(g->ctx), NMT_ERR_INTERNAL);
  NMT_ASSERT(strstr(nmt_last_error(), "embedding") != NULL);
  NMT_ASSERT_OK(g->be->synchronize(g->ctx)); /* reported once, then cleared */
  /* k_lens[1] = 0 with B = 2, Tq = Tk = 3, H = 1, dk = 2 */
  NMT_ASSERT_OK(g->be->attention_fwd(g->ctx, d_a, d_b, d_c, 2, d_c, d_c, 2, d_lens, 2, 3, 3, 1,
                                     2, 0, 0.0f, 1, 1));
  NMT_ASSERT_EQ_STATUS(g->be->synchronize(g->ctx), NMT_ERR_INTERNAL);
  NMT_ASSERT(strstr(nmt_last_error(), "k_lens") != NULL);
  /* target 9 >= V = 4 */
  NMT_ASSERT_OK(g->be->xent_fwd_bwd(g->ctx, d_a, d_b, NULL, d_tgt, 2, 4, 0.1f, 1.0f, NULL, 1));
  float l[2];
  NMT_ASSERT_EQ_STATUS(g->be->copy_d2h(g->ctx, l, d_b, sizeof l), NMT_ERR_INTERNAL);
  NMT_ASSERT(strstr(nmt_last_error(), "target") != NULL);
  NMT_ASSERT_OK(g->be->synchronize(g->ctx));
}
