/* preflight.h — what a training run will need after its first step, checked at create before
 * any step (src/engine/, not public): a run that cannot finish its first validation or write
 * its first checkpoint is refused while it has nothing to lose, instead of failing there and
 * losing the steps since its last checkpoint.
 *
 * Checked: validation BLEU's temporary directory (valid.c calls it with train.valid_bleu = on,
 * next to its sacreBLEU probe), and the free space of the checkpoint directory's file system
 * for one checkpoint (trainer.c). README.md "Validation BLEU" and "Run directory" list them.
 *
 * defines: nmt__preflight_tmp, nmt__preflight_space, nmt__preflight_checkpoint
 */
#ifndef NMT_ENGINE_PREFLIGHT_H
#define NMT_ENGINE_PREFLIGHT_H

#include <stdint.h>

#include "nmt/checkpoint.h"
#include "nmt/status.h"

/* The temporary directory nmt_eval_score_hyps writes each validation's hypotheses to ($TMPDIR,
 * or /tmp when unset: nmt_eval_tmp_dir) exists, is a directory, and takes a file: a probe
 * file is created there (mkstemp) and removed. `who` names what needs it in the message
 * ("[train] valid_bleu = on"). Errors: NMT_ERR_IO naming TMPDIR and the directory, the reason
 * (errno text) and what to do. */
nmt_status nmt__preflight_tmp(const char *who);

/* The file system holding dir (dir itself, or its nearest existing parent when dir is not made
 * yet) has at least `bytes` available (statvfs f_bavail, as df shows it). `what` names the
 * bytes in the message ("one checkpoint ..."). Errors: NMT_ERR_IO naming dir, the free and
 * needed sizes and run.out_dir (also when statvfs fails). */
nmt_status nmt__preflight_space(const char *dir, uint64_t bytes, const char *what);

/* nmt__preflight_space for one checkpoint of the run into ckpt_dir: nmt_ckpt_file_bytes of the
 * run's header base (parameters, Adam's m and v, the metadata), counted with a best record
 * (a validation adds one). A checkpoint is written beside the older ones before
 * checkpoint.keep deletes any, so this is what the next one needs. Errors: those of
 * nmt__preflight_space. */
nmt_status nmt__preflight_checkpoint(const char *ckpt_dir, const nmt_ckpt_header *base);

#endif /* NMT_ENGINE_PREFLIGHT_H */
