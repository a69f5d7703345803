/* eval.c — loss/perplexity of a checkpoint on a shard, and BLEU/chrF of its translations
 * through sacreBLEU (include/nmt/eval.h). */
#include "nmt/eval.h"
#include "nmt/json.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "nmt/backend.h"
#include "nmt/data.h"
#include "nmt/device.h"
#include "nmt/log.h"
#include "nmt/model.h"
#include "nmt/translate.h"

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

/* Single-quotes s for /bin/sh. */
static void shell_quote(char *dst, size_t n, const char *src) {
  size_t j = 0;
  dst[j++] = '\'';
  for (const char *p = src; *p && j + 6 < n; p++) {
    if (*p == '\'') {
      memcpy(dst + j, "'\\''", 4);
      j += 4;
    } else {
      dst[j++] = *p;
    }
  }
  dst[j++] = '\'';
  dst[j] = 0;
}

/* "NAME|SIGNATURE = SCORE ..." lines of sacreBLEU's text format. */
static int parse_score(const char *line, const char *name, double *score, char *sig, size_t cap) {
  size_t n = strlen(name);
  while (*line == ' ') line++;
  if (strncmp(line, name, n) || line[n] != '|') return 0;
  const char *eq = strstr(line, " = ");
  if (!eq) return 0;
  char *end;
  double v = strtod(eq + 3, &end);
  if (end == eq + 3) return 0;
  size_t len = (size_t)(eq - (line + n + 1));
  if (len >= cap) len = cap - 1;
  memcpy(sig, line + n + 1, len);
  sig[len] = 0;
  *score = v;
  return 1;
}

/* One sacreBLEU score line for a reader: "BLEU  = 10.22 ...   [signature]", the metric name
 * padded so that BLEU's and chrF2's scores start in the same column (sacreBLEU's own lines put
 * the signature first, whose length differs by metric). Other lines as they are. */
static void print_aligned(FILE *out, const char *line) {
  const char *p = line;
  while (*p == ' ') p++;
  const char *bar = strchr(p, '|'), *eq = strstr(p, " = ");
  if (!bar || !eq || bar > eq || bar - p > 16) {
    fputs(line, out);
    return;
  }
  int rest = (int)strcspn(eq + 3, "\n");
  fprintf(out, "%-5.*s = %.*s   [%.*s]\n", (int)(bar - p), p, rest, eq + 3, (int)(eq - bar - 1),
          bar + 1);
}

nmt_status nmt_eval_bleu(const nmt_config *cfg, const char *ckpt, const char *src_text,
                         const char *ref_text, const char *hyp_path, const char *report_path,
                         FILE *report, nmt_eval_bleu_result *out) {
  nmt_status s = NMT_OK;
  memset(out, 0, sizeof *out);
  NMT_TRY(nmt_translate_file(cfg, ckpt, src_text, hyp_path, 0));
  long nh = count_lines(hyp_path, &s), nr = nh >= 0 ? count_lines(ref_text, &s) : -1;
  if (nh < 0 || nr < 0) return s;
  if (nh != nr)
    return nmt_errorf(NMT_ERR_DATA, "%s has %ld lines but the reference %s has %ld", hyp_path, nh,
                      ref_text, nr);
  char qref[NMT_PATH_MAX * 4 + 8], qhyp[NMT_PATH_MAX * 4 + 8], cmd[NMT_PATH_MAX * 10];
  shell_quote(qref, sizeof qref, ref_text);
  shell_quote(qhyp, sizeof qhyp, hyp_path);
  snprintf(cmd, sizeof cmd, "python3 -m sacrebleu %s -i %s -m bleu chrf -w 2 -f text 2>&1", qref,
           qhyp);
  FILE *rep = NULL;
  if (report_path && !(rep = fopen(report_path, "w")))
    return nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", report_path, strerror(errno));
  FILE *p = popen(cmd, "r");
  if (!p) {
    if (rep) fclose(rep);
    return nmt_errorf(NMT_ERR_IO, "cannot run `%s`: %s", cmd, strerror(errno));
  }
  char line[4096];
  int got = 0;
  while (fgets(line, sizeof line, p)) {
    if (report) print_aligned(report, line);
    if (rep) fputs(line, rep);
    got |= parse_score(line, "BLEU", &out->bleu, out->bleu_signature, sizeof out->bleu_signature);
    got |= parse_score(line, "chrF2", &out->chrf, out->chrf_signature, sizeof out->chrf_signature)
           << 1;
  }
  int st = pclose(p);
  if (rep && fclose(rep) != 0)
    return nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", report_path, strerror(errno));
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || got != 3)
    return nmt_errorf(NMT_ERR_IO,
                      "`python3 -m sacrebleu` failed (exit %d) or printed no BLEU and chrF2 "
                      "scores; install it with tools/install-deps.sh --bleu",
                      WIFEXITED(st) ? WEXITSTATUS(st) : -1);
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
  char hyp[NMT_PATH_MAX + 256] = "", rep[NMT_PATH_MAX + 300] = "";
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
    const char *base = strrchr(opt->src_text, '/');
    base = base ? base + 1 : opt->src_text;
    /* Named after the checkpoint file, so an averaged checkpoint does not overwrite the
     * hypotheses of the step it shares its step number with. */
    const char *cb = strrchr(ckpt, '/');
    cb = cb ? cb + 1 : ckpt;
    int cl = (int)strlen(cb);
    if (cl > 5 && !strcmp(cb + cl - 5, ".ckpt")) cl -= 5;
    snprintf(hyp, sizeof hyp, "%s/%s.%.*s.beam%d.hyp", dir, base, cl, cb, cfg->decode_beam);
    snprintf(rep, sizeof rep, "%s.sacrebleu.txt", hyp);
    fprintf(out, "translating %s (beam %d, length penalty %g, max extra length %d)\n",
            opt->src_text, cfg->decode_beam, (double)cfg->decode_length_penalty,
            cfg->decode_max_extra_len);
    fflush(out);
    NMT_TRY_GOTO(s, nmt_eval_bleu(cfg, ckpt, opt->src_text, opt->ref_text, hyp, rep, out, &br),
                 done);
    fprintf(out, "hypotheses: %s\n", hyp);
  }
  char jl[NMT_PATH_MAX + 32];
  snprintf(jl, sizeof jl, "%s/eval.jsonl", dir);
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
  free(params);
  return s;
}
