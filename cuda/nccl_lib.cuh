/* cuda/nccl_lib.cuh — NCCL loaded on demand (internal to cuda/nccl*.cu).
 *
 * nmt is not linked against libnccl: a one-GPU run (the host communicator) must start where
 * libnccl.so.2 is absent, which a DT_NEEDED entry would forbid (issue 15). nccl.h is still
 * used at compile time, for the types and, through decltype, for the exact prototype of every
 * function the NCCL communicator calls; cuda/nccl_lib.cu dlopen()s libnccl.so.2 the first time
 * a communicator of several GPUs (or a multi-node one, or its unique id) is asked for, and
 * fills one table of function pointers with dlsym(). The search is dlopen's: LD_LIBRARY_PATH,
 * the executable's or libnmt.so's RUNPATH (the toolkit's lib64, from the Makefile), the
 * ld.so cache, /lib and /usr/lib.
 *
 * The table is process-wide state, written once under std::call_once and only read after: it
 * describes the process's one copy of the library, as the dynamic linker's own tables would
 * had nmt been linked against it.
 *
 * defines: nmt__nccl_api, nmt__nccl_open, NMT_NCCL_SONAME, NMT_NCCL_MIN_VERSION
 */
#ifndef NMT_CUDA_NCCL_LIB_CUH
#define NMT_CUDA_NCCL_LIB_CUH

#include <nccl.h>

#include "nmt/status.h"

/* The library's soname: NCCL 2.x keeps its ABI within the major version. */
#define NMT_NCCL_SONAME "libnccl.so.2"
/* 2.14: nonblocking communicators (ncclConfig_t, ncclCommInitRankConfig with blocking = 0:
 * the abortable multi-process creation in nccl.cu) and ncclCommFinalize (the teardown); also
 * newer than ncclGetLastError (2.13) and ncclBfloat16 (2.10). Checked against ncclGetVersion
 * at load. A library without one of the table's functions is refused by dlsym first. */
#define NMT_NCCL_MIN_VERSION 21400

/* One pointer per NCCL function nmt calls, typed by nccl.h's own prototypes. */
struct nmt__nccl_api {
  decltype(&ncclGetVersion) GetVersion;
  decltype(&ncclGetErrorString) GetErrorString;
  decltype(&ncclGetLastError) GetLastError;
  decltype(&ncclGetUniqueId) GetUniqueId;
  decltype(&ncclCommInitAll) CommInitAll;
  decltype(&ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&ncclCommFinalize) CommFinalize;
  decltype(&ncclCommDestroy) CommDestroy;
  decltype(&ncclCommAbort) CommAbort;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&ncclGroupStart) GroupStart;
  decltype(&ncclGroupEnd) GroupEnd;
  decltype(&ncclAllReduce) AllReduce;
  decltype(&ncclBroadcast) Broadcast;
  decltype(&ncclReduceScatter) ReduceScatter;
  decltype(&ncclAllGather) AllGather;
  int version;     /* ncclGetVersion: major * 10000 + minor * 100 + patch */
  char path[512];  /* the file dlopen found (dladdr), for the log */
};

/* The process's NCCL, loaded on the first call (thread-safe; later calls return the same
 * table or the same error). Also sets NCCL_RUNTIME_CONNECT=0 before NCCL can read its
 * environment, unless the environment already sets it (see nmt_comm_create_nccl in
 * nmt/comm.h). `what` names what needed NCCL, for the message ("a communicator over 2 GPUs").
 * Errors: NMT_ERR_DEVICE naming NMT_NCCL_SONAME and dlerror()'s text when the library cannot
 * be opened, a function is missing (dlsym), or its version is below NMT_NCCL_MIN_VERSION. */
nmt_status nmt__nccl_open(const char *what, const nmt__nccl_api **api);

#endif /* NMT_CUDA_NCCL_LIB_CUH */
