/* valid.c — what a validation decides beyond the loss: validation BLEU (train.valid_bleu), the
 * best validation so far (train.best_metric, checkpoints/best) and early stopping
 * (train.patience).
 *
 * BLEU runs on global rank 0 alone: corpus BLEU is not a sum of per-sentence parts (sacreBLEU
 * needs every hypothesis in one file), and the communicators move floats, not text. Rank 0
 * copies its parameters to the host, decodes the valid split's raw source on its own
 * inference context ([decode] settings with train.valid_beam) and scores it
 * (nmt_eval_score_hyps); the other ranks meanwhile wait in the all-reduce that then hands
 * every rank the two scores (rank 0 adds them, the others zeros). So every rank holds the
 * same numbers and takes the same early-stopping decision at the same step, with no stop flag
 * to carry: the stop happens at the validation step itself, which already reads its own
 * control block before the next step is enqueued (worker.c read_now).
 *
 * What that costs is logged by rank 0 at every validation: its decoding and scoring time, the
 * longest wait of the other ranks (each rank's time from entering the validation to the
 * scores' arrival, gathered by one more all-reduce of a float, max), and the segment's totals
 * as a share of its wall time so far: on a GPU run every rank stands still that long.
 *
 * That inference context (the decoder rig: context, cuBLASLt handle, streams, model and
 * decoder buffers) is opened once, at create, before the communicator exists, with its
 * buffers sized for the longest valid source, and every validation reuses it: opening and
 * freeing device memory while the other ranks' NCCL kernels wait in the all-reduce can hang
 * (cudaMalloc / cudaFree synchronize the device; cuda/context.cu, cuda/nccl.cu). Its context
 * carries the run's abort flag, so an abort ends rank 0's decoding too.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/clock.h"
#include "nmt/eval.h"
#include "nmt/log.h"
#include "nmt/spm.h"
#include "nmt/translate.h"
#include "preflight.h"
#include "valid.h"


/* The config keys of validation against each other and the data. */
static nmt_status check_keys(const nmt_config *cfg) {
  const int validates = cfg->data_valid[0] && cfg->train_valid_every > 0;
  if (cfg->train_best_metric == NMT_METRIC_VALID_BLEU && !cfg->train_valid_bleu)
    return nmt_errorf(NMT_ERR_CONFIG, "[train] best_metric = valid_bleu needs [train] valid_bleu "
                      "= on (BLEU is only measured then)");
  if (cfg->train_patience > 0 && !validates)
    return nmt_errorf(NMT_ERR_CONFIG, "[train] patience = %d needs validations: [data] valid = "
                      "\"%s\", [train] valid_every = %d (set both, or patience = 0)",
                      cfg->train_patience, cfg->data_valid, cfg->train_valid_every);
  if (cfg->train_valid_bleu && !validates)
    return nmt_errorf(NMT_ERR_CONFIG, "[train] valid_bleu = on needs validations: [data] valid = "
                      "\"%s\", [train] valid_every = %d (set both, or valid_bleu = off)",
                      cfg->data_valid, cfg->train_valid_every);
  if (cfg->train_valid_bleu && !cfg->data_spm_model[0])
    return nmt_errorf(NMT_ERR_CONFIG, "[train] valid_bleu = on needs [data] spm_model (to encode "
                      "the raw valid source and detokenize the hypotheses)");
  return NMT_OK;
}

/* The longest line of the raw source, in SentencePiece ids. */
static nmt_status longest_source(const char *path, const nmt_spm *spm, int *longest) {
  FILE *f = fopen(path, "r");
  if (!f) return nmt_errorf(NMT_ERR_IO, "cannot read %s: %s", path, strerror(errno));
  char *line = NULL;
  size_t cap = 0;
  ssize_t len;
  nmt_status s = NMT_OK;
  *longest = 0;
  while (s == NMT_OK && (len = getline(&line, &cap, f)) >= 0) {
    while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) len--;
    int32_t *ids = NULL;
    int n = 0;
    s = nmt__encode_line(spm, line, (size_t)len, &ids, &n);
    free(ids);
    if (n > *longest) *longest = n;
  }
  free(line);
  fclose(f);
  return s;
}

/* The decoding config: the [decode] settings with train.valid_beam, and room for the longest
 * valid source and its output (up to model.max_positions): validation BLEU scores the whole
 * split, where training drops pairs longer than data.max_len. */
static nmt_status decode_config(const nmt_config *cfg, nmt__valid_bleu_setup *vb,
                                nmt_config *d) {
  *d = *cfg;
  if (cfg->train_valid_beam > 0) d->decode_beam = cfg->train_valid_beam;
  NMT_TRY(longest_source(vb->src, vb->spm, &vb->longest));
  const int longest = vb->longest;
  long want = (long)longest + 1 + cfg->decode_max_extra_len;
  if (want > cfg->model_max_positions) want = cfg->model_max_positions;
  if (want > d->data_max_len) d->data_max_len = (int)want;
  if (longest + 1 > cfg->model_max_positions)
    nmt_log(NMT_LOG_WARN, "validation BLEU: the longest source of %s has %d ids, more than "
            "[model] max_positions = %d allows: such sources are cut", vb->src, longest,
            cfg->model_max_positions);
  return NMT_OK;
}

nmt_status nmt__valid_setup(const nmt_config *cfg, int first_rank, size_t n_params,
                            nmt__valid_bleu_setup *vb) {
  NMT_TRY(check_keys(cfg));
  if (!cfg->train_valid_bleu || first_rank != 0) return NMT_OK;
  nmt_status s = nmt_eval_split_text(cfg, "valid", vb->src, vb->ref, sizeof vb->src);
  if (s != NMT_OK)
    return nmt_errorf(s, "[train] valid_bleu = on needs the raw text of [data] valid: %s",
                      nmt_last_error());
  NMT_TRY(nmt_spm_load(cfg->data_spm_model, &vb->spm));
  NMT_TRY(nmt_spm_check_vocab(vb->spm, cfg->model_vocab));
  /* Fail now rather than at the first validation: the hypotheses' temporary directory takes
   * a file, sacreBLEU runs, and source and reference have as many lines (the source stands in
   * for hypotheses here). */
  NMT_TRY(nmt__preflight_tmp("[train] valid_bleu = on"));
  nmt_eval_bleu_result r;
  s = nmt_eval_sacrebleu(vb->src, vb->ref, NULL, &r);
  if (s != NMT_OK)
    return nmt_errorf(s, "[train] valid_bleu = on: %s", nmt_last_error());
  NMT_TRY(decode_config(cfg, vb, &vb->dcfg));
  vb->host_params = malloc(n_params * sizeof(float));
  if (!vb->host_params) return nmt_errorf(NMT_ERR_NOMEM, "validation BLEU: host parameters");
  vb->on = 1;
  nmt_log(NMT_LOG_INFO, "validation BLEU: %s against %s, beam %d, sacreBLEU (on rank 0)",
          vb->src, vb->ref, vb->dcfg.decode_beam);
  return NMT_OK;
}

nmt_status nmt__valid_open(nmt__valid_bleu_setup *vb, const nmt_backend *be, atomic_int *abort,
                           const float *host_params) {
  if (!vb->on) return NMT_OK;
  NMT_TRY(nmt__rig_open_on(&vb->rig, &vb->dcfg, be, abort, host_params, 1, 0));
  NMT_TRY(nmt__rig_reserve(&vb->rig, vb->longest));
  nmt_log(NMT_LOG_DEBUG, "validation BLEU: decoder open on %s for the run (sources up to %d "
          "ids)", vb->rig.dev.be->name, vb->longest);
  return NMT_OK;
}

void nmt__valid_free(nmt__valid_bleu_setup *vb) {
  nmt__rig_close(&vb->rig);
  nmt_spm_free(vb->spm);
  free(vb->host_params);
  memset(vb, 0, sizeof *vb);
}

/* Rank 0: decodes and scores; out[0] = BLEU, out[1] = chrF2; *n sentences, decoded in
 * *decode_s seconds (the parameters' copy included) and scored in *score_s. */
static nmt_status decode_and_score(nmt__replica *r, nmt__valid_bleu_setup *vb, float out[2],
                                   long *n, double *decode_s, double *score_s) {
  const double t0 = nmt_clock_now_s();
  NMT_TRY(r->be->copy_d2h(r->ctx, vb->host_params, r->params, r->plan->n_params * sizeof(float)));
  /* The rig opened at create: a copy into its parameters, no allocation on the device. */
  NMT_TRY(nmt__rig_load(&vb->rig, vb->host_params));
  char **hyps;
  NMT_TRY(nmt__rig_to_text(&vb->rig, vb->spm, vb->src, 0, &hyps, n));
  const double t1 = nmt_clock_now_s();
  nmt_eval_bleu_result score;
  nmt_status s = nmt_eval_score_hyps(hyps, *n, vb->ref, &score);
  nmt_translate_text_free(hyps, *n);
  NMT_TRY(s);
  *decode_s = t1 - t0;
  *score_s = nmt_clock_now_s() - t1;
  out[0] = (float)score.bleu;
  out[1] = (float)score.chrf;
  return NMT_OK;
}

/* Rank 0's line: this validation's decoding, scoring and the others' longest wait, and the
 * segment's totals against its wall time so far (the segment began at seg_start). */
static void log_cost(nmt__valid_bleu_setup *vb, int world, long step, double seg_start, long n,
                     double decode_s, double score_s, double wait_s) {
  if (vb->t_start != seg_start) vb->t_start = seg_start, vb->decode_s = 0;
  vb->decode_s += decode_s + score_s;
  const double wall = nmt_clock_now_s() - seg_start;
  char others[96] = "", how[64] = "greedy";
  if (vb->dcfg.decode_beam > 1)
    snprintf(how, sizeof how, "beam %d, %s", vb->dcfg.decode_beam,
             nmt_beam_rule_name(vb->dcfg.decode_beam_rule));
  if (world > 1)
    snprintf(others, sizeof others, "; the other %d rank(s) waited up to %.1f s", world - 1,
             wait_s);
  nmt_log(NMT_LOG_INFO, "step %ld | validation BLEU: rank 0 decoded %ld sentences in %.1f s "
          "(%.1f sentences/s, %s) and scored them in %.1f s%s | so far %.1f s of %.0f s wall "
          "(%.1f%%)", step, n, decode_s, decode_s > 0 ? (double)n / decode_s : 0.0, how,
          score_s, others, vb->decode_s, wall, wall > 0 ? 100.0 * vb->decode_s / wall : 0.0);
}

nmt_status nmt__valid_bleu(nmt__replica *r, nmt__valid_bleu_setup *vb, long step,
                           double seg_start, nmt__valid_result *v) {
  const nmt_backend *be = r->be;
  const double t0 = nmt_clock_now_s();
  float h[NMT_GRAD_EXTRA] = {0};
  long n = 0;
  double decode_s = 0, score_s = 0;
  if (r->grank == 0) {
    if (!vb->on || !vb->rig.dec)
      return nmt_errorf(NMT_ERR_INTERNAL, "validation BLEU was not set up on rank 0");
    NMT_TRY(decode_and_score(r, vb, h, &n, &decode_s, &score_s));
  }
  /* Every rank gets rank 0's numbers (x + 0 + ... + 0 is exact); one rank has nobody to ask. */
  float wait[NMT_GRAD_EXTRA] = {0};
  if (r->world > 1) {
    NMT_TRY(be->copy_h2d(r->ctx, r->dev_valid, h, sizeof h));
    NMT_TRY(nmt_comm_allreduce_sum(r->comm, r->dev_valid, NMT_GRAD_EXTRA));
    NMT_TRY(nmt_comm_flush(r->comm));
    NMT_TRY(be->copy_d2h(r->ctx, h, r->dev_valid, sizeof h));
    /* How long the others stood still: the longest, for rank 0's line. */
    if (r->grank != 0) wait[0] = (float)(nmt_clock_now_s() - t0);
    NMT_TRY(be->copy_h2d(r->ctx, r->dev_valid, wait, sizeof wait));
    NMT_TRY(nmt_comm_allreduce_max(r->comm, r->dev_valid, NMT_GRAD_EXTRA));
    NMT_TRY(nmt_comm_flush(r->comm));
    NMT_TRY(be->copy_d2h(r->ctx, wait, r->dev_valid, sizeof wait));
  }
  if (r->grank == 0) log_cost(vb, r->world, step, seg_start, n, decode_s, score_s, wait[0]);
  v->has_bleu = 1;
  v->bleu = h[0];
  v->chrf = h[1];
  return NMT_OK;
}

/* The metric value of a validation (NAN when it had no target tokens). */
static double metric_value(nmt_valid_metric m, const nmt__valid_result *v) {
  const double tok = v->x[NMT_GRAD_SLOT_TOKENS];
  switch (m) {
    case NMT_METRIC_VALID_LOSS: return tok > 0 ? v->x[NMT_GRAD_SLOT_LOSS] / tok : NAN;
    case NMT_METRIC_VALID_PPL: return tok > 0 ? exp(v->x[NMT_GRAD_SLOT_NLL] / tok) : NAN;
    case NMT_METRIC_VALID_BLEU: return v->has_bleu ? v->bleu : NAN;
  }
  return NAN;
}

int nmt__best_update(const nmt_config *cfg, nmt__best *b, long step, nmt__valid_result *v) {
  const double x = metric_value(b->metric, v);
  const int higher = b->metric == NMT_METRIC_VALID_BLEU;
  /* Strictly better; the first finite value always is. A NaN never is. */
  v->improved = isfinite(x) && (b->step == 0 || (higher ? x > b->value : x < b->value));
  if (v->improved) {
    b->step = step, b->value = x, b->bad = 0;
  } else {
    b->bad++;
  }
  return nmt__best_exhausted(cfg, b);
}

int nmt__best_exhausted(const nmt_config *cfg, const nmt__best *b) {
  return cfg->train_patience > 0 && b->bad >= cfg->train_patience;
}

void nmt__best_reason(const nmt_config *cfg, const nmt__best *b, long step, char *buf,
                      size_t cap) {
  if (b->step > 0)
    snprintf(buf, cap, "early stopping at step %ld: %s did not improve for %ld validations "
             "(train.patience = %d); best %.6g at step %ld", step, nmt_valid_metric_name(b->metric),
             b->bad, cfg->train_patience, b->value, b->step);
  else
    snprintf(buf, cap, "early stopping at step %ld: %s was not measured in %ld validations "
             "(train.patience = %d)", step, nmt_valid_metric_name(b->metric), b->bad,
             cfg->train_patience);
}

void nmt__best_resume(const nmt_config *cfg, const nmt_ckpt_header *h, nmt__best *best) {
  const nmt_valid_metric want = cfg->train_best_metric;
  if (h->best_step <= 0) return;
  if (h->best_metric != (int32_t)want) {
    nmt_log(NMT_LOG_INFO, "the checkpoint's best validation is by %s, [train] best_metric is %s: "
            "the best and the patience count start anew",
            nmt_valid_metric_name((nmt_valid_metric)h->best_metric), nmt_valid_metric_name(want));
    return;
  }
  *best = (nmt__best){.metric = want, .step = (long)h->best_step, .value = h->best_value,
                      .bad = (long)h->best_bad};
  nmt_log(NMT_LOG_INFO, "best %s so far: %.6g at step %ld; %ld validations since without "
          "improvement", nmt_valid_metric_name(want), h->best_value, (long)h->best_step,
          (long)h->best_bad);
}
