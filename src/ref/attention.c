/* ref/attention.c — multi-head scaled dot-product attention (Vaswani et al. 2017 §3.2.1 eq. 1,
 * §3.2.2) with key-padding and causal masks and dropout on the attention probabilities (§5.4).
 *
 * Each product (scores Q K^T, weighted sum A V, and in backward A^T dO, dO V^T, dS K, dS^T Q)
 * is ONE logical strided-batched GEMM over the B x H (sentence, head) blocks, as on the GPU
 * (cuda/attention.cu: one cuBLASLt call per product), and is counted as one GEMM call
 * (nmt_backend_counters). Here the batched call loops over the blocks with one OpenBLAS sgemm
 * each, whose leading dimensions step over the fused QKV / KV buffers, so no head is copied
 * out. Every block's elements are computed by the same sgemm, softmax and mask code in the
 * same order as when the blocks ran one after another (blocks write disjoint outputs), so the
 * results are bitwise those of the per-(b,h) loop this replaced. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/half.h"
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

/* One operand of a batched product: block (b, h) starts at p + b*sb + h*sh, rows of ld. */
typedef struct {
  const float *p;
  size_t sb, sh;
  int ld;
} view;

static inline const float *at(view v, int b, int h) {
  return v.p + (size_t)b * v.sb + (size_t)h * v.sh;
}

/* C(b,h) = alpha op(A(b,h)) op(B(b,h)) + beta C(b,h), row-major (m x n), for every block:
 * one logical GEMM call. */
static void batched_gemm(void *ctx, int B, int H, enum CBLAS_TRANSPOSE ta,
                         enum CBLAS_TRANSPOSE tb, int m, int n, int k, float alpha, view a,
                         view bm, float beta, view c) {
  for (int b = 0; b < B; b++)
    for (int h = 0; h < H; h++)
      cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, alpha, at(a, b, h), a.ld, at(bm, b, h), bm.ld,
                  beta, (float *)at(c, b, h), c.ld);
  nmt__ref_count_gemm(ctx, 1);
}

/* The views of q, k/v, the head outputs (rows of C) and the (Tq, Tk) probability blocks. */
static view q_view(const float *q, int ldq, int Tq, int dk) {
  return (view){q, (size_t)Tq * ldq, (size_t)dk, ldq};
}
static view kv_view(const float *k, int ldkv, int Tk, int dk) {
  return (view){k, (size_t)Tk * ldkv, (size_t)dk, ldkv};
}
static view o_view(const float *o, int Tq, int C, int dk) {
  return (view){o, (size_t)Tq * C, (size_t)dk, C};
}
static view p_view(const float *p, int H, int Tq, int Tk) {
  return (view){p, (size_t)H * Tq * Tk, (size_t)Tq * Tk, Tk};
}

/* The dropped probabilities of all B*H*Tq*Tk elements and their keep mask, in the context's
 * attention scratch (or malloc'ed without a context: *owned[] to free); NULLs when p == 0. */
typedef struct {
  float *pd;
  uint8_t *keep;
  void *owned[2];
} drop_scratch;

static nmt_status drop_alloc(void *ctx, drop_scratch *s, size_t total, float p_drop) {
  s->pd = NULL;
  s->keep = NULL;
  s->owned[0] = s->owned[1] = NULL;
  if (p_drop == 0.0f || total == 0) return NMT_OK;
  float *k;
  NMT_TRY(nmt__ref_scratch_or_malloc(ctx, NMT_REF_SLOT_ATT_DROP, total, &s->pd, &s->owned[0]));
  nmt_status st = nmt__ref_scratch_or_malloc(ctx, NMT_REF_SLOT_ATT_KEEP,
                                             (total + sizeof(float) - 1) / sizeof(float), &k,
                                             &s->owned[1]);
  if (st != NMT_OK) {
    free(s->owned[0]);
    return st;
  }
  s->keep = (uint8_t *)k;
  return NMT_OK;
}

static void drop_free(drop_scratch *s) {
  free(s->owned[0]);
  free(s->owned[1]);
}

/* s->pd = dropout(P) over all `total` elements (keep mask in s->keep); the matrix to use. */
static const float *dropped(drop_scratch *s, const float *P, size_t total, float p_drop,
                            uint64_t seed, uint64_t stream) {
  if (p_drop == 0.0f) return P;
  float scale = 1.0f / (1.0f - p_drop);
  nmt_ref_dropout_keep(s->keep, 0, total, p_drop, seed, stream);
  for (size_t e = 0; e < total; e++) s->pd[e] = s->keep[e] ? P[e] * scale : 0.0f;
  return s->pd;
}

/* Softmax over the visible keys of every row of probs (B,H,Tq,Tk), in place; exact zeros for
 * masked keys. */
static void softmax_rows(float *probs, const int32_t *k_lens, int B, int H, int Tq, int Tk,
                         int causal) {
  for (int b = 0; b < B; b++)
    for (int h = 0; h < H; h++)
      for (int i = 0; i < Tq; i++) {
        float *row = probs + (((size_t)b * H + h) * Tq + i) * Tk;
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
}

// out: (B,Tq,H*dk); probs: (B,H,Tq,Tk); q: rows of ldq; k, v: rows of ldkv; k_lens: (B)
nmt_status nmt_ref_attention_fwd(void *ctx, float *out, float *probs, const float *q, int ldq,
                                 const float *k, const float *v, int ldkv, const int32_t *k_lens,
                                 int B, int Tq, int Tk, int H, int dk, int causal, float p_drop,
                                 uint64_t seed, uint64_t stream) {
  NMT_TRY(check_args("attention_fwd", k_lens, ldq, ldkv, B, Tq, Tk, H, dk, p_drop));
  if (Tq == 0 || B == 0) return NMT_OK;
  const size_t total = (size_t)B * H * Tq * Tk;
  drop_scratch s;
  NMT_TRY(drop_alloc(ctx, &s, total, p_drop));
  const int C = H * dk;
  const float scale = (float)(1.0 / sqrt((double)dk));
  const view P = p_view(probs, H, Tq, Tk);
  batched_gemm(ctx, B, H, CblasNoTrans, CblasTrans, Tq, Tk, dk, scale, q_view(q, ldq, Tq, dk),
               kv_view(k, ldkv, Tk, dk), 0.0f, P);
  softmax_rows(probs, k_lens, B, H, Tq, Tk, causal);
  const float *A = dropped(&s, probs, total, p_drop, seed, stream);
  batched_gemm(ctx, B, H, CblasNoTrans, CblasNoTrans, Tq, dk, Tk, 1.0f, p_view(A, H, Tq, Tk),
               kv_view(v, ldkv, Tk, dk), 0.0f, o_view(out, Tq, C, dk));
  drop_free(&s);
  return NMT_OK;
}

/* With A = dropout(P), out = A V:  dV += A^T dout;  dA = dout V^T;  dP = dropout mask of dA;
 * dS = P * (dP - rowsum(P * dP)) (softmax Jacobian);  dQ += scale dS K;  dK += scale dS^T Q. */
nmt_status nmt_ref_attention_bwd(void *ctx, float *dq, float *dkey, float *dv, float *dprobs,
                                 const float *dout, const float *probs, const float *q, int ldq,
                                 const float *k, const float *v, int ldkv, const int32_t *k_lens,
                                 int B, int Tq, int Tk, int H, int dk, int causal, float p_drop,
                                 uint64_t seed, uint64_t stream) {
  (void)causal; /* the mask is already in probs as exact zeros */
  NMT_TRY(check_args("attention_bwd", k_lens, ldq, ldkv, B, Tq, Tk, H, dk, p_drop));
  if (Tq == 0 || B == 0 || (!dq && !dkey && !dv)) return NMT_OK;
  const size_t total = (size_t)B * H * Tq * Tk;
  drop_scratch s;
  NMT_TRY(drop_alloc(ctx, &s, total, p_drop));
  const int C = H * dk;
  const float scale = (float)(1.0 / sqrt((double)dk));
  const float dscale = p_drop > 0.0f ? 1.0f / (1.0f - p_drop) : 1.0f;
  const view dO = o_view(dout, Tq, C, dk), P = p_view(probs, H, Tq, Tk);
  const view dP = p_view(dprobs, H, Tq, Tk);
  const float *A = dropped(&s, probs, total, p_drop, seed, stream);
  if (dv)
    batched_gemm(ctx, B, H, CblasTrans, CblasNoTrans, Tk, dk, Tq, 1.0f, p_view(A, H, Tq, Tk), dO,
                 1.0f, kv_view(dv, ldkv, Tk, dk));
  if (dq || dkey) {
    batched_gemm(ctx, B, H, CblasNoTrans, CblasTrans, Tq, Tk, dk, 1.0f, dO,
                 kv_view(v, ldkv, Tk, dk), 0.0f, dP);
    if (p_drop > 0.0f)
      for (size_t e = 0; e < total; e++) dprobs[e] = s.keep[e] ? dprobs[e] * dscale : 0.0f;
    for (size_t r = 0; r < (size_t)B * H * Tq; r++) {
      const float *pr = P.p + r * Tk;
      float *dr = dprobs + r * Tk;
      double dot = 0;
      for (int j = 0; j < Tk; j++) dot += (double)pr[j] * dr[j];
      float dotf = (float)dot;
      for (int j = 0; j < Tk; j++) dr[j] = pr[j] * (dr[j] - dotf);
    }
    if (dq)
      batched_gemm(ctx, B, H, CblasNoTrans, CblasNoTrans, Tq, dk, Tk, scale, dP,
                   kv_view(k, ldkv, Tk, dk), 1.0f, q_view(dq, ldq, Tq, dk));
    if (dkey)
      batched_gemm(ctx, B, H, CblasTrans, CblasNoTrans, Tk, dk, Tq, scale, dP,
                   q_view(q, ldq, Tq, dk), 1.0f, kv_view(dkey, ldkv, Tk, dk));
  }
  drop_free(&s);
  return NMT_OK;
}

/* ---- the half-storage path (nmt/backend.h attention_half_fwd / attention_half_bwd): the fp32
 * op above on widened copies of the head columns, then one rounding per stored element ---- */

/* x's rows (n of them, H*dk columns starting at x, rows ld apart) widened into a compact
 * (n, H*dk) fp32 copy. */
static void widen_rows(int bf16, float *out, const nmt_act *x, int ld, size_t n, int C) {
  for (size_t r = 0; r < n; r++)
    nmt_half_decode_array(bf16, out + r * (size_t)C, x + r * (size_t)ld, (size_t)C);
}

/* The compact (n, C) fp32 rows of src rounded into x's strided rows. */
static void narrow_rows(int bf16, nmt_act *x, int ld, const float *src, size_t n, int C) {
  for (size_t r = 0; r < n; r++)
    nmt_half_encode_array(bf16, x + r * (size_t)ld, src + r * (size_t)C, (size_t)C);
}

// out: (B,Tq,H*dk) half; probs: (B,H,Tq,Tk) fp32; q: rows of ldq, k, v: rows of ldkv, half
nmt_status nmt_ref_attention_half_fwd(void *ctx, nmt_act *out, float *probs, const nmt_act *q,
                                      int ldq, const nmt_act *k, const nmt_act *v, int ldkv,
                                      const int32_t *k_lens, int B, int Tq, int Tk, int H, int dk,
                                      int causal, float p_drop, uint64_t seed, uint64_t stream) {
  NMT_TRY(check_args("attention_half_fwd", k_lens, ldq, ldkv, B, Tq, Tk, H, dk, p_drop));
  int bf16;
  NMT_TRY(nmt__ref_half_mode(ctx, "attention_half_fwd", &bf16));
  if (Tq == 0 || B == 0) return NMT_OK;
  const int C = H * dk;
  const size_t nq = (size_t)B * Tq, nk = (size_t)B * Tk;
  float *qf, *kf, *vf, *of;
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_ATT_Q, nq * C, &qf));
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_ATT_K, nk * C, &kf));
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_ATT_V, nk * C, &vf));
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_ATT_O, nq * C, &of));
  widen_rows(bf16, qf, q, ldq, nq, C);
  widen_rows(bf16, kf, k, ldkv, nk, C);
  widen_rows(bf16, vf, v, ldkv, nk, C);
  NMT_TRY(nmt_ref_attention_fwd(ctx, of, probs, qf, C, kf, vf, C, k_lens, B, Tq, Tk, H, dk, causal,
                                p_drop, seed, stream));
  narrow_rows(bf16, out, C, of, nq, C);
  return NMT_OK;
}

// dq: rows of ldq, dkey, dv: rows of ldkv, half, written; dout: (B,Tq,H*dk) half
nmt_status nmt_ref_attention_half_bwd(void *ctx, nmt_act *dq, nmt_act *dkey, nmt_act *dv,
                                      float *dprobs, const nmt_act *dout, const float *probs,
                                      const nmt_act *q, int ldq, const nmt_act *k,
                                      const nmt_act *v, int ldkv, const int32_t *k_lens, int B,
                                      int Tq, int Tk, int H, int dk, int causal, float p_drop,
                                      uint64_t seed, uint64_t stream) {
  NMT_TRY(check_args("attention_half_bwd", k_lens, ldq, ldkv, B, Tq, Tk, H, dk, p_drop));
  int bf16;
  NMT_TRY(nmt__ref_half_mode(ctx, "attention_half_bwd", &bf16));
  if (Tq == 0 || B == 0 || (!dq && !dkey && !dv)) return NMT_OK;
  const int C = H * dk;
  const size_t nq = (size_t)B * Tq, nk = (size_t)B * Tk;
  float *qf, *kf, *vf, *gf, *dqf, *dkf, *dvf;
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_ATT_Q, nq * C, &qf));
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_ATT_K, nk * C, &kf));
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_ATT_V, nk * C, &vf));
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_ATT_O, nq * C, &gf));
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_ATT_DQ, nq * C, &dqf));
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_ATT_DK, nk * C, &dkf));
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_ATT_DV, nk * C, &dvf));
  widen_rows(bf16, qf, q, ldq, nq, C);
  widen_rows(bf16, kf, k, ldkv, nk, C);
  widen_rows(bf16, vf, v, ldkv, nk, C);
  widen_rows(bf16, gf, dout, C, nq, C);
  /* The fp32 op accumulates: into zeros, then one rounding each. */
  memset(dqf, 0, nq * C * sizeof(float));
  memset(dkf, 0, nk * C * sizeof(float));
  memset(dvf, 0, nk * C * sizeof(float));
  NMT_TRY(nmt_ref_attention_bwd(ctx, dq ? dqf : NULL, dkey ? dkf : NULL, dv ? dvf : NULL, dprobs,
                                gf, probs, qf, C, kf, vf, C, k_lens, B, Tq, Tk, H, dk, causal,
                                p_drop, seed, stream));
  if (dq) narrow_rows(bf16, dq, ldq, dqf, nq, C);
  if (dkey) narrow_rows(bf16, dkey, ldkv, dkf, nk, C);
  if (dv) narrow_rows(bf16, dv, ldkv, dvf, nk, C);
  return NMT_OK;
}
