/* export.c — checkpoint averaging and safetensors export (include/nmt/export.h). */
#include "nmt/export.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nmt/log.h"
#include "nmt/model.h"
#include "nmt/translate.h"
#include "ckpt_impl.h"

/* ------------------------------------------------------------------------------------------ */
/* averaging */

nmt_status nmt_ckpt_average(const char *const *paths, int n, const char *out_path) {
  if (n < 1) return nmt_errorf(NMT_ERR_USAGE, "average: no input checkpoints");
  nmt_ckpt_header first, h, newest;
  NMT_TRY(nmt_ckpt_read_header(paths[0], &first));
  if (first.n_params == 0 || first.n_params > (uint64_t)SIZE_MAX / sizeof(double))
    return nmt_errorf(NMT_ERR_CHECKPOINT, "%s: %llu parameters", paths[0],
                      (unsigned long long)first.n_params);
  const size_t np = (size_t)first.n_params;
  nmt_ckpt_meta meta = {0};
  double *acc = calloc(np, sizeof *acc);
  float *buf = malloc(np * sizeof *buf);
  nmt_status s = NMT_OK;
  if (!acc || !buf) {
    s = nmt_errorf(NMT_ERR_NOMEM, "average: %zu parameters", np);
    goto out;
  }
  newest = first;
  int newest_k = 0;
  for (int k = 0; k < n; k++) {
    /* The reader's message (it names paths[k]) goes out once, with what "config" means. */
    char msg[ERR_CAP];
    s = nmt__ckpt_read(paths[k], &first, &h, buf, NULL, NULL, msg);
    if (s != NMT_OK) {
      s = nmt_errorf(s, "average: %s (config: the model of %s, the first checkpoint)", msg,
                     paths[0]);
      goto out;
    }
    if (h.step > newest.step) newest = h, newest_k = k;
    for (size_t i = 0; i < np; i++) acc[i] += buf[i];
  }
  /* Sums of n <= 2^29 fp32 values are exact in double, so n copies of x average to x. */
  for (size_t i = 0; i < np; i++) buf[i] = (float)(acc[i] / n);
  newest.has_moments = 0;
  /* The result describes itself as its newest input does (config, SentencePiece model). */
  NMT_TRY_GOTO(s, nmt_ckpt_read_meta(paths[newest_k], &h, &meta), out);
  newest.meta = &meta;
  NMT_TRY_GOTO(s, nmt_ckpt_write(out_path, &newest, buf, NULL, NULL), out);
  nmt_log(NMT_LOG_INFO, "averaged %d checkpoints (newest step %lld) into %s", n,
          (long long)newest.step, out_path);
out:
  nmt_ckpt_meta_free(&meta);
  free(acc);
  free(buf);
  return s;
}

typedef struct {
  long long step;
  char *path;
} step_file;

static int by_step_desc(const void *a, const void *b) {
  long long x = ((const step_file *)a)->step, y = ((const step_file *)b)->step;
  return x < y ? 1 : x > y ? -1 : 0;
}

nmt_status nmt_ckpt_last_k(const char *dir, int k, char ***paths_out, int *n_out) {
  *paths_out = NULL;
  *n_out = 0;
  DIR *d = opendir(dir);
  if (!d) return nmt_errorf(NMT_ERR_IO, "cannot list %s: %s", dir, strerror(errno));
  step_file *v = NULL;
  size_t n = 0, cap = 0;
  nmt_status s = NMT_OK;
  struct dirent *e;
  while ((e = readdir(d))) {
    long long step;
    char tail[8];
    /* step_<digits>.ckpt exactly */
    if (sscanf(e->d_name, "step_%lld%7s", &step, tail) != 2 || strcmp(tail, ".ckpt") ||
        strncmp(e->d_name, "step_", 5) || e->d_name[5] < '0' || e->d_name[5] > '9')
      continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 16;
      step_file *nv = realloc(v, cap * sizeof *v);
      if (!nv) {
        s = nmt_errorf(NMT_ERR_NOMEM, "listing %s", dir);
        break;
      }
      v = nv;
    }
    size_t len = strlen(dir) + strlen(e->d_name) + 2;
    v[n].path = malloc(len);
    if (!v[n].path) {
      s = nmt_errorf(NMT_ERR_NOMEM, "listing %s", dir);
      break;
    }
    snprintf(v[n].path, len, "%s/%s", dir, e->d_name);
    v[n++].step = step;
  }
  closedir(d);
  if (s == NMT_OK) qsort(v, n, sizeof *v, by_step_desc);
  char **out = s == NMT_OK ? calloc((size_t)(k > 0 ? k : 1), sizeof *out) : NULL;
  if (s == NMT_OK && !out) s = nmt_errorf(NMT_ERR_NOMEM, "listing %s", dir);
  int got = 0;
  for (size_t i = 0; i < n; i++) {
    nmt_ckpt_header h;
    if (s == NMT_OK && got < k) {
      if (nmt_ckpt_read_header(v[i].path, &h) == NMT_OK) {
        out[got++] = v[i].path;
        continue;
      }
      nmt_log(NMT_LOG_WARN, "skipping %s: %s", v[i].path, nmt_last_error());
    }
    free(v[i].path);
  }
  free(v);
  if (s == NMT_OK && got == 0) {
    free(out);
    return nmt_errorf(NMT_ERR_CHECKPOINT, "no valid checkpoint in %s", dir);
  }
  if (s != NMT_OK) {
    for (int i = 0; i < got; i++) free(out[i]);
    free(out);
    return s;
  }
  *paths_out = out;
  *n_out = got;
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* safetensors */

typedef struct {
  char *p;
  size_t len, cap;
  int oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
  if (b->oom) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
    va_end(ap);
    if (k < 0) {
      b->oom = 1;
      return;
    }
    if (b->p && b->len + (size_t)k < b->cap) {
      b->len += (size_t)k;
      return;
    }
    size_t nc = b->cap ? b->cap : 4096;
    while (nc <= b->len + (size_t)k) nc *= 2;
    char *np = realloc(b->p, nc);
    if (!np) {
      b->oom = 1;
      return;
    }
    b->p = np;
    b->cap = nc;
  }
}

static nmt_status write_all(int fd, const void *p, size_t n, const char *path) {
  const char *c = p;
  while (n > 0) {
    ssize_t k = write(fd, c, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    c += k;
    n -= (size_t)k;
  }
  return NMT_OK;
}

/* Header bytes then the fp32 data little-endian, to a temp file renamed over path. */
static nmt_status write_atomic(const char *path, const char *header, size_t header_len,
                               const float *data, size_t n) {
  char tmp[NMT_PATH_MAX + 32], dir[NMT_PATH_MAX];
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return nmt_errorf(NMT_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
  nmt_status s = NMT_OK;
  uint8_t len8[8];
  for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)header_len >> (8 * i));
  NMT_TRY_GOTO(s, write_all(fd, len8, 8, tmp), fail);
  NMT_TRY_GOTO(s, write_all(fd, header, header_len, tmp), fail);
  {
    enum { CHUNK = 16384 };
    uint8_t *b = malloc(CHUNK * 4);
    if (!b) {
      s = nmt_errorf(NMT_ERR_NOMEM, "export buffer");
      goto fail;
    }
    for (size_t i = 0; i < n && s == NMT_OK; i += CHUNK) {
      size_t m = n - i < CHUNK ? n - i : CHUNK;
      for (size_t j = 0; j < m; j++) {
        uint32_t u;
        memcpy(&u, data + i + j, 4);
        for (int q = 0; q < 4; q++) b[4 * j + q] = (uint8_t)(u >> (8 * q));
      }
      s = write_all(fd, b, 4 * m, tmp);
    }
    free(b);
    if (s != NMT_OK) goto fail;
  }
  if (fsync(fd) != 0) {
    s = nmt_errorf(NMT_ERR_IO, "cannot fsync %s: %s", tmp, strerror(errno));
    goto fail;
  }
  if (close(fd) != 0) {
    fd = -1;
    s = nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
    goto fail;
  }
  fd = -1;
  if (rename(tmp, path) != 0) {
    s = nmt_errorf(NMT_ERR_IO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
    goto fail;
  }
  snprintf(dir, sizeof dir, "%s", path);
  int dfd = open(dirname(dir), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return NMT_OK;
fail:
  if (fd >= 0) close(fd);
  unlink(tmp);
  return s;
}

/* The shortest %g form that reads back as the same float (metadata shows "0.1", not
 * "0.100000001"). */
static const char *fmt_float(float v, char *buf, size_t n) {
  for (int prec = 6; prec <= 9; prec++) {
    snprintf(buf, n, "%.*g", prec, (double)v);
    if (strtof(buf, NULL) == v) break;
  }
  return buf;
}

nmt_status nmt_export_safetensors(const char *ckpt_path, const nmt_config *cfg,
                                  const char *out_path) {
  nmt_config base;
  nmt_ckpt_header h, expect;
  nmt_ckpt_setup setup = {0};
  nmt_ckpt_meta meta;
  NMT_TRY(nmt_ckpt_read_meta(ckpt_path, &h, &meta));
  const int embedded = meta.config != NULL;
  nmt_ckpt_meta_free(&meta);
  if (!cfg && embedded) {
    NMT_TRY(nmt_ckpt_setup_load(ckpt_path, NULL, 0, NULL, 0, &setup));
    base = setup.cfg;
    nmt_ckpt_setup_free(&setup);
    cfg = &base;
  }
  if (cfg) {
    nmt_ckpt_expect_from_config(cfg, &expect);
  } else {
    nmt_log(NMT_LOG_WARN, "%s carries no config (format version %u): max_positions, ln_eps, "
            "label smoothing and dropout in the metadata are the schema defaults; give the "
            "run's config to export them as trained", ckpt_path, h.version);
    /* The checkpoint's shape with the schema defaults for what it does not record. */
    nmt_config_defaults(&base);
    base.model_vocab = h.vocab, base.model_d_model = h.d_model, base.model_n_heads = h.n_heads;
    base.model_d_ff = h.d_ff, base.model_enc_layers = h.enc_layers;
    base.model_dec_layers = h.dec_layers, base.model_norm = h.norm ? NMT_NORM_PRE : NMT_NORM_POST;
    cfg = &base;
    nmt_ckpt_expect_from_config(cfg, &expect);
  }
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(cfg, &mc);
  const size_t np = nmt_model_num_params(&mc);
  const int nt = nmt_model_param_table(&mc, NULL);
  float *params = malloc(np * sizeof *params);
  nmt_param_info *tab = malloc((size_t)nt * sizeof *tab);
  sbuf j = {0};
  nmt_status s = NMT_OK;
  if (!params || !tab) {
    s = nmt_errorf(NMT_ERR_NOMEM, "export: %zu parameters", np);
    goto out;
  }
  NMT_TRY_GOTO(s, nmt_ckpt_read(ckpt_path, &expect, &h, params, NULL, NULL), out);
  nmt_model_param_table(&mc, tab);
  /* The data section is the flat buffer: tensors must tile it in table order. */
  size_t end = 0;
  for (int i = 0; i < nt; i++) {
    if (tab[i].offset != end) {
      s = nmt_errorf(NMT_ERR_INTERNAL, "export: %s at offset %zu, expected %zu", tab[i].name,
                     tab[i].offset, end);
      goto out;
    }
    end += tab[i].numel;
  }

  char f[5][32];
  sb_printf(&j, "{\"__metadata__\":{\"format\":\"pt\",\"producer\":\"nmt\",\"layout\":"
                "\"docs/formats.md#safetensors-export\",");
  sb_printf(&j,
            "\"vocab\":\"%d\",\"d_model\":\"%d\",\"n_heads\":\"%d\",\"d_ff\":\"%d\","
            "\"enc_layers\":\"%d\",\"dec_layers\":\"%d\",\"max_positions\":\"%d\","
            "\"norm\":\"%s\",\"ln_eps\":\"%s\",\"label_smoothing\":\"%s\","
            "\"dropout\":\"%s\",\"attn_dropout\":\"%s\",\"relu_dropout\":\"%s\","
            "\"pad_id\":\"%d\",\"unk_id\":\"%d\",\"bos_id\":\"%d\",\"eos_id\":\"%d\","
            "\"step\":\"%lld\",\"has_moments\":\"%u\"},",
            mc.vocab, mc.d_model, mc.n_heads, mc.d_ff, mc.enc_layers, mc.dec_layers,
            mc.max_positions, mc.norm == NMT_NORM_PRE ? "pre" : "post",
            fmt_float(mc.ln_eps, f[0], sizeof f[0]), fmt_float(mc.label_smoothing, f[1], sizeof f[1]),
            fmt_float(mc.dropout, f[2], sizeof f[2]), fmt_float(mc.attn_dropout, f[3], sizeof f[3]),
            fmt_float(mc.relu_dropout, f[4], sizeof f[4]), NMT_PAD_ID, NMT_UNK_ID, NMT_BOS_ID, NMT_EOS_ID,
            (long long)h.step, (unsigned)h.has_moments);
  for (int i = 0; i < nt; i++) {
    const nmt_param_info *p = &tab[i];
    sb_printf(&j, "\"%s\":{\"dtype\":\"F32\",\"shape\":[", p->name);
    for (int d = 0; d < p->ndim; d++) sb_printf(&j, d ? ",%d" : "%d", p->shape[d]);
    sb_printf(&j, "],\"data_offsets\":[%zu,%zu]}%s", p->offset * 4, (p->offset + p->numel) * 4,
              i + 1 < nt ? "," : "}");
  }
  /* Data starts 8-aligned (the format recommends it): pad the JSON with spaces. */
  while (!j.oom && j.len % 8) sb_printf(&j, " ");
  if (j.oom) {
    s = nmt_errorf(NMT_ERR_NOMEM, "export: header");
    goto out;
  }
  NMT_TRY_GOTO(s, write_atomic(out_path, j.p, j.len, params, np), out);
  nmt_log(NMT_LOG_INFO, "exported %d tensors (%zu parameters, step %lld) to %s", nt, np,
          (long long)h.step, out_path);
out:
  free(j.p);
  free(params);
  free(tab);
  return s;
}
