/* nmt/comm.h — collectives between the ranks of a run (one rank per worker thread; Gloo's
 * ranks may live in several processes).
 *
 * An nmt_comm is one rank's handle; a group of them is created at once by the main thread
 * (as ncclCommInitAll does) before any worker starts; an NCCL group may also be this process's
 * share of a clique spanning several processes (nmt_comm_create_nccl_ranks). Every rank must
 * call the same collectives in the same order with the same counts. Implementations: host
 * (shared memory between CPU worker threads, src/comm/host.c), NCCL (one rank per GPU,
 * cuda/nccl.cu, with libnccl.so.2 loaded on demand by cuda/nccl_lib.cu; src/comm/nccl_none.c
 * stands in for both in a CPU-only build) and Gloo (CPU workers in several processes,
 * src/comm/gloo.cc; the block at the end).
 *
 * Host implementation: each collective publishes the rank's buffer pointer, meets the others
 * at a spinning barrier (C11 atomics, sched_yield; no mutex), and rank r reduces slice r of
 * every buffer in rank order 0..n-1, so every rank gets bitwise the same result and the result
 * does not depend on thread timing. A raised abort flag makes every waiting rank return
 * NMT_ERR_ABORTED instead of hanging. Collectives are synchronous: the result is in the
 * buffer when the call returns, and nmt_comm_flush has nothing to do.
 *
 * NCCL implementation: buffers are DEVICE memory of the rank's GPU (fp32, or 16-bit storage
 * for all_gather), and allreduce_sum(_as) / allreduce_max / broadcast / reduce_scatter_sum_as /
 * all_gather are ASYNCHRONOUS enqueues. Each one records an event on the rank's compute stream
 * (the CUDA context's stream, on which the backward pass that wrote the buffer was enqueued),
 * makes the context's comm stream wait for it (so the bucket's gradients are final before NCCL
 * reads them), enqueues the in-place ncclAllReduce / ncclBroadcast / ncclReduceScatter /
 * ncclAllGather on the comm stream and returns at once: the reduction of bucket b overlaps
 * the rest of backward on the compute stream. The results are visible to work enqueued on the
 * compute stream only after nmt_comm_flush, and to the host only after a flush followed by a
 * wait on that stream (the CUDA backend's copy_d2h or synchronize). Until then neither the
 * host nor later compute work may read or write a buffer passed to a collective. barrier is
 * an ncclAllReduce of one float followed by a wait for the comm stream, so it does block.
 * Every host-side wait of the CUDA backend polls instead of blocking (see nmt/cuda.h): it
 * gives up with NMT_ERR_ABORTED once the group is aborted or the run's abort flag is raised,
 * and it reports an NCCL asynchronous error (ncclCommGetAsyncError) as NMT_ERR_DEVICE, so a
 * peer that died never leaves a rank waiting forever on its stream.
 *
 * Half-precision wire (parallel.grad_dtype = fp16 | bf16; docs/cuda.md, NCCL communicator,
 * "Gradient reduction in half precision"):
 * nmt_comm_allreduce_sum_as reduces fp32 buffers through fp16 or bf16 copies, so half the bytes
 * cross the links. Each rank's values are rounded to the wire type, summed IN the wire type
 * (every addition rounded, as a ring reduce in half does) and converted back to fp32. NCCL
 * needs a half scratch buffer per rank, sized once at setup by nmt_comm_reserve; the host
 * communicator checks the same reservation, so a missing one fails on CPU workers too.
 *
 * defines: nmt_comm, nmt_comm_create_host, nmt_comm_create_nccl, nmt_comm_create_nccl_ranks,
 *          nmt_comm_nccl_unique_id,
 *          NMT_COMM_NCCL_ID_BYTES, nmt_comm_allreduce_sum,
 *          nmt_comm_allreduce_sum_as, nmt_comm_reserve, nmt_comm_wire_size,
 *          nmt_comm_wire_name, nmt_comm_allreduce_max, nmt_comm_broadcast, nmt_comm_barrier,
 *          nmt_comm_flush, nmt_comm_rank, nmt_comm_size, nmt_comm_abort, nmt_comm_destroy,
 *          nmt_comm_reduce_scatter_sum_as, nmt_comm_all_gather, nmt_gloo_options,
 *          nmt_comm_create_gloo, nmt_comm_create_staged, nmt_comm_reserve_staging,
 *          nmt_comm_name
 */
#ifndef NMT_COMM_H
#define NMT_COMM_H

#include <stddef.h>

#include "nmt/atomic.h" /* atomic_int in C and C++ */

#include "nmt/status.h"
#include "nmt/types.h" /* nmt_grad_dtype */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nmt_comm nmt_comm;

/* Creates n host communicators sharing one group; comms[r] is rank r's. `abort` (may be
 * NULL) is the run's shared abort flag, polled while waiting. Errors: NMT_ERR_NOMEM,
 * NMT_ERR_INTERNAL (n < 1). */
nmt_status nmt_comm_create_host(int n, atomic_int *abort, nmt_comm **comms);

struct nmt_backend; /* nmt/backend.h */

/* The host-staged communicator (src/comm/staged.c; docs/cuda.md "Several workers on one GPU"):
 * n ranks of one process whose buffers are memory of backend `be` (rank r's on context
 * ctxs[r]; device memory on a GPU), reduced by a host communicator group
 * (nmt_comm_create_host) through pinned host copies. NCCL refuses two ranks on one GPU
 * ("Duplicate GPU detected"); this group takes any number of workers on any devices, one GPU
 * included, so the multi-GPU engine (per-worker streams, buckets launched from grad-ready
 * events, accumulation without sync, ZeRO) runs on a one-GPU machine. It is for tests and for
 * machines without NCCL, not for speed.
 * Asynchronous like NCCL, with the same contract (device buffers, results visible after
 * nmt_comm_flush): each collective copies its buffer device -> host on the context's comm
 * stream after everything issued on the compute stream (be->comm_d2h: an event there, waited
 * for by the comm stream), records the collective as pending and returns at once, so the copy
 * of bucket b overlaps the rest of backward. nmt_comm_flush then, in the rank's own thread:
 * waits for the comm stream (be->comm_wait: polls, honouring the abort flag), runs the pending
 * host collectives in issue order on the staged copies, enqueues the results' copies host ->
 * device on the comm stream (be->comm_h2d) and makes the compute stream wait for them
 * (be->comm_join); it returns without waiting for those copies. The sums are the host
 * communicator's (slice r on rank r, ranks in order 0..n-1; half wires rounded as
 * nmt_comm_allreduce_sum_as says): bitwise the host communicator's results on the same
 * values, whatever the backend. barrier flushes, then meets the peers on the host.
 * Staging: pinned host memory (be->host_alloc) per rank, sized by nmt_comm_reserve_staging
 * at setup (never in the step: cudaHostAlloc and cudaFreeHost synchronize the device). The
 * collectives between two flushes share it, each buffer at its own offset; one that would not
 * fit behind the pending ones first runs those (a flush without the join), so a small
 * reservation costs overlap, not correctness; one larger than the whole reservation is an
 * error. Costs, per collective: one device -> host and one host -> device copy of the buffer
 * (reduce-scatter: n x count elements down, count back; all-gather: count down, n x count
 * back), the host reduction (memory bound, one thread per rank), and the flush's wait: the
 * worker's host thread waits there until backward has finished on its device, so the host's
 * enqueueing of the optimizer no longer runs ahead of the device.
 * ctxs: one context per rank (may be NULL when be->is_host; a ref context or NULL then).
 * `abort` (may be NULL): the run's abort flag, polled by the host collectives (register it
 * with each context too, be->set_abort, so that comm_wait sees it); nmt_comm_abort raises it.
 * Errors: NMT_ERR_INTERNAL (n < 1, NULL be or comms, a backend without the comm_* entries,
 * NULL ctxs for a device backend), NMT_ERR_NOMEM. */
nmt_status nmt_comm_create_staged(int n, const struct nmt_backend *be, void *const *ctxs,
                                  atomic_int *abort, nmt_comm **comms);

/* Makes room for max_bytes of buffers handed to collectives between two flushes on this rank
 * (the all-reduce's whole buffer; a reduce-scatter's or all-gather's n x count elements), so
 * that the host-staged communicator allocates its pinned staging here, at setup, instead of
 * in the step. Monotonic: a max_bytes at or below the current reservation changes nothing.
 * Call it from the main thread before the workers start, or from the rank's own thread with
 * no collective pending. Every other communicator ignores it. Errors: NMT_ERR_NOMEM
 * (host-staged: pinned memory), NMT_ERR_INTERNAL (collectives pending). */
nmt_status nmt_comm_reserve_staging(nmt_comm *c, size_t max_bytes);

/* The implementation's name, for logs: "host", "nccl", "host-staged" or "gloo". */
const char *nmt_comm_name(const nmt_comm *c);

/* Creates the NCCL group of n ranks, one per GPU, in this process: ncclCommInitAll over
 * devices[0..n-1] (rank r on devices[r]; the devices must be distinct), then one warm-up
 * ncclAllReduce on every rank (in one group call) so that a broken setup fails here rather
 * than in the first step. ncclCommInitAll stays blocking (NCCL has no config variant of
 * it; its ranks are all this process's, so no peer process can die during it); the warm-up
 * already waits through the contexts' wait hooks. Rank r is bound to cuda_ctxs[r] (a context
 * from nmt_cuda_ctx_create(devices[r], ...)): its collectives use that context's compute
 * stream, comm stream and events, and the context's host waits start polling the group
 * (abort and NCCL asynchronous errors) before the warm-up. Call it on the main thread after
 * every worker's context exists and before any worker starts. `abort` (may be NULL) is the
 * run's shared abort flag: once raised, collectives and waits return NMT_ERR_ABORTED.
 * Unless the environment already sets it, NCCL_RUNTIME_CONNECT=0 is set before the first
 * NCCL call of the process, so that NCCL connects every transport at init: with NCCL's lazy
 * connection (the default since 2.22) the first large collective would exchange connection
 * data with the peers on the host, inside ncclAllReduce, and hang there if a peer had died.
 * The group must be destroyed (nmt_comm_destroy) BEFORE the contexts it is bound to.
 * NCCL is not linked into nmt: the first call of this function (or of
 * nmt_comm_create_nccl_ranks, nmt_comm_nccl_unique_id) dlopen()s libnccl.so.2 (>= 2.14), so a
 * one-GPU run, which uses the host communicator, starts where NCCL is not installed.
 * Errors: NMT_ERR_DEVICE naming the NCCL or CUDA call with NCCL's error string
 * (ncclGetErrorString, ncclGetLastError), or naming libnccl.so.2 with dlerror()'s text when
 * the library cannot be loaded, also in a build without CUDA/NCCL ("built without
 * CUDA/NCCL"); NMT_ERR_INTERNAL for bad arguments (n < 1, NULL pointers, a context on another
 * device than devices[r], a device listed twice), checked before NCCL is loaded;
 * NMT_ERR_NOMEM. */
nmt_status nmt_comm_create_nccl(int n, const int *devices, void *const *cuda_ctxs,
                                atomic_int *abort, nmt_comm **comms);

/* Bytes of an NCCL unique id (nccl.h's NCCL_UNIQUE_ID_BYTES; cuda/nccl.cu checks they agree),
 * so that code which never includes nccl.h can size the buffer it publishes. */
#define NMT_COMM_NCCL_ID_BYTES 128

/* Several processes (issue 18, one per node): the id that names one NCCL clique. Global rank
 * 0's process calls this (ncclGetUniqueId, which also starts NCCL's bootstrap listener in this
 * process, so the process must live until the group is created), writes the
 * NMT_COMM_NCCL_ID_BYTES bytes into out and publishes them to every other process (the
 * engine's rendezvous store); every process, this one included, then passes the same bytes to
 * nmt_comm_create_nccl_ranks. The bytes are opaque (they hold the root's address).
 * Errors: NMT_ERR_INTERNAL for a NULL out or cap < NMT_COMM_NCCL_ID_BYTES; NMT_ERR_DEVICE when
 * NCCL cannot be loaded or ncclGetUniqueId fails (message with NCCL's text), or in a build
 * without CUDA/NCCL. */
nmt_status nmt_comm_nccl_unique_id(void *out, size_t cap);

/* Creates this process's n_local ranks of an NCCL clique of `world` ranks spread over several
 * processes: local rank i is global rank first_rank + i on devices[i], bound to cuda_ctxs[i]
 * as in nmt_comm_create_nccl. The communicators are NONBLOCKING (ncclConfig_t.blocking = 0,
 * NCCL >= 2.14): ncclCommInitRankConfig(world, id, first_rank + i) for every local GPU inside
 * one ncclGroupStart/End (NCCL user guide, "Group Calls": one thread initialising several
 * ranks must group the calls, or the first would wait for the others forever), which returns
 * at once; then ncclCommGetAsyncError is polled on each until it leaves ncclInProgress (user
 * guide, "Fault Tolerance"). That wait, which lasts until every process of the clique has
 * joined, ends with NMT_ERR_ABORTED once `abort` is raised or timeout_s has passed (the
 * message names parallel.timeout_s), after ncclCommAbort on every local communicator, so a
 * process that never arrives or dies during init cannot hang this one. Then the contexts'
 * wait hooks are installed (abort flag, ncclCommGetAsyncError) and the warm-up all-reduce
 * (grouped) is waited for through them, again within timeout_s: a peer dying after its init
 * ends the warm-up too. Every later NCCL call on these communicators may return
 * ncclInProgress (NCCL then works in a thread of its own): each is polled the same way before
 * anything else is issued on the communicator or its stream (cuda/nccl.cu, "Nonblocking").
 * nmt_comm_rank gives the GLOBAL rank (first_rank + i) and nmt_comm_size gives world: ZeRO's
 * slices and the collectives' in-place offsets are global. With world == n_local and
 * first_rank == 0 it is the single-process group again, created through the id (the
 * degenerate case of one node). Everything else (streams, events, abort, destroy) is as for
 * nmt_comm_create_nccl. unique_id: NMT_COMM_NCCL_ID_BYTES bytes from
 * nmt_comm_nccl_unique_id, the same in every process. timeout_s: parallel.timeout_s, seconds
 * (>= 0; 0: no limit): bounds each wait on peer processes that NCCL makes on the host (the
 * nonblocking init, the warm-up, an enqueue or ncclCommFinalize still ncclInProgress).
 * Errors: NMT_ERR_INTERNAL for bad arguments (as nmt_comm_create_nccl, plus world < n_local,
 * first_rank < 0, first_rank + n_local > world, a NULL unique_id) and NMT_ERR_CONFIG for
 * timeout_s < 0 or not a number, checked before NCCL is
 * loaded; NMT_ERR_ABORTED for the abort flag or the timeout (above); NMT_ERR_DEVICE as
 * nmt_comm_create_nccl (ncclCommInitRankConfig's error, or the asynchronous one it ended
 * with, with NCCL's last message, naming the GPU and global rank); NMT_ERR_NOMEM. On error
 * no handle is written that needs destroying. */
nmt_status nmt_comm_create_nccl_ranks(int n_local, const int *devices, void *const *cuda_ctxs,
                                      int world, int first_rank, const void *unique_id,
                                      double timeout_s, atomic_int *abort, nmt_comm **comms);

int nmt_comm_rank(const nmt_comm *c);
int nmt_comm_size(const nmt_comm *c);

/* In place: buf[i] = sum over ranks of buf[i], i < count (fp32; host: summed in rank order;
 * NCCL: in NCCL's order, which depends on the algorithm but is the same on every rank and
 * every run of the same configuration). NCCL: asynchronous, device memory (see above).
 * Errors: NMT_ERR_ABORTED if the abort flag is raised while waiting (host) or before the call
 * (NCCL); NCCL: NMT_ERR_DEVICE for a failed enqueue, NMT_ERR_INTERNAL for a buffer that is
 * not device memory of the rank's GPU. */
nmt_status nmt_comm_allreduce_sum(nmt_comm *c, float *buf, size_t count);

/* Bytes of one element on the wire: 4 (NMT_GRAD_FP32), 2 (NMT_GRAD_FP16, NMT_GRAD_BF16); 0 for
 * a value outside the enum. */
size_t nmt_comm_wire_size(nmt_grad_dtype wire);
/* The wire type's name as nccl-tests prints it: "float", "half", "bfloat16"; "?" otherwise. */
const char *nmt_comm_wire_name(nmt_grad_dtype wire);

/* Makes nmt_comm_allreduce_sum_as with a half wire type (fp16, bf16) valid on this rank for
 * counts up to max_count elements. Call it at setup, on every rank that will use a half wire
 * type, before the rank's first collective (from the rank's own thread, or from the main
 * thread before the rank's thread starts); never between a collective and its flush. A
 * max_count at or below the current reservation changes nothing; a larger one grows it.
 * Host: records max_count (the host reduces through a stack scratch and allocates nothing),
 * so a missing or short reservation fails on CPU workers exactly as it would on GPUs.
 * NCCL: allocates max_count x 2 bytes of device memory on the rank's GPU, owned by the group
 * and freed by nmt_comm_destroy; growing frees the old buffer with cudaFree, which waits for
 * the whole device (hence: at setup, never in the step).
 * Errors: NCCL: NMT_ERR_NOMEM (cudaMalloc), NMT_ERR_DEVICE (another CUDA error),
 * NMT_ERR_ABORTED (the group was aborted). The host never fails. */
nmt_status nmt_comm_reserve(nmt_comm *c, size_t max_count);

/* In place, through a half-precision copy: buf[i] (fp32, count elements) on every rank becomes
 *   float(S_i),  S_i = (...((w(b_0[i]) (+) w(b_1[i])) (+) w(b_2[i])) ...) (+) w(b_{n-1}[i])
 * where b_r is rank r's buf, w() rounds a float to the wire type (round to nearest, ties to
 * even, as nmt_half_round_fp16 / nmt_half_round_bf16 and __float2half_rn / __float2bfloat16_rn:
 * fp16 turns |x| >= 65520 into +-inf, NaN stays NaN) and (+) is an addition rounded to the wire
 * type (IEEE 754-2008 §4.3.1 roundTiesToEven). Summing in the wire type is what a ring
 * all-reduce in half does: every hop adds two halves and stores a half. Precision: fp16 keeps
 * 11 significant bits and |S| <= 65504 (an fp16 overflow is +-inf on every rank, which the fp16
 * loss-scale check sees as an overflowed step); bf16 keeps 8 bits with fp32's range.
 * wire = NMT_GRAD_FP32 is exactly nmt_comm_allreduce_sum (no reservation needed).
 * Host: the additions run in rank order 0..n-1 as written above (each one computed in fp32 and
 * rounded, which is the correctly rounded half sum: Figueroa 1995, "When is double rounding
 * innocuous?", since fp32 has >= 2p+2 significant bits for p = 11 and 8), so every rank gets
 * bitwise the same result whatever the thread timing. NCCL: on the comm stream, a cast kernel
 * writes w(buf) into the rank's scratch (nmt_comm_reserve), ncclAllReduce sums it in place with
 * ncclFloat16 / ncclBfloat16 and ncclSum, and a second kernel writes float(S) back into buf;
 * asynchronous like nmt_comm_allreduce_sum (nmt_comm_flush joins), and consecutive calls reuse
 * the scratch in stream order. NCCL adds in its algorithm's order (the same on every rank), so
 * S may differ from the host's rank order by a few units in the last place of the wire type.
 * Errors: NMT_ERR_INTERNAL for a wire value outside nmt_grad_dtype, a NULL buf with count > 0,
 * or, with a half wire type, count > this rank's reservation (the message names both); ranks
 * that reserved alike and make the same call fail alike, before any waiting. Otherwise as
 * nmt_comm_allreduce_sum. */
nmt_status nmt_comm_allreduce_sum_as(nmt_comm *c, float *buf, size_t count, nmt_grad_dtype wire);

/* ZeRO's collectives (Rajbhandari et al. 2020 §5; NCCL user guide "Collective Operations":
 * ReduceScatter, AllGather, in-place forms). Rank r of n owns slice r of a buffer of n x count
 * elements: buf[r*count, (r+1)*count).
 *
 * reduce_scatter_sum_as: in place; buf holds n x count fp32 on every rank; on return rank r's
 * slice r holds the sum over ranks of slice r, rounded through `wire` as
 * nmt_comm_allreduce_sum_as rounds (fp32: plain fp32 sums; fp16/bf16: each rank's value
 * rounded to the wire type and every addition rounded to it; a half wire needs
 * nmt_comm_reserve(c, n x count) first). The other slices of buf are unspecified afterwards
 * (NCCL leaves them as they were, the host may too). Host: rank r sums slice r in rank order
 * 0..n-1, so the result is bitwise that of nmt_comm_allreduce_sum_as on the same slice, and
 * the same on every run. NCCL: ncclReduceScatter with recvbuff = buf + r*count (in place) on
 * the comm stream, ordered by events like the all-reduce; asynchronous (flush joins).
 *
 * all_gather: in place; rank r's slice r of buf (n x count elements of `dtype`: 4-byte fp32,
 * or 2-byte fp16/bf16 storage, moved bit for bit) is copied into slice r of every rank's buf.
 * NCCL: ncclAllGather with sendbuff = buf + r*count, asynchronous as above.
 *
 * Errors: NMT_ERR_INTERNAL for a NULL buf with count > 0, a dtype/wire outside nmt_grad_dtype,
 * a half wire beyond the reservation, or an implementation without the collective (the
 * message names it); otherwise as nmt_comm_allreduce_sum. */
nmt_status nmt_comm_reduce_scatter_sum_as(nmt_comm *c, float *buf, size_t count,
                                          nmt_grad_dtype wire);
nmt_status nmt_comm_all_gather(nmt_comm *c, void *buf, size_t count, nmt_grad_dtype dtype);

/* In place: buf[i] = max over ranks. */
nmt_status nmt_comm_allreduce_max(nmt_comm *c, float *buf, size_t count);
/* buf on every rank = buf on `root`. */
nmt_status nmt_comm_broadcast(nmt_comm *c, float *buf, size_t count, int root);
/* Returns when every rank has entered the barrier (NCCL: an allreduce of one float on the
 * comm stream, then a polling wait for that stream; the wait also covers every collective
 * enqueued before). */
nmt_status nmt_comm_barrier(nmt_comm *c);
/* Work enqueued on the rank's device after this call sees the results of every collective
 * the rank issued before it. Host: a no-op (collectives are synchronous) that returns
 * NMT_ERR_ABORTED once the group is aborted, NMT_OK otherwise. NCCL: records an event on the
 * comm stream after the last collective and makes the compute stream wait for it
 * (cudaStreamWaitEvent), so it returns at once; the host sees the results after a wait on the
 * compute stream (copy_d2h, synchronize). It also polls ncclCommGetAsyncError: an NCCL
 * asynchronous error is NMT_ERR_DEVICE (and aborts the group). Call it on every rank once
 * the last bucket has been handed to allreduce, before anything (a kernel, an H2D copy, a
 * host read) touches the reduced buffers. */
nmt_status nmt_comm_flush(nmt_comm *c);
/* Aborts the group (any thread may call it, any number of times): raises the group's abort
 * flag (and the run's, when one was given), so every rank waiting in or entering a collective,
 * a flush or a polling wait of the CUDA backend returns NMT_ERR_ABORTED.
 * NCCL: additionally calls ncclCommAbort on every communicator of the group, which makes
 * NCCL kernels still waiting for a peer on the device quit, so the streams drain. NCCL's
 * communicators are not thread-safe (NCCL user guide, "Thread Safety": one thread at a time
 * per communicator), so the calling thread aborts a communicator only while its rank's thread
 * is not inside an NCCL call; otherwise that rank's thread aborts its own communicator when
 * its call returns (calls into NCCL never wait for peers on the host, see
 * nmt_comm_create_nccl). After an abort the group is unusable: destroy it. */
void nmt_comm_abort(nmt_comm *c);
/* Frees the group; call once with all n handles after every rank has stopped. NCCL: unbinds
 * the CUDA contexts (which must still exist: destroy the group before them), then
 * ncclCommFinalize on every communicator of the group inside one ncclGroupStart/End (it waits
 * for the enqueued collectives; grouped because one thread finalizes ranks that must progress
 * together), then ncclCommDestroy on each (NCCL user guide, "Destroying a communicator"). A
 * finalize that fails falls back to ncclCommAbort, logged; for an aborted group destroy only
 * releases what ncclCommAbort left. */
void nmt_comm_destroy(nmt_comm **comms, int n);

/* ---- Gloo communicator: ranks in several processes (src/comm/gloo.cc) ----
 * CPU workers of a run spread over N processes (one per node; issue 18): each process creates
 * the group's handles for its own worker threads, with their global ranks, and the group spans
 * every process. Gloo (Debian libgloo-dev; the collective library PyTorch uses for CPU
 * tensors) carries the collectives over TCP; the processes meet through the rendezvous store
 * (nmt/rendezvous.h) in a shared directory. docs/multinode.md, "Gloo communicator and
 * rendezvous", has the picture; the contract differs from the host communicator's only where
 * this block says so. */

/* Options of nmt_comm_create_gloo. Extensible: set size = sizeof(nmt_gloo_options). */
typedef struct nmt_gloo_options {
  size_t size;            /* sizeof(nmt_gloo_options) */
  const char *rendezvous; /* parallel.rendezvous: a directory every process can read and write
                           * (created if missing) */
  const char *prefix;     /* namespace of this group's keys there (NULL or "" for none); every
                           * process of the group passes the same, and each group creation in a
                           * directory needs its own: keys are write-once */
  const char *iface;      /* network interface to listen on ("eth0", "ib0", "lo"); NULL or "":
                           * use hostname */
  const char *hostname;   /* name or address to listen on when iface is unset ("127.0.0.1" for
                           * processes on one machine); NULL or "": this machine's host name */
  double timeout_s;       /* parallel.timeout_s (> 0): each rendezvous wait, each connection and
                           * each wait inside a collective */
} nmt_gloo_options;

/* Creates this process's n_local ranks of a Gloo group of `world` ranks: comms[i] gets global
 * rank global_ranks[i] (distinct, in [0, world)); every rank of the world must be created by
 * exactly one process, with the same world, rendezvous, prefix and timeout. Opens one TCP
 * device (one epoll thread) on o->iface / o->hostname, then connects one Gloo context per
 * local rank to every other rank (gloo::rendezvous::Context::connectFullMesh through the
 * store, keys "<prefix>/gloo/<rank>"), the local ranks at the same time on one thread each;
 * returns when every pair is connected (bounded by timeout_s, except that a peer which dies
 * after publishing its address and before connecting holds the pair's connect up to
 * 5 x timeout_s: Gloo's connect wait). Call it on the main thread before the workers start;
 * rank i's handle is then used by one worker thread at a time. `abort` (may be NULL) is the
 * run's abort flag: raised during the rendezvous, it ends the wait (NMT_ERR_ABORTED); raised
 * later, a watcher thread aborts the group within ~20 ms, as nmt_comm_abort does.
 * Side effect: SIGPIPE is set to SIG_IGN if it was at its default (Gloo writes to sockets with
 * writev, and a peer that died must be an error, not a SIGPIPE that kills this process).
 * Errors: NMT_ERR_ABORTED when ranks have not arrived within timeout_s (the message names
 * every missing rank, the directory and the timeout) or the abort flag was raised;
 * NMT_ERR_CONFIG for an empty rendezvous, a timeout_s not > 0, a key already set (a stale
 * directory or prefix), or an interface / host that cannot be opened (named); NMT_ERR_IO for a
 * directory that cannot be created or written; NMT_ERR_INTERNAL for bad arguments (NULL
 * pointers, options.size too small, n_local not in [1, world], a rank out of range or given
 * twice); NMT_ERR_NOMEM. On error no handle is written that needs destroying.
 *
 * The collectives keep nmt/comm.h's contract (in place, synchronous like the host's: the
 * result is in buf when the call returns, flush has nothing to do; every rank of the world
 * calls the same collectives in the same order with the same counts), with these differences:
 *  - Order of the sums. allreduce_sum and allreduce_sum_as use Gloo's ring all-reduce
 *    (gloo::allreduce): the buffer is cut into segments (at most 1 MiB, at least 2 per rank);
 *    each segment's sum starts at one rank and travels the ring towards lower ranks (rank r
 *    receives from r + 1), each rank adding its own value to the partial sum it received, then
 *    the finished segments are gathered. So S_i is the sum of the same n terms as the host's,
 *    added in a cyclic rank order whose start depends on the segment instead of 0..n-1
 *    (with a half wire: each term rounded to the wire type, each addition rounded to it, as the
 *    host). For n = 2 the order is immaterial (one addition) and the result is bitwise the
 *    host's; for n >= 3 it may differ from the host's by rounding (fp32 sums of integers that
 *    fit in 24 bits, and half sums that stay exact, do not). Every rank gets the same bits,
 *    and the same world, count and values give the same bits on every run.
 *  - reduce_scatter_sum_as is the reduce-scatter half of the same ring, written over Gloo's
 *    transport (src/comm/gloo.cc says why not Gloo's own): slice r's sum starts at rank r + 1
 *    and ends at rank r, S_r = b_r + (b_{r-1} + (... + (b_{r+2} + b_{r+1}))), with the wire
 *    rounding of nmt_comm_allreduce_sum_as; so it is bitwise allreduce_sum_as on the slice
 *    for n <= 2, not necessarily for n >= 3. It is computed in place in slice r; the other
 *    slices of buf hold partial sums afterwards. A receive buffer of one slice is allocated
 *    on the rank's first call with a larger count (host memory, NMT_ERR_NOMEM if that fails).
 *  - allreduce_max keeps NaN (NaN on any rank is NaN on every rank), as the host does.
 *  - Half wire: nmt_comm_reserve allocates the rank's uint16 scratch (max_count x 2 bytes,
 *    freed by destroy) on the host: NMT_ERR_NOMEM if that fails.
 *  - Failure: every wait inside Gloo ends at timeout_s. A peer process that dies closes its
 *    sockets and the ranks waiting on it fail at once; a peer that stalls is a timeout. Either
 *    way the collective returns NMT_ERR_ABORTED with Gloo's message (the peer's address) and
 *    the rank, and the failing rank closes its own connections so that its process-mates and
 *    peers fail at once instead of at their timeouts. nmt_comm_abort (or the run's abort flag)
 *    makes every local rank waiting in or entering a collective return NMT_ERR_ABORTED at
 *    once, and closes the connections, so the other processes' ranks fail too. After any
 *    failure the group is unusable: destroy it (after every local rank's thread has returned).
 *  - nmt_comm_destroy closes the connections and stops the device's thread; call it once per
 *    process with that process's n_local handles. */
nmt_status nmt_comm_create_gloo(const nmt_gloo_options *o, int n_local, const int *global_ranks,
                                int world, atomic_int *abort, nmt_comm **comms);

#ifdef __cplusplus
}
#endif
#endif /* NMT_COMM_H */
