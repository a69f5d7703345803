/* test_resume_data.c — --resume after the data order changed (data.max_tokens, the shard,
 * the device count, a checkpoint without the `data` record), and the epoch count in
 * metrics.jsonl, on the tiny synthetic setup of test/helpers.h.
 *
 * A checkpoint's data position (data_epoch, data_index) names a batch of one epoch order only;
 * the tests read it from the checkpoints the runs write (nmt_ckpt_read_header) and compare it
 * with the position the documented rule gives (include/nmt/checkpoint.h nmt_ckpt_data_resume):
 * same order, the same position; another order, the start of a new epoch. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/log.h"
#include "nmt/trainer.h"
#include "test.h"

/* Batches of one epoch of `shard` under max_tokens (max_len 16, as nmt_th_tiny_config), or -1. */
static long n_batches(const char *shard, int max_tokens) {
  nmt_shard *s;
  nmt_batcher *b;
  if (nmt_shard_open(shard, 0, &s) != NMT_OK) return -1;
  long n = -1;
  if (nmt_batcher_create(s, max_tokens, 16, 7, &b) == NMT_OK) {
    n = nmt_batcher_num_batches(b);
    nmt_batcher_destroy(b);
  }
  nmt_shard_close(s);
  return n;
}

/* The warnings and info lines of the last run() (the resume's decisions among them). */
static char logged[16384];

static void keep_line(void *user, nmt_log_level level, const char *line) {
  (void)user;
  size_t n = strlen(logged);
  if (level <= NMT_LOG_INFO && n + strlen(line) + 2 < sizeof logged)
    snprintf(logged + n, sizeof logged - n, "%s\n", line);
}

/* Runs c to its end (quiet), its log lines into `logged`; NMT_OK or the run's status. */
static nmt_status run(const nmt_config *c) {
  nmt_trainer *t;
  static const nmt_log_sink sink = {keep_line, NULL};
  const nmt_log_level level = nmt_log_get_level();
  logged[0] = 0;
  nmt_log_set_level(NMT_LOG_INFO);
  nmt_log_set_sink(&sink);
  nmt_status s = nmt_th_trainer_quiet(c, NULL, NULL, &t);
  if (s == NMT_OK) {
    s = nmt_trainer_run(t);
    nmt_trainer_destroy(t);
  }
  nmt_log_set_sink(NULL);
  nmt_log_set_level(level);
  return s;
}

/* `text` is in the last run's log. */
#define ASSERT_LOGGED(text)                                                           \
  do {                                                                                \
    if (!strstr(logged, text)) {                                                      \
      nmt_test_fail(__FILE__, __LINE__, "no \"%s\" in the log:\n%s", text, logged); \
      return;                                                                         \
    }                                                                                 \
  } while (0)

/* The newest checkpoint of run directory `out` and its header. */
static nmt_status latest(const char *out, char *path, nmt_ckpt_header *h) {
  char dir[NMT_PATH_MAX + 16];
  snprintf(dir, sizeof dir, "%s/checkpoints", out);
  NMT_TRY(nmt_ckpt_find_latest(dir, path));
  return nmt_ckpt_read_header(path, h);
}

#define ASSERT_POS(out, step_, epoch_, index_)                                            \
  do {                                                                                    \
    char p_[1024];                                                                        \
    nmt_ckpt_header h_;                                                                   \
    NMT_ASSERT_OK(latest(out, p_, &h_));                                                  \
    printf("# %s: step %ld, data position epoch %ld index %ld\n", p_, (long)h_.step,      \
           (long)h_.data_epoch, (long)h_.data_index);                                     \
    NMT_ASSERT_EQ_INT(h_.step, step_);                                                    \
    NMT_ASSERT_EQ_INT(h_.data_epoch, epoch_);                                             \
    NMT_ASSERT_EQ_INT(h_.data_index, index_);                                             \
  } while (0)

/* The case: a checkpoint near the end of an epoch of 64-token batches, resumed with
 * data.max_tokens = 256 (fewer batches). Its index lies past the new order: unchecked, the
 * loader read past its epoch order (out of bounds) and trained on whatever ids it found there.
 * The run must continue at the start of the next epoch of the new order. */
NMT_TEST(resume_data_larger_max_tokens_starts_new_epoch) {
  const char *dir = nmt_test_tmpdir();
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(dir, 96, 6, &c));
  const long nb = n_batches(c.data_train, 64), nb2 = n_batches(c.data_train, 256);
  printf("# %ld batches at max_tokens 64, %ld at 256\n", nb, nb2);
  NMT_ASSERT(nb2 >= 1 && nb - 1 > nb2); /* the checkpoint's index is past the new order */
  c.train_max_steps = nb - 1;
  NMT_ASSERT_OK(run(&c));
  ASSERT_POS(c.run_out_dir, nb - 1, 0, nb - 1);
  c.run_resume = 1;
  c.data_max_tokens = 256;
  const long more = nb2 + 1; /* crosses an epoch of the new order too */
  c.train_max_steps = nb - 1 + more;
  NMT_ASSERT_OK(run(&c));
  ASSERT_POS(c.run_out_dir, nb - 1 + more, 1 + more / nb2, more % nb2);
  ASSERT_LOGGED("the training data order changed (data.max_tokens): [data] max_tokens = 64 "
                "then, 256 now");
  ASSERT_LOGGED("continuing at the start of epoch 2");
}

/* data.train rewritten in place (same path, other pairs): the position is mid-epoch and in
 * range of the new order, so nothing would crash; but it names other batches than the ones
 * the checkpoint's epoch had left. A new epoch of the new shard's order starts. */
NMT_TEST(resume_data_changed_shard_starts_new_epoch) {
  const char *dir = nmt_test_tmpdir();
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(dir, 96, 6, &c));
  c.train_max_steps = 3;
  NMT_ASSERT_OK(run(&c));
  ASSERT_POS(c.run_out_dir, 3, 0, 3);
  NMT_ASSERT_OK(nmt_th_write_synthetic(c.data_train, 80, 11));
  NMT_ASSERT(n_batches(c.data_train, 64) > 5);
  c.run_resume = 1;
  c.train_max_steps = 5;
  NMT_ASSERT_OK(run(&c));
  ASSERT_POS(c.run_out_dir, 5, 1, 2);
  ASSERT_LOGGED("the training data order changed (data.train): [data] train = \"");
  ASSERT_LOGGED("then (96 pairs,");
  ASSERT_LOGGED("now (80 pairs,");
}

/* More data-parallel workers read the same stream: the position carries over and each step
 * takes devices x accum_steps batches of it. */
NMT_TEST(resume_data_more_devices_keeps_position) {
  const char *dir = nmt_test_tmpdir();
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(dir, 96, 6, &c));
  NMT_ASSERT(n_batches(c.data_train, 64) > 7);
  c.train_max_steps = 3;
  NMT_ASSERT_OK(run(&c));
  c.run_resume = 1;
  c.parallel_devices = 2;
  c.train_max_steps = 5;
  NMT_ASSERT_OK(run(&c));
  ASSERT_POS(c.run_out_dir, 5, 0, 3 + 2 * 2);
  ASSERT_LOGGED("1 data-parallel rank(s) x train.accum_steps = 1 then, 2 x 1 now: the data "
                "position (epoch 1, batch 4 of");
}

/* Rewrites checkpoint `path` as a file of an nmt that recorded no data order: the same
 * arrays and records but `data`, with the position (epoch, index). */
static nmt_status strip_data_record(const char *path, long epoch, long index) {
  nmt_ckpt_header h;
  nmt_ckpt_meta m;
  NMT_TRY(nmt_ckpt_read_meta(path, &h, &m));
  float *a = malloc(3 * h.n_params * sizeof(float) + 1);
  nmt_status s = a ? nmt_ckpt_read(path, NULL, &h, a, a + h.n_params, a + 2 * h.n_params)
                   : NMT_ERR_NOMEM;
  nmt_ckpt_meta old = {.config = m.config,
                       .spm_model_path = m.spm_model_path,
                       .spm_model = m.spm_model,
                       .spm_model_bytes = m.spm_model_bytes};
  h.meta = &old;
  h.data_epoch = epoch;
  h.data_index = index;
  if (s == NMT_OK) s = nmt_ckpt_write(path, &h, a, a + h.n_params, a + 2 * h.n_params);
  free(a);
  nmt_ckpt_meta_free(&m);
  return s;
}

/* A checkpoint without the `data` record still resumes: a position inside the current order
 * is taken as it is (such a file cannot tell a changed shard); one past it cannot be of this
 * order, and a new epoch starts. */
NMT_TEST(resume_data_old_checkpoint_without_record) {
  const char *dir = nmt_test_tmpdir();
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(dir, 96, 6, &c));
  const long nb = n_batches(c.data_train, 64);
  NMT_ASSERT(nb > 6);
  c.train_max_steps = 3;
  NMT_ASSERT_OK(run(&c));
  char path[1024];
  nmt_ckpt_header h;
  NMT_ASSERT_OK(latest(c.run_out_dir, path, &h));
  NMT_ASSERT_OK(strip_data_record(path, 0, 3));
  c.run_resume = 1;
  c.train_max_steps = 5;
  NMT_ASSERT_OK(run(&c));
  ASSERT_POS(c.run_out_dir, 5, 0, 5);
  ASSERT_LOGGED("the checkpoint does not record its data order");
  NMT_ASSERT_OK(latest(c.run_out_dir, path, &h));
  NMT_ASSERT_OK(strip_data_record(path, 2, nb + 4)); /* past any order of this shard */
  c.train_max_steps = 7;
  NMT_ASSERT_OK(run(&c));
  ASSERT_POS(c.run_out_dir, 7, 3, 2);
  ASSERT_LOGGED("the training data order changed (the data): the position lies past the");
}

/* The `data` record (docs/formats.md) round-trips through a checkpoint file; a record whose
 * counts describe no order (more batches than pairs) is corruption. */
NMT_TEST(resume_data_record_round_trip) {
  char path[NMT_PATH_MAX];
  snprintf(path, sizeof path, "%s/d.ckpt", nmt_test_tmpdir());
  nmt_ckpt_meta meta = {.config = (char *)"[run]\nseed = 9\n"};
  nmt_ckpt_data *d = &meta.data;
  *d = (nmt_ckpt_data){.present = 1, .shard_bytes = 5000000001ull, .shard_crc32 = 0xdeadbeef,
                       .max_tokens = 4096, .max_len = 128, .world = 8, .accum_steps = 2,
                       .n_pairs = 3000000000LL, .n_batches = 70000, .seed = 1ull << 63};
  snprintf(d->train, sizeof d->train, "data/wmt14/train.shard");
  nmt_ckpt_header h = {.vocab = 40, .d_model = 16, .n_heads = 2, .d_ff = 32, .enc_layers = 1,
                       .dec_layers = 1, .n_params = 3, .step = 9, .data_epoch = 2,
                       .data_index = 69999, .meta = &meta};
  const float p[3] = {1, 2, 3};
  NMT_ASSERT_OK(nmt_ckpt_write(path, &h, p, NULL, NULL));
  nmt_ckpt_header got;
  nmt_ckpt_meta m;
  NMT_ASSERT_OK(nmt_ckpt_read_meta(path, &got, &m));
  NMT_ASSERT_EQ_INT(m.data.present, 1);
  const nmt_ckpt_data *r = &m.data;
  NMT_ASSERT(r->shard_bytes == d->shard_bytes && r->shard_crc32 == d->shard_crc32 &&
             r->max_tokens == d->max_tokens && r->max_len == d->max_len &&
             r->world == d->world && r->accum_steps == d->accum_steps &&
             r->n_pairs == d->n_pairs && r->n_batches == d->n_batches && r->seed == d->seed &&
             !strcmp(r->train, d->train));
  nmt_ckpt_meta_free(&m);
  NMT_ASSERT_OK(nmt_ckpt_read(path, NULL, &got, NULL, NULL, NULL));
  d->n_batches = d->n_pairs + 1;
  NMT_ASSERT_OK(nmt_ckpt_write(path, &h, p, NULL, NULL));
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read_meta(path, &got, &m), NMT_ERR_CHECKPOINT);
  NMT_ASSERT(strstr(nmt_last_error(), "corrupt metadata") != NULL);
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read(path, NULL, &got, NULL, NULL, NULL), NMT_ERR_CHECKPOINT);
  /* A negative position is a corrupt header (nmt never writes one). */
  d->n_batches = 70000;
  h.data_index = -1;
  NMT_ASSERT_OK(nmt_ckpt_write(path, &h, p, NULL, NULL));
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read_header(path, &got), NMT_ERR_CHECKPOINT);
  NMT_ASSERT(strstr(nmt_last_error(), "corrupt header") != NULL);
}

/* The epoch of each metrics.jsonl record, by step (index = step); -1 where none. */
static int read_epochs(const char *out, long *epoch, int cap) {
  char path[NMT_PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/metrics.jsonl", out);
  char *text = nmt_th_read_file(path, NULL);
  if (!text) return -1;
  for (int i = 0; i < cap; i++) epoch[i] = -1;
  int n = 0;
  for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
    double step = nmt_th_json_num(line, "step"), e = nmt_th_json_num(line, "epoch");
    if (step >= 0 && step < cap && e == e) epoch[(long)step] = (long)e, n++;
  }
  free(text);
  return n;
}

/* A shard of a few batches exhausted several times: metrics.jsonl's epoch is the pass over the
 * data (from 1) that each step's last batch belongs to, also after a resume. */
NMT_TEST(resume_epoch_counts_data_passes) {
  const char *dir = nmt_test_tmpdir();
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(dir, 12, 5, &c));
  const long nb = n_batches(c.data_train, 64);
  printf("# %ld batches per epoch\n", nb);
  NMT_ASSERT(nb >= 2 && nb <= 6);
  const long s1 = 2 * nb + 1, s2 = 4 * nb + 1;
  c.train_max_steps = s1;
  NMT_ASSERT_OK(run(&c));
  c.run_resume = 1;
  c.train_max_steps = s2;
  NMT_ASSERT_OK(run(&c));
  long epoch[64];
  NMT_ASSERT(s2 < 64);
  NMT_ASSERT(read_epochs(c.run_out_dir, epoch, 64) >= s2);
  for (long s = 1; s <= s2; s++)
    if (epoch[s] != (s - 1) / nb + 1) {
      nmt_test_fail(__FILE__, __LINE__, "step %ld: epoch %ld in metrics.jsonl, expected %ld", s,
                    epoch[s], (s - 1) / nb + 1);
      return;
    }
}
