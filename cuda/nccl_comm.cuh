/* cuda/nccl_comm.cuh — what the NCCL communicator's two files share (internal to them):
 * cuda/nccl.cu (the operations, abort and destroy) and cuda/nccl_create.cu (creation:
 * ncclCommInitAll, or the nonblocking ncclCommInitRankConfig, then binding, hooks and
 * warm-up). The rank and group structs, the per-rank state word's protocol (enter / leave /
 * release / group_abort: the top of cuda/nccl.cu says why), the polling of a nonblocking
 * communicator (settle), the contexts' wait hook and the operations table.
 *
 * defines: nmt__nccl::nccl_rank, nccl_group, ST_*, rank_of, group_aborted, now_s,
 *          deadline_after, backoff, timed_out, describe, release, leave, enter, group_abort,
 *          poll_rank, wait_hook, settle, free_group, release_rest, nccl_ops
 */
#ifndef NMT_CUDA_NCCL_COMM_CUH
#define NMT_CUDA_NCCL_COMM_CUH

#include <stddef.h>

#include <atomic>

#include "../src/comm/comm_impl.h"
#include "common.cuh"
#include "nccl_lib.cuh"

namespace nmt__nccl {

enum : int { ST_BUSY = 1, ST_ABORT = 2, ST_RELEASED = 4 };

struct nccl_group;

struct nccl_rank {
  nmt_comm base; /* first member: a nmt_comm * is a nccl_rank * */
  nccl_group *g;
  ncclComm_t comm;
  nmt_cuda_ctx *ctx;
  float *d_barrier;       /* one float on the rank's GPU: the barrier's allreduce */
  void *d_wire;           /* half scratch of allreduce_sum_as (nmt_comm_reserve), or NULL */
  size_t wire_cap;        /* its capacity in 2-byte elements */
  int pending;            /* collectives enqueued since the last flush; owner thread only */
  std::atomic<int> state; /* ST_* bits, see the top of cuda/nccl.cu */
};

struct nccl_group {
  const nmt__nccl_api *api; /* the process's NCCL (nccl_lib.cuh) */
  std::atomic<int> own_abort;
  std::atomic<int> *abort; /* the run's flag, or &own_abort */
  double timeout_s;        /* parallel.timeout_s for host waits on peers (settle); 0: none */
  double warmup_deadline;  /* monotonic s; the wait hook's limit during the warm-up, else 0.
                            * Written and read by the creating thread only. */
  bool nonblocking;        /* ncclConfig_t.blocking = 0 (nmt_comm_create_nccl_ranks) */
  int n;
  nccl_rank *ranks;
};

inline nccl_rank *rank_of(nmt_comm *c) { return reinterpret_cast<nccl_rank *>(c); }

/* Relaxed: the flag guards no data, it only stops work (as in src/comm/host.c). */
inline bool group_aborted(const nccl_group *g) {
  return g->abort->load(std::memory_order_relaxed) != 0;
}

/* Monotonic seconds. */
double now_s();
/* The absolute end (now_s() units) of a wait of timeout_s from now; 0 (none) for 0. */
double deadline_after(double timeout_s);
/* Between two polls of NCCL's progress (poll number i): sched_yield, then 50 us sleeps. */
void backoff(unsigned long i);
/* NMT_ERR_ABORTED naming `what` and parallel.timeout_s (a wait on peers that ran out). */
nmt_status timed_out(const char *what, double timeout_s);

/* NCCL's text for e from `call` on rank r, with the communicator's last error, into out (cap
 * bytes). Only with the right to use r->comm. */
void describe(const nccl_rank *r, ncclResult_t e, const char *call, char *out, size_t cap);
/* ncclCommAbort(r->comm): the one call that gives a communicator back. */
void release(nccl_rank *r);
/* The owner's right to use r->comm for one NCCL call (NMT_ERR_ABORTED once aborted), and its
 * end (which releases the communicator if an abort came meanwhile). */
nmt_status enter(nccl_rank *r);
void leave(nccl_rank *r);
/* Raises the group's (the run's) abort flag and gives back every communicator not in use. */
void group_abort(nccl_group *g);
/* The rank's health from its thread: NMT_ERR_ABORTED, or NMT_ERR_DEVICE (and the group
 * aborted) for an asynchronous NCCL error seen during `during`. */
nmt_status poll_rank(nccl_rank *r, const char *during);
/* The CUDA context's wait hook (nmt__cuda_wait_hook; arg: the nccl_rank). */
nmt_status wait_hook(void *arg);
/* After `call` returned ncclInProgress on a nonblocking communicator: polls
 * ncclCommGetAsyncError until the operation leaves ncclInProgress; *res its final result (an
 * error described into msg). NMT_ERR_ABORTED on an abort or past deadline (0: none). */
nmt_status settle(nccl_rank *r, const char *call, double deadline, ncclResult_t *res, char *msg,
                  size_t cap);
/* Frees the group's device buffers and bookkeeping (the communicators are given back first). */
void free_group(nccl_group *g);
/* Gives back every communicator of g nobody gave back (no rank may be BUSY). */
void release_rest(nccl_group *g);

/* The NCCL implementation of nmt_comm (src/comm/comm_impl.h). */
extern const nmt_comm_ops nccl_ops;

} // namespace nmt__nccl

#endif /* NMT_CUDA_NCCL_COMM_CUH */
