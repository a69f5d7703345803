/* ref/layernorm.c — layer normalization (Ba et al. 2016): biased variance, eps inside the sqrt,
 * statistics accumulated in double. */
#include <math.h>
#include <string.h>

#include "nmt/half.h"
#include "nmt/ref.h"

// out, inp: (M,C); mean, rstd: (M); gamma, beta: (C)
nmt_status nmt_ref_layernorm_fwd(void *ctx, float *out, float *mean, float *rstd, const float *inp,
                                 const float *gamma, const float *beta, int M, int C, float eps) {
  (void)ctx;
  if (M < 0 || C < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref layernorm_fwd: bad shape M=%d C=%d", M, C);
  for (int r = 0; r < M; r++) {
    const float *x = inp + (size_t)r * C;
    float *o = out + (size_t)r * C;
    double s = 0;
    for (int c = 0; c < C; c++) s += x[c];
    double mu = s / C;
    /* Two-pass variance: no cancellation when |mean| >> std. */
    double ss = 0;
    for (int c = 0; c < C; c++) {
      double d = x[c] - mu;
      ss += d * d;
    }
    double rs = 1.0 / sqrt(ss / C + (double)eps);
    float muf = (float)mu, rsf = (float)rs;
    for (int c = 0; c < C; c++) o[c] = (x[c] - muf) * rsf * gamma[c] + beta[c];
    if (mean) mean[r] = muf;
    if (rstd) rstd[r] = rsf;
  }
  return NMT_OK;
}

/* With xhat = (x - mean) * rstd and g = dout * gamma:
 * dinp = rstd * (g - mean(g) - xhat * mean(g * xhat)); dgamma = sum_rows dout * xhat;
 * dbeta = sum_rows dout. */
nmt_status nmt_ref_layernorm_bwd(void *ctx, float *dinp, float *dgamma, float *dbeta,
                                 const float *dout, const float *inp, const float *gamma,
                                 const float *mean, const float *rstd, int M, int C) {
  (void)ctx;
  if (M < 0 || C < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref layernorm_bwd: bad shape M=%d C=%d", M, C);
  for (int r = 0; r < M; r++) {
    const float *x = inp + (size_t)r * C;
    const float *g = dout + (size_t)r * C;
    float mu = mean[r], rs = rstd[r];
    if (dinp) {
      double sg = 0, sgx = 0;
      for (int c = 0; c < C; c++) {
        float xh = (x[c] - mu) * rs;
        float gg = g[c] * gamma[c];
        sg += gg;
        sgx += (double)gg * xh;
      }
      float mg = (float)(sg / C), mgx = (float)(sgx / C);
      float *dx = dinp + (size_t)r * C;
      for (int c = 0; c < C; c++) {
        float xh = (x[c] - mu) * rs;
        dx[c] += rs * (g[c] * gamma[c] - mg - xh * mgx);
      }
    }
    if (dgamma)
      for (int c = 0; c < C; c++) dgamma[c] += g[c] * ((x[c] - mu) * rs);
    if (dbeta)
      for (int c = 0; c < C; c++) dbeta[c] += g[c];
  }
  return NMT_OK;
}

/* ---- the half-storage path (nmt/backend.h layernorm_half_fwd / _bwd) ---- */

// out: (M,C) half; inp: (M,C) fp32; mean, rstd: (M); gamma, beta: (C)
nmt_status nmt_ref_layernorm_half_fwd(void *ctx, nmt_act *out, float *mean, float *rstd,
                                      const float *inp, const float *gamma, const float *beta,
                                      int M, int C, float eps) {
  if (M < 0 || C < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref layernorm_half_fwd: bad shape M=%d C=%d", M, C);
  int bf16;
  NMT_TRY(nmt__ref_half_mode(ctx, "layernorm_half_fwd", &bf16));
  if (M == 0) return NMT_OK;
  float *row;
  NMT_TRY(nmt__ref_scratch(ctx, NMT_REF_SLOT_ROW, (size_t)C, &row));
  for (int r = 0; r < M; r++) {
    NMT_TRY(nmt_ref_layernorm_fwd(NULL, row, mean ? mean + r : NULL, rstd ? rstd + r : NULL,
                                  inp + (size_t)r * C, gamma, beta, 1, C, eps));
    nmt_half_encode_array(bf16, out + (size_t)r * C, row, (size_t)C);
  }
  return NMT_OK;
}

// dinp: (M,C) fp32, = or +=; dinp_h: (M,C) half or NULL; dout, inp: (M,C) fp32
nmt_status nmt_ref_layernorm_half_bwd(void *ctx, float *dinp, int accumulate, nmt_act *dinp_h,
                                      float *dgamma, float *dbeta, const float *dout,
                                      const float *inp, const float *gamma, const float *mean,
                                      const float *rstd, int M, int C) {
  if (M < 0 || C < 1)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref layernorm_half_bwd: bad shape M=%d C=%d", M, C);
  if (dinp_h && !dinp)
    return nmt_errorf(NMT_ERR_INTERNAL, "ref layernorm_half_bwd: dinp_h without dinp");
  int bf16;
  NMT_TRY(nmt__ref_half_mode(ctx, "layernorm_half_bwd", &bf16));
  if (M == 0) return NMT_OK;
  const size_t n = (size_t)M * C;
  if (dinp && !accumulate) memset(dinp, 0, n * sizeof *dinp);
  NMT_TRY(nmt_ref_layernorm_bwd(NULL, dinp, dgamma, dbeta, dout, inp, gamma, mean, rstd, M, C));
  if (dinp_h) nmt_half_encode_array(bf16, dinp_h, dinp, n);
  return NMT_OK;
}
