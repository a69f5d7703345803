/* data/shard_impl.h — what the shard writer shares with the raw-text writer (shard_raw.c).
 *
 * defines: nmt__shard_write_from_text
 */
#ifndef NMT_SHARD_IMPL_H
#define NMT_SHARD_IMPL_H

#include <stdint.h>

#include "nmt/status.h"

/* nmt_shard_write_from_text that records spm_hash (nmt_spm_file_hash of the SentencePiece model
 * the ids came from; 0 = not known) in the header. Errors: those of nmt_shard_write_from_text. */
nmt_status nmt__shard_write_from_text(const char *src_ids_path, const char *tgt_ids_path,
                                      int vocab, uint32_t spm_hash, const char *out_path);

#endif /* NMT_SHARD_IMPL_H */
