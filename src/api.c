/* api.c — libnmt's public C API (include/nmt/nmt.h): a session wraps one nmt_trainer, the
 * config it was built from and the log sink (the signal handlers are the trainer's). Everything
 * that trains lives in src/engine/ (trainer.c and its rooms); this file loads, checks arguments and cleans up. */
#include "nmt/nmt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/config.h"

struct nmt_session {
  nmt_config cfg;
  nmt_trainer *trainer;
  nmt_log_sink sink;     /* installed in place while the session is open (nmt_log_set_sink) */
  int sink_set;
};

nmt_status nmt_session_options_default(nmt_session_options *o) {
  if (!o) return nmt_errorf(NMT_ERR_USAGE, "nmt_session_options_default: NULL options");
  memset(o, 0, sizeof *o);
  o->size = sizeof *o;
  o->inject_nan_step = -1;
  return NMT_OK;
}

/* Undoes what open did, in reverse: the trainer (no thread runs between calls; its destroy
 * restores the signal handlers it installed), then the log sink. */
static void session_free(nmt_session *s) {
  if (s->trainer) nmt_trainer_destroy(s->trainer);
  if (s->sink_set) nmt_log_set_sink(NULL);
  free(s);
}

nmt_status nmt_session_open(const char *ini_path, const char *const *overrides, int n_overrides,
                            const nmt_session_options *opt, nmt_session **out) {
  return nmt_session_open_files(ini_path ? &ini_path : NULL, ini_path ? 1 : 0, overrides,
                                n_overrides, opt, out);
}

nmt_status nmt_session_open_files(const char *const *paths, int n_paths,
                                  const char *const *overrides, int n_overrides,
                                  const nmt_session_options *opt, nmt_session **out) {
  if (!out) return nmt_errorf(NMT_ERR_USAGE, "nmt_session_open: NULL output pointer");
  *out = NULL;
  if (n_overrides < 0 || (n_overrides > 0 && !overrides))
    return nmt_errorf(NMT_ERR_USAGE, "nmt_session_open: %d overrides but no array", n_overrides);
  if (n_paths < 0 || (n_paths > 0 && !paths))
    return nmt_errorf(NMT_ERR_USAGE, "nmt_session_open: %d config files but no array", n_paths);
  nmt_session_options o;
  nmt_session_options_default(&o);
  if (opt) {
    /* Fields past the caller's size keep their defaults (an older caller's struct). */
    if (opt->size < offsetof(nmt_session_options, inject_nan_step))
      return nmt_errorf(NMT_ERR_USAGE, "nmt_session_open: options.size = %zu; call "
                        "nmt_session_options_default first", opt->size);
    memcpy(&o, opt, opt->size < sizeof o ? opt->size : sizeof o);
    o.size = sizeof o;
  }
  nmt_session *s = calloc(1, sizeof *s);
  if (!s) return nmt_errorf(NMT_ERR_NOMEM, "nmt_session_open: session");
  nmt_status st = nmt_config_load_files(paths, n_paths, overrides, n_overrides, &s->cfg);
  if (st != NMT_OK) {
    free(s);
    return st;
  }
  if (o.resume) s->cfg.run_resume = 1;
  if (o.on_log) {
    s->sink.fn = o.on_log;
    s->sink.user = o.user;
    nmt_log_set_sink(&s->sink);
    s->sink_set = 1;
  }
  nmt_trainer_options to;
  nmt_trainer_options_default(&to);
  to.handle_signals = o.handle_signals;
  to.quiet = o.quiet;
  to.on_metrics = o.on_metrics;
  to.user = o.user;
  to.nan_from_step = o.inject_nan_step;
  to.overwrite = o.overwrite;
  st = nmt_trainer_create(&s->cfg, &to, &s->trainer);
  if (st != NMT_OK) {
    s->trainer = NULL;
    session_free(s); /* logs nothing that would replace the caller's error message */
    return st;
  }
  *out = s;
  return NMT_OK;
}

nmt_status nmt_session_train(nmt_session *s, long n_steps) {
  if (!s) return nmt_errorf(NMT_ERR_USAGE, "nmt_session_train: NULL session");
  return nmt_trainer_train(s->trainer, n_steps);
}

nmt_status nmt_session_evaluate(nmt_session *s, double *valid_loss, double *valid_nll) {
  if (!s) return nmt_errorf(NMT_ERR_USAGE, "nmt_session_evaluate: NULL session");
  return nmt_trainer_evaluate(s->trainer, valid_loss, valid_nll, NULL);
}

nmt_status nmt_session_save(nmt_session *s, char *path_out, size_t cap) {
  if (!s) return nmt_errorf(NMT_ERR_USAGE, "nmt_session_save: NULL session");
  char path[1024];
  NMT_TRY(nmt_trainer_save(s->trainer, path));
  if (path_out && cap > 0) {
    if (strlen(path) >= cap)
      return nmt_errorf(NMT_ERR_USAGE, "nmt_session_save: wrote %s, but its path needs %zu "
                        "bytes and path_out has %zu", path, strlen(path) + 1, cap);
    memcpy(path_out, path, strlen(path) + 1);
  }
  return NMT_OK;
}

nmt_status nmt_session_request_stop(nmt_session *s) {
  /* No nmt_errorf: this may run in a signal handler, where formatting is not allowed. */
  if (!s) return NMT_ERR_USAGE;
  nmt_trainer_request_stop(s->trainer);
  return NMT_OK;
}

nmt_status nmt_session_progress(const nmt_session *s, long *step, long *max_steps) {
  if (!s) return nmt_errorf(NMT_ERR_USAGE, "nmt_session_progress: NULL session");
  if (step) *step = nmt_trainer_step(s->trainer);
  if (max_steps) *max_steps = nmt_trainer_end_step(s->trainer); /* early stopping ends sooner */
  return NMT_OK;
}

nmt_status nmt_session_params(const nmt_session *s, const float **params, size_t *n) {
  if (!s || !params) return nmt_errorf(NMT_ERR_USAGE, "nmt_session_params: NULL argument");
  *params = nmt_trainer_params(s->trainer, n);
  return NMT_OK;
}

nmt_status nmt_session_close(nmt_session *s) {
  if (s) session_free(s);
  return NMT_OK;
}
