/* test_comm.c — host communicator, nccl-tests style: every check counts the wrong elements and
 * prints the count. Ranks are threads; n = 1..4, counts 0, 1, 7, 1000, 1<<20.
 *  - exactness: integer-valued floats so the fp32 sum is exact and equals a double sum;
 *  - determinism: non-integer floats, every rank bitwise equal and equal to the in-order
 *    fp32 sum (((b0 + b1) + b2) + b3) the contract promises;
 *  - 200 consecutive collectives of varying size and kind, each rank checking its own result,
 *    to catch a rank racing into the next collective;
 *  - abort: a rank never arrives; the others must come back with NMT_ERR_ABORTED;
 *  - flush: a no-op that keeps results and reports an aborted group as NMT_ERR_ABORTED;
 *  - half wire (allreduce_sum_as): fp32, fp16 and bf16 results, each bitwise equal on every
 *    rank and to an emulation written here in double (round to nearest even through nearbyint,
 *    rank-order accumulation rounded after every addition), on values that make the three
 *    differ; fp16 overflow is inf (or NaN for inf - inf) on every rank; the reservation and
 *    wire-type checks.
 * Every join has a 10 s watchdog that fails the test instead of hanging it. */
#include <math.h>
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
  int op; /* 0 sum, 1 max, 2 broadcast, 3 barrier, 4 sum_as, 5 reduce_scatter_sum_as (count per
          * rank), 6 all_gather (count per rank, element type in .wire) */
  nmt_grad_dtype wire; /* ops 4, 5, 6 */
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
  case 4: x->st = nmt_comm_allreduce_sum_as(x->c, x->buf, x->count, x->wire); break;
  case 5: x->st = nmt_comm_reduce_scatter_sum_as(x->c, x->buf, x->count, x->wire); break;
  case 6: x->st = nmt_comm_all_gather(x->c, x->buf, x->count, x->wire); break;
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
    /* ZeRO's collectives take the count per rank: n x count must fit the 1000 floats. */
    const size_t count = op >= 5 ? 1000 / (size_t)n : 1000;
    ctx[r] = (rank_ctx){.c = comms[r], .buf = bufs[r], .count = count, .op = op, .st = NMT_OK};
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
  if (nmt_test_failed()) return;
  atomic_int fresh = 0; /* `shared` is raised by now: a group over it would never wait */
  abort_case(3, 5, &fresh); /* reduce-scatter: ZeRO's gradient reduction */
  if (nmt_test_failed()) return;
  abort_case(4, 6, NULL); /* all-gather: ZeRO's weight exchange */
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

/* ------------------------------------------------------------------------------------------ */
/* half wire: nmt_comm_allreduce_sum_as */

/* The value nearest to x in a binary format with `digits` significant bits, smallest normal
 * 2^emin and largest finite `max`: ties to even (nearbyint in the default rounding mode),
 * gradual underflow (below 2^emin the quantum stays 2^(emin+1-digits)), overflow to +-inf.
 * Written in double, independently of the bit manipulations of nmt_half_round_fp16/bf16. */
static double emu_round(double x, int digits, int emin, double max) {
  if (x != x || isinf(x)) return x;
  int e;
  frexp(x, &e); /* |x| = f 2^e, f in [0.5, 1): one unit in the last place is 2^(e - digits) */
  if (e - 1 < emin) e = emin + 1;
  double q = ldexp(1.0, e - digits), r = nearbyint(x / q) * q;
  return fabs(r) > max ? copysign(INFINITY, x) : r;
}

static double emu_wire(double x, nmt_grad_dtype wire) {
  if (wire == NMT_GRAD_FP16) return emu_round(x, 11, -14, 65504.0);
  if (wire == NMT_GRAD_BF16) return emu_round(x, 8, -126, ldexp(255.0, 120)); /* (2-2^-7)2^127 */
  return (float)x;
}

/* What rank-order summation in the wire type gives: inputs rounded, then every addition (exact
 * in double for two halves; for bf16, double's 53 bits >= 2*8+2 make rounding the double sum
 * innocuous) rounded to the wire type. For fp32 this is the in-order float sum. */
static float emu_sum(const float *vals, int n, nmt_grad_dtype wire) {
  double acc = emu_wire(vals[0], wire);
  for (int r = 1; r < n; r++) acc = emu_wire(acc + emu_wire(vals[r], wire), wire);
  return (float)acc;
}

/* Random sign, 24 random significand bits and a binary exponent in [-20, 5]: fp16 subnormals
 * (below 2^-14) and normals, so rounding to fp16 (11 bits) and bf16 (8 bits) both change most
 * values, and the order of rounding matters. */
static float wire_val(int r, size_t i) {
  uint64_t h = mix64(((uint64_t)(r + 1) << 44) ^ (i * 0x2545F4914F6CDD1Dull));
  float m = (float)(((h >> 40) | 0x800000u) & 0xffffffu) * 0x1p-24f; /* [0.5, 1) */
  int e = (int)((h >> 8) % 26u) - 20;
  return (h & 1u ? -1.0f : 1.0f) * ldexpf(m, e);
}

static const nmt_grad_dtype wires[] = {NMT_GRAD_FP32, NMT_GRAD_FP16, NMT_GRAD_BF16};

/* One all-reduce of wire_val over n ranks on threads; result[r] gets rank r's buffer (the
 * caller frees). 0 on failure (recorded). */
static int run_sum_as(int n, size_t count, nmt_grad_dtype wire, float **result) {
  nmt_comm *comms[MAX_RANKS];
  if (!setup(n, count, NULL, comms, result)) return 0;
  rank_ctx ctx[MAX_RANKS];
  for (int r = 0; r < n; r++) {
    for (size_t i = 0; i < count; i++) result[r][i] = wire_val(r, i);
    nmt_status st = nmt_comm_reserve(comms[r], count);
    if (st != NMT_OK) {
      nmt_test_fail(__FILE__, __LINE__, "reserve(%zu) on rank %d: %s", count, r,
                    nmt_status_str(st));
      return 0;
    }
    ctx[r] = (rank_ctx){.c = comms[r], .buf = result[r], .count = count, .op = 4, .wire = wire};
  }
  if (!run_ranks(n, ctx, do_op)) return 0;
  nmt_comm_destroy(comms, n);
  return statuses_ok(n, ctx, nmt_comm_wire_name(wire), count);
}

NMT_TEST(comm_allreduce_sum_as_matches_emulation) {
  for (int n = 1; n <= MAX_RANKS; n++) {
    for (size_t ci = 0; ci < N_COUNTS; ci++) {
      const size_t count = counts[ci];
      float *res[3][MAX_RANKS] = {{NULL}};
      int ok = 1;
      for (int w = 0; w < 3 && ok; w++) ok = run_sum_as(n, count, wires[w], res[w]);
      size_t differ[3] = {0}, wrong[3] = {0}, fp32_vs_16 = 0, fp16_vs_bf16 = 0, once = 0;
      for (size_t i = 0; ok && i < count; i++) {
        float vals[MAX_RANKS];
        for (int r = 0; r < n; r++) vals[r] = wire_val(r, i);
        for (int w = 0; w < 3; w++) {
          const float want = emu_sum(vals, n, wires[w]);
          wrong[w] += memcmp(&res[w][0][i], &want, sizeof want) != 0;
          for (int r = 1; r < n; r++) differ[w] += memcmp(&res[w][r][i], &res[w][0][i], 4) != 0;
        }
        fp32_vs_16 += res[0][0][i] != res[1][0][i];
        fp16_vs_bf16 += res[1][0][i] != res[2][0][i];
        /* A plausible mistake: sum the rounded inputs exactly, round once at the end. */
        double exact = 0;
        for (int r = 0; r < n; r++) exact += emu_wire(vals[r], NMT_GRAD_FP16);
        once += (float)emu_wire(exact, NMT_GRAD_FP16) != res[1][0][i];
      }
      for (int w = 0; w < 3; w++)
        for (int r = 0; r < n; r++) free(res[w][r]);
      if (!ok) return;
      for (int w = 0; w < 3; w++)
        if (wrong[w] || differ[w])
          nmt_test_fail(__FILE__, __LINE__,
                        "sum_as(%s) n=%d count=%zu: #wrong %zu differ from the emulation, %zu "
                        "differ across ranks", nmt_comm_wire_name(wires[w]), n, count, wrong[w],
                        differ[w]);
      /* The data must tell the wire types (and the rounding of each addition) apart, or the
       * comparisons above prove nothing. */
      if (count >= 1000 && (fp32_vs_16 < count / 2 || fp16_vs_bf16 < count / 2 ||
                            (n >= 3 && once == 0)))
        nmt_test_fail(__FILE__, __LINE__,
                      "n=%d count=%zu: test data too tame: fp32 != fp16 at %zu, fp16 != bf16 at "
                      "%zu, per-addition rounding visible at %zu elements", n, count,
                      fp32_vs_16, fp16_vs_bf16, once);
      if (nmt_test_failed()) return;
    }
  }
}

/* fp16 overflows to inf like a real conversion, and the same non-finite value reaches every
 * rank; bf16 (fp32's range) keeps the same sums finite. */
NMT_TEST(comm_allreduce_sum_as_fp16_overflow) {
  enum { N = 2, COUNT = 6 };
  /* element: rank 0, rank 1 -> fp16 result
   *  0: 40000 + 30000 (each exact in fp16)  -> +inf (70000 > 65504)
   *  1: 70000 + -1                           -> +inf (70000 is already inf on the wire)
   *  2: 65520 + -70000                       -> NaN  (inf + -inf; 65520 rounds to inf)
   *  3: 65504 + 16                           -> +inf (65520 is the tie with 2^16, to even)
   *  4: -40000 + -30000                      -> -inf
   *  5: 65504 + -32                          -> 65472 (finite: no overflow on the way) */
  static const float in[N][COUNT] = {{40000, 70000, 65520, 65504, -40000, 65504},
                                     {30000, -1, -70000, 16, -30000, -32}};
  for (int w = 1; w < 3; w++) {
    nmt_comm *comms[N];
    float *bufs[N];
    if (!setup(N, COUNT, NULL, comms, bufs)) return;
    rank_ctx ctx[N];
    for (int r = 0; r < N; r++) {
      memcpy(bufs[r], in[r], sizeof in[r]);
      NMT_ASSERT_OK(nmt_comm_reserve(comms[r], COUNT));
      ctx[r] = (rank_ctx){.c = comms[r], .buf = bufs[r], .count = COUNT, .op = 4,
                          .wire = wires[w]};
    }
    if (!run_ranks(N, ctx, do_op)) return;
    if (!statuses_ok(N, ctx, "sum_as overflow", COUNT)) return;
    size_t wrong = 0;
    for (int r = 0; r < N; r++)
      for (int i = 0; i < COUNT; i++) {
        const float *b = bufs[r];
        if (wires[w] == NMT_GRAD_FP16) {
          const float want[COUNT] = {INFINITY, INFINITY, NAN, INFINITY, -INFINITY, 65472.0f};
          wrong += i == 2 ? !isnan(b[i]) : b[i] != want[i];
        } else {
          const float vals[N] = {in[0][i], in[1][i]};
          wrong += !isfinite(b[i]) || b[i] != emu_sum(vals, N, NMT_GRAD_BF16);
        }
      }
    teardown(N, comms, bufs);
    if (wrong)
      nmt_test_fail(__FILE__, __LINE__, "sum_as(%s) overflow cases: #wrong %zu of %d",
                    nmt_comm_wire_name(wires[w]), wrong, N * COUNT);
    if (nmt_test_failed()) return;
  }
}

/* A half wire needs a reservation at least as large as the count; a smaller reserve later
 * keeps the larger one; fp32 needs none; unknown wire values are refused. Every refusal
 * happens before any waiting, so one rank (no peers needed) shows it. */
NMT_TEST(comm_allreduce_sum_as_reserve_and_args) {
  NMT_ASSERT_EQ_INT(nmt_comm_wire_size(NMT_GRAD_FP32), 4);
  NMT_ASSERT_EQ_INT(nmt_comm_wire_size(NMT_GRAD_FP16), 2);
  NMT_ASSERT_EQ_INT(nmt_comm_wire_size(NMT_GRAD_BF16), 2);
  NMT_ASSERT_EQ_INT(nmt_comm_wire_size((nmt_grad_dtype)7), 0);
  NMT_ASSERT(!strcmp(nmt_comm_wire_name(NMT_GRAD_FP32), "float"));
  NMT_ASSERT(!strcmp(nmt_comm_wire_name(NMT_GRAD_FP16), "half"));
  NMT_ASSERT(!strcmp(nmt_comm_wire_name(NMT_GRAD_BF16), "bfloat16"));
  nmt_comm *comms[1];
  NMT_ASSERT_OK(nmt_comm_create_host(1, NULL, comms));
  float x[10];
  for (int i = 0; i < 10; i++) x[i] = 1.0f / 3.0f;
  nmt_status unreserved = nmt_comm_allreduce_sum_as(comms[0], x, 10, NMT_GRAD_FP16);
  int named = strstr(nmt_last_error(), "nmt_comm_reserve") != NULL;
  nmt_status fp32 = nmt_comm_allreduce_sum_as(comms[0], x, 10, NMT_GRAD_FP32);
  float third = x[0]; /* one rank, fp32: unchanged */
  nmt_status r10 = nmt_comm_reserve(comms[0], 10), r5 = nmt_comm_reserve(comms[0], 5);
  nmt_status ok10 = nmt_comm_allreduce_sum_as(comms[0], x, 10, NMT_GRAD_BF16);
  float rounded = x[0]; /* one rank, bf16: the input rounded to bf16 */
  nmt_status over = nmt_comm_allreduce_sum_as(comms[0], x, 11, NMT_GRAD_FP16);
  nmt_status bad = nmt_comm_allreduce_sum_as(comms[0], x, 1, (nmt_grad_dtype)7);
  nmt_status null = nmt_comm_allreduce_sum_as(comms[0], NULL, 3, NMT_GRAD_FP16);
  nmt_comm_destroy(comms, 1);
  NMT_ASSERT_EQ_STATUS(unreserved, NMT_ERR_INTERNAL);
  NMT_ASSERT(named);
  NMT_ASSERT_OK(fp32);
  NMT_ASSERT(third == 1.0f / 3.0f);
  NMT_ASSERT_OK(r10);
  NMT_ASSERT_OK(r5);
  NMT_ASSERT_OK(ok10);
  NMT_ASSERT(rounded == (float)emu_wire(1.0 / 3.0f, NMT_GRAD_BF16) && rounded != third);
  NMT_ASSERT_EQ_STATUS(over, NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(bad, NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(null, NMT_ERR_INTERNAL);
}

/* ------------------------------------------------------------------------------------------ */
/* ZeRO's collectives: reduce_scatter_sum_as and all_gather (rank r owns slice r of n x count) */

/* Counts per rank: empty, tiny, odd, and one that spans several CHUNKs of host.c, odd on
 * purpose so slices do not start on a convenient boundary. */
static const size_t zero_counts[] = {0, 1, 7, 1000, (1u << 18) + 3};
#define N_ZERO_COUNTS (sizeof zero_counts / sizeof zero_counts[0])

/* Integer-valued inputs: every rank's slice r must hold the exact sum (the double sum) over
 * ranks; #wrong counts the elements of the owned slices that do not. */
NMT_TEST(comm_reduce_scatter_exact) {
  for (int n = 1; n <= MAX_RANKS; n++) {
    for (size_t ci = 0; ci < N_ZERO_COUNTS; ci++) {
      const size_t count = zero_counts[ci], total = count * (size_t)n;
      nmt_comm *comms[MAX_RANKS];
      float *bufs[MAX_RANKS];
      if (!setup(n, total, NULL, comms, bufs)) return;
      rank_ctx ctx[MAX_RANKS];
      for (int r = 0; r < n; r++) {
        for (size_t i = 0; i < total; i++) bufs[r][i] = int_val(r, i, 3);
        ctx[r] = (rank_ctx){.c = comms[r], .buf = bufs[r], .count = count, .op = 5,
                            .wire = NMT_GRAD_FP32};
      }
      if (!run_ranks(n, ctx, do_op)) return;
      if (!statuses_ok(n, ctx, "reduce_scatter", count)) return;
      size_t wrong = 0;
      for (int r = 0; r < n; r++)
        for (size_t i = (size_t)r * count; i < (size_t)(r + 1) * count; i++) {
          double want = 0;
          for (int q = 0; q < n; q++) want += int_val(q, i, 3);
          wrong += (double)bufs[r][i] != want;
        }
      teardown(n, comms, bufs);
      if (wrong)
        nmt_test_fail(__FILE__, __LINE__, "reduce_scatter n=%d count=%zu: #wrong %zu of %zu", n,
                      count, wrong, total);
      if (nmt_test_failed()) return;
    }
  }
}

/* One reduce-scatter of wire_val over n ranks; result[r] gets rank r's buffer of n x count
 * floats (the caller frees). 0 on failure (recorded). */
static int run_reduce_scatter_as(int n, size_t count, nmt_grad_dtype wire, float **result) {
  const size_t total = count * (size_t)n;
  nmt_comm *comms[MAX_RANKS];
  if (!setup(n, total, NULL, comms, result)) return 0;
  rank_ctx ctx[MAX_RANKS];
  for (int r = 0; r < n; r++) {
    for (size_t i = 0; i < total; i++) result[r][i] = wire_val(r, i);
    if (wire != NMT_GRAD_FP32) {
      nmt_status st = nmt_comm_reserve(comms[r], total);
      if (st != NMT_OK) {
        nmt_test_fail(__FILE__, __LINE__, "reserve(%zu) on rank %d: %s", total, r,
                      nmt_status_str(st));
        return 0;
      }
    }
    ctx[r] = (rank_ctx){.c = comms[r], .buf = result[r], .count = count, .op = 5, .wire = wire};
  }
  if (!run_ranks(n, ctx, do_op)) return 0;
  nmt_comm_destroy(comms, n);
  return statuses_ok(n, ctx, "reduce_scatter_sum_as", count);
}

/* The contract ZeRO's "bitwise where the summation order is the same" rests on: slice r of a
 * reduce-scatter equals, bit for bit, the same slice of an all-reduce of the same inputs, for
 * each wire type, on data where the wire types and the rounding of each addition differ
 * (comm_allreduce_sum_as_matches_emulation checks that they do). */
NMT_TEST(comm_reduce_scatter_matches_allreduce) {
  for (int n = 1; n <= MAX_RANKS; n++) {
    for (size_t ci = 0; ci < N_ZERO_COUNTS; ci++) {
      const size_t count = zero_counts[ci];
      for (int w = 0; w < 3; w++) {
        float *ar[MAX_RANKS] = {NULL}, *rs[MAX_RANKS] = {NULL};
        int ok = run_sum_as(n, count * (size_t)n, wires[w], ar) &&
                 run_reduce_scatter_as(n, count, wires[w], rs);
        size_t wrong = 0, worst = 0;
        for (int r = 0; ok && r < n; r++)
          for (size_t i = (size_t)r * count; i < (size_t)(r + 1) * count; i++)
            if (memcmp(&rs[r][i], &ar[0][i], sizeof(float)) != 0) {
              if (!wrong) worst = i;
              wrong++;
            }
        for (int r = 0; r < n; r++) free(ar[r]), free(rs[r]);
        if (!ok) return;
        if (wrong)
          nmt_test_fail(__FILE__, __LINE__,
                        "reduce_scatter(%s) n=%d count=%zu: #wrong %zu elements differ from the "
                        "all-reduce (first at %zu)", nmt_comm_wire_name(wires[w]), n, count, wrong,
                        worst);
        if (nmt_test_failed()) return;
      }
    }
  }
}

/* The 16-bit storage patterns all_gather moves: every bit pattern can occur (NaN payloads
 * included), since the gather must not interpret them. */
static uint16_t pattern16(int r, size_t i) { return (uint16_t)mix64(((uint64_t)r << 48) ^ i); }

static float pattern32(int r, size_t i) {
  uint32_t u = (uint32_t)mix64(((uint64_t)(r + 7) << 48) ^ i);
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Every rank fills its whole buffer with its own poison, then slice r with its pattern; after
 * the gather every slice q of every rank must hold rank q's pattern, bit for bit. */
NMT_TEST(comm_all_gather_moves_bits) {
  for (int n = 1; n <= MAX_RANKS; n++) {
    for (size_t ci = 0; ci < N_ZERO_COUNTS; ci++) {
      for (int w = 0; w < 3; w++) {
        const size_t count = zero_counts[ci], total = count * (size_t)n;
        const size_t esz = nmt_comm_wire_size(wires[w]);
        nmt_comm *comms[MAX_RANKS];
        float *bufs[MAX_RANKS];
        if (!setup(n, total, NULL, comms, bufs)) return; /* 4 bytes a slot: room for 2 */
        rank_ctx ctx[MAX_RANKS];
        for (int r = 0; r < n; r++) {
          for (size_t i = 0; i < total; i++) {
            const int who = i / count == (size_t)r ? r : MAX_RANKS + r; /* poison elsewhere */
            if (esz == 2) ((uint16_t *)bufs[r])[i] = pattern16(who, i);
            else bufs[r][i] = pattern32(who, i);
          }
          ctx[r] = (rank_ctx){.c = comms[r], .buf = bufs[r], .count = count, .op = 6,
                              .wire = wires[w]};
        }
        if (!run_ranks(n, ctx, do_op)) return;
        if (!statuses_ok(n, ctx, "all_gather", count)) return;
        size_t wrong = 0;
        for (int r = 0; r < n; r++)
          for (size_t i = 0; i < total; i++) {
            const int q = (int)(i / count);
            if (esz == 2) {
              wrong += ((uint16_t *)bufs[r])[i] != pattern16(q, i);
            } else {
              const float want = pattern32(q, i);
              wrong += memcmp(&bufs[r][i], &want, sizeof want) != 0;
            }
          }
        teardown(n, comms, bufs);
        if (wrong)
          nmt_test_fail(__FILE__, __LINE__, "all_gather(%s) n=%d count=%zu: #wrong %zu of %zu",
                        nmt_comm_wire_name(wires[w]), n, count, wrong, total * (size_t)n);
        if (nmt_test_failed()) return;
      }
    }
  }
}

/* A ZeRO step over and over: reduce-scatter the "gradients", update the owned slice, gather
 * the "weights", with a different size every time and the buffer refilled right after each
 * call returns, so a rank racing into the next collective (or a peer still reading the last
 * one) corrupts someone's result. Every rank checks every element it can. Failure injection:
 * with fail_rank >= 0, that rank stops at iteration fail_at as a failing worker does (records
 * its own error and aborts the group instead of entering the collective). */
#define ZERO_ITERS 120
#define ZERO_MAX 6000

typedef struct {
  rank_ctx x;
  int fail_rank, fail_at;
  int iters_done;
} zero_ctx;

static nmt_status zero_iteration(rank_ctx *x, int k) {
  const int n = nmt_comm_size(x->c), me = nmt_comm_rank(x->c);
  const size_t count = (size_t)(mix64((uint64_t)k * 977u) % ZERO_MAX);
  const nmt_grad_dtype wire = wires[k % 3]; /* the gradients' wire type this time */
  for (size_t i = 0; i < count * (size_t)n; i++) x->buf[i] = int_val(me, i, (unsigned)k);
  NMT_TRY(nmt_comm_reduce_scatter_sum_as(x->c, x->buf, count, wire));
  for (size_t i = (size_t)me * count; i < (size_t)(me + 1) * count; i++) {
    float want = 0;
    for (int r = 0; r < n; r++) want += int_val(r, i, (unsigned)k); /* exact in every wire */
    x->wrong += x->buf[i] != want;
    x->buf[i] = want * 0.5f + (float)me; /* "the optimizer step" on the owned shard */
  }
  NMT_TRY(nmt_comm_all_gather(x->c, x->buf, count, NMT_GRAD_FP32));
  for (size_t i = 0; i < count * (size_t)n; i++) {
    const int q = (int)(i / count);
    float want = 0;
    for (int r = 0; r < n; r++) want += int_val(r, i, (unsigned)k);
    x->wrong += x->buf[i] != want * 0.5f + (float)q;
  }
  return NMT_OK;
}

static void *zero_rank(void *p) {
  zero_ctx *z = p;
  rank_ctx *x = &z->x;
  x->st = NMT_OK;
  x->wrong = 0;
  for (int k = 0; k < ZERO_ITERS && x->st == NMT_OK; k++) {
    if (nmt_comm_rank(x->c) == z->fail_rank && k == z->fail_at) {
      x->st = NMT_ERR_INTERNAL; /* the worker's own error, recorded before the abort */
      nmt_comm_abort(x->c);
      break;
    }
    x->st = zero_iteration(x, k);
    if (x->st == NMT_OK) z->iters_done = k + 1;
  }
  return NULL;
}

static void run_zero_steps(int n, int fail_rank, int fail_at) {
  nmt_comm *comms[MAX_RANKS];
  float *bufs[MAX_RANKS];
  atomic_int run_abort = 0;
  if (!setup(n, (size_t)n * ZERO_MAX, &run_abort, comms, bufs)) return;
  for (int r = 0; r < n; r++) {
    nmt_status st = nmt_comm_reserve(comms[r], (size_t)n * ZERO_MAX);
    if (st != NMT_OK) {
      nmt_test_fail(__FILE__, __LINE__, "reserve: %s", nmt_status_str(st));
      return;
    }
  }
  zero_ctx z[MAX_RANKS];
  pthread_t t[MAX_RANKS];
  for (int r = 0; r < n; r++) {
    z[r] = (zero_ctx){.x = {.c = comms[r], .buf = bufs[r]}, .fail_rank = fail_rank,
                      .fail_at = fail_at};
    if (pthread_create(&t[r], NULL, zero_rank, &z[r]) != 0) {
      nmt_comm_abort(comms[0]);
      join_watchdog(t, r, NULL);
      nmt_test_fail(__FILE__, __LINE__, "pthread_create failed for rank %d", r);
      return;
    }
  }
  if (!join_watchdog(t, n, comms[0])) {
    nmt_test_fail(__FILE__, __LINE__, "n=%d, failure at rank %d step %d: ranks hang", n,
                  fail_rank, fail_at);
    return; /* leaked on purpose: stuck threads may still touch them */
  }
  size_t wrong = 0;
  for (int r = 0; r < n; r++) wrong += z[r].x.wrong;
  for (int r = 0; r < n && !nmt_test_failed(); r++) {
    const nmt_status want = fail_rank < 0 ? NMT_OK
                            : r == fail_rank ? NMT_ERR_INTERNAL
                                             : NMT_ERR_ABORTED;
    if (z[r].x.st != want)
      nmt_test_fail(__FILE__, __LINE__, "n=%d, failure at rank %d step %d: rank %d returned %s, "
                    "want %s", n, fail_rank, fail_at, r, nmt_status_str(z[r].x.st),
                    nmt_status_str(want));
    /* Nobody completes the step the failing rank never joined. */
    else if (fail_rank >= 0 && z[r].iters_done > fail_at)
      nmt_test_fail(__FILE__, __LINE__, "rank %d completed %d steps past the failure at %d", r,
                    z[r].iters_done, fail_at);
  }
  teardown(n, comms, bufs);
  if (!nmt_test_failed() && wrong)
    nmt_test_fail(__FILE__, __LINE__, "n=%d, %d ZeRO steps: #wrong %zu", n, ZERO_ITERS, wrong);
  if (!nmt_test_failed() && fail_rank >= 0 && !atomic_load(&run_abort))
    nmt_test_fail(__FILE__, __LINE__, "the failure did not raise the run's abort flag");
}

NMT_TEST(comm_zero_steps_consecutive) {
  for (int n = 1; n <= MAX_RANKS && !nmt_test_failed(); n++) run_zero_steps(n, -1, 0);
}

NMT_TEST(comm_zero_failure_injection_no_hang) {
  /* (ranks, failing rank, step): first, middle and last rank; at the first step and later. */
  static const int cases[][3] = {{2, 0, 0}, {2, 1, 17}, {3, 1, 5}, {4, 3, 40}, {4, 0, 77}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0] && !nmt_test_failed(); i++)
    run_zero_steps(cases[i][0], cases[i][1], cases[i][2]);
}

/* Refusals every rank would hit alike, before any waiting (one rank, no peers needed): a half
 * wire beyond the reservation of n x count (named), an unknown type, a NULL buffer, a count
 * whose n x count wraps; and the host slices: with one rank both are identities (fp32), and a
 * half wire rounds. */
NMT_TEST(comm_zero_collectives_args) {
  nmt_comm *comms[2];
  NMT_ASSERT_OK(nmt_comm_create_host(2, NULL, comms));
  float x[8] = {0};
  NMT_ASSERT_OK(nmt_comm_reserve(comms[0], 7));
  nmt_status short_res = nmt_comm_reduce_scatter_sum_as(comms[0], x, 4, NMT_GRAD_FP16);
  int named = strstr(nmt_last_error(), "nmt_comm_reserve") && strstr(nmt_last_error(), "8");
  nmt_status bad_wire = nmt_comm_reduce_scatter_sum_as(comms[0], x, 1, (nmt_grad_dtype)9);
  nmt_status bad_type = nmt_comm_all_gather(comms[0], x, 1, (nmt_grad_dtype)9);
  nmt_status null_rs = nmt_comm_reduce_scatter_sum_as(comms[0], NULL, 1, NMT_GRAD_FP32);
  nmt_status null_ag = nmt_comm_all_gather(comms[0], NULL, 1, NMT_GRAD_BF16);
  nmt_status wrap_rs = nmt_comm_reduce_scatter_sum_as(comms[0], x, SIZE_MAX / 2, NMT_GRAD_FP32);
  nmt_status wrap_ag = nmt_comm_all_gather(comms[0], x, SIZE_MAX / 3, NMT_GRAD_FP16);
  nmt_comm_destroy(comms, 2);
  NMT_ASSERT_EQ_STATUS(short_res, NMT_ERR_INTERNAL);
  NMT_ASSERT(named);
  NMT_ASSERT_EQ_STATUS(bad_wire, NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(bad_type, NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(null_rs, NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(null_ag, NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(wrap_rs, NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(wrap_ag, NMT_ERR_INTERNAL);

  NMT_ASSERT_OK(nmt_comm_create_host(1, NULL, comms));
  for (int i = 0; i < 8; i++) x[i] = 1.0f / 3.0f;
  NMT_ASSERT_OK(nmt_comm_reduce_scatter_sum_as(comms[0], x, 8, NMT_GRAD_FP32));
  NMT_ASSERT_OK(nmt_comm_all_gather(comms[0], x, 8, NMT_GRAD_FP32));
  NMT_ASSERT(x[7] == 1.0f / 3.0f);
  NMT_ASSERT_OK(nmt_comm_reserve(comms[0], 8));
  NMT_ASSERT_OK(nmt_comm_reduce_scatter_sum_as(comms[0], x, 8, NMT_GRAD_BF16));
  NMT_ASSERT(x[7] == (float)emu_wire(1.0 / 3.0f, NMT_GRAD_BF16));
  nmt_comm_destroy(comms, 1);
}
