/* nmt/spm.h — SentencePiece (Kudo & Richardson 2018) in process, through its C++ library
 * (Debian libsentencepiece-dev, sentencepiece_processor.h), behind a C interface.
 *
 * translate and eval encode raw text to ids and decode ids back to text with this wrapper, so
 * no spm_encode/spm_decode process, shell or PATH is involved (tools/prepare-data.sh still
 * trains the model with spm_train). A model is loaded from a file or from its serialized bytes
 * (the copy a version-2 checkpoint carries, docs/formats.md). Every C++ exception is caught at
 * this boundary and becomes an nmt_status; nothing throws through C.
 *
 * Ids are those of the model file: nmt's models are trained with <pad>=0 <unk>=1 <s>=2 </s>=3
 * (docs/formats.md "Token ids"). Encoding emits only the pieces of the text (no BOS/EOS), as
 * `spm_encode --output_format=id` does; decoding drops control ids (pad, bos, eos), as
 * `spm_decode --input_format=id` does. A loaded model is read-only: encode and decode may run
 * on several threads at once.
 *
 * defines: nmt_spm, nmt_spm_load, nmt_spm_load_bytes, nmt_spm_free, nmt_spm_vocab,
 *          nmt_spm_encode, nmt_spm_decode, nmt_spm_check_vocab
 */
#ifndef NMT_SPM_H
#define NMT_SPM_H

#include <stddef.h>
#include <stdint.h>

#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nmt_spm nmt_spm;

/* Loads the SentencePiece model file at `path`. Errors: NMT_ERR_IO (cannot read the file,
 * naming it and errno's text), NMT_ERR_DATA (not a SentencePiece model: the library's message),
 * NMT_ERR_NOMEM. */
nmt_status nmt_spm_load(const char *path, nmt_spm **out);

/* Loads a model from its serialized bytes (the content of a .model file). `label` names the
 * bytes' origin in messages ("runs/x/checkpoints/step_100.ckpt (embedded)"). Errors:
 * NMT_ERR_DATA (not a model), NMT_ERR_NOMEM. */
nmt_status nmt_spm_load_bytes(const void *bytes, size_t n, const char *label, nmt_spm **out);

/* Frees a model; NULL is a no-op. */
void nmt_spm_free(nmt_spm *sp);

/* Number of pieces (ids 0..vocab-1). */
int nmt_spm_vocab(const nmt_spm *sp);

/* The file or label the model was loaded from, for messages. */
const char *nmt_spm_name(const nmt_spm *sp);

/* Encodes text[0..len) (UTF-8, one sentence, no newline needed) into ids. Writes at most `cap`
 * ids to `ids` and the full count to *n_out; when *n_out > cap the caller retries with room for
 * *n_out. Errors: NMT_ERR_DATA (the library refused the text), NMT_ERR_NOMEM. */
nmt_status nmt_spm_encode(const nmt_spm *sp, const char *text, size_t len, int32_t *ids,
                          int cap, int *n_out);

/* Decodes ids[0..n) into UTF-8 text, NUL-terminated in out[0..cap): writes at most cap-1 bytes
 * and the full length (without the NUL) to *len_out; when *len_out >= cap the caller retries
 * with cap > *len_out. Errors: NMT_ERR_DATA (an id outside [0, vocab), naming it), NMT_ERR_NOMEM. */
nmt_status nmt_spm_decode(const nmt_spm *sp, const int32_t *ids, int n, char *out, size_t cap,
                          size_t *len_out);

/* Checks that the model's pieces are the model's vocabulary: nmt_spm_vocab(sp) == vocab
 * ([model] vocab), so that every id it emits is an embedding row and every id the model emits
 * has a piece. Errors: NMT_ERR_CONFIG naming the model, both sizes and the key. */
nmt_status nmt_spm_check_vocab(const nmt_spm *sp, int vocab);

#ifdef __cplusplus
}
#endif
#endif /* NMT_SPM_H */
