/* cuda/version.cu — the CUDA libraries this binary was built against, for `nmt --version`
 * (through nmt_device_versions, src/device.c): compile-time macros of the toolkit's headers,
 * and the versions of the shared libraries loaded now where they are linked dynamically
 * (cuBLASLt, NCCL), which the rpath may resolve to another toolkit than the one built with.
 * Needs no GPU and no driver. cuda/none.c stands in for a CPU-only build. */
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdio.h>

#include "nccl_lib.cuh"
#include "nmt/device.h"

void nmt_cuda_versions(char *out, size_t cap) {
  /* NCCL is loaded on demand (cuda/nccl_lib.cu): where libnccl.so.2 is absent, "0.0.0". */
  int nccl_loaded = 0;
  const nmt__nccl_api *api = NULL;
  if (nmt__nccl_open("nmt --version", &api) == NMT_OK) nccl_loaded = api->version;
  else nmt_clear_error();
  const size_t lt = cublasLtGetVersion(); /* major * 10000 + minor * 100 + patch */
  /* NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch since NCCL 2.9. */
  snprintf(out, cap,
           "CUDA runtime %d.%d (static), NCCL %d.%d.%d (loaded %d.%d.%d), cuBLASLt %d.%d.%d "
           "(loaded %zu.%zu.%zu)",
           CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH,
           nccl_loaded / 10000, nccl_loaded / 100 % 100, nccl_loaded % 100, CUBLAS_VER_MAJOR,
           CUBLAS_VER_MINOR, CUBLAS_VER_PATCH, lt / 10000, lt / 100 % 100, lt % 100);
}
