/* comm.c — the public nmt_comm_* entry points: argument checks shared by every
 * implementation, then dispatch through the handle's ops table (comm_impl.h). */
#include "nmt/comm.h"

#include <stdint.h>

#include "comm_impl.h"

int nmt_comm_rank(const nmt_comm *c) { return c->rank; }

int nmt_comm_size(const nmt_comm *c) { return c->size; }

/* A NULL buffer with a non-zero count is a caller bug; catching it here gives a message
 * instead of a segfault inside a peer's reduction loop. Every rank makes the same call, so
 * every rank fails the same way and nobody is left waiting at a barrier. */
static nmt_status check_buf(const char *op, const nmt_comm *c, const float *buf, size_t count) {
  if (!buf && count)
    return nmt_errorf(NMT_ERR_INTERNAL, "%s on rank %d: NULL buffer with count %zu", op, c->rank,
                      count);
  return NMT_OK;
}

nmt_status nmt_comm_allreduce_sum(nmt_comm *c, float *buf, size_t count) {
  NMT_TRY(check_buf("allreduce_sum", c, buf, count));
  return c->ops->allreduce_sum(c, buf, count);
}

size_t nmt_comm_wire_size(nmt_grad_dtype wire) {
  switch (wire) {
  case NMT_GRAD_FP32: return 4;
  case NMT_GRAD_FP16: return 2;
  case NMT_GRAD_BF16: return 2;
  }
  return 0;
}

const char *nmt_comm_wire_name(nmt_grad_dtype wire) {
  switch (wire) {
  case NMT_GRAD_FP32: return "float";
  case NMT_GRAD_FP16: return "half";
  case NMT_GRAD_BF16: return "bfloat16";
  }
  return "?";
}

nmt_status nmt_comm_reserve(nmt_comm *c, size_t max_count) {
  if (max_count <= c->wire_reserved) return NMT_OK;
  if (c->ops->reserve) NMT_TRY(c->ops->reserve(c, max_count));
  c->wire_reserved = max_count;
  return NMT_OK;
}

nmt_status nmt_comm_reserve_staging(nmt_comm *c, size_t max_bytes) {
  if (max_bytes <= c->staging_reserved) return NMT_OK;
  if (c->ops->reserve_staging) NMT_TRY(c->ops->reserve_staging(c, max_bytes));
  c->staging_reserved = max_bytes;
  return NMT_OK;
}

const char *nmt_comm_name(const nmt_comm *c) { return c && c->ops->name ? c->ops->name : "?"; }

nmt_status nmt_comm_allreduce_sum_as(nmt_comm *c, float *buf, size_t count, nmt_grad_dtype wire) {
  if (wire == NMT_GRAD_FP32) return nmt_comm_allreduce_sum(c, buf, count);
  if (wire != NMT_GRAD_FP16 && wire != NMT_GRAD_BF16)
    return nmt_errorf(NMT_ERR_INTERNAL, "allreduce_sum_as on rank %d: wire type %d is not fp32, "
                      "fp16 or bf16", c->rank, (int)wire);
  NMT_TRY(check_buf("allreduce_sum_as", c, buf, count));
  /* Checked here rather than grown on demand: on NCCL, growing means cudaFree, which waits for
   * the whole device in the middle of backward. */
  if (count > c->wire_reserved)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "allreduce_sum_as(%s) on rank %d: %zu elements, but nmt_comm_reserve made "
                      "room for %zu; reserve the largest count (the bucket size) at setup",
                      nmt_comm_wire_name(wire), c->rank, count, c->wire_reserved);
  if (!c->ops->allreduce_sum_as)
    return nmt_errorf(NMT_ERR_INTERNAL, "allreduce_sum_as(%s) on rank %d: the %s communicator "
                      "has no half-precision all-reduce", nmt_comm_wire_name(wire), c->rank,
                      c->ops->name);
  return c->ops->allreduce_sum_as(c, buf, count, wire);
}

/* A wire or element type of nmt_grad_dtype. */
static nmt_status check_dtype(const char *op, const nmt_comm *c, nmt_grad_dtype t) {
  if (t != NMT_GRAD_FP32 && t != NMT_GRAD_FP16 && t != NMT_GRAD_BF16)
    return nmt_errorf(NMT_ERR_INTERNAL, "%s on rank %d: type %d is not fp32, fp16 or bf16", op,
                      c->rank, (int)t);
  return NMT_OK;
}

nmt_status nmt_comm_reduce_scatter_sum_as(nmt_comm *c, float *buf, size_t count,
                                          nmt_grad_dtype wire) {
  NMT_TRY(check_dtype("reduce_scatter_sum_as", c, wire));
  if (!buf && count)
    return nmt_errorf(NMT_ERR_INTERNAL, "reduce_scatter_sum_as on rank %d: NULL buffer with "
                      "count %zu", c->rank, count);
  /* n x count fp32 must be addressable; a count that wraps would reduce the wrong slices. */
  if (count > SIZE_MAX / sizeof(float) / (size_t)c->size)
    return nmt_errorf(NMT_ERR_INTERNAL, "reduce_scatter_sum_as on rank %d: %d x %zu elements "
                      "overflow size_t", c->rank, c->size, count);
  const size_t total = count * (size_t)c->size;
  if (wire != NMT_GRAD_FP32 && total > c->wire_reserved)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "reduce_scatter_sum_as(%s) on rank %d: %zu elements, but nmt_comm_reserve "
                      "made room for %zu; reserve n x count at setup", nmt_comm_wire_name(wire),
                      c->rank, total, c->wire_reserved);
  if (!c->ops->reduce_scatter_sum_as)
    return nmt_errorf(NMT_ERR_INTERNAL, "reduce_scatter_sum_as on rank %d: the %s communicator "
                      "has no reduce-scatter", c->rank, c->ops->name);
  return c->ops->reduce_scatter_sum_as(c, buf, count, wire);
}

nmt_status nmt_comm_all_gather(nmt_comm *c, void *buf, size_t count, nmt_grad_dtype dtype) {
  NMT_TRY(check_dtype("all_gather", c, dtype));
  if (!buf && count)
    return nmt_errorf(NMT_ERR_INTERNAL, "all_gather on rank %d: NULL buffer with count %zu",
                      c->rank, count);
  if (count > SIZE_MAX / nmt_comm_wire_size(dtype) / (size_t)c->size)
    return nmt_errorf(NMT_ERR_INTERNAL, "all_gather on rank %d: %d x %zu elements overflow "
                      "size_t", c->rank, c->size, count);
  if (!c->ops->all_gather)
    return nmt_errorf(NMT_ERR_INTERNAL, "all_gather on rank %d: the %s communicator has no "
                      "all-gather", c->rank, c->ops->name);
  return c->ops->all_gather(c, buf, count, dtype);
}

nmt_status nmt_comm_allreduce_max(nmt_comm *c, float *buf, size_t count) {
  NMT_TRY(check_buf("allreduce_max", c, buf, count));
  return c->ops->allreduce_max(c, buf, count);
}

nmt_status nmt_comm_broadcast(nmt_comm *c, float *buf, size_t count, int root) {
  NMT_TRY(check_buf("broadcast", c, buf, count));
  if (root < 0 || root >= c->size)
    return nmt_errorf(NMT_ERR_INTERNAL, "broadcast on rank %d: root %d not in [0, %d)", c->rank,
                      root, c->size);
  return c->ops->broadcast(c, buf, count, root);
}

nmt_status nmt_comm_barrier(nmt_comm *c) { return c->ops->barrier(c); }

nmt_status nmt_comm_flush(nmt_comm *c) { return c->ops->flush(c); }

void nmt_comm_abort(nmt_comm *c) {
  if (c) c->ops->abort(c);
}

void nmt_comm_destroy(nmt_comm **comms, int n) {
  if (!comms || n < 1 || !comms[0]) return;
  comms[0]->ops->destroy(comms, n);
}
