/* zero.h — ZeRO's sharded optimizer step on one replica (src/engine/, not public; zero.c has
 * the algorithm, nmt/buckets.h the layouts). It needs the replica's device state and AdamW's
 * hyperparameters, nothing of the worker's step loop or of the trainer.
 *
 * defines: nmt__zero_update, nmt__zero_load_moments, nmt__zero_save_moments,
 *          nmt__zero_copy_grads, nmt__zero_gathers_in_place
 */
#ifndef NMT_ENGINE_ZERO_H
#define NMT_ENGINE_ZERO_H

#include "nmt/config.h"
#include "replica.h"

/* The optimizer step after the buckets were reduce-scattered into r's slices: the norm from
 * the slices' sums of squares (one 1-float all-reduce), step_decide with `policy` into
 * r->dev_ctl (step + 1 is the 1-based step), AdamW with learning rate lr and cfg's
 * train.adam_beta1/2, adam_eps, weight_decay on the owned slices, then the all-gather of the
 * updated weights (and the half copy re-rounded). Enqueued; NCCL's collectives are joined by
 * flushes. Errors: the backend's and the communicator's; NMT_ERR_ABORTED when the run's abort
 * flag is up with one rank (no collective to see it). */
nmt_status nmt__zero_update(nmt__replica *r, const nmt_config *cfg, long step, float lr,
                            nmt_step_policy policy);
/* The rank's shard of the consolidated moments host_m / host_v (n_params floats each) into
 * r->m / r->v (the pad zeroed), and back. Blocking copies. Errors: the backend's. */
nmt_status nmt__zero_load_moments(nmt__replica *r, const float *host_m, const float *host_v);
nmt_status nmt__zero_save_moments(nmt__replica *r, float *host_m, float *host_v);
/* Stage 2 (tests' keep_last_grads): the rank's reduced gradient slices at their parameter
 * offsets of host (n_params floats, zero elsewhere), then the trailing slots. */
nmt_status nmt__zero_copy_grads(nmt__replica *r, float *host);
/* 1 when stage-2 plan p's parameter all-gather can run in place with one flush: every bucket
 * but the last spans (n_ranks slices from its first parameter) no further than n_params.
 * Else (an embedding smaller than a bucket's pad) each bucket goes through a window with a
 * flush of its own. 0 for a plan of another stage. */
int nmt__zero_gathers_in_place(const nmt_bucket_plan *p);

#endif /* NMT_ENGINE_ZERO_H */
