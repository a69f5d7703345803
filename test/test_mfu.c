/* test_mfu.c — MFU as reported in metrics.jsonl: a fraction of the peak, never above 1, and the
 * estimate of a CPU step's time logged before step 1. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "nmt/config.h"
#include "nmt/log.h"
#include "nmt/trainer.h"
#include "helpers.h"
#include "test.h"

typedef struct {
  int n, n_null, n_above;
  double max;
} mfu_seen;

static void on_metrics(void *user, const nmt_metrics *m) {
  mfu_seen *s = user;
  s->n++;
  if (!isfinite(m->mfu)) s->n_null++;
  else {
    if (m->mfu > 1.0) s->n_above++;
    if (m->mfu > s->max) s->max = m->mfu;
  }
}

typedef struct {
  pthread_mutex_t mu;
  int warned, estimated, estimated_warn, auto_warned, on_cpu;
  char line[512], estimate[512];
} log_seen;

static void on_log(void *user, nmt_log_level level, const char *line) {
  log_seen *s = user;
  pthread_mutex_lock(&s->mu);
  if (level == NMT_LOG_WARN && strstr(line, "MFU") && strstr(line, "above 1") &&
      strstr(line, "peak_tflops")) {
    s->warned++;
    snprintf(s->line, sizeof s->line, "%s", line);
  }
  if (level == NMT_LOG_WARN && strstr(line, "[parallel] device = auto") &&
      strstr(line, "CPU worker")) s->auto_warned++;
  if (strstr(line, "training ") && strstr(line, " ref worker(s)")) s->on_cpu++;
  if (strstr(line, "estimated at least") && strstr(line, "per step on CPU workers")) {
    s->estimated++;
    s->estimated_warn += level == NMT_LOG_WARN;
    snprintf(s->estimate, sizeof s->estimate, "%s", line);
  }
  pthread_mutex_unlock(&s->mu);
}

/* Trains the tiny model 4 steps with [profile] peak_tflops = peak; metrics and log lines seen. */
static nmt_status run_on(nmt_device_kind device, double peak, mfu_seen *m, log_seen *l);
static nmt_status run(double peak, mfu_seen *m, log_seen *l) {
  return run_on(NMT_DEVICE_CPU, peak, m, l);
}

static nmt_status run_on(nmt_device_kind device, double peak, mfu_seen *m, log_seen *l) {
  static int n_runs; /* each run in its own directory: a run directory is never reused */
  char dir[1024];
  snprintf(dir, sizeof dir, "%s/run%d", nmt_test_tmpdir(), n_runs++);
  if (mkdir(dir, 0777) != 0) return nmt_errorf(NMT_ERR_IO, "mkdir %s", dir);
  nmt_config c;
  NMT_TRY(nmt_th_tiny_run(dir, 64, 5, &c));
  c.train_max_steps = 4;
  c.profile_peak_tflops = peak;
  c.profile_peak_gbps = 10;
  c.parallel_device = device;
  nmt_log_sink sink = {on_log, l};
  nmt_log_set_sink(&sink);
  const nmt_log_level level = nmt_log_get_level();
  nmt_log_set_level(NMT_LOG_INFO);
  nmt_trainer *t = NULL;
  nmt_status s = nmt_th_trainer_quiet(&c, on_metrics, m, &t);
  if (s == NMT_OK) s = nmt_trainer_train(t, 0);
  nmt_trainer_destroy(t);
  nmt_log_set_level(level);
  nmt_log_set_sink(NULL);
  return s;
}

/* A peak far below what the steps run at (1e-9 TFLOP/s = 1 kFLOP/s) would give MFU in the
 * millions: reported as null with one warning naming [profile] peak_tflops, not as a number
 * above 1. A peak far above gives a finite MFU in (0, 1]. */
NMT_TEST(mfu_never_above_one) {
  mfu_seen low = {0}, high = {0};
  log_seen l1 = {.mu = PTHREAD_MUTEX_INITIALIZER}, l2 = {.mu = PTHREAD_MUTEX_INITIALIZER};
  NMT_ASSERT_OK(run(1e-9, &low, &l1));
  printf("# peak 1e-9 TFLOP/s: %d metrics lines, %d null, %d above 1; warning: %s\n", low.n,
         low.n_null, low.n_above, l1.line);
  NMT_ASSERT(low.n >= 4);
  NMT_ASSERT_EQ_INT(low.n_above, 0);
  NMT_ASSERT_EQ_INT(low.n_null, low.n);
  NMT_ASSERT_EQ_INT(l1.warned, 1);
  NMT_ASSERT_OK(run(1e3, &high, &l2));
  printf("# peak 1e3 TFLOP/s: %d metrics lines, max MFU %.3g\n", high.n, high.max);
  NMT_ASSERT_EQ_INT(high.n_null, 0);
  NMT_ASSERT(high.max > 0 && high.max <= 1.0);
  NMT_ASSERT_EQ_INT(l2.warned, 0);
}

/* Before step 1 on CPU workers: the least time a step can take, from the model FLOPs of the
 * training order and the peak; a warning naming the likely cause when that is a minute or more
 * (1e-9 TFLOP/s makes it an hour), an info line otherwise. */
NMT_TEST(mfu_step_estimate_before_step_1) {
  mfu_seen m1 = {0}, m2 = {0};
  log_seen slow = {.mu = PTHREAD_MUTEX_INITIALIZER}, fast = {.mu = PTHREAD_MUTEX_INITIALIZER};
  NMT_ASSERT_OK(run(1e-9, &m1, &slow));
  NMT_ASSERT_OK(run(1e3, &m2, &fast));
  printf("# %s\n# %s\n", slow.estimate, fast.estimate);
  NMT_ASSERT_EQ_INT(slow.estimated, 1);
  NMT_ASSERT_EQ_INT(slow.estimated_warn, 1);
  NMT_ASSERT(strstr(slow.estimate, "sized for GPUs") != NULL);
  NMT_ASSERT_EQ_INT(fast.estimated, 1);
  NMT_ASSERT_EQ_INT(fast.estimated_warn, 0);
}

typedef struct {
  int n;
  double ms[64];
  long step[64];
} step_ms_seen;

static void on_step_ms(void *user, const nmt_metrics *m) {
  step_ms_seen *s = user;
  if (s->n < 64) s->step[s->n] = m->step, s->ms[s->n++] = m->step_ms;
}

/* Trains a tiny run of `steps` (a record per step, a checkpoint every 3; valid_every > 0:
 * validation on the train shard) with a step_ms / valid_ms sleep per step / validation, into
 * *s; prints what it saw. NMT_OK or the run's error. */
static nmt_status timed_run(int steps, int valid_every, int step_ms, int valid_ms,
                            step_ms_seen *s) {
  nmt_config c;
  NMT_TRY(nmt_th_tiny_run(nmt_test_tmpdir(), 64, 5, &c));
  if (valid_every > 0) snprintf(c.data_valid, sizeof c.data_valid, "%s", c.data_train);
  c.train_max_steps = steps;
  c.train_log_every = 1;
  c.train_valid_every = valid_every;
  c.train_save_every = 3;
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  o.on_metrics = on_step_ms;
  o.user = s;
  o.step_delay_ms = step_ms;
  o.valid_delay_ms = valid_ms;
  nmt_trainer *t = NULL;
  NMT_TRY(nmt_trainer_create(&c, &o, &t));
  nmt_status st = nmt_trainer_train(t, 0);
  nmt_trainer_destroy(t);
  printf("# step_ms with a %d ms sleep per step and %d ms per validation:", step_ms, valid_ms);
  for (int i = 0; i < s->n; i++) printf(" %ld:%.1f", s->step[i], s->ms[i]);
  printf("\n");
  return st;
}

/* On CPU workers the host reads a step's results after enqueuing (and so running) the next
 * one; a checkpoint step ends that read-ahead. Each metrics interval must time its own steps:
 * timed to the read, a checkpoint step showed 0 ms (and the step before it two steps' time),
 * which also inflated tokens/s and MFU. Every step here sleeps DELAY_MS inside its own time
 * (options.step_delay_ms), so every interval (one step each) lasts at least that long. */
NMT_TEST(mfu_interval_times_its_own_steps) {
  enum { DELAY_MS = 25 };
  step_ms_seen s = {0};
  NMT_ASSERT_OK(timed_run(9, 0, DELAY_MS, 0, &s));
  NMT_ASSERT_EQ_INT(s.n, 9);
  for (int i = 0; i < s.n; i++) NMT_ASSERT(s.ms[i] >= DELAY_MS);
}

/* Validation and checkpoint writes are left out of the metrics intervals: a validation that
 * lasts VALID_MS (options.valid_delay_ms, every 2 steps, with a checkpoint every 3) must not
 * show in any record's step_ms, while each step's own STEP_MS sleep does. Before, the record
 * of a validation step (on a GPU) or of the step after it (CPU workers) carried it. */
NMT_TEST(mfu_interval_leaves_out_validation) {
  enum { STEP_MS = 20, VALID_MS = 1500 };
  step_ms_seen s = {0};
  NMT_ASSERT_OK(timed_run(6, 2, STEP_MS, VALID_MS, &s));
  NMT_ASSERT_EQ_INT(s.n, 6);
  for (int i = 0; i < s.n; i++) {
    NMT_ASSERT(s.ms[i] >= STEP_MS);
    NMT_ASSERT(s.ms[i] < VALID_MS / 2);
  }
}

/* parallel.device = auto without a GPU (conf/base.ini on a machine without one) trains on CPU
 * workers: said as a warning, not an info line a user scrolls past. Where this test binary
 * sees a CUDA device, auto picks it and there is nothing to check. */
NMT_TEST(mfu_auto_device_fallback_warns) {
  mfu_seen m = {0};
  log_seen l = {.mu = PTHREAD_MUTEX_INITIALIZER};
  NMT_ASSERT_OK(run_on(NMT_DEVICE_AUTO, 1e3, &m, &l));
  if (!l.on_cpu) NMT_SKIP("a CUDA device is visible: auto picks it");
  NMT_ASSERT_EQ_INT(l.auto_warned, 1);
}
