/* host.c — the host communicator: collectives between worker threads of one process through
 * shared memory (see include/nmt/comm.h).
 *
 * Every collective is: publish my buffer pointer -> barrier -> work on my slice -> barrier.
 *  - The first barrier makes every rank's pointer (and the buffer contents written before the
 *    call) visible to every other rank.
 *  - Rank r owns slice r (a contiguous split of [0, count) into n parts). For allreduce it
 *    combines ranks 0..n-1 IN THAT ORDER into a stack scratch and copies the result into
 *    slice r of every rank's buffer. Each element is therefore computed once, by one thread,
 *    in a fixed order: all ranks end bitwise identical and the result does not depend on
 *    which thread ran first. No two ranks ever write the same element.
 *  - A half wire type (nmt_comm_allreduce_sum_as) changes only the combining: every input is
 *    rounded to the wire type as it is read, and the running sum after every addition, which
 *    is what a ring of half buffers computes. The buffers stay fp32 (the rounded values are
 *    exactly representable), so nothing else differs from the fp32 sum.
 *  - ZeRO's collectives use the caller's slices instead of slice_of's: reduce_scatter_sum_as
 *    over n x count elements has rank r combine slice r ([r*count, (r+1)*count)) exactly as
 *    the all-reduce combines each element (same code, same rank order, same rounding, so the
 *    result is bitwise the all-reduce's on that slice) and write it into its OWN buffer only;
 *    all_gather has rank r copy slice q of rank q's buffer into its own, for every q != r,
 *    byte for byte (4- or 2-byte elements). Either way each rank writes only elements nobody
 *    reads in the same collective.
 *  - The second barrier guarantees nobody still reads or writes any buffer when a rank
 *    returns, so the caller may reuse its buffer and the next collective may republish
 *    pointers without racing the previous one.
 * count 0 gives empty slices and still meets at both barriers, so it works and keeps the ranks
 * in step.
 *
 * The barrier is sense-reversing (Mellor-Crummey & Scott 1991, "Algorithms for scalable
 * synchronization on shared-memory multiprocessors", §3.3 centralized barrier): each arrival
 * increments a counter; the last one resets it and flips the shared sense; the others wait for
 * the flip. Waiting spins briefly and then sched_yield()s, so 4 ranks on 2 cores do not starve
 * the rank they wait for, and polls the abort flag.
 *
 * Abort: after NMT_ERR_ABORTED the group is unusable (the barrier count is left mid-episode)
 * and must only be destroyed. A rank that returns NMT_ERR_ABORTED from the first barrier may
 * race a peer that got through it and is still writing into that rank's buffer, so buffers
 * passed to an aborted collective must stay allocated until every rank's thread has returned
 * (the main thread's abort-then-join does exactly that).
 *
 * Testing hook: NMT_TEST_HOST_COMM_DELAY_US=d[@b] (read at create) makes rank 0 sleep d
 * microseconds inside every collective of more than b bytes (4 x count; default 0), between
 * the barriers, so each such call costs at least d: a communicator of known costs
 * (test_bucket_auto.c: parallel.bucket_mb = auto must follow them).
 */
#include <sched.h>
#include <time.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "comm_impl.h"
#include "nmt/comm.h"
#include "nmt/half.h"

/* Floats combined per pass: 4 KiB of stack scratch stays in L1 while n sources stream in. */
#define CHUNK 1024
/* See ring.c: a short spin covers a peer that is about to arrive on another core. */
#define SPIN_BEFORE_YIELD 256

typedef struct host_group host_group;

/* One rank's handle. Aligned to a cache line so one rank publishing its pointer or flipping
 * its local sense does not invalidate a neighbour's line. */
typedef struct {
  alignas(64) nmt_comm base; /* first member: a nmt_comm * is a host_rank * */
  host_group *g;
  int sense;  /* this rank's barrier sense; read and written only by its own thread */
  void *buf; /* the buffer of the current collective (fp32, or 16-bit storage for all_gather);
              * written by the owner before the first barrier, read by peers between the
              * barriers */
} host_rank;

struct host_group {
  alignas(64) atomic_uint arrived; /* ranks that reached the current barrier episode */
  alignas(64) atomic_int sense;    /* flipped by the last arrival of each episode */
  alignas(64) atomic_int own_abort;
  atomic_int *abort; /* the run's flag, or &own_abort */
  int n;
  long delay_us;      /* testing: NMT_TEST_HOST_COMM_DELAY_US (0: none) */
  size_t delay_above; /* ... for collectives of more than this many bytes */
  host_rank ranks[];
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
  __asm__ __volatile__("yield");
#endif
}

/* The flag guards no data, it only ends waits: relaxed is enough for the polling load. */
static inline int aborted(const host_group *g) {
  return atomic_load_explicit(g->abort, memory_order_relaxed) != 0;
}

static nmt_status barrier_wait(host_rank *me) {
  host_group *g = me->g;
  int s = !me->sense;
  me->sense = s;
  /* acq_rel: the release half publishes everything this rank wrote before the barrier (its
   * buffer pointer, its slice of results); the increments form one release sequence, so the
   * last arrival's acquire half sees every earlier rank's writes. */
  if (atomic_fetch_add_explicit(&g->arrived, 1, memory_order_acq_rel) == (unsigned)g->n - 1) {
    /* relaxed reset: the release store below orders it before any rank can see the flip and
     * start the next episode's increments. */
    atomic_store_explicit(&g->arrived, 0, memory_order_relaxed);
    /* release: hands everything the last arrival has seen (all ranks' writes) to each waiter
     * whose acquire load reads the flipped sense. */
    atomic_store_explicit(&g->sense, s, memory_order_release);
    return NMT_OK;
  }
  unsigned spins = 0;
  while (atomic_load_explicit(&g->sense, memory_order_acquire) != s) {
    if (aborted(g)) return NMT_ERR_ABORTED;
    if (spins < SPIN_BEFORE_YIELD) {
      spins++;
      cpu_relax();
    } else {
      sched_yield();
    }
  }
  return NMT_OK;
}

/* Slice r of a contiguous split of [0, count) into n parts; the first count % n slices get
 * one extra element. Written without count * r so it cannot overflow. */
static void slice_of(size_t count, int n, int r, size_t *lo, size_t *hi) {
  size_t q = count / (size_t)n, rem = count % (size_t)n, ur = (size_t)r;
  *lo = q * ur + (ur < rem ? ur : rem);
  *hi = *lo + q + (ur < rem ? 1 : 0);
}

typedef enum { OP_SUM, OP_SUM_FP16, OP_SUM_BF16, OP_MAX, OP_BCAST, OP_GATHER } host_op;

static inline float *fbuf(const host_rank *r) { return (float *)r->buf; }

/* Combines slice [lo, hi) of every rank's buffer in rank order and writes the result back
 * into every rank's buffer, or only into rank `only`'s (reduce-scatter; -1: every rank). */
static void reduce_slice(host_group *g, host_op op, size_t lo, size_t hi, int only) {
  float acc[CHUNK];
  /* The half sum: an fp32 addition of two wire values, rounded, is the correctly rounded wire
   * addition (see nmt_comm_allreduce_sum_as in nmt/comm.h). */
  float (*wire)(float) = op == OP_SUM_FP16 ? nmt_half_round_fp16
                         : op == OP_SUM_BF16 ? nmt_half_round_bf16
                                             : NULL;
  for (size_t b = lo; b < hi; b += CHUNK) {
    size_t len = hi - b < CHUNK ? hi - b : CHUNK;
    memcpy(acc, fbuf(&g->ranks[0]) + b, len * sizeof(float));
    if (wire)
      for (size_t k = 0; k < len; k++) acc[k] = wire(acc[k]);
    for (int j = 1; j < g->n; j++) {
      const float *src = fbuf(&g->ranks[j]) + b;
      if (op == OP_SUM) {
        for (size_t k = 0; k < len; k++) acc[k] += src[k];
      } else if (wire) {
        for (size_t k = 0; k < len; k++) acc[k] = wire(acc[k] + wire(src[k]));
      } else {
        /* NaN is sticky (x != x catches a new one; a NaN in acc never compares smaller), so
         * an overflow on any rank shows on every rank. */
        for (size_t k = 0; k < len; k++)
          if (src[k] > acc[k] || src[k] != src[k]) acc[k] = src[k];
      }
    }
    for (int j = 0; j < g->n; j++)
      if (only < 0 || j == only) memcpy(fbuf(&g->ranks[j]) + b, acc, len * sizeof(float));
  }
}

/* All-gather, pulled: rank `me` copies slice q of rank q's buffer into slice q of its own, for
 * every q != me. Rank q never writes its own slice q during the collective, and rank `me` is
 * the only writer of its buffer, so no element is read and written at once. */
static void gather_slices(host_group *g, int me, size_t count, size_t esz) {
  const size_t bytes = count * esz;
  char *dst = g->ranks[me].buf;
  for (int q = 0; q < g->n; q++)
    if (q != me) memcpy(dst + (size_t)q * bytes, (const char *)g->ranks[q].buf + (size_t)q * bytes,
                        bytes);
}

/* One collective on `count` elements. `arg`: the root (OP_BCAST), the element size in bytes
 * (OP_GATHER: count elements per rank), 1 for a reduce-scatter (a reduction op over n x count
 * elements of which rank r reduces slice r into its own buffer only), 0 otherwise. */
static nmt_status collective(nmt_comm *c, void *buf, size_t count, host_op op, int arg) {
  host_rank *me = (host_rank *)c;
  host_group *g = me->g;
  if (aborted(g)) return NMT_ERR_ABORTED;
  me->buf = buf;
  NMT_TRY(barrier_wait(me));
  size_t lo, hi;
  if (op == OP_GATHER) {
    if (count) gather_slices(g, c->rank, count, (size_t)arg);
  } else if (op == OP_BCAST) {
    slice_of(count, g->n, c->rank, &lo, &hi);
    const float *src = fbuf(&g->ranks[arg]) + lo;
    for (int j = 0; hi > lo && j < g->n; j++)
      if (j != arg) memcpy(fbuf(&g->ranks[j]) + lo, src, (hi - lo) * sizeof(float));
  } else if (arg) { /* reduce-scatter: the same combining as the all-reduce, on slice r */
    lo = count * (size_t)c->rank, hi = lo + count;
    if (hi > lo) reduce_slice(g, op, lo, hi, c->rank);
  } else {
    slice_of(count, g->n, c->rank, &lo, &hi);
    if (hi > lo) reduce_slice(g, op, lo, hi, -1);
  }
  if (g->delay_us > 0 && c->rank == 0 && count * sizeof(float) > g->delay_above) {
    const struct timespec d = {g->delay_us / 1000000, (g->delay_us % 1000000) * 1000};
    nanosleep(&d, NULL);
  }
  NMT_TRY(barrier_wait(me));
  return NMT_OK;
}

static host_op sum_op(nmt_grad_dtype wire) {
  return wire == NMT_GRAD_BF16 ? OP_SUM_BF16 : wire == NMT_GRAD_FP16 ? OP_SUM_FP16 : OP_SUM;
}

static nmt_status host_allreduce_sum(nmt_comm *c, float *buf, size_t count) {
  return collective(c, buf, count, OP_SUM, 0);
}

static nmt_status host_allreduce_sum_as(nmt_comm *c, float *buf, size_t count,
                                        nmt_grad_dtype wire) {
  return collective(c, buf, count, sum_op(wire), 0);
}

/* comm.c has checked the wire type, the buffer and (half wires) n x count <= the reservation. */
static nmt_status host_reduce_scatter_sum_as(nmt_comm *c, float *buf, size_t count,
                                             nmt_grad_dtype wire) {
  return collective(c, buf, count, sum_op(wire), 1);
}

static nmt_status host_all_gather(nmt_comm *c, void *buf, size_t count, nmt_grad_dtype dtype) {
  return collective(c, buf, count, OP_GATHER, dtype == NMT_GRAD_FP32 ? 4 : 2);
}

static nmt_status host_allreduce_max(nmt_comm *c, float *buf, size_t count) {
  return collective(c, buf, count, OP_MAX, 0);
}

static nmt_status host_broadcast(nmt_comm *c, float *buf, size_t count, int root) {
  return collective(c, buf, count, OP_BCAST, root);
}

static nmt_status host_barrier(nmt_comm *c) {
  host_rank *me = (host_rank *)c;
  if (aborted(me->g)) return NMT_ERR_ABORTED;
  return barrier_wait(me);
}

/* Collectives are complete when they return: there is nothing to order, only the abort to
 * report, so that a flush after an aborted collective fails like the collective did. */
static nmt_status host_flush(nmt_comm *c) {
  return aborted(((host_rank *)c)->g) ? NMT_ERR_ABORTED : NMT_OK;
}

static void host_abort(nmt_comm *c) {
  /* seq_cst: rare, and it also orders whatever error the caller recorded before raising it. */
  atomic_store(((host_rank *)c)->g->abort, 1);
}

static void host_destroy(nmt_comm **comms, int n) {
  (void)n; /* all handles live inside the one group allocation */
  free(((host_rank *)comms[0])->g);
}

static const nmt_comm_ops host_ops = {
    .name = "host",
    .allreduce_sum = host_allreduce_sum,
    .allreduce_sum_as = host_allreduce_sum_as,
    .reserve = NULL, /* nothing to allocate: comm.c records the count it checks */
    .allreduce_max = host_allreduce_max,
    .reduce_scatter_sum_as = host_reduce_scatter_sum_as,
    .all_gather = host_all_gather,
    .broadcast = host_broadcast,
    .barrier = host_barrier,
    .reserve_staging = NULL, /* stages nothing */
    .flush = host_flush,
    .abort = host_abort,
    .destroy = host_destroy,
};

nmt_status nmt_comm_create_host(int n, atomic_int *abort, nmt_comm **comms) {
  if (n < 1) return nmt_errorf(NMT_ERR_INTERNAL, "host communicator: %d ranks (need >= 1)", n);
  if (!comms) return nmt_errorf(NMT_ERR_INTERNAL, "host communicator: NULL comms array");
  /* aligned_alloc keeps the alignas(64) members really aligned; C11 wants the size to be a
   * multiple of the alignment. */
  size_t bytes = sizeof(host_group) + (size_t)n * sizeof(host_rank);
  bytes = (bytes + 63) / 64 * 64;
  host_group *g = aligned_alloc(64, bytes);
  if (!g) return nmt_errorf(NMT_ERR_NOMEM, "host communicator: cannot allocate %zu bytes", bytes);
  memset(g, 0, bytes);
  atomic_init(&g->arrived, 0);
  atomic_init(&g->sense, 0);
  atomic_init(&g->own_abort, 0);
  g->abort = abort ? abort : &g->own_abort;
  g->n = n;
  const char *delay = getenv("NMT_TEST_HOST_COMM_DELAY_US");
  char *at = NULL;
  g->delay_us = delay ? strtol(delay, &at, 10) : 0;
  g->delay_above = at && *at == '@' ? (size_t)strtoull(at + 1, NULL, 10) : 0;
  for (int r = 0; r < n; r++) {
    host_rank *hr = &g->ranks[r];
    hr->base.ops = &host_ops;
    hr->base.rank = r;
    hr->base.size = n;
    hr->base.wire_reserved = 0;
    hr->base.staging_reserved = 0;
    hr->g = g;
    hr->sense = 0;
    hr->buf = NULL;
    comms[r] = &hr->base;
  }
  return NMT_OK;
}
