/* test/test_warmup.c — the create-time GEMM warm-up (src/engine/warmup.c) on CPU workers.
 *
 * The reference backend has no kernels to load, so nmt_trainer_create skips the warm-up there
 * (warmup_skipped_on_host_backend checks that it logs no line and issues no GEMM). warmup_leaves_no_trace forces it (nmt__warmup(t, 1)) on a created trainer before it
 * trains, as create does on a GPU before the communicator exists, and checks that it leaves
 * no trace: the buffers it must not write (parameters, Adam moments, the half copy, the
 * control block) are bitwise what they were, the gradient buffer and ZeRO-2 windows are zero,
 * the model's profiler track and device loss scale are re-attached, the scratch did not grow;
 * and training after it gives bitwise the losses, gradient norms, loss scales and final
 * parameters of training without it. On 2 CPU workers with dropout, in fp32 and fp16 (dynamic
 * loss scaling), with the replicated gradient buffer and with ZeRO stage 2's windows.
 *
 * Not every leak shows in the losses: each step zeroes the gradient buffer first, so leftover
 * gradients are caught by the zero check, not by training. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "nmt/backend.h"
#include "nmt/log.h"
#include "nmt/trainer.h"
#include "test.h"
#include "../src/engine/run.h"       /* the trainer's workers, nmt__warmup */
#include "../src/model/model_impl.h" /* the model's profiler track and loss-scale pointer */

enum { WSTEPS = 6 };

/* Every step's metrics as reported (train.log_every = 1). */
typedef struct {
  nmt_metrics m[WSTEPS];
  long n;
} run_log;

static void record(void *user, const nmt_metrics *m) {
  run_log *l = user;
  if (l->n < WSTEPS) l->m[l->n] = *m;
  l->n++;
}

/* Lines logged that contain "warm-up" (the sink runs on whichever thread logs). */
static struct {
  pthread_mutex_t mu;
  int lines;
  char last[512];
} warm_lines = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void count_warm_lines(void *user, nmt_log_level level, const char *line) {
  (void)user, (void)level;
  if (!strstr(line, "warm-up")) return;
  pthread_mutex_lock(&warm_lines.mu);
  warm_lines.lines++;
  snprintf(warm_lines.last, sizeof warm_lines.last, "%s", line);
  pthread_mutex_unlock(&warm_lines.mu);
}

static int warm_line_count(void) {
  pthread_mutex_lock(&warm_lines.mu);
  const int n = warm_lines.lines;
  pthread_mutex_unlock(&warm_lines.mu);
  return n;
}

static void wcfg(nmt_config *c, const char *dir, const char *name, const char *shard,
                 nmt_precision prec, int zero) {
  char out[sizeof c->run_out_dir];
  snprintf(out, sizeof out, "%s/%s", dir, name);
  nmt_th_tiny_config(c, out, shard);
  c->parallel_devices = 2;
  c->parallel_zero = zero;
  c->precision_mode = prec;
  c->model_dropout = c->model_attn_dropout = c->model_relu_dropout = 0.1f;
  c->train_max_steps = WSTEPS;
}

/* What the warm-up must leave as it found it, read back from one worker's buffers. */
typedef struct {
  void *params, *m, *v, *half, *ctl;
  size_t params_bytes, optim_bytes, half_bytes;
} worker_snap;

static nmt_status snap_take(const nmt_trainer *t, const nmt__replica *w, worker_snap *s) {
  const nmt_backend *be = t->be;
  *s = (worker_snap){.params_bytes = t->n_params * sizeof(float),
                     .optim_bytes = w->bytes_optim / 2,
                     .half_bytes = w->half_params ? t->n_params * 2 : 0};
  s->params = malloc(s->params_bytes), s->m = malloc(s->optim_bytes);
  s->v = malloc(s->optim_bytes), s->ctl = malloc(sizeof *w->dev_ctl);
  s->half = malloc(s->half_bytes ? s->half_bytes : 1);
  if (!s->params || !s->m || !s->v || !s->ctl || !s->half)
    return nmt_errorf(NMT_ERR_NOMEM, "test: snapshot");
  NMT_TRY(be->copy_d2h(w->ctx, s->params, w->params, s->params_bytes));
  NMT_TRY(be->copy_d2h(w->ctx, s->m, w->m, s->optim_bytes));
  NMT_TRY(be->copy_d2h(w->ctx, s->v, w->v, s->optim_bytes));
  NMT_TRY(be->copy_d2h(w->ctx, s->ctl, w->dev_ctl, sizeof *w->dev_ctl));
  if (s->half_bytes) NMT_TRY(be->copy_d2h(w->ctx, s->half, w->half_params, s->half_bytes));
  return NMT_OK;
}

static void snap_free(worker_snap *s) {
  free(s->params), free(s->m), free(s->v), free(s->half), free(s->ctl);
}

/* Device floats [p, p + n) that are not +0.0. */
static long nonzero_floats(const nmt_trainer *t, const nmt__replica *w, const float *p, size_t n) {
  float *h = malloc((n ? n : 1) * sizeof *h);
  if (!h || t->be->copy_d2h(w->ctx, h, p, n * sizeof *h) != NMT_OK) {
    free(h);
    return -1;
  }
  long bad = 0;
  const float zero = 0.0f;
  for (size_t i = 0; i < n; i++) bad += memcmp(&h[i], &zero, sizeof zero) != 0;
  free(h);
  return bad;
}

/* After a forced warm-up: every state check on every worker; failures are recorded without
 * returning, so that the training comparison after it still runs and reports too. */
static void check_state(const nmt_trainer *t, worker_snap *before,
                        const nmt_backend_counters *c0, const char *what) {
  for (int r = 0; r < t->n_dev; r++) {
    const nmt__replica *w = &t->workers[r].rep;
    worker_snap after;
    if (snap_take(t, w, &after) != NMT_OK) {
      nmt_test_fail(__FILE__, __LINE__, "%s: rank %d: snapshot: %s", what, r, nmt_last_error());
      snap_free(&after);
      return;
    }
    const struct {
      const char *name;
      const void *a, *b;
      size_t bytes;
    } same[] = {{"parameters", before[r].params, after.params, after.params_bytes},
                {"Adam m", before[r].m, after.m, after.optim_bytes},
                {"Adam v", before[r].v, after.v, after.optim_bytes},
                {"half copy", before[r].half, after.half, after.half_bytes},
                {"control block", before[r].ctl, after.ctl, sizeof *w->dev_ctl}};
    for (size_t i = 0; i < sizeof same / sizeof *same; i++)
      if (memcmp(same[i].a, same[i].b, same[i].bytes))
        nmt_test_fail(__FILE__, __LINE__, "%s: rank %d: the warm-up changed the %s", what, r,
                      same[i].name);
    snap_free(&after);
    const long g = nonzero_floats(t, w, w->grads, w->bytes_grad_buf / sizeof(float));
    if (g != 0)
      nmt_test_fail(__FILE__, __LINE__, "%s: rank %d: %ld of %zu gradient floats (slots "
                    "included) not zero after the warm-up", what, r, g,
                    w->bytes_grad_buf / sizeof(float));
    if (w->zero_windows) {
      const size_t nw = nmt_grad_windows_floats(&t->plan);
      const long z = nonzero_floats(t, w, w->zero_windows, nw);
      if (z != 0)
        nmt_test_fail(__FILE__, __LINE__, "%s: rank %d: %ld of %zu ZeRO-2 window floats not "
                      "zero after the warm-up", what, r, z, nw);
    }
    if (w->model->prof != w->prof)
      nmt_test_fail(__FILE__, __LINE__, "%s: rank %d: the model's profiler track is not "
                    "re-attached", what, r);
    if (w->model->loss_scale_dev != &w->dev_ctl->scale)
      nmt_test_fail(__FILE__, __LINE__, "%s: rank %d: the model's device loss scale is not "
                    "re-attached", what, r);
    nmt_backend_counters c1;
    if (t->be->counters(w->ctx, &c1) != NMT_OK) {
      nmt_test_fail(__FILE__, __LINE__, "%s: rank %d: counters", what, r);
      continue;
    }
    if (c1.scratch_growths != c0[r].scratch_growths)
      nmt_test_fail(__FILE__, __LINE__, "%s: rank %d: the scratch grew %llu times in the "
                    "warm-up (the plan must cover its shapes)", what, r,
                    (unsigned long long)(c1.scratch_growths - c0[r].scratch_growths));
    if (c1.gemm_calls <= c0[r].gemm_calls)
      nmt_test_fail(__FILE__, __LINE__, "%s: rank %d: the forced warm-up issued no GEMM", what,
                    r);
  }
}

/* Trains cfg for WSTEPS steps into *log and *params (malloc'd, n_params floats); with
 * `warm`, forces the warm-up first and checks the state it leaves (check_state). */
static nmt_status train(const nmt_config *cfg, int warm, const char *what, run_log *log,
                        float **params, size_t *n) {
  nmt_trainer *t;
  NMT_TRY(nmt_th_trainer_quiet(cfg, record, log, &t));
  nmt_status s = NMT_OK;
  if (warm) {
    worker_snap before[2];
    nmt_backend_counters c0[2];
    memset(before, 0, sizeof before);
    for (int r = 0; s == NMT_OK && r < t->n_dev && r < 2; r++) {
      s = snap_take(t, &t->workers[r].rep, &before[r]);
      if (s == NMT_OK) s = t->be->counters(t->workers[r].rep.ctx, &c0[r]);
    }
    if (s == NMT_OK) s = nmt__warmup(t, 1);
    if (s == NMT_OK) check_state(t, before, c0, what);
    for (int r = 0; r < 2; r++) snap_free(&before[r]);
  }
  if (s == NMT_OK) s = nmt_trainer_run(t);
  if (s == NMT_OK) {
    const float *p = nmt_trainer_params(t, n);
    *params = malloc(*n * sizeof(float));
    if (*params) memcpy(*params, p, *n * sizeof(float));
    else s = nmt_errorf(NMT_ERR_NOMEM, "test: parameters");
  }
  nmt_trainer_destroy(t);
  return s;
}

/* The forced warm-up leaves each buffer as it found it, and training after it is bitwise
 * training without it: fp32 and fp16, replicated and ZeRO stage 2, 2 workers, dropout 0.1. */
NMT_TEST(warmup_leaves_no_trace) {
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 64, 5));
  const nmt_precision precs[] = {NMT_PRECISION_FP32, NMT_PRECISION_FP16};
  const int zeros[] = {0, 2};
  for (int pi = 0; pi < 2; pi++)
    for (int zi = 0; zi < 2; zi++) {
      char what[64], name[32];
      snprintf(what, sizeof what, "%s, parallel.zero = %d",
               precs[pi] == NMT_PRECISION_FP16 ? "fp16" : "fp32", zeros[zi]);
      nmt_config c;
      run_log base = {0}, warm = {0};
      float *p0 = NULL, *p1 = NULL;
      size_t n0 = 0, n1 = 0;
      snprintf(name, sizeof name, "base%d%d", pi, zi);
      wcfg(&c, dir, name, shard, precs[pi], zeros[zi]);
      NMT_ASSERT_OK(train(&c, 0, what, &base, &p0, &n0));
      snprintf(name, sizeof name, "warm%d%d", pi, zi);
      wcfg(&c, dir, name, shard, precs[pi], zeros[zi]);
      nmt_status s = train(&c, 1, what, &warm, &p1, &n1);
      if (s != NMT_OK) free(p0);
      NMT_ASSERT_OK(s);
      NMT_ASSERT_EQ_INT(base.n, WSTEPS);
      NMT_ASSERT_EQ_INT(warm.n, WSTEPS);
      NMT_ASSERT_EQ_INT(n0, n1);
      int steps_differ = 0;
      for (int i = 0; i < WSTEPS; i++) {
        const nmt_metrics *a = &base.m[i], *b = &warm.m[i];
        if (memcmp(&a->train_loss, &b->train_loss, sizeof(double)) ||
            memcmp(&a->grad_norm, &b->grad_norm, sizeof(double)) ||
            memcmp(&a->loss_scale, &b->loss_scale, sizeof a->loss_scale) ||
            a->skipped_steps != b->skipped_steps) {
          if (!steps_differ++)
            nmt_test_fail(__FILE__, __LINE__, "%s: step %ld: loss %.9g vs %.9g, grad norm %.9g "
                          "vs %.9g, loss scale %g vs %g, skipped %lld vs %lld (without / with "
                          "the warm-up)", what, a->step, a->train_loss, b->train_loss,
                          a->grad_norm, b->grad_norm, (double)a->loss_scale,
                          (double)b->loss_scale, (long long)a->skipped_steps,
                          (long long)b->skipped_steps);
        }
      }
      long pdiff = 0;
      for (size_t i = 0; i < n0; i++) pdiff += memcmp(&p0[i], &p1[i], sizeof(float)) != 0;
      free(p0);
      free(p1);
      printf("# %s: %d of %d steps differ, %ld of %zu final parameters differ; last loss %.6f, "
             "loss scale %g\n", what, steps_differ, WSTEPS, pdiff, n0,
             base.m[WSTEPS - 1].train_loss, (double)base.m[WSTEPS - 1].loss_scale);
      if (pdiff)
        nmt_test_fail(__FILE__, __LINE__, "%s: %ld of %zu final parameters differ after the "
                      "warm-up", what, pdiff, n0);
    }
}

/* On the reference backend nmt_trainer_create runs no warm-up: no log line, no GEMM on worker
 * 1's context (rank 0 measures the peaks with GEMMs; rank 1 runs none at create).
 * nmt__warmup(t, 0) is a no-op there too; forced, the same trainer shows both, its line
 * naming both shapes on both workers. */
NMT_TEST(warmup_skipped_on_host_backend) {
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(nmt_test_tmpdir(), 32, 6, &c));
  c.parallel_devices = 2;
  const nmt_log_level level = nmt_log_get_level();
  const nmt_log_sink sink = {count_warm_lines, NULL};
  warm_lines.lines = 0;
  nmt_log_set_level(NMT_LOG_INFO);
  nmt_log_set_sink(&sink);
  nmt_trainer *t = NULL;
  nmt_status s = nmt_th_trainer_quiet(&c, NULL, NULL, &t);
  const int lines_create = warm_line_count();
  nmt_backend_counters c0 = {0}, c1 = {0}, c2 = {0};
  int lines_unforced = -1;
  if (s == NMT_OK) {
    NMT_ASSERT(t->be->is_host);
    s = t->be->counters(t->workers[1].rep.ctx, &c0);
  }
  if (s == NMT_OK) s = nmt__warmup(t, 0);
  if (s == NMT_OK) {
    lines_unforced = warm_line_count();
    s = t->be->counters(t->workers[1].rep.ctx, &c1);
  }
  if (s == NMT_OK) s = nmt__warmup(t, 1);
  if (s == NMT_OK) {
    s = t->be->counters(t->workers[1].rep.ctx, &c2);
  }
  nmt_log_set_sink(NULL);
  nmt_log_set_level(level);
  nmt_trainer_destroy(t);
  NMT_ASSERT_OK(s);
  printf("# create: %d lines, %llu GEMMs on rank 1; forced: line \"%s\"\n", lines_create,
         (unsigned long long)c0.gemm_calls, warm_lines.last);
  NMT_ASSERT_EQ_INT(lines_create, 0);
  NMT_ASSERT_EQ_INT(c0.gemm_calls, 0);
  NMT_ASSERT_EQ_INT(lines_unforced, 0);
  NMT_ASSERT_EQ_INT(c1.gemm_calls, 0);
  /* Forced: the counters above could see it, both shapes on both workers. */
  NMT_ASSERT_EQ_INT(warm_line_count(), 1);
  NMT_ASSERT(strstr(warm_lines.last, "forced on the ref backend") != NULL);
  NMT_ASSERT(strstr(warm_lines.last, "ran 2 shapes") != NULL);
  NMT_ASSERT(strstr(warm_lines.last, "(2 workers;") != NULL);
  NMT_ASSERT(c2.gemm_calls > 0);
}
