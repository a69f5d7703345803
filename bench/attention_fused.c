/* bench/attention_fused.c — attention fwd+bwd, unfused (attention_half_fwd + attention_half_bwd,
 * cuda/attention.cu) against fused (attention_fused_fwd + attention_fused_bwd) in both of its
 * half-storage implementations: SIMT (cuda/attention_fused.cu) and tensor cores (WMMA,
 * cuda/attention_fused_mma.cu), chosen per run with nmt_cuda_ctx_set_attention_fused_impl
 * (nmt/cuda.h; the default follows NMT_ATTENTION_FUSED_IMPL), on device 0 in bf16 storage,
 * through the backend table (the production launchers; no kernel is copied here).
 *
 * usage: attention_fused [--iters N]      (default 20 timed calls after 3 warm-up calls)
 *
 * Shapes: the base model's self-attention (d_model 512, 8 heads of 64, one fused QKV buffer of
 * ldq = 3 d_model), dropout 0.1, at (sentences, length) = (156, 40), (24, 256), (625, 40)
 * (about 6250, 6144 and 25000 tokens), causal (decoder) and not (encoder), every key visible.
 * Each row: ms per fwd+bwd call (host clock around N calls, one synchronize after them) of
 * unfused, SIMT and mma, and the speedups over unfused. Then one JSONL row per shape and a
 * summary line. Timing only: nothing here decides a test. tools/gpu-check.sh first runs it
 * (about 8 s on an H100). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/attention.h"
#include "nmt/backend.h"
#include "nmt/clock.h"
#include "nmt/status.h"

/* The implementation knob (nmt/cuda.h). Weak: a CPU-only build links without it (and then
 * finds no device). */
extern nmt_status nmt_cuda_ctx_set_attention_fused_impl(void *ctx, int mma)
    __attribute__((weak));

#ifndef NMT_COMMIT
#define NMT_COMMIT "unknown"
#endif

#define TRY(expr)                                                                       \
  do {                                                                                  \
    nmt_status s_ = (expr);                                                             \
    if (s_ != NMT_OK) {                                                                 \
      fprintf(stderr, "attention_fused: %s: %s: %s\n", #expr, nmt_status_str(s_),       \
              nmt_last_error());                                                        \
      rc = 1;                                                                           \
      goto out;                                                                         \
    }                                                                                   \
  } while (0)

typedef struct {
  int B, T, causal;
} shape;

int main(int argc, char **argv) {
  int iters = 20, rc = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--iters") && i + 1 < argc) {
      char *end;
      long v = strtol(argv[++i], &end, 10);
      if (*end || v < 1 || v > 100000) {
        fprintf(stderr, "attention_fused: --iters %s: an integer in [1, 100000]\n", argv[i]);
        return 2;
      }
      iters = (int)v;
    } else {
      fprintf(stderr, "usage: attention_fused [--iters N]\n");
      return 2;
    }
  }
  const nmt_backend *be = nmt_backend_cuda_get();
  int n_dev = 0;
  if (!be || be->device_count(&n_dev) != NMT_OK || n_dev < 1 ||
      !nmt_cuda_ctx_set_attention_fused_impl) {
    fprintf(stderr, "attention_fused: no CUDA device\n");
    return 3;
  }
  static const shape shapes[] = {{156, 40, 0}, {156, 40, 1}, {24, 256, 0},
                                 {24, 256, 1}, {625, 40, 0}, {625, 40, 1}};
  const int n_shapes = (int)(sizeof shapes / sizeof *shapes);
  const int H = 8, dk = 64, C = H * dk, ldq = 3 * C;
  const float p = 0.1f;
  double ms_of[3][6] = {{0}}; /* [unfused, SIMT, mma][shape] */
  void *ctx = NULL, *buf = NULL;
  int32_t *lens_h = NULL;
  TRY(be->ctx_create(0, &ctx));
  TRY(be->set_precision(ctx, NMT_PRECISION_BF16));
  /* One allocation for the largest shape: qkv, dqkv (half), out, dout (half), probs and
   * dprobs (fp32), lse, drow (fp32), k_lens. */
  size_t max_tok = 0, max_sc = 0, max_rows = 0;
  int max_B = 0;
  for (int s = 0; s < n_shapes; s++) {
    const size_t tok = (size_t)shapes[s].B * shapes[s].T;
    const size_t sc = tok * H * shapes[s].T;
    if (tok > max_tok) max_tok = tok;
    if (sc > max_sc) max_sc = sc;
    if (tok * H > max_rows) max_rows = tok * H;
    if (shapes[s].B > max_B) max_B = shapes[s].B;
  }
  const size_t o_qkv = 0, o_dqkv = o_qkv + max_tok * ldq * 2, o_out = o_dqkv + max_tok * ldq * 2;
  const size_t o_dout = o_out + max_tok * C * 2, o_p = o_dout + max_tok * C * 2;
  const size_t o_dp = o_p + max_sc * 4, o_lse = o_dp + max_sc * 4, o_drow = o_lse + max_rows * 4;
  const size_t o_lens = o_drow + max_rows * 4, total = o_lens + (size_t)max_B * 4;
  TRY(be->malloc(ctx, total, &buf));
  TRY(be->memset_zero(ctx, buf, total)); /* zeros: finite inputs (bf16 +0) */
  lens_h = malloc((size_t)max_B * 4);
  if (!lens_h) {
    fprintf(stderr, "attention_fused: out of memory\n");
    rc = 1;
    goto out;
  }
  char *d = buf;
  nmt_act *qkv = (nmt_act *)(d + o_qkv), *dqkv = (nmt_act *)(d + o_dqkv);
  nmt_act *outp = (nmt_act *)(d + o_out), *dout = (nmt_act *)(d + o_dout);
  float *probs = (float *)(d + o_p), *dprobs = (float *)(d + o_dp);
  float *lse = (float *)(d + o_lse), *drow = (float *)(d + o_drow);
  int32_t *lens = (int32_t *)(d + o_lens);

  printf("# attention fwd+bwd, unfused vs fused (SIMT, mma): cuda device 0, bf16 storage, "
         "d_model %d, %d heads of %d, self-attention (fused QKV), dropout %.1f, %d calls, "
         "commit %s\n", C, H, dk, (double)p, iters, NMT_COMMIT);
  printf("%10s %6s %7s %8s %11s %9s %9s %9s %9s\n", "sentences", "length", "causal", "tokens",
         "unfused ms", "simt ms", "mma ms", "simt x", "mma x");
  for (int s = 0; s < n_shapes; s++) {
    const int B = shapes[s].B, T = shapes[s].T, causal = shapes[s].causal;
    for (int b = 0; b < B; b++) lens_h[b] = T;
    TRY(be->copy_h2d(ctx, lens, lens_h, (size_t)B * 4));
    nmt_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = qkv, a.k = qkv + C, a.v = qkv + 2 * C, a.ldq = ldq, a.ldkv = ldq, a.k_lens = lens;
    a.B = B, a.Tq = T, a.Tk = T, a.H = H, a.dk = dk, a.causal = causal, a.p_drop = p;
    a.seed = 1, a.stream = 2, a.half = 1;
    for (int variant = 0; variant < 3; variant++) {
      double t0 = 0.0;
      if (variant > 0) TRY(nmt_cuda_ctx_set_attention_fused_impl(ctx, variant == 2));
      for (int it = 0; it < iters + 3; it++) {
        if (it == 3) {
          TRY(be->synchronize(ctx));
          t0 = nmt_clock_now_s();
        }
        if (variant == 0) {
          TRY(be->attention_half_fwd(ctx, outp, probs, qkv, ldq, qkv + C, qkv + 2 * C, ldq, lens,
                                     B, T, T, H, dk, causal, p, 1, 2));
          TRY(be->attention_half_bwd(ctx, dqkv, dqkv + C, dqkv + 2 * C, dprobs, dout, probs, qkv,
                                     ldq, qkv + C, qkv + 2 * C, ldq, lens, B, T, T, H, dk, causal,
                                     p, 1, 2));
        } else {
          TRY(be->attention_fused_fwd(ctx, outp, lse, &a));
          TRY(be->attention_fused_bwd(ctx, dqkv, dqkv + C, dqkv + 2 * C, drow, dout, outp, lse,
                                      &a));
        }
      }
      TRY(be->synchronize(ctx));
      ms_of[variant][s] = (nmt_clock_now_s() - t0) * 1e3 / iters;
    }
    printf("%10d %6d %7d %8d %11.3f %9.3f %9.3f %8.2fx %8.2fx\n", B, T, causal, B * T,
           ms_of[0][s], ms_of[1][s], ms_of[2][s], ms_of[0][s] / ms_of[1][s],
           ms_of[0][s] / ms_of[2][s]);
  }
  for (int s = 0; s < n_shapes; s++)
    printf("{\"bench\":\"attention_fused\",\"device\":\"cuda:0\",\"precision\":\"bf16\","
           "\"d_model\":%d,\"heads\":%d,\"sentences\":%d,\"length\":%d,\"causal\":%d,"
           "\"tokens\":%d,\"p_drop\":%.1f,\"unfused_ms\":%.4f,\"simt_ms\":%.4f,"
           "\"mma_ms\":%.4f,\"commit\":\"%s\"}\n",
           C, H, shapes[s].B, shapes[s].T, shapes[s].causal, shapes[s].B * shapes[s].T,
           (double)p, ms_of[0][s], ms_of[1][s], ms_of[2][s], NMT_COMMIT);
  {
    double u = 0.0, f = 0.0, m = 0.0;
    for (int s = 0; s < n_shapes; s++) u += ms_of[0][s], f += ms_of[1][s], m += ms_of[2][s];
    printf("summary: attention fwd+bwd bf16, %d shapes: unfused %.3f ms, fused SIMT %.3f ms "
           "(%.2fx), fused mma %.3f ms (%.2fx) in all\n", n_shapes, u, f, u / f, m, u / m);
  }
out:
  free(lens_h);
  if (buf) be->free(ctx, buf);
  if (ctx) be->ctx_destroy(ctx);
  return rc;
}
