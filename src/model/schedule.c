/* schedule.c — the learning-rate schedule of the Transformer (include/nmt/model.h,
 * nmt_lr_at): Vaswani et al. 2017 §5.3, eq. 3. It belongs to the model, not to the trainer:
 * its scale is the model's width (d_model^-0.5), and the trainer, `nmt bench scaling` and
 * bench/op_profile.c all step AdamW with it. */
#include <math.h>

#include "nmt/model.h"

double nmt_lr_at(const nmt_config *cfg, long step) {
  double s = step < 1 ? 1.0 : (double)step;
  double w = cfg->train_warmup_steps < 1 ? 1.0 : (double)cfg->train_warmup_steps;
  double a = 1.0 / sqrt(s), b = s * pow(w, -1.5);
  return cfg->train_lr_scale / sqrt((double)cfg->model_d_model) * (a < b ? a : b);
}
