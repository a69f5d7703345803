/* main_help.c — the command line's texts: the usage summary and each command's --help (the
 * nmt binary's only; not in libnmt), printed from one table of its options per command. Split
 * from main.c, which holds the commands and their parsers. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "main_help.h"

const char nmt__cli_usage[] =
    "usage:\n"
    "  nmt train CONFIG [CONFIG ...] [section.key=value ...] [--resume | --overwrite]\n"
    "      several CONFIGs apply in order, a later file's keys replacing an earlier one's\n"
    "      (nmt train conf/bible-small.ini data/x/data.ini); overrides apply after them\n"
    "  nmt translate CKPT|CONFIG [CONFIG ...] [section.key=value ...] [--config CONFIG]\n"
    "                [--ckpt CKPT] [--input FILE] [--output FILE] [--ids] [--nbest K] [--scores]\n"
    "                [--ensemble CKPT...] [--weights W...]\n"
    "  nmt config --dump CONFIG [CONFIG ...] [section.key=value ...]\n"
    "  nmt config --help [--markdown]\n"
    "  nmt shard --vocab V SRC_IDS TGT_IDS OUT\n"
    "  nmt shard --spm MODEL [--drop-empty] [--max-ratio R] SRC_TEXT TGT_TEXT OUT\n"
    "  nmt shard-info SHARD [--vocab V]\n"
    "  nmt eval CKPT|CONFIG [CONFIG ...] [section.key=value ...] [--config CONFIG] [--ckpt CKPT]\n"
    "           [--split valid|test | --shard FILE] [--src TEXT --ref TEXT]\n"
    "  nmt average CKPT... --output OUT | nmt average --last K DIR --output OUT\n"
    "  nmt export CKPT OUT [CONFIG ...] [section.key=value ...]\n"
    "             [--format safetensors|ctranslate2] [--quantization Q] [--overwrite]\n"
    "  nmt bench allreduce [CONFIG ...] [section.key=value ...] [--max-bytes N] [--min-bytes N]\n"
    "                      [--warmup N] [--iters N] [--jsonl FILE]\n"
    "                      [--op allreduce|reduce_scatter|all_gather|all]\n"
    "      all_reduce_perf-style table of the communicator (parallel.devices ranks);\n"
    "      sizes 1K..512M (K/M/G suffixes), capped by --max-bytes and by memory\n"
    "  nmt bench scaling CONFIG [CONFIG ...] [section.key=value ...] [--busbw GB/s]\n"
    "                    [--latency-us X] [--preset rtx3090x4] [--mfu X] [--steps N] [--warmup N]\n"
    "                    [--max-tokens N] [--max-devices N] [--zero 0|1|2|all]\n"
    "                    [--nodes K] [--net-gbps X] [--net-latency-us X] [--mem-gb X]\n"
    "                    [--reserve-gb X] [--bucket MB|auto] [--jsonl FILE]\n"
    "      weak-scaling model of data parallelism from one measured device, ZeRO stages,\n"
    "      per-GPU memory, several nodes (docs/scaling.md)\n"
    "  nmt COMMAND --help   (one command in detail)     nmt --version\n"
    "Exit codes: 0 done, 1 internal, 2 config/usage, 3 data, 4 device/out of memory, 5 diverged,\n"
    "6 I/O, 7 checkpoint, 8 aborted, 9 missing dependency (named: what to install), 75 stopped\n"
    "with a checkpoint written.\n";

/* ---- each command: usage, what it does, its options, examples ----------------------------- */

static const nmt__cli_option train_opts[] = {
    {"--resume", NULL,
     "continue from run.out_dir's newest valid checkpoint (none: start fresh;\n"
     "only damaged ones: exit 7); also run.resume = true"},
    {"--overwrite", NULL,
     "discard a previous run in run.out_dir (its checkpoints and metrics);\n"
     "without --resume or --overwrite, a run.out_dir holding one is refused"},
    {NULL, NULL, NULL}};

/* translate, eval and export read a checkpoint (take_ckpt_arg in main.c). */
#define CKPT_ARGS_ABOUT                                                                        \
  "CKPT|CONFIG: a checkpoint (it carries its config and SentencePiece model) or a config (then\n" \
  "the checkpoint is run.out_dir/checkpoints/latest), told apart by the checkpoint's magic;\n"   \
  "--ckpt and --config name them too. Several CONFIGs apply in order, a later file's keys\n"     \
  "replacing an earlier one's. A config given with a checkpoint must describe the same model\n" \
  "(exit 7). Overrides section.key=value apply after either, in order.\n"
#define CKPT_OPT                                                                               \
  {"--ckpt", "CKPT",                                                                           \
   "checkpoint (default: CKPT; else, with CONFIG, its\n"                                      \
   "run.out_dir/checkpoints/latest)"}
#define CONFIG_OPT                                                                             \
  {"--config", "CONFIG",                                                                       \
   "config, in order with the other CONFIGs (may be repeated;\n"                              \
   "default: CONFIG, else the checkpoint's own)"}

static const nmt__cli_option translate_opts[] = {
    CKPT_OPT,
    CONFIG_OPT,
    {"--input", "FILE", "source text, one sentence per line (default: stdin)"},
    {"--output", "FILE", "translations (default: stdout)"},
    {"--ids", NULL, "read and write SentencePiece ids instead of text"},
    {"--nbest", "K",
     "the K best hypotheses per line, best first, as \"i ||| hyp ||| F0= logp ||| score\"\n"
     "(i the 0-based input line; logp = log p(y|x) in nats; score = logp / lp(|y|), the\n"
     "ranking; 1 <= K <= decode.beam)"},
    {"--scores", NULL, "\" ||| F0= logp ||| score\" after each translation"},
    {"--ensemble", "CKPT...",
     "decode with these checkpoints together (after CKPT if one is given):\n"
     "each step ranks by the weighted mean of the models' log-probabilities\n"
     "(Marian's --models); [decode] and [data] are the first model's; all share\n"
     "one vocabulary and SentencePiece model (exit 7 otherwise)"},
    {"--weights", "W...",
     "one positive weight per model, in order (default: equal); normalised\n"
     "to sum to 1, so logp stays a log-probability"},
    {NULL, NULL, NULL}};

static const nmt__cli_option eval_opts[] = {
    CKPT_OPT,
    CONFIG_OPT,
    {"--split", "valid|test", "the shard of [data] valid or [data] test (default: valid)"},
    {"--shard", "FILE", "another shard (not with --split)"},
    {"--src", "TEXT", "source text, one sentence per line (with --ref)"},
    {"--ref", "TEXT", "reference text, one sentence per line (with --src)"},
    {NULL, NULL, NULL}};

static const nmt__cli_option average_opts[] = {
    {"--output", "OUT", "the averaged checkpoint (parameters only; not one of the inputs)"},
    {"--last", "K DIR", "the last K valid checkpoints of the checkpoint directory DIR"},
    {NULL, NULL, NULL}};

static const nmt__cli_option export_opts[] = {
    CONFIG_OPT,
    {"--format", "safetensors|ctranslate2",
     "OUT as a safetensors file (default) or as a\n"
     "CTranslate2 model directory (tools/nmt_to_ct2.py run\n"
     "by $NMT_PYTHON, default python3; exit 9 without them)"},
    {"--quantization", "Q",
     "ctranslate2 only: the weight type, one of int8,\n"
     "int8_float32, int8_float16, int8_bfloat16, int16,\n"
     "float16, bfloat16, float32 (default: fp32 as trained)"},
    {"--overwrite", NULL,
     "ctranslate2 only: replace an OUT a previous export\n"
     "wrote (without it an existing OUT is refused, exit 2)"},
    {NULL, NULL, NULL}};

static const nmt__cli_option config_opts[] = {
    {"--dump", "CONFIG...",
     "the effective configuration of the CONFIGs (in order, a later file's keys\n"
     "replacing an earlier one's) and the overrides: every key, defaults applied,\n"
     "with its doc; the output loads again as the CONFIG of any command"},
    {"--help", NULL, "every key: type, default, range, doc"},
    {"--markdown", NULL, "with --help: as Markdown (docs/config.md)"},
    {NULL, NULL, NULL}};

static const nmt__cli_option shard_opts[] = {
    {"--vocab", "V", "ids must be < V (from files of ids)"},
    {"--spm", "MODEL", "encode text files with the SentencePiece model MODEL"},
    {"--drop-empty", NULL, "with --spm: leave out pairs with an empty side"},
    {"--max-ratio", "R",
     "with --spm: leave out pairs whose one side has more than R (>= 1) times\n"
     "the pieces of the other"},
    {NULL, NULL, NULL}};

static const nmt__cli_option shard_info_opts[] = {
    {"--vocab", "V", "also check that every id is < V"},
    {NULL, NULL, NULL}};

static const nmt__cli_option no_opts[] = {{NULL, NULL, NULL}};

static const nmt__cli_option bench_allreduce_opts[] = {
    {"--max-bytes", "N", "largest size (default 512M; K/M/G suffixes; capped by memory)"},
    {"--min-bytes", "N", "smallest size (default 1K)"},
    {"--warmup", "N", "untimed iterations per size (default 5)"},
    {"--iters", "N", "timed iterations per size (default 20)"},
    {"--op", "OP", "allreduce (default), reduce_scatter, all_gather, or all three"},
    {"--jsonl", "FILE", "append one JSON row per size"},
    {NULL, NULL, NULL}};

static const nmt__cli_option bench_scaling_opts[] = {
    {"--preset", "rtx3090x4", "rescale compute to 4x RTX 3090 and use its link figures"},
    {"--busbw", "GB/s",
     "declare the link's bus bandwidth (default: the preset's, else measured\n"
     "on the host communicator)"},
    {"--latency-us", "X", "declare the link's latency per step (default: as --busbw)"},
    {"--mfu", "X", "the preset GPU's model FLOPs utilisation (default: its assumption)"},
    {"--steps", "N", "timed steps (default: 5 on a GPU, 2 on the CPU reference)"},
    {"--warmup", "N", "warmup steps (default: 2 on a GPU, 1 on the CPU reference)"},
    {"--max-tokens", "N",
     "measure micro-batches of at most N padded tokens, one per step,\n"
     "and extrapolate to the config's batch linearly in FLOPs (default\n"
     "0: 1024 on the CPU reference, the config's batch on a GPU; -1: the\n"
     "config's batch everywhere)"},
    {"--max-devices", "N", "predict N = 1..N (default 8)"},
    {"--zero", "0|1|2|all", "ZeRO stage 0, 1, 2, or all three (default parallel.zero)"},
    {"--nodes", "K",
     "also predict 1..K nodes (2..16) of the preset's GPUs (or\n"
     "parallel.devices) on a network of --net-gbps per node"},
    {"--net-gbps", "X", "the network's Gb/s per node (default 100)"},
    {"--net-latency-us", "X", "the network's latency per ring step (default NCCL's)"},
    {"--mem-gb", "X", "device memory per GPU in GiB (default: the preset's)"},
    {"--reserve-gb", "X", "memory kept from nmt's buffers: CUDA context, NCCL (default 1)"},
    {"--bucket", "MB|auto",
     "parallel.bucket_mb (auto: also the sizes a run's auto chooses\n"
     "among; docs/scaling.md \"bucket_mb = auto\")"},
    {"--jsonl", "FILE", "append the table's rows as JSON lines"},
    {NULL, NULL, NULL}};

static const nmt__cli_command commands[] = {
    {"train",
     "usage: nmt train CONFIG [CONFIG ...] [section.key=value ...] [--resume | --overwrite]\n",
     "Trains the model CONFIG describes (every key: nmt config --help, docs/config.md).\n"
     "Several CONFIGs apply in order, a later file's keys replacing an earlier one's (a model\n"
     "config, then a corpus's data.ini from tools/prepare-data.sh); overrides\n"
     "section.key=value apply after the files, in order.\n",
     train_opts,
     "Writes run.out_dir/: config.ini (the merged config: it alone resumes the run),\n"
     "metrics.jsonl, status.json, checkpoints/step_N.ckpt and checkpoints/latest.\n"
     "SIGINT/SIGTERM/SIGUSR1: finish the step, write a checkpoint, exit 75.\n"
     "  nmt train conf/bible-small.ini train.max_steps=2000 parallel.devices=2\n"
     "  nmt train conf/bible-small.ini data/wmt14/data.ini run.out_dir=runs/wmt14\n"},
    {"translate",
     "usage: nmt translate CKPT|CONFIG [CONFIG ...] [section.key=value ...] [--config CONFIG]\n"
     "                     [--ckpt CKPT] [--input FILE] [--output FILE] [--ids] [--nbest K]\n"
     "                     [--scores] [--ensemble CKPT...] [--weights W...]\n",
     "Translates one sentence per line (beam decode.beam; 1 = greedy), as it arrives.\n"
     CKPT_ARGS_ABOUT,
     translate_opts,
     "  nmt translate runs/bible-small/checkpoints/step_480.ckpt --input data/bible/test.en\n"
     "  nmt translate conf/bible-small.ini --input data/bible/test.en --output hyp.es\n"
     "  nmt translate --ensemble runs/a/checkpoints/step_480.ckpt \\\n"
     "                runs/b/checkpoints/step_480.ckpt --input data/bible/test.en\n"},
    {"eval",
     "usage: nmt eval CKPT|CONFIG [CONFIG ...] [section.key=value ...] [--config CONFIG]\n"
     "                [--ckpt CKPT] [--split valid|test | --shard FILE] [--src TEXT --ref TEXT]\n",
     "Loss, per-token NLL and perplexity on a shard; BLEU and chrF (sacreBLEU) of the\n"
     "translations of --src against --ref (with --split, of the split's raw text).\n"
     "Writes run.out_dir/eval/eval.jsonl.\n" CKPT_ARGS_ABOUT,
     eval_opts,
     "  nmt eval conf/bible-small.ini --split test\n"
     "  nmt eval runs/bible-small/checkpoints/step_480.ckpt --split test\n"},
    {"average",
     "usage: nmt average CKPT... --output OUT\n"
     "       nmt average --last K DIR --output OUT\n",
     "Averages the parameters of checkpoints of one model (e.g. the last K of a run, as the\n"
     "paper's base models average the last 5); a warning says when DIR holds fewer than K.\n",
     average_opts,
     "  nmt average --last 5 runs/bible-small/checkpoints --output avg.ckpt\n"},
    {"export",
     "usage: nmt export CKPT OUT [CONFIG ... | --config CONFIG] [section.key=value ...]\n"
     "                  [--format safetensors|ctranslate2] [--quantization Q] [--overwrite]\n",
     "Writes the parameters as safetensors (tools/load_pytorch.py reads them into PyTorch),\n"
     "or as a CTranslate2 model directory with the SentencePiece model beside it (spm.model;\n"
     "docs/formats.md \"CTranslate2 export\"); without CONFIG or overrides, with the\n"
     "checkpoint's own config.\n",
     export_opts,
     "  nmt export avg.ckpt model.safetensors conf/bible-small.ini\n"
     "  nmt export avg.ckpt ct2-model --format ctranslate2 --quantization int8\n"},
    {"config",
     "usage: nmt config --dump CONFIG [CONFIG ...] [section.key=value ...]\n"
     "       nmt config --help [--markdown]\n",
     NULL, config_opts, NULL},
    {"shard",
     "usage: nmt shard --vocab V SRC_IDS TGT_IDS OUT\n"
     "       nmt shard --spm MODEL [--drop-empty] [--max-ratio R] SRC_TEXT TGT_TEXT OUT\n",
     "Writes a binary shard (docs/formats.md) from two aligned files of space-separated ids,\n"
     "one sentence per line; ids must be < V. With --spm, from two aligned text files encoded\n"
     "with the SentencePiece model MODEL (its hash recorded, so that train can check\n"
     "data.spm_model); the cleaning is Moses' clean-corpus-n's, on pieces, and it prints the\n"
     "counts. tools/prepare-data.sh calls it.\n",
     shard_opts, NULL},
    {"shard-info", "usage: nmt shard-info SHARD [--vocab V]\n",
     "Validates a shard (and its vocabulary, with --vocab) and prints its pair and id counts,\n"
     "and its checksums (version 2 shards; version 1 has none), which it verified.\n",
     shard_info_opts, NULL},
    {"bench", "usage: nmt bench allreduce ... | nmt bench scaling ...\n",
     "  allreduce   all_reduce_perf-style busbw table of the communicator\n"
     "  scaling     weak-scaling model of data parallelism from one measured device\n"
     "nmt bench allreduce --help, nmt bench scaling --help: their options.\n",
     no_opts, NULL},
    {"bench allreduce",
     "usage: nmt bench allreduce [CONFIG ...] [section.key=value ...] [--max-bytes N]\n"
     "                           [--min-bytes N] [--warmup N] [--iters N] [--jsonl FILE]\n"
     "                           [--op allreduce|reduce_scatter|all_gather|all]\n",
     "All-reduce of sizes 1K..512M (K/M/G suffixes) over parallel.devices ranks of\n"
     "parallel.device, in parallel.grad_dtype; columns as nccl-tests (time, algbw, busbw,\n"
     "#wrong).\n",
     bench_allreduce_opts, "  nmt bench allreduce conf/bible-small.ini parallel.devices=2\n"},
    {"bench scaling",
     "usage: nmt bench scaling CONFIG [CONFIG ...] [section.key=value ...] [--busbw GB/s]\n"
     "                         [--latency-us X] [--preset rtx3090x4] [--mfu X] [--steps N]\n"
     "                         [--warmup N] [--max-tokens N] [--max-devices N]\n"
     "                         [--zero 0|1|2|all]\n"
     "                         [--nodes K] [--net-gbps X] [--net-latency-us X] [--mem-gb X]\n"
     "                         [--reserve-gb X] [--bucket MB|auto] [--jsonl FILE]\n",
     "Measures ONE device training CONFIG's model, then predicts the step time of N devices\n"
     "with bucketed all-reduce overlapped with backward, ZeRO's collectives, the per-GPU\n"
     "memory and the largest data.max_tokens that fits (docs/scaling.md). Progress on stderr.\n",
     bench_scaling_opts,
     "  nmt bench scaling conf/base.ini --preset rtx3090x4 --zero all --nodes 4\n"},
};

const nmt__cli_command *nmt__cli_command_find(const char *name) {
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (!strcmp(commands[i].name, name)) return &commands[i];
  return NULL;
}

int nmt__cli_help_print(FILE *out, const char *name) {
  const nmt__cli_command *c = nmt__cli_command_find(name);
  if (!c) return -1;
  fputs(c->usage, out);
  if (c->about) fputs(c->about, out);
  int width = 0;
  for (const nmt__cli_option *o = c->options; o->flag; o++) {
    int w = (int)strlen(o->flag) + (o->value ? 1 + (int)strlen(o->value) : 0);
    if (w > width) width = w;
  }
  for (const nmt__cli_option *o = c->options; o->flag; o++) {
    char head[128];
    snprintf(head, sizeof head, "%s%s%s", o->flag, o->value ? " " : "", o->value ? o->value : "");
    /* The help's lines, the first after the flag, the others under it. */
    const char *line = o->help;
    for (int first = 1; line; first = 0) {
      const char *nl = strchr(line, '\n');
      int n = nl ? (int)(nl - line) : (int)strlen(line);
      fprintf(out, "  %-*s  %.*s\n", width, first ? head : "", n, line);
      line = nl ? nl + 1 : NULL;
    }
  }
  if (c->after) fputs(c->after, out);
  return 0;
}
