/* prof_cost.c — the FLOP/byte formulas of the backend ops (nmt_prof_cost_*,
 * include/nmt/prof_cost.h, where each formula and its source are given; docs/profiling.md has
 * the table). */
#include "nmt/prof_cost.h"

static nmt_prof_cost cost(double flops, double bytes) {
  nmt_prof_cost c = {flops, bytes};
  return c;
}

nmt_prof_cost nmt_prof_cost_matmul(nmt_prof_phase ph, double M, double K, double N, int bias) {
  if (ph == NMT_PROF_BWD)
    return cost(4 * M * N * K + (bias ? M * N : 0),
                4 * (M * N + 3 * M * K + 3 * N * K + (bias ? 2 * N : 0)));
  return cost(2 * M * N * K, 4 * (M * K + N * K + M * N + (bias ? N : 0)));
}

nmt_prof_cost nmt_prof_cost_attention(nmt_prof_phase ph, double B, double Tq, double Tk,
                                      double H, double dk) {
  const double C = H * dk, P = H * Tq * Tk;
  const double fwd = B * (4 * Tq * Tk * C + 3 * P);
  if (ph == NMT_PROF_BWD) return cost(2 * fwd, 4 * B * (4 * Tq * C + 6 * Tk * C + 3 * P));
  return cost(fwd, 4 * B * (2 * Tq * C + 2 * Tk * C + P));
}

nmt_prof_cost nmt_prof_cost_layernorm(nmt_prof_phase ph, double M, double C) {
  if (ph == NMT_PROF_BWD) return cost(12 * M * C, 4 * (4 * M * C + 5 * C + 2 * M));
  return cost(8 * M * C, 4 * (2 * M * C + 2 * C + 2 * M));
}

nmt_prof_cost nmt_prof_cost_embedding(nmt_prof_phase ph, double n_rows, double C) {
  (void)ph; /* the same tally both ways (see the header) */
  return cost(2 * n_rows * C, 4 * (3 * n_rows * C + n_rows));
}

nmt_prof_cost nmt_prof_cost_xent(double M, double V) {
  return cost(7 * M * V, 4 * (2 * M * V + 4 * M));
}

nmt_prof_cost nmt_prof_cost_elementwise(double n, double reads, double writes, double flops) {
  return cost(n * flops, 4 * n * (reads + writes));
}

nmt_prof_cost nmt_prof_cost_adamw(double n) { return cost(17 * n, 28 * n); }

nmt_prof_cost nmt_prof_cost_allreduce(double count, double ranks) {
  if (ranks <= 1) return cost(0, 0);
  double f = (ranks - 1) / ranks;
  return cost(f * count, 2 * f * 4 * count);
}

nmt_prof_cost nmt_prof_cost_reduce_scatter(double count, double ranks) {
  if (ranks <= 1) return cost(0, 0);
  double f = (ranks - 1) / ranks;
  return cost(f * count, f * 4 * count);
}

nmt_prof_cost nmt_prof_cost_copy(double bytes) { return cost(0, bytes); }
