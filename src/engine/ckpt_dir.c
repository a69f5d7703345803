/* ckpt_dir.c — a checkpoint directory (include/nmt/checkpoint.h, docs/formats.md "Checkpoint
 * directory"): step_N.ckpt files written atomically, `latest` pointed at the newest and `best`
 * at the best validation's once they are durable, rotation to checkpoint.keep files (never the
 * best), and recovery of the newest valid checkpoint when the one `latest` names is damaged.
 * The file format itself is checkpoint.c's.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_impl.h"
#include "nmt/checkpoint.h"
#include "nmt/log.h"

#define fail nmt__ckpt_fail
/* mkdir -p: creates each missing component; an existing directory is fine. */
static nmt_status mkdir_p(const char *dir, char *err) {
  char p[PATH_CAP];
  if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p)
    return fail(err, NMT_ERR_IO, "path too long: %s", dir);
  for (char *s = p + 1; *s; s++) {
    if (*s != '/') continue;
    *s = 0;
    if (mkdir(p, 0755) != 0 && errno != EEXIST)
      return fail(err, NMT_ERR_IO, "cannot create directory %s: %s", p, strerror(errno));
    *s = '/';
  }
  if (mkdir(p, 0755) != 0 && errno != EEXIST)
    return fail(err, NMT_ERR_IO, "cannot create directory %s: %s", p, strerror(errno));
  struct stat sb;
  if (stat(p, &sb) != 0 || !S_ISDIR(sb.st_mode))
    return fail(err, NMT_ERR_IO, "%s exists and is not a directory", p);
  return NMT_OK;
}

/* "step_<digits>.ckpt" exactly (no temp files, no other suffixes). */
static int parse_step_name(const char *name, long long *step) {
  if (strncmp(name, "step_", 5) != 0) return 0;
  const char *d = name + 5, *e = d;
  while (*e >= '0' && *e <= '9') e++;
  if (e == d || e - d > 18 || strcmp(e, ".ckpt") != 0) return 0;
  *step = strtoll(d, NULL, 10);
  return 1;
}

typedef struct {
  long long step;
  char name[256];
} step_file;

static int by_step_desc(const void *a, const void *b) {
  long long x = ((const step_file *)a)->step, y = ((const step_file *)b)->step;
  return (x < y) - (x > y);
}

/* The step_*.ckpt files in dir, newest (highest step) first. */
static nmt_status list_steps(const char *dir, step_file **out, size_t *n_out, char *err) {
  *out = NULL;
  *n_out = 0;
  DIR *d = opendir(dir);
  if (!d) return fail(err, NMT_ERR_IO, "cannot open directory %s: %s", dir, strerror(errno));
  step_file *v = NULL;
  size_t n = 0, cap = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    long long step;
    if (!parse_step_name(e->d_name, &step) || strlen(e->d_name) >= sizeof v->name) continue;
    if (n == cap) {
      size_t nc = cap ? 2 * cap : 16;
      step_file *nv = realloc(v, nc * sizeof *nv);
      if (!nv) {
        free(v);
        closedir(d);
        return fail(err, NMT_ERR_NOMEM, "no memory listing %s", dir);
      }
      v = nv;
      cap = nc;
    }
    v[n].step = step;
    snprintf(v[n].name, sizeof v[n].name, "%s", e->d_name);
    n++;
  }
  closedir(d);
  if (n) qsort(v, n, sizeof *v, by_step_desc);
  *out = v;
  *n_out = n;
  return NMT_OK;
}

/* The body of `latest` and `best`: one line, the file name. */
static nmt_status write_name_body(FILE *f, const char *tmp, const void *ctx, char *err) {
  if (fprintf(f, "%s\n", (const char *)ctx) < 0)
    return fail(err, NMT_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
  return NMT_OK;
}

/* The file name dir/<marker> (`latest` or `best`) holds, or "" (missing, unreadable, or not a
 * plain file name: the latter with a warning). */
static void read_marker(const char *dir, const char *marker, char *name, size_t cap) {
  char p[PATH_CAP];
  name[0] = 0;
  snprintf(p, sizeof p, "%s/%s", dir, marker);
  FILE *f = fopen(p, "rb");
  if (!f) return;
  size_t n = fread(name, 1, cap - 1, f);
  fclose(f);
  name[n] = 0;
  while (n && (name[n - 1] == '\n' || name[n - 1] == '\r' || name[n - 1] == ' ')) name[--n] = 0;
  /* A name only: a marker must not send the reader outside dir. */
  if (!n || strchr(name, '/') || !strcmp(name, ".") || !strcmp(name, "..") || strlen(name) != n) {
    nmt_log(NMT_LOG_WARN, "%s does not hold a checkpoint file name; ignoring it", p);
    name[0] = 0;
  }
}

/* Deletes the oldest step files beyond `keep`. Never the one just written (`current`): after
 * a resume from an older checkpoint, higher-numbered files of the abandoned run may still be
 * present, and `latest` names `current`. Never the one `best` names either: it counts among
 * the `keep` newest when it is one of them, and is kept beyond them when it is older. A
 * failure here only warns: the checkpoint itself is safely written. */
static void prune(const char *dir, int keep, const char *current) {
  char err[ERR_CAP];
  step_file *v;
  size_t n;
  if (list_steps(dir, &v, &n, err) != NMT_OK) {
    nmt_log(NMT_LOG_WARN, "checkpoint pruning skipped: %s", err);
    return;
  }
  char best[256];
  read_marker(dir, "best", best, sizeof best);
  size_t kept = 1; /* current */
  for (size_t i = 0; i < n; i++) {
    if (!strcmp(v[i].name, current)) continue;
    if (kept < (size_t)keep) {
      kept++;
      continue;
    }
    if (!strcmp(v[i].name, best)) continue;
    char p[PATH_CAP];
    snprintf(p, sizeof p, "%s/%s", dir, v[i].name);
    if (unlink(p) != 0 && errno != ENOENT)
      nmt_log(NMT_LOG_WARN, "cannot delete old checkpoint %s: %s", p, strerror(errno));
  }
  free(v);
}

nmt_status nmt_ckpt_save_step(const char *dir, const nmt_ckpt_header *h, const float *params,
                              const float *m, const float *v, int keep, char *path_out) {
  char err[ERR_CAP], name[64], path[OUT_CAP], latest[PATH_CAP], best[PATH_CAP];
  nmt_status st;
  if (h->step < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "checkpoint in %s: negative step %lld", dir,
                      (long long)h->step);
  snprintf(name, sizeof name, "step_%lld.ckpt", (long long)h->step);
  if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path ||
      snprintf(latest, sizeof latest, "%s/latest", dir) >= (int)sizeof latest ||
      snprintf(best, sizeof best, "%s/best", dir) >= (int)sizeof best)
    return nmt_errorf(NMT_ERR_IO, "checkpoint directory path too long: %s", dir);
  if ((st = mkdir_p(dir, err)) != NMT_OK) return nmt_errorf(st, "%s", err);
  if ((st = nmt__ckpt_write(path, h, params, m, v, err)) != NMT_OK)
    return nmt_errorf(st, "%s", err);
  /* Only now that the checkpoint is durable may `latest` (and `best`) point at it. */
  if ((st = nmt__ckpt_atomic_write(latest, write_name_body, name, err)) != NMT_OK)
    return nmt_errorf(st, "%s", err);
  if (h->best_step > 0 && h->best_step == h->step &&
      (st = nmt__ckpt_atomic_write(best, write_name_body, name, err)) != NMT_OK)
    return nmt_errorf(st, "%s", err);
  if (keep > 0) prune(dir, keep, name);
  if (path_out) snprintf(path_out, OUT_CAP, "%s", path);
  return NMT_OK;
}

nmt_status nmt_ckpt_find_latest(const char *dir, char *path_out) {
  char err[ERR_CAP], named[256], p[PATH_CAP];
  read_marker(dir, "latest", named, sizeof named);
  if (named[0]) {
    snprintf(p, sizeof p, "%s/%s", dir, named);
    if (nmt__ckpt_read(p, NULL, NULL, NULL, NULL, NULL, err) == NMT_OK) {
      if (snprintf(path_out, OUT_CAP, "%s", p) >= OUT_CAP)
        return nmt_errorf(NMT_ERR_IO, "checkpoint path too long: %s", p);
      return NMT_OK;
    }
    nmt_log(NMT_LOG_WARN, "%s/latest names %s, which is not usable (%s); looking for an older "
            "checkpoint", dir, named, err);
  }
  step_file *v;
  size_t n;
  nmt_status st = list_steps(dir, &v, &n, err);
  if (st == NMT_ERR_NOMEM) return nmt_errorf(st, "%s", err);
  if (st != NMT_OK)
    return nmt_errorf(NMT_ERR_CHECKPOINT, "no valid checkpoint in %s (%s)", dir, err);
  for (size_t i = 0; i < n; i++) {
    if (!strcmp(v[i].name, named)) continue; /* already tried and warned about */
    snprintf(p, sizeof p, "%s/%s", dir, v[i].name);
    if (nmt__ckpt_read(p, NULL, NULL, NULL, NULL, NULL, err) == NMT_OK) {
      free(v);
      if (snprintf(path_out, OUT_CAP, "%s", p) >= OUT_CAP)
        return nmt_errorf(NMT_ERR_IO, "checkpoint path too long: %s", p);
      return NMT_OK;
    }
    nmt_log(NMT_LOG_WARN, "skipping damaged checkpoint: %s", err);
  }
  free(v);
  return nmt_errorf(NMT_ERR_CHECKPOINT, "no valid checkpoint in %s", dir);
}

nmt_status nmt_ckpt_find_best(const char *dir, char *path_out) {
  char err[ERR_CAP], named[256], p[PATH_CAP];
  read_marker(dir, "best", named, sizeof named);
  if (!named[0])
    return nmt_errorf(NMT_ERR_CHECKPOINT, "%s has no best checkpoint (%s/best is missing: no "
                      "validation improved train.best_metric yet)", dir, dir);
  snprintf(p, sizeof p, "%s/%s", dir, named);
  if (nmt__ckpt_read(p, NULL, NULL, NULL, NULL, NULL, err) != NMT_OK)
    return nmt_errorf(NMT_ERR_CHECKPOINT, "%s/best names %s, which is not usable: %s", dir, named,
                      err);
  if (snprintf(path_out, OUT_CAP, "%s", p) >= OUT_CAP)
    return nmt_errorf(NMT_ERR_IO, "checkpoint path too long: %s", p);
  return NMT_OK;
}
