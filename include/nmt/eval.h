/* nmt/eval.h — evaluation of a checkpoint: loss and perplexity on a shard; BLEU and chrF of its
 * translations through sacreBLEU (Post 2018), with sacreBLEU's signature. The scoring pieces
 * (nmt_eval_score_hyps with nmt_translate_to_text) serve validation BLEU during training.
 *
 * `nmt eval` (src/main.c) drives both and writes what it produces under run.out_dir/eval/
 * (docs/decoding.md): hypotheses, sacreBLEU's report, and one JSON line per evaluation in
 * eval.jsonl.
 *
 * defines: nmt_eval_loss_result, nmt_eval_loss, nmt_eval_bleu_result, nmt_eval_sacrebleu,
 *          nmt_eval_score_hyps, nmt_eval_tmp_dir, nmt_eval_print_bleu, nmt_eval_bleu,
 *          nmt_eval_split_text, nmt_eval_options, nmt_eval_run
 */
#ifndef NMT_EVAL_H
#define NMT_EVAL_H

#include <stdio.h>

#include "nmt/config.h"
#include "nmt/spm.h"
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
  char bleu_detail[256];        /* "45.1/16.2/7.0/3.2 (BP = 0.955 ratio = 0.956 hyp_len = ...)" */
} nmt_eval_bleu_result;

/* Scores the hypothesis file hyp_path against ref_path (one sentence per line, same count)
 * with sacreBLEU (Post 2018), run without a shell as
 *   python3 -m sacrebleu REF -i HYP -m bleu chrf -w 2 -f text
 * and copies its output to report_path (may be NULL). A ref_path that is not a regular file
 * (a pipe such as `<(sacrebleu -t wmt14 -l en-de --echo ref)`, a FIFO) is copied to a
 * temporary file in $TMPDIR first, since it is read twice. Errors: NMT_ERR_DATA (an empty
 * reference; line counts differ, naming both files), NMT_ERR_IO (a file unreadable; python3
 * or sacreBLEU missing, with how to install it: tools/install-deps.sh --bleu; sacreBLEU
 * failing, with its last line). */
nmt_status nmt_eval_sacrebleu(const char *hyp_path, const char *ref_path, const char *report_path,
                              nmt_eval_bleu_result *out);

/* For validation BLEU during training: scores hyps[0..n) (detokenized text, e.g. from
 * nmt_translate_to_text; no newlines inside) against the reference file ref_path, through a
 * temporary hypothesis file ($TMPDIR, removed afterwards) and nmt_eval_sacrebleu.
 * Errors: those of nmt_eval_sacrebleu. */
nmt_status nmt_eval_score_hyps(char *const *hyps, long n, const char *ref_path,
                               nmt_eval_bleu_result *out);

/* The directory of the temporary files above: $TMPDIR, or /tmp when it is unset or empty.
 * *from_env: 1 when $TMPDIR named it (may be NULL). */
const char *nmt_eval_tmp_dir(int *from_env);

/* Writes the two aligned score lines and the signatures ("BLEU  = 10.22 ...", "chrF2 = ...")
 * to f. */
void nmt_eval_print_bleu(FILE *f, const nmt_eval_bleu_result *r);

/* Translates src_text (raw text, one sentence per line) with checkpoint `ckpt`, the [decode]
 * settings of cfg and SentencePiece model spm into hyp_path (nmt_translate), then scores it
 * (nmt_eval_sacrebleu, report to report_path). Errors: those of nmt_translate and
 * nmt_eval_sacrebleu. */
nmt_status nmt_eval_bleu(const nmt_config *cfg, const char *ckpt, const nmt_spm *spm,
                         const char *src_text, const char *ref_text, const char *hyp_path,
                         const char *report_path, nmt_eval_bleu_result *out);

/* The raw text of a split for BLEU (docs/formats.md "Data directory"): for the split's shard
 * DIR/NAME.shard ([data] valid or test), the source DIR/NAME.SRC and the reference
 * DIR/NAME.TGT, where SRC and TGT are the languages DIR/spm.settings records (written by
 * tools/prepare-data.sh: "... src=en tgt=es ..."). split is "valid" or "test". Writes both
 * paths (cap bytes each). Errors: NMT_ERR_USAGE (another split, echoing it), NMT_ERR_CONFIG
 * (the split's shard key is empty), NMT_ERR_DATA (no spm.settings with src= and tgt=, or a
 * text file missing: the message names what was looked for and suggests --src/--ref). */
nmt_status nmt_eval_split_text(const nmt_config *cfg, const char *split, char *src, char *ref,
                               size_t cap);

typedef struct {
  const char *ckpt;        /* NULL: the newest valid checkpoint in run.out_dir/checkpoints */
  const char *shard;       /* loss and perplexity on this shard; NULL or "": none */
  const char *shard_label; /* how the report names it ("valid", "test", a path) */
  const char *src_text;    /* with ref_text: translate and score; both NULL: no BLEU */
  const char *ref_text;
  const nmt_spm *spm;      /* BLEU: the SentencePiece model (required with src_text) */
} nmt_eval_options;

/* The files nmt_eval_run writes for checkpoint `ckpt` and source text src_text (NULL: no
 * BLEU; hyp and report are then ""): run.out_dir/eval/eval.jsonl, run.out_dir/eval/<source
 * file name>.<checkpoint file name without .ckpt>.beam<decode.beam>.hyp (named after the
 * checkpoint file, so an averaged checkpoint does not overwrite the hypotheses of the step it
 * shares its step number with) and <that>.sacrebleu.txt. */
typedef struct {
  char jsonl[NMT_PATH_MAX + 32];
  char hyp[NMT_PATH_MAX + 1300];
  char report[NMT_PATH_MAX + 1320];
} nmt_eval_paths;
void nmt_eval_paths_of(const nmt_config *cfg, const char *ckpt, const char *src_text,
                       nmt_eval_paths *out);

/* `nmt eval`: loads the checkpoint once, prints the loss line
 *   loss L nll N ppl P tokens T pairs K dropped D
 * (per target token, nats) for opt->shard, then translates and scores opt->src_text against
 * opt->ref_text (BLEU and chrF2 lines, aligned, with their signatures), all to `out`. Writes the
 * hypotheses to run.out_dir/eval/<source file name>.<checkpoint file name without
 * .ckpt>.beam<B>.hyp, sacreBLEU's report next to them (.sacrebleu.txt), and appends one JSON
 * object per call to run.out_dir/eval/eval.jsonl. Before decoding, a source or reference
 * that is a pipe is copied into run.out_dir/eval/ (removed afterwards), and empty texts or
 * line counts that differ are refused. The hypotheses and report are written as NAME.partial
 * and renamed only once both are complete, so a failed or interrupted eval leaves the
 * previous ones as they were (a killed one may leave the .partial files).
 * Errors: those of nmt_eval_loss, nmt_translate and nmt_eval_sacrebleu, NMT_ERR_DATA (empty
 * texts, line counts), NMT_ERR_CHECKPOINT, NMT_ERR_IO. */
nmt_status nmt_eval_run(const nmt_config *cfg, const nmt_eval_options *opt, FILE *out);

#ifdef __cplusplus
}
#endif
#endif /* NMT_EVAL_H */
