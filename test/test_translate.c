/* test_translate.c — the translation side of issue 19, end to end with the real binary on a
 * tiny model trained for two steps on the Bible corpus (vocabulary 8000, d_model 16):
 * checkpoints that describe themselves (translate, eval, export and average from a checkpoint
 * alone, also copied elsewhere with no PATH; a config that disagrees is refused naming the key,
 * both values and both sources; a version-1 checkpoint still works with its config), streaming
 * (a translation arrives while stdin is still open), SIGINT (exit 75, what was translated is
 * written), --nbest and --scores, eval --split test with BLEU and chrF, and the in-memory
 * functions validation BLEU will use (nmt_translate_to_text, nmt_eval_score_hyps). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include "helpers.h"
#include "nmt/checkpoint.h"
#include "nmt/eval.h"
#include "nmt/model.h"
#include "nmt/translate.h"
#include "test.h"

#define TINY                                                                                 \
  "model.d_model=16 model.n_heads=2 model.d_ff=32 model.enc_layers=1 model.dec_layers=1 "    \
  "model.max_positions=77 train.max_steps=2 train.save_every=0 train.valid_every=0 "         \
  "data.max_tokens=256 data.max_len=64 parallel.devices=1 parallel.device=cpu"

typedef struct {
  char dir[512], ckpt[768], in[768], ref[768];
  char repo[512]; /* the repository root (the tests' working directory) */
} tiny;

/* Runs `sh -c cmd` (cwd: the repository root) with stdout to out_path and stderr to err_path
 * (either may be NULL: /dev/null); returns the exit code. */
static int sh(const char *cmd, const char *out_path, const char *err_path) {
  size_t cap = strlen(cmd) + 2048;
  char *full = malloc(cap);
  if (!full) return -1;
  snprintf(full, cap, "%s >%s 2>%s", cmd, out_path ? out_path : "/dev/null",
           err_path ? err_path : "/dev/null");
  fflush(stdout);
  int st = system(full);
  free(full);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int need_data(void) {
  if (access("data/bible/spm.model", R_OK) == 0 && access("data/bible/train.shard", R_OK) == 0)
    return 1;
  nmt_test_fail(__FILE__, __LINE__, "data/bible missing: run tools/prepare-bible.sh (make test "
                "does) from the repository root");
  return 0;
}

/* Trains the tiny model in DIR/run (two steps) and writes the first 7 test verses to DIR/in.en
 * and their references to DIR/ref.es. */
static int tiny_setup(tiny *t, const char *extra) {
  if (!need_data()) return 0;
  snprintf(t->dir, sizeof t->dir, "%s", nmt_test_tmpdir());
  snprintf(t->ckpt, sizeof t->ckpt, "%s/run/checkpoints/step_2.ckpt", t->dir);
  snprintf(t->in, sizeof t->in, "%s/in.en", t->dir);
  snprintf(t->ref, sizeof t->ref, "%s/ref.es", t->dir);
  if (!getcwd(t->repo, sizeof t->repo)) return 0;
  char cmd[4096], log[768];
  snprintf(log, sizeof log, "%s/train.log", t->dir);
  snprintf(cmd, sizeof cmd, "%s/nmt train conf/bible-small.ini run.out_dir=%s/run " TINY " %s",
           nmt_test_build_dir(), t->dir, extra ? extra : "");
  int rc = sh(cmd, log, log);
  if (rc != 0) {
    nmt_test_fail(__FILE__, __LINE__, "training failed (exit %d), see %s", rc, log);
    return 0;
  }
  snprintf(cmd, sizeof cmd, "head -7 data/bible/test.en");
  if (sh(cmd, t->in, NULL) != 0) return 0;
  snprintf(cmd, sizeof cmd, "head -7 data/bible/test.es");
  return sh(cmd, t->ref, NULL) == 0;
}

static char *slurp(const char *path) { return nmt_th_read_file(path, NULL); }

static int count_char(const char *s, char c) {
  int n = 0;
  for (; s && *s; s++) n += *s == c;
  return n;
}

/* ------------------------------------------------------------------------------------------ */

NMT_TEST(translate_from_checkpoint_alone) {
  tiny t;
  if (!tiny_setup(&t, NULL)) return;
  char cmd[8192], o1[800], o2[800], o3[800], err[800], away[800];
  const char *nmt = nmt_test_build_dir();
  snprintf(o1, sizeof o1, "%s/o1", t.dir);
  snprintf(o2, sizeof o2, "%s/o2", t.dir);
  snprintf(o3, sizeof o3, "%s/o3", t.dir);
  snprintf(err, sizeof err, "%s/err", t.dir);
  /* The checkpoint carries its config and SentencePiece model. */
  nmt_ckpt_header h;
  nmt_ckpt_meta m;
  NMT_ASSERT_OK(nmt_ckpt_read_meta(t.ckpt, &h, &m));
  NMT_ASSERT_EQ_INT(h.version, 2);
  int meta_ok = m.config && strstr(m.config, "\nd_model = 16\n") &&
                strstr(m.config, "\nmax_positions = 77\n") && m.spm_model_path &&
                !strcmp(m.spm_model_path, "data/bible/spm.model");
  size_t spm_len;
  char *spm = nmt_th_read_file("data/bible/spm.model", &spm_len);
  meta_ok = meta_ok && spm && m.spm_model_bytes == spm_len && !memcmp(m.spm_model, spm, spm_len);
  free(spm);
  nmt_ckpt_meta_free(&m);
  NMT_ASSERT(meta_ok);
  /* CKPT alone == CONFIG + --ckpt. */
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --input %s", nmt, t.ckpt, t.in);
  NMT_ASSERT_EQ_INT(sh(cmd, o1, err), 0);
  snprintf(cmd, sizeof cmd, "%s/nmt translate conf/bible-small.ini " TINY " --ckpt %s --input %s",
           nmt, t.ckpt, t.in);
  NMT_ASSERT_EQ_INT(sh(cmd, o2, err), 0);
  char *a = slurp(o1), *b = slurp(o2);
  NMT_ASSERT(a && b);
  NMT_ASSERT_EQ_INT(count_char(a, '\n'), 7);
  NMT_ASSERT(!strcmp(a, b));
  free(b);
  /* Copied elsewhere, run from there with no PATH: no spm_encode, no data/ directory. */
  snprintf(away, sizeof away, "%s/away", t.dir);
  NMT_ASSERT(mkdir(away, 0755) == 0);
  char exe[1200];
  snprintf(exe, sizeof exe, "%s%s%s/nmt", nmt[0] == '/' ? "" : t.repo, nmt[0] == '/' ? "" : "/",
           nmt);
  snprintf(cmd, sizeof cmd, "cp %s %s/model.ckpt && cd %s && PATH=/nonexistent %s translate "
           "model.ckpt --input %s", t.ckpt, away, away, exe, t.in);
  NMT_ASSERT_EQ_INT(sh(cmd, o3, err), 0);
  char *c = slurp(o3), *e = slurp(err);
  NMT_ASSERT(c && e);
  NMT_ASSERT(!strcmp(a, c));
  NMT_ASSERT(strstr(e, "sh:") == NULL);
  free(a), free(c), free(e);
}

/* parallel.devices = N on the CPU: N decoders take a window's batches in turn, each on one
 * core; the output (text, n-best with scores) is byte for byte that of one decoder. 150 lines
 * in batches of 8: a window of 16 batches, then a shorter one. */
NMT_TEST(translate_parallel_decoders_same_output) {
  tiny t;
  if (!tiny_setup(&t, NULL)) return;
  char cmd[4096], in[800], o0[800], o1[800], err[800], *o[2] = {o0, o1};
  const char *nmt = nmt_test_build_dir();
  snprintf(in, sizeof in, "%s/in150.en", t.dir);
  snprintf(err, sizeof err, "%s/err", t.dir);
  NMT_ASSERT_EQ_INT(sh("head -150 data/bible/test.en", in, NULL), 0);
  const char *modes[3] = {"decode.beam=1", "decode.beam=4 --nbest 2", "decode.beam=3 "
                          "decode.beam_rule=full --scores"};
  for (int m = 0; m < 3; m++) {
    for (int k = 0; k < 2; k++) {
      snprintf(o[k], sizeof o0, "%s/o%d.%d", t.dir, m, k);
      snprintf(cmd, sizeof cmd, "%s/nmt translate %s --input %s decode.batch_sentences=8 "
               "parallel.device=cpu parallel.devices=%d decode.max_extra_len=5 %s", nmt, t.ckpt,
               in, k ? 3 : 1, modes[m]);
      NMT_ASSERT_EQ_INT(sh(cmd, o[k], err), 0);
      char *e = slurp(err);
      char want[64];
      snprintf(want, sizeof want, "on %d ref decoder(s)", k ? 3 : 1);
      /* ... and the CPU time of decoding apart from opening (bench/ctranslate2.sh reads it) */
      const int said = e && strstr(e, want) && strstr(e, "decoded 150 sentences") &&
                       strstr(e, "; CPU time ") && strstr(e, " s decoding, ");
      free(e);
      NMT_ASSERT(said);
    }
    char *a = slurp(o[0]), *b = slurp(o[1]);
    const int same = a && b && count_char(a, '\n') >= 150 && !strcmp(a, b);
    free(a), free(b);
    NMT_ASSERT(same);
  }
}

/* A version-1 copy of a version-2 checkpoint: same header fields and arrays, no metadata. */
static int write_v1(const char *v2, const char *v1) {
  size_t n;
  unsigned char *b = (unsigned char *)nmt_th_read_file(v2, &n);
  if (!b) return 0;
  uint64_t meta = 0;
  for (int i = 0; i < 8; i++) meta |= (uint64_t)b[104 + i] << (8 * i);
  size_t rest = n - 128 - (size_t)meta; /* arrays + crc */
  memmove(b + 128, b + 128 + meta, rest);
  n = 128 + rest;
  b[8] = 1;
  memset(b + 104, 0, 8);
  uint32_t crc = (uint32_t)crc32(0, b, (uInt)(n - 4));
  for (int i = 0; i < 4; i++) b[n - 4 + i] = (unsigned char)(crc >> (8 * i));
  FILE *f = fopen(v1, "wb");
  int ok = f && fwrite(b, 1, n, f) == n;
  if (f) ok = fclose(f) == 0 && ok;
  free(b);
  return ok;
}

NMT_TEST(translate_config_must_agree_with_checkpoint) {
  tiny t;
  if (!tiny_setup(&t, NULL)) return;
  char cmd[4096], err[800], v1[800], o[800];
  const char *nmt = nmt_test_build_dir();
  snprintf(err, sizeof err, "%s/err", t.dir);
  snprintf(o, sizeof o, "%s/o", t.dir);
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s model.d_model=32 --input %s", nmt, t.ckpt, t.in);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, err), 7);
  char *e = slurp(err);
  NMT_ASSERT(e && strstr(e, "d_model = 32 in the command line but 16 in the checkpoint") &&
             strstr(e, t.ckpt));
  free(e);
  snprintf(cmd, sizeof cmd, "%s/nmt translate conf/bible-small.ini --ckpt %s --input %s", nmt,
           t.ckpt, t.in);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, err), 7);
  e = slurp(err);
  NMT_ASSERT(e && strstr(e, "d_model = 256 in conf/bible-small.ini but 16 in the checkpoint"));
  free(e);
  /* Version 1: alone it needs its config (exit 2, saying so); with it, it translates as the
   * version-2 file does. */
  snprintf(v1, sizeof v1, "%s/v1.ckpt", t.dir);
  NMT_ASSERT(write_v1(t.ckpt, v1));
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --input %s", nmt, v1, t.in);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, err), 2);
  e = slurp(err);
  NMT_ASSERT(e && strstr(e, "format version 1") && strstr(e, "--ckpt"));
  free(e);
  snprintf(cmd, sizeof cmd, "%s/nmt translate conf/bible-small.ini " TINY " --ckpt %s --input %s",
           nmt, v1, t.in);
  NMT_ASSERT_EQ_INT(sh(cmd, o, err), 0);
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --config conf/bible-small.ini " TINY
           " --input %s", nmt, v1, t.in);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, err), 0);
  /* Two checkpoints is a usage error naming both. */
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --ckpt %s", nmt, v1, t.ckpt);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, err), 2);
}

/* ------------------------------------------------------------------------------------------ */
/* streaming and SIGINT */

typedef struct {
  pid_t pid;
  int in, out; /* our ends: the child's stdin, its stdout */
} child;

static int spawn_translate(child *c, const char *ckpt, const char *err_path, const char *extra) {
  int pin[2], pout[2];
  if (pipe(pin) || pipe(pout)) return 0;
  char exe[1024];
  snprintf(exe, sizeof exe, "%s/nmt", nmt_test_build_dir());
  fflush(stdout);
  c->pid = fork();
  if (c->pid == 0) {
    dup2(pin[0], 0);
    dup2(pout[1], 1);
    int fd = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) dup2(fd, 2);
    close(pin[1]), close(pout[0]);
    execl(exe, exe, "translate", ckpt, "--ids", "decode.beam=1", extra, (char *)NULL);
    _exit(127);
  }
  close(pin[0]), close(pout[1]);
  c->in = pin[1], c->out = pout[0];
  return c->pid > 0;
}

/* Reads one line from fd within timeout_s; returns its length, -1 on timeout or EOF. */
static int read_line_within(int fd, char *buf, int cap, double timeout_s) {
  int n = 0;
  double t0 = nmt_th_now();
  while (n < cap - 1) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int left = (int)((timeout_s - (nmt_th_now() - t0)) * 1000);
    if (left <= 0 || poll(&p, 1, left) <= 0) return -1;
    if (read(fd, buf + n, 1) != 1) return -1;
    if (buf[n] == '\n') break;
    n++;
  }
  buf[n] = 0;
  return n;
}

NMT_TEST(translate_streams_before_stdin_closes) {
  tiny t;
  if (!tiny_setup(&t, NULL)) return;
  char err[800], line[4096];
  snprintf(err, sizeof err, "%s/err", t.dir);
  child c;
  NMT_ASSERT(spawn_translate(&c, t.ckpt, err, "decode.max_extra_len=3"));
  NMT_ASSERT(write(c.in, "25 100 7\n", 9) == 9);
  /* stdin stays open: the translation must come anyway. */
  int n1 = read_line_within(c.out, line, sizeof line, 60);
  NMT_ASSERT(n1 > 0);
  NMT_ASSERT(write(c.in, "9 9 9 9\n", 8) == 8);
  int n2 = read_line_within(c.out, line, sizeof line, 60);
  NMT_ASSERT(n2 > 0);
  printf("# two translations arrived while stdin was open (%d and %d bytes)\n", n1, n2);
  close(c.in);
  NMT_ASSERT_EQ_INT(read_line_within(c.out, line, sizeof line, 60), -1); /* EOF, nothing more */
  NMT_ASSERT_EQ_INT(nmt_th_wait(c.pid, 60, NULL), 0);
  close(c.out);
}

NMT_TEST(translate_sigint_keeps_output_exit_75) {
  tiny t;
  if (!tiny_setup(&t, NULL)) return;
  char err[800], line[4096];
  snprintf(err, sizeof err, "%s/err", t.dir);
  child c;
  NMT_ASSERT(spawn_translate(&c, t.ckpt, err, "decode.max_extra_len=3"));
  NMT_ASSERT(write(c.in, "25 100 7\n", 9) == 9);
  NMT_ASSERT(read_line_within(c.out, line, sizeof line, 60) > 0);
  /* Waiting for more input when the signal comes: it stops at once, exit 75. */
  NMT_ASSERT(kill(c.pid, SIGINT) == 0);
  double took;
  NMT_ASSERT_EQ_INT(nmt_th_wait(c.pid, 30, &took), 75);
  char *e = slurp(err);
  NMT_ASSERT(e && strstr(e, "stopped on request") && strstr(e, "first 1 lines"));
  free(e);
  printf("# SIGINT while waiting for input: exit 75 after %.2f s\n", took);
  close(c.in), close(c.out);
}

/* Copies of one SIGTERM (GNU timeout's to the process and then to its group, or one per
 * thread) are one request: exit 75 with what is translated. The handler used to reset itself
 * on the first (SA_RESETHAND), so the next copy killed the process (exit 143) before it wrote
 * its stop. A copy to every thread, 5 runs. */
NMT_TEST(translate_signal_copies_are_one_request) {
  tiny t;
  if (!tiny_setup(&t, NULL)) return;
  char err[800], line[4096];
  snprintf(err, sizeof err, "%s/err", t.dir);
  for (int run = 0; run < 5; run++) {
    child c;
    NMT_ASSERT(spawn_translate(&c, t.ckpt, err, "decode.max_extra_len=3"));
    NMT_ASSERT(write(c.in, "25 100 7\n", 9) == 9);
    NMT_ASSERT(read_line_within(c.out, line, sizeof line, 60) > 0);
    const int threads = nmt_th_signal_each_thread(c.pid, SIGTERM);
    const int rc = nmt_th_wait(c.pid, 30, NULL);
    printf("# run %d: SIGTERM to each of %d thread(s): exit %d\n", run, threads, rc);
    close(c.in), close(c.out);
    NMT_ASSERT(threads >= 2);
    NMT_ASSERT_EQ_INT(rc, 75);
  }
}

/* ------------------------------------------------------------------------------------------ */

NMT_TEST(translate_nbest_and_scores) {
  tiny t;
  if (!tiny_setup(&t, NULL)) return;
  char cmd[4096], ids[800], o[800], err[800];
  const char *nmt = nmt_test_build_dir();
  snprintf(ids, sizeof ids, "%s/in.ids", t.dir);
  snprintf(o, sizeof o, "%s/o", t.dir);
  snprintf(err, sizeof err, "%s/err", t.dir);
  FILE *f = fopen(ids, "w");
  NMT_ASSERT(f);
  fputs("25 100 7\n9 9 9 9\n", f);
  fclose(f);
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --ids --input %s decode.max_extra_len=3 "
           "--nbest 3", nmt, t.ckpt, ids);
  NMT_ASSERT_EQ_INT(sh(cmd, o, err), 0);
  char *a = slurp(o);
  NMT_ASSERT(a);
  /* "i ||| ids ||| F0= log p ||| score": 3 per input line, i = 0 0 0 1 1 1, log p <= 0 */
  int k = 0;
  for (char *line = strtok(a, "\n"); line; line = strtok(NULL, "\n"), k++) {
    long i;
    int off = 0;
    NMT_ASSERT(sscanf(line, "%ld ||| %n", &i, &off) == 1 && off > 0);
    NMT_ASSERT_EQ_INT(i, k / 3);
    char *bar = strstr(line + off, " ||| F0= ");
    NMT_ASSERT(bar);
    double lp = strtod(bar + 9, NULL);
    NMT_ASSERT(lp <= 0 && lp > -1000);
  }
  NMT_ASSERT_EQ_INT(k, 6);
  free(a);
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --ids --input %s decode.max_extra_len=3 --scores",
           nmt, t.ckpt, ids);
  NMT_ASSERT_EQ_INT(sh(cmd, o, err), 0);
  a = slurp(o);
  NMT_ASSERT(a && count_char(a, '\n') == 2 && strstr(a, " ||| -"));
  free(a);
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --ids --input %s --nbest 5", nmt, t.ckpt, ids);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, err), 2);
  a = slurp(err);
  NMT_ASSERT(a && strstr(a, "decode.beam = 4"));
  free(a);
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --ids --input %s --nbest x", nmt, t.ckpt, ids);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, err), 2);
}

/* ------------------------------------------------------------------------------------------ */
/* eval, export, average from a checkpoint alone */

static int have_sacrebleu(void) { return sh("python3 -c 'import sacrebleu'", NULL, NULL) == 0; }

NMT_TEST(eval_split_test_prints_bleu_and_chrf) {
  if (!have_sacrebleu()) NMT_SKIP("no sacrebleu (tools/install-deps.sh --bleu)");
  tiny t;
  if (!tiny_setup(&t, NULL)) return;
  char cmd[4096], o[800], err[800];
  const char *nmt = nmt_test_build_dir();
  snprintf(o, sizeof o, "%s/o", t.dir);
  snprintf(err, sizeof err, "%s/err", t.dir);
  snprintf(cmd, sizeof cmd, "%s/nmt eval %s --split test decode.beam=1 decode.max_extra_len=2",
           nmt, t.ckpt);
  NMT_ASSERT_EQ_INT(sh(cmd, o, err), 0);
  char *a = slurp(o);
  NMT_ASSERT(a && strstr(a, "\nBLEU  = ") && strstr(a, "\nchrF2 = ") && strstr(a, "loss ") &&
             strstr(a, "data/bible/test.en") && strstr(a, "data/bible/test.es"));
  free(a);
  /* The hypotheses and eval.jsonl land in the run directory that holds the checkpoint. */
  snprintf(cmd, sizeof cmd, "test -s %s/run/eval/test.en.step_2.beam1.hyp && grep -q '\"bleu\"' "
           "%s/run/eval/eval.jsonl", t.dir, t.dir);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, NULL), 0);
  snprintf(cmd, sizeof cmd, "%s/nmt eval %s --split bogus", nmt, t.ckpt);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, err), 2);
  a = slurp(err);
  NMT_ASSERT(a && strstr(a, "\"bogus\""));
  free(a);
  /* A split whose directory says nothing of its raw text: exit 3, naming what is missing. */
  snprintf(cmd, sizeof cmd, "cp data/bible/test.shard %s/x.shard && %s/nmt eval %s "
           "data.test=%s/x.shard --split test decode.beam=1", t.dir, nmt, t.ckpt, t.dir);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, err), 3);
  a = slurp(err);
  NMT_ASSERT(a && strstr(a, "spm.settings") && strstr(a, "--src"));
  free(a);
}

NMT_TEST(export_and_average_from_checkpoint_alone) {
  tiny t;
  if (!tiny_setup(&t, NULL)) return;
  char cmd[4096], st[800], avg[800], err[800], o[800];
  const char *nmt = nmt_test_build_dir();
  snprintf(st, sizeof st, "%s/m.safetensors", t.dir);
  snprintf(avg, sizeof avg, "%s/avg.ckpt", t.dir);
  snprintf(err, sizeof err, "%s/err", t.dir);
  snprintf(o, sizeof o, "%s/o", t.dir);
  /* export: the metadata is the run's (max_positions 77), not the schema default (1024). */
  snprintf(cmd, sizeof cmd, "%s/nmt export %s %s", nmt, t.ckpt, st);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, err), 0);
  char *a = slurp(st);
  NMT_ASSERT(a && strstr(a + 8, "\"max_positions\":\"77\""));
  free(a);
  /* average: the result carries its inputs' description, so it translates alone. */
  snprintf(cmd, sizeof cmd, "%s/nmt average %s %s --output %s", nmt, t.ckpt, t.ckpt, avg);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, err), 0);
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --input %s decode.max_extra_len=2", nmt, avg,
           t.in);
  NMT_ASSERT_EQ_INT(sh(cmd, o, err), 0);
  a = slurp(o);
  NMT_ASSERT(a && count_char(a, '\n') == 7);
  free(a);
  /* average --last with fewer checkpoints than asked: a warning line. */
  snprintf(cmd, sizeof cmd, "%s/nmt average --last 3 %s/run/checkpoints --output %s", nmt, t.dir,
           avg);
  NMT_ASSERT_EQ_INT(sh(cmd, NULL, err), 0);
  a = slurp(err);
  NMT_ASSERT(a && strstr(a, "warn: average --last 3: only 1 valid checkpoint"));
  free(a);
}

/* The functions validation BLEU during training will call: in-memory hypotheses equal what
 * `nmt translate` writes, and their score equals sacreBLEU's on that file. */
NMT_TEST(translate_to_text_and_score_in_memory) {
  if (!have_sacrebleu()) NMT_SKIP("no sacrebleu (tools/install-deps.sh --bleu)");
  tiny t;
  if (!tiny_setup(&t, NULL)) return;
  char cmd[4096], o[800], err[800];
  snprintf(o, sizeof o, "%s/o", t.dir);
  snprintf(err, sizeof err, "%s/err", t.dir);
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --input %s decode.max_extra_len=3",
           nmt_test_build_dir(), t.ckpt, t.in);
  NMT_ASSERT_EQ_INT(sh(cmd, o, err), 0);
  nmt_ckpt_setup s;
  const char *ov[] = {"decode.max_extra_len=3"};
  NMT_ASSERT_OK(nmt_ckpt_setup_load(t.ckpt, NULL, 0, ov, 1, &s));
  nmt_spm *spm;
  NMT_ASSERT_OK(nmt_ckpt_setup_spm(&s, &spm));
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(&s.cfg, &mc);
  const size_t np = nmt_model_num_params(&mc);
  float *p = malloc(np * sizeof *p);
  NMT_ASSERT(p);
  NMT_ASSERT_OK(nmt_ckpt_read(t.ckpt, NULL, NULL, p, NULL, NULL));
  char **hyps;
  long n;
  NMT_ASSERT_OK(nmt_translate_to_text(&s.cfg, p, spm, t.in, 0, &hyps, &n));
  NMT_ASSERT_EQ_INT(n, 7);
  char *want = slurp(o), *line = want;
  NMT_ASSERT(want);
  for (long i = 0; i < n; i++) {
    char *nl = strchr(line, '\n');
    NMT_ASSERT(nl);
    *nl = 0;
    if (strcmp(hyps[i], line)) {
      nmt_test_fail(__FILE__, __LINE__, "line %ld: in memory \"%s\", translate \"%s\"", i + 1,
                    hyps[i], line);
      return;
    }
    line = nl + 1;
  }
  free(want);
  nmt_eval_bleu_result mem, file;
  NMT_ASSERT_OK(nmt_eval_score_hyps(hyps, n, t.ref, &mem));
  NMT_ASSERT_OK(nmt_eval_sacrebleu(o, t.ref, NULL, &file));
  NMT_ASSERT(mem.bleu == file.bleu && mem.chrf == file.chrf && mem.chrf > 0);
  NMT_ASSERT(!strcmp(mem.bleu_signature, file.bleu_signature));
  /* A shard's sources: one hypothesis per pair. */
  nmt_translate_text_free(hyps, n);
  s.cfg.decode_beam = 1, s.cfg.decode_max_extra_len = 1;
  NMT_ASSERT_OK(nmt_translate_to_text(&s.cfg, p, spm, "data/bible/valid.shard", 1, &hyps, &n));
  NMT_ASSERT_EQ_INT(n, 268);
  /* Line counts differ: a data error naming both files. */
  NMT_ASSERT_EQ_STATUS(nmt_eval_score_hyps(hyps, 5, t.ref, &mem), NMT_ERR_DATA);
  NMT_ASSERT(strstr(nmt_last_error(), t.ref) != NULL);
  nmt_translate_text_free(hyps, n);
  free(p);
  nmt_spm_free(spm);
  nmt_ckpt_setup_free(&s);
}

/* ---- what translate prints and reserves (issue 38's new-user trial found each silent):
 * n-best and scores in the Moses / Marian form "i ||| hypothesis ||| F0= log p ||| score",
 * score the length-normalised one the search ranks by (--nbest printed only log p, so the
 * order did not follow the numbers; a strong length penalty, alpha 2, --ids input); the
 * decoder sized for the lines it has, decode.beam rows per sentence for min(lines,
 * decode.batch_sentences) sentences, as its debug line reports before it allocates (beam 1024
 * asked 54.8 GB for 3 sentences: it was sized for batch_sentences x beam whatever the input;
 * beam 64 on one line: 64 rows, not 4,096); invalid UTF-8 input warned per line with file,
 * line and byte, and counted (it was accepted without a word). ---- */

/* One line's trailing " ||| F0= LOGP ||| SCORE"; returns 1 when both parse. */
static int parse_tail(const char *line, double *logp, double *score) {
  const char *f0 = strstr(line, " ||| F0= ");
  if (!f0) return 0;
  char *end;
  *logp = strtod(f0 + 9, &end);
  if (end == f0 + 9 || strncmp(end, " ||| ", 5)) return 0;
  const char *s = end + 5;
  *score = strtod(s, &end);
  return end != s && *end == 0;
}

NMT_TEST(translate_nbest_prints_the_ranking_score) {
  const char *dir = nmt_test_tmpdir(), *nmt = nmt_test_build_dir();
  char cmd[4096], ids[600], out[600], err[600];
  snprintf(ids, sizeof ids, "%s/in.ids", dir);
  tiny t;
  if (!tiny_setup(&t, NULL)) return;
  const char *ckpt = t.ckpt;
  snprintf(out, sizeof out, "%s/out", dir);
  snprintf(err, sizeof err, "%s/err", dir);
  FILE *f = fopen(ids, "w");
  NMT_ASSERT(f);
  fputs("25 100 7\n9 9 9 9\n311 40 12 12 5\n", f);
  fclose(f);
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --ids --input %s decode.beam=6 "
           "decode.length_penalty=2 decode.max_extra_len=4 --nbest 6", nmt, ckpt, ids);
  NMT_ASSERT_EQ_INT(sh(cmd, out, err), 0);
  char *a = nmt_th_read_file(out, NULL);
  NMT_ASSERT(a);
  int k = 0, bad_order = 0, raw_order_differs = 0;
  long prev_i = -1;
  double prev_score = 0, prev_logp = 0;
  for (char *line = strtok(a, "\n"); line; line = strtok(NULL, "\n"), k++) {
    long i;
    int off = 0;
    double lp, sc;
    NMT_ASSERT(sscanf(line, "%ld ||| %n", &i, &off) == 1 && off > 0);
    if (!parse_tail(line, &lp, &sc)) {
      nmt_test_fail(__FILE__, __LINE__, "line \"%s\" lacks \" ||| F0= LOGP ||| SCORE\"", line);
      free(a);
      return;
    }
    /* alpha 2 > 0: lp(n) > 1, so score = log p / lp(n) lies in [log p, 0] */
    NMT_ASSERT(lp <= 0 && sc <= 0 && sc >= lp - 1e-3);
    if (i == prev_i) {
      bad_order += sc > prev_score + 1e-4;
      raw_order_differs += lp > prev_logp + 1e-4;
    }
    prev_i = i, prev_score = sc, prev_logp = lp;
  }
  free(a);
  printf("# %d lines; %d where log p rises within a sentence's list, %d where the score does\n",
         k, raw_order_differs, bad_order);
  NMT_ASSERT_EQ_INT(k, 18);
  NMT_ASSERT_EQ_INT(bad_order, 0);
  /* --scores: the one best, the same two fields. */
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --ids --input %s decode.length_penalty=2 "
           "decode.max_extra_len=4 --scores", nmt, ckpt, ids);
  NMT_ASSERT_EQ_INT(sh(cmd, out, err), 0);
  a = nmt_th_read_file(out, NULL);
  NMT_ASSERT(a);
  int lines = 0;
  for (char *line = strtok(a, "\n"); line; line = strtok(NULL, "\n"), lines++) {
    double lp, sc;
    NMT_ASSERT(parse_tail(line, &lp, &sc));
  }
  free(a);
  NMT_ASSERT_EQ_INT(lines, 3);
}

NMT_TEST(translate_sizes_the_beam_for_its_lines) {
  const char *dir = nmt_test_tmpdir(), *nmt = nmt_test_build_dir();
  char cmd[4096], ids[600], out[600], err[600];
  snprintf(ids, sizeof ids, "%s/in.ids", dir);
  tiny t;
  if (!tiny_setup(&t, NULL)) return;
  const char *ckpt = t.ckpt;
  snprintf(out, sizeof out, "%s/out", dir);
  snprintf(err, sizeof err, "%s/err", dir);
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

NMT_TEST(translate_warns_on_invalid_utf8) {
  const char *dir = nmt_test_tmpdir(), *nmt = nmt_test_build_dir();
  char cmd[4096], in[600], out[600], err[600];
  snprintf(in, sizeof in, "%s/in.txt", dir);
  tiny t;
  if (!tiny_setup(&t, NULL)) return;
  const char *ckpt = t.ckpt;
  snprintf(out, sizeof out, "%s/out", dir);
  snprintf(err, sizeof err, "%s/err", dir);
  FILE *f = fopen(in, "wb");
  NMT_ASSERT(f);
  /* 1 and 7 are valid (2-, 3- and 4-byte sequences); 2..6 are not: a stray byte, an overlong
   * '/', a UTF-16 surrogate, a sequence cut by the line's end, a code point past U+10FFFF. */
  fputs("In the beginning \xc3\xb1 \xe2\x82\xac \xf0\x9f\x98\x80\n"
        "God \xff created\n"
        "the \xc0\xaf heaven\n"
        "and \xed\xa0\x80 the\n"
        "earth \xe2\x82\n"
        "x \xf4\x90\x80\x80 y\n"
        "And the earth was without form.\n",
        f);
  fclose(f);
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --input %s decode.max_extra_len=2", nmt, ckpt,
           in);
  NMT_ASSERT_EQ_INT(sh(cmd, out, err), 0);
  char *o = nmt_th_read_file(out, NULL), *e = nmt_th_read_file(err, NULL);
  NMT_ASSERT(o && e);
  NMT_ASSERT_EQ_INT(nmt_th_count(o, "\n"), 7);
  printf("# stderr:\n%s", e);
  char want[700];
  const int bad[] = {2, 3, 4, 5, 6}, offset[] = {5, 5, 5, 7, 3};
  for (int i = 0; i < 5; i++) {
    snprintf(want, sizeof want, "%s:%d: invalid UTF-8 at byte %d", in, bad[i], offset[i]);
    if (!strstr(e, want)) {
      nmt_test_fail(__FILE__, __LINE__, "stderr lacks \"%s\"", want);
      free(o), free(e);
      return;
    }
  }
  snprintf(want, sizeof want, "%s:1:", in);
  NMT_ASSERT(!strstr(e, want));
  snprintf(want, sizeof want, "%s:7:", in);
  NMT_ASSERT(!strstr(e, want));
  NMT_ASSERT(strstr(e, "5 input lines were not valid UTF-8") != NULL);
  free(o), free(e);
}
