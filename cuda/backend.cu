/* cuda/backend.cu — the CUDA backend's op table (ops in cuda/<op>.cu; include/nmt/cuda.h). */
#include "common.cuh"
#include "nmt/backend.h"

extern "C" const nmt_backend nmt_backend_cuda = {
    .name = "cuda",
    .device_count = nmt_cuda_device_count,
    .ctx_create = nmt_cuda_ctx_create,
    .ctx_destroy = nmt_cuda_ctx_destroy,
    .set_precision = nmt_cuda_set_precision,
    .malloc = nmt_cuda_malloc,
    .free = nmt_cuda_free,
    .memset_zero = nmt_cuda_memset_zero,
    .copy_h2d = nmt_cuda_copy_h2d,
    .copy_d2h = nmt_cuda_copy_d2h,
    .synchronize = nmt_cuda_synchronize,
    .embedding_fwd = nmt_cuda_embedding_fwd,
    .embedding_bwd = nmt_cuda_embedding_bwd,
    .matmul_fwd = nmt_cuda_matmul_fwd,
    .matmul_bwd = nmt_cuda_matmul_bwd,
    .layernorm_fwd = nmt_cuda_layernorm_fwd,
    .layernorm_bwd = nmt_cuda_layernorm_bwd,
    .attention_fwd = nmt_cuda_attention_fwd,
    .attention_bwd = nmt_cuda_attention_bwd,
    .relu_fwd = nmt_cuda_relu_fwd,
    .relu_bwd = nmt_cuda_relu_bwd,
    .dropout_fwd = nmt_cuda_dropout_fwd,
    .dropout_bwd = nmt_cuda_dropout_bwd,
    .add = nmt_cuda_add,
    .axpy = nmt_cuda_axpy,
    .sum_acc = nmt_cuda_sum_acc,
    .sumsq = nmt_cuda_sumsq,
    .xent_fwd_bwd = nmt_cuda_xent_fwd_bwd,
    .argmax = nmt_cuda_argmax,
    .adamw = nmt_cuda_adamw,
};

extern "C" const nmt_backend *nmt_backend_cuda_get(void) { return &nmt_backend_cuda; }
