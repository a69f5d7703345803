/* comm.c — the public nmt_comm_* entry points: argument checks shared by every
 * implementation, then dispatch through the handle's ops table (comm_impl.h). */
#include "nmt/comm.h"

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
