/* ref/attention.c — multi-head scaled dot-product attention (Vaswani et al. 2017 §3.2.1 eq. 1,
 * §3.2.2) with key-padding and causal masks and dropout on the attention probabilities (§5.4).
 * Per (batch, head) the two products are OpenBLAS sgemm calls whose leading dimensions step
 * over the fused QKV / KV buffers, so no head is ever copied out. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>

#include "nmt/ref.h"

static nmt_status check_args(const char *op, const int32_t *k_lens, int ldq, int ldkv, int B,
                             int Tq, int Tk, int H, int dk, float p_drop) {
  if (B < 0 || Tq < 0 || Tk < 1 || H < 1 || dk < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: bad shape B=%d Tq=%d Tk=%d H=%d dk=%d", op, B,
                      Tq, Tk, H, dk);
  if (ldq < H * dk || ldkv < H * dk)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: ldq=%d / ldkv=%d smaller than H*dk=%d", op, ldq,
                      ldkv, H * dk);
  if (!(p_drop >= 0.0f && p_drop < 1.0f))
    return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: dropout probability %g outside [0, 1)", op,
                      (double)p_drop);
  for (int b = 0; b < B; b++)
    if (k_lens[b] < 1 || k_lens[b] > Tk)
      return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: k_lens[%d] = %d outside [1, Tk=%d]", op, b,
                        (int)k_lens[b], Tk);
  return NMT_OK;
}

/* Keys j < limit(i) are visible to query i. */
static inline int key_limit(int k_len, int i, int causal) {
  return causal && i + 1 < k_len ? i + 1 : k_len;
}

/* Scratch for the dropped probabilities of one (b,h) and their keep mask; NULLs when p == 0. */
typedef struct {
  float *pd;
  uint8_t *keep;
} drop_scratch;

static nmt_status scratch_alloc(drop_scratch *s, const char *op, int Tq, int Tk, float p_drop) {
  s->pd = NULL;
  s->keep = NULL;
  if (p_drop == 0.0f || Tq == 0) return NMT_OK;
  size_t n = (size_t)Tq * Tk;
  s->pd = malloc(n * sizeof(float));
  s->keep = malloc(n);
  if (!s->pd || !s->keep) {
    free(s->pd);
    free(s->keep);
    return nmt_errorf(NMT_ERR_NOMEM, "ref %s: cannot allocate dropout scratch of %zu elements",
                      op, n);
  }
  return NMT_OK;
}

static void scratch_free(drop_scratch *s) {
  free(s->pd);
  free(s->keep);
}

/* dropout(P) of block bh into s->pd (keep mask left in s->keep); returns the matrix to use. */
static const float *dropped(drop_scratch *s, const float *P, size_t bh, size_t n, float p_drop,
                            uint64_t seed, uint64_t stream) {
  if (p_drop == 0.0f) return P;
  float scale = 1.0f / (1.0f - p_drop);
  nmt_ref_dropout_keep(s->keep, bh * n, n, p_drop, seed, stream);
  for (size_t e = 0; e < n; e++) s->pd[e] = s->keep[e] ? P[e] * scale : 0.0f;
  return s->pd;
}

// out: (B,Tq,H*dk); probs: (B,H,Tq,Tk); q: rows of ldq; k, v: rows of ldkv; k_lens: (B)
nmt_status nmt_ref_attention_fwd(void *ctx, float *out, float *probs, const float *q, int ldq,
                                 const float *k, const float *v, int ldkv, const int32_t *k_lens,
                                 int B, int Tq, int Tk, int H, int dk, int causal, float p_drop,
                                 uint64_t seed, uint64_t stream) {
  (void)ctx;
  NMT_TRY(check_args("attention_fwd", k_lens, ldq, ldkv, B, Tq, Tk, H, dk, p_drop));
  if (Tq == 0) return NMT_OK;
  drop_scratch s;
  NMT_TRY(scratch_alloc(&s, "attention_fwd", Tq, Tk, p_drop));
  const int C = H * dk;
  const float scale = (float)(1.0 / sqrt((double)dk));
  const size_t n = (size_t)Tq * Tk;
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < H; h++) {
      size_t bh = (size_t)b * H + h;
      float *P = probs + bh * n;
      const float *Q = q + (size_t)b * Tq * ldq + (size_t)h * dk;
      const float *K = k + (size_t)b * Tk * ldkv + (size_t)h * dk;
      const float *V = v + (size_t)b * Tk * ldkv + (size_t)h * dk;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Tq, Tk, dk, scale, Q, ldq, K, ldkv,
                  0.0f, P, Tk);
      for (int i = 0; i < Tq; i++) {
        float *row = P + (size_t)i * Tk;
        int lim = key_limit(k_lens[b], i, causal);
        float mx = row[0];
        for (int j = 1; j < lim; j++) mx = row[j] > mx ? row[j] : mx;
        double sum = 0;
        for (int j = 0; j < lim; j++) {
          row[j] = expf(row[j] - mx);
          sum += row[j];
        }
        float inv = (float)(1.0 / sum);
        for (int j = 0; j < lim; j++) row[j] *= inv;
        /* Masked keys get an exact 0 (softmax of -inf), hence exactly zero gradient. */
        for (int j = lim; j < Tk; j++) row[j] = 0.0f;
      }
      const float *A = dropped(&s, P, bh, n, p_drop, seed, stream);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Tq, dk, Tk, 1.0f, A, Tk, V, ldkv,
                  0.0f, out + (size_t)b * Tq * C + (size_t)h * dk, C);
    }
  }
  scratch_free(&s);
  return NMT_OK;
}

/* With A = dropout(P), out = A V:  dV += A^T dout;  dA = dout V^T;  dP = dropout mask of dA;
 * dS = P * (dP - rowsum(P * dP)) (softmax Jacobian);  dQ += scale dS K;  dK += scale dS^T Q. */
nmt_status nmt_ref_attention_bwd(void *ctx, float *dq, float *dkey, float *dv, float *dprobs,
                                 const float *dout, const float *probs, const float *q, int ldq,
                                 const float *k, const float *v, int ldkv, const int32_t *k_lens,
                                 int B, int Tq, int Tk, int H, int dk, int causal, float p_drop,
                                 uint64_t seed, uint64_t stream) {
  (void)ctx;
  (void)causal; /* the mask is already in probs as exact zeros */
  NMT_TRY(check_args("attention_bwd", k_lens, ldq, ldkv, B, Tq, Tk, H, dk, p_drop));
  if (Tq == 0 || (!dq && !dkey && !dv)) return NMT_OK;
  drop_scratch s;
  NMT_TRY(scratch_alloc(&s, "attention_bwd", Tq, Tk, p_drop));
  const int C = H * dk;
  const float scale = (float)(1.0 / sqrt((double)dk));
  const float dscale = p_drop > 0.0f ? 1.0f / (1.0f - p_drop) : 1.0f;
  const size_t n = (size_t)Tq * Tk;
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < H; h++) {
      size_t bh = (size_t)b * H + h;
      const float *P = probs + bh * n;
      float *dP = dprobs + bh * n;
      size_t qoff = (size_t)b * Tq * ldq + (size_t)h * dk;
      size_t kvoff = (size_t)b * Tk * ldkv + (size_t)h * dk;
      const float *dO = dout + (size_t)b * Tq * C + (size_t)h * dk;
      const float *A = dropped(&s, P, bh, n, p_drop, seed, stream);
      if (dv)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Tk, dk, Tq, 1.0f, A, Tk, dO, C,
                    1.0f, dv + kvoff, ldkv);
      if (!dq && !dkey) continue;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Tq, Tk, dk, 1.0f, dO, C, v + kvoff,
                  ldkv, 0.0f, dP, Tk);
      if (p_drop > 0.0f)
        for (size_t e = 0; e < n; e++) dP[e] = s.keep[e] ? dP[e] * dscale : 0.0f;
      for (int i = 0; i < Tq; i++) {
        const float *pr = P + (size_t)i * Tk;
        float *dr = dP + (size_t)i * Tk;
        double dot = 0;
        for (int j = 0; j < Tk; j++) dot += (double)pr[j] * dr[j];
        float dotf = (float)dot;
        for (int j = 0; j < Tk; j++) dr[j] = pr[j] * (dr[j] - dotf);
      }
      if (dq)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Tq, dk, Tk, scale, dP, Tk,
                    k + kvoff, ldkv, 1.0f, dq + qoff, ldq);
      if (dkey)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Tk, dk, Tq, scale, dP, Tk,
                    q + qoff, ldq, 1.0f, dkey + kvoff, ldkv);
    }
  }
  scratch_free(&s);
  return NMT_OK;
}
