/* nmt/translate.h — translation with a checkpoint: greedy or beam search, streamed.
 *
 * Input is one sentence per line, raw text (encoded in process with SentencePiece,
 * include/nmt/spm.h) or space-separated ids (ids = 1). Lines are read in windows: a window
 * closes when it holds [decode] batch_sentences lines (16 x that when the input is a regular
 * file), at the end of the input, or — on a pipe or a terminal — when no further line is
 * ready, so an interactive user gets each line back at once (fairseq-interactive, Marian's
 * interactive mode). A window is sorted by length into batches of up to batch_sentences,
 * decoded incrementally (include/nmt/model.h, nmt_decoder): greedy when [decode] beam = 1,
 * else beam search with [decode] length_penalty (max output length = source length + [decode]
 * max_extra_len, §6.1 of the paper); its translations are written in input order and flushed.
 * Sources longer than data.max_len - 1 ids are cut, with a warning naming their line numbers.
 * Logs the decoding throughput (sentences/s) at info level. Runs on the device of
 * include/nmt/device.h ([parallel] device: the CUDA backend when selected, else the CPU
 * reference).
 *
 * defines: nmt_translate_options, nmt_translate_options_default, nmt_translate,
 *          nmt_translate_file, nmt_translate_to_text, nmt_translate_text_free,
 *          nmt_ckpt_expect_from_config
 */
#ifndef NMT_TRANSLATE_H
#define NMT_TRANSLATE_H

#include <stdatomic.h>
#include <stddef.h>

#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/spm.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The checkpoint header fields a config's model implies (shape and n_params), for
 * nmt_ckpt_read's `expect`. */
void nmt_ckpt_expect_from_config(const nmt_config *cfg, nmt_ckpt_header *expect);

typedef struct {
  size_t size;        /* sizeof(nmt_translate_options), set by nmt_translate_options_default */
  const char *input;  /* path, "-" = stdin (default) */
  const char *output; /* path, "-" = stdout (default) */
  int ids;            /* 1: id lines in and out, no SentencePiece */
  const nmt_spm *spm; /* raw text: the model to encode and decode with (required unless ids) */
  int nbest;          /* 0: one line per input; K in [1, decode.beam]: K lines per input,
                       * "i ||| hypothesis ||| F0= log-probability ||| score", i the 0-based
                       * input line, score the length-normalised one they are ranked by */
  int scores;         /* 1 (without nbest): "hypothesis ||| F0= log-probability ||| score" */
  const atomic_int *stop; /* non-zero: stop (see nmt_translate); may be NULL; an atomic,
                           * since a signal handler on any thread may set it */
  long translated;    /* out: input lines whose translations were written */
  /* Ensemble decoding (nmt_translate): n_ensemble further checkpoints (NULL: none) decoded
   * together with ckpt, each with the model shape of its own embedded config, and NULL or
   * 1 + n_ensemble positive weights (ckpt's first; NULL: equal). */
  const char *const *ensemble;
  int n_ensemble;
  const float *weights;
} nmt_translate_options;

/* Defaults: stdin to stdout, raw text, one best hypothesis, no scores, no stop flag. */
void nmt_translate_options_default(nmt_translate_options *o);

/* Translates o->input to o->output with the parameters of checkpoint `ckpt` (the model of cfg:
 * its shape must match). The log-probability is log p(y | x) in nats, EOS included (scores
 * need the beam search's bookkeeping: with beam 1 it runs as a beam of 1, which decodes
 * exactly as greedy). When *o->stop becomes non-zero, reading stops, the batch being decoded
 * is finished, every translation of the input's first lines that is complete is written and
 * flushed, and NMT_STOPPED is returned; o->translated counts the lines written. A raw-text
 * line that is not valid UTF-8 is translated and warned about (file, line, first bad byte;
 * the first five named, all counted at the end), not refused: the output keeps one line per
 * input line.
 * With o->ensemble, every step ranks and scores by the weighted mean of the models'
 * log-probabilities (nmt_decoder_ensemble; docs/decoding.md "Ensembles"); the [decode] and
 * [data] settings are cfg's, and each further checkpoint must have cfg's model.vocab, a
 * model.max_positions at least cfg's, and the same SentencePiece model (its embedded bytes, or
 * where a checkpoint carries none its data.spm_model path).
 * Errors: NMT_ERR_CHECKPOINT (damaged, wrong shape; an ensemble member of another vocabulary,
 * SentencePiece model or fewer positions, or without an embedded config, naming both
 * checkpoints), NMT_ERR_IO (input or output), NMT_ERR_DATA (an id line that does not parse or
 * an id >= vocab, naming file and line), NMT_ERR_USAGE (nbest outside [0, decode.beam]; raw
 * text without o->spm; more than 16 models; a weight not positive), NMT_STOPPED. */
nmt_status nmt_translate(const nmt_config *cfg, const char *ckpt, nmt_translate_options *o);

/* nmt_translate from in_path to out_path with the best hypothesis only. ckpt NULL = the
 * newest valid checkpoint in run.out_dir/checkpoints. Raw text (ids = 0) uses data.spm_model,
 * or when that is empty the SentencePiece model the checkpoint carries.
 * Errors: those of nmt_translate and nmt_ckpt_setup_spm. */
nmt_status nmt_translate_file(const nmt_config *cfg, const char *ckpt, const char *in_path,
                              const char *out_path, int ids);

/* For validation BLEU during training: decodes every source of src_path with host_params
 * (nmt_model_num_params floats, the model of cfg; host memory) and returns the detokenized
 * best hypotheses in input order as malloc'd strings (*hyps_out[0..*n_out), free with
 * nmt_translate_text_free). src_is_shard = 1: src_path is a shard and its pairs' source sides
 * are decoded (pair i = line i of the split's raw text); 0: a raw text file, encoded with spm.
 * All sources are sorted by length into batches of decode.batch_sentences; [decode] settings
 * apply. Each call opens and closes its own device context (nmt_device_open, inference, with
 * no abort flag): device memory is allocated and freed, so never call it while collectives
 * may be in flight on that device (the trainer's validation BLEU keeps one decoder open for
 * the run instead, src/engine/valid.c). Errors: NMT_ERR_IO / NMT_ERR_DATA (source unreadable,
 * shard invalid or of another vocabulary), NMT_ERR_USAGE (spm NULL), NMT_ERR_NOMEM, device
 * errors. */
nmt_status nmt_translate_to_text(const nmt_config *cfg, const float *host_params,
                                 const nmt_spm *spm, const char *src_path, int src_is_shard,
                                 char ***hyps_out, long *n_out);
void nmt_translate_text_free(char **hyps, long n);

#ifdef __cplusplus
}
#endif
#endif /* NMT_TRANSLATE_H */
