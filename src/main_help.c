/* main_help.c — the command line's texts: the usage summary and each command's --help (the
 * nmt binary's only; not in libnmt). Split from main.c, which holds the commands. */
#include <stddef.h>
#include <string.h>

#include "main_help.h"

const char nmt__cli_usage[] =
    "usage:\n"
    "  nmt train CONFIG [section.key=value ...] [--resume | --overwrite]\n"
    "  nmt translate CKPT|CONFIG [section.key=value ...] [--config CONFIG] [--ckpt CKPT]\n"
    "                [--input FILE] [--output FILE] [--ids] [--nbest K] [--scores]\n"
    "  nmt config --dump CONFIG [section.key=value ...]\n"
    "  nmt config --help [--markdown]\n"
    "  nmt shard --vocab V SRC_IDS TGT_IDS OUT\n"
    "  nmt shard-info SHARD [--vocab V]\n"
    "  nmt eval CKPT|CONFIG [section.key=value ...] [--config CONFIG] [--ckpt CKPT]\n"
    "           [--split valid|test | --shard FILE] [--src TEXT --ref TEXT]\n"
    "  nmt average CKPT... --output OUT | nmt average --last K DIR --output OUT\n"
    "  nmt export CKPT OUT.safetensors [CONFIG] [section.key=value ...]\n"
    "  nmt bench allreduce [CONFIG] [section.key=value ...] [--max-bytes N] [--min-bytes N]\n"
    "                      [--warmup N] [--iters N] [--jsonl FILE]\n"
    "                      [--op allreduce|reduce_scatter|all_gather|all]\n"
    "      all_reduce_perf-style table of the communicator (parallel.devices ranks);\n"
    "      sizes 1K..512M (K/M/G suffixes), capped by --max-bytes and by memory\n"
    "  nmt bench scaling CONFIG [section.key=value ...] [--busbw GB/s] [--latency-us X]\n"
    "                    [--preset rtx3090x4] [--mfu X] [--steps N] [--warmup N]\n"
    "                    [--max-tokens N] [--max-devices N] [--zero 0|1|2|all]\n"
    "                    [--nodes K] [--net-gbps X] [--net-latency-us X] [--mem-gb X]\n"
    "                    [--reserve-gb X] [--jsonl FILE]\n"
    "      weak-scaling model of data parallelism from one measured device, ZeRO stages,\n"
    "      per-GPU memory, several nodes (docs/scaling.md)\n"
    "  nmt COMMAND --help   (one command in detail)     nmt --version\n"
    "Exit codes: 0 done, 1 internal, 2 config/usage, 3 data, 4 device/out of memory, 5 diverged,\n"
    "6 I/O, 7 checkpoint, 8 aborted, 75 stopped with a checkpoint written.\n";

typedef struct {
  const char *name;
  const char *help;
} command_help;

static const command_help helps[] = {
    {"train",
     "usage: nmt train CONFIG [section.key=value ...] [--resume | --overwrite]\n"
     "Trains the model CONFIG describes (every key: nmt config --help, docs/config.md);\n"
     "overrides section.key=value apply after the file, in order.\n"
     "  --resume   continue from run.out_dir's newest valid checkpoint (none: start fresh;\n"
     "             only damaged ones: exit 7); also run.resume = true\n"
     "  --overwrite  discard a previous run in run.out_dir (its checkpoints and metrics);\n"
     "             without --resume or --overwrite, a run.out_dir holding one is refused\n"
     "Writes run.out_dir/: config.ini, metrics.jsonl, status.json, checkpoints/step_N.ckpt and\n"
     "checkpoints/latest. SIGINT/SIGTERM/SIGUSR1: finish the step, write a checkpoint, exit 75.\n"
     "  nmt train conf/bible-small.ini train.max_steps=2000 parallel.devices=2\n"},
    {"translate",
     "usage: nmt translate CONFIG [section.key=value ...] [--ckpt PATH] [--input FILE]\n"
     "                     [--output FILE] [--ids] [--nbest K] [--scores]\n"
     "Translates one sentence per line (beam decode.beam; 1 = greedy).\n"
     "  --ckpt PATH     checkpoint (default: run.out_dir/checkpoints/latest)\n"
     "  --input FILE    source text, one sentence per line (default: stdin)\n"
     "  --output FILE   translations (default: stdout)\n"
     "  --ids           read and write SentencePiece ids instead of text\n"
     "  --nbest K       K lines per input, best first: \"i ||| hyp ||| F0= logp ||| score\"\n"
     "                  (logp = log p(y|x) in nats; score = logp / lp(|y|), the ranking)\n"
     "  --scores        \" ||| F0= logp ||| score\" after each translation\n"
     "  nmt translate conf/bible-small.ini --input data/bible/test.en --output hyp.es\n"},
    {"eval",
     "usage: nmt eval CONFIG [section.key=value ...] [--ckpt PATH]\n"
     "                [--split valid|test | --shard FILE] [--src TEXT --ref TEXT]\n"
     "Loss, per-token NLL and perplexity on a shard; BLEU and chrF (sacreBLEU) of the\n"
     "translations of --src against --ref. Writes run.out_dir/eval/eval.jsonl.\n"
     "  --ckpt PATH         checkpoint (default: run.out_dir/checkpoints/latest)\n"
     "  --split valid|test  the shard of [data] valid or [data] test (default: valid)\n"
     "  --shard FILE        another shard\n"
     "  --src TEXT --ref TEXT   source and reference text, one sentence per line\n"
     "  nmt eval conf/bible-small.ini --split test\n"},
    {"average",
     "usage: nmt average CKPT... --output OUT\n"
     "       nmt average --last K DIR --output OUT\n"
     "Averages the parameters of checkpoints of one model (e.g. the last K of a run, as the\n"
     "paper's base models average the last 5); a warning says when DIR holds fewer than K.\n"
     "  nmt average --last 5 runs/bible-small/checkpoints --output avg.ckpt\n"},
    {"export",
     "usage: nmt export CKPT OUT.safetensors [CONFIG [section.key=value ...]]\n"
     "Writes the parameters as safetensors (tools/load_pytorch.py reads them into PyTorch).\n"
     "  nmt export avg.ckpt model.safetensors conf/bible-small.ini\n"},
    {"config",
     "usage: nmt config --dump CONFIG [section.key=value ...]\n"
     "       nmt config --help [--markdown]\n"
     "  --dump   the effective configuration: every key, defaults applied, with its doc; the\n"
     "           output loads again as the CONFIG of any command\n"
     "  --help   every key: type, default, range, doc (--markdown: docs/config.md)\n"},
    {"shard",
     "usage: nmt shard --vocab V SRC_IDS TGT_IDS OUT\n"
     "       nmt shard --spm MODEL [--drop-empty] [--max-ratio R] SRC_TEXT TGT_TEXT OUT\n"
     "Writes a binary shard (docs/formats.md) from two aligned files of space-separated ids,\n"
     "one sentence per line; ids must be < V. With --spm, from two aligned text files encoded\n"
     "with the SentencePiece model MODEL (its hash recorded, so that train can check\n"
     "data.spm_model); --drop-empty leaves out pairs with an empty side, --max-ratio R those\n"
     "whose one side has more than R times the pieces of the other (Moses' clean-corpus-n;\n"
     "it prints the counts). tools/prepare-data.sh calls it.\n"},
    {"shard-info",
     "usage: nmt shard-info SHARD [--vocab V]\n"
     "Validates a shard (and its vocabulary, with --vocab) and prints its pair and id counts.\n"},
    {"bench",
     "usage: nmt bench allreduce ... | nmt bench scaling ...\n"
     "  allreduce   all_reduce_perf-style busbw table of the communicator\n"
     "  scaling     weak-scaling model of data parallelism from one measured device\n"
     "nmt bench allreduce --help, nmt bench scaling --help: their options.\n"},
    {"bench allreduce",
     "usage: nmt bench allreduce [CONFIG] [section.key=value ...] [--max-bytes N]\n"
     "                           [--min-bytes N] [--warmup N] [--iters N] [--jsonl FILE]\n"
     "All-reduce of sizes 1K..512M (K/M/G suffixes) over parallel.devices ranks of\n"
     "parallel.device, in parallel.grad_dtype; columns as nccl-tests (time, algbw, busbw,\n"
     "#wrong); --jsonl appends one JSON row per size.\n"
     "  nmt bench allreduce conf/bible-small.ini parallel.devices=2\n"},
    {"bench scaling",
     "usage: nmt bench scaling CONFIG [section.key=value ...] [--busbw GB/s] [--latency-us X]\n"
     "                         [--preset rtx3090x4] [--mfu X] [--steps N] [--warmup N]\n"
     "                         [--max-tokens N] [--max-devices N] [--zero 0|1|2|all]\n"
     "                         [--nodes K] [--net-gbps X] [--net-latency-us X] [--mem-gb X]\n"
     "                         [--reserve-gb X] [--bucket MB|auto] [--jsonl FILE]\n"
     "Measures ONE device training CONFIG's model, then predicts the step time of N devices\n"
     "with bucketed all-reduce overlapped with backward, ZeRO's collectives, the per-GPU\n"
     "memory and the largest data.max_tokens that fits (docs/scaling.md). Progress on stderr.\n"
     "  --preset rtx3090x4   rescale compute to 4x RTX 3090 and use its link figures\n"
     "  --busbw, --latency-us  declare the link (default: the preset's, else measured on the\n"
     "                       host communicator)\n"
     "  --mfu X              the preset GPU's model FLOPs utilisation (default: its assumption)\n"
     "  --steps N, --warmup N  timed and warmup steps (default: 5 and 2 on a GPU, 2 and 1 on\n"
     "                       the CPU reference)\n"
     "  --max-tokens N       measure micro-batches of at most N padded tokens, one per step,\n"
     "                       and extrapolate to the config's batch linearly in FLOPs (default\n"
     "                       0: 1024 on the CPU reference, the config's batch on a GPU; -1: the\n"
     "                       config's batch everywhere)\n"
     "  --max-devices N      predict N = 1..N (default 8)\n"
     "  --zero S             ZeRO stage 0, 1, 2, or all three (default parallel.zero)\n"
     "  --nodes K            also predict 1..K nodes (2..16) of the preset's GPUs (or\n"
     "                       parallel.devices) on a network of --net-gbps Gb/s per node\n"
     "                       (default 100) and --net-latency-us per ring step (default NCCL's)\n"
     "  --mem-gb X           device memory per GPU in GiB (default: the preset's)\n"
     "  --reserve-gb X       memory kept from nmt's buffers: CUDA context, NCCL (default 1)\n"
     "  --bucket MB|auto     parallel.bucket_mb (auto: also the sizes a run's auto chooses\n"
     "                       among; docs/scaling.md \"bucket_mb = auto\")\n"
     "  nmt bench scaling conf/base.ini --preset rtx3090x4 --zero all --nodes 4\n"},
};

const char *nmt__cli_help(const char *name) {
  for (size_t i = 0; i < sizeof helps / sizeof helps[0]; i++)
    if (!strcmp(helps[i].name, name)) return helps[i].help;
  return NULL;
}
