/* cuda/gemm.cu — every GEMM of the CUDA backend goes through here: cuBLASLt, fp32 accumulation,
 * strided batches, fp32 or 16-bit output, and the epilogues of the linear layers (bias, ReLU,
 * the ReLU bit-mask, its backward DRELU, and the bias gradient BGRADB). Inputs fp32 (TF32
 * tensor-core inputs when the context's precision is tf32 and the caller allows it), or
 * fp16/bf16: copies made by the caller (cuda/matmul.cu, the fp32-storage path) or the
 * half-storage path's activations and the registered half copy of the weights.
 *
 * Types. Scale type CUDA_R_32F and CUBLAS_COMPUTE_32F (or _32F_FAST_TF32 for fp32 inputs in
 * tf32 mode) always. A/B fp16 or bf16 with C/D fp32, and A/B fp16 (bf16) with C/D fp16 (bf16),
 * are combinations cuBLASLt lists as supported (cuBLAS Library User Guide, cuBLASLt API
 * reference, "cublasLtMatmul()": the table of supported computeType / scaleType /
 * Atype-Btype / Ctype, rows CUBLAS_COMPUTE_32F, CUDA_R_32F, then CUDA_R_16F, CUDA_R_16F or
 * CUDA_R_32F, and CUDA_R_16BF, CUDA_R_16BF or CUDA_R_32F; D has C's type). Any other mix
 * (16-bit D from fp32 inputs, fp16 with bf16) is refused here with NMT_ERR_INTERNAL. A 16-bit
 * D is the fp32 result (alpha AB + beta C + bias, through the epilogue) converted once; with
 * beta != 0 its C is read in the same 16-bit type and scaled in fp32.
 *
 * Epilogues (nmt__cuda_gemm_lt; cuBLAS Library User Guide, cuBLASLt API,
 * "cublasLtEpilogue_t" and "cublasLtMatmulDescAttributes_t", the same text as the comments in
 * /usr/local/cuda/include/cublasLt.h, which is what each use below was checked against):
 * - BIAS adds a bias vector whose length "must match matrix D rows", packed, "broadcasted to
 *   all columns and added before applying final postprocessing"; RELU_BIAS adds it and then
 *   takes max(x, 0); RELU takes max(x, 0) alone. The bias elements "are the same type as the
 *   elements of output matrix (Dtype)" unless CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE says
 *   otherwise (the exceptions listed are IMMA and fp8 kernels; we leave it unset): an fp32 bias
 *   with fp32 D, a half bias with half D (the half-storage path reads it from the half copy of
 *   the weights, nmt/backend.h linear_half_fwd: "the bias (rounded to the half type, as the
 *   copy holds it) added once to the fp32 sum"). The row-major linear layer y (M,N) is the
 *   column-major D = y^T (N x M, cuda/matmul.cu), so D's rows are the N output features: the
 *   bias runs along N, per feature, broadcast over the M tokens — the bias of the layer.
 *   In a strided batch, batch i adds bias + i * CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE
 *   ("Used together with CUBLASLT_MATMUL_DESC_BIAS_POINTER when matrix D's
 *   CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT > 1", int64_t; elements, as every stride of cuBLASLt's
 *   layouts): the decoder's cross-attention K/V projections, one GEMM for every layer, whose
 *   biases lie param_stride elements apart in the half copy.
 * - RELU_AUX / RELU_AUX_BIAS also write "a ReLu bit-mask matrix" to
 *   CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, whose CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD is
 *   "in elements (i.e. bits)", "must be divisible by 128 and be no less than the number of
 *   rows in the output matrix": we set m rounded up to 128, so column j of D (a token) has
 *   its bits at aux + j * ld / 8 bytes and the buffer is nmt_relu_mask_bytes(n, m) bytes. The
 *   mask's data type stays unset ("ReLu uses a bit-mask"). DRELU ("Apply ReLu gradient to
 *   matmul output", mask read from the same attribute, same ld) zeroes the elements whose bit
 *   is clear: the backward of the layer whose forward wrote the mask, for the same (m, n). The
 *   header names EPILOGUE_AUX_LD's rule for RELU_AUX, RELU_AUX_BIAS and DRELU_BGRAD; for DRELU
 *   it says only that the mode "requires an extra input" at the aux pointer, so we give it the
 *   same ld. Which bit order cuBLASLt uses is its own: we never read the mask on the host.
 * - BGRADB: "Bias gradient based on the input matrix B. The bias size corresponds to the
 *   number of columns of the matrix D. The reduction happens over the GEMM's k dimension.
 *   Stores Bias gradient in the auxiliary output (see CUBLASLT_MATMUL_DESC_BIAS_POINTER)",
 *   whose elements "are the same type as the output elements (Ctype)": fp32 here. It is the
 *   dW GEMM of a linear layer, dW_c (K x N) = x_c (K x M) . dy_c^T (M x N) with B = dy_c
 *   transposed: op(B)'s sums over k = M tokens are dbias (N). The vector is WRITTEN (the
 *   caller adds it into its accumulating dbias), while dW itself accumulates with beta = 1.
 * The rule of which epilogue takes what (gemm_run checks it; a call outside it is an
 * NMT_ERR_INTERNAL, never silently unfused): BIAS, RELU, RELU_BIAS with beta = 0 and any
 * batch (a batch's bias needs its stride); RELU_AUX, RELU_AUX_BIAS, DRELU with beta = 0 and
 * batch 1 (the mask has no batch stride here); BGRADB with batch 1 and beta 0 or 1 (weight
 * gradients accumulate across micro-batches: the bias gradient does not see beta).
 *   When an epilogue is taken. (1) Its vector and aux pointers must be 16-byte aligned (a
 * batched bias: its stride in bytes too). The alignment preferences
 * (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_{A,B,C,D}_BYTES) do not cover them; the header says only
 * that routines that do not dereference the bias or aux pointer, like the heuristic, "depend
 * on its value to determine expected pointer alignment", and kernels that assume 16 bytes
 * have faulted with "misaligned address" on bias slices (Marian's src/tensors/gpu/prod.cpp
 * keeps a 16-byte rule for this reason; the open PyTorch pull request #194497 reports the
 * fault on a bias slice and falls back below 16 bytes). The model's biases are slices of the
 * flat parameter buffer (and of its half copy), so only the element size is guaranteed.
 * (2) The heuristic must return an algorithm for the key with the epilogue set on the
 * descriptor (bias and aux pointers and aux ld included). (3) The context's test knob
 * (nmt_cuda_ctx_set_epilogues) is on. Otherwise nothing is enqueued, *fused = 0, and the
 * caller runs the unfused sequence (cuda/matmul.cu: bias broadcast into C and beta = 1, the
 * ReLU kernels, the column-sum kernel for dbias): never a refusal. A key that found no
 * algorithm is cached as such, so the heuristic is asked once per key and a shape always
 * takes the same path. The fused ReLU is cuBLASLt's max(x, 0): whether it maps a NaN to 0 as
 * the ReLU kernels do is not documented (docs/cuda.md).
 *
 * Caching (issue 15: the host cost of a GEMM call). Each GEMM is described by a key
 * (nmt/cuda.h: transposes, sizes, leading dimensions, strides, batch, compute type, input and
 * output types, epilogue, the bias batch stride and, per matrix, the alignment common to its
 * pointer, leading dimension and batch stride (nmt_cuda_gemm_alignment), the bias's and the
 * mask's included). An exact
 * entry per key holds the matmul descriptor, the three layouts and the algorithm, so a shape
 * seen before makes no descriptor, layout or heuristic call: one cublasLtMatmul (and, with a
 * bias or mask, one attribute set per pointer). A new shape's algorithm comes from its BUCKET
 * (the key with every size rounded up by nmt_cuda_gemm_bucket, so batch lengths, token counts
 * and B*H do not churn it): the heuristic is asked once per bucket, for the bucket's own shape
 * (the mask's ld from the bucket's m), and its algorithm is verified for the exact shape with
 * cublasLtMatmulAlgoCheck (and our workspace); a refusal falls back to asking the heuristic for
 * the exact shape. Either way the
 * algorithm is a function of the exact key alone (never of which shape came first), so a shape
 * always runs the same algorithm, fused or not: two runs on the same GPU are bitwise equal,
 * resumed or not. The alignments are passed to the heuristic: its default assumes 256-byte
 * alignment, but the model hands in column slices (fused QKV heads, one row of a matrix) that
 * are only 4-byte aligned, and an algorithm that assumes more would read wrong or fault
 * (AlgoCheck does not see pointers, which is why alignments are never bucketed). The
 * requirement covers leading dimensions and batch strides too (cuBLASLt API,
 * CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES), and those ARE bucketed: the bucket of an
 * exact shape with ld = 1001 floats has ld = 1024, so the alignment word carries the
 * exact ld's and stride's share, and the bucket's heuristic is asked for that. In tf32 mode
 * a shape that no TF32 kernel accepts falls back to fp32 (and is cached so). 16-bit inputs
 * need no particular shape: leading dimensions that are multiples of 8 elements and 16-byte
 * alignment let the heuristic pick tensor-core kernels (speed), other shapes get slower
 * kernels, none is refused here. */
#include <string.h>

#include "common.cuh"
#include "nmt/log.h"

static const char *type_name(cudaDataType_t t) {
  return t == CUDA_R_16F ? "fp16" : t == CUDA_R_16BF ? "bf16" : t == CUDA_R_32F ? "fp32" : "?";
}

static const char *epi_name(nmt__cuda_epilogue e) {
  static const char *const names[] = {"none",          "BIAS",  "RELU",  "RELU_BIAS", "RELU_AUX",
                                      "RELU_AUX_BIAS", "DRELU", "BGRADB"};
  return (unsigned)e < sizeof names / sizeof *names ? names[e] : "?";
}

static uint64_t hash_key(const int64_t *k, int n) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a over the words */
  for (int i = 0; i < n; i++) {
    h ^= (uint64_t)k[i];
    h *= 1099511628211ull;
  }
  return h;
}

/* Which pointers each epilogue reads or writes (the top of the file). */
static int has_bias(nmt__cuda_epilogue epi) {
  return epi == NMT_CUDA_EPI_BIAS || epi == NMT_CUDA_EPI_RELU_BIAS ||
         epi == NMT_CUDA_EPI_RELU_AUX_BIAS || epi == NMT_CUDA_EPI_BGRADB;
}
static int has_aux(nmt__cuda_epilogue epi) {
  return epi == NMT_CUDA_EPI_RELU_AUX || epi == NMT_CUDA_EPI_RELU_AUX_BIAS ||
         epi == NMT_CUDA_EPI_DRELU;
}
/* The forward epilogues without a mask: any batch (a batched bias has its stride). */
static int batched_ok(nmt__cuda_epilogue epi) {
  return epi == NMT_CUDA_EPI_BIAS || epi == NMT_CUDA_EPI_RELU || epi == NMT_CUDA_EPI_RELU_BIAS;
}

static cublasLtEpilogue_t lt_epilogue(nmt__cuda_epilogue epi) {
  switch (epi) {
    case NMT_CUDA_EPI_BIAS: return CUBLASLT_EPILOGUE_BIAS;
    case NMT_CUDA_EPI_RELU: return CUBLASLT_EPILOGUE_RELU;
    case NMT_CUDA_EPI_RELU_BIAS: return CUBLASLT_EPILOGUE_RELU_BIAS;
    case NMT_CUDA_EPI_RELU_AUX: return CUBLASLT_EPILOGUE_RELU_AUX;
    case NMT_CUDA_EPI_RELU_AUX_BIAS: return CUBLASLT_EPILOGUE_RELU_AUX_BIAS;
    case NMT_CUDA_EPI_DRELU: return CUBLASLT_EPILOGUE_DRELU;
    case NMT_CUDA_EPI_BGRADB: return CUBLASLT_EPILOGUE_BGRADB;
    default: return CUBLASLT_EPILOGUE_DEFAULT;
  }
}

/* The ReLU bit-mask's leading dimension in bits for a D of m rows: CUBLASLT_MATMUL_DESC_
 * EPILOGUE_AUX_LD "must be divisible by 128 and be no less than the number of rows in the
 * output matrix" (cublasLt.h); nmt_relu_mask_bytes sizes the buffer with the same rounding. */
static int64_t aux_ld_bits(int64_t m) { return (m + 127) / 128 * 128; }

/* Key words (nmt/cuda.h): transa, transb, m, n, k, lda, ldb, ldc, strides, batch, compute,
 * alignments, input type, epilogue, bias alignment, output type, aux alignment, bias batch
 * stride. */
enum { K_TA, K_TB, K_M, K_N, K_K, K_LDA, K_LDB, K_LDC, K_SA, K_SB, K_SC, K_BATCH, K_CT, K_ALA,
       K_ALB, K_ALC, K_TYPE, K_EPI, K_ALBIAS, K_DTYPE, K_ALAUX, K_BSTRIDE, K_WORDS };
static_assert((int)K_WORDS == (int)NMT_CUDA_GEMM_KEY,
              "nmt/cuda.h's key and this file's words agree");

/* A matmul descriptor: fp32 scale, compute type ct, key's transposes and epilogue, with the
 * epilogue's pointers (the heuristic reads their alignment from them), the bias batch stride
 * of a batched bias and the mask's leading dimension (from key's m: the bucket's own for a
 * bucket's query). */
static cublasStatus_t matmul_desc(cublasLtMatmulDesc_t *op, cublasComputeType_t ct,
                                  const int64_t *key, const void *bias, const void *aux) {
  const cublasOperation_t ta = key[K_TA] ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = key[K_TB] ? CUBLAS_OP_T : CUBLAS_OP_N;
  const nmt__cuda_epilogue epi = (nmt__cuda_epilogue)key[K_EPI];
  cublasStatus_t s = cublasLtMatmulDescCreate(op, ct, CUDA_R_32F);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
  if (s == CUBLAS_STATUS_SUCCESS && epi != NMT_CUDA_EPI_NONE) {
    /* uint32_t per cublasLt.h ("uint32_t, default: CUBLASLT_EPILOGUE_DEFAULT"). */
    const uint32_t e = (uint32_t)lt_epilogue(epi);
    s = cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof e);
    if (s == CUBLAS_STATUS_SUCCESS && bias)
      s = cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                         sizeof bias);
    if (s == CUBLAS_STATUS_SUCCESS && bias && key[K_BATCH] > 1) {
      const int64_t bs = key[K_BSTRIDE];
      s = cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &bs,
                                         sizeof bs);
    }
    if (s == CUBLAS_STATUS_SUCCESS && aux) {
      const int64_t ld = aux_ld_bits(key[K_M]);
      s = cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux,
                                         sizeof aux);
      if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld,
                                           sizeof ld);
    }
  }
  if (s != CUBLAS_STATUS_SUCCESS && *op) {
    cublasLtMatmulDescDestroy(*op);
    *op = NULL;
  }
  return s;
}

#define GEMM_TRY(expr)                                                 \
  do {                                                                 \
    cublasStatus_t gemm_s_ = (expr);                                   \
    if (gemm_s_ != CUBLAS_STATUS_SUCCESS) {                            \
      st = nmt__cublas_error(gemm_s_, #expr, __FILE__, __LINE__);      \
      goto out;                                                        \
    }                                                                  \
  } while (0)

static void destroy_layouts(cublasLtMatrixLayout_t l[3]) {
  for (int i = 0; i < 3; i++)
    if (l[i]) cublasLtMatrixLayoutDestroy(l[i]);
  l[0] = l[1] = l[2] = NULL;
}

/* The layouts of A, B, C (= D) for the sizes of key (exact or bucketed): A of the input type,
 * (transa ? k x m : m x k) with lda, B likewise, C of the output type, m x n with ldc; with the
 * batch count and the strides when batch > 1. On failure none is left. */
static cublasStatus_t make_layouts(const int64_t *key, cublasLtMatrixLayout_t l[3]) {
  const cudaDataType_t ab = (cudaDataType_t)key[K_TYPE];
  const int64_t m = key[K_M], n = key[K_N], k = key[K_K];
  const uint64_t rows[3] = {(uint64_t)(key[K_TA] ? k : m), (uint64_t)(key[K_TB] ? n : k),
                            (uint64_t)m};
  const uint64_t cols[3] = {(uint64_t)(key[K_TA] ? m : k), (uint64_t)(key[K_TB] ? k : n),
                            (uint64_t)n};
  const cudaDataType_t types[3] = {ab, ab, (cudaDataType_t)key[K_DTYPE]};
  l[0] = l[1] = l[2] = NULL;
  cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
  for (int i = 0; i < 3 && s == CUBLAS_STATUS_SUCCESS; i++)
    s = cublasLtMatrixLayoutCreate(&l[i], types[i], rows[i], cols[i], key[K_LDA + i]);
  if (key[K_BATCH] > 1) {
    const int32_t bc = (int32_t)key[K_BATCH];
    for (int i = 0; i < 3 && s == CUBLAS_STATUS_SUCCESS; i++) {
      s = cublasLtMatrixLayoutSetAttribute(l[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc,
                                           sizeof bc);
      if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutSetAttribute(l[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                             &key[K_SA + i], sizeof key[K_SA + i]);
    }
  }
  if (s != CUBLAS_STATUS_SUCCESS) destroy_layouts(l);
  return s;
}

static void entry_clear(nmt__cuda_gemm_entry *e) {
  if (e->op) cublasLtMatmulDescDestroy(e->op);
  cublasLtMatrixLayout_t l[3] = {e->Ad, e->Bd, e->Cd};
  destroy_layouts(l);
  memset(e, 0, sizeof *e);
}

void nmt__cuda_gemm_cache_free(nmt_cuda_ctx *c) {
  for (int i = 0; i < NMT_CUDA_GEMM_CACHE; i++) entry_clear(&c->gemm_cache[i]);
  for (int i = 0; i < NMT_CUDA_GEMM_BUCKETS; i++) entry_clear(&c->gemm_bucket[i]);
}

/* The entry of `key` in tab (n slots, open addressing over 8 probes): the hit, or NULL with
 * *slot = a free slot on the probe sequence, else the first one (cleared: evicted; the
 * choice for a key is a function of the key, so re-making it gives the same algorithm). */
static nmt__cuda_gemm_entry *lookup(nmt__cuda_gemm_entry *tab, int n, const int64_t *key,
                                    nmt__cuda_gemm_entry **slot) {
  const uint64_t h = hash_key(key, NMT_CUDA_GEMM_KEY);
  *slot = NULL;
  for (int probe = 0; probe < 8; probe++) {
    nmt__cuda_gemm_entry *e = &tab[(h + (uint64_t)probe) % (uint64_t)n];
    if (e->valid && !memcmp(e->key, key, sizeof e->key)) return e;
    if (!e->valid && !*slot) *slot = e;
  }
  if (!*slot) {
    *slot = &tab[h % (uint64_t)n];
    entry_clear(*slot);
  }
  return NULL;
}

/* The heuristic's first algorithm for layouts l under key's transposes, epilogue (bias and
 * aux: their pointers) and alignments, with at most the workspace: TF32 compute first when
 * the key asks for it, then fp32 (a shape no TF32 kernel takes, e.g. for alignment). *found =
 * 0 when none; a status other than NOT_SUPPORTED is an error. */
static nmt_status heuristic(nmt_cuda_ctx *c, const int64_t *key, cublasLtMatrixLayout_t l[3],
                            const void *bias, const void *aux, cublasLtMatmulAlgo_t *algo,
                            int *compute, int *found) {
  nmt_status st = NMT_OK;
  cublasLtMatmulPreference_t pref = NULL;
  cublasLtMatmulDesc_t op = NULL;
  const uint64_t ws = NMT_CUDA_WORKSPACE_BYTES;
  const uint32_t al[3] = {(uint32_t)key[K_ALA], (uint32_t)key[K_ALB], (uint32_t)key[K_ALC]};
  const int tf32 = key[K_CT] == (int64_t)CUBLAS_COMPUTE_32F_FAST_TF32;
  *found = 0;
  GEMM_TRY(cublasLtMatmulPreferenceCreate(&pref));
  GEMM_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &ws, sizeof ws));
  GEMM_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                &al[0], sizeof al[0]));
  GEMM_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                &al[1], sizeof al[1]));
  GEMM_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                &al[2], sizeof al[2]));
  GEMM_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                &al[2], sizeof al[2]));
  if (key[K_DTYPE] != (int64_t)CUDA_R_32F) {
    /* A 16-bit D: split-K partials only in the compute type (fp32) or none. The INPLACE and
     * OUTPUT_TYPE schemes keep them in the output buffer and type (cublasLt.h,
     * cublasLtReductionScheme_t), which would round each element more than once (and can
     * overflow an fp16 partial whose total is finite): the contract is one rounding. */
    const uint32_t red = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    GEMM_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                  &red, sizeof red));
  }
  for (int attempt = 0; attempt < (tf32 ? 2 : 1) && !*found; attempt++) {
    const cublasComputeType_t ct =
        attempt == 0 ? (cublasComputeType_t)key[K_CT] : CUBLAS_COMPUTE_32F;
    cublasLtMatmulHeuristicResult_t heur;
    memset(&heur, 0, sizeof heur);
    int n = 0;
    GEMM_TRY(matmul_desc(&op, ct, key, bias, aux));
    const cublasStatus_t hs =
        cublasLtMatmulAlgoGetHeuristic(c->lt, op, l[0], l[1], l[2], l[2], pref, 1, &heur, &n);
    cublasLtMatmulDescDestroy(op);
    op = NULL;
    if (hs == CUBLAS_STATUS_SUCCESS && n >= 1 && heur.state == CUBLAS_STATUS_SUCCESS) {
      *algo = heur.algo;
      *compute = (int)ct;
      *found = 1;
    } else if (hs != CUBLAS_STATUS_SUCCESS && hs != CUBLAS_STATUS_NOT_SUPPORTED) {
      if (key[K_EPI] != (int64_t)NMT_CUDA_EPI_NONE) {
        /* An epilogue the library refuses for these types or shapes (INVALID_VALUE, say) is
         * "not taken": the caller runs the unfused sequence (rule (2) at the top). */
        nmt_log(NMT_LOG_DEBUG, "cuda gemm: the heuristic refused the %s epilogue (%s)",
                epi_name((nmt__cuda_epilogue)key[K_EPI]), cublasLtGetStatusString(hs));
        continue;
      }
      st = nmt__cublas_error(hs, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
      goto out;
    }
  }
out:
  if (op) cublasLtMatmulDescDestroy(op);
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  return st;
}

/* The bucket's algorithm (c->gemm_bucket): the heuristic asked once per bucketed key, for the
 * bucket's own shape (nmt_cuda_gemm_bucket_key's sizes: a valid problem, since bucketing keeps
 * every leading dimension >= its rows). A failed query of that made-up shape only means no
 * algorithm for the bucket. */
static nmt_status bucket_algo(nmt_cuda_ctx *c, const int64_t *key, const void *bias,
                              const void *aux, const nmt__cuda_gemm_entry **out) {
  int64_t bk[NMT_CUDA_GEMM_KEY];
  nmt_cuda_gemm_bucket_key(key, bk);
  nmt__cuda_gemm_entry *slot, *e = lookup(c->gemm_bucket, NMT_CUDA_GEMM_BUCKETS, bk, &slot);
  if (!e) {
    e = slot;
    cublasLtMatrixLayout_t l[3];
    if (make_layouts(bk, l) == CUBLAS_STATUS_SUCCESS) {
      const nmt_status st = heuristic(c, bk, l, bias, aux, &e->algo, &e->compute, &e->found);
      destroy_layouts(l);
      if (st != NMT_OK) {
        /* Not an error of the call: its exact shape is asked next. */
        nmt_log(NMT_LOG_DEBUG, "cuda gemm: no algorithm for the bucket of m=%lld n=%lld k=%lld: %s",
                (long long)key[K_M], (long long)key[K_N], (long long)key[K_K], nmt_last_error());
        e->found = 0;
      }
    }
    memcpy(e->key, bk, sizeof bk);
    e->valid = 1;
  }
  *out = e;
  return NMT_OK;
}

/* An algorithm for the exact shape (layouts l) into slot: the bucket's when
 * cublasLtMatmulAlgoCheck accepts it for this shape with at most our workspace, else the
 * heuristic's for this shape. Makes slot's descriptor for the chosen compute type.
 * *found = 0: no algorithm (slot->op stays NULL). */
static nmt_status choose(nmt_cuda_ctx *c, const int64_t *key, cublasLtMatrixLayout_t l[3],
                         const void *bias, const void *aux, nmt__cuda_gemm_entry *slot,
                         int *found) {
  nmt_status st = NMT_OK;
  const nmt__cuda_gemm_entry *b;
  *found = 0;
  NMT_TRY(bucket_algo(c, key, bias, aux, &b));
  if (b->found) {
    GEMM_TRY(matmul_desc(&slot->op, (cublasComputeType_t)b->compute, key, bias, aux));
    cublasLtMatmulHeuristicResult_t res;
    memset(&res, 0, sizeof res);
    const cublasStatus_t cs =
        cublasLtMatmulAlgoCheck(c->lt, slot->op, l[0], l[1], l[2], l[2], &b->algo, &res);
    if (cs == CUBLAS_STATUS_SUCCESS && res.state == CUBLAS_STATUS_SUCCESS &&
        res.workspaceSize <= NMT_CUDA_WORKSPACE_BYTES) {
      slot->algo = b->algo;
      slot->compute = b->compute;
      *found = 1;
      return NMT_OK;
    }
    cublasLtMatmulDescDestroy(slot->op);
    slot->op = NULL;
  }
  NMT_TRY(heuristic(c, key, l, bias, aux, &slot->algo, &slot->compute, found));
  if (*found) GEMM_TRY(matmul_desc(&slot->op, (cublasComputeType_t)slot->compute, key, bias, aux));
out:
  if (st != NMT_OK) *found = 0;
  return st;
}

static uint32_t elem_bytes(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

/* The one GEMM path (nmt__cuda_gemm_lt's contract in common.cuh; the rule at the top of the
 * file). A shape seen before runs from its cache entry: no descriptor, layout or heuristic
 * call. */
static nmt_status gemm_run(nmt_cuda_ctx *c, const nmt__cuda_gemm_desc *g, int *fused) {
  *fused = 0;
  const cudaDataType_t ab = g->ab_type, cd = g->cd_type;
  const nmt__cuda_epilogue epi = g->epi;
  const int m = g->m, n = g->n, k = g->k, batch = g->batch;
  if (ab != CUDA_R_32F && ab != CUDA_R_16F && ab != CUDA_R_16BF)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda gemm: unsupported input type %d", (int)ab);
  /* The supported combinations (top of the file): fp32 output from any input, a 16-bit output
   * only from inputs of the same 16-bit type. */
  if (cd != CUDA_R_32F && (cd != ab || ab == CUDA_R_32F))
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda gemm: %s output from %s inputs is not supported",
                      type_name(cd), type_name(ab));
  if ((unsigned)epi > (unsigned)NMT_CUDA_EPI_BGRADB)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda gemm: unknown epilogue %d", (int)epi);
  if (m < 0 || n < 0 || k < 0 || batch < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda gemm: bad shape m=%d n=%d k=%d batch=%d", m, n, k,
                      batch);
  if (epi != NMT_CUDA_EPI_NONE) {
    const int beta_ok = epi == NMT_CUDA_EPI_BGRADB ? g->beta == 0.0f || g->beta == 1.0f
                                                   : g->beta == 0.0f;
    if (!beta_ok || (batch != 1 && !batched_ok(epi)))
      return nmt_errorf(NMT_ERR_INTERNAL,
                        "cuda gemm: the %s epilogue is not for batch %d with beta %g (BIAS, RELU, "
                        "RELU_BIAS: beta 0, any batch; the mask's: beta 0, batch 1; BGRADB: "
                        "beta 0 or 1, batch 1)",
                        epi_name(epi), batch, (double)g->beta);
    if (has_bias(epi) && !g->bias)
      return nmt_errorf(NMT_ERR_INTERNAL, "cuda gemm: the %s epilogue without its bias vector",
                        epi_name(epi));
    if (has_aux(epi) && !g->aux)
      return nmt_errorf(NMT_ERR_INTERNAL, "cuda gemm: the %s epilogue without its ReLU mask",
                        epi_name(epi));
  }
  if (m == 0 || n == 0 || batch == 0) {
    *fused = 1;
    return NMT_OK;
  }
  if (k == 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda gemm: k = 0 must be handled by the caller");
  const int transa = g->transa, transb = g->transb;
  const int64_t lda = g->lda, ldb = g->ldb, ldc = g->ldc;
  const int64_t a_rows = transa ? k : m, b_rows = transb ? n : k;
  if (lda < a_rows || ldb < b_rows || ldc < m || lda < 1 || ldb < 1 || ldc < 1)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda gemm: leading dimension too small (lda %lld < %lld, ldb %lld < %lld "
                      "or ldc %lld < %d)",
                      (long long)lda, (long long)a_rows, (long long)ldb, (long long)b_rows,
                      (long long)ldc, m);
  if (!g->A || !g->B || !g->C) return nmt_errorf(NMT_ERR_INTERNAL, "cuda gemm: NULL matrix");
  /* The test knob: not taken, nothing cached (the key's choice stays the heuristic's). */
  if (epi != NMT_CUDA_EPI_NONE && c->epilogues_off) return NMT_OK;

  const int tf32 = ab == CUDA_R_32F && g->allow_tf32 && c->precision == NMT_PRECISION_TF32;
  const cublasComputeType_t want_ct = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const uint32_t ab_elem = elem_bytes(ab), cd_elem = elem_bytes(cd);
  /* Pointer, leading dimension and batch stride together (nmt/cuda.h says why). */
  const uint32_t al_a = nmt_cuda_gemm_alignment((uintptr_t)g->A, lda, g->strideA, batch, ab_elem);
  const uint32_t al_b = nmt_cuda_gemm_alignment((uintptr_t)g->B, ldb, g->strideB, batch, ab_elem);
  const uint32_t al_c = nmt_cuda_gemm_alignment((uintptr_t)g->C, ldc, g->strideC, batch, cd_elem);
  const void *bias = has_bias(epi) ? g->bias : NULL;
  void *aux = has_aux(epi) ? g->aux : NULL;
  /* The bias vector (input or BGRADB's output) has C's type: cd_elem bytes per element. */
  if ((((uintptr_t)g->A | (uintptr_t)g->B) & (ab_elem - 1)) || ((uintptr_t)g->C & (cd_elem - 1)) ||
      ((uintptr_t)bias & (cd_elem - 1)))
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda gemm: a matrix is not aligned to its element size");
  const int64_t bias_stride = bias && batch > 1 ? g->bias_stride : 0;
  const uint32_t al_bias =
      bias ? nmt_cuda_gemm_alignment((uintptr_t)bias, 0, bias_stride, batch, cd_elem) : 0;
  /* The mask: its pointer and its columns (ld bits = a multiple of 16 bytes). */
  const uint32_t al_aux =
      aux ? nmt_cuda_gemm_alignment((uintptr_t)aux, aux_ld_bits(m) / 8, 0, 1, 1) : 0;
  if ((bias && al_bias < 16) || (aux && al_aux < 16)) return NMT_OK; /* rule (1): unfused */

  nmt_status st = NMT_OK;
  const int64_t key[NMT_CUDA_GEMM_KEY] = {transa, transb, m, n, k, lda, ldb, ldc,
                                          batch > 1 ? g->strideA : 0, batch > 1 ? g->strideB : 0,
                                          batch > 1 ? g->strideC : 0, batch, (int64_t)want_ct,
                                          al_a, al_b, al_c, (int64_t)ab, (int64_t)epi, al_bias,
                                          (int64_t)cd, al_aux, bias_stride};
  nmt__cuda_gemm_entry *slot, *e = lookup(c->gemm_cache, NMT_CUDA_GEMM_CACHE, key, &slot);
  if (e && e->unfused) return NMT_OK; /* rule (2), known from an earlier call */
  if (!e) {
    cublasLtMatrixLayout_t l[3];
    GEMM_TRY(make_layouts(key, l));
    int found = 0;
    st = choose(c, key, l, bias, aux, slot, &found);
    if (st != NMT_OK || !found) destroy_layouts(l);
    if (st != NMT_OK) return st;
    memcpy(slot->key, key, sizeof key);
    if (!found && epi != NMT_CUDA_EPI_NONE) {
      /* Rule (2): remember that this key runs unfused. */
      nmt_log(NMT_LOG_DEBUG,
              "cuda gemm: no algorithm with the %s epilogue for m=%d n=%d k=%d batch %d (%s in, "
              "%s out): unfused",
              epi_name(epi), m, n, k, batch, type_name(ab), type_name(cd));
      slot->unfused = 1;
      slot->valid = 1;
      return NMT_OK;
    }
    if (!found)
      return nmt_errorf(NMT_ERR_DEVICE,
                        "cuBLASLt has no algorithm for m=%d n=%d k=%d (trans %d%d, ld %lld/%lld/"
                        "%lld, batch %d, align %u/%u/%u, inputs %s, output %s, %s compute)",
                        m, n, k, transa, transb, (long long)lda, (long long)ldb, (long long)ldc,
                        batch, al_a, al_b, al_c, type_name(ab), type_name(cd),
                        tf32 ? "tf32" : "fp32");
    slot->Ad = l[0], slot->Bd = l[1], slot->Cd = l[2];
    slot->valid = 1;
    e = slot;
  } else {
    /* The cached descriptor holds an earlier call's pointers (of the same alignments). */
    if (bias)
      GEMM_TRY(cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                              sizeof bias));
    if (aux)
      GEMM_TRY(cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                              &aux, sizeof aux));
  }
  {
    const cublasStatus_t ms =
        cublasLtMatmul(c->lt, e->op, &g->alpha, g->A, e->Ad, g->B, e->Bd, &g->beta, g->C, e->Cd,
                       g->C, e->Cd, &e->algo, nmt__cuda_workspace(c), NMT_CUDA_WORKSPACE_BYTES,
                       nmt__cuda_stream(c));
    if (ms != CUBLAS_STATUS_SUCCESS && epi != NMT_CUDA_EPI_NONE &&
        (ms == CUBLAS_STATUS_NOT_SUPPORTED || ms == CUBLAS_STATUS_INVALID_VALUE)) {
      /* The library checks its arguments before it enqueues anything: a fused call it refuses
       * here runs unfused from now on (rule (2)), and leaves no CUDA error behind for the next
       * launch's check to pick up. */
      nmt_log(NMT_LOG_DEBUG, "cuda gemm: cublasLtMatmul refused the %s epilogue for m=%d n=%d "
              "k=%d (%s): unfused", epi_name(epi), m, n, k, cublasLtGetStatusString(ms));
      (void)cudaGetLastError();
      int64_t kept[NMT_CUDA_GEMM_KEY];
      memcpy(kept, e->key, sizeof kept);
      entry_clear(e);
      memcpy(e->key, kept, sizeof kept);
      e->unfused = 1;
      e->valid = 1;
      return NMT_OK;
    }
    if (ms != CUBLAS_STATUS_SUCCESS)
      return nmt__cublas_error(ms, "cublasLtMatmul", __FILE__, __LINE__);
    c->counters.gemm_calls++;
    nmt__cuda_launched(1);
    *fused = 1;
  }
out:
  return st;
}

nmt_status nmt__cuda_gemm_lt(nmt_cuda_ctx *c, const nmt__cuda_gemm_desc *g, int *fused) {
  return gemm_run(c, g, fused);
}

nmt_status nmt__cuda_gemm(nmt_cuda_ctx *c, int transa, int transb, int m, int n, int k,
                          float alpha, const float *A, int64_t lda, int64_t strideA,
                          const float *B, int64_t ldb, int64_t strideB, float beta, float *C,
                          int64_t ldc, int64_t strideC, int batch, int allow_tf32) {
  return nmt__cuda_gemm_ex(c, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB,
                           CUDA_R_32F, beta, C, ldc, strideC, batch, allow_tf32);
}

nmt_status nmt__cuda_gemm_ex(nmt_cuda_ctx *c, int transa, int transb, int m, int n, int k,
                             float alpha, const void *A, int64_t lda, int64_t strideA,
                             const void *B, int64_t ldb, int64_t strideB, cudaDataType_t ab_type,
                             float beta, float *C, int64_t ldc, int64_t strideC, int batch,
                             int allow_tf32) {
  nmt__cuda_gemm_desc g;
  memset(&g, 0, sizeof g);
  g.transa = transa, g.transb = transb, g.m = m, g.n = n, g.k = k, g.alpha = alpha;
  g.A = A, g.lda = lda, g.strideA = strideA, g.B = B, g.ldb = ldb, g.strideB = strideB;
  g.ab_type = ab_type, g.beta = beta, g.C = C, g.ldc = ldc, g.strideC = strideC;
  g.cd_type = CUDA_R_32F, g.batch = batch, g.allow_tf32 = allow_tf32, g.epi = NMT_CUDA_EPI_NONE;
  int ran;
  return gemm_run(c, &g, &ran);
}

nmt_status nmt__cuda_gemm_epilogue(nmt_cuda_ctx *c, int transa, int transb, int m, int n, int k,
                                   float alpha, const void *A, int64_t lda, const void *B,
                                   int64_t ldb, cudaDataType_t ab_type, float *C, int64_t ldc,
                                   int allow_tf32, nmt__cuda_epilogue epi, const float *bias,
                                   int *fused) {
  *fused = 0;
  if (epi != NMT_CUDA_EPI_NONE && epi != NMT_CUDA_EPI_BIAS && epi != NMT_CUDA_EPI_RELU &&
      epi != NMT_CUDA_EPI_RELU_BIAS)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda gemm: nmt__cuda_gemm_epilogue takes no %s epilogue "
                      "(nmt__cuda_gemm_lt does)", epi_name(epi));
  nmt__cuda_gemm_desc g;
  memset(&g, 0, sizeof g);
  g.transa = transa, g.transb = transb, g.m = m, g.n = n, g.k = k, g.alpha = alpha;
  g.A = A, g.lda = lda, g.B = B, g.ldb = ldb, g.ab_type = ab_type, g.beta = 0.0f;
  g.C = C, g.ldc = ldc, g.cd_type = CUDA_R_32F, g.batch = 1, g.allow_tf32 = allow_tf32;
  g.epi = epi, g.bias = bias;
  return gemm_run(c, &g, fused);
}
