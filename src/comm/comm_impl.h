/* comm_impl.h — what a communicator implementation provides (internal to src/comm/).
 *
 * nmt_comm is one rank's handle: a pointer to a table of operations plus rank and size. An
 * implementation embeds `struct nmt_comm` as the FIRST member of its own per-rank struct and
 * casts back inside its ops (the host one in host.c; the NCCL one in cuda/nccl.cu wraps an
 * ncclComm_t the same way). comm.c holds the public nmt_comm_* functions, which only dispatch
 * through `ops`, so callers never know which implementation they talk to.
 *
 * defines: nmt_comm_ops, struct nmt_comm, nmt__nccl_probe
 */
#ifndef NMT_COMM_IMPL_H
#define NMT_COMM_IMPL_H

#include "nmt/comm.h"

typedef struct nmt_comm_ops {
  const char *name; /* "host", "nccl", "host-staged", "gloo": nmt_comm_name, logs */
  nmt_status (*allreduce_sum)(nmt_comm *c, float *buf, size_t count);
  /* nmt_comm_allreduce_sum_as for wire = NMT_GRAD_FP16 or NMT_GRAD_BF16 only (comm.c sends
   * fp32 to allreduce_sum) and count <= the rank's wire_reserved (comm.c checks). NULL: the
   * implementation has no half wire, and comm.c says so. */
  nmt_status (*allreduce_sum_as)(nmt_comm *c, float *buf, size_t count, nmt_grad_dtype wire);
  /* nmt_comm_reserve: make room for max_count half elements (only called to grow); NULL when
   * the implementation needs no memory for it. */
  nmt_status (*reserve)(nmt_comm *c, size_t max_count);
  nmt_status (*allreduce_max)(nmt_comm *c, float *buf, size_t count);
  /* nmt_comm_reduce_scatter_sum_as (wire fp32, fp16 or bf16; a half wire only with count <=
   * wire_reserved, which comm.c checks) and nmt_comm_all_gather (dtype = the element type:
   * fp32, or 16-bit storage moved as is). NULL: not implemented yet, and comm.c says so. */
  nmt_status (*reduce_scatter_sum_as)(nmt_comm *c, float *buf, size_t count, nmt_grad_dtype wire);
  nmt_status (*all_gather)(nmt_comm *c, void *buf, size_t count, nmt_grad_dtype dtype);
  nmt_status (*broadcast)(nmt_comm *c, float *buf, size_t count, int root);
  nmt_status (*barrier)(nmt_comm *c);
  /* nmt_comm_reserve_staging: make room for max_bytes of staged buffers between two flushes
   * (only called to grow); NULL when the implementation stages nothing. */
  nmt_status (*reserve_staging)(nmt_comm *c, size_t max_bytes);
  /* nmt_comm_flush: later device work sees every earlier collective's result. */
  nmt_status (*flush)(nmt_comm *c);
  void (*abort)(nmt_comm *c);
  /* Frees the whole group given all n handles (called once, after every rank stopped). */
  void (*destroy)(nmt_comm **comms, int n);
} nmt_comm_ops;

struct nmt_comm {
  const nmt_comm_ops *ops;
  int rank, size;
  size_t wire_reserved; /* nmt_comm_reserve's largest max_count; 0 at creation */
  size_t staging_reserved; /* nmt_comm_reserve_staging's largest max_bytes; 0 at creation */
};

#ifdef __cplusplus
extern "C" {
#endif

/* CUDA builds only (cuda/nccl_lib.cu; there is no definition in a CPU-only build): dlopen()s
 * `soname`, resolves every NCCL function the NCCL communicator calls, reads the library's
 * version into *version (major * 10000 + minor * 100 + patch) and closes it again, leaving the
 * process's own NCCL alone. It needs no GPU: the tests check the loader's messages with it.
 * Errors: NMT_ERR_DEVICE naming soname with dlerror()'s text (missing library or function), or
 * a version below 2.14. */
nmt_status nmt__nccl_probe(const char *soname, int *version);

#ifdef __cplusplus
}
#endif

#endif /* NMT_COMM_IMPL_H */
