/* ref/memory.c — the reference backend's memory: malloc/free/memset_zero, copy_d2d, the blocking copies
 * and synchronize (plain host memory), host_alloc and the two h2d staging slots, and the d2h
 * read-back slots, all of which complete at once on the calling thread. Between a stream_fork
 * and its join the main-stream operations are refused (context.c's nmt__ref_main_stream_only),
 * as on a GPU. cuda/memory.cu is the CUDA counterpart. */
#include <stdlib.h>
#include <string.h>

#include "nmt/ref.h"

nmt_status nmt_ref_malloc(void *ctx, size_t bytes, void **out) {
  (void)ctx;
  /* 64-byte alignment keeps rows SIMD- and cache-line-aligned; 0 bytes still gives a pointer. */
  size_t rounded = (bytes + 63) / 64 * 64;
  void *p = NULL;
  if (rounded == 0) rounded = 64;
  if (rounded < bytes || posix_memalign(&p, 64, rounded) != 0)
    return nmt_errorf(NMT_ERR_NOMEM, "ref backend: cannot allocate %zu bytes of host memory",
                      bytes);
  *out = p;
  return NMT_OK;
}

void nmt_ref_free(void *ctx, void *p) {
  (void)ctx;
  free(p);
}

nmt_status nmt_ref_memset_zero(void *ctx, void *p, size_t bytes) {
  NMT_TRY(nmt__ref_main_stream_only(ctx, "memset_zero"));
  if (bytes) memset(p, 0, bytes);
  return NMT_OK;
}

nmt_status nmt_ref_copy_d2d(void *ctx, void *dst, const void *src, size_t bytes) {
  NMT_TRY(nmt__ref_main_stream_only(ctx, "copy_d2d"));
  if (bytes && dst != src) memmove(dst, src, bytes);
  return NMT_OK;
}

nmt_status nmt_ref_copy_h2d(void *ctx, void *dst, const void *src, size_t bytes) {
  NMT_TRY(nmt__ref_main_stream_only(ctx, "copy_h2d"));
  if (bytes && dst != src) memmove(dst, src, bytes);
  return NMT_OK;
}

nmt_status nmt_ref_copy_d2h(void *ctx, void *dst, const void *src, size_t bytes) {
  NMT_TRY(nmt__ref_main_stream_only(ctx, "copy_d2h"));
  if (bytes && dst != src) memmove(dst, src, bytes);
  return NMT_OK;
}

nmt_status nmt_ref_synchronize(void *ctx) {
  NMT_TRY(nmt__ref_main_stream_only(ctx, "synchronize"));
  return NMT_OK;
}

/* ---- batch staging: host memory and a copy that completes at once ---- */

static nmt_status check_slot(const char *op, int slot) {
  if (slot != 0 && slot != 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: staging slot %d is not 0 or 1", op, slot);
  return NMT_OK;
}

nmt_status nmt_ref_host_alloc(void *ctx, size_t bytes, void **out) {
  (void)ctx;
  *out = NULL;
  void *p = malloc(bytes ? bytes : 1);
  if (!p)
    return nmt_errorf(NMT_ERR_NOMEM, "ref backend: cannot allocate %zu bytes of staging memory",
                      bytes);
  *out = p;
  return NMT_OK;
}

void nmt_ref_host_free(void *ctx, void *p) {
  (void)ctx;
  free(p);
}

nmt_status nmt_ref_h2d_async(void *ctx, int slot, void *dst, const void *src, size_t bytes) {
  NMT_TRY(check_slot("h2d_async", slot));
  NMT_TRY(nmt__ref_main_stream_only(ctx, "h2d_async"));
  if (bytes && dst != src) memmove(dst, src, bytes);
  return NMT_OK;
}

nmt_status nmt_ref_h2d_acquire(void *ctx, int slot) {
  NMT_TRY(check_slot("h2d_acquire", slot));
  return nmt__ref_main_stream_only(ctx, "h2d_acquire");
}

nmt_status nmt_ref_h2d_release(void *ctx, int slot) {
  NMT_TRY(check_slot("h2d_release", slot));
  return nmt__ref_main_stream_only(ctx, "h2d_release");
}

nmt_status nmt_ref_h2d_wait_src(void *ctx, int slot) {
  (void)ctx;
  return check_slot("h2d_wait_src", slot);
}

/* ---- asynchronous reads back: the copy completes at once ---- */

static nmt_status check_d2h_slot(const char *op, int slot) {
  if (slot < 0 || slot >= NMT_D2H_SLOTS)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: read-back slot %d is outside [0, %d)", op, slot,
                      (int)NMT_D2H_SLOTS);
  return NMT_OK;
}

nmt_status nmt_ref_d2h_async(void *ctx, int slot, void *host, const void *dev, size_t bytes) {
  NMT_TRY(check_d2h_slot("d2h_async", slot));
  NMT_TRY(nmt__ref_main_stream_only(ctx, "d2h_async"));
  if (bytes && host != dev) memmove(host, dev, bytes);
  return NMT_OK;
}

nmt_status nmt_ref_d2h_wait(void *ctx, int slot) {
  NMT_TRY(check_d2h_slot("d2h_wait", slot));
  return nmt__ref_main_stream_only(ctx, "d2h_wait");
}

/* ---- the comm stream's copies (the host-staged communicator): at once, like every op ---- */

nmt_status nmt_ref_comm_d2h(void *ctx, void *host, const void *dev, size_t bytes) {
  NMT_TRY(nmt__ref_main_stream_only(ctx, "comm_d2h"));
  if (bytes && host != dev) memmove(host, dev, bytes);
  return NMT_OK;
}

nmt_status nmt_ref_comm_h2d(void *ctx, void *dev, const void *host, size_t bytes) {
  NMT_TRY(nmt__ref_main_stream_only(ctx, "comm_h2d"));
  if (bytes && host != dev) memmove(dev, host, bytes);
  return NMT_OK;
}

nmt_status nmt_ref_comm_wait(void *ctx) { return nmt__ref_main_stream_only(ctx, "comm_wait"); }

nmt_status nmt_ref_comm_join(void *ctx) { return nmt__ref_main_stream_only(ctx, "comm_join"); }
