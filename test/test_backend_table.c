/* test/test_backend_table.c — the op tables themselves (nmt/backend.h). */
#include <string.h>

#include "nmt/backend.h"
#include "nmt/ref.h"
#include "test.h"

NMT_TEST(misc_backend_table_complete) {
  const nmt_backend *be = &nmt_backend_ref;
  NMT_ASSERT(be->name && strcmp(be->name, "ref") == 0);
  /* Every member after the name is a function pointer: none may be left NULL. */
  const char *p = (const char *)be + sizeof(be->name);
  size_t n = (sizeof *be - sizeof(be->name)) / sizeof(void (*)(void));
  for (size_t i = 0; i < n; i++) {
    void (*fn)(void);
    memcpy(&fn, p + i * sizeof fn, sizeof fn);
    if (!fn) {
      nmt_test_fail(__FILE__, __LINE__, "op table entry %zu is NULL", i);
      return;
    }
  }
  NMT_ASSERT(be->attention_bwd == nmt_ref_attention_bwd && be->adamw == nmt_ref_adamw);
}
