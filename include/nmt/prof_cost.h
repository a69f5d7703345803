/* nmt/prof_cost.h — the FLOP/byte formulas of the backend ops, in one place: the work a
 * profiler range carries (nmt_prof_push), which the per-module table turns into TFLOP/s, GB/s
 * and a roofline bound. Each function gives the FLOPs and bytes of one call of an op (fp32).
 *
 * FLOPs after Kaplan et al. 2020 §2.1 and Hoffmann et al. 2022 ("Chinchilla") appendix F: a
 * matmul is 2·M·N·K forward and 4·M·N·K backward (dinp and dw); attention 4·Tq·Tk·H·dk plus
 * 3·H·Tq·Tk for the softmax, backward twice the forward.
 * Bytes are the minimum fp32 traffic of one pass over each operand (every input read once,
 * every output written once; accumulated gradients read and written): a roofline estimate
 * (Williams, Waterman & Patterson 2009), not a measurement. Elementwise, LayerNorm, softmax
 * cross entropy, embedding and AdamW are bytes-dominated; their FLOP counts are per-element
 * tallies of the backend's formulas (see each function). docs/profiling.md has the table.
 *
 * defines: nmt_prof_phase, nmt_prof_cost, nmt_prof_cost_add, nmt_prof_cost_matmul,
 *          nmt_prof_cost_attention, nmt_prof_cost_layernorm, nmt_prof_cost_embedding,
 *          nmt_prof_cost_xent, nmt_prof_cost_elementwise, nmt_prof_cost_adamw,
 *          nmt_prof_cost_allreduce, nmt_prof_cost_reduce_scatter, nmt_prof_cost_copy
 */
#ifndef NMT_PROF_COST_H
#define NMT_PROF_COST_H

#ifdef __cplusplus
extern "C" {
#endif

/* The pass a range times and a formula counts (nmt_prof_phase_str names it). */
typedef enum { NMT_PROF_OTHER = 0, NMT_PROF_FWD = 1, NMT_PROF_BWD = 2 } nmt_prof_phase;

typedef struct {
  double flops, bytes;
} nmt_prof_cost;

static inline nmt_prof_cost nmt_prof_cost_add(nmt_prof_cost a, nmt_prof_cost b) {
  nmt_prof_cost c = {a.flops + b.flops, a.bytes + b.bytes};
  return c;
}

/* out(M,N) = inp(M,K) w(N,K)^T (+ bias). fwd: 2MNK FLOP; bytes 4(MK + NK + MN) (+ 4N bias).
 * bwd (dinp and dw, Kaplan et al. 2020 §2.1): 4MNK FLOP (+ MN for dbias); reads dout, inp,
 * w and read-modify-writes dinp and dw: 4(MN + 3MK + 3NK) (+ 8N dbias). The bias add itself
 * is not counted in the FLOPs, so a matmul range is exactly 2MNK / 4MNK. */
nmt_prof_cost nmt_prof_cost_matmul(nmt_prof_phase ph, double M, double K, double N, int bias);
/* Multi-head attention core of B sentences, Tq queries, Tk keys, H heads of dk (C = H*dk).
 * fwd (Hoffmann et al. 2022 app. F): B(4 Tq Tk C + 3 H Tq Tk) FLOP (QK^T, softmax, PV);
 * bytes 4B(2 Tq C + 2 Tk C + H Tq Tk) (q, k, v read; out and the saved probs written).
 * bwd: twice the forward FLOPs (dP, dV, dQ, dK); bytes 4B(4 Tq C + 6 Tk C + 3 H Tq Tk)
 * (dout, probs, q, k, v read; dprobs written and read; dq, dk, dv read and written).
 * Masked (causal, padding) scores are counted: the kernels compute them. */
nmt_prof_cost nmt_prof_cost_attention(nmt_prof_phase ph, double B, double Tq, double Tk,
                                      double H, double dk);
/* LayerNorm over M rows of C. fwd: 8MC FLOP (mean 1, variance 3, normalise and affine 4 per
 * element); bytes 4(2MC + 2C + 2M). bwd: 12MC FLOP; bytes 4(4MC + 5C + 2M) (dout, inp read;
 * dinp, dgamma, dbeta read and written; mean, rstd, gamma read). */
nmt_prof_cost nmt_prof_cost_layernorm(nmt_prof_phase ph, double M, double C);
/* Embedding of n_rows rows of C (scale * E[id] + PE). fwd: 2 n C FLOP, 4(3 n C + n) bytes
 * (E row and PE row read, out written, ids). bwd: dE[id] += scale * dout: 2 n C FLOP,
 * 4(3 n C + n) bytes (dout read, dE rows read and written, ids). */
nmt_prof_cost nmt_prof_cost_embedding(nmt_prof_phase ph, double n_rows, double C);
/* Softmax cross entropy with label smoothing over (M,V) logits, fused with the gradient
 * written in place: 7 FLOP per logit (max 1, exp 2, sum 1, smoothing mean 1, gradient 2;
 * Hoffmann et al. count the softmax alone as 3); bytes 4(2MV + 4M): the logits read and the
 * gradient written once (minimum traffic), targets, losses, nll and the row sums. */
nmt_prof_cost nmt_prof_cost_xent(double M, double V);
/* Any elementwise op over n floats with `reads` input and `writes` output arrays and `flops`
 * FLOP per element: n*flops FLOP, 4n(reads + writes) bytes. add: (2,1,1); axpy: (2,1,2)
 * (y read and written); relu: (1,1,1); dropout (1,1,1: the scale; the counter-based RNG is
 * integer work); memset: (0,1,0). */
nmt_prof_cost nmt_prof_cost_elementwise(double n, double reads, double writes, double flops);
/* AdamW over n parameters (the backend's formula: 17 FLOP per parameter); bytes 28n: params,
 * grads, m, v read; params, m, v written. */
nmt_prof_cost nmt_prof_cost_adamw(double n);
/* All-reduce of `count` floats over `ranks` ranks: bytes are the "bus bandwidth" traffic of a
 * ring, 2(ranks-1)/ranks * 4 count (nccl-tests doc/PERFORMANCE.md); FLOPs (ranks-1)/ranks *
 * count additions. 0 for one rank. */
nmt_prof_cost nmt_prof_cost_allreduce(double count, double ranks);
/* Reduce-scatter of `count` floats (the whole buffer) over `ranks` ranks: half an all-reduce's
 * traffic, (ranks-1)/ranks * 4 count bytes (nccl-tests' reduce_scatter busbw), the same
 * (ranks-1)/ranks * count additions. 0 for one rank. */
nmt_prof_cost nmt_prof_cost_reduce_scatter(double count, double ranks);
/* A copy of `bytes` bytes (h2d, d2h): 0 FLOP, `bytes` bytes (what crosses the link). */
nmt_prof_cost nmt_prof_cost_copy(double bytes);

#ifdef __cplusplus
}
#endif
#endif /* NMT_PROF_COST_H */
