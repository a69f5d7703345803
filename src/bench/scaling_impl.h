/* scaling_impl.h — what the rooms of `nmt bench scaling` share (internal to src/bench/):
 * scaling.c runs the command (measure, inputs, predictions), scaling_report.c prints them.
 * The run's inputs each carry their origin: measured here, declared on the command line, or a
 * preset's (published or ASSUMED).
 *
 * defines: nmt__scaling_preset, nmt__scaling_run, NMT__SCALING_*, nmt__scaling_report_*
 */
#ifndef NMT_BENCH_SCALING_IMPL_H
#define NMT_BENCH_SCALING_IMPL_H

#include <stdio.h>

#include "nmt/bench.h"
#include "nmt/config.h"
#include "nmt/model.h"

/* A machine the model predicts for; every figure published or labelled ASSUMED. */
typedef struct {
  const char *name;
  int gpus;
  double busbw_gbs;
  const char *busbw_origin;
  double latency_us;
  const char *latency_origin;
  double peak_tflops_fp32, peak_tflops_tf32, peak_tflops_half;
  const char *peak_origin;
  double mfu;
  const char *mfu_origin;
  double mem_gbs, mem_eff;
  const char *mem_origin;
  double capacity_gib;        /* device memory per GPU */
  const char *capacity_origin;
} nmt__scaling_preset;

enum {
  NMT__SCALING_CANDIDATES = 7,                        /* 1, 2, 5, 10, 25, 50, 100 MiB */
  /* and the config's bucket_mb, or under bucket_mb = auto the trainer's candidates */
  NMT__SCALING_MAX_SIZES = NMT__SCALING_CANDIDATES + NMT_BUCKET_CANDIDATES,
  NMT__SCALING_MAX_N = 64,
  NMT__SCALING_STAGES = 3,    /* ZeRO 0, 1, 2 */
  NMT__SCALING_MAX_NODES = 16,
};

/* One run of the command: its inputs with their origins, and the predictions. */
typedef struct {
  const nmt_config *cfg;
  const nmt_bench_scaling_opts *o;
  const nmt__scaling_preset *ps;   /* NULL: no preset */
  nmt_scaling_measurement me;
  nmt_model_cfg mc;
  double load0[3], load1[3];       /* load averages before and after measuring */
  double sizes[NMT__SCALING_MAX_SIZES]; /* bucket MiB, ascending: the candidates and the config's */
  int n_sizes, cfg_idx;
  double scale, peak, mfu;         /* compute scale to the preset's GPU (1 without one) */
  double fwd_ms, bwd_ms, opt_ms;   /* as predicted for one device, zero 0 */
  double busbw, lat;
  char busbw_origin[512], lat_origin[512];
  size_t cap;                      /* buckets per size the tables hold */
  double *bytes, *ready, *gather;  /* (cap) one plan's buckets, rebuilt per prediction */
  double scaled_ready[NMT_SCALING_MAX_EVENTS];
  /* ZeRO: the stages predicted (stage[0] is the one of the step-time grid) */
  int n_stages, stage[NMT__SCALING_STAGES];
  int half;                        /* precision.mode fp16/bf16: a 16-bit working copy */
  size_t stage_floats;             /* the largest backward stage (from the grad-ready events) */
  size_t windows_floats;           /* zero 2's gradient windows at mem_n ranks */
  nmt_scaling_pred pred[NMT__SCALING_STAGES][NMT__SCALING_MAX_N][NMT__SCALING_MAX_SIZES];
  nmt_scaling_pred serial[NMT__SCALING_STAGES][NMT__SCALING_MAX_N][NMT__SCALING_MAX_SIZES];
  int nb[NMT__SCALING_STAGES][NMT__SCALING_MAX_N][NMT__SCALING_MAX_SIZES];
  nmt_scaling_step_bytes sb[NMT__SCALING_STAGES][NMT__SCALING_MAX_N][NMT__SCALING_MAX_SIZES];
  /* memory per GPU at mem_n devices: stage x (no checkpointing, checkpointing) */
  int mem_n;
  double capacity, reserve;        /* bytes; capacity 0: unknown */
  char capacity_origin[256], reserve_origin[320];
  nmt_scaling_memory mem[NMT__SCALING_STAGES][2];
  int fit_tokens[NMT__SCALING_STAGES][2];
  /* several nodes: ring and two-level, 1..nodes nodes of gpus_per_node */
  int gpn;
  double net_busbw, net_step_us, intra_step_us;
  char net_origin[256], net_lat_origin[256];
  nmt_scaling_pred node_pred[2][NMT__SCALING_MAX_NODES][NMT__SCALING_MAX_SIZES];
  int node_nb[NMT__SCALING_MAX_NODES][NMT__SCALING_MAX_SIZES];
} nmt__scaling_run;

/* The efficiency baseline of every table: one device's replicated step (forward, backward,
 * update; no collective), whatever ZeRO stage a table predicts. */
static inline double nmt__scaling_step1_ms(const nmt__scaling_run *r) {
  return r->fwd_ms + r->bwd_ms + r->opt_ms;
}

/* The header: what was measured, where, and every input with its origin. */
void nmt__scaling_report_inputs(const nmt__scaling_run *r, const char *config_label,
                                const char *cpu, const char *commit, const char *date, FILE *out);
/* The step-time grid and per-N table of stage[0], the ZeRO comparison, memory, nodes. */
void nmt__scaling_report_tables(const nmt__scaling_run *r, FILE *out);
/* One JSON row per (stage, N, bucket size), per memory row, per (nodes, algorithm, size). */
nmt_status nmt__scaling_report_jsonl(const nmt__scaling_run *r, const char *config_label,
                                     const char *cpu, const char *commit, const char *date,
                                     const char *jsonl_path);

#endif /* NMT_BENCH_SCALING_IMPL_H */
