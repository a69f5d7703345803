/* nmt/device.h — which backend a command runs on, and one device context opened for it.
 *
 * One meaning of parallel.device for every command (train, eval, translate, the benches):
 *   cpu  = the fp32 CPU reference backend (src/ref/);
 *   cuda = the CUDA backend, which must be built in and see every device the command uses
 *          (rank r uses the r-th entry of a parallel.devices list, else device r);
 *   auto = cuda when it is built in and sees them all, else cpu, said once at info level
 *          ("no CUDA device: training on 2 CPU workers").
 * Opening a device for a rank is the same everywhere: the context on that device, its
 * precision, the aux stream pool of parallel.aux_streams (parallel.qkv = streams forks onto
 * it), and the run's abort flag, which every host wait of the context polls.
 * Precision: training runs in precision.mode on either backend (the reference emulates
 * fp16/bf16 GEMMs, which is how mixed precision is tested without a GPU); inference on the
 * reference runs in fp32 (the emulation is slower than fp32 and no more useful there).
 *
 * defines: nmt_device_use, nmt_device, nmt_device_select, nmt_device_open, nmt_device_close,
 *          nmt_device_host, nmt_device_versions, nmt_cuda_versions,
 *          nmt_device_comm_create, nmt_device_comm_create_world
 */
#ifndef NMT_DEVICE_H
#define NMT_DEVICE_H

#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  NMT_DEVICE_TRAIN = 0, /* training (and its benches): precision.mode on every backend */
  NMT_DEVICE_INFER = 1  /* translate / eval: fp32 on the CPU reference */
} nmt_device_use;

/* One rank's device: the backend table and its context. */
typedef struct {
  const nmt_backend *be;
  void *ctx;
  int index;               /* the device index the context was created on */
  nmt_precision precision; /* the precision the context computes in */
} nmt_device;

/* The backend for a command that uses ranks 0..n_ranks-1, as described above. Logs once at
 * info level when auto falls back to the CPU. Errors: NMT_ERR_DEVICE (device = cuda without a
 * CUDA build, without a visible GPU, or with a device index not visible; the message names
 * [parallel] device / devices), NMT_ERR_CONFIG (n_ranks < 1). */
nmt_status nmt_device_select(const nmt_config *cfg, int n_ranks, nmt_device_use use,
                             const nmt_backend **out);

/* How many decoders a command that infers (translate) runs: parallel.devices (at least 1),
 * except that with parallel.device = cuda or auto, no explicit device list and fewer visible
 * CUDA devices than that, one per visible device (logged as a warning): a training config for
 * 8 GPUs translates on the GPUs of a 1-GPU machine, not on the CPU, and not into "device
 * index 7 is not visible". Never fails: a failed device count leaves parallel.devices, for
 * nmt_device_select to judge. */
int nmt_device_infer_ranks(const nmt_config *cfg);

/* Opens rank `rank`'s device on backend `be` (NULL: nmt_device_select for rank 0 alone, as
 * translate and eval use one device): context, precision, aux stream pool, abort flag (may be
 * NULL). On an error nothing stays open and out->ctx is NULL. Errors: nmt_device_select's,
 * the backend's context errors (NMT_ERR_DEVICE, NMT_ERR_NOMEM). */
nmt_status nmt_device_open(const nmt_config *cfg, const nmt_backend *be, int rank,
                           nmt_device_use use, atomic_int *abort, nmt_device *out);

/* Waits for and frees the context; a zeroed or already closed device is a no-op. */
void nmt_device_close(nmt_device *d);

/* The communicator group of a run's n ranks in this process (rank r = worker r, on device
 * devices[r] with context ctxs[r]), the one place parallel.comm is read:
 *   auto, nccl: the backend's own (be->comm_create: CPU workers and one GPU the host
 *     communicator, several GPUs NCCL, which refuses a GPU listed twice);
 *   host: the host-staged communicator (nmt_comm_create_staged over be and ctxs) for n > 1,
 *     on CPU workers too (the same staging code with plain copies, which is how CPU tests cover
 *     it); one rank never reduces, so n == 1 takes be->comm_create.
 * Call it on the main thread once every rank's context exists, before any worker starts.
 * Errors: NMT_ERR_CONFIG for comm = nccl on a host backend (CPU workers) or a repeated device
 * index without comm = host (the message says NCCL refuses it), the communicators' errors. */
nmt_status nmt_device_comm_create(const nmt_config *cfg, const nmt_backend *be, int n,
                                  const int *devices, void *const *ctxs, atomic_int *abort,
                                  nmt_comm **comms);

/* The communicator group of a run spread over several processes (parallel.nodes; the same
 * with nodes = 1 and a rendezvous, alone): this process's n_local ranks, global ranks
 * first_rank .. first_rank + n_local - 1 of `world`, meeting in the rendezvous directory under
 * `prefix`. CPU workers (a host backend): a Gloo group (nmt_comm_create_gloo; interface
 * parallel.iface). GPUs: NCCL across processes: global rank 0's process makes the
 * ncclUniqueId and publishes it in the store, every process reads it and creates its GPUs'
 * ranks in one group (nmt_comm_create_nccl_ranks). Every wait is bounded by timeout_s.
 * parallel.comm = host is refused here (the host-staged group lives in one process).
 * Errors: NMT_ERR_ABORTED (a peer did not arrive in time; the message names it),
 * NMT_ERR_CONFIG (a stale rendezvous directory, a bad interface, parallel.comm = host), the
 * communicators'. */
nmt_status nmt_device_comm_create_world(const nmt_config *cfg, const nmt_backend *be,
                                        const char *rendezvous, const char *prefix,
                                        double timeout_s, int n_local, int first_rank, int world,
                                        const int *devices, void *const *ctxs, atomic_int *abort,
                                        nmt_comm **comms);

/* The host backend (the CPU reference): for code that means host memory whatever
 * parallel.device says, such as a model of the host communicator. */
const nmt_backend *nmt_device_host(void);

/* The device libraries this binary was built against, for `nmt --version`: "CUDA runtime 13.0
 * (static), NCCL 2.28.9 (loaded 2.28.9), cuBLASLt 13.1.0 (loaded 13.1.0)", or "none (built
 * without CUDA)". Needs no device. */
void nmt_device_versions(char *out, size_t cap);
/* Its CUDA half, in cuda/version.cu (cuda/none.c in a CPU-only build). */
void nmt_cuda_versions(char *out, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* NMT_DEVICE_H */
