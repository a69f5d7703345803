/* main_help.h — the nmt command line's texts (src/main_help.c), for src/main.c only. */
#ifndef NMT_MAIN_HELP_H
#define NMT_MAIN_HELP_H

/* "usage: ..." over every command, then the exit codes; printed on a usage error and by
 * `nmt --help` (stdout) or `nmt` alone (stderr). */
extern const char nmt__cli_usage[];

/* COMMAND's `nmt COMMAND --help` text (NUL-terminated, ends with a newline); NULL for a name
 * that is not a command. `config`'s is followed by the key list (nmt_config_help). */
const char *nmt__cli_help(const char *name);

#endif
