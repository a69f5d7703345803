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
#include "scaling_impl.h"

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
  o->zero = -1;
  o->nodes = 0;
  o->net_gbps = 100;
  o->net_latency_us = -1;
  o->mem_gb = 0;
  o->reserve_gb = -1;
}

/* The lab box of the seeds: 4x GeForce RTX 3090 on PCIe 4.0, no NVLink bridge. Every figure is
 * either a published specification or labelled as an assumption (docs/scaling.md discusses
 * each). */
static const nmt__scaling_preset rtx3090x4 = {
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
    .capacity_gib = 24.0,
    .capacity_origin = "preset rtx3090x4, published: 24 GB GDDR6X per GeForce RTX 3090 (GA102 "
                       "whitepaper), 24 GiB",
};

/* Not nmt's to use on a GPU, whatever the model: the CUDA context (~0.3-0.4 GiB with lazy
 * module loading, CUDA >= 11.7: pytorch/pytorch#107667, #109888; over 1 GiB without), cuBLASLt
 * workspaces (NMT_CUDA_WORKSPACE_BYTES = 32 MiB per stream, cuda/common.cuh), NCCL's buffers
 * (NCCL_BUFFSIZE = 4 MiB per channel, peer and protocol), and allocator rounding. */
static const double default_reserve_gib = 1.0;
static const char default_reserve_origin[] =
    "ASSUMED: CUDA context ~0.4 GiB with lazy loading (pytorch/pytorch#109888), cuBLASLt "
    "workspaces 32 MiB per stream (cuda/common.cuh), NCCL buffers (4 MiB per channel, peer and "
    "protocol), rounding";

/* The network between nodes: NCCL's own tuning model (src/graph/tuning.cc, hwLat, ring,
 * Simple protocol) for the per-step latencies; the NIC's line rate x an efficiency. */
static const double net_efficiency = 0.9;
static const double nccl_net_step_us = 9.6, nccl_pci_step_us = 5.7;

static const double candidate_mb[NMT__SCALING_CANDIDATES] = {1, 2, 5, 10, 25, 50, 100};
#define MAX_BUCKETS ((size_t)1 << 22) /* buckets per size the tables model */

/* One host-communicator all-reduce size, quickly: time (us) and busbw (GB/s). */
static nmt_status quick_allreduce(int ranks, size_t bytes, int warmup, int iters,
                                  nmt_bench_allreduce_row *row) {
  nmt_comm *comms[NMT__SCALING_MAX_N];
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

static nmt_status check_options(const nmt_config *cfg, const nmt_bench_scaling_opts *o) {
  if (!o || o->size != sizeof *o)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: options struct of the wrong size");
  if (o->max_devices < 1 || o->max_devices > NMT__SCALING_MAX_N)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: max devices %d (1..%d)", o->max_devices,
                      NMT__SCALING_MAX_N);
  if (o->busbw_gbs < 0 || o->mfu < 0 || o->mfu > 1)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: busbw %g GB/s (> 0) or MFU %g (0..1]",
                      o->busbw_gbs, o->mfu);
  if (o->mfu > 0 && o->preset != NMT_SCALING_PRESET_RTX3090X4)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: --mfu rescales compute to a preset's GPU; "
                      "give --preset too");
  if (o->zero < -1 || o->zero > NMT_SCALING_ZERO_ALL)
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: --zero %d (0, 1, 2 or all)", o->zero);
  if (o->nodes < 0 || o->nodes > NMT_SCALING_MAX_NODES || !(o->net_gbps > 0) ||
      !(o->mem_gb >= 0))
    return nmt_errorf(NMT_ERR_USAGE, "bench scaling: --nodes %d (2..%d), --net-gbps %g (> 0), "
                      "--mem-gb %g (> 0)", o->nodes, NMT_SCALING_MAX_NODES, o->net_gbps,
                      o->mem_gb);
  /* Refuse a bucket size the tables cannot hold before spending time measuring. */
  nmt_model_cfg c0;
  nmt_model_cfg_from_config(cfg, &c0);
  nmt_bucket_plan plan;
  const double mb = cfg->parallel_bucket_mb == NMT_BUCKET_MB_AUTO ? nmt_bucket_candidates_mb[0]
                                                                  : cfg->parallel_bucket_mb;
  nmt_status s = nmt_bucket_plan_make(mb, nmt_model_num_params(&c0), NMT_GRAD_EXTRA,
                                      MAX_BUCKETS, &plan);
  if (s != NMT_OK)
    return nmt_errorf(s, "bench scaling: %s", nmt_last_error());
  return NMT_OK;
}

/* Bucket sizes: the candidates and the config's (under bucket_mb = auto, the sizes the trainer
 * chooses among), ascending, without duplicates. */
static void pick_sizes(nmt__scaling_run *r) {
  const double cfg_mb = r->cfg->parallel_bucket_mb;
  const int is_auto = cfg_mb == NMT_BUCKET_MB_AUTO;
  const int n_extra = is_auto ? NMT_BUCKET_CANDIDATES : 1;
  r->n_sizes = 0;
  r->cfg_idx = -1;
  for (int i = 0; i < NMT__SCALING_CANDIDATES + n_extra; i++) {
    double v = i < NMT__SCALING_CANDIDATES ? candidate_mb[i]
               : is_auto                   ? nmt_bucket_candidates_mb[i - NMT__SCALING_CANDIDATES]
                                           : cfg_mb;
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
  for (int i = 0; i < r->n_sizes && !is_auto; i++)
    if (r->sizes[i] == cfg_mb) r->cfg_idx = i;
}

/* Compute times: as measured, or rescaled to the preset's GPU. */
static void compute_times(nmt__scaling_run *r) {
  const nmt_scaling_measurement *me = &r->me;
  const nmt__scaling_preset *ps = r->ps;
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
static nmt_status link_inputs(nmt__scaling_run *r) {
  const nmt__scaling_preset *ps = r->ps;
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

/* One plan's buckets (zero 0: the trainer's all-reduce plan; zero >= 1: the sharded plan for
 * n ranks) into r->bytes (wire bytes), r->ready (rescaled ready times) and r->gather (fp32
 * bytes); *plan_out gets the plan. */
static nmt_status plan_buckets(nmt__scaling_run *r, int zero, int n, double bucket_mb, int *nb,
                               nmt_bucket_plan *plan_out) {
  const nmt_scaling_measurement *me = &r->me;
  nmt_bucket_plan plan;
  if (zero == 0)
    NMT_TRY(nmt_bucket_plan_make(bucket_mb, me->n_params, NMT_GRAD_EXTRA, MAX_BUCKETS, &plan));
  else {
    /* Stage 2 cuts its buckets at the model's backward stages; the model keeps bucket_mb
     * buckets for it (the same bytes in another number of collectives), marked stage 2 so
     * that they are reduced every micro-batch. */
    NMT_TRY(nmt_bucket_plan_make_sharded(bucket_mb, me->n_params, n, 1, MAX_BUCKETS, &plan));
    plan.zero = zero;
  }
  NMT_TRY(nmt_scaling_buckets_plan(&plan, me->ready_floats, r->scaled_ready, me->n_events,
                                   r->bytes, r->ready, (int)r->cap, nb));
  /* parallel.grad_dtype: gradients travel in 2 bytes (with zero 0 the 4 fp32 slots of the last
   * bucket are a separate 16-byte reduce whose latency is not modelled). */
  const double wire = nmt_comm_wire_size(r->cfg->parallel_grad_dtype) / 4.0;
  for (int b = 0; b < *nb; b++) r->gather[b] = r->bytes[b], r->bytes[b] *= wire;
  *plan_out = plan;
  return NMT_OK;
}

/* The update at a ZeRO stage: the zero 0 update (36 B per parameter: zero the gradient 4, its
 * norm 4, AdamW 28) with the norm and AdamW on the shard and the gradient zeroed whole (zero 1)
 * or as the shard it accumulates (zero 2): x (4 x zeroed floats + 32 x shard) / (36 x
 * parameters). */
static double stage_update_ms(const nmt__scaling_run *r, const nmt_bucket_plan *plan) {
  if (plan->zero == 0) return r->opt_ms;
  const double shard = (double)plan->shard_floats;
  const double zeroed = plan->zero == 1 ? (double)(plan->total_floats + NMT_GRAD_EXTRA) : shard;
  return r->opt_ms * (4.0 * zeroed + 32.0 * shard) / (36.0 * (double)r->me.n_params);
}

/* The step time of every (stage, N, bucket size), overlapped and serial. */
static nmt_status predict(nmt__scaling_run *r) {
  const nmt_scaling_measurement *me = &r->me;
  /* The smallest size has the most buckets: the trainer's plan bounds their number (a sharded
   * plan rounds buckets up, so it has no more). */
  nmt_bucket_plan plan;
  NMT_TRY(nmt_bucket_plan_make(r->sizes[0], me->total_floats, 0, MAX_BUCKETS, &plan));
  r->cap = (size_t)plan.n_buckets;
  r->bytes = calloc(r->cap, sizeof *r->bytes);
  r->ready = calloc(r->cap, sizeof *r->ready);
  r->gather = calloc(r->cap, sizeof *r->gather);
  if (!r->bytes || !r->ready || !r->gather)
    return nmt_errorf(NMT_ERR_NOMEM, "bench scaling: bucket tables");
  for (int k = 0; k < me->n_events; k++) r->scaled_ready[k] = me->ready_ms[k] * r->scale;
  nmt_scaling_link link = {.busbw_gbs = r->busbw, .latency_us = r->lat, .serial = 0};
  nmt_scaling_link slink = link;
  slink.serial = 1;
  for (int s = 0; s < r->n_stages; s++)
    for (int N = 1; N <= r->o->max_devices; N++)
      for (int i = 0; i < r->n_sizes; i++) {
        const int z = r->stage[s];
        int *nb = &r->nb[s][N - 1][i];
        nmt_bucket_plan plan;
        NMT_TRY(plan_buckets(r, z, N, r->sizes[i], nb, &plan));
        NMT_TRY(nmt_scaling_zero_bytes(&plan, N, me->accum, r->cfg->parallel_grad_dtype,
                                       &r->sb[s][N - 1][i]));
        nmt_scaling_profile p = {.fwd_ms = r->fwd_ms, .bwd_ms = r->bwd_ms,
                                 .opt_ms = stage_update_ms(r, &plan),
                                 .n_buckets = *nb, .bytes = r->bytes, .ready_ms = r->ready};
        nmt_scaling_zero zz = {.zero = z, .accum = me->accum,
                               .period_ms = (r->fwd_ms + r->bwd_ms) / me->accum,
                               .gather_bytes = r->gather};
        NMT_TRY(nmt_scaling_predict_zero(&p, N, &link, &zz, &r->pred[s][N - 1][i]));
        NMT_TRY(nmt_scaling_predict_zero(&p, N, &slink, &zz, &r->serial[s][N - 1][i]));
      }
  return NMT_OK;
}

/* Per-GPU memory of each stage at mem_n devices, without and with activation checkpointing,
 * and the largest data.max_tokens that fits the device memory (when one is known). */
static nmt_status memory(nmt__scaling_run *r) {
  const nmt_config *cfg = r->cfg;
  const nmt__scaling_preset *ps = r->ps;
  r->mem_n = ps ? ps->gpus : cfg->parallel_devices > 1 ? cfg->parallel_devices : 2;
  r->capacity = 0;
  snprintf(r->capacity_origin, sizeof r->capacity_origin, "none: give --mem-gb or a preset");
  if (r->o->mem_gb > 0) {
    r->capacity = r->o->mem_gb * 1073741824.0;
    snprintf(r->capacity_origin, sizeof r->capacity_origin, "declared on the command line");
  } else if (ps) {
    r->capacity = ps->capacity_gib * 1073741824.0;
    snprintf(r->capacity_origin, sizeof r->capacity_origin, "%s", ps->capacity_origin);
  }
  const double reserve_gib = r->o->reserve_gb >= 0 ? r->o->reserve_gb : default_reserve_gib;
  r->reserve = reserve_gib * 1073741824.0;
  snprintf(r->reserve_origin, sizeof r->reserve_origin, "%s",
           r->o->reserve_gb >= 0 ? "declared on the command line" : default_reserve_origin);
  /* Stage 2's plan as the trainer makes it for mem_n ranks. */
  nmt_bucket_plan s2;
  NMT_TRY(nmt_bucket_plan_make_model_stages(&r->mc, r->mem_n, &s2));
  r->windows_floats = nmt_grad_windows_floats(&s2);
  nmt_status st = NMT_OK;
  for (int s = 0; st == NMT_OK && s < r->n_stages; s++)
    for (int ck = 0; st == NMT_OK && ck < 2; ck++) {
      nmt_scaling_memory *m = &r->mem[s][ck];
      st = nmt_scaling_state_bytes(r->stage[s], r->mem_n, r->me.n_params, &s2, r->half,
                                   r->sizes[r->cfg_idx >= 0 ? r->cfg_idx : 0], m);
      if (st != NMT_OK) break;
      const double fixed = m->total + r->reserve;
      nmt_model_cfg mc = r->mc;
      mc.checkpoint_activations = ck;
      st = nmt_scaling_token_bytes(&mc, cfg->data_max_tokens, cfg->data_max_len, r->half, m);
      m->reserve = r->reserve;
      m->total = fixed + m->activations + m->scratch + m->batch;
      r->fit_tokens[s][ck] = 0;
      if (st == NMT_OK && r->capacity > 0)
        st = nmt_scaling_max_tokens(&mc, cfg->data_max_len, r->half, fixed, r->capacity,
                                    &r->fit_tokens[s][ck]);
    }
  nmt_bucket_plan_free(&s2);
  return st;
}

/* Zero 0 across 1..nodes nodes of gpn GPUs: ring and two-level, every bucket size. */
static nmt_status predict_nodes(nmt__scaling_run *r) {
  const nmt_bench_scaling_opts *o = r->o;
  if (o->nodes < 2) return NMT_OK;
  r->gpn = r->ps ? r->ps->gpus : r->cfg->parallel_devices > 1 ? r->cfg->parallel_devices : 1;
  r->net_busbw = o->net_gbps / 8.0 * net_efficiency;
  snprintf(r->net_origin, sizeof r->net_origin, "line rate %g Gb/s (%s) / 8 x ASSUMED %.0f%% "
           "achieved (NCCL's ring reaches 12.2 GB/s of 12.5 on one 100 Gb/s NIC with GPUDirect "
           "RDMA: NVIDIA/nccl-tests#29; GeForce has none)", o->net_gbps,
           o->net_gbps == 100 ? "the default" : "declared", 100 * net_efficiency);
  r->net_step_us = o->net_latency_us >= 0 ? o->net_latency_us : nccl_net_step_us;
  r->intra_step_us = nccl_pci_step_us;
  snprintf(r->net_lat_origin, sizeof r->net_lat_origin, "%s; a ring step inside a node %.1f us "
           "(NCCL's tuning model, src/graph/tuning.cc hwLat: ring, Simple protocol, NET and PCI)",
           o->net_latency_us >= 0 ? "declared on the command line" : "NCCL's tuning model",
           r->intra_step_us);
  for (int k = 1; k <= o->nodes; k++)
    for (int i = 0; i < r->n_sizes; i++) {
      int *nb = &r->node_nb[k - 1][i];
      nmt_bucket_plan plan;
      NMT_TRY(plan_buckets(r, 0, k * r->gpn, r->sizes[i], nb, &plan));
      nmt_scaling_profile p = {.fwd_ms = r->fwd_ms, .bwd_ms = r->bwd_ms, .opt_ms = r->opt_ms,
                               .n_buckets = *nb, .bytes = r->bytes, .ready_ms = r->ready};
      for (int a = 0; a < 2; a++) {
        nmt_scaling_link l = {.busbw_gbs = r->busbw, .latency_us = r->lat,
                              .nodes = k > 1 ? k : 0, .gpus_per_node = r->gpn,
                              .net_busbw_gbs = r->net_busbw, .net_step_us = r->net_step_us,
                              .intra_step_us = r->intra_step_us, .algo = (nmt_scaling_algo)a};
        NMT_TRY(nmt_scaling_predict(&p, k * r->gpn, &l, &r->node_pred[a][k - 1][i]));
      }
    }
  return NMT_OK;
}

/* Measures one device. On the CPU reference a base-model micro-batch of thousands of tokens
 * takes tens of seconds, so by default it measures fewer steps of micro-batches of at most
 * 1024 tokens, one per step, and extrapolates to the config's batch (report_inputs says so). */
static nmt_status measure(nmt__scaling_run *r) {
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

static nmt_status run(nmt__scaling_run *r, const char *config_label, const char *jsonl_path,
                      FILE *out) {
  for (int i = 0; i < 3; i++) r->load0[i] = r->load1[i] = -1;
  getloadavg(r->load0, 3);
  NMT_TRY(measure(r));
  getloadavg(r->load1, 3);
  nmt_model_cfg_from_config(r->cfg, &r->mc);
  pick_sizes(r);
  compute_times(r);
  NMT_TRY(link_inputs(r));
  r->half = r->cfg->precision_mode == NMT_PRECISION_FP16 ||
            r->cfg->precision_mode == NMT_PRECISION_BF16;
  r->stage_floats = nmt_scaling_largest_stage(r->me.ready_floats, r->me.n_events,
                                              r->me.n_params);
  const int z = r->o->zero >= 0 ? r->o->zero : r->cfg->parallel_zero;
  r->n_stages = z == NMT_SCALING_ZERO_ALL ? 3 : 1;
  for (int s = 0; s < r->n_stages; s++) r->stage[s] = r->n_stages > 1 ? s : z;
  nmt_log_progress("bench scaling: predicting N = 1..%d devices", r->o->max_devices);
  NMT_TRY(predict(r));
  NMT_TRY(memory(r));
  NMT_TRY(predict_nodes(r));
  nmt_log_progress_end();
  char cpu[256], commit[64], date[32];
  nmt__bench_cpu_name(cpu, sizeof cpu);
  nmt__bench_commit(commit, sizeof commit);
  time_t now = time(NULL);
  struct tm tm;
  gmtime_r(&now, &tm);
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tm);
  nmt__scaling_report_inputs(r, config_label, cpu, commit, date, out);
  nmt__scaling_report_tables(r, out);
  if (jsonl_path)
    NMT_TRY(nmt__scaling_report_jsonl(r, config_label, cpu, commit, date, jsonl_path));
  return NMT_OK;
}

nmt_status nmt_bench_scaling(const nmt_config *cfg, const char *config_label,
                             const nmt_bench_scaling_opts *o, const char *jsonl_path, FILE *out) {
  NMT_TRY(check_options(cfg, o));
  nmt__scaling_run *r = calloc(1, sizeof *r);
  if (!r) return nmt_errorf(NMT_ERR_NOMEM, "bench scaling: run state");
  r->cfg = cfg, r->o = o;
  r->ps = o->preset == NMT_SCALING_PRESET_RTX3090X4 ? &rtx3090x4 : NULL;
  nmt_status s = run(r, config_label, jsonl_path, out);
  free(r->bytes), free(r->ready), free(r->gather);
  free(r);
  return s;
}
