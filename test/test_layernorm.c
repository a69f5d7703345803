/* test/test_layernorm.c — LayerNorm forward vs a naive double computation (saved mean/rstd
 * included), backward vs central finite differences of a double mirror, accumulation. */
#include <math.h>
#include <string.h>

#include "nmt/ref.h"
#include "test.h"

static uint64_t rng_state = 0xda942042e4dd58b5ull;
static float rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (float)((rng_state >> 40) * 0x1p-24 * 2.0 - 1.0);
}

enum { M = 4, C = 9 };
static const float eps = 1e-5f;

/* out (M,C) in double; mean/rstd optional. */
static void mirror(double *out, double *mean, double *rstd, const double *x, const double *g,
                   const double *b) {
  for (int r = 0; r < M; r++) {
    double mu = 0, var = 0;
    for (int c = 0; c < C; c++) mu += x[r * C + c];
    mu /= C;
    for (int c = 0; c < C; c++) var += (x[r * C + c] - mu) * (x[r * C + c] - mu);
    var /= C;
    double rs = 1 / sqrt(var + eps);
    for (int c = 0; c < C; c++) out[r * C + c] = (x[r * C + c] - mu) * rs * g[c] + b[c];
    if (mean) mean[r] = mu;
    if (rstd) rstd[r] = rs;
  }
}

typedef struct {
  double x[M * C], g[C], b[C], R[M * C];
} ln_prob;

static double objective(const ln_prob *p) {
  double out[M * C], L = 0;
  mirror(out, NULL, NULL, p->x, p->g, p->b);
  for (int i = 0; i < M * C; i++) L += out[i] * p->R[i];
  return L;
}

static void fd(ln_prob *p, double *x, int n, double *grad) {
  const double h = 1e-5;
  for (int i = 0; i < n; i++) {
    double s = x[i];
    x[i] = s + h;
    double lp = objective(p);
    x[i] = s - h;
    double lm = objective(p);
    x[i] = s;
    grad[i] = (lp - lm) / (2 * h);
  }
}

static void setup(ln_prob *p, float *x, float *g, float *b, float *R) {
  /* Rows with a large offset and a small spread test the variance's cancellation. */
  for (int i = 0; i < M * C; i++) x[i] = rnd() * (1 + i / C) + 3.0f * (float)(i / C);
  for (int c = 0; c < C; c++) g[c] = 1.0f + 0.5f * rnd(), b[c] = rnd();
  for (int i = 0; i < M * C; i++) R[i] = rnd();
  for (int i = 0; i < M * C; i++) p->x[i] = x[i], p->R[i] = R[i];
  for (int c = 0; c < C; c++) p->g[c] = g[c], p->b[c] = b[c];
}

NMT_TEST(layernorm_fwd_vs_naive) {
  ln_prob p;
  float x[M * C], g[C], b[C], R[M * C], out[M * C], mean[M], rstd[M];
  setup(&p, x, g, b, R);
  NMT_ASSERT_OK(nmt_ref_layernorm_fwd(NULL, out, mean, rstd, x, g, b, M, C, eps));
  double want[M * C], wmean[M], wrstd[M], got[M * C];
  mirror(want, wmean, wrstd, p.x, p.g, p.b);
  for (int i = 0; i < M * C; i++) got[i] = out[i];
  if (!nmt_test_close_d(__FILE__, __LINE__, "ln out", got, want, M * C, 1e-5, 1e-5)) return;
  for (int r = 0; r < M; r++) got[r] = mean[r];
  if (!nmt_test_close_d(__FILE__, __LINE__, "ln mean", got, wmean, M, 1e-6, 1e-6)) return;
  for (int r = 0; r < M; r++) got[r] = rstd[r];
  nmt_test_close_d(__FILE__, __LINE__, "ln rstd", got, wrstd, M, 1e-6, 1e-6);
}

NMT_TEST(layernorm_bwd_fd_and_accumulate) {
  ln_prob p;
  float x[M * C], g[C], b[C], R[M * C], out[M * C], mean[M], rstd[M];
  setup(&p, x, g, b, R);
  NMT_ASSERT_OK(nmt_ref_layernorm_fwd(NULL, out, mean, rstd, x, g, b, M, C, eps));
  double gx[M * C], gg[C], gb[C], got[M * C];
  fd(&p, p.x, M * C, gx);
  fd(&p, p.g, C, gg);
  fd(&p, p.b, C, gb);
  float dx[M * C], dg[C], db[C], bx[M * C], bg[C], bb[C];
  for (int i = 0; i < M * C; i++) bx[i] = rnd();
  for (int c = 0; c < C; c++) bg[c] = rnd(), bb[c] = rnd();
  memcpy(dx, bx, sizeof dx), memcpy(dg, bg, sizeof dg), memcpy(db, bb, sizeof db);
  for (int c = 0; c < 2; c++)
    NMT_ASSERT_OK(nmt_ref_layernorm_bwd(NULL, dx, dg, db, R, x, g, mean, rstd, M, C));
  for (int i = 0; i < M * C; i++) got[i] = ((double)dx[i] - bx[i]) / 2;
  if (!nmt_test_close_d(__FILE__, __LINE__, "ln dinp", got, gx, M * C, 1e-4, 1e-3)) return;
  for (int i = 0; i < C; i++) got[i] = ((double)dg[i] - bg[i]) / 2;
  if (!nmt_test_close_d(__FILE__, __LINE__, "ln dgamma", got, gg, C, 1e-4, 1e-3)) return;
  for (int i = 0; i < C; i++) got[i] = ((double)db[i] - bb[i]) / 2;
  if (!nmt_test_close_d(__FILE__, __LINE__, "ln dbeta", got, gb, C, 1e-4, 1e-3)) return;

  /* Only dinp requested. */
  float dx2[M * C];
  memset(dx2, 0, sizeof dx2);
  NMT_ASSERT_OK(nmt_ref_layernorm_bwd(NULL, dx2, NULL, NULL, R, x, g, mean, rstd, M, C));
  for (int i = 0; i < M * C; i++) got[i] = dx2[i];
  nmt_test_close_d(__FILE__, __LINE__, "ln dinp only", got, gx, M * C, 1e-4, 1e-3);
}
