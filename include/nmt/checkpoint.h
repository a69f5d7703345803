/* nmt/checkpoint.h — checkpoint files: parameters, Adam moments, step, data position, RNG, and
 * the description of the model (config and SentencePiece model) that makes a checkpoint
 * usable on its own.
 *
 * Layout (little-endian; docs/formats.md): a fixed header (magic "NMTCKPT1", format version,
 * model shape, counts, step, data position, seed, loss scale, metadata size), then (version 2)
 * the metadata section — named records: the run's effective config as INI text, the
 * data.spm_model path and that SentencePiece model's bytes — then n_params fp32 parameters,
 * then n_params fp32 Adam first moments and n_params second moments (if has_moments), then a
 * CRC-32 (zlib) of every preceding byte. Version 2 is written; versions 1 (no metadata) and 2
 * are read. Writes are atomic: temp file in the same directory, fsync, rename, fsync of the
 * directory; a reader never sees a partial file. A checkpoint directory holds step_N.ckpt files,
 * `latest`, a one-line text file naming the newest, and `best`, one naming the checkpoint of the
 * best validation so far (train.best_metric); each is replaced atomically after the checkpoint
 * it names is durable, and checkpoint.keep never deletes the one `best` names.
 *
 * defines: nmt_ckpt_header, nmt_ckpt_meta, nmt_ckpt_file_bytes, nmt_ckpt_write, nmt_ckpt_read,
 *          nmt_ckpt_read_header, nmt_ckpt_read_meta, nmt_ckpt_meta_free, nmt_ckpt_is_checkpoint,
 *          nmt_ckpt_save_step, nmt_ckpt_find_latest, nmt_ckpt_find_best, NMT_CKPT_VERSION,
 *          nmt_ckpt_meta_from_config, nmt_ckpt_meta_set_config, nmt_ckpt_setup,
 *          nmt_ckpt_setup_load, nmt_ckpt_setup_free,
 *          nmt_ckpt_setup_spm, nmt_ckpt_data, nmt_ckpt_data_of, nmt_ckpt_data_resume
 */
#ifndef NMT_CHECKPOINT_H
#define NMT_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "nmt/config.h"
#include "nmt/spm.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define NMT_CKPT_MAGIC "NMTCKPT1"
#define NMT_CKPT_VERSION 2u /* written; 1 and 2 are read */

/* What decided the training data order of a run (the metadata record "data", docs/formats.md):
 * the batches are a function of the shard's bytes, data.max_tokens and data.max_len, and epoch
 * e's order a function of those batches, run.seed and e. A checkpoint's (data_epoch,
 * data_index) means a batch only in the order these describe; --resume compares them with the
 * run's own (nmt_ckpt_data_resume). world and accum_steps only say how many batches a step
 * takes from that one stream. */
typedef struct {
  int present;              /* 0: none recorded (a file written before nmt recorded it) */
  uint64_t shard_bytes;     /* size of the data.train file */
  uint32_t shard_crc32;     /* zlib CRC-32 of its bytes */
  int32_t max_tokens;       /* data.max_tokens */
  int32_t max_len;          /* data.max_len */
  int32_t world;            /* data-parallel ranks: parallel.nodes x parallel.devices */
  int32_t accum_steps;      /* train.accum_steps */
  int64_t n_pairs;          /* pairs in the shard */
  int64_t n_batches;        /* batches in one epoch's order (>= 1) */
  uint64_t seed;            /* run.seed */
  char train[NMT_PATH_MAX]; /* data.train as the run named it */
} nmt_ckpt_data;

/* What a checkpoint says about itself (version 2; docs/formats.md "Metadata section"). Each
 * field may be absent (NULL, data.present 0): the trainer leaves out the SentencePiece model
 * when data.spm_model is empty or unreadable, and only the trainer records `data`. Returned
 * by nmt_ckpt_read_meta (malloc'd, freed by nmt_ckpt_meta_free); given to a write through
 * nmt_ckpt_header.meta (not copied, not freed; zero it first: a field left unset may write a
 * record). */
typedef struct {
  char *config;          /* the effective config as INI text (`nmt config --dump`), NUL-ended */
  char *spm_model_path;  /* data.spm_model as the run named it, NUL-ended */
  void *spm_model;       /* that file's bytes: a serialized SentencePiece model */
  size_t spm_model_bytes;
  nmt_ckpt_data data;    /* the data order's inputs (data.present 0: none; the record "data") */
} nmt_ckpt_meta;

typedef struct {
  uint32_t version;          /* filled by write */
  int32_t vocab, d_model, n_heads, d_ff, enc_layers, dec_layers, norm; /* model shape */
  uint64_t n_params;         /* floats per array */
  uint32_t has_moments;      /* 1 if Adam m and v follow the parameters */
  int64_t step;              /* optimizer steps completed */
  int64_t data_epoch;        /* position of the next batch in the data stream: epoch (0-based) */
  int64_t data_index;        /* and index in that epoch's order (0-based; nmt_ckpt_data) */
  uint64_t seed;             /* run.seed the run started with */
  float loss_scale;          /* fp16 dynamic loss scale; 0 = the run was not fp16 */
  int64_t skipped_steps;     /* steps skipped on fp16 overflow */
  int64_t scale_good_steps;  /* fp16: clean steps since the loss scale last changed */
  uint64_t meta_bytes;       /* read: size of the metadata section (0: none; version 1) */
  const nmt_ckpt_meta *meta; /* write: metadata to embed (NULL: none); read: always NULL */
  /* The best validation up to this step (checkpoints/best, train.patience), kept in the
   * metadata record "best" (docs/formats.md), so that --resume continues the count. Written
   * when best_step > 0; read by nmt_ckpt_read and nmt_ckpt_read_meta (not by
   * nmt_ckpt_read_header); all 0 when the file has none. */
  int32_t best_metric;       /* the nmt_valid_metric (nmt/config.h) best_value measures */
  int64_t best_step;         /* the step of that validation; 0 = no validation yet */
  double best_value;         /* its value: valid_loss / valid_ppl (lower is better) or BLEU */
  int64_t best_bad;          /* validations after best_step that did not improve on it */
} nmt_ckpt_header;

/* The size in bytes of the file nmt_ckpt_write writes for h (its metadata, h->meta and the
 * best record, included): 128 + M + 4 * n_params * (has_moments ? 3 : 1) + 4
 * (docs/formats.md "Checkpoint files"). */
uint64_t nmt_ckpt_file_bytes(const nmt_ckpt_header *h);

/* Writes atomically. m, v may be NULL only if h->has_moments == 0.
 * Errors: NMT_ERR_IO (naming path and errno text). */
nmt_status nmt_ckpt_write(const char *path, const nmt_ckpt_header *h, const float *params,
                          const float *m, const float *v);

/* Reads and validates the header only (magic, version, size consistent with the file).
 * Errors: NMT_ERR_IO (cannot open), NMT_ERR_CHECKPOINT ("truncated", "bad magic",
 * "unsupported version N"). */
nmt_status nmt_ckpt_read_header(const char *path, nmt_ckpt_header *h);

/* Reads the header (as nmt_ckpt_read_header) and the metadata section into *meta (all NULL for
 * a version-1 file). The CRC is not checked here (that needs the whole file): nmt_ckpt_read
 * checks it. Errors: those of nmt_ckpt_read_header, NMT_ERR_CHECKPOINT ("corrupt metadata"),
 * NMT_ERR_NOMEM. On error *meta holds nothing to free. */
nmt_status nmt_ckpt_read_meta(const char *path, nmt_ckpt_header *h, nmt_ckpt_meta *meta);

/* Frees what nmt_ckpt_read_meta allocated and zeroes *meta; a zeroed meta is a no-op. */
void nmt_ckpt_meta_free(nmt_ckpt_meta *meta);

/* 1 if the file at path begins with the checkpoint magic (how the CLI tells a checkpoint from
 * an INI config), else 0 (also when it cannot be read). */
int nmt_ckpt_is_checkpoint(const char *path);

/* Reads a whole checkpoint and verifies its CRC. If `expect` is not NULL its model shape and
 * n_params must match ("wrong model shape: d_model 512 in file, 256 in config"). params, m, v
 * may be NULL to skip them (all NULL: verify only). The metadata section is checked by the
 * CRC and its records' structure; of it only the best record reaches *h (best_*), the rest is
 * nmt_ckpt_read_meta's. Errors: as above plus NMT_ERR_CHECKPOINT for "checksum mismatch",
 * "corrupt metadata", shape mismatches and a NaN or infinite parameter ("parameter
 * embed.weight[12] is nan", also when params is NULL; the moments are not checked). On error
 * the outputs are unspecified. */
nmt_status nmt_ckpt_read(const char *path, const nmt_ckpt_header *expect, nmt_ckpt_header *h,
                         float *params, float *m, float *v);

/* Writes dir/step_<h->step>.ckpt, then points dir/latest at it (atomic), and when this step's
 * validation is the best so far (h->best_step == h->step > 0) points dir/best at it too
 * (atomic), then deletes the oldest step_*.ckpt beyond `keep` (keep <= 0 keeps all), never the
 * one just written nor the one `best` names. Creates dir if missing.
 * Writes the chosen file name to path_out (may be NULL; size >= 1024). Errors: NMT_ERR_IO,
 * NMT_ERR_INTERNAL (a negative step). */
nmt_status nmt_ckpt_save_step(const char *dir, const nmt_ckpt_header *h, const float *params,
                              const float *m, const float *v, int keep, char *path_out);

/* The newest checkpoint in dir that passes nmt_ckpt_read_header and whose CRC verifies: the
 * one `latest` names, else (damaged or missing) the highest-step valid step_*.ckpt, logging a
 * warning for each damaged file skipped. Errors: NMT_ERR_CHECKPOINT "no valid checkpoint in
 * DIR" if none. path_out has room for 1024 chars. */
nmt_status nmt_ckpt_find_latest(const char *dir, char *path_out);

/* The checkpoint dir/best names, read through (CRC) and valid. Errors: NMT_ERR_CHECKPOINT "DIR
 * has no best checkpoint" (no `best`: no validation ran, or none was written yet) or naming the
 * damaged or missing file. path_out has room for 1024 chars. */
nmt_status nmt_ckpt_find_best(const char *dir, char *path_out);

/* ---- self-describing checkpoints (src/engine/ckpt_config.c) ---- */

/* The metadata the trainer embeds for cfg: its dump (`nmt config --dump`, with run.resume =
 * false so that a resumed run writes the same bytes), data.spm_model and that file's bytes. An unreadable data.spm_model is a warning (training does not need it) and
 * leaves the bytes out. Free with nmt_ckpt_meta_free. Errors: NMT_ERR_NOMEM. */
nmt_status nmt_ckpt_meta_from_config(const nmt_config *cfg, nmt_ckpt_meta *out);
/* Replaces m->config with cfg's dump (run.resume = false, as above), e.g. once the trainer has
 * settled a key the file left to it (parallel.bucket_mb = auto). Errors: NMT_ERR_NOMEM; m is
 * unchanged then. */
nmt_status nmt_ckpt_meta_set_config(const nmt_config *cfg, nmt_ckpt_meta *m);

/* The data order's inputs of a run with config cfg whose batcher over data.train made n_batches
 * batches of its n_pairs pairs, on `world` data-parallel ranks: the fields of cfg, and the size
 * and CRC-32 of the data.train file (read through once, about a second per GB). Errors:
 * NMT_ERR_IO naming the file, NMT_ERR_NOMEM. */
nmt_status nmt_ckpt_data_of(const nmt_config *cfg, long n_pairs, long n_batches, int world,
                            nmt_ckpt_data *out);

/* --resume: where in the data a run resumed from checkpoint `ckpt` (its header h, its `data`
 * record `then`, present or not) continues, given the run's own data order `now`; *epoch and
 * *index (0-based, 0 <= index < now->n_batches) receive the position. Each decision is logged
 * naming the keys (docs/formats.md "Resume and the data order"):
 * - the same order (shard bytes, max_tokens, max_len, seed, hence the batches): the
 *   checkpoint's position; a change of world or accum_steps only changes how many batches a
 *   step takes from it (info);
 * - another order: the position names no batch of it; the run continues at the start of a
 *   new epoch of the new order (h's epoch if it had just ended, data_index 0, else the next
 *   one), warning with each changed key's value then and now;
 * - no record (files of older versions): the position is kept when it lies in the order and
 *   the header's seed is run.seed (info: a changed shard or batching cannot be seen there);
 *   otherwise as for another order.
 * Never fails. */
void nmt_ckpt_data_resume(const char *ckpt, const nmt_ckpt_header *h, const nmt_ckpt_data *then,
                          const nmt_ckpt_data *now, long *epoch, long *index);

/* What a command that reads a checkpoint (translate, eval, export) runs with. */
typedef struct {
  nmt_config cfg;          /* the effective config */
  char ckpt[1024];         /* the checkpoint: the one given, or the newest valid one of
                            * run.out_dir/checkpoints */
  nmt_ckpt_header header;  /* its header */
  nmt_ckpt_meta meta;      /* its metadata (all NULL for a version-1 file) */
  int from_ckpt;           /* 1: cfg is the checkpoint's embedded config */
} nmt_ckpt_setup;

/* Resolves checkpoint and config (docs/decoding.md "Checkpoint or config"):
 * - configs given (n_configs > 0): cfg = those files in order, a later one's value of a key
 *   replacing an earlier one's, + overrides (nmt_config_load_files); the checkpoint is
 *   `ckpt`, or with ckpt NULL the newest valid one in run.out_dir/checkpoints;
 * - no config: cfg = the checkpoint's embedded config, except run.out_dir (the run
 *   directory that holds the checkpoint: DIR for DIR/checkpoints/step_N.ckpt, else the file's
 *   directory), run.resume and [parallel] (schema defaults: this machine decides), and
 *   data.spm_model when the model's bytes are embedded (empty: the bytes are used); then the
 *   overrides. Keys this build does not know are skipped with a warning.
 * In both cases the model shape of cfg must equal the checkpoint header's.
 * Free with nmt_ckpt_setup_free. Errors: NMT_ERR_USAGE (neither given; a version-1 checkpoint,
 * or one without an embedded config, given alone), NMT_ERR_CHECKPOINT (damaged, none found,
 * model shape differs: "[model] d_model = 256 in CONFIG but 512 in the checkpoint CKPT", where
 * CONFIG names every source, "a.ini + b.ini + command line"),
 * NMT_ERR_CONFIG (a config or override error, naming its origin), NMT_ERR_IO. */
nmt_status nmt_ckpt_setup_load(const char *ckpt, const char *const *configs, int n_configs,
                               const char *const *overrides, int n_overrides,
                               nmt_ckpt_setup *s);
void nmt_ckpt_setup_free(nmt_ckpt_setup *s);

/* The SentencePiece model for raw text: the file data.spm_model names when set (with a
 * warning when its bytes differ from the copy the checkpoint carries), else the checkpoint's
 * embedded copy. Its pieces must be [model] vocab. Errors: NMT_ERR_CONFIG (neither; a piece
 * count other than the vocabulary), those of nmt_spm_load / nmt_spm_load_bytes. */
nmt_status nmt_ckpt_setup_spm(const nmt_ckpt_setup *s, nmt_spm **out);

#ifdef __cplusplus
}
#endif
#endif /* NMT_CHECKPOINT_H */
