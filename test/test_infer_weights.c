/* test/test_infer_weights.c — an inference context's weights on the reference backend
 * (nmt/backend.h infer_weights; src/ref/context.c, src/ref/matmul.c): the GEMMs that read the
 * transposed copy give the products of the plain ones (within fp32 reordering, for one row to
 * hundreds, bias and ReLU included, sub-matrices of a fused weight), the copy is what is read
 * (a write to the weights without a new call is not seen; the call after it is), a matrix
 * overlapping one copied in another shape is read from the weights, fp16/bf16 ignore the copy,
 * the errors. That a decoder searches the same with the copy as without it is
 * test/test_decode.c's decode_infer_weights_same_search. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

/* Uniform in [-1, 1): Philox (nmt/rng.h), a fresh counter for every value. */
static uint64_t draws;
static void fill(float *x, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = 2.0f * nmt_rng_uniform(29, 0, draws++) - 1.0f;
}

/* 1 when a and b (n) agree within 1e-5 of the row scale (K terms of magnitude <= 1), failing
 * the test naming the first element that does not. */
static int close_all(const char *what, const float *a, const float *b, size_t n, int K) {
  for (size_t i = 0; i < n; i++)
    if (!(fabsf(a[i] - b[i]) <= 1e-5f * (float)(K + 1))) {
      nmt_test_fail(__FILE__, __LINE__, "%s: element %zu: %.9g vs %.9g", what, i, (double)a[i],
                    (double)b[i]);
      return 0;
    }
  return 1;
}

/* The weights of a pretend model: a buffer of n floats with the matrix of each case at an
 * offset, so that the copy's offsets are exercised, not just its start. */
enum { PAD = 37 };

static void shape_case(void *ctx, int M, int K, int N, int relu) {
  const size_t n = PAD + (size_t)N * K + N + PAD;
  float *params = malloc(n * sizeof(float)), *inp = malloc((size_t)M * K * sizeof(float));
  float *want = malloc((size_t)M * N * sizeof(float)), *got = malloc((size_t)M * N * sizeof(float));
  fill(params, n);
  fill(inp, (size_t)M * K);
  const float *w = params + PAD, *bias = params + PAD + (size_t)N * K;
  nmt_status (*op)(void *, float *, const float *, const float *, const float *, int, int, int) =
      relu ? nmt_ref_matmul_bias_relu_fwd : nmt_ref_matmul_fwd;
  NMT_ASSERT_OK(op(ctx, want, inp, w, bias, M, K, N));
  NMT_ASSERT_OK(nmt_ref_infer_weights(ctx, params, n));
  /* Twice: the first call transposes the matrix, the second reads what it made. */
  for (int rep = 0; rep < 2; rep++) {
    memset(got, 0xff, (size_t)M * N * sizeof(float));
    NMT_ASSERT_OK(op(ctx, got, inp, w, bias, M, K, N));
    if (!close_all(relu ? "bias_relu" : "matmul", got, want, (size_t)M * N, K)) break;
  }
  NMT_ASSERT(nmt__ref_infer_copy(ctx, w, N, K) != NULL);
  NMT_ASSERT_OK(nmt_ref_infer_weights(ctx, NULL, 0));
  free(params), free(inp), free(want), free(got);
}

NMT_TEST(infer_weights_same_products) {
  void *ctx;
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &ctx));
  static const int Ms[] = {1, 2, 3, 5, 17, 64, 130}, Ks[] = {1, 7, 64, 300}, Ns[] = {1, 5, 33, 200};
  for (size_t a = 0; a < sizeof Ms / sizeof *Ms; a++)
    for (size_t b = 0; b < sizeof Ks / sizeof *Ks; b++)
      for (size_t c = 0; c < sizeof Ns / sizeof *Ns; c++) {
        shape_case(ctx, Ms[a], Ks[b], Ns[c], 0);
        if (Ms[a] == 17) shape_case(ctx, Ms[a], Ks[b], Ns[c], 1);
      }
  nmt_ref_ctx_destroy(ctx);
}

/* The copy is what the GEMM reads: weights written after the call are not seen until the next
 * call (the decoder rig calls it at every load). */
NMT_TEST(infer_weights_copy_is_read_until_the_next_call) {
  enum { M = 6, K = 40, N = 24 };
  static float params[PAD + N * K], inp[M * K], old_out[M * N], new_out[M * N], got[M * N];
  void *ctx;
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &ctx));
  float *w = params + PAD;
  fill(params, sizeof params / sizeof *params);
  fill(inp, M * K);
  NMT_ASSERT_OK(nmt_ref_matmul_fwd(ctx, old_out, inp, w, NULL, M, K, N));
  NMT_ASSERT_OK(nmt_ref_infer_weights(ctx, params, sizeof params / sizeof *params));
  NMT_ASSERT_OK(nmt_ref_matmul_fwd(ctx, got, inp, w, NULL, M, K, N)); /* copies w */
  for (int i = 0; i < N * K; i++) w[i] = -w[i];
  NMT_ASSERT_OK(nmt_ref_matmul_fwd(NULL, new_out, inp, w, NULL, M, K, N)); /* no copy: plain */
  NMT_ASSERT_OK(nmt_ref_matmul_fwd(ctx, got, inp, w, NULL, M, K, N));
  close_all("stale copy", got, old_out, M * N, K);
  NMT_ASSERT_OK(nmt_ref_infer_weights(ctx, params, sizeof params / sizeof *params));
  NMT_ASSERT_OK(nmt_ref_matmul_fwd(ctx, got, inp, w, NULL, M, K, N));
  close_all("after the new call", got, new_out, M * N, K);
  /* Forgotten: the plain weights again (negated back, so the copy would be wrong). */
  NMT_ASSERT_OK(nmt_ref_infer_weights(ctx, NULL, 0));
  for (int i = 0; i < N * K; i++) w[i] = -w[i];
  NMT_ASSERT_OK(nmt_ref_matmul_fwd(ctx, got, inp, w, NULL, M, K, N));
  close_all("after forgetting", got, old_out, M * N, K);
  nmt_ref_ctx_destroy(ctx);
}

/* A fused weight read in parts (the decoder reads the self-attention's (3C, C) projection as
 * Q (C, C) and K/V (2C, C)): each part is its own matrix; the whole, read after them in
 * another shape over the same floats, comes from the weights, and so does a matrix that
 * straddles the end of the registered buffer. */
NMT_TEST(infer_weights_parts_and_overlaps) {
  enum { M = 5, C = 12 };
  static float params[3 * C * C], inp[M * C], want[M * 3 * C], got[M * 3 * C];
  void *ctx;
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &ctx));
  fill(params, 3 * C * C);
  fill(inp, M * C);
  NMT_ASSERT_OK(nmt_ref_infer_weights(ctx, params, 3 * C * C));
  const float *q = params, *kv = params + C * C;
  NMT_ASSERT(nmt__ref_infer_copy(ctx, q, C, C) != NULL);
  NMT_ASSERT(nmt__ref_infer_copy(ctx, kv, 2 * C, C) != NULL);
  NMT_ASSERT(nmt__ref_infer_copy(ctx, params, 3 * C, C) == NULL); /* overlaps both */
  NMT_ASSERT(nmt__ref_infer_copy(ctx, kv, 3 * C, C) == NULL);     /* past the end */
  NMT_ASSERT(nmt__ref_infer_copy(ctx, q, 0, C) == NULL);
  NMT_ASSERT(nmt__ref_infer_copy(NULL, q, C, C) == NULL);
  NMT_ASSERT_OK(nmt_ref_matmul_fwd(NULL, want, inp, params, NULL, M, C, 3 * C));
  NMT_ASSERT_OK(nmt_ref_matmul_fwd(ctx, got, inp, params, NULL, M, C, 3 * C));
  close_all("whole over parts", got, want, M * 3 * C, C);
  NMT_ASSERT_OK(nmt_ref_matmul_fwd(NULL, want, inp, kv, NULL, M, C, 2 * C));
  NMT_ASSERT_OK(nmt_ref_matmul_fwd(ctx, got, inp, kv, NULL, M, C, 2 * C));
  close_all("part", got, want, M * 2 * C, C);
  nmt_ref_ctx_destroy(ctx);
}

/* fp16/bf16 read the half copy or round w, never the fp32 transposed copy: bitwise the
 * results without a registration. */
NMT_TEST(infer_weights_half_modes_ignore_the_copy) {
  enum { M = 4, K = 32, N = 16 };
  static float params[N * K], inp[M * K], want[M * N], got[M * N];
  const nmt_precision modes[] = {NMT_PRECISION_FP16, NMT_PRECISION_BF16};
  fill(params, N * K);
  fill(inp, M * K);
  for (int i = 0; i < 2; i++) {
    void *ctx;
    NMT_ASSERT_OK(nmt_ref_ctx_create(0, &ctx));
    NMT_ASSERT_OK(nmt_ref_set_precision(ctx, modes[i]));
    NMT_ASSERT_OK(nmt_ref_matmul_fwd(ctx, want, inp, params, NULL, M, K, N));
    NMT_ASSERT_OK(nmt_ref_infer_weights(ctx, params, N * K));
    NMT_ASSERT_OK(nmt_ref_matmul_fwd(ctx, got, inp, params, NULL, M, K, N));
    NMT_ASSERT(memcmp(got, want, sizeof got) == 0);
    nmt_ref_ctx_destroy(ctx);
  }
}

NMT_TEST(infer_weights_errors) {
  float w[4] = {0};
  NMT_ASSERT_EQ_STATUS(nmt_ref_infer_weights(NULL, w, 4), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(nmt_ref_infer_weights(NULL, NULL, 0));
  void *ctx;
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &ctx));
  NMT_ASSERT_EQ_STATUS(nmt_ref_infer_weights(ctx, w, 0), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(nmt_ref_infer_weights(ctx, NULL, 0)); /* nothing registered: a no-op */
  NMT_ASSERT_OK(nmt_ref_infer_weights(ctx, w, 4));
  NMT_ASSERT_OK(nmt_ref_infer_weights(ctx, w, 2)); /* a smaller buffer keeps the copy's memory */
  NMT_ASSERT(nmt__ref_infer_copy(ctx, w + 2, 1, 2) == NULL); /* outside the 2 declared */
  NMT_ASSERT(nmt__ref_infer_copy(ctx, w, 1, 2) != NULL);
  /* A call that fails has still forgotten the earlier declaration: its weights are going. */
  NMT_ASSERT_EQ_STATUS(nmt_ref_infer_weights(ctx, w, 0), NMT_ERR_INTERNAL);
  NMT_ASSERT(nmt__ref_infer_copy(ctx, w, 1, 2) == NULL);
  nmt_ref_ctx_destroy(ctx); /* frees the copy (the leak checker of the ASan build sees it) */
  int other = 7;
  NMT_ASSERT_EQ_STATUS(nmt_ref_infer_weights(&other, w, 4), NMT_ERR_INTERNAL);
}
