/* test_tensorboard.c — TensorBoard event files (nmt/tensorboard.h, run.tensorboard): the CRC and
 * the TFRecord framing against known vectors (no Python needed: a broken CRC or encoding fails
 * here), the run directory's tb/ (on by default, off by the key, a fresh start's cleanup), and
 * end to end: a real run with validation BLEU, resumed from a checkpoint older than its last
 * records, read back by the tensorboard package's own reader (test/tensorboard_check.py) and
 * checked scalar by scalar against metrics.jsonl. */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "nmt/log.h"
#include "nmt/tensorboard.h"
#include "nmt/trainer.h"
#include "test.h"

/* The event files (events.out.tfevents.*) in dir; the last one's name in last (may be NULL). */
static int count_events(const char *dir, char *last, size_t cap) {
  DIR *d = opendir(dir);
  if (!d) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (!strncmp(e->d_name, "events.out.tfevents.", 20)) {
      n++;
      if (last) snprintf(last, cap, "%s", e->d_name);
    }
  closedir(d);
  return n;
}

/* RFC 3720 §B.4's vectors and the check value of the CRC catalogue; the masked value is the
 * tensorboard package's masked_crc32c(b"123456789"). */
NMT_TEST(tb_crc32c_known_vectors) {
  static const unsigned char zeros[32];
  NMT_ASSERT_EQ_INT(nmt_tb_crc32c("123456789", 9), 0xe3069283u);
  NMT_ASSERT_EQ_INT(nmt_tb_crc32c(zeros, sizeof zeros), 0x8a9136aau);
  NMT_ASSERT_EQ_INT(nmt_tb_crc32c("", 0), 0u);
  NMT_ASSERT_EQ_INT(nmt_tb_mask_crc(0xe3069283u), 0xc78ab0e5u);
}

/* One event, byte for byte: Event{wall_time 1700000000.5, step 7, summary {train/loss 2.5,
 * x 0}} framed as a TFRecord, as the tensorboard package's event_pb2 and RecordWriter write it
 * (a 0 is written too: in a oneof; a NaN is left out). The file begins with the file-version
 * record, and its name follows events.out.tfevents.<seconds>.<host>.<pid>.<n>. */
NMT_TEST(tb_record_framing_matches_tensorboard) {
  static const unsigned char want[58] = {
      0x2a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xae, 0x8d, 0x91, 0xf5, 0x09, 0x00, 0x00,
      0x20, 0x40, 0xfc, 0x54, 0xd9, 0x41, 0x10, 0x07, 0x2a, 0x1d, 0x0a, 0x11, 0x0a, 0x0a, 0x74,
      0x72, 0x61, 0x69, 0x6e, 0x2f, 0x6c, 0x6f, 0x73, 0x73, 0x15, 0x00, 0x00, 0x20, 0x40, 0x0a,
      0x08, 0x0a, 0x01, 0x78, 0x15, 0x00, 0x00, 0x00, 0x00, 0xa1, 0x1f, 0xa3, 0x68};
  char dir[600], name[256], path[900];
  snprintf(dir, sizeof dir, "%s/tb", nmt_test_tmpdir());
  nmt_tb_writer *w = NULL;
  NMT_ASSERT_OK(nmt_tb_open(dir, 0, &w));
  const nmt_tb_scalar v[] = {{"train/loss", 2.5}, {"nan", NAN}, {"x", 0.0}, {"inf", INFINITY}};
  nmt_tb_write(w, 7, 1700000000.5, v, 4);
  nmt_tb_close(w);
  NMT_ASSERT_EQ_INT(count_events(dir, name, sizeof name), 1);
  long sec = 0, pid = 0;
  int k = -1, end = 0;
  char host[128] = "";
  NMT_ASSERT(sscanf(name, "events.out.tfevents.%ld.%127[^.].%ld.%d%n", &sec, host, &pid, &k,
                    &end) == 4 && name[end] == 0);
  NMT_ASSERT(sec > 1600000000 && pid == (long)getpid() && k == 0);
  snprintf(path, sizeof path, "%s/%s", dir, name);
  size_t n = 0;
  unsigned char *b = (unsigned char *)nmt_th_read_file(path, &n);
  NMT_ASSERT(b);
  /* first record: length, CRCs, and field 3 = "brain.Event:2" after the wall time (field 1) */
  const size_t first = 12 + 9 + 15 + 4;
  int version_ok = n == first + sizeof want && b[0] == 9 + 15 && b[12] == 0x09 &&
                   !memcmp(b + 21, "\x1a\x0d" "brain.Event:2", 15);
  uint32_t head_crc = 0, data_crc = 0;
  for (int i = 0; i < 4; i++)
    head_crc |= (uint32_t)b[8 + i] << (8 * i), data_crc |= (uint32_t)b[36 + i] << (8 * i);
  version_ok = version_ok && head_crc == nmt_tb_mask_crc(nmt_tb_crc32c(b, 8)) &&
               data_crc == nmt_tb_mask_crc(nmt_tb_crc32c(b + 12, 24));
  int same = n == first + sizeof want && !memcmp(b + first, want, sizeof want);
  if (!same && n >= first) {
    char hex[3 * 80] = "";
    for (size_t i = first; i < n && i < first + 70; i++)
      snprintf(hex + strlen(hex), sizeof hex - strlen(hex), "%02x ", b[i]);
    nmt_test_fail(__FILE__, __LINE__, "second record (%zu bytes): %s", n - first, hex);
  }
  free(b);
  NMT_ASSERT(version_ok);
  NMT_ASSERT(same);
}

/* A second writer in the same second takes the next name; a resumed one starts with a
 * SessionLog START at the step after the checkpoint (field 6 {status 1}, step field 2). */
NMT_TEST(tb_new_file_per_writer_and_resume_start) {
  char dir[600], name[256], path[900];
  snprintf(dir, sizeof dir, "%s/tb", nmt_test_tmpdir());
  nmt_tb_writer *a = NULL, *b = NULL;
  NMT_ASSERT_OK(nmt_tb_open(dir, 0, &a));
  NMT_ASSERT_OK(nmt_tb_open(dir, 40, &b));
  NMT_ASSERT(strcmp(nmt_tb_path(a), nmt_tb_path(b)) != 0);
  snprintf(path, sizeof path, "%s", nmt_tb_path(b));
  nmt_tb_close(a);
  nmt_tb_close(b);
  NMT_ASSERT_EQ_INT(count_events(dir, name, sizeof name), 2);
  size_t n = 0;
  unsigned char *d = (unsigned char *)nmt_th_read_file(path, &n);
  NMT_ASSERT(d);
  /* record 2 at 40: 12 bytes of header, wall time (9), step 41 (0x10 0x29), 0x3a 0x02 0x08 0x01 */
  int ok = n == 40 + 12 + 15 + 4 && d[40] == 15 && d[52] == 0x09 && d[61] == 0x10 &&
           d[62] == 41 && !memcmp(d + 63, "\x3a\x02\x08\x01", 4);
  free(d);
  NMT_ASSERT(ok);
  /* a fresh start deletes the event files and nothing else */
  char keep[700];
  snprintf(keep, sizeof keep, "%s/notes.txt", dir);
  NMT_ASSERT(nmt_th_write_file(keep, "mine\n") == 0);
  int removed = -1;
  NMT_ASSERT_OK(nmt_tb_remove_events(dir, &removed));
  NMT_ASSERT_EQ_INT(removed, 2);
  NMT_ASSERT_EQ_INT(count_events(dir, NULL, 0), 0);
  NMT_ASSERT(access(keep, R_OK) == 0);
  snprintf(path, sizeof path, "%s/none", dir);
  NMT_ASSERT_OK(nmt_tb_remove_events(path, &removed));
  NMT_ASSERT_EQ_INT(removed, 0);
}

/* Trains c to its end (quiet); NMT_OK or the run's error. */
static nmt_status train(const nmt_config *c) {
  nmt_trainer *t = NULL;
  NMT_TRY(nmt_th_trainer_quiet(c, NULL, NULL, &t));
  nmt_status s = nmt_trainer_run(t);
  nmt_trainer_destroy(t);
  return s;
}

/* Trains c to its end (quiet) with --overwrite: a fresh start over a previous run. */
static nmt_status train_overwrite(const nmt_config *c) {
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  o.overwrite = 1;
  nmt_trainer *t = NULL;
  NMT_TRY(nmt_trainer_create(c, &o, &t));
  nmt_status s = nmt_trainer_run(t);
  nmt_trainer_destroy(t);
  return s;
}

/* run.tensorboard is on by default: run.out_dir/tb/ holds one event file per process; a fresh
 * start (--overwrite) replaces the previous run's; off writes no tb/. */
NMT_TEST(tb_run_dir_default_on_and_key_off) {
  const char *dir = nmt_test_tmpdir();
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(dir, 48, 3, &c));
  NMT_ASSERT_EQ_INT(c.run_tensorboard, 1);
  c.train_max_steps = 2;
  char tb[NMT_PATH_MAX + 8], first[256], second[256];
  snprintf(tb, sizeof tb, "%s/tb", c.run_out_dir);
  NMT_ASSERT_OK(train(&c));
  NMT_ASSERT_EQ_INT(count_events(tb, first, sizeof first), 1);
  /* a resume adds one */
  c.run_resume = 1;
  c.train_max_steps = 3;
  NMT_ASSERT_OK(train(&c));
  NMT_ASSERT_EQ_INT(count_events(tb, NULL, 0), 2);
  /* starting over from step 0 keeps none of the previous run's */
  c.run_resume = 0;
  NMT_ASSERT_OK(train_overwrite(&c));
  NMT_ASSERT_EQ_INT(count_events(tb, second, sizeof second), 1);
  /* off: no directory */
  char off[700];
  snprintf(off, sizeof off, "%s/off", dir);
  snprintf(c.run_out_dir, sizeof c.run_out_dir, "%s", off);
  c.run_tensorboard = 0;
  NMT_ASSERT_OK(train(&c));
  snprintf(tb, sizeof tb, "%s/tb", off);
  struct stat st;
  NMT_ASSERT(stat(tb, &st) != 0);
}

typedef struct {
  int metrics_warnings, overwrite_tb;
} run_log;

static void watch_log(void *user, nmt_log_level level, const char *line) {
  run_log *r = user;
  if (level == NMT_LOG_WARN && strstr(line, "metrics.jsonl at step")) r->metrics_warnings++;
  if (level == NMT_LOG_WARN && strstr(line, "--overwrite") && strstr(line, "tb/"))
    r->overwrite_tb = 1;
}

/* A run whose metrics.jsonl cannot be written (here: it is /dev/full, so every flush fails
 * with ENOSPC) trains to its end and says so once, naming the file and the step; --overwrite's
 * warning names tb/ too, which it empties. */
NMT_TEST(run_metrics_write_error_warned_once) {
  const char *dir = nmt_test_tmpdir();
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(dir, 48, 3, &c));
  c.train_max_steps = 3;
  c.train_log_every = 1;
  NMT_ASSERT(mkdir(c.run_out_dir, 0755) == 0);
  char metrics[NMT_PATH_MAX + 16];
  snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", c.run_out_dir);
  NMT_ASSERT(symlink("/dev/full", metrics) == 0);
  nmt_log_level saved = nmt_log_get_level();
  nmt_log_set_level(NMT_LOG_INFO);
  run_log r = {0, 0};
  const nmt_log_sink sink = {watch_log, &r};
  nmt_log_set_sink(&sink);
  nmt_status s = train(&c);
  int warnings = r.metrics_warnings;
  /* a second start over the finished run: --overwrite's warning */
  unlink(metrics);
  nmt_status s2 = train_overwrite(&c);
  nmt_log_set_sink(NULL);
  nmt_log_set_level(saved);
  NMT_ASSERT_OK(s);
  NMT_ASSERT_EQ_INT(warnings, 1);
  NMT_ASSERT_OK(s2);
  NMT_ASSERT(r.overwrite_tb);
}

/* Runs cmd (output to log); 1 when it exits 0, else fails the test with the log. */
static int run_ok(const char *cmd, const char *log, int line) {
  fflush(stdout);
  int st = system(cmd);
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return 1;
  char *text = nmt_th_read_file(log, NULL);
  nmt_test_fail(__FILE__, line, "exit %d: %s\n%s", WIFEXITED(st) ? WEXITSTATUS(st) : -1, cmd,
                text ? text : "");
  free(text);
  return 0;
}

/* The real binary on the Bible corpus (a tiny model, validation with BLEU every 2 steps, a
 * checkpoint every 2): 4 steps; the newest checkpoint (step 4) is then damaged, so --resume
 * continues from step 2 and logs steps 3 and 4 again, to step 6. TensorBoard's reader over
 * tb/ (two files) must show exactly metrics.jsonl's records, the resumed run's for steps 3
 * and 4: every tag, step and value (float32). */
NMT_TEST(tb_scalars_match_metrics_jsonl) {
  fflush(stdout);
  if (system("python3 -c 'import tensorboard, sacrebleu' >/dev/null 2>&1") != 0)
    NMT_SKIP("python3 cannot import tensorboard and sacrebleu (tools/install-deps.sh --bleu, "
             "or: python3 -m pip install tensorboard sacrebleu)");
  if (access("data/bible/valid.en", R_OK) || access("data/bible/spm.model", R_OK)) {
    nmt_test_fail(__FILE__, __LINE__, "data/bible missing: run tools/prepare-bible.sh");
    return;
  }
  const char *dir = nmt_test_tmpdir();
  char run[600], log[640], cmd[4096], ckpt[700];
  snprintf(run, sizeof run, "%s/run", dir);
  snprintf(log, sizeof log, "%s/train.log", dir);
  const char *args =
      "conf/bible-small.ini model.d_model=16 model.n_heads=2 model.d_ff=32 model.enc_layers=1 "
      "model.dec_layers=1 model.max_positions=160 data.max_tokens=256 data.max_len=64 "
      "parallel.devices=1 parallel.device=cpu train.log_every=1 train.valid_every=2 "
      "train.save_every=2 train.valid_bleu=on decode.max_extra_len=5";
  snprintf(cmd, sizeof cmd, "%s/nmt train %s run.out_dir=%s train.max_steps=4 >%s 2>&1",
           nmt_test_build_dir(), args, run, log);
  if (!run_ok(cmd, log, __LINE__)) return;
  snprintf(ckpt, sizeof ckpt, "%s/checkpoints/step_4.ckpt", run);
  NMT_ASSERT(truncate(ckpt, 100) == 0);
  snprintf(cmd, sizeof cmd, "%s/nmt train %s run.out_dir=%s train.max_steps=6 --resume >>%s 2>&1",
           nmt_test_build_dir(), args, run, log);
  if (!run_ok(cmd, log, __LINE__)) return;
  char out[8192];
  snprintf(cmd, sizeof cmd, "python3 test/tensorboard_check.py %s 2 2>&1", run);
  int rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 0 || !strstr(out, "ok: ")) {
    nmt_test_fail(__FILE__, __LINE__, "tensorboard_check.py exit %d:\n%s", rc, out);
    return;
  }
  /* the resume did go back: steps 3 and 4 are in metrics.jsonl twice */
  snprintf(cmd, sizeof cmd, "grep -c '^{\"step\": [34],' %s/metrics.jsonl", run);
  NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 0);
  NMT_ASSERT_EQ_INT(atoi(out), 4);
}
