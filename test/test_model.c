/* test/test_model.c — the Transformer (src/model/) on the ref backend against PyTorch golden
 * fixtures (tools/make-fixture.py, float64), plus properties PyTorch cannot check for us: the
 * grad-ready prefixes, dropout determinism, eval mode, greedy decoding vs teacher forcing,
 * initialisation and error paths.
 *
 * Tolerances vs the fixtures. The fixture is float64 from the same float32 parameters; nmt
 * computes in float32 (double accumulation only in the loss and the LN statistics), so each
 * value carries float32 roundings of everything before it. Loss sums: rel 1e-5 (observed
 * <= 1e-7). Gradients: |a-b| <= atol + 1e-5|b| with atol = ATOL_FRAC * max|b| over the tensor,
 * ATOL_FRAC = 2e-6. Most gradient elements are small differences of larger terms (LayerNorm
 * and softmax Jacobians, residual sums over layers), so an element is only determined to some
 * float32 ulps of the tensor's largest values: observed max|a-b| / max|b| is <= 9e-7 (about 15
 * ulps), and across OpenBLAS kernels (OPENBLAS_CORETYPE=Prescott..SkylakeX) at most 0.44 of the
 * tolerance is used. A structural error (a wrong mask, site, scale or residual) shows up at
 * >= 1e-3 of max|b|, so the bound keeps a 500x gap to real bugs. The test prints the figures. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixture.h"
#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/model.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

#define ATOL_FRAC 2e-6 /* of max|b| per tensor: see the tolerance note above */

/* ------------------------------------------------------------------------------------------ */
/* device-side helpers (ref backend: device memory is host memory, but go through the table) */

static const nmt_backend *BE = &nmt_backend_ref;

typedef struct {
  nmt_batch b;
  int32_t *mem;
} dev_batch;

static nmt_status batch_upload(dev_batch *d, int n_sent, int src_len, int tgt_len,
                               const int32_t *src, const int32_t *tgt_in, const int32_t *tgt_out,
                               const int32_t *src_lens, const int32_t *tgt_lens) {
  size_t ns = (size_t)n_sent, s = ns * src_len, t = ns * tgt_len;
  size_t total = s + 2 * t + 2 * ns;
  memset(d, 0, sizeof *d);
  NMT_TRY(BE->malloc(NULL, total * sizeof(int32_t), (void **)&d->mem));
  nmt_batch *b = &d->b;
  b->n_sent = n_sent;
  b->src_len = src_len;
  b->tgt_len = tgt_len;
  b->src = d->mem;
  b->tgt_in = b->src + s;
  b->tgt_out = b->tgt_in + t;
  b->src_lens = b->tgt_out + t;
  b->tgt_lens = b->src_lens + ns;
  NMT_TRY(BE->copy_h2d(NULL, b->src, src, s * 4));
  NMT_TRY(BE->copy_h2d(NULL, b->tgt_in, tgt_in, t * 4));
  NMT_TRY(BE->copy_h2d(NULL, b->tgt_out, tgt_out, t * 4));
  NMT_TRY(BE->copy_h2d(NULL, b->src_lens, src_lens, ns * 4));
  NMT_TRY(BE->copy_h2d(NULL, b->tgt_lens, tgt_lens, ns * 4));
  for (size_t i = 0; i < ns; i++) {
    for (int j = 0; j < src_len; j++) b->src_tokens += src[i * src_len + j] != NMT_PAD_ID;
    for (int j = 0; j < tgt_len; j++) b->tgt_tokens += tgt_out[i * tgt_len + j] != NMT_PAD_ID;
  }
  return NMT_OK;
}

static void batch_free(dev_batch *d) {
  if (d->mem) BE->free(NULL, d->mem);
  d->mem = NULL;
}

/* A model, its parameters and a zeroed gradient buffer (n_params + NMT_GRAD_EXTRA). */
typedef struct {
  nmt_model *m;
  float *params, *grads;
  size_t n_params;
  int vocab;
} rig;

static nmt_status rig_create(rig *r, const nmt_model_cfg *cfg, const float *host_params,
                             int max_tokens, int max_len) {
  memset(r, 0, sizeof *r);
  r->n_params = nmt_model_num_params(cfg);
  r->vocab = cfg->vocab;
  NMT_TRY(nmt_model_create(cfg, BE, NULL, max_tokens, max_len, &r->m));
  NMT_TRY(BE->malloc(NULL, r->n_params * sizeof(float), (void **)&r->params));
  NMT_TRY(BE->malloc(NULL, (r->n_params + NMT_GRAD_EXTRA) * sizeof(float), (void **)&r->grads));
  NMT_TRY(BE->copy_h2d(NULL, r->params, host_params, r->n_params * sizeof(float)));
  NMT_TRY(BE->memset_zero(NULL, r->grads, (r->n_params + NMT_GRAD_EXTRA) * sizeof(float)));
  return NMT_OK;
}

static void rig_free(rig *r) {
  nmt_model_destroy(r->m);
  if (r->params) BE->free(NULL, r->params);
  if (r->grads) BE->free(NULL, r->grads);
  memset(r, 0, sizeof *r);
}

static nmt_status fixture_batch(const nmt_fixture *f, dev_batch *d) {
  return batch_upload(d, f->n_sent, f->src_len, f->tgt_len, f->src, f->tgt_in, f->tgt_out,
                      f->src_lens, f->tgt_lens);
}

static int fixture_max_len(const nmt_fixture *f) {
  return f->src_len > f->tgt_len ? f->src_len : f->tgt_len;
}

/* Forward (train=1) and backward into zeroed grads; returns the host copy of all grads. */
static nmt_status run_step(rig *r, const dev_batch *d, uint64_t seed, uint64_t step,
                           nmt_grad_ready_fn ready, void *user, float *host_grads) {
  NMT_TRY(BE->memset_zero(NULL, r->grads, (r->n_params + NMT_GRAD_EXTRA) * sizeof(float)));
  NMT_TRY(nmt_model_forward(r->m, r->params, &d->b, 1, seed, step, r->grads + r->n_params));
  NMT_TRY(nmt_model_backward(r->m, r->params, r->grads, &d->b, ready, user));
  NMT_TRY(BE->copy_d2h(NULL, host_grads, r->grads, (r->n_params + NMT_GRAD_EXTRA) * sizeof(float)));
  return NMT_OK;
}

/* Forward only; returns grad_extra's four slots. */
static nmt_status run_forward(rig *r, const dev_batch *d, int train, uint64_t seed, uint64_t step,
                              float extra[NMT_GRAD_EXTRA]) {
  float *dev_extra = r->grads + r->n_params;
  NMT_TRY(BE->memset_zero(NULL, dev_extra, NMT_GRAD_EXTRA * sizeof(float)));
  NMT_TRY(nmt_model_forward(r->m, r->params, &d->b, train, seed, step, dev_extra));
  NMT_TRY(BE->copy_d2h(NULL, extra, dev_extra, NMT_GRAD_EXTRA * sizeof(float)));
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* golden tests */

static int check_table(const nmt_fixture *f) {
  int n = nmt_model_param_table(&f->cfg, NULL);
  if (n != f->n_tensors) {
    nmt_test_fail(__FILE__, __LINE__, "tensor count: nmt %d, fixture %d", n, f->n_tensors);
    return 0;
  }
  nmt_param_info *tab = calloc((size_t)n, sizeof *tab);
  if (!tab) return 0;
  nmt_model_param_table(&f->cfg, tab);
  int ok = nmt_model_num_params(&f->cfg) == f->n_params;
  if (!ok)
    nmt_test_fail(__FILE__, __LINE__, "n_params: nmt %zu, fixture %zu",
                  nmt_model_num_params(&f->cfg), f->n_params);
  for (int i = 0; ok && i < n; i++) {
    const nmt_param_info *a = &tab[i], *b = &f->tab[i];
    if (strcmp(a->name, b->name) || a->offset != b->offset || a->numel != b->numel ||
        a->ndim != b->ndim || a->shape[0] != b->shape[0] ||
        (a->ndim == 2 && a->shape[1] != b->shape[1])) {
      nmt_test_fail(__FILE__, __LINE__, "tensor %d: nmt %s @%zu (%d,%d) vs fixture %s @%zu (%d,%d)",
                    i, a->name, a->offset, a->shape[0], a->shape[1], b->name, b->offset,
                    b->shape[0], b->shape[1]);
      ok = 0;
    }
  }
  free(tab);
  return ok;
}

static void golden(const char *name) {
  nmt_fixture f;
  if (nmt_fixture_load(name, &f)) return;
  rig r = {0};
  dev_batch d = {0};
  float *got = NULL;
  if (!check_table(&f)) goto out;
  nmt_status st =
      rig_create(&r, &f.cfg, f.params, f.n_sent * fixture_max_len(&f), fixture_max_len(&f));
  if (st == NMT_OK) st = fixture_batch(&f, &d);
  got = malloc((f.n_params + NMT_GRAD_EXTRA) * sizeof *got);
  if (st == NMT_OK && got) st = run_step(&r, &d, f.seed, f.step, NULL, NULL, got);
  if (st != NMT_OK || !got) {
    nmt_test_fail(__FILE__, __LINE__, "%s: setup/step failed: %s %s", name, nmt_status_str(st),
                  nmt_last_error());
    goto out;
  }
  if (d.b.tgt_tokens != (long)f.tokens) {
    nmt_test_fail(__FILE__, __LINE__, "%s: batch tokens %ld, fixture %g", name, d.b.tgt_tokens,
                  f.tokens);
    goto out;
  }
  nmt_fixture_report rep;
  if (!nmt_fixture_check_loss(name, &f, got, 1e-5, &rep) ||
      !nmt_fixture_check_grads(name, &f, got, ATOL_FRAC, 1e-5, &rep))
    goto out;
  printf(
      "# %s: loss sum rel err %.2e, nll rel err %.2e, worst grad max|err|/max|g| %.2e (%s), "
      "max fraction of tolerance used %.2f\n",
      name, rep.loss_rel, rep.nll_rel, rep.worst_rel_to_max, rep.worst, rep.used);
out:
  free(got);
  batch_free(&d);
  rig_free(&r);
  nmt_fixture_free(&f);
}

NMT_TEST(model_golden_post) { golden("model_post.bin"); }
NMT_TEST(model_golden_pre) { golden("model_pre.bin"); }
/* Dropout on every site with nmt's Philox masks re-implemented in the script: checks that the
 * backward regenerates each forward mask (same site, same element indexing). */
NMT_TEST(model_golden_post_dropout) { golden("model_post_dropout.bin"); }
NMT_TEST(model_golden_pre_dropout_no_smoothing) { golden("model_pre_dropout.bin"); }

/* ------------------------------------------------------------------------------------------ */
/* grad-ready callback */

typedef struct {
  const float *dev_grads;
  size_t total;
  int n_calls;
  size_t prefix[64];
  float *snap[64];
  int order_ok;
} ready_log;

static nmt_status on_ready(void *user, size_t n) {
  ready_log *l = user;
  if (l->n_calls >= 64) return nmt_errorf(NMT_ERR_INTERNAL, "too many ready calls");
  if (l->n_calls > 0 && n < l->prefix[l->n_calls - 1]) l->order_ok = 0;
  if (n > l->total) l->order_ok = 0;
  float *s = malloc((n ? n : 1) * sizeof *s);
  if (!s) return NMT_ERR_NOMEM;
  NMT_TRY(BE->copy_d2h(NULL, s, l->dev_grads, n * sizeof *s));
  l->prefix[l->n_calls] = n;
  l->snap[l->n_calls++] = s;
  return NMT_OK;
}

static void ready_case(const char *name) {
  nmt_fixture f;
  if (nmt_fixture_load(name, &f)) return;
  rig r = {0};
  dev_batch d = {0};
  ready_log log = {0};
  float *final = malloc((f.n_params + NMT_GRAD_EXTRA) * sizeof *final);
  nmt_status st =
      rig_create(&r, &f.cfg, f.params, f.n_sent * fixture_max_len(&f), fixture_max_len(&f));
  if (st == NMT_OK) st = fixture_batch(&f, &d);
  log.dev_grads = r.grads;
  log.total = f.n_params + NMT_GRAD_EXTRA;
  log.order_ok = 1;
  if (st == NMT_OK && final) st = run_step(&r, &d, f.seed, f.step, on_ready, &log, final);
  if (st != NMT_OK || !final) {
    nmt_test_fail(__FILE__, __LINE__, "%s: step failed: %s", name, nmt_last_error());
    goto out;
  }
  /* One call per finished stage at least: each decoder and encoder layer, then the rest. */
  int min_calls = f.cfg.dec_layers + f.cfg.enc_layers + 1;
  if (log.n_calls < min_calls || !log.order_ok ||
      log.prefix[log.n_calls - 1] != f.n_params + NMT_GRAD_EXTRA) {
    nmt_test_fail(__FILE__, __LINE__, "%s: %d calls (want >= %d), order ok %d, last %zu (want %zu)",
                  name, log.n_calls, min_calls, log.order_ok,
                  log.n_calls ? log.prefix[log.n_calls - 1] : 0, f.n_params + NMT_GRAD_EXTRA);
    goto out;
  }
  for (int c = 0; c < log.n_calls; c++) {
    size_t n = log.prefix[c];
    if (memcmp(log.snap[c], final, n * sizeof(float))) {
      size_t i = 0;
      while (log.snap[c][i] == final[i]) i++;
      nmt_test_fail(__FILE__, __LINE__,
                    "%s: call %d reported [0, %zu) final, but float %zu changed later "
                    "(%.9g -> %.9g)",
                    name, c, n, i, log.snap[c][i], final[i]);
      goto out;
    }
    /* Each reported prefix must already hold non-zero gradient (it was computed). */
    if (c > 0 && n > log.prefix[c - 1]) {
      int any = 0;
      for (size_t i = log.prefix[c - 1]; i < n && !any; i++) any = log.snap[c][i] != 0;
      if (!any) {
        nmt_test_fail(__FILE__, __LINE__, "%s: call %d: new range [%zu, %zu) is all zero", name, c,
                      log.prefix[c - 1], n);
        goto out;
      }
    }
  }
out:
  for (int c = 0; c < log.n_calls; c++) free(log.snap[c]);
  free(final);
  batch_free(&d);
  rig_free(&r);
  nmt_fixture_free(&f);
}

NMT_TEST(model_grad_ready_post) { ready_case("model_post_dropout.bin"); }
NMT_TEST(model_grad_ready_pre) { ready_case("model_pre.bin"); }

/* ------------------------------------------------------------------------------------------ */
/* dropout: determinism and eval mode */

NMT_TEST(model_dropout_deterministic) {
  nmt_fixture f;
  if (nmt_fixture_load("model_post_dropout.bin", &f)) return;
  rig r = {0};
  dev_batch d = {0};
  size_t ng = f.n_params + NMT_GRAD_EXTRA;
  float *g1 = malloc(ng * sizeof *g1), *g2 = malloc(ng * sizeof *g2);
  float e1[NMT_GRAD_EXTRA], e2[NMT_GRAD_EXTRA], e3[NMT_GRAD_EXTRA], e4[NMT_GRAD_EXTRA];
  NMT_ASSERT(f.cfg.dropout > 0 && f.cfg.attn_dropout > 0 && f.cfg.relu_dropout > 0);
  nmt_status st =
      rig_create(&r, &f.cfg, f.params, f.n_sent * fixture_max_len(&f), fixture_max_len(&f));
  if (st == NMT_OK) st = fixture_batch(&f, &d);
  if (st == NMT_OK) st = run_forward(&r, &d, 1, 42, 5, e1);
  if (st == NMT_OK) st = run_forward(&r, &d, 1, 42, 5, e2);
  if (st == NMT_OK) st = run_forward(&r, &d, 1, 42, 6, e3);
  if (st == NMT_OK) st = run_forward(&r, &d, 1, 43, 5, e4);
  if (st == NMT_OK && g1 && g2) st = run_step(&r, &d, 42, 5, NULL, NULL, g1);
  if (st == NMT_OK && g1 && g2) st = run_step(&r, &d, 42, 5, NULL, NULL, g2);
  if (st != NMT_OK || !g1 || !g2) {
    nmt_test_fail(__FILE__, __LINE__, "step failed: %s", nmt_last_error());
  } else if (memcmp(e1, e2, sizeof e1)) {
    nmt_test_fail(__FILE__, __LINE__, "same seed/step: loss %.9g vs %.9g", e1[0], e2[0]);
  } else if (e1[NMT_GRAD_SLOT_LOSS] == e3[NMT_GRAD_SLOT_LOSS] ||
             e1[NMT_GRAD_SLOT_LOSS] == e4[NMT_GRAD_SLOT_LOSS]) {
    nmt_test_fail(__FILE__, __LINE__, "other step/seed gave the same loss %.9g", e1[0]);
  } else if (memcmp(g1, g2, ng * sizeof *g1)) {
    nmt_test_fail(__FILE__, __LINE__, "backward not bitwise deterministic");
  }
  free(g1);
  free(g2);
  batch_free(&d);
  rig_free(&r);
  nmt_fixture_free(&f);
}

NMT_TEST(model_dropout_off_in_eval) {
  nmt_fixture f;
  if (nmt_fixture_load("model_post_dropout.bin", &f)) return;
  rig with = {0}, without = {0};
  dev_batch d = {0};
  float a[NMT_GRAD_EXTRA], b[NMT_GRAD_EXTRA], c[NMT_GRAD_EXTRA], e[NMT_GRAD_EXTRA];
  nmt_model_cfg off = f.cfg;
  off.dropout = off.attn_dropout = off.relu_dropout = 0;
  int N = f.n_sent * fixture_max_len(&f), L = fixture_max_len(&f);
  nmt_status st = rig_create(&with, &f.cfg, f.params, N, L);
  if (st == NMT_OK) st = rig_create(&without, &off, f.params, N, L);
  if (st == NMT_OK) st = fixture_batch(&f, &d);
  if (st == NMT_OK) st = run_forward(&with, &d, 0, 42, 5, a);
  if (st == NMT_OK) st = run_forward(&without, &d, 0, 42, 5, b);
  if (st == NMT_OK) st = run_forward(&without, &d, 1, 42, 5, c);
  if (st == NMT_OK) st = run_forward(&with, &d, 1, 42, 5, e);
  if (st != NMT_OK)
    nmt_test_fail(__FILE__, __LINE__, "forward failed: %s", nmt_last_error());
  else if (memcmp(a, b, sizeof a) || memcmp(a, c, sizeof a))
    nmt_test_fail(__FILE__, __LINE__, "eval loss with dropout %.9g, without %.9g / %.9g", a[0],
                  b[0], c[0]);
  else if (a[0] == e[0])
    nmt_test_fail(__FILE__, __LINE__, "train-mode dropout had no effect (%.9g)", e[0]);
  batch_free(&d);
  rig_free(&with);
  rig_free(&without);
  nmt_fixture_free(&f);
}

/* Backward accumulates: two steps without zeroing give twice the gradient. */
NMT_TEST(model_backward_accumulates) {
  nmt_fixture f;
  if (nmt_fixture_load("model_pre.bin", &f)) return;
  rig r = {0};
  dev_batch d = {0};
  size_t ng = f.n_params + NMT_GRAD_EXTRA;
  float *once = malloc(ng * sizeof *once), *twice = malloc(ng * sizeof *twice);
  nmt_status st =
      rig_create(&r, &f.cfg, f.params, f.n_sent * fixture_max_len(&f), fixture_max_len(&f));
  if (st == NMT_OK) st = fixture_batch(&f, &d);
  if (st == NMT_OK && once && twice) st = run_step(&r, &d, 1, 1, NULL, NULL, once);
  /* second forward+backward on top of the first one's gradients */
  if (st == NMT_OK && once && twice)
    st = nmt_model_forward(r.m, r.params, &d.b, 1, 1, 1, r.grads + r.n_params);
  if (st == NMT_OK && once && twice)
    st = nmt_model_backward(r.m, r.params, r.grads, &d.b, NULL, NULL);
  if (st == NMT_OK && once && twice) st = BE->copy_d2h(NULL, twice, r.grads, ng * sizeof(float));
  if (st != NMT_OK || !once || !twice) {
    nmt_test_fail(__FILE__, __LINE__, "step failed: %s", nmt_last_error());
  } else {
    /* Not bitwise: the second pass adds each op's contribution onto non-zero sums, so the
     * rounding differs by a few ulps of the largest partial sums. */
    double mx = 0;
    for (size_t i = 0; i < ng; i++) {
      once[i] *= 2.0f;
      mx = fmax(mx, fabs(once[i]));
    }
    nmt_test_close(__FILE__, __LINE__, "2 x grads", twice, once, ng, 1e-6 * mx, 1e-6);
  }
  free(once);
  free(twice);
  batch_free(&d);
  rig_free(&r);
  nmt_fixture_free(&f);
}

/* ------------------------------------------------------------------------------------------ */
/* greedy decoding vs teacher forcing */

/* -log p(v | src, prefix) at the prefix's last position, from a full forward of a B=1 batch
 * whose only non-pad target is v at that position. */
static nmt_status nll_at(rig *r, const int32_t *src, int src_len, const int32_t *prefix, int T,
                         int32_t v, double *out) {
  int32_t tgt_out[64], tgt_lens = T, src_lens = src_len;
  for (int j = 0; j < T; j++) tgt_out[j] = NMT_PAD_ID;
  tgt_out[T - 1] = v;
  dev_batch d;
  NMT_TRY(batch_upload(&d, 1, src_len, T, src, prefix, tgt_out, &src_lens, &tgt_lens));
  float e[NMT_GRAD_EXTRA];
  nmt_status st = run_forward(r, &d, 0, 0, 0, e);
  batch_free(&d);
  *out = e[NMT_GRAD_SLOT_NLL];
  return st;
}

/* Random copy-task batch (target = source): src = x EOS, tgt_in = BOS x, tgt_out = x EOS,
 * lengths 2..T including EOS/BOS. Draws from nmt_rng under (seed, stream). */
static nmt_status copy_batch(dev_batch *d, int B, int T, int V, uint64_t seed, uint64_t stream) {
  int32_t src[64 * 16] = {0}, tin[64 * 16] = {0}, tout[64 * 16] = {0}, sl[64], tl[64];
  uint64_t k = 0;
  for (int b = 0; b < B; b++) {
    int len = 2 + (int)(nmt_rng_u32(seed, stream, k++) % (uint32_t)(T - 1));
    tin[b * T] = NMT_BOS_ID;
    for (int j = 0; j < len - 1; j++) {
      int32_t tok = 4 + (int32_t)(nmt_rng_u32(seed, stream, k++) % (uint32_t)(V - 4));
      src[b * T + j] = tok;
      tin[b * T + j + 1] = tok;
      tout[b * T + j] = tok;
    }
    src[b * T + len - 1] = NMT_EOS_ID;
    tout[b * T + len - 1] = NMT_EOS_ID;
    sl[b] = tl[b] = len;
  }
  return batch_upload(d, B, T, T, src, tin, tout, sl, tl);
}

/* A few hundred Adam steps on the copy task, so that greedy outputs depend on the source and
 * on the position: a random Transformer repeats one token, which would let a wrong position
 * or a stale cache go unnoticed. */
static nmt_status train_copy(rig *r, int steps, int B, int T) {
  size_t n = r->n_params;
  float *mom = NULL, *var = NULL, *host = malloc((n + NMT_GRAD_EXTRA) * sizeof *host);
  nmt_status st = host ? NMT_OK : NMT_ERR_NOMEM;
  if (st == NMT_OK) st = BE->malloc(NULL, n * sizeof(float), (void **)&mom);
  if (st == NMT_OK) st = BE->malloc(NULL, n * sizeof(float), (void **)&var);
  if (st == NMT_OK) st = BE->memset_zero(NULL, mom, n * sizeof(float));
  if (st == NMT_OK) st = BE->memset_zero(NULL, var, n * sizeof(float));
  for (int s = 1; s <= steps && st == NMT_OK; s++) {
    dev_batch d;
    st = copy_batch(&d, B, T, r->vocab, 99, (uint64_t)s);
    if (st == NMT_OK) st = run_step(r, &d, 0, (uint64_t)s, NULL, NULL, host);
    if (st == NMT_OK)
      st = BE->adamw(NULL, r->params, r->grads, mom, var, n, 1e-2f, 0.9f, 0.98f, 1e-9f, 0.0f,
                     1.0f / (float)d.b.tgt_tokens, NULL, NULL, s);
    batch_free(&d);
  }
  if (mom) BE->free(NULL, mom);
  if (var) BE->free(NULL, var);
  free(host);
  return st;
}

static void greedy_case(nmt_norm_kind norm) {
  enum { B = 5, TS = 8, MAX_OUT = 9, EXTRA = 2, TRAIN_STEPS = 300 };
  nmt_model_cfg cfg = {.vocab = 37,
                       .d_model = 16,
                       .n_heads = 2,
                       .d_ff = 32,
                       .enc_layers = 2,
                       .dec_layers = 2,
                       .max_positions = 32,
                       .norm = norm,
                       .ln_eps = 1e-5f};
  /* label smoothing 0, so that the NLL slot is exactly -log p */
  rig r = {0};
  dev_batch d = {0};
  int32_t out[B * MAX_OUT], lens[B], src[B * TS], src_lens[B];
  float *params = malloc(nmt_model_num_params(&cfg) * sizeof *params);
  NMT_ASSERT(params);
  nmt_model_init_params(&cfg, 5, params);
  nmt_status st = rig_create(&r, &cfg, params, 16 * TS, 16);
  free(params);
  if (st == NMT_OK) st = train_copy(&r, TRAIN_STEPS, 16, TS);
  /* Sources of several lengths, so the batch has source padding. */
  if (st == NMT_OK) st = copy_batch(&d, B, TS, cfg.vocab, 7, 12345);
  if (st == NMT_OK) st = nmt_model_greedy(r.m, r.params, &d.b, MAX_OUT, EXTRA, out, lens);
  if (st == NMT_OK) st = BE->copy_d2h(NULL, src, d.b.src, sizeof src);
  if (st == NMT_OK) st = BE->copy_d2h(NULL, src_lens, d.b.src_lens, sizeof src_lens);
  if (st != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "train/greedy failed: %s", nmt_last_error());
    goto out;
  }
  int total = 0, copied = 0, distinct = 0, seen[64] = {0};
  for (int i = 0; i < B && !nmt_test_failed(); i++) {
    const int32_t *s = src + i * TS;
    int slen = src_lens[i];
    int limit = slen + EXTRA < MAX_OUT ? slen + EXTRA : MAX_OUT;
    if (getenv("NMT_TEST_VERBOSE")) {
      printf("# greedy %d:", i);
      for (int j = 0; j < lens[i]; j++) printf(" %d", out[i * MAX_OUT + j]);
      printf("  (source");
      for (int j = 0; j < slen; j++) printf(" %d", s[j]);
      printf(")\n");
    }
    if (lens[i] < 0 || lens[i] > limit) {
      nmt_test_fail(__FILE__, __LINE__, "sentence %d: length %d outside [0, %d]", i, lens[i],
                    limit);
      goto out;
    }
    for (int j = lens[i]; j < MAX_OUT; j++)
      if (out[i * MAX_OUT + j] != NMT_PAD_ID) {
        nmt_test_fail(__FILE__, __LINE__, "sentence %d: no PAD after the end", i);
        goto out;
      }
    for (int j = 0; j < lens[i]; j++) {
      int32_t tok = out[i * MAX_OUT + j];
      copied += j < slen && tok == s[j];
      if (tok >= 0 && tok < 64 && !seen[tok]++) distinct++;
    }
    total += lens[i];
    /* Positions 0..len-1 produced the tokens; position len produced EOS unless the limit
     * stopped it. Each must be the argmax of the teacher-forced distribution of a B=1 batch
     * (no padding), up to float rounding between the two computations (1e-4 nats). */
    int checks = lens[i] < limit ? lens[i] + 1 : lens[i];
    int32_t prefix[32];
    prefix[0] = NMT_BOS_ID;
    for (int t = 0; t < checks; t++) {
      if (t > 0) prefix[t] = out[i * MAX_OUT + t - 1];
      int32_t chosen = t < lens[i] ? out[i * MAX_OUT + t] : NMT_EOS_ID;
      double best = INFINITY, got = 0;
      int32_t best_v = -1;
      for (int32_t v = 0; v < cfg.vocab; v++) {
        double nll;
        if (v == NMT_PAD_ID) continue; /* a PAD target is ignored by the loss */
        st = nll_at(&r, s, slen, prefix, t + 1, v, &nll);
        if (st != NMT_OK) {
          nmt_test_fail(__FILE__, __LINE__, "forward failed: %s", nmt_last_error());
          goto out;
        }
        if (nll < best) {
          best = nll;
          best_v = v;
        }
        if (v == chosen) got = nll;
      }
      if (chosen == NMT_PAD_ID || got > best + 1e-4) {
        nmt_test_fail(__FILE__, __LINE__,
                      "sentence %d position %d: greedy chose %d (nll %.6f), teacher forcing "
                      "argmax %d (nll %.6f)",
                      i, t, chosen, got, best_v, best);
        goto out;
      }
    }
  }
  printf("# greedy (%s-LN, %d copy-task steps): %d tokens, %d distinct, %d copied correctly\n",
         norm == NMT_NORM_PRE ? "pre" : "post", TRAIN_STEPS, total, distinct, copied);
  /* Guard against a vacuous pass: outputs must vary with position and sentence. */
  if (distinct < 6)
    nmt_test_fail(__FILE__, __LINE__, "only %d distinct tokens in %d generated", distinct, total);
out:
  batch_free(&d);
  rig_free(&r);
}

NMT_TEST(model_greedy_matches_teacher_forcing_post) { greedy_case(NMT_NORM_POST); }
NMT_TEST(model_greedy_matches_teacher_forcing_pre) { greedy_case(NMT_NORM_PRE); }

/* ------------------------------------------------------------------------------------------ */
/* init */

NMT_TEST(model_init_params) {
  nmt_model_cfg cfg = {.vocab = 50,
                       .d_model = 32,
                       .n_heads = 4,
                       .d_ff = 64,
                       .enc_layers = 2,
                       .dec_layers = 3,
                       .max_positions = 64,
                       .norm = NMT_NORM_PRE,
                       .ln_eps = 1e-5f};
  size_t n = nmt_model_num_params(&cfg);
  int nt = nmt_model_param_table(&cfg, NULL);
  float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b), *c = malloc(n * sizeof *c);
  nmt_param_info *tab = calloc((size_t)nt, sizeof *tab);
  NMT_ASSERT(a && b && c && tab);
  nmt_model_param_table(&cfg, tab);
  nmt_model_init_params(&cfg, 7, a);
  nmt_model_init_params(&cfg, 7, b);
  nmt_model_init_params(&cfg, 8, c);
  int same = !memcmp(a, b, n * sizeof *a), differs = !!memcmp(a, c, n * sizeof *a);
  size_t covered = 0;
  int bad = 0;
  for (int t = 0; t < nt && !bad; t++) {
    const nmt_param_info *p = &tab[t];
    const float *w = a + p->offset;
    size_t len = strlen(p->name);
    int is_weight = len > 7 && !strcmp(p->name + len - 7, ".weight");
    int is_ln = strstr(p->name, ".ln") != NULL;
    covered += p->numel;
    if (!strcmp(p->name, "embed.weight")) {
      double ss = 0;
      for (int k = 0; k < cfg.d_model; k++) bad |= w[NMT_PAD_ID * cfg.d_model + k] != 0.0f;
      for (size_t i = (size_t)cfg.d_model; i < p->numel; i++) ss += (double)w[i] * w[i];
      double sd = sqrt(ss / (double)(p->numel - cfg.d_model));
      if (fabs(sd - 1.0 / sqrt(cfg.d_model)) > 0.1 / sqrt(cfg.d_model)) {
        nmt_test_fail(__FILE__, __LINE__, "embed std %g, want %g", sd, 1.0 / sqrt(cfg.d_model));
        bad = 1;
      }
    } else if (is_ln) {
      for (size_t i = 0; i < p->numel; i++) bad |= w[i] != (is_weight ? 1.0f : 0.0f);
      if (bad) nmt_test_fail(__FILE__, __LINE__, "%s not %d", p->name, is_weight);
    } else if (!is_weight) {
      for (size_t i = 0; i < p->numel; i++) bad |= w[i] != 0.0f;
      if (bad) nmt_test_fail(__FILE__, __LINE__, "%s not zero", p->name);
    } else {
      double lim = sqrt(6.0 / (p->shape[0] + p->shape[1])), ss = 0;
      for (size_t i = 0; i < p->numel; i++) {
        bad |= fabs(w[i]) > lim;
        ss += (double)w[i] * w[i];
      }
      double sd = sqrt(ss / (double)p->numel), want = lim / sqrt(3.0);
      if (bad || fabs(sd - want) > 0.1 * want) {
        nmt_test_fail(__FILE__, __LINE__, "%s: Xavier bound %g, std %g want %g", p->name, lim, sd,
                      want);
        bad = 1;
      }
    }
  }
  free(a);
  free(b);
  free(c);
  free(tab);
  NMT_ASSERT(!bad);
  NMT_ASSERT(same);
  NMT_ASSERT(differs);
  NMT_ASSERT_EQ_INT(covered, n);
}

/* The table tiles [0, n_params) in the documented order, for both norms. */
NMT_TEST(model_param_table_layout) {
  for (int norm = 0; norm < 2; norm++) {
    nmt_model_cfg cfg = {.vocab = 11,
                         .d_model = 8,
                         .n_heads = 2,
                         .d_ff = 12,
                         .enc_layers = 3,
                         .dec_layers = 2,
                         .max_positions = 8,
                         .norm = (nmt_norm_kind)norm,
                         .ln_eps = 1e-5f};
    int nt = nmt_model_param_table(&cfg, NULL);
    nmt_param_info tab[128];
    NMT_ASSERT(nt <= 128);
    NMT_ASSERT_EQ_INT(nmt_model_param_table(&cfg, tab), nt);
    size_t off = 0;
    for (int i = 0; i < nt; i++) {
      NMT_ASSERT_EQ_INT(tab[i].offset, off);
      NMT_ASSERT_EQ_INT(tab[i].numel,
                        (size_t)tab[i].shape[0] * (size_t)(tab[i].ndim == 2 ? tab[i].shape[1] : 1));
      off += tab[i].numel;
    }
    NMT_ASSERT_EQ_INT(off, nmt_model_num_params(&cfg));
    /* decoder layers 20 tensors each, encoder layers 12, embed 1, ln_f 2 x 2 (pre-LN) */
    NMT_ASSERT_EQ_INT(nt, 2 * 20 + 3 * 12 + 1 + (norm ? 4 : 0));
    int k = 0;
    if (norm) {
      NMT_ASSERT(!strcmp(tab[k].name, "decoder.ln_f.weight"));
      k += 2;
    }
    NMT_ASSERT(!strcmp(tab[k].name, "decoder.layers.1.self_attn.qkv.weight"));
    NMT_ASSERT_EQ_INT(tab[k].shape[0], 24);
    NMT_ASSERT(!strcmp(tab[k + 20].name, "decoder.layers.0.self_attn.qkv.weight"));
    k += 40;
    if (norm) {
      NMT_ASSERT(!strcmp(tab[k].name, "encoder.ln_f.weight"));
      k += 2;
    }
    NMT_ASSERT(!strcmp(tab[k].name, "encoder.layers.2.self_attn.qkv.weight"));
    NMT_ASSERT(!strcmp(tab[nt - 1].name, "embed.weight"));
    NMT_ASSERT_EQ_INT(tab[nt - 1].shape[0], 11);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* errors */

NMT_TEST(model_errors) {
  nmt_model_cfg cfg = {.vocab = 11,
                       .d_model = 8,
                       .n_heads = 2,
                       .d_ff = 12,
                       .enc_layers = 1,
                       .dec_layers = 1,
                       .max_positions = 8,
                       .norm = NMT_NORM_POST,
                       .ln_eps = 1e-5f};
  nmt_model *m = NULL;
  NMT_ASSERT_EQ_STATUS(nmt_model_create(&cfg, BE, NULL, 64, 9, &m), NMT_ERR_CONFIG);
  NMT_ASSERT(m == NULL);
  nmt_model_cfg odd = cfg;
  odd.n_heads = 3;
  NMT_ASSERT_EQ_STATUS(nmt_model_create(&odd, BE, NULL, 64, 8, &m), NMT_ERR_CONFIG);

  float *params = malloc(nmt_model_num_params(&cfg) * sizeof *params);
  NMT_ASSERT(params);
  nmt_model_init_params(&cfg, 1, params);
  rig r;
  nmt_status st = rig_create(&r, &cfg, params, 16, 8);
  free(params);
  NMT_ASSERT_OK(st);
  int32_t src[3 * 6] = {5, 6, 3}, tgt[3 * 6] = {2, 7}, out[3 * 6] = {7, 3};
  int32_t sl[3] = {3, 3, 3}, tl[3] = {2, 2, 2};
  dev_batch d;
  st = batch_upload(&d, 3, 6, 6, src, tgt, out, sl, tl); /* 18 rows > max_tokens 16 */
  if (st == NMT_OK) st = nmt_model_forward(r.m, r.params, &d.b, 1, 0, 0, r.grads + r.n_params);
  nmt_status back = nmt_model_backward(r.m, r.params, r.grads, &d.b, NULL, NULL);
  batch_free(&d);
  rig_free(&r);
  NMT_ASSERT_EQ_STATUS(st, NMT_ERR_DATA);
  NMT_ASSERT(back != NMT_OK); /* no successful forward to take the gradient of */
}

/* ------------------------------------------------------------------------------------------ */
/* no host round trip in a training step (device-side step control, nmt/backend.h) */

/* The ref table with every call that waits for the device on a GPU counted. */
static int host_syncs;
static nmt_status counted_h2d(void *ctx, void *dst, const void *src, size_t bytes) {
  host_syncs++;
  return nmt_ref_copy_h2d(ctx, dst, src, bytes);
}
static nmt_status counted_d2h(void *ctx, void *dst, const void *src, size_t bytes) {
  host_syncs++;
  return nmt_ref_copy_d2h(ctx, dst, src, bytes);
}
static nmt_status counted_sync(void *ctx) {
  host_syncs++;
  return nmt_ref_synchronize(ctx);
}

/* A training forward and backward issue no blocking copy (the token count is counted on the
 * device), the counted tokens equal the batch's, and the device-held loss scale multiplies
 * every gradient as the host scale does: a power of two scales each rounding exactly, so
 * host 2 x device 4 is bitwise 8 x the unscaled gradient. */
NMT_TEST(model_training_step_no_host_copy_device_loss_scale) {
  nmt_backend counting = nmt_backend_ref;
  counting.copy_h2d = counted_h2d, counting.copy_d2h = counted_d2h;
  counting.synchronize = counted_sync;
  nmt_model_cfg cfg = {.vocab = 37, .d_model = 16, .n_heads = 2, .d_ff = 32, .enc_layers = 1,
                       .dec_layers = 1, .max_positions = 16, .norm = NMT_NORM_PRE,
                       .dropout = 0.1f, .label_smoothing = 0.1f, .ln_eps = 1e-5f};
  const size_t n = nmt_model_num_params(&cfg), total = n + NMT_GRAD_EXTRA;
  float *params = malloc(n * sizeof *params), *g1 = malloc(total * sizeof *g1),
        *g8 = malloc(total * sizeof *g8);
  NMT_ASSERT(params && g1 && g8);
  nmt_model_init_params(&cfg, 7, params);
  nmt_model *m = NULL;
  NMT_ASSERT_OK(nmt_model_create(&cfg, &counting, NULL, 64, 10, &m));
  dev_batch d;
  NMT_ASSERT_OK(copy_batch(&d, 4, 10, cfg.vocab, 5, 1));
  float dev_scale = 4.0f; /* "device memory" of the ref backend */
  for (int pass = 0; pass < 2; pass++) {
    float *g = pass ? g8 : g1;
    memset(g, 0, total * sizeof *g);
    nmt_model_set_loss_scale(m, pass ? 2.0f : 1.0f);
    nmt_model_set_loss_scale_dev(m, pass ? &dev_scale : NULL);
    host_syncs = 0;
    NMT_ASSERT_OK(nmt_model_forward(m, params, &d.b, 1, 3, 11, g + n));
    NMT_ASSERT_OK(nmt_model_backward(m, params, g, &d.b, NULL, NULL));
    NMT_ASSERT_EQ_INT(host_syncs, 0);
    NMT_ASSERT(g[n + NMT_GRAD_SLOT_TOKENS] == (float)d.b.tgt_tokens);
  }
  size_t bad = 0, nonzero = 0;
  for (size_t i = 0; i < n; i++) {
    bad += g8[i] != 8.0f * g1[i];
    nonzero += g1[i] != 0.0f;
  }
  NMT_ASSERT(nonzero > n / 2);
  NMT_ASSERT_EQ_INT((long)bad, 0);
  /* The loss slots are of the unscaled loss. */
  NMT_ASSERT(g8[n + NMT_GRAD_SLOT_LOSS] == g1[n + NMT_GRAD_SLOT_LOSS]);
  batch_free(&d);
  nmt_model_destroy(m);
  free(params), free(g1), free(g8);
}
