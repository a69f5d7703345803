/* config.c — everything the schema table (config_schema.c) drives: defaults, INI parsing,
 * overrides, validation, the dump of the effective config, --help text and docs/config.md.
 *
 * The only file that includes iniparser. iniparser is used to split the file into
 * section:key = value entries (it lowercases sections and keys, strips comments and quotes);
 * its typed getters are never used, because iniparser_getint("042") is octal 34 and
 * iniparser_getint("abc") is 0. Every value goes through set_value(), which is also how the
 * schema's default texts become nmt_config_defaults(), so a default can never be a value the
 * parser would reject without the config tests noticing.
 */
#include "nmt/config.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <iniparser.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "config_impl.h"

/* The table of config_schema.c under a short name. */
static const key_spec *const schema = nmt__config_schema;

/* Longest string value: its dump line `key = "value"` must fit iniparser's 1024-byte line
 * buffer, or config.ini (the dump) would not load back (found by test/fuzz/fuzz_ini.c). */
enum { STRING_MAX = 1000 };

static const char *const bool_true[] = {"true", "on", "yes", "1"};
static const char *const bool_false[] = {"false", "off", "no", "0"};

static const key_spec *find_key(const char *section, const char *key) {
  for (int i = 0; i < nmt__config_n_keys; i++)
    if (!strcmp(schema[i].section, section) && !strcmp(schema[i].key, key)) return &schema[i];
  return NULL;
}

/* Messages name the origin and the value before saying what is wrong, in one bounded buffer
 * (nmt_errorf's): a long path or value is shown cut in its middle ("abc...xyz") so that the
 * reason after it survives. */
enum { ORIGIN_SHOWN = 240, VALUE_SHOWN = 160 };

static const char *clip(const char *s, size_t max, char *out, size_t cap) {
  size_t n = strlen(s);
  if (n <= max || max < 8 || cap <= max) return s;
  size_t head = (max - 3) / 2, tail = max - 3 - head;
  snprintf(out, cap, "%.*s...%s", (int)head, s, s + n - tail);
  return out;
}

static int section_known(const char *section) {
  for (int i = 0; i < nmt__config_n_keys; i++)
    if (!strcmp(schema[i].section, section)) return 1;
  return 0;
}

/* "run, data, model, ..." in schema order, for messages. */
static void list_sections(char *buf, size_t cap) {
  size_t len = 0;
  buf[0] = 0;
  for (int i = 0; i < nmt__config_n_keys; i++) {
    if (i > 0 && !strcmp(schema[i - 1].section, schema[i].section)) continue;
    int n = snprintf(buf + len, cap - len, "%s%s", len ? ", " : "", schema[i].section);
    if (n < 0 || (size_t)n >= cap - len) return;
    len += (size_t)n;
  }
}

static void list_keys(const char *section, char *buf, size_t cap) {
  size_t len = 0;
  buf[0] = 0;
  for (int i = 0; i < nmt__config_n_keys; i++) {
    if (strcmp(schema[i].section, section)) continue;
    int n = snprintf(buf + len, cap - len, "%s%s", len ? ", " : "", schema[i].key);
    if (n < 0 || (size_t)n >= cap - len) return;
    len += (size_t)n;
  }
}

/* ---- strict scalar parsing; each returns a reason string, or NULL on success ---- */

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

static const char *parse_ll(const char *s, long long *out) {
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

static const char *parse_u64(const char *s, uint64_t *out) {
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
static const char *parse_float(const char *s, float *out) {
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

static int float_in_range(const key_spec *k, double v) {
  if (k->flo_open ? !(v > k->flo) : !(v >= k->flo)) return 0;
  if (k->fhi_open ? !(v < k->fhi) : !(v <= k->fhi)) return 0;
  return 1;
}

/* The range as shown in messages and docs: "[1, 1000000000]", "[0, 1)", "one of ...". */
static void format_range(const key_spec *k, char *buf, size_t cap, int markdown) {
  switch (k->type) {
    case T_INT:
    case T_LONG:
      snprintf(buf, cap, "[%lld, %lld]", k->ilo, k->ihi);
      break;
    case T_U64:
      snprintf(buf, cap, "[0, %" PRIu64 "]", UINT64_MAX);
      break;
    case T_FLOAT:
      snprintf(buf, cap, "%c%g, %g%c%s", k->flo_open ? '(' : '[', k->flo, k->fhi,
               k->fhi_open ? ')' : ']', k->float_auto ? ", or auto" : "");
      break;
    case T_BOOL:
      snprintf(buf, cap, "true, false, on, off, yes, no, 1, 0");
      break;
    case T_STRING:
      snprintf(buf, cap, "at most %d bytes%s", STRING_MAX,
               markdown ? "" : ", no double quote or control character, no outer space");
      break;
    case T_DEVICES:
      snprintf(buf, cap, "count in [%lld, %lld], or a list of up to %d distinct indices in [0, "
               "%lld]", k->ilo, k->ihi, NMT_MAX_DEVICE_IDS, k->ihi - 1);
      break;
    case T_ENUM: {
      size_t len = 0;
      buf[0] = 0;
      for (int i = 0; k->names[i]; i++) {
        int n = snprintf(buf + len, cap - len, "%s%s", i ? ", " : "", k->names[i]);
        if (n < 0 || (size_t)n >= cap - len) break;
        len += (size_t)n;
      }
      break;
    }
  }
}

static nmt_status value_error(const char *origin, const key_spec *k, const char *value,
                              const char *why) {
  char o[ORIGIN_SHOWN + 1], v[VALUE_SHOWN + 1];
  return nmt_errorf(NMT_ERR_CONFIG, "%s: [%s] %s = \"%s\": %s", clip(origin, ORIGIN_SHOWN, o,
                    sizeof o), k->section, k->key, clip(value, VALUE_SHOWN, v, sizeof v), why);
}

static nmt_status range_error(const char *origin, const key_spec *k, const char *value) {
  char range[128], why[160];
  format_range(k, range, sizeof range, 0);
  /* The range text of each type reads after its own verb: "must be in [1, 64]", "must be one
   * of fp32, ...", "must be a count in [1, 1024], or a list ...". */
  const char *verb = k->type == T_ENUM || k->type == T_BOOL ? "must be one of"
                     : k->type == T_DEVICES                 ? "must be a"
                                                            : "must be in";
  snprintf(why, sizeof why, "%s %s", verb, range);
  return value_error(origin, k, value, why);
}

/* parallel.devices: "N" is a count; "a,b", "[a]" or "[a, b]" a list of device indices. */
static nmt_status set_devices(nmt_config *cfg, const key_spec *k, const char *value,
                              const char *origin) {
  const char *p = value;
  while (*p == ' ') p++;
  int bracket = *p == '[';
  if (!bracket && !strchr(value, ',')) {
    long long v;
    const char *why = parse_ll(value, &v);
    if (why && strcmp(why, "out of range")) return value_error(origin, k, value, why);
    if (why || v < k->ilo || v > k->ihi) return range_error(origin, k, value);
    cfg->parallel_devices = (int)v;
    cfg->parallel_device_ids_n = 0;
    return NMT_OK;
  }
  if (bracket) p++;
  int ids[NMT_MAX_DEVICE_IDS], n = 0;
  for (;;) {
    while (*p == ' ') p++;
    if (bracket && *p == ']') break;
    char *end;
    errno = 0;
    long v = strtol(p, &end, 10);
    if (end == p || errno || v < 0 || v >= k->ihi)
      return value_error(origin, k, value, "a device list holds indices in [0, 1023], separated "
                                           "by commas");
    if (n == NMT_MAX_DEVICE_IDS) return range_error(origin, k, value);
    ids[n++] = (int)v;
    p = end;
    while (*p == ' ') p++;
    if (*p == ',') {
      p++;
      continue;
    }
    if (bracket && *p == ']') break;
    if (!bracket && !*p) break;
    return value_error(origin, k, value, bracket ? "expected \",\" or \"]\"" : "expected \",\"");
  }
  if (bracket) {
    p++;
    while (*p == ' ') p++;
    if (*p) return value_error(origin, k, value, "text after \"]\"");
  }
  if (n == 0) return value_error(origin, k, value, "an empty device list");
  cfg->parallel_devices = n;
  cfg->parallel_device_ids_n = n;
  memcpy(cfg->parallel_device_ids, ids, (size_t)n * sizeof ids[0]);
  return NMT_OK;
}

/* Parses `value` (already stripped of surrounding quotes) as k's type and stores it. */
static nmt_status set_value(nmt_config *cfg, const key_spec *k, const char *value,
                            const char *origin) {
  char *field = (char *)cfg + k->offset;
  const char *why = NULL;
  switch (k->type) {
    case T_INT:
    case T_LONG: {
      long long v;
      if ((why = parse_ll(value, &v)) != NULL) {
        if (strcmp(why, "out of range")) return value_error(origin, k, value, why);
        return range_error(origin, k, value);
      }
      if (v < k->ilo || v > k->ihi) return range_error(origin, k, value);
      if (k->type == T_INT) {
        int iv = (int)v;
        memcpy(field, &iv, sizeof iv);
      } else {
        long lv = (long)v;
        memcpy(field, &lv, sizeof lv);
      }
      return NMT_OK;
    }
    case T_U64: {
      uint64_t v;
      if ((why = parse_u64(value, &v)) != NULL) return value_error(origin, k, value, why);
      memcpy(field, &v, sizeof v);
      return NMT_OK;
    }
    case T_FLOAT: {
      float v;
      if (k->float_auto && !strcmp(value, "auto")) {
        v = 0.0f;
        memcpy(field, &v, sizeof v);
        return NMT_OK;
      }
      if ((why = parse_float(value, &v)) != NULL) {
        if (strcmp(why, "out of range"))
          return value_error(origin, k, value, k->float_auto ? "neither a number nor auto" : why);
        return range_error(origin, k, value);
      }
      /* The range is checked on the stored float: "0.99999999999" is below 1 as a double
       * but rounds to 1.0f, which a dropout probability must not be. */
      if (!float_in_range(k, (double)v)) return range_error(origin, k, value);
      memcpy(field, &v, sizeof v);
      return NMT_OK;
    }
    case T_BOOL: {
      int v = -1;
      for (size_t i = 0; i < sizeof bool_true / sizeof bool_true[0]; i++) {
        if (!strcmp(value, bool_true[i])) v = 1;
        if (!strcmp(value, bool_false[i])) v = 0;
      }
      if (v < 0) return range_error(origin, k, value);
      memcpy(field, &v, sizeof v);
      return NMT_OK;
    }
    case T_STRING: {
      size_t n = strlen(value);
      if (n > STRING_MAX) {
        char msg[64];
        snprintf(msg, sizeof msg, "longer than %d bytes", STRING_MAX);
        return value_error(origin, k, value, msg);
      }
      /* A double quote or a control character could not be written back into an INI file
       * that iniparser reads as the same string, so the dump would not round-trip. */
      for (const char *q = value; *q; q++)
        if (*q == '"' || (unsigned char)*q < 0x20 || *q == 0x7f)
          return value_error(origin, k, value,
                             "must not contain a double quote or a control character");
      /* iniparser strips the quotes of `key = "a "` before this file trims spaces, so a value
       * with outer spaces would come back changed from the dump (found by fuzz_ini). */
      if (n > 0 && (value[0] == ' ' || value[n - 1] == ' '))
        return value_error(origin, k, value, "must not start or end with a space");
      memset(field, 0, NMT_PATH_MAX);
      memcpy(field, value, n);
      return NMT_OK;
    }
    case T_ENUM: {
      for (int i = 0; k->names[i]; i++) {
        if (!strcmp(value, k->names[i])) {
          memcpy(field, &i, sizeof i);
          return NMT_OK;
        }
      }
      return range_error(origin, k, value);
    }
    case T_DEVICES:
      return set_devices(cfg, k, value, origin);
  }
  return nmt_errorf(NMT_ERR_INTERNAL, "config: [%s] %s has an unknown type", k->section, k->key);
}

/* Copies `in` without surrounding whitespace and one pair of surrounding double quotes. */
static void strip_value(const char *in, char *out, size_t cap) {
  while (*in == ' ' || *in == '\t') in++;
  size_t n = strlen(in);
  while (n > 0 && (in[n - 1] == ' ' || in[n - 1] == '\t' || in[n - 1] == '\r' || in[n - 1] == '\n'))
    n--;
  if (n >= 2 && in[0] == '"' && in[n - 1] == '"') {
    in++;
    n -= 2;
  }
  if (n >= cap) n = cap - 1;
  memcpy(out, in, n);
  out[n] = 0;
}

nmt_status nmt_config_set(nmt_config *cfg, const char *section, const char *key, const char *value,
                          const char *origin) {
  if (!origin) origin = "config";
  const key_spec *k = find_key(section, key);
  if (!k) {
    char known[1024], o[ORIGIN_SHOWN + 1], v[VALUE_SHOWN + 1], sk[2][64];
    origin = clip(origin, ORIGIN_SHOWN, o, sizeof o);
    value = clip(value, VALUE_SHOWN, v, sizeof v);
    section = clip(section, 60, sk[0], sizeof sk[0]), key = clip(key, 60, sk[1], sizeof sk[1]);
    if (!section_known(section)) {
      list_sections(known, sizeof known);
      return nmt_errorf(NMT_ERR_CONFIG, "%s: [%s] %s = \"%s\": unknown section [%s] (sections: %s)",
                        origin, section, key, value, section, known);
    }
    list_keys(section, known, sizeof known);
    return nmt_errorf(NMT_ERR_CONFIG, "%s: [%s] %s = \"%s\": unknown key (keys of [%s]: %s)",
                      origin, section, key, value, section, known);
  }
  /* Long enough for a path of NMT_PATH_MAX-1 bytes in quotes plus one byte more, so that an
   * over-long value is reported as too long rather than silently cut. */
  char v[NMT_PATH_MAX + 8];
  strip_value(value, v, sizeof v);
  return set_value(cfg, k, v, origin);
}

void nmt_config_defaults(nmt_config *cfg) {
  memset(cfg, 0, sizeof *cfg);
  for (int i = 0; i < nmt__config_n_keys; i++) {
    /* A default the parser rejects is a bug in the table; nmt_errorf logs it and the config
     * tests compare every default against the paper's values. */
    (void)set_value(cfg, &schema[i], schema[i].def, "schema default");
  }
}

/* Cross-key constraints, checked after the file and the overrides. Each message names both
 * keys and their values. */
void nmt_config_devices_str(const nmt_config *cfg, char *buf, size_t cap) {
  if (cap == 0) return;
  if (cfg->parallel_device_ids_n == 0) {
    snprintf(buf, cap, "%d", cfg->parallel_devices);
    return;
  }
  size_t len = 0;
  len += (size_t)snprintf(buf, cap, "[");
  for (int i = 0; i < cfg->parallel_device_ids_n && len < cap; i++)
    len += (size_t)snprintf(buf + len, cap - len, "%s%d", i ? "," : "",
                            cfg->parallel_device_ids[i]);
  if (len < cap) snprintf(buf + len, cap - len, "]");
}

static nmt_status validate(const nmt_config *c, const char *origin) {
  if (c->model_d_model % c->model_n_heads != 0)
    return nmt_errorf(NMT_ERR_CONFIG,
                      "%s: [model] d_model = \"%d\" is not divisible by [model] n_heads = \"%d\" "
                      "(each head has d_k = d_model / n_heads, Vaswani et al. 2017 §3.2.2)",
                      origin, c->model_d_model, c->model_n_heads);
  if (c->model_d_model % 2 != 0)
    return nmt_errorf(NMT_ERR_CONFIG,
                      "%s: [model] d_model = \"%d\" must be even: sinusoidal positions pair sin "
                      "and cos over the d_model dimensions (§3.5)",
                      origin, c->model_d_model);
  if (c->data_max_tokens < c->data_max_len)
    return nmt_errorf(NMT_ERR_CONFIG,
                      "%s: [data] max_tokens = \"%d\" is less than [data] max_len = \"%d\": a "
                      "pair of max_len ids would not fit in any micro-batch",
                      origin, c->data_max_tokens, c->data_max_len);
  if (c->model_max_positions < c->data_max_len)
    return nmt_errorf(NMT_ERR_CONFIG,
                      "%s: [model] max_positions = \"%d\" is less than [data] max_len = \"%d\": "
                      "training sequences would run past the position table",
                      origin, c->model_max_positions, c->data_max_len);
  if (c->precision_floor > c->precision_loss_scale)
    return nmt_errorf(NMT_ERR_CONFIG,
                      "%s: [precision] floor = \"%g\" is above [precision] loss_scale = \"%g\": "
                      "the first overflow would already count as diverged",
                      origin, c->precision_floor, c->precision_loss_scale);
  if (c->parallel_grad_dtype == NMT_GRAD_FP16 && c->precision_mode != NMT_PRECISION_FP16)
    return nmt_errorf(NMT_ERR_CONFIG,
                      "%s: [parallel] grad_dtype = \"fp16\" needs [precision] mode = \"fp16\" "
                      "(got \"%s\"): gradients are sums over the step's tokens and overflow "
                      "fp16 without the dynamic loss scale that skips such steps; use "
                      "grad_dtype = \"bf16\" (the range of fp32)",
                      origin, nmt__config_precision_names[c->precision_mode]);
  if (c->parallel_qkv == NMT_QKV_STREAMS && c->parallel_aux_streams < 2)
    return nmt_errorf(NMT_ERR_CONFIG,
                      "%s: [parallel] qkv = \"streams\" needs [parallel] aux_streams >= 2 (K and V "
                      "run on two extra streams), got \"%d\"",
                      origin, c->parallel_aux_streams);
  if (c->parallel_device == NMT_DEVICE_CPU && c->parallel_device_ids_n > 0) {
    char list[NMT_MAX_DEVICE_IDS * 6];
    nmt_config_devices_str(c, list, sizeof list);
    return nmt_errorf(NMT_ERR_CONFIG,
                      "%s: [parallel] devices = \"%s\" is a list of CUDA device indices, but "
                      "[parallel] device = \"cpu\" runs CPU workers, which have none; write "
                      "devices = %d for %d CPU workers (or device = cuda to use those GPUs)",
                      origin, list, c->parallel_device_ids_n, c->parallel_device_ids_n);
  }
  for (int i = 0; i < c->parallel_device_ids_n; i++)
    for (int j = 0; j < i; j++)
      if (c->parallel_device_ids[i] == c->parallel_device_ids[j] &&
          c->parallel_comm != NMT_COMM_HOST) {
        char list[NMT_MAX_DEVICE_IDS * 6];
        nmt_config_devices_str(c, list, sizeof list);
        return nmt_errorf(NMT_ERR_CONFIG,
                          "%s: [parallel] devices = \"%s\" lists device %d twice, which needs "
                          "[parallel] comm = \"host\" (got \"%s\"): NCCL refuses two ranks on "
                          "one GPU (\"Duplicate GPU detected\"); the host-staged communicator "
                          "runs several workers on one GPU (for tests: it reduces on the host)",
                          origin, list, c->parallel_device_ids[i],
                          c->parallel_comm == NMT_COMM_NCCL ? "nccl" : "auto");
      }
  if (c->parallel_device == NMT_DEVICE_CPU && c->parallel_comm == NMT_COMM_NCCL)
    return nmt_errorf(NMT_ERR_CONFIG,
                      "%s: [parallel] comm = \"nccl\" needs GPU workers, but [parallel] device = "
                      "\"cpu\" runs CPU workers: use comm = auto (or host)", origin);
  if (c->profile_stop_step > 0 && c->profile_stop_step < c->profile_start_step)
    return nmt_errorf(NMT_ERR_CONFIG,
                      "%s: [profile] stop_step = \"%ld\" is before [profile] start_step = \"%ld\"",
                      origin, c->profile_stop_step, c->profile_start_step);
  return NMT_OK;
}

/* Each "{job}" in run.out_dir becomes $SLURM_JOB_ID, or "local" outside Slurm: one directory
 * per job, and a job Slurm requeues after preemption keeps its id, so `--resume` finds its own
 * checkpoints. */
static nmt_status expand_job(nmt_config *c, const char *origin) {
  static const char tok[] = "{job}";
  if (!strstr(c->run_out_dir, tok)) return NMT_OK;
  const char *job = getenv("SLURM_JOB_ID");
  if (!job || !*job) job = "local";
  char shown[VALUE_SHOWN + 1];
  const char *dir = clip(c->run_out_dir, VALUE_SHOWN, shown, sizeof shown);
  for (const char *q = job; *q; q++)
    if (!isalnum((unsigned char)*q) && *q != '_' && *q != '-' && *q != '.')
      return nmt_errorf(NMT_ERR_CONFIG,
                        "%s: [run] out_dir = \"%s\": SLURM_JOB_ID = \"%s\" cannot be part of a "
                        "directory name",
                        origin, dir, job);
  char out[NMT_PATH_MAX];
  size_t n = 0;
  for (const char *p = c->run_out_dir; *p;) {
    const char *piece = p;
    size_t len = 1;
    if (!strncmp(p, tok, sizeof tok - 1)) piece = job, len = strlen(job), p += sizeof tok - 1;
    else p++;
    if (n + len > STRING_MAX)
      return nmt_errorf(NMT_ERR_CONFIG, "%s: [run] out_dir = \"%s\" is too long with {job} = %s",
                        origin, dir, job);
    memcpy(out + n, piece, len);
    n += len;
  }
  out[n] = 0;
  memcpy(c->run_out_dir, out, n + 1);
  return NMT_OK;
}

/* iniparser reports its own errors on stderr through this callback; nmt__config_scan_file has
 * reported any it would find, once and with the file's name, so it stays silent. */
static int ini_quiet(const char *fmt, ...) {
  (void)fmt;
  return 0;
}

/* Applies every entry of the INI file at `path` to *cfg. */
static nmt_status apply_file(nmt_config *cfg, const char *path) {
  /* fopen(dir, "r") succeeds on Linux and iniparser then reads nothing, which would make a
   * directory an empty config (all defaults) and blame a missing [data] train much later. */
  struct stat sb;
  if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
    return nmt_errorf(NMT_ERR_CONFIG, "%s: cannot open config: is a directory, not an INI file",
                      path);
  /* An empty file is no config either: with all defaults the error would come much later and
   * name something else (a missing checkpoint in runs/default, a missing [data] train). */
  if (stat(path, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size == 0)
    return nmt_errorf(NMT_ERR_CONFIG, "%s: empty file: expected an INI config", path);
  NMT_TRY(nmt__config_scan_file(path));
  iniparser_set_error_callback(ini_quiet);
  dictionary *d = iniparser_load(path);
  if (!d) return nmt_errorf(NMT_ERR_CONFIG, "%s: not a valid INI file", path);
  nmt_status st = NMT_OK;
  /* Entries are in file order (scan_file refused repeated keys), so the first error
   * reported is the first one in the file. A section is an entry without ':' and no value. */
  for (ssize_t i = 0; i < d->size && st == NMT_OK; i++) {
    const char *entry = d->key[i];
    if (!entry) continue;
    const char *colon = strchr(entry, ':');
    if (!colon) {
      /* An unknown section with keys is reported at its first key, which names the key and
       * value too; an empty one is reported here. */
      if (!section_known(entry) && iniparser_getsecnkeys(d, entry) == 0) {
        char known[256];
        list_sections(known, sizeof known);
        st = nmt_errorf(NMT_ERR_CONFIG, "%s: [%s]: unknown section (sections: %s)", path, entry,
                        known);
      }
      continue;
    }
    size_t slen = (size_t)(colon - entry);
    const char *value = d->val[i] ? d->val[i] : "";
    if (slen == 0) {
      st = nmt_errorf(NMT_ERR_CONFIG, "%s: %s = \"%s\": key outside any [section]", path,
                      colon + 1, value);
      continue;
    }
    char section[128];
    if (slen >= sizeof section) slen = sizeof section - 1;
    memcpy(section, entry, slen);
    section[slen] = 0;
    st = nmt_config_set(cfg, section, colon + 1, value, path);
  }
  iniparser_freedict(d);
  return st;
}

/* Splits "section.key=value" and applies it; errors name `origin`. */
static nmt_status apply_override(nmt_config *cfg, const char *ov, const char *origin) {
  const char *eq = strchr(ov, '=');
  const char *dot = eq ? memchr(ov, '.', (size_t)(eq - ov)) : NULL;
  char o[ORIGIN_SHOWN + 1], v[VALUE_SHOWN + 1];
  if (!eq || !dot || dot == ov || dot + 1 == eq)
    return nmt_errorf(NMT_ERR_CONFIG,
                      "%s: override \"%s\": expected section.key=value "
                      "(e.g. train.max_steps=1000)",
                      clip(origin, ORIGIN_SHOWN, o, sizeof o), clip(ov, VALUE_SHOWN, v, sizeof v));
  char section[128], key[128];
  size_t slen = (size_t)(dot - ov), klen = (size_t)(eq - dot - 1);
  if (slen >= sizeof section || klen >= sizeof key)
    return nmt_errorf(NMT_ERR_CONFIG, "%s: override \"%s\": unknown key",
                      clip(origin, ORIGIN_SHOWN, o, sizeof o), clip(ov, VALUE_SHOWN, v, sizeof v));
  memcpy(section, ov, slen);
  section[slen] = 0;
  memcpy(key, dot + 1, klen);
  key[klen] = 0;
  return nmt_config_set(cfg, section, key, eq + 1, origin);
}

nmt_status nmt_config_load_layered(const char *path, const char *const *base, int n_base,
                                   const char *base_origin, const char *const *overrides,
                                   int n_overrides, nmt_config *cfg) {
  /* Built in a copy so that *cfg is untouched when loading fails. */
  nmt_config tmp;
  nmt_config_defaults(&tmp);
  if (!base_origin) base_origin = "config";
  if (path) NMT_TRY(apply_file(&tmp, path));
  for (int i = 0; i < n_base; i++) NMT_TRY(apply_override(&tmp, base[i], base_origin));
  for (int i = 0; i < n_overrides; i++)
    NMT_TRY(apply_override(&tmp, overrides[i], "command line"));
  /* A cross-key error names every source that set keys: each key may come from any of them. */
  char origin[2 * NMT_PATH_MAX + 64], shown[ORIGIN_SHOWN + 1];
  snprintf(origin, sizeof origin, "%s%s%s%s", path ? path : "", path && n_base ? " + " : "",
           n_base ? base_origin : "", n_overrides ? (path || n_base ? " + command line"
                                                                     : "command line")
                                                  : "");
  if (!origin[0]) snprintf(origin, sizeof origin, "defaults");
  const char *o = clip(origin, ORIGIN_SHOWN, shown, sizeof shown);
  NMT_TRY(expand_job(&tmp, o));
  NMT_TRY(validate(&tmp, o));
  *cfg = tmp;
  return NMT_OK;
}

nmt_status nmt_config_load(const char *path, const char *const *overrides, int n_overrides,
                           nmt_config *cfg) {
  return nmt_config_load_layered(path, NULL, 0, NULL, overrides, n_overrides, cfg);
}

/* The value of key k in *cfg in a form set_value() parses back to the identical value. */
static void format_value(const nmt_config *cfg, const key_spec *k, char *buf, size_t cap) {
  const char *field = (const char *)cfg + k->offset;
  switch (k->type) {
    case T_INT:
    case T_BOOL: {
      int v;
      memcpy(&v, field, sizeof v);
      if (k->type == T_BOOL)
        snprintf(buf, cap, "%s", v ? "true" : "false");
      else
        snprintf(buf, cap, "%d", v);
      return;
    }
    case T_LONG: {
      long v;
      memcpy(&v, field, sizeof v);
      snprintf(buf, cap, "%ld", v);
      return;
    }
    case T_U64: {
      uint64_t v;
      memcpy(&v, field, sizeof v);
      snprintf(buf, cap, "%" PRIu64, v);
      return;
    }
    case T_FLOAT: {
      float v;
      memcpy(&v, field, sizeof v);
      if (k->float_auto && v == 0.0f) {
        snprintf(buf, cap, "auto");
        return;
      }
      /* The shortest of %.6g .. %.9g that reads back as the same float: %.9g always does
       * (FLT_DECIMAL_DIG), but 0.1 reads better than 0.100000001. */
      for (int prec = 6; prec <= 9; prec++) {
        snprintf(buf, cap, "%.*g", prec, (double)v);
        if (strtof(buf, NULL) == v) return;
      }
      return;
    }
    case T_STRING:
      snprintf(buf, cap, "\"%s\"", field);
      return;
    case T_DEVICES:
      nmt_config_devices_str(cfg, buf, cap);
      return;
    case T_ENUM: {
      int v;
      memcpy(&v, field, sizeof v);
      int n = 0;
      while (k->names[n]) n++;
      snprintf(buf, cap, "%s", v >= 0 && v < n ? k->names[v] : "?");
      return;
    }
  }
  snprintf(buf, cap, "?");
}

const char *nmt_config_enum_name(const char *section, const char *key, int value) {
  const key_spec *k = find_key(section, key);
  if (!k || k->type != T_ENUM || value < 0) return NULL;
  for (int i = 0; k->names[i]; i++)
    if (i == value) return k->names[i];
  return NULL;
}

nmt_status nmt_config_dump(const nmt_config *cfg, FILE *out) {
  char value[NMT_PATH_MAX + 8];
  fprintf(out,
          "; nmt effective configuration: every key, with its default applied where the file "
          "did not set it.\n; Reference: docs/config.md. Load it again as the CONFIG of any "
          "command, e.g. nmt train THIS_FILE.\n");
  for (int i = 0; i < nmt__config_n_keys; i++) {
    const key_spec *k = &schema[i];
    if (i == 0 || strcmp(schema[i - 1].section, k->section)) fprintf(out, "\n[%s]\n", k->section);
    format_value(cfg, k, value, sizeof value);
    fprintf(out, "; %s\n%s = %s\n", k->doc, k->key, value);
  }
  if (fflush(out) != 0 || ferror(out))
    return nmt_errorf(NMT_ERR_IO, "config dump: write failed: %s", strerror(errno));
  return NMT_OK;
}

static const char *type_name(key_type t) {
  switch (t) {
    case T_INT: return "int";
    case T_LONG: return "long";
    case T_U64: return "u64";
    case T_FLOAT: return "float";
    case T_BOOL: return "bool";
    case T_STRING: return "string";
    case T_ENUM: return "enum";
    case T_DEVICES: return "count or list";
  }
  return "?";
}

/* Writes s with '|' escaped, for a markdown table cell. */
static void md_cell(FILE *out, const char *s) {
  for (; *s; s++) {
    if (*s == '|') fputc('\\', out);
    fputc(*s, out);
  }
}

void nmt_config_help(FILE *out, int markdown) {
  char range[256];
  if (markdown) {
    fputs("# nmt configuration reference\n\n"
          "<!-- Generated from the schema in src/config.c by nmt_config_help(out, 1). Do not "
          "edit by hand: the test config_docs_up_to_date fails when this file and the schema "
          "disagree. -->\n\n"
          "A run is configured by one INI file (`conf/*.ini`) plus command-line overrides "
          "`section.key=value`, applied after the file in order. Every key has a default, so a "
          "file sets only what it changes; the trainer writes the effective configuration, "
          "every key with its doc, to `run.out_dir/config.ini`.\n\n"
          "Parsing is strict, and every error names the file (or `command line`, or the "
          "checkpoint whose embedded config holds the value), section, key and value; a long "
          "value or path is shown cut in its middle, so the reason always ends the message:\n\n"
          "- unknown sections and keys are errors; sections and keys are case-insensitive in "
          "files (iniparser lowercases them) and lowercase in overrides;\n"
          "- a key set twice in a file (in any case) is an error naming both lines; a section "
          "may appear twice; among overrides the last one wins;\n"
          "- an empty file, or a line that is not `[section]`, `key = value` or a `;`/`#` "
          "comment, is an error naming the file and the first such line;\n"
          "- integers are decimal: `abc`, `12x`, `1e3`, an empty value and a leading zero "
          "(`042`, which C would read as octal 34) are rejected; `0` is fine;\n"
          "- floats are decimal (`0.1`, `1e-9`): `nan`, `inf`, hex floats and trailing junk are "
          "rejected;\n"
          "- bools are exactly one of `true false on off yes no 1 0`;\n"
          "- strings may be written in double quotes (needed when they contain `;` or `#`) and "
          "may not contain a double quote; a quote opened must be closed on its line, with "
          "nothing but a `;`/`#` comment after it;\n"
          "- values outside the range below are rejected, and after loading, cross-key "
          "constraints are checked: `model.d_model` divisible by `model.n_heads` and even, "
          "`data.max_tokens >= data.max_len`, `model.max_positions >= data.max_len`.\n\n"
          "Ranges: `[a, b]` includes both ends, `(` or `)` excludes that end.\n\n"
          "| section | key | type | default | range | doc |\n"
          "|---|---|---|---|---|---|\n",
          out);
    for (int i = 0; i < nmt__config_n_keys; i++) {
      const key_spec *k = &schema[i];
      format_range(k, range, sizeof range, 1);
      fprintf(out, "| %s | %s | %s | ", k->section, k->key, type_name(k->type));
      if (k->type == T_STRING)
        fprintf(out, "`\"%s\"`", k->def);
      else
        fprintf(out, "`%s`", k->def);
      fputs(" | ", out);
      md_cell(out, range);
      fputs(" | ", out);
      md_cell(out, k->doc);
      fputs(" |\n", out);
    }
    return;
  }
  fputs("Configuration keys (INI file sections; override with section.key=value):\n", out);
  for (int i = 0; i < nmt__config_n_keys; i++) {
    const key_spec *k = &schema[i];
    if (i == 0 || strcmp(schema[i - 1].section, k->section)) fprintf(out, "\n[%s]\n", k->section);
    format_range(k, range, sizeof range, 0);
    const char *label = k->type == T_ENUM || k->type == T_BOOL ? "one of "
                        : k->type == T_STRING                  ? ""
                                                               : "range ";
    fprintf(out, "  %s  (%s, default %s%s%s, %s%s)\n      %s\n", k->key, type_name(k->type),
            k->type == T_STRING ? "\"" : "", k->def, k->type == T_STRING ? "\"" : "", label,
            range, k->doc);
  }
}
