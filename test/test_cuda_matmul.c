/* test/test_cuda_matmul.c — the linear layer (cuda/matmul.cu: matmul_fwd, matmul_bwd, the
 * fp16/bf16 input casts, cast_half and the toolkit's host conversions) against the reference
 * (src/ref/matmul.c), forward and backward, at column-slice offsets.
 *
 * Tolerance (NMT_TG_CLOSE, test/gpu_helpers.h): rtol = 1e-4 in fp32 and 1e-3 with TF32 GEMMs.
 * fp16/bf16 matmuls are compared with the reference emulating the same mode (a reference
 * context; nmt/ref.h) at rtol 1e-2, plus a check that the device really rounds; an fp16
 * overflow gives the same infinities. Roundings and cast_half's 16-bit patterns are held to
 * the reference's bitwise. The bias / ReLU epilogues: test/test_cuda_gemm.c; matmul through
 * the registered half copy: test/test_cuda_context.c. */
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
