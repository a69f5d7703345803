/* nmt/paths.h — whether a command's output file is one of its inputs.
 *
 * `nmt translate --input f --output f` would truncate f before reading it, and `nmt average X
 * --output X` would replace a resumable checkpoint by parameters only: a command that writes
 * files checks each output against each input first and refuses, naming both arguments
 * (NMT_ERR_USAGE, exit 2). Files are compared by identity (st_dev and st_ino), so a hard
 * link, a symlink or another spelling of the same path counts as the same file.
 *
 * defines: nmt_path_arg, nmt_path_same, nmt_path_check_outputs
 */
#ifndef NMT_PATHS_H
#define NMT_PATHS_H

#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One file a command line names: the argument that named it ("--input", "CKPT") and the path.
 * A NULL or empty path, or "-" (stdin/stdout), is no file and never matches. */
typedef struct {
  const char *arg;
  const char *path;
} nmt_path_arg;

/* 1 if a and b name the same file: when both exist, the same st_dev and st_ino and a regular
 * file (two names of one terminal or pipe, /dev/stdin and /dev/stdout, are not an input being
 * overwritten); when either does not exist, the same path once its directory is resolved
 * (realpath) and the last component compared. 0 otherwise, also for NULL, "" or "-". */
int nmt_path_same(const char *a, const char *b);

/* NMT_OK when no output in outs[0..n_out) is the same file (nmt_path_same) as an input in
 * ins[0..n_in) or as another output. Else NMT_ERR_USAGE with the message "CMD: OUTARG PATH
 * is the same file as INARG PATH; writing it would destroy the input: choose another output".
 * Checks names only: writes nothing, needs no file to exist. */
nmt_status nmt_path_check_outputs(const char *cmd, const nmt_path_arg *outs, int n_out,
                                  const nmt_path_arg *ins, int n_in);

#ifdef __cplusplus
}
#endif
#endif /* NMT_PATHS_H */
