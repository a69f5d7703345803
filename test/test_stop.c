/* test_stop.c — the second stop signal of `nmt train` (README "Exit codes": 8): it ends the run
 * at once, even while every CPU worker is inside a step of many seconds, and the last message
 * says the user stopped the run, not that a worker or peer failed.
 *
 * The model is made big for a CPU (d_model 512, d_ff 4096, 4096 padded tokens a batch, two
 * workers): one step is hundreds of GFLOP per worker, tens of seconds on one core, so a run
 * that waited for the step to end would blow the bound below by far. Both signals arrive
 * while the first step runs (the log has no "step 1/" line when the second one is sent). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cblas.h>

#include "helpers.h"
#include "nmt/ref.h"
#include "test.h"

/* Seconds from the second signal to the process's exit: the GEMM in flight (nmt/ref.h
 * set_abort) and the teardown, with room for a loaded machine. A step here takes far longer. */
#define STOP_BOUND_S 15.0

static int file_has(const char *path, const char *text) {
  char *s = nmt_th_read_file(path, NULL);
  int found = s && strstr(s, text);
  free(s);
  return found;
}

/* Starts a big-model run, sends sig once training has started, then again once the first was
 * taken; checks the exit (code 8, within STOP_BOUND_S) and the messages. */
static void second_signal_ends_step(int sig, const char *name) {
  char ini[600], run[600], shard[600], log[600];
  const char *dir = nmt_test_tmpdir();
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(ini, sizeof ini, "%s/big.ini", dir);
  snprintf(run, sizeof run, "%s/big", dir);
  snprintf(log, sizeof log, "%s/big.log", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 4000, 11));
  NMT_ASSERT(nmt_th_write_ini(ini, run, shard, 1000,
                              "[model]\nd_model = 512\nd_ff = 4096\nn_heads = 8\n"
                              "[data]\nmax_tokens = 4096\n[parallel]\nbucket_mb = 25\n") == 0);
  const char *argv[] = {"train", ini, NULL};
  pid_t pid = nmt_th_spawn(argv, log, NULL);
  NMT_ASSERT(pid > 0);
  NMT_ASSERT(nmt_th_wait_for(log, "training ", pid, 120));
  kill(pid, sig);
  char taken[32];
  snprintf(taken, sizeof taken, "signal %d", sig);
  /* Signals do not queue: the second is sent once the first was taken. */
  NMT_ASSERT(nmt_th_wait_for(log, taken, pid, 60));
  const int mid_step = !file_has(log, "step 1/");
  double t0 = nmt_th_now();
  kill(pid, sig);
  double dt = 0;
  int code = nmt_th_wait(pid, STOP_BOUND_S, &dt);
  dt = nmt_th_now() - t0;
  printf("# second %s: exit %d after %.3f s (bound %.0f s; mid-step: %d)\n", name, code, dt,
         STOP_BOUND_S, mid_step);
  NMT_ASSERT(mid_step); /* otherwise the step was not long and the bound proves nothing */
  NMT_ASSERT_EQ_INT(code, 8);
  char second[64];
  snprintf(second, sizeof second, "second %s", name);
  NMT_ASSERT(file_has(log, second));
  NMT_ASSERT(file_has(log, "stopped by the user"));
  /* No rank failed, no peer failed: nothing may say so. */
  NMT_ASSERT(!file_has(log, "failed on"));
  NMT_ASSERT(!file_has(log, "peer"));
  NMT_ASSERT(file_has(log, "nmt: aborted (exit 8)"));
}

NMT_TEST(stop_second_sigint_ends_long_step) { second_signal_ends_step(SIGINT, "SIGINT"); }

/* A scheduler's (or a user's `kill`) second SIGTERM too. */
NMT_TEST(stop_second_sigterm_ends_long_step) { second_signal_ends_step(SIGTERM, "SIGTERM"); }

/* Every GEMM op of the ref backend looks at the run's abort flag first (nmt/ref.h set_abort):
 * before it is raised, one call computes what one sgemm computes, bitwise (the GEMM is not
 * split to look more often); after, the forward and both backward GEMMs return
 * NMT_ERR_ABORTED without touching their outputs. */
NMT_TEST(stop_gemm_sees_the_abort_flag) {
  enum { M = 1024, K = 512, N = 640 }; /* bigger than any GEMM of make run's model per row */
  float *x = malloc(sizeof(float) * M * K), *w = malloc(sizeof(float) * N * K),
        *y = malloc(sizeof(float) * M * N), *want = malloc(sizeof(float) * M * N),
        *dw = calloc((size_t)N * K, sizeof(float)), *dx = calloc((size_t)M * K, sizeof(float));
  NMT_ASSERT(x && w && y && want && dw && dx);
  unsigned r = 1;
  for (size_t i = 0; i < (size_t)M * K + (size_t)N * K; i++) {
    r = r * 1664525u + 1013904223u;
    const float v = (float)(r >> 8) / 16777216.0f - 0.5f;
    if (i < (size_t)M * K) x[i] = v;
    else w[i - (size_t)M * K] = v;
  }
  void *ctx = NULL;
  NMT_ASSERT_OK(nmt_ref_ctx_create(0, &ctx));
  atomic_int abort_flag;
  atomic_init(&abort_flag, 0);
  NMT_ASSERT_OK(nmt_ref_ctx_set_abort(ctx, &abort_flag));
  NMT_ASSERT_OK(nmt_ref_matmul_fwd(ctx, y, x, w, NULL, M, K, N));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, K, w, K, 0.0f, want, N);
  long wrong = 0;
  for (size_t i = 0; i < (size_t)M * N; i++) wrong += memcmp(&y[i], &want[i], sizeof y[i]) != 0;
  printf("# %ld elements differ from one sgemm call\n", wrong);
  atomic_store(&abort_flag, 1);
  memset(y, 0, sizeof(float) * M * N);
  const nmt_status f = nmt_ref_matmul_fwd(ctx, y, x, w, NULL, M, K, N);
  const nmt_status b = nmt_ref_matmul_bwd(ctx, dx, dw, NULL, want, x, w, M, K, N);
  long touched = 0;
  for (size_t i = 0; i < (size_t)M * N; i++) touched += y[i] != 0.0f;
  for (size_t i = 0; i < (size_t)N * K; i++) touched += dw[i] != 0.0f;
  for (size_t i = 0; i < (size_t)M * K; i++) touched += dx[i] != 0.0f;
  nmt_ref_ctx_destroy(ctx);
  free(x), free(w), free(y), free(want), free(dw), free(dx);
  NMT_ASSERT_EQ_INT(wrong, 0);
  NMT_ASSERT_EQ_STATUS(f, NMT_ERR_ABORTED);
  NMT_ASSERT_EQ_STATUS(b, NMT_ERR_ABORTED);
  NMT_ASSERT_EQ_INT(touched, 0);
}
