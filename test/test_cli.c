/* test_cli.c — the nmt binary's exit codes and messages on bad input (README "Exit codes"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"

/* Runs build/nmt with `args` (shell words), capturing stderr; returns the exit code. */
static int run_nmt(const char *args, char *err, size_t n) {
  char cmd[4200];
  snprintf(cmd, sizeof cmd, "%s/nmt %s 2>&1 >/dev/null", nmt_test_build_dir(), args);
  FILE *p = popen(cmd, "r");
  if (!p) return -1;
  size_t k = fread(err, 1, n - 1, p);
  err[k] = 0;
  int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (f) {
    fputs(text, f);
    fclose(f);
  }
}

NMT_TEST(cli_bad_config_exit_2) {
  const char *dir = nmt_test_tmpdir();
  char ini[512], args[1024], err[4096];
  snprintf(ini, sizeof ini, "%s/bad.ini", dir);
  write_file(ini, "[train]\nmax_steps = 12x\n");
  snprintf(args, sizeof args, "train %s", ini);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  NMT_ASSERT(strstr(err, "max_steps") && strstr(err, "12x") && strstr(err, "bad.ini"));
  snprintf(args, sizeof args, "config --dump %s/missing.ini", dir);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  NMT_ASSERT(strstr(err, "missing.ini") != NULL);
  NMT_ASSERT_EQ_INT(run_nmt("frobnicate", err, sizeof err), 2);
  NMT_ASSERT_EQ_INT(run_nmt("train conf/bible-small.ini train.max_steps=-4", err, sizeof err), 2);
}

NMT_TEST(cli_damaged_shard_exit_3) {
  const char *dir = nmt_test_tmpdir();
  char src[512], tgt[512], shard[512], args[2048], err[4096];
  snprintf(src, sizeof src, "%s/a.ids", dir);
  snprintf(tgt, sizeof tgt, "%s/b.ids", dir);
  snprintf(shard, sizeof shard, "%s/x.shard", dir);
  write_file(src, "5 6 7\n8 9\n");
  write_file(tgt, "7 6 5\n9 8\n");
  snprintf(args, sizeof args, "shard --vocab 10 %s %s %s", src, tgt, shard);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 0);
  snprintf(args, sizeof args, "shard-info %s", shard);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 0);
  /* Truncate the shard by a few bytes: a data error, exit 3, naming the file. */
  FILE *f = fopen(shard, "r+");
  NMT_ASSERT(f != NULL);
  fseek(f, 0, SEEK_END);
  long size = ftell(f);
  fclose(f);
  NMT_ASSERT(truncate(shard, size - 3) == 0);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 3);
  NMT_ASSERT(strstr(err, "x.shard") != NULL);
  /* Training on it is the same data error. */
  snprintf(args, sizeof args, "train conf/bible-small.ini data.train=%s data.valid= run.out_dir=%s/run",
           shard, dir);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 3);
  /* An id >= vocab in the text is a data error naming file and line. */
  write_file(tgt, "7 6 5\n9 80\n");
  snprintf(args, sizeof args, "shard --vocab 10 %s %s %s", src, tgt, shard);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 3);
  NMT_ASSERT(strstr(err, "b.ids") != NULL);
}
