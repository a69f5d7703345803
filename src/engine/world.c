/* world.c — a run over several processes, one per node (parallel.nodes; docs/multinode.md):
 * who this process is, where the nodes meet, and the check that they all run the same thing.
 *
 * Ranks: global rank = node_rank x devices + local index; world = nodes x devices. Under
 * Slurm the keys left at auto take an srun task's place: $SLURM_STEP_NUM_NODES nodes and
 * $SLURM_PROCID, one task per node; the rendezvous directory lives under the run directory,
 * named by the job and its restart count, so `srun nmt train CONFIG` on N nodes needs nothing
 * else. A launch that would run the wrong processes is refused at once (exit 2): nmt started
 * by the batch script (or an salloc shell) of a job of several nodes, where no other node
 * would ever join, and several tasks on one node, which would each train alone.
 *
 * At create every process publishes its effective config (without parallel.node_rank) and the
 * step it resumes from under its own key of the rendezvous store, and reads every other's:
 * the first differing line is an error on every node naming the key, both values and both
 * nodes (exit 2); a node that never arrives is an error naming it after parallel.timeout_s
 * (exit 8). Only then are the communicators created (through the device layer).
 *
 * The rendezvous directory that Slurm's job names (parallel.rendezvous at auto) belongs to
 * node 0, which removes it: those of the job's earlier restarts when it starts (Slurm starts a
 * requeued job only once every process of the previous one has ended), its own when a run
 * that trained ends without an error (every node is past the last collective, so none reads
 * the store again). A failed run's directory stays for inspection until the job restarts.
 */
#include <dirent.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nmt/log.h"
#include "nmt/rendezvous.h"
#include "run.h"

/* A positive integer from the environment, or -1. */
static long env_long(const char *name) {
  const char *e = getenv(name);
  if (!e || !*e) return -1;
  char *end;
  long v = strtol(e, &end, 10);
  return *end || v < 0 ? -1 : v;
}

/* Slurm's environment as nmt reads it. What Slurm 22.05 sets (test/slurm/ prints it): an srun
 * task has SLURM_STEP_ID, the step's SLURM_STEP_NUM_NODES and SLURM_STEP_NUM_TASKS, its
 * SLURM_PROCID and SLURM_NODEID, and SLURM_NNODES / SLURM_NTASKS set to the step's counts; the
 * batch script (sbatch) has no SLURM_STEP_* and the whole job's SLURM_NNODES, with
 * SLURM_NODEID = SLURM_PROCID = 0 (SLURM_NTASKS only when -n or --ntasks-per-node was given);
 * an salloc shell has SLURM_NNODES and no SLURM_STEP_*, SLURM_NODEID or SLURM_PROCID. */
typedef struct {
  int in_step;         /* an srun task */
  long nodes, tasks;   /* the step's (in a step), else the job's; -1 when not set */
  long procid, nodeid; /* -1 when not set */
} slurm_env;

static slurm_env read_slurm(void) {
  slurm_env e;
  const char *step = getenv("SLURM_STEP_ID");
  e.in_step = step && *step;
  e.nodes = env_long("SLURM_STEP_NUM_NODES");
  if (!e.in_step || e.nodes < 0) e.nodes = env_long("SLURM_NNODES");
  e.tasks = env_long("SLURM_STEP_NUM_TASKS");
  if (!e.in_step || e.tasks < 0) e.tasks = env_long("SLURM_NTASKS");
  e.procid = env_long("SLURM_PROCID");
  e.nodeid = env_long("SLURM_NODEID");
  return e;
}

/* NMT_OK when Slurm launched this process as nmt can run it with parallel.nodes or
 * parallel.node_rank at auto (one srun task per node, or a job of one node); else
 * NMT_ERR_CONFIG naming the variables and the launch that works. */
static nmt_status check_slurm_launch(const slurm_env *e, int auto_nodes) {
  if (e->in_step && e->tasks > 1 && e->nodes >= 1 && e->tasks > e->nodes)
    return nmt_errorf(NMT_ERR_CONFIG, "srun started %ld tasks on %ld node(s) "
                      "(SLURM_STEP_NUM_TASKS = %ld, SLURM_STEP_NUM_NODES = %ld): nmt runs one "
                      "process per node with one worker per device inside it, and tasks sharing "
                      "a node would train as copies of one node. Start one task per node (srun "
                      "--ntasks-per-node=1; in a job script #SBATCH --ntasks-per-node=1) and "
                      "set parallel.devices to the node's devices", e->tasks, e->nodes,
                      e->tasks, e->nodes);
  if (!e->in_step && auto_nodes && e->nodes > 1)
    return nmt_errorf(NMT_ERR_CONFIG, "this is not an srun task but the batch script (or salloc "
                      "shell) of a %ld-node Slurm job (SLURM_NNODES = %ld, no SLURM_STEP_ID): "
                      "with [parallel] nodes = auto no other node would join. Start nmt with "
                      "`srun --ntasks-per-node=1 nmt train ...` (one process per node), or set "
                      "parallel.nodes = 1 to train on this node alone", e->nodes, e->nodes);
  return NMT_OK;
}

nmt_status nmt__world_resolve(const nmt_config *cfg, nmt__world *w) {
  memset(w, 0, sizeof *w);
  const int auto_nodes = cfg->parallel_nodes <= 0, auto_rank = cfg->parallel_node_rank < 0;
  const slurm_env se = read_slurm();
  /* Both keys given: the user's word (e.g. tasks launched by hand), Slurm is not asked. */
  if (auto_nodes || auto_rank) NMT_TRY(check_slurm_launch(&se, auto_nodes));
  /* An srun task per node: the task ids are the node ids. */
  const int slurm_tasks = se.in_step && se.tasks > 1 && se.tasks == se.nodes && se.procid >= 0;
  w->nodes = !auto_nodes ? cfg->parallel_nodes : se.nodes > 0 ? (int)se.nodes : 1;
  w->node_rank = !auto_rank                       ? cfg->parallel_node_rank
                 : slurm_tasks                    ? (int)se.procid
                 : se.nodeid >= 0 && w->nodes > 1 ? (int)se.nodeid
                                                  : 0;
  if (w->node_rank >= w->nodes)
    return nmt_errorf(NMT_ERR_CONFIG, "[parallel] node_rank = %d is not below nodes = %d%s",
                      w->node_rank, w->nodes,
                      cfg->parallel_node_rank < 0 ? " (taken from Slurm's environment)" : "");
  w->local = cfg->parallel_devices;
  w->world = w->nodes * w->local;
  w->first_rank = w->node_rank * w->local;
  w->timeout_s = cfg->parallel_timeout_s;
  if (cfg->parallel_rendezvous[0]) {
    snprintf(w->rendezvous, sizeof w->rendezvous, "%s", cfg->parallel_rendezvous);
  } else if (w->nodes > 1) {
    const char *job = getenv("SLURM_JOB_ID");
    if (!job || !*job)
      return nmt_errorf(NMT_ERR_CONFIG, "[parallel] nodes = %d needs [parallel] rendezvous: a "
                        "fresh directory every node can read and write (or run under Slurm, "
                        "where it defaults to run.out_dir/rendezvous/job-<id>)", w->nodes);
    long restart = env_long("SLURM_RESTART_COUNT");
    if (snprintf(w->rendezvous, sizeof w->rendezvous, "%s/rendezvous/job-%s-%ld",
                 cfg->run_out_dir, job, restart < 0 ? 0 : restart) >= (int)sizeof w->rendezvous)
      return nmt_errorf(NMT_ERR_CONFIG, "[run] out_dir is too long for the rendezvous path");
  }
  w->multi = w->rendezvous[0] != 0; /* nodes = 1 with a rendezvous: the same path, alone */
  return NMT_OK;
}

/* The effective config as every node must have it: the dump without parallel.node_rank (the
 * one key that differs by design), plus the resume step. Caller frees. */
static char *agreement_text(const nmt_config *cfg, long start_step, size_t *len) {
  char *buf = NULL;
  size_t n = 0;
  FILE *f = open_memstream(&buf, &n);
  if (!f) return NULL;
  nmt_config c = *cfg;
  c.parallel_node_rank = -1;
  nmt_config_dump(&c, f);
  fprintf(f, "[resume]\nstart_step = %ld\n", start_step);
  if (fclose(f) != 0) {
    free(buf);
    return NULL;
  }
  *len = n;
  return buf;
}

/* The first line where a and b differ, as "section.key = value" for each side. */
static void first_difference(const char *a, const char *b, char *key, size_t kcap, char *va,
                             char *vb, size_t vcap) {
  char section[128] = "";
  while (*a || *b) {
    size_t la = strcspn(a, "\n"), lb = strcspn(b, "\n");
    if (*a == '[') snprintf(section, sizeof section, "%.*s", (int)(la - 2 > 120 ? 120 : la - 2), a + 1);
    if (la != lb || memcmp(a, b, la)) {
      size_t kl = strcspn(a, " =");
      snprintf(key, kcap, "%s.%.*s", section, (int)(kl > 100 ? 100 : kl), a);
      const char *ea = memchr(a, '=', la), *eb = memchr(b, '=', lb);
      snprintf(va, vcap, "%.*s", ea ? (int)(la - (size_t)(ea + 2 - a)) : (int)la, ea ? ea + 2 : a);
      snprintf(vb, vcap, "%.*s", eb ? (int)(lb - (size_t)(eb + 2 - b)) : (int)lb, eb ? eb + 2 : b);
      return;
    }
    a += la + (a[la] == '\n');
    b += lb + (b[lb] == '\n');
  }
  snprintf(key, kcap, "?");
  va[0] = vb[0] = 0;
}

/* 1 when the rendezvous directory is the one nmt names after the Slurm job (not the user's). */
static int derived_rendezvous(const nmt_config *cfg, const nmt__world *w) {
  return w->multi && !cfg->parallel_rendezvous[0];
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb, (void)flag, (void)ftw;
  remove(path); /* best effort: what cannot go stays, and is only clutter */
  return 0;
}

/* Removes directory `path` and everything under it, best effort. */
static void remove_tree(const char *path) { nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* Node 0, at start: the rendezvous directories of this job's earlier restarts
 * (run.out_dir/rendezvous/job-<id>-<r>, r below this restart's count). */
static void remove_earlier_restarts(const nmt_config *cfg) {
  const char *job = getenv("SLURM_JOB_ID");
  const long restart = env_long("SLURM_RESTART_COUNT");
  if (!job || !*job || restart <= 0) return;
  char parent[NMT_PATH_MAX + 16], stem[256], path[2 * NMT_PATH_MAX];
  snprintf(parent, sizeof parent, "%s/rendezvous", cfg->run_out_dir);
  snprintf(stem, sizeof stem, "job-%s-", job);
  DIR *d = opendir(parent);
  if (!d) return;
  int removed = 0;
  for (struct dirent *e; (e = readdir(d));) {
    if (strncmp(e->d_name, stem, strlen(stem))) continue;
    char *end;
    const char *r = e->d_name + strlen(stem);
    long k = strtol(r, &end, 10);
    if (end == r || *end || k < 0 || k >= restart) continue;
    snprintf(path, sizeof path, "%s/%s", parent, e->d_name);
    remove_tree(path);
    removed++;
  }
  closedir(d);
  if (removed)
    nmt_log(NMT_LOG_INFO, "removed %d rendezvous director%s of job %s's earlier restarts in %s",
            removed, removed == 1 ? "y" : "ies", job, parent);
}

nmt_status nmt__world_agree(nmt_trainer *t, const char *prefix) {
  const nmt__world *w = &t->world;
  nmt_rendezvous *rv = NULL;
  if (w->node_rank == 0 && derived_rendezvous(&t->cfg, w)) remove_earlier_restarts(&t->cfg);
  NMT_TRY(nmt_rendezvous_open(w->rendezvous, prefix, w->timeout_s, &rv));
  nmt_rendezvous_watch(rv, &t->sync.abort);
  size_t len = 0;
  char *mine = agreement_text(&t->cfg, t->pos.start_step, &len), *theirs = NULL;
  nmt_status s = mine ? NMT_OK : nmt_errorf(NMT_ERR_NOMEM, "rendezvous: config text");
  char key[64];
  if (s == NMT_OK) {
    snprintf(key, sizeof key, "config/node%d", w->node_rank);
    s = nmt_rendezvous_set(rv, key, mine, len);
  }
  theirs = s == NMT_OK ? malloc(len + 65536) : NULL;
  if (s == NMT_OK && !theirs) s = nmt_errorf(NMT_ERR_NOMEM, "rendezvous: config text");
  for (int node = 0; node < w->nodes && s == NMT_OK; node++) {
    if (node == w->node_rank) continue;
    size_t got = 0;
    snprintf(key, sizeof key, "config/node%d", node);
    s = nmt_rendezvous_get(rv, key, theirs, len + 65535, &got);
    if (s == NMT_ERR_ABORTED) {
      s = nmt_errorf(NMT_ERR_ABORTED, "node %d (ranks %d..%d) did not reach the rendezvous in %s "
                     "within parallel.timeout_s = %g s: %s", node, node * w->local,
                     node * w->local + w->local - 1, w->rendezvous, w->timeout_s,
                     nmt_last_error());
      break;
    }
    if (s != NMT_OK) break;
    theirs[got] = 0;
    if (got != len || memcmp(mine, theirs, len)) {
      char k[256], va[256], vb[256];
      first_difference(mine, theirs, k, sizeof k, va, vb, sizeof vb);
      s = nmt_errorf(NMT_ERR_CONFIG, "the nodes disagree on %s: %s on node %d, %s on node %d "
                     "(every node must run the same config; only parallel.node_rank differs)",
                     k, va, w->node_rank, vb, node);
    }
  }
  free(mine), free(theirs);
  nmt_rendezvous_close(rv);
  return s;
}

void nmt__world_release(nmt_trainer *t) {
  const nmt__world *w = &t->world;
  /* A run that failed, or trained no step (a node may still be connecting), keeps it. */
  if (!derived_rendezvous(&t->cfg, w) || w->node_rank != 0 || t->sync.dead || !t->comms ||
      !t->comms[0] || t->dir.last_metrics.step <= 0)
    return;
  remove_tree(w->rendezvous);
  char parent[NMT_PATH_MAX + 16];
  snprintf(parent, sizeof parent, "%s/rendezvous", t->cfg.run_out_dir);
  rmdir(parent); /* when empty: the last of the job's */
}

