/* test_eval_io.c — `nmt eval --src --ref`'s inputs and outputs: a reference from a pipe
 * (sacreBLEU's idiom `--ref <(sacrebleu -t wmt14 -l en-de --echo ref)`), empty texts and line
 * counts that differ (refused before decoding), and the .hyp and sacreBLEU report written
 * whole or not at all.
 *
 * A tiny model (vocab NMT_TH_VOCAB = 40) trained for two steps on the synthetic shard, and a
 * character SentencePiece model of exactly 40 pieces (a-z, 0-8, the word boundary and the four
 * specials) trained by spm_train on text made of those characters. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "test.h"

typedef struct {
  char dir[512], ini[600], spm[600], src[600], ref[600], hyp[900], rep[1000];
} setup;

/* Runs `bash -c CMD` (process substitution needs bash), stdout and stderr into out; the exit
 * code. */
static int run_bash(const char *cmd, char *out, size_t n) {
  char full[8192];
  snprintf(full, sizeof full, "bash -c '%s' 2>&1", cmd);
  return nmt_th_capture(full, out, n);
}

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (f) {
    fputs(text, f);
    fclose(f);
  }
}

/* Lines of words over a-z and 0-8 (deterministic). */
static void write_words(const char *path, int lines, unsigned seed) {
  static const char ch[] = "abcdefghijklmnopqrstuvwxyz012345678";
  FILE *f = fopen(path, "w");
  if (!f) return;
  for (int i = 0; i < lines; i++) {
    int words = 2 + (int)(seed % 3);
    for (int w = 0; w < words; w++) {
      int len = 1 + (int)((seed >> 3) % 4);
      for (int c = 0; c < len; c++) {
        seed = seed * 1103515245u + 12345u;
        fputc(ch[(seed >> 8) % (sizeof ch - 1)], f);
      }
      fputc(w + 1 < words ? ' ' : '\n', f);
    }
  }
  fclose(f);
}

/* The run, its checkpoint and the SentencePiece model; 0 (and a skip or failure) if not. */
static int make_setup(setup *s) {
  if (system("command -v spm_train >/dev/null 2>&1") != 0) {
    nmt_test_skip("no spm_train (tools/install-deps.sh installs SentencePiece)");
    return 0;
  }
  snprintf(s->dir, sizeof s->dir, "%s", nmt_test_tmpdir());
  char shard[600], out[600], cmd[4096], log[8192], text[600];
  snprintf(shard, sizeof shard, "%s/syn.shard", s->dir);
  snprintf(out, sizeof out, "%s/run", s->dir);
  snprintf(s->ini, sizeof s->ini, "%s/tiny.ini", s->dir);
  snprintf(s->spm, sizeof s->spm, "%s/sp.model", s->dir);
  snprintf(s->src, sizeof s->src, "%s/s.txt", s->dir);
  snprintf(s->ref, sizeof s->ref, "%s/r.txt", s->dir);
  snprintf(text, sizeof text, "%s/spm.txt", s->dir);
  if (nmt_th_write_synthetic(shard, 64, 9) != NMT_OK) return 0;
  char extra[1024];
  snprintf(extra, sizeof extra,
           "[data]\nspm_model = \"%s\"\n[model]\nenc_layers = 1\ndec_layers = 1\n"
           "[decode]\nmax_extra_len = 4\n[parallel]\ndevices = 1\n",
           s->spm);
  if (nmt_th_write_ini(s->ini, out, shard, 2, extra) != 0) return 0;
  write_words(text, 300, 1);
  snprintf(cmd, sizeof cmd,
           "spm_train --input=%s --model_prefix=%s/sp --vocab_size=%d --model_type=char "
           "--character_coverage=1.0 --pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3 "
           ">%s/spm.log 2>&1 && %s/nmt train %s",
           text, s->dir, NMT_TH_VOCAB, s->dir, nmt_test_build_dir(), s->ini);
  if (run_bash(cmd, log, sizeof log) != 0) {
    nmt_test_fail(__FILE__, __LINE__, "setup: %s", log);
    return 0;
  }
  write_words(s->src, 5, 2);
  write_words(s->ref, 5, 3);
  snprintf(s->hyp, sizeof s->hyp, "%s/eval/s.txt.step_2.beam4.hyp", out);
  snprintf(s->rep, sizeof s->rep, "%s.sacrebleu.txt", s->hyp);
  return 1;
}

static int have_sacrebleu(void) {
  return system("python3 -c \"import sacrebleu\" >/dev/null 2>&1") == 0;
}

/* `--ref <(cat r.txt)`: nmt read the pipe to count its lines and sacreBLEU found it empty
 * ("streams have different lengths"), with advice to install sacreBLEU. */
NMT_TEST(eval_io_reference_from_a_pipe) {
  setup s;
  if (!make_setup(&s)) return;
  if (!have_sacrebleu()) NMT_SKIP("no sacrebleu for python3 (tools/install-deps.sh --bleu)");
  char cmd[4096], out[16384];
  snprintf(cmd, sizeof cmd, "%s/nmt eval %s --src %s --ref <(cat %s)", nmt_test_build_dir(),
           s.ini, s.src, s.ref);
  int rc = run_bash(cmd, out, sizeof out);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "exit %d: %s", rc, out);
  NMT_ASSERT_EQ_INT(rc, 0);
  NMT_ASSERT(strstr(out, "\nBLEU  = ") != NULL);
  /* The same scores as from the file itself. */
  char again[16384];
  snprintf(cmd, sizeof cmd, "%s/nmt eval %s --src %s --ref %s", nmt_test_build_dir(), s.ini,
           s.src, s.ref);
  NMT_ASSERT_EQ_INT(run_bash(cmd, again, sizeof again), 0);
  const char *a = strstr(out, "\nBLEU  = "), *b = strstr(again, "\nBLEU  = ");
  NMT_ASSERT(b && !strncmp(a, b, strcspn(a + 1, "\n") + 1));
}

/* Empty texts and texts of different lengths are refused before any decoding, naming the
 * files; no advice to install sacreBLEU. */
NMT_TEST(eval_io_texts_checked_before_decoding) {
  setup s;
  if (!make_setup(&s)) return;
  char empty[600], short_ref[600], cmd[4096], out[16384];
  snprintf(empty, sizeof empty, "%s/empty.txt", s.dir);
  snprintf(short_ref, sizeof short_ref, "%s/short.txt", s.dir);
  write_text(empty, "");
  write_words(short_ref, 3, 4);
  const char *refs[] = {short_ref, empty};
  for (int i = 0; i < 2; i++) {
    snprintf(cmd, sizeof cmd, "%s/nmt eval %s --src %s --ref %s", nmt_test_build_dir(), s.ini,
             s.src, refs[i]);
    int rc = run_bash(cmd, out, sizeof out);
    if (rc != 3 || !strstr(out, refs[i]) || strstr(out, "decoded ") ||
        strstr(out, "install-deps"))
      nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", refs[i], rc, out);
    if (nmt_test_failed()) return;
  }
  NMT_ASSERT(strstr(out, "empty") != NULL);
  snprintf(cmd, sizeof cmd, "%s/nmt eval %s --src %s --ref %s", nmt_test_build_dir(), s.ini,
           empty, empty);
  int rc = run_bash(cmd, out, sizeof out);
  if (rc != 3 || !strstr(out, empty) || strstr(out, "install-deps"))
    nmt_test_fail(__FILE__, __LINE__, "exit %d: %s", rc, out);
}

/* An eval that fails after decoding (here sacreBLEU fails: a python3 that exits 1 comes first
 * on PATH) leaves the .hyp and report of the previous eval as they were, and no partial
 * files; the hypotheses used to be overwritten and the report truncated. */
NMT_TEST(eval_io_outputs_replaced_only_on_success) {
  setup s;
  if (!make_setup(&s)) return;
  if (!have_sacrebleu()) NMT_SKIP("no sacrebleu for python3 (tools/install-deps.sh --bleu)");
  char cmd[4096], out[16384];
  snprintf(cmd, sizeof cmd, "%s/nmt eval %s --src %s --ref %s", nmt_test_build_dir(), s.ini,
           s.src, s.ref);
  int rc = run_bash(cmd, out, sizeof out);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "exit %d: %s", rc, out);
  NMT_ASSERT_EQ_INT(rc, 0);
  char *hyp0 = nmt_th_read_file(s.hyp, NULL), *rep0 = nmt_th_read_file(s.rep, NULL);
  NMT_ASSERT(hyp0 && rep0 && strstr(rep0, "BLEU"));
  /* Another source of the same name (so the same .hyp), and a sacreBLEU that fails. */
  char other[600], bin[600];
  snprintf(other, sizeof other, "%s/other", s.dir);
  snprintf(bin, sizeof bin, "%s/bin", s.dir);
  NMT_ASSERT(mkdir(other, 0755) == 0 && mkdir(bin, 0755) == 0);
  snprintf(cmd, sizeof cmd, "%s/s.txt", other);
  write_words(cmd, 5, 77);
  snprintf(cmd, sizeof cmd, "%s/python3", bin);
  write_text(cmd, "#!/bin/sh\necho \"sacreBLEU: broken on purpose\"\nexit 1\n");
  NMT_ASSERT(chmod(cmd, 0755) == 0);
  snprintf(cmd, sizeof cmd, "PATH=%s:$PATH %s/nmt eval %s --src %s/s.txt --ref %s", bin,
           nmt_test_build_dir(), s.ini, other, s.ref);
  rc = run_bash(cmd, out, sizeof out);
  if (rc != 6 || !strstr(out, "broken on purpose") || strstr(out, "install-deps"))
    nmt_test_fail(__FILE__, __LINE__, "exit %d: %s", rc, out);
  char *hyp1 = nmt_th_read_file(s.hyp, NULL), *rep1 = nmt_th_read_file(s.rep, NULL);
  int same = hyp1 && rep1 && !strcmp(hyp0, hyp1) && !strcmp(rep0, rep1);
  free(hyp0), free(rep0), free(hyp1), free(rep1);
  NMT_ASSERT(same);
  char partial[1100];
  snprintf(partial, sizeof partial, "%s.partial", s.hyp);
  NMT_ASSERT(access(partial, F_OK) != 0);
}
