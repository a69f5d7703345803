/* test/test_cuda_gemm.c — the bias and ReLU epilogues of cuda/gemm.cu, reached through the
 * table's matmul_fwd with a bias and matmul_bias_relu_fwd (hence the tests' cuda_matmul_
 * names), in all four precision modes, with the bias on both sides of the 16-byte rule (the
 * epilogue path and the unfused fallback), against the reference (src/ref/matmul.c) in the
 * device's mode. Harness and tolerance: test/gpu_helpers.h. And, without a device, the GEMM
 * cache's size buckets and bucketed keys (nmt/cuda.h), which decide how often cuBLASLt's
 * heuristic runs, with the half-storage path's words (16-bit output, the ReLU mask, the bias
 * batch stride). The half-storage epilogues themselves (half bias, RELU_AUX_BIAS, DRELU,
 * BGRADB, the batched bias) are held to the reference through linear_half_fwd/bwd in
 * test/test_cuda_matmul.c. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "nmt/cuda.h"

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/ref.h"
#include "test.h"

/* Bias and ReLU epilogues (cuda/gemm.cu): matmul_fwd with a bias and matmul_bias_relu_fwd,
 * with the bias at 0, 1, 2 and 4 floats past cudaMalloc's 256-byte boundary: 16-byte aligned
 * (the epilogue path, where cuBLASLt has an algorithm) and 4- or 8-byte aligned (the unfused
 * fallback; the model's biases are slices of the flat parameter buffer), and the ReLU without
 * a bias; each against the reference in the device's mode (a NULL ref_ctx: fp32), poisoned
 * output first, |gpu - ref| <= rtol (max|ref| + |ref|) with the worst index reported. K = 0
 * (bias only) and N = 1 included. A ReLU output must also never be negative. */
static void epilogue_cases(nmt_tg_gpu *g, nmt_precision mode, const char *mode_name, double rtol,
                           uint64_t seed0) {
  static const int shapes[][3] = {{37, 64, 96}, {1, 32, 50}, {130, 200, 70}, {5, 0, 7},
                                  {33, 17, 1},  {256, 512, 1024}};
  static const int bias_offs[] = {0, 1, 2, 4}; /* floats; -1 below: no bias */
  void *rc = NULL;
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, mode));
  if (mode == NMT_PRECISION_FP16 || mode == NMT_PRECISION_BF16) {
    NMT_ASSERT_OK(nmt_ref_ctx_create(0, &rc));
    nmt_status s = nmt_ref_set_precision(rc, mode);
    if (s != NMT_OK) nmt_ref_ctx_destroy(rc);
    NMT_ASSERT_OK(s);
  }
  char what[128];
  for (size_t i = 0; i < sizeof shapes / sizeof *shapes && !nmt_test_failed(); i++) {
    const int M = shapes[i][0], K = shapes[i][1], N = shapes[i][2];
    const size_t ni = (size_t)M * K, nw = (size_t)N * K, no = (size_t)M * N;
    const uint64_t seed = seed0 + 10 * i;
    float *inp = nmt_tg_randn(g, ni, seed, 1.0f, 0.0f),
          *w = nmt_tg_randn(g, nw, seed + 1, 0.2f, 0.0f);
    float *bias = nmt_tg_randn(g, (size_t)N, seed + 2, 1.0f, 0.0f),
          *want = nmt_tg_halloc(g, no * 4 + 4);
    float *d_inp = nmt_tg_dup_dev(g, inp, ni * 4), *d_w = nmt_tg_dup_dev(g, w, nw * 4);
    float *d_bias0 = nmt_tg_dalloc(g, ((size_t)N + 4) * 4), *d_out = nmt_tg_dalloc(g, no * 4);
    if (nmt_test_failed()) break;
    for (int relu = 0; relu < 2 && !nmt_test_failed(); relu++) {
      for (int b = relu ? -1 : 0; b < 4 && !nmt_test_failed(); b++) {
        const int off = b < 0 ? -1 : bias_offs[b];
        float *d_bias = off < 0 ? NULL : d_bias0 + off;
        if (d_bias && g->be->copy_h2d(g->ctx, d_bias, bias, (size_t)N * 4) != NMT_OK) {
          nmt_test_fail(__FILE__, __LINE__, "copy_h2d: %s", nmt_last_error());
          break;
        }
        const float *h_bias = d_bias ? bias : NULL;
        nmt_tg_poison(g, d_out, no);
        nmt_status sg, sr;
        if (relu) {
          sg = g->be->matmul_bias_relu_fwd(g->ctx, d_out, d_inp, d_w, d_bias, M, K, N);
          sr = nmt_ref_matmul_bias_relu_fwd(rc, want, inp, w, h_bias, M, K, N);
        } else {
          sg = g->be->matmul_fwd(g->ctx, d_out, d_inp, d_w, d_bias, M, K, N);
          sr = nmt_ref_matmul_fwd(rc, want, inp, w, h_bias, M, K, N);
        }
        snprintf(what, sizeof what, "%s %s M=%d K=%d N=%d bias %s%d", mode_name,
                 relu ? "matmul_bias_relu_fwd" : "matmul_fwd", M, K, N,
                 off < 0 ? "none" : "+", off < 0 ? 0 : 4 * off);
        if (sg != NMT_OK || sr != NMT_OK) {
          nmt_test_fail(__FILE__, __LINE__, "%s: device %s, ref %s: %s", what,
                        nmt_status_str(sg), nmt_status_str(sr), nmt_last_error());
          break;
        }
        const float *got = nmt_tg_fetch(g, d_out, no * 4);
        if (!got || !nmt_test_close(__FILE__, __LINE__, what, got, want, no,
                                    rtol * nmt_tg_max_abs(want, no), rtol))
          break;
        size_t negative = 0;
        for (size_t e = 0; relu && e < no; e++) negative += got[e] < 0.0f;
        if (negative)
          nmt_test_fail(__FILE__, __LINE__, "%s: %zu negative outputs after the ReLU", what,
                        negative);
      }
    }
  }
  nmt_ref_ctx_destroy(rc);
}

NMT_TG_TEST(cuda_matmul_epilogue_fp32_matches_ref) {
  epilogue_cases(g, NMT_PRECISION_FP32, "fp32", 1e-4, 800);
}
NMT_TG_TEST(cuda_matmul_epilogue_tf32_matches_ref) {
  epilogue_cases(g, NMT_PRECISION_TF32, "tf32", 1e-3, 900);
}
NMT_TG_TEST(cuda_matmul_epilogue_fp16_matches_ref) {
  epilogue_cases(g, NMT_PRECISION_FP16, "fp16", 1e-2, 1000);
}
NMT_TG_TEST(cuda_matmul_epilogue_bf16_matches_ref) {
  epilogue_cases(g, NMT_PRECISION_BF16, "bf16", 1e-2, 1100);
}

/* nmt_cuda_gemm_bucket: >= x, at most 12.5% above it, non-decreasing, idempotent, exact up
 * to 16 and on the model's fixed sizes; few buckets per octave (the point: token counts of
 * 1000..8000 give 25 heuristic queries, not 7000). */
NMT_TEST(gemm_cache_bucket_sizes) {
  int64_t prev = 0, distinct = 0, last = -1;
  for (int64_t x = 1; x <= 200000; x++) {
    const int64_t b = nmt_cuda_gemm_bucket(x);
    if (b < x || b < prev || nmt_cuda_gemm_bucket(b) != b || (x > 16 && 8 * b > 9 * x + 8) ||
        (x <= 16 && b != x)) {
      nmt_test_fail(__FILE__, __LINE__, "bucket(%lld) = %lld (previous bucket %lld)",
                    (long long)x, (long long)b, (long long)prev);
      return;
    }
    prev = b;
    if (x >= 1000 && x <= 8000 && b != last) distinct++, last = b;
  }
  NMT_ASSERT(distinct <= 25);
  const int64_t fixed[] = {64, 512, 1536, 2048, 4096};
  for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++)
    NMT_ASSERT_EQ_INT(nmt_cuda_gemm_bucket(fixed[i]), fixed[i]);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_bucket(3000), 3072);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_bucket(8000), 8192);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_bucket(0), 0);
}

/* The bucketed key: two linear layers whose token counts share a bucket share the key, as do
 * two attention products over different sentence lengths and B*H in one bucket; transposes,
 * types, alignments and the epilogue are never merged; a leading dimension keeps covering
 * its rows. */
NMT_TEST(gemm_cache_bucket_key) {
  /* transa, transb, m, n, k, lda, ldb, ldc, sA, sB, sC, batch, ct, al_a, al_b, al_c, type, epi,
   * al_bias, output type, al_aux, bias stride: a linear forward y^T (N x M) = W (N x K) x^T,
   * M = 3000 tokens */
  const int64_t a[NMT_CUDA_GEMM_KEY] = {1, 0, 512, 3000, 2048, 2048, 2048, 512, 0, 0, 0, 1,
                                        68, 256, 256, 256, 0, 1, 256, 0, 0, 0};
  int64_t b[NMT_CUDA_GEMM_KEY], ka[NMT_CUDA_GEMM_KEY], kb[NMT_CUDA_GEMM_KEY];
  memcpy(b, a, sizeof b);
  b[3] = 3050; /* another batch's token count, same bucket (3072) */
  nmt_cuda_gemm_bucket_key(a, ka);
  nmt_cuda_gemm_bucket_key(b, kb);
  NMT_ASSERT(memcmp(ka, kb, sizeof ka) == 0);
  NMT_ASSERT_EQ_INT(ka[3], 3072);
  NMT_ASSERT_EQ_INT(ka[2], 512);
  b[3] = 3100; /* the next bucket */
  nmt_cuda_gemm_bucket_key(b, kb);
  NMT_ASSERT(memcmp(ka, kb, sizeof ka) != 0);
  /* every non-size word keeps the key apart */
  const int apart[] = {0, 1, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21};
  for (size_t i = 0; i < sizeof apart / sizeof *apart; i++) {
    memcpy(b, a, sizeof b);
    b[apart[i]] += apart[i] >= 13 && apart[i] <= 15 ? -128 : 1;
    nmt_cuda_gemm_bucket_key(b, kb);
    if (!memcmp(ka, kb, sizeof ka))
      nmt_test_fail(__FILE__, __LINE__, "key word %d merged by the bucket", apart[i]);
  }
  /* attention scores S^T (Tk x Tq) = Kh^T Qh per (b, h): batch B*H, strides by T */
  const int64_t att1[NMT_CUDA_GEMM_KEY] = {1, 0, 34, 34, 64, 64, 64, 34, 34 * 64, 34 * 64,
                                           34 * 34, 8 * 90, 68, 4, 4, 4, 0, 0, 0, 0, 0, 0};
  const int64_t att2[NMT_CUDA_GEMM_KEY] = {1, 0, 35, 35, 64, 64, 64, 35, 35 * 64, 35 * 64,
                                           35 * 35, 8 * 92, 68, 4, 4, 4, 0, 0, 0, 0, 0, 0};
  nmt_cuda_gemm_bucket_key(att1, ka);
  nmt_cuda_gemm_bucket_key(att2, kb);
  NMT_ASSERT(memcmp(ka, kb, sizeof ka) == 0);
  /* bucketed leading dimensions still cover the bucketed rows (ldc >= m, lda >= k here) */
  NMT_ASSERT(ka[7] >= ka[2] && ka[5] >= ka[4]);
}

/* nmt_cuda_gemm_alignment, the key's alignment words: the largest power of two (element size
 * to 256 bytes) common to the pointer, the leading dimension in bytes and, in a batch, the
 * stride in bytes. The leading dimension is what the cache used to miss: a 256-byte aligned
 * pointer with ld = 513 floats has 4-byte aligned columns, and its key must not share the
 * alignment word (and so the algorithm) of ld = 512. */
NMT_TEST(gemm_cache_key_alignment) {
  const uintptr_t p256 = 0x7f0000010000u; /* cudaMalloc's 256-byte boundary */
  /* fp32: ld alone decides below the pointer's alignment */
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 512, 0, 1, 4), 256);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 513, 0, 1, 4), 4);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 514, 0, 1, 4), 8);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 516, 0, 1, 4), 16);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 1001, 0, 1, 4), 4);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 1024, 0, 1, 4), 256); /* 1001's bucket */
  /* fp16/bf16 (2-byte elements): 8 elements are 16 bytes, an odd ld is 2 */
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 8, 0, 1, 2), 16);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 9, 0, 1, 2), 2);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 2048, 0, 1, 2), 256);
  /* the pointer still bounds it (a column slice of the fused QKV buffer) */
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256 + 4, 512, 0, 1, 4), 4);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256 + 32, 512, 0, 1, 4), 32);
  /* batch strides count only in a batch */
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 64, 34 * 64, 8, 4), 256);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 64, 35 * 35, 8, 4), 4);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 64, 35 * 35, 1, 4), 256);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 64, 100, 2, 4), 16);
  /* a vector (the bias): the pointer alone */
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256 + 16, 0, 0, 1, 4), 16);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256 + 8, 0, 0, 1, 4), 8);
  /* two shapes of one bucket (ld 1000 and 1001 floats -> 1024) keep distinct words, so the
   * bucketed keys differ and the bucket's algorithm is chosen for each alignment apart */
  int64_t a[NMT_CUDA_GEMM_KEY] = {1, 0, 512, 3000, 1000, 1000, 1000, 512, 0, 0, 0, 1,
                                  68, 0, 256, 256, 0, 0, 0, 0, 0, 0};
  int64_t b[NMT_CUDA_GEMM_KEY], ka[NMT_CUDA_GEMM_KEY], kb[NMT_CUDA_GEMM_KEY];
  memcpy(b, a, sizeof b);
  b[4] = b[5] = 1001;
  a[13] = nmt_cuda_gemm_alignment(p256, a[5], 0, 1, 4);
  b[13] = nmt_cuda_gemm_alignment(p256, b[5], 0, 1, 4);
  nmt_cuda_gemm_bucket_key(a, ka);
  nmt_cuda_gemm_bucket_key(b, kb);
  NMT_ASSERT_EQ_INT(ka[5], kb[5]); /* same bucketed ld */
  NMT_ASSERT(memcmp(ka, kb, sizeof ka) != 0);
}

/* The half-storage path's words (cuda/gemm.cu: the output type, the mask's alignment, the
 * bias batch stride). The decoder's cross-attention K/V projections of all layers as one
 * batched GEMM with a half bias: two source lengths of one bucket share the bucketed key, the
 * weight stride (a size) is bucketed but the bias batch stride is not (it is no dimension of
 * the problem and is set on the descriptor as it is); fp16 vs bf16 output, a mask's
 * alignment and the stride keep keys apart. The alignment words of a batched half bias and of
 * the ReLU mask (bytes, ld = 128-bit rows). */
NMT_TEST(gemm_cache_key_half_epilogues) {
  const uintptr_t p256 = 0x7f0000010000u;
  /* CUDA_R_16F = 2, CUDA_R_16BF = 14, CUBLAS_COMPUTE_32F = 68, NMT_CUDA_EPI_BIAS = 1 */
  const int64_t stride = 1050624; /* floats between two layers' weights */
  const int64_t a[NMT_CUDA_GEMM_KEY] = {1, 0, 1024, 3000, 512, 512, 512, 1024, stride, 0,
                                        4096 * 1024, 6, 68, 256, 256, 256, 2, 1, 256, 2, 0,
                                        stride};
  int64_t b[NMT_CUDA_GEMM_KEY], ka[NMT_CUDA_GEMM_KEY], kb[NMT_CUDA_GEMM_KEY];
  memcpy(b, a, sizeof b);
  b[3] = 3050;
  nmt_cuda_gemm_bucket_key(a, ka);
  nmt_cuda_gemm_bucket_key(b, kb);
  NMT_ASSERT(memcmp(ka, kb, sizeof ka) == 0);
  NMT_ASSERT_EQ_INT(ka[21], stride);             /* the bias stride as it is */
  NMT_ASSERT(ka[8] == nmt_cuda_gemm_bucket(stride)); /* the weight stride bucketed */
  NMT_ASSERT(ka[8] != stride);
  const int words[] = {19, 20, 21};
  for (size_t i = 0; i < sizeof words / sizeof *words; i++) {
    memcpy(b, a, sizeof b);
    b[words[i]] = words[i] == 19 ? 14 : words[i] == 20 ? 16 : stride + 8;
    nmt_cuda_gemm_bucket_key(b, kb);
    if (!memcmp(ka, kb, sizeof ka))
      nmt_test_fail(__FILE__, __LINE__, "key word %d merged by the bucket", words[i]);
  }
  /* a batched half bias: the slices are 2 x stride bytes apart */
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 0, stride, 6, 2), 256);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 0, stride + 4, 6, 2), 8);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 0, stride + 1, 6, 2), 2); /* unfused */
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256 + 2 * 512, 0, stride, 1, 2), 256);
  /* the ReLU mask: ld = m rounded up to 128 bits, in bytes (16 per 128 rows) */
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 2048 / 8, 0, 1, 1), 256);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256, 128 / 8, 0, 1, 1), 16);
  NMT_ASSERT_EQ_INT(nmt_cuda_gemm_alignment(p256 + 8, 2048 / 8, 0, 1, 1), 8); /* unfused */
  /* and the buffer the model allocates for it */
  NMT_ASSERT_EQ_INT((int)nmt_relu_mask_bytes(3, 2048), 3 * 256);
  NMT_ASSERT_EQ_INT((int)nmt_relu_mask_bytes(3, 2049), 3 * 272);
  NMT_ASSERT_EQ_INT((int)nmt_relu_mask_bytes(0, 2048), 0);
}
