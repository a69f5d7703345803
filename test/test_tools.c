/* test/test_tools.c — the scripts under tools/ run as a user runs them (from the repository root):
 * tools/plot renders a PNG from a metrics.jsonl with malformed lines and missing fields;
 * tools/check-layout; the GPU runbook's pieces (tools/gpu-check.sh without a GPU, the runner's
 * NMT_EXPECT_GPU, the level of the CUDA init error). */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "nmt/backend.h"
#include "nmt/log.h"
#include "helpers.h"
#include "test.h"

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
  int rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 2) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 2: %s", cmd, rc, out);
  NMT_ASSERT_EQ_INT(rc, 2);

  if (nmt_th_capture("/usr/bin/python3 -c 'import matplotlib' 2>&1", out, sizeof out) != 0)
    NMT_SKIP("/usr/bin/python3 cannot import matplotlib (tools/install-deps.sh installs it)");

  /* A file with no usable record: exit 2. */
  snprintf(path, sizeof path, "%s/empty.jsonl", dir);
  FILE *f = fopen(path, "w");
  NMT_ASSERT(f != NULL);
  fprintf(f, "\n{\"epoch\": 1}\n[1, 2]\n");
  NMT_ASSERT(fclose(f) == 0);
  snprintf(cmd, sizeof cmd, "tools/plot %s 2>&1", path);
  rc = nmt_th_capture(cmd, out, sizeof out);
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
  rc = nmt_th_capture(cmd, out, sizeof out);
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
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", cmd, rc, out);
  NMT_ASSERT_EQ_INT(rc, 0);
  w = h = 0;
  NMT_ASSERT(png_ok(png, &w, &h));
}

/* 1 when the file holds `text` anywhere (a PNG's tEXt metadata is stored as plain bytes). */
static int file_has(const char *path, const char *text) {
  FILE *f = fopen(path, "rb");
  if (!f) return 0;
  static char buf[1 << 20];
  size_t n = fread(buf, 1, sizeof buf, f);
  fclose(f);
  return memmem(buf, n, text, strlen(text)) != NULL;
}

/* Issue 19: tools/plot drew an "fp16 loss scale" panel (a flat line at 1) for fp32 runs. A run
 * is fp16 by its config.ini, or without one by a loss scale other than 1 in its records; the
 * PNG's Description names the panels drawn. */
NMT_TEST(tools_plot_loss_scale_only_for_fp16) {
  char cmd[4096], out[8192], path[1024], png[1024];
  const char *dir = nmt_test_tmpdir();
  if (access("/usr/bin/python3", X_OK) != 0) NMT_SKIP("no /usr/bin/python3");
  if (nmt_th_capture("/usr/bin/python3 -c 'import matplotlib' 2>&1", out, sizeof out) != 0)
    NMT_SKIP("/usr/bin/python3 cannot import matplotlib (tools/install-deps.sh installs it)");
  /* fp32 (config.ini says so) and fp16 runs, both logging loss_scale; the fp16 one with its
   * initial scale of 65536 and one halving. */
  static const char *const modes[] = {"fp32", "fp16", "bf16-no-config"};
  for (int r = 0; r < 3; r++) {
    snprintf(path, sizeof path, "%s/%s", dir, modes[r]);
    NMT_ASSERT(mkdir(path, 0755) == 0);
    if (r < 2) {
      snprintf(path, sizeof path, "%s/%s/config.ini", dir, modes[r]);
      FILE *f = fopen(path, "w");
      NMT_ASSERT(f != NULL);
      fprintf(f, "[run]\n; doc\nseed = 1\n\n[precision]\n; GEMM arithmetic\nmode = %s\n",
              modes[r]);
      NMT_ASSERT(fclose(f) == 0);
    }
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", dir, modes[r]);
    FILE *f = fopen(path, "w");
    NMT_ASSERT(f != NULL);
    for (int s = 10; s <= 100; s += 10)
      fprintf(f, "{\"step\": %d, \"train_loss\": %.3f, \"lr\": 0.001, \"loss_scale\": %d, "
              "\"skipped_steps\": %d}\n", s, 9.0 - 0.01 * s,
              r == 1 ? (s < 50 ? 65536 : 32768) : 1, r == 1 && s >= 50);
    NMT_ASSERT(fclose(f) == 0);
  }
  for (int r = 0; r < 3; r++) {
    snprintf(png, sizeof png, "%s/%s.png", dir, modes[r]);
    snprintf(cmd, sizeof cmd, "tools/plot %s/%s -o %s 2>&1", dir, modes[r], png);
    int rc = nmt_th_capture(cmd, out, sizeof out);
    if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", cmd, rc, out);
    NMT_ASSERT_EQ_INT(rc, 0);
    NMT_ASSERT(file_has(png, "panels: "));
    const int fp16 = r == 1;
    if (file_has(png, "fp16 loss scale") != fp16 || file_has(png, "learning rate") == fp16)
      nmt_test_fail(__FILE__, __LINE__, "%s: the loss-scale panel is %s", modes[r],
                    fp16 ? "missing" : "drawn");
    if (nmt_test_failed()) return;
  }
  /* fp32 and fp16 overlaid: the panel is there for the fp16 run. */
  snprintf(png, sizeof png, "%s/both.png", dir);
  snprintf(cmd, sizeof cmd, "tools/plot %s/fp32 %s/fp16 -o %s 2>&1", dir, dir, png);
  NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 0);
  NMT_ASSERT(file_has(png, "fp16 loss scale"));
}

/* Writes text to dir/rel, making the parent folders. */
static int put(const char *dir, const char *rel, const char *text) {
  char path[1024], cmd[1200], out[256];
  snprintf(path, sizeof path, "%s/%s", dir, rel);
  snprintf(cmd, sizeof cmd, "mkdir -p \"$(dirname '%s')\"", path);
  if (nmt_th_capture(cmd, out, sizeof out) != 0) return 0;
  FILE *f = fopen(path, "w");
  if (!f) return 0;
  fputs(text, f);
  return fclose(f) == 0;
}

/* tools/check-layout (issue 14's size and coupling rules, issue 27's "no circle of files"):
 * this repository passes, and a tree that breaks each rule once fails with each violation
 * named, so the check can fail. */
NMT_TEST(tools_check_layout) {
  char out[16384], cmd[2048];
  if (access("/usr/bin/python3", X_OK) != 0) NMT_SKIP("no /usr/bin/python3");
  NMT_ASSERT(access("tools/check-layout", X_OK) == 0); /* run from the repository root */
  int rc = nmt_th_capture("/usr/bin/python3 tools/check-layout 2>&1", out, sizeof out);
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
  /* Circles: p.c and q.c call each other's functions (q.h only declares them: promises, not
   * uses); two headers include each other. Not circles: v.c names u.c's u_fn only in a
   * comment, a string, a member and its own static function of that name, while u.c calls
   * v.c. */
  NMT_ASSERT(put(dir, "src/data/q.h", "int p_fn(void);\nint q_fn(void);\n"));
  NMT_ASSERT(put(dir, "src/data/p.c", "#include \"q.h\"\nint p_fn(void) { return q_fn() + 1; }\n"));
  NMT_ASSERT(put(dir, "src/data/q.c",
                 "#include \"q.h\"\nint q_fn(void) { return 2; }\n"
                 "int q_user(void) { return p_fn(); }\n"));
  NMT_ASSERT(put(dir, "src/data/h1.h", "#include \"h2.h\"\n"));
  NMT_ASSERT(put(dir, "src/data/h2.h", "#include \"h1.h\"\n"));
  NMT_ASSERT(put(dir, "src/data/u.c", "int u_fn(void) { return v_fn(); }\n"));
  NMT_ASSERT(put(dir, "src/data/v.c",
                 "/* u_fn() in a comment */\nstruct box { int u_fn; };\n"
                 "static int u_fn(void) { return 1; }\n"
                 "int v_fn(struct box b) {\n"
                 "  const char *s = \"u_fn()\";\n  return u_fn() + b.u_fn + !s;\n}\n"));
  snprintf(cmd, sizeof cmd, "/usr/bin/python3 tools/check-layout %s 2>&1", dir);
  rc = nmt_th_capture(cmd, out, sizeof out);
  NMT_ASSERT_EQ_INT(rc, 1);
  const char *want[] = {
      "include/nmt/big.h:1: file-size: 801 lines",
      "src/util/f.c:3: function-size: 151 lines",
      "src/engine/e.c:3: coupling: tests NMT_CUDA",
      "src/engine/e.c:4: coupling: names nmt_backend_ref",
      "src/engine/e.c:6: coupling: calls nmt_cuda_* directly",
      "src/data/p.c:2: circle: src/data/p.c -> src/data/q.c (q_fn) -> src/data/p.c (p_fn)",
      "src/data/h1.h:1: circle: src/data/h1.h -> src/data/h2.h (#include \"h2.h\") -> "
      "src/data/h1.h (#include \"h1.h\")",
      "check-layout: 7 violation(s)"};
  for (size_t i = 0; i < sizeof want / sizeof *want; i++)
    if (!strstr(out, want[i])) nmt_test_fail(__FILE__, __LINE__, "no \"%s\" in: %s", want[i], out);
}

/* ------------------------------------------------------------------------------------------ */
/* The GPU runbook (issue 15): NMT_EXPECT_GPU turns a skip for want of a GPU into a failure,
 * tools/gpu-check.sh stops loudly where there is no GPU, and a CUDA build's failed device
 * count is a warning where a GPU is expected. */

/* The fixture of tools_runner_expect_gpu, run in a child test_nmt: skips with the reason that
 * NMT_TEST_PROBE names, and does nothing when it is unset (every ordinary run). */
NMT_TEST(tools_runner_probe) {
  const char *p = getenv("NMT_TEST_PROBE");
  if (p && !strcmp(p, "no-device")) NMT_SKIP("no CUDA device");
  if (p && !strcmp(p, "cpu-build")) NMT_SKIP("CPU-only build: no CUDA backend table");
  if (p && !strcmp(p, "two-gpus")) NMT_SKIP("needs 2 GPUs");
}

/* Runs this very test binary on tools_runner_probe with `env` (assignments for env(1)) and the
 * outer run's NMT_EXPECT_GPU / NMT_TEST_SKIP removed; the exit code, output in out. */
static int run_probe(const char *env, char *out, size_t n) {
  char self[1024], cmd[2048];
  ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
  if (k <= 0) return -1;
  self[k] = 0;
  snprintf(cmd, sizeof cmd,
           "env -u NMT_EXPECT_GPU -u NMT_TEST_SKIP %s '%s' tools_runner_probe 2>&1", env, self);
  return nmt_th_capture(cmd, out, n);
}

NMT_TEST(tools_runner_expect_gpu) {
  char out[4096];
  /* Without NMT_EXPECT_GPU (or with 0) a missing device is a skip, as on every GPU-less box. */
  const char *skip_env[] = {"NMT_TEST_PROBE=no-device", "NMT_TEST_PROBE=no-device NMT_EXPECT_GPU=0",
                            "NMT_TEST_PROBE=no-device NMT_EXPECT_GPU=",
                            "NMT_TEST_PROBE=two-gpus NMT_EXPECT_GPU=1",
                            "NMT_TEST_PROBE=no-device NMT_EXPECT_GPU=1 NMT_TEST_SKIP=runner_probe"};
  for (size_t i = 0; i < sizeof skip_env / sizeof *skip_env; i++) {
    int rc = run_probe(skip_env[i], out, sizeof out);
    if (rc != 0 || !strstr(out, "ok 1 - tools_runner_probe # SKIP") ||
        !strstr(out, "0 passed, 0 failed, 1 skipped"))
      nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 0 and a skip: %s", skip_env[i], rc, out);
  }
  /* With NMT_EXPECT_GPU=1 (tools/gpu-check.sh on a GPU machine): a failure, with the reason. */
  const char *fail_env[] = {"NMT_TEST_PROBE=no-device NMT_EXPECT_GPU=1",
                            "NMT_TEST_PROBE=cpu-build NMT_EXPECT_GPU=yes"};
  for (size_t i = 0; i < sizeof fail_env / sizeof *fail_env; i++) {
    int rc = run_probe(fail_env[i], out, sizeof out);
    if (rc != 1 || !strstr(out, "not ok 1 - tools_runner_probe") ||
        !strstr(out, "# NMT_EXPECT_GPU is set (a GPU machine), but the test skipped: ") ||
        !strstr(out, "0 passed, 1 failed, 0 skipped"))
      nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 1 and not ok: %s", fail_env[i], rc, out);
  }
  /* The probe itself passes when nothing asks it to skip. */
  int rc = run_probe("", out, sizeof out);
  if (rc != 0 || !strstr(out, "1 passed, 0 failed, 0 skipped"))
    nmt_test_fail(__FILE__, __LINE__, "plain probe: exit %d: %s", rc, out);
}

/* The runner's filters (test/runner.c), run in a child test_nmt: a filter selects the names
 * that contain it, or with a trailing '$' the one name equal to it; several filters select
 * the union, each test once, in name order (tools/gpu-check.sh first names a group's tests
 * exactly, so that cuda_train does not also run cuda_trainer_device_selection). */
NMT_TEST(tools_runner_exact_names) {
  char self[1024], cmd[2048], out[4096];
  ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
  NMT_ASSERT(k > 0);
  self[k] = 0;
  const struct {
    const char *args, *want[3];
  } cases[] = {
      {"'tools_runner_probe$'", {"ok 1 - tools_runner_probe\n", "1 passed, 0 failed, 0 skipped"}},
      {"tools_runner_prob", {"ok 1 - tools_runner_probe\n", "1 passed, 0 failed, 0 skipped"}},
      {"'tools_runner_prob$'", {"0 passed, 0 failed, 0 skipped"}},
      {"'tools_runner_probe$' tools_runner_probe",
       {"ok 1 - tools_runner_probe\n", "1 passed, 0 failed, 0 skipped"}},
      {"'tools_runner_probe$' 'tools_gpu_check_memcheck_kinds$'",
       {"ok 1 - tools_gpu_check_memcheck_kinds\n", "ok 2 - tools_runner_probe\n",
        "2 passed, 0 failed, 0 skipped"}}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    snprintf(cmd, sizeof cmd,
             "env -u NMT_EXPECT_GPU -u NMT_TEST_SKIP -u NMT_TEST_PROBE '%s' %s 2>&1", self,
             cases[i].args);
    int rc = nmt_th_capture(cmd, out, sizeof out);
    if (rc != 0) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", cases[i].args, rc, out);
    for (int j = 0; j < 3 && cases[i].want[j]; j++)
      if (!strstr(out, cases[i].want[j]))
        nmt_test_fail(__FILE__, __LINE__, "%s: no \"%s\" in: %s", cases[i].args, cases[i].want[j],
                      out);
  }
}

/* An executable script at dir/name with the given body; 1 on success. */
static int put_script(const char *dir, const char *name, const char *body, char *path, size_t n) {
  snprintf(path, n, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  if (!f) return 0;
  fprintf(f, "#!/bin/sh\n%s", body);
  return fclose(f) == 0 && chmod(path, 0755) == 0;
}

/* tools/gpu-check.sh on a machine without a GPU stops at once with exit 4 and says why, in its
 * output and its summary, before building or running anything. */
NMT_TEST(tools_gpu_check_without_gpu) {
  char out[8192], cmd[4096], smi[1024], sum[1200], buf[4096];
  const char *dir = nmt_test_tmpdir();
  NMT_ASSERT(dir != NULL);
  NMT_ASSERT(access("tools/gpu-check.sh", X_OK) == 0); /* run from the repository root */

  /* Usage errors come first: exit 2. */
  NMT_ASSERT_EQ_INT(nmt_th_capture("tools/gpu-check.sh 2>&1", out, sizeof out), 2);
  snprintf(cmd, sizeof cmd, "OUT=%s/u tools/gpu-check.sh test bogus 2>&1", dir);
  NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 2);
  NMT_ASSERT(strstr(out, "unknown stage 'bogus'") != NULL);

  /* No nvidia-smi at all; an nvidia-smi that finds no device (its own words and exit code);
   * one that succeeds but lists nothing. */
  NMT_ASSERT(put_script(dir, "smi-none", "echo 'No devices were found'; exit 6\n", smi,
                        sizeof smi));
  NMT_ASSERT(put_script(dir, "smi-empty", "exit 0\n", buf, sizeof buf));
  struct {
    const char *smi, *stage, *want;
  } cases[] = {
      {"/nonexistent/nvidia-smi", "test", "no GPU: /nonexistent/nvidia-smi not found"},
      {"smi-none", "sanitize", "lists no GPU (exit 6: No devices were found)"},
      {"smi-empty", "train-fp16", "lists no GPU (exit 0: )"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char smi_path[1100], out_dir[1100];
    if (cases[i].smi[0] == '/')
      snprintf(smi_path, sizeof smi_path, "%s", cases[i].smi);
    else
      snprintf(smi_path, sizeof smi_path, "%s/%s", dir, cases[i].smi);
    snprintf(out_dir, sizeof out_dir, "%s/out%zu", dir, i);
    snprintf(cmd, sizeof cmd, "NVIDIA_SMI='%s' OUT='%s' tools/gpu-check.sh %s 2>&1", smi_path,
             out_dir, cases[i].stage);
    int rc = nmt_th_capture(cmd, out, sizeof out);
    if (rc != 4 || !strstr(out, "no GPU: ") || !strstr(out, cases[i].want))
      nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 4 and \"%s\": %s", cmd, rc,
                    cases[i].want, out);
    /* The summary says it too, and nothing ran: no test log, no build log. */
    snprintf(sum, sizeof sum, "%s/summary.txt", out_dir);
    FILE *f = fopen(sum, "r");
    size_t k = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[k] = 0;
    if (!strstr(buf, "no GPU: "))
      nmt_test_fail(__FILE__, __LINE__, "%s: no \"no GPU: \" in the summary: %s", cmd, buf);
    snprintf(sum, sizeof sum, "%s/tests-cuda.log", out_dir);
    NMT_ASSERT(access(sum, F_OK) != 0);
    snprintf(sum, sizeof sum, "%s/build.log", out_dir);
    NMT_ASSERT(access(sum, F_OK) != 0);
  }

  /* And as a user runs it here, when this machine has no GPU. */
  if (nmt_th_capture("nvidia-smi -L 2>/dev/null | grep -q '^GPU [0-9]'", out, sizeof out) == 0) {
    printf("# this machine has a GPU: the plain run of tools/gpu-check.sh is not checked\n");
    return;
  }
  snprintf(cmd, sizeof cmd, "env -u NVIDIA_SMI OUT='%s/plain' tools/gpu-check.sh test 2>&1", dir);
  int rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 4 || !strstr(out, "no GPU: "))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 4 and \"no GPU: \": %s", cmd, rc, out);
}

/* The CUDA init error (cudaGetDeviceCount's) is logged at warn level where a GPU is expected
 * (NMT_EXPECT_GPU set, or a driver library installed), at debug level on a machine with no
 * driver (CI). Needs a CUDA build on a machine where the count fails. */
typedef struct {
  int n, level;
  char line[512];
} captured_log;

static void capture_log(void *user, nmt_log_level level, const char *line) {
  captured_log *c = user;
  if (!strstr(line, "cudaGetDeviceCount")) return;
  c->n++;
  c->level = (int)level;
  snprintf(c->line, sizeof c->line, "%s", line);
}

/* Calls device_count once with NMT_EXPECT_GPU set to `expect` (NULL: unset) and every log line
 * captured; the outer environment, log level and sink are restored before it returns. */
static void count_with(const nmt_backend *be, const char *expect, captured_log *c, int *n) {
  const char *old = getenv("NMT_EXPECT_GPU");
  char saved[64];
  snprintf(saved, sizeof saved, "%s", old ? old : "");
  nmt_log_level lvl = nmt_log_get_level();
  nmt_log_sink sink = {capture_log, c};
  memset(c, 0, sizeof *c);
  c->level = -1;
  if (expect) setenv("NMT_EXPECT_GPU", expect, 1);
  else unsetenv("NMT_EXPECT_GPU");
  nmt_log_set_level(NMT_LOG_DEBUG);
  nmt_log_set_sink(&sink);
  *n = -1;
  be->device_count(n);
  nmt_log_set_sink(NULL);
  nmt_log_set_level(lvl);
  if (old) setenv("NMT_EXPECT_GPU", saved, 1);
  else unsetenv("NMT_EXPECT_GPU");
}

NMT_TEST(tools_cuda_init_error_is_a_warning_where_a_gpu_is_expected) {
  const nmt_backend *be = nmt_backend_cuda_get();
  if (!be) NMT_SKIP("CPU-only build: no CUDA backend table");
  captured_log c;
  int n;
  count_with(be, "1", &c, &n);
  if (n > 0) NMT_SKIP("a CUDA device is present: the device count does not fail here");
  NMT_ASSERT_EQ_INT(n, 0);
  NMT_ASSERT_EQ_INT(c.n, 1);
  if (c.level != NMT_LOG_WARN || !strstr(c.line, "treating as no CUDA device") ||
      !strstr(c.line, "this build's runtime is CUDA "))
    nmt_test_fail(__FILE__, __LINE__, "NMT_EXPECT_GPU=1: level %d, want warn (%d): %s", c.level,
                  NMT_LOG_WARN, c.line);
  /* Unset (or 0): warn only if a driver library is installed, else debug. */
  void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  int want = h ? NMT_LOG_WARN : NMT_LOG_DEBUG;
  if (h) dlclose(h);
  const char *quiet[] = {NULL, "0"};
  for (int i = 0; i < 2; i++) {
    count_with(be, quiet[i], &c, &n);
    NMT_ASSERT_EQ_INT(n, 0);
    NMT_ASSERT_EQ_INT(c.n, 1);
    if (c.level != want)
      nmt_test_fail(__FILE__, __LINE__, "NMT_EXPECT_GPU=%s: level %d, want %d (libcuda.so.1 %s)",
                    quiet[i] ? quiet[i] : "(unset)", c.level, want, h ? "present" : "absent");
  }
}

/* The fat binary carries compute_90 PTX besides the sm_XX machine code (Makefile CUDA_PTX), so
 * a GPU newer than every built architecture JIT-compiles it instead of finding no kernel image;
 * read from this very test binary by tools/gpu-check.sh targets, module by module. A CPU-only
 * build carries none. */
NMT_TEST(tools_fat_binary_carries_ptx) {
  char self[1024], cmd[2048], out[4096];
  ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
  NMT_ASSERT(k > 0);
  self[k] = 0;
  snprintf(cmd, sizeof cmd, "tools/gpu-check.sh targets '%s' 2>&1", self);
  int rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc == 3) NMT_SKIP("tools/gpu-check.sh targets needs objcopy and python3");
  if (!nmt_backend_cuda_get()) {
    if (rc != 1 || !strstr(out, "no CUDA device code"))
      nmt_test_fail(__FILE__, __LINE__, "CPU-only build: exit %d, want 1: %s", rc, out);
    return;
  }
  /* Every module (one per cuda/<op>.cu) carries both: a count below sm_90's is an object built
   * without the PTX target and never rebuilt. */
  const char *ptx = strstr(out, "compute_90 PTX: "), *elf = strstr(out, "sm_90 ELF: ");
  int n_ptx = ptx ? atoi(ptx + strlen("compute_90 PTX: ")) : 0;
  int n_elf = elf ? atoi(elf + strlen("sm_90 ELF: ")) : 0;
  if (rc != 0 || n_elf < 1 || n_ptx != n_elf)
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want compute_90 PTX in each of the sm_90 "
                  "modules: %s", cmd, rc, out);
}

/* Writes n lines of made-up words (deterministic) to path; line `long_line` (1-based, 0 = none)
 * is 5000 bytes; line `bad_line` holds an invalid UTF-8 byte. */
static int write_text(const char *path, int n, int long_line, int bad_line, unsigned seed) {
  static const char *const syl[] = {"ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "é"};
  FILE *f = fopen(path, "w");
  if (!f) return 0;
  for (int i = 1; i <= n; i++) {
    int words = i == long_line ? 1000 : 3 + (int)(seed % 7);
    for (int w = 0; w < words; w++) {
      seed = seed * 1103515245u + 12345u;
      fprintf(f, "%s%s%s", w ? " " : "", syl[(seed >> 16) % 10], syl[(seed >> 20) % 10]);
    }
    if (i == bad_line) fputs(" \xff\xfe", f);
    fputc('\n', f);
  }
  return fclose(f) == 0;
}

/* Issue 19: tools/prepare-data.sh exited 1 for every error; now nmt's table (2 usage, 3 data,
 * 6 I/O), invalid UTF-8 is refused naming the file and line, and training lines longer than
 * SentencePiece takes are reported by line number. */
NMT_TEST(tools_prepare_data_exit_codes_and_checks) {
  const char *dir = nmt_test_tmpdir();
  char cmd[4096], out[16384], p[1024];
  NMT_ASSERT(access("tools/prepare-data.sh", X_OK) == 0);
  int rc = nmt_th_capture("tools/prepare-data.sh 2>&1", out, sizeof out);
  NMT_ASSERT_EQ_INT(rc, 2);
  rc = nmt_th_capture("tools/prepare-data.sh --help 2>&1", out, sizeof out);
  NMT_ASSERT_EQ_INT(rc, 0);
  NMT_ASSERT(strstr(out, "Exit codes") != NULL);
  NMT_ASSERT_EQ_INT(nmt_th_capture("tools/prepare-data.sh --name x --frob 1 2>&1", out, sizeof out), 2);
  if (access("/usr/bin/spm_train", X_OK) != 0 && nmt_th_capture("command -v spm_train", out, sizeof out))
    NMT_SKIP("no spm_train (tools/install-deps.sh installs SentencePiece)");

  const char *sides[] = {"en", "de"};
  for (int s = 0; s < 2; s++) {
    snprintf(p, sizeof p, "%s/train.%s", dir, sides[s]);
    NMT_ASSERT(write_text(p, 300, s == 0 ? 2 : 0, 0, 11u + (unsigned)s));
    snprintf(p, sizeof p, "%s/valid.%s", dir, sides[s]);
    NMT_ASSERT(write_text(p, 20, 0, s == 1 ? 3 : 0, 5u + (unsigned)s));
    snprintf(p, sizeof p, "%s/short.%s", dir, sides[s]);
    NMT_ASSERT(write_text(p, s == 0 ? 10 : 9, 0, 0, 7u));
  }
  char base[2048];
  snprintf(base, sizeof base, "tools/prepare-data.sh --name t --src en --tgt de --vocab 60 "
           "--nmt %s/nmt --train %s/train", nmt_test_build_dir(), dir);
  struct {
    const char *args;
    int code;
    const char *need[2];
  } cases[] = {
      {"--valid %s/nothing --out %s/o1", 2, {"missing file", "nothing.en"}},
      {"--valid %s/short --out %s/o2", 3, {"line counts differ", "short.de has 9"}},
      {"--valid %s/valid --out %s/o3", 3, {"valid.de: invalid UTF-8 on line 3", ""}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char more[1024];
    snprintf(more, sizeof more, cases[i].args, dir, dir);
    snprintf(cmd, sizeof cmd, "%s %s 2>&1", base, more);
    rc = nmt_th_capture(cmd, out, sizeof out);
    if (rc != cases[i].code || !strstr(out, cases[i].need[0]) || !strstr(out, cases[i].need[1]))
      nmt_test_fail(__FILE__, __LINE__, "%s: exit %d (want %d): %s", cmd, rc, cases[i].code, out);
    if (nmt_test_failed()) return;
  }
  /* OUT under a regular file cannot be made: I/O, exit 6. */
  snprintf(cmd, sizeof cmd, "%s --valid %s/train --out %s/train.en/sub 2>&1", base, dir, dir);
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 6) nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want 6: %s", cmd, rc, out);
  NMT_ASSERT_EQ_INT(rc, 6);
  /* A good run: the 5000-byte line 2 of train.en is reported, not refused. */
  snprintf(cmd, sizeof cmd, "%s --valid %s/train --out %s/ok 2>&1", base, dir, dir);
  rc = nmt_th_capture(cmd, out, sizeof out);
  if (rc != 0 || !strstr(out, "train.en: line 2 longer than 4192 bytes"))
    nmt_test_fail(__FILE__, __LINE__, "%s: exit %d: %s", cmd, rc, out);
  NMT_ASSERT_EQ_INT(rc, 0);
  snprintf(p, sizeof p, "%s/ok/train.shard", dir);
  NMT_ASSERT(access(p, R_OK) == 0);
}

/* The number of times needle occurs in hay. */
static int occurrences(const char *hay, const char *needle) {
  int n = 0;
  for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle)) n++;
  return n;
}

/* tools/gpu-check.sh first, the one command of a lent GPU machine (15 minutes of device time,
 * 10 per command, 8 files back), run here with a fake nvidia-smi and stand-in binaries.
 * (a) groups that pass, fail, crash and hang, then more; the stand-in test_nmt matches its
 * arguments as test/runner.c does, so a group named by a substring would run cuda_alphabet_six
 * twice (once for cuda_alpha): each test runs once, and the late group cuda_translate before
 * cuda_nccl. (b) the training plan: the stand-in nmt logs every train.log_every steps, the first
 * interval and the profiling window's at 1 target token/s and the others at 1000 (half
 * activations) or 500 (fp32), so the speed figures are 1000 and 500 only if those intervals
 * are left out; validation BLEU is asked of the first run alone (a stand-in sacreBLEU in the
 * pack where the machine has none); the earlier storage at 4x6250 and fp16 hang, and the run
 * after a hang still runs (each later run keeps its minimum and the gap between runs, which a
 * loaded machine once spent: 1 s was left for it); the table has every run, the new/old ratio where both ran and the 2026-11-26 curve. (c) the comparison gets
 * the compile plan that fits (default mode, no compiled loss check, a non-fatal eager check)
 * and hangs after writing more files than come back. The budget holds (it ends within
 * FIRST_SECONDS), every part is reported, and at most 8 files are left in OUT. */
NMT_TEST(tools_gpu_check_first_holds_its_budget) {
  char out[16384], cmd[8192], path[2300], sum[1200];
  const char *dir = nmt_test_tmpdir();
  NMT_ASSERT(dir != NULL);
  char pack[1024], bin[1100], py[1100];
  snprintf(pack, sizeof pack, "%s/pack", dir);
  snprintf(bin, sizeof bin, "%s/bin", pack);
  snprintf(py, sizeof py, "%s/python/sacrebleu", pack);
  snprintf(cmd, sizeof cmd, "mkdir -p '%s' '%s/lib' '%s' && echo fake > '%s/COMMIT' && "
           "printf 'cuda_alpha_one\\ncuda_alphabet_six\\ncuda_crash_two\\ncuda_fail_three\\n"
           "cuda_hang_four\\ncuda_multiworker_two_vs_accum_fp32\\ncuda_multiworker_valid_loss\\n"
           "cuda_nccl_eight\\ncuda_translate_seven\\ncuda_zeta_five\\n' > "
           "'%s/cuda-tests.txt' && : > '%s/__init__.py'", bin, pack, py, pack, pack, py);
  NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 0);
  NMT_ASSERT(put_script(py, "__main__.py",
                        "print('BLEU|nrefs:1|stand-in = 1.00 1.0/1.0/1.0/1.0 (BP = 1.000)')\n"
                        "print('chrF2|nrefs:1|stand-in = 2.00')\n",
                        path, sizeof path));
  NMT_ASSERT(put_script(dir, "smi",
                        "case \"$*\" in\n"
                        "  -L) echo 'GPU 0: Stand-in GPU (UUID: GPU-0)' ;;\n"
                        "  *driver_version*) echo '1.0, 9.0, 1 MiB' ;;\n"
                        "  *memory.used*) echo 100 ;;\n"
                        "  *) echo 'CUDA Version: 13.0' ;;\n"
                        "esac\n",
                        path, sizeof path));
  NMT_ASSERT(put_script(bin, "test_nmt",
                        "case \"$*\" in\n"
                        "  *cuda_crash*) echo 'ok 1 - cuda_crash_two'; kill -SEGV $$ ;;\n"
                        "  *cuda_fail*) echo '# boom'; echo 'not ok 1 - cuda_fail_three';\n"
                        "             echo '0 passed, 1 failed, 0 skipped'; exit 1 ;;\n"
                        "  *cuda_hang*) echo 'ok 1 - cuda_hang_four'; exec sleep 1000 ;;\n"
                        "esac\n"
                        "n=0\n"
                        "while read -r t; do\n"
                        "  for a in \"$@\"; do\n"
                        "    case \"$a\" in\n"
                        "      *'$') [ \"$t\" = \"${a%?}\" ] || continue ;;\n"
                        "      *) case \"$t\" in *\"$a\"*) ;; *) continue ;; esac ;;\n"
                        "    esac\n"
                        "    n=$((n + 1)); echo \"ok $n - $t\"; break\n"
                        "  done\n"
                        "done < \"$(dirname \"$0\")/../cuda-tests.txt\"\n"
                        "echo \"$n passed, 0 failed, 0 skipped\"\n",
                        path, sizeof path));
  snprintf(cmd, sizeof cmd,
           "echo \"$*\" >> '%s/nmt-args.txt'\n"
           "for a in \"$@\"; do case \"$a\" in\n"
           "  run.out_dir=*) o=${a#*=} ;; precision.mode=*) p=${a#*=} ;;\n"
           "  precision.activations=*) act=${a#*=} ;; data.max_tokens=*) tok=${a#*=} ;;\n"
           "  train.max_steps=*) S=${a#*=} ;; train.log_every=*) e=${a#*=} ;;\n"
           "  train.valid_every=*) ve=${a#*=} ;; train.valid_bleu=*) vb=${a#*=} ;;\n"
           "  profile.start_step=*) w=${a#*=} ;;\n"
           "esac; done\n"
           "[ \"$p\" = fp16 ] && exec sleep 1000\n"
           "[ \"$act\" = fp32 ] && [ \"$tok\" = 6250 ] && exec sleep 1000\n"
           "T=1000; [ \"$act\" = fp32 ] && T=500\n"
           "mkdir -p \"$o\"\n"
           "s=$e\n"
           "while [ $s -le $S ]; do\n"
           "  v=$T; l=8.5\n"
           "  [ $s -le $e ] && v=1 l=9.0\n"
           "  [ $s -ge $w ] && [ $((s - e)) -lt $((w + 10)) ] && v=1\n"
           "  [ $s -eq $S ] && l=8.0\n"
           "  echo \"{\\\"step\\\": $s, \\\"train_loss\\\": $l, \\\"tgt_tokens_per_s\\\": $v, "
           "\\\"step_ms\\\": 5, \\\"mfu\\\": 0.25}\" >> \"$o/metrics.jsonl\"\n"
           "  s=$((s + e))\n"
           "done\n"
           "b=''\n"
           "if [ \"$vb\" = on ]; then\n"
           "  echo \"step $S | validation BLEU: rank 0 decoded 268 sentences in 0.5 s\"\n"
           "  b=', \"valid_bleu\": 1.25, \"valid_chrf\": 10.5'\n"
           "fi\n"
           "[ \"$ve\" = \"$S\" ] && echo \"{\\\"step\\\": $S, \\\"valid_loss\\\": 8.5, "
           "\\\"valid_ppl\\\": 4914.8$b}\" >> \"$o/metrics.jsonl\"\n"
           "{ echo '# GEMM calls per micro-batch: 375.0 (forward 125.0, backward 250.0)'\n"
           "  echo \"# device kernels per micro-batch: 900.0 (forward 300.0, backward 600.0); "
           "cast kernels per micro-batch: 0.0; activation storage: $act\"\n"
           "  echo 'stand-in module table'; } > \"$o/profile.txt\"\n",
           dir);
  NMT_ASSERT(put_script(bin, "nmt", cmd, path, sizeof path));
  NMT_ASSERT(put_script(dir, "compare",
                        "echo 'summary: stand-in comparison'; mkdir -p \"$OUT\"\n"
                        "echo \"compile plan: $COMPILE_MODE $COMPILE_CHECK $CHECK_FATAL\"\n"
                        "echo '{\"system\": \"nmt\"}' > \"$OUT/results.jsonl\"\n"
                        "for i in 1 2 3 4 5 6 7 8 9; do echo x > \"$OUT/extra$i.txt\"; done\n"
                        "exec sleep 1000\n",
                        path, sizeof path));
  /* The pack's binaries travel gzip'd (tools/gpu-check.sh pack): setup unpacks them. */
  snprintf(cmd, sizeof cmd, "gzip -9 '%s/test_nmt' '%s/nmt'", bin, bin);
  NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 0);
  const int budget = 42;
  snprintf(cmd, sizeof cmd,
           "NVIDIA_SMI='%s/smi' GPU_PACK='%s' GPU_COMPARE='%s/compare' OUT='%s/out' "
           "RUNS='%s/runs' FIRST_SECONDS=%d FIRST_TESTS_SECONDS=10 FIRST_GROUP_SECONDS=3 "
           "FIRST_TRAIN_SECONDS=18 FIRST_COMPARE_SECONDS=5 FIRST_RUN_MIN_SECONDS=2 "
           "FIRST_RUN_GAP_SECONDS=2 TRAIN_STEPS=40 FIRST_BIG_STEPS=20 FIND_SECONDS=1 "
           /* five runs (the default plan's seven do not fit these seconds); the attention
            * field given, left out and fused */
           "FIRST_TRAIN_PLAN='bf16:half:6250:4:40:bleu:unfused bf16:fp32:6250:4:40:valid "
           "bf16:half:25000:1:20:none bf16:fp32:25000:1:20:none fp16:half:6250:4:40:valid:fused' "
           "tools/gpu-check.sh first 2>&1",
           dir, pack, dir, dir, dir, budget);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int rc = nmt_th_capture(cmd, out, sizeof out);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  const double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
  printf("# first with stand-ins: exit %d after %.1f s (FIRST_SECONDS %d)\n", rc, secs, budget);
  /* The budget is what the stage promises; 10 s more covers timeout's grace (-k 5). */
  if (rc != 1 || secs > budget + 10)
    nmt_test_fail(__FILE__, __LINE__, "exit %d after %.1f s: want 1 within %d s: %s", rc, secs,
                  budget + 10, out);
  snprintf(sum, sizeof sum, "%s/out/summary.txt", dir);
  char *summary = nmt_th_read_file(sum, NULL);
  NMT_ASSERT(summary != NULL);
  /* Each run's line (its timeout when it hung), for a log that has to explain a failure. */
  for (const char *l = summary; (l = strstr(l, "\ntrain ")); l++)
    printf("# %.*s\n", (int)strcspn(l + 1, "\n"), l + 1);
  const char *want[] = {
      "--- (a) GPU tests in groups",        "cuda_crash: rc 139",
      "not ok 1 - cuda_fail_three",          "cuda_hang: TIMED OUT after 3s",
      "GPU tests: 9 passed, 1 failed, 0 skipped, 1 groups timed out (9 groups run)",
      "multi-worker engine on one GPU (2 workers, parallel.comm = host): passed: "
      "two_vs_accum_fp32 valid_loss;",
      "validation BLEU: sacreBLEU from ",
      "train bf16-half-4x6250: rc 0",        "step 40 | validation BLEU: rank 0 decoded 268",
      "valid BLEU 1.25, chrF2 10.50",        "9.000 (step 4) -> 8.000 (step 40): falling",
      "# device kernels per micro-batch: 900.0 (forward 300.0, backward 600.0); cast kernels "
      "per micro-batch: 0.0; activation storage: half",
      "# GEMM calls per micro-batch: 375.0", "tgt tokens/s 1000, step 5.0 ms, MFU 25.0%",
      "train bf16-fp32-4x6250: rc 124",      "train bf16-half-1x25000: rc 0",
      "train bf16-fp32-1x25000: rc 0",       "tgt tokens/s 500,",
      "train fp16-half-4x6250-fused: rc 124",      "bf16-fp32-4x6250     no metrics (rc 124)",
      "new/old tgt tok/s, bf16 1x25000: 2.00x (half 1000, fp32 500",
      "new/old tgt tok/s, bf16 4x6250: - (a run has no figures)",
      "2026-11-26 (H100, bf16, 4x6250, fp32 activations): loss 9.386",
      "; bf16-half-4x6250: 9.000 -> 8.000 (step 40), valid 8.500",
      "--- (c) bench/gpu-compare.sh",        "gpu-compare: rc 124 (TIMED OUT)",
      "summary: stand-in comparison",
      "gpu-check done: status 1"};
  for (size_t i = 0; i < sizeof want / sizeof *want; i++)
    if (!strstr(summary, want[i]))
      nmt_test_fail(__FILE__, __LINE__, "summary lacks \"%s\":\n%s", want[i], summary);
  free(summary);
  /* Each test ran once (exact names); the group after the hang ran; the decoding path's late
   * group ran before NCCL's. */
  snprintf(sum, sizeof sum, "%s/out/tests.log", dir);
  char *tests = nmt_th_read_file(sum, NULL);
  NMT_ASSERT(tests != NULL);
  const char *mw = strstr(tests, "===== cuda_multiworker: rc 0");
  const char *tr = strstr(tests, "===== cuda_translate: rc 0");
  const char *nc = strstr(tests, "===== cuda_nccl");
  printf("# tests.log: cuda_alphabet_six %d time(s), cuda_alpha_one %d\n",
         occurrences(tests, "- cuda_alphabet_six\n"), occurrences(tests, "- cuda_alpha_one\n"));
  int tests_ok = strstr(tests, "===== cuda_zeta: rc 0") && mw && tr && nc && mw < tr && tr < nc &&
                 occurrences(tests, "- cuda_alphabet_six\n") == 1 &&
                 occurrences(tests, "- cuda_alpha_one\n") == 1;
  free(tests);
  NMT_ASSERT(tests_ok);
  /* The profile tables are in the training log, one section per run. */
  snprintf(sum, sizeof sum, "%s/out/train.log", dir);
  char *train = nmt_th_read_file(sum, NULL);
  NMT_ASSERT(train != NULL);
  int train_ok = occurrences(train, "stand-in module table") == 3 &&
                 strstr(train, "===== train bf16-half-1x25000") &&
                 strstr(train, "===== train fp16-half-4x6250");
  free(train);
  NMT_ASSERT(train_ok);
  /* Validation BLEU asked of the first run alone; every run with its storage and batch. */
  snprintf(sum, sizeof sum, "%s/nmt-args.txt", dir);
  char *args = nmt_th_read_file(sum, NULL);
  NMT_ASSERT(args != NULL);
  int args_ok = occurrences(args, "train.valid_bleu=on") == 1 &&
                occurrences(args, "precision.activations=half") == 3 &&
                occurrences(args, "data.max_tokens=25000 train.accum_steps=1") == 2 &&
                strstr(args, "precision.mode=bf16") && strstr(args, "profile.start_step=21") &&
                strstr(args, "profile.start_step=11") &&
                occurrences(args, "kernels.attention=fused") == 1 &&
                occurrences(args, "kernels.attention=unfused") == 4;
  if (!args_ok) printf("# nmt arguments:\n%s", args);
  NMT_ASSERT(args_ok);
  const char *first_line_end = strchr(args, '\n');
  NMT_ASSERT(first_line_end && strstr(args, "train.valid_bleu=on") < first_line_end);
  free(args);
  /* The comparison got the plan that fits the part. */
  snprintf(sum, sizeof sum, "%s/out/compare.txt", dir);
  char *compare = nmt_th_read_file(sum, NULL);
  NMT_ASSERT(compare && strstr(compare, "compile plan: default none 0"));
  free(compare);
  snprintf(sum, sizeof sum, "%s/out/metrics.jsonl", dir);
  char *metrics = nmt_th_read_file(sum, NULL);
  NMT_ASSERT(metrics && strstr(metrics, "\"run\": \"bf16-fp32-1x25000\""));
  free(metrics);
  /* At most 8 files, hidden ones included: the device tool brings back no more. */
  snprintf(cmd, sizeof cmd, "find '%s/out' -type f | wc -l", dir);
  NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 0);
  if (atoi(out) > 8 || atoi(out) < 5)
    nmt_test_fail(__FILE__, __LINE__, "%d files under OUT, want 5 to 8", atoi(out));
}

/* tools/gpu-check.sh memcheck-summary reads a compute-sanitizer memcheck log as the sanitize stage
 * does: a leak, NCCL's own API error (its first frame past libcuda in libnccl: NCCL probing its
 * kernels, as seen on an H100) and an invalid read in an nmt kernel are told apart, and only the
 * last fails (exit 1); without it the log passes (exit 0). */
NMT_TEST(tools_gpu_check_memcheck_kinds) {
  static const char *nccl =
      "========= Program hit cudaErrorNoKernelImageForDevice (error 209) due to \"no kernel "
      "image is available for execution on the device\" on CUDA API call to "
      "cudaFuncGetAttributes.\n"
      "=========     Saved host backtrace up to driver entry point at error\n"
      "=========         Host Frame:  [0x4cb045] in libcuda.so.1\n"
      "=========         Host Frame:  [0x1babc0] in libnccl.so.2\n"
      "=========         Host Frame: nmt_comm_create_nccl_ranks [0x14ec60] in test_nmt\n"
      "========= \n";
  static const char *ours =
      "========= Program hit cudaErrorInvalidValue (error 1) due to \"invalid argument\" on CUDA "
      "API call to cudaMemcpyAsync.\n"
      "=========     Saved host backtrace up to driver entry point at error\n"
      "=========         Host Frame:  [0x4cb045] in libcuda.so.1\n"
      "=========         Host Frame: nmt_cuda_copy_d2h [0x1234] in test_nmt\n"
      "========= \n"
      "========= Invalid __global__ read of size 4 bytes\n"
      "=========     at xent_kernel+0x90 in xent.cu:42\n"
      "========= \n";
  static const char *leak =
      "========= Leaked 1,024 bytes at 0x7f0000000000\n"
      "=========     Saved host backtrace up to driver entry point at cudaMalloc time\n"
      "=========         Host Frame:  [0x4cb045] in libcuda.so.1\n"
      "========= \n"
      "========= LEAK SUMMARY: 1024 bytes leaked in 1 allocations\n"
      "========= ERROR SUMMARY: 4 errors\n";
  const char *dir = nmt_test_tmpdir();
  NMT_ASSERT(dir != NULL);
  char path[1100], cmd[1400], out[4096];
  for (int with_ours = 0; with_ours < 2; with_ours++) {
    snprintf(path, sizeof path, "%s/memcheck%d.log", dir, with_ours);
    FILE *f = fopen(path, "w");
    NMT_ASSERT(f != NULL);
    fprintf(f, "========= COMPUTE-SANITIZER\nok 1 - cuda_x\n%s%s%s", nccl,
            with_ours ? ours : "", leak);
    NMT_ASSERT(fclose(f) == 0);
    snprintf(cmd, sizeof cmd, "tools/gpu-check.sh memcheck-summary '%s' 2>&1", path);
    const int rc = nmt_th_capture(cmd, out, sizeof out);
    char want[160];
    snprintf(want, sizeof want, "memcheck errors (not leaks, not NCCL's own): %d; leaks: 1",
             with_ours ? 2 : 0);
    if (rc != with_ours || !strstr(out, want) || !strstr(out, "NCCL-internal API errors: 1;"))
      nmt_test_fail(__FILE__, __LINE__, "%s: exit %d, want %d and \"%s\": %s", path, rc,
                    with_ours, want, out);
  }
}

/* tools/cuda-libs.sh, the one library search of tools/gpu-check.sh and bench/gpu-compare.sh,
 * finds a library in a CUDA 13 pip wheel's layout (site-packages/nvidia/cu13/lib, here on
 * PYTHONPATH), ahead of the bounded find over /, and puts that folder on LD_LIBRARY_PATH; a
 * library that is nowhere is reported NOT FOUND after at most FIND_SECONDS. */
NMT_TEST(tools_cuda_libs_find_the_cu13_wheel) {
  const char *dir = nmt_test_tmpdir();
  NMT_ASSERT(dir != NULL);
  char cmd[4096], out[4096], want[1200];
  snprintf(cmd, sizeof cmd,
           "mkdir -p '%s/site/nvidia/cu13/lib' && touch '%s/site/nvidia/cu13/lib/libnmtfake.so.7'",
           dir, dir);
  NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 0);
  snprintf(cmd, sizeof cmd,
           "PYTHONPATH='%s/site' CUDA_HOME=/nonexistent FIND_SECONDS=2 bash -c '"
           ". tools/cuda-libs.sh; nmt_find_lib libnmtfake.so.7; nmt_find_lib libnmtnowhere.so.1;"
           " echo end' 2>&1",
           dir);
  NMT_ASSERT_EQ_INT(nmt_th_capture(cmd, out, sizeof out), 0);
  snprintf(want, sizeof want, "%s/site/nvidia/cu13/lib pip\nend\n", dir);
  if (strcmp(out, want) != 0)
    nmt_test_fail(__FILE__, __LINE__, "got \"%s\", want \"%s\"", out, want);
}
