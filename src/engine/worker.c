/* worker.c — a worker thread: the step loop of one device, and the host's end of each step.
 *
 * Per step the host enqueues the micro-batches' forward and backward (the last one's backward
 * reduces the gradient buckets as they become final: nmt/buckets.h), step_control (norm, fp16
 * skip, loss scale, clip: decided on the device) and AdamW, then the asynchronous read of the
 * step's control block; it then reads the PREVIOUS step's block, which is complete or nearly
 * so: the device always has the step just enqueued to work on, and no step waits for the
 * host. On the ref backend every op is synchronous anyway.
 *
 * Batches are double-buffered: before a micro-batch's forward is enqueued the worker pops the
 * NEXT micro-batch and starts its copy into the other device staging slot on the copy stream
 * (h2d_async); the compute stream waits for a slot's copy (h2d_acquire) and marks when it is
 * done reading it (h2d_release); the host slot goes back to the loader once its copy has read
 * it (h2d_wait_src), also when the loop ends with a batch fetched ahead (after an error, only
 * if that copy is seen to have finished: hand_back_ahead).
 */
#include <math.h>
#include <string.h>

#include <sched.h>

#include "nmt/clock.h"
#include "nmt/log.h"
#include "worker.h"
#include "zero.h"

/* Runs `expr` (an nmt_status) inside profiler range `name` on `track` with cost `cost`; the
 * range is closed before an error is returned. */
#define NMT__PROFILED(track, name, phase, cost, expr)                \
  do {                                                               \
    nmt_prof_cost pc_ = (cost);                                      \
    nmt_prof_push((track), (name), (phase), pc_.flops, pc_.bytes);   \
    nmt_status ps_ = (expr);                                         \
    nmt_prof_pop(track);                                             \
    NMT_TRY(ps_);                                                    \
  } while (0)
#define NMT__NO_COST ((nmt_prof_cost){0, 0})

/* ------------------------------------------------------------------------------------------ */
/* batches                                                                                    */

/* Host and device batches share nmt_batch_layout over their own buffers, so one copy of the
 * block from the host buffer's start to the end of its last array moves the whole batch:
 * these are its bytes. */
static size_t batch_bytes(const int32_t *host_buf, const nmt_batch *h) {
  const int32_t *end = h->src + (size_t)h->n_sent * h->src_len;
  const int32_t *e[] = {h->tgt_in + (size_t)h->n_sent * h->tgt_len,
                        h->tgt_out + (size_t)h->n_sent * h->tgt_len, h->src_lens + h->n_sent,
                        h->tgt_lens + h->n_sent};
  for (int i = 0; i < 4; i++)
    if (e[i] > end) end = e[i];
  return (size_t)(end - host_buf) * sizeof(int32_t);
}

/* *d describes host batch *h laid out over the device buffer `buf`. */
static void dev_batch_over(int32_t *buf, const nmt_batch *h, nmt_batch *d) {
  nmt_batch_layout(d, buf, h->n_sent, h->src_len, h->tgt_len);
  d->src_tokens = h->src_tokens;
  d->tgt_tokens = h->tgt_tokens;
  d->epoch = h->epoch;
  d->index = h->index;
}

/* Training: pops the next batch of this worker (it must belong to `step`) and starts its copy
 * into staging slot `slot` on the copy stream. The host slot (page-locked memory) stays with
 * the worker until the copy has read it (take_batch). */
static nmt_status fetch_batch(nmt__worker *w, long step, int slot) {
  nmt__replica *r = &w->rep;
  void *p;
  NMT__PROFILED(r->prof, w->rn->data_wait, NMT_PROF_OTHER, NMT__NO_COST,
                nmt_ring_pop(&r->feed->batches, &p, r->abort));
  nmt__batch_slot *s = p;
  w->ahead = s, w->ahead_slot = slot, w->ahead_copying = 0;
  if (s->step != step)
    return nmt_errorf(NMT_ERR_INTERNAL, "rank %d expected a batch of step %ld, got %ld",
                      r->rank, step, s->step);
  size_t bytes = batch_bytes(s->buf, &s->b);
  /* From here the copy engine may read the slot, also when h2d_async reports an error. */
  w->ahead_copying = 1;
  NMT__PROFILED(r->prof, w->rn->h2d, NMT_PROF_OTHER, nmt_prof_cost_copy((double)bytes),
                r->be->h2d_async(r->ctx, slot, r->dev_stage[slot], s->buf, bytes));
  return NMT_OK;
}

/* Makes the batch fetched ahead the current one: the compute stream waits for its copy, and
 * once the copy has read the host slot, the slot goes back to the loader. *d describes the
 * batch in dev_stage[*slot]; *out keeps the host slot's bookkeeping (step, k, positions). */
static nmt_status take_batch(nmt__worker *w, nmt_batch *d, nmt__batch_slot *out, int *slot) {
  nmt__replica *r = &w->rep;
  const nmt_backend *be = r->be;
  nmt__batch_slot *s = w->ahead;
  *slot = w->ahead_slot;
  NMT_TRY(be->h2d_acquire(r->ctx, *slot));
  NMT_TRY(be->h2d_wait_src(r->ctx, *slot));
  *out = *s;
  dev_batch_over(r->dev_stage[*slot], &s->b, d);
  w->ahead = NULL, w->ahead_copying = 0;
  return nmt_ring_push(&r->feed->free_slots, s, r->abort);
}

/* The batch fetched ahead when the loop ended: its host slot goes back to the loader only
 * once its copy has read it (h2d_wait_src). After a stop the next segment restarts from the
 * last completed step and refills it. After an error the abort flag is already up, which
 * bounds the wait: it succeeds at once if the copy is done (the reference copies at once)
 * and returns NMT_ERR_ABORTED otherwise (cuda polls the copy's event before the flag), and
 * the slot, which the copy engine may still be reading, then goes to neither ring: the run
 * is over, and a loader waiting for it ends on the abort flag (loader.c). */
static nmt_status hand_back_ahead(nmt__worker *w) {
  nmt__replica *r = &w->rep;
  nmt__batch_slot *s = w->ahead;
  if (!s) return NMT_OK;
  w->ahead = NULL;
  if (w->ahead_copying) {
    w->ahead_copying = 0;
    nmt_status ws = r->be->h2d_wait_src(r->ctx, w->ahead_slot);
    if (ws != NMT_OK) {
      w->parked = s;
      return ws;
    }
  }
  /* Cannot fail: the ring holds every slot of the worker. */
  nmt_ring_try_push(&r->feed->free_slots, s);
  return NMT_OK;
}

static long stop_ends_after(const nmt__worker *w, long done);

/* The validation loss slots of this rank's share of the valid set, all-reduced. `done` > 0:
 * the validation of that training step, which a stop request cuts short (sync.h): a rank
 * stops at its next batch once the request ends the run after this step, and local rank 0
 * seals the step at the end of its share; the stop slot (out[NMT_GRAD_SLOT_STOP] > 0, reduced
 * with the others) then tells every rank the result is void. 0: nmt_trainer_evaluate. */
static nmt_status validate(nmt__worker *w, double out[NMT_GRAD_EXTRA], long done) {
  nmt__replica *r = &w->rep;
  const nmt_backend *be = r->be;
  NMT_TRY(be->memset_zero(r->ctx, r->dev_valid, NMT_GRAD_EXTRA * sizeof(float)));
  long nb = nmt_batcher_num_batches(w->valid);
  nmt_batch hb, db;
  int cut = 0;
  for (long i = r->grank; i < nb; i += r->world) {
    if (done > 0 && nmt__stop_pending_at(w->sync, done)) {
      cut = 1;
      break;
    }
    int ns, sl, tl;
    long tt;
    nmt_batcher_shape(w->valid, i, &ns, &sl, &tl, &tt);
    nmt_batch_layout(&hb, r->valid_host_buf, ns, sl, tl);
    nmt_batcher_fill(w->valid, i, &hb);
    /* A synchronous copy into the validation buffer. */
    dev_batch_over(r->dev_batch_buf, &hb, &db);
    NMT_TRY(be->copy_h2d(r->ctx, r->dev_batch_buf, r->valid_host_buf,
                         batch_bytes(r->valid_host_buf, &hb)));
    NMT_TRY(nmt_model_forward(r->model, r->params, &db, 0, w->cfg->run_seed, 0, r->dev_valid));
  }
  if (done > 0 && r->rank == 0 && !cut)
    cut = nmt__stop_seal(w->sync, stop_ends_after(w, done + 1));
  if (cut) {
    float one = 1.0f;
    NMT_TRY(be->copy_h2d(r->ctx, r->dev_valid + NMT_GRAD_SLOT_STOP, &one, sizeof one));
  }
  /* With one rank there is nothing to reduce (and a device buffer must not reach the host
   * communicator). */
  if (r->world > 1) NMT_TRY(nmt_comm_allreduce_sum(r->comm, r->dev_valid, NMT_GRAD_EXTRA));
  else if (atomic_load(r->abort)) return NMT_ERR_ABORTED;
  if (r->world > 1) NMT_TRY(nmt_comm_flush(r->comm));
  float h[NMT_GRAD_EXTRA];
  NMT_TRY(be->copy_d2h(r->ctx, h, r->dev_valid, sizeof h));
  for (int i = 0; i < NMT_GRAD_EXTRA; i++) out[i] = h[i];
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* the host's end of a step: control block, metrics, validation, checkpoint                   */

static nmt_status send_msg(nmt__worker *w, const nmt__msg *m) {
  nmt__replica *r = &w->rep;
  void *p;
  NMT_TRY(nmt_ring_pop(&w->mail->free, &p, r->abort));
  *(nmt__msg *)p = *m;
  return nmt_ring_push(&w->mail->full, p, r->abort);
}

void nmt__ckpt_header(const nmt_ckpt_header *base, const nmt__best *b,
                      const nmt__loss_scaler *ls, long step, long epoch, long index,
                      nmt_ckpt_header *h) {
  *h = *base;
  h->step = step;
  h->data_epoch = epoch;
  h->data_index = index;
  h->loss_scale = ls->enabled ? ls->scale : 0.0f;
  h->skipped_steps = ls->skipped;
  h->scale_good_steps = ls->good;
  h->best_metric = (int32_t)b->metric;
  h->best_step = b->step;
  h->best_value = b->value;
  h->best_bad = b->bad;
}

/* Copies the state into the mailbox's snapshot and asks main to write it: rank 0 alone, or with
 * ZeRO every rank its shard of the moments (the ranks are threads of this process, sharing
 * the host snapshot), met at a barrier before rank 0 hands it over. */
static nmt_status snapshot(nmt__worker *w, long step, long epoch, long index) {
  nmt__replica *r = &w->rep;
  /* The writer may still be busy with the previous checkpoint: wait, but never past an abort. */
  while (atomic_load_explicit(&w->mail->busy, memory_order_acquire)) {
    if (atomic_load(r->abort)) return NMT_ERR_ABORTED;
    sched_yield();
  }
  size_t bytes = r->plan->n_params * sizeof(float);
  if (r->plan->zero) {
    NMT_TRY(nmt__zero_save_moments(r, w->mail->m, w->mail->v));
    if (r->world > 1) NMT_TRY(nmt_comm_barrier(r->comm));
    if (r->grank != 0) return NMT_OK;
    NMT_TRY(r->be->copy_d2h(r->ctx, w->mail->params, r->params, bytes));
  } else {
    NMT_TRY(r->be->copy_d2h(r->ctx, w->mail->params, r->params, bytes));
    NMT_TRY(r->be->copy_d2h(r->ctx, w->mail->m, r->m, bytes));
    NMT_TRY(r->be->copy_d2h(r->ctx, w->mail->v, r->v, bytes));
  }
  nmt__msg m = {.kind = NMT__MSG_CHECKPOINT};
  /* Worker 0 wrote pos->best_end before this step's snapshot; main reads it between
   * segments. */
  nmt__ckpt_header(w->ckpt_base, &w->pos->best_end, &w->scaler, step, epoch, index, &m.ckpt);
  atomic_store_explicit(&w->mail->busy, 1, memory_order_release);
  return send_msg(w, &m);
}

/* Peak memory in MiB (backend mem_peak_mb): the process's peak resident set on CPU workers
 * (all of them share it); on GPU workers the device's used memory, sampled at log steps. */
static double peak_mem_mb(nmt__worker *w) {
  nmt__replica *r = &w->rep;
  if (r->be->mem_peak_mb(r->ctx, &r->mem_peak_mb) != NMT_OK) nmt_clear_error();
  return r->mem_peak_mb;
}

/* The metrics of the steps read back since the last log line. */
typedef struct {
  double loss, nll, tokens, flops, t0;
  long steps;
} interval;

/* Whether step `done` is one of train.valid_every's (the run's last step validates too:
 * finish_step). */
static int valid_step(const nmt__worker *w, long done) {
  return w->valid && w->cfg->train_valid_every > 0 && done % w->cfg->train_valid_every == 0;
}

/* Steps whose end needs the device state after exactly that step (validation, a checkpoint,
 * the end of the run or of the segment): their control block is read before the next step is
 * enqueued. Every other step's block is read while the next step runs, except on a host
 * backend (CPU workers): its ops are synchronous, so the enqueue has already run the step and
 * reading late would only delay a stop by one more step (options.lagged_reads keeps the late
 * read there for tests). Deterministic, so every rank reads at the same steps (each rank's
 * validation forward joins a collective). */
static int read_now(const nmt__worker *w, long done) {
  const nmt_config *cfg = w->cfg;
  return (w->rep.be->is_host && !w->opt->lagged_reads) || done == cfg->train_max_steps ||
         done == w->pos->end_step ||
         valid_step(w, done) ||
         (cfg->train_save_every > 0 && done % cfg->train_save_every == 0);
}

/* The step after which a stop sealed into step `done`'s slot ends the run: `done` itself
 * where its block is read at once, else the next step, enqueued before the block is read;
 * never past the segment's end. */
static long stop_ends_after(const nmt__worker *w, long done) {
  const long end = read_now(w, done) ? done : done + 1;
  return end < w->pos->end_step ? end : w->pos->end_step;
}

/* Step `done`'s stop decision (sync.h), as its trailing slots are about to be reduced: local
 * rank 0 writes the stop slot if a stop is requested; otherwise a request from now on goes into
 * the next step. Every rank then reads the same reduced slot. As late as the slot allows: a
 * request that arrives at any time before (forward, backward, the other buckets) still ends the
 * run after this step. */
static nmt_status seal_stop(nmt__worker *w, long done, float *extra) {
  nmt__replica *r = &w->rep;
  /* A step that validates can still stop after itself until its validation is sealed. */
  const long next = valid_step(w, done) ? done : stop_ends_after(w, done + 1);
  if (r->rank != 0 || !nmt__stop_seal(w->sync, next)) return NMT_OK;
  float one = 1.0f;
  return r->be->copy_h2d(r->ctx, extra + NMT_GRAD_SLOT_STOP, &one, sizeof one);
}

/* The model's ready reports of one backward, for the bucket reducer. The last report of the
 * step's last backward makes the trailing slots final and sends them out with the last bucket
 * (ZeRO 1: on their own): the stop is sealed just before. */
typedef struct {
  nmt__worker *w;
  long done;
  float *extra;
} grads_ready;

static nmt_status on_grads_ready(void *user, size_t ready) {
  grads_ready *g = user;
  nmt__replica *r = &g->w->rep;
  if (r->buckets.active && ready >= r->plan->n_params + NMT_GRAD_EXTRA)
    NMT_TRY(seal_stop(g->w, g->done, g->extra));
  return nmt_bucket_reducer_on_ready(&r->buckets, ready);
}

/* Waits for step si's control block, turns its verdict into an error, and mirrors the loss
 * scaler into w->scaler. *out: the block. */
static nmt_status read_block(nmt__worker *w, const nmt__step_info *si, const nmt_step_ctl **out) {
  nmt__replica *r = &w->rep;
  const nmt_config *cfg = w->cfg;
  const int slot = (int)(si->step % NMT_D2H_SLOTS);
  const long done = si->step + 1;
  NMT_TRY(r->be->d2h_wait(r->ctx, slot));
  const nmt_step_ctl *c = *out = &r->host_ctl[slot];
  if (c->step != done)
    return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: read the control block of step %lld, expected "
                      "step %ld", r->rank, (long long)c->step, done);
  const double loss = c->extra[NMT_GRAD_SLOT_LOSS] / c->extra[NMT_GRAD_SLOT_TOKENS];
  switch ((nmt_step_status)c->status) {
    case NMT_STEP_OK: break;
    case NMT_STEP_NO_TOKENS:
      return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: step %ld has no target tokens", r->rank,
                        si->step);
    case NMT_STEP_NONFINITE:
      return nmt_errorf(NMT_ERR_DIVERGED, "step %ld: gradient norm is %g (loss %g)", done,
                        c->gnorm, loss);
    case NMT_STEP_FLOOR:
      return nmt_errorf(NMT_ERR_DIVERGED,
                        "step %ld: the gradient overflowed at loss scale %g, and backing off "
                        "(precision.backoff = %g) would go below precision.floor = %g: "
                        "diverged after %lld skipped steps (loss %g)",
                        done, c->scale_used, cfg->precision_backoff, cfg->precision_floor,
                        (long long)c->skipped + 1, loss);
    default:
      return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: step %ld: unknown step status %d", r->rank,
                        done, (int)c->status);
  }
  if (c->skip && r->rank == 0)
    nmt_log(NMT_LOG_WARN, "step %ld: fp16 gradient overflow, step skipped; loss scale -> %g", done,
            c->scale);
  w->scaler.scale = c->scale;
  w->scaler.good = (long)c->good;
  w->scaler.skipped = c->skipped;
  return NMT_OK;
}

/* Testing (options.step_delay_ms, valid_delay_ms): sleeps ms milliseconds; 0: none. */
static void test_delay(int ms) {
  if (ms <= 0) return;
  const struct timespec d = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&d, NULL);
}

/* The training clock: seconds of nmt_clock_now_s() less those spent validating and writing
 * checkpoints (w->paused_s), which a metrics interval does not count: a validation with BLEU
 * lasts many steps, and timed in, the record after it showed a step of that length. */
static double train_clock(const nmt__worker *w) { return nmt_clock_now_s() - w->paused_s; }

/* Rank 0: the metrics record of the interval ending at this step, sent to main; v: this
 * step's validation (NULL: none). */
static nmt_status send_metrics(nmt__worker *w, const nmt__step_info *si, const nmt_step_ctl *c,
                               const nmt__valid_result *v, interval *iv) {
  nmt__replica *r = &w->rep;
  /* The interval ends when this step's work ended: on a device, now (its control block was
   * just waited for); on CPU workers, whose ops run as they are enqueued, when its enqueue
   * returned: the next step has usually run since (it was enqueued before this block was
   * read), and timing to now would give the interval a step it does not count and leave a
   * step that ends the read-ahead (checkpoint, validation) at 0 ms. */
  const double end = r->be->is_host ? si->enqueued_s : train_clock(w);
  double dt = end - iv->t0;
  nmt__msg m = {.kind = NMT__MSG_METRICS};
  nmt_metrics *mt = &m.metrics;
  mt->step = si->step + 1;
  /* The pass (from 1) of the step's last batch: the one before the position after the step. */
  mt->epoch = si->next_index == 0 ? si->next_epoch : si->next_epoch + 1;
  mt->train_loss = iv->loss / iv->tokens;
  mt->train_nll = iv->nll / iv->tokens;
  mt->lr = si->lr;
  mt->grad_norm = c->gnorm;
  mt->loss_scale = w->scaler.scale;
  mt->skipped_steps = w->scaler.skipped;
  mt->mfu = dt > 0 && w->peak_flops > 0 ? iv->flops / dt / (w->peak_flops * r->world)
                                         : NAN;
  if (mt->mfu > 1.0 || w->mfu_warned) {
    /* More than the peak: the peak is wrong (measured low, or profile.peak_tflops set below
     * the device's), so the fraction means nothing. Said once, then null in metrics.jsonl. */
    if (!w->mfu_warned)
      nmt_log(NMT_LOG_WARN, "MFU %.2f is above 1: the steps ran at %.3g TFLOP/s per worker, "
              "more than the peak of %.3g TFLOP/s (%s); MFU is not reported (null) for this run. "
              "Set [profile] peak_tflops to the device's peak", mt->mfu,
              iv->flops / dt / r->world / 1e12, w->peak_flops / 1e12,
              w->cfg->profile_peak_tflops > 0 ? "[profile] peak_tflops" : "measured at start");
    w->mfu_warned = 1;
    mt->mfu = NAN;
  }
  mt->peak_mem_mb = peak_mem_mb(w);
  mt->tgt_tokens = iv->tokens;
  mt->tgt_tokens_per_s = dt > 0 ? iv->tokens / dt : 0;
  mt->step_ms = 1e3 * dt / (double)iv->steps;
  if (v && v->x[NMT_GRAD_SLOT_TOKENS] > 0) {
    mt->has_valid = 1;
    mt->valid_loss = v->x[NMT_GRAD_SLOT_LOSS] / v->x[NMT_GRAD_SLOT_TOKENS];
    mt->valid_nll = v->x[NMT_GRAD_SLOT_NLL] / v->x[NMT_GRAD_SLOT_TOKENS];
    mt->valid_ppl = exp(mt->valid_nll);
  }
  if (v && v->has_bleu) mt->has_bleu = 1, mt->valid_bleu = v->bleu, mt->valid_chrf = v->chrf;
  mt->best_step = w->best.step;
  mt->best_value = w->best.value;
  mt->best_bad = w->best.bad;
  mt->improved = v && v->improved;
  NMT_TRY(send_msg(w, &m));
  *iv = (interval){.t0 = end};
  return NMT_OK;
}

/* This step's validation: the loss, and with train.valid_bleu its BLEU (rank 0 decodes). */
static nmt_status validate_all(nmt__worker *w, long done, nmt__valid_result *v, int *cut) {
  nmt__replica *r = &w->rep;
  /* Evaluation forwards are not training modules: keep them out of the module rows. */
  NMT_TRY(nmt_model_set_profiler(r->model, NULL));
  NMT__PROFILED(r->prof, w->rn->validate, NMT_PROF_OTHER, NMT__NO_COST, validate(w, v->x, done));
  test_delay(w->opt->valid_delay_ms);
  /* A stop request cut it short (the same reduced slot on every rank): no result, no BLEU. */
  *cut = v->x[NMT_GRAD_SLOT_STOP] > 0;
  if (w->cfg->train_valid_bleu && !*cut)
    NMT__PROFILED(r->prof, w->rn->validate, NMT_PROF_OTHER, NMT__NO_COST,
                  nmt__valid_bleu(r, w->vbleu, done, w->pos->t_start, v));
  return nmt_model_set_profiler(r->model, r->prof);
}

/* The host's end of a step: reads the control block step_control wrote (waiting for the
 * device only if the step has not finished), and logs, validates and checkpoints where due.
 * `final`: no later step has been enqueued (the device state is this step's), which read_now
 * guarantees for validation and checkpoint steps. `stop_seen`: an earlier block carried the
 * stop flag, so this step is the last. *stop: this step ends the loop, or (not final) the
 * next one must. */
static nmt_status finish_step(nmt__worker *w, const nmt__step_info *si, int final, int stop_seen,
                              interval *iv, int *stop) {
  nmt__replica *r = &w->rep;
  const nmt_config *cfg = w->cfg;
  const long done = si->step + 1;
  const nmt_step_ctl *c;
  NMT_TRY(read_block(w, si, &c));
  *stop = stop_seen || c->extra[NMT_GRAD_SLOT_STOP] > 0;
  int last = final && (done == cfg->train_max_steps || *stop);
  const int seg_end = done == w->pos->end_step; /* a shorter nmt_trainer_train segment ends here */
  if (r->rank == 0) {
    w->pos->pos_epoch = si->next_epoch, w->pos->pos_index = si->next_index; /* main, after join */
    w->pos->scaler_end = w->scaler;
    atomic_store(&w->sync->steps_done, done);
  }
  iv->loss += c->extra[NMT_GRAD_SLOT_LOSS], iv->nll += c->extra[NMT_GRAD_SLOT_NLL];
  iv->tokens += c->extra[NMT_GRAD_SLOT_TOKENS], iv->flops += si->flops;
  iv->steps++;
  /* A stop (a signal, a scheduler's preemption, nmt_trainer_request_stop) checkpoints at once
   * and never validates: a validation with BLEU can outlast a scheduler's grace period
   * (Slurm's KillWait, 30 s by default) and lose the checkpoint, and it would count toward
   * train.patience. Every rank sees the same reduced stop flag, so all skip it alike. */
  const int valid_due = !*stop && (valid_step(w, done) || (last && w->valid &&
                                                             cfg->train_valid_every > 0));
  int save_due = last || (cfg->train_save_every > 0 && done % cfg->train_save_every == 0);
  if ((valid_due || save_due) && !final)
    return nmt_errorf(NMT_ERR_INTERNAL, "rank %d: step %ld needs its own parameters, but the next "
                      "step was enqueued before its control block was read", r->rank, done);
  nmt__valid_result v = {.has_bleu = 0};
  int early = 0, cut = 0;
  if (valid_due) {
    /* A failure other than ABORTED (sacreBLEU gone, $TMPDIR gone, a write error) leaves this
     * step's state whole on the devices (a validation step is read before the next one is
     * enqueued): main checkpoints it before the run ends with the error (trainer.c). */
    const double p0 = nmt_clock_now_s();
    const nmt_status vs = validate_all(w, done, &v, &cut);
    w->paused_s += nmt_clock_now_s() - p0;
    if (vs != NMT_OK && vs != NMT_ERR_ABORTED) atomic_store(&w->sync->valid_failed_step, done);
    NMT_TRY(vs);
    if (cut) {
      /* This step is the last, as the stop request was told. */
      *stop = 1, last = 1, save_due = 1;
    } else {
      /* Every rank decides from the same reduced numbers: all stop here, or none. */
      early = nmt__best_update(cfg, &w->best, done, &v);
      if (early) *stop = 1, last = 1;
      /* A better validation gets its checkpoint now, for checkpoints/best to name. */
      save_due = save_due || last || v.improved;
    }
    if (r->rank == 0) w->pos->best_end = w->best; /* before the snapshot's header reads it */
  }
  const int log_due = done % cfg->train_log_every == 0 || valid_due || last || seg_end;
  if (r->rank == 0 && log_due)
    NMT_TRY(send_metrics(w, si, c, valid_due && !cut ? &v : NULL, iv));
  if ((r->grank == 0 || r->plan->zero) && save_due) {
    const double p0 = nmt_clock_now_s();
    NMT__PROFILED(r->prof, w->rn->checkpoint, NMT_PROF_OTHER, NMT__NO_COST,
                  snapshot(w, done, si->next_epoch, si->next_index));
    w->paused_s += nmt_clock_now_s() - p0;
  }
  /* Every process's main returns it. Early stopping wins over a stop request at the same
   * step: the run is over, not paused. */
  if (last && *stop && r->rank == 0) {
    if (early) w->pos->early_stopped = 1;
    else w->pos->stopped = 1;
  }
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* the step loop                                                                              */

/* Enqueues step `step` (its gradients already zeroed): accum micro-batches of forward +
 * backward (buckets reduced during the last backward, the stop sealed just before the trailing
 * slots go out; ZeRO stage 2: stage windows reduced during every backward), step_control and
 * AdamW, then the asynchronous read of the control block.
 * Nothing here waits for the device, except the batch copies' host-slot hand-back. */
static nmt_status enqueue_step(nmt__worker *w, long step, nmt__step_info *si,
                               nmt_step_policy policy) {
  nmt__replica *r = &w->rep;
  const nmt_config *cfg = w->cfg;
  const nmt_backend *be = r->be;
  const size_t n = r->plan->n_params;
  const int K = r->world * w->accum;
  nmt_prof_track *pt = r->prof;
  float *const extra = r->grads + r->plan->extra_offset; /* the trailing slots */
  grads_ready ready = {w, step + 1, extra};
  *si = (nmt__step_info){.step = step, .lr = nmt_lr_at(cfg, step + 1)};
  /* ZeRO stage 2: backward writes stage windows, reduce-scattered into the shard on every
   * micro-batch (nmt/buckets.h); otherwise the flat buffer, reduced on the last one. */
  const int windows = r->plan->zero == 2;
  const nmt_grad_sink sink = {nmt_grad_windows_open, nmt_grad_windows_close, &r->zero_grads};
  if (windows) nmt_grad_windows_begin(&r->zero_grads);
  for (int a = 0; a < w->accum; a++) {
    nmt_prof_push(pt, w->rn->micro_step, NMT_PROF_OTHER, 0, 0);
    /* The first batch of a segment is fetched here; every later one was fetched ahead. */
    if (!w->ahead) NMT_TRY(fetch_batch(w, step, 0));
    nmt__batch_slot bs;
    nmt_batch db;
    int slot;
    NMT_TRY(take_batch(w, &db, &bs, &slot));
    /* Start copying the next micro-batch (of this step or the next one in the segment) into
     * the other slot, behind this one's compute. */
    if (a + 1 < w->accum) NMT_TRY(fetch_batch(w, step, 1 - slot));
    else if (step + 1 < w->pos->end_step) NMT_TRY(fetch_batch(w, step + 1, 1 - slot));
    uint64_t rng_step = (uint64_t)step * (uint64_t)K + (uint64_t)bs.k;
    si->next_epoch = bs.next_epoch, si->next_index = bs.next_index;
    if (a == 0) si->flops = bs.step_flops;
    nmt_bucket_reducer_begin(&r->buckets, a == w->accum - 1);
    const int fail_here = r->grank == w->opt->fail_rank && step == w->opt->fail_step;
    r->buckets.fail_at_bucket = r->zero_grads.fail_at_bucket = fail_here ? w->opt->fail_bucket : -1;
    NMT__PROFILED(pt, w->rn->forward, NMT_PROF_FWD, NMT__NO_COST,
                  nmt_model_forward(r->model, r->params, &db, 1, cfg->run_seed, rng_step,
                                    extra));
    /* Testing: the step runs long, between its last forward and backward. */
    if (a == w->accum - 1) test_delay(w->opt->step_delay_ms);
    if (windows)
      NMT__PROFILED(pt, w->rn->backward, NMT_PROF_BWD, NMT__NO_COST,
                    nmt_model_backward_sink(r->model, r->params, &db, &sink));
    else
      NMT__PROFILED(pt, w->rn->backward, NMT_PROF_BWD, NMT__NO_COST,
                    nmt_model_backward(r->model, r->params, r->grads, &db, on_grads_ready,
                                       &ready));
    NMT_TRY(be->h2d_release(r->ctx, slot)); /* the slot may take the batch after next */
    nmt_prof_pop(pt); /* micro_step */
  }
  if (windows) {
    NMT_TRY(seal_stop(w, step + 1, extra)); /* the slots are reduced last, in finish */
    NMT_TRY(nmt_grad_windows_finish(&r->zero_grads));
  }
  else NMT_TRY(nmt_bucket_reducer_finish(&r->buckets, r->rank));
  /* NCCL buckets were only enqueued: the optimizer's work waits for the comm stream. */
  if (r->world > 1) NMT_TRY(nmt_comm_flush(r->comm));

  if (w->opt->nan_from_step >= 0 && step >= w->opt->nan_from_step &&
      (w->opt->nan_steps <= 0 || step < w->opt->nan_from_step + w->opt->nan_steps)) {
    float nan = NAN;
    NMT_TRY(be->copy_h2d(r->ctx, r->grads, &nan, sizeof nan));
  }
  /* The update, decided on the device: no host read here. */
  nmt_prof_cost oc = nmt_prof_cost_adamw((double)(r->plan->zero ? r->plan->shard_floats : n));
  nmt_prof_push(pt, w->rn->optimizer, NMT_PROF_OTHER, oc.flops, oc.bytes);
  if (r->plan->zero) {
    NMT_TRY(nmt__zero_update(r, cfg, step, (float)si->lr, policy));
  } else {
    NMT_TRY(be->step_control(r->ctx, r->dev_ctl, r->grads, n, policy, step + 1));
    NMT_TRY(be->adamw(r->ctx, r->params, r->grads, r->m, r->v, n, (float)si->lr,
                      cfg->train_adam_beta1, cfg->train_adam_beta2, cfg->train_adam_eps,
                      cfg->train_weight_decay, 1.0f, r->dev_ctl, r->half_params, step + 1));
  }
  const int ds = (int)(step % NMT_D2H_SLOTS);
  NMT_TRY(be->d2h_async(r->ctx, ds, &r->host_ctl[ds], r->dev_ctl, sizeof *r->host_ctl));
  nmt_prof_pop(pt); /* optimizer */
  if (windows && r->host_grads) {
    NMT_TRY(nmt__zero_copy_grads(r, r->host_grads));
  } else if (r->host_grads) { /* tests: blocking copies (with ZeRO only the owned slices are
                                 sums) */
    NMT_TRY(be->copy_d2h(r->ctx, r->host_grads, r->grads, n * sizeof(float)));
    NMT_TRY(be->copy_d2h(r->ctx, r->host_grads + n, extra, NMT_GRAD_EXTRA * sizeof(float)));
  }
  return NMT_OK;
}

/* One segment of training: steps [start_step, end_step). After enqueuing step s the host
 * reads step s-1's control block; a stop flag seen there makes step s (already enqueued) the
 * last, on every rank alike (on CPU workers each block is read at once, so the step whose slot
 * carries the flag is the last). */
static nmt_status worker_loop(nmt__worker *w) {
  nmt__replica *r = &w->rep;
  const nmt_config *cfg = w->cfg;
  const nmt_backend *be = r->be;
  interval iv = {.t0 = train_clock(w)};
  w->scaler = w->pos->scaler0;
  w->best = w->pos->best0;
  /* The loss scaler lives on the device from here to the segment's end. */
  nmt_step_ctl ctl0 = {.scale = w->scaler.scale, .good = w->scaler.good,
                       .skipped = w->scaler.skipped};
  NMT_TRY(be->copy_h2d(r->ctx, r->dev_ctl, &ctl0, sizeof ctl0));
  const nmt_step_policy policy = {.scaling = w->scaler.enabled,
                                  .clip_norm = cfg->train_clip_norm,
                                  .backoff = cfg->precision_backoff,
                                  .floor = cfg->precision_floor,
                                  .growth_interval = cfg->precision_growth_interval};
  if (r->rank == 0) nmt__stop_open(w->sync, stop_ends_after(w, w->pos->start_step + 1));
  long unread = -1; /* a step whose control block the host has not read yet */
  nmt_prof_track *pt = r->prof;
  int capturing = 0;
  for (long step = w->pos->start_step; step < w->pos->end_step; step++) {
    if (r->grank == w->opt->fail_rank && step == w->opt->fail_step && w->opt->fail_bucket < 0)
      return nmt_errorf(NMT_ERR_INTERNAL, "injected failure on rank %d at step %ld", r->grank,
                        step);
    /* Ranges: NVTX on every step (for nsys), timed events only inside the profile window. */
    nmt_prof_step_begin(pt, step + 1);
    nmt_prof_push(pt, w->rn->step, NMT_PROF_OTHER, 0, 0);
    NMT_TRY(be->memset_zero(r->ctx, r->grads, r->bytes_grad_buf));
    /* nsys --capture-range=cudaProfilerApi: the window only (after the step's first op made
     * this thread's device current). */
    if (!capturing && nmt_prof_in_window(w->profiler, step + 1)) {
      NMT_TRY(be->profiler_capture(1));
      capturing = 1;
    }
    nmt__step_info *si = &w->inflight[step % NMT_D2H_SLOTS];
    NMT_TRY(enqueue_step(w, step, si, policy));
    si->enqueued_s = train_clock(w);
    /* The previous step's block (its work ran while this step was enqueued), then this one's
     * where its end needs it now or a stop makes this step the last. */
    int stop = 0;
    if (unread >= 0) {
      NMT_TRY(finish_step(w, &w->inflight[unread % NMT_D2H_SLOTS], 0, 0, &iv, &stop));
      unread = -1;
    }
    if (stop || read_now(w, step + 1))
      NMT_TRY(finish_step(w, si, 1, stop, &iv, &stop));
    else
      unread = step;
    nmt_prof_pop(pt); /* step */
    /* The device clock resolves its events at step_end: wait here with the backend's
     * abort-aware synchronize, so a dead peer cannot hang the wait. */
    if (r->prof_clock && nmt_prof_track_sampling(pt)) NMT_TRY(be->synchronize(r->ctx));
    NMT_TRY(nmt_prof_step_end(pt));
    if (capturing && step + 1 == nmt_prof_stop_step(w->profiler)) {
      NMT_TRY(be->profiler_capture(0));
      capturing = 0;
    }
    if (stop) break;
  }
  return NMT_OK;
}

void *nmt__worker_main(void *arg) {
  nmt__worker *w = arg;
  nmt__replica *r = &w->rep;
  nmt_prof_track_bind_thread(r->prof);
  nmt_status s = worker_loop(w);
  /* An error is recorded first: it raises the abort flag, which releases the peers and
   * bounds the wait for the slot fetched ahead. */
  if (s != NMT_OK) nmt__sync_record_error(w->sync, r->grank, s);
  const nmt_status hs = hand_back_ahead(w);
  if (s == NMT_OK && hs != NMT_OK) nmt__sync_record_error(w->sync, r->grank, s = hs);
  /* Closes a capture window cut short by a stop, an error or the segment's end. */
  if (r->be->profiler_capture(0) != NMT_OK) nmt_clear_error();
  w->status = s;
  atomic_fetch_add(&w->sync->workers_done, 1);
  return NULL;
}

void *nmt__eval_main(void *arg) {
  nmt__worker *w = arg;
  nmt__replica *r = &w->rep;
  nmt_status s = validate(w, w->valid_out, 0);
  if (s != NMT_OK) nmt__sync_record_error(w->sync, r->grank, s);
  atomic_fetch_add(&w->sync->workers_done, 1);
  return NULL;
}
