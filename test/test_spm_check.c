/* test_spm_check.c — data.spm_model is checked when training starts (issue 28): a file that is
 * not a SentencePiece model (a shard, a text file, a missing file), a model of another
 * vocabulary size, or another model than the one the shards were encoded with is a config error
 * (exit 2) naming the key, the file and the mismatch, before any step; a shard written before
 * nmt recorded its model is trained on with a warning. */
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "nmt/data.h"
#include "nmt/log.h"
#include "test.h"

/* n lines of made-up words (deterministic from seed) to path; 1 on success. */
static int write_words(const char *path, int n, unsigned seed) {
  static const char *const syl[] = {"ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po"};
  FILE *f = fopen(path, "w");
  if (!f) return 0;
  for (int i = 0; i < n; i++) {
    int words = 2 + (int)(seed % 5);
    for (int w = 0; w < words; w++) {
      seed = seed * 1103515245u + 12345u;
      fprintf(f, "%s%s%s", w ? " " : "", syl[(seed >> 16) % 10], syl[(seed >> 20) % 10]);
    }
    fputc('\n', f);
  }
  return fclose(f) == 0;
}

/* dir/NAME.model: spm_train on `text`, `vocab` pieces, nmt's ids. 1 on success. */
static int train_spm(const char *dir, const char *name, const char *text, int vocab) {
  char cmd[4096], out[4096];
  snprintf(cmd, sizeof cmd,
           "spm_train --input=%s --model_prefix=%s/%s --vocab_size=%d --model_type=unigram "
           "--character_coverage=1.0 --pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3 "
           "--random_seed=1 --num_threads=1 >%s/%s.log 2>&1",
           text, dir, name, vocab, dir, name);
  return nmt_th_capture(cmd, out, sizeof out) == 0;
}

/* Warnings the check logs, collected. */
static char warned[4096];
static void on_log(void *user, nmt_log_level level, const char *msg) {
  (void)user;
  if (level == NMT_LOG_WARN && strlen(warned) + strlen(msg) + 2 < sizeof warned)
    strcat(strcat(warned, msg), "\n");
}

NMT_TEST(spm_check_at_train_start) {
  char out[8192];
  if (nmt_th_capture("command -v spm_train", out, sizeof out) != 0)
    NMT_SKIP("no spm_train (tools/install-deps.sh installs SentencePiece)");
  const char *dir = nmt_test_tmpdir();
  char a[1024], b[1024], c_text[1024], shard[1024], old[1024], m40[1024], m60[1024], other[1024];
  snprintf(a, sizeof a, "%s/a.txt", dir);
  snprintf(b, sizeof b, "%s/b.txt", dir);
  snprintf(c_text, sizeof c_text, "%s/c.txt", dir);
  NMT_ASSERT(write_words(a, 200, 3) && write_words(b, 200, 4) && write_words(c_text, 200, 99));
  NMT_ASSERT(train_spm(dir, "m40", a, NMT_TH_VOCAB) && train_spm(dir, "m60", a, 60));
  /* Same size, other text: another model of the same vocabulary. */
  snprintf(other, sizeof other, "%s/cb.txt", dir);
  snprintf(out, sizeof out, "cat %s %s > %s", c_text, b, other);
  NMT_ASSERT_EQ_INT(nmt_th_capture(out, out, sizeof out), 0);
  NMT_ASSERT(train_spm(dir, "other", other, NMT_TH_VOCAB));
  snprintf(m40, sizeof m40, "%s/m40.model", dir);
  snprintf(m60, sizeof m60, "%s/m60.model", dir);
  snprintf(other, sizeof other, "%s/other.model", dir);
  snprintf(shard, sizeof shard, "%s/train.shard", dir);
  snprintf(old, sizeof old, "%s/old.shard", dir);
  nmt_shard_clean_report r;
  NMT_ASSERT_OK(nmt_shard_write_from_raw(m40, a, b, NULL, shard, &r));
  NMT_ASSERT_EQ_INT(r.kept, 200);
  NMT_ASSERT_OK(nmt_th_write_synthetic(old, 50, 1));

  nmt_config c;
  char run[1024];
  snprintf(run, sizeof run, "%s/run", dir);
  nmt_th_tiny_config(&c, run, shard);
  struct {
    const char *model;
    const char *shard;
    const char *need[3];
  } bad[] = {
      {shard, shard, {"[data] spm_model", "train.shard", "not a usable SentencePiece model"}},
      {a, shard, {"[data] spm_model", "a.txt", "not a usable SentencePiece model"}},
      {"/nonexistent/spm.model", shard, {"[data] spm_model", "/nonexistent/spm.model", "No such"}},
      {m60, shard, {"[data] spm_model", "m60.model", "60 pieces but [model] vocab = 40"}},
      {other, shard, {"[data] spm_model", "other.model", "is not the SentencePiece model [data] "
                                                           "train"}},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    snprintf(c.data_spm_model, sizeof c.data_spm_model, "%s", bad[i].model);
    snprintf(c.data_train, sizeof c.data_train, "%s", bad[i].shard);
    nmt_trainer *t = NULL;
    nmt_status s = nmt_th_trainer_quiet(&c, NULL, NULL, &t);
    const char *msg = nmt_last_error();
    if (s != NMT_ERR_CONFIG || !strstr(msg, bad[i].need[0]) || !strstr(msg, bad[i].need[1]) ||
        !strstr(msg, bad[i].need[2]))
      nmt_test_fail(__FILE__, __LINE__, "spm_model %s: %s: %s", bad[i].model, nmt_status_str(s),
                    msg);
    if (t) nmt_trainer_destroy(t);
    /* Refused before the run directory exists: nothing to clean up, nothing overwritten. */
    NMT_ASSERT(access(run, F_OK) != 0);
    if (nmt_test_failed()) return;
  }
  /* The right model, and a shard from before the hash: trains, the latter with a warning. */
  const char *ok_shards[] = {shard, old};
  for (int i = 0; i < 2; i++) {
    snprintf(c.data_spm_model, sizeof c.data_spm_model, "%s", m40);
    snprintf(c.data_train, sizeof c.data_train, "%s", ok_shards[i]);
    warned[0] = 0;
    static const nmt_log_sink sink = {on_log, NULL};
    nmt_log_level level = nmt_log_get_level();
    nmt_log_set_level(NMT_LOG_WARN);
    nmt_log_set_sink(&sink);
    nmt_trainer *t = NULL;
    nmt_status s = nmt_th_trainer_quiet(&c, NULL, NULL, &t);
    nmt_log_set_sink(NULL);
    nmt_log_set_level(level);
    if (s != NMT_OK)
      nmt_test_fail(__FILE__, __LINE__, "%s: %s", ok_shards[i], nmt_last_error());
    if (t) nmt_trainer_destroy(t);
    int has_warning = strstr(warned, "does not record its SentencePiece model") != NULL;
    NMT_ASSERT_EQ_INT(has_warning, i == 1);
  }
  uint32_t h = 0;
  NMT_ASSERT_OK(nmt_shard_read_spm_hash(old, &h));
  NMT_ASSERT_EQ_INT((int)h, 0);

  /* The command line: exit 2, the key and the file named. */
  char ini[1024], cmd[4096];
  snprintf(ini, sizeof ini, "%s/t.ini", dir);
  NMT_ASSERT_EQ_INT(nmt_th_write_ini(ini, run, shard, 1, NULL), 0);
  snprintf(cmd, sizeof cmd, "%s/nmt train %s data.spm_model=%s 2>&1", nmt_test_build_dir(), ini,
           shard);
  int rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 2 || !strstr(out, "[data] spm_model") || !strstr(out, "train.shard"))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 2: %s", cmd, rc, out);
}
