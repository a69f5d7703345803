/* cuda/nccl_lib.cu — libnccl.so.2 opened with dlopen on first use (see cuda/nccl_lib.cuh).
 *
 * Why not link it: a DT_NEEDED entry makes the dynamic linker refuse to start nmt at all where
 * the library is missing, although a one-GPU run never calls NCCL (its communicator is the
 * host one). Loading on demand moves the failure to the one place that needs NCCL, with a
 * message that says what was asked for and how to provide the library.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>

#include "../src/comm/comm_impl.h"
#include "nccl_lib.cuh"
#include "nmt/log.h"

namespace {

/* dlerror() after a failed dl* call, never NULL. */
const char *dl_text() {
  const char *e = dlerror();
  return e ? e : "(no dlerror text)";
}

/* Opens soname and fills *api; on failure records a message (NMT_ERR_DEVICE) and closes what
 * it opened. *handle gets the dlopen handle on success. */
nmt_status load(const char *soname, nmt__nccl_api *api, void **handle) {
  memset(api, 0, sizeof *api);
  *handle = NULL;
  (void)dlerror(); /* clear a stale message */
  void *h = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
  if (!h)
    return nmt_errorf(NMT_ERR_DEVICE,
                      "cannot load the NCCL library %s (dlopen: %s); it is needed for more than "
                      "one GPU: install NCCL >= 2.14 (e.g. the nvidia-nccl-cu13 wheel or the "
                      "libnccl2 package) and put its folder on LD_LIBRARY_PATH, or train on one "
                      "GPU (parallel.devices = 1)",
                      soname, dl_text());
  struct sym {
    const char *name;
    void **slot;
  };
  const sym syms[] = {
      {"ncclGetVersion", (void **)&api->GetVersion},
      {"ncclGetErrorString", (void **)&api->GetErrorString},
      {"ncclGetLastError", (void **)&api->GetLastError},
      {"ncclGetUniqueId", (void **)&api->GetUniqueId},
      {"ncclCommInitAll", (void **)&api->CommInitAll},
      {"ncclCommInitRankConfig", (void **)&api->CommInitRankConfig},
      {"ncclCommFinalize", (void **)&api->CommFinalize},
      {"ncclCommDestroy", (void **)&api->CommDestroy},
      {"ncclCommAbort", (void **)&api->CommAbort},
      {"ncclCommGetAsyncError", (void **)&api->CommGetAsyncError},
      {"ncclGroupStart", (void **)&api->GroupStart},
      {"ncclGroupEnd", (void **)&api->GroupEnd},
      {"ncclAllReduce", (void **)&api->AllReduce},
      {"ncclBroadcast", (void **)&api->Broadcast},
      {"ncclReduceScatter", (void **)&api->ReduceScatter},
      {"ncclAllGather", (void **)&api->AllGather},
  };
  nmt_status s = NMT_OK;
  for (const sym &y : syms) {
    (void)dlerror();
    *y.slot = dlsym(h, y.name);
    if (!*y.slot) {
      s = nmt_errorf(NMT_ERR_DEVICE,
                     "the NCCL library %s lacks %s (dlsym: %s); nmt needs NCCL >= 2.14 "
                     "(nonblocking communicators, ncclCommFinalize): install a newer NCCL",
                     soname, y.name, dl_text());
      break;
    }
  }
  if (s == NMT_OK) {
    ncclResult_t e = api->GetVersion(&api->version);
    if (e != ncclSuccess)
      s = nmt_errorf(NMT_ERR_DEVICE, "ncclGetVersion from %s: NCCL error %d (%s)", soname, (int)e,
                     api->GetErrorString(e));
    else if (api->version < NMT_NCCL_MIN_VERSION)
      s = nmt_errorf(NMT_ERR_DEVICE, "the NCCL library %s is version %d, older than %d (2.14, "
                     "which brought nonblocking communicators (ncclConfig_t.blocking = 0, "
                     "needed for a creation that a timeout or an abort can end) and "
                     "ncclCommFinalize); install a newer NCCL", soname, api->version,
                     NMT_NCCL_MIN_VERSION);
  }
  if (s != NMT_OK) {
    dlclose(h);
    memset(api, 0, sizeof *api);
    return s;
  }
  Dl_info info;
  snprintf(api->path, sizeof api->path, "%s",
           dladdr((void *)api->GetVersion, &info) && info.dli_fname ? info.dli_fname : soname);
  *handle = h;
  return NMT_OK;
}

/* The process's copy: written once inside call_once, read-only afterwards. The handle is
 * never closed (NCCL keeps threads and atexit work of its own). */
struct process_nccl {
  std::once_flag once;
  nmt__nccl_api api;
  nmt_status status;
  char error[1024];
};

process_nccl &the_nccl() {
  static process_nccl p;
  return p;
}

} // namespace

nmt_status nmt__nccl_open(const char *what, const nmt__nccl_api **api) {
  process_nccl &p = the_nccl();
  std::call_once(p.once, [&p] {
    /* Before NCCL's first call (it reads its parameters once, at initialisation); 0 keeps a
     * value the user set. Why: nmt_comm_create_nccl in nmt/comm.h. */
    if (setenv("NCCL_RUNTIME_CONNECT", "0", 0) != 0)
      nmt_log(NMT_LOG_WARN, "cannot set NCCL_RUNTIME_CONNECT=0: NCCL may connect lazily, and a "
                            "peer that dies before the first large collective can hang its "
                            "peers");
    void *handle = NULL;
    p.status = load(NMT_NCCL_SONAME, &p.api, &handle);
    if (p.status != NMT_OK) {
      snprintf(p.error, sizeof p.error, "%s", nmt_last_error());
      return;
    }
    nmt_log(NMT_LOG_INFO, "NCCL %d loaded from %s", p.api.version, p.api.path);
  });
  *api = p.status == NMT_OK ? &p.api : NULL;
  if (p.status != NMT_OK) return nmt_errorf(p.status, "%s: %s", what, p.error);
  return NMT_OK;
}

nmt_status nmt__nccl_probe(const char *soname, int *version) {
  nmt__nccl_api api;
  void *handle = NULL;
  *version = 0;
  NMT_TRY(load(soname, &api, &handle));
  *version = api.version;
  dlclose(handle);
  return NMT_OK;
}
