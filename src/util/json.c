/* json.c — JSON string and number writers shared by metrics, status, eval and bench output. */
#include "nmt/json.h"

#include <math.h>

void nmt_json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c < 0x20) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
}

void nmt_json_num(FILE *f, const char *key, double v, const char *fmt) {
  fprintf(f, ", \"%s\": ", key);
  if (isfinite(v)) fprintf(f, fmt, v);
  else fputs("null", f);
}
