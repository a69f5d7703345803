/* test/test_decode_limits.c — the edges of decoding's range (src/model/decode.c, beam.c): the
 * minimum output length (nmt_decoder_set_min_len) that keeps a wide beam from ending on the
 * empty output, and the largest documented beam (decode.beam = 1024) running on one sentence.
 *
 * Issue 38: decode.beam >= 64 gave an empty line for every sentence. The search was right: a
 * beam of 64 reaches EOS at the first step (beam 16 did not), and log p(EOS | <s>) alone beat
 * every longer hypothesis even after the length penalty. An untrained model shows the same,
 * since every token there has log p ~ -log V: the empty output wins any search that reaches it. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/backend.h"
#include "nmt/model.h"
#include "nmt/ref.h"
#include "test.h"

static const nmt_backend *BE = &nmt_backend_ref;

enum { NB = 4, TS = 6, MAX_OUT = 12, EXTRA = 6, MAXT = 16 };

typedef struct {
  nmt_model_cfg cfg;
  nmt_model *m;
  float *params; /* device (ref: host memory through the table) */
  int32_t *mem;  /* the batch */
  nmt_batch b;
} fixture;

/* An untrained pre-LN model (vocab 29, d_model 16, 1+1 layers) and NB random sources of
 * TS - 1 ids and EOS. */
static nmt_status fixture_open(fixture *f, uint64_t seed) {
  memset(f, 0, sizeof *f);
  f->cfg = (nmt_model_cfg){.vocab = 29, .d_model = 16, .n_heads = 2, .d_ff = 24,
                           .enc_layers = 1, .dec_layers = 1, .max_positions = 40,
                           .norm = NMT_NORM_PRE, .ln_eps = 1e-5f};
  const size_t n = nmt_model_num_params(&f->cfg);
  float *h = malloc(n * sizeof *h);
  if (!h) return NMT_ERR_NOMEM;
  nmt_model_init_params(&f->cfg, seed, h);
  nmt_status st = nmt_model_create(&f->cfg, BE, NULL, NB * MAXT, MAXT, &f->m);
  if (st == NMT_OK) st = BE->malloc(NULL, n * sizeof(float), (void **)&f->params);
  if (st == NMT_OK) st = BE->copy_h2d(NULL, f->params, h, n * sizeof(float));
  free(h);
  const size_t ni = nmt_batch_ints(NB, TS);
  int32_t *hb_mem = calloc(ni, sizeof *hb_mem);
  if (st == NMT_OK && !hb_mem) st = NMT_ERR_NOMEM;
  if (st == NMT_OK) st = BE->malloc(NULL, ni * sizeof(int32_t), (void **)&f->mem);
  if (st == NMT_OK) {
    nmt_batch hb;
    nmt_batch_layout(&hb, hb_mem, NB, TS, 1);
    for (int i = 0; i < NB; i++) {
      for (int t = 0; t < TS; t++)
        hb.src[i * TS + t] =
            t < TS - 1 ? 4 + (int32_t)((seed + 7u * i + 3u * t) % 25u) : NMT_EOS_ID;
      hb.src_lens[i] = TS;
      hb.tgt_in[i] = NMT_BOS_ID;
      hb.tgt_out[i] = NMT_PAD_ID;
      hb.tgt_lens[i] = 1;
    }
    st = BE->copy_h2d(NULL, f->mem, hb_mem, ni * sizeof(int32_t));
    nmt_batch_layout(&f->b, f->mem, NB, TS, 1);
  }
  free(hb_mem);
  return st;
}

static void fixture_close(fixture *f) {
  if (f->m) nmt_model_destroy(f->m);
  if (f->params) BE->free(NULL, f->params);
  if (f->mem) BE->free(NULL, f->mem);
}

/* Rigs the model so that EOS has the highest logit at every step (test_decode.c's way for
 * <s>: the decoder's final LayerNorm bias along EOS's embedding row, made the longest). */
static nmt_status rig_eos(fixture *f) {
  const nmt_model_cfg *c = &f->cfg;
  const size_t n = nmt_model_num_params(c);
  const int nt = nmt_model_param_table(c, NULL), C = c->d_model;
  nmt_param_info *tab = malloc((size_t)nt * sizeof *tab);
  float *h = malloc(n * sizeof *h);
  nmt_status st = tab && h ? NMT_OK : NMT_ERR_NOMEM;
  if (st == NMT_OK) nmt_model_param_table(c, tab);
  if (st == NMT_OK) st = BE->copy_d2h(NULL, h, f->params, n * sizeof(float));
  size_t embed = 0, ln_b = 0;
  for (int i = 0; st == NMT_OK && i < nt; i++) {
    if (!strcmp(tab[i].name, "embed.weight")) embed = tab[i].offset;
    if (!strcmp(tab[i].name, "decoder.ln_f.bias")) ln_b = tab[i].offset;
  }
  if (st == NMT_OK && (embed == 0 || ln_b == 0)) st = NMT_ERR_INTERNAL;
  if (st == NMT_OK) {
    float *row = h + embed + (size_t)NMT_EOS_ID * C;
    for (int j = 0; j < C; j++) row[j] = j % 3 ? 1.0f : -1.0f;
    for (int j = 0; j < C; j++) h[ln_b + j] = (float)(50.0 * row[j] / sqrt((double)C));
    st = BE->copy_h2d(NULL, f->params, h, n * sizeof(float));
  }
  free(tab), free(h);
  return st;
}

static int shortest(const int32_t *lens, int n) {
  int s = lens[0];
  for (int i = 1; i < n; i++) s = lens[i] < s ? lens[i] : s;
  return s;
}

/* A wide beam on an untrained model: the full search reaches EOS at step 0 and ends empty
 * unless the minimum length forbids it. Fails before the fix: every output had length 0. */
NMT_TEST(decode_wide_beam_is_not_empty) {
  fixture f;
  nmt_decoder *d;
  int32_t ids[NB * MAX_OUT], lens[NB];
  NMT_ASSERT_OK(fixture_open(&f, 5));
  NMT_ASSERT_OK(nmt_decoder_create(f.m, &d));
  /* The library's plain search (min_len 0) shows the cause: the empty output wins. */
  NMT_ASSERT_OK(nmt_decoder_beam(d, f.params, &f.b, 64, 0.6f, NMT_BEAM_SHRINK, MAX_OUT, EXTRA,
                                 ids, lens, NULL));
  NMT_ASSERT_EQ_INT(shortest(lens, NB), 0);
  NMT_ASSERT_OK(nmt_decoder_set_min_len(d, 1));
  for (int rule = NMT_BEAM_SHRINK; rule <= NMT_BEAM_FULL; rule++) {
    NMT_ASSERT_OK(nmt_decoder_beam(d, f.params, &f.b, 64, 0.6f, (nmt_beam_rule)rule, MAX_OUT,
                                   EXTRA, ids, lens, NULL));
    printf("# beam 64, rule %d, min_len 1: shortest output %d tokens\n", rule, shortest(lens, NB));
    NMT_ASSERT(shortest(lens, NB) >= 1);
  }
  NMT_ASSERT_EQ_STATUS(nmt_decoder_set_min_len(d, -1), NMT_ERR_USAGE);
  nmt_decoder_destroy(d);
  fixture_close(&f);
}

/* EOS the best id at every step: min_len tokens come out before it, for greedy and beam
 * search alike (beam 1 still equals greedy); the length limit still ends first. */
NMT_TEST(decode_min_len_holds_eos_back) {
  fixture f;
  nmt_decoder *d;
  int32_t g_ids[NB * MAX_OUT], g_lens[NB], b_ids[NB * MAX_OUT], b_lens[NB];
  NMT_ASSERT_OK(fixture_open(&f, 9));
  NMT_ASSERT_OK(rig_eos(&f));
  NMT_ASSERT_OK(nmt_decoder_create(f.m, &d));
  NMT_ASSERT_OK(nmt_decoder_greedy(d, f.params, &f.b, MAX_OUT, EXTRA, g_ids, g_lens));
  NMT_ASSERT_EQ_INT(shortest(g_lens, NB), 0); /* the rig works: EOS first */
  const int min_lens[] = {1, 3, MAX_OUT + 5};
  for (int m = 0; m < 3; m++) {
    const int want = min_lens[m] < MAX_OUT ? min_lens[m] : MAX_OUT;
    NMT_ASSERT_OK(nmt_decoder_set_min_len(d, min_lens[m]));
    NMT_ASSERT_OK(nmt_decoder_greedy(d, f.params, &f.b, MAX_OUT, EXTRA, g_ids, g_lens));
    NMT_ASSERT_OK(nmt_decoder_beam(d, f.params, &f.b, 1, 0.6f, NMT_BEAM_SHRINK, MAX_OUT, EXTRA,
                                   b_ids, b_lens, NULL));
    for (int i = 0; i < NB; i++) {
      NMT_ASSERT_EQ_INT(g_lens[i], want);
      NMT_ASSERT_EQ_INT(b_lens[i], g_lens[i]);
      for (int j = 0; j < g_lens[i]; j++) {
        NMT_ASSERT(g_ids[i * MAX_OUT + j] != NMT_EOS_ID);
        NMT_ASSERT_EQ_INT(b_ids[i * MAX_OUT + j], g_ids[i * MAX_OUT + j]);
      }
    }
    for (int rule = NMT_BEAM_SHRINK; rule <= NMT_BEAM_FULL; rule++) {
      NMT_ASSERT_OK(nmt_decoder_beam(d, f.params, &f.b, 4, 0.6f, (nmt_beam_rule)rule, MAX_OUT,
                                     EXTRA, b_ids, b_lens, NULL));
      for (int i = 0; i < NB; i++) NMT_ASSERT_EQ_INT(b_lens[i], want);
    }
  }
  nmt_decoder_destroy(d);
  fixture_close(&f);
}

/* decode.beam's documented maximum, 1024, runs on one sentence (1024 rows), and 1025 is
 * refused: a guard of the documented range (it passed before issue 38's fixes too). */
NMT_TEST(decode_beam_1024_runs) {
  fixture f;
  nmt_decoder *d;
  int32_t ids[NB * MAX_OUT], lens[NB];
  NMT_ASSERT_OK(fixture_open(&f, 5));
  NMT_ASSERT_OK(nmt_decoder_create(f.m, &d));
  NMT_ASSERT_OK(nmt_decoder_set_min_len(d, 1));
  nmt_batch one = f.b;
  one.n_sent = 1;
  for (int rule = NMT_BEAM_SHRINK; rule <= NMT_BEAM_FULL; rule++) {
    NMT_ASSERT_OK(nmt_decoder_beam(d, f.params, &one, 1024, 0.6f, (nmt_beam_rule)rule, MAX_OUT,
                                   EXTRA, ids, lens, NULL));
    NMT_ASSERT(lens[0] >= 1);
  }
  NMT_ASSERT_EQ_STATUS(nmt_decoder_beam(d, f.params, &one, NMT_TOPK_MAX / 2 + 1, 0.6f,
                                        NMT_BEAM_SHRINK, MAX_OUT, EXTRA, ids, lens, NULL),
                       NMT_ERR_USAGE);
  nmt_decoder_destroy(d);
  fixture_close(&f);
}
