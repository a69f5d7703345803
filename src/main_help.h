/* main_help.h — the nmt command line's texts (src/main_help.c), for src/main.c only: the usage
 * summary and, per command, a table of its options from which `nmt COMMAND --help` is printed
 * (test_cli.c's cli_help_lists_every_parsed_option checks the table against the flags main.c's
 * parsers accept).
 *
 * defines: nmt__cli_usage, nmt__cli_option, nmt__cli_command, nmt__cli_command_find,
 *          nmt__cli_help_print
 */
#ifndef NMT_MAIN_HELP_H
#define NMT_MAIN_HELP_H

#include <stdio.h>

/* "usage: ..." over every command, then the exit codes; printed on a usage error and by
 * `nmt --help` (stdout) or `nmt` alone (stderr). */
extern const char nmt__cli_usage[];

/* One flag of a command: "--nbest" taking "K" (NULL: a switch), and its help, lines separated
 * by "\n" (no final newline), printed in a column after the flag. */
typedef struct {
  const char *flag;
  const char *value;
  const char *help;
} nmt__cli_option;

/* One command's --help: `usage` (its "usage: nmt ..." lines), `about` (what it does; may be
 * NULL), its options (terminated by a {NULL} entry; the list may be only that), and `after`
 * (examples, notes; may be NULL). Each text but the options ends with a newline. */
typedef struct {
  const char *name;
  const char *usage;
  const char *about;
  const nmt__cli_option *options;
  const char *after;
} nmt__cli_command;

/* The command called `name` ("translate", "bench scaling"); NULL for a name that is not one. */
const nmt__cli_command *nmt__cli_command_find(const char *name);

/* Writes `nmt NAME --help` to out: usage, about, each option as "  FLAG VALUE  help" (the help
 * column as wide as the command's longest FLAG VALUE), then `after`. Returns 0, or -1 for a
 * name that is not a command (nothing written). `config`'s is followed by the key list
 * (nmt_config_help), which main.c prints. */
int nmt__cli_help_print(FILE *out, const char *name);

#endif
