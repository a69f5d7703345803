/* test/gpu_helpers.c — the harness of the CUDA-vs-reference op tests (see gpu_helpers.h). */
#include "gpu_helpers.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/half.h"
#include "nmt/ref.h"
#include "nmt/rng.h"

#if NMT_TG_HAVE_GATE
#include <cuda_runtime_api.h>
#include <time.h>

#include "nmt/cuda.h"
#endif

/* ------------------------------------------------------------------------------------------ */
/* a context on device 0 and the buffers of one test, freed together */

#ifdef NMT_CUDA_TESTS_ON_REF
/* The reference has the whole table (a NULL context, one "device"). */
const nmt_backend *nmt_tg_device_backend(void) { return &nmt_backend_ref; }
#else
const nmt_backend *nmt_tg_device_backend(void) { return nmt_backend_cuda_get(); }
#endif

int nmt_tg_open(nmt_tg_gpu *g) {
  memset(g, 0, sizeof *g);
  g->be = nmt_tg_device_backend();
  if (!g->be) return 0;
  int n = 0;
  if (g->be->device_count(&n) != NMT_OK || n < 1) return 0;
  nmt_status s = g->be->ctx_create(0, &g->ctx);
  if (s != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "ctx_create(0): %s: %s", nmt_status_str(s),
                  nmt_last_error());
    return -1;
  }
  return 1;
}

void nmt_tg_close(nmt_tg_gpu *g) {
  if (!g->be) return;
  for (int i = 0; i < g->n_dev; i++) g->be->free(g->ctx, g->dev[i]);
  for (int i = 0; i < g->n_host; i++) free(g->host[i]);
  for (int i = 0; i < g->n_pinned; i++) g->be->host_free(g->ctx, g->pinned[i]);
  if (g->ctx) g->be->ctx_destroy(g->ctx);
  memset(g, 0, sizeof *g);
}

void *nmt_tg_halloc(nmt_tg_gpu *g, size_t bytes) {
  void *p = g->n_host < NMT_TG_MAX_BUFS ? malloc(bytes ? bytes : 1) : NULL;
  if (!p) {
    nmt_test_fail(__FILE__, __LINE__, "host allocation of %zu bytes (buffer %d)", bytes,
                  g->n_host);
    return NULL;
  }
  g->host[g->n_host++] = p;
  return p;
}

void *nmt_tg_dalloc(nmt_tg_gpu *g, size_t bytes) {
  void *p = NULL;
  nmt_status s = g->n_dev < NMT_TG_MAX_BUFS ? g->be->malloc(g->ctx, bytes, &p) : NMT_ERR_NOMEM;
  if (s != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "device allocation of %zu bytes: %s", bytes,
                  nmt_last_error());
    return NULL;
  }
  g->dev[g->n_dev++] = p;
  return p;
}

void *nmt_tg_dup_dev(nmt_tg_gpu *g, const void *h, size_t bytes) {
  void *d = nmt_tg_dalloc(g, bytes);
  if (!d) return NULL;
  nmt_status s = g->be->copy_h2d(g->ctx, d, h, bytes);
  if (s != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "copy_h2d: %s", nmt_last_error());
    return NULL;
  }
  return d;
}

void *nmt_tg_fetch(nmt_tg_gpu *g, const void *d, size_t bytes) {
  void *h = nmt_tg_halloc(g, bytes);
  if (!h) return NULL;
  nmt_status s = g->be->copy_d2h(g->ctx, h, d, bytes);
  if (s != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "copy_d2h: %s: %s", nmt_status_str(s), nmt_last_error());
    return NULL;
  }
  return h;
}

void nmt_tg_poison(nmt_tg_gpu *g, float *d, size_t n) {
  float *h = malloc((n ? n : 1) * sizeof *h);
  if (!h) {
    nmt_test_fail(__FILE__, __LINE__, "poison: out of host memory");
    return;
  }
  for (size_t i = 0; i < n; i++) h[i] = NAN;
  if (g->be->copy_h2d(g->ctx, d, h, n * sizeof *h) != NMT_OK)
    nmt_test_fail(__FILE__, __LINE__, "poison: %s", nmt_last_error());
  free(h);
}

float *nmt_tg_randn(nmt_tg_gpu *g, size_t n, uint64_t seed, float scale, float shift) {
  float *x = nmt_tg_halloc(g, n * sizeof *x);
  if (x)
    for (size_t i = 0; i < n; i++) x[i] = shift + scale * nmt_rng_normal(seed, 991, i);
  return x;
}

float *nmt_tg_hcopy(nmt_tg_gpu *g, const float *x, size_t n) {
  float *y = nmt_tg_halloc(g, n * sizeof *y);
  if (y) memcpy(y, x, n * sizeof *y);
  return y;
}

double nmt_tg_max_abs(const float *x, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; i++) m = fmax(m, fabs((double)x[i]));
  return m;
}

/* ------------------------------------------------------------------------------------------ */
/* staging buffers and the gate */

float *nmt_tg_pinned(nmt_tg_gpu *g, size_t n) {
  void *p = NULL;
  nmt_status s = g->n_pinned < NMT_TG_MAX_PINNED
                     ? g->be->host_alloc(g->ctx, n * sizeof(float), &p)
                     : NMT_ERR_NOMEM;
  if (s != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "host_alloc of %zu floats: %s", n, nmt_last_error());
    return NULL;
  }
  g->pinned[g->n_pinned++] = p;
  return p;
}

void nmt_tg_fill_ramp(float *x, size_t n, float base) {
  for (size_t i = 0; i < n; i++) x[i] = base + (float)i;
}

#if NMT_TG_HAVE_GATE
static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void *valve_fn(void *p) {
  nmt_tg_gate *gt = p;
  for (long ms = 0; ms < gt->valve_ms && !atomic_load(&gt->open); ms++) sleep_ms(1);
  atomic_store(&gt->open, 1);
  return NULL;
}

static void CUDART_CB gate_fn(void *p) {
  nmt_tg_gate *gt = p;
  while (!atomic_load(&gt->open)) sleep_ms(1);
}
#endif

int nmt_tg_gate_close(nmt_tg_gpu *g, nmt_tg_gate *gt, long valve_ms) {
  gt->valve_ms = valve_ms;
  gt->started = 0;
#if NMT_TG_HAVE_GATE
  atomic_init(&gt->open, 0);
  void *stream = NULL;
  if (nmt_cuda_ctx_streams(g->ctx, &stream, NULL) != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "nmt_cuda_ctx_streams: %s", nmt_last_error());
    return 0;
  }
  if (pthread_create(&gt->valve, NULL, valve_fn, gt) != 0) {
    nmt_test_fail(__FILE__, __LINE__, "pthread_create");
    return 0;
  }
  gt->started = 1;
  cudaError_t e = cudaLaunchHostFunc((cudaStream_t)stream, gate_fn, gt);
  if (e != cudaSuccess) {
    atomic_store(&gt->open, 1);
    pthread_join(gt->valve, NULL);
    gt->started = 0;
    nmt_test_fail(__FILE__, __LINE__, "cudaLaunchHostFunc: %s", cudaGetErrorString(e));
    return 0;
  }
#else
  (void)g;
  atomic_init(&gt->open, 1);
#endif
  return 1;
}

void nmt_tg_gate_open(nmt_tg_gate *gt) {
  atomic_store(&gt->open, 1);
#if NMT_TG_HAVE_GATE
  if (gt->started) pthread_join(gt->valve, NULL);
#endif
  gt->started = 0;
}

void nmt_tg_keep(nmt_tg_first_err *e, nmt_status st, const char *what) {
  if (st == NMT_OK || e->st != NMT_OK) return;
  e->st = st;
  e->what = what;
  snprintf(e->msg, sizeof e->msg, "%s", nmt_last_error());
}

/* ------------------------------------------------------------------------------------------ */
/* the step control block and the half working copy */

nmt_step_ctl nmt_tg_ctl_init(float scale, int64_t good, int64_t skipped) {
  nmt_step_ctl c;
  memset(&c, 0, sizeof c);
  c.scale = scale;
  c.good = good;
  c.skipped = skipped;
  return c;
}

const nmt_precision nmt_tg_half_modes[2] = {NMT_PRECISION_FP16, NMT_PRECISION_BF16};

/* The rounding bits of x as the reference writes them (NaN: any NaN pattern is accepted from
 * the device, see nmt_tg_same_half). */
static uint16_t ref_half_bits(nmt_precision mode, float x) {
  return mode == NMT_PRECISION_FP16 ? nmt_half_fp16_bits(x) : nmt_half_bf16_bits(x);
}

static int half_is_nan(nmt_precision mode, uint16_t h) {
  return mode == NMT_PRECISION_FP16 ? (h & 0x7c00) == 0x7c00 && (h & 0x3ff)
                                    : (h & 0x7f80) == 0x7f80 && (h & 0x7f);
}

int nmt_tg_same_half(nmt_precision mode, const char *what, const uint16_t *got, const float *x,
                     size_t n) {
  size_t wrong = 0, first = 0;
  for (size_t i = 0; i < n; i++) {
    const int ok = isnan(x[i]) ? half_is_nan(mode, got[i]) : got[i] == ref_half_bits(mode, x[i]);
    if (!ok && wrong++ == 0) first = i;
  }
  if (wrong)
    nmt_test_fail(__FILE__, __LINE__, "%s: %zu of %zu wrong; first at %zu: x = %.9g, device "
                  "0x%04x, reference 0x%04x", what, wrong, n, first, x[first], got[first],
                  ref_half_bits(mode, x[first]));
  return wrong == 0;
}

/* ---- the half-storage ops' buffers ---- */

int nmt_tg_half_bf16(nmt_precision mode) { return mode == NMT_PRECISION_BF16; }

void *nmt_tg_half_twin(nmt_tg_gpu *g, nmt_precision mode, const nmt_scratch_plan *plan) {
  nmt_status s = g->be->set_precision(g->ctx, mode);
  if (s == NMT_OK) s = g->be->reserve_scratch(g->ctx, plan);
  if (s != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "device setup: %s", nmt_last_error());
    return NULL;
  }
  void *rc = NULL;
  s = nmt_ref_ctx_create(0, &rc);
  if (s == NMT_OK) s = nmt_ref_set_precision(rc, mode);
  if (s == NMT_OK) s = nmt_ref_reserve_scratch(rc, plan);
  if (s != NMT_OK) {
    nmt_test_fail(__FILE__, __LINE__, "ref setup: %s", nmt_last_error());
    nmt_ref_ctx_destroy(rc);
    return NULL;
  }
  return rc;
}

uint16_t *nmt_tg_half_encode(nmt_tg_gpu *g, nmt_precision mode, const float *x, size_t n) {
  uint16_t *h = nmt_tg_halloc(g, (n ? n : 1) * 2);
  if (h) nmt_half_encode_array(nmt_tg_half_bf16(mode), h, x, n);
  return h;
}

float *nmt_tg_half_decode(nmt_tg_gpu *g, nmt_precision mode, const uint16_t *h, size_t n) {
  float *x = nmt_tg_halloc(g, (n ? n : 1) * sizeof *x);
  if (x) nmt_half_decode_array(nmt_tg_half_bf16(mode), x, h, n);
  return x;
}

void nmt_tg_half_poison(nmt_tg_gpu *g, uint16_t *d, size_t n) {
  uint16_t *h = malloc((n ? n : 1) * 2);
  if (!h) {
    nmt_test_fail(__FILE__, __LINE__, "poison: out of host memory");
    return;
  }
  for (size_t i = 0; i < n; i++) h[i] = 0xffff;
  if (g->be->copy_h2d(g->ctx, d, h, n * 2) != NMT_OK)
    nmt_test_fail(__FILE__, __LINE__, "poison: %s", nmt_last_error());
  free(h);
}

/* The position of bits h in the type's order of values (-0 and +0 at 0; the largest finite
 * value and inf are neighbours), and whether h is a NaN. */
static long half_key(uint16_t h) { return h & 0x8000 ? -(long)(h & 0x7fff) : (long)(h & 0x7fff); }
static int half_nan(nmt_precision mode, uint16_t h) {
  return (h & 0x7fff) > (mode == NMT_PRECISION_FP16 ? 0x7c00 : 0x7f80);
}

int nmt_tg_half_close_at(const char *file, int line, nmt_precision mode, const char *what,
                         const uint16_t *got, const uint16_t *want, size_t n, double rtol,
                         double min_exact) {
  const int bf16 = nmt_tg_half_bf16(mode);
  double mx = 0.0;
  for (size_t i = 0; i < n; i++) {
    const float w = bf16 ? nmt_half_bf16_value(want[i]) : nmt_half_fp16_value(want[i]);
    if (isfinite(w)) mx = fmax(mx, fabs((double)w));
  }
  size_t wrong = 0, worst = 0, equal = 0;
  double worst_d = -1.0;
  for (size_t i = 0; i < n; i++) {
    const int gn = half_nan(mode, got[i]), wn = half_nan(mode, want[i]);
    const long dk = half_key(got[i]) - half_key(want[i]);
    const double g = bf16 ? nmt_half_bf16_value(got[i]) : nmt_half_fp16_value(got[i]);
    const double w = bf16 ? nmt_half_bf16_value(want[i]) : nmt_half_fp16_value(want[i]);
    if (gn || wn) {
      if (gn && wn) equal++;
      else if (wrong++ == 0 || worst_d < INFINITY) worst = i, worst_d = INFINITY;
      continue;
    }
    if (dk == 0) {
      equal++;
      continue;
    }
    const double d = fabs(g - w);
    if (dk == 1 || dk == -1 || d <= rtol * (mx + fabs(w))) continue;
    if (wrong++ == 0 || d > worst_d) worst = i, worst_d = d;
  }
  if (wrong) {
    nmt_test_fail(file, line, "%s: %zu of %zu half elements beyond 1 ulp and rtol %g "
                  "(max|want| %g); worst at %zu: device 0x%04x, reference 0x%04x",
                  what, wrong, n, rtol, mx, worst, got[worst], want[worst]);
    return 0;
  }
  if ((double)equal < min_exact * (double)n) {
    nmt_test_fail(file, line, "%s: only %zu of %zu half elements equal the reference's "
                  "(at least %.0f%% expected)", what, equal, n, 100.0 * min_exact);
    return 0;
  }
  return 1;
}
