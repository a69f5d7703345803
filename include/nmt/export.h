/* nmt/export.h — checkpoint averaging and export of the parameters to safetensors or to a
 * CTranslate2 model directory.
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
 * CTranslate2 (https://github.com/OpenNMT/CTranslate2): the safetensors export given to
 * tools/nmt_to_ct2.py, which builds the model with CTranslate2's own converter API (a
 * ctranslate2.converters.Converter filling a TransformerSpec) in a Python process; docs/formats.md
 * "CTranslate2 export" documents the directory and the mapping.
 *
 * defines: nmt_ckpt_average, nmt_ckpt_last_k, nmt_export_safetensors, nmt_export_ct2
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

/* Writes checkpoint ckpt_path as a CTranslate2 model directory out_dir, which
 * ctranslate2.Translator(out_dir) loads: model.bin, config.json, shared_vocabulary.json, and
 * spm.model (the SentencePiece model embedded in the checkpoint) beside them. cfg: as for
 * nmt_export_safetensors (NULL: the checkpoint's own config). quantization: NULL or "" (fp32, as
 * trained) or one of CTranslate2's weight types int8, int8_float32, int8_float16,
 * int8_bfloat16, int16, float16, bfloat16, float32. overwrite: replace an existing out_dir, if
 * it is a directory holding a model.bin (a previous export) or nothing; 0: an existing out_dir
 * is refused.
 * Runs `$NMT_PYTHON $NMT_CT2_CONVERTER [--quantization Q] model.safetensors spm.model DIR` (no
 * shell): NMT_PYTHON defaults to python3 (found on PATH); NMT_CT2_CONVERTER to
 * tools/nmt_to_ct2.py of the source tree the running binary was built in (BIN/../tools/, as
 * build/nmt is), else of the working directory. Everything is written into a temporary
 * directory beside out_dir (OUT_DIR.tmp-XXXXXX, removed on every path) and renamed into place
 * at the end (an existing out_dir is exchanged with it atomically, renameat2), so out_dir is
 * the old model or the new one, never a part.
 * Errors: NMT_ERR_USAGE (unknown quantization), NMT_ERR_CONFIG (out_dir exists and overwrite is
 * 0, or it is not a directory a previous export wrote), NMT_ERR_MISSING_DEP (python, the
 * converter script or a Python module it imports missing: the message names what to install,
 * tools/install-deps.sh --bleu or pip install ctranslate2), NMT_ERR_CHECKPOINT (damaged input,
 * no SentencePiece model embedded, model shape unlike cfg's), NMT_ERR_IO (the temporary
 * directory, the files, the rename; the converter failing otherwise, with its last line),
 * NMT_ERR_NOMEM. */
nmt_status nmt_export_ct2(const char *ckpt_path, const nmt_config *cfg, const char *quantization,
                          int overwrite, const char *out_dir);

#ifdef __cplusplus
}
#endif
#endif /* NMT_EXPORT_H */
