/* test/test_xent.c — label-smoothed softmax cross-entropy against a direct double computation
 * (torch.nn.CrossEntropyLoss(label_smoothing=eps) per row, PAD rows ignored), its in-place
 * gradient against central finite differences, stability and argument errors. */
#include <math.h>
#include <string.h>

#include "nmt/config.h"
#include "nmt/ref.h"
#include "test.h"

static uint64_t rng_state = 0xbb67ae8584caa73bull;
static float rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (float)((rng_state >> 40) * 0x1p-24 * 2.0 - 1.0);
}

enum { M = 6, V = 11 };
static const int32_t targets[M] = {3, NMT_PAD_ID, 10, 1, NMT_PAD_ID, 7};

/* Direct definition: loss = (1-eps) * -log p[t] + eps * mean_v(-log p[v]), p = softmax(x). */
static double row_loss(const double *x, int t, double eps) {
  if (t == NMT_PAD_ID) return 0;
  double z = 0;
  for (int v = 0; v < V; v++) z += exp(x[v]);
  double nll = -log(exp(x[t]) / z), smooth = 0;
  for (int v = 0; v < V; v++) smooth += -log(exp(x[v]) / z) / V;
  return (1 - eps) * nll + eps * smooth;
}

static void check(double eps, float dloss) {
  float logits[M * V], losses[M];
  double x[M * V], want[M], got[M * V], g[M * V];
  for (int i = 0; i < M * V; i++) x[i] = logits[i] = 3 * rnd();
  for (int r = 0; r < M; r++) want[r] = row_loss(x + r * V, targets[r], eps);
  float nll[M];
  NMT_ASSERT_OK(
      nmt_ref_xent_fwd_bwd(NULL, logits, losses, nll, targets, M, V, (float)eps, dloss, NULL, 1));
  for (int r = 0; r < M; r++) got[r] = losses[r];
  if (!nmt_test_close_d(__FILE__, __LINE__, "xent losses", got, want, M, 1e-6, 1e-5)) return;
  /* The unsmoothed NLL output is the eps = 0 loss. */
  for (int r = 0; r < M; r++) got[r] = nll[r], want[r] = row_loss(x + r * V, targets[r], 0.0);
  if (!nmt_test_close_d(__FILE__, __LINE__, "xent nll", got, want, M, 1e-6, 1e-5)) return;
  /* Gradient of dloss * sum_r loss_r by central differences. */
  const double h = 1e-5;
  for (int r = 0; r < M; r++)
    for (int v = 0; v < V; v++) {
      double *xr = x + r * V, s = xr[v];
      xr[v] = s + h;
      double lp = row_loss(xr, targets[r], eps);
      xr[v] = s - h;
      double lm = row_loss(xr, targets[r], eps);
      xr[v] = s;
      g[r * V + v] = dloss * (lp - lm) / (2 * h);
    }
  for (int i = 0; i < M * V; i++) got[i] = logits[i];
  if (!nmt_test_close_d(__FILE__, __LINE__, "xent grad", got, g, M * V, 1e-6, 1e-4)) return;
  for (int r = 0; r < M; r++)
    if (targets[r] == NMT_PAD_ID)
      for (int v = 0; v < V; v++) NMT_ASSERT(logits[r * V + v] == 0.0f);
}

NMT_TEST(xent_label_smoothing_vs_direct_and_fd) { check(0.1, 0.37f); }
NMT_TEST(xent_no_smoothing_vs_direct_and_fd) { check(0.0, 1.0f); }

NMT_TEST(xent_no_grad_keeps_logits_and_is_stable) {
  float logits[2 * 4] = {1000, 1001, 999, 1000.5f, -1000, -999, -1001, -999.5f}, copy[8];
  float losses[2];
  int32_t t[2] = {1, 1};
  memcpy(copy, logits, sizeof copy);
  NMT_ASSERT_OK(nmt_ref_xent_fwd_bwd(NULL, logits, losses, NULL, t, 2, 4, 0.0f, 1.0f, NULL, 0));
  NMT_ASSERT(memcmp(copy, logits, sizeof copy) == 0);
  /* Both rows are shifts of {0, 1, -1, 0.5}: the same loss, finite. */
  double z = exp(0) + exp(1) + exp(-1) + exp(0.5), want = -log(exp(1) / z);
  NMT_ASSERT_NEAR(losses[0], want, 1e-5);
  NMT_ASSERT_NEAR(losses[1], want, 1e-5);
}

NMT_TEST(xent_bad_target) {
  float logits[4] = {1, 2, 3, 4}, losses[2];
  int32_t t[2] = {1, 2};
  NMT_ASSERT_EQ_STATUS(
      nmt_ref_xent_fwd_bwd(NULL, logits, losses, NULL, t, 2, 2, 0.1f, 1.0f, NULL, 1),
      NMT_ERR_INTERNAL);
  NMT_ASSERT(logits[0] == 1 && logits[3] == 4); /* untouched on error */
}
