/* test_multiworker.c — several workers through the host-staged communicator (parallel.comm =
 * host): on one GPU (cuda_multiworker_*, parallel.devices = 0,0: two workers, each with its
 * own streams, cuBLASLt handle, events, scratch and half weights, sharing GPU 0), and on CPU
 * workers (multiworker_*_cpu: the same staging code over the reference backend's copies).
 *
 * What each case checks (the GPU tests are tools/gpu-check.sh first's group cuda_multiworker;
 * without a CUDA device they print "# SKIP no CUDA device"):
 *  - two_vs_accum (fp32; ZeRO 1 and 2 with buckets small enough for several, the overlap
 *    path; bf16): 2 workers with accum 1 against 1 worker with accum 2 on the same batches
 *    (the dealing gives worker k the step's k-th batch, and dropout is keyed by the global
 *    batch index, so both see the same micro-batches). Not bitwise: the host sums the two
 *    workers' gradients once (g0 + g1), where one worker adds its second micro-batch into the
 *    first inside backward, and a parameter that gets several contributions per micro-batch
 *    (the tied embedding, biases) sums them in another order. fp32: losses and parameters
 *    within 1e-6 (+ 1e-5 relative for parameters over 4 Adam steps with eps 1e-3, as
 *    test_engine.c's (devices, accum) equivalence); bf16: 2e-3. On a GPU also against 2 CPU
 *    workers (auto communicator) as cuda_train_20_steps_matches_cpu does: 1e-3 fp32, 5e-2 bf16.
 *  - staged_matches_host (CPU): 2 CPU workers with comm = host give bitwise the losses and
 *    parameters of comm = auto (the plain host communicator): the staging changes no sum.
 *  - runs_are_bitwise_equal (GPU): two 2-worker runs, ZeRO 1: bitwise (the host sums in rank
 *    order, whatever the timing).
 *  - failure: worker 1 fails inside step 2's first bucket collective (fail_bucket, the
 *    engine's fault hook); worker 0, waiting in the host group at its flush, is ended by the
 *    abort within parallel.timeout_s; the error names rank 1 and the injected failure, and
 *    the run directory keeps config.ini and a status.json that says failed.
 *  - valid: the validation loss of 2 workers (disjoint valid batches, all-reduced) equals 1
 *    worker's within 1e-5 after the same 2 steps (accum 2 there).
 *  - stop_resume: SIGTERM during a step of 2 workers: NMT_STOPPED (the CLI's exit 75), a
 *    checkpoint at the step the run stopped after, and a resume to the end is bitwise the
 *    straight run (parameters and the losses after the stop). */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "nmt/backend.h"
#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/trainer.h"
#include "helpers.h"
#include "test.h"

enum { MW_MAX_STEPS = 16 };

typedef struct {
  double loss[MW_MAX_STEPS + 1];
  double valid[MW_MAX_STEPS + 1];
  int seen;
  long raise_at; /* stop_resume: raise SIGTERM at this step's metrics (0: never) */
} curve;

static void on_metrics(void *user, const nmt_metrics *m) {
  curve *c = user;
  if (m->step < 1 || m->step > MW_MAX_STEPS) return;
  c->loss[m->step] = m->train_loss;
  if (m->has_valid) c->valid[m->step] = m->valid_loss;
  c->seen++;
  if (c->raise_at && m->step == c->raise_at) raise(SIGTERM);
}

typedef struct {
  nmt_device_kind dev;
  int workers, accum, zero;
  nmt_precision prec;
  nmt_comm_kind comm;
  long steps;
  int valid;
} spec;

static int have_gpu(void) {
  const nmt_backend *be = nmt_backend_cuda_get();
  int n = 0;
  return be && be->device_count(&n) == NMT_OK && n > 0;
}

/* The tiny model with dropout, several buckets (0.002 MiB: ZeRO 1's overlap path too). Two
 * GPU workers share GPU 0 through parallel.devices = 0,0 and comm = host. */
static void config_for(nmt_config *c, const char *dir, const char *name, const spec *s) {
  char shard[NMT_PATH_MAX], out[NMT_PATH_MAX];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  if (snprintf(out, sizeof out, "%s/%s", dir, name) >= (int)sizeof out) out[0] = 0;
  nmt_th_tiny_config(c, out, shard);
  c->model_dropout = c->model_attn_dropout = c->model_relu_dropout = 0.1f;
  c->train_max_steps = s->steps;
  c->train_adam_eps = 1e-3f; /* see test_engine.c: keeps the update continuous in the grads */
  c->train_warmup_steps = 4;
  c->parallel_device = s->dev;
  c->parallel_devices = s->workers;
  if (s->dev == NMT_DEVICE_CUDA && s->workers > 1) {
    c->parallel_device_ids_n = s->workers;
    for (int i = 0; i < s->workers; i++) c->parallel_device_ids[i] = 0;
  }
  c->parallel_comm = s->workers > 1 ? s->comm : NMT_COMM_AUTO;
  c->train_accum_steps = s->accum;
  c->parallel_zero = s->zero;
  c->parallel_bucket_mb = 0.002f;
  c->precision_mode = s->prec;
  c->parallel_timeout_s = 30;
  /* Given, not measured: the GPU's peak measurement (8192^3 GEMMs, 1 GiB copies) would cost
   * every run of the group a second or two of first's 60 s. */
  c->profile_peak_tflops = 100;
  c->profile_peak_gbps = 1000;
  if (s->valid) {
    snprintf(c->data_valid, sizeof c->data_valid, "%s", shard);
    c->train_valid_every = 2;
  }
}

static nmt_trainer_options opts(curve *cv) {
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  o.on_metrics = on_metrics;
  o.user = cv;
  o.overwrite = 1;
  return o;
}

/* Trains c with options o; *params (malloc'd; params may be NULL) gets the final parameters. */
static nmt_status train(const nmt_config *c, nmt_trainer_options o, float **params, size_t *np) {
  nmt_trainer *t = NULL;
  NMT_TRY(nmt_trainer_create(c, &o, &t));
  nmt_status s = nmt_trainer_run(t);
  if (s == NMT_OK && params) {
    const float *p = nmt_trainer_params(t, np);
    *params = malloc(*np * sizeof(float));
    if (*params) memcpy(*params, p, *np * sizeof(float));
    else s = nmt_errorf(NMT_ERR_NOMEM, "params copy");
  }
  nmt_trainer_destroy(t);
  return s;
}

static nmt_status run_spec(const char *dir, const char *name, const spec *s, curve *cv,
                           float **params, size_t *np) {
  nmt_config c;
  config_for(&c, dir, name, s);
  memset(cv, 0, sizeof *cv);
  return train(&c, opts(cv), params, np);
}

static const char *prec_name(nmt_precision p) { return p == NMT_PRECISION_BF16 ? "bf16" : "fp32"; }

/* 2 workers (comm = host) with accum 1 vs 1 worker with accum 2; on a GPU also vs 2 CPU
 * workers. */
static void two_vs_accum(nmt_device_kind dev, int zero, nmt_precision prec) {
  if (dev == NMT_DEVICE_CUDA && !have_gpu()) NMT_SKIP("no CUDA device");
  const char *dir = nmt_test_tmpdir();
  char shard[NMT_PATH_MAX];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 96, 31));
  const long steps = 4;
  spec two = {dev, 2, 1, zero, prec, NMT_COMM_HOST, steps, 0};
  spec one = {dev, 1, 2, zero, prec, NMT_COMM_AUTO, steps, 0};
  curve a, b;
  float *pa = NULL, *pb = NULL;
  size_t na = 0, nb = 0;
  NMT_ASSERT_OK(run_spec(dir, "two", &two, &a, &pa, &na));
  nmt_status s = run_spec(dir, "one", &one, &b, &pb, &nb);
  if (s != NMT_OK) free(pa);
  NMT_ASSERT_OK(s);
  const double tol = prec == NMT_PRECISION_BF16 ? 2e-3 : 1e-6;
  double worst = 0;
  for (long k = 1; k <= steps; k++) worst = fmax(worst, fabs(a.loss[k] - b.loss[k]));
  size_t worst_i = 0, bad = 0;
  double worst_p = 0;
  for (size_t i = 0; na == nb && i < na; i++) {
    const double d = fabs((double)pa[i] - pb[i]);
    if (d > worst_p) worst_p = d, worst_i = i;
    bad += !(d <= tol + (prec == NMT_PRECISION_BF16 ? 2e-2 : 1e-5) * fabs((double)pb[i]));
  }
  printf("# %s zero %d, %s: 2 workers x accum 1 vs 1 x accum 2 over %ld steps: loss %.5f -> "
         "%.5f, max |loss diff| %.2e, max |param diff| %.2e at %zu, %zu of %zu params beyond "
         "the tolerance (%.0e)\n", dev == NMT_DEVICE_CUDA ? "GPU" : "CPU", zero, prec_name(prec),
         steps, a.loss[1], a.loss[steps], worst, worst_p, worst_i, bad, na, tol);
  NMT_ASSERT_EQ_INT(a.seen, steps);
  NMT_ASSERT_EQ_INT(b.seen, steps);
  NMT_ASSERT_EQ_INT(na, nb);
  int ok = worst <= tol && bad == 0;
  if (ok && dev == NMT_DEVICE_CUDA) {
    /* The CPU reference with 2 workers and its own host communicator. */
    spec cpu = {NMT_DEVICE_CPU, 2, 1, zero, prec, NMT_COMM_AUTO, steps, 0};
    curve r;
    NMT_ASSERT_OK(run_spec(dir, "cpu", &cpu, &r, NULL, NULL));
    double wc = 0;
    for (long k = 1; k <= steps; k++) wc = fmax(wc, fabs(a.loss[k] - r.loss[k]));
    printf("# vs 2 CPU workers: max |loss diff| %.2e\n", wc);
    ok = wc <= (prec == NMT_PRECISION_BF16 ? 5e-2 : 1e-3);
  }
  free(pa), free(pb);
  NMT_ASSERT(ok);
}

NMT_TEST(cuda_multiworker_two_vs_accum_fp32) { two_vs_accum(NMT_DEVICE_CUDA, 0, NMT_PRECISION_FP32); }
NMT_TEST(cuda_multiworker_two_vs_accum_zero1) { two_vs_accum(NMT_DEVICE_CUDA, 1, NMT_PRECISION_FP32); }
NMT_TEST(cuda_multiworker_two_vs_accum_zero2) { two_vs_accum(NMT_DEVICE_CUDA, 2, NMT_PRECISION_FP32); }
NMT_TEST(cuda_multiworker_two_vs_accum_bf16) { two_vs_accum(NMT_DEVICE_CUDA, 1, NMT_PRECISION_BF16); }
NMT_TEST(multiworker_two_vs_accum_cpu) {
  two_vs_accum(NMT_DEVICE_CPU, 0, NMT_PRECISION_FP32);
  two_vs_accum(NMT_DEVICE_CPU, 2, NMT_PRECISION_FP32);
}

/* CPU workers: comm = host (staged through the reference's copies) is bitwise comm = auto. */
NMT_TEST(multiworker_staged_matches_host_cpu) {
  const char *dir = nmt_test_tmpdir();
  char shard[NMT_PATH_MAX];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 96, 32));
  const struct {
    int zero, accum;
    nmt_precision prec;
  } cases[] = {{0, 1, NMT_PRECISION_FP32}, {1, 1, NMT_PRECISION_FP32},
               {2, 2, NMT_PRECISION_FP32}, {1, 1, NMT_PRECISION_BF16}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    spec host = {NMT_DEVICE_CPU, 2, cases[k].accum, cases[k].zero, cases[k].prec, NMT_COMM_AUTO,
                 3, 0};
    spec staged = host;
    staged.comm = NMT_COMM_HOST;
    curve a, b;
    float *pa = NULL, *pb = NULL;
    size_t na = 0, nb = 0;
    NMT_ASSERT_OK(run_spec(dir, "host", &host, &a, &pa, &na));
    nmt_status s = run_spec(dir, "staged", &staged, &b, &pb, &nb);
    size_t differ = 0;
    for (size_t i = 0; s == NMT_OK && na == nb && i < na; i++)
      differ += memcmp(&pa[i], &pb[i], sizeof(float)) != 0;
    const int same_loss = !memcmp(a.loss, b.loss, sizeof a.loss);
    free(pa), free(pb);
    printf("# zero %d, accum %d, %s: %zu of %zu parameters differ, losses %s\n", cases[k].zero,
           cases[k].accum, prec_name(cases[k].prec), differ, na, same_loss ? "equal" : "DIFFER");
    NMT_ASSERT_OK(s);
    NMT_ASSERT_EQ_INT(na, nb);
    NMT_ASSERT_EQ_INT(differ, 0);
    NMT_ASSERT(same_loss);
    NMT_ASSERT_EQ_INT(b.seen, 3);
  }
}

NMT_TEST(cuda_multiworker_runs_are_bitwise_equal) {
  if (!have_gpu()) NMT_SKIP("no CUDA device");
  const char *dir = nmt_test_tmpdir();
  char shard[NMT_PATH_MAX];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 96, 33));
  spec s = {NMT_DEVICE_CUDA, 2, 1, 1, NMT_PRECISION_FP32, NMT_COMM_HOST, 4, 0};
  curve a, b;
  float *pa = NULL, *pb = NULL;
  size_t na = 0, nb = 0;
  NMT_ASSERT_OK(run_spec(dir, "a", &s, &a, &pa, &na));
  nmt_status st = run_spec(dir, "b", &s, &b, &pb, &nb);
  size_t differ = 0;
  for (size_t i = 0; st == NMT_OK && na == nb && i < na; i++)
    differ += memcmp(&pa[i], &pb[i], sizeof(float)) != 0;
  free(pa), free(pb);
  printf("# two 2-worker GPU runs: %zu of %zu parameters differ\n", differ, na);
  NMT_ASSERT_OK(st);
  NMT_ASSERT_EQ_INT(differ, 0);
  NMT_ASSERT(!memcmp(a.loss, b.loss, sizeof a.loss));
}

/* Worker 1 fails inside step 2's first bucket; worker 0 must be ended, not left waiting. */
static void failure(nmt_device_kind dev) {
  if (dev == NMT_DEVICE_CUDA && !have_gpu()) NMT_SKIP("no CUDA device");
  const char *dir = nmt_test_tmpdir();
  char shard[NMT_PATH_MAX];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 96, 34));
  spec s = {dev, 2, 1, 0, NMT_PRECISION_FP32, NMT_COMM_HOST, 6, 0};
  nmt_config c;
  config_for(&c, dir, "fail", &s);
  curve cv = {0};
  nmt_trainer_options o = opts(&cv);
  o.fail_rank = 1;
  o.fail_step = 2;
  o.fail_bucket = 0;
  const double t0 = nmt_th_now();
  nmt_status st = train(&c, o, NULL, NULL);
  const double dt = nmt_th_now() - t0;
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", nmt_last_error());
  printf("# run ended in %.2f s (parallel.timeout_s %g): %s\n", dt, c.parallel_timeout_s, msg);
  NMT_ASSERT_EQ_STATUS(st, NMT_ERR_INTERNAL);
  NMT_ASSERT(strstr(msg, "injected failure on rank 1") != NULL);
  NMT_ASSERT(dt < c.parallel_timeout_s);
  char path[NMT_PATH_MAX + 32];
  struct stat sb;
  snprintf(path, sizeof path, "%s/config.ini", c.run_out_dir);
  NMT_ASSERT(stat(path, &sb) == 0);
  snprintf(path, sizeof path, "%s/status.json", c.run_out_dir);
  char *status = nmt_th_read_file(path, NULL);
  NMT_ASSERT(status != NULL);
  const int failed = strstr(status, "failed") != NULL;
  free(status);
  NMT_ASSERT(failed);
}

NMT_TEST(cuda_multiworker_failure_ends_the_other) { failure(NMT_DEVICE_CUDA); }
NMT_TEST(multiworker_failure_ends_the_other_cpu) { failure(NMT_DEVICE_CPU); }

/* Validation split over 2 workers and all-reduced = 1 worker's, after the same 2 steps. */
static void valid(nmt_device_kind dev) {
  if (dev == NMT_DEVICE_CUDA && !have_gpu()) NMT_SKIP("no CUDA device");
  const char *dir = nmt_test_tmpdir();
  char shard[NMT_PATH_MAX];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 96, 35));
  spec two = {dev, 2, 1, 0, NMT_PRECISION_FP32, NMT_COMM_HOST, 2, 1};
  spec one = {dev, 1, 2, 0, NMT_PRECISION_FP32, NMT_COMM_AUTO, 2, 1};
  curve a, b;
  NMT_ASSERT_OK(run_spec(dir, "two", &two, &a, NULL, NULL));
  NMT_ASSERT_OK(run_spec(dir, "one", &one, &b, NULL, NULL));
  printf("# valid loss at step 2: %.6f with 2 workers, %.6f with 1\n", a.valid[2], b.valid[2]);
  NMT_ASSERT(a.valid[2] > 0 && b.valid[2] > 0); /* a validation really ran */
  NMT_ASSERT(fabs(a.valid[2] - b.valid[2]) <= 1e-5 * fabs(b.valid[2]));
}

NMT_TEST(cuda_multiworker_valid_loss) { valid(NMT_DEVICE_CUDA); }
NMT_TEST(multiworker_valid_loss_cpu) { valid(NMT_DEVICE_CPU); }

/* SIGTERM at step 2's metrics, while the workers sleep inside a later step: the run stops
 * after a step with its checkpoint; the resume to the end is bitwise the straight run. */
static void stop_resume(nmt_device_kind dev) {
  if (dev == NMT_DEVICE_CUDA && !have_gpu()) NMT_SKIP("no CUDA device");
  const char *dir = nmt_test_tmpdir();
  char shard[NMT_PATH_MAX];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 96, 36));
  const long steps = 8;
  spec s = {dev, 2, 1, 1, NMT_PRECISION_FP32, NMT_COMM_HOST, steps, 0};
  curve straight, first, rest;
  float *pa = NULL, *pb = NULL;
  size_t na = 0, nb = 0;
  NMT_ASSERT_OK(run_spec(dir, "straight", &s, &straight, &pa, &na));
  nmt_config c;
  config_for(&c, dir, "stopped", &s);
  memset(&first, 0, sizeof first);
  first.raise_at = 2;
  nmt_trainer_options o = opts(&first);
  o.handle_signals = 1;
  o.step_delay_ms = 300;
  nmt_trainer *t = NULL;
  nmt_status st = nmt_trainer_create(&c, &o, &t);
  if (st == NMT_OK) st = nmt_trainer_run(t);
  const long stopped = t ? nmt_trainer_step(t) : -1;
  nmt_trainer_destroy(t);
  int ok = st == NMT_STOPPED && stopped >= 2 && stopped < steps;
  char ckdir[NMT_PATH_MAX + 16], latest[1024];
  nmt_ckpt_header h = {0};
  snprintf(ckdir, sizeof ckdir, "%s/checkpoints", c.run_out_dir);
  ok = ok && nmt_ckpt_find_latest(ckdir, latest) == NMT_OK &&
       nmt_ckpt_read_header(latest, &h) == NMT_OK && h.step == stopped;
  printf("# SIGTERM at step 2's metrics: %s after step %ld, checkpoint at step %ld\n",
         nmt_status_str(st), stopped, (long)h.step);
  if (ok) {
    c.run_resume = 1;
    memset(&rest, 0, sizeof rest);
    nmt_trainer_options ro = opts(&rest);
    ro.overwrite = 0;
    st = train(&c, ro, &pb, &nb);
    ok = st == NMT_OK;
  }
  size_t differ = 0;
  for (size_t i = 0; ok && na == nb && i < na; i++)
    differ += memcmp(&pa[i], &pb[i], sizeof(float)) != 0;
  int same_loss = ok;
  for (long k = stopped + 1; ok && k <= steps; k++)
    same_loss = same_loss && !memcmp(&straight.loss[k], &rest.loss[k], sizeof(double));
  free(pa), free(pb);
  if (ok) printf("# resumed to step %ld: %zu of %zu parameters differ from the straight run, "
                 "losses after the stop %s\n", steps, differ, na, same_loss ? "equal" : "DIFFER");
  NMT_ASSERT(ok);
  NMT_ASSERT_EQ_INT(na, nb);
  NMT_ASSERT_EQ_INT(differ, 0);
  NMT_ASSERT(same_loss);
}

NMT_TEST(cuda_multiworker_stop_resume_is_exact) { stop_resume(NMT_DEVICE_CUDA); }
NMT_TEST(multiworker_stop_resume_is_exact_cpu) { stop_resume(NMT_DEVICE_CPU); }
