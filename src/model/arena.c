/* arena.c — one backend allocation carved into 64-byte aligned pieces, the allocator of the
 * model's activations (transformer.c) and of the decoder's caches (decode.c).
 *
 * A layout function carves every piece in a fixed order. Run on an arena whose base is NULL it
 * only measures (used = the bytes to allocate, alignment padding included); run again on the
 * allocation it hands out the same offsets, now as pointers. So a layout is written once and
 * its size can be known without allocating (nmt_model_arena_bytes). */
#include "model_impl.h"

void *nmt__arena_carve(nmt__arena *a, size_t bytes) {
  size_t off = (a->used + 63) & ~(size_t)63;
  a->used = off + bytes;
  return a->base ? a->base + off : NULL;
}

float *nmt__arena_floats(nmt__arena *a, size_t n) {
  return (float *)nmt__arena_carve(a, n * sizeof(float));
}

int32_t *nmt__arena_ints(nmt__arena *a, size_t n) {
  return (int32_t *)nmt__arena_carve(a, n * sizeof(int32_t));
}

nmt_act *nmt__arena_acts(nmt__arena *a, size_t n) {
  return (nmt_act *)nmt__arena_carve(a, n * sizeof(nmt_act));
}

size_t nmt__arena_measure(nmt__arena_layout_fn layout, void *obj) {
  nmt__arena a = {0};
  layout(obj, &a);
  return a.used;
}

nmt_status nmt__arena_alloc(const nmt_backend *be, void *ctx, nmt__arena_layout_fn layout,
                            void *obj, void **mem, size_t *bytes) {
  *mem = NULL;
  size_t n = nmt__arena_measure(layout, obj);
  if (bytes) *bytes = n;
  NMT_TRY(be->malloc(ctx, n, mem));
  nmt__arena a = {.base = *mem};
  layout(obj, &a);
  return NMT_OK;
}
