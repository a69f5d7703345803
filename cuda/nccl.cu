/* cuda/nccl.cu — the NCCL communicator (include/nmt/comm.h): one rank per GPU, all in this
 * process, created at once by ncclCommInitAll, or this process's ranks of a clique spanning
 * several processes (nonblocking ncclCommInitRankConfig through a unique id). This file holds
 * the operations, abort and destroy; creation is cuda/nccl_create.cu's, and what the two share
 * (structs, the state word, settle, the wait hook) is declared in cuda/nccl_comm.cuh. NCCL
 * itself is reached through the table of cuda/nccl_lib.cuh (dlopen on first use; nmt does not
 * link libnccl).
 *
 * Streams. Rank r works on the CUDA context of its worker (cuda/context.cu): the compute stream
 * carries forward, backward and the optimizer; the comm stream carries the collectives. A
 * collective records ev_compute on the compute stream, makes the comm stream wait for it (the
 * bucket's gradients are final once every kernel enqueued before the call has run) and enqueues
 * the in-place ncclAllReduce / ncclBroadcast there; the call returns at once and the reduction
 * overlaps the rest of backward. nmt_comm_flush records ev_comm on the comm stream and makes the
 * compute stream wait for it, so the optimizer, and any copy to the host, come after every
 * collective. One event of each kind suffices: cudaStreamWaitEvent waits for the event's most
 * recent record at the time of the call, and each record is consumed before the next.
 * (NCCL user guide, "CUDA Stream Semantics": an NCCL call returns once the operation is
 * enqueued on the given stream; completion is observed with CUDA events or stream queries.)
 *
 * Half wire (nmt_comm_allreduce_sum_as). The buffers stay fp32; after the same wait for
 * ev_compute, three things go on the comm stream: a kernel casting buf into the rank's half
 * scratch (__float2half_rn / __float2bfloat16_rn), the in-place ncclAllReduce on the scratch
 * with ncclFloat16 / ncclBfloat16 (NCCL's reduction kernels add in the element type), and a
 * kernel casting the sum back into buf. Stream order makes one scratch per rank enough for any
 * number of buckets: bucket b+1's cast runs after bucket b's cast back. The scratch is sized by
 * nmt_comm_reserve at setup, because growing it in the step would mean cudaFree, which waits
 * for the whole device.
 *
 * ZeRO's collectives, in place as NCCL defines it (user guide, "In-place Operations"):
 * ncclReduceScatter(buf, buf + rank*count, count) and ncclAllGather(buf + rank*count, buf,
 * count), with ncclFloat32, or for the gather ncclFloat16 / ncclBfloat16 storage moved as is.
 * A half-wire reduce-scatter casts all n x count elements into the scratch, reduce-scatters
 * the scratch in place and casts back only the rank's own slice. Same events, same comm
 * stream, same flush as the all-reduce.
 *
 * Teardown (user guide, "Destroying a communicator"): ncclCommFinalize on every live
 * communicator of the group inside one ncclGroupStart/End, since this one thread finalizes
 * ranks whose pending work must progress together, then ncclCommDestroy on each. An aborted
 * rank keeps the abort path (ncclCommAbort already released it).
 *
 * Abort without a hang. A rank whose peer died waits forever on the device: the NCCL kernel
 * spins until the peer's data arrives. Three things keep the host out of that wait:
 *  1. The host never blocks in the driver: every wait of the CUDA context polls
 *     cudaStreamQuery (nmt__cuda_wait) and calls this rank's wait hook, which returns
 *     NMT_ERR_ABORTED once the group is aborted or the run's abort flag is raised, and
 *     NMT_ERR_DEVICE for an asynchronous NCCL error (ncclCommGetAsyncError) — the loop the NCCL
 *     user guide recommends in place of cudaStreamSynchronize ("Creating a Communicator",
 *     "Error handling and communicator destruction").
 *  2. nmt_comm_abort calls ncclCommAbort on every communicator: it sets NCCL's abort flag,
 *     which the device kernels poll, so they quit and the streams drain, and then frees the
 *     communicator (nccl.h: "Frees resources associated with communicator object and aborts
 *     any operations that might still be running on the device"; NCCL's src/init.cc sets the
 *     abort flags before anything else).
 *  3. Calls into NCCL never wait for a peer on the host: NCCL_RUNTIME_CONNECT=0 (set when
 *     NCCL is loaded unless the user chose otherwise) makes NCCL connect every transport during
 *     ncclCommInitAll / ncclCommInitRankConfig; with lazy connection the first large collective
 *     would exchange connection data with the peers inside ncclAllReduce. The multi-process
 *     communicators are nonblocking besides (below), so even such a wait would be a poll.
 * NCCL communicators are not thread-safe ("Thread Safety": operations on one communicator must
 * not be issued from two threads at once), and ncclCommAbort frees the communicator, so the
 * abort cannot simply run on the main thread while a worker is inside an NCCL call on the same
 * communicator. Each rank has a state word: the owner sets BUSY around each of its NCCL calls;
 * the aborter sets ABORT. Whoever sees the other's bit clear calls ncclCommAbort: the aborter
 * when the rank is not BUSY, else the owner right after its call returns (by 3., soon). Once
 * ABORT is set the owner never touches the communicator again. Exactly one thread calls
 * ncclCommAbort per communicator because each bit is set by one atomic read-modify-write whose
 * result tells the setter what the other side had done.
 *
 * Nonblocking (the communicators of nmt_comm_create_nccl_ranks; nccl.h, ncclConfig_t.blocking;
 * NCCL user guide, "Fault Tolerance"). ncclCommInitRank blocks until every process of the
 * clique has joined, deaf to any abort: a process that dies before (or during) init hangs the
 * others for good. With blocking = 0, ncclCommInitRankConfig returns at once and NCCL inits in
 * a thread of its own; ncclCommGetAsyncError says ncclInProgress until it is done, and
 * ncclCommAbort may be called at any point, init included. So creation polls it against the
 * run's abort flag and parallel.timeout_s and aborts on either. The price: ANY call on such a
 * communicator may return ncclInProgress (in NCCL 2.28 every group end on it, a single
 * collective included, hands the enqueue to a new thread), and until the state leaves
 * ncclInProgress nothing may be issued on the communicator, nor on the stream the operation
 * goes to (an event recorded there could precede NCCL's kernel). settle() is that wait, after
 * every call: collectives, the warm-up's ncclGroupEnd, ncclCommFinalize. It polls one
 * ncclCommGetAsyncError at a time with the right to use the communicator (enter/leave), so an
 * aborter can step in between two polls. ncclCommInitAll has no config variant and stays
 * blocking: its ranks are all in this process, there is no peer process to die.
 * The warm-up of either kind waits through the contexts' wait hooks, installed BEFORE it (a
 * peer that dies after its init must end the warm-up too), within parallel.timeout_s.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <new>

#include "nccl_comm.cuh"
#include "nmt/log.h"

namespace nmt__nccl {

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The absolute end of a wait of timeout_s from now; 0 (none) when timeout_s is 0. */
double deadline_after(double timeout_s) { return timeout_s > 0 ? now_s() + timeout_s : 0; }

/* Between two polls of NCCL's progress: yield at first (an enqueue handed to NCCL's thread
 * takes microseconds), then sleep 50 us (an init or a finalize takes up to seconds). */
void backoff(unsigned long i) {
  if (i < 1000) {
    sched_yield();
    return;
  }
  const timespec ts = {0, 50 * 1000};
  nanosleep(&ts, NULL);
}

/* The error of a wait on peers that passed parallel.timeout_s. */
nmt_status timed_out(const char *what, double timeout_s) {
  return nmt_errorf(NMT_ERR_ABORTED,
                    "%s: not done within parallel.timeout_s = %g s (a process of the NCCL "
                    "clique has not joined, has stalled or has died)",
                    what, timeout_s);
}

/* NCCL's description of e plus the communicator's last error message. Only with the right to
 * use r->comm (inside enter/leave), since the message is read from the communicator. */
void describe(const nccl_rank *r, ncclResult_t e, const char *call, char *out, size_t cap) {
  const char *last = r->g->api->GetLastError(r->comm);
  snprintf(out, cap, "NCCL error %d (%s) in %s on rank %d of %d (GPU %d)%s%s", (int)e,
           r->g->api->GetErrorString(e), call, r->base.rank, r->base.size, r->ctx->device,
           last && *last ? ": " : "", last ? last : "");
}

/* The one call that gives a communicator back: after it, nobody may use r->comm. */
void release(nccl_rank *r) {
  ncclResult_t e = r->g->api->CommAbort(r->comm);
  if (e != ncclSuccess)
    nmt_log(NMT_LOG_WARN, "ncclCommAbort on rank %d (GPU %d): %s", r->base.rank,
            r->ctx->device, r->g->api->GetErrorString(e));
  r->state.fetch_or(ST_RELEASED);
}

/* Ends the owner's right to use r->comm; if an abort arrived meanwhile, the aborter left the
 * communicator to us. */
void leave(nccl_rank *r) {
  if (r->state.fetch_and(~ST_BUSY) & ST_ABORT) release(r);
}

/* The owner's right to use r->comm for one NCCL call, or NMT_ERR_ABORTED. seq_cst RMWs on the
 * one state word: the aborter's fetch_or and ours are totally ordered, so each side learns
 * whether the other came first. */
nmt_status enter(nccl_rank *r) {
  if (r->state.fetch_or(ST_BUSY) & ST_ABORT) {
    /* The aborter saw us idle (or our previous leave() saw its bit): it is handled. */
    r->state.fetch_and(~ST_BUSY);
    return NMT_ERR_ABORTED;
  }
  if (group_aborted(r->g)) {
    leave(r);
    return NMT_ERR_ABORTED;
  }
  return NMT_OK;
}

void group_abort(nccl_group *g) {
  /* seq_cst: rare, and it orders whatever error the caller recorded before raising it. */
  g->abort->store(1);
  for (int i = 0; i < g->n; i++) {
    nccl_rank *r = &g->ranks[i];
    int prev = r->state.fetch_or(ST_ABORT);
    if (!(prev & (ST_ABORT | ST_BUSY))) release(r); /* first aborter, owner not in NCCL */
  }
}

/* The rank's health, from the rank's thread: NMT_ERR_ABORTED once the group is aborted,
 * NMT_ERR_DEVICE (and the group aborted) for an asynchronous NCCL error. */
nmt_status poll_rank(nccl_rank *r, const char *during) {
  NMT_TRY(enter(r));
  ncclResult_t async = ncclSuccess;
  ncclResult_t e = r->g->api->CommGetAsyncError(r->comm, &async);
  char msg[768];
  msg[0] = 0;
  if (e != ncclSuccess) {
    describe(r, e, "ncclCommGetAsyncError", msg, sizeof msg);
  } else if (async != ncclSuccess && async != ncclInProgress) {
    char call[96];
    snprintf(call, sizeof call, "a collective (asynchronous error, seen in %s)", during);
    describe(r, async, call, msg, sizeof msg);
  }
  leave(r);
  if (!msg[0]) return NMT_OK;
  /* The failed collective will never complete anywhere: stop every rank now. */
  group_abort(r->g);
  return nmt_errorf(NMT_ERR_DEVICE, "%s", msg);
}

/* The CUDA context's wait hook (nmt__cuda_wait): a wait on any of the rank's streams ends
 * when the group is aborted or NCCL reports an error, and during the warm-up at its
 * deadline. */
nmt_status wait_hook(void *arg) {
  nccl_rank *r = static_cast<nccl_rank *>(arg);
  if (r->g->warmup_deadline > 0 && now_s() > r->g->warmup_deadline)
    return timed_out("the NCCL warm-up all-reduce", r->g->timeout_s);
  return poll_rank(r, "a wait");
}

/* After r's NCCL call `call` returned ncclInProgress (a nonblocking communicator, see the top
 * of the file): polls ncclCommGetAsyncError, one call at a time with the right to use r->comm,
 * until the operation has left ncclInProgress, and puts its final result in *res (the
 * ncclCommGetAsyncError's own error if that call fails); an error is described into msg.
 * NMT_ERR_ABORTED once the group is aborted or past `deadline` (monotonic s, 0: none; the
 * message names parallel.timeout_s). */
nmt_status settle(nccl_rank *r, const char *call, double deadline, ncclResult_t *res, char *msg,
                  size_t cap) {
  const nmt__nccl_api *nc = r->g->api;
  for (unsigned long i = 0;; i++) {
    if (enter(r) != NMT_OK)
      return nmt_errorf(NMT_ERR_ABORTED, "%s on rank %d: the NCCL group was aborted", call,
                        r->base.rank);
    ncclResult_t state = ncclInProgress;
    const ncclResult_t q = nc->CommGetAsyncError(r->comm, &state);
    if (q != ncclSuccess) state = q;
    if (state != ncclSuccess && state != ncclInProgress)
      describe(r, state, q != ncclSuccess ? "ncclCommGetAsyncError" : call, msg, cap);
    leave(r);
    if (state != ncclInProgress) {
      *res = state;
      return NMT_OK;
    }
    if (deadline > 0 && now_s() > deadline) return timed_out(call, r->g->timeout_s);
    backoff(i);
  }
}

void free_group(nccl_group *g) {
  for (int i = 0; i < g->n; i++) {
    nccl_rank *r = &g->ranks[i];
    if (r->d_barrier) {
      (void)cudaSetDevice(r->ctx->device);
      cudaError_t e = cudaFree(r->d_barrier);
      if (e != cudaSuccess) nmt__cuda_error(e, "cudaFree (NCCL barrier word)", __FILE__, __LINE__);
    }
    if (r->d_wire) {
      (void)cudaSetDevice(r->ctx->device);
      cudaError_t e = cudaFree(r->d_wire);
      if (e != cudaSuccess) nmt__cuda_error(e, "cudaFree (NCCL half scratch)", __FILE__, __LINE__);
    }
  }
  delete[] g->ranks;
  delete g;
}

/* Gives back every communicator of g that nobody has given back: the one cleanup after a
 * failed creation or finalize, on a thread that holds no rank BUSY (a rank the wait hook
 * already aborted, with its group, is skipped). */
void release_rest(nccl_group *g) {
  for (int i = 0; i < g->n; i++) {
    nccl_rank *r = &g->ranks[i];
    if (!(r->state.fetch_or(ST_ABORT) & ST_ABORT)) release(r);
  }
}

namespace {

/* NCCL dereferences the buffer on the device: a host pointer (the host communicator's
 * convention) would be an illegal address fault in the kernel, reported much later. */
nmt_status check_device_buffer(const nccl_rank *r, const char *op, const void *buf) {
  cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, buf);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return nmt_errorf(NMT_ERR_INTERNAL, "%s on rank %d: cudaPointerGetAttributes(%p): %s", op,
                      r->base.rank, buf, cudaGetErrorString(e));
  }
  if ((a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) ||
      a.device != r->ctx->device)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "%s on rank %d: buffer %p is not device memory of GPU %d (memory type "
                      "%d on device %d); the NCCL communicator reduces device buffers",
                      op, r->base.rank, buf, r->ctx->device, (int)a.type,
                      a.device);
  return NMT_OK;
}

/* The start of every collective on buf: the rank's device current, buf checked, and the comm
 * stream made to wait for everything enqueued on the compute stream so far (the bucket's
 * gradients are final). */
nmt_status order_after_compute(nccl_rank *r, const char *op, const void *buf) {
  nmt_cuda_ctx *x = r->ctx;
  NMT_TRY(nmt__cuda_enter(x, op));
  NMT_TRY(check_device_buffer(r, op, buf));
  NMT_CUDA_TRY(cudaEventRecord(x->ev_compute, x->stream));
  NMT_CUDA_TRY(cudaStreamWaitEvent(x->comm_stream, x->ev_compute, 0));
  return NMT_OK;
}

/* One NCCL enqueue with the right to use r->comm: `f` makes the call; its error is described
 * with NCCL's last message. The rank has a collective pending until the next flush. */
template <typename F>
nmt_status issue(nccl_rank *r, const char *call, const char *op, size_t count, F f) {
  NMT_TRY(enter(r));
  ncclResult_t e = f();
  char msg[768];
  if (e != ncclSuccess && e != ncclInProgress) describe(r, e, call, msg, sizeof msg);
  leave(r);
  /* Nonblocking: enqueued only once settled; until then the comm stream must stay untouched
   * (a cast kernel, the flush's event) and so must the communicator. */
  if (e == ncclInProgress)
    NMT_TRY(settle(r, call, deadline_after(r->g->timeout_s), &e, msg, sizeof msg));
  if (e != ncclSuccess) return nmt_errorf(NMT_ERR_DEVICE, "%s of %zu elements: %s", op, count, msg);
  r->pending = 1;
  return NMT_OK;
}

bool rank_aborted(const nccl_rank *r) {
  return group_aborted(r->g) || (r->state.load() & ST_ABORT);
}

enum coll_kind { COLL_SUM, COLL_MAX, COLL_BCAST };

nmt_status enqueue(nmt_comm *c, float *buf, size_t count, coll_kind kind, int root) {
  static const char *const names[] = {"allreduce_sum", "allreduce_max", "broadcast"};
  const char *op = names[kind];
  nccl_rank *r = rank_of(c);
  nmt_cuda_ctx *x = r->ctx;
  const nmt__nccl_api *nc = r->g->api;
  if (rank_aborted(r)) return NMT_ERR_ABORTED;
  if (count == 0) return NMT_OK; /* every rank makes the same call, so every rank skips it */
  NMT_TRY(order_after_compute(r, op, buf));
  if (kind == COLL_BCAST)
    return issue(r, "ncclBroadcast", op, count, [&] {
      return nc->Broadcast(buf, buf, count, ncclFloat32, root, r->comm, x->comm_stream);
    });
  return issue(r, "ncclAllReduce", op, count, [&] {
    return nc->AllReduce(buf, buf, count, ncclFloat32, kind == COLL_SUM ? ncclSum : ncclMax,
                         r->comm, x->comm_stream);
  });
}

nmt_status nccl_allreduce_sum(nmt_comm *c, float *buf, size_t count) {
  return enqueue(c, buf, count, COLL_SUM, 0);
}

/* ---- half wire ---- */

__device__ __forceinline__ void store_wire(__half *p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_wire(__nv_bfloat16 *p, float v) {
  *p = __float2bfloat16_rn(v);
}
__device__ __forceinline__ float load_wire(__half v) { return __half2float(v); }
__device__ __forceinline__ float load_wire(__nv_bfloat16 v) { return __bfloat162float(v); }

/* wire[i] = w(buf[i]) (to_wire) or buf[i] = float(wire[i]), i < n; a grid-stride loop. */
template <typename H>
__global__ void cast_kernel(float *buf, H *wire, size_t n, bool to_wire) {
  const size_t step = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    if (to_wire) store_wire(&wire[i], buf[i]);
    else buf[i] = load_wire(wire[i]);
  }
}
NMT_CUDA_PRELOAD(cast_kernel<__half>);
NMT_CUDA_PRELOAD(cast_kernel<__nv_bfloat16>);

enum { CAST_THREADS = 256 };

nmt_status cast_on_comm_stream(nmt_cuda_ctx *x, nmt_grad_dtype wire, float *buf, void *scratch,
                               size_t n, bool to_wire) {
  const unsigned grid = nmt__grid(n, CAST_THREADS);
  if (wire == NMT_GRAD_BF16) {
    cast_kernel<<<grid, CAST_THREADS, 0, x->comm_stream>>>(
        buf, static_cast<__nv_bfloat16 *>(scratch), n, to_wire);
    NMT_CUDA_LAUNCH_CHECK("cast_kernel<bf16>");
  } else {
    cast_kernel<<<grid, CAST_THREADS, 0, x->comm_stream>>>(buf, static_cast<__half *>(scratch),
                                                           n, to_wire);
    NMT_CUDA_LAUNCH_CHECK("cast_kernel<fp16>");
  }
  return NMT_OK;
}

/* comm.c has checked wire (fp16 or bf16), buf and count <= the reservation. */
nmt_status nccl_allreduce_sum_as(nmt_comm *c, float *buf, size_t count, nmt_grad_dtype wire) {
  const char *op = wire == NMT_GRAD_BF16 ? "allreduce_sum_as(bfloat16)" : "allreduce_sum_as(half)";
  nccl_rank *r = rank_of(c);
  nmt_cuda_ctx *x = r->ctx;
  const nmt__nccl_api *nc = r->g->api;
  if (rank_aborted(r)) return NMT_ERR_ABORTED;
  if (count == 0) return NMT_OK; /* every rank makes the same call, so every rank skips it */
  if (count > r->wire_cap || !r->d_wire)
    return nmt_errorf(NMT_ERR_INTERNAL, "%s on rank %d: %zu elements, scratch for %zu", op,
                      r->base.rank, count, r->wire_cap);
  NMT_TRY(order_after_compute(r, op, buf));
  NMT_TRY(cast_on_comm_stream(x, wire, buf, r->d_wire, count, true));
  NMT_TRY(issue(r, "ncclAllReduce", op, count, [&] {
    return nc->AllReduce(r->d_wire, r->d_wire, count,
                         wire == NMT_GRAD_BF16 ? ncclBfloat16 : ncclFloat16, ncclSum, r->comm,
                         x->comm_stream);
  }));
  return cast_on_comm_stream(x, wire, buf, r->d_wire, count, false);
}

/* comm.c has checked wire, buf, that n x count does not overflow and, for a half wire, that
 * n x count <= the reservation. In place: NCCL's recvbuff is the rank's own slice of buf. */
nmt_status nccl_reduce_scatter_sum_as(nmt_comm *c, float *buf, size_t count,
                                      nmt_grad_dtype wire) {
  const char *op = wire == NMT_GRAD_BF16   ? "reduce_scatter_sum_as(bfloat16)"
                   : wire == NMT_GRAD_FP16 ? "reduce_scatter_sum_as(half)"
                                           : "reduce_scatter_sum_as(float)";
  nccl_rank *r = rank_of(c);
  nmt_cuda_ctx *x = r->ctx;
  const nmt__nccl_api *nc = r->g->api;
  if (rank_aborted(r)) return NMT_ERR_ABORTED;
  if (count == 0) return NMT_OK; /* every rank makes the same call, so every rank skips it */
  const size_t total = count * (size_t)r->base.size, mine = count * (size_t)r->base.rank;
  NMT_TRY(order_after_compute(r, op, buf));
  if (wire == NMT_GRAD_FP32)
    return issue(r, "ncclReduceScatter", op, count, [&] {
      return nc->ReduceScatter(buf, buf + mine, count, ncclFloat32, ncclSum, r->comm,
                               x->comm_stream);
    });
  if (total > r->wire_cap || !r->d_wire)
    return nmt_errorf(NMT_ERR_INTERNAL, "%s on rank %d: %zu elements, scratch for %zu", op,
                      r->base.rank, total, r->wire_cap);
  /* Every slice goes on the wire; only the owned one comes back (2-byte elements). */
  char *scratch = static_cast<char *>(r->d_wire), *own = scratch + 2 * mine;
  NMT_TRY(cast_on_comm_stream(x, wire, buf, scratch, total, true));
  NMT_TRY(issue(r, "ncclReduceScatter", op, count, [&] {
    return nc->ReduceScatter(scratch, own, count,
                             wire == NMT_GRAD_BF16 ? ncclBfloat16 : ncclFloat16, ncclSum,
                             r->comm, x->comm_stream);
  }));
  return cast_on_comm_stream(x, wire, buf + mine, own, count, false);
}

/* In place: NCCL's sendbuff is the rank's own slice of buf; 16-bit storage travels as the
 * NCCL type of the same width, bit for bit (a gather does no arithmetic). */
nmt_status nccl_all_gather(nmt_comm *c, void *buf, size_t count, nmt_grad_dtype dtype) {
  const char *op = dtype == NMT_GRAD_BF16   ? "all_gather(bfloat16)"
                   : dtype == NMT_GRAD_FP16 ? "all_gather(half)"
                                            : "all_gather(float)";
  const ncclDataType_t type = dtype == NMT_GRAD_BF16   ? ncclBfloat16
                              : dtype == NMT_GRAD_FP16 ? ncclFloat16
                                                       : ncclFloat32;
  nccl_rank *r = rank_of(c);
  nmt_cuda_ctx *x = r->ctx;
  const nmt__nccl_api *nc = r->g->api;
  if (rank_aborted(r)) return NMT_ERR_ABORTED;
  if (count == 0) return NMT_OK;
  const size_t esz = dtype == NMT_GRAD_FP32 ? 4 : 2;
  char *own = static_cast<char *>(buf) + esz * count * (size_t)r->base.rank;
  NMT_TRY(order_after_compute(r, op, buf));
  return issue(r, "ncclAllGather", op, count, [&] {
    return nc->AllGather(own, buf, count, type, r->comm, x->comm_stream);
  });
}

/* Grows the rank's half scratch to max_count elements (comm.c calls it only to grow). */
nmt_status nccl_reserve(nmt_comm *c, size_t max_count) {
  nccl_rank *r = rank_of(c);
  nmt_cuda_ctx *x = r->ctx;
  if (rank_aborted(r)) return NMT_ERR_ABORTED;
  if (max_count <= r->wire_cap) return NMT_OK;
  if (max_count > SIZE_MAX / 2)
    return nmt_errorf(NMT_ERR_INTERNAL, "reserve on rank %d: %zu elements", r->base.rank,
                      max_count);
  NMT_TRY(nmt__cuda_enter(x, "reserve"));
  if (r->d_wire) {
    /* cudaFree waits for the device, so a collective still reading the old scratch ends
     * first (and the contract keeps this call out of the step). */
    void *old = r->d_wire;
    r->d_wire = NULL;
    r->wire_cap = 0;
    NMT_CUDA_TRY(cudaFree(old));
  }
  void *p = NULL;
  NMT_CUDA_TRY(cudaMalloc(&p, max_count * 2));
  r->d_wire = p;
  r->wire_cap = max_count;
  return NMT_OK;
}

nmt_status nccl_allreduce_max(nmt_comm *c, float *buf, size_t count) {
  return enqueue(c, buf, count, COLL_MAX, 0);
}

nmt_status nccl_broadcast(nmt_comm *c, float *buf, size_t count, int root) {
  return enqueue(c, buf, count, COLL_BCAST, root);
}

nmt_status nccl_flush(nmt_comm *c) {
  nccl_rank *r = rank_of(c);
  nmt_cuda_ctx *x = r->ctx;
  /* An aborted collective's results are incomplete: say so rather than order work after it. */
  if (rank_aborted(r)) return NMT_ERR_ABORTED;
  if (r->pending) {
    NMT_TRY(nmt__cuda_enter(x, "flush"));
    NMT_CUDA_TRY(cudaEventRecord(x->ev_comm, x->comm_stream));
    NMT_CUDA_TRY(cudaStreamWaitEvent(x->stream, x->ev_comm, 0));
    r->pending = 0;
  }
  return poll_rank(r, "flush");
}

nmt_status nccl_barrier(nmt_comm *c) {
  nccl_rank *r = rank_of(c);
  nmt_cuda_ctx *x = r->ctx;
  const nmt__nccl_api *nc = r->g->api;
  if (rank_aborted(r)) return NMT_ERR_ABORTED;
  NMT_TRY(nmt__cuda_enter(x, "barrier"));
  /* max of zeros stays zero, however many barriers run (a sum of ones would grow to inf). */
  NMT_TRY(issue(r, "ncclAllReduce (barrier)", "barrier", 1, [&] {
    return nc->AllReduce(r->d_barrier, r->d_barrier, 1, ncclFloat32, ncclMax, r->comm,
                         x->comm_stream);
  }));
  /* A rank's allreduce completes only when every rank has joined it. The wait polls the hook
   * (abort, asynchronous errors) like every wait of the context. */
  NMT_TRY(nmt__cuda_wait(x, x->comm_stream, "barrier"));
  /* The comm stream is idle and the host saw it: work enqueued from now on comes after every
   * earlier collective without a flush. */
  r->pending = 0;
  return NMT_OK;
}

void nccl_abort(nmt_comm *c) { group_abort(rank_of(c)->g); }

/* Finalizes the live communicators together, then destroys them (see the top of the file).
 * Nonblocking ones return ncclInProgress from ncclCommFinalize / ncclGroupEnd: each is then
 * settled (its finalize waits for its enqueued collectives) within parallel.timeout_s before
 * ncclCommDestroy. A failed or unfinished finalize leaves their state unknown: abort them
 * instead, which never waits. */
void finalize_and_destroy(nccl_group *g, nccl_rank **live, int n_live) {
  const nmt__nccl_api *nc = g->api;
  ncclResult_t first = nc->GroupStart();
  const int started = first == ncclSuccess;
  int bad = started ? -1 : 0;
  for (int i = 0; first == ncclSuccess && i < n_live; i++) {
    ncclResult_t e = nc->CommFinalize(live[i]->comm);
    if (e != ncclSuccess && e != ncclInProgress) first = e, bad = i;
  }
  /* Only a group that started is ended (ending another is a usage error of its own). */
  ncclResult_t end = started ? nc->GroupEnd() : ncclSuccess;
  if (first == ncclSuccess && end != ncclSuccess && end != ncclInProgress) first = end, bad = 0;
  char msg[768];
  if (first != ncclSuccess) {
    describe(live[bad], first, "ncclCommFinalize (ncclGroupEnd)", msg, sizeof msg);
    nmt_log(NMT_LOG_WARN, "%s; aborting the group's communicators instead", msg);
    release_rest(g);
    return;
  }
  /* A blocking communicator is finalized here; asking a nonblocking one costs one poll. */
  const double deadline = deadline_after(g->timeout_s);
  for (int i = 0; i < n_live; i++) {
    ncclResult_t res = ncclSuccess;
    const nmt_status st = settle(live[i], "ncclCommFinalize", deadline, &res, msg, sizeof msg);
    if (st != NMT_OK || res != ncclSuccess) {
      nmt_log(NMT_LOG_WARN, "%s; aborting the group's communicators instead",
              st != NMT_OK ? nmt_last_error() : msg);
      release_rest(g);
      return;
    }
  }
  for (int i = 0; i < n_live; i++) {
    nccl_rank *r = live[i];
    ncclResult_t e = nc->CommDestroy(r->comm);
    /* ncclInProgress: a nonblocking communicator frees the rest in NCCL's own time. */
    if (e != ncclSuccess && e != ncclInProgress)
      nmt_log(NMT_LOG_WARN, "ncclCommDestroy on rank %d (GPU %d): %s", r->base.rank,
              r->ctx->device, nc->GetErrorString(e));
  }
}

void nccl_destroy(nmt_comm **comms, int n) {
  (void)n; /* all handles live in the one group */
  nccl_group *g = rank_of(comms[0])->g;
  nccl_rank **live = new (std::nothrow) nccl_rank *[g->n];
  int n_live = 0;
  for (int i = 0; i < g->n; i++) {
    nmt_cuda_ctx *x = g->ranks[i].ctx;
    x->wait_hook = NULL;
    x->wait_arg = NULL;
  }
  for (int i = 0; i < g->n; i++) {
    nccl_rank *r = &g->ranks[i];
    int st = r->state.load();
    if (st & ST_RELEASED) continue;
    if ((st & ST_ABORT) || !live) {
      release(r); /* marked but never given back (an aborter raced the join), or no memory */
      continue;
    }
    live[n_live++] = r;
  }
  if (n_live) finalize_and_destroy(g, live, n_live);
  delete[] live;
  free_group(g);
}

} // namespace

const nmt_comm_ops nccl_ops = {
    .name = "nccl",
    .allreduce_sum = nccl_allreduce_sum,
    .allreduce_sum_as = nccl_allreduce_sum_as,
    .reserve = nccl_reserve,
    .allreduce_max = nccl_allreduce_max,
    .reduce_scatter_sum_as = nccl_reduce_scatter_sum_as,
    .all_gather = nccl_all_gather,
    .broadcast = nccl_broadcast,
    .barrier = nccl_barrier,
    .reserve_staging = NULL, /* stages nothing */
    .flush = nccl_flush,
    .abort = nccl_abort,
    .destroy = nccl_destroy,
};

} // namespace nmt__nccl
