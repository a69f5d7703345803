/* test/fuzz/fuzz_common.h — included once per harness file: the memfd helper (static, so that
 * the three harnesses link together into the test binary) and the libFuzzer entry point. */
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

#include "nmt/log.h"

/* Replaces the contents of this harness's memfd `slot` (0..3) with data and writes its
 * /proc/self/fd path to path (64 bytes). Returns 0, or -1 if the memfd cannot be made. */
static int fuzz_memfile(int slot, const void *data, size_t size, char *path) {
  static int fds[4] = {-1, -1, -1, -1};
  if (slot < 0 || slot > 3) return -1;
  if (fds[slot] < 0) {
    fds[slot] = memfd_create("nmt-fuzz", MFD_CLOEXEC);
    if (fds[slot] < 0) return -1;
  }
  int fd = fds[slot];
  if (ftruncate(fd, 0) != 0) return -1;
  size_t done = 0;
  while (done < size) {
    ssize_t k = pwrite(fd, (const char *)data + done, size - done, (off_t)done);
    if (k <= 0) return -1;
    done += (size_t)k;
  }
  snprintf(path, 64, "/proc/self/fd/%d", fd);
  return 0;
}

#ifdef NMT_FUZZ_MAIN
int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  nmt_log_set_level((nmt_log_level)-1); /* rejections are the normal case: keep them quiet */
  return 0;
}
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (FUZZ_ENTRY(data, size) != 0) __builtin_trap();
  return 0;
}
#endif
