/* nmt/eval.h — evaluation of a checkpoint: loss and perplexity on a shard; BLEU and chrF of its
 * translations through sacreBLEU (Post 2018), with sacreBLEU's signature.
 *
 * `nmt eval` (src/main.c) drives both and writes what it produces under run.out_dir/eval/
 * (docs/decoding.md): hypotheses, sacreBLEU's report, and one JSON line per evaluation in
 * eval.jsonl.
 *
 * defines: nmt_eval_loss_result, nmt_eval_loss, nmt_eval_bleu_result, nmt_eval_bleu,
 *          nmt_eval_options, nmt_eval_run
 */
#ifndef NMT_EVAL_H
#define NMT_EVAL_H

#include <stdio.h>

#include "nmt/config.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  long pairs;       /* pairs evaluated */
  long dropped;     /* pairs with a side longer than data.max_len - 1 ids, skipped */
  double tokens;    /* non-pad target tokens (EOS included) */
  double loss_sum;  /* label-smoothed cross entropy (train.label_smoothing, §5.4), nats */
  double nll_sum;   /* unsmoothed negative log-likelihood, nats */
  double loss, nll; /* per target token */
  double ppl;       /* exp(nll) */
} nmt_eval_loss_result;

/* Loss of host_params (n_params floats, the model of cfg) on every pair of the shard at
 * shard_path that fits data.max_len, in eval mode (no dropout), in length-sorted batches of
 * at most data.max_tokens padded tokens; sums in double. Runs on the reference backend.
 * Errors: NMT_ERR_IO / NMT_ERR_DATA (shard cannot be opened or is invalid, vocab mismatch,
 * no pair fits), NMT_ERR_NOMEM. */
nmt_status nmt_eval_loss(const nmt_config *cfg, const float *host_params, const char *shard_path,
                         nmt_eval_loss_result *out);

typedef struct {
  double bleu, chrf;            /* corpus scores, 0..100 */
  char bleu_signature[256];     /* "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0" */
  char chrf_signature[256];
} nmt_eval_bleu_result;

/* Translates src_text (raw text, one sentence per line) with checkpoint `ckpt` and the
 * [decode] settings of cfg into hyp_path (nmt_translate_file), then runs
 *   python3 -m sacrebleu REF -i HYP -m bleu chrf -f text
 * and copies its output (scores with signatures) to `report` (may be NULL) and to
 * report_path (may be NULL). Errors: those of nmt_translate_file; NMT_ERR_IO when sacreBLEU
 * fails or prints no score (message: how to install it, tools/install-deps.sh --bleu), or the
 * files cannot be read or written; NMT_ERR_DATA when hypotheses and references differ in line
 * count. */
nmt_status nmt_eval_bleu(const nmt_config *cfg, const char *ckpt, const char *src_text,
                         const char *ref_text, const char *hyp_path, const char *report_path,
                         FILE *report, nmt_eval_bleu_result *out);

typedef struct {
  const char *ckpt;        /* NULL: the newest valid checkpoint in run.out_dir/checkpoints */
  const char *shard;       /* loss and perplexity on this shard; NULL or "": none */
  const char *shard_label; /* how the report names it ("valid", "test", a path) */
  const char *src_text;    /* with ref_text: translate and score; both NULL: no BLEU */
  const char *ref_text;
} nmt_eval_options;

/* `nmt eval`: loads the checkpoint once, prints the loss line
 *   loss L nll N ppl P tokens T pairs K dropped D
 * (per target token, nats) for opt->shard, then translates and scores opt->src_text against
 * opt->ref_text (sacreBLEU's lines, with signatures), all to `out`. Writes the hypotheses to
 * run.out_dir/eval/<source file name>.<checkpoint file name without .ckpt>.beam<B>.hyp,
 * sacreBLEU's report next to them (.sacrebleu.txt), and appends one JSON object per call to
 * run.out_dir/eval/eval.jsonl.
 * Errors: those of nmt_eval_loss and nmt_eval_bleu, NMT_ERR_CHECKPOINT, NMT_ERR_IO. */
nmt_status nmt_eval_run(const nmt_config *cfg, const nmt_eval_options *opt, FILE *out);

#ifdef __cplusplus
}
#endif
#endif /* NMT_EVAL_H */
