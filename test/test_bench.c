/* test_bench.c — `nmt bench allreduce` and `nmt bench scaling` (include/nmt/bench.h).
 *  - the all-reduce checker: exact sums pass, a corrupted element, a shifted slice or a missing
 *    rank are counted; the sweep on the host communicator (2 and 4 ranks) reports 0 wrong, and
 *    the same sweep through a communicator that corrupts one element reports exactly it;
 *  - the wire type (parallel.grad_dtype): fp16/bf16 sweeps go through allreduce_sum_as with
 *    that type only (a spying communicator counts the calls), after one reservation of the
 *    largest count; sizes are 2-byte elements; a corrupted element is still caught; a wire
 *    type whose sums would not be exact (bf16, 9 ranks) is refused; the CLI prints "half";
 *  - busbw = algbw * 2(n-1)/n (0 for one rank), and (n-1)/n for reduce-scatter and all-gather;
 *  - ZeRO's collectives (--op): reduce-scatter and all-gather sweeps on the host communicator
 *    (2, 3 and 4 ranks; fp32 and 16-bit) report 0 wrong, sizes are whole buffers rounded down
 *    to n x element size as nccl-tests does, and a communicator that corrupts one element of a
 *    reduce-scatter's owned slice or of a gathered slice is caught; the CLI's --op all prints
 *    the three tables and tags each JSON row with its op;
 *  - the scaling model on synthetic profiles against hand-computed values: infinite bandwidth
 *    hides everything, one bucket exposes its whole all-reduce, early buckets leave only the
 *    last one exposed, a backed-up comm stream, the serial variant, the trainer's bucketing,
 *    and the best bucket is the argmin;
 *  - the measurement on a tiny model: events cover the gradient in order, tokens match the
 *    batcher's batches;
 *  - the CLI: exit 2 on bad arguments and config, a short sweep and a short scaling run;
 *  - issues 17 and 18: one collective's time in one node and across nodes (ring, two-level)
 *    against hand counts; each stage's bytes per step; ZeRO 1 and 2 (reduce-scatters, slots, norm, all-gathers with and
 *    without the half copy, stage 2's per-micro-batch passes, a backed-up stream); sharded
 *    buckets and the largest stage; per-GPU state per stage against the engine's allocation
 *    formulas counted by hand; the batch-dependent memory and the largest batch that fits; the
 *    CLI's --zero all --nodes --mem-gb tables and JSON rows.
 * Timing never decides a test: only structure, counts and exact arithmetic do. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "../src/comm/comm_impl.h"
#include "helpers.h"
#include "nmt/bench.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/model.h"
#include "test.h"

/* ---- the checker ----------------------------------------------------------------------- */

/* Each rank's fill, summed element by element in float: an independent route to the sum. */
static void reference_sum(float *out, size_t count, size_t offset, int n, int skip_rank) {
  float *tmp = malloc(count * sizeof *tmp);
  memset(out, 0, count * sizeof *out);
  for (int r = 0; r < n; r++) {
    if (r == skip_rank) continue;
    nmt_bench_allreduce_fill(tmp, count, offset, r);
    for (size_t k = 0; k < count; k++) out[k] += tmp[k];
  }
  free(tmp);
}

NMT_TEST(bench_check_counts_wrong) {
  enum { COUNT = 5000, N = 4 };
  const size_t offset = 123457;
  float *buf = malloc(COUNT * sizeof *buf), *one = malloc(COUNT * sizeof *one);
  reference_sum(buf, COUNT, offset, N, -1);
  NMT_ASSERT_EQ_INT(nmt_bench_allreduce_check(buf, COUNT, offset, N), 0);
  /* The pattern is integer-valued, bounded and not constant. */
  int distinct = 0;
  for (size_t k = 0; k < COUNT; k++) {
    float v = nmt_bench_allreduce_value(1, offset + k);
    NMT_ASSERT(v == floorf(v) && v >= -31 && v <= 32);
    distinct += v != nmt_bench_allreduce_value(1, offset);
  }
  NMT_ASSERT(distinct > COUNT / 2);
  buf[17] += 1;
  NMT_ASSERT_EQ_INT(nmt_bench_allreduce_check(buf, COUNT, offset, N), 1);
  buf[COUNT - 1] = NAN;
  NMT_ASSERT_EQ_INT(nmt_bench_allreduce_check(buf, COUNT, offset, N), 2);
  /* A slice written one element off: wrong wherever neighbouring sums differ. */
  reference_sum(buf, COUNT, offset + 1, N, -1);
  reference_sum(one, COUNT, offset, N, -1);
  size_t differ = 0;
  for (size_t k = 0; k < COUNT; k++) differ += buf[k] != one[k];
  NMT_ASSERT(differ > COUNT / 2);
  NMT_ASSERT_EQ_INT(nmt_bench_allreduce_check(buf, COUNT, offset, N), differ);
  /* Rank 2 missing: wrong exactly where rank 2 contributes a non-zero value. */
  reference_sum(buf, COUNT, offset, N, 2);
  size_t nonzero = 0;
  for (size_t k = 0; k < COUNT; k++) nonzero += nmt_bench_allreduce_value(2, offset + k) != 0;
  NMT_ASSERT(nonzero > COUNT / 2);
  NMT_ASSERT_EQ_INT(nmt_bench_allreduce_check(buf, COUNT, offset, N), nonzero);
  /* A rank counted twice (or one rank too many assumed) is caught the same way. */
  reference_sum(buf, COUNT, offset, N, -1);
  NMT_ASSERT(nmt_bench_allreduce_check(buf, COUNT, offset, N + 1) > COUNT / 2);
  free(buf), free(one);
}

NMT_TEST(bench_busbw_factor) {
  /* nccl-tests doc/PERFORMANCE.md: 2(n-1)/n, worked by hand; one rank: 0. */
  const int n[] = {1, 2, 4, 8};
  const double factor[] = {0.0, 1.0, 1.5, 1.75};
  for (int i = 0; i < 4; i++) {
    NMT_ASSERT_NEAR(nmt_bench_busbw_factor(n[i]), factor[i], 1e-15);
    NMT_ASSERT_NEAR(nmt_bench_busbw(3.2, n[i]), 3.2 * factor[i], 1e-12);
  }
  NMT_ASSERT_NEAR(nmt_bench_busbw_factor(0), 0, 0);
}

NMT_TEST(bench_parse_bytes) {
  size_t v;
  NMT_ASSERT_OK(nmt_bench_parse_bytes("4096", &v));
  NMT_ASSERT_EQ_INT(v, 4096);
  NMT_ASSERT_OK(nmt_bench_parse_bytes("64K", &v));
  NMT_ASSERT_EQ_INT(v, 65536);
  NMT_ASSERT_OK(nmt_bench_parse_bytes("512MB", &v));
  NMT_ASSERT_EQ_INT(v, 512ull << 20);
  NMT_ASSERT_OK(nmt_bench_parse_bytes("1GiB", &v));
  NMT_ASSERT_EQ_INT(v, 1ull << 30);
  NMT_ASSERT_EQ_STATUS(nmt_bench_parse_bytes("12Q", &v), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(nmt_bench_parse_bytes("-4", &v), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(nmt_bench_parse_bytes("", &v), NMT_ERR_USAGE);
}

/* ---- the sweep on a communicator --------------------------------------------------------- */

static nmt_status sweep_as(nmt_comm **comms, int n, size_t max_bytes, nmt_grad_dtype wire,
                           nmt_bench_allreduce_row *rows, int *n_rows) {
  nmt_bench_allreduce_opts o;
  nmt_bench_allreduce_opts_default(&o);
  o.min_bytes = 4;
  o.max_bytes = max_bytes;
  o.warmup = 1;
  o.iters = 2;
  o.wire = wire;
  return nmt_bench_allreduce_run(comms, n, &nmt_backend_ref, NULL, &o, rows, 32, n_rows);
}

static nmt_status sweep(nmt_comm **comms, int n, size_t max_bytes, nmt_bench_allreduce_row *rows,
                        int *n_rows) {
  return sweep_as(comms, n, max_bytes, NMT_GRAD_FP32, rows, n_rows);
}

NMT_TEST(bench_allreduce_host_zero_wrong) {
  const int ns[] = {2, 4};
  for (int t = 0; t < 2; t++) {
    int n = ns[t];
    nmt_comm *comms[4];
    NMT_ASSERT_OK(nmt_comm_create_host(n, NULL, comms));
    nmt_bench_allreduce_row rows[32];
    int n_rows = 0;
    nmt_status s = sweep(comms, n, 64 << 10, rows, &n_rows);
    nmt_comm_destroy(comms, n);
    NMT_ASSERT_OK(s);
    NMT_ASSERT_EQ_INT(n_rows, 15); /* 4 B .. 64 KiB, doubling */
    for (int k = 0; k < n_rows; k++) {
      NMT_ASSERT_EQ_INT(rows[k].bytes, (size_t)4 << k);
      NMT_ASSERT_EQ_INT(rows[k].count, (size_t)1 << k);
      if (rows[k].wrong != 0) printf("# %d ranks, %zu B: %lld wrong\n", n, rows[k].bytes, rows[k].wrong);
      NMT_ASSERT_EQ_INT(rows[k].wrong, 0);
      NMT_ASSERT(rows[k].time_us > 0);
      NMT_ASSERT_NEAR(rows[k].algbw_gbs, rows[k].bytes / (rows[k].time_us * 1e3), 1e-9 * rows[k].algbw_gbs);
      NMT_ASSERT_NEAR(rows[k].busbw_gbs, rows[k].algbw_gbs * 2.0 * (n - 1) / n, 1e-12);
    }
  }
}

/* A communicator that reduces through the host one and counts the calls by wire type; with
 * `corrupt` it then changes one element of rank 1's result: the bench must report exactly that
 * element, whatever the size. */
typedef struct {
  nmt_comm base;
  nmt_comm *inner;
  int corrupt;
  long calls[3];       /* sum calls per nmt_grad_dtype (fp32 through allreduce_sum) */
  size_t reserved;     /* the largest reserve the bench asked for */
  int reserve_calls;
} faulty_comm;

static nmt_status faulty_sum(nmt_comm *c, float *buf, size_t count) {
  faulty_comm *f = (faulty_comm *)c;
  f->calls[NMT_GRAD_FP32]++;
  NMT_TRY(nmt_comm_allreduce_sum(f->inner, buf, count));
  if (f->corrupt && c->rank == 1 && count > 0) buf[count / 2] += 1;
  return NMT_OK;
}
static nmt_status faulty_sum_as(nmt_comm *c, float *buf, size_t count, nmt_grad_dtype wire) {
  faulty_comm *f = (faulty_comm *)c;
  f->calls[wire]++;
  NMT_TRY(nmt_comm_allreduce_sum_as(f->inner, buf, count, wire));
  if (f->corrupt && c->rank == 1 && count > 0) buf[count / 2] += 1;
  return NMT_OK;
}
static nmt_status faulty_reserve(nmt_comm *c, size_t max_count) {
  faulty_comm *f = (faulty_comm *)c;
  f->reserved = max_count;
  f->reserve_calls++;
  return nmt_comm_reserve(f->inner, max_count);
}
static nmt_status faulty_max(nmt_comm *c, float *buf, size_t count) {
  return nmt_comm_allreduce_max(((faulty_comm *)c)->inner, buf, count);
}
static nmt_status faulty_bcast(nmt_comm *c, float *buf, size_t count, int root) {
  return nmt_comm_broadcast(((faulty_comm *)c)->inner, buf, count, root);
}
static nmt_status faulty_barrier(nmt_comm *c) { return nmt_comm_barrier(((faulty_comm *)c)->inner); }
static void faulty_abort(nmt_comm *c) { nmt_comm_abort(((faulty_comm *)c)->inner); }
static void faulty_destroy(nmt_comm **comms, int n) { (void)comms, (void)n; }

static nmt_status faulty_flush(nmt_comm *c) { return nmt_comm_flush(((faulty_comm *)c)->inner); }

/* Reduce-scatter: one element of rank 1's own slice; all-gather: one element of the slice rank
 * 1 received from rank 0 (fp32: +1; 16-bit: one bit flipped). */
static nmt_status faulty_rs(nmt_comm *c, float *buf, size_t count, nmt_grad_dtype wire) {
  faulty_comm *f = (faulty_comm *)c;
  f->calls[wire]++;
  NMT_TRY(nmt_comm_reduce_scatter_sum_as(f->inner, buf, count, wire));
  if (f->corrupt && c->rank == 1 && count > 0) buf[count + count / 2] += 1;
  return NMT_OK;
}
static nmt_status faulty_ag(nmt_comm *c, void *buf, size_t count, nmt_grad_dtype dtype) {
  faulty_comm *f = (faulty_comm *)c;
  f->calls[dtype]++;
  NMT_TRY(nmt_comm_all_gather(f->inner, buf, count, dtype));
  if (f->corrupt && c->rank == 1 && count > 0) {
    if (dtype == NMT_GRAD_FP32) ((float *)buf)[count / 2] += 1;
    else ((unsigned short *)buf)[count / 2] ^= 1;
  }
  return NMT_OK;
}

static const nmt_comm_ops faulty_ops = {.name = "faulty",
                                        .allreduce_sum = faulty_sum,
                                        .allreduce_sum_as = faulty_sum_as,
                                        .reserve = faulty_reserve,
                                        .allreduce_max = faulty_max,
                                        .reduce_scatter_sum_as = faulty_rs,
                                        .all_gather = faulty_ag,
                                        .broadcast = faulty_bcast,
                                        .barrier = faulty_barrier,
                                        .flush = faulty_flush,
                                        .abort = faulty_abort,
                                        .destroy = faulty_destroy};

static void faulty_wrap(int n, nmt_comm **inner, faulty_comm *f, nmt_comm **outer, int corrupt) {
  memset(f, 0, (size_t)n * sizeof *f);
  for (int r = 0; r < n; r++) {
    f[r].base.ops = &faulty_ops, f[r].base.rank = r, f[r].base.size = n;
    f[r].inner = inner[r];
    f[r].corrupt = corrupt;
    outer[r] = &f[r].base;
  }
}

NMT_TEST(bench_allreduce_detects_faulty_comm) {
  enum { N = 3 };
  nmt_comm *inner[N], *outer[N];
  faulty_comm f[N];
  NMT_ASSERT_OK(nmt_comm_create_host(N, NULL, inner));
  faulty_wrap(N, inner, f, outer, 1);
  nmt_bench_allreduce_row rows[32];
  int n_rows = 0;
  nmt_status s = sweep(outer, N, 16 << 10, rows, &n_rows);
  nmt_comm_destroy(inner, N);
  NMT_ASSERT_OK(s);
  NMT_ASSERT_EQ_INT(n_rows, 13);
  for (int k = 0; k < n_rows; k++) NMT_ASSERT_EQ_INT(rows[k].wrong, 1);
  /* fp32 needs no reservation and goes through the plain sum. */
  for (int r = 0; r < N; r++) {
    NMT_ASSERT_EQ_INT(f[r].reserve_calls, 0);
    NMT_ASSERT(f[r].calls[NMT_GRAD_FP16] == 0 && f[r].calls[NMT_GRAD_BF16] == 0);
  }
}

/* fp16 and bf16 sweeps: every reduction goes through allreduce_sum_as with that wire type, the
 * largest count is reserved once, sizes count 2-byte elements, the sums of the integer pattern
 * are exact (0 wrong), and a corrupted element is still found. */
NMT_TEST(bench_allreduce_half_wire) {
  const nmt_grad_dtype wires[] = {NMT_GRAD_FP16, NMT_GRAD_BF16};
  const int ns[] = {2, 4};
  for (int wi = 0; wi < 2; wi++)
    for (int t = 0; t < 2; t++)
      for (int corrupt = 0; corrupt < 2; corrupt++) {
        const nmt_grad_dtype wire = wires[wi];
        const int n = ns[t];
        nmt_comm *inner[4], *outer[4];
        faulty_comm f[4];
        NMT_ASSERT_OK(nmt_comm_create_host(n, NULL, inner));
        faulty_wrap(n, inner, f, outer, corrupt);
        nmt_bench_allreduce_row rows[32];
        int n_rows = 0;
        nmt_status s = sweep_as(outer, n, 64 << 10, wire, rows, &n_rows);
        nmt_comm_destroy(inner, n);
        NMT_ASSERT_OK(s);
        NMT_ASSERT_EQ_INT(n_rows, 15); /* 4 B .. 64 KiB on the wire, doubling */
        for (int k = 0; k < n_rows; k++) {
          NMT_ASSERT_EQ_INT(rows[k].bytes, (size_t)4 << k);
          NMT_ASSERT_EQ_INT(rows[k].count, (size_t)2 << k);
          if (rows[k].wrong != corrupt)
            printf("# %s, %d ranks, %zu B: %lld wrong\n", nmt_comm_wire_name(wire), n,
                   rows[k].bytes, rows[k].wrong);
          NMT_ASSERT_EQ_INT(rows[k].wrong, corrupt);
          NMT_ASSERT(rows[k].time_us > 0);
          NMT_ASSERT_NEAR(rows[k].algbw_gbs, rows[k].bytes / (rows[k].time_us * 1e3),
                          1e-9 * rows[k].algbw_gbs);
          NMT_ASSERT_NEAR(rows[k].busbw_gbs, rows[k].algbw_gbs * 2.0 * (n - 1) / n, 1e-12);
        }
        /* Per size: 1 warmup + 2 timed + 1 checked (iterations do not shrink below 16 MiB). */
        for (int r = 0; r < n; r++) {
          NMT_ASSERT_EQ_INT(f[r].reserve_calls, 1);
          NMT_ASSERT_EQ_INT(f[r].reserved, (size_t)(64 << 10) / 2);
          NMT_ASSERT_EQ_INT(f[r].calls[wire], 4 * n_rows);
          NMT_ASSERT_EQ_INT(f[r].calls[NMT_GRAD_FP32] + f[r].calls[3 - wire], 0);
        }
      }
}

/* The check pattern's sums reach 32 x ranks: past 256 bf16 no longer holds every integer, so
 * the bench refuses rather than report rounding as wrong elements; fp16 (2048) still runs. */
NMT_TEST(bench_allreduce_half_wire_rank_limit) {
  enum { N = 9 };
  nmt_comm *comms[N];
  NMT_ASSERT_OK(nmt_comm_create_host(N, NULL, comms));
  nmt_bench_allreduce_row rows[32];
  int n_rows = -1;
  nmt_status bf = sweep_as(comms, N, 64, NMT_GRAD_BF16, rows, &n_rows);
  int named = strstr(nmt_last_error(), "bfloat16") != NULL;
  int rows_bf = n_rows;
  nmt_status hf = sweep_as(comms, N, 64, NMT_GRAD_FP16, rows, &n_rows);
  long long wrong = 0;
  for (int k = 0; hf == NMT_OK && k < n_rows; k++) wrong += rows[k].wrong;
  nmt_comm_destroy(comms, N);
  NMT_ASSERT_EQ_STATUS(bf, NMT_ERR_USAGE);
  NMT_ASSERT(named);
  NMT_ASSERT_EQ_INT(rows_bf, 0);
  NMT_ASSERT_OK(hf);
  NMT_ASSERT_EQ_INT(n_rows, 5); /* 4 .. 64 B */
  NMT_ASSERT_EQ_INT(wrong, 0);
}

/* ---- ZeRO's collectives: reduce-scatter and all-gather ----------------------------------- */

NMT_TEST(bench_op_names_and_busbw) {
  /* doc/PERFORMANCE.md: (n-1)/n for ReduceScatter and AllGather, worked by hand. */
  const int n[] = {1, 2, 4, 8};
  const double rs[] = {0.0, 0.5, 0.75, 0.875}, ar[] = {0.0, 1.0, 1.5, 1.75};
  for (int i = 0; i < 4; i++) {
    NMT_ASSERT_NEAR(nmt_bench_op_busbw_factor(NMT_BENCH_REDUCE_SCATTER, n[i]), rs[i], 1e-15);
    NMT_ASSERT_NEAR(nmt_bench_op_busbw_factor(NMT_BENCH_ALL_GATHER, n[i]), rs[i], 1e-15);
    NMT_ASSERT_NEAR(nmt_bench_op_busbw_factor(NMT_BENCH_ALLREDUCE, n[i]), ar[i], 1e-15);
  }
  NMT_ASSERT_NEAR(nmt_bench_op_busbw_factor(NMT_BENCH_ALL_OPS, 4), 0, 0);
  nmt_bench_op op = NMT_BENCH_ALL_OPS;
  NMT_ASSERT_OK(nmt_bench_op_parse("allreduce", &op));
  NMT_ASSERT_EQ_INT(op, NMT_BENCH_ALLREDUCE);
  NMT_ASSERT_OK(nmt_bench_op_parse("reduce_scatter", &op));
  NMT_ASSERT_EQ_INT(op, NMT_BENCH_REDUCE_SCATTER);
  NMT_ASSERT_OK(nmt_bench_op_parse("all_gather", &op));
  NMT_ASSERT_EQ_INT(op, NMT_BENCH_ALL_GATHER);
  NMT_ASSERT_OK(nmt_bench_op_parse("all", &op));
  NMT_ASSERT_EQ_INT(op, NMT_BENCH_ALL_OPS);
  NMT_ASSERT_EQ_STATUS(nmt_bench_op_parse("allgather", &op), NMT_ERR_USAGE);
  NMT_ASSERT(!strcmp(nmt_bench_op_name(NMT_BENCH_REDUCE_SCATTER), "reduce_scatter"));
  NMT_ASSERT(!strcmp(nmt_bench_op_name(NMT_BENCH_ALL_GATHER), "all_gather"));
  NMT_ASSERT(!strcmp(nmt_bench_op_name(NMT_BENCH_ALLREDUCE), "all_reduce"));
}

static nmt_status sweep_op(nmt_comm **comms, int n, size_t max_bytes, nmt_bench_op op,
                           nmt_grad_dtype wire, nmt_bench_allreduce_row *rows, int *n_rows) {
  nmt_bench_allreduce_opts o;
  nmt_bench_allreduce_opts_default(&o);
  o.min_bytes = 4;
  o.max_bytes = max_bytes;
  o.warmup = 1;
  o.iters = 2;
  o.wire = wire;
  o.op = op;
  return nmt_bench_allreduce_run(comms, n, &nmt_backend_ref, NULL, &o, rows, 32, n_rows);
}

/* Each op, wire type and rank count through a communicator that counts the calls, clean and
 * then corrupting one element per collective: the rows are whole buffers (each doubled size
 * from 4 B rounded down to n x element size), count = n x rank_count, busbw = algbw (n-1)/n,
 * #wrong = 0 clean and exactly 1 per size corrupted; the op's own collective, and only it,
 * ran 4 times per size (1 warmup, 2 timed, 1 checked). */
NMT_TEST(bench_zero_ops_host) {
  const nmt_bench_op ops[] = {NMT_BENCH_REDUCE_SCATTER, NMT_BENCH_ALL_GATHER};
  const nmt_grad_dtype wires[] = {NMT_GRAD_FP32, NMT_GRAD_FP16, NMT_GRAD_BF16};
  for (int oi = 0; oi < 2; oi++)
    for (int wi = 0; wi < 3; wi++)
      for (int n = 2; n <= 4; n++)
        for (int corrupt = 0; corrupt < 2; corrupt++) {
          const size_t esz = wires[wi] == NMT_GRAD_FP32 ? 4 : 2, unit = esz * (size_t)n;
          nmt_comm *inner[4], *outer[4];
          faulty_comm f[4];
          NMT_ASSERT_OK(nmt_comm_create_host(n, NULL, inner));
          faulty_wrap(n, inner, f, outer, corrupt);
          nmt_bench_allreduce_row rows[32];
          int n_rows = 0;
          nmt_status s = sweep_op(outer, n, 16 << 10, ops[oi], wires[wi], rows, &n_rows);
          nmt_comm_destroy(inner, n);
          NMT_ASSERT_OK(s);
          int want_rows = 0;
          for (size_t d = 4; d <= (16 << 10); d *= 2) want_rows += d >= unit;
          NMT_ASSERT_EQ_INT(n_rows, want_rows);
          for (int k = 0; k < n_rows; k++) {
            const size_t d = (size_t)4 << (13 - want_rows + k); /* 4 B .. 16 KiB: 13 sizes */
            NMT_ASSERT_EQ_INT(rows[k].bytes, d / unit * unit);
            NMT_ASSERT_EQ_INT(rows[k].count, rows[k].bytes / esz);
            NMT_ASSERT_EQ_INT(rows[k].rank_count * (size_t)n, rows[k].count);
            if (rows[k].wrong != corrupt)
              printf("# %s %s n=%d %zu B: %lld wrong\n", nmt_bench_op_name(ops[oi]),
                     nmt_comm_wire_name(wires[wi]), n, rows[k].bytes, rows[k].wrong);
            NMT_ASSERT_EQ_INT(rows[k].wrong, corrupt);
            NMT_ASSERT(rows[k].time_us > 0);
            NMT_ASSERT_NEAR(rows[k].busbw_gbs, rows[k].algbw_gbs * (n - 1) / n, 1e-12);
          }
          for (int r = 0; r < n; r++) {
            NMT_ASSERT_EQ_INT(f[r].calls[wires[wi]], 4 * n_rows);
            NMT_ASSERT_EQ_INT(f[r].calls[0] + f[r].calls[1] + f[r].calls[2], 4 * n_rows);
            /* Only a half-wire reduce-scatter needs scratch: n x count of the largest size. */
            const int reserves = ops[oi] == NMT_BENCH_REDUCE_SCATTER && wires[wi] != NMT_GRAD_FP32;
            NMT_ASSERT_EQ_INT(f[r].reserve_calls, reserves);
            if (reserves) NMT_ASSERT_EQ_INT(f[r].reserved, rows[n_rows - 1].count);
          }
        }
}

/* The gather does no arithmetic, so the wire's exactness limit does not apply to it; a sweep
 * runs one collective, never "all". */
NMT_TEST(bench_zero_ops_limits) {
  enum { N = 9 };
  nmt_comm *comms[N];
  NMT_ASSERT_OK(nmt_comm_create_host(N, NULL, comms));
  nmt_bench_allreduce_row rows[32];
  int n_rows = -1;
  nmt_status rs = sweep_op(comms, N, 256, NMT_BENCH_REDUCE_SCATTER, NMT_GRAD_BF16, rows, &n_rows);
  nmt_status ag = sweep_op(comms, N, 256, NMT_BENCH_ALL_GATHER, NMT_GRAD_BF16, rows, &n_rows);
  long long wrong = 0;
  for (int k = 0; ag == NMT_OK && k < n_rows; k++) wrong += rows[k].wrong;
  int ag_rows = n_rows;
  nmt_status all = sweep_op(comms, N, 256, NMT_BENCH_ALL_OPS, NMT_GRAD_FP32, rows, &n_rows);
  nmt_comm_destroy(comms, N);
  NMT_ASSERT_EQ_STATUS(rs, NMT_ERR_USAGE);
  NMT_ASSERT_OK(ag);
  NMT_ASSERT_EQ_INT(ag_rows, 4); /* units of 9 x 2 B: 32 -> 18, 64 -> 54, 128 -> 126, 256 -> 252 */
  NMT_ASSERT_EQ_INT(wrong, 0);
  NMT_ASSERT_EQ_STATUS(all, NMT_ERR_USAGE);
}

/* ---- the scaling model ------------------------------------------------------------------- */

NMT_TEST(scaling_infinite_busbw_hides_all) {
  const double bytes[] = {4e6, 4e6, 4e6, 2e6};
  const double ready[] = {5, 8, 11, 16};
  nmt_scaling_profile p = {.fwd_ms = 6, .bwd_ms = 10, .opt_ms = 2, .n_buckets = 4,
                           .bytes = bytes, .ready_ms = ready};
  const double links[] = {0, INFINITY};
  for (int l = 0; l < 2; l++) {
    nmt_scaling_link link = {.busbw_gbs = links[l], .latency_us = 0};
    nmt_scaling_pred one;
    NMT_ASSERT_OK(nmt_scaling_predict(&p, 1, &link, &one));
    for (int N = 1; N <= 8; N++) {
      nmt_scaling_pred q;
      NMT_ASSERT_OK(nmt_scaling_predict(&p, N, &link, &q));
      NMT_ASSERT_NEAR(q.exposed_ms, 0, 0);
      NMT_ASSERT_NEAR(q.allreduce_ms, 0, 0);
      NMT_ASSERT_NEAR(q.step_ms, 18, 1e-12);
      NMT_ASSERT_NEAR(one.step_ms / q.step_ms, 1, 1e-15);
    }
  }
}

NMT_TEST(scaling_one_bucket_exposes_all) {
  /* 40 MB ready when backward ends; 10 GB/s, 20 us: t = 0.02 + 40e6 * 2(N-1)/N / 1e7 ms. */
  const double bytes[] = {40e6}, ready[] = {25};
  nmt_scaling_profile p = {.fwd_ms = 10, .bwd_ms = 15, .opt_ms = 3, .n_buckets = 1,
                           .bytes = bytes, .ready_ms = ready};
  nmt_scaling_link link = {.busbw_gbs = 10, .latency_us = 20};
  const int Ns[] = {2, 4, 8};
  const double t[] = {4.02, 6.02, 7.02}; /* factors 1, 1.5, 1.75 x 4 ms, + 0.02 */
  for (int i = 0; i < 3; i++) {
    nmt_scaling_pred q;
    NMT_ASSERT_OK(nmt_scaling_predict(&p, Ns[i], &link, &q));
    NMT_ASSERT_NEAR(q.allreduce_ms, t[i], 1e-12);
    NMT_ASSERT_NEAR(q.exposed_ms, t[i], 1e-12);
    NMT_ASSERT_NEAR(q.comm_end_ms, 25 + t[i], 1e-12);
    NMT_ASSERT_NEAR(q.step_ms, 28 + t[i], 1e-12);
  }
  nmt_scaling_pred q1;
  NMT_ASSERT_OK(nmt_scaling_predict(&p, 1, &link, &q1));
  NMT_ASSERT_NEAR(q1.step_ms, 28, 0); /* one device: nothing to reduce, no latency */
}

NMT_TEST(scaling_early_buckets_leave_last) {
  /* N = 2, 10 GB/s, no latency: t_b = bytes / 1e7 ms = 1, 1, 1, 2. Ready at 1, 2, 3 and at
   * the backward's end (10): the stream runs [1,2] [2,3] [3,4] and [10,12]: exposed 2 = t_last. */
  const double bytes[] = {10e6, 10e6, 10e6, 20e6}, ready[] = {1, 2, 3, 10};
  nmt_scaling_profile p = {.fwd_ms = 4, .bwd_ms = 6, .opt_ms = 0.5, .n_buckets = 4,
                           .bytes = bytes, .ready_ms = ready};
  nmt_scaling_link link = {.busbw_gbs = 10, .latency_us = 0};
  nmt_scaling_pred q;
  NMT_ASSERT_OK(nmt_scaling_predict(&p, 2, &link, &q));
  NMT_ASSERT_NEAR(q.allreduce_ms, 5, 1e-12);
  NMT_ASSERT_NEAR(q.comm_end_ms, 12, 1e-12);
  NMT_ASSERT_NEAR(q.exposed_ms, 2, 1e-12);
  NMT_ASSERT_NEAR(q.step_ms, 12.5, 1e-12);
  /* Backed up: all ready at 9.5, the stream runs [9.5,10.5] .. [12.5,14.5]: exposed 4.5. */
  const double late[] = {9.5, 9.5, 9.5, 10};
  p.ready_ms = late;
  NMT_ASSERT_OK(nmt_scaling_predict(&p, 2, &link, &q));
  NMT_ASSERT_NEAR(q.comm_end_ms, 14.5, 1e-12);
  NMT_ASSERT_NEAR(q.exposed_ms, 4.5, 1e-12);
  /* Serial (CPU workers today): every all-reduce delays compute, exposed = 5. */
  link.serial = 1;
  NMT_ASSERT_OK(nmt_scaling_predict(&p, 2, &link, &q));
  NMT_ASSERT_NEAR(q.exposed_ms, 5, 1e-12);
  NMT_ASSERT_NEAR(q.step_ms, 15.5, 1e-12);
}

NMT_TEST(scaling_predict_rejects_bad_profiles) {
  const double bytes[] = {1e6, 1e6}, ready[] = {3, 2}, beyond[] = {1, 12};
  nmt_scaling_profile p = {.fwd_ms = 4, .bwd_ms = 6, .opt_ms = 1, .n_buckets = 2,
                           .bytes = bytes, .ready_ms = ready};
  nmt_scaling_link link = {.busbw_gbs = 10, .latency_us = 0};
  nmt_scaling_pred q;
  NMT_ASSERT_EQ_STATUS(nmt_scaling_predict(&p, 2, &link, &q), NMT_ERR_USAGE);
  p.ready_ms = beyond;
  NMT_ASSERT_EQ_STATUS(nmt_scaling_predict(&p, 2, &link, &q), NMT_ERR_USAGE);
  p.ready_ms = ready;
  p.n_buckets = 1;
  NMT_ASSERT_OK(nmt_scaling_predict(&p, 2, &link, &q));
  NMT_ASSERT_EQ_STATUS(nmt_scaling_predict(&p, 0, &link, &q), NMT_ERR_USAGE);
  link.latency_us = -1;
  NMT_ASSERT_EQ_STATUS(nmt_scaling_predict(&p, 2, &link, &q), NMT_ERR_USAGE);
}

NMT_TEST(scaling_buckets_as_trainer) {
  /* 1000 params + 4 slots; events after 100, 600 and all 1004 floats. */
  const size_t floats[] = {100, 600, 1004};
  const double at[] = {1.0, 2.0, 3.0};
  double bytes[2000], ready[2000];
  int n = 0;
  /* 300 floats per bucket: [0,300) [300,600) ready with event 1; [600,900) [900,1004) with 2. */
  NMT_ASSERT_OK(nmt_scaling_buckets(1004, floats, at, 3, 300.0 * 4 / 1048576, bytes, ready,
                                    2000, &n));
  NMT_ASSERT_EQ_INT(n, 4);
  const double want_bytes[] = {1200, 1200, 1200, 416}, want_ready[] = {2, 2, 3, 3};
  for (int b = 0; b < 4; b++) {
    NMT_ASSERT_NEAR(bytes[b], want_bytes[b], 0);
    NMT_ASSERT_NEAR(ready[b], want_ready[b], 0);
  }
  /* Larger than the gradient: one bucket of everything, ready at the end. */
  NMT_ASSERT_OK(nmt_scaling_buckets(1004, floats, at, 3, 25, bytes, ready, 2000, &n));
  NMT_ASSERT_EQ_INT(n, 1);
  NMT_ASSERT_NEAR(bytes[0], 4016, 0);
  NMT_ASSERT_NEAR(ready[0], 3, 0);
  /* Below one float: one float per bucket (the trainer's floor). */
  NMT_ASSERT_OK(nmt_scaling_buckets(1004, floats, at, 3, 1e-9, bytes, ready, 2000, &n));
  NMT_ASSERT_EQ_INT(n, 1004);
  NMT_ASSERT_NEAR(ready[99], 1, 0);
  NMT_ASSERT_NEAR(ready[100], 2, 0);
  NMT_ASSERT_NEAR(ready[1003], 3, 0);
  NMT_ASSERT_EQ_STATUS(nmt_scaling_buckets(1004, floats, at, 3, 1e-9, bytes, ready, 100, &n),
                       NMT_ERR_USAGE);
  /* Events that never cover the gradient. */
  NMT_ASSERT_EQ_STATUS(nmt_scaling_buckets(2000, floats, at, 3, 25, bytes, ready, 2000, &n),
                       NMT_ERR_USAGE);
}

NMT_TEST(scaling_best_is_argmin) {
  /* Synthetic backward of 100 ms over 64 layers of 1 MiB each, the last 8 MiB (an embedding)
   * final only at the end; the model's trade-off: small buckets pay latency, big ones expose. */
  enum { L = 64 };
  size_t floats[L + 1];
  double at[L + 1];
  const size_t mib = 1048576 / 4;
  for (int l = 0; l < L; l++) floats[l] = (size_t)(l + 1) * mib, at[l] = 20 + 100.0 * (l + 1) / (L + 1);
  floats[L] = (size_t)L * mib + 8 * mib, at[L] = 120;
  const double sizes[] = {0.25, 1, 2, 5, 10, 25, 50, 100};
  double bytes[8][600], ready[8][600];
  int nb[8];
  nmt_scaling_pred pred[8];
  nmt_scaling_link link = {.busbw_gbs = 5, .latency_us = 500};
  for (int N = 2; N <= 8; N *= 2) {
    for (int i = 0; i < 8; i++) {
      NMT_ASSERT_OK(nmt_scaling_buckets(floats[L], floats, at, L + 1, sizes[i], bytes[i], ready[i],
                                        600, &nb[i]));
      nmt_scaling_profile p = {.fwd_ms = 20, .bwd_ms = 100, .opt_ms = 5, .n_buckets = nb[i],
                               .bytes = bytes[i], .ready_ms = ready[i]};
      NMT_ASSERT_OK(nmt_scaling_predict(&p, N, &link, &pred[i]));
    }
    int want = 0;
    for (int i = 1; i < 8; i++)
      if (pred[i].step_ms < pred[want].step_ms) want = i;
    NMT_ASSERT_EQ_INT(nmt_scaling_best(pred, 8), want);
    /* The trade-off is real here: neither extreme wins. */
    NMT_ASSERT(want != 0 && want != 7);
  }
  nmt_scaling_pred q[4] = {{.step_ms = 5}, {.step_ms = 3}, {.step_ms = 3}, {.step_ms = 4}};
  NMT_ASSERT_EQ_INT(nmt_scaling_best(q, 4), 1);
  NMT_ASSERT_EQ_INT(nmt_scaling_best(q, 0), -1);
}

/* ---- the measurement on a tiny model ----------------------------------------------------- */

NMT_TEST(scaling_measure_tiny_model) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], ini[512], out[512];
  snprintf(shard, sizeof shard, "%s/train.shard", dir);
  snprintf(ini, sizeof ini, "%s/tiny.ini", dir);
  snprintf(out, sizeof out, "%s/run", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 200, 3));
  NMT_ASSERT_EQ_INT(nmt_th_write_ini(ini, out, shard, 10, NULL), 0);
  const char *accum2[] = {"train.accum_steps=2"};
  nmt_config cfg;
  NMT_ASSERT_OK(nmt_config_load(ini, accum2, 1, &cfg));
  nmt_scaling_measurement *m = malloc(sizeof *m);
  const int warmup = 1, steps = 2;
  nmt_status s = nmt_scaling_measure(&cfg, warmup, steps, m);
  if (s != NMT_OK) free(m);
  NMT_ASSERT_OK(s);
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(&cfg, &mc);
  size_t total = nmt_model_num_params(&mc) + NMT_GRAD_EXTRA;
  int ok = m->total_floats == total && m->n_events >= 2 &&
           m->ready_floats[m->n_events - 1] == total && m->accum == 2 && m->fwd_ms > 0 &&
           m->bwd_ms > 0;
  for (int k = 1; k < m->n_events; k++)
    ok &= m->ready_floats[k] > m->ready_floats[k - 1] && m->ready_ms[k] >= m->ready_ms[k - 1];
  /* The events come from the last micro-batch's backward: after both forwards and the first
   * backward began (at least the first forward's time in). */
  ok &= m->ready_ms[0] > 0 && m->ready_ms[m->n_events - 1] <= m->fwd_ms + m->bwd_ms;
  /* Tokens: the batcher's epoch-0 batches warmup*2 .. (warmup+steps)*2, independently. */
  nmt_shard *sh;
  nmt_batcher *b;
  NMT_ASSERT_OK(nmt_shard_open(shard, 0, &sh));
  NMT_ASSERT_OK(nmt_batcher_create(sh, cfg.data_max_tokens, cfg.data_max_len, cfg.run_seed, &b));
  double tokens = 0;
  for (int k = warmup * 2; k < (warmup + steps) * 2; k++) {
    int ns, sl, tl;
    long tt;
    nmt_batcher_shape(b, nmt_batcher_order(b, 0, k % nmt_batcher_num_batches(b)), &ns, &sl, &tl, &tt);
    tokens += (double)tt;
  }
  nmt_batcher_destroy(b);
  nmt_shard_close(sh);
  double got_tokens = m->tokens;
  free(m);
  NMT_ASSERT(ok);
  NMT_ASSERT_NEAR(got_tokens, tokens / steps, 1e-9);
}

/* ---- the CLI ------------------------------------------------------------------------------ */

/* Runs build/nmt with `args`, stdout and stderr into `text`; returns the exit code. */
static int run_nmt_all(const char *args, char *text, size_t n) {
  char cmd[4200];
  snprintf(cmd, sizeof cmd, "%s/nmt %s 2>&1", nmt_test_build_dir(), args);
  return nmt_th_capture(cmd, text, n);
}

NMT_TEST(bench_cli_bad_arguments_exit_2) {
  char *text = malloc(1 << 16);
  NMT_ASSERT(text != NULL);
  int rc = run_nmt_all("bench allreduce parallel.devices=abc", text, 1 << 16);
  int named = strstr(text, "devices") && strstr(text, "abc");
  int rc2 = run_nmt_all("bench allreduce nosuch.key=1", text, 1 << 16);
  int rc3 = run_nmt_all("bench allreduce --max-bytes 12Q", text, 1 << 16);
  int rc4 = run_nmt_all("bench allreduce conf/bible-small.ini parallel.devices=0", text, 1 << 16);
  int rc5 = run_nmt_all("bench frobnicate", text, 1 << 16);
  int rc6 = run_nmt_all("bench scaling", text, 1 << 16);
  int rc7 = run_nmt_all("bench scaling conf/bible-small.ini --mfu 0.5", text, 1 << 16);
  int rc8 = run_nmt_all("bench scaling conf/bible-small.ini --preset h100", text, 1 << 16);
  int rc9 = run_nmt_all("bench scaling conf/bible-small.ini --busbw -3", text, 1 << 16);
  int usage = strstr(text, "nmt bench scaling CONFIG") != NULL;
  int rc10 = run_nmt_all("bench allreduce --op allgather", text, 1 << 16);
  int op_named = strstr(text, "--op takes allreduce, reduce_scatter, all_gather or all") != NULL;
  free(text);
  NMT_ASSERT_EQ_INT(rc, 2);
  NMT_ASSERT(named);
  NMT_ASSERT_EQ_INT(rc2, 2);
  NMT_ASSERT_EQ_INT(rc3, 2);
  NMT_ASSERT_EQ_INT(rc4, 2);
  NMT_ASSERT_EQ_INT(rc5, 2);
  NMT_ASSERT_EQ_INT(rc6, 2);
  NMT_ASSERT_EQ_INT(rc7, 2);
  NMT_ASSERT_EQ_INT(rc8, 2);
  NMT_ASSERT_EQ_INT(rc9, 2);
  NMT_ASSERT(usage);
  NMT_ASSERT_EQ_INT(rc10, 2);
  NMT_ASSERT(op_named);
}

/* --op all: three tables (all_reduce_perf, reduce_scatter_perf, all_gather_perf), each ending
 * "0 OK", and JSON rows tagged with their op (3 sizes each up to 4 KiB; the reduce-scatter's
 * and all-gather's rounded down to 3 x 4 B: 1020, 2040, 4092 B). */
NMT_TEST(bench_cli_allreduce_op_all) {
  const char *dir = nmt_test_tmpdir();
  char args[1024], *text = malloc(1 << 16), jsonl[512];
  NMT_ASSERT(text != NULL);
  snprintf(jsonl, sizeof jsonl, "%s/rows_ops.jsonl", dir);
  snprintf(args, sizeof args, "bench allreduce parallel.devices=3 --max-bytes 4K --op all "
           "--jsonl %s", jsonl);
  int rc = run_nmt_all(args, text, 1 << 16);
  int oks = 0;
  for (char *p = text; (p = strstr(p, "Out of bounds values : 0 OK")); p++) oks++;
  int titles = strstr(text, "all_reduce_perf style") && strstr(text, "reduce_scatter_perf style") &&
               strstr(text, "all_gather_perf style") &&
               strstr(text, "        4092          1023     float    none");
  char *rows = nmt_th_read_file(jsonl, NULL);
  int per_op[3] = {0}, zero = 0, rs_first = 0;
  const char *tags[3] = {"\"op\": \"all_reduce\"", "\"op\": \"reduce_scatter\"",
                         "\"op\": \"all_gather\""};
  for (int k = 0; k < 3; k++)
    for (char *p = rows; p && (p = strstr(p, tags[k])); p++) per_op[k]++;
  for (char *p = rows; p && (p = strstr(p, "\"wrong\": 0,")); p++) zero++;
  rs_first = rows && strstr(rows, "\"size_bytes\": 1020, \"count\": 255, \"rank_count\": 85,");
  free(rows);
  if (rc != 0 || oks != 3 || !titles) printf("# %s\n", text);
  free(text);
  NMT_ASSERT_EQ_INT(rc, 0);
  NMT_ASSERT_EQ_INT(oks, 3);
  NMT_ASSERT(titles);
  for (int k = 0; k < 3; k++) NMT_ASSERT_EQ_INT(per_op[k], 3);
  NMT_ASSERT_EQ_INT(zero, 9);
  NMT_ASSERT(rs_first);
}

NMT_TEST(bench_cli_allreduce_sweep) {
  const char *dir = nmt_test_tmpdir();
  char args[1024], *text = malloc(1 << 16), jsonl[512];
  NMT_ASSERT(text != NULL);
  snprintf(jsonl, sizeof jsonl, "%s/rows.jsonl", dir);
  snprintf(args, sizeof args, "bench allreduce parallel.devices=3 --max-bytes 4K --jsonl %s",
           jsonl);
  int rc = run_nmt_all(args, text, 1 << 16);
  int table = strstr(text, "#wrong") && strstr(text, "Avg bus bandwidth") &&
              strstr(text, "Out of bounds values : 0 OK");
  char *rows = nmt_th_read_file(jsonl, NULL);
  int lines = 0, zero = 0;
  for (char *p = rows; p && (p = strstr(p, "\"bench\": \"allreduce\"")); p++) lines++;
  for (char *p = rows; p && (p = strstr(p, "\"wrong\": 0,")); p++) zero++;
  free(rows);
  if (rc != 0 || !table) printf("# %s\n", text);
  free(text);
  NMT_ASSERT_EQ_INT(rc, 0);
  NMT_ASSERT(table);
  NMT_ASSERT_EQ_INT(lines, 3); /* 1K, 2K, 4K */
  NMT_ASSERT_EQ_INT(zero, 3);
}

/* parallel.grad_dtype picks the wire type: the table's type column and the JSON rows say
 * "half", a size counts 2-byte elements (1024 B = 512 elements). */
NMT_TEST(bench_cli_allreduce_grad_dtype) {
  const char *dir = nmt_test_tmpdir();
  char args[1024], *text = malloc(1 << 16), jsonl[512];
  NMT_ASSERT(text != NULL);
  snprintf(jsonl, sizeof jsonl, "%s/rows_half.jsonl", dir);
  snprintf(args, sizeof args, "bench allreduce parallel.devices=3 parallel.grad_dtype=fp16 precision.mode=fp16 "
           "--max-bytes 4K --jsonl %s", jsonl);
  int rc = run_nmt_all(args, text, 1 << 16);
  int table = strstr(text, "Out of bounds values : 0 OK") && strstr(text, "sum in half") &&
              strstr(text, "        1024           512      half     sum") &&
              !strstr(text, "     float ");
  char *rows = nmt_th_read_file(jsonl, NULL);
  int half = 0, floats = 0, zero = 0;
  for (char *p = rows; p && (p = strstr(p, "\"type\": \"half\"")); p++) half++;
  for (char *p = rows; p && (p = strstr(p, "\"type\": \"float\"")); p++) floats++;
  for (char *p = rows; p && (p = strstr(p, "\"wrong\": 0,")); p++) zero++;
  int first = rows && strstr(rows, "\"size_bytes\": 1024, \"count\": 512,") != NULL;
  free(rows);
  if (rc != 0 || !table) printf("# %s\n", text);
  free(text);
  NMT_ASSERT_EQ_INT(rc, 0);
  NMT_ASSERT(table);
  NMT_ASSERT_EQ_INT(half, 3); /* 1K, 2K, 4K */
  NMT_ASSERT_EQ_INT(floats, 0);
  NMT_ASSERT_EQ_INT(zero, 3);
  NMT_ASSERT(first);
}

/* `nmt bench scaling` on a tiny synthetic model with a declared link; `extra` is appended to
 * the command line. Returns the exit code, the output in text (cap bytes). */
static int scaling_cli(const char *extra, char *text, size_t cap) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], ini[512], out[512], args[2048];
  snprintf(shard, sizeof shard, "%s/train.shard", dir);
  snprintf(ini, sizeof ini, "%s/tiny.ini", dir);
  snprintf(out, sizeof out, "%s/run", dir);
  if (nmt_th_write_synthetic(shard, 100, 4) != NMT_OK) return -1;
  if (nmt_th_write_ini(ini, out, shard, 10, NULL) != 0) return -1;
  snprintf(args, sizeof args, "bench scaling %s --busbw 5 --latency-us 10 --steps 1 --warmup 0 "
           "%s", ini, extra);
  return run_nmt_all(args, text, cap);
}

NMT_TEST(bench_cli_scaling_tiny) {
  char *text = malloc(1 << 16);
  NMT_ASSERT(text != NULL);
  int rc = scaling_cli("--max-devices 3", text, 1 << 16);
  int ok = strstr(text, "declared on the command line") && strstr(text, "efficiency") &&
           strstr(text, "\n   3 ") && !strstr(text, "\n   4 ");
  if (rc != 0 || !ok) printf("# %s\n", text);
  free(text);
  NMT_ASSERT_EQ_INT(rc, 0);
  NMT_ASSERT(ok);
}

/* parallel.grad_dtype = bf16: the model sends 2 bytes per gradient (plus the 4 fp32 slots). */
NMT_TEST(bench_cli_scaling_half_wire_bytes) {
  char *text = malloc(1 << 16);
  NMT_ASSERT(text != NULL);
  int rc = scaling_cli("--max-devices 2 parallel.grad_dtype=bf16", text, 1 << 16);
  double bytes = 0;
  long params = 0;
  const char *line = strstr(text, "gradient bytes per step");
  int got = line ? sscanf(line, "gradient bytes per step %lf B %ld parameters in bfloat16",
                          &bytes, &params) : 0;
  if (rc != 0 || got != 2) printf("# %s\n", text);
  free(text);
  NMT_ASSERT_EQ_INT(rc, 0);
  NMT_ASSERT_EQ_INT(got, 2);
  NMT_ASSERT(params > 1000);
  NMT_ASSERT(bytes == 2.0 * (double)params + 16.0);
}

/* ---- issue 19: the CPU reference measures small batches and extrapolates ------------------- */

/* nmt_scaling_extrapolate: tokens and FLOPs become those of the config's own batches (counted
 * here independently), compute scales as documented, the update stays. */
NMT_TEST(scaling_extrapolate_to_config_batch) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], ini[512], out[512];
  snprintf(shard, sizeof shard, "%s/train.shard", dir);
  snprintf(ini, sizeof ini, "%s/tiny.ini", dir);
  snprintf(out, sizeof out, "%s/run", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 200, 3));
  NMT_ASSERT_EQ_INT(nmt_th_write_ini(ini, out, shard, 10, NULL), 0);
  const char *full_ov[] = {"train.accum_steps=3", "data.max_tokens=96"};
  const char *small_ov[] = {"train.accum_steps=1", "data.max_tokens=32"};
  nmt_config full, small;
  NMT_ASSERT_OK(nmt_config_load(ini, full_ov, 2, &full));
  NMT_ASSERT_OK(nmt_config_load(ini, small_ov, 2, &small));
  nmt_scaling_measurement *m = malloc(sizeof *m);
  NMT_ASSERT(m != NULL);
  const int warmup = 1, steps = 2;
  nmt_status s = nmt_scaling_measure(&small, warmup, steps, m);
  nmt_scaling_measurement before = *m;
  if (s == NMT_OK) s = nmt_scaling_extrapolate(&full, m);
  nmt_scaling_measurement after = *m;
  free(m);
  NMT_ASSERT_OK(s);
  /* The config's batches at steps 2..3: micro-batches 3..8 of the epoch-0 order. */
  nmt_shard *sh;
  nmt_batcher *b;
  NMT_ASSERT_OK(nmt_shard_open(shard, 0, &sh));
  NMT_ASSERT_OK(nmt_batcher_create(sh, 96, full.data_max_len, full.run_seed, &b));
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(&full, &mc);
  double tokens = 0, flops = 0;
  for (int k = warmup * 3; k < (warmup + steps) * 3; k++) {
    int ns, sl, tl;
    long tt;
    nmt_batcher_shape(b, nmt_batcher_order(b, 0, k % nmt_batcher_num_batches(b)), &ns, &sl, &tl,
                      &tt);
    tokens += (double)tt;
    flops += nmt_model_train_flops(&mc, ns, sl, tl);
  }
  nmt_batcher_destroy(b);
  nmt_shard_close(sh);
  NMT_ASSERT_NEAR(after.tokens, tokens / steps, 1e-9);
  NMT_ASSERT_NEAR(after.flops / (flops / steps), 1.0, 1e-12);
  NMT_ASSERT_EQ_INT(after.accum, 3);
  NMT_ASSERT_EQ_INT(after.measured_max_tokens, 32);
  NMT_ASSERT_EQ_INT(after.measured_accum, 1);
  const double r = after.flops / 3 / before.flops;
  NMT_ASSERT_NEAR(after.extrapolated, r, 1e-12);
  NMT_ASSERT(r > 1.5); /* 96-token micro-batches against 32-token ones */
  NMT_ASSERT_NEAR(after.fwd_ms, 3 * r * before.fwd_ms, 1e-9 * after.fwd_ms);
  NMT_ASSERT_NEAR(after.bwd_ms, 3 * r * before.bwd_ms, 1e-9 * after.bwd_ms);
  NMT_ASSERT_NEAR(after.opt_ms, before.opt_ms, 0);
  const double c = before.fwd_ms + before.bwd_ms;
  for (int k = 0; k < after.n_events; k++)
    NMT_ASSERT_NEAR(after.ready_ms[k], 2 * r * c + r * before.ready_ms[k], 1e-9 * after.fwd_ms);
  NMT_ASSERT(after.ready_ms[after.n_events - 1] <= after.fwd_ms + after.bwd_ms + 1e-9);
  /* Only a one-micro-batch measurement extrapolates. */
  nmt_scaling_measurement *m2 = malloc(sizeof *m2);
  NMT_ASSERT(m2 != NULL);
  *m2 = after;
  s = nmt_scaling_extrapolate(&full, m2);
  free(m2);
  NMT_ASSERT_EQ_STATUS(s, NMT_ERR_USAGE);
}

/* Issue 19: `bench scaling conf/base.ini` printed nothing for minutes on a CPU. Now progress
 * lines on stderr, and by default on the CPU reference 1 warmup + 2 timed steps of one small
 * micro-batch, extrapolated, which the report's header says. */
NMT_TEST(bench_cli_scaling_cpu_progress_and_small_batches) {
  char *text = malloc(1 << 16);
  NMT_ASSERT(text != NULL);
  const char *dir = nmt_test_tmpdir();
  char shard[512], ini[512], out[512], args[2048];
  snprintf(shard, sizeof shard, "%s/train.shard", dir);
  snprintf(ini, sizeof ini, "%s/tiny.ini", dir);
  snprintf(out, sizeof out, "%s/run", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 100, 4));
  NMT_ASSERT_EQ_INT(nmt_th_write_ini(ini, out, shard, 10, NULL), 0);
  snprintf(args, sizeof args, "bench scaling %s --busbw 5 --latency-us 10 --max-devices 2 "
           "parallel.device=cpu train.accum_steps=2 --max-tokens 32", ini);
  int rc = run_nmt_all(args, text, 1 << 16);
  int ok = strstr(text, "measuring step 1/3 (warmup): forward 1/1") &&
           strstr(text, "measuring step 3/3 (timed): update") &&
           strstr(text, "micro-batches of at most 32 padded tokens, 1 per step, instead of "
                        "data.max_tokens = 64 x train.accum_steps = 2") &&
           strstr(text, "2 timed steps after 1 warmup");
  if (rc != 0 || !ok) printf("# %s\n", text);
  /* --max-tokens -1: the config's batch, no extrapolation; --steps/--warmup as given. */
  snprintf(args, sizeof args, "bench scaling %s --busbw 5 --latency-us 10 --max-devices 2 "
           "train.accum_steps=2 --max-tokens -1 --steps 1 --warmup 0", ini);
  int rc2 = run_nmt_all(args, text, 1 << 16);
  int ok2 = strstr(text, "measuring step 1/1 (timed): forward 2/2") &&
            !strstr(text, "smaller batches") && strstr(text, "1 timed steps after 0 warmup");
  if (rc2 != 0 || !ok2) printf("# %s\n", text);
  free(text);
  NMT_ASSERT_EQ_INT(rc, 0);
  NMT_ASSERT(ok);
  NMT_ASSERT_EQ_INT(rc2, 0);
  NMT_ASSERT(ok2);
}

/* ---- issues 17 and 18: ZeRO's collectives, per-GPU memory, several nodes ------------------- */

/* One collective's time, within one node and across nodes, against hand-computed values. */
NMT_TEST(scaling_collective_one_node_and_nodes) {
  /* One node, 10 GB/s, 20 us: bytes x f / 1e7 ms + 0.02; f = 1.5 (all-reduce) or 0.75. */
  nmt_scaling_link one = {.busbw_gbs = 10, .latency_us = 20};
  NMT_ASSERT_NEAR(nmt_scaling_collective_ms(&one, NMT_BENCH_ALLREDUCE, 4, 40e6), 6.02, 1e-12);
  NMT_ASSERT_NEAR(nmt_scaling_collective_ms(&one, NMT_BENCH_REDUCE_SCATTER, 4, 40e6), 3.02, 1e-12);
  NMT_ASSERT_NEAR(nmt_scaling_collective_ms(&one, NMT_BENCH_ALL_GATHER, 4, 40e6), 3.02, 1e-12);
  NMT_ASSERT_NEAR(nmt_scaling_collective_ms(&one, NMT_BENCH_ALLREDUCE, 1, 40e6), 0, 0);
  NMT_ASSERT(isnan(nmt_scaling_collective_ms(&one, NMT_BENCH_ALL_OPS, 4, 40e6)));
  /* Ring over 2 nodes of 4 GPUs, network 5 GB/s (slower than the node's 10), 10 us per network
   * step, 5 us per step inside a node: latency 0.02 + 2 x 1 x (10 + 3 x 5) us = 0.07 ms, then
   * 40e6 x 2(7/8) / 5e6 = 14 ms. */
  nmt_scaling_link two = {.busbw_gbs = 10, .latency_us = 20, .nodes = 2, .gpus_per_node = 4,
                          .net_busbw_gbs = 5, .net_step_us = 10, .intra_step_us = 5,
                          .algo = NMT_SCALING_RING};
  NMT_ASSERT_NEAR(nmt_scaling_collective_ms(&two, NMT_BENCH_ALLREDUCE, 8, 40e6), 14.07, 1e-9);
  /* Reduce-scatter: one pass, 0.02 + 0.025 ms + 40e6 x 7/8 / 5e6 = 7 ms. */
  NMT_ASSERT_NEAR(nmt_scaling_collective_ms(&two, NMT_BENCH_REDUCE_SCATTER, 8, 40e6), 7.045,
                  1e-9);
  /* A network faster than the node: the node's 10 GB/s paces the ring (40e6 x 1.75 / 1e7). */
  two.net_busbw_gbs = 20;
  NMT_ASSERT_NEAR(nmt_scaling_collective_ms(&two, NMT_BENCH_ALLREDUCE, 8, 40e6), 7.07, 1e-9);
  /* 4 nodes: latency 0.02 + 2 x 3 x 25 us = 0.17 ms, 40e6 x 2(15/16) / 5e6 = 15 ms. */
  nmt_scaling_link four = two;
  four.nodes = 4, four.net_busbw_gbs = 5;
  NMT_ASSERT_NEAR(nmt_scaling_collective_ms(&four, NMT_BENCH_ALLREDUCE, 16, 40e6), 15.17, 1e-9);
  /* Two-level: 0.02 + 2(K-1) x 10 us, reduce-scatter and all-gather in the node 2 x 40e6 x 3/4
   * / 1e7 = 6 ms, across 40e6 x 2(K-1)/K / 5e6: K = 2: 8 ms; K = 4: 12 ms. */
  two.net_busbw_gbs = 5, two.algo = NMT_SCALING_TWO_LEVEL;
  four.algo = NMT_SCALING_TWO_LEVEL;
  NMT_ASSERT_NEAR(nmt_scaling_collective_ms(&two, NMT_BENCH_ALLREDUCE, 8, 40e6), 14.04, 1e-9);
  NMT_ASSERT_NEAR(nmt_scaling_collective_ms(&four, NMT_BENCH_ALLREDUCE, 16, 40e6), 18.08, 1e-9);
  /* The two-level model is for the all-reduce; the others take the ring. */
  NMT_ASSERT_NEAR(nmt_scaling_collective_ms(&two, NMT_BENCH_REDUCE_SCATTER, 8, 40e6), 7.045,
                  1e-9);
  /* Devices that are not nodes x GPUs per node. */
  NMT_ASSERT(isnan(nmt_scaling_collective_ms(&two, NMT_BENCH_ALLREDUCE, 7, 40e6)));
  /* An unlimited network: the node's busbw alone. */
  two.algo = NMT_SCALING_RING, two.net_busbw_gbs = 0;
  NMT_ASSERT_NEAR(nmt_scaling_collective_ms(&two, NMT_BENCH_ALLREDUCE, 8, 40e6), 7.07, 1e-9);
  /* The step model refuses a device count the nodes cannot hold. */
  const double bytes[] = {1e6}, ready[] = {3};
  nmt_scaling_profile p = {.fwd_ms = 1, .bwd_ms = 2, .n_buckets = 1, .bytes = bytes,
                           .ready_ms = ready};
  nmt_scaling_pred q;
  NMT_ASSERT_EQ_STATUS(nmt_scaling_predict(&p, 6, &two, &q), NMT_ERR_USAGE);
  NMT_ASSERT_OK(nmt_scaling_predict(&p, 8, &two, &q));
  NMT_ASSERT_NEAR(q.exposed_ms, nmt_scaling_collective_ms(&two, NMT_BENCH_ALLREDUCE, 8, 1e6),
                  1e-12);
}

/* ZeRO 1 and 2 against a hand count: two buckets, reduce-scatters on the comm stream, the
 * slots' all-reduce, the norm, the all-gathers after the update. */
NMT_TEST(scaling_zero_stages_hand_count) {
  const double bytes[] = {8e6, 8e6}, ready[] = {20, 30}, gather[] = {16e6, 16e6};
  nmt_scaling_profile p = {.fwd_ms = 10, .bwd_ms = 20, .opt_ms = 2, .n_buckets = 2,
                           .bytes = bytes, .ready_ms = ready};
  nmt_scaling_link link = {.busbw_gbs = 10, .latency_us = 10};
  const double lat = 0.01;
  /* zero 0: all-reduce 0.01 + 8e6 / 1e7 each; the last ends at 30.81, exposed 0.81. */
  nmt_scaling_zero z = {.zero = 0, .accum = 1};
  nmt_scaling_pred q;
  NMT_ASSERT_OK(nmt_scaling_predict_zero(&p, 2, &link, &z, &q));
  NMT_ASSERT_NEAR(q.exposed_ms, 0.81, 1e-12);
  NMT_ASSERT_NEAR(q.step_ms, 32.81, 1e-12);
  NMT_ASSERT_NEAR(q.gather_ms + q.norm_ms, 0, 0);
  /* zero 1, N = 2: reduce-scatter 0.01 + 8e6 x 1/2 / 1e7 = 0.41; the slots (16 B) after the
   * last bucket; norm (4 B); all-gathers of 16e6 fp32 bytes per bucket (a 16-bit working copy
   * is cast locally, not gathered). */
  const double rs = lat + 8e6 * 0.5 / 1e7, slots = lat + 16 * 1.0 / 1e7;
  const double norm = lat + 4 * 1.0 / 1e7;
  const double ag = 2 * (lat + 16e6 * 0.5 / 1e7);
  z = (nmt_scaling_zero){.zero = 1, .accum = 1, .gather_bytes = gather};
  NMT_ASSERT_OK(nmt_scaling_predict_zero(&p, 2, &link, &z, &q));
  NMT_ASSERT_NEAR(q.allreduce_ms, 2 * rs + slots, 1e-12);
  NMT_ASSERT_NEAR(q.comm_end_ms, 30 + rs + slots, 1e-12);
  NMT_ASSERT_NEAR(q.exposed_ms, rs + slots, 1e-12);
  NMT_ASSERT_NEAR(q.norm_ms, norm, 1e-12);
  NMT_ASSERT_NEAR(q.gather_ms, ag, 1e-12);
  NMT_ASSERT_NEAR(q.opt_ms, 2, 0);
  NMT_ASSERT_NEAR(q.step_ms, 30 + rs + slots + norm + 2 + ag, 1e-12);
  /* One device: nothing to reduce or gather (the engine skips every collective). */
  NMT_ASSERT_OK(nmt_scaling_predict_zero(&p, 1, &link, &z, &q));
  NMT_ASSERT_NEAR(q.step_ms, 32, 0);
  /* zero 2, accum 2, period 15: the first micro-batch's buckets at 5 and 15 finish long before
   * the second's, so the exposed part is zero 1's; twice the reduce-scatters. */
  z = (nmt_scaling_zero){.zero = 2, .accum = 2, .period_ms = 15, .gather_bytes = gather};
  NMT_ASSERT_OK(nmt_scaling_predict_zero(&p, 2, &link, &z, &q));
  NMT_ASSERT_NEAR(q.allreduce_ms, 2 * (2 * rs + slots), 1e-12);
  NMT_ASSERT_NEAR(q.exposed_ms, rs + slots, 1e-12);
  /* Buckets of 80e6 bytes (4.01 ms each) with micro-batches 1 ms apart back up the stream:
   * [19, 23.01] [29, 33.01] slots; [start, +4.01] x 2 slots, the second pass waiting. */
  const double big[] = {80e6, 80e6}, t = lat + 80e6 * 0.5 / 1e7;
  p.bytes = big;
  z.period_ms = 1;
  NMT_ASSERT_OK(nmt_scaling_predict_zero(&p, 2, &link, &z, &q));
  double end = 29 + t + slots;         /* first pass */
  end = (end > 20 ? end : 20) + t;     /* second pass, bucket 0 (ready at 20) */
  end = (end > 30 ? end : 30) + t + slots;
  NMT_ASSERT_NEAR(q.comm_end_ms, end, 1e-12);
  NMT_ASSERT_NEAR(q.exposed_ms, end - 30, 1e-12);
  /* Serial: every collective on the compute thread. */
  link.serial = 1;
  NMT_ASSERT_OK(nmt_scaling_predict_zero(&p, 2, &link, &z, &q));
  NMT_ASSERT_NEAR(q.exposed_ms, 4 * t + 2 * slots, 1e-12);
  /* Refused: a stage outside 0..2, no micro-batch, a sharded stage without gather sizes. */
  link.serial = 0;
  z.zero = 3;
  NMT_ASSERT_EQ_STATUS(nmt_scaling_predict_zero(&p, 2, &link, &z, &q), NMT_ERR_USAGE);
  z.zero = 1, z.accum = 0;
  NMT_ASSERT_EQ_STATUS(nmt_scaling_predict_zero(&p, 2, &link, &z, &q), NMT_ERR_USAGE);
  z.accum = 1, z.gather_bytes = NULL;
  NMT_ASSERT_EQ_STATUS(nmt_scaling_predict_zero(&p, 2, &link, &z, &q), NMT_ERR_USAGE);
}

/* The sharded plan's buckets: padded to n_ranks x 16 floats, ready when their parameters are. */
NMT_TEST(scaling_buckets_sharded_plan) {
  const size_t floats[] = {100, 600, 1004};
  const double at[] = {1.0, 2.0, 3.0};
  double bytes[64], ready[64];
  int n = 0;
  /* 300 floats round up to 320 (2 ranks x 16); 1000 parameters: 3 x 320 + 40, padded to 64. */
  nmt_bucket_plan plan;
  NMT_ASSERT_OK(nmt_bucket_plan_make_sharded(300.0 * 4 / 1048576, 1000, 2, 1, 0, &plan));
  NMT_ASSERT_OK(nmt_scaling_buckets_plan(&plan, floats, at, 3, bytes, ready, 64, &n));
  NMT_ASSERT_EQ_INT(n, 4);
  const double want_bytes[] = {1280, 1280, 1280, 256}, want_ready[] = {2, 3, 3, 3};
  for (int b = 0; b < 4; b++) {
    NMT_ASSERT_NEAR(bytes[b], want_bytes[b], 0);
    NMT_ASSERT_NEAR(ready[b], want_ready[b], 0);
  }
  /* The last bucket waits for the parameters (1000), not its pad (1024): an event at 1000. */
  const size_t at_params[] = {100, 600, 1000, 1004};
  const double at4[] = {1, 2, 2.5, 3};
  NMT_ASSERT_OK(nmt_scaling_buckets_plan(&plan, at_params, at4, 4, bytes, ready, 64, &n));
  NMT_ASSERT_NEAR(ready[3], 2.5, 0);
  NMT_ASSERT_EQ_STATUS(nmt_scaling_buckets_plan(&plan, floats, at, 3, bytes, ready, 3, &n),
                       NMT_ERR_USAGE);
  /* The largest stage: prefixes 100, 600, 1004 of 1000 parameters -> 100, 500, 400. */
  NMT_ASSERT_EQ_INT(nmt_scaling_largest_stage(floats, 3, 1000), 500);
  const size_t last_big[] = {100, 200, 1004};
  NMT_ASSERT_EQ_INT(nmt_scaling_largest_stage(last_big, 3, 1000), 800);
  NMT_ASSERT_EQ_INT(nmt_scaling_largest_stage(floats, 0, 1000), 0);
}

/* Bytes per step of each stage, counted by hand: 1000 parameters, 4 ranks, buckets of 300
 * floats (zero 0: 4 buckets over 1004 floats; zero >= 1: 320-float buckets, span 1024). */
NMT_TEST(scaling_zero_bytes_per_step) {
  const double mb = 300.0 * 4 / 1048576;
  nmt_bucket_plan p0, p1, p2, whole;
  NMT_ASSERT_OK(nmt_bucket_plan_make(mb, 1000, 4, 0, &p0));
  NMT_ASSERT_OK(nmt_bucket_plan_make_sharded(mb, 1000, 4, 1, 0, &p1));
  NMT_ASSERT_OK(nmt_bucket_plan_make_sharded(mb, 1000, 4, 1, 0, &p2));
  p2.zero = 2; /* the bench's stand-in for stage 2's plan (src/bench/scaling.c) */
  nmt_scaling_step_bytes b;
  /* zero 0, fp32: 4000 + 16 bytes all-reduced in 4 calls, x 2(3/4) on the bus. */
  NMT_ASSERT_OK(nmt_scaling_zero_bytes(&p0, 4, 3, NMT_GRAD_FP32, &b));
  NMT_ASSERT_NEAR(b.backward_bytes, 4016, 0);
  NMT_ASSERT_NEAR(b.gather_bytes, 0, 0);
  NMT_ASSERT_NEAR(b.bus_bytes, 4016 * 1.5, 1e-9);
  NMT_ASSERT_EQ_INT(b.calls, 4);
  /* bf16 wire: 2000 + 16, the slots in a call of their own. */
  NMT_ASSERT_OK(nmt_scaling_zero_bytes(&p0, 4, 3, NMT_GRAD_BF16, &b));
  NMT_ASSERT_NEAR(b.backward_bytes, 2016, 0);
  NMT_ASSERT_EQ_INT(b.calls, 5);
  /* ... unless the last bucket holds only the slots: [0, 1000) [1000, 1004). */
  NMT_ASSERT_OK(nmt_bucket_plan_make(1000.0 * 4 / 1048576, 1000, 4, 0, &whole));
  NMT_ASSERT_OK(nmt_scaling_zero_bytes(&whole, 4, 1, NMT_GRAD_BF16, &b));
  NMT_ASSERT_EQ_INT(b.calls, 2);
  /* One rank: nothing on the bus. */
  NMT_ASSERT_OK(nmt_scaling_zero_bytes(&p0, 1, 1, NMT_GRAD_FP32, &b));
  NMT_ASSERT_NEAR(b.bus_bytes, 0, 0);
  /* zero 1, fp32, accum 3 (once): reduce-scatter 4096 + slots 16; all-gather 4 x 1024 + the
   * norm's 4; 5 + 1 + 4 calls; bus 4096 x 3/4 + 16 x 1.5 + 4 x 1.5 + 4096 x 3/4. */
  NMT_ASSERT_OK(nmt_scaling_zero_bytes(&p1, 4, 3, NMT_GRAD_FP32, &b));
  NMT_ASSERT_NEAR(b.backward_bytes, 4112, 0);
  NMT_ASSERT_NEAR(b.gather_bytes, 4100, 0);
  NMT_ASSERT_NEAR(b.bus_bytes, 3072 + 24 + 6 + 3072, 1e-9);
  NMT_ASSERT_EQ_INT(b.calls, 10);
  /* zero 2, bf16 wire, accum 3: every micro-batch reduce-scatters. */
  NMT_ASSERT_OK(nmt_scaling_zero_bytes(&p2, 4, 3, NMT_GRAD_BF16, &b));
  NMT_ASSERT_NEAR(b.backward_bytes, 3 * (2048 + 16), 0);
  NMT_ASSERT_NEAR(b.gather_bytes, 4100, 0);
  NMT_ASSERT_NEAR(b.bus_bytes, 3 * (1536 + 24) + 6 + 3072, 1e-9);
  NMT_ASSERT_EQ_INT(b.calls, 3 * 5 + 1 + 4);
  NMT_ASSERT_EQ_STATUS(nmt_scaling_zero_bytes(&p2, 4, 0, NMT_GRAD_FP32, &b), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(nmt_scaling_zero_bytes(&p2, 2, 1, NMT_GRAD_FP32, &b), NMT_ERR_USAGE);
}

/* Per-GPU state of each stage against the engine's allocations, counted by hand: 1000
 * parameters over 4 ranks, buckets of 300 floats rounded up to 320 (4 x 16 = 64 | 320), so
 * the padded span is 3 x 320 + 64 = 1024 floats and the shard 256. Stage 2 with backward
 * stages of 200, 704 and 96 floats (the last the embedding's), padded to 256, 704 and 128:
 * shard 272, windows 2 x 704 + 128 = 1536. */
NMT_TEST(scaling_memory_state_hand_count) {
  const double mb = 300.0 * 4 / 1048576;
  const size_t bounds[] = {0, 200, 904, 1000};
  nmt_bucket_plan s2;
  NMT_ASSERT_OK(nmt_bucket_plan_make_stages(bounds, 3, 4, &s2));
  nmt_scaling_memory m;
  NMT_ASSERT_OK(nmt_scaling_state_bytes(0, 4, 1000, NULL, 1, mb, &m));
  NMT_ASSERT_NEAR(m.weights, 4000 + 2000, 0);
  NMT_ASSERT_NEAR(m.grads, 4 * 1004, 0);
  NMT_ASSERT_NEAR(m.optim, 8000, 0);
  NMT_ASSERT_NEAR(m.total, 6000 + 4016 + 8000, 0);
  NMT_ASSERT_OK(nmt_scaling_state_bytes(1, 4, 1000, NULL, 1, mb, &m));
  NMT_ASSERT_NEAR(m.weights, 4 * 1024 + 2 * 1024, 0);
  NMT_ASSERT_NEAR(m.grads, 4 * (1024 + 4), 0);
  NMT_ASSERT_NEAR(m.optim, 8 * 256, 0);
  NMT_ASSERT_OK(nmt_scaling_state_bytes(2, 4, 1000, &s2, 0, mb, &m));
  NMT_ASSERT_NEAR(m.weights, 4 * 1000, 0); /* stage 2's parameters carry no pad */
  NMT_ASSERT_NEAR(m.grads, 4 * (272 + 4) + 4 * 1536, 0);
  NMT_ASSERT_NEAR(m.optim, 8 * 272, 0);
  /* The same as the trainer's plan says (src/engine/replica.c sizes from it). */
  nmt_bucket_plan plan;
  NMT_ASSERT_OK(nmt_bucket_plan_make_sharded(mb, 1000, 4, 1, 0, &plan));
  NMT_ASSERT_EQ_INT(plan.total_floats, 1024);
  NMT_ASSERT_EQ_INT(plan.shard_floats, 256);
  NMT_ASSERT_EQ_STATUS(nmt_scaling_state_bytes(3, 4, 1000, NULL, 0, mb, &m), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(nmt_scaling_state_bytes(1, 0, 1000, NULL, 0, mb, &m), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(nmt_scaling_state_bytes(0, 1, 1000, NULL, 0, 0, &m), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(nmt_scaling_state_bytes(2, 4, 1000, NULL, 0, mb, &m), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(nmt_scaling_state_bytes(2, 2, 1000, &s2, 0, mb, &m), NMT_ERR_USAGE);
  nmt_bucket_plan_free(&s2);
}

/* What grows with the batch, and the largest batch that fits. */
NMT_TEST(scaling_memory_tokens_and_fit) {
  nmt_model_cfg c = {.vocab = 50, .d_model = 16, .n_heads = 2, .d_ff = 32, .enc_layers = 1,
                     .dec_layers = 1, .max_positions = 64, .dropout = 0.1f,
                     .attn_dropout = 0.1f, .ln_eps = 1e-5f};
  nmt_scaling_memory m, h;
  memset(&m, 0, sizeof m);
  NMT_ASSERT_OK(nmt_scaling_token_bytes(&c, 40, 10, 0, &m));
  NMT_ASSERT_NEAR(m.activations, (double)nmt_model_arena_bytes(&c, 40, 10), 0);
  NMT_ASSERT_NEAR(m.batch, 3.0 * (5 * 40 + 16) * 4, 0);
  /* Attention scratch: q = kv = 40 x 16 floats, scores 40 x 2 x 10: 2 x 2560 + 2 x 2560 +
   * 2560 + 3200 -> 3328 (256-byte pieces). */
  NMT_ASSERT_NEAR(m.scratch, 5120 + 5120 + 2560 + 3328, 0);
  /* fp16/bf16: + 16-bit GEMM copies of inp 40 x 32, w 16 x 50, out 40 x 50: 2560 + 1600 ->
   * 1792 + 4000 -> 4096. */
  NMT_ASSERT_OK(nmt_scaling_token_bytes(&c, 40, 10, 1, &h));
  NMT_ASSERT_NEAR(h.scratch - m.scratch, 2560 + 1792 + 4096, 0);
  /* Checkpointing keeps less. */
  nmt_model_cfg ck = c;
  ck.checkpoint_activations = 1;
  NMT_ASSERT_OK(nmt_scaling_token_bytes(&ck, 40, 10, 0, &h));
  NMT_ASSERT(h.activations < m.activations);
  NMT_ASSERT_EQ_STATUS(nmt_scaling_token_bytes(&c, 0, 10, 0, &h), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(nmt_scaling_token_bytes(&c, 40, 65, 0, &h), NMT_ERR_USAGE);
  /* The fit: exactly at 300 tokens' total, 300; one byte less, 299; below 1 token, 0. */
  const double fixed = 1e6;
  NMT_ASSERT_OK(nmt_scaling_token_bytes(&c, 300, 10, 0, &m));
  const double at300 = fixed + m.activations + m.scratch + m.batch;
  int fit = -1;
  NMT_ASSERT_OK(nmt_scaling_max_tokens(&c, 10, 0, fixed, at300, &fit));
  NMT_ASSERT_EQ_INT(fit, 300);
  NMT_ASSERT_OK(nmt_scaling_max_tokens(&c, 10, 0, fixed, at300 - 1, &fit));
  NMT_ASSERT_EQ_INT(fit, 299);
  NMT_ASSERT_OK(nmt_scaling_max_tokens(&c, 10, 0, fixed, fixed, &fit));
  NMT_ASSERT_EQ_INT(fit, 0);
}

/* `--zero all --nodes 2 --mem-gb`: the ZeRO, memory and node tables, and their JSON rows. */
NMT_TEST(bench_cli_scaling_zero_memory_nodes) {
  char *text = malloc(1 << 17), jsonl[512], extra[1024];
  NMT_ASSERT(text != NULL);
  snprintf(jsonl, sizeof jsonl, "%s/rows_zero.jsonl", nmt_test_tmpdir());
  snprintf(extra, sizeof extra, "--max-devices 2 --zero all --nodes 3 --net-gbps 50 "
           "--mem-gb 0.5 --reserve-gb 0.25 --jsonl %s", jsonl);
  int rc = scaling_cli(extra, text, 1 << 17);
  int ok = strstr(text, "ZeRO stages per N") && strstr(text, "\n   2    2 ") &&
           strstr(text, "per-GPU memory (MiB) at N = 2") && strstr(text, "\n   2   yes ") &&
           strstr(text, "several nodes") && strstr(text, "\n    3    6 ") &&
           strstr(text, "line rate 50 Gb/s (declared)") && strstr(text, "0.50 GiB declared") &&
           strstr(text, "bytes per step at N = 2");
  if (rc != 0 || !ok) printf("# %s\n", text);
  char *rows = nmt_th_read_file(jsonl, NULL);
  int steps = 0, mem = 0, nodes = 0;
  for (const char *q = rows; q && (q = strstr(q, "\"bench\": \"scaling")); q++) {
    q += strlen("\"bench\": \"scaling");
    if (!strncmp(q, "\"", 1)) steps++;
    if (!strncmp(q, "_memory\"", 8)) mem++;
    if (!strncmp(q, "_nodes\"", 7)) nodes++;
  }
  int zero2 = rows && strstr(rows, "\"zero\": 2, \"n_devices\": 2") &&
              strstr(rows, "\"gather_bytes\": ") &&
              strstr(rows, "\"algo\": \"two_level\", \"nodes\": 3");
  free(rows);
  /* Bad values exit 2. */
  int rc2 = scaling_cli("--zero 3", text, 1 << 17);
  int rc3 = scaling_cli("--nodes 1", text, 1 << 17);
  int rc4 = scaling_cli("--nodes 17", text, 1 << 17);
  int rc5 = scaling_cli("--net-gbps 0", text, 1 << 17);
  free(text);
  NMT_ASSERT_EQ_INT(rc, 0);
  NMT_ASSERT(ok);
  /* 3 stages x 2 N x 8 sizes (1..100 MiB and the config's 0.01); 3 x 2 memory rows; 2 models
   * x 3 node counts x 8 sizes. */
  NMT_ASSERT_EQ_INT(steps, 48);
  NMT_ASSERT_EQ_INT(mem, 6);
  NMT_ASSERT_EQ_INT(nodes, 48);
  NMT_ASSERT(zero2);
  NMT_ASSERT_EQ_INT(rc2, 2);
  NMT_ASSERT_EQ_INT(rc3, 2);
  NMT_ASSERT_EQ_INT(rc4, 2);
  NMT_ASSERT_EQ_INT(rc5, 2);
}
