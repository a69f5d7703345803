/* export_ct2.c — a checkpoint as a CTranslate2 model directory (include/nmt/export.h): the
 * safetensors export and the SentencePiece model in a temporary directory, tools/nmt_to_ct2.py
 * run on them, the result renamed into place. */
#include "nmt/export.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <libgen.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nmt/log.h"

extern char **environ;

/* CTranslate2's weight types (ctranslate2.converters.Converter.convert's quantization). */
static const char *const quantizations[] = {"int8",         "int8_float32", "int8_float16",
                                            "int8_bfloat16", "int16",        "float16",
                                            "bfloat16",      "float32",      NULL};

/* tools/nmt_to_ct2.py's exit status for a missing Python module (its MISSING_DEPENDENCY). */
enum { CONVERTER_MISSING_MODULE = 9 };

#define INSTALL_HINT "install it with tools/install-deps.sh --bleu, or pip install ctranslate2"

static int quantization_known(const char *q) {
  for (int i = 0; quantizations[i]; i++)
    if (!strcmp(q, quantizations[i])) return 1;
  return 0;
}

/* The converter script: $NMT_CT2_CONVERTER, else BIN/../tools/nmt_to_ct2.py beside the running
 * binary (build/nmt of a source tree), else tools/nmt_to_ct2.py of the working directory. */
static nmt_status find_converter(char *out, size_t cap) {
  const char *env = getenv("NMT_CT2_CONVERTER");
  if (env && *env) {
    snprintf(out, cap, "%s", env);
    if (access(out, R_OK) == 0) return NMT_OK;
    return nmt_errorf(NMT_ERR_MISSING_DEP, "export: the CTranslate2 converter %s "
                      "(NMT_CT2_CONVERTER) cannot be read: %s; it is tools/nmt_to_ct2.py of the "
                      "nmt source tree", out, strerror(errno));
  }
  char exe[NMT_PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    exe[n] = 0;
    /* BIN/../tools: dirname twice climbs from ROOT/build/nmt to ROOT */
    snprintf(out, cap, "%s/tools/nmt_to_ct2.py", dirname(dirname(exe)));
    if (access(out, R_OK) == 0) return NMT_OK;
  }
  snprintf(out, cap, "tools/nmt_to_ct2.py");
  if (access(out, R_OK) == 0) return NMT_OK;
  return nmt_errorf(NMT_ERR_MISSING_DEP, "export: the CTranslate2 converter tools/nmt_to_ct2.py "
                    "was found neither beside the nmt binary (BIN/../tools/) nor in the working "
                    "directory: run nmt from the source tree or set NMT_CT2_CONVERTER to it");
}

/* NMT_OK if out_dir may be written: it does not exist, or overwrite is set and it is a
 * directory holding a model.bin or nothing. *exists: whether it does. */
static nmt_status check_out_dir(const char *out_dir, int overwrite, int *exists) {
  struct stat st;
  *exists = lstat(out_dir, &st) == 0;
  if (!*exists) {
    if (errno == ENOENT) return NMT_OK;
    return nmt_errorf(NMT_ERR_IO, "export: cannot stat %s: %s", out_dir, strerror(errno));
  }
  if (!overwrite)
    return nmt_errorf(NMT_ERR_CONFIG, "export: %s exists; choose another OUT_DIR, or replace "
                      "it with --overwrite", out_dir);
  if (!S_ISDIR(st.st_mode))
    return nmt_errorf(NMT_ERR_CONFIG, "export: %s exists and is not a directory; --overwrite "
                      "replaces only a directory a previous export wrote", out_dir);
  char probe[NMT_PATH_MAX + 16];
  snprintf(probe, sizeof probe, "%s/model.bin", out_dir);
  if (access(probe, F_OK) == 0) return NMT_OK;
  /* An empty directory: the final rename(2) replaces it (nothing is removed before then). */
  DIR *dir = opendir(out_dir);
  int empty = dir != NULL;
  for (struct dirent *e; dir && (e = readdir(dir)) != NULL;)
    empty &= !strcmp(e->d_name, ".") || !strcmp(e->d_name, "..");
  if (dir) closedir(dir);
  if (empty) return *exists = 0, NMT_OK;
  return nmt_errorf(NMT_ERR_CONFIG, "export: %s holds no model.bin, so it is not a previous "
                    "CTranslate2 export; --overwrite replaces only those (or an empty "
                    "directory)", out_dir);
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb, (void)flag, (void)ftw;
  return remove(path);
}

static void rm_tree(const char *path) { nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

static nmt_status write_bytes(const char *path, const void *b, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return nmt_errorf(NMT_ERR_IO, "export: cannot write %s: %s", path, strerror(errno));
  int ok = fwrite(b, 1, n, f) == n;
  ok &= fclose(f) == 0;
  return ok ? NMT_OK : nmt_errorf(NMT_ERR_IO, "export: cannot write %s: %s", path, strerror(errno));
}

/* Writes ckpt_path's SentencePiece model (its metadata record) to path. */
static nmt_status write_spm(const char *ckpt_path, const char *path) {
  nmt_ckpt_header h;
  nmt_ckpt_meta meta = {0};
  NMT_TRY(nmt_ckpt_read_meta(ckpt_path, &h, &meta));
  nmt_status s = NMT_OK;
  if (!meta.spm_model || !meta.spm_model_bytes)
    s = nmt_errorf(NMT_ERR_CHECKPOINT, "export: %s embeds no SentencePiece model (a checkpoint "
                   "of format version 1, or a run without data.spm_model): the CTranslate2 "
                   "model needs its vocabulary", ckpt_path);
  else
    s = write_bytes(path, meta.spm_model, meta.spm_model_bytes);
  nmt_ckpt_meta_free(&meta);
  return s;
}

/* Runs argv (no shell) with stdout and stderr logged line by line at debug level; *code gets
 * its exit status (-1: killed) and last the last line it printed. */
static nmt_status run_logged(char *const argv[], int *code, char *last, size_t cap) {
  int fd[2];
  if (pipe2(fd, O_CLOEXEC) != 0) return nmt_errorf(NMT_ERR_IO, "pipe: %s", strerror(errno));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fd[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&fa, fd[1], STDERR_FILENO);
  pid_t pid;
  int e = posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(fd[1]);
  if (e != 0) {
    close(fd[0]);
    if (e == ENOENT || e == EACCES || e == ENOTDIR)
      return nmt_errorf(NMT_ERR_MISSING_DEP, "export: cannot run %s (NMT_PYTHON; default "
                        "python3): %s; the CTranslate2 export needs Python 3 with the "
                        "ctranslate2 module: " INSTALL_HINT, argv[0], strerror(e));
    return nmt_errorf(NMT_ERR_IO, "export: cannot run %s: %s", argv[0], strerror(e));
  }
  FILE *p = fdopen(fd[0], "r");
  char line[4096];
  last[0] = 0;
  while (p && fgets(line, sizeof line, p)) {
    line[strcspn(line, "\n")] = 0;
    nmt_log(NMT_LOG_DEBUG, "nmt_to_ct2: %s", line);
    if (line[0]) snprintf(last, cap, "%.*s", (int)(cap - 1), line);
  }
  if (p) fclose(p);
  else close(fd[0]);
  int st = 0;
  pid_t w;
  while ((w = waitpid(pid, &st, 0)) < 0 && errno == EINTR) continue;
  if (w < 0)
    return nmt_errorf(NMT_ERR_IO, "export: waiting for the CTranslate2 converter: %s",
                      strerror(errno));
  *code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return NMT_OK;
}

/* Runs the converter conv on tmp's model.safetensors and spm.model, writing tmp/model. */
static nmt_status convert(char *conv, const char *tmp, const char *quantization) {
  char st[NMT_PATH_MAX + 32], spm[NMT_PATH_MAX + 32], dir[NMT_PATH_MAX + 32];
  /* tmp is shorter than NMT_PATH_MAX (nmt_export_ct2 made it) */
  snprintf(st, sizeof st, "%s/model.safetensors", tmp);
  snprintf(spm, sizeof spm, "%s/spm.model", tmp);
  snprintf(dir, sizeof dir, "%s/model", tmp);
  const char *py = getenv("NMT_PYTHON");
  char *argv[8];
  int n = 0;
  argv[n++] = (char *)(py && *py ? py : "python3");
  argv[n++] = conv;
  if (quantization && *quantization) {
    argv[n++] = "--quantization";
    argv[n++] = (char *)quantization;
  }
  argv[n++] = st, argv[n++] = spm, argv[n++] = dir, argv[n] = NULL;
  int code = -1;
  char last[1024];
  NMT_TRY(run_logged(argv, &code, last, sizeof last));
  if (code == CONVERTER_MISSING_MODULE)
    return nmt_errorf(NMT_ERR_MISSING_DEP, "export: %s", last);
  if (code != 0)
    return nmt_errorf(NMT_ERR_IO, "export: %s %s failed (exit %d): %s", argv[0], conv, code,
                      last);
  return NMT_OK;
}

/* Puts tmp/model (and tmp/spm.model into it) at out_dir: a rename, or where out_dir exists an
 * exchange (renameat2), after which the old model is in tmp/model and goes with tmp. */
static nmt_status place(const char tmp[NMT_PATH_MAX], const char *out_dir, int exists) {
  char model[NMT_PATH_MAX + 16], from[NMT_PATH_MAX + 16], to[NMT_PATH_MAX + 32];
  snprintf(model, sizeof model, "%s/model", tmp);
  snprintf(from, sizeof from, "%s/spm.model", tmp);
  snprintf(to, sizeof to, "%s/spm.model", model);
  if (rename(from, to) != 0)
    return nmt_errorf(NMT_ERR_IO, "export: cannot rename %s to %s: %s", from, to,
                      strerror(errno));
  int rc = exists ? renameat2(AT_FDCWD, model, AT_FDCWD, out_dir, RENAME_EXCHANGE)
                  : rename(model, out_dir);
  if (rc != 0 && exists && (errno == EINVAL || errno == ENOSYS)) {
    /* A file system without RENAME_EXCHANGE (NFS, some FUSE): the old model moves into tmp,
     * then the new one to out_dir (a moment without out_dir), the old one back on failure. */
    char old[NMT_PATH_MAX + 16];
    snprintf(old, sizeof old, "%s/old", tmp);
    rc = rename(out_dir, old);
    if (rc == 0 && (rc = rename(model, out_dir)) != 0) {
      const int e = errno;
      (void)rename(old, out_dir);
      errno = e;
    }
  }
  if (rc != 0)
    return nmt_errorf(NMT_ERR_IO, "export: cannot rename %s to %s: %s", model, out_dir,
                      strerror(errno));
  return NMT_OK;
}

nmt_status nmt_export_ct2(const char *ckpt_path, const nmt_config *cfg, const char *quantization,
                          int overwrite, const char *out_dir) {
  if (quantization && *quantization && !quantization_known(quantization))
    return nmt_errorf(NMT_ERR_USAGE, "export: unknown --quantization %s (CTranslate2's: int8, "
                      "int8_float32, int8_float16, int8_bfloat16, int16, float16, bfloat16, "
                      "float32)", quantization);
  char conv[NMT_PATH_MAX];
  NMT_TRY(find_converter(conv, sizeof conv)); /* before any work: a missing one is exit 9 */
  int exists;
  NMT_TRY(check_out_dir(out_dir, overwrite, &exists));
  /* Beside out_dir, so that the final rename stays on its file system. */
  char tmp[NMT_PATH_MAX], path[NMT_PATH_MAX + 64];
  size_t len = strlen(out_dir);
  while (len > 1 && out_dir[len - 1] == '/') len--;
  if (snprintf(tmp, sizeof tmp, "%.*s.tmp-XXXXXX", (int)len, out_dir) >= (int)sizeof tmp)
    return nmt_errorf(NMT_ERR_USAGE, "export: OUT_DIR %s is too long (%d bytes at most)",
                      out_dir, NMT_PATH_MAX - 12);
  if (!mkdtemp(tmp))
    return nmt_errorf(NMT_ERR_IO, "export: cannot create a directory beside %s (%s): %s",
                      out_dir, tmp, strerror(errno));
  nmt_status s;
  snprintf(path, sizeof path, "%s/model.safetensors", tmp);
  NMT_TRY_GOTO(s, nmt_export_safetensors(ckpt_path, cfg, path), out);
  snprintf(path, sizeof path, "%s/spm.model", tmp);
  NMT_TRY_GOTO(s, write_spm(ckpt_path, path), out);
  NMT_TRY_GOTO(s, convert(conv, tmp, quantization), out);
  NMT_TRY_GOTO(s, place(tmp, out_dir, exists), out);
  nmt_log(NMT_LOG_INFO, "exported %s as a CTranslate2 model (%s) to %s", ckpt_path,
          quantization && *quantization ? quantization : "float32", out_dir);
out:
  rm_tree(tmp);
  return s;
}
