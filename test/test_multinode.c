/* test/test_multinode.c — a run over several processes (parallel.nodes; src/engine/world.c,
 * docs/multinode.md) on this machine: 2 processes x 2 CPU workers through a rendezvous
 * directory and Gloo on loopback, against 1 process x 4 workers; a killed peer; a config that
 * differs between nodes; Slurm's environment (an srun task, the batch script, several tasks per
 * node); a node that never arrives; a stop signal on one node. */
#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nmt/backend.h"
#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/trainer.h"
#include "helpers.h"
#include "test.h"
#include "../src/engine/run.h" /* nmt__world_resolve */

/* A loose per-test budget for each process: liveness, not speed. */
enum { WAIT_S = 180 };

/* The INI of one node (or of the single process): devices workers each, max_steps steps,
 * and the [parallel] block's extra lines. */
static int write_node_ini(const char *path, const char *out_dir, const char *shard, long steps,
                          int devices, float dropout, const char *parallel_extra) {
  char extra[2048];
  snprintf(extra, sizeof extra,
           "[model]\ndropout = %g\nattn_dropout = %g\n"
           "[train]\nadam_eps = 0.001\n"
           "[parallel]\ndevices = %d\n%s", dropout, dropout, devices,
           parallel_extra ? parallel_extra : "");
  return nmt_th_write_ini(path, out_dir, shard, steps, extra);
}

/* The train_loss of every line of a metrics.jsonl (at most cap), their count. */
static int read_losses(const char *path, double *loss, int cap) {
  char *text = nmt_th_read_file(path, NULL);
  if (!text) return -1;
  int n = 0;
  for (char *line = strtok(text, "\n"); line && n < cap; line = strtok(NULL, "\n"))
    loss[n++] = nmt_th_json_num(line, "train_loss");
  free(text);
  return n;
}

/* Starts the two nodes of a run on `ini` (node_rank set on the command line) with the given
 * rendezvous directory, node 1 with one more override when node1_extra is not NULL; logs in
 * dir/node<k>.log. */
static int start_nodes(const char *dir, const char *ini, const char *rdzv, pid_t pid[2],
                       const char *node1_extra) {
  for (int k = 0; k < 2; k++) {
    char log[1024], rank[64], rv[1200];
    snprintf(log, sizeof log, "%s/node%d.log", dir, k);
    snprintf(rank, sizeof rank, "parallel.node_rank=%d", k);
    snprintf(rv, sizeof rv, "parallel.rendezvous=%s", rdzv);
    const char *argv[] = {"train", ini, "parallel.nodes=2", rank, rv, "parallel.iface=lo",
                          k == 1 ? node1_extra : NULL, NULL};
    pid[k] = nmt_th_spawn(argv, log, NULL);
    if (pid[k] < 0) return -1;
  }
  return 0;
}

/* 20 steps of 2 processes x 2 workers equal 1 process x 4 workers to 1e-6 relative (Gloo's
 * ring adds the 4 ranks' gradients in another order than the host communicator), dropout off
 * and on; both nodes end with 0 and only node 0 wrote metrics.jsonl. */
NMT_TEST(multinode_two_processes_match_one) {
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 200, 21));
  const float drops[] = {0.0f, 0.1f};
  for (int di = 0; di < 2; di++) {
    char one_dir[600], one_ini[700], two_dir[600], two_ini[700], rdzv[700], path[800];
    snprintf(one_dir, sizeof one_dir, "%s/one%d", dir, di);
    snprintf(one_ini, sizeof one_ini, "%s/one%d.ini", dir, di);
    snprintf(two_dir, sizeof two_dir, "%s/two%d", dir, di);
    snprintf(two_ini, sizeof two_ini, "%s/two%d.ini", dir, di);
    snprintf(rdzv, sizeof rdzv, "%s/rdzv%d", dir, di);
    NMT_ASSERT(write_node_ini(one_ini, one_dir, shard, 20, 4, drops[di], NULL) == 0);
    NMT_ASSERT(write_node_ini(two_ini, two_dir, shard, 20, 2, drops[di], NULL) == 0);
    char log[800];
    snprintf(log, sizeof log, "%s/one%d.log", dir, di);
    const char *argv[] = {"train", one_ini, NULL};
    NMT_ASSERT_EQ_INT(nmt_th_wait(nmt_th_spawn(argv, log, NULL), WAIT_S, NULL), 0);
    pid_t pid[2];
    NMT_ASSERT(start_nodes(dir, two_ini, rdzv, pid, NULL) == 0);
    int rc0 = nmt_th_wait(pid[0], WAIT_S, NULL), rc1 = nmt_th_wait(pid[1], WAIT_S, NULL);
    if (rc0 || rc1) {
      snprintf(path, sizeof path, "%s/node0.log", dir);
      char *t = nmt_th_read_file(path, NULL);
      printf("# node0 (exit %d): %s\n", rc0, t ? t : "");
      free(t);
    }
    NMT_ASSERT_EQ_INT(rc0, 0);
    NMT_ASSERT_EQ_INT(rc1, 0);
    double a[64], b[64];
    snprintf(path, sizeof path, "%s/metrics.jsonl", one_dir);
    int na = read_losses(path, a, 64);
    snprintf(path, sizeof path, "%s/metrics.jsonl", two_dir);
    int nb = read_losses(path, b, 64);
    NMT_ASSERT_EQ_INT(na, 20);
    NMT_ASSERT_EQ_INT(nb, 20);
    double worst = 0;
    for (int i = 0; i < 20; i++) worst = fmax(worst, fabs(a[i] - b[i]) / fabs(a[i]));
    printf("# dropout %.1f: 2 nodes x 2 workers vs 1 x 4: max relative loss difference %.3g "
           "over 20 steps (metrics.jsonl keeps 6 decimals)\n", drops[di], worst);
    NMT_ASSERT(worst <= 1e-6);
    /* Node 1 wrote its own status file, and no metrics of its own. */
    snprintf(path, sizeof path, "%s/status.node1.json", two_dir);
    NMT_ASSERT(access(path, R_OK) == 0);
    snprintf(path, sizeof path, "%s/metrics.node1.jsonl", two_dir);
    NMT_ASSERT(access(path, R_OK) != 0);
  }
}

/* Nodes that disagree on a key refuse to start, each naming the key and both values. */
NMT_TEST(multinode_config_mismatch_is_refused) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], ini[600], out[600], rdzv[600];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(ini, sizeof ini, "%s/n.ini", dir);
  snprintf(out, sizeof out, "%s/run", dir);
  snprintf(rdzv, sizeof rdzv, "%s/rdzv", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 50, 22));
  NMT_ASSERT(write_node_ini(ini, out, shard, 5, 2, 0.1f, NULL) == 0);
  pid_t pid[2];
  NMT_ASSERT(start_nodes(dir, ini, rdzv, pid, "model.dropout=0.2") == 0);
  for (int k = 0; k < 2; k++) {
    int rc = nmt_th_wait(pid[k], WAIT_S, NULL);
    char path[800];
    snprintf(path, sizeof path, "%s/node%d.log", dir, k);
    char *log = nmt_th_read_file(path, NULL);
    int named = log && strstr(log, "model.dropout") && strstr(log, "0.2") && strstr(log, "0.1");
    if (rc != 2 || !named) printf("# node %d exit %d: %s\n", k, rc, log ? log : "");
    free(log);
    NMT_ASSERT_EQ_INT(rc, 2);
    NMT_ASSERT(named);
  }
}

/* A node killed mid-run ends the other within parallel.timeout_s with exit 8 and an error
 * naming the lost peer; every checkpoint file left is whole. */
NMT_TEST(multinode_killed_peer_ends_the_run) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], ini[600], out[600], rdzv[600], path[800];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(ini, sizeof ini, "%s/n.ini", dir);
  snprintf(out, sizeof out, "%s/run", dir);
  snprintf(rdzv, sizeof rdzv, "%s/rdzv", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 200, 23));
  /* save_every 5: checkpoints are being written when the peer dies. */
  NMT_ASSERT(write_node_ini(ini, out, shard, 100000, 2, 0.1f,
                            "timeout_s = 20\n[train]\nsave_every = 5\n") == 0);
  pid_t pid[2];
  NMT_ASSERT(start_nodes(dir, ini, rdzv, pid, NULL) == 0);
  snprintf(path, sizeof path, "%s/metrics.jsonl", out);
  int started = nmt_th_wait_for(path, "\"step\": 12", pid[0], WAIT_S);
  kill(pid[1], SIGKILL);
  nmt_th_wait(pid[1], 30, NULL);
  double dt = 0;
  int rc = nmt_th_wait(pid[0], 60, &dt);
  snprintf(path, sizeof path, "%s/node0.log", dir);
  char *log = nmt_th_read_file(path, NULL);
  printf("# node 1 killed: node 0 exited %d after %.2f s\n", rc, dt);
  if (rc != 8) printf("# %s\n", log ? log : "");
  NMT_ASSERT(started);
  NMT_ASSERT_EQ_INT(rc, 8);
  /* The communicator's error, naming the collective and the rank (the startup line "ranks
   * 0..1 of 4" would satisfy a bare "rank"). */
  const int named = log && strstr(log, "gloo ") && strstr(log, " on rank ") &&
                    strstr(log, "a peer process died");
  free(log);
  NMT_ASSERT(named);
  NMT_ASSERT(dt < 20 + 10); /* parallel.timeout_s = 20, plus the exit's own time */
  /* Every checkpoint file left reads whole (CRC verified), not only the latest one. */
  char ck_dir[800], ck[1100];
  snprintf(ck_dir, sizeof ck_dir, "%s/checkpoints", out);
  NMT_ASSERT_OK(nmt_ckpt_find_latest(ck_dir, ck));
  int n_ck = 0;
  for (int s = 5; s <= 100; s += 5) {
    snprintf(ck, sizeof ck, "%s/step_%d.ckpt", ck_dir, s);
    if (access(ck, F_OK) != 0) continue;
    nmt_ckpt_header h;
    if (nmt_ckpt_read(ck, NULL, &h, NULL, NULL, NULL) != NMT_OK)
      nmt_test_fail(__FILE__, __LINE__, "%s: %s", ck, nmt_last_error());
    n_ck++;
  }
  NMT_ASSERT(n_ck >= 1);
}

/* Under Slurm the keys left at auto come from an srun task's environment: the step's nodes,
 * $SLURM_PROCID, and a rendezvous directory under the run directory named by the job and its
 * restart. Node 0 removes the directories of the job's earlier restarts at start, and its own
 * when the run ends well: a requeued job used to leave one per restart. Another job's stays. */
NMT_TEST(multinode_slurm_environment) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], ini[600], out[600], log[700], path[900];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(ini, sizeof ini, "%s/n.ini", dir);
  snprintf(out, sizeof out, "%s/run", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 60, 24));
  NMT_ASSERT(write_node_ini(ini, out, shard, 4, 2, 0.1f, "iface = lo\n") == 0);
  static const char *const left[] = {"job-4242-0", "job-4242-1", "job-999-0"};
  for (int i = 0; i < 3; i++) {
    snprintf(path, sizeof path, "%s/rendezvous/%s", out, left[i]);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s' && echo x > '%s/stale'", path, path);
    NMT_ASSERT(system(cmd) == 0);
  }
  pid_t pid[2];
  for (int k = 0; k < 2; k++) {
    char env[512];
    snprintf(env, sizeof env, "SLURM_JOB_ID=4242 SLURM_RESTART_COUNT=2 SLURM_STEP_ID=0 "
             "SLURM_STEP_NUM_NODES=2 SLURM_STEP_NUM_TASKS=2 SLURM_NNODES=2 SLURM_NTASKS=2 "
             "SLURM_NODEID=%d SLURM_PROCID=%d", k, k);
    snprintf(log, sizeof log, "%s/node%d.log", dir, k);
    const char *argv[] = {"train", ini, NULL};
    pid[k] = nmt_th_spawn(argv, log, env);
    NMT_ASSERT(pid[k] > 0);
  }
  NMT_ASSERT_EQ_INT(nmt_th_wait(pid[0], WAIT_S, NULL), 0);
  NMT_ASSERT_EQ_INT(nmt_th_wait(pid[1], WAIT_S, NULL), 0);
  snprintf(log, sizeof log, "%s/node1.log", dir);
  char *t = nmt_th_read_file(log, NULL);
  const int met = t && strstr(t, "node 1 of 2: ranks 2..3 of 4") &&
                  strstr(t, "rendezvous/job-4242-2");
  free(t);
  NMT_ASSERT(met);
  const int want[] = {0, 0, 1}; /* job 4242's earlier restarts go, job 999's stays */
  int wrong = 0;
  for (int i = 0; i < 3; i++) {
    snprintf(path, sizeof path, "%s/rendezvous/%s", out, left[i]);
    const int there = access(path, F_OK) == 0;
    printf("# %s: %s\n", left[i], there ? "kept" : "removed");
    wrong += there != want[i];
  }
  snprintf(path, sizeof path, "%s/rendezvous/job-4242-2", out);
  const int own = access(path, F_OK) == 0;
  printf("# job-4242-2 (this run's): %s\n", own ? "kept" : "removed");
  NMT_ASSERT_EQ_INT(wrong, 0);
  NMT_ASSERT(!own);
}

/* SIGTERM to node 1 alone: both nodes stop after the same step (the stop flag rides in the
 * reduced gradient slots), exit 75, and global rank 0 wrote that step's checkpoint, once. */
NMT_TEST(multinode_stop_signal_on_one_node) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], ini[600], out[600], rdzv[600], path[800];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(ini, sizeof ini, "%s/n.ini", dir);
  snprintf(out, sizeof out, "%s/run", dir);
  snprintf(rdzv, sizeof rdzv, "%s/rdzv", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 200, 25));
  NMT_ASSERT(write_node_ini(ini, out, shard, 100000, 2, 0.1f, NULL) == 0);
  pid_t pid[2];
  NMT_ASSERT(start_nodes(dir, ini, rdzv, pid, NULL) == 0);
  snprintf(path, sizeof path, "%s/metrics.jsonl", out);
  NMT_ASSERT(nmt_th_wait_for(path, "\"step\": 6", pid[0], WAIT_S));
  kill(pid[1], SIGTERM);
  int rc0 = nmt_th_wait(pid[0], WAIT_S, NULL), rc1 = nmt_th_wait(pid[1], WAIT_S, NULL);
  NMT_ASSERT_EQ_INT(rc0, 75);
  NMT_ASSERT_EQ_INT(rc1, 75);
  char s0[4096] = "", s1[4096] = "";
  snprintf(path, sizeof path, "%s/status.json", out);
  char *a = nmt_th_read_file(path, NULL);
  snprintf(path, sizeof path, "%s/status.node1.json", out);
  char *b = nmt_th_read_file(path, NULL);
  NMT_ASSERT(a && b);
  snprintf(s0, sizeof s0, "%s", a);
  snprintf(s1, sizeof s1, "%s", b);
  free(a), free(b);
  double step0 = nmt_th_json_num(s0, "step"), step1 = nmt_th_json_num(s1, "step");
  printf("# SIGTERM to node 1: both stopped at step %.0f / %.0f\n", step0, step1);
  NMT_ASSERT(step0 == step1 && step0 >= 6);
  char ck[1100];
  snprintf(ck, sizeof ck, "%s/checkpoints/step_%.0f.ckpt", out, step0);
  NMT_ASSERT(access(ck, R_OK) == 0);
}

/* Trains cfg (2 workers, 12 steps unless set) through the API; the last step's loss. */
static nmt_status train_loss(const nmt_config *cfg, double *loss, float **params, size_t *np) {
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  nmt_trainer *t;
  NMT_TRY(nmt_trainer_create(cfg, &o, &t));
  nmt_status s = nmt_trainer_run(t);
  if (s == NMT_OK) {
    *loss = nmt_trainer_last_metrics(t)->train_loss;
    const float *p = nmt_trainer_params(t, np);
    *params = malloc(*np * sizeof(float));
    if (*params) memcpy(*params, p, *np * sizeof(float));
  }
  nmt_trainer_destroy(t);
  return s;
}

/* The degenerate case of the multi-node path: nodes = 1 with a rendezvous directory takes it
 * alone (the config check, the communicator through the store). On CPU workers that is a Gloo
 * group of 2, whose sums of 2 terms are the host communicator's: bitwise the same run. */
NMT_TEST(multinode_single_node_through_rendezvous) {
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 80, 26));
  nmt_config a, b;
  char out[600];
  snprintf(out, sizeof out, "%s/host", dir);
  nmt_th_tiny_config(&a, out, shard);
  a.model_vocab = NMT_TH_VOCAB;
  a.parallel_devices = 2;
  a.train_max_steps = 12;
  a.model_dropout = a.model_attn_dropout = 0.1f;
  b = a;
  snprintf(b.run_out_dir, sizeof b.run_out_dir, "%s/rdzv-run", dir);
  snprintf(b.parallel_rendezvous, sizeof b.parallel_rendezvous, "%s/rdzv", dir);
  snprintf(b.parallel_iface, sizeof b.parallel_iface, "lo");
  double la, lb;
  float *pa = NULL, *pb = NULL;
  size_t na = 0, nb = 0;
  NMT_ASSERT_OK(train_loss(&a, &la, &pa, &na));
  NMT_ASSERT_OK(train_loss(&b, &lb, &pb, &nb));
  int same = na == nb && !memcmp(pa, pb, na * sizeof(float));
  printf("# host vs Gloo through the rendezvous: loss %.9f vs %.9f, parameters %s\n", la, lb,
         same ? "bitwise equal" : "DIFFER");
  free(pa), free(pb);
  NMT_ASSERT(same);
  /* ... and the run did go through the store: the rendezvous directory holds its keys. */
  char rdzv[600];
  snprintf(rdzv, sizeof rdzv, "%s/rdzv", dir);
  DIR *d = opendir(rdzv);
  int keys = 0;
  for (struct dirent *e; d && (e = readdir(d));) keys += e->d_name[0] != '.';
  if (d) closedir(d);
  printf("# %d entries in the rendezvous directory\n", keys);
  NMT_ASSERT(keys > 0);
}

/* The same on one GPU: NCCL's rank created by ncclCommInitRank with the ncclUniqueId read back
 * from the store (the multi-node NCCL init, world 1), training a few steps like the plain path. */
NMT_TEST(cuda_multinode_single_gpu_through_rendezvous) {
  const nmt_backend *cuda = nmt_backend_cuda_get();
  int n = 0;
  if (cuda) NMT_ASSERT_OK(cuda->device_count(&n));
  if (n < 1) NMT_SKIP("no CUDA device");
  const char *dir = nmt_test_tmpdir();
  char shard[512];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 80, 27));
  nmt_config a, b;
  char out[600];
  snprintf(out, sizeof out, "%s/plain", dir);
  nmt_th_tiny_config(&a, out, shard);
  a.model_vocab = NMT_TH_VOCAB;
  a.parallel_device = NMT_DEVICE_CUDA;
  a.parallel_devices = 1;
  a.train_max_steps = 6;
  b = a;
  snprintf(b.run_out_dir, sizeof b.run_out_dir, "%s/rdzv-run", dir);
  snprintf(b.parallel_rendezvous, sizeof b.parallel_rendezvous, "%s/rdzv", dir);
  double la, lb;
  float *pa = NULL, *pb = NULL;
  size_t na = 0, nb = 0;
  NMT_ASSERT_OK(train_loss(&a, &la, &pa, &na));
  NMT_ASSERT_OK(train_loss(&b, &lb, &pb, &nb));
  printf("# one GPU, plain vs through the rendezvous (NCCL world 1): loss %.9f vs %.9f\n", la,
         lb);
  /* One rank reduces nothing on either path: the same kernels, so the same numbers. */
  int same = na == nb && !memcmp(pa, pb, na * sizeof(float));
  free(pa), free(pb);
  NMT_ASSERT(same);
}

/* ---- Slurm's launch (issue 24) ------------------------------------------------------------ */

extern char **environ;

/* nmt__world_resolve(cfg) with every SLURM_* variable of this process replaced by `env` ("K=V"
 * separated by spaces), then the environment as it was. */
static nmt_status resolve_under(const char *env, const nmt_config *cfg, nmt__world *w) {
  char *saved[128];
  int n = 0;
  for (char **e = environ; *e && n < 128; e++)
    if (!strncmp(*e, "SLURM_", 6)) saved[n++] = strdup(*e);
  for (int i = 0; i < n; i++) {
    char name[256];
    snprintf(name, sizeof name, "%.*s", (int)strcspn(saved[i], "="), saved[i]);
    unsetenv(name);
  }
  char *copy = strdup(env), *save = NULL;
  for (char *kv = strtok_r(copy, " ", &save); kv; kv = strtok_r(NULL, " ", &save)) {
    char *eq = strchr(kv, '=');
    *eq = 0;
    setenv(kv, eq + 1, 1);
    *eq = '=';
  }
  nmt_status s = nmt__world_resolve(cfg, w);
  save = NULL;
  snprintf(copy, strlen(env) + 1, "%s", env);
  for (char *kv = strtok_r(copy, " ", &save); kv; kv = strtok_r(NULL, " ", &save)) {
    kv[strcspn(kv, "=")] = 0;
    unsetenv(kv);
  }
  free(copy);
  for (int i = 0; i < n; i++) {
    char *eq = strchr(saved[i], '=');
    *eq = 0;
    setenv(saved[i], eq + 1, 1);
    free(saved[i]);
  }
  return s;
}

/* The environments Slurm 22.05 gives (test/slurm/ shows them: `srun env`, the batch script's
 * env): an srun task has SLURM_STEP_ID and the step's counts; the batch script and an salloc
 * shell have no SLURM_STEP_* and the whole job's SLURM_NNODES. nodes and node_rank at auto
 * take an srun task's place, and refuse a launch that would run the wrong number of processes:
 * the batch script of a job of several nodes (nobody else would join: it waited
 * parallel.timeout_s and exited 8), several tasks on a node (each ran alone and all wrote one
 * run directory). Either key set by hand is the user's word. */
NMT_TEST(multinode_slurm_launch_is_checked) {
  const char *dir = nmt_test_tmpdir();
  nmt_config c;
  char out[600], shard[600];
  snprintf(out, sizeof out, "%s/run", dir);
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  nmt_th_tiny_config(&c, out, shard);
  static const char step2[] = "SLURM_JOB_ID=77 SLURM_JOB_NUM_NODES=2 SLURM_STEP_ID=0 "
                              "SLURM_STEP_NUM_NODES=2 SLURM_STEP_NUM_TASKS=2 SLURM_NNODES=2 "
                              "SLURM_NTASKS=2 SLURM_NODEID=1 SLURM_PROCID=1 SLURM_LOCALID=0";
  static const struct {
    const char *what, *env;
    int nodes, node_rank; /* the keys set by hand (0 / -1: auto) */
    nmt_status want;
    int want_nodes, want_rank;   /* when accepted */
    const char *named1, *named2; /* in the error, when refused */
  } cases[] = {
      {"no Slurm", "", 0, -1, NMT_OK, 1, 0, NULL, NULL},
      {"srun -N2 -n2, task 1", step2, 0, -1, NMT_OK, 2, 1, NULL, NULL},
      {"srun -N1 -n1 in a 2-node job",
       "SLURM_JOB_ID=77 SLURM_JOB_NUM_NODES=2 SLURM_STEP_ID=3 SLURM_STEP_NUM_NODES=1 "
       "SLURM_STEP_NUM_TASKS=1 SLURM_NNODES=1 SLURM_NTASKS=1 SLURM_NODEID=0 SLURM_PROCID=0",
       0, -1, NMT_OK, 1, 0, NULL, NULL},
      {"batch script of a 1-node job", "SLURM_JOB_ID=77 SLURM_JOB_NUM_NODES=1 SLURM_NNODES=1 "
       "SLURM_NODEID=0 SLURM_PROCID=0", 0, -1, NMT_OK, 1, 0, NULL, NULL},
      {"batch script of sbatch -N2", "SLURM_JOB_ID=77 SLURM_JOB_NUM_NODES=2 SLURM_NNODES=2 "
       "SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0", 0, -1, NMT_ERR_CONFIG, 0, 0, "srun",
       "SLURM_NNODES"},
      {"batch script of sbatch -N2 --ntasks-per-node=1", "SLURM_JOB_ID=77 "
       "SLURM_JOB_NUM_NODES=2 SLURM_NNODES=2 SLURM_NTASKS=2 SLURM_NTASKS_PER_NODE=1 "
       "SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0", 0, -1, NMT_ERR_CONFIG, 0, 0, "srun",
       "SLURM_NNODES"},
      {"salloc -N2 shell", "SLURM_JOB_ID=77 SLURM_JOB_NUM_NODES=2 SLURM_NNODES=2", 0, -1,
       NMT_ERR_CONFIG, 0, 0, "srun", "SLURM_NNODES"},
      {"srun -N1 -n2, task 1", "SLURM_JOB_ID=77 SLURM_JOB_NUM_NODES=1 SLURM_STEP_ID=0 "
       "SLURM_STEP_NUM_NODES=1 SLURM_STEP_NUM_TASKS=2 SLURM_NNODES=1 SLURM_NTASKS=2 "
       "SLURM_NODEID=0 SLURM_PROCID=1 SLURM_LOCALID=1", 0, -1, NMT_ERR_CONFIG, 0, 0,
       "SLURM_STEP_NUM_TASKS", "--ntasks-per-node=1"},
      {"srun -N2 -n4, task 2", "SLURM_JOB_ID=77 SLURM_JOB_NUM_NODES=2 SLURM_STEP_ID=1 "
       "SLURM_STEP_NUM_NODES=2 SLURM_STEP_NUM_TASKS=4 SLURM_NNODES=2 SLURM_NTASKS=4 "
       "SLURM_NODEID=1 SLURM_PROCID=2 SLURM_LOCALID=0", 0, -1, NMT_ERR_CONFIG, 0, 0,
       "SLURM_STEP_NUM_TASKS", "parallel.devices"},
      {"srun -N1 -n2 with nodes = 1 and node_rank = 0 by hand", "SLURM_JOB_ID=77 "
       "SLURM_STEP_ID=0 SLURM_STEP_NUM_NODES=1 SLURM_STEP_NUM_TASKS=2 SLURM_NNODES=1 "
       "SLURM_NTASKS=2 SLURM_NODEID=0 SLURM_PROCID=1", 1, 0, NMT_OK, 1, 0, NULL, NULL},
      {"batch script of sbatch -N2 with nodes = 1 by hand", "SLURM_JOB_ID=77 SLURM_NNODES=2 "
       "SLURM_NODEID=0 SLURM_PROCID=0", 1, -1, NMT_OK, 1, 0, NULL, NULL},
  };
  int wrong = 0;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    c.parallel_nodes = cases[i].nodes;
    c.parallel_node_rank = cases[i].node_rank;
    nmt__world w;
    nmt_clear_error();
    nmt_status s = resolve_under(cases[i].env, &c, &w);
    const char *e = nmt_last_error();
    int ok = s == cases[i].want;
    if (ok && s == NMT_OK) ok = w.nodes == cases[i].want_nodes && w.node_rank == cases[i].want_rank;
    if (ok && s != NMT_OK) ok = strstr(e, cases[i].named1) && strstr(e, cases[i].named2);
    printf("# %s: %s, nodes %d, node_rank %d%s%s\n", cases[i].what, nmt_status_str(s),
           s == NMT_OK ? w.nodes : 0, s == NMT_OK ? w.node_rank : 0, *e ? ": " : "", e);
    if (!ok) {
      printf("# ^ wrong: want %s", nmt_status_str(cases[i].want));
      if (cases[i].want == NMT_OK)
        printf(", nodes %d, node_rank %d\n", cases[i].want_nodes, cases[i].want_rank);
      else
        printf(" naming %s and %s\n", cases[i].named1, cases[i].named2);
      wrong++;
    }
  }
  NMT_ASSERT_EQ_INT(wrong, 0);
  /* The task's rendezvous: under the run directory, named by the job and its restart. */
  nmt__world w;
  c.parallel_nodes = 0, c.parallel_node_rank = -1;
  NMT_ASSERT_OK(resolve_under(step2, &c, &w));
  char want[700];
  snprintf(want, sizeof want, "%s/rendezvous/job-77-0", out);
  NMT_ASSERT(!strcmp(w.rendezvous, want));
}

/* The batch script of a 2-node job running nmt without srun: refused at once with exit 2 and
 * a line saying to start it with srun. It used to wait parallel.timeout_s for node 1, then
 * exit 8 saying only that a key was not set. */
NMT_TEST(multinode_batch_script_without_srun_is_refused) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], ini[600], out[600], log[700];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(ini, sizeof ini, "%s/n.ini", dir);
  snprintf(out, sizeof out, "%s/run", dir);
  snprintf(log, sizeof log, "%s/batch.log", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 60, 28));
  NMT_ASSERT(write_node_ini(ini, out, shard, 4, 1, 0.1f, "iface = lo\ntimeout_s = 3\n") == 0);
  const char *argv[] = {"train", ini, NULL};
  pid_t pid = nmt_th_spawn(argv, log, "SLURM_JOB_ID=78 SLURM_JOB_NUM_NODES=2 SLURM_NNODES=2 "
                           "SLURM_NTASKS=2 SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0");
  NMT_ASSERT(pid > 0);
  int rc = nmt_th_wait(pid, WAIT_S, NULL);
  char *t = nmt_th_read_file(log, NULL);
  printf("# exit %d: %s", rc, t ? t : "(no log)\n");
  const int named = t && strstr(t, "srun --ntasks-per-node=1");
  free(t);
  NMT_ASSERT_EQ_INT(rc, 2);
  NMT_ASSERT(named);
}
/* A node that never arrives is named on stderr, not only in status.json: the rendezvous' own
 * line ("key 'config/node1' not set within ...") was printed first, and the fuller line that
 * wraps it was dropped as a repeat. */
NMT_TEST(multinode_missing_node_is_named) {
  const char *dir = nmt_test_tmpdir();
  char shard[512], ini[600], out[600], rdzv[600], log[700];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(ini, sizeof ini, "%s/n.ini", dir);
  snprintf(out, sizeof out, "%s/run", dir);
  snprintf(rdzv, sizeof rdzv, "parallel.rendezvous=%s/rdzv", dir);
  snprintf(log, sizeof log, "%s/node0.log", dir);
  NMT_ASSERT_OK(nmt_th_write_synthetic(shard, 60, 29));
  NMT_ASSERT(write_node_ini(ini, out, shard, 4, 2, 0.1f, "iface = lo\ntimeout_s = 1\n") == 0);
  const char *argv[] = {"train", ini, "parallel.nodes=2", "parallel.node_rank=0", rdzv, NULL};
  int rc = nmt_th_wait(nmt_th_spawn(argv, log, NULL), WAIT_S, NULL);
  char *t = nmt_th_read_file(log, NULL);
  printf("# exit %d: %s", rc, t ? t : "(no log)\n");
  const int named = t && strstr(t, "[nmt] error: node 1 (ranks 2..3) did not reach the "
                                   "rendezvous");
  free(t);
  NMT_ASSERT_EQ_INT(rc, 8);
  NMT_ASSERT(named);
}
