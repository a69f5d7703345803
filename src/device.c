/* device.c — the one selection of parallel.device and the one way a rank's device is opened
 * (include/nmt/device.h), for train, eval, translate and the benches. */
#include "nmt/device.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nmt/comm.h"
#include "nmt/log.h"
#include "nmt/rendezvous.h"

char *openblas_get_config(void);

/* How many threads may be inside OpenBLAS at once. Its allocator (driver/others/memory.c)
 * keeps NUM_BUFFERS = max(50, 2 * MAX_CPU_NUMBER) buffer slots, one per calling thread for
 * the duration of a call; past that it prints "precompiled NUM_THREADS exceeded", adds a
 * racily managed auxiliary array and, later, crashes (issue 19: a segfault in sgemm_itcopy
 * with 257 and more CPU workers on Debian's 0.3.21, whose openblas_get_config() says
 * "MAX_THREADS=64"). Each CPU worker is a thread calling BLAS with one BLAS thread of its
 * own, so this bounds the CPU workers. *max_threads gets MAX_CPU_NUMBER (0 when the config
 * string has none; the bound is then 50, the allocator's floor). */
static int blas_max_callers(long *max_threads) {
  const char *c = openblas_get_config();
  const char *m = c ? strstr(c, "MAX_THREADS=") : NULL;
  long t = m ? strtol(m + 12, NULL, 10) : 0;
  *max_threads = t > 0 && t < (1 << 20) ? t : 0;
  return *max_threads > 25 ? (int)(2 * *max_threads) : 50;
}

/* CPU workers: at most blas_max_callers(), and a warning when they time-slice on far fewer
 * cores (every step waits for the slowest worker). */
static nmt_status check_cpu_workers(const nmt_config *cfg, int n_ranks) {
  long max_threads;
  const int limit = blas_max_callers(&max_threads);
  if (n_ranks > limit)
    return nmt_errorf(NMT_ERR_CONFIG,
                      "[parallel] devices = %d CPU workers: the limit is %d. Each CPU worker is "
                      "a thread calling OpenBLAS, whose buffers serve at most %d threads in a "
                      "call at once (2 x its MAX_THREADS = %ld; past that it crashes); use at "
                      "most %d workers, and train.accum_steps for a larger batch",
                      n_ranks, limit, limit, max_threads, limit);
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (cores > 0 && n_ranks > 4 * cores)
    nmt_log(NMT_LOG_WARN,
            "[parallel] devices = %d CPU workers on %ld cores: they time-slice and each step "
            "waits for the slowest; parallel.devices = %ld with train.accum_steps = %d gives "
            "the same batch faster", n_ranks, cores, cores,
            (int)((n_ranks + cores - 1) / cores) * cfg->train_accum_steps);
  return NMT_OK;
}

/* The device index rank r runs on: the r-th entry of a parallel.devices list, else r. */
static int device_index(const nmt_config *cfg, int rank) {
  return cfg->parallel_device_ids_n ? cfg->parallel_device_ids[rank] : rank;
}

nmt_status nmt_device_select(const nmt_config *cfg, int n_ranks, nmt_device_use use,
                             const nmt_backend **out) {
  *out = &nmt_backend_ref;
  if (n_ranks < 1) return nmt_errorf(NMT_ERR_CONFIG, "[parallel] devices = %d", n_ranks);
  if (cfg->parallel_device == NMT_DEVICE_CPU) return check_cpu_workers(cfg, n_ranks);
  const nmt_backend *cuda = nmt_backend_cuda_get();
  int n = 0, need = 0;
  for (int r = 0; r < n_ranks; r++)
    if (device_index(cfg, r) + 1 > need) need = device_index(cfg, r) + 1;
  if (cuda) NMT_TRY(cuda->device_count(&n));
  if (cuda && n >= need) {
    *out = cuda;
    return NMT_OK;
  }
  if (cfg->parallel_device == NMT_DEVICE_AUTO) {
    char why[128];
    if (!cuda) snprintf(why, sizeof why, "no CUDA device (this build has no CUDA backend)");
    else if (n == 0) snprintf(why, sizeof why, "no CUDA device");
    else snprintf(why, sizeof why, "%d CUDA device(s) do not cover device index %d", n, need - 1);
    /* A list names GPUs: CPU workers in their place would be a silent change of device. */
    if (cfg->parallel_device_ids_n > 0) {
      char list[NMT_MAX_DEVICE_IDS * 6];
      nmt_config_devices_str(cfg, list, sizeof list);
      return nmt_errorf(NMT_ERR_CONFIG, "[parallel] devices = \"%s\" is a list of CUDA device "
                        "indices, but device = auto found %s and would run CPU workers, which "
                        "have none; write devices = %d for %d CPU workers", list, why,
                        cfg->parallel_device_ids_n, cfg->parallel_device_ids_n);
    }
    if (use == NMT_DEVICE_TRAIN)
      nmt_log(NMT_LOG_WARN, "[parallel] device = auto: %s: training on %d CPU worker(s) "
              "instead (set parallel.device = cpu to say so, or = cuda to refuse)", why,
              n_ranks);
    else
      nmt_log(NMT_LOG_INFO, "[parallel] device = auto: %s: running on the CPU in fp32", why);
    return check_cpu_workers(cfg, n_ranks);
  }
  if (!cuda)
    return nmt_errorf(NMT_ERR_DEVICE, "[parallel] device = cuda: this build has no CUDA backend "
                                      "(built with CUDA=0 or without nvcc); use device = cpu");
  if (n < 1)
    return nmt_errorf(NMT_ERR_DEVICE, "[parallel] device = cuda: no CUDA device is visible (no "
                                      "GPU, no driver, or CUDA_VISIBLE_DEVICES hides them)");
  return nmt_errorf(NMT_ERR_DEVICE, "[parallel] devices: device index %d is not visible (%d "
                    "CUDA device(s); CUDA_VISIBLE_DEVICES renumbers them from 0)", need - 1, n);
}

int nmt_device_infer_ranks(const nmt_config *cfg) {
  const int n = cfg->parallel_devices > 0 ? cfg->parallel_devices : 1;
  if (cfg->parallel_device == NMT_DEVICE_CPU || cfg->parallel_device_ids_n) return n;
  const nmt_backend *cuda = nmt_backend_cuda_get();
  int vis = 0;
  if (!cuda || cuda->device_count(&vis) != NMT_OK || vis < 1 || vis >= n) return n;
  nmt_log(NMT_LOG_WARN, "[parallel] devices = %d: %d CUDA device(s) visible: decoding on %d "
          "decoder(s), one per device (a parallel.devices list names the devices to use)", n,
          vis, vis);
  return vis;
}

nmt_status nmt_device_open(const nmt_config *cfg, const nmt_backend *be, int rank,
                           nmt_device_use use, atomic_int *abort, nmt_device *out) {
  *out = (nmt_device){0};
  if (!be) NMT_TRY(nmt_device_select(cfg, 1, use, &be));
  nmt_device d = {.be = be, .index = device_index(cfg, rank)};
  d.precision = use == NMT_DEVICE_INFER && be->is_host ? NMT_PRECISION_FP32 : cfg->precision_mode;
  NMT_TRY(be->ctx_create(d.index, &d.ctx));
  nmt_status s = be->set_precision(d.ctx, d.precision);
  /* parallel.aux_streams: the pool parallel.qkv = streams forks onto. */
  if (s == NMT_OK) s = be->stream_pool(d.ctx, cfg->parallel_aux_streams);
  /* Host waits on this device poll the run's abort flag instead of blocking forever. */
  if (s == NMT_OK && abort) s = be->set_abort(d.ctx, abort);
  if (s != NMT_OK) {
    nmt_device_close(&d);
    return s;
  }
  *out = d;
  return NMT_OK;
}

void nmt_device_close(nmt_device *d) {
  if (d->ctx && d->be && d->be->ctx_destroy) d->be->ctx_destroy(d->ctx);
  d->ctx = NULL;
}

const nmt_backend *nmt_device_host(void) { return &nmt_backend_ref; }

void nmt_device_versions(char *out, size_t cap) { nmt_cuda_versions(out, cap); }

nmt_status nmt_device_comm_create(const nmt_config *cfg, const nmt_backend *be, int n,
                                  const int *devices, void *const *ctxs, atomic_int *abort,
                                  nmt_comm **comms) {
  if (cfg->parallel_comm == NMT_COMM_NCCL && be->is_host)
    return nmt_errorf(NMT_ERR_CONFIG, "[parallel] comm = nccl: the workers run on the %s "
                      "backend (CPU), which NCCL cannot reduce; use comm = auto or host",
                      be->name);
  for (int r = 0; devices && cfg->parallel_comm != NMT_COMM_HOST && !be->is_host && r < n; r++)
    for (int q = 0; q < r; q++)
      if (devices[q] == devices[r])
        return nmt_errorf(NMT_ERR_CONFIG, "[parallel] devices: ranks %d and %d are both on GPU "
                          "%d: NCCL refuses two ranks on one GPU (\"Duplicate GPU "
                          "detected\"); set [parallel] comm = host for several workers on one "
                          "GPU", q, r, devices[r]);
  if (cfg->parallel_comm == NMT_COMM_HOST && n > 1)
    return nmt_comm_create_staged(n, be, ctxs, abort, comms);
  return be->comm_create(n, devices, ctxs, abort, comms);
}

/* GPUs across processes: the ncclUniqueId through the store, then this process's ranks. */
static nmt_status nccl_world(const char *rendezvous, const char *prefix, double timeout_s,
                             int n_local, int first_rank, int world, const int *devices,
                             void *const *ctxs, atomic_int *abort, nmt_comm **comms) {
  unsigned char id[NMT_COMM_NCCL_ID_BYTES];
  nmt_rendezvous *rv;
  NMT_TRY(nmt_rendezvous_open(rendezvous, prefix, timeout_s, &rv));
  nmt_rendezvous_watch(rv, abort);
  nmt_status s;
  if (first_rank == 0) {
    s = nmt_comm_nccl_unique_id(id, sizeof id);
    if (s == NMT_OK) s = nmt_rendezvous_set(rv, "nccl-id", id, sizeof id);
  } else {
    size_t len = 0;
    s = nmt_rendezvous_get(rv, "nccl-id", id, sizeof id, &len);
    if (s == NMT_OK && len != sizeof id)
      s = nmt_errorf(NMT_ERR_CONFIG, "rendezvous %s: the NCCL id has %zu bytes, not %zu",
                     rendezvous, len, sizeof id);
  }
  nmt_rendezvous_close(rv);
  NMT_TRY(s);
  /* parallel.timeout_s also bounds NCCL's nonblocking init and warm-up (nmt/comm.h). */
  return nmt_comm_create_nccl_ranks(n_local, devices, ctxs, world, first_rank, id, timeout_s,
                                    abort, comms);
}

nmt_status nmt_device_comm_create_world(const nmt_config *cfg, const nmt_backend *be,
                                        const char *rendezvous, const char *prefix,
                                        double timeout_s, int n_local, int first_rank, int world,
                                        const int *devices, void *const *ctxs, atomic_int *abort,
                                        nmt_comm **comms) {
  if (cfg->parallel_comm == NMT_COMM_HOST)
    return nmt_errorf(NMT_ERR_CONFIG, "[parallel] comm = host with several processes "
                      "(parallel.nodes or a rendezvous): the host-staged communicator reduces "
                      "in one process's memory; use comm = auto (NCCL or Gloo across nodes)");
  if (!be->is_host)
    return nccl_world(rendezvous, prefix, timeout_s, n_local, first_rank, world, devices, ctxs,
                      abort, comms);
  int *ranks = malloc((size_t)n_local * sizeof *ranks);
  if (!ranks) return nmt_errorf(NMT_ERR_NOMEM, "gloo: %d ranks", n_local);
  for (int i = 0; i < n_local; i++) ranks[i] = first_rank + i;
  /* The communicator adds its own "/gloo" to the prefix (nmt/comm.h). */
  nmt_gloo_options o = {.size = sizeof o, .rendezvous = rendezvous, .prefix = prefix,
                        .iface = cfg->parallel_iface, .hostname = NULL, .timeout_s = timeout_s};
  nmt_status s = nmt_comm_create_gloo(&o, n_local, ranks, world, abort, comms);
  free(ranks);
  return s;
}
