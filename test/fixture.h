/* test/fixture.h — the PyTorch golden fixtures of the whole model (test/fixtures/model_*.bin,
 * written by tools/make-fixture.py, whose docstring documents the file layout): a model config,
 * one batch, float32 parameters, and the float64 loss and gradients of one training step,
 * rounded to float32. Read by test/test_model.c (ref backend) and test/test_cuda_model.c
 * (device), which compare a step against them with the two checks below.
 *
 * defines: nmt_fixture, nmt_fixture_load, nmt_fixture_free, nmt_fixture_report,
 *          nmt_fixture_check_loss, nmt_fixture_check_grads
 */
#ifndef NMT_TEST_FIXTURE_H
#define NMT_TEST_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

#include "nmt/model.h"

typedef struct {
  nmt_model_cfg cfg;
  int n_sent, src_len, tgt_len, n_tensors;
  uint64_t seed, step;            /* dropout streams of the training forward */
  int32_t *src, *tgt_in, *tgt_out; /* (n_sent, src_len), (n_sent, tgt_len) x 2, PAD-padded */
  int32_t *src_lens, *tgt_lens;    /* (n_sent) */
  nmt_param_info *tab;             /* n_tensors rows, as PyTorch names and lays them out */
  size_t n_params;                 /* == nmt_model_num_params(&cfg), checked by the loader */
  float *params, *grads;           /* (n_params); grads = d loss_mean / d params */
  double loss_sum, tokens, nll_sum, loss_mean; /* smoothed sum, non-pad targets, NLL sum */
  unsigned char *file;
} nmt_fixture;

/* Loads test/fixtures/<name> (relative to the working directory, else next to this source
 * file). Every array is checked against the file's size, the magic and version, the header's
 * ranges, every tensor inside the parameters, no trailing bytes, and n_params against
 * nmt_model_num_params(cfg), so a test may size its buffers from either. Returns 0 on success;
 * on failure records a test failure naming the file and what is wrong, frees what it read and
 * returns -1. Either way nmt_fixture_free(f) is safe. */
int nmt_fixture_load(const char *name, nmt_fixture *f);

/* Frees what nmt_fixture_load allocated and zeroes *f. */
void nmt_fixture_free(nmt_fixture *f);

/* What the checks measured, for the test's summary line. */
typedef struct {
  double loss_rel, nll_rel;   /* |nmt - fixture| / |fixture| of the loss and NLL sums */
  double worst_rel_to_max;    /* largest max|a-b| / max|b| of any tensor's gradient */
  const char *worst;          /* that tensor's name ("" before nmt_fixture_check_grads) */
  double used;                /* largest |a-b| / (atol + rtol|b|) of any element */
} nmt_fixture_report;

/* `got` is nmt's result of the fixture's training step: n_params gradients of the loss sum,
 * then the NMT_GRAD_EXTRA slots (include/nmt/model.h). The token count must equal the
 * fixture's exactly and the label-smoothed loss and NLL sums agree to relative `rtol`.
 * Fills rep->loss_rel, rep->nll_rel (and zeroes the rest). Returns 1 if all hold; else
 * records a test failure naming `name` and both values, and returns 0. */
int nmt_fixture_check_loss(const char *name, const nmt_fixture *f, const float *got, double rtol,
                           nmt_fixture_report *rep);

/* Gradients of the same `got`, divided by its token count (the fixture holds d(mean)/d params),
 * against the fixture tensor by tensor: |a-b| <= atol_frac * max|b| + rtol * |b| with max|b|
 * over the tensor. Every fixture tensor must have a non-zero gradient, else the comparison
 * would be vacuous. Fills rep->worst_rel_to_max, worst and used (over the tensors checked).
 * Returns 1 if all tensors are close; else records a test failure (the tensor, worst index,
 * both values, tolerance: nmt_test_close) and returns 0. */
int nmt_fixture_check_grads(const char *name, const nmt_fixture *f, const float *got,
                            double atol_frac, double rtol, nmt_fixture_report *rep);

#endif /* NMT_TEST_FIXTURE_H */
