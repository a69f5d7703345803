/* test_checkpoint.c — checkpoint files: bitwise round trip (with and without moments) and the
 * documented byte layout decoded by hand, every kind of damage the reader must name
 * (truncation at several lengths, flipped bytes, wrong magic, version, shape), rotation with
 * keep=2 ordered by step number, recovery of the newest valid checkpoint, and no temp files
 * left behind; the version-2 metadata section (round trip, layout, damage) and version-1 files
 * still read. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "nmt/checkpoint.h"
#include "test.h"

static uint64_t mix64(uint64_t *s) { /* splitmix64 */
  uint64_t x = (*s += 0x9E3779B97F4A7C15ull);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/* Random bit patterns, so -0, subnormals and every exponent but the all-ones one occur: the
 * file must carry the bits, not the values (NaN and infinity parameters are refused at load,
 * test_ckpt_finite.c). */
static float *rand_floats(size_t n, uint64_t seed) {
  float *p = malloc(n * sizeof *p);
  for (size_t i = 0; p && i < n; i++) {
    uint32_t u = (uint32_t)mix64(&seed);
    /* Any finite bit pattern: a NaN or infinity parameter is refused at load. */
    if ((u & 0x7f800000u) == 0x7f800000u) u &= ~0x00800000u;
    memcpy(&p[i], &u, sizeof u);
  }
  return p;
}

static nmt_ckpt_header sample_header(uint64_t n_params, int moments) {
  nmt_ckpt_header h = {0};
  h.vocab = 8000;
  h.d_model = 512;
  h.n_heads = 8;
  h.d_ff = 2048;
  h.enc_layers = 6;
  h.dec_layers = 5;
  h.norm = 1;
  h.n_params = n_params;
  h.has_moments = moments ? 1 : 0;
  h.step = 5000000000LL; /* > 2^32: all 8 bytes matter */
  h.data_epoch = 3;
  h.data_index = 5000000007LL; /* > 2^32 too (a negative position is corruption) */
  h.seed = 0xF00DFACECAFEBEEFull;
  h.loss_scale = 32768.5f;
  h.skipped_steps = 42;
  h.scale_good_steps = 1999;
  return h;
}

/* Test paths are short; a truncated one would fail loudly as a missing file. */
static void join(char *out, size_t cap, const char *dir, const char *name) {
  if (snprintf(out, cap, "%s/%s", dir, name) >= (int)cap) out[0] = 0;
}

static int count_tmp_files(const char *dir) {
  DIR *d = opendir(dir);
  int n = 0;
  struct dirent *e;
  while (d && (e = readdir(d)))
    if (strstr(e->d_name, ".tmp.")) n++;
  if (d) closedir(d);
  return n;
}

static long file_size(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 ? (long)sb.st_size : -1;
}

static unsigned char *slurp(const char *path, long *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  *n = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc((size_t)*n + 1);
  if (b && fread(b, 1, (size_t)*n, f) != (size_t)*n) {
    free(b);
    b = NULL;
  }
  fclose(f);
  return b;
}

static int spill(const char *path, const unsigned char *b, long n) {
  FILE *f = fopen(path, "wb");
  if (!f) return 0;
  int ok = fwrite(b, 1, (size_t)n, f) == (size_t)n;
  return fclose(f) == 0 && ok;
}

static int spill_text(const char *path, const char *text) {
  return spill(path, (const unsigned char *)text, (long)strlen(text));
}

static uint64_t le(const unsigned char *p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

/* Fails unless the last error contains `phrase`. */
#define ASSERT_ERR_HAS(phrase)                                                              \
  do {                                                                                      \
    if (!strstr(nmt_last_error(), (phrase))) {                                              \
      nmt_test_fail(__FILE__, __LINE__, "error \"%s\" lacks \"%s\"", nmt_last_error(),      \
                    (phrase));                                                              \
      return;                                                                               \
    }                                                                                       \
  } while (0)

static int header_eq(const nmt_ckpt_header *a, const nmt_ckpt_header *b) {
  return a->vocab == b->vocab && a->d_model == b->d_model && a->n_heads == b->n_heads &&
         a->d_ff == b->d_ff && a->enc_layers == b->enc_layers && a->dec_layers == b->dec_layers &&
         a->norm == b->norm && a->n_params == b->n_params && a->has_moments == b->has_moments &&
         a->step == b->step && a->data_epoch == b->data_epoch &&
         a->data_index == b->data_index && a->seed == b->seed &&
         memcmp(&a->loss_scale, &b->loss_scale, sizeof(float)) == 0 &&
         a->skipped_steps == b->skipped_steps && a->scale_good_steps == b->scale_good_steps;
}

static void round_trip(int moments) {
  const char *dir = nmt_test_tmpdir();
  char path[1024];
  join(path, sizeof path, dir, moments ? "m.ckpt" : "p.ckpt");
  const size_t n = 40000; /* crosses the writer's 16384-float chunks */
  nmt_ckpt_header h = sample_header(n, moments);
  h.version = 99; /* ignored: write fills in its own */
  float *p = rand_floats(n, 1), *m = rand_floats(n, 2), *v = rand_floats(n, 3);
  float *p2 = calloc(n, 4), *m2 = calloc(n, 4), *v2 = calloc(n, 4);
  NMT_ASSERT(p && m && v && p2 && m2 && v2);
  NMT_ASSERT_OK(nmt_ckpt_write(path, &h, p, moments ? m : NULL, moments ? v : NULL));
  NMT_ASSERT_EQ_INT(count_tmp_files(dir), 0);
  NMT_ASSERT_EQ_INT(file_size(path), 128 + 4 * (long)n * (moments ? 3 : 1) + 4);

  nmt_ckpt_header got;
  NMT_ASSERT_OK(nmt_ckpt_read_header(path, &got));
  NMT_ASSERT_EQ_INT(got.version, NMT_CKPT_VERSION);
  NMT_ASSERT(header_eq(&got, &h));

  memset(&got, 0, sizeof got);
  nmt_ckpt_header expect = sample_header(n, 0); /* has_moments is not part of the shape */
  NMT_ASSERT_OK(nmt_ckpt_read(path, &expect, &got, p2, m2, v2));
  NMT_ASSERT(header_eq(&got, &h));
  NMT_ASSERT(memcmp(p, p2, n * 4) == 0);
  if (moments) {
    NMT_ASSERT(memcmp(m, m2, n * 4) == 0);
    NMT_ASSERT(memcmp(v, v2, n * 4) == 0);
    /* Moments may be skipped. */
    memset(p2, 0, n * 4);
    NMT_ASSERT_OK(nmt_ckpt_read(path, NULL, &got, p2, NULL, NULL));
    NMT_ASSERT(memcmp(p, p2, n * 4) == 0);
  }

  /* The documented layout, decoded by hand (docs/formats.md "Checkpoint format"). */
  long sz;
  unsigned char *b = slurp(path, &sz);
  NMT_ASSERT(b);
  int layout_ok = memcmp(b, "NMTCKPT1", 8) == 0 && le(b + 8, 4) == 2 && le(b + 104, 8) == 0 &&
                  le(b + 12, 4) == (uint64_t)moments && le(b + 20, 4) == 512 &&
                  le(b + 36, 4) == 5 && le(b + 48, 8) == n && le(b + 56, 8) == 5000000000ull &&
                  le(b + 72, 8) == 5000000007ull && le(b + 80, 8) == 0xF00DFACECAFEBEEFull &&
                  le(b + 88, 8) == 42 && le(b + 128, 4) == le((unsigned char *)p, 4) &&
                  le(b + sz - 4, 4) == crc32(0, b, (uInt)(sz - 4));
  float ls;
  uint32_t lsb = (uint32_t)le(b + 44, 4);
  memcpy(&ls, &lsb, 4);
  free(b);
  NMT_ASSERT(layout_ok);
  NMT_ASSERT(ls == 32768.5f);
  free(p), free(m), free(v), free(p2), free(m2), free(v2);
}

NMT_TEST(ckpt_round_trip_params_only) { round_trip(0); }
NMT_TEST(ckpt_round_trip_with_moments) { round_trip(1); }

NMT_TEST(ckpt_round_trip_zero_params) {
  char path[1024];
  join(path, sizeof path, nmt_test_tmpdir(), "empty.ckpt");
  nmt_ckpt_header h = sample_header(0, 1), got;
  NMT_ASSERT_OK(nmt_ckpt_write(path, &h, NULL, NULL, NULL));
  NMT_ASSERT_OK(nmt_ckpt_read(path, &h, &got, NULL, NULL, NULL));
  NMT_ASSERT(header_eq(&got, &h));
}

/* Writes a valid checkpoint with moments and returns its bytes. */
static unsigned char *valid_file(const char *path, size_t n, long *size) {
  nmt_ckpt_header h = sample_header(n, 1);
  float *p = rand_floats(n, 7);
  nmt_status st = nmt_ckpt_write(path, &h, p, p, p);
  free(p);
  return st == NMT_OK ? slurp(path, size) : NULL;
}

NMT_TEST(ckpt_truncated) {
  char path[1024];
  join(path, sizeof path, nmt_test_tmpdir(), "t.ckpt");
  const size_t n = 1000;
  long size;
  unsigned char *b = valid_file(path, n, &size);
  NMT_ASSERT(b);
  long cuts[] = {0, 5, 8, 100, 127, 128, 128 + 10, 128 + 4000, size / 2, size - 5, size - 1};
  float *p = malloc(n * 4), *m = malloc(n * 4), *v = malloc(n * 4);
  nmt_ckpt_header h;
  for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
    NMT_ASSERT(spill(path, b, cuts[i]));
    NMT_ASSERT_EQ_STATUS(nmt_ckpt_read_header(path, &h), NMT_ERR_CHECKPOINT);
    ASSERT_ERR_HAS("truncated");
    NMT_ASSERT_EQ_STATUS(nmt_ckpt_read(path, NULL, &h, p, m, v), NMT_ERR_CHECKPOINT);
    ASSERT_ERR_HAS("truncated");
  }
  /* Extra bytes are damage too. */
  unsigned char *longer = malloc((size_t)size + 3);
  memcpy(longer, b, (size_t)size);
  memset(longer + size, 0, 3);
  NMT_ASSERT(spill(path, longer, size + 3));
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read(path, NULL, &h, p, m, v), NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("size mismatch");
  free(longer), free(b), free(p), free(m), free(v);
}

NMT_TEST(ckpt_checksum_mismatch) {
  char path[1024];
  join(path, sizeof path, nmt_test_tmpdir(), "c.ckpt");
  const size_t n = 1000;
  long size;
  unsigned char *b = valid_file(path, n, &size);
  NMT_ASSERT(b);
  float *p = malloc(n * 4), *m = malloc(n * 4), *v = malloc(n * 4);
  nmt_ckpt_header h;
  /* The middle of the moments, a reserved header byte, and the stored CRC itself. */
  long where[] = {size / 2, 100, size - 2};
  for (size_t i = 0; i < 3; i++) {
    b[where[i]] ^= 0x10;
    NMT_ASSERT(spill(path, b, size));
    b[where[i]] ^= 0x10;
    NMT_ASSERT_EQ_STATUS(nmt_ckpt_read(path, NULL, &h, p, m, v), NMT_ERR_CHECKPOINT);
    ASSERT_ERR_HAS("checksum mismatch");
    /* Also when the damaged array is not wanted. */
    NMT_ASSERT_EQ_STATUS(nmt_ckpt_read(path, NULL, &h, p, NULL, NULL), NMT_ERR_CHECKPOINT);
    ASSERT_ERR_HAS("checksum mismatch");
  }
  /* The header-only reader does not read the arrays, so it passes. */
  NMT_ASSERT_OK(nmt_ckpt_read_header(path, &h));
  free(b), free(p), free(m), free(v);
}

NMT_TEST(ckpt_bad_magic_and_version) {
  char path[1024];
  join(path, sizeof path, nmt_test_tmpdir(), "mv.ckpt");
  long size;
  unsigned char *b = valid_file(path, 10, &size);
  NMT_ASSERT(b);
  nmt_ckpt_header h;
  float buf[10];
  b[3] = 'X';
  NMT_ASSERT(spill(path, b, size));
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read_header(path, &h), NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("bad magic");
  b[3] = 'C';
  b[8] = 7; /* version, little-endian u32 at offset 8 */
  NMT_ASSERT(spill(path, b, size));
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read_header(path, &h), NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("unsupported version 7");
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read(path, NULL, &h, buf, NULL, NULL), NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("unsupported version 7");
  free(b);
  /* A missing file is an I/O error naming the path. */
  join(path, sizeof path, nmt_test_tmpdir(), "nope.ckpt");
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read_header(path, &h), NMT_ERR_IO);
  ASSERT_ERR_HAS("nope.ckpt");
}

NMT_TEST(ckpt_wrong_shape) {
  char path[1024];
  join(path, sizeof path, nmt_test_tmpdir(), "s.ckpt");
  const size_t n = 64;
  long size;
  unsigned char *b = valid_file(path, n, &size); /* d_model 512 */
  NMT_ASSERT(b);
  float *p = malloc(n * 4);
  nmt_ckpt_header h, want = sample_header(n, 1);
  want.d_model = 256;
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read(path, &want, &h, p, NULL, NULL), NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("d_model 512 in file, 256 in config");
  want = sample_header(n, 1);
  want.dec_layers = 6;
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read(path, &want, &h, p, NULL, NULL), NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("dec_layers 5 in file, 6 in config");
  want = sample_header(n + 1, 1);
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read(path, &want, &h, p, NULL, NULL), NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("n_params 64 in file, 65 in config");
  /* Damage wins over shape: a corrupted file is reported as such, not as a shape error. */
  want = sample_header(n, 1);
  want.d_model = 256;
  b[size / 2] ^= 1;
  NMT_ASSERT(spill(path, b, size));
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read(path, &want, &h, p, NULL, NULL), NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("checksum mismatch");
  free(b), free(p);
}

/* A model.norm that differs is named as the config spells it (post, pre), not as the
 * header's integer. */
NMT_TEST(ckpt_wrong_norm_named) {
  char path[1024];
  join(path, sizeof path, nmt_test_tmpdir(), "n.ckpt");
  const size_t n = 64;
  long size;
  unsigned char *b = valid_file(path, n, &size); /* norm = pre */
  NMT_ASSERT(b);
  free(b);
  nmt_ckpt_header h, want = sample_header(n, 1);
  want.norm = 0;
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read(path, &want, &h, NULL, NULL, NULL), NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("norm pre in file, post in config");
  want.norm = 7; /* no such norm: the number, said to be unknown */
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read(path, &want, &h, NULL, NULL, NULL), NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("norm pre in file, 7 (unknown) in config");
}

/* nmt_ckpt_setup_load of a checkpoint alone: a value its embedded config holds is reported
 * against the checkpoint (named by path), never against the command line; a command-line
 * override that takes part is named as such too. */
static nmt_status setup_with_config(const char *path, const char *config, const char *const *ov,
                                    int n_ov) {
  nmt_ckpt_meta meta = {0};
  meta.config = (char *)config;
  nmt_ckpt_header h = sample_header(8, 1);
  h.meta = &meta;
  float p[8] = {0};
  nmt_status s = nmt_ckpt_write(path, &h, p, p, p);
  if (s != NMT_OK) return s;
  nmt_ckpt_setup st;
  s = nmt_ckpt_setup_load(path, NULL, 0, ov, n_ov, &st);
  if (s == NMT_OK) nmt_ckpt_setup_free(&st);
  return s;
}

#define SHAPE "[model]\nvocab = 8000\nn_heads = 8\nd_ff = 2048\nenc_layers = 6\n" \
              "dec_layers = 5\nnorm = pre\nmax_positions = 32\n"
#define FITS "[data]\nmax_len = 16\n"

NMT_TEST(ckpt_setup_names_the_checkpoint_as_origin) {
  char path[1024];
  join(path, sizeof path, nmt_test_tmpdir(), "own.ckpt");
  /* Its own max_len past its own max_positions. */
  NMT_ASSERT_EQ_STATUS(setup_with_config(path, SHAPE "d_model = 512\n[data]\nmax_len = 64\n",
                                         NULL, 0), NMT_ERR_CONFIG);
  ASSERT_ERR_HAS(path);
  ASSERT_ERR_HAS("max_positions");
  NMT_ASSERT(!strstr(nmt_last_error(), "command line"));
  /* The same through an override: both sources named. */
  const char *ov[] = {"data.max_len=64"};
  NMT_ASSERT_EQ_STATUS(setup_with_config(path, SHAPE "d_model = 512\n" FITS, ov, 1),
                       NMT_ERR_CONFIG);
  ASSERT_ERR_HAS(path);
  ASSERT_ERR_HAS("command line");
  /* Its embedded config disagreeing with its own header. */
  NMT_ASSERT_EQ_STATUS(setup_with_config(path, SHAPE "d_model = 256\n" FITS, NULL, 0),
                       NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("d_model = 256 in");
  ASSERT_ERR_HAS("embedded config");
  NMT_ASSERT(!strstr(nmt_last_error(), "command line"));
  /* An override that changes the shape is the command line's. */
  const char *ov2[] = {"model.d_model=256"};
  NMT_ASSERT_EQ_STATUS(setup_with_config(path, SHAPE "d_model = 512\n" FITS, ov2, 1),
                       NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("d_model = 256 in the command line but 512 in the checkpoint");
}

NMT_TEST(ckpt_write_io_error) {
  char path[1024];
  join(path, sizeof path, nmt_test_tmpdir(), "no/such/dir/x.ckpt");
  nmt_ckpt_header h = sample_header(4, 0);
  float p[4] = {1, 2, 3, 4};
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_write(path, &h, p, NULL, NULL), NMT_ERR_IO);
  ASSERT_ERR_HAS("no/such/dir/x.ckpt");
  h.has_moments = 1;
  join(path, sizeof path, nmt_test_tmpdir(), "x.ckpt");
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_write(path, &h, p, NULL, NULL), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_INT(count_tmp_files(nmt_test_tmpdir()), 0);
}

static nmt_status save(const char *dir, long long step, int keep, char *out) {
  const size_t n = 100;
  nmt_ckpt_header h = sample_header(n, 1);
  h.step = step;
  float *p = rand_floats(n, (uint64_t)step);
  nmt_status st = nmt_ckpt_save_step(dir, &h, p, p, p, keep, out);
  free(p);
  return st;
}

static int exists(const char *dir, const char *name) {
  char p[1024];
  join(p, sizeof p, dir, name);
  return access(p, F_OK) == 0;
}

static int count_step_files(const char *dir) {
  DIR *d = opendir(dir);
  int n = 0;
  struct dirent *e;
  while (d && (e = readdir(d)))
    if (!strncmp(e->d_name, "step_", 5)) n++;
  if (d) closedir(d);
  return n;
}

static int latest_is(const char *dir, const char *name) {
  char p[1024], want[300];
  join(p, sizeof p, dir, "latest");
  long n;
  unsigned char *b = slurp(p, &n);
  snprintf(want, sizeof want, "%s\n", name);
  int ok = b && n == (long)strlen(want) && !memcmp(b, want, (size_t)n);
  free(b);
  return ok;
}

NMT_TEST(ckpt_save_step_keeps_newest_by_number) {
  char dir[1024], out[1024], want[1024];
  join(dir, sizeof dir, nmt_test_tmpdir(), "a/b/ckpt"); /* mkdir -p */
  /* String order would keep "9" and "8"; step order keeps 11 and 100. */
  long long steps[] = {8, 9, 10, 11, 100};
  for (int i = 0; i < 5; i++) NMT_ASSERT_OK(save(dir, steps[i], 2, out));
  join(want, sizeof want, dir, "step_100.ckpt");
  NMT_ASSERT(!strcmp(out, want));
  NMT_ASSERT_EQ_INT(count_step_files(dir), 2);
  NMT_ASSERT(exists(dir, "step_11.ckpt"));
  NMT_ASSERT(exists(dir, "step_100.ckpt"));
  NMT_ASSERT(latest_is(dir, "step_100.ckpt"));
  NMT_ASSERT_EQ_INT(count_tmp_files(dir), 0);
  char found[1024];
  NMT_ASSERT_OK(nmt_ckpt_find_latest(dir, found));
  NMT_ASSERT(!strcmp(found, want));
  /* The file just written survives pruning even when higher steps exist (a resumed run). */
  NMT_ASSERT_OK(save(dir, 5, 2, out));
  NMT_ASSERT(exists(dir, "step_5.ckpt"));
  NMT_ASSERT(exists(dir, "step_100.ckpt"));
  NMT_ASSERT(!exists(dir, "step_11.ckpt"));
  NMT_ASSERT(latest_is(dir, "step_5.ckpt"));
  /* keep <= 0 keeps everything. */
  for (int s = 200; s < 204; s++) NMT_ASSERT_OK(save(dir, s, 0, NULL));
  NMT_ASSERT_EQ_INT(count_step_files(dir), 6);
  NMT_ASSERT_EQ_INT(count_tmp_files(dir), 0);
}

static void corrupt(const char *dir, const char *name) {
  char p[1024];
  join(p, sizeof p, dir, name);
  long n;
  unsigned char *b = slurp(p, &n);
  if (!b) return;
  b[n / 2] ^= 0xFF;
  spill(p, b, n);
  free(b);
}

#define ASSERT_FINDS(dir, name)                                                        \
  do {                                                                                 \
    char found_[1024], want_[1024];                                                    \
    join(want_, sizeof want_, (dir), (name));                                          \
    NMT_ASSERT_OK(nmt_ckpt_find_latest((dir), found_));                                \
    if (strcmp(found_, want_)) {                                                       \
      nmt_test_fail(__FILE__, __LINE__, "find_latest: %s, want %s", found_, want_);    \
      return;                                                                          \
    }                                                                                  \
  } while (0)

NMT_TEST(ckpt_find_latest_falls_back) {
  char dir[1024], p[1024];
  join(dir, sizeof dir, nmt_test_tmpdir(), "ck");
  for (int s = 1; s <= 3; s++) NMT_ASSERT_OK(save(dir, s, 0, NULL));
  ASSERT_FINDS(dir, "step_3.ckpt");
  /* The newest is damaged: latest names it, but it fails its CRC. */
  corrupt(dir, "step_3.ckpt");
  ASSERT_FINDS(dir, "step_2.ckpt");
  /* latest missing: scan from the highest step down, skipping the damaged one. */
  join(p, sizeof p, dir, "latest");
  NMT_ASSERT(unlink(p) == 0);
  ASSERT_FINDS(dir, "step_2.ckpt");
  /* latest names a file that does not exist, or garbage. */
  NMT_ASSERT(spill_text(p, "step_99.ckpt\n"));
  ASSERT_FINDS(dir, "step_2.ckpt");
  NMT_ASSERT(spill_text(p, "../../etc/passwd\n"));
  ASSERT_FINDS(dir, "step_2.ckpt");
  /* A valid file named by latest is trusted even if a higher step exists. */
  NMT_ASSERT(spill_text(p, "step_1.ckpt\n"));
  ASSERT_FINDS(dir, "step_1.ckpt");
  /* Truncation is caught like a bad CRC. */
  join(p, sizeof p, dir, "step_2.ckpt");
  NMT_ASSERT(truncate(p, 300) == 0);
  join(p, sizeof p, dir, "latest");
  NMT_ASSERT(unlink(p) == 0);
  ASSERT_FINDS(dir, "step_1.ckpt");
  /* Nothing valid left. */
  corrupt(dir, "step_1.ckpt");
  char found[1024];
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_find_latest(dir, found), NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("no valid checkpoint in");
  ASSERT_ERR_HAS(dir);
  /* No directory at all. */
  join(p, sizeof p, dir, "missing");
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_find_latest(p, found), NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("no valid checkpoint in");
}

/* ------------------------------------------------------------------------------------------ */
/* version 2: the metadata section */

static const char CONFIG_TEXT[] = "[model]\nvocab = 8000\nd_model = 512\n";

/* A meta with a config, a path and "model bytes" that hold NULs and every byte value. */
static void sample_meta(nmt_ckpt_meta *m, unsigned char *bytes, size_t n) {
  memset(m, 0, sizeof *m); /* no data record */
  for (size_t i = 0; i < n; i++) bytes[i] = (unsigned char)(i * 7);
  m->config = (char *)CONFIG_TEXT;
  m->spm_model_path = (char *)"data/bible/spm.model";
  m->spm_model = bytes;
  m->spm_model_bytes = n;
}

NMT_TEST(ckpt_meta_round_trip_and_layout) {
  char path[1024];
  join(path, sizeof path, nmt_test_tmpdir(), "meta.ckpt");
  const size_t n = 300;
  unsigned char spm[1000];
  nmt_ckpt_meta meta, got;
  sample_meta(&meta, spm, sizeof spm);
  nmt_ckpt_header h = sample_header(n, 1), rh;
  h.meta = &meta;
  float *p = rand_floats(n, 5), *p2 = calloc(n, 4), *m2 = calloc(n, 4), *v2 = calloc(n, 4);
  NMT_ASSERT(p && p2 && m2 && v2);
  NMT_ASSERT_OK(nmt_ckpt_write(path, &h, p, p, p));
  const size_t meta_bytes = (12 + 6 + strlen(CONFIG_TEXT)) + (12 + 14 + 20) + (12 + 9 + 1000);
  NMT_ASSERT_EQ_INT(file_size(path), 128 + (long)meta_bytes + 4 * 3 * (long)n + 4);
  NMT_ASSERT_OK(nmt_ckpt_read_meta(path, &rh, &got));
  NMT_ASSERT_EQ_INT(rh.version, 2);
  NMT_ASSERT_EQ_INT(rh.meta_bytes, meta_bytes);
  NMT_ASSERT(rh.meta == NULL);
  NMT_ASSERT(header_eq(&rh, &h));
  NMT_ASSERT(got.config && !strcmp(got.config, CONFIG_TEXT));
  NMT_ASSERT(got.spm_model_path && !strcmp(got.spm_model_path, "data/bible/spm.model"));
  NMT_ASSERT_EQ_INT(got.spm_model_bytes, sizeof spm);
  NMT_ASSERT(got.spm_model && !memcmp(got.spm_model, spm, sizeof spm));
  nmt_ckpt_meta_free(&got);
  NMT_ASSERT(got.config == NULL && got.spm_model == NULL);
  /* The arrays come after the section, bit for bit, and the CRC covers it. */
  nmt_ckpt_header expect = sample_header(n, 1);
  NMT_ASSERT_OK(nmt_ckpt_read(path, &expect, &rh, p2, m2, v2));
  NMT_ASSERT(!memcmp(p, p2, n * 4) && !memcmp(p, m2, n * 4) && !memcmp(p, v2, n * 4));
  long sz;
  unsigned char *b = slurp(path, &sz);
  NMT_ASSERT(b);
  /* Layout by hand: meta size at 104, first record at 128: u32 name length, name, u64 length. */
  int layout_ok = le(b + 8, 4) == 2 && le(b + 104, 8) == meta_bytes && le(b + 128, 4) == 6 &&
                  !memcmp(b + 132, "config", 6) && le(b + 138, 8) == strlen(CONFIG_TEXT) &&
                  !memcmp(b + 146, CONFIG_TEXT, strlen(CONFIG_TEXT)) &&
                  le(b + 128 + meta_bytes, 4) == le((unsigned char *)p, 4);
  NMT_ASSERT(layout_ok);
  /* A flipped byte inside the section: the full read says damaged. */
  b[150] ^= 0x20;
  NMT_ASSERT(spill(path, b, sz));
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read(path, NULL, &rh, p2, NULL, NULL), NMT_ERR_CHECKPOINT);
  ASSERT_ERR_HAS("checksum mismatch");
  free(b), free(p), free(p2), free(m2), free(v2);
}

/* Patches the metadata section of a valid file and expects read_meta to refuse it. */
static int meta_refused(const char *path, const unsigned char *good, long sz, size_t off,
                        uint64_t value, int width, const char *phrase) {
  unsigned char *b = malloc((size_t)sz);
  memcpy(b, good, (size_t)sz);
  for (int i = 0; i < width; i++) b[off + (size_t)i] = (unsigned char)(value >> (8 * i));
  int ok = spill(path, b, sz);
  free(b);
  nmt_ckpt_header h;
  nmt_ckpt_meta m;
  if (!ok || nmt_ckpt_read_meta(path, &h, &m) != NMT_ERR_CHECKPOINT) return 0;
  if (!strstr(nmt_last_error(), phrase)) {
    printf("# error \"%s\" lacks \"%s\"\n", nmt_last_error(), phrase);
    return 0;
  }
  return m.config == NULL && m.spm_model == NULL;
}

NMT_TEST(ckpt_meta_damage_is_named) {
  char path[1024];
  join(path, sizeof path, nmt_test_tmpdir(), "bad.ckpt");
  unsigned char spm[64];
  nmt_ckpt_meta meta;
  sample_meta(&meta, spm, sizeof spm);
  nmt_ckpt_header h = sample_header(8, 0);
  h.meta = &meta;
  float p[8] = {0};
  NMT_ASSERT_OK(nmt_ckpt_write(path, &h, p, NULL, NULL));
  long sz;
  unsigned char *good = slurp(path, &sz);
  NMT_ASSERT(good);
  const uint64_t mb = le(good + 104, 8);
  const size_t rec0 = 128, len0 = 128 + 4 + 6;
  NMT_ASSERT(meta_refused(path, good, sz, 104, 1ull << 40, 8, "corrupt header"));
  NMT_ASSERT(meta_refused(path, good, sz, 104, mb + 4, 8, "truncated"));
  NMT_ASSERT(meta_refused(path, good, sz, rec0, 0, 4, "corrupt metadata"));    /* empty name */
  NMT_ASSERT(meta_refused(path, good, sz, rec0, 9999, 4, "corrupt metadata")); /* long name */
  NMT_ASSERT(meta_refused(path, good, sz, len0, mb, 8, "corrupt metadata"));   /* overrun */
  NMT_ASSERT(meta_refused(path, good, sz, len0 + 8 + 3, 0, 1, "corrupt metadata")); /* NUL */
  /* A repeated record: rename "spm_model_path" (the second) to "config". */
  unsigned char *b = malloc((size_t)sz);
  memcpy(b, good, (size_t)sz);
  size_t rec1 = rec0 + 12 + 6 + strlen(CONFIG_TEXT);
  NMT_ASSERT_EQ_INT(le(b + rec1, 4), 14);
  memcpy(b + rec1, "\x06\0\0\0config", 10);
  memcpy(b + rec1 + 10, b + rec1 + 18, 8); /* its u64 length moves up */
  NMT_ASSERT(spill(path, b, sz)); /* sizes no longer tile: refused either way */
  nmt_ckpt_meta m;
  NMT_ASSERT_EQ_STATUS(nmt_ckpt_read_meta(path, &h, &m), NMT_ERR_CHECKPOINT);
  free(b);
  /* An unknown record is skipped (a later version may add some). */
  b = malloc((size_t)sz);
  memcpy(b, good, (size_t)sz);
  memcpy(b + rec1 + 4, "spm_model_XXXX", 14);
  NMT_ASSERT(spill(path, b, sz));
  NMT_ASSERT_OK(nmt_ckpt_read_meta(path, &h, &m));
  NMT_ASSERT(m.config && m.spm_model_path == NULL && m.spm_model_bytes == sizeof spm);
  nmt_ckpt_meta_free(&m);
  free(b), free(good);
}

/* A version-1 file, as nmt wrote before the metadata section: still read, no metadata, and
 * whatever sat in its reserved bytes is not taken for a metadata size. */
NMT_TEST(ckpt_reads_version_1) {
  char path[1024];
  join(path, sizeof path, nmt_test_tmpdir(), "v1.ckpt");
  const size_t n = 50;
  nmt_ckpt_header h = sample_header(n, 0), got;
  float *p = rand_floats(n, 9), *p2 = calloc(n, 4);
  NMT_ASSERT(p && p2);
  NMT_ASSERT_OK(nmt_ckpt_write(path, &h, p, NULL, NULL));
  long sz;
  unsigned char *b = slurp(path, &sz);
  NMT_ASSERT(b);
  b[8] = 1;
  b[104] = 0x55; /* reserved in version 1 */
  uint32_t crc = (uint32_t)crc32(0, b, (uInt)(sz - 4));
  for (int i = 0; i < 4; i++) b[sz - 4 + i] = (unsigned char)(crc >> (8 * i));
  NMT_ASSERT(spill(path, b, sz));
  nmt_ckpt_meta m;
  NMT_ASSERT_OK(nmt_ckpt_read_meta(path, &got, &m));
  NMT_ASSERT_EQ_INT(got.version, 1);
  NMT_ASSERT_EQ_INT(got.meta_bytes, 0);
  NMT_ASSERT(m.config == NULL && m.spm_model_path == NULL && m.spm_model == NULL);
  NMT_ASSERT_OK(nmt_ckpt_read(path, &h, &got, p2, NULL, NULL));
  NMT_ASSERT(!memcmp(p, p2, n * 4));
  NMT_ASSERT_EQ_INT(nmt_ckpt_is_checkpoint(path), 1);
  free(b), free(p), free(p2);
}

NMT_TEST(ckpt_is_checkpoint_by_magic) {
  const char *dir = nmt_test_tmpdir();
  char ck[1024], ini[1024], shortf[1024];
  join(ck, sizeof ck, dir, "a.ckpt");
  join(ini, sizeof ini, dir, "a.ini");
  join(shortf, sizeof shortf, dir, "short");
  nmt_ckpt_header h = sample_header(0, 0);
  NMT_ASSERT_OK(nmt_ckpt_write(ck, &h, NULL, NULL, NULL));
  NMT_ASSERT(spill_text(ini, "[model]\nd_model = 16\n"));
  NMT_ASSERT(spill_text(shortf, "NMTC"));
  NMT_ASSERT_EQ_INT(nmt_ckpt_is_checkpoint(ck), 1);
  NMT_ASSERT_EQ_INT(nmt_ckpt_is_checkpoint(ini), 0);
  NMT_ASSERT_EQ_INT(nmt_ckpt_is_checkpoint(shortf), 0);
  NMT_ASSERT_EQ_INT(nmt_ckpt_is_checkpoint(dir), 0);
  join(ck, sizeof ck, dir, "missing.ckpt");
  NMT_ASSERT_EQ_INT(nmt_ckpt_is_checkpoint(ck), 0);
}
