/* nmt/buckets.h — gradient buckets: which slices of the flat gradient buffer are reduced when.
 *
 * The model lays its gradients out in backward-completion order (docs/ARCHITECTURE.md "One
 * flat parameter buffer"), followed by NMT_GRAD_EXTRA trailing slots (loss, tokens, NLL, stop
 * flag). A bucket is a contiguous slice of parallel.bucket_mb MiB of fp32 floats (the last one
 * shorter), so "bucket b is ready" is "backward's ready prefix passed its end" (PyTorch DDP's
 * bucketing, Li et al. 2020 §3.2.3, over a flat buffer). One plan serves every rank, the
 * trainer and `nmt bench scaling`, so the collectives they issue or model always match.
 *
 * The reducer follows one backward: the model calls nmt_bucket_reducer_on_ready with its ready
 * prefix, and every bucket that prefix covers is reduced (host communicator: at once; NCCL:
 * enqueued on the comm stream, which is where the overlap with backward comes from).
 * Gradients travel in parallel.grad_dtype; the trailing slots always in fp32 (a step's token
 * count and loss sum exceed what fp16 holds exactly, or at all).
 *
 * ZeRO (parallel.zero >= 1; Rajbhandari et al. 2020 §5): every bucket is cut into n_ranks equal
 * slices and rank r owns slice r of every bucket (the layout of PyTorch FSDP's flat parameters,
 * one per bucket), so a bucket is REDUCE-SCATTERED as backward finishes it (each rank receives
 * the summed slices it owns) and the optimizer state exists only for the owned slices, stored
 * one after the other: the rank's shard. Buckets are rounded up to a multiple of n_ranks x
 * NMT_SHARD_ALIGN floats, the last one padded past the parameters (the pad is zero and never
 * written by the model), and the trailing slots move behind the pad (extra_offset), where they
 * are all-reduced in fp32 after the last bucket.
 *
 * defines: nmt_bucket_plan, nmt_bucket_plan_make, nmt_bucket_plan_make_sharded,
 *          nmt_bucket_slice, NMT_SHARD_ALIGN, nmt_bucket_range, nmt_bucket_reducer,
 *          nmt_bucket_reducer_init, nmt_bucket_reducer_begin, nmt_bucket_reducer_on_ready,
 *          nmt_bucket_reducer_finish, nmt_bucket_reduce
 */
#ifndef NMT_BUCKETS_H
#define NMT_BUCKETS_H

#include <stddef.h>

#include "nmt/comm.h"
#include "nmt/prof.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Floats a shard slice is a multiple of (64 bytes: vector loads, NCCL's alignment). */
enum { NMT_SHARD_ALIGN = 16 };

typedef struct {
  size_t n_params;      /* gradient floats (the model's parameters) */
  size_t total_floats;  /* zero 0: n_params + the trailing slots; zero >= 1: the padded
                           parameter span (the slots follow at extra_offset) */
  size_t bucket_floats; /* floats per bucket (the last bucket may be shorter) */
  int n_buckets;
  int zero;             /* 0: buckets are all-reduced; >= 1: reduce-scattered (ZeRO) */
  int n_ranks;          /* ranks the slices are cut for (1 with zero 0) */
  size_t extra_offset;  /* where the trailing slots live: n_params, or the padded span */
  size_t shard_floats;  /* floats one rank owns: the whole buffer with zero 0, else the sum of
                           its slices = total_floats / n_ranks */
} nmt_bucket_plan;

/* The plan for a buffer of n_params + extra floats and buckets of bucket_mb MiB of fp32:
 * bucket_floats = max(1, floor(bucket_mb * 2^20 / 4)), capped at the total; n_buckets =
 * ceil(total / bucket_floats). Errors: NMT_ERR_USAGE when bucket_mb is not > 0 or the count
 * exceeds max_buckets (0 = no limit; the message names both). */
nmt_status nmt_bucket_plan_make(double bucket_mb, size_t n_params, size_t extra,
                                size_t max_buckets, nmt_bucket_plan *out);

/* The ZeRO plan for n_params gradients over n_ranks: bucket_floats = max(1, floor(bucket_mb x
 * 2^20 / 4)) rounded UP to a multiple of n_ranks x NMT_SHARD_ALIGN (and no larger than the
 * padded parameters), n_buckets = ceil(n_params / bucket_floats), the last bucket padded to a
 * multiple of n_ranks x NMT_SHARD_ALIGN. zero is the stage recorded in the plan (1 or 2).
 * Errors: as nmt_bucket_plan_make; NMT_ERR_CONFIG for n_ranks < 1 or zero not 1 or 2. */
nmt_status nmt_bucket_plan_make_sharded(double bucket_mb, size_t n_params, int n_ranks, int zero,
                                        size_t max_buckets, nmt_bucket_plan *out);

/* Bucket b covers floats [*begin, *end) of the buffer (0 <= b < n_buckets; with ZeRO the last
 * bucket's range includes its pad). */
void nmt_bucket_range(const nmt_bucket_plan *p, int b, size_t *begin, size_t *end);

/* Rank `rank`'s slice of bucket b: floats [*begin, *begin + *len) of the flat buffer, stored
 * at [*shard_off, *shard_off + *len) of the rank's shard. With zero 0 the one "slice" is the
 * whole bucket at its own offset. */
void nmt_bucket_slice(const nmt_bucket_plan *p, int b, int rank, size_t *begin, size_t *len,
                      size_t *shard_off);

/* Sums floats [begin, end) of `grads` over the communicator's ranks: the part below
 * plan->n_params in `wire` (fp32, or a rounded fp16/bf16 copy: nmt_comm_allreduce_sum_as),
 * the trailing slots in fp32. With ZeRO, [begin, end) is a bucket's padded range and is
 * reduce-scattered (nmt_comm_reduce_scatter_sum_as): each rank receives its slice's sum.
 * With n_ranks == 1 it only checks `abort` (may be NULL) and returns NMT_ERR_ABORTED when
 * raised. Errors: the communicator's. */
nmt_status nmt_bucket_reduce(const nmt_bucket_plan *plan, nmt_comm *comm, int n_ranks,
                             nmt_grad_dtype wire, atomic_int *abort, float *grads, size_t begin,
                             size_t end);

/* One rank's progress through the plan during a backward. */
typedef struct {
  const nmt_bucket_plan *plan;
  nmt_comm *comm;
  int n_ranks;
  nmt_grad_dtype wire;
  atomic_int *abort;
  float *grads;            /* the rank's flat gradient buffer (device memory on a GPU) */
  nmt_prof_track *prof;    /* optional: one range per bucket, named by range_ids[b] */
  const int *range_ids;
  int active;              /* reduce during this backward (the step's last micro-batch) */
  int next;                /* the first bucket not yet reduced */
  int extras_done;         /* ZeRO: the trailing slots have been all-reduced */
  int fail_at_bucket;      /* testing: >= 0 makes this rank fail when it reaches this bucket
                              (failure injection inside a collective; -1 = never) */
} nmt_bucket_reducer;

/* Binds a reducer to a plan, a rank's communicator and gradient buffer. prof/range_ids may be
 * NULL (no profiler ranges). */
void nmt_bucket_reducer_init(nmt_bucket_reducer *r, const nmt_bucket_plan *plan, nmt_comm *comm,
                             int n_ranks, nmt_grad_dtype wire, atomic_int *abort, float *grads,
                             nmt_prof_track *prof, const int *range_ids);
/* Starts a backward: active = 1 on the step's last micro-batch (earlier ones only accumulate,
 * DDP's no_sync), 0 otherwise. */
void nmt_bucket_reducer_begin(nmt_bucket_reducer *r, int active);
/* The model's nmt_grad_ready_fn (user = the reducer): reduces every bucket whose end is at or
 * below `ready` floats (with ZeRO: whose parameters end there; the pad is never written), and
 * with ZeRO, once `ready` covers the trailing slots (n_params + NMT_GRAD_EXTRA, the model's
 * last report), all-reduces them at extra_offset. Errors: the communicator's. */
nmt_status nmt_bucket_reducer_on_ready(void *user, size_t ready);
/* After an active backward: NMT_ERR_INTERNAL naming `rank` unless every bucket was reduced
 * (the model's ready reports must cover the whole buffer). */
nmt_status nmt_bucket_reducer_finish(const nmt_bucket_reducer *r, int rank);

#ifdef __cplusplus
}
#endif
#endif /* NMT_BUCKETS_H */
