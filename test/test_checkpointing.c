/* test/test_checkpointing.c — activation checkpointing (nmt_model_cfg.checkpoint_activations)
 * and the Q/K/V projection on three streams (nmt_model_cfg.qkv_streams) of
 * src/model/transformer.c, on the ref backend.
 *
 * Checkpointing must not change a bit. A model with it and one without run the same training
 * steps; the loss slots, every gradient and the sequence of ready-prefix calls (each call's
 * prefix and a snapshot of the gradient buffer at that moment) are compared with memcmp, over
 * post-LN and pre-LN, fp32 and the fp16/bf16 GEMM emulation, both Q/K/V modes and several
 * padded shapes, with dropout on every site. Before that the checkpointed model trains on a
 * different batch, so a workspace buffer the backward failed to rebuild would hold stale
 * values and show. Eval passes (loss, logits, greedy decoding) must be bitwise unchanged too.
 * Memory: nmt_model_activation_bytes against a total worked out here from the shapes (the
 * table at the top of transformer.c), for a 6-layer model. Profiler: the recorded ranges
 * against a (name, phase) list built here from the config. End to end: the trainer with two
 * CPU workers, accumulation and small buckets (reduced from the ready callbacks) gives bitwise
 * the same reduced gradients and parameters. The CUDA variants (checkpointing bitwise, streams
 * vs fused) skip without a device.
 *
 * Streams vs fused: not bitwise. The three weight/bias blocks see the same sums, but the input
 * gradient adds three (rows, C) x (C, C) products instead of one (rows, 3C) x (3C, C) GEMM, so
 * its float32 rounding differs, and everything upstream of a self-attention inherits that.
 * The tolerance is |a-b| <= 1e-5 (max|b| over the tensor + |b|): a few float32 ulps of the
 * tensor's largest values (observed below 1e-6 of max|b|), while a wrong block, bias or
 * stride changes the loss alone by more than 1e-3 (tried: the q bias on all three blocks). The streams mode is also checked against the
 * PyTorch fixtures with test_model.c's tolerances. Its use of the stream pool is checked with a
 * copy of the ref table whose stream and memory ops count calls and record what each op
 * between a fork and its join reads and writes. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixture.h"
#include "helpers.h"
#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/model.h"
#include "nmt/prof.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "nmt/trainer.h"
#include "test.h"

static const nmt_backend *REF = &nmt_backend_ref;

/* ------------------------------------------------------------------------------------------ */
/* a model, its parameters and gradients, and random padded batches */

typedef struct {
  const nmt_backend *be;
  void *ctx;
  nmt_model *m;
  float *params, *grads;
  size_t n_params;
} rig;

static nmt_model_cfg small_cfg(nmt_norm_kind norm, int ckpt, int streams) {
  /* enc_layers != dec_layers, so an encoder/decoder mix-up cannot cancel out */
  nmt_model_cfg c = {.vocab = 41,
                     .d_model = 16,
                     .n_heads = 4,
                     .d_ff = 24,
                     .enc_layers = 2,
                     .dec_layers = 3,
                     .max_positions = 16,
                     .dropout = 0.1f,
                     .attn_dropout = 0.15f,
                     .relu_dropout = 0.2f,
                     .label_smoothing = 0.1f,
                     .norm = norm,
                     .ln_eps = 1e-5f,
                     .checkpoint_activations = ckpt,
                     .qkv_streams = streams};
  return c;
}

/* nmt_model_init_params plus noise on every parameter, so that biases and LayerNorm
 * parameters are not 0/1: a bias block applied to the wrong rows must show. Caller frees. */
static float *make_params(const nmt_model_cfg *cfg, uint64_t seed) {
  size_t n = nmt_model_num_params(cfg);
  float *p = malloc(n * sizeof *p);
  if (!p) return NULL;
  nmt_model_init_params(cfg, seed, p);
  for (size_t i = 0; i < n; i++) p[i] += 0.2f * (nmt_rng_uniform(seed, 77, i) - 0.5f);
  return p;
}

static nmt_status rig_create(rig *r, const nmt_backend *be, void *ctx, const nmt_model_cfg *cfg,
                             const float *host_params, int max_tokens, int max_len) {
  memset(r, 0, sizeof *r);
  r->be = be;
  r->ctx = ctx;
  r->n_params = nmt_model_num_params(cfg);
  NMT_TRY(nmt_model_create(cfg, be, ctx, max_tokens, max_len, &r->m));
  NMT_TRY(be->malloc(ctx, r->n_params * sizeof(float), (void **)&r->params));
  NMT_TRY(be->malloc(ctx, (r->n_params + NMT_GRAD_EXTRA) * sizeof(float), (void **)&r->grads));
  NMT_TRY(be->copy_h2d(ctx, r->params, host_params, r->n_params * sizeof(float)));
  return NMT_OK;
}

static void rig_free(rig *r) {
  nmt_model_destroy(r->m);
  if (r->params) r->be->free(r->ctx, r->params);
  if (r->grads) r->be->free(r->ctx, r->grads);
  memset(r, 0, sizeof *r);
}

typedef struct {
  nmt_batch b;
  int32_t *mem;
  const nmt_backend *be;
  void *ctx;
} dev_batch;

/* Random batch of B sentences: source lengths in [1, Ts] and target lengths in [1, Tt], with
 * one sentence at full length on each side (as the batcher pads to the longest), the others
 * padded; tokens in [4, V), tgt_in = BOS + the first len-1 targets. */
static nmt_status make_batch(dev_batch *d, const nmt_backend *be, void *ctx, int B, int Ts, int Tt,
                             int V, uint64_t seed) {
  int T = Ts > Tt ? Ts : Tt;
  size_t n_ints = nmt_batch_ints(B, T);
  int32_t *host = calloc(n_ints, sizeof *host);
  if (!host) return nmt_errorf(NMT_ERR_NOMEM, "test batch");
  nmt_batch h;
  nmt_batch_layout(&h, host, B, Ts, Tt);
  uint64_t k = 0;
  for (int i = 0; i < B; i++) {
    int sl = i == 0 ? Ts : 1 + (int)(nmt_rng_u32(seed, 1, k++) % (uint32_t)Ts);
    int tl = i == B - 1 ? Tt : 1 + (int)(nmt_rng_u32(seed, 1, k++) % (uint32_t)Tt);
    h.src_lens[i] = sl;
    h.tgt_lens[i] = tl;
    for (int j = 0; j < Ts; j++)
      h.src[i * Ts + j] = j < sl ? 4 + (int32_t)(nmt_rng_u32(seed, 2, k++) % (uint32_t)(V - 4))
                                 : NMT_PAD_ID;
    for (int j = 0; j < Tt; j++)
      h.tgt_out[i * Tt + j] =
          j < tl ? 4 + (int32_t)(nmt_rng_u32(seed, 3, k++) % (uint32_t)(V - 4)) : NMT_PAD_ID;
    for (int j = 0; j < Tt; j++)
      h.tgt_in[i * Tt + j] = j >= tl ? NMT_PAD_ID : j == 0 ? NMT_BOS_ID : h.tgt_out[i * Tt + j - 1];
    h.src_tokens += sl;
    h.tgt_tokens += tl;
  }
  memset(d, 0, sizeof *d);
  d->be = be;
  d->ctx = ctx;
  nmt_status st = be->malloc(ctx, n_ints * sizeof(int32_t), (void **)&d->mem);
  if (st == NMT_OK) st = be->copy_h2d(ctx, d->mem, host, n_ints * sizeof(int32_t));
  if (st == NMT_OK) {
    nmt_batch_layout(&d->b, d->mem, B, Ts, Tt);
    d->b.src_tokens = h.src_tokens;
    d->b.tgt_tokens = h.tgt_tokens;
  }
  free(host);
  return st;
}

static void batch_free(dev_batch *d) {
  if (d->mem) d->be->free(d->ctx, d->mem);
  d->mem = NULL;
}

/* Every ready call: the prefix and a copy of the whole gradient buffer at that moment. */
typedef struct {
  const rig *r;
  int n;
  size_t prefix[64];
  float *snap[64];
} ready_log;

static nmt_status on_ready(void *user, size_t n) {
  ready_log *l = user;
  size_t total = l->r->n_params + NMT_GRAD_EXTRA;
  if (l->n >= 64) return nmt_errorf(NMT_ERR_INTERNAL, "test: too many ready calls");
  float *s = malloc(total * sizeof *s);
  if (!s) return nmt_errorf(NMT_ERR_NOMEM, "test: ready snapshot");
  NMT_TRY(l->r->be->copy_d2h(l->r->ctx, s, l->r->grads, total * sizeof *s));
  l->prefix[l->n] = n;
  l->snap[l->n++] = s;
  return NMT_OK;
}

static void ready_log_free(ready_log *l) {
  for (int i = 0; i < l->n; i++) free(l->snap[i]);
  l->n = 0;
}

/* Zeroed gradients, forward(train=1), backward; host copy of gradients and extra slots. */
static nmt_status rig_step(rig *r, const dev_batch *d, uint64_t seed, uint64_t step,
                           ready_log *log, float *host_out) {
  size_t total = r->n_params + NMT_GRAD_EXTRA;
  NMT_TRY(r->be->memset_zero(r->ctx, r->grads, total * sizeof(float)));
  NMT_TRY(nmt_model_forward(r->m, r->params, &d->b, 1, seed, step, r->grads + r->n_params));
  NMT_TRY(nmt_model_backward(r->m, r->params, r->grads, &d->b, log ? on_ready : NULL, log));
  return r->be->copy_d2h(r->ctx, host_out, r->grads, total * sizeof(float));
}

/* Index of the first differing float, or n. */
static size_t first_diff(const float *a, const float *b, size_t n) {
  size_t i = 0;
  while (i < n && !memcmp(&a[i], &b[i], sizeof *a)) i++;
  return i;
}

/* ------------------------------------------------------------------------------------------ */
/* checkpointing: bitwise equal training steps */

static const char *prec_name(nmt_precision p) {
  return p == NMT_PRECISION_FP16 ? "fp16" : p == NMT_PRECISION_BF16 ? "bf16" : "fp32";
}

/* Returns 1 if the steps of `plain` and `ck` on shape (B, Ts, Tt) agree bitwise. */
static int compare_step(rig *plain, rig *ck, int B, int Ts, int Tt, uint64_t step,
                        const char *what) {
  const nmt_model_cfg c = small_cfg(NMT_NORM_POST, 0, 0); /* vocab and layers of every rig */
  size_t total = plain->n_params + NMT_GRAD_EXTRA;
  dev_batch d = {0};
  ready_log la = {.r = plain}, lb = {.r = ck};
  float *ga = malloc(total * sizeof *ga), *gb = malloc(total * sizeof *gb);
  int ok = 0;
  nmt_status st = ga && gb ? make_batch(&d, plain->be, plain->ctx, B, Ts, Tt, c.vocab, 1000 + step)
                            : NMT_ERR_NOMEM;
  if (st == NMT_OK) st = rig_step(plain, &d, 5, step, &la, ga);
  if (st == NMT_OK) st = rig_step(ck, &d, 5, step, &lb, gb);
  if (st != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "%s %dx%d/%d: step failed: %s", what, B, Ts, Tt,
                  nmt_last_error());
    goto out;
  }
  size_t i = first_diff(ga, gb, total);
  if (i < total) {
    nmt_test_fail(__FILE__, __LINE__,
                  "%s %dx%d/%d: float %zu of %zu differs with checkpointing: %.9g vs %.9g", what,
                  B, Ts, Tt, i, total, gb[i], ga[i]);
    goto out;
  }
  /* Guard against comparing two empty results. */
  int nonzero = 0;
  for (size_t k = 0; k < plain->n_params && !nonzero; k++) nonzero = ga[k] != 0;
  if (!nonzero || !(ga[plain->n_params + NMT_GRAD_SLOT_LOSS] > 0) ||
      ga[plain->n_params + NMT_GRAD_SLOT_TOKENS] != (float)d.b.tgt_tokens) {
    nmt_test_fail(__FILE__, __LINE__, "%s: degenerate step (grads nonzero %d, loss %g)", what,
                  nonzero, ga[plain->n_params + NMT_GRAD_SLOT_LOSS]);
    goto out;
  }
  if (la.n != lb.n || la.n < c.enc_layers + c.dec_layers + 1) {
    nmt_test_fail(__FILE__, __LINE__, "%s %dx%d/%d: %d ready calls with, %d without", what, B,
                  Ts, Tt, lb.n, la.n);
    goto out;
  }
  for (int k = 0; k < la.n; k++) {
    if (la.prefix[k] != lb.prefix[k]) {
      nmt_test_fail(__FILE__, __LINE__, "%s: ready call %d: prefix %zu with, %zu without", what,
                    k, lb.prefix[k], la.prefix[k]);
      goto out;
    }
    i = first_diff(la.snap[k], lb.snap[k], total);
    if (i < total) {
      nmt_test_fail(__FILE__, __LINE__,
                    "%s: at ready call %d (prefix %zu) float %zu differs: %.9g vs %.9g", what, k,
                    la.prefix[k], i, lb.snap[k][i], la.snap[k][i]);
      goto out;
    }
  }
  ok = 1;
out:
  ready_log_free(&la);
  ready_log_free(&lb);
  free(ga);
  free(gb);
  batch_free(&d);
  return ok;
}

static void bitwise_case(nmt_norm_kind norm, nmt_precision prec, int streams) {
  static const int shapes[][3] = {{4, 9, 11}, {3, 12, 5}, {7, 6, 8}, {1, 2, 1}, {16, 4, 4}};
  const int n_shapes = (int)(sizeof shapes / sizeof shapes[0]);
  char what[64];
  snprintf(what, sizeof what, "%s-LN %s qkv=%s", norm == NMT_NORM_PRE ? "pre" : "post",
           prec_name(prec), streams ? "streams" : "fused");
  nmt_model_cfg c0 = small_cfg(norm, 0, streams), c1 = small_cfg(norm, 1, streams);
  void *ctx = NULL;
  rig plain = {0}, ck = {0};
  dev_batch warm = {0};
  float *host = make_params(&c0, 3), *scratch = NULL;
  nmt_status st = host ? NMT_OK : NMT_ERR_NOMEM;
  if (st == NMT_OK) st = nmt_ref_ctx_create(0, &ctx);
  if (st == NMT_OK) st = REF->set_precision(ctx, prec);
  if (st == NMT_OK && REF->stream_pool) st = REF->stream_pool(ctx, 2);
  if (st == NMT_OK) st = rig_create(&plain, REF, ctx, &c0, host, 64, 12);
  if (st == NMT_OK) st = rig_create(&ck, REF, ctx, &c1, host, 64, 12);
  if (st == NMT_OK && prec == NMT_PRECISION_FP16) {
    nmt_model_set_loss_scale(plain.m, 128.0f);
    nmt_model_set_loss_scale(ck.m, 128.0f);
  }
  /* Dirty the checkpointed model's workspace with another batch and step. */
  if (st == NMT_OK) st = make_batch(&warm, REF, ctx, 5, 10, 12, c0.vocab, 99);
  scratch = malloc((plain.n_params + NMT_GRAD_EXTRA) * sizeof *scratch);
  if (st == NMT_OK && !scratch) st = NMT_ERR_NOMEM;
  if (st == NMT_OK) st = rig_step(&ck, &warm, 8, 77, NULL, scratch);
  if (st != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "%s: setup failed: %s", what, nmt_last_error());
    goto out;
  }
  if (!(nmt_model_activation_bytes(ck.m) < nmt_model_activation_bytes(plain.m))) {
    nmt_test_fail(__FILE__, __LINE__, "%s: checkpointing did not shrink the arena (%zu vs %zu)",
                  what, nmt_model_activation_bytes(ck.m), nmt_model_activation_bytes(plain.m));
    goto out;
  }
  for (int s = 0; s < n_shapes; s++)
    if (!compare_step(&plain, &ck, shapes[s][0], shapes[s][1], shapes[s][2], (uint64_t)(s + 1),
                      what))
      goto out;
out:
  free(host);
  free(scratch);
  batch_free(&warm);
  rig_free(&plain);
  rig_free(&ck);
  nmt_ref_ctx_destroy(ctx);
}

NMT_TEST(act_ckpt_bitwise_post_fp32) { bitwise_case(NMT_NORM_POST, NMT_PRECISION_FP32, 0); }
NMT_TEST(act_ckpt_bitwise_pre_fp32) { bitwise_case(NMT_NORM_PRE, NMT_PRECISION_FP32, 0); }
NMT_TEST(act_ckpt_bitwise_post_fp16) { bitwise_case(NMT_NORM_POST, NMT_PRECISION_FP16, 0); }
NMT_TEST(act_ckpt_bitwise_pre_fp16) { bitwise_case(NMT_NORM_PRE, NMT_PRECISION_FP16, 0); }
NMT_TEST(act_ckpt_bitwise_post_bf16) { bitwise_case(NMT_NORM_POST, NMT_PRECISION_BF16, 0); }
NMT_TEST(act_ckpt_bitwise_pre_bf16) { bitwise_case(NMT_NORM_PRE, NMT_PRECISION_BF16, 0); }
NMT_TEST(act_ckpt_bitwise_post_fp32_qkv_streams) {
  bitwise_case(NMT_NORM_POST, NMT_PRECISION_FP32, 1);
}
NMT_TEST(act_ckpt_bitwise_pre_fp16_qkv_streams) {
  bitwise_case(NMT_NORM_PRE, NMT_PRECISION_FP16, 1);
}

/* ------------------------------------------------------------------------------------------ */
/* checkpointing: eval passes unchanged */

static void eval_case(nmt_norm_kind norm) {
  enum { B = 4, T = 9, MAX_OUT = 10 };
  nmt_model_cfg c0 = small_cfg(norm, 0, 0), c1 = small_cfg(norm, 1, 0);
  const size_t nl = (size_t)B * T * (size_t)c0.vocab;
  rig plain = {0}, ck = {0};
  dev_batch d = {0}, warm = {0};
  float *host = make_params(&c0, 4), *scratch = NULL, *la = malloc(nl * sizeof *la),
        *lb = malloc(nl * sizeof *lb);
  float ea[NMT_GRAD_EXTRA], eb[NMT_GRAD_EXTRA];
  int32_t ia[B * MAX_OUT], ib[B * MAX_OUT], na[B], nb[B];
  const float *logits = NULL;
  nmt_status st = host && la && lb ? NMT_OK : NMT_ERR_NOMEM;
  if (st == NMT_OK) st = rig_create(&plain, REF, NULL, &c0, host, 64, 12);
  if (st == NMT_OK) st = rig_create(&ck, REF, NULL, &c1, host, 64, 12);
  if (st == NMT_OK) st = make_batch(&d, REF, NULL, B, T, T, c0.vocab, 21);
  if (st == NMT_OK) st = make_batch(&warm, REF, NULL, 6, 10, 10, c0.vocab, 22);
  scratch = malloc((plain.n_params + NMT_GRAD_EXTRA) * sizeof *scratch);
  if (st == NMT_OK && !scratch) st = NMT_ERR_NOMEM;
  /* a training step first, so the workspace holds another batch's activations */
  if (st == NMT_OK) st = rig_step(&ck, &warm, 1, 1, NULL, scratch);
  rig *r[2] = {&plain, &ck};
  float *e[2] = {ea, eb}, *lg[2] = {la, lb};
  int32_t *ids[2] = {ia, ib}, *lens[2] = {na, nb};
  for (int k = 0; k < 2 && st == NMT_OK; k++) {
    float *extra = r[k]->grads + r[k]->n_params;
    st = REF->memset_zero(NULL, extra, NMT_GRAD_EXTRA * sizeof(float));
    if (st == NMT_OK) st = nmt_model_forward(r[k]->m, r[k]->params, &d.b, 0, 1, 1, extra);
    if (st == NMT_OK) st = REF->copy_d2h(NULL, e[k], extra, sizeof ea);
    if (st == NMT_OK) st = nmt_model_logits(r[k]->m, r[k]->params, &d.b, &logits);
    if (st == NMT_OK) st = REF->copy_d2h(NULL, lg[k], logits, nl * sizeof(float));
    if (st == NMT_OK)
      st = nmt_model_greedy(r[k]->m, r[k]->params, &d.b, MAX_OUT, 3, ids[k], lens[k]);
  }
  if (st != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "eval failed: %s", nmt_last_error());
  } else if (memcmp(ea, eb, sizeof ea)) {
    nmt_test_fail(__FILE__, __LINE__, "eval loss %.9g with checkpointing, %.9g without", eb[0],
                  ea[0]);
  } else if (!(ea[NMT_GRAD_SLOT_LOSS] > 0)) {
    nmt_test_fail(__FILE__, __LINE__, "eval loss %g", ea[NMT_GRAD_SLOT_LOSS]);
  } else if (first_diff(la, lb, nl) < nl) {
    size_t i = first_diff(la, lb, nl);
    nmt_test_fail(__FILE__, __LINE__, "logit %zu: %.9g with checkpointing, %.9g without", i, lb[i],
                  la[i]);
  } else if (memcmp(ia, ib, sizeof ia) || memcmp(na, nb, sizeof na)) {
    nmt_test_fail(__FILE__, __LINE__, "greedy outputs differ with checkpointing");
  } else {
    /* After eval passes overwrote the workspace and layer outputs, training still agrees. */
    compare_step(&plain, &ck, 5, 7, 8, 3,
                 norm == NMT_NORM_PRE ? "pre after eval" : "post after eval");
  }
  free(host);
  free(scratch);
  free(la);
  free(lb);
  batch_free(&d);
  batch_free(&warm);
  rig_free(&plain);
  rig_free(&ck);
}

NMT_TEST(act_ckpt_eval_unchanged_post) { eval_case(NMT_NORM_POST); }
NMT_TEST(act_ckpt_eval_unchanged_pre) { eval_case(NMT_NORM_PRE); }

/* ------------------------------------------------------------------------------------------ */
/* checkpointing: the arena really shrinks */

/* Floats of the model's arena, from the shapes (the table at the top of transformer.c):
 * per sublayer LN input/output + statistics, attention projections (3C), head outputs and
 * probabilities, FFN hidden; embeddings, sinusoids, logits, losses, backward scratch. With
 * checkpointing one set per sublayer kind plus one (N, C) output per layer. */
static double expected_floats(const nmt_model_cfg *c, int max_tokens, int max_len, int ckpt) {
  const double N = max_tokens, C = c->d_model, F = c->d_ff, H = c->n_heads, V = c->vocab;
  const double L = max_len < max_tokens ? max_len : max_tokens, NP = N * H * L;
  const double Le = c->enc_layers, Ld = c->dec_layers;
  const double attn = 2 * N * C + 2 * N + 3 * N * C + N * C + NP;
  const double ffn = 2 * N * C + 2 * N + N * F;
  double fixed = c->max_positions * C + 2 * N * C + N * V + 2 * N +
                 (3 * N * C + N * C + N * C + 3 * N * C + NP + 2 * N * F);
  if (c->norm == NMT_NORM_PRE) fixed += 2 * (N * C + 2 * N);
  if (!ckpt) return fixed + Le * (attn + ffn) + Ld * (2 * attn + ffn);
  return fixed + (Le + Ld) * N * C + attn + (Ld > 0 ? attn : 0) + (ffn - N * C);
}

NMT_TEST(act_ckpt_activation_bytes) {
  /* A 6+6-layer model whose layer activations dominate (small vocabulary). */
  nmt_model_cfg c = {.vocab = 64,
                     .d_model = 64,
                     .n_heads = 4,
                     .d_ff = 256,
                     .enc_layers = 6,
                     .dec_layers = 6,
                     .max_positions = 64,
                     .dropout = 0.1f,
                     .norm = NMT_NORM_POST,
                     .ln_eps = 1e-5f};
  const int N = 512, L = 64;
  for (int norm = 0; norm < 2; norm++) {
    c.norm = norm ? NMT_NORM_PRE : NMT_NORM_POST;
    size_t got[2];
    double want[2];
    for (int ck = 0; ck < 2; ck++) {
      nmt_model *m = NULL;
      c.checkpoint_activations = ck;
      NMT_ASSERT_OK(nmt_model_create(&c, REF, NULL, N, L, &m));
      got[ck] = nmt_model_activation_bytes(m);
      nmt_model_destroy(m);
      /* the no-allocation count the trainer's messages use is the same number */
      NMT_ASSERT_EQ_INT(nmt_model_arena_bytes(&c, N, L), got[ck]);
      want[ck] = 4 * expected_floats(&c, N, L, ck);
      /* each carved piece may add up to 63 bytes of alignment; there are fewer than
       * 8 per sublayer plus 32 others */
      double slack = 64.0 * (8 * (2 * c.enc_layers + 3 * c.dec_layers) + 32);
      printf("# %s-LN, checkpointing %d: arena %zu bytes, expected %.0f (+ <= %.0f padding)\n",
             norm ? "pre" : "post", ck, got[ck], want[ck], slack);
      NMT_ASSERT((double)got[ck] >= want[ck]);
      NMT_ASSERT((double)got[ck] <= want[ck] + slack);
    }
    double factor = (double)got[0] / (double)got[1], expect = want[0] / want[1];
    printf("# %s-LN: %.2fx smaller with checkpointing (expected %.2fx from the shapes)\n",
           norm ? "pre" : "post", factor, expect);
    NMT_ASSERT(expect > 3.0); /* the config is one where checkpointing matters */
    NMT_ASSERT(factor >= expect * 0.99);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* checkpointing: profiler ranges */

typedef struct {
  int n_push, n_pop;
} nvtx_count;

static void count_nvtx(void *user, const nmt_prof_track *t, const char *name) {
  (void)t;
  nvtx_count *n = user;
  if (name) n->n_push++;
  else n->n_pop++;
}

/* (name, phase) of every range of one training step, in push order, from the config. */
static int expected_ranges(const nmt_model_cfg *c, char names[][40], nmt_prof_phase *ph) {
  int n = 0, pre = c->norm == NMT_NORM_PRE;
  const char *sub[2][3] = {{"self_attn", "ffn", ""}, {"self_attn", "cross_attn", "ffn"}};
#define ADD(p, ...)                               \
  do {                                            \
    snprintf(names[n], 40, __VA_ARGS__);          \
    ph[n++] = (p);                                \
  } while (0)
  ADD(NMT_PROF_FWD, "encoder.embed");
  for (int l = 0; l < c->enc_layers; l++)
    for (int k = 0; k < 2; k++) ADD(NMT_PROF_FWD, "encoder.%d.%s", l, sub[0][k]);
  if (pre) ADD(NMT_PROF_FWD, "encoder.final_ln");
  ADD(NMT_PROF_FWD, "decoder.embed");
  for (int l = 0; l < c->dec_layers; l++)
    for (int k = 0; k < 3; k++) ADD(NMT_PROF_FWD, "decoder.%d.%s", l, sub[1][k]);
  if (pre) ADD(NMT_PROF_FWD, "decoder.final_ln");
  ADD(NMT_PROF_FWD, "generator.proj");
  ADD(NMT_PROF_FWD, "generator.xent");
  ADD(NMT_PROF_BWD, "generator.proj");
  if (pre) ADD(NMT_PROF_BWD, "decoder.final_ln");
  for (int l = c->dec_layers - 1; l >= 0; l--) {
    for (int k = 0; k < 3; k++) ADD(NMT_PROF_FWD, "decoder.%d.%s", l, sub[1][k]); /* re-run */
    for (int k = 2; k >= 0; k--) ADD(NMT_PROF_BWD, "decoder.%d.%s", l, sub[1][k]);
  }
  ADD(NMT_PROF_BWD, "decoder.embed");
  if (pre) ADD(NMT_PROF_BWD, "encoder.final_ln");
  for (int l = c->enc_layers - 1; l >= 0; l--) {
    for (int k = 0; k < 2; k++) ADD(NMT_PROF_FWD, "encoder.%d.%s", l, sub[0][k]);
    for (int k = 1; k >= 0; k--) ADD(NMT_PROF_BWD, "encoder.%d.%s", l, sub[0][k]);
  }
  ADD(NMT_PROF_BWD, "encoder.embed");
#undef ADD
  return n;
}

static void ranges_case(nmt_norm_kind norm) {
  nmt_model_cfg c = small_cfg(norm, 1, 1);
  rig r = {0}, bare = {0};
  dev_batch d = {0};
  nmt_prof *p = NULL;
  nmt_prof_track *t = NULL;
  nvtx_count nv = {0, 0};
  size_t total = nmt_model_num_params(&c) + NMT_GRAD_EXTRA;
  float *host = make_params(&c, 6), *ga = malloc(total * sizeof *ga),
        *gb = malloc(total * sizeof *gb);
  nmt_prof_options o;
  nmt_prof_options_default(&o);
  o.start_step = 1;
  o.stop_step = 1;
  o.nvtx = 1;
  nmt_status st = host && ga && gb ? nmt_prof_create(&o, &p) : NMT_ERR_NOMEM;
  if (st == NMT_OK) nmt_prof_set_nvtx_hook(p, count_nvtx, &nv);
  if (st == NMT_OK) st = rig_create(&r, REF, NULL, &c, host, 64, 12);
  if (st == NMT_OK) st = rig_create(&bare, REF, NULL, &c, host, 64, 12);
  int n_fwd = st == NMT_OK ? nmt_model_module_names(r.m, NMT_PROF_FWD, NULL) : 0;
  int n_bwd = st == NMT_OK ? nmt_model_module_names(r.m, NMT_PROF_BWD, NULL) : 0;
  if (st == NMT_OK) st = nmt_prof_add_track(p, "cpu0", (size_t)(n_fwd + n_bwd), &t);
  if (st == NMT_OK) st = nmt_model_set_profiler(r.m, t);
  if (st == NMT_OK) st = make_batch(&d, REF, NULL, 3, 7, 9, c.vocab, 5);
  if (st == NMT_OK) {
    nmt_prof_step_begin(t, 1);
    st = rig_step(&r, &d, 2, 1, NULL, ga);
    if (st == NMT_OK) st = nmt_prof_step_end(t);
  }
  if (st == NMT_OK) st = rig_step(&bare, &d, 2, 1, NULL, gb);
  if (st != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "setup/step failed: %s", nmt_last_error());
    goto out;
  }
  char want[128][40];
  nmt_prof_phase ph[128];
  int n_want = expected_ranges(&c, want, ph);
  const char *listed[128];
  if (n_fwd + n_bwd != n_want || n_fwd > 128 || n_bwd > 128) {
    nmt_test_fail(__FILE__, __LINE__, "module lists %d + %d names, expected %d", n_fwd, n_bwd,
                  n_want);
    goto out;
  }
  nmt_model_module_names(r.m, NMT_PROF_FWD, listed);
  nmt_model_module_names(r.m, NMT_PROF_BWD, listed + n_fwd);
  for (int i = 0; i < n_want; i++)
    if (strcmp(listed[i], want[i])) {
      nmt_test_fail(__FILE__, __LINE__, "module list entry %d: '%s', expected '%s'", i, listed[i],
                    want[i]);
      goto out;
    }
  size_t ne = nmt_prof_track_n_events(t);
  if (ne != (size_t)n_want || nmt_prof_track_dropped(t) != 0) {
    nmt_test_fail(__FILE__, __LINE__, "%zu events (%zu dropped), expected %d", ne,
                  nmt_prof_track_dropped(t), n_want);
    goto out;
  }
  for (size_t i = 0; i < ne; i++) {
    nmt_prof_event e;
    nmt_prof_track_event(t, i, &e);
    if (strcmp(e.name, want[i]) || e.phase != ph[i] || e.depth != 0 || e.t1_ns < e.t0_ns) {
      nmt_test_fail(__FILE__, __LINE__, "event %zu: '%s' %s depth %d; expected '%s' %s", i,
                    e.name, nmt_prof_phase_str(e.phase), e.depth, want[i],
                    nmt_prof_phase_str(ph[i]));
      goto out;
    }
  }
  if (nv.n_push != n_want || nv.n_pop != nv.n_push) {
    nmt_test_fail(__FILE__, __LINE__, "NVTX: %d pushes, %d pops, expected %d", nv.n_push,
                  nv.n_pop, n_want);
    goto out;
  }
  if (memcmp(ga, gb, total * sizeof *ga))
    nmt_test_fail(__FILE__, __LINE__, "gradients differ with the profiler on");
out:
  free(host);
  free(ga);
  free(gb);
  batch_free(&d);
  rig_free(&r);
  rig_free(&bare);
  nmt_prof_destroy(p);
}

NMT_TEST(act_ckpt_profiler_ranges_post) { ranges_case(NMT_NORM_POST); }
NMT_TEST(act_ckpt_profiler_ranges_pre) { ranges_case(NMT_NORM_PRE); }

/* ------------------------------------------------------------------------------------------ */
/* Q/K/V on streams: same results as fused */

/* Loss slots to rel tol (tokens exactly), gradients per tensor |a-b| <= tol (max|b| + |b|).
 * Returns the largest max|a-b| / max|b| over the tensors, or -1 after a failure. */
static double compare_close(const nmt_model_cfg *c, const float *got, const float *ref,
                            double tol, const char *what) {
  size_t np = nmt_model_num_params(c);
  const float *eg = got + np, *er = ref + np;
  if (eg[NMT_GRAD_SLOT_TOKENS] != er[NMT_GRAD_SLOT_TOKENS] ||
      fabs(eg[NMT_GRAD_SLOT_LOSS] - er[NMT_GRAD_SLOT_LOSS]) > tol * fabs(er[NMT_GRAD_SLOT_LOSS]) ||
      fabs(eg[NMT_GRAD_SLOT_NLL] - er[NMT_GRAD_SLOT_NLL]) > tol * fabs(er[NMT_GRAD_SLOT_NLL])) {
    nmt_test_fail(__FILE__, __LINE__, "%s: loss %.9g / nll %.9g / tokens %g vs %.9g / %.9g / %g",
                  what, eg[0], eg[2], eg[1], er[0], er[2], er[1]);
    return -1;
  }
  int nt = nmt_model_param_table(c, NULL);
  nmt_param_info *tab = calloc((size_t)nt, sizeof *tab);
  if (!tab) return -1;
  nmt_model_param_table(c, tab);
  double worst = 0;
  for (int i = 0; i < nt; i++) {
    const float *a = got + tab[i].offset, *b = ref + tab[i].offset;
    double mx = 0, err = 0;
    for (size_t k = 0; k < tab[i].numel; k++) {
      mx = fmax(mx, fabs(b[k]));
      err = fmax(err, fabs(a[k] - b[k]));
    }
    char name[160];
    snprintf(name, sizeof name, "%s %s", what, tab[i].name);
    if (!nmt_test_close(__FILE__, __LINE__, name, a, b, tab[i].numel, tol * mx, tol)) {
      free(tab);
      return -1;
    }
    if (mx > 0) worst = fmax(worst, err / mx);
  }
  free(tab);
  return worst;
}

static void streams_case(nmt_norm_kind norm, int ckpt) {
  static const int shapes[][3] = {{4, 9, 11}, {3, 12, 5}, {1, 2, 1}};
  nmt_model_cfg cf = small_cfg(norm, ckpt, 0), cs = small_cfg(norm, ckpt, 1);
  size_t total = nmt_model_num_params(&cf) + NMT_GRAD_EXTRA;
  rig fused = {0}, str = {0};
  float *host = make_params(&cf, 9), *ga = malloc(total * sizeof *ga),
        *gb = malloc(total * sizeof *gb);
  nmt_status st = host && ga && gb ? NMT_OK : NMT_ERR_NOMEM;
  if (st == NMT_OK) st = rig_create(&fused, REF, NULL, &cf, host, 64, 12);
  if (st == NMT_OK) st = rig_create(&str, REF, NULL, &cs, host, 64, 12);
  double worst = 0;
  for (int s = 0; s < 3 && st == NMT_OK; s++) {
    dev_batch d;
    st = make_batch(&d, fused.be, fused.ctx, shapes[s][0], shapes[s][1], shapes[s][2], cf.vocab,
                    40 + (uint64_t)s);
    if (st == NMT_OK) st = rig_step(&fused, &d, 3, (uint64_t)s, NULL, ga);
    if (st == NMT_OK) st = rig_step(&str, &d, 3, (uint64_t)s, NULL, gb);
    batch_free(&d);
    if (st != NMT_OK) break;
    double w = compare_close(&cf, gb, ga, 1e-5, norm == NMT_NORM_PRE ? "pre" : "post");
    if (w < 0) goto out;
    worst = fmax(worst, w);
  }
  if (st != NMT_OK)
    nmt_test_fail(__FILE__, __LINE__, "step failed: %s", nmt_last_error());
  else
    printf("# %s-LN%s: streams vs fused worst max|err|/max|g| over tensors %.2e (tolerance 1e-5)\n",
           norm == NMT_NORM_PRE ? "pre" : "post", ckpt ? " checkpointed" : "", worst);
out:
  free(host);
  free(ga);
  free(gb);
  rig_free(&fused);
  rig_free(&str);
}

NMT_TEST(qkv_streams_matches_fused_post) { streams_case(NMT_NORM_POST, 0); }
NMT_TEST(qkv_streams_matches_fused_pre) { streams_case(NMT_NORM_PRE, 0); }
NMT_TEST(qkv_streams_matches_fused_post_ckpt) { streams_case(NMT_NORM_POST, 1); }
NMT_TEST(qkv_streams_matches_fused_pre_ckpt) { streams_case(NMT_NORM_PRE, 1); }

/* The PyTorch fixtures (test_model.c's golden tests and tolerances) with streams and
 * checkpointing on: an independent check of the split into row blocks. */
static void golden_variant(const char *name, int ckpt, int streams) {
  nmt_fixture f;
  if (nmt_fixture_load(name, &f)) return;
  nmt_model_cfg c = f.cfg;
  c.checkpoint_activations = ckpt;
  c.qkv_streams = streams;
  int T = f.src_len > f.tgt_len ? f.src_len : f.tgt_len;
  rig r = {0};
  dev_batch d = {0};
  size_t total = f.n_params + NMT_GRAD_EXTRA;
  float *got = malloc(total * sizeof *got);
  nmt_status st = got ? rig_create(&r, REF, NULL, &c, f.params, f.n_sent * T, T) : NMT_ERR_NOMEM;
  if (st == NMT_OK) {
    /* the fixture's exact batch (make_batch draws its own) */
    size_t n_ints = nmt_batch_ints(f.n_sent, T);
    d.be = REF;
    st = REF->malloc(NULL, n_ints * sizeof(int32_t), (void **)&d.mem);
    if (st == NMT_OK) {
      nmt_batch_layout(&d.b, d.mem, f.n_sent, f.src_len, f.tgt_len);
      size_t s = (size_t)f.n_sent * f.src_len, t = (size_t)f.n_sent * f.tgt_len;
      memcpy(d.b.src, f.src, s * 4);
      memcpy(d.b.tgt_in, f.tgt_in, t * 4);
      memcpy(d.b.tgt_out, f.tgt_out, t * 4);
      memcpy(d.b.src_lens, f.src_lens, (size_t)f.n_sent * 4);
      memcpy(d.b.tgt_lens, f.tgt_lens, (size_t)f.n_sent * 4);
      for (size_t i = 0; i < s; i++) d.b.src_tokens += f.src[i] != NMT_PAD_ID;
      for (size_t i = 0; i < t; i++) d.b.tgt_tokens += f.tgt_out[i] != NMT_PAD_ID;
    }
  }
  if (st == NMT_OK) st = rig_step(&r, &d, f.seed, f.step, NULL, got);
  if (st != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "%s: step failed: %s", name, nmt_last_error());
  } else {
    nmt_fixture_report rep;
    if (nmt_fixture_check_loss(name, &f, got, 1e-5, &rep) &&
        nmt_fixture_check_grads(name, &f, got, 2e-6, 1e-5, &rep))
      printf("# %s (checkpointing %d, qkv %s): worst grad max|err|/max|g| %.2e (%s), max "
             "fraction of tolerance used %.2f\n",
             name, ckpt, streams ? "streams" : "fused", rep.worst_rel_to_max, rep.worst, rep.used);
  }
  free(got);
  batch_free(&d);
  rig_free(&r);
  nmt_fixture_free(&f);
}

NMT_TEST(qkv_streams_golden) {
  const char *names[] = {"model_post_dropout.bin", "model_pre_dropout.bin", "model_pre.bin"};
  for (int i = 0; i < 3 && !nmt_test_failed(); i++) {
    golden_variant(names[i], 0, 1);
    if (!nmt_test_failed()) golden_variant(names[i], 1, 1);
    if (!nmt_test_failed()) golden_variant(names[i], 1, 0);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Q/K/V on streams: the stream pool used as its contract says (nmt/backend.h) */

enum { MAX_ACCESS = 64 };

/* What the counting table saw. Tests run on one thread, one at a time. */
static struct {
  int forked, forks, joins, uses[3];
  int main_op_in_fork; /* memset, copy or synchronize between fork and join */
  int bad_use;         /* stream_use outside a fork, or i outside [0, 2] */
  int other_op_in_fork; /* attention, LayerNorm, ... before the join that they must follow */
  int conflicts;       /* two streams of one fork touching the same memory, one writing */
  int n_access, access_overflow;
  struct {
    int stream, write;
    const char *lo, *hi;
  } access[MAX_ACCESS];
} SL;

static nmt_backend COUNTING;

static int cur_stream; /* stream_use's i since the last fork */

/* Records that the op being issued on cur_stream reads or writes [p, p + floats). */
static void touch_on(const void *p, size_t floats, int write) {
  if (!SL.forked || !p || !floats) return;
  if (SL.n_access == MAX_ACCESS) {
    SL.access_overflow++;
    return;
  }
  SL.access[SL.n_access].stream = cur_stream;
  SL.access[SL.n_access].write = write;
  SL.access[SL.n_access].lo = p;
  SL.access[SL.n_access].hi = (const char *)p + floats * sizeof(float);
  SL.n_access++;
}

static nmt_status c_stream_pool(void *ctx, int n) {
  return REF->stream_pool ? REF->stream_pool(ctx, n) : NMT_OK;
}

static nmt_status c_stream_fork(void *ctx) {
  if (SL.forked) SL.bad_use++;
  SL.forked = 1;
  SL.forks++;
  SL.n_access = 0;
  cur_stream = 0;
  return REF->stream_fork ? REF->stream_fork(ctx) : NMT_OK;
}

static nmt_status c_stream_use(void *ctx, int i) {
  if (!SL.forked || i < 0 || i > 2) SL.bad_use++;
  else SL.uses[i]++;
  cur_stream = i;
  return REF->stream_use ? REF->stream_use(ctx, i) : NMT_OK;
}

static nmt_status c_stream_join(void *ctx) {
  if (!SL.forked) SL.bad_use++;
  for (int i = 0; i < SL.n_access; i++)
    for (int j = 0; j < i; j++)
      if (SL.access[i].stream != SL.access[j].stream &&
          (SL.access[i].write || SL.access[j].write) && SL.access[i].lo < SL.access[j].hi &&
          SL.access[j].lo < SL.access[i].hi)
        SL.conflicts++;
  SL.forked = 0;
  SL.joins++;
  cur_stream = 0;
  return REF->stream_join ? REF->stream_join(ctx) : NMT_OK;
}

static nmt_status c_memset_zero(void *ctx, void *p, size_t bytes) {
  SL.main_op_in_fork += SL.forked;
  return REF->memset_zero(ctx, p, bytes);
}
static nmt_status c_copy_h2d(void *ctx, void *dst, const void *src, size_t bytes) {
  SL.main_op_in_fork += SL.forked;
  return REF->copy_h2d(ctx, dst, src, bytes);
}
static nmt_status c_copy_d2h(void *ctx, void *dst, const void *src, size_t bytes) {
  SL.main_op_in_fork += SL.forked;
  return REF->copy_d2h(ctx, dst, src, bytes);
}
static nmt_status c_synchronize(void *ctx) {
  SL.main_op_in_fork += SL.forked;
  return REF->synchronize(ctx);
}

static nmt_status c_matmul_fwd(void *ctx, float *out, const float *inp, const float *w,
                               const float *bias, int M, int K, int N) {
  touch_on(out, (size_t)M * N, 1);
  touch_on(inp, (size_t)M * K, 0);
  touch_on(w, (size_t)N * K, 0);
  touch_on(bias, (size_t)N, 0);
  return REF->matmul_fwd(ctx, out, inp, w, bias, M, K, N);
}

static nmt_status c_matmul_bwd(void *ctx, float *dinp, float *dw, float *dbias, const float *dout,
                               const float *inp, const float *w, int M, int K, int N) {
  touch_on(dinp, (size_t)M * K, 1);
  touch_on(dw, (size_t)N * K, 1);
  touch_on(dbias, (size_t)N, 1);
  touch_on(dout, (size_t)M * N, 0);
  if (dw) touch_on(inp, (size_t)M * K, 0);
  if (dinp) touch_on(w, (size_t)N * K, 0);
  return REF->matmul_bwd(ctx, dinp, dw, dbias, dout, inp, w, M, K, N);
}

static nmt_status c_attention_fwd(void *ctx, float *out, float *probs, const float *q, int ldq,
                                  const float *k, const float *v, int ldkv, const int32_t *k_lens,
                                  int B, int Tq, int Tk, int H, int dk, int causal, float p_drop,
                                  uint64_t seed, uint64_t stream) {
  SL.other_op_in_fork += SL.forked;
  return REF->attention_fwd(ctx, out, probs, q, ldq, k, v, ldkv, k_lens, B, Tq, Tk, H, dk, causal,
                            p_drop, seed, stream);
}

static nmt_status c_attention_bwd(void *ctx, float *dq, float *dkey, float *dv, float *dprobs,
                                  const float *dout, const float *probs, const float *q, int ldq,
                                  const float *k, const float *v, int ldkv, const int32_t *k_lens,
                                  int B, int Tq, int Tk, int H, int dk, int causal, float p_drop,
                                  uint64_t seed, uint64_t stream) {
  SL.other_op_in_fork += SL.forked;
  return REF->attention_bwd(ctx, dq, dkey, dv, dprobs, dout, probs, q, ldq, k, v, ldkv, k_lens, B,
                            Tq, Tk, H, dk, causal, p_drop, seed, stream);
}

static nmt_status c_layernorm_bwd(void *ctx, float *dinp, float *dgamma, float *dbeta,
                                  const float *dout, const float *inp, const float *gamma,
                                  const float *mean, const float *rstd, int M, int C) {
  SL.other_op_in_fork += SL.forked;
  return REF->layernorm_bwd(ctx, dinp, dgamma, dbeta, dout, inp, gamma, mean, rstd, M, C);
}

static nmt_status c_dropout_fwd(void *ctx, float *out, const float *inp, size_t n, float p,
                                uint64_t seed, uint64_t stream) {
  SL.other_op_in_fork += SL.forked;
  return REF->dropout_fwd(ctx, out, inp, n, p, seed, stream);
}

static void counting_init(void) {
  COUNTING = nmt_backend_ref;
  COUNTING.name = "ref-counting";
  COUNTING.stream_pool = c_stream_pool;
  COUNTING.stream_fork = c_stream_fork;
  COUNTING.stream_use = c_stream_use;
  COUNTING.stream_join = c_stream_join;
  COUNTING.memset_zero = c_memset_zero;
  COUNTING.copy_h2d = c_copy_h2d;
  COUNTING.copy_d2h = c_copy_d2h;
  COUNTING.synchronize = c_synchronize;
  COUNTING.matmul_fwd = c_matmul_fwd;
  COUNTING.matmul_bwd = c_matmul_bwd;
  COUNTING.attention_fwd = c_attention_fwd;
  COUNTING.attention_bwd = c_attention_bwd;
  COUNTING.layernorm_bwd = c_layernorm_bwd;
  COUNTING.dropout_fwd = c_dropout_fwd;
  memset(&SL, 0, sizeof SL);
  cur_stream = 0;
}

/* The checker itself catches what it is meant to: a buffer written on one stream and read on
 * another, and a memset between fork and join. */
NMT_TEST(qkv_streams_checker_can_fail) {
  counting_init();
  float a[8] = {0}, b[8] = {0}, w[4] = {1, 0, 0, 1};
  NMT_ASSERT_OK(COUNTING.stream_fork(NULL));
  NMT_ASSERT_OK(COUNTING.stream_use(NULL, 1));
  NMT_ASSERT_OK(COUNTING.matmul_fwd(NULL, a, b, w, NULL, 4, 2, 2));
  NMT_ASSERT_OK(COUNTING.stream_use(NULL, 2));
  NMT_ASSERT_OK(COUNTING.matmul_fwd(NULL, b + 4, a, w, NULL, 2, 2, 2)); /* reads stream 1's a */
  COUNTING.memset_zero(NULL, b, sizeof b); /* the ref may refuse it; the count is what matters */
  NMT_ASSERT_OK(COUNTING.stream_join(NULL));
  NMT_ASSERT(SL.conflicts >= 1);
  NMT_ASSERT_EQ_INT(SL.main_op_in_fork, 1);
  NMT_ASSERT_EQ_INT(SL.forks, 1);
  NMT_ASSERT_EQ_INT(SL.joins, 1);
}

NMT_TEST(qkv_streams_bookkeeping) {
  counting_init();
  nmt_backend nofork = COUNTING; /* a backend without a stream pool: the three run in turn */
  nofork.stream_fork = NULL;
  void *ctx = NULL;
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &ctx));
  nmt_status st = COUNTING.stream_pool(ctx, 2);
  size_t total = 0;
  float *ga = NULL, *gb = NULL, *host = NULL;
  for (int ck = 0; ck < 2 && st == NMT_OK && !nmt_test_failed(); ck++) {
    nmt_model_cfg c = small_cfg(ck ? NMT_NORM_PRE : NMT_NORM_POST, ck, 1);
    total = nmt_model_num_params(&c) + NMT_GRAD_EXTRA;
    free(ga);
    free(gb);
    free(host);
    ga = malloc(total * sizeof *ga);
    gb = malloc(total * sizeof *gb);
    host = make_params(&c, 12);
    if (!ga || !gb || !host) {
      st = NMT_ERR_NOMEM;
      break;
    }
    rig r = {0}, rn = {0};
    dev_batch d = {0};
    st = rig_create(&r, &COUNTING, ctx, &c, host, 64, 12);
    if (st == NMT_OK) st = rig_create(&rn, &nofork, ctx, &c, host, 64, 12);
    if (st == NMT_OK) st = make_batch(&d, REF, NULL, 4, 9, 11, c.vocab, 8);
    memset(&SL, 0, sizeof SL);
    if (st == NMT_OK) st = rig_step(&r, &d, 1, 2, NULL, ga);
    /* self-attentions: forward and backward, plus the re-run with checkpointing */
    int n_self = c.enc_layers + c.dec_layers, want = (ck ? 3 : 2) * n_self;
    if (st == NMT_OK) {
      printf("# checkpointing %d: %d forks, %d joins, uses %d/%d/%d, %d main-stream ops and %d "
             "other ops inside forks, %d cross-stream conflicts\n",
             ck, SL.forks, SL.joins, SL.uses[0], SL.uses[1], SL.uses[2], SL.main_op_in_fork,
             SL.other_op_in_fork, SL.conflicts);
      if (SL.forks != want || SL.joins != want || SL.forked || SL.uses[0] != want ||
          SL.uses[1] != want || SL.uses[2] != want || SL.bad_use || SL.main_op_in_fork ||
          SL.other_op_in_fork || SL.conflicts || SL.access_overflow)
        nmt_test_fail(__FILE__, __LINE__,
                      "stream bookkeeping (want %d forks, joins and uses of each stream, nothing "
                      "else): forks %d joins %d uses %d/%d/%d bad_use %d overflow %d",
                      want, SL.forks, SL.joins, SL.uses[0], SL.uses[1], SL.uses[2], SL.bad_use,
                      SL.access_overflow);
    }
    memset(&SL, 0, sizeof SL);
    if (st == NMT_OK) st = rig_step(&rn, &d, 1, 2, NULL, gb);
    if (st == NMT_OK && !nmt_test_failed()) {
      if (SL.forks || SL.joins || SL.uses[0] || SL.uses[1] || SL.uses[2] || SL.bad_use)
        nmt_test_fail(__FILE__, __LINE__, "without stream_fork the model still used streams");
      else if (memcmp(ga, gb, total * sizeof *ga))
        nmt_test_fail(__FILE__, __LINE__, "in turn vs on streams: gradients differ");
    }
    batch_free(&d);
    rig_free(&r);
    rig_free(&rn);
  }
  if (st != NMT_OK) nmt_test_fail(__FILE__, __LINE__, "step failed: %s", nmt_last_error());
  free(ga);
  free(gb);
  free(host);
  nmt_ref_ctx_destroy(ctx);
}

/* ------------------------------------------------------------------------------------------ */
/* through the trainer: buckets reduced from the ready callbacks, several workers */

/* Runs cfg to the end; copies rank 0's last reduced gradient and the final parameters. */
static nmt_status train_copy(const nmt_config *cfg, float **grads, float **params, size_t *ng,
                             size_t *np) {
  nmt_trainer *t;
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  o.keep_last_grads = 1;
  NMT_TRY(nmt_trainer_create(cfg, &o, &t));
  nmt_status s = nmt_trainer_run(t);
  if (s == NMT_OK) {
    const float *g = nmt_trainer_last_grads(t, 0, ng);
    const float *p = nmt_trainer_params(t, np);
    *grads = malloc(*ng * sizeof(float));
    *params = malloc(*np * sizeof(float));
    if (!*grads || !*params) s = nmt_errorf(NMT_ERR_NOMEM, "test: trainer copies");
    else {
      memcpy(*grads, g, *ng * sizeof(float));
      memcpy(*params, p, *np * sizeof(float));
    }
  }
  nmt_trainer_destroy(t);
  return s;
}

/* Two CPU workers, two micro-batches per step, buckets of ~1300 floats (so every layer's
 * ready call reduces something), dropout on: checkpointing gives bitwise the same reduced
 * gradient and parameters after 3 steps; qkv = streams the same within the streams tolerance
 * (1e-5 of the largest values; Adam's eps is raised so that rounding noise in gradients that
 * are exactly 0 in theory does not become a full-size step, as in test_engine.c). */
NMT_TEST(act_ckpt_trainer_end_to_end) {
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 96, 5));
  float *g[3] = {0}, *p[3] = {0};
  size_t ng = 0, np = 0;
  for (int k = 0; k < 3 && !nmt_test_failed(); k++) {
    nmt_config c;
    char out[600];
    snprintf(out, sizeof out, "%s/run%d", dir, k);
    nmt_th_tiny_config(&c, out, shard);
    c.model_dec_layers = 3;
    c.model_dropout = c.model_attn_dropout = c.model_relu_dropout = 0.1f;
    c.train_max_steps = 3;
    c.train_warmup_steps = 4000; /* the paper's: small steps keep the runs comparable */
    c.train_adam_eps = 1e-3f;
    c.parallel_devices = 2;
    c.train_accum_steps = 2;
    c.parallel_bucket_mb = 0.005f;
    c.run_seed = 3;
    c.train_checkpoint_activations = k >= 1;
    c.parallel_qkv = k == 2 ? NMT_QKV_STREAMS : NMT_QKV_FUSED;
    nmt_status st = train_copy(&c, &g[k], &p[k], &ng, &np);
    if (st != NMT_OK) nmt_test_fail(__FILE__, __LINE__, "run %d: %s", k, nmt_last_error());
  }
  if (!nmt_test_failed()) {
    size_t i = first_diff(g[0], g[1], ng), j = first_diff(p[0], p[1], np);
    if (!(g[0][np + NMT_GRAD_SLOT_TOKENS] > 20))
      nmt_test_fail(__FILE__, __LINE__, "degenerate run: %g tokens",
                    g[0][np + NMT_GRAD_SLOT_TOKENS]);
    else if (i < ng || j < np)
      nmt_test_fail(__FILE__, __LINE__,
                    "checkpointing changed the training: grad %zu (%.9g vs %.9g), param %zu", i,
                    i < ng ? g[1][i] : 0.0f, i < ng ? g[0][i] : 0.0f, j);
  }
  if (!nmt_test_failed()) {
    double mg = 0, mp = 0;
    for (size_t i = 0; i < np; i++) mg = fmax(mg, fabs(g[0][i])), mp = fmax(mp, fabs(p[0][i]));
    if (nmt_test_close(__FILE__, __LINE__, "qkv streams: reduced grads", g[2], g[0], np,
                       1e-5 * mg, 1e-5))
      nmt_test_close(__FILE__, __LINE__, "qkv streams: params", p[2], p[0], np, 1e-5 * mp, 1e-5);
  }
  for (int k = 0; k < 3; k++) free(g[k]), free(p[k]);
}

/* ------------------------------------------------------------------------------------------ */
/* the CUDA backend (skipped without a device)
 *
 * Checkpointing re-runs the same kernels on the same buffers, and cuBLASLt's algorithm is
 * fixed per shape within a run (test_cuda_model.c's two bitwise runs rely on the same), so it
 * must stay bitwise there too. Streams vs fused: the split GEMMs have other shapes, for which
 * cuBLASLt may choose algorithms with other summation orders, so the tolerance is
 * test_cuda_model.c's fp32 one, 1e-4. */

static const nmt_backend *cuda_device(void) {
  const nmt_backend *be = nmt_backend_cuda_get();
  int n = 0;
  return be && be->device_count(&n) == NMT_OK && n > 0 ? be : NULL;
}

static void cuda_case(nmt_norm_kind norm) {
  const nmt_backend *be = cuda_device();
  if (!be) NMT_SKIP("no CUDA device");
  static const int shapes[][3] = {{4, 9, 11}, {3, 12, 5}, {16, 4, 4}};
  const char *what = norm == NMT_NORM_PRE ? "cuda pre" : "cuda post";
  nmt_model_cfg c = small_cfg(norm, 0, 0);
  size_t total = nmt_model_num_params(&c) + NMT_GRAD_EXTRA;
  void *ctx = NULL;
  rig r[4]; /* index = 2 * qkv_streams + checkpoint_activations */
  memset(r, 0, sizeof r);
  float *host = make_params(&c, 10), *ga = malloc(total * sizeof *ga),
        *gb = malloc(total * sizeof *gb);
  nmt_status st = host && ga && gb ? be->ctx_create(0, &ctx) : NMT_ERR_NOMEM;
  if (st == NMT_OK) st = be->set_precision(ctx, NMT_PRECISION_FP32);
  if (st == NMT_OK && be->stream_pool) st = be->stream_pool(ctx, 2);
  for (int k = 0; k < 4 && st == NMT_OK; k++) {
    nmt_model_cfg ck = small_cfg(norm, k & 1, k >> 1);
    st = rig_create(&r[k], be, ctx, &ck, host, 64, 12);
  }
  if (st != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "%s: setup failed: %s", what, nmt_last_error());
    goto out;
  }
  for (int s = 0; s < 3; s++) {
    if (!compare_step(&r[0], &r[1], shapes[s][0], shapes[s][1], shapes[s][2], (uint64_t)s + 1,
                      what) ||
        !compare_step(&r[2], &r[3], shapes[s][0], shapes[s][1], shapes[s][2], (uint64_t)s + 1,
                      what))
      goto out;
    dev_batch d;
    st = make_batch(&d, be, ctx, shapes[s][0], shapes[s][1], shapes[s][2], c.vocab,
                    60 + (uint64_t)s);
    if (st == NMT_OK) st = rig_step(&r[1], &d, 3, 9, NULL, ga);
    if (st == NMT_OK) st = rig_step(&r[3], &d, 3, 9, NULL, gb);
    batch_free(&d);
    if (st != NMT_OK) {
      nmt_test_fail(__FILE__, __LINE__, "%s: step failed: %s", what, nmt_last_error());
      goto out;
    }
    double w = compare_close(&c, gb, ga, 1e-4, what);
    if (w < 0) goto out;
    printf("# %s %dx%d/%d: checkpointing bitwise; streams vs fused worst %.2e of max|g|\n", what,
           shapes[s][0], shapes[s][1], shapes[s][2], w);
  }
out:
  for (int k = 0; k < 4; k++) rig_free(&r[k]);
  if (ctx) be->ctx_destroy(ctx);
  free(host);
  free(ga);
  free(gb);
}

NMT_TEST(cuda_act_ckpt_post) { cuda_case(NMT_NORM_POST); }
NMT_TEST(cuda_act_ckpt_pre) { cuda_case(NMT_NORM_PRE); }
