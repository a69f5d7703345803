/* cmd_translate.c — `nmt translate`: a checkpoint's translations of an input file (or stdin),
 * with the signal handling that lets a stopped run keep what it translated. */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/paths.h"
#include "nmt/spm.h"
#include "nmt/status.h"
#include "nmt/translate.h"

/* The most models of one ensemble (src/engine/translate_impl.h's NMT__ENSEMBLE_MAX). */
#define NMT_ENSEMBLE_MAX_MODELS 16

/* SIGINT/SIGTERM during translate: finish the batch, write what is translated, exit 75. The
 * handler sets a flag (the translation loop polls it). A second signal 1 s or more after the
 * first ends the process at once, as without a handler; sooner it is a copy of the same request
 * (GNU timeout signals the process and then its group, a pipeline's Ctrl-C reaches every
 * process, a signal sent to each thread arrives once per thread), the rule training applies
 * (src/engine/signals.h, NMT__SIGNAL_GRACE_S). clock_gettime, signal and raise are
 * async-signal-safe (signal-safety(7)), as are lock-free atomics. */
#define TRANSLATE_SIGNAL_GRACE_S 1.0
static atomic_int translate_stop; /* set once, by the first request's handler */
/* The first request's monotonic arrival (ns; 0: none). A lock-free atomic, so the handlers of
 * copies landing on several threads at once agree on which is first (C11 7.14.1.1). */
static atomic_llong translate_stop_ns;
static void on_translate_signal(int sig) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  const long long t = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
  long long first = 0; /* becomes the first request's time when this one is not it */
  if (atomic_compare_exchange_strong(&translate_stop_ns, &first, t)) {
    atomic_store(&translate_stop, 1);
    return;
  }
  if (1e-9 * (double)(t - first) < TRANSLATE_SIGNAL_GRACE_S) return; /* a copy */
  signal(sig, SIG_DFL);
  raise(sig);
}

/* A checkpoint argument, as cli_take_ckpt_arg tells one from a CONFIG. */
static int looks_like_ckpt(const char *x) {
  const size_t n = strlen(x);
  return x[0] != '-' && !strchr(x, '=') &&
         (nmt_ckpt_is_checkpoint(x) || (n > 5 && !strcmp(x + n - 5, ".ckpt")));
}

/* --ensemble CKPT... and --weights W...: the checkpoints (and numbers) that follow the flag.
 * Returns 0, or the exit code of the usage error it printed. */
static int take_ensemble(int argc, char **argv, int *i, const char **ck, int *n_ck, float *w,
                         int *n_w) {
  char msg[512];
  if (!strcmp(argv[*i], "--ensemble")) {
    const int n0 = *n_ck;
    while (*i + 1 < argc && looks_like_ckpt(argv[*i + 1])) {
      if (*n_ck == NMT_ENSEMBLE_MAX_MODELS) {
        snprintf(msg, sizeof msg, "translate: --ensemble: more than %d checkpoints",
                 NMT_ENSEMBLE_MAX_MODELS);
        return cli_usage_error(msg);
      }
      ck[(*n_ck)++] = argv[++*i];
    }
    if (*n_ck > n0) return 0;
    return cli_usage_error("translate: --ensemble: expected checkpoints after it (files "
                           "ending in .ckpt, or checkpoints by their magic)");
  }
  const int n0 = *n_w;
  char *end;
  while (*i + 1 < argc && *n_w < NMT_ENSEMBLE_MAX_MODELS) {
    const double v = strtod(argv[*i + 1], &end);
    if (end == argv[*i + 1] || *end) break;
    if (!(v > 0 && v < 1e30)) {
      snprintf(msg, sizeof msg, "translate: --weights \"%s\": a weight must be a positive "
               "number", argv[*i + 1]);
      return cli_usage_error(msg);
    }
    w[(*n_w)++] = (float)v;
    ++*i;
  }
  if (*n_w > n0) return 0;
  return cli_usage_error("translate: --weights: expected one positive number per model of "
                         "the ensemble after it");
}

int cli_cmd_translate(int argc, char **argv) {
  ckpt_args a = {0};
  nmt_translate_options o;
  nmt_translate_options_default(&o);
  const char *ens[NMT_ENSEMBLE_MAX_MODELS];
  float weights[NMT_ENSEMBLE_MAX_MODELS];
  int n_ens = 0, n_w = 0, ensemble = 0;
  for (int i = 0; i < argc; i++) {
    if (!strcmp(argv[i], "--ensemble") || !strcmp(argv[i], "--weights")) {
      ensemble |= argv[i][2] == 'e';
      int rc = take_ensemble(argc, argv, &i, ens, &n_ens, weights, &n_w);
      if (rc) return rc;
      continue;
    }
    int took = cli_take_ckpt_arg("translate", argc, argv, &i, &a);
    if (took < 0) return nmt_status_exit_code(NMT_ERR_USAGE);
    if (took) continue;
    if (!strcmp(argv[i], "--ids")) o.ids = 1;
    else if (!strcmp(argv[i], "--scores")) o.scores = 1;
    else if (!strcmp(argv[i], "--input") && i + 1 < argc) o.input = argv[++i];
    else if (!strcmp(argv[i], "--output") && i + 1 < argc) o.output = argv[++i];
    else if (!strcmp(argv[i], "--nbest") && i + 1 < argc) {
      char *end;
      long k = strtol(argv[++i], &end, 10);
      if (end == argv[i] || *end || k < 1 || k > 1024) {
        char msg[256];
        snprintf(msg, sizeof msg, "translate: --nbest \"%s\": expected a count in [1, 1024]",
                 argv[i]);
        return cli_usage_error(msg);
      }
      o.nbest = (int)k;
    } else {
      char msg[256];
      snprintf(msg, sizeof msg, "translate: unexpected argument \"%s\"", argv[i]);
      return cli_usage_error(msg);
    }
  }
  /* The ensemble: a positional CKPT first, then --ensemble's checkpoints in order. */
  const char *models[NMT_ENSEMBLE_MAX_MODELS + 1];
  int n_models = 0;
  if (ensemble) {
    if (a.ckpt) models[n_models++] = a.ckpt;
    for (int k = 0; k < n_ens; k++) models[n_models++] = ens[k];
    if (n_models > NMT_ENSEMBLE_MAX_MODELS) {
      char msg[128];
      snprintf(msg, sizeof msg, "translate: an ensemble of %d checkpoints (at most %d)",
               n_models, NMT_ENSEMBLE_MAX_MODELS);
      return cli_usage_error(msg);
    }
    a.ckpt = models[0];
    o.ensemble = models + 1;
    o.n_ensemble = n_models - 1;
  }
  if (n_w && n_w != (ensemble ? n_models : 1)) {
    char msg[256];
    snprintf(msg, sizeof msg, "translate: --weights gives %d weights for %d models", n_w,
             ensemble ? n_models : 1);
    return cli_usage_error(msg);
  }
  if (n_w) o.weights = weights;
  if (cli_need_ckpt_or_config("translate", &a)) return nmt_status_exit_code(NMT_ERR_USAGE);
  nmt_ckpt_setup setup;
  nmt_status s = nmt_ckpt_setup_load(a.ckpt, a.c.configs, a.c.n_configs, a.c.overrides,
                                     a.c.n_overrides, &setup);
  if (s != NMT_OK) return cli_fail(s);
  nmt_spm *spm = NULL;
  if (!o.ids) s = nmt_ckpt_setup_spm(&setup, &spm);
  o.spm = spm;
  o.stop = &translate_stop;
  struct sigaction sa, old_int, old_term;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_translate_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  nmt_path_arg in[2 + MAX_CONFIGS] = {{"--input", o.input}, {"CKPT", setup.ckpt}};
  nmt_path_arg out = {"--output", o.output};
  if (s == NMT_OK) s = nmt_path_check_outputs("translate", &out, 1, in, cli_config_inputs(&a, in, 2));
  if (s == NMT_OK) s = nmt_translate(&setup.cfg, setup.ckpt, &o);
  /* After a stop the handler stays until the exit: a copy still pending on another thread would
   * meet the default action and kill the process with its translations written. */
  if (!atomic_load(&translate_stop)) {
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
  }
  nmt_spm_free(spm);
  nmt_ckpt_setup_free(&setup);
  if (s == NMT_STOPPED) {
    fprintf(stderr, "nmt: translate: stopped on request; the translations of the first %ld "
            "lines are written\n", o.translated);
    return nmt_status_exit_code(s);
  }
  return s == NMT_OK ? 0 : cli_fail(s);
}
