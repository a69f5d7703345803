/* test/test_embedding.c — token embedding * scale + positions: forward vs a naive double
 * computation, backward vs central finite differences (repeated ids) of the objective without
 * the padding rows (PAD gets no gradient), accumulation, and the PAD rule itself. */
#include <math.h>
#include <string.h>

#include "nmt/ref.h"
#include "test.h"

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static float rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (float)((rng_state >> 40) * 0x1p-24 * 2.0 - 1.0);
}
static void fill(float *x, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = rnd();
}

enum { B = 2, T = 5, C = 6, V = 7, TP = 8 };
static const int32_t ids[B * T] = {3, 1, 4, 1, 5, 6, 2, 6, 0, 3}; /* repeats on purpose */
static const float scale = 2.5f;

NMT_TEST(embedding_fwd_vs_naive) {
  float wte[V * C], pos[TP * C], out[B * T * C];
  double got[B * T * C], want[B * T * C];
  fill(wte, V * C), fill(pos, TP * C);
  NMT_ASSERT_OK(nmt_ref_embedding_fwd(NULL, out, ids, wte, pos, B * T, T, C, scale));
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++)
      for (int c = 0; c < C; c++) {
        int r = b * T + t;
        want[r * C + c] = (double)scale * wte[ids[r] * C + c] + pos[t * C + c];
        got[r * C + c] = out[r * C + c];
      }
  nmt_test_close_d(__FILE__, __LINE__, "embedding out", got, want, B * T * C, 1e-6, 1e-6);
}

/* The rows of NMT_PAD_ID (row 8 here) are constants: the backward skips them (nmt/backend.h). */
static double objective(const double *wte, const double *pos, const double *R) {
  double L = 0;
  for (int r = 0; r < B * T; r++)
    for (int c = 0; c < C && ids[r] != NMT_PAD_ID; c++)
      L += (scale * wte[ids[r] * C + c] + pos[(r % T) * C + c]) * R[r * C + c];
  return L;
}

NMT_TEST(embedding_bwd_fd_and_accumulate) {
  float R[B * T * C], dwte[V * C], base[V * C];
  double wte[V * C], pos[TP * C], Rd[B * T * C], g[V * C], got[V * C];
  fill(R, B * T * C), fill(base, V * C);
  for (int i = 0; i < V * C; i++) wte[i] = rnd();
  for (int i = 0; i < TP * C; i++) pos[i] = rnd();
  for (int i = 0; i < B * T * C; i++) Rd[i] = R[i];
  const double h = 1e-4;
  for (int i = 0; i < V * C; i++) {
    double s = wte[i];
    wte[i] = s + h;
    double lp = objective(wte, pos, Rd);
    wte[i] = s - h;
    double lm = objective(wte, pos, Rd);
    wte[i] = s;
    g[i] = (lp - lm) / (2 * h);
  }
  memcpy(dwte, base, sizeof dwte);
  NMT_ASSERT_OK(nmt_ref_embedding_bwd(NULL, dwte, R, ids, B * T, C, scale));
  NMT_ASSERT_OK(nmt_ref_embedding_bwd(NULL, dwte, R, ids, B * T, C, scale));
  for (int i = 0; i < V * C; i++) got[i] = ((double)dwte[i] - base[i]) / 2;
  nmt_test_close_d(__FILE__, __LINE__, "dwte", got, g, V * C, 1e-5, 1e-4);
}

NMT_TEST(embedding_bad_id) {
  int32_t bad[2] = {1, -3};
  float wte[4] = {0}, pos[4] = {0}, out[4];
  NMT_ASSERT_EQ_STATUS(nmt_ref_embedding_fwd(NULL, out, bad, wte, pos, 2, 2, 1, 1.0f),
                       NMT_ERR_INTERNAL);
}

/* Rows of NMT_PAD_ID add nothing, whatever their gradient; the other rows are unchanged by
 * them. Without the rule the PAD row would get scale * (sum of its rows' dout). */
NMT_TEST(embedding_bwd_skips_pad) {
  const int32_t with_pad[4] = {NMT_PAD_ID, 5, NMT_PAD_ID, 5};
  float dout[4 * 2] = {1, 2, 3, 4, 5, 6, 7, 8}, dwte[7 * 2];
  memset(dwte, 0, sizeof dwte);
  NMT_ASSERT_OK(nmt_ref_embedding_bwd(NULL, dwte, dout, with_pad, 4, 2, 0.5f));
  NMT_ASSERT(dwte[2 * NMT_PAD_ID] == 0.0f && dwte[2 * NMT_PAD_ID + 1] == 0.0f);
  NMT_ASSERT(dwte[10] == 0.5f * 3 + 0.5f * 7 && dwte[11] == 0.5f * 4 + 0.5f * 8);
}
