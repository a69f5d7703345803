/* nmt/loader.h — how one optimizer step's batches are dealt to the workers.
 *
 * An optimizer step takes the next devices x accum_steps batches of the epoch order
 * (nmt_batcher_epoch_order). The loader threads (src/engine/loader.c) deal them so every
 * worker gets exactly accum_steps batches and the workers' target-token counts balance:
 * largest batch first, each to the least-loaded worker that still needs batches (the greedy
 * LPT rule, Graham 1969). A batch's index k in the step's list keys its dropout stream, so the
 * deal changes who computes a batch, never what is computed: (devices, accum_steps) = (4,1),
 * (2,2) and (1,4) give the same update (docs/ARCHITECTURE.md "Dropout is counter-based").
 *
 * defines: nmt_loader_deal
 */
#ifndef NMT_LOADER_H
#define NMT_LOADER_H

#ifdef __cplusplus
extern "C" {
#endif

/* Deals K = n_workers * per_worker batches with target-token counts tokens[0..K-1]:
 * owner[k] = the worker (0..n_workers-1) that gets batch k. Ties go to the lower-numbered
 * worker and the sort is stable (equal counts keep list order), so the deal is a pure function
 * of its inputs, the same on every loader thread. `order` is scratch of K ints, `load` of
 * n_workers longs and `count` of n_workers ints (callers keep them on their stack). */
void nmt_loader_deal(const long *tokens, int n_workers, int per_worker, int *owner, int *order,
                     long *load, int *count);

#ifdef __cplusplus
}
#endif
#endif /* NMT_LOADER_H */
