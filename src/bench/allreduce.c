/* allreduce.c — `nmt bench allreduce`: nccl-tests' all_reduce_perf on nmt's communicator
 * (include/nmt/bench.h), and with --op its reduce_scatter_perf and all_gather_perf (ZeRO's
 * collectives).
 *
 * Ranks are threads, as in the trainer. Each size is run the way all_reduce_perf runs it
 * (nccl-tests src/common.cu): warmup iterations, then `iters` collectives issued back to back
 * and timed as a whole (time = elapsed / iters), then a separate, freshly initialised
 * collective that is checked. The buffers are reduced in place (our only mode), so the timed
 * iterations keep reducing the previous result: the values grow by at most a factor n per
 * iteration, which for n <= 16 ranks and the default 25 iterations stays finite, and fp32
 * addition costs the same whatever the values. The check always starts from a fresh fill.
 *
 * With a half wire type (parallel.grad_dtype = fp16 | bf16, nmt_comm_allreduce_sum_as) a size
 * is the bytes on the wire (2 per element) while the buffers stay fp32, as in the trainer. In
 * fp16 the timed values reach inf (then NaN) within a few iterations: GPU half arithmetic costs
 * the same for them, but the host's rounding takes a short path for inf and NaN, so host fp16
 * times are slightly optimistic past the first iterations.
 *
 * Buffers come from a backend table (host memory for the host communicator) and are filled and
 * checked through a small host staging buffer with copy_h2d/copy_d2h, so device buffers (an
 * NCCL communicator) need no change here.
 *
 * Reduce-scatter and all-gather follow nccl-tests' conventions: a size is the whole buffer of
 * n x count elements (count per rank), the buffer is in place (rank r's slice r is its
 * input, for the gather, or its output, for the reduce-scatter). The reduce-scatter fills
 * every slice with the all-reduce's pattern and checks each rank's own slice; the all-gather
 * fills the rank's own slice with its pattern (fp32 values, or 16-bit patterns for a half
 * parallel.grad_dtype) and every other slice with a poison, then checks every slice.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nmt/bench.h"
#include "nmt/device.h"
#include "nmt/json.h"

/* Fill/check in chunks of 1 Mi floats (4 MiB): big enough for full-speed copies, small
 * enough not to double the memory a 512 MiB size needs. */
#define STAGE_FLOATS ((size_t)1 << 20)
/* Above this size the iteration counts shrink in proportion (keeps the sweep's time linear). */
#define BIG_BYTES ((size_t)16 << 20)
#define MAX_SIZES 64

double nmt__bench_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Runs `cmd` and keeps the first line of its output (NUL-terminated, newline dropped). */
static int first_line(const char *cmd, char *out, size_t cap) {
  FILE *p = popen(cmd, "r");
  if (!p) return 0;
  out[0] = 0;
  int ok = fgets(out, (int)cap, p) != NULL;
  char rest[256];
  while (fgets(rest, sizeof rest, p)) {
  }
  pclose(p);
  out[strcspn(out, "\n")] = 0;
  return ok && out[0];
}

/* As bench/cpu-throughput.sh: "-dirty" when code or configs have uncommitted changes. */
void nmt__bench_commit(char *out, size_t cap) {
  char c[64], d[256];
  if (!first_line("git rev-parse --short HEAD 2>/dev/null", c, sizeof c)) {
    snprintf(out, cap, "unknown");
    return;
  }
  int dirty = first_line("git status --porcelain -- src include cuda bench conf Makefile "
                         "2>/dev/null", d, sizeof d);
  snprintf(out, cap, "%s%s", c, dirty ? "-dirty" : "");
}

void nmt__bench_cpu_name(char *out, size_t cap) {
  snprintf(out, cap, "unknown");
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "model name", 10)) continue;
    const char *v = strchr(line, ':');
    if (!v) break;
    v++;
    while (*v == ' ' || *v == '\t') v++;
    snprintf(out, cap, "%.*s", (int)strcspn(v, "\n"), v);
    break;
  }
  fclose(f);
}


double nmt_bench_busbw_factor(int n_ranks) {
  if (n_ranks < 1) return 0;
  return 2.0 * (double)(n_ranks - 1) / (double)n_ranks;
}

double nmt_bench_busbw(double algbw, int n_ranks) { return algbw * nmt_bench_busbw_factor(n_ranks); }

const char *nmt_bench_op_name(nmt_bench_op op) {
  switch (op) {
  case NMT_BENCH_ALLREDUCE: return "all_reduce";
  case NMT_BENCH_REDUCE_SCATTER: return "reduce_scatter";
  case NMT_BENCH_ALL_GATHER: return "all_gather";
  case NMT_BENCH_ALL_OPS: return "all";
  }
  return "?";
}

nmt_status nmt_bench_op_parse(const char *text, nmt_bench_op *out) {
  static const struct {
    const char *name;
    nmt_bench_op op;
  } names[] = {{"allreduce", NMT_BENCH_ALLREDUCE},      {"all_reduce", NMT_BENCH_ALLREDUCE},
               {"reduce_scatter", NMT_BENCH_REDUCE_SCATTER}, {"all_gather", NMT_BENCH_ALL_GATHER},
               {"all", NMT_BENCH_ALL_OPS}};
  for (size_t i = 0; text && i < sizeof names / sizeof names[0]; i++)
    if (!strcmp(text, names[i].name)) {
      *out = names[i].op;
      return NMT_OK;
    }
  return nmt_errorf(NMT_ERR_USAGE, "bench allreduce: --op '%s' (expected allreduce, "
                    "reduce_scatter, all_gather or all)", text ? text : "");
}

double nmt_bench_op_busbw_factor(nmt_bench_op op, int n_ranks) {
  if (n_ranks < 2) return 0;
  if (op == NMT_BENCH_ALLREDUCE) return nmt_bench_busbw_factor(n_ranks);
  if (op == NMT_BENCH_REDUCE_SCATTER || op == NMT_BENCH_ALL_GATHER)
    return (double)(n_ranks - 1) / (double)n_ranks;
  return 0;
}

float nmt_bench_allreduce_value(int rank, size_t i) {
  /* splitmix64's finaliser: every bit of (i, rank) moves the result. */
  uint64_t z = (uint64_t)i * 0x9E3779B97F4A7C15ull + (uint64_t)(uint32_t)rank * 0xD1B54A32D192ED03ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (float)((int)(z & 63) - 31);
}

void nmt_bench_allreduce_fill(float *buf, size_t count, size_t offset, int rank) {
  for (size_t k = 0; k < count; k++) buf[k] = nmt_bench_allreduce_value(rank, offset + k);
}

size_t nmt_bench_allreduce_check(const float *buf, size_t count, size_t offset, int n_ranks) {
  size_t wrong = 0;
  for (size_t k = 0; k < count; k++) {
    /* An integer sum, independent of the order the communicator added in. */
    long long want = 0;
    for (int r = 0; r < n_ranks; r++) want += (long long)nmt_bench_allreduce_value(r, offset + k);
    if (buf[k] != (float)want) wrong++;
  }
  return wrong;
}

void nmt_bench_allreduce_opts_default(nmt_bench_allreduce_opts *o) {
  memset(o, 0, sizeof *o);
  o->size = sizeof *o;
  o->min_bytes = 1024;
  o->max_bytes = (size_t)512 << 20;
  o->warmup = 5;
  o->iters = 20;
  o->mem_fraction = 0.5;
  o->wire = NMT_GRAD_FP32;
  o->op = NMT_BENCH_ALLREDUCE;
}

nmt_status nmt_bench_parse_bytes(const char *text, size_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = text && *text >= '0' && *text <= '9' ? strtoull(text, &end, 10) : 0;
  if (!text || *text < '0' || *text > '9' || errno)
    return nmt_errorf(NMT_ERR_USAGE, "bad byte count '%s' (expected e.g. 4096, 64K, 512M, 1G)",
                      text ? text : "");
  unsigned long long mul = 1;
  switch (*end) {
    case 'k': case 'K': mul = 1ull << 10, end++; break;
    case 'm': case 'M': mul = 1ull << 20, end++; break;
    case 'g': case 'G': mul = 1ull << 30, end++; break;
    default: break;
  }
  if (mul > 1 && *end == 'i') end++;
  if (*end == 'B' || *end == 'b') end++;
  if (*end || v > (unsigned long long)SIZE_MAX / mul)
    return nmt_errorf(NMT_ERR_USAGE, "bad byte count '%s' (expected e.g. 4096, 64K, 512M, 1G)",
                      text);
  *out = (size_t)(v * mul);
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */

typedef struct {
  size_t bytes;      /* the row's size: per rank (all-reduce) or the whole buffer */
  size_t elems;      /* elements in each rank's buffer: bytes / element size */
  size_t rank_count; /* the count passed to the collective */
  int warmup, iters;
} size_plan;

typedef struct {
  nmt_comm *comm;
  nmt_bench_op op;
  nmt_grad_dtype wire;
  const nmt_backend *be;
  void *ctx;
  float *buf;   /* backend memory: fp32 for the largest count */
  float *stage; /* STAGE_FLOATS of host memory */
  const size_plan *plan;
  int n_sizes;
  double *sec;      /* (n_sizes) per-iteration seconds on this rank */
  long long *wrong; /* (n_sizes) */
  nmt_status status;
  char error[512];
} rank_job;

/* The all-gather's 16-bit elements: any bit pattern (a gather interprets nothing). */
static uint16_t gather_bits16(int rank, size_t i) {
  uint64_t z = (uint64_t)i * 0x9E3779B97F4A7C15ull ^ (uint64_t)(uint32_t)(rank + 1) << 40;
  z = (z ^ (z >> 31)) * 0xBF58476D1CE4E5B9ull;
  return (uint16_t)(z >> 48);
}

/* Element i of the all-gather's input on `rank` (element size esz), written into the staging
 * buffer at k: rank `owner`'s pattern, or (owner < 0) a poison only this rank writes. */
static void gather_put(void *stage, size_t k, size_t esz, int rank, int owner, size_t i) {
  if (esz == 2)
    ((uint16_t *)stage)[k] = owner >= 0 ? gather_bits16(owner, i) : gather_bits16(-2 - rank, i);
  else
    ((float *)stage)[k] = owner >= 0 ? nmt_bench_allreduce_value(owner, i)
                                     : 1000.0f + (float)rank; /* never a pattern value */
}

/* Writes the op's input: the sums' pattern everywhere, or the gather's own slice and poison. */
static nmt_status fill(rank_job *j, const size_plan *p, int rank) {
  const size_t esz = j->op == NMT_BENCH_ALL_GATHER ? nmt_comm_wire_size(j->wire) : sizeof(float);
  for (size_t off = 0; off < p->elems; off += STAGE_FLOATS) {
    size_t len = p->elems - off < STAGE_FLOATS ? p->elems - off : STAGE_FLOATS;
    if (j->op != NMT_BENCH_ALL_GATHER)
      nmt_bench_allreduce_fill(j->stage, len, off, rank);
    else
      for (size_t k = 0; k < len; k++)
        gather_put(j->stage, k, esz, rank, (off + k) / p->rank_count == (size_t)rank ? rank : -1,
                   off + k);
    NMT_TRY(j->be->copy_h2d(j->ctx, (char *)j->buf + off * esz, j->stage, len * esz));
  }
  return NMT_OK;
}

/* Counts the wrong elements of the op's output: every element (all-reduce), the rank's own
 * slice (reduce-scatter), every slice against its owner's pattern (all-gather). */
static nmt_status check(rank_job *j, const size_plan *p, int rank, int n, long long *wrong) {
  const size_t esz = j->op == NMT_BENCH_ALL_GATHER ? nmt_comm_wire_size(j->wire) : sizeof(float);
  size_t lo = 0, hi = p->elems;
  if (j->op == NMT_BENCH_REDUCE_SCATTER) lo = p->rank_count * (size_t)rank, hi = lo + p->rank_count;
  *wrong = 0;
  for (size_t off = lo; off < hi; off += STAGE_FLOATS) {
    size_t len = hi - off < STAGE_FLOATS ? hi - off : STAGE_FLOATS;
    NMT_TRY(j->be->copy_d2h(j->ctx, j->stage, (char *)j->buf + off * esz, len * esz));
    if (j->op != NMT_BENCH_ALL_GATHER) {
      *wrong += (long long)nmt_bench_allreduce_check(j->stage, len, off, n);
      continue;
    }
    float want32[1];
    for (size_t k = 0; k < len; k++) {
      const int owner = (int)((off + k) / p->rank_count);
      if (esz == 2) {
        *wrong += ((uint16_t *)j->stage)[k] != gather_bits16(owner, off + k);
      } else {
        gather_put(want32, 0, esz, rank, owner, off + k);
        *wrong += memcmp(&j->stage[k], want32, sizeof(float)) != 0;
      }
    }
  }
  return NMT_OK;
}

/* One collective of the job's op on the size's buffer. */
static nmt_status collective(rank_job *j, const size_plan *p) {
  switch (j->op) {
  case NMT_BENCH_REDUCE_SCATTER:
    return nmt_comm_reduce_scatter_sum_as(j->comm, j->buf, p->rank_count, j->wire);
  case NMT_BENCH_ALL_GATHER: return nmt_comm_all_gather(j->comm, j->buf, p->rank_count, j->wire);
  default: return nmt_comm_allreduce_sum_as(j->comm, j->buf, p->rank_count, j->wire);
  }
}

/* Returns once every collective this rank issued has completed: a flush orders them before
 * the device's later work (asynchronous communicators), the synchronize waits for that. */
static nmt_status wait_done(rank_job *j) {
  NMT_TRY(nmt_comm_flush(j->comm));
  if (j->be->synchronize) NMT_TRY(j->be->synchronize(j->ctx));
  return NMT_OK;
}

static nmt_status rank_sweep(rank_job *j) {
  const int rank = nmt_comm_rank(j->comm), n = nmt_comm_size(j->comm);
  for (int s = 0; s < j->n_sizes; s++) {
    const size_plan *p = &j->plan[s];
    NMT_TRY(fill(j, p, rank));
    for (int i = 0; i < p->warmup; i++) NMT_TRY(collective(j, p));
    NMT_TRY(wait_done(j));
    /* Every rank starts the clock as the last one leaves the barrier. */
    NMT_TRY(nmt_comm_barrier(j->comm));
    double t0 = nmt__bench_now_s();
    for (int i = 0; i < p->iters; i++) NMT_TRY(collective(j, p));
    NMT_TRY(wait_done(j));
    j->sec[s] = (nmt__bench_now_s() - t0) / p->iters;
    NMT_TRY(fill(j, p, rank));
    NMT_TRY(collective(j, p));
    NMT_TRY(nmt_comm_flush(j->comm));
    NMT_TRY(check(j, p, rank, n, &j->wrong[s]));
  }
  return NMT_OK;
}

static void *rank_main(void *arg) {
  rank_job *j = arg;
  j->status = rank_sweep(j);
  if (j->status != NMT_OK) {
    snprintf(j->error, sizeof j->error, "%s", nmt_last_error());
    /* The peers may be waiting in a collective for this rank: let them out. */
    nmt_comm_abort(j->comm);
  }
  return NULL;
}

/* Every partial sum of the check pattern is an integer of magnitude <= 32 n: exact while 32 n
 * fits the wire type's significand (24, 11, 8 bits), whatever order the communicator adds in.
 * Beyond that the check would count rounding as wrong elements: refuse. */
static nmt_status check_wire(nmt_grad_dtype wire, int n) {
  if (!nmt_comm_wire_size(wire))
    return nmt_errorf(NMT_ERR_USAGE, "bench allreduce: wire type %d", (int)wire);
  const int digits = wire == NMT_GRAD_FP16 ? 11 : wire == NMT_GRAD_BF16 ? 8 : 24;
  if (32.0 * n > ldexp(1.0, digits))
    return nmt_errorf(NMT_ERR_USAGE, "bench allreduce: %d ranks over a %s wire: sums of the check "
                      "pattern (|v| <= 32) reach %d, past %.0f, the integers %s holds exactly; "
                      "use at most %d ranks", n, nmt_comm_wire_name(wire), 32 * n,
                      ldexp(1.0, digits), nmt_comm_wire_name(wire), (1 << digits) / 32);
  return NMT_OK;
}

/* The first size: min_bytes rounded up to whole elements of `esz` bytes, at least one. */
static size_t first_size(size_t min_bytes, size_t esz) {
  size_t b = (min_bytes + esz - 1) / esz * esz;
  return b ? b : esz;
}

/* The sizes of the sweep. `ranks` elements make the smallest unit: 1 for the all-reduce (a
 * size is per rank), n for reduce-scatter and all-gather (a size is the whole buffer), where,
 * as nccl-tests does, each doubled size is rounded down to whole units (sizes below one unit
 * are left out). */
static int plan_sizes(const nmt_bench_allreduce_opts *o, size_t esz, int ranks,
                      size_plan *plan) {
  int n = 0;
  const size_t unit = esz * (size_t)ranks;
  for (size_t d = first_size(o->min_bytes, esz); d <= o->max_bytes && n < MAX_SIZES; d *= 2) {
    const size_t b = d / unit * unit;
    if (!b) continue;
    double scale = b > BIG_BYTES ? (double)BIG_BYTES / (double)b : 1.0;
    plan[n].bytes = b;
    plan[n].elems = b / esz;
    plan[n].rank_count = b / unit;
    plan[n].iters = (int)ceil(o->iters * scale);
    if (plan[n].iters < 2) plan[n].iters = o->iters < 2 ? o->iters : 2;
    plan[n].warmup = o->warmup > 0 ? (int)ceil(o->warmup * scale) : 0;
    n++;
    if (d > SIZE_MAX / 2) break;
  }
  return n;
}

nmt_status nmt_bench_allreduce_run(nmt_comm **comms, int n, const nmt_backend *be, void **ctxs,
                                   const nmt_bench_allreduce_opts *o,
                                   nmt_bench_allreduce_row *rows, int max_rows, int *n_rows) {
  *n_rows = 0;
  if (!o || o->size != sizeof *o)
    return nmt_errorf(NMT_ERR_USAGE, "bench allreduce: options struct of the wrong size");
  if (n < 1 || !comms) return nmt_errorf(NMT_ERR_USAGE, "bench allreduce: %d ranks", n);
  if (o->iters < 1 || o->warmup < 0)
    return nmt_errorf(NMT_ERR_USAGE, "bench allreduce: iters %d (>= 1), warmup %d (>= 0)",
                      o->iters, o->warmup);
  if (o->min_bytes > o->max_bytes)
    return nmt_errorf(NMT_ERR_USAGE, "bench allreduce: min bytes %zu > max bytes %zu",
                      o->min_bytes, o->max_bytes);
  if (o->op != NMT_BENCH_ALLREDUCE && o->op != NMT_BENCH_REDUCE_SCATTER &&
      o->op != NMT_BENCH_ALL_GATHER)
    return nmt_errorf(NMT_ERR_USAGE, "bench allreduce: one sweep runs one collective, not op "
                      "%d (%s)", (int)o->op, nmt_bench_op_name(o->op));
  /* The gather adds nothing: any wire type moves the pattern exactly. */
  if (o->op != NMT_BENCH_ALL_GATHER) NMT_TRY(check_wire(o->wire, n));
  else if (!nmt_comm_wire_size(o->wire))
    return nmt_errorf(NMT_ERR_USAGE, "bench allreduce: element type %d", (int)o->wire);
  const size_t esz = nmt_comm_wire_size(o->wire);
  size_plan plan[MAX_SIZES];
  int n_sizes = plan_sizes(o, esz, o->op == NMT_BENCH_ALLREDUCE ? 1 : n, plan);
  if (n_sizes > max_rows) n_sizes = max_rows;
  if (n_sizes < 1) return NMT_OK;
  /* Every op's buffer holds `elems` elements; fp32 slots are enough for 16-bit ones too. */
  const size_t max_count = plan[n_sizes - 1].elems;

  nmt_status s = NMT_OK;
  rank_job *jobs = calloc((size_t)n, sizeof *jobs);
  double *sec = calloc((size_t)n * (size_t)n_sizes, sizeof *sec);
  long long *wrong = calloc((size_t)n * (size_t)n_sizes, sizeof *wrong);
  pthread_t *threads = calloc((size_t)n, sizeof *threads);
  if (!jobs || !sec || !wrong || !threads) {
    s = nmt_errorf(NMT_ERR_NOMEM, "bench allreduce: bookkeeping for %d ranks", n);
    goto out;
  }
  for (int r = 0; r < n; r++) {
    rank_job *j = &jobs[r];
    j->comm = comms[r], j->op = o->op, j->wire = o->wire, j->be = be;
    j->ctx = ctxs ? ctxs[r] : NULL;
    j->plan = plan, j->n_sizes = n_sizes;
    j->sec = sec + (size_t)r * n_sizes, j->wrong = wrong + (size_t)r * n_sizes;
    j->stage = malloc(STAGE_FLOATS * sizeof(float));
    if (!j->stage) {
      s = nmt_errorf(NMT_ERR_NOMEM, "bench allreduce: staging buffer of rank %d", r);
      goto out;
    }
    NMT_TRY_GOTO(s, be->malloc(j->ctx, max_count * sizeof(float), (void **)&j->buf), out);
    /* Before the threads start: NCCL may cudaFree an older scratch, which waits for the whole
     * device. */
    if (o->wire != NMT_GRAD_FP32 && o->op != NMT_BENCH_ALL_GATHER)
      NMT_TRY_GOTO(s, nmt_comm_reserve(j->comm, max_count), out);
    /* A communicator that stages through host memory (host-staged) sizes it now. */
    NMT_TRY_GOTO(s, nmt_comm_reserve_staging(j->comm, max_count * sizeof(float)), out);
  }
  int started = 0;
  for (; started < n; started++)
    if (pthread_create(&threads[started], NULL, rank_main, &jobs[started]) != 0) break;
  if (started < n) {
    nmt_comm_abort(comms[0]); /* the started ranks would wait for the missing ones forever */
    s = nmt_errorf(NMT_ERR_INTERNAL, "bench allreduce: cannot start the thread of rank %d",
                   started);
  }
  for (int r = 0; r < started; r++) pthread_join(threads[r], NULL);
  if (s != NMT_OK) goto out;
  /* The first real error; ABORTED ranks only echo it. */
  for (int pass = 0; pass < 2 && s == NMT_OK; pass++)
    for (int r = 0; r < n && s == NMT_OK; r++)
      if (jobs[r].status != NMT_OK && (pass == 1 || jobs[r].status != NMT_ERR_ABORTED))
        s = nmt_errorf(jobs[r].status, "bench allreduce, rank %d: %s", r, jobs[r].error);
  if (s != NMT_OK) goto out;
  for (int k = 0; k < n_sizes; k++) {
    nmt_bench_allreduce_row *row = &rows[k];
    double t = 0;
    long long w = 0;
    for (int r = 0; r < n; r++) {
      if (sec[(size_t)r * n_sizes + k] > t) t = sec[(size_t)r * n_sizes + k];
      w += wrong[(size_t)r * n_sizes + k];
    }
    row->bytes = plan[k].bytes;
    row->count = plan[k].elems;
    row->rank_count = plan[k].rank_count;
    row->warmup = plan[k].warmup;
    row->iters = plan[k].iters;
    row->time_us = t * 1e6;
    row->algbw_gbs = t > 0 ? (double)plan[k].bytes / t / 1e9 : 0;
    row->busbw_gbs = row->algbw_gbs * nmt_bench_op_busbw_factor(o->op, n);
    row->wrong = w;
  }
  *n_rows = n_sizes;
out:
  if (jobs)
    for (int r = 0; r < n; r++) {
      if (jobs[r].buf) be->free(jobs[r].ctx, jobs[r].buf);
      free(jobs[r].stage);
    }
  free(jobs), free(sec), free(wrong), free(threads);
  return s;
}

/* ------------------------------------------------------------------------------------------ */

/* MemAvailable from /proc/meminfo in bytes (what can be allocated without swapping), or the
 * free pages where that file is missing; 0 if neither is known. */
static double mem_available(void) {
  FILE *f = fopen("/proc/meminfo", "r");
  if (f) {
    char line[256];
    unsigned long long kb = 0;
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) found = sscanf(line, "MemAvailable: %llu kB", &kb) == 1;
    fclose(f);
    if (found) return (double)kb * 1024.0;
  }
  long pages = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  return pages > 0 && psz > 0 ? (double)pages * (double)psz : 0;
}

static void utc_now(char *out, size_t cap) {
  time_t now = time(NULL);
  struct tm tm;
  gmtime_r(&now, &tm);
  strftime(out, cap, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

/* The communicator group the trainer would use: parallel.device's backend, one device per
 * rank, nmt_device_comm_create (host threads on CPU workers, NCCL over several GPUs, the
 * host-staged group with parallel.comm = host: its cost, measured). */
typedef struct {
  int n;
  nmt_device *dev;
  void **ctxs;
  int *index;
  nmt_comm **comms;
} rank_group;

static void group_close(rank_group *g) {
  if (g->comms && g->comms[0]) nmt_comm_destroy(g->comms, g->n);
  for (int r = 0; g->dev && r < g->n; r++) nmt_device_close(&g->dev[r]);
  free(g->dev), free(g->ctxs), free(g->index), free(g->comms);
}

static nmt_status group_open(const nmt_config *cfg, rank_group *g) {
  const int n = g->n = cfg->parallel_devices;
  const nmt_backend *be;
  NMT_TRY(nmt_device_select(cfg, n, NMT_DEVICE_TRAIN, &be));
  if (!be->is_host && n < 2)
    return nmt_errorf(NMT_ERR_USAGE, "bench allreduce: parallel.devices = 1 GPU has nothing to "
                      "reduce (set parallel.devices >= 2, or parallel.device = cpu)");
  g->dev = calloc((size_t)n, sizeof *g->dev), g->ctxs = calloc((size_t)n, sizeof *g->ctxs);
  g->index = calloc((size_t)n, sizeof *g->index), g->comms = calloc((size_t)n, sizeof *g->comms);
  if (!g->dev || !g->ctxs || !g->index || !g->comms)
    return nmt_errorf(NMT_ERR_NOMEM, "bench allreduce: %d communicator handles", n);
  for (int r = 0; r < n; r++) {
    NMT_TRY(nmt_device_open(cfg, be, r, NMT_DEVICE_TRAIN, NULL, &g->dev[r]));
    g->ctxs[r] = g->dev[r].ctx, g->index[r] = g->dev[r].index;
  }
  return nmt_device_comm_create(cfg, be, n, g->index, g->ctxs, NULL, g->comms);
}

/* The largest size whose n fp32 buffers fit in mem_fraction of MemAvailable (0: none);
 * *first_skipped: the first size left out (0: none). */
static size_t fit_sizes(const nmt_bench_allreduce_opts *o, int n, size_t esz, double avail,
                        size_t *first_skipped) {
  double budget = o->mem_fraction * avail;
  size_t fits = 0;
  *first_skipped = 0;
  for (size_t b = first_size(o->min_bytes, esz); b <= o->max_bytes; b *= 2) {
    /* The buffers are fp32 whatever travels on the wire. */
    if ((double)n * (double)(b / esz * sizeof(float)) > budget) {
      *first_skipped = b;
      break;
    }
    fits = b;
    if (b > SIZE_MAX / 2) break;
  }
  return fits;
}

typedef struct {
  char cpu[256], commit[64], date[32];
  double load[3];
  long cores;
  const char *comm;     /* "host" or "nccl" */
} run_info;

/* What one table measures, in nccl-tests' words. */
static const char *op_title(nmt_bench_op op) {
  return op == NMT_BENCH_REDUCE_SCATTER ? "reduce_scatter_perf"
         : op == NMT_BENCH_ALL_GATHER   ? "all_gather_perf"
                                        : "all_reduce_perf";
}

static void print_header(const char *config_label, const nmt_bench_allreduce_opts *o,
                         const run_info *ri, int n, size_t esz, const char *type,
                         size_t first_skipped, double avail, FILE *out) {
  if (o->op == NMT_BENCH_ALL_GATHER)
    fprintf(out, "# nmt bench allreduce --op all_gather: all_gather_perf style, %s elements "
            "(parallel.grad_dtype) moved bit for bit, in place\n", type);
  else
    fprintf(out, "# nmt bench allreduce%s: %s style, sum in %s (parallel.grad_dtype), fp32 "
            "buffers, in place\n", o->op == NMT_BENCH_REDUCE_SCATTER ? " --op reduce_scatter" : "",
            op_title(o->op), type);
  if (!strcmp(ri->comm, "host"))
    fprintf(out, "# communicator: host, %d rank(s) = threads of this process, buffers in host "
            "memory\n", n);
  else
    fprintf(out, "# communicator: NCCL, %d rank(s) = GPUs of this process, buffers in device "
            "memory\n", n);
  fprintf(out, "# config: %s (parallel.devices = %d)\n", config_label, n);
  fprintf(out, "# device: %s, %ld core(s) online; load average %.2f %.2f %.2f\n", ri->cpu,
          ri->cores, ri->load[0], ri->load[1], ri->load[2]);
  fprintf(out, "# commit %s, %s\n", ri->commit, ri->date);
  fprintf(out, "# warmup %d, timed %d iterations per size (both x 16 MiB / size above 16 MiB); "
          "time = mean over the timed iterations, slowest rank\n", o->warmup, o->iters);
  if (o->op == NMT_BENCH_ALLREDUCE)
    fprintf(out, "# size = count x %zu B on the wire; algbw = size / time, busbw = algbw * "
            "2(n-1)/n (nccl-tests doc/PERFORMANCE.md), GB = 1e9 B; #wrong: elements differing "
            "from the exact sum\n", esz);
  else
    fprintf(out, "# size = count x %zu B = the whole buffer, n x %zu B per rank's slice; algbw = "
            "size / time, busbw = algbw * (n-1)/n (nccl-tests doc/PERFORMANCE.md), GB = 1e9 B; "
            "#wrong: %s\n", esz, esz, o->op == NMT_BENCH_REDUCE_SCATTER
            ? "elements of each rank's own slice differing from the exact sum"
            : "elements of any slice differing from its owner's, bit for bit");
  if (first_skipped)
    fprintf(out, "# skipped sizes from %zu B: %d fp32 buffers of %zu B exceed %.0f%% of "
            "MemAvailable (%.2f GiB)\n", first_skipped, n, first_skipped / esz * sizeof(float),
            100 * o->mem_fraction, avail / 1073741824.0);
  fprintf(out, "#\n# %10s %13s %9s %7s %10s %8s %8s %7s\n", "size", "count", "type", "redop",
          "time", "algbw", "busbw", "#wrong");
  fprintf(out, "# %10s %13s %9s %7s %10s %8s %8s %7s\n", "(B)", "(elements)", "", "", "(us)",
          "(GB/s)", "(GB/s)", "");
  fflush(out);
}

static nmt_status write_rows(const char *jsonl_path, const run_info *ri, const char *config_label,
                             int n, nmt_bench_op op, const char *type,
                             const nmt_bench_allreduce_row *rows, int n_rows) {
  FILE *f = fopen(jsonl_path, "a");
  if (!f) return nmt_errorf(NMT_ERR_IO, "bench allreduce: cannot append to %s", jsonl_path);
  for (int k = 0; k < n_rows; k++) {
    const nmt_bench_allreduce_row *r = &rows[k];
    fprintf(f, "{\"date\": \"%s\", \"commit\": \"%s\", \"bench\": \"allreduce\", \"op\": \"%s\", "
            "\"comm\": \"%s\", \"ranks\": %d, \"device\": ", ri->date, ri->commit,
            nmt_bench_op_name(op), ri->comm, n);
    nmt_json_str(f, ri->cpu);
    fprintf(f, ", \"cores\": %ld, \"config\": ", ri->cores);
    nmt_json_str(f, config_label);
    fprintf(f, ", \"type\": \"%s\", \"redop\": \"%s\", \"size_bytes\": %zu, \"count\": %zu, "
            "\"rank_count\": %zu, \"warmup\": %d, \"iters\": %d, \"time_us\": %.3f, "
            "\"algbw_gbs\": %.6f, \"busbw_gbs\": %.6f, \"wrong\": %lld, \"loadavg\": %.2f}\n",
            type, op == NMT_BENCH_ALL_GATHER ? "none" : "sum", r->bytes, r->count, r->rank_count,
            r->warmup, r->iters, r->time_us, r->algbw_gbs, r->busbw_gbs, r->wrong, ri->load[0]);
  }
  int bad = ferror(f);
  if (fclose(f) != 0 || bad)
    return nmt_errorf(NMT_ERR_IO, "bench allreduce: cannot write %s", jsonl_path);
  return NMT_OK;
}

/* One table: the sweep of run->op on the open group, printed, appended to the JSONL file;
 * *wrong gets its wrong elements. */
static nmt_status run_table(rank_group *g, const char *config_label,
                            const nmt_bench_allreduce_opts *run, size_t first_skipped,
                            double avail, const run_info *ri, const char *jsonl_path, FILE *out,
                            long long *wrong) {
  const nmt_backend *be = g->dev[0].be;
  const size_t esz = nmt_comm_wire_size(run->wire);
  const char *type = nmt_comm_wire_name(run->wire);
  print_header(config_label, run, ri, g->n, esz, type, first_skipped, avail, out);
  nmt_bench_allreduce_row rows[MAX_SIZES];
  int n_rows = 0;
  *wrong = 0;
  if (run->max_bytes >= run->min_bytes && run->max_bytes > 0)
    NMT_TRY(nmt_bench_allreduce_run(g->comms, g->n, be, g->ctxs, run, rows, MAX_SIZES, &n_rows));
  double sum_busbw = 0;
  for (int k = 0; k < n_rows; k++) {
    const nmt_bench_allreduce_row *r = &rows[k];
    fprintf(out, "  %10zu %13zu %9s %7s %10.2f %8.3f %8.3f %7lld\n", r->bytes, r->count, type,
            run->op == NMT_BENCH_ALL_GATHER ? "none" : "sum", r->time_us, r->algbw_gbs,
            r->busbw_gbs, r->wrong);
    sum_busbw += r->busbw_gbs;
    *wrong += r->wrong;
  }
  fprintf(out, "# Out of bounds values : %lld %s\n", *wrong, *wrong ? "FAILED" : "OK");
  fprintf(out, "# Avg bus bandwidth    : %.4f GB/s (mean over %d sizes)\n",
          n_rows ? sum_busbw / n_rows : 0.0, n_rows);
  fflush(out);
  if (jsonl_path)
    NMT_TRY(write_rows(jsonl_path, ri, config_label, g->n, run->op, type, rows, n_rows));
  return NMT_OK;
}

nmt_status nmt_bench_allreduce(const nmt_config *cfg, const char *config_label,
                               const nmt_bench_allreduce_opts *o, const char *jsonl_path,
                               FILE *out) {
  if (!o || o->size != sizeof *o)
    return nmt_errorf(NMT_ERR_USAGE, "bench allreduce: options struct of the wrong size");
  const int n = cfg->parallel_devices;
  const nmt_bench_op first = o->op == NMT_BENCH_ALL_OPS ? NMT_BENCH_ALLREDUCE : o->op;
  const nmt_bench_op last = o->op == NMT_BENCH_ALL_OPS ? NMT_BENCH_ALL_GATHER : o->op;
  if (first < NMT_BENCH_ALLREDUCE || last > NMT_BENCH_ALL_GATHER)
    return nmt_errorf(NMT_ERR_USAGE, "bench allreduce: op %d", (int)o->op);
  if (first != NMT_BENCH_ALL_GATHER) NMT_TRY(check_wire(cfg->parallel_grad_dtype, n));
  rank_group g = {0};
  nmt_status s = group_open(cfg, &g);
  if (s != NMT_OK) {
    group_close(&g);
    return s;
  }
  const nmt_backend *be = g.dev[0].be;
  nmt_bench_allreduce_opts run = *o;
  run.wire = cfg->parallel_grad_dtype;
  double avail = be->is_host ? mem_available() : 0;
  size_t first_skipped = 0;
  if (avail > 0) run.max_bytes = fit_sizes(o, n, nmt_comm_wire_size(run.wire), avail,
                                           &first_skipped);
  run_info ri = {.load = {-1, -1, -1}, .cores = sysconf(_SC_NPROCESSORS_ONLN),
                 .comm = be->is_host ? "host" : "nccl"};
  nmt__bench_cpu_name(ri.cpu, sizeof ri.cpu);
  nmt__bench_commit(ri.commit, sizeof ri.commit);
  utc_now(ri.date, sizeof ri.date);
  getloadavg(ri.load, 3);
  long long total_wrong = 0;
  for (nmt_bench_op op = first; s == NMT_OK && op <= last; op++) {
    long long wrong = 0;
    run.op = op;
    if (op != first) fprintf(out, "\n");
    s = run_table(&g, config_label, &run, first_skipped, avail, &ri, jsonl_path, out, &wrong);
    total_wrong += wrong;
  }
  group_close(&g);
  if (s != NMT_OK) return s;
  if (total_wrong)
    return nmt_errorf(NMT_ERR_DATA, "bench allreduce: %lld wrong element(s) on the %s "
                      "communicator with %d ranks (%s, %s on the wire)", total_wrong, ri.comm, n,
                      nmt_bench_op_name(o->op), nmt_comm_wire_name(run.wire));
  return NMT_OK;
}
