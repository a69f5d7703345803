/* test_cli_errors.c — inputs of the wrong kind on the nmt command line: a corpus or an empty
 * file where a checkpoint or config is expected, a key set twice in an INI file, arguments
 * that are not understood; each is one message naming the file, key or argument (README
 * "Exit codes"), never a line per corpus line, an error printed twice or a silent choice. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "test.h"

/* Runs build/nmt with `args` (shell words), stderr into err (stdout dropped); the exit code. */
static int run_err(const char *args, char *err, size_t n) {
  char cmd[4400];
  snprintf(cmd, sizeof cmd, "%s/nmt %s 2>&1 >/dev/null", nmt_test_build_dir(), args);
  return nmt_th_capture(cmd, err, n);
}

static int lines_of(const char *s) { return nmt_th_count(s, "\n"); }

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (f) {
    fputs(text, f);
    fclose(f);
  }
}

/* Fails the test with the whole stderr when cond is false. */
#define EXPECT(cond, err)                                                            \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      nmt_test_fail(__FILE__, __LINE__, "%s; stderr:\n%s", #cond, err);              \
      return;                                                                        \
    }                                                                                \
  } while (0)

/* A 20,000-line corpus given where the checkpoint or config goes: one message naming the file
 * and its first line, not two iniparser lines per corpus line. */
NMT_TEST(cli_errors_corpus_as_checkpoint) {
  const char *dir = nmt_test_tmpdir();
  char corpus[512], args[1024], err[16384];
  snprintf(corpus, sizeof corpus, "%s/train.en", dir);
  FILE *f = fopen(corpus, "w");
  NMT_ASSERT(f != NULL);
  for (int i = 0; i < 20000; i++) fprintf(f, "In the beginning God created the heaven %d\n", i);
  fclose(f);
  snprintf(args, sizeof args, "translate %s --ids --input /dev/null", corpus);
  int rc = run_err(args, err, sizeof err);
  EXPECT(rc == 2, err);
  EXPECT(lines_of(err) <= 3, err);
  EXPECT(strstr(err, corpus) && strstr(err, "line 1"), err);
  EXPECT(!strstr(err, "iniparser"), err);
  snprintf(args, sizeof args, "config --dump %s", corpus);
  rc = run_err(args, err, sizeof err);
  EXPECT(rc == 2 && lines_of(err) <= 3 && strstr(err, corpus), err);
}

/* An empty file: named, with what it should have been; not "no valid checkpoint in
 * runs/default/checkpoints" from a config of all defaults. */
NMT_TEST(cli_errors_empty_file_named) {
  const char *dir = nmt_test_tmpdir();
  char path[512], args[1024], err[8192];
  const char *names[] = {"empty.ckpt", "empty.ini", "empty"};
  for (int i = 0; i < 3; i++) {
    snprintf(path, sizeof path, "%s/%s", dir, names[i]);
    write_text(path, "");
    snprintf(args, sizeof args, "translate %s --ids --input /dev/null", path);
    int rc = run_err(args, err, sizeof err);
    EXPECT(rc == (i == 0 ? 7 : 2), err);
    EXPECT(strstr(err, path) != NULL, err);
    EXPECT(!strstr(err, "runs/default"), err);
    EXPECT(nmt_th_count(err, "[nmt] error:") == 1, err);
  }
}

/* A key set twice (here with another case and spacing, as iniparser folds them) is refused,
 * naming the file, section, key and both lines; iniparser silently kept the last. */
NMT_TEST(cli_errors_duplicate_key_refused) {
  const char *dir = nmt_test_tmpdir();
  char ini[512], args[1024], err[8192];
  snprintf(ini, sizeof ini, "%s/dup.ini", dir);
  write_text(ini, "[train]\nmax_steps = 5\n; the same key again below\n[model]\nd_model = 16\n"
                  "[Train]\nMax_Steps=7\n");
  snprintf(args, sizeof args, "config --dump %s", ini);
  int rc = run_err(args, err, sizeof err);
  EXPECT(rc == 2, err);
  EXPECT(strstr(err, ini) && strstr(err, "[train] max_steps") && strstr(err, "line 2") &&
             strstr(err, "line 7"),
         err);
  EXPECT(nmt_th_count(err, "[nmt] error:") == 1, err);
  /* The same section twice with different keys is fine. */
  write_text(ini, "[train]\nmax_steps = 5\n[model]\nd_model = 16\n[train]\nlog_every = 2\n");
  rc = run_err(args, err, sizeof err);
  EXPECT(rc == 0, err);
}

/* A value whose quote is never closed, or with text after its closing quote, is refused
 * naming the file and the line (iniparser read `"runs/x` as if closed, and dropped what
 * follows `"runs/x"`); a closed quote followed by a comment, and quotes inside an unquoted
 * value's comment, are fine. */
NMT_TEST(cli_errors_unclosed_quote_refused) {
  const char *dir = nmt_test_tmpdir();
  char ini[512], args[1024], err[8192];
  snprintf(ini, sizeof ini, "%s/q.ini", dir);
  snprintf(args, sizeof args, "config --dump %s", ini);
  const char *bad[] = {"out_dir = \"runs/x", "out_dir = 'runs/x", "out_dir = \"runs/x\" junk",
                       "out_dir=\""};
  for (int i = 0; i < 4; i++) {
    char text[256];
    snprintf(text, sizeof text, "[train]\nmax_steps = 5\n[run]\n%s\nseed = 3\n", bad[i]);
    write_text(ini, text);
    int rc = run_err(args, err, sizeof err);
    EXPECT(rc == 2, err);
    EXPECT(strstr(err, ini) && strstr(err, "line 4") && strstr(err, "quote"), err);
    EXPECT(nmt_th_count(err, "[nmt] error:") == 1, err);
  }
  write_text(ini, "[run]\nout_dir = \"runs/x\" ; where \"it\" goes\nseed = 3 ; \"three\"\n");
  int rc = run_err(args, err, sizeof err);
  EXPECT(rc == 0, err);
}

/* Arguments that are not understood are named. */
NMT_TEST(cli_errors_name_the_argument) {
  const char *dir = nmt_test_tmpdir();
  char ini[512], args[1024], err[8192];
  snprintf(ini, sizeof ini, "%s/a.ini", dir);
  write_text(ini, "[train]\nmax_steps = 5\n");
  struct {
    const char *fmt, *need;
  } cases[] = {
      {"train %s second.ini", "second.ini: cannot open config"}, /* a second CONFIG */
      {"train %s max_steps=5", "\"max_steps=5\""},
      {"train %s --frob", "\"--frob\""},
      {"config --dump %s max_steps=5", "\"max_steps=5\""},
      {"average x.ckpt --frob --output %s", "\"--frob\""},
      {"frobnicate %s", "\"frobnicate\""},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    snprintf(args, sizeof args, cases[i].fmt, ini);
    int rc = run_err(args, err, sizeof err);
    EXPECT(rc == 2, err);
    EXPECT(strstr(err, cases[i].need) != NULL, err);
  }
}

/* Errors the library logs where they arise and a caller then wrapped were printed twice: eval
 * --split without the split's raw text, average of checkpoints of two models. */
NMT_TEST(cli_errors_printed_once) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], ini[512], ini2[512], out[512], args[2048], err[8192];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 64, 5));
  snprintf(ini, sizeof ini, "%s/a.ini", dir);
  snprintf(out, sizeof out, "%s/a", dir);
  char extra[1024];
  snprintf(extra, sizeof extra, "[data]\ntest = \"%s\"\n[parallel]\ndevices = 1\n", shard);
  NMT_ASSERT(nmt_th_write_ini(ini, out, shard, 2, extra) == 0);
  snprintf(args, sizeof args, "train %s", ini);
  int rc = run_err(args, err, sizeof err);
  EXPECT(rc == 0, err);
  snprintf(args, sizeof args, "eval %s --split test", ini);
  rc = run_err(args, err, sizeof err);
  EXPECT(rc == 3, err);
  EXPECT(nmt_th_count(err, "[nmt] error:") == 1, err);
  EXPECT(strstr(err, "--src TEXT --ref TEXT") != NULL, err);

  snprintf(ini2, sizeof ini2, "%s/b.ini", dir);
  snprintf(out, sizeof out, "%s/b", dir);
  NMT_ASSERT(nmt_th_write_ini(ini2, out, shard, 2,
                              "[model]\nd_model = 32\n[parallel]\ndevices = 1\n") == 0);
  snprintf(args, sizeof args, "train %s", ini2);
  rc = run_err(args, err, sizeof err);
  EXPECT(rc == 0, err);
  snprintf(args, sizeof args, "average %s/a/checkpoints/step_2.ckpt %s/b/checkpoints/step_2.ckpt "
           "--output %s/avg.ckpt", dir, dir, dir);
  rc = run_err(args, err, sizeof err);
  EXPECT(rc == 7, err);
  EXPECT(nmt_th_count(err, "[nmt] error:") == 1, err);
  EXPECT(strstr(err, "d_model 32") != NULL, err);
}

/* Issue 38: a list of GPU indices with CPU workers ran as many workers, silently. CPU workers
 * have no index: the list is refused (exit 2), naming the key, the value and the count to
 * write instead. */
NMT_TEST(cli_errors_gpu_list_on_cpu) {
  char args[1024], err[8192];
  snprintf(args, sizeof args, "config --dump conf/bible-small.ini parallel.device=cpu "
                              "parallel.devices=0,2");
  int rc = run_err(args, err, sizeof err);
  EXPECT(rc == 2, err);
  EXPECT(strstr(err, "[parallel] devices") && strstr(err, "0,2") && strstr(err, "cpu") &&
             strstr(err, "devices = 2"),
         err);
  EXPECT(nmt_th_count(err, "[nmt] error:") == 1, err);
  /* A count is what CPU workers take. */
  snprintf(args, sizeof args, "config --dump conf/bible-small.ini parallel.device=cpu "
                              "parallel.devices=2");
  rc = run_err(args, err, sizeof err);
  EXPECT(rc == 0, err);
}
