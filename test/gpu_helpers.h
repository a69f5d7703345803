/* test/gpu_helpers.h — the harness of the CUDA-vs-reference op tests (test/test_cuda_<op>.c,
 * one file per cuda/<op>.cu): a context on device 0 and the buffers of one test, freed
 * together; random inputs; poisoned outputs; the two comparisons; the gate that holds the
 * compute stream; the pieces of the step control block and of the half copy that several op
 * files check.
 *
 * Each test runs the same call on both backends. Outputs a forward writes are poisoned (NaN)
 * on the device first, so an element the kernel forgets shows up; gradient outputs (which
 * accumulate) start from the same random values on both sides. NMT_TG_CLOSE: |gpu - ref| <=
 * atol + rtol |ref| with atol = rtol * max|ref| over the array (a GEMM element is only
 * determined to some ulps of the array's large values), the worst index reported; each file
 * says which rtol it uses and why. NMT_TG_EXACT: bitwise.
 *
 * Without a CUDA device (or in a CPU-only build) every NMT_TG_TEST prints
 * "# SKIP no CUDA device"; with NMT_EXPECT_GPU=1 (tools/gpu-check.sh on a GPU machine) the
 * runner counts that skip as a failure (test/test.h).
 *
 * Self-test of the harness without a GPU: with -DNMT_CUDA_TESTS_ON_REF in CFLAGS (every test
 * file and this harness must see it: the gate's layout depends on it) the reference backend
 * plays the device (every comparison must then be exact), which checks the buffer layouts,
 * slices and aliasing of the tests themselves:
 *   CFLAGS="-O1 -g -fsanitize=address,undefined -DNMT_CUDA_TESTS_ON_REF" \
 *     make CUDA=0 BUILD=build/onref build/onref/test_nmt && build/onref/test_nmt cuda_
 *
 * defines: nmt_tg_gpu, NMT_TG_MAX_BUFS, NMT_TG_MAX_PINNED, NMT_TG_TEST, nmt_tg_device_backend,
 *          nmt_tg_open, nmt_tg_close,
 *          nmt_tg_halloc, nmt_tg_dalloc, nmt_tg_dup_dev, nmt_tg_fetch, nmt_tg_poison,
 *          nmt_tg_randn, nmt_tg_hcopy, nmt_tg_max_abs, NMT_TG_CLOSE, NMT_TG_EXACT,
 *          NMT_TG_SETUP_OK, nmt_tg_pinned, nmt_tg_fill_ramp, NMT_TG_HAVE_GATE, nmt_tg_gate,
 *          nmt_tg_gate_close, nmt_tg_gate_open, nmt_tg_first_err, nmt_tg_keep, NMT_TG_NO_ERR,
 *          nmt_tg_ctl_init, nmt_tg_half_modes, nmt_tg_same_half, nmt_tg_half_bf16,
 *          nmt_tg_half_twin,
 *          nmt_tg_half_encode, nmt_tg_half_decode, nmt_tg_half_poison, NMT_TG_HALF_CLOSE
 */
#ifndef NMT_TEST_GPU_HELPERS_H
#define NMT_TEST_GPU_HELPERS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "nmt/backend.h"
#include "test.h"

/* The gated-stream tests need the CUDA runtime (a host function on the compute stream). */
#if defined(NMT_CUDA) && !defined(NMT_CUDA_TESTS_ON_REF)
#include <pthread.h>
#define NMT_TG_HAVE_GATE 1
#else
#define NMT_TG_HAVE_GATE 0
#endif

/* ------------------------------------------------------------------------------------------ */
/* a context on device 0 and the buffers of one test, freed together */

enum { NMT_TG_MAX_BUFS = 1024 };

enum { NMT_TG_MAX_PINNED = 16 };

typedef struct {
  const nmt_backend *be;
  void *ctx;
  void *dev[NMT_TG_MAX_BUFS];
  int n_dev;
  void *host[NMT_TG_MAX_BUFS];
  int n_host;
  void *pinned[NMT_TG_MAX_PINNED]; /* from host_alloc */
  int n_pinned;
} nmt_tg_gpu;

/* The backend that plays the device: cuda's table (NULL in a CPU-only build), or the
 * reference's with -DNMT_CUDA_TESTS_ON_REF (a NULL context, one "device"). */
const nmt_backend *nmt_tg_device_backend(void);

/* 1: a context on device 0; 0: no CUDA backend or device (skip); -1: failure (recorded). */
int nmt_tg_open(nmt_tg_gpu *g);

/* Frees every tracked buffer and the context (a no-op on a gpu that never opened). */
void nmt_tg_close(nmt_tg_gpu *g);

/* Runs body(g) with an open context, then frees everything (also when body failed early). */
#define NMT_TG_TEST(name)                                    \
  static void name##_body(nmt_tg_gpu *g);                    \
  NMT_TEST(name) {                                           \
    nmt_tg_gpu g;                                            \
    int r = nmt_tg_open(&g);                                 \
    if (r == 0) NMT_SKIP("no CUDA device");                  \
    if (r > 0) name##_body(&g);                              \
    nmt_tg_close(&g);                                        \
  }                                                          \
  static void name##_body(nmt_tg_gpu *g)

/* Tracked host memory of `bytes` (at least 1); NULL with the failure recorded. */
void *nmt_tg_halloc(nmt_tg_gpu *g, size_t bytes);

/* Tracked device memory of `bytes`; NULL with the failure recorded. */
void *nmt_tg_dalloc(nmt_tg_gpu *g, size_t bytes);

/* A device copy of host memory. */
void *nmt_tg_dup_dev(nmt_tg_gpu *g, const void *h, size_t bytes);

/* A host copy of device memory (waits for the device). */
void *nmt_tg_fetch(nmt_tg_gpu *g, const void *d, size_t bytes);

/* Fills n device floats with NaN. */
void nmt_tg_poison(nmt_tg_gpu *g, float *d, size_t n);

/* n normal(0, scale) + shift floats, tracked host memory; a different stream per call site. */
float *nmt_tg_randn(nmt_tg_gpu *g, size_t n, uint64_t seed, float scale, float shift);

/* A tracked host copy. */
float *nmt_tg_hcopy(nmt_tg_gpu *g, const float *x, size_t n);

/* max |x[i]| over n floats (0 for n = 0). */
double nmt_tg_max_abs(const float *x, size_t n);

/* |got - want| <= rtol (max|want| + |want|), the worst index reported on failure. */
#define NMT_TG_CLOSE(what, got, want, n, rtol)                                            \
  do {                                                                                    \
    const float *got_ = (got), *want_ = (want);                                           \
    NMT_ASSERT(got_ != NULL && want_ != NULL);                                            \
    double atol_ = (rtol) * nmt_tg_max_abs(want_, (n));                                   \
    if (!nmt_test_close(__FILE__, __LINE__, (what), got_, want_, (n), atol_, (rtol)))     \
      return;                                                                             \
  } while (0)

/* Bitwise equality (NaN never equal). */
#define NMT_TG_EXACT(what, got, want, n)                                                  \
  do {                                                                                    \
    const float *got_ = (got), *want_ = (want);                                           \
    NMT_ASSERT(got_ != NULL && want_ != NULL);                                            \
    if (!nmt_test_close(__FILE__, __LINE__, (what), got_, want_, (n), 0.0, 0.0)) return; \
  } while (0)

/* Returns from the test if an allocation or copy above has failed. */
#define NMT_TG_SETUP_OK() \
  do {                    \
    if (nmt_test_failed()) return; \
  } while (0)

/* ------------------------------------------------------------------------------------------ */
/* staging buffers and the gate (docs/cuda.md "Streams") */

/* A pinned staging buffer of n floats, freed with the test. */
float *nmt_tg_pinned(nmt_tg_gpu *g, size_t n);

/* x[i] = base + i, exact in fp32 while below 2^24. */
void nmt_tg_fill_ramp(float *x, size_t n, float base);

/* A gate holds the compute stream: work enqueued after nmt_tg_gate_close waits until
 * nmt_tg_gate_open, or until the valve thread opens it after `valve_ms` (so that a wrong
 * implementation fails instead of hanging; one test uses the valve as its opener). Without the
 * CUDA runtime (the reference self-test) every op has run by the time it returns: the gate is
 * open from the start. */
typedef struct {
  atomic_int open;
  long valve_ms;
  int started;
#if NMT_TG_HAVE_GATE
  pthread_t valve;
#endif
} nmt_tg_gate;

/* 1 once the compute stream is held, 0 on failure (recorded). */
int nmt_tg_gate_close(nmt_tg_gpu *g, nmt_tg_gate *gt, long valve_ms);

/* Opens the gate and joins the valve thread. */
void nmt_tg_gate_open(nmt_tg_gate *gt);

/* Between nmt_tg_gate_close and nmt_tg_gate_open a failed assertion must not return (the
 * context could not be destroyed while its stream is held): the first failing call is kept
 * (nmt_tg_keep) and reported after (NMT_TG_NO_ERR). */
typedef struct {
  nmt_status st;
  const char *what;
  char msg[256];
} nmt_tg_first_err;

/* Records st (with nmt_last_error()) in *e unless st is NMT_OK or *e already holds an error. */
void nmt_tg_keep(nmt_tg_first_err *e, nmt_status st, const char *what);

/* Fails the test with the kept error, if any. */
#define NMT_TG_NO_ERR(e)                                                                  \
  do {                                                                                    \
    if ((e).st != NMT_OK) {                                                               \
      nmt_test_fail(__FILE__, __LINE__, "%s: %s: %s", (e).what, nmt_status_str((e).st), \
                    (e).msg);                                                             \
      return;                                                                             \
    }                                                                                     \
  } while (0)

/* ------------------------------------------------------------------------------------------ */
/* the step control block and the half working copy (docs/cuda.md "Step control") */

/* A fresh control block: the loss scaler's state, the rest zero (as the host writes it at the
 * start of a segment). */
nmt_step_ctl nmt_tg_ctl_init(float scale, int64_t good, int64_t skipped);

/* The two 16-bit modes, fp16 then bf16. */
extern const nmt_precision nmt_tg_half_modes[2];

/* Device half bits `got` (n) against the reference's bits of x (nmt_half_fp16_bits /
 * nmt_half_bf16_bits): equal, or both NaN (any NaN pattern is accepted from the device).
 * Records a failure with the count and the first mismatch; 1 if all equal. */
int nmt_tg_same_half(nmt_precision mode, const char *what, const uint16_t *got, const float *x,
                     size_t n);

/* ---- the half-storage ops' buffers: the context's 16-bit patterns (nmt_act, uint16_t),
 * encoded and decoded with nmt/half.h ---- */

/* 1 for bf16, 0 for fp16. */
int nmt_tg_half_bf16(nmt_precision mode);

/* The half ops' two sides in one precision: sets `mode` and reserves `plan` on the device
 * context, and returns a reference context (nmt_ref_ctx_create) in the same mode with the same
 * plan, for the caller to destroy (nmt_ref_ctx_destroy); NULL after recording a failure that
 * names the side that refused. */
void *nmt_tg_half_twin(nmt_tg_gpu *g, nmt_precision mode, const nmt_scratch_plan *plan);
/* Tracked host bits of round(x[i]) (the reference's rounding), n of them. */
uint16_t *nmt_tg_half_encode(nmt_tg_gpu *g, nmt_precision mode, const float *x, size_t n);
/* Tracked host floats of the values of n half bits. */
float *nmt_tg_half_decode(nmt_tg_gpu *g, nmt_precision mode, const uint16_t *h, size_t n);
/* Fills n device half elements with 0xffff (a NaN in both types): an element an op forgets to
 * write shows. */
void nmt_tg_half_poison(nmt_tg_gpu *g, uint16_t *d, size_t n);
/* Half values got (device) vs want (reference), n of them: each pair equal, or one unit in
 * the last place of the half type apart (the two fp32 values the backends round differ by fp32
 * rounding noise and may straddle a rounding boundary), or within rtol (max|want| + |want|) (an
 * element much smaller than the array's largest, whose fp32 noise can span several half ulps,
 * as NMT_TG_CLOSE allows in fp32); a NaN only against a NaN; and at least min_exact of the
 * pairs equal (a wrong rounding, truncation say, moves about half of them by one unit: the ulp
 * allowance alone would not see it). Reports the count, the worst pair and the tolerance; 1 if
 * they agree. */
int nmt_tg_half_close_at(const char *file, int line, nmt_precision mode, const char *what,
                         const uint16_t *got, const uint16_t *want, size_t n, double rtol,
                         double min_exact);
#define NMT_TG_HALF_CLOSE(mode, what, got, want, n, rtol, min_exact) \
  nmt_tg_half_close_at(__FILE__, __LINE__, mode, what, got, want, n, rtol, min_exact)

#endif /* NMT_TEST_GPU_HELPERS_H */
