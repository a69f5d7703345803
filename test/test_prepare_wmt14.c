/* test_prepare_wmt14.c — the WMT14 English-German recipe (issue 37) end to end on a corpus made
 * up in the downloads' own layout: tools/prepare-wmt14.sh finds Europarl and News Commentary
 * extracted (training/NAME.{en,de}) and Common Crawl still in its .tgz, concatenates them in
 * order (a last line without a newline does not run into the next corpus), takes newstest2013
 * and 2014 from files, hands everything to tools/prepare-data.sh and is quick and unchanged
 * the second time; conf/wmt14-en-de-base.ini, shrunk by overrides, then trains on
 * OUT/data.ini, `nmt average --last 5` averages its checkpoints, and the average translates and
 * evaluates the test split. Refusals: a corpus missing, a split's file missing, a corpus whose
 * sides differ in length, and sacreBLEU unable to fetch (offline) each name what to pass. No
 * network is used. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "helpers.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "test.h"

/* The paper's base, shrunk to run in seconds: the recipe's schedule, decoding and checkpoint
 * keys stay the file's. */
#define SHRINK                                                                                  \
  "model.d_model=32 model.n_heads=2 model.d_ff=64 model.enc_layers=1 model.dec_layers=1 "       \
  "data.max_len=32 data.max_tokens=256 train.accum_steps=1 train.max_steps=200 "                \
  "train.warmup_steps=20 train.log_every=50 train.valid_every=200 train.save_every=40 "         \
  "parallel.device=cpu decode.max_extra_len=4"

/* PREFIX.en / PREFIX.de of n made-up sentences of 3..7 words (deterministic from seed); with
 * `no_final_newline` the last line of each ends without one. 1 on success. */
static int write_pair(const char *prefix, int n, unsigned seed, int no_final_newline) {
  static const char *const syl[] = {"ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po"};
  char p[1200];
  int ok = 1;
  for (int s = 0; s < 2; s++) {
    snprintf(p, sizeof p, "%s.%s", prefix, s ? "de" : "en");
    FILE *f = fopen(p, "w");
    if (!f) return 0;
    unsigned r = seed + (unsigned)s;
    for (int i = 0; i < n; i++) {
      r = r * 1103515245u + 12345u;
      int words = 3 + (int)((r >> 8) % 5);
      for (int w = 0; w < words; w++) {
        r = r * 1103515245u + 12345u;
        fprintf(f, "%s%s%s", w ? " " : "", syl[(r >> 16) % 10], syl[(r >> 20) % 10]);
      }
      if (i + 1 < n || !no_final_newline) fputc('\n', f);
    }
    ok &= fclose(f) == 0;
  }
  return ok;
}

/* dir/dl: the three corpora as downloaded (Common Crawl as its archive), dir/nt: newstest2013
 * (30 lines) and newstest2014 (20 lines). 1 on success. */
static int write_downloads(const char *dir) {
  char p[1100], cmd[4096], out[4096];
  snprintf(cmd, sizeof cmd, "mkdir -p %s/dl/training %s/cc %s/nt", dir, dir, dir);
  if (nmt_th_capture(cmd, out, sizeof out) != 0) return 0;
  snprintf(p, sizeof p, "%s/dl/training/europarl-v7.de-en", dir);
  if (!write_pair(p, 300, 1, 1)) return 0;
  snprintf(p, sizeof p, "%s/cc/commoncrawl.de-en", dir);
  if (!write_pair(p, 200, 2, 0)) return 0;
  snprintf(p, sizeof p, "%s/dl/training/news-commentary-v9.de-en", dir);
  if (!write_pair(p, 100, 3, 0)) return 0;
  snprintf(p, sizeof p, "%s/nt/newstest2013", dir);
  if (!write_pair(p, 30, 4, 0)) return 0;
  snprintf(p, sizeof p, "%s/nt/newstest2014", dir);
  if (!write_pair(p, 20, 5, 0)) return 0;
  snprintf(cmd, sizeof cmd, "tar -czf %s/dl/training-parallel-commoncrawl.tgz -C %s/cc "
           "commoncrawl.de-en.en commoncrawl.de-en.de && rm -r %s/cc", dir, dir, dir);
  return nmt_th_capture(cmd, out, sizeof out) == 0;
}

static int have_sacrebleu(void) {
  char out[256];
  return nmt_th_capture("python3 -c 'import sacrebleu' 2>/dev/null", out, sizeof out) == 0;
}

NMT_TEST(prepare_wmt14_downloads_to_trained_model) {
  char out[32768], cmd[8192], p[1200], q[1200];
  if (nmt_th_capture("command -v spm_train", out, sizeof out) != 0)
    NMT_SKIP("no spm_train (tools/install-deps.sh installs SentencePiece)");
  const char *dir = nmt_test_tmpdir(), *nmt = nmt_test_build_dir();
  NMT_ASSERT(write_downloads(dir));
  char base[4096];
  snprintf(base, sizeof base, "tools/prepare-wmt14.sh --raw %s/dl --valid %s/nt/newstest2013 "
           "--test %s/nt/newstest2014 --out %s/out --vocab 60 --nmt %s/nmt", dir, dir, dir, dir,
           nmt);
  snprintf(cmd, sizeof cmd, "%s 2>&1", base);
  int rc = nmt_th_capture(cmd, out, sizeof out);
  snprintf(p, sizeof p, "prepare-wmt14: train lines 301..500: %s/out/raw/extract/"
           "commoncrawl.de-en.{en,de}", dir);
  snprintf(q, sizeof q, "nmt train conf/wmt14-en-de-base.ini %s/out/data.ini", dir);
  if (rc != 0 || !strstr(out, "extracting commoncrawl.de-en.{en,de} from ") || !strstr(out, p) ||
      !strstr(out, "train lines 501..600: ") || !strstr(out, "600 pairs, 600 kept") ||
      !strstr(out, q))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", cmd, rc, out);
  NMT_ASSERT_EQ_INT(rc, 0);
  /* The concatenation keeps the corpora's lines apart: Europarl's last line (no newline) is
   * line 300, Common Crawl's first line 301. */
  snprintf(cmd, sizeof cmd, "cd %s && for l in en de; do test $(wc -l < out/raw/train.$l) = 600 "
           "&& test \"$(sed -n 300p out/raw/train.$l)\" = \"$(tail -n 1 "
           "dl/training/europarl-v7.de-en.$l)\" && test \"$(sed -n 301p out/raw/train.$l)\" = "
           "\"$(head -n 1 out/raw/extract/commoncrawl.de-en.$l)\" || exit 1; done", dir);
  NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 0);
  static const struct {
    const char *split;
    int pairs;
  } shards[] = {{"train", 600}, {"valid", 30}, {"test", 20}};
  for (int s = 0; s < 3; s++) {
    nmt_shard *sh;
    snprintf(p, sizeof p, "%s/out/%s.shard", dir, shards[s].split);
    NMT_ASSERT_OK(nmt_shard_open(p, 60, &sh));
    long n = nmt_shard_num_pairs(sh);
    uint32_t hash = nmt_shard_spm_hash(sh);
    nmt_shard_close(sh);
    NMT_ASSERT_EQ_INT((int)n, shards[s].pairs);
    NMT_ASSERT(hash != 0);
  }
  /* data.ini after the recipe: the corpus' paths and vocabulary, the recipe's model. */
  snprintf(p, sizeof p, "%s/out/data.ini", dir);
  const char *layers[] = {"conf/wmt14-en-de-base.ini", p};
  nmt_config cfg;
  NMT_ASSERT_OK(nmt_config_load_files(layers, 2, NULL, 0, &cfg));
  snprintf(q, sizeof q, "%s/out/test.shard", dir);
  NMT_ASSERT(cfg.model_vocab == 60 && cfg.model_d_model == 512 && !strcmp(cfg.data_test, q));
  NMT_ASSERT_OK(nmt_data_check_spm(&cfg));

  /* Idempotent: nothing is redone, the concatenation not even rewritten. */
  struct stat before, after;
  snprintf(p, sizeof p, "%s/out/raw/train.en", dir);
  NMT_ASSERT_EQ_INT(stat(p, &before), 0);
  snprintf(cmd, sizeof cmd, "%s 2>&1", base);
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 0 || !strstr(out, "is up to date") || strstr(out, "train lines") ||
      strstr(out, "extracting"))
    nmt_test_fail(__FILE__, __LINE__, "second run: exit %d: %s", rc, out);
  NMT_ASSERT_EQ_INT(stat(p, &after), 0);
  NMT_ASSERT(before.st_mtim.tv_sec == after.st_mtim.tv_sec &&
             before.st_mtim.tv_nsec == after.st_mtim.tv_nsec);

  /* Train the recipe, shrunk, far enough to learn the corpus' unigrams (valid loss below 3,
   * from ~4.1 at the start: log 60 and label smoothing); average the last 5 checkpoints (steps
   * 40..200) as the paper does. */
  snprintf(cmd, sizeof cmd, "%s/nmt train conf/wmt14-en-de-base.ini %s/out/data.ini "
           "run.out_dir=%s/run " SHRINK " 2>&1", nmt, dir, dir);
  rc = nmt_th_capture(cmd, out, sizeof out);
  const char *vl = strstr(out, "step 200 | valid loss ");
  double valid_loss = vl ? strtod(vl + strlen("step 200 | valid loss "), NULL) : 99;
  if (rc != 0 || !(valid_loss < 3.0))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, valid loss %g, want < 3: %s", cmd, rc,
                  valid_loss, out);
  NMT_ASSERT_EQ_INT(rc, 0);
  snprintf(p, sizeof p, "%s/run/config.ini", dir);
  char *ini = nmt_th_read_file(p, NULL);
  NMT_ASSERT(ini != NULL);
  int recipe = strstr(ini, "\nvocab = 60\n") && strstr(ini, "\nlabel_smoothing = 0.1\n") &&
               strstr(ini, "\nadam_beta2 = 0.98\n") && strstr(ini, "\ndropout = 0.1\n") &&
               strstr(ini, "\nbeam = 4\n") && strstr(ini, "\nlength_penalty = 0.6\n") &&
               strstr(ini, "\nkeep = 5\n");
  free(ini);
  if (!recipe) nmt_test_fail(__FILE__, __LINE__, "%s lacks the recipe's keys", p);
  snprintf(cmd, sizeof cmd, "%s/nmt average --last 5 %s/run/checkpoints --output %s/avg.ckpt "
           "2>&1", nmt, dir, dir);
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 0 || strstr(out, "only"))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", cmd, rc, out);
  /* The average translates newstest2014 (beam 4, length penalty 0.6 from the recipe): a line
   * per sentence, some of them words. */
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s/avg.ckpt --input %s/out/test.en --output "
           "%s/hyp.de decode.max_extra_len=4 2>&1 && test $(wc -l < %s/hyp.de) = 20 && "
           "grep -q '[a-z]' %s/hyp.de", nmt, dir, dir, dir, dir, dir);
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", cmd, rc, out);
  if (!have_sacrebleu()) {
    printf("# no sacrebleu: nmt eval --split test not run\n");
    return;
  }
  snprintf(cmd, sizeof cmd, "%s/nmt eval %s/avg.ckpt --split test decode.max_extra_len=4 2>&1",
           nmt, dir);
  rc = nmt_th_capture(cmd, out, sizeof out);
  snprintf(p, sizeof p, "%s/out/test.de", dir);
  if (rc != 0 || !strstr(out, "\nBLEU  = ") || !strstr(out, "\nchrF2 = ") || !strstr(out, p))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", cmd, rc, out);
}

NMT_TEST(prepare_wmt14_refusals_name_the_input) {
  char out[16384], cmd[8192], p[1200];
  const char *dir = nmt_test_tmpdir();
  NMT_ASSERT(write_downloads(dir));
  /* The recipe itself loads, every key in the schema, at the paper's batch on one GPU. */
  nmt_config cfg;
  NMT_ASSERT_OK(nmt_config_load("conf/wmt14-en-de-base.ini", NULL, 0, &cfg));
  NMT_ASSERT(cfg.model_vocab == 32000 && cfg.model_d_model == 512 && cfg.model_d_ff == 2048 &&
             cfg.model_enc_layers == 6 && cfg.model_dec_layers == 6 && cfg.model_n_heads == 8);
  NMT_ASSERT_EQ_INT(cfg.data_max_tokens * cfg.train_accum_steps, 25000);

  /* News Commentary not downloaded: exit 2, naming the file and where to get it. */
  snprintf(cmd, sizeof cmd, "mkdir -p %s/nc && mv %s/dl/training/news-commentary-v9.de-en.* "
           "%s/nc/", dir, dir, dir);
  NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 0);
  char base[4096];
  snprintf(base, sizeof base, "tools/prepare-wmt14.sh --raw %s/dl --out %s/out --vocab 60", dir,
           dir);
  snprintf(cmd, sizeof cmd, "%s --valid %s/nt/newstest2013 --test %s/nt/newstest2014 2>&1", base,
           dir, dir);
  int rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 2 || !strstr(out, "missing news-commentary-v9.de-en.en") ||
      !strstr(out, "https://www.statmt.org/wmt14/training-parallel-nc-v9.tgz"))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 2: %s", cmd, rc, out);
  snprintf(cmd, sizeof cmd, "mv %s/nc/* %s/dl/training/", dir, dir);
  NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 0);

  /* A split's file missing: exit 2, naming it. */
  snprintf(cmd, sizeof cmd, "rm %s/nt/newstest2014.de && %s --valid %s/nt/newstest2013 --test "
           "%s/nt/newstest2014 2>&1", dir, base, dir, dir);
  rc = nmt_th_capture(cmd, out, sizeof out);
  snprintf(p, sizeof p, "--test %s/nt/newstest2014: missing file %s/nt/newstest2014.de", dir, dir);
  if (rc != 2 || !strstr(out, p))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 2: %s", cmd, rc, out);

  /* Offline, no newstest2014 given: sacreBLEU (a stand-in that fails as it does without a
   * network) cannot fetch it, and the error says to pass --test. */
  snprintf(cmd, sizeof cmd, "mkdir -p %s/bin && printf '#!/bin/sh\\necho \"urllib.error."
           "URLError: <urlopen error [Errno -2] Name or service not known>\" >&2\\nexit 1\\n' > "
           "%s/bin/sacrebleu && chmod +x %s/bin/sacrebleu && PATH=%s/bin:$PATH %s --valid "
           "%s/nt/newstest2013 2>&1", dir, dir, dir, dir, base, dir);
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 2 || !strstr(out, "sacrebleu could not fetch wmt14/full") ||
      !strstr(out, "Name or service not known") || !strstr(out, "pass --test PREFIX"))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 2: %s", cmd, rc, out);
  snprintf(p, sizeof p, "%s/out/raw/newstest2014.en", dir);
  NMT_ASSERT(access(p, F_OK) != 0);

  /* A corpus whose sides differ in length: exit 3, naming both files. */
  snprintf(cmd, sizeof cmd, "printf '\\nextra\\n' >> %s/dl/training/europarl-v7.de-en.de && "
           "%s --valid %s/nt/newstest2013 --test %s/nt/newstest2013 2>&1", dir, base, dir, dir);
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 3 || !strstr(out, "europarl-v7.de-en: line counts differ") ||
      !strstr(out, "europarl-v7.de-en.de has 301"))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 3: %s", cmd, rc, out);
}
