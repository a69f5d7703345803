/* test/fuzz/link_main.c — a plain main for the libFuzzer harnesses, so that `make test` links
 * each fuzz target from the same source list as `make fuzz` (Makefile FUZZ_SRCS_*) with the
 * regular compiler and no libFuzzer: a source missing from a list fails `make test` here, not
 * only CI's fuzz stage, which needs clang. It runs the harness once on each file named on the
 * command line (none: one empty input), as libFuzzer replays a crash input. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int main(int argc, char **argv) {
  LLVMFuzzerInitialize(&argc, &argv);
  if (argc < 2) return LLVMFuzzerTestOneInput((const uint8_t *)"", 0);
  for (int i = 1; i < argc; i++) {
    FILE *f = fopen(argv[i], "rb");
    if (!f) {
      fprintf(stderr, "%s: cannot open %s\n", argv[0], argv[i]);
      return 2;
    }
    uint8_t *buf = NULL;
    size_t n = 0, cap = 0, k;
    do {
      if (n == cap) {
        cap = cap ? 2 * cap : 4096;
        uint8_t *nb = realloc(buf, cap);
        if (!nb) {
          free(buf);
          fclose(f);
          return 2;
        }
        buf = nb;
      }
      k = fread(buf + n, 1, cap - n, f);
      n += k;
    } while (k > 0);
    fclose(f);
    LLVMFuzzerTestOneInput(buf, n);
    free(buf);
  }
  return 0;
}
