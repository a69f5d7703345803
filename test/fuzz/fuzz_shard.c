/* test/fuzz/fuzz_shard.c — the shard reader (src/data/shard.c, validated on open) and the
 * batcher on top of it, on arbitrary bytes. Property: a shard that opens has every pair's ids
 * in [0, vocab) at the lengths it reports, and every batch the batcher forms fits the token
 * budget it was given.
 *
 * An input that claims version 2 gets its two CRC-32s written in (docs/formats.md) before it
 * is opened: a mutation would almost never keep them right, and the checks behind them (what
 * keeps a hand-made file with correct CRCs from reading out of bounds) would go unfuzzed. The
 * mismatch itself is test/test_shard.c's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "fuzz.h"
#include "nmt/data.h"

static int fuzz_memfile(int slot, const void *data, size_t size, char *path);

enum { MAX_TOKENS = 256, MAX_LEN = 64, MAX_BATCHES = 64 };

static int check_ids(const int32_t *ids, int n, int vocab) {
  for (int j = 0; j < n; j++)
    if (ids[j] < 0 || ids[j] >= vocab) return 1;
  return 0;
}

/* data with the CRCs of a version 2 header made right, in a new buffer (NULL: not one). */
static uint8_t *sealed(const uint8_t *data, size_t size) {
  uint32_t version;
  if (size < 72 || memcmp(data, NMT_SHARD_MAGIC, 8) != 0) return NULL;
  memcpy(&version, data + 8, 4);
  uint8_t *b = version == 2 ? malloc(size) : NULL;
  if (!b) return NULL;
  memcpy(b, data, size);
  uint32_t payload = (uint32_t)crc32(0L, b + 72, (uInt)(size - 72));
  memcpy(b + 64, &payload, 4);
  uint32_t header = (uint32_t)crc32(0L, b, 68);
  memcpy(b + 68, &header, 4);
  return b;
}

int nmt_fuzz_shard(const uint8_t *data, size_t size) {
  char path[64];
  uint8_t *copy = sealed(data, size);
  int made = fuzz_memfile(0, copy ? copy : data, size, path);
  free(copy);
  if (made != 0) return 0;
  nmt_shard *sh;
  if (nmt_shard_open(path, 0, &sh) != NMT_OK) return 0;
  int bad = 0, vocab = nmt_shard_vocab(sh);
  long n = nmt_shard_num_pairs(sh);
  for (long i = 0; i < n && !bad; i++) {
    int sl = nmt_shard_src_len(sh, i), tl = nmt_shard_tgt_len(sh, i);
    if (sl < 0 || tl < 0 || (size_t)sl > size || (size_t)tl > size) {
      fprintf(stderr, "fuzz_shard: pair %ld has lengths %d, %d in a %zu-byte file\n", i, sl, tl,
              size);
      bad = 1;
      break;
    }
    int32_t *buf = malloc(((size_t)(sl > tl ? sl : tl) + 1) * sizeof *buf);
    if (!buf) break;
    nmt_shard_copy_src(sh, i, buf);
    bad |= check_ids(buf, sl, vocab);
    nmt_shard_copy_tgt(sh, i, buf);
    bad |= check_ids(buf, tl, vocab);
    free(buf);
    if (bad) fprintf(stderr, "fuzz_shard: pair %ld has an id outside [0, %d)\n", i, vocab);
  }
  nmt_batcher *b;
  if (!bad && nmt_batcher_create(sh, MAX_TOKENS, MAX_LEN, 1, &b) == NMT_OK) {
    int32_t *buf = malloc((5 * (size_t)MAX_TOKENS + 16) * sizeof *buf);
    long nb = nmt_batcher_num_batches(b);
    for (long k = 0; buf && k < nb && k < MAX_BATCHES && !bad; k++) {
      long id = nmt_batcher_order(b, 1, k);
      int ns, sl, tl;
      long tt;
      nmt_batcher_shape(b, id, &ns, &sl, &tl, &tt);
      if (id < 0 || id >= nb || ns < 1 || sl < 1 || tl < 1 || sl > MAX_LEN || tl > MAX_LEN ||
          (long)ns * sl > MAX_TOKENS || (long)ns * tl > MAX_TOKENS) {
        fprintf(stderr, "fuzz_shard: batch %ld is %d x (%d, %d), over the budget\n", id, ns, sl,
                tl);
        bad = 1;
        break;
      }
      nmt_batch bt;
      nmt_batch_layout(&bt, buf, ns, sl, tl);
      nmt_batcher_fill(b, id, &bt);
      bad |= check_ids(bt.src, ns * sl, vocab) | check_ids(bt.tgt_in, ns * tl, vocab) |
             check_ids(bt.tgt_out, ns * tl, vocab);
      if (bad) fprintf(stderr, "fuzz_shard: batch %ld holds an id outside [0, %d)\n", id, vocab);
    }
    free(buf);
    nmt_batcher_destroy(b);
  }
  nmt_shard_close(sh);
  return bad;
}

#define FUZZ_ENTRY nmt_fuzz_shard
#include "fuzz_common.h"
