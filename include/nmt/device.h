/* nmt/device.h — the device an inference command (translate, eval) runs on.
 *
 * Training has its own per-worker selection (src/engine/trainer.c); translation and evaluation
 * use one device: [parallel] device = cuda (or auto with a GPU visible) gives the CUDA backend
 * on the first device parallel.devices names (its first list entry, else device 0) in
 * precision.mode; otherwise the CPU reference in fp32 (its fp16/bf16 are an emulation for
 * parity tests, slower than fp32 and no more useful for inference).
 *
 * defines: nmt_infer_device_open, nmt_infer_device_close
 */
#ifndef NMT_DEVICE_H
#define NMT_DEVICE_H

#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* *be and *ctx for inference as described above; close with nmt_infer_device_close.
 * Errors: NMT_ERR_DEVICE (device = cuda without a CUDA build or visible GPU, or the device
 * index not visible), the backend's context errors. */
nmt_status nmt_infer_device_open(const nmt_config *cfg, const nmt_backend **be, void **ctx);
/* Waits for and frees the context (NULL: no-op). */
void nmt_infer_device_close(const nmt_backend *be, void *ctx);

#ifdef __cplusplus
}
#endif
#endif /* NMT_DEVICE_H */
