/* paths.c — an output path that is one of the command's inputs (include/nmt/paths.h). */
#include "nmt/paths.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int is_file_arg(const char *p) { return p && *p && strcmp(p, "-"); }

/* p with its directory resolved and its last component kept ("a/../b/f" -> "/abs/b/f"), so
 * that a path that does not exist yet compares; the text as given when the directory cannot
 * be resolved either. */
static void resolve(const char *p, char *out, size_t cap) {
  char dir[PATH_MAX], real[PATH_MAX];
  const char *slash = strrchr(p, '/');
  const char *base = slash ? slash + 1 : p;
  if (slash == p) snprintf(dir, sizeof dir, "/");
  else if (slash) snprintf(dir, sizeof dir, "%.*s", (int)(slash - p), p);
  else snprintf(dir, sizeof dir, ".");
  if (realpath(dir, real)) snprintf(out, cap, "%s/%s", strcmp(real, "/") ? real : "", base);
  else snprintf(out, cap, "%s", p);
}

int nmt_path_same(const char *a, const char *b) {
  if (!is_file_arg(a) || !is_file_arg(b)) return 0;
  struct stat sa, sb;
  int ea = stat(a, &sa) == 0, eb = stat(b, &sb) == 0;
  if (ea && eb)
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino && S_ISREG(sa.st_mode);
  if (ea != eb) return 0; /* one exists and the other does not: two files */
  char ra[PATH_MAX + 256], rb[PATH_MAX + 256];
  resolve(a, ra, sizeof ra);
  resolve(b, rb, sizeof rb);
  return !strcmp(ra, rb);
}

nmt_status nmt_path_check_outputs(const char *cmd, const nmt_path_arg *outs, int n_out,
                                  const nmt_path_arg *ins, int n_in) {
  for (int o = 0; o < n_out; o++) {
    for (int i = 0; i < n_in; i++)
      if (nmt_path_same(outs[o].path, ins[i].path))
        return nmt_errorf(NMT_ERR_USAGE, "%s: %s %s is the same file as %s %s; writing it would "
                          "destroy the input: choose another output", cmd, outs[o].arg,
                          outs[o].path, ins[i].arg, ins[i].path);
    for (int p = 0; p < o; p++)
      if (nmt_path_same(outs[o].path, outs[p].path))
        return nmt_errorf(NMT_ERR_USAGE, "%s: %s %s and %s %s are the same file: choose two "
                          "outputs", cmd, outs[p].arg, outs[p].path, outs[o].arg, outs[o].path);
  }
  return NMT_OK;
}
