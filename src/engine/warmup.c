/* warmup.c — the create-time warm-up of a device backend's GEMM kernels (nmt__warmup).
 *
 * Why. CUDA loads kernels lazily (CUDA_MODULE_LOADING=LAZY, the default on Linux since 12.2),
 * and loading a kernel may need a context synchronization (CUDA C++ Programming Guide, "Lazy
 * Loading", "Potential Hazards"). The CUDA backend loads its own kernels and CUB's when a
 * context is created (docs/cuda.md, "Kernel preload"), but cuBLASLt's GEMM kernels are the
 * library's: each algorithm's kernel loads inside the first cublasLtMatmul that runs it. In
 * step 1 the last micro-batch's backward enqueues gradient buckets on the comm stream (NCCL)
 * while its later GEMMs make their first launches; a load that waits for the context then
 * waits for a collective in flight: step 1 loses its overlap, and with several GPUs in one
 * process a driver that serialises the loads could hang the step.
 *
 * What. Once every replica exists and before the communicator does (so no collective can be
 * in flight, and none is issued here), each worker of a device backend runs forward + backward
 * over synthetic micro-batches in the run's precision, with dropout on as in training and no
 * optimizer step, then waits for its device (the backend's abort-aware synchronize). The
 * GEMMs run the same ops, weights, buffers and hence the same pointer alignments as a
 * training step: the flat gradient buffer, or with ZeRO stage 2 the same gradient windows in
 * the order the reducer hands them out (nmt_grad_windows_open), but never reduced.
 *
 * Shapes: a heuristic. cuBLASLt's algorithm, and so the kernel that loads, is a function of
 * the GEMM's shape bucket and of its matrices' alignment (cuda/gemm.cu), and step 1 runs
 * whatever batches the epoch order deals it. The batcher fills each micro-batch to nearly
 * data.max_tokens padded tokens whatever its lengths, so the linear layers' rows are always
 * near max_tokens, while the attention GEMMs follow the batch's lengths (the scores' leading
 * dimension is the key length: its alignment class changes the algorithm). Two shapes are
 * run: the longest the scratch plan covers (L = min(max_len, max_tokens) positions on both
 * sides, max_tokens / L sentences: nmt_model_scratch_plan's bounds), and a short one filled
 * to max_tokens with lengths 9 (source) and 10 (target), whose keys fall into other
 * alignment classes than a power-of-two max_len and than each other. Batches of lengths in
 * other size buckets or classes may still load a kernel in their first step.
 *
 * State left as found: parameters, their half copy and the Adam moments are only read; the
 * gradient buffer is zeroed afterwards (and the stage-2 windows, which every step zeroes
 * before use anyway); dropout masks are pure functions of (seed, step, site) (nmt/rng.h), so
 * no counter advances, and the warm-up uses a step no training micro-batch reaches; the loss
 * scaler's control block is neither read nor written (the model's device loss scale is
 * detached for the warm-up and re-attached); the profiler track is detached likewise, so no
 * range or count of the warm-up enters it; the backend's counters are monotonic by contract
 * (nmt/backend.h: readers take differences), and the scratch plan covers these shapes, so
 * the scratch-growth count does not move; the batch goes through the validation batch buffer,
 * which every validation overwrites first. On the cuda backend the algorithm of a GEMM is a
 * function of its exact key alone (never of which shape came first), so training after the
 * warm-up computes bitwise what it would without it.
 */
#include <stdlib.h>
#include <string.h>

#include "nmt/clock.h"
#include "nmt/log.h"
#include "run.h"

enum { N_SHAPES = 2, SHORT_SRC_LEN = 9, SHORT_TGT_LEN = 10 };

/* The dropout step of the warm-up's passes: the largest nmt_rng_stream can pack (40 bits);
 * training uses step x devices x accum + k, far below it. The masks are pure functions of it,
 * so nothing advances whichever step is used: this only keeps the warm-up's masks apart. */
static const uint64_t WARMUP_RNG_STEP = (1ull << 40) - 1;

/* One synthetic micro-batch: n_sent sentences of src_len / tgt_len positions, no padding. */
typedef struct {
  int n_sent, src_len, tgt_len;
} warm_shape;

/* The shapes above for data.max_tokens and data.max_len (the config guarantees
 * max_tokens >= max_len >= 1); a short shape equal to the longest is dropped. Returns the
 * count. */
static int warm_shapes(const nmt_config *cfg, warm_shape out[N_SHAPES]) {
  const int N = cfg->data_max_tokens;
  const int L = cfg->data_max_len < N ? cfg->data_max_len : N;
  out[0] = (warm_shape){N / L, L, L};
  const int s = SHORT_SRC_LEN < L ? SHORT_SRC_LEN : L, t = SHORT_TGT_LEN < L ? SHORT_TGT_LEN : L;
  out[1] = (warm_shape){N / (s > t ? s : t), s, t};
  return memcmp(&out[0], &out[1], sizeof out[0]) ? 2 : 1;
}

/* A deterministic batch of shape sh in host buffer buf (nmt_batch_layout; t->batch_ints
 * int32s hold any shape of warm_shapes): src = x EOS, tgt_in = BOS y, tgt_out = y EOS with
 * ids from 4 (after the specials) below vocab. */
static void fill_batch(const warm_shape *sh, int vocab, int32_t *buf, nmt_batch *b) {
  nmt_batch_layout(b, buf, sh->n_sent, sh->src_len, sh->tgt_len);
  const int S = sh->src_len, T = sh->tgt_len, span = vocab - 4;
  for (int i = 0; i < sh->n_sent; i++) {
    for (int j = 0; j < S; j++)
      b->src[(size_t)i * S + j] = j == S - 1 ? NMT_EOS_ID : 4 + (7 * i + 3 * j) % span;
    for (int j = 0; j < T; j++) {
      const int32_t y = 4 + (5 * i + 11 * j) % span;
      b->tgt_out[(size_t)i * T + j] = j == T - 1 ? NMT_EOS_ID : y;
      b->tgt_in[(size_t)i * T + j] = j == 0 ? NMT_BOS_ID : 4 + (5 * i + 11 * (j - 1)) % span;
    }
    b->src_lens[i] = S;
    b->tgt_lens[i] = T;
  }
  b->src_tokens = (long)sh->n_sent * S;
  b->tgt_tokens = (long)sh->n_sent * T;
}

/* ZeRO stage 2: a gradient sink over the worker's own windows, handed out as the reducer
 * hands them out (the held window for the embedding's stage; the two others alternating from
 * window 0 in every backward), zeroed on open, never reduced on close. */
typedef struct {
  nmt__replica *r;
  size_t held_begin; /* the embedding stage's first parameter */
  int next;          /* the alternating window the next other stage gets */
} warm_sink;

static nmt_status warm_open(void *user, size_t begin, size_t end, float **window) {
  warm_sink *s = user;
  const nmt_grad_windows *g = &s->r->zero_grads;
  float *win = begin == s->held_begin ? g->window[2] : g->window[s->next];
  if (begin != s->held_begin) s->next ^= 1;
  *window = win;
  return s->r->be->memset_zero(s->r->ctx, win, (end - begin) * sizeof(float));
}

static nmt_status warm_close(void *user, size_t begin, size_t end) {
  (void)user, (void)begin, (void)end;
  return NMT_OK;
}

/* Forward + backward of the micro-batch already in r->dev_batch_buf (host view hb), with
 * dropout seeded by `seed`, into the gradient buffer zeroed first (the trailing slots the
 * forward sums into included). ready / user: the flat buffer's grad-ready callback (NULL:
 * none). fwd_s: if not NULL, the forward is waited for and its end time (nmt_clock_now_s)
 * stored. */
static nmt_status warm_pass(nmt__replica *r, uint64_t seed, const nmt_batch *hb,
                            nmt_grad_ready_fn ready, void *user, double *fwd_s) {
  float *const extra = r->grads + r->plan->extra_offset;
  NMT_TRY(r->be->memset_zero(r->ctx, r->grads, r->bytes_grad_buf));
  nmt_batch db;
  nmt_batch_layout(&db, r->dev_batch_buf, hb->n_sent, hb->src_len, hb->tgt_len);
  db.src_tokens = hb->src_tokens, db.tgt_tokens = hb->tgt_tokens;
  NMT_TRY(nmt_model_forward(r->model, r->params, &db, 1, seed, WARMUP_RNG_STEP, extra));
  if (fwd_s) {
    NMT_TRY(r->be->synchronize(r->ctx));
    *fwd_s = nmt_clock_now_s();
  }
  if (r->plan->zero == 2) {
    warm_sink ws = {.r = r};
    size_t held_end;
    nmt_bucket_range(r->plan, r->zero_grads.held_bucket, &ws.held_begin, &held_end);
    const nmt_grad_sink sink = {warm_open, warm_close, &ws};
    NMT_TRY(nmt_model_backward_sink(r->model, r->params, &db, &sink));
  } else {
    NMT_TRY(nmt_model_backward(r->model, r->params, r->grads, &db, ready, user));
  }
  return NMT_OK;
}

/* Every shape through replica r (enqueued; the caller waits), with its profiler track and
 * device loss scale detached meanwhile and re-attached on every path out. */
static nmt_status warm_worker(const nmt_trainer *t, nmt__replica *r, const warm_shape *shapes,
                              int n_shapes, int32_t *host_buf) {
  const nmt_backend *be = r->be;
  nmt_status s = nmt_model_set_profiler(r->model, NULL);
  nmt_model_set_loss_scale_dev(r->model, NULL);
  for (int i = 0; s == NMT_OK && i < n_shapes; i++) {
    nmt_batch hb;
    fill_batch(&shapes[i], t->mcfg.vocab, host_buf, &hb);
    const size_t ints = (size_t)(hb.tgt_lens + hb.n_sent - host_buf);
    s = be->copy_h2d(r->ctx, r->dev_batch_buf, host_buf, ints * sizeof(int32_t));
    if (s == NMT_OK) s = warm_pass(r, t->cfg.run_seed, &hb, NULL, NULL, NULL);
  }
  if (s == NMT_OK) s = be->memset_zero(r->ctx, r->grads, r->bytes_grad_buf);
  if (s == NMT_OK && r->zero_windows)
    s = be->memset_zero(r->ctx, r->zero_windows,
                        nmt_grad_windows_floats(r->plan) * sizeof(float));
  /* As replica.c bound them. */
  nmt_model_set_loss_scale_dev(r->model, &r->dev_ctl->scale);
  const nmt_status ps = nmt_model_set_profiler(r->model, r->prof);
  return s != NMT_OK ? s : ps;
}

nmt_status nmt__warmup(nmt_trainer *t, int force) {
  if (t->be->is_host && !force) return NMT_OK;
  warm_shape shapes[N_SHAPES];
  const int n_shapes = warm_shapes(&t->cfg, shapes);
  int32_t *host_buf = malloc(t->batch_ints * sizeof(int32_t));
  if (!host_buf) return nmt_errorf(NMT_ERR_NOMEM, "warm-up: a host batch of %zu ints",
                                   t->batch_ints);
  nmt_backend_counters c0 = {0}, c1 = {0};
  const int counted = t->be->counters && t->be->counters(t->workers[0].rep.ctx, &c0) == NMT_OK;
  const double t0 = nmt_clock_now_s();
  nmt_status s = NMT_OK;
  /* Worker by worker (each batch's copy_h2d waits for its stream, so a worker's passes run
   * one after the other); then every device is waited for, abort-aware. */
  for (int r = 0; s == NMT_OK && r < t->n_dev; r++)
    s = warm_worker(t, &t->workers[r].rep, shapes, n_shapes, host_buf);
  for (int r = 0; s == NMT_OK && r < t->n_dev; r++)
    s = t->be->synchronize(t->workers[r].rep.ctx);
  free(host_buf);
  NMT_TRY(s);
  const double ms = 1e3 * (nmt_clock_now_s() - t0);
  long long launches = -1; /* worker 0's GEMM launches in the warm-up (-1: no counters) */
  if (counted) {
    if (t->be->counters(t->workers[0].rep.ctx, &c1) == NMT_OK)
      launches = (long long)(c1.gemm_calls - c0.gemm_calls);
    else
      nmt_clear_error();
  }
  char batches[96];
  int len = snprintf(batches, sizeof batches, "%dx%d/%d", shapes[0].n_sent, shapes[0].src_len,
                     shapes[0].tgt_len);
  if (n_shapes > 1 && len > 0 && (size_t)len < sizeof batches)
    snprintf(batches + len, sizeof batches - (size_t)len, " and %dx%d/%d", shapes[1].n_sent,
             shapes[1].src_len, shapes[1].tgt_len);
  if (t->be->is_host)
    nmt_log(NMT_LOG_INFO, "warm-up (forced on the %s backend, which has no kernels to load): ran "
            "%d shapes in %.1f ms (%d worker%s; micro-batches sentences x source/target "
            "positions: %s; %lld GEMM calls per worker)", t->be->name, n_shapes, ms, t->n_dev,
            t->n_dev > 1 ? "s" : "", batches, launches);
  else
    nmt_log(NMT_LOG_INFO, "warm-up: loaded cuBLASLt kernels for %d shapes in %.1f ms (%d "
            "worker%s; micro-batches sentences x source/target positions: %s; %lld GEMM "
            "launches per worker; no collective)", n_shapes, ms, t->n_dev,
            t->n_dev > 1 ? "s" : "", batches, launches);
  return NMT_OK;
}

nmt_status nmt__warmup_time_backward(nmt_trainer *t, nmt_grad_ready_fn ready, void *user,
                                     double *t0_s, double *fwd_ms, double *compute_ms) {
  nmt__replica *r = &t->workers[0].rep;
  const nmt_backend *be = t->be;
  if (t->plan.zero == 2)
    return nmt_errorf(NMT_ERR_INTERNAL, "backward probe: ZeRO stage 2 has no flat gradient");
  warm_shape shapes[N_SHAPES];
  warm_shapes(&t->cfg, shapes);
  int32_t *host_buf = malloc(t->batch_ints * sizeof(int32_t));
  if (!host_buf) return nmt_errorf(NMT_ERR_NOMEM, "backward probe: a host batch of %zu ints",
                                   t->batch_ints);
  nmt_status s = nmt_model_set_profiler(r->model, NULL);
  nmt_model_set_loss_scale_dev(r->model, NULL);
  nmt_batch hb;
  fill_batch(&shapes[0], t->mcfg.vocab, host_buf, &hb);
  const size_t ints = (size_t)(hb.tgt_lens + hb.n_sent - host_buf);
  if (s == NMT_OK) s = be->copy_h2d(r->ctx, r->dev_batch_buf, host_buf, ints * sizeof(int32_t));
  /* An untimed pass first (first touch of the activations, a device's first launches). */
  if (s == NMT_OK) s = warm_pass(r, t->cfg.run_seed, &hb, NULL, NULL, NULL);
  if (s == NMT_OK) s = be->synchronize(r->ctx);
  double fwd_end = 0;
  *t0_s = nmt_clock_now_s();
  if (s == NMT_OK) s = warm_pass(r, t->cfg.run_seed, &hb, ready, user, &fwd_end);
  if (s == NMT_OK) s = be->synchronize(r->ctx);
  const double end = nmt_clock_now_s();
  *fwd_ms = 1e3 * (fwd_end - *t0_s), *compute_ms = 1e3 * (end - *t0_s);
  if (s == NMT_OK) s = be->memset_zero(r->ctx, r->grads, r->bytes_grad_buf);
  free(host_buf);
  nmt_model_set_loss_scale_dev(r->model, &r->dev_ctl->scale);
  const nmt_status ps = nmt_model_set_profiler(r->model, r->prof);
  return s != NMT_OK ? s : ps;
}
