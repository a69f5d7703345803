/* bench/dump_batches.c — writes the training batches of the first N optimizer steps, in the
 * trainer's order, and optionally nmt's initial parameters, so that bench/pytorch_baseline.py
 * trains the same model from the same weights on the same batches as `nmt train`.
 *
 * usage: dump_batches CONFIG --steps N --out BATCHES [--params PARAMS] [section.key=value ...]
 *
 * Order (src/engine/loader.c, nmt__loader_main): optimizer step s uses the K = parallel.devices *
 * train.accum_steps batches at positions s*K .. s*K+K-1 of the epoch stream, position p of
 * epoch e being batch nmt_batcher_order(b, e, p); the stream rolls over to epoch e+1, index 0
 * after nmt_batcher_num_batches(b) positions. The batcher is built exactly as the trainer builds
 * it: nmt_batcher_create(train shard, data.max_tokens, data.max_len, run.seed). How the trainer
 * deals a step's K batches to workers does not change the step's update (gradients are summed
 * and divided by the step's total target tokens), so the file keeps them in position order.
 *
 * BATCHES file (little endian, native x86 layout):
 *   char magic[8] = "NMTBTCH1"
 *   u32  version = 1
 *   i32  n_steps, K, devices, accum_steps, max_tokens, max_len, vocab
 *   u64  seed
 *   n_steps*K records, step-major, then position order within the step:
 *     i32 n_sent, src_len, tgt_len, k            (k = position within the step, 0..K-1)
 *     i64 step, epoch, index, batch_id, src_tokens, tgt_tokens
 *     i32 src[n_sent*src_len], tgt_in[n_sent*tgt_len], tgt_out[n_sent*tgt_len],
 *         src_lens[n_sent], tgt_lens[n_sent]
 *   (src = x EOS, tgt_in = BOS y, tgt_out = y EOS, right-padded with PAD = 0; include/nmt/data.h)
 *
 * PARAMS file (little endian): nmt_model_init_params(model cfg, run.seed) in the flat layout of
 * include/nmt/model.h, with its tensor table so the reader can check its own layout:
 *   char magic[8] = "NMTPARM1"
 *   u32  version = 1
 *   i32  vocab, d_model, n_heads, d_ff, enc_layers, dec_layers, max_positions,
 *        norm (0 post, 1 pre), n_tensors
 *   f32  ln_eps
 *   u64  seed
 *   n_tensors x { char name[80] (NUL padded), i32 ndim, i32 shape[2], u64 offset, u64 numel }
 *   u64  n_params
 *   f32  params[n_params]
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/model.h"
#include "nmt/status.h"

static const char usage[] =
    "usage: dump_batches CONFIG --steps N --out BATCHES [--params PARAMS] [section.key=value ...]\n";

static nmt_status write_all(FILE *f, const void *p, size_t bytes, const char *path) {
  if (bytes && fwrite(p, 1, bytes, f) != bytes)
    return nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
  return NMT_OK;
}

static nmt_status close_file(FILE *f, const char *path) {
  if (fclose(f) != 0) return nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
  return NMT_OK;
}

static nmt_status write_batches(const nmt_config *cfg, long n_steps, const char *path) {
  nmt_status s = NMT_OK;
  nmt_shard *shard = NULL;
  nmt_batcher *b = NULL;
  int32_t *buf = NULL;
  FILE *f = NULL;
  NMT_TRY_GOTO(s, nmt_shard_open(cfg->data_train, cfg->model_vocab, &shard), out);
  NMT_TRY_GOTO(s, nmt_batcher_create(shard, cfg->data_max_tokens, cfg->data_max_len,
                                     cfg->run_seed, &b), out);
  f = fopen(path, "wb");
  if (!f) {
    s = nmt_errorf(NMT_ERR_IO, "cannot create %s: %s", path, strerror(errno));
    goto out;
  }
  const int K = cfg->parallel_devices * cfg->train_accum_steps;
  const long n_batches = nmt_batcher_num_batches(b);
  {
    int32_t h[7] = {(int32_t)n_steps, K, cfg->parallel_devices, cfg->train_accum_steps,
                    cfg->data_max_tokens, cfg->data_max_len, cfg->model_vocab};
    uint32_t version = 1;
    uint64_t seed = cfg->run_seed;
    NMT_TRY_GOTO(s, write_all(f, "NMTBTCH1", 8, path), out);
    NMT_TRY_GOTO(s, write_all(f, &version, sizeof version, path), out);
    NMT_TRY_GOTO(s, write_all(f, h, sizeof h, path), out);
    NMT_TRY_GOTO(s, write_all(f, &seed, sizeof seed, path), out);
  }
  /* The largest batch a trainer slot holds is 5*max_tokens+16 ints (the trainer's batch_ints);
   * size this buffer per batch instead so a batcher bug shows as a mismatch, not an overrun. */
  size_t cap = 0;
  long epoch = 0, index = 0, total_tgt = 0;
  for (long step = 0; step < n_steps; step++) {
    for (int k = 0; k < K; k++) {
      long id = nmt_batcher_order(b, epoch, index), tgt_tokens;
      int ns, sl, tl;
      nmt_batcher_shape(b, id, &ns, &sl, &tl, &tgt_tokens);
      size_t need = nmt_batch_ints(ns, sl > tl ? sl : tl);
      if (need > cap) {
        free(buf);
        cap = need;
        buf = malloc(cap * sizeof *buf);
        if (!buf) {
          s = nmt_errorf(NMT_ERR_NOMEM, "batch buffer of %zu ints", cap);
          goto out;
        }
      }
      nmt_batch bt;
      memset(&bt, 0, sizeof bt);
      nmt_batch_layout(&bt, buf, ns, sl, tl);
      nmt_batcher_fill(b, id, &bt);
      if (bt.tgt_tokens != tgt_tokens) {
        s = nmt_errorf(NMT_ERR_INTERNAL, "batch %ld: shape says %ld target tokens, fill %ld", id,
                       tgt_tokens, bt.tgt_tokens);
        goto out;
      }
      int32_t rh[4] = {ns, sl, tl, k};
      int64_t rl[6] = {step, epoch, index, id, bt.src_tokens, bt.tgt_tokens};
      size_t nsl = (size_t)ns * (size_t)sl, ntl = (size_t)ns * (size_t)tl;
      NMT_TRY_GOTO(s, write_all(f, rh, sizeof rh, path), out);
      NMT_TRY_GOTO(s, write_all(f, rl, sizeof rl, path), out);
      NMT_TRY_GOTO(s, write_all(f, bt.src, nsl * sizeof(int32_t), path), out);
      NMT_TRY_GOTO(s, write_all(f, bt.tgt_in, ntl * sizeof(int32_t), path), out);
      NMT_TRY_GOTO(s, write_all(f, bt.tgt_out, ntl * sizeof(int32_t), path), out);
      NMT_TRY_GOTO(s, write_all(f, bt.src_lens, (size_t)ns * sizeof(int32_t), path), out);
      NMT_TRY_GOTO(s, write_all(f, bt.tgt_lens, (size_t)ns * sizeof(int32_t), path), out);
      total_tgt += bt.tgt_tokens;
      /* The trainer's advance(): roll over to the next epoch's shuffled order. */
      if (++index >= n_batches) index = 0, ++epoch;
    }
  }
  s = close_file(f, path);
  f = NULL;
  if (s == NMT_OK)
    fprintf(stderr, "dump_batches: %s: %ld steps x %d batches (%ld batches per epoch), %ld target "
            "tokens\n", path, n_steps, K, n_batches, total_tgt);
out:
  if (f) fclose(f);
  free(buf);
  if (b) nmt_batcher_destroy(b);
  if (shard) nmt_shard_close(shard);
  return s;
}

static nmt_status write_params(const nmt_config *cfg, const char *path) {
  nmt_status s = NMT_OK;
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(cfg, &mc);
  size_t n = nmt_model_num_params(&mc);
  int nt = nmt_model_param_table(&mc, NULL);
  float *p = malloc(n * sizeof *p);
  nmt_param_info *tab = malloc((size_t)nt * sizeof *tab);
  FILE *f = NULL;
  if (!p || !tab) {
    s = nmt_errorf(NMT_ERR_NOMEM, "%zu parameters", n);
    goto out;
  }
  nmt_model_param_table(&mc, tab);
  nmt_model_init_params(&mc, cfg->run_seed, p);
  f = fopen(path, "wb");
  if (!f) {
    s = nmt_errorf(NMT_ERR_IO, "cannot create %s: %s", path, strerror(errno));
    goto out;
  }
  {
    uint32_t version = 1;
    int32_t h[9] = {mc.vocab, mc.d_model, mc.n_heads, mc.d_ff, mc.enc_layers,
                    mc.dec_layers, mc.max_positions, (int32_t)mc.norm, nt};
    uint64_t seed = cfg->run_seed, np = n;
    NMT_TRY_GOTO(s, write_all(f, "NMTPARM1", 8, path), out);
    NMT_TRY_GOTO(s, write_all(f, &version, sizeof version, path), out);
    NMT_TRY_GOTO(s, write_all(f, h, sizeof h, path), out);
    NMT_TRY_GOTO(s, write_all(f, &mc.ln_eps, sizeof mc.ln_eps, path), out);
    NMT_TRY_GOTO(s, write_all(f, &seed, sizeof seed, path), out);
    for (int i = 0; i < nt; i++) {
      char name[80] = {0};
      snprintf(name, sizeof name, "%s", tab[i].name);
      int32_t shape[3] = {tab[i].ndim, tab[i].shape[0], tab[i].ndim > 1 ? tab[i].shape[1] : 0};
      uint64_t om[2] = {tab[i].offset, tab[i].numel};
      NMT_TRY_GOTO(s, write_all(f, name, sizeof name, path), out);
      NMT_TRY_GOTO(s, write_all(f, shape, sizeof shape, path), out);
      NMT_TRY_GOTO(s, write_all(f, om, sizeof om, path), out);
    }
    NMT_TRY_GOTO(s, write_all(f, &np, sizeof np, path), out);
    NMT_TRY_GOTO(s, write_all(f, p, n * sizeof *p, path), out);
  }
  s = close_file(f, path);
  f = NULL;
  if (s == NMT_OK)
    fprintf(stderr, "dump_batches: %s: %d tensors, %zu parameters (seed %llu)\n", path, nt, n,
            (unsigned long long)cfg->run_seed);
out:
  if (f) fclose(f);
  free(p);
  free(tab);
  return s;
}

static int fail(nmt_status s) {
  fprintf(stderr, "dump_batches: %s: %s\n", nmt_status_desc(s), nmt_last_error());
  return nmt_status_exit_code(s);
}

int main(int argc, char **argv) {
  const char *config = NULL, *out = NULL, *params = NULL;
  const char *overrides[256];
  int n_overrides = 0;
  long steps = -1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--steps") && i + 1 < argc) {
      char *end;
      errno = 0;
      steps = strtol(argv[++i], &end, 10);
      if (errno || *end || end == argv[i] || steps < 1) {
        fprintf(stderr, "dump_batches: --steps \"%s\": expected an integer >= 1\n", argv[i]);
        return 2;
      }
    } else if (!strcmp(a, "--out") && i + 1 < argc) {
      out = argv[++i];
    } else if (!strcmp(a, "--params") && i + 1 < argc) {
      params = argv[++i];
    } else if (a[0] != '-' && strchr(a, '=') && strchr(a, '.') && n_overrides < 256) {
      overrides[n_overrides++] = a;
    } else if (a[0] != '-' && !config) {
      config = a;
    } else {
      fprintf(stderr, "dump_batches: unexpected argument \"%s\"\n%s", a, usage);
      return 2;
    }
  }
  if (!config || !out || steps < 1) {
    fprintf(stderr, "%s", usage);
    return 2;
  }
  nmt_config cfg;
  nmt_status s = nmt_config_load(config, overrides, n_overrides, &cfg);
  if (s != NMT_OK) return fail(s);
  s = write_batches(&cfg, steps, out);
  if (s != NMT_OK) return fail(s);
  if (params) {
    s = write_params(&cfg, params);
    if (s != NMT_OK) return fail(s);
  }
  return 0;
}
