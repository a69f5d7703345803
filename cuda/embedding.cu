/* cuda/embedding.cu — token embedding times scale plus the positional table (Vaswani et al.
 * 2017 §3.4, §3.5), and its backward into the (shared) embedding gradient.
 *
 * Backward without float atomics: the rows are sorted by token id with CUB's stable radix sort
 * (keys = ids, values = row indices), so the rows of one id form a contiguous run in
 * increasing row order. Rows of NMT_PAD_ID are skipped (they carry no gradient: the contract
 * of nmt/backend.h, as torch.nn.Embedding's padding_idx), so the padding of a batch, often its
 * longest run, costs nothing. A run is cut into chunks of RUN_CHUNK rows, one block each, so
 * no block adds more than RUN_CHUNK rows serially, however frequent a token:
 *   - a run of at most RUN_CHUNK rows (most tokens of a batch) is one chunk, whose block owns
 *     that embedding row and adds the rows into it in row order with the reference's roundings
 *     (multiply, then add; no fused multiply-add): bitwise the reference's;
 *   - a longer run's chunks are summed from 0 into partials in scratch, then the block at the
 *     run's start adds the partials in chunk order: deterministic (fixed chunks, fixed order),
 *     within fp32 rounding of the reference's one sequential sum.
 * Each gradient element is written by one thread: bitwise repeatable run to run. */
#include <cub/cub.cuh>

#include "common.cuh"
#include "half_scratch.cuh"

/* The most rows one block adds serially (a chunk). */
enum { RUN_CHUNK = 32 };

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
NMT_CUDA_PRELOAD(embedding_fwd_kernel);

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
NMT_CUDA_PRELOAD(make_pairs);

/* The run of equal keys around sorted position i: [*s, *e), by binary search (keys sorted). */
static __device__ void run_bounds(const uint32_t *keys, int n, int i, int *s, int *e) {
  const uint32_t key = keys[i];
  int lo = 0, hi = i; /* first position with keys[p] == key */
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (keys[mid] < key) lo = mid + 1;
    else hi = mid;
  }
  *s = lo;
  lo = i + 1, hi = n; /* first position with keys[p] > key */
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (keys[mid] <= key) lo = mid + 1;
    else hi = mid;
  }
  *e = lo;
}

/* One block per sorted position; only chunk heads work: the positions s + k*RUN_CHUNK of each
 * run [s, e) of a valid, non-PAD id. A run of at most RUN_CHUNK rows is added into its
 * embedding row directly, in row order (the reference's sums exactly). A longer run's chunk
 * k (rows [h, min(h + RUN_CHUNK, e)), h = s + k*RUN_CHUNK) is summed from 0 into
 * partial[2 * (h / RUN_CHUNK) + (k == 0)]: a RUN_CHUNK-wide window of sorted positions holds
 * chunk heads of at most two long runs (each is longer than the window), the first chunk of one
 * and a later chunk of the other, so the slot is unique. */
static __global__ void chunk_sums(float *dwte, float *partial, const float *dout,
                                  const uint32_t *keys, const int32_t *rows, int n, int C,
                                  float scale, int *err) {
  const int i = blockIdx.x;
  if (i >= n) return;
  int s, e;
  run_bounds(keys, n, i, &s, &e);
  if ((i - s) % RUN_CHUNK) return;
  const uint32_t key = keys[i];
  if ((int32_t)key < 0) {
    if (i == s && threadIdx.x == 0) atomicOr(err, NMT_CUDA_ERR_EMB_ID);
    return;
  }
  if (key == (uint32_t)NMT_PAD_ID) return; /* PAD rows carry no gradient (nmt/backend.h) */
  const int end = i + RUN_CHUNK < e ? i + RUN_CHUNK : e;
  const bool direct = e - s <= RUN_CHUNK;
  float *d = direct ? dwte + (size_t)key * (size_t)C
                    : partial + (2 * (size_t)(i / RUN_CHUNK) + (i == s)) * (size_t)C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = direct ? d[c] : 0.0f;
    for (int j = i; j < end; j++)
      acc = __fadd_rn(acc, __fmul_rn(scale, dout[(size_t)rows[j] * (size_t)C + c]));
    d[c] = acc;
  }
}
NMT_CUDA_PRELOAD(chunk_sums);

/* One block per sorted position; the start s of each run longer than RUN_CHUNK adds its
 * chunks' partial sums into the embedding row, in chunk order (deterministic). */
static __global__ void combine_chunks(float *dwte, const float *partial, const uint32_t *keys,
                                      int n, int C) {
  const int i = blockIdx.x;
  if (i >= n) return;
  int s, e;
  run_bounds(keys, n, i, &s, &e);
  const uint32_t key = keys[i];
  if (i != s || e - s <= RUN_CHUNK || (int32_t)key < 0 || key == (uint32_t)NMT_PAD_ID) return;
  float *d = dwte + (size_t)key * (size_t)C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = d[c];
    for (int h = s; h < e; h += RUN_CHUNK)
      acc = __fadd_rn(acc, partial[(2 * (size_t)(h / RUN_CHUNK) + (h == s)) * (size_t)C + c]);
    d[c] = acc;
  }
}
NMT_CUDA_PRELOAD(combine_chunks);

/* CUB's stable radix sort of n (key, row) pairs on c's current stream, every bit of the keys;
 * with temp == NULL, only sets *temp_bytes. The one call site of the sort, so that the size
 * query, the backward and the preload below use the same instantiation (hence kernels). */
static cudaError_t sort_pairs(nmt_cuda_ctx *c, void *temp, size_t *temp_bytes,
                              const uint32_t *keys_in, uint32_t *keys_out,
                              const int32_t *rows_in, int32_t *rows_out, int n) {
  return cub::DeviceRadixSort::SortPairs(temp, *temp_bytes, keys_in, keys_out, rows_in, rows_out,
                                         n, 0, 32, nmt__cuda_stream(c));
}

/* Pieces of the backward's scratch for n rows of width C: sort keys and values (in and out),
 * CUB's temporary storage, the chunk partials. */
typedef struct {
  size_t kb, vb, temp, partial;
} emb_scratch;

static nmt_status emb_layout(nmt_cuda_ctx *c, size_t rows, size_t width, emb_scratch *l) {
  l->temp = 0;
  if (rows > 0x7fffffff)
    return nmt_errorf(NMT_ERR_INTERNAL, "cuda embedding_bwd: %zu rows exceed an int", rows);
  NMT_CUDA_TRY(sort_pairs(c, NULL, &l->temp, NULL, NULL, NULL, NULL, (int)rows));
  l->kb = nmt__cuda_pad(rows * sizeof(uint32_t));
  l->vb = nmt__cuda_pad(rows * sizeof(int32_t));
  l->temp = nmt__cuda_pad(l->temp);
  l->partial = nmt__cuda_pad(2 * ((rows + RUN_CHUNK - 1) / RUN_CHUNK) * width * sizeof(float));
  return NMT_OK;
}

nmt_status nmt__cuda_embedding_scratch(nmt_cuda_ctx *c, size_t rows, size_t width,
                                       size_t *bytes) {
  emb_scratch l;
  *bytes = 0;
  if (rows == 0 || width == 0) return NMT_OK;
  NMT_TRY(emb_layout(c, rows, width, &l));
  *bytes = 2 * l.kb + 2 * l.vb + l.temp + l.partial;
  return NMT_OK;
}

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
  emb_scratch l;
  NMT_TRY(emb_layout(c, n, (size_t)C, &l));
  void *scratch;
  NMT_TRY(nmt__cuda_scratch(c, 2 * l.kb + 2 * l.vb + l.temp + l.partial, &scratch));
  char *p = (char *)scratch;
  uint32_t *keys_in = (uint32_t *)p, *keys_out = (uint32_t *)(p + l.kb);
  int32_t *rows_in = (int32_t *)(p + 2 * l.kb), *rows_out = (int32_t *)(p + 2 * l.kb + l.vb);
  void *temp = p + 2 * l.kb + 2 * l.vb;
  float *partial = (float *)(p + 2 * l.kb + 2 * l.vb + l.temp);
  size_t temp_bytes = l.temp;

  make_pairs<<<nmt__grid(n, 256), 256, 0, nmt__cuda_stream(c)>>>(keys_in, rows_in, ids, n_rows);
  NMT_CUDA_LAUNCH_CHECK("make_pairs");
  NMT_CUDA_TRY(sort_pairs(c, temp, &temp_bytes, keys_in, keys_out, rows_in, rows_out, n_rows));
  const int threads = C >= 256 ? 256 : (C + 31) / 32 * 32;
  chunk_sums<<<(unsigned)n_rows, threads, 0, nmt__cuda_stream(c)>>>(
      dwte, partial, dout, keys_out, rows_out, n_rows, C, scale, c->d_err);
  NMT_CUDA_LAUNCH_CHECK("chunk_sums");
  combine_chunks<<<(unsigned)n_rows, threads, 0, nmt__cuda_stream(c)>>>(dwte, partial, keys_out,
                                                                         n_rows, C);
  NMT_CUDA_LAUNCH_CHECK("combine_chunks");
  return NMT_OK;
}

/* Rows of the preload's second sort: above the single tile of every CUB tuning policy (at most
 * a few thousand items), so that it takes the multi-tile path (onesweep, or upsweep, scan and
 * downsweep) while one row takes the single-tile kernel. */
enum { PRELOAD_ROWS = 1 << 16 };

nmt_status nmt__cuda_embedding_preload(nmt_cuda_ctx *c) {
  const int sizes[2] = {1, PRELOAD_ROWS};
  size_t temp = 0;
  for (int i = 0; i < 2; i++) {
    size_t t = 0;
    NMT_CUDA_TRY(sort_pairs(c, NULL, &t, NULL, NULL, NULL, NULL, sizes[i]));
    temp = t > temp ? t : temp;
  }
  const size_t kb = nmt__cuda_pad(PRELOAD_ROWS * sizeof(uint32_t)), vb = kb;
  const size_t bytes = 2 * kb + 2 * vb + nmt__cuda_pad(temp);
  cudaStream_t st = nmt__cuda_stream(c);
  /* The buffer is stream-ordered (cudaMallocAsync / cudaFreeAsync on the stream the sorts run
   * on): cudaFree would synchronise the whole device, and every context (a trainer's rank, the
   * validation decoder, a test's) is created while other contexts of the process may have work
   * in flight, NCCL kernels waiting for peers among them. The free is enqueued behind the
   * sorts, so it cannot overtake them, and the polling wait below (which the abort flag can
   * end) is the only wait. The freed memory goes back to the device's default pool (about
   * 1 MiB kept there until a later synchronisation trims it). A device without memory pools
   * (cudaDevAttrMemoryPoolsSupported = 0) takes cudaMalloc / cudaFree after the wait. */
  char *p = NULL;
  int pooled = 0;
  cudaError_t e = cudaDeviceGetAttribute(&pooled, cudaDevAttrMemoryPoolsSupported, c->device);
  if (e != cudaSuccess)
    return nmt__cuda_error(e, "cudaDeviceGetAttribute(MemoryPoolsSupported)", __FILE__, __LINE__);
  e = pooled ? cudaMallocAsync((void **)&p, bytes, st) : cudaMalloc((void **)&p, bytes);
  if (e != cudaSuccess)
    return nmt__cuda_error(e, "CUB radix sort (preload buffer)", __FILE__, __LINE__);
  uint32_t *keys_in = (uint32_t *)p, *keys_out = (uint32_t *)(p + kb);
  int32_t *rows_in = (int32_t *)(p + 2 * kb), *rows_out = (int32_t *)(p + 2 * kb + vb);
  e = cudaMemsetAsync(p, 0, 2 * kb + 2 * vb, st);
  for (int i = 0; i < 2 && e == cudaSuccess; i++) {
    size_t t = temp;
    e = sort_pairs(c, p + 2 * kb + 2 * vb, &t, keys_in, keys_out, rows_in, rows_out, sizes[i]);
  }
  nmt_status s = e == cudaSuccess ? NMT_OK
                                  : nmt__cuda_error(e, "CUB radix sort (preload)", __FILE__,
                                                    __LINE__);
  if (pooled) {
    /* Behind whatever was enqueued, also after a failed launch. */
    e = cudaFreeAsync(p, st);
    if (e != cudaSuccess && s == NMT_OK)
      s = nmt__cuda_error(e, "cudaFreeAsync (sort preload)", __FILE__, __LINE__);
  }
  /* Whatever was enqueued must have run before the buffer goes; after a failed wait it may
   * still be running, and a cudaMalloc'd buffer is kept (a leak on that error path only). */
  const nmt_status w = nmt__cuda_wait(c, st, "ctx_create (sort preload)");
  if (!pooled && w == NMT_OK) {
    e = cudaFree(p);
    if (e != cudaSuccess && s == NMT_OK)
      s = nmt__cuda_error(e, "cudaFree (sort preload)", __FILE__, __LINE__);
  }
  return s != NMT_OK ? s : w;
}


/* ---- the half-storage path (nmt/backend.h embedding_half_fwd): embedding_fwd and dropout_fwd
 * in one pass ----
 * dropout_kernel's layout over the flat (n_rows, C) output: one thread per Philox block of 4
 * elements e = r*C + c, a grid-stride loop. Each element is embedding_fwd_kernel's
 * __fadd_rn(__fmul_rn(scale, wte), pos) (a bad id: NaN and the error bit, as there), then
 * dropout_fwd's keep ? __fmul_rn(v, 1/(1-p)) : 0 (p = 0: v), written to out (fp32) and, when
 * out_h is given, rounded once to the half type: out is bitwise the two fp32 ops, out_h its
 * rounding. VEC = 4 (C % 4 == 0, so a block lies in one row; out, wte and pos 16-byte and
 * out_h 8-byte aligned): one id, one float4 from each table, one float4 and one 8-byte store
 * per block; else element by element. Resources: 256 threads, a grid of at most 65535 blocks
 * (nmt__grid), no shared memory. */

/* Four half elements moved as one 8-byte store. */
template <typename T>
struct __align__(8) emb_half4 {
  T v[4];
};

// out: (n_rows,C) fp32; out_h: (n_rows,C) half or NULL; ids: (n_rows); wte: (V,C); pos: (>=T,C)
template <typename T, int VEC>
static __global__ void embedding_half_kernel(float *out, T *out_h, const int32_t *ids,
                                             const float *wte, const float *pos, int n_rows,
                                             int T_, int C, float scale, float p, float dscale,
                                             uint64_t seed, uint64_t stream, int *err) {
  const size_t n = (size_t)n_rows * (size_t)C, n_blk = (n + 3) / 4;
  for (size_t blk = (size_t)blockIdx.x * blockDim.x + threadIdx.x; blk < n_blk;
       blk += (size_t)gridDim.x * blockDim.x) {
    uint32_t w[4] = {0, 0, 0, 0};
    if (p > 0.0f) nmt__rng_block(seed, stream, (uint64_t)blk, w);
    const size_t e0 = blk * 4;
    float v[4];
    int m = 4; /* elements of this block inside the output */
    if (VEC == 4) {
      const size_t r = e0 / (size_t)C, c = e0 % (size_t)C;
      const int32_t id = ids[r];
      if (id < 0) {
        atomicOr(err, NMT_CUDA_ERR_EMB_ID);
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] = __int_as_float(0x7fc00000);
      } else {
        const float4 a = *reinterpret_cast<const float4 *>(wte + (size_t)id * (size_t)C + c);
        const float4 b = *reinterpret_cast<const float4 *>(pos + (r % (size_t)T_) * (size_t)C + c);
        v[0] = __fadd_rn(__fmul_rn(scale, a.x), b.x);
        v[1] = __fadd_rn(__fmul_rn(scale, a.y), b.y);
        v[2] = __fadd_rn(__fmul_rn(scale, a.z), b.z);
        v[3] = __fadd_rn(__fmul_rn(scale, a.w), b.w);
      }
    } else {
      m = n - e0 < 4 ? (int)(n - e0) : 4;
#pragma unroll
      for (int j = 0; j < 4; j++) {
        v[j] = 0.0f;
        if (j >= m) continue;
        const size_t e = e0 + (size_t)j, r = e / (size_t)C, c = e % (size_t)C;
        const int32_t id = ids[r];
        if (id < 0) {
          atomicOr(err, NMT_CUDA_ERR_EMB_ID);
          v[j] = __int_as_float(0x7fc00000);
          continue;
        }
        v[j] = __fadd_rn(__fmul_rn(scale, wte[(size_t)id * (size_t)C + c]),
                         pos[(r % (size_t)T_) * (size_t)C + c]);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; j++)
      if (p > 0.0f) v[j] = nmt__u32_uniform(w[j]) >= p ? __fmul_rn(v[j], dscale) : 0.0f;
    if (VEC == 4) {
      *reinterpret_cast<float4 *>(out + e0) = make_float4(v[0], v[1], v[2], v[3]);
      if (out_h) {
        emb_half4<T> h;
#pragma unroll
        for (int j = 0; j < 4; j++) h.v[j] = nmt__float_to_half<T>(v[j]);
        *reinterpret_cast<emb_half4<T> *>(out_h + e0) = h;
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; j++) {
        if (j >= m) continue;
        out[e0 + j] = v[j];
        if (out_h) out_h[e0 + j] = nmt__float_to_half<T>(v[j]);
      }
    }
  }
}
NMT_CUDA_PRELOAD(embedding_half_kernel<__half, 4>);
NMT_CUDA_PRELOAD(embedding_half_kernel<__half, 1>);
NMT_CUDA_PRELOAD(embedding_half_kernel<__nv_bfloat16, 4>);
NMT_CUDA_PRELOAD(embedding_half_kernel<__nv_bfloat16, 1>);

template <typename T>
static nmt_status embedding_half_t(nmt_cuda_ctx *c, float *out, T *out_h, const int32_t *ids,
                                   const float *wte, const float *pos, int n_rows, int T_, int C,
                                   float scale, float p, uint64_t seed, uint64_t stream) {
  const size_t n = (size_t)n_rows * (size_t)C;
  const float dscale = 1.0f / (1.0f - p);
  const int vec = C % 4 == 0 && ((uintptr_t)out & 15) == 0 && ((uintptr_t)wte & 15) == 0 &&
                  ((uintptr_t)pos & 15) == 0 && ((uintptr_t)out_h & 7) == 0;
  const unsigned grid = nmt__grid((n + 3) / 4, 256);
  cudaStream_t s = nmt__cuda_stream(c);
  if (vec)
    embedding_half_kernel<T, 4><<<grid, 256, 0, s>>>(out, out_h, ids, wte, pos, n_rows, T_, C,
                                                     scale, p, dscale, seed, stream, c->d_err);
  else
    embedding_half_kernel<T, 1><<<grid, 256, 0, s>>>(out, out_h, ids, wte, pos, n_rows, T_, C,
                                                     scale, p, dscale, seed, stream, c->d_err);
  NMT_CUDA_LAUNCH_CHECK("embedding_half_kernel");
  return NMT_OK;
}

// out: (n_rows,C) fp32; out_h: (n_rows,C) half or NULL; ids: (n_rows); wte: (V,C); pos: (>=T,C)
nmt_status nmt_cuda_embedding_half_fwd(void *ctx, float *out, nmt_act *out_h, const int32_t *ids,
                                       const float *wte, const float *pos, int n_rows, int T,
                                       int C, float scale, float p, uint64_t seed,
                                       uint64_t stream) {
  NMT_TRY(nmt__cuda_enter(ctx, "embedding_half_fwd"));
  nmt_cuda_ctx *c = nmt__cuda_ctx(ctx);
  NMT_TRY(nmt__cuda_half_op_check(c, "embedding_half_fwd"));
  if (n_rows < 0 || T < 1 || C < 0)
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda embedding_half_fwd: bad shape n_rows=%d T=%d C=%d", n_rows, T, C);
  if (!(p >= 0.0f && p < 1.0f))
    return nmt_errorf(NMT_ERR_INTERNAL,
                      "cuda embedding_half_fwd: dropout probability %g outside [0, 1)",
                      (double)p);
  if ((size_t)n_rows * (size_t)C == 0) return NMT_OK;
  if (nmt__cuda_half_bf16(c))
    return embedding_half_t(c, out, (__nv_bfloat16 *)out_h, ids, wte, pos, n_rows, T, C, scale,
                            p, seed, stream);
  return embedding_half_t(c, out, (__half *)out_h, ids, wte, pos, n_rows, T, C, scale, p, seed,
                          stream);
}
