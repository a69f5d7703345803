/* test_gloo.c — the rendezvous store (nmt/rendezvous.h):
 *  - store: set/get, prefixes, write-once keys, timeouts and aborts naming the key, a value
 *    published by another process;
 * A child process publishes through the store; the parent waits for it with a watchdog. */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"
#include "nmt/rendezvous.h"
#include "test.h"

#define CHILD_WATCHDOG_S 20.0

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ---------------------------------------------------------------- rendezvous store ---- */

NMT_TEST(gloo_store_set_get) {
  const char *dir = nmt_test_tmpdir();
  char path[600];
  snprintf(path, sizeof path, "%s/rv/sub", dir); /* parents are created */
  nmt_rendezvous *a = NULL, *b = NULL, *other = NULL;
  NMT_ASSERT_OK(nmt_rendezvous_open(path, "run1", 0.3, &a));
  NMT_ASSERT_OK(nmt_rendezvous_open(path, "run1", 0.3, &b));
  NMT_ASSERT_OK(nmt_rendezvous_open(path, "run2", 0.3, &other));
  const char v[] = "config-hash 1234";
  NMT_ASSERT_OK(nmt_rendezvous_set(a, "node0/config", v, sizeof v));
  char buf[64];
  size_t len = 0;
  NMT_ASSERT_OK(nmt_rendezvous_get(b, "node0/config", buf, sizeof buf, &len));
  NMT_ASSERT_EQ_INT(len, sizeof v);
  NMT_ASSERT(memcmp(buf, v, sizeof v) == 0);
  /* Too small a buffer: the length comes back for a retry. */
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_get(b, "node0/config", buf, 4, &len), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_INT(len, sizeof v);
  /* Write-once, and the message says why it matters. */
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_set(b, "node0/config", v, sizeof v), NMT_ERR_CONFIG);
  NMT_ASSERT(strstr(nmt_last_error(), "'node0/config'") != NULL);
  NMT_ASSERT(strstr(nmt_last_error(), "already set") != NULL);
  /* Another prefix is another namespace: its wait times out, naming key, prefix and time. */
  double t0 = nmt_th_now();
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_get(other, "node0/config", buf, sizeof buf, &len),
                       NMT_ERR_ABORTED);
  double waited = nmt_th_now() - t0;
  NMT_ASSERT(strstr(nmt_last_error(), "key 'node0/config' not set within 0.3 s") != NULL);
  NMT_ASSERT(strstr(nmt_last_error(), "prefix 'run2'") != NULL);
  NMT_ASSERT(waited >= 0.29);
  /* A raised abort flag ends a wait that would otherwise last the whole timeout. */
  atomic_int flag = 1;
  nmt_rendezvous_watch(other, &flag);
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_get(other, "never", buf, sizeof buf, &len),
                       NMT_ERR_ABORTED);
  NMT_ASSERT(strstr(nmt_last_error(), "aborted while waiting for key 'never'") != NULL);
  /* Argument errors. */
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_set(a, "", v, 1), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_set(a, "empty", v, 0), NMT_ERR_INTERNAL);
  nmt_rendezvous_close(a);
  nmt_rendezvous_close(b);
  nmt_rendezvous_close(other);
}

NMT_TEST(gloo_store_open_errors) {
  nmt_rendezvous *rv = (nmt_rendezvous *)1;
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_open("", "p", 1, &rv), NMT_ERR_CONFIG);
  NMT_ASSERT(rv == NULL);
  NMT_ASSERT(strstr(nmt_last_error(), "parallel.rendezvous") != NULL);
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_open(nmt_test_tmpdir(), "p", 0, &rv), NMT_ERR_CONFIG);
  NMT_ASSERT(strstr(nmt_last_error(), "parallel.timeout_s") != NULL);
  char file[600];
  snprintf(file, sizeof file, "%s/plain-file", nmt_test_tmpdir());
  FILE *f = fopen(file, "w");
  NMT_ASSERT(f != NULL);
  fclose(f);
  NMT_ASSERT_EQ_STATUS(nmt_rendezvous_open(file, "p", 1, &rv), NMT_ERR_IO);
  NMT_ASSERT(strstr(nmt_last_error(), "not a directory") != NULL);
}

/* A value published by another process, after the reader started waiting. */
NMT_TEST(gloo_store_across_processes) {
  const char *dir = nmt_test_tmpdir();
  fflush(stdout);
  pid_t pid = fork();
  NMT_ASSERT(pid >= 0);
  if (pid == 0) {
    nmt_rendezvous *w = NULL;
    sleep_ms(200);
    int ok = nmt_rendezvous_open(dir, "x", 5, &w) == NMT_OK &&
             nmt_rendezvous_set(w, "nccl_id", "0123456789abcdef", 16) == NMT_OK;
    nmt_rendezvous_close(w);
    _exit(ok ? 0 : 1);
  }
  nmt_rendezvous *r = NULL;
  NMT_ASSERT_OK(nmt_rendezvous_open(dir, "x", 10, &r));
  char buf[32];
  size_t len = 0;
  nmt_status st = nmt_rendezvous_get(r, "nccl_id", buf, sizeof buf, &len);
  nmt_rendezvous_close(r);
  NMT_ASSERT_EQ_INT(nmt_th_wait(pid, CHILD_WATCHDOG_S, NULL), 0);
  NMT_ASSERT_OK(st);
  NMT_ASSERT_EQ_INT(len, 16);
  NMT_ASSERT(memcmp(buf, "0123456789abcdef", 16) == 0);
}

