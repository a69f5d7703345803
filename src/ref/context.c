/* ref/context.c — the reference backend's context: device_count, ctx_create/destroy, the GEMM
 * precision (set_precision), the registered half copy of the weights (half_weights), an
 * inference context's transposed weights (infer_weights), the
 * scratch slots that matmul.c, attention.c and residual.c use, sized once by reserve_scratch
 * (growth past the plan is counted), the counters (GEMM calls, scratch growths), the stream
 * pool's bookkeeping (stream_pool / fork / use /
 * join) with the main-stream-only check that memory.c applies, and the run-level entries of
 * nmt/backend.h that concern the context: the abort flag (set_abort) and the communicator
 * factory (comm_create). The memory ops are in memory.c, the small vector ops in
 * reductions.c, the profiler's entries in profile.c; cuda/context.cu is the CUDA
 * counterpart. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/log.h"
#include "nmt/ref.h"
#include "nmt/types.h"

nmt_status nmt_ref_device_count(int *out) {
  *out = 1;
  return NMT_OK;
}

/* The reference context: the GEMM precision, the scratch slots (NMT_REF_SLOT_*) and the plan
 * that sized them, the counters, the registered half copy of the weights (nmt/ref.h), and the
 * stream pool's bookkeeping, which
 * exists only so that a CPU run rejects the misuses that would race on a GPU. `magic` lets
 * matmul refuse another backend's context instead of misreading it. */
enum { REF_CTX_MAGIC = 0x6e6d7472u, REF_MAX_AUX_STREAMS = 8 };

typedef struct {
  uint32_t magic;
  nmt_precision precision;
  float *scratch[NMT_REF_SCRATCH_SLOTS];
  size_t scratch_len[NMT_REF_SCRATCH_SLOTS]; /* floats */
  /* reserve_scratch's plan (planned = 0: none yet), kept for a later set_precision. */
  int planned;
  nmt_scratch_plan plan;
  nmt_backend_counters counters;
  /* half_weights: the half bits of half_src[0, half_n) live in half_dst (NULL: none). */
  const float *half_src;
  const uint16_t *half_dst;
  size_t half_n;
  /* infer_weights: infer_src[0, infer_n) is fixed; infer_t (infer_cap floats) holds the
   * transposes of the n_made matrices in made[] (offset in floats, N, K; cap_made entries). */
  const float *infer_src;
  size_t infer_n, infer_cap;
  float *infer_t;
  int n_made, cap_made;
  struct infer_made {
    size_t off;
    int N, K;
  } *made;
  int n_aux;   /* stream_pool's n */
  int forked;  /* between stream_fork and stream_join */
  int current; /* stream_use's i: 0 = main */
  atomic_int *abort; /* set_abort's flag (NULL: none): GEMMs end on it (nmt__ref_gemm_precision) */
} ref_ctx;

nmt_status nmt_ref_ctx_create(int device, void **ctx) {
  (void)device; /* every CPU worker is the host; the index is its rank */
  *ctx = NULL;
  ref_ctx *c = calloc(1, sizeof *c);
  if (!c) return nmt_errorf(NMT_ERR_NOMEM, "ref backend: cannot allocate a context");
  c->magic = REF_CTX_MAGIC;
  c->precision = NMT_PRECISION_FP32;
  *ctx = c;
  return NMT_OK;
}

void nmt_ref_ctx_destroy(void *ctx) {
  ref_ctx *c = ctx;
  if (!c) return;
  for (int i = 0; i < NMT_REF_SCRATCH_SLOTS; i++) free(c->scratch[i]);
  free(c->infer_t);
  free(c->made);
  c->magic = 0;
  free(c);
}

static const char *precision_name(nmt_precision mode) {
  switch (mode) {
    case NMT_PRECISION_FP32: return "fp32";
    case NMT_PRECISION_TF32: return "tf32";
    case NMT_PRECISION_FP16: return "fp16";
    case NMT_PRECISION_BF16: return "bf16";
  }
  return "?";
}

static int half_mode(nmt_precision mode) {
  return mode == NMT_PRECISION_FP16 || mode == NMT_PRECISION_BF16;
}

static ref_ctx *as_ref(void *ctx) {
  ref_ctx *c = ctx;
  return c && c->magic == REF_CTX_MAGIC ? c : NULL;
}

nmt_status nmt_ref_set_precision(void *ctx, nmt_precision mode) {
  if (mode != NMT_PRECISION_FP32 && mode != NMT_PRECISION_TF32 && mode != NMT_PRECISION_FP16 &&
      mode != NMT_PRECISION_BF16)
    return nmt_errorf(NMT_ERR_CONFIG, "ref backend: unknown precision mode %d", (int)mode);
  if (!ctx) {
    /* A NULL context means fp32: there is nowhere to keep a half mode. */
    if (mode == NMT_PRECISION_FP16 || mode == NMT_PRECISION_BF16)
      return nmt_errorf(NMT_ERR_CONFIG,
                        "ref backend: precision mode %s needs a context from ctx_create (a NULL "
                        "context computes fp32)",
                        precision_name(mode));
    return NMT_OK;
  }
  ref_ctx *c = as_ref(ctx);
  if (!c) return nmt_errorf(NMT_ERR_INTERNAL, "ref set_precision: not a reference context");
  if (c->half_src && mode != c->precision)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref set_precision: a %s copy of the weights is registered (half_weights); "
                      "unregister it before switching to %s",
                      precision_name(c->precision), precision_name(mode));
  /* fp16/bf16 GEMMs round their inputs into scratch: size it from the plan now, not in a step.
   * A failed reserve keeps the old mode (the slots only grow, so the context stays whole). */
  const nmt_precision was = c->precision;
  c->precision = mode;
  nmt_status s = c->planned ? nmt_ref_reserve_scratch(c, &c->plan) : NMT_OK;
  if (s != NMT_OK) c->precision = was;
  return s;
}

nmt_status nmt_ref_half_weights(void *ctx, const float *src, void *dst, size_t n) {
  ref_ctx *c = as_ref(ctx);
  if (ctx && !c) return nmt_errorf(NMT_ERR_INTERNAL, "ref half_weights: not a reference context");
  if (!src) {
    /* Unregister: a NULL context never had a copy. */
    if (c) {
      c->half_src = NULL;
      c->half_dst = NULL;
      c->half_n = 0;
    }
    return NMT_OK;
  }
  if (!c || !half_mode(c->precision))
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref half_weights: precision %s does not round GEMM inputs: there is no half "
                      "copy to keep (fp16/bf16 only)",
                      c ? precision_name(c->precision) : "fp32 (NULL context)");
  if (!dst || n == 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref half_weights: %s", !dst ? "dst is NULL" : "n is 0");
  if (c->half_src)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref half_weights: a copy is already registered (one per context: "
                      "unregister it with src = NULL first)");
  c->half_src = src;
  c->half_dst = dst;
  c->half_n = n;
  return NMT_OK;
}

const uint16_t *nmt__ref_half_copy(void *ctx, const float *w, size_t len) {
  const ref_ctx *c = as_ref(ctx);
  size_t off;
  if (!c || !nmt_half_copy_offset(c->half_src, c->half_n, w, len, &off)) return NULL;
  return c->half_dst + off;
}

nmt_status nmt_ref_infer_weights(void *ctx, const float *src, size_t n) {
  ref_ctx *c = as_ref(ctx);
  if (ctx && !c) return nmt_errorf(NMT_ERR_INTERNAL, "ref infer_weights: not a reference context");
  /* Whatever comes next, the earlier declaration is over: its weights are being replaced. */
  if (c) {
    c->infer_src = NULL;
    c->infer_n = 0;
    c->n_made = 0;
  }
  if (!src) {
    if (c) {
      free(c->infer_t);
      free(c->made);
      c->infer_t = NULL;
      c->made = NULL;
      c->infer_cap = 0;
      c->cap_made = 0;
    }
    return NMT_OK;
  }
  if (!c)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref infer_weights: the NULL context has nowhere to keep "
                      "a copy of the weights (use ctx_create)");
  if (n == 0) return nmt_errorf(NMT_ERR_INTERNAL, "ref infer_weights: n is 0");
  if (n > c->infer_cap) {
    /* malloc, not calloc: only the matrices used are ever written (and their pages touched). */
    float *t = malloc(n * sizeof(float));
    if (!t)
      return nmt_errorf(NMT_ERR_NOMEM, "ref infer_weights: %zu MB for the transposed weights",
                        n * sizeof(float) >> 20);
    free(c->infer_t);
    c->infer_t = t;
    c->infer_cap = n;
  }
  c->infer_src = src;
  c->infer_n = n;
  return NMT_OK;
}

const float *nmt__ref_infer_copy(void *ctx, const float *w, int N, int K) {
  ref_ctx *c = as_ref(ctx);
  if (!c || !c->infer_src || N < 1 || K < 1) return NULL;
  const size_t len = (size_t)N * (size_t)K;
  size_t off;
  if (!nmt_half_copy_offset(c->infer_src, c->infer_n, w, len, &off)) return NULL;
  for (int i = 0; i < c->n_made; i++) {
    if (c->made[i].off == off && c->made[i].N == N && c->made[i].K == K)
      return c->infer_t + off;
    const size_t o = c->made[i].off, l = (size_t)c->made[i].N * (size_t)c->made[i].K;
    if (off < o + l && o < off + len) return NULL; /* another shape over the same floats */
  }
  if (c->n_made == c->cap_made) {
    /* Grows by doubling, in the first decoding step after the first load (a trainer's
     * validation rig: its trial step at create); later loads make the same matrices and find
     * the room. */
    const int cap = c->cap_made ? 2 * c->cap_made : 64;
    struct infer_made *m = realloc(c->made, (size_t)cap * sizeof *m);
    if (!m) return NULL; /* the plain weights then: slower, as correct */
    c->made = m;
    c->cap_made = cap;
  }
  /* W^T (K, N): element (k, n) = w[n * K + k], written row by row of W^T (in blocks of 16
   * rows of W so that both sides stay in cache). */
  float *t = c->infer_t + off;
  enum { BN = 16 };
  for (int n0 = 0; n0 < N; n0 += BN) {
    const int n1 = n0 + BN < N ? n0 + BN : N;
    for (int k = 0; k < K; k++)
      for (int n = n0; n < n1; n++) t[(size_t)k * N + n] = w[(size_t)n * K + k];
  }
  c->made[c->n_made].off = off;
  c->made[c->n_made].N = N;
  c->made[c->n_made].K = K;
  c->n_made++;
  return t;
}

/* 1 once the flag registered with set_abort is raised (none registered: 0). */
static int aborted(const ref_ctx *c) {
  return c->abort && atomic_load_explicit(c->abort, memory_order_relaxed);
}

nmt_status nmt__ref_gemm_precision(void *ctx, const char *op, nmt_precision *out) {
  *out = NMT_PRECISION_FP32;
  if (!ctx) return NMT_OK;
  ref_ctx *c = as_ref(ctx);
  if (!c) return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: ctx is not a reference context", op);
  *out = c->precision;
  /* A CPU step is minutes of GEMMs on a big model: each GEMM looks at the run's abort flag
   * first, so a second SIGINT or a failed peer ends the step within one GEMM instead of after
   * it (a GEMM is not split into slices to look more often: OpenBLAS rounds a sub-block
   * differently, and make run's losses would change). No message: the error that raised the
   * flag is the run's. */
  return aborted(c) ? NMT_ERR_ABORTED : NMT_OK;
}

/* Makes slot hold at least n floats (contents not kept: each call fills what it uses),
 * allocating exactly `want` floats (>= n) when it must grow. */
static nmt_status slot_grow(ref_ctx *c, int slot, size_t n, size_t want) {
  if (n <= c->scratch_len[slot]) return NMT_OK;
  void *p = NULL;
  if (want < n || want > SIZE_MAX / sizeof(float) ||
      posix_memalign(&p, 64, want * sizeof(float)) != 0)
    return nmt_errorf(NMT_ERR_NOMEM, "ref backend: cannot allocate %zu floats of scratch (slot %d)",
                      n, slot);
  free(c->scratch[slot]);
  c->scratch[slot] = p;
  c->scratch_len[slot] = want;
  return NMT_OK;
}

nmt_status nmt__ref_scratch(void *ctx, int slot, size_t n, float **out) {
  ref_ctx *c = as_ref(ctx);
  if (!c || slot < 0 || slot >= NMT_REF_SCRATCH_SLOTS)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref scratch: bad context or slot %d", slot);
  if (n > c->scratch_len[slot]) {
    /* A call the reservation did not cover: correct, but it allocates inside a step. Grow by a
     * quarter more so that a slightly longer batch does not allocate again. */
    if (c->planned)
      nmt_log(NMT_LOG_WARN,
              "ref backend: scratch slot %d grew from %zu to %zu floats inside a step (the "
              "scratch plan did not cover this call: nmt_model_scratch_plan)",
              slot, c->scratch_len[slot], n);
    c->counters.scratch_growths++;
    NMT_TRY(slot_grow(c, slot, n, n + n / 4));
  }
  *out = c->scratch[slot];
  return NMT_OK;
}

nmt_status nmt__ref_scratch_or_malloc(void *ctx, int slot, size_t n, float **out, void **owned) {
  *out = NULL;
  *owned = NULL;
  if (as_ref(ctx)) return nmt__ref_scratch(ctx, slot, n, out);
  if (n > SIZE_MAX / sizeof(float) || !(*owned = malloc(n ? n * sizeof(float) : 1)))
    return nmt_errorf(NMT_ERR_NOMEM, "ref backend: cannot allocate %zu floats of scratch", n);
  *out = *owned;
  return NMT_OK;
}

void nmt__ref_count_gemm(void *ctx, unsigned n) {
  ref_ctx *c = as_ref(ctx);
  if (c) c->counters.gemm_calls += n;
}

void nmt__ref_count_cast(void *ctx, unsigned n) {
  ref_ctx *c = as_ref(ctx);
  if (c) c->counters.casts += n;
}

nmt_status nmt__ref_half_mode(void *ctx, const char *op, int *bf16) {
  nmt_precision mode;
  NMT_TRY(nmt__ref_gemm_precision(ctx, op, &mode));
  if (!as_ref(ctx) || !half_mode(mode))
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref %s: a half-storage op needs a reference context in fp16 or bf16 mode "
                      "(this one computes %s)",
                      op, ctx ? precision_name(mode) : "fp32: a NULL context");
  *bf16 = mode == NMT_PRECISION_BF16;
  return NMT_OK;
}

static size_t max_z(size_t a, size_t b) { return a > b ? a : b; }

nmt_status nmt_ref_reserve_scratch(void *ctx, const nmt_scratch_plan *plan) {
  if (!ctx) return NMT_OK;
  ref_ctx *c = as_ref(ctx);
  if (!c) return nmt_errorf(NMT_ERR_INTERNAL, "ref reserve_scratch: not a reference context");
  if (!plan) return nmt_errorf(NMT_ERR_INTERNAL, "ref reserve_scratch: NULL plan");
  if (c->forked)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref reserve_scratch: called between stream_fork and stream_join");
  /* Every stream's ops run here, on this thread, through the same slots: the larger need. */
  nmt_scratch_need n = plan->main;
  nmt_scratch_need_max(&n, &plan->aux);
  size_t want[NMT_REF_SCRATCH_SLOTS] = {0};
  if (half_mode(c->precision)) {
    want[NMT_REF_SLOT_GEMM_A] = max_z(n.gemm_inp, n.gemm_out);
    want[NMT_REF_SLOT_GEMM_W] = n.gemm_w;
    want[NMT_REF_SLOT_GEMM_B] = n.gemm_inp;
  }
  want[NMT_REF_SLOT_ATT_DROP] = n.att_scores;
  want[NMT_REF_SLOT_ATT_KEEP] = (n.att_scores + sizeof(float) - 1) / sizeof(float);
  want[NMT_REF_SLOT_ROW] = n.width;
  if (n.half_acts) {
    /* The half-storage ops' fp32 working copies (nmt/ref.h): a GEMM's output or input
     * gradient before rounding, attention's widened q/k/v/out and gradients, one logits row. */
    want[NMT_REF_SLOT_GEMM_OUT] = max_z(n.gemm_out, n.gemm_inp);
    want[NMT_REF_SLOT_ATT_Q] = want[NMT_REF_SLOT_ATT_O] = want[NMT_REF_SLOT_ATT_DQ] = n.att_q;
    want[NMT_REF_SLOT_ATT_K] = want[NMT_REF_SLOT_ATT_V] = n.att_kv;
    want[NMT_REF_SLOT_ATT_DK] = want[NMT_REF_SLOT_ATT_DV] = n.att_kv;
    want[NMT_REF_SLOT_XENT_ROW] = n.xent_cols;
  }
  for (int i = 0; i < NMT_REF_SCRATCH_SLOTS; i++) NMT_TRY(slot_grow(c, i, want[i], want[i]));
  /* Keep the element-wise larger of this plan and earlier ones (monotonic, like the slots). */
  nmt_scratch_plan_max(&c->plan, plan); /* the context starts zeroed */
  c->planned = 1;
  return NMT_OK;
}

nmt_status nmt_ref_counters(void *ctx, nmt_backend_counters *out) {
  memset(out, 0, sizeof *out);
  ref_ctx *c = as_ref(ctx);
  if (!c)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref counters: %s",
                      ctx ? "not a reference context"
                          : "NULL context (counts live in a context from ctx_create)");
  *out = c->counters;
  return NMT_OK;
}

/* Copies, memset and synchronize are main-stream only (nmt/backend.h): between a fork and its
 * join they would be ordered after the main stream's work but not the aux streams', so on a GPU
 * they could read a result still being written. */
nmt_status nmt__ref_main_stream_only(void *ctx, const char *op) {
  ref_ctx *c = as_ref(ctx);
  if (c && c->forked)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref %s: called between stream_fork and stream_join (copies, memset and "
                      "synchronize are main-stream only: join first)",
                      op);
  return NMT_OK;
}

/* ---- stream pool: bookkeeping only (every ref op runs at once on the calling thread) ---- */

/* The context whose bookkeeping a stream op updates: NULL for a NULL ctx (nothing to record,
 * so the checks that need the state are skipped), NMT_ERR_INTERNAL for a foreign context. */
static nmt_status stream_ctx(void *ctx, const char *op, ref_ctx **out) {
  *out = NULL;
  if (!ctx) return NMT_OK;
  *out = as_ref(ctx);
  if (!*out) return nmt_errorf(NMT_ERR_INTERNAL, "ref %s: ctx is not a reference context", op);
  return NMT_OK;
}

nmt_status nmt_ref_stream_pool(void *ctx, int n) {
  if (n < 0 || n > REF_MAX_AUX_STREAMS)
    return nmt_errorf(NMT_ERR_CONFIG, "ref stream_pool: %d aux streams, want 0..%d", n,
                      REF_MAX_AUX_STREAMS);
  ref_ctx *c;
  NMT_TRY(stream_ctx(ctx, "stream_pool", &c));
  if (!c) return NMT_OK;
  if (c->forked)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref stream_pool: called between stream_fork and stream_join (the pool "
                      "must be set on an idle context)");
  c->n_aux = n;
  return NMT_OK;
}

nmt_status nmt_ref_stream_fork(void *ctx) {
  ref_ctx *c;
  NMT_TRY(stream_ctx(ctx, "stream_fork", &c));
  if (!c) return NMT_OK;
  if (c->forked)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref stream_fork: already forked (every fork needs its stream_join first)");
  c->forked = 1;
  c->current = 0;
  return NMT_OK;
}

nmt_status nmt_ref_stream_use(void *ctx, int i) {
  ref_ctx *c;
  NMT_TRY(stream_ctx(ctx, "stream_use", &c));
  int n = c ? c->n_aux : REF_MAX_AUX_STREAMS;
  if (i < 0 || i > n)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref stream_use: stream %d outside [0, %d] (0 = main, 1..n = aux)", i, n);
  if (!c) return NMT_OK;
  if (!c->forked)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "ref stream_use(%d): no stream_fork before it (aux streams have not "
                      "waited for the main stream's work)",
                      i);
  c->current = i;
  return NMT_OK;
}

nmt_status nmt_ref_stream_join(void *ctx) {
  ref_ctx *c;
  NMT_TRY(stream_ctx(ctx, "stream_join", &c));
  if (!c) return NMT_OK;
  if (!c->forked)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref stream_join: no stream_fork to join");
  c->forked = 0;
  c->current = 0;
  return NMT_OK;
}

/* ---- run level: the abort flag and the communicator ---- */

nmt_status nmt_ref_ctx_set_abort(void *ctx, atomic_int *abort) {
  /* Every ref op completes before it returns, so no wait of a CPU worker can hang on a peer
   * (the host communicator polls the flag it was created with); the GEMMs look at the flag
   * so that a long step ends early once the run is aborted. */
  ref_ctx *c = as_ref(ctx);
  if (c) c->abort = abort;
  return NMT_OK;
}

nmt_status nmt_ref_comm_create(int n, const int *devices, void *const *ctxs, atomic_int *abort,
                               nmt_comm **comms) {
  (void)devices;
  (void)ctxs;
  return nmt_comm_create_host(n, abort, comms);
}
