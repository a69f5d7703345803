/* nmt/data.h — binary shards of SentencePiece ids, and token-based batching.
 *
 * A shard holds aligned (source, target) id sequences; docs/formats.md gives the byte layout
 * (magic "NMTSHRD1", format version, vocab size, pair count, id width, offset arrays, ids).
 * Shards are mmap'd read-only and fully validated on open, so later reads need no checks.
 * Version 2 shards carry two zlib CRC-32s in their header, one of the header and one of the
 * rest of the file, which open verifies, so a byte damaged since the writer closed the file is
 * refused instead of trained on; version 1 shards (no checksums) still open, with a warning.
 *
 * Batching (DESIGN.md "Data"): pairs are sorted by length, cut into batches whose padded size
 * max(n_sent*src_len, n_sent*tgt_len) <= max_tokens; the batch order is shuffled per epoch from
 * the seed (a pure function of (seed, epoch), so resume needs only (epoch, index)).
 *
 * Sequences in a batch: src = x EOS; tgt_in = BOS y; tgt_out = y EOS; right-padded with
 * NMT_PAD_ID. Lengths count EOS/BOS.
 *
 * A shard records which SentencePiece model its ids came from (nmt_spm_file_hash of the model
 * file; 0 in shards written before nmt recorded it), so that training can refuse a data.spm_model
 * other than the one the shards were encoded with (nmt_data_check_spm).
 *
 * defines: nmt_shard, nmt_shard_open/close/..., nmt_shard_version, nmt_shard_crc32,
 *          nmt_shard_write, nmt_shard_write_from_text, nmt_shard_spm_hash, nmt_shard_read_spm_hash, nmt_shard_clean, nmt_shard_clean_report,
 *          nmt_shard_write_from_raw, nmt_file_crc32, nmt_spm_file_hash, nmt_data_check_spm,
 *          nmt_batch, nmt_batch_alloc/free, nmt_batcher, nmt_batcher_*
 */
#ifndef NMT_DATA_H
#define NMT_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "nmt/config.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define NMT_SHARD_MAGIC "NMTSHRD1"
/* The version the writers write. Readers take it and version 1 (the same layout with a
 * 64-byte header and no checksums). */
#define NMT_SHARD_VERSION 2u

typedef struct nmt_shard nmt_shard;

/* Opens and validates a shard: size, magic, version (1 or 2), the header's CRC-32 (version 2),
 * id width (2 or 4), sections in range, the payload's CRC-32 (version 2), offsets monotone
 * and in range, every id < vocab. If expected_vocab > 0 the shard's vocab must equal it. Both
 * CRCs are checked before the fields and sections they cover, so a damaged file reads as
 * damaged; the payload's costs one pass of zlib's crc32 over the mapped file, once per open
 * (2.4-4.3 GB/s: 90 ms more for a 300 MB shard, docs/formats.md): the trainer opens each
 * shard once and its loader threads share it. A version 1 shard opens with one warning line
 * naming it (it cannot be checked).
 * Errors: NMT_ERR_IO (cannot open/mmap), NMT_ERR_DATA (any validation failure; the message
 * names the file and what is wrong: "truncated", "bad magic", "unsupported version",
 * "header checksum mismatch (stored 1a2b3c4d, computed ...)", "payload checksum mismatch",
 * "offset out of range", "id 9001 >= vocab 8000 at pair 17", "vocab mismatch"; a checksum
 * mismatch also says how to rebuild the shard). */
nmt_status nmt_shard_open(const char *path, int expected_vocab, nmt_shard **out);
void nmt_shard_close(nmt_shard *s);
long nmt_shard_num_pairs(const nmt_shard *s);
int nmt_shard_vocab(const nmt_shard *s);
/* The shard's format version: 1 (no checksums) or 2. */
int nmt_shard_version(const nmt_shard *s);
/* The header's and the payload's CRC-32 (zlib's; docs/formats.md "Shard format": bytes 0-67
 * and 72 to the end) as stored, which nmt_shard_open verified: returns 1. A version 1 shard
 * has none: returns 0 and sets both to 0. */
int nmt_shard_crc32(const nmt_shard *s, uint32_t *header_crc, uint32_t *payload_crc);
/* The hash of the SentencePiece model the shard's ids came from (nmt_spm_file_hash); 0 when
 * the writer did not know it (`nmt shard` from id files, shards written before nmt recorded it). */
uint32_t nmt_shard_spm_hash(const nmt_shard *s);
/* The same from the header alone (72 bytes read; magic, version and, in version 2, the
 * header's CRC-32 checked; the rest is not validated): cheap on a corpus of any size.
 * Errors: NMT_ERR_IO (cannot open or read), NMT_ERR_DATA (not a shard, truncated header,
 * another version, header checksum mismatch), each naming the file. */
nmt_status nmt_shard_read_spm_hash(const char *path, uint32_t *hash);
/* Lengths of pair i (ids, without the EOS/BOS the batcher adds). */
int nmt_shard_src_len(const nmt_shard *s, long i);
int nmt_shard_tgt_len(const nmt_shard *s, long i);
/* Copies pair i's ids into dst as int32 (dst has room for the length above). */
void nmt_shard_copy_src(const nmt_shard *s, long i, int32_t *dst);
void nmt_shard_copy_tgt(const nmt_shard *s, long i, int32_t *dst);

/* Writes a version 2 shard atomically (temp file, its CRC-32s from the bytes read back, fsync,
 * rename). Offsets have n_pairs+1 entries, offsets[0] == 0, monotone; ids < vocab. id width =
 * 2 if vocab <= 65536 else 4. Errors: NMT_ERR_DATA (bad arguments), NMT_ERR_IO. */
nmt_status nmt_shard_write(const char *path, int vocab, long n_pairs, const uint64_t *src_offsets,
                           const int32_t *src_ids, const uint64_t *tgt_offsets,
                           const int32_t *tgt_ids);

/* Reads two aligned text files of space-separated ids (spm_encode --output_format=id), one
 * sentence per line, and writes a shard. Line counts must match; ids must parse and be < vocab.
 * Errors: NMT_ERR_DATA naming the file and line, NMT_ERR_IO. */
nmt_status nmt_shard_write_from_text(const char *src_ids_path, const char *tgt_ids_path,
                                     int vocab, const char *out_path);

/* Which training pairs nmt_shard_write_from_raw leaves out, as Moses' clean-corpus-n.perl
 * does, counting SentencePiece pieces instead of words. All zero: every pair is kept (valid and
 * test sets, whose line i must stay pair i for BLEU against the raw reference). */
typedef struct {
  int drop_empty;   /* drop a pair with a side of no pieces (an empty or blank line) */
  double max_ratio; /* drop a pair whose one side has more than max_ratio times the pieces of
                       the other (clean-corpus-n's default is 9); 0 = no ratio filter */
} nmt_shard_clean;

/* What nmt_shard_write_from_raw read, kept and left out, per reason. */
typedef struct {
  long pairs;         /* lines read from each side */
  long kept;          /* pairs in the shard */
  long dropped_empty; /* left out: a side with no pieces (drop_empty) */
  long dropped_ratio; /* left out: length ratio above max_ratio */
  long empty_kept;    /* kept although a side has no pieces (drop_empty off) */
} nmt_shard_clean_report;

/* Encodes two aligned UTF-8 text files (one sentence a line) with the SentencePiece model file
 * `spm_path` in process (nmt_spm_encode: no spm_encode command) and writes a shard atomically,
 * its vocab the model's piece count and its header the model's nmt_spm_file_hash. Pairs are
 * left out as `clean` says (NULL: none) and counted in *report (may be NULL). The ids pass
 * through two temporary files next to out_path, removed on return.
 * Errors: NMT_ERR_IO (cannot read an input or the model; cannot write next to out_path, e.g. a
 * full disk: the message names the file and errno's text), NMT_ERR_DATA (not a SentencePiece
 * model, line counts differ, no pair left), NMT_ERR_NOMEM. */
nmt_status nmt_shard_write_from_raw(const char *spm_path, const char *src_text_path,
                                    const char *tgt_text_path, const nmt_shard_clean *clean,
                                    const char *out_path, nmt_shard_clean_report *report);

/* zlib's CRC-32 of the whole file's bytes in *crc, and their count in *bytes (may be NULL).
 * Errors: NMT_ERR_IO naming the file, NMT_ERR_NOMEM. */
nmt_status nmt_file_crc32(const char *path, uint32_t *crc, uint64_t *bytes);

/* nmt_file_crc32 of the model file, never 0 (0 means "not recorded" in a shard header, so a
 * CRC of 0 is given as 1): the identity of a SentencePiece model that shards record.
 * Errors: nmt_file_crc32's. */
nmt_status nmt_spm_file_hash(const char *path, uint32_t *hash);

/* The check at train start that data.spm_model fits the run: when set, the file must load as a
 * SentencePiece model, have [model] vocab pieces, and be the model the shards of data.train,
 * data.valid and data.test (those set) were encoded with (their recorded hash). A shard without
 * a recorded hash (written before nmt recorded it, or by `nmt shard` from id files) is a
 * warning naming it: its ids cannot be checked. An empty data.spm_model checks nothing.
 * Errors: NMT_ERR_CONFIG naming the key, the file and the mismatch (unreadable, not a model,
 * piece count, another model than the shard's); NMT_ERR_DATA / NMT_ERR_IO of a shard header. */
nmt_status nmt_data_check_spm(const nmt_config *cfg);

/* One micro-batch, host or device memory (the layout is the same). */
typedef struct {
  int n_sent;        /* sentences */
  int src_len;       /* padded length of src rows */
  int tgt_len;       /* padded length of tgt_in / tgt_out rows */
  long src_tokens;   /* non-pad source ids */
  long tgt_tokens;   /* non-pad target ids = tokens the loss is summed over */
  int32_t *src;      /* (n_sent, src_len) */
  int32_t *tgt_in;   /* (n_sent, tgt_len) */
  int32_t *tgt_out;  /* (n_sent, tgt_len) */
  int32_t *src_lens; /* (n_sent) */
  int32_t *tgt_lens; /* (n_sent) */
  long epoch;        /* data position this batch came from, for logs and resume */
  long index;        /* batch index within the epoch order */
} nmt_batch;

/* Size in int32 of one buffer that holds a batch of these bounds (see nmt_batch_layout). */
size_t nmt_batch_ints(int max_sent, int max_len);
/* Points the batch's arrays into `buf` (nmt_batch_ints(n_sent, ...) int32) for the given
 * shape; sets n_sent, src_len, tgt_len. */
void nmt_batch_layout(nmt_batch *b, int32_t *buf, int n_sent, int src_len, int tgt_len);

typedef struct nmt_batcher nmt_batcher;

/* Builds the length-sorted batch list over all pairs of `shard` whose sides fit max_len
 * (length + 1 for EOS/BOS <= max_len); longer pairs are dropped and counted.
 * Errors: NMT_ERR_CONFIG if max_tokens < max_len (a longest pair could not fit),
 * NMT_ERR_DATA if no pair fits. */
nmt_status nmt_batcher_create(const nmt_shard *shard, int max_tokens, int max_len, uint64_t seed,
                              nmt_batcher **out);
void nmt_batcher_destroy(nmt_batcher *b);
long nmt_batcher_num_batches(const nmt_batcher *b);
long nmt_batcher_num_dropped(const nmt_batcher *b);
/* The batch id at position `index` of epoch `epoch`'s shuffled order (Fisher-Yates driven by
 * nmt_rng_u32(seed, epoch, .)); index in [0, num_batches). */
long nmt_batcher_order(const nmt_batcher *b, long epoch, long index);
/* Writes epoch `epoch`'s whole order (num_batches ids) into the caller's perm: the same
 * permutation nmt_batcher_order reads from, without its shared cache or lock. The trainer's
 * loader keeps its own perm so the per-step path takes no lock. */
void nmt_batcher_epoch_order(const nmt_batcher *b, long epoch, long *perm);
/* Sentences, padded src/tgt lengths and non-pad target tokens of batch id `id`. */
void nmt_batcher_shape(const nmt_batcher *b, long id, int *n_sent, int *src_len, int *tgt_len,
                       long *tgt_tokens);
/* Fills `out` (already laid out by nmt_batch_layout with the shape above) with batch `id`. */
void nmt_batcher_fill(const nmt_batcher *b, long id, nmt_batch *out);

#ifdef __cplusplus
}
#endif
#endif /* NMT_DATA_H */
