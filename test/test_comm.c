/* test_comm.c — host communicator, nccl-tests style: every check counts the wrong elements and
 * prints the count. Ranks are threads; n = 1..4, counts 0, 1, 7, 1000, 1<<20.
 *  - exactness: integer-valued floats so the fp32 sum is exact and equals a double sum;
 *  - determinism: non-integer floats, every rank bitwise equal and equal to the in-order
 *    fp32 sum (((b0 + b1) + b2) + b3) the contract promises;
 *  - 200 consecutive collectives of varying size and kind, each rank checking its own result,
 *    to catch a rank racing into the next collective;
 *  - abort: a rank never arrives; the others must come back with NMT_ERR_ABORTED;
 *  - flush: a no-op that keeps results and reports an aborted group as NMT_ERR_ABORTED.
 * Every join has a 10 s watchdog that fails the test instead of hanging it. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nmt/comm.h"
#include "test.h"

#define MAX_RANKS 4
#define WATCHDOG_S 10

static const size_t counts[] = {0, 1, 7, 1000, 1u << 20};
#define N_COUNTS (sizeof counts / sizeof counts[0])

typedef struct {
  nmt_comm *c;
  float *buf;
  size_t count;
  int root;
  int op; /* 0 sum, 1 max, 2 broadcast, 3 barrier */
  nmt_status st;
  size_t wrong;          /* filled by rank functions that check their own results */
  const atomic_int *gate; /* barrier test: shared counter */
} rank_ctx;

/* Joins n rank threads within WATCHDOG_S. On timeout raises the group's abort so they can
 * leave, allows one more second, and detaches any thread still stuck; the caller must then
 * leak everything those threads can reach. Returns 1 if all joined in time. */
static int join_watchdog(pthread_t *t, int n, nmt_comm *any) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += WATCHDOG_S;
  for (int i = 0; i < n; i++) {
    if (pthread_timedjoin_np(t[i], NULL, &dl) == 0) continue;
    if (any) nmt_comm_abort(any);
    struct timespec grace;
    clock_gettime(CLOCK_REALTIME, &grace);
    grace.tv_sec += 1;
    for (int j = i; j < n; j++)
      if (pthread_timedjoin_np(t[j], NULL, &grace) != 0) pthread_detach(t[j]);
    return 0;
  }
  return 1;
}

/* Runs fn on n threads, one per ctx. Returns 1 if they all finished within the watchdog. */
static int run_ranks(int n, rank_ctx *ctx, void *(*fn)(void *)) {
  pthread_t t[MAX_RANKS];
  int started = 0;
  for (; started < n; started++)
    if (pthread_create(&t[started], NULL, fn, &ctx[started]) != 0) break;
  if (started < n) {
    nmt_comm_abort(ctx[0].c); /* the started ones would wait forever for the rest */
    join_watchdog(t, started, NULL);
    nmt_test_fail(__FILE__, __LINE__, "pthread_create failed for rank %d", started);
    return 0;
  }
  if (!join_watchdog(t, n, ctx[0].c)) {
    nmt_test_fail(__FILE__, __LINE__, "ranks did not finish within %d s (hang)", WATCHDOG_S);
    return 0;
  }
  return 1;
}

static void *do_op(void *p) {
  rank_ctx *x = p;
  switch (x->op) {
  case 0: x->st = nmt_comm_allreduce_sum(x->c, x->buf, x->count); break;
  case 1: x->st = nmt_comm_allreduce_max(x->c, x->buf, x->count); break;
  case 2: x->st = nmt_comm_broadcast(x->c, x->buf, x->count, x->root); break;
  default: x->st = nmt_comm_barrier(x->c); break;
  }
  return NULL;
}

/* Small integers in [-30, 30]: any sum of <= 4 of them is exact in fp32. */
static float int_val(int r, size_t i, unsigned salt) {
  return (float)((int)((r * 131u + i * 31u + salt * 17u) % 61u) - 30);
}

static uint64_t mix64(uint64_t x) { /* splitmix64 finalizer */
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/* Non-integer values in (-1, 1) with all 24 mantissa bits in play, so summation order
 * changes the rounded result. */
static float frac_val(int r, size_t i) {
  uint64_t h = mix64(((uint64_t)r << 40) ^ i);
  return (float)((double)(h >> 40) * 0x1p-24 * 2.0 - 1.0) * 0.999f;
}

/* Creates n comms and n buffers of `count` floats (NULL when count is 0, which the API
 * allows). */
static int setup(int n, size_t count, atomic_int *abort, nmt_comm **comms, float **bufs) {
  nmt_status st = nmt_comm_create_host(n, abort, comms);
  if (st != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "create_host(%d): %s", n, nmt_status_str(st));
    return 0;
  }
  for (int r = 0; r < n; r++) {
    bufs[r] = count ? malloc(count * sizeof(float)) : NULL;
    if (count && !bufs[r]) {
      nmt_test_fail(__FILE__, __LINE__, "out of memory");
      return 0;
    }
  }
  return 1;
}

static void teardown(int n, nmt_comm **comms, float **bufs) {
  for (int r = 0; r < n; r++) free(bufs[r]);
  nmt_comm_destroy(comms, n);
}

static int statuses_ok(int n, const rank_ctx *ctx, const char *what, size_t count) {
  for (int r = 0; r < n; r++)
    if (ctx[r].st != NMT_OK) {
      nmt_test_fail(__FILE__, __LINE__, "%s n=%d count=%zu: rank %d returned %s", what, n, count,
                    r, nmt_status_str(ctx[r].st));
      return 0;
    }
  return 1;
}

NMT_TEST(comm_create_and_ids) {
  nmt_comm *comms[MAX_RANKS];
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_host(0, NULL, comms), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(nmt_comm_create_host(3, NULL, comms));
  for (int r = 0; r < 3; r++) {
    NMT_ASSERT_EQ_INT(nmt_comm_rank(comms[r]), r);
    NMT_ASSERT_EQ_INT(nmt_comm_size(comms[r]), 3);
  }
  /* Arguments every rank would get wrong together are refused before any waiting. */
  float x = 0;
  NMT_ASSERT_EQ_STATUS(nmt_comm_broadcast(comms[0], &x, 1, 3), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_comm_allreduce_sum(comms[0], NULL, 5), NMT_ERR_INTERNAL);
  nmt_comm_destroy(comms, 3);
}

NMT_TEST(comm_allreduce_sum_exact) {
  for (int n = 1; n <= MAX_RANKS; n++) {
    for (size_t ci = 0; ci < N_COUNTS; ci++) {
      size_t count = counts[ci];
      nmt_comm *comms[MAX_RANKS];
      float *bufs[MAX_RANKS];
      if (!setup(n, count, NULL, comms, bufs)) return;
      rank_ctx ctx[MAX_RANKS];
      for (int r = 0; r < n; r++) {
        for (size_t i = 0; i < count; i++) bufs[r][i] = int_val(r, i, 0);
        ctx[r] = (rank_ctx){.c = comms[r], .buf = bufs[r], .count = count, .op = 0};
      }
      if (!run_ranks(n, ctx, do_op)) return;
      if (!statuses_ok(n, ctx, "allreduce_sum", count)) return;
      size_t wrong = 0;
      for (size_t i = 0; i < count; i++) {
        double want = 0;
        for (int r = 0; r < n; r++) want += int_val(r, i, 0);
        for (int r = 0; r < n; r++) wrong += (double)bufs[r][i] != want;
      }
      teardown(n, comms, bufs);
      if (wrong)
        nmt_test_fail(__FILE__, __LINE__, "allreduce_sum n=%d count=%zu: #wrong %zu of %zu", n,
                      count, wrong, count * (size_t)n);
      if (nmt_test_failed()) return;
    }
  }
}

NMT_TEST(comm_allreduce_sum_bitwise_identical) {
  for (int n = 2; n <= MAX_RANKS; n++) {
    for (size_t ci = 1; ci < N_COUNTS; ci++) {
      size_t count = counts[ci];
      nmt_comm *comms[MAX_RANKS];
      float *bufs[MAX_RANKS];
      if (!setup(n, count, NULL, comms, bufs)) return;
      rank_ctx ctx[MAX_RANKS];
      for (int r = 0; r < n; r++) {
        for (size_t i = 0; i < count; i++) bufs[r][i] = frac_val(r, i);
        ctx[r] = (rank_ctx){.c = comms[r], .buf = bufs[r], .count = count, .op = 0};
      }
      if (!run_ranks(n, ctx, do_op)) return;
      if (!statuses_ok(n, ctx, "allreduce_sum", count)) return;
      size_t differ = 0, not_in_order = 0, far = 0;
      for (size_t i = 0; i < count; i++) {
        float in_order = frac_val(0, i);
        double exact = frac_val(0, i);
        for (int r = 1; r < n; r++) {
          in_order += frac_val(r, i);
          exact += frac_val(r, i);
        }
        for (int r = 1; r < n; r++)
          differ += memcmp(&bufs[r][i], &bufs[0][i], sizeof(float)) != 0;
        not_in_order += memcmp(&bufs[0][i], &in_order, sizeof(float)) != 0;
        double d = bufs[0][i] - exact;
        far += !(d <= 1e-6 && d >= -1e-6);
      }
      teardown(n, comms, bufs);
      if (differ || not_in_order || far)
        nmt_test_fail(__FILE__, __LINE__,
                      "n=%d count=%zu: #wrong %zu differ across ranks, %zu differ from the "
                      "rank-order fp32 sum, %zu off the double sum by > 1e-6",
                      n, count, differ, not_in_order, far);
      if (nmt_test_failed()) return;
    }
  }
}

NMT_TEST(comm_allreduce_max) {
  for (int n = 1; n <= MAX_RANKS; n++) {
    for (size_t ci = 0; ci < N_COUNTS; ci++) {
      size_t count = counts[ci];
      nmt_comm *comms[MAX_RANKS];
      float *bufs[MAX_RANKS];
      if (!setup(n, count, NULL, comms, bufs)) return;
      rank_ctx ctx[MAX_RANKS];
      for (int r = 0; r < n; r++) {
        for (size_t i = 0; i < count; i++) bufs[r][i] = frac_val(r, i) * 100.0f;
        ctx[r] = (rank_ctx){.c = comms[r], .buf = bufs[r], .count = count, .op = 1};
      }
      if (!run_ranks(n, ctx, do_op)) return;
      if (!statuses_ok(n, ctx, "allreduce_max", count)) return;
      size_t wrong = 0;
      for (size_t i = 0; i < count; i++) {
        float want = frac_val(0, i) * 100.0f;
        for (int r = 1; r < n; r++) {
          float v = frac_val(r, i) * 100.0f;
          if (v > want) want = v;
        }
        for (int r = 0; r < n; r++) wrong += bufs[r][i] != want;
      }
      teardown(n, comms, bufs);
      if (wrong)
        nmt_test_fail(__FILE__, __LINE__, "allreduce_max n=%d count=%zu: #wrong %zu", n, count,
                      wrong);
      if (nmt_test_failed()) return;
    }
  }
}

/* The fp16 overflow flag is reduced with max: a NaN or inf on one rank must reach all. */
NMT_TEST(comm_allreduce_max_propagates_nan_inf) {
  const int n = 3;
  nmt_comm *comms[MAX_RANKS];
  float *bufs[MAX_RANKS];
  if (!setup(n, 3, NULL, comms, bufs)) return;
  rank_ctx ctx[MAX_RANKS];
  for (int r = 0; r < n; r++) {
    bufs[r][0] = (float)r;
    bufs[r][1] = r == 1 ? __builtin_nanf("") : (float)r; /* NaN in the middle rank */
    bufs[r][2] = r == 0 ? __builtin_inff() : 1.0f;
    ctx[r] = (rank_ctx){.c = comms[r], .buf = bufs[r], .count = 3, .op = 1};
  }
  if (!run_ranks(n, ctx, do_op)) return;
  if (!statuses_ok(n, ctx, "allreduce_max", 3)) return;
  size_t wrong = 0;
  for (int r = 0; r < n; r++) {
    wrong += bufs[r][0] != 2.0f;
    wrong += bufs[r][1] == bufs[r][1]; /* must be NaN */
    wrong += bufs[r][2] != __builtin_inff();
  }
  teardown(n, comms, bufs);
  if (wrong) nmt_test_fail(__FILE__, __LINE__, "max with NaN/inf: #wrong %zu of 9", wrong);
}

NMT_TEST(comm_broadcast_each_root) {
  for (int n = 1; n <= MAX_RANKS; n++) {
    for (int root = 0; root < n; root++) {
      for (size_t ci = 0; ci < N_COUNTS; ci++) {
        size_t count = counts[ci];
        nmt_comm *comms[MAX_RANKS];
        float *bufs[MAX_RANKS];
        if (!setup(n, count, NULL, comms, bufs)) return;
        rank_ctx ctx[MAX_RANKS];
        for (int r = 0; r < n; r++) {
          for (size_t i = 0; i < count; i++) bufs[r][i] = frac_val(r, i);
          ctx[r] = (rank_ctx){.c = comms[r], .buf = bufs[r], .count = count, .op = 2,
                              .root = root};
        }
        if (!run_ranks(n, ctx, do_op)) return;
        if (!statuses_ok(n, ctx, "broadcast", count)) return;
        size_t wrong = 0;
        for (size_t i = 0; i < count; i++) {
          float want = frac_val(root, i);
          for (int r = 0; r < n; r++) wrong += memcmp(&bufs[r][i], &want, sizeof want) != 0;
        }
        teardown(n, comms, bufs);
        if (wrong)
          nmt_test_fail(__FILE__, __LINE__, "broadcast n=%d root=%d count=%zu: #wrong %zu", n,
                        root, count, wrong);
        if (nmt_test_failed()) return;
      }
    }
  }
}

/* Nobody may leave barrier k before everyone has entered it: each rank bumps a shared counter
 * before barrier k and must then see at least n*(k+1). */
static void *barrier_rank(void *p) {
  rank_ctx *x = p;
  atomic_int *gate = (atomic_int *)x->gate;
  int n = nmt_comm_size(x->c);
  x->st = NMT_OK;
  x->wrong = 0;
  for (int k = 0; k < 2000 && x->st == NMT_OK; k++) {
    atomic_fetch_add(gate, 1);
    x->st = nmt_comm_barrier(x->c);
    if (atomic_load(gate) < n * (k + 1)) x->wrong++;
    /* A second barrier so nobody bumps for k+1 before everyone has checked k. */
    if (x->st == NMT_OK) x->st = nmt_comm_barrier(x->c);
  }
  return NULL;
}

NMT_TEST(comm_barrier_orders_ranks) {
  for (int n = 1; n <= MAX_RANKS; n++) {
    nmt_comm *comms[MAX_RANKS];
    NMT_ASSERT_OK(nmt_comm_create_host(n, NULL, comms));
    atomic_int gate = 0;
    rank_ctx ctx[MAX_RANKS];
    for (int r = 0; r < n; r++) ctx[r] = (rank_ctx){.c = comms[r], .gate = &gate};
    if (!run_ranks(n, ctx, barrier_rank)) return;
    if (!statuses_ok(n, ctx, "barrier", 0)) return;
    size_t wrong = 0;
    for (int r = 0; r < n; r++) wrong += ctx[r].wrong;
    nmt_comm_destroy(comms, n);
    if (wrong) nmt_test_fail(__FILE__, __LINE__, "barrier n=%d: %zu early exits", n, wrong);
    NMT_ASSERT_EQ_INT(atomic_load(&gate), n * 2000);
  }
}

/* 200 collectives back to back, each of a different size and kind, reusing one buffer per
 * rank. Each rank fills its buffer for iteration k right after collective k-1 returns, so a
 * peer still reading or writing iteration k-1 data would corrupt someone's result. */
#define STRESS_ITERS 200
#define STRESS_MAX 20000

static size_t stress_count(int k) { return (size_t)(mix64((uint64_t)k) % STRESS_MAX); }

static void *stress_rank(void *p) {
  rank_ctx *x = p;
  int n = nmt_comm_size(x->c), me = nmt_comm_rank(x->c);
  x->st = NMT_OK;
  x->wrong = 0;
  for (int k = 0; k < STRESS_ITERS && x->st == NMT_OK; k++) {
    size_t count = stress_count(k);
    int op = k % 3, root = (k / 3) % n;
    for (size_t i = 0; i < count; i++) x->buf[i] = int_val(me, i, (unsigned)k);
    switch (op) {
    case 0: x->st = nmt_comm_allreduce_sum(x->c, x->buf, count); break;
    case 1: x->st = nmt_comm_allreduce_max(x->c, x->buf, count); break;
    default: x->st = nmt_comm_broadcast(x->c, x->buf, count, root); break;
    }
    for (size_t i = 0; i < count && x->st == NMT_OK; i++) {
      float want;
      if (op == 2) {
        want = int_val(root, i, (unsigned)k);
      } else {
        want = int_val(0, i, (unsigned)k);
        for (int r = 1; r < n; r++) {
          float v = int_val(r, i, (unsigned)k);
          want = op == 0 ? want + v : (v > want ? v : want);
        }
      }
      x->wrong += x->buf[i] != want;
    }
  }
  return NULL;
}

NMT_TEST(comm_consecutive_collectives) {
  for (int n = 2; n <= MAX_RANKS; n++) {
    nmt_comm *comms[MAX_RANKS];
    float *bufs[MAX_RANKS];
    if (!setup(n, STRESS_MAX, NULL, comms, bufs)) return;
    rank_ctx ctx[MAX_RANKS];
    for (int r = 0; r < n; r++) ctx[r] = (rank_ctx){.c = comms[r], .buf = bufs[r]};
    if (!run_ranks(n, ctx, stress_rank)) return;
    if (!statuses_ok(n, ctx, "consecutive collectives", 0)) return;
    size_t wrong = 0;
    for (int r = 0; r < n; r++) wrong += ctx[r].wrong;
    teardown(n, comms, bufs);
    if (wrong)
      nmt_test_fail(__FILE__, __LINE__, "n=%d, %d collectives: #wrong %zu", n, STRESS_ITERS,
                    wrong);
    if (nmt_test_failed()) return;
  }
}

typedef struct {
  nmt_comm *c;
} aborter_arg;

static void *aborter(void *p) {
  nanosleep(&(struct timespec){0, 100 * 1000 * 1000}, NULL);
  nmt_comm_abort(((aborter_arg *)p)->c);
  return NULL;
}

/* Ranks 0..n-2 enter `op`; rank n-1 never arrives; a third party aborts after 100 ms. */
static void abort_case(int n, int op, atomic_int *shared) {
  nmt_comm *comms[MAX_RANKS];
  float *bufs[MAX_RANKS];
  if (!setup(n, 1000, shared, comms, bufs)) return;
  rank_ctx ctx[MAX_RANKS];
  for (int r = 0; r < n - 1; r++) {
    for (size_t i = 0; i < 1000; i++) bufs[r][i] = 1.0f;
    ctx[r] = (rank_ctx){.c = comms[r], .buf = bufs[r], .count = 1000, .op = op, .st = NMT_OK};
  }
  pthread_t ab;
  aborter_arg aa = {comms[n - 1]};
  NMT_ASSERT(pthread_create(&ab, NULL, aborter, &aa) == 0);
  if (!run_ranks(n - 1, ctx, do_op)) {
    nmt_test_fail(__FILE__, __LINE__, "op %d n=%d: waiting ranks not released by abort", op, n);
    pthread_detach(ab);
    return; /* comms and buffers leaked on purpose: stuck threads may still touch them */
  }
  pthread_join(ab, NULL);
  for (int r = 0; r < n - 1; r++)
    if (ctx[r].st != NMT_ERR_ABORTED) {
      nmt_test_fail(__FILE__, __LINE__, "op %d n=%d: rank %d returned %s, want NMT_ERR_ABORTED",
                    op, n, r, nmt_status_str(ctx[r].st));
      return;
    }
  if (shared) NMT_ASSERT(atomic_load(shared) != 0); /* the run's flag is the one raised */
  /* Entering a collective after the abort fails at once, even the missing rank's. */
  float x = 0;
  NMT_ASSERT_EQ_STATUS(nmt_comm_allreduce_sum(comms[n - 1], &x, 1), NMT_ERR_ABORTED);
  NMT_ASSERT_EQ_STATUS(nmt_comm_barrier(comms[0]), NMT_ERR_ABORTED);
  teardown(n, comms, bufs);
}

NMT_TEST(comm_abort_releases_waiting_ranks) {
  atomic_int shared = 0;
  abort_case(3, 0, &shared); /* allreduce, the run's abort flag */
  if (nmt_test_failed()) return;
  abort_case(4, 3, NULL); /* barrier, the group's own flag */
  if (nmt_test_failed()) return;
  abort_case(2, 2, NULL); /* broadcast */
}

/* A flag raised elsewhere in the run (a loader failing) stops the group too. */
NMT_TEST(comm_abort_by_shared_flag) {
  atomic_int shared = 0;
  nmt_comm *comms[2];
  NMT_ASSERT_OK(nmt_comm_create_host(2, &shared, comms));
  atomic_store(&shared, 1);
  float x = 1;
  NMT_ASSERT_EQ_STATUS(nmt_comm_allreduce_sum(comms[0], &x, 1), NMT_ERR_ABORTED);
  nmt_comm_destroy(comms, 2);
}

/* flush: the host communicator's collectives are complete when they return, so flush must
 * leave every rank's result as it is (and work with nothing to flush), and it must report an
 * aborted group like a collective does, whichever flag was raised. */
static void *sum_then_flush(void *p) {
  rank_ctx *x = p;
  x->st = nmt_comm_flush(x->c); /* nothing issued yet */
  if (x->st == NMT_OK) x->st = nmt_comm_allreduce_sum(x->c, x->buf, x->count);
  if (x->st == NMT_OK) x->st = nmt_comm_flush(x->c);
  if (x->st == NMT_OK) x->st = nmt_comm_flush(x->c); /* twice in a row */
  return NULL;
}

NMT_TEST(comm_flush_host_keeps_results) {
  const size_t count = 1000;
  for (int n = 1; n <= MAX_RANKS; n++) {
    nmt_comm *comms[MAX_RANKS];
    float *bufs[MAX_RANKS];
    if (!setup(n, count, NULL, comms, bufs)) return;
    rank_ctx ctx[MAX_RANKS];
    for (int r = 0; r < n; r++) {
      for (size_t i = 0; i < count; i++) bufs[r][i] = int_val(r, i, 7);
      ctx[r] = (rank_ctx){.c = comms[r], .buf = bufs[r], .count = count};
    }
    if (!run_ranks(n, ctx, sum_then_flush)) return;
    if (!statuses_ok(n, ctx, "allreduce_sum + flush", count)) return;
    size_t wrong = 0;
    for (size_t i = 0; i < count; i++) {
      double want = 0;
      for (int r = 0; r < n; r++) want += int_val(r, i, 7);
      for (int r = 0; r < n; r++) wrong += (double)bufs[r][i] != want;
    }
    teardown(n, comms, bufs);
    if (wrong)
      nmt_test_fail(__FILE__, __LINE__, "flush n=%d: #wrong %zu of %zu", n, wrong,
                    count * (size_t)n);
    if (nmt_test_failed()) return;
  }
}

NMT_TEST(comm_flush_host_reports_abort) {
  nmt_comm *comms[2];
  NMT_ASSERT_OK(nmt_comm_create_host(2, NULL, comms));
  NMT_ASSERT_OK(nmt_comm_flush(comms[1]));
  nmt_comm_abort(comms[0]); /* the group's own flag */
  NMT_ASSERT_EQ_STATUS(nmt_comm_flush(comms[0]), NMT_ERR_ABORTED);
  NMT_ASSERT_EQ_STATUS(nmt_comm_flush(comms[1]), NMT_ERR_ABORTED);
  nmt_comm_abort(comms[1]); /* idempotent */
  NMT_ASSERT_EQ_STATUS(nmt_comm_flush(comms[1]), NMT_ERR_ABORTED);
  nmt_comm_destroy(comms, 2);

  atomic_int shared = 0; /* the run's flag, raised elsewhere (a loader failing) */
  NMT_ASSERT_OK(nmt_comm_create_host(2, &shared, comms));
  NMT_ASSERT_OK(nmt_comm_flush(comms[0]));
  atomic_store(&shared, 1);
  NMT_ASSERT_EQ_STATUS(nmt_comm_flush(comms[0]), NMT_ERR_ABORTED);
  nmt_comm_destroy(comms, 2);
}
