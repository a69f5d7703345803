/* data/shard.c — binary shards of SentencePiece ids: atomic writer, mmap reader that validates
 * everything on open, the header's and the payload's CRC-32 (version 2) first. Byte layout:
 * docs/formats.md "Shard format". */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "nmt/data.h"
#include "nmt/log.h"
#include "shard_impl.h"
#include "nmt/types.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "shards are little-endian and read in place; a big-endian host needs byte swaps here"
#endif

enum {
  HEADER_BYTES = 72,    /* version 2; the source offsets always start right after the header */
  HEADER_BYTES_V1 = 64, /* version 1: the same fields without the two CRCs */
  /* Header field offsets (docs/formats.md). */
  H_MAGIC = 0,
  H_VERSION = 8,
  H_ID_WIDTH = 12,
  H_VOCAB = 16,
  H_SPM_HASH = 20, /* 0 in shards written before it was recorded (the old reserved field) */
  H_N_PAIRS = 24,
  H_TGT_OFFSETS = 32,
  H_SRC_IDS = 40,
  H_TGT_IDS = 48,
  H_FILE_BYTES = 56,
  H_PAYLOAD_CRC = 64, /* version 2: CRC-32 of bytes HEADER_BYTES.. the end */
  H_HEADER_CRC = 68,  /* version 2: CRC-32 of bytes 0..67 (payload CRC included) */
};

/* What a checksum mismatch tells the user to do: the scripts' "up to date" compares times,
 * which a damaged file keeps, hence "remove it". */
#define REBUILD_HINT                                                                        \
  "the file changed since it was written (damaged on disk or in a copy); remove it and rerun " \
  "tools/prepare-data.sh (tools/prepare-bible.sh for data/bible), or write it again with "   \
  "`nmt shard`"

struct nmt_shard {
  void *map;
  size_t map_bytes;
  int version;
  uint32_t header_crc, payload_crc; /* as stored and verified; 0 in version 1 */
  int vocab;
  int id_width;
  uint32_t spm_hash;
  long n_pairs;
  const uint64_t *src_off, *tgt_off; /* n_pairs + 1 each */
  const void *src_ids, *tgt_ids;
};

static uint32_t get_u32(const unsigned char *p) {
  uint32_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

static uint64_t get_u64(const unsigned char *p) {
  uint64_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

static void put_u32(unsigned char *p, uint32_t v) { memcpy(p, &v, sizeof v); }
static void put_u64(unsigned char *p, uint64_t v) { memcpy(p, &v, sizeof v); }

static uint64_t align8(uint64_t x) { return (x + 7) & ~(uint64_t)7; }

/* zlib's CRC-32 of n bytes continuing crc (start: 0), in pieces zlib's uInt length can hold. */
static uint32_t crc_more(uint32_t crc, const unsigned char *p, uint64_t n) {
  uLong c = crc;
  while (n > 0) {
    uInt k = n > (1u << 30) ? (1u << 30) : (uInt)n;
    c = crc32(c, p, k);
    p += k, n -= k;
  }
  return (uint32_t)c;
}

static int width_for_vocab(int vocab) { return vocab <= 65536 ? 2 : 4; }

static uint32_t id_at(const void *ids, int width, uint64_t k) {
  return width == 2 ? ((const uint16_t *)ids)[k] : ((const uint32_t *)ids)[k];
}

/* The pair whose id range [off[i], off[i+1]) holds id number k (offsets already validated). */
static long pair_of(const uint64_t *off, long n, uint64_t k) {
  long lo = 0, hi = n - 1;
  while (lo < hi) {
    long mid = lo + (hi - lo + 1) / 2;
    if (off[mid] <= k) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/* Checks one offset array: offsets[0] == 0, monotone, and the ids it spans fit in `room` ids. */
static nmt_status check_offsets(const char *path, const char *side, const uint64_t *off, long n,
                                uint64_t room) {
  if (off[0] != 0)
    return nmt_errorf(NMT_ERR_DATA, "%s: %s offsets[0] = %llu, must be 0", path, side,
                      (unsigned long long)off[0]);
  for (long i = 0; i < n; i++)
    if (off[i + 1] < off[i])
      return nmt_errorf(NMT_ERR_DATA, "%s: %s offsets not monotone at pair %ld (%llu < %llu)",
                        path, side, i, (unsigned long long)off[i + 1], (unsigned long long)off[i]);
  if (off[n] > room)
    return nmt_errorf(NMT_ERR_DATA,
                      "%s: %s offset out of range: %llu ids, but the section holds %llu", path,
                      side, (unsigned long long)off[n], (unsigned long long)room);
  return NMT_OK;
}

static nmt_status check_ids(const char *path, const char *side, const void *ids, int width,
                            const uint64_t *off, long n, int vocab) {
  uint64_t count = off[n];
  for (uint64_t k = 0; k < count; k++) {
    uint32_t id = id_at(ids, width, k);
    if (id >= (uint32_t)vocab)
      return nmt_errorf(NMT_ERR_DATA, "%s: id %u >= vocab %d at pair %ld (%s)", path, id, vocab,
                        pair_of(off, n, k), side);
  }
  return NMT_OK;
}

/* The header's first `size` bytes (of a file at least that long): magic, version and, in
 * version 2, the header's CRC-32. Sets *version and *header_bytes (where the header ends). */
static nmt_status check_head(const char *path, const unsigned char *p, uint64_t size,
                             uint32_t *version, uint64_t *header_bytes) {
  if (size < 8)
    return nmt_errorf(NMT_ERR_DATA, "%s: truncated: %llu bytes, the header needs %d", path,
                      (unsigned long long)size, HEADER_BYTES);
  if (memcmp(p + H_MAGIC, NMT_SHARD_MAGIC, 8) != 0)
    return nmt_errorf(NMT_ERR_DATA, "%s: bad magic (not an nmt shard; expected \"%s\")", path,
                      NMT_SHARD_MAGIC);
  if (size < HEADER_BYTES_V1)
    return nmt_errorf(NMT_ERR_DATA, "%s: truncated: %llu bytes, the header needs %d", path,
                      (unsigned long long)size, HEADER_BYTES);
  *version = get_u32(p + H_VERSION);
  if (*version != 1 && *version != NMT_SHARD_VERSION)
    return nmt_errorf(NMT_ERR_DATA, "%s: unsupported version %u (this build reads 1 and %u)",
                      path, *version, NMT_SHARD_VERSION);
  *header_bytes = *version == 1 ? HEADER_BYTES_V1 : HEADER_BYTES;
  if (size < *header_bytes)
    return nmt_errorf(NMT_ERR_DATA, "%s: truncated: %llu bytes, the header needs %llu", path,
                      (unsigned long long)size, (unsigned long long)*header_bytes);
  if (*version == 1) return NMT_OK;
  uint32_t stored = get_u32(p + H_HEADER_CRC), computed = crc_more(0, p, H_HEADER_CRC);
  if (stored != computed)
    return nmt_errorf(NMT_ERR_DATA, "%s: header checksum mismatch (stored %08x, computed %08x): "
                      REBUILD_HINT, path, stored, computed);
  return NMT_OK;
}

/* Validates the mapped bytes of `path` and fills the views of *s. */
static nmt_status validate(const char *path, const unsigned char *p, uint64_t size,
                           int expected_vocab, nmt_shard *s) {
  uint32_t version;
  uint64_t hdr;
  NMT_TRY(check_head(path, p, size, &version, &hdr));
  uint32_t width = get_u32(p + H_ID_WIDTH);
  if (width != 2 && width != 4)
    return nmt_errorf(NMT_ERR_DATA, "%s: bad id width %u (must be 2 or 4)", path, width);
  uint32_t vocab = get_u32(p + H_VOCAB);
  if (vocab < 1 || vocab > INT_MAX || (width == 2 && vocab > 65536))
    return nmt_errorf(NMT_ERR_DATA, "%s: bad vocab %u for id width %u", path, vocab, width);
  /* Batches add BOS and EOS (ids 2, 3), which must be valid rows of the embedding (found by
   * test/fuzz/fuzz_shard.c). */
  if (vocab <= NMT_EOS_ID)
    return nmt_errorf(NMT_ERR_DATA, "%s: bad vocab %u: ids 0-%d are reserved (pad, unk, bos, eos)",
                      path, vocab, NMT_EOS_ID);
  if (expected_vocab > 0 && vocab != (uint32_t)expected_vocab)
    return nmt_errorf(NMT_ERR_DATA, "%s: vocab mismatch: shard has %u, expected %d", path, vocab,
                      expected_vocab);
  uint64_t file_bytes = get_u64(p + H_FILE_BYTES);
  if (size < file_bytes)
    return nmt_errorf(NMT_ERR_DATA, "%s: truncated: %llu bytes, the header says %llu", path,
                      (unsigned long long)size, (unsigned long long)file_bytes);
  if (size > file_bytes)
    return nmt_errorf(NMT_ERR_DATA, "%s: %llu trailing bytes after the %llu the header says",
                      path, (unsigned long long)(size - file_bytes),
                      (unsigned long long)file_bytes);
  uint64_t n = get_u64(p + H_N_PAIRS);
  /* Every pair costs two 8-byte offsets, which bounds n before any multiplication. */
  if (n > (size - hdr) / 16 || n >= (uint64_t)LONG_MAX)
    return nmt_errorf(NMT_ERR_DATA, "%s: offset out of range: %llu pairs cannot fit in %llu bytes",
                      path, (unsigned long long)n, (unsigned long long)size);
  uint64_t off_bytes = 8 * (n + 1);
  uint64_t tgt_off = get_u64(p + H_TGT_OFFSETS), src_ids = get_u64(p + H_SRC_IDS),
           tgt_ids = get_u64(p + H_TGT_IDS);
  /* Sections in file order, each inside the file and after the previous one. */
  struct {
    const char *name;
    uint64_t at, min, align;
  } sec[] = {{"target offsets", tgt_off, hdr + off_bytes, 8},
             {"source ids", src_ids, tgt_off + off_bytes, width},
             {"target ids", tgt_ids, src_ids, width}};
  for (int i = 0; i < 3; i++) {
    if (sec[i].at < sec[i].min || sec[i].at > size || sec[i].at % sec[i].align)
      return nmt_errorf(NMT_ERR_DATA,
                        "%s: offset out of range: %s section at byte %llu (must be >= %llu, "
                        "<= %llu, a multiple of %llu)",
                        path, sec[i].name, (unsigned long long)sec[i].at,
                        (unsigned long long)sec[i].min, (unsigned long long)size,
                        (unsigned long long)sec[i].align);
    if (i == 0 && sec[0].at + off_bytes > size)
      return nmt_errorf(NMT_ERR_DATA, "%s: offset out of range: target offsets run past the end",
                        path);
  }
  /* The sections lie inside the file the header describes: check its bytes before reading
   * them as offsets and ids, so damage is reported as damage. */
  if (version >= 2) {
    uint32_t stored = get_u32(p + H_PAYLOAD_CRC), computed = crc_more(0, p + hdr, size - hdr);
    if (stored != computed)
      return nmt_errorf(NMT_ERR_DATA, "%s: payload checksum mismatch (stored %08x, computed "
                        "%08x): " REBUILD_HINT, path, stored, computed);
    s->payload_crc = stored;
    s->header_crc = get_u32(p + H_HEADER_CRC);
  }
  s->version = (int)version;
  s->vocab = (int)vocab;
  s->id_width = (int)width;
  s->spm_hash = get_u32(p + H_SPM_HASH);
  s->n_pairs = (long)n;
  s->src_off = (const uint64_t *)(p + hdr);
  s->tgt_off = (const uint64_t *)(p + tgt_off);
  s->src_ids = p + src_ids;
  s->tgt_ids = p + tgt_ids;
  NMT_TRY(check_offsets(path, "src", s->src_off, s->n_pairs, (tgt_ids - src_ids) / width));
  NMT_TRY(check_offsets(path, "tgt", s->tgt_off, s->n_pairs, (size - tgt_ids) / width));
  if (tgt_ids + s->tgt_off[n] * width != size)
    return nmt_errorf(NMT_ERR_DATA, "%s: %llu bytes after the last target id", path,
                      (unsigned long long)(size - tgt_ids - s->tgt_off[n] * width));
  NMT_TRY(check_ids(path, "src", s->src_ids, s->id_width, s->src_off, s->n_pairs, s->vocab));
  NMT_TRY(check_ids(path, "tgt", s->tgt_ids, s->id_width, s->tgt_off, s->n_pairs, s->vocab));
  return NMT_OK;
}

nmt_status nmt_shard_open(const char *path, int expected_vocab, nmt_shard **out) {
  *out = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return nmt_errorf(NMT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    return nmt_errorf(NMT_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return nmt_errorf(NMT_ERR_DATA, "%s: not a regular file", path);
  }
  nmt_shard *s = calloc(1, sizeof *s);
  if (!s) {
    close(fd);
    return nmt_errorf(NMT_ERR_NOMEM, "%s: shard handle", path);
  }
  uint64_t size = (uint64_t)st.st_size;
  nmt_status rc = NMT_OK;
  if (size == 0) {
    close(fd);
    free(s);
    return nmt_errorf(NMT_ERR_DATA, "%s: truncated: empty file", path);
  }
  s->map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (s->map == MAP_FAILED) {
    int e = errno;
    free(s);
    return nmt_errorf(NMT_ERR_IO, "%s: cannot mmap %llu bytes: %s", path,
                      (unsigned long long)size, strerror(e));
  }
  s->map_bytes = (size_t)size;
  rc = validate(path, s->map, size, expected_vocab, s);
  if (rc != NMT_OK) {
    nmt_shard_close(s);
    return rc;
  }
  if (s->version == 1)
    nmt_log(NMT_LOG_WARN, "%s: a version 1 shard has no checksum, so damage to it cannot be "
            "detected; to have it checked, remove it and rerun tools/prepare-data.sh "
            "(tools/prepare-bible.sh for data/bible), or write it again with `nmt shard`", path);
  *out = s;
  return NMT_OK;
}

void nmt_shard_close(nmt_shard *s) {
  if (!s) return;
  if (s->map) munmap(s->map, s->map_bytes);
  free(s);
}

long nmt_shard_num_pairs(const nmt_shard *s) { return s->n_pairs; }
uint32_t nmt_shard_spm_hash(const nmt_shard *s) { return s->spm_hash; }
int nmt_shard_version(const nmt_shard *s) { return s->version; }

int nmt_shard_crc32(const nmt_shard *s, uint32_t *header_crc, uint32_t *payload_crc) {
  *header_crc = s->header_crc;
  *payload_crc = s->payload_crc;
  return s->version >= 2;
}

nmt_status nmt_shard_read_spm_hash(const char *path, uint32_t *hash) {
  *hash = 0;
  unsigned char h[HEADER_BYTES];
  FILE *f = fopen(path, "rb");
  if (!f) return nmt_errorf(NMT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
  size_t got = fread(h, 1, sizeof h, f);
  int err = ferror(f) ? errno : 0;
  fclose(f);
  if (err) return nmt_errorf(NMT_ERR_IO, "%s: read error: %s", path, strerror(err));
  uint32_t version;
  uint64_t hdr;
  NMT_TRY(check_head(path, h, got, &version, &hdr));
  *hash = get_u32(h + H_SPM_HASH);
  return NMT_OK;
}
int nmt_shard_vocab(const nmt_shard *s) { return s->vocab; }
int nmt_shard_src_len(const nmt_shard *s, long i) {
  return (int)(s->src_off[i + 1] - s->src_off[i]);
}

int nmt_shard_tgt_len(const nmt_shard *s, long i) {
  return (int)(s->tgt_off[i + 1] - s->tgt_off[i]);
}

static void copy_ids(const void *ids, int width, uint64_t from, uint64_t to, int32_t *dst) {
  if (width == 2) {
    const uint16_t *p = (const uint16_t *)ids;
    for (uint64_t k = from; k < to; k++) *dst++ = p[k];
  } else {
    const uint32_t *p = (const uint32_t *)ids;
    for (uint64_t k = from; k < to; k++) *dst++ = (int32_t)p[k];
  }
}

void nmt_shard_copy_src(const nmt_shard *s, long i, int32_t *dst) {
  copy_ids(s->src_ids, s->id_width, s->src_off[i], s->src_off[i + 1], dst);
}

void nmt_shard_copy_tgt(const nmt_shard *s, long i, int32_t *dst) {
  copy_ids(s->tgt_ids, s->id_width, s->tgt_off[i], s->tgt_off[i + 1], dst);
}

/* ------------------------------------------------------------------------------------------ */
/* writing                                                                                    */

/* A shard being written: a temp file next to the target, renamed over it on commit, so a
 * reader never sees a half-written shard and a crash leaves the old one in place. */
typedef struct {
  FILE *f;
  char tmp[PATH_MAX];
  const char *path;
} writer;

static nmt_status writer_open(writer *w, const char *path) {
  w->path = path;
  w->f = NULL;
  if (snprintf(w->tmp, sizeof w->tmp, "%s.tmp.XXXXXX", path) >= (int)sizeof w->tmp)
    return nmt_errorf(NMT_ERR_IO, "%s: path too long", path);
  int fd = mkstemp(w->tmp);
  if (fd < 0)
    return nmt_errorf(NMT_ERR_IO, "%s: cannot create temp file: %s", w->tmp, strerror(errno));
  /* mkstemp makes the file 0600; a shard is data anyone who may read the directory may read. */
  (void)fchmod(fd, 0644);
  w->f = fdopen(fd, "wb");
  if (!w->f) {
    int e = errno;
    close(fd);
    unlink(w->tmp);
    return nmt_errorf(NMT_ERR_IO, "%s: fdopen: %s", w->tmp, strerror(e));
  }
  return NMT_OK;
}

static void writer_abort(writer *w) {
  if (w->f) fclose(w->f);
  w->f = NULL;
  unlink(w->tmp);
}

static nmt_status writer_put(writer *w, const void *p, size_t n) {
  if (n && fwrite(p, 1, n, w->f) != n)
    return nmt_errorf(NMT_ERR_IO, "%s: write failed: %s", w->tmp, strerror(errno));
  return NMT_OK;
}

static nmt_status writer_seek(writer *w, uint64_t at) {
  if (fseeko(w->f, (off_t)at, SEEK_SET) != 0)
    return nmt_errorf(NMT_ERR_IO, "%s: seek failed: %s", w->tmp, strerror(errno));
  return NMT_OK;
}

/* Completes header h (the one the file starts with) with the payload's CRC-32, read back from
 * the file (both writers write sections out of file order, so the bytes on disk are the one
 * place they come together), and the header's own, and writes it over the first bytes. */
static nmt_status writer_seal(writer *w, unsigned char h[HEADER_BYTES]) {
  if (fflush(w->f) != 0)
    return nmt_errorf(NMT_ERR_IO, "%s: write failed: %s", w->tmp, strerror(errno));
  enum { CHUNK = 1 << 20 };
  unsigned char *buf = malloc(CHUNK);
  if (!buf) return nmt_errorf(NMT_ERR_NOMEM, "%s: checksum buffer", w->tmp);
  int fd = fileno(w->f);
  uint32_t crc = 0;
  off_t at = HEADER_BYTES;
  ssize_t got;
  while ((got = pread(fd, buf, CHUNK, at)) != 0) {
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      int e = errno;
      free(buf);
      return nmt_errorf(NMT_ERR_IO, "%s: read back failed: %s", w->tmp, strerror(e));
    }
    crc = crc_more(crc, buf, (uint64_t)got);
    at += got;
  }
  free(buf);
  put_u32(h + H_PAYLOAD_CRC, crc);
  put_u32(h + H_HEADER_CRC, crc_more(0, h, H_HEADER_CRC));
  NMT_TRY(writer_seek(w, 0));
  return writer_put(w, h, HEADER_BYTES);
}

/* Seals the temp file with header h (writer_seal), makes it durable and renames it over the
 * target. */
static nmt_status writer_commit(writer *w, unsigned char h[HEADER_BYTES]) {
  nmt_status rc = writer_seal(w, h);
  if (rc != NMT_OK) {
    writer_abort(w);
    return rc;
  }
  if (fflush(w->f) != 0 || fsync(fileno(w->f)) != 0)
    rc = nmt_errorf(NMT_ERR_IO, "%s: flush failed: %s", w->tmp, strerror(errno));
  if (fclose(w->f) != 0 && rc == NMT_OK)
    rc = nmt_errorf(NMT_ERR_IO, "%s: close failed: %s", w->tmp, strerror(errno));
  w->f = NULL;
  if (rc == NMT_OK && rename(w->tmp, w->path) != 0)
    rc = nmt_errorf(NMT_ERR_IO, "%s: rename from %s failed: %s", w->path, w->tmp, strerror(errno));
  if (rc != NMT_OK) {
    unlink(w->tmp);
    return rc;
  }
  /* Persist the rename itself; a failure here loses durability, not consistency. */
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s", w->path);
  int dfd = open(dirname(dir), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return NMT_OK;
}

/* Byte positions of the sections for n pairs with the given id totals (docs/formats.md). */
typedef struct {
  uint64_t tgt_off, src_ids, tgt_ids, file_bytes;
} layout;

static layout layout_for(uint64_t n, uint64_t src_total, uint64_t tgt_total, int width) {
  layout l;
  l.tgt_off = HEADER_BYTES + 8 * (n + 1);
  l.src_ids = l.tgt_off + 8 * (n + 1);
  l.tgt_ids = align8(l.src_ids + src_total * width);
  l.file_bytes = l.tgt_ids + tgt_total * width;
  return l;
}

static void header_bytes(unsigned char h[HEADER_BYTES], int vocab, int width, uint32_t spm_hash,
                         uint64_t n, const layout *l) {
  memset(h, 0, HEADER_BYTES);
  memcpy(h + H_MAGIC, NMT_SHARD_MAGIC, 8);
  put_u32(h + H_VERSION, NMT_SHARD_VERSION);
  put_u32(h + H_ID_WIDTH, (uint32_t)width);
  put_u32(h + H_VOCAB, (uint32_t)vocab);
  put_u32(h + H_SPM_HASH, spm_hash);
  put_u64(h + H_N_PAIRS, n);
  put_u64(h + H_TGT_OFFSETS, l->tgt_off);
  put_u64(h + H_SRC_IDS, l->src_ids);
  put_u64(h + H_TGT_IDS, l->tgt_ids);
  put_u64(h + H_FILE_BYTES, l->file_bytes);
}

/* Appends ids converted to the shard's width, through a small buffer. */
static nmt_status put_ids(writer *w, const int32_t *ids, uint64_t count, int width) {
  unsigned char buf[8192];
  size_t used = 0;
  for (uint64_t k = 0; k < count; k++) {
    if (width == 2) {
      uint16_t v = (uint16_t)ids[k];
      memcpy(buf + used, &v, 2);
    } else {
      uint32_t v = (uint32_t)ids[k];
      memcpy(buf + used, &v, 4);
    }
    used += (size_t)width;
    if (used == sizeof buf) {
      NMT_TRY(writer_put(w, buf, used));
      used = 0;
    }
  }
  return writer_put(w, buf, used);
}

static nmt_status check_write_side(const char *path, const char *side, int vocab, long n,
                                   const uint64_t *off, const int32_t *ids) {
  if (off[0] != 0)
    return nmt_errorf(NMT_ERR_DATA, "%s: %s offsets[0] = %llu, must be 0", path, side,
                      (unsigned long long)off[0]);
  for (long i = 0; i < n; i++) {
    if (off[i + 1] < off[i])
      return nmt_errorf(NMT_ERR_DATA, "%s: %s offsets not monotone at pair %ld", path, side, i);
    for (uint64_t k = off[i]; k < off[i + 1]; k++)
      if (ids[k] < 0 || ids[k] >= vocab)
        return nmt_errorf(NMT_ERR_DATA, "%s: id %d >= vocab %d at pair %ld (%s)", path, ids[k],
                          vocab, i, side);
  }
  return NMT_OK;
}

nmt_status nmt_shard_write(const char *path, int vocab, long n_pairs, const uint64_t *src_offsets,
                           const int32_t *src_ids, const uint64_t *tgt_offsets,
                           const int32_t *tgt_ids) {
  if (vocab <= NMT_EOS_ID || n_pairs < 0)
    return nmt_errorf(NMT_ERR_DATA, "%s: bad shard arguments (vocab %d, %ld pairs)", path, vocab,
                      n_pairs);
  NMT_TRY(check_write_side(path, "src", vocab, n_pairs, src_offsets, src_ids));
  NMT_TRY(check_write_side(path, "tgt", vocab, n_pairs, tgt_offsets, tgt_ids));
  int width = width_for_vocab(vocab);
  uint64_t n = (uint64_t)n_pairs;
  layout l = layout_for(n, src_offsets[n], tgt_offsets[n], width);
  unsigned char h[HEADER_BYTES];
  header_bytes(h, vocab, width, 0, n, &l);
  static const unsigned char zeros[8] = {0};
  writer w;
  NMT_TRY(writer_open(&w, path));
  nmt_status rc;
  NMT_TRY_GOTO(rc, writer_put(&w, h, sizeof h), fail);
  NMT_TRY_GOTO(rc, writer_put(&w, src_offsets, 8 * (n + 1)), fail);
  NMT_TRY_GOTO(rc, writer_put(&w, tgt_offsets, 8 * (n + 1)), fail);
  NMT_TRY_GOTO(rc, put_ids(&w, src_ids, src_offsets[n], width), fail);
  NMT_TRY_GOTO(rc, writer_put(&w, zeros, l.tgt_ids - (l.src_ids + src_offsets[n] * width)), fail);
  NMT_TRY_GOTO(rc, put_ids(&w, tgt_ids, tgt_offsets[n], width), fail);
  return writer_commit(&w, h);
fail:
  writer_abort(&w);
  return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* from text (spm_encode --output_format=id)                                                  */

/* Parses one line of space-separated ids. With `emit` NULL it only validates and counts;
 * otherwise it appends the ids, converted to `width`, to the writer. */
typedef struct {
  const char *path;
  int vocab;
  int width;
  writer *emit;
  int32_t buf[4096];
  size_t used;
} id_sink;

static nmt_status sink_flush(id_sink *k) {
  if (k->emit && k->used) NMT_TRY(put_ids(k->emit, k->buf, k->used, k->width));
  k->used = 0;
  return NMT_OK;
}

static nmt_status parse_line(id_sink *k, char *line, long lineno, uint64_t *count) {
  char *p = line;
  uint64_t c = 0;
  for (;;) {
    while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') p++;
    if (!*p) break;
    char *end;
    errno = 0;
    long v = (*p >= '0' && *p <= '9') ? strtol(p, &end, 10) : (end = p, 0);
    if (end == p || errno == ERANGE || (*end && *end != ' ' && *end != '\t' && *end != '\r' &&
                                        *end != '\n')) {
      int len = 0;
      while (p[len] && p[len] != ' ' && p[len] != '\t' && p[len] != '\r' && p[len] != '\n' &&
             len < 40)
        len++;
      return nmt_errorf(NMT_ERR_DATA, "%s:%ld: bad id \"%.*s\" (expected a non-negative integer)",
                        k->path, lineno, len, p);
    }
    if (v >= k->vocab)
      return nmt_errorf(NMT_ERR_DATA, "%s:%ld: id %ld >= vocab %d", k->path, lineno, v, k->vocab);
    if (k->emit) {
      k->buf[k->used++] = (int32_t)v;
      if (k->used == sizeof k->buf / sizeof k->buf[0]) NMT_TRY(sink_flush(k));
    }
    c++;
    p = end;
  }
  *count = c;
  return NMT_OK;
}

/* Reads `path` once. Pass 1 (offsets NULL): counts lines and ids and checks every id. Pass 2:
 * writes the ids through the sink and fills offsets (lines + 1 entries). */
static nmt_status scan_ids(id_sink *k, long *lines, uint64_t *total, uint64_t *offsets,
                           long expect_lines) {
  FILE *f = fopen(k->path, "r");
  if (!f) return nmt_errorf(NMT_ERR_IO, "%s: cannot open: %s", k->path, strerror(errno));
  char *line = NULL;
  size_t cap = 0;
  long n = 0;
  uint64_t sum = 0;
  nmt_status rc = NMT_OK;
  if (offsets) offsets[0] = 0;
  while (getline(&line, &cap, f) >= 0) {
    uint64_t c = 0;
    if (offsets && n >= expect_lines) {
      rc = nmt_errorf(NMT_ERR_DATA, "%s: changed while being read (more than %ld lines)",
                      k->path, expect_lines);
      break;
    }
    if ((rc = parse_line(k, line, n + 1, &c)) != NMT_OK) break;
    sum += c;
    n++;
    if (offsets) offsets[n] = sum;
  }
  if (rc == NMT_OK && ferror(f))
    rc = nmt_errorf(NMT_ERR_IO, "%s: read error: %s", k->path, strerror(errno));
  if (rc == NMT_OK && offsets && n != expect_lines)
    rc = nmt_errorf(NMT_ERR_DATA, "%s: changed while being read (%ld lines, then %ld)", k->path,
                    expect_lines, n);
  if (rc == NMT_OK) rc = sink_flush(k);
  free(line);
  fclose(f);
  *lines = n;
  *total = sum;
  return rc;
}

nmt_status nmt_shard_write_from_text(const char *src_ids_path, const char *tgt_ids_path,
                                     int vocab, const char *out_path) {
  return nmt__shard_write_from_text(src_ids_path, tgt_ids_path, vocab, 0, out_path);
}

nmt_status nmt__shard_write_from_text(const char *src_ids_path, const char *tgt_ids_path,
                                      int vocab, uint32_t spm_hash, const char *out_path) {
  if (vocab < 1) return nmt_errorf(NMT_ERR_DATA, "%s: bad vocab %d", out_path, vocab);
  int width = width_for_vocab(vocab);
  /* Two passes over the text keep memory at the offsets (16 bytes a pair), not the ids: a
   * WMT-sized corpus has hundreds of millions of ids. */
  id_sink ks = {.path = src_ids_path, .vocab = vocab, .width = width};
  id_sink kt = {.path = tgt_ids_path, .vocab = vocab, .width = width};
  long ns, nt;
  uint64_t src_total, tgt_total;
  NMT_TRY(scan_ids(&ks, &ns, &src_total, NULL, 0));
  NMT_TRY(scan_ids(&kt, &nt, &tgt_total, NULL, 0));
  if (ns != nt)
    return nmt_errorf(NMT_ERR_DATA, "line counts differ: %s has %ld lines, %s has %ld",
                      src_ids_path, ns, tgt_ids_path, nt);
  uint64_t n = (uint64_t)ns;
  uint64_t *off = malloc(2 * 8 * (n + 1));
  if (!off) return nmt_errorf(NMT_ERR_NOMEM, "%s: offsets for %ld pairs", out_path, ns);
  uint64_t *src_off = off, *tgt_off = off + n + 1;
  layout l = layout_for(n, src_total, tgt_total, width);
  static const unsigned char zeros[8] = {0};
  unsigned char h[HEADER_BYTES];
  header_bytes(h, vocab, width, spm_hash, n, &l);
  writer w;
  nmt_status rc = writer_open(&w, out_path);
  if (rc != NMT_OK) {
    free(off);
    return rc;
  }
  long lines;
  uint64_t total;
  ks.emit = kt.emit = &w;
  NMT_TRY_GOTO(rc, writer_seek(&w, l.src_ids), fail);
  NMT_TRY_GOTO(rc, scan_ids(&ks, &lines, &total, src_off, ns), fail);
  NMT_TRY_GOTO(rc, writer_put(&w, zeros, l.tgt_ids - (l.src_ids + total * width)), fail);
  NMT_TRY_GOTO(rc, scan_ids(&kt, &lines, &total, tgt_off, ns), fail);
  if (src_off[n] != src_total || tgt_off[n] != tgt_total) {
    rc = nmt_errorf(NMT_ERR_DATA, "%s / %s: changed while being read", src_ids_path, tgt_ids_path);
    goto fail;
  }
  NMT_TRY_GOTO(rc, writer_seek(&w, 0), fail);
  NMT_TRY_GOTO(rc, writer_put(&w, h, sizeof h), fail);
  NMT_TRY_GOTO(rc, writer_put(&w, src_off, 8 * (n + 1)), fail);
  NMT_TRY_GOTO(rc, writer_put(&w, tgt_off, 8 * (n + 1)), fail);
  free(off);
  return writer_commit(&w, h);
fail:
  writer_abort(&w);
  free(off);
  return rc;
}
