/* cli.c — the command line's shared parsing and error reporting (src/cli.h). */
#include "cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/log.h"
#include "main_help.h"

/* Reports a failed command: its message once (the library logged it where the error arose,
 * so nmt_log_errors_once drops it here unless it is new), then what the exit code means. */
int cli_fail(nmt_status s) {
  const char *msg = nmt_last_error();
  if (*msg) nmt_log(NMT_LOG_ERROR, "%s", msg);
  fprintf(stderr, "nmt: %s (exit %d)\n", nmt_status_desc(s), nmt_status_exit_code(s));
  return nmt_status_exit_code(s);
}

int cli_usage_error(const char *what) {
  fprintf(stderr, "nmt: %s\n%s", what, nmt__cli_usage);
  return nmt_status_exit_code(NMT_ERR_USAGE);
}

int cli_is_override(const char *a) { return a[0] != '-' && strchr(a, '=') && strchr(a, '.'); }

int cli_unexpected_arg(const char *cmd, const char *arg) {
  char msg[1200];
  snprintf(msg, sizeof msg, "%s: unexpected argument \"%s\"", cmd, arg);
  return cli_usage_error(msg);
}


/* Appends the CONFIG x. Returns 0, or the exit code of the usage error it printed. */
int cli_add_config(const char *cmd, const char *x, cli_args *a) {
  if (a->n_configs < MAX_CONFIGS) {
    a->configs[a->n_configs++] = x;
    return 0;
  }
  char msg[1200];
  snprintf(msg, sizeof msg, "%s: too many configs at \"%s\" (%d at most)", cmd, x, MAX_CONFIGS);
  return cli_usage_error(msg);
}

/* Takes the positional argument x (not a flag) into a: an override section.key=value, or
 * another CONFIG (an argument with '=' is never one). Returns 0, or the exit code of the usage
 * error it printed. */
int cli_take_positional(const char *cmd, const char *x, cli_args *a) {
  char msg[1200];
  if (!strchr(x, '=')) return cli_add_config(cmd, x, a);
  if (cli_is_override(x) && a->n_overrides < MAX_OVERRIDES) {
    a->overrides[a->n_overrides++] = x;
    return 0;
  }
  if (cli_is_override(x))
    snprintf(msg, sizeof msg, "%s: too many overrides at \"%s\" (%d at most)", cmd, x,
             MAX_OVERRIDES);
  else
    snprintf(msg, sizeof msg, "%s: bad override \"%s\": expected section.key=value (e.g. "
             "train.max_steps=1000)", cmd, x);
  return cli_usage_error(msg);
}

/* "a.ini + b.ini + command line", as messages and bench tables name a command's config. */
void cli_config_label(const cli_args *a, char *out, size_t cap) {
  if (a->n_configs)
    nmt_config_sources(a->configs, a->n_configs, a->n_overrides, out, cap);
  else
    snprintf(out, cap, "defaults%s", a->n_overrides ? " + command line" : "");
}



/* Takes argv[*i] if it is a positional CKPT or CONFIG, --ckpt P, --config C or an override;
 * returns 1 if taken, 0 if not one of these, -1 on a usage error (message printed). */
int cli_take_ckpt_arg(const char *cmd, int argc, char **argv, int *i, ckpt_args *a) {
  const char *x = argv[*i];
  int ckpt = 0;
  if (!strcmp(x, "--ckpt") && *i + 1 < argc) ckpt = 1, x = argv[++*i];
  else if (!strcmp(x, "--config") && *i + 1 < argc)
    return cli_add_config(cmd, argv[++*i], &a->c) ? -1 : 1;
  else if (x[0] == '-') return 0;
  else if (!cli_is_override(x)) {
    /* A missing *.ckpt is reported as a missing checkpoint, not as a missing config. */
    size_t n = strlen(x);
    /* So is a *.ckpt that is not one (empty, damaged, a corpus): the checkpoint reader names
     * what is wrong with it, where the config parser would see a bad INI or, for an empty
     * file, all defaults and then a missing checkpoint in runs/default. */
    ckpt = nmt_ckpt_is_checkpoint(x) || (n > 5 && !strcmp(x + n - 5, ".ckpt"));
  }
  if (!ckpt) return cli_take_positional(cmd, x, &a->c) ? -1 : 1;
  if (a->ckpt) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s: two checkpoints given (%s and %s)", cmd, a->ckpt, x);
    return cli_usage_error(msg), -1;
  }
  a->ckpt = x;
  return 1;
}

/* The command's CONFIG files after the n inputs already in `in`, for nmt_path_check_outputs
 * (an output must not replace one of them). Returns the new count. */
int cli_config_inputs(const ckpt_args *a, nmt_path_arg *in, int n) {
  for (int k = 0; k < a->c.n_configs; k++) in[n++] = (nmt_path_arg){"CONFIG", a->c.configs[k]};
  return n;
}

int cli_need_ckpt_or_config(const char *cmd, const ckpt_args *a) {
  if (a->ckpt || a->c.n_configs) return 0;
  char msg[256];
  snprintf(msg, sizeof msg, "%s: missing CKPT or CONFIG", cmd);
  return cli_usage_error(msg);
}

/* Strict numbers for the bench flags: the whole text, finite, in [lo, hi]. */
int cli_parse_int_in(const char *s, long lo, long hi, int *out) {
  char *end;
  long v = strtol(s, &end, 10);
  if (end == s || *end || v < lo || v > hi) return 0;
  *out = (int)v;
  return 1;
}

int cli_parse_double_in(const char *s, double lo, double hi, double *out) {
  char *end;
  double v = strtod(s, &end);
  if (end == s || *end || !(v >= lo && v <= hi)) return 0;
  *out = v;
  return 1;
}
