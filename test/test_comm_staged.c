/* test_comm_staged.c — the host-staged communicator (nmt_comm_create_staged, src/comm/staged.c)
 * over the reference backend, whose comm-stream copies are memmoves: the staging logic itself
 * (regions, pending collectives run in issue order at the flush, what goes down and back, a
 * buffer that reads what a pending collective writes, a reservation smaller than the step)
 * on the CPU, against the host communicator it wraps. nccl-tests style: each check counts the
 * wrong elements and prints the count.
 *  - a sequence of every collective, all pending before one flush, gives bitwise the host
 *    communicator's results run one by one (n = 2, 3; with staging for all of them, and with
 *    staging for the largest one only, so that earlier ones run early);
 *  - a chain of in-place all-gathers whose buffers overlap (ZeRO's last-bucket-first gathers)
 *    gives the host's results;
 *  - abort: a rank that never flushes; the others' flushes return NMT_ERR_ABORTED;
 *  - arguments: a collective beyond the reservation, growing the staging with collectives
 *    pending, creation without a backend; the name.
 * The GPU side (the same code with cudaMemcpyAsync on the comm stream): the two
 * cuda_multiworker_comm_* tests here (the sequence on two and three contexts of GPU 0, one
 * thread each, against the host communicator; a collective's copy down waits for the compute
 * stream, held by a gate), and test_multiworker.c's trainer-level cuda_multiworker_* tests.
 * With -DNMT_CUDA_TESTS_ON_REF the reference backend plays the device in the first two
 * (test/gpu_helpers.h). Every join has a 10 s watchdog. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nmt/backend.h"
#include "nmt/comm.h"
#include "nmt/half.h"
#include "gpu_helpers.h"
#include "test.h"

#define MAX_RANKS 3
#define WATCHDOG_S 10
#define N 1000 /* elements per all-reduce; per rank slice for the ZeRO collectives: N / 4 */

/* One rank's buffers: every collective of the sequence on its own region of one array. */
enum { R_SUM, R_SUM_BF16, R_MAX, R_BCAST, R_RS, R_RS_FP16, R_AG, R_AG16, R_N };

typedef struct {
  nmt_comm *c;
  float *buf[R_N];
  size_t count[R_N]; /* the call's count argument */
  int staged;        /* 1: all collectives, then one flush; 0: flush after each */
  nmt_status st;
} rank_job;

static uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* Non-integer values whose rank-order sums round: an order change would show. */
static float val(int r, int k, size_t i) {
  return (float)((double)(mix64(((uint64_t)r << 40) ^ ((uint64_t)k << 32) ^ i) >> 40) /
                     (double)(1 << 24) - 0.5) * (float)(1 + k);
}

static size_t elems(int k, int n) {
  switch (k) {
  case R_RS: case R_RS_FP16: case R_AG: case R_AG16: return (size_t)n * (N / 4);
  default: return N;
  }
}

static nmt_status sequence(rank_job *j) {
  nmt_comm *c = j->c;
  for (int k = 0; k < R_N; k++) {
    nmt_status s = NMT_OK;
    switch (k) {
    case R_SUM: s = nmt_comm_allreduce_sum(c, j->buf[k], j->count[k]); break;
    case R_SUM_BF16: s = nmt_comm_allreduce_sum_as(c, j->buf[k], j->count[k], NMT_GRAD_BF16); break;
    case R_MAX: s = nmt_comm_allreduce_max(c, j->buf[k], j->count[k]); break;
    case R_BCAST: s = nmt_comm_broadcast(c, j->buf[k], j->count[k], 1); break;
    case R_RS: s = nmt_comm_reduce_scatter_sum_as(c, j->buf[k], j->count[k], NMT_GRAD_FP32); break;
    case R_RS_FP16:
      s = nmt_comm_reduce_scatter_sum_as(c, j->buf[k], j->count[k], NMT_GRAD_FP16);
      break;
    case R_AG: s = nmt_comm_all_gather(c, j->buf[k], j->count[k], NMT_GRAD_FP32); break;
    case R_AG16: s = nmt_comm_all_gather(c, j->buf[k], j->count[k], NMT_GRAD_BF16); break;
    }
    NMT_TRY(s);
    if (!j->staged) NMT_TRY(nmt_comm_flush(c));
  }
  return nmt_comm_flush(c);
}

static void *rank_main(void *p) {
  rank_job *j = p;
  j->st = sequence(j);
  if (j->st != NMT_OK) nmt_comm_abort(j->c);
  return NULL;
}

static int join_all(pthread_t *t, int n, nmt_comm *any) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += WATCHDOG_S;
  for (int i = 0; i < n; i++)
    if (pthread_timedjoin_np(t[i], NULL, &dl) != 0) {
      nmt_comm_abort(any);
      for (int k = i; k < n; k++) pthread_join(t[k], NULL);
      return 0;
    }
  return 1;
}

/* Runs the sequence on n ranks of `comms`; out[r][k] gets rank r's buffers (malloc'd). */
static int run_sequence(int n, nmt_comm **comms, int staged, float *out[MAX_RANKS][R_N]) {
  rank_job jobs[MAX_RANKS];
  pthread_t t[MAX_RANKS];
  for (int r = 0; r < n; r++) {
    jobs[r] = (rank_job){.c = comms[r], .staged = staged};
    for (int k = 0; k < R_N; k++) {
      const size_t e = elems(k, n);
      jobs[r].count[k] = e == N ? N : N / 4;
      out[r][k] = jobs[r].buf[k] = malloc(e * sizeof(float));
      if (!out[r][k]) return 0;
      for (size_t i = 0; i < e; i++) jobs[r].buf[k][i] = val(r, k, i);
      if (k == R_AG16) { /* 16-bit storage: two bf16 values per float slot of the array */
        uint16_t *h = (uint16_t *)jobs[r].buf[k];
        for (size_t i = 0; i < e; i++) h[i] = (uint16_t)mix64(((uint64_t)r << 32) ^ i);
      }
    }
    if (nmt_comm_reserve(comms[r], (size_t)n * N) != NMT_OK) return 0;
  }
  for (int r = 0; r < n; r++)
    if (pthread_create(&t[r], NULL, rank_main, &jobs[r]) != 0) return 0;
  if (!join_all(t, n, comms[0])) return 0;
  for (int r = 0; r < n; r++)
    if (jobs[r].st != NMT_OK) {
      printf("# rank %d: %s: %s\n", r, nmt_status_str(jobs[r].st), nmt_last_error());
      return 0;
    }
  return 1;
}

static void free_out(int n, float *out[MAX_RANKS][R_N]) {
  for (int r = 0; r < n; r++)
    for (int k = 0; k < R_N; k++) free(out[r][k]), out[r][k] = NULL;
}

/* The elements the contract defines on rank r after collective k (a reduce-scatter's own slice
 * only; a 16-bit gather's bytes: half of the float slots hold them). */
static size_t compare_bits(int k, int n, int r, const float *a, const float *b) {
  size_t lo = 0, hi = elems(k, n), wrong = 0;
  if (k == R_RS || k == R_RS_FP16) lo = (size_t)r * (N / 4), hi = lo + N / 4;
  if (k == R_AG16) hi = (hi + 1) / 2;
  for (size_t i = lo; i < hi; i++) wrong += memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return wrong;
}

/* Elements of the n ranks' R_N outputs whose bits differ from want's (each collective with a
 * difference printed); *total gets the element count. */
static size_t count_wrong(int n, float *got[][R_N], float *want[][R_N], size_t *total) {
  size_t wrong = 0;
  *total = 0;
  for (int r = 0; r < n; r++)
    for (int k = 0; k < R_N; k++) {
      const size_t w = compare_bits(k, n, r, got[r][k], want[r][k]);
      if (w) printf("# n %d rank %d collective %d: %zu wrong\n", n, r, k, w);
      wrong += w, *total += elems(k, n);
    }
  return wrong;
}

static void staged_vs_host(int n, size_t staging_bytes) {
  nmt_comm *hc[MAX_RANKS], *sc[MAX_RANKS];
  float *want[MAX_RANKS][R_N] = {{0}}, *got[MAX_RANKS][R_N] = {{0}};
  NMT_ASSERT_OK(nmt_comm_create_host(n, NULL, hc));
  int ok = run_sequence(n, hc, 0, want);
  nmt_comm_destroy(hc, n);
  NMT_ASSERT(ok);
  NMT_ASSERT_OK(nmt_comm_create_staged(n, &nmt_backend_ref, NULL, NULL, sc));
  NMT_ASSERT(!strcmp(nmt_comm_name(sc[0]), "host-staged"));
  for (int r = 0; r < n; r++) NMT_ASSERT_OK(nmt_comm_reserve_staging(sc[r], staging_bytes));
  ok = run_sequence(n, sc, 1, got);
  nmt_comm_destroy(sc, n);
  size_t total = 0, wrong = ok ? count_wrong(n, got, want, &total) : 0;
  free_out(n, want), free_out(n, got);
  printf("# n %d, staging %zu bytes: %zu of %zu elements differ from the host communicator's\n",
         n, staging_bytes, wrong, total);
  NMT_ASSERT(ok);
  NMT_ASSERT_EQ_INT(wrong, 0);
}

NMT_TEST(comm_staged_matches_host_bitwise) {
  for (int n = 2; n <= MAX_RANKS; n++) {
    size_t all = 0;
    for (int k = 0; k < R_N; k++) all += ((elems(k, n) * sizeof(float) + 255) / 256) * 256;
    staged_vs_host(n, all);                           /* every collective pending at once */
    staged_vs_host(n, (size_t)n * N * sizeof(float)); /* room for the largest one only */
  }
}

/* ZeRO's in-place gathers, last bucket first: bucket b's n slices run into bucket b+1's
 * parameters, and must carry the values b+1's gather already brought. */
typedef struct {
  nmt_comm *c;
  float *p;
  int staged;
  nmt_status st;
} chain_job;

enum { CHAIN_SLICE = 96, CHAIN_BUCKETS = 3, CHAIN_STEP = 150 }; /* bucket b starts at b * 150 */

static void *chain_main(void *arg) {
  chain_job *j = arg;
  nmt_status s = NMT_OK;
  for (int b = CHAIN_BUCKETS - 1; b >= 0 && s == NMT_OK; b--) {
    s = nmt_comm_all_gather(j->c, j->p + (size_t)b * CHAIN_STEP, CHAIN_SLICE, NMT_GRAD_FP32);
    if (s == NMT_OK && !j->staged) s = nmt_comm_flush(j->c);
  }
  j->st = s == NMT_OK ? nmt_comm_flush(j->c) : s;
  if (j->st != NMT_OK) nmt_comm_abort(j->c);
  return NULL;
}

static int run_chain(int n, nmt_comm **comms, int staged, float **p) {
  chain_job jobs[MAX_RANKS];
  pthread_t t[MAX_RANKS];
  const size_t len = (size_t)(CHAIN_BUCKETS - 1) * CHAIN_STEP + (size_t)n * CHAIN_SLICE;
  for (int r = 0; r < n; r++) {
    p[r] = malloc(len * sizeof(float));
    if (!p[r]) return 0;
    for (size_t i = 0; i < len; i++) p[r][i] = val(r, 9, i);
    jobs[r] = (chain_job){.c = comms[r], .p = p[r], .staged = staged};
  }
  for (int r = 0; r < n; r++)
    if (pthread_create(&t[r], NULL, chain_main, &jobs[r]) != 0) return 0;
  if (!join_all(t, n, comms[0])) return 0;
  for (int r = 0; r < n; r++)
    if (jobs[r].st != NMT_OK) return 0;
  return 1;
}

NMT_TEST(comm_staged_overlapping_gathers_keep_stream_order) {
  for (int n = 2; n <= MAX_RANKS; n++) {
    nmt_comm *hc[MAX_RANKS], *sc[MAX_RANKS];
    float *want[MAX_RANKS] = {0}, *got[MAX_RANKS] = {0};
    NMT_ASSERT_OK(nmt_comm_create_host(n, NULL, hc));
    int ok = run_chain(n, hc, 0, want);
    nmt_comm_destroy(hc, n);
    NMT_ASSERT_OK(nmt_comm_create_staged(n, &nmt_backend_ref, NULL, NULL, sc));
    for (int r = 0; r < n; r++) NMT_ASSERT_OK(nmt_comm_reserve_staging(sc[r], 1 << 20));
    ok = ok && run_chain(n, sc, 1, got);
    nmt_comm_destroy(sc, n);
    const size_t len = (size_t)(CHAIN_BUCKETS - 1) * CHAIN_STEP + (size_t)n * CHAIN_SLICE;
    size_t wrong = 0;
    for (int r = 0; ok && r < n; r++)
      for (size_t i = 0; i < len; i++) wrong += memcmp(&got[r][i], &want[r][i], 4) != 0;
    for (int r = 0; r < n; r++) free(want[r]), free(got[r]);
    printf("# n %d: %zu wrong of %zu per rank\n", n, wrong, len);
    NMT_ASSERT(ok);
    NMT_ASSERT_EQ_INT(wrong, 0);
  }
}

/* Rank 1 issues its collective but never flushes; rank 0's flush waits in the host group
 * until the abort flag is raised, then returns NMT_ERR_ABORTED. */
typedef struct {
  nmt_comm *c;
  float *buf;
  int flush;
  nmt_status st;
} abort_job;

static void *abort_rank(void *arg) {
  abort_job *j = arg;
  j->st = nmt_comm_allreduce_sum(j->c, j->buf, 64);
  if (j->st == NMT_OK && j->flush) j->st = nmt_comm_flush(j->c);
  return NULL;
}

NMT_TEST(comm_staged_abort_ends_flush) {
  atomic_int flag;
  atomic_init(&flag, 0);
  nmt_comm *sc[2];
  float bufs[2][64] = {{0}};
  NMT_ASSERT_OK(nmt_comm_create_staged(2, &nmt_backend_ref, NULL, &flag, sc));
  for (int r = 0; r < 2; r++) NMT_ASSERT_OK(nmt_comm_reserve_staging(sc[r], 4096));
  abort_job j[2] = {{sc[0], bufs[0], 1, NMT_OK}, {sc[1], bufs[1], 0, NMT_OK}};
  pthread_t t[2];
  for (int r = 0; r < 2; r++) NMT_ASSERT(pthread_create(&t[r], NULL, abort_rank, &j[r]) == 0);
  pthread_join(t[1], NULL);
  const struct timespec d = {0, 50 * 1000 * 1000};
  nanosleep(&d, NULL);
  nmt_comm_abort(sc[1]);
  NMT_ASSERT(join_all(t, 1, sc[0]));
  NMT_ASSERT_EQ_STATUS(j[1].st, NMT_OK);
  NMT_ASSERT_EQ_STATUS(j[0].st, NMT_ERR_ABORTED);
  NMT_ASSERT(atomic_load(&flag) != 0); /* the run's flag, which the contexts' waits poll */
  NMT_ASSERT_EQ_STATUS(nmt_comm_flush(sc[1]), NMT_ERR_ABORTED);
  nmt_comm_destroy(sc, 2);
}

NMT_TEST(comm_staged_bad_arguments) {
  nmt_comm *sc[2];
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_staged(0, &nmt_backend_ref, NULL, NULL, sc),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_staged(2, NULL, NULL, NULL, sc), NMT_ERR_INTERNAL);
  /* One rank: no peer to wait for, so the errors show on this thread. */
  NMT_ASSERT_OK(nmt_comm_create_staged(1, &nmt_backend_ref, NULL, NULL, sc));
  float buf[512];
  memset(buf, 0, sizeof buf);
  NMT_ASSERT_EQ_STATUS(nmt_comm_allreduce_sum(sc[0], buf, 16), NMT_ERR_INTERNAL);
  NMT_ASSERT(strstr(nmt_last_error(), "nmt_comm_reserve_staging") != NULL);
  NMT_ASSERT_OK(nmt_comm_reserve_staging(sc[0], 256));
  NMT_ASSERT_OK(nmt_comm_allreduce_sum(sc[0], buf, 16));
  NMT_ASSERT_EQ_STATUS(nmt_comm_reserve_staging(sc[0], 4096), NMT_ERR_INTERNAL);
  NMT_ASSERT(strstr(nmt_last_error(), "pending") != NULL);
  NMT_ASSERT_OK(nmt_comm_flush(sc[0]));
  NMT_ASSERT_OK(nmt_comm_reserve_staging(sc[0], 4096));
  /* A half wire still needs its reservation, on this handle as on the host's. */
  NMT_ASSERT_EQ_STATUS(nmt_comm_allreduce_sum_as(sc[0], buf, 16, NMT_GRAD_BF16), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(nmt_comm_reserve(sc[0], 16));
  for (int i = 0; i < 16; i++) buf[i] = 1.0f + 0x1p-12f * (float)i;
  NMT_ASSERT_OK(nmt_comm_allreduce_sum_as(sc[0], buf, 16, NMT_GRAD_BF16));
  NMT_ASSERT_OK(nmt_comm_barrier(sc[0])); /* flushes */
  for (int i = 0; i < 16; i++) NMT_ASSERT(buf[i] == nmt_half_round_bf16(1.0f + 0x1p-12f * (float)i));
  nmt_comm_destroy(sc, 1);
}

/* ------------------------------------------------------------------------------------------ */
/* on the device backend: contexts of GPU 0, device buffers, the comm stream's copies */

/* The sequence of every collective, all pending before one flush, on n contexts of device 0
 * (one host thread each, as the trainer's workers with parallel.devices = 0,0): each rank's
 * buffers are device memory, copied in before and read back (copy_d2h, on the compute stream:
 * it sees the results only through the flush's join) after. Bitwise the host communicator's
 * results on host copies of the same values. */
static int run_sequence_dev(int n, const nmt_backend *be, void *const *ctxs, nmt_comm **comms,
                            float *out[MAX_RANKS][R_N]) {
  rank_job jobs[MAX_RANKS];
  pthread_t t[MAX_RANKS];
  float *dev[MAX_RANKS][R_N] = {{0}};
  int ok = 1;
  for (int r = 0; ok && r < n; r++) {
    jobs[r] = (rank_job){.c = comms[r], .staged = 1};
    for (int k = 0; ok && k < R_N; k++) {
      const size_t e = elems(k, n);
      jobs[r].count[k] = e == N ? N : N / 4;
      out[r][k] = malloc(e * sizeof(float));
      ok = out[r][k] && be->malloc(ctxs[r], e * sizeof(float), (void **)&dev[r][k]) == NMT_OK;
      if (!ok) break;
      for (size_t i = 0; i < e; i++) out[r][k][i] = val(r, k, i);
      if (k == R_AG16) {
        uint16_t *h = (uint16_t *)out[r][k];
        for (size_t i = 0; i < e; i++) h[i] = (uint16_t)mix64(((uint64_t)r << 32) ^ i);
      }
      ok = be->copy_h2d(ctxs[r], dev[r][k], out[r][k], e * sizeof(float)) == NMT_OK;
      jobs[r].buf[k] = dev[r][k];
    }
    ok = ok && nmt_comm_reserve(comms[r], (size_t)n * N) == NMT_OK;
  }
  int started = 0;
  for (; ok && started < n; started++)
    if (pthread_create(&t[started], NULL, rank_main, &jobs[started]) != 0) break;
  if (started < n) {
    ok = 0;
    nmt_comm_abort(comms[0]);
    for (int r = 0; r < started; r++) pthread_join(t[r], NULL);
  } else if (!join_all(t, n, comms[0])) {
    ok = 0;
  }
  for (int r = 0; ok && r < n; r++)
    if (jobs[r].st != NMT_OK) {
      printf("# rank %d: %s: %s\n", r, nmt_status_str(jobs[r].st), nmt_last_error());
      ok = 0;
    }
  for (int r = 0; ok && r < n; r++)
    for (int k = 0; ok && k < R_N; k++)
      ok = be->copy_d2h(ctxs[r], out[r][k], dev[r][k], elems(k, n) * sizeof(float)) == NMT_OK;
  for (int r = 0; r < n; r++)
    for (int k = 0; k < R_N; k++)
      if (dev[r][k]) be->free(ctxs[r], dev[r][k]);
  return ok;
}

NMT_TEST(cuda_multiworker_comm_staged_two_contexts) {
  const nmt_backend *be = nmt_tg_device_backend();
  int devices = 0;
  if (!be || be->device_count(&devices) != NMT_OK || devices < 1) NMT_SKIP("no CUDA device");
  for (int n = 2; n <= MAX_RANKS; n++) {
    void *ctxs[MAX_RANKS] = {0};
    nmt_comm *hc[MAX_RANKS], *sc[MAX_RANKS];
    float *want[MAX_RANKS][R_N] = {{0}}, *got[MAX_RANKS][R_N] = {{0}};
    NMT_ASSERT_OK(nmt_comm_create_host(n, NULL, hc));
    int ok = run_sequence(n, hc, 0, want);
    nmt_comm_destroy(hc, n);
    nmt_status s = NMT_OK;
    for (int r = 0; s == NMT_OK && r < n; r++) s = be->ctx_create(0, &ctxs[r]);
    if (s == NMT_OK) s = nmt_comm_create_staged(n, be, ctxs, NULL, sc);
    size_t all = 0;
    for (int k = 0; k < R_N; k++) all += ((elems(k, n) * sizeof(float) + 255) / 256) * 256;
    for (int r = 0; s == NMT_OK && r < n; r++) s = nmt_comm_reserve_staging(sc[r], all);
    if (s != NMT_OK) printf("# setup: %s: %s\n", nmt_status_str(s), nmt_last_error());
    ok = ok && s == NMT_OK && run_sequence_dev(n, be, ctxs, sc, got);
    if (s == NMT_OK) nmt_comm_destroy(sc, n); /* before the contexts, as the trainer does */
    for (int r = 0; r < n; r++)
      if (ctxs[r]) be->ctx_destroy(ctxs[r]);
    size_t total = 0, wrong = ok ? count_wrong(n, got, want, &total) : 0;
    free_out(n, want), free_out(n, got);
    printf("# %d contexts on device 0 (%s): %zu of %zu elements differ from the host "
           "communicator's\n", n, be->name, wrong, total);
    NMT_ASSERT(ok);
    NMT_ASSERT_EQ_INT(wrong, 0);
  }
}


/* A collective's copy down runs after the compute stream's earlier ops: an add into the buffer
 * held behind the gate, then the (one-rank) all-reduce, must stage the add's result, not the
 * poison that was there before; and the flush's join orders the copy back before the compute
 * stream's read. One rank: the host group returns its input, so the buffer ends as the add
 * wrote it exactly when the ordering holds. */
NMT_TG_TEST(cuda_multiworker_comm_d2h_after_compute) {
  const size_t n = (size_t)1 << 20;
  float *src = nmt_tg_randn(g, n, 161, 1.0f, 0.0f), *back = nmt_tg_halloc(g, n * 4);
  float *d_src = nmt_tg_dalloc(g, n * 4), *d_zero = nmt_tg_dalloc(g, n * 4),
        *d_buf = nmt_tg_dalloc(g, n * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_src, src, n * 4));
  NMT_ASSERT_OK(g->be->memset_zero(g->ctx, d_zero, n * 4));
  nmt_tg_poison(g, d_buf, n);
  NMT_TG_SETUP_OK();
  nmt_comm *sc[1];
  NMT_ASSERT_OK(nmt_comm_create_staged(1, g->be, &g->ctx, NULL, sc));
  nmt_status rs = nmt_comm_reserve_staging(sc[0], n * 4);
  if (rs != NMT_OK) nmt_comm_destroy(sc, 1);
  NMT_ASSERT_OK(rs);
  nmt_tg_gate gt;
  nmt_tg_first_err e = {NMT_OK, NULL, ""};
  if (!nmt_tg_gate_close(g, &gt, 20000)) {
    nmt_comm_destroy(sc, 1);
    return;
  }
  nmt_tg_keep(&e, g->be->add(g->ctx, d_buf, d_src, d_zero, n), "add");
  nmt_tg_keep(&e, nmt_comm_allreduce_sum(sc[0], d_buf, n), "allreduce_sum (enqueue)");
  const int returned_held = !atomic_load(&gt.open); /* the enqueue waited for nothing */
  nmt_tg_gate_open(&gt);
  nmt_tg_keep(&e, nmt_comm_flush(sc[0]), "flush");
  nmt_tg_keep(&e, g->be->copy_d2h(g->ctx, back, d_buf, n * 4), "copy_d2h");
  nmt_comm_destroy(sc, 1);
  NMT_TG_NO_ERR(e);
  if (NMT_TG_HAVE_GATE && !returned_held)
    nmt_test_fail(__FILE__, __LINE__, "a staged collective's enqueue waited for the compute "
                  "stream (it must return at once)");
  NMT_TG_EXACT("all-reduce over one rank after the add", back, src, n);
}
