/* nmt/prof.h — the built-in profiler: named ranges per thread, timed on a window of steps,
 * written as a Chrome trace (trace.json) and a per-module roofline table (profile.txt); NVTX
 * ranges with the same names for Nsight; and, through nmt/prof_cost.h, the FLOP/byte formulas
 * of every op, in one place. Implemented in src/util/prof*.c, one file per concern.
 *
 * Model. One profiler (nmt_prof) per run holds the window [start_step, stop_step] ([profile]
 * keys), the NVTX switch and the interned range names. It owns one recorder (nmt_prof_track) per
 * thread role — "cpu0"/"gpu0".. for the workers, "loader", "main" — created up front, before
 * the threads start, with a preallocated event array sized from the window. A track is used by
 * one thread at a time (threads may be replaced between training segments: each new thread
 * calls nmt_prof_track_bind_thread). The per-op path — nmt_prof_push / nmt_prof_pop — takes no
 * lock, allocates nothing and makes no system call but the clock read:
 *   - every push/pop emits the NVTX range when [profile] nvtx is on (Nsight needs every step,
 *     e.g. with nsys --capture-range=cudaProfilerApi);
 *   - only between nmt_prof_step_begin(step in the window) and nmt_prof_step_end does a push
 *     record an event (name, phase, FLOPs, bytes, times); elsewhere push/pop do nothing else;
 *   - a full event array drops the event and counts it (nmt_prof_track_dropped), never fails.
 * Ranges nest (a stack per track; "step" > "micro_step" > "decoder.3.ffn"); pop closes the
 * innermost one.
 *
 * Range names are stable and dotted. The model's modules (nmt_model_module_names):
 *   encoder.embed, encoder.L.self_attn, encoder.L.ffn, encoder.final_ln (pre-LN),
 *   decoder.embed, decoder.L.self_attn, decoder.L.cross_attn, decoder.L.ffn,
 *   decoder.final_ln (pre-LN), generator.proj, generator.xent;
 * the engine's: step, micro_step, data_wait, h2d, allreduce.bN, optimizer (docs/profiling.md).
 * Forward and backward of a module share the name and differ in phase.
 *
 * Clocks. By default a track times ranges with the host's CLOCK_MONOTONIC, which is exact for
 * CPU workers (ref ops are synchronous). A device worker installs an nmt_prof_clock: push/pop
 * then call its mark() (record a CUDA event on the worker's stream; no host sync) and
 * nmt_prof_step_end calls resolve() once per sampled step to read every mark's time. Unsampled
 * steps never call either.
 *
 * Cost formulas: the FLOPs and bytes a range carries come from nmt/prof_cost.h (included here),
 * which also defines nmt_prof_phase.
 *
 * defines: nmt_prof, nmt_prof_track, nmt_prof_options, nmt_prof_clock, nmt_prof_row,
 *          nmt_prof_summary, nmt_prof_event, nmt_prof_* (but nmt_prof_cost*: prof_cost.h)
 */
#ifndef NMT_PROF_H
#define NMT_PROF_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "nmt/config.h"
#include "nmt/prof_cost.h" /* nmt_prof_phase, nmt_prof_cost_* */
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nmt_prof nmt_prof;
typedef struct nmt_prof_track nmt_prof_track;

/* "other", "fwd", "bwd". */
const char *nmt_prof_phase_str(nmt_prof_phase ph);

enum {
  NMT_PROF_NAME_MAX = 64,         /* bytes per range name, NUL included */
  NMT_PROF_MAX_DEPTH = 64,        /* nesting recorded per track (deeper: NVTX only, counted) */
  NMT_PROF_MAX_EVENTS = 1 << 20   /* events per track at most, whatever the window */
};

typedef struct {
  size_t size;      /* sizeof(nmt_prof_options): the version of this struct */
  long start_step;  /* first sampled step (1-based optimizer step); 0 = no window */
  long stop_step;   /* last sampled step; 0 = start_step + 9 */
  int nvtx;         /* emit NVTX ranges and thread names (no-ops in builds without NMT_NVTX) */
  int max_names;    /* capacity of the name table; 0 = 4096 */
} nmt_prof_options;

/* Defaults: no window, NVTX on, 4096 names. */
void nmt_prof_options_default(nmt_prof_options *o);
/* The [profile] keys of a run config: start_step, stop_step (0 resolved to start + 9), nvtx. */
void nmt_prof_options_from_config(const nmt_config *c, nmt_prof_options *o);

/* Creates a profiler; its epoch (time 0 of the trace) is CLOCK_MONOTONIC now.
 * Errors: NMT_ERR_USAGE (size mismatch, stop_step < start_step, negative values),
 * NMT_ERR_NOMEM. */
nmt_status nmt_prof_create(const nmt_prof_options *o, nmt_prof **out);
/* Frees the profiler and its tracks; NULL is a no-op. No thread may still use a track. */
void nmt_prof_destroy(nmt_prof *p);

/* 1 iff step is in [start_step, stop_step] (never with start_step = 0). For the caller's
 * cudaProfilerStart/Stop at the window's edges. */
int nmt_prof_in_window(const nmt_prof *p, long step);
long nmt_prof_start_step(const nmt_prof *p); /* 0 when there is no window */
long nmt_prof_stop_step(const nmt_prof *p);  /* resolved (start + 9 for 0) */
int nmt_prof_nvtx_on(const nmt_prof *p);
/* CLOCK_MONOTONIC in ns at create: time 0 of the trace (a device clock anchors to it). */
int64_t nmt_prof_epoch_ns(const nmt_prof *p);

/* Adds a track named `name` (1..31 chars; "gpu0", "loader", "main"), shown as one thread in
 * the trace. Its event array holds events_per_step * (window length) events, at most
 * NMT_PROF_MAX_EVENTS (nothing when there is no window). Call before the threads that use it
 * start: tracks are not added concurrently with pushes. Errors: NMT_ERR_USAGE (bad name),
 * NMT_ERR_NOMEM. */
nmt_status nmt_prof_add_track(nmt_prof *p, const char *name, size_t events_per_step,
                              nmt_prof_track **out);
const char *nmt_prof_track_name(const nmt_prof_track *t);
nmt_prof *nmt_prof_track_profiler(nmt_prof_track *t);
/* Capacity of the track's event array (events). */
size_t nmt_prof_track_capacity(const nmt_prof_track *t);

/* The id of range name `name` (1..NMT_PROF_NAME_MAX-1 bytes), the same id for the same name
 * on every call and thread. Thread-safe (a mutex): call it at setup, not per op.
 * Errors: NMT_ERR_USAGE (empty or too long), NMT_ERR_NOMEM (the name table is full). */
nmt_status nmt_prof_intern(nmt_prof *p, const char *name, int *id);
/* The string of an interned id (valid until destroy); NULL for an unknown id. */
const char *nmt_prof_name(const nmt_prof *p, int id);

/* Names the calling OS thread after the track for NVTX (nvtxNameOsThreadA with gettid).
 * Call first thing in the thread that will use the track. NULL is a no-op. */
void nmt_prof_track_bind_thread(nmt_prof_track *t);

/* Start of step `step` (same numbering as the window) on this track: the track records events
 * until nmt_prof_step_end iff the step is in the window. NULL is a no-op. */
void nmt_prof_step_begin(nmt_prof_track *t, long step);
/* End of the step: with a device clock, resolves the step's marks (may block until the
 * device reaches them; only on sampled steps); recording stops. A range that is still open
 * keeps its host end time, but a device clock cannot resolve it: it is left out of the
 * outputs, so close ranges before the step ends. Errors: those of the clock's resolve. */
nmt_status nmt_prof_step_end(nmt_prof_track *t);
/* 1 between step_begin and step_end of a sampled step. */
int nmt_prof_track_sampling(const nmt_prof_track *t);

/* Opens range `name` (an nmt_prof_intern id) of phase `ph` on the track; `flops` and `bytes`
 * are the work of the whole range (nmt_prof_cost_*; 0 when unknown). NVTX range if on; an
 * event if the step is sampled. No lock, no allocation. NULL track: no-op. */
void nmt_prof_push(nmt_prof_track *t, int name, nmt_prof_phase ph, double flops, double bytes);
/* Closes the innermost open range. A pop with no open range is counted and ignored. */
void nmt_prof_pop(nmt_prof_track *t);
/* The backend's counts of one model pass (nmt/backend.h nmt_backend_counters): gemm_calls,
 * launches (device work items: kernels, GEMMs, memsets, copies; 0 on the CPU) and casts (GEMM
 * inputs cast to the half type inside a GEMM op) made by the pass; scratch_growths, the
 * context's total so far (the largest seen is kept); half_storage, 1 when the model keeps its
 * activations in half (precision.activations = half in fp16/bf16), 0 when in fp32. */
typedef struct {
  double gemm_calls, launches, casts, scratch_growths;
  int half_storage;
} nmt_prof_backend_counts;
/* Adds one pass of phase ph (NMT_PROF_FWD: a training forward, NMT_PROF_BWD: its backward; a
 * micro-batch is one of each), on a sampled step only (nothing otherwise; NULL track: no-op).
 * The table's "GEMM calls per micro-batch" and "device kernels per micro-batch" lines
 * (src/util/prof_table.c). No lock. */
void nmt_prof_track_add_backend(nmt_prof_track *t, nmt_prof_phase ph,
                                const nmt_prof_backend_counts *c);

/* ---- device clock (the CUDA side fills it in; none in this file) ----
 * mark(user, i): record timestamp i on the track's device stream (cudaEventRecord of event i
 * of a pool of 2 * nmt_prof_track_capacity events): i = 2*e at the push of the track's e-th
 * event, 2*e + 1 at its pop. Called only on sampled steps; must not synchronise.
 * step_begin(user, host_ns) (may be NULL): a sampled step starts at host time host_ns
 * (CLOCK_MONOTONIC): record an anchor event, so resolve can convert device elapsed times
 * (cudaEventElapsedTime from the anchor) to host time: t = host_ns + elapsed.
 * resolve(user, first, n, t_ns): at nmt_prof_step_end, write the times of marks
 * [first, first + n) to t_ns[0..n) in ns of CLOCK_MONOTONIC (the same clock as
 * nmt_prof_epoch_ns), -1 for a mark never recorded; may block (cudaEventSynchronize on the
 * last one). Once per sampled step, so the host waits for the device once per step at most. */
typedef struct {
  void *user;
  void (*mark)(void *user, size_t i);
  void (*step_begin)(void *user, int64_t host_ns);
  nmt_status (*resolve)(void *user, size_t first, size_t n, int64_t *t_ns);
} nmt_prof_clock;

/* Installs a device clock on the track (NULL: back to the host clock). Before the thread
 * starts. Errors: NMT_ERR_USAGE (mark or resolve NULL), NMT_ERR_NOMEM. */
nmt_status nmt_prof_track_set_clock(nmt_prof_track *t, const nmt_prof_clock *clock);

/* Called with every name the profiler pushes to NVTX (and NULL for each pop) on the pushing
 * thread, whenever NVTX is on — also in builds without NMT_NVTX, where nothing else is
 * emitted. For tests, and for tools that want the same ranges. Set before the threads start. */
typedef void (*nmt_prof_nvtx_hook)(void *user, const nmt_prof_track *t, const char *name);
void nmt_prof_set_nvtx_hook(nmt_prof *p, nmt_prof_nvtx_hook fn, void *user);

/* ---- recorded events (after the threads are joined) ---- */
typedef struct {
  const char *name;
  nmt_prof_phase phase;
  long step;
  int depth;         /* 0 = outermost open range of the track when pushed */
  long parent;       /* index of the enclosing recorded event, -1 if none */
  int64_t t0_ns, t1_ns; /* since the epoch; t1_ns < t0_ns: never closed or not resolved */
  double flops, bytes;
} nmt_prof_event;

size_t nmt_prof_track_n_events(const nmt_prof_track *t);
/* Events pushed on sampled steps that did not fit the array. */
size_t nmt_prof_track_dropped(const nmt_prof_track *t);
/* Sampled steps seen by the track (step_begin in the window). */
long nmt_prof_track_n_steps(const nmt_prof_track *t);
/* Event i (< n_events) of the track, in push order. */
void nmt_prof_track_event(const nmt_prof_track *t, size_t i, nmt_prof_event *out);
int nmt_prof_n_tracks(const nmt_prof *p);
nmt_prof_track *nmt_prof_get_track(nmt_prof *p, int i);

/* ---- outputs ---- */

/* Chrome trace format ("JSON Object Format": {"traceEvents": [...]}): per track, a thread_name
 * metadata event and one "X" (complete) event per closed range, pid 1, tid = track index + 1,
 * ts/dur in microseconds since the epoch, cat = phase, args {step, phase, flops, bytes}.
 * Opens in Perfetto (ui.perfetto.dev) and chrome://tracing. Names are JSON-escaped.
 * Errors: NMT_ERR_IO naming the path. */
nmt_status nmt_prof_write_trace(const nmt_prof *p, const char *path);

/* One row of the per-module table: a (name, phase) aggregated over every track and sampled
 * step. "Per step" figures are averages per track and step: totals divided by the sampled
 * steps of the tracks that recorded the row (with data parallelism: per device). */
typedef struct {
  const char *name;
  nmt_prof_phase phase;
  long calls;               /* all tracks, all sampled steps */
  long steps;               /* track-steps the per-step figures are averaged over */
  double calls_per_step;
  double ms_per_step;       /* inclusive time */
  double self_ms_per_step;  /* minus the recorded ranges nested inside */
  double pct_step;          /* ms_per_step / summary step_ms * 100 */
  double gflop_per_step, gb_per_step;
  double tflops, gbps;      /* achieved: per-step FLOPs, bytes over per-step inclusive time */
  double intensity;         /* FLOP per byte (0 when no bytes) */
  double pct_roof;          /* tflops over the roofline min(peak, intensity * bw) at it, % */
  const char *bound;        /* "compute" (intensity >= ridge), "memory", or "-" */
} nmt_prof_row;

typedef struct {
  long sampled_steps;   /* most sampled steps of any track */
  /* nmt_prof_track_add_backend's counts over every track: GEMM launches per micro-batch
   * (forward + backward; per pass of each phase), NAN when no pass was reported; the largest
   * scratch growth count reported (0 when none). */
  double gemm_per_micro_batch, gemm_per_fwd, gemm_per_bwd;
  double scratch_growths;
  /* the same for device work items and casts per micro-batch (NAN when no pass); the activation
   * storage reported (1 half, 0 fp32, -1 none reported) */
  double launches_per_micro_batch, launches_per_fwd, launches_per_bwd, casts_per_micro_batch;
  int half_storage;
  double step_ms;       /* the "step" range's ms per step; without one, the largest per-step
                           sum of a track's outermost ranges */
  double peak_tflops, peak_gbps;
  double ridge;         /* peak FLOP/s over peak byte/s (FLOP/B), 0 if a peak is unknown */
  size_t events, dropped, unclosed;
} nmt_prof_summary;

/* Aggregates every track's recorded events into rows sorted by ms_per_step (largest first);
 * *rows is malloc'ed (free it), *n_rows its length. Peaks (one device's, e.g. from
 * nmt_prof_measure_cpu_peak) decide `bound` by the roofline ridge point; 0 = unknown ("-").
 * Call after the threads are joined. Errors: NMT_ERR_NOMEM. */
nmt_status nmt_prof_summarize(const nmt_prof *p, double peak_tflops, double peak_gbps,
                              nmt_prof_summary *sum, nmt_prof_row **rows, int *n_rows);
/* The table (nmt_prof_summarize) as text: a '#' header (window, tracks, events and drops,
 * peaks and ridge) and one line per row. Errors: NMT_ERR_IO, NMT_ERR_NOMEM. */
nmt_status nmt_prof_print_table(const nmt_prof *p, double peak_tflops, double peak_gbps,
                                FILE *out);
/* nmt_prof_print_table into the file at path (run.out_dir/profile.txt). Errors: NMT_ERR_IO. */
nmt_status nmt_prof_write_table(const nmt_prof *p, double peak_tflops, double peak_gbps,
                                const char *path);

/* One core's fp32 fused multiply-add throughput in GFLOP/s: independent chains of 256-bit
 * (AVX2+FMA) and, where present, 512-bit (AVX-512F) FMAs at whatever clock the core sustains,
 * the larger of the two, best of 5 runs each (about 50 ms). It is the ceiling of any fp32 GEMM
 * on that core: the MFU denominator of the trainer (times its CPU workers) and of
 * bench/cpu-throughput.sh (times the cores). 0 where the CPU has neither (or is not x86). */
double nmt_prof_cpu_fma_gflops(void);

/* One CPU worker's peaks, for [profile] peak_tflops/peak_gbps = 0: FLOP/s from
 * nmt_prof_cpu_fma_gflops (one worker = one core: its BLAS runs on one thread); where that is
 * 0, the best of 512x512x512 cblas_sgemm calls on one OpenBLAS thread (timed after 30 ms of
 * untimed ones, for at least 80 ms; the thread count is restored after). Bandwidth: the best of
 * several 64 MiB memcpy, counted as 2 x 64 MiB moved (read and write, as STREAM's Copy,
 * McCalpin 1995). Measured once per process (about 0.1-0.3 s, under a mutex) and returned from
 * then on; call at startup, before the workers run BLAS. Errors: NMT_ERR_NOMEM (then measured
 * again at the next call). */
nmt_status nmt_prof_measure_cpu_peak(double *tflops, double *gbps);

#ifdef __cplusplus
}
#endif
#endif /* NMT_PROF_H */
