/* test/test_tools.c — the scripts under tools/ run as a user runs them (from the repository root):
 * tools/plot renders a PNG from a metrics.jsonl with malformed lines and missing fields. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"

/* Runs a shell command, capturing stdout+stderr into out; returns the exit code (-1 if none). */
static int run(const char *cmd, char *out, size_t n) {
  FILE *p = popen(cmd, "r");
  if (!p) return -1;
  size_t k = fread(out, 1, n - 1, p);
  out[k] = 0;
  int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static uint32_t be32(const unsigned char *b) {
  return (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
}

/* 1 when path is a PNG whose first chunk is an IHDR with a non-zero width and height (PNG spec
 * §5.2-5.3, §11.2.2: the 8-byte signature, then length, "IHDR", width, height big-endian). */
static int png_ok(const char *path, uint32_t *w, uint32_t *h) {
  static const unsigned char sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  unsigned char b[24];
  FILE *f = fopen(path, "rb");
  if (!f) return 0;
  size_t n = fread(b, 1, sizeof b, f);
  fclose(f);
  if (n != sizeof b || memcmp(b, sig, 8) || be32(b + 8) != 13 || memcmp(b + 12, "IHDR", 4))
    return 0;
  *w = be32(b + 16), *h = be32(b + 20);
  return *w > 0 && *h > 0;
}

/* A run of 40 logged steps as an fp16 run with this trainer writes them, save that every field but
 * step is left out of some records, one line is half written (a kill mid-write), one has a
 * string step, and the run resumes from step 20 (steps 21-25 logged twice). Returns the 1-based
 * line numbers of the two bad lines. */
static int write_metrics(const char *path, int bad[2]) {
  FILE *f = fopen(path, "w");
  if (!f) return 0;
  int line = 0;
  for (int i = 1; i <= 45; i++) {
    int step = i <= 25 ? i * 10 : (i - 5) * 10; /* i = 26..30 re-log steps 210..250 */
    double loss = 9.0 / (1.0 + 0.01 * step);
    fprintf(f, "{\"step\": %d, \"epoch\": %d", step, step / 100);
    if (i % 7) fprintf(f, ", \"train_loss\": %.6f, \"train_nll\": %.6f", loss, loss - 0.3);
    if (i % 5) fprintf(f, ", \"lr\": %.6g, \"tgt_tokens_per_s\": %.1f", 1e-4 * step, 1000.0 + i);
    fprintf(f, ", \"grad_norm\": %s", i == 3 ? "null" : "1.5");
    if (i > 10) /* older records predate the fp16 fields */
      fprintf(f, ", \"loss_scale\": %d, \"skipped_steps\": %d, \"mfu\": 0.41, \"peak_mem_mb\": 812",
              65536 >> (i % 4), i / 4);
    if (i % 10 == 0)
      fprintf(f, ", \"valid_loss\": %.6f, \"valid_nll\": %.6f, \"valid_ppl\": %.4f", loss + 0.2,
              loss, 2.0 + loss);
    fprintf(f, "}\n");
    line++;
    if (i == 4) fprintf(f, "{\"step\": 41, \"epoch\": 0, \"train_lo\n"), bad[0] = ++line;
    if (i == 8) fprintf(f, "{\"step\": \"x\", \"train_loss\": 1.0}\n"), bad[1] = ++line;
  }
  return fclose(f) == 0;
}

NMT_TEST(tools_plot) {
  char cmd[4096], out[8192], path[1024], png[1024];
  const char *dir = nmt_test_tmpdir();
  NMT_ASSERT(dir != NULL);
  if (access("/usr/bin/python3", X_OK) != 0) NMT_SKIP("no /usr/bin/python3");
  NMT_ASSERT(access("tools/plot", X_OK) == 0); /* run from the repository root, like make test */

  /* A missing file is refused before matplotlib is needed. */
  snprintf(cmd, sizeof cmd, "tools/plot %s/nothing-here 2>&1", dir);
  int rc = run(cmd, out, sizeof out);
  if (rc != 2) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 2: %s", cmd, rc, out);
  NMT_ASSERT_EQ_INT(rc, 2);

  if (run("/usr/bin/python3 -c 'import matplotlib' 2>&1", out, sizeof out) != 0)
    NMT_SKIP("/usr/bin/python3 cannot import matplotlib (tools/install-deps.sh installs it)");

  /* A file with no usable record: exit 2. */
  snprintf(path, sizeof path, "%s/empty.jsonl", dir);
  FILE *f = fopen(path, "w");
  NMT_ASSERT(f != NULL);
  fprintf(f, "\n{\"epoch\": 1}\n[1, 2]\n");
  NMT_ASSERT(fclose(f) == 0);
  snprintf(cmd, sizeof cmd, "tools/plot %s 2>&1", path);
  rc = run(cmd, out, sizeof out);
  if (rc != 2) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 2: %s", cmd, rc, out);
  NMT_ASSERT_EQ_INT(rc, 2);

  /* A run directory: the default output is RUN_DIR/metrics.png, printed on stdout; each bad line
   * is named in a warning. */
  int bad[2] = {0, 0};
  snprintf(path, sizeof path, "%s/fp16", dir);
  NMT_ASSERT(mkdir(path, 0755) == 0);
  snprintf(path, sizeof path, "%s/fp16/metrics.jsonl", dir);
  NMT_ASSERT(write_metrics(path, bad));
  snprintf(cmd, sizeof cmd, "tools/plot %s/fp16 2>&1", dir);
  rc = run(cmd, out, sizeof out);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", cmd, rc, out);
  NMT_ASSERT_EQ_INT(rc, 0);
  snprintf(png, sizeof png, "%s/fp16/metrics.png", dir);
  if (!strstr(out, png)) nmt_test_fail(__FILE__, __LINE__, "output does not name %s: %s", png, out);
  for (int k = 0; k < 2; k++) {
    char want[64];
    snprintf(want, sizeof want, "metrics.jsonl:%d: skipped", bad[k]);
    if (!strstr(out, want)) nmt_test_fail(__FILE__, __LINE__, "no warning \"%s\": %s", want, out);
  }
  if (nmt_test_failed()) return;
  uint32_t w = 0, h = 0;
  NMT_ASSERT(png_ok(png, &w, &h));
  printf("# %s: %ux%u\n", png, w, h);

  /* Two runs overlaid, -o and --title; the second (bf16-like) has no loss_scale or valid fields. */
  snprintf(path, sizeof path, "%s/bf16.jsonl", dir);
  f = fopen(path, "w");
  NMT_ASSERT(f != NULL);
  for (int s = 10; s <= 200; s += 10)
    fprintf(f, "{\"step\": %d, \"train_loss\": %.4f, \"tgt_tokens_per_s\": 1500}\n", s,
            8.0 - s * 0.01);
  NMT_ASSERT(fclose(f) == 0);
  snprintf(png, sizeof png, "%s/cmp.png", dir);
  snprintf(cmd, sizeof cmd, "tools/plot %s/fp16/metrics.jsonl %s -o %s --title 'fp16 vs bf16' 2>&1",
           dir, path, png);
  rc = run(cmd, out, sizeof out);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", cmd, rc, out);
  NMT_ASSERT_EQ_INT(rc, 0);
  w = h = 0;
  NMT_ASSERT(png_ok(png, &w, &h));
}

/* Writes text to dir/rel, making the parent folders. */
static int put(const char *dir, const char *rel, const char *text) {
  char path[1024], cmd[1200], out[256];
  snprintf(path, sizeof path, "%s/%s", dir, rel);
  snprintf(cmd, sizeof cmd, "mkdir -p \"$(dirname '%s')\"", path);
  if (run(cmd, out, sizeof out) != 0) return 0;
  FILE *f = fopen(path, "w");
  if (!f) return 0;
  fputs(text, f);
  return fclose(f) == 0;
}

/* tools/check-layout (issue 14's size and coupling rules): this repository passes, and a tree
 * that breaks each rule once fails with each violation named, so the check can fail. */
NMT_TEST(tools_check_layout) {
  char out[16384], cmd[2048];
  if (access("/usr/bin/python3", X_OK) != 0) NMT_SKIP("no /usr/bin/python3");
  NMT_ASSERT(access("tools/check-layout", X_OK) == 0); /* run from the repository root */
  int rc = run("/usr/bin/python3 tools/check-layout 2>&1", out, sizeof out);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "this tree breaks the layout rules: %s", out);
  NMT_ASSERT_EQ_INT(rc, 0);

  const char *dir = nmt_test_tmpdir();
  NMT_ASSERT(dir != NULL);
  /* A 801-line header, a 151-line function next to a one-line one and a prototype, and an
   * engine file that names the reference table, tests NMT_CUDA and calls a CUDA function
   * (the same words inside a comment or a string must not count). */
  static char big[801 * 3 + 1];
  for (int i = 0; i < 801; i++) memcpy(big + 3 * i, "//\n", 3);
  NMT_ASSERT(put(dir, "include/nmt/big.h", big));
  static char fn[20000];
  size_t k = (size_t)snprintf(fn, sizeof fn, "int tiny(void) { return 0; }\nint proto(int x);\n"
                              "int long_one(int x) {\n");
  for (int i = 0; i < 149; i++) k += (size_t)snprintf(fn + k, sizeof fn - k, "  x++;\n");
  snprintf(fn + k, sizeof fn - k, "}\n");
  NMT_ASSERT(put(dir, "src/util/f.c", fn));
  NMT_ASSERT(put(dir, "src/engine/e.c",
                 "/* nmt_backend_ref, #ifdef NMT_CUDA, nmt_cuda_x() in a comment */\n"
                 "const char *s = \"nmt_cuda_y()\";\n"
                 "#ifdef NMT_CUDA\n"
                 "int a(void) { return be == &nmt_backend_ref; }\n"
                 "#endif\n"
                 "int b(void) { return nmt_cuda_thing(1); }\n"));
  snprintf(cmd, sizeof cmd, "/usr/bin/python3 tools/check-layout %s 2>&1", dir);
  rc = run(cmd, out, sizeof out);
  NMT_ASSERT_EQ_INT(rc, 1);
  const char *want[] = {"include/nmt/big.h:1: file-size: 801 lines",
                        "src/util/f.c:3: function-size: 151 lines",
                        "src/engine/e.c:3: coupling: tests NMT_CUDA",
                        "src/engine/e.c:4: coupling: names nmt_backend_ref",
                        "src/engine/e.c:6: coupling: calls nmt_cuda_* directly",
                        "check-layout: 5 violation(s)"};
  for (size_t i = 0; i < sizeof want / sizeof *want; i++)
    if (!strstr(out, want[i])) nmt_test_fail(__FILE__, __LINE__, "no \"%s\" in: %s", want[i], out);
}
