/* estimate.c — before step 1, what a step will cost: the model FLOPs of a mean step (every
 * batch of the training order through nmt_model_train_flops, src/model/cost.c) over one
 * worker's peak (measured at start, or [profile] peak_tflops). A step cannot run faster than
 * that (metrics.jsonl's mfu says how close it gets). On CPU workers a config sized for GPUs
 * (conf/base.ini) takes minutes per step, and nothing else would say so before step 1 ends. */
#include <math.h>
#include <stdio.h>

#include "nmt/log.h"
#include "nmt/model.h"
#include "run.h"

/* Seconds as "12 s", "7.5 min", "3.2 h" or "4.1 days". */
static void human_s(double s, char *buf, size_t cap) {
  if (s < 120) snprintf(buf, cap, "%.3g s", s);
  else if (s < 7200) snprintf(buf, cap, "%.3g min", s / 60);
  else if (s < 172800) snprintf(buf, cap, "%.3g h", s / 3600);
  else snprintf(buf, cap, "%.3g days", s / 86400);
}

/* The model FLOPs of one worker's mean step: every batch of the training order through
 * nmt_model_train_flops, times accum_steps; 0 without batches. */
static double mean_step_flops(const nmt_trainer *t) {
  const long n = t->train_batcher ? nmt_batcher_num_batches(t->train_batcher) : 0;
  if (n <= 0) return 0;
  double sum = 0;
  for (long id = 0; id < n; id++) {
    int ns = 0, sl = 0, tl = 0;
    long tokens = 0;
    nmt_batcher_shape(t->train_batcher, id, &ns, &sl, &tl, &tokens);
    sum += nmt_model_train_flops(&t->mcfg, ns, sl, tl);
  }
  return sum / (double)n * (double)t->accum; /* one worker's micro-batches of a step */
}

void nmt__log_step_estimate(const nmt_trainer *t, long n_steps) {
  if (!t->be->is_host || !(t->peak_flops > 0) || n_steps <= 0) return;
  const double flops = mean_step_flops(t);
  if (!(flops > 0)) return;
  const double s = flops / t->peak_flops; /* the workers run their micro-batches in parallel */
  char step[32], all[32];
  human_s(s, step, sizeof step);
  human_s(s * (double)n_steps, all, sizeof all);
  /* Loud when a step would take longer than a minute even at the peak. */
  nmt_log(s >= 60 ? NMT_LOG_WARN : NMT_LOG_INFO,
          "estimated at least %s per step on CPU workers (%.3g GFLOP per worker per step at the "
          "peak of %.3g GFLOP/s per worker; metrics.jsonl's mfu is the fraction reached), so at least %s for "
          "%ld steps%s", step, flops / 1e9, t->peak_flops / 1e9, all, n_steps,
          s >= 60 ? ": a config sized for GPUs? (parallel.device, model.*, data.max_tokens)" : "");
}
