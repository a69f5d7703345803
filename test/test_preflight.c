/* test_preflight.c — issue 38: what a run needs later is checked at its start, and a
 * validation that fails mid-run keeps the step's work.
 *
 * At create, before any step (src/engine/preflight.c): the temporary directory validation BLEU
 * writes its hypotheses to ($TMPDIR, or /tmp), sacreBLEU, and the free space for one checkpoint.
 * A validation that fails after that (the scorer broken, the temporary directory gone) writes
 * the checkpoint of its step before the run ends with the validation's error.
 *
 * The runs are the real binary on the Bible corpus's data with a tiny model on one CPU worker;
 * validation BLEU scores a split of its own: six lines of the valid text beside a link to the
 * valid shard, so a decode is cheap. Where sacreBLEU must work or break on cue, a stand-in
 * `sacrebleu` package on PYTHONPATH prints sacreBLEU's text format (no real sacreBLEU needed):
 * NMT_TEST_SACREBLEU=fail makes every call after the first (the check at start) fail, rmtmp
 * makes the first call remove $TMPDIR. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "nmt/checkpoint.h"
#include "nmt/status.h"
#include "test.h"
#include "../src/engine/preflight.h"

/* ------------------------------------------------------------------------------------------ */
/* helpers                                                                                    */

typedef struct {
  char dir[512], split[600], py[600], run[600], log[600], tmp[600];
} fixture;

static const char *const STANDIN =
    "import os, sys\n"
    "mode = os.environ.get('NMT_TEST_SACREBLEU', '')\n"
    "calls = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'calls')\n"
    "n = os.path.getsize(calls) if os.path.exists(calls) else 0\n"
    "open(calls, 'a').write('x')\n"
    "if mode == 'fail' and n >= 1:\n"
    "    sys.exit('sacrebleu stand-in: broken after the first call')\n"
    "print('BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:stand-in = 1.00 "
    "10.0/1.0/0.1/0.0 (BP = 1.000 ratio = 1.000 hyp_len = 10 ref_len = 10)')\n"
    "print('chrF2|nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:stand-in = 10.00')\n"
    "if mode == 'rmtmp':\n"
    "    os.rmdir(os.environ['TMPDIR'])\n";

static int write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (!f) return 0;
  int ok = fputs(text, f) >= 0;
  return fclose(f) == 0 && ok;
}

/* The split (six lines of the Bible's valid text, its languages, a link to its shard), the
 * stand-in package and a temporary directory under the test's directory. */
static int fixture_init(fixture *f) {
  if (access("data/bible/valid.en", R_OK) || access("data/bible/spm.model", R_OK) ||
      access("data/bible/valid.shard", R_OK)) {
    nmt_test_fail(__FILE__, __LINE__, "data/bible missing: run tools/prepare-bible.sh");
    return 0;
  }
  snprintf(f->dir, sizeof f->dir, "%s", nmt_test_tmpdir());
  snprintf(f->split, sizeof f->split, "%s/split", f->dir);
  snprintf(f->py, sizeof f->py, "%s/py", f->dir);
  snprintf(f->run, sizeof f->run, "%s/run", f->dir);
  snprintf(f->log, sizeof f->log, "%s/train.log", f->dir);
  snprintf(f->tmp, sizeof f->tmp, "%s/tmp", f->dir);
  char cmd[8192], path[700], cwd[512];
  if (!getcwd(cwd, sizeof cwd)) return 0;
  snprintf(cmd, sizeof cmd,
           "mkdir -p '%s' '%s/sacrebleu' '%s' && head -n 6 data/bible/valid.en >'%s/valid.en' && "
           "head -n 6 data/bible/valid.es >'%s/valid.es' && cp data/bible/spm.settings '%s/' && "
           "ln -sf '%s/data/bible/valid.shard' '%s/valid.shard' && : >'%s/sacrebleu/__init__.py'",
           f->split, f->py, f->tmp, f->split, f->split, f->split, cwd, f->split, f->py);
  fflush(stdout);
  int st = system(cmd);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) return 0;
  snprintf(path, sizeof path, "%s/sacrebleu/__main__.py", f->py);
  return write_text(path, STANDIN);
}

/* Runs `env ENV nmt train` on the tiny model (validation with BLEU every 2 steps, no periodic
 * checkpoint; `extra`: more key=value arguments) with its output into f->log; returns the exit
 * code. */
static int train(const fixture *f, const char *env, long max_steps, const char *extra) {
  char cmd[16384];
  snprintf(cmd, sizeof cmd,
           "env PYTHONDONTWRITEBYTECODE=1 %s %s/nmt train conf/bible-small.ini run.out_dir=%s "
           "model.d_model=16 model.n_heads=2 model.d_ff=32 model.enc_layers=1 "
           "model.dec_layers=1 model.max_positions=160 data.max_tokens=256 data.max_len=64 "
           "data.valid=%s/valid.shard parallel.devices=1 parallel.device=cpu "
           "train.max_steps=%ld train.log_every=1 train.valid_every=2 train.save_every=0 "
           "train.valid_bleu=on train.valid_beam=1 decode.max_extra_len=5 %s >%s 2>&1",
           env, nmt_test_build_dir(), f->run, f->split, max_steps, extra, f->log);
  fflush(stdout);
  int st = system(cmd);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* A refusal at start: exit `code`, the log names each of `want` (NULL-terminated), no step was
 * trained and run.out_dir was not made. */
static void assert_refused(const fixture *f, int code, int want_code, const char *const *want) {
  char *text = nmt_th_read_file(f->log, NULL);
  int named = text != NULL;
  for (int i = 0; named && want[i]; i++) named = strstr(text, want[i]) != NULL;
  const int trained = text && strstr(text, "training ") && strstr(text, " parameters on ");
  const int dir_made = access(f->run, F_OK) == 0;
  if (code != want_code || !named || trained || dir_made)
    nmt_test_fail(__FILE__, __LINE__, "exit %d (want %d), message %s, %s, run.out_dir %s; log:\n%s",
                  code, want_code, named ? "named what it should" : "missing a part",
                  trained ? "training started" : "no training", dir_made ? "made" : "not made",
                  text ? text : "(none)");
  free(text);
}

/* ------------------------------------------------------------------------------------------ */
/* at start                                                                                   */

/* TMPDIR names a directory that does not exist: refused at create (exit 6), naming TMPDIR and
 * the path, before the first step and before run.out_dir is made; before the check the run
 * trained to its first validation and lost it there. */
NMT_TEST(preflight_tmpdir_missing_refused_before_step_1) {
  fixture f;
  if (!fixture_init(&f)) return;
  char env[4096], gone[700];
  snprintf(gone, sizeof gone, "%s/no-such-dir", f.dir);
  snprintf(env, sizeof env, "TMPDIR=%s PYTHONPATH=%s", gone, f.py);
  const int code = train(&f, env, 4, "");
  const char *want[] = {"TMPDIR", gone, "does not exist", NULL};
  assert_refused(&f, code, nmt_status_exit_code(NMT_ERR_IO), want);
}

/* TMPDIR names a place no file can be created in: refused at create (exit 6). Not as root,
 * a directory of mode 0500; as root, where that is still writable, a path under a regular
 * file, which nobody can create files in. */
NMT_TEST(preflight_tmpdir_unwritable_refused_before_step_1) {
  fixture f;
  if (!fixture_init(&f)) return;
  char env[4096], bad[800];
  const char *why;
  if (geteuid() != 0) {
    snprintf(bad, sizeof bad, "%s/readonly", f.dir);
    NMT_ASSERT(mkdir(bad, 0500) == 0);
    why = "cannot create a file there";
  } else {
    char file[700];
    snprintf(file, sizeof file, "%s/a-file", f.dir);
    NMT_ASSERT(write_text(file, "x\n"));
    snprintf(bad, sizeof bad, "%s/sub", file);
    why = "Not a directory";
  }
  snprintf(env, sizeof env, "TMPDIR=%s PYTHONPATH=%s", bad, f.py);
  const int code = train(&f, env, 4, "");
  const char *want[] = {"TMPDIR", bad, why, NULL};
  assert_refused(&f, code, nmt_status_exit_code(NMT_ERR_IO), want);
  if (geteuid() != 0) chmod(bad, 0700);
}

/* python3 runs but has no sacrebleu package (a python3 on PATH that ignores site-packages):
 * refused at create (exit 6) with the install advice, before the first step. */
NMT_TEST(preflight_sacrebleu_missing_refused_before_step_1) {
  fixture f;
  if (!fixture_init(&f)) return;
  char real[512] = "", bin[700], shim[800], text[1200], env[8192];
  if (nmt_th_capture("python3 -c 'import sys; print(sys.executable)' 2>/dev/null", real,
                     sizeof real) != 0 || !real[0])
    NMT_SKIP("no python3");
  real[strcspn(real, "\n")] = 0;
  snprintf(bin, sizeof bin, "%s/bin", f.dir);
  snprintf(shim, sizeof shim, "%s/python3", bin);
  snprintf(text, sizeof text, "#!/bin/sh\nexec '%s' -S \"$@\"\n", real);
  NMT_ASSERT(mkdir(bin, 0755) == 0 && write_text(shim, text) && chmod(shim, 0755) == 0);
  snprintf(env, sizeof env, "PATH=%s:%s TMPDIR=%s", bin, getenv("PATH") ? getenv("PATH") : "",
           f.tmp);
  const int code = train(&f, env, 4, "");
  const char *want[] = {"valid_bleu = on", "sacrebleu", "tools/install-deps.sh --bleu", NULL};
  assert_refused(&f, code, nmt_status_exit_code(NMT_ERR_IO), want);
}

/* The free-space check: a checkpoint larger than the file system's free space is refused with
 * NMT_ERR_IO naming the directory and both sizes; one byte passes; a missing directory is
 * checked at its nearest existing parent. */
NMT_TEST(preflight_space_refuses_more_than_free) {
  const char *dir = nmt_test_tmpdir();
  struct statvfs sv;
  NMT_ASSERT(statvfs(dir, &sv) == 0);
  const unsigned long long avail = (unsigned long long)sv.f_bavail * sv.f_frsize;
  char missing[700];
  snprintf(missing, sizeof missing, "%s/not/yet", dir);
  NMT_ASSERT_OK(nmt__preflight_space(missing, 1, "a test"));
  nmt_status s = nmt__preflight_space(missing, avail + (1ull << 40), "a test");
  const char *msg = nmt_last_error();
  printf("# %s\n", msg);
  NMT_ASSERT_EQ_STATUS(s, NMT_ERR_IO);
  NMT_ASSERT(strstr(msg, missing) && strstr(msg, "free") && strstr(msg, "run.out_dir"));
}

/* nmt_ckpt_file_bytes, which the free-space check uses, is the size of the file the trainer's
 * checkpoint writer makes (with moments, metadata and a best record). */
NMT_TEST(preflight_ckpt_file_bytes_is_the_written_size) {
  const size_t n = 1000;
  float *p = calloc(3 * n, sizeof(float));
  NMT_ASSERT(p);
  nmt_ckpt_meta meta = {0};
  char cfg_text[] = "[run]\nseed = 1\n";
  meta.config = cfg_text;
  nmt_ckpt_header h = {0};
  h.vocab = 10, h.d_model = 4, h.n_heads = 1, h.d_ff = 8, h.enc_layers = h.dec_layers = 1;
  h.n_params = n, h.has_moments = 1, h.step = 3, h.best_step = 2, h.best_value = 1.5;
  h.meta = &meta;
  char path[700];
  snprintf(path, sizeof path, "%s/x.ckpt", nmt_test_tmpdir());
  nmt_status s = nmt_ckpt_write(path, &h, p, p + n, p + 2 * n);
  free(p);
  NMT_ASSERT_OK(s);
  struct stat sb;
  NMT_ASSERT(stat(path, &sb) == 0);
  NMT_ASSERT_EQ_INT((long long)nmt_ckpt_file_bytes(&h), (long long)sb.st_size);
}

/* ------------------------------------------------------------------------------------------ */
/* a validation that fails mid-run                                                            */

/* After a validation failed at step 2 of 4 (exit `want_code`): checkpoints/step_2.ckpt is a
 * valid checkpoint of step 2 with moments, `latest` names it, the log says it was written
 * before exiting, status.json says failed with that exit code. Before the fix the run had no
 * checkpoint at all (train.save_every = 0: the first would have been step 4's). */
static void assert_kept(const fixture *f, int code, int want_code, const char *cause) {
  char *text = nmt_th_read_file(f->log, NULL);
  char path[700], latest[64] = "";
  snprintf(path, sizeof path, "%s/checkpoints/step_2.ckpt", f->run);
  nmt_ckpt_header h;
  memset(&h, 0, sizeof h);
  nmt_status rs = nmt_ckpt_read(path, NULL, &h, NULL, NULL, NULL);
  snprintf(path, sizeof path, "%s/checkpoints/latest", f->run);
  char *l = nmt_th_read_file(path, NULL);
  if (l) snprintf(latest, sizeof latest, "%.*s", (int)strcspn(l, "\n"), l);
  free(l);
  snprintf(path, sizeof path, "%s/status.json", f->run);
  char *st = nmt_th_read_file(path, NULL), state[32] = "";
  const int status_ok = st && nmt_th_json_str(st, "state", state, sizeof state) &&
                        !strcmp(state, "failed") && nmt_th_json_num(st, "exit_code") == want_code;
  free(st);
  const int said = text && strstr(text, cause) &&
                   strstr(text, "checkpoint step_2 written before exiting");
  if (code != want_code || rs != NMT_OK || h.step != 2 || !h.has_moments ||
      strcmp(latest, "step_2.ckpt") || !status_ok || !said)
    nmt_test_fail(__FILE__, __LINE__, "exit %d (want %d); step_2.ckpt: %s (step %lld); latest "
                  "\"%s\"; status.json %s; log %s:\n%s", code, want_code, nmt_status_str(rs),
                  (long long)h.step, latest, status_ok ? "ok" : "wrong",
                  said ? "says it" : "does not say it", text ? text : "(none)");
  free(text);
}

/* sacreBLEU passes the check at start, then fails at the first validation (step 2 of 4). */
NMT_TEST(preflight_scorer_failing_mid_run_keeps_the_step) {
  fixture f;
  if (!fixture_init(&f)) return;
  char env[4096];
  snprintf(env, sizeof env, "TMPDIR=%s PYTHONPATH=%s NMT_TEST_SACREBLEU=fail", f.tmp, f.py);
  const int code = train(&f, env, 4, "");
  assert_kept(&f, code, nmt_status_exit_code(NMT_ERR_IO), "broken after the first call");
}

/* The same with ZeRO on two workers: every rank's shard of the moments is gathered into the
 * checkpoint after the others were aborted in the validation's all-reduce. */
NMT_TEST(preflight_scorer_failing_mid_run_keeps_the_step_with_zero) {
  fixture f;
  if (!fixture_init(&f)) return;
  char env[4096];
  snprintf(env, sizeof env, "TMPDIR=%s PYTHONPATH=%s NMT_TEST_SACREBLEU=fail", f.tmp, f.py);
  const int code = train(&f, env, 4, "parallel.devices=2 parallel.zero=1");
  assert_kept(&f, code, nmt_status_exit_code(NMT_ERR_IO), "broken after the first call");
}

/* $TMPDIR exists at start and is removed before the first validation (here by the stand-in's
 * first call, the check at start): the hypotheses cannot be written at step 2. */
NMT_TEST(preflight_tmpdir_removed_mid_run_keeps_the_step) {
  fixture f;
  if (!fixture_init(&f)) return;
  char env[4096];
  snprintf(env, sizeof env, "TMPDIR=%s PYTHONPATH=%s NMT_TEST_SACREBLEU=rmtmp", f.tmp, f.py);
  const int code = train(&f, env, 4, "");
  assert_kept(&f, code, nmt_status_exit_code(NMT_ERR_IO), f.tmp);
}
