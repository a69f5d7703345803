/* staged.c — the host-staged communicator (nmt/comm.h, nmt_comm_create_staged): the host
 * communicator (host.c) reducing device buffers through pinned host copies, so several
 * workers can share one GPU, which NCCL refuses.
 *
 * One rank's collective, written against the backend's table only (so the reference backend
 * runs this very code on CPU workers, and a CPU test checks it bitwise against host.c):
 *
 *   enqueue (worker thread, during backward):
 *     be->comm_d2h(stage + off, buf)      compute: ─record─ ...            (returns at once)
 *                                         comm   : wait ─ D2H(buf -> stage + off)
 *     pending[k] = {op, buf, count, off}
 *   flush (worker thread, once the step's last bucket is out):
 *     be->comm_wait                       polls the comm stream: every D2H has landed
 *     host collective k on stage + off    in issue order, k = 0, 1, ... (meets the peers)
 *     be->comm_h2d(buf, stage + off)      comm   : H2D(stage + off -> buf) ...
 *     be->comm_join                       compute waits for the comm stream (returns at once)
 *
 * Why the host part runs in the worker's thread at the flush rather than in a stream
 * callback (cudaLaunchHostFunc) as each copy lands: callbacks run one at a time on a driver
 * thread, and one that waited in a host collective for a peer rank whose own callback queues
 * behind it would deadlock. Why not a proxy thread per rank: the flush is the point at which
 * the engine already waits for its collectives (the optimizer needs them), and every rank
 * issues the same collectives in the same order, so running them in order there keeps the
 * host group's matching without a second thread per rank, its hand-off and its shutdown.
 *
 * Staging regions: the collectives between two flushes sit in one pinned buffer per rank,
 * each at its own offset (256-byte aligned), reset at each flush. Ordering of a region's
 * reuse: the host writes a region only after comm_wait (the D2H into it has landed, and so
 * has every earlier H2D out of it, being before it on the comm stream); the next D2H into it
 * is enqueued after the H2D that reads it, on the same stream. A collective that does not fit
 * behind the pending ones first runs them (the flush without the join: correct, but the host
 * waits for the device there, mid-backward), and so does one whose buffer overlaps what a
 * pending one will copy back (stream order, which NCCL's in-place collectives have, kept).
 *
 * What goes down and back (the host group's buffers are the staged copies):
 *   allreduce_sum(_as), allreduce_max, broadcast: count fp32 down, count back;
 *   reduce_scatter_sum_as: n x count fp32 down, the rank's slice (count) back;
 *   all_gather: the rank's slice down, n x count elements (fp32 or 16-bit) back.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "comm_impl.h"
#include "nmt/backend.h"
#include "nmt/comm.h"

#define ALIGN 256

typedef enum { OP_SUM, OP_SUM_AS, OP_MAX, OP_BCAST, OP_RS, OP_AG } op_kind;

typedef struct {
  op_kind kind;
  char *dev;         /* the caller's buffer (memory of the rank's context) */
  size_t count;      /* the collective's count argument */
  int arg;           /* the root (OP_BCAST), the wire type (OP_SUM_AS, OP_RS), the dtype (OP_AG) */
  size_t off;        /* the staged copy's offset in the rank's staging buffer */
  size_t back_off;   /* bytes from the buffer's start to the part copied back ... */
  size_t back_bytes; /* ... and its size */
} pending_op;

typedef struct staged_group staged_group;

typedef struct {
  nmt_comm base; /* first member: a nmt_comm * is a staged_rank * */
  staged_group *g;
  nmt_comm *inner; /* this rank's handle of the host group */
  void *ctx;
  char *stage;     /* be->host_alloc'd, `cap` bytes (NULL before nmt_comm_reserve_staging) */
  size_t cap;
  size_t used;     /* bytes of `stage` taken by the pending collectives */
  pending_op *ops; /* pending collectives, in issue order */
  int n_ops, ops_cap;
  int unjoined;    /* H2D copies on the comm stream the compute stream does not wait for yet */
} staged_rank;

struct staged_group {
  const nmt_backend *be;
  int n;
  nmt_comm **inner; /* the host group, n handles */
  staged_rank ranks[];
};

static inline staged_rank *rank_of(nmt_comm *c) { return (staged_rank *)c; }

static size_t align_up(size_t x) { return (x + ALIGN - 1) / ALIGN * ALIGN; }

/* The pending host collectives, in issue order, on the staged copies; then their results'
 * copies back to the device (not joined: the flush does that). */
static nmt_status run_pending(staged_rank *r) {
  if (r->n_ops == 0) return NMT_OK;
  const nmt_backend *be = r->g->be;
  NMT_TRY(be->comm_wait(r->ctx));
  for (int k = 0; k < r->n_ops; k++) {
    const pending_op *o = &r->ops[k];
    float *p = (float *)(r->stage + o->off);
    switch (o->kind) {
    case OP_SUM: NMT_TRY(nmt_comm_allreduce_sum(r->inner, p, o->count)); break;
    case OP_SUM_AS:
      NMT_TRY(nmt_comm_allreduce_sum_as(r->inner, p, o->count, (nmt_grad_dtype)o->arg));
      break;
    case OP_MAX: NMT_TRY(nmt_comm_allreduce_max(r->inner, p, o->count)); break;
    case OP_BCAST: NMT_TRY(nmt_comm_broadcast(r->inner, p, o->count, o->arg)); break;
    case OP_RS:
      NMT_TRY(nmt_comm_reduce_scatter_sum_as(r->inner, p, o->count, (nmt_grad_dtype)o->arg));
      break;
    case OP_AG: NMT_TRY(nmt_comm_all_gather(r->inner, p, o->count, (nmt_grad_dtype)o->arg)); break;
    }
  }
  for (int k = 0; k < r->n_ops; k++) {
    const pending_op *o = &r->ops[k];
    NMT_TRY(be->comm_h2d(r->ctx, o->dev + o->back_off, r->stage + o->off + o->back_off,
                         o->back_bytes));
  }
  r->unjoined = 1;
  r->n_ops = 0;
  r->used = 0;
  return NMT_OK;
}

/* 1 when [p, p + bytes) overlaps what a pending collective will copy back to the device. */
static int reads_pending(const staged_rank *r, const char *p, size_t bytes) {
  const uintptr_t lo = (uintptr_t)p, hi = lo + bytes;
  for (int k = 0; k < r->n_ops; k++) {
    const uintptr_t blo = (uintptr_t)(r->ops[k].dev + r->ops[k].back_off);
    if (lo < blo + r->ops[k].back_bytes && blo < hi) return 1;
  }
  return 0;
}

static const char *op_name(op_kind k) {
  static const char *const names[] = {"allreduce_sum", "allreduce_sum_as", "allreduce_max",
                                      "broadcast", "reduce_scatter_sum_as", "all_gather"};
  return names[k];
}

/* Stages one collective: its buffer down to a region of the staging buffer on the comm stream,
 * after the compute stream's work so far, and records it as pending. comm.c has checked the
 * arguments (wire and dtype values, a half wire's reservation against this handle). */
static nmt_status enqueue(nmt_comm *c, op_kind kind, void *buf, size_t count, int arg) {
  staged_rank *r = rank_of(c);
  const int n = r->base.size, me = r->base.rank;
  /* The host group reports an abort (a no-op otherwise: its collectives are synchronous). */
  NMT_TRY(nmt_comm_flush(r->inner));
  /* Every rank makes the same call, so every rank skips it. */
  if (count == 0) return NMT_OK;
  const size_t esz = kind == OP_AG ? nmt_comm_wire_size((nmt_grad_dtype)arg) : sizeof(float);
  const size_t elems = kind == OP_RS || kind == OP_AG ? count * (size_t)n : count;
  const size_t bytes = elems * esz, slice = count * esz;
  if (bytes > r->cap)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "host-staged communicator, rank %d: %s of %zu bytes, but only %zu bytes "
                      "of pinned staging were reserved (nmt_comm_reserve_staging at setup)",
                      me, op_name(kind), bytes, r->cap);
  size_t down_off = 0, down_bytes = bytes;
  if (kind == OP_AG) down_off = (size_t)me * slice, down_bytes = slice;
  /* On a stream, a collective reads its buffer after the earlier ones have written theirs; here
   * the earlier results reach the device only at the flush. So a buffer that reads what a
   * pending collective will write (ZeRO's in-place gathers, last bucket first, where a
   * bucket's pad runs into the next bucket's parameters) first runs the pending ones, and its
   * copy down then follows their copies back on the comm stream. */
  if (align_up(r->used) + bytes > r->cap || reads_pending(r, (char *)buf + down_off, down_bytes))
    NMT_TRY(run_pending(r));
  if (r->n_ops == r->ops_cap) {
    /* Host memory only, and a handful of entries per step after the first: no device sync. */
    int ncap = r->ops_cap ? 2 * r->ops_cap : 64;
    pending_op *ops = realloc(r->ops, (size_t)ncap * sizeof *ops);
    if (!ops) return nmt_errorf(NMT_ERR_NOMEM, "host-staged communicator: %d pending", ncap);
    r->ops = ops, r->ops_cap = ncap;
  }
  pending_op o = {.kind = kind, .dev = buf, .count = count, .arg = arg,
                  .off = align_up(r->used), .back_off = 0, .back_bytes = bytes};
  if (kind == OP_RS) o.back_off = (size_t)me * slice, o.back_bytes = slice;
  NMT_TRY(r->g->be->comm_d2h(r->ctx, r->stage + o.off + down_off, o.dev + down_off, down_bytes));
  r->ops[r->n_ops++] = o;
  r->used = o.off + bytes;
  return NMT_OK;
}

static nmt_status staged_allreduce_sum(nmt_comm *c, float *buf, size_t count) {
  return enqueue(c, OP_SUM, buf, count, 0);
}

static nmt_status staged_allreduce_sum_as(nmt_comm *c, float *buf, size_t count,
                                          nmt_grad_dtype wire) {
  return enqueue(c, OP_SUM_AS, buf, count, (int)wire);
}

static nmt_status staged_reduce_scatter_sum_as(nmt_comm *c, float *buf, size_t count,
                                               nmt_grad_dtype wire) {
  return enqueue(c, OP_RS, buf, count, (int)wire);
}

static nmt_status staged_all_gather(nmt_comm *c, void *buf, size_t count, nmt_grad_dtype dtype) {
  return enqueue(c, OP_AG, buf, count, (int)dtype);
}

static nmt_status staged_allreduce_max(nmt_comm *c, float *buf, size_t count) {
  return enqueue(c, OP_MAX, buf, count, 0);
}

static nmt_status staged_broadcast(nmt_comm *c, float *buf, size_t count, int root) {
  return enqueue(c, OP_BCAST, buf, count, root);
}

/* The host group's half wire checks its own reservation: keep it as large as this handle's. */
static nmt_status staged_reserve(nmt_comm *c, size_t max_count) {
  return nmt_comm_reserve(rank_of(c)->inner, max_count);
}

static nmt_status staged_reserve_staging(nmt_comm *c, size_t max_bytes) {
  staged_rank *r = rank_of(c);
  if (max_bytes <= r->cap) return NMT_OK;
  if (r->n_ops)
    return nmt_errorf(NMT_ERR_INTERNAL, "host-staged communicator, rank %d: staging grown with "
                      "%d collectives pending", r->base.rank, r->n_ops);
  const nmt_backend *be = r->g->be;
  /* The comm stream's copies may still read the old buffer (the last flush's H2D). */
  NMT_TRY(be->comm_wait(r->ctx));
  void *p = NULL;
  NMT_TRY(be->host_alloc(r->ctx, max_bytes, &p));
  be->host_free(r->ctx, r->stage);
  r->stage = p;
  r->cap = max_bytes;
  return NMT_OK;
}

static nmt_status staged_flush(nmt_comm *c) {
  staged_rank *r = rank_of(c);
  NMT_TRY(run_pending(r));
  if (r->unjoined) {
    NMT_TRY(r->g->be->comm_join(r->ctx));
    r->unjoined = 0;
  }
  return nmt_comm_flush(r->inner);
}

static nmt_status staged_barrier(nmt_comm *c) {
  NMT_TRY(staged_flush(c));
  return nmt_comm_barrier(rank_of(c)->inner);
}

static void staged_abort(nmt_comm *c) { nmt_comm_abort(rank_of(c)->inner); }

static void staged_destroy(nmt_comm **comms, int n) {
  (void)n; /* all handles live in the one group allocation */
  staged_group *g = rank_of(comms[0])->g;
  for (int i = 0; i < g->n; i++) {
    staged_rank *r = &g->ranks[i];
    /* The comm stream may still hold copies into the buffer: wait for them (a copy never
     * waits for a peer, so this ends; after an abort comm_wait returns at once, and
     * cudaFreeHost, which synchronizes the device, waits instead). */
    if (r->stage) {
      if (g->be->comm_wait(r->ctx) != NMT_OK) nmt_clear_error();
      g->be->host_free(r->ctx, r->stage);
    }
    free(r->ops);
  }
  nmt_comm_destroy(g->inner, g->n);
  free(g->inner);
  free(g);
}

static const nmt_comm_ops staged_ops = {
    .name = "host-staged",
    .allreduce_sum = staged_allreduce_sum,
    .allreduce_sum_as = staged_allreduce_sum_as,
    .reserve = staged_reserve,
    .allreduce_max = staged_allreduce_max,
    .reduce_scatter_sum_as = staged_reduce_scatter_sum_as,
    .all_gather = staged_all_gather,
    .broadcast = staged_broadcast,
    .barrier = staged_barrier,
    .reserve_staging = staged_reserve_staging,
    .flush = staged_flush,
    .abort = staged_abort,
    .destroy = staged_destroy,
};

nmt_status nmt_comm_create_staged(int n, const nmt_backend *be, void *const *ctxs,
                                  atomic_int *abort, nmt_comm **comms) {
  if (n < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "host-staged communicator: %d ranks (need >= 1)", n);
  if (!be || !comms)
    return nmt_errorf(NMT_ERR_INTERNAL, "host-staged communicator: NULL backend or comms");
  if (!be->comm_d2h || !be->comm_h2d || !be->comm_wait || !be->comm_join || !be->host_alloc ||
      !be->host_free)
    return nmt_errorf(NMT_ERR_INTERNAL, "host-staged communicator: backend %s has no comm "
                      "stream copies", be->name);
  if (!ctxs && !be->is_host)
    return nmt_errorf(NMT_ERR_INTERNAL, "host-staged communicator: backend %s needs a context "
                      "per rank", be->name);
  staged_group *g = calloc(1, sizeof *g + (size_t)n * sizeof(staged_rank));
  nmt_comm **inner = calloc((size_t)n, sizeof *inner);
  if (!g || !inner) {
    free(g), free(inner);
    return nmt_errorf(NMT_ERR_NOMEM, "host-staged communicator: %d ranks", n);
  }
  nmt_status s = nmt_comm_create_host(n, abort, inner);
  if (s != NMT_OK) {
    free(g), free(inner);
    return s;
  }
  g->be = be, g->n = n, g->inner = inner;
  for (int i = 0; i < n; i++) {
    staged_rank *r = &g->ranks[i];
    r->base = (nmt_comm){.ops = &staged_ops, .rank = i, .size = n};
    r->g = g;
    r->inner = inner[i];
    r->ctx = ctxs ? ctxs[i] : NULL;
    comms[i] = &r->base;
  }
  return NMT_OK;
}
