/* cmd_export.c — `nmt export`: a checkpoint's weights as safetensors. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "nmt/checkpoint.h"
#include "nmt/export.h"
#include "nmt/paths.h"
#include "nmt/status.h"

int cli_cmd_export(int argc, char **argv) {
  if (argc < 2 || argv[0][0] == '-' || argv[1][0] == '-')
    return cli_usage_error("export: expected CKPT OUT.safetensors [CONFIG] [section.key=value ...]");
  ckpt_args a = {.ckpt = argv[0]};
  for (int i = 2; i < argc; i++) {
    int took = cli_take_ckpt_arg("export", argc, argv, &i, &a);
    if (took < 0) return nmt_status_exit_code(NMT_ERR_USAGE);
    if (!took) {
      char msg[256];
      snprintf(msg, sizeof msg, "export: unexpected argument \"%s\"", argv[i]);
      return cli_usage_error(msg);
    }
  }
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
  if (s == NMT_OK) s = nmt_export_safetensors(argv[0], have_cfg ? &setup.cfg : NULL, argv[1]);
  nmt_ckpt_setup_free(&setup);
  return s == NMT_OK ? 0 : cli_fail(s);
}
