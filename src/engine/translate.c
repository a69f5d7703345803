/* translate.c — batched translation of a file (greedy or beam search, src/model/decode.c),
 * through SentencePiece for raw text. */
#include "nmt/translate.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nmt/backend.h"
#include "nmt/data.h"
#include "nmt/device.h"
#include "nmt/log.h"
#include "nmt/model.h"

typedef struct {
  int32_t *ids;
  int len;
} sentence;

void nmt_ckpt_expect_from_config(const nmt_config *cfg, nmt_ckpt_header *e) {
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(cfg, &mc);
  memset(e, 0, sizeof *e);
  e->vocab = mc.vocab, e->d_model = mc.d_model, e->n_heads = mc.n_heads, e->d_ff = mc.d_ff;
  e->enc_layers = mc.enc_layers, e->dec_layers = mc.dec_layers, e->norm = (int32_t)mc.norm;
  e->n_params = nmt_model_num_params(&mc);
}

/* Parses id lines strictly; an empty line is an empty sentence. */
static nmt_status read_id_lines(FILE *f, const char *name, int vocab, sentence **out, long *n_out) {
  long cap = 1024, n = 0;
  sentence *v = malloc((size_t)cap * sizeof *v);
  char *line = NULL;
  size_t lcap = 0;
  ssize_t len;
  nmt_status s = NMT_OK;
  if (!v) return nmt_errorf(NMT_ERR_NOMEM, "sentences");
  while ((len = getline(&line, &lcap, f)) >= 0) {
    if (n == cap) {
      cap *= 2;
      sentence *nv = realloc(v, (size_t)cap * sizeof *v);
      if (!nv) {
        s = nmt_errorf(NMT_ERR_NOMEM, "sentences");
        break;
      }
      v = nv;
    }
    int32_t *ids = malloc(((size_t)len / 2 + 2) * sizeof(int32_t));
    int k = 0;
    char *p = line;
    if (!ids) {
      s = nmt_errorf(NMT_ERR_NOMEM, "sentences");
      break;
    }
    for (;;) {
      while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
      if (!*p) break;
      char *end;
      errno = 0;
      long x = strtol(p, &end, 10);
      if (end == p || errno || x < 0 || x >= vocab || (*end && *end != ' ' && *end != '\t' &&
                                                       *end != '\n' && *end != '\r')) {
        s = nmt_errorf(NMT_ERR_DATA, "%s:%ld: \"%.*s\" is not an id in [0, %d)", name, n + 1,
                       (int)strcspn(p, " \t\r\n"), p, vocab);
        free(ids);
        goto out;
      }
      ids[k++] = (int32_t)x;
      p = end;
    }
    v[n].ids = ids;
    v[n].len = k;
    n++;
  }
out:
  free(line);
  *out = v;
  *n_out = n;
  return s;
}

static int by_len(const void *a, const void *b, void *arg) {
  const sentence *s = arg;
  int x = *(const int *)a, y = *(const int *)b;
  return s[x].len != s[y].len ? (s[x].len < s[y].len ? -1 : 1) : (x < y ? -1 : x > y);
}

static void shell_quote(char *dst, size_t n, const char *src) {
  size_t j = 0;
  if (j < n - 1) dst[j++] = '\'';
  for (const char *p = src; *p && j + 5 < n; p++) {
    if (*p == '\'') {
      memcpy(dst + j, "'\\''", 4);
      j += 4;
    } else {
      dst[j++] = *p;
    }
  }
  if (j < n - 1) dst[j++] = '\'';
  dst[j] = 0;
}

/* Sentences as SentencePiece ids: read directly (ids), or raw text through spm_encode. */
static nmt_status read_input(const nmt_config *cfg, const char *in_path, int ids, int vocab,
                             sentence **sents, long *n) {
  FILE *in;
  char qmodel[NMT_PATH_MAX * 4 + 8], qpath[NMT_PATH_MAX * 4 + 8], cmd[NMT_PATH_MAX * 16];
  if (ids) {
    in = strcmp(in_path, "-") ? fopen(in_path, "r") : stdin;
  } else {
    shell_quote(qmodel, sizeof qmodel, cfg->data_spm_model);
    if (strcmp(in_path, "-")) {
      shell_quote(qpath, sizeof qpath, in_path);
      snprintf(cmd, sizeof cmd, "spm_encode --model=%s --output_format=id < %s", qmodel, qpath);
    } else {
      snprintf(cmd, sizeof cmd, "spm_encode --model=%s --output_format=id", qmodel);
    }
    in = popen(cmd, "r");
  }
  if (!in) return nmt_errorf(NMT_ERR_IO, "cannot read %s: %s", in_path, strerror(errno));
  nmt_status s = read_id_lines(in, in_path, vocab, sents, n);
  if (ids) {
    if (in != stdin) fclose(in);
  } else if (pclose(in) != 0 && s == NMT_OK) {
    s = nmt_errorf(NMT_ERR_IO, "spm_encode failed on %s (model %s)", in_path, cfg->data_spm_model);
  }
  return s;
}

/* Writes the hypotheses in input order: ids directly, or through spm_decode from a temporary
 * id file (removed afterwards). */
static nmt_status write_output(const nmt_config *cfg, const char *out_path, int ids,
                               int32_t *const *hyp, const int32_t *hyp_len, long n) {
  char qmodel[NMT_PATH_MAX * 4 + 8], qpath[NMT_PATH_MAX * 4 + 8], cmd[NMT_PATH_MAX * 16];
  char tmp_ids[NMT_PATH_MAX + 64] = "";
  nmt_status s = NMT_OK;
  FILE *ido;
  if (ids) {
    ido = strcmp(out_path, "-") ? fopen(out_path, "w") : stdout;
  } else {
    snprintf(tmp_ids, sizeof tmp_ids, "%s.ids.tmp.%d", strcmp(out_path, "-") ? out_path : "/tmp/nmt-hyp",
             (int)getpid());
    ido = fopen(tmp_ids, "w");
  }
  if (!ido) {
    s = nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", ids ? out_path : tmp_ids, strerror(errno));
    goto done;
  }
  for (long i = 0; i < n; i++) {
    for (int t = 0; t < hyp_len[i]; t++) fprintf(ido, t ? " %d" : "%d", hyp[i][t]);
    fputc('\n', ido);
  }
  if (ido != stdout && fclose(ido) != 0) {
    s = nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", ids ? out_path : tmp_ids, strerror(errno));
    goto done;
  }
  if (ido == stdout) fflush(stdout);
  if (!ids) {
    char qtmp[sizeof tmp_ids * 4 + 8];
    shell_quote(qmodel, sizeof qmodel, cfg->data_spm_model);
    shell_quote(qtmp, sizeof qtmp, tmp_ids);
    if (strcmp(out_path, "-")) {
      shell_quote(qpath, sizeof qpath, out_path);
      snprintf(cmd, sizeof cmd, "spm_decode --model=%s --input_format=id < %s > %s", qmodel, qtmp,
               qpath);
    } else {
      snprintf(cmd, sizeof cmd, "spm_decode --model=%s --input_format=id < %s", qmodel, qtmp);
    }
    fflush(stdout);
    if (system(cmd) != 0) s = nmt_errorf(NMT_ERR_IO, "spm_decode failed writing %s", out_path);
  }
done:
  if (tmp_ids[0]) unlink(tmp_ids);
  return s;
}

/* One decoder and its buffers on the inference device. */
typedef struct {
  const nmt_config *cfg;
  nmt_device dev;
  nmt_model *model;
  nmt_decoder *dec;
  float *params;
  int32_t *hbuf, *dbuf, *out_ids, *out_lens;
  long cut, out_tokens;
} decoder_rig;

static nmt_status rig_open(decoder_rig *r, const nmt_model_cfg *mc, const float *host,
                           size_t n_params) {
  const nmt_config *cfg = r->cfg;
  const int max_len = cfg->data_max_len, bs = cfg->decode_batch_sentences, max_out = max_len - 1;
  const size_t bints = nmt_batch_ints(bs, max_len);
  r->hbuf = malloc(bints * sizeof(int32_t));
  r->out_ids = malloc((size_t)bs * max_out * sizeof(int32_t));
  r->out_lens = malloc((size_t)bs * sizeof(int32_t));
  if (!r->hbuf || !r->out_ids || !r->out_lens)
    return nmt_errorf(NMT_ERR_NOMEM, "translation buffers");
  NMT_TRY(nmt_device_open(cfg, NULL, 0, NMT_DEVICE_INFER, NULL, &r->dev));
  const nmt_backend *be = r->dev.be;
  void *ctx = r->dev.ctx;
  NMT_TRY(be->malloc(ctx, n_params * sizeof(float), (void **)&r->params));
  NMT_TRY(be->copy_h2d(ctx, r->params, host, n_params * sizeof(float)));
  NMT_TRY(be->malloc(ctx, bints * sizeof(int32_t), (void **)&r->dbuf));
  NMT_TRY(nmt_model_create(mc, be, ctx, bs * max_len, max_len, &r->model));
  return nmt_decoder_create(r->model, &r->dec);
}

static void rig_close(decoder_rig *r) {
  nmt_decoder_destroy(r->dec);
  if (r->model) nmt_model_destroy(r->model);
  if (r->params) r->dev.be->free(r->dev.ctx, r->params);
  if (r->dbuf) r->dev.be->free(r->dev.ctx, r->dbuf);
  nmt_device_close(&r->dev);
  free(r->hbuf), free(r->out_ids), free(r->out_lens);
}

/* Decodes sentences order[0..nb-1] as one batch into hyp/hyp_len. Sources longer than
 * max_len - 1 are cut (EOS needs one position). */
static nmt_status decode_batch(decoder_rig *r, const sentence *sents, const int *order, int nb,
                               int32_t **hyp, int32_t *hyp_len) {
  const nmt_config *cfg = r->cfg;
  const nmt_backend *be = r->dev.be;
  const int max_len = cfg->data_max_len, max_out = max_len - 1, beam = cfg->decode_beam;
  int sl = 1;
  for (int j = 0; j < nb; j++) {
    int l = sents[order[j]].len + 1;
    if (l > max_len) l = max_len;
    if (l > sl) sl = l;
  }
  nmt_batch hb, db;
  nmt_batch_layout(&hb, r->hbuf, nb, sl, 1);
  for (int j = 0; j < nb; j++) {
    const sentence *x = &sents[order[j]];
    int l = x->len < max_len - 1 ? x->len : max_len - 1;
    if (l < x->len) r->cut++;
    for (int t = 0; t < sl; t++)
      hb.src[(size_t)j * sl + t] = t < l ? x->ids[t] : (t == l ? NMT_EOS_ID : NMT_PAD_ID);
    hb.src_lens[j] = l + 1;
    hb.tgt_in[j] = NMT_BOS_ID;
    hb.tgt_out[j] = NMT_PAD_ID;
    hb.tgt_lens[j] = 1;
  }
  nmt_batch_layout(&db, r->dbuf, nb, sl, 1);
  NMT_TRY(be->copy_h2d(r->dev.ctx, r->dbuf, r->hbuf, nmt_batch_ints(nb, sl) * sizeof(int32_t)));
  if (beam == 1)
    NMT_TRY(nmt_decoder_greedy(r->dec, r->params, &db, max_out, cfg->decode_max_extra_len,
                               r->out_ids, r->out_lens));
  else
    NMT_TRY(nmt_decoder_beam(r->dec, r->params, &db, beam, cfg->decode_length_penalty, max_out,
                             cfg->decode_max_extra_len, r->out_ids, r->out_lens, NULL));
  for (int j = 0; j < nb; j++) {
    int id = order[j];
    hyp_len[id] = r->out_lens[j];
    r->out_tokens += r->out_lens[j];
    hyp[id] = malloc(((size_t)r->out_lens[j] + 1) * sizeof(int32_t));
    if (!hyp[id]) return nmt_errorf(NMT_ERR_NOMEM, "hypotheses");
    memcpy(hyp[id], r->out_ids + (size_t)j * max_out, (size_t)r->out_lens[j] * sizeof(int32_t));
  }
  return NMT_OK;
}

nmt_status nmt_translate_file(const nmt_config *cfg, const char *ckpt, const char *in_path,
                              const char *out_path, int ids) {
  nmt_status s = NMT_OK;
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(cfg, &mc);
  size_t n_params = nmt_model_num_params(&mc);
  float *host = NULL;
  sentence *sents = NULL;
  long n = 0;
  int *order = NULL;
  int32_t **hyp = NULL;
  int32_t *hyp_len = NULL;
  decoder_rig r = {.cfg = cfg};
  char ckpt_path[1024];

  if (!ids && !cfg->data_spm_model[0])
    return nmt_errorf(NMT_ERR_CONFIG, "[data] spm_model is empty: raw-text translation needs the "
                                      "SentencePiece model (or pass --ids)");
  if (!ckpt) {
    char dir[NMT_PATH_MAX + 16];
    snprintf(dir, sizeof dir, "%s/checkpoints", cfg->run_out_dir);
    NMT_TRY(nmt_ckpt_find_latest(dir, ckpt_path));
    ckpt = ckpt_path;
  }
  nmt_ckpt_header expect, h;
  nmt_ckpt_expect_from_config(cfg, &expect);
  host = malloc(n_params * sizeof(float));
  if (!host) return nmt_errorf(NMT_ERR_NOMEM, "parameters");
  NMT_TRY_GOTO(s, nmt_ckpt_read(ckpt, &expect, &h, host, NULL, NULL), done);
  nmt_log(NMT_LOG_INFO, "translating with %s (step %ld)", ckpt, (long)h.step);
  NMT_TRY_GOTO(s, read_input(cfg, in_path, ids, mc.vocab, &sents, &n), done);

  /* Decode in length-sorted batches. */
  const int bs = cfg->decode_batch_sentences, beam = cfg->decode_beam;
  order = malloc((size_t)(n ? n : 1) * sizeof *order);
  hyp = calloc((size_t)(n ? n : 1), sizeof *hyp);
  hyp_len = calloc((size_t)(n ? n : 1), sizeof *hyp_len);
  if (!order || !hyp || !hyp_len) {
    s = nmt_errorf(NMT_ERR_NOMEM, "translation buffers");
    goto done;
  }
  for (long i = 0; i < n; i++) order[i] = (int)i;
  qsort_r(order, (size_t)n, sizeof *order, by_len, sents);
  NMT_TRY_GOTO(s, rig_open(&r, &mc, host, n_params), done);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long i0 = 0; i0 < n; i0 += bs) {
    int nb = (int)(n - i0 < bs ? n - i0 : bs);
    NMT_TRY_GOTO(s, decode_batch(&r, sents, order + i0, nb, hyp, hyp_len), done);
    nmt_log(NMT_LOG_DEBUG, "translated %ld/%ld", i0 + nb, n);
  }
  if (r.cut) nmt_log(NMT_LOG_WARN, "%ld sources longer than [data] max_len - 1 were cut", r.cut);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
  nmt_log(NMT_LOG_INFO,
          "decoded %ld sentences (%ld tokens) in %.2f s on %s: %.1f sentences/s, beam %d, "
          "length penalty %.2f, %d sentences per batch",
          n, r.out_tokens, secs, r.dev.be->name, secs > 0 ? (double)n / secs : 0.0, beam,
          beam > 1 ? (double)cfg->decode_length_penalty : 0.0, bs);
  s = write_output(cfg, out_path, ids, hyp, hyp_len, n);
done:
  rig_close(&r);
  for (long i = 0; i < n; i++) {
    free(sents[i].ids);
    if (hyp) free(hyp[i]);
  }
  free(sents), free(order), free(hyp), free(hyp_len);
  free(host);
  return s;
}
