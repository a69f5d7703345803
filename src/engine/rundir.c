/* rundir.c — run.out_dir: what the main thread writes there while a run lives.
 *
 *   config.ini      the effective config, so a run directory says exactly what produced it
 *   config.ini.step<N>  the one a --resume from step N replaced with a different config
 *   metrics.jsonl   one JSON object per metrics record (README.md lists the fields)
 *   tb/             TensorBoard event files (run.tensorboard): the same records as scalars,
 *                   one file per process that trained there
 *   status.json     for schedulers: replaced atomically at every change of state
 *   profile.txt, trace.json   after a segment that reached profile.start_step
 *   checkpoints/    written by nmt_ckpt_save_step (step files, latest, best); temp files a
 *                   killed writer left are removed
 *   run.lock        held (flock) from create to destroy; says who holds it
 * In a run over several nodes (world.c) node 0 writes these; every other node writes only
 * its own status.node<k>.json (and profile.node<k>.txt, trace.node<k>.json, run.node<k>.lock),
 * so nodes that share run.out_dir never write the same file.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nmt/clock.h"
#include "nmt/json.h"
#include "nmt/log.h"
#include "ckpt_impl.h"
#include "run.h"

nmt_status nmt__mkdir_p(const char *path) {
  char tmp[NMT_PATH_MAX + 32];
  snprintf(tmp, sizeof tmp, "%s", path);
  for (char *p = tmp + 1; *p; p++) {
    if (*p != '/') continue;
    *p = 0;
    if (mkdir(tmp, 0777) != 0 && errno != EEXIST)
      return nmt_errorf(NMT_ERR_IO, "cannot create directory %s: %s", tmp, strerror(errno));
    *p = '/';
  }
  if (mkdir(tmp, 0777) != 0 && errno != EEXIST)
    return nmt_errorf(NMT_ERR_IO, "cannot create directory %s: %s", tmp, strerror(errno));
  return NMT_OK;
}

/* run.out_dir/<base><ext>, or <base>.node<k><ext> on node k > 0. */
static void run_file(const nmt_trainer *t, const char *base, const char *ext, char *out,
                     size_t cap) {
  if (t->world.node_rank > 0)
    snprintf(out, cap, "%s/%s.node%d%s", t->cfg.run_out_dir, base, t->world.node_rank, ext);
  else
    snprintf(out, cap, "%s/%s%s", t->cfg.run_out_dir, base, ext);
}

/* One `key = value` line of a config dump (nmt_config_dump): "section.key" and the value,
 * pointing into the dump's text. */
typedef struct {
  char name[160];
  const char *value;
} dump_line;

/* The key lines of a dump, in order, cut in place (text is modified); *n gets their number.
 * Returns NULL when out of memory. */
static dump_line *dump_lines(char *text, int *n) {
  int cap = 1;
  for (const char *p = text; *p; p++) cap += *p == '\n';
  dump_line *out = calloc((size_t)cap, sizeof *out);
  if (!out) return NULL;
  char section[64] = "";
  *n = 0;
  for (char *line = text; line && *line;) {
    char *end = strchr(line, '\n');
    if (end) *end = 0;
    char *eq = strstr(line, " = ");
    if (line[0] == '[') {
      snprintf(section, sizeof section, "%.*s", (int)strcspn(line + 1, "]"), line + 1);
    } else if (line[0] != ';' && eq && *n < cap) {
      snprintf(out[*n].name, sizeof out[*n].name, "%s.%.*s", section, (int)(eq - line), line);
      out[(*n)++].value = eq + 3;
    }
    line = end ? end + 1 : NULL;
  }
  return out;
}

/* Appends "name old -> new" for every key whose value differs between the dumps `before` and
 * `after` (both modified), run.resume aside (--resume sets it); returns how many. */
static int config_changes(char *before, char *after, char *list, size_t cap) {
  int na = 0, nb = 0, changed = 0;
  size_t len = 0;
  dump_line *a = dump_lines(before, &na), *b = dump_lines(after, &nb);
  list[0] = 0;
  for (int pass = 0; a && b && pass < 2; pass++) {
    /* pass 0: the keys of the new config; pass 1: keys the old one had and the new lacks. */
    const dump_line *x = pass ? a : b, *y = pass ? b : a;
    const int nx = pass ? na : nb, ny = pass ? nb : na;
    for (int i = 0; i < nx; i++) {
      if (!strcmp(x[i].name, "run.resume")) continue;
      const char *other = NULL;
      for (int j = 0; j < ny && !other; j++)
        if (!strcmp(x[i].name, y[j].name)) other = y[j].value;
      if (pass ? other != NULL : other && !strcmp(other, x[i].value)) continue;
      const char *was = pass ? x[i].value : other ? other : "(unset)";
      const char *now = pass ? "(unset)" : x[i].value;
      changed++;
      if (len < cap)
        len += (size_t)snprintf(list + len, cap - len, "%s%s %s -> %s", changed > 1 ? ", " : "",
                                x[i].name, was, now);
    }
  }
  if (len >= cap && cap > 4) memcpy(list + cap - 4, "...", 4);
  free(a), free(b);
  return changed;
}

static nmt_status dump_body(FILE *f, const char *tmp, const void *cfg, char *err) {
  if (nmt_config_dump(cfg, f) != NMT_OK)
    return nmt__ckpt_fail(err, NMT_ERR_IO, "cannot write %s: %s", tmp, nmt_last_error());
  return NMT_OK;
}

/* A resume from step N whose config differs from the config.ini the run wrote so far: warns
 * naming each changed key with both values and keeps that config.ini as config.ini.stepN
 * (config.ini.stepN.K when a resume from step N kept one already), so the run directory still
 * says what produced each step. */
static nmt_status keep_changed_config(const nmt_trainer *t, const char *path) {
  void *text = NULL;
  size_t len = 0;
  char *before = NULL, *after = NULL;
  if (nmt__slurp(path, &text, &len) == NMT_OK) before = text;
  else nmt_clear_error(); /* no config.ini before (an older run): nothing to compare */
  nmt_status s = before ? nmt__config_dump_text(&t->cfg, &after) : NMT_OK;
  char list[1536], kept[NMT_PATH_MAX + 64];
  if (before && after && s == NMT_OK && config_changes(before, after, list, sizeof list) > 0) {
    snprintf(kept, sizeof kept, "%s.step%ld", path, t->pos.start_step);
    for (int k = 1; k < 1000 && access(kept, F_OK) == 0; k++)
      snprintf(kept, sizeof kept, "%s.step%ld.%d", path, t->pos.start_step, k);
    if (rename(path, kept) != 0)
      s = nmt_errorf(NMT_ERR_IO, "cannot keep %s as %s: %s", path, kept, strerror(errno));
    else
      nmt_log(NMT_LOG_WARN, "--resume from step %ld with a config that differs from the one the "
              "run used so far (kept as %s): %s", t->pos.start_step, kept, list);
  }
  free(before), free(after);
  return s;
}

static nmt_status write_config(nmt_trainer *t) {
  char path[NMT_PATH_MAX + 32], err[ERR_CAP];
  if (t->world.node_rank > 0) return NMT_OK; /* node 0 writes config.ini */
  snprintf(path, sizeof path, "%s/config.ini", t->cfg.run_out_dir);
  if (t->cfg.run_resume && t->pos.start_step > 0) NMT_TRY(keep_changed_config(t, path));
  nmt_status s = nmt__ckpt_atomic_write(path, dump_body, &t->cfg, err);
  return s == NMT_OK ? NMT_OK : nmt_errorf(s, "%s", err);
}

nmt_status nmt__rundir_open(nmt_trainer *t) {
  const nmt_config *cfg = &t->cfg;
  char path[NMT_PATH_MAX + 32];
  if (t->world.node_rank > 0) return NMT_OK; /* node 0 writes config.ini and metrics.jsonl */
  NMT_TRY(write_config(t));
  snprintf(path, sizeof path, "%s/metrics.jsonl", cfg->run_out_dir);
  t->dir.metrics_file = fopen(path, t->pos.start_step > 0 ? "a" : "w");
  if (!t->dir.metrics_file)
    return nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
  if (!cfg->run_tensorboard) return NMT_OK;
  /* TensorBoard reads every file of tb/ as one run: a start from step 0 deletes the old run's
   * files as it rewrites metrics.jsonl; a resume adds one (its START drops what the previous
   * process logged past the checkpoint). */
  snprintf(path, sizeof path, "%s/tb", cfg->run_out_dir);
  int removed = 0;
  if (t->pos.start_step == 0) NMT_TRY(nmt_tb_remove_events(path, &removed));
  if (removed) nmt_log(NMT_LOG_INFO, "deleted %d TensorBoard event files of a previous run "
                       "in %s", removed, path);
  return nmt_tb_open(path, t->pos.start_step, &t->dir.tb);
}

/* The record as TensorBoard scalars, from the values metrics.jsonl writes (not finite or not
 * measured: left out, as metrics.jsonl writes null or omits the key). The tags are listed in
 * docs/formats.md "Run directory" and test/tensorboard_check.py. */
static void write_tb(nmt_tb_writer *tb, const nmt_metrics *m) {
  const double none = NAN;
  const nmt_tb_scalar v[] = {
      {"train/loss", m->train_loss},
      {"train/nll", m->train_nll},
      {"train/ppl", exp(m->train_nll)},
      {"train/lr", m->lr},
      {"train/grad_norm", m->grad_norm},
      {"train/loss_scale", m->loss_scale},
      {"train/skipped_steps", (double)m->skipped_steps},
      {"train/tgt_tokens_per_s", m->tgt_tokens_per_s},
      {"train/step_ms", m->step_ms},
      {"train/mfu", m->mfu},
      {"train/peak_mem_mb", m->peak_mem_mb},
      {"train/epoch", (double)m->epoch},
      {"valid/loss", m->has_valid ? m->valid_loss : none},
      {"valid/nll", m->has_valid ? m->valid_nll : none},
      {"valid/ppl", m->has_valid ? m->valid_ppl : none},
      {"valid/bleu", m->has_bleu ? m->valid_bleu : none},
      {"valid/chrf", m->has_bleu ? m->valid_chrf : none},
  };
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  nmt_tb_write(tb, m->step, (double)now.tv_sec + (double)now.tv_nsec * 1e-9, v,
               (int)(sizeof v / sizeof v[0]));
  nmt_tb_flush(tb);
}

void nmt__remove_stale_temps(const char *dir) {
  /* "step_N.ckpt.tmp.PID.TID", "latest.tmp.PID.TID", "best.tmp.PID.TID": never read (names
   * differ), but they would pile up. */
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  while ((e = readdir(d))) {
    if ((strncmp(e->d_name, "step_", 5) && strncmp(e->d_name, "latest", 6) &&
         strncmp(e->d_name, "best", 4)) ||
        !strstr(e->d_name, ".tmp."))
      continue;
    char p[NMT_PATH_MAX + 300];
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    if (unlink(p) == 0) nmt_log(NMT_LOG_INFO, "removed %s left by an interrupted write", p);
  }
  closedir(d);
}

int nmt__has_checkpoints(const char *dir) {
  /* `latest` or any step_*.ckpt, valid or not. */
  DIR *d = opendir(dir);
  if (!d) return 0;
  struct dirent *e;
  int found = 0;
  while (!found && (e = readdir(d))) {
    size_t n = strlen(e->d_name);
    found = !strcmp(e->d_name, "latest") ||
            (!strncmp(e->d_name, "step_", 5) && n > 10 && !strcmp(e->d_name + n - 5, ".ckpt"));
  }
  closedir(d);
  return found;
}

static void fmt_eta(double s, char *buf, size_t n) {
  if (!(s >= 0) || s > 1e7) {
    snprintf(buf, n, "?");
    return;
  }
  long x = (long)s;
  if (x >= 3600) snprintf(buf, n, "%ldh%02ldm", x / 3600, x / 60 % 60);
  else snprintf(buf, n, "%ldm%02lds", x / 60, x % 60);
}

/* One record; 0 on success, else the errno of the failed write (ferror or fflush). */
static int write_jsonl(FILE *f, const nmt_metrics *m) {
  errno = 0;
  fprintf(f,
          "{\"step\": %ld, \"epoch\": %ld, \"train_loss\": %.6f, \"train_nll\": %.6f, "
          "\"lr\": %.6g", m->step, m->epoch, m->train_loss, m->train_nll, m->lr);
  nmt_json_num(f, "grad_norm", m->grad_norm, "%.6g");
  fprintf(f, ", \"tgt_tokens_per_s\": %.1f, \"step_ms\": %.2f, \"loss_scale\": %.9g, "
          "\"skipped_steps\": %ld", m->tgt_tokens_per_s, m->step_ms, m->loss_scale,
          m->skipped_steps);
  nmt_json_num(f, "mfu", m->mfu, "%.4f");
  nmt_json_num(f, "peak_mem_mb", m->peak_mem_mb, "%.1f");
  if (m->has_valid)
    fprintf(f, ", \"valid_loss\": %.6f, \"valid_nll\": %.6f, \"valid_ppl\": %.4f", m->valid_loss,
            m->valid_nll, m->valid_ppl);
  if (m->has_bleu)
    fprintf(f, ", \"valid_bleu\": %.2f, \"valid_chrf\": %.2f", m->valid_bleu, m->valid_chrf);
  fprintf(f, "}\n");
  if (fflush(f) == 0 && !ferror(f)) return 0;
  return errno ? errno : EIO;
}

/* The validation line: loss, perplexity, BLEU and chrF2 when measured, and where the best
 * stands ("new best", or the best so far and the patience used up). */
static void log_validation(const nmt_trainer *t, const nmt_metrics *m) {
  const nmt_config *cfg = &t->cfg;
  char bleu[96] = "", best[160] = "";
  if (m->has_bleu)
    snprintf(bleu, sizeof bleu, " | valid BLEU %.2f | chrF2 %.2f", m->valid_bleu, m->valid_chrf);
  const char *name = nmt_valid_metric_name(cfg->train_best_metric);
  if (m->improved)
    snprintf(best, sizeof best, " | new best %s", name);
  else if (m->best_step > 0 && cfg->train_patience > 0)
    snprintf(best, sizeof best, " | best %s %.4g at step %ld, no improvement %ld/%d", name,
             m->best_value, m->best_step, m->best_bad, cfg->train_patience);
  else if (m->best_step > 0)
    snprintf(best, sizeof best, " | best %s %.4g at step %ld", name, m->best_value, m->best_step);
  nmt_log(NMT_LOG_INFO, "step %ld | valid loss %.3f | valid ppl %.2f%s%s", m->step, m->valid_loss,
          m->valid_ppl, bleu, best);
}

void nmt__write_metrics(nmt_trainer *t, const nmt_metrics *m) {
  t->dir.last_metrics = *m;
  /* A full disk must not end a run whose checkpoints may still fit, but it must not go
   * unsaid: one warning, as the TensorBoard writer gives (nmt/tensorboard.h). */
  int err = t->dir.metrics_file ? write_jsonl(t->dir.metrics_file, m) : 0;
  if (err && !t->dir.metrics_failed) {
    t->dir.metrics_failed = 1;
    nmt_log(NMT_LOG_WARN, "cannot write %s/metrics.jsonl at step %ld: %s; its later records "
            "may be missing (the log and the checkpoints go on)", t->cfg.run_out_dir, m->step,
            strerror(err));
  }
  if (t->dir.tb) write_tb(t->dir.tb, m);
  if (!t->opt.quiet) {
    char eta[32], scale[64] = "";
    double left = (double)(t->cfg.train_max_steps - m->step) * m->step_ms / 1e3;
    fmt_eta(left, eta, sizeof eta);
    if (t->pos.scaler0.enabled && m->skipped_steps)
      snprintf(scale, sizeof scale, " | scale %g (%ld skipped)", m->loss_scale, m->skipped_steps);
    else if (t->pos.scaler0.enabled)
      snprintf(scale, sizeof scale, " | scale %g", m->loss_scale);
    /* On a terminal this line is rewritten in place; validation results stay as lines. */
    t->dir.progress_s = nmt_clock_now_s();
    nmt_log_progress("step %ld/%ld | epoch %ld | loss %.3f | lr %.3g | gnorm %.3f%s | "
                     "%.0f tgt tok/s | %.0f ms/step | ETA %s",
                     m->step, t->cfg.train_max_steps, m->epoch, m->train_loss, m->lr,
                     m->grad_norm, scale, m->tgt_tokens_per_s, m->step_ms, eta);
    if (m->has_valid) log_validation(t, m);
  }
  if (t->opt.on_metrics) t->opt.on_metrics(t->opt.user, m);
}

void nmt__progress_tick(nmt_trainer *t) {
  const double now = nmt_clock_now_s();
  if (t->opt.quiet || now - t->dir.progress_s < 2.0 || !nmt_log_progress_live()) return;
  t->dir.progress_s = now;
  const long step = atomic_load(&t->sync.steps_done), max = t->cfg.train_max_steps;
  const long done = step - t->pos.start_step;
  const double ms = done > 0 ? (now - t->pos.t_start) * 1e3 / (double)done : NAN;
  char eta[32], rate[32] = "-";
  fmt_eta(done > 0 ? (double)(max - step) * ms / 1e3 : NAN, eta, sizeof eta);
  if (done > 0) snprintf(rate, sizeof rate, "%.0f", ms);
  const nmt_metrics *m = &t->dir.last_metrics;
  /* Between log steps: the step count, rate and ETA are live, loss and throughput are those of
   * the last record. */
  if (m->step > 0)
    nmt_log_progress("step %ld/%ld | epoch %ld | loss %.3f (step %ld) | %.0f tgt tok/s | %s "
                     "ms/step | ETA %s", step, max, m->epoch, m->train_loss, m->step,
                     m->tgt_tokens_per_s, rate, eta);
  else
    nmt_log_progress("step %ld/%ld | %s ms/step | ETA %s", step, max, rate, eta);
}

/* Replaces run.out_dir/status.json (fields: README.md "Embedding, schedulers and faults").
 * Written to a temp file in the same directory and renamed over the old one, so a poller reads
 * the old or the new file, never half of one. No fsync: the file describes a live process;
 * after a power cut the checkpoints, not this file, are the truth. A failure here only warns:
 * it must not end a run. */
void nmt__write_status(nmt_trainer *t, const char *state, nmt_status s, const char *error) {
  if (!t->dir.out_dir_made) return;
  t->dir.state = state;
  char path[NMT_PATH_MAX + 32], tmp[NMT_PATH_MAX + 64];
  run_file(t, "status", ".json", path, sizeof path);
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
  FILE *f = fopen(tmp, "w");
  if (!f) {
    nmt_log(NMT_LOG_WARN, "cannot write %s: %s", tmp, strerror(errno));
    return;
  }
  const nmt_metrics *m = &t->dir.last_metrics;
  long step = atomic_load(&t->sync.steps_done), max = t->cfg.train_max_steps;
  int have = m->step > 0, live = !strcmp(state, "running");
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  fprintf(f, "{\"state\": \"%s\", \"step\": %ld, \"max_steps\": %ld", state, step, max);
  nmt_json_num(f, "train_loss", have ? m->train_loss : NAN, "%.6f");
  nmt_json_num(f, "valid_loss", t->dir.last_valid_loss, "%.6f");
  nmt_json_num(f, "valid_bleu", t->dir.last_valid_bleu, "%.2f");
  nmt_json_num(f, "tgt_tokens_per_s", have ? m->tgt_tokens_per_s : NAN, "%.1f");
  nmt_json_num(f, "step_ms", have ? m->step_ms : NAN, "%.2f");
  nmt_json_num(f, "loss_scale", have ? m->loss_scale : NAN, "%.9g");
  fprintf(f, ", \"skipped_steps\": %ld", have ? m->skipped_steps : 0L);
  nmt_json_num(f, "eta_s", have && live ? (double)(max - step) * m->step_ms / 1e3 : live ? NAN : 0,
           "%.0f");
  fputs(", \"last_checkpoint\": ", f);
  if (t->dir.last_ckpt[0]) nmt_json_str(f, t->dir.last_ckpt);
  else fputs("null", f);
  /* The best validation so far by train.best_metric (checkpoints/best names its checkpoint). */
  if (t->dir.best.step > 0) fprintf(f, ", \"best_step\": %ld", t->dir.best.step);
  else fputs(", \"best_step\": null", f);
  fprintf(f, ", \"best_metric\": \"%s\"", nmt_valid_metric_name(t->cfg.train_best_metric));
  nmt_json_num(f, "best_value", t->dir.best.step > 0 ? t->dir.best.value : NAN, "%.6g");
  fputs(", \"reason\": ", f);
  if (t->dir.reason[0] && strcmp(state, "running")) nmt_json_str(f, t->dir.reason);
  else fputs("null", f);
  fprintf(f, ", \"status\": \"%s\", \"exit_code\": %d", nmt_status_str(s),
          nmt_status_exit_code(s));
  fputs(", \"error\": ", f);
  if (error && *error) nmt_json_str(f, error);
  else fputs("null", f);
  fprintf(f, ", \"pid\": %ld, \"updated_unix\": %.3f}\n", (long)getpid(),
          (double)now.tv_sec + 1e-9 * (double)now.tv_nsec);
  int bad = ferror(f);
  if (fclose(f) != 0 || bad || rename(tmp, path) != 0) {
    nmt_log(NMT_LOG_WARN, "cannot write %s: %s", path, strerror(errno));
    unlink(tmp);
  }
}

void nmt__write_profile(nmt_trainer *t) {
  const nmt_config *cfg = &t->cfg;
  long start = nmt_prof_start_step(t->prof);
  if (start <= 0 || atomic_load(&t->sync.steps_done) < start) return;
  char path[NMT_PATH_MAX + 32];
  if (cfg->profile_timeline) {
    run_file(t, "trace", ".json", path, sizeof path);
    if (nmt_prof_write_trace(t->prof, path) == NMT_OK)
      nmt_log(NMT_LOG_INFO, "timeline of steps %ld..%ld: %s (Perfetto, chrome://tracing)", start,
              nmt_prof_stop_step(t->prof), path);
    else
      nmt_log(NMT_LOG_WARN, "trace not written: %s", nmt_last_error());
  }
  if (cfg->profile_table) {
    /* Cumulative over segments: the tracks keep their events. */
    double tf = t->peak_flops / 1e12;
    run_file(t, "profile", ".txt", path, sizeof path);
    if (nmt_prof_write_table(t->prof, tf, t->peak_gbps, path) != NMT_OK)
      nmt_log(NMT_LOG_WARN, "profile table not written: %s", nmt_last_error());
    if (!t->opt.quiet) {
      nmt_log_progress_end();
      nmt_prof_print_table(t->prof, tf, t->peak_gbps, stderr);
    }
    nmt_log(NMT_LOG_INFO, "per-module table: %s", path);
  }
}

/* ---- claiming run.out_dir: the lock, and a previous run's work ---------------------------- */

/* Takes run.lock (node k > 0: run.node<k>.lock, so the nodes of one run do not exclude each
 * other) with flock: held while the process lives, released by the kernel when it dies, so a
 * killed run leaves no stale lock. The file then says who holds it; another process that finds
 * it locked names that holder. */
static nmt_status take_lock(nmt_trainer *t) {
  char path[NMT_PATH_MAX + 32];
  run_file(t, "run", ".lock", path, sizeof path);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) return nmt_errorf(NMT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    char who[512];
    ssize_t n = pread(fd, who, sizeof who - 1, 0);
    close(fd);
    if (e != EWOULDBLOCK)
      return nmt_errorf(NMT_ERR_IO, "cannot lock %s: %s", path, strerror(e));
    while (n > 0 && (who[n - 1] == '\n' || who[n - 1] == ' ')) n--;
    who[n > 0 ? n : 0] = 0;
    return nmt_errorf(NMT_ERR_CONFIG, "run.out_dir = %s is in use by another training: %s is "
                      "held by %s; two runs writing one directory would mix their metrics and "
                      "checkpoints: wait for it to end or stop it, or choose another run.out_dir",
                      t->cfg.run_out_dir, path, n > 0 ? who : "a process that is just starting");
  }
  char host[256] = "?", when[64] = "?", who[512];
  gethostname(host, sizeof host - 1);
  time_t now = time(NULL);
  struct tm tm;
  if (gmtime_r(&now, &tm)) strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
  int len = snprintf(who, sizeof who, "pid %ld on host %s since %s\n", (long)getpid(), host, when);
  if (ftruncate(fd, 0) != 0 || pwrite(fd, who, (size_t)len, 0) != len)
    nmt_log(NMT_LOG_WARN, "cannot write %s: %s (the lock is held all the same)", path,
            strerror(errno));
  t->dir.lock_fd = fd;
  t->dir.locked = 1;
  return NMT_OK;
}

/* The number after `"key": ` in a small file, or -1 (no file, no key). */
static long json_long(const char *path, const char *key) {
  char buf[4096], pat[64];
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  snprintf(pat, sizeof pat, "\"%s\": ", key);
  const char *p = strstr(buf, pat);
  return p ? strtol(p + strlen(pat), NULL, 10) : -1;
}

/* What a previous run left in run.out_dir that a fresh start would destroy, described into
 * `what` ("" and 0 when nothing): checkpoint files, metrics.jsonl records, a status.json past
 * step 0. A directory holding only config.ini, an empty metrics.jsonl or the status.json of a
 * setup that failed holds no work. Node 0's files are what every node checks: a run over
 * several nodes writes its work there (node 0 has written none yet of this run: it waits for
 * every node at nmt__world_agree, after this check). */
static int previous_work(const nmt_trainer *t, char *what, size_t cap) {
  char path[NMT_PATH_MAX + 32], line[512];
  size_t n = 0;
  what[0] = 0;
  if (nmt__has_checkpoints(t->dir.ckpt_dir))
    n += (size_t)snprintf(what + n, cap - n, "checkpoints in %s", t->dir.ckpt_dir);
  snprintf(path, sizeof path, "%s/metrics.jsonl", t->cfg.run_out_dir);
  /* Only a regular file is read: a FIFO or a device there (/dev/full, /dev/zero) would block
   * the start or never end. */
  struct stat st;
  FILE *f = stat(path, &st) == 0 && S_ISREG(st.st_mode) ? fopen(path, "r") : NULL;
  long records = 0, last = 0;
  while (f && fgets(line, sizeof line, f)) {
    const char *p = strstr(line, "{\"step\": ");
    if (p) records++, last = strtol(p + 9, NULL, 10);
  }
  if (f) fclose(f);
  if (records && n < cap)
    n += (size_t)snprintf(what + n, cap - n, "%s%s with %ld records up to step %ld",
                          n ? ", " : "", path, records, last);
  snprintf(path, sizeof path, "%s/status.json", t->cfg.run_out_dir);
  long step = json_long(path, "step");
  if (step > 0 && n < cap)
    snprintf(what + n, cap - n, "%s%s at step %ld", n ? ", " : "", path, step);
  return what[0] != 0;
}

/* --overwrite: the previous run's checkpoint files (step_*.ckpt, latest, best; node 0 only),
 * so that `latest`, `best` and checkpoint.keep see this run's files alone. metrics.jsonl and
 * status.json are rewritten from step 0 by nmt__rundir_open and the first status. */
static nmt_status discard_checkpoints(const nmt_trainer *t, int *removed) {
  *removed = 0;
  DIR *d = opendir(t->dir.ckpt_dir);
  if (!d) return NMT_OK;
  struct dirent *e;
  nmt_status s = NMT_OK;
  while ((e = readdir(d))) {
    size_t n = strlen(e->d_name);
    if (strcmp(e->d_name, "latest") && strcmp(e->d_name, "best") &&
        !(!strncmp(e->d_name, "step_", 5) && n > 10 && !strcmp(e->d_name + n - 5, ".ckpt")))
      continue;
    char p[NMT_PATH_MAX + 300];
    snprintf(p, sizeof p, "%s/%s", t->dir.ckpt_dir, e->d_name);
    if (unlink(p) == 0) (*removed)++;
    else if (errno != ENOENT) {
      s = nmt_errorf(NMT_ERR_IO, "--overwrite: cannot delete %s: %s", p, strerror(errno));
      break;
    }
  }
  closedir(d);
  return s;
}

nmt_status nmt__rundir_claim(nmt_trainer *t) {
  const nmt_config *cfg = &t->cfg;
  snprintf(t->dir.ckpt_dir, sizeof t->dir.ckpt_dir, "%s/checkpoints", cfg->run_out_dir);
  if (cfg->run_resume && t->opt.overwrite)
    return nmt_errorf(NMT_ERR_CONFIG, "run.resume = true and --overwrite exclude each other: "
                      "resume continues the run in %s, --overwrite discards it",
                      cfg->run_out_dir);
  NMT_TRY(nmt__mkdir_p(cfg->run_out_dir));
  NMT_TRY(take_lock(t));
  char what[3 * NMT_PATH_MAX];
  if (!cfg->run_resume && previous_work(t, what, sizeof what)) {
    if (!t->opt.overwrite)
      return nmt_errorf(NMT_ERR_CONFIG, "run.out_dir = %s holds a previous run (%s); starting "
                        "over there would overwrite it. Continue it with --resume (run.resume = "
                        "true), choose a fresh run.out_dir, or discard it with --overwrite",
                        cfg->run_out_dir, what);
    int removed = 0;
    if (t->world.node_rank == 0) NMT_TRY(discard_checkpoints(t, &removed));
    nmt_log(NMT_LOG_WARN, "--overwrite: discarding the previous run in %s (%s): %d checkpoint "
            "files deleted, metrics.jsonl%s starts again", cfg->run_out_dir, what, removed,
            cfg->run_tensorboard ? " and tb/ (its TensorBoard event files)" : "");
  }
  /* The previous run's status.json describes checkpoints this run continues: a setup that
   * fails (a refused resume, a device that cannot hold the run) is not that run's end. */
  char status[NMT_PATH_MAX + 32];
  run_file(t, "status", ".json", status, sizeof status);
  t->dir.keep_status = cfg->run_resume && json_long(status, "step") > 0;
  t->dir.out_dir_made = 1;
  return NMT_OK;
}

void nmt__rundir_release(nmt_trainer *t) {
  if (!t->dir.locked) return;
  /* Emptied, not removed: removing it would let a process that opened the old file lock an
   * inode no later process sees. */
  if (ftruncate(t->dir.lock_fd, 0) != 0)
    nmt_log(NMT_LOG_DEBUG, "cannot empty the run lock file: %s", strerror(errno));
  close(t->dir.lock_fd); /* releases the flock */
  t->dir.locked = 0;
}
