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

/* One decoder with its buffers on the inference device, for batches of up to
 * decode.batch_sentences. K hypotheses per sentence; beam search whenever decode.beam > 1, K > 1
 * or scores are wanted (beam 1 then decodes exactly as greedy). */
typedef struct {
  const nmt_config *cfg;
  nmt_device dev;
  nmt_model *model;
  nmt_decoder *dec;
  float *params;
  int32_t *hbuf, *dbuf, *out_ids, *out_lens, *out_n;
  float *out_score, *out_logp;
  int K, use_beam;
  long cut, out_tokens; /* sources cut to data.max_len - 1; tokens output */
} nmt__rig;

/* Opens the device, uploads host_params (the model of cfg). On error, nmt__rig_close still
 * frees what was made. */
nmt_status nmt__rig_open(nmt__rig *r, const nmt_config *cfg, const float *host_params, int K,
                         int scores);
void nmt__rig_close(nmt__rig *r);

/* Decodes sentences s[order[0..nb)] as one batch (nb <= decode.batch_sentences) into the
 * slots order[j] of out (whose K equals the rig's). Sources longer than data.max_len - 1 are
 * cut (EOS needs a position), with a warning naming the line for the first few. */
nmt_status nmt__rig_decode(nmt__rig *r, const nmt__sentence *s, const int *order, int nb,
                           nmt__hyps *out);

/* text[0..len) encoded with spm into a malloc'd *ids (*n ids; freed by the caller, also on
 * error). */
nmt_status nmt__encode_line(const nmt_spm *spm, const char *text, size_t len,
                            int32_t **ids, int *n);

/* order[0..n) = 0..n-1 sorted by source length (stable: input order among equal lengths). */
void nmt__sort_by_len(const nmt__sentence *s, int *order, long n);

#endif /* NMT_TRANSLATE_IMPL_H */
