/* translate_impl.h — what translate.c (the streaming command) and translate_batch.c (the
 * decoder rig, in-memory translation) share. Internal to src/engine/. */
#ifndef NMT_TRANSLATE_IMPL_H
#define NMT_TRANSLATE_IMPL_H

#include <stdint.h>

#include "nmt/config.h"
#include "nmt/device.h"
#include "nmt/model.h"
#include "nmt/spm.h"
#include "nmt/status.h"

/* One source sentence: ids without EOS, and its 1-based input line (0: none, e.g. a shard). */
typedef struct {
  int32_t *ids;
  int len;
  long line;
} nmt__sentence;

/* The translations of a window of W sentences, K hypotheses each: slot i's hypothesis q is
 * ids[(i*K + q) * max_out ..] of length len[i*K + q]; n[i] hypotheses were found (-1: slot
 * not decoded yet). score: normalised (the ranking), logp: log p(y|x) in nats. */
typedef struct {
  int W, K, max_out;
  int32_t *ids, *len, *n;
  float *score, *logp;
} nmt__hyps;

nmt_status nmt__hyps_alloc(nmt__hyps *h, int W, int K, int max_out);
void nmt__hyps_free(nmt__hyps *h);

/* The most models one ensemble decodes with (nmt translate --ensemble). */
enum { NMT__ENSEMBLE_MAX = 16 };

/* The models a rig decodes with besides its first (cfg, host_params): n of them, each its
 * config (the model's shape; any other key is the first model's) and nmt_model_num_params
 * floats of host memory, and n + 1 weights (the first model's first; NULL: equal), given to
 * nmt_decoder_ensemble. */
typedef struct {
  int n;
  const nmt_config *cfg[NMT__ENSEMBLE_MAX - 1];
  const float *host[NMT__ENSEMBLE_MAX - 1];
  const float *weights;
} nmt__ensemble;

/* One decoder with its buffers on the inference device, for batches of up to
 * decode.batch_sentences. K hypotheses per sentence; beam search whenever decode.beam > 1, K > 1
 * or scores are wanted (beam 1 then decodes exactly as greedy). */
typedef struct {
  const nmt_config *cfg;
  nmt_device dev;
  atomic_int *abort;    /* the run's abort flag given to the context (NULL: none) */
  nmt_model *model;
  nmt_decoder *dec;
  /* an ensemble's other models and their decoders (nmt__rig_open_ensemble); their parameters
   * follow the first model's in params, at mem_off[i] floats, so that one half copy and one
   * infer_weights cover them all */
  int n_mem;
  nmt_model *mem_model[NMT__ENSEMBLE_MAX - 1];
  nmt_decoder *mem_dec[NMT__ENSEMBLE_MAX - 1];
  size_t mem_off[NMT__ENSEMBLE_MAX - 1], n_first, n_total; /* floats */
  float *params;
  void *half;           /* fp16/bf16: the half copy of params the GEMMs read (NULL in fp32) */
  int32_t *hbuf, *dbuf, *out_ids, *out_lens, *out_n;
  float *out_score, *out_logp;
  int K, use_beam;
  long cut, out_tokens; /* sources cut to data.max_len - 1; tokens output */
} nmt__rig;

/* Opens the device, uploads host_params (the model of cfg). On error, nmt__rig_close still
 * frees what was made. The same as nmt__rig_open_on(r, cfg, NULL, NULL, ...). */
nmt_status nmt__rig_open(nmt__rig *r, const nmt_config *cfg, const float *host_params, int K,
                         int scores);
/* nmt__rig_open on backend `be` (NULL: nmt_device_select for one inference rank), the context
 * of device rank 0 (parallel.devices' first entry) with the run's abort flag `abort` (may be
 * NULL): every host wait of the context (copies, synchronize) and nmt__rig_decode return
 * NMT_ERR_ABORTED once it is raised. host_params (required): nmt_model_num_params floats of
 * host memory, uploaded. Errors: NMT_ERR_NOMEM (host buffers), nmt_device_open's, the
 * backend's (device memory), nmt_model_create's. */
nmt_status nmt__rig_open_on(nmt__rig *r, const nmt_config *cfg, const nmt_backend *be,
                            atomic_int *abort, const float *host_params, int K, int scores);
/* nmt__rig_open_on on device rank `rank` (parallel.devices' entry `rank`; on the CPU any rank
 * is a context of its own): one of several rigs decoding batches at once (translate.c). be:
 * as nmt__rig_open_on, chosen for all the ranks (nmt_device_select). */
nmt_status nmt__rig_open_rank(nmt__rig *r, const nmt_config *cfg, const nmt_backend *be,
                              int rank, atomic_int *abort, const float *host_params, int K,
                              int scores);
/* nmt__rig_open_rank decoding with an ensemble: the first model (cfg, host_params) and e's
 * (NULL or e->n == 0: the first alone), all in one context, as nmt_decoder_ensemble combines
 * them. Errors: nmt__rig_open_rank's, NMT_ERR_USAGE (more than NMT__ENSEMBLE_MAX models),
 * nmt_decoder_ensemble's. */
nmt_status nmt__rig_open_ensemble(nmt__rig *r, const nmt_config *cfg, const nmt_backend *be,
                                  int rank, atomic_int *abort, const float *host_params, int K,
                                  int scores, const nmt__ensemble *e);
/* Uploads new parameters (nmt_model_num_params floats of host memory) into the open rig: a
 * copy, no device allocation; with a half copy (nmt__rig_half_weights) also its rounding
 * (cast_half), the one rounding of the weights per load; without one (fp32/tf32) it declares
 * them the context's fixed weights (infer_weights: ref keeps them transposed, its host buffer
 * allocated at the first load, kept by the later ones, each matrix transposed at its first use
 * after the load; nmt__rig_close forgets them). Errors: the backend's copy_h2d, cast_half and
 * infer_weights (NMT_ERR_ABORTED on an abort, NMT_ERR_NOMEM). */
nmt_status nmt__rig_load(nmt__rig *r, const float *host_params);
/* (An ensemble's rig: host_params are its first model's; the others keep what open gave them,
 * and the half copy or infer_weights is remade over all.) */
/* The rig's half copy of its weights (mixed precision, nmt/backend.h half_weights): device
 * memory of 2 bytes per parameter, registered with the context and filled from the current
 * parameters, so that every GEMM of decoding reads its weights rounded once instead of
 * rounding them at every call (the V x C output projection included, at every step).
 * nmt__rig_open_on calls it when the device computes in fp16 or bf16; nmt__rig_load refreshes
 * it; nmt__rig_close unregisters and frees it. Errors: NMT_ERR_INTERNAL (a copy already made,
 * a context in fp32/tf32), NMT_ERR_NOMEM, the backend's. */
nmt_status nmt__rig_half_weights(nmt__rig *r);
/* Sizes the decoder's buffers (and the context's scratch) now for every batch of sources of
 * at most `longest` ids (cut to data.max_len - 1 as nmt__rig_decode cuts them), by starting
 * one batch of decode.batch_sentences such sources and decoding its first step: later
 * nmt__rig_decode calls on such batches allocate no device memory (a trainer decodes while
 * other ranks wait in a collective, where cudaMalloc and cudaFree may hang), and the kernels
 * of a step have been loaded. Errors: nmt_decoder_begin's, the search's, the backend's. */
nmt_status nmt__rig_reserve(nmt__rig *r, int longest);
/* nmt__rig_reserve's sizes without its trial batch (nmt_decoder_reserve), for batches of
 * min(n_sent, decode.batch_sentences) sentences: nothing is decoded, no kernel loaded; what
 * nmt translate does for each window's longest source and line count, so that the window's
 * length-sorted batches reuse one arena instead of regrowing it batch after batch, and a
 * short input asks only for the hypotheses it has (decode.beam rows per sentence).
 * Errors: nmt_decoder_reserve's (NMT_ERR_NOMEM naming the bytes, decode.batch_sentences and
 * decode.beam). */
nmt_status nmt__rig_prepare(nmt__rig *r, int longest, int n_sent);
void nmt__rig_close(nmt__rig *r);

/* Decodes sentences s[order[0..nb)] as one batch (nb <= decode.batch_sentences) into the
 * slots order[j] of out (whose K equals the rig's). Sources longer than data.max_len - 1 are
 * cut (EOS needs a position), with a warning naming the line for the first few.
 * NMT_ERR_ABORTED, before decoding, when the rig's abort flag is raised. */
nmt_status nmt__rig_decode(nmt__rig *r, const nmt__sentence *s, const int *order, int nb,
                           nmt__hyps *out);

/* nmt_translate_to_text on an open rig (K = 1; its config's [decode] settings): every source
 * of src_path, best hypothesis detokenized, in input order, into *hyps_out[0..*n_out) (free
 * with nmt_translate_text_free). Errors: as nmt_translate_to_text; NMT_ERR_ABORTED between
 * batches once the rig's abort flag is raised. */
nmt_status nmt__rig_to_text(nmt__rig *r, const nmt_spm *spm, const char *src_path,
                            int src_is_shard, char ***hyps_out, long *n_out);

/* text[0..len) encoded with spm into a malloc'd *ids (*n ids; freed by the caller, also on
 * error). */
nmt_status nmt__encode_line(const nmt_spm *spm, const char *text, size_t len,
                            int32_t **ids, int *n);

/* order[0..n) = 0..n-1 sorted by source length (stable: input order among equal lengths). */
void nmt__sort_by_len(const nmt__sentence *s, int *order, long n);

#endif /* NMT_TRANSLATE_IMPL_H */
