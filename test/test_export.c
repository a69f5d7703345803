/* test/test_export.c — checkpoint averaging, the safetensors export, and the PyTorch loader
 * (tools/load_pytorch.py) reproducing `nmt eval`'s loss. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/export.h"
#include "nmt/model.h"
#include "nmt/rng.h"
#include "helpers.h"
#include "test.h"

static nmt_model_cfg tiny_cfg(nmt_norm_kind norm) {
  nmt_model_cfg c = {.vocab = 50,
                     .d_model = 16,
                     .n_heads = 2,
                     .d_ff = 24,
                     .enc_layers = 2,
                     .dec_layers = 2,
                     .max_positions = 64,
                     .norm = norm,
                     .ln_eps = 1e-5f,
                     .label_smoothing = 0.1f};
  return c;
}

static void header_of(const nmt_model_cfg *c, long step, nmt_ckpt_header *h) {
  memset(h, 0, sizeof *h);
  h->vocab = c->vocab, h->d_model = c->d_model, h->n_heads = c->n_heads, h->d_ff = c->d_ff;
  h->enc_layers = c->enc_layers, h->dec_layers = c->dec_layers, h->norm = (int32_t)c->norm;
  h->n_params = nmt_model_num_params(c);
  h->step = step;
  h->seed = 1;
  h->loss_scale = 1.0f;
}

/* nmt's init plus noise on every value, so that biases and LayerNorm parameters are not 0/1
 * and a tensor mapped to the wrong place changes the loss. */
static float *random_params(const nmt_model_cfg *c, uint64_t seed, float noise) {
  size_t n = nmt_model_num_params(c);
  float *p = malloc(n * sizeof *p);
  if (!p) return NULL;
  nmt_model_init_params(c, seed, p);
  for (size_t i = 0; i < n; i++)
    p[i] += noise * (2.0f * nmt_rng_uniform(seed, 77, i) - 1.0f);
  return p;
}

static nmt_status write_ckpt(const char *path, const nmt_model_cfg *c, long step, const float *p,
                             int moments) {
  nmt_ckpt_header h;
  header_of(c, step, &h);
  h.has_moments = (uint32_t)moments;
  return nmt_ckpt_write(path, &h, p, moments ? p : NULL, moments ? p : NULL);
}

/* ------------------------------------------------------------------------------------------ */
/* averaging */

NMT_TEST(average_identical_is_identity) {
  const char *dir = nmt_test_tmpdir();
  nmt_model_cfg c = tiny_cfg(NMT_NORM_POST);
  size_t n = nmt_model_num_params(&c);
  float *p = random_params(&c, 1, 0.3f), *q = malloc(n * sizeof *q);
  NMT_ASSERT(p && q);
  char a[512], out[512];
  snprintf(a, sizeof a, "%s/a.ckpt", dir);
  snprintf(out, sizeof out, "%s/avg.ckpt", dir);
  NMT_ASSERT_OK(write_ckpt(a, &c, 7, p, 1));
  for (int k = 1; k <= 3; k++) {
    const char *paths[3] = {a, a, a};
    nmt_ckpt_header h;
    NMT_ASSERT_OK(nmt_ckpt_average(paths, k, out));
    NMT_ASSERT_OK(nmt_ckpt_read(out, NULL, &h, q, NULL, NULL));
    NMT_ASSERT(memcmp(p, q, n * sizeof *p) == 0); /* bit for bit */
    NMT_ASSERT_EQ_INT(h.has_moments, 0);
    NMT_ASSERT_EQ_INT(h.step, 7);
  }
  free(p);
  free(q);
}

NMT_TEST(average_is_the_mean) {
  const char *dir = nmt_test_tmpdir();
  nmt_model_cfg c = tiny_cfg(NMT_NORM_PRE);
  size_t n = nmt_model_num_params(&c);
  float *p[3] = {random_params(&c, 1, 0.3f), random_params(&c, 2, 0.3f),
                 random_params(&c, 3, 0.3f)};
  float *q = malloc(n * sizeof *q), *want = malloc(n * sizeof *want);
  NMT_ASSERT(p[0] && p[1] && p[2] && q && want);
  char path[3][512], out[512];
  const char *paths[3];
  long steps[3] = {300, 500, 400};
  for (int k = 0; k < 3; k++) {
    snprintf(path[k], sizeof path[k], "%s/step_%ld.ckpt", dir, steps[k]);
    paths[k] = path[k];
    NMT_ASSERT_OK(write_ckpt(path[k], &c, steps[k], p[k], k != 1));
  }
  snprintf(out, sizeof out, "%s/avg.ckpt", dir);
  NMT_ASSERT_OK(nmt_ckpt_average(paths, 3, out));
  nmt_ckpt_header h;
  NMT_ASSERT_OK(nmt_ckpt_read(out, NULL, &h, q, NULL, NULL));
  /* (a + b + c) / 3 of the float32 values, rounded once */
  for (size_t i = 0; i < n; i++)
    want[i] = (float)(((double)p[0][i] + (double)p[1][i] + (double)p[2][i]) / 3.0);
  NMT_ASSERT_CLOSE("average", q, want, n, 0, 0);
  NMT_ASSERT_EQ_INT(h.step, 500); /* the newest input's position */
  int differ = 0;
  for (size_t i = 0; i < n; i++) differ += q[i] != p[0][i];
  NMT_ASSERT(differ > (int)(n / 2));

  /* nmt average --last 2 picks the two highest steps */
  char **last;
  int got;
  NMT_ASSERT_OK(nmt_ckpt_last_k(dir, 2, &last, &got));
  NMT_ASSERT_EQ_INT(got, 2);
  NMT_ASSERT(strstr(last[0], "step_500.ckpt") && strstr(last[1], "step_400.ckpt"));
  for (int k = 0; k < got; k++) free(last[k]);
  free(last);

  /* a different model shape is refused, naming the file */
  nmt_model_cfg c2 = tiny_cfg(NMT_NORM_PRE);
  c2.d_ff = 32;
  float *r = random_params(&c2, 4, 0.1f);
  NMT_ASSERT(r);
  snprintf(path[1], sizeof path[1], "%s/other.ckpt", dir);
  NMT_ASSERT_OK(write_ckpt(path[1], &c2, 1, r, 0));
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_average(paths, 2, out), NMT_ERR_CHECKPOINT);
  NMT_ASSERT(strstr(nmt_last_error(), "other.ckpt") != NULL);
  free(r);
  for (int k = 0; k < 3; k++) free(p[k]);
  free(q);
  free(want);
}

/* ------------------------------------------------------------------------------------------ */
/* safetensors */

static unsigned char *read_all(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc((size_t)len + 1);
  if (b && fread(b, 1, (size_t)len, f) != (size_t)len) {
    free(b);
    b = NULL;
  }
  fclose(f);
  if (b) b[len] = 0;
  *n = (size_t)len;
  return b;
}

NMT_TEST(export_safetensors_layout) {
  const char *dir = nmt_test_tmpdir();
  nmt_model_cfg c = tiny_cfg(NMT_NORM_PRE);
  size_t n = nmt_model_num_params(&c);
  float *p = random_params(&c, 9, 0.2f);
  NMT_ASSERT(p);
  char ck[512], st[512];
  snprintf(ck, sizeof ck, "%s/x.ckpt", dir);
  snprintf(st, sizeof st, "%s/x.safetensors", dir);
  NMT_ASSERT_OK(write_ckpt(ck, &c, 42, p, 1));
  nmt_config cfg;
  nmt_config_defaults(&cfg);
  cfg.model_vocab = c.vocab, cfg.model_d_model = c.d_model, cfg.model_n_heads = c.n_heads;
  cfg.model_d_ff = c.d_ff, cfg.model_enc_layers = c.enc_layers, cfg.model_dec_layers = c.dec_layers;
  cfg.model_norm = c.norm, cfg.model_max_positions = c.max_positions;
  NMT_ASSERT_OK(nmt_export_safetensors(ck, &cfg, st));
  size_t len;
  unsigned char *b = read_all(st, &len);
  NMT_ASSERT(b && len > 8);
  uint64_t hl = 0;
  for (int i = 0; i < 8; i++) hl |= (uint64_t)b[i] << (8 * i);
  /* header, 8-aligned data, and exactly n_params floats after it */
  NMT_ASSERT(hl % 8 == 0);
  NMT_ASSERT_EQ_INT(len, 8 + hl + 4 * n);
  char *json = malloc(hl + 1);
  NMT_ASSERT(json);
  memcpy(json, b + 8, hl);
  json[hl] = 0;
  NMT_ASSERT(strstr(json, "\"__metadata__\":{") && strstr(json, "\"d_model\":\"16\"") &&
             strstr(json, "\"norm\":\"pre\"") && strstr(json, "\"step\":\"42\"") &&
             strstr(json, "\"label_smoothing\":\"0.1\""));
  int nt = nmt_model_param_table(&c, NULL);
  nmt_param_info *tab = malloc((size_t)nt * sizeof *tab);
  NMT_ASSERT(tab);
  nmt_model_param_table(&c, tab);
  for (int i = 0; i < nt; i++) {
    char want[256];
    if (tab[i].ndim == 2)
      snprintf(want, sizeof want, "\"%s\":{\"dtype\":\"F32\",\"shape\":[%d,%d],\"data_offsets\":[%zu,%zu]}",
               tab[i].name, tab[i].shape[0], tab[i].shape[1], 4 * tab[i].offset,
               4 * (tab[i].offset + tab[i].numel));
    else
      snprintf(want, sizeof want, "\"%s\":{\"dtype\":\"F32\",\"shape\":[%d],\"data_offsets\":[%zu,%zu]}",
               tab[i].name, tab[i].shape[0], 4 * tab[i].offset, 4 * (tab[i].offset + tab[i].numel));
    if (!strstr(json, want)) {
      nmt_test_fail(__FILE__, __LINE__, "header lacks %s", want);
      break;
    }
  }
  /* data: the parameters, little-endian fp32 */
  float *d = malloc(4 * n);
  NMT_ASSERT(d);
  for (size_t i = 0; i < n; i++) {
    const unsigned char *q = b + 8 + hl + 4 * i;
    uint32_t u = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
    memcpy(&d[i], &u, 4);
  }
  if (!nmt_test_failed()) NMT_ASSERT(memcmp(d, p, 4 * n) == 0);
  /* a config of another shape is refused */
  cfg.model_d_ff = 32;
  NMT_ASSERT_EQ_STATUS(nmt_export_safetensors(ck, &cfg, st), NMT_ERR_CHECKPOINT);
  free(d), free(tab), free(json), free(b), free(p);
}

typedef struct {
  double loss, nll, tokens;
  long pairs, dropped;
} loss_line;

static int parse_loss(const char *text, loss_line *l) {
  const char *s = strstr(text, "loss ");
  while (s && sscanf(s, "loss %lf nll %lf ppl %*f tokens %lf pairs %ld dropped %ld", &l->loss,
                     &l->nll, &l->tokens, &l->pairs, &l->dropped) != 5)
    s = strstr(s + 1, "loss ");
  return s != NULL;
}

/* A shard of random pairs, lengths 1..max, some longer than max_len - 1 (dropped by both). */
static nmt_status write_shard(const char *path, int V, int n, int max) {
  uint64_t *so = malloc((size_t)(n + 1) * 8), *to = malloc((size_t)(n + 1) * 8);
  int32_t *si = malloc((size_t)n * max * 4), *ti = malloc((size_t)n * max * 4);
  if (!so || !to || !si || !ti) return NMT_ERR_NOMEM;
  so[0] = to[0] = 0;
  uint64_t k = 0;
  for (int i = 0; i < n; i++) {
    int ls = 1 + (int)(nmt_rng_u32(5, 1, k++) % (uint32_t)max);
    int lt = 1 + (int)(nmt_rng_u32(5, 1, k++) % (uint32_t)max);
    for (int j = 0; j < ls; j++) si[so[i] + j] = 4 + (int32_t)(nmt_rng_u32(5, 2, k++) % (uint32_t)(V - 4));
    for (int j = 0; j < lt; j++) ti[to[i] + j] = 4 + (int32_t)(nmt_rng_u32(5, 2, k++) % (uint32_t)(V - 4));
    so[i + 1] = so[i] + (uint64_t)ls;
    to[i + 1] = to[i] + (uint64_t)lt;
  }
  nmt_status s = nmt_shard_write(path, V, n, so, si, to, ti);
  free(so), free(to), free(si), free(ti);
  return s;
}

static void pytorch_case(nmt_norm_kind norm) {
  const char *dir = nmt_test_tmpdir();
  char out[8192], cmd[4096];
  if (nmt_th_capture("/usr/bin/python3 -c 'import torch, numpy' 2>&1", out, sizeof out) != 0)
    NMT_SKIP("/usr/bin/python3 cannot import torch (Debian python3-torch; tools/install-deps.sh "
             "installs it)");
  char nmt_bin[1024];
  snprintf(nmt_bin, sizeof nmt_bin, "%s/nmt", nmt_test_build_dir());
  struct stat sb;
  if (stat(nmt_bin, &sb) != 0) {
    nmt_test_fail(__FILE__, __LINE__, "%s missing (make builds it)", nmt_bin);
    return;
  }
  nmt_model_cfg c = tiny_cfg(norm);
  float *p = random_params(&c, 31 + (uint64_t)norm, 0.3f);
  NMT_ASSERT(p);
  char ini[512], ck[512], st[512], sh[512];
  snprintf(ini, sizeof ini, "%s/tiny.ini", dir);
  snprintf(ck, sizeof ck, "%s/tiny.ckpt", dir);
  snprintf(st, sizeof st, "%s/tiny.safetensors", dir);
  snprintf(sh, sizeof sh, "%s/pairs.shard", dir);
  NMT_ASSERT_OK(write_ckpt(ck, &c, 5, p, 1));
  free(p);
  NMT_ASSERT_OK(write_shard(sh, c.vocab, 40, 14));
  FILE *f = fopen(ini, "w");
  NMT_ASSERT(f);
  fprintf(f,
          "[run]\nout_dir = \"%s/run\"\n[data]\nmax_tokens = 96\nmax_len = 12\n"
          "[model]\nvocab = %d\nd_model = %d\nn_heads = %d\nd_ff = %d\nenc_layers = %d\n"
          "dec_layers = %d\nmax_positions = %d\nnorm = %s\ndropout = 0.1\n"
          "[train]\nlabel_smoothing = 0.1\n",
          dir, c.vocab, c.d_model, c.n_heads, c.d_ff, c.enc_layers, c.dec_layers, c.max_positions,
          norm == NMT_NORM_PRE ? "pre" : "post");
  fclose(f);

  snprintf(cmd, sizeof cmd, "%s export %s %s %s 2>&1", nmt_bin, ck, st, ini);
  if (nmt_th_capture(cmd, out, sizeof out) != 0) {
    nmt_test_fail(__FILE__, __LINE__, "%s failed: %s", cmd, out);
    return;
  }
  loss_line a, b;
  snprintf(cmd, sizeof cmd, "%s eval %s --ckpt %s --shard %s 2>&1", nmt_bin, ini, ck, sh);
  if (nmt_th_capture(cmd, out, sizeof out) != 0 || !parse_loss(out, &a)) {
    nmt_test_fail(__FILE__, __LINE__, "%s failed: %s", cmd, out);
    return;
  }
  snprintf(cmd, sizeof cmd,
           "/usr/bin/python3 tools/load_pytorch.py %s --shard %s --max-len 12 --max-tokens 96 2>&1",
           st, sh);
  if (nmt_th_capture(cmd, out, sizeof out) != 0 || !parse_loss(out, &b)) {
    nmt_test_fail(__FILE__, __LINE__, "%s failed: %s", cmd, out);
    return;
  }
  printf("# %s-LN: nmt loss %.6f nll %.6f, PyTorch loss %.6f nll %.6f (%.0f tokens, %ld pairs, "
         "%ld dropped)\n",
         norm == NMT_NORM_PRE ? "pre" : "post", a.loss, a.nll, b.loss, b.nll, a.tokens, a.pairs,
         a.dropped);
  NMT_ASSERT_EQ_INT(a.pairs, b.pairs);
  NMT_ASSERT_EQ_INT(a.dropped, b.dropped);
  NMT_ASSERT(a.dropped > 0 && a.pairs > 0);
  NMT_ASSERT_NEAR(a.tokens, b.tokens, 0.5);
  NMT_ASSERT_NEAR(a.loss, b.loss, 1e-4 * fabs(b.loss));
  NMT_ASSERT_NEAR(a.nll, b.nll, 1e-4 * fabs(b.nll));
}

NMT_TEST(export_pytorch_reproduces_loss_post) { pytorch_case(NMT_NORM_POST); }
NMT_TEST(export_pytorch_reproduces_loss_pre) { pytorch_case(NMT_NORM_PRE); }

/* Usage errors of the new subcommands exit 2 (README "Exit codes"); a damaged input exits 7. */
NMT_TEST(export_cli_usage) {
  const char *dir = nmt_test_tmpdir();
  char cmd[2048], out[8192], ck[512];
  const char *bin = nmt_test_build_dir();
  snprintf(ck, sizeof ck, "%s/bad.ckpt", dir);
  FILE *f = fopen(ck, "w");
  NMT_ASSERT(f);
  fputs("not a checkpoint", f);
  fclose(f);
  const struct {
    const char *args;
    int code;
  } cases[] = {
      {"average %s", 2},                            /* no --output */
      {"average --last 0 %s --output x.ckpt", 2},   /* K >= 1 */
      {"eval conf/bible-small.ini --src %s", 2},    /* --src without --ref */
      {"eval conf/bible-small.ini --split train", 2},
      {"export %s", 2},                             /* no output path */
      {"average %s %s --output /dev/null/x", 7},    /* damaged input */
      {"export %s /dev/null/x.safetensors", 7},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char args[1024];
    snprintf(args, sizeof args, cases[i].args, ck, ck);
    snprintf(cmd, sizeof cmd, "%s/nmt %s 2>&1", bin, args);
    int code = nmt_th_capture(cmd, out, sizeof out);
    if (code != cases[i].code) {
      nmt_test_fail(__FILE__, __LINE__, "`nmt %s` exited %d, expected %d: %s", args, code,
                    cases[i].code, out);
      return;
    }
  }
}
