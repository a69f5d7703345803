/* test_rundir_safety.c — nothing a user does to a run directory or an output path loses their
 * work: a second `nmt train` without --resume refuses a run.out_dir that holds a previous run,
 * two trainings never write one run.out_dir at once (run.lock), an output that is one of the
 * command's inputs is refused, and --resume refuses a checkpoint without Adam moments. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "nmt/checkpoint.h"
#include "nmt/paths.h"
#include "test.h"

/* Runs build/nmt with `args` (shell words), capturing stderr; returns the exit code. */
static int run_nmt(const char *args, char *err, size_t n) {
  char cmd[4400];
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

/* dir/syn.shard and dir/run.ini (run.out_dir = dir/run, `steps` steps, nmt_th_write_ini's). */
static int tiny_ini(const char *dir, long steps, char *ini, size_t cap) {
  char shard[600], out[600];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(out, sizeof out, "%s/run", dir);
  snprintf(ini, cap, "%s/run.ini", dir);
  if (nmt_th_write_synthetic(shard, 64, 5) != NMT_OK) return -1;
  return nmt_th_write_ini(ini, out, shard, steps, NULL);
}

/* A file's bytes, or "" (caller frees). */
static char *slurp(const char *path) {
  char *t = nmt_th_read_file(path, NULL);
  return t ? t : calloc(1, 1);
}

/* An output that is one of the command's inputs is refused (exit 2, naming both arguments)
 * before anything is written: translate, average (also through a hard link and with --last),
 * export, shard, eval. */
NMT_TEST(paths_output_equal_input_refused) {
  const char *dir = nmt_test_tmpdir();
  char ini[700], args[3000], err[8192], ckpt[800], f[800], alias[800];
  NMT_ASSERT(tiny_ini(dir, 1, ini, sizeof ini) == 0);
  snprintf(args, sizeof args, "train %s", ini);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 0);
  snprintf(ckpt, sizeof ckpt, "%s/run/checkpoints/step_1.ckpt", dir);
  char *orig = slurp(ckpt);
  struct stat st0;
  NMT_ASSERT(stat(ckpt, &st0) == 0);

  snprintf(f, sizeof f, "%s/ids.txt", dir);
  write_file(f, "5 6 7\n8 9\n");
  snprintf(args, sizeof args, "translate %s --ids --input %s --output %s/../%s/ids.txt", ckpt,
           f, dir, strrchr(dir, '/') + 1);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  NMT_ASSERT(strstr(err, "--input") && strstr(err, "--output") && strstr(err, "same file"));
  char *text = slurp(f);
  NMT_ASSERT(!strcmp(text, "5 6 7\n8 9\n"));
  free(text);

  snprintf(args, sizeof args, "average %s --output %s", ckpt, ckpt);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  NMT_ASSERT(strstr(err, "--output") && strstr(err, "step_1.ckpt"));
  snprintf(alias, sizeof alias, "%s/alias.ckpt", dir);
  NMT_ASSERT(link(ckpt, alias) == 0);
  snprintf(args, sizeof args, "average %s --output %s", ckpt, alias);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  snprintf(args, sizeof args, "average --last 1 %s/run/checkpoints --output %s", dir, ckpt);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  snprintf(args, sizeof args, "export %s %s", ckpt, alias);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  NMT_ASSERT(strstr(err, "CKPT") && strstr(err, "OUT"));
  struct stat st1;
  NMT_ASSERT(stat(ckpt, &st1) == 0);
  NMT_ASSERT(st1.st_ino == st0.st_ino && st1.st_size == st0.st_size);
  nmt_ckpt_header h;
  NMT_ASSERT_OK(nmt_ckpt_read_header(ckpt, &h));
  NMT_ASSERT_EQ_INT((int)h.has_moments, 1);
  char *now = slurp(ckpt);
  NMT_ASSERT(!memcmp(now, orig, (size_t)st0.st_size));
  free(now), free(orig);

  snprintf(args, sizeof args, "shard --vocab 10 %s %s %s", f, f, f);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  NMT_ASSERT(strstr(err, "SRC_IDS") && strstr(err, "OUT"));
  text = slurp(f);
  NMT_ASSERT(!strcmp(text, "5 6 7\n8 9\n"));
  free(text);

  char jl[800];
  snprintf(jl, sizeof jl, "%s/run/eval", dir);
  mkdir(jl, 0777);
  snprintf(jl, sizeof jl, "%s/run/eval/eval.jsonl", dir);
  write_file(jl, "{\"step\": 1}\n");
  snprintf(args, sizeof args, "eval %s --shard %s", ckpt, jl);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  NMT_ASSERT(strstr(err, "--shard") && strstr(err, "eval.jsonl"));
}

/* nmt_path_same: one file under two spellings, a hard link and a symlink are the same; two
 * files, "-", NULL, and one terminal or /dev/null under two names are not; a path that does
 * not exist yet compares by its resolved directory. */
NMT_TEST(paths_same_file_identity) {
  const char *dir = nmt_test_tmpdir();
  char a[700], a2[800], b[700], hl[700], sl[700], n1[700], n2[800];
  snprintf(a, sizeof a, "%s/a.txt", dir);
  snprintf(a2, sizeof a2, "%s/./sub/../a.txt", dir);
  snprintf(b, sizeof b, "%s/b.txt", dir);
  snprintf(hl, sizeof hl, "%s/hard.txt", dir);
  snprintf(sl, sizeof sl, "%s/soft.txt", dir);
  snprintf(n1, sizeof n1, "%s/new.txt", dir);
  snprintf(n2, sizeof n2, "%s/sub/../new.txt", dir);
  write_file(a, "x\n");
  write_file(b, "x\n");
  char sub[700];
  snprintf(sub, sizeof sub, "%s/sub", dir);
  NMT_ASSERT(mkdir(sub, 0777) == 0);
  NMT_ASSERT(link(a, hl) == 0 && symlink(a, sl) == 0);
  NMT_ASSERT_EQ_INT(nmt_path_same(a, a2), 1);
  NMT_ASSERT_EQ_INT(nmt_path_same(a, hl), 1);
  NMT_ASSERT_EQ_INT(nmt_path_same(sl, a), 1);
  NMT_ASSERT_EQ_INT(nmt_path_same(a, b), 0);
  NMT_ASSERT_EQ_INT(nmt_path_same(n1, n2), 1);
  NMT_ASSERT_EQ_INT(nmt_path_same(n1, a), 0);
  NMT_ASSERT_EQ_INT(nmt_path_same("-", "-"), 0);
  NMT_ASSERT_EQ_INT(nmt_path_same(NULL, a), 0);
  NMT_ASSERT_EQ_INT(nmt_path_same("/dev/null", "/dev/null"), 0);
  nmt_path_arg out = {"--output", hl}, in[] = {{"--input", b}, {"CKPT", sl}};
  NMT_ASSERT_EQ_STATUS(nmt_path_check_outputs("x", &out, 1, in, 2), NMT_ERR_USAGE);
  NMT_ASSERT(strstr(nmt_last_error(), "--output") && strstr(nmt_last_error(), "CKPT"));
  out.path = n1;
  NMT_ASSERT_OK(nmt_path_check_outputs("x", &out, 1, in, 2));
}
