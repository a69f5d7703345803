/* checkpoint.c — checkpoint files: byte layout, atomic writes, validation (see
 * include/nmt/checkpoint.h and docs/formats.md "Checkpoint format"). The directory of step
 * files, `latest`, `best`, rotation and recovery are ckpt_dir.c's.
 *
 * The header is encoded field by field into a byte buffer in little-endian order, never by
 * writing the C struct, so the file does not depend on the compiler's padding or the host's
 * byte order. Arrays are converted in chunks for the same reason (on a little-endian host the
 * conversion compiles to a copy).
 *
 * Internal functions report into a caller-supplied message buffer instead of nmt_errorf, so
 * that nmt_ckpt_find_latest can turn a damaged file into a warning and move on; the public
 * functions turn the message into nmt_errorf at the end.
 *
 * Version 2 adds the metadata section between the header and the arrays: named byte strings
 * (records), so a reader skips names it does not know and a later version can add some
 * without a format change. Its size is in the header, so the size check and the CRC cover it
 * like the arrays.
 */
#include "nmt/checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "ckpt_impl.h"
#include "nmt/config.h" /* nmt_valid_metric, nmt_config_enum_name */
#include "nmt/log.h"
#include "nmt/model.h" /* nmt_model_param_table: the tensor a non-finite parameter is in */

/* Byte offsets of the header fields; docs/formats.md "Checkpoint format" lists the same table. */
enum {
  OFF_MAGIC = 0,           /* char[8] "NMTCKPT1" */
  OFF_VERSION = 8,         /* u32 */
  OFF_HAS_MOMENTS = 12,    /* u32, 0 or 1 */
  OFF_VOCAB = 16,          /* i32 */
  OFF_D_MODEL = 20,        /* i32 */
  OFF_N_HEADS = 24,        /* i32 */
  OFF_D_FF = 28,           /* i32 */
  OFF_ENC_LAYERS = 32,     /* i32 */
  OFF_DEC_LAYERS = 36,     /* i32 */
  OFF_NORM = 40,           /* i32 */
  OFF_LOSS_SCALE = 44,     /* f32 */
  OFF_N_PARAMS = 48,       /* u64 */
  OFF_STEP = 56,           /* i64 */
  OFF_DATA_EPOCH = 64,     /* i64 */
  OFF_DATA_INDEX = 72,     /* i64 */
  OFF_SEED = 80,           /* u64 */
  OFF_SKIPPED_STEPS = 88,  /* i64 */
  OFF_SCALE_GOOD = 96,     /* i64: clean steps since the loss scale last changed */
  OFF_META_BYTES = 104,    /* u64, version 2: size of the metadata section after the header */
  /* 112..127 reserved, written as zero, ignored by this version's reader. Files written before
   * OFF_SCALE_GOOD existed hold 0 there: a resume restarts the growth count, nothing worse.
   * Version-1 files hold zero at 104 too, and their reader never looked there. */
  HDR_BYTES = 128,
  CRC_BYTES = 4,
};

#define MAGIC_LEN 8
#define IO_CHUNK 16384 /* floats per conversion pass (64 KiB) */
#define META_MAX (1ull << 30)  /* a metadata section beyond 1 GiB is corrupt, not a model */
#define META_NAME_MAX 64

/* Record names of the metadata section (docs/formats.md "Metadata section"). */
#define REC_CONFIG "config"
#define REC_SPM_PATH "spm_model_path"
#define REC_SPM "spm_model"
#define REC_BEST "best"
#define REC_DATA "data"
#define BEST_BYTES 32 /* u32 metric, u32 zero, i64 step, f64 value, i64 validations since */
/* The data order's inputs: u64 shard bytes, u32 shard crc32, i32 max_tokens, i32 max_len,
 * i32 world, i32 accum_steps, u32 zero, i64 n_pairs, i64 n_batches, u64 seed; then data.train
 * (the rest of the record, no NUL). */
#define DATA_BYTES 56

nmt_status nmt__ckpt_fail(char *err, nmt_status s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, ERR_CAP, fmt, ap);
  va_end(ap);
  return s;
}
#define fail nmt__ckpt_fail

static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}
static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
static float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static void encode_header(const nmt_ckpt_header *h, uint64_t meta_bytes, uint8_t *b) {
  memset(b, 0, HDR_BYTES);
  memcpy(b + OFF_MAGIC, NMT_CKPT_MAGIC, MAGIC_LEN);
  put_u32(b + OFF_VERSION, NMT_CKPT_VERSION);
  put_u32(b + OFF_HAS_MOMENTS, h->has_moments ? 1u : 0u);
  put_u32(b + OFF_VOCAB, (uint32_t)h->vocab);
  put_u32(b + OFF_D_MODEL, (uint32_t)h->d_model);
  put_u32(b + OFF_N_HEADS, (uint32_t)h->n_heads);
  put_u32(b + OFF_D_FF, (uint32_t)h->d_ff);
  put_u32(b + OFF_ENC_LAYERS, (uint32_t)h->enc_layers);
  put_u32(b + OFF_DEC_LAYERS, (uint32_t)h->dec_layers);
  put_u32(b + OFF_NORM, (uint32_t)h->norm);
  put_u32(b + OFF_LOSS_SCALE, f32_bits(h->loss_scale));
  put_u64(b + OFF_N_PARAMS, h->n_params);
  put_u64(b + OFF_STEP, (uint64_t)h->step);
  put_u64(b + OFF_DATA_EPOCH, (uint64_t)h->data_epoch);
  put_u64(b + OFF_DATA_INDEX, (uint64_t)h->data_index);
  put_u64(b + OFF_SEED, h->seed);
  put_u64(b + OFF_SKIPPED_STEPS, (uint64_t)h->skipped_steps);
  put_u64(b + OFF_SCALE_GOOD, (uint64_t)h->scale_good_steps);
  put_u64(b + OFF_META_BYTES, meta_bytes);
}

static void decode_header(const uint8_t *b, nmt_ckpt_header *h) {
  memset(h, 0, sizeof *h);
  h->version = get_u32(b + OFF_VERSION);
  h->has_moments = get_u32(b + OFF_HAS_MOMENTS);
  h->vocab = (int32_t)get_u32(b + OFF_VOCAB);
  h->d_model = (int32_t)get_u32(b + OFF_D_MODEL);
  h->n_heads = (int32_t)get_u32(b + OFF_N_HEADS);
  h->d_ff = (int32_t)get_u32(b + OFF_D_FF);
  h->enc_layers = (int32_t)get_u32(b + OFF_ENC_LAYERS);
  h->dec_layers = (int32_t)get_u32(b + OFF_DEC_LAYERS);
  h->norm = (int32_t)get_u32(b + OFF_NORM);
  h->loss_scale = bits_f32(get_u32(b + OFF_LOSS_SCALE));
  h->n_params = get_u64(b + OFF_N_PARAMS);
  h->step = (int64_t)get_u64(b + OFF_STEP);
  h->data_epoch = (int64_t)get_u64(b + OFF_DATA_EPOCH);
  h->data_index = (int64_t)get_u64(b + OFF_DATA_INDEX);
  h->seed = get_u64(b + OFF_SEED);
  h->skipped_steps = (int64_t)get_u64(b + OFF_SKIPPED_STEPS);
  h->scale_good_steps = (int64_t)get_u64(b + OFF_SCALE_GOOD);
  h->meta_bytes = h->version >= 2 ? get_u64(b + OFF_META_BYTES) : 0;
}

/* ---------------------------------------------------------------- metadata records */

/* Appends one record (u32 name length, name, u64 value length, value) at *p; with out NULL
 * only counts. */
static size_t put_record(uint8_t *out, size_t at, const char *name, const void *v, size_t n) {
  size_t k = strlen(name);
  if (out) {
    put_u32(out + at, (uint32_t)k);
    memcpy(out + at + 4, name, k);
    put_u64(out + at + 4 + k, (uint64_t)n);
    if (n) memcpy(out + at + 12 + k, v, n);
  }
  return at + 12 + k + n;
}

/* The metadata section of h: records for h->meta's fields present and, when a validation was
 * recorded (best_step > 0), the best-so-far record, in a fixed order. With out NULL returns the
 * size only. */
static size_t encode_meta(const nmt_ckpt_header *h, uint8_t *out) {
  size_t at = 0;
  const nmt_ckpt_meta *m = h->meta;
  if (m && m->config) at = put_record(out, at, REC_CONFIG, m->config, strlen(m->config));
  if (m && m->spm_model_path)
    at = put_record(out, at, REC_SPM_PATH, m->spm_model_path, strlen(m->spm_model_path));
  if (m && m->spm_model) at = put_record(out, at, REC_SPM, m->spm_model, m->spm_model_bytes);
  if (h->best_step > 0) {
    uint8_t b[BEST_BYTES] = {0};
    uint64_t bits;
    memcpy(&bits, &h->best_value, sizeof bits);
    put_u32(b, (uint32_t)h->best_metric);
    put_u64(b + 8, (uint64_t)h->best_step);
    put_u64(b + 16, bits);
    put_u64(b + 24, (uint64_t)h->best_bad);
    at = put_record(out, at, REC_BEST, b, BEST_BYTES);
  }
  if (m && m->data.present) {
    const nmt_ckpt_data *d = &m->data;
    const size_t n = strnlen(d->train, sizeof d->train - 1);
    uint8_t b[DATA_BYTES + sizeof d->train];
    memset(b, 0, DATA_BYTES);
    put_u64(b, d->shard_bytes);
    put_u32(b + 8, d->shard_crc32);
    put_u32(b + 12, (uint32_t)d->max_tokens);
    put_u32(b + 16, (uint32_t)d->max_len);
    put_u32(b + 20, (uint32_t)d->world);
    put_u32(b + 24, (uint32_t)d->accum_steps);
    put_u64(b + 32, (uint64_t)d->n_pairs);
    put_u64(b + 40, (uint64_t)d->n_batches);
    put_u64(b + 48, d->seed);
    memcpy(b + DATA_BYTES, d->train, n);
    at = put_record(out, at, REC_DATA, b, DATA_BYTES + n);
  }
  return at;
}

/* The data record into d; 0 if it is malformed (short, a path that does not fit or holds a
 * NUL, a nonzero reserved field, a count or size out of range). */
static int decode_data(const uint8_t *v, uint64_t len, nmt_ckpt_data *d) {
  if (len < DATA_BYTES || len - DATA_BYTES >= sizeof d->train || get_u32(v + 28) != 0 ||
      memchr(v + DATA_BYTES, 0, (size_t)(len - DATA_BYTES)))
    return 0;
  memset(d, 0, sizeof *d);
  d->shard_bytes = get_u64(v);
  d->shard_crc32 = get_u32(v + 8);
  d->max_tokens = (int32_t)get_u32(v + 12);
  d->max_len = (int32_t)get_u32(v + 16);
  d->world = (int32_t)get_u32(v + 20);
  d->accum_steps = (int32_t)get_u32(v + 24);
  d->n_pairs = (int64_t)get_u64(v + 32);
  d->n_batches = (int64_t)get_u64(v + 40);
  d->seed = get_u64(v + 48);
  memcpy(d->train, v + DATA_BYTES, (size_t)(len - DATA_BYTES));
  if (d->max_tokens < 1 || d->max_len < 1 || d->world < 1 || d->accum_steps < 1 ||
      d->n_pairs < 1 || d->n_batches < 1 || d->n_batches > d->n_pairs)
    return 0;
  d->present = 1;
  return 1;
}

/* The best-so-far record into h; 0 if it is malformed. */
static int decode_best(const uint8_t *v, uint64_t len, nmt_ckpt_header *h) {
  if (len != BEST_BYTES || get_u32(v + 4) != 0) return 0;
  uint32_t metric = get_u32(v);
  uint64_t bits = get_u64(v + 16);
  int64_t step = (int64_t)get_u64(v + 8), bad = (int64_t)get_u64(v + 24);
  if (metric > NMT_METRIC_VALID_PPL || step <= 0 || bad < 0) return 0;
  h->best_metric = (int32_t)metric;
  h->best_step = step;
  memcpy(&h->best_value, &bits, sizeof bits);
  h->best_bad = bad;
  return 1;
}

void nmt_ckpt_meta_free(nmt_ckpt_meta *m) {
  if (!m) return;
  free(m->config);
  free(m->spm_model_path);
  free(m->spm_model);
  memset(m, 0, sizeof *m);
}

/* A malloc'd copy of n bytes plus a NUL (text records must not hold one inside). */
static char *dup_bytes(const uint8_t *p, size_t n) {
  char *c = malloc(n + 1);
  if (c) {
    memcpy(c, p, n);
    c[n] = 0;
  }
  return c;
}

/* Parses a metadata section into m (NULL: checked, not copied) and the best-so-far record into
 * h (NULL: skipped): records must tile it exactly; unknown names are skipped; a text record
 * with a NUL inside, a repeated name, a malformed best or data record or an overrun is
 * corruption. */
static nmt_status decode_meta(const char *path, const uint8_t *b, size_t n, nmt_ckpt_meta *m,
                              nmt_ckpt_header *h, char *err) {
  if (m) memset(m, 0, sizeof *m);
  size_t at = 0;
  int best_seen = 0, data_seen = 0, seen[3] = {0}; /* config, spm_model_path, spm_model */
  nmt_status st = NMT_OK;
  while (at < n && st == NMT_OK) {
    if (n - at < 4) goto corrupt;
    uint32_t k = get_u32(b + at);
    if (k == 0 || k > META_NAME_MAX || n - at - 4 < (size_t)k + 8) goto corrupt;
    const char *name = (const char *)b + at + 4;
    uint64_t len = get_u64(b + at + 4 + k);
    const uint8_t *v = b + at + 12 + k;
    if (len > n - at - 12 - k) goto corrupt;
    at += 12 + k + (size_t)len;
    int which = -1;
    if (k == strlen(REC_CONFIG) && !memcmp(name, REC_CONFIG, k)) which = 0;
    else if (k == strlen(REC_SPM_PATH) && !memcmp(name, REC_SPM_PATH, k)) which = 1;
    else if (k == strlen(REC_SPM) && !memcmp(name, REC_SPM, k)) which = 2;
    if (k == strlen(REC_BEST) && !memcmp(name, REC_BEST, k)) {
      nmt_ckpt_header scratch;
      if (best_seen++ || !decode_best(v, len, h ? h : &scratch)) goto corrupt;
      continue;
    }
    if (k == strlen(REC_DATA) && !memcmp(name, REC_DATA, k)) {
      nmt_ckpt_data scratch;
      if (data_seen++ || !decode_data(v, len, m ? &m->data : &scratch)) goto corrupt;
      continue;
    }
    if (which < 0) continue;
    if (seen[which]++ || (which < 2 && memchr(v, 0, (size_t)len))) goto corrupt;
    if (!m) continue; /* checked, not kept */
    char **slot = which == 0 ? &m->config : which == 1 ? &m->spm_model_path
                                                       : (char **)&m->spm_model;
    if (!(*slot = dup_bytes(v, (size_t)len)))
      st = fail(err, NMT_ERR_NOMEM, "%s: no memory for %llu bytes of metadata", path,
                (unsigned long long)len);
    if (slot == (char **)&m->spm_model) m->spm_model_bytes = (size_t)len;
  }
  if (st != NMT_OK && m) nmt_ckpt_meta_free(m);
  return st;
corrupt:
  if (m) nmt_ckpt_meta_free(m);
  return fail(err, NMT_ERR_CHECKPOINT, "%s: corrupt metadata at byte %zu of its %zu-byte section",
              path, at, n);
}

/* ---------------------------------------------------------------- atomic file replacement */

/* Directory part of path ("." if none), for the fsync that makes a rename durable. */
static void dir_of(const char *path, char *out, size_t cap) {
  const char *slash = strrchr(path, '/');
  if (!slash) {
    snprintf(out, cap, ".");
  } else if (slash == path) {
    snprintf(out, cap, "/");
  } else {
    snprintf(out, cap, "%.*s", (int)(slash - path), path);
  }
}

static nmt_status fsync_dir(const char *dir, char *err) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return fail(err, NMT_ERR_IO, "cannot open directory %s: %s", dir, strerror(errno));
  /* EINVAL: the filesystem cannot sync directories (some network/FUSE ones); the rename is as
   * durable there as it can be made. */
  if (fsync(fd) != 0 && errno != EINVAL) {
    int e = errno;
    close(fd);
    return fail(err, NMT_ERR_IO, "cannot fsync directory %s: %s", dir, strerror(e));
  }
  close(fd);
  return NMT_OK;
}

/* ckpt_impl.h. pid.tid keeps concurrent writers from sharing a temp file. */
nmt_status nmt__ckpt_atomic_write(const char *path, nmt__ckpt_body_fn body, const void *ctx,
                                  char *err) {
  char tmp[PATH_CAP], dir[PATH_CAP];
  if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld.%ld", path, (long)getpid(), (long)gettid()) >=
      (int)sizeof tmp)
    return fail(err, NMT_ERR_IO, "path too long: %s", path);
  dir_of(path, dir, sizeof dir);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return fail(err, NMT_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
  FILE *f = fdopen(fd, "wb");
  if (!f) {
    int e = errno;
    close(fd);
    unlink(tmp);
    return fail(err, NMT_ERR_IO, "cannot open %s: %s", tmp, strerror(e));
  }
  nmt_status st = body(f, tmp, ctx, err);
  if (st == NMT_OK && fflush(f) != 0)
    st = fail(err, NMT_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
  if (st == NMT_OK && fsync(fileno(f)) != 0)
    st = fail(err, NMT_ERR_IO, "cannot fsync %s: %s", tmp, strerror(errno));
  if (fclose(f) != 0 && st == NMT_OK)
    st = fail(err, NMT_ERR_IO, "cannot close %s: %s", tmp, strerror(errno));
  if (st == NMT_OK && rename(tmp, path) != 0)
    st = fail(err, NMT_ERR_IO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
  if (st != NMT_OK) {
    unlink(tmp);
    return st;
  }
  return fsync_dir(dir, err);
}

/* ---------------------------------------------------------------- checkpoint body */

typedef struct {
  const nmt_ckpt_header *h;
  const float *arrays[3];
  int n_arrays;
} ckpt_src;

static nmt_status put_bytes(FILE *f, const char *tmp, const void *p, size_t n, uLong *crc,
                            char *err) {
  if (fwrite(p, 1, n, f) != n)
    return fail(err, NMT_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
  *crc = crc32(*crc, p, (uInt)n);
  return NMT_OK;
}

/* A file's size from its header's fields: what the reader demands and the writer writes. */
static uint64_t file_bytes(uint64_t n_params, int has_moments, uint64_t meta_bytes) {
  return HDR_BYTES + meta_bytes + n_params * 4u * (has_moments ? 3u : 1u) + CRC_BYTES;
}

uint64_t nmt_ckpt_file_bytes(const nmt_ckpt_header *h) {
  return file_bytes(h->n_params, h->has_moments, (uint64_t)encode_meta(h, NULL));
}

static nmt_status write_ckpt_body(FILE *f, const char *tmp, const void *ctx, char *err) {
  const ckpt_src *s = ctx;
  uint8_t hdr[HDR_BYTES];
  const size_t meta_bytes = encode_meta(s->h, NULL);
  if (meta_bytes > META_MAX)
    return fail(err, NMT_ERR_INTERNAL, "checkpoint %s: %zu bytes of metadata (at most %llu)", tmp,
                meta_bytes, META_MAX);
  encode_header(s->h, meta_bytes, hdr);
  uLong crc = crc32(0L, Z_NULL, 0);
  nmt_status st = put_bytes(f, tmp, hdr, HDR_BYTES, &crc, err);
  if (st != NMT_OK) return st;
  if (meta_bytes) {
    uint8_t *meta = malloc(meta_bytes);
    if (!meta) return fail(err, NMT_ERR_NOMEM, "checkpoint %s: no memory for metadata", tmp);
    encode_meta(s->h, meta);
    /* crc32's length is a uInt: feed it in pieces. */
    for (size_t i = 0; i < meta_bytes && st == NMT_OK; i += 1u << 30)
      st = put_bytes(f, tmp, meta + i, meta_bytes - i < (1u << 30) ? meta_bytes - i : 1u << 30,
                     &crc, err);
    free(meta);
    if (st != NMT_OK) return st;
  }
  uint8_t *chunk = malloc((size_t)IO_CHUNK * 4);
  if (!chunk) return fail(err, NMT_ERR_NOMEM, "checkpoint %s: no memory for write buffer", tmp);
  for (int a = 0; a < s->n_arrays && st == NMT_OK; a++) {
    const float *src = s->arrays[a];
    for (uint64_t i = 0; i < s->h->n_params && st == NMT_OK; i += IO_CHUNK) {
      size_t len = s->h->n_params - i < IO_CHUNK ? (size_t)(s->h->n_params - i) : IO_CHUNK;
      for (size_t k = 0; k < len; k++) put_u32(chunk + 4 * k, f32_bits(src[i + k]));
      st = put_bytes(f, tmp, chunk, 4 * len, &crc, err);
    }
  }
  free(chunk);
  if (st != NMT_OK) return st;
  uint8_t tail[CRC_BYTES];
  put_u32(tail, (uint32_t)crc);
  if (fwrite(tail, 1, CRC_BYTES, f) != CRC_BYTES)
    return fail(err, NMT_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
  return NMT_OK;
}

nmt_status nmt__ckpt_write(const char *path, const nmt_ckpt_header *h, const float *params,
                          const float *m, const float *v, char *err) {
  if (!h) return fail(err, NMT_ERR_INTERNAL, "checkpoint %s: NULL header", path);
  if (!params && h->n_params)
    return fail(err, NMT_ERR_INTERNAL, "checkpoint %s: NULL params", path);
  if (h->has_moments && h->n_params && (!m || !v))
    return fail(err, NMT_ERR_INTERNAL, "checkpoint %s: has_moments set but m or v is NULL",
                path);
  ckpt_src s = {.h = h, .arrays = {params, m, v}, .n_arrays = h->has_moments ? 3 : 1};
  return nmt__ckpt_atomic_write(path, write_ckpt_body, &s, err);
}

nmt_status nmt_ckpt_write(const char *path, const nmt_ckpt_header *h, const float *params,
                          const float *m, const float *v) {
  char err[ERR_CAP];
  nmt_status st = nmt__ckpt_write(path, h, params, m, v, err);
  return st == NMT_OK ? NMT_OK : nmt_errorf(st, "%s", err);
}

/* ---------------------------------------------------------------- reading and validation */

typedef struct {
  FILE *f;
  const char *path;
  uLong crc;
  uint8_t *chunk;
} reader;

static void reader_close(reader *r) {
  if (r->f) fclose(r->f);
  free(r->chunk);
  r->f = NULL;
  r->chunk = NULL;
}

/* Opens path and validates the header against the file: magic, version, field sanity, and
 * file size == header + arrays + CRC. The CRC is started over the header bytes. */
static nmt_status open_checked(const char *path, reader *r, nmt_ckpt_header *h, char *err) {
  memset(r, 0, sizeof *r);
  r->path = path;
  r->f = fopen(path, "rb");
  if (!r->f) return fail(err, NMT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
  struct stat sb;
  if (fstat(fileno(r->f), &sb) != 0)
    return fail(err, NMT_ERR_IO, "cannot stat %s: %s", path, strerror(errno));
  uint64_t size = (uint64_t)sb.st_size;
  uint8_t hdr[HDR_BYTES];
  size_t got = fread(hdr, 1, HDR_BYTES, r->f);
  if (ferror(r->f)) return fail(err, NMT_ERR_IO, "cannot read %s: %s", path, strerror(errno));
  if (got < MAGIC_LEN)
    return fail(err, NMT_ERR_CHECKPOINT, "%s: truncated: %zu bytes, too short for the magic",
                path, got);
  if (memcmp(hdr + OFF_MAGIC, NMT_CKPT_MAGIC, MAGIC_LEN) != 0)
    return fail(err, NMT_ERR_CHECKPOINT, "%s: bad magic (not an nmt checkpoint)", path);
  if (got < HDR_BYTES)
    return fail(err, NMT_ERR_CHECKPOINT, "%s: truncated: %zu bytes, the header alone needs %d",
                path, got, HDR_BYTES);
  decode_header(hdr, h);
  if (h->version < 1 || h->version > NMT_CKPT_VERSION)
    return fail(err, NMT_ERR_CHECKPOINT, "%s: unsupported version %u (this build reads 1 to %u)",
                path, h->version, NMT_CKPT_VERSION);
  if (h->meta_bytes > META_MAX || h->meta_bytes > size)
    return fail(err, NMT_ERR_CHECKPOINT, "%s: corrupt header: metadata of %llu bytes in a "
                "%llu-byte file", path, (unsigned long long)h->meta_bytes,
                (unsigned long long)size);
  if (h->has_moments > 1)
    return fail(err, NMT_ERR_CHECKPOINT, "%s: corrupt header: has_moments %u", path,
                h->has_moments);
  /* Never written by nmt (the loader's position only grows from 0); the epoch bound leaves
   * room for the resume's next epoch. */
  if (h->step < 0 || h->data_epoch < 0 || h->data_epoch > INT64_MAX / 2 || h->data_index < 0)
    return fail(err, NMT_ERR_CHECKPOINT, "%s: corrupt header: step %lld, data position epoch "
                "%lld index %lld", path, (long long)h->step, (long long)h->data_epoch,
                (long long)h->data_index);
  uint64_t per_param = 4u * (h->has_moments ? 3u : 1u);
  if (h->n_params > (UINT64_MAX - HDR_BYTES - CRC_BYTES - META_MAX) / per_param)
    return fail(err, NMT_ERR_CHECKPOINT, "%s: corrupt header: n_params %llu", path,
                (unsigned long long)h->n_params);
  uint64_t want = file_bytes(h->n_params, h->has_moments, h->meta_bytes);
  if (size < want)
    return fail(err, NMT_ERR_CHECKPOINT,
                "%s: truncated: %llu bytes, header (n_params %llu, has_moments %u, metadata %llu) "
                "implies %llu",
                path, (unsigned long long)size, (unsigned long long)h->n_params, h->has_moments,
                (unsigned long long)h->meta_bytes, (unsigned long long)want);
  if (size > want)
    return fail(err, NMT_ERR_CHECKPOINT,
                "%s: size mismatch: %llu bytes, header (n_params %llu, has_moments %u, metadata "
                "%llu) implies %llu",
                path, (unsigned long long)size, (unsigned long long)h->n_params, h->has_moments,
                (unsigned long long)h->meta_bytes, (unsigned long long)want);
  r->crc = crc32(crc32(0L, Z_NULL, 0), hdr, HDR_BYTES);
  r->chunk = malloc((size_t)IO_CHUNK * 4);
  if (!r->chunk) return fail(err, NMT_ERR_NOMEM, "%s: no memory for read buffer", path);
  return NMT_OK;
}

static nmt_status read_bytes(reader *r, uint8_t *dst, size_t n, char *err) {
  if (fread(dst, 1, n, r->f) != n) {
    if (ferror(r->f)) return fail(err, NMT_ERR_IO, "cannot read %s: %s", r->path, strerror(errno));
    return fail(err, NMT_ERR_CHECKPOINT, "%s: truncated (file shrank while reading)", r->path);
  }
  return NMT_OK;
}

/* The first non-finite float of an array: its index, or UINT64_MAX for none; its bits. */
typedef struct {
  uint64_t at;
  uint32_t bits;
} nonfinite;

/* Reads one array of n floats into dst (NULL: only feed the CRC). With bad (may be NULL), the
 * first NaN or infinity (exponent bits all ones) is noted in the same pass over the bytes. */
static nmt_status read_array(reader *r, float *dst, uint64_t n, nonfinite *bad, char *err) {
  if (bad) bad->at = UINT64_MAX;
  for (uint64_t i = 0; i < n; i += IO_CHUNK) {
    size_t len = n - i < IO_CHUNK ? (size_t)(n - i) : IO_CHUNK;
    nmt_status st = read_bytes(r, r->chunk, 4 * len, err);
    if (st != NMT_OK) return st;
    r->crc = crc32(r->crc, r->chunk, (uInt)(4 * len));
    if (dst)
      for (size_t k = 0; k < len; k++) dst[i + k] = bits_f32(get_u32(r->chunk + 4 * k));
    if (bad && bad->at == UINT64_MAX) {
      uint32_t any = 0;
      for (size_t k = 0; k < len; k++)
        any |= (get_u32(r->chunk + 4 * k) & 0x7f800000u) == 0x7f800000u;
      for (size_t k = 0; any && k < len; k++) {
        const uint32_t u = get_u32(r->chunk + 4 * k);
        if ((u & 0x7f800000u) == 0x7f800000u) {
          bad->at = i + k, bad->bits = u;
          break;
        }
      }
    }
  }
  return NMT_OK;
}

/* The refusal of a non-finite parameter, naming its tensor and element through the layout of
 * the header's shape (nmt_model_param_table), or its flat index where the shape is not a
 * model's. */
static nmt_status refuse_nonfinite(const char *path, const nmt_ckpt_header *h,
                                   const nonfinite *bad, char *err) {
  const float f = bits_f32(bad->bits);
  const char *what = f != f ? "nan" : f > 0 ? "inf" : "-inf";
  nmt_model_cfg c = {.vocab = h->vocab, .d_model = h->d_model, .n_heads = h->n_heads,
                     .d_ff = h->d_ff, .enc_layers = h->enc_layers, .dec_layers = h->dec_layers,
                     .norm = (nmt_norm_kind)h->norm};
  const int ok_shape = c.vocab > 0 && c.d_model > 0 && c.d_ff > 0 && c.enc_layers >= 0 &&
                       c.dec_layers >= 0 && (c.norm == NMT_NORM_PRE || c.norm == NMT_NORM_POST) &&
                       c.enc_layers <= 4096 && c.dec_layers <= 4096 &&
                       nmt_model_num_params(&c) == h->n_params;
  const int nt = ok_shape ? nmt_model_param_table(&c, NULL) : 0;
  nmt_param_info *tab = nt > 0 ? malloc((size_t)nt * sizeof *tab) : NULL;
  if (tab) nmt_model_param_table(&c, tab);
  for (int i = 0; tab && i < nt; i++)
    if (bad->at >= tab[i].offset && bad->at - tab[i].offset < tab[i].numel) {
      fail(err, NMT_ERR_CHECKPOINT, "%s: parameter %s[%llu] is %s (non-finite weights: the run "
           "that wrote it diverged or the file was made so; use an earlier checkpoint)", path,
           tab[i].name, (unsigned long long)(bad->at - tab[i].offset), what);
      free(tab);
      return NMT_ERR_CHECKPOINT;
    }
  free(tab);
  return fail(err, NMT_ERR_CHECKPOINT, "%s: parameter %llu of %llu is %s (non-finite weights: "
              "use an earlier checkpoint)", path, (unsigned long long)bad->at,
              (unsigned long long)h->n_params, what);
}

/* Reads the metadata section (meta_bytes after the header) into a malloc'd *out (NULL: only
 * feed the CRC). */
static nmt_status read_meta_bytes(reader *r, uint64_t n, uint8_t **out, char *err) {
  uint8_t *all = NULL;
  if (out) {
    *out = NULL;
    if (!(all = malloc(n ? (size_t)n : 1)))
      return fail(err, NMT_ERR_NOMEM, "%s: no memory for %llu bytes of metadata", r->path,
                  (unsigned long long)n);
  }
  for (uint64_t i = 0; i < n; i += (uint64_t)IO_CHUNK * 4) {
    size_t len = n - i < (uint64_t)IO_CHUNK * 4 ? (size_t)(n - i) : (size_t)IO_CHUNK * 4;
    nmt_status st = read_bytes(r, all ? all + i : r->chunk, len, err);
    if (st != NMT_OK) {
      free(all);
      return st;
    }
    r->crc = crc32(r->crc, all ? all + i : r->chunk, (uInt)len);
  }
  if (out) *out = all;
  return NMT_OK;
}

static nmt_status check_crc(reader *r, char *err) {
  uint8_t tail[CRC_BYTES];
  nmt_status st = read_bytes(r, tail, CRC_BYTES, err);
  if (st != NMT_OK) return st;
  uint32_t stored = get_u32(tail), computed = (uint32_t)r->crc;
  if (stored != computed)
    return fail(err, NMT_ERR_CHECKPOINT,
                "%s: checksum mismatch (stored crc32 0x%08x, computed 0x%08x): file is damaged",
                r->path, stored, computed);
  return NMT_OK;
}

/* A shape field's value as a config file spells it: model.norm by name ("post", "pre"; an
 * integer that is neither is shown as such, "(unknown)"), the others as numbers. */
void nmt__ckpt_shape_value(const char *name, long v, char *out, size_t cap) {
  const int norm = !strcmp(name, "norm");
  const char *n = norm ? nmt_config_enum_name("model", "norm", (int)v) : NULL;
  if (n) snprintf(out, cap, "%s", n);
  else snprintf(out, cap, "%ld%s", v, norm ? " (unknown)" : "");
}

/* The first model-shape field that differs, or 0 if all match. */
static int shape_mismatch(const nmt_ckpt_header *file, const nmt_ckpt_header *want, char *err) {
  static const struct {
    const char *name;
    size_t off;
  } fields[] = {
      {"vocab", offsetof(nmt_ckpt_header, vocab)},
      {"d_model", offsetof(nmt_ckpt_header, d_model)},
      {"n_heads", offsetof(nmt_ckpt_header, n_heads)},
      {"d_ff", offsetof(nmt_ckpt_header, d_ff)},
      {"enc_layers", offsetof(nmt_ckpt_header, enc_layers)},
      {"dec_layers", offsetof(nmt_ckpt_header, dec_layers)},
      {"norm", offsetof(nmt_ckpt_header, norm)},
  };
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
    int32_t a, b;
    memcpy(&a, (const char *)file + fields[i].off, sizeof a);
    memcpy(&b, (const char *)want + fields[i].off, sizeof b);
    if (a != b) {
      char va[32], vb[32];
      nmt__ckpt_shape_value(fields[i].name, a, va, sizeof va);
      nmt__ckpt_shape_value(fields[i].name, b, vb, sizeof vb);
      snprintf(err, ERR_CAP, "wrong model shape: %s %s in file, %s in config", fields[i].name, va,
               vb);
      return 1;
    }
  }
  if (file->n_params != want->n_params) {
    snprintf(err, ERR_CAP, "wrong model shape: n_params %llu in file, %llu in config",
             (unsigned long long)file->n_params, (unsigned long long)want->n_params);
    return 1;
  }
  return 0;
}

/* The whole read: header checks, shape, arrays, CRC. Any output may be NULL (verify only). */
nmt_status nmt__ckpt_read(const char *path, const nmt_ckpt_header *expect, nmt_ckpt_header *h,
                         float *params, float *m, float *v, char *err) {
  reader r;
  nmt_ckpt_header tmp_h;
  if (!h) h = &tmp_h;
  nmt_status st = open_checked(path, &r, h, err);
  if (st == NMT_OK && expect) {
    char shape_err[ERR_CAP];
    if (shape_mismatch(h, expect, shape_err)) {
      /* The caller's buffers are sized for `expect`, so nothing is stored; but a damaged file
       * also shows up as a shape mismatch, so read it through first to tell the two apart. */
      st = read_meta_bytes(&r, h->meta_bytes, NULL, err);
      if (st == NMT_OK)
        st = read_array(&r, NULL, h->n_params * (h->has_moments ? 3u : 1u), NULL, err);
      if (st == NMT_OK) st = check_crc(&r, err);
      if (st == NMT_OK) st = fail(err, NMT_ERR_CHECKPOINT, "%s: %s", path, shape_err);
      reader_close(&r);
      return st;
    }
  }
  uint8_t *meta_buf = NULL;
  if (st == NMT_OK) st = read_meta_bytes(&r, h->meta_bytes, &meta_buf, err);
  nonfinite bad = {UINT64_MAX, 0};
  if (st == NMT_OK) st = read_array(&r, params, h->n_params, &bad, err);
  if (st == NMT_OK && h->has_moments) st = read_array(&r, m, h->n_params, NULL, err);
  if (st == NMT_OK && h->has_moments) st = read_array(&r, v, h->n_params, NULL, err);
  if (st == NMT_OK) st = check_crc(&r, err);
  reader_close(&r);
  /* After the CRC: a damaged file is reported as damaged, not as holding a NaN. */
  if (st == NMT_OK && bad.at != UINT64_MAX) st = refuse_nonfinite(path, h, &bad, err);
  /* Only the best-so-far record goes to the caller (nmt_ckpt_read_meta returns the rest): the
   * other records are checked, not copied. */
  if (st == NMT_OK && h->meta_bytes)
    st = decode_meta(path, meta_buf, (size_t)h->meta_bytes, NULL, h, err);
  free(meta_buf);
  return st;
}

nmt_status nmt_ckpt_read_header(const char *path, nmt_ckpt_header *h) {
  char err[ERR_CAP];
  reader r;
  nmt_status st = open_checked(path, &r, h, err);
  reader_close(&r);
  return st == NMT_OK ? NMT_OK : nmt_errorf(st, "%s", err);
}

nmt_status nmt_ckpt_read_meta(const char *path, nmt_ckpt_header *h, nmt_ckpt_meta *meta) {
  char err[ERR_CAP];
  reader r;
  uint8_t *b = NULL;
  memset(meta, 0, sizeof *meta);
  nmt_status st = open_checked(path, &r, h, err);
  if (st == NMT_OK) st = read_meta_bytes(&r, h->meta_bytes, &b, err);
  if (st == NMT_OK) st = decode_meta(path, b, (size_t)h->meta_bytes, meta, h, err);
  free(b);
  reader_close(&r);
  return st == NMT_OK ? NMT_OK : nmt_errorf(st, "%s", err);
}

int nmt_ckpt_is_checkpoint(const char *path) {
  char magic[MAGIC_LEN];
  FILE *f = fopen(path, "rb");
  if (!f) return 0;
  int yes = fread(magic, 1, MAGIC_LEN, f) == MAGIC_LEN && !memcmp(magic, NMT_CKPT_MAGIC, MAGIC_LEN);
  fclose(f);
  return yes;
}

nmt_status nmt_ckpt_read(const char *path, const nmt_ckpt_header *expect, nmt_ckpt_header *h,
                         float *params, float *m, float *v) {
  char err[ERR_CAP];
  nmt_status st = nmt__ckpt_read(path, expect, h, params, m, v, err);
  return st == NMT_OK ? NMT_OK : nmt_errorf(st, "%s", err);
}

