/* test/test_memory.c — the ref backend's memory ops (src/ref/memory.c): malloc alignment and
 * its NOMEM error, the blocking copies, copy_d2d, synchronize and memset_zero. (Names keep their
 * historical misc_ prefix: the runbook and scripts select tests by name.) */
#include <stdint.h>
#include <string.h>

#include "nmt/backend.h"
#include "nmt/ref.h"
#include "test.h"

NMT_TEST(misc_memory_ops) {
  const nmt_backend *be = &nmt_backend_ref;
  float *d = NULL, h[100], back[100];
  NMT_ASSERT_OK(be->malloc(NULL, sizeof h, (void **)&d));
  NMT_ASSERT(d != NULL && (uintptr_t)d % 64 == 0);
  for (int i = 0; i < 100; i++) h[i] = (float)i * 0.5f;
  NMT_ASSERT_OK(be->copy_h2d(NULL, d, h, sizeof h));
  NMT_ASSERT_OK(be->synchronize(NULL));
  NMT_ASSERT_OK(be->copy_d2h(NULL, back, d, sizeof h));
  NMT_ASSERT(memcmp(h, back, sizeof h) == 0);
  NMT_ASSERT_OK(be->memset_zero(NULL, d + 10, 20 * sizeof(float)));
  NMT_ASSERT_OK(be->copy_d2h(NULL, back, d, sizeof h));
  for (int i = 0; i < 100; i++) NMT_ASSERT(back[i] == (i >= 10 && i < 30 ? 0.0f : h[i]));
  NMT_ASSERT_OK(be->copy_d2d(NULL, d + 50, d + 5, 10 * sizeof(float)));
  NMT_ASSERT_OK(be->copy_d2h(NULL, back, d, sizeof h));
  for (int i = 0; i < 100; i++)
    NMT_ASSERT(back[i] == (i >= 50 && i < 60 ? (i - 45 >= 10 ? 0.0f : h[i - 45])
                                             : i >= 10 && i < 30 ? 0.0f : h[i]));
  be->free(NULL, d);
  void *z = NULL;
  NMT_ASSERT_OK(be->malloc(NULL, 0, &z));
  NMT_ASSERT(z != NULL);
  be->free(NULL, z);
  NMT_ASSERT_EQ_STATUS(be->malloc(NULL, (size_t)-1 / 2, &z), NMT_ERR_NOMEM);
}
