/* preflight.c — what a training run will need after its first step, checked before it
 * (preflight.h). Each check costs a few system calls: a stat, a probe file, a statvfs. */
#include "preflight.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "nmt/eval.h"
#include "nmt/config.h"

nmt_status nmt__preflight_tmp(const char *who) {
  int from_env;
  const char *d = nmt_eval_tmp_dir(&from_env);
  char where[NMT_PATH_MAX + 64];
  const char *todo = from_env ? "create it, point TMPDIR at a writable directory, or unset "
                                "TMPDIR (then /tmp is used)"
                              : "make /tmp a writable directory, or point TMPDIR at one";
  if (from_env) snprintf(where, sizeof where, "TMPDIR = %s", d);
  else snprintf(where, sizeof where, "%s (TMPDIR is unset)", d);
  struct stat sb;
  if (stat(d, &sb) != 0)
    return nmt_errorf(NMT_ERR_IO, "%s writes each validation's hypotheses to a temporary file "
                      "in %s, which %s (%s): %s", who, where,
                      errno == ENOENT ? "does not exist" : "cannot be reached", strerror(errno),
                      todo);
  if (!S_ISDIR(sb.st_mode))
    return nmt_errorf(NMT_ERR_IO, "%s writes each validation's hypotheses to a temporary file "
                      "in %s, which is not a directory: %s", who, where, todo);
  char probe[NMT_PATH_MAX + 32];
  snprintf(probe, sizeof probe, "%s/nmt-preflight-XXXXXX", d);
  int fd = mkstemp(probe);
  if (fd < 0)
    return nmt_errorf(NMT_ERR_IO, "%s writes each validation's hypotheses to a temporary file "
                      "in %s, but nmt cannot create a file there (%s): %s", who, where,
                      strerror(errno), todo);
  close(fd);
  unlink(probe);
  return NMT_OK;
}

nmt_status nmt__preflight_space(const char *dir, uint64_t bytes, const char *what) {
  char at[NMT_PATH_MAX + 16];
  snprintf(at, sizeof at, "%s", dir && *dir ? dir : ".");
  struct statvfs sv;
  /* A directory not made yet lands on its nearest existing parent's file system. */
  while (statvfs(at, &sv) != 0) {
    char *slash = strrchr(at, '/');
    if (errno != ENOENT || !strcmp(at, ".") || !strcmp(at, "/"))
      return nmt_errorf(NMT_ERR_IO, "cannot read the free space of %s (statvfs %s: %s): check "
                        "run.out_dir", dir, at, strerror(errno));
    if (!slash) snprintf(at, sizeof at, ".");
    else if (slash == at) at[1] = 0;
    else *slash = 0;
  }
  /* f_bavail, what df calls available: root may also have the reserved blocks (f_bfree),
   * but on some file systems (overlays, quotas) f_bfree counts space no writer gets. */
  const uint64_t avail = (uint64_t)sv.f_bavail * (uint64_t)sv.f_frsize;
  if (avail >= bytes) return NMT_OK;
  return nmt_errorf(NMT_ERR_IO, "%s: its file system (at %s) has %.1f MiB free, but %s needs "
                    "%.1f MiB: free some space there, or choose a run.out_dir on another file "
                    "system", dir, at, (double)avail / (1 << 20), what,
                    (double)bytes / (1 << 20));
}

nmt_status nmt__preflight_checkpoint(const char *ckpt_dir, const nmt_ckpt_header *base) {
  nmt_ckpt_header h = *base;
  if (h.best_step <= 0) h.best_step = 1;
  char what[160];
  snprintf(what, sizeof what, "one checkpoint (%llu parameters%s, 4 bytes each, and the "
           "metadata)", (unsigned long long)h.n_params,
           h.has_moments ? " and Adam's two moments" : "");
  return nmt__preflight_space(ckpt_dir, nmt_ckpt_file_bytes(&h), what);
}
