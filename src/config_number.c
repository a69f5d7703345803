/* config_number.c — a number as a config writes it, read strictly (STYLE.md "Config"): the
 * whole text, decimal, in the type's range; strtol and strtod alone accept more. Each returns
 * the reason a text is no such number, or NULL with the value stored (config.c puts the reason
 * after the origin, key and value in its message). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "config_impl.h"

/* [+-]?[0-9]+ with no leading zero (strtol's base 0 reads "042" as octal 34, and a config
 * that means 42 must not silently become 34 or be read differently by another tool). */
static const char *check_integer_text(const char *s) {
  const char *p = s;
  if (*p == '+' || *p == '-') p++;
  if (!*p) return "not an integer";
  for (const char *q = p; *q; q++)
    if (*q < '0' || *q > '9') return "not an integer";
  if (p[0] == '0' && p[1]) return "not an integer (leading zeros are not allowed)";
  return NULL;
}

const char *nmt__config_parse_ll(const char *s, long long *out) {
  const char *why = check_integer_text(s);
  if (why) return why;
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno == ERANGE) return "out of range";
  if (*end) return "not an integer";
  *out = v;
  return NULL;
}

const char *nmt__config_parse_u64(const char *s, uint64_t *out) {
  /* strtoull accepts "-1" and returns 2^64-1, so the sign is rejected before it. */
  if (*s == '-') return "must be in [0, 18446744073709551615]";
  const char *why = check_integer_text(s);
  if (why) return why;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno == ERANGE || v > UINT64_MAX) return "must be in [0, 18446744073709551615]";
  if (*end) return "not an integer";
  *out = (uint64_t)v;
  return NULL;
}

/* Decimal floats only: strtod also reads "nan", "inf", "infinity" and hex floats ("0x1p3"),
 * none of which belong in a config, so the characters are checked first. */
const char *nmt__config_parse_float(const char *s, float *out) {
  if (!*s) return "not a number";
  for (const char *q = s; *q; q++)
    if (!strchr("0123456789+-.eE", *q)) return "not a number";
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (end == s || *end) return "not a number";
  if (errno == ERANGE || !isfinite(v) || fabs(v) > 3.4028234663852886e38)
    return "out of range";
  *out = (float)v;
  return NULL;
}
