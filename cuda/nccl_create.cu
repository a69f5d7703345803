/* cuda/nccl_create.cu — creating the NCCL communicator's groups (include/nmt/comm.h; the
 * operations, abort and destroy are cuda/nccl.cu's, sharing cuda/nccl_comm.cuh):
 * nmt_comm_create_nccl (ncclCommInitAll: every rank in this process, blocking, as NCCL has no
 * config variant of it), nmt_comm_nccl_unique_id, and nmt_comm_create_nccl_ranks (this
 * process's ranks of a clique over several processes: NONBLOCKING ncclCommInitRankConfig,
 * polled against the run's abort flag and parallel.timeout_s, aborted on either; NCCL user
 * guide, "Fault Tolerance"). Then, for either: bind each rank to its CUDA context, install the
 * contexts' wait hooks, and only then the warm-up all-reduce, whose wait depends on every
 * peer: a peer that dies after its init ends it (abort flag, ncclCommGetAsyncError, the
 * deadline) instead of hanging the process. A failed creation gives every communicator back
 * with ncclCommAbort, which never waits.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <new>

#include "nccl_comm.cuh"
#include "nmt/log.h"

static_assert(sizeof(ncclUniqueId) == NMT_COMM_NCCL_ID_BYTES,
              "NMT_COMM_NCCL_ID_BYTES (nmt/comm.h) must match nccl.h's NCCL_UNIQUE_ID_BYTES");

namespace nmt__nccl {
namespace {

nmt_status check_args(int n, const int *devices, void *const *cuda_ctxs, nmt_comm **comms) {
  if (n < 1) return nmt_errorf(NMT_ERR_INTERNAL, "NCCL communicator: %d ranks (need >= 1)", n);
  if (!devices || !cuda_ctxs || !comms)
    return nmt_errorf(NMT_ERR_INTERNAL, "NCCL communicator: NULL devices, contexts or comms");
  for (int r = 0; r < n; r++) comms[r] = NULL;
  for (int r = 0; r < n; r++) {
    if (!cuda_ctxs[r])
      return nmt_errorf(NMT_ERR_INTERNAL, "NCCL communicator: rank %d has no CUDA context", r);
    int dev = nmt__cuda_ctx(cuda_ctxs[r])->device;
    if (dev != devices[r])
      return nmt_errorf(NMT_ERR_INTERNAL,
                        "NCCL communicator: rank %d is on GPU %d but its CUDA context is on GPU %d",
                        r, devices[r], dev);
    for (int q = 0; q < r; q++)
      if (devices[q] == devices[r])
        return nmt_errorf(NMT_ERR_INTERNAL,
                          "NCCL communicator: GPU %d is listed for ranks %d and %d (NCCL runs one "
                          "rank per GPU)",
                          devices[r], q, r);
  }
  return NMT_OK;
}

/* Allocates the barrier words and runs one allreduce on every rank in one group call from this
 * thread (NCCL user guide, "Group Calls": one thread driving several devices must group their
 * collectives), then waits for it: a group that cannot communicate fails here, at creation.
 * The ranks' wait hooks are already installed, and g->warmup_deadline set: the wait depends
 * on every peer. */
nmt_status warm_up(nccl_group *g) {
  const nmt__nccl_api *nc = g->api;
  for (int i = 0; i < g->n; i++) {
    nccl_rank *r = &g->ranks[i];
    NMT_TRY(nmt__cuda_enter(r->ctx, "NCCL warm-up"));
    NMT_CUDA_TRY(cudaMalloc((void **)&r->d_barrier, sizeof(float)));
    NMT_CUDA_TRY(cudaMemsetAsync(r->d_barrier, 0, sizeof(float), r->ctx->comm_stream));
  }
  ncclResult_t e = nc->GroupStart();
  if (e != ncclSuccess)
    return nmt_errorf(NMT_ERR_DEVICE, "ncclGroupStart: NCCL error %d (%s)", (int)e,
                      nc->GetErrorString(e));
  ncclResult_t first = ncclSuccess;
  int bad = -1;
  for (int i = 0; i < g->n; i++) {
    nccl_rank *r = &g->ranks[i];
    e = nc->AllReduce(r->d_barrier, r->d_barrier, 1, ncclFloat32, ncclMax, r->comm,
                      r->ctx->comm_stream);
    if (e != ncclSuccess && e != ncclInProgress && first == ncclSuccess) first = e, bad = i;
  }
  e = nc->GroupEnd();
  if (first == ncclSuccess && e != ncclSuccess && e != ncclInProgress) first = e, bad = 0;
  char msg[768];
  if (first != ncclSuccess) {
    describe(&g->ranks[bad], first, "the warm-up ncclAllReduce (ncclGroupEnd)", msg, sizeof msg);
    return nmt_errorf(NMT_ERR_DEVICE, "%s", msg);
  }
  /* Nonblocking: enqueued on every comm stream only once every communicator has settled. */
  for (int i = 0; e == ncclInProgress && i < g->n; i++) {
    ncclResult_t res = ncclSuccess;
    NMT_TRY(settle(&g->ranks[i], "the warm-up ncclAllReduce (ncclGroupEnd)",
                   g->warmup_deadline, &res, msg, sizeof msg));
    if (res != ncclSuccess) return nmt_errorf(NMT_ERR_DEVICE, "%s", msg);
  }
  for (int i = 0; i < g->n; i++) {
    nccl_rank *r = &g->ranks[i];
    NMT_TRY(nmt__cuda_wait(r->ctx, r->ctx->comm_stream, "NCCL warm-up"));
  }
  return NMT_OK;
}

/* "[0,1,3]": the GPUs, for messages. */
void device_list(const int *devices, int n, char *out, size_t cap) {
  int at = snprintf(out, cap, "[");
  for (int r = 0; r < n && at < (int)cap - 12; r++)
    at += snprintf(out + at, cap - (size_t)at, r ? ",%d" : "%d", devices[r]);
  snprintf(out + at, cap - (size_t)at, "]");
}

/* The group's bookkeeping before any NCCL communicator exists. */
nmt_status new_group(const nmt__nccl_api *api, int n, atomic_int *abort, double timeout_s,
                     nccl_group **out) {
  nccl_group *g = new (std::nothrow) nccl_group();
  if (g) g->ranks = new (std::nothrow) nccl_rank[n]();
  if (!g || !g->ranks) {
    delete g;
    return nmt_errorf(NMT_ERR_NOMEM, "NCCL communicator: cannot allocate %d ranks", n);
  }
  g->api = api;
  g->abort = abort ? abort : &g->own_abort;
  g->timeout_s = timeout_s;
  g->warmup_deadline = 0;
  g->nonblocking = false;
  g->n = n;
  *out = g;
  return NMT_OK;
}

/* Binds the n created communicators nc[] to their ranks (global rank first_rank + i of
 * world), hooks the contexts' waits and warms the group up within parallel.timeout_s. On
 * failure unhooks the contexts, aborts every communicator and frees the group. */
nmt_status finish_group(nccl_group *g, ncclComm_t *nc, void *const *cuda_ctxs, int world,
                        int first_rank, nmt_comm **comms) {
  for (int i = 0; i < g->n; i++) {
    nccl_rank *r = &g->ranks[i];
    r->base.ops = &nccl_ops;
    r->base.rank = first_rank + i;
    r->base.size = world;
    r->base.wire_reserved = 0;
    r->base.staging_reserved = 0;
    r->g = g;
    r->comm = nc[i];
    r->ctx = nmt__cuda_ctx(cuda_ctxs[i]);
  }
  /* Hooked before the warm-up, whose wait depends on every peer: a peer that dies after its
   * init must end it (abort flag, NCCL's asynchronous error, the deadline), not hang it. */
  for (int i = 0; i < g->n; i++) {
    nccl_rank *r = &g->ranks[i];
    r->ctx->wait_hook = wait_hook;
    r->ctx->wait_arg = r;
  }
  g->warmup_deadline = deadline_after(g->timeout_s);
  nmt_status s = warm_up(g);
  g->warmup_deadline = 0;
  if (s != NMT_OK) {
    for (int i = 0; i < g->n; i++) {
      g->ranks[i].ctx->wait_hook = NULL;
      g->ranks[i].ctx->wait_arg = NULL;
    }
    /* Abort, not destroy: destroy would wait for a warm-up that may never complete. */
    release_rest(g);
    free_group(g);
    return s;
  }
  for (int i = 0; i < g->n; i++) comms[i] = &g->ranks[i].base;
  const char *rc = getenv("NCCL_RUNTIME_CONNECT");
  nmt_log(NMT_LOG_INFO, "NCCL %d: %s communicator over %d GPU(s) of this process, global ranks "
          "%d..%d of %d, NCCL_RUNTIME_CONNECT=%s", g->api->version,
          g->nonblocking ? "nonblocking" : "blocking", g->n,
          first_rank, first_rank + g->n - 1, world, rc ? rc : "(unset)");
  return NMT_OK;
}

/* Aborts the communicators that exist after a failed creation (never waits; a nonblocking
 * one may be aborted in the middle of its init). */
void abort_created(const nmt__nccl_api *nc, ncclComm_t *comms, int n) {
  for (int i = 0; i < n; i++)
    if (comms[i]) (void)nc->CommAbort(comms[i]);
}

/* The part of both creations after the checks: load NCCL, make the group, init the
 * communicators (`init(g, nc)` fills nc[] and returns NMT_OK or the recorded error), finish.
 * `what` names the request for the loader's message; timeout_s as g->timeout_s. */
template <typename Init>
nmt_status create_group(const char *what, int n, void *const *cuda_ctxs, int world,
                        int first_rank, atomic_int *abort, double timeout_s, nmt_comm **comms,
                        Init init) {
  const nmt__nccl_api *api = NULL;
  NMT_TRY(nmt__nccl_open(what, &api));
  int prev_device = -1;
  (void)cudaGetDevice(&prev_device);
  nccl_group *g = NULL;
  NMT_TRY(new_group(api, n, abort, timeout_s, &g));
  ncclComm_t *nc = new (std::nothrow) ncclComm_t[n]();
  if (!nc) {
    free_group(g);
    return nmt_errorf(NMT_ERR_NOMEM, "NCCL communicator: cannot allocate %d handles", n);
  }
  nmt_status s = init(g, nc);
  if (s != NMT_OK) {
    abort_created(api, nc, n);
    free_group(g);
  } else {
    s = finish_group(g, nc, cuda_ctxs, world, first_rank, comms);
  }
  delete[] nc;
  if (prev_device >= 0) (void)cudaSetDevice(prev_device);
  return s;
}

/* NCCL's verdict with its last message (of `comm`, or the library's for NULL), for a failed
 * creation: NMT_ERR_DEVICE. */
nmt_status init_error(const nmt__nccl_api *nc, ncclComm_t comm, ncclResult_t e,
                      const char *head) {
  const char *last = nc->GetLastError(comm);
  return nmt_errorf(NMT_ERR_DEVICE, "%s: NCCL error %d (%s)%s%s", head, (int)e,
                    nc->GetErrorString(e), last && *last ? ": " : "", last ? last : "");
}

/* Waits for the nonblocking init of comms[0..n) (NCCL user guide, "Fault Tolerance": poll
 * ncclCommGetAsyncError while it says ncclInProgress, abort on a timeout): NMT_OK once every
 * one is ncclSuccess. Otherwise *bad is the communicator that ended in an error or was being
 * waited for, and the status NMT_ERR_DEVICE (*state: NCCL's error) or NMT_ERR_ABORTED (the
 * run's abort flag, or g->timeout_s passed: the message names it). Only the creating thread
 * knows these handles: no state word is needed around the calls. */
nmt_status await_init(const nccl_group *g, ncclComm_t *comms, int n, const char *what,
                      int *bad, ncclResult_t *state) {
  const double deadline = deadline_after(g->timeout_s);
  for (int i = 0; i < n; i++) {
    *bad = i;
    for (unsigned long k = 0;; k++) {
      *state = ncclInProgress;
      const ncclResult_t q = g->api->CommGetAsyncError(comms[i], state);
      if (q != ncclSuccess) *state = q;
      if (*state == ncclSuccess) break;
      if (*state != ncclInProgress) return NMT_ERR_DEVICE;
      if (group_aborted(g))
        return nmt_errorf(NMT_ERR_ABORTED, "%s: the run was aborted during NCCL's init", what);
      if (deadline > 0 && now_s() > deadline) return timed_out(what, g->timeout_s);
      backoff(k);
    }
  }
  return NMT_OK;
}

} // namespace
} // namespace nmt__nccl

using namespace nmt__nccl;

nmt_status nmt_comm_create_nccl(int n, const int *devices, void *const *cuda_ctxs,
                                atomic_int *abort, nmt_comm **comms) {
  NMT_TRY(check_args(n, devices, cuda_ctxs, comms));
  char list[256], what[320];
  device_list(devices, n, list, sizeof list);
  snprintf(what, sizeof what, "NCCL communicator over %d GPU(s) %s", n, list);
  /* ncclCommInitAll has no config variant: blocking (every rank is in this process). */
  return create_group(what, n, cuda_ctxs, n, 0, abort, 0.0, comms,
                      [&](nccl_group *g, ncclComm_t *out) {
                        const nmt__nccl_api *nc = g->api;
                        ncclResult_t e = nc->CommInitAll(out, n, devices);
                        if (e == ncclSuccess) return NMT_OK;
                        char head[320];
                        snprintf(head, sizeof head, "ncclCommInitAll over %d GPU(s) %s", n, list);
                        return init_error(nc, NULL, e, head);
                      });
}

nmt_status nmt_comm_nccl_unique_id(void *out, size_t cap) {
  if (!out || cap < sizeof(ncclUniqueId))
    return nmt_errorf(NMT_ERR_INTERNAL, "NCCL unique id: a buffer of %zu bytes at %p (need %zu)",
                      cap, out, sizeof(ncclUniqueId));
  const nmt__nccl_api *nc = NULL;
  NMT_TRY(nmt__nccl_open("the NCCL unique id of a multi-process group", &nc));
  ncclUniqueId id;
  ncclResult_t e = nc->GetUniqueId(&id);
  if (e != ncclSuccess) return init_error(nc, NULL, e, "ncclGetUniqueId");
  memcpy(out, &id, sizeof id);
  return NMT_OK;
}

nmt_status nmt_comm_create_nccl_ranks(int n_local, const int *devices, void *const *cuda_ctxs,
                                      int world, int first_rank, const void *unique_id,
                                      double timeout_s, atomic_int *abort, nmt_comm **comms) {
  if (!(timeout_s >= 0))
    return nmt_errorf(NMT_ERR_CONFIG, "parallel.timeout_s = %g: must be >= 0 (seconds)",
                      timeout_s);
  NMT_TRY(check_args(n_local, devices, cuda_ctxs, comms));
  if (!unique_id || world < n_local || first_rank < 0 || first_rank > world - n_local)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "NCCL communicator: %d local GPU(s) as global ranks %d..%d of %d%s", n_local,
                      first_rank, first_rank + n_local - 1, world,
                      unique_id ? " (outside [0, world))" : ", without a unique id");
  ncclUniqueId id;
  memcpy(&id, unique_id, sizeof id);
  char list[256], what[384];
  device_list(devices, n_local, list, sizeof list);
  snprintf(what, sizeof what, "NCCL communicator over GPU(s) %s as global ranks %d..%d of %d",
           list, first_rank, first_rank + n_local - 1, world);
  return create_group(
      what, n_local, cuda_ctxs, world, first_rank, abort, timeout_s, comms,
      [&](nccl_group *g, ncclComm_t *out) {
        const nmt__nccl_api *nc = g->api;
        /* Every device is checked before any init is queued: ending a group that holds some
         * ranks' inits would start them without the missing local rank. */
        for (int i = 0; i < n_local; i++) {
          cudaError_t ce = cudaSetDevice(devices[i]);
          if (ce != cudaSuccess && cudaGetLastError() != cudaSuccess) /* reported, cleared */
            return nmt_errorf(NMT_ERR_DEVICE, "%s: cudaSetDevice(%d) before NCCL's init: %s",
                              what, devices[i], cudaGetErrorString(ce));
        }
        /* Nonblocking (the top of the file). NCCL copies min(size, its own) bytes of the
         * config and reads `version` to know which fields exist, so this header's
         * initializer suits any library >= 2.14 (the loader's minimum). */
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        g->nonblocking = true;
        /* One thread, several ranks: grouped, or the first init would wait for the others
         * forever (user guide, "Group Calls"). */
        ncclResult_t first = nc->GroupStart();
        const int started = first == ncclSuccess;
        int bad = 0;
        for (int i = 0; first == ncclSuccess && i < n_local; i++) {
          (void)cudaSetDevice(devices[i]); /* succeeded above */
          ncclResult_t e = nc->CommInitRankConfig(&out[i], world, id, first_rank + i, &config);
          if (e != ncclSuccess && e != ncclInProgress) first = e, bad = i;
        }
        ncclResult_t end = started ? nc->GroupEnd() : ncclSuccess;
        if (first == ncclSuccess && end != ncclInProgress) first = end;
        char head[512];
        if (first == ncclSuccess) {
          ncclResult_t state = ncclSuccess;
          const nmt_status s = await_init(g, out, n_local, what, &bad, &state);
          if (s != NMT_ERR_DEVICE) return s;
          first = state;
        }
        snprintf(head, sizeof head,
                 "ncclCommInitRankConfig (GPU %d as global rank %d of %d, in a group of %d "
                 "local rank(s))",
                 devices[bad], first_rank + bad, world, n_local);
        return init_error(nc, out[bad], first, head);
      });
}

