/* test/test_translate_utf8.c — `nmt translate` on raw text that is not valid UTF-8 (src/engine/
 * translate.c; docs/decoding.md "Invalid UTF-8"): each such line is translated (its bad bytes
 * reach SentencePiece, which reads each bad byte as U+FFFD) and named in a warning with its
 * line number and 1-based byte, so the output keeps one line per input line and nothing is
 * silent.
 *
 * Issue 38: invalid UTF-8 was accepted silently. End to end with the real binary on a tiny
 * model trained for two steps on the Bible corpus. */
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

NMT_TEST(translate_warns_on_invalid_utf8) {
  if (access("data/bible/spm.model", R_OK) || access("data/bible/train.shard", R_OK)) {
    nmt_test_fail(__FILE__, __LINE__, "data/bible missing: run tools/prepare-bible.sh");
    return;
  }
  const char *dir = nmt_test_tmpdir(), *nmt = nmt_test_build_dir();
  char cmd[4096], in[600], out[600], err[600], ckpt[600];
  snprintf(in, sizeof in, "%s/in.txt", dir);
  snprintf(out, sizeof out, "%s/out", dir);
  snprintf(err, sizeof err, "%s/err", dir);
  snprintf(ckpt, sizeof ckpt, "%s/run/checkpoints/step_2.ckpt", dir);
  snprintf(cmd, sizeof cmd, "%s/nmt train conf/bible-small.ini run.out_dir=%s/run " TINY, nmt,
           dir);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, err), 0);
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
