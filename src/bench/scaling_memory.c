/* scaling_memory.c — `nmt bench scaling`'s per-GPU memory model (include/nmt/bench.h,
 * docs/scaling.md "Memory"): what one training worker holds at each ZeRO stage, what grows with
 * data.max_tokens, and the largest data.max_tokens that fits a GPU. Pure functions of the
 * configuration: nothing is allocated.
 */
#include <math.h>
#include <string.h>

#include "nmt/backend.h"
#include "nmt/bench.h"
#include "nmt/buckets.h"
#include "nmt/model.h"

nmt_status nmt_scaling_state_bytes(int zero, int n_ranks, size_t n_params,
                                   const nmt_bucket_plan *stage2, int half, double bucket_mb,
                                   nmt_scaling_memory *out) {
  memset(out, 0, sizeof *out);
  if (zero < 0 || zero > 2 || n_ranks < 1 || !(bucket_mb > 0) ||
      (zero == 2 && (!stage2 || stage2->zero != 2 || stage2->n_ranks != n_ranks ||
                     stage2->n_params != n_params)))
    return nmt_errorf(NMT_ERR_USAGE, "memory model: zero %d over %d ranks, bucket_mb %g%s", zero,
                      n_ranks, bucket_mb, zero == 2 ? " (needs the stage 2 plan of that model "
                      "over those ranks)" : "");
  /* The trainer's own plans and sizes (src/engine/replica.c allocates nmt_bucket_plan_bytes). */
  nmt_bucket_plan plan;
  if (zero == 0) NMT_TRY(nmt_bucket_plan_make(bucket_mb, n_params, NMT_GRAD_EXTRA, 0, &plan));
  if (zero == 1) NMT_TRY(nmt_bucket_plan_make_sharded(bucket_mb, n_params, n_ranks, 1, 0, &plan));
  nmt_plan_bytes b;
  nmt_bucket_plan_bytes(zero == 2 ? stage2 : &plan, half, &b);
  out->weights = (double)b.weights;
  out->grads = (double)b.grads;
  out->optim = (double)b.optim;
  out->total = out->weights + out->grads + out->optim;
  return NMT_OK;
}

/* cuda/common.cuh rounds every scratch piece up to 256 bytes. */
static double pad256(double bytes) { return ceil(bytes / 256) * 256; }

nmt_status nmt_scaling_token_bytes(const nmt_model_cfg *mc, int max_tokens, int max_len, int half,
                                   nmt_scaling_memory *out) {
  if (max_tokens < 1 || max_len < 1 || max_len > mc->max_positions)
    return nmt_errorf(NMT_ERR_USAGE, "memory model: max_tokens %d, max_len %d (model.max_positions "
                      "%d)", max_tokens, max_len, mc->max_positions);
  /* The exact count is a size_t: refuse shapes whose bound would not fit (as the trainer). */
  if (!(nmt_model_activation_bytes_bound(mc, max_tokens, max_len) <= 0x1p60))
    return nmt_errorf(NMT_ERR_USAGE, "memory model: %d tokens per micro-batch need more than 2^60 "
                      "bytes of activations", max_tokens);
  const size_t arena = nmt_model_arena_bytes(mc, max_tokens, max_len);
  if (arena == 0)
    return nmt_errorf(NMT_ERR_NOMEM, "memory model: no host memory to lay out the activations");
  out->activations = (double)arena;
  out->batch = 3.0 * (5.0 * max_tokens + 16) * sizeof(int32_t);
  nmt_scratch_plan plan;
  nmt_model_scratch_plan(mc, max_tokens, max_len, &plan);
  const nmt_scratch_need *m = &plan.main;
  const double q = (double)m->att_q, kv = (double)m->att_kv, g = q > kv ? q : kv;
  out->scratch = 2 * pad256(4 * q) + 2 * pad256(4 * kv) + pad256(4 * g) +
                 pad256(4 * (double)m->att_scores);
  if (half && m->gemm_rows)
    out->scratch += pad256(2.0 * (double)m->gemm_inp) + pad256(2.0 * (double)m->gemm_w) +
                    pad256(2.0 * (double)m->gemm_out);
  return NMT_OK;
}

nmt_status nmt_scaling_max_tokens(const nmt_model_cfg *mc, int max_len, int half,
                                  double fixed_bytes, double capacity_bytes, int *out) {
  *out = 0;
  nmt_scaling_memory m;
  int lo = 0, hi = 1 << 24; /* lo fits (0: nothing), hi + 1 does not */
  while (lo < hi) {
    int mid = lo + (hi - lo + 1) / 2;
    NMT_TRY(nmt_scaling_token_bytes(mc, mid, max_len, half, &m));
    if (fixed_bytes + m.activations + m.scratch + m.batch <= capacity_bytes)
      lo = mid;
    else
      hi = mid - 1;
  }
  *out = lo;
  return NMT_OK;
}
