/* data/file_crc.c — a file's identity by its bytes: zlib's CRC-32 over the whole file
 * (nmt_file_crc32, include/nmt/data.h). Shards record their SentencePiece model by it, and
 * checkpoints their data.train shard. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "nmt/data.h"

nmt_status nmt_file_crc32(const char *path, uint32_t *crc, uint64_t *bytes) {
  *crc = 0;
  if (bytes) *bytes = 0;
  FILE *f = fopen(path, "rb");
  if (!f) return nmt_errorf(NMT_ERR_IO, "cannot read %s: %s", path, strerror(errno));
  enum { CHUNK = 1 << 20 };
  unsigned char *buf = malloc(CHUNK);
  if (!buf) {
    fclose(f);
    return nmt_errorf(NMT_ERR_NOMEM, "reading %s", path);
  }
  uLong c = crc32(0L, Z_NULL, 0);
  uint64_t n = 0;
  size_t got;
  while ((got = fread(buf, 1, CHUNK, f)) > 0) {
    c = crc32(c, buf, (uInt)got);
    n += got;
  }
  const int err = ferror(f) ? errno : 0;
  free(buf);
  fclose(f);
  if (err) return nmt_errorf(NMT_ERR_IO, "cannot read %s: %s", path, strerror(err));
  *crc = (uint32_t)c;
  if (bytes) *bytes = n;
  return NMT_OK;
}
