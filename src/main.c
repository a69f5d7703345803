/* main.c — the nmt command line: a thin client of the library. The only place that exits.
 *
 *   nmt train CONFIG [CONFIG ...] [section.key=value ...] [--resume | --overwrite]
 *   nmt translate CKPT|CONFIG [CONFIG ...] [section.key=value ...] [--config CONFIG]
 *                 [--ckpt CKPT] [--input F] [--output F] [--ids] [--nbest K] [--scores]
 *   nmt config --dump CONFIG [CONFIG ...] [section.key=value ...]
 *   nmt config --help [--markdown]
 *   nmt shard --vocab V SRC_IDS TGT_IDS OUT
 *   nmt shard-info SHARD [--vocab V]
 *   nmt eval CKPT|CONFIG [CONFIG ...] [section.key=value ...] [--config CONFIG] [--ckpt CKPT]
 *            [--split valid|test | --shard FILE] [--src TEXT --ref TEXT]
 *   nmt average CKPT... --output OUT      |  nmt average --last K DIR --output OUT
 *   nmt export CKPT OUT [CONFIG ...] [section.key=value ...]
 *              [--format safetensors|ctranslate2] [--quantization Q] [--overwrite]
 *   nmt bench allreduce [CONFIG ...] [section.key=value ...] [--max-bytes N] [--min-bytes N]
 *                       [--warmup N] [--iters N] [--jsonl FILE]
 *                       [--op allreduce|reduce_scatter|all_gather|all]
 *   nmt bench scaling CONFIG [CONFIG ...] [section.key=value ...] [--busbw GB/s]
 *                     [--latency-us X] [--preset rtx3090x4] [--mfu X] [--steps N] [--warmup N]
 *                     [--max-tokens N] [--max-devices N] [--zero 0|1|2|all] [--nodes K]
 *                     [--net-gbps X] [--net-latency-us X] [--mem-gb X] [--reserve-gb X]
 *                     [--bucket MB|auto] [--jsonl FILE]
 *   nmt COMMAND --help      nmt --help      nmt --version
 *
 * Several CONFIGs apply in order, a later file's keys replacing an earlier one's, and the
 * overrides after them (nmt_config_load_files).
 *
 * Exit codes: nmt_status_exit_code() (README.md "Exit codes"). Each error is printed once
 * (nmt_log_errors_once): the library logs it where it happens, and main's report of the same
 * text is dropped.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nmt/bench.h"
#include "nmt/checkpoint.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/device.h"
#include "nmt/eval.h"
#include "nmt/export.h"
#include "nmt/log.h"
#include "nmt/nmt.h"
#include "nmt/paths.h"
#include "nmt/spm.h"
#include "nmt/status.h"
#include "nmt/trainer.h"
#include "nmt/translate.h"
#include "cli.h"
#include "main_help.h"



/* Testing hook: NMT_INJECT_NAN_STEP=k makes the reduced gradient NaN from step k on, so the
 * "diverged" exit code can be checked end to end (README "Exit codes"). -1 when unset. */
static long inject_nan_step(void) {
  const char *e = getenv("NMT_INJECT_NAN_STEP");
  char *end;
  long v = e && *e ? strtol(e, &end, 10) : -1;
  return e && *e && !*end && v >= 0 ? v : -1;
}

static int cmd_train(int argc, char **argv) {
  cli_args a = {0};
  int resume = 0, overwrite = 0;
  for (int i = 0; i < argc; i++) {
    if (!strcmp(argv[i], "--resume")) resume = 1;
    else if (!strcmp(argv[i], "--overwrite")) overwrite = 1;
    else if (argv[i][0] != '-') {
      int rc = cli_take_positional("train", argv[i], &a);
      if (rc) return rc;
    } else return cli_unexpected_arg("train", argv[i]);
  }
  if (!a.n_configs) return cli_usage_error("train: missing CONFIG");
  if (resume && overwrite) return cli_usage_error("train: --resume and --overwrite exclude each other");
  /* The CLI is a client of the public API (include/nmt/nmt.h); signals are handled there. */
  nmt_session_options opt;
  nmt_session_options_default(&opt);
  opt.resume = resume;
  opt.overwrite = overwrite;
  opt.handle_signals = 1;
  opt.inject_nan_step = inject_nan_step();
  nmt_session *sess;
  nmt_status s = nmt_session_open_files(a.configs, a.n_configs, a.overrides, a.n_overrides, &opt,
                                        &sess);
  if (s != NMT_OK) return cli_fail(s);
  s = nmt_session_train(sess, 0);
  int code = s == NMT_OK || s == NMT_STOPPED ? nmt_status_exit_code(s) : cli_fail(s);
  nmt_session_close(sess);
  if (s == NMT_STOPPED)
    fprintf(stderr, "nmt: stopped on request; checkpoint written; resume with --resume\n");
  return code;
}

static int cmd_config(int argc, char **argv) {
  if (argc >= 1 && !strcmp(argv[0], "--help")) {
    nmt_config_help(stdout, argc >= 2 && !strcmp(argv[1], "--markdown"));
    return 0;
  }
  if (argc < 2 || strcmp(argv[0], "--dump"))
    return cli_usage_error("config: expected --dump CONFIG [CONFIG ...] or --help");
  cli_args a = {0};
  for (int i = 1; i < argc; i++) {
    if (argv[i][0] == '-') return cli_unexpected_arg("config --dump", argv[i]);
    int rc = cli_take_positional("config --dump", argv[i], &a);
    if (rc) return rc;
  }
  if (!a.n_configs) return cli_usage_error("config --dump: missing CONFIG");
  nmt_config cfg;
  nmt_status s = nmt_config_load_files(a.configs, a.n_configs, a.overrides, a.n_overrides, &cfg);
  if (s != NMT_OK) return cli_fail(s);
  s = nmt_config_dump(&cfg, stdout);
  return s == NMT_OK ? 0 : cli_fail(s);
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
  if (argc >= 2 && !strcmp(argv[0], "--spm")) {
    /* Raw text, encoded in process; cleaning as Moses' clean-corpus-n.perl, on pieces. */
    nmt_shard_clean clean = {0};
    int i = 2;
    for (; i < argc - 3; i++) {
      char *end = NULL;
      if (!strcmp(argv[i], "--drop-empty")) clean.drop_empty = 1;
      else if (!strcmp(argv[i], "--max-ratio") && i + 1 < argc - 3 &&
               (clean.max_ratio = strtod(argv[i + 1], &end), end != argv[i + 1] && !*end) &&
               clean.max_ratio >= 1)
        i++;
      else break;
    }
    if (i != argc - 3)
      return cli_usage_error("shard: expected --spm MODEL [--drop-empty] [--max-ratio R >= 1] "
                         "SRC_TEXT TGT_TEXT OUT");
    nmt_shard_clean_report r;
    nmt_path_arg in[] = {{"MODEL", argv[1]}, {"SRC_TEXT", argv[i]}, {"TGT_TEXT", argv[i + 1]}},
                 out = {"OUT", argv[i + 2]};
    nmt_status s = nmt_path_check_outputs("shard", &out, 1, in, 3);
    if (s == NMT_OK) s = nmt_shard_write_from_raw(argv[1], argv[i], argv[i + 1], &clean, argv[i + 2], &r);
    if (s != NMT_OK) return cli_fail(s);
    printf("%s: %ld pairs, %ld kept", argv[i + 2], r.pairs, r.kept);
    if (clean.drop_empty || clean.max_ratio > 0)
      printf("; left out: %ld with an empty side, %ld with a length ratio above %g (pieces)",
             r.dropped_empty, r.dropped_ratio, clean.max_ratio);
    if (r.empty_kept) printf("; kept with an empty side: %ld", r.empty_kept);
    putchar('\n');
    return fflush(stdout) == 0 ? 0 : cli_fail(nmt_errorf(NMT_ERR_IO, "shard: cannot write to stdout"));
  }
  if (argc != 5 || strcmp(argv[0], "--vocab") || !parse_vocab(argv[1], &vocab))
    return cli_usage_error("shard: expected --vocab V SRC_IDS TGT_IDS OUT, or --spm MODEL "
                       "[--drop-empty] [--max-ratio R] SRC_TEXT TGT_TEXT OUT");
  nmt_path_arg in[] = {{"SRC_IDS", argv[2]}, {"TGT_IDS", argv[3]}}, out = {"OUT", argv[4]};
  nmt_status s = nmt_path_check_outputs("shard", &out, 1, in, 2);
  if (s == NMT_OK) s = nmt_shard_write_from_text(argv[2], argv[3], vocab, argv[4]);
  return s == NMT_OK ? 0 : cli_fail(s);
}

static int cmd_shard_info(int argc, char **argv) {
  int vocab = 0;
  if (argc != 1 && !(argc == 3 && !strcmp(argv[1], "--vocab") && parse_vocab(argv[2], &vocab)))
    return cli_usage_error("shard-info: expected SHARD [--vocab V]");
  nmt_shard *sh;
  nmt_status s = nmt_shard_open(argv[0], vocab, &sh);
  if (s != NMT_OK) return cli_fail(s);
  long n = nmt_shard_num_pairs(sh), src = 0, tgt = 0;
  for (long i = 0; i < n; i++) src += nmt_shard_src_len(sh, i), tgt += nmt_shard_tgt_len(sh, i);
  printf("%s: %ld pairs, vocab %d, %ld source ids, %ld target ids\n", argv[0], n,
         nmt_shard_vocab(sh), src, tgt);
  uint32_t header_crc, payload_crc;
  if (nmt_shard_crc32(sh, &header_crc, &payload_crc))
    printf("%s: checksum: header crc32 %08x, payload crc32 %08x (verified, version %d shard)\n",
           argv[0], header_crc, payload_crc, nmt_shard_version(sh));
  else
    printf("%s: checksum: none (version %d shard)\n", argv[0], nmt_shard_version(sh));
  nmt_shard_close(sh);
  return fflush(stdout) == 0 ? 0 : cli_fail(nmt_errorf(NMT_ERR_IO, "shard-info: cannot write to stdout"));
}

/* What `nmt eval` writes under run.out_dir/eval (nmt_eval_run: eval.jsonl, and with --src the
 * hypotheses <source>.<checkpoint>.beam<B>.hyp and their .sacrebleu.txt), checked against its
 * inputs. o->ckpt is the checkpoint nmt_ckpt_setup_load resolved. */
static nmt_status check_eval_outputs(const nmt_config *cfg, const ckpt_args *a,
                                     const nmt_eval_options *o) {
  nmt_eval_paths p;
  nmt_eval_paths_of(cfg, o->ckpt, o->src_text, &p);
  nmt_path_arg out[] = {{"eval.jsonl", p.jsonl}, {"hypotheses", p.hyp},
                        {"sacreBLEU report", p.report}};
  nmt_path_arg in[4 + MAX_CONFIGS] = {{"CKPT", o->ckpt}, {"--shard", o->shard},
                                      {"--src", o->src_text}, {"--ref", o->ref_text}};
  return nmt_path_check_outputs("eval", out, 3, in, cli_config_inputs(a, in, 4));
}

/* Loss/perplexity on a split or shard (default: data.valid unless only BLEU was asked for);
 * BLEU/chrF with --src/--ref, or of the split's raw text with --split. */
static int cmd_eval(int argc, char **argv) {
  ckpt_args a = {0};
  nmt_eval_options o = {0};
  const char *split = NULL, *hint = NULL;
  for (int i = 0; i < argc; i++) {
    int took = cli_take_ckpt_arg("eval", argc, argv, &i, &a);
    if (took < 0) return nmt_status_exit_code(NMT_ERR_USAGE);
    if (took) continue;
    if (!strcmp(argv[i], "--split") && i + 1 < argc) split = argv[++i];
    else if (!strcmp(argv[i], "--shard") && i + 1 < argc) o.shard = argv[++i];
    else if (!strcmp(argv[i], "--src") && i + 1 < argc) o.src_text = argv[++i];
    else if (!strcmp(argv[i], "--ref") && i + 1 < argc) o.ref_text = argv[++i];
    else {
      char msg[256];
      snprintf(msg, sizeof msg, "eval: unexpected argument \"%s\"", argv[i]);
      return cli_usage_error(msg);
    }
  }
  if (cli_need_ckpt_or_config("eval", &a)) return nmt_status_exit_code(NMT_ERR_USAGE);
  if (!o.src_text != !o.ref_text) return cli_usage_error("eval: --src and --ref go together");
  if (split && o.shard) return cli_usage_error("eval: --split and --shard exclude each other");
  if (split && strcmp(split, "valid") && strcmp(split, "test")) {
    char msg[256];
    snprintf(msg, sizeof msg, "eval: --split \"%s\": expected valid or test", split);
    return cli_usage_error(msg);
  }
  nmt_ckpt_setup setup;
  nmt_status s = nmt_ckpt_setup_load(a.ckpt, a.c.configs, a.c.n_configs, a.c.overrides,
                                     a.c.n_overrides, &setup);
  if (s != NMT_OK) return cli_fail(s);
  const nmt_config *cfg = &setup.cfg;
  char src[NMT_PATH_MAX + 64], ref[NMT_PATH_MAX + 64];
  nmt_spm *spm = NULL;
  o.ckpt = setup.ckpt;
  if (o.shard) {
    o.shard_label = "shard";
  } else if (split || !o.src_text) {
    int test = split && !strcmp(split, "test");
    o.shard = test ? cfg->data_test : cfg->data_valid;
    o.shard_label = test ? "test" : "valid";
    if (!o.shard[0]) {
      char label[4 * NMT_PATH_MAX];
      cli_config_label(&a.c, label, sizeof label);
      s = nmt_errorf(NMT_ERR_CONFIG, "eval --split %s needs [data] %s in %s", o.shard_label,
                     o.shard_label, a.c.n_configs ? label : setup.ckpt);
    } else if (split && !o.src_text) {
      /* --split: BLEU and chrF of the split's raw text too. */
      s = nmt_eval_split_text(cfg, split, src, ref, sizeof src);
      /* The advice for this command line, after the message (logged once where it arose;
       * wrapped in a second message it was printed twice); the trainer has its own words. */
      if (s != NMT_OK) hint = "pass --src TEXT --ref TEXT for BLEU of the split's raw text";
      o.src_text = src, o.ref_text = ref;
    }
  }
  if (s == NMT_OK) s = check_eval_outputs(cfg, &a, &o);
  if (s == NMT_OK && o.src_text) s = nmt_ckpt_setup_spm(&setup, &spm);
  o.spm = spm;
  if (s == NMT_OK) s = nmt_eval_run(cfg, &o, stdout);
  nmt_spm_free(spm);
  nmt_ckpt_setup_free(&setup);
  if (s != NMT_OK && hint) {
    const char *msg = nmt_last_error();
    if (*msg) nmt_log(NMT_LOG_ERROR, "%s", msg);
    fprintf(stderr, "nmt: eval --split %s: %s\n", split, hint);
  }
  return s == NMT_OK ? 0 : cli_fail(s);
}

static int parse_count(const char *s, int *out) {
  char *end;
  long v = strtol(s, &end, 10);
  if (end == s || *end || v < 1 || v > 100000) return 0;
  *out = (int)v;
  return 1;
}

/* average --output must not replace one of the checkpoints it reads (a resumable one would
 * become parameters only). */
static nmt_status check_average_output(const char *out, const char *const *ins, int n,
                                       const char *arg) {
  nmt_path_arg o = {"--output", out};
  for (int i = 0; i < n; i++) {
    nmt_path_arg in = {arg, ins[i]};
    NMT_TRY(nmt_path_check_outputs("average", &o, 1, &in, 1));
  }
  return NMT_OK;
}

static int cmd_average(int argc, char **argv) {
  const char *out = NULL, *dir = NULL;
  const char **paths = calloc((size_t)(argc > 0 ? argc : 1), sizeof *paths);
  int n = 0, k = 0;
  if (!paths) return cli_fail(nmt_errorf(NMT_ERR_NOMEM, "arguments"));
  for (int i = 0; i < argc; i++) {
    if (!strcmp(argv[i], "--output") && i + 1 < argc) out = argv[++i];
    else if (!strcmp(argv[i], "--last") && i + 2 < argc && parse_count(argv[i + 1], &k))
      dir = argv[i + 2], i += 2;
    else if (argv[i][0] != '-') paths[n++] = argv[i];
    else {
      free(paths);
      return cli_unexpected_arg("average", argv[i]);
    }
  }
  if (!out || (dir && n) || (!dir && !n)) {
    free(paths);
    return cli_usage_error("average: expected CKPT... --output OUT or --last K DIR --output OUT");
  }
  nmt_status s;
  if (dir) {
    char **last;
    int got;
    s = nmt_ckpt_last_k(dir, k, &last, &got);
    if (s == NMT_OK) {
      if (got < k)
        nmt_log(NMT_LOG_WARN, "average --last %d: only %d valid checkpoint%s in %s; averaging "
                "%s", k, got, got == 1 ? "" : "s", dir, got == 1 ? "it" : "those");
      for (int i = 0; i < got; i++) fprintf(stderr, "nmt: average: %s\n", last[i]);
      s = check_average_output(out, (const char *const *)last, got, "--last K DIR:");
      if (s == NMT_OK) s = nmt_ckpt_average((const char *const *)last, got, out);
      for (int i = 0; i < got; i++) free(last[i]);
      free(last);
    }
  } else {
    s = check_average_output(out, paths, n, "CKPT");
    if (s == NMT_OK) s = nmt_ckpt_average(paths, n, out);
  }
  free(paths);
  return s == NMT_OK ? 0 : cli_fail(s);
}

static int cmd_bench_allreduce(int argc, char **argv) {
  cli_args a = {0};
  nmt_bench_allreduce_opts o;
  nmt_bench_allreduce_opts_default(&o);
  const char *jsonl = NULL;
  for (int i = 0; i < argc; i++) {
    int more = i + 1 < argc;
    if (!strcmp(argv[i], "--max-bytes") && more) {
      if (nmt_bench_parse_bytes(argv[++i], &o.max_bytes) != NMT_OK)
        return cli_usage_error("bench allreduce: bad --max-bytes");
    } else if (!strcmp(argv[i], "--min-bytes") && more) {
      if (nmt_bench_parse_bytes(argv[++i], &o.min_bytes) != NMT_OK)
        return cli_usage_error("bench allreduce: bad --min-bytes");
    } else if (!strcmp(argv[i], "--warmup") && more) {
      if (!cli_parse_int_in(argv[++i], 0, 100000, &o.warmup))
        return cli_usage_error("bench allreduce: --warmup takes 0..100000");
    } else if (!strcmp(argv[i], "--iters") && more) {
      if (!cli_parse_int_in(argv[++i], 1, 100000, &o.iters))
        return cli_usage_error("bench allreduce: --iters takes 1..100000");
    } else if (!strcmp(argv[i], "--jsonl") && more) {
      jsonl = argv[++i];
    } else if (!strcmp(argv[i], "--op") && more) {
      if (nmt_bench_op_parse(argv[++i], &o.op) != NMT_OK)
        return cli_usage_error("bench allreduce: --op takes allreduce, reduce_scatter, all_gather or all");
    } else if (argv[i][0] != '-') {
      int rc = cli_take_positional("bench allreduce", argv[i], &a);
      if (rc) return rc;
    } else {
      return cli_unexpected_arg("bench allreduce", argv[i]);
    }
  }
  if (o.min_bytes > o.max_bytes) return cli_usage_error("bench allreduce: --min-bytes > --max-bytes");
  nmt_config cfg;
  nmt_status s = nmt_config_load_files(a.configs, a.n_configs, a.overrides, a.n_overrides, &cfg);
  if (s != NMT_OK) return cli_fail(s);
  char label[NMT_PATH_MAX + 32];
  cli_config_label(&a, label, sizeof label);
  s = nmt_bench_allreduce(&cfg, label, &o, jsonl, stdout);
  return s == NMT_OK ? 0 : cli_fail(s);
}

static int cmd_bench_scaling(int argc, char **argv) {
  cli_args a = {0};
  nmt_bench_scaling_opts o;
  nmt_bench_scaling_opts_default(&o);
  const char *jsonl = NULL;
  char bucket_override[64];
  for (int i = 0; i < argc; i++) {
    int more = i + 1 < argc;
    if (!strcmp(argv[i], "--busbw") && more) {
      if (!cli_parse_double_in(argv[++i], 1e-6, 1e6, &o.busbw_gbs))
        return cli_usage_error("bench scaling: --busbw takes GB/s in (0, 1e6]");
    } else if (!strcmp(argv[i], "--latency-us") && more) {
      if (!cli_parse_double_in(argv[++i], 0, 1e7, &o.latency_us))
        return cli_usage_error("bench scaling: --latency-us takes microseconds in [0, 1e7]");
    } else if (!strcmp(argv[i], "--mfu") && more) {
      if (!cli_parse_double_in(argv[++i], 1e-4, 1, &o.mfu))
        return cli_usage_error("bench scaling: --mfu takes a fraction in (0, 1]");
    } else if (!strcmp(argv[i], "--preset") && more) {
      if (strcmp(argv[++i], "rtx3090x4"))
        return cli_usage_error("bench scaling: the only --preset is rtx3090x4");
      o.preset = NMT_SCALING_PRESET_RTX3090X4;
    } else if (!strcmp(argv[i], "--steps") && more) {
      if (!cli_parse_int_in(argv[++i], 1, 100000, &o.steps))
        return cli_usage_error("bench scaling: --steps takes 1..100000");
    } else if (!strcmp(argv[i], "--warmup") && more) {
      if (!cli_parse_int_in(argv[++i], 0, 100000, &o.warmup))
        return cli_usage_error("bench scaling: --warmup takes 0..100000");
    } else if (!strcmp(argv[i], "--max-devices") && more) {
      if (!cli_parse_int_in(argv[++i], 1, 64, &o.max_devices))
        return cli_usage_error("bench scaling: --max-devices takes 1..64");
    } else if (!strcmp(argv[i], "--max-tokens") && more) {
      if (!cli_parse_int_in(argv[++i], -1, 1 << 30, &o.max_tokens))
        return cli_usage_error("bench scaling: --max-tokens takes -1 (the config's batch), 0 (auto) "
                           "or padded tokens per measured micro-batch");
    } else if (!strcmp(argv[i], "--zero") && more) {
      const char *z = argv[++i];
      if (!strcmp(z, "all"))
        o.zero = NMT_SCALING_ZERO_ALL;
      else if (!cli_parse_int_in(z, 0, 2, &o.zero))
        return cli_usage_error("bench scaling: --zero takes 0, 1, 2 or all");
    } else if (!strcmp(argv[i], "--nodes") && more) {
      if (!cli_parse_int_in(argv[++i], 2, NMT_SCALING_MAX_NODES, &o.nodes))
        return cli_usage_error("bench scaling: --nodes takes 2..16");
    } else if (!strcmp(argv[i], "--net-gbps") && more) {
      if (!cli_parse_double_in(argv[++i], 1e-3, 1e6, &o.net_gbps))
        return cli_usage_error("bench scaling: --net-gbps takes Gb/s in (0, 1e6]");
    } else if (!strcmp(argv[i], "--net-latency-us") && more) {
      if (!cli_parse_double_in(argv[++i], 0, 1e7, &o.net_latency_us))
        return cli_usage_error("bench scaling: --net-latency-us takes microseconds in [0, 1e7]");
    } else if (!strcmp(argv[i], "--mem-gb") && more) {
      if (!cli_parse_double_in(argv[++i], 1e-3, 1e6, &o.mem_gb))
        return cli_usage_error("bench scaling: --mem-gb takes GiB in (0, 1e6]");
    } else if (!strcmp(argv[i], "--reserve-gb") && more) {
      if (!cli_parse_double_in(argv[++i], 0, 1e6, &o.reserve_gb))
        return cli_usage_error("bench scaling: --reserve-gb takes GiB in [0, 1e6]");
    } else if (!strcmp(argv[i], "--jsonl") && more) {
      jsonl = argv[++i];
    } else if (!strcmp(argv[i], "--bucket") && more && a.n_overrides < MAX_OVERRIDES) {
      /* Shorthand for the override, applied in its place among the others. */
      const char *v = argv[++i];
      double mb;
      if (strcmp(v, "auto") && !cli_parse_double_in(v, 1e-6, 65536, &mb))
        return cli_usage_error("bench scaling: --bucket takes MiB in (0, 65536] or auto");
      snprintf(bucket_override, sizeof bucket_override, "parallel.bucket_mb=%s", v);
      a.overrides[a.n_overrides++] = bucket_override;
    } else if (argv[i][0] != '-') {
      int rc = cli_take_positional("bench scaling", argv[i], &a);
      if (rc) return rc;
    } else {
      return cli_unexpected_arg("bench scaling", argv[i]);
    }
  }
  if (!a.n_configs) return cli_usage_error("bench scaling: missing CONFIG");
  if (o.mfu > 0 && o.preset == NMT_SCALING_PRESET_NONE)
    return cli_usage_error("bench scaling: --mfu needs --preset (it rescales compute to that GPU)");
  nmt_config cfg;
  nmt_status s = nmt_config_load_files(a.configs, a.n_configs, a.overrides, a.n_overrides, &cfg);
  if (s != NMT_OK) return cli_fail(s);
  char label[NMT_PATH_MAX + 32];
  cli_config_label(&a, label, sizeof label);
  s = nmt_bench_scaling(&cfg, label, &o, jsonl, stdout);
  return s == NMT_OK ? 0 : cli_fail(s);
}

static int cmd_bench(int argc, char **argv) {
  if (argc >= 1 && !strcmp(argv[0], "allreduce")) return cmd_bench_allreduce(argc - 1, argv + 1);
  if (argc >= 1 && !strcmp(argv[0], "scaling")) return cmd_bench_scaling(argc - 1, argv + 1);
  return cli_usage_error("bench: expected allreduce or scaling");
}

/* ---- nmt COMMAND --help, nmt --version ---------------------------------------------------- */


static int print_help(const char *name) {
  if (nmt__cli_help_print(stdout, name) != 0) return cli_usage_error("unknown command");
  if (!strcmp(name, "config")) {
    fputs("\n", stdout);
    nmt_config_help(stdout, 0);
  }
  return 0;
}

static int has_help_flag(int argc, char **argv) {
  for (int i = 0; i < argc; i++)
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return 1;
  return 0;
}

/* Set by the Makefile for src/main.o from `git describe --always --dirty`. */
#ifndef NMT_COMMIT
#define NMT_COMMIT "unknown"
#endif
#define NMT_VERSION "0.1.0"

static int print_version(void) {
  char dev[512];
  nmt_device_versions(dev, sizeof dev);
  printf("nmt %s (commit %s, built %s)\n", NMT_VERSION, NMT_COMMIT, __DATE__);
  printf("device libraries: %s\n", dev);
  return 0;
}

int main(int argc, char **argv) {
  nmt_log_errors_once(1);
  if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
    fputs(nmt__cli_usage, argc < 2 ? stderr : stdout);
    return argc < 2 ? nmt_status_exit_code(NMT_ERR_USAGE) : 0;
  }
  if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-V")) return print_version();
  const char *cmd = argv[1];
  /* `config --help` is the key reference (with the command's usage above it); `config --dump
   * X --help` asks for that too. */
  if (has_help_flag(argc - 2, argv + 2)) {
    if (!strcmp(cmd, "config") && argc >= 4 && !strcmp(argv[2], "--help") &&
        !strcmp(argv[3], "--markdown"))
      return cmd_config(argc - 2, argv + 2);
    if (!strcmp(cmd, "bench") && argc >= 3 &&
        (!strcmp(argv[2], "allreduce") || !strcmp(argv[2], "scaling"))) {
      char name[32];
      snprintf(name, sizeof name, "bench %s", argv[2]);
      return print_help(name);
    }
    return print_help(cmd);
  }
  if (!strcmp(cmd, "train")) return cmd_train(argc - 2, argv + 2);
  if (!strcmp(cmd, "translate")) return cli_cmd_translate(argc - 2, argv + 2);
  if (!strcmp(cmd, "config")) return cmd_config(argc - 2, argv + 2);
  if (!strcmp(cmd, "shard")) return cmd_shard(argc - 2, argv + 2);
  if (!strcmp(cmd, "shard-info")) return cmd_shard_info(argc - 2, argv + 2);
  if (!strcmp(cmd, "eval")) return cmd_eval(argc - 2, argv + 2);
  if (!strcmp(cmd, "average")) return cmd_average(argc - 2, argv + 2);
  if (!strcmp(cmd, "export")) return cli_cmd_export(argc - 2, argv + 2);
  if (!strcmp(cmd, "bench")) return cmd_bench(argc - 2, argv + 2);
  char msg[300];
  snprintf(msg, sizeof msg, "unknown command \"%.200s\"", cmd);
  return cli_usage_error(msg);
}
