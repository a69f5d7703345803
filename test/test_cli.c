/* test_cli.c — the nmt binary's exit codes and messages on bad input (README "Exit codes"). */
#include <fcntl.h>
#include <glob.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"
#include "nmt/data.h"
#include "test.h"

/* Runs build/nmt with `args` (shell words) and environment assignments `env` (shell words, may
 * be ""), capturing stderr; returns the exit code. */
static int run_nmt_env(const char *env, const char *args, char *err, size_t n) {
  char cmd[4400];
  snprintf(cmd, sizeof cmd, "%s %s/nmt %s 2>&1 >/dev/null", env, nmt_test_build_dir(), args);
  return nmt_th_capture(cmd, err, n);
}

static int run_nmt(const char *args, char *err, size_t n) { return run_nmt_env("", args, err, n); }

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
  /* A GPU listed twice without the host-staged communicator: the key, the value and why. */
  NMT_ASSERT_EQ_INT(run_nmt("train conf/bible-small.ini parallel.device=cuda "
                            "parallel.devices=0,0", err, sizeof err), 2);
  NMT_ASSERT(strstr(err, "[parallel] devices = \"[0,0]\"") && strstr(err, "comm = \"host\"") &&
             strstr(err, "Duplicate GPU"));
  NMT_ASSERT_EQ_INT(run_nmt("train conf/bible-small.ini parallel.comm=ring", err, sizeof err), 2);
  NMT_ASSERT(strstr(err, "[parallel] comm") && strstr(err, "ring"));
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

/* ---- issue 19: config paths, CPU workers, errors printed once, --help, --version ---------- */

/* Runs build/nmt with `args`, capturing stdout alone; returns the exit code. */
static int run_nmt_stdout(const char *args, char *out, size_t n) {
  char cmd[4200];
  snprintf(cmd, sizeof cmd, "%s/nmt %s 2>/dev/null", nmt_test_build_dir(), args);
  return nmt_th_capture(cmd, out, n);
}

/* A tiny synthetic run's INI in dir (helpers.h): `extra` appended. */
static int tiny_ini(const char *dir, const char *name, long steps, const char *extra, char *ini,
                    size_t cap) {
  char shard[512], out[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(out, sizeof out, "%s/run-%s", dir, name);
  snprintf(ini, cap, "%s/%s.ini", dir, name);
  if (access(shard, R_OK) != 0 && nmt_th_write_synthetic(shard, 64, 3) != NMT_OK) return 0;
  return nmt_th_write_ini(ini, out, shard, steps, extra) == 0;
}

NMT_TEST(cli_directory_config_exit_2) {
  const char *dir = nmt_test_tmpdir();
  char d[512], args[1024], err[4096];
  snprintf(d, sizeof d, "%s/dir.ini", dir);
  NMT_ASSERT(mkdir(d, 0755) == 0);
  snprintf(args, sizeof args, "config --dump %s", d);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  NMT_ASSERT(strstr(err, d) && strstr(err, "is a directory"));
  snprintf(args, sizeof args, "train %s", d);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  NMT_ASSERT(strstr(err, "is a directory") != NULL);
  NMT_ASSERT(strstr(err, "[data] train") == NULL);
}

/* Issue 19: 257+ CPU workers crashed inside OpenBLAS; now a config error naming key, value and
 * the limit, before any thread starts. */
NMT_TEST(cli_cpu_workers_over_blas_limit_exit_2) {
  const char *dir = nmt_test_tmpdir();
  char ini[512], args[1024], err[8192];
  NMT_ASSERT(tiny_ini(dir, "many", 1, "devices = 300\n", ini, sizeof ini));
  snprintf(args, sizeof args, "train %s", ini);
  int rc = run_nmt(args, err, sizeof err);
  if (rc != 2) nmt_test_fail(__FILE__, __LINE__, "exit %d, want 2: %s", rc, err);
  NMT_ASSERT_EQ_INT(rc, 2);
  NMT_ASSERT(strstr(err, "[parallel] devices = 300") && strstr(err, "OpenBLAS") &&
             strstr(err, "the limit is"));
  /* The same from the command line, where the count overrides the file. */
  snprintf(args, sizeof args, "train %s parallel.devices=1000", ini);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  NMT_ASSERT(strstr(err, "[parallel] devices = 1000") != NULL);
}

/* Far more CPU workers than cores online trains, with a warning naming both numbers. */
NMT_TEST(cli_cpu_workers_far_above_cores_warn) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (cores < 1 || 4 * cores + 1 > 64) NMT_SKIP("too many cores for a quick over-subscribed run");
  const char *dir = nmt_test_tmpdir();
  char ini[512], args[1024], err[16384], want[128];
  int n = (int)(4 * cores + 1);
  char extra[64];
  snprintf(extra, sizeof extra, "devices = %d\nbucket_mb = 1\n", n);
  NMT_ASSERT(tiny_ini(dir, "over", 1, extra, ini, sizeof ini));
  snprintf(args, sizeof args, "train %s", ini);
  int rc = run_nmt(args, err, sizeof err);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "exit %d: %s", rc, err);
  NMT_ASSERT_EQ_INT(rc, 0);
  snprintf(want, sizeof want, "[parallel] devices = %d CPU workers on %ld cores", n, cores);
  if (!strstr(err, want)) nmt_test_fail(__FILE__, __LINE__, "no \"%s\" in: %s", want, err);
  NMT_ASSERT(strstr(err, want) != NULL);
  /* As many workers as cores: no warning. */
  snprintf(args, sizeof args, "train %s parallel.devices=1 run.out_dir=%s/one", ini, dir);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 0);
  NMT_ASSERT(strstr(err, "CPU workers on") == NULL);
}

/* Issue 19: an error was printed by the library's log and again by main (and a worker's error
 * three times: the worker, "run failed on rank r", main). */
NMT_TEST(cli_error_printed_once) {
  const char *dir = nmt_test_tmpdir();
  char ini[512], args[2048], err[8192];
  snprintf(ini, sizeof ini, "%s/bad.ini", dir);
  write_file(ini, "[train]\nmax_steps = 12x\n");
  snprintf(args, sizeof args, "train %s", ini);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  NMT_ASSERT_EQ_INT(nmt_th_count(err, "\"12x\": not an integer"), 1);
  /* ... followed by what the exit code means, once. */
  NMT_ASSERT_EQ_INT(nmt_th_count(err, "nmt: config error (exit 2)"), 1);
  /* An error in a worker thread (a NaN gradient from step 1 on, the testing hook): the
   * worker, the trainer's "run failed on rank 0" and main used to print it once each. */
  NMT_ASSERT(tiny_ini(dir, "nan", 4, NULL, ini, sizeof ini));
  snprintf(args, sizeof args, "train %s", ini);
  int rc = run_nmt_env("NMT_INJECT_NAN_STEP=1", args, err, sizeof err);
  if (rc != 5) nmt_test_fail(__FILE__, __LINE__, "exit %d, want 5: %s", rc, err);
  NMT_ASSERT_EQ_INT(rc, 5);
  if (nmt_th_count(err, "[nmt] error:") != 1) nmt_test_fail(__FILE__, __LINE__, "%s", err);
  NMT_ASSERT_EQ_INT(nmt_th_count(err, "[nmt] error:"), 1);
  /* A missing checkpoint for translate. */
  snprintf(args, sizeof args, "translate %s --ids --ckpt %s/none.ckpt --input /dev/null", ini, dir);
  NMT_ASSERT(run_nmt(args, err, sizeof err) != 0);
  NMT_ASSERT_EQ_INT(nmt_th_count(err, "none.ckpt"), 1);
}

NMT_TEST(cli_help_for_every_command) {
  static const char *const cmds[] = {"train",      "translate", "eval",  "average",
                                     "export",     "config",    "shard", "shard-info",
                                     "bench allreduce", "bench scaling", "bench"};
  static char out[65536];
  for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
    char args[128], want[64];
    snprintf(args, sizeof args, "%s --help", cmds[i]);
    snprintf(want, sizeof want, "usage: nmt %s", cmds[i]);
    int rc = run_nmt_stdout(args, out, sizeof out);
    if (rc != 0 || !strstr(out, want))
      nmt_test_fail(__FILE__, __LINE__, "nmt %s: exit %d, no \"%s\" in: %.300s", args, rc, want,
                    out);
    NMT_ASSERT(rc == 0 && strstr(out, want));
  }
  /* -h anywhere after the command, and config's help still lists every key. */
  NMT_ASSERT_EQ_INT(run_nmt_stdout("train conf/bible-small.ini -h", out, sizeof out), 0);
  NMT_ASSERT(strstr(out, "usage: nmt train") != NULL);
  NMT_ASSERT_EQ_INT(run_nmt_stdout("config --help", out, sizeof out), 0);
  NMT_ASSERT(strstr(out, "max_tokens") && strstr(out, "label_smoothing"));
  char err[4096];
  NMT_ASSERT_EQ_INT(run_nmt("frobnicate --help", err, sizeof err), 2);
}

NMT_TEST(cli_version) {
  char out[4096];
  NMT_ASSERT_EQ_INT(run_nmt_stdout("--version", out, sizeof out), 0);
  NMT_ASSERT(!strncmp(out, "nmt ", 4));
  NMT_ASSERT(strstr(out, "commit ") != NULL);
  NMT_ASSERT(strstr(out, "commit unknown") == NULL); /* the Makefile passes it */
  NMT_ASSERT(strstr(out, "device libraries: ") != NULL);
  /* A CUDA build names the three libraries; a CPU-only one says none. */
  NMT_ASSERT((strstr(out, "CUDA runtime") && strstr(out, "NCCL") && strstr(out, "cuBLASLt")) ||
             strstr(out, "device libraries: none"));
}

/* Issue 19: `average --last K` with fewer than K checkpoints said so only as a bare line; now
 * a warning line, and it still averages what is there. */
NMT_TEST(cli_average_fewer_than_asked_warns) {
  const char *dir = nmt_test_tmpdir();
  char ini[512], args[2048], err[8192];
  NMT_ASSERT(tiny_ini(dir, "avg", 2, "[train]\nsave_every = 1\n", ini, sizeof ini));
  snprintf(args, sizeof args, "train %s", ini);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 0);
  snprintf(args, sizeof args, "average --last 5 %s/run-avg/checkpoints --output %s/avg.ckpt", dir,
           dir);
  int rc = run_nmt(args, err, sizeof err);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "exit %d: %s", rc, err);
  NMT_ASSERT_EQ_INT(rc, 0);
  NMT_ASSERT(strstr(err, "[nmt] warn: average --last 5: only 2 valid checkpoints") != NULL);
}

/* ---- issue 19: the progress line on a terminal ---------------------------------------------- */

/* Starts build/nmt `argv` with stderr on a new pseudo-terminal (stdout to /dev/null); returns
 * the pid and the master side in *master, or -1. */
static pid_t spawn_on_pty(const char *const *argv, int *master) {
  int m = posix_openpt(O_RDWR | O_NOCTTY);
  if (m < 0 || grantpt(m) != 0 || unlockpt(m) != 0) return -1;
  const char *slave = ptsname(m);
  if (!slave) return -1;
  char exe[1024];
  snprintf(exe, sizeof exe, "%s/nmt", nmt_test_build_dir());
  const char *args[32] = {exe};
  for (int i = 0; argv[i] && i < 30; i++) args[i + 1] = argv[i];
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    setsid();
    int s = open(slave, O_RDWR);
    int null = open("/dev/null", O_WRONLY);
    if (s < 0 || null < 0) _exit(127);
    struct termios tio; /* no "\n" -> "\r\n": the test sees the bytes nmt wrote */
    if (tcgetattr(s, &tio) == 0) {
      tio.c_oflag &= ~(tcflag_t)OPOST;
      tcsetattr(s, TCSANOW, &tio);
    }
    dup2(null, 1);
    dup2(s, 2);
    close(m);
    execv(exe, (char *const *)args);
    _exit(127);
  }
  *master = m;
  return pid;
}

/* Reads what the terminal shows into buf (appending at *len) for up to timeout_s, or until
 * `until` returns 1 for it. Returns that result. */
static int read_pty(int m, char *buf, size_t cap, size_t *len, double timeout_s,
                    int (*until)(const char *)) {
  struct timespec t0, now;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    if (until(buf)) return 1;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double left = timeout_s - ((double)(now.tv_sec - t0.tv_sec) + 1e-9 * (double)(now.tv_nsec -
                                                                                  t0.tv_nsec));
    if (left <= 0) return 0;
    struct pollfd p = {.fd = m, .events = POLLIN};
    if (poll(&p, 1, (int)(left * 1000) + 1) <= 0) continue;
    ssize_t k = read(m, buf + *len, cap - 1 - *len);
    if (k <= 0) return until(buf); /* the child closed the terminal */
    *len += (size_t)k;
    buf[*len] = 0;
  }
}

/* Two progress redraws beyond the first: step counts moving on although no log step came. */
static int three_redraws(const char *s) { return nmt_th_count(s, "\r\033[K[nmt] step ") >= 3; }
static int stop_line_seen(const char *s) { return strstr(s, "stopping after step ") != NULL; }
static int redrawn_after_stop(const char *s) {
  const char *p = strstr(s, "stopping after step ");
  p = p ? strstr(p, ", then writing a checkpoint\n") : NULL;
  return p && strstr(p, "\n[nmt] step ") != NULL;
}

/* Issue 19: on a terminal the progress line moved only every train.log_every steps, and an
 * info line erased it until the next one. Now it is redrawn at least every 2 s, and drawn again
 * below any other line. The run here logs never (log_every 1e9) and is stopped by SIGTERM. */
NMT_TEST(cli_progress_line_on_a_terminal) {
  const char *dir = nmt_test_tmpdir();
  char ini[512];
  NMT_ASSERT(tiny_ini(dir, "pty", 1000000, "[train]\nlog_every = 1000000000\n", ini, sizeof ini));
  const char *argv[] = {"train", ini, NULL};
  int m = -1;
  pid_t pid = spawn_on_pty(argv, &m);
  NMT_ASSERT(pid > 0);
  static char buf[1 << 20];
  size_t len = 0;
  buf[0] = 0;
  int redraws = read_pty(m, buf, sizeof buf, &len, 120, three_redraws);
  kill(pid, SIGTERM);
  int stop = read_pty(m, buf, sizeof buf, &len, 60, stop_line_seen);
  int redrawn = read_pty(m, buf, sizeof buf, &len, 5, redrawn_after_stop);
  int rc = nmt_th_wait(pid, 120, NULL);
  size_t dummy = len;
  (void)read_pty(m, buf, sizeof buf, &dummy, 0.2, stop_line_seen);
  close(m);
  if (!redraws || !stop || !redrawn || rc != 75)
    nmt_test_fail(__FILE__, __LINE__, "redraws %d, stop %d, redrawn %d, exit %d; terminal: %.3000s",
                  redraws, stop, redrawn, rc, buf);
  NMT_ASSERT(redraws && stop && redrawn);
  NMT_ASSERT_EQ_INT(rc, 75);
  /* The redraws name steps the run reached; the last one shown is past step 0. */
  const char *last = NULL;
  for (const char *p = buf; (p = strstr(p, "\r\033[K[nmt] step ")) != NULL; p++) last = p;
  long step = -1;
  NMT_ASSERT(last && sscanf(last, "\r\033[K[nmt] step %ld/", &step) == 1);
  NMT_ASSERT(step > 0);
}

/* Issue 19: eval's sacreBLEU lines came as sacreBLEU prints them, the signature first, so the
 * BLEU and chrF2 scores sat in different columns. Now "BLEU  = x" and "chrF2 = y", aligned. */
NMT_TEST(cli_eval_sacrebleu_lines_aligned) {
  if (access("data/bible/train.shard", R_OK) != 0 || access("data/bible/spm.model", R_OK) != 0)
    NMT_SKIP("no prepared corpus in data/bible (make data)");
  char out[16384];
  if (system("python3 -c 'import sacrebleu' >/dev/null 2>&1") != 0)
    NMT_SKIP("no sacrebleu for python3 (tools/install-deps.sh --bleu)");
  const char *dir = nmt_test_tmpdir();
  char tiny[1024], args[4096];
  snprintf(tiny, sizeof tiny,
           "model.d_model=32 model.n_heads=2 model.d_ff=64 model.enc_layers=1 "
           "model.dec_layers=1 data.max_len=32 data.max_tokens=256 train.max_steps=2 "
           "train.valid_every=0 decode.max_extra_len=4 run.out_dir=%s/run",
           dir);
  snprintf(args, sizeof args, "train conf/bible-small.ini %s", tiny);
  NMT_ASSERT_EQ_INT(run_nmt(args, out, sizeof out), 0);
  snprintf(args, sizeof args, "head -n 8 data/bible/test.en > %s/x.en && head -n 8 "
           "data/bible/test.es > %s/x.es", dir, dir);
  NMT_ASSERT(system(args) == 0);
  snprintf(args, sizeof args, "eval conf/bible-small.ini %s --src %s/x.en --ref %s/x.es", tiny,
           dir, dir);
  int rc = run_nmt_stdout(args, out, sizeof out);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "eval: exit %d: %s", rc, out);
  NMT_ASSERT_EQ_INT(rc, 0);
  const char *bleu = strstr(out, "\nBLEU  = "), *chrf = strstr(out, "\nchrF2 = ");
  if (!bleu || !chrf) nmt_test_fail(__FILE__, __LINE__, "scores not aligned: %s", out);
  NMT_ASSERT(bleu && chrf);
  NMT_ASSERT(strstr(bleu, "nrefs:1|") != NULL); /* the signature is printed too */
}

/* ---- issue 38: several CONFIG files, later ones overriding earlier ones --------------------- */

/* config --dump a.ini b.ini: b's value of a key wins, a key only a sets stays, a bad value b
 * replaces is no error, the command line beats both; a value's error names its file, and a
 * missing second file is a config error (exit 2) naming it, for train too. bench allreduce
 * names both files as its config. */
NMT_TEST(cli_configs_layered) {
  const char *dir = nmt_test_tmpdir();
  char a[512], b[512], bad[512], args[2400], err[8192];
  static char out[65536];
  snprintf(a, sizeof a, "%s/a.ini", dir);
  snprintf(b, sizeof b, "%s/b.ini", dir);
  snprintf(bad, sizeof bad, "%s/bad.ini", dir);
  write_file(a, "[train]\nmax_steps = 500\nlog_every = 5\n[data]\nmax_len = 12x\n");
  write_file(b, "[train]\nmax_steps = 600\n[data]\nmax_len = 64\n");
  write_file(bad, "[train]\nlog_every = 0\n");
  snprintf(args, sizeof args, "config --dump %s %s", a, b);
  NMT_ASSERT_EQ_INT(run_nmt_stdout(args, out, sizeof out), 0);
  NMT_ASSERT(strstr(out, "\nmax_steps = 600\n") && strstr(out, "\nlog_every = 5\n") &&
             strstr(out, "\nmax_len = 64\n"));
  snprintf(args, sizeof args, "config --dump %s %s train.max_steps=7", a, b);
  NMT_ASSERT_EQ_INT(run_nmt_stdout(args, out, sizeof out), 0);
  NMT_ASSERT(strstr(out, "\nmax_steps = 7\n") != NULL);
  /* b then a: a's bad value takes effect, and the message names a. */
  snprintf(args, sizeof args, "config --dump %s %s", b, a);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  char want[1200];
  snprintf(want, sizeof want, "%s: [data] max_len = \"12x\": not an integer", a);
  NMT_ASSERT(strstr(err, want) != NULL);
  /* An error in the second file names the second file. */
  snprintf(args, sizeof args, "config --dump %s %s data.max_len=64", a, bad);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  snprintf(want, sizeof want, "%s: [train] log_every = \"0\": must be in", bad);
  NMT_ASSERT(strstr(err, want) != NULL);
  /* A missing second file: exit 2 (config error), naming it. */
  snprintf(args, sizeof args, "train %s %s/missing.ini", b, dir);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 2);
  snprintf(want, sizeof want, "%s/missing.ini: cannot open config: No such file", dir);
  NMT_ASSERT(strstr(err, want) && strstr(err, "nmt: config error (exit 2)"));
  snprintf(args, sizeof args, "bench allreduce %s %s --max-bytes 4K --iters 1 --warmup 0", a, b);
  NMT_ASSERT_EQ_INT(run_nmt_stdout(args, out, sizeof out), 0);
  snprintf(want, sizeof want, "# config: %s + %s (parallel.devices", a, b);
  if (!strstr(out, want)) nmt_test_fail(__FILE__, __LINE__, "no \"%s\" in: %.400s", want, out);
}

/* A model config and a corpus's data.ini as tools/prepare-data.sh writes it: training takes
 * the corpus from the second file, the run's config.ini holds the merged config, and --resume
 * works from config.ini alone and from the two files again (warning only about what changed);
 * eval finds the run's checkpoint through the two files. */
NMT_TEST(cli_train_model_config_and_data_ini) {
  const char *dir = nmt_test_tmpdir();
  char model[512], data[512], shard[512], valid[512], run[512], text[2400], args[3000],
      path[700];
  static char err[65536];
  snprintf(model, sizeof model, "%s/model.ini", dir);
  snprintf(data, sizeof data, "%s/data.ini", dir);
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(valid, sizeof valid, "%s/valid.shard", dir);
  snprintf(run, sizeof run, "%s/run", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 64, 3));
  NMT_ASSERT_OK(nmt_th_write_synthetic(valid, 16, 9));
  /* The model config names another corpus (as conf/bible-small.ini names the Bible). */
  NMT_ASSERT(nmt_th_write_ini(model, run, "data/other/train.shard", 2,
                              "[model]\nvocab = 8000\n") == 0);
  snprintf(text, sizeof text,
           "; %s — corpus syn (a -> b), written by tools/prepare-data.sh. Give it after a\n"
           "; model config, whose [data] keys and [model] vocab it replaces\n"
           "[data]\ntrain = \"%s\"\nvalid = \"%s\"\ntest = \"\"\n\n[model]\nvocab = %d\n",
           data, shard, valid, NMT_TH_VOCAB);
  write_file(data, text);
  snprintf(args, sizeof args, "train %s %s", model, data);
  int rc = run_nmt(args, err, sizeof err);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", args, rc, err);
  NMT_ASSERT_EQ_INT(rc, 0);
  snprintf(path, sizeof path, "%s/config.ini", run);
  char *merged = nmt_th_read_file(path, NULL);
  NMT_ASSERT(merged != NULL);
  char want[700];
  snprintf(want, sizeof want, "\ntrain = \"%s\"\n", shard);
  int ok = strstr(merged, want) && strstr(merged, "\nvocab = 40\n") &&
           strstr(merged, "\nd_model = 16\n") && strstr(merged, "\nmax_steps = 2\n");
  if (!ok) nmt_test_fail(__FILE__, __LINE__, "config.ini is not the merged config:\n%s", merged);
  free(merged);
  NMT_ASSERT(ok);
  /* --resume from the run directory's config.ini alone, as from any one-file run. */
  snprintf(args, sizeof args, "train %s train.max_steps=3 --resume", path);
  rc = run_nmt(args, err, sizeof err);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", args, rc, err);
  NMT_ASSERT(rc == 0 && strstr(err, "train.max_steps 2 -> 3"));
  /* --resume from the two files: the same merged config, so only max_steps changed. */
  snprintf(args, sizeof args, "train %s %s train.max_steps=4 --resume", model, data);
  rc = run_nmt(args, err, sizeof err);
  if (rc != 0 || !strstr(err, "train.max_steps 3 -> 4") || strstr(err, "data.train") ||
      strstr(err, "model.vocab"))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", args, rc, err);
  NMT_ASSERT_EQ_INT(rc, 0);
  snprintf(path, sizeof path, "%s/checkpoints/latest", run);
  char *latest = nmt_th_read_file(path, NULL);
  NMT_ASSERT(latest && !strncmp(latest, "step_4.ckpt", 11));
  free(latest);
  /* eval takes the two files too: its checkpoint is the run's latest, its shard data.ini's. */
  snprintf(args, sizeof args, "eval %s %s", model, data);
  rc = run_nmt(args, err, sizeof err);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", args, rc, err);
  NMT_ASSERT_EQ_INT(rc, 0);
}

/* Issue 38: `translate --help` and `eval --help` left out --nbest, --scores, --config and the
 * checkpoint as first argument. Each command's help is printed from its table of options
 * (src/main_help.c); this reads the parsers (src/main.c, cli.c, cmd_*.c) and fails for a flag one of them
 * accepts ("--x" as a whole string literal in cmd_X or in the functions it calls, but not
 * another command's) that is not an option line of `nmt X --help`, or not in `nmt --help`. */
NMT_TEST(cli_help_lists_every_parsed_option) {
  /* The command line's files: main.c, its shared parsing (cli.c) and the commands that live in
   * their own files (cmd_NAME.c, whose cli_cmd_NAME is the command). */
  glob_t g_files;
  if (glob("src/cmd_*.c", 0, NULL, &g_files) != 0)
    NMT_SKIP("no src/cmd_*.c (the suite runs from the repository root)");
  size_t cap = 1 << 20, len = 0;
  char *src = calloc(cap, 1);
  NMT_ASSERT(src != NULL);
  const char *fixed[] = {"src/main.c", "src/cli.c"};
  for (size_t k = 0; k < 2 + g_files.gl_pathc; k++) {
    const char *path = k < 2 ? fixed[k] : g_files.gl_pathv[k - 2];
    char *text = nmt_th_read_file(path, NULL);
    if (!text) {
      globfree(&g_files), free(src);
      NMT_SKIP("a file of the command line is missing (the suite runs from the repository root)");
    }
    size_t n = strlen(text);
    NMT_ASSERT(len + n + 2 < cap);
    src[len++] = '\n', memcpy(src + len, text, n), len += n;
    free(text);
  }
  globfree(&g_files);
  enum { MAX_FN = 96, MAX_FLAGS = 48 };
  static struct {
    char name[64];
    const char *body, *end;
  } fn[MAX_FN];
  int n_fn = 0;
  /* Functions: from a line "static ... name(" or "int name(" to the next line "}". */
  for (const char *p = src; (p = strchr(p, '\n')) != NULL && n_fn < MAX_FN; p++) {
    if (strncmp(p + 1, "static ", 7) && strncmp(p + 1, "int ", 4) && strncmp(p + 1, "void ", 5))
      continue;
    const char *paren = strchr(p + 1, '('), *eol = strchr(p + 1, '\n');
    const char *end = strstr(p + 1, "\n}\n");
    if (!paren || !end || (eol && paren > eol)) continue;
    const char *id = paren;
    while (id > p && (id[-1] == '_' || (id[-1] >= 'a' && id[-1] <= 'z') ||
                      (id[-1] >= '0' && id[-1] <= '9')))
      id--;
    if (paren - id <= 0 || paren - id >= 64) continue;
    const char *brace = strchr(paren, '{'), *semi = strchr(paren, ';');
    if (!brace || brace > end || (semi && semi < brace)) continue; /* a declaration */
    snprintf(fn[n_fn].name, sizeof fn[n_fn].name, "%.*s", (int)(paren - id), id);
    fn[n_fn].body = brace, fn[n_fn].end = end;
    n_fn++;
  }
  static const struct {
    const char *cmd, *flag;
  } exempt[] = {
      /* export's CKPT is its first argument; --ckpt is taken (cli_take_ckpt_arg) only to be refused
       * as a second checkpoint. */
      {"export", "--ckpt"},
  };
  static char help[65536], usage[16384];
  NMT_ASSERT_EQ_INT(run_nmt_stdout("--help", usage, sizeof usage), 0);
  int n_cmds = 0, n_checked = 0;
  for (int f = 0; f < n_fn; f++) {
    const char *name = fn[f].name;
    if (!strncmp(name, "cli_cmd_", 8)) name += 4;
    if (strncmp(name, "cmd_", 4) != 0) continue;
    char cmd[64];
    snprintf(cmd, sizeof cmd, "%s", name + 4);
    for (char *c = cmd; *c; c++)
      if (*c == '_') *c = '-';
    if (!strncmp(cmd, "bench-", 6)) cmd[5] = ' ';
    /* Its flags: in its body and in the non-command functions it calls (one level down, then
     * theirs: cli_take_ckpt_arg is called from the commands). */
    const char *flags[MAX_FLAGS];
    int n_flags = 0, uses_ckpt_arg = 0;
    int todo[MAX_FN], n_todo = 0, seen[MAX_FN] = {0};
    todo[n_todo++] = f, seen[f] = 1;
    while (n_todo) {
      int g = todo[--n_todo];
      for (const char *q = fn[g].body; q < fn[g].end; q++) {
        if (q[0] == '"' && q[1] == '-' && q[2] == '-') {
          const char *e = q + 3;
          while ((*e >= 'a' && *e <= 'z') || (*e >= '0' && *e <= '9') || *e == '-') e++;
          if (*e == '"' && e > q + 3 && n_flags < MAX_FLAGS) {
            static char store[MAX_FN][MAX_FLAGS][40];
            snprintf(store[f][n_flags], 40, "%.*s", (int)(e - q - 1), q + 1);
            int dup = 0;
            for (int k = 0; k < n_flags; k++) dup |= !strcmp(flags[k], store[f][n_flags]);
            if (!dup) flags[n_flags] = store[f][n_flags], n_flags++;
          }
        }
      }
      for (int h = 0; h < n_fn; h++) {
        if (seen[h] || !strncmp(fn[h].name, "cmd_", 4) || !strncmp(fn[h].name, "cli_cmd_", 8))
          continue;
        char call[72];
        snprintf(call, sizeof call, "%s(", fn[h].name);
        const char *at = strstr(fn[g].body, call);
        if (at && at < fn[g].end) {
          seen[h] = 1, todo[n_todo++] = h;
          if (!strcmp(fn[h].name, "cli_take_ckpt_arg")) uses_ckpt_arg = 1;
        }
      }
    }
    n_cmds++;
    char args[128];
    snprintf(args, sizeof args, "%s --help", cmd);
    int rc = run_nmt_stdout(args, help, sizeof help);
    if (rc != 0) {
      nmt_test_fail(__FILE__, __LINE__, "nmt %s: exit %d", args, rc);
      continue;
    }
    /* A command that reads a checkpoint says so in its usage line. */
    char first[256];
    snprintf(first, sizeof first, "%.*s", (int)strcspn(help, "\n"), help);
    if (uses_ckpt_arg && !strstr(first, "CKPT"))
      nmt_test_fail(__FILE__, __LINE__, "nmt %s: its usage does not name CKPT: %.200s", args,
                    help);
    for (int k = 0; k < n_flags; k++) {
      int skip = 0;
      for (size_t x = 0; x < sizeof exempt / sizeof exempt[0]; x++)
        skip |= !strcmp(exempt[x].cmd, cmd) && !strcmp(exempt[x].flag, flags[k]);
      if (skip) continue;
      n_checked++;
      char line[64];
      snprintf(line, sizeof line, "\n  %s", flags[k]);
      const char *at = strstr(help, line);
      while (at && at[strlen(line)] != ' ' && at[strlen(line)] != '\n')
        at = strstr(at + 1, line);
      if (!at)
        nmt_test_fail(__FILE__, __LINE__, "nmt %s: no option line for %s, which %s "
                      "accepts", args, flags[k], fn[f].name);
      if (!strstr(usage, flags[k]))
        nmt_test_fail(__FILE__, __LINE__, "nmt --help: no %s (nmt %s accepts it)", flags[k], cmd);
    }
  }
  free(src);
  /* The scan itself: every command, and the flags of the commands that have them. */
  if (n_cmds < 11 || n_checked < 40)
    nmt_test_fail(__FILE__, __LINE__, "found %d commands and %d flags in src/main.c, cli.c, cmd_*.c: did the "
                  "scan break?", n_cmds, n_checked);
}

/* ---- issue 38: shard checksums ------------------------------------------------------------ */

/* dir/NAME: `from` with bit 0 of its first source id flipped, an id the other checks accept
 * (the synthetic shard's ids are 4..39). 1 on success. */
static int flip_first_source_id(const char *from, const char *dir, const char *name, char *to,
                                size_t cap) {
  size_t n = 0;
  unsigned char *b = (unsigned char *)nmt_th_read_file(from, &n);
  uint64_t src_ids = 0;
  if (b && n > 72) memcpy(&src_ids, b + 40, 8);
  int ok = b && src_ids > 0 && src_ids < n;
  if (ok) b[src_ids] ^= 1;
  snprintf(to, cap, "%s/%s", dir, name);
  FILE *f = ok ? fopen(to, "wb") : NULL;
  ok = f && fwrite(b, 1, n, f) == n;
  if (f && fclose(f) != 0) ok = 0;
  free(b);
  return ok;
}

/* A shard byte changed since the writer closed the file (one id into another valid id) was
 * trained on, validated and evaluated without a word. Now `shard-info` prints the CRCs it
 * verified, and `shard-info`, `train` (as data.train or data.valid) and `eval --shard` refuse
 * the changed file with the data exit code 3, naming it and the mismatch; train before step
 * 1 (before the run directory is made). */
NMT_TEST(cli_shard_checksum_refused_by_every_command) {
  const char *dir = nmt_test_tmpdir();
  char ini[512], shard[600], bad[700], args[4096], err[16384], out[4096], want[256];
  NMT_ASSERT(tiny_ini(dir, "crc", 1, NULL, ini, sizeof ini));
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  nmt_shard *sh = NULL;
  NMT_ASSERT_OK(nmt_shard_open(shard, 0, &sh));
  uint32_t hc = 0, pc = 0;
  int has = nmt_shard_crc32(sh, &hc, &pc);
  nmt_shard_close(sh);
  NMT_ASSERT_EQ_INT(has, 1);
  snprintf(args, sizeof args, "shard-info %s", shard);
  NMT_ASSERT_EQ_INT(run_nmt_stdout(args, out, sizeof out), 0);
  snprintf(want, sizeof want, "syn.shard: checksum: header crc32 %08x, payload crc32 %08x "
           "(verified, version 2 shard)\n", hc, pc);
  if (!strstr(out, want)) nmt_test_fail(__FILE__, __LINE__, "shard-info: %s", out);
  NMT_ASSERT(strstr(out, want) != NULL);
  /* A clean run, for its checkpoint. */
  snprintf(args, sizeof args, "train %s", ini);
  NMT_ASSERT_EQ_INT(run_nmt(args, err, sizeof err), 0);

  NMT_ASSERT(flip_first_source_id(shard, dir, "bad.shard", bad, sizeof bad));
  const char *what[4] = {"shard-info", "train data.train", "train data.valid", "eval --shard"};
  for (int k = 0; k < 4; k++) {
    char run[700];
    snprintf(run, sizeof run, "%s/run-bad%d", dir, k);
    if (k == 0) snprintf(args, sizeof args, "shard-info %s", bad);
    else if (k == 1 || k == 2)
      snprintf(args, sizeof args, "train %s %s=%s run.out_dir=%s", ini,
               k == 1 ? "data.train" : "data.valid", bad, run);
    else snprintf(args, sizeof args, "eval %s --shard %s", ini, bad);
    int rc = run_nmt(args, err, sizeof err);
    if (rc != 3 || !strstr(err, bad) || !strstr(err, "payload checksum mismatch (stored ") ||
        strstr(err, "step 1"))
      nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 3 naming %s: %s", what[k], rc, bad,
                    err);
    NMT_ASSERT_EQ_INT(rc, 3);
    if (k == 1 || k == 2) NMT_ASSERT(access(run, F_OK) != 0);
  }
}

/* A version 1 shard (what data/ holds from before version 2) is still read: shard-info says it
 * has no checksum, and a run trains on it with one warning naming it. */
NMT_TEST(cli_shard_version_1_still_read) {
  const char *dir = nmt_test_tmpdir();
  char ini[512], shard[600], v1[600], args[4096], err[16384], out[4096];
  NMT_ASSERT(tiny_ini(dir, "v1", 1, NULL, ini, sizeof ini));
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(v1, sizeof v1, "%s/v1.shard", dir);
  NMT_ASSERT_EQ_INT(nmt_th_shard_to_v1(shard, v1), 0);
  snprintf(args, sizeof args, "shard-info %s", v1);
  NMT_ASSERT_EQ_INT(run_nmt_stdout(args, out, sizeof out), 0);
  if (!strstr(out, "v1.shard: 64 pairs, vocab 40, ") ||
      !strstr(out, "v1.shard: checksum: none (version 1 shard)\n"))
    nmt_test_fail(__FILE__, __LINE__, "shard-info: %s", out);
  NMT_ASSERT(!nmt_test_failed());
  snprintf(args, sizeof args, "train %s data.train=%s", ini, v1);
  int rc = run_nmt(args, err, sizeof err);
  char warning[700];
  snprintf(warning, sizeof warning, "[nmt] warn: %s: a version 1 shard has no checksum", v1);
  if (rc != 0 || nmt_th_count(err, warning) != 1)
    nmt_test_fail(__FILE__, __LINE__, "train on %s: exit %d: %s", v1, rc, err);
  NMT_ASSERT_EQ_INT(rc, 0);
}
