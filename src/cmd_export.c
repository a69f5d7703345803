/* cmd_export.c — `nmt export`: a checkpoint's weights as safetensors or as a CTranslate2 model. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "nmt/checkpoint.h"
#include "nmt/export.h"
#include "nmt/paths.h"
#include "nmt/status.h"

#define EXPORT_USAGE                                                                         \
  "export: expected CKPT OUT [CONFIG] [section.key=value ...] [--format safetensors|ctranslate2] " \
  "[--quantization Q] [--overwrite]"

typedef struct {
  int ct2, overwrite;
  const char *quantization;
} export_flags;

/* Takes argv[*i] if it is one of export's own flags; 1 taken, 0 not one, -1 usage error (the
 * exit code in *rc). */
static int take_flag(int argc, char **argv, int *i, export_flags *f, int *rc) {
  const char *x = argv[*i];
  if (!strcmp(x, "--overwrite")) return f->overwrite = 1, 1;
  if (strcmp(x, "--format") && strcmp(x, "--quantization")) return 0;
  if (*i + 1 >= argc) {
    char msg[128];
    snprintf(msg, sizeof msg, "export: %s needs a value", x);
    return *rc = cli_usage_error(msg), -1;
  }
  const char *v = argv[++*i];
  if (!strcmp(x, "--quantization")) return f->quantization = v, 1;
  if (!strcmp(v, "safetensors") || !strcmp(v, "ctranslate2")) return f->ct2 = v[0] == 'c', 1;
  char msg[512];
  snprintf(msg, sizeof msg, "export: unknown --format \"%s\" (safetensors or ctranslate2)", v);
  return *rc = cli_usage_error(msg), -1;
}

int cli_cmd_export(int argc, char **argv) {
  if (argc < 2 || argv[0][0] == '-' || argv[1][0] == '-') return cli_usage_error(EXPORT_USAGE);
  ckpt_args a = {.ckpt = argv[0]};
  export_flags f = {0};
  for (int i = 2; i < argc; i++) {
    int rc = 0, flag = take_flag(argc, argv, &i, &f, &rc);
    if (flag < 0) return rc;
    if (flag) continue;
    int took = cli_take_ckpt_arg("export", argc, argv, &i, &a);
    if (took < 0) return nmt_status_exit_code(NMT_ERR_USAGE);
    if (!took) return cli_unexpected_arg("export", argv[i]);
  }
  if (f.quantization && !f.ct2)
    return cli_usage_error("export: --quantization applies to --format ctranslate2 only");
  if (f.overwrite && !f.ct2)
    return cli_usage_error("export: --overwrite applies to --format ctranslate2 only (a "
                           "safetensors OUT is replaced as it is)");
  /* Without CONFIG or overrides the library takes the checkpoint's own config. */
  nmt_ckpt_setup setup = {0};
  nmt_status s = NMT_OK;
  int have_cfg = a.c.n_configs || a.c.n_overrides;
  nmt_path_arg in[1 + MAX_CONFIGS] = {{"CKPT", argv[0]}}, out = {"OUT", argv[1]};
  s = nmt_path_check_outputs("export", &out, 1, in, cli_config_inputs(&a, in, 1));
  if (s != NMT_OK) return cli_fail(s);
  if (have_cfg)
    s = nmt_ckpt_setup_load(a.ckpt, a.c.configs, a.c.n_configs, a.c.overrides, a.c.n_overrides,
                            &setup);
  const nmt_config *cfg = have_cfg ? &setup.cfg : NULL;
  if (s == NMT_OK)
    s = f.ct2 ? nmt_export_ct2(argv[0], cfg, f.quantization, f.overwrite, argv[1])
              : nmt_export_safetensors(argv[0], cfg, argv[1]);
  nmt_ckpt_setup_free(&setup);
  return s == NMT_OK ? 0 : cli_fail(s);
}
