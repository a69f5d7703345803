/* nmt/nvtx.h — NVTX ranges and thread names for Nsight Systems, or nothing.
 *
 * NVTX v3 is header-only: a push/pop costs a branch on a function pointer until Nsight injects
 * its library into the process, so the ranges can stay in release builds. They are compiled in
 * when NMT_NVTX is defined (the Makefile defines it, with -isystem $(CUDA_HOME)/include, in
 * builds with CUDA; the binary then needs -ldl, which those builds link); otherwise every call
 * below compiles to nothing and no CUDA header is included. The runtime switch
 * ([profile] nvtx) is the caller's `on` argument: src/util/prof.c passes it, and the rest of
 * the code emits ranges through the profiler (include/nmt/prof.h), not through this header.
 *
 * defines: NMT_NVTX_ENABLED, nmt_nvtx_push, nmt_nvtx_pop, nmt_nvtx_name_thread
 */
#ifndef NMT_NVTX_H
#define NMT_NVTX_H

#ifdef NMT_NVTX
#include <nvtx3/nvToolsExt.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
#define NMT_NVTX_ENABLED 1
#else
#define NMT_NVTX_ENABLED 0
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Opens a range named `name` (NUL-terminated ASCII, copied by NVTX) on the calling thread. */
static inline void nmt_nvtx_push(int on, const char *name) {
#ifdef NMT_NVTX
  if (on) nvtxRangePushA(name);
#else
  (void)on, (void)name;
#endif
}

/* Closes the calling thread's innermost open range. */
static inline void nmt_nvtx_pop(int on) {
#ifdef NMT_NVTX
  if (on) nvtxRangePop();
#else
  (void)on;
#endif
}

/* Names the calling OS thread in the Nsight timeline (nvtxNameOsThreadA wants the kernel's
 * thread id, gettid(2), not a pthread_t). */
static inline void nmt_nvtx_name_thread(int on, const char *name) {
#ifdef NMT_NVTX
  if (on) nvtxNameOsThreadA((uint32_t)syscall(SYS_gettid), name);
#else
  (void)on, (void)name;
#endif
}

#ifdef __cplusplus
}
#endif
#endif /* NMT_NVTX_H */
