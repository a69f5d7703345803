/* test/test_half_ops.c — the reference's half-storage ops (nmt/backend.h "the half-storage
 * path"; src/ref/<op>.c) held to their contract exactly, in fp16 and bf16:
 *   - the GEMM ops on data whose every product and sum is exact (small integers), where the
 *     half op must give bitwise the fp32 op's result whatever the order of the sums: this pins
 *     shapes, transposes, strides, the batch, the bias, the ReLU, the ReLU backward through
 *     the saved output and its dropout scale, and the three dinp modes;
 *   - one value that needs rounding, stored rounded to nearest even (the rounding site);
 *   - the other ops as "the fp32 op on the decoded inputs, then one rounding where the op
 *     stores half": attention, residual + dropout + LayerNorm, LayerNorm, the classifier,
 *     embedding + dropout, dropout; bitwise;
 *   - the argument errors (no context, an fp32 context) and the cast counter (a weight in the
 *     registered half copy is not cast; one outside it is).
 * The CUDA backend is held to the reference by test/test_cuda_<op>.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/backend.h"
#include "nmt/half.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

static const nmt_precision MODES[2] = {NMT_PRECISION_FP16, NMT_PRECISION_BF16};

static void *half_ctx(nmt_precision mode) {
  void *ctx = NULL;
  if (nmt_ref_ctx_create(0, &ctx) != NMT_OK || nmt_ref_set_precision(ctx, mode) != NMT_OK) {
    nmt_ref_ctx_destroy(ctx);
    return NULL;
  }
  return ctx;
}

static float uniform(uint64_t stream, uint64_t i) { return nmt_rng_uniform(7, stream, i); }

/* Small integers in [-r, r]: exact in both half types, as are their products and the short
 * sums below (|sum| < 256, bf16's exact integers). */
static void ints(float *x, size_t n, int r, uint64_t stream) {
  for (size_t i = 0; i < n; i++) x[i] = floorf(uniform(stream, i) * (2 * r + 1)) - r;
}
static void randn(float *x, size_t n, float scale, uint64_t stream) {
  for (size_t i = 0; i < n; i++) x[i] = (uniform(stream, 2 * i) - 0.5f) * 2 * scale;
}

static int bits_equal(const char *what, const nmt_act *a, const nmt_act *b, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (a[i] != b[i]) {
      nmt_test_fail(__FILE__, __LINE__, "%s: element %zu: 0x%04x, want 0x%04x", what, i, a[i],
                    b[i]);
      return 0;
    }
  return 1;
}
static int floats_equal(const char *what, const float *a, const float *b, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (memcmp(&a[i], &b[i], sizeof(float))) {
      nmt_test_fail(__FILE__, __LINE__, "%s: element %zu: %.9g, want %.9g", what, i, (double)a[i],
                    (double)b[i]);
      return 0;
    }
  return 1;
}

/* ---- linear_half_fwd / linear_half_bwd on exact data ---- */

static void linear_exact(nmt_precision mode) {
  const int bf16 = mode == NMT_PRECISION_BF16;
  const int M = 5, K = 6, N = 7, B = 3;
  const size_t stride = (size_t)N * K + N + 3; /* weight, bias, and a gap: a layer's layout */
  void *ctx = half_ctx(mode);
  float *params = calloc(stride * B, sizeof(float));
  float *x = malloc(M * K * 4), *y = malloc(B * M * N * 4), *want = malloc(B * M * N * 4);
  nmt_act *xh = malloc(M * K * 2), *yh = malloc(B * M * N * 2), *wh = malloc(B * M * N * 2);
  NMT_ASSERT(ctx && params && x && y && want && xh && yh && wh);
  ints(x, (size_t)M * K, 3, 1);
  for (int b = 0; b < B; b++) {
    ints(params + b * stride, (size_t)N * K, 2, 10 + b);
    ints(params + b * stride + (size_t)N * K, (size_t)N, 5, 20 + b);
  }
  nmt_half_encode_array(bf16, xh, x, (size_t)M * K);
  for (int relu = 0; relu < 2; relu++) {
    int written = -1;
    NMT_ASSERT_OK(nmt_ref_linear_half_fwd(ctx, yh, xh, params, params + (size_t)N * K, M, K, N,
                                          relu, NULL, &written, B, stride, (size_t)M * N));
    NMT_ASSERT_EQ_INT(written, 0); /* the reference never records a mask */
    for (int b = 0; b < B; b++) {
      const float *w = params + b * stride;
      NMT_ASSERT_OK(nmt_ref_matmul_fwd(NULL, want + b * M * N, x, w, w + (size_t)N * K, M, K, N));
      if (relu) NMT_ASSERT_OK(nmt_ref_relu_fwd(NULL, want + b * M * N, want + b * M * N, M * N));
    }
    nmt_half_encode_array(bf16, wh, want, (size_t)B * M * N);
    if (!bits_equal(relu ? "linear_half_fwd relu, batch 3" : "linear_half_fwd, batch 3", yh, wh,
                    (size_t)B * M * N))
      goto out;
  }
  /* Backward of batch entry 0 with the ReLU: dout integers, relu_out the forward's output. */
  {
    const float *w = params;
    float *dout = malloc(M * N * 4), *dx = malloc(M * K * 4), *dxw = malloc(M * K * 4);
    float *dw = malloc(N * K * 4), *dww = malloc(N * K * 4), *db = malloc(N * 4),
          *dbw = malloc(N * 4), *hid = malloc(M * K * 4);
    nmt_act *douth = malloc(M * N * 2), *dxh = malloc(M * K * 2), *dxwh = malloc(M * K * 2),
            *hidh = malloc(M * K * 2);
    NMT_ASSERT(dout && dx && dxw && dw && dww && db && dbw && hid && douth && dxh && dxwh && hidh);
    ints(dout, (size_t)M * N, 2, 30);
    nmt_half_encode_array(bf16, douth, dout, (size_t)M * N);
    /* A "hidden" output of a ReLU with a dropout: zeros and positive integers. */
    ints(hid, (size_t)M * K, 2, 31);
    for (int i = 0; i < M * K; i++) hid[i] = hid[i] > 0 ? hid[i] : 0;
    nmt_half_encode_array(bf16, hidh, hid, (size_t)M * K);
    for (int mode_i = 0; mode_i < 3; mode_i++) {
      const nmt_dinp_mode dm = (nmt_dinp_mode)mode_i;
      ints(dw, (size_t)N * K, 4, 40); /* gradients accumulate onto what is there */
      memcpy(dww, dw, (size_t)N * K * 4);
      ints(db, (size_t)N, 4, 41);
      memcpy(dbw, db, (size_t)N * 4);
      ints(dx, (size_t)M * K, 4, 42);
      memcpy(dxw, dx, (size_t)M * K * 4);
      const float scale = dm == NMT_DINP_HALF ? 2.0f : 1.0f; /* exact: a power of two */
      NMT_ASSERT_OK(nmt_ref_linear_half_bwd(ctx, dm == NMT_DINP_HALF ? (void *)dxh : (void *)dx,
                                            dm, dw, db, douth, xh, w,
                                            dm == NMT_DINP_HALF ? hidh : NULL, NULL, scale, M, K,
                                            N));
      /* The composition of the fp32 ops: dinp into zeros (or onto dx), then ReLU and scale. */
      float *acc = malloc(M * K * 4);
      NMT_ASSERT(acc);
      memset(acc, 0, (size_t)M * K * 4);
      NMT_ASSERT_OK(nmt_ref_matmul_bwd(NULL, acc, dww, dbw, dout, x, w, M, K, N));
      if (dm == NMT_DINP_HALF) {
        for (int i = 0; i < M * K; i++) acc[i] = hid[i] > 0 ? acc[i] * scale : 0.0f;
        nmt_half_encode_array(bf16, dxwh, acc, (size_t)M * K);
        if (!bits_equal("linear_half_bwd dinp half with relu_out", dxh, dxwh, (size_t)M * K)) {
          free(acc);
          goto out_b;
        }
      } else {
        for (int i = 0; i < M * K; i++) dxw[i] = dm == NMT_DINP_F32 ? acc[i] : dxw[i] + acc[i];
        if (!floats_equal(dm == NMT_DINP_F32 ? "linear_half_bwd dinp fp32 written"
                                             : "linear_half_bwd dinp fp32 added",
                          dx, dxw, (size_t)M * K)) {
          free(acc);
          goto out_b;
        }
      }
      free(acc);
      if (!floats_equal("linear_half_bwd dw +=", dw, dww, (size_t)N * K) ||
          !floats_equal("linear_half_bwd dbias +=", db, dbw, (size_t)N))
        goto out_b;
    }
    /* relu_out with an fp32 dinp is refused. */
    NMT_ASSERT_EQ_STATUS(nmt_ref_linear_half_bwd(ctx, dx, NMT_DINP_F32, NULL, NULL, douth, xh, w,
                                                 hidh, NULL, 1.0f, M, K, N),
                         NMT_ERR_INTERNAL);
  out_b:
    free(dout), free(dx), free(dxw), free(dw), free(dww), free(db), free(dbw), free(hid);
    free(douth), free(dxh), free(dxwh), free(hidh);
  }
out:
  free(params), free(x), free(y), free(want), free(xh), free(yh), free(wh);
  nmt_ref_ctx_destroy(ctx);
}

NMT_TEST(half_ops_linear_exact_fp16) { linear_exact(NMT_PRECISION_FP16); }
NMT_TEST(half_ops_linear_exact_bf16) { linear_exact(NMT_PRECISION_BF16); }

/* The rounding site: an output that is not a half is stored as the nearest one (ties to even),
 * once; and the weight comes from the registered half copy (not cast: counted) when it is
 * there, from the fp32 master otherwise (one cast). */
NMT_TEST(half_ops_linear_rounds_once_and_reads_the_copy) {
  for (int k = 0; k < 2; k++) {
    const int bf16 = MODES[k] == NMT_PRECISION_BF16;
    void *ctx = half_ctx(MODES[k]);
    NMT_ASSERT(ctx);
    /* 1 x 2 times 2 x 1: 1 * a + 1 * b with a + b between two halves. bf16 has 8 significant
     * bits: 256 + 1 = 257 is a tie between 256 and 258 and goes to 256 (even); fp16 has 11:
     * 2048 + 1 ties to 2048. Plus 0.75 more: 2049.75 -> 2050 (fp16), 257.75 -> 258 (bf16). */
    const float big = bf16 ? 256.0f : 2048.0f;
    float w[2] = {1.0f, 1.0f}, x[2] = {big, 1.0f}, bias = 0.0f;
    nmt_act xh[2], y;
    nmt_half_encode_array(bf16, xh, x, 2);
    nmt_backend_counters c0, c1;
    NMT_ASSERT_OK(nmt_ref_counters(ctx, &c0));
    NMT_ASSERT_OK(nmt_ref_linear_half_fwd(ctx, &y, xh, w, &bias, 1, 2, 1, 0, NULL, NULL, 1, 0, 0));
    NMT_ASSERT(fabsf((bf16 ? nmt_half_bf16_value(y) : nmt_half_fp16_value(y)) - big) == 0.0f);
    NMT_ASSERT_OK(nmt_ref_counters(ctx, &c1));
    NMT_ASSERT_EQ_INT((int)(c1.casts - c0.casts), 2); /* the weight and the bias, not in a copy */
    NMT_ASSERT_EQ_INT((int)(c1.gemm_calls - c0.gemm_calls), 1);
    bias = 0.75f;
    NMT_ASSERT_OK(nmt_ref_linear_half_fwd(ctx, &y, xh, w, &bias, 1, 2, 1, 0, NULL, NULL, 1, 0, 0));
    NMT_ASSERT((bf16 ? nmt_half_bf16_value(y) : nmt_half_fp16_value(y)) == big + 2.0f);
    /* With a registered copy whose bits say 3 for both weights (not the master's 1): read. */
    float master[3] = {1.0f, 1.0f, 0.0f};
    nmt_act copy[3];
    const float three[3] = {3.0f, 3.0f, 0.0f};
    nmt_half_encode_array(bf16, copy, three, 3);
    NMT_ASSERT_OK(nmt_ref_half_weights(ctx, master, copy, 3));
    x[0] = 1.0f;
    nmt_half_encode_array(bf16, xh, x, 2);
    NMT_ASSERT_OK(nmt_ref_counters(ctx, &c0));
    NMT_ASSERT_OK(nmt_ref_linear_half_fwd(ctx, &y, xh, master, master + 2, 1, 2, 1, 0, NULL, NULL,
                                          1, 0, 0));
    NMT_ASSERT_OK(nmt_ref_counters(ctx, &c1));
    NMT_ASSERT((bf16 ? nmt_half_bf16_value(y) : nmt_half_fp16_value(y)) == 6.0f);
    NMT_ASSERT_EQ_INT((int)(c1.casts - c0.casts), 0);
    NMT_ASSERT_OK(nmt_ref_half_weights(ctx, NULL, NULL, 0));
    nmt_ref_ctx_destroy(ctx);
  }
}

NMT_TEST(half_ops_need_a_half_context) {
  nmt_act a[4] = {0}, o[4];
  float w[4] = {0}, f[4] = {0};
  void *ctx = NULL;
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &ctx));
  /* NULL (fp32) and an fp32 context: refused by every op with a message. */
  void *ctxs[2] = {NULL, ctx};
  for (int i = 0; i < 2; i++) {
    NMT_ASSERT_EQ_STATUS(nmt_ref_linear_half_fwd(ctxs[i], o, a, w, NULL, 1, 1, 1, 0, NULL, NULL, 1,
                                                 0, 0),
                         NMT_ERR_INTERNAL);
    NMT_ASSERT_EQ_STATUS(nmt_ref_dropout_half(ctxs[i], o, a, 0, 4, 0.1f, 1, 2),
                         NMT_ERR_INTERNAL);
    NMT_ASSERT_EQ_STATUS(nmt_ref_layernorm_half_fwd(ctxs[i], o, f, f, f, w, w, 1, 4, 1e-5f),
                         NMT_ERR_INTERNAL);
  }
  nmt_ref_ctx_destroy(ctx);
}

/* ---- the other ops: the fp32 op on decoded inputs, one rounding at each half store ---- */

static void decode(int bf16, float *out, const nmt_act *in, size_t n) {
  nmt_half_decode_array(bf16, out, in, n);
}
/* A random half array and its values. */
static void rand_half(int bf16, nmt_act *h, float *v, size_t n, float scale, uint64_t stream) {
  randn(v, n, scale, stream);
  nmt_half_encode_array(bf16, h, v, n);
  decode(bf16, v, h, n);
}

static void attention_case(nmt_precision mode, int causal, int cross, float p) {
  const int bf16 = mode == NMT_PRECISION_BF16;
  const int B = 2, H = 2, dk = 4, C = H * dk, Tq = 5, Tk = cross ? 7 : Tq;
  const int32_t lens[2] = {Tk, Tk - 2};
  const int ldq = cross ? C : 3 * C, ldkv = cross ? 2 * C : 3 * C;
  const size_t nq = (size_t)B * Tq, nk = (size_t)B * Tk;
  void *ctx = half_ctx(mode);
  /* q in its own buffer (cross) or the fused qkv (self); k, v side by side. */
  const size_t qn = nq * ldq, kvn = nk * ldkv;
  nmt_act *qh = malloc(qn * 2), *kvh = cross ? malloc(kvn * 2) : qh, *oh = malloc(nq * C * 2);
  float *qv = malloc(qn * 4), *kvv = cross ? malloc(kvn * 4) : qv, *ov = malloc(nq * C * 4);
  float *probs = malloc((size_t)B * H * Tq * Tk * 4), *probs2 = malloc((size_t)B * H * Tq * Tk * 4);
  nmt_act *douth = malloc(nq * C * 2), *dqh = malloc(qn * 2), *dkvh = cross ? malloc(kvn * 2) : dqh;
  float *doutv = malloc(nq * C * 4), *dq = malloc(qn * 4), *dkv = cross ? malloc(kvn * 4) : dq;
  float *dprobs = malloc((size_t)B * H * Tq * Tk * 4);
  nmt_act *want = malloc((qn > kvn ? qn : kvn) * 2);
  NMT_ASSERT(ctx && qh && kvh && oh && qv && kvv && ov && probs && probs2 && douth && dqh && dkvh &&
             doutv && dq && dkv && dprobs && want);
  rand_half(bf16, qh, qv, qn, 1.0f, 1);
  if (cross) rand_half(bf16, kvh, kvv, kvn, 1.0f, 2);
  const nmt_act *kh = cross ? kvh : qh + C, *vh = cross ? kvh + C : qh + 2 * C;
  const float *kf = cross ? kvv : qv + C, *vf = cross ? kvv + C : qv + 2 * C;
  NMT_ASSERT_OK(nmt_ref_attention_half_fwd(ctx, oh, probs, qh, ldq, kh, vh, ldkv, lens, B, Tq, Tk,
                                           H, dk, causal, p, 5, 6));
  NMT_ASSERT_OK(nmt_ref_attention_fwd(ctx, ov, probs2, qv, ldq, kf, vf, ldkv, lens, B, Tq, Tk, H,
                                      dk, causal, p, 5, 6));
  nmt_half_encode_array(bf16, want, ov, nq * C);
  if (!bits_equal("attention_half_fwd out", oh, want, nq * C) ||
      !floats_equal("attention_half_fwd probs", probs, probs2, (size_t)B * H * Tq * Tk))
    goto out;
  rand_half(bf16, douth, doutv, nq * C, 1.0f, 3);
  /* The gradients are written: poison first. */
  memset(dqh, 0xff, qn * 2);
  if (cross) memset(dkvh, 0xff, kvn * 2);
  nmt_act *dkh = cross ? dkvh : dqh + C, *dvh = cross ? dkvh + C : dqh + 2 * C;
  NMT_ASSERT_OK(nmt_ref_attention_half_bwd(ctx, dqh, dkh, dvh, dprobs, douth, probs, qh, ldq, kh, vh,
                                           ldkv, lens, B, Tq, Tk, H, dk, causal, p, 5, 6));
  memset(dq, 0, qn * 4);
  if (cross) memset(dkv, 0, kvn * 4);
  float *dkf = cross ? dkv : dq + C, *dvf = cross ? dkv + C : dq + 2 * C;
  NMT_ASSERT_OK(nmt_ref_attention_bwd(ctx, dq, dkf, dvf, dprobs, doutv, probs2, qv, ldq, kf, vf,
                                      ldkv, lens, B, Tq, Tk, H, dk, causal, p, 5, 6));
  /* Compare the head columns of every row (the rest of a fused row is another tensor's). */
  for (size_t r = 0; r < nq; r++) {
    nmt_half_encode_array(bf16, want, dq + r * ldq, (size_t)C);
    if (!bits_equal("attention_half_bwd dq", dqh + r * ldq, want, (size_t)C)) goto out;
  }
  for (size_t r = 0; r < nk; r++) {
    nmt_half_encode_array(bf16, want, dkf + r * ldkv, (size_t)C);
    if (!bits_equal("attention_half_bwd dk", dkh + r * ldkv, want, (size_t)C)) goto out;
    nmt_half_encode_array(bf16, want, dvf + r * ldkv, (size_t)C);
    if (!bits_equal("attention_half_bwd dv", dvh + r * ldkv, want, (size_t)C)) goto out;
  }
out:
  free(qh), free(oh), free(qv), free(ov), free(probs), free(probs2), free(douth), free(dqh);
  free(doutv), free(dq), free(dprobs), free(want);
  if (cross) free(kvh), free(kvv), free(dkvh), free(dkv);
  nmt_ref_ctx_destroy(ctx);
}

NMT_TEST(half_ops_attention) {
  for (int k = 0; k < 2; k++) {
    attention_case(MODES[k], 0, 0, 0.0f);
    attention_case(MODES[k], 1, 0, 0.2f);
    attention_case(MODES[k], 0, 1, 0.1f);
  }
}

static void residual_case(nmt_precision mode, int post, float p) {
  const int bf16 = mode == NMT_PRECISION_BF16;
  const int M = 6, C = 20;
  const size_t n = (size_t)M * C;
  void *ctx = half_ctx(mode);
  float *x = malloc(n * 4), *yv = malloc(n * 4), *g = malloc(C * 4), *bt = malloc(C * 4);
  float *out = malloc(n * 4), *sum = malloc(n * 4), *mean = malloc(M * 4), *rstd = malloc(M * 4);
  float *out2 = malloc(n * 4), *sum2 = malloc(n * 4), *mean2 = malloc(M * 4),
        *rstd2 = malloc(M * 4);
  nmt_act *yh = malloc(n * 2), *outh = malloc(n * 2), *want = malloc(n * 2), *dyh = malloc(n * 2);
  float *dout = malloc(n * 4), *dx = malloc(n * 4), *dx2 = malloc(n * 4), *dy2 = malloc(n * 4);
  float *dg = calloc(C, 4), *db = calloc(C, 4), *dg2 = calloc(C, 4), *db2 = calloc(C, 4);
  NMT_ASSERT(ctx && x && yv && g && bt && out && sum && mean && rstd && out2 && sum2 && mean2 &&
             rstd2 && yh && outh && want && dyh && dout && dx && dx2 && dy2 && dg && db && dg2 &&
             db2);
  randn(x, n, 2.0f, 1);
  rand_half(bf16, yh, yv, n, 1.0f, 2);
  randn(g, C, 1.0f, 3);
  randn(bt, C, 0.5f, 4);
  NMT_ASSERT_OK(nmt_ref_residual_ln_half_fwd(ctx, post ? out : NULL, post ? outh : NULL, sum, mean,
                                             rstd, x, yh, post ? g : NULL, bt, M, C, 1e-5f, p, 9,
                                             10));
  NMT_ASSERT_OK(nmt_ref_residual_dropout_ln_fwd(NULL, post ? out2 : NULL, sum2, mean2, rstd2, x, yv,
                                                post ? g : NULL, bt, M, C, 1e-5f, p, 9, 10));
  if (!floats_equal("residual_ln_half_fwd sum", sum, sum2, n)) goto out;
  if (post) {
    nmt_half_encode_array(bf16, want, out2, n);
    if (!floats_equal("residual_ln_half_fwd out", out, out2, n) ||
        !floats_equal("residual_ln_half_fwd mean", mean, mean2, (size_t)M) ||
        !bits_equal("residual_ln_half_fwd out_h", outh, want, n))
      goto out;
    randn(dout, n, 1.0f, 5);
    randn(dx, n, 1.0f, 6); /* written over */
    NMT_ASSERT_OK(nmt_ref_residual_ln_half_bwd(ctx, dx, dyh, dg, db, dout, sum, g, mean, rstd, M, C,
                                               p, 9, 10));
    memset(dx2, 0, n * 4);
    memset(dy2, 0, n * 4);
    NMT_ASSERT_OK(nmt_ref_residual_dropout_ln_bwd(NULL, dx2, dy2, dg2, db2, dout, sum2, g, mean2,
                                                  rstd2, M, C, p, 9, 10));
    nmt_half_encode_array(bf16, want, dy2, n);
    if (!floats_equal("residual_ln_half_bwd dx", dx, dx2, n) ||
        !bits_equal("residual_ln_half_bwd dy", dyh, want, n) ||
        !floats_equal("residual_ln_half_bwd dgamma", dg, dg2, (size_t)C) ||
        !floats_equal("residual_ln_half_bwd dbeta", db, db2, (size_t)C))
      goto out;
  }
out:
  free(x), free(yv), free(g), free(bt), free(out), free(sum), free(mean), free(rstd), free(out2);
  free(sum2), free(mean2), free(rstd2), free(yh), free(outh), free(want), free(dyh), free(dout);
  free(dx), free(dx2), free(dy2), free(dg), free(db), free(dg2), free(db2);
  nmt_ref_ctx_destroy(ctx);
}

NMT_TEST(half_ops_residual_ln) {
  for (int k = 0; k < 2; k++) {
    residual_case(MODES[k], 1, 0.0f);
    residual_case(MODES[k], 1, 0.1f);
    residual_case(MODES[k], 0, 0.1f);
  }
}

NMT_TEST(half_ops_layernorm) {
  for (int k = 0; k < 2; k++) {
    const int bf16 = MODES[k] == NMT_PRECISION_BF16;
    enum { M = 5, C = 24 };
    const size_t n = (size_t)M * C;
    void *ctx = half_ctx(MODES[k]);
    float x[M * C], g[C], b[C], out[M * C], mean[M], rstd[M], mean2[M], rstd2[M];
    float dout[M * C], dx[M * C], dx2[M * C], dg[C] = {0}, db[C] = {0}, dg2[C] = {0}, db2[C] = {0};
    nmt_act oh[M * C], want[M * C], dxh[M * C];
    NMT_ASSERT(ctx);
    randn(x, n, 3.0f, 1);
    randn(g, C, 1.0f, 2);
    randn(b, C, 1.0f, 3);
    NMT_ASSERT_OK(nmt_ref_layernorm_half_fwd(ctx, oh, mean, rstd, x, g, b, M, C, 1e-5f));
    NMT_ASSERT_OK(nmt_ref_layernorm_fwd(NULL, out, mean2, rstd2, x, g, b, M, C, 1e-5f));
    nmt_half_encode_array(bf16, want, out, n);
    if (!bits_equal("layernorm_half_fwd", oh, want, n) ||
        !floats_equal("layernorm_half_fwd rstd", rstd, rstd2, M))
      goto done;
    for (int acc = 0; acc < 2; acc++) {
      randn(dout, n, 1.0f, 4);
      randn(dx, n, 1.0f, 5);
      memcpy(dx2, dx, sizeof dx);
      if (!acc) memset(dx2, 0, sizeof dx2);
      NMT_ASSERT_OK(nmt_ref_layernorm_half_bwd(ctx, dx, acc, dxh, dg, db, dout, x, g, mean, rstd,
                                               M, C));
      NMT_ASSERT_OK(nmt_ref_layernorm_bwd(NULL, dx2, dg2, db2, dout, x, g, mean, rstd, M, C));
      nmt_half_encode_array(bf16, want, dx2, n);
      if (!floats_equal(acc ? "layernorm_half_bwd dinp +=" : "layernorm_half_bwd dinp =", dx, dx2,
                        n) ||
          !bits_equal("layernorm_half_bwd dinp_h", dxh, want, n) ||
          !floats_equal("layernorm_half_bwd dgamma", dg, dg2, C))
        goto done;
    }
  done:
    nmt_ref_ctx_destroy(ctx);
  }
}

NMT_TEST(half_ops_xent) {
  for (int k = 0; k < 2; k++) {
    const int bf16 = MODES[k] == NMT_PRECISION_BF16;
    enum { M = 6, V = 40 };
    void *ctx = half_ctx(MODES[k]);
    nmt_act lh[M * V], want[M * V];
    float lv[M * V], loss[M], nll[M], loss2[M], nll2[M];
    int32_t t[M] = {5, NMT_PAD_ID, 39, 4, 7, 12};
    NMT_ASSERT(ctx);
    rand_half(bf16, lh, lv, M * V, 4.0f, 1);
    const float scale = 1024.0f;
    NMT_ASSERT_OK(nmt_ref_xent_half_fwd_bwd(ctx, lh, loss, nll, t, M, V, 0.1f, 1.0f, &scale, 1));
    NMT_ASSERT_OK(nmt_ref_xent_fwd_bwd(NULL, lv, loss2, nll2, t, M, V, 0.1f, 1.0f, &scale, 1));
    nmt_half_encode_array(bf16, want, lv, M * V);
    if (!floats_equal("xent_half loss", loss, loss2, M) ||
        !floats_equal("xent_half nll", nll, nll2, M) ||
        !bits_equal("xent_half gradient", lh, want, M * V)) {
      nmt_ref_ctx_destroy(ctx);
      return;
    }
    /* A bad target leaves the logits intact. */
    nmt_act keep[M * V];
    memcpy(keep, lh, sizeof keep);
    t[3] = V;
    NMT_ASSERT_EQ_STATUS(nmt_ref_xent_half_fwd_bwd(ctx, lh, loss, nll, t, M, V, 0.1f, 1.0f, NULL, 1),
                         NMT_ERR_INTERNAL);
    NMT_ASSERT(!memcmp(keep, lh, sizeof keep));
    nmt_ref_ctx_destroy(ctx);
  }
}

NMT_TEST(half_ops_fp16_classifier_gradient_overflows) {
  /* fp16: the scaled gradient of the target's logit, ~ -0.9 x 2^17, is past 65504: -inf. */
  void *ctx = half_ctx(NMT_PRECISION_FP16);
  enum { V = 16 };
  nmt_act lh[V];
  float lv[V], loss, nll;
  const int32_t t = 4;
  NMT_ASSERT(ctx);
  memset(lv, 0, sizeof lv);
  nmt_half_encode_array(0, lh, lv, V);
  const float scale = 0x1p17f;
  NMT_ASSERT_OK(nmt_ref_xent_half_fwd_bwd(ctx, lh, &loss, &nll, &t, 1, V, 0.1f, 1.0f, &scale, 1));
  NMT_ASSERT(isinf(nmt_half_fp16_value(lh[t])) && nmt_half_fp16_value(lh[t]) < 0);
  NMT_ASSERT(isfinite(nmt_half_fp16_value(lh[0])));
  nmt_ref_ctx_destroy(ctx);
}

NMT_TEST(half_ops_embedding_and_dropout) {
  for (int k = 0; k < 2; k++) {
    const int bf16 = MODES[k] == NMT_PRECISION_BF16;
    enum { V = 9, C = 12, T = 4, R = 8 };
    void *ctx = half_ctx(MODES[k]);
    float wte[V * C], pos[T * C], out[R * C], out2[R * C], x[R * C];
    nmt_act oh[R * C], want[R * C], xh[R * C], dh[R * C];
    const int32_t ids[R] = {1, 2, 3, 0, 4, 8, 8, 5};
    NMT_ASSERT(ctx);
    randn(wte, V * C, 1.0f, 1);
    randn(pos, T * C, 1.0f, 2);
    NMT_ASSERT_OK(nmt_ref_embedding_half_fwd(ctx, out, oh, ids, wte, pos, R, T, C, 3.0f, 0.25f, 3,
                                             4));
    NMT_ASSERT_OK(nmt_ref_embedding_fwd(NULL, out2, ids, wte, pos, R, T, C, 3.0f));
    NMT_ASSERT_OK(nmt_ref_dropout_fwd(NULL, out2, out2, R * C, 0.25f, 3, 4));
    nmt_half_encode_array(bf16, want, out2, R * C);
    if (!floats_equal("embedding_half_fwd out", out, out2, R * C) ||
        !bits_equal("embedding_half_fwd out_h", oh, want, R * C))
      goto next;
    /* dropout_half from half (in place) and from fp32, as dropout_fwd then one rounding. */
    rand_half(bf16, xh, x, R * C, 2.0f, 5);
    NMT_ASSERT_OK(nmt_ref_dropout_fwd(NULL, out2, x, R * C, 0.3f, 6, 7));
    nmt_half_encode_array(bf16, want, out2, R * C);
    NMT_ASSERT_OK(nmt_ref_dropout_half(ctx, xh, xh, 0, R * C, 0.3f, 6, 7));
    if (!bits_equal("dropout_half in place", xh, want, R * C)) goto next;
    randn(x, R * C, 2.0f, 8);
    NMT_ASSERT_OK(nmt_ref_dropout_fwd(NULL, out2, x, R * C, 0.3f, 6, 7));
    nmt_half_encode_array(bf16, want, out2, R * C);
    NMT_ASSERT_OK(nmt_ref_dropout_half(ctx, dh, x, 1, R * C, 0.3f, 6, 7));
    if (!bits_equal("dropout_half from fp32", dh, want, R * C)) goto next;
    nmt_half_encode_array(bf16, want, x, R * C);
    NMT_ASSERT_OK(nmt_ref_dropout_half(ctx, dh, x, 1, R * C, 0.0f, 6, 7));
    if (!bits_equal("dropout_half p = 0 (the rounding alone)", dh, want, R * C)) goto next;
  next:
    nmt_ref_ctx_destroy(ctx);
    if (nmt_test_failed()) return;
  }
}
