/* test/fuzz/fuzz_ini.c — the config loader (src/config.c over iniparser) on arbitrary input.
 *
 * Input byte 0 chooses the form: even, the rest is an INI file; odd, the rest is a list of
 * "section.key=value" overrides, one per line. Property: whatever loads, its dump loads back
 * and dumps to the same text (nmt_config_dump promises a form the parser reads back exactly). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <iniparser.h>

#include "fuzz.h"
#include "nmt/config.h"

static int fuzz_memfile(int slot, const void *data, size_t size, char *path);

/* iniparser prints each syntax error to stderr; config.c reports its own, better message. */
static int quiet_iniparser(const char *fmt, ...) {
  (void)fmt;
  return 0;
}

static char *dump_text(const nmt_config *c, size_t *n) {
  char *t = NULL;
  FILE *f = open_memstream(&t, n);
  if (!f) return NULL;
  nmt_config_dump(c, f);
  fclose(f);
  return t;
}

int nmt_fuzz_ini(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  iniparser_set_error_callback(quiet_iniparser);
  nmt_config a, b;
  nmt_status s;
  char path[64];
  if (data[0] & 1) {
    char *buf = malloc(size);
    if (!buf) return 0;
    memcpy(buf, data + 1, size - 1);
    buf[size - 1] = 0;
    const char *ovs[32];
    int n = 0;
    for (char *p = buf; n < 32;) {
      ovs[n++] = p;
      char *nl = strchr(p, '\n');
      if (!nl) break;
      *nl = 0;
      p = nl + 1;
    }
    s = nmt_config_load(NULL, ovs, n, &a);
    free(buf);
  } else {
    if (fuzz_memfile(0, data + 1, size - 1, path) != 0) return 0;
    s = nmt_config_load(path, NULL, 0, &a);
  }
  if (s != NMT_OK) return 0;
  size_t n1, n2;
  char *t1 = dump_text(&a, &n1);
  if (!t1) return 0;
  int bad = 0;
  if (fuzz_memfile(1, t1, n1, path) != 0) {
    free(t1);
    return 0;
  }
  if (nmt_config_load(path, NULL, 0, &b) != NMT_OK) {
    fprintf(stderr, "fuzz_ini: the dump of a loaded config does not load back: %s\n",
            nmt_last_error());
    bad = 1;
  } else {
    char *t2 = dump_text(&b, &n2);
    if (t2 && (n1 != n2 || memcmp(t1, t2, n1) != 0)) {
      fprintf(stderr, "fuzz_ini: dump -> load -> dump changed the text\n");
      bad = 1;
    }
    free(t2);
  }
  free(t1);
  return bad;
}

#define FUZZ_ENTRY nmt_fuzz_ini
#include "fuzz_common.h"
