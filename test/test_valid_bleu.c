/* test_valid_bleu.c — issue 19's validation features: validation BLEU during training
 * (train.valid_bleu), the best validation and checkpoints/best (train.best_metric), and early
 * stopping (train.patience).
 *
 * The engine tests train the tiny synthetic model (test/helpers.h) on CPU workers. A plateau
 * is made by training with train.lr_scale = 1e-30: an update of ~1e-31 leaves every weight and
 * so every validation exactly as it was, so no validation after the first improves. The BLEU
 * test runs the real binary on the Bible corpus (raw text and SentencePiece model needed) and
 * skips when `python3 -m sacrebleu` cannot run. */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/trainer.h"
#include "test.h"
#include "../src/engine/run.h" /* the trainer's decoder rig and abort flag */

/* ------------------------------------------------------------------------------------------ */
/* helpers                                                                                    */

typedef struct {
  char dir[512], train[600], valid[600], run[600], ckpts[640];
} fixture;

static int fixture_init(fixture *f) {
  snprintf(f->dir, sizeof f->dir, "%s", nmt_test_tmpdir());
  snprintf(f->train, sizeof f->train, "%s/train.shard", f->dir);
  snprintf(f->valid, sizeof f->valid, "%s/valid.shard", f->dir);
  snprintf(f->run, sizeof f->run, "%s/run", f->dir);
  snprintf(f->ckpts, sizeof f->ckpts, "%s/checkpoints", f->run);
  return nmt_th_write_synthetic(f->train, 96, 6) == NMT_OK &&
         nmt_th_write_synthetic(f->valid, 24, 99) == NMT_OK;
}

/* The tiny setup on two CPU workers with a validation every 2 steps. */
static void config(const fixture *f, nmt_config *c, long max_steps) {
  nmt_th_tiny_config(c, f->run, f->train);
  snprintf(c->data_valid, sizeof c->data_valid, "%s", f->valid);
  c->parallel_devices = 2;
  c->train_max_steps = max_steps;
  c->train_valid_every = 2;
  c->train_lr_scale = 1.0f;
}

typedef struct {
  long n;
  double train_loss[64];
  long step[64];
} loss_log;

static void on_metrics(void *user, const nmt_metrics *m) {
  loss_log *l = user;
  if (l->n < 64) l->step[l->n] = m->step, l->train_loss[l->n++] = m->train_loss;
}

/* Trains cfg from scratch (or resumed) to its end; *steps: the step reached. */
static nmt_status train(const nmt_config *c, loss_log *log, long *steps, long *end_step) {
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  o.on_metrics = log ? on_metrics : NULL;
  o.user = log;
  nmt_trainer *t;
  NMT_TRY(nmt_trainer_create(c, &o, &t));
  nmt_status s = nmt_trainer_run(t);
  if (steps) *steps = nmt_trainer_step(t);
  if (end_step) *end_step = nmt_trainer_end_step(t);
  nmt_trainer_destroy(t);
  return s;
}

/* The step_*.ckpt files of dir as a sorted, comma-separated list of steps ("2,8"). */
static void step_files(const char *dir, char *out, size_t cap) {
  long steps[256];
  int n = 0;
  DIR *d = opendir(dir);
  struct dirent *e;
  while (d && (e = readdir(d)) && n < 256) {
    long s;
    char tail[16];
    if (sscanf(e->d_name, "step_%ld%15s", &s, tail) == 2 && !strcmp(tail, ".ckpt")) steps[n++] = s;
  }
  if (d) closedir(d);
  for (int i = 1; i < n; i++)
    for (int j = i; j > 0 && steps[j - 1] > steps[j]; j--) {
      long x = steps[j];
      steps[j] = steps[j - 1], steps[j - 1] = x;
    }
  out[0] = 0;
  for (int i = 0; i < n; i++)
    snprintf(out + strlen(out), cap - strlen(out), "%s%ld", i ? "," : "", steps[i]);
}

/* The file name dir/best holds ("" if none). */
static void best_name(const char *dir, char *out, size_t cap) {
  char p[800];
  snprintf(p, sizeof p, "%s/best", dir);
  char *b = nmt_th_read_file(p, NULL);
  snprintf(out, cap, "%s", b ? b : "");
  free(b);
  out[strcspn(out, "\n")] = 0;
}

#define ASSERT_STR(a, b)                                                                  \
  do {                                                                                    \
    if (strcmp((a), (b))) {                                                               \
      nmt_test_fail(__FILE__, __LINE__, "%s == %s: \"%s\" != \"%s\"", #a, #b, (a), (b)); \
      return;                                                                             \
    }                                                                                     \
  } while (0)

/* ------------------------------------------------------------------------------------------ */
/* the checkpoint directory: best marker, keep, the best record                               */

static nmt_status save(const char *dir, long step, long best_step, long bad, int keep) {
  enum { N = 50 };
  float p[N];
  for (int i = 0; i < N; i++) p[i] = (float)(i + step);
  nmt_ckpt_header h = {0};
  h.vocab = 40, h.d_model = 16, h.n_heads = 2, h.d_ff = 32, h.enc_layers = 1;
  h.dec_layers = 1, h.n_params = N, h.has_moments = 1, h.step = step;
  h.best_metric = NMT_METRIC_VALID_BLEU;
  h.best_step = best_step, h.best_value = 12.25 + (double)best_step, h.best_bad = bad;
  return nmt_ckpt_save_step(dir, &h, p, p, p, keep, NULL);
}

/* keep = 1 keeps the newest and the one `best` names, whatever its age; the best record
 * round-trips; nmt_ckpt_find_best finds it and says so when there is none. */
NMT_TEST(valid_ckpt_best_marker_survives_keep) {
  char dir[600], files[256], name[64], path[1100], want[700];
  snprintf(dir, sizeof dir, "%s/ck", nmt_test_tmpdir());
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_find_best(dir, path), NMT_ERR_CHECKPOINT);
  NMT_ASSERT(strstr(nmt_last_error(), "has no best checkpoint") != NULL);
  NMT_ASSERT_OK(save(dir, 1, 1, 0, 1));
  NMT_ASSERT_OK(save(dir, 2, 2, 0, 1));
  for (long s = 3; s <= 6; s++) NMT_ASSERT_OK(save(dir, s, 2, s - 2, 1));
  step_files(dir, files, sizeof files);
  ASSERT_STR(files, "2,6");
  best_name(dir, name, sizeof name);
  ASSERT_STR(name, "step_2.ckpt");
  NMT_ASSERT_OK(nmt_ckpt_find_best(dir, path));
  snprintf(want, sizeof want, "%s/step_2.ckpt", dir);
  ASSERT_STR(path, want);
  /* The record: every field back, from nmt_ckpt_read (resume) and nmt_ckpt_read_meta. */
  nmt_ckpt_header h;
  snprintf(path, sizeof path, "%s/step_6.ckpt", dir);
  NMT_ASSERT_OK(nmt_ckpt_read(path, NULL, &h, NULL, NULL, NULL));
  NMT_ASSERT_EQ_INT(h.best_metric, NMT_METRIC_VALID_BLEU);
  NMT_ASSERT_EQ_INT(h.best_step, 2);
  NMT_ASSERT(h.best_value == 14.25);
  NMT_ASSERT_EQ_INT(h.best_bad, 4);
  nmt_ckpt_meta m;
  memset(&h, 0, sizeof h);
  NMT_ASSERT_OK(nmt_ckpt_read_meta(path, &h, &m));
  nmt_ckpt_meta_free(&m);
  NMT_ASSERT_EQ_INT(h.best_step, 2);
  NMT_ASSERT_EQ_INT(h.best_bad, 4);
  /* A newer best moves the marker; the old best is then an ordinary old checkpoint. */
  NMT_ASSERT_OK(save(dir, 7, 7, 0, 1));
  step_files(dir, files, sizeof files);
  ASSERT_STR(files, "7");
  best_name(dir, name, sizeof name);
  ASSERT_STR(name, "step_7.ckpt");
  /* keep = 3: the best counts among the 3 newest when it is one of them, else comes on top. */
  const char *want_files[] = {"7,8", "7,8,9", "7,8,9,10", "7,9,10,11"};
  for (long s = 8; s <= 11; s++) {
    NMT_ASSERT_OK(save(dir, s, 7, s - 7, 3));
    step_files(dir, files, sizeof files);
    ASSERT_STR(files, want_files[s - 8]);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* the engine                                                                                 */

/* Keys that cannot work together are config errors naming them, before anything runs. */
NMT_TEST(valid_config_errors) {
  fixture f;
  NMT_ASSERT(fixture_init(&f));
  nmt_config c;
  config(&f, &c, 4);
  c.train_best_metric = NMT_METRIC_VALID_BLEU;
  NMT_ASSERT_EQ_STATUS(train(&c, NULL, NULL, NULL), NMT_ERR_CONFIG);
  NMT_ASSERT(strstr(nmt_last_error(), "[train] best_metric = valid_bleu needs [train] valid_bleu"));
  config(&f, &c, 4);
  c.train_patience = 3;
  c.train_valid_every = 0;
  NMT_ASSERT_EQ_STATUS(train(&c, NULL, NULL, NULL), NMT_ERR_CONFIG);
  NMT_ASSERT(strstr(nmt_last_error(), "[train] patience = 3 needs validations"));
  config(&f, &c, 4);
  c.train_valid_bleu = 1;
  NMT_ASSERT_EQ_STATUS(train(&c, NULL, NULL, NULL), NMT_ERR_CONFIG);
  NMT_ASSERT(strstr(nmt_last_error(), "[train] valid_bleu = on needs [data] spm_model"));
  /* A synthetic shard has no raw text next to it: the message names what was looked for. */
  snprintf(c.data_spm_model, sizeof c.data_spm_model, "data/bible/spm.model");
  NMT_ASSERT_EQ_STATUS(train(&c, NULL, NULL, NULL), NMT_ERR_DATA);
  NMT_ASSERT(strstr(nmt_last_error(), "valid_bleu = on needs the raw text of [data] valid"));
  NMT_ASSERT(strstr(nmt_last_error(), "spm.settings") && !strstr(nmt_last_error(), "--src"));
}

/* A plateau from the start on two workers: the first validation is the best, patience 3
 * validations later every rank stops at the same step (a rank that went on would hang its
 * peer in the next step's all-reduce), with exit status OK, a final checkpoint, `best`
 * kept through keep = 1, and status.json saying why. Metric: valid_ppl. With ZeRO too, where
 * every rank takes part in each checkpoint (its barrier needs them all to agree). */
static void plateau(int zero) {
  fixture f;
  NMT_ASSERT(fixture_init(&f));
  nmt_config c;
  config(&f, &c, 40);
  c.parallel_zero = zero;
  c.train_lr_scale = 1e-30f;
  c.train_patience = 3;
  c.train_best_metric = NMT_METRIC_VALID_PPL;
  c.train_save_every = 1;
  c.checkpoint_keep = 1;
  loss_log log = {0};
  long steps, end;
  NMT_ASSERT_OK(train(&c, &log, &steps, &end));
  NMT_ASSERT_EQ_INT(steps, 8); /* validations at 2 (best), 4, 6, 8 */
  NMT_ASSERT_EQ_INT(end, 8);
  char files[256], name[64], path[1100];
  step_files(f.ckpts, files, sizeof files);
  ASSERT_STR(files, "2,8");
  best_name(f.ckpts, name, sizeof name);
  ASSERT_STR(name, "step_2.ckpt");
  nmt_ckpt_header h;
  snprintf(path, sizeof path, "%s/step_8.ckpt", f.ckpts);
  NMT_ASSERT_OK(nmt_ckpt_read(path, NULL, &h, NULL, NULL, NULL));
  NMT_ASSERT_EQ_INT(h.best_metric, NMT_METRIC_VALID_PPL);
  NMT_ASSERT_EQ_INT(h.best_step, 2);
  NMT_ASSERT_EQ_INT(h.best_bad, 3);
  NMT_ASSERT(h.best_value > 1 && isfinite(h.best_value));
  snprintf(path, sizeof path, "%s/status.json", f.run);
  char *st = nmt_th_read_file(path, NULL);
  char state[32] = "", metric[32] = "", reason[512] = "";
  int ok = st && nmt_th_json_str(st, "state", state, sizeof state) &&
           nmt_th_json_str(st, "best_metric", metric, sizeof metric) &&
           nmt_th_json_str(st, "reason", reason, sizeof reason) &&
           nmt_th_json_num(st, "best_step") == 2 && nmt_th_json_num(st, "exit_code") == 0 &&
           nmt_th_json_num(st, "best_value") > 1;
  free(st);
  NMT_ASSERT(ok);
  ASSERT_STR(state, "done");
  ASSERT_STR(metric, "valid_ppl");
  NMT_ASSERT(strstr(reason, "early stopping at step 8: valid_ppl did not improve for 3 "
                            "validations (train.patience = 3)"));
}

NMT_TEST(valid_plateau_stops_early_on_every_rank) { plateau(0); }
NMT_TEST(valid_plateau_stops_early_with_zero) { plateau(1); }

/* Improvement, then a plateau across --resume: the patience count and the best survive in the
 * checkpoints, `best` keeps the first run's checkpoint through the second run's keep = 1, and a
 * run that stopped early and is resumed trains nothing. */
NMT_TEST(valid_best_and_patience_survive_resume) {
  fixture f;
  NMT_ASSERT(fixture_init(&f));
  nmt_config c;
  config(&f, &c, 40);
  c.train_max_steps = 6; /* first run: learns; validations at 2, 4 and 6 */
  c.train_patience = 2;
  loss_log log = {0};
  long steps, end;
  NMT_ASSERT_OK(train(&c, &log, &steps, &end));
  NMT_ASSERT_EQ_INT(steps, 6);
  char files[256], name[64], path[1100];
  best_name(f.ckpts, name, sizeof name);
  ASSERT_STR(name, "step_6.ckpt"); /* the loss fell at every validation */
  step_files(f.ckpts, files, sizeof files);
  ASSERT_STR(files, "2,4,6");
  /* Second run: frozen weights from step 6 on; the validations at 8 and 10 equal step 6's. */
  c.train_max_steps = 40;
  c.run_resume = 1;
  c.train_lr_scale = 1e-30f;
  c.train_save_every = 1;
  c.checkpoint_keep = 1;
  NMT_ASSERT_OK(train(&c, NULL, &steps, &end));
  NMT_ASSERT_EQ_INT(steps, 10);
  NMT_ASSERT_EQ_INT(end, 10);
  step_files(f.ckpts, files, sizeof files);
  ASSERT_STR(files, "6,10");
  best_name(f.ckpts, name, sizeof name);
  ASSERT_STR(name, "step_6.ckpt");
  /* Resumed once more: already stopped early, nothing to train, still done. */
  NMT_ASSERT_OK(train(&c, NULL, &steps, &end));
  NMT_ASSERT_EQ_INT(steps, 10);
  NMT_ASSERT_EQ_INT(end, 10);
  step_files(f.ckpts, files, sizeof files);
  ASSERT_STR(files, "6,10");
  snprintf(path, sizeof path, "%s/status.json", f.run);
  char *st = nmt_th_read_file(path, NULL);
  char state[32] = "";
  int ok = st && nmt_th_json_str(st, "state", state, sizeof state) &&
           nmt_th_json_num(st, "best_step") == 6;
  free(st);
  NMT_ASSERT(ok);
  ASSERT_STR(state, "done");
  /* A larger patience on resume trains on from there. */
  c.train_patience = 3;
  c.train_max_steps = 12;
  NMT_ASSERT_OK(train(&c, NULL, &steps, &end));
  NMT_ASSERT_EQ_INT(steps, 12);
  NMT_ASSERT_EQ_INT(end, 12);
}

/* Validation, the best checkpoints and a patience that never runs out change no number of the
 * training: the losses and the final parameters are bitwise those of a run that never
 * validates. */
NMT_TEST(valid_patience_changes_no_loss) {
  fixture f;
  NMT_ASSERT(fixture_init(&f));
  nmt_config c;
  loss_log logs[3] = {{0}};
  float *params[3] = {NULL, NULL, NULL};
  size_t n = 0;
  for (int k = 0; k < 3; k++) {
    config(&f, &c, 10);
    snprintf(c.run_out_dir, sizeof c.run_out_dir, "%s/run%d", f.dir, k);
    c.train_valid_every = k == 0 ? 0 : 2; /* 0: never validates */
    c.train_patience = k == 2 ? 1000 : 0;
    nmt_trainer_options o;
    nmt_trainer_options_default(&o);
    o.quiet = 1, o.on_metrics = on_metrics, o.user = &logs[k];
    nmt_trainer *t;
    NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
    nmt_status s = nmt_trainer_run(t);
    const float *p = nmt_trainer_params(t, &n);
    params[k] = malloc(n * sizeof(float));
    if (params[k]) memcpy(params[k], p, n * sizeof(float));
    nmt_trainer_destroy(t);
    NMT_ASSERT_OK(s);
    NMT_ASSERT(params[k]);
  }
  int same = 1;
  for (int k = 1; k < 3; k++) {
    same = same && logs[k].n == logs[0].n && !memcmp(params[k], params[0], n * sizeof(float));
    for (long i = 0; same && i < logs[0].n; i++)
      same = logs[k].step[i] == logs[0].step[i] &&
             !memcmp(&logs[k].train_loss[i], &logs[0].train_loss[i], sizeof(double));
  }
  for (int k = 0; k < 3; k++) free(params[k]);
  NMT_ASSERT(logs[0].n == 10);
  NMT_ASSERT(same);
}

/* ------------------------------------------------------------------------------------------ */
/* validation BLEU, end to end                                                                */

static int have_sacrebleu(void) {
  fflush(stdout);
  int st = system("python3 -m sacrebleu --version >/dev/null 2>&1");
  return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

/* The real binary on the Bible corpus with a tiny frozen model: every validation decodes the
 * raw valid source and scores it; valid_bleu and valid_chrf are in metrics.jsonl, the log
 * line and status.json; rank 0 logs what each validation's decoding cost (its time, the other
 * rank's wait, the share of the wall time); best by BLEU, patience 2 ends the run at step 6
 * with exit 0. */
NMT_TEST(valid_bleu_in_metrics_status_and_log) {
  if (!have_sacrebleu())
    NMT_SKIP("python3 -m sacrebleu not importable (tools/install-deps.sh --bleu)");
  if (access("data/bible/valid.en", R_OK) || access("data/bible/spm.model", R_OK)) {
    nmt_test_fail(__FILE__, __LINE__, "data/bible missing: run tools/prepare-bible.sh");
    return;
  }
  const char *dir = nmt_test_tmpdir();
  char run[600], log[640], cmd[4096], path[700];
  snprintf(run, sizeof run, "%s/run", dir);
  snprintf(log, sizeof log, "%s/train.log", dir);
  snprintf(cmd, sizeof cmd,
           "%s/nmt train conf/bible-small.ini run.out_dir=%s model.d_model=16 model.n_heads=2 "
           "model.d_ff=32 model.enc_layers=1 model.dec_layers=1 model.max_positions=160 "
           "data.max_tokens=256 data.max_len=64 parallel.devices=2 parallel.device=cpu "
           "train.max_steps=40 train.log_every=1 train.valid_every=2 train.save_every=0 "
           "train.lr_scale=1e-30 train.valid_bleu=on train.best_metric=valid_bleu "
           "train.patience=2 decode.max_extra_len=5 >%s 2>&1",
           nmt_test_build_dir(), run, log);
  fflush(stdout);
  int st = system(cmd);
  char *text = nmt_th_read_file(log, NULL);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    nmt_test_fail(__FILE__, __LINE__, "exit %d; log:\n%s", WEXITSTATUS(st), text ? text : "");
    free(text);
    return;
  }
  int log_ok = text && strstr(text, "step 2 | valid loss") && strstr(text, "| valid BLEU ") &&
               strstr(text, "| chrF2 ") && strstr(text, "new best valid_bleu") &&
               strstr(text, "early stopping at step 6: valid_bleu did not improve for 2 "
                            "validations (train.patience = 2)") &&
               /* what the validation cost: rank 0's decoding, rank 1's wait, the share */
               strstr(text, "step 2 | validation BLEU: rank 0 decoded ") &&
               strstr(text, "the other 1 rank(s) waited up to ") && strstr(text, " s wall (");
  free(text);
  NMT_ASSERT(log_ok);
  snprintf(path, sizeof path, "%s/metrics.jsonl", run);
  char *m = nmt_th_read_file(path, NULL);
  NMT_ASSERT(m);
  int rows = 0, bleu_rows = 0;
  for (char *line = m; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
    char row[2048];
    snprintf(row, sizeof row, "%.*s", (int)strcspn(line, "\n"), line);
    rows++;
    const double b = nmt_th_json_num(row, "valid_bleu"), ch = nmt_th_json_num(row, "valid_chrf");
    const double step = nmt_th_json_num(row, "step");
    if (!isnan(b)) {
      bleu_rows++;
      if (!(b >= 0 && b <= 100 && ch > 0 && ch <= 100 && (long)step % 2 == 0)) {
        nmt_test_fail(__FILE__, __LINE__, "metrics row: %s", row);
        free(m);
        return;
      }
    }
  }
  free(m);
  NMT_ASSERT_EQ_INT(rows, 6);
  NMT_ASSERT_EQ_INT(bleu_rows, 3);
  snprintf(path, sizeof path, "%s/status.json", run);
  char *s = nmt_th_read_file(path, NULL);
  char state[32] = "", metric[32] = "";
  int ok = s && nmt_th_json_str(s, "state", state, sizeof state) &&
           nmt_th_json_str(s, "best_metric", metric, sizeof metric) &&
           nmt_th_json_num(s, "best_step") == 2 && nmt_th_json_num(s, "step") == 6 &&
           nmt_th_json_num(s, "valid_bleu") >= 0;
  free(s);
  NMT_ASSERT(ok);
  ASSERT_STR(state, "done");
  ASSERT_STR(metric, "valid_bleu");
  char ck[700], name[64];
  snprintf(ck, sizeof ck, "%s/checkpoints", run);
  best_name(ck, name, sizeof name);
  ASSERT_STR(name, "step_2.ckpt");
}

/* Counts the metrics records that carry a validation BLEU. */
static void count_bleu(void *user, const nmt_metrics *m) {
  if (m->has_bleu) ++*(long *)user;
}

/* Validation BLEU decodes on one decoder rig per run: opened at create (before any collective
 * could be in flight), sized there for the longest valid source, and reused by every
 * validation, so no validation opens a device context or allocates device memory while the
 * other ranks wait in the all-reduce (on GPUs, cudaMalloc/cudaFree there can hang NCCL). Its
 * context carries the run's abort flag: once raised, rank 0's decoding returns
 * NMT_ERR_ABORTED instead of decoding the whole valid source. In process, on the Bible corpus
 * with a tiny frozen model on one CPU worker (no peer to all-reduce with, so what returns
 * ABORTED is the decoding itself). */
NMT_TEST(valid_bleu_decoder_opened_once_with_abort) {
  if (!have_sacrebleu())
    NMT_SKIP("python3 -m sacrebleu not importable (tools/install-deps.sh --bleu)");
  if (access("data/bible/valid.en", R_OK) || access("data/bible/spm.model", R_OK)) {
    nmt_test_fail(__FILE__, __LINE__, "data/bible missing: run tools/prepare-bible.sh");
    return;
  }
  char run[600];
  snprintf(run, sizeof run, "%s/run", nmt_test_tmpdir());
  nmt_config c;
  nmt_th_tiny_config(&c, run, "data/bible/train.shard");
  snprintf(c.data_valid, sizeof c.data_valid, "data/bible/valid.shard");
  snprintf(c.data_spm_model, sizeof c.data_spm_model, "data/bible/spm.model");
  c.model_vocab = 8000;
  c.model_enc_layers = c.model_dec_layers = 1;
  c.model_max_positions = 160;
  c.data_max_tokens = 256;
  c.data_max_len = 64;
  c.train_max_steps = 6;
  c.train_valid_every = 2;
  c.train_lr_scale = 1e-30f;
  c.train_valid_bleu = 1;
  c.decode_max_extra_len = 5;
  long bleu_records = 0;
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  o.on_metrics = count_bleu;
  o.user = &bleu_records;
  nmt_trainer *t;
  NMT_ASSERT_OK(nmt_trainer_create(&c, &o, &t));
  const int abort_reaches_rig = t->vbleu.rig.abort == &t->sync.abort;
  /* The rig's context counts its GEMMs: the reservation at create decoded a batch there, and
   * every validation decodes there again (not on a context of its own). */
  const nmt__rig *rig = &t->vbleu.rig;
  nmt_backend_counters at_create = {0}, after_run = {0};
  NMT_ASSERT(rig->dev.ctx != NULL);
  NMT_ASSERT_OK(rig->dev.be->counters(rig->dev.ctx, &at_create));
  nmt_status s = nmt_trainer_run(t);
  NMT_ASSERT_OK(rig->dev.be->counters(rig->dev.ctx, &after_run));
  nmt_status sa = NMT_ERR_INTERNAL;
  if (s == NMT_OK) {
    nmt__valid_result v = {.has_bleu = 0};
    atomic_store(&t->sync.abort, 1);
    sa = nmt__valid_bleu(&t->workers[0].rep, &t->vbleu, 6, t->pos.t_start, &v);
    atomic_store(&t->sync.abort, 0);
  }
  nmt_trainer_destroy(t);
  printf("# %ld validations with BLEU; GEMMs on the decoder's context: %llu at create, %llu "
         "after the run; abort flag %s its context; a validation with the flag raised: %s\n",
         bleu_records, (unsigned long long)at_create.gemm_calls,
         (unsigned long long)after_run.gemm_calls,
         abort_reaches_rig ? "reaches" : "does not reach", nmt_status_str(sa));
  NMT_ASSERT_OK(s);
  NMT_ASSERT_EQ_INT(bleu_records, 3);
  NMT_ASSERT(at_create.gemm_calls > 0);
  NMT_ASSERT(after_run.gemm_calls > at_create.gemm_calls);
  NMT_ASSERT(abort_reaches_rig);
  NMT_ASSERT_EQ_STATUS(sa, NMT_ERR_ABORTED);
}
