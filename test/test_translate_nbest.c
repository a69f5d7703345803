/* test/test_translate_nbest.c — what `nmt translate --nbest K` and `--scores` print (src/engine/
 * translate.c, docs/decoding.md "n-best and scores"): the Moses / Marian n-best form
 * "i ||| hypothesis ||| F0= log p ||| score", where score is the length-normalised score the
 * search ranks by and F0 the raw log-probability, so the lines' order follows the last field.
 *
 * Issue 38: --nbest ranked by the normalised score but printed only log p, so the order did
 * not follow the numbers. End to end with the real binary on a tiny model trained for two
 * steps on the Bible corpus, a strong length penalty (alpha 2) and --ids input. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "test.h"

#define TINY                                                                                 \
  "model.d_model=16 model.n_heads=2 model.d_ff=32 model.enc_layers=1 model.dec_layers=1 "    \
  "model.max_positions=77 train.max_steps=2 train.save_every=0 train.valid_every=0 "         \
  "data.max_tokens=256 data.max_len=64 parallel.devices=1 parallel.device=cpu"

static int sh(const char *cmd, const char *out_path, const char *err_path) {
  char full[8192];
  snprintf(full, sizeof full, "%s >%s 2>%s", cmd, out_path ? out_path : "/dev/null",
           err_path ? err_path : "/dev/null");
  fflush(stdout);
  int st = system(full);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* One line's trailing " ||| F0= LOGP ||| SCORE"; returns 1 when both parse. */
static int parse_tail(const char *line, double *logp, double *score) {
  const char *f0 = strstr(line, " ||| F0= ");
  if (!f0) return 0;
  char *end;
  *logp = strtod(f0 + 9, &end);
  if (end == f0 + 9 || strncmp(end, " ||| ", 5)) return 0;
  const char *s = end + 5;
  *score = strtod(s, &end);
  return end != s && *end == 0;
}

NMT_TEST(translate_nbest_prints_the_ranking_score) {
  if (access("data/bible/spm.model", R_OK) || access("data/bible/train.shard", R_OK)) {
    nmt_test_fail(__FILE__, __LINE__, "data/bible missing: run tools/prepare-bible.sh");
    return;
  }
  const char *dir = nmt_test_tmpdir(), *nmt = nmt_test_build_dir();
  char cmd[4096], ids[600], out[600], err[600], ckpt[600];
  snprintf(ids, sizeof ids, "%s/in.ids", dir);
  snprintf(out, sizeof out, "%s/out", dir);
  snprintf(err, sizeof err, "%s/err", dir);
  snprintf(ckpt, sizeof ckpt, "%s/run/checkpoints/step_2.ckpt", dir);
  snprintf(cmd, sizeof cmd, "%s/nmt train conf/bible-small.ini run.out_dir=%s/run " TINY, nmt,
           dir);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, err), 0);
  FILE *f = fopen(ids, "w");
  NMT_ASSERT(f);
  fputs("25 100 7\n9 9 9 9\n311 40 12 12 5\n", f);
  fclose(f);
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --ids --input %s decode.beam=6 "
           "decode.length_penalty=2 decode.max_extra_len=4 --nbest 6", nmt, ckpt, ids);
  NMT_ASSERT_EQ_INT(sh(cmd, out, err), 0);
  char *a = nmt_th_read_file(out, NULL);
  NMT_ASSERT(a);
  int k = 0, bad_order = 0, raw_order_differs = 0;
  long prev_i = -1;
  double prev_score = 0, prev_logp = 0;
  for (char *line = strtok(a, "\n"); line; line = strtok(NULL, "\n"), k++) {
    long i;
    int off = 0;
    double lp, sc;
    NMT_ASSERT(sscanf(line, "%ld ||| %n", &i, &off) == 1 && off > 0);
    if (!parse_tail(line, &lp, &sc)) {
      nmt_test_fail(__FILE__, __LINE__, "line \"%s\" lacks \" ||| F0= LOGP ||| SCORE\"", line);
      free(a);
      return;
    }
    /* alpha 2 > 0: lp(n) > 1, so score = log p / lp(n) lies in [log p, 0] */
    NMT_ASSERT(lp <= 0 && sc <= 0 && sc >= lp - 1e-3);
    if (i == prev_i) {
      bad_order += sc > prev_score + 1e-4;
      raw_order_differs += lp > prev_logp + 1e-4;
    }
    prev_i = i, prev_score = sc, prev_logp = lp;
  }
  free(a);
  printf("# %d lines; %d where log p rises within a sentence's list, %d where the score does\n",
         k, raw_order_differs, bad_order);
  NMT_ASSERT_EQ_INT(k, 18);
  NMT_ASSERT_EQ_INT(bad_order, 0);
  /* --scores: the one best, the same two fields. */
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --ids --input %s decode.length_penalty=2 "
           "decode.max_extra_len=4 --scores", nmt, ckpt, ids);
  NMT_ASSERT_EQ_INT(sh(cmd, out, err), 0);
  a = nmt_th_read_file(out, NULL);
  NMT_ASSERT(a);
  int lines = 0;
  for (char *line = strtok(a, "\n"); line; line = strtok(NULL, "\n"), lines++) {
    double lp, sc;
    NMT_ASSERT(parse_tail(line, &lp, &sc));
  }
  free(a);
  NMT_ASSERT_EQ_INT(lines, 3);
}
