/* ref/logp_topk_lanes.h — logp_topk's row loop for vectors of LANES floats (4 or 8), included
 * by src/ref/logp_topk.c once per width, which defines LANES, optionally LANES_TARGET (a
 * target attribute for every function below), BLK (16, a multiple of 8), INL, key() and
 * insert_range(). Defines rows_<LANES>(ids, logp, x, R, V, k): the op's work on R rows.
 *
 * The same bits at every width: each lane computes the same fp32 operations; a block's
 * maximum is a maximum (its order cannot change the value); the double sum keeps 8
 * accumulators, accumulator j adding the terms of ids v = j mod 8 in increasing order, added
 * at the end as ((L0 + L2) + (L4 + L6)) + ((L1 + L3) + (L5 + L7)). The accumulators are
 * named vectors (a0..a3 of LANES / 2 doubles) because an array of them, or more of them, is
 * kept in memory by the compiler at 4 lanes. */
#ifndef LANES
#error "logp_topk_lanes.h: define LANES (4 or 8) before including it"
#endif
#ifndef LANES_TARGET
#define LANES_TARGET
#define LT_UNDEF_TARGET
#endif

#define LT_CAT_(a, b) a##_##b
#define LT_CAT(a, b) LT_CAT_(a, b)
#define LT(name) LT_CAT(name, LANES)

typedef float LT(vf) __attribute__((vector_size(4 * LANES)));
typedef int32_t LT(vi) __attribute__((vector_size(4 * LANES)));
typedef double LT(vd) __attribute__((vector_size(4 * LANES))); /* LANES / 2 doubles */
#define VF LT(vf)
#define VI LT(vi)
#define VD LT(vd)

INL LANES_TARGET VF LT(splat)(float x) {
  VF v = {0}; /* every lane written below; initialised for -O1's uninitialised-use warning */
  for (int i = 0; i < LANES; i++) v[i] = x;
  return v;
}
INL LANES_TARGET VF LT(load)(const float *p) {
  VF v;
  memcpy(&v, p, sizeof v);
  return v;
}
/* m ? a : b, lane by lane (m: all ones or all zeros per lane, as a vector compare gives). */
INL LANES_TARGET VF LT(select)(VI m, VF a, VF b) { return (VF)((m & (VI)a) | (~m & (VI)b)); }
/* key() per lane: NaN becomes -inf. */
INL LANES_TARGET VF LT(keyv)(VF x) { return LT(select)(x == x, x, LT(splat)(-INFINITY)); }
/* x > m ? x : m per lane (NaN never wins). */
INL LANES_TARGET VF LT(maxv)(VF x, VF m) { return LT(select)(x > m, x, m); }

/* e^x per lane, in fp32, for x <= 0 (x = -inf included; not NaN): 0 below -87 (e^-87 =
 * 1.6e-38, nothing next to the row's largest term, which is 1). Range reduction x = n ln2 + r,
 * |r| <= ln2 / 2, with ln2 in two parts, Cephes' degree-7 polynomial for e^r (S. L. Moshier,
 * Cephes Math Library, expf.c: relative error below 2e-7, as libm's expf within an ulp or
 * two), and 2^n built in the exponent bits. */
INL LANES_TARGET VF LT(exp_neg)(VF x) {
  const VI small = x < LT(splat)(-87.0f);
  const VF xc = LT(select)(small, LT(splat)(-87.0f), x);
  /* nearest integer of xc log2(e) <= 0: truncation of t - 0.5 rounds toward zero, i.e. up */
  const VI n = __builtin_convertvector(xc * LT(splat)(1.44269504088896341f) - LT(splat)(0.5f), VI);
  const VF fn = __builtin_convertvector(n, VF);
  const VF r = (xc - fn * LT(splat)(0.693359375f)) + fn * LT(splat)(2.12194440e-4f);
  VF p = LT(splat)(1.9875691500e-4f);
  p = p * r + LT(splat)(1.3981999507e-3f);
  p = p * r + LT(splat)(8.3334519073e-3f);
  p = p * r + LT(splat)(4.1665795894e-2f);
  p = p * r + LT(splat)(1.6666665459e-1f);
  p = p * r + LT(splat)(5.0000001201e-1f);
  p = p * (r * r) + r + LT(splat)(1.0f);
  const VF scale = (VF)((n + 127) << 23); /* n in [-126, 0]: a normal power of two */
  return (VF)(~small & (VI)(p * scale));
}

/* The largest key of x[0, BLK) (NaN never wins: read as -inf, also where it shares a lane
 * with a number; -inf when nothing beats it). */
INL LANES_TARGET float LT(block_max)(const float *x) {
  VF m = LT(keyv)(LT(load)(x));
  for (int j = LANES; j < BLK; j += LANES) m = LT(maxv)(LT(keyv)(LT(load)(x + j)), m);
  float b = m[0];
  for (int j = 1; j < LANES; j++) b = m[j] > b ? m[j] : b;
  return b;
}

/* idx[0, n) = the k best ids of x (V) by key, largest first, lower id first on ties; returns
 * n = min(k, outputtable ids). kv holds their keys; *mx gets the row's largest value (NaN
 * ignored; -inf if none). */
INL LANES_TARGET int LT(topk_row)(const float *x, int V, int k, int32_t *idx, float *kv,
                                  float *mx) {
  int n = 0, v = 0;
  float m = -INFINITY;
  for (; v + BLK <= V; v += BLK) {
    const float bm = LT(block_max)(x + v);
    m = bm > m ? bm : m;
    /* No id of the block can enter: its best is not above the k-th (NaN keys are -inf). */
    if (n == k && !(bm > kv[k - 1])) continue;
    n = insert_range(x, v, v + BLK, k, n, idx, kv);
  }
  for (int t = v; t < V; t++) m = x[t] > m ? x[t] : m;
  *mx = m;
  return insert_range(x, v, V, k, n, idx, kv);
}

/* The terms of vector e (block offset h) into the accumulators of their ids mod 8. */
#define LT_ACC(e, h)                                                                      \
  do {                                                                                    \
    const VD lo_ = __builtin_convertvector(LT_HALF_LO(e), VD);                            \
    const VD hi_ = __builtin_convertvector(LT_HALF_HI(e), VD);                            \
    if ((h) % 8 == 0) {                                                                   \
      a0 += lo_;                                                                          \
      a1 += hi_;                                                                          \
    } else {                                                                              \
      LT_ACC_UPPER(lo_, hi_);                                                             \
    }                                                                                     \
  } while (0)
#if LANES == 4
#define LT_HALF_LO(e) __builtin_shufflevector(e, e, 0, 1)
#define LT_HALF_HI(e) __builtin_shufflevector(e, e, 2, 3)
#define LT_ACC_UPPER(lo, hi) (a2 += (lo), a3 += (hi))
#elif LANES == 8
#define LT_HALF_LO(e) __builtin_shufflevector(e, e, 0, 1, 2, 3)
#define LT_HALF_HI(e) __builtin_shufflevector(e, e, 4, 5, 6, 7)
#define LT_ACC_UPPER(lo, hi) ((void)(lo), (void)(hi)) /* never: h is a multiple of 8 */
#else
#error "logp_topk_lanes.h: LANES must be 4 or 8"
#endif

/* log sum_v exp(key(x_v)), given the row's largest value mx: -inf for a row of -inf/NaN
 * only, NaN with a +inf. The terms in fp32, summed in double (the header's 8 accumulators). */
INL LANES_TARGET double LT(logsumexp)(const float *x, int V, float mx) {
  if (mx == -INFINITY) return -INFINITY;
  if (mx == INFINITY) return NAN;
  const VF m = LT(splat)(mx);
  VD a0 = {0}, a1 = {0};
#if LANES == 4
  VD a2 = {0}, a3 = {0};
#endif
  float tail[BLK];
  for (int v = 0; v < V; v += BLK) {
    const float *b = x + v;
    if (v + BLK > V) { /* the last, partial block: -inf beyond the row adds 0 */
      for (int j = 0; j < BLK; j++) tail[j] = v + j < V ? x[v + j] : -INFINITY;
      b = tail;
    }
    for (int h = 0; h < BLK; h += LANES) {
      const VF e = LT(exp_neg)(LT(keyv)(LT(load)(b + h)) - m);
      LT_ACC(e, h);
    }
  }
#if LANES == 4
  const double l[8] = {a0[0], a0[1], a1[0], a1[1], a2[0], a2[1], a3[0], a3[1]};
#else
  const double l[8] = {a0[0], a0[1], a0[2], a0[3], a1[0], a1[1], a1[2], a1[3]};
#endif
  const double s0 = (l[0] + l[2]) + (l[4] + l[6]), s1 = (l[1] + l[3]) + (l[5] + l[7]);
  return mx + log(s0 + s1);
}

static LANES_TARGET void LT(rows)(int32_t *ids, float *logp, const float *x, int R, int V,
                                  int k) {
  float kv[NMT_TOPK_MAX];
  for (int r = 0; r < R; r++) {
    const float *row = x + (size_t)r * V;
    int32_t *ri = ids + (size_t)r * k;
    float mx;
    const int n = LT(topk_row)(row, V, k, ri, kv, &mx);
    for (int j = n; j < k; j++) ri[j] = -1;
    if (!logp) continue;
    const double lse = LT(logsumexp)(row, V, mx);
    float *rl = logp + (size_t)r * k;
    for (int j = 0; j < k; j++)
      rl[j] = j >= n || lse == -INFINITY ? -INFINITY : (float)((double)kv[j] - lse);
  }
}

/* logp_at's rows: the row's largest value (a maximum of the keys: any order gives the one
 * topk_row finds), its logsumexp as above, and each given id's key minus it. */
static LANES_TARGET void LT(rows_at)(float *logp, const int32_t *ids, const float *x, int R,
                                     int V, int k) {
  for (int r = 0; r < R; r++) {
    const float *row = x + (size_t)r * V;
    float mx = -INFINITY;
    int v = 0;
    for (; v + BLK <= V; v += BLK) {
      const float bm = LT(block_max)(row + v);
      mx = bm > mx ? bm : mx;
    }
    for (; v < V; v++) mx = row[v] > mx ? row[v] : mx;
    const double lse = LT(logsumexp)(row, V, mx);
    const int32_t *ri = ids + (size_t)r * k;
    float *rl = logp + (size_t)r * k;
    for (int j = 0; j < k; j++)
      rl[j] = ri[j] < 0 || lse == -INFINITY ? -INFINITY : (float)((double)key(row[ri[j]]) - lse);
  }
}

#undef LT_ACC
#undef LT_HALF_LO
#undef LT_HALF_HI
#undef LT_ACC_UPPER
#undef VF
#undef VI
#undef VD
#undef LT
#undef LT_CAT
#undef LT_CAT_
#ifdef LT_UNDEF_TARGET
#undef LANES_TARGET
#undef LT_UNDEF_TARGET
#endif
