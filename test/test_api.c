/* test_api.c — the public C API (include/nmt/nmt.h): segments, evaluate, save/resume, stop,
 * errors, callbacks, the {job} rule for Slurm, and tools/embed_example built against
 * libnmt.so. */
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "helpers.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/model.h"
#include "nmt/nmt.h"
#include "test.h"

typedef struct {
  char dir[512], shard[600], valid[600], ini[600], run[600];
} api_fixture;

static int api_init(api_fixture *f, const char *name, long max_steps) {
  snprintf(f->dir, sizeof f->dir, "%s", nmt_test_tmpdir());
  snprintf(f->shard, sizeof f->shard, "%s/train.shard", f->dir);
  snprintf(f->valid, sizeof f->valid, "%s/valid.shard", f->dir);
  snprintf(f->ini, sizeof f->ini, "%s/%s.ini", f->dir, name);
  snprintf(f->run, sizeof f->run, "%s/%s", f->dir, name);
  if (access(f->shard, R_OK) != 0 && nmt_th_write_synthetic(f->shard, 96, 6) != NMT_OK) return -1;
  if (access(f->valid, R_OK) != 0 && nmt_th_write_synthetic(f->valid, 24, 99) != NMT_OK) return -1;
  char extra[800];
  snprintf(extra, sizeof extra, "[data]\nvalid = \"%s\"\n", f->valid);
  return nmt_th_write_ini(f->ini, f->run, f->shard, max_steps, extra);
}

static nmt_session_options quiet(void) {
  nmt_session_options o;
  nmt_session_options_default(&o);
  o.quiet = 1;
  return o;
}

/* Trains a fresh session to the end in one call; returns a malloc'd copy of the parameters. */
static float *straight(const api_fixture *f, size_t *n) {
  nmt_session_options o = quiet();
  nmt_session *s;
  if (nmt_session_open(f->ini, NULL, 0, &o, &s) != NMT_OK) return NULL;
  const float *p;
  float *copy = NULL;
  if (nmt_session_train(s, 0) == NMT_OK && nmt_session_params(s, &p, n) == NMT_OK) {
    copy = malloc(*n * sizeof(float));
    memcpy(copy, p, *n * sizeof(float));
  }
  nmt_session_close(s);
  return copy;
}

static long count_diff(const float *a, const float *b, size_t n) {
  long d = 0;
  for (size_t i = 0; i < n; i++) d += memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return d;
}

/* 3 + 7 + rest steps in three calls equal one call, bitwise; evaluate agrees too. */
NMT_TEST(api_segments_equal_one_run) {
  enum { M = 20 };
  api_fixture a, b;
  NMT_ASSERT(api_init(&a, "one", M) == 0);
  NMT_ASSERT(api_init(&b, "three", M) == 0);
  size_t n1, n2;
  float *p1 = straight(&a, &n1);
  NMT_ASSERT(p1 != NULL);
  nmt_session_options o = quiet();
  nmt_session *s;
  NMT_ASSERT_OK(nmt_session_open(b.ini, NULL, 0, &o, &s));
  long step, max;
  NMT_ASSERT_OK(nmt_session_train(s, 3));
  NMT_ASSERT_OK(nmt_session_progress(s, &step, &max));
  NMT_ASSERT_EQ_INT(step, 3);
  NMT_ASSERT_EQ_INT(max, M);
  double l1, n_1;
  NMT_ASSERT_OK(nmt_session_evaluate(s, &l1, &n_1)); /* between segments: must not disturb */
  NMT_ASSERT_OK(nmt_session_train(s, 7));
  NMT_ASSERT_OK(nmt_session_progress(s, &step, NULL));
  NMT_ASSERT_EQ_INT(step, 10);
  NMT_ASSERT_OK(nmt_session_train(s, 0));
  NMT_ASSERT_OK(nmt_session_progress(s, &step, NULL));
  NMT_ASSERT_EQ_INT(step, M);
  NMT_ASSERT_OK(nmt_session_train(s, 5)); /* finished: nothing more to do, still OK */
  const float *p2;
  NMT_ASSERT_OK(nmt_session_params(s, &p2, &n2));
  NMT_ASSERT_EQ_INT(n1, n2);
  long d = count_diff(p1, p2, n1);
  double l2, nll2;
  NMT_ASSERT_OK(nmt_session_evaluate(s, &l2, &nll2));
  nmt_session_close(s);
  free(p1);
  if (d) nmt_test_fail(__FILE__, __LINE__, "%ld of %zu parameters differ", d, n1);
  printf("# valid loss %.4f at step 3, %.4f at step %d\n", l1, l2, M);
  NMT_ASSERT(isfinite(l1) && isfinite(l2) && l2 < l1);
}

/* evaluate equals an independent pass: the model's eval forward over every valid batch. */
NMT_TEST(api_evaluate_matches_direct_forward) {
  api_fixture f;
  NMT_ASSERT(api_init(&f, "eval", 5) == 0);
  nmt_session_options o = quiet();
  nmt_session *s;
  NMT_ASSERT_OK(nmt_session_open(f.ini, NULL, 0, &o, &s));
  NMT_ASSERT_OK(nmt_session_train(s, 0));
  double loss, nll;
  NMT_ASSERT_OK(nmt_session_evaluate(s, &loss, &nll));
  const float *p;
  size_t n;
  NMT_ASSERT_OK(nmt_session_params(s, &p, &n));

  nmt_config cfg;
  NMT_ASSERT_OK(nmt_config_load(f.ini, NULL, 0, &cfg));
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(&cfg, &mc);
  nmt_shard *sh;
  nmt_batcher *bt;
  nmt_model *m;
  NMT_ASSERT_OK(nmt_shard_open(f.valid, NMT_TH_VOCAB, &sh));
  NMT_ASSERT_OK(nmt_batcher_create(sh, cfg.data_max_tokens, cfg.data_max_len, cfg.run_seed, &bt));
  NMT_ASSERT_OK(nmt_model_create(&mc, &nmt_backend_ref, NULL, cfg.data_max_tokens,
                                 cfg.data_max_len, &m));
  int32_t *buf = malloc((5 * (size_t)cfg.data_max_tokens + 16) * sizeof(int32_t));
  float slots[NMT_GRAD_EXTRA];
  double sum_loss = 0, sum_nll = 0, tok = 0;
  for (long i = 0; i < nmt_batcher_num_batches(bt); i++) {
    int ns, sl, tl;
    long tt;
    nmt_batch b;
    nmt_batcher_shape(bt, i, &ns, &sl, &tl, &tt);
    nmt_batch_layout(&b, buf, ns, sl, tl);
    nmt_batcher_fill(bt, i, &b);
    memset(slots, 0, sizeof slots);
    NMT_ASSERT_OK(nmt_model_forward(m, p, &b, 0, cfg.run_seed, 0, slots));
    sum_loss += slots[NMT_GRAD_SLOT_LOSS], sum_nll += slots[NMT_GRAD_SLOT_NLL];
    tok += slots[NMT_GRAD_SLOT_TOKENS];
  }
  free(buf);
  nmt_model_destroy(m);
  nmt_batcher_destroy(bt);
  nmt_shard_close(sh);
  nmt_session_close(s);
  printf("# evaluate: loss %.6f nll %.6f; direct: loss %.6f nll %.6f over %.0f tokens\n", loss,
         nll, sum_loss / tok, sum_nll / tok, tok);
  NMT_ASSERT(tok > 50);
  NMT_ASSERT_NEAR(loss, sum_loss / tok, 1e-5 * loss);
  NMT_ASSERT_NEAR(nll, sum_nll / tok, 1e-5 * nll);
}

/* save at step 6, close, reopen with resume, finish: equals the straight run bitwise. */
NMT_TEST(api_save_resume_equals_straight) {
  enum { M = 14 };
  api_fixture a, b;
  NMT_ASSERT(api_init(&a, "ref", M) == 0);
  NMT_ASSERT(api_init(&b, "saved", M) == 0);
  size_t n1, n2;
  float *p1 = straight(&a, &n1);
  NMT_ASSERT(p1 != NULL);
  nmt_session_options o = quiet();
  nmt_session *s;
  NMT_ASSERT_OK(nmt_session_open(b.ini, NULL, 0, &o, &s));
  NMT_ASSERT_OK(nmt_session_train(s, 6));
  char path[1024], want[1200], tiny[8];
  NMT_ASSERT_EQ_STATUS(nmt_session_save(s, tiny, sizeof tiny), NMT_ERR_USAGE);
  NMT_ASSERT_OK(nmt_session_save(s, path, sizeof path));
  snprintf(want, sizeof want, "%s/checkpoints/step_6.ckpt", b.run);
  NMT_ASSERT(!strcmp(path, want));
  nmt_session_close(s);
  o.resume = 1;
  NMT_ASSERT_OK(nmt_session_open(b.ini, NULL, 0, &o, &s));
  long step;
  NMT_ASSERT_OK(nmt_session_progress(s, &step, NULL));
  NMT_ASSERT_EQ_INT(step, 6);
  NMT_ASSERT_OK(nmt_session_train(s, 0));
  const float *p2;
  NMT_ASSERT_OK(nmt_session_params(s, &p2, &n2));
  long d = count_diff(p1, p2, n1);
  nmt_session_close(s);
  free(p1);
  if (d) nmt_test_fail(__FILE__, __LINE__, "%ld of %zu parameters differ after save+resume", d, n1);
}

static void count_records(void *user, const nmt_metrics *m) {
  (void)m;
  ++*(long *)user;
}

/* A stop request ends the call with NMT_STOPPED and a checkpoint; the next call trains on, and
 * the result equals the straight run. The request is made between two calls (after step 4),
 * not from the metrics callback: the callback runs on the main thread while the workers train
 * on, so whether a tiny model had already finished every step when it ran was a race. */
NMT_TEST(api_stop_then_continue) {
  enum { M = 12 };
  api_fixture a, b;
  NMT_ASSERT(api_init(&a, "ref", M) == 0);
  NMT_ASSERT(api_init(&b, "stop", M) == 0);
  size_t n1, n2;
  float *p1 = straight(&a, &n1);
  NMT_ASSERT(p1 != NULL);
  nmt_session *s = NULL;
  long records = 0;
  nmt_session_options o = quiet();
  o.on_metrics = count_records;
  o.user = &records;
  NMT_ASSERT_OK(nmt_session_open(b.ini, NULL, 0, &o, &s));
  NMT_ASSERT_OK(nmt_session_train(s, 4));
  NMT_ASSERT_OK(nmt_session_request_stop(s));
  NMT_ASSERT_EQ_STATUS(nmt_session_train(s, 0), NMT_STOPPED);
  long step;
  nmt_session_progress(s, &step, NULL);
  NMT_ASSERT(step > 4 && step < M);
  char ck[1200];
  snprintf(ck, sizeof ck, "%s/checkpoints/step_%ld.ckpt", b.run, step);
  NMT_ASSERT(access(ck, R_OK) == 0);
  NMT_ASSERT_OK(nmt_session_train(s, 0));
  const float *p2;
  NMT_ASSERT_OK(nmt_session_params(s, &p2, &n2));
  long d = count_diff(p1, p2, n1);
  nmt_session_close(s);
  free(p1);
  NMT_ASSERT(records >= M);
  if (d) nmt_test_fail(__FILE__, __LINE__, "%ld of %zu parameters differ after stop", d, n1);
}

/* Every call reports misuse and failure with a status and a message naming the problem. */
NMT_TEST(api_errors_are_statuses) {
  api_fixture f;
  NMT_ASSERT(api_init(&f, "err", 10) == 0);
  nmt_session *s;
  nmt_session_options o = quiet();
  NMT_ASSERT_EQ_STATUS(nmt_session_open(f.ini, NULL, 0, &o, NULL), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(nmt_session_options_default(NULL), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(nmt_session_train(NULL, 1), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(nmt_session_request_stop(NULL), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(nmt_session_close(NULL), NMT_OK);
  nmt_session_options bad = o;
  bad.size = 4;
  NMT_ASSERT_EQ_STATUS(nmt_session_open(f.ini, NULL, 0, &bad, &s), NMT_ERR_USAGE);
  const char *ov[] = {"train.max_steps=12x"};
  NMT_ASSERT_EQ_STATUS(nmt_session_open(f.ini, ov, 1, &o, &s), NMT_ERR_CONFIG);
  NMT_ASSERT(strstr(nmt_last_error(), "max_steps") && strstr(nmt_last_error(), "12x"));
  NMT_ASSERT(s == NULL);

  /* evaluate without a validation shard */
  const char *nov[] = {"data.valid="};
  NMT_ASSERT_OK(nmt_session_open(f.ini, nov, 1, &o, &s));
  NMT_ASSERT_EQ_STATUS(nmt_session_evaluate(s, NULL, NULL), NMT_ERR_CONFIG);
  NMT_ASSERT(strstr(nmt_last_error(), "valid") != NULL);
  nmt_session_close(s);

  /* a persistent NaN gradient: diverged (exit code 5), and it stays the session's answer */
  o.inject_nan_step = 2;
  NMT_ASSERT_OK(nmt_session_open(f.ini, NULL, 0, &o, &s));
  NMT_ASSERT_EQ_STATUS(nmt_session_train(s, 0), NMT_ERR_DIVERGED);
  NMT_ASSERT(strstr(nmt_last_error(), "step 3: gradient norm is nan") != NULL);
  NMT_ASSERT_EQ_INT(nmt_status_exit_code(NMT_ERR_DIVERGED), 5);
  long step;
  nmt_session_progress(s, &step, NULL);
  NMT_ASSERT_EQ_INT(step, 2);
  NMT_ASSERT_EQ_STATUS(nmt_session_train(s, 0), NMT_ERR_DIVERGED);
  NMT_ASSERT_EQ_STATUS(nmt_session_save(s, NULL, 0), NMT_ERR_DIVERGED);
  nmt_session_close(s);
  NMT_ASSERT(!strcmp(nmt_status_str(NMT_ERR_DIVERGED), "NMT_ERR_DIVERGED"));
}

typedef struct {
  int lines, training_line;
} log_count;

static void count_log(void *user, nmt_log_level level, const char *line) {
  log_count *c = user;
  c->lines++;
  if (level == NMT_LOG_INFO && strstr(line, "training")) c->training_line = 1;
}

/* The log callback receives the library's lines while the session is open, and only then. */
NMT_TEST(api_log_callback) {
  api_fixture f;
  NMT_ASSERT(api_init(&f, "log", 3) == 0);
  nmt_log_level saved = nmt_log_get_level();
  nmt_log_set_level(NMT_LOG_INFO); /* the runner silences the log */
  log_count c = {0, 0};
  nmt_session_options o = quiet();
  o.on_log = count_log;
  o.user = &c;
  nmt_session *s;
  nmt_status st = nmt_session_open(f.ini, NULL, 0, &o, &s);
  if (st == NMT_OK) st = nmt_session_train(s, 0);
  if (st == NMT_OK) nmt_session_close(s);
  int during = c.lines;
  /* After close the line goes to stderr (muted here), not to the callback. */
  fflush(stderr);
  int err_fd = dup(2), null_fd = open("/dev/null", O_WRONLY);
  if (null_fd >= 0) dup2(null_fd, 2);
  nmt_log(NMT_LOG_INFO, "after close");
  fflush(stderr);
  if (err_fd >= 0) dup2(err_fd, 2), close(err_fd);
  if (null_fd >= 0) close(null_fd);
  nmt_log_set_level(saved);
  NMT_ASSERT_OK(st);
  NMT_ASSERT(during > 0 && c.training_line);
  NMT_ASSERT_EQ_INT(c.lines, during);
}

/* {job} in run.out_dir: $SLURM_JOB_ID, "local" outside Slurm, and never a path separator. */
NMT_TEST(api_slurm_job_in_out_dir) {
  nmt_config c;
  char ov[256];
  snprintf(ov, sizeof ov, "run.out_dir=%s/run-{job}/x{job}", nmt_test_tmpdir());
  const char *ovs[] = {ov};
  char want[700];
  const char *saved = getenv("SLURM_JOB_ID");
  char saved_copy[128] = "";
  if (saved) snprintf(saved_copy, sizeof saved_copy, "%s", saved);
  setenv("SLURM_JOB_ID", "4242", 1);
  nmt_status s1 = nmt_config_load(NULL, ovs, 1, &c);
  snprintf(want, sizeof want, "%s/run-4242/x4242", nmt_test_tmpdir());
  int ok1 = s1 == NMT_OK && !strcmp(c.run_out_dir, want);
  setenv("SLURM_JOB_ID", "../../x", 1);
  nmt_status s2 = nmt_config_load(NULL, ovs, 1, &c);
  unsetenv("SLURM_JOB_ID");
  nmt_status s3 = nmt_config_load(NULL, ovs, 1, &c);
  char want3[700];
  snprintf(want3, sizeof want3, "%s/run-local/xlocal", nmt_test_tmpdir());
  int ok3 = s3 == NMT_OK && !strcmp(c.run_out_dir, want3);
  if (saved) setenv("SLURM_JOB_ID", saved_copy, 1);
  NMT_ASSERT(ok1);
  NMT_ASSERT_EQ_STATUS(s2, NMT_ERR_CONFIG);
  NMT_ASSERT(ok3);
}

/* nmt_session_open_files: a later file's keys win, the overrides beat both files, an error
 * names the file that holds the value, and misuse is a usage error. */
NMT_TEST(api_open_files_layers_configs) {
  api_fixture f;
  NMT_ASSERT(api_init(&f, "files", 10) == 0);
  char more[700], bad[700];
  snprintf(more, sizeof more, "%s/more.ini", f.dir);
  snprintf(bad, sizeof bad, "%s/bad.ini", f.dir);
  NMT_ASSERT(nmt_th_write_file(more, "[train]\nmax_steps = 4\n") == 0);
  NMT_ASSERT(nmt_th_write_file(bad, "[model]\nd_model = 12x\n") == 0);
  nmt_session_options o = quiet();
  o.overwrite = 1;
  nmt_session *s;
  const char *two[] = {f.ini, more}, *with_bad[] = {f.ini, bad, more};
  long step, max;
  NMT_ASSERT_OK(nmt_session_open_files(two, 2, NULL, 0, &o, &s));
  nmt_status st = nmt_session_train(s, 0);
  nmt_session_progress(s, &step, &max);
  nmt_session_close(s);
  NMT_ASSERT_OK(st);
  NMT_ASSERT_EQ_INT(max, 4);
  NMT_ASSERT_EQ_INT(step, 4);
  const char *ov[] = {"train.max_steps=3"};
  NMT_ASSERT_OK(nmt_session_open_files(two, 2, ov, 1, &o, &s));
  nmt_session_progress(s, NULL, &max);
  nmt_session_close(s);
  NMT_ASSERT_EQ_INT(max, 3);
  NMT_ASSERT_EQ_STATUS(nmt_session_open_files(with_bad, 3, NULL, 0, &o, &s), NMT_ERR_CONFIG);
  NMT_ASSERT(s == NULL);
  NMT_ASSERT(!strncmp(nmt_last_error(), bad, strlen(bad)));
  NMT_ASSERT(strstr(nmt_last_error(), "d_model = \"12x\"") != NULL);
  NMT_ASSERT_EQ_STATUS(nmt_session_open_files(NULL, 1, NULL, 0, &o, &s), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(nmt_session_open_files(two, -1, NULL, 0, &o, &s), NMT_ERR_USAGE);
}

/* tools/embed_example, linked against libnmt.so, trains to the end through the public API,
 * from two config files (the second sets train.max_steps). */
NMT_TEST(api_embed_example_runs) {
  api_fixture f;
  NMT_ASSERT(api_init(&f, "embed", 10) == 0);
  char exe[600], cmd[3200], log[700], steps[700];
  snprintf(steps, sizeof steps, "%s/steps.ini", f.dir);
  NMT_ASSERT(nmt_th_write_file(steps, "[train]\nmax_steps = 20\n") == 0);
  snprintf(exe, sizeof exe, "%s/embed_example", nmt_test_build_dir());
  if (access(exe, X_OK) != 0) {
    nmt_test_fail(__FILE__, __LINE__, "%s missing: `make test` builds it", exe);
    return;
  }
  snprintf(log, sizeof log, "%s/embed.out", f.dir);
  snprintf(cmd, sizeof cmd, "%s %s %s train.save_every=0 > %s 2>&1", exe, f.ini, steps, log);
  int rc = system(cmd);
  char *out = nmt_th_read_file(log, NULL);
  NMT_ASSERT(out != NULL);
  if (rc != 0) printf("%s", out);
  NMT_ASSERT(rc == 0);
  char ck[1200];
  snprintf(ck, sizeof ck, "saved %s/checkpoints/step_20.ckpt", f.run);
  int ok = strstr(out, "step 10/20 train_loss") && strstr(out, "step 20/20 train_loss") &&
           strstr(out, ck) && strstr(out, "[host] nmt/") && !strstr(out, "metrics records 0");
  free(out);
  NMT_ASSERT(ok);
}

typedef struct {
  char line[4][256];
  int n;
} line_grab;

static void grab_loader_lines(void *user, nmt_log_level level, const char *line) {
  line_grab *g = user;
  (void)level;
  if (g->n < 4 && (strstr(line, "loader thread") || strstr(line, "SLURM_CPUS_PER_TASK")))
    snprintf(g->line[g->n++], sizeof g->line[0], "%s", line);
}

/* Runs `ini` with the overrides to the end; params copied out; log lines about loaders kept. */
static float *run_grab(const char *ini, const char *const *ov, int n_ov, line_grab *g, size_t *n) {
  nmt_log_level saved = nmt_log_get_level();
  nmt_log_set_level(NMT_LOG_INFO);
  nmt_session_options o = quiet();
  o.overwrite = 1; /* each call trains the same run.out_dir afresh */
  o.on_log = grab_loader_lines;
  o.user = g;
  nmt_session *s;
  float *copy = NULL;
  const float *p;
  if (nmt_session_open(ini, ov, n_ov, &o, &s) == NMT_OK) {
    if (nmt_session_train(s, 0) == NMT_OK && nmt_session_params(s, &p, n) == NMT_OK) {
      copy = malloc(*n * sizeof(float));
      memcpy(copy, p, *n * sizeof(float));
    }
    nmt_session_close(s);
  }
  nmt_log_set_level(saved);
  return copy;
}

/* Three loader threads (one per worker) deal the same batches as one: bitwise-equal training;
 * SLURM_CPUS_PER_TASK bounds their number. */
NMT_TEST(api_loader_threads_and_slurm_cpus) {
  api_fixture f;
  NMT_ASSERT(api_init(&f, "loaders", 8) == 0);
  const char *one[] = {"parallel.devices=3", "data.loader_threads=1"};
  const char *three[] = {"parallel.devices=3", "data.loader_threads=3"};
  line_grab g1 = {.n = 0}, g3 = {.n = 0}, gs = {.n = 0};
  size_t n1 = 0, n3 = 0, ns = 0;
  float *p1 = run_grab(f.ini, one, 2, &g1, &n1);
  float *p3 = run_grab(f.ini, three, 2, &g3, &n3);
  const char *saved = getenv("SLURM_CPUS_PER_TASK");
  char saved_copy[64] = "";
  if (saved) snprintf(saved_copy, sizeof saved_copy, "%s", saved);
  setenv("SLURM_CPUS_PER_TASK", "2", 1);
  float *ps = run_grab(f.ini, three, 2, &gs, &ns);
  if (saved) setenv("SLURM_CPUS_PER_TASK", saved_copy, 1);
  else unsetenv("SLURM_CPUS_PER_TASK");
  int ok = p1 && p3 && ps && n1 == n3 && n1 == ns;
  long d3 = ok ? count_diff(p1, p3, n1) : -1, ds = ok ? count_diff(p1, ps, n1) : -1;
  free(p1), free(p3), free(ps);
  NMT_ASSERT(ok);
  NMT_ASSERT_EQ_INT(d3, 0);
  NMT_ASSERT_EQ_INT(ds, 0);
  NMT_ASSERT(g1.n >= 1 && strstr(g1.line[g1.n - 1], " 1 loader thread(s)"));
  NMT_ASSERT(g3.n >= 1 && strstr(g3.line[g3.n - 1], " 3 loader thread(s)"));
  NMT_ASSERT(gs.n >= 2 && strstr(gs.line[0], "SLURM_CPUS_PER_TASK = 2") &&
             strstr(gs.line[gs.n - 1], " 2 loader thread(s)"));
}
