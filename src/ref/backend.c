/* ref/backend.c — the fp32 CPU reference backend's op table (ops in src/ref/<op>.c). */
#include "nmt/backend.h"

#include "nmt/ref.h"

const nmt_backend nmt_backend_ref = {
    .name = "ref",
    .device_count = nmt_ref_device_count,
    .ctx_create = nmt_ref_ctx_create,
    .ctx_destroy = nmt_ref_ctx_destroy,
    .set_precision = nmt_ref_set_precision,
    .malloc = nmt_ref_malloc,
    .free = nmt_ref_free,
    .memset_zero = nmt_ref_memset_zero,
    .copy_h2d = nmt_ref_copy_h2d,
    .copy_d2h = nmt_ref_copy_d2h,
    .synchronize = nmt_ref_synchronize,
    .embedding_fwd = nmt_ref_embedding_fwd,
    .embedding_bwd = nmt_ref_embedding_bwd,
    .matmul_fwd = nmt_ref_matmul_fwd,
    .matmul_bwd = nmt_ref_matmul_bwd,
    .layernorm_fwd = nmt_ref_layernorm_fwd,
    .layernorm_bwd = nmt_ref_layernorm_bwd,
    .attention_fwd = nmt_ref_attention_fwd,
    .attention_bwd = nmt_ref_attention_bwd,
    .relu_fwd = nmt_ref_relu_fwd,
    .relu_bwd = nmt_ref_relu_bwd,
    .dropout_fwd = nmt_ref_dropout_fwd,
    .dropout_bwd = nmt_ref_dropout_bwd,
    .add = nmt_ref_add,
    .axpy = nmt_ref_axpy,
    .sum_acc = nmt_ref_sum_acc,
    .sumsq = nmt_ref_sumsq,
    .xent_fwd_bwd = nmt_ref_xent_fwd_bwd,
    .argmax = nmt_ref_argmax,
    .adamw = nmt_ref_adamw,
};
