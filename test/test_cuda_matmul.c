/* test/test_cuda_matmul.c — the linear layer (cuda/matmul.cu: matmul_fwd, matmul_bwd, the
 * fp16/bf16 input casts, cast_half and the toolkit's host conversions) against the reference
 * (src/ref/matmul.c), forward and backward, at column-slice offsets.
 *
 * Tolerance (NMT_TG_CLOSE, test/gpu_helpers.h): rtol = 1e-4 in fp32 and 1e-3 with TF32 GEMMs.
 * fp16/bf16 matmuls are compared with the reference emulating the same mode (a reference
 * context; nmt/ref.h) at rtol 1e-2, plus a check that the device really rounds; an fp16
 * overflow gives the same infinities. Roundings and cast_half's 16-bit patterns are held to
 * the reference's bitwise. The bias / ReLU epilogues: test/test_cuda_gemm.c; matmul through
 * the registered half copy: test/test_cuda_context.c. The half-storage path's linear layer
 * (linear_half_fwd / linear_half_bwd, with its epilogues on and off) at the end, with its own
 * tolerance note. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/half.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

/* ------------------------------------------------------------------------------------------ */
/* fp32 and TF32 */

/* One linear layer case on both backends; `off` shifts every device buffer by that many floats
 * (column slices in the model are only 4-byte aligned). The reference runs with `ref_ctx`:
 * NULL (fp32) or a reference context in the device's fp16/bf16 mode (the same rounding of the
 * GEMM inputs, emulated). */
static void matmul_case(nmt_tg_gpu *g, int M, int K, int N, int has_bias, int off, double rtol,
                        uint64_t seed, void *ref_ctx) {
  char what[112];
  const size_t ni = (size_t)M * K, nw = (size_t)N * K, no = (size_t)M * N;
  float *inp = nmt_tg_randn(g, ni, seed, 1.0f, 0.0f),
        *w = nmt_tg_randn(g, nw, seed + 1, 0.2f, 0.0f);
  float *bias = nmt_tg_randn(g, (size_t)N, seed + 2, 1.0f, 0.0f);
  float *dout = nmt_tg_randn(g, no, seed + 3, 1.0f, 0.0f);
  float *dinp = nmt_tg_randn(g, ni, seed + 4, 1.0f, 0.0f),
        *dw = nmt_tg_randn(g, nw, seed + 5, 1.0f, 0.0f);
  float *dbias = nmt_tg_randn(g, (size_t)N, seed + 6, 1.0f, 0.0f);
  float *want = nmt_tg_halloc(g, no * 4 + 4), *want_di = nmt_tg_hcopy(g, dinp, ni),
        *want_dw = nmt_tg_hcopy(g, dw, nw);
  float *want_db = nmt_tg_hcopy(g, dbias, (size_t)N);
  NMT_TG_SETUP_OK();
  const size_t o = (size_t)off;
  float *d_inp = nmt_tg_dalloc(g, (ni + o) * 4), *d_w = nmt_tg_dalloc(g, (nw + o) * 4);
  float *d_bias = nmt_tg_dalloc(g, ((size_t)N + o) * 4), *d_out = nmt_tg_dalloc(g, (no + o) * 4);
  float *d_dout = nmt_tg_dalloc(g, (no + o) * 4), *d_dinp = nmt_tg_dalloc(g, (ni + o) * 4);
  float *d_dw = nmt_tg_dalloc(g, (nw + o) * 4), *d_dbias = nmt_tg_dalloc(g, ((size_t)N + o) * 4);
  NMT_TG_SETUP_OK();
  d_inp += o, d_w += o, d_bias += o, d_out += o, d_dout += o, d_dinp += o, d_dw += o, d_dbias += o;
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_inp, inp, ni * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_w, w, nw * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_bias, bias, (size_t)N * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_dout, dout, no * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_dinp, dinp, ni * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_dw, dw, nw * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_dbias, dbias, (size_t)N * 4));
  nmt_tg_poison(g, d_out, no);
  NMT_ASSERT_OK(g->be->matmul_fwd(g->ctx, d_out, d_inp, d_w, has_bias ? d_bias : NULL, M, K, N));
  NMT_ASSERT_OK(nmt_ref_matmul_fwd(ref_ctx, want, inp, w, has_bias ? bias : NULL, M, K, N));
  snprintf(what, sizeof what, "matmul_fwd M=%d K=%d N=%d bias=%d off=%d", M, K, N, has_bias, off);
  NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_out, no * 4), want, no, rtol);
  NMT_ASSERT_OK(g->be->matmul_bwd(g->ctx, d_dinp, d_dw, has_bias ? d_dbias : NULL, d_dout, d_inp,
                                  d_w, M, K, N));
  NMT_ASSERT_OK(nmt_ref_matmul_bwd(ref_ctx, want_di, want_dw, has_bias ? want_db : NULL, dout,
                                   inp, w, M, K, N));
  snprintf(what, sizeof what, "matmul_bwd dinp M=%d K=%d N=%d off=%d", M, K, N, off);
  NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_dinp, ni * 4), want_di, ni, rtol);
  snprintf(what, sizeof what, "matmul_bwd dw M=%d K=%d N=%d off=%d", M, K, N, off);
  NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_dw, nw * 4), want_dw, nw, rtol);
  /* The bias gradient is a plain fp32 sum in every precision mode. */
  snprintf(what, sizeof what, "matmul_bwd dbias M=%d K=%d N=%d off=%d", M, K, N, off);
  NMT_TG_CLOSE(what, nmt_tg_fetch(g, d_dbias, (size_t)N * 4), want_db, (size_t)N, 1e-4);
}

static const int matmul_cases[][5] = {
    /* M, K, N, bias, offset */
    {37, 64, 96, 1, 0},   {1, 32, 50, 0, 0},   {130, 200, 70, 1, 1}, {256, 512, 1024, 1, 0},
    {64, 512, 1536, 1, 0}, {5, 0, 7, 1, 0},    {33, 17, 1, 1, 3},    {300, 96, 384, 0, 1},
};

NMT_TG_TEST(cuda_matmul_matches_ref) {
  for (size_t i = 0; i < sizeof matmul_cases / sizeof *matmul_cases; i++) {
    const int *c = matmul_cases[i];
    matmul_case(g, c[0], c[1], c[2], c[3], c[4], 1e-4, 100 + 10 * i, NULL);
    if (nmt_test_failed()) return;
  }
}

NMT_TG_TEST(cuda_matmul_tf32_matches_ref) {
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, NMT_PRECISION_TF32));
  for (size_t i = 0; i < sizeof matmul_cases / sizeof *matmul_cases; i++) {
    const int *c = matmul_cases[i];
    matmul_case(g, c[0], c[1], c[2], c[3], c[4], 1e-3, 200 + 10 * i, NULL);
    if (nmt_test_failed()) return;
  }
  /* An unknown mode is refused, not silently run in fp32. */
  NMT_ASSERT_EQ_STATUS(g->be->set_precision(g->ctx, (nmt_precision)7), NMT_ERR_CONFIG);
}

/* ------------------------------------------------------------------------------------------ */
/* fp16 and bf16 GEMM inputs */


/* fp16/bf16 (issue 3): the device's half-input GEMMs against the reference's emulation of the
 * same rounding (nmt/ref.h), |gpu - ref| <= 1e-2 (max|ref| + |ref|) with the worst index
 * reported. Both round the inputs identically (cuda_round_host_matches_ref) and the products
 * are exact, so only the order of the fp32 sums differs; to show that the device really rounds
 * (a plain fp32 GEMM would pass 1e-2 too), its distance to the emulation must also be under a
 * tenth of the emulation's distance to fp32. */
static void half_mode_cases(nmt_tg_gpu *g, nmt_precision mode, uint64_t seed0) {
  const char *name = mode == NMT_PRECISION_FP16 ? "fp16" : "bf16";
  void *rc = NULL;
  NMT_ASSERT_OK(g->be->set_precision(g->ctx, mode));
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &rc));
  nmt_status s = nmt_ref_set_precision(rc, mode);
  for (size_t i = 0; s == NMT_OK && i < sizeof matmul_cases / sizeof *matmul_cases; i++) {
    const int *c = matmul_cases[i];
    matmul_case(g, c[0], c[1], c[2], c[3], c[4], 1e-2, seed0 + 10 * i, rc);
    if (nmt_test_failed()) break;
  }
  nmt_ref_ctx_destroy(rc);
  NMT_ASSERT_OK(s);
  if (nmt_test_failed()) return;
  /* The rounding check on one case: device vs emulation vs fp32 reference, forward and dinp. */
  const int M = 130, K = 200, N = 70;
  const size_t ni = (size_t)M * K, nw = (size_t)N * K, no = (size_t)M * N;
  float *inp = nmt_tg_randn(g, ni, seed0 + 1000, 1.0f, 0.0f),
        *w = nmt_tg_randn(g, nw, seed0 + 1001, 0.2f, 0.0f);
  float *dout = nmt_tg_randn(g, no, seed0 + 1002, 1.0f, 0.0f);
  float *emu = nmt_tg_halloc(g, no * 4), *f32 = nmt_tg_halloc(g, no * 4);
  float *emu_d = nmt_tg_halloc(g, ni * 4), *f32_d = nmt_tg_halloc(g, ni * 4);
  NMT_TG_SETUP_OK();
  float *d_inp = nmt_tg_dup_dev(g, inp, ni * 4), *d_w = nmt_tg_dup_dev(g, w, nw * 4);
  float *d_dout = nmt_tg_dup_dev(g, dout, no * 4), *d_out = nmt_tg_dalloc(g, no * 4),
        *d_di = nmt_tg_dalloc(g, ni * 4);
  NMT_TG_SETUP_OK();
  nmt_tg_poison(g, d_out, no);
  NMT_ASSERT_OK(g->be->memset_zero(g->ctx, d_di, ni * 4));
  NMT_ASSERT_OK(g->be->matmul_fwd(g->ctx, d_out, d_inp, d_w, NULL, M, K, N));
  NMT_ASSERT_OK(g->be->matmul_bwd(g->ctx, d_di, NULL, NULL, d_dout, d_inp, d_w, M, K, N));
  memset(emu_d, 0, ni * 4);
  memset(f32_d, 0, ni * 4);
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &rc));
  s = nmt_ref_set_precision(rc, mode);
  if (s == NMT_OK) s = nmt_ref_matmul_fwd(rc, emu, inp, w, NULL, M, K, N);
  if (s == NMT_OK) s = nmt_ref_matmul_bwd(rc, emu_d, NULL, NULL, dout, inp, w, M, K, N);
  nmt_ref_ctx_destroy(rc);
  NMT_ASSERT_OK(s);
  NMT_ASSERT_OK(nmt_ref_matmul_fwd(NULL, f32, inp, w, NULL, M, K, N));
  NMT_ASSERT_OK(nmt_ref_matmul_bwd(NULL, f32_d, NULL, NULL, dout, inp, w, M, K, N));
  const float *got[2] = {nmt_tg_fetch(g, d_out, no * 4), nmt_tg_fetch(g, d_di, ni * 4)};
  const float *want[2] = {emu, emu_d}, *plain[2] = {f32, f32_d};
  const size_t len[2] = {no, ni};
  NMT_TG_SETUP_OK();
  for (int k = 0; k < 2; k++) {
    double to_emu = 0, emu_to_fp32 = 0;
    for (size_t i = 0; i < len[k]; i++) {
      to_emu = fmax(to_emu, fabs((double)got[k][i] - want[k][i]));
      emu_to_fp32 = fmax(emu_to_fp32, fabs((double)want[k][i] - plain[k][i]));
    }
    printf("# %s %s: max |device - emulation| %.3g, max |emulation - fp32| %.3g\n", name,
           k ? "dinp" : "out", to_emu, emu_to_fp32);
    NMT_ASSERT(emu_to_fp32 > 0);
    if (!(to_emu <= 0.1 * emu_to_fp32))
      nmt_test_fail(__FILE__, __LINE__, "%s %s: the device is %.3g from the emulation, not well "
                    "under the emulation's %.3g from fp32: are its GEMM inputs rounded?", name,
                    k ? "dinp" : "out", to_emu, emu_to_fp32);
  }
}

NMT_TG_TEST(cuda_matmul_fp16_matches_ref) { half_mode_cases(g, NMT_PRECISION_FP16, 500); }
NMT_TG_TEST(cuda_matmul_bf16_matches_ref) { half_mode_cases(g, NMT_PRECISION_BF16, 600); }

/* A value beyond fp16's range (1e5 > 65504) becomes inf in the GEMM input on the device as in
 * the emulation: the same outputs are infinite (the engine's overflow check depends on it);
 * bf16 keeps fp32's range. */
NMT_TG_TEST(cuda_matmul_fp16_overflow_matches_ref) {
  const int M = 6, K = 40, N = 9;
  const size_t ni = (size_t)M * K, nw = (size_t)N * K, no = (size_t)M * N;
  float *inp = nmt_tg_randn(g, ni, 701, 1.0f, 0.0f), *w = nmt_tg_randn(g, nw, 702, 0.2f, 0.0f);
  float *dout = nmt_tg_randn(g, no, 703, 1.0f, 0.0f), *want = nmt_tg_halloc(g, no * 4);
  float *want_di = nmt_tg_halloc(g, ni * 4);
  NMT_TG_SETUP_OK();
  for (size_t i = 0; i < nw; i++) w[i] = 0.05f + fabsf(w[i]); /* all > 0: rows of +-inf */
  inp[3 * K + 7] = 1e5f;
  dout[1 * N + 2] = -1e5f;
  float *d_inp = nmt_tg_dup_dev(g, inp, ni * 4), *d_w = nmt_tg_dup_dev(g, w, nw * 4);
  float *d_dout = nmt_tg_dup_dev(g, dout, no * 4), *d_out = nmt_tg_dalloc(g, no * 4),
        *d_di = nmt_tg_dalloc(g, ni * 4);
  NMT_TG_SETUP_OK();
  for (int k = 0; k < 2; k++) {
    const nmt_precision mode = k ? NMT_PRECISION_BF16 : NMT_PRECISION_FP16;
    void *rc = NULL;
    NMT_ASSERT_OK(g->be->set_precision(g->ctx, mode));
    nmt_tg_poison(g, d_out, no);
    NMT_ASSERT_OK(g->be->memset_zero(g->ctx, d_di, ni * 4));
    NMT_ASSERT_OK(g->be->matmul_fwd(g->ctx, d_out, d_inp, d_w, NULL, M, K, N));
    NMT_ASSERT_OK(g->be->matmul_bwd(g->ctx, d_di, NULL, NULL, d_dout, d_inp, d_w, M, K, N));
    memset(want_di, 0, ni * 4);
    NMT_ASSERT_OK(nmt_ref_ctx_create(0, &rc));
    nmt_status s = nmt_ref_set_precision(rc, mode);
    if (s == NMT_OK) s = nmt_ref_matmul_fwd(rc, want, inp, w, NULL, M, K, N);
    if (s == NMT_OK) s = nmt_ref_matmul_bwd(rc, want_di, NULL, NULL, dout, inp, w, M, K, N);
    nmt_ref_ctx_destroy(rc);
    NMT_ASSERT_OK(s);
    const float *got[2] = {nmt_tg_fetch(g, d_out, no * 4), nmt_tg_fetch(g, d_di, ni * 4)};
    const float *ref[2] = {want, want_di};
    const size_t len[2] = {no, ni};
    NMT_TG_SETUP_OK();
    for (int j = 0; j < 2; j++) {
      size_t inf_got = 0, inf_ref = 0;
      for (size_t i = 0; i < len[j]; i++) {
        inf_got += !isfinite(got[j][i]);
        inf_ref += !isfinite(ref[j][i]);
        if (isfinite(got[j][i]) != isfinite(ref[j][i]) ||
            (isinf(ref[j][i]) && got[j][i] != ref[j][i])) {
          nmt_test_fail(__FILE__, __LINE__, "%s %s[%zu]: device %g, emulation %g",
                        k ? "bf16" : "fp16", j ? "dinp" : "out", i, (double)got[j][i],
                        (double)ref[j][i]);
          return;
        }
      }
      /* fp16: one row of out (N) and one row of dinp (K) overflow; bf16: none. */
      NMT_ASSERT_EQ_INT((int)inf_ref, k ? 0 : (j ? K : N));
      NMT_ASSERT_EQ_INT((int)inf_got, (int)inf_ref);
    }
  }
}

/* ------------------------------------------------------------------------------------------ */
/* the roundings: the toolkit's host conversions and cast_half */

/* Needs no device: the CUDA toolkit's __float2half_rn / __float2bfloat16_rn, run on the host
 * (cuda/matmul.cu's nmt_cuda_round_host), round as the reference's helpers do, over random bit
 * patterns and exact ties. Weak, so a CPU-only build links without it (and skips). */
extern void nmt_cuda_round_host(nmt_precision mode, float *out, const float *x, size_t n)
    __attribute__((weak));

NMT_TEST(cuda_round_host_matches_ref) {
  if (!nmt_cuda_round_host) NMT_SKIP("CPU-only build (no CUDA toolkit conversions)");
  enum { N = 1 << 18 };
  float *x = malloc(N * sizeof *x), *dev = malloc(N * sizeof *x), *ref = malloc(N * sizeof *x);
  if (!x || !dev || !ref) {
    free(x), free(dev), free(ref);
    NMT_ASSERT(!"out of memory");
  }
  for (size_t i = 0; i < N; i++) {
    uint32_t u = nmt_rng_u32(123, 4, i);
    if (i % 3 == 1) u = (u & 0x8fffe000u) | 0x30001000u; /* fp16 ties (normal range) */
    if (i % 3 == 2) u = (u & 0xffff0000u) | 0x8000u;     /* bf16 ties */
    memcpy(&x[i], &u, 4);
  }
  for (int k = 0; k < 2; k++) {
    const nmt_precision mode = k ? NMT_PRECISION_BF16 : NMT_PRECISION_FP16;
    nmt_cuda_round_host(mode, dev, x, N);
    if (k) nmt_half_round_bf16_array(ref, x, N);
    else nmt_half_round_fp16_array(ref, x, N);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < N; i++) {
      const int same = (isnan(dev[i]) && isnan(ref[i])) || !memcmp(&dev[i], &ref[i], 4);
      if (!same && !bad++) first = i;
    }
    if (bad)
      nmt_test_fail(__FILE__, __LINE__, "%s: %zu of %d differ; first x = %.9g: CUDA %.9g, ref %.9g",
                    k ? "bf16" : "fp16", bad, N, (double)x[first], (double)dev[first],
                    (double)ref[first]);
  }
  free(x), free(dev), free(ref);
}

/* cast_half: bitwise the reference's bits (nmt_half_fp16_bits / nmt_half_bf16_bits, which equal
 * the toolkit's host conversions: cuda_round_host_matches_ref) on values at every scale, fp16
 * subnormals and overflow, ties, infinities and NaNs; the output poisoned first. */
NMT_TG_TEST(cuda_half_cast_matches_ref) {
  const size_t n = 100003;
  float *x = nmt_tg_halloc(g, n * 4);
  uint16_t *pattern = nmt_tg_halloc(g, n * 2);
  NMT_TG_SETUP_OK();
  const float fixed[] = {0.0f,     -0.0f,      65504.0f,  65520.0f, -65520.0f, 1e5f, 0x1p-24f,
                         0x1p-25f, 0x1.8p-25f, 0x1p-14f,  1.0f + 0x1p-11f, 1.0f + 0x1p-8f,
                         1e-40f,   INFINITY,   -INFINITY, NAN,      3.4e38f};
  const size_t nf = sizeof fixed / sizeof *fixed;
  for (size_t i = 0; i < n; i++)
    x[i] = i < nf ? fixed[i] : powf(10.0f, (float)(i % 13) - 8.0f) * nmt_rng_normal(131, 0, i);
  memset(pattern, 0xa5, n * 2);
  float *d_x = nmt_tg_dup_dev(g, x, n * 4);
  uint16_t *d_h = nmt_tg_dalloc(g, n * 2);
  NMT_TG_SETUP_OK();
  for (int k = 0; k < 2; k++) {
    const nmt_precision mode = nmt_tg_half_modes[k];
    NMT_ASSERT_OK(g->be->set_precision(g->ctx, mode));
    NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_h, pattern, n * 2));
    NMT_ASSERT_OK(g->be->cast_half(g->ctx, d_h, d_x, n));
    const uint16_t *got = nmt_tg_fetch(g, d_h, n * 2);
    NMT_TG_SETUP_OK();
    if (!nmt_tg_same_half(mode, k ? "bf16 cast_half" : "fp16 cast_half", got, x, n)) return;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* the half-storage path's linear layer: linear_half_fwd / linear_half_bwd (cuda/matmul.cu)
 *
 * Both backends get the same half bits (inputs, the half copy of the weights from each one's
 * cast_half, relu_out) and the same fp32 master weights and starting gradients, in fp16 and
 * bf16, with the cuBLASLt epilogues on and off (nmt_cuda_ctx_set_epilogues: the fused and the
 * unfused sequences). Two kinds of data:
 *  - random (normal): the fp32 sums are the same exact products added in another order, so
 *    an fp32 output agrees to rounding noise (NMT_TG_CLOSE rtol 1e-4, as the fp32 matmul
 *    tests) and a half output is the rounding of nearly the same fp32 value: equal, or one
 *    ulp of the half type apart where the two sums straddle a rounding boundary (two ulps
 *    after relu_scale != 1: round(round(acc) * s) rounds a value that may already be one ulp
 *    off), plus 1e-6 max|ref| for the fp32 noise itself;
 *  - exact (small integers, biases in quarters): every product and partial sum is an exact
 *    fp32 integer or quarter below 2^24, so ANY order and any accumulator (tensor cores
 *    included) gives the same sum and every output must EQUAL the reference's (values; -0 and
 *    +0 equal). This is what sees a second rounding (a bias added after D was rounded to
 *    half, a ReLU or scale applied to the wrong value): the 1-ulp tolerance above would not.
 * Half outputs are poisoned (0xffff, a NaN in both types) first, with gaps between batch
 * entries that must stay poisoned; a NaN left or written fails, and each reference output must
 * have non-zero elements (the test can fail). Counters: GEMM calls equal the reference's
 * (1 per forward with K > 0, 1 per backward dinp and dw), casts equal the reference's (0 for
 * weights inside the registered half copy), launches (cuda) exactly the unfused sequence's with
 * the epilogues off, and no scratch growth after reserve_scratch with the shapes' plan. */

/* The test knob (nmt/cuda.h). Weak: a CPU-only build links without it; the reference playing
 * the device (NMT_CUDA_TESTS_ON_REF) has no epilogue to turn off and runs both passes alike. */
extern nmt_status nmt_cuda_ctx_set_epilogues(void *ctx, int on) __attribute__((weak));

static int lh_epilogues(nmt_tg_gpu *g, int on) {
  if (g->be->is_host || !nmt_cuda_ctx_set_epilogues) return 1;
  const nmt_status s = nmt_cuda_ctx_set_epilogues(g->ctx, on);
  if (s != NMT_OK) nmt_test_fail(__FILE__, __LINE__, "set_epilogues: %s", nmt_last_error());
  return s == NMT_OK;
}

static uint16_t lh_bits(nmt_precision mode, float x) {
  return mode == NMT_PRECISION_BF16 ? nmt_half_bf16_bits(x) : nmt_half_fp16_bits(x);
}
static float lh_value(nmt_precision mode, uint16_t h) {
  return mode == NMT_PRECISION_BF16 ? nmt_half_bf16_value(h) : nmt_half_fp16_value(h);
}

/* One ulp of the half type in the binade of |x| (fp16: 2^-24 below 2^-14, its subnormals). */
static double lh_ulp(nmt_precision mode, double x) {
  const int bf16 = mode == NMT_PRECISION_BF16;
  const int mant = bf16 ? 7 : 10, emin = bf16 ? -126 : -14;
  int e = emin + 1;
  if (x != 0) frexp(fabs(x), &e);
  return ldexp(1.0, (e - 1 < emin ? emin : e - 1) - mant);
}

/* n values as floats: exact ? integers uniform in [lo, hi] (plus a quarter in [0, 3] / 4 when
 * quarters) : normal(0, scale). */
static float *lh_data(nmt_tg_gpu *g, size_t n, uint64_t seed, int exact, float scale, int lo,
                      int hi, int quarters) {
  float *x = nmt_tg_halloc(g, (n ? n : 1) * sizeof *x);
  if (!x) return NULL;
  for (size_t i = 0; i < n; i++) {
    const uint32_t u = nmt_rng_u32(seed, 17, i);
    x[i] = exact ? (float)(lo + (int)(u % (uint32_t)(hi - lo + 1))) +
                       (quarters ? 0.25f * (float)(u >> 29 & 3) : 0.0f)
                 : scale * nmt_rng_normal(seed, 18, i);
  }
  return x;
}

/* Half outputs got vs want (n elements, decoded): exact: equal values; else within ulps of the
 * half type at the larger magnitude plus 1e-6 max|want|. A NaN on either side fails (nothing
 * here is meant to produce one), as does a reference with no non-zero element unless zeros
 * are the answer (zeros_ok). Prints how many differ at all. 1 if all agree. */
static int lh_close(nmt_precision mode, const char *what, const uint16_t *got,
                    const uint16_t *want, size_t n, int exact, double ulps, int zeros_ok) {
  double max_ref = 0;
  size_t nonzero = 0;
  for (size_t i = 0; i < n; i++) {
    const double w = lh_value(mode, want[i]);
    max_ref = fmax(max_ref, fabs(w));
    nonzero += w != 0;
  }
  size_t bad = 0, differ = 0, worst = 0;
  double worst_err = -1;
  for (size_t i = 0; i < n; i++) {
    const double a = lh_value(mode, got[i]), b = lh_value(mode, want[i]);
    const double err = fabs(a - b);
    const double tol = exact ? 0 : ulps * lh_ulp(mode, fmax(fabs(a), fabs(b))) + 1e-6 * max_ref;
    differ += a != b;
    if (isnan(a) || isnan(b) || err > tol) {
      if (!bad++ || err > worst_err) worst = i, worst_err = isnan(err) ? INFINITY : err;
    }
  }
  if (differ && !bad)
    printf("# %s: %zu of %zu differ, within %g ulp\n", what, differ, n, exact ? 0.0 : ulps);
  if (bad)
    nmt_test_fail(__FILE__, __LINE__, "%s: %zu of %zu outside %s; worst at %zu: device %.9g "
                  "(0x%04x), reference %.9g (0x%04x)", what, bad, n,
                  exact ? "exact agreement" : "the half-ulp tolerance", worst,
                  (double)lh_value(mode, got[worst]), got[worst],
                  (double)lh_value(mode, want[worst]), want[worst]);
  else if (n > 0 && nonzero == 0 && !zeros_ok)
    nmt_test_fail(__FILE__, __LINE__, "%s: the reference output is all zeros (a test that "
                  "cannot fail)", what);
  return bad == 0 && (n == 0 || nonzero > 0 || zeros_ok);
}

/* dst (host, bytes) <- src (device): the tests' many reads back into buffers they own (the
 * harness tracks at most NMT_TG_MAX_BUFS). 1 on success. */
static int lh_fetch(nmt_tg_gpu *g, void *dst, const void *src, size_t bytes) {
  const nmt_status s = g->be->copy_d2h(g->ctx, dst, src, bytes);
  if (s != NMT_OK)
    nmt_test_fail(__FILE__, __LINE__, "copy_d2h: %s: %s", nmt_status_str(s), nmt_last_error());
  return s == NMT_OK;
}

/* A device copy of the flat fp32 parameters P (n) and its half copy by the device's cast_half;
 * the reference's half copy (its own cast_half) into *ref_bits. */
static int lh_params(nmt_tg_gpu *g, void *rc, const float *P, size_t n, float **d_P,
                     uint16_t **d_Ph, uint16_t **ref_bits) {
  *d_P = nmt_tg_dup_dev(g, P, n * 4);
  *d_Ph = nmt_tg_dalloc(g, n * 2);
  *ref_bits = nmt_tg_halloc(g, n * 2);
  if (nmt_test_failed()) return 0;
  nmt_status s = g->be->cast_half(g->ctx, *d_Ph, *d_P, n);
  if (s == NMT_OK) s = nmt_ref_cast_half(rc, *ref_bits, P, n);
  if (s != NMT_OK) nmt_test_fail(__FILE__, __LINE__, "cast_half: %s", nmt_last_error());
  return s == NMT_OK;
}

/* Registers (on = 1) or unregisters the half copies on both backends. */
static int lh_register(nmt_tg_gpu *g, void *rc, int on, const float *d_P, uint16_t *d_Ph,
                       const float *P, uint16_t *ref_bits, size_t n) {
  nmt_status s = g->be->half_weights(g->ctx, NULL, NULL, 0);
  if (s == NMT_OK) s = nmt_ref_half_weights(rc, NULL, NULL, 0);
  if (s == NMT_OK && on) s = g->be->half_weights(g->ctx, d_P, d_Ph, n);
  if (s == NMT_OK && on) s = nmt_ref_half_weights(rc, P, ref_bits, n);
  if (s != NMT_OK) nmt_test_fail(__FILE__, __LINE__, "half_weights: %s", nmt_last_error());
  return s == NMT_OK;
}

/* A reference context in mode and both backends' scratch reserved for shapes up to (M, K, N)
 * (the model-like plan: gemm_out = M x N, nmt/cuda.h reserve_scratch), half_acts set. */
static void *lh_setup(nmt_tg_gpu *g, nmt_precision mode, const int (*shapes)[3], size_t n_shapes,
                      int relu_k) {
  /* The plan of every shape (M, K, N) of the test, and with relu_k > 0 of the forward (M,
   * relu_k, K) that makes a backward's ReLU output, as nmt_model_scratch_plan bounds a model's. */
  nmt_scratch_plan plan;
  memset(&plan, 0, sizeof plan);
  for (size_t i = 0; i < n_shapes; i++)
    for (int f = 0; f < (relu_k > 0 ? 2 : 1); f++) {
      const size_t M = (size_t)shapes[i][0];
      const size_t K = f ? (size_t)relu_k : (size_t)shapes[i][1];
      const size_t N = f ? (size_t)shapes[i][1] : (size_t)shapes[i][2];
      nmt_scratch_need n;
      memset(&n, 0, sizeof n);
      n.gemm_rows = M, n.gemm_inp = M * K, n.gemm_w = N * K, n.gemm_out = M * N;
      nmt_scratch_need_max(&plan.main, &n);
    }
  plan.main.half_acts = 1;
  return nmt_tg_half_twin(g, mode, &plan);
}

/* The counters of both backends. */
typedef struct {
  nmt_backend_counters dev, ref;
} lh_counts;

static int lh_count(nmt_tg_gpu *g, void *rc, lh_counts *c) {
  nmt_status s = g->be->counters(g->ctx, &c->dev);
  if (s == NMT_OK) s = nmt_ref_counters(rc, &c->ref);
  if (s != NMT_OK) nmt_test_fail(__FILE__, __LINE__, "counters: %s", nmt_last_error());
  return s == NMT_OK;
}

/* ---- forward ---- */

/* {8, 4096, 16}: few output tiles and a long K, where a heuristic may pick split-K: its exact
 * sums (integers under 2^24, exact in fp32 in any order) must still be rounded once to half,
 * bitwise the reference's, which a split-K kept in the output type would not give. */
static const int lh_fwd_shapes[][3] = {{37, 29, 53}, {64, 128, 96}, {130, 256, 200}, {5, 0, 8},
                                       {8, 4096, 16}};
enum { LH_BIAS, LH_PLAIN, LH_RELU_BIAS, LH_RELU, LH_RELU_MASK, LH_VARIANTS };
static const char *const lh_variant_names[LH_VARIANTS] = {"bias", "no bias", "relu+bias",
                                                          "relu", "relu+bias+mask"};

static void lh_fwd_cases(nmt_tg_gpu *g, nmt_precision mode, uint64_t seed0) {
  const char *mname = mode == NMT_PRECISION_BF16 ? "bf16" : "fp16";
  void *rc = lh_setup(g, mode, lh_fwd_shapes, sizeof lh_fwd_shapes / sizeof *lh_fwd_shapes, 0);
  if (!rc) return;
  char what[192];
  for (int exact = 0; exact < 2 && !nmt_test_failed(); exact++)
    for (size_t si = 0; si < sizeof lh_fwd_shapes / sizeof *lh_fwd_shapes; si++)
      for (int batch = 1; batch <= 6 && !nmt_test_failed(); batch += 5) {
        const int M = lh_fwd_shapes[si][0], K = lh_fwd_shapes[si][1], N = lh_fwd_shapes[si][2];
        const uint64_t seed = seed0 + 100 * si + 10 * (uint64_t)batch + 1000 * (uint64_t)exact;
        const size_t mn = (size_t)M * N, nk = (size_t)N * K;
        /* Slices of a flat buffer, as the model's: w_b at b*stride, bias_b after it. Shapes of
         * multiples of 8 keep every half slice 16-byte aligned (the epilogue may be taken);
         * odd ones leave the bias and the later slices misaligned (the fallback). */
        const int al = K % 8 == 0 && N % 8 == 0;
        const size_t boff = al ? (nk + 7) / 8 * 8 : nk;
        const size_t stride = al ? (boff + (size_t)N + 7) / 8 * 8 + 8 : boff + (size_t)N + 3;
        const size_t n_par = (size_t)(batch - 1) * stride + boff + (size_t)N + 5;
        const size_t out_stride = batch > 1 ? mn + 40 : mn;
        const size_t total = (size_t)(batch - 1) * out_stride + mn;
        float *P = lh_data(g, n_par, seed, exact, 0.2f, -6, 8, 0);
        if (!P) return;
        for (int b = 0; b < batch && exact; b++) /* biases in quarters for the exact kind */
          for (int n = 0; n < N; n++)
            P[(size_t)b * stride + boff + n] =
                (float)((n * 5 + 3 * b) % 17 - 8) + 0.25f * (float)(n % 4); /* per entry */
        const float *x = lh_data(g, (size_t)M * K, seed + 1, exact, 1.0f, -3, 4, 0);
        const uint16_t *xh = x ? nmt_tg_half_encode(g, mode, x, (size_t)M * K) : NULL;
        uint16_t *want = nmt_tg_halloc(g, total * 2), *got = nmt_tg_halloc(g, total * 2);
        uint16_t *ref_bits;
        float *d_P;
        uint16_t *d_Ph;
        if (!xh || !want || !got || !lh_params(g, rc, P, n_par, &d_P, &d_Ph, &ref_bits)) break;
        uint16_t *d_x = nmt_tg_dup_dev(g, xh, K > 0 ? (size_t)M * K * 2 : 2);
        uint16_t *d_out = nmt_tg_dalloc(g, total * 2);
        uint8_t *d_mask = nmt_tg_dalloc(g, nmt_relu_mask_bytes(M, N) + 16);
        NMT_TG_SETUP_OK();
        for (int in_copy = 0; in_copy < 2 && !nmt_test_failed(); in_copy++) {
          if (!lh_register(g, rc, in_copy, d_P, d_Ph, P, ref_bits, n_par)) break;
          for (int v = 0; v < LH_VARIANTS && !nmt_test_failed(); v++) {
            if (v == LH_RELU_MASK && batch > 1) continue; /* the mask is for batch 1 */
            const int relu = v >= LH_RELU_BIAS, has_bias = v != LH_PLAIN && v != LH_RELU;
            for (int on = 1; on >= 0 && !nmt_test_failed(); on--) {
              snprintf(what, sizeof what,
                       "%s linear_half_fwd %s M=%d K=%d N=%d batch %d %s, %s copy, epilogues %s",
                       mname, exact ? "exact" : "random", M, K, N, batch, lh_variant_names[v],
                       in_copy ? "in the" : "outside the", on ? "on" : "off");
              if (!lh_epilogues(g, on)) return;
              nmt_tg_half_poison(g, d_out, total);
              for (size_t i = 0; i < total; i++) want[i] = 0xffff;
              lh_counts c0, c1;
              int mw_dev = -1, mw_ref = -1;
              if (!lh_count(g, rc, &c0)) break;
              const nmt_status sd = g->be->linear_half_fwd(
                  g->ctx, d_out, d_x, d_P, has_bias ? d_P + boff : NULL, M, K, N, relu,
                  v == LH_RELU_MASK ? d_mask : NULL, &mw_dev, batch, stride, out_stride);
              if (!lh_count(g, rc, &c1)) break;
              const nmt_status sr = nmt_ref_linear_half_fwd(
                  rc, want, xh, P, has_bias ? P + boff : NULL, M, K, N, relu, NULL, &mw_ref,
                  batch, stride, out_stride);
              lh_counts c2;
              if (!lh_count(g, rc, &c2)) break;
              if (sd != NMT_OK || sr != NMT_OK) {
                nmt_test_fail(__FILE__, __LINE__, "%s: device %s, ref %s: %s", what,
                              nmt_status_str(sd), nmt_status_str(sr), nmt_last_error());
                break;
              }
              if (!lh_fetch(g, got, d_out, total * 2)) break;
              for (int b = 0; b < batch; b++) {
                /* K = 0 without a bias: zeros are the answer */
                if (!lh_close(mode, what, got + (size_t)b * out_stride,
                              want + (size_t)b * out_stride, mn, exact, 1.0,
                              K == 0 && !has_bias))
                  break;
                for (size_t i = mn; b + 1 < batch && i < out_stride; i++)
                  if (got[(size_t)b * out_stride + i] != 0xffff) {
                    nmt_test_fail(__FILE__, __LINE__, "%s: wrote element %zu of the gap after "
                                  "batch entry %d", what, i - mn, b);
                    break;
                  }
                for (size_t i = 0; relu && i < mn; i++)
                  if (lh_value(mode, got[(size_t)b * out_stride + i]) < 0) {
                    nmt_test_fail(__FILE__, __LINE__, "%s: a negative output after the ReLU",
                                  what);
                    break;
                  }
                if (nmt_test_failed()) break;
              }
              if (nmt_test_failed()) break;
              /* Counters: the device's own (c1 - c0), the reference's (c2 - c1). */
              const uint64_t gemm = c1.dev.gemm_calls - c0.dev.gemm_calls;
              const uint64_t casts = c1.dev.casts - c0.dev.casts;
              const uint64_t ref_casts = c2.ref.casts - c1.ref.casts;
              /* K = 0 runs no GEMM on the device (the reference counts its logical call) */
              if ((!g->be->is_host && gemm != (K > 0)) ||
                  (K > 0 && gemm != c2.ref.gemm_calls - c1.ref.gemm_calls) ||
                  casts != ref_casts || (in_copy && casts != 0) ||
                  /* a batch's casts (outside the copy) are beyond a plan of one layer */
                  ((batch == 1 || in_copy) &&
                   c1.dev.scratch_growths != c0.dev.scratch_growths) ||
                  (mw_dev != 0 && (!on || g->be->is_host || v != LH_RELU_MASK)) || mw_ref != 0) {
                nmt_test_fail(__FILE__, __LINE__, "%s: GEMM calls %llu (ref %llu), casts %llu "
                              "(ref %llu), scratch growths %llu, mask written %d (ref %d)",
                              what, (unsigned long long)gemm,
                              (unsigned long long)(c2.ref.gemm_calls - c1.ref.gemm_calls),
                              (unsigned long long)casts, (unsigned long long)ref_casts,
                              (unsigned long long)(c1.dev.scratch_growths -
                                                   c0.dev.scratch_growths),
                              mw_dev, mw_ref);
                break;
              }
              if (!g->be->is_host) {
                /* The unfused sequence: the casts, the bias broadcast (or zeros for K = 0),
                 * the GEMM, the ReLU kernel; fused: the casts and one GEMM. */
                const uint64_t unfused = casts + (has_bias || K == 0) + (K > 0) +
                                         (relu && (K > 0 || has_bias));
                const uint64_t fused = casts + 1;
                const uint64_t l = c1.dev.launches - c0.dev.launches;
                if (l != unfused && (!on || K == 0 || !(has_bias || relu) || l != fused))
                  nmt_test_fail(__FILE__, __LINE__, "%s: %llu launches, not %llu (unfused) or "
                                "%llu (fused)", what, (unsigned long long)l,
                                (unsigned long long)unfused, (unsigned long long)fused);
                /* Which path this shape took, for the GPU run's summary (tools/gpu-check.sh
                 * collects these lines): an epilogue never taken is a speed question, not a
                 * test failure. */
                if (on && si == 1 && !exact && (has_bias || relu))
                  printf("# %s: %s%s\n", what,
                         v == LH_RELU_MASK ? (mw_dev ? "mask written, " : "mask not written, ")
                                           : "",
                         l == fused ? "fused" : "unfused");
              }
            }
          }
        }
      }
  lh_register(g, rc, 0, NULL, NULL, NULL, NULL, 0);
  lh_epilogues(g, 1);
  nmt_ref_ctx_destroy(rc);
}

NMT_TG_TEST(cuda_linear_half_fwd_fp16_matches_ref) { lh_fwd_cases(g, NMT_PRECISION_FP16, 3000); }
NMT_TG_TEST(cuda_linear_half_fwd_bf16_matches_ref) { lh_fwd_cases(g, NMT_PRECISION_BF16, 4000); }

/* ---- backward ---- */

/* fp32 outputs: NMT_TG_CLOSE's rule at rtol 1e-4 (random), or bitwise (exact); 1 if close. */
static int lh_close_f32(const char *what, const float *got, const float *want, size_t n,
                        int exact) {
  if (!got || !want) return 0;
  const double rtol = exact ? 0.0 : 1e-4;
  return nmt_test_close(__FILE__, __LINE__, what, got, want, n, rtol * nmt_tg_max_abs(want, n),
                        rtol);
}

/* K > 128 (the ReLU mask wider than one 128-bit word per row: conf/base.ini's fc2 has K =
 * d_ff = 2048) in the last two. */
static const int lh_bwd_shapes[][3] = {{37, 29, 53},  {64, 128, 96},  {600, 64, 40},
                                       {700, 16, 13}, {1100, 48, 24}, {5, 0, 8},
                                       {300, 200, 64}, {130, 2048, 32}};
enum { LH_C0 = 24 }; /* the inputs of the forward whose ReLU output the backward undoes */
enum { LH_NO_RELU, LH_RELU_OUT, LH_RELU_MASK_OUT, LH_DROPPED, LH_RELU_VARIANTS };
static const char *const lh_relu_names[LH_RELU_VARIANTS] = {
    "no relu", "relu_out", "relu_out+mask", "relu_out after dropout 0.1 (+mask, unused)"};
/* Which gradients are asked for: all three; dinp and dbias (no dW GEMM: the column sums);
 * dW only. */
enum { LH_ALL, LH_NO_DW, LH_DW_ONLY, LH_WANTS };

static void lh_bwd_cases(nmt_tg_gpu *g, nmt_precision mode, uint64_t seed0) {
  const char *mname = mode == NMT_PRECISION_BF16 ? "bf16" : "fp16";
  static const nmt_dinp_mode dmodes[3] = {NMT_DINP_HALF, NMT_DINP_F32, NMT_DINP_F32_ADD};
  static const char *const dnames[3] = {"half", "fp32", "fp32 +="};
  /* As the model's FFN: the dropout's scale, 1/(1-p) in fp32. */
  const float drop_scale = 1.0f / (1.0f - 0.1f);
  void *rc = lh_setup(g, mode, lh_bwd_shapes, sizeof lh_bwd_shapes / sizeof *lh_bwd_shapes, LH_C0);
  if (!rc) return;
  char what[224];
  for (int exact = 0; exact < 2 && !nmt_test_failed(); exact++)
    for (size_t si = 0; si < sizeof lh_bwd_shapes / sizeof *lh_bwd_shapes; si++) {
      if (nmt_test_failed()) break;
      const int M = lh_bwd_shapes[si][0], K = lh_bwd_shapes[si][1], N = lh_bwd_shapes[si][2];
      const uint64_t seed = seed0 + 100 * si + 1000 * (uint64_t)exact;
      const size_t mk = (size_t)M * K, nk = (size_t)N * K, mn = (size_t)M * N;
      /* relu_out: the device forward's ReLU output (M, K) of (M, LH_C0) inputs, with its mask
       * where the epilogue wrote one; the same bits for the reference; and a copy after a
       * dropout of 0.1 (kept x 1/(1-p), rounded; dropped 0), whose mask must not be used. */
      uint16_t *h = NULL, *hd = NULL, *d_h = NULL, *d_hd = NULL;
      uint8_t *d_mask = NULL;
      int mask_written = 0;
      if (K > 0) {
        const float *x0 = lh_data(g, (size_t)M * LH_C0, seed + 1, exact, 1.0f, -3, 4, 0);
        const float *w0 = lh_data(g, (size_t)K * LH_C0 + K, seed + 2, exact, 0.3f, -6, 8, 1);
        const uint16_t *x0h = x0 ? nmt_tg_half_encode(g, mode, x0, (size_t)M * LH_C0) : NULL;
        hd = nmt_tg_halloc(g, mk * 2);
        if (!x0h || !w0 || !hd) break;
        uint16_t *d_x0 = nmt_tg_dup_dev(g, x0h, (size_t)M * LH_C0 * 2);
        float *d_w0 = nmt_tg_dup_dev(g, w0, ((size_t)K * LH_C0 + K) * 4);
        d_h = nmt_tg_dalloc(g, mk * 2);
        d_mask = nmt_tg_dalloc(g, nmt_relu_mask_bytes(M, K) + 16);
        NMT_TG_SETUP_OK();
        if (!lh_epilogues(g, 1)) break;
        const nmt_status s =
            g->be->linear_half_fwd(g->ctx, d_h, d_x0, d_w0, d_w0 + (size_t)K * LH_C0, M, LH_C0,
                                   K, 1, d_mask, &mask_written, 1, 0, 0);
        if (s != NMT_OK) {
          nmt_test_fail(__FILE__, __LINE__, "relu_out's forward: %s", nmt_last_error());
          break;
        }
        h = nmt_tg_fetch(g, d_h, mk * 2);
        if (!h) break;
        size_t active = 0;
        for (size_t i = 0; i < mk; i++) {
          const int keep = nmt_rng_uniform(seed + 3, 5, i) >= 0.1f;
          hd[i] = keep ? lh_bits(mode, lh_value(mode, h[i]) * drop_scale) : 0;
          active += lh_value(mode, h[i]) > 0;
        }
        if (active == 0 || active == mk) {
          nmt_test_fail(__FILE__, __LINE__, "relu_out has %zu of %zu active: no ReLU to undo",
                        active, mk);
          break;
        }
        d_hd = nmt_tg_dup_dev(g, hd, mk * 2);
      }
      const float *dy = lh_data(g, mn, seed + 4, exact, 1.0f, -4, 4, 0);
      const float *x = lh_data(g, mk, seed + 5, exact, 1.0f, -3, 4, 0);
      const uint16_t *dyh = dy ? nmt_tg_half_encode(g, mode, dy, mn) : NULL;
      const uint16_t *xh = x ? nmt_tg_half_encode(g, mode, x, mk) : NULL;
      const float *P = lh_data(g, nk + 5, seed + 6, exact, 0.2f, -6, 8, 0);
      const float *dw0 = lh_data(g, nk, seed + 7, exact, 1.0f, -5, 5, 0);
      const float *db0 = lh_data(g, (size_t)N, seed + 8, exact, 1.0f, -5, 5, 0);
      const float *dx0 = lh_data(g, mk, seed + 9, exact, 1.0f, -5, 5, 0);
      float *want_dx = nmt_tg_halloc(g, mk * 4 + 4), *want_dw = nmt_tg_halloc(g, nk * 4 + 4);
      float *want_db = nmt_tg_halloc(g, (size_t)N * 4);
      float *got = nmt_tg_halloc(g, mk * 4 + nk * 4 + (size_t)N * 4 + 4);
      float *d_P;
      uint16_t *d_Ph, *ref_bits;
      if (!dyh || !xh || !P || !dw0 || !db0 || !dx0 || !want_dx || !want_dw || !want_db || !got ||
          !lh_params(g, rc, P, nk + 5, &d_P, &d_Ph, &ref_bits))
        break;
      uint16_t *d_dy = nmt_tg_dup_dev(g, dyh, mn * 2);
      uint16_t *d_x = nmt_tg_dup_dev(g, xh, mk ? mk * 2 : 2);
      float *d_dx = nmt_tg_dalloc(g, mk * 4 + 4), *d_dw = nmt_tg_dalloc(g, nk * 4 + 4);
      float *d_db = nmt_tg_dalloc(g, (size_t)N * 4);
      NMT_TG_SETUP_OK();
      for (int in_copy = 0; in_copy < 2 && !nmt_test_failed(); in_copy++) {
        if (!lh_register(g, rc, in_copy, d_P, d_Ph, P, ref_bits, nk + 5)) break;
        for (int dm = 0; dm < 3 && !nmt_test_failed(); dm++)
          for (int rv = 0; rv < LH_RELU_VARIANTS && !nmt_test_failed(); rv++)
            for (int wants = 0; wants < LH_WANTS && !nmt_test_failed(); wants++)
              for (int on = 1; on >= 0 && !nmt_test_failed(); on--) {
                if (rv && (dmodes[dm] != NMT_DINP_HALF || K == 0)) continue;
                if (wants != LH_ALL && (rv > LH_RELU_OUT || dm == 2)) continue;
                const nmt_dinp_mode dmode = dmodes[dm];
                const int half = dmode == NMT_DINP_HALF;
                const int want_dinp = wants != LH_DW_ONLY, want_dwt = wants != LH_NO_DW;
                const int want_dbias = wants != LH_DW_ONLY;
                snprintf(what, sizeof what,
                         "%s linear_half_bwd %s M=%d K=%d N=%d dinp %s, %s, %s%s%s, %s copy, "
                         "epilogues %s",
                         mname, exact ? "exact" : "random", M, K, N, dnames[dm],
                         lh_relu_names[rv], want_dinp ? "dinp " : "", want_dwt ? "dw " : "",
                         want_dbias ? "dbias" : "", in_copy ? "in the" : "outside the",
                         on ? "on" : "off");
                if (!lh_epilogues(g, on)) return;
                /* Written outputs poisoned, accumulated ones from their starting values. */
                if (half) {
                  nmt_tg_half_poison(g, (uint16_t *)d_dx, mk);
                  for (size_t i = 0; i < mk; i++) ((uint16_t *)want_dx)[i] = 0xffff;
                } else if (dmode == NMT_DINP_F32) {
                  nmt_tg_poison(g, d_dx, mk);
                  for (size_t i = 0; i < mk; i++) want_dx[i] = NAN;
                } else {
                  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_dx, dx0, mk * 4));
                  memcpy(want_dx, dx0, mk * 4);
                }
                NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_dw, dw0, nk * 4));
                NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_db, db0, (size_t)N * 4));
                memcpy(want_dw, dw0, nk * 4);
                memcpy(want_db, db0, (size_t)N * 4);
                const uint16_t *ro = rv == LH_NO_RELU ? NULL : rv == LH_DROPPED ? d_hd : d_h;
                const uint16_t *ro_ref = rv == LH_NO_RELU ? NULL : rv == LH_DROPPED ? hd : h;
                const uint8_t *mask = rv >= LH_RELU_MASK_OUT && mask_written ? d_mask : NULL;
                const float scale = rv == LH_DROPPED ? drop_scale : 1.0f;
                lh_counts c0, c1, c2;
                if (!lh_count(g, rc, &c0)) break;
                const nmt_status sd = g->be->linear_half_bwd(
                    g->ctx, want_dinp ? (void *)d_dx : NULL, dmode, want_dwt ? d_dw : NULL,
                    want_dbias ? d_db : NULL, d_dy, d_x, d_P, ro, mask, scale, M, K, N);
                if (!lh_count(g, rc, &c1)) break;
                const nmt_status sr = nmt_ref_linear_half_bwd(
                    rc, want_dinp ? (void *)want_dx : NULL, dmode, want_dwt ? want_dw : NULL,
                    want_dbias ? want_db : NULL, dyh, xh, P, ro_ref, NULL, scale, M, K, N);
                if (!lh_count(g, rc, &c2)) break;
                if (sd != NMT_OK || sr != NMT_OK) {
                  nmt_test_fail(__FILE__, __LINE__, "%s: device %s, ref %s: %s", what,
                                nmt_status_str(sd), nmt_status_str(sr), nmt_last_error());
                  break;
                }
                if (want_dinp) {
                  if (!lh_fetch(g, got, d_dx, half ? mk * 2 : mk * 4)) break;
                  if (half ? !lh_close(mode, what, (const uint16_t *)got,
                                       (const uint16_t *)want_dx, mk, exact,
                                       rv == LH_DROPPED ? 2.0 : 1.0, 0)
                           : !lh_close_f32(what, got, want_dx, mk, exact))
                    break;
                }
                if (want_dwt && (!lh_fetch(g, got, d_dw, nk * 4) ||
                                 !lh_close_f32(what, got, want_dw, nk, exact)))
                  break;
                if (want_dbias && (!lh_fetch(g, got, d_db, (size_t)N * 4) ||
                                   !lh_close_f32(what, got, want_db, (size_t)N, exact)))
                  break;
                const uint64_t gemm = c1.dev.gemm_calls - c0.dev.gemm_calls;
                const uint64_t ref_gemm = c2.ref.gemm_calls - c1.ref.gemm_calls;
                const uint64_t casts = c1.dev.casts - c0.dev.casts;
                const uint64_t ref_casts = c2.ref.casts - c1.ref.casts;
                if (gemm != ref_gemm || gemm != (uint64_t)(K > 0) * (want_dinp + want_dwt) ||
                    casts != ref_casts || (in_copy && casts) ||
                    c1.dev.scratch_growths != c0.dev.scratch_growths) {
                  nmt_test_fail(__FILE__, __LINE__, "%s: GEMM calls %llu (ref %llu), casts %llu "
                                "(ref %llu), scratch growths %llu", what,
                                (unsigned long long)gemm, (unsigned long long)ref_gemm,
                                (unsigned long long)casts, (unsigned long long)ref_casts,
                                (unsigned long long)(c1.dev.scratch_growths -
                                                     c0.dev.scratch_growths));
                  break;
                }
                if (!g->be->is_host && !on) {
                  /* Unfused: the weight's cast, the dinp GEMM and the ReLU kernel, the dW
                   * GEMM, the column sums (and their finishing pass past 511 rows). */
                  const int chunks = M / 256 < 1 ? 1 : M / 256 > 64 ? 64 : M / 256;
                  const uint64_t expect =
                      casts + (K > 0 && want_dinp ? 1u + (rv != LH_NO_RELU) : 0u) +
                      (K > 0 && want_dwt ? 1u : 0u) + (want_dbias ? 1u + (chunks > 1) : 0u);
                  const uint64_t l = c1.dev.launches - c0.dev.launches;
                  if (l != expect)
                    nmt_test_fail(__FILE__, __LINE__, "%s: %llu launches, not %llu", what,
                                  (unsigned long long)l, (unsigned long long)expect);
                }
              }
      }
    }
  lh_register(g, rc, 0, NULL, NULL, NULL, NULL, 0);
  lh_epilogues(g, 1);
  nmt_ref_ctx_destroy(rc);
}

NMT_TG_TEST(cuda_linear_half_bwd_fp16_matches_ref) { lh_bwd_cases(g, NMT_PRECISION_FP16, 5000); }
NMT_TG_TEST(cuda_linear_half_bwd_bf16_matches_ref) { lh_bwd_cases(g, NMT_PRECISION_BF16, 6000); }

/* Misuse the contract names: no half type (fp32 mode), an fp32 dinp with relu_out, an unknown
 * dinp mode, negative sizes, batch 0, overlapping batch outputs; each refused on the device
 * as in the reference. */
NMT_TG_TEST(cuda_linear_half_refuses_misuse) {
  uint16_t *d = nmt_tg_dalloc(g, 4096);
  float *w = nmt_tg_dalloc(g, 4096);
  NMT_TG_SETUP_OK();
  int mw = 7;
  /* fp32 mode: no half type */
  NMT_ASSERT_EQ_STATUS(g->be->linear_half_fwd(g->ctx, d, d + 512, w, NULL, 2, 2, 2, 0, NULL, &mw,
                                              1, 0, 0), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_INT(mw, 0);
  NMT_ASSERT_EQ_STATUS(g->be->linear_half_bwd(g->ctx, d, NMT_DINP_HALF, NULL, NULL, d, d, w,
                                              NULL, NULL, 1.0f, 2, 2, 2), NMT_ERR_INTERNAL);
  for (int k = 0; k < 2 && !nmt_test_failed(); k++) {
    NMT_ASSERT_OK(g->be->set_precision(g->ctx, nmt_tg_half_modes[k]));
    NMT_ASSERT_EQ_STATUS(g->be->linear_half_bwd(g->ctx, w, NMT_DINP_F32, NULL, NULL, d, d, w, d,
                                                NULL, 1.0f, 2, 2, 2), NMT_ERR_INTERNAL);
    NMT_ASSERT_EQ_STATUS(g->be->linear_half_bwd(g->ctx, d, (nmt_dinp_mode)3, NULL, NULL, d, d,
                                                w, NULL, NULL, 1.0f, 2, 2, 2), NMT_ERR_INTERNAL);
    NMT_ASSERT_EQ_STATUS(g->be->linear_half_bwd(g->ctx, d, NMT_DINP_HALF, NULL, NULL, d, d, w,
                                                NULL, NULL, 1.0f, -1, 2, 2), NMT_ERR_INTERNAL);
    NMT_ASSERT_EQ_STATUS(g->be->linear_half_fwd(g->ctx, d, d + 512, w, NULL, 2, -2, 2, 0, NULL,
                                                NULL, 1, 0, 0), NMT_ERR_INTERNAL);
    NMT_ASSERT_EQ_STATUS(g->be->linear_half_fwd(g->ctx, d, d + 512, w, NULL, 2, 2, 2, 0, NULL,
                                                NULL, 0, 0, 0), NMT_ERR_INTERNAL);
    if (!g->be->is_host) /* the device's own rule: the reference writes such batches in order */
      NMT_ASSERT_EQ_STATUS(g->be->linear_half_fwd(g->ctx, d, d + 512, w, NULL, 2, 2, 2, 0, NULL,
                                                  NULL, 2, 8, 3), NMT_ERR_INTERNAL);
    /* an empty call is fine and writes nothing */
    NMT_ASSERT_OK(g->be->linear_half_fwd(g->ctx, d, d + 512, w, NULL, 0, 2, 2, 0, NULL, NULL, 1,
                                         0, 0));
  }
}
