/* test/fuzz/fuzz.h — libFuzzer harnesses for the readers of untrusted files: the INI config
 * loader, the shard reader (and the batcher on top of it) and the checkpoint reader.
 *
 * Each harness is a plain function, nmt_fuzz_<name>(data, size), returning 0, or non-zero
 * when a property the code promises is broken (a crash is found by the sanitizers). Built with
 * -DNMT_FUZZ_MAIN (make fuzz, clang -fsanitize=fuzzer) it also defines LLVMFuzzerTestOneInput,
 * which traps on non-zero; the test suite links the same functions and replays the committed
 * seed corpora and every regression input (test/test_fuzz_corpus.c).
 *
 * The readers take paths, so the input goes into a memfd and is read as /proc/self/fd/N (no
 * disk traffic, one file per process).
 *
 * defines: nmt_fuzz_ini, nmt_fuzz_shard, nmt_fuzz_ckpt
 */
#ifndef NMT_TEST_FUZZ_H
#define NMT_TEST_FUZZ_H

#include <stddef.h>
#include <stdint.h>

int nmt_fuzz_ini(const uint8_t *data, size_t size);
int nmt_fuzz_shard(const uint8_t *data, size_t size);
int nmt_fuzz_ckpt(const uint8_t *data, size_t size);

#endif /* NMT_TEST_FUZZ_H */
