/* config_impl.h — the config schema's row type, shared by the table (config_schema.c) and
 * everything it drives (config.c: defaults, parsing, validation, dump; config_help.c: --help
 * and docs/config.md). Internal.
 *
 * defines: key_type, key_spec, nmt__config_schema, nmt__config_n_keys,
 *          nmt__config_precision_names, nmt__config_scan_file, nmt__config_format_range,
 *          nmt__config_parse_ll, nmt__config_parse_u64, nmt__config_parse_float
 */
#ifndef NMT_CONFIG_IMPL_H
#define NMT_CONFIG_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "nmt/config.h"

typedef enum { T_INT, T_LONG, T_U64, T_FLOAT, T_BOOL, T_STRING, T_ENUM, T_DEVICES } key_type;

typedef struct {
  const char *section;
  const char *key;
  key_type type;
  size_t offset;          /* offsetof(nmt_config, field) */
  const char *def;        /* default, in the same text form a file would use */
  long long ilo, ihi;     /* T_INT, T_LONG: inclusive range */
  double flo, fhi;        /* T_FLOAT: range; open ends flagged below */
  int flo_open, fhi_open; /* 1: that end is excluded, e.g. dropout in [0, 1) */
  const char *const *names; /* T_ENUM: NULL-terminated, index = enum value */
  const char *doc;
  int float_auto;         /* T_FLOAT: 1 also accepts the word "auto", stored as 0 (outside the
                             range, which must exclude 0) and dumped as "auto" */
} key_spec;

/* config_scan.c: reads the INI file at path once and stops at the first line iniparser 4.1
 * would reject or misread (a value whose quote is not closed, or with text after its closing
 * quote) or at a key set twice (sections and keys compared lowercased, as iniparser stores
 * them). NMT_OK when none is found; NMT_ERR_CONFIG naming the file, the line (its first 60
 * bytes, control bytes as '?') or the section, key and both line numbers; NMT_ERR_NOMEM. */
nmt_status nmt__config_scan_file(const char *path);

/* config_number.c: the text s as a number, strictly: NULL with *out set, or the reason it is
 * none ("not an integer", "not an integer (leading zeros are not allowed)", "out of range",
 * "not a number", for u64 "must be in [0, 18446744073709551615]"). Integers are
 * [+-]?[0-9]+ without a leading zero (strtol's base 0 reads "042" as octal 34); floats are
 * decimal (no nan, inf or hex) and finite as a float. */
const char *nmt__config_parse_ll(const char *s, long long *out);
const char *nmt__config_parse_u64(const char *s, uint64_t *out);
const char *nmt__config_parse_float(const char *s, float *out);

/* config.c: k's range as messages and docs show it, NUL-terminated in buf (cap bytes):
 * "[1, 1000000000]", "[0, 1)", "one of fp32, tf32, ..."; markdown = 1 leaves out what the
 * docs table says elsewhere (a string's forbidden characters). */
void nmt__config_format_range(const key_spec *k, char *buf, size_t cap, int markdown);

/* The schema: one row per key, in struct order = dump order = docs order. */
extern const key_spec nmt__config_schema[];
extern const int nmt__config_n_keys;
/* [precision] mode's names, indexed by nmt_precision (for validation messages). */
extern const char *const nmt__config_precision_names[];

#endif /* NMT_CONFIG_IMPL_H */
