/* test/test_model_windows.c — the model's gradient windows (nmt_model_backward_sink, for ZeRO
 * stage 2; include/nmt/model.h): one training step through a sink gives nmt_model_backward's
 * gradients stage by stage, the sink sees nmt_model_grad_stages' ranges in backward order (the
 * tied embedding's window open first and closed last, the others one at a time between), and
 * nmt_model_backward's ready
 * prefixes are those stages' ends. On the reference backend, post-LN and pre-LN, with
 * checkpointing and Q/K/V streams; the CUDA variant skips without a device. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "nmt/data.h"
#include "nmt/model.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "test.h"

/* A test sink: a fresh zeroed window per open, copied into a host copy of the flat layout at
 * its close, and the sequence of ranges opened. The first window (the embedding's) is held
 * in its own buffer while the others open and close one at a time in the second. */
typedef struct {
  const nmt_backend *be;
  void *ctx;
  float *window[2];   /* device: n_params floats each (the largest stage fits) */
  float *host;        /* n_params floats: the windows' values at their offsets */
  float *tmp;
  size_t n_params;
  size_t opened[64][2];
  int slot[64];       /* the buffer window i was given */
  int n, open[2];     /* open[k]: the index of the window open in buffer k, + 1 (0: none) */
} sink_log;

static nmt_status log_open(void *user, size_t begin, size_t end, float **window) {
  sink_log *l = user;
  const int k = l->n == 0 ? 0 : 1;
  if (l->open[k] || l->n >= 64 || end > l->n_params || end <= begin || (k && !l->open[0]))
    return nmt_errorf(NMT_ERR_INTERNAL, "test sink: open [%zu, %zu) (open %d %d, %d windows)",
                      begin, end, l->open[0], l->open[1], l->n);
  NMT_TRY(l->be->memset_zero(l->ctx, l->window[k], (end - begin) * sizeof(float)));
  l->opened[l->n][0] = begin, l->opened[l->n][1] = end, l->slot[l->n] = k;
  l->n++, l->open[k] = l->n;
  *window = l->window[k];
  return NMT_OK;
}

static nmt_status log_close(void *user, size_t begin, size_t end) {
  sink_log *l = user;
  const int k = l->open[1] ? 1 : 0, i = l->open[k] - 1;
  if (i < 0 || l->opened[i][0] != begin || l->opened[i][1] != end)
    return nmt_errorf(NMT_ERR_INTERNAL, "test sink: close [%zu, %zu) not the last window opened",
                      begin, end);
  l->open[k] = 0;
  NMT_TRY(l->be->copy_d2h(l->ctx, l->tmp, l->window[k], (end - begin) * sizeof(float)));
  for (size_t j = begin; j < end; j++) l->host[j] += l->tmp[j - begin];
  return NMT_OK;
}

typedef struct {
  size_t prefix[64];
  int n;
} prefix_log;

static nmt_status log_ready(void *user, size_t n) {
  prefix_log *l = user;
  if (l->n < 64) l->prefix[l->n++] = n;
  return NMT_OK;
}

/* A padded batch of B sentences (one full-length per side), tokens in [4, V). */
static nmt_status sink_batch(const nmt_backend *be, void *ctx, int B, int Ts, int Tt, int V,
                             int32_t **mem, nmt_batch *out) {
  const int T = Ts > Tt ? Ts : Tt;
  const size_t n_ints = nmt_batch_ints(B, T);
  int32_t *host = calloc(n_ints, sizeof *host);
  if (!host) return nmt_errorf(NMT_ERR_NOMEM, "test batch");
  nmt_batch h;
  nmt_batch_layout(&h, host, B, Ts, Tt);
  uint64_t k = 0;
  for (int i = 0; i < B; i++) {
    const int sl = i == 0 ? Ts : 1 + (int)(nmt_rng_u32(3, 1, k++) % (uint32_t)Ts);
    const int tl = i == B - 1 ? Tt : 1 + (int)(nmt_rng_u32(3, 1, k++) % (uint32_t)Tt);
    h.src_lens[i] = sl, h.tgt_lens[i] = tl;
    for (int j = 0; j < Ts; j++)
      h.src[i * Ts + j] = j < sl ? 4 + (int32_t)(nmt_rng_u32(3, 2, k++) % (uint32_t)(V - 4))
                                 : NMT_PAD_ID;
    for (int j = 0; j < Tt; j++)
      h.tgt_out[i * Tt + j] =
          j < tl ? 4 + (int32_t)(nmt_rng_u32(3, 3, k++) % (uint32_t)(V - 4)) : NMT_PAD_ID;
    for (int j = 0; j < Tt; j++)
      h.tgt_in[i * Tt + j] = j >= tl ? NMT_PAD_ID : j == 0 ? NMT_BOS_ID : h.tgt_out[i * Tt + j - 1];
    h.src_tokens += sl, h.tgt_tokens += tl;
  }
  nmt_status st = be->malloc(ctx, n_ints * sizeof(int32_t), (void **)mem);
  if (st == NMT_OK) st = be->copy_h2d(ctx, *mem, host, n_ints * sizeof(int32_t));
  if (st == NMT_OK) {
    nmt_batch_layout(out, *mem, B, Ts, Tt);
    out->src_tokens = h.src_tokens, out->tgt_tokens = h.tgt_tokens;
  }
  free(host);
  return st;
}

/* One training step of cfg on (be, ctx) through the flat buffer and through a sink: the ready
 * prefixes are the stages' ends, the sink sees the embedding's window first, then the other
 * stages in backward order one at a time, then the embedding's close, and the gradients agree
 * within `tol` of each stage's scale (0: bitwise), the embedding's included. */
static void sink_vs_flat(const nmt_backend *be, void *ctx, const nmt_model_cfg *cfg, double tol,
                         const char *what) {
  const size_t n = nmt_model_num_params(cfg);
  const int ns = nmt_model_grad_stages(cfg, NULL);
  size_t bounds[32];
  NMT_ASSERT(ns > 0 && ns < 32);
  nmt_model_grad_stages(cfg, bounds);
  nmt_model *m = NULL;
  float *params = NULL, *grads = NULL, *hp = malloc(n * sizeof(float));
  float *flat = malloc((n + NMT_GRAD_EXTRA) * sizeof(float));
  sink_log sl = {.be = be, .ctx = ctx, .n_params = n, .host = calloc(n, sizeof(float)),
                 .tmp = malloc(n * sizeof(float))};
  prefix_log pl = {0};
  int32_t *bmem = NULL;
  nmt_batch b;
  nmt_status st = hp && flat && sl.host && sl.tmp ? NMT_OK : NMT_ERR_NOMEM;
  if (st == NMT_OK) st = nmt_model_create(cfg, be, ctx, 64, 12, &m);
  if (st == NMT_OK) st = be->malloc(ctx, n * sizeof(float), (void **)&params);
  if (st == NMT_OK) st = be->malloc(ctx, (n + NMT_GRAD_EXTRA) * sizeof(float), (void **)&grads);
  for (int k = 0; k < 2; k++)
    if (st == NMT_OK) st = be->malloc(ctx, n * sizeof(float), (void **)&sl.window[k]);
  if (st == NMT_OK) {
    nmt_model_init_params(cfg, 5, hp);
    for (size_t i = 0; i < n; i++) hp[i] += 0.2f * (nmt_rng_uniform(5, 77, i) - 0.5f);
    st = be->copy_h2d(ctx, params, hp, n * sizeof(float));
  }
  if (st == NMT_OK) st = sink_batch(be, ctx, 5, 9, 11, cfg->vocab, &bmem, &b);
  if (st == NMT_OK) st = be->memset_zero(ctx, grads, (n + NMT_GRAD_EXTRA) * sizeof(float));
  if (st == NMT_OK) st = nmt_model_forward(m, params, &b, 1, 9, 3, grads + n);
  if (st == NMT_OK) st = nmt_model_backward(m, params, grads, &b, log_ready, &pl);
  if (st == NMT_OK) st = be->copy_d2h(ctx, flat, grads, (n + NMT_GRAD_EXTRA) * sizeof(float));
  const nmt_grad_sink sink = {log_open, log_close, &sl};
  if (st == NMT_OK) st = be->memset_zero(ctx, grads, (n + NMT_GRAD_EXTRA) * sizeof(float));
  if (st == NMT_OK) st = nmt_model_forward(m, params, &b, 1, 9, 3, grads + n);
  if (st == NMT_OK) st = nmt_model_backward_sink(m, params, &b, &sink);
  if (st != NMT_OK) nmt_test_fail(__FILE__, __LINE__, "%s: %s", what, nmt_last_error());
  /* Ready prefixes: every stage's end but the embedding's, then the trailing slots. */
  if (st == NMT_OK && pl.n != ns) {
    nmt_test_fail(__FILE__, __LINE__, "%s: %d ready calls for %d stages", what, pl.n, ns);
  } else if (st == NMT_OK) {
    for (int i = 0; i < ns && !nmt_test_failed(); i++) {
      const size_t want = i + 1 < ns ? bounds[i + 1] : n + NMT_GRAD_EXTRA;
      if (pl.prefix[i] != want)
        nmt_test_fail(__FILE__, __LINE__, "%s: ready call %d: %zu, stage end %zu", what, i,
                      pl.prefix[i], want);
    }
  }
  /* Windows: the embedding's (held), then every other stage in backward order. */
  const int embed = ns - 1;
  int want[40], nw = 0;
  want[nw++] = embed;
  for (int i = 0; i < embed; i++) want[nw++] = i;
  if (!nmt_test_failed() && (sl.n != nw || sl.open[0] || sl.open[1]))
    nmt_test_fail(__FILE__, __LINE__, "%s: %d windows (open at the end: %d %d), expected %d",
                  what, sl.n, sl.open[0], sl.open[1], nw);
  for (int i = 0; i < nw && !nmt_test_failed(); i++)
    if (sl.opened[i][0] != bounds[want[i]] || sl.opened[i][1] != bounds[want[i] + 1])
      nmt_test_fail(__FILE__, __LINE__, "%s: window %d is [%zu, %zu), expected stage %d [%zu, "
                    "%zu)", what, i, sl.opened[i][0], sl.opened[i][1], want[i], bounds[want[i]],
                    bounds[want[i] + 1]);
  if (!nmt_test_failed()) {
    const size_t e0 = bounds[embed];
    double scale = 0, escale = nmt_tg_max_abs(flat + e0, n - e0);
    for (size_t i = 0; i < e0; i++) scale = fmax(scale, fabs(flat[i]));
    int nonzero = 0;
    for (size_t i = 0; i < n; i++) nonzero += flat[i] != 0;
    printf("# %s: %d windows; layers: max |grad| %.3g\n", what, sl.n, scale);
    if (nonzero < (int)(n / 2))
      nmt_test_fail(__FILE__, __LINE__, "%s: degenerate gradient (%d of %zu nonzero)", what,
                    nonzero, n);
    else if (nmt_test_close(__FILE__, __LINE__, what, sl.host, flat, e0, tol * scale, tol))
      nmt_test_close(__FILE__, __LINE__, "embedding", sl.host + e0, flat + e0, n - e0,
                     tol * escale, tol);
  }
  if (bmem) be->free(ctx, bmem);
  for (int k = 0; k < 2; k++)
    if (sl.window[k]) be->free(ctx, sl.window[k]);
  if (grads) be->free(ctx, grads);
  if (params) be->free(ctx, params);
  nmt_model_destroy(m);
  free(hp), free(flat), free(sl.host), free(sl.tmp);
}

static nmt_model_cfg sink_cfg(nmt_norm_kind norm, int ckpt, int streams) {
  return (nmt_model_cfg){.vocab = 41, .d_model = 16, .n_heads = 4, .d_ff = 24,
                         .enc_layers = 2, .dec_layers = 3, .max_positions = 16,
                         .dropout = 0.1f, .attn_dropout = 0.15f, .relu_dropout = 0.2f,
                         .label_smoothing = 0.1f, .norm = norm, .ln_eps = 1e-5f,
                         .checkpoint_activations = ckpt, .qkv_streams = streams};
}

/* On the reference every stage is bitwise the flat buffer's, the embedding's included: the same
 * ops accumulate into a zeroed window instead of a zeroed slice of the buffer, the embedding's
 * three parts in the same order. Post-LN and pre-LN
 * (whose ln_f stages exist), with checkpointing and Q/K/V streams too. */
NMT_TEST(model_windows_match_flat_buffer) {
  void *ctx = NULL;
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &ctx));
  nmt_status st = nmt_backend_ref.stream_pool ? nmt_backend_ref.stream_pool(ctx, 2) : NMT_OK;
  if (st == NMT_OK) {
    const nmt_norm_kind norms[] = {NMT_NORM_POST, NMT_NORM_PRE};
    for (int i = 0; i < 4 && !nmt_test_failed(); i++) {
      const nmt_model_cfg c = sink_cfg(norms[i % 2], i / 2, i / 2);
      char what[64];
      snprintf(what, sizeof what, "ref %s-LN%s", i % 2 ? "pre" : "post",
               i / 2 ? ", checkpointing, qkv streams" : "");
      sink_vs_flat(&nmt_backend_ref, ctx, &c, 0.0, what);
    }
  } else {
    nmt_test_fail(__FILE__, __LINE__, "stream pool: %s", nmt_last_error());
  }
  nmt_ref_ctx_destroy(ctx);
}

/* The same on the CUDA backend: a window's alignment may make cuBLASLt pick another GEMM
 * algorithm than at the flat buffer's offset, so within 1e-5 of each tensor's scale. */
NMT_TG_TEST(cuda_model_windows_match_flat_buffer) {
  const nmt_backend *be = g->be;
  if (be->set_precision(g->ctx, NMT_PRECISION_FP32) != NMT_OK ||
      (be->stream_pool && be->stream_pool(g->ctx, 2) != NMT_OK)) {
    nmt_test_fail(__FILE__, __LINE__, "fp32 context with a stream pool: %s", nmt_last_error());
    return;
  }
  for (int i = 0; i < 4 && !nmt_test_failed(); i++) {
    const nmt_model_cfg c = sink_cfg(i % 2 ? NMT_NORM_PRE : NMT_NORM_POST, i / 2, i / 2);
    char what[64];
    snprintf(what, sizeof what, "cuda %s-LN%s", i % 2 ? "pre" : "post",
             i / 2 ? ", checkpointing, qkv streams" : "");
    sink_vs_flat(be, g->ctx, &c, 1e-5, what);
  }
}
