/* util/rng.c — Philox4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3",
 * SC'11), with the round and key-schedule constants of Random123 and cuRAND, so the CUDA backend
 * (curand_Philox4x32_10 or a copy of this function) yields the same bits. */
#include "nmt/rng.h"

#include <math.h>

enum {
  PHILOX_M0 = 0xD2511F53u, /* round multipliers */
  PHILOX_M1 = 0xCD9E8D57u,
  PHILOX_W0 = 0x9E3779B9u, /* Weyl key bumps: golden ratio, sqrt(3)-1 */
  PHILOX_W1 = 0xBB67AE85u,
};

static inline void philox_round(uint32_t c[4], const uint32_t k[2]) {
  uint64_t p0 = (uint64_t)PHILOX_M0 * c[0];
  uint64_t p1 = (uint64_t)PHILOX_M1 * c[2];
  uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
  uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
  uint32_t n0 = hi1 ^ c[1] ^ k[0];
  uint32_t n2 = hi0 ^ c[3] ^ k[1];
  c[0] = n0;
  c[1] = lo1;
  c[2] = n2;
  c[3] = lo0;
}

void nmt_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
  uint32_t c[4] = {ctr[0], ctr[1], ctr[2], ctr[3]};
  uint32_t k[2] = {key[0], key[1]};
  /* Random123's philox4x32_R: the first round uses the key as given, each later one bumps it. */
  philox_round(c, k);
  for (int r = 1; r < 10; r++) {
    k[0] += PHILOX_W0;
    k[1] += PHILOX_W1;
    philox_round(c, k);
  }
  out[0] = c[0];
  out[1] = c[1];
  out[2] = c[2];
  out[3] = c[3];
}

uint32_t nmt_rng_u32(uint64_t seed, uint64_t stream, uint64_t idx) {
  uint64_t blk = idx >> 2;
  uint32_t ctr[4] = {(uint32_t)blk, (uint32_t)(blk >> 32), (uint32_t)stream,
                     (uint32_t)(stream >> 32)};
  uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
  uint32_t out[4];
  nmt_philox4x32(ctr, key, out);
  return out[idx & 3];
}

float nmt_rng_uniform(uint64_t seed, uint64_t stream, uint64_t idx) {
  /* 24 bits fill a float mantissa exactly, so the result is exact and < 1. */
  return (float)(nmt_rng_u32(seed, stream, idx) >> 8) * 0x1p-24f;
}

float nmt_rng_normal(uint64_t seed, uint64_t stream, uint64_t idx) {
  /* Normal idx uses the two words 2*idx and 2*idx+1 of the stream, which share one Philox
   * block. u1 is taken in (0, 1] so the log is finite; the math is in double. */
  uint64_t base = idx << 1;
  uint32_t a = nmt_rng_u32(seed, stream, base);
  uint32_t b = nmt_rng_u32(seed, stream, base + 1);
  double u1 = ((double)(a >> 8) + 1.0) * 0x1p-24;
  double u2 = (double)(b >> 8) * 0x1p-24;
  return (float)(sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}
