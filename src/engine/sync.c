/* sync.c — the run's error record (sync.h): the first error wins, and any error raises the
 * abort and shutdown flags that every thread of the run watches; the stop request's word. */
#include "sync.h"

#include <stdio.h>

void nmt__sync_record_error(nmt__sync *s, int rank, nmt_status st) {
  if (st == NMT_OK) return;
  int expected = 0;
  /* A worker's ABORTED is an echo of someone else's error; the main thread's is its own. */
  if ((st != NMT_ERR_ABORTED || rank < 0) &&
      atomic_compare_exchange_strong(&s->error_claimed, &expected, 1)) {
    s->error = st;
    s->error_rank = rank;
    snprintf(s->error_msg, sizeof s->error_msg, "%s", nmt_last_error());
  }
  expected = 0;
  if (st == NMT_ERR_ABORTED && rank >= 0 &&
      atomic_compare_exchange_strong(&s->aborted_claimed, &expected, 1)) {
    s->aborted_rank = rank;
    snprintf(s->aborted_msg, sizeof s->aborted_msg, "%s", nmt_last_error());
  }
  atomic_store(&s->abort, 1);
  atomic_store(&s->shutdown, 1);
}

int nmt__sync_failed(nmt__sync *s) {
  if (atomic_load(&s->error_claimed)) return 1;
  if (!atomic_load(&s->aborted_claimed)) return 0;
  int expected = 0;
  if (atomic_compare_exchange_strong(&s->error_claimed, &expected, 1)) {
    s->error = NMT_ERR_ABORTED;
    s->error_rank = s->aborted_rank;
    snprintf(s->error_msg, sizeof s->error_msg, "%s", s->aborted_msg);
  }
  return 1;
}

long nmt__stop_request(nmt__sync *s) { return (long)(atomic_fetch_or(&s->stop, 1) >> 1); }

int nmt__stop_pending(nmt__sync *s) { return (int)(atomic_load(&s->stop) & 1); }

int nmt__stop_pending_at(nmt__sync *s, long step) {
  return atomic_load(&s->stop) == (((long long)step << 1) | 1);
}

void nmt__stop_open(nmt__sync *s, long step) {
  long long old = atomic_load(&s->stop);
  while (!atomic_compare_exchange_weak(&s->stop, &old, ((long long)step << 1) | (old & 1))) {
  }
}

int nmt__stop_seal(nmt__sync *s, long next) {
  long long old = atomic_load(&s->stop);
  do {
    if (old & 1) return 1;
  } while (!atomic_compare_exchange_weak(&s->stop, &old, (long long)next << 1));
  return 0;
}

void nmt__stop_clear(nmt__sync *s) { atomic_fetch_and(&s->stop, ~1LL); }
