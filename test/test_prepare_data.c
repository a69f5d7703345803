/* test_prepare_data.c — tools/prepare-data.sh on a corpus a user might bring (issue 28): pairs
 * with an empty side and pairs of a wild length ratio are left out of training and counted per
 * reason (Moses' clean-corpus-n.perl), valid and test keep every line, OUT/data.ini loads as a
 * config, after a model config as the command it and the final message spell out, and points
 * `eval --split` at the raw valid/test text placed next to the shards, shards of an older
 * format or without their model's hash are rewritten, and a write that fails (a full disk,
 * here a file size limit) is an I/O error, exit 6. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/eval.h"
#include "test.h"

/* A sentence of `words` made-up words (deterministic from *seed) to f. */
static void words_to(FILE *f, int words, unsigned *seed) {
  static const char *const syl[] = {"ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po"};
  for (int w = 0; w < words; w++) {
    *seed = *seed * 1103515245u + 12345u;
    fprintf(f, "%s%s%s", w ? " " : "", syl[(*seed >> 16) % 10], syl[(*seed >> 20) % 10]);
  }
  fputc('\n', f);
}

/* PREFIX.en / PREFIX.de of n lines: the source of line i (0-based) is empty when i % 10 == 3,
 * the target when i % 10 == 7 (when `empty`), and line i % 50 == 11 pairs 1 word with 40
 * (when `ratio`); the rest 3..7 words each side. 1 on success. */
static int write_corpus(const char *prefix, int n, int empty, int ratio) {
  char p[1200];
  FILE *f[2];
  for (int s = 0; s < 2; s++) {
    snprintf(p, sizeof p, "%s.%s", prefix, s ? "de" : "en");
    if (!(f[s] = fopen(p, "w"))) return 0;
  }
  unsigned seed = 17;
  for (int i = 0; i < n; i++)
    for (int s = 0; s < 2; s++) {
      int words = 3 + (int)((seed >> 8) % 5);
      if (empty && i % 10 == (s ? 7 : 3)) words = 0;
      else if (ratio && i % 50 == 11) words = s ? 40 : 1;
      words_to(f[s], words, &seed);
    }
  return (fclose(f[0]) == 0) & (fclose(f[1]) == 0);
}

/* 1 when `dir` holds a name containing `part`. */
static int dir_has(const char *dir, const char *part) {
  DIR *d = opendir(dir);
  if (!d) return 0;
  struct dirent *e;
  int found = 0;
  while ((e = readdir(d))) found |= strstr(e->d_name, part) != NULL;
  closedir(d);
  return found;
}

NMT_TEST(prepare_data_cleans_reports_and_writes_data_ini) {
  char out[16384], cmd[8192], p[1100], q[1100];
  if (nmt_th_capture("command -v spm_train", out, sizeof out) != 0)
    NMT_SKIP("no spm_train (tools/install-deps.sh installs SentencePiece)");
  const char *dir = nmt_test_tmpdir();
  char raw[1024], o[1024];
  snprintf(raw, sizeof raw, "%s/raw", dir);
  snprintf(o, sizeof o, "%s/out", dir);
  NMT_ASSERT_EQ_INT(mkdir(raw, 0755), 0);
  snprintf(p, sizeof p, "%s/train", raw);
  NMT_ASSERT(write_corpus(p, 2000, 1, 1));
  snprintf(p, sizeof p, "%s/valid", raw);
  NMT_ASSERT(write_corpus(p, 50, 1, 0));
  snprintf(p, sizeof p, "%s/test", raw);
  NMT_ASSERT(write_corpus(p, 20, 0, 0));
  char base[6000];
  snprintf(base, sizeof base, "tools/prepare-data.sh --name t --src en --tgt de --vocab 60 "
           "--nmt %s/nmt --train %s/train --valid %s/valid --test %s/test --out %s",
           nmt_test_build_dir(), raw, raw, raw, o);
  snprintf(cmd, sizeof cmd, "%s 2>&1", base);
  int rc = nmt_th_capture(cmd, out, sizeof out);
  /* 2000 lines: 400 with an empty side (200 each), 40 of 1 word against 40, none of them
   * empty; valid keeps its 10 empty ones. */
  const char *need[] = {"train: ", "2000 pairs, 1560 kept; left out: 400 with an empty side, "
                        "40 with a length ratio above 9",
                        "valid.shard: 50 pairs, 50 kept; kept with an empty side: 10"};
  char train_cmd[1200];
  snprintf(train_cmd, sizeof train_cmd, "train with a model config first, e.g.\n  nmt train "
           "conf/bible-small.ini %s/data.ini run.out_dir=runs/t\n", o);
  if (rc != 0 || !strstr(out, need[1]) || !strstr(out, need[2]) || !strstr(out, train_cmd))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", cmd, rc, out);
  NMT_ASSERT_EQ_INT(rc, 0);
  nmt_shard *sh_;
  snprintf(p, sizeof p, "%s/train.shard", o);
  NMT_ASSERT_OK(nmt_shard_open(p, 60, &sh_));
  NMT_ASSERT_EQ_INT((int)nmt_shard_num_pairs(sh_), 1560);
  for (long i = 0; i < nmt_shard_num_pairs(sh_); i++)
    if (nmt_shard_src_len(sh_, i) == 0 || nmt_shard_tgt_len(sh_, i) == 0) {
      nmt_test_fail(__FILE__, __LINE__, "pair %ld of %s has an empty side", i, p);
      break;
    }
  NMT_ASSERT(nmt_shard_spm_hash(sh_) != 0);
  nmt_shard_close(sh_);

  /* data.ini loads as a config naming this corpus, and eval --split finds the raw text. */
  snprintf(p, sizeof p, "%s/data.ini", o);
  nmt_config cfg;
  NMT_ASSERT_OK(nmt_config_load(p, NULL, 0, &cfg));
  NMT_ASSERT_EQ_INT(cfg.model_vocab, 60);
  snprintf(q, sizeof q, "%s/spm.model", o);
  NMT_ASSERT(!strcmp(cfg.data_spm_model, q));
  snprintf(q, sizeof q, "%s/test.shard", o);
  NMT_ASSERT(!strcmp(cfg.data_test, q));
  NMT_ASSERT_OK(nmt_data_check_spm(&cfg));
  char src[NMT_PATH_MAX + 64], ref[NMT_PATH_MAX + 64];
  for (int t = 0; t < 2; t++) {
    const char *split = t ? "test" : "valid";
    NMT_ASSERT_OK(nmt_eval_split_text(&cfg, split, src, ref, sizeof src));
    snprintf(q, sizeof q, "%s/%s.en", o, split);
    NMT_ASSERT(!strcmp(src, q));
    snprintf(cmd, sizeof cmd, "cmp %s %s/%s.en && cmp %s %s/%s.de", src, raw, split, ref, raw,
             split);
    NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 0);
  }
  /* The command the comment spells out loads: the model config's keys, the corpus' [data] and
   * vocabulary over them. */
  snprintf(cmd, sizeof cmd, "%s/nmt config --dump $(sed -n '4s/^; *nmt train //p' %s/data.ini) "
           "2>&1", nmt_test_build_dir(), o);
  NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 0);
  snprintf(q, sizeof q, "\ntrain = \"%s/train.shard\"\n", o);
  NMT_ASSERT(strstr(out, q) && strstr(out, "\nvocab = 60\n") && strstr(out, "\nd_model = 256\n") &&
             strstr(out, "\nout_dir = \"runs/t\"\n"));
  snprintf(cmd, sizeof cmd, "%s 2>&1", base);
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 0 || !strstr(out, "is up to date; ") || !strstr(out, train_cmd))
    nmt_test_fail(__FILE__, __LINE__, "second run: exit %d: %s", rc, out);
  /* Without --test, data.ini sets test = "" (none), so a model config's test shard (the
   * Bible's, in conf/bible-small.ini) is not taken for this corpus'. */
  char no_test[6000];
  snprintf(no_test, sizeof no_test, "%s", base);
  char *t = strstr(no_test, " --test ");
  NMT_ASSERT(t != NULL);
  memmove(t, strstr(t + 8, " "), strlen(strstr(t + 8, " ")) + 1);
  snprintf(cmd, sizeof cmd, "%s 2>&1", no_test);
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 0 || !strstr(out, "is up to date"))
    nmt_test_fail(__FILE__, __LINE__, "run without --test: exit %d: %s", rc, out);
  const char *layers[] = {"conf/bible-small.ini", p};
  NMT_ASSERT_OK(nmt_config_load_files(layers, 2, NULL, 0, &cfg));
  NMT_ASSERT(cfg.data_test[0] == 0 && cfg.model_vocab == 60 && cfg.model_d_model == 256);
  /* A shard from before shards recorded the model's hash (bytes 20..23 zero; `nmt shard
   * --vocab` writes such shards still) is rewritten with it, and so is one of format version
   * 1 (no checksums: what data/ holds from before version 2), so that nmt verifies it on open;
   * the others stay up to date, and the rewritten ones are up to date after. */
  snprintf(p, sizeof p, "%s/test.shard", o);
  size_t len = 0;
  unsigned char *bytes = (unsigned char *)nmt_th_read_file(p, &len);
  NMT_ASSERT(bytes != NULL && len > 72);
  memset(bytes + 20, 0, 4);
  nmt_th_shard_reseal(bytes, len);
  FILE *f = fopen(p, "wb");
  int wrote = f && fwrite(bytes, 1, len, f) == len;
  if (f && fclose(f) != 0) wrote = 0;
  free(bytes);
  NMT_ASSERT(wrote);
  NMT_ASSERT_OK(nmt_shard_open(p, 60, &sh_));
  NMT_ASSERT(nmt_shard_spm_hash(sh_) == 0);
  nmt_shard_close(sh_);
  snprintf(p, sizeof p, "%s/valid.shard", o);
  snprintf(q, sizeof q, "%s/valid.v1", dir);
  NMT_ASSERT_EQ_INT(nmt_th_shard_to_v1(p, q), 0);
  NMT_ASSERT_EQ_INT(rename(q, p), 0);
  snprintf(cmd, sizeof cmd, "%s 2>&1", base);
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 0 || !strstr(out, "valid.shard: 50 pairs") || !strstr(out, "test.shard: 20 pairs") ||
      !strstr(out, "valid.shard: format version 1, this nmt writes 2") ||
      strstr(out, "train.shard:"))
    nmt_test_fail(__FILE__, __LINE__, "run after zeroing test's hash and making valid version "
                  "1: exit %d: %s", rc, out);
  for (int t = 0; t < 2; t++) {
    snprintf(p, sizeof p, "%s/%s.shard", o, t ? "test" : "valid");
    NMT_ASSERT_OK(nmt_shard_open(p, 60, &sh_));
    int version = nmt_shard_version(sh_);
    uint32_t hash = nmt_shard_spm_hash(sh_);
    nmt_shard_close(sh_);
    NMT_ASSERT_EQ_INT(version, NMT_SHARD_VERSION);
    NMT_ASSERT(hash != 0);
  }
  snprintf(cmd, sizeof cmd, "%s 2>&1", base);
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 0 || !strstr(out, "is up to date"))
    nmt_test_fail(__FILE__, __LINE__, "run after the rewrite: exit %d: %s", rc, out);

  /* A write that fails (as on a full disk: a file size limit makes write() fail with EFBIG):
   * exit 6 naming the file, and no temporary file left in OUT. */
  snprintf(p, sizeof p, "%s/train.shard", o);
  NMT_ASSERT_EQ_INT(unlink(p), 0);
  snprintf(cmd, sizeof cmd, "bash -c \"trap '' XFSZ; ulimit -f 16; %s\" 2>&1", base);
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 6 || !strstr(out, "write failed") || !strstr(out, o))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 6: %s", cmd, rc, out);
  NMT_ASSERT(!dir_has(o, "tmp"));
  NMT_ASSERT(!dir_has(o, "-ids."));
  NMT_ASSERT(access(p, F_OK) != 0);
  /* The same limit on a fresh OUT: spm_train exits 0 with a truncated model, still exit 6. */
  snprintf(cmd, sizeof cmd, "bash -c \"trap '' XFSZ; ulimit -f 16; %s2\" 2>&1", base);
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 6 || !strstr(out, "is the disk full"))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 6: %s", cmd, rc, out);
}

/* nmt shard --spm on its own: a bad option is a usage error, a missing model an I/O error,
 * unequal line counts a data error naming both files. */
NMT_TEST(prepare_data_nmt_shard_spm_errors) {
  char out[8192], cmd[4096], p[1100];
  const char *dir = nmt_test_tmpdir();
  snprintf(p, sizeof p, "%s/a", dir);
  NMT_ASSERT(write_corpus(p, 30, 0, 0));
  snprintf(cmd, sizeof cmd, "%s/nmt shard --spm %s/none.model --max-ratio 0.5 %s.en %s.de "
           "%s/x.shard 2>&1", nmt_test_build_dir(), dir, p, p, dir);
  NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 2);
  snprintf(cmd, sizeof cmd, "%s/nmt shard --spm %s/none.model %s.en %s.de %s/x.shard 2>&1",
           nmt_test_build_dir(), dir, p, p, dir);
  int rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 6 || !strstr(out, "none.model"))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 6: %s", cmd, rc, out);
  if (nmt_th_capture("command -v spm_train", out, sizeof out) != 0) return;
  snprintf(cmd, sizeof cmd, "spm_train --input=%s.en --model_prefix=%s/m --vocab_size=30 "
           "--pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3 >/dev/null 2>&1 && head -n 20 %s.de > "
           "%s/short.de", p, dir, p, dir);
  NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 0);
  snprintf(cmd, sizeof cmd, "%s/nmt shard --spm %s/m.model %s.en %s/short.de %s/x.shard 2>&1",
           nmt_test_build_dir(), dir, p, dir, dir);
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 3 || !strstr(out, "line counts differ") || !strstr(out, "short.de"))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 3: %s", cmd, rc, out);
}
