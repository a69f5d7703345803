/* nmt/rng.h — counter-based random numbers (Philox4x32-10) for init and dropout.
 *
 * A dropout mask element is a pure function of (seed, stream, index): the backward pass
 * regenerates the forward mask instead of storing it, a replay gives the same mask, and the
 * CUDA backend computes bit-identical masks. Source: Salmon et al. 2011, "Parallel random
 * numbers: as easy as 1, 2, 3" (Philox4x32 with 10 rounds, the constants of Random123/cuRAND).
 *
 * Stream ids: nmt_rng_stream(step, site) packs the optimizer step and a per-call-site id (which
 * layer and which dropout in it), so every site of every step draws independent numbers.
 *
 * defines: nmt_philox4x32, nmt_rng_u32, nmt_rng_uniform, nmt_rng_normal, nmt_rng_stream
 */
#ifndef NMT_RNG_H
#define NMT_RNG_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One Philox4x32-10 block: out = philox(ctr, key). */
void nmt_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/* 32 random bits for element `idx` of stream `stream` under `seed`:
 * word (idx & 3) of philox(ctr = {idx>>2 lo, idx>>2 hi, stream lo, stream hi}, key = seed). */
uint32_t nmt_rng_u32(uint64_t seed, uint64_t stream, uint64_t idx);

/* Uniform in [0, 1): (u32 >> 8) * 2^-24. Dropout keeps element idx iff uniform >= p. */
float nmt_rng_uniform(uint64_t seed, uint64_t stream, uint64_t idx);

/* Standard normal from two uniforms (Box-Muller), element idx of the stream. */
float nmt_rng_normal(uint64_t seed, uint64_t stream, uint64_t idx);

/* Packs (step, site) into a stream id: step in the high 40 bits, site in the low 24. */
static inline uint64_t nmt_rng_stream(uint64_t step, uint32_t site) {
  return (step << 24) | (uint64_t)(site & 0xffffffu);
}

#ifdef __cplusplus
}
#endif
#endif /* NMT_RNG_H */
