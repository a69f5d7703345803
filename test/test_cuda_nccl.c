/* test/test_cuda_nccl.c — the NCCL communicator (cuda/nccl.cu) and the CUDA backend's polling
 * host waits, one rank per visible GPU (up to 8), one thread per rank as in the engine.
 *
 *  - collectives: every rank fills a device buffer with small integers through kernels on its
 *    compute stream (memset + axpy, not waited for), allreduces (sum, max) or broadcasts, then,
 *    after nmt_comm_flush, adds its own input once more on the compute stream and copies back;
 *    the result must be the exact double sum (max, root's values) plus that input. A comm
 *    stream that did not wait for the compute stream would reduce zeros; a flush that did not
 *    order the compute stream would race the axpy. #wrong counted over every rank.
 *  - half wire: allreduce_sum_as with fp16 and bf16 on data written by unsynchronized kernels;
 *    every result must be a value of the wire type (the casts happened) and within 1 unit in
 *    the last place of the wire type (n - 1 units beyond 2 ranks, where NCCL's order of
 *    additions may differ from rank order) of the host emulation through nmt_half_round_fp16 /
 *    bf16 in rank order; fp16 overflow is inf, as on the host; every rank bitwise equal; a
 *    count beyond the reservation is refused before NCCL sees it.
 *  - barrier: nobody leaves barrier k before everyone has entered it (a shared counter).
 *  - abort: a rank waits in nmt_cuda_synchronize on a compute stream held by a host-function
 *    gate (cudaLaunchHostFunc); nmt_comm_abort from another thread must end the wait with
 *    NMT_ERR_ABORTED within 5 s (the gate is opened afterwards). The same for the context's
 *    own abort flag (nmt_cuda_ctx_set_abort) without any communicator. With 2 or more GPUs,
 *    the real case too: the last rank never joins a barrier.
 *  - arguments: bad counts, contexts, duplicate devices and a host buffer are refused.
 *  - ZeRO's collectives: reduce_scatter_sum_as (fp32, fp16, bf16 wires) and all_gather (fp32,
 *    and 16-bit storage moved bit for bit) on data written by unsynchronized kernels, each
 *    followed by a flush and one more kernel on the owned slice; exact, #wrong counted.
 *  - several processes' path (issue 18), degenerate: nmt_comm_nccl_unique_id, then
 *    nmt_comm_create_nccl_ranks over one GPU (world 1) and over every GPU (world n); global
 *    ranks, all-reduce and ZeRO's collectives through it; its argument and option checks.
 *    Its nonblocking init: one GPU as rank 0 of a world of 2 whose rank 1 never comes must
 *    end at the timeout, or at the abort flag, not hang; with 2+ GPUs, each rank created by
 *    its own thread (the multi-process shape), collectives, and a destroy per rank.
 *  - allocation discipline: every multi-rank case allocates (cudaMalloc, nmt_comm_reserve)
 *    before a host barrier that precedes any collective, and frees after a second one that
 *    follows every rank's results (rank_sync below).
 *  - pageable copies: copy_d2h / copy_h2d with malloc'd memory behind a gated stream honour
 *    the abort flag (the driver would otherwise wait for the stream inside cudaMemcpyAsync).
 *  - NCCL loaded on demand: the loader names the library and dlerror()'s text for a missing
 *    library and a missing function (no GPU needed), loads the real libnccl.so.2 when present,
 *    and neither nmt nor the test binary lists libnccl among its dynamic dependencies (ldd).
 * Without a CUDA device every GPU test prints "# SKIP no CUDA device". In a CPU-only build
 * nmt_comm_create_nccl, nmt_comm_create_nccl_ranks and nmt_comm_nccl_unique_id must fail with
 * NMT_ERR_DEVICE ("built without CUDA/NCCL"). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nmt/comm.h"
#include "test.h"

/* A one-GPU run must start where libnccl.so.2 is absent (issue 15): no DT_NEEDED entry for it
 * in nmt or in this binary (which links the same objects). */
static int lists_libnccl(const char *binary, int *ran) {
  char cmd[1100], line[512];
  snprintf(cmd, sizeof cmd, "ldd '%s' 2>/dev/null", binary);
  FILE *p = popen(cmd, "r");
  *ran = 0;
  if (!p) return 0;
  int found = 0;
  while (fgets(line, sizeof line, p)) {
    *ran = 1;
    found |= strstr(line, "libnccl") != NULL;
  }
  pclose(p);
  return found;
}

NMT_TEST(cuda_nccl_not_linked) {
  char nmt[1024];
  snprintf(nmt, sizeof nmt, "%s/nmt", nmt_test_build_dir());
  int ran_nmt = 0, ran_self = 0;
  int in_nmt = lists_libnccl(nmt, &ran_nmt), in_self = lists_libnccl("/proc/self/exe", &ran_self);
  if (!ran_self) NMT_SKIP("ldd not available");
  NMT_ASSERT(!in_self);
  NMT_ASSERT(ran_nmt); /* `make test` builds nmt before running the tests */
  NMT_ASSERT(!in_nmt);
}

#ifndef NMT_CUDA

NMT_TEST(cuda_nccl_cpu_build_refuses) {
  nmt_comm *comms[2] = {(nmt_comm *)&comms, (nmt_comm *)&comms}; /* must be cleared */
  const int devices[2] = {0, 1};
  void *ctxs[2] = {NULL, NULL};
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_nccl(2, devices, ctxs, NULL, comms), NMT_ERR_DEVICE);
  NMT_ASSERT(strstr(nmt_last_error(), "built without CUDA/NCCL") != NULL);
  NMT_ASSERT(comms[0] == NULL && comms[1] == NULL);
  char id[NMT_COMM_NCCL_ID_BYTES];
  NMT_ASSERT_EQ_STATUS(nmt_comm_nccl_unique_id(id, sizeof id), NMT_ERR_DEVICE);
  NMT_ASSERT(strstr(nmt_last_error(), "built without CUDA/NCCL") != NULL);
  comms[0] = comms[1] = (nmt_comm *)&comms;
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_nccl_ranks(2, devices, ctxs, 4, 2, id, 0, NULL, comms),
                       NMT_ERR_DEVICE);
  NMT_ASSERT(strstr(nmt_last_error(), "built without CUDA/NCCL") != NULL);
  NMT_ASSERT(comms[0] == NULL && comms[1] == NULL);
}

#else /* NMT_CUDA */

#include <cuda_runtime_api.h>

#include "../src/comm/comm_impl.h" /* nmt__nccl_probe */
#include "nmt/cuda.h"
#include "nmt/half.h"
#include "nmt/ref.h"

enum { MAX_GPUS = 8, WATCHDOG_S = 20, ABORT_LIMIT_S = 5 };

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* One context per GPU 0..n-1 and, when `group`, the NCCL group over them. */
typedef struct {
  int n;
  int devices[MAX_GPUS];
  void *ctx[MAX_GPUS];
  nmt_comm *comms[MAX_GPUS];
  int have_group;
} gpus;

static void gpus_close(gpus *g) {
  if (g->have_group) nmt_comm_destroy(g->comms, g->n); /* before the contexts */
  for (int r = 0; r < g->n; r++)
    if (g->ctx[r]) nmt_cuda_ctx_destroy(g->ctx[r]);
  memset(g, 0, sizeof *g);
}

enum { GROUP_NONE = 0, GROUP_ALL = 1, GROUP_BY_ID = 2 };

/* 1: open; 0: no device (skip); -1: failure (recorded). group: GROUP_NONE (contexts only),
 * GROUP_ALL (nmt_comm_create_nccl) or GROUP_BY_ID (nmt_comm_nccl_unique_id, then
 * nmt_comm_create_nccl_ranks with world = the GPUs opened, first rank 0); at most max_n GPUs. */
static int gpus_open_n(gpus *g, int group, atomic_int *abort, int max_n) {
  memset(g, 0, sizeof *g);
  int n = 0;
  if (nmt_cuda_device_count(&n) != NMT_OK || n < 1) return 0;
  if (n > max_n) n = max_n;
  g->n = n < MAX_GPUS ? n : MAX_GPUS;
  for (int r = 0; r < g->n; r++) {
    g->devices[r] = r;
    nmt_status s = nmt_cuda_ctx_create(r, &g->ctx[r]);
    if (s != NMT_OK) {
      nmt_test_fail(__FILE__, __LINE__, "ctx_create(%d): %s: %s", r, nmt_status_str(s),
                    nmt_last_error());
      gpus_close(g);
      return -1;
    }
  }
  if (group != GROUP_NONE) {
    char id[NMT_COMM_NCCL_ID_BYTES];
    nmt_status s = group == GROUP_ALL
                       ? nmt_comm_create_nccl(g->n, g->devices, g->ctx, abort, g->comms)
                       : nmt_comm_nccl_unique_id(id, sizeof id);
    if (s == NMT_OK && group == GROUP_BY_ID)
      s = nmt_comm_create_nccl_ranks(g->n, g->devices, g->ctx, g->n, 0, id, 0, abort, g->comms);
    if (s != NMT_OK) {
      nmt_test_fail(__FILE__, __LINE__, "NCCL group (%s) over %d GPU(s): %s: %s",
                    group == GROUP_ALL ? "ncclCommInitAll" : "unique id, ncclCommInitRank", g->n,
                    nmt_status_str(s), nmt_last_error());
      gpus_close(g);
      return -1;
    }
    g->have_group = 1;
  }
  return 1;
}

static int gpus_open(gpus *g, int group, atomic_int *abort) {
  return gpus_open_n(g, group, abort, MAX_GPUS);
}

/* Joins the threads within `limit_s`; 1 if all joined. Threads still running are detached
 * and whatever they use is leaked on purpose by the caller. */
static int join_within(pthread_t *t, int n, double limit_s) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += (time_t)limit_s;
  int ok = 1;
  for (int i = 0; i < n; i++)
    if (pthread_timedjoin_np(t[i], NULL, &dl) != 0) {
      pthread_detach(t[i]);
      ok = 0;
    }
  return ok;
}

/* A host barrier between the rank threads of one case. cudaMalloc and cudaFree may
 * synchronize the device or serialize on a lock in the driver, and so deadlock against an NCCL
 * kernel that waits for a sibling rank whose thread is itself held there (NCCL user guide,
 * "Using multiple NCCL communicators concurrently" and "Thread Safety"; nmt's own rule:
 * cuda/context.cu's scratch growth, cuda/nccl.cu's half scratch, docs/cuda.md "Scratch plan").
 * So every rank allocates, meets the others (meeting 1), runs its collectives and reads its
 * results back, meets them again (meeting 2: every rank's collectives have completed, each
 * rank's copy_d2h having waited for them) and only then frees. A rank that failed before
 * meeting 1 says so there, and every rank then skips the collectives, which would otherwise
 * wait for it forever. `cancel` releases every waiter (a thread that could not be started
 * never arrives; a hung case is given up). Heap-allocated by the case, leaked with the group
 * when threads cannot be joined. */
typedef struct {
  int n;
  atomic_int arrived; /* arrivals over all meetings */
  atomic_int failed;  /* a rank reached meeting 1 with an error */
  atomic_int cancel;
} rank_sync;

static rank_sync *rank_sync_new(int n) {
  rank_sync *s = calloc(1, sizeof *s);
  if (s) s->n = n;
  return s;
}

/* Rank's arrival at meeting k (1, 2): returns once all n ranks have arrived at it (or the case
 * was cancelled); 1 when every rank came to meeting 1 with NMT_OK and nothing was cancelled. */
static int ranks_meet(rank_sync *s, int k, nmt_status st) {
  if (k == 1 && st != NMT_OK) atomic_store(&s->failed, 1);
  atomic_fetch_add(&s->arrived, 1);
  while (atomic_load(&s->arrived) < s->n * k && !atomic_load(&s->cancel)) sleep_ms(1);
  return !atomic_load(&s->failed) && !atomic_load(&s->cancel);
}

/* Meeting 1, after the rank's allocations: 1 to go on with the collectives. A rank that is
 * fine but must skip them (a sibling failed first) records why. */
static int meet_before_collectives(rank_sync *s, nmt_status *st, const char **failed_at) {
  if (ranks_meet(s, 1, *st)) return 1;
  if (*st == NMT_OK) {
    *st = NMT_ERR_ABORTED;
    *failed_at = "the host barrier before the collectives (a sibling rank failed first)";
  }
  return 0;
}

/* Small integers: sums of up to 8 of them (plus the input once more) are exact in fp32. */
static float int_val(int r, size_t i, int salt) {
  return (float)((int)((r * 131u + i * 31u + (unsigned)salt * 17u) % 61u) - 30);
}

/* ------------------------------------------------------------------------------------------ */
/* collectives */

enum { COUNT = (1 << 22) + 3 }; /* large enough for the streams to overlap, odd on purpose */

typedef struct {
  gpus *g;
  rank_sync *sync;
  int rank, op, root; /* op: 0 sum, 1 max, 2 broadcast */
  nmt_status st;
  const char *failed_at;
  size_t wrong;
} coll_arg;

#define STEP(call)                   \
  do {                               \
    if (a->st == NMT_OK) {           \
      a->st = (call);                \
      if (a->st != NMT_OK) a->failed_at = #call; \
    }                                \
  } while (0)

static void *coll_rank(void *p) {
  coll_arg *a = p;
  void *ctx = a->g->ctx[a->rank];
  nmt_comm *c = a->g->comms[a->rank];
  int n = a->g->n, me = a->rank;
  size_t bytes = (size_t)COUNT * sizeof(float);
  float *h = malloc(bytes), *d = NULL, *src = NULL;
  a->st = h ? NMT_OK : NMT_ERR_NOMEM;
  STEP(nmt_cuda_malloc(ctx, bytes, (void **)&d));
  STEP(nmt_cuda_malloc(ctx, bytes, (void **)&src));
  a->wrong = 0;
  if (!meet_before_collectives(a->sync, &a->st, &a->failed_at)) goto out;
  for (size_t i = 0; i < COUNT; i++) h[i] = int_val(me, i, a->op);
  STEP(nmt_cuda_copy_h2d(ctx, src, h, bytes));
  /* Enqueued, not waited for: the collective must order itself after them. */
  STEP(nmt_cuda_memset_zero(ctx, d, bytes));
  STEP(nmt_cuda_axpy(ctx, d, src, 1.0f, COUNT));
  switch (a->op) {
  case 0: STEP(nmt_comm_allreduce_sum(c, d, COUNT)); break;
  case 1: STEP(nmt_comm_allreduce_max(c, d, COUNT)); break;
  default: STEP(nmt_comm_broadcast(c, d, COUNT, a->root)); break;
  }
  STEP(nmt_comm_flush(c));
  STEP(nmt_cuda_axpy(ctx, d, src, 1.0f, COUNT)); /* must see the reduced values */
  STEP(nmt_cuda_copy_d2h(ctx, h, d, bytes));
  if (a->st == NMT_OK)
    for (size_t i = 0; i < COUNT; i++) {
      double want;
      if (a->op == 0) {
        want = 0;
        for (int r = 0; r < n; r++) want += int_val(r, i, a->op);
      } else if (a->op == 1) {
        want = int_val(0, i, a->op);
        for (int r = 1; r < n; r++)
          if (int_val(r, i, a->op) > want) want = int_val(r, i, a->op);
      } else {
        want = int_val(a->root, i, a->op);
      }
      want += int_val(me, i, a->op);
      a->wrong += (double)h[i] != want;
    }
out:
  ranks_meet(a->sync, 2, NMT_OK); /* every rank's collectives have completed */
  nmt_cuda_free(ctx, d);
  nmt_cuda_free(ctx, src);
  free(h);
  return NULL;
}

/* All-reduce sum, max and broadcast over the group of g, checked (failures recorded; on a hang
 * the group is aborted and leaked, and g->have_group cleared so nobody destroys it). */
static void run_collectives(gpus *gg) {
  gpus g = *gg; /* the threads read this copy; gg's group is closed by the caller */
  for (int op = 0; op < 3 && !nmt_test_failed(); op++) {
    pthread_t t[MAX_GPUS];
    coll_arg a[MAX_GPUS];
    rank_sync *sync = rank_sync_new(g.n);
    if (!sync) {
      nmt_test_fail(__FILE__, __LINE__, "out of memory");
      return;
    }
    int started = 0;
    for (int r = 0; r < g.n; r++) {
      a[r] = (coll_arg){.g = &g, .sync = sync, .rank = r, .op = op, .root = g.n - 1};
      if (pthread_create(&t[r], NULL, coll_rank, &a[r]) != 0) break;
      started++;
    }
    if (started < g.n) {
      atomic_store(&sync->cancel, 1);
      nmt_comm_abort(g.comms[0]);
      join_within(t, started, WATCHDOG_S);
      nmt_test_fail(__FILE__, __LINE__, "pthread_create failed");
      gg->have_group = 0;
      return; /* leaks the group and sync: threads may still use them */
    }
    if (!join_within(t, g.n, WATCHDOG_S)) {
      atomic_store(&sync->cancel, 1);
      nmt_comm_abort(g.comms[0]);
      nmt_test_fail(__FILE__, __LINE__, "op %d over %d GPU(s): ranks hang", op, g.n);
      gg->have_group = 0;
      return;
    }
    free(sync);
    size_t wrong = 0;
    for (int r = 0; r < g.n; r++) {
      if (a[r].st != NMT_OK) {
        nmt_test_fail(__FILE__, __LINE__, "op %d: rank %d: %s returned %s: %s", op, r,
                      a[r].failed_at, nmt_status_str(a[r].st), nmt_last_error());
        break;
      }
      wrong += a[r].wrong;
    }
    if (!nmt_test_failed() && wrong)
      nmt_test_fail(__FILE__, __LINE__, "%s over %d GPU(s), count %d: #wrong %zu of %zu",
                    op == 0 ? "allreduce_sum" : op == 1 ? "allreduce_max" : "broadcast", g.n,
                    (int)COUNT, wrong, (size_t)COUNT * (size_t)g.n);
  }
}

NMT_TEST(cuda_nccl_collectives) {
  gpus g;
  int o = gpus_open(&g, GROUP_ALL, NULL);
  if (o == 0) NMT_SKIP("no CUDA device");
  if (o < 0) return;
  run_collectives(&g);
  if (g.have_group) gpus_close(&g);
}

/* ------------------------------------------------------------------------------------------ */
/* half wire */

enum { HALF_COUNT = (1 << 20) + 5 };

static uint64_t mix64(uint64_t x) { /* splitmix64 finalizer */
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/* Random sign, 24 significand bits, exponent in [-20, 5] (fp16 subnormals included); element
 * 0 of rank 0 is 70000, beyond fp16's range, and element 1 is 65504 on every rank, so fp16
 * overflows there with 2 or more ranks. */
static float half_val(int r, size_t i) {
  if (i == 0 && r == 0) return 70000.0f;
  if (i == 1) return 65504.0f;
  uint64_t h = mix64(((uint64_t)(r + 1) << 44) ^ (i * 0x2545F4914F6CDD1Dull));
  float m = (float)(((h >> 40) | 0x800000u) & 0xffffffu) * 0x1p-24f;
  return (h & 1u ? -1.0f : 1.0f) * ldexpf(m, (int)((h >> 8) % 26u) - 20);
}

static float wire_round(float x, nmt_grad_dtype wire) {
  return wire == NMT_GRAD_FP16 ? nmt_half_round_fp16(x) : nmt_half_round_bf16(x);
}

/* One unit in the last place of the wire type at magnitude m (11 or 8 significant bits, and
 * the subnormal quantum below the smallest normal). */
static double wire_ulp(double m, nmt_grad_dtype wire) {
  int digits = wire == NMT_GRAD_FP16 ? 11 : 8, emin = wire == NMT_GRAD_FP16 ? -14 : -126, e;
  frexp(m, &e);
  if (e - 1 < emin) e = emin + 1;
  return ldexp(1.0, e - digits);
}

typedef struct {
  gpus *g;
  rank_sync *sync;
  int rank;
  nmt_grad_dtype wire;
  nmt_status st;
  const char *failed_at;
  nmt_status too_many; /* the call beyond the reservation */
  float *out;          /* (HALF_COUNT) the rank's result, host memory */
} half_arg;

static void *half_rank(void *p) {
  half_arg *a = p;
  void *ctx = a->g->ctx[a->rank];
  nmt_comm *c = a->g->comms[a->rank];
  size_t bytes = (size_t)HALF_COUNT * sizeof(float);
  float *d = NULL, *src = NULL;
  a->st = a->out ? NMT_OK : NMT_ERR_NOMEM;
  STEP(nmt_comm_reserve(c, HALF_COUNT)); /* a cudaMalloc too */
  STEP(nmt_cuda_malloc(ctx, bytes, (void **)&d));
  STEP(nmt_cuda_malloc(ctx, bytes, (void **)&src));
  if (!meet_before_collectives(a->sync, &a->st, &a->failed_at)) goto out;
  for (size_t i = 0; i < HALF_COUNT; i++) a->out[i] = half_val(a->rank, i);
  STEP(nmt_cuda_copy_h2d(ctx, src, a->out, bytes));
  if (a->st == NMT_OK)
    for (size_t i = 0; i < HALF_COUNT; i++) a->out[i] = NAN; /* poison */
  /* Enqueued, not waited for: the cast must order itself after them. */
  STEP(nmt_cuda_memset_zero(ctx, d, bytes));
  STEP(nmt_cuda_axpy(ctx, d, src, 1.0f, HALF_COUNT));
  STEP(nmt_comm_allreduce_sum_as(c, d, HALF_COUNT, a->wire));
  STEP(nmt_comm_flush(c));
  STEP(nmt_cuda_copy_d2h(ctx, a->out, d, bytes));
  if (a->st == NMT_OK) a->too_many = nmt_comm_allreduce_sum_as(c, d, HALF_COUNT + 1, a->wire);
out:
  ranks_meet(a->sync, 2, NMT_OK); /* every rank's collectives have completed */
  nmt_cuda_free(ctx, d);
  nmt_cuda_free(ctx, src);
  return NULL;
}

NMT_TEST(cuda_nccl_allreduce_sum_as) {
  gpus g;
  int o = gpus_open(&g, 1, NULL);
  if (o == 0) NMT_SKIP("no CUDA device");
  if (o < 0) return;
  const nmt_grad_dtype wires[] = {NMT_GRAD_FP16, NMT_GRAD_BF16};
  const int n = g.n;
  /* Rank order may differ from NCCL's beyond two ranks: each addition errs by at most half a
   * unit of its partial sum, on both sides. */
  const double tol_ulps = n <= 2 ? 1.0 : (double)(n - 1);
  for (int wi = 0; wi < 2 && !nmt_test_failed(); wi++) {
    const nmt_grad_dtype wire = wires[wi];
    pthread_t t[MAX_GPUS];
    half_arg a[MAX_GPUS];
    rank_sync *sync = rank_sync_new(n);
    if (!sync) {
      nmt_test_fail(__FILE__, __LINE__, "out of memory");
      break;
    }
    int started = 0;
    for (int r = 0; r < n; r++) {
      a[r] = (half_arg){.g = &g, .sync = sync, .rank = r, .wire = wire,
                        .out = malloc((size_t)HALF_COUNT * sizeof(float))};
      if (pthread_create(&t[r], NULL, half_rank, &a[r]) != 0) break;
      started++;
    }
    if (started < n) atomic_store(&sync->cancel, 1);
    if (started < n || !join_within(t, started, WATCHDOG_S)) {
      atomic_store(&sync->cancel, 1);
      nmt_comm_abort(g.comms[0]);
      nmt_test_fail(__FILE__, __LINE__, "%s over %d GPU(s): %s", nmt_comm_wire_name(wire), n,
                    started < n ? "pthread_create failed" : "ranks hang");
      return; /* leaks the group and sync: threads may still use them */
    }
    free(sync);
    size_t wrong = 0, not_wire = 0, differ = 0, worst_i = 0;
    double worst = 0;
    for (int r = 0; r < n && !nmt_test_failed(); r++) {
      if (a[r].st != NMT_OK)
        nmt_test_fail(__FILE__, __LINE__, "%s: rank %d: %s returned %s: %s",
                      nmt_comm_wire_name(wire), r, a[r].failed_at, nmt_status_str(a[r].st),
                      nmt_last_error());
      else if (a[r].too_many != NMT_ERR_INTERNAL)
        nmt_test_fail(__FILE__, __LINE__, "%s: rank %d: a count beyond the reservation gave %s",
                      nmt_comm_wire_name(wire), r, nmt_status_str(a[r].too_many));
    }
    for (size_t i = 0; i < HALF_COUNT && !nmt_test_failed(); i++) {
      float want = wire_round(half_val(0, i), wire);
      double big = fabs(want);
      for (int r = 1; r < n; r++) {
        want = wire_round(want + wire_round(half_val(r, i), wire), wire);
        if (fabs(want) > big) big = fabs(want);
      }
      const float got = a[0].out[i];
      for (int r = 1; r < n; r++) differ += memcmp(&a[r].out[i], &got, sizeof got) != 0;
      if (isnan(got) || isnan(want) || isinf(got) || isinf(want)) {
        wrong += !(isnan(got) && isnan(want)) && got != want;
        continue;
      }
      not_wire += wire_round(got, wire) != got;
      const double err = fabs((double)got - want) / wire_ulp(big, wire);
      if (err > worst) worst = err, worst_i = i;
      wrong += err > tol_ulps;
    }
    for (int r = 0; r < n; r++) free(a[r].out);
    if (!nmt_test_failed() && (wrong || not_wire || differ))
      nmt_test_fail(__FILE__, __LINE__,
                    "sum_as(%s) over %d GPU(s), count %d: #wrong %zu (tolerance %.0f ulp; worst "
                    "%.2f ulp at %zu), %zu results not %s values, %zu differ across ranks",
                    nmt_comm_wire_name(wire), n, (int)HALF_COUNT, wrong, tol_ulps, worst,
                    worst_i, not_wire, nmt_comm_wire_name(wire), differ);
  }
  gpus_close(&g);
}

/* ------------------------------------------------------------------------------------------ */
/* barrier */

typedef struct {
  nmt_comm *c;
  atomic_int *counter;
  nmt_status st;
  int early;
} barrier_arg;

static void *barrier_rank(void *p) {
  barrier_arg *a = p;
  int n = nmt_comm_size(a->c);
  a->st = NMT_OK;
  for (int k = 0; k < 100 && a->st == NMT_OK; k++) {
    atomic_fetch_add(a->counter, 1);
    a->st = nmt_comm_barrier(a->c);
    if (atomic_load(a->counter) < n * (k + 1)) a->early++;
    if (a->st == NMT_OK) a->st = nmt_comm_barrier(a->c); /* nobody bumps k+1 before all checked */
  }
  return NULL;
}

NMT_TEST(cuda_nccl_barrier) {
  gpus g;
  int o = gpus_open(&g, 1, NULL);
  if (o == 0) NMT_SKIP("no CUDA device");
  if (o < 0) return;
  const int n = g.n;
  atomic_int counter = 0;
  pthread_t t[MAX_GPUS];
  barrier_arg a[MAX_GPUS];
  int started = 0;
  for (int r = 0; r < n; r++) {
    a[r] = (barrier_arg){.c = g.comms[r], .counter = &counter};
    if (pthread_create(&t[r], NULL, barrier_rank, &a[r]) != 0) break;
    started++;
  }
  if (started < n || !join_within(t, started, WATCHDOG_S)) {
    nmt_comm_abort(g.comms[0]);
    nmt_test_fail(__FILE__, __LINE__, "barrier over %d GPU(s): %s", n,
                  started < n ? "pthread_create failed" : "ranks hang");
    return; /* leaks the group: threads may still use it */
  }
  int early = 0;
  for (int r = 0; r < n; r++) {
    if (a[r].st != NMT_OK)
      nmt_test_fail(__FILE__, __LINE__, "barrier: rank %d returned %s", r,
                    nmt_status_str(a[r].st));
    early += a[r].early;
  }
  gpus_close(&g);
  if (early) nmt_test_fail(__FILE__, __LINE__, "barrier over %d GPU(s): %d early exits", n, early);
  if (!nmt_test_failed()) NMT_ASSERT_EQ_INT(atomic_load(&counter), 100 * n);
}

/* ------------------------------------------------------------------------------------------ */
/* abort */

/* A host function on a stream: everything enqueued after it waits until *open is set. */
static void CUDART_CB gate_fn(void *p) {
  atomic_int *open = p;
  while (!atomic_load(open)) sleep_ms(1);
}

static nmt_status close_gate(void *ctx, atomic_int *open) {
  void *stream = NULL;
  NMT_TRY(nmt_cuda_ctx_streams(ctx, &stream, NULL));
  cudaError_t e = cudaLaunchHostFunc((cudaStream_t)stream, gate_fn, open);
  if (e != cudaSuccess)
    return nmt_errorf(NMT_ERR_DEVICE, "cudaLaunchHostFunc: %s", cudaGetErrorString(e));
  return NMT_OK;
}

typedef struct {
  void *ctx;
  nmt_comm *c; /* NULL: wait in synchronize; else: barrier */
  nmt_status st;
  double t_end;
} wait_arg;

static void *wait_rank(void *p) {
  wait_arg *a = p;
  a->st = a->c ? nmt_comm_barrier(a->c) : nmt_cuda_synchronize(a->ctx);
  a->t_end = now_s();
  return NULL;
}

typedef struct {
  nmt_comm *c;
  atomic_int *flag;
  double t_abort;
} aborter_arg;

static void *aborter(void *p) {
  aborter_arg *a = p;
  sleep_ms(200);
  a->t_abort = now_s();
  if (a->c) nmt_comm_abort(a->c);
  else atomic_store(a->flag, 1);
  return NULL;
}

/* 1 if both streams of ctx finish within limit_s (raw CUDA: after an abort every wait of a
 * bound context reports the abort, by design). */
static int drained_within(void *ctx, double limit_s) {
  void *streams[2] = {NULL, NULL};
  if (nmt_cuda_ctx_streams(ctx, &streams[0], &streams[1]) != NMT_OK) return 0;
  double t0 = now_s();
  for (int i = 0; i < 2; i++) {
    cudaError_t e;
    while ((e = cudaStreamQuery((cudaStream_t)streams[i])) == cudaErrorNotReady) {
      if (now_s() - t0 > limit_s) return 0;
      sleep_ms(1);
    }
    if (e != cudaSuccess) return 0;
  }
  return 1;
}

/* Opens the gates 2.5 s after the abort whatever happens. ncclCommAbort may wait for the
 * device (NCCL frees device memory), and a rank that was inside an NCCL call when the abort
 * came aborts its own communicator on its way out, so it may be held until the gate opens;
 * it still returns NMT_ERR_ABORTED within the limit. A wait that ignored the abort would come
 * back NMT_OK once the gate opens, and fail the test. */
static void *valve(void *p) {
  sleep_ms(200 + 2500);
  atomic_store((atomic_int *)p, 1);
  return NULL;
}

/* Starts waiters on ranks [0, n_wait) and one aborter; checks that every waiter returned
 * NMT_ERR_ABORTED within ABORT_LIMIT_S of the abort. `gates` (may be NULL) is opened once the
 * waiters are back (or by the valve), before the aborter is joined.
 * Returns 1 if the threads could all be joined (else everything they use must leak). */
static int abort_case(const char *what, wait_arg *w, int n_wait, aborter_arg *ab,
                      atomic_int *gates) {
  pthread_t t[MAX_GPUS], at, vt;
  for (int r = 0; r < n_wait; r++)
    if (pthread_create(&t[r], NULL, wait_rank, &w[r]) != 0) {
      nmt_test_fail(__FILE__, __LINE__, "pthread_create");
      return 0;
    }
  if (pthread_create(&at, NULL, aborter, ab) != 0) {
    nmt_test_fail(__FILE__, __LINE__, "pthread_create");
    return 0;
  }
  if (gates && pthread_create(&vt, NULL, valve, gates) != 0) {
    nmt_test_fail(__FILE__, __LINE__, "pthread_create");
    return 0;
  }
  int back = join_within(t, n_wait, ABORT_LIMIT_S + 1.0);
  if (gates) {
    atomic_store(gates, 1);
    pthread_join(vt, NULL);
  }
  if (!join_within(&at, 1, WATCHDOG_S)) {
    nmt_test_fail(__FILE__, __LINE__, "%s: the aborting thread hangs", what);
    return 0;
  }
  if (!back) {
    nmt_test_fail(__FILE__, __LINE__, "%s: waiting ranks not released by the abort", what);
    return 0;
  }
  for (int r = 0; r < n_wait; r++) {
    if (w[r].st != NMT_ERR_ABORTED)
      nmt_test_fail(__FILE__, __LINE__, "%s: rank %d returned %s, want NMT_ERR_ABORTED", what,
                    r, nmt_status_str(w[r].st));
    else if (w[r].t_end - ab->t_abort > ABORT_LIMIT_S)
      nmt_test_fail(__FILE__, __LINE__, "%s: rank %d came back %.1f s after the abort", what,
                    r, w[r].t_end - ab->t_abort);
  }
  return 1;
}

/* The context alone: its abort flag ends a wait on a stream that cannot finish. */
NMT_TEST(cuda_ctx_wait_honours_abort_flag) {
  gpus g;
  int o = gpus_open(&g, 0, NULL);
  if (o == 0) NMT_SKIP("no CUDA device");
  if (o < 0) return;
  atomic_int flag = 0, gate = 0;
  NMT_ASSERT_OK(nmt_cuda_ctx_set_abort(g.ctx[0], &flag));
  NMT_ASSERT_OK(nmt_cuda_synchronize(g.ctx[0])); /* an idle stream is not an abort */
  nmt_status s = close_gate(g.ctx[0], &gate);
  if (s != NMT_OK) {
    gpus_close(&g);
    NMT_ASSERT_OK(s);
  }
  wait_arg w = {.ctx = g.ctx[0]};
  aborter_arg ab = {.flag = &flag};
  if (!abort_case("ctx abort flag", &w, 1, &ab, &gate)) return; /* leak: a thread may hang */
  atomic_store(&flag, 0);
  s = nmt_cuda_synchronize(g.ctx[0]); /* the gate is open: the stream drains */
  NMT_ASSERT_OK(nmt_cuda_ctx_set_abort(g.ctx[0], NULL));
  gpus_close(&g);
  NMT_ASSERT_OK(s);
}

/* copy_d2h into, and copy_h2d from, pageable host memory (malloc) behind a gated compute
 * stream. cudaMemcpyAsync between device and pageable memory is synchronous with respect to
 * the host: issued behind the gate, device-to-pageable waits inside the driver, deaf to the
 * abort flag, until the gate opens (cuda/memory.cu drains the stream with the polling wait
 * first). Each copy must return NMT_ERR_ABORTED within ABORT_LIMIT_S of the flag while the
 * gate stays shut; it is opened only after that limit, so a copy stuck in the driver fails
 * the case (it did before the fix: validation's copy_d2h after a flush hung behind a dead
 * peer's NCCL kernel). Whether the driver also holds a pageable host-to-device copy of this
 * size behind the stream is its choice (it may stage the data and return), so the h2d half
 * fails only where it does. */
typedef struct {
  void *ctx, *dev, *host;
  size_t bytes;
  int h2d;
  nmt_status st;
  double t_end;
} copy_arg;

static void *copy_rank(void *p) {
  copy_arg *a = p;
  a->st = a->h2d ? nmt_cuda_copy_h2d(a->ctx, a->dev, a->host, a->bytes)
                 : nmt_cuda_copy_d2h(a->ctx, a->host, a->dev, a->bytes);
  a->t_end = now_s();
  return NULL;
}

NMT_TEST(cuda_ctx_pageable_copy_honours_abort_flag) {
  gpus g;
  int o = gpus_open_n(&g, GROUP_NONE, NULL, 1);
  if (o == 0) NMT_SKIP("no CUDA device");
  if (o < 0) return;
  const size_t bytes = (size_t)16 << 20;
  static atomic_int flag, gates[2]; /* static: a leaked thread or host function may read them */
  atomic_store(&flag, 0);
  void *dev = NULL, *host = calloc(1, bytes);
  nmt_status s = host ? nmt_cuda_malloc(g.ctx[0], bytes, &dev) : NMT_ERR_NOMEM;
  if (s == NMT_OK) s = nmt_cuda_ctx_set_abort(g.ctx[0], &flag);
  for (int h2d = 0; h2d < 2 && s == NMT_OK && !nmt_test_failed(); h2d++) {
    const char *what = h2d ? "copy_h2d from pageable memory" : "copy_d2h into pageable memory";
    atomic_store(&gates[h2d], 0);
    atomic_store(&flag, 0);
    s = close_gate(g.ctx[0], &gates[h2d]);
    if (s != NMT_OK) break;
    copy_arg *a = malloc(sizeof *a); /* leaked with the thread if it hangs */
    if (a) *a = (copy_arg){.ctx = g.ctx[0], .dev = dev, .host = host, .bytes = bytes, .h2d = h2d};
    pthread_t t;
    if (!a || pthread_create(&t, NULL, copy_rank, a) != 0) {
      atomic_store(&gates[h2d], 1);
      free(a);
      nmt_test_fail(__FILE__, __LINE__, "%s: cannot start the copying thread", what);
      break;
    }
    sleep_ms(200);
    const double t_abort = now_s();
    atomic_store(&flag, 1);
    const int back = join_within(&t, 1, ABORT_LIMIT_S + 1.0);
    atomic_store(&gates[h2d], 1); /* whatever happened: a copy stuck in the driver can finish */
    if (!back) {
      nmt_test_fail(__FILE__, __LINE__, "%s behind a gated stream ignored the abort flag for "
                    "%d s (blocked inside cudaMemcpyAsync)", what, ABORT_LIMIT_S + 1);
      return; /* leak: the thread, the context and the buffers may still be in use */
    }
    if (a->st != NMT_ERR_ABORTED)
      nmt_test_fail(__FILE__, __LINE__, "%s: returned %s, want NMT_ERR_ABORTED", what,
                    nmt_status_str(a->st));
    else if (a->t_end - t_abort > ABORT_LIMIT_S)
      nmt_test_fail(__FILE__, __LINE__, "%s came back %.1f s after the abort", what,
                    a->t_end - t_abort);
    free(a);
    atomic_store(&flag, 0);
    s = nmt_cuda_synchronize(g.ctx[0]); /* the gate is open: the stream drains */
  }
  /* With the flag down the same copies work, and move the bytes. */
  if (s == NMT_OK && !nmt_test_failed()) {
    memset(host, 0x5a, bytes);
    s = nmt_cuda_copy_h2d(g.ctx[0], dev, host, bytes);
    if (s == NMT_OK) memset(host, 0, bytes);
    if (s == NMT_OK) s = nmt_cuda_copy_d2h(g.ctx[0], host, dev, bytes);
    size_t wrong = 0;
    for (size_t i = 0; s == NMT_OK && i < bytes; i++) wrong += ((unsigned char *)host)[i] != 0x5a;
    if (wrong) nmt_test_fail(__FILE__, __LINE__, "pageable round trip: #wrong %zu", wrong);
  }
  if (s != NMT_OK && !nmt_test_failed())
    nmt_test_fail(__FILE__, __LINE__, "%s: %s", nmt_status_str(s), nmt_last_error());
  (void)nmt_cuda_ctx_set_abort(g.ctx[0], NULL);
  nmt_cuda_free(g.ctx[0], dev);
  free(host);
  gpus_close(&g);
}

/* A bound group's abort ends every rank's wait on its gated compute stream. */
NMT_TEST(cuda_nccl_abort_releases_waits) {
  gpus g;
  int o = gpus_open(&g, 1, NULL);
  if (o == 0) NMT_SKIP("no CUDA device");
  if (o < 0) return;
  atomic_int gate = 0;
  wait_arg w[MAX_GPUS];
  for (int r = 0; r < g.n; r++) {
    nmt_status s = close_gate(g.ctx[r], &gate);
    if (s != NMT_OK) {
      atomic_store(&gate, 1);
      gpus_close(&g);
      NMT_ASSERT_OK(s);
    }
    w[r] = (wait_arg){.ctx = g.ctx[r]};
  }
  aborter_arg ab = {.c = g.comms[g.n - 1]};
  if (!abort_case("group abort", w, g.n, &ab, &gate)) return;
  /* After the abort every collective fails at once, on every rank. */
  for (int r = 0; r < g.n; r++) {
    NMT_ASSERT_EQ_STATUS(nmt_comm_barrier(g.comms[r]), NMT_ERR_ABORTED);
    NMT_ASSERT_EQ_STATUS(nmt_comm_flush(g.comms[r]), NMT_ERR_ABORTED);
  }
  nmt_comm_abort(g.comms[0]); /* idempotent */
  for (int r = 0; r < g.n; r++)
    if (!drained_within(g.ctx[r], WATCHDOG_S)) {
      nmt_test_fail(__FILE__, __LINE__, "rank %d: streams not drained after the abort", r);
      return; /* leak: the device is still busy */
    }
  gpus_close(&g);
}

/* The real case: the last rank never joins; the others wait on NCCL kernels that only
 * ncclCommAbort can stop. The run's flag is raised too. */
NMT_TEST(cuda_nccl_abort_missing_peer) {
  gpus g;
  atomic_int run_abort = 0;
  int o = gpus_open(&g, 1, &run_abort);
  if (o == 0) NMT_SKIP("no CUDA device");
  if (o < 0) return;
  if (g.n < 2) {
    gpus_close(&g);
    NMT_SKIP("needs 2 GPUs");
  }
  wait_arg w[MAX_GPUS];
  for (int r = 0; r < g.n - 1; r++) w[r] = (wait_arg){.ctx = g.ctx[r], .c = g.comms[r]};
  aborter_arg ab = {.c = g.comms[0]};
  if (!abort_case("missing peer", w, g.n - 1, &ab, NULL)) return;
  NMT_ASSERT(atomic_load(&run_abort) != 0);
  /* ncclCommAbort must have stopped the kernels that waited for the missing rank. */
  for (int r = 0; r < g.n; r++)
    if (!drained_within(g.ctx[r], WATCHDOG_S)) {
      nmt_test_fail(__FILE__, __LINE__, "rank %d: NCCL kernels still running %d s after "
                    "ncclCommAbort", r, (int)WATCHDOG_S);
      return; /* leak: the device is still busy */
    }
  gpus_close(&g);
}

/* ------------------------------------------------------------------------------------------ */
/* arguments */

NMT_TEST(cuda_nccl_bad_arguments) {
  gpus g;
  int o = gpus_open(&g, 0, NULL);
  if (o == 0) NMT_SKIP("no CUDA device");
  if (o < 0) return;
  nmt_comm *comms[2];
  int dev[2] = {0, 0};
  void *ctxs[2] = {g.ctx[0], g.ctx[0]};
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_nccl(0, dev, ctxs, NULL, comms), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_nccl(2, dev, ctxs, NULL, comms), NMT_ERR_INTERNAL);
  NMT_ASSERT(strstr(nmt_last_error(), "listed for ranks") != NULL);
  dev[0] = 1; /* the context is on GPU 0 */
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_nccl(1, dev, ctxs, NULL, comms), NMT_ERR_INTERNAL);
  void *none[1] = {NULL};
  dev[0] = 0;
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_nccl(1, dev, none, NULL, comms), NMT_ERR_INTERNAL);
  /* One rank on GPU 0: a host buffer is refused before NCCL sees it; the group still works. */
  nmt_status s = nmt_comm_create_nccl(1, dev, ctxs, NULL, comms);
  if (s != NMT_OK) {
    gpus_close(&g);
    NMT_ASSERT_OK(s);
  }
  float host[4] = {1, 2, 3, 4};
  nmt_status bad = nmt_comm_allreduce_sum(comms[0], host, 4);
  int named = strstr(nmt_last_error(), "not device memory") != NULL;
  nmt_status zero = nmt_comm_allreduce_sum(comms[0], NULL, 0);
  nmt_status bar = nmt_comm_barrier(comms[0]);
  nmt_comm_destroy(comms, 1);
  gpus_close(&g);
  NMT_ASSERT_EQ_STATUS(bad, NMT_ERR_INTERNAL);
  NMT_ASSERT(named);
  NMT_ASSERT_OK(zero);
  NMT_ASSERT_OK(bar);
}

/* ------------------------------------------------------------------------------------------ */
/* ZeRO's collectives: reduce_scatter_sum_as and all_gather */

enum { ZERO_COUNT = (1 << 19) + 3 }; /* per rank; odd so slices start off any alignment */

static uint16_t pattern16(int r, size_t i) { return (uint16_t)mix64(((uint64_t)r << 48) ^ i); }

typedef struct {
  gpus *g;
  rank_sync *sync;
  int rank;
  nmt_status st;
  const char *failed_at;
  char error[512];
  size_t wrong[6]; /* reduce-scatter fp32/fp16/bf16, all-gather fp32/fp16/bf16 */
} zero_arg;

/* Rank `me`: for each wire type, d = src (n x count small integers, by unsynchronized
 * kernels), reduce-scatter, flush, d_own += src_own (must see the reduced slice), copy back,
 * check the owned slice; then all-gather fp32 (only the owned slice written, the rest zero),
 * flush, copy back, check every slice; then all-gather of 16-bit patterns (every slice but
 * the owned one poisoned), check every slice bit for bit. */
static void zero_rank_body(zero_arg *a) {
  const int n = a->g->n, me = a->rank;
  void *ctx = a->g->ctx[me];
  nmt_comm *c = a->g->comms[me];
  const size_t count = ZERO_COUNT, total = count * (size_t)n, own = count * (size_t)me;
  const size_t bytes = total * sizeof(float);
  static const nmt_grad_dtype wires[3] = {NMT_GRAD_FP32, NMT_GRAD_FP16, NMT_GRAD_BF16};
  float *h = malloc(bytes), *d = NULL, *src = NULL;
  a->st = h ? NMT_OK : NMT_ERR_NOMEM;
  STEP(nmt_comm_reserve(c, total)); /* a cudaMalloc too */
  STEP(nmt_cuda_malloc(ctx, bytes, (void **)&d));
  STEP(nmt_cuda_malloc(ctx, bytes, (void **)&src));
  if (!meet_before_collectives(a->sync, &a->st, &a->failed_at)) goto out;
  for (int w = 0; w < 3 && a->st == NMT_OK; w++) {
    for (size_t i = 0; i < total; i++) h[i] = int_val(me, i, 40 + w);
    STEP(nmt_cuda_copy_h2d(ctx, src, h, bytes));
    STEP(nmt_cuda_memset_zero(ctx, d, bytes));
    STEP(nmt_cuda_axpy(ctx, d, src, 1.0f, total));
    STEP(nmt_comm_reduce_scatter_sum_as(c, d, count, wires[w]));
    STEP(nmt_comm_flush(c));
    STEP(nmt_cuda_axpy(ctx, d + own, src + own, 1.0f, count));
    STEP(nmt_cuda_copy_d2h(ctx, h, d + own, count * sizeof(float)));
    /* |sum| <= 30 x 8 = 240: exact in fp32, fp16 and bf16 whatever NCCL's order. */
    for (size_t k = 0; a->st == NMT_OK && k < count; k++) {
      double want = int_val(me, own + k, 40 + w);
      for (int q = 0; q < n; q++) want += int_val(q, own + k, 40 + w);
      a->wrong[w] += (double)h[k] != want;
    }
  }
  for (size_t i = 0; i < total; i++) h[i] = int_val(me, i, 50);
  STEP(nmt_cuda_copy_h2d(ctx, src, h, bytes));
  STEP(nmt_cuda_memset_zero(ctx, d, bytes));
  STEP(nmt_cuda_axpy(ctx, d + own, src + own, 1.0f, count));
  STEP(nmt_comm_all_gather(c, d, count, NMT_GRAD_FP32));
  STEP(nmt_comm_flush(c));
  STEP(nmt_cuda_copy_d2h(ctx, h, d, bytes));
  for (size_t i = 0; a->st == NMT_OK && i < total; i++)
    a->wrong[3] += h[i] != int_val((int)(i / count), i, 50);
  for (int w = 1; w < 3 && a->st == NMT_OK; w++) {
    uint16_t *h16 = (uint16_t *)h;
    for (size_t i = 0; i < total; i++)
      h16[i] = pattern16(i / count == (size_t)me ? me : MAX_GPUS + me, i);
    STEP(nmt_cuda_copy_h2d(ctx, d, h16, total * 2));
    STEP(nmt_comm_all_gather(c, d, count, wires[w]));
    STEP(nmt_comm_flush(c));
    STEP(nmt_cuda_copy_d2h(ctx, h16, d, total * 2));
    for (size_t i = 0; a->st == NMT_OK && i < total; i++)
      a->wrong[3 + w] += h16[i] != pattern16((int)(i / count), i);
  }
out:
  if (a->st != NMT_OK) snprintf(a->error, sizeof a->error, "%s", nmt_last_error());
  ranks_meet(a->sync, 2, NMT_OK); /* every rank's collectives have completed */
  nmt_cuda_free(ctx, d);
  nmt_cuda_free(ctx, src);
  free(h);
}

static void *zero_rank(void *p) {
  zero_rank_body(p);
  return NULL;
}

/* Runs zero_rank on every rank of gg's group and checks; on a hang the group is aborted and
 * leaked (gg->have_group cleared). */
static void run_zero_collectives(gpus *gg) {
  static const char *const what[6] = {"reduce_scatter(float)",  "reduce_scatter(half)",
                                      "reduce_scatter(bfloat16)", "all_gather(float)",
                                      "all_gather(half)",       "all_gather(bfloat16)"};
  gpus g = *gg;
  pthread_t t[MAX_GPUS];
  zero_arg a[MAX_GPUS];
  rank_sync *sync = rank_sync_new(g.n);
  if (!sync) {
    nmt_test_fail(__FILE__, __LINE__, "out of memory");
    return;
  }
  int started = 0;
  for (int r = 0; r < g.n; r++) {
    a[r] = (zero_arg){.g = &g, .sync = sync, .rank = r};
    if (pthread_create(&t[r], NULL, zero_rank, &a[r]) != 0) break;
    started++;
  }
  if (started < g.n) atomic_store(&sync->cancel, 1);
  if (started < g.n || !join_within(t, started, WATCHDOG_S)) {
    atomic_store(&sync->cancel, 1);
    nmt_comm_abort(g.comms[0]);
    nmt_test_fail(__FILE__, __LINE__, "ZeRO collectives over %d GPU(s): %s", g.n,
                  started < g.n ? "pthread_create failed" : "ranks hang");
    gg->have_group = 0;
    return; /* leaks the group and sync: threads may still use them */
  }
  free(sync);
  for (int r = 0; r < g.n && !nmt_test_failed(); r++)
    if (a[r].st != NMT_OK)
      nmt_test_fail(__FILE__, __LINE__, "rank %d: %s returned %s: %s", r, a[r].failed_at,
                    nmt_status_str(a[r].st), a[r].error);
  for (int k = 0; k < 6 && !nmt_test_failed(); k++) {
    size_t wrong = 0;
    for (int r = 0; r < g.n; r++) wrong += a[r].wrong[k];
    if (wrong)
      nmt_test_fail(__FILE__, __LINE__, "%s over %d GPU(s), %d per rank: #wrong %zu", what[k],
                    g.n, (int)ZERO_COUNT, wrong);
  }
}

NMT_TEST(cuda_nccl_zero_collectives) {
  gpus g;
  int o = gpus_open(&g, GROUP_ALL, NULL);
  if (o == 0) NMT_SKIP("no CUDA device");
  if (o < 0) return;
  run_zero_collectives(&g);
  if (g.have_group) gpus_close(&g);
}

/* ------------------------------------------------------------------------------------------ */
/* several processes' path, degenerate: one process, the clique created through a unique id */

static void unique_id_group(int max_n) {
  gpus g;
  int o = gpus_open_n(&g, GROUP_BY_ID, NULL, max_n);
  if (o <= 0) return;
  for (int r = 0; r < g.n; r++) {
    NMT_ASSERT_EQ_INT(nmt_comm_rank(g.comms[r]), r);
    NMT_ASSERT_EQ_INT(nmt_comm_size(g.comms[r]), g.n);
  }
  run_collectives(&g);
  if (g.have_group && !nmt_test_failed()) run_zero_collectives(&g);
  if (g.have_group) gpus_close(&g);
}

NMT_TEST(cuda_nccl_unique_id_path) {
  int n = 0;
  if (nmt_cuda_device_count(&n) != NMT_OK || n < 1) NMT_SKIP("no CUDA device");
  unique_id_group(1); /* one rank, world 1: the single-node degenerate case */
  if (!nmt_test_failed() && n >= 2) unique_id_group(MAX_GPUS);
}

/* The multi-process creation's own checks, made before NCCL is loaded; the id's size. */
NMT_TEST(cuda_nccl_ranks_bad_arguments) {
  char small[16];
  NMT_ASSERT_EQ_STATUS(nmt_comm_nccl_unique_id(small, sizeof small), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_comm_nccl_unique_id(NULL, NMT_COMM_NCCL_ID_BYTES), NMT_ERR_INTERNAL);
  gpus g;
  int o = gpus_open_n(&g, GROUP_NONE, NULL, 1);
  if (o == 0) NMT_SKIP("no CUDA device");
  if (o < 0) return;
  char id[NMT_COMM_NCCL_ID_BYTES] = {0};
  nmt_comm *comms[1];
  const nmt_status world_small =
      nmt_comm_create_nccl_ranks(1, g.devices, g.ctx, 0, 0, id, 0, NULL, comms);
  const nmt_status past_end =
      nmt_comm_create_nccl_ranks(1, g.devices, g.ctx, 4, 4, id, 0, NULL, comms);
  const nmt_status negative =
      nmt_comm_create_nccl_ranks(1, g.devices, g.ctx, 4, -1, id, 0, NULL, comms);
  const nmt_status no_id =
      nmt_comm_create_nccl_ranks(1, g.devices, g.ctx, 1, 0, NULL, 0, NULL, comms);
  int named = strstr(nmt_last_error(), "unique id") != NULL;
  gpus_close(&g);
  NMT_ASSERT_EQ_STATUS(world_small, NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(past_end, NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(negative, NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(no_id, NMT_ERR_INTERNAL);
  NMT_ASSERT(named);
}

/* The timeout of the multi-process creation, refused before anything is loaded (no GPU). */
NMT_TEST(cuda_nccl_ranks_bad_timeout) {
  char id[NMT_COMM_NCCL_ID_BYTES] = {0};
  const int dev[1] = {0};
  void *ctxs[1] = {NULL};
  nmt_comm *comms[1];
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_nccl_ranks(1, dev, ctxs, 1, 0, id, -1, NULL, comms),
                       NMT_ERR_CONFIG);
  NMT_ASSERT(strstr(nmt_last_error(), "parallel.timeout_s") != NULL);
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_nccl_ranks(1, dev, ctxs, 1, 0, id, NAN, NULL, comms),
                       NMT_ERR_CONFIG);
}

/* A clique whose other process never comes: this GPU as global rank 0 of a world of 2.
 * ncclCommInitRank would wait for rank 1 forever, deaf to any abort; the nonblocking init
 * (cuda/nccl.cu) must end at parallel.timeout_s, or when the run's abort flag is raised, with
 * NMT_ERR_ABORTED, after ncclCommAbort, and leave the context usable. Each creation runs on
 * a thread of its own, so that a hang is reported (and leaked) instead of hanging the run. */
typedef struct {
  void *ctx;
  int device;
  double timeout_s; /* parallel.timeout_s of the creation (0: none, only the flag ends it) */
  atomic_int *abort;
  nmt_status st;
  char error[512];
  double t_end;
} lonely_arg;

static void *lonely_rank(void *p) {
  lonely_arg *a = p;
  char id[NMT_COMM_NCCL_ID_BYTES];
  nmt_comm *comms[1] = {NULL};
  void *ctxs[1] = {a->ctx};
  a->st = nmt_comm_nccl_unique_id(id, sizeof id);
  if (a->st == NMT_OK)
    a->st = nmt_comm_create_nccl_ranks(1, &a->device, ctxs, 2, 0, id, a->timeout_s, a->abort,
                                       comms);
  snprintf(a->error, sizeof a->error, "%s", nmt_last_error());
  a->t_end = now_s();
  return NULL;
}

/* Runs one lonely creation (the abort flag raised after raise_ms when raise_ms >= 0);
 * 1 if its thread came back within `limit_s` (else it and the context leak). */
static int lonely_case(gpus *g, double timeout_s, long raise_ms, double limit_s,
                       lonely_arg **out) {
  static atomic_int flag; /* static: a leaked thread may still read it */
  atomic_store(&flag, 0);
  lonely_arg *a = malloc(sizeof *a); /* leaked with a hung thread */
  if (!a) {
    nmt_test_fail(__FILE__, __LINE__, "out of memory");
    return 0;
  }
  *a = (lonely_arg){.ctx = g->ctx[0], .device = g->devices[0], .timeout_s = timeout_s,
                    .abort = &flag};
  const double t0 = now_s();
  pthread_t t;
  if (pthread_create(&t, NULL, lonely_rank, a) != 0) {
    free(a);
    nmt_test_fail(__FILE__, __LINE__, "pthread_create");
    return 0;
  }
  if (raise_ms >= 0) {
    sleep_ms(raise_ms);
    atomic_store(&flag, 1);
  }
  if (!join_within(&t, 1, limit_s)) {
    nmt_test_fail(__FILE__, __LINE__, "creating global rank 0 of 2 without rank 1 hangs (%.0f s; "
                  "timeout_s %g, abort flag %s)", limit_s, timeout_s,
                  raise_ms >= 0 ? "raised" : "not raised");
    return 0;
  }
  a->t_end -= t0;
  *out = a;
  return 1;
}

NMT_TEST(cuda_nccl_init_missing_peer_times_out) {
  gpus g;
  int o = gpus_open_n(&g, GROUP_NONE, NULL, 1);
  if (o == 0) NMT_SKIP("no CUDA device");
  if (o < 0) return;
  const double timeout_s = 2;
  lonely_arg *a = NULL;
  if (!lonely_case(&g, timeout_s, -1, WATCHDOG_S, &a)) return; /* leak */
  printf("# %s (after %.1f s)\n", a->error, a->t_end);
  const nmt_status st = a->st;
  const int named = strstr(a->error, "parallel.timeout_s") != NULL;
  const double took = a->t_end;
  free(a);
  /* The context is untouched: no hook left behind, it still works. */
  const nmt_status after = nmt_cuda_synchronize(g.ctx[0]);
  gpus_close(&g);
  NMT_ASSERT_EQ_STATUS(st, NMT_ERR_ABORTED);
  NMT_ASSERT(named);
  NMT_ASSERT(took >= 0.9 * timeout_s); /* not before the timeout */
  NMT_ASSERT_OK(after);
}

NMT_TEST(cuda_nccl_init_honours_abort_flag) {
  gpus g;
  int o = gpus_open_n(&g, GROUP_NONE, NULL, 1);
  if (o == 0) NMT_SKIP("no CUDA device");
  if (o < 0) return;
  lonely_arg *a = NULL;
  /* No timeout: only the flag can end it. */
  if (!lonely_case(&g, 0, 200, ABORT_LIMIT_S + 1.0, &a)) return; /* leak */
  printf("# %s (after %.1f s)\n", a->error, a->t_end);
  const nmt_status st = a->st;
  free(a);
  const nmt_status after = nmt_cuda_synchronize(g.ctx[0]);
  gpus_close(&g);
  NMT_ASSERT_EQ_STATUS(st, NMT_ERR_ABORTED);
  NMT_ASSERT_OK(after);
}

/* The multi-process shape in one process: rank r of a world of n created by its own thread
 * with n_local = 1, as each node's process does, so each init waits for peers it does not
 * hold, and each warm-up's group holds one communicator. Then the collectives (nonblocking
 * communicators: every call settles through ncclCommGetAsyncError) and a destroy per rank,
 * concurrently (a finalize may wait for its peers). 2 GPUs or more. */
typedef struct {
  gpus *g;
  const char *id;
  atomic_int *abort;
  int rank;
  nmt_status st;
  char error[512];
} own_arg;

static void *own_create(void *p) {
  own_arg *a = p;
  a->st = nmt_comm_create_nccl_ranks(1, &a->g->devices[a->rank], &a->g->ctx[a->rank], a->g->n,
                                     a->rank, a->id, WATCHDOG_S / 2, a->abort,
                                     &a->g->comms[a->rank]);
  if (a->st != NMT_OK) snprintf(a->error, sizeof a->error, "%s", nmt_last_error());
  return NULL;
}

static void *own_destroy(void *p) {
  own_arg *a = p;
  if (a->g->comms[a->rank]) nmt_comm_destroy(&a->g->comms[a->rank], 1);
  return NULL;
}

/* Runs fn on every rank's own_arg; 1 if all threads were joined within WATCHDOG_S. */
static int on_every_rank(own_arg *a, int n, void *(*fn)(void *)) {
  pthread_t t[MAX_GPUS];
  int started = 0;
  for (int r = 0; r < n; r++) {
    if (pthread_create(&t[r], NULL, fn, &a[r]) != 0) break;
    started++;
  }
  const int joined = join_within(t, started, WATCHDOG_S);
  if (started < n) nmt_test_fail(__FILE__, __LINE__, "pthread_create");
  return joined && started == n;
}

NMT_TEST(cuda_nccl_ranks_in_threads) {
  int n = 0;
  if (nmt_cuda_device_count(&n) != NMT_OK || n < 1) NMT_SKIP("no CUDA device");
  if (n < 2) NMT_SKIP("needs 2 GPUs");
  static gpus g; /* static: leaked threads may still use it */
  static atomic_int run_abort;
  atomic_store(&run_abort, 0);
  if (gpus_open(&g, GROUP_NONE, NULL) <= 0) return;
  char id[NMT_COMM_NCCL_ID_BYTES];
  nmt_status s = nmt_comm_nccl_unique_id(id, sizeof id);
  if (s != NMT_OK) {
    gpus_close(&g);
    NMT_ASSERT_OK(s);
  }
  own_arg *a = calloc((size_t)g.n, sizeof *a); /* leaked with hung threads */
  NMT_ASSERT(a != NULL);
  for (int r = 0; r < g.n; r++) a[r] = (own_arg){.g = &g, .id = id, .abort = &run_abort, .rank = r};
  if (!on_every_rank(a, g.n, own_create)) {
    atomic_store(&run_abort, 1); /* every group waits on the run's flag */
    nmt_test_fail(__FILE__, __LINE__, "creating %d ranks in %d threads hangs", g.n, g.n);
    return; /* leak */
  }
  int created = 0;
  for (int r = 0; r < g.n; r++) {
    if (a[r].st == NMT_OK) created++;
    else if (!nmt_test_failed())
      nmt_test_fail(__FILE__, __LINE__, "rank %d of %d: %s: %s", r, g.n,
                    nmt_status_str(a[r].st), a[r].error);
  }
  if (created == g.n) {
    g.have_group = 1;
    run_collectives(&g); /* clears have_group on a hang, after aborting */
    if (!g.have_group) {
      atomic_store(&run_abort, 1);
      return; /* leak */
    }
  }
  g.have_group = 0; /* one group per rank here: destroyed one by one, concurrently */
  if (created && !on_every_rank(a, g.n, own_destroy)) {
    nmt_test_fail(__FILE__, __LINE__, "destroying %d one-rank groups hangs", g.n);
    return; /* leak */
  }
  free(a);
  gpus_close(&g);
}

/* ------------------------------------------------------------------------------------------ */
/* NCCL loaded on demand (no GPU needed) */

NMT_TEST(cuda_nccl_loader_messages) {
  int version = -1;
  /* A library that is not there: its name, dlopen's reason, and what to do. */
  const char *missing = "libnccl-nmt-test-missing.so.2";
  NMT_ASSERT_EQ_STATUS(nmt__nccl_probe(missing, &version), NMT_ERR_DEVICE);
  const char *m = nmt_last_error();
  printf("# %s\n", m);
  NMT_ASSERT(strstr(m, missing) != NULL);
  NMT_ASSERT(strstr(m, "cannot open shared object file") != NULL); /* dlerror()'s text */
  NMT_ASSERT(strstr(m, "LD_LIBRARY_PATH") != NULL);
  NMT_ASSERT_EQ_INT(version, 0);
  /* A library that is there but is not NCCL: the first missing function, dlsym's reason. */
  NMT_ASSERT_EQ_STATUS(nmt__nccl_probe("libm.so.6", &version), NMT_ERR_DEVICE);
  m = nmt_last_error();
  NMT_ASSERT(strstr(m, "libm.so.6") != NULL && strstr(m, "lacks ncclGetVersion") != NULL);
  NMT_ASSERT(strstr(m, "dlsym") != NULL);
  /* The real one, where installed: every function resolves, and it is recent enough. */
  nmt_status s = nmt__nccl_probe("libnccl.so.2", &version);
  if (s != NMT_OK && strstr(nmt_last_error(), "cannot open shared object file"))
    NMT_SKIP("libnccl.so.2 not installed here (the refusals above passed)");
  NMT_ASSERT_OK(s);
  printf("# libnccl.so.2: NCCL %d\n", version);
  NMT_ASSERT(version >= 21400);
}

#endif /* NMT_CUDA */
