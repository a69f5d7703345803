/* test/test_logp_topk.c — decoding's per-step selection on the reference backend
 * (src/ref/logp_topk.c, contract nmt/backend.h): ids and log-probabilities against a brute
 * force (every outputtable id sorted, the normaliser in long double), ties, NaN, infinite
 * rows, k beyond the outputtable ids, the prefix property beam search relies on, greedy's
 * k = 1 without logp against the argmax op, a NaN beside the best in a block, and the two
 * compilations of the row loop (SSE2, AVX2) bitwise equal. The CUDA twin:
 * test/test_cuda_logp_topk.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/ref.h"
#include "nmt/rng.h"
#include "nmt/types.h"
#include "test.h"

typedef struct {
  float k;
  int id;
} ranked;

static float key(float v) { return v == v ? v : -INFINITY; }

static int by_rank(const void *pa, const void *pb) {
  const ranked *a = pa, *b = pb;
  if (a->k != b->k) return a->k > b->k ? -1 : 1;
  return a->id < b->id ? -1 : a->id > b->id;
}

/* The brute force of one row: all outputtable ids sorted; returns 1 when the op's ids and
 * logp (may be NULL) agree (logp within 1e-6 absolute of the long double value). */
static int check_row(const float *x, int V, int k, const int32_t *ids, const float *logp,
                     int row) {
  ranked *all = malloc((size_t)V * sizeof *all);
  int n = 0;
  long double mx = -INFINITY, s = 0;
  for (int v = 0; v < V; v++) {
    if (key(x[v]) > mx) mx = key(x[v]);
    if (v != NMT_PAD_ID && v != NMT_BOS_ID) all[n++] = (ranked){key(x[v]), v};
  }
  qsort(all, (size_t)n, sizeof *all, by_rank);
  for (int v = 0; v < V; v++) s += mx == -INFINITY ? 0 : expl((long double)key(x[v]) - mx);
  const long double lse = mx == -INFINITY ? -INFINITY : mx + logl(s);
  int ok = 1;
  for (int j = 0; j < k && ok; j++) {
    const int want = j < n ? all[j].id : -1;
    if (ids[j] != want) {
      nmt_test_fail(__FILE__, __LINE__, "row %d slot %d: id %d, want %d", row, j, (int)ids[j],
                    want);
      ok = 0;
    }
    if (!ok || !logp) continue;
    const double lp = j >= n || mx == -INFINITY ? -INFINITY
                      : mx == INFINITY           ? NAN
                                                 : (double)((long double)all[j].k - lse);
    const int same = isnan(lp) ? isnan(logp[j])
                     : isinf(lp) ? logp[j] == lp
                                 : fabs((double)logp[j] - lp) <= 1e-6 * (1 + fabs(lp));
    if (!same) {
      nmt_test_fail(__FILE__, __LINE__, "row %d slot %d (id %d): logp %.9g, want %.9g", row, j,
                    (int)ids[j], (double)logp[j], lp);
      ok = 0;
    }
  }
  free(all);
  return ok;
}

/* Rows of special cases, then random ones; every row checked for k in {1, 4, 9} with and
 * without logp. */
NMT_TEST(logp_topk_matches_brute_force) {
  enum { V = 37, R = 12, KMAX = 9 };
  float x[R * V];
  for (int i = 0; i < R * V; i++) x[i] = 3.0f * nmt_rng_normal(5, 1, (uint64_t)i);
  float *r1 = x + 1 * V, *r2 = x + 2 * V, *r3 = x + 3 * V, *r4 = x + 4 * V, *r5 = x + 5 * V;
  float *r6 = x + 6 * V, *r7 = x + 7 * V;
  for (int v = 0; v < V; v++) r1[v] = (float)(v % 4); /* ties everywhere: lower ids first */
  r2[NMT_PAD_ID] = r2[NMT_BOS_ID] = 100.0f;           /* never-outputs win by far: skipped, */
  for (int v = 5; v < V; v += 3) r3[v] = NAN;         /* but counted in the normaliser */
  r3[7] = 50.0f;
  for (int v = 0; v < V; v++) r4[v] = -INFINITY;      /* no information: logp -inf */
  r4[9] = NAN;
  r5[11] = INFINITY;                                  /* NaN log-probabilities */
  for (int v = 0; v < V; v++) r6[v] = v & 1 ? -0.0f : 0.0f; /* signed zeros tie */
  for (int v = 0; v < V; v++) r7[v] = -INFINITY;      /* -inf keys still rank by id */
  r7[20] = 1.0f;
  const int ks[3] = {1, 4, KMAX};
  int32_t ids[R * KMAX];
  float logp[R * KMAX];
  for (int c = 0; c < 3; c++) {
    const int k = ks[c];
    for (int with = 0; with < 2; with++) {
      NMT_ASSERT_OK(nmt_ref_logp_topk(NULL, ids, with ? logp : NULL, x, R, V, k));
      for (int r = 0; r < R; r++)
        if (!check_row(x + r * V, V, k, ids + r * k, with ? logp + r * k : NULL, r)) return;
    }
  }
  /* the rigged rows say what they were made for */
  NMT_ASSERT_OK(nmt_ref_logp_topk(NULL, ids, logp, x, R, V, 4));
  NMT_ASSERT_EQ_INT(ids[1 * 4 + 0], 3);
  NMT_ASSERT_EQ_INT(ids[1 * 4 + 1], 7);
  NMT_ASSERT(ids[2 * 4] != NMT_PAD_ID && ids[2 * 4] != NMT_BOS_ID && logp[2 * 4] < -80.0f);
  NMT_ASSERT_EQ_INT(ids[3 * 4], 7);
  NMT_ASSERT(isinf(logp[4 * 4]) && logp[4 * 4] < 0);
  NMT_ASSERT_EQ_INT(ids[5 * 4], 11);
  NMT_ASSERT(isnan(logp[5 * 4]));
  NMT_ASSERT_EQ_INT(ids[6 * 4], 1);
  NMT_ASSERT_EQ_INT(ids[7 * 4 + 0], 20);
  NMT_ASSERT_EQ_INT(ids[7 * 4 + 1], 1);
  NMT_ASSERT(logp[7 * 4] == 0.0f && isinf(logp[7 * 4 + 1]));
}

/* A row's top-k' is the first k' of its top-k (beam search asks 2 x beam and reads fewer). */
NMT_TEST(logp_topk_prefix_and_small_vocab) {
  enum { V = 1000, R = 3, K = 64 };
  float *x = malloc(sizeof(float) * R * V);
  NMT_ASSERT(x);
  for (int i = 0; i < R * V; i++) x[i] = (float)(nmt_rng_u32(9, 2, (uint64_t)i) % 50); /* ties */
  int32_t big[R * K], small[R * 5];
  float lbig[R * K], lsmall[R * 5];
  NMT_ASSERT_OK(nmt_ref_logp_topk(NULL, big, lbig, x, R, V, K));
  NMT_ASSERT_OK(nmt_ref_logp_topk(NULL, small, lsmall, x, R, V, 5));
  for (int r = 0; r < R; r++) {
    if (!check_row(x + r * V, V, K, big + r * K, lbig + r * K, r)) break;
    for (int j = 0; j < 5; j++) {
      NMT_ASSERT_EQ_INT(small[r * 5 + j], big[r * K + j]);
      NMT_ASSERT(lsmall[r * 5 + j] == lbig[r * K + j]);
    }
  }
  free(x);
  /* V = 4: ids 1 and 3 only; k = 3 leaves one -1 slot. V = 1: <pad> alone, nothing. */
  const float y[4] = {9, 1, 8, 2};
  int32_t ids[3];
  float lp[3];
  NMT_ASSERT_OK(nmt_ref_logp_topk(NULL, ids, lp, y, 1, 4, 3));
  NMT_ASSERT(ids[0] == 3 && ids[1] == 1 && ids[2] == -1);
  NMT_ASSERT(isinf(lp[2]) && lp[0] < 0 && lp[0] > lp[1]);
  if (!check_row(y, 4, 3, ids, lp, 0)) return;
  NMT_ASSERT_OK(nmt_ref_logp_topk(NULL, ids, lp, y, 1, 1, 2));
  NMT_ASSERT(ids[0] == -1 && ids[1] == -1 && isinf(lp[0]));
}

/* Greedy's selection: k = 1 without logp is the argmax op, re-ranked without <pad>/<s> when
 * one of them wins (what greedy decoding did before the op existed). */
NMT_TEST(logp_topk_k1_is_greedy_argmax) {
  enum { V = 300, R = 40 };
  float *x = malloc(sizeof(float) * R * V);
  NMT_ASSERT(x);
  for (int i = 0; i < R * V; i++) x[i] = nmt_rng_normal(11, 4, (uint64_t)i);
  for (int r = 0; r < R; r += 4) x[r * V + (r % 8 ? NMT_BOS_ID : NMT_PAD_ID)] = 30.0f;
  for (int v = 0; v < V; v++) x[5 * V + v] = NAN; /* all NaN: id 1 */
  int32_t am[R], top[R];
  NMT_ASSERT_OK(nmt_ref_argmax(NULL, am, x, R, V));
  NMT_ASSERT_OK(nmt_ref_logp_topk(NULL, top, NULL, x, R, V, 1));
  int reranked = 0;
  for (int r = 0; r < R; r++) {
    int want = am[r];
    if (want == NMT_PAD_ID || want == NMT_BOS_ID) {
      reranked++;
      want = -1;
      for (int v = 0; v < V; v++)
        if (v != NMT_PAD_ID && v != NMT_BOS_ID && (want < 0 || key(x[r * V + v]) > key(x[r * V + want])))
          want = v;
    }
    NMT_ASSERT_EQ_INT(top[r], want);
  }
  NMT_ASSERT(reranked >= R / 4);
  free(x);
}

NMT_TEST(logp_topk_errors) {
  float x[4] = {0};
  int32_t ids[4];
  NMT_ASSERT_EQ_STATUS(nmt_ref_logp_topk(NULL, ids, NULL, x, -1, 4, 1), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_ref_logp_topk(NULL, ids, NULL, x, 1, 0, 1), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_ref_logp_topk(NULL, ids, NULL, x, 1, 4, 0), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_ref_logp_topk(NULL, ids, NULL, x, 1, 4, NMT_TOPK_MAX + 1),
                       NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_STATUS(nmt_ref_logp_topk(NULL, NULL, NULL, x, 1, 4, 1), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(nmt_ref_logp_topk(NULL, NULL, NULL, NULL, 0, 4, 1)); /* no rows: nothing */
}

/* A NaN beside the row's best in the same vector lane of a block must not hide it: the
 * block's maximum is taken over keys (NaN read as -inf). The best (40) is at id 16, the NaNs
 * at ids 20 and 24 (the lanes it meets in 4- and 8-lane maxima), and block 0 holds a 10, so
 * with k = 1 a lost 40 would make block 1 look beaten and be skipped. */
NMT_TEST(logp_topk_nan_beside_the_best) {
  enum { V = 64, K = 1 };
  float x[V];
  for (int v = 0; v < V; v++) x[v] = nmt_rng_normal(13, 0, (uint64_t)v);
  x[5] = 10.0f;
  x[16] = 40.0f;
  x[20] = x[24] = NAN;
  for (int path = 0; path < 2; path++) {
    if (nmt__ref_logp_topk_path(path) != path) continue; /* no AVX2 here */
    int32_t ids[K];
    float lp[K];
    NMT_ASSERT_OK(nmt_ref_logp_topk(NULL, ids, lp, x, 1, V, K));
    NMT_ASSERT_EQ_INT(ids[0], 16);
    NMT_ASSERT(lp[0] > -1e-6f && lp[0] <= 0.0f); /* e^40 dwarfs every other term */
    if (!check_row(x, V, K, ids, lp, 0)) break;
  }
  nmt__ref_logp_topk_path(-1);
}

/* The row loop's two compilations (SSE2, AVX2) give the same bits: ids and logp of rows of
 * every length class (shorter than a block, ragged tails, the Bible model's 8000), with NaN,
 * infinities and ties among them. Skipped where the CPU has no AVX2. */
NMT_TEST(logp_topk_paths_are_bitwise_equal) {
  if (nmt__ref_logp_topk_path(1) != 1) NMT_SKIP("no AVX2 on this CPU (or not x86-64)");
  static const int Vs[] = {3, 16, 37, 1003, 8000};
  enum { R = 6, K = 9 };
  for (size_t c = 0; c < sizeof Vs / sizeof *Vs; c++) {
    const int V = Vs[c];
    float *x = malloc(sizeof(float) * R * V);
    NMT_ASSERT(x);
    for (int i = 0; i < R * V; i++) x[i] = 4.0f * nmt_rng_normal(17, (uint64_t)c, (uint64_t)i);
    x[V / 2] = NAN;                            /* row 0 */
    for (int v = 0; v < V; v += 2) x[V + v] = (float)(v % 5); /* row 1: ties */
    x[2 * V + V - 1] = INFINITY;               /* row 2 */
    for (int v = 0; v < V; v++) x[3 * V + v] = -INFINITY; /* row 3 */
    int32_t a_ids[R * K], b_ids[R * K];
    float a_lp[R * K], b_lp[R * K];
    NMT_ASSERT_EQ_INT(nmt__ref_logp_topk_path(0), 0);
    NMT_ASSERT_OK(nmt_ref_logp_topk(NULL, a_ids, a_lp, x, R, V, K));
    NMT_ASSERT_EQ_INT(nmt__ref_logp_topk_path(1), 1);
    NMT_ASSERT_OK(nmt_ref_logp_topk(NULL, b_ids, b_lp, x, R, V, K));
    NMT_ASSERT(memcmp(a_ids, b_ids, sizeof a_ids) == 0);
    NMT_ASSERT(memcmp(a_lp, b_lp, sizeof a_lp) == 0);
    for (int r = 0; r < R; r++)
      if (!check_row(x + (size_t)r * V, V, K, a_ids + r * K, a_lp + r * K, r)) break;
    free(x);
  }
  nmt__ref_logp_topk_path(-1);
}

/* logp_at (ensemble decoding's scores): at logp_topk's own ids it gives logp_topk's logp
 * bitwise, on each compilation of the row loop; at any ids (pad and bos too, repeated ids,
 * -1) it gives log_softmax within 1e-6 of the long double value, -inf at -1 and in a row of
 * -inf keys, NaN in a row holding +inf; and it refuses bad arguments. */
NMT_TEST(logp_at_matches_logp_topk_and_brute_force) {
  static const int Vs[] = {3, 16, 37, 1003, 8000};
  enum { R = 6, K = 9 };
  for (int p = 0; p < 2; p++) {
    if (nmt__ref_logp_topk_path(p) != p) continue; /* no AVX2 here */
    for (size_t c = 0; c < sizeof Vs / sizeof *Vs; c++) {
      const int V = Vs[c];
      float *x = malloc(sizeof(float) * R * V);
      NMT_ASSERT(x);
      for (int i = 0; i < R * V; i++) x[i] = 4.0f * nmt_rng_normal(23, (uint64_t)c, (uint64_t)i);
      x[V / 2] = NAN;                                           /* row 0 */
      for (int v = 0; v < V; v += 2) x[V + v] = (float)(v % 5); /* row 1: ties */
      x[2 * V + V - 1] = INFINITY;                              /* row 2 */
      for (int v = 0; v < V; v++) x[3 * V + v] = -INFINITY;     /* row 3 */
      int32_t ids[R * K], any[R * K];
      float lp[R * K], at[R * K];
      NMT_ASSERT_OK(nmt_ref_logp_topk(NULL, ids, lp, x, R, V, K));
      NMT_ASSERT_OK(nmt_ref_logp_at(NULL, at, ids, x, R, V, K));
      NMT_ASSERT(memcmp(lp, at, sizeof lp) == 0);
      for (int i = 0; i < R * K; i++)
        any[i] = i % 7 == 3 ? -1 : (int32_t)((i * 7919u + c) % (unsigned)V);
      NMT_ASSERT_OK(nmt_ref_logp_at(NULL, at, any, x, R, V, K));
      for (int r = 0; r < R; r++) {
        const float *row = x + (size_t)r * V;
        long double mx = -INFINITY, s = 0;
        for (int v = 0; v < V; v++) mx = key(row[v]) > mx ? key(row[v]) : mx;
        for (int v = 0; v < V; v++) s += mx == -INFINITY ? 0 : expl((long double)key(row[v]) - mx);
        for (int j = 0; j < K; j++) {
          const int id = any[r * K + j];
          const float got = at[r * K + j];
          const double want = id < 0 || mx == -INFINITY ? -INFINITY
                              : mx == INFINITY           ? NAN
                                  : (double)((long double)key(row[id]) - mx - logl(s));
          const int same = isnan(want) ? isnan(got)
                           : isinf(want) ? got == want
                                         : fabs((double)got - want) <= 1e-6 * (1 + fabs(want));
          if (!same)
            nmt_test_fail(__FILE__, __LINE__, "path %d V %d row %d slot %d (id %d): %.9g, want "
                          "%.9g", p, V, r, j, id, (double)got, want);
        }
      }
      free(x);
    }
  }
  nmt__ref_logp_topk_path(-1);
  float x[4] = {0}, lp[2];
  int32_t ids[2] = {0, 1};
  NMT_ASSERT_EQ_INT(nmt_ref_logp_at(NULL, lp, ids, x, 1, 4, 0), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_INT(nmt_ref_logp_at(NULL, NULL, ids, x, 1, 4, 2), NMT_ERR_INTERNAL);
  NMT_ASSERT_EQ_INT(nmt_ref_logp_at(NULL, lp, ids, x, 1, 0, 2), NMT_ERR_INTERNAL);
  NMT_ASSERT_OK(nmt_ref_logp_at(NULL, NULL, NULL, NULL, 0, 4, 2));
}
