/* test_engine_faults.c — the engine's batch hand-off under faults, on CPU workers: a worker
 * that ends with an error never gives the loader a host slot whose copy may still be reading
 * it, and a loader waiting for a slot gives up on the run's abort flag.
 *
 * The reference backend copies a batch at once (h2d_async is a memcpy), so an early hand-back
 * would go unseen there. These tests train through a copy of its table whose copy engine lags
 * like a GPU's: h2d_async only records the copy, which happens when the compute stream waits
 * for it (h2d_acquire) or the host waits for its source to be read (h2d_wait_src); a wait that
 * finds the copy pending with the abort flag raised returns NMT_ERR_ABORTED and leaves it
 * pending, as the CUDA backend's polling wait does. A slot still pending when the run ends is
 * one the copy engine may still be reading. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "helpers.h"
#include "nmt/backend.h"
#include "nmt/ref.h"
#include "nmt/trainer.h"
#include "test.h"
#include "../src/engine/run.h" /* the trainer's backend, workers, rings and loaders */

/* ------------------------------------------------------------------------------------------ */
/* a copy engine that lags                                                                    */

enum { LAG_CTXS = 8 };

typedef struct {
  const void *src;
  void *dst;
  size_t bytes;
  int pending;
} lag_copy;

/* The state of the lagging table: one test at a time uses it (the runner runs tests in turn);
 * worker threads reach it concurrently, hence the mutex. */
static struct {
  pthread_mutex_t mu;
  struct {
    void *ctx;
    lag_copy slot[2];
  } c[LAG_CTXS];
  int n;
  const atomic_int *abort;
  long refused; /* waits that found their copy pending with the abort flag up */
} lag = {.mu = PTHREAD_MUTEX_INITIALIZER};

static nmt_backend lag_be;

/* The copies of ctx (registered on first use); NULL when the table is full. Under lag.mu. */
static lag_copy *lag_slots(void *ctx) {
  for (int i = 0; i < lag.n; i++)
    if (lag.c[i].ctx == ctx) return lag.c[i].slot;
  if (lag.n == LAG_CTXS) return NULL;
  lag.c[lag.n].ctx = ctx;
  return lag.c[lag.n++].slot;
}

static void lag_complete(lag_copy *x) {
  if (!x->pending) return;
  memcpy(x->dst, x->src, x->bytes);
  x->pending = 0;
}

static nmt_status lag_h2d_async(void *ctx, int slot, void *dst, const void *src, size_t bytes) {
  if (slot < 0 || slot > 1) return nmt_backend_ref.h2d_async(ctx, slot, dst, src, bytes);
  pthread_mutex_lock(&lag.mu);
  lag_copy *s = lag_slots(ctx);
  if (s) {
    lag_complete(&s[slot]); /* the slot's previous copy is long done */
    s[slot] = (lag_copy){.src = src, .dst = dst, .bytes = bytes, .pending = 1};
  }
  pthread_mutex_unlock(&lag.mu);
  return s ? NMT_OK : nmt_errorf(NMT_ERR_INTERNAL, "test: more than %d contexts", LAG_CTXS);
}

static nmt_status lag_h2d_acquire(void *ctx, int slot) {
  if (slot >= 0 && slot <= 1) {
    pthread_mutex_lock(&lag.mu);
    lag_copy *s = lag_slots(ctx);
    if (s) lag_complete(&s[slot]);
    pthread_mutex_unlock(&lag.mu);
  }
  return nmt_backend_ref.h2d_acquire(ctx, slot);
}

static nmt_status lag_h2d_wait_src(void *ctx, int slot) {
  if (slot < 0 || slot > 1) return nmt_backend_ref.h2d_wait_src(ctx, slot);
  nmt_status st = NMT_OK;
  pthread_mutex_lock(&lag.mu);
  lag_copy *s = lag_slots(ctx);
  if (s && s[slot].pending && lag.abort && atomic_load(lag.abort)) {
    lag.refused++;
    st = NMT_ERR_ABORTED;
  } else if (s) {
    lag_complete(&s[slot]);
  }
  pthread_mutex_unlock(&lag.mu);
  return st;
}

/* Puts backend table be under trainer t and every worker's replica. */
static void set_backend(nmt_trainer *t, const nmt_backend *be) {
  t->be = be;
  for (int r = 0; r < t->n_dev; r++) t->workers[r].rep.be = be;
}

/* Puts the lagging table under trainer t (created on the reference backend). */
static void lag_install(nmt_trainer *t) {
  lag_be = nmt_backend_ref;
  lag_be.name = "ref-lagging-copies";
  lag_be.h2d_async = lag_h2d_async;
  lag_be.h2d_acquire = lag_h2d_acquire;
  lag_be.h2d_wait_src = lag_h2d_wait_src;
  pthread_mutex_lock(&lag.mu);
  memset(lag.c, 0, sizeof lag.c);
  lag.n = 0;
  lag.refused = 0;
  lag.abort = &t->sync.abort;
  pthread_mutex_unlock(&lag.mu);
  set_backend(t, &lag_be);
}

/* Whether slot buffer `buf` sits in ring r (read between segments: no thread runs). */
static int ring_holds(nmt_ring *r, const void *buf) {
  void *items[64];
  int n = 0, found = 0;
  while (n < 64 && nmt_ring_try_pop(r, &items[n])) n++;
  for (int i = 0; i < n; i++) {
    found |= (const void *)((nmt__batch_slot *)items[i])->buf == buf;
    nmt_ring_try_push(r, items[i]);
  }
  return found;
}

/* ------------------------------------------------------------------------------------------ */
/* tests                                                                                      */

/* Rank 1 of 2 fails inside step 3's first bucket collective, after both workers fetched step
 * 4's batch ahead (its copy still pending on the lagging engine); rank 0, waiting in that
 * collective, is aborted. The run ends with rank 1's error, and neither worker hands its
 * pending slot back to the loader: each slot whose copy never finished is in no ring (the
 * loader could refill it while the copy engine reads it) and is the worker's parked one. */
NMT_TEST(engine_error_keeps_inflight_slot_from_loader) {
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(nmt_test_tmpdir(), 96, 21, &c));
  c.parallel_devices = 2;
  c.train_max_steps = 8;
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  o.fail_rank = 1;
  o.fail_step = 3;
  o.fail_bucket = 0;
  nmt_trainer *t;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
  lag_install(t);
  const double t0 = nmt_th_now();
  nmt_status s = nmt_trainer_run(t);
  const double dt = nmt_th_now() - t0;
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", nmt_last_error());
  long pending = 0, handed_back = 0, unparked = 0;
  for (int i = 0; i < lag.n; i++)
    for (int k = 0; k < 2; k++) {
      const lag_copy *x = &lag.c[i].slot[k];
      if (!x->pending) continue;
      pending++;
      for (int r = 0; r < t->n_dev; r++) {
        nmt__worker *w = &t->workers[r];
        nmt__feed *f = &t->feeds[r];
        if (w->rep.ctx != lag.c[i].ctx) continue;
        if (ring_holds(&f->free_slots, x->src) || ring_holds(&f->batches, x->src)) handed_back++;
        if (!w->parked || (const void *)w->parked->buf != x->src) unparked++;
      }
    }
  printf("# run ended in %.3f s: %s; %ld copies still pending at the end, %ld of their slots "
         "handed back to the loader, %ld not parked; %ld waits refused on the abort flag\n", dt,
         msg, pending, handed_back, unparked, lag.refused);
  set_backend(t, &nmt_backend_ref);
  nmt_trainer_destroy(t);
  NMT_ASSERT_EQ_STATUS(s, NMT_ERR_INTERNAL);
  NMT_ASSERT(strstr(msg, "injected failure on rank 1") != NULL);
  NMT_ASSERT(pending >= 1); /* the scenario happened: a copy in flight at the error */
  NMT_ASSERT_EQ_INT(handed_back, 0);
  NMT_ASSERT_EQ_INT(unparked, 0);
}

/* A stop (not an error) still hands the slot fetched ahead back, once its copy is done, so
 * the next segment finds every slot: after the stop every slot of both workers is in a ring,
 * none parked, and the run then trains to its end. The stop is requested before the segment
 * starts, so it rides on step 1 (a request from the metrics callback raced the tiny run's
 * end on a loaded machine); step 1's enqueue has already fetched step 2's batch ahead. */
NMT_TEST(engine_stop_hands_fetched_slot_back) {
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(nmt_test_tmpdir(), 96, 22, &c));
  c.parallel_devices = 2;
  c.train_accum_steps = 2;
  c.train_max_steps = 12;
  nmt_trainer *t = NULL;
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
  lag_install(t);
  nmt_trainer_request_stop(t);
  nmt_status s1 = nmt_trainer_train(t, 0);
  const long stopped_at = nmt_trainer_step(t);
  long in_rings = 0, parked = 0;
  for (int r = 0; r < t->n_dev; r++) {
    in_rings += (long)nmt_ring_size(&t->feeds[r].free_slots) +
                (long)nmt_ring_size(&t->feeds[r].batches);
    parked += t->workers[r].parked != NULL;
  }
  nmt_status s2 = nmt_trainer_train(t, 0);
  const long steps = nmt_trainer_step(t);
  const int n_slots = t->feeds[0].n_slots;
  set_backend(t, &nmt_backend_ref);
  nmt_trainer_destroy(t);
  printf("# stopped after step %ld: %ld slots in the rings of 2 workers (%d each), %ld parked; "
         "then trained to step %ld\n", stopped_at, in_rings, n_slots, parked, steps);
  NMT_ASSERT_EQ_STATUS(s1, NMT_STOPPED);
  NMT_ASSERT_EQ_INT(stopped_at, 1);
  NMT_ASSERT_EQ_INT(in_rings, 2L * n_slots);
  NMT_ASSERT_EQ_INT(parked, 0);
  NMT_ASSERT_OK(s2);
  NMT_ASSERT_EQ_INT(steps, 12);
}

/* A loader waiting for a free slot ends when the run's abort flag rises, without shutdown:
 * an abort raised before any worker recorded an error (a peer process's failure), or a worker
 * that kept its slot after an error, must not leave it spinning. Every free slot of the worker
 * is taken away, abort raised, and the loader run on a thread of its own; it must return. */
NMT_TEST(engine_loader_stops_on_abort) {
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(nmt_test_tmpdir(), 96, 23, &c));
  c.train_max_steps = 8;
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  nmt_trainer *t;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
  nmt__feed *f = &t->feeds[0];
  void *held[64];
  int n = 0;
  while (n < 64 && nmt_ring_try_pop(&f->free_slots, &held[n])) n++;
  atomic_store(&t->sync.shutdown, 0);
  atomic_store(&t->sync.abort, 1);
  nmt__loader *L = &t->loaders[0]; /* bound to the run at create: only the segment is set */
  L->start_step = 0, L->end_step = c.train_max_steps, L->start_epoch = 0, L->start_index = 0;
  pthread_t th;
  int started = pthread_create(&th, NULL, nmt__loader_main, L) == 0, joined = 0;
  if (started) {
    /* A hang detector, not a timing: the loader returns at once, or never. */
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 30;
    joined = pthread_timedjoin_np(th, NULL, &deadline) == 0;
    if (!joined) {
      atomic_store(&t->sync.shutdown, 1); /* release it, so the test ends */
      pthread_join(th, NULL);
    }
  }
  for (int i = 0; i < n; i++) nmt_ring_try_push(&f->free_slots, held[i]);
  atomic_store(&t->sync.abort, 0);
  nmt_trainer_destroy(t);
  printf("# %d free slots taken away, abort raised: the loader %s\n", n,
         joined ? "returned" : "was still waiting after 30 s (released by shutdown)");
  NMT_ASSERT(started);
  NMT_ASSERT(n >= 1);
  NMT_ASSERT(joined);
}
