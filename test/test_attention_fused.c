/* test/test_attention_fused.c — the reference's fused attention (src/ref/attention_fused.c,
 * contract in nmt/attention.h) held to:
 *   - an emulation of the contract written here independently (whole (Tq, Tk) score
 *     matrices, masked entries as zeros inside every sum, the dropout mask drawn element by
 *     element through nmt_rng_uniform, the half rounding at exactly the contract's sites):
 *     BITWISE, in fp32 and in fp16/bf16 storage, since both sum in index order in fp32;
 *   - the unfused ops (attention_fwd/bwd, attention_half_fwd/bwd), the authority the fused
 *     path replaces: within tolerances derived from the differing softmax (and, in half mode,
 *     the rounding of A and dS, which the unfused op does not round);
 *   - the layout: q/k/v and their gradients as column slices of wider rows, the columns outside
 *     the heads untouched; key padding, the causal mask, cross-attention (Tq != Tk), dk from 8
 *     to 128, T from 1 to 256, B*H >= 1000; dropout's mask the unfused op's;
 *   - two runs bitwise equal, NULL gradients, and the argument errors. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/attention.h"
#include "nmt/backend.h"
#include "nmt/half.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

/* ---- cases ---- */

enum { SELF, CROSS, CROSS_PAD };
typedef struct {
  int B, Tq, Tk, H, dk, causal, layout, pad;
  float p;
} fcase;

/* The column layout: q at column qoff of rows ldq; k, v at koff, voff of rows ldkv. SELF is
 * the fused QKV projection (3C), CROSS a plain q beside padding and the KV projection (2C),
 * CROSS_PAD odd offsets in wider rows. */
typedef struct {
  int C, ldq, qoff, ldkv, koff, voff;
} lay;
static lay layout_of(const fcase *c) {
  const int C = c->H * c->dk;
  if (c->layout == SELF) return (lay){C, 3 * C, 0, 3 * C, C, 2 * C};
  if (c->layout == CROSS) return (lay){C, C + 3, 2, 2 * C, 0, C};
  return (lay){C, 3 * C, C, 2 * C + 5, 3, C + 4};
}

static void make_lens(const fcase *c, int32_t *lens) {
  for (int b = 0; b < c->B; b++) lens[b] = c->pad && b > 0 ? 1 + (b * 5 + 2) % c->Tk : c->Tk;
}

static void fill(float *x, size_t n, float scale, uint64_t stream) {
  for (size_t i = 0; i < n; i++) x[i] = scale * nmt_rng_normal(11, stream, i);
}

/* Every buffer of a case, freed together. */
typedef struct {
  void *p[48];
  int n;
} arena;
static void *get(arena *a, size_t bytes) {
  void *x = a->n < 48 ? calloc(bytes ? bytes : 1, 1) : NULL;
  if (x) a->p[a->n++] = x;
  return x;
}
static void arena_free(arena *a) {
  for (int i = 0; i < a->n; i++) free(a->p[i]);
  a->n = 0;
}
static float *dup_f(arena *a, const float *x, size_t n) {
  float *y = get(a, n * sizeof *y);
  if (y) memcpy(y, x, n * sizeof *y);
  return y;
}

/* ---- the emulation of the contract (nmt/attention.h), fp32 in index order ---- */

typedef struct {
  const fcase *c;
  lay L;
  const int32_t *lens;
  int half, bf16;
  uint64_t seed, stream;
} emu;

static float rnd_site(const emu *e, float x) {
  if (!e->half) return x;
  return e->bf16 ? nmt_half_round_bf16(x) : nmt_half_round_fp16(x);
}
static int visible(const emu *e, int b, int i, int j) {
  return j < e->lens[b] && (!e->c->causal || j <= i);
}

/* For block (b, h): S (scores, 0 where masked), P and A (Tq, Tk), lse (Tq), from decoded q,
 * kv (full strided buffers). */
static void emu_block(const emu *e, const float *q, const float *kv, int b, int h, float *S,
                      float *P, float *A, float *lse) {
  const fcase *c = e->c;
  const int Tq = c->Tq, Tk = c->Tk, dk = c->dk;
  const float scale = (float)(1.0 / sqrt((double)dk)), r = 1.0f / (1.0f - c->p);
  for (int i = 0; i < Tq; i++)
    for (int j = 0; j < Tk; j++) {
      const float *qi = q + ((size_t)b * Tq + i) * e->L.ldq + e->L.qoff + h * dk;
      const float *kj = kv + ((size_t)b * Tk + j) * e->L.ldkv + e->L.koff + h * dk;
      float acc = 0.0f;
      for (int d = 0; d < dk; d++) acc += qi[d] * kj[d];
      S[(size_t)i * Tk + j] = visible(e, b, i, j) ? scale * acc : 0.0f;
    }
  for (int i = 0; i < Tq; i++) {
    const float *s = S + (size_t)i * Tk;
    float m = s[0], l = 0.0f;
    for (int j = 1; j < Tk; j++)
      if (visible(e, b, i, j) && s[j] > m) m = s[j];
    for (int j = 0; j < Tk; j++)
      if (visible(e, b, i, j)) l += expf(s[j] - m);
    lse[i] = m + logf(l);
    for (int j = 0; j < Tk; j++) {
      const float Pj = visible(e, b, i, j) ? expf(s[j] - lse[i]) : 0.0f;
      const uint64_t el = (((uint64_t)b * c->H + h) * Tq + i) * Tk + j;
      const float a = c->p == 0.0f                                      ? Pj
                      : nmt_rng_uniform(e->seed, e->stream, el) >= c->p ? Pj * r
                                                                        : 0.0f;
      P[(size_t)i * Tk + j] = Pj;
      A[(size_t)i * Tk + j] = rnd_site(e, a);
    }
  }
}

/* out (B*Tq, C) compact, rounded in half mode; lse (B,H,Tq). */
static void emu_fwd(const emu *e, const float *q, const float *kv, float *out, float *lse) {
  const fcase *c = e->c;
  const int Tq = c->Tq, Tk = c->Tk, dk = c->dk, C = e->L.C;
  float *S = malloc((size_t)Tq * Tk * 4), *P = malloc((size_t)Tq * Tk * 4),
        *A = malloc((size_t)Tq * Tk * 4);
  for (int b = 0; b < c->B; b++)
    for (int h = 0; h < c->H; h++) {
      emu_block(e, q, kv, b, h, S, P, A, lse + ((size_t)b * c->H + h) * Tq);
      for (int i = 0; i < Tq; i++)
        for (int d = 0; d < dk; d++) {
          float acc = 0.0f;
          for (int j = 0; j < Tk; j++)
            acc += A[(size_t)i * Tk + j] *
                   kv[((size_t)b * Tk + j) * e->L.ldkv + e->L.voff + h * dk + d];
          out[((size_t)b * Tq + i) * C + h * dk + d] = rnd_site(e, acc);
        }
    }
  free(S), free(P), free(A);
}

/* drow (B,H,Tq); dQ (B*Tq, C), dK, dV (B*Tk, C) compact: the sums times their scale, before
 * the store (+= in fp32, round in half mode). dout, out compact (B*Tq, C), out as stored. */
static void emu_bwd(const emu *e, const float *q, const float *kv, const float *dout,
                    const float *out, float *drow, float *dQ, float *dK, float *dV) {
  const fcase *c = e->c;
  const int Tq = c->Tq, Tk = c->Tk, dk = c->dk, C = e->L.C;
  const float scale = (float)(1.0 / sqrt((double)dk)), r = 1.0f / (1.0f - c->p);
  float *S = malloc((size_t)Tq * Tk * 4), *P = malloc((size_t)Tq * Tk * 4),
        *A = malloc((size_t)Tq * Tk * 4), *dS = malloc((size_t)Tq * Tk * 4), *lse = malloc(Tq * 4);
  const size_t ldkv = e->L.ldkv;
  for (int b = 0; b < c->B; b++)
    for (int h = 0; h < c->H; h++) {
      emu_block(e, q, kv, b, h, S, P, A, lse);
      for (int i = 0; i < Tq; i++) {
        const float *gi = dout + ((size_t)b * Tq + i) * C + h * dk;
        const float *oi = out + ((size_t)b * Tq + i) * C + h * dk;
        float D = 0.0f;
        for (int d = 0; d < dk; d++) D += gi[d] * oi[d];
        drow[((size_t)b * c->H + h) * Tq + i] = D;
        for (int j = 0; j < Tk; j++) {
          const float *vj = kv + ((size_t)b * Tk + j) * ldkv + e->L.voff + h * dk;
          float dA = 0.0f;
          for (int d = 0; d < dk; d++) dA += gi[d] * vj[d];
          const uint64_t el = (((uint64_t)b * c->H + h) * Tq + i) * Tk + j;
          const float dP = c->p == 0.0f                                      ? dA
                           : nmt_rng_uniform(e->seed, e->stream, el) >= c->p ? dA * r
                                                                             : 0.0f;
          dS[(size_t)i * Tk + j] = rnd_site(e, P[(size_t)i * Tk + j] * (dP - D));
        }
      }
      for (int i = 0; i < Tq; i++)
        for (int d = 0; d < dk; d++) {
          float acc = 0.0f;
          for (int j = 0; j < Tk; j++)
            acc += dS[(size_t)i * Tk + j] * kv[((size_t)b * Tk + j) * ldkv + e->L.koff + h * dk + d];
          dQ[((size_t)b * Tq + i) * C + h * dk + d] = scale * acc;
        }
      for (int j = 0; j < Tk; j++)
        for (int d = 0; d < dk; d++) {
          float ak = 0.0f, av = 0.0f;
          for (int i = 0; i < Tq; i++) {
            ak += dS[(size_t)i * Tk + j] *
                  q[((size_t)b * Tq + i) * e->L.ldq + e->L.qoff + h * dk + d];
            av += A[(size_t)i * Tk + j] * dout[((size_t)b * Tq + i) * C + h * dk + d];
          }
          dK[((size_t)b * Tk + j) * C + h * dk + d] = scale * ak;
          dV[((size_t)b * Tk + j) * C + h * dk + d] = av;
        }
    }
  free(S), free(P), free(A), free(dS), free(lse);
}

/* ---- comparisons ---- */

static char what_buf[256];
static const char *what_of(const fcase *c, const char *name, const char *mode) {
  snprintf(what_buf, sizeof what_buf,
           "%s [%s B=%d Tq=%d Tk=%d H=%d dk=%d causal=%d layout=%d pad=%d p=%g]", name, mode,
           c->B, c->Tq, c->Tk, c->H, c->dk, c->causal, c->layout, c->pad, (double)c->p);
  return what_buf;
}

static int same_bits(const char *what, const void *a, const void *b, size_t n, size_t es) {
  const unsigned char *x = a, *y = b;
  for (size_t i = 0; i < n; i++)
    if (memcmp(x + i * es, y + i * es, es)) {
      double va, vb;
      if (es == 4) {
        float fa, fb;
        memcpy(&fa, x + i * es, 4), memcpy(&fb, y + i * es, 4);
        va = fa, vb = fb;
      } else {
        uint16_t ha, hb;
        memcpy(&ha, x + i * es, 2), memcpy(&hb, y + i * es, 2);
        va = ha, vb = hb; /* the bit patterns */
      }
      nmt_test_fail(__FILE__, __LINE__, "%s: not bitwise equal at %zu of %zu: %.9g vs %.9g", what,
                    i, n, va, vb);
      return 0;
    }
  return 1;
}

/* |a-b| <= tol * (max|b| + 1e-30) + tol*|b|: relative to the array's largest magnitude. */
static int close_scaled(const char *what, const float *a, const float *b, size_t n, double tol) {
  double mx = 0;
  for (size_t i = 0; i < n; i++) mx = fabs(b[i]) > mx ? fabs(b[i]) : mx;
  return nmt_test_close(__FILE__, __LINE__, what, a, b, n, tol * mx + 1e-30, tol);
}

/* The C head columns at off of rows ld (n rows), as compact (n, C) floats (es 4: float,
 * es 2: half decoded with bf16). */
static void gather(float *dst, const void *buf, size_t es, int bf16, int ld, int off, size_t n,
                   int C) {
  for (size_t r = 0; r < n; r++) {
    if (es == 4)
      memcpy(dst + r * C, (const float *)buf + r * ld + off, (size_t)C * 4);
    else
      nmt_half_decode_array(bf16, dst + r * C, (const uint16_t *)buf + r * ld + off, (size_t)C);
  }
}

/* Every column of buf's n rows of ld outside [o1, o1+C) and [o2, o2+C) (o2 < 0: none) equals
 * init's, bitwise. */
static int untouched(const char *what, const void *buf, const void *init, size_t es, int ld,
                     size_t n, int o1, int o2, int C) {
  for (size_t r = 0; r < n; r++)
    for (int col = 0; col < ld; col++) {
      if ((col >= o1 && col < o1 + C) || (o2 >= 0 && col >= o2 && col < o2 + C)) continue;
      const size_t e = (r * ld + col) * es;
      if (memcmp((const char *)buf + e, (const char *)init + e, es)) {
        nmt_test_fail(__FILE__, __LINE__, "%s: column %d of row %zu (outside the heads) changed",
                      what, col, r);
        return 0;
      }
    }
  return 1;
}

static nmt_attn_args args_of(const fcase *c, const lay *L, const void *q, const void *kv,
                             size_t es, const int32_t *lens, int half) {
  const char *qc = q, *kc = kv;
  return (nmt_attn_args){.q = qc + (size_t)L->qoff * es,
                         .k = kc + (size_t)L->koff * es,
                         .v = kc + (size_t)L->voff * es,
                         .ldq = L->ldq,
                         .ldkv = L->ldkv,
                         .k_lens = lens,
                         .B = c->B,
                         .Tq = c->Tq,
                         .Tk = c->Tk,
                         .H = c->H,
                         .dk = c->dk,
                         .causal = c->causal,
                         .p_drop = c->p,
                         .seed = 1234,
                         .stream = nmt_rng_stream(3, 17),
                         .half = half};
}

/* ---- fp32 (half = 0) ---- */

/* One fp32 case on ctx (NULL, or any mode: half = 0 ignores it): fused vs unfused within
 * tolerance, fused vs the emulation bitwise (forward, lse, drow, and the gradients accumulated
 * into nonzero buffers), the columns outside the heads untouched. */
static void fp32_case(const fcase *c, void *ctx) {
  const lay L = layout_of(c);
  const int B = c->B, Tq = c->Tq, Tk = c->Tk, H = c->H, C = L.C;
  const size_t nq = (size_t)B * Tq * L.ldq, nkv = (size_t)B * Tk * L.ldkv, no = (size_t)B * Tq * C;
  const size_t nkc = (size_t)B * Tk * C, np = (size_t)B * H * Tq * Tk, nr = (size_t)B * H * Tq;
  arena ar = {0};
  int32_t *lens = get(&ar, B * sizeof *lens);
  float *q = get(&ar, nq * 4), *kv = get(&ar, nkv * 4), *dout = get(&ar, no * 4);
  float *out_u = get(&ar, no * 4), *out_f = get(&ar, no * 4), *e_out = get(&ar, no * 4);
  float *probs = get(&ar, np * 4), *dprobs = get(&ar, np * 4);
  float *lse = get(&ar, nr * 4), *e_lse = get(&ar, nr * 4), *drow = get(&ar, nr * 4);
  float *e_drow = get(&ar, nr * 4), *dq0 = get(&ar, nq * 4), *dkv0 = get(&ar, nkv * 4);
  float *dqz_u = get(&ar, nq * 4), *dkvz_u = get(&ar, nkv * 4), *dqz_f = get(&ar, nq * 4);
  float *dkvz_f = get(&ar, nkv * 4), *eq = get(&ar, no * 4), *ek = get(&ar, nkc * 4);
  float *ev = get(&ar, nkc * 4), *g1 = get(&ar, (no > nkc ? no : nkc) * 4);
  float *g2 = get(&ar, (no > nkc ? no : nkc) * 4);
  if (!g2) {
    nmt_test_fail(__FILE__, __LINE__, "out of memory");
    goto out;
  }
  make_lens(c, lens);
  fill(q, nq, 1.0f, 1), fill(kv, nkv, 1.0f, 2), fill(dout, no, 1.0f, 3);
  fill(dq0, nq, 0.5f, 4), fill(dkv0, nkv, 0.5f, 5);
  float *dq = dup_f(&ar, dq0, nq), *dkv = dup_f(&ar, dkv0, nkv);
  if (!dq || !dkv) goto out;
  const nmt_attn_args a = args_of(c, &L, q, kv, 4, lens, 0);
  const emu e = {c, L, lens, 0, 0, a.seed, a.stream};
  /* forward */
  if (nmt_ref_attention_fwd(NULL, out_u, probs, a.q, L.ldq, a.k, a.v, L.ldkv, lens, B, Tq, Tk, H,
                            c->dk, c->causal, c->p, a.seed, a.stream) != NMT_OK ||
      nmt_backend_ref.attention_fused_fwd(ctx, out_f, lse, &a) != NMT_OK)
    goto fail;
  emu_fwd(&e, q, kv, e_out, e_lse);
  if (!close_scaled(what_of(c, "out vs unfused", "fp32"), out_f, out_u, no, 2e-6) ||
      !same_bits(what_of(c, "out vs emulation", "fp32"), out_f, e_out, no, 4) ||
      !same_bits(what_of(c, "lse vs emulation", "fp32"), lse, e_lse, nr, 4))
    goto out;
  /* lse = log sum_j exp(s_j), the scores in double */
  for (int b = 0; b < B; b++)
    for (int h = 0; h < H; h++)
      for (int i = 0; i < Tq; i++) {
        const int lim = c->causal && i + 1 < lens[b] ? i + 1 : lens[b];
        double sum = 0;
        for (int j = 0; j < lim; j++) {
          double s = 0;
          for (int d = 0; d < c->dk; d++)
            s += (double)q[((size_t)b * Tq + i) * L.ldq + L.qoff + h * c->dk + d] *
                 kv[((size_t)b * Tk + j) * L.ldkv + L.koff + h * c->dk + d];
          sum += exp(s / sqrt((double)c->dk));
        }
        g1[0] = lse[((size_t)b * H + h) * Tq + i], g2[0] = (float)log(sum);
        if (!nmt_test_close(__FILE__, __LINE__, what_of(c, "lse vs log-sum-exp", "fp32"), g1, g2,
                            1, 1e-5, 1e-5))
          goto out;
      }
  /* backward: into zeros vs unfused; into dq0/dkv0 vs dq0 + emulation, bitwise */
  float *gz_u[3] = {dqz_u + L.qoff, dkvz_u + L.koff, dkvz_u + L.voff};
  float *gz_f[3] = {dqz_f + L.qoff, dkvz_f + L.koff, dkvz_f + L.voff};
  if (nmt_ref_attention_bwd(NULL, gz_u[0], gz_u[1], gz_u[2], dprobs, dout, probs, a.q, L.ldq, a.k,
                            a.v, L.ldkv, lens, B, Tq, Tk, H, c->dk, c->causal, c->p, a.seed,
                            a.stream) != NMT_OK ||
      nmt_backend_ref.attention_fused_bwd(ctx, gz_f[0], gz_f[1], gz_f[2], drow, dout, out_f, lse,
                                          &a) != NMT_OK ||
      nmt_ref_attention_fused_bwd(ctx, dq + L.qoff, dkv + L.koff, dkv + L.voff, drow, dout, out_f,
                                  lse, &a) != NMT_OK)
    goto fail;
  emu_bwd(&e, q, kv, dout, out_f, e_drow, eq, ek, ev);
  if (!same_bits(what_of(c, "drow vs emulation", "fp32"), drow, e_drow, nr, 4)) goto out;
  const struct {
    const char *name;
    const float *z_u, *z_f, *acc, *init, *emu;
    int ld, off;
    size_t rows;
  } g[3] = {{"dq", dqz_u, dqz_f, dq, dq0, eq, L.ldq, L.qoff, (size_t)B * Tq},
            {"dkey", dkvz_u, dkvz_f, dkv, dkv0, ek, L.ldkv, L.koff, (size_t)B * Tk},
            {"dv", dkvz_u, dkvz_f, dkv, dkv0, ev, L.ldkv, L.voff, (size_t)B * Tk}};
  for (int t = 0; t < 3; t++) {
    const size_t n = g[t].rows * C;
    char name[64];
    gather(g1, g[t].z_f, 4, 0, g[t].ld, g[t].off, g[t].rows, C);
    gather(g2, g[t].z_u, 4, 0, g[t].ld, g[t].off, g[t].rows, C);
    snprintf(name, sizeof name, "%s vs unfused", g[t].name);
    if (!close_scaled(what_of(c, name, "fp32"), g1, g2, n, 1e-5)) goto out;
    gather(g1, g[t].acc, 4, 0, g[t].ld, g[t].off, g[t].rows, C);
    gather(g2, g[t].init, 4, 0, g[t].ld, g[t].off, g[t].rows, C);
    for (size_t x = 0; x < n; x++) g2[x] += g[t].emu[x];
    snprintf(name, sizeof name, "%s accumulated vs emulation", g[t].name);
    if (!same_bits(what_of(c, name, "fp32"), g1, g2, n, 4)) goto out;
  }
  if (!untouched(what_of(c, "dq", "fp32"), dq, dq0, 4, L.ldq, (size_t)B * Tq, L.qoff, -1, C) ||
      !untouched(what_of(c, "dkv", "fp32"), dkv, dkv0, 4, L.ldkv, (size_t)B * Tk, L.koff, L.voff,
                 C))
    goto out;
  goto out;
fail:
  nmt_test_fail(__FILE__, __LINE__, "%s: %s", what_of(c, "op failed", "fp32"), nmt_last_error());
out:
  arena_free(&ar);
}

/* B, Tq, Tk, H, dk, causal, layout, pad, p */
static const fcase FP32_CASES[] = {
    /* decoder self-attention over the T ladder (tile edges of the CUDA kernels: 32, 64, 128) */
    {2, 1, 1, 2, 32, 1, SELF, 0, 0.0f},
    {2, 31, 31, 2, 32, 1, SELF, 1, 0.0f},
    {2, 40, 40, 2, 32, 1, SELF, 0, 0.0f},
    {2, 64, 64, 2, 32, 1, SELF, 1, 0.0f},
    {2, 65, 65, 2, 32, 1, SELF, 0, 0.0f},
    {1, 128, 128, 2, 32, 1, SELF, 0, 0.0f},
    {1, 255, 255, 1, 32, 1, SELF, 0, 0.0f},
    {2, 256, 256, 1, 32, 1, SELF, 1, 0.0f},
    /* encoder self-attention with padding */
    {3, 31, 31, 1, 64, 0, SELF, 1, 0.0f},
    {3, 65, 65, 1, 64, 0, SELF, 1, 0.0f},
    {2, 256, 256, 1, 64, 0, SELF, 1, 0.0f},
    /* cross-attention, strided, Tq != Tk */
    {3, 7, 19, 4, 8, 0, CROSS, 1, 0.0f},
    {2, 40, 1, 2, 8, 0, CROSS, 0, 0.0f},
    {4, 1, 65, 2, 32, 0, CROSS_PAD, 1, 0.0f},
    {1, 64, 128, 1, 128, 0, CROSS_PAD, 1, 0.0f},
    {2, 128, 40, 1, 64, 0, CROSS, 1, 0.0f},
    /* dk ladder */
    {2, 40, 40, 2, 8, 1, SELF, 1, 0.0f},
    {2, 40, 40, 2, 64, 1, SELF, 1, 0.0f},
    {2, 40, 40, 2, 128, 1, SELF, 1, 0.0f},
    {1, 33, 33, 3, 5, 0, CROSS_PAD, 1, 0.0f}, /* odd dk: the reference serves any */
    /* many (sentence, head) blocks */
    {250, 5, 5, 4, 8, 0, SELF, 1, 0.0f},
    {1000, 3, 6, 1, 8, 0, CROSS, 1, 0.0f},
    {256, 4, 4, 4, 8, 1, SELF, 0, 0.0f},
};

NMT_TEST(attention_fused_fp32_vs_unfused_and_emulation) {
  for (size_t i = 0; i < sizeof FP32_CASES / sizeof *FP32_CASES && !nmt_test_failed(); i++)
    fp32_case(&FP32_CASES[i], NULL);
}

/* half = 0 is fp32 on any context: a fp32 one and a bf16 one give the NULL context's bits. */
NMT_TEST(attention_fused_fp32_any_ctx) {
  void *c32 = NULL, *cbf = NULL;
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &c32));
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &cbf));
  NMT_ASSERT_OK(nmt_ref_set_precision(cbf, NMT_PRECISION_BF16));
  const fcase cs[2] = {{2, 31, 31, 2, 32, 1, SELF, 1, 0.1f}, {3, 7, 19, 4, 8, 0, CROSS, 1, 0.0f}};
  for (int i = 0; i < 2 && !nmt_test_failed(); i++) {
    fp32_case(&cs[i], c32);
    if (!nmt_test_failed()) fp32_case(&cs[i], cbf);
  }
  nmt_ref_ctx_destroy(c32);
  nmt_ref_ctx_destroy(cbf);
}

static const fcase DROP_CASES[] = {
    {2, 64, 64, 2, 32, 1, SELF, 1, 0.1f},
    {3, 31, 40, 2, 32, 0, CROSS, 1, 0.1f},
    {250, 5, 5, 4, 8, 0, SELF, 1, 0.1f},
    {1, 255, 255, 1, 64, 1, SELF, 0, 0.1f},
};

/* Dropout p = 0.1: the fused out equals the unfused op's within 2e-6, which a different mask
 * would miss by far (the emulation draws nmt_rng_uniform per element; bitwise). The check can
 * fail: another stream's mask does not meet the tolerance. */
NMT_TEST(attention_fused_dropout_mask) {
  for (size_t i = 0; i < sizeof DROP_CASES / sizeof *DROP_CASES && !nmt_test_failed(); i++)
    fp32_case(&DROP_CASES[i], NULL);
  if (nmt_test_failed()) return;
  const fcase *c = &DROP_CASES[0];
  const lay L = layout_of(c);
  const size_t nq = (size_t)c->B * c->Tq * L.ldq, no = (size_t)c->B * c->Tq * L.C;
  float *q = malloc(nq * 4), *o1 = malloc(no * 4), *o2 = malloc(no * 4);
  float *lse = malloc((size_t)c->B * c->H * c->Tq * 4);
  int32_t lens[2];
  NMT_ASSERT(q && o1 && o2 && lse);
  make_lens(c, lens);
  fill(q, nq, 1.0f, 1);
  nmt_attn_args a = args_of(c, &L, q, q, 4, lens, 0);
  NMT_ASSERT_OK(nmt_ref_attention_fused_fwd(NULL, o1, lse, &a));
  a.stream++;
  NMT_ASSERT_OK(nmt_ref_attention_fused_fwd(NULL, o2, lse, &a));
  double mx = 0;
  for (size_t x = 0; x < no; x++) mx = fmax(mx, fabs((double)o1[x] - o2[x]));
  free(q), free(o1), free(o2), free(lse);
  if (!(mx > 1e-2))
    nmt_test_fail(__FILE__, __LINE__, "another dropout stream moved out by only %g", mx);
}

/* ---- half storage (half = 1, a context in fp16 or bf16 mode) ---- */

static void *half_ctx(nmt_precision mode) {
  void *ctx = NULL;
  if (nmt_ref_ctx_create(0, &ctx) != NMT_OK || nmt_ref_set_precision(ctx, mode) != NMT_OK) {
    nmt_ref_ctx_destroy(ctx);
    return NULL;
  }
  return ctx;
}

/* n random halves into h and their values into v. */
static void fill_half(int bf16, uint16_t *h, float *v, size_t n, uint64_t stream) {
  fill(v, n, 1.0f, stream);
  nmt_half_encode_array(bf16, h, v, n);
  nmt_half_decode_array(bf16, v, h, n);
}

/* One half case: fused vs the emulation bitwise (out, lse, drow, and the written gradients'
 * head columns; the other columns keep their poison), and vs attention_half_fwd/bwd within
 * TOL half unit roundoffs of the array's largest magnitude. The unfused op keeps A and dS in
 * fp32 and rounds only its stores, so the two differ by the rounding of each A_ij (and each
 * dS_ij), at most one unit roundoff of each term of the sums, plus the stores' rounding; the
 * terms' sum of magnitudes is a small multiple of the array's largest value on these inputs. */
enum { TOL_FWD_U = 4, TOL_BWD_U = 8 }; /* measured worst: within 2 on these cases */
static void half_case(nmt_precision mode, const fcase *c) {
  const int bf16 = mode == NMT_PRECISION_BF16;
  const char *mn = bf16 ? "bf16" : "fp16";
  const double u = bf16 ? 0x1p-8 : 0x1p-11;
  const lay L = layout_of(c);
  const int B = c->B, Tq = c->Tq, Tk = c->Tk, H = c->H, C = L.C;
  const size_t nq = (size_t)B * Tq * L.ldq, nkv = (size_t)B * Tk * L.ldkv, no = (size_t)B * Tq * C;
  const size_t nkc = (size_t)B * Tk * C, np = (size_t)B * H * Tq * Tk, nr = (size_t)B * H * Tq;
  const size_t ng = no > nkc ? no : nkc;
  arena ar = {0};
  void *ctx = half_ctx(mode);
  int32_t *lens = get(&ar, B * sizeof *lens);
  uint16_t *qh = get(&ar, nq * 2), *kvh = get(&ar, nkv * 2), *douth = get(&ar, no * 2);
  uint16_t *outh = get(&ar, no * 2), *outh_u = get(&ar, no * 2), *want = get(&ar, ng * 2);
  uint16_t *dqh = get(&ar, nq * 2), *dkvh = get(&ar, nkv * 2), *dqh_u = get(&ar, nq * 2);
  uint16_t *dkvh_u = get(&ar, nkv * 2), *poison_q = get(&ar, nq * 2), *poison_kv = get(&ar, nkv * 2);
  float *q = get(&ar, nq * 4), *kv = get(&ar, nkv * 4), *dout = get(&ar, no * 4);
  float *probs = get(&ar, np * 4), *dprobs = get(&ar, np * 4), *lse = get(&ar, nr * 4);
  float *e_lse = get(&ar, nr * 4), *drow = get(&ar, nr * 4), *e_drow = get(&ar, nr * 4);
  float *e_out = get(&ar, no * 4), *of = get(&ar, no * 4), *ou = get(&ar, no * 4);
  float *eq = get(&ar, no * 4), *ek = get(&ar, nkc * 4), *ev = get(&ar, nkc * 4);
  float *g1 = get(&ar, ng * 4), *g2 = get(&ar, ng * 4);
  if (!ctx || !g2) {
    nmt_test_fail(__FILE__, __LINE__, "out of memory or no %s context", mn);
    goto out;
  }
  make_lens(c, lens);
  fill_half(bf16, qh, q, nq, 1), fill_half(bf16, kvh, kv, nkv, 2);
  fill_half(bf16, douth, dout, no, 3);
  for (size_t x = 0; x < nq; x++) poison_q[x] = 0x5a5a;
  for (size_t x = 0; x < nkv; x++) poison_kv[x] = 0x5a5a;
  memcpy(dqh, poison_q, nq * 2), memcpy(dkvh, poison_kv, nkv * 2);
  memcpy(dqh_u, poison_q, nq * 2), memcpy(dkvh_u, poison_kv, nkv * 2);
  const nmt_attn_args a = args_of(c, &L, qh, kvh, 2, lens, 1);
  const emu e = {c, L, lens, 1, bf16, a.seed, a.stream};
  if (nmt_backend_ref.attention_fused_fwd(ctx, outh, lse, &a) != NMT_OK ||
      nmt_ref_attention_half_fwd(ctx, outh_u, probs, a.q, L.ldq, a.k, a.v, L.ldkv, lens, B, Tq, Tk,
                                 H, c->dk, c->causal, c->p, a.seed, a.stream) != NMT_OK)
    goto fail;
  emu_fwd(&e, q, kv, e_out, e_lse);
  nmt_half_encode_array(bf16, want, e_out, no);
  nmt_half_decode_array(bf16, of, outh, no), nmt_half_decode_array(bf16, ou, outh_u, no);
  if (!same_bits(what_of(c, "out vs emulation", mn), outh, want, no, 2) ||
      !same_bits(what_of(c, "lse vs emulation", mn), lse, e_lse, nr, 4) ||
      !close_scaled(what_of(c, "out vs attention_half_fwd", mn), of, ou, no, TOL_FWD_U * u))
    goto out;
  const void *gk = (uint16_t *)dkvh + L.koff, *gv = (uint16_t *)dkvh + L.voff;
  if (nmt_backend_ref.attention_fused_bwd(ctx, dqh + L.qoff, (void *)gk, (void *)gv, drow, douth,
                                          outh, lse, &a) != NMT_OK ||
      nmt_ref_attention_half_bwd(ctx, dqh_u + L.qoff, dkvh_u + L.koff, dkvh_u + L.voff, dprobs,
                                 douth, probs, a.q, L.ldq, a.k, a.v, L.ldkv, lens, B, Tq, Tk, H,
                                 c->dk, c->causal, c->p, a.seed, a.stream) != NMT_OK)
    goto fail;
  emu_bwd(&e, q, kv, dout, of, e_drow, eq, ek, ev);
  if (!same_bits(what_of(c, "drow vs emulation", mn), drow, e_drow, nr, 4)) goto out;
  const struct {
    const char *name;
    const uint16_t *f, *u;
    const float *emu;
    int ld, off;
    size_t rows;
  } g[3] = {{"dq", dqh, dqh_u, eq, L.ldq, L.qoff, (size_t)B * Tq},
            {"dkey", dkvh, dkvh_u, ek, L.ldkv, L.koff, (size_t)B * Tk},
            {"dv", dkvh, dkvh_u, ev, L.ldkv, L.voff, (size_t)B * Tk}};
  for (int t = 0; t < 3; t++) {
    const size_t rows = g[t].rows;
    char name[64];
    uint16_t *wrote = (uint16_t *)g1; /* rows x C halves fit in the float buffer */
    for (size_t r = 0; r < rows; r++)
      memcpy(wrote + r * C, g[t].f + r * g[t].ld + g[t].off, (size_t)C * 2);
    nmt_half_encode_array(bf16, want, g[t].emu, rows * C);
    snprintf(name, sizeof name, "%s vs emulation", g[t].name);
    if (!same_bits(what_of(c, name, mn), wrote, want, rows * C, 2)) goto out;
    gather(g1, g[t].f, 2, bf16, g[t].ld, g[t].off, rows, C);
    gather(g2, g[t].u, 2, bf16, g[t].ld, g[t].off, rows, C);
    snprintf(name, sizeof name, "%s vs attention_half_bwd", g[t].name);
    if (!close_scaled(what_of(c, name, mn), g1, g2, rows * C, TOL_BWD_U * u)) goto out;
  }
  if (!untouched(what_of(c, "dq", mn), dqh, poison_q, 2, L.ldq, (size_t)B * Tq, L.qoff, -1, C) ||
      !untouched(what_of(c, "dkv", mn), dkvh, poison_kv, 2, L.ldkv, (size_t)B * Tk, L.koff, L.voff,
                 C))
    goto out;
  goto out;
fail:
  nmt_test_fail(__FILE__, __LINE__, "%s: %s", what_of(c, "op failed", mn), nmt_last_error());
out:
  nmt_ref_ctx_destroy(ctx);
  arena_free(&ar);
}

static const fcase HALF_CASES[] = {
    {2, 31, 31, 2, 32, 1, SELF, 1, 0.0f},
    {3, 7, 19, 4, 8, 0, CROSS, 1, 0.1f},
    {2, 65, 65, 1, 64, 0, SELF, 1, 0.1f},
    {1, 40, 128, 1, 128, 0, CROSS_PAD, 1, 0.0f},
    {1, 256, 256, 1, 32, 1, SELF, 0, 0.0f},
    {250, 5, 5, 4, 8, 0, SELF, 1, 0.0f},
    {2, 1, 1, 2, 32, 1, SELF, 0, 0.0f},
};

NMT_TEST(attention_fused_half_bf16) {
  for (size_t i = 0; i < sizeof HALF_CASES / sizeof *HALF_CASES && !nmt_test_failed(); i++)
    half_case(NMT_PRECISION_BF16, &HALF_CASES[i]);
}
NMT_TEST(attention_fused_half_fp16) {
  for (size_t i = 0; i < sizeof HALF_CASES / sizeof *HALF_CASES && !nmt_test_failed(); i++)
    half_case(NMT_PRECISION_FP16, &HALF_CASES[i]);
}

/* ---- determinism, NULL gradients, errors ---- */

/* Two runs are bitwise equal; each gradient alone (the others NULL) gives the bits it gets
 * with all three; no gradient at all still writes drow. */
NMT_TEST(attention_fused_deterministic_and_null_grads) {
  const fcase c = {3, 31, 40, 2, 32, 0, CROSS_PAD, 1, 0.1f};
  const lay L = layout_of(&c);
  const size_t nq = (size_t)c.B * c.Tq * L.ldq, nkv = (size_t)c.B * c.Tk * L.ldkv;
  const size_t no = (size_t)c.B * c.Tq * L.C, nr = (size_t)c.B * c.H * c.Tq;
  arena ar = {0};
  int32_t lens[3];
  float *q = get(&ar, nq * 4), *kv = get(&ar, nkv * 4), *dout = get(&ar, no * 4);
  float *o[2] = {get(&ar, no * 4), get(&ar, no * 4)}, *lse[2] = {get(&ar, nr * 4), get(&ar, nr * 4)};
  float *drow[2] = {get(&ar, nr * 4), get(&ar, nr * 4)};
  float *dq[2] = {get(&ar, nq * 4), get(&ar, nq * 4)}, *dkv[2] = {get(&ar, nkv * 4), get(&ar, nkv * 4)};
  float *one = get(&ar, (nq > nkv ? nq : nkv) * 4);
  if (!one) {
    arena_free(&ar);
    NMT_ASSERT(!"out of memory");
  }
  make_lens(&c, lens);
  fill(q, nq, 1.0f, 1), fill(kv, nkv, 1.0f, 2), fill(dout, no, 1.0f, 3);
  const nmt_attn_args a = args_of(&c, &L, q, kv, 4, lens, 0);
  for (int r = 0; r < 2; r++) {
    fill(dq[r], nq, 0.5f, 4), fill(dkv[r], nkv, 0.5f, 5);
    if (nmt_ref_attention_fused_fwd(NULL, o[r], lse[r], &a) != NMT_OK ||
        nmt_ref_attention_fused_bwd(NULL, dq[r] + L.qoff, dkv[r] + L.koff, dkv[r] + L.voff,
                                    drow[r], dout, o[r], lse[r], &a) != NMT_OK) {
      nmt_test_fail(__FILE__, __LINE__, "run %d: %s", r, nmt_last_error());
      goto out;
    }
  }
  if (!same_bits("out, run 2 vs 1", o[1], o[0], no, 4) ||
      !same_bits("lse, run 2 vs 1", lse[1], lse[0], nr, 4) ||
      !same_bits("drow, run 2 vs 1", drow[1], drow[0], nr, 4) ||
      !same_bits("dq, run 2 vs 1", dq[1], dq[0], nq, 4) ||
      !same_bits("dkv, run 2 vs 1", dkv[1], dkv[0], nkv, 4))
    goto out;
  for (int t = 0; t < 4 && !nmt_test_failed(); t++) {
    const size_t n = t == 0 ? nq : nkv;
    fill(one, n, 0.5f, t == 0 ? 4 : 5);
    float *base = one, *g[3] = {NULL, NULL, NULL};
    if (t < 3) g[t] = base + (t == 0 ? L.qoff : t == 1 ? L.koff : L.voff);
    memset(drow[1], 0, nr * 4);
    if (nmt_ref_attention_fused_bwd(NULL, g[0], g[1], g[2], drow[1], dout, o[0], lse[0], &a) !=
        NMT_OK) {
      nmt_test_fail(__FILE__, __LINE__, "gradient %d alone: %s", t, nmt_last_error());
      break;
    }
    if (!same_bits("drow with NULL gradients", drow[1], drow[0], nr, 4)) break;
    if (t == 3) break;
    const float *ref = t == 0 ? dq[0] : dkv[0];
    const int ld = t == 0 ? L.ldq : L.ldkv, off = t == 0 ? L.qoff : t == 1 ? L.koff : L.voff;
    for (size_t r = 0; r < (size_t)c.B * (t == 0 ? c.Tq : c.Tk); r++)
      if (!same_bits("one gradient alone vs all three", one + r * ld + off, ref + r * ld + off,
                     (size_t)L.C, 4))
        goto out;
  }
out:
  arena_free(&ar);
}

/* The named errors: NMT_ERR_INTERNAL, the message naming the op and the bad value. */
static int bad(const char *what, nmt_status st, const char *want1, const char *want2) {
  const char *m = nmt_last_error();
  if (st == NMT_ERR_INTERNAL && strstr(m, want1) && strstr(m, want2)) return 1;
  nmt_test_fail(__FILE__, __LINE__, "%s: %s \"%s\", want NMT_ERR_INTERNAL naming %s and %s", what,
                nmt_status_str(st), m, want1, want2);
  return 0;
}

NMT_TEST(attention_fused_errors) {
  float x[64] = {0}, lse[8], drow[8];
  int32_t lens[2] = {2, 2};
  void *c32 = NULL;
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &c32));
  const nmt_attn_args ok = {.q = x, .k = x, .v = x, .ldq = 4, .ldkv = 4, .k_lens = lens, .B = 2,
                            .Tq = 2, .Tk = 2, .H = 1, .dk = 4};
  NMT_ASSERT_OK(nmt_ref_attention_fused_fwd(NULL, x + 32, lse, &ok));
  nmt_attn_args a = ok;
  lens[1] = 0;
  if (!bad("k_lens 0", nmt_ref_attention_fused_fwd(NULL, x + 32, lse, &a), "attention_fused_fwd",
           "k_lens[1] = 0"))
    goto out;
  if (!bad("k_lens 0 (bwd)",
           nmt_ref_attention_fused_bwd(NULL, x, x, x, drow, x, x, lse, &a), "attention_fused_bwd",
           "k_lens[1] = 0"))
    goto out;
  lens[1] = 3;
  if (!bad("k_lens > Tk", nmt_ref_attention_fused_fwd(NULL, x + 32, lse, &a),
           "attention_fused_fwd", "k_lens[1] = 3"))
    goto out;
  lens[1] = 2;
  a.Tk = 0;
  if (!bad("Tk 0", nmt_ref_attention_fused_fwd(NULL, x + 32, lse, &a), "attention_fused_fwd",
           "Tk=0"))
    goto out;
  a = ok, a.ldq = 3;
  if (!bad("ldq < H*dk", nmt_ref_attention_fused_fwd(NULL, x + 32, lse, &a),
           "attention_fused_fwd", "ldq=3"))
    goto out;
  a = ok, a.p_drop = 1.0f;
  if (!bad("p_drop 1", nmt_ref_attention_fused_fwd(NULL, x + 32, lse, &a), "attention_fused_fwd",
           "1 outside"))
    goto out;
  a = ok, a.half = 2;
  if (!bad("half 2", nmt_ref_attention_fused_fwd(NULL, x + 32, lse, &a), "attention_fused_fwd",
           "half = 2"))
    goto out;
  a = ok, a.half = 1;
  if (!bad("half with an fp32 ctx", nmt_ref_attention_fused_fwd(c32, x + 32, lse, &a),
           "attention_fused_fwd", "fp16 or bf16") ||
      !bad("half with a NULL ctx", nmt_ref_attention_fused_fwd(NULL, x + 32, lse, &a),
           "attention_fused_fwd", "fp16 or bf16") ||
      !bad("half bwd with an fp32 ctx",
           nmt_ref_attention_fused_bwd(c32, x, x, x, drow, x, x, lse, &a), "attention_fused_bwd",
           "fp16 or bf16"))
    goto out;
  a = ok;
  if (!bad("lse NULL", nmt_ref_attention_fused_fwd(NULL, x + 32, NULL, &a), "attention_fused_fwd",
           "lse"))
    goto out;
  /* Empty batches are no work, not errors. */
  a = ok, a.B = 0;
  NMT_ASSERT_OK(nmt_ref_attention_fused_fwd(NULL, NULL, NULL, &a));
  a = ok, a.Tq = 0;
  NMT_ASSERT_OK(nmt_ref_attention_fused_bwd(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, &a));
out:
  nmt_ref_ctx_destroy(c32);
}
