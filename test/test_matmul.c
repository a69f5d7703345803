/* test/test_matmul.c — linear layer: forward vs a naive double product, backward vs central
 * finite differences of a double mirror, accumulation and NULL-gradient skipping; the fp16/bf16
 * emulation: the rounding helpers against IEEE facts and two independent conversions (gcc's
 * _Float16 and a rounding written on values), the emulated GEMMs against fp32 GEMMs of
 * pre-rounded inputs, fp16 overflow to inf, and the reference context's modes; the ReLU-fused
 * forward (matmul_bias_relu_fwd) against the two ops it replaces and a double product. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/half.h"
#include "nmt/ref.h"
#include "test.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float rnd(void) { /* uniform in [-1, 1) */
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (float)((rng_state >> 40) * 0x1p-24 * 2.0 - 1.0);
}
static void fill(float *x, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = rnd();
}

/* out = inp w^T + bias in double. */
static void naive_linear(double *out, const float *inp, const float *w, const float *bias, int M,
                         int K, int N) {
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      double s = bias ? bias[n] : 0.0;
      for (int k = 0; k < K; k++) s += (double)inp[m * K + k] * w[n * K + k];
      out[m * N + n] = s;
    }
}

static void check_fwd(int M, int K, int N, int with_bias) {
  float *inp = malloc(sizeof(float) * M * K), *w = malloc(sizeof(float) * N * K);
  float *bias = malloc(sizeof(float) * N), *out = malloc(sizeof(float) * M * N);
  double *want = malloc(sizeof(double) * M * N), *got = malloc(sizeof(double) * M * N);
  fill(inp, (size_t)M * K);
  fill(w, (size_t)N * K);
  fill(bias, (size_t)N);
  for (int i = 0; i < M * N; i++) out[i] = NAN; /* forward must overwrite, not accumulate */
  NMT_ASSERT_OK(nmt_ref_matmul_fwd(NULL, out, inp, w, with_bias ? bias : NULL, M, K, N));
  naive_linear(want, inp, w, with_bias ? bias : NULL, M, K, N);
  for (int i = 0; i < M * N; i++) got[i] = out[i];
  nmt_test_close_d(__FILE__, __LINE__, "matmul out", got, want, (size_t)M * N, 1e-5, 1e-5);
  free(inp), free(w), free(bias), free(out), free(want), free(got);
}

NMT_TEST(matmul_fwd_vs_naive) {
  check_fwd(5, 7, 6, 1);
  if (nmt_test_failed()) return;
  check_fwd(5, 7, 6, 0);
  if (nmt_test_failed()) return;
  check_fwd(67, 129, 83, 1); /* big enough for BLAS blocking and edge tiles */
}

/* L = sum(out * R) over the double mirror; the three inputs are perturbed in place. */
typedef struct {
  int M, K, N;
  double *inp, *w, *bias, *R;
} lin_prob;

static double objective(const lin_prob *p) {
  double L = 0;
  for (int m = 0; m < p->M; m++)
    for (int n = 0; n < p->N; n++) {
      double s = p->bias[n];
      for (int k = 0; k < p->K; k++) s += p->inp[m * p->K + k] * p->w[n * p->K + k];
      L += s * p->R[m * p->N + n];
    }
  return L;
}

static void fd(lin_prob *p, double *x, size_t n, double *g) {
  const double h = 1e-4; /* L is bilinear: central differences are exact up to rounding */
  for (size_t i = 0; i < n; i++) {
    double s = x[i];
    x[i] = s + h;
    double lp = objective(p);
    x[i] = s - h;
    double lm = objective(p);
    x[i] = s;
    g[i] = (lp - lm) / (2 * h);
  }
}

static void to_d(double *d, const float *f, size_t n) {
  for (size_t i = 0; i < n; i++) d[i] = f[i];
}

/* (grad - base) / calls, to compare an accumulated gradient with one FD gradient. */
static void delta(double *d, const float *g, const float *base, size_t n, int calls) {
  for (size_t i = 0; i < n; i++) d[i] = ((double)g[i] - base[i]) / calls;
}

NMT_TEST(matmul_bwd_fd_and_accumulate) {
  enum { M = 4, K = 5, N = 3 };
  float inp[M * K], w[N * K], bias[N], R[M * N];
  fill(inp, M * K), fill(w, N * K), fill(bias, N), fill(R, M * N);
  double dinp_d[M * K], dw_d[N * K], db_d[N], R_d[M * N];
  lin_prob p = {M, K, N, dinp_d, dw_d, db_d, R_d};
  to_d(p.inp, inp, M * K), to_d(p.w, w, N * K), to_d(p.bias, bias, N), to_d(p.R, R, M * N);
  double g_inp[M * K], g_w[N * K], g_b[N];
  fd(&p, p.inp, M * K, g_inp);
  fd(&p, p.w, N * K, g_w);
  fd(&p, p.bias, N, g_b);

  /* Gradients start from a random baseline and get two backward calls: accumulation must give
   * baseline + 2 * grad. */
  float dinp[M * K], dw[N * K], db[N], b_inp[M * K], b_w[N * K], b_b[N];
  fill(b_inp, M * K), fill(b_w, N * K), fill(b_b, N);
  memcpy(dinp, b_inp, sizeof dinp), memcpy(dw, b_w, sizeof dw), memcpy(db, b_b, sizeof db);
  for (int c = 0; c < 2; c++)
    NMT_ASSERT_OK(nmt_ref_matmul_bwd(NULL, dinp, dw, db, R, inp, w, M, K, N));
  double got[M * K];
  delta(got, dinp, b_inp, M * K, 2);
  if (!nmt_test_close_d(__FILE__, __LINE__, "dinp", got, g_inp, M * K, 1e-5, 1e-4)) return;
  delta(got, dw, b_w, N * K, 2);
  if (!nmt_test_close_d(__FILE__, __LINE__, "dw", got, g_w, N * K, 1e-5, 1e-4)) return;
  delta(got, db, b_b, N, 2);
  if (!nmt_test_close_d(__FILE__, __LINE__, "dbias", got, g_b, N, 1e-5, 1e-4)) return;

  /* NULL gradients are skipped; the others are still produced. */
  float dw2[N * K];
  memset(dw2, 0, sizeof dw2);
  NMT_ASSERT_OK(nmt_ref_matmul_bwd(NULL, NULL, dw2, NULL, R, inp, w, M, K, N));
  to_d(got, dw2, N * K);
  nmt_test_close_d(__FILE__, __LINE__, "dw only", got, g_w, N * K, 1e-5, 1e-4);
}

NMT_TEST(matmul_bad_shape) {
  float x = 0;
  NMT_ASSERT_EQ_STATUS(nmt_ref_matmul_fwd(NULL, &x, &x, &x, NULL, -1, 1, 1), NMT_ERR_INTERNAL);
}

/* ------------------------------------------------------------------------------------------ */
/* fp16 / bf16: the rounding helpers and the emulated GEMMs (nmt/ref.h) */

static uint32_t fbits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

static float ffrom(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

/* Same value and same sign (so -0 != +0), or both NaN. */
static int same_value(float a, float b) {
  return (isnan(a) && isnan(b)) || fbits(a) == fbits(b);
}

#define ASSERT_ROUNDS(fn, x, want)                                                            \
  do {                                                                                        \
    const float x_ = (x), want_ = (want), got_ = fn(x_);                                      \
    if (!same_value(got_, want_)) {                                                           \
      nmt_test_fail(__FILE__, __LINE__, "%s(%.9g = 0x%08x) = %.9g (0x%08x), want %.9g (0x%08x)", \
                    #fn, (double)x_, fbits(x_), (double)got_, fbits(got_), (double)want_,     \
                    fbits(want_));                                                            \
      return;                                                                                 \
    }                                                                                         \
  } while (0)

NMT_TEST(matmul_round_fp16_facts) {
  /* Facts of IEEE binary16 (IEEE 754-2008 §3.6): 11 significant bits, emax 15, subnormal step
   * 2^-24, largest finite 65504. */
  ASSERT_ROUNDS(nmt_half_round_fp16, 65504.0f, 65504.0f);
  ASSERT_ROUNDS(nmt_half_round_fp16, 65519.99f, 65504.0f);
  ASSERT_ROUNDS(nmt_half_round_fp16, 65520.0f, INFINITY); /* the tie with 2^16 goes to even */
  ASSERT_ROUNDS(nmt_half_round_fp16, -65520.0f, -INFINITY);
  ASSERT_ROUNDS(nmt_half_round_fp16, 1e5f, INFINITY);
  ASSERT_ROUNDS(nmt_half_round_fp16, INFINITY, INFINITY);
  ASSERT_ROUNDS(nmt_half_round_fp16, -INFINITY, -INFINITY);
  ASSERT_ROUNDS(nmt_half_round_fp16, 0x1p-24f, 0x1p-24f);    /* smallest subnormal survives */
  ASSERT_ROUNDS(nmt_half_round_fp16, 0x1p-25f, 0.0f);        /* tie between 0 and 2^-24: even */
  ASSERT_ROUNDS(nmt_half_round_fp16, 0x1.8p-25f, 0x1p-24f);
  ASSERT_ROUNDS(nmt_half_round_fp16, 0x1p-26f, 0.0f);
  ASSERT_ROUNDS(nmt_half_round_fp16, -0x1p-26f, -0.0f);      /* the sign survives underflow */
  ASSERT_ROUNDS(nmt_half_round_fp16, 0x1p-130f, 0.0f);       /* a float subnormal */
  ASSERT_ROUNDS(nmt_half_round_fp16, 3 * 0x1p-24f, 3 * 0x1p-24f);
  ASSERT_ROUNDS(nmt_half_round_fp16, 2.5f * 0x1p-24f, 2 * 0x1p-24f); /* subnormal tie: even */
  ASSERT_ROUNDS(nmt_half_round_fp16, 3.5f * 0x1p-24f, 4 * 0x1p-24f);
  ASSERT_ROUNDS(nmt_half_round_fp16, 0x1p-14f - 0x1p-25f, 0x1p-14f); /* into the normals */
  ASSERT_ROUNDS(nmt_half_round_fp16, 0x1p-14f, 0x1p-14f);
  ASSERT_ROUNDS(nmt_half_round_fp16, 1.0f + 0x1p-11f, 1.0f);  /* ties to even */
  ASSERT_ROUNDS(nmt_half_round_fp16, 1.0f + 3 * 0x1p-11f, 1.0f + 0x1p-9f);
  ASSERT_ROUNDS(nmt_half_round_fp16, 1.0f + 0x1p-11f + 0x1p-20f, 1.0f + 0x1p-10f);
  ASSERT_ROUNDS(nmt_half_round_fp16, 2049.0f, 2048.0f);
  ASSERT_ROUNDS(nmt_half_round_fp16, 2051.0f, 2052.0f);
  ASSERT_ROUNDS(nmt_half_round_fp16, 0.1f, 0.0999755859375f); /* 0x2e66 */
  ASSERT_ROUNDS(nmt_half_round_fp16, -0.0f, -0.0f);
  NMT_ASSERT(isnan(nmt_half_round_fp16(NAN)));
  NMT_ASSERT(isnan(nmt_half_round_fp16(ffrom(0x7f800001u)))); /* payload only in the low bits */
  NMT_ASSERT(isnan(nmt_half_round_fp16(ffrom(0xffc00000u))));
}

NMT_TEST(matmul_round_bf16_facts) {
  /* bfloat16: the top 16 bits of a float, 8 significant bits. */
  ASSERT_ROUNDS(nmt_half_round_bf16, 1.0f + 0x1p-8f, 1.0f); /* tie to even */
  ASSERT_ROUNDS(nmt_half_round_bf16, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-6f);
  ASSERT_ROUNDS(nmt_half_round_bf16, 1.0f + 0x1p-8f + 0x1p-20f, 1.0f + 0x1p-7f);
  ASSERT_ROUNDS(nmt_half_round_bf16, 1e5f, 99840.0f);       /* no overflow: fp32's range */
  ASSERT_ROUNDS(nmt_half_round_bf16, 0x1.fep127f, 0x1.fep127f);
  ASSERT_ROUNDS(nmt_half_round_bf16, 0x1.ffp127f, INFINITY); /* the tie above the largest: even */
  ASSERT_ROUNDS(nmt_half_round_bf16, -3.4028235e38f, -INFINITY);
  ASSERT_ROUNDS(nmt_half_round_bf16, INFINITY, INFINITY);
  ASSERT_ROUNDS(nmt_half_round_bf16, 0x1p-133f + 0x1p-140f, 0x1p-133f); /* subnormals kept */
  ASSERT_ROUNDS(nmt_half_round_bf16, 0x1p-133f, 0x1p-133f); /* smallest bf16 subnormal */
  ASSERT_ROUNDS(nmt_half_round_bf16, 0x1p-134f, 0.0f);      /* tie with 0: even */
  ASSERT_ROUNDS(nmt_half_round_bf16, 0x1.8p-134f, 0x1p-133f);
  ASSERT_ROUNDS(nmt_half_round_bf16, -0x1p-149f, -0.0f);
  ASSERT_ROUNDS(nmt_half_round_bf16, -0.0f, -0.0f);
  ASSERT_ROUNDS(nmt_half_round_bf16, 0.1f, 0.10009765625f); /* 0x3dcd: the low half 0xcccd > 0x8000 */
  NMT_ASSERT(isnan(nmt_half_round_bf16(NAN)));
  NMT_ASSERT(isnan(nmt_half_round_bf16(ffrom(0x7f800001u)))); /* would round to inf */
  NMT_ASSERT(isnan(nmt_half_round_bf16(ffrom(0xff80ffffu))));
}

/* Nearest of the two neighbours in double (exact for these magnitudes), ties to the one whose
 * last kept bit is even: written on values, not on the float's bits as src/ref/matmul.c. */
static float nearest(double x, double lo, double hi, int lo_even) {
  double dl = x - lo, dh = hi - x;
  if (dl < dh) return (float)lo;
  if (dh < dl) return (float)hi;
  return (float)(lo_even ? lo : hi);
}

/* fp16: |x| in [2^e, 2^(e+1)) has step 2^(e-10) for e >= -14, else 2^-24. */
static float fp16_by_values(float xf) {
  if (isnan(xf)) return xf;
  double x = fabs((double)xf);
  if (isinf(xf)) return xf;
  int e;
  (void)frexp(x, &e); /* x = f * 2^e, f in [0.5, 1) */
  e -= 1;
  double step = ldexp(1.0, (e >= -14 ? e : -14) - 10);
  double k = floor(x / step);
  double r = nearest(x, k * step, (k + 1) * step, fmod(k, 2.0) == 0);
  if (r > 65504.0) r = INFINITY;
  return (float)copysign(r, (double)xf);
}

/* bf16: the truncation and the next bf16 away from zero (2^128 past the largest). */
static float bf16_by_values(float xf) {
  if (isnan(xf) || isinf(xf)) return xf;
  uint32_t t = fbits(fabsf(xf)) & 0xffff0000u;
  double lo = ffrom(t);
  double hi = t + 0x10000u >= 0x7f800000u ? ldexp(1.0, 128) : (double)ffrom(t + 0x10000u);
  double r = nearest(fabs((double)xf), lo, hi, ((t >> 16) & 1u) == 0);
  if (r > 3.4028235e38) r = INFINITY;
  return (float)copysign(r, (double)xf);
}

NMT_TEST(matmul_round_vs_independent) {
  /* Random bit patterns (every exponent, NaNs and infs included), values spread over the
   * fp16 range and its underflow, and exact ties of both formats. */
  enum { N = 600000 };
  size_t bad16 = 0, bad16v = 0, badbf = 0, n_fp16_ties = 0;
  for (size_t i = 0; i < N; i++) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    uint32_t u = (uint32_t)(rng_state >> 16);
    float x;
    switch (i % 4) {
      case 0: x = ffrom(u); break;
      case 1: x = ldexpf(1.0f + (float)(u & 0xffff) * 0x1p-16f, (int)((u >> 16) % 48) - 30);
              if (u & 0x80000000u) x = -x;
              break;
      case 2: x = ffrom((u & 0x8fffe000u) | 0x1000u | 0x30000000u); /* fp16 tie bits (normals) */
              n_fp16_ties++;
              break;
      default: x = ffrom((u & 0xffff0000u) | 0x8000u); break; /* bf16 ties */
    }
    float r16 = nmt_half_round_fp16(x), rbf = nmt_half_round_bf16(x);
#ifdef __FLT16_MAX__
    /* gcc's _Float16 conversion (libgcc's __truncsfhf2, or F16C): an independent
     * implementation of the same IEEE rounding. */
    if (!same_value(r16, (float)(_Float16)x) && bad16++ < 5)
      nmt_test_fail(__FILE__, __LINE__, "fp16(0x%08x) = 0x%08x, _Float16 gives 0x%08x", fbits(x),
                    fbits(r16), fbits((float)(_Float16)x));
#endif
    if (!same_value(r16, fp16_by_values(x)) && bad16v++ < 5)
      nmt_test_fail(__FILE__, __LINE__, "fp16(0x%08x) = 0x%08x, by values 0x%08x", fbits(x),
                    fbits(r16), fbits(fp16_by_values(x)));
    if (!same_value(rbf, bf16_by_values(x)) && badbf++ < 5)
      nmt_test_fail(__FILE__, __LINE__, "bf16(0x%08x) = 0x%08x, by values 0x%08x", fbits(x),
                    fbits(rbf), fbits(bf16_by_values(x)));
  }
  if (bad16 || bad16v || badbf)
    nmt_test_fail(__FILE__, __LINE__, "%zu / %zu / %zu of %d values differ (fp16 vs _Float16, fp16 "
                  "vs by-values, bf16 vs by-values)", bad16, bad16v, badbf, N);
  /* The array versions are the scalar ones, in place too. */
  float a[7] = {1.0f + 0x1p-11f, 65520.0f, 0x1p-25f, NAN, -2.5f * 0x1p-24f, 1e5f, 0.1f}, b[7];
  nmt_half_round_fp16_array(b, a, 7);
  for (int i = 0; i < 7; i++) NMT_ASSERT(same_value(b[i], nmt_half_round_fp16(a[i])));
  memcpy(b, a, sizeof b);
  nmt_half_round_bf16_array(b, b, 7);
  for (int i = 0; i < 7; i++) NMT_ASSERT(same_value(b[i], nmt_half_round_bf16(a[i])));
  printf("# %d values (%zu fp16 ties) agree with %s\n", N, n_fp16_ties,
#ifdef __FLT16_MAX__
         "_Float16 and the by-values roundings"
#else
         "the by-values roundings (no _Float16 in this compiler)"
#endif
  );
}

static void round_mode(nmt_precision mode, float *out, const float *x, size_t n) {
  if (mode == NMT_PRECISION_FP16) nmt_half_round_fp16_array(out, x, n);
  else nmt_half_round_bf16_array(out, x, n);
}

static int bitwise_equal(const char *what, const float *a, const float *b, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (fbits(a[i]) != fbits(b[i])) {
      nmt_test_fail(__FILE__, __LINE__, "%s: [%zu] %.9g vs %.9g (must be bitwise equal)", what, i,
                    (double)a[i], (double)b[i]);
      return 0;
    }
  return 1;
}

static size_t count_differ(const float *a, const float *b, size_t n) {
  size_t d = 0;
  for (size_t i = 0; i < n; i++) d += fbits(a[i]) != fbits(b[i]);
  return d;
}

/* fp16/bf16 matmul with a context == the fp32 matmul (NULL context) on pre-rounded inputs,
 * bias and dbias from the unrounded values; and different from plain fp32 (the rounding is
 * really applied). */
static void emulation_case(nmt_precision mode, int M, int K, int N) {
  const char *name = mode == NMT_PRECISION_FP16 ? "fp16" : "bf16";
  const size_t ni = (size_t)M * K, nw = (size_t)N * K, no = (size_t)M * N;
  float *buf = malloc(sizeof(float) * (3 * ni + 3 * nw + 5 * no + 3 * (size_t)N + 3 * ni + 3 * nw));
  NMT_ASSERT(buf != NULL);
  float *inp = buf, *w = inp + ni, *dout = w + nw, *bias = dout + no;
  float *ri = bias + N, *rw = ri + ni, *rd = rw + nw;
  float *out = rd + no, *want = out + no, *plain = want + no;
  float *di = plain + no, *di_want = di + ni, *dw = di_want + ni, *dw_want = dw + nw;
  float *db = dw_want + nw, *db_want = db + N, *di_plain = db_want + N;
  /* Values of many magnitudes, so the rounding matters at every scale. */
  for (size_t i = 0; i < ni; i++) inp[i] = rnd() * ldexpf(1.0f, (int)(i % 7) - 3);
  for (size_t i = 0; i < nw; i++) w[i] = rnd() * 0.3f;
  for (size_t i = 0; i < no; i++) dout[i] = rnd() * ldexpf(1.0f, (int)(i % 5) - 8);
  fill(bias, (size_t)N);
  round_mode(mode, ri, inp, ni);
  round_mode(mode, rw, w, nw);
  round_mode(mode, rd, dout, no);
  void *ctx = NULL;
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &ctx));
  NMT_ASSERT_OK(nmt_ref_set_precision(ctx, mode));
  char what[96];
  for (int with_bias = 0; with_bias < 2 && !nmt_test_failed(); with_bias++) {
    const float *b = with_bias ? bias : NULL;
    for (size_t i = 0; i < no; i++) out[i] = NAN;
    NMT_ASSERT_OK(nmt_ref_matmul_fwd(ctx, out, inp, w, b, M, K, N));
    NMT_ASSERT_OK(nmt_ref_matmul_fwd(NULL, want, ri, rw, b, M, K, N));
    NMT_ASSERT_OK(nmt_ref_matmul_fwd(NULL, plain, inp, w, b, M, K, N));
    snprintf(what, sizeof what, "%s matmul_fwd M=%d K=%d N=%d bias=%d", name, M, K, N, with_bias);
    if (!bitwise_equal(what, out, want, no)) break;
    if (count_differ(out, plain, no) == 0)
      nmt_test_fail(__FILE__, __LINE__, "%s: equals fp32: the inputs were not rounded", what);
  }
  /* Backward from a shared random baseline (accumulation) into all three gradients. */
  for (size_t i = 0; i < ni; i++) di[i] = di_want[i] = di_plain[i] = rnd();
  for (size_t i = 0; i < nw; i++) dw[i] = dw_want[i] = rnd();
  for (int i = 0; i < N; i++) db[i] = db_want[i] = rnd();
  if (!nmt_test_failed()) {
    NMT_ASSERT_OK(nmt_ref_matmul_bwd(ctx, di, dw, db, dout, inp, w, M, K, N));
    NMT_ASSERT_OK(nmt_ref_matmul_bwd(NULL, di_want, dw_want, NULL, rd, ri, rw, M, K, N));
    NMT_ASSERT_OK(nmt_ref_matmul_bwd(NULL, NULL, NULL, db_want, dout, inp, w, M, K, N));
    NMT_ASSERT_OK(nmt_ref_matmul_bwd(NULL, di_plain, NULL, NULL, dout, inp, w, M, K, N));
    snprintf(what, sizeof what, "%s matmul_bwd dinp M=%d K=%d N=%d", name, M, K, N);
    if (bitwise_equal(what, di, di_want, ni)) {
      snprintf(what, sizeof what, "%s matmul_bwd dw M=%d K=%d N=%d", name, M, K, N);
      if (bitwise_equal(what, dw, dw_want, nw)) {
        snprintf(what, sizeof what, "%s matmul_bwd dbias (fp32, unrounded dout)", name);
        if (bitwise_equal(what, db, db_want, (size_t)N) && count_differ(di, di_plain, ni) == 0)
          nmt_test_fail(__FILE__, __LINE__, "%s dinp equals fp32: not rounded", name);
      }
    }
  }
  nmt_ref_ctx_destroy(ctx);
  free(buf);
}

NMT_TEST(matmul_fp16_bf16_emulation) {
  const int shapes[3][3] = {{5, 7, 6}, {67, 129, 83}, {1, 300, 1}};
  for (int m = 0; m < 2; m++)
    for (int s = 0; s < 3 && !nmt_test_failed(); s++)
      emulation_case(m ? NMT_PRECISION_BF16 : NMT_PRECISION_FP16, shapes[s][0], shapes[s][1],
                     shapes[s][2]);
}

static size_t count_nonfinite(const float *x, size_t n) {
  size_t c = 0;
  for (size_t i = 0; i < n; i++) c += !isfinite(x[i]);
  return c;
}

/* 1e5 overflows fp16 (to inf) and not bf16: the loss-scale overflow the engine must see. */
NMT_TEST(matmul_fp16_overflow_is_inf) {
  enum { M = 4, K = 6, N = 5 };
  float inp[M * K], w[N * K], dout[M * N], out[M * N], bias[N];
  float di[M * K], dw[N * K], db[N];
  fill(inp, M * K), fill(w, N * K), fill(dout, M * N), fill(bias, N);
  for (int i = 0; i < N * K; i++) w[i] = 0.25f + 0.5f * fabsf(w[i]); /* no zero weights */
  inp[2 * K + 3] = 1e5f;   /* row 2 of the input */
  dout[1 * N + 4] = -1e5f; /* row 1, column 4 of the output gradient */
  for (int k = 0; k < 2; k++) {
    const nmt_precision mode = k ? NMT_PRECISION_BF16 : NMT_PRECISION_FP16;
    void *ctx = NULL;
    NMT_ASSERT_OK(nmt_ref_ctx_create(0, &ctx));
    NMT_ASSERT_OK(nmt_ref_set_precision(ctx, mode));
    nmt_status s = nmt_ref_matmul_fwd(ctx, out, inp, w, bias, M, K, N);
    memset(di, 0, sizeof di), memset(dw, 0, sizeof dw), memset(db, 0, sizeof db);
    nmt_status s2 = nmt_ref_matmul_bwd(ctx, di, dw, db, dout, inp, w, M, K, N);
    nmt_ref_ctx_destroy(ctx);
    NMT_ASSERT_OK(s);
    NMT_ASSERT_OK(s2);
    if (mode == NMT_PRECISION_FP16) {
      /* Row 2 of out is inf (every weight > 0), the other rows finite. */
      NMT_ASSERT_EQ_INT((int)count_nonfinite(out + 2 * N, N), N);
      NMT_ASSERT_EQ_INT((int)count_nonfinite(out, M * N), N);
      for (int n = 0; n < N; n++) NMT_ASSERT(isinf(out[2 * N + n]) && out[2 * N + n] > 0);
      /* dinp row 1 = dout row 1 @ w: -inf * w > 0; dw row 4 = dout col 4 ^T @ inp: inf or NaN
       * (inf * 0 would be NaN; -inf * the 1e5 input is -inf). */
      NMT_ASSERT_EQ_INT((int)count_nonfinite(di + 1 * K, K), K);
      NMT_ASSERT(count_nonfinite(dw + 4 * K, K) > 0);
      NMT_ASSERT(count_nonfinite(di, M * K) + count_nonfinite(dw, N * K) > 0);
      /* The bias gradient is an fp32 sum of the unrounded dout: finite. */
      NMT_ASSERT_EQ_INT((int)count_nonfinite(db, N), 0);
    } else {
      NMT_ASSERT_EQ_INT((int)count_nonfinite(out, M * N), 0);
      NMT_ASSERT_EQ_INT((int)count_nonfinite(di, M * K), 0);
      NMT_ASSERT_EQ_INT((int)count_nonfinite(dw, N * K), 0);
    }
  }
}

/* fp32 and tf32 with a context compute exactly what a NULL context does (no rounding, no
 * copy); the precision setter's errors. */
NMT_TEST(matmul_ref_ctx_fp32_and_modes) {
  enum { M = 33, K = 65, N = 17 };
  static float inp[M * K], w[N * K], bias[N], dout[M * N];
  static float a[M * N], b[M * N], da[M * K + N * K + N], dbb[M * K + N * K + N];
  fill(inp, M * K), fill(w, N * K), fill(bias, N), fill(dout, M * N);
  for (int k = 0; k < 2; k++) {
    void *ctx = NULL;
    NMT_ASSERT_OK(nmt_ref_ctx_create(3, &ctx)); /* any index: CPU workers pass their rank */
    NMT_ASSERT(ctx != NULL);
    if (k) NMT_ASSERT_OK(nmt_ref_set_precision(ctx, NMT_PRECISION_TF32));
    memset(da, 0, sizeof da), memset(dbb, 0, sizeof dbb);
    nmt_status s1 = nmt_ref_matmul_fwd(ctx, a, inp, w, bias, M, K, N);
    nmt_status s2 = nmt_ref_matmul_bwd(ctx, da, da + M * K, da + M * K + N * K, dout, inp, w,
                                       M, K, N);
    nmt_ref_ctx_destroy(ctx);
    NMT_ASSERT_OK(s1);
    NMT_ASSERT_OK(s2);
    NMT_ASSERT_OK(nmt_ref_matmul_fwd(NULL, b, inp, w, bias, M, K, N));
    NMT_ASSERT_OK(nmt_ref_matmul_bwd(NULL, dbb, dbb + M * K, dbb + M * K + N * K, dout, inp, w,
                                     M, K, N));
    NMT_ASSERT(!memcmp(a, b, sizeof a));
    NMT_ASSERT(!memcmp(da, dbb, sizeof da));
  }
  /* A NULL context is fp32: it accepts fp32/tf32 and refuses the half modes. */
  NMT_ASSERT_OK(nmt_ref_set_precision(NULL, NMT_PRECISION_FP32));
  NMT_ASSERT_OK(nmt_ref_set_precision(NULL, NMT_PRECISION_TF32));
  NMT_ASSERT_EQ_STATUS(nmt_ref_set_precision(NULL, NMT_PRECISION_FP16), NMT_ERR_CONFIG);
  NMT_ASSERT_EQ_STATUS(nmt_ref_set_precision(NULL, NMT_PRECISION_BF16), NMT_ERR_CONFIG);
  void *ctx = NULL;
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &ctx));
  NMT_ASSERT_EQ_STATUS(nmt_ref_set_precision(ctx, (nmt_precision)7), NMT_ERR_CONFIG);
  nmt_ref_ctx_destroy(ctx);
  nmt_ref_ctx_destroy(NULL);
  /* Another backend's context is refused, not misread. */
  uint64_t foreign[8] = {0};
  NMT_ASSERT_EQ_STATUS(nmt_ref_matmul_fwd(foreign, a, inp, w, bias, M, K, N), NMT_ERR_INTERNAL);
}

/* ------------------------------------------------------------------------------------------ */
/* matmul_bias_relu_fwd (the FFN's fc1 with its ReLU, nmt/backend.h) */

/* Bitwise matmul_fwd followed by relu_fwd in place — what the model ran before the fused op,
 * so CPU training is unchanged — in fp32 (NULL context and a context) and in the fp16/bf16
 * emulation, with and without a bias. Independently of both ops: within 1e-5 of max(0, .) of
 * the double product of the inputs as the GEMM sees them (rounded in fp16/bf16), exactly 0
 * where that product is clearly negative, and with both signs present, so the ReLU is really
 * taken and the rounding really applied. */
NMT_TEST(matmul_bias_relu_fwd_is_the_composition) {
  enum { M = 37, K = 45, N = 29 };
  static float inp[M * K], w[N * K], bias[N], ri[M * K], rw[N * K];
  static float out[M * N], want[M * N];
  static double naive[M * N], got[M * N];
  fill(inp, M * K), fill(w, N * K), fill(bias, N);
  const nmt_precision modes[4] = {NMT_PRECISION_FP32, NMT_PRECISION_FP32, NMT_PRECISION_FP16,
                                  NMT_PRECISION_BF16};
  const char *names[4] = {"fp32 (NULL ctx)", "fp32", "fp16", "bf16"};
  char what[96];
  for (int k = 0; k < 4 && !nmt_test_failed(); k++) {
    void *ctx = NULL;
    if (k > 0) {
      NMT_ASSERT_OK(nmt_ref_ctx_create(0, &ctx));
      NMT_ASSERT_OK(nmt_ref_set_precision(ctx, modes[k]));
    }
    if (modes[k] == NMT_PRECISION_FP32) {
      memcpy(ri, inp, sizeof ri), memcpy(rw, w, sizeof rw);
    } else {
      round_mode(modes[k], ri, inp, M * K);
      round_mode(modes[k], rw, w, N * K);
    }
    for (int with_bias = 0; with_bias < 2 && !nmt_test_failed(); with_bias++) {
      const float *b = with_bias ? bias : NULL;
      for (int i = 0; i < M * N; i++) out[i] = NAN; /* every element must be written */
      nmt_status s1 = nmt_ref_matmul_bias_relu_fwd(ctx, out, inp, w, b, M, K, N);
      nmt_status s2 = nmt_ref_matmul_fwd(ctx, want, inp, w, b, M, K, N);
      if (s2 == NMT_OK) s2 = nmt_ref_relu_fwd(NULL, want, want, M * N);
      if (s1 != NMT_OK || s2 != NMT_OK) nmt_ref_ctx_destroy(ctx);
      NMT_ASSERT_OK(s1);
      NMT_ASSERT_OK(s2);
      snprintf(what, sizeof what, "%s matmul_bias_relu_fwd bias=%d", names[k], with_bias);
      if (!bitwise_equal(what, out, want, M * N)) break;
      naive_linear(naive, ri, rw, b, M, K, N);
      int neg = 0, pos = 0;
      for (int i = 0; i < M * N; i++) {
        neg += naive[i] < -1e-3, pos += naive[i] > 1e-3;
        if (naive[i] < -1e-3 && out[i] != 0.0f)
          nmt_test_fail(__FILE__, __LINE__, "%s: [%d] = %g where the product is %g < 0", what, i,
                        (double)out[i], naive[i]);
        naive[i] = naive[i] > 0 ? naive[i] : 0.0;
        got[i] = out[i];
      }
      if (!(neg > M * N / 4 && pos > M * N / 4))
        nmt_test_fail(__FILE__, __LINE__, "%s: %d negative and %d positive products: the test "
                      "needs both", what, neg, pos);
      nmt_test_close_d(__FILE__, __LINE__, what, got, naive, (size_t)M * N, 1e-5, 1e-5);
    }
    nmt_ref_ctx_destroy(ctx);
  }
  float x = 0;
  NMT_ASSERT_EQ_STATUS(nmt_ref_matmul_bias_relu_fwd(NULL, &x, &x, &x, NULL, 1, -1, 1),
                       NMT_ERR_INTERNAL);
  /* The op table points at it. */
  NMT_ASSERT(nmt_backend_ref.matmul_bias_relu_fwd == nmt_ref_matmul_bias_relu_fwd);
}
