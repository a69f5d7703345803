/* test/fuzz/fuzz_ckpt.c — the checkpoint reader (src/engine/checkpoint.c) on arbitrary bytes.
 *
 * Byte 0 even: the rest is a checkpoint file. Properties: a header that validates promises a
 * file large enough for its arrays; metadata that parses fits in the file, and its data record
 * describes a usable order; a file that reads completely (CRC included) reads again
 * with its own shape as `expect`, and is refused (NMT_ERR_CHECKPOINT) with another shape.
 * Byte 0 odd: a checkpoint directory: `latest` holds the next data[1] % 64 bytes, step_7.ckpt
 * the rest. Property: nmt_ckpt_find_latest returns only a file inside the directory that reads
 * completely. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fuzz.h"
#include "nmt/checkpoint.h"

static int fuzz_memfile(int slot, const void *data, size_t size, char *path);

static int put_file(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  size_t k = fwrite(data, 1, n, f);
  return fclose(f) == 0 && k == n ? 0 : -1;
}

/* Full read of `path`; 1 if it read, 0 if refused, -1 if a property broke. */
static int read_whole(const char *path, size_t file_size) {
  nmt_ckpt_header h, h2;
  if (nmt_ckpt_read_header(path, &h) != NMT_OK) return 0;
  size_t per = h.has_moments ? 3 : 1;
  if (h.n_params > file_size / (4 * per)) {
    fprintf(stderr, "fuzz_ckpt: header of %s accepted with n_params %llu in %zu bytes\n", path,
            (unsigned long long)h.n_params, file_size);
    return -1;
  }
  /* The metadata parser (version 2) on the same bytes: whatever it accepts lies in the file. */
  nmt_ckpt_meta meta;
  if (nmt_ckpt_read_meta(path, &h2, &meta) == NMT_OK) {
    /* A data record that parses holds a usable order: batches of at least one pair each. */
    const nmt_ckpt_data *d = &meta.data;
    if (d->present && (d->n_batches < 1 || d->n_batches > d->n_pairs || d->max_tokens < 1 ||
                       d->world < 1 || d->accum_steps < 1 || strlen(d->train) > file_size)) {
      fprintf(stderr, "fuzz_ckpt: data record accepted with %lld batches of %lld pairs in %s\n",
              (long long)d->n_batches, (long long)d->n_pairs, path);
      nmt_ckpt_meta_free(&meta);
      return -1;
    }
    if (meta.spm_model_bytes > file_size || (meta.config && strlen(meta.config) > file_size)) {
      fprintf(stderr, "fuzz_ckpt: metadata larger than the file %s\n", path);
      nmt_ckpt_meta_free(&meta);
      return -1;
    }
    nmt_ckpt_meta_free(&meta);
  }
  size_t n = (size_t)h.n_params;
  float *p = malloc((3 * n + 1) * sizeof *p);
  if (!p) return 0;
  int r = 0;
  if (nmt_ckpt_read(path, NULL, &h2, p, p + n, p + 2 * n) == NMT_OK) {
    r = 1;
    if (nmt_ckpt_read(path, &h, NULL, p, p + n, p + 2 * n) != NMT_OK) {
      fprintf(stderr, "fuzz_ckpt: refused with its own shape: %s\n", nmt_last_error());
      r = -1;
    }
    nmt_ckpt_header other = h;
    other.d_model += 1;
    if (r == 1 && nmt_ckpt_read(path, &other, NULL, p, p + n, p + 2 * n) != NMT_ERR_CHECKPOINT) {
      fprintf(stderr, "fuzz_ckpt: read with another d_model did not fail\n");
      r = -1;
    }
  }
  free(p);
  return r;
}

int nmt_fuzz_ckpt(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  if (!(data[0] & 1)) {
    char path[64];
    if (fuzz_memfile(0, data + 1, size - 1, path) != 0) return 0;
    return read_whole(path, size - 1) < 0;
  }
  static char dir[128];
  if (!dir[0]) {
    snprintf(dir, sizeof dir, "%s/nmt-fuzz-ckpt-%ld",
             access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp", (long)getpid());
    mkdir(dir, 0700);
  }
  size_t k = size > 1 ? data[1] % 64 : 0;
  if (2 + k > size) k = size > 2 ? size - 2 : 0;
  char latest[256], ckpt[256], found[1024];
  snprintf(latest, sizeof latest, "%s/latest", dir);
  snprintf(ckpt, sizeof ckpt, "%s/step_7.ckpt", dir);
  const uint8_t *body = data + (size > 2 ? 2 + k : size);
  size_t body_n = size > 2 + k ? size - 2 - k : 0;
  if (put_file(latest, data + (size > 2 ? 2 : size), k) || put_file(ckpt, body, body_n)) return 0;
  int bad = 0;
  if (nmt_ckpt_find_latest(dir, found) == NMT_OK) {
    if (strncmp(found, dir, strlen(dir)) || strchr(found + strlen(dir) + 1, '/') ||
        read_whole(found, body_n) != 1) {
      fprintf(stderr, "fuzz_ckpt: find_latest gave %s, not a whole checkpoint in %s\n", found, dir);
      bad = 1;
    }
  }
  return bad;
}

#define FUZZ_ENTRY nmt_fuzz_ckpt
#include "fuzz_common.h"
