/* test_fuzz_corpus.c — replays every committed fuzz input through the same harnesses `make
 * fuzz` runs (test/fuzz/): the seed corpora, and test/fuzz/regress/, where each input that
 * once crashed a reader or broke a property is kept after the fix. Under `make test-asan` this
 * is the sanitized regression run. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/fuzz.h"
#include "helpers.h"
#include "test.h"

typedef int (*harness_fn)(const uint8_t *, size_t);

/* Runs fn on every file of dir; returns the number of inputs run, -1 on a failed one. */
static long replay(const char *dir, harness_fn fn, int required) {
  DIR *d = opendir(dir);
  if (!d) {
    if (required) nmt_test_fail(__FILE__, __LINE__, "cannot open %s", dir);
    return required ? -1 : 0;
  }
  long n = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    size_t len;
    char *data = nmt_th_read_file(p, &len);
    if (!data) continue;
    int r = fn((const uint8_t *)data, len);
    free(data);
    if (r != 0) {
      closedir(d);
      nmt_test_fail(__FILE__, __LINE__, "%s: harness property broken (see the line above)", p);
      return -1;
    }
    n++;
  }
  closedir(d);
  return n;
}

static void run_target(const char *name, harness_fn fn) {
  char dir[256];
  snprintf(dir, sizeof dir, "test/fuzz/corpus/%s", name);
  long seeds = replay(dir, fn, 1);
  if (seeds < 0) return;
  snprintf(dir, sizeof dir, "test/fuzz/regress/%s", name);
  long regress = replay(dir, fn, 0);
  if (regress < 0) return;
  printf("# fuzz_%s: %ld seeds, %ld regression inputs\n", name, seeds, regress);
  NMT_ASSERT(seeds > 0);
}

NMT_TEST(fuzz_corpus_ini) { run_target("ini", nmt_fuzz_ini); }
NMT_TEST(fuzz_corpus_shard) { run_target("shard", nmt_fuzz_shard); }
NMT_TEST(fuzz_corpus_ckpt) { run_target("ckpt", nmt_fuzz_ckpt); }
