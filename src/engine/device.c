/* device.c — the one device of translate / eval (include/nmt/device.h). */
#include "nmt/device.h"

#include "nmt/log.h"

nmt_status nmt_infer_device_open(const nmt_config *cfg, const nmt_backend **be, void **ctx) {
  *be = &nmt_backend_ref;
  *ctx = NULL;
  const nmt_backend *cuda = nmt_backend_cuda_get();
  int n = 0, dev = cfg->parallel_device_ids_n ? cfg->parallel_device_ids[0] : 0;
  if (cfg->parallel_device != NMT_DEVICE_CPU && cuda) NMT_TRY(cuda->device_count(&n));
  if (cfg->parallel_device == NMT_DEVICE_CUDA) {
    if (!cuda)
      return nmt_errorf(NMT_ERR_DEVICE, "[parallel] device = cuda: this build has no CUDA "
                                        "backend (built with CUDA=0 or without nvcc)");
    if (dev >= n)
      return nmt_errorf(NMT_ERR_DEVICE, "[parallel] device = cuda: device %d is not visible (%d "
                                        "CUDA device(s))", dev, n);
  }
  nmt_precision prec = NMT_PRECISION_FP32;
  if (cfg->parallel_device != NMT_DEVICE_CPU && cuda && dev < n) {
    *be = cuda;
    prec = cfg->precision_mode;
  }
  NMT_TRY((*be)->ctx_create(dev, ctx));
  nmt_status s = (*be)->set_precision(*ctx, prec);
  /* parallel.qkv = streams forks the model's self-attention projections onto this pool. */
  if (s == NMT_OK) s = (*be)->stream_pool(*ctx, cfg->parallel_aux_streams);
  if (s != NMT_OK) {
    nmt_infer_device_close(*be, *ctx);
    *ctx = NULL;
    return s;
  }
  return NMT_OK;
}

void nmt_infer_device_close(const nmt_backend *be, void *ctx) {
  if (ctx && be && be->ctx_destroy) be->ctx_destroy(ctx);
}
