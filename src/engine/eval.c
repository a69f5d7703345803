/* eval.c — loss/perplexity of a checkpoint on a shard, and BLEU/chrF of its translations
 * through sacreBLEU (include/nmt/eval.h). */
#include "nmt/eval.h"
#include "nmt/json.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nmt/backend.h"
#include "nmt/data.h"
#include "nmt/device.h"
#include "nmt/log.h"
#include "nmt/model.h"
#include "nmt/translate.h"

void openblas_set_num_threads(int num_threads); /* OpenBLAS (cblas.h) */

nmt_status nmt_eval_loss(const nmt_config *cfg, const float *host_params, const char *shard_path,
                         nmt_eval_loss_result *out) {
  const nmt_backend *be = NULL;
  void *ctx = NULL;
  nmt_device dev = {0};
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(cfg, &mc);
  const size_t n_params = nmt_model_num_params(&mc);
  const int max_tokens = cfg->data_max_tokens, max_len = cfg->data_max_len;
  nmt_status s = NMT_OK;
  nmt_shard *sh = NULL;
  nmt_batcher *bt = NULL;
  nmt_model *model = NULL;
  float *params = NULL, *extra = NULL;
  int32_t *hbuf = NULL, *dbuf = NULL;
  memset(out, 0, sizeof *out);

  NMT_TRY(nmt_shard_open(shard_path, mc.vocab, &sh));
  NMT_TRY_GOTO(s, nmt_batcher_create(sh, max_tokens, max_len, cfg->run_seed, &bt), done);
  const size_t ints = 5 * (size_t)max_tokens + 16; /* nmt_batch_layout's five arrays */
  hbuf = malloc(ints * sizeof(int32_t));
  if (!hbuf) {
    s = nmt_errorf(NMT_ERR_NOMEM, "eval: batch buffer");
    goto done;
  }
  NMT_TRY_GOTO(s, nmt_device_open(cfg, NULL, 0, NMT_DEVICE_INFER, NULL, &dev), done);
  be = dev.be, ctx = dev.ctx;
  /* One OpenBLAS thread, as a training worker has: the loss is then bitwise the one the
   * run's validation logged for this checkpoint, on any core count. */
  if (be->is_host) openblas_set_num_threads(1);
  NMT_TRY_GOTO(s, be->malloc(ctx, ints * sizeof(int32_t), (void **)&dbuf), done);
  NMT_TRY_GOTO(s, be->malloc(ctx, n_params * sizeof(float), (void **)&params), done);
  NMT_TRY_GOTO(s, be->malloc(ctx, NMT_GRAD_EXTRA * sizeof(float), (void **)&extra), done);
  NMT_TRY_GOTO(s, be->copy_h2d(ctx, params, host_params, n_params * sizeof(float)), done);
  NMT_TRY_GOTO(s, nmt_model_create(&mc, be, ctx, max_tokens, max_len, &model), done);

  const long nb = nmt_batcher_num_batches(bt);
  for (long i = 0; i < nb; i++) {
    int ns, sl, tl;
    long tt;
    nmt_batch hb, db;
    nmt_batcher_shape(bt, i, &ns, &sl, &tl, &tt);
    nmt_batch_layout(&hb, hbuf, ns, sl, tl);
    nmt_batcher_fill(bt, i, &hb);
    nmt_batch_layout(&db, dbuf, ns, sl, tl);
    db.src_tokens = hb.src_tokens, db.tgt_tokens = hb.tgt_tokens;
    NMT_TRY_GOTO(s, be->copy_h2d(ctx, dbuf, hbuf, nmt_batch_ints(ns, sl > tl ? sl : tl) *
                                                        sizeof(int32_t)), done);
    /* Per-batch sums come back to the host and add up in double. */
    float e[NMT_GRAD_EXTRA];
    NMT_TRY_GOTO(s, be->memset_zero(ctx, extra, sizeof e), done);
    NMT_TRY_GOTO(s, nmt_model_forward(model, params, &db, 0, cfg->run_seed, 0, extra), done);
    NMT_TRY_GOTO(s, be->copy_d2h(ctx, e, extra, sizeof e), done);
    NMT_TRY_GOTO(s, be->synchronize(ctx), done);
    out->loss_sum += e[NMT_GRAD_SLOT_LOSS];
    out->nll_sum += e[NMT_GRAD_SLOT_NLL];
    out->tokens += e[NMT_GRAD_SLOT_TOKENS];
    out->pairs += ns;
  }
  out->dropped = nmt_batcher_num_dropped(bt);
  if (out->tokens > 0) {
    out->loss = out->loss_sum / out->tokens;
    out->nll = out->nll_sum / out->tokens;
    out->ppl = exp(out->nll);
  }
done:
  if (model) nmt_model_destroy(model);
  if (params) be->free(ctx, params);
  if (extra) be->free(ctx, extra);
  if (dbuf) be->free(ctx, dbuf);
  nmt_device_close(&dev);
  free(hbuf);
  nmt_batcher_destroy(bt);
  nmt_shard_close(sh);
  return s;
}

static long count_lines(const char *path, nmt_status *s) {
  FILE *f = fopen(path, "r");
  if (!f) {
    *s = nmt_errorf(NMT_ERR_IO, "cannot read %s: %s", path, strerror(errno));
    return -1;
  }
  long n = 0;
  int c, last = '\n';
  while ((c = fgetc(f)) != EOF) {
    n += c == '\n';
    last = c;
  }
  n += last != '\n';
  fclose(f);
  return n;
}

/* A text nmt must read more than once (its line count first, then the decoder or sacreBLEU)
 * that is not a regular file, such as sacreBLEU's idiom `--ref <(sacrebleu -t wmt14 ...)` (a
 * pipe), a FIFO or /dev/stdin, can be read once only: it is copied into a temporary file in
 * dir, whose path goes to staged (the caller unlinks it); a regular file is read in place
 * (staged = ""). Errors: NMT_ERR_IO naming `path`. */
static nmt_status stage_text(const char *path, const char *dir, char *staged, size_t cap) {
  struct stat sb;
  staged[0] = 0;
  if (stat(path, &sb) != 0)
    return nmt_errorf(NMT_ERR_IO, "cannot read %s: %s", path, strerror(errno));
  if (S_ISREG(sb.st_mode)) return NMT_OK;
  if (S_ISDIR(sb.st_mode)) return nmt_errorf(NMT_ERR_IO, "cannot read %s: is a directory", path);
  FILE *in = fopen(path, "r");
  if (!in) return nmt_errorf(NMT_ERR_IO, "cannot read %s: %s", path, strerror(errno));
  snprintf(staged, cap, "%s/nmt-text-XXXXXX", dir);
  int fd = mkstemp(staged);
  FILE *o = fd >= 0 ? fdopen(fd, "w") : NULL;
  if (!o) {
    nmt_status e = nmt_errorf(NMT_ERR_IO, "cannot create %s (a copy of %s): %s", staged, path,
                              strerror(errno));
    if (fd >= 0) close(fd), unlink(staged);
    fclose(in);
    staged[0] = 0;
    return e;
  }
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, in)) > 0)
    if (fwrite(buf, 1, n, o) != n) break;
  int bad_in = ferror(in), bad_out = ferror(o);
  fclose(in);
  if (fclose(o) != 0 || bad_in || bad_out) {
    unlink(staged);
    staged[0] = 0;
    return nmt_errorf(NMT_ERR_IO, "cannot copy %s into %s/: %s", path, dir,
                      bad_in ? "read error" : "write error");
  }
  return NMT_OK;
}

const char *nmt_eval_tmp_dir(int *from_env) {
  const char *d = getenv("TMPDIR");
  if (from_env) *from_env = d && *d;
  return d && *d ? d : "/tmp";
}

/* "NAME|SIGNATURE = SCORE REST" lines of sacreBLEU's text format. */
static int parse_score(const char *line, const char *name, double *score, char *sig, size_t cap,
                       char *rest, size_t rcap) {
  size_t n = strlen(name);
  while (*line == ' ') line++;
  if (strncmp(line, name, n) || line[n] != '|') return 0;
  const char *eq = strstr(line, " = ");
  if (!eq) return 0;
  char *end;
  double v = strtod(eq + 3, &end);
  if (end == eq + 3) return 0;
  snprintf(sig, cap, "%.*s", (int)(eq - (line + n + 1)), line + n + 1);
  while (*end == ' ') end++;
  if (rest) snprintf(rest, rcap, "%.*s", (int)strcspn(end, "\n"), end);
  *score = v;
  return 1;
}

/* Runs argv (no shell: posix_spawnp) with stdout and stderr into one pipe; returns its read
 * end as a FILE and the child's pid. */
static nmt_status spawn_reader(char *const argv[], FILE **out, pid_t *pid) {
  int fd[2];
  if (pipe2(fd, O_CLOEXEC) != 0) return nmt_errorf(NMT_ERR_IO, "pipe: %s", strerror(errno));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fd[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&fa, fd[1], STDERR_FILENO);
  int e = posix_spawnp(pid, argv[0], &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(fd[1]);
  if (e != 0) {
    close(fd[0]);
    return nmt_errorf(NMT_ERR_IO, "cannot run %s: %s; sacreBLEU needs python3 with the "
                      "sacrebleu package (tools/install-deps.sh --bleu)", argv[0], strerror(e));
  }
  *out = fdopen(fd[0], "r");
  if (!*out) {
    close(fd[0]);
    waitpid(*pid, NULL, 0);
    return nmt_errorf(NMT_ERR_IO, "fdopen: %s", strerror(errno));
  }
  return NMT_OK;
}

/* nmt_eval_sacrebleu on a regular reference file ref_path, named ref_label in messages. */
static nmt_status sacrebleu_run(const char *hyp_path, const char *ref_path, const char *ref_label,
                                const char *report_path, nmt_eval_bleu_result *out) {
  nmt_status s = NMT_OK;
  memset(out, 0, sizeof *out);
  long nh = count_lines(hyp_path, &s), nr = nh >= 0 ? count_lines(ref_path, &s) : -1;
  if (nh < 0 || nr < 0) return s;
  if (nr == 0)
    return nmt_errorf(NMT_ERR_DATA, "the reference %s is empty: nothing to score", ref_label);
  if (nh != nr)
    return nmt_errorf(NMT_ERR_DATA, "%s has %ld lines but the reference %s has %ld", hyp_path, nh,
                      ref_label, nr);
  char *argv[] = {"python3", "-m", "sacrebleu", (char *)ref_path, "-i", (char *)hyp_path,
                  "-m", "bleu", "chrf", "-w", "2", "-f", "text", NULL};
  FILE *rep = NULL, *p;
  pid_t pid;
  if (report_path && !(rep = fopen(report_path, "w")))
    return nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", report_path, strerror(errno));
  if ((s = spawn_reader(argv, &p, &pid)) != NMT_OK) {
    if (rep) fclose(rep);
    return s;
  }
  char line[4096], last[4096] = "";
  int got = 0, st = 0, missing = 0;
  while (fgets(line, sizeof line, p)) {
    if (rep) fputs(line, rep);
    if (line[0] != '\n') snprintf(last, sizeof last, "%s", line);
    missing |= strstr(line, "No module named sacrebleu") != NULL;
    got |= parse_score(line, "BLEU", &out->bleu, out->bleu_signature, sizeof out->bleu_signature,
                       out->bleu_detail, sizeof out->bleu_detail);
    got |= parse_score(line, "chrF2", &out->chrf, out->chrf_signature, sizeof out->chrf_signature,
                       NULL, 0) << 1;
  }
  fclose(p);
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) continue;
  if (rep && fclose(rep) != 0)
    return nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", report_path, strerror(errno));
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || got != 3)
    /* The install advice only where sacreBLEU is missing: its own refusals (e.g. "System
     * and reference streams have different lengths") are about the input. */
    return nmt_errorf(NMT_ERR_IO,
                      "`python3 -m sacrebleu %s -i %s` failed (exit %d) or printed no BLEU and "
                      "chrF2 scores (last line: %.*s)%s",
                      ref_label, hyp_path, WIFEXITED(st) ? WEXITSTATUS(st) : -1,
                      (int)strcspn(last, "\n"), last,
                      missing ? "; install it with tools/install-deps.sh --bleu" : "");
  return NMT_OK;
}

nmt_status nmt_eval_sacrebleu(const char *hyp_path, const char *ref_path, const char *report_path,
                              nmt_eval_bleu_result *out) {
  memset(out, 0, sizeof *out);
  char staged[NMT_PATH_MAX + 32];
  NMT_TRY(stage_text(ref_path, nmt_eval_tmp_dir(NULL), staged, sizeof staged));
  nmt_status s = sacrebleu_run(hyp_path, staged[0] ? staged : ref_path, ref_path, report_path, out);
  if (staged[0]) unlink(staged);
  return s;
}

nmt_status nmt_eval_score_hyps(char *const *hyps, long n, const char *ref_path,
                               nmt_eval_bleu_result *out) {
  char path[NMT_PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/nmt-hyp-XXXXXX", nmt_eval_tmp_dir(NULL));
  int fd = mkstemp(path);
  if (fd < 0) return nmt_errorf(NMT_ERR_IO, "cannot create %s: %s", path, strerror(errno));
  FILE *f = fdopen(fd, "w");
  if (!f) {
    close(fd);
    unlink(path);
    return nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
  }
  for (long i = 0; i < n; i++) fprintf(f, "%s\n", hyps[i]);
  nmt_status s = NMT_OK;
  if (fclose(f) != 0) s = nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
  if (s == NMT_OK) s = nmt_eval_sacrebleu(path, ref_path, NULL, out);
  unlink(path);
  return s;
}

void nmt_eval_print_bleu(FILE *f, const nmt_eval_bleu_result *r) {
  fprintf(f, "BLEU  = %6.2f  %s\n", r->bleu, r->bleu_detail);
  fprintf(f, "chrF2 = %6.2f\n", r->chrf);
  fprintf(f, "signatures: BLEU %s\n            chrF2 %s\n", r->bleu_signature, r->chrf_signature);
}

nmt_status nmt_eval_bleu(const nmt_config *cfg, const char *ckpt, const nmt_spm *spm,
                         const char *src_text, const char *ref_text, const char *hyp_path,
                         const char *report_path, nmt_eval_bleu_result *out) {
  memset(out, 0, sizeof *out);
  nmt_translate_options o;
  nmt_translate_options_default(&o);
  o.input = src_text, o.output = hyp_path, o.spm = spm;
  NMT_TRY(nmt_translate(cfg, ckpt, &o));
  return nmt_eval_sacrebleu(hyp_path, ref_text, report_path, out);
}

/* "key=VALUE" in a settings line, into out. */
static int setting(const char *line, const char *key, char *out, size_t cap) {
  size_t k = strlen(key);
  for (const char *p = line; (p = strstr(p, key)); p++)
    if ((p == line || p[-1] == ' ') && p[k] == '=') {
      snprintf(out, cap, "%.*s", (int)strcspn(p + k + 1, " \n"), p + k + 1);
      return out[0] != 0;
    }
  return 0;
}

nmt_status nmt_eval_split_text(const nmt_config *cfg, const char *split, char *src, char *ref,
                               size_t cap) {
  if (strcmp(split, "valid") && strcmp(split, "test"))
    return nmt_errorf(NMT_ERR_USAGE, "eval --split \"%s\": expected valid or test", split);
  const char *shard = strcmp(split, "test") ? cfg->data_valid : cfg->data_test;
  if (!shard[0])
    return nmt_errorf(NMT_ERR_CONFIG, "eval --split %s needs [data] %s (the split's shard)",
                      split, split);
  const char *slash = strrchr(shard, '/');
  const int dl = slash ? (int)(slash - shard) : 1;
  const char *dir = slash ? shard : ".", *base = slash ? slash + 1 : shard;
  int bl = (int)strlen(base);
  if (bl > 6 && !strcmp(base + bl - 6, ".shard")) bl -= 6;
  char settings[NMT_PATH_MAX + 32], line[1024] = "", sl[64], tl[64];
  snprintf(settings, sizeof settings, "%.*s/spm.settings", dl, dir);
  FILE *f = fopen(settings, "r");
  int ok = f && fgets(line, sizeof line, f) && setting(line, "src", sl, sizeof sl) &&
           setting(line, "tgt", tl, sizeof tl);
  if (f) fclose(f);
  if (!ok)
    return nmt_errorf(NMT_ERR_DATA,
                      "split %s: BLEU needs the split's raw text, and %s (written by "
                      "tools/prepare-data.sh) does not say its languages (src=, tgt=)",
                      split, settings);
  snprintf(src, cap, "%.*s/%.*s.%s", dl, dir, bl, base, sl);
  snprintf(ref, cap, "%.*s/%.*s.%s", dl, dir, bl, base, tl);
  for (int i = 0; i < 2; i++)
    if (access(i ? ref : src, R_OK) != 0)
      return nmt_errorf(NMT_ERR_DATA,
                        "split %s: cannot read the split's %s text %s (%s; languages "
                        "from %s)",
                        split, i ? "reference" : "source", i ? ref : src, strerror(errno),
                        settings);
  return NMT_OK;
}

/* mkdir -p; existing directories are fine. */
static nmt_status mkdir_p(const char *dir) {
  char p[NMT_PATH_MAX + 16];
  snprintf(p, sizeof p, "%s", dir);
  for (char *c = p + 1;; c++) {
    if (*c == '/' || !*c) {
      char keep = *c;
      *c = 0;
      if (mkdir(p, 0755) != 0 && errno != EEXIST)
        return nmt_errorf(NMT_ERR_IO, "cannot create directory %s: %s", p, strerror(errno));
      *c = keep;
      if (!keep) break;
    }
  }
  return NMT_OK;
}


void nmt_eval_paths_of(const nmt_config *cfg, const char *ckpt, const char *src_text,
                       nmt_eval_paths *out) {
  snprintf(out->jsonl, sizeof out->jsonl, "%s/eval/eval.jsonl", cfg->run_out_dir);
  out->hyp[0] = out->report[0] = 0;
  if (!src_text) return;
  const char *base = strrchr(src_text, '/'), *cb = strrchr(ckpt, '/');
  base = base ? base + 1 : src_text;
  cb = cb ? cb + 1 : ckpt;
  int cl = (int)strlen(cb);
  if (cl > 5 && !strcmp(cb + cl - 5, ".ckpt")) cl -= 5;
  snprintf(out->hyp, sizeof out->hyp, "%s/eval/%.300s.%.*s.beam%d.hyp", cfg->run_out_dir, base,
           cl < 900 ? cl : 900, cb, cfg->decode_beam);
  snprintf(out->report, sizeof out->report, "%s.sacrebleu.txt", out->hyp);
}

nmt_status nmt_eval_run(const nmt_config *cfg, const nmt_eval_options *opt, FILE *out) {
  nmt_status s = NMT_OK;
  char ckpt[1024], dir[NMT_PATH_MAX + 16];
  if (opt->ckpt) {
    snprintf(ckpt, sizeof ckpt, "%s", opt->ckpt);
  } else {
    snprintf(dir, sizeof dir, "%s/checkpoints", cfg->run_out_dir);
    NMT_TRY(nmt_ckpt_find_latest(dir, ckpt));
  }
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(cfg, &mc);
  nmt_ckpt_header expect, h;
  nmt_ckpt_expect_from_config(cfg, &expect);
  float *params = malloc(nmt_model_num_params(&mc) * sizeof *params);
  if (!params) return nmt_errorf(NMT_ERR_NOMEM, "parameters");
  NMT_TRY_GOTO(s, nmt_ckpt_read(ckpt, &expect, &h, params, NULL, NULL), done);
  fprintf(out, "checkpoint %s (step %lld)\n", ckpt, (long long)h.step);
  snprintf(dir, sizeof dir, "%s/eval", cfg->run_out_dir);
  NMT_TRY_GOTO(s, mkdir_p(dir), done);

  int have_loss = opt->shard && opt->shard[0], have_bleu = opt->src_text && opt->ref_text;
  nmt_eval_loss_result lr = {0};
  nmt_eval_bleu_result br = {0};
  nmt_eval_paths paths;
  nmt_eval_paths_of(cfg, ckpt, have_bleu ? opt->src_text : NULL, &paths);
  const char *hyp = paths.hyp, *rep = paths.report;
  char hyp_tmp[sizeof paths.hyp + 8] = "", rep_tmp[sizeof paths.report + 8] = "";
  char src_staged[NMT_PATH_MAX + 64] = "", ref_staged[NMT_PATH_MAX + 64] = "";
  if (have_loss) {
    NMT_TRY_GOTO(s, nmt_eval_loss(cfg, params, opt->shard, &lr), done);
    fprintf(out, "%s %s: %ld pairs, %.0f target tokens; %ld pairs longer than data.max_len %d "
                 "skipped\n",
            opt->shard_label ? opt->shard_label : "shard", opt->shard, lr.pairs, lr.tokens,
            lr.dropped, cfg->data_max_len);
    fprintf(out, "loss %.6f nll %.6f ppl %.4f tokens %.0f pairs %ld dropped %ld\n", lr.loss,
            lr.nll, lr.ppl, lr.tokens, lr.pairs, lr.dropped);
    fprintf(out, "(loss: label-smoothed cross entropy, eps %g; nll: unsmoothed; per target "
                 "token incl. EOS, nats; ppl = exp(nll))\n",
            (double)mc.label_smoothing);
    fflush(out);
  }
  if (have_bleu) {
    /* Both texts are checked before the decoding, which can take long: a pipe is copied
     * first (stage_text), an empty source or a line count that differs is refused. */
    NMT_TRY_GOTO(s, stage_text(opt->src_text, dir, src_staged, sizeof src_staged), done);
    NMT_TRY_GOTO(s, stage_text(opt->ref_text, dir, ref_staged, sizeof ref_staged), done);
    const char *src = src_staged[0] ? src_staged : opt->src_text;
    const char *ref = ref_staged[0] ? ref_staged : opt->ref_text;
    long ns = count_lines(src, &s), nr = ns >= 0 ? count_lines(ref, &s) : -1;
    if (ns < 0 || nr < 0) goto done;
    if (ns == 0 || nr == 0) {
      s = nmt_errorf(NMT_ERR_DATA, "the %s %s is empty: nothing to %s", ns ? "reference" :
                     "source", ns ? opt->ref_text : opt->src_text, ns ? "score" : "translate");
      goto done;
    }
    if (ns != nr) {
      s = nmt_errorf(NMT_ERR_DATA, "the source %s has %ld lines but the reference %s has %ld: "
                     "BLEU needs one reference line per source line (nothing was decoded)",
                     opt->src_text, ns, opt->ref_text, nr);
      goto done;
    }
    fprintf(out, "translating %s (beam %d, length penalty %g, max extra length %d)\n",
            opt->src_text, cfg->decode_beam, (double)cfg->decode_length_penalty,
            cfg->decode_max_extra_len);
    fflush(out);
    /* The hypotheses and the report go to NAME.partial and take their names only once both
     * are complete: an eval stopped or failing midway never leaves a truncated .hyp beside
     * the scores of an earlier run. */
    snprintf(hyp_tmp, sizeof hyp_tmp, "%s.partial", hyp);
    snprintf(rep_tmp, sizeof rep_tmp, "%s.partial", rep);
    nmt_translate_options to;
    nmt_translate_options_default(&to);
    to.input = src, to.output = hyp_tmp, to.spm = opt->spm;
    NMT_TRY_GOTO(s, nmt_translate(cfg, ckpt, &to), done);
    NMT_TRY_GOTO(s, sacrebleu_run(hyp_tmp, ref, opt->ref_text, rep_tmp, &br), done);
    if (rename(rep_tmp, rep) != 0 || rename(hyp_tmp, hyp) != 0) {
      s = nmt_errorf(NMT_ERR_IO, "cannot rename %s.partial to %s: %s", hyp, hyp,
                     strerror(errno));
      goto done;
    }
    hyp_tmp[0] = rep_tmp[0] = 0;
    fprintf(out, "reference %s\n", opt->ref_text);
    nmt_eval_print_bleu(out, &br);
    fprintf(out, "hypotheses: %s\nsacreBLEU's report: %s\n", hyp, rep);
  }
  const char *jl = paths.jsonl;
  FILE *f = fopen(jl, "a");
  if (!f) {
    s = nmt_errorf(NMT_ERR_IO, "cannot append to %s: %s", jl, strerror(errno));
    goto done;
  }
  fputs("{\"ckpt\":", f);
  nmt_json_str(f, ckpt);
  fprintf(f, ",\"step\":%lld", (long long)h.step);
  if (have_loss) {
    fputs(",\"shard\":", f);
    nmt_json_str(f, opt->shard);
    fprintf(f,
            ",\"loss\":%.6f,\"nll\":%.6f,\"ppl\":%.4f,\"tokens\":%.0f,\"pairs\":%ld,"
            "\"dropped\":%ld,\"label_smoothing\":%g",
            lr.loss, lr.nll, lr.ppl, lr.tokens, lr.pairs, lr.dropped,
            (double)mc.label_smoothing);
  }
  if (have_bleu) {
    fputs(",\"src\":", f);
    nmt_json_str(f, opt->src_text);
    fputs(",\"ref\":", f);
    nmt_json_str(f, opt->ref_text);
    fputs(",\"hyp\":", f);
    nmt_json_str(f, hyp);
    fprintf(f, ",\"beam\":%d,\"length_penalty\":%g,\"max_extra_len\":%d,\"bleu\":%.2f",
            cfg->decode_beam, (double)cfg->decode_length_penalty, cfg->decode_max_extra_len,
            br.bleu);
    fputs(",\"bleu_signature\":", f);
    nmt_json_str(f, br.bleu_signature);
    fprintf(f, ",\"chrf\":%.2f,\"chrf_signature\":", br.chrf);
    nmt_json_str(f, br.chrf_signature);
  }
  fputs("}\n", f);
  if (fclose(f) != 0) s = nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", jl, strerror(errno));
done:
  if (hyp_tmp[0]) unlink(hyp_tmp);
  if (rep_tmp[0]) unlink(rep_tmp);
  if (src_staged[0]) unlink(src_staged);
  if (ref_staged[0]) unlink(ref_staged);
  free(params);
  return s;
}
