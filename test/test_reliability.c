/* test_reliability.c — the nmt binary under faults: signals, kill -9, damaged checkpoints,
 * out of memory, divergence; status.json for schedulers (README "Exit codes", "Embedding").
 *
 * Every test spawns build/nmt on a synthetic corpus with a tiny model, so a run takes well
 * under a second; the reference for "exact" is always a second, uninterrupted run of the same
 * binary, compared bitwise through its final checkpoint. */
#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"
#include "nmt/checkpoint.h"
#include "nmt/rng.h"
#include "test.h"

typedef struct {
  char dir[512], shard[600], ini[600], run[600], ckdir[700], log[600], status[700];
} fixture;

/* A run directory `name` under the test's tmpdir, with its own INI. */
static int fixture_init(fixture *f, const char *name, long max_steps, const char *extra) {
  snprintf(f->dir, sizeof f->dir, "%s", nmt_test_tmpdir());
  snprintf(f->shard, sizeof f->shard, "%s/syn.shard", f->dir);
  snprintf(f->ini, sizeof f->ini, "%s/%s.ini", f->dir, name);
  snprintf(f->run, sizeof f->run, "%s/%s", f->dir, name);
  snprintf(f->ckdir, sizeof f->ckdir, "%s/checkpoints", f->run);
  snprintf(f->log, sizeof f->log, "%s/%s.log", f->dir, name);
  snprintf(f->status, sizeof f->status, "%s/status.json", f->run);
  if (access(f->shard, R_OK) != 0 && nmt_th_write_synthetic(f->shard, 96, 6) != NMT_OK) return -1;
  return nmt_th_write_ini(f->ini, f->run, f->shard, max_steps, extra);
}

/* Runs `nmt train INI [a1 [a2]]` to completion (env: one "K=V" or NULL); returns the exit code. */
static int train2(const fixture *f, const char *a1, const char *a2, const char *env,
                  double timeout_s) {
  const char *argv[] = {"train", f->ini, a1, a1 ? a2 : NULL, NULL};
  pid_t pid = nmt_th_spawn(argv, f->log, env);
  return pid < 0 ? -1 : nmt_th_wait(pid, timeout_s, NULL);
}

static int train(const fixture *f, const char *a1, const char *env, double timeout_s) {
  return train2(f, a1, NULL, env, timeout_s);
}

static int log_has(const fixture *f, const char *text) {
  char *s = nmt_th_read_file(f->log, NULL);
  int found = s && strstr(s, text);
  free(s);
  return found;
}

static void clear_log(const fixture *f) {
  FILE *o = fopen(f->log, "w");
  if (o) fclose(o);
}

static void ckpt_path(const fixture *f, long step, char *out, size_t cap) {
  snprintf(out, cap, "%s/step_%ld.ckpt", f->ckdir, step);
}

/* Reads status.json; state and exit code out (state "" if unreadable). */
static double status_field(const fixture *f, const char *key, char *state, size_t cap) {
  char *s = nmt_th_read_file(f->status, NULL);
  if (state && (!s || !nmt_th_json_str(s, "state", state, cap))) state[0] = 0;
  double v = key ? nmt_th_json_num(s, key) : NAN;
  free(s);
  return v;
}

/* SIGTERM after a few steps: exit 75 with a checkpoint of the last step and status "stopped";
 * --resume finishes; the result is bitwise the uninterrupted run's (parameters and Adam
 * moments; dropout is on, so RNG streams and data position must be restored exactly). */
NMT_TEST(reliab_sigterm_stop_resume_exact) {
  enum { M = 400 }; /* long enough that the signal always lands mid-run */
  fixture ref, f;
  NMT_ASSERT(fixture_init(&ref, "straight", M, NULL) == 0);
  NMT_ASSERT(fixture_init(&f, "stopped", M, NULL) == 0);
  NMT_ASSERT_EQ_INT(train(&ref, NULL, NULL, 120), 0);

  const char *argv[] = {"train", f.ini, NULL};
  pid_t pid = nmt_th_spawn(argv, f.log, NULL);
  NMT_ASSERT(pid > 0);
  NMT_ASSERT(nmt_th_wait_for(f.log, "step 3/", pid, 60));
  kill(pid, SIGTERM);
  int code = nmt_th_wait(pid, 60, NULL);
  NMT_ASSERT_EQ_INT(code, 75);
  NMT_ASSERT(log_has(&f, "checkpoint written"));
  char state[64], path[1024], latest[1024];
  double step = status_field(&f, "step", state, sizeof state);
  printf("# SIGTERM stopped the run at step %.0f of %d\n", step, M);
  NMT_ASSERT(!strcmp(state, "stopped"));
  NMT_ASSERT(step >= 3 && step < M);
  NMT_ASSERT_EQ_INT(status_field(&f, "exit_code", NULL, 0), 75);
  NMT_ASSERT_OK(nmt_ckpt_find_latest(f.ckdir, latest));
  ckpt_path(&f, (long)step, path, sizeof path);
  NMT_ASSERT(!strcmp(latest, path));

  NMT_ASSERT_EQ_INT(train(&f, "--resume", NULL, 120), 0);
  NMT_ASSERT(log_has(&f, "resuming from"));
  status_field(&f, NULL, state, sizeof state);
  NMT_ASSERT(!strcmp(state, "done"));
  char a[1024], b[1024];
  ckpt_path(&ref, M, a, sizeof a);
  ckpt_path(&f, M, b, sizeof b);
  long diff = nmt_th_ckpt_diff(a, b);
  if (diff != 0)
    nmt_test_fail(__FILE__, __LINE__, "%ld floats of parameters/moments differ between the "
                  "straight run and stop+resume (-1: unreadable: %s)", diff, nmt_last_error());
  /* The losses too: metrics.jsonl of the stopped run continues after the stop; every step's
   * train_loss (as printed, %.6f) equals the straight run's. */
  static char la[M + 1][32], lb[M + 1][32];
  const char *names[2] = {ref.run, f.run};
  for (int r = 0; r < 2; r++) {
    char mp[700];
    snprintf(mp, sizeof mp, "%s/metrics.jsonl", names[r]);
    char *text = nmt_th_read_file(mp, NULL);
    NMT_ASSERT(text != NULL);
    for (int i = 0; i <= M; i++) (r ? lb : la)[i][0] = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
      long st = (long)nmt_th_json_num(line, "step");
      const char *l = strstr(line, "\"train_loss\": ");
      if (st >= 1 && st <= M && l) sscanf(l + 14, "%31[^,]", (r ? lb : la)[st]);
    }
    free(text);
  }
  int compared = 0;
  for (int i = 1; i <= M; i++) {
    if (!la[i][0] || !lb[i][0]) continue;
    compared++;
    if (strcmp(la[i], lb[i])) {
      nmt_test_fail(__FILE__, __LINE__, "step %d: train_loss %s straight, %s with stop+resume", i,
                    la[i], lb[i]);
      return;
    }
  }
  NMT_ASSERT_EQ_INT(compared, M);
}

/* SIGINT and SIGUSR1 stop the same way as SIGTERM (exit 75, checkpoint). */
NMT_TEST(reliab_sigint_sigusr1_stop) {
  int sigs[2] = {SIGINT, SIGUSR1};
  for (int i = 0; i < 2; i++) {
    fixture f;
    char name[32];
    snprintf(name, sizeof name, "sig%d", sigs[i]);
    NMT_ASSERT(fixture_init(&f, name, 100000, NULL) == 0);
    const char *argv[] = {"train", f.ini, NULL};
    pid_t pid = nmt_th_spawn(argv, f.log, NULL);
    NMT_ASSERT(pid > 0);
    NMT_ASSERT(nmt_th_wait_for(f.log, "step 2/", pid, 60));
    kill(pid, sigs[i]);
    NMT_ASSERT_EQ_INT(nmt_th_wait(pid, 60, NULL), 75);
    char latest[1024];
    NMT_ASSERT_OK(nmt_ckpt_find_latest(f.ckdir, latest));
  }
}

/* A second SIGINT aborts without waiting for the run: non-zero (8, aborted), not 75, and
 * quickly. A second request counts from 1 s after the first (earlier it is a copy of it:
 * README "Signals"), so the model is made big enough (tens of seconds per step on a core, as
 * in test_stop.c) that the first stop cannot complete before the second signal arrives. */
NMT_TEST(reliab_second_sigint_aborts) {
  fixture f;
  NMT_ASSERT(fixture_init(&f, "twice", 100000,
                          "[model]\nd_model = 512\nd_ff = 4096\nn_heads = 8\n"
                          "[data]\nmax_tokens = 4096\n[parallel]\ndevices = 2\n"
                          "bucket_mb = 25\n") == 0);
  const char *argv[] = {"train", f.ini, NULL};
  pid_t pid = nmt_th_spawn(argv, f.log, NULL);
  NMT_ASSERT(pid > 0);
  NMT_ASSERT(nmt_th_wait_for(f.log, "training ", pid, 120));
  kill(pid, SIGINT);
  /* Signals do not queue: wait until the first was taken, then past the 1 s in which another
   * is a copy (the line is written after the first arrived). */
  NMT_ASSERT(nmt_th_wait_for(f.log, "signal 2", pid, 60));
  const struct timespec grace = {1, 100000000};
  nanosleep(&grace, NULL);
  double t0 = nmt_th_now();
  kill(pid, SIGINT);
  int code = nmt_th_wait(pid, 60, NULL);
  double dt = nmt_th_now() - t0;
  printf("# second SIGINT: exit %d after %.3f s\n", code, dt);
  NMT_ASSERT(log_has(&f, "second SIGINT"));
  NMT_ASSERT_EQ_INT(code, 8);
  char state[64];
  status_field(&f, NULL, state, sizeof state);
  NMT_ASSERT(!strcmp(state, "failed"));
}

/* Every file named step_*.ckpt in dir must read back completely (CRC included): a writer
 * killed at any moment may leave a temp file, never a damaged checkpoint under a real name.
 * Returns the number of bad ones; *newest gets the highest valid step (-1 if none). */
static int check_all_ckpts(const char *dir, long *newest, int *temps) {
  *newest = -1;
  *temps = 0;
  DIR *d = opendir(dir);
  if (!d) return 0;
  int bad = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    long step;
    char tail[8];
    if (strstr(e->d_name, ".tmp.")) {
      (*temps)++;
      continue;
    }
    if (sscanf(e->d_name, "step_%ld.ck%2s", &step, tail) != 2) continue;
    char p[1400];
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    nmt_ckpt_header h;
    if (nmt_ckpt_read(p, NULL, &h, NULL, NULL, NULL) != NMT_OK || h.step != step) {
      printf("# damaged checkpoint under its final name: %s: %s\n", p, nmt_last_error());
      bad++;
    } else if (step > *newest) {
      *newest = step;
    }
  }
  closedir(d);
  return bad;
}

/* kill -9 at random moments (seeded, so a failure reproduces), with a checkpoint every step so
 * many kills land inside a checkpoint write: afterwards every checkpoint file is whole,
 * `latest` (if any) names the newest, and --resume always finishes with bitwise the result of
 * the uninterrupted run. NMT_TEST_LONG=1: 200 trials instead of 20. */
NMT_TEST(reliab_kill9_crash_safety) {
  enum { M = 24 };
  const char *extra = "[train]\nsave_every = 1\n[checkpoint]\nkeep = 2\n[parallel]\ndevices = 1\n";
  int trials = getenv("NMT_TEST_LONG") && atoi(getenv("NMT_TEST_LONG")) > 0 ? 200 : 20;
  fixture ref;
  NMT_ASSERT(fixture_init(&ref, "ref", M, extra) == 0);
  double t0 = nmt_th_now();
  NMT_ASSERT_EQ_INT(train(&ref, NULL, NULL, 120), 0);
  double run_s = nmt_th_now() - t0;
  char ref_final[1024];
  ckpt_path(&ref, M, ref_final, sizeof ref_final);
  int with_temp = 0, finished = 0, fresh = 0;
  for (int i = 0; i < trials; i++) {
    fixture f;
    char name[32];
    snprintf(name, sizeof name, "k%d", i);
    NMT_ASSERT(fixture_init(&f, name, M, extra) == 0);
    /* Uniform over the whole run, including start-up and the final checkpoint. */
    double delay = 1.1 * run_s * (double)nmt_rng_u32(2024, 9, (uint64_t)i) / 4294967296.0;
    const char *argv[] = {"train", f.ini, NULL};
    pid_t pid = nmt_th_spawn(argv, f.log, NULL);
    NMT_ASSERT(pid > 0);
    struct timespec ts = {(time_t)delay, (long)((delay - (double)(time_t)delay) * 1e9)};
    nanosleep(&ts, NULL);
    kill(pid, SIGKILL);
    int code = nmt_th_wait(pid, 60, NULL);
    finished += code == 0;
    long newest;
    int temps;
    int bad = check_all_ckpts(f.ckdir, &newest, &temps);
    with_temp += temps > 0;
    if (bad) {
      nmt_test_fail(__FILE__, __LINE__, "trial %d (kill after %.3f s): %d damaged checkpoint(s)",
                    i, delay, bad);
      return;
    }
    /* `latest` moves only after the checkpoint it names is durable, so a kill between the
     * two leaves it one step behind the newest file: either is a correct place to resume. */
    char latest[1024];
    nmt_status fs = nmt_ckpt_find_latest(f.ckdir, latest);
    if (newest >= 0) {
      char want[1024], prev[1024];
      ckpt_path(&f, newest, want, sizeof want);
      ckpt_path(&f, newest - 1, prev, sizeof prev);
      if (fs != NMT_OK || (strcmp(latest, want) && strcmp(latest, prev))) {
        nmt_test_fail(__FILE__, __LINE__, "trial %d: newest valid is %s but find_latest gave %s "
                      "(%s)", i, want, fs == NMT_OK ? latest : "an error", nmt_last_error());
        return;
      }
    } else {
      fresh++;
      if (fs == NMT_OK) {
        nmt_test_fail(__FILE__, __LINE__, "trial %d: no valid file, yet find_latest gave %s", i,
                      latest);
        return;
      }
    }
    int rc = train(&f, "--resume", NULL, 120);
    if (rc != 0) {
      nmt_test_fail(__FILE__, __LINE__, "trial %d (kill after %.3f s, newest step %ld): resume "
                    "exited %d; log %s", i, delay, newest, rc, f.log);
      return;
    }
    char fin[1024];
    ckpt_path(&f, M, fin, sizeof fin);
    long diff = nmt_th_ckpt_diff(ref_final, fin);
    if (diff != 0) {
      nmt_test_fail(__FILE__, __LINE__, "trial %d (kill after %.3f s, resumed from step %ld): "
                    "%ld floats differ from the uninterrupted run", i, delay, newest, diff);
      return;
    }
  }
  printf("# %d kill -9 trials (a run takes %.2f s): %d left a temp file (killed inside a "
         "checkpoint write), %d had no checkpoint yet, %d had already finished\n",
         trials, run_s, with_temp, fresh, finished);
}

/* Damaged checkpoints: --resume names the damaged file and uses the previous valid one; with
 * none valid, or a valid one of another model shape, it exits 7 and loads nothing. */
NMT_TEST(reliab_corrupt_checkpoint) {
  const char *extra = "[train]\nsave_every = 2\n[checkpoint]\nkeep = 0\n";
  fixture f;
  NMT_ASSERT(fixture_init(&f, "c", 4, extra) == 0);
  NMT_ASSERT_EQ_INT(train(&f, NULL, NULL, 60), 0);
  char c2[1024], c4[1024], keep2[1100], keep4[1100];
  ckpt_path(&f, 2, c2, sizeof c2);
  ckpt_path(&f, 4, c4, sizeof c4);
  snprintf(keep2, sizeof keep2, "%s/good2", f.dir);
  snprintf(keep4, sizeof keep4, "%s/good4", f.dir);
  size_t n2, n4;
  char *g2 = nmt_th_read_file(c2, &n2), *g4 = nmt_th_read_file(c4, &n4);
  NMT_ASSERT(g2 && g4 && n4 > 200);

  /* kind: 0 flipped byte, 1 truncated, 2 wrong version. Each time the newest is damaged. */
  const char *expect[3] = {"checksum mismatch", "truncated", "unsupported version 99"};
  for (int kind = 0; kind < 3; kind++) {
    FILE *o = fopen(c2, "wb");
    fwrite(g2, 1, n2, o);
    fclose(o);
    char *bad = malloc(n4);
    memcpy(bad, g4, n4);
    size_t len = n4;
    if (kind == 0) bad[n4 / 2] ^= 0x10;
    if (kind == 1) len = n4 - 100;
    if (kind == 2) bad[8] = 99, bad[9] = bad[10] = bad[11] = 0;
    o = fopen(c4, "wb");
    fwrite(bad, 1, len, o);
    fclose(o);
    free(bad);
    /* resume to step 4 again: must start from 2 and rewrite 4 */
    clear_log(&f);
    int rc = train(&f, "--resume", NULL, 60);
    printf("# damage %d (%s): resume exit %d\n", kind, expect[kind], rc);
    NMT_ASSERT_EQ_INT(rc, 0);
    NMT_ASSERT(log_has(&f, expect[kind]));
    NMT_ASSERT(log_has(&f, "step_4.ckpt"));
    NMT_ASSERT(log_has(&f, "step_2.ckpt (step 2)"));
    /* 2 -> 4 again reproduces the original step 4 bitwise */
    size_t n;
    char *again = nmt_th_read_file(c4, &n);
    NMT_ASSERT(again && n == n4 && memcmp(again, g4, n4) == 0);
    free(again);
  }

  /* `latest` pointing outside the directory is ignored. */
  {
    char lp[1100];
    snprintf(lp, sizeof lp, "%s/latest", f.ckdir);
    FILE *o = fopen(lp, "w");
    fputs("../../../etc/passwd\n", o);
    fclose(o);
    clear_log(&f);
    NMT_ASSERT_EQ_INT(train2(&f, "--resume", "train.max_steps=5", NULL, 60), 0);
    NMT_ASSERT(log_has(&f, "step_4.ckpt (step 4)"));
  }

  /* Every checkpoint damaged: exit 7, nothing loaded or written; status.json still the
   * finished run's (the refused command never started a run). */
  {
    DIR *d = opendir(f.ckdir);
    struct dirent *e;
    while ((e = readdir(d))) {
      if (strncmp(e->d_name, "step_", 5)) continue;
      char p[1400];
      snprintf(p, sizeof p, "%s/%s", f.ckdir, e->d_name);
      FILE *o = fopen(p, "r+b");
      NMT_ASSERT(o != NULL);
      fseek(o, 150, SEEK_SET);
      int c = fgetc(o);
      fseek(o, 150, SEEK_SET);
      fputc(c ^ 0x01, o);
      fclose(o);
    }
    closedir(d);
    clear_log(&f);
    NMT_ASSERT_EQ_INT(train2(&f, "--resume", "train.max_steps=8", NULL, 60), 7);
    NMT_ASSERT(log_has(&f, "none is valid"));
    NMT_ASSERT(!log_has(&f, "resuming from"));
    char state[64];
    NMT_ASSERT_EQ_INT(status_field(&f, "exit_code", state, sizeof state), 0);
    NMT_ASSERT(!strcmp(state, "done"));
    NMT_ASSERT_EQ_INT(status_field(&f, "step", NULL, 0), 5);
    char p8[1024];
    ckpt_path(&f, 8, p8, sizeof p8);
    NMT_ASSERT(access(p8, F_OK) != 0);
    /* Asked for by name (translate --ckpt), a damaged file is the same named error. */
    clear_log(&f);
    const char *argv[] = {"translate", f.ini, "--ckpt", c4, "--ids", "--input", "/dev/null",
                          "--output", "/dev/null", NULL};
    pid_t pid = nmt_th_spawn(argv, f.log, NULL);
    NMT_ASSERT(pid > 0);
    NMT_ASSERT_EQ_INT(nmt_th_wait(pid, 60, NULL), 7);
    NMT_ASSERT(log_has(&f, "step_4.ckpt: checksum mismatch"));
  }

  /* A valid checkpoint of another model shape: exit 7 naming the field, nothing loaded. */
  {
    FILE *o = fopen(c2, "wb");
    fwrite(g2, 1, n2, o);
    fclose(o);
    clear_log(&f);
    NMT_ASSERT_EQ_INT(train2(&f, "--resume", "model.d_ff=64", NULL, 60), 7);
    NMT_ASSERT(log_has(&f, "wrong model shape: d_ff 32 in file, 64 in config"));
  }
  free(g2), free(g4);
}

/* An absurd batch must fail cleanly with exit 4 and a message naming the batch size. */
NMT_TEST(reliab_out_of_memory_names_batch) {
  fixture f;
  NMT_ASSERT(fixture_init(&f, "oom", 10, "[data]\nmax_tokens = 1073741824\n") == 0);
  NMT_ASSERT_EQ_INT(train(&f, NULL, NULL, 60), 4);
  NMT_ASSERT(log_has(&f, "data.max_tokens = 1073741824"));
  NMT_ASSERT(log_has(&f, "out of memory"));
  char state[64];
  NMT_ASSERT_EQ_INT(status_field(&f, "exit_code", state, sizeof state), 4);
  NMT_ASSERT(!strcmp(state, "failed"));
}

/* A NaN gradient norm (injected from step 3 on, as fp16 overflow would produce) ends the run
 * with the "diverged" exit code 5, naming the step. */
NMT_TEST(reliab_nan_gradient_diverged_exit_5) {
  fixture f;
  NMT_ASSERT(fixture_init(&f, "nan", 50, NULL) == 0);
  NMT_ASSERT_EQ_INT(train(&f, NULL, "NMT_INJECT_NAN_STEP=3", 60), 5);
  NMT_ASSERT(log_has(&f, "step 4: gradient norm is nan"));
  char state[64], err[512];
  NMT_ASSERT_EQ_INT(status_field(&f, "exit_code", state, sizeof state), 5);
  NMT_ASSERT(!strcmp(state, "failed"));
  char *s = nmt_th_read_file(f.status, NULL);
  NMT_ASSERT(s && nmt_th_json_str(s, "error", err, sizeof err) && strstr(err, "gradient norm"));
  free(s);
  NMT_ASSERT_EQ_INT(status_field(&f, "step", NULL, 0), 3);
}

/* fp16: the same persistent NaN is first taken as overflow (steps skipped, loss scale backed
 * off: 8 -> 4 -> 2 -> 1), then ends the run with exit code 5 once precision.floor is reached. */
NMT_TEST(reliab_fp16_nan_backs_off_then_diverges) {
  fixture f;
  NMT_ASSERT(fixture_init(&f, "nan16", 50,
                          "[precision]\nmode = fp16\nloss_scale = 8\nfloor = 1\n") == 0);
  NMT_ASSERT_EQ_INT(train(&f, NULL, "NMT_INJECT_NAN_STEP=3", 60), 5);
  NMT_ASSERT(log_has(&f, "step 4: fp16 gradient overflow, step skipped; loss scale -> 4"));
  NMT_ASSERT(log_has(&f, "step 6: fp16 gradient overflow, step skipped; loss scale -> 1"));
  NMT_ASSERT(log_has(&f, "step 7: the gradient overflowed at loss scale 1"));
  char state[64];
  NMT_ASSERT_EQ_INT(status_field(&f, "exit_code", state, sizeof state), 5);
  NMT_ASSERT_EQ_INT(status_field(&f, "step", NULL, 0), 6);
}

/* Polls f's status.json until its "step" is >= min_step (1), or pid exits (a last look) or
 * timeout_s passes (0). */
static int wait_status_step(const fixture *f, long min_step, pid_t pid, double timeout_s) {
  const double t0 = nmt_th_now();
  for (;;) {
    char *s = nmt_th_read_file(f->status, NULL);
    const double step = s ? nmt_th_json_num(s, "step") : NAN;
    free(s);
    if (step >= (double)min_step) return 1;
    siginfo_t info;
    memset(&info, 0, sizeof info);
    const int exited = waitid(P_PID, (id_t)pid, &info, WEXITED | WNOHANG | WNOWAIT) != 0 ||
                       info.si_pid == pid;
    if (exited || nmt_th_now() - t0 > timeout_s) {
      s = nmt_th_read_file(f->status, NULL);
      const double last = s ? nmt_th_json_num(s, "step") : NAN;
      free(s);
      return last >= (double)min_step;
    }
    struct timespec ms = {0, 500000};
    nanosleep(&ms, NULL);
  }
}

/* status.json while running and at the end: fields present and consistent with the run. */
NMT_TEST(reliab_status_json_fields) {
  enum { M = 300 };
  fixture f;
  NMT_ASSERT(fixture_init(&f, "st", M, "[train]\nsave_every = 100\n") == 0);
  const char *argv[] = {"train", f.ini, NULL};
  pid_t pid = nmt_th_spawn(argv, f.log, NULL);
  NMT_ASSERT(pid > 0);
  /* status.json is rewritten in place each log step: wait for any step >= 5 (a poll that
   * looked for "step": 5 literally saw only steps 5 and 50-59, which a loaded machine's poller
   * can miss in a run of 1-2 ms steps; it then ends at step 300 and never matches). */
  NMT_ASSERT(wait_status_step(&f, 5, pid, 60));
  char state[64];
  double step = status_field(&f, "step", state, sizeof state);
  double eta = status_field(&f, "eta_s", NULL, 0);
  double tps = status_field(&f, "tgt_tokens_per_s", NULL, 0);
  printf("# while running: state %s step %.0f eta %.1f s, %.0f tgt tok/s\n", state, step, eta, tps);
  NMT_ASSERT(!strcmp(state, "running") || !strcmp(state, "done"));
  NMT_ASSERT(tps > 0);
  if (!strcmp(state, "running")) NMT_ASSERT(eta >= 0);
  NMT_ASSERT_EQ_INT(nmt_th_wait(pid, 120, NULL), 0);
  char *s = nmt_th_read_file(f.status, NULL), ck[1024], want[1024];
  NMT_ASSERT(s != NULL);
  NMT_ASSERT(nmt_th_json_str(s, "state", state, sizeof state) && !strcmp(state, "done"));
  NMT_ASSERT_EQ_INT(nmt_th_json_num(s, "step"), M);
  NMT_ASSERT_EQ_INT(nmt_th_json_num(s, "max_steps"), M);
  NMT_ASSERT_EQ_INT(nmt_th_json_num(s, "exit_code"), 0);
  NMT_ASSERT(nmt_th_json_num(s, "train_loss") > 0);
  NMT_ASSERT_EQ_INT(nmt_th_json_num(s, "eta_s"), 0);
  NMT_ASSERT_EQ_INT(nmt_th_json_num(s, "pid"), pid);
  ckpt_path(&f, M, want, sizeof want);
  NMT_ASSERT(nmt_th_json_str(s, "last_checkpoint", ck, sizeof ck) && !strcmp(ck, want));
  NMT_ASSERT(strstr(s, "\"error\": null") != NULL);
  free(s);
  /* No temp file of the atomic replacement is left behind. */
  DIR *d = opendir(f.run);
  struct dirent *e;
  int temps = 0;
  while ((e = readdir(d))) temps += strstr(e->d_name, ".tmp") != NULL;
  closedir(d);
  NMT_ASSERT_EQ_INT(temps, 0);
}
