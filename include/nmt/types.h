/* nmt/types.h — the small shared types of the layers below the config: the fixed token ids,
 * the GEMM precision and the gradient all-reduce element type.
 *
 * data/, ref/, comm/ and the backend and communicator headers need these values but not the
 * run configuration, so they include this header instead of nmt/config.h (which includes it,
 * and whose [precision] mode and [parallel] grad_dtype keys hold these enums). Keep it to
 * types and constants with no dependency: no struct of the config, no function.
 *
 * defines: NMT_PAD_ID, NMT_UNK_ID, NMT_BOS_ID, NMT_EOS_ID, nmt_precision, NMT_PRECISION_*,
 *          nmt_grad_dtype, NMT_GRAD_FP32, NMT_GRAD_FP16, NMT_GRAD_BF16
 */
#ifndef NMT_TYPES_H
#define NMT_TYPES_H

#ifdef __cplusplus
extern "C" {
#endif

/* SentencePiece ids fixed by tools/prepare-data.sh (spm_train --pad_id=0 --unk_id=1
 * --bos_id=2 --eos_id=3). docs/formats.md documents them. */
enum { NMT_PAD_ID = 0, NMT_UNK_ID = 1, NMT_BOS_ID = 2, NMT_EOS_ID = 3 };

/* [precision] mode: the arithmetic of the GEMMs (docs/cuda.md "Precision"). fp32; tf32 (tensor
 * cores round GEMM inputs to TF32, fp32 accumulation); fp16 and bf16 (GEMM inputs rounded to half
 * precision, fp32 accumulation, fp32 master weights; fp16 with dynamic loss scaling). The CPU
 * reference computes tf32 as fp32 and emulates fp16/bf16 by rounding the GEMM inputs. */
typedef enum {
  NMT_PRECISION_FP32 = 0,
  NMT_PRECISION_TF32 = 1,
  NMT_PRECISION_FP16 = 2,
  NMT_PRECISION_BF16 = 3
} nmt_precision;

/* [parallel] grad_dtype: the element type of the gradient all-reduce (docs/cuda.md). */
typedef enum { NMT_GRAD_FP32 = 0, NMT_GRAD_FP16 = 1, NMT_GRAD_BF16 = 2 } nmt_grad_dtype;

#ifdef __cplusplus
}
#endif
#endif /* NMT_TYPES_H */
