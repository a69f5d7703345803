/* model_impl.h — what the files of src/model/ share, internal to it: the nmt_model struct and
 * its sublayers, the shapes of one pass, and the functions one file gives another.
 *   transformer.c  create/destroy: the parameter offsets, the activation arena's layout
 *   forward.c      forward pass and loss; backward.c  backward pass and ready prefixes
 *   qkv_streams.c  the Q/K/V projections on three streams (parallel.qkv = streams)
 *   profile.c      profiler ranges: names and per-module FLOPs/bytes
 *   arena.c        the aligned bump allocator of transformer.c and decode.c
 *   decode.c       incremental decoding, greedy and beam search
 *   params.c       the flat parameter layout and its initialisation
 *   cost.c         model FLOPs and the activation bound, from the shapes alone
 *   half_forward.c, half_backward.c  the half-storage path (cfg.act_half)
 *
 * defines: sublayer, final_ln, struct nmt_model, pass, MPROF_*, nmt__model_*, nmt__pass_dropout,
 *          nmt__attn_args,
 *          nmt__decoder_model, nmt__decoder_step_live, nmt__decode_limits, nmt__decoder_select,
 *          nmt__decoder_min_len, nmt__arena, nmt__arena_*
 */
#ifndef NMT_MODEL_IMPL_H
#define NMT_MODEL_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "nmt/model.h"
#include "nmt/prof.h"

enum { SUB_SELF = 0, SUB_CROSS = 1, SUB_FFN = 2 };
enum { STACK_EMBED = 0, STACK_ENC = 1, STACK_DEC = 2 };
enum { PLACE_ATTN = 0, PLACE_OUT = 1, PLACE_RELU = 2 };
/* Profiler ranges of the model outside the layers (names in profile.c's mprof_names). */
enum { MPROF_ENC_EMBED, MPROF_DEC_EMBED, MPROF_ENC_LN, MPROF_DEC_LN, MPROF_PROJ, MPROF_XENT,
       MPROF_N };
/* "decoder.65535.cross_attn" plus NUL fits */
enum { MPROF_NAME_MAX = 32 };

typedef struct {
  int kind, causal;
  /* parameter offsets (floats). SELF: w1/b1 = qkv, w2/b2 = out. CROSS: wq/bq = q,
   * w1/b1 = kv, w2/b2 = out. FFN: w1/b1 = fc1, w2/b2 = fc2. */
  size_t wq, bq, w1, b1, w2, b2, ln_w, ln_b;
  uint32_t site; /* base site; + PLACE_* */
  /* saved activations. With cfg.checkpoint_activations every pointer but an FFN's `out` (the
   * layer's output, kept per layer) points into the workspace shared by all sublayers of its
   * kind, and holds this sublayer's values only after its layer's last (re)computation. */
  float *aux;         /* post-LN: x + dropout(S(x)) (LN input); pre-LN: LN(x) (S input) */
  float *out;         /* sublayer output */
  float *mean, *rstd; /* LN statistics */
  float *proj;        /* SELF fused: qkv (rows, 3C); SELF with cfg.qkv_streams: q, k, v
                       * (rows, C) each, at proj + i*max_tokens*C; CROSS: q (rows, C) at
                       * proj, kv (src rows, 2C) at proj + max_tokens*C */
  float *probs;       /* softmax weights (B, H, Tq, Tk); NULL with cfg.fused_attention */
  float *lse;         /* cfg.fused_attention: the rows' log-sum-exp (B, H, Tq) (else NULL) */
  float *att;         /* concatenated head outputs (rows, C) */
  float *h;           /* FFN hidden after ReLU (rows, F) */
  const float *in;    /* input x of the last forward (a layer's first sublayer: the layer
                       * input, which checkpointing keeps) */
  /* half storage (cfg.act_half; half_forward.c, half_backward.c): what this sublayer keeps in
   * the half type. NULL on the fp32 path. */
  const nmt_act *in_h; /* the GEMM input S read at the last forward (post-LN: the half copy
                        * of in; pre-LN: aux_h) */
  nmt_act *aux_h;      /* pre-LN: LN(x), S's input (post-LN keeps aux, the LN input, fp32) */
  nmt_act *out_h;      /* post-LN: round(out), the next sublayer's GEMM input */
  nmt_act *proj_h;     /* SELF: qkv (rows, 3C), or with cfg.qkv_streams q, k, v (rows, C) at
                        * proj_h + i*max_tokens*C; CROSS: q (rows, C) (its K/V: kv_h) */
  nmt_act *att_h;      /* head outputs (rows, C) */
  nmt_act *h_h;        /* FFN hidden after ReLU and its dropout (rows, F) */
  uint8_t *relu_mask;  /* FFN: where fc1's GEMM may record the ReLU mask (nmt_relu_mask_bytes) */
  int mask_written;    /* FFN: fc1 wrote relu_mask at this sublayer's last forward */
  const nmt_act *kv_h; /* CROSS: this layer's K/V projection of the encoder output, in m->kv_h */
  char prof_name[MPROF_NAME_MAX]; /* range name, "encoder.3.self_attn" */
  int prof_id;                    /* its nmt_prof_intern id while a profiler is set */
} sublayer;

typedef struct {
  size_t w, b;
  float *out, *mean, *rstd;
  const float *in;
  nmt_act *out_h; /* half storage: the output in half only (the next GEMMs' input) */
} final_ln;

struct nmt_model {
  nmt_model_cfg cfg;
  const nmt_backend *be;
  void *ctx;
  int max_tokens, max_len, max_keys;
  size_t n_params;
  size_t embed_off;

  void *arena;
  size_t arena_bytes;       /* nmt_model_activation_bytes */
  float *pe;                /* (max_positions, C) sinusoids */
  float *emb_src, *emb_tgt; /* embedding sums after dropout (N, C) */
  sublayer *enc, *dec;      /* enc_layers*2, dec_layers*3 sublayers, in forward order; every
                             * layer ends with its FFN, whose out is the layer's output */
  final_ln enc_ln, dec_ln;  /* pre-LN only */
  const float *enc_out, *dec_out;
  float *logits, *losses, *nll;
  float loss_scale; /* dloss of the training xent: nmt_model_set_loss_scale, 1 by default */
  const float *loss_scale_dev; /* device scalar multiplying it (nmt_model_set_loss_scale_dev) */
  /* backward scratch */
  float *g[3], *d_drop, *d_att, *d_proj, *d_probs, *f1, *f2;
  float *d_row; /* cfg.fused_attention: the backward's row sums D (B, H, Tq), in d_probs' place */

  /* half storage (cfg.act_half; transformer.c's layout, half_forward.c, half_backward.c) */
  nmt_act *emb_src_h, *emb_tgt_h; /* post-LN: round of the embedding sums (first GEMM inputs) */
  const nmt_act *cur_h;           /* post-LN: the half copy of the residual x the next
                                   * sublayer reads (set by the op that wrote it) */
  const nmt_act *enc_out_h, *dec_out_h; /* the stacks' outputs in half: cross K/V, generator */
  nmt_act *kv_h;    /* every decoder layer's cross K/V, (dec_layers, max_tokens, 2C); layer l
                     * at kv_h + (dec_layers-1-l) * max_tokens * 2C (parameter order) */
  size_t kv_stride; /* floats from one decoder layer's cross kv weight (and bias) to the next
                     * layer's in the layout, uniform; 0: not uniform, one GEMM per layer */
  nmt_act *logits_h;
  nmt_act *dy_h;    /* backward: d S(x) (rows, C); forward: S(x) itself, the residual's input */
  nmt_act *datt_h, *dproj_h, *dh_h; /* d att (rows, C); d qkv (rows, 3C) or d q (rows, C) and
                                     * d kv (src rows, 2C) at + max_tokens*C; d hidden (rows, F) */
  nmt_act *g_h;     /* pre-LN: the half copy of the residual gradient (dropout 0) */
  int d_enc_written; /* backward: some cross-attention has written d_enc (the first writes) */

  /* backward bookkeeping: ready prefix after each stage (see stage_of) */
  int n_stages;
  size_t *ready_after;

  /* state of the last forward, for backward */
  int fwd_train;
  uint64_t fwd_seed, fwd_step;
  int fwd_B, fwd_Ts, fwd_Tt;

  /* profiler ranges (nmt_model_set_profiler): NULL = off */
  nmt_prof_track *prof;
  int prof_ids[MPROF_N];
};

/* Where backward writes parameter gradients: the gradient of the parameter at flat offset o
 * is base[o - begin]. Without a sink (nmt_model_backward) base is the caller's flat gradient
 * buffer and begin 0; with one (nmt_model_backward_sink) base is the window the sink opened
 * for a stage and begin that stage's first offset, so only offsets inside the stage may be
 * asked for (the subtraction happens on offsets, never on pointers outside an allocation). */
typedef struct {
  float *base;
  size_t begin;
} nmt__grad_win;

/* The gradient of parameter offset `off` (NULL base: no gradient wanted, NULL). */
static inline float *nmt__grad_at(nmt__grad_win g, size_t off) {
  return g.base ? g.base + (off - g.begin) : NULL;
}

/* Shapes of one pass: B sentences; the sublayer's own rows have length T (tokens), the
 * keys of cross-attention come from the source (Ts, src_lens). */
typedef struct {
  int B, T, Ts;
  const int32_t *lens, *src_lens;
  const float *enc_out; /* cross-attention memory (B*Ts, C) */
  int train;
  uint64_t seed, step;
} pass;

/* Dropout probability p in a training pass, 0 in an eval pass. */
static inline float nmt__pass_dropout(const pass *ps, float p) { return ps->train ? p : 0.0f; }

/* The fused attention ops' arguments (nmt/attention.h) for the shapes and the dropout of an
 * unfused call: the same q, k, v, strides, key lengths, causal flag, p_drop, seed and stream,
 * so that the two ops draw the same masks. half: q, k, v (and the ops' out, dout, dq, dkey,
 * dv) are nmt_act. */
static inline nmt_attn_args nmt__attn_args(const nmt_model *m, const void *q, int ldq,
                                           const void *k, const void *v, int ldkv,
                                           const int32_t *k_lens, int B, int Tq, int Tk,
                                           int causal, float p_drop, uint64_t seed,
                                           uint64_t stream, int half) {
  const int H = m->cfg.n_heads;
  return (nmt_attn_args){.q = q, .k = k, .v = v, .ldq = ldq, .ldkv = ldkv, .k_lens = k_lens,
                         .B = B, .Tq = Tq, .Tk = Tk, .H = H, .dk = m->cfg.d_model / H,
                         .causal = causal, .p_drop = p_drop, .seed = seed, .stream = stream,
                         .half = half};
}

/* ---- transformer.c ---- */
/* NMT_ERR_DATA unless 1 <= B, 1 <= T <= max_len and B*T <= max_tokens (the create sizes). */
nmt_status nmt__model_check_shape(const nmt_model *m, int B, int T, const char *side);

/* ---- forward.c ---- */
/* Encoder in eval mode (no dropout) over b's sources (device memory); sets m->enc_out
 * (n_sent*src_len, d_model). Errors: NMT_ERR_DATA if the batch exceeds the create sizes. */
nmt_status nmt__model_encode_eval(nmt_model *m, const float *params, const nmt_batch *b);
/* One encoder (n = 2) or decoder (n = 3) layer, sublayers s[0..n), on input x (rows, C);
 * *out = the layer's output (s[n-1].out). backward.c re-runs it when checkpointing. */
nmt_status nmt__model_layer_fwd(nmt_model *m, const float *P, sublayer *s, int n, const float *x,
                                const pass *ps, const float **out);

/* ---- half_forward.c, half_backward.c: the half-storage path (cfg.act_half), one function per
 * piece of forward.c / backward.c, which call them in its place (profiler ranges and the
 * stage windows stay theirs). Shapes and arguments as the fp32 piece's. ---- */
/* embed_fwd_ops: out (rows, C) fp32 and, post-LN, emb_h = its half copy (m->cur_h). */
nmt_status nmt__half_embed_fwd(nmt_model *m, const float *P, float *out, nmt_act *out_h,
                               const int32_t *ids, const pass *ps, uint32_t place);
/* sub_fwd_ops: S(x) and the residual; post-LN reads m->cur_h (the half copy of x) and sets it
 * to s->out_h. */
nmt_status nmt__half_sub_fwd(nmt_model *m, const float *P, sublayer *s, const float *x,
                             const pass *ps);
/* final_ln_fwd: f->out_h = LN(x) in half; sets m->cur_h. */
nmt_status nmt__half_final_ln_fwd(nmt_model *m, const float *P, final_ln *f, const float *x,
                                  int rows);
/* Before the decoder layers: every layer's cross K/V projection of m->enc_out_h into m->kv_h
 * (one batched GEMM when kv_stride is uniform), s->kv_h of each cross sublayer set. */
nmt_status nmt__half_cross_kv_fwd(nmt_model *m, const float *P, const pass *ps);
/* generator_proj and generator_xent_ops on half logits. */
nmt_status nmt__half_generator_fwd(nmt_model *m, const float *P, int rows);
nmt_status nmt__half_xent(nmt_model *m, const nmt_batch *b, int rows, int train,
                          float *grad_extra);
/* generator_proj_bwd: g (rows, C) fp32 written. */
nmt_status nmt__half_generator_bwd(nmt_model *m, const float *P, nmt__grad_win G, float *g,
                                   int rows);
/* final_ln_bwd: *t = LN'(*g) written (and, pre-LN with dropout 0, m->g_h); buffers swapped. */
nmt_status nmt__half_final_ln_bwd(nmt_model *m, const float *P, nmt__grad_win G, final_ln *f,
                                  float **g, float **t, int rows);
/* sub_bwd_ops. */
nmt_status nmt__half_sub_bwd(nmt_model *m, const float *P, nmt__grad_win G, sublayer *s,
                             float **g, float **t, float *d_enc, const pass *ps);
/* embed_bwd_ops. */
nmt_status nmt__half_embed_bwd(nmt_model *m, nmt__grad_win G, const float *dout,
                               const int32_t *ids, const pass *ps, uint32_t place);

/* ---- qkv_streams.c (cfg.qkv_streams) ---- */
/* q, k, v = x W_i^T + b_i (x: (rows, C)) into s->proj's three (rows, C) blocks, at
 * s->proj + i*max_tokens*C, on streams 0, 1, 2. */
nmt_status nmt__model_qkv_streams_fwd(nmt_model *m, const float *P, const sublayer *s,
                                       const float *x, int rows);
/* Backward of the above from dq, dk, dv at dqkv + i*max_tokens*C: accumulates each block's
 * weight and bias gradient into G (the sublayer's stage window) on stream i, and the input
 * gradient of all three into dx (rows, C) on stream 0. */
nmt_status nmt__model_qkv_streams_bwd(nmt_model *m, const float *P, const sublayer *s,
                                       const float *x, nmt__grad_win G, const float *dqkv,
                                       float *dx, int rows);
/* The same on the half-storage path: q, k, v (rows, C) half into s->proj_h's blocks from
 * in_h; backward from dq, dk, dv at dqkv_h + i*max_tokens*C: each block's weight and bias
 * gradient on stream i, the input gradients into dx (fp32) on stream 0, the first of the
 * three delivered as `first` (NMT_DINP_F32: dx written; NMT_DINP_F32_ADD: added). */
nmt_status nmt__model_qkv_streams_half_fwd(nmt_model *m, const float *P, const sublayer *s,
                                            const nmt_act *in_h, int rows);
nmt_status nmt__model_qkv_streams_half_bwd(nmt_model *m, const float *P, const sublayer *s,
                                            const nmt_act *in_h, nmt__grad_win G,
                                            const nmt_act *dqkv_h, float *dx,
                                            nmt_dinp_mode first, int rows);

/* ---- profile.c: ranges and their costs (m->prof set) ---- */
/* Costs are only worked out on sampled steps; other steps push NVTX names only. */
static inline int nmt__model_prof_costs(const nmt_model *m) {
  return nmt_prof_track_sampling(m->prof);
}
static inline void nmt__model_prof_push(nmt_model *m, int id, nmt_prof_phase ph, nmt_prof_cost c) {
  nmt_prof_push(m->prof, id, ph, c.flops, c.bytes);
}
/* FLOPs and bytes of one range: a sublayer with its dropout, residual and LayerNorm
 * (sub_fwd / sub_bwd), an embedding (embed_fwd / embed_bwd), a final LayerNorm
 * (final_ln_fwd / _bwd), the output projection (generator_proj / _bwd), the loss
 * (generator_xent), in phase ph for the pass's shapes. */
nmt_prof_cost nmt__model_sub_cost(const nmt_model *m, const sublayer *s, const pass *ps,
                                  nmt_prof_phase ph);
nmt_prof_cost nmt__model_embed_cost(const nmt_model *m, const pass *ps, nmt_prof_phase ph,
                                    uint32_t place);
nmt_prof_cost nmt__model_final_ln_cost(const nmt_model *m, int rows, nmt_prof_phase ph);
nmt_prof_cost nmt__model_proj_cost(const nmt_model *m, int rows, nmt_prof_phase ph);
nmt_prof_cost nmt__model_xent_cost(const nmt_model *m, int rows);
/* The backend's counters in *out when this pass is profiled (a sampled step, a backend with
 * counters): 1; else 0 (nothing to report). */
int nmt__model_prof_counts(const nmt_model *m, nmt_backend_counters *out);
/* Reports the GEMM launches since *start (from nmt__model_prof_counts) and the context's
 * scratch growths to the track as a pass of phase ph (nmt_prof_track_add_backend). */
void nmt__model_prof_report(const nmt_model *m, nmt_prof_phase ph,
                            const nmt_backend_counters *start);

/* ---- decode.c: what beam search (beam.c) builds on ---- */
/* The model the decoder runs. */
nmt_model *nmt__decoder_model(nmt_decoder *d);
/* nmt_decoder_step where slots may be idle: a token of -1 marks a slot that is not computed
 * (beam search's rows beyond a sentence's live hypotheses), so only the n_live live slots
 * run, in slot order: *logits is (*n_live, vocab), row i = the i-th live slot. A live slot's
 * parent must have been live. Cross-attention still sees beam query slots per sentence (the
 * live rows are spread to them and gathered back), so only idle slots' work is saved. Errors:
 * as nmt_decoder_step; NMT_ERR_USAGE for an idle parent or a step with no live slot. */
nmt_status nmt__decoder_step_live(nmt_decoder *d, const float *params, int n_act,
                                  const int32_t *act, const int32_t *parent,
                                  const int32_t *tokens, const float **logits, int *n_live);
/* Per-sentence output limits lim[i] = min(max_out, src_lens[i] + extra_len, max_positions),
 * >= 0, for B sentences (src_lens: host); returns the longest. lim may alias src_lens. */
int nmt__decode_limits(const nmt_model *m, const int32_t *src_lens, int B, int max_out,
                       int extra_len, int32_t *lim);
/* The decoder's minimum output length (nmt_decoder_set_min_len; 0 when never set). */
int nmt__decoder_min_len(const nmt_decoder *d);
/* The step's selection: logp_topk (nmt/backend.h) of `logits` (R, vocab: the device logits of
 * the last nmt_decoder_step), k per row, into the decoder's device buffer, then read back into
 * its pinned host buffer by one d2h_async and one d2h_wait (the step's only read back). *ids
 * (R, k) and, with with_logp, *logp (R, k; else NULL; logp itself may be NULL) point into that
 * host buffer, valid until the next selection, begin or reservation. R <= the rows of the last
 * begin, k <= 2 x its beam (at most NMT_TOPK_MAX). Errors: NMT_ERR_INTERNAL for R or k beyond
 * those; the backend's (NMT_ERR_ABORTED from the wait). */
nmt_status nmt__decoder_select(nmt_decoder *d, const float *logits, int R, int k, int with_logp,
                               const int32_t **ids, const float **logp);

/* ---- arena (arena.c) ----
 * One backend allocation carved into 64-byte aligned pieces by a layout function that carves
 * every piece in a fixed order: a first pass with base NULL measures, a second one on the
 * allocation hands out the pointers (NULL while measuring). */
typedef struct {
  char *base; /* NULL: measure only */
  size_t used; /* bytes carved so far, alignment padding included */
} nmt__arena;

/* The next piece of `bytes` bytes, at the first multiple of 64 bytes at or after a->used. */
void *nmt__arena_carve(nmt__arena *a, size_t bytes);
/* nmt__arena_carve of n floats / n int32s. */
float *nmt__arena_floats(nmt__arena *a, size_t n);
int32_t *nmt__arena_ints(nmt__arena *a, size_t n);
/* n half elements (nmt_act, 2 bytes each). */
nmt_act *nmt__arena_acts(nmt__arena *a, size_t n);

/* Carves every piece of obj (an nmt_model, an nmt_decoder) into a. */
typedef void (*nmt__arena_layout_fn)(void *obj, nmt__arena *a);
/* Bytes layout(obj) needs: the measuring pass alone. */
size_t nmt__arena_measure(nmt__arena_layout_fn layout, void *obj);
/* Measures, allocates that many bytes with be->malloc into *mem (NULL on error), then runs the
 * layout on it; *bytes (may be NULL) gets the size. Errors: those of be->malloc (NMT_ERR_NOMEM). */
nmt_status nmt__arena_alloc(const nmt_backend *be, void *ctx, nmt__arena_layout_fn layout,
                            void *obj, void **mem, size_t *bytes);

#endif /* NMT_MODEL_IMPL_H */
