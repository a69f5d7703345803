/* nccl_none.c — the NCCL communicator in a CPU-only build (make CUDA=0, or no nvcc): there is no
 * NCCL to create a group with, so nmt_comm_create_nccl fails with a message that says why. In a
 * CUDA build cuda/nccl.cu defines it and this file compiles to nothing (the Makefile defines
 * NMT_CUDA there). */
#ifndef NMT_CUDA
#include "nmt/comm.h"

nmt_status nmt_comm_create_nccl(int n, const int *devices, void *const *cuda_ctxs,
                                atomic_int *abort, nmt_comm **comms) {
  (void)devices, (void)cuda_ctxs, (void)abort;
  for (int r = 0; comms && r < n; r++) comms[r] = NULL;
  return nmt_errorf(NMT_ERR_DEVICE,
                    "NCCL communicator over %d GPU(s): built without CUDA/NCCL (make CUDA=0 or "
                    "no nvcc); use the host communicator (parallel.device = cpu)",
                    n);
}
#else
/* ISO C wants at least one declaration in a translation unit. */
typedef int nmt__nccl_none_unused;
#endif
