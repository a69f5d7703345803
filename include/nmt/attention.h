/* nmt/attention.h — the fused attention ops' arguments and their exact math (issue 35).
 *
 * Multi-head scaled dot-product attention (Vaswani et al. 2017 §3.2.1 eq. 1, §3.2.2) with
 * key-padding and causal masks and dropout on the attention weights (§5.4), computed without
 * the (B, H, Tq, Tk) weights in memory: the forward keeps only each row's log-sum-exp, and the
 * backward recomputes the weights from it (FlashAttention-2, Dao 2023, Algorithms 1 and 2, with
 * the softmax exact in two passes instead of online rescaling: a translation sentence's keys
 * fit on chip). The backend entries are nmt_backend.attention_fused_fwd / _bwd (nmt/backend.h);
 * the unfused attention_fwd / _bwd (and their _half_ forms) stay the authority they are
 * checked against, and `kernels.attention` (docs/config.md) picks one or the other.
 *
 * Layouts are those of attention_fwd: head h of query row (b, i) is
 * q[(b*Tq + i)*ldq + h*dk + 0..dk), keys and values likewise with ldkv, so q, k, v may be
 * column slices of one fused QKV (ldq = ldkv = 3C) or KV (2C) projection output; out, dout
 * and the gradients of q, k, v have the same layouts (out and dout: row stride C = H*dk).
 * `half` = 1: q, k, v, out, dout, dq, dkey, dv are nmt_act (the context's half type, bf16 or
 * fp16 bits, nmt/backend.h); `half` = 0: float. lse and every intermediate are fp32.
 *
 * The math, which every backend computes at these rounding sites (the summation order of each
 * sum is the backend's; the CPU reference sums in index order). x^ is the fp32 value of x
 * (exact for half), round() the context's half rounding (round to nearest even), applied only
 * where `half` = 1 (identity for half = 0). scale = (float)(1/sqrt(dk)). Key j of row (b, i)
 * is visible iff j < k_lens[b] and, with `causal`, j <= i; k_lens[b] in [1, Tk]. Element
 * index e = ((b*H + h)*Tq + i)*Tk + j; keep(e) = nmt_rng_uniform(seed, stream, e) >= p_drop
 * (the unfused op's mask, bitwise); r = 1.0f / (1.0f - p_drop).
 *   forward, per (b, h, i):
 *     s_j   = scale * sum_d q^_id k^_jd                      (fp32; visible j only)
 *     m     = max_j s_j;   l = sum_j expf(s_j - m);   lse = m + logf(l)   (saved: lse[(b*H+h)*Tq+i])
 *     P_j   = expf(s_j - lse)        (visible j; 0 otherwise)
 *     a_j   = keep(e) ? P_j * r : 0  (p_drop = 0: a_j = P_j)
 *     A_j   = round(a_j)                                     (the P.V product's input)
 *     O_d   = sum_j A_j v^_jd;   out = round(O)              (WRITTEN, rows and head columns)
 *   backward (s, P, a, A recomputed from q, k and lse exactly as above):
 *     D     = sum_d dout^_id out^_id                         (fp32; out as stored)
 *     dA_j  = sum_d dout^_id v^_jd;   dP_j = keep(e) ? dA_j * r : 0
 *     dS_j  = round(P_j * (dP_j - D))                        (the two dS products' input)
 *     dQ_id = scale * sum_j dS_j k^_jd;   dK_jd = scale * sum_i dS_ij q^_id;
 *     dV_jd = sum_i A_ij dout^_id
 *     half = 0: dq, dkey, dv += dQ, dK, dV (ACCUMULATED, as attention_bwd);
 *     half = 1: dq, dkey, dv = round(dQ), round(dK), round(dV) (WRITTEN, as
 *     attention_half_bwd), over their rows and head columns only. Each may be NULL.
 * D = rowsum(dout * out) equals sum_j a_j dA_j when out is unrounded (FlashAttention-2 §3.2);
 * in half mode it is the stored out's, on every backend alike.
 *
 * Determinism: two runs of the same op on the same device are bitwise equal (no float atomics:
 * each gradient element has one owner). Head dims: nmt_attention_fused_dk_ok.
 *
 * defines: nmt_attention_args, nmt_attention_fused_dk_ok
 */
#ifndef NMT_ATTENTION_H
#define NMT_ATTENTION_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One attention call's inputs and shape (the arguments attention_fwd takes, in one place).
 * q: rows of ldq; k, v: rows of ldkv (float or nmt_act per `half`); k_lens (B) int32, host
 * memory on the ref backend and device memory on cuda, as for attention_fwd. B >= 0, Tq >= 0,
 * Tk >= 1, H >= 1, dk = C / H; p_drop in [0, 1). */
typedef struct {
  const void *q;
  const void *k;
  const void *v;
  int ldq, ldkv;
  const int32_t *k_lens;
  int B, Tq, Tk, H, dk;
  int causal;
  float p_drop;
  uint64_t seed, stream;
  int half;
} nmt_attention_args;

/* 1 iff the fused ops serve head dimension dk (32, 64 and 128: the tensor-core tiles of
 * cuda/attention_fused.cu); the config refuses kernels.attention = fused otherwise. */
static inline int nmt_attention_fused_dk_ok(int dk) { return dk == 32 || dk == 64 || dk == 128; }

#ifdef __cplusplus
}
#endif
#endif /* NMT_ATTENTION_H */
