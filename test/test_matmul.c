/* test/test_matmul.c — linear layer: forward vs a naive double product, backward vs central
 * finite differences of a double mirror, accumulation and NULL-gradient skipping. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

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
