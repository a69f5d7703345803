/* test/test_cuda_model.c — the whole Transformer on the CUDA backend: against the PyTorch
 * golden fixtures (test/fixtures, tools/make-fixture.py), eval logits and greedy decoding
 * against the CPU reference, 20 training steps against the CPU engine, and two GPU runs
 * bitwise equal.
 *
 * Tolerances. fp32 ops match the reference to ~1e-6 of each tensor's largest values (different
 * summation orders in cuBLASLt and in the block reductions); the golden test allows loss sums
 * rel 1e-4 and gradients |a-b| <= 1e-4 max|b| + 1e-4 |b| per tensor, still 10x below what a
 * structural error (a wrong mask, site, scale or residual) produces (>= 1e-3 of max|b|, see
 * test/test_model.c). TF32 GEMMs round inputs to 10 mantissa bits: loss rel 2e-3. Training:
 * the per-step loss of 20 GPU steps within 1e-3 (absolute, nats) of the CPU's; two GPU runs
 * bitwise equal (every reduction has a fixed order and cuBLASLt's algorithm is fixed per
 * shape within a run).
 *
 * Every test prints "# SKIP no CUDA device" without a device. With -DNMT_CUDA_TESTS_ON_REF
 * (see test/test_cuda_ops.c) the reference plays the device for the fixture tests. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/model.h"
#include "nmt/trainer.h"
#include "test.h"

/* ------------------------------------------------------------------------------------------ */
/* the device backend, or none */

#ifdef NMT_CUDA_TESTS_ON_REF
/* The reference has the whole table (a NULL context, one "device"). */
static const nmt_backend *device_backend(void) { return &nmt_backend_ref; }
#else
static const nmt_backend *device_backend(void) { return nmt_backend_cuda_get(); }
#endif

static int have_device(void) {
  const nmt_backend *be = device_backend();
  int n = 0;
  return be && be->device_count(&n) == NMT_OK && n > 0;
}

/* ------------------------------------------------------------------------------------------ */
/* fixture file (layout: tools/make-fixture.py; the same reader as test/test_model.c) */

typedef struct {
  nmt_model_cfg cfg;
  int n_sent, src_len, tgt_len, n_tensors;
  uint64_t seed, step;
  int32_t *src, *tgt_in, *tgt_out, *src_lens, *tgt_lens;
  nmt_param_info *tab;
  size_t n_params;
  float *params, *grads;
  double loss_sum, tokens, nll_sum, loss_mean;
  unsigned char *file;
} fixture;

typedef struct {
  const unsigned char *p, *end;
  int bad;
} reader;

static const void *take(reader *r, size_t n) {
  if (r->bad || (size_t)(r->end - r->p) < n) {
    r->bad = 1;
    return NULL;
  }
  const void *q = r->p;
  r->p += n;
  return q;
}

static int32_t rd_i32(reader *r) {
  int32_t v = 0;
  const void *q = take(r, 4);
  if (q) memcpy(&v, q, 4);
  return v;
}

static uint64_t rd_u64(reader *r) {
  uint64_t v = 0;
  const void *q = take(r, 8);
  if (q) memcpy(&v, q, 8);
  return v;
}

static float rd_f32(reader *r) {
  float v = 0;
  const void *q = take(r, 4);
  if (q) memcpy(&v, q, 4);
  return v;
}

static double rd_f64(reader *r) {
  double v = 0;
  const void *q = take(r, 8);
  if (q) memcpy(&v, q, 8);
  return v;
}

static void *rd_array(reader *r, size_t bytes) {
  const void *q = take(r, bytes);
  void *a = malloc(bytes ? bytes : 1);
  if (q && a) memcpy(a, q, bytes);
  return a;
}

static void fixture_free(fixture *f) {
  free(f->src), free(f->tgt_in), free(f->tgt_out), free(f->src_lens), free(f->tgt_lens);
  free(f->tab), free(f->params), free(f->grads), free(f->file);
  memset(f, 0, sizeof *f);
}

static int fixture_load(const char *name, fixture *f) {
  memset(f, 0, sizeof *f);
  char path[1024];
  snprintf(path, sizeof path, "test/fixtures/%s", name);
  FILE *fp = fopen(path, "rb");
  if (!fp) {
    const char *src = __FILE__, *slash = strrchr(src, '/');
    if (slash) {
      snprintf(path, sizeof path, "%.*s/fixtures/%s", (int)(slash - src), src, name);
      fp = fopen(path, "rb");
    }
  }
  if (!fp) {
    nmt_test_fail(__FILE__, __LINE__, "cannot open fixture %s (run from the repository root)",
                  name);
    return -1;
  }
  fseek(fp, 0, SEEK_END);
  long size = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  f->file = size > 0 ? malloc((size_t)size) : NULL;
  size_t got = f->file ? fread(f->file, 1, (size_t)size, fp) : 0;
  fclose(fp);
  reader r = {f->file, f->file + (got == (size_t)size ? size : 0), 0};
  const char *magic = take(&r, 8);
  if (!magic || memcmp(magic, "NMTFIXT1", 8) || rd_i32(&r) != 1) {
    nmt_test_fail(__FILE__, __LINE__, "%s: bad magic, version or short read", name);
    return -1;
  }
  nmt_model_cfg *c = &f->cfg;
  c->vocab = rd_i32(&r);
  c->d_model = rd_i32(&r);
  c->n_heads = rd_i32(&r);
  c->d_ff = rd_i32(&r);
  c->enc_layers = rd_i32(&r);
  c->dec_layers = rd_i32(&r);
  c->max_positions = rd_i32(&r);
  c->norm = rd_i32(&r) ? NMT_NORM_PRE : NMT_NORM_POST;
  f->n_sent = rd_i32(&r);
  f->src_len = rd_i32(&r);
  f->tgt_len = rd_i32(&r);
  f->n_tensors = rd_i32(&r);
  c->dropout = rd_f32(&r);
  c->attn_dropout = rd_f32(&r);
  c->relu_dropout = rd_f32(&r);
  c->label_smoothing = rd_f32(&r);
  c->ln_eps = rd_f32(&r);
  f->seed = rd_u64(&r);
  f->step = rd_u64(&r);
  if (r.bad || f->n_sent < 1 || f->src_len < 1 || f->tgt_len < 1 || f->n_tensors < 1 ||
      f->n_tensors > 100000) {
    nmt_test_fail(__FILE__, __LINE__, "%s: bad header", name);
    return -1;
  }
  size_t ns = (size_t)f->n_sent;
  f->src = rd_array(&r, ns * f->src_len * 4);
  f->tgt_in = rd_array(&r, ns * f->tgt_len * 4);
  f->tgt_out = rd_array(&r, ns * f->tgt_len * 4);
  f->src_lens = rd_array(&r, ns * 4);
  f->tgt_lens = rd_array(&r, ns * 4);
  f->tab = calloc((size_t)f->n_tensors, sizeof *f->tab);
  for (int i = 0; f->tab && i < f->n_tensors && !r.bad; i++) {
    const char *nm = take(&r, 80);
    if (nm) memcpy(f->tab[i].name, nm, 79);
    f->tab[i].ndim = rd_i32(&r);
    f->tab[i].shape[0] = rd_i32(&r);
    f->tab[i].shape[1] = rd_i32(&r);
    f->tab[i].offset = rd_u64(&r);
    f->tab[i].numel = rd_u64(&r);
  }
  f->n_params = rd_u64(&r);
  if (r.bad || f->n_params > 100000000 || f->n_params != nmt_model_num_params(&f->cfg)) {
    nmt_test_fail(__FILE__, __LINE__, "%s: truncated tensor table or parameter count", name);
    return -1;
  }
  f->params = rd_array(&r, f->n_params * 4);
  f->loss_sum = rd_f64(&r);
  f->tokens = rd_f64(&r);
  f->nll_sum = rd_f64(&r);
  f->loss_mean = rd_f64(&r);
  f->grads = rd_array(&r, f->n_params * 4);
  if (r.bad || r.p != r.end || !f->src || !f->tgt_in || !f->tgt_out || !f->src_lens ||
      !f->tgt_lens || !f->tab || !f->params || !f->grads) {
    nmt_test_fail(__FILE__, __LINE__, "%s: truncated or trailing bytes", name);
    return -1;
  }
  return 0;
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
static nmt_status rig_create(rig *r, const nmt_backend *be, nmt_precision prec, const fixture *f) {
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
static nmt_status rig_step(rig *r, const fixture *f, float *host_grads) {
  const size_t total = r->n_params + NMT_GRAD_EXTRA;
  NMT_TRY(r->be->memset_zero(r->ctx, r->grads, total * 4));
  NMT_TRY(nmt_model_forward(r->m, r->params, &r->b, 1, f->seed, f->step, r->grads + r->n_params));
  NMT_TRY(nmt_model_backward(r->m, r->params, r->grads, &r->b, NULL, NULL));
  return r->be->copy_d2h(r->ctx, host_grads, r->grads, total * 4);
}

/* ------------------------------------------------------------------------------------------ */
/* golden fixtures on the device */

static void golden(const char *name, nmt_precision prec) {
  if (!have_device()) {
    nmt_test_skip("no CUDA device");
    return;
  }
  fixture f;
  rig r = {0};
  float *got = NULL, *scaled = NULL;
  if (fixture_load(name, &f)) goto out;
  got = malloc((f.n_params + NMT_GRAD_EXTRA) * 4);
  scaled = malloc(f.n_params * 4);
  nmt_status st = got && scaled ? NMT_OK : NMT_ERR_NOMEM;
  if (st == NMT_OK) st = rig_create(&r, device_backend(), prec, &f);
  if (st == NMT_OK) st = rig_step(&r, &f, got);
  if (st != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "%s: setup/step failed: %s %s", name, nmt_status_str(st),
                  nmt_last_error());
    goto out;
  }
  const float *extra = got + f.n_params;
  const double loss = extra[NMT_GRAD_SLOT_LOSS], nll = extra[NMT_GRAD_SLOT_NLL];
  const double tokens = extra[NMT_GRAD_SLOT_TOKENS];
  const double tol = prec == NMT_PRECISION_TF32 ? 2e-3 : 1e-4;
  if (tokens != f.tokens) {
    nmt_test_fail(__FILE__, __LINE__, "%s: tokens %g, fixture %g", name, tokens, f.tokens);
    goto out;
  }
  const double loss_rel = fabs(loss - f.loss_sum) / fabs(f.loss_sum);
  const double nll_rel = fabs(nll - f.nll_sum) / fabs(f.nll_sum);
  if (!(loss_rel <= tol) || !(nll_rel <= tol)) {
    nmt_test_fail(__FILE__, __LINE__,
                  "%s: loss sum %.9g vs %.9g (rel %.3g), nll %.9g vs %.9g (rel %.3g), tol %g",
                  name, loss, f.loss_sum, loss_rel, nll, f.nll_sum, nll_rel, tol);
    goto out;
  }
  double worst = 0;
  const char *worst_name = "";
  if (prec == NMT_PRECISION_FP32) {
    /* nmt returns d(sum)/d params; the fixture holds d(mean)/d params. */
    for (size_t i = 0; i < f.n_params; i++) scaled[i] = (float)(got[i] / tokens);
    for (int t = 0; t < f.n_tensors; t++) {
      const nmt_param_info *p = &f.tab[t];
      const float *a = scaled + p->offset, *b = f.grads + p->offset;
      double mx = 0, err = 0;
      for (size_t i = 0; i < p->numel; i++) {
        mx = fmax(mx, fabs(b[i]));
        err = fmax(err, fabs((double)a[i] - b[i]));
      }
      if (mx > 0 && err / mx > worst) worst = err / mx, worst_name = p->name;
      if (!nmt_test_close(__FILE__, __LINE__, p->name, a, b, p->numel, 1e-4 * mx, 1e-4)) goto out;
    }
  }
  printf("# %s on the device (%s): loss sum rel err %.2e, nll rel err %.2e, worst grad "
         "max|err|/max|g| %.2e (%s)\n",
         name, prec == NMT_PRECISION_TF32 ? "tf32" : "fp32", loss_rel, nll_rel, worst, worst_name);
out:
  free(got);
  free(scaled);
  rig_free(&r);
  fixture_free(&f);
}

NMT_TEST(cuda_model_golden_post) { golden("model_post.bin", NMT_PRECISION_FP32); }
NMT_TEST(cuda_model_golden_pre) { golden("model_pre.bin", NMT_PRECISION_FP32); }
/* Dropout on every site: the device regenerates nmt's Philox masks bit for bit. */
NMT_TEST(cuda_model_golden_post_dropout) { golden("model_post_dropout.bin", NMT_PRECISION_FP32); }
NMT_TEST(cuda_model_golden_pre_dropout) { golden("model_pre_dropout.bin", NMT_PRECISION_FP32); }
NMT_TEST(cuda_model_golden_tf32_loss) { golden("model_post_dropout.bin", NMT_PRECISION_TF32); }

/* Eval-mode logits and greedy decoding on the device equal the CPU reference's. */
NMT_TEST(cuda_model_logits_and_greedy_match_cpu) {
  if (!have_device()) NMT_SKIP("no CUDA device");
  fixture f;
  rig d = {0}, c = {0};
  float *hl[2] = {0};
  int32_t *ids[2] = {0}, *lens[2] = {0};
  if (fixture_load("model_pre.bin", &f)) goto out;
  nmt_status st = rig_create(&d, device_backend(), NMT_PRECISION_FP32, &f);
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
  fixture_free(&f);
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
  nmt_config_defaults(c);
  snprintf(c->run_out_dir, sizeof c->run_out_dir, "%s/%s", dir, name);
  snprintf(c->data_train, sizeof c->data_train, "%s", shard);
  c->data_valid[0] = 0;
  c->data_max_tokens = 128;
  c->data_max_len = 16;
  c->model_vocab = NMT_TH_VOCAB;
  c->model_d_model = 32;
  c->model_n_heads = 4;
  c->model_d_ff = 64;
  c->model_enc_layers = 2;
  c->model_dec_layers = 2;
  c->model_max_positions = 32;
  c->model_dropout = 0.1f;
  c->model_attn_dropout = 0.1f;
  c->model_relu_dropout = 0.1f;
  c->train_max_steps = TRAIN_STEPS;
  c->train_log_every = 1;
  c->train_valid_every = 0;
  c->train_save_every = 0;
  c->train_warmup_steps = 10;
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

NMT_TEST(cuda_train_20_steps_matches_cpu) {
  if (!real_cuda_device()) NMT_SKIP("no CUDA device");
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 256, 5));
  nmt_config cg, cc;
  train_config(&cg, dir, shard, "gpu", NMT_DEVICE_CUDA, NMT_PRECISION_FP32);
  train_config(&cc, dir, shard, "cpu", NMT_DEVICE_CPU, NMT_PRECISION_FP32);
  curve g, c;
  NMT_ASSERT_OK(train_curve(&cg, &g, NULL, NULL));
  NMT_ASSERT_OK(train_curve(&cc, &c, NULL, NULL));
  NMT_ASSERT_EQ_INT(g.seen, TRAIN_STEPS);
  NMT_ASSERT_EQ_INT(c.seen, TRAIN_STEPS);
  double worst = -1;
  int worst_step = 0;
  for (int s = 1; s <= TRAIN_STEPS; s++) {
    double d = fabs(g.loss[s] - c.loss[s]);
    if (!(d <= worst)) worst = d, worst_step = s; /* NaN sticks */
    if (isnan(worst)) break;
  }
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
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 256, 5));
  nmt_config ct, cf;
  train_config(&ct, dir, shard, "tf32", NMT_DEVICE_CUDA, NMT_PRECISION_TF32);
  train_config(&cf, dir, shard, "fp32", NMT_DEVICE_CUDA, NMT_PRECISION_FP32);
  curve t, f;
  NMT_ASSERT_OK(train_curve(&ct, &t, NULL, NULL));
  NMT_ASSERT_OK(train_curve(&cf, &f, NULL, NULL));
  double worst = 0;
  for (int s = 1; s <= TRAIN_STEPS; s++) worst = fmax(worst, fabs(t.loss[s] - f.loss[s]));
  printf("# tf32 vs fp32 over 20 steps: max |loss difference| %.2e\n", worst);
  NMT_ASSERT(worst <= 2e-2);
}
