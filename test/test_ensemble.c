/* test_ensemble.c — ensemble decoding (issue 37 item 2: `nmt translate --ensemble A B ...`,
 * nmt_decoder_ensemble), end to end with the binary on small random models that carry their
 * configs: a model in an ensemble with itself (or alone, or at equal weights given) decodes
 * bitwise as the model alone, greedy and beam, text and n-best scores; two models of different
 * shapes at weights 0.7/0.3 against an independent PyTorch reference of the averaged search
 * (test/ensemble_ref.py: greedy ids and scores, every n-best hypothesis's ensemble
 * log-probability); and the refusals: another vocabulary or SentencePiece model (exit 7,
 * naming both checkpoints), and bad --ensemble / --weights arguments (exit 2). On a GPU
 * (cuda_translate_ensemble_matches_cpu, in gpu-check's cuda_translate group): the device's
 * ensemble against the CPU's, and bitwise self-ensemble there too. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "helpers.h"
#include "nmt/backend.h"
#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/model.h"
#include "nmt/rng.h"
#include "nmt/translate.h"
#include "test.h"

enum { VOCAB = 50, MAX_LEN = 32, N_SRC = 24 };

/* A checkpoint of a random model (nmt's init plus uniform noise, so that the outputs depend on
 * the source) that embeds its config (d_model 16, 2 heads, d_ff, 2+2 layers, vocabulary
 * `vocab`, data.max_len 32, no SentencePiece model unless `spm` names one). */
static int write_model(const char *path, int vocab, int d_ff, uint64_t seed, const char *spm) {
  nmt_config c;
  nmt_config_defaults(&c);
  c.model_vocab = vocab, c.model_d_model = 16, c.model_n_heads = 2, c.model_d_ff = d_ff;
  c.model_enc_layers = c.model_dec_layers = 2, c.model_max_positions = 64;
  c.data_max_len = MAX_LEN, c.decode_batch_sentences = 8;
  snprintf(c.data_spm_model, sizeof c.data_spm_model, "%s", spm ? spm : "");
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(&c, &mc);
  const size_t n = nmt_model_num_params(&mc);
  float *p = malloc(n * sizeof *p);
  if (!p) return -1;
  nmt_model_init_params(&mc, seed, p);
  for (size_t i = 0; i < n; i++) p[i] += 0.5f * (2.0f * nmt_rng_uniform(seed, 91, i) - 1.0f);
  nmt_ckpt_header h;
  nmt_ckpt_expect_from_config(&c, &h);
  h.step = (int64_t)seed, h.seed = 1, h.loss_scale = 1.0f;
  nmt_ckpt_meta meta;
  nmt_status s = nmt_ckpt_meta_from_config(&c, &meta);
  h.meta = &meta;
  if (s == NMT_OK) s = nmt_ckpt_write(path, &h, p, NULL, NULL);
  nmt_ckpt_meta_free(&meta);
  free(p);
  return s == NMT_OK ? 0 : -1;
}

typedef struct {
  char dir[512], a[768], b[768], src[768];
} models;

/* Two models (B with another d_ff) and N_SRC source lines of 1..20 random ids. */
static int setup(models *m) {
  snprintf(m->dir, sizeof m->dir, "%s", nmt_test_tmpdir());
  snprintf(m->a, sizeof m->a, "%s/a.ckpt", m->dir);
  snprintf(m->b, sizeof m->b, "%s/b.ckpt", m->dir);
  snprintf(m->src, sizeof m->src, "%s/src.ids", m->dir);
  if (write_model(m->a, VOCAB, 24, 3, NULL) || write_model(m->b, VOCAB, 40, 4, NULL)) return 0;
  FILE *f = fopen(m->src, "w");
  if (!f) return 0;
  for (int i = 0; i < N_SRC; i++) {
    const int len = 1 + (int)(nmt_rng_u32(5, 1, (uint64_t)i) % 20);
    for (int j = 0; j < len; j++)
      fprintf(f, "%s%u", j ? " " : "", 4 + nmt_rng_u32(5, 2, (uint64_t)(i * 64 + j)) % (VOCAB - 4));
    fputc('\n', f);
  }
  return fclose(f) == 0;
}

/* `nmt translate ARGS --ids --input SRC` with stdout to DIR/NAME; returns the exit code. */
static int translate(const models *m, const char *args, const char *name) {
  char cmd[12288];
  snprintf(cmd, sizeof cmd, "%s/nmt translate %s --ids --input %s >%s/%s 2>%s/%s.err",
           nmt_test_build_dir(), args, m->src, m->dir, name, m->dir, name);
  fflush(stdout);
  int st = system(cmd);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int same_files(const models *m, const char *x, const char *y) {
  char p[1200], q[1200];
  snprintf(p, sizeof p, "%s/%s", m->dir, x);
  snprintf(q, sizeof q, "%s/%s", m->dir, y);
  size_t n1, n2;
  char *a = nmt_th_read_file(p, &n1), *b = nmt_th_read_file(q, &n2);
  int same = a && b && n1 == n2 && n1 > 0 && !memcmp(a, b, n1);
  if (!same)
    nmt_test_fail(__FILE__, __LINE__, "%s and %s differ:\n%.300s\n---\n%.300s", p, q,
                  a ? a : "(none)", b ? b : "(none)");
  free(a), free(b);
  return same;
}

NMT_TEST(ensemble_of_one_model_is_the_model_bitwise) {
  models m;
  NMT_ASSERT(setup(&m));
  char args[3000];
  static const char *const search[] = {"decode.beam=1", "decode.beam=4 --scores",
                                       "decode.beam=4 --nbest 3", "decode.beam=3 "
                                       "decode.beam_rule=full --nbest 2"};
  for (size_t s = 0; s < sizeof search / sizeof *search; s++) {
    snprintf(args, sizeof args, "%s %s", m.a, search[s]);
    NMT_ASSERT_EQ_INT(translate(&m, args, "alone"), 0);
    snprintf(args, sizeof args, "--ensemble %s %s %s", m.a, m.a, search[s]);
    NMT_ASSERT_EQ_INT(translate(&m, args, "twice"), 0);
    snprintf(args, sizeof args, "%s --ensemble %s --weights 2 2 %s", m.a, m.a, search[s]);
    NMT_ASSERT_EQ_INT(translate(&m, args, "weighted"), 0);
    snprintf(args, sizeof args, "--ensemble %s %s", m.a, search[s]);
    NMT_ASSERT_EQ_INT(translate(&m, args, "one"), 0);
    if (!same_files(&m, "alone", "twice") || !same_files(&m, "alone", "weighted") ||
        !same_files(&m, "alone", "one"))
      nmt_test_fail(__FILE__, __LINE__, "search %s", search[s]);
  }
  /* The ensemble is not the model: B's votes move A's output. */
  snprintf(args, sizeof args, "--ensemble %s %s decode.beam=4 --scores", m.a, m.b);
  NMT_ASSERT_EQ_INT(translate(&m, args, "both"), 0);
  snprintf(args, sizeof args, "%s decode.beam=4 --scores", m.a);
  NMT_ASSERT_EQ_INT(translate(&m, args, "alone"), 0);
  char p[1200], q[1200];
  snprintf(p, sizeof p, "%s/alone", m.dir);
  snprintf(q, sizeof q, "%s/both", m.dir);
  char *a = nmt_th_read_file(p, NULL), *b = nmt_th_read_file(q, NULL);
  NMT_ASSERT(a && b && strcmp(a, b) != 0);
  free(a), free(b);
}

NMT_TEST(ensemble_matches_pytorch_reference) {
  char out[8192], cmd[8192];
  if (nmt_th_capture("/usr/bin/python3 -c 'import torch, numpy' 2>&1", out, sizeof out) != 0)
    NMT_SKIP("/usr/bin/python3 cannot import torch (Debian python3-torch; tools/install-deps.sh "
             "installs it)");
  models m;
  NMT_ASSERT(setup(&m));
  const char *nmt = nmt_test_build_dir();
  snprintf(cmd, sizeof cmd, "%s/nmt export %s %s/a.safetensors 2>&1 && %s/nmt export %s "
           "%s/b.safetensors 2>&1", nmt, m.a, m.dir, nmt, m.b, m.dir);
  if (nmt_th_capture(cmd, out, sizeof out) != 0) {
    nmt_test_fail(__FILE__, __LINE__, "%s: %s", cmd, out);
    return;
  }
  char args[3000];
  snprintf(args, sizeof args, "--ensemble %s %s --weights 0.7 0.3 decode.beam=1 --scores", m.a,
           m.b);
  NMT_ASSERT_EQ_INT(translate(&m, args, "greedy"), 0);
  snprintf(args, sizeof args, "--ensemble %s %s --weights 0.7 0.3 decode.beam=4 --nbest 4", m.a,
           m.b);
  NMT_ASSERT_EQ_INT(translate(&m, args, "nbest"), 0);
  snprintf(cmd, sizeof cmd, "/usr/bin/python3 test/ensemble_ref.py --models %s/a.safetensors "
           "%s/b.safetensors --weights 0.7 0.3 --src %s --greedy %s/greedy --nbest %s/nbest "
           "--max-len %d 2>&1", m.dir, m.dir, m.src, m.dir, m.dir, MAX_LEN);
  int rc = nmt_th_capture(cmd, out, sizeof out);
  printf("# %s", out);
  /* The search must have something to choose: different outputs for different sources. */
  char path[1200];
  snprintf(path, sizeof path, "%s/greedy", m.dir);
  char *g = nmt_th_read_file(path, NULL);
  NMT_ASSERT(g);
  /* lines (ids before " |||") that differ from every earlier line */
  const char *line[N_SRC] = {""};
  int n = 0, distinct = 0;
  for (char *p = g; *p && n < N_SRC; n++) {
    line[n] = p;
    char *bar = strstr(p, " |||"), *eol = strchr(p, '\n');
    if (bar) *bar = 0;
    p = eol ? eol + 1 : p + strlen(p);
    int seen = 0;
    for (int k = 0; k < n; k++) seen |= !strcmp(line[k], line[n]);
    distinct += !seen;
  }
  printf("# %d distinct greedy outputs of %d; the first: %.80s\n", distinct, n, line[0]);
  free(g);
  NMT_ASSERT(distinct >= N_SRC / 3);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d:\n%s", cmd, rc, out);
}

NMT_TEST(ensemble_refuses_other_vocabularies_and_bad_arguments) {
  models m;
  NMT_ASSERT(setup(&m));
  char c[800], d[800], args[3000], err[1200];
  snprintf(c, sizeof c, "%s/c.ckpt", m.dir);
  snprintf(d, sizeof d, "%s/d.ckpt", m.dir);
  NMT_ASSERT_EQ_INT(write_model(c, VOCAB + 8, 24, 5, NULL), 0);
  NMT_ASSERT_EQ_INT(write_model(d, VOCAB, 24, 6, "data/bible/spm.model"), 0);
  snprintf(err, sizeof err, "%s/refused.err", m.dir);
  /* another vocabulary, another SentencePiece model: exit 7, both checkpoints named */
  const char *other[2] = {c, d};
  for (int k = 0; k < 2; k++) {
    snprintf(args, sizeof args, "--ensemble %s %s", m.a, other[k]);
    NMT_ASSERT_EQ_INT(translate(&m, args, "refused"), 7);
    char *e = nmt_th_read_file(err, NULL);
    NMT_ASSERT(e && strstr(e, m.a) && strstr(e, other[k]));
    NMT_ASSERT(strstr(e, k == 0 ? "model.vocab" : "SentencePiece"));
    free(e);
  }
  /* usage errors: exit 2 */
  static const char *const bad[] = {"--ensemble", "--ensemble --scores", "--weights 1 1 1",
                                    "--weights 1 -1", "--weights x"};
  for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
    snprintf(args, sizeof args, "%s %s%s", m.a, bad[k], k < 2 ? "" : " --ensemble ");
    if (k >= 2) strncat(args, m.b, sizeof args - strlen(args) - 1);
    const int rc = translate(&m, args, "refused");
    if (rc != 2) nmt_test_fail(__FILE__, __LINE__, "translate %s: exit %d, want 2", args, rc);
  }
}

/* The ensemble on a GPU: two models (weights 0.7/0.3), greedy and beam 4 with scores, decode as
 * on the CPU reference but for the order of fp32 sums (nearly every line identical, every F0
 * within 1e-3 where the ids agree), and a model with itself decodes bitwise as alone on the
 * device too (logp_at's bits are logp_topk's there as well). */
NMT_TEST(cuda_translate_ensemble_matches_cpu) {
  const nmt_backend *be = nmt_backend_cuda_get();
  int n_dev = 0;
  if (!be || be->device_count(&n_dev) != NMT_OK || n_dev < 1) NMT_SKIP("no CUDA device");
  models m;
  NMT_ASSERT(setup(&m));
  char args[3000];
  for (int beam = 1; beam <= 4; beam += 3) {
    for (int dev = 0; dev < 2; dev++) {
      snprintf(args, sizeof args, "--ensemble %s %s --weights 0.7 0.3 decode.beam=%d --scores "
               "parallel.device=%s", m.a, m.b, beam, dev ? "cuda" : "cpu");
      NMT_ASSERT_EQ_INT(translate(&m, args, dev ? "gpu" : "cpu"), 0);
    }
    char p[1200], q[1200];
    snprintf(p, sizeof p, "%s/cpu", m.dir);
    snprintf(q, sizeof q, "%s/gpu", m.dir);
    char *a = nmt_th_read_file(p, NULL), *b = nmt_th_read_file(q, NULL);
    NMT_ASSERT(a && b);
    int lines = 0, same = 0;
    for (char *x = a, *y = b; *x && *y; lines++) {
      char *xe = strchr(x, '\n'), *ye = strchr(y, '\n');
      if (!xe || !ye) break;
      *xe = *ye = 0;
      const char *xb = strstr(x, " ||| F0= "), *yb = strstr(y, " ||| F0= ");
      if (xb && yb && xb - x == yb - y && !strncmp(x, y, (size_t)(xb - x))) {
        same++;
        if (fabs(atof(xb + 9) - atof(yb + 9)) > 1e-3)
          nmt_test_fail(__FILE__, __LINE__, "beam %d line %d: F0 %s on the CPU, %s on the GPU",
                        beam, lines, xb + 9, yb + 9);
      }
      x = xe + 1, y = ye + 1;
    }
    free(a), free(b);
    printf("# beam %d: %d of %d ensemble lines identical on GPU and CPU\n", beam, same, lines);
    NMT_ASSERT_EQ_INT(lines, N_SRC);
    NMT_ASSERT(same >= N_SRC * 9 / 10);
  }
  snprintf(args, sizeof args, "%s decode.beam=4 --scores parallel.device=cuda", m.a);
  NMT_ASSERT_EQ_INT(translate(&m, args, "alone"), 0);
  snprintf(args, sizeof args, "--ensemble %s %s decode.beam=4 --scores parallel.device=cuda", m.a,
           m.a);
  NMT_ASSERT_EQ_INT(translate(&m, args, "twice"), 0);
  NMT_ASSERT(same_files(&m, "alone", "twice"));
}
