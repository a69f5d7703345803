/* ckpt_impl.h — what checkpoint.c (the file format: encoding, atomic writes, reading and
 * validation) and ckpt_dir.c (a checkpoint directory: step files, `latest`, `best`, pruning,
 * recovery) share. Internal to src/engine/.
 *
 * These report into a caller-supplied message buffer (ERR_CAP bytes) instead of nmt_errorf, so
 * that nmt_ckpt_find_latest can turn a damaged file into a warning and move on; the public
 * functions turn the message into nmt_errorf at the end.
 *
 * defines: ERR_CAP, PATH_CAP, OUT_CAP, nmt__ckpt_fail, nmt__ckpt_body_fn,
 *          nmt__ckpt_atomic_write, nmt__ckpt_write, nmt__ckpt_read, nmt__slurp,
 *          nmt__config_dump_text, nmt__ckpt_shape_value
 */
#ifndef NMT_ENGINE_CKPT_IMPL_H
#define NMT_ENGINE_CKPT_IMPL_H

#include <stdio.h>

#include "nmt/checkpoint.h"
#include "nmt/config.h"

#define ERR_CAP 1024  /* message buffers */
#define PATH_CAP 4096 /* paths built inside a checkpoint directory */
#define OUT_CAP 1024  /* path_out size promised by nmt/checkpoint.h */

/* Formats the message into err (ERR_CAP bytes) and returns s: `return nmt__ckpt_fail(err,
 * NMT_ERR_IO, "...: %s", path)`. */
nmt_status nmt__ckpt_fail(char *err, nmt_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Writes a file's body to f (the temp file `tmp`); a failure is reported into err. */
typedef nmt_status (*nmt__ckpt_body_fn)(FILE *f, const char *tmp, const void *ctx, char *err);

/* Writes path by writing `path.tmp.<pid>.<tid>` in the same directory (so rename stays within
 * one filesystem and is atomic), fflush + fsync, close, rename over path, fsync the directory.
 * A reader sees the old file or the complete new one, never a mix, and after return the new
 * one survives a power cut. On failure the temp file is removed. Errors: NMT_ERR_IO, the
 * body's. */
nmt_status nmt__ckpt_atomic_write(const char *path, nmt__ckpt_body_fn body, const void *ctx,
                                  char *err);

/* nmt_ckpt_write and nmt_ckpt_read, reporting into err. */
nmt_status nmt__ckpt_write(const char *path, const nmt_ckpt_header *h, const float *params,
                          const float *m, const float *v, char *err);
nmt_status nmt__ckpt_read(const char *path, const nmt_ckpt_header *expect, nmt_ckpt_header *h,
                         float *params, float *m, float *v, char *err);

/* The whole file at path in a malloc'd buffer of *n bytes, with a NUL after them (so a text
 * file reads as a string). Errors: NMT_ERR_IO (missing, not a regular file, short read),
 * NMT_ERR_NOMEM. (ckpt_config.c) */
nmt_status nmt__slurp(const char *path, void **out, size_t *n);

/* The effective config as `nmt config --dump` writes it (nmt_config_dump), malloc'd.
 * Errors: NMT_ERR_NOMEM, nmt_config_dump's. (ckpt_config.c) */
nmt_status nmt__config_dump_text(const nmt_config *cfg, char **out);

/* A model-shape field's value as a message shows it, into out (cap bytes): model.norm by the
 * name a config file gives it ("pre"; "7 (unknown)" for none), the others as numbers.
 * (checkpoint.c) */
void nmt__ckpt_shape_value(const char *name, long v, char *out, size_t cap);

#endif /* NMT_ENGINE_CKPT_IMPL_H */
