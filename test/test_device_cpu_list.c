/* test/test_device_cpu_list.c — parallel.device = auto falling back to CPU workers refuses a
 * parallel.devices list of GPU indices (src/device.c, nmt_device_select), as parallel.device =
 * cpu does at load (test_cli_errors.c, cli_errors_gpu_list_on_cpu).
 *
 * Issue 38: "parallel.devices = 0,2" without the GPUs ran 2 CPU workers, exit 0. */
#include <stdio.h>
#include <string.h>

#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/device.h"
#include "test.h"

NMT_TEST(device_auto_gpu_list_without_gpus_is_config_error) {
  const nmt_backend *cuda = nmt_backend_cuda_get();
  int visible = 0;
  if (cuda && cuda->device_count(&visible) != NMT_OK) visible = 0;
  if (visible >= 3) NMT_SKIP("3 CUDA devices visible: the list 0,2 is served");
  nmt_config c;
  nmt_config_defaults(&c);
  c.parallel_device = NMT_DEVICE_AUTO;
  c.parallel_devices = 2;
  c.parallel_device_ids_n = 2;
  c.parallel_device_ids[0] = 0;
  c.parallel_device_ids[1] = 2;
  const nmt_backend *be = NULL;
  for (int use = 0; use < 2; use++) {
    NMT_ASSERT_EQ_STATUS(nmt_device_select(&c, 2, use ? NMT_DEVICE_INFER : NMT_DEVICE_TRAIN, &be),
                         NMT_ERR_CONFIG);
    const char *msg = nmt_last_error();
    printf("# %s\n", msg);
    NMT_ASSERT(strstr(msg, "[parallel] devices") && strstr(msg, "0,2") &&
               strstr(msg, "devices = 2"));
  }
  /* A count still falls back to CPU workers. */
  c.parallel_device_ids_n = 0;
  NMT_ASSERT_OK(nmt_device_select(&c, 2, NMT_DEVICE_TRAIN, &be));
  NMT_ASSERT(be->is_host);
}
