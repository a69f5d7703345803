/* cli.h — what the nmt command line's files share (src/main.c and src/cmd_*.c; not part of
 * libnmt): error reporting with exit codes, and the parsing of CONFIG files, overrides
 * (section.key=value) and checkpoints that every command taking them does alike.
 *
 * defines: cli_args, ckpt_args, MAX_CONFIGS, MAX_OVERRIDES, cli_fail, cli_usage_error,
 *          cli_is_override, cli_unexpected_arg, cli_add_config, cli_take_positional,
 *          cli_config_label, cli_take_ckpt_arg, cli_config_inputs, cli_need_ckpt_or_config,
 *          cli_parse_int_in, cli_parse_double_in
 */
#ifndef NMT_CLI_H
#define NMT_CLI_H

#include <stddef.h>

#include "nmt/paths.h"
#include "nmt/status.h"

/* A command's CONFIG files, in order (later ones override earlier ones, as Marian's --config
 * a.yml b.yml), and its overrides (a.b=c), applied after them. */
enum { MAX_CONFIGS = 64, MAX_OVERRIDES = 256 };
typedef struct {
  const char *configs[MAX_CONFIGS];
  int n_configs;
  const char *overrides[MAX_OVERRIDES];
  int n_overrides;
} cli_args;

/* A command that reads a checkpoint: its positional arguments are a checkpoint and configs,
 * told apart by the checkpoint magic; --ckpt and --config name them too. */
typedef struct {
  const char *ckpt;
  cli_args c; /* the configs, in order (positional and --config alike), and the overrides */
} ckpt_args;

/* Reports a failed command: its message once (the library logged it where the error arose,
 * so nmt_log_errors_once drops it here unless it is new), then what the exit code means. */
int cli_fail(nmt_status s);

/* Prints "nmt: WHAT" and the usage summary to stderr; returns the usage exit code (2). */
int cli_usage_error(const char *what);

/* 1 if a looks like an override section.key=value (no leading '-'; a '=' and a '.'). */
int cli_is_override(const char *a);

/* The usage error "CMD: unexpected argument \"ARG\""; returns its exit code. */
int cli_unexpected_arg(const char *cmd, const char *arg);

/* Appends the CONFIG x. Returns 0, or the exit code of the usage error it printed. */
int cli_add_config(const char *cmd, const char *x, cli_args *a);

/* Takes the positional argument x (not a flag) into a: an override section.key=value, or
 * another CONFIG (an argument with '=' is never one). Returns 0, or the exit code of the usage
 * error it printed. */
int cli_take_positional(const char *cmd, const char *x, cli_args *a);

/* "a.ini + b.ini + command line", as messages and bench tables name a command's config. */
void cli_config_label(const cli_args *a, char *out, size_t cap);

/* Takes argv[*i] if it is a positional CKPT or CONFIG, --ckpt P, --config C or an override;
 * returns 1 if taken, 0 if not one of these, -1 on a usage error (message printed). */
int cli_take_ckpt_arg(const char *cmd, int argc, char **argv, int *i, ckpt_args *a);

/* The command's CONFIG files after the n inputs already in `in`, for nmt_path_check_outputs
 * (an output must not replace one of them). Returns the new count. */
int cli_config_inputs(const ckpt_args *a, nmt_path_arg *in, int n);

/* 0 if a names a checkpoint or a CONFIG; else the usage error "CMD: missing CKPT or CONFIG"
 * and its exit code. */
int cli_need_ckpt_or_config(const char *cmd, const ckpt_args *a);

/* Strict numbers for the bench flags: the whole text, finite, in [lo, hi]. */
int cli_parse_int_in(const char *s, long lo, long hi, int *out);

/* As cli_parse_int_in for a double. Both return 1 and set *out, or 0 (out untouched). */
int cli_parse_double_in(const char *s, double lo, double hi, double *out);

/* The commands that live in their own files (src/cmd_NAME.c): argv after the command's name.
 * Each returns the process exit code (nmt_status_exit_code; README "Exit codes"). */
int cli_cmd_translate(int argc, char **argv);
int cli_cmd_export(int argc, char **argv);

#endif
