/* nmt/comm.h — collectives between the ranks of one process (one rank per worker thread).
 *
 * An nmt_comm is one rank's handle; a group of them is created at once by the main thread
 * (as ncclCommInitAll does) before any worker starts. Every rank must call the same collectives
 * in the same order with the same counts. Implementations: host (shared memory between CPU
 * worker threads, src/comm/host.c) and, later, NCCL (src/comm/nccl.c, the only file that
 * includes nccl.h).
 *
 * Host implementation: each collective publishes the rank's buffer pointer, meets the others
 * at a spinning barrier (C11 atomics, sched_yield; no mutex), and rank r reduces slice r of
 * every buffer in rank order 0..n-1, so every rank gets bitwise the same result and the result
 * does not depend on thread timing. A raised abort flag makes every waiting rank return
 * NMT_ERR_ABORTED instead of hanging.
 *
 * defines: nmt_comm, nmt_comm_create_host, nmt_comm_allreduce_sum, nmt_comm_allreduce_max,
 *          nmt_comm_broadcast, nmt_comm_barrier, nmt_comm_rank, nmt_comm_size,
 *          nmt_comm_abort, nmt_comm_destroy
 */
#ifndef NMT_COMM_H
#define NMT_COMM_H

#include <stdatomic.h>
#include <stddef.h>

#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nmt_comm nmt_comm;

/* Creates n host communicators sharing one group; comms[r] is rank r's. `abort` (may be
 * NULL) is the run's shared abort flag, polled while waiting. Errors: NMT_ERR_NOMEM,
 * NMT_ERR_INTERNAL (n < 1). */
nmt_status nmt_comm_create_host(int n, atomic_int *abort, nmt_comm **comms);

int nmt_comm_rank(const nmt_comm *c);
int nmt_comm_size(const nmt_comm *c);

/* In place: buf[i] = sum over ranks of buf[i], i < count (fp32, summed in rank order).
 * Errors: NMT_ERR_ABORTED if the abort flag is raised while waiting. */
nmt_status nmt_comm_allreduce_sum(nmt_comm *c, float *buf, size_t count);
/* In place: buf[i] = max over ranks. */
nmt_status nmt_comm_allreduce_max(nmt_comm *c, float *buf, size_t count);
/* buf on every rank = buf on `root`. */
nmt_status nmt_comm_broadcast(nmt_comm *c, float *buf, size_t count, int root);
nmt_status nmt_comm_barrier(nmt_comm *c);
/* Raises the group's abort flag (any thread may call it): every rank waiting in or entering a
 * collective returns NMT_ERR_ABORTED. */
void nmt_comm_abort(nmt_comm *c);
/* Frees the group; call once with all n handles after every rank has stopped. */
void nmt_comm_destroy(nmt_comm **comms, int n);

#ifdef __cplusplus
}
#endif
#endif /* NMT_COMM_H */
