/* ring.c — bounded lock-free SPSC ring of pointers (see include/nmt/ring.h).
 *
 * Memory ordering, the whole argument in one place:
 *  - Each index has exactly one writer, so a thread reads its OWN index with relaxed order
 *    (it only ever sees its own last store).
 *  - Producer: writes slots[head & mask] with a plain store, then publishes head+1 with
 *    release. The consumer loads head with acquire, so seeing head+1 makes the slot write
 *    visible before it reads the slot (release/acquire pair #1).
 *  - Consumer: reads slots[tail & mask], then publishes tail+1 with release. The producer
 *    loads tail with acquire before overwriting that slot, so the consumer's read of the old
 *    item happens-before the producer's new write into it (pair #2; without it the producer
 *    could overwrite a slot the consumer has not finished reading).
 * Nothing else needs ordering, so no seq_cst (which would add a full fence on x86 stores).
 * Indices run freely and wrap at SIZE_MAX+1; since capacity divides SIZE_MAX+1, the masked
 * slot stays right and head - tail (unsigned) stays the queued count across the wrap.
 */
#include "nmt/ring.h"

#include <sched.h>
#include <stdint.h>
#include <stdlib.h>

/* A short spin covers the common case where the peer is running on another core and is
 * about to move the index; after that, yield so that on an oversubscribed machine (2 cores,
 * loader + workers + main) the peer gets the core we would otherwise burn. */
#define SPIN_BEFORE_YIELD 256

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
  __asm__ __volatile__("yield");
#endif
}

static inline void backoff(unsigned *spins) {
  if (*spins < SPIN_BEFORE_YIELD) {
    ++*spins;
    cpu_relax();
  } else {
    sched_yield();
  }
}

/* The abort flag only tells us to stop waiting; it guards no data, so relaxed suffices. */
static inline int aborted(const atomic_int *abort) {
  return abort && atomic_load_explicit(abort, memory_order_relaxed) != 0;
}

nmt_status nmt_ring_init(nmt_ring *r, size_t capacity) {
  if (capacity < 2 || (capacity & (capacity - 1)) != 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "ring capacity %zu is not a power of two >= 2", capacity);
  void **slots = calloc(capacity, sizeof *slots);
  if (!slots)
    return nmt_errorf(NMT_ERR_NOMEM, "ring: cannot allocate %zu slots", capacity);
  atomic_init(&r->head, 0);
  atomic_init(&r->tail, 0);
  r->slots = slots;
  r->mask = capacity - 1;
  return NMT_OK;
}

void nmt_ring_free(nmt_ring *r) {
  if (!r) return;
  free(r->slots);
  r->slots = NULL;
  r->mask = 0;
}

int nmt_ring_try_push(nmt_ring *r, void *item) {
  size_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
  /* acquire: pair #2 — the consumer is done reading the slot we may reuse. */
  size_t tail = atomic_load_explicit(&r->tail, memory_order_acquire);
  if (head - tail > r->mask) return 0; /* head - tail == capacity: full */
  r->slots[head & r->mask] = item;
  /* release: pair #1 — the slot write is visible to whoever sees the new head. */
  atomic_store_explicit(&r->head, head + 1, memory_order_release);
  return 1;
}

int nmt_ring_try_pop(nmt_ring *r, void **item) {
  size_t tail = atomic_load_explicit(&r->tail, memory_order_relaxed);
  /* acquire: pair #1 — the producer's slot write happens-before our read of it. */
  size_t head = atomic_load_explicit(&r->head, memory_order_acquire);
  if (head == tail) return 0;
  *item = r->slots[tail & r->mask];
  /* release: pair #2 — our read of the slot is done before the producer may reuse it. */
  atomic_store_explicit(&r->tail, tail + 1, memory_order_release);
  return 1;
}

/* The operation is tried before the flag is looked at, so an item that is already
 * available still moves; the flag only ends a wait that cannot complete on its own. */
nmt_status nmt_ring_push_any(nmt_ring *r, void *item, const atomic_int *a, const atomic_int *b) {
  unsigned spins = 0;
  while (!nmt_ring_try_push(r, item)) {
    if (aborted(a) || aborted(b)) return NMT_ERR_ABORTED;
    backoff(&spins);
  }
  return NMT_OK;
}

nmt_status nmt_ring_pop_any(nmt_ring *r, void **item, const atomic_int *a, const atomic_int *b) {
  unsigned spins = 0;
  while (!nmt_ring_try_pop(r, item)) {
    if (aborted(a) || aborted(b)) return NMT_ERR_ABORTED;
    backoff(&spins);
  }
  return NMT_OK;
}

nmt_status nmt_ring_push(nmt_ring *r, void *item, const atomic_int *abort) {
  return nmt_ring_push_any(r, item, abort, NULL);
}

nmt_status nmt_ring_pop(nmt_ring *r, void **item, const atomic_int *abort) {
  return nmt_ring_pop_any(r, item, abort, NULL);
}

size_t nmt_ring_size(nmt_ring *r) {
  /* tail first: both only grow and head >= tail at every instant, so a later head is never
   * below an earlier tail and the difference cannot underflow, whichever thread asks. A
   * third thread can still see tail stale by more than a lap, hence the clamp. */
  size_t tail = atomic_load_explicit(&r->tail, memory_order_acquire);
  size_t head = atomic_load_explicit(&r->head, memory_order_acquire);
  size_t n = head - tail;
  return n > r->mask + 1 ? r->mask + 1 : n;
}
