/* test/test_ckpt_finite.c — a checkpoint whose parameters hold NaN or infinity is refused at
 * load (src/engine/checkpoint.c), naming the tensor and the element.
 *
 * Issue 38: such a checkpoint translated to empty lines and evaluated to "loss nan", exit 0.
 * The check rides on the read's own pass over the bytes (no second pass over the weights). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nmt/checkpoint.h"
#include "nmt/model.h"
#include "test.h"

static nmt_model_cfg tiny_cfg(void) {
  return (nmt_model_cfg){.vocab = 29, .d_model = 16, .n_heads = 2, .d_ff = 24, .enc_layers = 1,
                         .dec_layers = 1, .max_positions = 40, .norm = NMT_NORM_PRE,
                         .ln_eps = 1e-5f};
}

static nmt_ckpt_header header_of(const nmt_model_cfg *c) {
  nmt_ckpt_header h = {0};
  h.vocab = c->vocab, h.d_model = c->d_model, h.n_heads = c->n_heads, h.d_ff = c->d_ff;
  h.enc_layers = c->enc_layers, h.dec_layers = c->dec_layers, h.norm = (int32_t)c->norm;
  h.n_params = nmt_model_num_params(c);
  h.step = 3;
  return h;
}

/* The offset of tensor `name` in the layout, or (size_t)-1. */
static size_t offset_of(const nmt_model_cfg *c, const char *name) {
  const int nt = nmt_model_param_table(c, NULL);
  nmt_param_info *tab = malloc((size_t)nt * sizeof *tab);
  size_t off = (size_t)-1;
  if (!tab) return off;
  nmt_model_param_table(c, tab);
  for (int i = 0; i < nt; i++)
    if (!strcmp(tab[i].name, name)) off = tab[i].offset;
  free(tab);
  return off;
}

/* Writes the tiny model with params[tensor + elem] = bad (and the moments when asked), reads
 * it back; returns the read's status, its message in msg. */
static nmt_status poisoned_read(const char *tensor, size_t elem, float bad, int moments,
                                int verify_only, char *msg, size_t cap) {
  const nmt_model_cfg c = tiny_cfg();
  nmt_ckpt_header h = header_of(&c), got;
  h.has_moments = (uint32_t)moments;
  const size_t n = h.n_params, off = offset_of(&c, tensor);
  float *p = malloc(n * sizeof *p), *m = calloc(n, sizeof *m), *v = calloc(n, sizeof *v);
  char path[1024];
  snprintf(path, sizeof path, "%s/poisoned.ckpt", nmt_test_tmpdir());
  nmt_status st = p && m && v && off != (size_t)-1 ? NMT_OK : NMT_ERR_NOMEM;
  if (st == NMT_OK) {
    nmt_model_init_params(&c, 1, p);
    p[off + elem] = bad;
    st = nmt_ckpt_write(path, &h, p, moments ? m : NULL, moments ? v : NULL);
  }
  if (st == NMT_OK)
    st = verify_only ? nmt_ckpt_read(path, NULL, &got, NULL, NULL, NULL)
                     : nmt_ckpt_read(path, &h, &got, p, moments ? m : NULL, moments ? v : NULL);
  snprintf(msg, cap, "%s", st == NMT_OK ? "" : nmt_last_error());
  free(p), free(m), free(v);
  return st;
}

NMT_TEST(ckpt_refuses_nan_parameter) {
  char msg[1024];
  NMT_ASSERT_EQ_STATUS(poisoned_read("decoder.layers.0.ffn.fc1.bias", 5, NAN, 1, 0, msg,
                                     sizeof msg),
                       NMT_ERR_CHECKPOINT);
  printf("# %s\n", msg);
  NMT_ASSERT(strstr(msg, "poisoned.ckpt") != NULL);
  NMT_ASSERT(strstr(msg, "decoder.layers.0.ffn.fc1.bias[5]") != NULL);
  NMT_ASSERT(strstr(msg, "nan") != NULL);
}

NMT_TEST(ckpt_refuses_inf_parameter) {
  char msg[1024];
  /* The last element of the layout, and a verification read (no output arrays). */
  const nmt_model_cfg c = tiny_cfg();
  const size_t last = (size_t)c.vocab * c.d_model - 1;
  NMT_ASSERT_EQ_STATUS(poisoned_read("embed.weight", last, -INFINITY, 0, 1, msg, sizeof msg),
                       NMT_ERR_CHECKPOINT);
  printf("# %s\n", msg);
  char want[64];
  snprintf(want, sizeof want, "embed.weight[%zu]", last);
  NMT_ASSERT(strstr(msg, want) != NULL);
  NMT_ASSERT(strstr(msg, "-inf") != NULL);
}

NMT_TEST(ckpt_finite_parameters_load) {
  char msg[1024];
  /* FLT_MAX and a subnormal are finite: they load. */
  NMT_ASSERT_OK(poisoned_read("encoder.layers.0.ln1.weight", 0, 3.4028235e38f, 1, 0, msg,
                              sizeof msg));
  NMT_ASSERT_OK(poisoned_read("encoder.layers.0.ln1.weight", 1, 1e-45f, 0, 1, msg, sizeof msg));
}
