/* data/shard_raw.c — a shard straight from raw parallel text: SentencePiece in process, the
 * corpus cleaning of Moses' clean-corpus-n.perl (empty sides, length ratio), and the model's
 * hash in the header. tools/prepare-data.sh calls it through `nmt shard --spm`. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nmt/data.h"
#include "nmt/spm.h"
#include "shard_impl.h"

/* A temporary file of id lines next to the shard: the same disk, so a full one fails here with
 * the writer's own I/O error. */
typedef struct {
  char path[PATH_MAX];
  FILE *f;
  int made; /* the file exists: unlink it when done */
} id_file;

static nmt_status id_file_open(id_file *t, const char *out_path, const char *side) {
  t->f = NULL;
  if (snprintf(t->path, sizeof t->path, "%s.%s-ids.XXXXXX", out_path, side) >=
      (int)sizeof t->path)
    return nmt_errorf(NMT_ERR_IO, "%s: path too long", out_path);
  int fd = mkstemp(t->path);
  if (fd < 0)
    return nmt_errorf(NMT_ERR_IO, "%s: cannot create temp file: %s", t->path, strerror(errno));
  t->made = 1;
  t->f = fdopen(fd, "w");
  if (!t->f) {
    int e = errno;
    close(fd);
    return nmt_errorf(NMT_ERR_IO, "%s: fdopen: %s", t->path, strerror(e));
  }
  return NMT_OK;
}

static nmt_status id_file_put(id_file *t, const int32_t *ids, int n) {
  for (int i = 0; i < n; i++)
    if (fprintf(t->f, i ? " %d" : "%d", (int)ids[i]) < 0) goto fail;
  if (fputc('\n', t->f) == EOF) goto fail;
  return NMT_OK;
fail:
  return nmt_errorf(NMT_ERR_IO, "%s: write failed: %s", t->path, strerror(errno));
}

static nmt_status id_file_close(id_file *t) {
  if (!t->f) return NMT_OK;
  int bad = fflush(t->f) != 0 || ferror(t->f);
  int e = errno;
  bad |= fclose(t->f) != 0;
  if (!bad) e = 0;
  else if (!e) e = errno;
  t->f = NULL;
  if (bad) return nmt_errorf(NMT_ERR_IO, "%s: write failed: %s", t->path, strerror(e));
  return NMT_OK;
}

/* One side's ids of the current line, grown as needed. */
typedef struct {
  int32_t *ids;
  int cap, n;
} id_buf;

static nmt_status encode_line(const nmt_spm *sp, char *line, ssize_t len, id_buf *b) {
  while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) len--;
  for (;;) {
    NMT_TRY(nmt_spm_encode(sp, line, (size_t)len, b->ids, b->cap, &b->n));
    if (b->n <= b->cap) return NMT_OK;
    int32_t *grown = realloc(b->ids, (size_t)b->n * sizeof *grown);
    if (!grown) return nmt_errorf(NMT_ERR_NOMEM, "%d ids of one line", b->n);
    b->ids = grown, b->cap = b->n;
  }
}

/* Moses' clean-corpus-n.perl rule, on pieces: 0 = keep, 1 = an empty side, 2 = ratio. */
static int verdict(const nmt_shard_clean *c, int ns, int nt) {
  if (ns == 0 || nt == 0) return c && c->drop_empty ? 1 : 0;
  if (c && c->max_ratio > 0 && (ns > c->max_ratio * nt || nt > c->max_ratio * ns)) return 2;
  return 0;
}

typedef struct {
  const char *path[2];
  FILE *in[2];
  id_file tmp[2];
  id_buf buf[2];
  char *line[2];
  size_t cap[2];
} raw_job;

/* Reads both sides in step, encodes each pair and writes the kept ones' ids. */
static nmt_status encode_pairs(raw_job *j, const nmt_spm *sp, const nmt_shard_clean *clean,
                               nmt_shard_clean_report *r) {
  for (;;) {
    ssize_t len[2];
    for (int s = 0; s < 2; s++) len[s] = getline(&j->line[s], &j->cap[s], j->in[s]);
    for (int s = 0; s < 2; s++)
      if (ferror(j->in[s]))
        return nmt_errorf(NMT_ERR_IO, "%s: read error: %s", j->path[s], strerror(errno));
    if (len[0] < 0 && len[1] < 0) return NMT_OK;
    if (len[0] < 0 || len[1] < 0)
      return nmt_errorf(NMT_ERR_DATA, "line counts differ: %s ends at line %ld, %s goes on",
                        j->path[len[0] < 0 ? 0 : 1], r->pairs, j->path[len[0] < 0 ? 1 : 0]);
    r->pairs++;
    for (int s = 0; s < 2; s++) NMT_TRY(encode_line(sp, j->line[s], len[s], &j->buf[s]));
    int v = verdict(clean, j->buf[0].n, j->buf[1].n);
    if (v == 1) r->dropped_empty++;
    if (v == 2) r->dropped_ratio++;
    if (v) continue;
    if (j->buf[0].n == 0 || j->buf[1].n == 0) r->empty_kept++;
    for (int s = 0; s < 2; s++) NMT_TRY(id_file_put(&j->tmp[s], j->buf[s].ids, j->buf[s].n));
    r->kept++;
  }
}

nmt_status nmt_shard_write_from_raw(const char *spm_path, const char *src_text_path,
                                    const char *tgt_text_path, const nmt_shard_clean *clean,
                                    const char *out_path, nmt_shard_clean_report *report) {
  nmt_shard_clean_report r = {0};
  if (report) *report = r;
  uint32_t hash;
  NMT_TRY(nmt_spm_file_hash(spm_path, &hash));
  nmt_spm *sp;
  NMT_TRY(nmt_spm_load(spm_path, &sp));
  raw_job j = {.path = {src_text_path, tgt_text_path}};
  nmt_status rc = NMT_OK;
  for (int s = 0; s < 2 && rc == NMT_OK; s++) {
    j.in[s] = fopen(j.path[s], "r");
    if (!j.in[s]) rc = nmt_errorf(NMT_ERR_IO, "%s: cannot open: %s", j.path[s], strerror(errno));
  }
  for (int s = 0; s < 2 && rc == NMT_OK; s++)
    rc = id_file_open(&j.tmp[s], out_path, s ? "tgt" : "src");
  if (rc == NMT_OK) rc = encode_pairs(&j, sp, clean, &r);
  for (int s = 0; s < 2; s++) {
    if (rc == NMT_OK) rc = id_file_close(&j.tmp[s]);
    else if (j.tmp[s].f) fclose(j.tmp[s].f); /* one error reported: the first */
  }
  if (rc == NMT_OK && r.kept == 0)
    rc = nmt_errorf(NMT_ERR_DATA, "%s / %s: no pair left of %ld (%ld with an empty side, %ld "
                    "with a length ratio above %g)", src_text_path, tgt_text_path, r.pairs,
                    r.dropped_empty, r.dropped_ratio, clean ? clean->max_ratio : 0.0);
  if (rc == NMT_OK)
    rc = nmt__shard_write_from_text(j.tmp[0].path, j.tmp[1].path, nmt_spm_vocab(sp), hash,
                                    out_path);
  for (int s = 0; s < 2; s++) {
    if (j.in[s]) fclose(j.in[s]);
    if (j.tmp[s].made) unlink(j.tmp[s].path);
    free(j.buf[s].ids);
    free(j.line[s]);
  }
  nmt_spm_free(sp);
  if (report) *report = r;
  return rc;
}
