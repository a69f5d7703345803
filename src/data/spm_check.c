/* data/spm_check.c — data.spm_model checked at train start: a loadable SentencePiece model of
 * [model] vocab pieces, the one the shards were encoded with. Without it a checkpoint, a shard or
 * another vocabulary's model trains to the end, is embedded in every checkpoint, and only
 * `translate` fails. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "nmt/data.h"
#include "nmt/log.h"
#include "nmt/spm.h"

nmt_status nmt_spm_file_hash(const char *path, uint32_t *hash) {
  NMT_TRY(nmt_file_crc32(path, hash, NULL));
  if (*hash == 0) *hash = 1;
  return NMT_OK;
}

/* The shard of [data] `key` was encoded with the model of hash `want`, or does not say. */
static nmt_status check_shard(const char *key, const char *shard, const char *model,
                              uint32_t want) {
  uint32_t got;
  NMT_TRY(nmt_shard_read_spm_hash(shard, &got));
  if (got == 0) {
    nmt_log(NMT_LOG_WARN, "[data] %s = \"%s\" does not record its SentencePiece model (written "
            "before nmt recorded it, or by `nmt shard` from id files): cannot check that its "
            "ids come from [data] spm_model = \"%s\"; remove it and rerun tools/prepare-data.sh "
            "to have it checked", key, shard, model);
    return NMT_OK;
  }
  if (got != want)
    return nmt_errorf(NMT_ERR_CONFIG,
                      "[data] spm_model = \"%s\" (hash %08x) is not the SentencePiece model "
                      "[data] %s = \"%s\" was encoded with (hash %08x): name the spm.model "
                      "tools/prepare-data.sh wrote next to that shard",
                      model, want, key, shard, got);
  return NMT_OK;
}

/* The key's error, the library's text inside: it must not end with that text, which the
 * command line has printed already (nmt_log_errors_once would drop it as a repeat). */
static nmt_status config_error(const char *model) {
  return nmt_errorf(NMT_ERR_CONFIG, "[data] spm_model = \"%s\" cannot be used (%s); name the "
                    "spm.model that tools/prepare-data.sh wrote with the shards",
                    model, nmt_last_error());
}

nmt_status nmt_data_check_spm(const nmt_config *cfg) {
  const char *model = cfg->data_spm_model;
  if (!model[0]) return NMT_OK;
  nmt_spm *sp;
  if (nmt_spm_load(model, &sp) != NMT_OK) return config_error(model);
  nmt_status s = nmt_spm_check_vocab(sp, cfg->model_vocab);
  nmt_spm_free(sp);
  uint32_t hash;
  if (s != NMT_OK || nmt_spm_file_hash(model, &hash) != NMT_OK) return config_error(model);
  const char *keys[] = {"train", "valid", "test"};
  const char *shards[] = {cfg->data_train, cfg->data_valid, cfg->data_test};
  for (int i = 0; i < 3; i++)
    if (shards[i][0]) NMT_TRY(check_shard(keys[i], shards[i], model, hash));
  return NMT_OK;
}
