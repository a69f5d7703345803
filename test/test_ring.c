/* test_ring.c — SPSC ring: a single-thread model check, a two-thread stress over 1e6 items at
 * capacities that force constant wrap-around and full/empty transitions, index wrap at
 * SIZE_MAX, and abort unblocking a blocked push and pop. */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "nmt/ring.h"
#include "test.h"

/* Joins n threads within timeout_s. On timeout raises *abort (if given) so they can leave,
 * allows one more second, and detaches whatever is still stuck (its memory is then leaked on
 * purpose, since a stuck thread may still use it). Returns 1 if all joined in time. */
static int join_watchdog(pthread_t *t, int n, atomic_int *abort, double timeout_s) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += (time_t)timeout_s;
  int ok = 1;
  for (int i = 0; i < n; i++) {
    if (pthread_timedjoin_np(t[i], NULL, &dl) == 0) continue;
    ok = 0;
    if (abort) atomic_store(abort, 1);
    struct timespec grace;
    clock_gettime(CLOCK_REALTIME, &grace);
    grace.tv_sec += 1;
    for (int j = i; j < n; j++)
      if (pthread_timedjoin_np(t[j], NULL, &grace) != 0) pthread_detach(t[j]);
    break;
  }
  return ok;
}

NMT_TEST(ring_init_rejects_bad_capacity) {
  nmt_ring r;
  size_t bad[] = {0, 1, 3, 6, 1000};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    NMT_ASSERT_EQ_STATUS(nmt_ring_init(&r, bad[i]), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(nmt_ring_init(&r, 2));
  nmt_ring_free(&r);
  NMT_ASSERT_OK(nmt_ring_init(&r, 1024));
  nmt_ring_free(&r);
}

/* Random interleaving of pushes and pops against a plain array FIFO model. */
static void model_check(nmt_ring *r, size_t cap, int ops) {
  uintptr_t *model = malloc((size_t)ops * sizeof *model);
  size_t mh = 0, mt = 0; /* model head/tail */
  uintptr_t next = 1;
  uint32_t s = 12345;
  int wrong = 0;
  for (int k = 0; k < ops && model; k++) {
    s = s * 1664525u + 1013904223u;
    if ((s >> 16) & 1) {
      int pushed = nmt_ring_try_push(r, (void *)next);
      int expect = (mh - mt) < cap;
      if (pushed != expect) wrong++;
      if (pushed) model[mh++] = next;
      next++;
    } else {
      void *it = NULL;
      int popped = nmt_ring_try_pop(r, &it);
      int expect = mh != mt;
      if (popped != expect) wrong++;
      if (popped && expect && (uintptr_t)it != model[mt]) wrong++;
      if (popped && expect) mt++;
    }
    if (nmt_ring_size(r) != mh - mt) wrong++;
  }
  free(model);
  if (wrong) nmt_test_fail(__FILE__, __LINE__, "capacity %zu: %d wrong results of %d ops", cap,
                           wrong, ops);
}

NMT_TEST(ring_single_thread_full_empty) {
  nmt_ring r;
  NMT_ASSERT_OK(nmt_ring_init(&r, 4));
  void *it = NULL;
  NMT_ASSERT_EQ_INT(nmt_ring_try_pop(&r, &it), 0);
  for (uintptr_t i = 1; i <= 4; i++) NMT_ASSERT_EQ_INT(nmt_ring_try_push(&r, (void *)i), 1);
  NMT_ASSERT_EQ_INT(nmt_ring_try_push(&r, (void *)99), 0);
  NMT_ASSERT_EQ_INT(nmt_ring_size(&r), 4);
  for (uintptr_t i = 1; i <= 4; i++) {
    NMT_ASSERT_EQ_INT(nmt_ring_try_pop(&r, &it), 1);
    NMT_ASSERT_EQ_INT((uintptr_t)it, i);
  }
  NMT_ASSERT_EQ_INT(nmt_ring_try_pop(&r, &it), 0);
  NMT_ASSERT_EQ_INT(nmt_ring_size(&r), 0);
  nmt_ring_free(&r);

  size_t caps[] = {2, 4, 8};
  for (size_t c = 0; c < 3; c++) {
    NMT_ASSERT_OK(nmt_ring_init(&r, caps[c]));
    model_check(&r, caps[c], 100000);
    nmt_ring_free(&r);
    if (nmt_test_failed()) return;
  }
}

/* Free-running indices must survive wrapping past SIZE_MAX. */
NMT_TEST(ring_index_wraps_at_size_max) {
  nmt_ring r;
  NMT_ASSERT_OK(nmt_ring_init(&r, 4));
  atomic_store(&r.head, SIZE_MAX - 5);
  atomic_store(&r.tail, SIZE_MAX - 5);
  model_check(&r, 4, 1000);
  NMT_ASSERT(atomic_load(&r.head) < 1000); /* it really wrapped */
  nmt_ring_free(&r);
}

typedef struct {
  nmt_ring *r;
  size_t n;
  atomic_int *abort;
  nmt_status st;
  size_t wrong, got, max_size;
} spsc_arg;

static void *producer(void *p) {
  spsc_arg *a = p;
  a->st = NMT_OK;
  for (size_t i = 0; i < a->n && a->st == NMT_OK; i++) {
    /* Alternate the non-blocking and blocking paths so both see full rings. */
    if ((i & 1) && nmt_ring_try_push(a->r, (void *)(uintptr_t)(i + 1))) continue;
    a->st = nmt_ring_push(a->r, (void *)(uintptr_t)(i + 1), a->abort);
  }
  return NULL;
}

static void *consumer(void *p) {
  spsc_arg *a = p;
  a->st = NMT_OK;
  a->wrong = a->got = a->max_size = 0;
  for (size_t i = 0; i < a->n; i++) {
    void *it = NULL;
    if (!((i & 2) && nmt_ring_try_pop(a->r, &it))) {
      a->st = nmt_ring_pop(a->r, &it, a->abort);
      if (a->st != NMT_OK) break;
    }
    if ((uintptr_t)it != i + 1) a->wrong++;
    a->got++;
    size_t s = nmt_ring_size(a->r);
    if (s > a->max_size) a->max_size = s;
  }
  return NULL;
}

NMT_TEST(ring_spsc_stress) {
  size_t caps[] = {2, 4, 1024};
  const size_t n = 1000000;
  for (size_t c = 0; c < 3; c++) {
    nmt_ring r;
    atomic_int abort = 0;
    NMT_ASSERT_OK(nmt_ring_init(&r, caps[c]));
    spsc_arg pa = {.r = &r, .n = n, .abort = &abort};
    spsc_arg ca = {.r = &r, .n = n, .abort = &abort};
    pthread_t t[2];
    NMT_ASSERT(pthread_create(&t[0], NULL, producer, &pa) == 0);
    NMT_ASSERT(pthread_create(&t[1], NULL, consumer, &ca) == 0);
    if (!join_watchdog(t, 2, &abort, 60)) {
      nmt_test_fail(__FILE__, __LINE__, "capacity %zu: threads did not finish in 60 s", caps[c]);
      return; /* ring leaked: a detached thread may still use it */
    }
    NMT_ASSERT_OK(pa.st);
    NMT_ASSERT_OK(ca.st);
    if (ca.wrong)
      nmt_test_fail(__FILE__, __LINE__, "capacity %zu: %zu of %zu items out of order", caps[c],
                    ca.wrong, n);
    NMT_ASSERT_EQ_INT(ca.got, n);
    NMT_ASSERT(ca.max_size <= caps[c]);
    void *it;
    NMT_ASSERT_EQ_INT(nmt_ring_try_pop(&r, &it), 0);
    nmt_ring_free(&r);
    if (nmt_test_failed()) return;
  }
}

typedef struct {
  nmt_ring *r;
  atomic_int *abort;
  int push; /* 1: push, 0: pop */
  int second; /* 1: through nmt_ring_*_any, the abort flag as its second flag */
  nmt_status st;
  atomic_int done;
} block_arg;

static void *blocker(void *p) {
  block_arg *a = p;
  void *it = NULL;
  /* second: the raised flag is the second of two (the first never rises). */
  atomic_int never = 0;
  if (a->second)
    a->st = a->push ? nmt_ring_push_any(a->r, (void *)(uintptr_t)7, &never, a->abort)
                    : nmt_ring_pop_any(a->r, &it, &never, a->abort);
  else
    a->st = a->push ? nmt_ring_push(a->r, (void *)(uintptr_t)7, a->abort)
                    : nmt_ring_pop(a->r, &it, a->abort);
  atomic_store(&a->done, 1);
  return NULL;
}

static void abort_case(int push, int second) {
  nmt_ring r;
  atomic_int abort = 0;
  NMT_ASSERT_OK(nmt_ring_init(&r, 2));
  if (push) { /* fill it so the push must block */
    NMT_ASSERT_EQ_INT(nmt_ring_try_push(&r, (void *)1), 1);
    NMT_ASSERT_EQ_INT(nmt_ring_try_push(&r, (void *)2), 1);
  }
  block_arg a = {.r = &r, .abort = &abort, .push = push, .second = second, .st = NMT_OK};
  atomic_init(&a.done, 0);
  pthread_t t;
  NMT_ASSERT(pthread_create(&t, NULL, blocker, &a) == 0);
  nanosleep(&(struct timespec){0, 100 * 1000 * 1000}, NULL);
  /* Still blocked: nothing could complete the operation. */
  NMT_ASSERT_EQ_INT(atomic_load(&a.done), 0);
  atomic_store(&abort, 1);
  if (!join_watchdog(&t, 1, NULL, 10)) {
    nmt_test_fail(__FILE__, __LINE__, "blocked %s did not return within 10 s of abort",
                  push ? "push" : "pop");
    return; /* ring leaked on purpose */
  }
  NMT_ASSERT_EQ_STATUS(a.st, NMT_ERR_ABORTED);
  /* Items already queued are not lost by an abort. */
  void *it = NULL;
  if (push) {
    NMT_ASSERT_OK(nmt_ring_pop(&r, &it, &abort));
    NMT_ASSERT_EQ_INT((uintptr_t)it, 1);
  } else {
    NMT_ASSERT_EQ_STATUS(nmt_ring_pop(&r, &it, &abort), NMT_ERR_ABORTED);
  }
  nmt_ring_free(&r);
}

NMT_TEST(ring_abort_unblocks_pop) { abort_case(0, 0); }
NMT_TEST(ring_abort_unblocks_push) { abort_case(1, 0); }
NMT_TEST(ring_second_flag_unblocks_pop) { abort_case(0, 1); }
NMT_TEST(ring_second_flag_unblocks_push) { abort_case(1, 1); }
