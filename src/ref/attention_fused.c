/* ref/attention_fused.c — fused multi-head attention (issue 35; contract and rounding sites in
 * nmt/attention.h): scaled dot-product attention (Vaswani et al. 2017 §3.2.1 eq. 1, §3.2.2)
 * that keeps each query row's log-sum-exp instead of the (B,H,Tq,Tk) probabilities and
 * recomputes them in backward (FlashAttention-2, Dao 2023, Algorithms 1 and 2; the softmax
 * exact in two passes, without online rescaling).
 *
 * The reference is the contract written as loops: one (sentence, head) block at a time, one
 * query row at a time, every sum a float accumulator in index order (d for the dot products, j
 * for the softmax and A V, i for dK and dV), so the CUDA kernels can be checked against it
 * site by site and a test can re-derive it bitwise. No BLAS: a GEMM's summation order is not
 * index order. half = 1 widens the block's head columns into compact fp32 copies first (exact)
 * and rounds at the contract's sites (A, dS, and every stored output). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/attention.h"
#include "nmt/half.h"
#include "nmt/ref.h"

static nmt_status check_args(const char *op, const nmt_attn_args *a) {
  if (!a) return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: arguments are NULL", op);
  if (a->B < 0 || a->Tq < 0 || a->Tk < 1 || a->H < 1 || a->dk < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: bad shape B=%d Tq=%d Tk=%d H=%d dk=%d", op, a->B,
                      a->Tq, a->Tk, a->H, a->dk);
  if (a->ldq < a->H * a->dk || a->ldkv < a->H * a->dk)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: ldq=%d / ldkv=%d smaller than H*dk=%d", op,
                      a->ldq, a->ldkv, a->H * a->dk);
  if (!(a->p_drop >= 0.0f && a->p_drop < 1.0f))
    return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: dropout probability %g outside [0, 1)", op,
                      (double)a->p_drop);
  if (a->half != 0 && a->half != 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: half = %d, want 0 or 1", op, a->half);
  if (a->B == 0 || a->Tq == 0) return NMT_OK;
  if (!a->q || !a->k || !a->v || !a->k_lens)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: q, k, v or k_lens is NULL", op);
  for (int b = 0; b < a->B; b++)
    if (a->k_lens[b] < 1 || a->k_lens[b] > a->Tk)
      return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: k_lens[%d] = %d outside [1, Tk=%d]", op, b,
                        (int)a->k_lens[b], a->Tk);
  return NMT_OK;
}

/* Keys j < limit(i) are visible to query i. */
static inline int key_limit(int k_len, int i, int causal) {
  return causal && i + 1 < k_len ? i + 1 : k_len;
}

/* The context's rounding for the half type (bf16 != 0: bfloat16, else fp16); applied only
 * where half = 1. */
static inline float round_half(int bf16, float x) {
  return bf16 ? nmt_half_round_bf16(x) : nmt_half_round_fp16(x);
}

/* One (Tn, dk) operand block: element (r, d) at p[r*ld + d], fp32 values. */
typedef struct {
  const float *p;
  int ld;
} blk;

/* The working state of one op call: the half mode, the shapes, and scratch for the widened
 * head blocks (half = 1), one row of scores and keep flags, and in backward the (Tq, Tk)
 * matrices dS and A and one row of dQ/dK/dV sums. One malloc, freed by work_free. */
typedef struct {
  const nmt_attn_args *a;
  int bf16;
  float scale, r;
  float *wq, *wk, *wv, *wdo, *wo; /* widened blocks (half = 1): (Tq|Tk, dk) */
  float *s;                       /* (Tk) one row's scores, then its weights A */
  uint8_t *keep;                  /* (Tk) one row's dropout keep flags */
  float *dS, *A;                  /* (Tq, Tk) backward only */
  float *acc;                     /* (dk) one gradient row's sums */
  void *mem;
} work;

static nmt_status work_alloc(const char *op, work *w, const nmt_attn_args *a, int bf16, int bwd) {
  memset(w, 0, sizeof *w);
  w->a = a;
  w->bf16 = bf16;
  w->scale = (float)(1.0 / sqrt((double)a->dk));
  w->r = 1.0f / (1.0f - a->p_drop);
  const size_t q = (size_t)a->Tq * a->dk, kv = (size_t)a->Tk * a->dk;
  const size_t blocks = a->half ? q + 2 * kv + (bwd ? 2 * q : 0) : 0;
  const size_t mats = bwd ? 2 * (size_t)a->Tq * a->Tk : 0;
  const size_t nf = blocks + mats + (size_t)a->Tk + (size_t)a->dk;
  const size_t bytes = nf * sizeof(float) + (size_t)a->Tk;
  if (!(w->mem = malloc(bytes)))
    return nmt_errorf(NMT_ERR_NOMEM, "ref %s: cannot allocate %zu bytes of scratch", op, bytes);
  float *f = w->mem;
  if (a->half) {
    w->wq = f, f += q;
    w->wk = f, f += kv;
    w->wv = f, f += kv;
    if (bwd) w->wdo = f, f += q, w->wo = f, f += q;
  }
  if (bwd) w->dS = f, f += (size_t)a->Tq * a->Tk, w->A = f, f += (size_t)a->Tq * a->Tk;
  w->s = f, f += a->Tk;
  w->acc = f, f += a->dk;
  w->keep = (uint8_t *)f;
  return NMT_OK;
}

static void work_free(work *w) { free(w->mem); }

/* Head h's columns of rows [row0, row0 + n) of x (rows ld apart): the float rows themselves
 * (half = 0), or widened into the compact (n, dk) copy dst (half = 1; exact). */
static blk head_block(const work *w, const void *x, int ld, size_t row0, int n, int h,
                      float *dst) {
  const int dk = w->a->dk;
  if (!w->a->half) return (blk){(const float *)x + row0 * ld + (size_t)h * dk, ld};
  const nmt_act *src = (const nmt_act *)x + row0 * ld + (size_t)h * dk;
  for (int r = 0; r < n; r++)
    nmt_half_decode_array(w->bf16, dst + (size_t)r * dk, src + (size_t)r * ld, (size_t)dk);
  return (blk){dst, dk};
}

/* s_j = scale * sum_d q_id k_jd for the visible keys j < lim (d in order, then the scale). */
static void row_scores(const work *w, blk q, blk k, int i, int lim, float *s) {
  const int dk = w->a->dk;
  const float *qi = q.p + (size_t)i * q.ld;
  for (int j = 0; j < lim; j++) {
    const float *kj = k.p + (size_t)j * k.ld;
    float acc = 0.0f;
    for (int d = 0; d < dk; d++) acc += qi[d] * kj[d];
    s[j] = w->scale * acc;
  }
}

/* Row (b,h,i)'s keep flags into w->keep[0..lim): the unfused op's mask (nmt_ref_dropout_keep
 * draws nmt_rng_uniform(seed, stream, e) >= p_drop per element e, bitwise). */
static void row_keep(work *w, int b, int h, int i, int lim) {
  const nmt_attn_args *a = w->a;
  if (a->p_drop == 0.0f || lim == 0) return;
  const uint64_t e0 = (((uint64_t)b * a->H + h) * a->Tq + i) * (uint64_t)a->Tk;
  nmt_ref_dropout_keep(w->keep, e0, (size_t)lim, a->p_drop, a->seed, a->stream);
}

/* a_j = keep ? P_j r : 0 (P_j when p_drop = 0), then A_j = round(a_j) in half mode. */
static inline float weight(const work *w, float P, int j) {
  float x = w->a->p_drop == 0.0f ? P : w->keep[j] ? P * w->r : 0.0f;
  return w->a->half ? round_half(w->bf16, x) : x;
}

/* A gradient row: dst's dk columns (float: += x, half: = round(x)) from acc times mul. */
static void store_row(const work *w, void *dst, size_t off, const float *acc, float mul) {
  const int dk = w->a->dk;
  if (!w->a->half) {
    float *o = (float *)dst + off;
    for (int d = 0; d < dk; d++) o[d] += mul * acc[d];
    return;
  }
  nmt_act *o = (nmt_act *)dst + off;
  for (int d = 0; d < dk; d++) {
    float x = mul * acc[d];
    o[d] = w->bf16 ? nmt_half_bf16_bits(x) : nmt_half_fp16_bits(x);
  }
}

/* Forward of block (b, h): for each query row, the scores, the two-pass softmax's max and sum,
 * lse, the weights A and out = round(sum_j A_j v_j). */
static void fwd_block(work *w, void *out, float *lse, int b, int h) {
  const nmt_attn_args *a = w->a;
  const int Tq = a->Tq, Tk = a->Tk, dk = a->dk, C = a->H * dk;
  const blk q = head_block(w, a->q, a->ldq, (size_t)b * Tq, Tq, h, w->wq);
  const blk k = head_block(w, a->k, a->ldkv, (size_t)b * Tk, Tk, h, w->wk);
  const blk v = head_block(w, a->v, a->ldkv, (size_t)b * Tk, Tk, h, w->wv);
  float *s = w->s, *o = w->acc;
  for (int i = 0; i < Tq; i++) {
    const int lim = key_limit(a->k_lens[b], i, a->causal);
    row_scores(w, q, k, i, lim, s);
    float m = s[0];
    for (int j = 1; j < lim; j++) m = s[j] > m ? s[j] : m;
    float l = 0.0f;
    for (int j = 0; j < lim; j++) l += expf(s[j] - m);
    const float L = m + logf(l);
    lse[((size_t)b * a->H + h) * Tq + i] = L;
    row_keep(w, b, h, i, lim);
    for (int j = 0; j < lim; j++) s[j] = weight(w, expf(s[j] - L), j);
    /* O_d = sum_j A_j v_jd: j outer keeps each O_d's sum in j order. */
    for (int d = 0; d < dk; d++) o[d] = 0.0f;
    for (int j = 0; j < lim; j++) {
      const float *vj = v.p + (size_t)j * v.ld;
      for (int d = 0; d < dk; d++) o[d] += s[j] * vj[d];
    }
    const size_t off = ((size_t)b * Tq + i) * C + (size_t)h * dk;
    if (!a->half) {
      memcpy((float *)out + off, o, (size_t)dk * sizeof(float));
    } else {
      nmt_half_encode_array(w->bf16, (nmt_act *)out + off, o, (size_t)dk);
    }
  }
}

// out: (B,Tq,H*dk) float or half; lse: (B,H,Tq) fp32; q: rows of ldq; k, v: rows of ldkv
nmt_status nmt_ref_attention_fused_fwd(void *ctx, void *out, float *lse, const nmt_attn_args *a) {
  NMT_TRY(check_args("attention_fused_fwd", a));
  int bf16 = 0;
  if (a->half) NMT_TRY(nmt__ref_half_mode(ctx, "attention_fused_fwd", &bf16));
  if (a->B == 0 || a->Tq == 0) return NMT_OK;
  if (!out || !lse)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref attention_fused_fwd: out or lse is NULL");
  work w;
  NMT_TRY(work_alloc("attention_fused_fwd", &w, a, bf16, 0));
  for (int b = 0; b < a->B; b++)
    for (int h = 0; h < a->H; h++) fwd_block(&w, out, lse, b, h);
  work_free(&w);
  return NMT_OK;
}

/* The operand blocks of one backward (b, h). */
typedef struct {
  blk q, k, v, dout, out;
} bwd_blocks;

/* Backward of block (b, h), first half: D_i = sum_d dout_id out_id into drow, and for each row
 * the recomputed P and A, dA, dP and dS = round(P (dP - D)) into the (Tq, Tk) matrices
 * w->dS and w->A (exact zeros at the invisible keys). */
static void bwd_scores(work *w, const bwd_blocks *x, const float *lse, float *drow, int b,
                       int h) {
  const nmt_attn_args *a = w->a;
  const int Tq = a->Tq, Tk = a->Tk, dk = a->dk;
  float *s = w->s;
  for (int i = 0; i < Tq; i++) {
    const size_t row = ((size_t)b * a->H + h) * Tq + i;
    const float *gi = x->dout.p + (size_t)i * x->dout.ld, *oi = x->out.p + (size_t)i * x->out.ld;
    float D = 0.0f;
    for (int d = 0; d < dk; d++) D += gi[d] * oi[d];
    drow[row] = D;
    const int lim = key_limit(a->k_lens[b], i, a->causal);
    const float L = lse[row];
    row_scores(w, x->q, x->k, i, lim, s);
    row_keep(w, b, h, i, lim);
    float *dSi = w->dS + (size_t)i * Tk, *Ai = w->A + (size_t)i * Tk;
    for (int j = 0; j < lim; j++) {
      const float P = expf(s[j] - L);
      const float *vj = x->v.p + (size_t)j * x->v.ld;
      float dA = 0.0f;
      for (int d = 0; d < dk; d++) dA += gi[d] * vj[d];
      const float dP = a->p_drop == 0.0f ? dA : w->keep[j] ? dA * w->r : 0.0f;
      const float dS = P * (dP - D);
      dSi[j] = a->half ? round_half(w->bf16, dS) : dS;
      Ai[j] = weight(w, P, j);
    }
    for (int j = lim; j < Tk; j++) dSi[j] = Ai[j] = 0.0f;
  }
}

/* Backward of block (b, h), second half: dQ_i = scale sum_j dS_ij k_j (j order), dK_j =
 * scale sum_i dS_ij q_i and dV_j = sum_i A_ij dout_i (i order), each stored by store_row. */
static void bwd_grads(work *w, const bwd_blocks *x, void *dq, void *dkey, void *dv, int b,
                      int h) {
  const nmt_attn_args *a = w->a;
  const int Tq = a->Tq, Tk = a->Tk, dk = a->dk;
  float *acc = w->acc;
  for (int i = 0; dq && i < Tq; i++) {
    const int lim = key_limit(a->k_lens[b], i, a->causal);
    const float *dSi = w->dS + (size_t)i * Tk;
    for (int d = 0; d < dk; d++) acc[d] = 0.0f;
    for (int j = 0; j < lim; j++) {
      const float *kj = x->k.p + (size_t)j * x->k.ld;
      for (int d = 0; d < dk; d++) acc[d] += dSi[j] * kj[d];
    }
    store_row(w, dq, ((size_t)b * Tq + i) * a->ldq + (size_t)h * dk, acc, w->scale);
  }
  for (int g = 0; g < 2; g++) {
    void *dst = g == 0 ? dkey : dv;
    if (!dst) continue;
    const float *M = g == 0 ? w->dS : w->A;
    const blk y = g == 0 ? x->q : x->dout;
    for (int j = 0; j < Tk; j++) {
      for (int d = 0; d < dk; d++) acc[d] = 0.0f;
      /* Rows that cannot see key j hold exact zeros in M: skipping them changes no sum. */
      for (int i = 0; i < Tq; i++) {
        if (j >= key_limit(a->k_lens[b], i, a->causal)) continue;
        const float m = M[(size_t)i * Tk + j], *yi = y.p + (size_t)i * y.ld;
        for (int d = 0; d < dk; d++) acc[d] += m * yi[d];
      }
      store_row(w, dst, ((size_t)b * Tk + j) * a->ldkv + (size_t)h * dk, acc,
                g == 0 ? w->scale : 1.0f);
    }
  }
}

// dq: rows of ldq, dkey, dv: rows of ldkv (float +=, or half written); drow: (B,H,Tq) fp32;
// dout, out: (B,Tq,H*dk) float or half; lse: (B,H,Tq) fp32 from the forward
nmt_status nmt_ref_attention_fused_bwd(void *ctx, void *dq, void *dkey, void *dv, float *drow,
                                       const void *dout, const void *out, const float *lse,
                                       const nmt_attn_args *a) {
  NMT_TRY(check_args("attention_fused_bwd", a));
  int bf16 = 0;
  if (a->half) NMT_TRY(nmt__ref_half_mode(ctx, "attention_fused_bwd", &bf16));
  if (a->B == 0 || a->Tq == 0) return NMT_OK;
  if (!drow || !dout || !out || !lse)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref attention_fused_bwd: drow, dout, out or lse is NULL");
  work w;
  NMT_TRY(work_alloc("attention_fused_bwd", &w, a, bf16, 1));
  const int Tq = a->Tq, Tk = a->Tk, C = a->H * a->dk;
  for (int b = 0; b < a->B; b++)
    for (int h = 0; h < a->H; h++) {
      const bwd_blocks x = {
          head_block(&w, a->q, a->ldq, (size_t)b * Tq, Tq, h, w.wq),
          head_block(&w, a->k, a->ldkv, (size_t)b * Tk, Tk, h, w.wk),
          head_block(&w, a->v, a->ldkv, (size_t)b * Tk, Tk, h, w.wv),
          head_block(&w, dout, C, (size_t)b * Tq, Tq, h, w.wdo),
          head_block(&w, out, C, (size_t)b * Tq, Tq, h, w.wo),
      };
      bwd_scores(&w, &x, lse, drow, b, h);
      if (dq || dkey || dv) bwd_grads(&w, &x, dq, dkey, dv, b, h);
    }
  work_free(&w);
  return NMT_OK;
}
