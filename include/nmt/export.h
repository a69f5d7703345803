/* nmt/export.h — checkpoint averaging and export of the parameters to safetensors.
 *
 * Averaging (Vaswani et al. 2017 §6.1: the base models average the last 5 checkpoints, written
 * at 10-minute intervals) takes the element-wise mean of the parameters of K checkpoints of the
 * same model. The result has no Adam moments (has_moments = 0): averaged moments describe no
 * optimizer state that ever existed, so an averaged checkpoint is for translate, eval and
 * export; training resumes from a regular one.
 *
 * safetensors (https://github.com/huggingface/safetensors): u64 little-endian header length N,
 * N bytes of JSON (padded with spaces to a multiple of 8) naming each tensor's dtype "F32",
 * shape and data_offsets, and "__metadata__" with the model config; then the tensors' bytes.
 * Tensor names, shapes and order are nmt_model_param_table's, so the data section is the flat
 * parameter buffer itself. docs/formats.md "safetensors export" documents the layouts;
 * tools/load_pytorch.py loads the file into a PyTorch module.
 *
 * defines: nmt_ckpt_average, nmt_ckpt_last_k, nmt_export_safetensors
 */
#ifndef NMT_EXPORT_H
#define NMT_EXPORT_H

#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Writes to out_path (atomically, nmt_ckpt_write) a checkpoint whose parameters are the mean of
 * those of paths[0..n), computed in double and rounded once to fp32 (so averaging copies of one
 * checkpoint returns it bit for bit). Header: model shape of the inputs; step, data position,
 * seed and loss scale of the input with the highest step; has_moments = 0; the metadata
 * (config, SentencePiece model) of that input too, so the result is as self-describing as it.
 * Every input must have the same model shape and n_params and pass its CRC check.
 * Errors: NMT_ERR_USAGE (n < 1), NMT_ERR_CHECKPOINT (damaged input, shape mismatch naming both
 * files), NMT_ERR_IO, NMT_ERR_NOMEM. */
nmt_status nmt_ckpt_average(const char *const *paths, int n, const char *out_path);

/* The k highest-step valid step_N.ckpt files of dir, highest first, as malloc'd strings in
 * *paths_out (free each and the array); *n_out <= k. Damaged files are skipped with a warning.
 * Errors: NMT_ERR_IO (cannot list dir), NMT_ERR_CHECKPOINT (no valid checkpoint). */
nmt_status nmt_ckpt_last_k(const char *dir, int k, char ***paths_out, int *n_out);

/* Writes the parameters of checkpoint ckpt_path as safetensors to out_path (atomically: temp
 * file, fsync, rename). cfg (may be NULL) supplies the metadata the header does not hold
 * (max_positions, ln_eps, label smoothing, dropout) and must match its model shape; NULL uses
 * the checkpoint's embedded config (format version 2), else (version 1) the schema defaults for
 * those, with a warning. Errors: NMT_ERR_CHECKPOINT, NMT_ERR_IO, NMT_ERR_NOMEM, those of
 * nmt_ckpt_setup_load. */
nmt_status nmt_export_safetensors(const char *ckpt_path, const nmt_config *cfg,
                                  const char *out_path);

#ifdef __cplusplus
}
#endif
#endif /* NMT_EXPORT_H */
