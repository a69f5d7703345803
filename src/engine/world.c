/* world.c — a run over several processes, one per node (parallel.nodes; docs/multinode.md):
 * who this process is, where the nodes meet, and the check that they all run the same thing.
 *
 * Ranks: global rank = node_rank x devices + local index; world = nodes x devices. Under
 * Slurm the keys left at auto take $SLURM_NNODES / $SLURM_NODEID (or $SLURM_NTASKS /
 * $SLURM_PROCID when srun starts one task per node), and the rendezvous directory lives under
 * the run directory, named by the job and its restart count, so `srun nmt train CONFIG` on N
 * nodes needs nothing else.
 *
 * At create every process publishes its effective config (without parallel.node_rank) and the
 * step it resumes from under its own key of the rendezvous store, and reads every other's:
 * the first differing line is an error on every node naming the key, both values and both
 * nodes (exit 2); a node that never arrives is an error naming it after parallel.timeout_s
 * (exit 8). Only then are the communicators created (through the device layer).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

nmt_status nmt__world_resolve(const nmt_config *cfg, nmt__world *w) {
  memset(w, 0, sizeof *w);
  const long snodes = env_long("SLURM_NNODES"), snode = env_long("SLURM_NODEID");
  const long stasks = env_long("SLURM_NTASKS"), sproc = env_long("SLURM_PROCID");
  /* srun with one task per node: the task ids are the node ids. */
  const int slurm_tasks = stasks > 1 && stasks == snodes && sproc >= 0;
  w->nodes = cfg->parallel_nodes > 0 ? cfg->parallel_nodes : snodes > 0 ? (int)snodes : 1;
  w->node_rank = cfg->parallel_node_rank >= 0 ? cfg->parallel_node_rank
                 : slurm_tasks                ? (int)sproc
                 : snode >= 0 && w->nodes > 1 ? (int)snode
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

nmt_status nmt__world_agree(nmt_trainer *t, const char *prefix) {
  const nmt__world *w = &t->world;
  nmt_rendezvous *rv = NULL;
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
