/* config.c — what the schema table (config_schema.c) drives in a program: defaults, INI
 * parsing, overrides, validation and the dump of the effective config (its text for people,
 * --help and docs/config.md, is config_help.c's).
 *
 * The only file that includes iniparser. iniparser is used to split the file into
 * section:key = value entries (it lowercases sections and keys, strips comments and quotes);
 * its typed getters are never used, because iniparser_getint("042") is octal 34 and
 * iniparser_getint("abc") is 0. A config is layers (load: INI files, then override strings),
 * and of each key only the value of the last layer that sets it is parsed. Every value goes
 * through set_value(), which is also how the schema's default texts become
 * nmt_config_defaults(), so a default can never be a value the parser would reject without
 * the config tests noticing.
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

#include "nmt/attention.h"
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

static int float_in_range(const key_spec *k, double v) {
  if (k->flo_open ? !(v > k->flo) : !(v >= k->flo)) return 0;
  if (k->fhi_open ? !(v < k->fhi) : !(v <= k->fhi)) return 0;
  return 1;
}

/* The range as shown in messages and docs: "[1, 1000000000]", "[0, 1)", "one of ...". */
void nmt__config_format_range(const key_spec *k, char *buf, size_t cap, int markdown) {
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
  nmt__config_format_range(k, range, sizeof range, 0);
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
    const char *why = nmt__config_parse_ll(value, &v);
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
      if ((why = nmt__config_parse_ll(value, &v)) != NULL) {
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
      if ((why = nmt__config_parse_u64(value, &v)) != NULL)
        return value_error(origin, k, value, why);
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
      if ((why = nmt__config_parse_float(value, &v)) != NULL) {
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
  if (c->kernels_attention == NMT_ATTN_FUSED &&
      !nmt_attn_supported_dk(c->model_d_model / c->model_n_heads))
    return nmt_errorf(NMT_ERR_CONFIG,
                      "%s: [kernels] attention = \"fused\" needs d_k = [model] d_model / "
                      "[model] n_heads in {32, 64, 128} (the fused kernels' head sizes), got "
                      "d_model = \"%d\" / n_heads = \"%d\" = %d; use attention = \"unfused\"",
                      origin, c->model_d_model, c->model_n_heads,
                      c->model_d_model / c->model_n_heads);
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

/* The INI file at `path` as iniparser reads it, after the checks iniparser lacks. */
static nmt_status read_file(const char *path, dictionary **out) {
  *out = NULL;
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
  if (!(*out = iniparser_load(path)))
    return nmt_errorf(NMT_ERR_CONFIG, "%s: not a valid INI file", path);
  return NMT_OK;
}

/* An iniparser entry "section:key": its key, the section copied to section[cap]; NULL for a
 * section's own entry (no ':'). */
static const char *entry_key(const char *entry, char *section, size_t cap) {
  const char *colon = strchr(entry, ':');
  if (!colon) return NULL;
  size_t n = (size_t)(colon - entry);
  if (n >= cap) n = cap - 1;
  memcpy(section, entry, n);
  section[n] = 0;
  return colon + 1;
}

/* Splits "section.key=value" into section[cap] and key[cap]: its value, or NULL with *too_long
 * 0 when it is not of that form, 1 when a name does not fit. */
static const char *split_override(const char *ov, char *section, char *key, size_t cap,
                                  int *too_long) {
  const char *eq = strchr(ov, '=');
  const char *dot = eq ? memchr(ov, '.', (size_t)(eq - ov)) : NULL;
  size_t slen = dot ? (size_t)(dot - ov) : 0, klen = dot ? (size_t)(eq - dot - 1) : 0;
  *too_long = slen >= cap || klen >= cap;
  if (!eq || !dot || !slen || !klen || *too_long) return NULL;
  memcpy(section, ov, slen);
  section[slen] = 0;
  memcpy(key, dot + 1, klen);
  key[klen] = 0;
  return eq + 1;
}

/* A config's layers, in the order they apply: the INI files paths[0..n_paths) (layers 0 ..
 * n_paths-1), then each string of base[] and of ov[] as a layer of its own. Only the value of
 * the layer that sets a key last is parsed: a later file or override replaces a value, so a
 * bad value it replaces is no error (as Marian's --config a.yml b.yml merges before it reads
 * a value); an unknown section or key is one wherever it is. */
typedef struct {
  const char *const *paths, *const *base, *const *ov;
  int n_paths, n_base, n_ov;
  const char *base_origin; /* what base's errors name */
  dictionary **files;      /* paths[i] as iniparser read it */
  int *last;               /* per schema key: the layer that sets it last; -1: none */
} layers;

static void mark_last(const layers *L) {
  char section[128], key[128];
  for (int i = 0; i < nmt__config_n_keys; i++) L->last[i] = -1;
  for (int i = 0; i < L->n_paths; i++)
    for (ssize_t e = 0; e < L->files[i]->size; e++) {
      const char *k = L->files[i]->key[e] ? entry_key(L->files[i]->key[e], section, sizeof section)
                                          : NULL;
      const key_spec *spec = k ? find_key(section, k) : NULL;
      if (spec) L->last[spec - schema] = i;
    }
  for (int j = 0; j < L->n_base + L->n_ov; j++) {
    int too_long;
    const char *s = j < L->n_base ? L->base[j] : L->ov[j - L->n_base];
    const key_spec *spec = split_override(s, section, key, sizeof key, &too_long)
                               ? find_key(section, key) : NULL;
    if (spec) L->last[spec - schema] = L->n_paths + j;
  }
}

/* Applies every entry of file i to *cfg whose key no later layer sets. */
static nmt_status apply_file(nmt_config *cfg, const layers *L, int i) {
  const dictionary *d = L->files[i];
  const char *path = L->paths[i];
  /* Entries are in file order (scan_file refused repeated keys), so the first error
   * reported is the first one in the file. A section is an entry without ':' and no value. */
  for (ssize_t e = 0; e < d->size; e++) {
    const char *entry = d->key[e];
    if (!entry) continue;
    char section[128];
    const char *key = entry_key(entry, section, sizeof section);
    if (!key) {
      /* An unknown section with keys is reported at its first key, which names the key and
       * value too; an empty one is reported here. */
      if (!section_known(entry) && iniparser_getsecnkeys(d, entry) == 0) {
        char known[256];
        list_sections(known, sizeof known);
        return nmt_errorf(NMT_ERR_CONFIG, "%s: [%s]: unknown section (sections: %s)", path,
                          entry, known);
      }
      continue;
    }
    const char *value = d->val[e] ? d->val[e] : "";
    if (!section[0])
      return nmt_errorf(NMT_ERR_CONFIG, "%s: %s = \"%s\": key outside any [section]", path, key,
                        value);
    const key_spec *spec = find_key(section, key);
    if (spec && L->last[spec - schema] != i) continue;
    NMT_TRY(nmt_config_set(cfg, section, key, value, path));
  }
  return NMT_OK;
}

/* Applies string j of the layers after the files (base, then ov), unless a later one sets its
 * key; errors name `origin`. */
static nmt_status apply_string(nmt_config *cfg, const layers *L, int j, const char *origin) {
  const char *ov = j < L->n_base ? L->base[j] : L->ov[j - L->n_base];
  char section[128], key[128], o[ORIGIN_SHOWN + 1], v[VALUE_SHOWN + 1];
  int too_long;
  const char *value = split_override(ov, section, key, sizeof key, &too_long);
  if (!value)
    return nmt_errorf(NMT_ERR_CONFIG, "%s: override \"%s\": %s",
                      clip(origin, ORIGIN_SHOWN, o, sizeof o), clip(ov, VALUE_SHOWN, v, sizeof v),
                      too_long ? "unknown key"
                               : "expected section.key=value (e.g. train.max_steps=1000)");
  const key_spec *spec = find_key(section, key);
  if (spec && L->last[spec - schema] != L->n_paths + j) return NMT_OK;
  return nmt_config_set(cfg, section, key, value, origin);
}

/* "a.ini + b.ini + BASE_ORIGIN + command line" in buf: the files, then base_origin (NULL:
 * none) and "command line" when there are overrides; "defaults" for no source at all. */
static void join_sources(const char *const *paths, int n_paths, const char *base_origin,
                         int n_overrides, char *buf, size_t cap) {
  size_t len = 0;
  buf[0] = 0;
  for (int i = 0; i < n_paths + 2; i++) {
    const char *s = i < n_paths ? paths[i] : i == n_paths ? base_origin
                                         : n_overrides > 0 ? "command line" : NULL;
    int n = s ? snprintf(buf + len, cap - len, "%s%s", len ? " + " : "", s) : 0;
    if (n < 0 || (size_t)n >= cap - len) break;
    len += (size_t)n;
  }
  if (!buf[0]) snprintf(buf, cap, "defaults");
}

void nmt_config_sources(const char *const *paths, int n_paths, int n_overrides, char *buf,
                        size_t cap) {
  if (cap > 0) join_sources(paths, n_paths, NULL, n_overrides, buf, cap);
}

static nmt_status load(layers *L, nmt_config *cfg) {
  /* Built in a copy so that *cfg is untouched when loading fails. */
  nmt_config tmp;
  nmt_config_defaults(&tmp);
  nmt_status st = NMT_OK;
  L->files = calloc((size_t)L->n_paths + 1, sizeof *L->files);
  L->last = calloc((size_t)nmt__config_n_keys, sizeof *L->last);
  if (!L->files || !L->last) {
    st = nmt_errorf(NMT_ERR_NOMEM, "config: %d files", L->n_paths);
    goto out;
  }
  /* Every file is read before any value is taken: which value takes effect needs them all. */
  for (int i = 0; i < L->n_paths; i++) NMT_TRY_GOTO(st, read_file(L->paths[i], &L->files[i]), out);
  mark_last(L);
  for (int i = 0; i < L->n_paths; i++) NMT_TRY_GOTO(st, apply_file(&tmp, L, i), out);
  for (int j = 0; j < L->n_base + L->n_ov; j++)
    NMT_TRY_GOTO(st, apply_string(&tmp, L, j, j < L->n_base ? L->base_origin : "command line"),
                 out);
  /* A cross-key error names every source: each key may come from any of them. */
  char origin[8192], shown[ORIGIN_SHOWN + 1];
  join_sources(L->paths, L->n_paths, L->n_base ? L->base_origin : NULL, L->n_ov, origin,
               sizeof origin);
  const char *o = clip(origin, ORIGIN_SHOWN, shown, sizeof shown);
  NMT_TRY_GOTO(st, expand_job(&tmp, o), out);
  NMT_TRY_GOTO(st, validate(&tmp, o), out);
  *cfg = tmp;
out:
  for (int i = 0; L->files && i < L->n_paths; i++)
    if (L->files[i]) iniparser_freedict(L->files[i]);
  free(L->files);
  free(L->last);
  return st;
}

nmt_status nmt_config_load_files(const char *const *paths, int n_paths,
                                 const char *const *overrides, int n_overrides, nmt_config *cfg) {
  if (n_paths < 0 || (n_paths > 0 && !paths) || n_overrides < 0 || (n_overrides > 0 && !overrides))
    return nmt_errorf(NMT_ERR_USAGE, "nmt_config_load_files: %d files, %d overrides", n_paths,
                      n_overrides);
  for (int i = 0; i < n_paths; i++)
    if (!paths[i]) return nmt_errorf(NMT_ERR_USAGE, "nmt_config_load_files: file %d is NULL", i);
  layers L = {.paths = paths, .n_paths = n_paths, .ov = overrides, .n_ov = n_overrides};
  return load(&L, cfg);
}

nmt_status nmt_config_load_layered(const char *path, const char *const *base, int n_base,
                                   const char *base_origin, const char *const *overrides,
                                   int n_overrides, nmt_config *cfg) {
  layers L = {.paths = &path, .n_paths = path ? 1 : 0, .base = base, .n_base = n_base,
              .base_origin = base_origin ? base_origin : "config", .ov = overrides,
              .n_ov = n_overrides};
  return load(&L, cfg);
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
          "; nmt effective configuration: every key, with its default applied where no file "
          "or override set it.\n; Reference: docs/config.md. Load it again as the CONFIG of any "
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
