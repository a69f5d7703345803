/* test/test_export_ct2.c — `nmt export --format ctranslate2` (src/engine/export_ct2.c,
 * tools/nmt_to_ct2.py): CTranslate2's greedy output on the 649 test verses is token-identical
 * to `nmt translate decode.beam=1`'s from the same checkpoint, its teacher-forced log p(y|x) of
 * nmt's outputs agrees with nmt's, an int8 export loads, translates and is under half the
 * size; and the refusals (README "Exit codes"): an existing OUT_DIR, --quantization without
 * ctranslate2, an unknown format or quantization, a missing python, converter or module (9).
 * test/ct2_greedy.py is CTranslate2's side. Skipped without python3's ctranslate2 and
 * sentencepiece modules (tools/install-deps.sh --bleu installs them). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "helpers.h"
#include "test.h"

/* The 200-step model: big enough for outputs that differ by sentence at their start and for
 * log-probabilities that depend on the source (the encoder's mapping), trained in ~13 s on 2
 * cores. Its greedy outputs mostly run to the length limit, so both decode up to MAX_OUT. */
#define MODEL                                                                                \
  "model.d_model=32 model.n_heads=2 model.d_ff=64 model.enc_layers=2 model.dec_layers=2 "    \
  "model.max_positions=64 model.dropout=0 data.max_len=48 data.max_tokens=1024 "             \
  "train.warmup_steps=40 train.save_every=0 train.valid_every=0 train.log_every=100 "        \
  "parallel.devices=2 parallel.device=cpu"
enum { MAX_OUT = 47 }; /* data.max_len - 1: nmt's longest output and its sources' cut */
#define LOGP_TOL 2e-3  /* nats per sentence, fp32 both sides (measured 6e-5) */

static int have_ct2(void) {
  char out[4096];
  return nmt_th_capture("python3 -c 'import ctranslate2, sentencepiece' 2>&1", out,
                        sizeof out) == 0;
}

static int need_data(void) {
  if (access("data/bible/spm.model", R_OK) == 0 && access("data/bible/train.shard", R_OK) == 0 &&
      access("data/bible/test.en", R_OK) == 0)
    return 1;
  nmt_test_fail(__FILE__, __LINE__, "data/bible missing: run tools/prepare-bible.sh (make test "
                "does) from the repository root");
  return 0;
}

/* Runs cmd through the shell with its output (stdout and stderr) in out; fails the test with
 * both when the exit code is not `want`. Returns 1 if it was. */
static int run_expect(const char *cmd, int want, char *out, size_t cap) {
  char full[8192 + 16];
  snprintf(full, sizeof full, "%s 2>&1", cmd);
  int rc = nmt_th_capture(full, out, cap);
  if (rc == want) return 1;
  nmt_test_fail(__FILE__, __LINE__, "`%s` exited %d, expected %d: %s", cmd, rc, want, out);
  return 0;
}

/* Trains conf/bible-small.ini with `ovr` for `steps` steps in dir/run; ckpt gets the path. */
static int train(const char *dir, const char *ovr, int steps, char *ckpt, size_t cap) {
  char cmd[4096], out[16384];
  snprintf(cmd, sizeof cmd, "%s/nmt train conf/bible-small.ini run.out_dir=%s/run %s "
           "train.max_steps=%d", nmt_test_build_dir(), dir, ovr, steps);
  snprintf(ckpt, cap, "%s/run/checkpoints/step_%d.ckpt", dir, steps);
  return run_expect(cmd, 0, out, sizeof out);
}

static long file_size(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 ? (long)st.st_size : -1;
}

/* Lines of a and b that differ (-1 if either is unreadable or their counts differ); *n the
 * lines of a. */
static long count_diff_lines(const char *a, const char *b, long *n) {
  FILE *fa = fopen(a, "r"), *fb = fopen(b, "r");
  long diff = 0;
  *n = 0;
  if (fa && fb) {
    char la[16384], lb[16384];
    for (;;) {
      char *ra = fgets(la, sizeof la, fa), *rb = fgets(lb, sizeof lb, fb);
      if (!ra || !rb) {
        if (ra || rb) diff = -1;
        break;
      }
      ++*n;
      diff += strcmp(la, lb) != 0;
    }
  } else diff = -1;
  if (fa) fclose(fa);
  if (fb) fclose(fb);
  return diff;
}

/* nmt translate --scores's lines "ids ||| F0= logp ||| score" split into ids (ids_path) and
 * logp (logp[i]); returns the count, -1 on a malformed file. */
static long split_scores(const char *path, const char *ids_path, double *logp, long cap) {
  FILE *f = fopen(path, "r"), *o = fopen(ids_path, "w");
  long n = 0;
  char line[16384];
  while (f && o && fgets(line, sizeof line, f) && n < cap) {
    char *sep = strstr(line, " ||| F0= ");
    if (!sep) sep = strstr(line, "||| F0= "); /* an empty output */
    if (!sep) break;
    logp[n++] = strtod(strstr(sep, "F0= ") + 4, NULL);
    *sep = 0;
    fprintf(o, "%s\n", line);
  }
  int ok = f && o && feof(f);
  if (f) fclose(f);
  if (o && fclose(o) != 0) ok = 0;
  return ok ? n : -1;
}

NMT_TEST(export_ct2_greedy_matches_nmt) {
  if (!have_ct2())
    NMT_SKIP("python3 cannot import ctranslate2 and sentencepiece (tools/install-deps.sh --bleu)");
  if (!need_data()) return;
  const char *dir = nmt_test_tmpdir(), *bin = nmt_test_build_dir();
  char ckpt[768], cmd[8192], out[16384];
  if (!train(dir, MODEL, 200, ckpt, sizeof ckpt)) return;
  /* nmt's input: the test verses as ids, cut to MAX_OUT ids as nmt cuts them, so that
   * CTranslate2 (which does not cut) sees the same sources. */
  snprintf(cmd, sizeof cmd, "spm_encode --model data/bible/spm.model --output_format=id "
           "<data/bible/test.en | awk '{ s = \"\"; for (i = 1; i <= NF && i <= %d; i++) "
           "s = s (i > 1 ? \" \" : \"\") $i; print s }' >%s/src.ids", MAX_OUT, dir);
  if (!run_expect(cmd, 0, out, sizeof out)) return;
  snprintf(cmd, sizeof cmd, "%s/nmt export %s %s/fp32 --format ctranslate2", bin, ckpt, dir);
  if (!run_expect(cmd, 0, out, sizeof out)) return;
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s decode.beam=1 decode.max_extra_len=100000 "
           "--ids --scores --input %s/src.ids --output %s/nmt.scores", bin, ckpt, dir, dir);
  if (!run_expect(cmd, 0, out, sizeof out)) return;
  char path[1024], ids[1024], ct2[1024];
  static double nmt_lp[4096];
  snprintf(path, sizeof path, "%s/nmt.scores", dir);
  snprintf(ids, sizeof ids, "%s/nmt.ids", dir);
  long n = split_scores(path, ids, nmt_lp, 4096);
  NMT_ASSERT_EQ_INT(n, 649);
  snprintf(cmd, sizeof cmd, "OMP_WAIT_POLICY=PASSIVE python3 test/ct2_greedy.py %s/fp32 "
           "%s/src.ids %d %s/ct2.ids %s %s/ct2.logp", dir, dir, MAX_OUT, dir, ids, dir);
  if (!run_expect(cmd, 0, out, sizeof out)) return;
  snprintf(ct2, sizeof ct2, "%s/ct2.ids", dir);
  long lines, diff = count_diff_lines(ids, ct2, &lines);
  printf("# greedy: %ld of %ld test verses token-identical\n", lines - diff, lines);
  NMT_ASSERT_EQ_INT(lines, 649);
  NMT_ASSERT_EQ_INT(diff, 0);
  /* teacher-forced: CTranslate2's log p of nmt's outputs against nmt's own */
  snprintf(path, sizeof path, "%s/ct2.logp", dir);
  FILE *f = fopen(path, "r");
  NMT_ASSERT(f);
  double worst = 0;
  long worst_i = -1, got = 0;
  for (double v; got < n && fscanf(f, "%lf", &v) == 1; got++)
    if (fabs(v - nmt_lp[got]) > worst) worst = fabs(v - nmt_lp[got]), worst_i = got;
  fclose(f);
  printf("# teacher-forced log p: max |ct2 - nmt| = %.2e nats (line %ld), tolerance %.0e\n",
         worst, worst_i, LOGP_TOL);
  NMT_ASSERT_EQ_INT(got, n);
  NMT_ASSERT(worst <= LOGP_TOL);
  NMT_ASSERT(nmt_lp[0] < -1.0); /* the scores are real log-probabilities, not zeros */

  /* int8: loads, translates every line, and is under half the fp32 model.bin */
  snprintf(cmd, sizeof cmd, "%s/nmt export %s %s/int8 --format ctranslate2 --quantization int8",
           bin, ckpt, dir);
  if (!run_expect(cmd, 0, out, sizeof out)) return;
  snprintf(cmd, sizeof cmd, "OMP_WAIT_POLICY=PASSIVE python3 test/ct2_greedy.py %s/int8 "
           "%s/src.ids %d %s/int8.ids && wc -l <%s/int8.ids", dir, dir, MAX_OUT, dir, dir);
  if (!run_expect(cmd, 0, out, sizeof out)) return;
  NMT_ASSERT_EQ_INT(atol(out), 649);
  char a[1024], b[1024];
  snprintf(a, sizeof a, "%s/fp32/model.bin", dir);
  snprintf(b, sizeof b, "%s/int8/model.bin", dir);
  long fp32 = file_size(a), int8 = file_size(b);
  printf("# model.bin: fp32 %ld bytes, int8 %ld bytes\n", fp32, int8);
  NMT_ASSERT(fp32 > 0 && int8 > 0 && 2 * int8 < fp32);
  snprintf(a, sizeof a, "%s/int8/spm.model", dir);
  NMT_ASSERT_EQ_INT(file_size(a), file_size("data/bible/spm.model"));
}

/* 1 if dir holds an entry whose name starts with prefix. */
static int has_entry(const char *dir, const char *prefix) {
  char cmd[2048], out[4096];
  snprintf(cmd, sizeof cmd, "ls -a %s", dir);
  if (nmt_th_capture(cmd, out, sizeof out) != 0) return 0;
  for (char *l = strtok(out, "\n"); l; l = strtok(NULL, "\n"))
    if (!strncmp(l, prefix, strlen(prefix))) return 1;
  return 0;
}

NMT_TEST(export_ct2_refusals) {
  if (!need_data()) return;
  const char *dir = nmt_test_tmpdir(), *bin = nmt_test_build_dir();
  char ckpt[768], cmd[8192], out[16384];
  if (!train(dir, "model.d_model=16 model.n_heads=2 model.d_ff=32 model.enc_layers=1 "
             "model.dec_layers=1 model.max_positions=77 data.max_tokens=256 data.max_len=64 "
             "train.save_every=0 train.valid_every=0 parallel.devices=1 parallel.device=cpu",
             2, ckpt, sizeof ckpt))
    return;
  const struct {
    const char *env, *args, *says;
    int code;
  } cases[] = {
      {"", "%s %s/x.safetensors --quantization int8", "--format ctranslate2 only", 2},
      {"", "%s %s/x.safetensors --overwrite", "--format ctranslate2 only", 2},
      {"", "%s %s/x --format onnx", "unknown --format \"onnx\"", 2},
      {"", "%s %s/x --format", "--format needs a value", 2},
      {"", "%s %s/x --format ctranslate2 --quantization int4", "unknown --quantization int4", 2},
      {"", "%s %s/run --format ctranslate2", "exists; choose another OUT_DIR", 2},
      {"", "%s %s/run --format ctranslate2 --overwrite", "not a previous", 2},
      {"NMT_PYTHON=/nonexistent", "%s %s/x --format ctranslate2",
       "tools/install-deps.sh --bleu, or pip install ctranslate2", 9},
      {"NMT_CT2_CONVERTER=/nonexistent/nmt_to_ct2.py", "%s %s/x --format ctranslate2",
       "NMT_CT2_CONVERTER", 9},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char args[2048];
    snprintf(args, sizeof args, cases[i].args, ckpt, dir);
    snprintf(cmd, sizeof cmd, "%s %s/nmt export %s", cases[i].env, bin, args);
    if (!run_expect(cmd, cases[i].code, out, sizeof out)) return;
    if (!strstr(out, cases[i].says)) {
      nmt_test_fail(__FILE__, __LINE__, "`%s` did not say \"%s\": %s", cmd, cases[i].says, out);
      return;
    }
  }
  NMT_ASSERT(strstr(out, "missing dependency (exit 9)") != NULL); /* the last case's report */
  /* nothing left behind: no OUT_DIR, no temporary directory beside it */
  char x[1024];
  snprintf(x, sizeof x, "%s/x", dir);
  NMT_ASSERT(access(x, F_OK) != 0);
  NMT_ASSERT(!has_entry(dir, "x.tmp-"));
  /* a python without the ctranslate2 module (Debian's own, where pip installed into another) */
  if (nmt_th_capture("/usr/bin/python3 -c 'import numpy' 2>&1 && "
                     "! /usr/bin/python3 -c 'import ctranslate2' 2>/dev/null", out,
                     sizeof out) == 0) {
    snprintf(cmd, sizeof cmd, "NMT_PYTHON=/usr/bin/python3 %s/nmt export %s %s/x --format "
             "ctranslate2", bin, ckpt, dir);
    if (!run_expect(cmd, 9, out, sizeof out)) return;
    NMT_ASSERT(strstr(out, "ctranslate2 missing") && strstr(out, "pip install ctranslate2"));
    NMT_ASSERT(!has_entry(dir, "x.tmp-") && access(x, F_OK) != 0);
  } else {
    printf("# no python3 without ctranslate2 at /usr/bin/python3: the module case not run\n");
  }
}
