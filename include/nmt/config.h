/* nmt/config.h — the run configuration: one struct, filled from INI files plus overrides.
 *
 * One schema table in src/config_schema.c (section, key, type, default, range, doc) drives
 * parsing, validation, `nmt config --dump` (src/config.c), `nmt config --help` and
 * docs/config.md (src/config_help.c). Numbers are parsed strictly (strtol/strtod with an end
 * pointer and a range check; "abc", "1e", "12x" and leading-zero "042" are errors), unknown
 * sections and keys are errors, and every error names the file, section, key and value. Only
 * config.c includes iniparser.
 *
 * The types the lower layers share with the config (token ids, nmt_precision, nmt_grad_dtype)
 * are in nmt/types.h, included here.
 *
 * defines: nmt_config, nmt_config_defaults, nmt_config_load, nmt_config_load_files,
 *          nmt_config_load_layered, nmt_config_sources,
 *          nmt_config_set, nmt_config_dump, nmt_config_devices_str,
 *          nmt_config_help, nmt_config_enum_name, nmt_valid_metric_name, nmt_beam_rule_name,
 *          nmt_device_kind, nmt_comm_kind, nmt_norm_kind, nmt_qkv_mode, nmt_beam_rule, nmt_valid_metric,
 *          nmt_act_storage, nmt_attn_kernel,
 *          NMT_PATH_MAX, NMT_MAX_DEVICE_IDS
 */
#ifndef NMT_CONFIG_H
#define NMT_CONFIG_H

#include <stdint.h>
#include <stdio.h>

#include "nmt/status.h"
#include "nmt/types.h" /* token ids, nmt_precision, nmt_grad_dtype */

#ifdef __cplusplus
extern "C" {
#endif

#define NMT_PATH_MAX 1024
#define NMT_MAX_DEVICE_IDS 64 /* longest parallel.devices list */
#define NMT_BUCKET_MB_AUTO 0.0f /* parallel.bucket_mb = auto */

typedef enum { NMT_DEVICE_CPU = 0, NMT_DEVICE_CUDA = 1, NMT_DEVICE_AUTO = 2 } nmt_device_kind;
typedef enum { NMT_NORM_POST = 0, NMT_NORM_PRE = 1 } nmt_norm_kind;
/* [parallel] comm: the communicator of a run's workers. auto = today's choice (CPU workers:
 * the host communicator; GPUs: NCCL, one rank per GPU); nccl = NCCL, refused for CPU workers;
 * host = the host-staged communicator (nmt_comm_create_staged): GPU buffers reduced on the
 * host through pinned copies, the only one that takes a GPU listed twice in parallel.devices
 * (several workers on one GPU); on CPU workers the same staging code with plain copies. */
typedef enum { NMT_COMM_AUTO = 0, NMT_COMM_NCCL = 1, NMT_COMM_HOST = 2 } nmt_comm_kind;
/* [parallel] qkv: self-attention projections as one (3C x C) GEMM, or three (C x C) GEMMs on
 * three streams joined by events. */
typedef enum { NMT_QKV_FUSED = 0, NMT_QKV_STREAMS = 1 } nmt_qkv_mode;
/* [precision] activations: in fp16/bf16 mode, where the activations that feed GEMMs live: half =
 * in the half type, written by the ops that produce them (docs/cuda.md "Precision"); fp32 = the
 * earlier path, fp32 activations rounded inside each GEMM. No effect in fp32/tf32 mode. */
typedef enum { NMT_ACT_HALF = 0, NMT_ACT_FP32 = 1 } nmt_act_storage;
/* [kernels] attention: the training model's attention ops (nmt/attention.h). unfused = the
 * attention_fwd / attention_bwd pair that saves the (B,H,Tq,Tk) probabilities; fused = one op
 * per direction that saves only each query row's log-sum-exp (B,H,Tq). */
typedef enum { NMT_ATTN_UNFUSED = 0, NMT_ATTN_FUSED = 1 } nmt_attn_kernel;
/* [decode] beam_rule: how beam search refills its beam (src/model/beam.c, docs/decoding.md).
 * shrink: k = beam - finished candidates survive, so the beam shrinks as hypotheses finish
 * (Marian); full: beam live hypotheses per sentence until beam have finished (fairseq,
 * CTranslate2). Both stop a sentence early once no live hypothesis can beat its best. */
typedef enum { NMT_BEAM_SHRINK = 0, NMT_BEAM_FULL = 1 } nmt_beam_rule;
/* [train] best_metric: the validation metric that checkpoints/best and train.patience follow;
 * lower is better for the loss and perplexity, higher for BLEU. */
typedef enum {
  NMT_METRIC_VALID_LOSS = 0, /* label-smoothed cross entropy per target token */
  NMT_METRIC_VALID_BLEU = 1, /* sacreBLEU of the decoded valid source (train.valid_bleu) */
  NMT_METRIC_VALID_PPL = 2   /* exp(unsmoothed NLL per target token) */
} nmt_valid_metric;

typedef struct {
  /* [run] */
  char run_out_dir[NMT_PATH_MAX]; /* run directory: config.ini, metrics.jsonl, checkpoints/ */
  uint64_t run_seed;              /* seeds init, dropout (counter-based) and batch shuffling */
  int run_resume;                 /* 0 no, 1 yes (continue from checkpoints/latest) */
  int run_tensorboard;            /* 1: event files in run.out_dir/tb/ (nmt/tensorboard.h) */

  /* [data] */
  char data_train[NMT_PATH_MAX];     /* training shard (docs/formats.md) */
  char data_valid[NMT_PATH_MAX];     /* validation shard; "" = none */
  char data_test[NMT_PATH_MAX];      /* test shard for `nmt eval --split test`; "" = none */
  char data_spm_model[NMT_PATH_MAX]; /* SentencePiece model for raw-text translate */
  int data_max_tokens;   /* padded tokens per micro-batch per device: sentences * max(len) */
  int data_max_len;      /* pairs with a side longer than this (in ids, + EOS) are dropped */
  int data_loader_threads;

  /* [model] Vaswani et al. 2017 §3, Table 3 */
  int model_vocab;        /* must equal the shard's vocab size */
  int model_d_model;
  int model_n_heads;
  int model_d_ff;
  int model_enc_layers;
  int model_dec_layers;
  int model_max_positions; /* rows of the sinusoidal table (§3.5) */
  float model_dropout;       /* P_drop on sublayer outputs and embedding sums (§5.4) */
  float model_attn_dropout;  /* on attention weights */
  float model_relu_dropout;  /* on the FFN's hidden activations */
  nmt_norm_kind model_norm;  /* post (paper) | pre */
  float model_init_std;      /* 0 = Xavier-uniform for matrices, N(0, d_model^-0.5) for embeddings */

  /* [train] */
  long train_max_steps;
  int train_log_every;
  int train_valid_every;     /* 0 = never */
  int train_valid_bleu;      /* 1: every validation also decodes the valid source, scores BLEU */
  int train_valid_beam;      /* beam of that decoding; 0 = decode.beam */
  nmt_valid_metric train_best_metric; /* what checkpoints/best and patience follow */
  int train_patience;        /* stop after this many validations without improvement; 0 = off */
  int train_save_every;      /* 0 = only at the end */
  int train_accum_steps;
  float train_label_smoothing; /* eps_ls (§5.4) */
  float train_lr_scale;      /* multiplies the paper's schedule (eq. 3) */
  int train_warmup_steps;
  float train_adam_beta1, train_adam_beta2, train_adam_eps;
  float train_weight_decay;  /* decoupled (AdamW); 0 = the paper's Adam */
  float train_clip_norm;     /* 0 = no clipping */
  int train_checkpoint_activations; /* recompute each layer's activations in backward */

  /* [parallel] */
  nmt_device_kind parallel_device;
  int parallel_devices;      /* worker threads (CPU) or GPUs: the count */
  int parallel_device_ids_n; /* 0: ranks use devices 0..N-1; else = parallel_devices, and */
  int parallel_device_ids[NMT_MAX_DEVICE_IDS]; /* rank r uses device parallel_device_ids[r] */
  float parallel_bucket_mb;  /* gradient bucket size for all-reduce, MiB; NMT_BUCKET_MB_AUTO
                                (0, "auto"): chosen at the run's start (nmt/buckets.h) */
  nmt_grad_dtype parallel_grad_dtype; /* fp32 | fp16 | bf16 all-reduce element type */
  nmt_qkv_mode parallel_qkv;          /* fused | streams */
  int parallel_aux_streams;           /* extra streams per device beyond compute/comm/copy */
  nmt_comm_kind parallel_comm;        /* auto | nccl | host (host-staged) */
  int parallel_zero;                  /* ZeRO stage: 0 replicated, 1 optimizer state, 2 + grads */
  int parallel_nodes;                 /* processes (one per node); 0 = auto ($SLURM_NNODES or 1) */
  int parallel_node_rank;             /* this process's index; -1 = auto ($SLURM_NODEID or 0) */
  char parallel_rendezvous[NMT_PATH_MAX]; /* shared directory where the nodes meet; "" = auto */
  char parallel_iface[NMT_PATH_MAX];  /* network interface for Gloo ("" = the host name) */
  float parallel_timeout_s;           /* every wait for a peer node, seconds */

  /* [precision] */
  nmt_precision precision_mode; /* fp32 | tf32 | fp16 | bf16 (GEMM arithmetic) */
  float precision_loss_scale;   /* fp16: initial dynamic loss scale */
  int precision_growth_interval;/* fp16: clean steps before the scale doubles */
  float precision_backoff;      /* fp16: scale factor after an overflow, in (0, 1) */
  float precision_floor;        /* fp16: scale below which an overflow means diverged */
  nmt_act_storage precision_activations; /* half | fp32: activation storage in fp16/bf16 */

  /* [kernels] */
  nmt_attn_kernel kernels_attention; /* unfused | fused (nmt/attention.h) */

  /* [profile] */
  int profile_nvtx;             /* NVTX ranges on (builds with CUDA) */
  long profile_start_step;      /* first step of the profiling window (1-based); 0 = none */
  long profile_stop_step;       /* last step of the window; 0 = start_step + 9 */
  int profile_timeline;         /* write run.out_dir/trace.json over the window */
  int profile_table;            /* per-module table at the end (window only) */
  float profile_peak_tflops;    /* one device's GEMM peak; 0 = measure */
  float profile_peak_gbps;      /* one device's memory bandwidth; 0 = measure */

  /* [decode] */
  int decode_beam;           /* 1 = greedy */
  int decode_max_extra_len;  /* max output length = source length + this (paper: 50) */
  int decode_batch_sentences;
  float decode_length_penalty; /* alpha of lp(n) = ((5+n)/6)^alpha (Wu et al. 2016); paper 0.6 */
  nmt_beam_rule decode_beam_rule; /* shrink | full */
  int decode_min_len;        /* no EOS before this many output tokens (fairseq: 1) */

  /* [checkpoint] */
  int checkpoint_keep;       /* keep the last K step checkpoints; 0 = keep all */
} nmt_config;

/* parallel.devices as the config dump writes it: the count ("2") or the list ("[0,2]"),
 * NUL-terminated and cut to cap bytes. */
void nmt_config_devices_str(const nmt_config *cfg, char *buf, size_t cap);

/* Fills *cfg with every key's schema default. */
void nmt_config_defaults(nmt_config *cfg);

/* Loads `path` (INI; NULL: defaults only), then applies `n_overrides` strings
 * "section.key=value" in order (the last of a key wins; only its value is parsed), then
 * validates cross-key constraints (d_model % n_heads == 0, ...).
 * Errors: NMT_ERR_CONFIG for a missing/unreadable file, unknown section or key, malformed or
 * out-of-range value; the message (nmt_last_error) names file, section, key and value. */
nmt_status nmt_config_load(const char *path, const char *const *overrides, int n_overrides,
                           nmt_config *cfg);

/* nmt_config_load over several INI files: paths[0..n_paths) in order, a later file's value of
 * a key replacing an earlier file's, then the overrides (Marian's `--config a.yml b.yml`;
 * `nmt train conf/bible-small.ini data/x/data.ini k=v`). Only the value that takes effect is
 * parsed, so a bad value a later file or override replaces is no error; an unknown section
 * or key is one in any file. Every file is read (and its syntax checked) before any value is
 * taken. A value's error names the file that set it (or "command line"); a cross-key error
 * names every source ("a.ini + b.ini + command line"). n_paths = 0: defaults and overrides.
 * Errors: as nmt_config_load (a missing file: NMT_ERR_CONFIG naming it); NMT_ERR_USAGE for a
 * negative count, a NULL array with a positive count or a NULL path; NMT_ERR_NOMEM. */
nmt_status nmt_config_load_files(const char *const *paths, int n_paths,
                                 const char *const *overrides, int n_overrides, nmt_config *cfg);

/* nmt_config_load with a layer between the file (path, may be NULL) and the command line:
 * base[0..n_base), "section.key=value" strings like the overrides, applied after the file and
 * before the overrides, whose errors name base_origin (e.g. "runs/x/checkpoints/step_9.ckpt
 * (its embedded config)") instead of "command line". A cross-key error names every source
 * that set keys ("FILE + BASE_ORIGIN + command line"); long origins and values are shown cut
 * in the middle, so the reason always ends the message. Errors: as nmt_config_load. */
nmt_status nmt_config_load_layered(const char *path, const char *const *base, int n_base,
                                   const char *base_origin, const char *const *overrides,
                                   int n_overrides, nmt_config *cfg);

/* The sources of a config loaded from paths[0..n_paths) and n_overrides overrides, as a
 * cross-key error names them: "a.ini + b.ini + command line" ("command line" alone for no
 * file, "defaults" for neither), NUL-terminated and cut to cap bytes. */
void nmt_config_sources(const char *const *paths, int n_paths, int n_overrides, char *buf,
                        size_t cap);

/* Sets one key from its text form ("train", "max_steps", "100"); same checks as a file value.
 * `origin` names where the value came from, for messages ("conf/x.ini", "command line"). */
nmt_status nmt_config_set(nmt_config *cfg, const char *section, const char *key, const char *value,
                          const char *origin);

/* The name an enum key's value has in a config file (nmt_config_enum_name("model", "norm",
 * NMT_NORM_PRE) is "pre"), for messages and dumps that show such a value: NULL when
 * [section] key is not an enum key or value is none of its values. */
const char *nmt_config_enum_name(const char *section, const char *key, int value);

/* Writes the effective config as INI (every key, schema order, with its doc as a comment). */
nmt_status nmt_config_dump(const nmt_config *cfg, FILE *out);

/* Writes every key's section, name, type, default, range and doc (for --help and docs). */
void nmt_config_help(FILE *out, int markdown);

/* train.best_metric's value as the schema spells it ("valid_loss", "valid_bleu", "valid_ppl");
 * "?" outside the enum. */
const char *nmt_valid_metric_name(nmt_valid_metric m);
/* "shrink" or "full" (the [decode] beam_rule value); "?" for another value. */
const char *nmt_beam_rule_name(nmt_beam_rule r);

#ifdef __cplusplus
}
#endif
#endif /* NMT_CONFIG_H */
