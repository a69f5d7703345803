/* cuda/embedding.cu — token embedding times scale plus the positional table (Vaswani et al.
 * 2017 §3.4, §3.5), and its backward into the (shared) embedding gradient.
 *
 * Backward without float atomics: the rows are sorted by token id with CUB's stable radix sort
 * (keys = ids, values = row indices), so the rows of one id form a contiguous run in
 * increasing row order; the block at the start of a run owns that embedding row and adds the
 * run's rows into it in that order. Each gradient element is thus written by one thread, in the
 * reference's order (rows ascending) with the reference's roundings (multiply, then add; no
 * fused multiply-add): the result is bitwise the reference's and bitwise repeatable. */
#include <cub/cub.cuh>

#include "common.cuh"

// out: (n_rows,C); ids: (n_rows); wte: (V,C); pos: (>=T,C)
static __global__ void embedding_fwd_kernel(float *out, const int32_t *ids, const float *wte,
                                            const float *pos, int n_rows, int T, int C,
                                            float scale, int *err) {
  const size_t n = (size_t)n_rows * (size_t)C;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t r = i / (size_t)C, c = i % (size_t)C;
    const int32_t id = ids[r];
    if (id < 0) {
      atomicOr(err, NMT_CUDA_ERR_EMB_ID);
      out[i] = __int_as_float(0x7fc00000); /* NaN: a bad id never looks like data */
      continue;
    }
    const float e = wte[(size_t)id * (size_t)C + c];
    const float p = pos[(r % (size_t)T) * (size_t)C + c];
    out[i] = __fadd_rn(__fmul_rn(scale, e), p); /* the reference's two roundings */
  }
}

nmt_status nmt_cuda_embedding_fwd(void *ctx, float *out, const int32_t *ids, const float *wte,
                                  const float *pos, int n_rows, int T, int C, float scale) {
  NMT_TRY(nmt__cuda_enter(ctx, "embedding_fwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (n_rows < 0 || T < 1 || C < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda embedding_fwd: bad shape n_rows=%d T=%d C=%d",
                      n_rows, T, C);
  const size_t n = (size_t)n_rows * (size_t)C;
  if (n == 0) return NMT_OK;
  embedding_fwd_kernel<<<nmt__grid(n, 256), 256, 0, nmt__cuda_stream(c)>>>(
      out, ids, wte, pos, n_rows, T, C, scale, c->d_err);
  NMT_CUDA_LAUNCH_CHECK("embedding_fwd_kernel");
  return NMT_OK;
}

static __global__ void make_pairs(uint32_t *keys, int32_t *rows, const int32_t *ids, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    keys[i] = (uint32_t)ids[i]; /* a negative id sorts last and is reported below */
    rows[i] = i;
  }
}

/* One block per sorted position; only the first position of each run of equal ids works. */
static __global__ void accumulate_runs(float *dwte, const float *dout, const uint32_t *keys,
                                       const int32_t *rows, int n, int C, float scale, int *err) {
  const int i = blockIdx.x;
  if (i >= n) return;
  const uint32_t key = keys[i];
  if (i > 0 && keys[i - 1] == key) return;
  if ((int32_t)key < 0) {
    if (threadIdx.x == 0) atomicOr(err, NMT_CUDA_ERR_EMB_ID);
    return;
  }
  float *d = dwte + (size_t)key * (size_t)C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = d[c];
    for (int j = i; j < n && keys[j] == key; j++)
      acc = __fadd_rn(acc, __fmul_rn(scale, dout[(size_t)rows[j] * (size_t)C + c]));
    d[c] = acc;
  }
}

static size_t round_up(size_t x) { return (x + 255) / 256 * 256; }

// dwte: (V,C) +=; dout: (n_rows,C); ids: (n_rows)
nmt_status nmt_cuda_embedding_bwd(void *ctx, float *dwte, const float *dout, const int32_t *ids,
                                  int n_rows, int C, float scale) {
  NMT_TRY(nmt__cuda_enter(ctx, "embedding_bwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  if (n_rows < 0 || C < 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda embedding_bwd: bad shape n_rows=%d C=%d", n_rows,
                      C);
  if (!dwte || n_rows == 0 || C == 0) return NMT_OK;
  const size_t n = (size_t)n_rows;
  size_t temp_bytes = 0;
  NMT_CUDA_TRY(cub::DeviceRadixSort::SortPairs(NULL, temp_bytes, (const uint32_t *)NULL,
                                               (uint32_t *)NULL, (const int32_t *)NULL,
                                               (int32_t *)NULL, n_rows, 0, 32,
                                               nmt__cuda_stream(c)));
  const size_t kb = round_up(n * sizeof(uint32_t)), vb = round_up(n * sizeof(int32_t));
  void *scratch;
  NMT_TRY(nmt__cuda_scratch(c, 2 * kb + 2 * vb + round_up(temp_bytes), &scratch));
  char *p = (char *)scratch;
  uint32_t *keys_in = (uint32_t *)p, *keys_out = (uint32_t *)(p + kb);
  int32_t *rows_in = (int32_t *)(p + 2 * kb), *rows_out = (int32_t *)(p + 2 * kb + vb);
  void *temp = p + 2 * kb + 2 * vb;

  make_pairs<<<nmt__grid(n, 256), 256, 0, nmt__cuda_stream(c)>>>(keys_in, rows_in, ids, n_rows);
  NMT_CUDA_LAUNCH_CHECK("make_pairs");
  NMT_CUDA_TRY(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, rows_in,
                                               rows_out, n_rows, 0, 32, nmt__cuda_stream(c)));
  const int threads = C >= 256 ? 256 : (C + 31) / 32 * 32;
  accumulate_runs<<<(unsigned)n_rows, threads, 0, nmt__cuda_stream(c)>>>(
      dwte, dout, keys_out, rows_out, n_rows, C, scale, c->d_err);
  NMT_CUDA_LAUNCH_CHECK("accumulate_runs");
  return NMT_OK;
}
