/* test_readme.c — every command of README.md runs as written (issue 19: several did not).
 *
 * The commands are the lines of README.md's ```sh blocks: continuation lines ("\" at the end)
 * are joined, comments (an unquoted "#" at the start or after a blank) dropped, and each
 * remaining line is one command; a block whose first line is "#!" (the Slurm script) is one
 * script. They run in README order, each with bash in one scratch directory that looks like
 * the repository root: conf/, tools/, include/ and build/ (the build under test) are links,
 * data/bible links the prepared corpus (so commands that need the corpus use data/bible) while
 * data/ itself is scratch, and runs/ and every output land in the scratch directory. Each
 * command must exit 0, and some outputs must exist (the table `outputs`).
 *
 * What is substituted, so that the whole README runs in a minute or two on 2 cores:
 *  - the commands that train or decode (build/nmt train, translate, eval, export, bench, and
 *    the embedding example) get TINY appended to their overrides: a 1+1-layer d_model 32
 *    model, 4 steps, a checkpoint every 2, short decodes. Overrides apply in order, so a
 *    README value of the same key (train.max_steps=2000) yields to it; the commands' own flags,
 *    configs, devices and precisions are kept;
 *  - `bench allreduce` also gets --max-bytes 64K --iters 2 --warmup 1;
 *  - tools/prepare-data.sh gets --vocab 400 instead of 32000 (the scratch raw/ corpus is the
 *    Bible's first 400 training verses, its valid and test books, as .en and .de), and so does
 *    tools/prepare-wmt14.sh (its downloads/ are those 400 verses cut into WMT14's three corpora
 *    in the archives' layout, 200 + 150 + 50, and the valid and test books as newstest2013
 *    and newstest2014);
 *  - `make run` and `make test` become dry runs (`make -n`): `make test` is this suite and
 *    `make run` the 20-minute main job whose steps the other commands cover; `make` runs with
 *    -C the repository and BUILD / CUDA / CUDA_ARCHS of the build under test;
 *  - `cc` gets $CFLAGS of the environment (empty, except in the sanitizer builds, whose
 *    library needs their flags to link);
 *  - srun and scontrol are stand-ins on PATH (srun runs its command; scontrol records its
 *    arguments), with SLURM_JOB_ID = 4242;
 *  - before the README's commands, the scratch directory gets what `make run` leaves: a
 *    finished run in runs/bible-small (the TINY model trained by conf/bible-small.ini). The
 *    README's commands must not change it: its checkpoints/best, checkpoints/latest, the
 *    checkpoint best names and metrics.jsonl are compared byte for byte after them (a user
 *    who runs the Use lines after `make run` keeps `make run`'s result);
 *  - no other input is made up: every file a command reads is one the README's earlier
 *    commands or `make run` made;
 *  - tools/plot is skipped (`true` in front) when /usr/bin/python3 has no matplotlib, and
 *    `nmt export --format ctranslate2` when python3 cannot import ctranslate2 (it would exit 9;
 *    test_export_ct2 checks that). README's Python serving example (a ```python block) is not
 *    run here; test_export_ct2 decodes such an export with the same calls.
 */
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nmt/data.h"
#include "test.h"

/* snprintf whose truncation is intended (and checked by the callers' sizes), without
 * -Wformat-truncation's guesses. */
static void fmt(char *dst, size_t cap, const char *f, ...) __attribute__((format(printf, 3, 4)));
static void fmt(char *dst, size_t cap, const char *f, ...) {
  va_list ap;
  va_start(ap, f);
  vsnprintf(dst, cap, f, ap);
  va_end(ap);
}

#define TINY                                                                                    \
  "model.d_model=32 model.n_heads=2 model.d_ff=64 model.enc_layers=1 model.dec_layers=1 "       \
  "data.max_len=32 data.max_tokens=256 train.accum_steps=1 train.max_steps=4 "                  \
  "train.warmup_steps=2 train.log_every=2 train.valid_every=4 train.save_every=2 "              \
  "decode.max_extra_len=4"

enum { MAX_CMDS = 128, CMD_MAX = 8192 };

typedef struct {
  char text[CMD_MAX]; /* as the README has it (joined, comments dropped) */
  int line;           /* README line it starts on */
  int script;         /* a whole "#!" block */
} readme_cmd;

static char *slurp(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *s = n >= 0 ? malloc((size_t)n + 1) : NULL;
  if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
    free(s);
    s = NULL;
  }
  if (s) s[n] = 0;
  fclose(f);
  return s;
}

/* Cuts a line at its first unquoted "#" that starts a word, and trims it. */
static void drop_comment(char *line) {
  char q = 0;
  for (char *p = line; *p; p++) {
    if (q) {
      if (*p == q) q = 0;
    } else if (*p == '\'' || *p == '"') {
      q = *p;
    } else if (*p == '#' && (p == line || p[-1] == ' ' || p[-1] == '\t')) {
      *p = 0;
      break;
    }
  }
  size_t n = strlen(line);
  while (n && (line[n - 1] == ' ' || line[n - 1] == '\t')) line[--n] = 0;
}

/* The commands of README's ```sh blocks, in order. Returns their number (-1: too many). */
static int extract(char *readme, readme_cmd *cmds, int cap, int *n_blocks) {
  int n = 0, lineno = 0, in_sh = 0, first = 0;
  readme_cmd *cur = NULL; /* a command continued by "\" or a script being collected */
  *n_blocks = 0;
  for (char *line = readme, *next; line && *line; line = next) {
    next = strchr(line, '\n');
    if (next) *next++ = 0;
    lineno++;
    if (!in_sh) {
      if (!strncmp(line, "```sh", 5)) in_sh = 1, first = 1, (*n_blocks)++;
      continue;
    }
    if (!strncmp(line, "```", 3)) {
      in_sh = 0, cur = NULL;
      continue;
    }
    if (first && !strncmp(line, "#!", 2)) {
      if (n == cap) return -1;
      cur = &cmds[n++];
      fmt(cur->text, CMD_MAX, "%s\n", line);
      cur->line = lineno, cur->script = 1;
      first = 0;
      continue;
    }
    first = 0;
    if (cur && cur->script) {
      size_t k = strlen(cur->text);
      fmt(cur->text + k, CMD_MAX - k, "%s\n", line);
      continue;
    }
    char buf[CMD_MAX];
    fmt(buf, sizeof buf, "%s", line);
    size_t len = strlen(buf);
    int cont = len && buf[len - 1] == '\\';
    if (cont) buf[--len] = 0;
    drop_comment(buf);
    const char *text = buf;
    while (*text == ' ') text++;
    if (!cur && !*text) continue;
    if (!cur) {
      if (n == cap) return -1;
      cur = &cmds[n++];
      cur->text[0] = 0;
      cur->line = lineno, cur->script = 0;
    }
    size_t k = strlen(cur->text);
    fmt(cur->text + k, CMD_MAX - k, "%s%s", k ? " " : "", text);
    if (!cont) cur = NULL;
  }
  return n;
}

/* Appends `extra` to each simple command that starts with `prefix`: before the first unquoted
 * ; | & < > or newline after it, or at the end. */
static void append_after(char *cmd, const char *prefix, const char *extra) {
  char *p = cmd;
  while ((p = strstr(p, prefix)) != NULL) {
    char *e = p + strlen(prefix), q = 0;
    for (; *e; e++) {
      if (q) {
        if (*e == q) q = 0;
      } else if (*e == '\'' || *e == '"') {
        q = *e;
      } else if (strchr(";|&<>\n", *e)) {
        break;
      }
    }
    while (e > p && e[-1] == ' ') e--;
    char tail[CMD_MAX];
    fmt(tail, sizeof tail, "%s", e);
    size_t at = (size_t)(e - cmd);
    fmt(cmd + at, CMD_MAX - at, " %s%s%s", extra, *tail && *tail != '\n' ? " " : "", tail);
    p = cmd + at + strlen(extra) + 1;
  }
}

/* Replaces every `from` with `to` (at most CMD_MAX bytes in all). */
static void replace_all(char *cmd, const char *from, const char *to) {
  char out[CMD_MAX];
  size_t k = 0;
  for (const char *p = cmd; *p && k + 1 < sizeof out;) {
    if (!strncmp(p, from, strlen(from))) {
      fmt(out + k, sizeof out - k, "%s", to);
      k += strlen(out + k);
      p += strlen(from);
    } else {
      out[k++] = *p++;
    }
  }
  out[k < sizeof out ? k : sizeof out - 1] = 0;
  fmt(cmd, CMD_MAX, "%s", out);
}

/* The substitutions of the header comment. `make_args`: "-C ROOT BUILD=... CUDA=...". */
static void adapt(char *cmd, const char *make_args, int have_plot, int have_ct2) {
  static const char *const tiny_prefixes[] = {
      "build/nmt train ",   "build/nmt translate ",   "build/nmt eval ", "build/nmt export ",
      "build/nmt bench scaling ", "./embed_static ", "./embed_example "};
  for (size_t i = 0; i < sizeof tiny_prefixes / sizeof tiny_prefixes[0]; i++)
    append_after(cmd, tiny_prefixes[i], TINY);
  append_after(cmd, "build/nmt bench allreduce ", TINY " --max-bytes 64K --iters 2 --warmup 1");
  if (strstr(cmd, "tools/prepare-data.sh")) replace_all(cmd, "--vocab 32000", "--vocab 400");
  append_after(cmd, "tools/prepare-wmt14.sh ", "--vocab 400");
  char m[1024];
  fmt(m, sizeof m, "make -n %s run", make_args);
  if (!strcmp(cmd, "make run")) fmt(cmd, CMD_MAX, "%s", m);
  fmt(m, sizeof m, "make -n %s test", make_args);
  if (!strcmp(cmd, "make test")) fmt(cmd, CMD_MAX, "%s", m);
  fmt(m, sizeof m, "make -s %s print-static-ldlibs", make_args);
  replace_all(cmd, "make -s print-static-ldlibs", m);
  if (!strncmp(cmd, "cc ", 3)) {
    char t[CMD_MAX];
    fmt(t, sizeof t, "cc ${CFLAGS:-} %s", cmd + 3);
    fmt(cmd, CMD_MAX, "%s", t);
  }
  if (!have_plot) replace_all(cmd, "tools/plot ", "true tools/plot ");
  if (!have_ct2 && strstr(cmd, "--format ctranslate2"))
    replace_all(cmd, "build/nmt export ", "true build/nmt export ");
}

static int sh(const char *cmd) {
  int st = system(cmd);
  return st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The scratch root of the header comment. Returns 0 on failure. */
static int make_sandbox(const char *dir, const char *root, const char *build) {
  char cmd[8192];
  fmt(cmd, sizeof cmd,
           "set -e; cd '%s'; for d in conf tools include; do ln -s '%s'/$d $d; done; "
           "ln -s '%s' build; mkdir -p data raw runs bin; ln -s '%s'/data/bible data/bible; "
           "b=data/bible; head -n 400 $b/train.en > raw/train.en; head -n 400 $b/train.es > "
           "raw/train.de; cp $b/valid.en raw/newstest2013.en; cp $b/valid.es raw/newstest2013.de; "
           "cp $b/test.en raw/newstest2014.en; cp $b/test.es raw/newstest2014.de; "
           "mkdir -p downloads/training; for l in en de; do t=raw/train.$l; "
           "head -n 200 $t > downloads/training/europarl-v7.de-en.$l; "
           "sed -n 201,350p $t > downloads/commoncrawl.de-en.$l; "
           "tail -n +351 $t > downloads/training/news-commentary-v9.de-en.$l; "
           "cp raw/newstest2013.$l raw/newstest2014.$l downloads/; done; "
           "printf '#!/bin/sh\\nexec \"$@\"\\n' > bin/srun; "
           "printf '#!/bin/sh\\necho \"$@\" >> scontrol.log\\n' > bin/scontrol; "
           "chmod +x bin/srun bin/scontrol",
           dir, root, build, root);
  return sh(cmd) == 0;
}

/* Files a command must leave behind (when its text contains `when`). */
static const struct {
  const char *when, *file;
} outputs[] = {
    {"--output hyp.es", "hyp.es"},
    {"> hyp.ids", "hyp.ids"},
    {"--output avg.ckpt", "avg.ckpt"},
    {"--output ensemble.es", "ensemble.es"},
    {"model.safetensors", "model.safetensors"},
    {"--format ctranslate2", "ct2-model/model.bin"},
    {"--format ctranslate2", "ct2-model/spm.model"},
    {"--out data/wmt14", "data/wmt14/test.shard"},
    {"-o metrics.png", "metrics.png"},
    {"-o embed_static", "embed_static"},
    {"run.out_dir=runs/embed", "runs/embed/checkpoints/latest"},
    {"runs/base-{job}", "runs/base-4242/checkpoints/latest"},
    {"run.out_dir=runs/bible-2000", "runs/bible-2000/checkpoints/latest"},
    {"run.out_dir=runs/wmt14", "runs/wmt14/checkpoints/latest"},
    {"tools/prepare-wmt14.sh", "data/wmt14/raw/train.en"},
    {"train conf/wmt14-en-de-base.ini", "runs/wmt14-en-de-base/checkpoints/latest"},
    {"--output runs/wmt14-en-de-base/avg.ckpt", "runs/wmt14-en-de-base/avg.ckpt"},
};

/* make run's result in the scratch directory: the files compared before and after. */
enum { N_KEPT = 4 };
static const char *const kept_names[N_KEPT] = {
    "runs/bible-small/checkpoints/best", "runs/bible-small/checkpoints/latest",
    "runs/bible-small/metrics.jsonl", "checkpoint named by best"};

/* Reads the N_KEPT files (the last one: the checkpoint `best` names, as its CRC-32 and size,
 * not the whole file). Returns how many were read. */
static int snapshot_run(const char *dir, char **out) {
  char path[PATH_MAX + 256];
  int n = 0;
  for (int k = 0; k < 3; k++) {
    fmt(path, sizeof path, "%s/%s", dir, kept_names[k]);
    out[k] = slurp(path);
    n += out[k] != NULL;
  }
  if (!out[0]) return n;
  char name[256];
  fmt(name, sizeof name, "%s", out[0]);
  name[strcspn(name, "\n")] = 0;
  fmt(path, sizeof path, "%s/runs/bible-small/checkpoints/%s", dir, name);
  uint32_t crc;
  uint64_t size;
  if (nmt_file_crc32(path, &crc, &size) != NMT_OK) return n;
  out[3] = malloc(64);
  if (!out[3]) return n;
  fmt(out[3], 64, "%08x %llu", (unsigned)crc, (unsigned long long)size);
  return n + 1;
}

/* make's view of the build under test `build`, run from `root`, into out: "-C ROOT
 * BUILD=OUT_BUILD CUDA=... CUDA_ARCHS=... CUDA_PTX=..." (CUDA, CUDA_ARCHS and CUDA_PTX from the
 * build's .cuda-flag, so make computes the same flag). out_build: the BUILD make is given. */
static void make_args_of(const char *root, const char *build, const char *out_build, char *out,
                         size_t cap) {
  char flag[256] = "", path[PATH_MAX + 64];
  fmt(path, sizeof path, "%s/.cuda-flag", build);
  FILE *f = fopen(path, "r");
  if (f) {
    if (!fgets(flag, sizeof flag, f)) flag[0] = 0;
    fclose(f);
  }
  flag[strcspn(flag, "\n")] = 0;
  /* "CUDA ARCH... ptx PTX..." */
  char *ptx = strstr(flag, " ptx");
  const char *ptx_archs = "";
  if (ptx) {
    *ptx = 0;
    ptx_archs = ptx[4] == ' ' ? ptx + 5 : "";
  }
  const char *archs = strchr(flag, ' ');
  fmt(out, cap, "-C '%s' BUILD='%s' CUDA=%.*s CUDA_ARCHS='%s' CUDA_PTX='%s'", root, out_build,
      archs ? (int)(archs - flag) : (int)strlen(flag), flag, archs ? archs + 1 : "", ptx_archs);
  if (!flag[0]) fmt(out, cap, "-C '%s' BUILD='%s'", root, out_build);
}

NMT_TEST(readme_commands_run) {
  char root[PATH_MAX], build[PATH_MAX], path[PATH_MAX + 64];
  if (!getcwd(root, sizeof root)) NMT_SKIP("no working directory");
  fmt(path, sizeof path, "%s/README.md", root);
  char *readme = slurp(path);
  if (!readme) NMT_SKIP("no README.md (the suite runs from the repository root)");
  if (access("data/bible/train.shard", R_OK) != 0 || access("data/bible/spm.model", R_OK) != 0) {
    free(readme);
    NMT_SKIP("no prepared corpus in data/bible (make data)");
  }
  if (!realpath(nmt_test_build_dir(), build)) {
    free(readme);
    NMT_SKIP("no build directory");
  }
  char make_args[PATH_MAX * 2 + 512];
  make_args_of(root, build, build, make_args, sizeof make_args);
  FILE *f;
  const int have_plot = sh("/usr/bin/python3 -c 'import matplotlib' >/dev/null 2>&1") == 0;
  const int have_ct2 = sh("python3 -c 'import ctranslate2, sentencepiece' >/dev/null 2>&1") == 0;

  static readme_cmd cmds[MAX_CMDS];
  int n_blocks = 0;
  int n = extract(readme, cmds, MAX_CMDS, &n_blocks);
  free(readme);
  NMT_ASSERT(n > 0);
  /* Setup, Use, fp32/fp16, prepare-data, embedding, Slurm; and at least their commands. */
  if (n_blocks < 6 || n < 25)
    nmt_test_fail(__FILE__, __LINE__, "only %d commands in %d sh blocks: did extraction break?", n,
                  n_blocks);
  if (nmt_test_failed()) return;

  const char *dir = nmt_test_tmpdir();
  NMT_ASSERT(make_sandbox(dir, root, build));
  /* What `make run` leaves (its training; its translate and eval only read the run). */
  char run_cmd[PATH_MAX + 1024];
  fmt(run_cmd, sizeof run_cmd,
      "cd '%s' && build/nmt train conf/bible-small.ini " TINY " > make-run.log 2>&1", dir);
  NMT_ASSERT_EQ_INT(sh(run_cmd), 0);
  char *before[N_KEPT] = {0};
  NMT_ASSERT(snapshot_run(dir, before) == N_KEPT);
  int failed = 0;
  for (int i = 0; i < n; i++) {
    static char cmd[CMD_MAX];
    fmt(cmd, sizeof cmd, "%s", cmds[i].text);
    adapt(cmd, make_args, have_plot, have_ct2);
    fmt(path, sizeof path, "%s/cmd%02d.sh", dir, i);
    f = fopen(path, "w");
    NMT_ASSERT(f != NULL);
    fprintf(f, "%s%s\n", cmds[i].script ? "" : "#!/bin/bash\n", cmd);
    NMT_ASSERT(fclose(f) == 0);
    char run[PATH_MAX * 3 + 256];
    fmt(run, sizeof run,
             "cd '%s' && PATH=\"$PWD/bin:$PATH\" SLURM_JOB_ID=4242 timeout 900 bash cmd%02d.sh "
             "> cmd%02d.log 2>&1",
             dir, i, i);
    int rc = sh(run);
    int shown = (int)strcspn(cmds[i].text, "\n");
    printf("# README line %d: exit %d: %.*s%s\n", cmds[i].line, rc, shown < 160 ? shown : 160,
           cmds[i].text, shown > 160 || cmds[i].text[shown] ? " ..." : "");
    int missing = 0;
    for (size_t k = 0; rc == 0 && k < sizeof outputs / sizeof outputs[0]; k++) {
      if (!strstr(cmds[i].text, outputs[k].when)) continue;
      if (!have_plot && strstr(outputs[k].file, ".png")) continue;
      if (!have_ct2 && !strncmp(outputs[k].file, "ct2-model/", 10)) continue;
      fmt(path, sizeof path, "%s/%s", dir, outputs[k].file);
      if (access(path, F_OK) != 0) {
        printf("#   expected %s after it\n", outputs[k].file);
        missing = 1;
      }
    }
    if (rc != 0 || missing) {
      char tail[PATH_MAX + 64];
      fmt(tail, sizeof tail, "tail -n 15 '%s/cmd%02d.log' | sed 's/^/#   /'", dir, i);
      fflush(stdout);
      sh(tail);
      printf("#   as run: %.600s\n", cmd);
      failed++;
    }
  }
  if (failed) nmt_test_fail(__FILE__, __LINE__, "%d of %d README commands failed", failed, n);
  char *after[N_KEPT] = {0};
  snapshot_run(dir, after);
  for (int k = 0; k < N_KEPT; k++) {
    if (!after[k] || strcmp(before[k], after[k]) != 0)
      nmt_test_fail(__FILE__, __LINE__, "the README's commands changed make run's %s (%s)",
                    kept_names[k], after[k] ? "its content differs" : "it is gone");
    free(before[k]);
    free(after[k]);
  }
}

/* Issue 38: after `make run`, the README's shared-library link line picked up libnmt.a (make
 * run built build/nmt only) and failed with C++ undefined references. The README's `cc` lines
 * link here against a build directory that holds only what `make run` builds, as its dry run
 * (make -n run, with an empty BUILD) shows: nmt, libnmt.a and libnmt.so, each linked in from
 * the build under test when the dry run makes it. */
NMT_TEST(readme_link_lines_after_make_run) {
  char root[PATH_MAX], build[PATH_MAX], path[PATH_MAX + 64];
  if (!getcwd(root, sizeof root)) NMT_SKIP("no working directory");
  fmt(path, sizeof path, "%s/README.md", root);
  char *readme = slurp(path);
  if (!readme) NMT_SKIP("no README.md (the suite runs from the repository root)");
  if (!realpath(nmt_test_build_dir(), build)) {
    free(readme);
    NMT_SKIP("no build directory");
  }
  static readme_cmd cmds[MAX_CMDS];
  int n_blocks = 0;
  int n = extract(readme, cmds, MAX_CMDS, &n_blocks);
  free(readme);
  NMT_ASSERT(n > 0);
  const char *dir = nmt_test_tmpdir();
  char dry[PATH_MAX + 64], make_args[PATH_MAX * 3 + 512], cmd[PATH_MAX * 4 + 1024];
  fmt(dry, sizeof dry, "%s/dry-build", dir);
  make_args_of(root, build, dry, make_args, sizeof make_args);
  fmt(cmd, sizeof cmd, "make -n %s run > '%s/dry-run.log' 2>&1", make_args, dir);
  NMT_ASSERT_EQ_INT(sh(cmd), 0);
  fmt(path, sizeof path, "%s/dry-run.log", dir);
  char *log = slurp(path);
  NMT_ASSERT(log != NULL);
  /* The sandbox's build/: a directory of links to what make run makes, not the build itself. */
  fmt(cmd, sizeof cmd, "cd '%s' && ln -s '%s'/include include && ln -s '%s'/tools tools && "
      "mkdir build", dir, root, root);
  NMT_ASSERT_EQ_INT(sh(cmd), 0);
  static const char *const made[] = {"nmt", "libnmt.a", "libnmt.so"};
  int n_made = 0;
  for (size_t k = 0; k < sizeof made / sizeof made[0]; k++) {
    char as_out[PATH_MAX + 128], as_last[PATH_MAX + 128], as_ar[PATH_MAX + 128];
    fmt(as_out, sizeof as_out, "-o %s/%s ", dry, made[k]);
    fmt(as_last, sizeof as_last, "-o %s/%s\n", dry, made[k]);
    fmt(as_ar, sizeof as_ar, "rcs %s/%s ", dry, made[k]);
    if (!strstr(log, as_out) && !strstr(log, as_last) && !strstr(log, as_ar)) {
      printf("# make run does not build %s\n", made[k]);
      continue;
    }
    n_made++;
    fmt(cmd, sizeof cmd, "ln -s '%s/%s' '%s/build/%s'", build, made[k], dir, made[k]);
    NMT_ASSERT_EQ_INT(sh(cmd), 0);
  }
  free(log);
  make_args_of(root, build, build, make_args, sizeof make_args);
  int links = 0, failed = 0;
  for (int i = 0; i < n; i++) {
    if (strncmp(cmds[i].text, "cc ", 3) != 0) continue;
    links++;
    static char c[CMD_MAX];
    fmt(c, sizeof c, "%s", cmds[i].text);
    adapt(c, make_args, 1, 1);
    fmt(path, sizeof path, "%s/link%02d.sh", dir, i);
    FILE *f = fopen(path, "w");
    NMT_ASSERT(f != NULL);
    fprintf(f, "#!/bin/bash\n%s\n", c);
    NMT_ASSERT(fclose(f) == 0);
    fmt(cmd, sizeof cmd, "cd '%s' && bash link%02d.sh > link%02d.log 2>&1", dir, i, i);
    int rc = sh(cmd);
    printf("# README line %d after make run's build (%d of nmt, libnmt.a, libnmt.so): exit %d: "
           "%.160s\n", cmds[i].line, n_made, rc, cmds[i].text);
    if (rc != 0) {
      fmt(cmd, sizeof cmd, "tail -n 8 '%s/link%02d.log' | sed 's/^/#   /'", dir, i);
      fflush(stdout);
      sh(cmd);
      failed++;
    }
  }
  if (links < 2)
    nmt_test_fail(__FILE__, __LINE__, "only %d cc lines in the README: did extraction break?",
                  links);
  if (failed)
    nmt_test_fail(__FILE__, __LINE__, "%d of the README's %d link lines fail after make run",
                  failed, links);
}
