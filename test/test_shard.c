/* test_shard.c — shard writer/reader round trips, the text writer, every kind of damage the
 * reader must reject on open, the version 2 checksums and version 1 shards (docs/formats.md
 * "Shard format"). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "helpers.h"
#include "nmt/data.h"
#include "nmt/log.h"
#include "test.h"

/* Random pairs: lengths 0..max_len, ids in [0, vocab). xorshift64* so the data differ per seed. */
typedef struct {
  long n;
  uint64_t *so, *to;
  int32_t *si, *ti;
} pairs;

static uint64_t next_rand(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 2685821657736338717ull;
}

static void make_pairs_min(pairs *p, long n, int min_len, int max_len, int vocab, uint64_t seed) {
  p->n = n;
  p->so = malloc((size_t)(n + 1) * sizeof *p->so);
  p->to = malloc((size_t)(n + 1) * sizeof *p->to);
  p->si = malloc((size_t)(n * max_len + 1) * sizeof *p->si);
  p->ti = malloc((size_t)(n * max_len + 1) * sizeof *p->ti);
  p->so[0] = p->to[0] = 0;
  for (long i = 0; i < n; i++) {
    uint64_t span = (uint64_t)(max_len - min_len + 1);
    p->so[i + 1] = p->so[i] + (uint64_t)min_len + next_rand(&seed) % span;
    p->to[i + 1] = p->to[i] + (uint64_t)min_len + next_rand(&seed) % span;
  }
  for (uint64_t k = 0; k < p->so[n]; k++) p->si[k] = (int32_t)(next_rand(&seed) % (uint64_t)vocab);
  for (uint64_t k = 0; k < p->to[n]; k++) p->ti[k] = (int32_t)(next_rand(&seed) % (uint64_t)vocab);
  /* Make sure the extremes of the id range are present. */
  if (p->so[n] > 1) p->si[0] = vocab - 1, p->si[1] = 0;
}

static void make_pairs(pairs *p, long n, int max_len, int vocab, uint64_t seed) {
  make_pairs_min(p, n, 0, max_len, vocab, seed);
}

static void free_pairs(pairs *p) {
  free(p->so);
  free(p->to);
  free(p->si);
  free(p->ti);
}

static long file_size(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 ? (long)st.st_size : -1;
}

/* Compares every accessor of an open shard with the pairs it was written from. */
static int shard_matches(const nmt_shard *s, const pairs *p, int vocab) {
  if (nmt_shard_num_pairs(s) != p->n || nmt_shard_vocab(s) != vocab) {
    nmt_test_fail(__FILE__, __LINE__, "pairs %ld vs %ld, vocab %d vs %d", nmt_shard_num_pairs(s),
                  p->n, nmt_shard_vocab(s), vocab);
    return 0;
  }
  int32_t buf[256];
  for (long i = 0; i < p->n; i++) {
    int ls = (int)(p->so[i + 1] - p->so[i]), lt = (int)(p->to[i + 1] - p->to[i]);
    if (nmt_shard_src_len(s, i) != ls || nmt_shard_tgt_len(s, i) != lt) {
      nmt_test_fail(__FILE__, __LINE__, "pair %ld: lengths %d/%d, expected %d/%d", i,
                    nmt_shard_src_len(s, i), nmt_shard_tgt_len(s, i), ls, lt);
      return 0;
    }
    nmt_shard_copy_src(s, i, buf);
    if (memcmp(buf, p->si + p->so[i], (size_t)ls * sizeof *buf)) {
      nmt_test_fail(__FILE__, __LINE__, "pair %ld: source ids differ", i);
      return 0;
    }
    nmt_shard_copy_tgt(s, i, buf);
    if (memcmp(buf, p->ti + p->to[i], (size_t)lt * sizeof *buf)) {
      nmt_test_fail(__FILE__, __LINE__, "pair %ld: target ids differ", i);
      return 0;
    }
  }
  return 1;
}

static void round_trip(int vocab, int expect_width) {
  pairs p;
  make_pairs(&p, 300, 40, vocab, (uint64_t)vocab * 7919u + 1);
  char path[512];
  snprintf(path, sizeof path, "%s/rt.shard", nmt_test_tmpdir());
  NMT_ASSERT_OK(nmt_shard_write(path, vocab, p.n, p.so, p.si, p.to, p.ti));
  /* Size from the documented layout: header, two offset arrays, ids at the width, target ids
   * 8-aligned. */
  long src_end = 72 + 16 * (p.n + 1) + (long)p.so[p.n] * expect_width;
  long expect = ((src_end + 7) / 8) * 8 + (long)p.to[p.n] * expect_width;
  NMT_ASSERT_EQ_INT(file_size(path), expect);
  nmt_shard *s;
  NMT_ASSERT_OK(nmt_shard_open(path, vocab, &s));
  int ok = shard_matches(s, &p, vocab);
  nmt_shard_close(s);
  free_pairs(&p);
  NMT_ASSERT(ok);
}

NMT_TEST(shard_round_trip_2byte) { round_trip(8000, 2); }
NMT_TEST(shard_round_trip_2byte_max) { round_trip(65536, 2); }
NMT_TEST(shard_round_trip_4byte) { round_trip(100003, 4); }

NMT_TEST(shard_empty_pairs_and_zero_pairs) {
  char path[512];
  snprintf(path, sizeof path, "%s/z.shard", nmt_test_tmpdir());
  uint64_t off[1] = {0};
  NMT_ASSERT_OK(nmt_shard_write(path, 10, 0, off, NULL, off, NULL));
  nmt_shard *s;
  NMT_ASSERT_OK(nmt_shard_open(path, 10, &s));
  NMT_ASSERT_EQ_INT(nmt_shard_num_pairs(s), 0);
  nmt_shard_close(s);
  /* Pairs with an empty side are legal (an empty line in a test set must keep its place). */
  uint64_t so[3] = {0, 0, 2}, to[3] = {0, 1, 1};
  int32_t si[2] = {4, 5}, ti[1] = {9};
  NMT_ASSERT_OK(nmt_shard_write(path, 10, 2, so, si, to, ti));
  NMT_ASSERT_OK(nmt_shard_open(path, 10, &s));
  NMT_ASSERT_EQ_INT(nmt_shard_src_len(s, 0), 0);
  NMT_ASSERT_EQ_INT(nmt_shard_tgt_len(s, 1), 0);
  nmt_shard_close(s);
}

NMT_TEST(shard_write_rejects_bad_input) {
  char path[512];
  snprintf(path, sizeof path, "%s/bad.shard", nmt_test_tmpdir());
  uint64_t so[3] = {0, 2, 1}, to[3] = {0, 1, 2};
  int32_t ids[2] = {1, 2};
  NMT_ASSERT_EQ_STATUS(nmt_shard_write(path, 10, 2, so, ids, to, ids), NMT_ERR_DATA);
  NMT_ASSERT(strstr(nmt_last_error(), "not monotone") != NULL);
  uint64_t ok[3] = {0, 1, 2};
  int32_t big[2] = {1, 10};
  NMT_ASSERT_EQ_STATUS(nmt_shard_write(path, 10, 2, ok, ids, ok, big), NMT_ERR_DATA);
  NMT_ASSERT(strstr(nmt_last_error(), "id 10 >= vocab 10 at pair 1 (tgt)") != NULL);
  NMT_ASSERT(access(path, F_OK) != 0); /* nothing half-written left behind */
}

/* ------------------------------------------------------------------------------------------ */
/* from text                                                                                  */

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (f) {
    fputs(text, f);
    fclose(f);
  }
}

static void write_ids_text(const char *path, const uint64_t *off, const int32_t *ids, long n) {
  FILE *f = fopen(path, "w");
  if (!f) return;
  for (long i = 0; i < n; i++) {
    for (uint64_t k = off[i]; k < off[i + 1]; k++)
      fprintf(f, k > off[i] ? " %d" : "%d", ids[k]);
    fputc('\n', f);
  }
  fclose(f);
}

static int same_bytes(const char *a, const char *b) {
  FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
  int same = fa && fb;
  while (same) {
    int ca = fgetc(fa), cb = fgetc(fb);
    if (ca != cb) same = 0;
    if (ca == EOF || cb == EOF) break;
  }
  if (fa) fclose(fa);
  if (fb) fclose(fb);
  return same;
}

NMT_TEST(shard_from_text_matches_writer) {
  const char *dir = nmt_test_tmpdir();
  for (int w = 0; w < 2; w++) {
    int vocab = w ? 70000 : 8000;
    pairs p;
    make_pairs(&p, 500, 30, vocab, 99 + (uint64_t)w);
    char src[512], tgt[512], a[512], b[512];
    snprintf(src, sizeof src, "%s/s.ids", dir);
    snprintf(tgt, sizeof tgt, "%s/t.ids", dir);
    snprintf(a, sizeof a, "%s/a.shard", dir);
    snprintf(b, sizeof b, "%s/b.shard", dir);
    write_ids_text(src, p.so, p.si, p.n);
    write_ids_text(tgt, p.to, p.ti, p.n);
    NMT_ASSERT_OK(nmt_shard_write_from_text(src, tgt, vocab, a));
    NMT_ASSERT_OK(nmt_shard_write(b, vocab, p.n, p.so, p.si, p.to, p.ti));
    /* Two different writers (streaming from text, and from arrays) give identical bytes. */
    NMT_ASSERT(same_bytes(a, b));
    nmt_shard *s;
    NMT_ASSERT_OK(nmt_shard_open(a, vocab, &s));
    int ok = shard_matches(s, &p, vocab);
    nmt_shard_close(s);
    free_pairs(&p);
    NMT_ASSERT(ok);
  }
}

NMT_TEST(shard_from_text_tolerates_crlf_and_no_final_newline) {
  const char *dir = nmt_test_tmpdir();
  char src[512], tgt[512], out[512];
  snprintf(src, sizeof src, "%s/s.ids", dir);
  snprintf(tgt, sizeof tgt, "%s/t.ids", dir);
  snprintf(out, sizeof out, "%s/o.shard", dir);
  write_text(src, "5 6\r\n\r\n7");
  write_text(tgt, "  8\t9 \n4\n\n");
  NMT_ASSERT_OK(nmt_shard_write_from_text(src, tgt, 10, out));
  nmt_shard *s;
  NMT_ASSERT_OK(nmt_shard_open(out, 10, &s));
  NMT_ASSERT_EQ_INT(nmt_shard_num_pairs(s), 3);
  NMT_ASSERT_EQ_INT(nmt_shard_src_len(s, 0), 2);
  NMT_ASSERT_EQ_INT(nmt_shard_src_len(s, 1), 0);
  NMT_ASSERT_EQ_INT(nmt_shard_src_len(s, 2), 1);
  NMT_ASSERT_EQ_INT(nmt_shard_tgt_len(s, 0), 2);
  NMT_ASSERT_EQ_INT(nmt_shard_tgt_len(s, 2), 0);
  int32_t t[2];
  nmt_shard_copy_tgt(s, 0, t);
  NMT_ASSERT_EQ_INT(t[0], 8);
  NMT_ASSERT_EQ_INT(t[1], 9);
  nmt_shard_close(s);
}

static void expect_text_error(const char *src_text, const char *tgt_text, nmt_status want,
                              const char *phrase) {
  const char *dir = nmt_test_tmpdir();
  char src[512], tgt[512], out[512];
  snprintf(src, sizeof src, "%s/src.ids", dir);
  snprintf(tgt, sizeof tgt, "%s/tgt.ids", dir);
  snprintf(out, sizeof out, "%s/out.shard", dir);
  write_text(src, src_text);
  write_text(tgt, tgt_text);
  unlink(out);
  NMT_ASSERT_EQ_STATUS(nmt_shard_write_from_text(src, tgt, 100, out), want);
  if (!strstr(nmt_last_error(), phrase))
    nmt_test_fail(__FILE__, __LINE__, "message \"%s\" lacks \"%s\"", nmt_last_error(), phrase);
  NMT_ASSERT(access(out, F_OK) != 0);
}

NMT_TEST(shard_from_text_errors_name_file_and_line) {
  expect_text_error("1 2\n3\n", "1\n", NMT_ERR_DATA, "src.ids has 2 lines, ");
  expect_text_error("1 2\n3\n", "1\n4 5 100\n", NMT_ERR_DATA, "tgt.ids:2: id 100 >= vocab 100");
  expect_text_error("1 2\n3 x7\n", "1\n2\n", NMT_ERR_DATA, "src.ids:2: bad id \"x7\"");
  expect_text_error("1 2\n3 7x\n", "1\n2\n", NMT_ERR_DATA, "src.ids:2: bad id \"7x\"");
  expect_text_error("1 -2\n", "1\n", NMT_ERR_DATA, "src.ids:1: bad id \"-2\"");
  expect_text_error("1 +2\n", "1\n", NMT_ERR_DATA, "src.ids:1: bad id \"+2\"");
  expect_text_error("1\n", "99999999999999999999\n", NMT_ERR_DATA, "tgt.ids:1: bad id");
  NMT_ASSERT_EQ_STATUS(nmt_shard_write_from_text("/nonexistent/a", "/nonexistent/b", 10, "/tmp/x"),
                       NMT_ERR_IO);
  NMT_ASSERT(strstr(nmt_last_error(), "/nonexistent/a") != NULL);
}

/* ------------------------------------------------------------------------------------------ */
/* damage                                                                                     */

typedef struct {
  char path[512];
  unsigned char *bytes;
  long size;
  pairs p;
} good_shard;

static int make_good(good_shard *g, int vocab) {
  snprintf(g->path, sizeof g->path, "%s/d.shard", nmt_test_tmpdir());
  make_pairs_min(&g->p, 50, 1, 12, vocab, 4242);
  if (nmt_shard_write(g->path, vocab, g->p.n, g->p.so, g->p.si, g->p.to, g->p.ti) != NMT_OK)
    return 0;
  g->size = file_size(g->path);
  g->bytes = malloc((size_t)g->size);
  FILE *f = fopen(g->path, "rb");
  if (!f || fread(g->bytes, 1, (size_t)g->size, f) != (size_t)g->size) return 0;
  fclose(f);
  return 1;
}

static void free_good(good_shard *g) {
  free(g->bytes);
  free_pairs(&g->p);
}

/* Writes `n` bytes of `bytes` as the shard, opens it, and checks for NMT_ERR_DATA and a message
 * naming the file and containing `phrase`. Returns 1 if so. */
static int damaged(const good_shard *g, const unsigned char *bytes, long n, int expected_vocab,
                   const char *phrase, int line) {
  FILE *f = fopen(g->path, "wb");
  if (!f) return 0;
  if (n) fwrite(bytes, 1, (size_t)n, f);
  fclose(f);
  nmt_shard *s = NULL;
  nmt_status st = nmt_shard_open(g->path, expected_vocab, &s);
  if (st != NMT_ERR_DATA || s) {
    nmt_test_fail(__FILE__, line, "expected NMT_ERR_DATA, got %s", nmt_status_str(st));
    nmt_shard_close(s);
    return 0;
  }
  if (!strstr(nmt_last_error(), g->path) || !strstr(nmt_last_error(), phrase)) {
    nmt_test_fail(__FILE__, line, "message \"%s\" lacks the path or \"%s\"", nmt_last_error(),
                  phrase);
    return 0;
  }
  return 1;
}

static void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get32(const unsigned char *p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
static uint64_t get64(const unsigned char *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

/* The two CRC-32s of a version 2 shard's bytes as docs/formats.md defines them, computed here
 * with zlib directly (not the reader's code): the payload's, of bytes 72 to the end, stored at
 * 64; the header's, of bytes 0..67, stored at 68. */
static uint32_t payload_crc_of(const unsigned char *b, long size) {
  return (uint32_t)crc32(0L, b + 72, (uInt)(size - 72));
}
static uint32_t header_crc_of(const unsigned char *b) { return (uint32_t)crc32(0L, b, 68); }
static void reseal(unsigned char *b, long size) { nmt_th_shard_reseal(b, (size_t)size); }

NMT_TEST(shard_truncated) {
  good_shard g;
  NMT_ASSERT(make_good(&g, 1000));
  long cuts[] = {0, 3, 8, 40, 63, 64, 100, g.size / 2, g.size - 2, g.size - 1};
  int ok = 1;
  for (size_t i = 0; ok && i < sizeof cuts / sizeof cuts[0]; i++)
    ok = damaged(&g, g.bytes, cuts[i], 0, "truncated", __LINE__);
  /* Trailing garbage is caught too. */
  unsigned char *more = malloc((size_t)g.size + 5);
  memcpy(more, g.bytes, (size_t)g.size);
  memset(more + g.size, 0, 5);
  if (ok) ok = damaged(&g, more, g.size + 5, 0, "trailing bytes", __LINE__);
  free(more);
  free_good(&g);
  NMT_ASSERT(ok);
}

NMT_TEST(shard_bad_header_fields) {
  good_shard g;
  NMT_ASSERT(make_good(&g, 1000));
  unsigned char *b = malloc((size_t)g.size);
  int ok = 1;
#define DAMAGE(edit, vocab, phrase)                                   \
  do {                                                                \
    memcpy(b, g.bytes, (size_t)g.size);                               \
    edit;                                                             \
    reseal(b, g.size);                                                \
    if (ok) ok = damaged(&g, b, g.size, (vocab), (phrase), __LINE__); \
  } while (0)
  DAMAGE(b[0] = 'X', 0, "bad magic");
  DAMAGE(memcpy(b, "NMTSHRD2", 8), 0, "bad magic");
  DAMAGE(put32(b + 8, 3), 0, "unsupported version 3");
  DAMAGE(put32(b + 8, 0), 0, "unsupported version 0");
  /* Read as version 1, the source offsets would start at the CRCs. */
  DAMAGE(put32(b + 8, 1), 0, "src offsets[0] = ");
  DAMAGE(put32(b + 12, 3), 0, "bad id width 3");
  DAMAGE(put32(b + 12, 8), 0, "bad id width 8");
  DAMAGE(put32(b + 16, 0), 0, "bad vocab");
  DAMAGE(put32(b + 16, 3), 0, "bad vocab 3: ids 0-3 are reserved");
  DAMAGE((void)0, 999, "vocab mismatch");
  DAMAGE((void)0, 8000, "vocab mismatch");
  /* Pair count larger than the file could hold. */
  DAMAGE(put64(b + 24, 1ull << 40), 0, "offset out of range");
  /* Section offsets outside the file, overlapping, or misaligned. */
  DAMAGE(put64(b + 32, (uint64_t)g.size + 8), 0, "offset out of range");
  DAMAGE(put64(b + 32, 64), 0, "offset out of range");
  DAMAGE(put64(b + 40, get64(b + 40) + 1), 0, "offset out of range");
  DAMAGE(put64(b + 48, ~0ull), 0, "offset out of range");
  /* The header's file size disagrees with the file. */
  DAMAGE(put64(b + 56, (uint64_t)g.size + 100), 0, "truncated");
#undef DAMAGE
  free(b);
  free_good(&g);
  NMT_ASSERT(ok);
}

NMT_TEST(shard_bad_offsets_and_ids) {
  good_shard g;
  NMT_ASSERT(make_good(&g, 1000));
  unsigned char *b = malloc((size_t)g.size);
  long n = g.p.n;
  unsigned char *src_off = b + 72, *tgt_off = b + 72 + 8 * (n + 1);
  uint64_t src_ids_at = get64(g.bytes + 40), tgt_ids_at = get64(g.bytes + 48);
  int ok = 1;
  long victim = 17; /* every pair has >= 1 id a side (make_good) */
  char msg[128];
#define DAMAGE(edit, phrase)                                      \
  do {                                                            \
    memcpy(b, g.bytes, (size_t)g.size);                           \
    edit;                                                         \
    reseal(b, g.size);                                            \
    if (ok) ok = damaged(&g, b, g.size, 0, (phrase), __LINE__);   \
  } while (0)
  DAMAGE(put64(src_off, 1), "src offsets[0] = 1");
  DAMAGE(put64(tgt_off + 8 * 5, get64(tgt_off + 8 * 6) + 1), "tgt offsets not monotone at pair 5");
  DAMAGE(put64(src_off + 8 * n, get64(src_off + 8 * n) + 1000), "src offset out of range");
  DAMAGE(put64(tgt_off + 8 * n, get64(tgt_off + 8 * n) + 1), "tgt offset out of range");
  /* Ids past the last offset (the target side must end exactly at the end of the file). */
  DAMAGE(put64(tgt_off + 8 * n, get64(tgt_off + 8 * n) - 1), "bytes after the last target id");
  snprintf(msg, sizeof msg, "id 1000 >= vocab 1000 at pair %ld (src)", victim);
  DAMAGE(memcpy(b + src_ids_at + 2 * g.p.so[victim], &(uint16_t){1000}, 2), msg);
  snprintf(msg, sizeof msg, "id 65535 >= vocab 1000 at pair %ld (tgt)", victim);
  DAMAGE(memcpy(b + tgt_ids_at + 2 * (g.p.to[victim + 1] - 1), &(uint16_t){65535}, 2), msg);
#undef DAMAGE
  free(b);
  free_good(&g);
  NMT_ASSERT(ok);
}

NMT_TEST(shard_open_missing_is_io_error) {
  nmt_shard *s = (nmt_shard *)1;
  NMT_ASSERT_EQ_STATUS(nmt_shard_open("/nonexistent/dir/x.shard", 0, &s), NMT_ERR_IO);
  NMT_ASSERT(s == NULL);
  NMT_ASSERT(strstr(nmt_last_error(), "/nonexistent/dir/x.shard") != NULL);
}

/* ------------------------------------------------------------------------------------------ */
/* checksums (issue 38: a byte changed since the writer closed the file was trained on,
 * validated and evaluated without a word)                                                    */

/* Every byte of the file with one bit flipped (bit i mod 8 of byte i): each such file is
 * refused (CRC-32 detects every single-bit error; the version field, read before the header's
 * CRC, cannot turn 2 into 1 by one bit). Before version 2 most of these opened and read as
 * other ids. */
NMT_TEST(shard_checksum_refuses_every_flipped_byte) {
  good_shard g;
  NMT_ASSERT(make_good(&g, 1000));
  unsigned char *b = malloc((size_t)g.size);
  long opened = 0, first = -1;
  for (long i = 0; i < g.size; i++) {
    memcpy(b, g.bytes, (size_t)g.size);
    b[i] ^= (unsigned char)(1u << (i % 8));
    FILE *f = fopen(g.path, "wb");
    NMT_ASSERT(f && fwrite(b, 1, (size_t)g.size, f) == (size_t)g.size && fclose(f) == 0);
    nmt_shard *s = NULL;
    nmt_status st = nmt_shard_open(g.path, 0, &s);
    if (st == NMT_OK) {
      if (first < 0) first = i;
      opened++;
      nmt_shard_close(s);
    } else if (st != NMT_ERR_DATA || !strstr(nmt_last_error(), g.path)) {
      nmt_test_fail(__FILE__, __LINE__, "byte %ld: %s: %s", i, nmt_status_str(st),
                    nmt_last_error());
      break;
    }
  }
  long size = g.size;
  free(b);
  free_good(&g);
  if (opened)
    nmt_test_fail(__FILE__, __LINE__, "%ld of %ld one-bit changes opened, the first at byte %ld",
                  opened, size, first);
  NMT_ASSERT_EQ_INT(opened, 0);
}

/* The writer stores the two CRCs docs/formats.md defines, the reader reports them, and a shard
 * that is as written opens. */
NMT_TEST(shard_checksum_stored_as_documented) {
  good_shard g;
  NMT_ASSERT(make_good(&g, 1000));
  uint32_t want_payload = payload_crc_of(g.bytes, g.size), want_header = header_crc_of(g.bytes);
  uint32_t stored_payload = get32(g.bytes + 64), stored_header = get32(g.bytes + 68);
  uint32_t version = get32(g.bytes + 8);
  nmt_shard *s = NULL;
  nmt_status st = nmt_shard_open(g.path, 1000, &s);
  uint32_t hc = 0, pc = 0;
  int has = s ? nmt_shard_crc32(s, &hc, &pc) : -1, v = s ? nmt_shard_version(s) : -1;
  int ok = s && shard_matches(s, &g.p, 1000);
  nmt_shard_close(s);
  free_good(&g);
  NMT_ASSERT_OK(st);
  NMT_ASSERT(ok);
  NMT_ASSERT_EQ_INT(version, NMT_SHARD_VERSION);
  NMT_ASSERT_EQ_INT(v, 2);
  NMT_ASSERT_EQ_INT(has, 1);
  NMT_ASSERT_EQ_INT(stored_payload, want_payload);
  NMT_ASSERT_EQ_INT(stored_header, want_header);
  NMT_ASSERT_EQ_INT(pc, want_payload);
  NMT_ASSERT_EQ_INT(hc, want_header);
}

/* A payload byte that every other check accepts (an id changed into another id < vocab, the
 * zero padding between the id sections, the last target id): refused, the message naming the
 * file, both CRCs and what to do. */
NMT_TEST(shard_checksum_payload_mismatch_names_file_and_values) {
  good_shard g;
  NMT_ASSERT(make_good(&g, 1000));
  unsigned char *b = malloc((size_t)g.size);
  uint64_t src_ids_at = get64(g.bytes + 40), tgt_ids_at = get64(g.bytes + 48);
  uint64_t pad_at = src_ids_at + 2 * g.p.so[g.p.n];
  long at[3] = {(long)(src_ids_at + 2 * g.p.so[17]), (long)pad_at, g.size - 2};
  int ok = 1;
  if (pad_at >= tgt_ids_at) {
    nmt_test_fail(__FILE__, __LINE__, "make_good's shard has no padding (%llu source ids)",
                  (unsigned long long)g.p.so[g.p.n]);
    ok = 0;
  }
  for (int k = 0; ok && k < 3; k++) {
    memcpy(b, g.bytes, (size_t)g.size);
    b[at[k]] ^= 1; /* ids < 1000 stay < 1000 */
    char phrase[160];
    snprintf(phrase, sizeof phrase, "payload checksum mismatch (stored %08x, computed %08x)",
             get32(b + 64), payload_crc_of(b, g.size));
    ok = damaged(&g, b, g.size, 0, phrase, __LINE__) &&
         damaged(&g, b, g.size, 0, "tools/prepare-data.sh", __LINE__);
  }
  free(b);
  free_good(&g);
  NMT_ASSERT(ok);
}

/* A header field the other checks cannot doubt (vocab 1000 read as 1001, the SentencePiece
 * model's hash, which only `nmt train` compares), refused by the header's CRC, by open and by
 * the header-only read that checks data.spm_model. */
NMT_TEST(shard_checksum_header_mismatch) {
  good_shard g;
  NMT_ASSERT(make_good(&g, 1000));
  unsigned char *b = malloc((size_t)g.size);
  int ok = 1;
  int fields[2] = {16, 20}; /* vocab, spm_hash */
  for (int k = 0; ok && k < 2; k++) {
    memcpy(b, g.bytes, (size_t)g.size);
    b[fields[k]] ^= 1;
    char phrase[160];
    snprintf(phrase, sizeof phrase, "header checksum mismatch (stored %08x, computed %08x)",
             get32(b + 68), header_crc_of(b));
    ok = damaged(&g, b, g.size, 0, phrase, __LINE__);
    uint32_t h = 1;
    nmt_status st = nmt_shard_read_spm_hash(g.path, &h);
    if (ok && (st != NMT_ERR_DATA || !strstr(nmt_last_error(), phrase))) {
      nmt_test_fail(__FILE__, __LINE__, "nmt_shard_read_spm_hash: %s: %s", nmt_status_str(st),
                    nmt_last_error());
      ok = 0;
    }
  }
  free(b);
  free_good(&g);
  NMT_ASSERT(ok);
}

static char shard_warned[4096];
static void on_shard_log(void *user, nmt_log_level level, const char *msg) {
  (void)user;
  if (level == NMT_LOG_WARN && strlen(shard_warned) + strlen(msg) + 2 < sizeof shard_warned)
    strcat(strcat(shard_warned, msg), "\n");
}

/* nmt_shard_open with the warnings it logs in shard_warned. */
static nmt_status open_logged(const char *path, int vocab, nmt_shard **s) {
  static const nmt_log_sink sink = {on_shard_log, NULL};
  shard_warned[0] = 0;
  nmt_log_level level = nmt_log_get_level();
  nmt_log_set_level(NMT_LOG_WARN);
  nmt_log_set_sink(&sink);
  nmt_status st = nmt_shard_open(path, vocab, s);
  nmt_log_set_sink(NULL);
  nmt_log_set_level(level);
  return st;
}

/* Version 1 shards (no checksums; what data/ holds from before version 2) still open and read
 * as written, with one warning naming the file; damage the other checks catch is still
 * refused. */
NMT_TEST(shard_version_1_opens_with_a_warning) {
  good_shard g;
  NMT_ASSERT(make_good(&g, 1000));
  char v1[600];
  snprintf(v1, sizeof v1, "%s/v1.shard", nmt_test_tmpdir());
  int made = nmt_th_shard_to_v1(g.path, v1) == 0;
  nmt_shard *s = NULL;
  nmt_status st = made ? open_logged(v1, 1000, &s) : NMT_ERR_INTERNAL;
  uint32_t hc = 1, pc = 1;
  int has = s ? nmt_shard_crc32(s, &hc, &pc) : -1, v = s ? nmt_shard_version(s) : -1;
  int ok = s && shard_matches(s, &g.p, 1000);
  nmt_shard_close(s);
  char warned[sizeof shard_warned];
  snprintf(warned, sizeof warned, "%s", shard_warned);
  /* A version 2 shard opens without a word. */
  nmt_status st2 = open_logged(g.path, 1000, &s);
  nmt_shard_close(s);
  free_good(&g);
  NMT_ASSERT(made);
  NMT_ASSERT_OK(st);
  NMT_ASSERT(ok);
  NMT_ASSERT_EQ_INT(v, 1);
  NMT_ASSERT_EQ_INT(has, 0);
  NMT_ASSERT_EQ_INT(hc, 0);
  NMT_ASSERT_EQ_INT(pc, 0);
  if (nmt_th_count(warned, "\n") != 1 || !strstr(warned, v1) ||
      !strstr(warned, "version 1 shard has no checksum") ||
      !strstr(warned, "tools/prepare-data.sh"))
    nmt_test_fail(__FILE__, __LINE__, "warnings: \"%s\"", warned);
  NMT_ASSERT(!nmt_test_failed());
  NMT_ASSERT_OK(st2);
  NMT_ASSERT_EQ_INT(shard_warned[0], 0);
  uint32_t h = 1;
  NMT_ASSERT_OK(nmt_shard_read_spm_hash(v1, &h));
  NMT_ASSERT_EQ_INT(h, 0);
  /* An id >= vocab in a version 1 shard is refused as before. */
  size_t n = 0;
  unsigned char *b = (unsigned char *)nmt_th_read_file(v1, &n);
  NMT_ASSERT(b != NULL);
  memcpy(b + get64(b + 40), &(uint16_t){1000}, 2);
  FILE *f = fopen(v1, "wb");
  int wrote = f && fwrite(b, 1, n, f) == n;
  if (f) fclose(f);
  free(b);
  NMT_ASSERT(wrote);
  NMT_ASSERT_EQ_STATUS(nmt_shard_open(v1, 0, &s), NMT_ERR_DATA);
  NMT_ASSERT(strstr(nmt_last_error(), "id 1000 >= vocab 1000 at pair 0 (src)") != NULL);
}
