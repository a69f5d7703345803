/* test_train_bible.c — training on the real corpus makes the loss fall.
 *
 * A small model (d_model 64, 1+1 layers) on data/bible/train.shard (vocab 8000, written by
 * tools/prepare-bible.sh, which `make test` runs first) with 2 CPU workers. The label-smoothed
 * loss starts near ln(8000) = 8.99 nats and must fall below 70% of its first value within
 * TRAIN_STEPS optimizer steps. */
#include <math.h>
#include <stdio.h>
#include <unistd.h>

#include "nmt/config.h"
#include "nmt/trainer.h"
#include "test.h"

enum { TRAIN_STEPS = 150 };

typedef struct {
  double first, last, first_valid, last_valid;
  long steps;
} curve;

static void record(void *user, const nmt_metrics *m) {
  curve *c = user;
  if (c->steps == 0) c->first = m->train_loss;
  c->last = m->train_loss;
  if (m->has_valid) {
    if (c->first_valid == 0) c->first_valid = m->valid_loss;
    c->last_valid = m->valid_loss;
  }
  c->steps = m->step;
}

NMT_TEST(train_bible_loss_falls) {
  if (access("data/bible/train.shard", R_OK) != 0) {
    nmt_test_fail(__FILE__, __LINE__, "data/bible/train.shard missing: run tools/prepare-bible.sh");
    return;
  }
  char out[600];
  snprintf(out, sizeof out, "run.out_dir=%s/run", nmt_test_tmpdir());
  const char *ov[] = {out, "model.d_model=64", "model.n_heads=2", "model.d_ff=128",
                      "model.enc_layers=1", "model.dec_layers=1", "data.max_tokens=1024",
                      "data.max_len=64", "train.max_steps=150", "train.log_every=1",
                      "train.valid_every=150", "train.save_every=0", "train.warmup_steps=100",
                      "train.lr_scale=3", "parallel.devices=2", "data.valid="};
  nmt_config cfg;
  NMT_ASSERT_OK(nmt_config_load("conf/bible-small.ini", ov, (int)(sizeof ov / sizeof ov[0]), &cfg));
  NMT_ASSERT_EQ_INT(cfg.train_max_steps, TRAIN_STEPS);
  curve c = {0};
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  o.on_metrics = record;
  o.user = &c;
  nmt_trainer *t;
  NMT_ASSERT_OK(nmt_trainer_create(&cfg, &o, &t));
  nmt_status s = nmt_trainer_run(t);
  nmt_trainer_destroy(t);
  NMT_ASSERT_OK(s);
  printf("# bible: train loss %.3f at step 1 -> %.3f at step %ld (ln V = %.3f)\n", c.first, c.last,
         c.steps, log(8000.0));
  NMT_ASSERT_EQ_INT(c.steps, TRAIN_STEPS);
  NMT_ASSERT(c.first > 0.8 * log(8000.0));
  NMT_ASSERT(c.last < 0.7 * c.first);
}
