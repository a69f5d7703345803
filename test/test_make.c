/* test_make.c — what a user sees of the build and of tools/install-deps.sh (issue 38): one
 * short line per file by default, the full command lines with V=1, and every error in full.
 *
 * The build runs for real, with stand-ins for the compilers, the archiver and nvcc that only
 * create their -o file (or fail, for the file named by FAKE_FAIL), into a scratch BUILD, so
 * every rule of `make` (C, C++, CUDA, archive, links), the test binary and the fuzz links run
 * in a second or two. install-deps.sh runs with stand-ins for dpkg-query (nothing installed),
 * apt-get (dpkg-style progress on stdout; FAKE_APT_RC its exit code) and sudo.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "helpers.h"
#include "test.h"

static void write_exe(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (f) {
    fputs(text, f);
    fclose(f);
  }
  if (chmod(path, 0755) != 0) nmt_test_fail(__FILE__, __LINE__, "chmod %s", path);
}

/* The stand-in compiler: creates its -o file; prints an error and fails for FAKE_FAIL. */
static const char fake_cc[] =
    "#!/bin/sh\n"
    "out=\n"
    "for a in \"$@\"; do\n"
    "  [ -n \"${FAKE_FAIL:-}\" ] && [ \"$a\" = \"$FAKE_FAIL\" ] && {\n"
    "    echo \"$a:1:1: error: a failure on purpose\" >&2; exit 1; }\n"
    "  [ \"$prev\" = -o ] && out=$a\n"
    "  prev=$a\n"
    "done\n"
    "[ -z \"$out\" ] || : > \"$out\"\n";

/* The stand-in archiver: `ar rcs OUT ...` */
static const char fake_ar[] = "#!/bin/sh\n: > \"$2\"\n";

/* `make ... targets` with the stand-ins into dir/b, `extra` its environment (not a calling
 * make's MAKEFLAGS or V); output (stdout and stderr) in out. */
static int fake_build(const char *dir, const char *extra, char *out, size_t cap) {
  char root[PATH_MAX], cmd[PATH_MAX * 8 + 1024];
  if (!getcwd(root, sizeof root)) return -1;
  snprintf(cmd, sizeof cmd,
           "rm -rf '%s/b' && env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL -u V %s make -C '%s' "
           "--no-print-directory -j2 BUILD='%s/b' CUDA=1 "
           "CC='%s/fake-cc' CXX='%s/fake-cc' NVCC='%s/fake-cc' AR='%s/fake-ar' "
           "'%s/b/nmt' '%s/b/libnmt.so' '%s/b/embed_example' '%s/b/test_nmt' "
           "'%s/b/fuzz-link/fuzz_ini' 2>&1",
           dir, extra, root, dir, dir, dir, dir, dir, dir, dir, dir, dir, dir);
  return nmt_th_capture(cmd, out, cap);
}

NMT_TEST(make_quiet_by_default) {
  if (access("Makefile", R_OK) != 0)
    NMT_SKIP("no Makefile (the suite runs from the repository root)");
  const char *dir = nmt_test_tmpdir();
  char path[PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/fake-cc", dir);
  write_exe(path, fake_cc);
  snprintf(path, sizeof path, "%s/fake-ar", dir);
  write_exe(path, fake_ar);
  static char out[1 << 20];
  /* Quiet: every line a short "  TAG     file" (no command line, no stand-in's path). */
  NMT_ASSERT_EQ_INT(fake_build(dir, "", out, sizeof out), 0);
  int lines = 0, cc = 0, cxx = 0, nvcc = 0, ar = 0, ld = 0;
  for (char *l = out, *next; *l; l = next) {
    next = strchr(l, '\n');
    if (next) *next++ = 0;
    else next = l + strlen(l);
    lines++;
    if (strstr(l, "fake-") || strncmp(l, "  ", 2) != 0 || strlen(l) > 120) {
      nmt_test_fail(__FILE__, __LINE__, "quiet build printed: %.300s", l);
      continue;
    }
    cc += !strncmp(l, "  CC ", 5), cxx += !strncmp(l, "  CXX ", 6);
    nvcc += !strncmp(l, "  NVCC ", 7), ar += !strncmp(l, "  AR ", 5);
    ld += !strncmp(l, "  LD ", 5);
  }
  printf("# quiet build: %d lines: %d CC, %d CXX, %d NVCC, %d AR, %d LD\n", lines, cc, cxx, nvcc,
         ar, ld);
  NMT_ASSERT(cc > 50 && cxx >= 2 && nvcc > 5 && ar == 1 && ld >= 5);
  /* V=1: the command lines. */
  NMT_ASSERT_EQ_INT(fake_build(dir, "V=1", out, sizeof out), 0);
  NMT_ASSERT(strstr(out, "fake-cc ") && strstr(out, " -c src/api.c -o "));
  /* An error in full, quiet or not: the compiler's message and make's. */
  NMT_ASSERT(fake_build(dir, "FAKE_FAIL=src/status.c", out, sizeof out) != 0);
  if (!strstr(out, "src/status.c:1:1: error: a failure on purpose") || !strstr(out, "Error"))
    nmt_test_fail(__FILE__, __LINE__, "a failing compile showed: %.2000s", out);
}

/* Runs tools/install-deps.sh with the stand-ins first on PATH and `env`; output in out. */
static int fake_install(const char *dir, const char *env, char *out, size_t cap) {
  char cmd[PATH_MAX * 2 + 256];
  snprintf(cmd, sizeof cmd, "PATH='%s/bin':\"$PATH\" V=0 %s tools/install-deps.sh 2>&1", dir,
           env);
  return nmt_th_capture(cmd, out, cap);
}

NMT_TEST(install_deps_quiet_by_default) {
  if (access("tools/install-deps.sh", X_OK) != 0) NMT_SKIP("no tools/install-deps.sh");
  const char *dir = nmt_test_tmpdir();
  char path[PATH_MAX + 32];
  snprintf(path, sizeof path, "mkdir -p '%s/bin'", dir);
  NMT_ASSERT_EQ_INT(system(path), 0);
  snprintf(path, sizeof path, "%s/bin/dpkg-query", dir);
  write_exe(path, "#!/bin/sh\nexit 1\n");
  snprintf(path, sizeof path, "%s/bin/sudo", dir);
  write_exe(path, "#!/bin/sh\nexec \"$@\"\n");
  snprintf(path, sizeof path, "%s/bin/apt-get", dir);
  write_exe(path, "#!/bin/sh\n"
                  "for i in 1 2 3; do echo \"Unpacking libfake$i (1.0) ...\"; done\n"
                  "echo 'debconf: delaying package configuration' >&2\n"
                  "exit ${FAKE_APT_RC:-0}\n");
  static char out[65536];
  NMT_ASSERT_EQ_INT(fake_install(dir, "", out, sizeof out), 0);
  if (strstr(out, "Unpacking") || strstr(out, "debconf") ||
      !strstr(out, "install-deps: installing"))
    nmt_test_fail(__FILE__, __LINE__, "quiet install printed: %.2000s", out);
  NMT_ASSERT_EQ_INT(fake_install(dir, "V=1", out, sizeof out), 0);
  NMT_ASSERT(strstr(out, "Unpacking libfake1") && strstr(out, "debconf"));
  /* A failure shows apt's whole output, quiet or not. */
  NMT_ASSERT(fake_install(dir, "FAKE_APT_RC=100", out, sizeof out) != 0);
  if (!strstr(out, "Unpacking libfake3") || !strstr(out, "debconf"))
    nmt_test_fail(__FILE__, __LINE__, "a failed install showed: %.2000s", out);
}
