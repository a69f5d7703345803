/* test/test_attention_batched.c — attention's products as one batched GEMM each (issue 15):
 * the reference (src/ref/attention.c) must give BITWISE the results of the per-(sentence, head)
 * loop it replaced (kept below verbatim as the oracle, apart from its argument checks), with
 * and without a context, over fused self-attention with the causal mask and dropout and
 * strided cross-attention with key padding; and count one GEMM call per product
 * (nmt_backend_counters.gemm_calls: 2 forward, up to 4 backward), as cuda/attention.cu makes
 * one cuBLASLt call per product. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/backend.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

/* ---- the oracle: src/ref/attention.c before issue 15 ---- */

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
static nmt_status per_head_fwd(void *ctx, float *out, float *probs, const float *q, int ldq,
                                 const float *k, const float *v, int ldkv, const int32_t *k_lens,
                                 int B, int Tq, int Tk, int H, int dk, int causal, float p_drop,
                                 uint64_t seed, uint64_t stream) {
  (void)ctx;
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
static nmt_status per_head_bwd(void *ctx, float *dq, float *dkey, float *dv, float *dprobs,
                                 const float *dout, const float *probs, const float *q, int ldq,
                                 const float *k, const float *v, int ldkv, const int32_t *k_lens,
                                 int B, int Tq, int Tk, int H, int dk, int causal, float p_drop,
                                 uint64_t seed, uint64_t stream) {
  (void)ctx;
  (void)k_lens;
  (void)causal; /* the mask is already in probs as exact zeros */
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

/* ---- the cases ---- */

typedef struct {
  int B, Tq, Tk, H, dk, causal, fused; /* fused: q, k, v column slices of one (B*T, 3C) buffer */
  float p;
  int32_t lens[4];
} bcase;

static float *randn(size_t n, uint64_t seed) {
  float *x = malloc((n ? n : 1) * sizeof *x);
  for (size_t i = 0; x && i < n; i++)
    x[i] = (float)nmt_rng_uniform(seed, 7, i) * 2.0f - 1.0f;
  return x;
}

static float *dup(const float *x, size_t n) {
  float *y = malloc((n ? n : 1) * sizeof *y);
  if (y) memcpy(y, x, n * sizeof *y);
  return y;
}

/* Runs case a through the batched reference (on ctx, which may be NULL) and the oracle, from
 * the same inputs and gradient start values, with every gradient requested or only `only`
 * (1 = dq, 2 = dkey, 3 = dv; 0 = all three); every output must be bitwise equal. Returns the
 * context's GEMM count of the batched forward and backward in *fwd, *bwd (0 with a NULL ctx). */
static void bitwise_case(const bcase *a, void *ctx, int only, long *fwd, long *bwd) {
  const int B = a->B, Tq = a->Tq, Tk = a->Tk, H = a->H, dk = a->dk, C = H * dk;
  const int ldq = a->fused ? 3 * C : C, ldkv = a->fused ? 3 * C : 2 * C;
  const size_t nq = (size_t)B * Tq * ldq, nkv = a->fused ? nq : (size_t)B * Tk * ldkv;
  const size_t no = (size_t)B * Tq * C, np = (size_t)B * H * Tq * Tk;
  float *qb = randn(nq, 1), *kvb = a->fused ? qb : randn(nkv, 2), *dout = randn(no, 3);
  float *dq0 = randn(nq, 4), *dkv0 = a->fused ? dq0 : randn(nkv, 5);
  float *o1 = malloc(no * 4), *o2 = malloc(no * 4), *p1 = malloc(np * 4), *p2 = malloc(np * 4);
  float *s1 = malloc(np * 4), *s2 = malloc(np * 4);
  float *dq1 = dup(dq0, nq), *dq2 = dup(dq0, nq);
  float *dkv1 = a->fused ? dq1 : dup(dkv0, nkv), *dkv2 = a->fused ? dq2 : dup(dkv0, nkv);
  if (!qb || !kvb || !dout || !dq0 || !dkv0 || !o1 || !o2 || !p1 || !p2 || !s1 || !s2 || !dq1 ||
      !dq2 || !dkv1 || !dkv2) {
    nmt_test_fail(__FILE__, __LINE__, "out of memory");
    goto out;
  }
  const size_t ko = a->fused ? (size_t)C : 0, vo = a->fused ? 2 * (size_t)C : (size_t)C;
  const uint64_t seed = 99, stream = nmt_rng_stream(4, 21);
  nmt_backend_counters c0 = {0}, c1 = {0}, c2 = {0};
  if (ctx && nmt_ref_counters(ctx, &c0) != NMT_OK) goto fail;
  if (nmt_ref_attention_fwd(ctx, o1, p1, qb, ldq, kvb + ko, kvb + vo, ldkv, a->lens, B, Tq, Tk, H,
                            dk, a->causal, a->p, seed, stream) != NMT_OK ||
      per_head_fwd(NULL, o2, p2, qb, ldq, kvb + ko, kvb + vo, ldkv, a->lens, B, Tq, Tk, H, dk,
                   a->causal, a->p, seed, stream) != NMT_OK)
    goto fail;
  if (ctx && nmt_ref_counters(ctx, &c1) != NMT_OK) goto fail;
  float *g1[3] = {dq1, dkv1 + ko, dkv1 + vo}, *g2[3] = {dq2, dkv2 + ko, dkv2 + vo};
  for (int i = 0; i < 3; i++)
    if (only && only != i + 1) g1[i] = g2[i] = NULL;
  if (nmt_ref_attention_bwd(ctx, g1[0], g1[1], g1[2], s1, dout, p1, qb, ldq, kvb + ko, kvb + vo,
                            ldkv, a->lens, B, Tq, Tk, H, dk, a->causal, a->p, seed,
                            stream) != NMT_OK ||
      per_head_bwd(NULL, g2[0], g2[1], g2[2], s2, dout, p2, qb, ldq, kvb + ko, kvb + vo, ldkv,
                   a->lens, B, Tq, Tk, H, dk, a->causal, a->p, seed, stream) != NMT_OK)
    goto fail;
  if (ctx && nmt_ref_counters(ctx, &c2) != NMT_OK) goto fail;
  *fwd = (long)(c1.gemm_calls - c0.gemm_calls);
  *bwd = (long)(c2.gemm_calls - c1.gemm_calls);
  const struct {
    const char *what;
    const float *x, *y;
    size_t n;
  } cmp[] = {{"out", o1, o2, no}, {"probs", p1, p2, np}, {"dq", dq1, dq2, nq},
             {"dkv", dkv1, dkv2, a->fused ? 0 : nkv}};
  for (size_t i = 0; i < sizeof cmp / sizeof *cmp; i++)
    if (cmp[i].n && memcmp(cmp[i].x, cmp[i].y, cmp[i].n * sizeof(float))) {
      size_t e = 0;
      while (memcmp(&cmp[i].x[e], &cmp[i].y[e], sizeof(float)) == 0) e++;
      nmt_test_fail(__FILE__, __LINE__,
                    "%s differs from the per-head loop at %zu: %.9g vs %.9g (B=%d Tq=%d Tk=%d "
                    "H=%d causal=%d p=%g only=%d ctx=%s)",
                    cmp[i].what, e, (double)cmp[i].x[e], (double)cmp[i].y[e], B, Tq, Tk, H,
                    a->causal, (double)a->p, only, ctx ? "yes" : "NULL");
      break;
    }
  goto out;
fail:
  nmt_test_fail(__FILE__, __LINE__, "attention failed: %s", nmt_last_error());
out:
  free(o1), free(o2), free(p1), free(p2), free(s1), free(s2), free(dout);
  if (!a->fused) free(kvb), free(dkv0), free(dkv1), free(dkv2);
  free(qb), free(dq0), free(dq1), free(dq2);
}

static const bcase cases[] = {
    {3, 7, 7, 4, 5, 1, 1, 0.3f, {7, 4, 6}},   /* decoder self-attention, fused QKV, dropout */
    {2, 6, 6, 2, 8, 0, 1, 0.0f, {3, 6}},      /* encoder self-attention with padding */
    {3, 5, 9, 4, 3, 0, 0, 0.25f, {9, 2, 5}},  /* cross-attention, strided KV, dropout */
    {4, 1, 6, 2, 4, 0, 0, 0.0f, {6, 1, 3, 6}}, /* one query per sentence (decoding) */
};

NMT_TEST(attention_batched_bitwise_per_head) {
  void *ctx = NULL;
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &ctx));
  for (size_t i = 0; i < sizeof cases / sizeof *cases && !nmt_test_failed(); i++)
    for (int with_ctx = 0; with_ctx < 2 && !nmt_test_failed(); with_ctx++)
      for (int only = 0; only < 4 && !nmt_test_failed(); only++) {
        long f = -1, b = -1;
        bitwise_case(&cases[i], with_ctx ? ctx : NULL, only, &f, &b);
        if (!with_ctx || nmt_test_failed()) continue;
        /* forward: scores and weighted sum; backward: dv (A^T dO), and for dq or dkey the
         * weights' gradient (dO V^T) plus dq (dS K) and/or dkey (dS^T Q). */
        const long want_b = only == 0 ? 4 : only == 3 ? 1 : 2;
        if (f != 2 || b != want_b)
          nmt_test_fail(__FILE__, __LINE__, "case %zu only=%d: %ld + %ld GEMM calls, want 2 + %ld",
                        i, only, f, b, want_b);
      }
  nmt_ref_ctx_destroy(ctx);
}
