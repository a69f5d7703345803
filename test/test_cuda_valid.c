/* test/test_cuda_valid.c — validation BLEU's decoder rig on a GPU (src/engine/valid.c
 * nmt__valid_open, src/engine/translate_batch.c): the rig a trainer opens once, at create, on
 * rank 0's device with the run's abort flag, and decodes the valid source on at every
 * validation while the other ranks wait in an all-reduce.
 *
 * What a validation relies on, checked on the device: the rig is on the device backend and its
 * context carries the abort flag; the reservation at open decoded there (its GEMMs ran, so
 * cuBLASLt's kernels are loaded before any collective); a validation's load of new parameters
 * and its decoding grow no scratch (no cudaMalloc while NCCL kernels wait); the decoding equals
 * the CPU reference's (ids exact, scores within 1e-4: fp32 GEMMs in other summation orders);
 * a raised flag ends the decoding with NMT_ERR_ABORTED; in bf16 the half copy made at open
 * holds the rounding of the uploaded parameters. The rig is opened by nmt__valid_open itself,
 * with the setup nmt__valid_setup would make (it needs sacreBLEU and the raw valid text, which
 * the decoder does not). Without a device: "# SKIP no CUDA device"; with
 * -DNMT_CUDA_TESTS_ON_REF (test/gpu_helpers.h) the reference plays the device. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_helpers.h"
#include "helpers.h"
#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/model.h"
#include "nmt/rng.h"
#include "test.h"
#include "../src/engine/valid.h" /* nmt__valid_open and its decoder rig */

enum { N_SRC = 4, LONGEST = 6 };

/* The tiny model with what a trainer's validation setup makes of it: train.valid_beam = 4
 * (beam search, so that scores show the arithmetic even where a random model stops at once),
 * batches of 4 sources, data.max_len raised to model.max_positions (valid.c decode_config
 * raises it to the longest source + 1 + decode.max_extra_len, capped there). */
static void valid_config(nmt_config *c, nmt_precision mode) {
  nmt_th_tiny_config(c, "/nonexistent", "/nonexistent");
  c->decode_beam = 4;
  c->decode_batch_sentences = N_SRC;
  c->data_max_len = c->model_max_positions;
  c->decode_max_extra_len = 4; /* outputs of at most 11 ids: fewer choices to compare */
  c->precision_mode = mode;
}

/* Parameters of seed `seed` (malloc'ed; NULL when out of memory), the embedding (tied to the
 * output projection) scaled by 4: a random tiny model's next-token distributions are nearly
 * flat, and wider gaps between logits keep the search's choices away from ties that the
 * backends' summation orders (1e-6 apart) could break differently. */
static float *params(const nmt_config *c, uint64_t seed, size_t *n) {
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(c, &mc);
  *n = nmt_model_num_params(&mc);
  float *p = malloc(*n * sizeof(float));
  const int nt = nmt_model_param_table(&mc, NULL);
  nmt_param_info *t = malloc((size_t)nt * sizeof *t);
  if (p && t) {
    nmt_model_init_params(&mc, seed, p);
    nmt_model_param_table(&mc, t);
    for (int i = 0; i < nt; i++)
      if (!strcmp(t[i].name, "embed.weight"))
        for (size_t j = 0; j < t[i].numel; j++) p[t[i].offset + j] *= 4.0f;
  }
  free(t);
  return p;
}

/* The valid split's stand-in: N_SRC sources of 3..LONGEST ids. */
static void sources(nmt__sentence *s, int32_t ids[N_SRC][LONGEST]) {
  for (int i = 0; i < N_SRC; i++) {
    s[i] = (nmt__sentence){ids[i], i == N_SRC - 1 ? LONGEST : 3 + i, i + 1};
    for (int j = 0; j < LONGEST; j++)
      ids[i][j] = 4 + (int32_t)(nmt_rng_u32(11, (uint64_t)i, j) % 36);
  }
}

/* One batch of the N_SRC sources on rig r into h (allocated here; free with nmt__hyps_free). */
static nmt_status decode(nmt__rig *r, const nmt__sentence *s, nmt__hyps *h) {
  const int order[N_SRC] = {0, 1, 2, 3};
  NMT_TRY(nmt__hyps_alloc(h, N_SRC, 1, r->cfg->data_max_len - 1));
  return nmt__rig_decode(r, s, order, N_SRC, h);
}

/* The setup nmt__valid_setup makes on rank 0 (on, the decoding config, the longest source). */
static void valid_setup(nmt__valid_bleu_setup *vb, const nmt_config *c) {
  memset(vb, 0, sizeof *vb);
  vb->on = 1;
  vb->dcfg = *c;
  vb->longest = LONGEST;
}

NMT_TEST(cuda_valid_decoder_rig_on_the_device) {
  const nmt_backend *be = nmt_tg_device_backend();
  int n_dev = 0;
  if (!be || be->device_count(&n_dev) != NMT_OK || n_dev < 1) NMT_SKIP("no CUDA device");
  nmt_config c;
  valid_config(&c, NMT_PRECISION_FP32);
  size_t n = 0;
  float *pa = params(&c, 3, &n), *pb = params(&c, 4, &n);
  nmt__sentence s[N_SRC];
  int32_t ids[N_SRC][LONGEST];
  sources(s, ids);
  nmt__valid_bleu_setup vb;
  valid_setup(&vb, &c);
  atomic_int abort_flag = 0;
  nmt__rig cpu;
  memset(&cpu, 0, sizeof cpu);
  nmt__hyps hd, hc;
  memset(&hd, 0, sizeof hd), memset(&hc, 0, sizeof hc);
  nmt_backend_counters at_open = {0}, after = {0};
  nmt_status s_open = NMT_ERR_NOMEM, s_dec = NMT_ERR_INTERNAL, s_cpu = NMT_ERR_INTERNAL;
  nmt_status s_abort = NMT_ERR_INTERNAL;
  if (pa && pb) s_open = nmt__valid_open(&vb, be, &abort_flag, pa);
  const int on_device = s_open == NMT_OK && vb.rig.dev.be == be && vb.rig.dec != NULL;
  const int abort_reaches = s_open == NMT_OK && vb.rig.abort == &abort_flag;
  if (on_device) {
    /* A validation: the trainer's parameters loaded into the open rig, then decoded. */
    nmt_status st = vb.rig.dev.be->counters(vb.rig.dev.ctx, &at_open);
    if (st == NMT_OK) st = nmt__rig_load(&vb.rig, pb);
    if (st == NMT_OK) st = decode(&vb.rig, s, &hd);
    if (st == NMT_OK) st = vb.rig.dev.be->counters(vb.rig.dev.ctx, &after);
    s_dec = st;
    atomic_store(&abort_flag, 1);
    nmt__hyps ha;
    s_abort = decode(&vb.rig, s, &ha);
    nmt__hyps_free(&ha);
    atomic_store(&abort_flag, 0);
    /* The CPU reference's rig of the same parameters. */
    s_cpu = nmt__rig_open_on(&cpu, &c, &nmt_backend_ref, NULL, pb, 1, 0);
    if (s_cpu == NMT_OK) s_cpu = decode(&cpu, s, &hc);
  }
  nmt__rig_close(&cpu);
  nmt__valid_free(&vb);
  printf("# decoder rig on %s: abort flag %s its context; GEMMs at open %llu, scratch growths "
         "in a validation %llu; lengths %d %d %d %d (cpu %d %d %d %d); raised flag: %s\n",
         on_device ? be->name : "-", abort_reaches ? "reaches" : "does not reach",
         (unsigned long long)at_open.gemm_calls,
         (unsigned long long)(after.scratch_growths - at_open.scratch_growths),
         hd.len ? hd.len[0] : -1, hd.len ? hd.len[1] : -1, hd.len ? hd.len[2] : -1,
         hd.len ? hd.len[3] : -1, hc.len ? hc.len[0] : -1, hc.len ? hc.len[1] : -1,
         hc.len ? hc.len[2] : -1, hc.len ? hc.len[3] : -1, nmt_status_str(s_abort));
  int same_ids = s_dec == NMT_OK && s_cpu == NMT_OK;
  for (int i = 0; same_ids && i < N_SRC; i++)
    same_ids = hd.len[i] == hc.len[i] &&
               !memcmp(&hd.ids[(size_t)i * hd.max_out], &hc.ids[(size_t)i * hc.max_out],
                       (size_t)hd.len[i] * sizeof(int32_t));
  int close = same_ids && nmt_test_close(__FILE__, __LINE__, "scores vs cpu", hd.score,
                                         hc.score, N_SRC, 1e-4, 1e-4);
  nmt__hyps_free(&hd), nmt__hyps_free(&hc);
  free(pa), free(pb);
  NMT_ASSERT_OK(s_open);
  NMT_ASSERT(on_device);
  NMT_ASSERT(abort_reaches);
  NMT_ASSERT(at_open.gemm_calls > 0);
  NMT_ASSERT_OK(s_dec);
  NMT_ASSERT_EQ_INT((long)(after.scratch_growths - at_open.scratch_growths), 0);
  NMT_ASSERT(after.gemm_calls > at_open.gemm_calls);
  NMT_ASSERT_EQ_STATUS(s_abort, NMT_ERR_ABORTED);
  NMT_ASSERT_OK(s_cpu);
  NMT_ASSERT(same_ids);
  NMT_ASSERT(close);
}

/* In bf16 the rig makes its half copy at open (a device infers in the run's precision): after
 * nmt__valid_open it holds the rounding of the parameters given, bit for bit. The reference
 * playing the device infers in fp32 and makes none (nothing to check there). */
NMT_TEST(cuda_valid_decoder_rig_half_copy_bf16) {
  const nmt_backend *be = nmt_tg_device_backend();
  int n_dev = 0;
  if (!be || be->device_count(&n_dev) != NMT_OK || n_dev < 1) NMT_SKIP("no CUDA device");
  nmt_config c;
  valid_config(&c, NMT_PRECISION_BF16);
  size_t n = 0;
  float *pa = params(&c, 3, &n);
  uint16_t *bits = malloc(n * sizeof(uint16_t));
  nmt__valid_bleu_setup vb;
  valid_setup(&vb, &c);
  atomic_int abort_flag = 0;
  nmt_status s = pa && bits ? nmt__valid_open(&vb, be, &abort_flag, pa) : NMT_ERR_NOMEM;
  const int half = s == NMT_OK && vb.rig.dev.precision == NMT_PRECISION_BF16;
  if (half) s = vb.rig.half ? be->copy_d2h(vb.rig.dev.ctx, bits, vb.rig.half, n * 2)
                            : NMT_ERR_INTERNAL;
  const int made = half && vb.rig.half != NULL;
  nmt__valid_free(&vb);
  printf("# bf16 decoder rig on %s: %s\n", be->name,
         half ? (made ? "half copy made at open" : "NO half copy") : "fp32 inference, no copy");
  int same = 1;
  if (s == NMT_OK && half) same = nmt_tg_same_half(NMT_PRECISION_BF16, "half copy", bits, pa, n);
  free(pa), free(bits);
  NMT_ASSERT_OK(s);
  NMT_ASSERT(same);
}
