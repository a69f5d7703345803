/* scaling_report.c — what `nmt bench scaling` prints (src/bench/scaling_impl.h): the inputs
 * with their origins, the step-time grid and per-N table, the ZeRO stages, per-GPU memory, the
 * node table, and the JSON rows.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "nmt/backend.h"
#include "nmt/bench.h"
#include "nmt/comm.h"
#include "nmt/json.h"
#include "scaling_impl.h"

static const double MIB = 1048576.0;

/* "fp32", "tf32", "fp16", "bf16" (precision.mode). */
static const char *precision_name(nmt_precision p) {
  switch (p) {
    case NMT_PRECISION_TF32: return "tf32";
    case NMT_PRECISION_FP16: return "fp16";
    case NMT_PRECISION_BF16: return "bf16";
    default: return "fp32";
  }
}

/* ------------------------------------------------------------------------------------------ */
/* the header                                                                                 */

/* ZeRO's, memory's and the network's inputs. */
static void report_zero_inputs(const nmt__scaling_run *r, FILE *out) {
  const nmt_config *cfg = r->cfg;
  fprintf(out, "#   %-30s %12s     %s\n", "ZeRO stage(s)",
          r->n_stages > 1 ? "0, 1, 2" : r->stage[0] == 0 ? "0" : r->stage[0] == 1 ? "1" : "2",
          r->o->zero >= 0 ? "declared on the command line (--zero)" : "parallel.zero");
  if (r->n_stages > 1 || r->stage[0] > 0) {
    fprintf(out, "#   %-30s %12s     zero 1: buckets reduce-scattered (busbw factor (N-1)/N) "
            "during the last micro-batch's backward, then the norm's 4 B all-reduce, the update "
            "of the shard and the all-gather of the fp32 weights per bucket%s, NOT overlapped "
            "(the next forward needs them); zero 2: every micro-batch's backward reduce-"
            "scatters (micro-batches taken identical: %d x %.3f ms)\n", "ZeRO collectives", "",
            r->half ? " (the 16-bit copy is cast from them locally, not gathered)" : "",
            r->me.accum,
            (r->fwd_ms + r->bwd_ms) / r->me.accum);
    fprintf(out, "#   %-30s %12s     the zero 0 update x (4 B x zeroed gradient + 32 B x "
            "shard) / (36 B x parameters): norm and AdamW on the shard, the gradient zeroed "
            "whole (zero 1) or as the shard (zero 2)\n", "update at zero >= 1", "");
  }
  fprintf(out, "#   %-30s %12zu     floats: the largest step between the measured grad-ready "
          "prefixes (zero 2 keeps two such windows besides its shard)\n", "largest backward stage",
          r->stage_floats);
  fprintf(out, "#   %-30s %12zu     floats at N = %d: two of the largest padded stage and the "
          "tied embedding's, held through backward (nmt_grad_windows_floats)\n",
          "zero 2 gradient windows", r->windows_floats, r->mem_n);
  fprintf(out, "#   %-30s %12d     devices sharing ZeRO's state in the memory table (%s)\n",
          "memory table at N", r->mem_n,
          r->ps ? "the preset's GPUs" : "parallel.devices, at least 2");
  if (r->capacity > 0)
    fprintf(out, "#   %-30s %12.2f GiB %s\n", "device memory", r->capacity / 1073741824.0,
            r->capacity_origin);
  else
    fprintf(out, "#   %-30s %12s     %s\n", "device memory", "unknown", r->capacity_origin);
  fprintf(out, "#   %-30s %12.2f GiB %s\n", "reserve", r->reserve / 1073741824.0,
          r->reserve_origin);
  fprintf(out, "#   %-30s %12s     activations nmt_model_arena_bytes(data.max_tokens = %d, "
          "data.max_len = %d), fp32; batch buffers 3 x (5 x max_tokens + 16) int32; scratch: "
          "CUDA's attention scratch%s\n", "activations, scratch", "", cfg->data_max_tokens,
          cfg->data_max_len, r->half ? " + 16-bit GEMM copies" : "");
  if (r->o->nodes >= 2) {
    fprintf(out, "#   %-30s %12d     %s\n", "GPUs per node", r->gpn,
            r->ps ? "the preset's" : "parallel.devices");
    fprintf(out, "#   %-30s %12.3f GB/s  %s\n", "network busbw per node", r->net_busbw,
            r->net_origin);
    fprintf(out, "#   %-30s %12.2f us  %s\n", "latency per network step", r->net_step_us,
            r->net_lat_origin);
  }
}

/* The header: what was measured, where, and every input with its origin. */
void nmt__scaling_report_inputs(const nmt__scaling_run *r, const char *config_label,
                                const char *cpu, const char *commit, const char *date, FILE *out) {
  const nmt_scaling_measurement *me = &r->me;
  const nmt_model_cfg *mc = &r->mc;
  const nmt_config *cfg = r->cfg;
  const nmt__scaling_preset *ps = r->ps;
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
  report_zero_inputs(r, out);
  fprintf(out, "#\n# grad-ready events of the last backward (ms from the step's first forward; "
          "compute ends at %.3f)\n#   %14s %12s\n", r->fwd_ms + r->bwd_ms, "final floats",
          "ready ms");
  for (int k = 0; k < me->n_events; k++)
    fprintf(out, "#   %14zu %12.3f\n", me->ready_floats[k], r->scaled_ready[k]);
}

/* ------------------------------------------------------------------------------------------ */
/* the tables                                                                                 */

/* The step-time grid (N x bucket size) and the per-N table at the best size, for stage[0]. */
static void report_grid(const nmt__scaling_run *r, FILE *out) {
  const int max_n = r->o->max_devices, z = r->stage[0];
  const double cfg_mb = r->cfg->parallel_bucket_mb;
  fprintf(out, "#\n# predicted step time (ms), zero %d, comm stream overlapped with backward; "
          "rows N devices, columns bucket MiB (buckets)%s\n", z,
          r->cfg_idx >= 0 ? "; * = config's" : "");
  fprintf(out, "%4s", "N");
  for (int i = 0; i < r->n_sizes; i++) {
    char h[48];
    snprintf(h, sizeof h, "%g(%d)%s", r->sizes[i], r->nb[0][0][i], i == r->cfg_idx ? "*" : "");
    fprintf(out, " %11s", h);
  }
  fprintf(out, " %6s\n", "best");
  for (int N = 1; N <= max_n; N++) {
    fprintf(out, "%4d", N);
    for (int i = 0; i < r->n_sizes; i++) fprintf(out, " %11.2f", r->pred[0][N - 1][i].step_ms);
    fprintf(out, " %6g\n", r->sizes[nmt_scaling_best(r->pred[0][N - 1], r->n_sizes)]);
  }
  fprintf(out, "#\n# per N at the best bucket size (ties: the smaller); serial_ms: the same "
          "buckets reduced without overlap, as today's CPU workers do%s\n",
          z ? "; allreduce_ms: the reduce-scatters and the slots' all-reduce" : "");
  fprintf(out, "%4s %9s %7s %12s %11s %10s %10s %11s %10s", "N", "bucket_mb", "buckets",
          "allreduce_ms", "exposed_ms", "step_ms", "efficiency", "tgt_tok/s", "serial_ms");
  fprintf(out, z ? " %9s %9s\n" : "\n", "gather_ms", "update_ms");
  const double step1 = nmt__scaling_step1_ms(r);
  for (int N = 1; N <= max_n; N++) {
    int b = nmt_scaling_best(r->pred[0][N - 1], r->n_sizes);
    const nmt_scaling_pred *p = &r->pred[0][N - 1][b];
    fprintf(out, "%4d %9g %7d %12.3f %11.3f %10.3f %10.3f %11.1f %10.3f", N, r->sizes[b],
            r->nb[0][N - 1][b], p->allreduce_ms, p->exposed_ms, p->step_ms, step1 / p->step_ms,
            N * r->me.tokens / p->step_ms * 1e3, r->serial[0][N - 1][b].step_ms);
    if (z) fprintf(out, " %9.3f %9.3f", p->norm_ms + p->gather_ms, p->opt_ms);
    fprintf(out, "%s\n", r->ps && N > r->ps->gpus ? "  (beyond the preset's GPUs: extrapolated)" : "");
  }
  if (cfg_mb == NMT_BUCKET_MB_AUTO && max_n >= 2)
    fprintf(out, "# parallel.bucket_mb = auto: a run measures its own backward and communicator "
            "at its start and picks among %g..%g MiB the size of least exposed communication "
            "(docs/scaling.md); by this model, the best column\n",
            nmt_bucket_candidates_mb[0], nmt_bucket_candidates_mb[NMT_BUCKET_CANDIDATES - 1]);
  if (r->cfg_idx >= 0 && max_n >= 2) {
    fprintf(out, "# at the config's bucket_mb = %g:", cfg_mb);
    for (int N = 2; N <= max_n && N <= 4; N++)
      fprintf(out, "%s N=%d %.3f ms (serial %.3f)", N > 2 ? ";" : "", N,
              r->pred[0][N - 1][r->cfg_idx].step_ms, r->serial[0][N - 1][r->cfg_idx].step_ms);
    fprintf(out, "\n");
  }
}

/* What each stage moves per step, at the memory table's N (within --max-devices) and the
 * config's bucket size. */
static void report_bytes(const nmt__scaling_run *r, FILE *out) {
  const int N = r->mem_n < r->o->max_devices ? r->mem_n : r->o->max_devices;
  const int i = r->cfg_idx >= 0 ? r->cfg_idx : 0;
  fprintf(out, "#\n# bytes per step at N = %d, bucket_mb = %g (nccl-tests sizes; bus = what each "
          "rank moves over its busiest link)\n", N, r->sizes[i]);
  fprintf(out, "%4s %14s %14s %14s %11s\n", "zero", "backward_B", "after_update_B", "bus_B",
          "collectives");
  for (int s = 0; s < r->n_stages; s++) {
    const nmt_scaling_step_bytes *b = &r->sb[s][N - 1][i];
    fprintf(out, "%4d %14.0f %14.0f %14.0f %11d\n", r->stage[s], b->backward_bytes,
            b->gather_bytes, b->bus_bytes, b->calls);
  }
}

/* The ZeRO stages side by side, each at its best bucket size. */
static void report_zero(const nmt__scaling_run *r, FILE *out) {
  if (r->n_stages < 2) return;
  fprintf(out, "#\n# ZeRO stages per N at each stage's best bucket size: backward_ms = the "
          "backward's collectives (all-reduce; reduce-scatter + slots), gather_ms = norm "
          "all-reduce + all-gathers after the update (not overlapped)\n");
  fprintf(out, "%4s %4s %9s %7s %11s %10s %9s %9s %10s %10s %11s\n", "N", "zero", "bucket_mb",
          "buckets", "backward_ms", "exposed_ms", "update_ms", "gather_ms", "step_ms",
          "efficiency", "tgt_tok/s");
  const double step1 = nmt__scaling_step1_ms(r);
  for (int N = 1; N <= r->o->max_devices; N++)
    for (int s = 0; s < r->n_stages; s++) {
      int b = nmt_scaling_best(r->pred[s][N - 1], r->n_sizes);
      const nmt_scaling_pred *p = &r->pred[s][N - 1][b];
      fprintf(out, "%4d %4d %9g %7d %11.3f %10.3f %9.3f %9.3f %10.3f %10.3f %11.1f\n", N,
              r->stage[s], r->sizes[b], r->nb[s][N - 1][b], p->allreduce_ms, p->exposed_ms,
              p->opt_ms, p->norm_ms + p->gather_ms, p->step_ms, step1 / p->step_ms,
              N * r->me.tokens / p->step_ms * 1e3);
    }
}

/* Per-GPU memory of each stage, without and with activation checkpointing. */
static void report_memory(const nmt__scaling_run *r, FILE *out) {
  const nmt_config *cfg = r->cfg;
  fprintf(out, "#\n# per-GPU memory (MiB) at N = %d, data.max_tokens = %d, precision %s: "
          "weights = fp32 (+ 16-bit copy), grads, optim = Adam m + v; fit = the largest "
          "data.max_tokens whose total fits the device memory\n", r->mem_n, cfg->data_max_tokens,
          precision_name(cfg->precision_mode));
  fprintf(out, "%4s %5s %9s %9s %9s %11s %9s %9s %9s %5s %9s\n", "zero", "ckpt", "weights",
          "grads", "optim", "activations", "scratch", "reserve", "total", "fits", "fit_tokens");
  for (int s = 0; s < r->n_stages; s++)
    for (int ck = 0; ck < 2; ck++) {
      const nmt_scaling_memory *m = &r->mem[s][ck];
      fprintf(out, "%4d %5s %9.1f %9.1f %9.1f %11.1f %9.1f %9.1f %9.1f", r->stage[s],
              ck ? "yes" : "no", m->weights / MIB, m->grads / MIB, m->optim / MIB,
              m->activations / MIB, (m->scratch + m->batch) / MIB, m->reserve / MIB,
              m->total / MIB);
      if (r->capacity > 0)
        fprintf(out, " %5s %9d%s\n", m->total <= r->capacity ? "yes" : "NO", r->fit_tokens[s][ck],
                r->fit_tokens[s][ck] < cfg->data_max_len ? " (< data.max_len: no batch fits)" : "");
      else
        fprintf(out, " %5s %9s\n", "-", "-");
    }
}

/* Zero 0 across 1..nodes nodes: the ring grid, then per node count the best of each model. */
static void report_nodes(const nmt__scaling_run *r, FILE *out) {
  const int K = r->o->nodes;
  if (K < 2) return;
  const double step1 = nmt__scaling_step1_ms(r);
  fprintf(out, "#\n# several nodes, zero 0 (the trainer refuses ZeRO across nodes): predicted "
          "efficiency = step(1 GPU) / step, NCCL ring over all N = nodes x %d GPUs; rows nodes, "
          "columns bucket MiB (buckets)\n", r->gpn);
  fprintf(out, "%5s %4s", "nodes", "N");
  for (int i = 0; i < r->n_sizes; i++) {
    char h[48];
    snprintf(h, sizeof h, "%g(%d)", r->sizes[i], r->node_nb[0][i]);
    fprintf(out, " %11s", h);
  }
  fprintf(out, "\n");
  for (int k = 1; k <= K; k++) {
    fprintf(out, "%5d %4d", k, k * r->gpn);
    for (int i = 0; i < r->n_sizes; i++)
      fprintf(out, " %11.3f", step1 / r->node_pred[0][k - 1][i].step_ms);
    fprintf(out, "\n");
  }
  fprintf(out, "#\n# per node count at the best bucket size: ring, and two-level (reduce-scatter "
          "in the node, all-reduce across, all-gather); efficiency = step(1 GPU) / step\n");
  fprintf(out, "%5s %4s %9s %10s %10s %10s %11s %9s %10s %10s\n", "nodes", "N", "bucket_mb",
          "exposed_ms", "step_ms", "efficiency", "tgt_tok/s", "2l_bucket", "2l_step_ms",
          "2l_effic");
  for (int k = 1; k <= K; k++) {
    const int N = k * r->gpn;
    int b = nmt_scaling_best(r->node_pred[0][k - 1], r->n_sizes);
    int b2 = nmt_scaling_best(r->node_pred[1][k - 1], r->n_sizes);
    const nmt_scaling_pred *p = &r->node_pred[0][k - 1][b], *q = &r->node_pred[1][k - 1][b2];
    fprintf(out, "%5d %4d %9g %10.3f %10.3f %10.3f %11.1f %9g %10.3f %10.3f\n", k, N,
            r->sizes[b], p->exposed_ms, p->step_ms, step1 / p->step_ms,
            N * r->me.tokens / p->step_ms * 1e3, r->sizes[b2], q->step_ms, step1 / q->step_ms);
  }
}

void nmt__scaling_report_tables(const nmt__scaling_run *r, FILE *out) {
  report_bytes(r, out);
  report_grid(r, out);
  report_zero(r, out);
  report_memory(r, out);
  report_nodes(r, out);
  fflush(out);
}

/* ------------------------------------------------------------------------------------------ */
/* JSON rows                                                                                  */

/* The fields every row starts with. */
static void row_head(const nmt__scaling_run *r, const char *bench, const char *config_label,
                     const char *cpu, const char *commit, const char *date, FILE *f) {
  fprintf(f, "{\"date\": \"%s\", \"commit\": \"%s\", \"bench\": \"%s\", \"config\": ", date,
          commit, bench);
  nmt_json_str(f, config_label);
  fprintf(f, ", \"device\": ");
  nmt_json_str(f, cpu);
  fprintf(f, ", \"backend\": \"%s\", \"precision\": \"%s\", \"preset\": \"%s\"", r->me.backend,
          precision_name(r->cfg->precision_mode), r->ps ? r->ps->name : "none");
}

static void rows_steps(const nmt__scaling_run *r, const char *config_label, const char *cpu,
                       const char *commit, const char *date, FILE *f) {
  const nmt_scaling_measurement *me = &r->me;
  const double step1 = nmt__scaling_step1_ms(r);
  for (int s = 0; s < r->n_stages; s++)
    for (int N = 1; N <= r->o->max_devices; N++)
      for (int i = 0; i < r->n_sizes; i++) {
        const nmt_scaling_pred *p = &r->pred[s][N - 1][i];
        row_head(r, "scaling", config_label, cpu, commit, date, f);
        fprintf(f, ", \"zero\": %d, \"n_devices\": %d, \"bucket_mb\": %g, \"buckets\": %d, "
                "\"fwd_ms\": %.4f, \"bwd_ms\": %.4f, \"opt_ms\": %.4f, \"tokens_per_step\": "
                "%.1f, \"flops_per_step\": %.6g, \"busbw_gbs\": %.6g, \"latency_us\": %.4g, "
                "\"busbw_origin\": ", r->stage[s], N, r->sizes[i], r->nb[s][N - 1][i], r->fwd_ms,
                r->bwd_ms, p->opt_ms, me->tokens, me->flops, r->busbw, r->lat);
        nmt_json_str(f, r->busbw_origin);
        fprintf(f, ", \"latency_origin\": ");
        nmt_json_str(f, r->lat_origin);
        const nmt_scaling_step_bytes *sb = &r->sb[s][N - 1][i];
        fprintf(f, ", \"backward_bytes\": %.0f, \"gather_bytes\": %.0f, \"bus_bytes\": %.0f, "
                "\"collectives\": %d", sb->backward_bytes, sb->gather_bytes, sb->bus_bytes,
                sb->calls);
        fprintf(f, ", \"compute_scale\": %.6g, \"allreduce_ms\": %.4f, \"exposed_ms\": %.4f, "
                "\"norm_ms\": %.4f, \"gather_ms\": %.4f, \"step_ms\": %.4f, \"serial_step_ms\": "
                "%.4f, \"efficiency\": %.5f, \"tgt_tokens_per_s\": %.1f, \"loadavg\": %.2f}\n",
                r->scale, p->allreduce_ms, p->exposed_ms, p->norm_ms, p->gather_ms, p->step_ms,
                r->serial[s][N - 1][i].step_ms, step1 / p->step_ms,
                N * me->tokens / p->step_ms * 1e3, r->load1[0]);
      }
}

static void rows_memory(const nmt__scaling_run *r, const char *config_label, const char *cpu,
                        const char *commit, const char *date, FILE *f) {
  for (int s = 0; s < r->n_stages; s++)
    for (int ck = 0; ck < 2; ck++) {
      const nmt_scaling_memory *m = &r->mem[s][ck];
      row_head(r, "scaling_memory", config_label, cpu, commit, date, f);
      fprintf(f, ", \"zero\": %d, \"n_devices\": %d, \"checkpoint_activations\": %s, "
              "\"max_tokens\": %d, \"max_len\": %d, \"weights_bytes\": %.0f, \"grads_bytes\": "
              "%.0f, \"optim_bytes\": %.0f, \"activation_bytes\": %.0f, \"scratch_bytes\": "
              "%.0f, \"batch_bytes\": %.0f, \"reserve_bytes\": %.0f, \"total_bytes\": %.0f, "
              "\"capacity_bytes\": %.0f, \"stage_floats\": %zu, \"fit_max_tokens\": %d}\n",
              r->stage[s], r->mem_n, ck ? "true" : "false", r->cfg->data_max_tokens,
              r->cfg->data_max_len, m->weights, m->grads, m->optim, m->activations, m->scratch,
              m->batch, m->reserve, m->total, r->capacity, r->stage_floats,
              r->capacity > 0 ? r->fit_tokens[s][ck] : -1);
    }
}

static void rows_nodes(const nmt__scaling_run *r, const char *config_label, const char *cpu,
                       const char *commit, const char *date, FILE *f) {
  const double step1 = nmt__scaling_step1_ms(r);
  for (int a = 0; a < 2 && r->o->nodes >= 2; a++)
    for (int k = 1; k <= r->o->nodes; k++)
      for (int i = 0; i < r->n_sizes; i++) {
        const nmt_scaling_pred *p = &r->node_pred[a][k - 1][i];
        row_head(r, "scaling_nodes", config_label, cpu, commit, date, f);
        fprintf(f, ", \"zero\": 0, \"algo\": \"%s\", \"nodes\": %d, \"gpus_per_node\": %d, "
                "\"n_devices\": %d, \"bucket_mb\": %g, \"buckets\": %d, \"busbw_gbs\": %.6g, "
                "\"latency_us\": %.4g, \"net_busbw_gbs\": %.6g, \"net_step_us\": %.4g, "
                "\"intra_step_us\": %.4g, \"allreduce_ms\": %.4f, \"exposed_ms\": %.4f, "
                "\"step_ms\": %.4f, \"efficiency\": %.5f, \"tgt_tokens_per_s\": %.1f}\n",
                a ? "two_level" : "ring", k, r->gpn, k * r->gpn, r->sizes[i], r->node_nb[k - 1][i],
                r->busbw, r->lat, r->net_busbw, r->net_step_us, r->intra_step_us,
                p->allreduce_ms, p->exposed_ms, p->step_ms, step1 / p->step_ms,
                k * r->gpn * r->me.tokens / p->step_ms * 1e3);
      }
}

nmt_status nmt__scaling_report_jsonl(const nmt__scaling_run *r, const char *config_label,
                                     const char *cpu, const char *commit, const char *date,
                                     const char *jsonl_path) {
  FILE *f = fopen(jsonl_path, "a");
  if (!f) return nmt_errorf(NMT_ERR_IO, "bench scaling: cannot append to %s", jsonl_path);
  rows_steps(r, config_label, cpu, commit, date, f);
  rows_memory(r, config_label, cpu, commit, date, f);
  rows_nodes(r, config_label, cpu, commit, date, f);
  int bad = ferror(f);
  if (fclose(f) != 0 || bad)
    return nmt_errorf(NMT_ERR_IO, "bench scaling: cannot write %s", jsonl_path);
  return NMT_OK;
}
