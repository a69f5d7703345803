/* test/test_cuda_backend.c — the CUDA backend's op table (cuda/backend.cu) and the trainer's
 * refusal of parallel.device = cuda without a usable GPU: checks that need no device, run in
 * every build (the table check skips in a CPU-only build, which has no table). The ops
 * themselves: test/test_cuda_<op>.c. */
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/trainer.h"
#include "test.h"

NMT_TEST(cuda_table_complete) {
  const nmt_backend *be = nmt_backend_cuda_get();
  if (!be) NMT_SKIP("no CUDA device (CPU-only build)");
  NMT_ASSERT(!strcmp(be->name, "cuda"));
  /* Every field of the table, in order: a NULL would crash the model mid-step. */
  const void *const fields[] = {
      (const void *)be->device_count, (const void *)be->ctx_create, (const void *)be->ctx_destroy,
      (const void *)be->set_precision, (const void *)be->set_abort,
      (const void *)be->reserve_scratch, (const void *)be->counters, (const void *)be->malloc,
      (const void *)be->free,
      (const void *)be->memset_zero, (const void *)be->copy_h2d, (const void *)be->copy_d2h,
      (const void *)be->copy_d2d,
      (const void *)be->synchronize, (const void *)be->host_alloc, (const void *)be->host_free,
      (const void *)be->h2d_async, (const void *)be->h2d_acquire, (const void *)be->h2d_release,
      (const void *)be->h2d_wait_src, (const void *)be->d2h_async, (const void *)be->d2h_wait,
      (const void *)be->comm_d2h, (const void *)be->comm_h2d, (const void *)be->comm_wait,
      (const void *)be->comm_join,
      (const void *)be->stream_pool,
      (const void *)be->stream_fork, (const void *)be->stream_use, (const void *)be->stream_join,
      (const void *)be->comm_create, (const void *)be->measure_peaks, (const void *)be->mem_peak_mb,
      (const void *)be->profiler_capture, (const void *)be->clock_create,
      (const void *)be->clock_destroy,
      (const void *)be->embedding_fwd,
      (const void *)be->embedding_bwd, (const void *)be->matmul_fwd, (const void *)be->matmul_bwd,
      (const void *)be->matmul_bias_relu_fwd, (const void *)be->half_weights,
      (const void *)be->cast_half, (const void *)be->infer_weights,
      (const void *)be->layernorm_fwd, (const void *)be->layernorm_bwd,
      (const void *)be->residual_dropout_ln_fwd, (const void *)be->residual_dropout_ln_bwd,
      (const void *)be->attention_fwd, (const void *)be->attention_bwd,
      (const void *)be->attention_fused_fwd, (const void *)be->attention_fused_bwd,
      (const void *)be->relu_fwd,
      (const void *)be->relu_bwd, (const void *)be->dropout_fwd, (const void *)be->dropout_bwd,
      (const void *)be->add, (const void *)be->axpy, (const void *)be->sum_acc,
      (const void *)be->sumsq, (const void *)be->count_targets, (const void *)be->step_control,
      (const void *)be->step_decide,
      (const void *)be->xent_fwd_bwd, (const void *)be->argmax, (const void *)be->logp_topk,
      (const void *)be->logp_at,
      (const void *)be->adamw, (const void *)be->linear_half_fwd,
      (const void *)be->linear_half_bwd, (const void *)be->attention_half_fwd,
      (const void *)be->attention_half_bwd, (const void *)be->residual_ln_half_fwd,
      (const void *)be->residual_ln_half_bwd, (const void *)be->layernorm_half_fwd,
      (const void *)be->layernorm_half_bwd, (const void *)be->xent_half_fwd_bwd,
      (const void *)be->embedding_half_fwd, (const void *)be->dropout_half};
  for (size_t i = 0; i < sizeof fields / sizeof *fields; i++) {
    if (!fields[i]) nmt_test_fail(__FILE__, __LINE__, "nmt_backend_cuda field %zu is NULL", i);
  }
  NMT_ASSERT(sizeof fields == sizeof(nmt_backend) - offsetof(nmt_backend, device_count));
  int n = -1;
  NMT_ASSERT_OK(be->device_count(&n));
  NMT_ASSERT(n >= 0);
  /* A NULL context is an error, not a crash. */
  NMT_ASSERT_EQ_STATUS(be->synchronize(NULL), NMT_ERR_INTERNAL);
}

/* parallel.device = cuda without a usable GPU is NMT_ERR_DEVICE before anything else happens;
 * devices > 1 on cuda is refused until the NCCL communicator exists. */
NMT_TEST(cuda_trainer_device_selection) {
  nmt_config c;
  nmt_config_defaults(&c);
  snprintf(c.run_out_dir, sizeof c.run_out_dir, "%s/run", nmt_test_tmpdir());
  snprintf(c.data_train, sizeof c.data_train, "%s/missing.shard", nmt_test_tmpdir());
  c.parallel_device = NMT_DEVICE_CUDA;
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  nmt_trainer *t = NULL;
  const nmt_backend *be = nmt_backend_cuda_get();
  int n = 0;
  if (be) NMT_ASSERT_OK(be->device_count(&n));
  nmt_status s = nmt_trainer_create(&c, &o, &t);
  nmt_trainer_destroy(t);
  t = NULL;
  if (n < 1) {
    NMT_ASSERT_EQ_STATUS(s, NMT_ERR_DEVICE);
    NMT_ASSERT(strstr(nmt_last_error(), "device = cuda") != NULL);
  } else {
    /* The device is there: creation gets as far as the missing shard. */
    NMT_ASSERT(s != NMT_ERR_DEVICE && s != NMT_OK);
    /* One more GPU than there are: named as a device error before anything is allocated. */
    c.parallel_devices = n + 1;
    s = nmt_trainer_create(&c, &o, &t);
    nmt_trainer_destroy(t);
    NMT_ASSERT_EQ_STATUS(s, NMT_ERR_DEVICE);
    NMT_ASSERT(strstr(nmt_last_error(), "not visible") != NULL);
  }
}

/* NMT_ATTENTION_FUSED_IMPL (nmt/cuda.h): a value other than simt or mma is refused by
 * ctx_create with NMT_ERR_USAGE, before the device is looked at (so also here, without one),
 * naming the variable; unset again, a missing device is the only error left. */
NMT_TEST(cuda_attention_fused_impl_env_refused) {
  const nmt_backend *be = nmt_backend_cuda_get();
  if (!be) NMT_SKIP("built without CUDA");
  const char *old = getenv("NMT_ATTENTION_FUSED_IMPL");
  char *keep = old ? strdup(old) : NULL;
  setenv("NMT_ATTENTION_FUSED_IMPL", "MMA", 1);
  void *ctx = NULL;
  const nmt_status s = be->ctx_create(0, &ctx);
  const int named = strstr(nmt_last_error(), "NMT_ATTENTION_FUSED_IMPL=MMA") != NULL;
  if (keep) setenv("NMT_ATTENTION_FUSED_IMPL", keep, 1);
  else unsetenv("NMT_ATTENTION_FUSED_IMPL");
  free(keep);
  if (s == NMT_OK) be->ctx_destroy(ctx);
  NMT_ASSERT_EQ_STATUS(s, NMT_ERR_USAGE);
  NMT_ASSERT(named);
}
