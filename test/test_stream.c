/* test/test_stream.c — the reference backend's batch staging (host_alloc, h2d_*), reads back
 * (d2h_async, d2h_wait) and stream pool (stream_pool/fork/use/join): the copies, and every
 * misuse the CUDA backend refuses
 * (nmt/backend.h), so that a CPU run catches what would race on a GPU. The CUDA versions are
 * tested on a device in test/test_cuda_memory.c and test/test_cuda_context.c. */
#include <string.h>

#include "nmt/backend.h"
#include "nmt/ref.h"
#include "test.h"

/* The last error message mentions `what` (the misuse is named, not only its status). */
#define ASSERT_MSG(what) NMT_ASSERT(strstr(nmt_last_error(), (what)) != NULL)

NMT_TEST(stream_ref_staging_copies) {
  const nmt_backend *be = &nmt_backend_ref;
  void *ctx = NULL;
  NMT_ASSERT_OK(be->ctx_create(0, &ctx));
  enum { N = 1000 };
  float *src[2] = {NULL, NULL}, *dst[2] = {NULL, NULL};
  for (int s = 0; s < 2; s++) {
    NMT_ASSERT_OK(be->host_alloc(ctx, N * sizeof(float), (void **)&src[s]));
    NMT_ASSERT_OK(be->malloc(ctx, N * sizeof(float), (void **)&dst[s]));
    NMT_ASSERT(src[s] != NULL && dst[s] != NULL);
  }
  /* Two micro-batches through the two slots, each source refilled once its copy has read it;
   * the destination must hold what the source held at h2d_async. A NULL context works too. */
  for (int step = 0; step < 4; step++) {
    void *c = step < 2 ? ctx : NULL;
    const int s = step % 2;
    for (int i = 0; i < N; i++) src[s][i] = (float)(step * N + i);
    for (int i = 0; i < N; i++) dst[s][i] = -1.0f;
    NMT_ASSERT_OK(be->h2d_async(c, s, dst[s], src[s], N * sizeof(float)));
    NMT_ASSERT_OK(be->h2d_wait_src(c, s));
    for (int i = 0; i < N; i++) src[s][i] = 12345.0f; /* the refill */
    NMT_ASSERT_OK(be->h2d_acquire(c, s));
    for (int i = 0; i < N; i++) NMT_ASSERT(dst[s][i] == (float)(step * N + i));
    NMT_ASSERT_OK(be->h2d_release(c, s));
  }
  NMT_ASSERT_OK(be->h2d_async(ctx, 1, dst[1], src[1], 0)); /* 0 bytes: nothing to copy */
  void *z = NULL;
  NMT_ASSERT_OK(be->host_alloc(NULL, 0, &z));
  NMT_ASSERT(z != NULL);
  be->host_free(NULL, z);
  be->host_free(ctx, NULL);
  NMT_ASSERT_EQ_STATUS(be->host_alloc(ctx, (size_t)-1 / 2, &z), NMT_ERR_NOMEM);
  NMT_ASSERT(z == NULL);
  for (int s = 0; s < 2; s++) {
    be->host_free(ctx, src[s]);
    be->free(ctx, dst[s]);
  }
  be->ctx_destroy(ctx);
}

NMT_TEST(stream_ref_staging_bad_slot) {
  const nmt_backend *be = &nmt_backend_ref;
  void *ctx = NULL;
  NMT_ASSERT_OK(be->ctx_create(0, &ctx));
  float a = 1.0f, b = 2.0f;
  const int bad[3] = {-1, 2, 1000};
  for (int k = 0; k < 3; k++) {
    for (int with_ctx = 0; with_ctx < 2; with_ctx++) {
      void *c = with_ctx ? ctx : NULL;
      NMT_ASSERT_EQ_STATUS(be->h2d_async(c, bad[k], &b, &a, sizeof a), NMT_ERR_INTERNAL);
      ASSERT_MSG("slot");
      NMT_ASSERT(b == 2.0f); /* refused before copying */
      NMT_ASSERT_EQ_STATUS(be->h2d_acquire(c, bad[k]), NMT_ERR_INTERNAL);
      NMT_ASSERT_EQ_STATUS(be->h2d_release(c, bad[k]), NMT_ERR_INTERNAL);
      NMT_ASSERT_EQ_STATUS(be->h2d_wait_src(c, bad[k]), NMT_ERR_INTERNAL);
      ASSERT_MSG("slot");
    }
  }
  be->ctx_destroy(ctx);
}

/* Reads back: step s's block goes to slot s % NMT_D2H_SLOTS and is read after d2h_wait, while
 * the device value has already moved on; bad slots are refused before any copy. */
NMT_TEST(stream_ref_d2h_async_slots) {
  const nmt_backend *be = &nmt_backend_ref;
  void *ctx = NULL;
  NMT_ASSERT_OK(be->ctx_create(0, &ctx));
  float *host = NULL, dev[3];
  NMT_ASSERT_OK(be->host_alloc(ctx, NMT_D2H_SLOTS * sizeof dev, (void **)&host));
  for (int s = 0; s < NMT_D2H_SLOTS; s++) NMT_ASSERT_OK(be->d2h_wait(ctx, s)); /* never used */
  for (int step = 0; step < 5; step++) {
    const int s = step % NMT_D2H_SLOTS;
    for (int i = 0; i < 3; i++) dev[i] = (float)(10 * step + i);
    NMT_ASSERT_OK(be->d2h_async(step % 2 ? ctx : NULL, s, host + 3 * s, dev, sizeof dev));
    for (int i = 0; i < 3; i++) dev[i] = -1.0f; /* the next step overwrites the device copy */
    NMT_ASSERT_OK(be->d2h_wait(ctx, s));
    for (int i = 0; i < 3; i++) NMT_ASSERT(host[3 * s + i] == (float)(10 * step + i));
  }
  float b = 5.0f, a = 1.0f;
  const int bad[3] = {-1, NMT_D2H_SLOTS, 77};
  for (int k = 0; k < 3; k++) {
    NMT_ASSERT_EQ_STATUS(be->d2h_async(ctx, bad[k], &b, &a, sizeof a), NMT_ERR_INTERNAL);
    ASSERT_MSG("slot");
    NMT_ASSERT(b == 5.0f);
    NMT_ASSERT_EQ_STATUS(be->d2h_wait(NULL, bad[k]), NMT_ERR_INTERNAL);
  }
  be->host_free(ctx, host);
  be->ctx_destroy(ctx);
}

/* The legal sequence: pool, then fork / use each stream / join, twice; ops between fork and
 * join run (at once) and give the same result as outside a fork. */
NMT_TEST(stream_ref_pool_fork_use_join) {
  const nmt_backend *be = &nmt_backend_ref;
  void *ctx = NULL;
  NMT_ASSERT_OK(be->ctx_create(0, &ctx));
  NMT_ASSERT_OK(be->stream_pool(ctx, 3));
  float x[5] = {1, 2, 3, 4, 5}, y[5] = {5, 4, 3, 2, 1}, out[3][5], want[5];
  for (int i = 0; i < 5; i++) want[i] = x[i] + y[i];
  for (int round = 0; round < 2; round++) {
    memset(out, 0, sizeof out);
    NMT_ASSERT_OK(be->stream_fork(ctx));
    for (int s = 1; s <= 3; s++) {
      NMT_ASSERT_OK(be->stream_use(ctx, s));
      NMT_ASSERT_OK(be->add(ctx, out[s - 1], x, y, 5));
    }
    NMT_ASSERT_OK(be->stream_use(ctx, 0));
    NMT_ASSERT_OK(be->stream_join(ctx));
    for (int s = 0; s < 3; s++) NMT_ASSERT(memcmp(out[s], want, sizeof want) == 0);
  }
  /* After the join, main-stream operations are allowed again. */
  NMT_ASSERT_OK(be->synchronize(ctx));
  NMT_ASSERT_OK(be->copy_h2d(ctx, out[0], x, sizeof x));
  /* The same size again, another size, and none, on an idle context. */
  NMT_ASSERT_OK(be->stream_pool(ctx, 3));
  NMT_ASSERT_OK(be->stream_pool(ctx, 8));
  NMT_ASSERT_OK(be->stream_fork(ctx));
  NMT_ASSERT_OK(be->stream_use(ctx, 8));
  NMT_ASSERT_OK(be->stream_join(ctx));
  NMT_ASSERT_OK(be->stream_pool(ctx, 0));
  NMT_ASSERT_OK(be->stream_fork(ctx));
  NMT_ASSERT_OK(be->stream_use(ctx, 0));
  NMT_ASSERT_EQ_STATUS(be->stream_use(ctx, 1), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(be->stream_join(ctx));
  be->ctx_destroy(ctx);
}

NMT_TEST(stream_ref_pool_misuse) {
  const nmt_backend *be = &nmt_backend_ref;
  void *ctx = NULL;
  NMT_ASSERT_OK(be->ctx_create(0, &ctx));
  /* Pool size out of range: a config error (parallel.aux_streams), with or without ctx. */
  NMT_ASSERT_EQ_STATUS(be->stream_pool(ctx, -1), NMT_ERR_CONFIG);
  NMT_ASSERT_EQ_STATUS(be->stream_pool(ctx, 9), NMT_ERR_CONFIG);
  NMT_ASSERT_EQ_STATUS(be->stream_pool(NULL, 9), NMT_ERR_CONFIG);
  NMT_ASSERT_OK(be->stream_pool(ctx, 2));

  /* Without a fork: use and join are refused. */
  NMT_ASSERT_EQ_STATUS(be->stream_use(ctx, 1), NMT_ERR_INTERNAL);
  ASSERT_MSG("no stream_fork");
  NMT_ASSERT_EQ_STATUS(be->stream_use(ctx, 0), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(be->stream_join(ctx), NMT_ERR_INTERNAL);
  ASSERT_MSG("no stream_fork");

  NMT_ASSERT_OK(be->stream_fork(ctx));
  /* Stream index outside [0, n]. */
  NMT_ASSERT_EQ_STATUS(be->stream_use(ctx, 3), NMT_ERR_INTERNAL);
  ASSERT_MSG("outside [0, 2]");
  NMT_ASSERT_EQ_STATUS(be->stream_use(ctx, -1), NMT_ERR_INTERNAL);
  /* A second fork, and a pool change, while forked. */
  NMT_ASSERT_EQ_STATUS(be->stream_fork(ctx), NMT_ERR_INTERNAL);
  ASSERT_MSG("already forked");
  NMT_ASSERT_EQ_STATUS(be->stream_pool(ctx, 2), NMT_ERR_INTERNAL);
  ASSERT_MSG("between stream_fork and stream_join");
  /* Main-stream-only operations, refused without touching memory. */
  float a[4] = {1, 2, 3, 4}, b[4] = {9, 9, 9, 9};
  NMT_ASSERT_EQ_STATUS(be->copy_h2d(ctx, b, a, sizeof a), NMT_ERR_INTERNAL);
  ASSERT_MSG("copy_h2d");
  NMT_ASSERT_EQ_STATUS(be->copy_d2h(ctx, b, a, sizeof a), NMT_ERR_INTERNAL);
  ASSERT_MSG("copy_d2h");
  NMT_ASSERT_EQ_STATUS(be->memset_zero(ctx, b, sizeof b), NMT_ERR_INTERNAL);
  ASSERT_MSG("memset_zero");
  NMT_ASSERT_EQ_STATUS(be->synchronize(ctx), NMT_ERR_INTERNAL);
  ASSERT_MSG("synchronize");
  NMT_ASSERT_EQ_STATUS(be->h2d_async(ctx, 0, b, a, sizeof a), NMT_ERR_INTERNAL);
  ASSERT_MSG("h2d_async");
  NMT_ASSERT_EQ_STATUS(be->h2d_acquire(ctx, 0), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(be->h2d_release(ctx, 1), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(be->d2h_async(ctx, 0, b, a, sizeof a), NMT_ERR_INTERNAL);
  ASSERT_MSG("d2h_async");
  NMT_ASSERT_EQ_STATUS(be->d2h_wait(ctx, 0), NMT_ERR_INTERNAL);
  ASSERT_MSG("d2h_wait");
  for (int i = 0; i < 4; i++) NMT_ASSERT(b[i] == 9.0f);
  /* Waiting for a staging source is host-side only: allowed. */
  NMT_ASSERT_OK(be->h2d_wait_src(ctx, 0));
  /* The misuses left the fork intact: join works once, then the context is idle again. */
  NMT_ASSERT_OK(be->stream_use(ctx, 2));
  NMT_ASSERT_OK(be->stream_join(ctx));
  NMT_ASSERT_EQ_STATUS(be->stream_join(ctx), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(be->copy_h2d(ctx, b, a, sizeof a));
  NMT_ASSERT(memcmp(a, b, sizeof a) == 0);
  NMT_ASSERT_OK(be->stream_pool(ctx, 1));
  /* A new fork sends ops to the main stream until stream_use; the old index is checked
   * against the new pool. */
  NMT_ASSERT_OK(be->stream_fork(ctx));
  NMT_ASSERT_EQ_STATUS(be->stream_use(ctx, 2), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(be->stream_join(ctx));
  be->ctx_destroy(ctx);
}

/* A NULL context (the fp32 default) keeps no state: the stream ops succeed after the checks
 * that need none; another backend's context is refused, not misread. */
NMT_TEST(stream_ref_null_and_foreign_ctx) {
  const nmt_backend *be = &nmt_backend_ref;
  NMT_ASSERT_OK(be->stream_pool(NULL, 2));
  NMT_ASSERT_OK(be->stream_fork(NULL));
  NMT_ASSERT_OK(be->stream_fork(NULL));
  NMT_ASSERT_OK(be->stream_use(NULL, 8));
  NMT_ASSERT_EQ_STATUS(be->stream_use(NULL, 9), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(be->stream_use(NULL, -1), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(be->stream_join(NULL));
  NMT_ASSERT_OK(be->stream_join(NULL));
  NMT_ASSERT_OK(be->synchronize(NULL));
  int foreign[64];
  memset(foreign, 0, sizeof foreign);
  NMT_ASSERT_EQ_STATUS(be->stream_pool(foreign, 2), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(be->stream_fork(foreign), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(be->stream_use(foreign, 0), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(be->stream_join(foreign), NMT_ERR_INTERNAL);
  ASSERT_MSG("not a reference context");
}
