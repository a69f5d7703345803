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
 * are all-reduced in fp32 after the last bucket. That is stage 1's layout.
 *
 * ZeRO stage 2 (parallel.zero = 2; Rajbhandari et al. 2020 §5.2, "P_os+g"): no flat gradient
 * buffer exists. The buckets are the model's backward stages (nmt_model_grad_stages: one per
 * layer, the final LayerNorms, the embedding), each padded to a multiple of n_ranks x
 * NMT_SHARD_ALIGN floats in the WINDOW and the SHARD only (the parameter buffer stays
 * n_params floats). Backward writes each stage into a zeroed stage-sized window
 * (nmt_model_backward_sink), and as a window closes it is
 * reduce-scattered and the rank's slice added into its shard-sized fp32 gradient
 * accumulator, on EVERY micro-batch (DeepSpeed's ZeRO-2 reduces each micro-batch the same
 * way: a rank cannot keep a micro-batch's full gradient for the next one without the memory
 * stage 2 exists to save). Two windows alternate, so that on a GPU the reduce-scatter of one
 * runs on the comm stream while the next stage computes into the other; the slice is added
 * to the shard only when the window is needed again (nmt_grad_windows). The tied embedding
 * (the last bucket), written at the start, middle and end of backward, keeps a third window
 * of its own open through the whole backward, so its three parts are summed in zero 0's
 * order and reduced once. A rank's gradient memory is then its shard + 2 windows of the
 * largest stage + 1 of the embedding + the trailing slots, which are kept after the shard
 * and all-reduced in fp32 once per step (nmt_grad_windows_floats). Sums differ from stage
 * 0/1 only in order, and only with accum_steps > 1: every micro-batch is summed over ranks
 * before micro-batches are added (with one micro-batch the losses are bitwise stage 0's).
 *
 * defines: nmt_bucket_plan, nmt_bucket_plan_make, nmt_bucket_plan_make_sharded,
 *          nmt_bucket_plan_make_stages, nmt_bucket_plan_free, nmt_bucket_slice,
 *          nmt_bucket_slice_floats, NMT_SHARD_ALIGN, nmt_bucket_range, nmt_bucket_reducer,
 *          nmt_bucket_reducer_init, nmt_bucket_reducer_begin, nmt_bucket_reducer_on_ready,
 *          nmt_bucket_reducer_finish, nmt_bucket_reduce, nmt_grad_windows,
 *          nmt_grad_windows_init, nmt_grad_windows_begin, nmt_grad_windows_open,
 *          nmt_grad_windows_close, nmt_grad_windows_finish, nmt_grad_windows_floats,
 *          nmt_bucket_plan_make_model_stages, nmt_plan_bytes, nmt_bucket_plan_bytes
 */
#ifndef NMT_BUCKETS_H
#define NMT_BUCKETS_H

#include <stddef.h>

#include "nmt/backend.h"
#include "nmt/comm.h"
#include "nmt/model.h"
#include "nmt/prof.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Floats a shard slice is a multiple of (64 bytes: vector loads, NCCL's alignment). */
enum { NMT_SHARD_ALIGN = 16 };

typedef struct {
  size_t n_params;      /* gradient floats (the model's parameters) */
  size_t total_floats;  /* zero 0: n_params + the trailing slots; zero 1: the padded
                           parameter span (the slots follow at extra_offset); zero 2: the sum
                           of the padded buckets (n_ranks x shard_floats) */
  size_t bucket_floats; /* zero 0, 1: floats per bucket (the last bucket may be shorter);
                           zero 2: the largest padded bucket, a window's size */
  int n_buckets;
  int zero;             /* 0: buckets are all-reduced; >= 1: reduce-scattered (ZeRO) */
  int n_ranks;          /* ranks the slices are cut for (1 with zero 0) */
  size_t extra_offset;  /* where the trailing slots live: n_params, or the padded span;
                           zero 2: shard_floats (behind the rank's gradient shard) */
  size_t shard_floats;  /* floats one rank owns: the whole buffer with zero 0, else the sum of
                           its slices = total_floats / n_ranks */
  size_t *bounds;       /* zero 2: n_buckets + 1 parameter offsets, bucket b's parameters are
                           [bounds[b], bounds[b+1]); NULL otherwise */
  size_t *shard_offs;   /* zero 2: n_buckets + 1 offsets of the buckets' slices in the shard */
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
 * multiple of n_ranks x NMT_SHARD_ALIGN. zero is the stage recorded in the plan: 1 (stage 2's
 * plan is nmt_bucket_plan_make_stages'). Errors: as nmt_bucket_plan_make; NMT_ERR_CONFIG for
 * n_ranks < 1 or zero not 1. */
nmt_status nmt_bucket_plan_make_sharded(double bucket_mb, size_t n_params, int n_ranks, int zero,
                                        size_t max_buckets, nmt_bucket_plan *out);

/* The ZeRO stage 2 plan over n_ranks for backward stages [bounds[i], bounds[i+1]), i <
 * n_stages (nmt_model_grad_stages: bounds[0] = 0, increasing, bounds[n_stages] = n_params):
 * one bucket per stage, padded to a multiple of n_ranks x NMT_SHARD_ALIGN floats; rank r's
 * slice of bucket b is window floats [r x slice_b, (r+1) x slice_b) with slice_b = padded / n,
 * i.e. parameters [bounds[b] + r x slice_b, ...) clipped to the bucket, stored at
 * shard_offs[b] of the shard. parallel.bucket_mb plays no part. The plan owns two arrays:
 * nmt_bucket_plan_free releases them. Errors: NMT_ERR_CONFIG for n_ranks < 1 or n_stages < 1;
 * NMT_ERR_INTERNAL for bounds that do not start at 0 and increase; NMT_ERR_NOMEM. */
nmt_status nmt_bucket_plan_make_stages(const size_t *bounds, int n_stages, int n_ranks,
                                       nmt_bucket_plan *out);
/* Frees what a plan owns (stage 2's arrays; nothing otherwise) and clears the pointers. */
void nmt_bucket_plan_free(nmt_bucket_plan *p);

/* Bucket b covers floats [*begin, *end) of the buffer (0 <= b < n_buckets; with zero 1 the
 * last bucket's range includes its pad; with zero 2 it is the stage's parameters, unpadded). */
void nmt_bucket_range(const nmt_bucket_plan *p, int b, size_t *begin, size_t *end);

/* Rank `rank`'s slice of bucket b: parameters [*begin, *begin + *len) of the flat buffer,
 * stored at [*shard_off, ...) of the rank's shard. With zero 0 the one "slice" is the whole
 * bucket at its own offset; with zero 1 *len is the whole slice (its pad lies in the padded
 * parameter buffer); with zero 2 *len counts only the slice's parameters (0 for a slice
 * wholly in the bucket's pad, with *begin the bucket's end). */
void nmt_bucket_slice(const nmt_bucket_plan *p, int b, int rank, size_t *begin, size_t *len,
                      size_t *shard_off);
/* Floats one rank owns of bucket b, pad included: the count of the bucket's reduce-scatter
 * and all-gather (the padded bucket is n_ranks times it); the whole bucket with zero 0. */
size_t nmt_bucket_slice_floats(const nmt_bucket_plan *p, int b);

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

/* ZeRO stage 2's reducer: one rank's gradient windows (two alternating, one held for the
 * embedding) and shard accumulator during a step, driven by the model as an nmt_grad_sink
 * (user = this struct; nmt_grad_windows_open and nmt_grad_windows_close have the sink's
 * signatures). */
typedef struct {
  const nmt_bucket_plan *plan; /* a stage 2 plan */
  const nmt_backend *be;
  void *ctx;                   /* the rank's device context (the windows' and shard's) */
  nmt_comm *comm;              /* bound once the group exists */
  int rank;                    /* global rank: which slice is this rank's */
  nmt_grad_dtype wire;
  atomic_int *abort;
  float *window[3];            /* [0], [1]: plan->bucket_floats floats each, alternating;
                                  [2]: the held bucket's padded floats */
  float *shard;                /* the rank's fp32 gradient accumulator, plan->shard_floats */
  nmt_prof_track *prof;        /* optional: one range per reduce-scatter, range_ids[b] */
  const int *range_ids;
  int fail_at_bucket;          /* testing: >= 0 fails this rank before that bucket's
                                  reduce-scatter (-1 = never) */
  int open_bucket, open_window;       /* the window backward writes (-1: none) */
  int pending_bucket, pending_window; /* reduce-scattered (maybe still in flight on the comm
                                         stream), not yet added to the shard (-1: none) */
  int held_bucket;             /* the plan's last bucket (the embedding's), which the model
                                  opens first and closes last (nmt_model_backward_sink) */
  int held_open;               /* its window is open */
  int closed;                  /* windows closed since nmt_grad_windows_begin */
} nmt_grad_windows;

/* ZeRO stage 2's plan for model mc over n_ranks: nmt_model_grad_stages' bounds through
 * nmt_bucket_plan_make_stages (the trainer's plan; `nmt bench scaling` predicts memory with
 * it). Errors: NMT_ERR_NOMEM; as nmt_bucket_plan_make_stages. */
nmt_status nmt_bucket_plan_make_model_stages(const nmt_model_cfg *mc, int n_ranks,
                                             nmt_bucket_plan *out);

/* What one worker allocates for its flat buffers under plan p, bytes (src/engine/replica.c
 * allocates exactly these; `nmt bench scaling` reports them): weights = 4 x span, + 2 x span
 * for the half copy when `half`, span = the padded total_floats at stage 1, else n_params;
 * grad_buf = 4 x (extra_offset + NMT_GRAD_EXTRA) (stage 2: the shard accumulator and the
 * slots); grads = grad_buf + 4 x nmt_grad_windows_floats(p); optim = Adam m + v, 8 x
 * shard_floats with ZeRO, else 8 x n_params. */
typedef struct {
  size_t weights, grad_buf, grads, optim;
} nmt_plan_bytes;
void nmt_bucket_plan_bytes(const nmt_bucket_plan *p, int half, nmt_plan_bytes *out);

/* Floats of device memory the windows of stage-2 plan p take: 2 x p->bucket_floats (the
 * alternating pair) + the last bucket's padded size (held); 0 for another stage. */
size_t nmt_grad_windows_floats(const nmt_bucket_plan *p);

/* Binds the windows (nmt_grad_windows_floats(plan) floats of device memory of ctx) and the shard
 * (plan->shard_floats + NMT_GRAD_EXTRA floats, the trailing slots at plan->extra_offset). The
 * communicator is set later (g->comm); prof/range_ids may be NULL. */
void nmt_grad_windows_init(nmt_grad_windows *g, const nmt_bucket_plan *plan,
                           const nmt_backend *be, void *ctx, int rank, nmt_grad_dtype wire,
                           atomic_int *abort, float *windows, float *shard,
                           nmt_prof_track *prof, const int *range_ids);
/* Starts a step (the shard is already zeroed): nothing open, nothing pending. */
void nmt_grad_windows_begin(nmt_grad_windows *g);
/* The sink's open: [begin, end) must be bucket b of the plan. The held bucket gets window[2];
 * any other, the alternating window other than the pending one. The window is memset to zero
 * over the padded bucket (so the pad sums to 0), *window = it. Errors: NMT_ERR_INTERNAL for a
 * range that is not a bucket, the held bucket opened twice or after another, or a second
 * window besides the held one; the backend's. */
nmt_status nmt_grad_windows_open(void *user, size_t begin, size_t end, float **window);
/* The sink's close: first the pending window's reduce-scatter is joined (nmt_comm_flush) and
 * its slice added into the shard (be->add), then this window is reduce-scattered in `wire`
 * (nmt_bucket_reduce: enqueued on the comm stream on GPUs) and becomes the pending one.
 * Errors: NMT_ERR_INTERNAL for a range other than the open window's, or the injected failure
 * ("injected failure on rank R in the collective of bucket B"); the communicator's. */
nmt_status nmt_grad_windows_close(void *user, size_t begin, size_t end);
/* Ends a step's backward passes: joins and adds the pending window, then all-reduces the
 * trailing slots at shard + plan->extra_offset in fp32 (with one rank: only the abort check).
 * The caller flushes before reading the shard. Errors: NMT_ERR_INTERNAL naming `rank` when a
 * window is still open or fewer windows closed than the plan has buckets; the communicator's. */
nmt_status nmt_grad_windows_finish(nmt_grad_windows *g);

#ifdef __cplusplus
}
#endif
#endif /* NMT_BUCKETS_H */
