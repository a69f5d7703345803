/* cuda/nccl.cu — the NCCL communicator (include/nmt/comm.h): one rank per GPU, all in this
 * process, created at once by ncclCommInitAll, or this process's ranks of a clique spanning
 * several processes (ncclCommInitRank through a unique id). NCCL itself is reached through the
 * table of cuda/nccl_lib.cuh (dlopen on first use; nmt does not link libnccl).
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
 *     ncclCommInitAll / ncclCommInitRank; with lazy connection the first large collective would exchange
 *     connection data with the peers inside ncclAllReduce.
 * NCCL communicators are not thread-safe ("Thread Safety": operations on one communicator must
 * not be issued from two threads at once), and ncclCommAbort frees the communicator, so the
 * abort cannot simply run on the main thread while a worker is inside an NCCL call on the same
 * communicator. Each rank has a state word: the owner sets BUSY around each of its NCCL calls;
 * the aborter sets ABORT. Whoever sees the other's bit clear calls ncclCommAbort: the aborter
 * when the rank is not BUSY, else the owner right after its call returns (by 3., soon). Once
 * ABORT is set the owner never touches the communicator again. Exactly one thread calls
 * ncclCommAbort per communicator because each bit is set by one atomic read-modify-write whose
 * result tells the setter what the other side had done.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <new>

#include "../src/comm/comm_impl.h"
#include "common.cuh"
#include "nccl_lib.cuh"
#include "nmt/log.h"

static_assert(sizeof(ncclUniqueId) == NMT_COMM_NCCL_ID_BYTES,
              "NMT_COMM_NCCL_ID_BYTES (nmt/comm.h) must match nccl.h's NCCL_UNIQUE_ID_BYTES");

namespace {

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
  std::atomic<int> state; /* ST_* bits, see the top of the file */
};

struct nccl_group {
  const nmt__nccl_api *api; /* the process's NCCL (nccl_lib.cuh) */
  std::atomic<int> own_abort;
  std::atomic<int> *abort; /* the run's flag, or &own_abort */
  int n;
  nccl_rank *ranks;
};

nccl_rank *rank_of(nmt_comm *c) { return reinterpret_cast<nccl_rank *>(c); }

/* Relaxed: the flag guards no data, it only stops work (as in src/comm/host.c). */
bool group_aborted(const nccl_group *g) { return g->abort->load(std::memory_order_relaxed) != 0; }

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
 * when the group is aborted or NCCL reports an error. */
nmt_status wait_hook(void *arg) { return poll_rank(static_cast<nccl_rank *>(arg), "a wait"); }

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
  if (e != ncclSuccess) describe(r, e, call, msg, sizeof msg);
  leave(r);
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

/* Finalizes the live communicators together, then destroys them (see the top of the file).
 * A failed finalize leaves their state unknown: abort them instead, which never waits. */
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
  if (first == ncclSuccess && end != ncclSuccess) first = end, bad = 0;
  if (first != ncclSuccess) {
    char msg[768];
    describe(live[bad], first, "ncclCommFinalize (ncclGroupEnd)", msg, sizeof msg);
    nmt_log(NMT_LOG_WARN, "%s; aborting the group's communicators instead", msg);
    for (int i = 0; i < n_live; i++) release(live[i]);
    return;
  }
  for (int i = 0; i < n_live; i++) {
    nccl_rank *r = live[i];
    ncclResult_t e = nc->CommDestroy(r->comm);
    if (e != ncclSuccess)
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
    .flush = nccl_flush,
    .abort = nccl_abort,
    .destroy = nccl_destroy,
};

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
 * collectives), then waits for it: a group that cannot communicate fails here, at creation. */
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
    if (e != ncclSuccess && first == ncclSuccess) first = e, bad = i;
  }
  e = nc->GroupEnd();
  if (first == ncclSuccess && e != ncclSuccess) first = e, bad = 0;
  if (first != ncclSuccess) {
    char msg[768];
    describe(&g->ranks[bad], first, "the warm-up ncclAllReduce (ncclGroupEnd)", msg, sizeof msg);
    return nmt_errorf(NMT_ERR_DEVICE, "%s", msg);
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
nmt_status new_group(const nmt__nccl_api *api, int n, atomic_int *abort, nccl_group **out) {
  nccl_group *g = new (std::nothrow) nccl_group();
  if (g) g->ranks = new (std::nothrow) nccl_rank[n]();
  if (!g || !g->ranks) {
    delete g;
    return nmt_errorf(NMT_ERR_NOMEM, "NCCL communicator: cannot allocate %d ranks", n);
  }
  g->api = api;
  g->abort = abort ? abort : &g->own_abort;
  g->n = n;
  *out = g;
  return NMT_OK;
}

/* Binds the n created communicators nc[] to their ranks (global rank first_rank + i of
 * world), warms the group up and hooks the contexts' waits. On failure aborts every
 * communicator and frees the group. */
nmt_status finish_group(nccl_group *g, ncclComm_t *nc, void *const *cuda_ctxs, int world,
                        int first_rank, nmt_comm **comms) {
  for (int i = 0; i < g->n; i++) {
    nccl_rank *r = &g->ranks[i];
    r->base.ops = &nccl_ops;
    r->base.rank = first_rank + i;
    r->base.size = world;
    r->base.wire_reserved = 0;
    r->g = g;
    r->comm = nc[i];
    r->ctx = nmt__cuda_ctx(cuda_ctxs[i]);
  }
  nmt_status s = warm_up(g);
  if (s != NMT_OK) {
    /* Abort, not destroy: destroy would wait for a warm-up that may never complete. */
    for (int i = 0; i < g->n; i++) release(&g->ranks[i]);
    free_group(g);
    return s;
  }
  for (int i = 0; i < g->n; i++) {
    nccl_rank *r = &g->ranks[i];
    r->ctx->wait_hook = wait_hook;
    r->ctx->wait_arg = r;
    comms[i] = &r->base;
  }
  const char *rc = getenv("NCCL_RUNTIME_CONNECT");
  nmt_log(NMT_LOG_INFO, "NCCL %d: communicator over %d GPU(s) of this process, global ranks "
          "%d..%d of %d, NCCL_RUNTIME_CONNECT=%s", g->api->version, g->n, first_rank,
          first_rank + g->n - 1, world, rc ? rc : "(unset)");
  return NMT_OK;
}

/* Aborts the communicators that exist after a failed creation (never waits). */
void abort_created(const nmt__nccl_api *nc, ncclComm_t *comms, int n) {
  for (int i = 0; i < n; i++)
    if (comms[i]) (void)nc->CommAbort(comms[i]);
}

/* The part of both creations after the checks: load NCCL, make the group, init the
 * communicators (`init` fills nc[] and returns NCCL's verdict, describing a failure into msg),
 * finish. `what` names the request for the loader's message. */
template <typename Init>
nmt_status create_group(const char *what, int n, void *const *cuda_ctxs, int world,
                        int first_rank, atomic_int *abort, nmt_comm **comms, Init init) {
  const nmt__nccl_api *api = NULL;
  NMT_TRY(nmt__nccl_open(what, &api));
  int prev_device = -1;
  (void)cudaGetDevice(&prev_device);
  nccl_group *g = NULL;
  NMT_TRY(new_group(api, n, abort, &g));
  ncclComm_t *nc = new (std::nothrow) ncclComm_t[n]();
  if (!nc) {
    free_group(g);
    return nmt_errorf(NMT_ERR_NOMEM, "NCCL communicator: cannot allocate %d handles", n);
  }
  char msg[1024] = "";
  nmt_status s = init(api, nc, msg, sizeof msg) ? NMT_OK : NMT_ERR_DEVICE;
  if (s != NMT_OK) {
    abort_created(api, nc, n);
    free_group(g);
    s = nmt_errorf(NMT_ERR_DEVICE, "%s", msg);
  } else {
    s = finish_group(g, nc, cuda_ctxs, world, first_rank, comms);
  }
  delete[] nc;
  if (prev_device >= 0) (void)cudaSetDevice(prev_device);
  return s;
}

/* NCCL's verdict with its last message, for a failed creation. */
void init_error(const nmt__nccl_api *nc, ncclResult_t e, const char *head, char *msg,
                size_t cap) {
  const char *last = nc->GetLastError(NULL);
  snprintf(msg, cap, "%s: NCCL error %d (%s)%s%s", head, (int)e, nc->GetErrorString(e),
           last && *last ? ": " : "", last ? last : "");
}

} // namespace

nmt_status nmt_comm_create_nccl(int n, const int *devices, void *const *cuda_ctxs,
                                atomic_int *abort, nmt_comm **comms) {
  NMT_TRY(check_args(n, devices, cuda_ctxs, comms));
  char list[256], what[320];
  device_list(devices, n, list, sizeof list);
  snprintf(what, sizeof what, "NCCL communicator over %d GPU(s) %s", n, list);
  return create_group(what, n, cuda_ctxs, n, 0, abort, comms,
                      [&](const nmt__nccl_api *nc, ncclComm_t *out, char *msg, size_t cap) {
                        ncclResult_t e = nc->CommInitAll(out, n, devices);
                        if (e == ncclSuccess) return true;
                        char head[320];
                        snprintf(head, sizeof head, "ncclCommInitAll over %d GPU(s) %s", n, list);
                        init_error(nc, e, head, msg, cap);
                        return false;
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
  if (e != ncclSuccess) {
    char msg[768];
    init_error(nc, e, "ncclGetUniqueId", msg, sizeof msg);
    return nmt_errorf(NMT_ERR_DEVICE, "%s", msg);
  }
  memcpy(out, &id, sizeof id);
  return NMT_OK;
}

nmt_status nmt_comm_create_nccl_ranks(int n_local, const int *devices, void *const *cuda_ctxs,
                                      int world, int first_rank, const void *unique_id,
                                      atomic_int *abort, nmt_comm **comms) {
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
  return create_group(what, n_local, cuda_ctxs, world, first_rank, abort, comms,
                      [&](const nmt__nccl_api *nc, ncclComm_t *out, char *msg, size_t cap) {
                        /* Every device is checked before any init is queued: ending a group
                         * that holds some ranks' inits would wait for the whole world, which
                         * the missing local rank never joins. */
                        for (int i = 0; i < n_local; i++) {
                          cudaError_t ce = cudaSetDevice(devices[i]);
                          if (ce != cudaSuccess) {
                            snprintf(msg, cap, "cudaSetDevice(%d) before ncclCommInitRank: %s",
                                     devices[i], cudaGetErrorString(ce));
                            return false;
                          }
                        }
                        /* One thread, several ranks: grouped, or the first init would wait for
                         * the others forever (user guide, "Group Calls"). */
                        ncclResult_t first = nc->GroupStart();
                        const int started = first == ncclSuccess;
                        int bad = 0;
                        for (int i = 0; first == ncclSuccess && i < n_local; i++) {
                          (void)cudaSetDevice(devices[i]); /* succeeded above */
                          ncclResult_t e = nc->CommInitRank(&out[i], world, id, first_rank + i);
                          if (e != ncclSuccess) first = e, bad = i;
                        }
                        ncclResult_t end = started ? nc->GroupEnd() : ncclSuccess;
                        if (first == ncclSuccess) first = end;
                        if (first == ncclSuccess) return true;
                        char head[384];
                        snprintf(head, sizeof head, "ncclCommInitRank (GPU %d as global rank %d "
                                 "of %d, in a group of %d local rank(s))", devices[bad],
                                 first_rank + bad, world, n_local);
                        init_error(nc, first, head, msg, cap);
                        return false;
                      });
}
