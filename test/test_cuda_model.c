/* test/test_cuda_model.c — the whole Transformer on the CUDA backend: against the PyTorch
 * golden fixtures (test/fixtures, tools/make-fixture.py), eval logits and greedy decoding
 * against the CPU reference, 20 training steps against the CPU engine, two GPU runs bitwise
 * equal, and translation (greedy, beam 4) against the CPU with a model trained until it emits
 * tokens (cuda_translate_fixture_emits_tokens checks that fixture on the CPU, without a GPU).
 *
 * Tolerances. fp32 ops match the reference to ~1e-6 of each tensor's largest values (different
 * summation orders in cuBLASLt and in the block reductions); the golden test allows loss sums
 * rel 1e-4 and gradients |a-b| <= 1e-4 max|b| + 1e-4 |b| per tensor, still 10x below what a
 * structural error (a wrong mask, site, scale or residual) produces (>= 1e-3 of max|b|, see
 * test/test_model.c). TF32 GEMMs round inputs to 10 mantissa bits: loss rel 2e-3. fp16/bf16
 * GEMM inputs: mean loss within 0.05 nats, gradient relative norm 1e-2 / 3e-2, the bounds the
 * CPU emulation meets (test/test_precision.c). Training:
 * the per-step loss of 20 GPU steps within 1e-3 (absolute, nats) of the CPU's; two GPU runs
 * bitwise equal (every reduction has a fixed order and cuBLASLt's algorithm is fixed per
 * shape within a run).
 *
 * Every test prints "# SKIP no CUDA device" without a device. With -DNMT_CUDA_TESTS_ON_REF
 * (see test/gpu_helpers.h) the reference plays the device for the fixture tests. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixture.h"
#include "gpu_helpers.h"
#include "helpers.h"
#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/device.h"
#include "nmt/model.h"
#include "nmt/trainer.h"
#include "nmt/translate.h"
#include "test.h"

/* ------------------------------------------------------------------------------------------ */
/* the device backend (nmt_tg_device_backend: cuda, or the reference playing it), or none */

static int have_device(void) {
  const nmt_backend *be = nmt_tg_device_backend();
  int n = 0;
  return be && be->device_count(&n) == NMT_OK && n > 0;
}

/* ------------------------------------------------------------------------------------------ */
/* one model on one backend */

typedef struct {
  const nmt_backend *be;
  void *ctx;
  nmt_model *m;
  float *params, *grads;
  int32_t *batch_mem;
  nmt_batch b;
  size_t n_params;
} rig;

static void rig_free(rig *r) {
  if (r->m) nmt_model_destroy(r->m);
  if (r->be) {
    if (r->params) r->be->free(r->ctx, r->params);
    if (r->grads) r->be->free(r->ctx, r->grads);
    if (r->batch_mem) r->be->free(r->ctx, r->batch_mem);
    if (r->ctx && r->be->ctx_destroy) r->be->ctx_destroy(r->ctx);
  }
  memset(r, 0, sizeof *r);
}

/* Model, parameters and the fixture's batch on `be` (a context on device 0 if it has them). */
static nmt_status rig_create(rig *r, const nmt_backend *be, nmt_precision prec,
                             const nmt_fixture *f) {
  memset(r, 0, sizeof *r);
  r->be = be;
  r->n_params = f->n_params;
  if (be->ctx_create) {
    NMT_TRY(be->ctx_create(0, &r->ctx));
    NMT_TRY(be->set_precision(r->ctx, prec));
  }
  const int max_len = f->src_len > f->tgt_len ? f->src_len : f->tgt_len;
  NMT_TRY(nmt_model_create(&f->cfg, be, r->ctx, f->n_sent * max_len, max_len, &r->m));
  NMT_TRY(be->malloc(r->ctx, f->n_params * 4, (void **)&r->params));
  NMT_TRY(be->malloc(r->ctx, (f->n_params + NMT_GRAD_EXTRA) * 4, (void **)&r->grads));
  NMT_TRY(be->copy_h2d(r->ctx, r->params, f->params, f->n_params * 4));
  const size_t ns = (size_t)f->n_sent, s = ns * f->src_len, t = ns * f->tgt_len;
  NMT_TRY(be->malloc(r->ctx, (s + 2 * t + 2 * ns) * 4, (void **)&r->batch_mem));
  nmt_batch *b = &r->b;
  b->n_sent = f->n_sent, b->src_len = f->src_len, b->tgt_len = f->tgt_len;
  b->src = r->batch_mem;
  b->tgt_in = b->src + s;
  b->tgt_out = b->tgt_in + t;
  b->src_lens = b->tgt_out + t;
  b->tgt_lens = b->src_lens + ns;
  NMT_TRY(be->copy_h2d(r->ctx, b->src, f->src, s * 4));
  NMT_TRY(be->copy_h2d(r->ctx, b->tgt_in, f->tgt_in, t * 4));
  NMT_TRY(be->copy_h2d(r->ctx, b->tgt_out, f->tgt_out, t * 4));
  NMT_TRY(be->copy_h2d(r->ctx, b->src_lens, f->src_lens, ns * 4));
  NMT_TRY(be->copy_h2d(r->ctx, b->tgt_lens, f->tgt_lens, ns * 4));
  for (size_t i = 0; i < ns; i++) {
    for (int j = 0; j < f->src_len; j++) b->src_tokens += f->src[i * f->src_len + j] != NMT_PAD_ID;
    for (int j = 0; j < f->tgt_len; j++) b->tgt_tokens += f->tgt_out[i * f->tgt_len + j] != NMT_PAD_ID;
  }
  return NMT_OK;
}

/* Forward (train) + backward of the fixture's step; host copy of grads + the 4 extra slots. */
static nmt_status rig_step(rig *r, const nmt_fixture *f, float *host_grads) {
  const size_t total = r->n_params + NMT_GRAD_EXTRA;
  NMT_TRY(r->be->memset_zero(r->ctx, r->grads, total * 4));
  NMT_TRY(nmt_model_forward(r->m, r->params, &r->b, 1, f->seed, f->step, r->grads + r->n_params));
  NMT_TRY(nmt_model_backward(r->m, r->params, r->grads, &r->b, NULL, NULL));
  return r->be->copy_d2h(r->ctx, host_grads, r->grads, total * 4);
}

/* ------------------------------------------------------------------------------------------ */
/* golden fixtures on the device */

/* ||got / tokens - fixture|| / ||fixture|| over all parameters (NaN if got is not finite). */
static double grad_rel_norm(const nmt_fixture *f, const float *got) {
  const double tokens = got[f->n_params + NMT_GRAD_SLOT_TOKENS];
  double num = 0, den = 0;
  for (size_t i = 0; i < f->n_params; i++) {
    const double d = got[i] / tokens - f->grads[i];
    num += d * d;
    den += (double)f->grads[i] * f->grads[i];
  }
  return sqrt(num / den);
}

/* fp16/bf16 GEMMs (issue 3): the mean loss within 0.05 nats of the fixture's and the gradient
 * within the relative norm test/test_precision.c holds the CPU emulation to (1e-2 fp16, 3e-2
 * bf16); the CPU emulation's figures in the same mode are printed next to the device's. */
static void golden_half(const char *name, nmt_precision prec) {
  const char *mode = prec == NMT_PRECISION_FP16 ? "fp16" : "bf16";
  nmt_fixture f;
  rig r = {0}, cpu = {0};
  float *got = NULL, *emu = NULL;
  if (nmt_fixture_load(name, &f)) goto out;
  got = malloc((f.n_params + NMT_GRAD_EXTRA) * 4);
  emu = malloc((f.n_params + NMT_GRAD_EXTRA) * 4);
  nmt_status st = got && emu ? NMT_OK : NMT_ERR_NOMEM;
  if (st == NMT_OK) st = rig_create(&r, nmt_tg_device_backend(), prec, &f);
  if (st == NMT_OK) st = rig_step(&r, &f, got);
  if (st == NMT_OK) st = rig_create(&cpu, &nmt_backend_ref, prec, &f);
  if (st == NMT_OK) st = rig_step(&cpu, &f, emu);
  if (st != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "%s %s: setup/step failed: %s %s", name, mode,
                  nmt_status_str(st), nmt_last_error());
    goto out;
  }
  const float *x = got + f.n_params, *xe = emu + f.n_params;
  if (x[NMT_GRAD_SLOT_TOKENS] != f.tokens) {
    nmt_test_fail(__FILE__, __LINE__, "%s %s: tokens %g, fixture %g", name, mode,
                  (double)x[NMT_GRAD_SLOT_TOKENS], f.tokens);
    goto out;
  }
  const double loss = x[NMT_GRAD_SLOT_LOSS] / f.tokens, loss_emu = xe[NMT_GRAD_SLOT_LOSS] / f.tokens;
  const double gerr = grad_rel_norm(&f, got), gerr_emu = grad_rel_norm(&f, emu);
  const double gtol = prec == NMT_PRECISION_FP16 ? 1e-2 : 3e-2;
  printf("# %s on the device (%s): mean loss %.6f (fixture %.6f, CPU emulation %.6f); gradient "
         "rel norm err %.2e (CPU emulation %.2e)\n",
         name, mode, loss, f.loss_mean, loss_emu, gerr, gerr_emu);
  if (!(fabs(loss - f.loss_mean) <= 0.05))
    nmt_test_fail(__FILE__, __LINE__, "%s %s: mean loss %.6f vs fixture %.6f (tolerance 0.05)",
                  name, mode, loss, f.loss_mean);
  else if (!(gerr <= gtol))
    nmt_test_fail(__FILE__, __LINE__, "%s %s: gradient relative norm error %.3g > %g", name, mode,
                  gerr, gtol);
out:
  free(got);
  free(emu);
  rig_free(&r);
  rig_free(&cpu);
  nmt_fixture_free(&f);
}

static void golden(const char *name, nmt_precision prec) {
  if (!have_device()) {
    nmt_test_skip("no CUDA device");
    return;
  }
  if (prec == NMT_PRECISION_FP16 || prec == NMT_PRECISION_BF16) {
    golden_half(name, prec);
    return;
  }
  nmt_fixture f;
  rig r = {0};
  float *got = NULL;
  if (nmt_fixture_load(name, &f)) goto out;
  got = malloc((f.n_params + NMT_GRAD_EXTRA) * 4);
  nmt_status st = got ? NMT_OK : NMT_ERR_NOMEM;
  if (st == NMT_OK) st = rig_create(&r, nmt_tg_device_backend(), prec, &f);
  if (st == NMT_OK) st = rig_step(&r, &f, got);
  if (st != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "%s: setup/step failed: %s %s", name, nmt_status_str(st),
                  nmt_last_error());
    goto out;
  }
  nmt_fixture_report rep;
  if (!nmt_fixture_check_loss(name, &f, got, prec == NMT_PRECISION_TF32 ? 2e-3 : 1e-4, &rep))
    goto out;
  /* TF32 rounds the GEMM inputs: its gradients are not held to the fp32 bound. */
  if (prec == NMT_PRECISION_FP32 && !nmt_fixture_check_grads(name, &f, got, 1e-4, 1e-4, &rep))
    goto out;
  printf("# %s on the device (%s): loss sum rel err %.2e, nll rel err %.2e, worst grad "
         "max|err|/max|g| %.2e (%s)\n",
         name, prec == NMT_PRECISION_TF32 ? "tf32" : "fp32", rep.loss_rel, rep.nll_rel,
         rep.worst_rel_to_max, rep.worst);
out:
  free(got);
  rig_free(&r);
  nmt_fixture_free(&f);
}

NMT_TEST(cuda_model_golden_post) { golden("model_post.bin", NMT_PRECISION_FP32); }
NMT_TEST(cuda_model_golden_pre) { golden("model_pre.bin", NMT_PRECISION_FP32); }
/* Dropout on every site: the device regenerates nmt's Philox masks bit for bit. */
NMT_TEST(cuda_model_golden_post_dropout) { golden("model_post_dropout.bin", NMT_PRECISION_FP32); }
NMT_TEST(cuda_model_golden_pre_dropout) { golden("model_pre_dropout.bin", NMT_PRECISION_FP32); }
NMT_TEST(cuda_model_golden_tf32_loss) { golden("model_post_dropout.bin", NMT_PRECISION_TF32); }
NMT_TEST(cuda_model_golden_fp16) { golden("model_post_dropout.bin", NMT_PRECISION_FP16); }
NMT_TEST(cuda_model_golden_bf16) { golden("model_pre_dropout.bin", NMT_PRECISION_BF16); }

/* Eval-mode logits and greedy decoding on the device equal the CPU reference's. */
NMT_TEST(cuda_model_logits_and_greedy_match_cpu) {
  if (!have_device()) NMT_SKIP("no CUDA device");
  nmt_fixture f;
  rig d = {0}, c = {0};
  float *hl[2] = {0};
  int32_t *ids[2] = {0}, *lens[2] = {0};
  if (nmt_fixture_load("model_pre.bin", &f)) goto out;
  nmt_status st = rig_create(&d, nmt_tg_device_backend(), NMT_PRECISION_FP32, &f);
  if (st == NMT_OK) st = rig_create(&c, &nmt_backend_ref, NMT_PRECISION_FP32, &f);
  const size_t nl = (size_t)f.n_sent * f.tgt_len * f.cfg.vocab;
  const int max_out = f.tgt_len;
  rig *rigs[2] = {&d, &c};
  for (int k = 0; k < 2 && st == NMT_OK; k++) {
    const float *logits;
    hl[k] = malloc(nl * 4);
    ids[k] = malloc((size_t)f.n_sent * max_out * 4);
    lens[k] = malloc((size_t)f.n_sent * 4);
    if (!hl[k] || !ids[k] || !lens[k]) st = NMT_ERR_NOMEM;
    if (st == NMT_OK) st = nmt_model_logits(rigs[k]->m, rigs[k]->params, &rigs[k]->b, &logits);
    if (st == NMT_OK) st = rigs[k]->be->copy_d2h(rigs[k]->ctx, hl[k], logits, nl * 4);
    if (st == NMT_OK)
      st = nmt_model_greedy(rigs[k]->m, rigs[k]->params, &rigs[k]->b, max_out, 4, ids[k], lens[k]);
  }
  if (st != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "setup failed: %s %s", nmt_status_str(st), nmt_last_error());
    goto out;
  }
  {
    double mx = 0;
    for (size_t i = 0; i < nl; i++) mx = fmax(mx, fabs(hl[1][i]));
    if (!nmt_test_close(__FILE__, __LINE__, "eval logits", hl[0], hl[1], nl, 1e-4 * mx, 1e-4))
      goto out;
  }
  for (int i = 0; i < f.n_sent; i++) {
    if (lens[0][i] != lens[1][i] ||
        memcmp(ids[0] + (size_t)i * max_out, ids[1] + (size_t)i * max_out, (size_t)max_out * 4)) {
      nmt_test_fail(__FILE__, __LINE__, "greedy output of sentence %d differs (lengths %d, %d)", i,
                    lens[0][i], lens[1][i]);
      goto out;
    }
  }
out:
  for (int k = 0; k < 2; k++) free(hl[k]), free(ids[k]), free(lens[k]);
  rig_free(&d);
  rig_free(&c);
  nmt_fixture_free(&f);
}

/* ------------------------------------------------------------------------------------------ */
/* training through the engine */

enum { TRAIN_STEPS = 20 };

typedef struct {
  double loss[TRAIN_STEPS + 1];
  int seen;
} curve;

static void on_metrics(void *user, const nmt_metrics *m) {
  curve *c = user;
  if (m->step >= 1 && m->step <= TRAIN_STEPS) {
    c->loss[m->step] = m->train_loss;
    c->seen++;
  }
}

/* A tiny model with dropout everywhere on the synthetic corpus, one step per log line. */
static void train_config(nmt_config *c, const char *dir, const char *shard, const char *name,
                         nmt_device_kind dev, nmt_precision prec) {
  char out[sizeof c->run_out_dir];
  if (snprintf(out, sizeof out, "%s/%s", dir, name) >= (int)sizeof out) out[0] = 0; /* too long */
  nmt_th_tiny_config(c, out, shard);
  c->data_max_tokens = 128;
  c->model_d_model = 32;
  c->model_n_heads = 4;
  c->model_d_ff = 64;
  c->model_dropout = c->model_attn_dropout = c->model_relu_dropout = 0.1f;
  c->train_max_steps = TRAIN_STEPS;
  c->train_lr_scale = 2.0f;
  /* Some true gradients are exactly 0 (a key bias shifts a whole softmax row); their computed
   * values are summation-order noise that Adam with eps 1e-9 would turn into full steps. */
  c->train_adam_eps = 1e-6f;
  c->parallel_device = dev;
  c->parallel_devices = 1;
  c->precision_mode = prec;
  c->run_seed = 11;
}

static nmt_status train_curve(const nmt_config *cfg, curve *out, float **params, size_t *np) {
  memset(out, 0, sizeof *out);
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  o.on_metrics = on_metrics;
  o.user = out;
  nmt_trainer *t = NULL;
  NMT_TRY(nmt_trainer_create(cfg, &o, &t));
  nmt_status s = nmt_trainer_run(t);
  if (s == NMT_OK && params) {
    const float *p = nmt_trainer_params(t, np);
    *params = malloc(*np * 4);
    if (*params) memcpy(*params, p, *np * 4);
    else s = nmt_errorf(NMT_ERR_NOMEM, "params copy");
  }
  nmt_trainer_destroy(t);
  return s;
}

static int real_cuda_device(void) {
  const nmt_backend *be = nmt_backend_cuda_get();
  int n = 0;
  return be && be->device_count(&n) == NMT_OK && n > 0;
}

/* Trains the same 20 steps (synthetic data, seed 5) as (da, pa) and as (db, pb); *worst is the
 * largest |loss difference| over the steps (NaN if any step's is), at *worst_step. */
static nmt_status two_curves(nmt_device_kind da, nmt_precision pa, nmt_device_kind db,
                             nmt_precision pb, curve *a, curve *b, double *worst,
                             int *worst_step) {
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_TRY(nmt_th_write_synthetic(shard, 256, 5));
  nmt_config ca, cb;
  train_config(&ca, dir, shard, "a", da, pa);
  train_config(&cb, dir, shard, "b", db, pb);
  NMT_TRY(train_curve(&ca, a, NULL, NULL));
  NMT_TRY(train_curve(&cb, b, NULL, NULL));
  *worst = -1, *worst_step = 0;
  for (int s = 1; s <= TRAIN_STEPS; s++) {
    double d = fabs(a->loss[s] - b->loss[s]);
    if (!(d <= *worst)) *worst = d, *worst_step = s; /* NaN sticks */
    if (isnan(*worst)) break;
  }
  return NMT_OK;
}

NMT_TEST(cuda_train_20_steps_matches_cpu) {
  if (!real_cuda_device()) NMT_SKIP("no CUDA device");
  curve g, c;
  double worst;
  int worst_step;
  NMT_ASSERT_OK(two_curves(NMT_DEVICE_CUDA, NMT_PRECISION_FP32, NMT_DEVICE_CPU,
                           NMT_PRECISION_FP32, &g, &c, &worst, &worst_step));
  NMT_ASSERT_EQ_INT(g.seen, TRAIN_STEPS);
  NMT_ASSERT_EQ_INT(c.seen, TRAIN_STEPS);
  printf("# 20 steps: loss %.4f -> %.4f (cpu %.4f -> %.4f), max |gpu - cpu| %.2e at step %d\n",
         g.loss[1], g.loss[TRAIN_STEPS], c.loss[1], c.loss[TRAIN_STEPS], worst, worst_step);
  NMT_ASSERT(worst <= 1e-3);
  /* The curve must really move, or the comparison says nothing. */
  NMT_ASSERT(c.loss[TRAIN_STEPS] < c.loss[1] - 0.1);
}

NMT_TEST(cuda_train_runs_are_bitwise_equal) {
  if (!real_cuda_device()) NMT_SKIP("no CUDA device");
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 256, 6));
  float *p[2] = {0};
  size_t np[2] = {0};
  curve cv[2];
  for (int k = 0; k < 2; k++) {
    nmt_config c;
    train_config(&c, dir, shard, k ? "b" : "a", NMT_DEVICE_CUDA, NMT_PRECISION_FP32);
    nmt_status s = train_curve(&c, &cv[k], &p[k], &np[k]);
    if (s != NMT_OK) {
      free(p[0]), free(p[1]);
      NMT_ASSERT_OK(s);
    }
  }
  int same = np[0] == np[1] && p[0] && p[1] && !memcmp(p[0], p[1], np[0] * 4) &&
             !memcmp(cv[0].loss, cv[1].loss, sizeof cv[0].loss);
  size_t diff = 0;
  for (size_t i = 0; p[0] && p[1] && np[0] == np[1] && i < np[0]; i++)
    diff += memcmp(&p[0][i], &p[1][i], 4) != 0;
  free(p[0]), free(p[1]);
  if (!same)
    nmt_test_fail(__FILE__, __LINE__, "two GPU runs differ: %zu of %zu parameters", diff, np[0]);
}

/* TF32 trains too: same loss curve up to the TF32 rounding. */
NMT_TEST(cuda_train_tf32_tracks_fp32) {
  if (!real_cuda_device()) NMT_SKIP("no CUDA device");
  curve t, f;
  double worst;
  int worst_step;
  NMT_ASSERT_OK(two_curves(NMT_DEVICE_CUDA, NMT_PRECISION_TF32, NMT_DEVICE_CUDA,
                           NMT_PRECISION_FP32, &t, &f, &worst, &worst_step));
  printf("# tf32 vs fp32 over 20 steps: max |loss difference| %.2e\n", worst);
  NMT_ASSERT(worst <= 2e-2);
}

/* Issue 8 on a GPU: train 2N steps straight vs N, stop, resume to 2N: bitwise-equal
 * parameters and loss curve (dropout on, so the device RNG streams, the data position and, in
 * fp16, the loss scaler must be restored exactly). */
static void resume_exact(nmt_precision prec) {
  if (!real_cuda_device()) NMT_SKIP("no CUDA device");
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 256, 8));
  nmt_config c;
  train_config(&c, dir, shard, "straight", NMT_DEVICE_CUDA, prec);
  c.precision_growth_interval = 3; /* fp16: the scale changes on both sides of the stop */
  curve a, b1, b2;
  float *pa = NULL, *pb = NULL;
  size_t na = 0, nb = 0;
  NMT_ASSERT_OK(train_curve(&c, &a, &pa, &na));
  train_config(&c, dir, shard, "resumed", NMT_DEVICE_CUDA, prec);
  c.precision_growth_interval = 3;
  c.train_max_steps = TRAIN_STEPS / 2;
  NMT_ASSERT_OK(train_curve(&c, &b1, NULL, NULL));
  c.train_max_steps = TRAIN_STEPS;
  c.run_resume = 1;
  NMT_ASSERT_OK(train_curve(&c, &b2, &pb, &nb));
  int same = na == nb && pa && pb && !memcmp(pa, pb, na * 4);
  for (int s = TRAIN_STEPS / 2 + 1; s <= TRAIN_STEPS; s++)
    same = same && !memcmp(&a.loss[s], &b2.loss[s], sizeof a.loss[s]);
  free(pa), free(pb);
  NMT_ASSERT(same);
}

NMT_TEST(cuda_train_resume_is_exact_fp32) { resume_exact(NMT_PRECISION_FP32); }
NMT_TEST(cuda_train_resume_is_exact_fp16) { resume_exact(NMT_PRECISION_FP16); }

/* Issue 3: fp16 (loss-scaled) and bf16 train on the GPU and follow the CPU reference's
 * emulation of the same precision (same GEMM input rounding) over 20 steps. */
static void mixed_tracks_cpu(nmt_precision prec) {
  if (!real_cuda_device()) NMT_SKIP("no CUDA device");
  curve g, c;
  double worst;
  int worst_step;
  NMT_ASSERT_OK(two_curves(NMT_DEVICE_CUDA, prec, NMT_DEVICE_CPU, prec, &g, &c, &worst,
                           &worst_step));
  printf("# %s: loss %.4f -> %.4f on the GPU, max |gpu - cpu| %.2e\n",
         prec == NMT_PRECISION_FP16 ? "fp16" : "bf16", g.loss[1], g.loss[TRAIN_STEPS], worst);
  NMT_ASSERT(worst <= 5e-2); /* issue 3: within 0.05 in fp16/bf16 */
  NMT_ASSERT(g.loss[TRAIN_STEPS] < g.loss[1] - 0.1);
}

NMT_TEST(cuda_train_fp16_tracks_cpu) { mixed_tracks_cpu(NMT_PRECISION_FP16); }
NMT_TEST(cuda_train_bf16_tracks_cpu) { mixed_tracks_cpu(NMT_PRECISION_BF16); }

/* ------------------------------------------------------------------------------------------ */
/* translation (issue 7) */

/* The translation fixture: TRANSLATE_LINES source lines of 3..11 ids, decoded with a model
 * trained TRANSLATE_STEPS steps on the CPU. train_config's 20 steps at lr_scale 2 leave a
 * model that emits EOS first on every line (its loss stays at the unigram entropy, ~3.5 nats,
 * and EOS is the most frequent target): 200 empty lines, on the CPU and the GPU alike, which
 * compare equal and test nothing. Without dropout and at lr_scale 0.25 the loss falls to about
 * 2 nats in 200 steps (half a second on one core) and the lines get tokens. */
enum { TRANSLATE_LINES = 200, TRANSLATE_STEPS = 200 };

/* Trains the fixture's model into dir/tr (checkpoint step_TRANSLATE_STEPS) and writes the
 * source lines to `in`; *c is left set up to translate with it on the CPU, greedy. */
static nmt_status translate_fixture(const char *dir, nmt_config *c, char *in, size_t cap) {
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  if (snprintf(in, cap, "%s/src.ids", dir) >= (int)cap)
    return nmt_errorf(NMT_ERR_USAGE, "translate fixture: path too long");
  NMT_TRY(nmt_th_write_synthetic(shard, 256, 9));
  train_config(c, dir, shard, "tr", NMT_DEVICE_CPU, NMT_PRECISION_FP32);
  c->model_dropout = c->model_attn_dropout = c->model_relu_dropout = 0;
  c->train_max_steps = TRANSLATE_STEPS;
  c->train_lr_scale = 0.25f;
  curve cv; /* on_metrics keeps the first TRAIN_STEPS steps only */
  NMT_TRY(train_curve(c, &cv, NULL, NULL));
  FILE *f = fopen(in, "w");
  if (!f) return nmt_errorf(NMT_ERR_IO, "translate fixture: cannot write %s", in);
  for (int i = 0; i < TRANSLATE_LINES; i++) {
    int len = 3 + i % 9;
    for (int j = 0; j < len; j++) fprintf(f, "%s%d", j ? " " : "", 4 + (i * 7 + j * 3) % 20);
    fputc('\n', f);
  }
  if (fclose(f) != 0) return nmt_errorf(NMT_ERR_IO, "translate fixture: cannot write %s", in);
  c->decode_beam = 1;
  c->parallel_device = NMT_DEVICE_CPU;
  return NMT_OK;
}

/* Splits text (modified) into at most max lines at '\n', keeping empty lines (strtok_r would
 * skip them: 200 empty translations counted as 0 lines); a last line without '\n' counts.
 * Returns the number of lines, or -1 when there are more than max. */
static int split_lines(char *text, char **lines, int max) {
  int n = 0;
  for (char *p = text; *p;) {
    if (n == max) return -1;
    lines[n++] = p;
    char *e = strchr(p, '\n');
    if (!e) break;
    *e = 0;
    p = e + 1;
  }
  return n;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Of n lines: how many are non-empty, and how many distinct (lines is reordered). */
static void line_stats(char **lines, int n, int *nonempty, int *distinct) {
  *nonempty = *distinct = 0;
  for (int i = 0; i < n; i++) *nonempty += lines[i][0] != 0;
  qsort(lines, (size_t)n, sizeof *lines, cmp_str);
  for (int i = 0; i < n; i++) *distinct += i == 0 || strcmp(lines[i], lines[i - 1]) != 0;
}

/* The fixture of cuda_translate_matches_cpu is worth comparing: on the CPU, greedy and beam 4
 * give one line per source line, most of them with tokens, and not one line repeated for
 * every input. Runs without a GPU. */
NMT_TEST(cuda_translate_fixture_emits_tokens) {
  const char *dir = nmt_test_tmpdir();
  char in[600], out[600];
  nmt_config c;
  NMT_ASSERT_OK(translate_fixture(dir, &c, in, sizeof in));
  for (int beam = 1; beam <= 4; beam += 3) {
    snprintf(out, sizeof out, "%s/cpu%d.ids", dir, beam);
    c.decode_beam = beam;
    NMT_ASSERT_OK(nmt_translate_file(&c, NULL, in, out, 1));
    char *text = nmt_th_read_file(out, NULL), *lines[TRANSLATE_LINES];
    NMT_ASSERT(text);
    int nonempty = 0, distinct = 0;
    const int n = split_lines(text, lines, TRANSLATE_LINES);
    if (n > 0) line_stats(lines, n, &nonempty, &distinct);
    free(text);
    printf("# beam %d on the CPU: %d lines, %d with tokens, %d distinct\n", beam, n, nonempty,
           distinct);
    NMT_ASSERT_EQ_INT(n, TRANSLATE_LINES);
    NMT_ASSERT(nonempty >= TRANSLATE_LINES * 9 / 10);
    NMT_ASSERT(distinct >= TRANSLATE_LINES / 2);
  }
}

/* A training config for more GPUs than the machine has translates on the GPUs it has, one
 * decoder per device (nmt_device_infer_ranks), not on CPU workers and not into "device index N
 * is not visible"; its output is byte-identical to one decoder's. */
NMT_TEST(cuda_translate_decoders_fit_the_machine) {
  if (!real_cuda_device()) NMT_SKIP("no CUDA device");
  int vis = 0;
  NMT_ASSERT_OK(nmt_backend_cuda_get()->device_count(&vis));
  const char *dir = nmt_test_tmpdir();
  char in[600], one[600], many[600];
  nmt_config c;
  NMT_ASSERT_OK(translate_fixture(dir, &c, in, sizeof in));
  snprintf(one, sizeof one, "%s/one.ids", dir);
  snprintf(many, sizeof many, "%s/many.ids", dir);
  c.decode_beam = 4;
  c.parallel_device = NMT_DEVICE_CUDA;
  c.parallel_devices = 1;
  NMT_ASSERT_OK(nmt_translate_file(&c, NULL, in, one, 1));
  c.parallel_devices = vis + 1;
  for (int k = 0; k < 2; k++) {
    c.parallel_device = k ? NMT_DEVICE_CUDA : NMT_DEVICE_AUTO;
    NMT_ASSERT_EQ_INT(nmt_device_infer_ranks(&c), vis);
  }
  NMT_ASSERT_OK(nmt_translate_file(&c, NULL, in, many, 1));
  char *a = nmt_th_read_file(one, NULL), *b = nmt_th_read_file(many, NULL);
  NMT_ASSERT(a && b);
  printf("# parallel.devices = %d on %d visible GPU(s): %d decoder(s); output %s one decoder's\n",
         vis + 1, vis, nmt_device_infer_ranks(&c), strcmp(a, b) ? "differs from" : "equals");
  NMT_ASSERT(!strcmp(a, b));
  free(a), free(b);
}

/* Issue 7 on a GPU: the CUDA path translates (greedy and beam 4) like the CPU reference, and
 * logs its throughput in sentences/s. fp32 on both: only summation order differs, so nearly
 * every output line must be identical (a near-tie can flip one token). The model is the
 * fixture's above (cuda_translate_fixture_emits_tokens shows on the CPU that its lines are
 * not empty). */
NMT_TEST(cuda_translate_matches_cpu) {
  if (!real_cuda_device()) NMT_SKIP("no CUDA device");
  const char *dir = nmt_test_tmpdir();
  char in[600], out_c[600], out_g[600];
  nmt_config c;
  NMT_ASSERT_OK(translate_fixture(dir, &c, in, sizeof in));
  /* greedy, beam 4 under each rule (decode.beam_rule) */
  for (int run = 0; run < 3; run++) {
    const int beam = run == 0 ? 1 : 4;
    snprintf(out_c, sizeof out_c, "%s/cpu%d.ids", dir, run);
    snprintf(out_g, sizeof out_g, "%s/gpu%d.ids", dir, run);
    c.decode_beam = beam;
    c.decode_beam_rule = run == 2 ? NMT_BEAM_FULL : NMT_BEAM_SHRINK;
    c.parallel_device = NMT_DEVICE_CPU;
    NMT_ASSERT_OK(nmt_translate_file(&c, NULL, in, out_c, 1));
    c.parallel_device = NMT_DEVICE_CUDA;
    NMT_ASSERT_OK(nmt_translate_file(&c, NULL, in, out_g, 1));
    char *a = nmt_th_read_file(out_c, NULL), *b = nmt_th_read_file(out_g, NULL);
    char *la[TRANSLATE_LINES], *lb[TRANSLATE_LINES];
    const int na = a ? split_lines(a, la, TRANSLATE_LINES) : -1;
    const int nb = b ? split_lines(b, lb, TRANSLATE_LINES) : -1;
    int same = 0, same_nonempty = 0;
    for (int i = 0; i < na && i < nb; i++) {
      const int eq = !strcmp(la[i], lb[i]);
      same += eq;
      same_nonempty += eq && la[i][0];
    }
    free(a), free(b);
    printf("# beam %d%s: %d of %d lines identical on GPU and CPU (%d of them with tokens)\n",
           beam, run == 2 ? " (full)" : "", same, na, same_nonempty);
    NMT_ASSERT_EQ_INT(na, TRANSLATE_LINES);
    NMT_ASSERT_EQ_INT(nb, TRANSLATE_LINES);
    NMT_ASSERT(same >= TRANSLATE_LINES * 95 / 100);
    /* Identical because both decode real tokens, not because both are empty. */
    NMT_ASSERT(same_nonempty >= TRANSLATE_LINES * 85 / 100);
  }
}
