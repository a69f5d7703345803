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
  return nmt_th_capture(cmd, err, n);
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

/* `nmt train` on a run directory that holds a finished run: refused with exit 2 naming
 * --resume, a fresh run.out_dir and --overwrite, and metrics.jsonl, status.json and the
 * checkpoints stay as they were; --resume continues it; --overwrite starts over with the old
 * checkpoints gone, so `latest`, `best` and checkpoint.keep see the new run's alone. */
NMT_TEST(rundir_train_refuses_previous_run) {
  const char *dir = nmt_test_tmpdir();
  char ini[700], args[2048], err[8192], path[800];
  NMT_ASSERT(tiny_ini(dir, 3, ini, sizeof ini) == 0);
  snprintf(args, sizeof args, "train %s", ini);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 0);
  snprintf(path, sizeof path, "%s/run/metrics.jsonl", dir);
  char *metrics = slurp(path);
  snprintf(path, sizeof path, "%s/run/status.json", dir);
  char *status = slurp(path);
  NMT_ASSERT(strstr(metrics, "\"step\": 3") != NULL);

  int rc = run_nmt(args, err, sizeof err);
  if (rc != 2) printf("# second train: exit %d: %s\n", rc, err);
  NMT_ASSERT_EQ_INT(rc, 2);
  NMT_ASSERT(strstr(err, "--resume") && strstr(err, "--overwrite") && strstr(err, "run.out_dir"));
  NMT_ASSERT(strstr(err, "checkpoints") && strstr(err, "metrics.jsonl"));
  snprintf(path, sizeof path, "%s/run/metrics.jsonl", dir);
  char *after = slurp(path);
  NMT_ASSERT(!strcmp(after, metrics));
  free(after);
  snprintf(path, sizeof path, "%s/run/status.json", dir);
  after = slurp(path);
  NMT_ASSERT(!strcmp(after, status)); /* not "failed": it is the finished run's */
  free(after);
  free(metrics), free(status);

  snprintf(args, sizeof args, "train %s train.max_steps=4 --resume", ini);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 0);
  snprintf(path, sizeof path, "%s/run/checkpoints/step_4.ckpt", dir);
  NMT_ASSERT(access(path, R_OK) == 0);

  snprintf(args, sizeof args, "train %s train.max_steps=2 --resume --overwrite", ini);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  snprintf(args, sizeof args, "train %s train.max_steps=2 --overwrite", ini);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 0);
  NMT_ASSERT(strstr(err, "--overwrite: discarding") != NULL);
  for (int s = 3; s <= 4; s++) {
    snprintf(path, sizeof path, "%s/run/checkpoints/step_%d.ckpt", dir, s);
    NMT_ASSERT(access(path, F_OK) != 0);
  }
  snprintf(path, sizeof path, "%s/run/checkpoints/latest", dir);
  char *latest = slurp(path);
  NMT_ASSERT(!strcmp(latest, "step_2.ckpt\n"));
  free(latest);
  snprintf(path, sizeof path, "%s/run/metrics.jsonl", dir);
  metrics = slurp(path);
  NMT_ASSERT(!strncmp(metrics, "{\"step\": 1,", 11) && !strstr(metrics, "\"step\": 3"));
  free(metrics);
}

/* A run directory that holds nothing of value (config.ini, an empty metrics.jsonl and the
 * status.json of a setup that failed at step 0) is reused without a flag. */
NMT_TEST(rundir_reuses_dir_without_work) {
  const char *dir = nmt_test_tmpdir();
  char ini[700], args[2048], err[8192], path[800];
  NMT_ASSERT(tiny_ini(dir, 1, ini, sizeof ini) == 0);
  snprintf(path, sizeof path, "%s/run", dir);
  NMT_ASSERT(mkdir(path, 0777) == 0);
  snprintf(path, sizeof path, "%s/run/config.ini", dir);
  write_file(path, "[run]\nseed = 7\n");
  snprintf(path, sizeof path, "%s/run/metrics.jsonl", dir);
  write_file(path, "");
  snprintf(path, sizeof path, "%s/run/status.json", dir);
  write_file(path, "{\"state\": \"failed\", \"step\": 0, \"max_steps\": 1}\n");
  snprintf(args, sizeof args, "train %s", ini);
  int rc = run_nmt(args, err, sizeof err);
  if (rc) printf("# %s\n", err);
  NMT_ASSERT_EQ_INT(rc, 0);
}

/* While one training runs in run.out_dir, a second one (even with --resume) is refused with
 * exit 2 naming the first one's pid; once the first is killed (SIGKILL: no cleanup), the
 * kernel has released its lock and a third starts. */
NMT_TEST(rundir_lock_refuses_second_run) {
  const char *dir = nmt_test_tmpdir();
  char ini[700], args[2048], err[8192], path[800], log[800];
  NMT_ASSERT(tiny_ini(dir, 1000000, ini, sizeof ini) == 0);
  snprintf(log, sizeof log, "%s/first.log", dir);
  const char *argv[] = {"train", ini, NULL};
  pid_t first = nmt_th_spawn(argv, log, NULL);
  NMT_ASSERT(first > 0);
  snprintf(path, sizeof path, "%s/run/metrics.jsonl", dir);
  int training = nmt_th_wait_for(path, "\"step\": 1,", first, 120);
  if (!training) kill(first, SIGKILL), nmt_th_wait(first, 30, NULL);
  NMT_ASSERT(training);
  snprintf(args, sizeof args, "train %s train.max_steps=2 --resume", ini);
  int rc = run_nmt(args, err, sizeof err);
  char pid[32];
  snprintf(pid, sizeof pid, "pid %ld ", (long)first);
  int named = strstr(err, pid) && strstr(err, "run.lock") && strstr(err, "in use");
  kill(first, SIGKILL);
  NMT_ASSERT(nmt_th_wait(first, 30, NULL) == 128 + SIGKILL);
  if (rc != 2 || !named) printf("# second train: exit %d: %s\n", rc, err);
  NMT_ASSERT_EQ_INT(rc, 2);
  NMT_ASSERT(named);
  rc = run_nmt(args, err, sizeof err);
  if (rc) printf("# third train: %s\n", err);
  NMT_ASSERT_EQ_INT(rc, 0);
}

/* In one process too: a second trainer on a run.out_dir a live trainer holds is refused
 * (NMT_ERR_CONFIG, naming this pid), and gets it once the first is destroyed. */
NMT_TEST(rundir_lock_in_process) {
  const char *dir = nmt_test_tmpdir();
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(dir, 32, 3, &c));
  nmt_trainer *a = NULL, *b = NULL;
  NMT_ASSERT_OK(nmt_th_trainer_quiet(&c, NULL, NULL, &a));
  nmt_status s = nmt_th_trainer_quiet(&c, NULL, NULL, &b);
  char pid[32];
  snprintf(pid, sizeof pid, "pid %ld ", (long)getpid());
  int named = strstr(nmt_last_error(), pid) != NULL;
  nmt_trainer_destroy(a);
  NMT_ASSERT_EQ_STATUS(s, NMT_ERR_CONFIG);
  NMT_ASSERT(named);
  NMT_ASSERT_OK(nmt_th_trainer_quiet(&c, NULL, NULL, &b));
  nmt_trainer_destroy(b);
}

/* --resume from a checkpoint that holds parameters only (an average written over a training
 * checkpoint) is refused with exit 7 naming the file, rather than continuing with zero Adam
 * moments. */
NMT_TEST(rundir_resume_refuses_weights_only) {
  const char *dir = nmt_test_tmpdir();
  char ini[700], args[2048], err[8192], ckpt[800], avg[800];
  NMT_ASSERT(tiny_ini(dir, 2, ini, sizeof ini) == 0);
  snprintf(args, sizeof args, "train %s", ini);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 0);
  snprintf(ckpt, sizeof ckpt, "%s/run/checkpoints/step_2.ckpt", dir);
  snprintf(avg, sizeof avg, "%s/avg.ckpt", dir);
  snprintf(args, sizeof args, "average %s --output %s", ckpt, avg);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 0);
  NMT_ASSERT(rename(avg, ckpt) == 0);
  snprintf(args, sizeof args, "train %s train.max_steps=4 --resume", ini);
  int rc = run_nmt(args, err, sizeof err);
  if (rc != 7) printf("# resume: exit %d: %s\n", rc, err);
  NMT_ASSERT_EQ_INT(rc, 7);
  NMT_ASSERT(strstr(err, "step_2.ckpt") && strstr(err, "moments"));
}

/* A refused --resume (exit 7: every checkpoint damaged) leaves the run directory as the
 * finished run left it: status.json still "done" at its step with its last_checkpoint,
 * config.ini and metrics.jsonl byte for byte. */
NMT_TEST(rundir_refused_resume_leaves_run) {
  const char *dir = nmt_test_tmpdir();
  char ini[700], args[2048], err[8192], path[800];
  const char *files[] = {"status.json", "config.ini", "metrics.jsonl"};
  char *before[3];
  NMT_ASSERT(tiny_ini(dir, 2, ini, sizeof ini) == 0);
  snprintf(args, sizeof args, "train %s", ini);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 0);
  for (int i = 0; i < 3; i++) {
    snprintf(path, sizeof path, "%s/run/%s", dir, files[i]);
    before[i] = slurp(path);
  }
  NMT_ASSERT(strstr(before[0], "\"done\"") && strstr(before[0], "step_2.ckpt"));
  snprintf(path, sizeof path, "%s/run/checkpoints/step_2.ckpt", dir);
  write_file(path, "not a checkpoint\n");
  snprintf(args, sizeof args, "train %s train.max_steps=4 model.dropout=0.3 --resume", ini);
  int rc = run_nmt(args, err, sizeof err);
  if (rc != 7) printf("# resume: exit %d: %s\n", rc, err);
  NMT_ASSERT_EQ_INT(rc, 7);
  for (int i = 0; i < 3; i++) {
    snprintf(path, sizeof path, "%s/run/%s", dir, files[i]);
    char *after = slurp(path);
    int same = !strcmp(after, before[i]);
    if (!same) printf("# %s changed:\n%s\n", files[i], after);
    free(after), free(before[i]);
    NMT_ASSERT(same);
  }
}

/* A --resume that changes keys warns naming each one with its old and new value (not
 * run.resume, which --resume itself sets) and keeps the config the run used so far as
 * config.ini.step<N> beside the new config.ini; a resume that changes nothing keeps none. */
NMT_TEST(rundir_resume_keeps_changed_config) {
  const char *dir = nmt_test_tmpdir();
  char ini[700], args[2048], err[8192], path[800];
  NMT_ASSERT(tiny_ini(dir, 2, ini, sizeof ini) == 0);
  snprintf(args, sizeof args, "train %s", ini);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 0);
  snprintf(path, sizeof path, "%s/run/config.ini", dir);
  char *first = slurp(path);
  NMT_ASSERT(strstr(first, "\ndropout = 0.1\n") != NULL);
  snprintf(args, sizeof args, "train %s train.max_steps=3 model.dropout=0.3 --resume", ini);
  int rc = run_nmt(args, err, sizeof err);
  if (rc) printf("# resume: exit %d: %s\n", rc, err);
  NMT_ASSERT_EQ_INT(rc, 0);
  int named = strstr(err, "model.dropout 0.1 -> 0.3") && strstr(err, "train.max_steps 2 -> 3") &&
              strstr(err, "config.ini.step2") && !strstr(err, "run.resume false");
  if (!named) printf("# resume said:\n%s\n", err);
  NMT_ASSERT(named);
  snprintf(path, sizeof path, "%s/run/config.ini.step2", dir);
  char *kept = slurp(path);
  NMT_ASSERT(!strcmp(kept, first));
  free(kept), free(first);
  snprintf(path, sizeof path, "%s/run/config.ini", dir);
  char *now = slurp(path);
  NMT_ASSERT(strstr(now, "\ndropout = 0.3\n") && strstr(now, "\nmax_steps = 3\n"));
  free(now);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 0);
  NMT_ASSERT(!strstr(err, "config.ini.step"));
  snprintf(path, sizeof path, "%s/run/config.ini.step3", dir);
  NMT_ASSERT(access(path, F_OK) != 0);
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
