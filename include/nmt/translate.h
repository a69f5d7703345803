/* nmt/translate.h — batched translation from a checkpoint: greedy or beam search.
 *
 * Input is one sentence per line, either raw text (encoded by piping through SentencePiece's
 * spm_encode with [data] spm_model) or space-separated ids (--ids). Sentences are sorted by
 * length into batches of up to [decode] batch_sentences, decoded incrementally
 * (include/nmt/model.h, nmt_decoder): greedy when [decode] beam = 1, else beam search with
 * [decode] length_penalty (max output length = source length + [decode] max_extra_len, §6.1 of
 * the paper), and written back in input order, as text (spm_decode) or ids. Logs the decoding
 * throughput (sentences/s) at info level. Runs on the device of include/nmt/device.h
 * ([parallel] device: the CUDA backend when selected, else the CPU reference).
 *
 * defines: nmt_translate_file, nmt_ckpt_expect_from_config
 */
#ifndef NMT_TRANSLATE_H
#define NMT_TRANSLATE_H

#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The checkpoint header fields a config's model implies (shape and n_params), for
 * nmt_ckpt_read's `expect`. */
void nmt_ckpt_expect_from_config(const nmt_config *cfg, nmt_ckpt_header *expect);

/* Translates in_path ("-" = stdin) to out_path ("-" = stdout) with the parameters of checkpoint
 * `ckpt` (NULL = the newest valid one in run.out_dir/checkpoints). ids != 0: id lines in and
 * out, no SentencePiece. Errors: NMT_ERR_CHECKPOINT (none, damaged, wrong shape), NMT_ERR_IO,
 * NMT_ERR_DATA (an id line that does not parse or an id >= vocab, naming the line),
 * NMT_ERR_CONFIG ([data] spm_model empty with raw text). */
nmt_status nmt_translate_file(const nmt_config *cfg, const char *ckpt, const char *in_path,
                              const char *out_path, int ids);

#ifdef __cplusplus
}
#endif
#endif /* NMT_TRANSLATE_H */
