/* resume.c — run.resume: where a run continues from (nmt__resume, run.h).
 *
 * The newest valid checkpoint of run.out_dir/checkpoints gives the host's initial state:
 * parameters and Adam moments, the step, the data position (mapped into this run's data
 * order: nmt_ckpt_data_resume), the fp16 loss scaler and the best validation so far. No
 * checkpoint file is the normal first start; checkpoint files of which none is valid are an
 * error (starting over would silently throw the run away, and soon overwrite its files); a
 * checkpoint of parameters only (an average or an export) is refused, since AdamW would
 * restart from zero moments.
 */
#include <math.h>
#include <stdio.h>

#include "nmt/log.h"
#include "run.h"

nmt_status nmt__resume(nmt_trainer *t) {
  char path[1024];
  nmt_ckpt_header expect = {0}, h;
  const nmt_model_cfg *c = &t->mcfg;
  expect.vocab = c->vocab, expect.d_model = c->d_model, expect.n_heads = c->n_heads;
  expect.d_ff = c->d_ff, expect.enc_layers = c->enc_layers, expect.dec_layers = c->dec_layers;
  expect.norm = (int32_t)c->norm, expect.n_params = t->n_params;
  nmt__remove_stale_temps(t->dir.ckpt_dir);
  /* No checkpoint file at all: say so as info, without asking find_latest (whose "no valid
   * checkpoint" is an error). */
  int any = nmt__has_checkpoints(t->dir.ckpt_dir);
  nmt_status s = any ? nmt_ckpt_find_latest(t->dir.ckpt_dir, path) : NMT_ERR_CHECKPOINT;
  if (s == NMT_OK) {
    NMT_TRY(nmt_ckpt_read(path, &expect, &h, t->init_params, t->init_m, t->init_v));
    /* Parameters only (nmt average's output): AdamW would restart from zero moments, which is
     * not the run continued. */
    if (!h.has_moments)
      return nmt_errorf(NMT_ERR_CHECKPOINT, "run.resume: %s holds parameters only, no Adam "
                        "moments (an average or export, not a training checkpoint); resuming "
                        "from it would restart AdamW from zero moments. Move it out of %s to "
                        "resume from the training checkpoint before it", path, t->dir.ckpt_dir);
    /* The position means a batch only of the data order it was taken in (its `data` record;
     * none in older files): nmt_ckpt_data_resume decides where this run's order continues. */
    nmt_ckpt_header hm;
    nmt_ckpt_meta meta;
    NMT_TRY(nmt_ckpt_read_meta(path, &hm, &meta));
    nmt_ckpt_data_resume(path, &h, &meta.data, &t->ckpt_meta.data, &t->pos.start_epoch,
                         &t->pos.start_index);
    nmt__bucket_auto_resumed(t, meta.config);
    nmt_ckpt_meta_free(&meta);
    t->pos.start_step = h.step;
    t->pos.scaler0.skipped = h.skipped_steps;
    if (t->pos.scaler0.enabled && isfinite(h.loss_scale) && h.loss_scale > 0) {
      t->pos.scaler0.scale = h.loss_scale;
      t->pos.scaler0.good = h.scale_good_steps;
    }
    snprintf(t->dir.last_ckpt, sizeof t->dir.last_ckpt, "%s", path);
    nmt_log(NMT_LOG_INFO, "resuming from %s (step %ld)", path, (long)h.step);
    nmt__best_resume(&t->cfg, &h, &t->pos.best0);
    return NMT_OK;
  }
  if (any)
    return nmt_errorf(NMT_ERR_CHECKPOINT,
                      "run.resume: %s holds checkpoint files but none is valid (the warnings "
                      "above name each problem); move them away to start from step 0",
                      t->dir.ckpt_dir);
  nmt_clear_error();
  nmt_log(NMT_LOG_INFO, "no checkpoint in %s: starting from step 0", t->dir.ckpt_dir);
  return NMT_OK;
}
