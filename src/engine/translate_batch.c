/* translate_batch.c — the decoder rig (one decoder and its buffers on the inference device),
 * one batch decoded into a window's slots, and translation in memory for validation BLEU
 * (include/nmt/translate.h, nmt_translate_to_text; a trainer keeps one rig open for the whole
 * run and decodes on it with nmt__rig_to_text, src/engine/valid.c). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/backend.h"
#include "nmt/data.h"
#include "nmt/log.h"
#include "nmt/spm.h"
#include "nmt/translate.h"
#include "translate_impl.h"

enum { CUT_WARNINGS = 5 }; /* cut sources named one by one; the rest are counted */

void nmt_ckpt_expect_from_config(const nmt_config *cfg, nmt_ckpt_header *e) {
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(cfg, &mc);
  memset(e, 0, sizeof *e);
  e->vocab = mc.vocab, e->d_model = mc.d_model, e->n_heads = mc.n_heads, e->d_ff = mc.d_ff;
  e->enc_layers = mc.enc_layers, e->dec_layers = mc.dec_layers, e->norm = (int32_t)mc.norm;
  e->n_params = nmt_model_num_params(&mc);
}

nmt_status nmt__hyps_alloc(nmt__hyps *h, int W, int K, int max_out) {
  const size_t WK = (size_t)W * K;
  memset(h, 0, sizeof *h);
  h->W = W, h->K = K, h->max_out = max_out;
  h->ids = malloc(WK * (size_t)max_out * sizeof(int32_t));
  h->len = malloc(WK * sizeof(int32_t));
  h->n = malloc((size_t)W * sizeof(int32_t));
  h->score = malloc(WK * sizeof(float));
  h->logp = malloc(WK * sizeof(float));
  if (!h->ids || !h->len || !h->n || !h->score || !h->logp) {
    nmt__hyps_free(h);
    return nmt_errorf(NMT_ERR_NOMEM, "translations of %d sentences", W);
  }
  for (int i = 0; i < W; i++) h->n[i] = -1;
  return NMT_OK;
}

void nmt__hyps_free(nmt__hyps *h) {
  free(h->ids), free(h->len), free(h->n), free(h->score), free(h->logp);
  memset(h, 0, sizeof *h);
}

nmt_status nmt__rig_open(nmt__rig *r, const nmt_config *cfg, const float *host, int K,
                         int scores) {
  return nmt__rig_open_on(r, cfg, NULL, NULL, host, K, scores);
}

nmt_status nmt__rig_open_on(nmt__rig *r, const nmt_config *cfg, const nmt_backend *be,
                            atomic_int *abort, const float *host, int K, int scores) {
  return nmt__rig_open_rank(r, cfg, be, 0, abort, host, K, scores);
}

nmt_status nmt__rig_open_rank(nmt__rig *r, const nmt_config *cfg, const nmt_backend *be,
                              int rank, atomic_int *abort, const float *host, int K,
                              int scores) {
  return nmt__rig_open_ensemble(r, cfg, be, rank, abort, host, K, scores, NULL);
}

/* The ensemble's other models: each its model and decoder in the rig's context, its
 * parameters uploaded after the first model's, then joined to the first decoder. */
static nmt_status open_members(nmt__rig *r, const nmt__ensemble *e, int rows, int max_len) {
  const nmt_backend *be = r->dev.be;
  nmt_decoder *dec[NMT__ENSEMBLE_MAX - 1];
  const float *params[NMT__ENSEMBLE_MAX - 1];
  /* the alignment gaps between the models are read by cast_half: zeros, not garbage */
  NMT_TRY(be->memset_zero(r->dev.ctx, r->params + r->n_first,
                          (r->n_total - r->n_first) * sizeof(float)));
  for (int i = 0; i < e->n; i++) {
    nmt_model_cfg mc;
    nmt_model_cfg_from_config(e->cfg[i], &mc);
    NMT_TRY(be->copy_h2d(r->dev.ctx, r->params + r->mem_off[i], e->host[i],
                         nmt_model_num_params(&mc) * sizeof(float)));
    NMT_TRY(nmt_model_create(&mc, be, r->dev.ctx, rows, max_len, &r->mem_model[i]));
    r->n_mem = i + 1;
    NMT_TRY(nmt_decoder_create(r->mem_model[i], &r->mem_dec[i]));
    dec[i] = r->mem_dec[i];
    params[i] = r->params + r->mem_off[i];
  }
  return nmt_decoder_ensemble(r->dec, dec, params, e->weights, e->n);
}

nmt_status nmt__rig_open_ensemble(nmt__rig *r, const nmt_config *cfg, const nmt_backend *be,
                                  int rank, atomic_int *abort, const float *host, int K,
                                  int scores, const nmt__ensemble *e) {
  memset(r, 0, sizeof *r);
  if (e && (e->n < 0 || e->n > NMT__ENSEMBLE_MAX - 1))
    return nmt_errorf(NMT_ERR_USAGE, "an ensemble of %d models (at most %d)", e->n + 1,
                      NMT__ENSEMBLE_MAX);
  r->cfg = cfg;
  r->abort = abort;
  r->K = K;
  r->use_beam = cfg->decode_beam > 1 || K > 1 || scores;
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(cfg, &mc);
  const size_t n_params = nmt_model_num_params(&mc);
  r->n_first = r->n_total = n_params;
  for (int i = 0; e && i < e->n; i++) {
    nmt_model_cfg mi;
    nmt_model_cfg_from_config(e->cfg[i], &mi);
    /* 256-byte aligned, as the first model's: the GEMM library picks its kernel by the
     * operands' alignment, so a member decodes as it would alone (bits and speed). */
    r->mem_off[i] = (r->n_total + 63) / 64 * 64;
    r->n_total = r->mem_off[i] + nmt_model_num_params(&mi);
  }
  const int max_len = cfg->data_max_len, bs = cfg->decode_batch_sentences, max_out = max_len - 1;
  const size_t bints = nmt_batch_ints(bs, max_len), BK = (size_t)bs * K;
  r->hbuf = malloc(bints * sizeof(int32_t));
  r->out_ids = malloc(BK * (size_t)(max_out > 0 ? max_out : 1) * sizeof(int32_t));
  r->out_lens = malloc(BK * sizeof(int32_t));
  r->out_n = malloc((size_t)bs * sizeof(int32_t));
  r->out_score = malloc(BK * sizeof(float));
  r->out_logp = malloc(BK * sizeof(float));
  if (!r->hbuf || !r->out_ids || !r->out_lens || !r->out_n || !r->out_score || !r->out_logp)
    return nmt_errorf(NMT_ERR_NOMEM, "translation buffers");
  /* The abort flag reaches the context: its host waits end on it (a trainer's rig). */
  NMT_TRY(nmt_device_open(cfg, be, rank, NMT_DEVICE_INFER, abort, &r->dev));
  void *ctx = r->dev.ctx;
  be = r->dev.be;
  NMT_TRY(be->malloc(ctx, r->n_total * sizeof(float), (void **)&r->params));
  NMT_TRY(be->malloc(ctx, bints * sizeof(int32_t), (void **)&r->dbuf));
  NMT_TRY(nmt_model_create(&mc, be, ctx, bs * max_len, max_len, &r->model));
  NMT_TRY(nmt_decoder_create(r->model, &r->dec));
  NMT_TRY(nmt_decoder_set_min_len(r->dec, cfg->decode_min_len));
  if (e && e->n > 0) NMT_TRY(open_members(r, e, bs * max_len, max_len));
  if (r->dev.precision != NMT_PRECISION_FP16 && r->dev.precision != NMT_PRECISION_BF16)
    return nmt__rig_load(r, host);
  /* Upload, then make the half copy: nmt__rig_half_weights casts what r->params holds, which
   * before the upload is uninitialised device memory. Later loads refresh the copy
   * (nmt__rig_load). */
  NMT_TRY(be->copy_h2d(ctx, r->params, host, n_params * sizeof(float)));
  return nmt__rig_half_weights(r);
}

nmt_status nmt__rig_half_weights(nmt__rig *r) {
  const size_t n = r->n_total;
  const nmt_backend *be = r->dev.be;
  if (r->half) return nmt_errorf(NMT_ERR_INTERNAL, "decoder rig: half weights made twice");
  /* 2 bytes per parameter (nmt/backend.h half_weights), filled by every nmt__rig_load. */
  NMT_TRY(be->malloc(r->dev.ctx, n * 2, &r->half));
  nmt_status s = be->half_weights(r->dev.ctx, r->params, r->half, n);
  if (s != NMT_OK) {
    be->free(r->dev.ctx, r->half);
    r->half = NULL;
    return s;
  }
  return be->cast_half(r->dev.ctx, r->half, r->params, n);
}

nmt_status nmt__rig_load(nmt__rig *r, const float *host) {
  const size_t n = r->n_total;
  NMT_TRY(r->dev.be->copy_h2d(r->dev.ctx, r->params, host, r->n_first * sizeof(float)));
  /* The GEMMs read the half copy: round the new weights into it, once per load (not per
   * decoding step, nor per batch). */
  if (r->half) return r->dev.be->cast_half(r->dev.ctx, r->half, r->params, n);
  /* fp32/tf32: the weights are fixed until the next load; the backend may keep them in the
   * layout its GEMMs read fastest (ref: transposed), remade after each load. */
  return r->dev.be->infer_weights(r->dev.ctx, r->params, n);
}

/* Rows j < nb of hb (laid out for sl source positions): source x cut to l = min(len, max_len
 * - 1) ids, then EOS, then padding; target side BOS alone. */
static void fill_row(nmt_batch *hb, int j, int sl, const int32_t *ids, int l) {
  for (int t = 0; t < sl; t++)
    hb->src[(size_t)j * sl + t] = t < l ? ids[t] : (t == l ? NMT_EOS_ID : NMT_PAD_ID);
  hb->src_lens[j] = l + 1;
  hb->tgt_in[j] = NMT_BOS_ID;
  hb->tgt_out[j] = NMT_PAD_ID;
  hb->tgt_lens[j] = 1;
}

nmt_status nmt__rig_reserve(nmt__rig *r, int longest) {
  const nmt_config *cfg = r->cfg;
  const nmt_backend *be = r->dev.be;
  const int max_len = cfg->data_max_len, max_out = max_len - 1;
  const int bs = cfg->decode_batch_sentences;
  const int l = longest < 0 ? 0 : (longest < max_len - 1 ? longest : max_len - 1), sl = l + 1;
  /* The decoders' step limit for such a batch: min(max_out, src_len + max_extra_len,
   * max_positions) with src_len = l + 1 (EOS counted), as their begin is called. */
  long steps = (long)sl + cfg->decode_max_extra_len;
  if (steps > max_out) steps = max_out;
  if (steps > cfg->model_max_positions) steps = cfg->model_max_positions;
  if (steps < 1) return NMT_OK; /* no batch ever decodes a step */
  /* Any id of the vocabulary does: only the shapes matter. */
  int32_t *ids = malloc((size_t)(l ? l : 1) * sizeof(int32_t));
  if (!ids) return nmt_errorf(NMT_ERR_NOMEM, "decoder reservation");
  for (int t = 0; t < l; t++) ids[t] = NMT_EOS_ID + 1;
  nmt_batch hb, db;
  nmt_batch_layout(&hb, r->hbuf, bs, sl, 1);
  for (int j = 0; j < bs; j++) fill_row(&hb, j, sl, ids, l);
  free(ids);
  nmt_batch_layout(&db, r->dbuf, bs, sl, 1);
  NMT_TRY(be->copy_h2d(r->dev.ctx, r->dbuf, r->hbuf, nmt_batch_ints(bs, sl) * sizeof(int32_t)));
  NMT_TRY(nmt_decoder_begin(r->dec, r->params, &db, r->use_beam ? cfg->decode_beam : 1,
                            (int)steps));
  /* Then one step of the same search, output length 1 (the buffers only grow, so the sizes
   * above stay): the step's GEMMs and the selection run once here, so that their kernels
   * (cuBLASLt's load lazily, on first use) are loaded before any collective is in flight,
   * as warmup.c does for training. */
  if (!r->use_beam)
    return nmt_decoder_greedy(r->dec, r->params, &db, 1, 0, r->out_ids, r->out_lens);
  return nmt_decoder_beam_nbest(r->dec, r->params, &db, cfg->decode_beam,
                                cfg->decode_length_penalty, cfg->decode_beam_rule, 1, 0, r->K,
                                r->out_ids, r->out_lens, r->out_n, r->out_score, r->out_logp);
}

nmt_status nmt__rig_prepare(nmt__rig *r, int longest, int n_sent) {
  const nmt_config *cfg = r->cfg;
  const int max_len = cfg->data_max_len, max_out = max_len - 1;
  const int l = longest < 0 ? 0 : (longest < max_len - 1 ? longest : max_len - 1), sl = l + 1;
  const int bs = cfg->decode_batch_sentences, beam = r->use_beam ? cfg->decode_beam : 1;
  const int ns = n_sent < 1 ? 1 : (n_sent < bs ? n_sent : bs);
  long steps = (long)sl + cfg->decode_max_extra_len; /* as nmt__rig_reserve */
  if (steps > max_out) steps = max_out;
  if (steps > cfg->model_max_positions) steps = cfg->model_max_positions;
  if (steps < 1) return NMT_OK;
  nmt_status st = nmt_decoder_reserve(r->dec, ns, beam, sl, (int)steps);
  if (st == NMT_ERR_NOMEM)
    return nmt_errorf(st, "%s; its rows are decode.batch_sentences (%d, or the input's %d "
                      "lines if fewer) x decode.beam (%d): lower either", nmt_last_error(), bs,
                      ns, cfg->decode_beam);
  return st;
}

void nmt__rig_close(nmt__rig *r) {
  nmt_decoder_destroy(r->dec);
  if (r->model) nmt_model_destroy(r->model);
  for (int i = 0; i < r->n_mem; i++) {
    nmt_decoder_destroy(r->mem_dec[i]);
    if (r->mem_model[i]) nmt_model_destroy(r->mem_model[i]);
  }
  if (r->half) {
    /* Unregistered before either buffer is freed (nmt/backend.h half_weights). */
    (void)r->dev.be->half_weights(r->dev.ctx, NULL, NULL, 0);
    r->dev.be->free(r->dev.ctx, r->half);
  }
  if (r->params) {
    (void)r->dev.be->infer_weights(r->dev.ctx, NULL, 0);
    r->dev.be->free(r->dev.ctx, r->params);
  }
  if (r->dbuf) r->dev.be->free(r->dev.ctx, r->dbuf);
  nmt_device_close(&r->dev);
  free(r->hbuf), free(r->out_ids), free(r->out_lens), free(r->out_n);
  free(r->out_score), free(r->out_logp);
  memset(r, 0, sizeof *r);
}

nmt_status nmt__rig_decode(nmt__rig *r, const nmt__sentence *sents, const int *order, int nb,
                           nmt__hyps *out) {
  const nmt_config *cfg = r->cfg;
  const nmt_backend *be = r->dev.be;
  const int max_len = cfg->data_max_len, max_out = max_len - 1, beam = cfg->decode_beam;
  const int K = r->K;
  /* On the reference nothing waits, so the flag is looked at here: a trainer's abort ends a
   * validation's decoding at the next batch on every backend. */
  if (r->abort && atomic_load(r->abort))
    return nmt_errorf(NMT_ERR_ABORTED, "decoding stopped: the run was aborted");
  int sl = 1;
  for (int j = 0; j < nb; j++) {
    int l = sents[order[j]].len + 1;
    if (l > max_len) l = max_len;
    if (l > sl) sl = l;
  }
  nmt_batch hb, db;
  nmt_batch_layout(&hb, r->hbuf, nb, sl, 1);
  for (int j = 0; j < nb; j++) {
    const nmt__sentence *x = &sents[order[j]];
    int l = x->len < max_len - 1 ? x->len : max_len - 1;
    if (l < x->len && ++r->cut <= CUT_WARNINGS)
      nmt_log(NMT_LOG_WARN, "line %ld: %d ids, longer than data.max_len - 1 = %d; cut%s",
              x->line, x->len, max_len - 1,
              r->cut == CUT_WARNINGS ? " (further cut lines are only counted)" : "");
    fill_row(&hb, j, sl, x->ids, l);
  }
  nmt_batch_layout(&db, r->dbuf, nb, sl, 1);
  NMT_TRY(be->copy_h2d(r->dev.ctx, r->dbuf, r->hbuf, nmt_batch_ints(nb, sl) * sizeof(int32_t)));
  if (!r->use_beam) {
    NMT_TRY(nmt_decoder_greedy(r->dec, r->params, &db, max_out, cfg->decode_max_extra_len,
                               r->out_ids, r->out_lens));
    for (int j = 0; j < nb; j++) r->out_n[j] = 1, r->out_score[j] = r->out_logp[j] = 0.0f;
  } else {
    NMT_TRY(nmt_decoder_beam_nbest(r->dec, r->params, &db, beam, cfg->decode_length_penalty,
                                   cfg->decode_beam_rule, max_out, cfg->decode_max_extra_len, K,
                                   r->out_ids, r->out_lens, r->out_n, r->out_score,
                                   r->out_logp));
  }
  for (int j = 0; j < nb; j++) {
    const int slot = order[j];
    out->n[slot] = r->out_n[j];
    for (int q = 0; q < K; q++) {
      const size_t src = (size_t)j * K + q, dst = (size_t)slot * K + q;
      out->len[dst] = q < r->out_n[j] ? r->out_lens[src] : 0;
      out->score[dst] = r->out_score[src];
      out->logp[dst] = r->out_logp[src];
      memcpy(out->ids + dst * max_out, r->out_ids + src * max_out,
             (size_t)out->len[dst] * sizeof(int32_t));
      r->out_tokens += out->len[dst];
    }
  }
  return NMT_OK;
}

static int by_len(const void *a, const void *b, void *arg) {
  const nmt__sentence *s = arg;
  int x = *(const int *)a, y = *(const int *)b;
  return s[x].len != s[y].len ? (s[x].len < s[y].len ? -1 : 1) : (x < y ? -1 : x > y);
}

void nmt__sort_by_len(const nmt__sentence *s, int *order, long n) {
  for (long i = 0; i < n; i++) order[i] = (int)i;
  qsort_r(order, (size_t)n, sizeof *order, by_len, (void *)s);
}

nmt_status nmt__encode_line(const nmt_spm *spm, const char *text, size_t len, int32_t **ids,
                            int *n) {
  int cap = (int)(len < (1u << 28) ? len : (1u << 28)) + 2;
  *ids = NULL;
  *n = 0;
  for (int tries = 0; tries < 2; tries++) {
    if (!(*ids = malloc((size_t)cap * sizeof(int32_t))))
      return nmt_errorf(NMT_ERR_NOMEM, "ids of a %zu-byte line", len);
    NMT_TRY(nmt_spm_encode(spm, text, len, *ids, cap, n));
    if (*n <= cap) return NMT_OK;
    free(*ids);
    *ids = NULL;
    cap = *n;
  }
  return nmt_errorf(NMT_ERR_INTERNAL, "SentencePiece: piece count changed between two calls");
}

/* ------------------------------------------------------------------------------------------ */
/* in memory */

/* Every source of src_path as sentences: a shard's source sides, or a text file's lines
 * encoded with spm. */
static nmt_status read_sources(const nmt_config *cfg, const nmt_spm *spm, const char *src_path,
                               int is_shard, nmt__sentence **out, long *n_out) {
  *out = NULL;
  *n_out = 0;
  if (is_shard) {
    nmt_shard *sh;
    NMT_TRY(nmt_shard_open(src_path, cfg->model_vocab, &sh));
    const long n = nmt_shard_num_pairs(sh);
    nmt__sentence *s = calloc((size_t)(n ? n : 1), sizeof *s);
    nmt_status st = s ? NMT_OK : nmt_errorf(NMT_ERR_NOMEM, "sources of %s", src_path);
    for (long i = 0; i < n && st == NMT_OK; i++) {
      s[i].len = nmt_shard_src_len(sh, i);
      s[i].line = i + 1;
      if (!(s[i].ids = malloc(((size_t)s[i].len + 1) * sizeof(int32_t))))
        st = nmt_errorf(NMT_ERR_NOMEM, "sources of %s", src_path);
      else nmt_shard_copy_src(sh, i, s[i].ids);
    }
    nmt_shard_close(sh);
    *out = s;
    *n_out = s ? n : 0;
    return st;
  }
  if (!spm) return nmt_errorf(NMT_ERR_USAGE, "translating %s needs a SentencePiece model", src_path);
  FILE *f = fopen(src_path, "r");
  if (!f) return nmt_errorf(NMT_ERR_IO, "cannot read %s: %s", src_path, strerror(errno));
  nmt__sentence *s = NULL;
  long n = 0, cap = 0;
  char *line = NULL;
  size_t lcap = 0;
  ssize_t len;
  nmt_status st = NMT_OK;
  while (st == NMT_OK && (len = getline(&line, &lcap, f)) >= 0) {
    while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) len--;
    if (n == cap) {
      cap = cap ? 2 * cap : 1024;
      nmt__sentence *ns = realloc(s, (size_t)cap * sizeof *s);
      if (!ns) {
        st = nmt_errorf(NMT_ERR_NOMEM, "sources of %s", src_path);
        break;
      }
      s = ns;
    }
    s[n].line = n + 1;
    s[n].len = 0;
    st = nmt__encode_line(spm, line, (size_t)len, &s[n].ids, &s[n].len);
    n++;
  }
  if (st == NMT_OK && ferror(f)) st = nmt_errorf(NMT_ERR_IO, "cannot read %s", src_path);
  free(line);
  fclose(f);
  *out = s;
  *n_out = n;
  return st;
}

nmt_status nmt__rig_to_text(nmt__rig *r, const nmt_spm *spm, const char *src_path,
                            int src_is_shard, char ***hyps_out, long *n_out) {
  const nmt_config *cfg = r->cfg;
  *hyps_out = NULL;
  *n_out = 0;
  nmt__sentence *s = NULL;
  long n = 0;
  int *order = NULL;
  char **text = NULL;
  nmt__hyps h = {0};
  char *buf = NULL;
  size_t cap = 0;
  nmt_status st = NMT_OK;
  const long cut0 = r->cut;
  if (!spm) return nmt_errorf(NMT_ERR_USAGE, "nmt_translate_to_text needs a SentencePiece model");
  if (r->K != 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "in-memory translation needs a rig of one hypothesis "
                      "per sentence, not %d", r->K);
  NMT_TRY_GOTO(st, read_sources(cfg, spm, src_path, src_is_shard, &s, &n), out);
  order = malloc((size_t)(n ? n : 1) * sizeof *order);
  text = calloc((size_t)(n ? n : 1), sizeof *text);
  if (!order || !text) {
    st = nmt_errorf(NMT_ERR_NOMEM, "translations of %s", src_path);
    goto out;
  }
  nmt__sort_by_len(s, order, n);
  const int bs = cfg->decode_batch_sentences, max_out = cfg->data_max_len - 1;
  NMT_TRY_GOTO(st, nmt__hyps_alloc(&h, (int)(n ? n : 1), 1, max_out > 0 ? max_out : 1), out);
  for (long i0 = 0; i0 < n; i0 += bs)
    NMT_TRY_GOTO(st, nmt__rig_decode(r, s, order + i0, (int)(n - i0 < bs ? n - i0 : bs), &h), out);
  for (long i = 0; i < n && st == NMT_OK; i++) {
    size_t len;
    const int32_t *ids = h.ids + (size_t)i * h.max_out;
    st = nmt_spm_decode(spm, ids, h.len[i], buf, cap, &len);
    if (st == NMT_OK && len >= cap) {
      free(buf);
      cap = 2 * len + 64;
      if (!(buf = malloc(cap))) st = nmt_errorf(NMT_ERR_NOMEM, "hypothesis text");
      else st = nmt_spm_decode(spm, ids, h.len[i], buf, cap, &len);
    }
    if (st == NMT_OK && !(text[i] = strdup(buf ? buf : "")))
      st = nmt_errorf(NMT_ERR_NOMEM, "hypothesis text");
  }
  if (r->cut > cut0)
    nmt_log(NMT_LOG_WARN, "%s: %ld sources longer than data.max_len - 1 were cut", src_path,
            r->cut - cut0);
out:
  nmt__hyps_free(&h);
  for (long i = 0; i < n; i++) free(s[i].ids);
  free(s), free(order), free(buf);
  if (st != NMT_OK) {
    nmt_translate_text_free(text, n);
    return st;
  }
  *hyps_out = text;
  *n_out = n;
  return NMT_OK;
}

nmt_status nmt_translate_to_text(const nmt_config *cfg, const float *host_params,
                                 const nmt_spm *spm, const char *src_path, int src_is_shard,
                                 char ***hyps_out, long *n_out) {
  *hyps_out = NULL;
  *n_out = 0;
  if (!spm) return nmt_errorf(NMT_ERR_USAGE, "nmt_translate_to_text needs a SentencePiece model");
  nmt__rig r = {0};
  nmt_status st = nmt__rig_open(&r, cfg, host_params, 1, 0);
  if (st == NMT_OK) st = nmt__rig_to_text(&r, spm, src_path, src_is_shard, hyps_out, n_out);
  nmt__rig_close(&r);
  return st;
}

void nmt_translate_text_free(char **hyps, long n) {
  if (!hyps) return;
  for (long i = 0; i < n; i++) free(hyps[i]);
  free(hyps);
}
