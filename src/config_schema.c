/* config_schema.c — the config schema: one row per key (section, key, type, default, range,
 * doc), which config.c turns into defaults, parsing, validation and the dump of the effective
 * config, and config_help.c into --help text and docs/config.md. Adding a key is adding a
 * field to nmt_config (include/nmt/config.h) and a row here.
 */
#include "nmt/config.h"

#include <stddef.h>
#include <stdint.h>

#include "config_impl.h"

static const char *const device_names[] = {"cpu", "cuda", "auto", NULL};
static const char *const comm_names[] = {"auto", "nccl", "host", NULL};
static const char *const norm_names[] = {"post", "pre", NULL};
const char *const nmt__config_precision_names[] = {"fp32", "tf32", "fp16", "bf16", NULL};
static const char *const grad_dtype_names[] = {"fp32", "fp16", "bf16", NULL};
static const char *const qkv_names[] = {"fused", "streams", NULL};
static const char *const act_names[] = {"half", "fp32", NULL};
static const char *const attn_kernel_names[] = {"unfused", "fused", NULL};
static const char *const beam_rule_names[] = {"shrink", "full", NULL};
static const char *const metric_names[] = {"valid_loss", "valid_bleu", "valid_ppl", NULL};

const char *nmt_valid_metric_name(nmt_valid_metric m) {
  return (unsigned)m <= NMT_METRIC_VALID_PPL ? metric_names[m] : "?";
}

const char *nmt_beam_rule_name(nmt_beam_rule r) {
  return (unsigned)r <= NMT_BEAM_FULL ? beam_rule_names[r] : "?";
}

_Static_assert(NMT_DEVICE_CPU == 0 && NMT_DEVICE_CUDA == 1 && NMT_DEVICE_AUTO == 2,
               "device_names is indexed by nmt_device_kind");
_Static_assert(NMT_COMM_AUTO == 0 && NMT_COMM_NCCL == 1 && NMT_COMM_HOST == 2,
               "comm_names is indexed by nmt_comm_kind");
_Static_assert(NMT_NORM_POST == 0 && NMT_NORM_PRE == 1, "norm_names is indexed by nmt_norm_kind");
_Static_assert(NMT_PRECISION_FP32 == 0 && NMT_PRECISION_TF32 == 1 && NMT_PRECISION_FP16 == 2 &&
                   NMT_PRECISION_BF16 == 3,
               "nmt__config_precision_names is indexed by nmt_precision");
_Static_assert(NMT_GRAD_FP32 == 0 && NMT_GRAD_FP16 == 1 && NMT_GRAD_BF16 == 2,
               "grad_dtype_names is indexed by nmt_grad_dtype");
_Static_assert(NMT_QKV_FUSED == 0 && NMT_QKV_STREAMS == 1, "qkv_names is indexed by nmt_qkv_mode");
_Static_assert(NMT_ACT_HALF == 0 && NMT_ACT_FP32 == 1, "act_names is indexed by nmt_act_storage");
_Static_assert(NMT_ATTN_UNFUSED == 0 && NMT_ATTN_FUSED == 1,
               "attn_kernel_names is indexed by nmt_attn_kernel");
_Static_assert(NMT_BEAM_SHRINK == 0 && NMT_BEAM_FULL == 1,
               "beam_rule_names is indexed by nmt_beam_rule");
_Static_assert(NMT_METRIC_VALID_LOSS == 0 && NMT_METRIC_VALID_BLEU == 1 &&
                   NMT_METRIC_VALID_PPL == 2,
               "metric_names is indexed by nmt_valid_metric");
_Static_assert(sizeof(nmt_device_kind) == sizeof(int) && sizeof(nmt_norm_kind) == sizeof(int) &&
                   sizeof(nmt_comm_kind) == sizeof(int) &&
                   sizeof(nmt_precision) == sizeof(int) && sizeof(nmt_grad_dtype) == sizeof(int) &&
                   sizeof(nmt_qkv_mode) == sizeof(int) && sizeof(nmt_valid_metric) == sizeof(int) &&
                   sizeof(nmt_beam_rule) == sizeof(int) &&
                   sizeof(nmt_attn_kernel) == sizeof(int),
               "enum fields are read and written as int");

/* offsetof that also fails to compile when the field does not have type T, so a schema row
 * cannot write an int into a float field. */
#define TYPED_OFFSET(field, T)     \
  (offsetof(nmt_config, field) +   \
   0 * sizeof(char[_Generic(((nmt_config *)0)->field, T: 1, default: -1)]))

#define K_INT(sec, key, field, def, lo, hi, doc) \
  {sec, key, T_INT, TYPED_OFFSET(field, int), def, lo, hi, 0, 0, 0, 0, NULL, doc, 0}
#define K_LONG(sec, key, field, def, lo, hi, doc) \
  {sec, key, T_LONG, TYPED_OFFSET(field, long), def, lo, hi, 0, 0, 0, 0, NULL, doc, 0}
#define K_U64(sec, key, field, def, doc) \
  {sec, key, T_U64, TYPED_OFFSET(field, uint64_t), def, 0, 0, 0, 0, 0, 0, NULL, doc, 0}
/* lo_open/hi_open: 1 excludes that end of the range. */
#define K_FLOAT(sec, key, field, def, lo, lo_open, hi, hi_open, doc) \
  {sec, key, T_FLOAT, TYPED_OFFSET(field, float), def, 0, 0, lo, hi, lo_open, hi_open, NULL, doc, 0}
/* A float key that also takes "auto" (stored as 0, which its range must exclude). */
#define K_FLOAT_AUTO(sec, key, field, def, hi, doc) \
  {sec, key, T_FLOAT, TYPED_OFFSET(field, float), def, 0, 0, 0.0, hi, 1, 0, NULL, doc, 1}
#define K_BOOL(sec, key, field, def, doc) \
  {sec, key, T_BOOL, TYPED_OFFSET(field, int), def, 0, 0, 0, 0, 0, 0, NULL, doc, 0}
#define K_STRING(sec, key, field, def, doc) \
  {sec, key, T_STRING, TYPED_OFFSET(field, char *), def, 0, 0, 0, 0, 0, 0, NULL, doc, 0}
/* parallel.devices: a count ("4": the first 4 visible devices) or a list of device indices
 * ("0,2", "[3]"), stored as parallel_devices (count) + parallel_device_ids. */
#define K_DEVICES(sec, key, field, def, doc) \
  {sec, key, T_DEVICES, TYPED_OFFSET(field, int), def, 1, 1024, 0, 0, 0, 0, NULL, doc, 0}
#define K_ENUM(sec, key, field, enum_t, def, names, doc) \
  {sec, key, T_ENUM, TYPED_OFFSET(field, enum_t), def, 0, 0, 0, 0, 0, 0, names, doc, 0}

#define BILLION 1000000000LL

/* Schema order = struct order = dump order = docs order. Defaults are the paper's base model
 * (Vaswani et al. 2017, Table 3) where the paper has one. Docs must not contain newlines. */
const key_spec nmt__config_schema[] = {
    /* [run] */
    K_STRING("run", "out_dir", run_out_dir, "runs/default",
             "Run directory; the trainer writes config.ini (the effective config), "
             "metrics.jsonl, status.json and checkpoints/ there. Each {job} in it becomes "
             "$SLURM_JOB_ID (\"local\" outside Slurm), so a requeued job resumes its own run."),
    K_U64("run", "seed", run_seed, "1",
          "Seeds parameter init, dropout masks (counter-based RNG) and the per-epoch batch "
          "shuffle; equal seeds and configs give equal runs."),
    K_BOOL("run", "resume", run_resume, "false",
           "Continue from run.out_dir/checkpoints/latest (weights, optimizer state, step, data "
           "position) instead of starting fresh. If data.train's contents, data.max_tokens, "
           "data.max_len or run.seed changed since, training continues at the start of a new "
           "epoch (a warning names the keys)."),
    K_BOOL("run", "tensorboard", run_tensorboard, "true",
           "Also write the metrics.jsonl records as TensorBoard scalars (train/loss, train/ppl, "
           "train/lr, train/grad_norm, train/loss_scale, train/tgt_tokens_per_s, train/mfu, "
           "valid/loss, valid/ppl, valid/bleu, valid/chrf, ...) to event files in "
           "run.out_dir/tb/, flushed at each log line: `tensorboard --logdir runs/` shows the "
           "runs live, side by side. A resume adds a file there; a fresh start deletes the old ones."),

    /* [data] */
    K_STRING("data", "train", data_train, "",
             "Training shard written by tools/prepare-data.sh (docs/formats.md). The trainer "
             "requires it; other commands do not."),
    K_STRING("data", "valid", data_valid, "",
             "Validation shard (same format); empty = no validation loss or BLEU during "
             "training."),
    K_STRING("data", "test", data_test, "",
             "Test shard (same format) that `nmt eval --split test` reads; empty = none."),
    K_STRING("data", "spm_model", data_spm_model, "",
             "SentencePiece model used to encode raw text for `nmt translate` and to decode "
             "ids back to text; `nmt train` checks at start that it loads, has model.vocab "
             "pieces and is the model the shards' ids were made with (their recorded hash)."),
    K_INT("data", "max_tokens", data_max_tokens, "4096", 1, 1LL << 30,
          "Micro-batch size per device in padded tokens: sentences x longest side. Tokens per "
          "optimizer step = max_tokens x parallel.devices x train.accum_steps (paper: ~25000 "
          "source + ~25000 target, §5.1)."),
    K_INT("data", "max_len", data_max_len, "256", 1, 1 << 20,
          "Training pairs with a side longer than this many ids (EOS included) are dropped."),
    K_INT("data", "loader_threads", data_loader_threads, "1", 1, 64,
          "Threads that form batches and feed the per-worker rings; at most one per worker "
          "(parallel.devices) and at most $SLURM_CPUS_PER_TASK when set."),

    /* [model] */
    K_INT("model", "vocab", model_vocab, "8000", NMT_EOS_ID + 2, 1 << 24,
          "Shared source/target vocabulary size; must equal the shard's (ids 0-3 are pad, unk, "
          "bos, eos). Embeddings and the output projection are tied (§3.4)."),
    K_INT("model", "d_model", model_d_model, "512", 2, 1 << 16,
          "Model width d_model (§3, Table 3: base 512, big 1024); must be even (sinusoidal "
          "positions pair sin and cos, §3.5) and divisible by model.n_heads."),
    K_INT("model", "n_heads", model_n_heads, "8", 1, 1024,
          "Attention heads h (§3.2.2); each head has d_k = d_v = d_model / h."),
    K_INT("model", "d_ff", model_d_ff, "2048", 1, 1 << 20,
          "Inner width of the position-wise feed-forward network (§3.3)."),
    K_INT("model", "enc_layers", model_enc_layers, "6", 1, 256, "Encoder layers N (§3.1)."),
    K_INT("model", "dec_layers", model_dec_layers, "6", 1, 256, "Decoder layers N (§3.1)."),
    K_INT("model", "max_positions", model_max_positions, "1024", 1, 1 << 20,
          "Rows of the sinusoidal position table (§3.5); the longest sequence the model can "
          "encode or decode. Must be >= data.max_len."),
    K_FLOAT("model", "dropout", model_dropout, "0.1", 0.0, 0, 1.0, 1,
            "P_drop on every sublayer output before the residual add and on the embedding + "
            "position sums (§5.4)."),
    K_FLOAT("model", "attn_dropout", model_attn_dropout, "0.0", 0.0, 0, 1.0, 1,
            "Dropout on the attention weights (after softmax); not in the paper."),
    K_FLOAT("model", "relu_dropout", model_relu_dropout, "0.0", 0.0, 0, 1.0, 1,
            "Dropout on the feed-forward hidden activations (after ReLU); not in the paper."),
    K_ENUM("model", "norm", model_norm, nmt_norm_kind, "post", norm_names,
           "Where LayerNorm sits: post = LayerNorm(x + Sublayer(x)) as in the paper (§3.1); "
           "pre = x + Sublayer(LayerNorm(x)), with a final LayerNorm per stack."),
    K_FLOAT("model", "init_std", model_init_std, "0", 0.0, 0, 100.0, 0,
            "0 = Xavier-uniform for weight matrices and N(0, d_model^-0.5) for embeddings; "
            "> 0 = N(0, init_std) for both."),

    /* [train] */
    K_LONG("train", "max_steps", train_max_steps, "100000", 1, 1000 * BILLION,
           "Optimizer steps to train (paper: base 100k, big 300k, §5.2)."),
    K_INT("train", "log_every", train_log_every, "100", 1, BILLION,
          "Steps between metrics.jsonl records and progress lines."),
    K_INT("train", "valid_every", train_valid_every, "1000", 0, BILLION,
          "Steps between validation passes over data.valid (and at the run's last step, but not at "
          "a stop: a stop checkpoints at once); 0 = never."),
    K_BOOL("train", "valid_bleu", train_valid_bleu, "false",
           "Every validation also translates the valid split's raw source (docs/formats.md "
           "\"Data directory\": DIR/NAME.SRC next to data.valid, encoded with data.spm_model) "
           "with the [decode] settings and train.valid_beam, and scores it against the raw "
           "reference DIR/NAME.TGT with sacreBLEU (BLEU and chrF2 in metrics.jsonl). Global "
           "rank 0 decodes while the other ranks wait (across nodes with Gloo, at most "
           "parallel.timeout_s). Needs python3 with sacrebleu, checked when training starts."),
    K_INT("train", "valid_beam", train_valid_beam, "1", 0, 1024,
          "Beam size of validation BLEU's decoding: 1 = greedy (fast); 0 = decode.beam."),
    K_ENUM("train", "best_metric", train_best_metric, nmt_valid_metric, "valid_loss",
           metric_names,
           "The validation metric that checkpoints/best and train.patience follow: valid_loss "
           "(label-smoothed) or valid_ppl (exp of the unsmoothed NLL), lower is better; "
           "valid_bleu (needs train.valid_bleu = on), higher is better. A validation that "
           "improves it writes a checkpoint at its step and points checkpoints/best at it."),
    K_INT("train", "patience", train_patience, "0", 0, BILLION,
          "Early stopping: end the run (exit 0, with a final checkpoint) once this many "
          "validations in a row did not improve train.best_metric; 0 = off. Needs data.valid "
          "and train.valid_every > 0. The count survives --resume (it is in the checkpoints)."),
    K_INT("train", "save_every", train_save_every, "1000", 0, BILLION,
          "Steps between checkpoints; 0 = only at the end."),
    K_INT("train", "accum_steps", train_accum_steps, "1", 1, 65536,
          "Micro-batches accumulated per optimizer step (gradients are reduced once, on the "
          "last)."),
    K_FLOAT("train", "label_smoothing", train_label_smoothing, "0.1", 0.0, 0, 1.0, 1,
            "Label smoothing eps_ls (§5.4)."),
    K_FLOAT("train", "lr_scale", train_lr_scale, "1.0", 0.0, 1, 1000.0, 0,
            "Multiplies the paper's schedule: lr = lr_scale * d_model^-0.5 * min(step^-0.5, "
            "step * warmup_steps^-1.5) (eq. 3)."),
    K_INT("train", "warmup_steps", train_warmup_steps, "4000", 1, BILLION,
          "warmup_steps of eq. 3 (paper: 4000)."),
    K_FLOAT("train", "adam_beta1", train_adam_beta1, "0.9", 0.0, 0, 1.0, 1,
            "Adam beta1 (§5.3: 0.9)."),
    K_FLOAT("train", "adam_beta2", train_adam_beta2, "0.98", 0.0, 0, 1.0, 1,
            "Adam beta2 (§5.3: 0.98)."),
    K_FLOAT("train", "adam_eps", train_adam_eps, "1e-9", 0.0, 1, 1.0, 0,
            "Adam epsilon (§5.3: 1e-9)."),
    K_FLOAT("train", "weight_decay", train_weight_decay, "0", 0.0, 0, 100.0, 0,
            "Decoupled weight decay (AdamW); 0 = the paper's Adam."),
    K_FLOAT("train", "clip_norm", train_clip_norm, "0", 0.0, 0, 1e9, 0,
            "Clip the global gradient L2 norm to this value; 0 = no clipping (the paper does "
            "not clip)."),
    K_BOOL("train", "checkpoint_activations", train_checkpoint_activations, "false",
           "Activation checkpointing (Chen et al. 2016): keep only each encoder/decoder layer's "
           "input during the training forward and recompute the layer's activations in "
           "backward. Gradients are unchanged (bitwise); saved activations shrink to about one "
           "(tokens x d_model) tensor per layer, for one more forward per step."),

    /* [parallel] */
    K_ENUM("parallel", "device", parallel_device, nmt_device_kind, "auto", device_names,
           "cpu = reference backend on worker threads; cuda = GPUs; auto = cuda when a GPU is "
           "present, else cpu."),
    K_DEVICES("parallel", "devices", parallel_devices, "1",
              "Data-parallel workers: a count N (CPU threads, or the first N visible GPUs) or a "
              "list of GPU indices, e.g. 0,2 or [1] (indices among the GPUs CUDA_VISIBLE_DEVICES "
              "leaves visible; rank r uses the r-th; refused with CPU workers, which take a "
              "count). One host thread per worker. nmt translate "
              "decodes on that many devices at once, batches in turn (CPU: one core each)."),
    K_FLOAT_AUTO("parallel", "bucket_mb", parallel_bucket_mb, "25", 65536.0,
                 "Gradient bucket size in MiB; each bucket is all-reduced (reduce-scattered "
                 "with parallel.zero = 1) as soon as its gradients are final during backward. "
                 "auto: chosen at the start of the run from what its own devices measure (one "
                 "backward's grad-ready times, the communicator at a few message sizes) as the "
                 "size with the least predicted exposed communication, logged with the numbers "
                 "behind it and written to run.out_dir/config.ini and the checkpoints, so a "
                 "resume keeps it (docs/scaling.md, \"bucket_mb = auto\"). Not used with "
                 "parallel.zero = 2, whose buckets are the model's backward stages."),
    K_ENUM("parallel", "grad_dtype", parallel_grad_dtype, nmt_grad_dtype, "fp32",
           grad_dtype_names,
           "Element type of the gradient all-reduce: fp32; fp16 / bf16 halve the bytes on the "
           "wire (each bucket is cast before the reduce and back after; fp16 gradients carry "
           "the loss scale, so an overflow is caught as a skipped step; fp16 therefore needs "
           "precision.mode = fp16). The loss and token sums stay fp32. Ignored with one worker "
           "(nothing is reduced)."),
    K_ENUM("parallel", "qkv", parallel_qkv, nmt_qkv_mode, "fused", qkv_names,
           "Self-attention Q/K/V projections: fused = one (3 d_model x d_model) GEMM; streams = "
           "three d_model x d_model GEMMs on three streams joined by events (needs "
           "parallel.aux_streams >= 2; on CPU workers the three run in turn). Same parameters "
           "and checkpoints either way."),
    K_INT("parallel", "zero", parallel_zero, "0", 0, 2,
          "ZeRO sharding of data parallelism (Rajbhandari et al. 2020): 0 = every worker keeps "
          "the full optimizer state (replicated); 1 = each worker keeps the Adam moments only "
          "for its 1/N slice of every gradient bucket, buckets are reduce-scattered instead of "
          "all-reduced and the updated weights all-gathered; 2 = also reduce-scatters every "
          "micro-batch's buckets, so gradients outlive a bucket only as the worker's slices. "
          "Checkpoints stay consolidated (any zero and device count resumes them)."),
    K_INT("parallel", "nodes", parallel_nodes, "0", 0, 4096,
          "Processes of the run, one per node (docs/multinode.md), each with parallel.devices "
          "workers; global rank = node_rank x devices + local index. 0 = auto: in an srun "
          "task the step's nodes ($SLURM_STEP_NUM_NODES), else 1; refused in the batch script "
          "of a job of several nodes (start nmt with srun) and for several tasks per node. 1 "
          "is today's single process."),
    K_INT("parallel", "node_rank", parallel_node_rank, "-1", -1, 4095,
          "This process's index in [0, nodes). -1 = auto: in an srun task with one task per "
          "node $SLURM_PROCID, else $SLURM_NODEID when nodes > 1, else 0."),
    K_STRING("parallel", "rendezvous", parallel_rendezvous, "",
             "A directory every node can read and write (NFS, Lustre; any local directory when "
             "the processes share a machine) where the nodes meet: config check, the NCCL id, "
             "Gloo's connections. Must be fresh for each launch (keys are write-once). \"\" = "
             "auto: under Slurm with several nodes run.out_dir/rendezvous/job-<SLURM_JOB_ID>-"
             "<SLURM_RESTART_COUNT>, removed by node 0 when the run ends without an error; "
             "required otherwise when nodes > 1. Set with nodes = 1 it takes the multi-node "
             "path alone (for tests)."),
    K_STRING("parallel", "iface", parallel_iface, "",
             "Network interface the CPU workers' Gloo connections listen on (eth0, ib0, lo); "
             "\"\" = this machine's host name."),
    K_FLOAT("parallel", "timeout_s", parallel_timeout_s, "300", 0.0, 1, 1.0e6, 0,
             "Seconds any wait for a peer node may last (the rendezvous, a collective across "
             "nodes) before the run ends with exit code 8 naming the missing rank."),
    K_INT("parallel", "aux_streams", parallel_aux_streams, "2", 0, 8,
          "Extra CUDA streams per device in the stream pool, besides compute, comm and copy "
          "(parallel.qkv = streams uses two)."),
    K_ENUM("parallel", "comm", parallel_comm, nmt_comm_kind, "auto", comm_names,
           "Communicator between the workers: auto = host threads' shared memory for CPU "
           "workers, NCCL for several GPUs; nccl = NCCL (GPUs only); host = the host-staged "
           "communicator: every collective's buffer is copied to pinned host memory on the comm "
           "stream, summed by the host communicator in rank order and copied back, ordered by "
           "the same grad-ready events as NCCL. The only choice that lets parallel.devices list "
           "a GPU twice (several workers on one GPU, which NCCL refuses); for tests and "
           "machines without NCCL, not for speed (docs/cuda.md, \"Several workers on one "
           "GPU\"). One process only (parallel.nodes = 1)."),

    /* [precision] */
    K_ENUM("precision", "mode", precision_mode, nmt_precision, "fp32", nmt__config_precision_names,
           "GEMM arithmetic (docs/cuda.md, Precision): fp32; tf32 = tensor cores round GEMM "
           "inputs to TF32, fp32 accumulation; fp16 / bf16 = GEMM inputs (weights and "
           "activations) in half precision, fp32 accumulation, fp32 master weights (where the "
           "activations live: precision.activations); fp16 adds dynamic loss scaling. The CPU "
           "reference emulates fp16/bf16 by rounding where the GPU stores or casts to half "
           "(slower than fp32; for tests and parity)."),
    K_FLOAT("precision", "loss_scale", precision_loss_scale, "65536", 1.0, 0, 3.0e38, 0,
            "fp16: initial dynamic loss scale (Micikevicius et al. 2018 §3.2; PyTorch "
            "GradScaler's default 2^16)."),
    K_INT("precision", "growth_interval", precision_growth_interval, "2000", 1, BILLION,
          "fp16: consecutive steps without overflow after which the loss scale doubles."),
    K_FLOAT("precision", "backoff", precision_backoff, "0.5", 0.0, 1, 1.0, 1,
            "fp16: factor applied to the loss scale when a step overflows (the step is "
            "skipped)."),
    K_FLOAT("precision", "floor", precision_floor, "1", 0.0, 1, 3.0e38, 0,
            "fp16: an overflow that would take the loss scale below this ends the run as "
            "diverged (exit code 5) instead of skipping steps forever."),
    K_ENUM("precision", "activations", precision_activations, nmt_act_storage, "half", act_names,
           "fp16 / bf16: where the activations that feed GEMMs are stored (docs/cuda.md, "
           "Precision). half = in the half type, written directly by the op that produces each "
           "(GEMM outputs, LayerNorm, attention, the classifier's gradient): no cast before a "
           "GEMM, half the bytes; the residual stream, statistics, losses, weights' gradients "
           "and optimizer state stay fp32. fp32 = the earlier path: fp32 activations, each GEMM "
           "rounds its inputs (kept selectable until a GPU run shows half at parity and faster). "
           "Ignored in fp32 and tf32, and by translate and eval, which decode from fp32 "
           "activations."),

    /* [kernels] */
    K_ENUM("kernels", "attention", kernels_attention, nmt_attn_kernel, "unfused",
           attn_kernel_names,
           "Training attention ops (include/nmt/attention.h, issue 35; docs/cuda.md \"Fused "
           "attention\"). unfused = today's path and the default: attention_fwd saves the "
           "softmax weights (batch x heads x queries x keys floats per sublayer) and "
           "attention_bwd reads them. fused = one kernel per attention forward and backward "
           "that keeps only each query row's log-sum-exp and recomputes the weights in "
           "backward: the saved activations lose those weights, the dropout masks are the "
           "same. Kept selectable until a GPU run shows fused at parity and faster. fused "
           "needs d_k = model.d_model / model.n_heads in {32, 64, 128} (the CUDA kernels' head "
           "sizes). Every pass of the model uses the choice (training, validation loss, the "
           "encoder of translate); incremental decoding's decoder steps keep the unfused op."),

    /* [profile] */
    K_BOOL("profile", "nvtx", profile_nvtx, "true",
           "NVTX ranges (step, micro-step, module forward/backward, all-reduce buckets, "
           "optimizer, data wait, copies) for Nsight; off = not emitted. Builds without CUDA "
           "have none."),
    K_LONG("profile", "start_step", profile_start_step, "0", 0, 1000 * BILLION,
           "First optimizer step (1-based) of the profiling window: cudaProfilerStart before "
           "it (for nsys --capture-range=cudaProfilerApi), built-in timing and the timeline "
           "from it on; 0 = no window."),
    K_LONG("profile", "stop_step", profile_stop_step, "0", 0, 1000 * BILLION,
           "Last step of the profiling window (cudaProfilerStop after it); 0 = start_step + 9."),
    K_BOOL("profile", "timeline", profile_timeline, "false",
           "Write trace.json (Chrome trace format, for Perfetto or chrome://tracing) in "
           "run.out_dir: one track per thread and stream over the profiling window."),
    K_BOOL("profile", "table", profile_table, "true",
           "With a profiling window: print the per-module table (time per step, %, FLOPs, "
           "bytes, TFLOP/s, GB/s, bound) at the end of the run and write profile.txt."),
    K_FLOAT("profile", "peak_tflops", profile_peak_tflops, "0", 0.0, 0, 1e6, 0,
            "Peak GEMM TFLOP/s of one device for MFU and the table's bound column; 0 = "
            "measured once at start."),
    K_FLOAT("profile", "peak_gbps", profile_peak_gbps, "0", 0.0, 0, 1e6, 0,
            "Peak memory bandwidth of one device in GB/s for the table's bound column; 0 = "
            "measured once at start."),

    /* [decode] */
    K_INT("decode", "beam", decode_beam, "4", 1, 1024,
          "Beam size; 1 = greedy (paper: 4, §6.1)."),
    K_INT("decode", "max_extra_len", decode_max_extra_len, "50", 0, 1 << 20,
          "Maximum output length = source length + this (paper: 50, §6.1)."),
    K_INT("decode", "batch_sentences", decode_batch_sentences, "64", 1, 1 << 20,
          "Sentences decoded together in one batch."),
    K_FLOAT("decode", "length_penalty", decode_length_penalty, "0.6", 0.0, 0, 100.0, 0,
            "Beam search length penalty alpha: the output is the finished hypothesis with the "
            "highest log p(y|x) / lp(|y|), lp(n) = ((5 + n) / 6)^alpha (Wu et al. 2016, eq. 14; "
            "|y| counts EOS); 0 = raw log probability (paper: 0.6, §6.1)."),
    K_ENUM("decode", "beam_rule", decode_beam_rule, nmt_beam_rule, "shrink", beam_rule_names,
           "How beam search refills its beam: shrink = the beam shrinks by one for each "
           "finished hypothesis (Marian); full = beam live hypotheses per sentence until beam "
           "hypotheses have finished (fairseq, CTranslate2). Either stops a sentence as soon "
           "as no live hypothesis can beat its best finished one under the length penalty. "
           "docs/decoding.md compares them."),
    K_INT("decode", "min_len", decode_min_len, "1", 0, 1 << 20,
          "Shortest output in tokens (EOS not counted): greedy and beam search do not end a "
          "hypothesis on EOS before it (fairseq's min_len). 0 allows the empty output, which a "
          "wide beam (64 and up) often finds the most probable one (docs/decoding.md "
          "\"Wide beams\")."),

    /* [checkpoint] */
    K_INT("checkpoint", "keep", checkpoint_keep, "5", 0, 1000000,
          "Keep the last K step checkpoints (plus latest); 0 = keep all."),
};

const int nmt__config_n_keys = sizeof nmt__config_schema / sizeof nmt__config_schema[0];
