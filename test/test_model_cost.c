/* test/test_model_cost.c — the model's closed-form costs (src/model/cost.c):
 * nmt_model_train_flops against a hand count and against an independent count of the
 * forward's GEMMs read off the parameter table, and nmt_model_activation_bytes_bound against
 * the exact arena size (nmt_model_arena_bytes) over tiny and real shapes. */
#include <stdio.h>
#include <string.h>

#include "nmt/config.h"
#include "nmt/model.h"
#include "test.h"

NMT_TEST(model_cost_train_flops_by_hand) {
  /* d_model 4, d_ff 8, vocab 10, one layer each, B = 1, Ts = 2, Tt = 3, worked by hand:
   * enc = 2*2*4*12 + 2*2*4*4 + 4*1*2*2*4 + 4*2*4*8 = 192 + 64 + 64 + 256 = 576
   * dec = 2*3*4*12 + 2*3*4*4 + 4*1*3*3*4 + 2*3*4*4 + 2*2*4*8 + 2*3*4*4 + 4*1*3*2*4 + 4*3*4*8
   *     = 288 + 96 + 144 + 96 + 128 + 96 + 96 + 384 = 1328;  logits 2*3*4*10 = 240
   * 3 x (576 + 1328 + 240) = 6432 */
  nmt_model_cfg c = {.vocab = 10, .d_model = 4, .n_heads = 2, .d_ff = 8, .enc_layers = 1,
                     .dec_layers = 1};
  NMT_ASSERT_NEAR(nmt_model_train_flops(&c, 1, 2, 3), 6432, 0);
}

/* 3 x the forward's matmul FLOPs, counted from the parameter table instead of the formula:
 * every weight matrix (N, K) is one GEMM of 2*M*K*N FLOPs, M = the rows it is applied to
 * (source tokens for the encoder and the cross-attention keys/values, target tokens for the
 * rest of the decoder and the tied output projection); every self-attention (its qkv weight)
 * and cross-attention (its q weight) adds QK^T and PV, 2 * 2*B*Tq*Tk*d_model. */
static double flops_from_table(const nmt_model_cfg *c, int B, int Ts, int Tt) {
  nmt_param_info tab[256];
  int n = nmt_model_param_table(c, NULL);
  if (n > 256) return -1;
  nmt_model_param_table(c, tab);
  const double ns = (double)B * Ts, nt = (double)B * Tt, C = c->d_model;
  double fwd = 0;
  for (int i = 0; i < n; i++) {
    const char *name = tab[i].name;
    if (tab[i].ndim != 2) continue;
    int enc = !strncmp(name, "encoder.", 8);
    double rows = enc || strstr(name, ".cross_attn.kv.") ? ns : nt;
    fwd += 2 * rows * (double)tab[i].shape[0] * tab[i].shape[1];
    if (strstr(name, ".self_attn.qkv.weight"))
      fwd += enc ? 4.0 * B * Ts * Ts * C : 4.0 * B * Tt * Tt * C;
    if (strstr(name, ".cross_attn.q.weight")) fwd += 4.0 * B * Tt * Ts * C;
  }
  return 3 * fwd;
}

NMT_TEST(model_cost_train_flops_vs_param_table) {
  const struct {
    int C, H, F, V, Le, Ld, B, Ts, Tt;
    nmt_norm_kind norm;
  } cases[] = {
      {4, 2, 8, 10, 1, 1, 1, 2, 3, NMT_NORM_POST},   {8, 2, 24, 13, 2, 3, 3, 5, 7, NMT_NORM_PRE},
      {16, 4, 32, 50, 3, 1, 2, 9, 4, NMT_NORM_POST}, {12, 3, 20, 7, 1, 2, 4, 1, 6, NMT_NORM_PRE},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    nmt_model_cfg c = {.vocab = cases[k].V, .d_model = cases[k].C, .n_heads = cases[k].H,
                       .d_ff = cases[k].F, .enc_layers = cases[k].Le, .dec_layers = cases[k].Ld,
                       .max_positions = 16, .norm = cases[k].norm, .ln_eps = 1e-5f};
    double want = flops_from_table(&c, cases[k].B, cases[k].Ts, cases[k].Tt);
    double got = nmt_model_train_flops(&c, cases[k].B, cases[k].Ts, cases[k].Tt);
    printf("# case %zu: %.0f FLOPs, %.0f from the parameter table\n", k, got, want);
    /* integers far below 2^53: exact in double whatever the summation order */
    NMT_ASSERT_NEAR(got, want, 0);
  }
}

/* bound >= exact for one config at the shapes nmt_model_create accepts; 0 on a failure. */
static int bound_holds(const nmt_model_cfg *c, int max_tokens, int max_len) {
  size_t exact = nmt_model_arena_bytes(c, max_tokens, max_len);
  double bound = nmt_model_activation_bytes_bound(c, max_tokens, max_len);
  if (exact > 0 && bound >= (double)exact) return 1;
  nmt_test_fail(__FILE__, __LINE__,
                "bound %.0f < arena %zu bytes: C=%d H=%d F=%d V=%d layers %d+%d norm %d "
                "checkpointing %d qkv_streams %d max_tokens %d max_len %d",
                bound, exact, c->d_model, c->n_heads, c->d_ff, c->vocab, c->enc_layers,
                c->dec_layers, (int)c->norm, c->checkpoint_activations, c->qkv_streams,
                max_tokens, max_len);
  return 0;
}

NMT_TEST(model_cost_activation_bound_tiny_shapes) {
  /* Tiny shapes are where the arena's 64-byte alignment padding matters most. */
  int n = 0;
  for (int C = 4; C <= 32; C *= 2)
    for (int layers = 0; layers < 9; layers++)
      for (int opt = 0; opt < 8; opt++)
        for (int N = 1; N <= 40; N += 13)
          for (int L = 1; L <= 9; L += 4) {
            if (L > N) continue;
            nmt_model_cfg c = {.vocab = 11, .d_model = C, .n_heads = 2, .d_ff = 3 * C,
                               .enc_layers = layers % 3, .dec_layers = layers / 3,
                               .max_positions = 9, .ln_eps = 1e-5f,
                               .norm = opt & 1 ? NMT_NORM_PRE : NMT_NORM_POST,
                               .checkpoint_activations = (opt >> 1) & 1,
                               .qkv_streams = (opt >> 2) & 1};
            if (!bound_holds(&c, N, L)) return;
            n++;
          }
  printf("# %d configs\n", n);
}

NMT_TEST(model_cost_activation_bound_conf_files) {
  const char *files[] = {"conf/base.ini", "conf/bible-small.ini", "conf/big.ini"};
  for (int i = 0; i < 3; i++)
    for (int opt = 0; opt < 4; opt++) {
      const char *ov[2] = {opt & 1 ? "train.checkpoint_activations=on"
                                   : "train.checkpoint_activations=off",
                           opt & 2 ? "model.norm=pre" : "model.norm=post"};
      nmt_config cfg;
      NMT_ASSERT_OK(nmt_config_load(files[i], ov, 2, &cfg));
      nmt_model_cfg c;
      nmt_model_cfg_from_config(&cfg, &c);
      const int N = cfg.data_max_tokens, L = cfg.data_max_len;
      if (!bound_holds(&c, N, L)) return;
      if (!bound_holds(&c, L, L)) return; /* one sentence per micro-batch */
      if (opt == 0)
        printf("# %s: arena %zu bytes, bound %.0f\n", files[i], nmt_model_arena_bytes(&c, N, L),
               nmt_model_activation_bytes_bound(&c, N, L));
    }
}

NMT_TEST(model_cost_activation_bound_does_not_wrap) {
  /* Shapes whose byte count overflows size_t: the bound stays a finite double above 2^64,
   * which is what lets the trainer refuse them before counting exactly. */
  nmt_model_cfg c = {.vocab = 1 << 30, .d_model = 1 << 20, .n_heads = 1 << 10, .d_ff = 1 << 24,
                     .enc_layers = 256, .dec_layers = 256, .max_positions = 1 << 20,
                     .ln_eps = 1e-5f};
  double b = nmt_model_activation_bytes_bound(&c, 1 << 30, 1 << 20);
  NMT_ASSERT(b > 0x1p64);
  NMT_ASSERT(b < 1e300);
}
