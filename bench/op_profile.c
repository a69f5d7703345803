/* bench/op_profile.c — where one nmt training step's time goes, op by op, on the ref backend.
 *
 * usage: op_profile CONFIG --batches BATCHES --params PARAMS [--warmup W] [section.key=value ...]
 *        op_profile --peak
 *
 * --peak measures one core's fp32 FMA throughput (GFLOP/s) with independent chains of 256-bit
 * (AVX2+FMA) and, where the CPU has it, 512-bit (AVX-512F) fused multiply-adds, and prints the
 * larger: the ceiling MFU is quoted against (bench/README.md). It runs at whatever clock the core
 * sustains (boost included), which a nominal "cores x FLOP/cycle x base clock" would miss. It is
 * nmt_prof_cpu_fma_gflops (include/nmt/prof.h), the trainer's MFU denominator per CPU worker.
 *
 * Replays the steps of a bench/dump_batches file on ONE thread (one OpenBLAS thread), the way a
 * single nmt worker with accum_steps = K runs them: per step, zero the gradients, forward +
 * backward of the step's K micro-batches (dropout as the config says, streams keyed as the
 * trainer keys them), sum of squares of the gradient, AdamW. The model is created on a copy of
 * nmt_backend_ref whose every entry is wrapped by a timer; the timers live in the ctx the model
 * passes to every op (the ref ops ignore ctx), so nothing here is global. Reports, over steps
 * W+1..N: per op, calls per step, ms per step, share of the step, and GFLOP/s for the GEMM-shaped
 * ops (matmul: 2*M*K*N forward, 2*M*K*N per requested gradient backward; the logits GEMM, N or
 * K = vocab, is listed apart; attention: its four (resp. eight) batched products).
 *
 * Timing only: nothing here decides a test. Built by bench/cpu-throughput.sh --breakdown.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/model.h"
#include "nmt/prof.h"
#include "nmt/status.h"
#include "nmt/trainer.h"

void openblas_set_num_threads(int num_threads);

enum {
  OP_EMB_F, OP_EMB_B, OP_MM_F, OP_MM_B, OP_MM_RELU_F, OP_LOGITS_F, OP_LOGITS_B, OP_LN_F, OP_LN_B,
  OP_RES_F, OP_RES_B, OP_ATT_F, OP_ATT_B, OP_RELU_F, OP_RELU_B, OP_DROP_F, OP_DROP_B, OP_ADD,
  OP_AXPY, OP_SUM_ACC, OP_SUMSQ, OP_XENT, OP_ADAMW, OP_MEM, OP_COUNT
};
static const char *const op_names[OP_COUNT] = {
    "embedding fwd", "embedding bwd", "matmul fwd", "matmul bwd", "matmul+relu fwd",
    "logits matmul fwd", "logits matmul bwd", "layernorm fwd", "layernorm bwd", "resid+drop+ln fwd",
    "resid+drop+ln bwd", "attention fwd", "attention bwd", "relu fwd", "relu bwd", "dropout fwd",
    "dropout bwd", "add", "axpy", "sum_acc", "sumsq", "xent fwd+bwd", "adamw", "memset/copy"};

typedef struct {
  int vocab;
  int on;          /* accumulate (steps after the warmup) */
  double sec[OP_COUNT], flops[OP_COUNT];
  long calls[OP_COUNT];
} prof;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void tally(void *ctx, int op, double t0, double flops) {
  prof *p = ctx;
  if (!p->on) return;
  p->sec[op] += now_s() - t0;
  p->flops[op] += flops;
  p->calls[op]++;
}

#define REF nmt_backend_ref

static nmt_status w_memset(void *ctx, void *ptr, size_t bytes) {
  double t = now_s();
  nmt_status s = REF.memset_zero(NULL, ptr, bytes);
  tally(ctx, OP_MEM, t, 0);
  return s;
}
static nmt_status w_h2d(void *ctx, void *dst, const void *src, size_t bytes) {
  double t = now_s();
  nmt_status s = REF.copy_h2d(NULL, dst, src, bytes);
  tally(ctx, OP_MEM, t, 0);
  return s;
}
static nmt_status w_d2h(void *ctx, void *dst, const void *src, size_t bytes) {
  double t = now_s();
  nmt_status s = REF.copy_d2h(NULL, dst, src, bytes);
  tally(ctx, OP_MEM, t, 0);
  return s;
}
static nmt_status w_malloc(void *ctx, size_t bytes, void **out) {
  (void)ctx;
  return REF.malloc(NULL, bytes, out);
}
static void w_free(void *ctx, void *ptr) {
  (void)ctx;
  REF.free(NULL, ptr);
}
static nmt_status w_sync(void *ctx) {
  (void)ctx;
  return REF.synchronize(NULL);
}
static nmt_status w_emb_f(void *ctx, float *out, const int32_t *ids, const float *wte,
                          const float *pos, int n_rows, int T, int C, float scale) {
  double t = now_s();
  nmt_status s = REF.embedding_fwd(NULL, out, ids, wte, pos, n_rows, T, C, scale);
  tally(ctx, OP_EMB_F, t, 0);
  return s;
}
static nmt_status w_emb_b(void *ctx, float *dwte, const float *dout, const int32_t *ids,
                          int n_rows, int C, float scale) {
  double t = now_s();
  nmt_status s = REF.embedding_bwd(NULL, dwte, dout, ids, n_rows, C, scale);
  tally(ctx, OP_EMB_B, t, 0);
  return s;
}
static nmt_status w_mm_f(void *ctx, float *out, const float *inp, const float *w,
                         const float *bias, int M, int K, int N) {
  prof *p = ctx;
  double t = now_s();
  nmt_status s = REF.matmul_fwd(NULL, out, inp, w, bias, M, K, N);
  tally(ctx, (N == p->vocab || K == p->vocab) ? OP_LOGITS_F : OP_MM_F, t, 2.0 * M * K * N);
  return s;
}
/* The FFN's fc1 with its ReLU (one op since the CUDA backend fuses them; on ref the two
 * passes run inside it). FLOPs: the GEMM's, as for matmul fwd. */
static nmt_status w_mm_relu_f(void *ctx, float *out, const float *inp, const float *w,
                              const float *bias, int M, int K, int N) {
  double t = now_s();
  nmt_status s = REF.matmul_bias_relu_fwd(NULL, out, inp, w, bias, M, K, N);
  tally(ctx, OP_MM_RELU_F, t, 2.0 * M * K * N);
  return s;
}
static nmt_status w_mm_b(void *ctx, float *dinp, float *dw, float *dbias, const float *dout,
                         const float *inp, const float *w, int M, int K, int N) {
  prof *p = ctx;
  double t = now_s();
  nmt_status s = REF.matmul_bwd(NULL, dinp, dw, dbias, dout, inp, w, M, K, N);
  double f = 2.0 * M * K * N * ((dinp != NULL) + (dw != NULL));
  tally(ctx, (N == p->vocab || K == p->vocab) ? OP_LOGITS_B : OP_MM_B, t, f);
  return s;
}
static nmt_status w_ln_f(void *ctx, float *out, float *mean, float *rstd, const float *inp,
                         const float *gamma, const float *beta, int M, int C, float eps) {
  double t = now_s();
  nmt_status s = REF.layernorm_fwd(NULL, out, mean, rstd, inp, gamma, beta, M, C, eps);
  tally(ctx, OP_LN_F, t, 0);
  return s;
}
static nmt_status w_ln_b(void *ctx, float *dinp, float *dgamma, float *dbeta, const float *dout,
                         const float *inp, const float *gamma, const float *mean,
                         const float *rstd, int M, int C) {
  double t = now_s();
  nmt_status s = REF.layernorm_bwd(NULL, dinp, dgamma, dbeta, dout, inp, gamma, mean, rstd, M, C);
  tally(ctx, OP_LN_B, t, 0);
  return s;
}
static nmt_status w_res_f(void *ctx, float *out, float *sum, float *mean, float *rstd,
                          const float *x, const float *y, const float *gamma, const float *beta,
                          int M, int C, float eps, float p, uint64_t seed, uint64_t stream) {
  double t = now_s();
  nmt_status s = REF.residual_dropout_ln_fwd(NULL, out, sum, mean, rstd, x, y, gamma, beta, M, C,
                                             eps, p, seed, stream);
  tally(ctx, OP_RES_F, t, 0);
  return s;
}
static nmt_status w_res_b(void *ctx, float *dx, float *dy, float *dgamma, float *dbeta,
                          const float *dout, const float *sum, const float *gamma,
                          const float *mean, const float *rstd, int M, int C, float p,
                          uint64_t seed, uint64_t stream) {
  double t = now_s();
  nmt_status s = REF.residual_dropout_ln_bwd(NULL, dx, dy, dgamma, dbeta, dout, sum, gamma, mean,
                                             rstd, M, C, p, seed, stream);
  tally(ctx, OP_RES_B, t, 0);
  return s;
}
static nmt_status w_att_f(void *ctx, float *out, float *probs, const float *q, int ldq,
                          const float *k, const float *v, int ldkv, const int32_t *k_lens, int B,
                          int Tq, int Tk, int H, int dk, int causal, float p_drop, uint64_t seed,
                          uint64_t stream) {
  double t = now_s();
  nmt_status s = REF.attention_fwd(NULL, out, probs, q, ldq, k, v, ldkv, k_lens, B, Tq, Tk, H,
                                   dk, causal, p_drop, seed, stream);
  tally(ctx, OP_ATT_F, t, 4.0 * B * H * Tq * Tk * dk);
  return s;
}
static nmt_status w_att_b(void *ctx, float *dq, float *dkey, float *dv, float *dprobs,
                          const float *dout, const float *probs, const float *q, int ldq,
                          const float *k, const float *v, int ldkv, const int32_t *k_lens, int B,
                          int Tq, int Tk, int H, int dk, int causal, float p_drop, uint64_t seed,
                          uint64_t stream) {
  double t = now_s();
  nmt_status s = REF.attention_bwd(NULL, dq, dkey, dv, dprobs, dout, probs, q, ldq, k, v, ldkv,
                                   k_lens, B, Tq, Tk, H, dk, causal, p_drop, seed, stream);
  tally(ctx, OP_ATT_B, t, 8.0 * B * H * Tq * Tk * dk);
  return s;
}
static nmt_status w_relu_f(void *ctx, float *out, const float *inp, size_t n) {
  double t = now_s();
  nmt_status s = REF.relu_fwd(NULL, out, inp, n);
  tally(ctx, OP_RELU_F, t, 0);
  return s;
}
static nmt_status w_relu_b(void *ctx, float *dinp, const float *dout, const float *out, size_t n) {
  double t = now_s();
  nmt_status s = REF.relu_bwd(NULL, dinp, dout, out, n);
  tally(ctx, OP_RELU_B, t, 0);
  return s;
}
static nmt_status w_drop_f(void *ctx, float *out, const float *inp, size_t n, float p,
                           uint64_t seed, uint64_t stream) {
  double t = now_s();
  nmt_status s = REF.dropout_fwd(NULL, out, inp, n, p, seed, stream);
  tally(ctx, OP_DROP_F, t, 0);
  return s;
}
static nmt_status w_drop_b(void *ctx, float *dinp, const float *dout, size_t n, float p,
                           uint64_t seed, uint64_t stream) {
  double t = now_s();
  nmt_status s = REF.dropout_bwd(NULL, dinp, dout, n, p, seed, stream);
  tally(ctx, OP_DROP_B, t, 0);
  return s;
}
static nmt_status w_add(void *ctx, float *out, const float *a, const float *b, size_t n) {
  double t = now_s();
  nmt_status s = REF.add(NULL, out, a, b, n);
  tally(ctx, OP_ADD, t, 0);
  return s;
}
static nmt_status w_axpy(void *ctx, float *y, const float *x, float alpha, size_t n) {
  double t = now_s();
  nmt_status s = REF.axpy(NULL, y, x, alpha, n);
  tally(ctx, OP_AXPY, t, 0);
  return s;
}
static nmt_status w_sum_acc(void *ctx, float *dst, const float *x, size_t n) {
  double t = now_s();
  nmt_status s = REF.sum_acc(NULL, dst, x, n);
  tally(ctx, OP_SUM_ACC, t, 0);
  return s;
}
static nmt_status w_sumsq(void *ctx, float *dst, const float *x, size_t n) {
  double t = now_s();
  nmt_status s = REF.sumsq(NULL, dst, x, n);
  tally(ctx, OP_SUMSQ, t, 0);
  return s;
}
static nmt_status w_xent(void *ctx, float *logits, float *losses, float *nll,
                         const int32_t *targets, int M, int V, float label_smoothing, float dloss,
                         const float *dloss_scale, int write_grad) {
  double t = now_s();
  nmt_status s = REF.xent_fwd_bwd(NULL, logits, losses, nll, targets, M, V, label_smoothing,
                                  dloss, dloss_scale, write_grad);
  tally(ctx, OP_XENT, t, 0);
  return s;
}
static nmt_status w_argmax(void *ctx, int32_t *out, const float *x, int M, int V) {
  (void)ctx;
  return REF.argmax(NULL, out, x, M, V);
}
static nmt_status w_adamw(void *ctx, float *params, const float *grads, float *m, float *v,
                          size_t n, float lr, float beta1, float beta2, float eps,
                          float weight_decay, float grad_scale, const nmt_step_ctl *ctl,
                          void *half_out, long step) {
  double t = now_s();
  /* fp32 (a NULL ref context): a half_out is refused, as the contract says. */
  nmt_status s = REF.adamw(NULL, params, grads, m, v, n, lr, beta1, beta2, eps, weight_decay,
                           grad_scale, ctl, half_out, step);
  tally(ctx, OP_ADAMW, t, 0);
  return s;
}
/* The half working copy exists only in fp16/bf16 mode; this profile runs fp32 (a NULL ref
 * context), so these pass NULL, never the timers' ctx, and registering is refused. */
static nmt_status w_half_weights(void *ctx, const float *src, void *dst, size_t n) {
  (void)ctx;
  return REF.half_weights(NULL, src, dst, n);
}
static nmt_status w_cast_half(void *ctx, void *dst, const float *src, size_t n) {
  (void)ctx;
  return REF.cast_half(NULL, dst, src, n);
}

/* infer_weights keeps its copy in a ref context, which the timed table does not have: it
 * declares nothing here, and the GEMMs read the weights as they are. */
static nmt_status w_infer_weights(void *ctx, const float *src, size_t n) {
  (void)ctx, (void)src, (void)n;
  return NMT_OK;
}

/* nmt_backend_ref with the compute and memory ops wrapped; entries this file does not know (the
 * table grows) pass through unchanged, which is safe because those ref ops ignore ctx. */
static nmt_backend make_timed(void) {
  nmt_backend t = nmt_backend_ref;
  t.name = "ref (timed)";
  t.infer_weights = w_infer_weights;
  t.malloc = w_malloc, t.free = w_free, t.synchronize = w_sync;
  t.memset_zero = w_memset, t.copy_h2d = w_h2d, t.copy_d2h = w_d2h;
  t.embedding_fwd = w_emb_f, t.embedding_bwd = w_emb_b;
  t.matmul_fwd = w_mm_f, t.matmul_bwd = w_mm_b, t.matmul_bias_relu_fwd = w_mm_relu_f;
  t.layernorm_fwd = w_ln_f, t.layernorm_bwd = w_ln_b;
  t.residual_dropout_ln_fwd = w_res_f, t.residual_dropout_ln_bwd = w_res_b;
  t.attention_fwd = w_att_f, t.attention_bwd = w_att_b;
  t.relu_fwd = w_relu_f, t.relu_bwd = w_relu_b;
  t.dropout_fwd = w_drop_f, t.dropout_bwd = w_drop_b;
  t.add = w_add, t.axpy = w_axpy, t.sum_acc = w_sum_acc, t.sumsq = w_sumsq;
  t.xent_fwd_bwd = w_xent, t.argmax = w_argmax, t.adamw = w_adamw;
  t.half_weights = w_half_weights, t.cast_half = w_cast_half;
  return t;
}

/* ------------------------------------------------------------------------------------------ */
/* bench/dump_batches files                                                                   */

typedef struct {
  int n_steps, K;
  nmt_batch *b;    /* n_steps*K, arrays inside buf */
  int32_t **buf;
} batch_file;

static nmt_status read_exact(FILE *f, void *p, size_t bytes, const char *path) {
  if (fread(p, 1, bytes, f) != bytes)
    return nmt_errorf(NMT_ERR_DATA, "%s: truncated", path);
  return NMT_OK;
}

static nmt_status read_batches(const char *path, batch_file *bf) {
  nmt_status s = NMT_OK;
  FILE *f = fopen(path, "rb");
  if (!f) return nmt_errorf(NMT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
  char magic[8];
  uint32_t version;
  int32_t h[7];
  uint64_t seed;
  NMT_TRY_GOTO(s, read_exact(f, magic, 8, path), out);
  NMT_TRY_GOTO(s, read_exact(f, &version, 4, path), out);
  NMT_TRY_GOTO(s, read_exact(f, h, sizeof h, path), out);
  NMT_TRY_GOTO(s, read_exact(f, &seed, 8, path), out);
  if (memcmp(magic, "NMTBTCH1", 8) || version != 1 || h[0] < 1 || h[1] < 1) {
    s = nmt_errorf(NMT_ERR_DATA, "%s: not a version-1 NMTBTCH1 file", path);
    goto out;
  }
  bf->n_steps = h[0], bf->K = h[1];
  size_t n = (size_t)h[0] * (size_t)h[1];
  bf->b = calloc(n, sizeof *bf->b);
  bf->buf = calloc(n, sizeof *bf->buf);
  if (!bf->b || !bf->buf) {
    s = nmt_errorf(NMT_ERR_NOMEM, "%zu batches", n);
    goto out;
  }
  for (size_t i = 0; i < n; i++) {
    int32_t rh[4];
    int64_t rl[6];
    NMT_TRY_GOTO(s, read_exact(f, rh, sizeof rh, path), out);
    NMT_TRY_GOTO(s, read_exact(f, rl, sizeof rl, path), out);
    size_t ints = (size_t)rh[0] * ((size_t)rh[1] + 2 * (size_t)rh[2] + 2);
    bf->buf[i] = malloc(ints * sizeof(int32_t));
    if (!bf->buf[i]) {
      s = nmt_errorf(NMT_ERR_NOMEM, "batch %zu", i);
      goto out;
    }
    /* The file's array order is nmt_batch_layout's, so one read fills the whole batch. */
    NMT_TRY_GOTO(s, read_exact(f, bf->buf[i], ints * sizeof(int32_t), path), out);
    nmt_batch_layout(&bf->b[i], bf->buf[i], rh[0], rh[1], rh[2]);
    bf->b[i].epoch = rl[1], bf->b[i].index = rl[2];
    bf->b[i].src_tokens = rl[4], bf->b[i].tgt_tokens = rl[5];
  }
out:
  fclose(f);
  return s;
}

static nmt_status read_params(const char *path, float *dst, size_t n) {
  nmt_status s = NMT_OK;
  FILE *f = fopen(path, "rb");
  if (!f) return nmt_errorf(NMT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
  /* Header: magic, version, 9 ints, ln_eps, seed; then n_tensors table entries of 108 bytes. */
  char magic[8];
  uint32_t version;
  int32_t h[9];
  float eps;
  uint64_t seed, np;
  NMT_TRY_GOTO(s, read_exact(f, magic, 8, path), out);
  NMT_TRY_GOTO(s, read_exact(f, &version, 4, path), out);
  NMT_TRY_GOTO(s, read_exact(f, h, sizeof h, path), out);
  NMT_TRY_GOTO(s, read_exact(f, &eps, 4, path), out);
  NMT_TRY_GOTO(s, read_exact(f, &seed, 8, path), out);
  if (memcmp(magic, "NMTPARM1", 8) || version != 1 || fseek(f, 108L * h[8], SEEK_CUR) != 0) {
    s = nmt_errorf(NMT_ERR_DATA, "%s: not a version-1 NMTPARM1 file", path);
    goto out;
  }
  NMT_TRY_GOTO(s, read_exact(f, &np, 8, path), out);
  if (np != n) {
    s = nmt_errorf(NMT_ERR_DATA, "%s has %llu parameters, the config's model %zu", path,
                   (unsigned long long)np, n);
    goto out;
  }
  NMT_TRY_GOTO(s, read_exact(f, dst, n * sizeof(float), path), out);
out:
  fclose(f);
  return s;
}

/* ------------------------------------------------------------------------------------------ */

static nmt_status run(const nmt_config *cfg, const char *batches, const char *params_path,
                      int warmup) {
  nmt_status s = NMT_OK;
  batch_file bf = {0};
  nmt_model *m = NULL;
  float *params = NULL, *grads = NULL, *mom = NULL, *var = NULL;
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(cfg, &mc);
  size_t n = nmt_model_num_params(&mc), total = n + NMT_GRAD_EXTRA;
  const nmt_backend timed = make_timed();
  prof p;
  memset(&p, 0, sizeof p);
  p.vocab = mc.vocab;
  NMT_TRY_GOTO(s, read_batches(batches, &bf), out);
  if (warmup >= bf.n_steps) {
    s = nmt_errorf(NMT_ERR_USAGE, "--warmup %d leaves none of %d steps to time", warmup,
                   bf.n_steps);
    goto out;
  }
  params = malloc(n * sizeof *params), grads = malloc(total * sizeof *grads);
  mom = calloc(n, sizeof *mom), var = calloc(n, sizeof *var);
  if (!params || !grads || !mom || !var) {
    s = nmt_errorf(NMT_ERR_NOMEM, "%zu parameters", n);
    goto out;
  }
  NMT_TRY_GOTO(s, read_params(params_path, params, n), out);
  NMT_TRY_GOTO(s, nmt_model_create(&mc, &timed, &p, cfg->data_max_tokens, cfg->data_max_len, &m),
               out);
  openblas_set_num_threads(1);
  double t_steps = 0, tokens = 0;
  double mb_max = 0, mb_mean = 0; /* sums over timed steps of the slowest / mean micro-batch */
  for (int step = 0; step < bf.n_steps; step++) {
    p.on = step >= warmup;
    double t0 = now_s();
    NMT_TRY_GOTO(s, timed.memset_zero(&p, grads, total * sizeof *grads), out);
    double t_max = 0, t_sum = 0;
    for (int k = 0; k < bf.K; k++) {
      const nmt_batch *b = &bf.b[(size_t)step * bf.K + k];
      uint64_t rng_step = (uint64_t)step * (uint64_t)bf.K + (uint64_t)k;
      double tk = now_s();
      NMT_TRY_GOTO(s, nmt_model_forward(m, params, b, 1, cfg->run_seed, rng_step, grads + n), out);
      NMT_TRY_GOTO(s, nmt_model_backward(m, params, grads, b, NULL, NULL), out);
      tk = now_s() - tk;
      t_sum += tk;
      t_max = tk > t_max ? tk : t_max;
    }
    if (p.on) mb_max += t_max, mb_mean += t_sum / bf.K;
    float sq;
    NMT_TRY_GOTO(s, timed.sumsq(&p, &sq, grads, n), out);
    double tok = grads[n + NMT_GRAD_SLOT_TOKENS];
    if (!(tok > 0) || !isfinite(sq)) {
      s = nmt_errorf(NMT_ERR_DIVERGED, "step %d: %g tokens, sum of squares %g", step + 1, tok, sq);
      goto out;
    }
    NMT_TRY_GOTO(s, timed.adamw(&p, params, grads, mom, var, n, (float)nmt_lr_at(cfg, step + 1),
                                cfg->train_adam_beta1, cfg->train_adam_beta2, cfg->train_adam_eps,
                                cfg->train_weight_decay, (float)(1.0 / tok), NULL, NULL, step + 1),
                 out);
    if (p.on) t_steps += now_s() - t0, tokens += tok;
  }
  int steps = bf.n_steps - warmup;
  double t_ops = 0;
  for (int i = 0; i < OP_COUNT; i++) t_ops += p.sec[i];
  printf("nmt ref backend, 1 thread, %d micro-batches per step, steps %d..%d: %.1f ms/step, "
         "%.0f tgt tok/s\n", bf.K, warmup + 1, bf.n_steps, 1e3 * t_steps / steps,
         tokens / t_steps);
  printf("%-20s %10s %10s %8s %9s\n", "op", "calls/step", "ms/step", "share", "GFLOP/s");
  for (int i = 0; i < OP_COUNT; i++) {
    if (!p.calls[i]) continue;
    char gf[16] = "";
    if (p.flops[i] > 0) snprintf(gf, sizeof gf, "%.1f", p.flops[i] / p.sec[i] / 1e9);
    printf("%-20s %10.1f %10.1f %7.1f%% %9s\n", op_names[i], (double)p.calls[i] / steps,
           1e3 * p.sec[i] / steps, 100 * p.sec[i] / t_steps, gf);
  }
  printf("%-20s %10s %10.1f %7.1f%%\n", "(outside ops)", "", 1e3 * (t_steps - t_ops) / steps,
         100 * (t_steps - t_ops) / t_steps);
  /* With one micro-batch per worker, a data-parallel step lasts as long as its slowest one. */
  printf("micro-batch fwd+bwd time within a step: slowest / mean = %.3f (%.1f vs %.1f ms)\n",
         mb_max / mb_mean, 1e3 * mb_max / steps, 1e3 * mb_mean / steps);
out:
  if (m) nmt_model_destroy(m);
  free(params), free(grads), free(mom), free(var);
  if (bf.buf)
    for (size_t i = 0; i < (size_t)bf.n_steps * bf.K; i++) free(bf.buf[i]);
  free(bf.buf), free(bf.b);
  return s;
}

int main(int argc, char **argv) {
  const char *config = NULL, *batches = NULL, *params = NULL;
  const char *overrides[256];
  int n_overrides = 0, warmup = 2;
  if (argc == 2 && !strcmp(argv[1], "--peak")) {
    printf("%.1f\n", nmt_prof_cpu_fma_gflops());
    return 0;
  }
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--batches") && i + 1 < argc) batches = argv[++i];
    else if (!strcmp(a, "--params") && i + 1 < argc) params = argv[++i];
    else if (!strcmp(a, "--warmup") && i + 1 < argc) warmup = atoi(argv[++i]);
    else if (a[0] != '-' && strchr(a, '=') && strchr(a, '.') && n_overrides < 256)
      overrides[n_overrides++] = a;
    else if (a[0] != '-' && !config) config = a;
    else {
      fprintf(stderr, "op_profile: unexpected argument \"%s\"\n", a);
      return 2;
    }
  }
  if (!config || !batches || !params || warmup < 0) {
    fprintf(stderr, "usage: op_profile CONFIG --batches BATCHES --params PARAMS [--warmup W] "
                    "[section.key=value ...]\n       op_profile --peak\n");
    return 2;
  }
  nmt_config cfg;
  nmt_status s = nmt_config_load(config, overrides, n_overrides, &cfg);
  if (s == NMT_OK) s = run(&cfg, batches, params, warmup);
  if (s != NMT_OK) {
    fprintf(stderr, "op_profile: %s: %s\n", nmt_status_desc(s), nmt_last_error());
    return nmt_status_exit_code(s);
  }
  return 0;
}
