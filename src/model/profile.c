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
    COST_ADD(c, nmt_prof_cost_attention(ph, ps->B, ps->T, ps->T, H, dk));
    if (bwd) COST_ADD(c, ew(3 * nc, 0, 1, 0));
  } else {
    COST_ADD(c, nmt_prof_cost_matmul(ph, rows, C, C, 1));
    COST_ADD(c, nmt_prof_cost_matmul(ph, src_rows, C, 2 * C, 1));
    COST_ADD(c, nmt_prof_cost_attention(ph, ps->B, ps->T, ps->Ts, H, dk));
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
nmt_prof_cost nmt__model_embed_cost(const nmt_model *m, const pass *ps, nmt_prof_phase ph) {
  const double rows = (double)ps->B * ps->T, C = m->cfg.d_model;
  nmt_prof_cost c = nmt_prof_cost_embedding(ph, rows, C);
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
  if (ph == NMT_PROF_BWD) COST_ADD(c, ew((double)rows * C, 0, 1, 0));
  return c;
}

/* Cost of generator_proj / generator_proj_bwd (backward: memset of g, then the GEMM's). */
nmt_prof_cost nmt__model_proj_cost(const nmt_model *m, int rows, nmt_prof_phase ph) {
  const int C = m->cfg.d_model, V = m->cfg.vocab;
  nmt_prof_cost c = nmt_prof_cost_matmul(ph, rows, C, V, 0);
  if (ph == NMT_PROF_BWD) COST_ADD(c, ew((double)rows * C, 0, 1, 0));
  return c;
}

/* Cost of generator_xent: the fused loss and its gradient, then the two sums. */
nmt_prof_cost nmt__model_xent_cost(const nmt_model *m, int rows) {
  nmt_prof_cost c = nmt_prof_cost_xent(rows, m->cfg.vocab);
  COST_ADD(c, ew(2.0 * rows, 1, 0, 1)); /* the two sums */
  return c;
}
