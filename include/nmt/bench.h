/* nmt/bench.h — `nmt bench allreduce` and `nmt bench scaling`: the communicator's bandwidth,
 * and a weak-scaling model of data parallelism with bucketed all-reduce overlapped with backward.
 *
 * All-reduce bench (src/bench/allreduce.c): nccl-tests' all_reduce_perf, simplified to
 * one in-place column group, on the communicator the trainer uses (today the host communicator,
 * parallel.devices ranks = threads). It is written against nmt_comm and an nmt_backend's
 * malloc/copy, so an NCCL communicator with device buffers plugs in without changing it.
 * Bandwidths follow nccl-tests doc/PERFORMANCE.md: algbw = S / t (GB = 1e9 B) and, for
 * all-reduce, busbw = algbw * 2(n-1)/n, "the speed of the hardware bottleneck", comparable
 * across rank counts. Every size is checked: integer-valued floats so the fp32 sum is exact,
 * and #wrong counts the elements (over all ranks) that differ from it. The wire type is
 * parallel.grad_dtype (nmt_comm_allreduce_sum_as): with fp16 or bf16 the buffers stay fp32,
 * a size is the bytes on the wire (count x 2) and so are algbw and busbw; the check stays
 * exact because every partial sum of the pattern is an integer of magnitude <= 32 x ranks,
 * exact in fp16 up to 64 ranks and in bf16 up to 8 (more ranks are refused).
 * ZeRO's collectives get the same sweep (opts.op; `--op` on the command line):
 * reduce_scatter_perf and all_gather_perf, where, as in nccl-tests, a size is the whole
 * buffer (n x count x element size, each rank owning count elements), algbw = size / t and
 * busbw = algbw * (n-1)/n (doc/PERFORMANCE.md "ReduceScatter", "AllGather"). The
 * reduce-scatter checks each rank's own slice against the exact sum; the all-gather moves
 * fp32 values, or with a 16-bit parallel.grad_dtype 16-bit patterns, and checks every slice
 * bit for bit.
 *
 * Scaling model (src/bench/scaling*.c, docs/scaling.md): measured on ONE device, for N
 * devices with identical per-device batches (weak scaling):
 *   t_b      = latency + bytes_b * 2(N-1)/N / busbw           ring all-reduce of bucket b (N > 1)
 *   start_b  = max(ready_b, end_{b-1}),  end_b = start_b + t_b  one comm stream, buckets in order
 *   exposed  = max(0, end_last - (fwd + bwd))
 *   step     = fwd + bwd + exposed + optimizer
 *   efficiency = step(1) / step(N),  tokens/s = N * tokens/step / step(N)
 * With N = 1 there is no communication (t_b = 0), as in the trainer.
 * ZeRO (parallel.zero, nmt_scaling_predict_zero): reduce-scatters on the same comm stream (every
 * micro-batch at stage 2), then the norm's all-reduce, the shard's update and the all-gathers
 * of the weights, not overlapped. Per-GPU memory per stage (nmt_scaling_state_bytes,
 * nmt_scaling_token_bytes) and the largest data.max_tokens that fits (nmt_scaling_max_tokens).
 * Several nodes (nmt_scaling_collective_ms): NCCL's ring over the slowest link, or a two-level
 * reduce-scatter / all-reduce across nodes / all-gather.
 *
 * defines: nmt_bench_busbw_factor, nmt_bench_busbw, nmt_bench_op, nmt_bench_op_name,
 *          nmt_bench_op_parse, nmt_bench_op_busbw_factor, nmt_bench_allreduce_value,
 *          nmt_bench_allreduce_fill, nmt_bench_allreduce_check, nmt_bench_allreduce_opts,
 *          nmt_bench_allreduce_row, nmt_bench_allreduce_run, nmt_bench_allreduce,
 *          nmt_scaling_profile, nmt_scaling_algo, nmt_scaling_link, nmt_scaling_pred,
 *          nmt_scaling_collective_ms, nmt_scaling_predict, nmt_scaling_zero,
 *          nmt_scaling_step_bytes, nmt_scaling_zero_bytes, nmt_scaling_predict_zero, nmt_scaling_buckets, nmt_scaling_buckets_plan,
 *          nmt_scaling_largest_stage, nmt_scaling_memory, nmt_scaling_state_bytes,
 *          nmt_scaling_token_bytes, nmt_scaling_max_tokens, nmt_scaling_best,
 *          nmt_bucket_cost_point, nmt_bucket_choice_in, nmt_bucket_choice_row,
 *          NMT_BUCKET_CANDIDATES, nmt_bucket_candidates_mb, nmt_bucket_choose,
 *          NMT_SCALING_ZERO_ALL, NMT_SCALING_MAX_NODES,
 *          nmt_scaling_measurement, nmt_scaling_measure, nmt_bench_scaling_opts,
 *          nmt_bench_scaling, nmt_bench_parse_bytes
 */
#ifndef NMT_BENCH_H
#define NMT_BENCH_H

#include <stddef.h>
#include <stdio.h>

#include "nmt/backend.h"
#include "nmt/buckets.h"
#include "nmt/comm.h"
#include "nmt/config.h"
#include "nmt/model.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------- */
/* all-reduce bench                                                                          */

/* nccl-tests' all-reduce bus-bandwidth factor 2(n-1)/n (doc/PERFORMANCE.md "AllReduce"); 0 for
 * n = 1, as nccl-tests prints (one rank moves nothing over any bus). n < 1 gives 0. */
double nmt_bench_busbw_factor(int n_ranks);
/* busbw = algbw * nmt_bench_busbw_factor(n_ranks), same unit as algbw. */
double nmt_bench_busbw(double algbw, int n_ranks);

/* The collective a sweep measures: nccl-tests' all_reduce_perf, reduce_scatter_perf,
 * all_gather_perf. */
typedef enum {
  NMT_BENCH_ALLREDUCE = 0,      /* nmt_comm_allreduce_sum_as (the default) */
  NMT_BENCH_REDUCE_SCATTER = 1, /* nmt_comm_reduce_scatter_sum_as */
  NMT_BENCH_ALL_GATHER = 2,     /* nmt_comm_all_gather */
  NMT_BENCH_ALL_OPS = 3,        /* nmt_bench_allreduce only: the three tables in turn */
} nmt_bench_op;

/* "all_reduce", "reduce_scatter", "all_gather", "all" (nccl-tests' names); "?" otherwise. */
const char *nmt_bench_op_name(nmt_bench_op op);
/* `--op`: "allreduce" (or "all_reduce"), "reduce_scatter", "all_gather", "all".
 * Errors: NMT_ERR_USAGE naming the text and the choices. */
nmt_status nmt_bench_op_parse(const char *text, nmt_bench_op *out);
/* nccl-tests' bus-bandwidth factor (doc/PERFORMANCE.md): 2(n-1)/n for the all-reduce, (n-1)/n
 * for reduce-scatter and all-gather (each rank sends or receives n-1 of the n slices); 0 for
 * n < 2 and for any other op. */
double nmt_bench_op_busbw_factor(nmt_bench_op op, int n_ranks);

/* The value rank `rank` contributes at element `i`: an integer in [-31, 32] from a hash of
 * (i, rank), so that any n <= 2^18 ranks sum exactly in fp32 and a misplaced slice, a missing
 * or doubled rank, or stale data changes the sum. */
float nmt_bench_allreduce_value(int rank, size_t i);
/* buf[k] = nmt_bench_allreduce_value(rank, offset + k), k < count (host memory). */
void nmt_bench_allreduce_fill(float *buf, size_t count, size_t offset, int rank);
/* Number of k < count where buf[k] (host memory) differs from the exact sum over ranks
 * 0..n_ranks-1 of nmt_bench_allreduce_value(r, offset + k). */
size_t nmt_bench_allreduce_check(const float *buf, size_t count, size_t offset, int n_ranks);

typedef struct {
  size_t size;       /* sizeof(nmt_bench_allreduce_opts) */
  size_t min_bytes;  /* first size (default 1 KiB), rounded up to a multiple of the element
                      * size on the wire */
  size_t max_bytes;  /* last size (default 512 MiB); sizes double from min_bytes */
  int warmup;        /* untimed iterations per size (default 5) */
  int iters;         /* timed iterations per size (default 20); above 16 MiB both counts are
                      * scaled by 16 MiB / size (at least 1 warmup, 2 timed) */
  double mem_fraction; /* nmt_bench_allreduce: skip sizes whose n buffers exceed this share of
                        * MemAvailable (default 0.5) */
  nmt_grad_dtype wire; /* element type on the wire (default NMT_GRAD_FP32; nmt_bench_allreduce
                        * sets parallel.grad_dtype): sizes are wire bytes, count = size /
                        * nmt_comm_wire_size(wire), buffers stay fp32 (4 x count bytes); the
                        * all-gather moves elements of this size (16-bit storage for fp16/bf16) */
  nmt_bench_op op;     /* the collective (default NMT_BENCH_ALLREDUCE); NMT_BENCH_ALL_OPS only
                        * in nmt_bench_allreduce */
} nmt_bench_allreduce_opts;

void nmt_bench_allreduce_opts_default(nmt_bench_allreduce_opts *o);

typedef struct {
  size_t bytes, count;  /* all-reduce: per rank, count elements = bytes on the wire (fp32
                         * buffers of 4 x count bytes). reduce-scatter, all-gather: the whole
                         * buffer, bytes = n x rank_count x element size, count = n x
                         * rank_count, as nccl-tests prints them */
  size_t rank_count;    /* the count passed to the collective: count (all-reduce), the
                         * elements each rank owns (reduce-scatter, all-gather) */
  int warmup, iters;    /* iterations actually run for this size */
  double time_us;       /* mean time of one all-reduce over the timed iterations, slowest rank */
  double algbw_gbs;     /* bytes / time, GB/s (1e9) */
  double busbw_gbs;     /* algbw * nmt_bench_op_busbw_factor(op, n) */
  long long wrong;      /* wrong elements summed over ranks (one fresh, checked collective:
                         * all-reduce every element, reduce-scatter each rank's own slice,
                         * all-gather every slice) */
} nmt_bench_allreduce_row;

/* Runs the size sweep of o->op (all-reduce, reduce-scatter or all-gather) on the n ranks of
 * `comms` (one thread per rank, created here), buffers
 * from `be` (device memory of ctxs[r]; the host communicator needs host memory: pass
 * &nmt_backend_ref and NULL ctxs). For each size: fill, `warmup` collectives
 * (nmt_comm_allreduce_sum_as with o->wire, or the op's), a barrier, `iters` timed ones back to back,
 * nmt_comm_flush + the backend's synchronize (time = elapsed / iters on each rank; the row
 * takes the slowest rank), then refill, one all-reduce, flush and the exact check (copy_d2h
 * waits for the flushed result). fp32 buffers for the largest count are allocated, and with a
 * half wire type nmt_comm_reserve is called for that count on every rank, once before the
 * threads start. Reduce-scatter and all-gather sizes start at min_bytes rounded up to a
 * multiple of n x element size (every rank owns at least one element) and double from there.
 * rows: capacity max_rows; *n_rows gets the sizes run. Errors: NMT_ERR_USAGE (bad options,
 * o->op = NMT_BENCH_ALL_OPS; for the sums, a wire type in which 32 x n is not exact: bf16
 * beyond 8 ranks, fp16 beyond 64),
 * NMT_ERR_NOMEM, any communicator or backend error (the group is then aborted). */
nmt_status nmt_bench_allreduce_run(nmt_comm **comms, int n, const nmt_backend *be, void **ctxs,
                                   const nmt_bench_allreduce_opts *o,
                                   nmt_bench_allreduce_row *rows, int max_rows, int *n_rows);

/* `nmt bench allreduce`: the communicator of cfg (host, parallel.devices ranks), the wire
 * type of parallel.grad_dtype (o->wire is ignored), sizes capped by max_bytes and by memory,
 * for o->op (or, with NMT_BENCH_ALL_OPS, all-reduce, reduce-scatter and all-gather in turn)
 * the table on `out` (nccl-tests columns; type "float", "half" or "bfloat16"), then "# Avg bus
 * bandwidth" (mean busbw over the sizes run) and, if jsonl_path is not NULL, one JSON row per
 * size appended to it (with "op": the nccl-tests name). config_label names the config in the header. Errors: as
 * nmt_bench_allreduce_run; NMT_ERR_DATA if any element was wrong (after printing the table);
 * NMT_ERR_IO (jsonl). */
nmt_status nmt_bench_allreduce(const nmt_config *cfg, const char *config_label,
                               const nmt_bench_allreduce_opts *o, const char *jsonl_path,
                               FILE *out);

/* Parses a byte count: digits with an optional K, M, G suffix (powers of 1024, optional
 * trailing "B"/"iB"). Errors: NMT_ERR_USAGE naming the text. */
nmt_status nmt_bench_parse_bytes(const char *text, size_t *out);

/* ---------------------------------------------------------------------------------------- */
/* scaling model                                                                             */

/* One optimizer step of one device, times in ms from the start of its first forward. */
typedef struct {
  double fwd_ms;          /* every micro-batch's forward (incl. the batch copy) */
  double bwd_ms;          /* every micro-batch's backward; compute ends at fwd_ms + bwd_ms */
  double opt_ms;          /* after the last bucket: zero grads, grad norm, AdamW */
  int n_buckets;
  const double *bytes;    /* (n_buckets) bytes of bucket b, in reduction order */
  const double *ready_ms; /* (n_buckets) when bucket b's gradients are final; nondecreasing */
} nmt_scaling_profile;

/* How an all-reduce crosses nodes (nmt_scaling_collective_ms). */
typedef enum {
  NMT_SCALING_RING = 0,      /* NCCL's ring through all nodes x GPUs, paced by its slowest link */
  NMT_SCALING_TWO_LEVEL = 1, /* reduce-scatter in the node, all-reduce across, all-gather */
} nmt_scaling_algo;

typedef struct {
  double busbw_gbs;   /* GB/s (1e9 B/s) inside a node; <= 0 or infinite: infinitely fast */
  double latency_us;  /* per collective call inside one node */
  int serial;         /* 0: the model above (comm stream overlapped with backward);
                       * 1: each bucket's all-reduce blocks compute (today's CPU workers reduce
                       *    inside the grad-ready callback): exposed = sum of t_b */
  /* Several nodes (nodes >= 2; 0 or 1: one node, and the fields below are not read): the
   * n_devices of a prediction are nodes x gpus_per_node, one NIC per node. */
  int nodes;
  int gpus_per_node;
  double net_busbw_gbs;  /* what one node's NIC moves, GB/s; <= 0 or infinite: infinitely fast */
  double net_step_us;    /* latency of one ring step that crosses the network */
  double intra_step_us;  /* latency of one ring step inside a node */
  nmt_scaling_algo algo;
} nmt_scaling_link;

typedef struct {
  double allreduce_ms; /* sum over buckets (and, with ZeRO 2, micro-batches) of t_b: the
                        * backward's collectives (all-reduce, or ZeRO's reduce-scatter and the
                        * trailing slots' all-reduce) */
  double comm_end_ms;  /* end of the last of them (fwd + bwd when N = 1) */
  double exposed_ms;   /* communication not hidden behind backward */
  double norm_ms;      /* ZeRO: the gradient norm's one-float all-reduce */
  double gather_ms;    /* ZeRO: the all-gathers of the updated weights after the update */
  double opt_ms;       /* the update (the profile's opt_ms) */
  double step_ms;      /* fwd + bwd + exposed + norm + opt + gather */
} nmt_scaling_pred;

/* Time in ms of one collective `op` (all-reduce, reduce-scatter or all-gather) of `bytes`
 * (nccl-tests' size: per rank for the all-reduce, the whole buffer for the other two) over
 * n_devices ranks; 0 for n_devices < 2.
 * One node (l->nodes < 2):  latency + bytes x f / busbw, f = nmt_bench_op_busbw_factor(op, n)
 *   (nccl-tests doc/PERFORMANCE.md: busbw = algbw x f).
 * K = l->nodes nodes of G = l->gpus_per_node GPUs (n_devices = K G), s = 2 ring passes for the
 * all-reduce, 1 for the others:
 *   ring:  latency + s (K-1) net_step + s (K-1)(G-1) intra_step
 *          + bytes x f / min(busbw, net_busbw)
 *     NCCL's ring runs through every GPU and crosses the network K times, so every step is
 *     paced by its slowest link (Patarasuk & Yuan 2009; NCCL src/graph/tuning.cc: ring latency
 *     = base + intra steps x intra latency + 2(nNodes-1) x net latency for the all-reduce);
 *     the one-node latency stands for the base and the first node's 2(G-1) steps.
 *   two-level (all-reduce only; reduce-scatter and all-gather use the ring):
 *          latency + 2 (K-1) net_step + 2 bytes (G-1)/G / busbw + bytes 2(K-1)/K / net_busbw
 *     reduce-scatter inside each node, G concurrent all-reduces of bytes/G across the nodes
 *     sharing the node's NIC, all-gather inside the node, one after the other (Jia et al. 2018
 *     "Highly Scalable Deep Learning Training System with Mixed-Precision" §3.3, Horovod's
 *     hierarchical all-reduce; NVIDIA/nccl-tests#196: inter-node traffic algbw x 2(K-1)/K).
 * Returns NAN for n_devices != K G with K >= 2 or an op outside the three. */
double nmt_scaling_collective_ms(const nmt_scaling_link *l, nmt_bench_op op, int n_devices,
                                 double bytes);

/* The model of the header comment for n_devices >= 1 (t_b = nmt_scaling_collective_ms of the
 * all-reduce). Errors: NMT_ERR_USAGE (n_devices < 1, a negative time or size, ready times
 * decreasing or beyond fwd_ms + bwd_ms; with l->nodes >= 2, n_devices != nodes x
 * gpus_per_node). */
nmt_status nmt_scaling_predict(const nmt_scaling_profile *p, int n_devices,
                               const nmt_scaling_link *l, nmt_scaling_pred *out);

/* ZeRO's step (Rajbhandari et al. 2020 §5; parallel.zero; the bucket layout of nmt/buckets.h).
 * With the profile's buckets cut by nmt_bucket_plan_make_sharded (bytes = the padded bucket in
 * the wire type) and its opt_ms the update of the rank's shard:
 *   zero 0: the all-reduce model above (nmt_scaling_predict).
 *   zero 1: each bucket REDUCE-SCATTERED during the last micro-batch's backward, on the comm
 *     stream as the all-reduce was (factor (N-1)/N instead of 2(N-1)/N), then the trailing
 *     slots' all-reduce (NMT_GRAD_EXTRA fp32); after backward the norm's one-float all-reduce,
 *     the update of the shard, and per bucket the ALL-GATHER of the updated fp32 weights
 *     (gather_bytes[b] = 4 x the bucket's floats; in fp16/bf16 modes the 16-bit working copy
 *     is cast from them on each GPU, src/engine/zero.c, a local pass not modelled): nothing
 *     overlaps them (the next forward needs the weights):
 *       step = fwd + bwd + exposed + norm + opt + gather.
 *   zero 2: as 1, but every micro-batch's backward reduce-scatters its buckets (the rank keeps
 *     only its shard of the accumulated gradient): micro-batch a of A = accum is taken to be
 *     the last one shifted (A-1-a) x period_ms earlier (identical micro-batches), so its
 *     buckets are ready at ready_b - (A-1-a) period_ms; one comm stream carries them all in
 *     order. */
typedef struct {
  int zero;                   /* 0, 1 or 2 */
  int accum;                  /* micro-batches per step (>= 1) */
  double period_ms;           /* one micro-batch's forward + backward */
  const double *gather_bytes; /* (n_buckets) zero >= 1: fp32 bytes all-gathered per bucket */
} nmt_scaling_zero;

/* The bytes one optimizer step moves at a ZeRO stage, in nccl-tests' sizes. */
typedef struct {
  double backward_bytes; /* issued during backward: the buckets' all-reduces (zero 0: per rank,
                          * parameters in the wire type + the NMT_GRAD_EXTRA fp32 slots) or
                          * reduce-scatters (zero >= 1: whole padded buckets in the wire type,
                          * each micro-batch at stage 2) + the slots' all-reduces */
  double gather_bytes;   /* after the update: the all-gathered fp32 weights (4 x padded span)
                          * plus the norm's 4 B */
  double bus_bytes;      /* what each rank moves over its busiest link: every collective's size
                          * x nmt_bench_op_busbw_factor (0 for one rank) */
  int calls;             /* collectives per step */
} nmt_scaling_step_bytes;

/* Bytes per step of `plan` (nmt_bucket_plan_make for zero 0; nmt_bucket_plan_make_sharded for
 * 1 and 2, which records the stage in plan->zero) over n_ranks ranks, accum micro-batches per
 * step, gradients on the wire in `wire`. Zero 0: backward = n_params x wire size + 4 x
 * NMT_GRAD_EXTRA, one all-reduce per bucket (plus one for the slots beside a 16-bit wire).
 * Zero 1: backward = span x wire size + the slots, gather = 4 span + 4 (the fp32 weights; a
 * 16-bit working copy is cast locally, not gathered). Zero 2: backward x accum. Errors:
 * NMT_ERR_USAGE (accum < 1, n_ranks < 1, a sharded plan cut for another n_ranks). */
nmt_status nmt_scaling_zero_bytes(const nmt_bucket_plan *plan, int n_ranks, int accum,
                                  nmt_grad_dtype wire, nmt_scaling_step_bytes *out);

/* Errors: as nmt_scaling_predict; NMT_ERR_USAGE for zero outside 0..2, accum < 1, period_ms <
 * 0, or zero >= 1 without gather_bytes. */
nmt_status nmt_scaling_predict_zero(const nmt_scaling_profile *p, int n_devices,
                                    const nmt_scaling_link *l, const nmt_scaling_zero *z,
                                    nmt_scaling_pred *out);

/* Buckets as the trainer forms them (worker_setup / on_grads_ready): bucket_floats =
 * max(1, floor(bucket_mb * 2^20 / 4)) capped at total_floats; bucket b covers floats
 * [b*bucket_floats, min((b+1)*bucket_floats, total_floats)), and is ready at the first event k
 * with ready_floats[k] >= its end. events: (n_events) pairs (ready_floats, ready_ms) as the
 * model's grad-ready callback reports them (ready_floats increasing, the last = total_floats).
 * Writes bytes_out/ready_out (capacity cap) and *n_buckets. Errors: NMT_ERR_USAGE (bucket_mb
 * <= 0, no event covers total_floats, more than cap buckets). */
nmt_status nmt_scaling_buckets(size_t total_floats, const size_t *ready_floats,
                               const double *ready_ms, int n_events, double bucket_mb,
                               double *bytes_out, double *ready_out, int cap, int *n_buckets);

/* nmt_scaling_buckets for any plan (nmt/buckets.h), ZeRO's sharded ones included: bucket b
 * (nmt_bucket_range, pad included) has (end - begin) x 4 bytes and is ready at the first event
 * whose prefix reaches min(end, plan->n_params + (plan->zero ? 0 : NMT_GRAD_EXTRA)): a ZeRO
 * pad is never written and its trailing slots are reduced on their own. Errors: NMT_ERR_USAGE
 * (no event covers a bucket, more than cap buckets). */
nmt_status nmt_scaling_buckets_plan(const nmt_bucket_plan *plan, const size_t *ready_floats,
                                    const double *ready_ms, int n_events, double *bytes_out,
                                    double *ready_out, int cap, int *n_buckets);

/* The largest backward stage in floats: the largest step between consecutive grad-ready
 * prefixes (the first from 0), each prefix capped at n_params (the trailing slots are not a
 * stage). The model reports one prefix per stage (decoder.ln_f, each decoder layer,
 * encoder.ln_f, each encoder layer, the embedding: src/model/backward.c). */
size_t nmt_scaling_largest_stage(const size_t *ready_floats, int n_events, size_t n_params);

/* Per-GPU memory of a training worker, bytes. */
typedef struct {
  double weights;     /* fp32 parameters, + the 16-bit working copy in fp16/bf16 modes */
  double grads;       /* the gradient buffer (with the trailing slots) */
  double optim;       /* Adam's m and v */
  double activations; /* nmt_model_arena_bytes: kept activations, backward scratch, logits */
  double scratch;     /* the backend's op scratch and 16-bit GEMM copies (CUDA's formulas) */
  double batch;       /* the device batch buffer and its two staging buffers */
  double reserve;     /* CUDA context, library workspaces, NCCL buffers: declared */
  double total;       /* the sum */
} nmt_scaling_memory;

/* The state that does not depend on the batch, for one worker of n_ranks at ZeRO stage `zero`:
 * exactly what the engine allocates (nmt_bucket_plan_bytes of the trainer's plan):
 *   zero 0: weights 4n (+2n half), grads 4(n + NMT_GRAD_EXTRA), optim 8n;
 *   zero 1: the sharded plan's padded span P and shard S = P / n_ranks: weights 4P (+2P):
 *     the fp32 weights stay replicated (the model reads fp32 LayerNorm, bias and embedding
 *     weights, and src/engine/zero.c all-gathers them), so the fp32 master is the working copy
 *     and is not sharded; grads 4(P + NMT_GRAD_EXTRA) (the full gradient); optim 8S;
 *   zero 2: stage2 = the model's stage plan (nmt_bucket_plan_make_model_stages) with shard S2:
 *     weights 4n (+2n; no pad), grads 4(S2 + NMT_GRAD_EXTRA) + the windows (two of the largest
 *     padded stage, the one being written and the one being reduced, and the embedding's,
 *     held through backward: nmt_grad_windows_floats), optim 8 S2.
 * bucket_mb cuts the zero 0/1 plans as the trainer does. Sets weights, grads, optim (the rest
 * 0). Errors: NMT_ERR_USAGE (zero outside 0..2, n_ranks < 1, bucket_mb <= 0, zero 2 without
 * a stage-2 plan of n_params over n_ranks). */
nmt_status nmt_scaling_state_bytes(int zero, int n_ranks, size_t n_params,
                                   const nmt_bucket_plan *stage2, int half, double bucket_mb,
                                   nmt_scaling_memory *out);

/* The memory that grows with data.max_tokens, for micro-batches of max_tokens padded tokens:
 * activations = nmt_model_arena_bytes(mc, max_tokens, max_len) (with or without
 * mc->checkpoint_activations), batch = 3 x (5 max_tokens + 16) int32 (the trainer's device
 * batch and staging buffers), scratch = the CUDA backend's op scratch for
 * nmt_model_scratch_plan's main need (its attention call: 4 (2q + 2kv + max(q, kv) + scores)
 * bytes, cuda/attention.cu) plus, with half, the 16-bit GEMM input copies 2 (inp + w + out)
 * (cuda/matmul.cu). Sets those three. Errors: NMT_ERR_USAGE (max_tokens < 1, max_len outside
 * [1, mc->max_positions], or a model so large the count would not fit: bound > 2^60). */
nmt_status nmt_scaling_token_bytes(const nmt_model_cfg *mc, int max_tokens, int max_len, int half,
                                   nmt_scaling_memory *out);

/* The largest max_tokens in [1, 2^24] whose fixed_bytes + token bytes (nmt_scaling_token_bytes)
 * fit in capacity_bytes, by bisection (the bytes grow with max_tokens); 0 if even 1 does not
 * fit. Errors: as nmt_scaling_token_bytes. */
nmt_status nmt_scaling_max_tokens(const nmt_model_cfg *mc, int max_len, int half,
                                  double fixed_bytes, double capacity_bytes, int *out);

/* Index of the smallest step_ms among n (the first on ties); -1 if n < 1. */
int nmt_scaling_best(const nmt_scaling_pred *preds, int n);

/* parallel.bucket_mb = auto (docs/scaling.md "bucket_mb = auto"): the bucket size with the
 * least predicted exposed communication, from what a run measures of itself.
 *
 * The communicator as measured: one collective of `bytes` (the fp32 bytes of the gradients it
 * carries, whatever the wire type) took `ms` (the slowest rank's mean). Between two points the
 * time is linear in bytes; beyond the ends, the end segment's slope (never below 0) continues
 * it, and no time is below 0. */
typedef struct {
  double bytes, ms;
} nmt_bucket_cost_point;

typedef struct {
  /* One backward (the step's last micro-batch), as nmt_scaling_measurement holds it: event k
   * says the gradient floats [0, ready_floats[k]) are final at ready_ms[k] (ms from the start
   * of the step's compute; nondecreasing), and compute ends at compute_end_ms. */
  const size_t *ready_floats;
  const double *ready_ms;
  int n_events;
  double compute_end_ms;
  size_t n_params;
  int zero;     /* 0: the all-reduce plan (nmt_bucket_plan_make, with NMT_GRAD_EXTRA slots);
                 * 1: ZeRO stage 1's sharded plan over n_ranks (reduce-scatters) */
  int n_ranks;
  const nmt_bucket_cost_point *cost; /* (n_cost >= 2) ascending bytes: the collective the plan
                                      * runs (all-reduce; reduce-scatter with zero = 1) */
  int n_cost;
  int serial;   /* 1: each collective blocks compute (CPU workers reduce inside the grad-ready
                 * callback): exposed = the sum of the collectives; 0: one comm stream
                 * overlapping backward, exposed = max(0, end of the last - compute_end) */
} nmt_bucket_choice_in;

typedef struct {
  double bucket_mb;
  int n_buckets;
  double comm_ms;    /* the sum of the plan's collectives */
  double exposed_ms; /* what backward does not hide of them */
} nmt_bucket_choice_row;

/* The sizes auto considers, MiB, ascending (nmt_bucket_choose drops a size whose plan equals
 * the previous one's, e.g. every size past the whole gradient). */
enum { NMT_BUCKET_CANDIDATES = 10 };
extern const double nmt_bucket_candidates_mb[NMT_BUCKET_CANDIDATES];

/* Predicts every candidate's collectives with the scaling model's recurrence (start_b =
 * max(ready_b, end_{b-1}), t_b from the cost table; nmt_scaling_predict) and picks the least
 * exposed_ms; among sizes within 1% (or 0.01 ms) of it, the one with the least comm_ms, then
 * the larger (fewer collectives, fewer chances to wait on a slow peer). rows (capacity
 * NMT_BUCKET_CANDIDATES) gets each distinct plan's numbers, *n_rows their count, *best the
 * chosen row. Errors: NMT_ERR_USAGE (fewer than 2 cost points or bytes not ascending, a
 * negative time, ready times out of order or beyond compute_end_ms, zero outside 0..1, no
 * event covering the gradients), the plans' errors. */
nmt_status nmt_bucket_choose(const nmt_bucket_choice_in *in, nmt_bucket_choice_row *rows,
                             int *n_rows, int *best);

enum { NMT_SCALING_MAX_EVENTS = 1024 };

/* What nmt_scaling_measure found, means over the timed steps. */
typedef struct {
  const char *backend;     /* "ref", "cuda" */
  int warmup, steps, accum;
  double fwd_ms, bwd_ms, opt_ms;
  double step_ms;          /* measured end to end (>= fwd + bwd + opt: batch fill excluded) */
  double tokens;           /* non-pad target tokens per step */
  double flops;            /* nmt_model_train_flops summed over the step's micro-batches */
  size_t n_params;
  size_t total_floats;     /* n_params + NMT_GRAD_EXTRA: what the trainer reduces */
  int n_events;
  size_t ready_floats[NMT_SCALING_MAX_EVENTS]; /* the grad-ready callback's prefixes */
  double ready_ms[NMT_SCALING_MAX_EVENTS];     /* from the step's first forward */
  /* The batch actually measured (padded tokens per micro-batch, micro-batches per step), and
   * the per-micro-batch compute factor nmt_scaling_extrapolate applied (1: as measured). */
  int measured_max_tokens, measured_accum;
  double extrapolated;
} nmt_scaling_measurement;

/* Trains `warmup + steps` optimizer steps of the config's model on ONE device of the config's
 * backend (cpu: ref with one BLAS thread, as a trainer worker; cuda/auto: the CUDA backend when
 * built in and a GPU is visible), on the first batches of the train shard's epoch-0 order,
 * train.accum_steps micro-batches per step; times forward, backward (and each grad-ready
 * callback), and the update; averages the last `steps`. On a device backend every phase and
 * callback is followed by a synchronize, so the times are completion times. Errors:
 * NMT_ERR_USAGE (steps < 1, warmup < 0), NMT_ERR_CONFIG / NMT_ERR_DATA (model, shard),
 * NMT_ERR_DEVICE, NMT_ERR_NOMEM. */
nmt_status nmt_scaling_measure(const nmt_config *cfg, int warmup, int steps,
                               nmt_scaling_measurement *out);

/* Turns a measurement made with a smaller batch (the same config but a smaller
 * data.max_tokens and train.accum_steps = 1; m->accum must be 1) into one of cfg's batch:
 * tokens and FLOPs per step become those of cfg's own batches at the same steps (epoch-0
 * order, optimizer steps warmup+1 .. warmup+steps, train.accum_steps micro-batches each), and
 * compute time is taken as linear in model FLOPs: with r = cfg's FLOPs per micro-batch / the
 * measured one and A = train.accum_steps, forward and backward become A r times the measured,
 * a grad-ready time t (of the last micro-batch) r (fwd + bwd) + r t, the step time grows
 * by (A r - 1)(fwd + bwd); the update is unchanged (it depends on the parameters only).
 * Records the measured batch and r in m. Errors: NMT_ERR_USAGE (m->accum != 1),
 * NMT_ERR_CONFIG / NMT_ERR_DATA (the shard). */
nmt_status nmt_scaling_extrapolate(const nmt_config *cfg, nmt_scaling_measurement *m);

typedef enum { NMT_SCALING_PRESET_NONE = 0, NMT_SCALING_PRESET_RTX3090X4 = 1 } nmt_scaling_preset;

typedef struct {
  size_t size;                /* sizeof(nmt_bench_scaling_opts) */
  int warmup, steps;          /* measured steps; -1 (default): 2, 5 on a GPU, 1, 2 on the CPU
                               * reference */
  double busbw_gbs;           /* > 0: declared; 0: preset's, else measured on the host comm */
  double latency_us;          /* >= 0: declared; < 0: preset's, else measured */
  double mfu;                 /* > 0: declared (preset only); 0: the preset's assumption */
  nmt_scaling_preset preset;
  int max_devices;            /* predict N = 1..max_devices (default 8) */
  int max_tokens;             /* > 0: measure micro-batches of at most this many padded tokens
                               * (at least data.max_len), one per step, and extrapolate to the
                               * config's batch (nmt_scaling_extrapolate); 0 (default): 1024 on
                               * the CPU reference, the config's batch on a GPU; -1: the
                               * config's batch everywhere */
  int zero;                   /* ZeRO stage to predict: -1 (default): parallel.zero; 0, 1, 2;
                               * NMT_SCALING_ZERO_ALL: the three (the grid shows zero 0) */
  int nodes;                  /* >= 2: also predict 1..nodes nodes of the preset's GPUs (or
                               * parallel.devices) on a network (at most 16); 0: one node */
  double net_gbps;            /* the network's line rate per node, Gb/s (bits; default 100) */
  double net_latency_us;      /* >= 0: latency per ring step across the network; < 0
                               * (default): NCCL's tuning-model figure */
  double mem_gb;              /* > 0: device memory per GPU, GiB; 0: the preset's, else none */
  double reserve_gb;          /* >= 0: memory not available to nmt's buffers, GiB; < 0
                               * (default): the stated assumption */
} nmt_bench_scaling_opts;

enum { NMT_SCALING_ZERO_ALL = 3, NMT_SCALING_MAX_NODES = 16 };

void nmt_bench_scaling_opts_default(nmt_bench_scaling_opts *o);

/* `nmt bench scaling`: nmt_scaling_measure, then busbw/latency (declared, preset, or measured
 * by a quick host-communicator all-reduce at the largest bucket / 4 bytes, max(2,
 * parallel.devices) ranks), then for each ZeRO stage asked for, each N and each bucket size
 * (1, 2, 5, 10, 25, 50, 100 MiB and the config's) the prediction (nmt_scaling_predict_zero);
 * the per-GPU memory of each stage (nmt_scaling_state_bytes, nmt_scaling_token_bytes) with
 * and without activation checkpointing and the largest data.max_tokens that fits (with a
 * device memory size: the preset's or --mem-gb); with o->nodes, the same model across 1..nodes
 * nodes (nmt_scaling_collective_ms, ring and two-level). Prints every input with its origin,
 * a step-time grid, a per-N table at the best bucket size, the ZeRO, memory and node tables,
 * and JSON rows to jsonl_path (may be NULL). Errors: as nmt_scaling_measure; NMT_ERR_USAGE
 * (bad options); NMT_ERR_IO (jsonl). */
nmt_status nmt_bench_scaling(const nmt_config *cfg, const char *config_label,
                             const nmt_bench_scaling_opts *o, const char *jsonl_path, FILE *out);

/* Internal to the files of src/bench/: the run's description for bench headers and JSON rows. */
void nmt__bench_commit(char *out, size_t cap);   /* "abc1234", "abc1234-dirty" or "unknown" */
void nmt__bench_cpu_name(char *out, size_t cap); /* /proc/cpuinfo "model name", or "unknown" */
double nmt__bench_now_s(void);                   /* CLOCK_MONOTONIC seconds */

#ifdef __cplusplus
}
#endif
#endif /* NMT_BENCH_H */
