/* test_batcher.c — token-based batching over a shard: coverage, token cap, shuffle determinism,
 * BOS/EOS/PAD layout and counts, dropped pairs (nmt/data.h). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/config.h"
#include "nmt/data.h"
#include "test.h"

/* A shard whose pair i starts both sides with the id FIRST_ID + i, so a batch row tells which
 * pair it holds; the other ids are pseudo-random. Lengths 1..max_len (xorshift). */
enum { FIRST_ID = 4, VOCAB = 100000 };

typedef struct {
  long n;
  uint64_t *so, *to;
  int32_t *si, *ti;
  nmt_shard *shard;
} corpus;

static uint64_t next_rand(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 2685821657736338717ull;
}

static int make_corpus(corpus *c, long n, int max_len, uint64_t seed) {
  memset(c, 0, sizeof *c);
  c->n = n;
  c->so = malloc((size_t)(n + 1) * sizeof *c->so);
  c->to = malloc((size_t)(n + 1) * sizeof *c->to);
  c->si = malloc((size_t)(n * max_len) * sizeof *c->si);
  c->ti = malloc((size_t)(n * max_len) * sizeof *c->ti);
  c->so[0] = c->to[0] = 0;
  for (long i = 0; i < n; i++) {
    int ls = 1 + (int)(next_rand(&seed) % (uint64_t)max_len);
    /* Targets loosely follow sources, as translations do, with spread. */
    int lt = ls / 2 + 1 + (int)(next_rand(&seed) % (uint64_t)(ls + 1));
    if (lt > max_len) lt = max_len;
    c->so[i + 1] = c->so[i] + (uint64_t)ls;
    c->to[i + 1] = c->to[i] + (uint64_t)lt;
    for (int k = 0; k < ls; k++)
      c->si[c->so[i] + k] = k ? 4 + (int32_t)(next_rand(&seed) % (VOCAB - 4)) : FIRST_ID + (int)i;
    for (int k = 0; k < lt; k++)
      c->ti[c->to[i] + k] = k ? 4 + (int32_t)(next_rand(&seed) % (VOCAB - 4)) : FIRST_ID + (int)i;
  }
  char path[512];
  snprintf(path, sizeof path, "%s/b.shard", nmt_test_tmpdir());
  if (nmt_shard_write(path, VOCAB, n, c->so, c->si, c->to, c->ti) != NMT_OK) return 0;
  return nmt_shard_open(path, VOCAB, &c->shard) == NMT_OK;
}

static void free_corpus(corpus *c) {
  nmt_shard_close(c->shard);
  free(c->so);
  free(c->to);
  free(c->si);
  free(c->ti);
}

/* Fills batch `id` into a fresh buffer sized by nmt_batch_ints and checks its layout against
 * the corpus: src = x EOS PAD..., tgt_in = BOS y PAD..., tgt_out = y EOS PAD..., lengths,
 * token counts, the shape's numbers and the token cap. Marks seen[pair]++. Returns 1 if ok. */
static int check_batch(const corpus *c, const nmt_batcher *b, long id, int max_tokens,
                       int max_len, int *seen) {
  int n, S, T;
  long tt;
  nmt_batcher_shape(b, id, &n, &S, &T, &tt);
  if (n < 1 || (long)n * S > max_tokens || (long)n * T > max_tokens || S > max_len || T > max_len) {
    nmt_test_fail(__FILE__, __LINE__, "batch %ld: %d x (%d, %d) breaks max_tokens %d / max_len %d",
                  id, n, S, T, max_tokens, max_len);
    return 0;
  }
  size_t ints = nmt_batch_ints(n, S > T ? S : T);
  int32_t *buf = malloc((ints + 1) * sizeof *buf);
  buf[ints] = 0x5a5a5a5a; /* canary: the layout must stay inside nmt_batch_ints */
  nmt_batch bt;
  nmt_batch_layout(&bt, buf, n, S, T);
  nmt_batcher_fill(b, id, &bt);
  int ok = buf[ints] == 0x5a5a5a5a;
  long src_tok = 0, tgt_tok = 0, nonpad = 0;
  int max_s = 0, max_t = 0;
  for (int r = 0; ok && r < n; r++) {
    long p = bt.src[(size_t)r * S] - FIRST_ID;
    if (p < 0 || p >= c->n) {
      nmt_test_fail(__FILE__, __LINE__, "batch %ld row %d: first id %d is no pair", id, r,
                    bt.src[(size_t)r * S]);
      ok = 0;
      break;
    }
    seen[p]++;
    int ls = (int)(c->so[p + 1] - c->so[p]), lt = (int)(c->to[p + 1] - c->to[p]);
    const int32_t *x = c->si + c->so[p], *y = c->ti + c->to[p];
    const int32_t *src = bt.src + (size_t)r * S, *tin = bt.tgt_in + (size_t)r * T,
                  *tout = bt.tgt_out + (size_t)r * T;
    for (int j = 0; ok && j < S; j++)
      ok = src[j] == (j < ls ? x[j] : j == ls ? NMT_EOS_ID : NMT_PAD_ID);
    for (int j = 0; ok && j < T; j++)
      ok = tin[j] == (j == 0 ? NMT_BOS_ID : j <= lt ? y[j - 1] : NMT_PAD_ID) &&
           tout[j] == (j < lt ? y[j] : j == lt ? NMT_EOS_ID : NMT_PAD_ID);
    ok = ok && bt.src_lens[r] == ls + 1 && bt.tgt_lens[r] == lt + 1;
    if (!ok)
      nmt_test_fail(__FILE__, __LINE__, "batch %ld row %d (pair %ld): layout wrong", id, r, p);
    for (int j = 0; j < T; j++) nonpad += tout[j] != NMT_PAD_ID;
    src_tok += ls + 1;
    tgt_tok += lt + 1;
    if (ls + 1 > max_s) max_s = ls + 1;
    if (lt + 1 > max_t) max_t = lt + 1;
  }
  if (ok && (bt.src_tokens != src_tok || bt.tgt_tokens != tgt_tok || tt != tgt_tok ||
             nonpad != tgt_tok)) {
    nmt_test_fail(__FILE__, __LINE__,
                  "batch %ld: tokens src %ld/%ld tgt %ld/%ld shape %ld nonpad %ld", id,
                  bt.src_tokens, src_tok, bt.tgt_tokens, tgt_tok, tt, nonpad);
    ok = 0;
  }
  /* Padding is tight: the padded lengths are the longest row's. */
  if (ok && (S != max_s || T != max_t)) {
    nmt_test_fail(__FILE__, __LINE__, "batch %ld: padded to (%d, %d), longest rows (%d, %d)", id,
                  S, T, max_s, max_t);
    ok = 0;
  }
  free(buf);
  return ok;
}

NMT_TEST(batcher_epoch_covers_each_pair_once_within_cap) {
  corpus c;
  NMT_ASSERT(make_corpus(&c, 3000, 60, 7));
  const int max_tokens = 500, max_len = 48;
  long expect_dropped = 0;
  for (long i = 0; i < c.n; i++)
    expect_dropped += (c.so[i + 1] - c.so[i]) + 1 > (uint64_t)max_len ||
                      (c.to[i + 1] - c.to[i]) + 1 > (uint64_t)max_len;
  nmt_batcher *b;
  NMT_ASSERT_OK(nmt_batcher_create(c.shard, max_tokens, max_len, 1234, &b));
  NMT_ASSERT(expect_dropped > 0);
  NMT_ASSERT_EQ_INT(nmt_batcher_num_dropped(b), expect_dropped);
  long nb = nmt_batcher_num_batches(b);
  int *seen = calloc((size_t)c.n, sizeof *seen);
  char *batch_seen = calloc((size_t)nb, 1);
  int ok = 1;
  for (long e = 0; ok && e < 2; e++) {
    memset(seen, 0, (size_t)c.n * sizeof *seen);
    memset(batch_seen, 0, (size_t)nb);
    long padded = 0, real = 0;
    for (long i = 0; ok && i < nb; i++) {
      long id = nmt_batcher_order(b, e, i);
      if (id < 0 || id >= nb || batch_seen[id]++) {
        nmt_test_fail(__FILE__, __LINE__, "epoch %ld: order[%ld] = %ld repeats or is out of range",
                      e, i, id);
        ok = 0;
        break;
      }
      ok = check_batch(&c, b, id, max_tokens, max_len, seen);
      int n, S, T;
      long tt;
      nmt_batcher_shape(b, id, &n, &S, &T, &tt);
      padded += (long)n * T;
      real += tt;
    }
    for (long p = 0; ok && p < c.n; p++) {
      int fits = (c.so[p + 1] - c.so[p]) + 1 <= (uint64_t)max_len &&
                 (c.to[p + 1] - c.to[p]) + 1 <= (uint64_t)max_len;
      if (seen[p] != fits) {
        nmt_test_fail(__FILE__, __LINE__, "epoch %ld: pair %ld seen %d times (fits %d)", e, p,
                      seen[p], fits);
        ok = 0;
      }
    }
    /* Length sorting keeps target padding small; random batching would waste about half. */
    if (ok && real < padded * 0.7) {
      nmt_test_fail(__FILE__, __LINE__, "target padding too high: %ld real of %ld padded", real,
                    padded);
      ok = 0;
    }
  }
  free(seen);
  free(batch_seen);
  nmt_batcher_destroy(b);
  free_corpus(&c);
  NMT_ASSERT(ok);
}

static int same_order(const nmt_batcher *a, long ea, const nmt_batcher *b, long eb) {
  long nb = nmt_batcher_num_batches(a);
  for (long i = 0; i < nb; i++)
    if (nmt_batcher_order(a, ea, i) != nmt_batcher_order(b, eb, i)) return 0;
  return 1;
}

NMT_TEST(batcher_order_is_a_function_of_seed_and_epoch) {
  corpus c;
  NMT_ASSERT(make_corpus(&c, 2000, 40, 11));
  nmt_batcher *a, *b, *d;
  NMT_ASSERT_OK(nmt_batcher_create(c.shard, 400, 64, 99, &a));
  NMT_ASSERT_OK(nmt_batcher_create(c.shard, 400, 64, 99, &b));
  NMT_ASSERT_OK(nmt_batcher_create(c.shard, 400, 64, 100, &d));
  NMT_ASSERT(nmt_batcher_num_batches(a) > 20);
  /* Same seed and epoch: same order, whatever was asked before (the epoch cache). */
  long first_e3 = nmt_batcher_order(a, 3, 0);
  NMT_ASSERT(same_order(a, 0, b, 0));
  NMT_ASSERT(same_order(a, 5, b, 5));
  NMT_ASSERT_EQ_INT(nmt_batcher_order(b, 3, 0), first_e3);
  NMT_ASSERT_EQ_INT(nmt_batcher_order(a, 3, 0), first_e3);
  /* Different epochs or seeds: a different order (1 in n! by chance). */
  NMT_ASSERT(!same_order(a, 0, a, 1));
  NMT_ASSERT(!same_order(a, 1, b, 2));
  NMT_ASSERT(!same_order(a, 0, d, 0));
  /* The batches themselves do not depend on the seed. */
  for (long id = 0; id < nmt_batcher_num_batches(a); id++) {
    int n1, s1, t1, n2, s2, t2;
    long k1, k2;
    nmt_batcher_shape(a, id, &n1, &s1, &t1, &k1);
    nmt_batcher_shape(d, id, &n2, &s2, &t2, &k2);
    NMT_ASSERT(n1 == n2 && s1 == s2 && t1 == t2 && k1 == k2);
  }
  nmt_batcher_destroy(a);
  nmt_batcher_destroy(b);
  nmt_batcher_destroy(d);
  free_corpus(&c);
}

NMT_TEST(batcher_shuffle_is_uniform) {
  /* Over 4000 epochs every (position, batch) cell should hold about 4000/nb. A biased shuffle
   * (Sattolo's, which never leaves a batch in place, or j drawn from [0, n) at every step)
   * misses this by far more than the tolerance. */
  corpus c;
  NMT_ASSERT(make_corpus(&c, 12, 5, 3));
  nmt_batcher *b;
  NMT_ASSERT_OK(nmt_batcher_create(c.shard, 7, 7, 2024, &b));
  long nb = nmt_batcher_num_batches(b);
  NMT_ASSERT(nb >= 6 && nb <= 12);
  enum { EPOCHS = 4000 };
  int count[12][12] = {{0}};
  for (long e = 0; e < EPOCHS; e++)
    for (long i = 0; i < nb; i++) count[i][nmt_batcher_order(b, e, i)]++;
  double expect = (double)EPOCHS / nb, worst = 0;
  for (int i = 0; i < nb; i++)
    for (int j = 0; j < nb; j++) {
      double dev = count[i][j] > expect ? count[i][j] - expect : expect - count[i][j];
      if (dev > worst) worst = dev;
    }
  nmt_batcher_destroy(b);
  free_corpus(&c);
  /* One cell's sd is sqrt(EPOCHS p (1-p)), p = 1/nb; allow 5.5 sd. */
  double sd = __builtin_sqrt(EPOCHS * (1.0 / nb) * (1 - 1.0 / nb));
  if (worst > 5.5 * sd)
    nmt_test_fail(__FILE__, __LINE__, "a cell is off by %.0f from %.1f (sd %.1f)", worst, expect,
                  sd);
}

NMT_TEST(batcher_config_and_data_errors) {
  corpus c;
  NMT_ASSERT(make_corpus(&c, 50, 30, 5));
  nmt_batcher *b = (nmt_batcher *)1;
  NMT_ASSERT_EQ_STATUS(nmt_batcher_create(c.shard, 63, 64, 1, &b), NMT_ERR_CONFIG);
  NMT_ASSERT(b == NULL);
  NMT_ASSERT(strstr(nmt_last_error(), "max_tokens") != NULL);
  NMT_ASSERT_EQ_STATUS(nmt_batcher_create(c.shard, 64, 1, 1, &b), NMT_ERR_CONFIG);
  /* Every pair has >= 1 id a side, so with max_len 2 only 1-id pairs fit; with none: error. */
  long ones = 0;
  for (long i = 0; i < c.n; i++) ones += c.so[i + 1] - c.so[i] == 1 && c.to[i + 1] - c.to[i] == 1;
  nmt_status st = nmt_batcher_create(c.shard, 64, 2, 1, &b);
  if (ones == 0) {
    NMT_ASSERT_EQ_STATUS(st, NMT_ERR_DATA);
    NMT_ASSERT(strstr(nmt_last_error(), "no pair") != NULL);
  } else {
    NMT_ASSERT_OK(st);
    NMT_ASSERT_EQ_INT(nmt_batcher_num_dropped(b), c.n - ones);
    nmt_batcher_destroy(b);
  }
  free_corpus(&c);
}

NMT_TEST(batcher_batch_ints_bounds_layout) {
  /* The trainer sizes one buffer by nmt_batch_ints(max_sent, max_len) and lays out any smaller
   * shape in it; the five arrays must not overlap and must end within that size. */
  enum { NS = 7, L = 13 };
  size_t ints = nmt_batch_ints(NS, L);
  int32_t *buf = calloc(ints, sizeof *buf);
  nmt_batch b;
  nmt_batch_layout(&b, buf, NS, L, L);
  NMT_ASSERT(b.src == buf);
  NMT_ASSERT(b.tgt_in == b.src + NS * L);
  NMT_ASSERT(b.tgt_out == b.tgt_in + NS * L);
  NMT_ASSERT(b.src_lens == b.tgt_out + NS * L);
  NMT_ASSERT(b.tgt_lens == b.src_lens + NS);
  NMT_ASSERT(b.tgt_lens + NS == buf + ints);
  nmt_batch_layout(&b, buf, 3, 5, 11);
  NMT_ASSERT(b.tgt_lens + 3 <= buf + ints);
  NMT_ASSERT(b.n_sent == 3 && b.src_len == 5 && b.tgt_len == 11);
  free(buf);
}

/* The loader's lock-free epoch order is the same permutation nmt_batcher_order serves. */
NMT_TEST(batcher_epoch_order_matches_order) {
  const char *dir = nmt_test_tmpdir();
  char path[512];
  snprintf(path, sizeof path, "%s/o.shard", dir);
  enum { NP = 300 };
  uint64_t so[NP + 1], to[NP + 1];
  int32_t *ids = malloc(NP * 20 * sizeof(int32_t));
  NMT_ASSERT(ids != NULL);
  so[0] = to[0] = 0;
  for (int i = 0; i < NP; i++) {
    int len = 1 + (i * 7) % 17;
    so[i + 1] = so[i] + (uint64_t)len;
    to[i + 1] = to[i] + (uint64_t)len;
  }
  for (uint64_t k = 0; k < so[NP]; k++) ids[k] = 4 + (int32_t)(k % 50);
  NMT_ASSERT_OK(nmt_shard_write(path, 64, NP, so, ids, to, ids));
  free(ids);
  nmt_shard *s;
  nmt_batcher *b;
  NMT_ASSERT_OK(nmt_shard_open(path, 64, &s));
  NMT_ASSERT_OK(nmt_batcher_create(s, 60, 20, 99, &b));
  long n = nmt_batcher_num_batches(b);
  NMT_ASSERT(n > 10);
  long *perm = malloc((size_t)n * sizeof *perm);
  int same = 1;
  for (long e = 0; e < 3; e++) {
    nmt_batcher_epoch_order(b, e, perm);
    for (long i = 0; i < n; i++) same &= perm[i] == nmt_batcher_order(b, e, i);
  }
  free(perm);
  nmt_batcher_destroy(b);
  nmt_shard_close(s);
  NMT_ASSERT(same);
}
