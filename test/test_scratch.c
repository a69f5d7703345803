/* test/test_scratch.c — no allocation inside a step (issue 15): the scratch plan
 * (nmt_model_scratch_plan, reserved by nmt_model_create through the table's reserve_scratch)
 * covers every op call of training, evaluation and decoding, so the reference backend's growth
 * counter (the `counters` entry) stays at zero after setup, over many batch shapes, through
 * the model directly and through the trainer on CPU workers; a call the plan does not cover is
 * counted and logged (so the zero can fail). And the GEMM launch count per micro-batch
 * (nmt_backend_counters.gemm_calls) for conf/base.ini's layers and heads, before and after
 * attention became one batched GEMM per product. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/log.h"
#include "nmt/model.h"
#include "nmt/ref.h"
#include "nmt/rng.h"
#include "nmt/trainer.h"
#include "test.h"

/* ---- log capture: counts warn lines about scratch growth ---- */

typedef struct {
  pthread_mutex_t mu;
  int growth_lines;
  char first[256];
} log_catch;

/* Installs the sink at warn level (the runner silences the log); end_catch restores both. */
static nmt_log_level begin_catch(const nmt_log_sink *sink) {
  nmt_log_level saved = nmt_log_get_level();
  nmt_log_set_level(NMT_LOG_WARN);
  nmt_log_set_sink(sink);
  return saved;
}

static void end_catch(nmt_log_level saved) {
  nmt_log_set_sink(NULL);
  nmt_log_set_level(saved);
}

static void catch_line(void *user, nmt_log_level level, const char *line) {
  log_catch *c = user;
  if (level != NMT_LOG_WARN || !strstr(line, "inside a step")) return;
  pthread_mutex_lock(&c->mu);
  if (c->growth_lines++ == 0) snprintf(c->first, sizeof c->first, "%s", line);
  pthread_mutex_unlock(&c->mu);
}

/* ---- a model on a reference context, fed random batches of varying shape ---- */

typedef struct {
  nmt_model_cfg cfg;
  void *ctx;
  nmt_model *m;
  size_t n_params;
  float *params, *grads;
  int32_t *buf;
  int max_tokens, max_len;
} srig;

static const nmt_backend *const BE = &nmt_backend_ref;

static nmt_status srig_create(srig *r, nmt_precision mode, int streams, int ckpt,
                              nmt_norm_kind norm, int act_half) {
  memset(r, 0, sizeof *r);
  nmt_model_cfg *c = &r->cfg;
  c->vocab = 37, c->d_model = 16, c->n_heads = 4, c->d_ff = 40, c->enc_layers = 2;
  c->dec_layers = 2, c->max_positions = 64, c->dropout = 0.1f, c->attn_dropout = 0.1f;
  c->relu_dropout = 0.1f, c->label_smoothing = 0.1f, c->norm = norm, c->ln_eps = 1e-5f;
  c->qkv_streams = streams, c->checkpoint_activations = ckpt, c->act_half = act_half;
  r->max_tokens = 48, r->max_len = 12;
  r->n_params = nmt_model_num_params(c);
  NMT_TRY(BE->ctx_create(0, &r->ctx));
  NMT_TRY(BE->set_precision(r->ctx, mode));
  NMT_TRY(BE->stream_pool(r->ctx, 2));
  NMT_TRY(nmt_model_create(c, BE, r->ctx, r->max_tokens, r->max_len, &r->m));
  r->params = malloc(r->n_params * sizeof(float));
  r->grads = malloc((r->n_params + NMT_GRAD_EXTRA) * sizeof(float));
  r->buf = malloc(nmt_batch_ints(r->max_tokens, r->max_len) * sizeof(int32_t));
  if (!r->params || !r->grads || !r->buf) return nmt_errorf(NMT_ERR_NOMEM, "test: no memory");
  nmt_model_init_params(c, 5, r->params);
  return NMT_OK;
}

static void srig_free(srig *r) {
  nmt_model_destroy(r->m);
  BE->ctx_destroy(r->ctx);
  free(r->params), free(r->grads), free(r->buf);
  memset(r, 0, sizeof *r);
}

/* Batch k: B sentences padded to Ts / Tt (B * max(Ts, Tt) <= max_tokens), random lengths,
 * one sentence of each side at full length. */
static void srig_batch(srig *r, uint64_t k, nmt_batch *b) {
  const int Ts = 1 + (int)(nmt_rng_u32(17, k, 0) % (uint32_t)r->max_len);
  const int Tt = 1 + (int)(nmt_rng_u32(17, k, 1) % (uint32_t)r->max_len);
  const int T = Ts > Tt ? Ts : Tt, maxB = r->max_tokens / T;
  const int B = 1 + (int)(nmt_rng_u32(17, k, 2) % (uint32_t)maxB);
  memset(b, 0, sizeof *b);
  nmt_batch_layout(b, r->buf, B, Ts, Tt);
  uint64_t e = 3;
  for (int i = 0; i < B; i++) {
    const int sl = i == 0 ? Ts : 1 + (int)(nmt_rng_u32(17, k, e++) % (uint32_t)Ts);
    const int tl = i == 0 ? Tt : 1 + (int)(nmt_rng_u32(17, k, e++) % (uint32_t)Tt);
    b->src_lens[i] = sl, b->tgt_lens[i] = tl;
    for (int j = 0; j < Ts; j++)
      b->src[i * Ts + j] = j < sl ? 4 + (int32_t)(nmt_rng_u32(18, k, e++) % 33) : NMT_PAD_ID;
    for (int j = 0; j < Tt; j++) {
      b->tgt_in[i * Tt + j] =
          j >= tl ? NMT_PAD_ID : j == 0 ? NMT_BOS_ID : 4 + (int32_t)(nmt_rng_u32(19, k, e++) % 33);
      b->tgt_out[i * Tt + j] = j < tl ? 4 + (int32_t)(nmt_rng_u32(20, k, e++) % 33) : NMT_PAD_ID;
      b->tgt_tokens += j < tl;
    }
    b->src_tokens += sl;
  }
}

/* 50 training micro-batches (forward + backward) of varying shape, an eval pass every tenth and
 * two greedy decodes: the growth counter must not move after nmt_model_create. */
static void no_growth_case(nmt_precision mode, int streams, int ckpt, nmt_norm_kind norm,
                           int act_half) {
  srig r;
  nmt_status st = srig_create(&r, mode, streams, ckpt, norm, act_half);
  nmt_backend_counters c0 = {0}, c1 = {0};
  if (st == NMT_OK) st = BE->counters(r.ctx, &c0);
  int32_t ids[48 * 8], lens[48];
  for (uint64_t k = 0; k < 50 && st == NMT_OK; k++) {
    nmt_batch b;
    srig_batch(&r, k, &b);
    st = BE->memset_zero(r.ctx, r.grads, (r.n_params + NMT_GRAD_EXTRA) * sizeof(float));
    if (st == NMT_OK) st = nmt_model_forward(r.m, r.params, &b, 1, 9, k + 1, r.grads + r.n_params);
    if (st == NMT_OK) st = nmt_model_backward(r.m, r.params, r.grads, &b, NULL, NULL);
    const float *logits;
    /* Half storage: an eval forward instead (its logits are half; decoding keeps fp32). */
    if (st == NMT_OK && k % 10 == 9)
      st = act_half ? nmt_model_forward(r.m, r.params, &b, 0, 0, 0, r.grads + r.n_params)
                    : nmt_model_logits(r.m, r.params, &b, &logits);
    if (st == NMT_OK && k % 25 == 24 && !act_half)
      st = nmt_model_greedy(r.m, r.params, &b, 8, 4, ids, lens);
  }
  if (st == NMT_OK) st = BE->counters(r.ctx, &c1);
  if (st != NMT_OK)
    nmt_test_fail(__FILE__, __LINE__, "failed: %s", nmt_last_error());
  else if (c1.scratch_growths != c0.scratch_growths)
    nmt_test_fail(__FILE__, __LINE__,
                  "%llu scratch growth(s) after setup (mode %d, qkv_streams %d, checkpointing %d)",
                  (unsigned long long)(c1.scratch_growths - c0.scratch_growths), (int)mode,
                  streams, ckpt);
  else if (c1.gemm_calls <= c0.gemm_calls)
    nmt_test_fail(__FILE__, __LINE__, "no GEMM call counted");
  srig_free(&r);
}

NMT_TEST(scratch_model_fp32_no_growth) {
  no_growth_case(NMT_PRECISION_FP32, 0, 0, NMT_NORM_POST, 0);
}
/* bf16: the rounded GEMM inputs live in scratch too; the Q/K/V blocks run on the aux streams
 * and checkpointing re-runs the forward inside backward. */
NMT_TEST(scratch_model_bf16_streams_ckpt_no_growth) {
  no_growth_case(NMT_PRECISION_BF16, 1, 1, NMT_NORM_PRE, 0);
}
/* Half storage (precision.activations = half): the half ops' working copies are planned too,
 * in both norms, with and without the stream split and checkpointing. */
NMT_TEST(scratch_model_half_storage_no_growth) {
  no_growth_case(NMT_PRECISION_BF16, 0, 0, NMT_NORM_POST, 1);
  no_growth_case(NMT_PRECISION_FP16, 1, 1, NMT_NORM_PRE, 1);
  no_growth_case(NMT_PRECISION_BF16, 1, 0, NMT_NORM_POST, 1);
  no_growth_case(NMT_PRECISION_FP16, 0, 1, NMT_NORM_POST, 1);
}

/* A call larger than the reserved plan grows the scratch: counted, and logged at warn level
 * once a plan was reserved; the same call again does not grow it twice. Without any plan the
 * growth is counted but not logged (ops called directly, as the op tests do). */
NMT_TEST(scratch_growth_counted_and_logged) {
  log_catch lc = {.mu = PTHREAD_MUTEX_INITIALIZER};
  const nmt_log_sink sink = {catch_line, &lc};
  enum { B = 2, H = 2, T = 4, dk = 3, C = H * dk };
  float q[B * T * 3 * C], out[B * T * C], probs[B * H * T * T];
  const int32_t lens[B] = {4, 3};
  for (int i = 0; i < B * T * 3 * C; i++) q[i] = (float)((i * 7) % 11) * 0.1f - 0.5f;
  void *ctx = NULL, *bare = NULL;
  nmt_backend_counters c = {0};
  NMT_ASSERT_OK(BE->ctx_create(0, &ctx));
  nmt_status st = BE->ctx_create(0, &bare);
  nmt_scratch_plan plan;
  memset(&plan, 0, sizeof plan);
  plan.main.att_scores = 10; /* less than B*H*T*T = 64 */
  if (st == NMT_OK) st = BE->reserve_scratch(ctx, &plan);
  const nmt_log_level saved = begin_catch(&sink);
  for (int i = 0; i < 2 && st == NMT_OK; i++)
    st = BE->attention_fwd(ctx, out, probs, q, 3 * C, q + C, q + 2 * C, 3 * C, lens, B, T, T, H,
                           dk, 1, 0.2f, 1, 2);
  if (st == NMT_OK) st = BE->counters(ctx, &c);
  const int lines_planned = lc.growth_lines;
  nmt_backend_counters cb = {0};
  if (st == NMT_OK)
    st = BE->attention_fwd(bare, out, probs, q, 3 * C, q + C, q + 2 * C, 3 * C, lens, B, T, T, H,
                           dk, 1, 0.2f, 1, 2);
  if (st == NMT_OK) st = BE->counters(bare, &cb);
  end_catch(saved);
  BE->ctx_destroy(ctx);
  BE->ctx_destroy(bare);
  NMT_ASSERT_OK(st);
  /* The dropped weights and the keep mask: two slots grew, once each. */
  NMT_ASSERT_EQ_INT(c.scratch_growths, 2);
  NMT_ASSERT_EQ_INT(lines_planned, 2);
  NMT_ASSERT(strstr(lc.first, "scratch") != NULL);
  NMT_ASSERT_EQ_INT(c.gemm_calls, 4); /* two calls of two products each */
  NMT_ASSERT_EQ_INT(cb.scratch_growths, 2);
  NMT_ASSERT_EQ_INT(lc.growth_lines, 2); /* the bare context's growth was not logged */
}

/* reserve_scratch sizes the fp16/bf16 GEMM copies only in those modes; a later set_precision
 * to bf16 sizes them from the kept plan, so the first bf16 GEMM does not grow anything. */
NMT_TEST(scratch_plan_kept_for_set_precision) {
  enum { M = 6, K = 5, N = 7 };
  float x[M * K], w[N * K], y[M * N];
  for (int i = 0; i < M * K; i++) x[i] = 0.1f * (float)(i % 9);
  for (int i = 0; i < N * K; i++) w[i] = 0.05f * (float)(i % 7);
  void *ctx = NULL;
  nmt_backend_counters c = {0};
  NMT_ASSERT_OK(BE->ctx_create(0, &ctx));
  nmt_scratch_plan plan;
  memset(&plan, 0, sizeof plan);
  plan.main.gemm_rows = M, plan.main.gemm_inp = M * K, plan.main.gemm_w = N * K;
  plan.main.gemm_out = M * N;
  nmt_status st = BE->reserve_scratch(ctx, &plan);
  if (st == NMT_OK) st = BE->set_precision(ctx, NMT_PRECISION_BF16);
  if (st == NMT_OK) st = BE->matmul_fwd(ctx, y, x, w, NULL, M, K, N);
  if (st == NMT_OK) st = BE->counters(ctx, &c);
  BE->ctx_destroy(ctx);
  NMT_ASSERT_OK(st);
  NMT_ASSERT_EQ_INT(c.scratch_growths, 0);
  NMT_ASSERT_EQ_INT(c.gemm_calls, 1);
}

/* ---- through the trainer: 2 CPU workers, 50 steps over the synthetic corpus (sentences of 2
 * to 12 tokens, so batch shapes vary step to step), attention dropout on, every step in the
 * profiling window: the table reports the backend's growth count (0) and GEMM calls per
 * micro-batch, and no growth line is logged. ---- */

static void trainer_case(nmt_device_kind device, int devices) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], out[512], path[600];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(out, sizeof out, "%s/run", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 300, 5));
  nmt_config c;
  nmt_th_tiny_config(&c, out, shard);
  c.model_attn_dropout = 0.1f;
  c.model_dropout = 0.1f;
  c.parallel_device = device;
  c.parallel_devices = devices;
  c.train_max_steps = 50;
  c.train_log_every = 50;
  c.profile_start_step = 1;
  c.profile_stop_step = 50;
  c.profile_table = 1;
  c.profile_peak_tflops = 1;
  c.profile_peak_gbps = 10;
  log_catch lc = {.mu = PTHREAD_MUTEX_INITIALIZER};
  const nmt_log_sink sink = {catch_line, &lc};
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  nmt_trainer *t = NULL;
  const nmt_log_level saved = begin_catch(&sink);
  nmt_status st = nmt_trainer_create(&c, &o, &t);
  if (st == NMT_OK) st = nmt_trainer_run(t);
  nmt_trainer_destroy(t);
  end_catch(saved);
  NMT_ASSERT_OK(st);
  if (lc.growth_lines)
    nmt_test_fail(__FILE__, __LINE__, "%d scratch growth line(s), first: %s", lc.growth_lines,
                  lc.first);
  snprintf(path, sizeof path, "%s/profile.txt", out);
  char *txt = nmt_th_read_file(path, NULL);
  NMT_ASSERT(txt != NULL);
  const char *g = strstr(txt, "# GEMM calls per micro-batch: ");
  double calls = g ? atof(g + strlen("# GEMM calls per micro-batch: ")) : 0;
  const char *sg = g ? strstr(g, "scratch growths after setup: ") : NULL;
  long growths = sg ? atol(sg + strlen("scratch growths after setup: ")) : -1;
  free(txt);
  NMT_ASSERT(g != NULL && sg != NULL);
  NMT_ASSERT_EQ_INT(growths, 0);
  /* 2 + 2 layers, fused Q/K/V, post-LN: forward 6*2 + 11*2 + 1, backward 16*2 + 29*2 + 2
   * (the formula of model_gemm_calls_base below). */
  NMT_ASSERT_EQ_INT((long)lround(calls), 35 + 92);
}

NMT_TEST(scratch_trainer_50_steps_no_growth) { trainer_case(NMT_DEVICE_CPU, 2); }

/* The same on one GPU: the CUDA backend's plan covers every op of 50 steps (no cudaMalloc in
 * a step) and its launch counter gives the same logical count. */
NMT_TEST(cuda_scratch_trainer_50_steps_no_growth) {
  const nmt_backend *be = nmt_backend_cuda_get();
  int n = 0;
  if (!be || be->device_count(&n) != NMT_OK || n < 1) NMT_SKIP("no CUDA device");
  trainer_case(NMT_DEVICE_CUDA, 1);
}

/* ---- GEMM launches per micro-batch for conf/base.ini ---- */

/* Attention's share of the launches: the reference table with attention wrapped to sum the
 * counter's growth across its calls (a test-local tally; the library keeps no globals). */
static uint64_t att_gemms;

static nmt_status att_fwd_counted(void *ctx, float *out, float *probs, const float *q, int ldq,
                                  const float *k, const float *v, int ldkv, const int32_t *k_lens,
                                  int B, int Tq, int Tk, int H, int dk, int causal, float p,
                                  uint64_t seed, uint64_t stream) {
  nmt_backend_counters a, b;
  NMT_TRY(nmt_ref_counters(ctx, &a));
  NMT_TRY(nmt_ref_attention_fwd(ctx, out, probs, q, ldq, k, v, ldkv, k_lens, B, Tq, Tk, H, dk,
                                causal, p, seed, stream));
  NMT_TRY(nmt_ref_counters(ctx, &b));
  att_gemms += b.gemm_calls - a.gemm_calls;
  return NMT_OK;
}

static nmt_status att_bwd_counted(void *ctx, float *dq, float *dkey, float *dv, float *dprobs,
                                  const float *dout, const float *probs, const float *q, int ldq,
                                  const float *k, const float *v, int ldkv, const int32_t *k_lens,
                                  int B, int Tq, int Tk, int H, int dk, int causal, float p,
                                  uint64_t seed, uint64_t stream) {
  nmt_backend_counters a, b;
  NMT_TRY(nmt_ref_counters(ctx, &a));
  NMT_TRY(nmt_ref_attention_bwd(ctx, dq, dkey, dv, dprobs, dout, probs, q, ldq, k, v, ldkv,
                                k_lens, B, Tq, Tk, H, dk, causal, p, seed, stream));
  NMT_TRY(nmt_ref_counters(ctx, &b));
  att_gemms += b.gemm_calls - a.gemm_calls;
  return NMT_OK;
}

/* conf/base.ini's model (6 + 6 layers, 8 heads, d_model 512, d_ff 2048, vocab 8000) on the
 * reference backend, whose counter counts the CUDA backend's logical launches: one
 * micro-batch (2 sentences of 8 tokens; the count depends on the layers and heads, not on the
 * batch). After: one batched GEMM per attention product. Before (cuda/attention.cu up to
 * issue 15): one GEMM per head for each product, i.e. n_heads times the attention's share. */
NMT_TEST(model_gemm_calls_base) {
  nmt_config cfg;
  NMT_ASSERT_OK(nmt_config_load("conf/base.ini", NULL, 0, &cfg));
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(&cfg, &mc);
  nmt_backend be = nmt_backend_ref;
  be.attention_fwd = att_fwd_counted;
  be.attention_bwd = att_bwd_counted;
  srig r;
  memset(&r, 0, sizeof r);
  r.cfg = mc;
  r.max_tokens = 16, r.max_len = 8;
  r.n_params = nmt_model_num_params(&mc);
  nmt_backend_counters c0 = {0}, c1 = {0}, c2 = {0};
  nmt_status st = be.ctx_create(0, &r.ctx);
  if (st == NMT_OK) st = nmt_model_create(&mc, &be, r.ctx, r.max_tokens, r.max_len, &r.m);
  r.params = malloc(r.n_params * sizeof(float));
  r.grads = calloc(r.n_params + NMT_GRAD_EXTRA, sizeof(float));
  r.buf = malloc(nmt_batch_ints(r.max_tokens, r.max_len) * sizeof(int32_t));
  if (st == NMT_OK && (!r.params || !r.grads || !r.buf)) st = NMT_ERR_NOMEM;
  nmt_batch b;
  if (st == NMT_OK) {
    nmt_model_init_params(&mc, 3, r.params);
    srig_batch(&r, 0, &b);
    att_gemms = 0;
    st = be.counters(r.ctx, &c0);
  }
  if (st == NMT_OK) st = nmt_model_forward(r.m, r.params, &b, 1, 1, 1, r.grads + r.n_params);
  if (st == NMT_OK) st = be.counters(r.ctx, &c1);
  if (st == NMT_OK) st = nmt_model_backward(r.m, r.params, r.grads, &b, NULL, NULL);
  if (st == NMT_OK) st = be.counters(r.ctx, &c2);
  nmt_model_destroy(r.m);
  be.ctx_destroy(r.ctx);
  free(r.params), free(r.grads), free(r.buf);
  NMT_ASSERT_OK(st);
  const long fwd = (long)(c1.gemm_calls - c0.gemm_calls), bwd = (long)(c2.gemm_calls - c1.gemm_calls);
  const long after = fwd + bwd, att = (long)att_gemms, H = mc.n_heads;
  const long before = after - att + H * att;
  printf("# GEMM calls per micro-batch, conf/base.ini (%d+%d layers, %ld heads): before %ld "
         "(attention %ld = one per head), after %ld (forward %ld, backward %ld; attention %ld): "
         "%.2fx fewer; attention alone %ldx\n",
         mc.enc_layers, mc.dec_layers, H, before, H * att, after, fwd, bwd, att,
         (double)before / (double)after, H);
  /* Per layer: encoder forward qkv + 2 attention + out + fc1 + fc2 = 6, decoder 11; backward
   * 3 per linear layer with a bias (dinp, dw, dbias) and 4 per attention: encoder 16, decoder
   * 29; the generator 1 forward, 2 backward (no bias). */
  const long Le = mc.enc_layers, Ld = mc.dec_layers;
  NMT_ASSERT_EQ_INT(fwd, 6 * Le + 11 * Ld + 1);
  NMT_ASSERT_EQ_INT(bwd, 16 * Le + 29 * Ld + 2);
  NMT_ASSERT_EQ_INT(att, 6 * (Le + 2 * Ld));
}
