/* test_config.c — the config schema: defaults, the committed conf/ files, strict parsing
 * and its messages, overrides, cross-key validation, the dump round trip and docs/config.md.
 *
 * Expected values are written out here from the paper and the brief, not read from the schema,
 * so a wrong row in the schema table fails a test. Tests run from the repository root. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "helpers.h"
#include "nmt/config.h"
#include "test.h"

/* ---- helpers ---- */

static int write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (!f) return 0;
  fputs(text, f);
  return fclose(f) == 0;
}

/* Field-by-field equality, written against the struct (not the schema), so a field the
 * schema forgot does not survive the dump round trip and fails here. Names the first field
 * that differs in *what. */
static int config_equal(const nmt_config *a, const nmt_config *b, const char **what) {
#define EQ(f)                 \
  if (a->f != b->f) {         \
    *what = #f;               \
    return 0;                 \
  }
#define EQS(f)                \
  if (strcmp(a->f, b->f)) {   \
    *what = #f;               \
    return 0;                 \
  }
  EQS(run_out_dir) EQ(run_seed) EQ(run_resume)
  EQS(data_train) EQS(data_valid) EQS(data_spm_model)
  EQ(data_max_tokens) EQ(data_max_len) EQ(data_loader_threads)
  EQ(model_vocab) EQ(model_d_model) EQ(model_n_heads) EQ(model_d_ff) EQ(model_enc_layers)
  EQ(model_dec_layers) EQ(model_max_positions) EQ(model_dropout) EQ(model_attn_dropout)
  EQ(model_relu_dropout) EQ(model_norm) EQ(model_init_std)
  EQ(train_max_steps) EQ(train_log_every) EQ(train_valid_every) EQ(train_save_every)
  EQ(train_accum_steps) EQ(train_label_smoothing) EQ(train_lr_scale) EQ(train_warmup_steps)
  EQ(train_adam_beta1) EQ(train_adam_beta2) EQ(train_adam_eps) EQ(train_weight_decay)
  EQ(train_clip_norm)
  EQ(parallel_device) EQ(parallel_devices) EQ(parallel_bucket_mb)
  EQ(decode_beam) EQ(decode_max_extra_len) EQ(decode_batch_sentences)
  EQ(kernels_attention)
  EQ(checkpoint_keep)
#undef EQ
#undef EQS
  *what = NULL;
  return 1;
}

#define ASSERT_CONFIG_EQUAL(a, b)                                                       \
  do {                                                                                  \
    const char *diff_;                                                                  \
    if (!config_equal((a), (b), &diff_)) {                                              \
      nmt_test_fail(__FILE__, __LINE__, "configs differ in field %s", diff_);           \
      return;                                                                           \
    }                                                                                   \
  } while (0)

#define ASSERT_CONTAINS(hay, needle)                                                     \
  do {                                                                                   \
    if (!strstr((hay), (needle))) {                                                      \
      nmt_test_fail(__FILE__, __LINE__, "\"%s\" does not contain \"%s\"", (hay), (needle)); \
      return;                                                                            \
    }                                                                                    \
  } while (0)

/* ---- defaults ---- */

NMT_TEST(config_defaults) {
  nmt_config c;
  memset(&c, 0xAB, sizeof c); /* every field must be written */
  nmt_config_defaults(&c);
  NMT_ASSERT(!strcmp(c.run_out_dir, "runs/default"));
  NMT_ASSERT_EQ_INT(c.run_seed, 1);
  NMT_ASSERT_EQ_INT(c.run_resume, 0);
  NMT_ASSERT(!strcmp(c.data_train, ""));
  NMT_ASSERT(!strcmp(c.data_valid, ""));
  NMT_ASSERT(!strcmp(c.data_spm_model, ""));
  NMT_ASSERT_EQ_INT(c.data_max_tokens, 4096);
  NMT_ASSERT_EQ_INT(c.data_max_len, 256);
  NMT_ASSERT_EQ_INT(c.data_loader_threads, 1);
  /* Vaswani et al. 2017, Table 3, base */
  NMT_ASSERT_EQ_INT(c.model_vocab, 8000);
  NMT_ASSERT_EQ_INT(c.model_d_model, 512);
  NMT_ASSERT_EQ_INT(c.model_n_heads, 8);
  NMT_ASSERT_EQ_INT(c.model_d_ff, 2048);
  NMT_ASSERT_EQ_INT(c.model_enc_layers, 6);
  NMT_ASSERT_EQ_INT(c.model_dec_layers, 6);
  NMT_ASSERT_EQ_INT(c.model_max_positions, 1024);
  NMT_ASSERT(c.model_dropout == 0.1f);
  NMT_ASSERT(c.model_attn_dropout == 0.0f);
  NMT_ASSERT(c.model_relu_dropout == 0.0f);
  NMT_ASSERT_EQ_INT(c.model_norm, NMT_NORM_POST);
  NMT_ASSERT(c.model_init_std == 0.0f);
  NMT_ASSERT_EQ_INT(c.train_max_steps, 100000);
  NMT_ASSERT_EQ_INT(c.train_log_every, 100);
  NMT_ASSERT_EQ_INT(c.train_valid_every, 1000);
  NMT_ASSERT_EQ_INT(c.train_save_every, 1000);
  NMT_ASSERT_EQ_INT(c.train_accum_steps, 1);
  NMT_ASSERT(c.train_label_smoothing == 0.1f);
  NMT_ASSERT(c.train_lr_scale == 1.0f);
  NMT_ASSERT_EQ_INT(c.train_warmup_steps, 4000);
  NMT_ASSERT(c.train_adam_beta1 == 0.9f);
  NMT_ASSERT(c.train_adam_beta2 == 0.98f);
  NMT_ASSERT(c.train_adam_eps == 1e-9f);
  NMT_ASSERT(c.train_weight_decay == 0.0f);
  NMT_ASSERT(c.train_clip_norm == 0.0f);
  NMT_ASSERT_EQ_INT(c.parallel_device, NMT_DEVICE_AUTO);
  NMT_ASSERT_EQ_INT(c.parallel_devices, 1);
  NMT_ASSERT(c.parallel_bucket_mb == 25.0f);
  NMT_ASSERT_EQ_INT(c.parallel_grad_dtype, NMT_GRAD_FP32);
  NMT_ASSERT_EQ_INT(c.parallel_qkv, NMT_QKV_FUSED);
  NMT_ASSERT_EQ_INT(c.parallel_aux_streams, 2);
  NMT_ASSERT_EQ_INT(c.train_checkpoint_activations, 0);
  NMT_ASSERT_EQ_INT(c.kernels_attention, NMT_ATTN_UNFUSED);
  NMT_ASSERT_EQ_INT(c.decode_beam, 4);
  NMT_ASSERT_EQ_INT(c.decode_max_extra_len, 50);
  NMT_ASSERT_EQ_INT(c.decode_batch_sentences, 64);
  NMT_ASSERT_EQ_INT(c.checkpoint_keep, 5);
}

/* An empty file gives the defaults and passes the cross-key validation. */
NMT_TEST(config_empty_file_is_defaults) {
  char path[512];
  snprintf(path, sizeof path, "%s/empty.ini", nmt_test_tmpdir());
  NMT_ASSERT(write_file(path, "; nothing\n"));
  nmt_config c, d;
  NMT_ASSERT_OK(nmt_config_load(path, NULL, 0, &c));
  nmt_config_defaults(&d);
  ASSERT_CONFIG_EQUAL(&c, &d);
}

/* ---- the committed files ---- */

NMT_TEST(config_conf_files_load) {
  nmt_config c;
  NMT_ASSERT_OK(nmt_config_load("conf/base.ini", NULL, 0, &c));
  NMT_ASSERT_EQ_INT(c.model_d_model, 512);
  NMT_ASSERT_EQ_INT(c.model_n_heads, 8);
  NMT_ASSERT_EQ_INT(c.model_d_ff, 2048);
  NMT_ASSERT_EQ_INT(c.model_enc_layers, 6);
  NMT_ASSERT_EQ_INT(c.model_dec_layers, 6);
  NMT_ASSERT(c.model_dropout == 0.1f && c.train_label_smoothing == 0.1f);
  NMT_ASSERT(c.train_adam_beta1 == 0.9f && c.train_adam_beta2 == 0.98f);
  NMT_ASSERT(c.train_adam_eps == 1e-9f);
  NMT_ASSERT_EQ_INT(c.train_warmup_steps, 4000);
  NMT_ASSERT_EQ_INT(c.train_max_steps, 100000);
  NMT_ASSERT_EQ_INT(c.parallel_device, NMT_DEVICE_AUTO);
  NMT_ASSERT(!strcmp(c.data_train, "data/bible/train.shard"));
  NMT_ASSERT(!strcmp(c.data_valid, "data/bible/valid.shard"));
  NMT_ASSERT(!strcmp(c.data_spm_model, "data/bible/spm.model"));
  NMT_ASSERT_EQ_INT(c.model_vocab, 8000);
  /* §5.1: ~25000 tokens per step per side */
  long per_step = (long)c.data_max_tokens * c.parallel_devices * c.train_accum_steps;
  NMT_ASSERT(per_step >= 24000 && per_step <= 26000);

  NMT_ASSERT_OK(nmt_config_load("conf/big.ini", NULL, 0, &c));
  NMT_ASSERT_EQ_INT(c.model_d_model, 1024);
  NMT_ASSERT_EQ_INT(c.model_n_heads, 16);
  NMT_ASSERT_EQ_INT(c.model_d_ff, 4096);
  NMT_ASSERT(c.model_dropout == 0.3f);
  NMT_ASSERT_EQ_INT(c.train_max_steps, 300000);
  per_step = (long)c.data_max_tokens * c.parallel_devices * c.train_accum_steps;
  NMT_ASSERT(per_step >= 24000 && per_step <= 26000);

  NMT_ASSERT_OK(nmt_config_load("conf/bible-small.ini", NULL, 0, &c));
  NMT_ASSERT_EQ_INT(c.parallel_device, NMT_DEVICE_CPU);
  NMT_ASSERT_EQ_INT(c.parallel_devices, 2);
  NMT_ASSERT_EQ_INT(c.model_d_model, 256);
  NMT_ASSERT_EQ_INT(c.model_n_heads, 4);
  NMT_ASSERT_EQ_INT(c.model_enc_layers, 3);
  NMT_ASSERT_EQ_INT(c.decode_beam, 4);
  NMT_ASSERT_EQ_INT(c.model_norm, NMT_NORM_PRE);
  NMT_ASSERT(!strcmp(c.run_out_dir, "runs/bible-small"));
  NMT_ASSERT(!strcmp(c.data_train, "data/bible/train.shard"));
}

/* ---- dump round trip ---- */

static nmt_status dump_to(const char *path, const nmt_config *c) {
  FILE *f = fopen(path, "w");
  if (!f) return NMT_ERR_IO;
  nmt_status st = nmt_config_dump(c, f);
  if (fclose(f) != 0 && st == NMT_OK) st = NMT_ERR_IO;
  return st;
}

NMT_TEST(config_dump_roundtrip) {
  char path[512];
  snprintf(path, sizeof path, "%s/dump.ini", nmt_test_tmpdir());
  /* Every field away from its default, with floats that need all 9 digits and strings with
   * the characters an unquoted INI value would lose (; and #). */
  nmt_config c, back;
  nmt_config_defaults(&c);
  snprintf(c.run_out_dir, sizeof c.run_out_dir, "runs/x;y #z");
  c.run_seed = 18446744073709551615ull;
  c.run_resume = 1;
  snprintf(c.data_train, sizeof c.data_train, "/a b/train.shard");
  snprintf(c.data_valid, sizeof c.data_valid, "v.shard");
  snprintf(c.data_spm_model, sizeof c.data_spm_model, "m=1.model");
  c.data_max_tokens = 12345;
  c.data_max_len = 99;
  c.data_loader_threads = 3;
  c.model_vocab = 32000;
  c.model_d_model = 96;
  c.model_n_heads = 3;
  c.model_d_ff = 333;
  c.model_enc_layers = 2;
  c.model_dec_layers = 5;
  c.model_max_positions = 777;
  c.model_dropout = 0.123456789f;
  c.model_attn_dropout = 1.0f / 3.0f;
  c.model_relu_dropout = 0.999999f;
  c.model_norm = NMT_NORM_PRE;
  c.model_init_std = 0.02f;
  c.train_max_steps = 123456789012L;
  c.train_log_every = 7;
  c.train_valid_every = 0;
  c.train_save_every = 0;
  c.train_accum_steps = 16;
  c.train_label_smoothing = 0.0f;
  c.train_lr_scale = 3.14159274f;
  c.train_warmup_steps = 1;
  c.train_adam_beta1 = 0.8999999f;
  c.train_adam_beta2 = 0.999f;
  c.train_adam_eps = 1.17549435e-38f; /* FLT_MIN */
  c.train_weight_decay = 0.01f;
  c.train_clip_norm = 1.5e6f;
  c.parallel_device = NMT_DEVICE_CUDA;
  c.parallel_devices = 8;
  c.parallel_bucket_mb = 0.1f;
  c.decode_beam = 12;
  c.decode_max_extra_len = 0;
  c.decode_batch_sentences = 5;
  c.checkpoint_keep = 0;
  NMT_ASSERT_OK(dump_to(path, &c));
  NMT_ASSERT_OK(nmt_config_load(path, NULL, 0, &back));
  ASSERT_CONFIG_EQUAL(&back, &c);

  /* and the committed files: load -> dump -> load */
  const char *files[] = {"conf/base.ini", "conf/big.ini", "conf/bible-small.ini"};
  for (int i = 0; i < 3; i++) {
    NMT_ASSERT_OK(nmt_config_load(files[i], NULL, 0, &c));
    NMT_ASSERT_OK(dump_to(path, &c));
    NMT_ASSERT_OK(nmt_config_load(path, NULL, 0, &back));
    ASSERT_CONFIG_EQUAL(&back, &c);
  }
}

/* The dump has every key once, under its section, each preceded by a ; comment. */
NMT_TEST(config_dump_format) {
  char path[512];
  snprintf(path, sizeof path, "%s/dump.ini", nmt_test_tmpdir());
  nmt_config c;
  nmt_config_defaults(&c);
  NMT_ASSERT_OK(dump_to(path, &c));
  char *text = nmt_th_read_file(path, NULL);
  NMT_ASSERT(text);
  int keys = 0, bad = 0;
  char prev[4096] = "";
  for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
    if (strchr(line, '=') && line[0] != ';') {
      keys++;
      if (prev[0] != ';') bad++;
    }
    snprintf(prev, sizeof prev, "%s", line);
  }
  free(text);
  NMT_ASSERT_EQ_INT(bad, 0);
  NMT_ASSERT_EQ_INT(keys, 75); /* the fields of nmt_config */
}

/* ---- malformed files ---- */

typedef struct {
  const char *section, *key, *value; /* written as `key = value` under [section] */
  const char *why;                   /* expected in the message */
} bad_case;

static const bad_case bad_cases[] = {
    {"train", "max_steps", "abc", "not an integer"},
    {"train", "max_steps", "1e", "not an integer"},
    {"train", "max_steps", "1e3", "not an integer"},
    {"train", "max_steps", "12x", "not an integer"},
    {"train", "max_steps", "042", "leading zero"},
    {"train", "max_steps", "", "not an integer"},
    {"train", "max_steps", "-", "not an integer"},
    {"train", "max_steps", "0", "must be in [1, "},
    {"train", "max_steps", "-5", "must be in [1, "},
    {"train", "max_steps", "99999999999999999999", "must be in [1, "},
    {"train", "log_every", "0", "must be in [1, 1000000000]"},
    {"train", "log_every", "3000000000", "must be in [1, 1000000000]"},
    {"train", "log_every", "1.5", "not an integer"},
    {"model", "dropout", "nan", "not a number"},
    {"model", "dropout", "inf", "not a number"},
    {"model", "dropout", "0x1p3", "not a number"},
    {"model", "dropout", "1e", "not a number"},
    {"model", "dropout", "0.1x", "not a number"},
    {"model", "dropout", "", "not a number"},
    {"model", "dropout", "1.0", "must be in [0, 1)"},
    {"model", "dropout", "0.99999999999", "must be in [0, 1)"},
    {"model", "dropout", "-0.1", "must be in [0, 1)"},
    {"model", "dropout", "1e400", "must be in [0, 1)"},
    {"train", "adam_eps", "0", "must be in (0, 1]"},
    {"run", "seed", "-1", "must be in [0, 18446744073709551615]"},
    {"run", "seed", "18446744073709551616", "must be in [0, 18446744073709551615]"},
    {"run", "seed", "07", "leading zero"},
    {"model", "d_model", "1000000", "must be in [2, 65536]"},
    {"train", "max_stepz", "100", "unknown key"},
    {"trian", "max_steps", "100", "unknown section"},
    {"parallel", "device", "gpu", "must be one of cpu, cuda, auto"},
    {"model", "norm", "Post", "must be one of post, pre"},
    {"run", "resume", "maybe", "must be one of true, false"},
    {"run", "resume", "TRUE", "must be one of true, false"},
    {"run", "out_dir", "runs/a\"b", "double quote"},
};

NMT_TEST(config_malformed_values) {
  const char *dir = nmt_test_tmpdir();
  int n = (int)(sizeof bad_cases / sizeof bad_cases[0]);
  for (int i = 0; i < n; i++) {
    const bad_case *b = &bad_cases[i];
    char path[512], text[512], quoted[128];
    snprintf(path, sizeof path, "%s/bad%02d.ini", dir, i);
    snprintf(text, sizeof text, "; case %d\n[%s]\n%s = %s\n", i, b->section, b->key, b->value);
    NMT_ASSERT(write_file(path, text));
    nmt_config c;
    nmt_config_defaults(&c);
    c.model_vocab = 4242; /* must survive a failed load */
    nmt_clear_error();
    nmt_status st = nmt_config_load(path, NULL, 0, &c);
    if (st != NMT_ERR_CONFIG) {
      nmt_test_fail(__FILE__, __LINE__, "case %d [%s] %s = %s: got %s, want NMT_ERR_CONFIG", i,
                    b->section, b->key, b->value, nmt_status_str(st));
      return;
    }
    const char *msg = nmt_last_error();
    snprintf(quoted, sizeof quoted, "= \"%s\"", b->value);
    const char *need[] = {path, b->section, b->key, quoted, b->why};
    for (int j = 0; j < 5; j++) {
      if (!strstr(msg, need[j])) {
        nmt_test_fail(__FILE__, __LINE__, "case %d: message \"%s\" lacks \"%s\"", i, msg, need[j]);
        return;
      }
    }
    NMT_ASSERT_EQ_INT(c.model_vocab, 4242);
  }
}

/* The exact message shapes other tools and people grep for. */
NMT_TEST(config_message_format) {
  nmt_config c;
  nmt_config_defaults(&c);
  NMT_ASSERT_EQ_STATUS(nmt_config_set(&c, "train", "max_steps", "12x", "conf/x.ini"),
                       NMT_ERR_CONFIG);
  NMT_ASSERT(!strcmp(nmt_last_error(), "conf/x.ini: [train] max_steps = \"12x\": not an integer"));
  NMT_ASSERT_EQ_STATUS(nmt_config_set(&c, "train", "log_every", "0", "conf/x.ini"),
                       NMT_ERR_CONFIG);
  NMT_ASSERT(!strcmp(nmt_last_error(),
                     "conf/x.ini: [train] log_every = \"0\": must be in [1, 1000000000]"));
}

/* Cross-key constraints and file-level errors: each message names the file and both keys. */
NMT_TEST(config_cross_key_and_file_errors) {
  const char *dir = nmt_test_tmpdir();
  struct {
    const char *text;
    const char *need[4];
  } cases[] = {
      {"[model]\nd_model = 510\nn_heads = 8\n", {"[model] d_model", "510", "[model] n_heads", "8"}},
      {"[model]\nd_model = 515\nn_heads = 5\n", {"[model] d_model", "515", "even", "§3.5"}},
      {"[data]\nmax_tokens = 100\nmax_len = 200\n",
       {"[data] max_tokens", "100", "[data] max_len", "200"}},
      {"[data]\nmax_len = 2000\nmax_tokens = 5000\n",
       {"[model] max_positions", "1024", "[data] max_len", "2000"}},
      {"seed = 3\n[run]\n", {"seed", "\"3\"", "outside any [section]", ""}},
      {"[trian]\n", {"[trian]", "unknown section", "", ""}},
      {"[run]\nseed 3\n", {"line 2", "seed 3", "", ""}},
      {"[parallel]\ngrad_dtype = fp16\n[precision]\nmode = bf16\n",
       {"[parallel] grad_dtype", "fp16", "[precision] mode", "bf16"}},
      {"[parallel]\nqkv = streams\naux_streams = 1\n",
       {"[parallel] qkv", "streams", "[parallel] aux_streams", "\"1\""}},
      /* A GPU listed twice: NCCL refuses it; only the host-staged communicator takes it. */
      {"[parallel]\ndevices = 0,0\n",
       {"[parallel] devices", "\"[0,0]\"", "[parallel] comm = \"host\"", "Duplicate GPU"}},
      {"[parallel]\ndevices = 1,2,1\ncomm = nccl\n",
       {"lists device 1 twice", "(got \"nccl\")", "NCCL refuses", ""}},
      {"[parallel]\ndevice = cpu\ncomm = nccl\n",
       {"[parallel] comm = \"nccl\"", "GPU workers", "[parallel] device = \"cpu\"", ""}},
      /* fused attention serves d_k in {32, 64, 128}: 48 / 2 = 24 is refused */
      {"[kernels]\nattention = fused\n[model]\nd_model = 48\nn_heads = 2\n",
       {"[kernels] attention = \"fused\"", "d_model = \"48\"", "n_heads = \"2\"", "= 24"}},
  };
  for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
    char path[512];
    snprintf(path, sizeof path, "%s/cross%d.ini", dir, i);
    NMT_ASSERT(write_file(path, cases[i].text));
    nmt_config c;
    nmt_status st = nmt_config_load(path, NULL, 0, &c);
    if (st != NMT_ERR_CONFIG) {
      nmt_test_fail(__FILE__, __LINE__, "case %d: got %s, want NMT_ERR_CONFIG", i,
                    nmt_status_str(st));
      return;
    }
    ASSERT_CONTAINS(nmt_last_error(), path);
    for (int j = 0; j < 4; j++) ASSERT_CONTAINS(nmt_last_error(), cases[i].need[j]);
  }

  char missing[512];
  snprintf(missing, sizeof missing, "%s/does-not-exist.ini", dir);
  nmt_config c;
  NMT_ASSERT_EQ_STATUS(nmt_config_load(missing, NULL, 0, &c), NMT_ERR_CONFIG);
  ASSERT_CONTAINS(nmt_last_error(), missing);
  ASSERT_CONTAINS(nmt_last_error(), "No such file");
}

/* Issue 19: a directory given as the config opened fine and read as an empty file, so
 * `config --dump dir.ini` printed the defaults and `train dir.ini` blamed [data] train. */
NMT_TEST(config_directory_is_an_error) {
  char path[512];
  snprintf(path, sizeof path, "%s/dir.ini", nmt_test_tmpdir());
  NMT_ASSERT(mkdir(path, 0755) == 0);
  nmt_config c;
  NMT_ASSERT_EQ_STATUS(nmt_config_load(path, NULL, 0, &c), NMT_ERR_CONFIG);
  ASSERT_CONTAINS(nmt_last_error(), path);
  ASSERT_CONTAINS(nmt_last_error(), "is a directory");
}

/* Issue 19: the range of parallel.devices read "must be in count in [1, 1024]". */
NMT_TEST(config_devices_range_message) {
  nmt_config c;
  nmt_config_defaults(&c);
  NMT_ASSERT_EQ_STATUS(nmt_config_set(&c, "parallel", "devices", "2000", "conf/x.ini"),
                       NMT_ERR_CONFIG);
  NMT_ASSERT(!strcmp(nmt_last_error(),
                     "conf/x.ini: [parallel] devices = \"2000\": must be a count in [1, 1024], or "
                     "a list of up to 64 distinct indices in [0, 1023]"));
  NMT_ASSERT(strstr(nmt_last_error(), "in count") == NULL);
}

/* ---- accepted spellings ---- */

NMT_TEST(config_accepted_values) {
  nmt_config c;
  nmt_config_defaults(&c);
  NMT_ASSERT_OK(nmt_config_set(&c, "train", "valid_every", "0", "t"));
  NMT_ASSERT_EQ_INT(c.train_valid_every, 0);
  NMT_ASSERT_OK(nmt_config_set(&c, "train", "valid_every", "+10", "t"));
  NMT_ASSERT_EQ_INT(c.train_valid_every, 10);
  NMT_ASSERT_OK(nmt_config_set(&c, "train", "max_steps", "\"250\"", "t"));
  NMT_ASSERT_EQ_INT(c.train_max_steps, 250);
  NMT_ASSERT_OK(nmt_config_set(&c, "train", "max_steps", "1000000000000", "t"));
  NMT_ASSERT_EQ_INT(c.train_max_steps, 1000000000000LL);
  NMT_ASSERT_OK(nmt_config_set(&c, "run", "seed", "18446744073709551615", "t"));
  NMT_ASSERT(c.run_seed == 18446744073709551615ull);
  NMT_ASSERT_OK(nmt_config_set(&c, "train", "adam_eps", "1e-9", "t"));
  NMT_ASSERT(c.train_adam_eps == 1e-9f);
  NMT_ASSERT_OK(nmt_config_set(&c, "model", "dropout", ".25", "t"));
  NMT_ASSERT(c.model_dropout == 0.25f);
  NMT_ASSERT_OK(nmt_config_set(&c, "model", "dropout", "0", "t"));
  NMT_ASSERT(c.model_dropout == 0.0f);
  NMT_ASSERT_OK(nmt_config_set(&c, "train", "lr_scale", "2.", "t"));
  NMT_ASSERT(c.train_lr_scale == 2.0f);
  NMT_ASSERT_OK(nmt_config_set(&c, "train", "adam_eps", "1", "t")); /* (0, 1]: hi included */
  const char *yes[] = {"true", "on", "yes", "1"}, *no[] = {"false", "off", "no", "0"};
  for (int i = 0; i < 4; i++) {
    NMT_ASSERT_OK(nmt_config_set(&c, "run", "resume", yes[i], "t"));
    NMT_ASSERT_EQ_INT(c.run_resume, 1);
    NMT_ASSERT_OK(nmt_config_set(&c, "run", "resume", no[i], "t"));
    NMT_ASSERT_EQ_INT(c.run_resume, 0);
  }
  NMT_ASSERT_OK(nmt_config_set(&c, "parallel", "device", "cuda", "t"));
  NMT_ASSERT_EQ_INT(c.parallel_device, NMT_DEVICE_CUDA);
  NMT_ASSERT_OK(nmt_config_set(&c, "model", "norm", "pre", "t"));
  NMT_ASSERT_EQ_INT(c.model_norm, NMT_NORM_PRE);
  NMT_ASSERT_OK(nmt_config_set(&c, "parallel", "grad_dtype", "fp16", "t"));
  NMT_ASSERT_EQ_INT(c.parallel_grad_dtype, NMT_GRAD_FP16);
  NMT_ASSERT_OK(nmt_config_set(&c, "parallel", "grad_dtype", "bf16", "t"));
  NMT_ASSERT_EQ_INT(c.parallel_grad_dtype, NMT_GRAD_BF16);
  NMT_ASSERT_EQ_STATUS(nmt_config_set(&c, "parallel", "grad_dtype", "tf32", "t"),
                       NMT_ERR_CONFIG);
  NMT_ASSERT_OK(nmt_config_set(&c, "parallel", "qkv", "streams", "t"));
  NMT_ASSERT_EQ_INT(c.parallel_qkv, NMT_QKV_STREAMS);
  NMT_ASSERT_OK(nmt_config_set(&c, "train", "checkpoint_activations", "on", "t"));
  NMT_ASSERT_EQ_INT(c.train_checkpoint_activations, 1);
  NMT_ASSERT_OK(nmt_config_set(&c, "data", "valid", "\"\"", "t"));
  NMT_ASSERT(!strcmp(c.data_valid, ""));

  /* strings: 1000 bytes fit, one more does not (the dump line `key = "value"` must fit
   * iniparser's 1024-byte line buffer to load back) */
  enum { SMAX = 1000 };
  char *s = malloc(SMAX + 2);
  NMT_ASSERT(s);
  memset(s, 'a', SMAX);
  s[SMAX] = 0;
  nmt_status st1 = nmt_config_set(&c, "data", "train", s, "t");
  size_t len1 = strlen(c.data_train);
  s[SMAX] = 'a';
  s[SMAX + 1] = 0;
  nmt_status st2 = nmt_config_set(&c, "data", "train", s, "t");
  free(s);
  NMT_ASSERT_OK(st1);
  NMT_ASSERT_EQ_INT(len1, SMAX);
  NMT_ASSERT_EQ_STATUS(st2, NMT_ERR_CONFIG);
  NMT_ASSERT_EQ_INT(strlen(c.data_train), SMAX); /* unchanged by the failure */
  /* and the longest value round-trips through the dump of the whole config */
  char dump_path[600];
  snprintf(dump_path, sizeof dump_path, "%s/long.ini", nmt_test_tmpdir());
  FILE *df = fopen(dump_path, "w");
  NMT_ASSERT(df != NULL);
  nmt_config_dump(&c, df);
  fclose(df);
  nmt_config back;
  NMT_ASSERT_OK(nmt_config_load(dump_path, NULL, 0, &back));
  NMT_ASSERT(!strcmp(back.data_train, c.data_train));
}

/* Files are case-insensitive in sections and keys (iniparser lowercases them), values are not,
 * and quotes around values are removed. */
NMT_TEST(config_file_syntax) {
  char path[512];
  snprintf(path, sizeof path, "%s/syntax.ini", nmt_test_tmpdir());
  NMT_ASSERT(write_file(path, "# comment\n[Train]\nMax_Steps = 77 ; trailing comment\n"
                              "[run]\nout_dir = \"Runs/A;B\"\nresume = yes\n"
                              "[parallel]\ndevice = \"cpu\"\n"));
  nmt_config c;
  NMT_ASSERT_OK(nmt_config_load(path, NULL, 0, &c));
  NMT_ASSERT_EQ_INT(c.train_max_steps, 77);
  NMT_ASSERT(!strcmp(c.run_out_dir, "Runs/A;B"));
  NMT_ASSERT_EQ_INT(c.run_resume, 1);
  NMT_ASSERT_EQ_INT(c.parallel_device, NMT_DEVICE_CPU);
}

/* ---- overrides ---- */

NMT_TEST(config_overrides) {
  char path[512];
  snprintf(path, sizeof path, "%s/ov.ini", nmt_test_tmpdir());
  NMT_ASSERT(write_file(path, "[train]\nmax_steps = 500\nlog_every = 5\n"));
  nmt_config c;

  /* the file beats the default, an override beats the file, a later override an earlier one */
  const char *ov1[] = {"train.max_steps=7", "model.dropout=0.3", "train.max_steps=9"};
  NMT_ASSERT_OK(nmt_config_load(path, ov1, 3, &c));
  NMT_ASSERT_EQ_INT(c.train_max_steps, 9);
  NMT_ASSERT_EQ_INT(c.train_log_every, 5);
  NMT_ASSERT(c.model_dropout == 0.3f);
  NMT_ASSERT_EQ_INT(c.model_d_model, 512);

  const char *ov2[] = {"run.out_dir=runs/a=b"}; /* value may contain '=' */
  NMT_ASSERT_OK(nmt_config_load(path, ov2, 1, &c));
  NMT_ASSERT(!strcmp(c.run_out_dir, "runs/a=b"));

  /* same checks as a file value, origin "command line" */
  const char *ov3[] = {"train.max_steps=12x"};
  NMT_ASSERT_EQ_STATUS(nmt_config_load(path, ov3, 1, &c), NMT_ERR_CONFIG);
  NMT_ASSERT(!strcmp(nmt_last_error(),
                     "command line: [train] max_steps = \"12x\": not an integer"));
  const char *ov4[] = {"train.nope=1"};
  NMT_ASSERT_EQ_STATUS(nmt_config_load(path, ov4, 1, &c), NMT_ERR_CONFIG);
  ASSERT_CONTAINS(nmt_last_error(), "unknown key");
  ASSERT_CONTAINS(nmt_last_error(), "command line");

  /* cross-key validation runs after the overrides */
  const char *ov5[] = {"model.n_heads=7"};
  NMT_ASSERT_EQ_STATUS(nmt_config_load(path, ov5, 1, &c), NMT_ERR_CONFIG);
  ASSERT_CONTAINS(nmt_last_error(), "n_heads");
  ASSERT_CONTAINS(nmt_last_error(), path);

  const char *malformed[] = {"train.max_steps", "max_steps=5", ".max_steps=5", "train.=5", "=5",
                             ""};
  for (int i = 0; i < (int)(sizeof malformed / sizeof malformed[0]); i++) {
    c.model_vocab = 4242;
    NMT_ASSERT_EQ_STATUS(nmt_config_load(path, &malformed[i], 1, &c), NMT_ERR_CONFIG);
    char quoted[64];
    snprintf(quoted, sizeof quoted, "\"%s\"", malformed[i]);
    ASSERT_CONTAINS(nmt_last_error(), quoted);
    ASSERT_CONTAINS(nmt_last_error(), "section.key=value");
    NMT_ASSERT_EQ_INT(c.model_vocab, 4242);
  }
}

/* Several files (nmt_config_load_files; `nmt train conf/x.ini data/y/data.ini`): applied in
 * order, a later file's value replacing an earlier one's and the overrides last; only the
 * value that takes effect is parsed; each error names the file that holds the value, a
 * cross-key error every source. */
NMT_TEST(config_files_layered) {
  const char *dir = nmt_test_tmpdir();
  char a[512], b[512], bad2[512], missing[512];
  snprintf(a, sizeof a, "%s/a.ini", dir);
  snprintf(b, sizeof b, "%s/b.ini", dir);
  snprintf(bad2, sizeof bad2, "%s/bad2.ini", dir);
  snprintf(missing, sizeof missing, "%s/missing.ini", dir);
  NMT_ASSERT(write_file(a, "[train]\nmax_steps = 500\nlog_every = 5\n[data]\nmax_len = 12x\n"
                           "[model]\nd_model = 510\n"));
  NMT_ASSERT(write_file(b, "[train]\nmax_steps = 600\n[data]\nmax_len = 64\n[model]\n"
                           "d_model = 256\n"));
  NMT_ASSERT(write_file(bad2, "[train]\nwarmup_steps = 10\nlog_every = 0\n"));
  nmt_config c;
  const char *ab[] = {a, b};
  NMT_ASSERT_OK(nmt_config_load_files(ab, 2, NULL, 0, &c));
  NMT_ASSERT_EQ_INT(c.train_max_steps, 600); /* the later file wins */
  NMT_ASSERT_EQ_INT(c.train_log_every, 5);   /* a key only the first sets stays */
  NMT_ASSERT_EQ_INT(c.data_max_len, 64);     /* a's bad value is replaced, so no error */
  NMT_ASSERT_EQ_INT(c.model_d_model, 256);
  NMT_ASSERT_EQ_INT(c.model_n_heads, 8); /* the default where neither sets it */
  /* The command line beats both; a bad override a later one replaces is no error either. */
  const char *ov[] = {"train.max_steps=7", "train.log_every=0", "train.log_every=3"};
  NMT_ASSERT_OK(nmt_config_load_files(ab, 2, ov, 3, &c));
  NMT_ASSERT_EQ_INT(c.train_max_steps, 7);
  NMT_ASSERT_EQ_INT(c.train_log_every, 3);
  /* In the other order a's bad value takes effect: the error names a, not b. */
  const char *ba[] = {b, a};
  NMT_ASSERT_EQ_STATUS(nmt_config_load_files(ba, 2, NULL, 0, &c), NMT_ERR_CONFIG);
  char want[1200];
  snprintf(want, sizeof want, "%s: [data] max_len = \"12x\": not an integer", a);
  NMT_ASSERT(!strcmp(nmt_last_error(), want));
  /* An error in the second file names the second file. */
  const char *a_bad2[] = {a, bad2};
  const char *fix[] = {"data.max_len=64"};
  NMT_ASSERT_EQ_STATUS(nmt_config_load_files(a_bad2, 2, fix, 1, &c), NMT_ERR_CONFIG);
  snprintf(want, sizeof want, "%s: [train] log_every = \"0\": must be in [1, 1000000000]", bad2);
  NMT_ASSERT(!strcmp(nmt_last_error(), want));
  /* A cross-key error names every source, in order. */
  const char *heads[] = {"model.n_heads=7"};
  NMT_ASSERT_EQ_STATUS(nmt_config_load_files(ab, 2, heads, 1, &c), NMT_ERR_CONFIG);
  snprintf(want, sizeof want, "%s + %s + command line: [model] d_model = \"256\"", a, b);
  ASSERT_CONTAINS(nmt_last_error(), want);
  /* An unknown key is an error even where a later file sets the key's section. */
  NMT_ASSERT(write_file(bad2, "[train]\nmax_stepz = 3\n"));
  const char *bad2_b[] = {bad2, b};
  NMT_ASSERT_EQ_STATUS(nmt_config_load_files(bad2_b, 2, NULL, 0, &c), NMT_ERR_CONFIG);
  ASSERT_CONTAINS(nmt_last_error(), bad2);
  ASSERT_CONTAINS(nmt_last_error(), "unknown key");
  /* A missing file is named, before any value is taken; *cfg is left as it was. */
  const char *b_missing[] = {b, missing};
  c.model_vocab = 4242;
  NMT_ASSERT_EQ_STATUS(nmt_config_load_files(b_missing, 2, NULL, 0, &c), NMT_ERR_CONFIG);
  snprintf(want, sizeof want, "%s: cannot open config: No such file", missing);
  ASSERT_CONTAINS(nmt_last_error(), want);
  NMT_ASSERT_EQ_INT(c.model_vocab, 4242);
  /* No file: the defaults and the overrides; misuse is a usage error. */
  NMT_ASSERT_OK(nmt_config_load_files(NULL, 0, ov, 1, &c));
  NMT_ASSERT_EQ_INT(c.train_max_steps, 7);
  NMT_ASSERT_EQ_INT(c.model_d_model, 512);
  const char *null_path[] = {b, NULL};
  NMT_ASSERT_EQ_STATUS(nmt_config_load_files(null_path, 2, NULL, 0, &c), NMT_ERR_USAGE);
  NMT_ASSERT_EQ_STATUS(nmt_config_load_files(NULL, 1, NULL, 0, &c), NMT_ERR_USAGE);
}

/* A message about a long value (or from a long-named origin) keeps its reason: the value and
 * the origin are cut in the middle, not the message at its end. */
NMT_TEST(config_long_value_keeps_reason) {
  nmt_config c;
  nmt_config_defaults(&c);
  char value[1100], origin[1000];
  memset(value, '9', sizeof value - 1);
  value[sizeof value - 1] = 0;
  memset(origin, 'o', sizeof origin - 1);
  origin[sizeof origin - 1] = 0;
  NMT_ASSERT_EQ_STATUS(nmt_config_set(&c, "train", "max_steps", value, "command line"),
                       NMT_ERR_CONFIG);
  ASSERT_CONTAINS(nmt_last_error(), "command line: [train] max_steps = \"9999");
  ASSERT_CONTAINS(nmt_last_error(), "...");
  ASSERT_CONTAINS(nmt_last_error(), "9999\": must be in [1, ");
  NMT_ASSERT_EQ_STATUS(nmt_config_set(&c, "train", "max_steps", value, origin), NMT_ERR_CONFIG);
  ASSERT_CONTAINS(nmt_last_error(), "must be in [1, ");
  ASSERT_CONTAINS(nmt_last_error(), "oooo: [train] max_steps");
  value[1020] = 0;
  NMT_ASSERT_EQ_STATUS(nmt_config_set(&c, "train", "nope", value, "command line"),
                       NMT_ERR_CONFIG);
  ASSERT_CONTAINS(nmt_last_error(), "unknown key (keys of [train]: ");
}

/* ---- help and docs ---- */

/* Every key of the dump appears in the markdown and plain help with its section. */
NMT_TEST(config_help_lists_every_key) {
  const char *dir = nmt_test_tmpdir();
  char dump_path[512], md_path[512], txt_path[512];
  snprintf(dump_path, sizeof dump_path, "%s/dump.ini", dir);
  snprintf(md_path, sizeof md_path, "%s/help.md", dir);
  snprintf(txt_path, sizeof txt_path, "%s/help.txt", dir);
  nmt_config c;
  nmt_config_defaults(&c);
  NMT_ASSERT_OK(dump_to(dump_path, &c));
  FILE *f = fopen(md_path, "w");
  NMT_ASSERT(f);
  nmt_config_help(f, 1);
  fclose(f);
  f = fopen(txt_path, "w");
  NMT_ASSERT(f);
  nmt_config_help(f, 0);
  fclose(f);
  char *dump = nmt_th_read_file(dump_path, NULL), *md = nmt_th_read_file(md_path, NULL),
       *txt = nmt_th_read_file(txt_path, NULL);
  NMT_ASSERT(dump && md && txt);
  char section[64] = "", missing[256] = "";
  int keys = 0;
  for (char *line = strtok(dump, "\n"); line; line = strtok(NULL, "\n")) {
    char key[64];
    if (line[0] == '[') {
      snprintf(section, sizeof section, "%.*s", (int)strcspn(line + 1, "]"), line + 1);
      continue;
    }
    if (line[0] == ';' || sscanf(line, "%63s =", key) != 1) continue;
    keys++;
    char row[160], entry[160], head[80];
    snprintf(row, sizeof row, "| %s | %s |", section, key);
    snprintf(head, sizeof head, "[%s]", section);
    snprintf(entry, sizeof entry, "\n  %s  (", key);
    if (!strstr(md, row) || !strstr(txt, head) || !strstr(txt, entry))
      snprintf(missing, sizeof missing, "%s.%s", section, key);
  }
  free(dump);
  free(md);
  free(txt);
  NMT_ASSERT_EQ_INT(keys, 75);
  if (missing[0]) {
    nmt_test_fail(__FILE__, __LINE__, "help lacks %s", missing);
    return;
  }
}

/* docs/config.md is what nmt_config_help(markdown) prints, so it cannot drift from the
 * schema. On failure the fresh text is left in the kept tmpdir for copying over. */
NMT_TEST(config_docs_up_to_date) {
  char path[512];
  snprintf(path, sizeof path, "%s/config.md", nmt_test_tmpdir());
  FILE *f = fopen(path, "w");
  NMT_ASSERT(f);
  nmt_config_help(f, 1);
  NMT_ASSERT(fclose(f) == 0);
  size_t want_len = 0, have_len = 0;
  char *want = nmt_th_read_file(path, &want_len);
  char *have = nmt_th_read_file("docs/config.md", &have_len);
  int same = want && have && want_len == have_len && !memcmp(want, have, want_len);
  free(want);
  free(have);
  if (!same) {
    nmt_test_fail(__FILE__, __LINE__,
                  "docs/config.md is missing or stale; regenerate: cp %s docs/config.md", path);
    return;
  }
}

/* parallel.devices: a count or a list of device indices; the dump reads back the same. */
NMT_TEST(config_devices_count_or_list) {
  nmt_config c;
  nmt_config_defaults(&c);
  NMT_ASSERT_OK(nmt_config_set(&c, "parallel", "devices", "4", "t"));
  NMT_ASSERT_EQ_INT(c.parallel_devices, 4);
  NMT_ASSERT_EQ_INT(c.parallel_device_ids_n, 0);
  NMT_ASSERT_OK(nmt_config_set(&c, "parallel", "devices", "0, 2,5", "t"));
  NMT_ASSERT_EQ_INT(c.parallel_devices, 3);
  NMT_ASSERT_EQ_INT(c.parallel_device_ids_n, 3);
  NMT_ASSERT(c.parallel_device_ids[0] == 0 && c.parallel_device_ids[1] == 2 &&
             c.parallel_device_ids[2] == 5);
  NMT_ASSERT_OK(nmt_config_set(&c, "parallel", "devices", "[3]", "t"));
  NMT_ASSERT_EQ_INT(c.parallel_devices, 1);
  NMT_ASSERT_EQ_INT(c.parallel_device_ids[0], 3);
  /* round trip through the dump */
  char path[512];
  snprintf(path, sizeof path, "%s/dev.ini", nmt_test_tmpdir());
  FILE *f = fopen(path, "w");
  NMT_ASSERT(f);
  NMT_ASSERT_OK(nmt_config_dump(&c, f));
  fclose(f);
  nmt_config d;
  NMT_ASSERT_OK(nmt_config_load(path, NULL, 0, &d));
  NMT_ASSERT_EQ_INT(d.parallel_devices, 1);
  NMT_ASSERT_EQ_INT(d.parallel_device_ids_n, 1);
  NMT_ASSERT_EQ_INT(d.parallel_device_ids[0], 3);
  const char *bad[][2] = {{"0,x", "indices"}, {"[]", "empty"},
                          {"[0", "\"]\""},     {"0", "must be a count in"}, {"1,2,", "indices"},
                          {"[1] x", "after"}, {"1024,1", "indices"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    nmt_config e;
    nmt_config_defaults(&e);
    NMT_ASSERT_EQ_STATUS(nmt_config_set(&e, "parallel", "devices", bad[i][0], "t"), NMT_ERR_CONFIG);
    if (!strstr(nmt_last_error(), bad[i][1])) printf("# %s: %s\n", bad[i][0], nmt_last_error());
    NMT_ASSERT(strstr(nmt_last_error(), bad[i][1]) != NULL);
    NMT_ASSERT(strstr(nmt_last_error(), "[parallel] devices") != NULL);
  }
  /* A repeated index parses (validation decides, with parallel.comm: cross-key errors above)
   * and, with comm = host, loads: two workers on GPU 0. */
  nmt_config e;
  nmt_config_defaults(&e);
  NMT_ASSERT_OK(nmt_config_set(&e, "parallel", "devices", "0,0", "t"));
  NMT_ASSERT_EQ_INT(e.parallel_devices, 2);
  snprintf(path, sizeof path, "%s/dup.ini", nmt_test_tmpdir());
  f = fopen(path, "w");
  NMT_ASSERT(f);
  fputs("[parallel]\ndevices = 0,0\ncomm = host\n", f);
  fclose(f);
  NMT_ASSERT_OK(nmt_config_load(path, NULL, 0, &d));
  NMT_ASSERT_EQ_INT(d.parallel_devices, 2);
  NMT_ASSERT_EQ_INT(d.parallel_device_ids[1], 0);
  NMT_ASSERT_EQ_INT(d.parallel_comm, NMT_COMM_HOST);
}

/* Wrapping the previous message, nmt_errorf(s, "...: %s", nmt_last_error()), as the engine
 * does to add context, keeps both parts (vsnprintf must not read the buffer it writes). */
NMT_TEST(status_errorf_wraps_last_error) {
  (void)nmt_errorf(NMT_ERR_DATA, "inner %d", 42);
  nmt_status s = nmt_errorf(NMT_ERR_CONFIG, "outer: %s; advice", nmt_last_error());
  NMT_ASSERT_EQ_STATUS(s, NMT_ERR_CONFIG);
  NMT_ASSERT(strcmp(nmt_last_error(), "outer: inner 42; advice") == 0);
}
