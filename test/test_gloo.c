/* test_gloo.c — the rendezvous store (nmt/rendezvous.h) and the Gloo communicator
 * (nmt_comm_create_gloo), nccl-tests style: collectives count their wrong elements.
 *  - store: set/get, prefixes, write-once keys, timeouts and aborts naming the key, a value
 *    published by another process;
 *  - collectives: 2 processes x 2 threads (and a world of 3: 2 + 1, ranks interleaved across
 *    the processes) on loopback with the store in the test's temp dir. The parent computes
 *    every expected result with the HOST communicator on the same inputs (before it forks),
 *    the children run the Gloo group and count the elements that differ bitwise (NaN == NaN).
 *    Inputs make the result independent of the summation order (the two communicators add in
 *    different orders, nmt/comm.h): integers, integers plus a fraction the half wire rounds
 *    away, and values equal on every rank (where every order adds the same partial sums, so
 *    the per-addition rounding of the half wire shows); fp16 overflow; NaN in max;
 *    reduce-scatter slices checked where rank r's must land, all-gather slices everywhere;
 *  - world 1, bad arguments, a rank that never arrives (named), a stale key, and aborts: by
 *    nmt_comm_abort, by the run's abort flag, and a process killed mid-collective, each of
 *    which must end the waiting ranks with NMT_ERR_ABORTED long before their timeout;
 *  - SIGPIPE ignored by group creation (unless the program handles it).
 * A child reports through a file; the parent waits for it with a watchdog (no hang). */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"
#include "nmt/comm.h"
#include "nmt/half.h"
#include "nmt/ref.h"
#include "nmt/rendezvous.h"
#include "test.h"

#define MAX_WORLD 4
#define CHILD_WATCHDOG_S 20.0

static nmt_gloo_options opts(const char *dir, const char *prefix, double timeout_s) {
  return (nmt_gloo_options){.size = sizeof(nmt_gloo_options), .rendezvous = dir,
                            .prefix = prefix, .hostname = "127.0.0.1", .timeout_s = timeout_s};
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ---------------------------------------------------------------- rendezvous store ---- */

NMT_TEST(gloo_store_set_get) {
  const char *dir = nmt_test_tmpdir();
  char path[600];
  snprintf(path, sizeof path, "%s/rv/sub", dir); /* parents are created */
  nmt_rendezvous *a = NULL, *b = NULL, *other = NULL;
  NMT_ASSERT_OK(nmt_rendezvous_open(path, "run1", 0.3, &a));
  NMT_ASSERT_OK(nmt_rendezvous_open(path, "run1", 0.3, &b));
  NMT_ASSERT_OK(nmt_rendezvous_open(path, "run2", 0.3, &other));
  const char v[] = "config-hash 1234";
  NMT_ASSERT_OK(nmt_rendezvous_set(a, "node0/config", v, sizeof v));
  char buf[64];
  size_t len = 0;
  NMT_ASSERT_OK(nmt_rendezvous_get(b, "node0/config", buf, sizeof buf, &len));
  NMT_ASSERT_EQ_INT(len, sizeof v);
  NMT_ASSERT(memcmp(buf, v, sizeof v) == 0);
  /* Too small a buffer: the length comes back for a retry. */
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_get(b, "node0/config", buf, 4, &len), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_INT(len, sizeof v);
  /* Write-once, and the message says why it matters. */
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_set(b, "node0/config", v, sizeof v), NMT_ERR_CONFIG);
  NMT_ASSERT(strstr(nmt_last_error(), "'node0/config'") != NULL);
  NMT_ASSERT(strstr(nmt_last_error(), "already set") != NULL);
  /* Another prefix is another namespace: its wait times out, naming key, prefix and time. */
  double t0 = nmt_th_now();
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_get(other, "node0/config", buf, sizeof buf, &len),
                       NMT_ERR_ABORTED);
  double waited = nmt_th_now() - t0;
  NMT_ASSERT(strstr(nmt_last_error(), "key 'node0/config' not set within 0.3 s") != NULL);
  NMT_ASSERT(strstr(nmt_last_error(), "prefix 'run2'") != NULL);
  NMT_ASSERT(waited >= 0.29);
  /* A raised abort flag ends a wait that would otherwise last the whole timeout. */
  atomic_int flag = 1;
  nmt_rendezvous_watch(other, &flag);
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_get(other, "never", buf, sizeof buf, &len),
                       NMT_ERR_ABORTED);
  NMT_ASSERT(strstr(nmt_last_error(), "aborted while waiting for key 'never'") != NULL);
  /* Argument errors. */
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_set(a, "", v, 1), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_set(a, "empty", v, 0), NMT_ERR_INTERNAL);
  nmt_rendezvous_close(a);
  nmt_rendezvous_close(b);
  nmt_rendezvous_close(other);
}

NMT_TEST(gloo_store_open_errors) {
  nmt_rendezvous *rv = (nmt_rendezvous *)1;
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_open("", "p", 1, &rv), NMT_ERR_CONFIG);
  NMT_ASSERT(rv == NULL);
  NMT_ASSERT(strstr(nmt_last_error(), "parallel.rendezvous") != NULL);
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_open(nmt_test_tmpdir(), "p", 0, &rv), NMT_ERR_CONFIG);
  NMT_ASSERT(strstr(nmt_last_error(), "parallel.timeout_s") != NULL);
  char file[600];
  snprintf(file, sizeof file, "%s/plain-file", nmt_test_tmpdir());
  FILE *f = fopen(file, "w");
  NMT_ASSERT(f != NULL);
  fclose(f);
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_open(file, "p", 1, &rv), NMT_ERR_IO);
  NMT_ASSERT(strstr(nmt_last_error(), "not a directory") != NULL);
}

/* A value published by another process, after the reader started waiting. */
NMT_TEST(gloo_store_across_processes) {
  const char *dir = nmt_test_tmpdir();
  fflush(stdout);
  pid_t pid = fork();
  NMT_ASSERT(pid >= 0);
  if (pid == 0) {
    nmt_rendezvous *w = NULL;
    sleep_ms(200);
    int ok = nmt_rendezvous_open(dir, "x", 5, &w) == NMT_OK &&
             nmt_rendezvous_set(w, "nccl_id", "0123456789abcdef", 16) == NMT_OK;
    nmt_rendezvous_close(w);
    _exit(ok ? 0 : 1);
  }
  nmt_rendezvous *r = NULL;
  NMT_ASSERT_OK(nmt_rendezvous_open(dir, "x", 10, &r));
  char buf[32];
  size_t len = 0;
  nmt_status st = nmt_rendezvous_get(r, "nccl_id", buf, sizeof buf, &len);
  nmt_rendezvous_close(r);
  NMT_ASSERT_EQ_INT(nmt_th_wait(pid, CHILD_WATCHDOG_S, NULL), 0);
  NMT_ASSERT_OK(st);
  NMT_ASSERT_EQ_INT(len, 16);
  NMT_ASSERT(memcmp(buf, "0123456789abcdef", 16) == 0);
}

/* ------------------------------------------------------------------- the case table ---- */

typedef enum { OP_SUM, OP_SUM_AS, OP_MAX, OP_BCAST, OP_RS, OP_AG, OP_BARRIER } gop;
/* Input kinds: integers; integers plus a fraction the half wire rounds away; random values in
 * (-4, 4) (their sums depend on the order for 3 ranks or more: exact only in a world of 2,
 * within the rounding bound otherwise); 20000 everywhere (fp16 sums overflow); integers with
 * NaN on rank 1 every 97th element. */
typedef enum { D_INT, D_INT_FRAC, D_RAND, D_BIG, D_NAN } gdata;

typedef struct {
  gop op;
  size_t count; /* per rank; reduce-scatter and all-gather: per slice */
  nmt_grad_dtype wire;
  int root;
  gdata data;
} gcase;

static const gcase cases[] = {
    {OP_SUM, 0, NMT_GRAD_FP32, 0, D_INT},
    {OP_SUM, 1, NMT_GRAD_FP32, 0, D_INT},
    {OP_SUM, 7, NMT_GRAD_FP32, 0, D_INT},
    {OP_SUM, 1000, NMT_GRAD_FP32, 0, D_INT},
    {OP_SUM, 300000, NMT_GRAD_FP32, 0, D_INT}, /* 1.2 MB: several 1 MiB segments */
    {OP_SUM_AS, 1000, NMT_GRAD_FP16, 0, D_INT_FRAC},
    {OP_SUM_AS, 1000, NMT_GRAD_BF16, 0, D_INT_FRAC},
    {OP_SUM_AS, 5000, NMT_GRAD_FP16, 0, D_RAND},
    {OP_SUM_AS, 5000, NMT_GRAD_BF16, 0, D_RAND},
    {OP_SUM, 5000, NMT_GRAD_FP32, 0, D_RAND},
    {OP_SUM_AS, 10, NMT_GRAD_FP16, 0, D_BIG},
    {OP_MAX, 1000, NMT_GRAD_FP32, 0, D_NAN},
    {OP_BCAST, 1000, NMT_GRAD_FP32, 0, D_INT},
    {OP_BCAST, 333, NMT_GRAD_FP32, -1, D_INT}, /* root -1: the last rank */
    {OP_RS, 0, NMT_GRAD_FP32, 0, D_INT},
    {OP_RS, 1, NMT_GRAD_FP32, 0, D_INT},
    {OP_RS, 1001, NMT_GRAD_FP32, 0, D_INT},
    {OP_RS, 70000, NMT_GRAD_FP32, 0, D_INT},
    {OP_RS, 513, NMT_GRAD_FP16, 0, D_INT_FRAC},
    {OP_RS, 513, NMT_GRAD_BF16, 0, D_RAND},
    {OP_RS, 700, NMT_GRAD_FP32, 0, D_RAND},
    {OP_AG, 0, NMT_GRAD_FP32, 0, D_INT},
    {OP_AG, 1, NMT_GRAD_BF16, 0, D_INT},
    {OP_AG, 999, NMT_GRAD_FP32, 0, D_INT},
    {OP_AG, 4097, NMT_GRAD_FP16, 0, D_INT},
    {OP_BARRIER, 0, NMT_GRAD_FP32, 0, D_INT},
    {OP_SUM, 1000, NMT_GRAD_FP32, 0, D_INT}, /* after everything: still in step */
};
#define N_CASES (sizeof cases / sizeof cases[0])

static uint64_t mix64(uint64_t x) { /* splitmix64 finalizer */
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/* Elements of one rank's buffer for a case (reduce-scatter: the whole n x count buffer). */
static size_t elems(const gcase *c, int world) {
  return c->op == OP_RS || c->op == OP_AG ? c->count * (size_t)world : c->count;
}

static size_t elem_bytes(const gcase *c) {
  return c->op == OP_AG && c->wire != NMT_GRAD_FP32 ? 2 : 4;
}

static float input(const gcase *c, int ci, int r, size_t i) {
  int m = (int)((r * 131u + i * 31u + (unsigned)ci * 17u) % 61u) - 30;
  switch (c->data) {
  case D_INT: return (float)m;
  case D_INT_FRAC: { /* |a| in [1, 30], plus 0.0002: below half an fp16 ulp at 1 (2^-11) */
    int a = m % 30 + (m < 0 ? -1 : 1);
    return (float)a + 0.0002f;
  }
  case D_RAND:
    return (float)((double)(mix64((uint64_t)r << 40 ^ i * 7919u ^ (unsigned)ci) >> 40) * 0x1p-24 *
                       8.0 - 4.0);
  case D_BIG: return 20000.0f;
  case D_NAN: return r == 1 && i % 97 == 5 ? NAN : (float)m;
  }
  return 0;
}

/* All-gather: rank r contributes pattern(r, i) in slice r; other slices start as garbage. */
static void fill(const gcase *c, int ci, int r, int world, void *buf) {
  size_t n = elems(c, world);
  if (c->op == OP_AG) {
    for (size_t i = 0; i < n; i++) {
      int owner = (int)(i / c->count);
      uint32_t v = owner == r ? (uint32_t)(mix64((uint64_t)owner << 32 | i) & 0xffffff) : 0xdead;
      if (elem_bytes(c) == 2)
        ((uint16_t *)buf)[i] = (uint16_t)v;
      else
        ((float *)buf)[i] = (float)v;
    }
    return;
  }
  for (size_t i = 0; i < n; i++) ((float *)buf)[i] = input(c, ci, r, i);
}

static int root_of(const gcase *c, int world) { return c->root < 0 ? world - 1 : c->root; }

static nmt_status run_case(nmt_comm *comm, const gcase *c, void *buf) {
  int world = nmt_comm_size(comm);
  switch (c->op) {
  case OP_SUM: return nmt_comm_allreduce_sum(comm, buf, c->count);
  case OP_SUM_AS: return nmt_comm_allreduce_sum_as(comm, buf, c->count, c->wire);
  case OP_MAX: return nmt_comm_allreduce_max(comm, buf, c->count);
  case OP_BCAST: return nmt_comm_broadcast(comm, buf, c->count, root_of(c, world));
  case OP_RS: return nmt_comm_reduce_scatter_sum_as(comm, buf, c->count, c->wire);
  case OP_AG: return nmt_comm_all_gather(comm, buf, c->count, c->wire);
  case OP_BARRIER: return nmt_comm_barrier(comm);
  }
  return NMT_ERR_INTERNAL;
}

/* Elements of rank r's result that differ bitwise from the expectation (NaN matches NaN).
 * Reduce-scatter: only slice r is specified. Random inputs in a world of 3 or more are summed
 * in another order than the host's (nmt/comm.h): there, wrong means off by more than both
 * results' rounding bound, 2 n u sum|x| (u: the unit roundoff of the wire type). */
static size_t count_wrong(const gcase *c, int ci, int r, int world, const void *got,
                          const void *want) {
  size_t lo = 0, hi = elems(c, world), wrong = 0;
  if (c->op == OP_BARRIER) return 0;
  if (c->op == OP_RS) lo = (size_t)r * c->count, hi = lo + c->count;
  if (elem_bytes(c) == 2) {
    for (size_t i = lo; i < hi; i++)
      wrong += ((const uint16_t *)got)[i] != ((const uint16_t *)want)[i];
    return wrong;
  }
  const float *g = got, *w = want;
  if (c->data == D_RAND && world > 2) {
    double u = c->wire == NMT_GRAD_FP16 ? 0x1p-11 : c->wire == NMT_GRAD_BF16 ? 0x1p-8 : 0x1p-24;
    for (size_t i = lo; i < hi; i++) {
      double mag = 0;
      for (int q = 0; q < world; q++) mag += fabs(input(c, ci, q, i));
      wrong += !(fabs((double)g[i] - (double)w[i]) <= 2.0 * world * u * mag);
    }
    return wrong;
  }
  for (size_t i = lo; i < hi; i++)
    wrong += !(isnan(g[i]) && isnan(w[i])) && memcmp(&g[i], &w[i], sizeof(float)) != 0;
  return wrong;
}

/* ---------------------------------------------- expected results: the host communicator ---- */

typedef struct {
  nmt_comm *c;
  const gcase *k;
  void *buf;
  nmt_status st;
} host_job;

static void *host_rank(void *p) {
  host_job *j = p;
  const gcase *k = j->k;
  int world = nmt_comm_size(j->c);
  j->st = nmt_comm_reserve(j->c, elems(k, world));
  if (j->st != NMT_OK) return NULL;
  if (k->op == OP_RS) /* the host contract: rank r's slice is allreduce_sum_as's slice r */
    j->st = nmt_comm_allreduce_sum_as(j->c, j->buf, elems(k, world), k->wire);
  else if (k->op != OP_AG) /* all-gather's expectation is the filled pattern itself */
    j->st = run_case(j->c, k, j->buf);
  return NULL;
}

/* want[ci][r]: rank r's expected buffer for case ci, computed on `world` host ranks. */
static int host_expect(int world, void *want[N_CASES][MAX_WORLD]) {
  for (size_t ci = 0; ci < N_CASES; ci++) {
    const gcase *k = &cases[ci];
    nmt_comm *comms[MAX_WORLD];
    if (nmt_comm_create_host(world, NULL, comms) != NMT_OK) return 0;
    host_job jobs[MAX_WORLD];
    pthread_t t[MAX_WORLD];
    for (int r = 0; r < world; r++) {
      want[ci][r] = malloc(elems(k, world) * elem_bytes(k) + 4);
      if (!want[ci][r]) return 0;
      fill(k, (int)ci, r, world, want[ci][r]);
      jobs[r] = (host_job){.c = comms[r], .k = k, .buf = want[ci][r], .st = NMT_OK};
    }
    for (int r = 0; r < world; r++) pthread_create(&t[r], NULL, host_rank, &jobs[r]);
    for (int r = 0; r < world; r++) pthread_join(t[r], NULL);
    nmt_comm_destroy(comms, world);
    for (int r = 0; r < world; r++)
      if (jobs[r].st != NMT_OK) return 0;
    if (k->op == OP_AG) { /* slice o everywhere = what rank o contributed */
      size_t sb = k->count * elem_bytes(k);
      void *own[MAX_WORLD];
      for (int o = 0; o < world; o++) {
        own[o] = malloc(elems(k, world) * elem_bytes(k) + 4);
        if (!own[o]) return 0;
        fill(k, (int)ci, o, world, own[o]);
      }
      for (int r = 0; r < world; r++)
        for (int o = 0; o < world; o++)
          memcpy((char *)want[ci][r] + (size_t)o * sb, (char *)own[o] + (size_t)o * sb, sb);
      for (int o = 0; o < world; o++) free(own[o]);
    }
  }
  return 1;
}

static void free_expect(int world, void *want[N_CASES][MAX_WORLD]) {
  for (size_t ci = 0; ci < N_CASES; ci++)
    for (int r = 0; r < world; r++) free(want[ci][r]);
}

/* --------------------------------------------------------- one process of a Gloo world ---- */

static const char *op_name[] = {"allreduce_sum", "allreduce_sum_as", "allreduce_max", "broadcast",
                                "reduce_scatter_sum_as", "all_gather", "barrier"};

typedef struct {
  int world;
  int n_procs;
  int n_local[2];
  int ranks[2][MAX_WORLD]; /* global ranks of each process's threads */
} world_cfg;

/* What a process reports to the test: per local rank and case, the status and #wrong. */
typedef struct {
  int created; /* nmt_comm_create_gloo's status */
  int st[MAX_WORLD][N_CASES];
  long wrong[MAX_WORLD][N_CASES];
  char msg[512]; /* the first error */
} proc_report;

typedef struct {
  nmt_comm *c;
  void *(*want)[MAX_WORLD];
  int *st;
  long *wrong;
  char msg[700];
} rank_job;

/* One rank: every case in order, checked against the host's result. */
static void *rank_main(void *p) {
  rank_job *j = p;
  int r = nmt_comm_rank(j->c), world = nmt_comm_size(j->c);
  size_t most = 0, most_elems = 0;
  for (size_t ci = 0; ci < N_CASES; ci++) {
    size_t e = elems(&cases[ci], world);
    if (e * elem_bytes(&cases[ci]) > most) most = e * elem_bytes(&cases[ci]);
    if (e > most_elems) most_elems = e;
  }
  void *buf = malloc(most + 4);
  nmt_status st = buf ? nmt_comm_reserve(j->c, most_elems) : NMT_ERR_NOMEM;
  for (size_t ci = 0; ci < N_CASES; ci++) {
    const gcase *k = &cases[ci];
    if (st == NMT_OK) {
      fill(k, (int)ci, r, world, buf);
      st = run_case(j->c, k, buf);
    }
    j->st[ci] = st;
    j->wrong[ci] = st == NMT_OK ? (long)count_wrong(k, (int)ci, r, world, buf, j->want[ci][r]) : -1;
    if (st != NMT_OK && !j->msg[0]) snprintf(j->msg, sizeof j->msg, "%s", nmt_last_error());
  }
  free(buf);
  return NULL;
}

/* Runs this process's ranks of the world through every case into *rep. */
static void run_proc(const world_cfg *w, int p, const char *dir, void *(*want)[MAX_WORLD],
                     proc_report *rep) {
  nmt_gloo_options o = opts(dir, "coll", 10);
  nmt_comm *comms[MAX_WORLD];
  int n = w->n_local[p];
  rep->created = nmt_comm_create_gloo(&o, n, w->ranks[p], w->world, NULL, comms);
  if (rep->created != NMT_OK) {
    snprintf(rep->msg, sizeof rep->msg, "%s", nmt_last_error());
    return;
  }
  rank_job jobs[MAX_WORLD];
  pthread_t t[MAX_WORLD];
  for (int i = 0; i < n; i++) {
    jobs[i] = (rank_job){.c = comms[i], .want = want, .st = rep->st[i], .wrong = rep->wrong[i]};
    pthread_create(&t[i], NULL, rank_main, &jobs[i]);
  }
  for (int i = 0; i < n; i++) {
    pthread_join(t[i], NULL);
    if (jobs[i].msg[0] && !rep->msg[0]) snprintf(rep->msg, sizeof rep->msg, "%s", jobs[i].msg);
  }
  nmt_comm_destroy(comms, n);
}

static int write_all(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  int ok = f && fwrite(p, 1, n, f) == n;
  if (f) ok = fclose(f) == 0 && ok;
  return ok;
}

/* The checks of one process's report; returns 0 after recording a failure. */
static int check_report(const world_cfg *w, int p, const proc_report *rep) {
  if (rep->created != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "process %d: create_gloo: %s: %s", p,
                  nmt_status_str(rep->created), rep->msg);
    return 0;
  }
  for (int i = 0; i < w->n_local[p]; i++)
    for (size_t ci = 0; ci < N_CASES; ci++) {
      const gcase *k = &cases[ci];
      if (rep->st[i][ci] != NMT_OK || rep->wrong[i][ci] != 0) {
        nmt_test_fail(__FILE__, __LINE__, "world %d, case %zu (%s count %zu %s): rank %d: %s, "
                      "#wrong %ld (%s)", w->world, ci, op_name[k->op], k->count,
                      nmt_comm_wire_name(k->wire), w->ranks[p][i],
                      nmt_status_str(rep->st[i][ci]), rep->wrong[i][ci], rep->msg);
        return 0;
      }
    }
  return 1;
}

/* Forks one process per entry of w, each running its ranks through every case, and checks
 * their reports against the host communicator's results. */
static void run_world(const world_cfg *w, const char *tag) {
  static void *want[N_CASES][MAX_WORLD];
  memset(want, 0, sizeof want);
  if (!host_expect(w->world, want)) {
    free_expect(w->world, want);
    nmt_test_fail(__FILE__, __LINE__, "host communicator expectations failed: %s",
                  nmt_last_error());
    return;
  }
  char dir[600], path[2][700];
  snprintf(dir, sizeof dir, "%s/%s", nmt_test_tmpdir(), tag);
  pid_t pid[2];
  fflush(stdout);
  fflush(stderr);
  for (int p = 0; p < w->n_procs; p++) {
    snprintf(path[p], sizeof path[p], "%s/%s-report-%d", nmt_test_tmpdir(), tag, p);
    pid[p] = fork();
    if (pid[p] == 0) {
      static proc_report rep;
      run_proc(w, p, dir, want, &rep);
      _exit(write_all(path[p], &rep, sizeof rep) ? 0 : 1);
    }
  }
  int ok = 1;
  for (int p = 0; p < w->n_procs; p++) {
    int rc = pid[p] > 0 ? nmt_th_wait(pid[p], CHILD_WATCHDOG_S, NULL) : -1;
    if (rc != 0 && ok) {
      nmt_test_fail(__FILE__, __LINE__, "process %d ended with %d (-1: still running after %g s, "
                    "killed)", p, rc, CHILD_WATCHDOG_S);
      ok = 0;
    }
  }
  for (int p = 0; p < w->n_procs && ok; p++) {
    size_t len = 0;
    char *rep = nmt_th_read_file(path[p], &len);
    if (!rep || len != sizeof(proc_report)) {
      nmt_test_fail(__FILE__, __LINE__, "process %d wrote no report", p);
      ok = 0;
    } else {
      ok = check_report(w, p, (const proc_report *)rep);
    }
    free(rep);
  }
  free_expect(w->world, want);
}

NMT_TEST(gloo_collectives_2x2) {
  world_cfg w = {.world = 4, .n_procs = 2, .n_local = {2, 2}, .ranks = {{0, 1}, {2, 3}}};
  run_world(&w, "2x2");
}

/* One rank per process: order is immaterial for 2 ranks, so random inputs must match the host
 * bitwise, the half wire's rounding of inputs and of the sum included. */
NMT_TEST(gloo_collectives_1x1) {
  world_cfg w = {.world = 2, .n_procs = 2, .n_local = {1, 1}, .ranks = {{1}, {0}}};
  run_world(&w, "1x1");
}

/* A world that is not a power of two (broadcast's binomial tree with a missing leaf, an odd
 * ring), ranks interleaved across the processes, processes of different sizes. */
NMT_TEST(gloo_collectives_world3) {
  world_cfg w = {.world = 3, .n_procs = 2, .n_local = {2, 1}, .ranks = {{0, 2}, {1}}};
  run_world(&w, "w3");
}

/* The data must be able to tell a wrong implementation from a right one: with the half wire,
 * summing the fp32 inputs and rounding once (no rounding of the inputs) or not rounding the sum
 * (fp32 accumulation) gives other bits than the contract's w(w(a) + w(b)) for many of the
 * random pairs (what a world of 2 checks bitwise), and the fraction inputs' plain fp32 sums
 * are not the integers the half wire gives. */
NMT_TEST(gloo_cases_can_fail) {
  size_t once = 0, unrounded = 0, fractional = 0;
  for (size_t i = 0; i < 5000; i++) {
    float a = input(&cases[7], 7, 0, i), b = input(&cases[7], 7, 1, i);
    float want = nmt_half_round_fp16(nmt_half_round_fp16(a) + nmt_half_round_fp16(b));
    once += want != nmt_half_round_fp16(a + b);
    unrounded += want != nmt_half_round_fp16(a) + nmt_half_round_fp16(b);
  }
  for (size_t i = 0; i < 1000; i++) {
    float s = 0;
    for (int r = 0; r < 4; r++) s += input(&cases[5], 5, r, i);
    fractional += s != floorf(s);
  }
  printf("# of 5000 fp16 pairs, %zu differ when rounded once, %zu when not rounded; %zu of 1000 "
         "fp32 sums of the fraction inputs are not integers\n", once, unrounded, fractional);
  NMT_ASSERT(cases[7].data == D_RAND && cases[7].wire == NMT_GRAD_FP16);
  NMT_ASSERT(cases[5].data == D_INT_FRAC);
  NMT_ASSERT(once > 100);
  NMT_ASSERT(unrounded > 100);
  NMT_ASSERT_EQ_INT(fractional, 1000);
}

/* World 1: every collective is local, the half wire still rounds. */
NMT_TEST(gloo_world_of_one) {
  static void *want[N_CASES][MAX_WORLD];
  memset(want, 0, sizeof want);
  world_cfg w = {.world = 1, .n_procs = 1, .n_local = {1}, .ranks = {{0}}};
  static proc_report rep;
  memset(&rep, 0, sizeof rep);
  int ok = host_expect(1, want);
  if (ok) {
    run_proc(&w, 0, nmt_test_tmpdir(), want, &rep);
    ok = check_report(&w, 0, &rep);
  } else {
    nmt_test_fail(__FILE__, __LINE__, "host expectations: %s", nmt_last_error());
  }
  free_expect(1, want);
}

/* ---------------------------------------------------------------- creation errors ---- */

NMT_TEST(gloo_create_errors) {
  const char *dir = nmt_test_tmpdir();
  nmt_comm *comms[4];
  int twice[2] = {0, 0}, out[2] = {0, 5}, one = 0;
  nmt_gloo_options o = opts(dir, "e", 1);
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_gloo(NULL, 1, &one, 1, NULL, comms), NMT_ERR_INTERNAL);
  nmt_gloo_options small = o;
  small.size = 8;
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_gloo(&small, 1, &one, 1, NULL, comms), NMT_ERR_INTERNAL);
  nmt_gloo_options empty = o;
  empty.rendezvous = "";
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_gloo(&empty, 1, &one, 1, NULL, comms), NMT_ERR_CONFIG);
  nmt_gloo_options zero = o;
  zero.timeout_s = 0;
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_gloo(&zero, 1, &one, 1, NULL, comms), NMT_ERR_CONFIG);
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_gloo(&o, 2, twice, 2, NULL, comms), NMT_ERR_INTERNAL);
  NMT_ASSERT(strstr(nmt_last_error(), "given twice") != NULL);
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_gloo(&o, 2, out, 2, NULL, comms), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_gloo(&o, 3, twice, 2, NULL, comms), NMT_ERR_INTERNAL);
  nmt_gloo_options bad_if = o;
  bad_if.iface = "nmt-no-such0";
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_gloo(&bad_if, 1, &one, 1, NULL, comms), NMT_ERR_CONFIG);
  NMT_ASSERT(strstr(nmt_last_error(), "interface 'nmt-no-such0'") != NULL);
  NMT_ASSERT(strstr(nmt_last_error(), " lo") != NULL); /* the ones there are */
}

/* Rank 0 of 3 alone: the error names both missing ranks and the timeout. */
NMT_TEST(gloo_missing_rank_named) {
  nmt_gloo_options o = opts(nmt_test_tmpdir(), "m", 0.5);
  nmt_comm *comms[1];
  int r0 = 0;
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_gloo(&o, 1, &r0, 3, NULL, comms), NMT_ERR_ABORTED);
  NMT_ASSERT(strstr(nmt_last_error(), "rank(s) 1, 2 of 3 did not arrive within 0.5 s") != NULL);
}

/* Keys are write-once: a second group under the same prefix is refused, not confused with the
 * first one's addresses. */
NMT_TEST(gloo_stale_prefix_refused) {
  nmt_gloo_options o = opts(nmt_test_tmpdir(), "same", 2);
  nmt_comm *comms[1];
  int r0 = 0;
  NMT_ASSERT_OK(nmt_comm_create_gloo(&o, 1, &r0, 1, NULL, comms));
  nmt_comm_destroy(comms, 1);
  NMT_ASSERT_EQ_STATUS(nmt_comm_create_gloo(&o, 1, &r0, 1, NULL, comms), NMT_ERR_CONFIG);
  NMT_ASSERT(strstr(nmt_last_error(), "already set") != NULL);
}

/* ----------------------------------------------------------------------- aborts ---- */

typedef struct {
  nmt_comm *c;
  int reduce_scatter; /* 0: allreduce_sum of 1000 floats; 1: reduce_scatter_sum_as, fp16 */
  nmt_status st;
  double elapsed_s;
  char msg[300]; /* the rank thread's error message */
} wait_job;

static void *allreduce_and_time(void *p) {
  wait_job *j = p;
  static float bufs[2][1000];
  float *buf = bufs[nmt_comm_rank(j->c) & 1];
  double t0 = nmt_th_now();
  if (j->reduce_scatter) {
    j->st = nmt_comm_reserve(j->c, 1000);
    if (j->st == NMT_OK)
      j->st = nmt_comm_reduce_scatter_sum_as(j->c, buf, 1000 / (size_t)nmt_comm_size(j->c),
                                             NMT_GRAD_FP16);
  } else {
    j->st = nmt_comm_allreduce_sum(j->c, buf, 1000);
  }
  j->elapsed_s = nmt_th_now() - t0;
  snprintf(j->msg, sizeof j->msg, "%s", j->st == NMT_OK ? "" : nmt_last_error());
  return NULL;
}

/* Rank 0 waits in a collective that rank 1 never enters, with a 60 s timeout: only the abort
 * (nmt_comm_abort, or the run's flag through the watcher) can end it within the watchdog.
 * Modes: all-reduce and nmt_comm_abort, all-reduce and the flag, reduce-scatter (the ring
 * written here) and nmt_comm_abort. */
NMT_TEST(gloo_abort_wakes_waiting_rank) {
  static const char *what[] = {"nmt_comm_abort", "abort flag", "nmt_comm_abort, reduce-scatter"};
  for (int mode = 0; mode < 3; mode++) {
    char prefix[32];
    snprintf(prefix, sizeof prefix, "abort%d", mode);
    nmt_gloo_options o = opts(nmt_test_tmpdir(), prefix, 60);
    nmt_comm *comms[2];
    int ranks[2] = {0, 1};
    atomic_int flag = 0;
    NMT_ASSERT_OK(nmt_comm_create_gloo(&o, 2, ranks, 2, &flag, comms));
    wait_job j = {.c = comms[0], .reduce_scatter = mode == 2};
    pthread_t t;
    NMT_ASSERT(pthread_create(&t, NULL, allreduce_and_time, &j) == 0);
    sleep_ms(200);
    if (mode == 1)
      atomic_store(&flag, 1);
    else
      nmt_comm_abort(comms[1]);
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 10;
    if (pthread_timedjoin_np(t, NULL, &dl) != 0) {
      pthread_detach(t); /* stuck in Gloo: leak the group rather than free it under the thread */
      nmt_test_fail(__FILE__, __LINE__, "mode %d: the waiting rank did not return within 10 s "
                    "of the abort", mode);
      return;
    }
    NMT_ASSERT_EQ_STATUS(j.st, NMT_ERR_ABORTED);
    NMT_ASSERT(strstr(j.msg, mode == 2 ? "gloo reduce_scatter_sum_as on rank 0 of 2: aborted"
                                       : "gloo allreduce_sum on rank 0 of 2: aborted") != NULL);
    NMT_ASSERT_EQ_INT(atomic_load(&flag), 1);
    float x = 1;
    NMT_ASSERT_EQ_STATUS(nmt_comm_allreduce_sum(comms[1], &x, 1), NMT_ERR_ABORTED);
    NMT_ASSERT_EQ_STATUS(nmt_comm_flush(comms[0]), NMT_ERR_ABORTED);
    printf("# mode %d (%s): the waiting rank returned %.3f s after entering\n", mode,
           what[mode], j.elapsed_s);
    nmt_comm_destroy(comms, 2);
  }
}

/* Two processes x two threads; process B is killed with SIGKILL while its rank 2 waits in an
 * all-reduce that its rank 3 never enters and A's ranks wait on both. A's ranks must return
 * NMT_ERR_ABORTED, within the timeout (the closed sockets end the wait, not the timeout). */
typedef struct {
  int st[2];
  double elapsed_s[2];
  char msg[700];
} killed_report;

static void killed_child(int p, const char *dir, int ready_fd, const char *report) {
  nmt_gloo_options o = opts(dir, "kill", 10);
  int ranks[2] = {2 * p, 2 * p + 1};
  nmt_comm *comms[2];
  static killed_report rep;
  if (nmt_comm_create_gloo(&o, 2, ranks, 4, NULL, comms) != NMT_OK) {
    snprintf(rep.msg, sizeof rep.msg, "create: %s", nmt_last_error());
    _exit(write_all(report, &rep, sizeof rep) ? 2 : 1);
  }
  wait_job j[2] = {{.c = comms[0]}, {.c = comms[1]}};
  pthread_t t[2];
  for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, allreduce_and_time, &j[i]);
  for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
  if (j[0].st != NMT_OK || j[1].st != NMT_OK) _exit(3); /* the first all-reduce must work */
  if (p == 1) { /* B: rank 3 signals and stays out, rank 2 waits in the next all-reduce */
    if (write(ready_fd, "r", 1) != 1) _exit(4);
    allreduce_and_time(&j[0]);
    _exit(5); /* not reached: killed while waiting */
  }
  for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, allreduce_and_time, &j[i]);
  for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < 2; i++) {
    rep.st[i] = j[i].st;
    rep.elapsed_s[i] = j[i].elapsed_s;
  }
  snprintf(rep.msg, sizeof rep.msg, "rank 0: %s | rank 1: %s", j[0].msg, j[1].msg);
  nmt_comm_destroy(comms, 2);
  _exit(write_all(report, &rep, sizeof rep) ? 0 : 1);
}

NMT_TEST(gloo_peer_killed_mid_collective) {
  const char *dir = nmt_test_tmpdir();
  char report[700];
  snprintf(report, sizeof report, "%s/killed-report", dir);
  int fds[2];
  NMT_ASSERT(pipe(fds) == 0);
  fflush(stdout);
  fflush(stderr);
  pid_t pid[2];
  for (int p = 0; p < 2; p++) {
    pid[p] = fork();
    if (pid[p] == 0) {
      close(fds[0]);
      killed_child(p, dir, fds[1], report);
    }
  }
  close(fds[1]);
  char c = 0;
  ssize_t got = read(fds[0], &c, 1); /* B's rank 3 is out; EOF if B died early */
  close(fds[0]);
  sleep_ms(300); /* rank 2 and A's ranks are inside the all-reduce */
  kill(pid[1], SIGKILL);
  int rc_b = nmt_th_wait(pid[1], CHILD_WATCHDOG_S, NULL);
  int rc_a = nmt_th_wait(pid[0], CHILD_WATCHDOG_S, NULL);
  NMT_ASSERT_EQ_INT(got, 1);
  NMT_ASSERT_EQ_INT(rc_b, 128 + SIGKILL);
  NMT_ASSERT_EQ_INT(rc_a, 0);
  size_t len = 0;
  killed_report *rep = (killed_report *)nmt_th_read_file(report, &len);
  NMT_ASSERT(rep != NULL);
  int ok = len == sizeof *rep;
  for (int i = 0; ok && i < 2; i++) {
    if (rep->st[i] != NMT_ERR_ABORTED || !(rep->elapsed_s[i] < 10.0)) {
      nmt_test_fail(__FILE__, __LINE__, "rank %d: %s after %.3f s (want NMT_ERR_ABORTED before "
                    "the 10 s timeout): %s", i, nmt_status_str(rep->st[i]), rep->elapsed_s[i],
                    rep->msg);
      ok = 0;
    }
  }
  if (ok && !strstr(rep->msg, "gloo allreduce_sum on rank ")) {
    nmt_test_fail(__FILE__, __LINE__, "message does not name the collective and rank: %s",
                  rep->msg);
    ok = 0;
  }
  if (ok)
    printf("# A's ranks returned NMT_ERR_ABORTED %.3f s and %.3f s after entering: %s\n",
           rep->elapsed_s[0], rep->elapsed_s[1], rep->msg);
  free(rep);
}

/* Gloo writes to sockets with writev: a peer gone between two writes would raise SIGPIPE and
 * kill the process instead of failing the collective. Creating a group ignores SIGPIPE when it
 * is at its default, and leaves a handler the program installed alone. In a child, so the
 * runner's own disposition does not matter. */
static void on_pipe(int sig) { (void)sig; }

NMT_TEST(gloo_sigpipe_ignored) {
  const char *dir = nmt_test_tmpdir();
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  NMT_ASSERT(pid >= 0);
  if (pid == 0) {
    int code = 0;
    for (int handler = 0; handler < 2; handler++) {
      signal(SIGPIPE, handler ? on_pipe : SIG_DFL);
      char prefix[32];
      snprintf(prefix, sizeof prefix, "pipe%d", handler);
      nmt_gloo_options o = opts(dir, prefix, 5);
      nmt_comm *c;
      int r0 = 0;
      if (nmt_comm_create_gloo(&o, 1, &r0, 1, NULL, &c) != NMT_OK) _exit(10 + handler);
      nmt_comm_destroy(&c, 1);
      struct sigaction sa;
      sigaction(SIGPIPE, NULL, &sa);
      if (sa.sa_handler != (handler ? on_pipe : SIG_IGN)) code |= 1 << handler;
    }
    _exit(code);
  }
  NMT_ASSERT_EQ_INT(nmt_th_wait(pid, CHILD_WATCHDOG_S, NULL), 0);
}
