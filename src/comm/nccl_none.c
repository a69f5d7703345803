/* nccl_none.c — the NCCL communicator in a CPU-only build (make CUDA=0, or no nvcc): there is no
 * NCCL to create a group with, so nmt_comm_create_nccl, nmt_comm_create_nccl_ranks and
 * nmt_comm_nccl_unique_id fail with a message that says why. In a CUDA build
 * cuda/nccl_create.cu defines them and this file compiles to nothing (the Makefile defines
 * NMT_CUDA there). */
#ifndef NMT_CUDA
#include "nmt/comm.h"

static const char why[] = "built without CUDA/NCCL (make CUDA=0 or no nvcc); use the host "
                          "communicator (parallel.device = cpu)";

nmt_status nmt_comm_create_nccl(int n, const int *devices, void *const *cuda_ctxs,
                                atomic_int *abort, nmt_comm **comms) {
  (void)devices, (void)cuda_ctxs, (void)abort;
  for (int r = 0; comms && r < n; r++) comms[r] = NULL;
  return nmt_errorf(NMT_ERR_DEVICE, "NCCL communicator over %d GPU(s): %s", n, why);
}

nmt_status nmt_comm_nccl_unique_id(void *out, size_t cap) {
  (void)out, (void)cap;
  return nmt_errorf(NMT_ERR_DEVICE, "NCCL unique id: %s", why);
}

nmt_status nmt_comm_create_nccl_ranks(int n_local, const int *devices, void *const *cuda_ctxs,
                                      int world, int first_rank, const void *unique_id,
                                      double timeout_s, atomic_int *abort, nmt_comm **comms) {
  (void)devices, (void)cuda_ctxs, (void)unique_id, (void)timeout_s, (void)abort;
  for (int r = 0; comms && r < n_local; r++) comms[r] = NULL;
  return nmt_errorf(NMT_ERR_DEVICE, "NCCL communicator over %d GPU(s) as global ranks %d..%d "
                    "of %d: %s", n_local, first_rank, first_rank + n_local - 1, world, why);
}

#else
/* ISO C wants at least one declaration in a translation unit. */
typedef int nmt__nccl_none_unused;
#endif
