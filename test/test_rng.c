/* test/test_rng.c — Philox4x32-10 known answers and the element/stream layout of nmt_rng_*. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "nmt/rng.h"
#include "test.h"

/* Random123 kat_vectors, philox4x32_10 (ctr, key, expected). */
NMT_TEST(rng_philox_known_answers) {
  static const struct {
    uint32_t ctr[4], key[2], want[4];
  } kat[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       {0xffffffffu, 0xffffffffu},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       {0xa4093822u, 0x299f31d0u},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (size_t t = 0; t < sizeof kat / sizeof kat[0]; t++) {
    uint32_t out[4];
    nmt_philox4x32(kat[t].ctr, kat[t].key, out);
    for (int w = 0; w < 4; w++) NMT_ASSERT_EQ_INT(out[w], kat[t].want[w]);
  }
}

NMT_TEST(rng_u32_layout) {
  /* Element idx is word idx&3 of block idx>>2, stream in ctr words 2-3, seed as the key. */
  uint64_t seed = 0x0123456789abcdefull, stream = 0xfedcba9876543210ull;
  uint64_t idxs[] = {0, 1, 2, 3, 4, 7, 0x100000003ull, 0xffffffffffffffffull};
  for (size_t t = 0; t < sizeof idxs / sizeof idxs[0]; t++) {
    uint64_t idx = idxs[t], blk = idx >> 2;
    uint32_t ctr[4] = {(uint32_t)blk, (uint32_t)(blk >> 32), 0x76543210u, 0xfedcba98u};
    uint32_t key[2] = {0x89abcdefu, 0x01234567u};
    uint32_t out[4];
    nmt_philox4x32(ctr, key, out);
    NMT_ASSERT_EQ_INT(nmt_rng_u32(seed, stream, idx), out[idx & 3]);
    float u = nmt_rng_uniform(seed, stream, idx);
    NMT_ASSERT(u == (float)((double)(out[idx & 3] >> 8) / 16777216.0));
  }
}

NMT_TEST(rng_uniform_stats) {
  const int n = 100000;
  double s = 0, s2 = 0;
  float lo = 1, hi = 0;
  for (int i = 0; i < n; i++) {
    float u = nmt_rng_uniform(42, nmt_rng_stream(7, 3), (uint64_t)i);
    NMT_ASSERT(u >= 0.0f && u < 1.0f);
    s += u;
    s2 += (double)u * u;
    lo = u < lo ? u : lo;
    hi = u > hi ? u : hi;
  }
  double mean = s / n, var = s2 / n - mean * mean;
  /* 5 standard errors: sd of the mean is sqrt(1/12/n) ~ 9.1e-4. */
  NMT_ASSERT_NEAR(mean, 0.5, 5 * sqrt(1.0 / 12 / n));
  NMT_ASSERT_NEAR(var, 1.0 / 12, 0.003);
  NMT_ASSERT(lo < 1e-3f && hi > 1.0f - 1e-3f);
}

NMT_TEST(rng_normal_stats) {
  const int n = 100000;
  double s = 0, s2 = 0, s4 = 0;
  int beyond2 = 0;
  for (int i = 0; i < n; i++) {
    double z = nmt_rng_normal(9, 11, (uint64_t)i);
    NMT_ASSERT(isfinite(z));
    s += z;
    s2 += z * z;
    s4 += z * z * z * z;
    beyond2 += fabs(z) > 2;
  }
  double mean = s / n, var = s2 / n - mean * mean;
  NMT_ASSERT_NEAR(mean, 0.0, 5 * sqrt(1.0 / n));
  NMT_ASSERT_NEAR(var, 1.0, 5 * sqrt(2.0 / n));
  NMT_ASSERT_NEAR(s4 / n, 3.0, 0.1); /* kurtosis of a normal, not of a uniform (1.8) */
  /* P(|z| > 2) = 0.0455 */
  NMT_ASSERT_NEAR((double)beyond2 / n, 0.0455, 5 * sqrt(0.0455 * 0.9545 / n));
}

NMT_TEST(rng_streams_and_seeds_differ) {
  const int n = 4096;
  int same_stream = 0, same_seed = 0, same_step = 0, repeat_diff = 0;
  for (int i = 0; i < n; i++) {
    uint32_t a = nmt_rng_u32(1, nmt_rng_stream(5, 2), (uint64_t)i);
    same_stream += a == nmt_rng_u32(1, nmt_rng_stream(5, 3), (uint64_t)i);
    same_step += a == nmt_rng_u32(1, nmt_rng_stream(6, 2), (uint64_t)i);
    same_seed += a == nmt_rng_u32(2, nmt_rng_stream(5, 2), (uint64_t)i);
    repeat_diff += a != nmt_rng_u32(1, nmt_rng_stream(5, 2), (uint64_t)i);
  }
  NMT_ASSERT_EQ_INT(repeat_diff, 0);
  NMT_ASSERT(same_stream < 3 && same_step < 3 && same_seed < 3);
  NMT_ASSERT(nmt_rng_stream(1, 0x1000000u) == nmt_rng_stream(1, 0)); /* site is 24 bits */
  NMT_ASSERT(nmt_rng_stream(1, 5) == ((1ull << 24) | 5));
}
