/* test/fixture.c — the PyTorch golden fixtures (fixture.h; layout: tools/make-fixture.py). */
#include "fixture.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"

/* A bounds-checked cursor over the file; `bad` sticks after the first overrun, so a header can
 * be read field by field and checked once. */
typedef struct {
  const unsigned char *p, *end;
  int bad;
} reader;

static const void *take(reader *r, size_t n) {
  if (r->bad || (size_t)(r->end - r->p) < n) {
    r->bad = 1;
    return NULL;
  }
  const void *q = r->p;
  r->p += n;
  return q;
}

/* The file is little endian, like every machine we build for, so a scalar is its bytes. */
static void rd(reader *r, void *v, size_t n) {
  const void *q = take(r, n);
  if (q) memcpy(v, q, n);
}

static int32_t rd_i32(reader *r) {
  int32_t v = 0;
  return rd(r, &v, sizeof v), v;
}

static uint64_t rd_u64(reader *r) {
  uint64_t v = 0;
  return rd(r, &v, sizeof v), v;
}

static float rd_f32(reader *r) {
  float v = 0;
  return rd(r, &v, sizeof v), v;
}

static double rd_f64(reader *r) {
  double v = 0;
  return rd(r, &v, sizeof v), v;
}

/* A malloc'd (so aligned) copy of the next `bytes` of the file. */
static void *rd_array(reader *r, size_t bytes) {
  const void *q = take(r, bytes);
  void *a = malloc(bytes ? bytes : 1);
  if (q && a) memcpy(a, q, bytes);
  return a;
}

void nmt_fixture_free(nmt_fixture *f) {
  free(f->src);
  free(f->tgt_in);
  free(f->tgt_out);
  free(f->src_lens);
  free(f->tgt_lens);
  free(f->tab);
  free(f->params);
  free(f->grads);
  free(f->file);
  memset(f, 0, sizeof *f);
}

static FILE *open_fixture(const char *name) {
  char path[1024];
  snprintf(path, sizeof path, "test/fixtures/%s", name);
  FILE *fp = fopen(path, "rb");
  if (fp) return fp;
  /* Running from elsewhere: look next to this source file. */
  const char *src = __FILE__, *slash = strrchr(src, '/');
  if (slash) {
    snprintf(path, sizeof path, "%.*s/fixtures/%s", (int)(slash - src), src, name);
    fp = fopen(path, "rb");
  }
  return fp;
}

int nmt_fixture_load(const char *name, nmt_fixture *f) {
  memset(f, 0, sizeof *f);
  FILE *fp = open_fixture(name);
  if (!fp) {
    nmt_test_fail(__FILE__, __LINE__, "cannot open fixture %s (run from the repository root)",
                  name);
    goto fail;
  }
  fseek(fp, 0, SEEK_END);
  long size = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  f->file = size >= 0 ? malloc(size ? (size_t)size : 1) : NULL;
  size_t got = f->file ? fread(f->file, 1, (size_t)size, fp) : 0;
  fclose(fp);
  if (!f->file || got != (size_t)size) {
    nmt_test_fail(__FILE__, __LINE__, "%s: short read", name);
    goto fail;
  }
  reader r = {f->file, f->file + size, 0};
  const char *magic = take(&r, 8);
  if (!magic || memcmp(magic, "NMTFIXT1", 8)) {
    nmt_test_fail(__FILE__, __LINE__, "%s: bad magic", name);
    goto fail;
  }
  if (rd_i32(&r) != 1) {
    nmt_test_fail(__FILE__, __LINE__, "%s: unsupported version", name);
    goto fail;
  }
  nmt_model_cfg *c = &f->cfg;
  c->vocab = rd_i32(&r);
  c->d_model = rd_i32(&r);
  c->n_heads = rd_i32(&r);
  c->d_ff = rd_i32(&r);
  c->enc_layers = rd_i32(&r);
  c->dec_layers = rd_i32(&r);
  c->max_positions = rd_i32(&r);
  c->norm = rd_i32(&r) ? NMT_NORM_PRE : NMT_NORM_POST;
  f->n_sent = rd_i32(&r);
  f->src_len = rd_i32(&r);
  f->tgt_len = rd_i32(&r);
  f->n_tensors = rd_i32(&r);
  c->dropout = rd_f32(&r);
  c->attn_dropout = rd_f32(&r);
  c->relu_dropout = rd_f32(&r);
  c->label_smoothing = rd_f32(&r);
  c->ln_eps = rd_f32(&r);
  f->seed = rd_u64(&r);
  f->step = rd_u64(&r);
  if (r.bad || f->n_sent < 1 || f->src_len < 1 || f->tgt_len < 1 || f->n_tensors < 1 ||
      f->n_tensors > 100000) {
    nmt_test_fail(__FILE__, __LINE__, "%s: bad header", name);
    goto fail;
  }
  size_t ns = (size_t)f->n_sent;
  f->src = rd_array(&r, ns * f->src_len * 4);
  f->tgt_in = rd_array(&r, ns * f->tgt_len * 4);
  f->tgt_out = rd_array(&r, ns * f->tgt_len * 4);
  f->src_lens = rd_array(&r, ns * 4);
  f->tgt_lens = rd_array(&r, ns * 4);
  f->tab = calloc((size_t)f->n_tensors, sizeof *f->tab);
  for (int i = 0; f->tab && i < f->n_tensors && !r.bad; i++) {
    const char *nm = take(&r, 80);
    if (nm) memcpy(f->tab[i].name, nm, 79);
    f->tab[i].ndim = rd_i32(&r);
    f->tab[i].shape[0] = rd_i32(&r);
    f->tab[i].shape[1] = rd_i32(&r);
    f->tab[i].offset = rd_u64(&r);
    f->tab[i].numel = rd_u64(&r);
  }
  f->n_params = rd_u64(&r);
  if (r.bad || f->n_params > 100000000) {
    nmt_test_fail(__FILE__, __LINE__, "%s: truncated tensor table", name);
    goto fail;
  }
  /* Tests size the model's buffers from the config and copy the fixture's arrays into them. */
  if (f->n_params != nmt_model_num_params(&f->cfg)) {
    nmt_test_fail(__FILE__, __LINE__, "%s: n_params %zu, but nmt's model of its config has %zu",
                  name, f->n_params, nmt_model_num_params(&f->cfg));
    goto fail;
  }
  for (int i = 0; f->tab && i < f->n_tensors; i++) {
    const nmt_param_info *t = &f->tab[i];
    if (t->offset > f->n_params || t->numel > f->n_params - t->offset) {
      nmt_test_fail(__FILE__, __LINE__, "%s: tensor %s [%zu, +%zu) outside %zu parameters", name,
                    t->name, t->offset, t->numel, f->n_params);
      goto fail;
    }
  }
  f->params = rd_array(&r, f->n_params * 4);
  f->loss_sum = rd_f64(&r);
  f->tokens = rd_f64(&r);
  f->nll_sum = rd_f64(&r);
  f->loss_mean = rd_f64(&r);
  f->grads = rd_array(&r, f->n_params * 4);
  if (r.bad || r.p != r.end || !f->src || !f->tgt_in || !f->tgt_out || !f->src_lens ||
      !f->tgt_lens || !f->tab || !f->params || !f->grads) {
    nmt_test_fail(__FILE__, __LINE__, "%s: truncated or trailing bytes", name);
    goto fail;
  }
  return 0;
fail:
  nmt_fixture_free(f);
  return -1;
}

int nmt_fixture_check_loss(const char *name, const nmt_fixture *f, const float *got, double rtol,
                           nmt_fixture_report *rep) {
  memset(rep, 0, sizeof *rep);
  rep->worst = "";
  const float *extra = got + f->n_params;
  const double loss = extra[NMT_GRAD_SLOT_LOSS], nll = extra[NMT_GRAD_SLOT_NLL];
  const double tokens = extra[NMT_GRAD_SLOT_TOKENS];
  if (tokens != f->tokens) {
    nmt_test_fail(__FILE__, __LINE__, "%s: tokens %g, fixture %g", name, tokens, f->tokens);
    return 0;
  }
  rep->loss_rel = fabs(loss - f->loss_sum) / fabs(f->loss_sum);
  rep->nll_rel = fabs(nll - f->nll_sum) / fabs(f->nll_sum);
  if (!(rep->loss_rel <= rtol) || !(rep->nll_rel <= rtol)) {
    nmt_test_fail(__FILE__, __LINE__,
                  "%s: loss sum %.9g vs %.9g (rel %.3g), nll %.9g vs %.9g (rel %.3g), tol %g",
                  name, loss, f->loss_sum, rep->loss_rel, nll, f->nll_sum, rep->nll_rel, rtol);
    return 0;
  }
  return 1;
}

int nmt_fixture_check_grads(const char *name, const nmt_fixture *f, const float *got,
                            double atol_frac, double rtol, nmt_fixture_report *rep) {
  rep->worst_rel_to_max = rep->used = 0;
  rep->worst = "";
  const double tokens = got[f->n_params + NMT_GRAD_SLOT_TOKENS];
  float *scaled = malloc((f->n_params ? f->n_params : 1) * sizeof *scaled);
  if (!scaled) {
    nmt_test_fail(__FILE__, __LINE__, "%s: out of memory", name);
    return 0;
  }
  /* nmt returns d(sum)/d params; the fixture holds d(mean)/d params. */
  for (size_t i = 0; i < f->n_params; i++) scaled[i] = (float)(got[i] / tokens);
  int ok = 1;
  for (int t = 0; ok && t < f->n_tensors; t++) {
    const nmt_param_info *p = &f->tab[t];
    const float *a = scaled + p->offset, *b = f->grads + p->offset;
    double mx = 0, err = 0;
    for (size_t i = 0; i < p->numel; i++) {
      mx = fmax(mx, fabs(b[i]));
      err = fmax(err, fabs((double)a[i] - b[i]));
    }
    for (size_t i = 0; i < p->numel; i++)
      rep->used = fmax(rep->used, fabs((double)a[i] - b[i]) / (atol_frac * mx + rtol * fabs(b[i])));
    if (mx > 0 && err / mx > rep->worst_rel_to_max) {
      rep->worst_rel_to_max = err / mx;
      rep->worst = p->name;
    }
    /* Every tensor must get a gradient, otherwise the comparison is vacuous. */
    if (mx == 0) {
      nmt_test_fail(__FILE__, __LINE__, "%s: fixture gradient of %s is all zero", name, p->name);
      ok = 0;
    } else {
      ok = nmt_test_close(__FILE__, __LINE__, p->name, a, b, p->numel, atol_frac * mx, rtol);
    }
  }
  free(scaled);
  return ok;
}
