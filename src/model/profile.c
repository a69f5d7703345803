/* profile.c — the model's profiler ranges (include/nmt/prof.h): the module names, their
 * interning, the order nmt_model_module_names lists them in, each module's FLOPs and bytes,
 * and the backend's counts of each training pass (GEMM launches, scratch growths).
 *
 * Each module's forward and backward is one range whose FLOPs and bytes are the sum of
 * nmt_prof_cost_* over the op calls the module makes; the nmt__model_*_cost functions below
 * mirror the op sequences of the functions in forward.c and backward.c they are named after,
 * so a change to one is a change to the other. Ranges wrap whole functions and are popped on
 * the error path too, so the track's nesting survives a failing op. */
#include "model_impl.h"

static const char *const mprof_names[MPROF_N] = {"encoder.embed",    "decoder.embed",
                                                 "encoder.final_ln", "decoder.final_ln",
                                                 "generator.proj",   "generator.xent"};

nmt_status nmt_model_set_profiler(nmt_model *m, nmt_prof_track *track) {
  m->prof = NULL;
  if (!track) return NMT_OK;
  nmt_prof *p = nmt_prof_track_profiler(track);
  for (int i = 0; i < MPROF_N; i++) NMT_TRY(nmt_prof_intern(p, mprof_names[i], &m->prof_ids[i]));
  for (int i = 0; i < 2 * m->cfg.enc_layers; i++)
    NMT_TRY(nmt_prof_intern(p, m->enc[i].prof_name, &m->enc[i].prof_id));
  for (int i = 0; i < 3 * m->cfg.dec_layers; i++)
    NMT_TRY(nmt_prof_intern(p, m->dec[i].prof_name, &m->dec[i].prof_id));
  m->prof = track;
  return NMT_OK;
}

int nmt__model_prof_counts(const nmt_model *m, nmt_backend_counters *out) {
  if (!m->prof || !nmt__model_prof_costs(m) || !m->be->counters) return 0;
  return m->be->counters(m->ctx, out) == NMT_OK;
}

void nmt__model_prof_report(const nmt_model *m, nmt_prof_phase ph,
                            const nmt_backend_counters *start) {
  nmt_backend_counters now;
  if (!nmt__model_prof_counts(m, &now)) return;
  const nmt_prof_backend_counts c = {
      .gemm_calls = (double)(now.gemm_calls - start->gemm_calls),
      .launches = (double)(now.launches - start->launches),
      .casts = (double)(now.casts - start->casts),
      .scratch_growths = (double)now.scratch_growths,
      .half_storage = m->cfg.act_half ? 1 : 0};
  nmt_prof_track_add_backend(m->prof, ph, &c);
}

int nmt_model_module_names(const nmt_model *m, nmt_prof_phase phase, const char **out) {
  const int pre = m->cfg.norm == NMT_NORM_PRE, Le = m->cfg.enc_layers, Ld = m->cfg.dec_layers;
  int n = 0;
#define PUT(s)              \
  do {                      \
    if (out) out[n] = (s);  \
    n++;                    \
  } while (0)
  if (phase == NMT_PROF_FWD) {
    PUT(mprof_names[MPROF_ENC_EMBED]);
    for (int i = 0; i < 2 * Le; i++) PUT(m->enc[i].prof_name);
    if (pre) PUT(mprof_names[MPROF_ENC_LN]);
    PUT(mprof_names[MPROF_DEC_EMBED]);
    for (int i = 0; i < 3 * Ld; i++) PUT(m->dec[i].prof_name);
    if (pre) PUT(mprof_names[MPROF_DEC_LN]);
    PUT(mprof_names[MPROF_PROJ]);
    PUT(mprof_names[MPROF_XENT]);
  } else if (phase == NMT_PROF_BWD) {
    /* With checkpointing each layer's backward starts with the re-run of its forward. */
    const int ck = m->cfg.checkpoint_activations;
    PUT(mprof_names[MPROF_PROJ]);
    if (pre) PUT(mprof_names[MPROF_DEC_LN]);
    for (int l = Ld - 1; l >= 0; l--) {
      for (int k = 0; ck && k < 3; k++) PUT(m->dec[3 * l + k].prof_name);
      for (int k = 2; k >= 0; k--) PUT(m->dec[3 * l + k].prof_name);
    }
    PUT(mprof_names[MPROF_DEC_EMBED]);
    if (pre) PUT(mprof_names[MPROF_ENC_LN]);
    for (int l = Le - 1; l >= 0; l--) {
      for (int k = 0; ck && k < 2; k++) PUT(m->enc[2 * l + k].prof_name);
      for (int k = 1; k >= 0; k--) PUT(m->enc[2 * l + k].prof_name);
    }
    PUT(mprof_names[MPROF_ENC_EMBED]);
  }
#undef PUT
  return n;
}

static nmt_prof_cost ew(double n, double reads, double writes, double flops) {
  return nmt_prof_cost_elementwise(n, reads, writes, flops);
}
#define COST_ADD(c, x) ((c) = nmt_prof_cost_add((c), (x)))

/* ---- the half-storage path's costs (half_forward.c, half_backward.c): the same FLOPs, bytes
 * counted at each tensor's element size (2 for half, 4 for fp32; docs/cuda.md "Precision"). */

static nmt_prof_cost cb(double flops, double bytes) {
  nmt_prof_cost c = {flops, bytes};
  return c;
}

/* linear_half_fwd: inp, w (the half copy), out, bias in half. */
static nmt_prof_cost half_linear_fwd(double M, double K, double N) {
  return cb(2 * M * N * K, 2 * (M * K + N * K + M * N + N));
}
/* linear_half_bwd: the dinp GEMM reads dout and w and writes dinp (dinp_bytes per element, and
 * reads it too when adding); the dw GEMM reads dout and inp and adds into fp32 dw; the bias
 * gradient rides on it (an fp32 vector read and written). */
static nmt_prof_cost half_linear_bwd(double M, double K, double N, double dinp_bytes, int add) {
  return cb(4 * M * N * K + M * N,
            2 * M * N + 2 * N * K + (dinp_bytes + (add ? 4 : 0)) * M * K + 2 * M * N + 2 * M * K +
                8 * N * K + 8 * N);
}
/* attention_fused_* (nmt/attention.h), elements of eb bytes: the unfused op's FLOPs (the
 * recomputed scores are not counted, as a recomputation's FLOPs never are here), and only q,
 * k, v, out (fwd: written; bwd: read with dout) and the fp32 row statistics (lse; bwd: lse
 * read, D written and read) through memory, dq, dk, dv written (fp32, eb = 4: added to, so
 * read too): no (B,H,Tq,Tk) tensor, every term linear in the lengths. */
static nmt_prof_cost fused_attention(nmt_prof_phase ph, double B, double Tq, double Tk,
                                     double H, double dk, double eb) {
  const double C = H * dk, rows = B * H * Tq, grads = eb * B * (Tq * C + 2 * Tk * C);
  const nmt_prof_cost f = nmt_prof_cost_attention(ph, B, Tq, Tk, H, dk);
  if (ph == NMT_PROF_BWD)
    return cb(f.flops, eb * B * (3 * Tq * C + 2 * Tk * C) + (eb == 4 ? 2 : 1) * grads +
                           4 * 3 * rows);
  return cb(f.flops, eb * B * (2 * Tq * C + 2 * Tk * C) + 4 * rows);
}

/* attention_half_*: q, k, v, out (and their gradients) in half, the probabilities fp32. */
static nmt_prof_cost half_attention(nmt_prof_phase ph, double B, double Tq, double Tk, double H,
                                    double dk, int fused) {
  if (fused) return fused_attention(ph, B, Tq, Tk, H, dk, 2);
  const double C = H * dk, P = H * Tq * Tk;
  const nmt_prof_cost f = nmt_prof_cost_attention(ph, B, Tq, Tk, H, dk);
  if (ph == NMT_PROF_BWD) return cb(f.flops, 2 * B * (4 * Tq * C + 6 * Tk * C) + 4 * B * 3 * P);
  return cb(f.flops, 2 * B * (2 * Tq * C + 2 * Tk * C) + 4 * B * P);
}

static nmt_prof_cost half_sub_compute_cost(const nmt_model *m, const sublayer *s, const pass *ps,
                                           nmt_prof_phase ph) {
  const double C = m->cfg.d_model, F = m->cfg.d_ff, H = m->cfg.n_heads, dk = C / H;
  const double rows = (double)ps->B * ps->T, src_rows = (double)ps->B * ps->Ts;
  const int bwd = ph == NMT_PROF_BWD, pre = m->cfg.norm == NMT_NORM_PRE;
  nmt_prof_cost c = {0, 0};
  if (s->kind == SUB_FFN) {
    if (!bwd) {
      COST_ADD(c, half_linear_fwd(rows, C, F));
      if (nmt__pass_dropout(ps, m->cfg.relu_dropout) > 0) COST_ADD(c, cb(rows * F, 4 * rows * F));
      COST_ADD(c, half_linear_fwd(rows, F, C));
    } else {
      /* fc2's dinp with the ReLU backward (its kernel, when not an epilogue, reads the hidden),
       * fc1's into the fp32 residual gradient */
      COST_ADD(c, half_linear_bwd(rows, F, C, 2, 0));
      COST_ADD(c, cb(rows * F, 2 * rows * F));
      COST_ADD(c, half_linear_bwd(rows, C, F, 4, !pre));
    }
    return c;
  }
  if (!bwd) {
    if (s->kind == SUB_SELF) COST_ADD(c, half_linear_fwd(rows, C, 3 * C));
    else COST_ADD(c, half_linear_fwd(rows, C, C)); /* the K/V are the stack's, below */
    COST_ADD(c, half_attention(ph, ps->B, ps->T, s->kind == SUB_SELF ? ps->T : ps->Ts, H, dk,
                               m->cfg.fused_attention));
    COST_ADD(c, half_linear_fwd(rows, C, C));
    return c;
  }
  COST_ADD(c, half_linear_bwd(rows, C, C, 2, 0));
  COST_ADD(c, half_attention(ph, ps->B, ps->T, s->kind == SUB_SELF ? ps->T : ps->Ts, H, dk,
                               m->cfg.fused_attention));
  if (s->kind == SUB_SELF) {
    COST_ADD(c, half_linear_bwd(rows, C, 3 * C, 4, !pre));
  } else {
    COST_ADD(c, half_linear_bwd(src_rows, C, 2 * C, 4, 1));
    COST_ADD(c, half_linear_bwd(rows, C, C, 4, !pre));
  }
  return c;
}

/* The sublayer with its residual, dropout and LayerNorm on the half path. post-LN forward: x
 * (fp32) and y (half) read, sum and out (fp32) and out_h (half) written, the LN's statistics;
 * backward: dout and sum read, dx (fp32) and dy (half) written. pre-LN forward: x read and LN(x)
 * written in half, then x, y read and the output written; backward: dropout into half (with
 * dropout), the LN backward adding into g and writing its half copy (without). */
static nmt_prof_cost half_sub_cost(const nmt_model *m, const sublayer *s, const pass *ps,
                                   nmt_prof_phase ph) {
  const double rows = (double)ps->B * ps->T, C = m->cfg.d_model, n = rows * C;
  const int post = m->cfg.norm == NMT_NORM_POST, bwd = ph == NMT_PROF_BWD;
  nmt_prof_cost c = half_sub_compute_cost(m, s, ps, ph);
  const double ln_flops = nmt_prof_cost_layernorm(ph, rows, C).flops, stats = 8 * rows + 8 * C;
  if (post)
    COST_ADD(c, bwd ? cb(ln_flops + n, n * (4 + 4 + 4 + 2) + stats + 8 * C)
                    : cb(ln_flops + 2 * n, n * (4 + 2 + 4 + 4 + 2) + stats));
  else if (!bwd)
    COST_ADD(c, cb(ln_flops + 2 * n, n * (4 + 2) + stats + n * (4 + 2 + 4)));
  else
    COST_ADD(c, cb(ln_flops + n, (m->cfg.dropout > 0 ? n * (4 + 2) : 0) +
                                      n * (4 + 4 + 4 + 4 + 2) + stats + 8 * C));
  return c;
}

/* Cost of S(x) (sub_compute) or of its backward (sub_compute_bwd). */
static nmt_prof_cost sub_compute_cost(const nmt_model *m, const sublayer *s, const pass *ps,
                                      nmt_prof_phase ph) {
  const double C = m->cfg.d_model, F = m->cfg.d_ff, H = m->cfg.n_heads, dk = C / H;
  const double rows = (double)ps->B * ps->T, src_rows = (double)ps->B * ps->Ts;
  const double nc = rows * C, nf = rows * F;
  const int bwd = ph == NMT_PROF_BWD;
  nmt_prof_cost c = {0, 0};
  if (s->kind == SUB_FFN) {
    const float pr = bwd ? m->cfg.relu_dropout : nmt__pass_dropout(ps, m->cfg.relu_dropout);
    COST_ADD(c, nmt_prof_cost_matmul(ph, rows, C, F, 1));
    COST_ADD(c, nmt_prof_cost_matmul(ph, rows, F, C, 1));
    if (!bwd) {
      /* The ReLU is fused into fc1 (matmul_bias_relu_fwd): no pass over memory of its own,
       * and, as the bias add, not counted in the FLOPs (nmt/prof.h). */
      if (pr > 0) COST_ADD(c, ew(nf, 1, 1, 1));
    } else {
      COST_ADD(c, ew(nf, 0, 2, 0));    /* two memsets */
      COST_ADD(c, ew(nf, 3, 1, 1));    /* relu_bwd: dinp += dout * (out > 0) */
      if (pr > 0) COST_ADD(c, ew(nf, 2, 2, 2)); /* memset + axpy */
    }
    return c;
  }
  COST_ADD(c, nmt_prof_cost_matmul(ph, rows, C, C, 1)); /* out projection */
  if (bwd) COST_ADD(c, ew(nc, 0, 1, 0));
  if (s->kind == SUB_SELF) {
    /* qkv_streams: the same FLOPs in three GEMMs, which read x (and dout) three times */
    if (m->cfg.qkv_streams)
      for (int i = 0; i < 3; i++) COST_ADD(c, nmt_prof_cost_matmul(ph, rows, C, C, 1));
    else
      COST_ADD(c, nmt_prof_cost_matmul(ph, rows, C, 3 * C, 1));
    COST_ADD(c, m->cfg.fused_attention ? fused_attention(ph, ps->B, ps->T, ps->T, H, dk, 4)
                                       : nmt_prof_cost_attention(ph, ps->B, ps->T, ps->T, H, dk));
    if (bwd) COST_ADD(c, ew(3 * nc, 0, 1, 0));
  } else {
    COST_ADD(c, nmt_prof_cost_matmul(ph, rows, C, C, 1));
    COST_ADD(c, nmt_prof_cost_matmul(ph, src_rows, C, 2 * C, 1));
    COST_ADD(c, m->cfg.fused_attention ? fused_attention(ph, ps->B, ps->T, ps->Ts, H, dk, 4)
                                       : nmt_prof_cost_attention(ph, ps->B, ps->T, ps->Ts, H, dk));
    if (bwd) COST_ADD(c, ew(nc + 2 * src_rows * C, 0, 1, 0));
  }
  return c;
}

/* Cost of sub_fwd_ops / sub_bwd_ops: S plus dropout, residual and LayerNorm. The fused
 * residual_dropout_ln op moves each array once: post-LN forward reads x and y and writes sum
 * and out (the LayerNorm's own traffic, its input read, plus one more read and the write of
 * sum); its backward adds to LayerNorm's traffic only the read and write of dy when there is
 * dropout. 1 FLOP per element for the add, 1 for the dropout scale. */
nmt_prof_cost nmt__model_sub_cost(const nmt_model *m, const sublayer *s, const pass *ps,
                                  nmt_prof_phase ph) {
  if (m->cfg.act_half) return half_sub_cost(m, s, ps, ph);
  const double rows = (double)ps->B * ps->T, n = rows * m->cfg.d_model;
  const int post = m->cfg.norm == NMT_NORM_POST;
  nmt_prof_cost c = sub_compute_cost(m, s, ps, ph);
  COST_ADD(c, nmt_prof_cost_layernorm(ph, rows, m->cfg.d_model));
  if (ph == NMT_PROF_BWD) {
    COST_ADD(c, ew(n, 0, 1, 0)); /* memset of the LN's or S's input gradient */
    if (m->cfg.dropout > 0)      /* memset of the dropout gradient, then post: the fused op's
                                  * dy += (read, write); pre: dropout_bwd (dout, dy read, dy) */
      COST_ADD(c, post ? ew(n, 1, 2, 1) : ew(n, 2, 2, 1));
  } else {
    const double pf = nmt__pass_dropout(ps, m->cfg.dropout) > 0 ? 1 : 0;
    /* post: y read and sum written on top of the LN's; pre (gamma NULL): x, y read, sum written */
    COST_ADD(c, post ? ew(n, 1, 1, 1 + pf) : ew(n, 2, 1, 1 + pf));
  }
  return c;
}

/* Cost of embed_fwd_ops / embed_bwd_ops. */
nmt_prof_cost nmt__model_embed_cost(const nmt_model *m, const pass *ps, nmt_prof_phase ph,
                                    uint32_t place) {
  const double rows = (double)ps->B * ps->T, C = m->cfg.d_model;
  nmt_prof_cost c = nmt_prof_cost_embedding(ph, rows, C);
  if (m->cfg.act_half) {
    /* forward: the half copy written too (post-LN); decoder: every layer's cross K/V, made
     * before the decoder's first layer, counted with its embedding */
    if (ph == NMT_PROF_FWD) {
      if (m->cfg.norm == NMT_NORM_POST) COST_ADD(c, cb(rows * C, 2 * rows * C));
      if (nmt__pass_dropout(ps, m->cfg.dropout) > 0) COST_ADD(c, ew(rows * C, 1, 1, 1));
      if (place == 1)
        for (int l = 0; l < m->cfg.dec_layers; l++)
          COST_ADD(c, half_linear_fwd((double)ps->B * ps->Ts, C, 2 * C));
    } else if (m->cfg.dropout > 0) {
      COST_ADD(c, ew(rows * C, 1, 1, 1)); /* dropout_fwd, written */
    }
    return c;
  }
  if (ph == NMT_PROF_BWD && m->cfg.dropout > 0) COST_ADD(c, ew(rows * C, 2, 2, 1));
  if (ph == NMT_PROF_FWD && nmt__pass_dropout(ps, m->cfg.dropout) > 0)
    COST_ADD(c, ew(rows * C, 1, 1, 1));
  return c;
}

/* Cost of final_ln_fwd / final_ln_bwd (backward: memset of the input gradient, then the
 * LayerNorm's backward). */
nmt_prof_cost nmt__model_final_ln_cost(const nmt_model *m, int rows, nmt_prof_phase ph) {
  const int C = m->cfg.d_model;
  nmt_prof_cost c = nmt_prof_cost_layernorm(ph, rows, C);
  if (m->cfg.act_half) {
    /* half output only forward; backward written, not zeroed, plus its half copy */
    const double n = (double)rows * C;
    return ph == NMT_PROF_BWD ? cb(c.flops, c.bytes + 2 * n) : cb(c.flops, c.bytes - 2 * n);
  }
  if (ph == NMT_PROF_BWD) COST_ADD(c, ew((double)rows * C, 0, 1, 0));
  return c;
}

/* Cost of generator_proj / generator_proj_bwd (backward: memset of g, then the GEMM's). */
nmt_prof_cost nmt__model_proj_cost(const nmt_model *m, int rows, nmt_prof_phase ph) {
  const int C = m->cfg.d_model, V = m->cfg.vocab;
  if (m->cfg.act_half)
    return ph == NMT_PROF_BWD ? half_linear_bwd(rows, C, V, 4, 0) : half_linear_fwd(rows, C, V);
  nmt_prof_cost c = nmt_prof_cost_matmul(ph, rows, C, V, 0);
  if (ph == NMT_PROF_BWD) COST_ADD(c, ew((double)rows * C, 0, 1, 0));
  return c;
}

/* Cost of generator_xent: the fused loss and its gradient, then the two sums. */
nmt_prof_cost nmt__model_xent_cost(const nmt_model *m, int rows) {
  nmt_prof_cost c = nmt_prof_cost_xent(rows, m->cfg.vocab);
  /* half logits read and the gradient written over them in half */
  if (m->cfg.act_half) c = cb(c.flops, 2 * 2.0 * rows * m->cfg.vocab + 16.0 * rows);
  COST_ADD(c, ew(2.0 * rows, 1, 0, 1)); /* the two sums */
  return c;
}
