/* data/batch.c — batch layout and the token-based batcher (DESIGN.md "Data"; nmt/data.h).
 *
 * Pairs are sorted by (source length, target length, pair index) and cut, in that order, into
 * batches whose padded size max(n*src_len, n*tgt_len) stays within max_tokens, so a batch holds
 * sentences of nearly equal length and little padding. The order in which an epoch visits the
 * batches is a Fisher-Yates shuffle keyed by (seed, epoch), so a resumed run needs only
 * (epoch, index) to continue exactly. */
#include <assert.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/data.h"
#include "nmt/rng.h"
#include "nmt/types.h"

size_t nmt_batch_ints(int max_sent, int max_len) {
  return 3 * (size_t)max_sent * (size_t)max_len + 2 * (size_t)max_sent;
}

void nmt_batch_layout(nmt_batch *b, int32_t *buf, int n_sent, int src_len, int tgt_len) {
  size_t n = (size_t)n_sent;
  b->n_sent = n_sent;
  b->src_len = src_len;
  b->tgt_len = tgt_len;
  b->src_tokens = 0;
  b->tgt_tokens = 0;
  b->src = buf;
  b->tgt_in = b->src + n * (size_t)src_len;
  b->tgt_out = b->tgt_in + n * (size_t)tgt_len;
  b->src_lens = b->tgt_out + n * (size_t)tgt_len;
  b->tgt_lens = b->src_lens + n;
  b->epoch = 0;
  b->index = 0;
}

/* The last epoch's permutation, kept so that nmt_batcher_order is O(1) per call. A separate
 * allocation, because the batcher is shared read-only (const) with its callers. */
typedef struct {
  pthread_mutex_t mu;
  long epoch; /* -1: none yet */
  long *perm;
} order_cache;

struct nmt_batcher {
  const nmt_shard *shard;
  uint64_t seed;
  long n_batches;
  long n_dropped;
  long *pairs;        /* kept pair indices, length-sorted; batch b is pairs[start[b]..start[b+1]) */
  long *start;        /* n_batches + 1 */
  int *src_len;       /* padded source length of each batch (ids + EOS) */
  int *tgt_len;       /* padded target length of each batch (ids + BOS/EOS) */
  long *tgt_tokens;   /* non-pad target ids of each batch */
  order_cache *cache;
};

typedef struct {
  int src, tgt; /* lengths with EOS/BOS */
  long idx;
} keyed_pair;

static int by_length(const void *a, const void *b) {
  const keyed_pair *x = a, *y = b;
  if (x->src != y->src) return x->src < y->src ? -1 : 1;
  if (x->tgt != y->tgt) return x->tgt < y->tgt ? -1 : 1;
  return (x->idx > y->idx) - (x->idx < y->idx); /* stable: qsort is not */
}

nmt_status nmt_batcher_create(const nmt_shard *shard, int max_tokens, int max_len, uint64_t seed,
                              nmt_batcher **out) {
  *out = NULL;
  if (max_len < 2)
    return nmt_errorf(NMT_ERR_CONFIG, "data.max_len = %d: must be >= 2 (one id plus EOS)",
                      max_len);
  if (max_tokens < max_len)
    return nmt_errorf(NMT_ERR_CONFIG,
                      "data.max_tokens = %d < data.max_len = %d: a pair of the longest allowed "
                      "length would not fit in any batch",
                      max_tokens, max_len);
  long n = nmt_shard_num_pairs(shard);
  nmt_batcher *b = calloc(1, sizeof *b);
  keyed_pair *keys = malloc((size_t)(n > 0 ? n : 1) * sizeof *keys);
  if (!b || !keys) {
    free(b);
    free(keys);
    return nmt_errorf(NMT_ERR_NOMEM, "batcher for %ld pairs", n);
  }
  b->shard = shard;
  b->seed = seed;
  long kept = 0;
  for (long i = 0; i < n; i++) {
    int s = nmt_shard_src_len(shard, i) + 1, t = nmt_shard_tgt_len(shard, i) + 1;
    if (s > max_len || t > max_len) {
      b->n_dropped++;
      continue;
    }
    keys[kept++] = (keyed_pair){s, t, i};
  }
  if (kept == 0) {
    free(keys);
    free(b);
    return nmt_errorf(NMT_ERR_DATA, "no pair of %ld fits data.max_len = %d (with EOS/BOS)", n,
                      max_len);
  }
  qsort(keys, (size_t)kept, sizeof *keys, by_length);

  /* Every kept pair fits alone (len <= max_len <= max_tokens), so at most `kept` batches. */
  b->pairs = malloc((size_t)kept * sizeof *b->pairs);
  b->start = malloc((size_t)(kept + 1) * sizeof *b->start);
  b->src_len = malloc((size_t)kept * sizeof *b->src_len);
  b->tgt_len = malloc((size_t)kept * sizeof *b->tgt_len);
  b->tgt_tokens = malloc((size_t)kept * sizeof *b->tgt_tokens);
  b->cache = calloc(1, sizeof *b->cache);
  if (!b->pairs || !b->start || !b->src_len || !b->tgt_len || !b->tgt_tokens || !b->cache) {
    free(keys);
    nmt_batcher_destroy(b);
    return nmt_errorf(NMT_ERR_NOMEM, "batcher for %ld pairs", n);
  }
  long nb = 0, first = 0;
  int ms = 0, mt = 0;
  long toks = 0;
  for (long k = 0; k < kept; k++) {
    int s = keys[k].src > ms ? keys[k].src : ms, t = keys[k].tgt > mt ? keys[k].tgt : mt;
    long rows = k - first + 1;
    if (k > first && (rows * s > max_tokens || rows * t > max_tokens)) {
      b->start[nb] = first;
      b->src_len[nb] = ms;
      b->tgt_len[nb] = mt;
      b->tgt_tokens[nb] = toks;
      nb++;
      first = k;
      s = keys[k].src;
      t = keys[k].tgt;
      toks = 0;
    }
    ms = s;
    mt = t;
    toks += keys[k].tgt;
    b->pairs[k] = keys[k].idx;
  }
  b->start[nb] = first;
  b->src_len[nb] = ms;
  b->tgt_len[nb] = mt;
  b->tgt_tokens[nb] = toks;
  nb++;
  b->start[nb] = kept;
  b->n_batches = nb;
  free(keys);

  b->cache->epoch = -1;
  b->cache->perm = malloc((size_t)nb * sizeof *b->cache->perm);
  if (!b->cache->perm || pthread_mutex_init(&b->cache->mu, NULL) != 0) {
    free(b->cache->perm);
    free(b->cache);
    b->cache = NULL;
    nmt_batcher_destroy(b);
    return nmt_errorf(NMT_ERR_NOMEM, "batcher order for %ld batches", nb);
  }
  *out = b;
  return NMT_OK;
}

void nmt_batcher_destroy(nmt_batcher *b) {
  if (!b) return;
  if (b->cache) {
    pthread_mutex_destroy(&b->cache->mu);
    free(b->cache->perm);
    free(b->cache);
  }
  free(b->pairs);
  free(b->start);
  free(b->src_len);
  free(b->tgt_len);
  free(b->tgt_tokens);
  free(b);
}

long nmt_batcher_num_batches(const nmt_batcher *b) { return b->n_batches; }
long nmt_batcher_num_dropped(const nmt_batcher *b) { return b->n_dropped; }

/* Fisher-Yates (Knuth, TAOCP vol. 2, Algorithm 3.4.2P): for i = n-1 .. 1 swap perm[i] with
 * perm[j], j uniform in [0, i], drawn as the high word of u32 * (i+1) (Lemire 2019; the bias is
 * below (i+1)/2^32, nothing for batch counts). */
static void shuffle(long *perm, long n, uint64_t seed, long epoch) {
  for (long i = 0; i < n; i++) perm[i] = i;
  for (long i = n - 1; i > 0; i--) {
    uint32_t r = nmt_rng_u32(seed, (uint64_t)epoch, (uint64_t)i);
    long j = (long)(((uint64_t)r * (uint64_t)(i + 1)) >> 32);
    long x = perm[i];
    perm[i] = perm[j];
    perm[j] = x;
  }
}

void nmt_batcher_epoch_order(const nmt_batcher *b, long epoch, long *perm) {
  shuffle(perm, b->n_batches, b->seed, epoch);
}

long nmt_batcher_order(const nmt_batcher *b, long epoch, long index) {
  assert(index >= 0 && index < b->n_batches);
  order_cache *c = b->cache;
  pthread_mutex_lock(&c->mu);
  if (c->epoch != epoch) {
    shuffle(c->perm, b->n_batches, b->seed, epoch);
    c->epoch = epoch;
  }
  long id = c->perm[index];
  pthread_mutex_unlock(&c->mu);
  return id;
}

void nmt_batcher_shape(const nmt_batcher *b, long id, int *n_sent, int *src_len, int *tgt_len,
                       long *tgt_tokens) {
  assert(id >= 0 && id < b->n_batches);
  if (n_sent) *n_sent = (int)(b->start[id + 1] - b->start[id]);
  if (src_len) *src_len = b->src_len[id];
  if (tgt_len) *tgt_len = b->tgt_len[id];
  if (tgt_tokens) *tgt_tokens = b->tgt_tokens[id];
}

void nmt_batcher_fill(const nmt_batcher *b, long id, nmt_batch *out) {
  assert(id >= 0 && id < b->n_batches);
  int n = (int)(b->start[id + 1] - b->start[id]);
  int S = out->src_len, T = out->tgt_len;
  assert(out->n_sent == n && S >= b->src_len[id] && T >= b->tgt_len[id]);
  long src_tokens = 0, tgt_tokens = 0;
  for (int r = 0; r < n; r++) {
    long p = b->pairs[b->start[id] + r];
    int ls = nmt_shard_src_len(b->shard, p), lt = nmt_shard_tgt_len(b->shard, p);
    int32_t *src = out->src + (size_t)r * S;
    int32_t *tin = out->tgt_in + (size_t)r * T;
    int32_t *tout = out->tgt_out + (size_t)r * T;
    /* src = x EOS; tgt_out = y EOS; tgt_in = BOS y (y copied once, then shifted). */
    nmt_shard_copy_src(b->shard, p, src);
    src[ls] = NMT_EOS_ID;
    for (int j = ls + 1; j < S; j++) src[j] = NMT_PAD_ID;
    nmt_shard_copy_tgt(b->shard, p, tout);
    tin[0] = NMT_BOS_ID;
    memcpy(tin + 1, tout, (size_t)lt * sizeof *tin);
    tout[lt] = NMT_EOS_ID;
    for (int j = lt + 1; j < T; j++) tin[j] = tout[j] = NMT_PAD_ID;
    out->src_lens[r] = ls + 1;
    out->tgt_lens[r] = lt + 1;
    src_tokens += ls + 1;
    tgt_tokens += lt + 1;
  }
  out->src_tokens = src_tokens;
  out->tgt_tokens = tgt_tokens;
}
