/* test/test_half_weights.c — the fp16/bf16 working copy of the weights on the reference backend
 * (nmt/backend.h: half_weights, cast_half, adamw's half_out; src/ref/matmul.c, src/ref/context.c,
 * src/ref/adamw.c) and the engine's use of it (src/engine/replica.c, worker.c).
 *
 * The reference keeps the copy as 16-bit patterns and decodes them in matmul, so:
 * - cast_half's bits are decoded here by an independent decoder (IEEE binary16 fields with
 *   ldexp; bfloat16 as the top half of a float) and must equal nmt_half_round_fp16/bf16;
 * - matmul with a registered CURRENT copy is bitwise matmul without one, and with a STALE copy
 *   (the fp32 weight changed after the cast) it gives exactly the old weight's results, which
 *   proves the copy is what the GEMM reads; a weight only partly inside the registered range
 *   is rounded from fp32 as before;
 * - adamw's half_out is bitwise cast_half of the updated parameters, and a skipped step leaves
 *   it alone;
 * - the trainer keeps the copy current: the validation loss after training (read through the
 *   copy adamw refreshed) equals the one of a trainer resumed from that step's checkpoint
 *   (whose copy is cast fresh from the loaded parameters);
 * - the decoder rig of translate/eval/validation BLEU makes its copy once, from the parameters
 *   it has uploaded, and refreshes it at each load (src/engine/translate_batch.c).
 * Every output is poisoned first, so an element an op forgets shows. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_helpers.h" /* nmt_tg_same_half */
#include "helpers.h"
#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/half.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "nmt/trainer.h"
#include "test.h"
#include "../src/engine/translate_impl.h" /* the decoder rig */

static const nmt_precision HALF_MODES[2] = {NMT_PRECISION_FP16, NMT_PRECISION_BF16};

static const char *mode_name(nmt_precision m) { return m == NMT_PRECISION_FP16 ? "fp16" : "bf16"; }

static uint32_t fbits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

/* The value of half pattern h, decoded from the format's definition (IEEE 754 binary16: sign,
 * 5-bit exponent biased by 15, 10-bit fraction; bfloat16: the top 16 bits of a binary32), not
 * by the code under test. */
static float decode(nmt_precision mode, uint16_t h) {
  if (mode == NMT_PRECISION_BF16) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
  }
  const int e = (h >> 10) & 31, m = h & 1023;
  const double s = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 31) return m ? NAN : (float)(s * INFINITY);
  if (e == 0) return (float)(s * ldexp(m, -24));
  return (float)(s * ldexp(1024 + m, e - 25));
}

static float round_ref(nmt_precision mode, float x) {
  return mode == NMT_PRECISION_FP16 ? nmt_half_round_fp16(x) : nmt_half_round_bf16(x);
}

/* Bitwise equality of two float arrays, NaN equal to NaN; reports the first difference. */
static int same_bits(const char *what, const float *a, const float *b, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (isnan(a[i]) && isnan(b[i])) continue;
    if (fbits(a[i]) != fbits(b[i])) {
      nmt_test_fail(__FILE__, __LINE__, "%s: element %zu differs: %.9g (0x%08x) vs %.9g (0x%08x)",
                    what, i, a[i], fbits(a[i]), b[i], fbits(b[i]));
      return 0;
    }
  }
  return 1;
}

/* Number of elements whose bits differ (NaN equal to NaN). */
static size_t count_diff(const float *a, const float *b, size_t n) {
  size_t d = 0;
  for (size_t i = 0; i < n; i++)
    if (!(isnan(a[i]) && isnan(b[i])) && fbits(a[i]) != fbits(b[i])) d++;
  return d;
}

static void fill_randn(float *x, size_t n, uint64_t seed, float scale) {
  for (size_t i = 0; i < n; i++) x[i] = scale * nmt_rng_normal(seed, 5, i);
}

static void fill_nan(float *x, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = NAN;
}

/* A reference context in `mode`, or NULL after recording a failure. */
static void *ctx_in(nmt_precision mode) {
  void *ctx = NULL;
  if (nmt_ref_ctx_create(0, &ctx) != NMT_OK || nmt_ref_set_precision(ctx, mode) != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "reference context in %s: %s", mode_name(mode),
                  nmt_last_error());
    nmt_ref_ctx_destroy(ctx);
    return NULL;
  }
  return ctx;
}

/* ------------------------------------------------------------------------------------------ */

/* Inputs that exercise the rounding: ordinary values at several magnitudes, fp16 subnormals
 * (2^-24 .. 2^-14) and values that flush to zero, fp16's overflow (65504 stays, 65520 and up
 * become inf), ties, signed zeros, infinities and NaNs (one with its payload only in the low 16
 * bits, which a careless bf16 truncation turns into inf). */
static size_t special_inputs(float *x, size_t cap) {
  size_t n = 0;
  const float fixed[] = {0.0f,        -0.0f,       1.0f,          -1.0f,         65504.0f,
                         65519.99f,   65520.0f,    -65520.0f,     1e5f,          -7e4f,
                         3.4e38f,     -3.4e38f,    0x1p-24f,      0x1p-25f,      0x1.8p-25f,
                         0x1p-26f,    0x1p-14f,    0x1.ffcp-15f,  -0x1.4p-20f,   1.0f + 0x1p-11f,
                         1.0f + 0x3p-11f, 1.0f + 0x1p-8f, 1.0f + 0x3p-8f, 1e-40f, INFINITY,
                         -INFINITY,   NAN,         -NAN};
  for (size_t i = 0; i < sizeof fixed / sizeof *fixed && n < cap; i++) x[n++] = fixed[i];
  const uint32_t nan_low = 0x7f800001u;
  if (n < cap) memcpy(&x[n++], &nan_low, sizeof(float));
  const float scales[] = {1e-7f, 3e-6f, 1e-4f, 1e-2f, 1.0f, 100.0f, 3e4f, 1e6f};
  for (size_t k = 0; k < sizeof scales / sizeof *scales; k++)
    for (size_t i = 0; i < 2000 && n < cap; i++)
      x[n++] = scales[k] * nmt_rng_normal(31 + k, 7, i);
  return n;
}

NMT_TEST(half_weights_cast_bits_decode_to_ref_rounding) {
  enum { CAP = 20000 };
  float *x = malloc(CAP * sizeof *x), *want = malloc(CAP * sizeof *want);
  float *got = malloc(CAP * sizeof *got);
  uint16_t *h = malloc(CAP * sizeof *h);
  NMT_ASSERT(x && want && got && h);
  const size_t n = special_inputs(x, CAP);
  for (int k = 0; k < 2; k++) {
    const nmt_precision mode = HALF_MODES[k];
    void *ctx = ctx_in(mode);
    if (!ctx) break;
    memset(h, 0xa5, n * sizeof *h); /* a pattern no input maps to everywhere */
    nmt_status s = nmt_backend_ref.cast_half(ctx, h, x, n);
    nmt_ref_ctx_destroy(ctx);
    NMT_ASSERT_OK(s);
    for (size_t i = 0; i < n; i++) {
      got[i] = decode(mode, h[i]);
      want[i] = round_ref(mode, x[i]);
    }
    if (!same_bits(mode == NMT_PRECISION_FP16 ? "fp16 cast_half" : "bf16 cast_half", got, want,
                   n))
      break;
    /* The overflow and NaN cases by name, so a regression says what it broke. */
    NMT_ASSERT(isnan(got[26]) && isnan(got[27]) && isnan(got[28]));
    if (mode == NMT_PRECISION_FP16) {
      NMT_ASSERT_EQ_INT(h[4], 0x7bff);  /* 65504: the largest half */
      NMT_ASSERT_EQ_INT(h[6], 0x7c00);  /* 65520: inf */
      NMT_ASSERT_EQ_INT(h[7], 0xfc00);  /* -65520: -inf */
      NMT_ASSERT_EQ_INT(h[12], 0x0001); /* 2^-24: the smallest subnormal */
      NMT_ASSERT_EQ_INT(h[13], 0x0000); /* 2^-25: a tie, to even (0) */
      NMT_ASSERT_EQ_INT(h[1], 0x8000);  /* -0 */
    } else {
      NMT_ASSERT_EQ_INT(h[8], 0x47c3);  /* 1e5 = 0x47c35000 rounds down */
      NMT_ASSERT_EQ_INT(h[24], 0x7f80); /* inf */
    }
  }
  /* Every half pattern: the reference's own decoder agrees with the one above, and encoding the
   * decoded value gives the pattern back (NaNs aside, which become the canonical 0x7fff). */
  for (int k = 0; k < 2 && !nmt_test_failed(); k++) {
    const nmt_precision mode = HALF_MODES[k];
    for (uint32_t p = 0; p < 65536; p++) {
      const float v = decode(mode, (uint16_t)p);
      const float r = mode == NMT_PRECISION_FP16 ? nmt_half_fp16_value((uint16_t)p)
                                                 : nmt_half_bf16_value((uint16_t)p);
      const uint16_t back =
          mode == NMT_PRECISION_FP16 ? nmt_half_fp16_bits(v) : nmt_half_bf16_bits(v);
      if (isnan(v)) {
        if (!isnan(r) || back != 0x7fff)
          nmt_test_fail(__FILE__, __LINE__, "%s NaN pattern 0x%04x: value %g, re-encoded 0x%04x",
                        mode_name(mode), p, r, back);
      } else if (fbits(r) != fbits(v) || back != p) {
        nmt_test_fail(__FILE__, __LINE__,
                      "%s pattern 0x%04x: decoded %g (want %g), re-encoded 0x%04x",
                      mode_name(mode), p, r, v, back);
      }
      if (nmt_test_failed()) break;
    }
  }
  free(x), free(want), free(got), free(h);
}

/* ------------------------------------------------------------------------------------------ */
/* matmul reads the registered copy */

enum { MM_M = 7, MM_K = 40, MM_N = 24, MM_BUF = 4000, MM_OFF = 1357 /* mid-buffer, unaligned */ };

typedef struct {
  float out[MM_M * MM_N], relu[MM_M * MM_N];
  float dinp[MM_M * MM_K], dw[MM_N * MM_K], dbias[MM_N];
} mm_result;

/* fwd, fused bias+ReLU fwd and bwd (all three gradients, from fixed starting values) of the
 * weight w on ctx, outputs poisoned first. */
static nmt_status run_mm(void *ctx, const float *w, const float *inp, const float *bias,
                         const float *dout, mm_result *r) {
  fill_nan(r->out, MM_M * MM_N);
  fill_nan(r->relu, MM_M * MM_N);
  fill_randn(r->dinp, MM_M * MM_K, 61, 0.5f);
  fill_randn(r->dw, MM_N * MM_K, 62, 0.5f);
  fill_randn(r->dbias, MM_N, 63, 0.5f);
  NMT_TRY(nmt_backend_ref.matmul_fwd(ctx, r->out, inp, w, bias, MM_M, MM_K, MM_N));
  NMT_TRY(nmt_backend_ref.matmul_bias_relu_fwd(ctx, r->relu, inp, w, bias, MM_M, MM_K, MM_N));
  return nmt_backend_ref.matmul_bwd(ctx, r->dinp, r->dw, r->dbias, dout, inp, w, MM_M, MM_K, MM_N);
}

static int same_mm(const char *what, const mm_result *a, const mm_result *b) {
  char name[96];
  const struct {
    const char *field;
    const float *x, *y;
    size_t n;
  } f[] = {{"matmul_fwd", a->out, b->out, MM_M * MM_N},
           {"matmul_bias_relu_fwd", a->relu, b->relu, MM_M * MM_N},
           {"matmul_bwd dinp", a->dinp, b->dinp, MM_M * MM_K},
           {"matmul_bwd dw", a->dw, b->dw, MM_N * MM_K},
           {"matmul_bwd dbias", a->dbias, b->dbias, MM_N}};
  for (size_t i = 0; i < sizeof f / sizeof *f; i++) {
    snprintf(name, sizeof name, "%s: %s", what, f[i].field);
    if (!same_bits(name, f[i].x, f[i].y, f[i].n)) return 0;
  }
  return 1;
}

/* A current copy is bitwise the per-call rounding; a stale one is read as it is. */
NMT_TEST(half_weights_matmul_reads_the_registered_copy) {
  static float buf[MM_BUF];
  static uint16_t half[MM_BUF];
  static mm_result plain, cached, stale, fresh;
  float inp[MM_M * MM_K], bias[MM_N], dout[MM_M * MM_N];
  fill_randn(inp, MM_M * MM_K, 51, 1.0f);
  fill_randn(bias, MM_N, 52, 0.3f);
  fill_randn(dout, MM_M * MM_N, 53, 1.0f);
  for (int k = 0; k < 2; k++) {
    const nmt_precision mode = HALF_MODES[k];
    void *ctx = ctx_in(mode), *plain_ctx = ctx_in(mode);
    if (!ctx || !plain_ctx) {
      nmt_ref_ctx_destroy(ctx);
      nmt_ref_ctx_destroy(plain_ctx);
      return;
    }
    fill_randn(buf, MM_BUF, 50 + k, 0.2f);
    float *w = buf + MM_OFF;
    nmt_status s = nmt_backend_ref.cast_half(ctx, half, buf, MM_BUF);
    if (s == NMT_OK) s = nmt_backend_ref.half_weights(ctx, buf, half, MM_BUF);
    if (s == NMT_OK) s = run_mm(plain_ctx, w, inp, bias, dout, &plain);
    if (s == NMT_OK) s = run_mm(ctx, w, inp, bias, dout, &cached);
    /* Stale: the fp32 weight moves on and the copy is not refreshed. The registered context
     * must still give exactly the old weight's results; a context without a copy, the new. */
    for (int i = 0; i < MM_N * MM_K; i++) w[i] = w[i] * 1.5f + 0.01f;
    if (s == NMT_OK) s = run_mm(ctx, w, inp, bias, dout, &stale);
    if (s == NMT_OK) s = run_mm(plain_ctx, w, inp, bias, dout, &fresh);
    nmt_ref_ctx_destroy(ctx);
    nmt_ref_ctx_destroy(plain_ctx);
    NMT_ASSERT_OK(s);
    char what[64];
    snprintf(what, sizeof what, "%s current copy", mode_name(mode));
    if (!same_mm(what, &cached, &plain)) return;
    snprintf(what, sizeof what, "%s stale copy vs the old weight", mode_name(mode));
    if (!same_mm(what, &stale, &plain)) return;
    /* ... which is not what the new weight gives (dw and dbias do not read w). */
    const size_t d_out = count_diff(stale.out, fresh.out, MM_M * MM_N);
    const size_t d_dinp = count_diff(stale.dinp, fresh.dinp, MM_M * MM_K);
    printf("# %s stale copy: %zu of %d outputs and %zu of %d dinp differ from the new weight's\n",
           mode_name(mode), d_out, MM_M * MM_N, d_dinp, MM_M * MM_K);
    NMT_ASSERT(d_out > MM_M * MM_N / 2 && d_dinp > MM_M * MM_K / 2);
    NMT_ASSERT(count_diff(stale.relu, fresh.relu, MM_M * MM_N) > 0);
  }
}

/* The range test: a weight ending exactly at the registered end is read from the copy; one
 * that runs past it, or starts before the registered buffer, is rounded from fp32. */
NMT_TEST(half_weights_matmul_copy_range) {
  static float buf[MM_BUF], orig[MM_BUF];
  static uint16_t half[MM_BUF];
  static mm_result got, want;
  const size_t len = MM_N * MM_K, n_reg = 3000, lo = 100;
  float inp[MM_M * MM_K], dout[MM_M * MM_N];
  fill_randn(inp, MM_M * MM_K, 71, 1.0f);
  fill_randn(dout, MM_M * MM_N, 72, 1.0f);
  void *ctx = ctx_in(NMT_PRECISION_BF16), *plain_ctx = ctx_in(NMT_PRECISION_BF16);
  if (!ctx || !plain_ctx) {
    nmt_ref_ctx_destroy(ctx);
    nmt_ref_ctx_destroy(plain_ctx);
    return;
  }
  fill_randn(buf, MM_BUF, 73, 0.2f);
  nmt_status s = nmt_backend_ref.cast_half(ctx, half + lo, buf + lo, n_reg);
  if (s == NMT_OK) s = nmt_backend_ref.half_weights(ctx, buf + lo, half + lo, n_reg);
  /* Make the whole copy stale: any element read from it shows. */
  memcpy(orig, buf, sizeof buf);
  for (int i = 0; i < MM_BUF; i++) buf[i] = buf[i] * 2.0f + 0.125f;
  struct {
    size_t off;
    int from_copy;
  } cases[] = {{lo + n_reg - len, 1}, {lo, 1}, {lo + n_reg - len + 1, 0}, {lo - 1, 0}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases && s == NMT_OK; c++) {
    /* From the copy: the results of the weight as it was at the cast. */
    const float *w = buf + cases[c].off, *as_cast = orig + cases[c].off;
    s = run_mm(ctx, w, inp, NULL, dout, &got);
    if (s == NMT_OK)
      s = run_mm(plain_ctx, cases[c].from_copy ? as_cast : w, inp, NULL, dout, &want);
    if (s != NMT_OK) break;
    char what[64];
    snprintf(what, sizeof what, "weight at offset %zu (%s)", cases[c].off,
             cases[c].from_copy ? "inside: from the copy" : "straddling: from fp32");
    if (!same_mm(what, &got, &want)) break;
  }
  nmt_ref_ctx_destroy(ctx);
  nmt_ref_ctx_destroy(plain_ctx);
  NMT_ASSERT_OK(s);
}

/* ------------------------------------------------------------------------------------------ */
/* adamw's half_out */

NMT_TEST(half_weights_adamw_half_out_is_cast_of_new_params) {
  enum { N = 5003 };
  static float p[N], p_plain[N], g[N], m[N], v[N], m2[N], v2[N];
  static uint16_t out[N], want[N], before[N];
  for (int k = 0; k < 2; k++) {
    const nmt_precision mode = HALF_MODES[k];
    void *ctx = ctx_in(mode);
    if (!ctx) return;
    fill_randn(p, N, 81 + k, 0.1f);
    fill_randn(g, N, 83, 1.0f);
    memset(m, 0, sizeof m);
    memset(v, 0, sizeof v);
    memset(m2, 0, sizeof m2);
    memset(v2, 0, sizeof v2);
    p[7] = 7e4f; /* fp16: stays above 65520 through the updates, so its half is inf */
    memcpy(p_plain, p, sizeof p);
    nmt_status s = NMT_OK;
    for (long step = 1; step <= 3 && s == NMT_OK; step++) {
      memset(out, 0x5a, sizeof out);
      s = nmt_backend_ref.adamw(ctx, p, g, m, v, N, 1e-3f, 0.9f, 0.98f, 1e-9f, 0.01f, 0.5f, NULL,
                                out, step);
      /* The same update without a copy (fp32 context): half_out must not change it. */
      if (s == NMT_OK)
        s = nmt_ref_adamw(NULL, p_plain, g, m2, v2, N, 1e-3f, 0.9f, 0.98f, 1e-9f, 0.01f, 0.5f,
                          NULL, NULL, step);
      if (s == NMT_OK) s = nmt_backend_ref.cast_half(ctx, want, p, N);
      if (s != NMT_OK) break;
      if (memcmp(p, p_plain, sizeof p) || memcmp(m, m2, sizeof m) || memcmp(v, v2, sizeof v)) {
        nmt_test_fail(__FILE__, __LINE__, "%s step %ld: half_out changed the update",
                      mode_name(mode), step);
        break;
      }
      for (int i = 0; i < N; i++)
        if (out[i] != want[i]) {
          nmt_test_fail(__FILE__, __LINE__,
                        "%s step %ld: half_out[%d] = 0x%04x, cast_half of the new param %.9g "
                        "= 0x%04x",
                        mode_name(mode), step, i, out[i], p[i], want[i]);
          break;
        }
      if (nmt_test_failed()) break;
    }
    if (s == NMT_OK && !nmt_test_failed() && mode == NMT_PRECISION_FP16)
      NMT_ASSERT_EQ_INT(out[7], 0x7c00);
    /* A skipped step (step_control's verdict) writes neither the parameters nor the copy. */
    nmt_step_ctl ctl;
    memset(&ctl, 0, sizeof ctl);
    ctl.skip = 1;
    ctl.coef = 1.0f;
    memcpy(before, out, sizeof out);
    memcpy(p_plain, p, sizeof p);
    if (s == NMT_OK && !nmt_test_failed())
      s = nmt_backend_ref.adamw(ctx, p, g, m, v, N, 1e-3f, 0.9f, 0.98f, 1e-9f, 0.01f, 0.5f, &ctl,
                                out, 4);
    nmt_ref_ctx_destroy(ctx);
    NMT_ASSERT_OK(s);
    if (nmt_test_failed()) return;
    NMT_ASSERT(memcmp(before, out, sizeof out) == 0);
    NMT_ASSERT(memcmp(p_plain, p, sizeof p) == 0);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* misuse */

NMT_TEST(half_weights_misuse_errors) {
  float src[64] = {0}, g[64] = {0}, m[64] = {0}, v[64] = {0};
  uint16_t dst[64];
  const nmt_backend *be = &nmt_backend_ref;
  NMT_ASSERT(be->half_weights == nmt_ref_half_weights && be->cast_half == nmt_ref_cast_half);
  /* A NULL context is fp32: nothing to register, no half type; unregistering is harmless. */
  NMT_ASSERT_EQ_STATUS(be->half_weights(NULL, src, dst, 64), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(be->cast_half(NULL, dst, src, 64), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(be->adamw(NULL, src, g, m, v, 64, 1e-3f, 0.9f, 0.98f, 1e-9f, 0, 1, NULL,
                                 dst, 1),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(be->half_weights(NULL, NULL, NULL, 0));
  /* fp32 and tf32 contexts: the same. adamw refuses before it writes anything, also on a step
   * the verdict would skip. */
  const nmt_precision full[2] = {NMT_PRECISION_FP32, NMT_PRECISION_TF32};
  for (int k = 0; k < 2; k++) {
    void *ctx = ctx_in(full[k]);
    if (!ctx) return;
    nmt_step_ctl ctl;
    memset(&ctl, 0, sizeof ctl);
    ctl.skip = 1;
    src[0] = 1.0f;
    g[0] = 1.0f;
    nmt_status a = be->half_weights(ctx, src, dst, 64);
    nmt_status b = be->cast_half(ctx, dst, src, 64);
    nmt_status c = be->adamw(ctx, src, g, m, v, 64, 1e-3f, 0.9f, 0.98f, 1e-9f, 0, 1, NULL, dst, 1);
    nmt_status d = be->adamw(ctx, src, g, m, v, 64, 1e-3f, 0.9f, 0.98f, 1e-9f, 0, 1, &ctl, dst, 1);
    nmt_status e = be->half_weights(ctx, NULL, NULL, 0);
    nmt_ref_ctx_destroy(ctx);
    NMT_ASSERT_EQ_STATUS(a, NMT_ERR_INTERNAL);
    NMT_ASSERT_EQ_STATUS(b, NMT_ERR_INTERNAL);
    NMT_ASSERT_EQ_STATUS(c, NMT_ERR_INTERNAL);
    NMT_ASSERT_EQ_STATUS(d, NMT_ERR_INTERNAL);
    NMT_ASSERT_OK(e);
    NMT_ASSERT(src[0] == 1.0f && m[0] == 0.0f);
  }
  /* fp16: bad arguments, one registration per context, and no switch of half type under a
   * registered copy. */
  void *ctx = ctx_in(NMT_PRECISION_FP16);
  if (!ctx) return;
  nmt_status st[10];
  st[0] = be->half_weights(ctx, src, NULL, 64);
  st[1] = be->half_weights(ctx, src, dst, 0);
  st[2] = be->cast_half(ctx, NULL, src, 64);
  st[3] = be->cast_half(ctx, NULL, NULL, 0); /* nothing to do */
  st[4] = be->half_weights(ctx, src, dst, 64);
  st[5] = be->half_weights(ctx, src, dst, 64); /* a second registration */
  st[6] = nmt_ref_set_precision(ctx, NMT_PRECISION_BF16);
  st[7] = nmt_ref_set_precision(ctx, NMT_PRECISION_FP16); /* the same type: fine */
  st[8] = be->half_weights(ctx, NULL, NULL, 0);
  st[9] = nmt_ref_set_precision(ctx, NMT_PRECISION_BF16); /* unregistered: fine */
  nmt_ref_ctx_destroy(ctx);
  const nmt_status want[10] = {NMT_ERR_INTERNAL, NMT_ERR_INTERNAL, NMT_ERR_INTERNAL, NMT_OK,
                               NMT_OK, NMT_ERR_INTERNAL, NMT_ERR_INTERNAL, NMT_OK, NMT_OK,
                               NMT_OK};
  for (int i = 0; i < 10; i++)
    if (st[i] != want[i])
      nmt_test_fail(__FILE__, __LINE__, "call %d: %s, want %s", i, nmt_status_str(st[i]),
                    nmt_status_str(want[i]));
}

/* ------------------------------------------------------------------------------------------ */
/* the engine keeps the copy current */

/* Trains 3 steps (2 CPU workers, dropout on) in `mode`, evaluates through the copy adamw kept;
 * then a trainer resumed from the step-3 checkpoint, whose copy is cast fresh from the loaded
 * parameters, evaluates the same weights: the two losses must be bitwise equal. A trainer that
 * stopped refreshing the copy would evaluate the initial weights' copy the first time. */
static void engine_copy_current(nmt_precision mode) {
  char dir[600], shard[700];
  snprintf(dir, sizeof dir, "%s/%s", nmt_test_tmpdir(), mode_name(mode));
  snprintf(shard, sizeof shard, "%s.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 64, 5));
  nmt_config c;
  nmt_th_tiny_config(&c, dir, shard);
  snprintf(c.data_valid, sizeof c.data_valid, "%s", shard);
  c.model_enc_layers = 1;
  c.model_dec_layers = 1;
  c.model_dropout = 0.1f;
  c.train_max_steps = 3;
  c.train_warmup_steps = 2;
  c.train_lr_scale = 4;
  c.parallel_devices = 2;
  c.precision_mode = mode;
  c.precision_loss_scale = 64; /* no overflow: every step updates */
  c.run_seed = 3;
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  double loss[2] = {0, 0}, nll[2] = {0, 0};
  for (int run = 0; run < 2; run++) {
    c.run_resume = run;
    nmt_trainer *t = NULL;
    nmt_status s = nmt_trainer_create(&c, &o, &t);
    if (s == NMT_OK && run == 0) s = nmt_trainer_run(t);
    if (s == NMT_OK && nmt_trainer_step(t) != 3)
      s = nmt_errorf(NMT_ERR_INTERNAL, "run %d at step %ld, want 3", run, nmt_trainer_step(t));
    if (s == NMT_OK) s = nmt_trainer_evaluate(t, &loss[run], &nll[run], NULL);
    nmt_trainer_destroy(t);
    NMT_ASSERT_OK(s);
  }
  printf("# %s: validation loss %.9g after training, %.9g resumed\n", mode_name(mode), loss[0],
         loss[1]);
  NMT_ASSERT(isfinite(loss[0]));
  NMT_ASSERT(loss[0] == loss[1] && nll[0] == nll[1]);
}

NMT_TEST(half_weights_engine_copy_current_bf16) { engine_copy_current(NMT_PRECISION_BF16); }
NMT_TEST(half_weights_engine_copy_current_fp16) { engine_copy_current(NMT_PRECISION_FP16); }

/* ------------------------------------------------------------------------------------------ */
/* inference: the decoder rig's copy (src/engine/translate_batch.c nmt__rig_half_weights) */

/* One batch of 4 sources through the rig's beam search (scores wanted: beam 4); ids, lengths
 * and scores into out (4 x (max_out + 2) ints, scores as their bits). */
static nmt_status rig_run(nmt__rig *r, const nmt__sentence *s, int32_t *out) {
  nmt__hyps h;
  const int order[4] = {0, 1, 2, 3}, max_out = r->cfg->data_max_len - 1;
  NMT_TRY(nmt__hyps_alloc(&h, 4, 1, max_out));
  nmt_status st = nmt__rig_decode(r, s, order, 4, &h);
  for (int i = 0; i < 4 && st == NMT_OK; i++) {
    int32_t *o = out + (size_t)i * (max_out + 2);
    o[0] = h.len[i];
    memcpy(&o[1], &h.score[i], sizeof(float));
    for (int j = 0; j < max_out; j++) o[2 + j] = j < h.len[i] ? h.ids[(size_t)i * max_out + j] : -1;
  }
  nmt__hyps_free(&h);
  return st;
}

/* The rig cases' inputs: the tiny config with beam 4 over batches of 4, two parameter sets
 * (seeds 3 and 4; malloc'ed, NULL when out of memory) and 4 short sentences over ids. */
typedef struct {
  nmt_config c;
  float *pa, *pb;
  nmt__sentence s[4];
  int32_t ids[4][6];
} rig_inputs;

static void rig_case_inputs(rig_inputs *in) {
  nmt_config *c = &in->c;
  nmt_th_tiny_config(c, "/nonexistent", "/nonexistent");
  c->decode_beam = 4;
  c->decode_batch_sentences = 4;
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(c, &mc);
  const size_t n = nmt_model_num_params(&mc);
  in->pa = malloc(n * sizeof(float)), in->pb = malloc(n * sizeof(float));
  if (!in->pa || !in->pb) return;
  nmt_model_init_params(&mc, 3, in->pa);
  nmt_model_init_params(&mc, 4, in->pb);
  for (int i = 0; i < 4; i++) {
    in->s[i] = (nmt__sentence){in->ids[i], 3 + i % 3, i + 1};
    for (int j = 0; j < 6; j++)
      in->ids[i][j] = 4 + (int32_t)(nmt_rng_u32(5, (uint64_t)i, j) % 36);
  }
}

/* A rig in fp16/bf16 (the reference plays a GPU: its inference contexts are fp32 otherwise)
 * decodes bitwise as every GEMM rounding its weights once the half copy is made, and a new
 * load refreshes the copy: decoding the second parameters through it equals a fresh rig of
 * them without a copy, and differs from the first (a copy left stale would give those). */
static void rig_half_case(nmt_precision mode) {
  rig_inputs in;
  rig_case_inputs(&in);
  NMT_ASSERT(in.pa && in.pb);
  const size_t per = (size_t)in.c.data_max_len + 1, n_out = 4 * per;
  int32_t *out[5];
  for (int k = 0; k < 5; k++) NMT_ASSERT((out[k] = calloc(n_out, sizeof(int32_t))) != NULL);
  nmt__rig r, r2;
  NMT_ASSERT_OK(nmt__rig_open_on(&r, &in.c, &nmt_backend_ref, NULL, in.pa, 1, 1));
  NMT_ASSERT(r.half == NULL); /* the reference infers in fp32 */
  NMT_ASSERT_OK(r.dev.be->set_precision(r.dev.ctx, mode));
  NMT_ASSERT_OK(rig_run(&r, in.s, out[0])); /* rounding at every GEMM */
  NMT_ASSERT_OK(nmt__rig_half_weights(&r));
  NMT_ASSERT(r.half != NULL);
  NMT_ASSERT_EQ_STATUS(nmt__rig_half_weights(&r), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(rig_run(&r, in.s, out[1])); /* through the copy */
  NMT_ASSERT_OK(nmt__rig_load(&r, in.pb));
  NMT_ASSERT_OK(rig_run(&r, in.s, out[2]));
  nmt__rig_close(&r);
  NMT_ASSERT_OK(nmt__rig_open_on(&r2, &in.c, &nmt_backend_ref, NULL, in.pb, 1, 1));
  NMT_ASSERT_OK(r2.dev.be->set_precision(r2.dev.ctx, mode));
  NMT_ASSERT_OK(rig_run(&r2, in.s, out[3]));
  NMT_ASSERT_OK(r2.dev.be->set_precision(r2.dev.ctx, NMT_PRECISION_FP32));
  NMT_ASSERT_OK(rig_run(&r2, in.s, out[4]));
  nmt__rig_close(&r2);
  NMT_ASSERT(!memcmp(out[0], out[1], n_out * sizeof(int32_t)));
  NMT_ASSERT(!memcmp(out[2], out[3], n_out * sizeof(int32_t)));
  NMT_ASSERT(memcmp(out[1], out[2], n_out * sizeof(int32_t)) != 0);
  /* the rounding is real: fp32 scores differ from the half ones */
  NMT_ASSERT(memcmp(out[3], out[4], n_out * sizeof(int32_t)) != 0);
  printf("# %s: the rig's half copy decodes as rounding at every GEMM; a load refreshes it\n",
         mode_name(mode));
  for (int k = 0; k < 5; k++) free(out[k]);
  free(in.pa), free(in.pb);
}

/* The same refresh on a GPU, where inference in fp16/bf16 makes the half copy at open
 * (nmt__rig_open_on): after a load of other parameters the rig decodes as a fresh rig of
 * them, and not as before the load (a stale copy would). */
static void cuda_rig_refresh_case(nmt_precision mode) {
  const nmt_backend *cuda = nmt_backend_cuda_get();
  int n_dev = 0;
  if (!cuda || cuda->device_count(&n_dev) != NMT_OK || n_dev < 1) NMT_SKIP("no CUDA device");
  rig_inputs in;
  rig_case_inputs(&in);
  NMT_ASSERT(in.pa && in.pb);
  in.c.precision_mode = mode;
  const size_t per = (size_t)in.c.data_max_len + 1, n_out = 4 * per;
  int32_t *out[3];
  for (int k = 0; k < 3; k++) NMT_ASSERT((out[k] = calloc(n_out, sizeof(int32_t))) != NULL);
  nmt__rig r, r2;
  NMT_ASSERT_OK(nmt__rig_open_on(&r, &in.c, cuda, NULL, in.pa, 1, 1));
  NMT_ASSERT(r.half != NULL); /* made at open in fp16/bf16 */
  NMT_ASSERT_OK(rig_run(&r, in.s, out[0]));
  NMT_ASSERT_OK(nmt__rig_load(&r, in.pb));
  NMT_ASSERT_OK(rig_run(&r, in.s, out[1]));
  nmt__rig_close(&r);
  NMT_ASSERT_OK(nmt__rig_open_on(&r2, &in.c, cuda, NULL, in.pb, 1, 1));
  NMT_ASSERT_OK(rig_run(&r2, in.s, out[2]));
  nmt__rig_close(&r2);
  printf("# cuda %s: after a load the rig decodes as a fresh rig of the new parameters (%s), "
         "not as before (%s)\n", mode_name(mode),
         memcmp(out[1], out[2], n_out * sizeof(int32_t)) ? "no" : "yes",
         memcmp(out[0], out[1], n_out * sizeof(int32_t)) ? "right" : "wrong");
  NMT_ASSERT(!memcmp(out[1], out[2], n_out * sizeof(int32_t)));
  NMT_ASSERT(memcmp(out[0], out[1], n_out * sizeof(int32_t)) != 0);
  for (int k = 0; k < 3; k++) free(out[k]);
  free(in.pa), free(in.pb);
}

/* The reference playing a device whose inference contexts compute in half (is_host = 0: the
 * rig then makes its copy at open, as on a GPU), with cast_half watched: every cast must read
 * the parameters uploaded last (`cast_expect`), never what the buffer held before. */
static nmt_backend ref_as_device;
static const float *cast_expect;
static size_t cast_n;
static int casts, stale_casts;

static nmt_status watched_cast_half(void *ctx, void *dst, const float *src, size_t n) {
  casts++;
  if (!cast_expect || n != cast_n || memcmp(src, cast_expect, n * sizeof(float)) != 0)
    stale_casts++;
  return nmt_backend_ref.cast_half(ctx, dst, src, n);
}

/* A rig opened in fp16/bf16 uploads its parameters before it makes the half copy from them:
 * one cast at open, of the uploaded parameters (the copy made first would cast the device
 * buffer's earlier contents, then again at the load), and one per later load, of the new
 * parameters; the copy holds their rounding both times. */
static void rig_open_cast_case(nmt_precision mode) {
  rig_inputs in;
  rig_case_inputs(&in);
  NMT_ASSERT(in.pa && in.pb);
  in.c.precision_mode = mode;
  ref_as_device = nmt_backend_ref;
  ref_as_device.is_host = 0;
  ref_as_device.cast_half = watched_cast_half;
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(&in.c, &mc);
  const size_t n = nmt_model_num_params(&mc);
  casts = stale_casts = 0;
  cast_expect = in.pa, cast_n = n;
  nmt__rig r;
  nmt_status s = nmt__rig_open_on(&r, &in.c, &ref_as_device, NULL, in.pa, 1, 1);
  const int open_casts = casts, open_stale = stale_casts, made = r.half != NULL;
  int copy_ok = 0, load_ok = 0;
  if (s == NMT_OK && made)
    copy_ok = nmt_tg_same_half(mode, "copy after open", r.half, in.pa, n);
  cast_expect = in.pb;
  if (s == NMT_OK) s = nmt__rig_load(&r, in.pb);
  if (s == NMT_OK && made) load_ok = nmt_tg_same_half(mode, "copy after load", r.half, in.pb, n);
  const int all_casts = casts, all_stale = stale_casts;
  nmt__rig_close(&r);
  cast_expect = NULL;
  free(in.pa), free(in.pb);
  printf("# %s: %d cast(s) at open (%d of parameters not uploaded yet), %d after one load "
         "(%d stale)\n", mode_name(mode), open_casts, open_stale, all_casts, all_stale);
  NMT_ASSERT_OK(s);
  NMT_ASSERT(made);
  NMT_ASSERT_EQ_INT(open_stale, 0);
  NMT_ASSERT_EQ_INT(open_casts, 1);
  NMT_ASSERT_EQ_INT(all_stale, 0);
  NMT_ASSERT_EQ_INT(all_casts, 2);
  NMT_ASSERT(copy_ok && load_ok);
}

NMT_TEST(half_weights_rig_open_casts_uploaded_bf16) { rig_open_cast_case(NMT_PRECISION_BF16); }
NMT_TEST(half_weights_rig_open_casts_uploaded_fp16) { rig_open_cast_case(NMT_PRECISION_FP16); }
NMT_TEST(cuda_rig_half_copy_refresh_bf16) { cuda_rig_refresh_case(NMT_PRECISION_BF16); }
NMT_TEST(cuda_rig_half_copy_refresh_fp16) { cuda_rig_refresh_case(NMT_PRECISION_FP16); }
NMT_TEST(half_weights_rig_bf16) { rig_half_case(NMT_PRECISION_BF16); }
NMT_TEST(half_weights_rig_fp16) { rig_half_case(NMT_PRECISION_FP16); }
