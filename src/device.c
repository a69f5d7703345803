/* device.c — the one selection of parallel.device and the one way a rank's device is opened
 * (include/nmt/device.h), for train, eval, translate and the benches. */
#include "nmt/device.h"

#include "nmt/log.h"

/* The device index rank r runs on: the r-th entry of a parallel.devices list, else r. */
static int device_index(const nmt_config *cfg, int rank) {
  return cfg->parallel_device_ids_n ? cfg->parallel_device_ids[rank] : rank;
}

nmt_status nmt_device_select(const nmt_config *cfg, int n_ranks, nmt_device_use use,
                             const nmt_backend **out) {
  *out = &nmt_backend_ref;
  if (n_ranks < 1) return nmt_errorf(NMT_ERR_CONFIG, "[parallel] devices = %d", n_ranks);
  if (cfg->parallel_device == NMT_DEVICE_CPU) return NMT_OK;
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
    if (use == NMT_DEVICE_TRAIN)
      nmt_log(NMT_LOG_INFO, "[parallel] device = auto: %s: training on %d CPU worker(s)", why,
              n_ranks);
    else
      nmt_log(NMT_LOG_INFO, "[parallel] device = auto: %s: running on the CPU in fp32", why);
    return NMT_OK;
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
