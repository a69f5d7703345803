/* test/test_attention.c — multi-head attention against a naive double mirror (forward, saved
 * probabilities) and central finite differences of that mirror (backward), with q/k/v as column
 * slices of fused buffers (ldq, ldkv), key padding, the causal mask and probability dropout. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

static uint64_t rng_state = 0x853c49e6748fea9bull;
static float rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (float)((rng_state >> 40) * 0x1p-24 * 2.0 - 1.0);
}

/* One attention problem. q lives in qbuf (rows of ldq, starting at column qcol); k and v live
 * in kvbuf (rows of ldkv, starting at columns kcol and vcol). */
typedef struct {
  int B, Tq, Tk, H, dk, causal;
  float p;
  uint64_t seed, stream;
  int ldq, ldkv, qcol, kcol, vcol;
  const int32_t *k_lens;
  double *qbuf, *kvbuf, *R; /* double mirror inputs; R: (B,Tq,C) */
  int same_buf;             /* q, k, v all in kvbuf (self-attention over one fused QKV) */
} att_prob;

/* Double mirror: out (B,Tq,C), probs (B,H,Tq,Tk) (undropped). Independent of the ref code: a
 * plain triple loop, the dropout mask drawn element by element through nmt_rng_uniform. */
static void mirror(const att_prob *a, double *out, double *probs) {
  int C = a->H * a->dk;
  const double *qb = a->same_buf ? a->kvbuf : a->qbuf;
  double *s = malloc(sizeof(double) * a->Tk);
  for (int b = 0; b < a->B; b++)
    for (int h = 0; h < a->H; h++)
      for (int i = 0; i < a->Tq; i++) {
        const double *qi = qb + (size_t)(b * a->Tq + i) * a->ldq + a->qcol + h * a->dk;
        double mx = -INFINITY;
        for (int j = 0; j < a->Tk; j++) {
          int masked = j >= a->k_lens[b] || (a->causal && j > i);
          const double *kj = a->kvbuf + (size_t)(b * a->Tk + j) * a->ldkv + a->kcol + h * a->dk;
          double d = 0;
          for (int c = 0; c < a->dk; c++) d += qi[c] * kj[c];
          s[j] = masked ? -INFINITY : d / sqrt((double)a->dk);
          if (s[j] > mx) mx = s[j];
        }
        double sum = 0;
        for (int j = 0; j < a->Tk; j++) sum += (s[j] = exp(s[j] - mx));
        for (int j = 0; j < a->Tk; j++) s[j] /= sum;
        if (probs)
          for (int j = 0; j < a->Tk; j++) probs[((size_t)(b * a->H + h) * a->Tq + i) * a->Tk + j] = s[j];
        for (int c = 0; c < a->dk; c++) {
          double o = 0;
          for (int j = 0; j < a->Tk; j++) {
            uint64_t e = ((uint64_t)(b * a->H + h) * a->Tq + i) * a->Tk + j;
            double pj = s[j];
            if (a->p > 0)
              pj = nmt_rng_uniform(a->seed, a->stream, e) >= a->p ? pj / (1.0 - a->p) : 0.0;
            o += pj * a->kvbuf[(size_t)(b * a->Tk + j) * a->ldkv + a->vcol + h * a->dk + c];
          }
          out[(size_t)(b * a->Tq + i) * C + h * a->dk + c] = o;
        }
      }
  free(s);
}

static double objective(const att_prob *a) {
  size_t n = (size_t)a->B * a->Tq * a->H * a->dk;
  double *out = malloc(sizeof(double) * n), L = 0;
  mirror(a, out, NULL);
  for (size_t i = 0; i < n; i++) L += out[i] * a->R[i];
  free(out);
  return L;
}

static void fd(const att_prob *a, double *x, size_t n, double *g) {
  const double h = 1e-5;
  for (size_t i = 0; i < n; i++) {
    double s = x[i];
    x[i] = s + h;
    double lp = objective(a);
    x[i] = s - h;
    double lm = objective(a);
    x[i] = s;
    g[i] = (lp - lm) / (2 * h);
  }
}

static float *to_f(const double *d, size_t n) {
  float *f = malloc(sizeof(float) * n);
  for (size_t i = 0; i < n; i++) f[i] = (float)d[i];
  return f;
}

static double *rand_d(size_t n, double amp) {
  double *d = malloc(sizeof(double) * n);
  for (size_t i = 0; i < n; i++) d[i] = (float)(amp * rnd()); /* float-representable */
  return d;
}

/* Runs fwd and bwd of the ref op on `a` and checks them against the mirror and FD. Gradients
 * start from a random baseline and get two bwd calls (accumulation). */
static void check(att_prob *a) {
  int C = a->H * a->dk;
  size_t nq = a->same_buf ? 0 : (size_t)a->B * a->Tq * a->ldq;
  size_t nkv = (size_t)a->B * a->Tk * a->ldkv;
  size_t nout = (size_t)a->B * a->Tq * C, np = (size_t)a->B * a->H * a->Tq * a->Tk;
  float *qf = nq ? to_f(a->qbuf, nq) : NULL, *kvf = to_f(a->kvbuf, nkv), *Rf = to_f(a->R, nout);
  const float *qsrc = (a->same_buf ? kvf : qf) + a->qcol;
  float *out = malloc(sizeof(float) * nout), *probs = malloc(sizeof(float) * np);
  float *dprobs = malloc(sizeof(float) * np);
  double *wout = malloc(sizeof(double) * nout), *wprobs = malloc(sizeof(double) * np);
  double *got = malloc(sizeof(double) * (nkv + nout + np + nq + 1));
  float *dq = NULL, *bq = NULL, *dkv = malloc(sizeof(float) * nkv), *bkv = malloc(sizeof(float) * nkv);
  double *gq = NULL, *gkv = malloc(sizeof(double) * nkv);
  if (nq) {
    dq = malloc(sizeof(float) * nq), bq = malloc(sizeof(float) * nq);
    gq = malloc(sizeof(double) * nq);
  }

  NMT_ASSERT_OK(nmt_ref_attention_fwd(NULL, out, probs, qsrc, a->ldq, kvf + a->kcol,
                                      kvf + a->vcol, a->ldkv, a->k_lens, a->B, a->Tq, a->Tk, a->H,
                                      a->dk, a->causal, a->p, a->seed, a->stream));
  mirror(a, wout, wprobs);
  for (size_t i = 0; i < nout; i++) got[i] = out[i];
  if (!nmt_test_close_d(__FILE__, __LINE__, "attention out", got, wout, nout, 1e-5, 1e-4))
    goto out;
  for (size_t i = 0; i < np; i++) got[i] = probs[i];
  if (!nmt_test_close_d(__FILE__, __LINE__, "attention probs", got, wprobs, np, 1e-6, 1e-4))
    goto out;
  /* Masked positions hold an exact zero probability. */
  for (size_t i = 0; i < np; i++)
    if (wprobs[i] == 0.0 && probs[i] != 0.0f) {
      nmt_test_fail(__FILE__, __LINE__, "masked prob [%zu] = %g, not 0", i, (double)probs[i]);
      goto out;
    }

  for (size_t i = 0; i < nkv; i++) bkv[i] = dkv[i] = rnd();
  for (size_t i = 0; i < nq; i++) bq[i] = dq[i] = rnd();
  float *dqsrc = (a->same_buf ? dkv : dq) + a->qcol;
  for (int c = 0; c < 2; c++) {
    nmt_status st = nmt_ref_attention_bwd(
        NULL, dqsrc, dkv + a->kcol, dkv + a->vcol, dprobs, Rf, probs, qsrc, a->ldq, kvf + a->kcol,
        kvf + a->vcol, a->ldkv, a->k_lens, a->B, a->Tq, a->Tk, a->H, a->dk, a->causal, a->p,
        a->seed, a->stream);
    if (st != NMT_OK) {
      nmt_test_fail(__FILE__, __LINE__, "attention_bwd: %s", nmt_status_str(st));
      goto out;
    }
  }
  /* FD over every element of the buffers: columns outside the q/k/v slices must get 0. */
  fd(a, a->kvbuf, nkv, gkv);
  for (size_t i = 0; i < nkv; i++) got[i] = ((double)dkv[i] - bkv[i]) / 2;
  if (!nmt_test_close_d(__FILE__, __LINE__, a->same_buf ? "d(qkv)" : "d(kv)", got, gkv, nkv,
                        1e-4, 1e-3))
    goto out;
  if (nq) {
    fd(a, a->qbuf, nq, gq);
    for (size_t i = 0; i < nq; i++) got[i] = ((double)dq[i] - bq[i]) / 2;
    if (!nmt_test_close_d(__FILE__, __LINE__, "dq", got, gq, nq, 1e-4, 1e-3)) goto out;
  }

  /* Padded keys get exactly zero dk and dv (probability exactly 0). */
  memset(dkv, 0, sizeof(float) * nkv);
  NMT_ASSERT_OK(nmt_ref_attention_bwd(NULL, a->same_buf ? NULL : dq, dkv + a->kcol,
                                      dkv + a->vcol, dprobs, Rf, probs, qsrc, a->ldq,
                                      kvf + a->kcol, kvf + a->vcol, a->ldkv, a->k_lens, a->B,
                                      a->Tq, a->Tk, a->H, a->dk, a->causal, a->p, a->seed,
                                      a->stream));
  for (int b = 0; b < a->B; b++)
    for (int j = a->k_lens[b]; j < a->Tk; j++)
      for (int c = 0; c < C; c++) {
        size_t r = (size_t)(b * a->Tk + j) * a->ldkv;
        if (dkv[r + a->kcol + c] != 0.0f || dkv[r + a->vcol + c] != 0.0f) {
          nmt_test_fail(__FILE__, __LINE__, "padded key b=%d j=%d has gradient", b, j);
          goto out;
        }
      }
out:
  free(qf), free(kvf), free(Rf), free(out), free(probs), free(dprobs), free(wout), free(wprobs);
  free(got), free(dq), free(bq), free(dkv), free(bkv), free(gq), free(gkv);
}

/* Decoder self-attention: q, k, v are the three column slices of one fused (B*T, 3C) buffer. */
static void self_attention(int causal, float p) {
  static const int32_t lens[2] = {5, 3};
  att_prob a = {.B = 2, .Tq = 5, .Tk = 5, .H = 2, .dk = 3, .causal = causal, .p = p,
                .seed = 1234, .stream = nmt_rng_stream(3, 17), .k_lens = lens, .same_buf = 1};
  int C = a.H * a.dk;
  a.ldq = a.ldkv = 3 * C;
  a.qcol = 0, a.kcol = C, a.vcol = 2 * C;
  a.kvbuf = rand_d((size_t)a.B * a.Tk * a.ldkv, 1.5);
  a.R = rand_d((size_t)a.B * a.Tq * C, 1.0);
  check(&a);
  free(a.kvbuf), free(a.R);
}

NMT_TEST(attention_self_fused_qkv_padding) { self_attention(0, 0.0f); }
NMT_TEST(attention_self_causal) { self_attention(1, 0.0f); }
NMT_TEST(attention_self_causal_dropout) { self_attention(1, 0.3f); }

/* Encoder-decoder attention: q from its own buffer with a padded stride (ldq = C + 2, q at
 * column 1), k and v from a fused (B*Tk, 2C + 1) KV buffer; Tq != Tk. */
static void cross_attention(float p) {
  static const int32_t lens[3] = {6, 2, 4};
  att_prob a = {.B = 3, .Tq = 4, .Tk = 6, .H = 3, .dk = 2, .causal = 0, .p = p, .seed = 99,
                .stream = 5, .k_lens = lens};
  int C = a.H * a.dk;
  a.ldq = C + 2, a.qcol = 1;
  a.ldkv = 2 * C + 1, a.kcol = 1, a.vcol = C + 1;
  a.qbuf = rand_d((size_t)a.B * a.Tq * a.ldq, 1.5);
  a.kvbuf = rand_d((size_t)a.B * a.Tk * a.ldkv, 1.5);
  a.R = rand_d((size_t)a.B * a.Tq * C, 1.0);
  check(&a);
  free(a.qbuf), free(a.kvbuf), free(a.R);
}

NMT_TEST(attention_cross_strided) { cross_attention(0.0f); }
NMT_TEST(attention_cross_dropout) { cross_attention(0.25f); }

NMT_TEST(attention_dropout_mask_matches_index) {
  /* With all probabilities equal (q = 0), out = mean over kept keys of v * 1/(1-p): checks the
   * element index ((b*H+h)*Tq+i)*Tk+j on a larger shape than the FD tests. */
  enum { B = 2, T = 16, H = 4, dk = 8, C = H * dk };
  static float q[B * T * C], kv[B * T * 2 * C], out[B * T * C], probs[B * H * T * T];
  int32_t lens[B] = {T, 11};
  for (int i = 0; i < B * T * 2 * C; i++) kv[i] = rnd();
  const float p = 0.4f;
  NMT_ASSERT_OK(nmt_ref_attention_fwd(NULL, out, probs, q, C, kv, kv + C, 2 * C, lens, B, T, T,
                                      H, dk, 0, p, 7, 8));
  for (int b = 0; b < B; b++)
    for (int h = 0; h < H; h++)
      for (int i = 0; i < T; i++)
        for (int c = 0; c < dk; c++) {
          double o = 0;
          for (int j = 0; j < lens[b]; j++) {
            uint64_t e = ((uint64_t)(b * H + h) * T + i) * T + j;
            if (nmt_rng_uniform(7, 8, e) >= p)
              o += kv[(b * T + j) * 2 * C + C + h * dk + c] / (double)lens[b] / (1.0 - p);
          }
          NMT_ASSERT_NEAR(out[(b * T + i) * C + h * dk + c], o, 1e-5);
        }
}

NMT_TEST(attention_bad_k_lens) {
  float x[16] = {0};
  int32_t lens[1] = {0};
  NMT_ASSERT_EQ_STATUS(
      nmt_ref_attention_fwd(NULL, x, x, x, 1, x, x, 1, lens, 1, 1, 1, 1, 1, 0, 0.0f, 0, 0),
      NMT_ERR_INTERNAL);
}
