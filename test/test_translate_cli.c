/* test/test_translate_cli.c — what `nmt translate` prints and reserves, end to end with the
 * real binary on a tiny model trained for two steps on the Bible corpus (issue 38's new-user
 * trial found each of these silent):
 *
 * n-best and scores (src/engine/translate.c, docs/decoding.md "n-best and scores"): the Moses /
 * Marian n-best form "i ||| hypothesis ||| F0= log p ||| score", where score is the
 * length-normalised score the search ranks by and F0 the raw log-probability, so the lines'
 * order follows the last field. --nbest ranked by the normalised score but printed only log p,
 * so the order did not follow the numbers. A strong length penalty (alpha 2), --ids input.
 *
 * The decoder's size (src/engine/translate_batch.c, nmt__rig_prepare): decode.beam rows per
 * sentence, for min(lines, decode.batch_sentences) sentences, as the decoder's debug line
 * reports before it allocates (src/model/decode.c). decode.beam = 1024, the documented
 * maximum, asked for 54.8 GB to translate 3 sentences: the decoder was sized for
 * decode.batch_sentences (64) x beam rows whatever the input. Beam 64 on one line: 64 rows,
 * not 4,096.
 *
 * Invalid UTF-8 input (docs/decoding.md): accepted without a word; now a warning per line
 * naming file, line and byte, and a count at the end. */
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

/* The test's files in its directory: DIR/out and DIR/err (a command's stdout and stderr) and
 * the checkpoint of the tiny model, trained here into DIR/run. Returns 1, or 0 after failing
 * the test (no prepared corpus, or the training failed). */
static int tiny_model(const char *dir, char out[600], char err[600], char ckpt[600]) {
  if (access("data/bible/spm.model", R_OK) || access("data/bible/train.shard", R_OK)) {
    nmt_test_fail(__FILE__, __LINE__, "data/bible missing: run tools/prepare-bible.sh");
    return 0;
  }
  char cmd[4096];
  snprintf(out, 600, "%s/out", dir);
  snprintf(err, 600, "%s/err", dir);
  snprintf(ckpt, 600, "%s/run/checkpoints/step_2.ckpt", dir);
  snprintf(cmd, sizeof cmd, "%s/nmt train conf/bible-small.ini run.out_dir=%s/run " TINY,
           nmt_test_build_dir(), dir);
  const int rc = sh(cmd, NULL, err);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d", cmd, rc);
  return rc == 0;
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
  const char *dir = nmt_test_tmpdir(), *nmt = nmt_test_build_dir();
  char cmd[4096], ids[600], out[600], err[600], ckpt[600];
  snprintf(ids, sizeof ids, "%s/in.ids", dir);
  if (!tiny_model(dir, out, err, ckpt)) return;
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

NMT_TEST(translate_sizes_the_beam_for_its_lines) {
  const char *dir = nmt_test_tmpdir(), *nmt = nmt_test_build_dir();
  char cmd[4096], ids[600], out[600], err[600], ckpt[600];
  snprintf(ids, sizeof ids, "%s/in.ids", dir);
  if (!tiny_model(dir, out, err, ckpt)) return;
  FILE *f = fopen(ids, "w");
  NMT_ASSERT(f);
  fputs("25 100 7\n", f);
  fclose(f);
  snprintf(cmd, sizeof cmd, "NMT_LOG=debug %s/nmt translate %s --ids --input %s decode.beam=64 "
           "decode.max_extra_len=2 parallel.device=cpu", nmt, ckpt, ids);
  NMT_ASSERT_EQ_INT(sh(cmd, out, err), 0);
  char *e = nmt_th_read_file(err, NULL), *o = nmt_th_read_file(out, NULL);
  NMT_ASSERT(e && o);
  /* The first reservation's line (the only one: every batch then fits). */
  const char *at = strstr(e, "hypothesis rows");
  char line[512] = "";
  if (at) {
    const char *start = at;
    while (start > e && start[-1] != '\n') start--;
    snprintf(line, sizeof line, "%.*s", (int)strcspn(start, "\n"), start);
  }
  printf("# %s\n", line);
  if (!strstr(line, "for 64 hypothesis rows (1 sentences)"))
    nmt_test_fail(__FILE__, __LINE__, "no \"for 64 hypothesis rows (1 sentences)\":\n%s", e);
  NMT_ASSERT_EQ_INT(nmt_th_count(o, "\n"), 1);
  free(e), free(o);
}

NMT_TEST(translate_warns_on_invalid_utf8) {
  const char *dir = nmt_test_tmpdir(), *nmt = nmt_test_build_dir();
  char cmd[4096], in[600], out[600], err[600], ckpt[600];
  snprintf(in, sizeof in, "%s/in.txt", dir);
  if (!tiny_model(dir, out, err, ckpt)) return;
  FILE *f = fopen(in, "wb");
  NMT_ASSERT(f);
  /* 1 and 7 are valid (2-, 3- and 4-byte sequences); 2..6 are not: a stray byte, an overlong
   * '/', a UTF-16 surrogate, a sequence cut by the line's end, a code point past U+10FFFF. */
  fputs("In the beginning \xc3\xb1 \xe2\x82\xac \xf0\x9f\x98\x80\n"
        "God \xff created\n"
        "the \xc0\xaf heaven\n"
        "and \xed\xa0\x80 the\n"
        "earth \xe2\x82\n"
        "x \xf4\x90\x80\x80 y\n"
        "And the earth was without form.\n",
        f);
  fclose(f);
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --input %s decode.max_extra_len=2", nmt, ckpt,
           in);
  NMT_ASSERT_EQ_INT(sh(cmd, out, err), 0);
  char *o = nmt_th_read_file(out, NULL), *e = nmt_th_read_file(err, NULL);
  NMT_ASSERT(o && e);
  NMT_ASSERT_EQ_INT(nmt_th_count(o, "\n"), 7);
  printf("# stderr:\n%s", e);
  char want[700];
  const int bad[] = {2, 3, 4, 5, 6}, offset[] = {5, 5, 5, 7, 3};
  for (int i = 0; i < 5; i++) {
    snprintf(want, sizeof want, "%s:%d: invalid UTF-8 at byte %d", in, bad[i], offset[i]);
    if (!strstr(e, want)) {
      nmt_test_fail(__FILE__, __LINE__, "stderr lacks \"%s\"", want);
      free(o), free(e);
      return;
    }
  }
  snprintf(want, sizeof want, "%s:1:", in);
  NMT_ASSERT(!strstr(e, want));
  snprintf(want, sizeof want, "%s:7:", in);
  NMT_ASSERT(!strstr(e, want));
  NMT_ASSERT(strstr(e, "5 input lines were not valid UTF-8") != NULL);
  free(o), free(e);
}
