/* loader.c — the loader threads: each optimizer step's batches, dealt to the workers.
 *
 * For each step a loader takes the next devices x accum_steps batches of the epoch order,
 * deals them (nmt_loader_deal, include/nmt/loader.h), fills preallocated host slots of its own
 * workers (r % n_loaders == its index) and pushes them into one SPSC ring per worker; workers
 * return slots through a second ring. Every loader computes the whole deal (a sort of
 * devices x accum numbers), so no loader waits for another, and each ring keeps one producer.
 * No allocation and no lock per step. A loader's waits end at the segment's end or on the
 * run's abort flag.
 */
#include "nmt/loader.h"

#include <stdlib.h>

#include "loader.h"
#include "nmt/log.h"

void nmt_loader_deal(const long *tokens, int n_workers, int per_worker, int *owner, int *order,
                     long *load, int *count) {
  const int K = n_workers * per_worker;
  for (int k = 0; k < K; k++) order[k] = k;
  /* Largest batch first (a stable insertion sort: K is small). */
  for (int i = 1; i < K; i++)
    for (int j = i; j > 0 && tokens[order[j]] > tokens[order[j - 1]]; j--) {
      int x = order[j];
      order[j] = order[j - 1];
      order[j - 1] = x;
    }
  for (int d = 0; d < n_workers; d++) load[d] = 0, count[d] = 0;
  for (int i = 0; i < K; i++) {
    int best = -1;
    for (int d = 0; d < n_workers; d++)
      if (count[d] < per_worker && (best < 0 || load[d] < load[best])) best = d;
    owner[order[i]] = best;
    load[best] += tokens[order[i]];
    count[best]++;
  }
}

/* Next data position; a new epoch reshuffles into the loader's own perm (no shared cache). */
static void advance(const nmt__loader *L, long *epoch, long *index, long *perm) {
  if (++*index >= nmt_batcher_num_batches(L->batcher)) {
    *index = 0;
    ++*epoch;
    nmt_batcher_epoch_order(L->batcher, *epoch, perm);
  }
}

/* Fills a free slot of local worker `owner` with batch `id` of `step` and hands it over. */
static nmt_status push_batch(nmt__loader *L, int owner, long id, long step, int k,
                             double step_flops, long epoch, long index) {
  nmt__feed *f = &L->feeds[owner];
  void *p;
  nmt_prof_push(L->prof, L->range_data_wait, NMT_PROF_OTHER, 0, 0);
  /* Ended by the segment's end (shutdown) or the run's abort: the flag can rise before any
   * worker recorded an error (a peer process's failure seen by the rendezvous watch or a
   * communicator), and a worker that failed may keep a slot out of the rings (worker.c
   * hand_back_ahead), so the wait must not depend on shutdown alone. */
  nmt_status ws = nmt_ring_pop_any(&f->free_slots, &p, &L->sync->shutdown, &L->sync->abort);
  nmt_prof_pop(L->prof);
  if (ws != NMT_OK) return ws;
  nmt__batch_slot *s = p;
  int ns, sl, tl;
  long tt;
  nmt_batcher_shape(L->batcher, id, &ns, &sl, &tl, &tt);
  nmt_batch_layout(&s->b, s->buf, ns, sl, tl);
  nmt_prof_push(L->prof, L->range_load, NMT_PROF_OTHER, 0, 0);
  nmt_batcher_fill(L->batcher, id, &s->b);
  nmt_prof_pop(L->prof);
  s->step = step;
  s->k = k;
  s->step_flops = step_flops;
  s->next_epoch = epoch;
  s->next_index = index;
  return nmt_ring_push_any(&f->batches, s, &L->sync->shutdown, &L->sync->abort);
}

void *nmt__loader_main(void *arg) {
  nmt__loader *L = arg;
  /* The deal covers every rank of the world; this process fills its own ranks' rings. */
  const int W = L->world, K = W * L->accum;
  long ids[K], tok[K];
  int order[K], owner[K], count[W];
  long load[W];
  long epoch = L->start_epoch, index = L->start_index;
  const long nb = nmt_batcher_num_batches(L->batcher);
  /* The resume maps a checkpoint's position into this order (nmt_ckpt_data_resume) and
   * advance() keeps it there; never read outside the order whatever the caller passed. */
  if (epoch < 0 || index < 0 || index >= nb) {
    nmt__sync_record_error(L->sync, -1,
                           nmt_errorf(NMT_ERR_INTERNAL, "loader: data position (epoch %ld, "
                                      "index %ld) outside the epoch order of %ld batches",
                                      epoch, index, nb));
    return NULL;
  }
  long *perm = malloc((size_t)nb * sizeof *perm);
  if (!perm) {
    nmt__sync_record_error(L->sync, -1, nmt_errorf(NMT_ERR_NOMEM, "loader: epoch order"));
    return NULL;
  }
  nmt_batcher_epoch_order(L->batcher, epoch, perm);
  nmt_prof_track_bind_thread(L->prof);
  for (long step = L->start_step; step < L->end_step; step++) {
    nmt_prof_step_begin(L->prof, step + 1);
    double step_flops = 0;
    for (int k = 0; k < K; k++) {
      int ns, sl, tl;
      ids[k] = perm[index];
      nmt_batcher_shape(L->batcher, ids[k], &ns, &sl, &tl, &tok[k]);
      step_flops += nmt_model_train_flops(L->mcfg, ns, sl, tl);
      advance(L, &epoch, &index, perm);
    }
    nmt_loader_deal(tok, W, L->accum, owner, order, load, count);
    /* Push in k order per worker, so micro-batch order is a function of the step only. */
    for (int k = 0; k < K; k++) {
      const int local = owner[k] - L->first_rank;
      if (local < 0 || local >= L->n_local || local % L->n_loaders != L->index) continue;
      if (push_batch(L, local, ids[k], step, k, step_flops, epoch, index) != NMT_OK) goto out;
    }
    nmt_prof_step_end(L->prof); /* host clock: cannot fail */
  }
out:
  free(perm);
  return NULL;
}

int nmt__loader_threads(const nmt_config *cfg) {
  int n = cfg->data_loader_threads < cfg->parallel_devices ? cfg->data_loader_threads
                                                             : cfg->parallel_devices;
  const char *e = getenv("SLURM_CPUS_PER_TASK");
  char *end;
  long cpus = e && *e ? strtol(e, &end, 10) : 0;
  if (e && *e && !*end && cpus >= 1) {
    if (n > cpus) {
      nmt_log(NMT_LOG_INFO, "SLURM_CPUS_PER_TASK = %ld: %ld loader thread(s) instead of %d",
              cpus, cpus, n);
      n = (int)cpus;
    }
    if (cfg->parallel_device == NMT_DEVICE_CPU && cfg->parallel_devices > cpus)
      nmt_log(NMT_LOG_WARN, "parallel.devices = %d CPU workers on SLURM_CPUS_PER_TASK = %ld "
              "CPUs: oversubscribed, steps will be slower", cfg->parallel_devices, cpus);
  }
  return n < 1 ? 1 : n;
}
