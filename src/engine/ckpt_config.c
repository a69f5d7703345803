/* ckpt_config.c — checkpoints that describe themselves (include/nmt/checkpoint.h, "setup"):
 * the metadata the trainer embeds (the effective config, the SentencePiece model), and the
 * config a command that reads a checkpoint runs with: the checkpoint's own, a config file's
 * (which must describe the same model), and the SentencePiece model that goes with it.
 *
 * The embedded config is applied as overrides (section.key=value, through nmt_config_load), so
 * it gets the same parsing, validation and messages as a config file; each value is first set
 * once with the checkpoint named as its origin, so a value this build refuses is reported
 * against the checkpoint, not the command line; they are then loaded as a layer of their own
 * (nmt_config_load_layered), so a cross-key or model-shape error names the checkpoint too, and
 * "command line" only for what the user's overrides set.
 *
 * The last part is the data order's inputs a checkpoint records (nmt_ckpt_data) and what
 * --resume makes of a position when they changed. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#include "ckpt_impl.h"
#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/log.h"
#include "nmt/spm.h"

/* ------------------------------------------------------------------------------------------ */
/* what the trainer embeds */

nmt_status nmt__slurp(const char *path, void **out, size_t *n) {
  *out = NULL;
  *n = 0;
  FILE *f = fopen(path, "rb");
  struct stat sb;
  if (!f) return nmt_errorf(NMT_ERR_IO, "cannot read %s: %s", path, strerror(errno));
  if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
    fclose(f);
    return nmt_errorf(NMT_ERR_IO, "%s is not a regular file", path);
  }
  char *b = malloc((size_t)sb.st_size + 1);
  size_t got = b ? fread(b, 1, (size_t)sb.st_size, f) : 0;
  int bad = !b || got != (size_t)sb.st_size || ferror(f);
  fclose(f);
  if (bad) {
    free(b);
    return b ? nmt_errorf(NMT_ERR_IO, "cannot read %s: short read", path)
             : nmt_errorf(NMT_ERR_NOMEM, "reading %s", path);
  }
  b[got] = 0;
  *out = b;
  *n = got;
  return NMT_OK;
}

nmt_status nmt__config_dump_text(const nmt_config *cfg, char **out) {
  size_t n = 0;
  *out = NULL;
  FILE *f = open_memstream(out, &n);
  if (!f) return nmt_errorf(NMT_ERR_NOMEM, "config text");
  nmt_status s = nmt_config_dump(cfg, f);
  if (fclose(f) != 0 && s == NMT_OK) s = nmt_errorf(NMT_ERR_NOMEM, "config text");
  if (s != NMT_OK) {
    free(*out);
    *out = NULL;
  }
  return s;
}

nmt_status nmt_ckpt_meta_set_config(const nmt_config *cfg, nmt_ckpt_meta *m) {
  nmt_config c = *cfg;
  c.run_resume = 0; /* as nmt_ckpt_meta_from_config */
  char *text = NULL;
  NMT_TRY(nmt__config_dump_text(&c, &text));
  free(m->config);
  m->config = text;
  return NMT_OK;
}

nmt_status nmt_ckpt_meta_from_config(const nmt_config *cfg, nmt_ckpt_meta *out) {
  memset(out, 0, sizeof *out);
  /* Whether the run was resumed says nothing about the model; with it fixed, a resumed run
   * writes the same checkpoint bytes as an uninterrupted one. */
  nmt_config c = *cfg;
  c.run_resume = 0;
  NMT_TRY(nmt__config_dump_text(&c, &out->config));
  if (!cfg->data_spm_model[0]) return NMT_OK;
  out->spm_model_path = strdup(cfg->data_spm_model);
  if (!out->spm_model_path) {
    nmt_ckpt_meta_free(out);
    return nmt_errorf(NMT_ERR_NOMEM, "checkpoint metadata");
  }
  /* Training never reads the SentencePiece model (shards hold ids), so a missing one is not
   * an error here; but the checkpoints will need data.spm_model at hand to translate text. */
  if (nmt__slurp(cfg->data_spm_model, &out->spm_model, &out->spm_model_bytes) != NMT_OK) {
    nmt_log(NMT_LOG_WARN, "[data] spm_model = \"%s\": %s; checkpoints will not carry the "
            "SentencePiece model", cfg->data_spm_model, nmt_last_error());
    nmt_clear_error();
  }
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* the config a command runs with */

/* A growing list of "section.key=value" strings. */
typedef struct {
  char **v;
  int n, cap;
} strlist;

static nmt_status push(strlist *l, const char *sec, const char *key, const char *val) {
  if (l->n == l->cap) {
    int nc = l->cap ? 2 * l->cap : 64;
    char **nv = realloc(l->v, (size_t)nc * sizeof *nv);
    if (!nv) return nmt_errorf(NMT_ERR_NOMEM, "config overrides");
    l->v = nv;
    l->cap = nc;
  }
  size_t len = strlen(sec) + strlen(key) + strlen(val) + 3;
  if (!(l->v[l->n] = malloc(len))) return nmt_errorf(NMT_ERR_NOMEM, "config overrides");
  snprintf(l->v[l->n++], len, "%s.%s=%s", sec, key, val);
  return NMT_OK;
}

static void strlist_free(strlist *l) {
  for (int i = 0; i < l->n; i++) free(l->v[i]);
  free(l->v);
}

/* Trims spaces in place. */
static char *trim(char *s) {
  while (*s == ' ' || *s == '\t') s++;
  size_t n = strlen(s);
  while (n && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r')) s[--n] = 0;
  return s;
}

/* Keys of the embedded config a checkpoint alone does not impose: where its files go
 * (run.out_dir: the run that holds the checkpoint; resume), which devices the machine that
 * trained it used ([parallel]: this machine may differ), and data.spm_model when the model's
 * bytes are embedded (they are used instead of a path that may not exist here). */
static int not_imposed(const char *sec, const char *key, int have_spm_bytes) {
  return !strcmp(sec, "parallel") || (!strcmp(sec, "run") && strcmp(key, "seed")) ||
         (have_spm_bytes && !strcmp(sec, "data") && !strcmp(key, "spm_model"));
}

/* Whether "[sec] key" exists in this build: the dump of the defaults lists every key. */
static int known_key(const char *defaults, const char *sec, const char *key) {
  char head[160], line[160];
  snprintf(head, sizeof head, "\n[%s]\n", sec);
  snprintf(line, sizeof line, "\n%s = ", key);
  const char *p = strstr(defaults, head);
  if (!p) return 0;
  const char *end = strstr(p + strlen(head), "\n[");
  const char *k = strstr(p, line);
  return k && (!end || k < end);
}

/* The run directory of a checkpoint: DIR for DIR/checkpoints/step_N.ckpt, else the
 * checkpoint's own directory. */
static void run_dir_of(const char *ckpt, char *out, size_t cap) {
  const char *slash = strrchr(ckpt, '/');
  if (!slash) {
    snprintf(out, cap, ".");
    return;
  }
  int len = (int)(slash - ckpt);
  const char *tail = "checkpoints";
  const int tl = (int)strlen(tail);
  if (len >= tl && !strncmp(slash - tl, tail, (size_t)tl) && (len == tl || slash[-tl - 1] == '/'))
    len = len == tl ? 0 : len - tl - 1;
  snprintf(out, cap, "%.*s", len ? len : 1, len ? ckpt : (ckpt[0] == '/' ? "/" : "."));
}

/* cfg from the checkpoint's embedded config text plus the user's overrides. */
static nmt_status config_from_meta(const nmt_ckpt_setup *s, const char *const *ov, int n_ov,
                                   nmt_config *cfg) {
  nmt_config scratch;
  char *defaults = NULL, *text = strdup(s->meta.config), origin[1200];
  strlist l = {0};
  nmt_status st = NMT_OK;
  snprintf(origin, sizeof origin, "%s (its embedded config)", s->ckpt);
  nmt_config_defaults(&scratch);
  if (!text) return nmt_errorf(NMT_ERR_NOMEM, "config text");
  NMT_TRY_GOTO(st, nmt__config_dump_text(&scratch, &defaults), out);
  char sec[128] = "";
  for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
    line = trim(line);
    if (!*line || *line == ';' || *line == '#') continue;
    if (*line == '[') {
      char *close = strchr(line, ']');
      snprintf(sec, sizeof sec, "%.*s", close ? (int)(close - line - 1) : 0, line + 1);
      continue;
    }
    char *eq = strchr(line, '=');
    if (!eq || !sec[0]) {
      st = nmt_errorf(NMT_ERR_CHECKPOINT, "%s: line \"%s\" is not key = value", origin, line);
      goto out;
    }
    *eq = 0;
    char *key = trim(line), *val = trim(eq + 1);
    if (not_imposed(sec, key, s->meta.spm_model != NULL)) continue;
    if (!known_key(defaults, sec, key)) {
      nmt_log(NMT_LOG_WARN, "%s: [%s] %s is unknown to this build; ignored", origin, sec, key);
      continue;
    }
    NMT_TRY_GOTO(st, nmt_config_set(&scratch, sec, key, val, origin), out);
    NMT_TRY_GOTO(st, push(&l, sec, key, val), out);
  }
  char dir[NMT_PATH_MAX];
  run_dir_of(s->ckpt, dir, sizeof dir);
  NMT_TRY_GOTO(st, push(&l, "run", "out_dir", dir), out);
  /* The checkpoint's keys as a layer of their own: an error in them, or a cross-key error they
   * take part in, names the checkpoint; only the user's overrides are "command line". */
  st = nmt_config_load_layered(NULL, (const char *const *)l.v, l.n, origin, ov, n_ov, cfg);
out:
  strlist_free(&l);
  free(defaults);
  free(text);
  return st;
}

/* Whether the overrides set [model] key. */
static int overridden(const char *const *ov, int n_ov, const char *key) {
  char head[64];
  int n = snprintf(head, sizeof head, "model.%s=", key);
  for (int i = 0; i < n_ov; i++)
    if (!strncmp(ov[i], head, (size_t)n)) return 1;
  return 0;
}

/* The header's model shape against cfg's; the error names the key, both values and both
 * sources. cfg_label says where cfg came from; NULL: the checkpoint's embedded config plus
 * the overrides ov, and then a key no override set is the checkpoint contradicting itself. */
static nmt_status check_shape(const nmt_ckpt_setup *s, const char *cfg_label,
                              const char *const *ov, int n_ov) {
  const nmt_config *c = &s->cfg;
  const nmt_ckpt_header *h = &s->header;
  const struct {
    const char *key;
    long file, cfg;
  } f[] = {
      {"vocab", h->vocab, c->model_vocab},
      {"d_model", h->d_model, c->model_d_model},
      {"n_heads", h->n_heads, c->model_n_heads},
      {"d_ff", h->d_ff, c->model_d_ff},
      {"enc_layers", h->enc_layers, c->model_enc_layers},
      {"dec_layers", h->dec_layers, c->model_dec_layers},
      {"norm", h->norm, (long)c->model_norm},
  };
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
    if (f[i].file == f[i].cfg) continue;
    char vf[64], vc[64];
    nmt__ckpt_shape_value(f[i].key, f[i].file, vf, sizeof vf);
    nmt__ckpt_shape_value(f[i].key, f[i].cfg, vc, sizeof vc);
    if (!cfg_label && !overridden(ov, n_ov, f[i].key))
      return nmt_errorf(NMT_ERR_CHECKPOINT,
                        "[model] %s = %s in the embedded config of %s but %s in its header: "
                        "the checkpoint contradicts itself (damaged, or written by another "
                        "build); give the config it was trained with as well",
                        f[i].key, vc, s->ckpt, vf);
    return nmt_errorf(NMT_ERR_CHECKPOINT,
                      "[model] %s = %s in %s but %s in the checkpoint %s: a config given "
                      "with a checkpoint must describe the same model",
                      f[i].key, vc, cfg_label ? cfg_label : "the command line", vf, s->ckpt);
  }
  return NMT_OK;
}

nmt_status nmt_ckpt_setup_load(const char *ckpt, const char *const *configs, int n_configs,
                               const char *const *ov, int n_ov, nmt_ckpt_setup *s) {
  memset(s, 0, sizeof *s);
  nmt_status st = NMT_OK;
  if (!ckpt && n_configs <= 0)
    return nmt_errorf(NMT_ERR_USAGE, "need a checkpoint or a config (or both)");
  if (n_configs > 0) NMT_TRY(nmt_config_load_files(configs, n_configs, ov, n_ov, &s->cfg));
  if (ckpt) {
    if (snprintf(s->ckpt, sizeof s->ckpt, "%s", ckpt) >= (int)sizeof s->ckpt)
      return nmt_errorf(NMT_ERR_USAGE, "checkpoint path too long: %s", ckpt);
  } else {
    char dir[NMT_PATH_MAX + 16];
    snprintf(dir, sizeof dir, "%s/checkpoints", s->cfg.run_out_dir);
    NMT_TRY(nmt_ckpt_find_latest(dir, s->ckpt));
  }
  NMT_TRY(nmt_ckpt_read_meta(s->ckpt, &s->header, &s->meta));
  char label[4 * NMT_PATH_MAX]; /* "a.ini + b.ini + command line" */
  if (n_configs > 0) {
    nmt_config_sources(configs, n_configs, n_ov, label, sizeof label);
  } else if (s->meta.config) {
    s->from_ckpt = 1;
    st = config_from_meta(s, ov, n_ov, &s->cfg);
    /* Damage in the metadata shows as a config error; the CRC tells the two apart. */
    if (st != NMT_OK && nmt_ckpt_read(s->ckpt, NULL, NULL, NULL, NULL, NULL) != NMT_OK)
      st = NMT_ERR_CHECKPOINT;
  } else {
    st = nmt_errorf(NMT_ERR_USAGE,
                    "%s carries no config (checkpoint format version %u; version 2 does): "
                    "give the config it was trained with as well, e.g. "
                    "`nmt translate CONFIG --ckpt %s`",
                    s->ckpt, s->header.version, s->ckpt);
  }
  if (st == NMT_OK) st = check_shape(s, s->from_ckpt ? NULL : label, ov, n_ov);
  if (st != NMT_OK) nmt_ckpt_setup_free(s);
  return st;
}

void nmt_ckpt_setup_free(nmt_ckpt_setup *s) { nmt_ckpt_meta_free(&s->meta); }

/* ------------------------------------------------------------------------------------------ */
/* the SentencePiece model that goes with it */

nmt_status nmt_ckpt_setup_spm(const nmt_ckpt_setup *s, nmt_spm **out) {
  *out = NULL;
  const char *path = s->cfg.data_spm_model;
  char label[1200];
  if (path[0]) {
    NMT_TRY(nmt_spm_load(path, out));
    if (s->meta.spm_model) {
      void *bytes;
      size_t n;
      if (nmt__slurp(path, &bytes, &n) == NMT_OK) {
        if (n != s->meta.spm_model_bytes || memcmp(bytes, s->meta.spm_model, n))
          nmt_log(NMT_LOG_WARN,
                  "[data] spm_model = \"%s\" differs from the SentencePiece model %s was "
                  "trained with (embedded, from \"%s\"); ids will not mean the same pieces",
                  path, s->ckpt, s->meta.spm_model_path ? s->meta.spm_model_path : "?");
        free(bytes);
      }
    }
  } else if (s->meta.spm_model) {
    snprintf(label, sizeof label, "%s (embedded copy of %s)", s->ckpt,
             s->meta.spm_model_path ? s->meta.spm_model_path : "its SentencePiece model");
    NMT_TRY(nmt_spm_load_bytes(s->meta.spm_model, s->meta.spm_model_bytes, label, out));
  } else {
    return nmt_errorf(NMT_ERR_CONFIG,
                      "[data] spm_model is empty and %s carries no SentencePiece model: raw "
                      "text needs one (set data.spm_model=PATH, or pass --ids)",
                      s->ckpt);
  }
  nmt_status st = nmt_spm_check_vocab(*out, s->cfg.model_vocab);
  if (st != NMT_OK) {
    nmt_spm_free(*out);
    *out = NULL;
  }
  return st;
}

/* ------------------------------------------------------------------------------------------ */
/* the data order: what a checkpoint's position means (nmt_ckpt_data) */

nmt_status nmt_ckpt_data_of(const nmt_config *cfg, long n_pairs, long n_batches, int world,
                            nmt_ckpt_data *out) {
  memset(out, 0, sizeof *out);
  uint32_t crc;
  uint64_t bytes;
  nmt_status s = nmt_file_crc32(cfg->data_train, &crc, &bytes);
  if (s != NMT_OK) return nmt_errorf(s, "[data] train = \"%s\": %s", cfg->data_train,
                                     nmt_last_error());
  out->present = 1;
  out->shard_bytes = bytes;
  out->shard_crc32 = crc;
  out->max_tokens = cfg->data_max_tokens;
  out->max_len = cfg->data_max_len;
  out->world = world;
  out->accum_steps = cfg->train_accum_steps;
  out->n_pairs = n_pairs;
  out->n_batches = n_batches;
  out->seed = cfg->run_seed;
  snprintf(out->train, sizeof out->train, "%s", cfg->data_train);
  return NMT_OK;
}

/* Appends ", " and the formatted text to buf (cap bytes; truncates). */
static void append(char *buf, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void append(char *buf, size_t cap, const char *fmt, ...) {
  size_t n = strlen(buf);
  if (n + 3 >= cap) return;
  if (n) memcpy(buf + n, ", ", 3), n += 2;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + n, cap - n, fmt, ap);
  va_end(ap);
}

void nmt_ckpt_data_resume(const char *ckpt, const nmt_ckpt_header *h, const nmt_ckpt_data *then,
                          const nmt_ckpt_data *now, long *epoch, long *index) {
  const long e = (long)h->data_epoch, i = (long)h->data_index, nb = (long)now->n_batches;
  /* Logs count epochs from 1, as metrics.jsonl does; the checkpoint's epoch is 0-based. */
  char changed[3000] = "", keys[200] = "";
  *epoch = e, *index = i;
  if (then && then->present) {
    if (strcmp(then->train, now->train) || then->shard_bytes != now->shard_bytes ||
        then->shard_crc32 != now->shard_crc32) {
      append(changed, sizeof changed, "[data] train = \"%s\" then (%lld pairs, %llu bytes, "
             "crc32 %08x), \"%s\" now (%lld pairs, %llu bytes, crc32 %08x)", then->train,
             (long long)then->n_pairs, (unsigned long long)then->shard_bytes, then->shard_crc32,
             now->train, (long long)now->n_pairs, (unsigned long long)now->shard_bytes,
             now->shard_crc32);
      append(keys, sizeof keys, "data.train");
    }
    if (then->max_tokens != now->max_tokens) {
      append(changed, sizeof changed, "[data] max_tokens = %d then, %d now", then->max_tokens,
             now->max_tokens);
      append(keys, sizeof keys, "data.max_tokens");
    }
    if (then->max_len != now->max_len) {
      append(changed, sizeof changed, "[data] max_len = %d then, %d now", then->max_len,
             now->max_len);
      append(keys, sizeof keys, "data.max_len");
    }
    if (then->seed != now->seed) {
      append(changed, sizeof changed, "[run] seed = %llu then, %llu now",
             (unsigned long long)then->seed, (unsigned long long)now->seed);
      append(keys, sizeof keys, "run.seed");
    }
    /* Equal inputs give equal batches; a count that differs anyway (a batching rule changed
     * between nmt versions) or a position past them means another order all the same. */
    if (!changed[0] && (then->n_batches != now->n_batches || i >= nb)) {
      append(changed, sizeof changed, "%lld batches per epoch then, %ld now",
             (long long)then->n_batches, nb);
      append(keys, sizeof keys, "the batching rule");
    }
    if (!changed[0] && (then->world != now->world || then->accum_steps != now->accum_steps))
      nmt_log(NMT_LOG_INFO, "resume from %s: %d data-parallel rank(s) x train.accum_steps = %d "
              "then, %d x %d now: the data position (epoch %ld, batch %ld of %ld) carries over; "
              "a step now takes %d batches of the same order instead of %d", ckpt, then->world,
              then->accum_steps, now->world, now->accum_steps, e + 1, i + 1, nb,
              now->world * now->accum_steps, then->world * then->accum_steps);
  } else {
    if (h->seed != now->seed) {
      append(changed, sizeof changed, "[run] seed = %llu then, %llu now",
             (unsigned long long)h->seed, (unsigned long long)now->seed);
      append(keys, sizeof keys, "run.seed");
    } else if (i >= nb) {
      append(changed, sizeof changed, "the position lies past the %ld batches of \"%s\" now",
             nb, now->train);
      append(keys, sizeof keys, "the data");
    } else {
      nmt_log(NMT_LOG_INFO, "resume from %s: the checkpoint does not record its data order "
              "(written before nmt did): its position (epoch %ld, batch %ld of %ld) is taken to "
              "mean the same batches of \"%s\"; a changed shard or batching cannot be detected",
              ckpt, e + 1, i + 1, nb, now->train);
    }
  }
  if (!changed[0]) return;
  /* The old position names no batch of the new order: start a new epoch of it, counting the
   * checkpoint's epoch as a pass unless it had just ended. */
  *epoch = i == 0 ? e : e + 1;
  *index = 0;
  char of[40] = "";
  if (then && then->present) snprintf(of, sizeof of, " of %lld", (long long)then->n_batches);
  nmt_log(NMT_LOG_WARN, "resume from %s: the training data order changed (%s): %s; the "
          "checkpoint's position (epoch %ld, batch %ld%s) does not carry over to the new order "
          "of %ld batches: continuing at the start of epoch %ld, shuffled anew", ckpt, keys,
          changed, e + 1, i + 1, of, nb, *epoch + 1);
}
