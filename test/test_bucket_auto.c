/* test_bucket_auto.c — parallel.bucket_mb = auto (docs/scaling.md "bucket_mb = auto"): the
 * choice on backwards and communicators whose costs are known (nmt_bucket_choose), the key's
 * "auto", and the trainer's use of it: the run trains exactly as with the size it chose, the
 * size is written to config.ini, and a resume takes the checkpoint's size instead of
 * measuring again. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "nmt/backend.h"
#include "nmt/bench.h"
#include "nmt/config.h"
#include "nmt/trainer.h"
#include "test.h"

/* ------------------------------------------------------------------------------------------ */
/* the choice on known costs                                                                  */

enum { MIB_FLOATS = 262144, N_EVENTS = 32 };

/* A backward of 32 MiB of gradients (8 Mi floats) made final 1 MiB at a time, evenly over
 * backward_ms after a forward of backward_ms / 2; the last event covers the trailing slots. */
typedef struct {
  size_t floats[N_EVENTS];
  double ms[N_EVENTS];
  nmt_bucket_choice_in in;
} known_backward;

static void known(known_backward *k, double backward_ms, const nmt_bucket_cost_point *cost,
                  int n_cost, int serial) {
  const size_t n = (size_t)N_EVENTS * MIB_FLOATS;
  const double fwd = backward_ms / 2;
  for (int e = 0; e < N_EVENTS; e++) {
    k->floats[e] = (size_t)(e + 1) * MIB_FLOATS;
    k->ms[e] = fwd + backward_ms * (e + 1) / N_EVENTS;
  }
  k->floats[N_EVENTS - 1] = n + NMT_GRAD_EXTRA;
  k->in = (nmt_bucket_choice_in){.ready_floats = k->floats, .ready_ms = k->ms,
                                 .n_events = N_EVENTS, .compute_end_ms = fwd + backward_ms,
                                 .n_params = n, .zero = 0, .n_ranks = 2, .cost = cost,
                                 .n_cost = n_cost, .serial = serial};
}

/* CPU workers (each collective blocks compute) on a link with 1 ms of latency per call and
 * 4 MiB/ms: exposed = calls x 1 ms + 8 ms, least with one bucket (n_buckets 1; 32 MiB still
 * makes two: the trailing slots follow the gradients). */
NMT_TEST(bucket_auto_serial_latency_picks_one_bucket) {
  const nmt_bucket_cost_point cost[] = {{1048576.0, 1.25}, {64 * 1048576.0, 17.0}};
  known_backward k;
  known(&k, 100, cost, 2, 1);
  nmt_bucket_choice_row rows[NMT_BUCKET_CANDIDATES];
  int n = 0, best = -1;
  NMT_ASSERT_OK(nmt_bucket_choose(&k.in, rows, &n, &best));
  NMT_ASSERT(n >= 3 && best >= 0 && best < n);
  NMT_ASSERT_EQ_INT(rows[best].n_buckets, 1);
  NMT_ASSERT(rows[best].bucket_mb == 64);
  /* 1 MiB: 33 calls (the slots spill into a 33rd) of ~1.25 ms. */
  NMT_ASSERT(rows[0].bucket_mb == 1 && rows[0].n_buckets == 33);
  NMT_ASSERT(fabs(rows[0].exposed_ms - rows[0].comm_ms) < 1e-12); /* serial: all exposed */
  NMT_ASSERT(rows[best].exposed_ms < rows[0].exposed_ms - 25);
}

/* GPUs (one comm stream overlapping backward), a long backward and a fast link: every bucket
 * but the last is hidden, so the smallest size leaves the least (its last 1 MiB, ~1 ms), and
 * the one-bucket plan starts only when compute ends (all ~32 ms exposed). */
NMT_TEST(bucket_auto_overlap_picks_small_buckets) {
  const nmt_bucket_cost_point cost[] = {{1048576.0, 1.01}, {64 * 1048576.0, 64.01}};
  known_backward k;
  known(&k, 1000, cost, 2, 0);
  nmt_bucket_choice_row rows[NMT_BUCKET_CANDIDATES];
  int n = 0, best = -1;
  NMT_ASSERT_OK(nmt_bucket_choose(&k.in, rows, &n, &best));
  NMT_ASSERT(rows[best].bucket_mb == 1);
  NMT_ASSERT(rows[best].exposed_ms < 1.1);
  NMT_ASSERT(rows[n - 1].n_buckets == 1 && rows[n - 1].exposed_ms > 32);
}

/* CPU workers on a communicator that is fast for messages that stay in cache (0.1 ms per MiB
 * up to 1 MiB) and slow past it: the measured table, not a latency-bandwidth line, decides,
 * and 1 MiB buckets win although they make the most calls. */
NMT_TEST(bucket_auto_follows_the_measured_table) {
  const nmt_bucket_cost_point cost[] = {
      {1048576.0, 0.1}, {2 * 1048576.0, 0.3}, {4 * 1048576.0, 4.0}, {64 * 1048576.0, 64.0}};
  known_backward k;
  known(&k, 100, cost, 4, 1);
  nmt_bucket_choice_row rows[NMT_BUCKET_CANDIDATES];
  int n = 0, best = -1;
  NMT_ASSERT_OK(nmt_bucket_choose(&k.in, rows, &n, &best));
  NMT_ASSERT(rows[best].bucket_mb == 1);
  NMT_ASSERT(rows[best].exposed_ms < 3.5); /* 33 x 0.1 */
}

/* Ties (within 1% or 0.01 ms): the least total, then the larger size. On a long backward and
 * a link of ~10 us per call every plan hides all but its last collective (~0.01 ms), so all
 * tie, and the larger buckets, with fewer calls, take less link time in all. */
NMT_TEST(bucket_auto_ties_go_to_fewer_calls) {
  const nmt_bucket_cost_point cost[] = {{1048576.0, 0.0101}, {64 * 1048576.0, 0.0164}};
  known_backward k;
  known(&k, 1000, cost, 2, 0);
  nmt_bucket_choice_row rows[NMT_BUCKET_CANDIDATES];
  int n = 0, best = -1;
  NMT_ASSERT_OK(nmt_bucket_choose(&k.in, rows, &n, &best));
  double least = INFINITY;
  for (int i = 0; i < n; i++) least = fmin(least, rows[i].exposed_ms);
  NMT_ASSERT(least > 0.0099 && least < 0.0166); /* one last collective */
  NMT_ASSERT(rows[best].exposed_ms <= least + 0.01);
  for (int i = 0; i < n; i++) /* the least link time among the tied */
    if (rows[i].exposed_ms <= least + 0.01) NMT_ASSERT(rows[best].comm_ms <= rows[i].comm_ms);
  NMT_ASSERT(rows[best].bucket_mb > 1 && rows[best].comm_ms < rows[0].comm_ms / 4);
}

NMT_TEST(bucket_auto_refuses_bad_inputs) {
  const nmt_bucket_cost_point one[] = {{1048576.0, 1.0}};
  const nmt_bucket_cost_point down[] = {{2 * 1048576.0, 1.0}, {1048576.0, 2.0}};
  known_backward k;
  nmt_bucket_choice_row rows[NMT_BUCKET_CANDIDATES];
  int n = 0, best = -1;
  known(&k, 100, one, 1, 1);
  NMT_ASSERT_EQ_STATUS(nmt_bucket_choose(&k.in, rows, &n, &best), NMT_ERR_USAGE);
  known(&k, 100, down, 2, 1);
  NMT_ASSERT_EQ_STATUS(nmt_bucket_choose(&k.in, rows, &n, &best), NMT_ERR_USAGE);
  const nmt_bucket_cost_point ok[] = {{1048576.0, 1.0}, {2 * 1048576.0, 2.0}};
  known(&k, 100, ok, 2, 1);
  k.ms[3] = k.ms[2] - 1; /* out of order */
  NMT_ASSERT_EQ_STATUS(nmt_bucket_choose(&k.in, rows, &n, &best), NMT_ERR_USAGE);
  known(&k, 100, ok, 2, 1);
  k.floats[N_EVENTS - 1] = k.in.n_params; /* the trailing slots never reported final */
  NMT_ASSERT_EQ_STATUS(nmt_bucket_choose(&k.in, rows, &n, &best), NMT_ERR_USAGE);
}

/* ------------------------------------------------------------------------------------------ */
/* the key                                                                                    */

NMT_TEST(bucket_auto_key_round_trip) {
  char ini[600], dump[600];
  const char *dir = nmt_test_tmpdir();
  snprintf(ini, sizeof ini, "%s/auto.ini", dir);
  snprintf(dump, sizeof dump, "%s/dump.ini", dir);
  FILE *f = fopen(ini, "w");
  NMT_ASSERT(f);
  fputs("[parallel]\nbucket_mb = auto\n", f);
  fclose(f);
  nmt_config c, back;
  NMT_ASSERT_OK(nmt_config_load(ini, NULL, 0, &c));
  NMT_ASSERT(c.parallel_bucket_mb == NMT_BUCKET_MB_AUTO);
  f = fopen(dump, "w");
  NMT_ASSERT(f);
  NMT_ASSERT_OK(nmt_config_dump(&c, f));
  fclose(f);
  char *text = nmt_th_read_file(dump, NULL);
  NMT_ASSERT(text && strstr(text, "\nbucket_mb = auto\n"));
  free(text);
  NMT_ASSERT_OK(nmt_config_load(dump, NULL, 0, &back));
  NMT_ASSERT(back.parallel_bucket_mb == NMT_BUCKET_MB_AUTO);
  /* A word other than auto, and 0 (auto's stored value), are refused with the range. */
  const char *bad[] = {"parallel.bucket_mb=autox", "parallel.bucket_mb=0"};
  for (int i = 0; i < 2; i++) {
    NMT_ASSERT_EQ_STATUS(nmt_config_load(ini, &bad[i], 1, &c), NMT_ERR_CONFIG);
    NMT_ASSERT(strstr(nmt_last_error(), "auto"));
    nmt_clear_error();
  }
}

/* ------------------------------------------------------------------------------------------ */
/* the trainer                                                                                */

static char *config_ini_line(const nmt_config *c) {
  char path[NMT_PATH_MAX + 16];
  snprintf(path, sizeof path, "%s/config.ini", c->run_out_dir);
  char *text = nmt_th_read_file(path, NULL);
  if (!text) return NULL;
  char *p = strstr(text, "\nbucket_mb = ");
  char *line = p ? strndup(p + 1, strcspn(p + 1, "\n")) : NULL;
  free(text);
  return line;
}

/* Trains c to the end; copies the final parameters into *params (malloc'd). */
static nmt_status train_copy(const nmt_config *c, float **params, size_t *n) {
  nmt_trainer *t = NULL;
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1, o.overwrite = !c->run_resume;
  NMT_TRY(nmt_trainer_create(c, &o, &t));
  nmt_status s = nmt_trainer_run(t);
  if (s == NMT_OK) {
    const float *p = nmt_trainer_params(t, n);
    *params = malloc(*n * sizeof(float));
    if (*params) memcpy(*params, p, *n * sizeof(float));
  }
  nmt_trainer_destroy(t);
  return s;
}

/* Two CPU workers: the run with auto measures (one backward, the host communicator), picks
 * the only distinct plan of the tiny model (every candidate is one bucket: 1 MiB), writes it
 * to config.ini, and trains bitwise as the run given 1 MiB: the probe leaves no trace. */
NMT_TEST(bucket_auto_trains_as_its_choice) {
  const char *dir = nmt_test_tmpdir();
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(dir, 96, 5, &c));
  c.parallel_devices = 2;
  c.train_max_steps = 3;
  c.parallel_bucket_mb = NMT_BUCKET_MB_AUTO;
  float *pa = NULL, *pb = NULL;
  size_t na = 0, nb = 0;
  NMT_ASSERT_OK(train_copy(&c, &pa, &na));
  char *line = config_ini_line(&c);
  NMT_ASSERT(line && !strcmp(line, "bucket_mb = 1"));
  free(line);
  c.parallel_bucket_mb = 1;
  NMT_ASSERT_OK(train_copy(&c, &pb, &nb));
  NMT_ASSERT(pa && pb && na == nb);
  NMT_ASSERT(memcmp(pa, pb, na * sizeof(float)) == 0);
  free(pa), free(pb);
}

/* A resume under auto cuts the buckets the checkpoint's run used (here 4 MiB, set by hand:
 * measuring would give 1 MiB on this model) and says so in config.ini. One rank: no collective,
 * the default size. ZeRO stage 2: nothing to choose. */
NMT_TEST(bucket_auto_resume_keeps_the_checkpoints_size) {
  const char *dir = nmt_test_tmpdir();
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(dir, 96, 5, &c));
  c.parallel_devices = 2;
  c.train_max_steps = 2;
  c.parallel_bucket_mb = 4;
  float *p = NULL;
  size_t n = 0;
  NMT_ASSERT_OK(train_copy(&c, &p, &n));
  free(p), p = NULL;
  c.train_max_steps = 4;
  c.run_resume = 1;
  c.parallel_bucket_mb = NMT_BUCKET_MB_AUTO;
  NMT_ASSERT_OK(train_copy(&c, &p, &n));
  free(p), p = NULL;
  char *line = config_ini_line(&c);
  NMT_ASSERT(line && !strcmp(line, "bucket_mb = 4"));
  free(line);

  nmt_config one;
  NMT_ASSERT_OK(nmt_th_tiny_run(dir, 96, 5, &one));
  one.parallel_bucket_mb = NMT_BUCKET_MB_AUTO;
  NMT_ASSERT_OK(train_copy(&one, &p, &n));
  free(p), p = NULL;
  line = config_ini_line(&one);
  NMT_ASSERT(line && !strcmp(line, "bucket_mb = 25"));
  free(line);

  one.parallel_devices = 2;
  one.parallel_zero = 2;
  NMT_ASSERT_OK(train_copy(&one, &p, &n));
  free(p), p = NULL;
  line = config_ini_line(&one);
  NMT_ASSERT(line && !strcmp(line, "bucket_mb = 25"));
  free(line);
}

/* Trains one step of a model of ~15 MiB of gradients on two CPU workers with auto, the host
 * communicator's costs shaped by NMT_TEST_HOST_COMM_DELAY_US = delay; *mb: the size the run
 * chose (config.ini). */
static void auto_under_delay(const char *delay, double *mb) {
  const char *dir = nmt_test_tmpdir();
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(dir, 96, 5, &c));
  c.parallel_devices = 2;
  c.train_max_steps = 1;
  c.model_d_model = 256, c.model_d_ff = 1024, c.model_n_heads = 4;
  c.parallel_bucket_mb = NMT_BUCKET_MB_AUTO;
  setenv("NMT_TEST_HOST_COMM_DELAY_US", delay, 1);
  float *p = NULL;
  size_t n = 0;
  nmt_status s = train_copy(&c, &p, &n);
  unsetenv("NMT_TEST_HOST_COMM_DELAY_US");
  NMT_ASSERT_OK(s);
  NMT_ASSERT(n * sizeof(float) > 12 * 1048576.0 && n * sizeof(float) < 16 * 1048576.0);
  free(p);
  char *line = config_ini_line(&c);
  NMT_ASSERT(line && sscanf(line, "bucket_mb = %lf", mb) == 1);
  free(line);
}

/* The run's own measurement decides, end to end (the probe, the communicator, the model), on
 * communicators of known costs. CPU workers' calls block compute, so:
 * - 20 ms on every call: the fewest calls win, the one-bucket plan (16 MiB; 1 MiB would make
 *   16 calls, 320 ms);
 * - 50 ms on every call above 2 MiB, none below: the fewest calls of at most 2 MiB win (1 or
 *   2 MiB, whichever the unshaped part of the measurement favours), not the one bucket. */
NMT_TEST(bucket_auto_follows_injected_costs) {
  double mb = 0;
  auto_under_delay("20000", &mb);
  NMT_ASSERT(mb == 16);
  auto_under_delay("50000@2097152", &mb);
  NMT_ASSERT(mb == 1 || mb == 2);
}

/* ZeRO stage 1 lays each rank's shard of the Adam moments out by the plan (each bucket's
 * slice). A resume under auto loads the checkpoint's moments while the plan is still the
 * provisional one (1 MiB), then re-cuts it to the checkpoint's size (4 MiB): the moments must
 * follow, or AdamW applies them to other parameters. On a model of ~15 MiB (several buckets
 * either way), 2 steps + a resume under auto to step 4 must equal 4 uninterrupted steps at
 * 4 MiB, bitwise. */
NMT_TEST(bucket_auto_resume_zero1_keeps_the_moments) {
  const char *dir = nmt_test_tmpdir();
  nmt_config c;
  NMT_ASSERT_OK(nmt_th_tiny_run(dir, 96, 5, &c));
  c.parallel_devices = 2, c.parallel_zero = 1;
  c.model_d_model = 256, c.model_d_ff = 1024, c.model_n_heads = 4;
  c.parallel_bucket_mb = 4;
  c.train_max_steps = 4;
  float *whole = NULL, *resumed = NULL, *p = NULL;
  size_t nw = 0, nr = 0, n = 0;
  NMT_ASSERT_OK(train_copy(&c, &whole, &nw));
  c.train_max_steps = 2;
  NMT_ASSERT_OK(train_copy(&c, &p, &n));
  free(p);
  c.train_max_steps = 4;
  c.run_resume = 1;
  c.parallel_bucket_mb = NMT_BUCKET_MB_AUTO;
  NMT_ASSERT_OK(train_copy(&c, &resumed, &nr));
  char *line = config_ini_line(&c);
  NMT_ASSERT(line && !strcmp(line, "bucket_mb = 4"));
  free(line);
  NMT_ASSERT(whole && resumed && nw == nr);
  NMT_ASSERT(memcmp(whole, resumed, nw * sizeof(float)) == 0);
  free(whole), free(resumed);
}
