/* nmt/ring.h — bounded lock-free single-producer/single-consumer ring of pointers.
 *
 * The hand-off between the loader and each worker (batches), and from each worker to the main
 * thread (metrics), with no mutex or condition variable: one producer thread writes `head`,
 * one consumer thread writes `tail`, each reads the other's index with acquire and publishes
 * its own with release (C11 <stdatomic.h>). Capacity is a power of two; indices run freely and
 * are masked. The blocking variants spin, then yield, and give up when *abort becomes non-zero.
 *
 * defines: nmt_ring, nmt_ring_init, nmt_ring_free, nmt_ring_try_push, nmt_ring_try_pop,
 *          nmt_ring_push, nmt_ring_pop, nmt_ring_push_any, nmt_ring_pop_any, nmt_ring_size
 */
#ifndef NMT_RING_H
#define NMT_RING_H

#include <stdatomic.h>
#include <stddef.h>

#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  _Alignas(64) atomic_size_t head; /* next slot to write; written by the producer only */
  _Alignas(64) atomic_size_t tail; /* next slot to read; written by the consumer only */
  _Alignas(64) void **slots;
  size_t mask;
} nmt_ring;

/* capacity: a power of two >= 2. Errors: NMT_ERR_INTERNAL (bad capacity), NMT_ERR_NOMEM. */
nmt_status nmt_ring_init(nmt_ring *r, size_t capacity);
void nmt_ring_free(nmt_ring *r);
/* Producer: 1 if pushed, 0 if full. */
int nmt_ring_try_push(nmt_ring *r, void *item);
/* Consumer: 1 and *item set if popped, 0 if empty. */
int nmt_ring_try_pop(nmt_ring *r, void **item);
/* Blocking push/pop: spin then sched_yield until done, or return NMT_ERR_ABORTED once
 * atomic_load(abort) != 0 (abort may be NULL). */
nmt_status nmt_ring_push(nmt_ring *r, void *item, const atomic_int *abort);
nmt_status nmt_ring_pop(nmt_ring *r, void **item, const atomic_int *abort);
/* The same, ended by either of two flags (either may be NULL): a loader waits until its
 * segment ends or the run aborts. */
nmt_status nmt_ring_push_any(nmt_ring *r, void *item, const atomic_int *a, const atomic_int *b);
nmt_status nmt_ring_pop_any(nmt_ring *r, void **item, const atomic_int *a, const atomic_int *b);
/* Items currently queued (a snapshot; exact only from the producer or consumer thread). */
size_t nmt_ring_size(nmt_ring *r);

#ifdef __cplusplus
}
#endif
#endif /* NMT_RING_H */
