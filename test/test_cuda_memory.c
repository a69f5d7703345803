/* test/test_cuda_memory.c — batch staging and asynchronous reads back (cuda/memory.cu:
 * h2d_async / h2d_acquire / h2d_release / h2d_wait_src, d2h_async / d2h_wait; docs/cuda.md
 * "Streams" and "Step control").
 *
 * They are tested for ordering, not timing: a host function holds ("gates") the compute stream
 * while the test enqueues work behind it (nmt_tg_gate, test/gpu_helpers.h), so a missing event
 * wait shows as wrong data or as a wait that returns while the gate is still closed, whatever
 * the timing; an abort must end a wait for a held copy. */
#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "gpu_helpers.h"
#include "nmt/backend.h"
#include "test.h"
#if NMT_TG_HAVE_GATE
#include "nmt/cuda.h"
#endif

/* ------------------------------------------------------------------------------------------ */
/* copy_d2d */

/* A device-to-device copy (ZeRO's all-gather through the windows uses it) is bitwise, ordered
 * after the ops before it on the compute stream (the memset), and touches only its range. */
NMT_TG_TEST(cuda_copy_d2d_bitwise_and_ordered) {
  const size_t n = 3000;
  float *h = nmt_tg_randn(g, n, 41, 1.0f, 0.0f);
  float *src = h ? nmt_tg_dup_dev(g, h, n * 4) : NULL;
  float *dst = nmt_tg_dalloc(g, n * 4);
  NMT_TG_SETUP_OK();
  nmt_tg_poison(g, dst, n);
  NMT_ASSERT_OK(g->be->memset_zero(g->ctx, src + 100, 50 * 4));
  NMT_ASSERT_OK(g->be->copy_d2d(g->ctx, dst + 7, src + 3, 2000 * 4));
  float *got = nmt_tg_fetch(g, dst, n * 4);
  NMT_TG_SETUP_OK();
  for (size_t i = 0; i < n; i++) {
    const int inside = i >= 7 && i < 2007;
    const float want = !inside ? NAN : i - 4 >= 100 && i - 4 < 150 ? 0.0f : h[i - 4];
    const int ok = inside ? memcmp(&got[i], &want, 4) == 0 : isnan(got[i]);
    if (!ok) {
      nmt_test_fail(__FILE__, __LINE__, "dst[%zu] = %g, want %g", i, got[i], want);
      return;
    }
  }
}

/* ------------------------------------------------------------------------------------------ */
/* batch staging */

/* Both slots are copied while the compute stream is held: the copies run on their own stream
 * (h2d_wait_src returns with the gate still closed), the host may then refill the sources,
 * and the compute stream's ops after h2d_acquire read what the sources held at h2d_async. */
NMT_TG_TEST(cuda_staging_copies_overlap_compute) {
  const size_t n = (size_t)1 << 20;
  float *src[2], *dst[2], *out[2], *want[2];
  float *zero = nmt_tg_dalloc(g, n * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->memset_zero(g->ctx, zero, n * 4));
  for (int s = 0; s < 2; s++) {
    src[s] = nmt_tg_pinned(g, n);
    want[s] = nmt_tg_halloc(g, n * 4);
    dst[s] = nmt_tg_dalloc(g, n * 4);
    out[s] = nmt_tg_dalloc(g, n * 4);
    NMT_TG_SETUP_OK();
    nmt_tg_fill_ramp(src[s], n, 1.0f + (float)(s * n));
    memcpy(want[s], src[s], n * 4);
    nmt_tg_poison(g, dst[s], n);
    nmt_tg_poison(g, out[s], n);
    NMT_TG_SETUP_OK();
  }
  nmt_tg_gate gt;
  nmt_tg_first_err e = {NMT_OK, NULL, ""};
  if (!nmt_tg_gate_close(g, &gt, 20000)) return;
  for (int s = 0; s < 2; s++)
    nmt_tg_keep(&e, g->be->h2d_async(g->ctx, s, dst[s], src[s], n * 4), "h2d_async");
  for (int s = 0; s < 2; s++) {
    nmt_tg_keep(&e, g->be->h2d_acquire(g->ctx, s), "h2d_acquire");
    nmt_tg_keep(&e, g->be->add(g->ctx, out[s], dst[s], zero, n), "add");
    nmt_tg_keep(&e, g->be->h2d_release(g->ctx, s), "h2d_release");
  }
  for (int s = 0; s < 2; s++) nmt_tg_keep(&e, g->be->h2d_wait_src(g->ctx, s), "h2d_wait_src");
  const int closed_at_wait = !atomic_load(&gt.open);
  for (int s = 0; s < 2; s++)
    for (size_t i = 0; i < n; i++) src[s][i] = -7.0f; /* the refill h2d_wait_src allows */
  nmt_tg_gate_open(&gt);
  NMT_TG_NO_ERR(e);
  if (NMT_TG_HAVE_GATE && !closed_at_wait)
    nmt_test_fail(__FILE__, __LINE__,
                  "h2d_wait_src returned only after the compute stream was released: the "
                  "staging copies do not run on a stream of their own");
  NMT_TG_EXACT("slot 0 through the compute stream", nmt_tg_fetch(g, out[0], n * 4), want[0], n);
  NMT_TG_EXACT("slot 1 through the compute stream", nmt_tg_fetch(g, out[1], n * 4), want[1], n);
  /* Bad slots, with no device-side effect. */
  NMT_ASSERT_EQ_STATUS(g->be->h2d_async(g->ctx, 2, dst[0], src[0], 4), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->h2d_acquire(g->ctx, -1), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->h2d_release(g->ctx, 2), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->h2d_wait_src(g->ctx, 2), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->synchronize(g->ctx));
}

/* The second h2d_async into a slot must not overwrite the destination before the compute
 * stream has passed h2d_release; the op after the next h2d_acquire must see the new data.
 * With the compute stream held, the copy of B cannot start, so h2d_wait_src can only return
 * after the gate opened (here the valve opens it); an abort ends that wait early. */
NMT_TG_TEST(cuda_staging_release_orders_reuse) {
  const size_t n = (size_t)8 << 20; /* 32 MiB: the copy takes a while after the release */
  float *srcA = nmt_tg_pinned(g, n), *srcB = nmt_tg_pinned(g, n);
  float *dst = nmt_tg_dalloc(g, n * 4), *outA = nmt_tg_dalloc(g, n * 4),
        *outB = nmt_tg_dalloc(g, n * 4);
  float *zero = nmt_tg_dalloc(g, n * 4), *wantA = nmt_tg_halloc(g, n * 4),
        *wantB = nmt_tg_halloc(g, n * 4);
  NMT_TG_SETUP_OK();
  nmt_tg_fill_ramp(srcA, n, 1.0f);
  for (size_t i = 0; i < n; i++) srcB[i] = -srcA[i];
  memcpy(wantA, srcA, n * 4);
  memcpy(wantB, srcB, n * 4);
  NMT_ASSERT_OK(g->be->memset_zero(g->ctx, zero, n * 4));
  nmt_tg_poison(g, outA, n);
  nmt_tg_poison(g, outB, n);
  NMT_TG_SETUP_OK();
  /* Micro-batch A through slot 0, ready before the gate. */
  NMT_ASSERT_OK(g->be->h2d_async(g->ctx, 0, dst, srcA, n * 4));
  NMT_ASSERT_OK(g->be->h2d_wait_src(g->ctx, 0));
  NMT_ASSERT_OK(g->be->h2d_acquire(g->ctx, 0));

  nmt_tg_gate gt;
  nmt_tg_first_err e = {NMT_OK, NULL, ""};
  if (!nmt_tg_gate_close(g, &gt, 300)) return;
  nmt_tg_keep(&e, g->be->add(g->ctx, outA, dst, zero, n), "add (reads A)");
  nmt_tg_keep(&e, g->be->h2d_release(g->ctx, 0), "h2d_release");
  nmt_tg_keep(&e, g->be->h2d_async(g->ctx, 0, dst, srcB, n * 4), "h2d_async (B)");
  nmt_tg_keep(&e, g->be->h2d_acquire(g->ctx, 0), "h2d_acquire");
  nmt_tg_keep(&e, g->be->add(g->ctx, outB, dst, zero, n), "add (reads B)");
#if NMT_TG_HAVE_GATE
  /* The copy of B waits behind the gate: an abort ends the wait for it. */
  atomic_int abort_flag;
  atomic_init(&abort_flag, 1);
  nmt_tg_keep(&e, nmt_cuda_ctx_set_abort(g->ctx, &abort_flag), "ctx_set_abort");
  const nmt_status aborted = g->be->h2d_wait_src(g->ctx, 0);
  const int closed_at_abort = !atomic_load(&gt.open);
  nmt_tg_keep(&e, nmt_cuda_ctx_set_abort(g->ctx, NULL), "ctx_set_abort(NULL)");
#endif
  nmt_tg_keep(&e, g->be->h2d_wait_src(g->ctx, 0), "h2d_wait_src");
  const int open_at_wait = atomic_load(&gt.open);
  nmt_tg_gate_open(&gt);
  NMT_TG_NO_ERR(e);
#if NMT_TG_HAVE_GATE
  NMT_ASSERT_EQ_STATUS(aborted, NMT_ERR_ABORTED);
  NMT_ASSERT(closed_at_abort);
#endif
  if (!open_at_wait)
    nmt_test_fail(__FILE__, __LINE__,
                  "h2d_wait_src returned before the compute stream reached h2d_release: the "
                  "copy did not wait for the slot to be released");
  NMT_TG_EXACT("the op before h2d_release reads A", nmt_tg_fetch(g, outA, n * 4), wantA, n);
  NMT_TG_EXACT("the op after h2d_acquire reads B", nmt_tg_fetch(g, outB, n * 4), wantB, n);
}

/* ------------------------------------------------------------------------------------------ */
/* asynchronous reads back (docs/cuda.md "Step control") */

/* d2h_async copies after the ops issued before it (an add held behind the gate); d2h_wait
 * waits for its own slot only: a slot never used, or one whose copy has landed, returns while
 * the compute stream is still held; an abort ends a wait for a held copy. */
NMT_TG_TEST(cuda_d2h_async_orders_and_waits_per_slot) {
  const size_t n = (size_t)1 << 20;
  float *src = nmt_tg_randn(g, n, 141, 1.0f, 0.0f), *src2 = nmt_tg_randn(g, n, 142, 1.0f, 0.0f);
  float *h0 = nmt_tg_pinned(g, n), *h1 = nmt_tg_pinned(g, n);
  float *d_src = nmt_tg_dalloc(g, n * 4), *d_src2 = nmt_tg_dalloc(g, n * 4),
        *d_zero = nmt_tg_dalloc(g, n * 4);
  float *d_out = nmt_tg_dalloc(g, n * 4), *d_out2 = nmt_tg_dalloc(g, n * 4);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_src, src, n * 4));
  NMT_ASSERT_OK(g->be->copy_h2d(g->ctx, d_src2, src2, n * 4));
  NMT_ASSERT_OK(g->be->memset_zero(g->ctx, d_zero, n * 4));
  nmt_tg_poison(g, d_out, n);
  nmt_tg_poison(g, d_out2, n);
  NMT_TG_SETUP_OK();
  for (size_t i = 0; i < n; i++) h0[i] = h1[i] = NAN;

  nmt_tg_gate gt;
  nmt_tg_first_err e = {NMT_OK, NULL, ""};
  if (!nmt_tg_gate_close(g, &gt, 20000)) return;
  nmt_tg_keep(&e, g->be->d2h_wait(g->ctx, 0), "d2h_wait (slot never used)");
  nmt_tg_keep(&e, g->be->d2h_wait(g->ctx, 1), "d2h_wait (slot never used)");
  const int closed_unused = !atomic_load(&gt.open);
  nmt_tg_keep(&e, g->be->add(g->ctx, d_out, d_src, d_zero, n), "add");
  nmt_tg_keep(&e, g->be->d2h_async(g->ctx, 0, h0, d_out, n * 4), "d2h_async");
#if NMT_TG_HAVE_GATE
  atomic_int abort_flag;
  atomic_init(&abort_flag, 1);
  nmt_tg_keep(&e, nmt_cuda_ctx_set_abort(g->ctx, &abort_flag), "ctx_set_abort");
  const nmt_status aborted = g->be->d2h_wait(g->ctx, 0);
  const int closed_at_abort = !atomic_load(&gt.open);
  nmt_tg_keep(&e, nmt_cuda_ctx_set_abort(g->ctx, NULL), "ctx_set_abort(NULL)");
#endif
  nmt_tg_gate_open(&gt);
  nmt_tg_keep(&e, g->be->d2h_wait(g->ctx, 0), "d2h_wait");
  NMT_TG_NO_ERR(e);
#if NMT_TG_HAVE_GATE
  NMT_ASSERT_EQ_STATUS(aborted, NMT_ERR_ABORTED);
  NMT_ASSERT(closed_at_abort);
#endif
  if (NMT_TG_HAVE_GATE && !closed_unused)
    nmt_test_fail(__FILE__, __LINE__, "d2h_wait on a slot never used waited for the stream");
  NMT_TG_EXACT("d2h_async after the add", h0, src, n);

  /* Slot 0 has landed; slot 1's copy is held behind the gate: waiting for slot 0 returns with
   * the gate still closed (no wait for the stream), slot 1 lands after it opens. */
  for (size_t i = 0; i < n; i++) h0[i] = NAN;
  if (!nmt_tg_gate_close(g, &gt, 20000)) return;
  nmt_tg_keep(&e, g->be->add(g->ctx, d_out2, d_src2, d_zero, n), "add");
  nmt_tg_keep(&e, g->be->d2h_async(g->ctx, 1, h1, d_out2, n * 4), "d2h_async (slot 1)");
  nmt_tg_keep(&e, g->be->d2h_wait(g->ctx, 0), "d2h_wait (slot 0, landed)");
  const int closed_landed = !atomic_load(&gt.open);
  nmt_tg_gate_open(&gt);
  nmt_tg_keep(&e, g->be->d2h_wait(g->ctx, 1), "d2h_wait (slot 1)");
  NMT_TG_NO_ERR(e);
  if (NMT_TG_HAVE_GATE && !closed_landed)
    nmt_test_fail(__FILE__, __LINE__,
                  "d2h_wait on a slot whose copy had landed waited for later work");
  NMT_TG_EXACT("d2h_async slot 1", h1, src2, n);
  /* Zero bytes: only the event (and the error word). */
  NMT_ASSERT_OK(g->be->d2h_async(g->ctx, 0, h0, d_out, 0));
  NMT_ASSERT_OK(g->be->d2h_wait(g->ctx, 0));
  NMT_ASSERT(isnan(h0[0]));
}

/* Bad slots, a fork, and an error a kernel detected before the copy (reported by d2h_wait as
 * copy_d2h reports it, once). */
NMT_TG_TEST(cuda_d2h_misuse_and_device_errors) {
  float *h = nmt_tg_pinned(g, 4);
  float zeros[8] = {0};
  float *d = nmt_tg_dup_dev(g, zeros, sizeof zeros);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_EQ_STATUS(g->be->d2h_async(g->ctx, -1, h, d, 16), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->d2h_async(g->ctx, NMT_D2H_SLOTS, h, d, 16), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->d2h_wait(g->ctx, -1), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->d2h_wait(g->ctx, NMT_D2H_SLOTS), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->stream_pool(g->ctx, 1));
  NMT_ASSERT_OK(g->be->stream_fork(g->ctx));
  NMT_ASSERT_EQ_STATUS(g->be->d2h_async(g->ctx, 0, h, d, 16), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(g->be->d2h_wait(g->ctx, 0), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->stream_use(g->ctx, 1));
  NMT_ASSERT_EQ_STATUS(g->be->d2h_async(g->ctx, 1, h, d, 16), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->stream_join(g->ctx));
  NMT_ASSERT_OK(g->be->d2h_async(g->ctx, 0, h, d, 16));
  NMT_ASSERT_OK(g->be->d2h_wait(g->ctx, 0));
#ifndef NMT_CUDA_TESTS_ON_REF /* the reference refuses a bad target at the call */
  /* Pageable host memory is refused by both asynchronous copies (it could block in the
   * driver, past the abort flag), before anything is queued. */
  float pageable[4] = {0};
  NMT_ASSERT_EQ_STATUS(g->be->d2h_async(g->ctx, 0, pageable, d, 16), NMT_ERR_INTERNAL);
  NMT_ASSERT(strstr(nmt_last_error(), "not page-locked") != NULL);
  NMT_ASSERT_EQ_STATUS(g->be->h2d_async(g->ctx, 0, d, pageable, 16), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(g->be->synchronize(g->ctx));
  int32_t tgt[2] = {1, 9}; /* 9 >= V = 4 */
  int32_t *d_tgt = nmt_tg_dup_dev(g, tgt, sizeof tgt);
  float *d_b = nmt_tg_dup_dev(g, zeros, sizeof zeros);
  NMT_TG_SETUP_OK();
  NMT_ASSERT_OK(g->be->xent_fwd_bwd(g->ctx, d, d_b, NULL, d_tgt, 2, 4, 0.1f, 1.0f, NULL, 1));
  NMT_ASSERT_OK(g->be->d2h_async(g->ctx, 1, h, d_b, 8));
  NMT_ASSERT_EQ_STATUS(g->be->d2h_wait(g->ctx, 1), NMT_ERR_INTERNAL);
  NMT_ASSERT(strstr(nmt_last_error(), "target") != NULL);
  NMT_ASSERT_OK(g->be->d2h_wait(g->ctx, 1)); /* reported once */
  NMT_ASSERT_OK(g->be->synchronize(g->ctx)); /* and cleared */
  NMT_ASSERT_OK(g->be->d2h_async(g->ctx, 1, h, d_b, 8));
  NMT_ASSERT_OK(g->be->d2h_wait(g->ctx, 1));
#endif
}
