/* test/test_translate_beam_memory.c — `nmt translate` sizes its decoder for the lines it has
 * (src/engine/translate_batch.c, nmt__rig_prepare): decode.beam rows per sentence, for
 * min(lines, decode.batch_sentences) sentences, as the decoder's debug line reports before
 * it allocates (src/model/decode.c).
 *
 * Issue 38: decode.beam = 1024, the documented maximum, asked for 54.8 GB to translate 3
 * sentences: the decoder was sized for decode.batch_sentences (64) x beam rows whatever the
 * input. End to end on a tiny model trained for two steps on the Bible corpus, beam 64 on one
 * line: 64 rows, not 4,096. */
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

NMT_TEST(translate_sizes_the_beam_for_its_lines) {
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
