/* nmt/attention.h — the fused attention ops' arguments and contract (issue 35): one forward and
 * one backward op that keep only each query row's log-sum-exp instead of the (B,H,Tq,Tk)
 * probabilities, with the softmax exact in two passes (FlashAttention-2, Dao 2023, Algorithms 1
 * and 2, without online rescaling: a translation sentence's keys fit on chip). Entries
 * attention_fused_fwd / attention_fused_bwd of nmt_backend (nmt/backend.h); src/ref/
 * attention_fused.c and cuda/attention_fused.cu implement them; the unfused attention_fwd /
 * attention_bwd (and their half twins) stay the authority they are checked against, and the
 * default (kernels.attention = unfused) until a GPU run shows the fused path at parity and
 * faster (docs/cuda.md "Fused attention").
 *
 * The math, at these rounding sites on every backend (each sum's order is the backend's; the
 * CPU reference's is index order). Layouts as attention_fwd's: head h of query row (b,i) is
 * q[(b*Tq + i)*ldq + h*dk + 0..dk), keys and values likewise with ldkv (column slices of the
 * fused QKV (ldq = ldkv = 3C) or KV (2C) projection outputs), out and dout (B*Tq, C = H*dk).
 * half = 1: q, k, v, out, dout, dq, dkey, dv are nmt_act in the context's half type (fp16/bf16
 * mode); half = 0: float. lse (B,H,Tq) and every intermediate are fp32. x^ is the fp32 value of
 * x (exact for half), round() the context's half rounding (to nearest even), applied only where
 * half = 1 (the identity for half = 0). scale = (float)(1/sqrt(dk)). Key j of row (b,i) is
 * visible iff j < k_lens[b] and, with causal, j <= i; k_lens[b] in [1, Tk]. Element index
 * e = ((b*H + h)*Tq + i)*Tk + j; keep(e) = nmt_rng_uniform(seed, stream, e) >= p_drop (the
 * unfused op's mask, bitwise); r = 1.0f / (1.0f - p_drop).
 *   forward, per (b, h, i):
 *     s_j  = scale * sum_d q^_id k^_jd                     (fp32; visible j only)
 *     m    = max_j s_j;  l = sum_j expf(s_j - m);  lse = m + logf(l)  (lse[(b*H+h)*Tq+i])
 *     P_j  = expf(s_j - lse)  (visible j; 0 otherwise)
 *     a_j  = keep(e) ? P_j * r : 0  (p_drop = 0: a_j = P_j);  A_j = round(a_j)
 *     O_d  = sum_j A_j v^_jd;  out = round(O)              (WRITTEN, its rows and head columns)
 *   backward (s, P, a, A recomputed from q, k and lse exactly as above):
 *     D    = sum_d dout^_id out^_id                        (fp32; out as stored; in drow)
 *     dA_j = sum_d dout^_id v^_jd;  dP_j = keep(e) ? dA_j * r : 0
 *     dS_j = round(P_j * (dP_j - D))
 *     dQ_id = scale * sum_j dS_j k^_jd;  dK_jd = scale * sum_i dS_ij q^_id;  dV_jd = sum_i A_ij dout^_id
 *     half = 0: dq, dkey, dv += dQ, dK, dV (ACCUMULATED, as attention_bwd);
 *     half = 1: dq, dkey, dv = round(dQ), round(dK), round(dV) (WRITTEN, as attention_half_bwd),
 *     over their rows and head columns only. Each may be NULL. B = 0 or Tq = 0: nothing is
 *     read or written (nor are dkey, dv rounded zeros then).
 * D = rowsum(dout * out) equals sum_j a_j dA_j when out is unrounded (FlashAttention-2 §3.2).
 * Non-finite inputs: a key hidden by the causal mask but inside a backend's key tile may meet
 * its zero weight in a product (cuda's tensor-core kernels: 16-key tiles), so an inf or NaN in
 * such a k or v row may reach the rows before it; keys at or past k_lens[b] never do.
 * Determinism: two runs of an op on the same device are bitwise equal (no float atomics: each
 * gradient element has one owner). The CUDA kernels serve dk in {32, 64, 128}; the reference
 * any dk.
 *
 * defines: nmt_attn_args, nmt_attn_supported_dk
 */
#ifndef NMT_ATTENTION_H
#define NMT_ATTENTION_H

#include <stdint.h>

/* The shapes and inputs both fused ops read. q, k, v: device memory, nmt_act when half = 1,
 * float when half = 0 (as described above). */
typedef struct {
  const void *q, *k, *v;
  int ldq, ldkv;           /* row strides of q and of k/v, in elements */
  const int32_t *k_lens;   /* (B) device memory: keys per batch row, in [1, Tk] */
  int B, Tq, Tk, H, dk;
  int causal;              /* 1: key j visible to query i only for j <= i */
  float p_drop;            /* attention dropout in [0, 1) */
  uint64_t seed, stream;   /* the dropout mask's counter-based stream (nmt_rng_uniform) */
  int half;                /* 1: q, k, v, out, dout, dq, dkey, dv in the context's half type */
} nmt_attn_args;

/* 1 when the CUDA fused kernels serve head dimension dk (32, 64 or 128), else 0: the config
 * check of kernels.attention = fused. */
static inline int nmt_attn_supported_dk(int dk) { return dk == 32 || dk == 64 || dk == 128; }

#endif /* NMT_ATTENTION_H */
