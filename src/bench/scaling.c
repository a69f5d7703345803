/* scaling.c — `nmt bench scaling`, the command: a weak-scaling model of data parallelism with
 * bucketed all-reduce overlapped with backward (include/nmt/bench.h, docs/scaling.md).
 *
 * One device is measured (forward, backward with the time of every grad-ready callback,
 * update) on real batches; everything about N devices is predicted from that, from a bus
 * bandwidth and a latency. Each input is printed with where it came from: measured here,
 * declared on the command line, or declared by a preset (and there: from a public figure, or
 * assumed).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nmt/backend.h"
#include "nmt/bench.h"
#include "nmt/buckets.h"
#include "nmt/json.h"
#include "nmt/log.h"
#include "nmt/data.h"
#include "nmt/device.h"
#include "nmt/model.h"
#include "nmt/trainer.h"

/* ------------------------------------------------------------------------------------------ */
/* the command                                                                                */

void nmt_bench_scaling_opts_default(nmt_bench_scaling_opts *o) {
  memset(o, 0, sizeof *o);
  o->size = sizeof *o;
  o->warmup = -1; /* auto: measure() */
  o->steps = -1;
  o->busbw_gbs = 0;
  o->latency_us = -1;
  o->mfu = 0;
  o->preset = NMT_SCALING_PRESET_NONE;
  o->max_devices = 8;
  o->max_tokens = 0;
}

/* The lab box of the seeds: 4x GeForce RTX 3090 on PCIe 4.0, no NVLink bridge. Every figure is
 * either a published specification or labelled as an assumption (docs/scaling.md discusses
 * each). */
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
} preset_spec;

static const preset_spec rtx3090x4 = {
    .name = "rtx3090x4",
    .gpus = 4,
    .busbw_gbs = 10.0,
    .busbw_origin = "preset rtx3090x4, ASSUMED: NCCL ring over PCIe 4.0 x16 without P2P (stock "
                    "GeForce driver: via host memory); between the ~4 GB/s SHM all-reduce on "
                    "PCIe 3.0 in NVIDIA/nccl#384 and the ~26 GB/s busbw of 4x RTX 4090 on "
                    "PCIe 4.0 with P2P enabled in tinygrad/open-gpu-kernel-modules#36",
    .latency_us = 30.0,
    .latency_origin = "preset rtx3090x4, ASSUMED: the 8-byte all-reduce of 8x RTX 4090 over "
                      "PCIe takes 40-42 us in NVIDIA/nccl#1530; 4 ranks have half the ring steps",
    .peak_tflops_fp32 = 35.6,
    .peak_tflops_tf32 = 35.6,
    .peak_tflops_half = 71.0,
    .peak_origin = "preset rtx3090x4, published: NVIDIA GA102 whitepaper, GeForce RTX 3090, "
                   "dense: FP32 35.6, TF32 tensor 35.6, FP16/BF16 tensor with FP32 "
                   "accumulate 71 TFLOPS",
    .mfu = 0.35,
    .mfu_origin = "preset rtx3090x4, ASSUMED (not measured on a 3090)",
    .mem_gbs = 936.0,
    .mem_eff = 0.7,
    .mem_origin = "preset rtx3090x4: 936 GB/s published GDDR6X bandwidth x ASSUMED 70% achieved",
};

static const double candidate_mb[] = {1, 2, 5, 10, 25, 50, 100};
#define N_CANDIDATES (int)(sizeof candidate_mb / sizeof candidate_mb[0])
#define MAX_SIZES (N_CANDIDATES + 1)
#define MAX_N 64
#define MAX_BUCKETS ((size_t)1 << 22) /* buckets per size the tables model */

/* One host-communicator all-reduce size, quickly: time (us) and busbw (GB/s). */
static nmt_status quick_allreduce(int ranks, size_t bytes, int warmup, int iters,
                                  nmt_bench_allreduce_row *row) {
  nmt_comm *comms[MAX_N];
  NMT_TRY(nmt_comm_create_host(ranks, NULL, comms));
  nmt_bench_allreduce_opts o;
  nmt_bench_allreduce_opts_default(&o);
  o.min_bytes = o.max_bytes = bytes;
  o.warmup = warmup;
  o.iters = iters;
  int n_rows = 0;
  nmt_status s = nmt_bench_allreduce_run(comms, ranks, nmt_device_host(), NULL, &o, row, 1, &n_rows);
  nmt_comm_destroy(comms, ranks);
  if (s == NMT_OK && (n_rows != 1 || row->wrong))
    s = nmt_errorf(NMT_ERR_INTERNAL, "bench scaling: host all-reduce of %zu B: %lld wrong",
                   bytes, row->wrong);
  return s;
}

static const char *precision_name(nmt_precision p) {
  switch (p) {
    case NMT_PRECISION_TF32: return "tf32";
    case NMT_PRECISION_FP16: return "fp16";
    case NMT_PRECISION_BF16: return "bf16";
    default: return "fp32";
  }
}

/* One run of the command: its inputs with their origins, and the predictions. */
typedef struct {
  const nmt_config *cfg;
  const nmt_bench_scaling_opts *o;
  const preset_spec *ps;           /* NULL: no preset */
  nmt_scaling_measurement me;
  nmt_model_cfg mc;
  double load0[3], load1[3];       /* load averages before and after measuring */
  double sizes[MAX_SIZES];         /* bucket MiB, ascending: the candidates and the config's */
  int n_sizes, cfg_idx;
  double scale, peak, mfu;         /* compute scale to the preset's GPU (1 without one) */
  double fwd_ms, bwd_ms, opt_ms;   /* as predicted for one device */
  double busbw, lat;
  char busbw_origin[512], lat_origin[512];
  size_t cap;                      /* buckets per size the tables hold */
  double *bytes, *ready;           /* (n_sizes, cap): each size's buckets */
  int nb[MAX_SIZES];
  double scaled_ready[NMT_SCALING_MAX_EVENTS];
  nmt_scaling_pred pred[MAX_N][MAX_SIZES], serial[MAX_N][MAX_SIZES];
} scaling_run;

static nmt_status check_options(const nmt_config *cfg, const nmt_bench_scaling_opts *o) {
  if (!o || o->size != sizeof *o)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: options struct of the wrong size");
  if (o->max_devices < 1 || o->max_devices > MAX_N)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: max devices %d (1..%d)", o->max_devices,
                      MAX_N);
  if (o->busbw_gbs < 0 || o->mfu < 0 || o->mfu > 1)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: busbw %g GB/s (> 0) or MFU %g (0..1]",
                      o->busbw_gbs, o->mfu);
  if (o->mfu > 0 && o->preset != NMT_SCALING_PRESET_RTX3090X4)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: --mfu rescales compute to a preset's GPU; "
                      "give --preset too");
  /* Refuse a bucket size the tables cannot hold before spending time measuring. */
  nmt_model_cfg c0;
  nmt_model_cfg_from_config(cfg, &c0);
  nmt_bucket_plan plan;
  nmt_status s = nmt_bucket_plan_make(cfg->parallel_bucket_mb, nmt_model_num_params(&c0),
                                      NMT_GRAD_EXTRA, MAX_BUCKETS, &plan);
  if (s != NMT_OK)
    return nmt_errorf(s, "bench scaling: %s", nmt_last_error());
  return NMT_OK;
}

/* Bucket sizes: the candidates and the config's, ascending, without duplicates. */
static void pick_sizes(scaling_run *r) {
  const double cfg_mb = r->cfg->parallel_bucket_mb;
  r->n_sizes = 0;
  r->cfg_idx = -1;
  for (int i = 0; i <= N_CANDIDATES; i++) {
    double v = i < N_CANDIDATES ? candidate_mb[i] : cfg_mb;
    int dup = 0;
    for (int j = 0; j < r->n_sizes; j++) dup |= r->sizes[j] == v;
    if (!dup) r->sizes[r->n_sizes++] = v;
  }
  for (int i = 1; i < r->n_sizes; i++)
    for (int j = i; j > 0 && r->sizes[j] < r->sizes[j - 1]; j--) {
      double x = r->sizes[j];
      r->sizes[j] = r->sizes[j - 1];
      r->sizes[j - 1] = x;
    }
  for (int i = 0; i < r->n_sizes; i++)
    if (r->sizes[i] == cfg_mb) r->cfg_idx = i;
}

/* Compute times: as measured, or rescaled to the preset's GPU. */
static void compute_times(scaling_run *r) {
  const nmt_scaling_measurement *me = &r->me;
  const preset_spec *ps = r->ps;
  r->scale = 1, r->opt_ms = me->opt_ms, r->peak = 0, r->mfu = 0;
  if (ps) {
    const nmt_precision prec = r->cfg->precision_mode;
    r->peak = prec == NMT_PRECISION_FP32   ? ps->peak_tflops_fp32
              : prec == NMT_PRECISION_TF32 ? ps->peak_tflops_tf32
                                           : ps->peak_tflops_half;
    r->mfu = r->o->mfu > 0 ? r->o->mfu : ps->mfu;
    double gpu_compute_ms = me->flops / (r->peak * 1e12 * r->mfu) * 1e3;
    r->scale = gpu_compute_ms / (me->fwd_ms + me->bwd_ms);
    /* zero grads (write 4 B), grad norm (read 4 B), AdamW (read p, g, m, v; write p, m, v). */
    r->opt_ms = (double)me->n_params * 36.0 / (ps->mem_gbs * 1e9 * ps->mem_eff) * 1e3;
  }
  r->fwd_ms = me->fwd_ms * r->scale, r->bwd_ms = me->bwd_ms * r->scale;
}

/* The link: declared on the command line, by the preset, or measured here on the host
 * communicator (busbw at the largest bucket, latency of a 4-byte all-reduce). */
static nmt_status link_inputs(scaling_run *r) {
  const preset_spec *ps = r->ps;
  const nmt_config *cfg = r->cfg;
  r->busbw = r->o->busbw_gbs, r->lat = r->o->latency_us;
  snprintf(r->busbw_origin, sizeof r->busbw_origin, "declared on the command line");
  snprintf(r->lat_origin, sizeof r->lat_origin, "declared on the command line");
  double max_bucket_bytes = r->sizes[r->n_sizes - 1] * 1048576.0;
  if (max_bucket_bytes > (double)r->me.total_floats * sizeof(float))
    max_bucket_bytes = (double)r->me.total_floats * sizeof(float);
  int ranks = cfg->parallel_devices < 2 ? 2 : cfg->parallel_devices > 8 ? 8 : cfg->parallel_devices;
  if (!(r->busbw > 0)) {
    if (ps) {
      r->busbw = ps->busbw_gbs;
      snprintf(r->busbw_origin, sizeof r->busbw_origin, "%s", ps->busbw_origin);
    } else {
      nmt_bench_allreduce_row row;
      size_t bytes = (size_t)max_bucket_bytes / 4 * 4;
      nmt_log_progress("bench scaling: measuring busbw (host all-reduce of %zu B)", bytes);
      NMT_TRY(quick_allreduce(ranks, bytes, 1, 3, &row));
      r->busbw = row.busbw_gbs;
      snprintf(r->busbw_origin, sizeof r->busbw_origin, "measured here: host communicator, %d "
               "ranks (threads), all-reduce of %zu B (the largest bucket), busbw = "
               "algbw*2(n-1)/n", ranks, bytes);
    }
  }
  if (r->lat < 0) {
    if (ps) {
      r->lat = ps->latency_us;
      snprintf(r->lat_origin, sizeof r->lat_origin, "%s", ps->latency_origin);
    } else {
      nmt_bench_allreduce_row row;
      nmt_log_progress("bench scaling: measuring latency (host all-reduce of 4 B)");
      NMT_TRY(quick_allreduce(ranks, 4, 20, 200, &row));
      r->lat = row.time_us;
      snprintf(r->lat_origin, sizeof r->lat_origin, "measured here: host communicator, %d "
               "ranks, time of a 4 B all-reduce", ranks);
    }
  }
  return NMT_OK;
}

/* Buckets per size from the measured grad-ready events (ready times rescaled with compute),
 * in wire bytes, then the step time of every (N, size), overlapped and serial. */
static nmt_status predict(scaling_run *r) {
  const nmt_scaling_measurement *me = &r->me;
  /* The smallest size has the most buckets: the trainer's plan bounds their number. */
  nmt_bucket_plan plan;
  NMT_TRY(nmt_bucket_plan_make(r->sizes[0], me->total_floats, 0, MAX_BUCKETS, &plan));
  r->cap = (size_t)plan.n_buckets;
  r->bytes = calloc((size_t)r->n_sizes * r->cap, sizeof *r->bytes);
  r->ready = calloc((size_t)r->n_sizes * r->cap, sizeof *r->ready);
  if (!r->bytes || !r->ready) return nmt_errorf(NMT_ERR_NOMEM, "bench scaling: bucket tables");
  for (int k = 0; k < me->n_events; k++) r->scaled_ready[k] = me->ready_ms[k] * r->scale;
  for (int i = 0; i < r->n_sizes; i++)
    NMT_TRY(nmt_scaling_buckets(me->total_floats, me->ready_floats, r->scaled_ready,
                                me->n_events, r->sizes[i], r->bytes + (size_t)i * r->cap,
                                r->ready + (size_t)i * r->cap, (int)r->cap, &r->nb[i]));
  /* parallel.grad_dtype: gradients travel in 2 bytes (the 4 fp32 slots of the last bucket are
   * a separate 16-byte reduce; their latency is not modelled). */
  const double wire = nmt_comm_wire_size(r->cfg->parallel_grad_dtype) / 4.0;
  for (int i = 0; i < r->n_sizes; i++)
    for (int b = 0; b < r->nb[i]; b++) r->bytes[(size_t)i * r->cap + (size_t)b] *= wire;
  nmt_scaling_link link = {.busbw_gbs = r->busbw, .latency_us = r->lat, .serial = 0};
  nmt_scaling_link slink = link;
  slink.serial = 1;
  for (int N = 1; N <= r->o->max_devices; N++)
    for (int i = 0; i < r->n_sizes; i++) {
      nmt_scaling_profile p = {.fwd_ms = r->fwd_ms, .bwd_ms = r->bwd_ms, .opt_ms = r->opt_ms,
                               .n_buckets = r->nb[i], .bytes = r->bytes + (size_t)i * r->cap,
                               .ready_ms = r->ready + (size_t)i * r->cap};
      NMT_TRY(nmt_scaling_predict(&p, N, &link, &r->pred[N - 1][i]));
      NMT_TRY(nmt_scaling_predict(&p, N, &slink, &r->serial[N - 1][i]));
    }
  return NMT_OK;
}

/* The header: what was measured, where, and every input with its origin. */
static void report_inputs(const scaling_run *r, const char *config_label, const char *cpu,
                          const char *commit, const char *date, FILE *out) {
  const nmt_scaling_measurement *me = &r->me;
  const nmt_model_cfg *mc = &r->mc;
  const nmt_config *cfg = r->cfg;
  const preset_spec *ps = r->ps;
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  const char *where = ps ? "rescaled" : "measured here";
  fprintf(out, "# nmt bench scaling: weak scaling of data parallelism, bucketed all-reduce "
          "overlapped with backward (docs/scaling.md)\n");
  fprintf(out, "# config: %s; %.2f M parameters (d_model %d, %d heads, d_ff %d, %d+%d layers, "
          "vocab %d); precision %s\n", config_label, me->n_params / 1e6, mc->d_model, mc->n_heads,
          mc->d_ff, mc->enc_layers, mc->dec_layers, mc->vocab,
          precision_name(cfg->precision_mode));
  fprintf(out, "# batch per device: data.max_tokens = %d padded tokens per micro-batch x "
          "train.accum_steps = %d\n", cfg->data_max_tokens, me->accum);
  fprintf(out, "# measured on: %s backend, 1 worker%s, %s, %ld core(s); load average %.2f "
          "before, %.2f after\n", me->backend,
          me->backend && !strcmp(me->backend, "ref") ? " (1 BLAS thread)" : "", cpu, cores,
          r->load0[0], r->load1[0]);
  fprintf(out, "# commit %s, %s; %d timed steps after %d warmup, means\n", commit, date, me->steps,
          me->warmup);
  if (me->extrapolated != 1)
    fprintf(out, "# measured on smaller batches, to finish quickly: micro-batches of at most %d "
            "padded tokens, %d per step, instead of data.max_tokens = %d x train.accum_steps = "
            "%d; forward, backward, grad-ready and step times extrapolated linearly in model "
            "FLOPs (x%.3f per micro-batch, nmt_scaling_extrapolate); tokens and FLOPs per step "
            "are the config's batches' (--max-tokens -1 measures those)\n",
            me->measured_max_tokens, me->measured_accum, cfg->data_max_tokens, me->accum,
            me->extrapolated);
  fprintf(out, "#\n# %-32s %12s     origin\n", "inputs", "value");
  char m_origin[160];
  snprintf(m_origin, sizeof m_origin, "measured here (%s backend, 1 device)%s", me->backend,
           me->extrapolated != 1 ? ", extrapolated to the config's batch" : "");
  if (ps) {
    fprintf(out, "#   %-30s %12.3f ms  %s\n", "forward, this device", me->fwd_ms, m_origin);
    fprintf(out, "#   %-30s %12.3f ms  %s\n", "backward, this device", me->bwd_ms, m_origin);
    fprintf(out, "#   %-30s %12.3f ms  measured here (%s backend, 1 device)\n",
            "update, this device", me->opt_ms, me->backend);
    fprintf(out, "#   %-30s %12.1f TF/s  %s (%s GEMMs)\n", "GPU peak", r->peak, ps->peak_origin,
            precision_name(cfg->precision_mode));
    fprintf(out, "#   %-30s %12.2f     %s\n", "MFU", r->mfu,
            r->o->mfu > 0 ? "declared on the command line" : ps->mfu_origin);
    fprintf(out, "#   %-30s %12.4f     = model FLOPs/step / (peak x MFU) / measured "
            "(forward + backward); applied to forward, backward and every ready time\n",
            "compute scale", r->scale);
  }
  fprintf(out, "#   %-30s %12.3f ms  %s\n", "forward (all micro-batches)", r->fwd_ms, where);
  fprintf(out, "#   %-30s %12.3f ms  %s\n", "backward (all micro-batches)", r->bwd_ms, where);
  if (ps)
    fprintf(out, "#   %-30s %12.3f ms  36 B/parameter / (%s)\n", "update", r->opt_ms,
            ps->mem_origin);
  else
    fprintf(out, "#   %-30s %12.3f ms  %s (zero grads, grad norm, AdamW)\n", "update", r->opt_ms,
            where);
  if (!ps)
    fprintf(out, "#   %-30s %12.3f ms  %s (end to end, batch forming excluded; vs the sum of "
            "the three above)\n", "step, 1 device", me->step_ms, where);
  fprintf(out, "#   %-30s %12.1f     %s\n", "target tokens per step", me->tokens,
          me->extrapolated != 1 ? "the config's batches at the measured steps" : m_origin);
  fprintf(out, "#   %-30s %12.4g     from the measured batches' padded shapes: 3 x forward "
          "GEMM FLOPs (bench/README.md)\n", "model FLOPs per step", me->flops);
  fprintf(out, "#   %-30s %12.0f B   %zu parameters in %s (parallel.grad_dtype) + %d fp32 "
          "slots\n", "gradient bytes per step",
          (double)me->n_params * (double)nmt_comm_wire_size(cfg->parallel_grad_dtype) +
              4.0 * NMT_GRAD_EXTRA,
          me->n_params, nmt_comm_wire_name(cfg->parallel_grad_dtype), NMT_GRAD_EXTRA);
  fprintf(out, "#   %-30s %12.3f GB/s  %s\n", "busbw", r->busbw, r->busbw_origin);
  fprintf(out, "#   %-30s %12.2f us  %s\n", "latency per all-reduce", r->lat, r->lat_origin);
  fprintf(out, "#\n# grad-ready events of the last backward (ms from the step's first forward; "
          "compute ends at %.3f)\n#   %14s %12s\n", r->fwd_ms + r->bwd_ms, "final floats",
          "ready ms");
  for (int k = 0; k < me->n_events; k++)
    fprintf(out, "#   %14zu %12.3f\n", me->ready_floats[k], r->scaled_ready[k]);
}

/* The step-time grid (N x bucket size) and the per-N table at the best size. */
static void report_tables(const scaling_run *r, FILE *out) {
  const int max_n = r->o->max_devices;
  const double cfg_mb = r->cfg->parallel_bucket_mb;
  fprintf(out, "#\n# predicted step time (ms), comm stream overlapped with backward; rows N "
          "devices, columns bucket MiB (buckets)%s\n", r->cfg_idx >= 0 ? "; * = config's" : "");
  fprintf(out, "%4s", "N");
  for (int i = 0; i < r->n_sizes; i++) {
    char h[48];
    snprintf(h, sizeof h, "%g(%d)%s", r->sizes[i], r->nb[i], i == r->cfg_idx ? "*" : "");
    fprintf(out, " %11s", h);
  }
  fprintf(out, " %6s\n", "best");
  for (int N = 1; N <= max_n; N++) {
    fprintf(out, "%4d", N);
    for (int i = 0; i < r->n_sizes; i++) fprintf(out, " %11.2f", r->pred[N - 1][i].step_ms);
    fprintf(out, " %6g\n", r->sizes[nmt_scaling_best(r->pred[N - 1], r->n_sizes)]);
  }
  fprintf(out, "#\n# per N at the best bucket size (ties: the smaller); serial_ms: the same "
          "buckets reduced without overlap, as today's CPU workers do\n");
  fprintf(out, "%4s %9s %7s %12s %11s %10s %10s %11s %10s\n", "N", "bucket_mb", "buckets",
          "allreduce_ms", "exposed_ms", "step_ms", "efficiency", "tgt_tok/s", "serial_ms");
  const double step1 = r->pred[0][0].step_ms;
  for (int N = 1; N <= max_n; N++) {
    int b = nmt_scaling_best(r->pred[N - 1], r->n_sizes);
    const nmt_scaling_pred *p = &r->pred[N - 1][b];
    fprintf(out, "%4d %9g %7d %12.3f %11.3f %10.3f %10.3f %11.1f %10.3f%s\n", N, r->sizes[b],
            r->nb[b], p->allreduce_ms, p->exposed_ms, p->step_ms, step1 / p->step_ms,
            N * r->me.tokens / p->step_ms * 1e3, r->serial[N - 1][b].step_ms,
            r->ps && N > r->ps->gpus ? "  (beyond the preset's GPUs: extrapolated)" : "");
  }
  if (r->cfg_idx >= 0 && max_n >= 2) {
    fprintf(out, "# at the config's bucket_mb = %g:", cfg_mb);
    for (int N = 2; N <= max_n && N <= 4; N++)
      fprintf(out, "%s N=%d %.3f ms (serial %.3f)", N > 2 ? ";" : "", N,
              r->pred[N - 1][r->cfg_idx].step_ms, r->serial[N - 1][r->cfg_idx].step_ms);
    fprintf(out, "\n");
  }
  fflush(out);
}

/* One JSON row per (N, bucket size), appended to jsonl_path. */
static nmt_status report_jsonl(const scaling_run *r, const char *config_label, const char *cpu,
                               const char *commit, const char *date, const char *jsonl_path) {
  FILE *f = fopen(jsonl_path, "a");
  if (!f) return nmt_errorf(NMT_ERR_IO, "bench scaling: cannot append to %s", jsonl_path);
  const nmt_scaling_measurement *me = &r->me;
  const double step1 = r->pred[0][0].step_ms;
  for (int N = 1; N <= r->o->max_devices; N++)
    for (int i = 0; i < r->n_sizes; i++) {
      const nmt_scaling_pred *p = &r->pred[N - 1][i];
      fprintf(f, "{\"date\": \"%s\", \"commit\": \"%s\", \"bench\": \"scaling\", "
              "\"config\": ", date, commit);
      nmt_json_str(f, config_label);
      fprintf(f, ", \"device\": ");
      nmt_json_str(f, cpu);
      fprintf(f, ", \"backend\": \"%s\", \"precision\": \"%s\", \"preset\": \"%s\", "
              "\"n_devices\": %d, \"bucket_mb\": %g, \"buckets\": %d, \"fwd_ms\": %.4f, "
              "\"bwd_ms\": %.4f, \"opt_ms\": %.4f, \"tokens_per_step\": %.1f, "
              "\"flops_per_step\": %.6g, \"busbw_gbs\": %.6g, \"latency_us\": %.4g, "
              "\"busbw_origin\": ", me->backend, precision_name(r->cfg->precision_mode),
              r->ps ? r->ps->name : "none", N, r->sizes[i], r->nb[i], r->fwd_ms, r->bwd_ms,
              r->opt_ms, me->tokens, me->flops, r->busbw, r->lat);
      nmt_json_str(f, r->busbw_origin);
      fprintf(f, ", \"latency_origin\": ");
      nmt_json_str(f, r->lat_origin);
      fprintf(f, ", \"compute_scale\": %.6g, \"allreduce_ms\": %.4f, \"exposed_ms\": %.4f, "
              "\"step_ms\": %.4f, \"serial_step_ms\": %.4f, \"efficiency\": %.5f, "
              "\"tgt_tokens_per_s\": %.1f, \"loadavg\": %.2f}\n", r->scale, p->allreduce_ms,
              p->exposed_ms, p->step_ms, r->serial[N - 1][i].step_ms, step1 / p->step_ms,
              N * me->tokens / p->step_ms * 1e3, r->load1[0]);
    }
  int bad = ferror(f);
  if (fclose(f) != 0 || bad)
    return nmt_errorf(NMT_ERR_IO, "bench scaling: cannot write %s", jsonl_path);
  return NMT_OK;
}

/* Measures one device. On the CPU reference a base-model micro-batch of thousands of tokens
 * takes tens of seconds, so by default it measures fewer steps of micro-batches of at most
 * 1024 tokens, one per step, and extrapolates to the config's batch (report_inputs says so). */
static nmt_status measure(scaling_run *r) {
  const nmt_bench_scaling_opts *o = r->o;
  const nmt_backend *be;
  NMT_TRY(nmt_device_select(r->cfg, 1, NMT_DEVICE_TRAIN, &be));
  nmt_config mcfg = *r->cfg;
  /* Decided once: the measurement opens this backend without asking (or logging) again. */
  mcfg.parallel_device = be->is_host ? NMT_DEVICE_CPU : NMT_DEVICE_CUDA;
  const int warmup = o->warmup >= 0 ? o->warmup : be->is_host ? 1 : 2;
  const int steps = o->steps >= 1 ? o->steps : be->is_host ? 2 : 5;
  int cap = o->max_tokens > 0 ? o->max_tokens : o->max_tokens == 0 && be->is_host ? 1024 : 0;
  if (cap > 0 && cap < mcfg.data_max_len) cap = mcfg.data_max_len;
  const int reduce = cap > 0 && (mcfg.data_max_tokens > cap || mcfg.train_accum_steps > 1);
  if (reduce) {
    if (mcfg.data_max_tokens > cap) mcfg.data_max_tokens = cap;
    mcfg.train_accum_steps = 1;
  }
  NMT_TRY(nmt_scaling_measure(&mcfg, warmup, steps, &r->me));
  if (reduce) NMT_TRY(nmt_scaling_extrapolate(r->cfg, &r->me));
  return NMT_OK;
}

static nmt_status run(scaling_run *r, const char *config_label, const char *jsonl_path,
                      FILE *out) {
  for (int i = 0; i < 3; i++) r->load0[i] = r->load1[i] = -1;
  getloadavg(r->load0, 3);
  NMT_TRY(measure(r));
  getloadavg(r->load1, 3);
  nmt_model_cfg_from_config(r->cfg, &r->mc);
  pick_sizes(r);
  compute_times(r);
  NMT_TRY(link_inputs(r));
  nmt_log_progress("bench scaling: predicting N = 1..%d devices", r->o->max_devices);
  NMT_TRY(predict(r));
  nmt_log_progress_end();
  char cpu[256], commit[64], date[32];
  nmt__bench_cpu_name(cpu, sizeof cpu);
  nmt__bench_commit(commit, sizeof commit);
  time_t now = time(NULL);
  struct tm tm;
  gmtime_r(&now, &tm);
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tm);
  report_inputs(r, config_label, cpu, commit, date, out);
  report_tables(r, out);
  if (jsonl_path) NMT_TRY(report_jsonl(r, config_label, cpu, commit, date, jsonl_path));
  return NMT_OK;
}

nmt_status nmt_bench_scaling(const nmt_config *cfg, const char *config_label,
                             const nmt_bench_scaling_opts *o, const char *jsonl_path, FILE *out) {
  NMT_TRY(check_options(cfg, o));
  scaling_run *r = calloc(1, sizeof *r);
  if (!r) return nmt_errorf(NMT_ERR_NOMEM, "bench scaling: run state");
  r->cfg = cfg, r->o = o;
  r->ps = o->preset == NMT_SCALING_PRESET_RTX3090X4 ? &rtx3090x4 : NULL;
  nmt_status s = run(r, config_label, jsonl_path, out);
  free(r->bytes), free(r->ready);
  free(r);
  return s;
}
