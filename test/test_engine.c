/* test_engine.c — the multi-worker engine on CPU workers: equivalences, failure, resume. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/half.h"
#include "nmt/model.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "nmt/trainer.h"
#include "helpers.h"
#include "test.h"

enum { SYN_VOCAB = 40, SYN_PAIRS = 96 };

/* A synthetic "reverse the sequence" corpus with varied lengths, so batches differ in shape. */
static nmt_status write_synthetic(const char *path, uint64_t seed) {
  uint64_t so[SYN_PAIRS + 1], to[SYN_PAIRS + 1];
  int32_t src[SYN_PAIRS * 16], tgt[SYN_PAIRS * 16];
  so[0] = to[0] = 0;
  for (int i = 0; i < SYN_PAIRS; i++) {
    int len = 2 + (int)(nmt_rng_u32(seed, 1, (uint64_t)i) % 11);
    for (int j = 0; j < len; j++) {
      int32_t id = 4 + (int32_t)(nmt_rng_u32(seed, 2, (uint64_t)(i * 16 + j)) % (SYN_VOCAB - 4));
      src[so[i] + (uint64_t)j] = id;
      tgt[to[i] + (uint64_t)(len - 1 - j)] = id;
    }
    so[i + 1] = so[i] + (uint64_t)len;
    to[i + 1] = to[i] + (uint64_t)len;
  }
  return nmt_shard_write(path, SYN_VOCAB, SYN_PAIRS, so, src, to, tgt);
}

static void tiny_config(nmt_config *c, const char *dir, const char *shard) {
  char out[sizeof c->run_out_dir];
  if (snprintf(out, sizeof out, "%s/run", dir) >= (int)sizeof out) out[0] = 0; /* too long */
  nmt_th_tiny_config(c, out, shard);
  c->model_vocab = SYN_VOCAB;
}

static nmt_trainer_options quiet_opts(void) {
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  o.keep_last_grads = 1;
  o.overwrite = 1; /* the tests compare configs trained one after another in one run.out_dir
                      (a resume sets it back to 0: the two exclude each other) */
  o.lagged_reads = 1; /* the device workers' read-behind schedule, on CPU workers */
  return o;
}

/* Runs cfg to the end; copies rank 0's last reduced gradient and the final parameters. */
static nmt_status run_copy(const nmt_config *cfg, float **grads, float **params, size_t *ng,
                           size_t *np) {
  nmt_trainer *t;
  nmt_trainer_options o = quiet_opts();
  o.overwrite = !cfg->run_resume;
  NMT_TRY(nmt_trainer_create(cfg, &o, &t));
  nmt_status s = nmt_trainer_run(t);
  if (s == NMT_OK) {
    const float *g = nmt_trainer_last_grads(t, 0, ng);
    const float *p = nmt_trainer_params(t, np);
    *grads = malloc(*ng * sizeof(float));
    *params = malloc(*np * sizeof(float));
    memcpy(*grads, g, *ng * sizeof(float));
    memcpy(*params, p, *np * sizeof(float));
  }
  nmt_trainer_destroy(t);
  return s;
}

/* (devices, accum_steps) = (1,4), (2,2), (4,1) consume the same 4 batches per step, so the
 * reduced gradient and the update must agree up to summation order: one step from the same
 * initialisation, where the forward is bitwise the same in all three. (Not a second step: the
 * first update differs in its last bits, and where a ReLU input sits that close to 0 the unit
 * switches in one run and not the other, moving the second step's gradient by 2.5e-2 under
 * OPENBLAS_CORETYPE=Sandybridge, as this test with train_max_steps = 2 showed; the per-step
 * curve of such a divergence is zero_losses_match_replicated's "per step" line.) */
NMT_TEST(engine_devices_accum_equivalence) {
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(write_synthetic(shard, 3));
  int devs[3] = {1, 2, 4}, acc[3] = {4, 2, 1};
  float *g[3] = {0}, *p[3] = {0};
  size_t ng = 0, np = 0;
  for (int i = 0; i < 3; i++) {
    nmt_config c;
    tiny_config(&c, dir, shard);
    c.parallel_devices = devs[i];
    c.train_accum_steps = acc[i];
    c.train_max_steps = 1;
    /* Some true gradients are exactly 0 (a key bias shifts every score of a softmax row
     * equally), so their computed value is rounding noise whose sign depends on summation
     * order; Adam with eps 1e-9 would turn that noise into full-size steps. A larger eps keeps
     * the update a continuous function of the gradient. */
    c.train_adam_eps = 1e-3f;
    NMT_ASSERT_OK(run_copy(&c, &g[i], &p[i], &ng, &np));
  }
  /* The loss normaliser is identical (same batches), and non-trivial. */
  NMT_ASSERT(g[0][np + NMT_GRAD_SLOT_TOKENS] > 20);
  NMT_ASSERT_EQ_INT(g[0][np + NMT_GRAD_SLOT_TOKENS], g[2][np + NMT_GRAD_SLOT_TOKENS]);
  for (int i = 1; i < 3; i++) {
    char what[64];
    snprintf(what, sizeof what, "grads devices=%d accum=%d vs 1x4", devs[i], acc[i]);
    NMT_ASSERT_CLOSE(what, g[i], g[0], ng, 1e-5, 1e-5);
    snprintf(what, sizeof what, "params devices=%d accum=%d vs 1x4", devs[i], acc[i]);
    NMT_ASSERT_CLOSE(what, p[i], p[0], np, 1e-6, 1e-5);
  }
  for (int i = 0; i < 3; i++) free(g[i]), free(p[i]);
}

/* parallel.grad_dtype = bf16 / fp16 with 2 workers: every reduced gradient is a value of the
 * wire type (so the half all-reduce was really used), the trailing slots stay exact fp32
 * (the token count is an integer fp16 could not hold past 2048), and the gradient is the fp32
 * run's within the wire type's rounding. One step, so both runs see the same parameters. */
NMT_TEST(engine_grad_dtype_half_wire) {
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(write_synthetic(shard, 5));
  nmt_grad_dtype wires[3] = {NMT_GRAD_FP32, NMT_GRAD_BF16, NMT_GRAD_FP16};
  float *g[3] = {0}, *p[3] = {0};
  size_t ng = 0, np = 0;
  for (int i = 0; i < 3; i++) {
    nmt_config c;
    tiny_config(&c, dir, shard);
    c.parallel_devices = 2;
    c.parallel_grad_dtype = wires[i];
    /* fp16 on the wire needs fp16 loss scaling (config validation); use it in all three runs
     * so the gradients compare. A small scale: no overflow at these sizes. */
    c.precision_mode = NMT_PRECISION_FP16;
    c.precision_loss_scale = 8.0f;
    c.precision_floor = 1.0f;
    c.parallel_bucket_mb = 0.002f; /* several buckets, the last one holding the slots */
    NMT_ASSERT_OK(run_copy(&c, &g[i], &p[i], &ng, &np));
  }
  NMT_ASSERT(g[0][np + NMT_GRAD_SLOT_TOKENS] > 20);
  for (int i = 1; i < 3; i++) {
    size_t not_wire = 0, differ = 0;
    for (size_t k = 0; k < np; k++) {
      float r = wires[i] == NMT_GRAD_BF16 ? nmt_half_round_bf16(g[i][k]) : nmt_half_round_fp16(g[i][k]);
      if (r != g[i][k]) not_wire++;
      if (g[i][k] != g[0][k]) differ++;
    }
    NMT_ASSERT_EQ_INT(not_wire, 0);
    NMT_ASSERT(differ > np / 4); /* fp32 sums are generally not half values */
    for (int k = 0; k < NMT_GRAD_EXTRA; k++)
      NMT_ASSERT(g[i][np + (size_t)k] == g[0][np + (size_t)k]); /* slots: fp32, bitwise */
    char what[64];
    snprintf(what, sizeof what, "grads grad_dtype=%s vs fp32", i == 1 ? "bf16" : "fp16");
    /* Each addend and the sum rounded once: error <= u (|a| + |b| + |a + b|) with u the unit
     * roundoff (2^-8 bf16, 2^-11 fp16); |a|, |b| are unknown per rank, so bound them by the
     * largest gradient (a cancelling sum can be far smaller than its addends). */
    double u = wires[i] == NMT_GRAD_BF16 ? 0x1p-8 : 0x1p-11, gmax = 0;
    for (size_t k = 0; k < np; k++) gmax = fmax(gmax, fabs(g[0][k]));
    NMT_ASSERT_CLOSE(what, g[i], g[0], np, 3 * u * gmax, 2 * u);
  }
  for (int i = 0; i < 3; i++) free(g[i]), free(p[i]);
}

/* Every rank ends a step with bitwise the same reduced gradient, whatever the bucket size. */
NMT_TEST(engine_bucket_size_invariance) {
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(write_synthetic(shard, 4));
  float buckets[3] = {0.0005f, 0.01f, 64.0f};
  float *ref = NULL;
  size_t n_ref = 0;
  for (int i = 0; i < 3; i++) {
    nmt_config c;
    tiny_config(&c, dir, shard);
    c.parallel_devices = 3;
    c.parallel_bucket_mb = buckets[i];
    nmt_trainer *t;
    nmt_trainer_options o = quiet_opts();
    NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
    NMT_ASSERT_OK(nmt_trainer_run(t));
    size_t n;
    const float *g0 = nmt_trainer_last_grads(t, 0, &n);
    for (int r = 1; r < 3; r++) {
      const float *gr = nmt_trainer_last_grads(t, r, &n);
      if (memcmp(g0, gr, n * sizeof(float)) != 0) {
        nmt_trainer_destroy(t);
        nmt_test_fail(__FILE__, __LINE__, "rank %d's reduced gradient differs from rank 0's", r);
        return;
      }
    }
    if (!ref) {
      ref = malloc(n * sizeof(float));
      memcpy(ref, g0, n * sizeof(float));
      n_ref = n;
    } else if (memcmp(ref, g0, n * sizeof(float)) != 0) {
      nmt_trainer_destroy(t);
      free(ref);
      nmt_test_fail(__FILE__, __LINE__, "bucket_mb %g changes the reduced gradient", buckets[i]);
      return;
    }
    nmt_trainer_destroy(t);
  }
  NMT_ASSERT(n_ref > 0);
  free(ref);
}

/* Gradients of 4 micro-batches accumulated equal the gradient of one batch holding the same
 * sentences (model level: padding must not leak into the sum). */
NMT_TEST(engine_accum_equals_one_big_batch) {
  nmt_config c;
  tiny_config(&c, "/tmp", "unused");
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(&c, &mc);
  size_t n = nmt_model_num_params(&mc), total = n + NMT_GRAD_EXTRA;
  float *params = malloc(n * sizeof(float));
  float *g_acc = calloc(total, sizeof(float)), *g_big = calloc(total, sizeof(float));
  nmt_model_init_params(&mc, 11, params);
  nmt_model *m;
  NMT_ASSERT_OK(nmt_model_create(&mc, &nmt_backend_ref, NULL, 256, 16, &m));
  enum { NS = 8, S = 9, T = 10 };
  int32_t sl[NS], tl[NS];
  for (int i = 0; i < NS; i++) sl[i] = 2 + i % 7, tl[i] = 3 + (i * 5) % 7;
  size_t ints = nmt_batch_ints(NS, T);
  int32_t *buf = malloc(ints * sizeof(int32_t)), *sbuf = malloc(ints * sizeof(int32_t));
  nmt_batch big, sub;
  nmt_batch_layout(&big, buf, NS, S, T);
  big.src_tokens = big.tgt_tokens = 0;
  for (int i = 0; i < NS; i++) {
    for (int j = 0; j < S; j++)
      big.src[i * S + j] = j < sl[i] - 1 ? 4 + (i * 7 + j * 3) % 30 : j == sl[i] - 1 ? NMT_EOS_ID : NMT_PAD_ID;
    for (int j = 0; j < T; j++) {
      int y = 4 + (i * 11 + j * 5) % 30;
      big.tgt_in[i * T + j] = j == 0 ? NMT_BOS_ID : j < tl[i] ? 4 + (i * 11 + (j - 1) * 5) % 30 : NMT_PAD_ID;
      big.tgt_out[i * T + j] = j < tl[i] - 1 ? y : j == tl[i] - 1 ? NMT_EOS_ID : NMT_PAD_ID;
    }
    big.src_lens[i] = sl[i], big.tgt_lens[i] = tl[i];
    big.src_tokens += sl[i], big.tgt_tokens += tl[i];
  }
  NMT_ASSERT_OK(nmt_model_forward(m, params, &big, 1, 1, 1, g_big + n));
  NMT_ASSERT_OK(nmt_model_backward(m, params, g_big, &big, NULL, NULL));
  for (int q = 0; q < 4; q++) {
    nmt_batch_layout(&sub, sbuf, 2, S, T);
    sub.src_tokens = sub.tgt_tokens = 0;
    for (int i = 0; i < 2; i++) {
      int k = q * 2 + i;
      memcpy(sub.src + i * S, big.src + k * S, S * sizeof(int32_t));
      memcpy(sub.tgt_in + i * T, big.tgt_in + k * T, T * sizeof(int32_t));
      memcpy(sub.tgt_out + i * T, big.tgt_out + k * T, T * sizeof(int32_t));
      sub.src_lens[i] = sl[k], sub.tgt_lens[i] = tl[k];
      sub.src_tokens += sl[k], sub.tgt_tokens += tl[k];
    }
    NMT_ASSERT_OK(nmt_model_forward(m, params, &sub, 1, 1, 1, g_acc + n));
    NMT_ASSERT_OK(nmt_model_backward(m, params, g_acc, &sub, NULL, NULL));
  }
  NMT_ASSERT_NEAR(g_acc[n + NMT_GRAD_SLOT_TOKENS], g_big[n + NMT_GRAD_SLOT_TOKENS], 0);
  NMT_ASSERT_CLOSE("accumulated vs one batch", g_acc, g_big, total, 1e-5, 1e-5);
  nmt_model_destroy(m);
  free(params), free(g_acc), free(g_big), free(buf), free(sbuf);
}

typedef struct {
  nmt_trainer *t;
  volatile int done;
} watch_arg;

/* A worker that fails must end the run with its own error, not hang its peers in a collective. */
NMT_TEST(engine_injected_failure_ends_run) {
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(write_synthetic(shard, 5));
  nmt_config c;
  tiny_config(&c, dir, shard);
  c.parallel_devices = 4;
  c.train_max_steps = 1000000;
  nmt_trainer_options o = quiet_opts();
  o.fail_rank = 2;
  o.fail_step = 3;
  nmt_trainer *t;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  nmt_status s = nmt_trainer_run(t);
  clock_gettime(CLOCK_MONOTONIC, &b);
  long step = nmt_trainer_step(t);
  nmt_trainer_destroy(t);
  double dt = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
  printf("# injected failure on rank 2 of 4 ended the run in %.3f s at step %ld\n", dt, step);
  NMT_ASSERT_EQ_STATUS(s, NMT_ERR_INTERNAL);
  NMT_ASSERT(strstr(nmt_last_error(), "injected failure on rank 2 at step 3") != NULL);
  NMT_ASSERT(step <= 3);
  /* Issue 4's bound for "no hang": the peers blocked in the collective are released by the
   * abort flag, not by a timeout. (A liveness bound, not a speed goal: the run is 3 tiny steps.) */
  NMT_ASSERT(dt < 5.0);
}

/* Train 2N steps straight vs N, stop, resume to 2N: bitwise-equal parameters (dropout on, so
 * the RNG streams and the data position must be restored exactly). */
NMT_TEST(engine_resume_is_exact) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], d1[600], d2[600];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(d1, sizeof d1, "%s/a", dir);
  snprintf(d2, sizeof d2, "%s/b", dir);
  NMT_ASSERT_OK(write_synthetic(shard, 6));
  nmt_config c;
  tiny_config(&c, d1, shard);
  c.model_dropout = 0.1f;
  c.model_attn_dropout = 0.1f;
  c.parallel_devices = 2;
  c.train_max_steps = 30; /* > one epoch of the synthetic data: crosses an epoch boundary */
  float *g1, *p1, *g2, *p2;
  size_t ng, np;
  NMT_ASSERT_OK(run_copy(&c, &g1, &p1, &ng, &np));
  tiny_config(&c, d2, shard);
  c.model_dropout = 0.1f;
  c.model_attn_dropout = 0.1f;
  c.parallel_devices = 2;
  c.train_max_steps = 13;
  NMT_ASSERT_OK(run_copy(&c, &g2, &p2, &ng, &np));
  free(g2), free(p2);
  c.train_max_steps = 30;
  c.run_resume = 1;
  NMT_ASSERT_OK(run_copy(&c, &g2, &p2, &ng, &np));
  NMT_ASSERT(memcmp(p1, p2, np * sizeof(float)) == 0);
  NMT_ASSERT(memcmp(g1, g2, ng * sizeof(float)) == 0);
  free(g1), free(p1), free(g2), free(p2);
}

/* The callback runs on the main thread; user points at the trainer handle. */
static void stop_at_3(void *user, const nmt_metrics *m) {
  if (m->step >= 3) nmt_trainer_request_stop(*(nmt_trainer **)user);
}

/* The stop tests' run: the tiny config on a fresh synthetic shard over `devices` CPU workers. */
static void stop_setup(nmt_config *c, int devices, long max_steps) {
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(write_synthetic(shard, 8));
  tiny_config(c, dir, shard);
  c->parallel_devices = devices;
  c->train_max_steps = max_steps;
}

/* A stop request ends every rank on the same step with a checkpoint and NMT_STOPPED. */
NMT_TEST(engine_stop_writes_checkpoint) {
  char ckdir[1100], path[1024];
  nmt_config c;
  stop_setup(&c, 3, 1000000);
  nmt_trainer *t = NULL;
  nmt_trainer_options o = quiet_opts();
  o.on_metrics = stop_at_3;
  o.user = &t;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
  nmt_status s = nmt_trainer_run(t);
  long step = nmt_trainer_step(t);
  nmt_trainer_destroy(t);
  NMT_ASSERT_EQ_STATUS(s, NMT_STOPPED);
  NMT_ASSERT(step >= 3 && step < 1000000);
  snprintf(ckdir, sizeof ckdir, "%s/checkpoints", c.run_out_dir);
  NMT_ASSERT_OK(nmt_ckpt_find_latest(ckdir, path));
  nmt_ckpt_header h;
  NMT_ASSERT_OK(nmt_ckpt_read_header(path, &h));
  NMT_ASSERT_EQ_INT(h.step, step);
}

/* Counts the metrics lines that carry a validation, and stops at step 3 like stop_at_3. */
typedef struct {
  nmt_trainer *t;
  int valid_lines;
  long last_step;
} stop_watch;

static void stop_at_3_counting(void *user, const nmt_metrics *m) {
  stop_watch *w = user;
  w->valid_lines += m->has_valid;
  w->last_step = m->step;
  if (m->step >= 3) nmt_trainer_request_stop(w->t);
}

/* A stop checkpoints at once and never validates (a validation with BLEU can outlast a
 * scheduler's grace period): with a validation set due only at the run's end (valid_every
 * far beyond the stop) and at every step (valid_every = 1), the step the stop makes the last
 * writes its checkpoint and no validation. Before the fix the last step validated. */
static void stop_never_validates(int valid_every) {
  char ckdir[1100], path[1024];
  nmt_config c;
  stop_setup(&c, 2, 1000);
  snprintf(c.data_valid, sizeof c.data_valid, "%s", c.data_train);
  c.train_valid_every = valid_every;
  stop_watch w = {NULL, 0, 0};
  nmt_trainer_options o = quiet_opts();
  o.on_metrics = stop_at_3_counting;
  o.user = &w;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &w.t));
  nmt_status s = nmt_trainer_run(w.t);
  long step = nmt_trainer_step(w.t);
  nmt_trainer_destroy(w.t);
  NMT_ASSERT_EQ_STATUS(s, NMT_STOPPED);
  NMT_ASSERT(step >= 3 && step < 1000);
  NMT_ASSERT_EQ_INT(w.last_step, step); /* the stop step was logged */
  /* valid_every = 1: the steps before the one the stop made the last validated. */
  NMT_ASSERT_EQ_INT(w.valid_lines, valid_every == 1 ? step - 1 : 0);
  snprintf(ckdir, sizeof ckdir, "%s/checkpoints", c.run_out_dir);
  NMT_ASSERT_OK(nmt_ckpt_find_latest(ckdir, path));
  nmt_ckpt_header h;
  NMT_ASSERT_OK(nmt_ckpt_read_header(path, &h));
  NMT_ASSERT_EQ_INT(h.step, step);
}

NMT_TEST(engine_stop_never_validates_at_end) { stop_never_validates(1000); }
NMT_TEST(engine_stop_never_validates_when_due) { stop_never_validates(1); }

/* A stop requested before the run starts goes into the first step's control block. CPU
 * workers read that block at once (their enqueue has run the step), so the run ends after step
 * 1; with the device workers' read-behind schedule the block is read while step 2 runs, which
 * then ends the run. Both write the checkpoint of their last step. */
static void steps_of_early_stop(int lagged, long *step) {
  nmt_config c;
  stop_setup(&c, 2, 100);
  nmt_trainer *t = NULL;
  nmt_trainer_options o = quiet_opts();
  o.lagged_reads = lagged;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
  nmt_trainer_request_stop(t);
  nmt_status s = nmt_trainer_run(t);
  *step = nmt_trainer_step(t);
  nmt_trainer_destroy(t);
  NMT_ASSERT_EQ_STATUS(s, NMT_STOPPED);
}

NMT_TEST(engine_stop_ends_the_step_after_the_request) {
  long at_once = -1, late = -1;
  steps_of_early_stop(0, &at_once);
  steps_of_early_stop(1, &late);
  NMT_ASSERT_EQ_INT(at_once, 1);
  NMT_ASSERT_EQ_INT(late, 2);
}

/* Every metrics line of a run, in order. */
typedef struct {
  int n;
  long step[32];
  double tokens[32], loss[32], lr[32];
} metric_lines;

static void record_lines(void *user, const nmt_metrics *m) {
  metric_lines *l = user;
  if (l->n >= 32) return;
  l->step[l->n] = m->step, l->tokens[l->n] = m->tgt_tokens;
  l->loss[l->n] = m->train_loss, l->lr[l->n] = m->lr;
  l->n++;
}

/* The host reads each step's losses one step late (the control block of step s while step s+1
 * runs). The lines of train.log_every = 3 must still cover exactly the steps that
 * log_every = 1 reports one by one: each interval's tokens are the sum of its steps', its loss
 * their token-weighted mean, its lr that of its last step, so the lag neither drops nor
 * double-counts a step. The two runs train identically (logging changes no numerics). */
NMT_TEST(engine_log_every_covers_each_step_once) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], d1[600], d2[600];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(d1, sizeof d1, "%s/every1", dir);
  snprintf(d2, sizeof d2, "%s/every3", dir);
  NMT_ASSERT_OK(write_synthetic(shard, 21));
  metric_lines one = {0}, three = {0};
  nmt_config c;
  nmt_trainer_options o = quiet_opts();
  o.on_metrics = record_lines;
  nmt_trainer *t;
  for (int run = 0; run < 2; run++) {
    tiny_config(&c, run ? d2 : d1, shard);
    c.parallel_devices = 2;
    c.train_max_steps = 10;
    c.train_log_every = run ? 3 : 1;
    o.user = run ? &three : &one;
    NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
    NMT_ASSERT_OK(nmt_trainer_run(t));
    nmt_trainer_destroy(t);
  }
  NMT_ASSERT_EQ_INT(one.n, 10);
  NMT_ASSERT_EQ_INT(three.n, 4);
  const long want_steps[4] = {3, 6, 9, 10};
  int k = 0;
  for (int i = 0; i < three.n; i++) {
    NMT_ASSERT_EQ_INT(three.step[i], want_steps[i]);
    double tok = 0, loss_sum = 0;
    for (; k < one.n && one.step[k] <= three.step[i]; k++)
      tok += one.tokens[k], loss_sum += one.loss[k] * one.tokens[k];
    NMT_ASSERT_EQ_INT(one.step[k - 1], three.step[i]);
    NMT_ASSERT(three.tokens[i] == tok);
    NMT_ASSERT_NEAR(three.loss[i], loss_sum / tok, 1e-12 * loss_sum / tok);
    NMT_ASSERT(three.lr[i] == one.lr[k - 1]);
  }
}

/* ---- fp16 dynamic loss scaling (precision.mode = fp16; the ref backend emulates fp16 GEMMs) */

static void fp16_config(nmt_config *c, const char *dir, const char *shard) {
  tiny_config(c, dir, shard);
  c->precision_mode = NMT_PRECISION_FP16;
  c->parallel_devices = 2;
  c->model_dropout = 0.1f;
}

/* A fresh synthetic shard (data seed `seed`) in the test's directory and fp16_config on it. */
static nmt_status fp16_fixture(nmt_config *c, uint64_t seed) {
  char shard[512]; /* copied into c->data_train */
  const char *dir = nmt_test_tmpdir();
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_TRY(write_synthetic(shard, seed));
  fp16_config(c, dir, shard);
  return NMT_OK;
}

/* Records the last metrics record's loss scale and skipped-step count. */
typedef struct {
  double loss_scale, loss;
  long skipped, step;
} scale_seen;

static void record_scale(void *user, const nmt_metrics *m) {
  scale_seen *s = user;
  s->loss_scale = m->loss_scale;
  s->skipped = m->skipped_steps;
  s->step = m->step;
  s->loss = m->train_loss;
}

/* An overflowing (NaN) gradient on steps 3..5 skips those updates on every rank (parameters
 * bitwise unchanged) and halves the loss scale each time; later steps train again. */
NMT_TEST(engine_fp16_overflow_skips_and_backs_off) {
  nmt_config c;
  NMT_ASSERT_OK(fp16_fixture(&c, 9));
  c.precision_loss_scale = 1024;
  c.precision_growth_interval = 1000;
  c.train_max_steps = 8;
  scale_seen seen = {0};
  nmt_trainer_options o = quiet_opts();
  o.nan_from_step = 2; /* 0-based: steps 3, 4, 5 */
  o.nan_steps = 3;
  o.on_metrics = record_scale;
  o.user = &seen;
  nmt_trainer *t;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
  size_t n;
  NMT_ASSERT_OK(nmt_trainer_train(t, 2));
  NMT_ASSERT_EQ_INT((long)seen.skipped, 0);
  NMT_ASSERT(seen.loss_scale == 1024);
  const float *p = nmt_trainer_params(t, &n);
  float *p2 = malloc(n * sizeof(float));
  memcpy(p2, p, n * sizeof(float));
  NMT_ASSERT_OK(nmt_trainer_train(t, 3));
  p = nmt_trainer_params(t, &n);
  NMT_ASSERT(memcmp(p, p2, n * sizeof(float)) == 0); /* skipped: no update */
  NMT_ASSERT_EQ_INT(seen.step, 5);
  NMT_ASSERT_EQ_INT((long)seen.skipped, 3);
  NMT_ASSERT(seen.loss_scale == 1024.0 / 8);
  NMT_ASSERT_OK(nmt_trainer_train(t, 0));
  p = nmt_trainer_params(t, &n);
  NMT_ASSERT(memcmp(p, p2, n * sizeof(float)) != 0); /* training resumed */
  NMT_ASSERT(isfinite(seen.loss));
  NMT_ASSERT_EQ_INT((long)seen.skipped, 3);
  NMT_ASSERT(seen.loss_scale == 1024.0 / 8);
  nmt_trainer_destroy(t);
  free(p2);
}

/* A NaN on every step from step 2 backs the scale off 16 -> 8 -> 4 -> 2 -> 1; the next
 * overflow would go below precision.floor = 1: NMT_ERR_DIVERGED naming the floor, not an
 * endless loop of skipped steps. */
NMT_TEST(engine_fp16_persistent_overflow_diverges) {
  nmt_config c;
  NMT_ASSERT_OK(fp16_fixture(&c, 10));
  c.precision_loss_scale = 16;
  c.precision_floor = 1;
  c.train_max_steps = 1000;
  nmt_trainer_options o = quiet_opts();
  o.nan_from_step = 1;
  nmt_trainer *t;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
  nmt_status s = nmt_trainer_run(t);
  long step = nmt_trainer_step(t);
  nmt_trainer_destroy(t);
  NMT_ASSERT_EQ_STATUS(s, NMT_ERR_DIVERGED);
  NMT_ASSERT(strstr(nmt_last_error(), "precision.floor") != NULL);
  NMT_ASSERT(strstr(nmt_last_error(), "step 6:") != NULL);
  NMT_ASSERT_EQ_INT(step, 5);
  NMT_ASSERT_EQ_INT(nmt_status_exit_code(s), 5);
}

/* growth_interval clean steps double the scale: 4 -> 32 after 6 steps with interval 2. */
NMT_TEST(engine_fp16_scale_grows) {
  nmt_config c;
  NMT_ASSERT_OK(fp16_fixture(&c, 11));
  c.precision_loss_scale = 4;
  c.precision_growth_interval = 2;
  c.train_max_steps = 6;
  scale_seen seen = {0};
  nmt_trainer_options o = quiet_opts();
  o.on_metrics = record_scale;
  o.user = &seen;
  nmt_trainer *t;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
  NMT_ASSERT_OK(nmt_trainer_run(t));
  nmt_trainer_destroy(t);
  NMT_ASSERT_EQ_INT((long)seen.skipped, 0);
  NMT_ASSERT(seen.loss_scale == 32);
}

/* Real overflow, no injection: at loss scale 2^20 the scaled logits' gradient exceeds fp16's
 * 65504 when the emulated fp16 GEMMs round it, so the first steps overflow and are skipped
 * until the scale is small enough; then the loss falls. */
NMT_TEST(engine_fp16_real_overflow_recovers) {
  nmt_config c;
  NMT_ASSERT_OK(fp16_fixture(&c, 12));
  c.precision_loss_scale = 1048576;
  c.train_max_steps = 30;
  c.train_warmup_steps = 5;
  c.train_lr_scale = 2;
  scale_seen seen = {0};
  double first_loss = 0;
  nmt_trainer_options o = quiet_opts();
  o.on_metrics = record_scale;
  o.user = &seen;
  nmt_trainer *t;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
  NMT_ASSERT_OK(nmt_trainer_train(t, 1));
  first_loss = seen.loss;
  NMT_ASSERT_OK(nmt_trainer_run(t));
  nmt_trainer_destroy(t);
  printf("# fp16 from scale 2^20: %ld skipped, final scale %g, loss %.3f -> %.3f\n",
         seen.skipped, seen.loss_scale, first_loss, seen.loss);
  NMT_ASSERT(seen.skipped >= 1 && seen.skipped < 25);
  NMT_ASSERT(seen.loss_scale <= 65536);
  NMT_ASSERT(isfinite(seen.loss) && seen.loss < first_loss);
}

/* Exact resume carries the loss scaler: 2N steps straight vs N, stop, resume to 2N with
 * overflows and growth on both sides of the stop give bitwise-equal parameters and scale. */
NMT_TEST(engine_fp16_resume_is_exact) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], d1[600], d2[600];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(d1, sizeof d1, "%s/a", dir);
  snprintf(d2, sizeof d2, "%s/b", dir);
  NMT_ASSERT_OK(write_synthetic(shard, 13));
  nmt_trainer_options o = quiet_opts();
  o.nan_from_step = 4; /* steps 5 and 6 overflow */
  o.nan_steps = 2;
  scale_seen s1 = {0}, s2 = {0};
  o.on_metrics = record_scale;
  nmt_config c;
  fp16_config(&c, d1, shard);
  c.precision_loss_scale = 256;
  c.precision_growth_interval = 3;
  c.train_max_steps = 14;
  float *p1 = NULL, *p2 = NULL;
  size_t n = 0;
  nmt_trainer *t;
  o.user = &s1;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
  NMT_ASSERT_OK(nmt_trainer_run(t));
  const float *p = nmt_trainer_params(t, &n);
  p1 = malloc(n * sizeof(float));
  memcpy(p1, p, n * sizeof(float));
  nmt_trainer_destroy(t);

  fp16_config(&c, d2, shard);
  c.precision_loss_scale = 256;
  c.precision_growth_interval = 3;
  c.train_max_steps = 5; /* stops inside the overflow run, one clean step counted */
  o.user = &s2;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
  NMT_ASSERT_OK(nmt_trainer_run(t));
  nmt_trainer_destroy(t);
  c.train_max_steps = 14;
  c.run_resume = 1;
  o.overwrite = 0;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
  NMT_ASSERT_OK(nmt_trainer_run(t));
  p = nmt_trainer_params(t, &n);
  p2 = malloc(n * sizeof(float));
  memcpy(p2, p, n * sizeof(float));
  nmt_trainer_destroy(t);
  printf("# fp16 resume: scale %g / %g, skipped %ld / %ld\n", s1.loss_scale, s2.loss_scale,
         s1.skipped, s2.skipped);
  NMT_ASSERT_EQ_INT(s1.skipped, 2);
  NMT_ASSERT_EQ_INT(s2.skipped, 2);
  NMT_ASSERT(s1.loss_scale == s2.loss_scale);
  NMT_ASSERT(memcmp(p1, p2, n * sizeof(float)) == 0);
  free(p1), free(p2);
}

/* ---- profiling through the engine (issue 5) ---- */

/* A run with the profile window and the timeline on: trace.json parses (Debian's python3 json
 * module, when there) and holds complete events from every worker thread and the loader, with
 * the step, forward and all-reduce ranges; profile.txt lists the module rows; and the
 * parameters are bitwise those of the same run without profiling. */
NMT_TEST(engine_profile_window_trace_and_table) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], d1[600], d2[600], path[700];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(d1, sizeof d1, "%s/plain", dir);
  snprintf(d2, sizeof d2, "%s/prof", dir);
  NMT_ASSERT_OK(write_synthetic(shard, 14));
  nmt_config c;
  tiny_config(&c, d1, shard);
  c.parallel_devices = 2;
  c.model_dropout = 0.1f;
  c.train_max_steps = 8;
  float *g1, *p1, *g2, *p2;
  size_t ng, np;
  NMT_ASSERT_OK(run_copy(&c, &g1, &p1, &ng, &np));
  tiny_config(&c, d2, shard);
  c.parallel_devices = 2;
  c.model_dropout = 0.1f;
  c.train_max_steps = 8;
  c.profile_start_step = 3;
  c.profile_stop_step = 5;
  c.profile_timeline = 1;
  c.profile_peak_tflops = 1; /* skip the measurement: not what this test is about */
  c.profile_peak_gbps = 10;
  NMT_ASSERT_OK(run_copy(&c, &g2, &p2, &ng, &np));
  NMT_ASSERT(memcmp(p1, p2, np * sizeof(float)) == 0);
  free(g1), free(p1), free(g2), free(p2);

  snprintf(path, sizeof path, "%s/run/trace.json", d2);
  char *tr = nmt_th_read_file(path, NULL);
  NMT_ASSERT(tr != NULL);
  const char *tracks[] = {"cpu0", "cpu1", "loader"};
  for (int i = 0; i < 3; i++) {
    char want[64];
    snprintf(want, sizeof want, "\"args\": {\"name\": \"%s\"}", tracks[i]);
    NMT_ASSERT(strstr(tr, want) != NULL);
  }
  NMT_ASSERT(strstr(tr, "\"name\": \"step\"") && strstr(tr, "\"name\": \"allreduce.b0\"") &&
             strstr(tr, "\"name\": \"decoder.1.cross_attn\""));
  /* Complete events of both workers: the tid of each worker's thread_name appears in an X. */
  for (int w = 0; w < 2; w++) {
    char name[64], *p, *q;
    snprintf(name, sizeof name, "\"args\": {\"name\": \"cpu%d\"}", w);
    p = strstr(tr, name);
    NMT_ASSERT(p != NULL);
    while (p > tr && strncmp(p, "\"tid\": ", 7)) p--; /* the thread_name record's tid */
    int tid = atoi(p + 7), found = 0;
    char x[64];
    snprintf(x, sizeof x, "\"ph\": \"X\", \"pid\": 1, \"tid\": %d,", tid);
    for (q = tr; (q = strstr(q, x)) != NULL; q++) found++;
    if (found < 10) printf("# cpu%d (tid %d): %d complete events\n", w, tid, found);
    NMT_ASSERT(found >= 10);
  }
  free(tr);
  if (access("/usr/bin/python3", X_OK) == 0) {
    char cmd[900];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 -c \"import json,sys; json.load(open(sys.argv[1]))\" '%s'",
             path);
    NMT_ASSERT_EQ_INT(system(cmd), 0);
  }
  snprintf(path, sizeof path, "%s/run/profile.txt", d2);
  char *tab = nmt_th_read_file(path, NULL);
  NMT_ASSERT(tab && strstr(tab, "encoder.0.self_attn") && strstr(tab, "generator.proj"));
  free(tab);
}
