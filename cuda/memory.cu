/* cuda/memory.cu — the CUDA backend's memory: malloc/free/memset_zero, copy_d2d, the blocking copies and
 * synchronize (device memory, the compute stream), batch staging (pinned host memory, the copy
 * stream and the two slots' events) and the asynchronous reads back (d2h_async / d2h_wait), as
 * src/ref/memory.c. Each memset and copy it enqueues counts as one launch
 * (nmt__cuda_launched; nmt_backend_counters.launches). */
#include "common.cuh"

nmt_status nmt_cuda_malloc(void *ctx, size_t bytes, void **out) {
  NMT_TRY(nmt__cuda_enter(ctx, "malloc"));
  *out = NULL;
  /* 0 bytes still gives a distinct pointer, as on the reference backend. */
  cudaError_t e = cudaMalloc(out, bytes ? bytes : 256);
  if (e != cudaSuccess) {
    size_t free_b = 0, total_b = 0;
    (void)cudaGetLastError();
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) (void)cudaGetLastError();
    return nmt_errorf(e == cudaErrorMemoryAllocation ? NMT_ERR_NOMEM : NMT_ERR_DEVICE,
                      "cuda: cannot allocate %zu bytes of device memory on device %d: %s "
                      "(%.1f of %.1f GiB free)",
                      bytes, nmt__cuda_ctx(ctx)->device, cudaGetErrorString(e),
                      (double)free_b / 1073741824.0, (double)total_b / 1073741824.0);
  }
  return NMT_OK;
}

void nmt_cuda_free(void *ctx, void *p) {
  /* cudaFree waits for the device; a failure here has nowhere to go but the log. */
  if (p) {
    if (ctx) cudaSetDevice(nmt__cuda_ctx(ctx)->device);
    cudaError_t e = cudaFree(p);
    if (e != cudaSuccess) nmt__cuda_error(e, "cudaFree", __FILE__, __LINE__);
  }
}

nmt_status nmt_cuda_memset_zero(void *ctx, void *p, size_t bytes) {
  NMT_TRY(nmt__cuda_enter(ctx, "memset_zero"));
  NMT_TRY(nmt__cuda_main_only(nmt__cuda_ctx(ctx), "memset_zero"));
  if (bytes) {
    NMT_CUDA_TRY(cudaMemsetAsync(p, 0, bytes, nmt__cuda_ctx(ctx)->stream));
    nmt__cuda_launched(1);
  }
  return NMT_OK;
}

nmt_status nmt_cuda_copy_d2d(void *ctx, void *dst, const void *src, size_t bytes) {
  NMT_TRY(nmt__cuda_enter(ctx, "copy_d2d"));
  NMT_TRY(nmt__cuda_main_only(nmt__cuda_ctx(ctx), "copy_d2d"));
  if (bytes && dst != src) {
    NMT_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                 nmt__cuda_ctx(ctx)->stream));
    nmt__cuda_launched(1);
  }
  return NMT_OK;
}

/* The blocking copies take any host memory, and callers pass pageable memory (stack
 * variables, malloc'd vectors). Between device and pageable host memory cudaMemcpyAsync is
 * synchronous with respect to the host: device to pageable returns only once the copy has
 * completed, so once everything queued before it on the stream has run, and pageable to
 * device may wait for the stream to stage its data (CUDA Runtime API, "API synchronization
 * behavior", "Memcpy", "Asynchronous"). That wait happens inside the driver, where neither
 * the abort flag nor an NCCL group's wait hook is seen: behind a collective whose peer died
 * the thread would hang for good. So the stream is first drained by the polling,
 * abort-aware nmt__cuda_wait, and the copy then has nothing ahead of it to wait for: same
 * bytes, same stream order, and the only time spent in the driver is the copy itself. */

nmt_status nmt_cuda_copy_h2d(void *ctx, void *dst, const void *src, size_t bytes) {
  NMT_TRY(nmt__cuda_enter(ctx, "copy_h2d"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(nmt__cuda_main_only(c, "copy_h2d"));
  if (!bytes) return NMT_OK;
  NMT_TRY(nmt__cuda_wait(c, c->stream, "copy_h2d"));
  NMT_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream));
  nmt__cuda_launched(1);
  /* Waiting makes `src` reusable on return whether it is pageable or pinned. */
  return nmt__cuda_wait(c, c->stream, "copy_h2d");
}

nmt_status nmt_cuda_copy_d2h(void *ctx, void *dst, const void *src, size_t bytes) {
  NMT_TRY(nmt__cuda_enter(ctx, "copy_d2h"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(nmt__cuda_main_only(c, "copy_d2h"));
  if (bytes) {
    NMT_TRY(nmt__cuda_wait(c, c->stream, "copy_d2h"));
    NMT_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    nmt__cuda_launched(1);
  }
  /* After the data, as before: the error word's copy, waited for (polling). */
  return nmt__cuda_check_errors(c);
}

nmt_status nmt_cuda_synchronize(void *ctx) {
  NMT_TRY(nmt__cuda_enter(ctx, "synchronize"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(nmt__cuda_main_only(c, "synchronize"));
  /* "Every op issued so far" includes a staging copy nothing has acquired yet. The pool's
   * streams are idle or joined into the compute stream (no fork is open). */
  NMT_TRY(nmt__cuda_wait(c, c->copy_stream, "synchronize"));
  return nmt__cuda_check_errors(c);
}

/* ------------------------------------------------------------------------------------------ */
/* Batch staging: two slots, each a (copy, compute) hand-off ordered by two events.
 *
 *   copy   : wait freed[s] -> H2D(s) -> record ready[s]
 *   compute:                            wait ready[s] (acquire) -> ops reading dst -> record
 *            freed[s] (release)
 *
 * so the copy of micro-batch k+1 (slot 1) runs while compute works on k (slot 0), and the
 * copy of k+2 into slot 0 cannot overwrite what k still reads. */

static nmt_status check_slot(const char *op, int slot) {
  if (slot != 0 && slot != 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: staging slot %d is not 0 or 1", op, slot);
  return NMT_OK;
}

nmt_status nmt_cuda_host_alloc(void *ctx, size_t bytes, void **out) {
  NMT_TRY(nmt__cuda_enter(ctx, "host_alloc"));
  *out = NULL;
  /* Page-locked: the copy engine reads it directly, so cudaMemcpyAsync is truly asynchronous
   * (from pageable memory the driver stages through its own buffer, in the host's time). */
  cudaError_t e = cudaHostAlloc(out, bytes ? bytes : 1, cudaHostAllocDefault);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    *out = NULL;
    return nmt_errorf(NMT_ERR_NOMEM, "cuda: cannot allocate %zu bytes of pinned host memory: %s",
                      bytes, cudaGetErrorString(e));
  }
  return NMT_OK;
}

void nmt_cuda_host_free(void *ctx, void *p) {
  if (!p) return;
  if (ctx) cudaSetDevice(nmt__cuda_ctx(ctx)->device);
  cudaError_t e = cudaFreeHost(p);
  if (e != cudaSuccess) nmt__cuda_error(e, "cudaFreeHost", __FILE__, __LINE__);
}

/* NMT_ERR_INTERNAL unless `host` is page-locked memory (host_alloc, cudaMallocHost,
 * cudaHostRegister). Between device and pageable memory cudaMemcpyAsync may be synchronous with
 * the host (CUDA Runtime API, "API synchronization behavior"): a pageable read-back would wait
 * inside the driver behind the step's queued work, a flush's wait on NCCL included, where
 * neither the abort flag nor the wait hook is seen. One cudaPointerGetAttributes per call. */
static nmt_status require_pinned(const char *op, const void *host) {
  cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, host);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: cannot query host buffer %p: %s", op, host,
                      cudaGetErrorString(e));
  }
  if (a.type != cudaMemoryTypeHost)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda %s: host buffer %p is not page-locked (allocate it with host_alloc): "
                      "an asynchronous copy to or from pageable memory can wait inside the "
                      "driver, where an abort cannot end it",
                      op, host);
  return NMT_OK;
}

nmt_status nmt_cuda_h2d_async(void *ctx, int slot, void *dst, const void *src, size_t bytes) {
  NMT_TRY(nmt__cuda_enter(ctx, "h2d_async"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_slot("h2d_async", slot));
  NMT_TRY(nmt__cuda_main_only(c, "h2d_async"));
  if (bytes) NMT_TRY(require_pinned("h2d_async", src));
  NMT_CUDA_TRY(cudaStreamWaitEvent(c->copy_stream, c->ev_freed[slot], 0));
  if (bytes) {
    NMT_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->copy_stream));
    nmt__cuda_launched(1);
  }
  NMT_CUDA_TRY(cudaEventRecord(c->ev_ready[slot], c->copy_stream));
  return NMT_OK;
}

nmt_status nmt_cuda_h2d_acquire(void *ctx, int slot) {
  NMT_TRY(nmt__cuda_enter(ctx, "h2d_acquire"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_slot("h2d_acquire", slot));
  NMT_TRY(nmt__cuda_main_only(c, "h2d_acquire"));
  NMT_CUDA_TRY(cudaStreamWaitEvent(c->stream, c->ev_ready[slot], 0));
  return NMT_OK;
}

nmt_status nmt_cuda_h2d_release(void *ctx, int slot) {
  NMT_TRY(nmt__cuda_enter(ctx, "h2d_release"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_slot("h2d_release", slot));
  NMT_TRY(nmt__cuda_main_only(c, "h2d_release"));
  NMT_CUDA_TRY(cudaEventRecord(c->ev_freed[slot], c->stream));
  return NMT_OK;
}

nmt_status nmt_cuda_h2d_wait_src(void *ctx, int slot) {
  NMT_TRY(nmt__cuda_enter(ctx, "h2d_wait_src"));
  NMT_TRY(check_slot("h2d_wait_src", slot));
  /* ready[slot] follows the copy, which has then read all of src. */
  return nmt__cuda_wait_event(nmt__cuda_ctx(ctx), nmt__cuda_ctx(ctx)->ev_ready[slot],
                              "h2d_wait_src");
}

/* ------------------------------------------------------------------------------------------ */
/* Asynchronous reads back (docs/cuda.md "Step control"): the trainer copies step s's control
 * block into pinned memory behind step s's optimizer and reads it while step s+1 runs.
 *
 *   compute: ... step_control, adamw ─► D2H(host ◄ dev) ─► D2H(d2h_err[s] ◄ error word) ─►
 *            record ev_d2h[s]
 *   host   : d2h_wait(s) polls ev_d2h[s], then reads d2h_err[s]
 *
 * The error word travels with the data, so the fast path (no error) costs one event query and
 * no second wait; only an error takes the slow path through nmt__cuda_check_errors, which
 * writes the message and clears the word. */

static nmt_status check_d2h_slot(const char *op, int slot) {
  if (slot < 0 || slot >= NMT_D2H_SLOTS)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda %s: read-back slot %d outside [0, %d)", op, slot,
                      (int)NMT_D2H_SLOTS);
  return NMT_OK;
}

nmt_status nmt_cuda_d2h_async(void *ctx, int slot, void *host, const void *dev, size_t bytes) {
  NMT_TRY(nmt__cuda_enter(ctx, "d2h_async"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_d2h_slot("d2h_async", slot));
  NMT_TRY(nmt__cuda_main_only(c, "d2h_async"));
  if (bytes) NMT_TRY(require_pinned("d2h_async", host));
  if (bytes) {
    NMT_CUDA_TRY(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, c->stream));
    nmt__cuda_launched(1);
  }
  NMT_CUDA_TRY(cudaMemcpyAsync(&c->d2h_err[slot], c->d_err, sizeof(int), cudaMemcpyDeviceToHost,
                               c->stream));
  nmt__cuda_launched(1);
  NMT_CUDA_TRY(cudaEventRecord(c->ev_d2h[slot], c->stream));
  return NMT_OK;
}

nmt_status nmt_cuda_d2h_wait(void *ctx, int slot) {
  NMT_TRY(nmt__cuda_enter(ctx, "d2h_wait"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(check_d2h_slot("d2h_wait", slot));
  NMT_TRY(nmt__cuda_main_only(c, "d2h_wait"));
  NMT_TRY(nmt__cuda_wait_event(c, c->ev_d2h[slot], "d2h_wait"));
  if (!c->d2h_err[slot]) return NMT_OK;
  /* The slot's copy has landed, so nothing writes d2h_err[slot] until the next d2h_async. The
   * word may have been reported and cleared since (by a synchronize): then this is OK too. */
  c->d2h_err[slot] = 0;
  return nmt__cuda_check_errors(c);
}

/* ------------------------------------------------------------------------------------------ */
/* The comm stream's copies (the host-staged communicator, src/comm/staged.c). The same
 * ordering as the NCCL communicator's collectives (cuda/nccl.cu):
 *
 *   compute: ... bwd (bucket b final) ─record ev_compute─ bwd ... ─wait ev_comm─ adamw
 *   comm   :                          wait ev_compute ─ D2H(b) ─ ... [host reduces] H2D ─record ev_comm
 *
 * One event of each kind suffices: cudaStreamWaitEvent waits for the record that is the most
 * recent at the time of the call, and each record is consumed before the next. The host's
 * part happens in the worker's own thread at the flush (comm_wait, then the host collectives,
 * then comm_h2d and comm_join), never in a host callback of the stream: those run one at a
 * time on a driver thread, and one that waited for a peer rank would stall every other
 * worker's callbacks on the device. */

nmt_status nmt_cuda_comm_d2h(void *ctx, void *host, const void *dev, size_t bytes) {
  NMT_TRY(nmt__cuda_enter(ctx, "comm_d2h"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(nmt__cuda_main_only(c, "comm_d2h"));
  if (!bytes) return NMT_OK;
  NMT_TRY(require_pinned("comm_d2h", host));
  NMT_CUDA_TRY(cudaEventRecord(c->ev_compute, c->stream));
  NMT_CUDA_TRY(cudaStreamWaitEvent(c->comm_stream, c->ev_compute, 0));
  NMT_CUDA_TRY(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, c->comm_stream));
  nmt__cuda_launched(1);
  return NMT_OK;
}

nmt_status nmt_cuda_comm_h2d(void *ctx, void *dev, const void *host, size_t bytes) {
  NMT_TRY(nmt__cuda_enter(ctx, "comm_h2d"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(nmt__cuda_main_only(c, "comm_h2d"));
  if (!bytes) return NMT_OK;
  NMT_TRY(require_pinned("comm_h2d", host));
  NMT_CUDA_TRY(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, c->comm_stream));
  nmt__cuda_launched(1);
  return NMT_OK;
}

nmt_status nmt_cuda_comm_wait(void *ctx) {
  NMT_TRY(nmt__cuda_enter(ctx, "comm_wait"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  return nmt__cuda_wait(c, c->comm_stream, "comm_wait");
}

nmt_status nmt_cuda_comm_join(void *ctx) {
  NMT_TRY(nmt__cuda_enter(ctx, "comm_join"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(nmt__cuda_main_only(c, "comm_join"));
  NMT_CUDA_TRY(cudaEventRecord(c->ev_comm, c->comm_stream));
  NMT_CUDA_TRY(cudaStreamWaitEvent(c->stream, c->ev_comm, 0));
  return NMT_OK;
}
