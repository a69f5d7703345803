/* cuda/common.cuh — internals shared by the CUDA backend's files (not a public header).
 *
 * The per-device context (compute stream, comm stream and the events that order them, the
 * copy stream and the two staging slots' events, the asynchronous read-back slots, the aux
 * stream pool and the "current stream" ops are issued to, the abort flag and wait hook that
 * make host waits poll), the error macros
 * (every CUDA/cuBLASLt call and every kernel launch is checked), the device-side argument-error
 * word, the Philox4x32-10 port that gives bit-identical dropout masks to src/util/rng.c,
 * deterministic block reductions, the launch counter, and the cuBLASLt GEMM wrapper
 * (cuda/gemm.cu; fp32, TF32, or fp16/bf16 inputs with fp32 or 16-bit output; bias, ReLU,
 * ReLU-mask, DRELU and BGRADB epilogues).
 *
 * defines: nmt_cuda_ctx (struct), nmt__cuda_lane, NMT_CUDA_TRY, NMT_CUBLAS_TRY,
 *          NMT_CUDA_LAUNCH_CHECK, NMT_CUDA_ERR_*, NMT_CUDA_MAX_AUX, NMT_CUDA_EPI_*,
 *          nmt__cuda_gemm_desc, nmt__cuda_launched, nmt__cuda_launch_count,
 *          nmt__cuda_* (nmt__cuda_gemm, nmt__cuda_gemm_ex, nmt__cuda_gemm_epilogue,
 *          nmt__cuda_gemm_lt,
 *          nmt__cuda_stream, nmt__cuda_workspace, scratch buffers,
 *          nmt__cuda_wait, nmt__cuda_wait_event, nmt__cuda_main_only, nmt__cuda_wait_hook,
 *          nmt__cuda_sum), NMT_CUDA_PRELOAD and nmt__cuda_preload (kernel preload),
 *          philox/reduction device helpers
 */
#ifndef NMT_CUDA_COMMON_CUH
#define NMT_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "nmt/cuda.h"
#include "nmt/status.h"

/* Bits of the device-side error word: a kernel that meets an argument only the device can see
 * out of range sets its bit and skips the element. */
enum {
  NMT_CUDA_ERR_EMB_ID = 1 << 0,      /* embedding: token id < 0 */
  NMT_CUDA_ERR_ATT_KLEN = 1 << 1,    /* attention: k_lens[b] outside [1, Tk] */
  NMT_CUDA_ERR_XENT_TARGET = 1 << 2, /* xent: target outside [0, V) */
};

/* A GEMM cache entry (cuda/gemm.cu), under a key of NMT_CUDA_GEMM_KEY words (nmt/cuda.h).
 * Exact entries (gemm_cache, the exact key) hold everything a call needs: the algorithm, and
 * the matmul descriptor and matrix layouts made for that shape, reused call after call (a
 * bias pointer is set per call). Bucket entries (gemm_bucket, the bucketed key) hold only the
 * heuristic's algorithm for the bucket's shape, or found = 0 when it had none. */
typedef struct {
  int valid;
  int found;   /* bucket entries: the heuristic returned an algorithm */
  int unfused; /* the key asks for an epilogue no algorithm takes: the caller runs it unfused */
  int compute; /* the cublasComputeType_t the algorithm was found for */
  int64_t key[NMT_CUDA_GEMM_KEY];
  cublasLtMatmulAlgo_t algo;
  cublasLtMatmulDesc_t op; /* exact entries that run: descriptor and layouts; else NULL */
  cublasLtMatrixLayout_t Ad, Bd, Cd;
} nmt__cuda_gemm_entry;

enum {
  NMT_CUDA_GEMM_CACHE = 512,
  NMT_CUDA_GEMM_BUCKETS = 256,
  NMT_CUDA_WORKSPACE_BYTES = 32 << 20
};

/* The most aux streams a context holds (nmt/backend.h's stream_pool: 0 <= n <= 8). */
enum { NMT_CUDA_MAX_AUX = 8 };

/* One aux stream of the pool and everything an op issued to it writes besides its outputs: its
 * own cuBLASLt workspace and op scratch, so that ops running at the same time on different
 * streams share no buffer. The main (compute) stream's are the context's own fields below. */
typedef struct {
  cudaStream_t stream;
  void *workspace; /* NMT_CUDA_WORKSPACE_BYTES */
  void *scratch;   /* as nmt_cuda_ctx.scratch */
  size_t scratch_bytes;
  void *gemm16;    /* as nmt_cuda_ctx.gemm16 */
  size_t gemm16_bytes;
  cudaEvent_t ev_join; /* recorded on `stream` by stream_join; the compute stream waits */
} nmt__cuda_lane;

/* Called by every polling host wait of a context (nmt__cuda_wait) now and then, on the thread
 * that waits: a non-OK status ends the wait with that status. An NCCL group bound to the
 * context (cuda/nccl.cu) installs one that reports the group's abort and NCCL's asynchronous
 * errors. */
typedef nmt_status (*nmt__cuda_wait_hook)(void *arg);

struct nmt_cuda_ctx {
  int device;
  int sm_count;
  nmt_precision precision;
  cudaStream_t stream;      /* compute (main): every op, in call order, outside a fork */
  cudaStream_t comm_stream; /* NCCL collectives (cuda/nccl.cu); non-blocking like `stream` */
  cudaEvent_t ev_compute;   /* recorded on `stream` before a collective; comm_stream waits */
  cudaEvent_t ev_comm;      /* recorded on comm_stream by a flush; `stream` waits */
  atomic_int *abort;        /* nmt_cuda_ctx_set_abort: host waits give up once it is raised */
  nmt__cuda_wait_hook wait_hook; /* NULL, or installed by a bound NCCL group */
  void *wait_arg;
  cublasLtHandle_t lt;
  void *workspace; /* cuBLASLt workspace of `stream`, NMT_CUDA_WORKSPACE_BYTES */
  void *scratch;   /* op scratch of `stream` (nmt__cuda_scratch), grows on demand */
  size_t scratch_bytes;
  float *ones;     /* ones for bias-gradient GEMVs, grows on demand; read-only, every stream */
  size_t ones_len;
  void *gemm16;    /* fp16/bf16 copies of GEMM inputs on `stream` (nmt__cuda_gemm16_scratch) */
  size_t gemm16_bytes;
  /* half_weights (nmt/backend.h): the half copy half_dst of the fp32 weights half_src[0,
   * half_n), read by the GEMMs of every stream instead of casting a weight inside it (NULL:
   * none registered). Kept current by the caller (adamw's half_out, cast_half). */
  const float *half_src;
  const void *half_dst;
  size_t half_n;
  int *d_err;      /* device-side argument error word */
  int *h_err;      /* pinned host copy */
  nmt__cuda_gemm_entry gemm_cache[NMT_CUDA_GEMM_CACHE];    /* by exact key */
  nmt__cuda_gemm_entry gemm_bucket[NMT_CUDA_GEMM_BUCKETS]; /* by bucketed key */
  /* Batch staging (cuda/memory.cu's h2d_*): copies of the next micro-batch run on copy_stream.
   * ev_ready[slot] is recorded after slot's copy (the compute stream waits for it, and the
   * host polls it before refilling the source); ev_freed[slot] is recorded on the compute
   * stream after the last op that reads slot's destination (the next copy waits for it). */
  cudaStream_t copy_stream;
  cudaEvent_t ev_ready[2];
  cudaEvent_t ev_freed[2];
  /* Asynchronous reads back (cuda/memory.cu's d2h_*), on the compute stream: ev_d2h[slot] is
   * recorded after slot's copy; d2h_err[slot] (pinned) receives a copy of the error word taken
   * with it, so that d2h_wait learns of a device-detected error without another wait. */
  cudaEvent_t ev_d2h[NMT_D2H_SLOTS];
  int *d2h_err;
  /* The aux stream pool (stream_pool/fork/use/join in cuda/context.cu). `cur` picks where ops
   * go: 0 = `stream` with the context's workspace and scratch, i = aux[i-1]. `forked` is set
   * between stream_fork and stream_join; ev_fork is recorded on `stream` by the fork. */
  int n_aux;
  int cur;
  int forked;
  cudaEvent_t ev_fork;
  nmt__cuda_lane aux[NMT_CUDA_MAX_AUX];
  /* reserve_scratch's plan (planned = 0: none yet): the element-wise largest of the plans
   * given, kept so that set_precision (16-bit GEMM copies) and stream_pool (new lanes) size
   * their buffers from it; and the counters (GEMM launches in cuda/gemm.cu, scratch growths
   * in grow()). */
  int planned;
  nmt_scratch_plan plan;
  nmt_backend_counters counters; /* launches: see nmt__cuda_launch_count instead */
  /* nmt_cuda_ctx_set_epilogues(ctx, 0): every epilogue reported as not taken (tests run the
   * unfused sequences); 0, the default, follows cuda/gemm.cu's rule. */
  int epilogues_off;
  /* The fused attention's kernels for half = 1 (cuda/attention_fused_mma.cuh): 0 = mma (WMMA,
   * the default), 1 = simt. NMT_ATTENTION_FUSED_IMPL at creation, or
   * nmt_cuda_ctx_set_attention_fused_impl. */
  int attn_fused_simt;
};

/* Turns a CUDA error into NMT_ERR_DEVICE (NMT_ERR_NOMEM for allocation failures) with the call
 * and place in the message. */
nmt_status nmt__cuda_error(cudaError_t e, const char *what, const char *file, int line);
nmt_status nmt__cublas_error(cublasStatus_t s, const char *what, const char *file, int line);

#define NMT_CUDA_TRY(expr)                                              \
  do {                                                                  \
    cudaError_t nmt_cuda_e_ = (expr);                                   \
    if (nmt_cuda_e_ != cudaSuccess)                                     \
      return nmt__cuda_error(nmt_cuda_e_, #expr, __FILE__, __LINE__);   \
  } while (0)

#define NMT_CUBLAS_TRY(expr)                                            \
  do {                                                                  \
    cublasStatus_t nmt_cublas_s_ = (expr);                              \
    if (nmt_cublas_s_ != CUBLAS_STATUS_SUCCESS)                         \
      return nmt__cublas_error(nmt_cublas_s_, #expr, __FILE__, __LINE__); \
  } while (0)

/* The launch counter (nmt_backend_counters.launches; cuda/context.cu). Per host thread, not
 * per context: an op knows its context but not which other contexts its thread drives, and a
 * thread-local count needs no lock. nmt__cuda_launched adds n work items put on a device by
 * this thread (kernel launches through NMT_CUDA_LAUNCH_CHECK, cublasLtMatmul calls in
 * cuda/gemm.cu, memsets and copies in cuda/memory.cu and cuda/matmul.cu);
 * nmt__cuda_launch_count is this thread's total, which nmt_cuda_counters reports: the
 * difference of two reads by one thread around its own ops on one context is exact. */
void nmt__cuda_launched(unsigned n);
uint64_t nmt__cuda_launch_count(void);

/* After every kernel launch: a bad configuration or an earlier asynchronous fault shows here.
 * Counts the launch (nmt__cuda_launched), so every launch must be followed by exactly one. */
#define NMT_CUDA_LAUNCH_CHECK(kernel_name)                                          \
  do {                                                                              \
    nmt__cuda_launched(1);                                                          \
    cudaError_t nmt_cuda_e_ = cudaGetLastError();                                   \
    if (nmt_cuda_e_ != cudaSuccess)                                                 \
      return nmt__cuda_error(nmt_cuda_e_, "launch of " kernel_name, __FILE__, __LINE__); \
  } while (0)

static inline nmt_cuda_ctx *nmt__cuda_ctx(void *ctx) { return (nmt_cuda_ctx *)ctx; }

/* Kernel preload. CUDA loads kernels lazily by default (CUDA_MODULE_LOADING=LAZY since 12.2):
 * the runtime loads a kernel when it is first referenced, usually its first launch, and
 * "loading kernels might require context synchronization" (CUDA C++ Programming Guide,
 * "Lazy Loading", "Potential Hazards", "Concurrent Execution"). A first launch then blocks the
 * host until every stream of the context is idle: behind an NCCL kernel waiting for its peers,
 * behind a held stream. The guide's remedy is to load the kernels beforehand, in the runtime
 * with cudaFuncGetAttributes. So every kernel of cuda/ is registered next to its definition,
 *   NMT_CUDA_PRELOAD(kernel);                 once per kernel,
 *   NMT_CUDA_PRELOAD(kernel<float>);          once per template instantiation that is launched,
 * and nmt__cuda_preload, called by ctx_create, loads them all into the new context. Only
 * these: CUDA_MODULE_LOADING=EAGER would also load cuBLASLt's and NCCL's thousands.
 * test/test_cuda_preload.c fails when a __global__ of cuda/ has no entry.
 *
 * An entry is a static object whose constructor prepends it to one list (cuda/context.cu)
 * during static initialization (one thread, before main or inside dlopen); the list is only
 * read afterwards. `func` is the kernel as the runtime API takes it (its host stub), `name`
 * its spelling for error messages. */
struct nmt__cuda_preload_entry {
  const void *func;
  const char *name;
  const nmt__cuda_preload_entry *next;
  nmt__cuda_preload_entry(const void *func, const char *name);
};
#define NMT_CUDA_PRELOAD_CAT2(a, b) a##b
#define NMT_CUDA_PRELOAD_CAT(a, b) NMT_CUDA_PRELOAD_CAT2(a, b)
#define NMT_CUDA_PRELOAD(...)                                                   \
  static nmt__cuda_preload_entry NMT_CUDA_PRELOAD_CAT(nmt_cuda_preload_, __LINE__)( \
      (const void *)&__VA_ARGS__, #__VA_ARGS__)

/* Loads every registered kernel into the current device's context (cudaFuncGetAttributes on
 * each; a no-op for a kernel already loaded) and returns their number in *n. Called by
 * ctx_create after cudaSetDevice, before any stream of the context holds work. Errors:
 * NMT_ERR_DEVICE naming the kernel (no image for this device, out of memory while loading). */
nmt_status nmt__cuda_preload(int *n);

/* Every entry point starts here: NMT_ERR_INTERNAL naming `op` when ctx is NULL (the ref
 * convention of passing NULL does not work on a device backend); otherwise makes the context's
 * device current on the calling thread (cheap when it already is), so a context may be used
 * from any thread, one thread at a time. */
nmt_status nmt__cuda_enter(void *ctx, const char *op);

/* The current stream: where every op enqueues its work. The compute stream outside a fork and
 * after stream_use(0); aux stream i after stream_use(i). */
static inline cudaStream_t nmt__cuda_stream(const nmt_cuda_ctx *c) {
  return c->cur ? c->aux[c->cur - 1].stream : c->stream;
}
/* The current stream's cuBLASLt workspace (NMT_CUDA_WORKSPACE_BYTES). */
static inline void *nmt__cuda_workspace(const nmt_cuda_ctx *c) {
  return c->cur ? c->aux[c->cur - 1].workspace : c->workspace;
}
/* NMT_ERR_INTERNAL naming `op` between stream_fork and stream_join: copies, memset,
 * synchronize and the staging ops are main-stream only (nmt/backend.h), since a fork's aux
 * streams are not ordered before them. */
nmt_status nmt__cuda_main_only(const nmt_cuda_ctx *c, const char *op);

/* A device buffer of at least `bytes` owned by the current stream, valid until the next call
 * (ops on one stream use it one at a time, in stream order; growing waits for that stream
 * before freeing the old one). Each stream has its own, so ops on different streams of a fork
 * never share one. */
nmt_status nmt__cuda_scratch(nmt_cuda_ctx *c, size_t bytes, void **out);
/* Like nmt__cuda_scratch, a second buffer for the half-precision copies of GEMM inputs in
 * fp16/bf16 mode (cuda/matmul.cu), so that an op may hold both. */
nmt_status nmt__cuda_gemm16_scratch(nmt_cuda_ctx *c, size_t bytes, void **out);
/* A device vector of at least n ones (for bias-gradient GEMVs), shared by every stream: it is
 * only read, and growing it drains every stream of the context and fills the new one before
 * returning. */
nmt_status nmt__cuda_ones(nmt_cuda_ctx *c, size_t n, const float **out);

/* The scratch each op asks for, as a function of its shape: the op requests exactly this from
 * nmt__cuda_scratch / nmt__cuda_gemm16_scratch, and reserve_scratch (cuda/context.cu) sizes
 * the buffers with the same functions at the plan's bounds (each is non-decreasing in every
 * argument), so a call within the plan never grows a buffer.
 * nmt__cuda_pad: bytes rounded up to 256 (every piece of a scratch buffer starts aligned).
 * attention (cuda/attention.cu): q = B*Tq*H*dk and kv = B*Tk*H*dk floats (the head-major
 *   copies), scores = B*H*Tq*Tk floats of dropped weights (0 without dropout).
 * embedding_bwd (cuda/embedding.cu): rows and width C; asks CUB for its sort's temporary
 *   storage (host-side query; NMT_ERR_DEVICE).
 * layernorm_bwd (cuda/layernorm.cu): the column partial sums for width C.
 * nmt__cuda_sum (cuda/reductions.cu): the fixed grid's partials.
 * gemm16 (cuda/matmul.cu): the 16-bit copies of inp (M*K), w (N*K) and out/dout (M*N).
 * linear_half (cuda/matmul.cu, linear_half_bwd's bias gradient on `rows` x `cols` of dout):
 *   the BGRADB epilogue's fp32 output (cols floats) or the column sums' fp32 partials (one
 *   row of cols floats per row chunk when there is more than one chunk), the larger. */
static inline size_t nmt__cuda_pad(size_t bytes) { return (bytes + 255) / 256 * 256; }
size_t nmt__cuda_attention_scratch(size_t q, size_t kv, size_t scores);
nmt_status nmt__cuda_embedding_scratch(nmt_cuda_ctx *c, size_t rows, size_t width, size_t *bytes);
/* Runs the embedding backward's CUB radix sort once on one pair and once on 2^16 (zeroed, in
 * a temporary buffer), on the current stream, and waits: CUB's kernels are then loaded (see
 * "Kernel preload" above; they cannot be named for NMT_CUDA_PRELOAD). ctx_create calls it.
 * Errors: NMT_ERR_DEVICE, NMT_ERR_NOMEM, a wait's (NMT_ERR_ABORTED). */
nmt_status nmt__cuda_embedding_preload(nmt_cuda_ctx *c);
size_t nmt__cuda_layernorm_scratch(size_t width);
size_t nmt__cuda_sum_scratch(void);
size_t nmt__cuda_gemm16_bytes(size_t inp, size_t w, size_t out);
size_t nmt__cuda_linear_half_scratch(size_t rows, size_t cols);
/* Waits until everything enqueued on stream s (one of c's) has run, without blocking in the
 * driver: polls cudaStreamQuery, spinning first and then yielding the CPU (sched_yield); gives
 * up with NMT_ERR_ABORTED as soon as c's abort flag is raised, and returns what c's wait hook
 * returns when that is not NMT_OK. A stream stuck behind a collective whose peer died thus
 * ends in an error instead of a hang. `what` names the caller in error messages. Errors:
 * NMT_ERR_DEVICE (an asynchronous CUDA fault surfaces here), NMT_ERR_ABORTED, the hook's. */
nmt_status nmt__cuda_wait(nmt_cuda_ctx *c, cudaStream_t s, const char *what);
/* The same wait for event e (cudaEventQuery): returns once the work before e's last record has
 * run (at once for an event never recorded). Same errors. */
nmt_status nmt__cuda_wait_event(nmt_cuda_ctx *c, cudaEvent_t e, const char *what);
/* Reads and clears the device error word (waits for the stream with nmt__cuda_wait);
 * NMT_ERR_INTERNAL naming the ops whose arguments were bad. */
nmt_status nmt__cuda_check_errors(nmt_cuda_ctx *c);

/* *dst = (accumulate ? *dst : 0) + sum over i < n of x[i] (square: x[i]^2), on the current
 * stream: the deterministic reduction of sum_acc and sumsq (cuda/reductions.cu; a fixed grid, double
 * partials added in a fixed order, one rounding to float). dst is device memory. Uses the
 * current stream's scratch. Errors: NMT_ERR_DEVICE, NMT_ERR_NOMEM. */
nmt_status nmt__cuda_sum(nmt_cuda_ctx *c, float *dst, const float *x, size_t n, int square,
                         int accumulate);

/* Column-major GEMM through cuBLASLt on the current stream with its workspace, strided-batched:
 *   C_i (m x n, ldc) = alpha * op(A_i) op(B_i) + beta * C_i,  i < batch,
 * with X_i = X + i * strideX; op(A) is m x k (A stored k x m when transa), op(B) is k x n (B
 * stored n x k when transb). Row-major callers pass their matrices as the transposes (see
 * cuda/matmul.cu). allow_tf32: use TF32 tensor-core inputs when the context's precision is
 * tf32. beta = 0 never reads C (C may hold NaN). fp32 accumulation always. */
nmt_status nmt__cuda_gemm(nmt_cuda_ctx *c, int transa, int transb, int m, int n, int k,
                          float alpha, const float *A, int64_t lda, int64_t strideA,
                          const float *B, int64_t ldb, int64_t strideB, float beta, float *C,
                          int64_t ldc, int64_t strideC, int batch, int allow_tf32);

/* The same GEMM with A and B of type ab_type: CUDA_R_32F (exactly nmt__cuda_gemm), or
 * CUDA_R_16F / CUDA_R_16BF (__half / __nv_bfloat16 elements; leading dimensions and strides
 * in elements) with C fp32 and CUBLAS_COMPUTE_32F: products of the 16-bit inputs, fp32
 * accumulation and scaling, fp32 C/D. TF32 applies only to fp32 inputs. */
nmt_status nmt__cuda_gemm_ex(nmt_cuda_ctx *c, int transa, int transb, int m, int n, int k,
                             float alpha, const void *A, int64_t lda, int64_t strideA,
                             const void *B, int64_t ldb, int64_t strideB, cudaDataType_t ab_type,
                             float beta, float *C, int64_t ldc, int64_t strideC, int batch,
                             int allow_tf32);

/* Destroys the descriptors and layouts the GEMM cache holds (before cublasLtDestroy). */
void nmt__cuda_gemm_cache_free(nmt_cuda_ctx *c);

/* The cuBLASLt epilogues the backend uses (cublasLtEpilogue_t; cuda/gemm.cu has the rule for
 * when one is taken, and what each needs). The bias runs along D's rows: one value per row of
 * the column-major D, broadcast over its columns. The values are key words (nmt/cuda.h):
 * never renumbered. */
typedef enum {
  NMT_CUDA_EPI_NONE = 0,
  NMT_CUDA_EPI_BIAS = 1,          /* D = alpha op(A) op(B) + bias */
  NMT_CUDA_EPI_RELU = 2,          /* D = max(alpha op(A) op(B), 0) */
  NMT_CUDA_EPI_RELU_BIAS = 3,     /* D = max(alpha op(A) op(B) + bias, 0) */
  NMT_CUDA_EPI_RELU_AUX = 4,      /* RELU, and the bit-mask of the positive set into aux */
  NMT_CUDA_EPI_RELU_AUX_BIAS = 5, /* RELU_BIAS, and the bit-mask into aux */
  NMT_CUDA_EPI_DRELU = 6,         /* D = aux's bit ? alpha op(A) op(B) : 0 (aux read) */
  NMT_CUDA_EPI_BGRADB = 7         /* C = alpha op(A) op(B) + beta C, and bias (n, C's type)
                                   * WRITTEN with the sums of op(B) over k, per column of D */
} nmt__cuda_epilogue;

/* One GEMM of the general path (nmt__cuda_gemm_lt): the problem of nmt__cuda_gemm_ex with
 *   cd_type: C's and D's type (C = D, one pointer): CUDA_R_32F, or ab_type when that is
 *     CUDA_R_16F / CUDA_R_16BF (16-bit output, rounded once from the fp32 result; C read in it
 *     when beta != 0);
 *   epi and its pointers: bias (the BIAS kinds: m elements of cd_type, packed; batch i reads
 *     bias + i * bias_stride elements; BGRADB: the n-element output, cd_type), aux (the ReLU
 *     bit-mask, RELU_AUX kinds: written, DRELU: read; ld = m rounded up to 128 bits per
 *     column of D, nmt_relu_mask_bytes(n, m) bytes; 16-byte aligned to be taken).
 * Pointers are device memory of the current stream's ops. */
typedef struct {
  int transa, transb, m, n, k;
  float alpha;
  const void *A;
  int64_t lda, strideA;
  const void *B;
  int64_t ldb, strideB;
  cudaDataType_t ab_type;
  float beta;
  void *C;
  int64_t ldc, strideC;
  cudaDataType_t cd_type;
  int batch;
  int allow_tf32;
  nmt__cuda_epilogue epi;
  const void *bias;
  int64_t bias_stride;
  void *aux;
} nmt__cuda_gemm_desc;

/* The general GEMM. epi NONE: runs, *fused = 1 (no algorithm is an error). With an epilogue:
 * *fused = 1 when it ran with it; *fused = 0 when the epilogue is not taken for this call
 * (cuda/gemm.cu's rule: a pointer under 16-byte alignment, no algorithm for the key, or the
 * test knob nmt_cuda_ctx_set_epilogues), in which case NOTHING was enqueued and the caller
 * runs the unfused sequence. Which epilogues take which batch and beta: cuda/gemm.cu. Errors:
 * NMT_ERR_INTERNAL for a bad shape or type, a missing bias or aux, an epilogue outside its
 * batch/beta rule; NMT_ERR_DEVICE. */
nmt_status nmt__cuda_gemm_lt(nmt_cuda_ctx *c, const nmt__cuda_gemm_desc *g, int *fused);

/* One GEMM (batch 1, beta 0, fp32 C) with an epilogue, when cuBLASLt takes it:
 *   C (m x n, ldc) = epi(alpha * op(A) op(B) [+ bias (m)]),
 * A, B and ab_type, allow_tf32 as nmt__cuda_gemm_ex; bias fp32 (m elements, packed; NULL and
 * unread for NMT_CUDA_EPI_NONE / _RELU); epi one of NONE, BIAS, RELU, RELU_BIAS. *fused as
 * nmt__cuda_gemm_lt. Errors: as nmt__cuda_gemm_ex; NMT_ERR_INTERNAL for a bias epilogue
 * without a bias. */
nmt_status nmt__cuda_gemm_epilogue(nmt_cuda_ctx *c, int transa, int transb, int m, int n, int k,
                                   float alpha, const void *A, int64_t lda, const void *B,
                                   int64_t ldb, cudaDataType_t ab_type, float *C, int64_t ldc,
                                   int allow_tf32, nmt__cuda_epilogue epi, const float *bias,
                                   int *fused);

/* ------------------------------------------------------------------------------------------ */
/* device helpers */

#ifdef __CUDACC__

/* Grid for a grid-stride loop over n items: enough blocks to fill the device, never more than
 * 65535 (valid in every dimension on every architecture), at least 1. */
static inline unsigned nmt__grid(size_t n, int threads) {
  size_t b = (n + (size_t)threads - 1) / (size_t)threads;
  if (b < 1) b = 1;
  if (b > 65535) b = 65535;
  return (unsigned)b;
}

/* Philox4x32-10 exactly as src/util/rng.c (Salmon et al. 2011; Random123/cuRAND constants):
 * the 32x32->64 products split into __umulhi and the low product. */
__device__ __forceinline__ void nmt__philox(uint32_t &c0, uint32_t &c1, uint32_t &c2,
                                            uint32_t &c3, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int r = 0; r < 10; r++) {
    if (r > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
}

/* The four words of Philox block `blk` of `stream` under `seed` (nmt_rng_u32 of elements
 * 4*blk .. 4*blk+3). */
__device__ __forceinline__ void nmt__rng_block(uint64_t seed, uint64_t stream, uint64_t blk,
                                               uint32_t w[4]) {
  uint32_t c0 = (uint32_t)blk, c1 = (uint32_t)(blk >> 32), c2 = (uint32_t)stream,
           c3 = (uint32_t)(stream >> 32);
  nmt__philox(c0, c1, c2, c3, (uint32_t)seed, (uint32_t)(seed >> 32));
  w[0] = c0;
  w[1] = c1;
  w[2] = c2;
  w[3] = c3;
}

/* nmt_rng_u32(seed, stream, idx). */
__device__ __forceinline__ uint32_t nmt__rng_u32(uint64_t seed, uint64_t stream, uint64_t idx) {
  uint32_t w[4];
  nmt__rng_block(seed, stream, idx >> 2, w);
  const unsigned j = (unsigned)(idx & 3);
  /* Selects without a run-time index into w, which would move it to local memory. */
  return j == 0 ? w[0] : j == 1 ? w[1] : j == 2 ? w[2] : w[3];
}

/* Uniform in [0,1) from 32 bits, as nmt_rng_uniform: exact (24 bits, times 2^-24). */
__device__ __forceinline__ float nmt__u32_uniform(uint32_t u) {
  return __uint2float_rn(u >> 8) * 5.9604644775390625e-08f;
}

/* Dropout keep decision of element idx: uniform >= p (nmt/ref.h's rounding contract). */
__device__ __forceinline__ bool nmt__keep(uint64_t seed, uint64_t stream, uint64_t idx, float p) {
  return nmt__u32_uniform(nmt__rng_u32(seed, stream, idx)) >= p;
}

/* Block-wide sum / max. Every thread calls it with its partial; every thread gets the result.
 * blockDim.x must be a multiple of 32 and at most 1024; `sh` is __shared__ T[32]. The order of
 * combination is fixed by the thread layout, so results are bitwise repeatable. */
template <typename T>
__device__ __forceinline__ T nmt__warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v; /* valid in lane 0 */
}

template <typename T>
__device__ __forceinline__ T nmt__warp_max(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    T u = __shfl_down_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  return v;
}

template <typename T>
__device__ T nmt__block_sum(T v, T *sh) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = nmt__warp_sum(v);
  __syncthreads(); /* sh may still be read by a previous call */
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  if (wid == 0) {
    T r = lane < nw ? sh[lane] : T(0);
    r = nmt__warp_sum(r);
    if (lane == 0) sh[0] = r;
  }
  __syncthreads();
  return sh[0];
}

/* Max over the block; threads with nothing to contribute pass -INFINITY. */
template <typename T>
__device__ T nmt__block_max(T v, T *sh) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = nmt__warp_max(v);
  __syncthreads();
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  if (wid == 0) {
    /* Spare lanes (lane >= nw) take their own v: a max of some of warp 0's values, no larger
     * than sh[0], so it changes nothing. Not sh[0]: lane 0 writes it below, and nothing
     * orders that write after their read (compute-sanitizer racecheck, docs/gpu-runs.md). */
    T r = lane < nw ? sh[lane] : v;
    r = nmt__warp_max(r);
    if (lane == 0) sh[0] = r;
  }
  __syncthreads();
  return sh[0];
}

#endif /* __CUDACC__ */
#endif /* NMT_CUDA_COMMON_CUH */
