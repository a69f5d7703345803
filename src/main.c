/* main.c — the nmt command line: a thin client of the library. The only place that exits.
 *
 *   nmt train CONFIG [section.key=value ...] [--resume]
 *   nmt translate CONFIG [section.key=value ...] [--ckpt PATH] [--input F] [--output F] [--ids]
 *   nmt config --dump CONFIG [section.key=value ...]
 *   nmt config --help [--markdown]
 *   nmt shard --vocab V SRC_IDS TGT_IDS OUT
 *   nmt shard-info SHARD [--vocab V]
 *
 * Exit codes: nmt_status_exit_code() (README.md "Exit codes").
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/log.h"
#include "nmt/status.h"
#include "nmt/trainer.h"
#include "nmt/translate.h"

static const char usage[] =
    "usage:\n"
    "  nmt train CONFIG [section.key=value ...] [--resume]\n"
    "  nmt translate CONFIG [section.key=value ...] [--ckpt PATH] [--input FILE] [--output FILE]"
    " [--ids]\n"
    "  nmt config --dump CONFIG [section.key=value ...]\n"
    "  nmt config --help [--markdown]\n"
    "  nmt shard --vocab V SRC_IDS TGT_IDS OUT\n"
    "  nmt shard-info SHARD [--vocab V]\n"
    "Exit codes: 0 done, 1 internal, 2 config/usage, 3 data, 4 device/out of memory, 5 diverged,\n"
    "6 I/O, 7 checkpoint, 8 aborted, 75 stopped with a checkpoint written.\n";

static int fail(nmt_status s) {
  const char *msg = nmt_last_error();
  fprintf(stderr, "nmt: %s%s%s\n", nmt_status_desc(s), *msg ? ": " : "", msg);
  return nmt_status_exit_code(s);
}

static int usage_error(const char *what) {
  fprintf(stderr, "nmt: %s\n%s", what, usage);
  return nmt_status_exit_code(NMT_ERR_USAGE);
}

/* Splits argv after the subcommand into CONFIG, overrides (a.b=c) and flags handled by `flag`. */
typedef struct {
  const char *config;
  const char *overrides[256];
  int n_overrides;
} cli_args;

static int is_override(const char *a) { return a[0] != '-' && strchr(a, '=') && strchr(a, '.'); }

static int cmd_train(int argc, char **argv) {
  cli_args a = {0};
  int resume = 0;
  for (int i = 0; i < argc; i++) {
    if (!strcmp(argv[i], "--resume")) resume = 1;
    else if (!a.config && argv[i][0] != '-' && !is_override(argv[i])) a.config = argv[i];
    else if (is_override(argv[i]) && a.n_overrides < 256) a.overrides[a.n_overrides++] = argv[i];
    else return usage_error("train: unexpected argument");
  }
  if (!a.config) return usage_error("train: missing CONFIG");
  nmt_config cfg;
  nmt_status s = nmt_config_load(a.config, a.overrides, a.n_overrides, &cfg);
  if (s != NMT_OK) return fail(s);
  if (resume) cfg.run_resume = 1;

  /* Signals go to the main thread's sigtimedwait only: block them before any thread starts so
   * every worker inherits the mask. */
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &sigs, NULL);

  nmt_trainer_options opt;
  nmt_trainer_options_default(&opt);
  opt.handle_signals = 1;
  nmt_trainer *t;
  s = nmt_trainer_create(&cfg, &opt, &t);
  if (s != NMT_OK) return fail(s);
  s = nmt_trainer_run(t);
  nmt_trainer_destroy(t);
  if (s == NMT_STOPPED) {
    fprintf(stderr, "nmt: stopped on request; checkpoint written; resume with --resume\n");
    return nmt_status_exit_code(s);
  }
  return s == NMT_OK ? 0 : fail(s);
}

static int cmd_translate(int argc, char **argv) {
  cli_args a = {0};
  const char *ckpt = NULL, *input = "-", *output = "-";
  int ids = 0;
  for (int i = 0; i < argc; i++) {
    if (!strcmp(argv[i], "--ids")) ids = 1;
    else if (!strcmp(argv[i], "--ckpt") && i + 1 < argc) ckpt = argv[++i];
    else if (!strcmp(argv[i], "--input") && i + 1 < argc) input = argv[++i];
    else if (!strcmp(argv[i], "--output") && i + 1 < argc) output = argv[++i];
    else if (!a.config && argv[i][0] != '-' && !is_override(argv[i])) a.config = argv[i];
    else if (is_override(argv[i]) && a.n_overrides < 256) a.overrides[a.n_overrides++] = argv[i];
    else return usage_error("translate: unexpected argument");
  }
  if (!a.config) return usage_error("translate: missing CONFIG");
  nmt_config cfg;
  nmt_status s = nmt_config_load(a.config, a.overrides, a.n_overrides, &cfg);
  if (s != NMT_OK) return fail(s);
  s = nmt_translate_file(&cfg, ckpt, input, output, ids);
  return s == NMT_OK ? 0 : fail(s);
}

static int cmd_config(int argc, char **argv) {
  if (argc >= 1 && !strcmp(argv[0], "--help")) {
    nmt_config_help(stdout, argc >= 2 && !strcmp(argv[1], "--markdown"));
    return 0;
  }
  if (argc < 2 || strcmp(argv[0], "--dump")) return usage_error("config: expected --dump CONFIG or --help");
  cli_args a = {0};
  a.config = argv[1];
  for (int i = 2; i < argc; i++) {
    if (!is_override(argv[i]) || a.n_overrides >= 256) return usage_error("config: bad override");
    a.overrides[a.n_overrides++] = argv[i];
  }
  nmt_config cfg;
  nmt_status s = nmt_config_load(a.config, a.overrides, a.n_overrides, &cfg);
  if (s != NMT_OK) return fail(s);
  s = nmt_config_dump(&cfg, stdout);
  return s == NMT_OK ? 0 : fail(s);
}

static int parse_vocab(const char *s, int *out) {
  char *end;
  long v = strtol(s, &end, 10);
  if (end == s || *end || v < 1 || v > (1L << 30)) return 0;
  *out = (int)v;
  return 1;
}

static int cmd_shard(int argc, char **argv) {
  int vocab = 0;
  if (argc != 5 || strcmp(argv[0], "--vocab") || !parse_vocab(argv[1], &vocab))
    return usage_error("shard: expected --vocab V SRC_IDS TGT_IDS OUT");
  nmt_status s = nmt_shard_write_from_text(argv[2], argv[3], vocab, argv[4]);
  return s == NMT_OK ? 0 : fail(s);
}

static int cmd_shard_info(int argc, char **argv) {
  int vocab = 0;
  if (argc != 1 && !(argc == 3 && !strcmp(argv[1], "--vocab") && parse_vocab(argv[2], &vocab)))
    return usage_error("shard-info: expected SHARD [--vocab V]");
  nmt_shard *sh;
  nmt_status s = nmt_shard_open(argv[0], vocab, &sh);
  if (s != NMT_OK) return fail(s);
  long n = nmt_shard_num_pairs(sh), src = 0, tgt = 0;
  for (long i = 0; i < n; i++) src += nmt_shard_src_len(sh, i), tgt += nmt_shard_tgt_len(sh, i);
  printf("%s: %ld pairs, vocab %d, %ld source ids, %ld target ids\n", argv[0], n,
         nmt_shard_vocab(sh), src, tgt);
  nmt_shard_close(sh);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
    fputs(usage, argc < 2 ? stderr : stdout);
    return argc < 2 ? nmt_status_exit_code(NMT_ERR_USAGE) : 0;
  }
  const char *cmd = argv[1];
  if (!strcmp(cmd, "train")) return cmd_train(argc - 2, argv + 2);
  if (!strcmp(cmd, "translate")) return cmd_translate(argc - 2, argv + 2);
  if (!strcmp(cmd, "config")) return cmd_config(argc - 2, argv + 2);
  if (!strcmp(cmd, "shard")) return cmd_shard(argc - 2, argv + 2);
  if (!strcmp(cmd, "shard-info")) return cmd_shard_info(argc - 2, argv + 2);
  return usage_error("unknown command");
}
