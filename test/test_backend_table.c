/* test/test_backend_table.c — the op tables themselves (nmt/backend.h): every entry of both
 * tables is filled (the CUDA table is checked without a device: nmt_backend_cuda_get() returns
 * it in every CUDA build, NULL only in a CPU-only build), and the reference backend's run-level
 * entries (is_host, set_abort, comm_create, measure_peaks, mem_peak_mb, profiler_capture,
 * clock_create/destroy) do what the header says. The communicator test runs its two ranks on
 * threads, with a watchdog that fails the test instead of hanging it. */
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#include "nmt/backend.h"
#include "nmt/comm.h"
#include "nmt/ref.h"
#include "test.h"

/* Every member after `name` and `is_host` is a function pointer, so the table's entries are
 * the function-pointer-sized slots from the first one (device_count) to the end. Counting them
 * from the struct's size means a new entry is checked without being listed here. */
typedef void (*any_fn)(void);
_Static_assert(offsetof(nmt_backend, is_host) < offsetof(nmt_backend, device_count),
               "nmt_backend: name and is_host come before the entries");
_Static_assert((sizeof(nmt_backend) - offsetof(nmt_backend, device_count)) % sizeof(any_fn) == 0,
               "nmt_backend: after is_host every member is a function pointer");

/* Fails the running test naming the first NULL entry of `be`; returns 1 when all are set. */
static int entries_filled(const nmt_backend *be) {
  const char *p = (const char *)be + offsetof(nmt_backend, device_count);
  size_t n = (sizeof *be - offsetof(nmt_backend, device_count)) / sizeof(any_fn);
  for (size_t i = 0; i < n; i++) {
    any_fn fn;
    memcpy(&fn, p + i * sizeof fn, sizeof fn);
    if (!fn) {
      nmt_test_fail(__FILE__, __LINE__, "%s op table entry %zu (of %zu) is NULL", be->name, i, n);
      return 0;
    }
  }
  return 1;
}

NMT_TEST(misc_backend_table_complete) {
  const nmt_backend *be = &nmt_backend_ref;
  NMT_ASSERT(be->name && strcmp(be->name, "ref") == 0);
  if (!entries_filled(be)) return;
  NMT_ASSERT(be->attention_bwd == nmt_ref_attention_bwd && be->adamw == nmt_ref_adamw);
  NMT_ASSERT(be->comm_create == nmt_ref_comm_create && be->clock_destroy == nmt_ref_clock_destroy);
}

NMT_TEST(backend_table_cuda_complete) {
  const nmt_backend *be = nmt_backend_cuda_get();
  if (!be) NMT_SKIP("CPU-only build: no CUDA backend table");
  NMT_ASSERT(be->name && strcmp(be->name, "cuda") == 0);
  NMT_ASSERT_EQ_INT(be->is_host, 0);
  entries_filled(be);
}

NMT_TEST(backend_ref_is_host) {
  NMT_ASSERT_EQ_INT(nmt_backend_ref.is_host, 1);
}

NMT_TEST(backend_ref_measure_peaks) {
  const nmt_backend *be = &nmt_backend_ref;
  double tf = -1, gb = -1;
  NMT_ASSERT_OK(be->measure_peaks(NULL, NMT_PRECISION_FP32, &tf, &gb));
  NMT_ASSERT(tf > 0 && isfinite(tf));
  NMT_ASSERT(gb > 0 && isfinite(gb));
  tf = gb = -1;
  NMT_ASSERT_EQ_STATUS(be->measure_peaks(NULL, (nmt_precision)99, &tf, &gb), NMT_ERR_CONFIG);
  NMT_ASSERT(tf == 0 && gb == 0);
}

NMT_TEST(backend_ref_mem_peak_mb) {
  const nmt_backend *be = &nmt_backend_ref;
  double mb = NAN;
  NMT_ASSERT_OK(be->mem_peak_mb(NULL, &mb)); /* first call: NAN in */
  NMT_ASSERT(mb > 0 && isfinite(mb));
  double first = mb;
  NMT_ASSERT_OK(be->mem_peak_mb(NULL, &mb)); /* a high-water mark never goes down */
  NMT_ASSERT(mb >= first);
  mb = 1e12; /* in/out: a larger peak seen before is kept */
  NMT_ASSERT_OK(be->mem_peak_mb(NULL, &mb));
  NMT_ASSERT(mb == 1e12);
  mb = 0; /* 0 in counts as nothing seen */
  NMT_ASSERT_OK(be->mem_peak_mb(NULL, &mb));
  NMT_ASSERT(mb >= first);
}

NMT_TEST(backend_ref_device_only_entries) {
  const nmt_backend *be = &nmt_backend_ref;
  NMT_ASSERT_OK(be->profiler_capture(1));
  NMT_ASSERT_OK(be->profiler_capture(0));
  atomic_int flag = 0;
  NMT_ASSERT_OK(be->set_abort(NULL, &flag));
  void *ctx = NULL;
  NMT_ASSERT_OK(be->ctx_create(0, &ctx));
  NMT_ASSERT_OK(be->set_abort(ctx, &flag));
  NMT_ASSERT_OK(be->set_abort(ctx, NULL));
  int sentinel;
  void *clock = &sentinel;
  NMT_ASSERT_OK(be->clock_create(ctx, NULL, &clock));
  NMT_ASSERT(clock == NULL); /* the host clock: no state */
  be->clock_destroy(clock);
  be->ctx_destroy(ctx);
}

/* ---- comm_create: a working host communicator ---- */

enum { COMM_RANKS = 2, COMM_COUNT = 1000, WATCHDOG_S = 10 };

typedef struct {
  nmt_comm *c;
  float buf[COMM_COUNT];
  nmt_status st;
} comm_rank;

static void *allreduce_rank(void *p) {
  comm_rank *x = p;
  x->st = nmt_comm_allreduce_sum(x->c, x->buf, COMM_COUNT);
  return NULL;
}

/* Joins the ranks within WATCHDOG_S; on timeout raises the abort flag so they leave. */
static int join_ranks(pthread_t *t, int n, atomic_int *abort) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += WATCHDOG_S;
  int ok = 1;
  for (int r = 0; r < n; r++) {
    if (pthread_timedjoin_np(t[r], NULL, &dl) == 0) continue;
    ok = 0;
    atomic_store(abort, 1);
    pthread_join(t[r], NULL);
  }
  return ok;
}

NMT_TEST(backend_ref_comm_create) {
  const nmt_backend *be = &nmt_backend_ref;
  nmt_comm *bad[1];
  NMT_ASSERT_EQ_STATUS(be->comm_create(0, NULL, NULL, NULL, bad), NMT_ERR_INTERNAL);
  atomic_int abort = 0;
  nmt_comm *comms[COMM_RANKS];
  NMT_ASSERT_OK(be->comm_create(COMM_RANKS, NULL, NULL, &abort, comms));
  static comm_rank ranks[COMM_RANKS];
  for (int r = 0; r < COMM_RANKS; r++) {
    NMT_ASSERT_EQ_INT(nmt_comm_rank(comms[r]), r);
    NMT_ASSERT_EQ_INT(nmt_comm_size(comms[r]), COMM_RANKS);
    ranks[r].c = comms[r];
    /* Small integers: the sum is exact whatever the order. */
    for (int i = 0; i < COMM_COUNT; i++) ranks[r].buf[i] = (float)((r + 1) * (i % 17) - 8);
  }
  pthread_t t[COMM_RANKS];
  int started = 0;
  for (; started < COMM_RANKS; started++)
    if (pthread_create(&t[started], NULL, allreduce_rank, &ranks[started]) != 0) break;
  if (started < COMM_RANKS) atomic_store(&abort, 1); /* the started rank would wait forever */
  int joined = join_ranks(t, started, &abort);
  NMT_ASSERT_EQ_INT(started, COMM_RANKS);
  NMT_ASSERT(joined); /* else the ranks hung until the watchdog aborted them */
  size_t wrong = 0;
  for (int r = 0; r < COMM_RANKS; r++) {
    NMT_ASSERT_OK(ranks[r].st);
    for (int i = 0; i < COMM_COUNT; i++)
      wrong += ranks[r].buf[i] != (float)(3 * (i % 17) - 16); /* (1 + 2) * v - 8 - 8 */
  }
  if (wrong)
    nmt_test_fail(__FILE__, __LINE__, "allreduce over comm_create's group: %zu wrong", wrong);
  /* The group polls the flag it was given: raised, a collective returns at once. */
  atomic_store(&abort, 1);
  NMT_ASSERT_EQ_STATUS(nmt_comm_flush(comms[0]), NMT_ERR_ABORTED);
  nmt_comm_destroy(comms, COMM_RANKS);
}
