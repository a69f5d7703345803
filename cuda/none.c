/* cuda/none.c — linked instead of the cuda/ objects in a CPU-only build (make CUDA=0, or no nvcc):
 * the CUDA backend is absent, so parallel.device = cuda fails with NMT_ERR_DEVICE and
 * device = auto picks the CPU. */
#include "nmt/backend.h"

const nmt_backend *nmt_backend_cuda_get(void) { return 0; }
