/* nmt/model.h — the Transformer of Vaswani et al. 2017 (§3) as a sequence of backend op calls.
 *
 * Knows shapes, not devices: every computation goes through an nmt_backend table, every buffer
 * comes from that backend's malloc. Encoder-decoder; multi-head attention with source padding
 * masks and the causal mask; ReLU FFN; sinusoidal positions; embeddings scaled by sqrt(d_model);
 * one embedding matrix shared by source, target and the output projection (§3.4); residual +
 * LayerNorm, post-LN as the paper or pre-LN (then with a final LayerNorm per stack); dropout on
 * sublayer outputs, embedding sums, attention weights and FFN activations; label-smoothed
 * cross entropy that ignores padding.
 *
 * Parameters live in ONE flat fp32 buffer owned by the caller; gradients in a second one of the
 * same layout (plus NMT_GRAD_EXTRA trailing slots, see below). The layout is in backward
 * completion order so gradient buckets fill front to back during backward:
 *   decoder.ln_f (pre-LN only), decoder.layers.{L-1..0}, encoder.ln_f (pre-LN only),
 *   encoder.layers.{L-1..0}, embed.weight.
 * nmt_model_param_table() lists every tensor (name, offset, shape); docs/formats.md and
 * tools/make-fixture.py follow it. Tensor names inside a layer (forward order):
 *   encoder.layers.i.{self_attn.qkv.weight (3C,C), self_attn.qkv.bias (3C),
 *     self_attn.out.weight (C,C), self_attn.out.bias (C), ln1.weight (C), ln1.bias (C),
 *     ffn.fc1.weight (F,C), ffn.fc1.bias (F), ffn.fc2.weight (C,F), ffn.fc2.bias (C),
 *     ln2.weight (C), ln2.bias (C)}
 *   decoder.layers.i.{self_attn.qkv.*, self_attn.out.*, ln1.*, cross_attn.q.weight (C,C),
 *     cross_attn.q.bias (C), cross_attn.kv.weight (2C,C), cross_attn.kv.bias (2C),
 *     cross_attn.out.*, ln2.*, ffn.fc1.*, ffn.fc2.*, ln3.*}
 *   {encoder,decoder}.ln_f.{weight,bias} (C) with pre-LN; embed.weight (V,C).
 * qkv rows are [W_q; W_k; W_v]; heads are contiguous column blocks of d_k = C/H.
 *
 * Two options of nmt_model_cfg change how, not what, is computed: checkpoint_activations
 * (Chen et al. 2016: keep one tensor per layer, recompute the rest in backward; bitwise the
 * same gradients, nmt_model_activation_bytes shows the memory) and qkv_streams (the Q/K/V
 * projections as three GEMMs on three streams). src/model/transformer.c's top comment has the
 * memory layout of both, src/model/qkv_streams.c the streams' work.
 *
 * Decoding (src/model/decode.c): nmt_decoder keeps per-layer caches so that each step runs the
 * decoder on one new position per hypothesis; greedy (decode.c) and beam search (beam.c) are
 * built on it.
 *
 * Profiling (include/nmt/prof.h): nmt_model_set_profiler makes every module's forward and
 * backward a named range on a profiler track (nmt_model_module_names lists them); off by
 * default, and the numerics are the same either way.
 *
 * defines: nmt_model_cfg, nmt_param_info, nmt_model, nmt_model_* (NMT_GRAD_* in nmt/backend.h),
 *          nmt_grad_sink, nmt_decoder, nmt_decoder_* (nmt_decoder_ensemble among them), nmt_lr_at
 */
#ifndef NMT_MODEL_H
#define NMT_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "nmt/backend.h"
#include "nmt/config.h"
#include "nmt/data.h"
#include "nmt/prof.h"
#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The trailing slots of the gradient buffer (NMT_GRAD_SLOT_*, NMT_GRAD_EXTRA) are defined in
 * nmt/backend.h, where step_control reads them. */

typedef struct {
  int vocab, d_model, n_heads, d_ff, enc_layers, dec_layers, max_positions;
  float dropout, attn_dropout, relu_dropout, label_smoothing;
  nmt_norm_kind norm;
  float ln_eps; /* 1e-5 */
  /* Activation checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
   * Cost" §4; train.checkpoint_activations). 0: every sublayer keeps its activations for
   * backward. 1: the training forward keeps only each encoder/decoder layer's input (the
   * previous layer's output, a (tokens, d_model) tensor); the sublayers' activations (LN
   * input/output and statistics, Q/K/V, softmax weights, head outputs, FFN hidden) live in
   * ONE workspace shared by all layers, and backward re-runs each layer's forward into it
   * just before that layer's backward. Dropout masks are counter-based (nmt_rng), so the
   * recomputed activations, and hence the loss, the gradients and the ready-prefix calls,
   * are bitwise those of 0; the cost is one more forward of the layers per step.
   * nmt_model_activation_bytes gives the memory either way. Eval passes are unchanged. */
  int checkpoint_activations;
  /* Self-attention Q/K/V projection (parallel.qkv). 0 (fused): one GEMM with the (3C, C)
   * weight self_attn.qkv into one (rows, 3C) buffer. 1 (streams): three (C, C) GEMMs with
   * its row blocks W_q, W_k, W_v into three (rows, C) buffers, issued on streams 0, 1, 2 of
   * the backend's stream pool (stream_fork .. stream_join), and likewise for their weight
   * gradients in backward. The context must have a pool of >= 2 aux streams (the trainer
   * makes it) unless the backend's stream_fork is NULL, which runs the three in turn.
   * Parameters and checkpoints are the same either way; results agree to float rounding
   * (the input gradient sums three (rows, C) products instead of one over 3C). Incremental
   * decoding (nmt_decoder) always uses the fused GEMM. */
  int qkv_streams;
  /* Half storage (precision.activations = half in fp16/bf16; docs/cuda.md "Precision"). 0: the
   * fp32 activations of the fp32 ops, whose GEMMs round their inputs in fp16/bf16 mode. 1: the
   * activations and activation gradients that feed GEMMs are stored in the context's half type
   * and produced by the half-storage ops (nmt/backend.h), so no GEMM input is cast; the
   * residual stream, statistics, losses and parameter gradients stay fp32. The context must
   * compute in fp16 or bf16. Parameters, checkpoints and the gradient buffer are the same; the
   * numerics differ by the extra rounding sites. nmt_model_logits is refused (its logits are
   * half), and incremental decoding (nmt_decoder) always uses 0. */
  int act_half;
  /* Attention ops (kernels.attention; nmt/attention.h). 0 (unfused): attention_fwd /
   * attention_bwd (and their half twins), each attention sublayer keeping its softmax weights
   * (B, H, Tq, Tk) for backward. 1 (fused): attention_fused_fwd / attention_fused_bwd, each
   * keeping only the rows' log-sum-exp (B, H, Tq) and recomputing the weights in backward
   * from it; the dropout masks are the same (seed, stream), the results agree to float
   * rounding, and the activation arena has no (B, H, Tq, Tk) tensor at all. Applies to every
   * pass of nmt_model_forward / _backward / nmt_model_logits (the encoder run of decoding
   * included); incremental decoding's steps (nmt_decoder) always use the unfused op. */
  int fused_attention;
} nmt_model_cfg;

/* Copies the model keys of a run config (ln_eps = 1e-5), with checkpoint_activations from
 * train.checkpoint_activations, qkv_streams = (parallel.qkv == streams) and fused_attention
 * = (kernels.attention == fused); act_half = 0
 * (decoding and evaluation keep fp32 activations; the trainer sets it from
 * nmt_model_half_storage). */
void nmt_model_cfg_from_config(const nmt_config *c, nmt_model_cfg *out);
/* 1 when a training run of config c stores activations in half (nmt_model_cfg.act_half):
 * precision.mode fp16 or bf16 with precision.activations = half; else 0. */
int nmt_model_half_storage(const nmt_config *c);

typedef struct {
  char name[80];
  size_t offset; /* in floats from the start of the flat buffer */
  size_t numel;
  int ndim;      /* 1 or 2 */
  int shape[2];
} nmt_param_info;

/* Number of parameters (floats) in the flat buffer, excluding NMT_GRAD_EXTRA. */
size_t nmt_model_num_params(const nmt_model_cfg *cfg);
/* Writes the tensor table to `out` (may be NULL) and returns the number of tensors. */
int nmt_model_param_table(const nmt_model_cfg *cfg, nmt_param_info *out);
/* Initialises host_params (n_params floats): Xavier-uniform matrices, zero biases, LayerNorm
 * gain 1 / bias 0, embedding N(0, d_model^-0.5) (fairseq's choice for tied embeddings), the
 * PAD row zero. Deterministic in seed (nmt_rng). */
void nmt_model_init_params(const nmt_model_cfg *cfg, uint64_t seed, float *host_params);

typedef struct nmt_model nmt_model;

/* Called during backward each time the gradients of every parameter at flat offsets
 * [0, ready_floats) are final; ready_floats only grows within one backward. */
typedef nmt_status (*nmt_grad_ready_fn)(void *user, size_t ready_floats);

/* Allocates activations for micro-batches of up to max_tokens padded tokens per side and rows
 * of up to max_len positions, on backend `be` with device context `ctx`, and reserves the
 * context's scratch for them (nmt_model_scratch_plan; be->reserve_scratch).
 * Errors: NMT_ERR_CONFIG (max_len > max_positions, d_model % n_heads), NMT_ERR_NOMEM, the
 * backend's (NMT_ERR_DEVICE). */
nmt_status nmt_model_create(const nmt_model_cfg *cfg, const nmt_backend *be, void *ctx,
                            int max_tokens, int max_len, nmt_model **out);
void nmt_model_destroy(nmt_model *m);

/* Bytes of the model's one backend allocation (device memory on cuda): the activations kept
 * for backward, the backward scratch, the logits and the sinusoid table, sized at create for
 * max_tokens rows (the itemised formula is at the top of src/model/transformer.c). With
 * cfg.checkpoint_activations the per-sublayer activations shrink to one (max_tokens, d_model)
 * tensor per layer plus one shared layer workspace. Parameters, gradients and optimizer
 * state are the caller's and not counted. */
size_t nmt_model_activation_bytes(const nmt_model *m);
/* The same number without creating a model: what nmt_model_create(cfg, ..., max_tokens,
 * max_len) would allocate (for messages and plans before the allocation). 0 if the host is out
 * of memory for the bookkeeping. The arguments must be ones nmt_model_create accepts, and
 * small enough that the byte count fits in size_t (the trainer bounds it first). */
size_t nmt_model_arena_bytes(const nmt_model_cfg *cfg, int max_tokens, int max_len);

/* An upper bound, in bytes, on nmt_model_arena_bytes(c, max_tokens, max_len), computed in
 * double from the itemised table at the top of src/model/transformer.c (every layer at its
 * size without checkpointing, which only shrinks it) plus the arena's alignment padding. For
 * any shapes, however large, it gives a finite number where the exact size_t count would
 * wrap: the trainer refuses sizes whose bound exceeds 2^60 before asking for the exact count.
 * max_tokens, max_len >= 1; no other checks. */
double nmt_model_activation_bytes_bound(const nmt_model_cfg *c, int max_tokens, int max_len);

/* The scratch plan of a model created with (cfg, max_tokens, max_len): the largest shapes its
 * ops are called with in a training or evaluation pass (nmt/backend.h nmt_scratch_plan; the
 * derivation is in src/model/cost.c), from the configuration alone (data.max_tokens,
 * data.max_len, d_model, n_heads, d_ff, vocab, attn_dropout, qkv_streams). nmt_model_create
 * reserves it on its context (the table's reserve_scratch), so that no op of a step
 * allocates scratch; the one function that decides those sizes, for the trainer, translate,
 * eval and the benches alike. Incremental decoding (nmt_decoder) reserves its own shapes.
 * Arguments as nmt_model_create accepts them. */
void nmt_model_scratch_plan(const nmt_model_cfg *cfg, int max_tokens, int max_len,
                            nmt_scratch_plan *out);

/* Model FLOPs of one training pass (forward + backward) over a batch of B sentences padded to
 * Ts source / Tt target positions: 3 x the forward pass's matrix-multiply FLOPs (2*M*K*N per
 * GEMM: Q/K/V and output projections, attention scores and weighted sums (4*B*Tq*Tk*d_model per
 * attention), FFN, tied output projection; backward = 2 x forward) on the padded shapes, the
 * convention of bench/README.md "model FLOPs" (Kaplan et al. 2020 §2.1; Chowdhery et al. 2022
 * App. B). Elementwise work, softmax, LayerNorm, the embedding lookups and the optimizer are
 * not counted. The same formula as bench/pytorch_baseline.py:train_flops, its Python twin;
 * MFU in metrics.jsonl and `nmt bench scaling` use it. */
double nmt_model_train_flops(const nmt_model_cfg *c, int B, int Ts, int Tt);

/* The learning rate of optimizer step `step` (1-based; step < 1 counts as 1): the
 * Transformer's schedule, Vaswani et al. 2017 §5.3 eq. 3, scaled by train.lr_scale:
 *   lr = lr_scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
 * with d_model = model.d_model and warmup = train.warmup_steps (< 1 counts as 1): a linear
 * rise over the warmup steps, then decay as step^-0.5. Pure; cannot fail. The trainer, `nmt
 * bench scaling` and bench/op_profile.c step AdamW with it (src/model/schedule.c). */
double nmt_lr_at(const nmt_config *cfg, long step);

/* Loss scale for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training" §3.2):
 * later training forwards seed backward with d(scale * sum loss)/d logits, so every gradient
 * nmt_model_backward accumulates is multiplied by `scale` (the caller unscales). 1 (the
 * default) leaves gradients as they are; scale must be > 0 and finite. */
void nmt_model_set_loss_scale(nmt_model *m, float scale);
/* The same, read from device memory at each training forward: *scale (one float, device
 * memory of the model's backend, e.g. &nmt_step_ctl.scale, which step_control updates on the
 * device) multiplies the host scale above. NULL (the default) reads nothing. The pointer must
 * stay valid while the model trains. */
void nmt_model_set_loss_scale_dev(nmt_model *m, const float *scale);

/* Forward pass and loss for batch `b` (device memory). Adds the summed label-smoothed loss,
 * the token count and the summed NLL into grad_extra[NMT_GRAD_SLOT_*] (device memory; pass
 * grads + n_params). train != 0 enables dropout with streams nmt_rng_stream(step, site) under
 * seed. Leaves d(loss scale * sum loss)/d logits in place for nmt_model_backward when train != 0.
 * Errors: NMT_ERR_DATA if the batch exceeds the sizes given at create. */
nmt_status nmt_model_forward(nmt_model *m, const float *params, const nmt_batch *b, int train,
                             uint64_t seed, uint64_t step, float *grad_extra);

/* Backward of the last nmt_model_forward(train=1): ACCUMULATES d(loss scale * sum of loss)/d params into
 * grads (same layout as params). Calls ready(user, n) as buckets' gradients become final (ready
 * may be NULL). The caller divides by the total token count (reduced across devices). */
nmt_status nmt_model_backward(nmt_model *m, const float *params, float *grads,
                              const nmt_batch *b, nmt_grad_ready_fn ready, void *user);

/* Where nmt_model_backward_sink sends the parameter gradients, stage by stage (ZeRO stage 2,
 * Rajbhandari et al. 2020 §5.2: a rank keeps only its shard of the gradient, so no flat
 * buffer of every gradient exists). The stages are nmt_model_grad_stages' ranges. The tied
 * embedding's stage (the last) is opened FIRST and closed LAST: its window stays open through
 * the whole backward and receives, in this order, the output projection's, the decoder
 * input's and the encoder input's parts. Between its open and close the other stages open
 * and close in backward order, one at a time: decoder.ln_f (pre-LN), decoder layers L-1..0,
 * encoder.ln_f (pre-LN), encoder layers L-1..0.
 * open(user, begin, end, &window): the stage covering parameter offsets [begin, end) starts;
 *   *window must point to >= end - begin ZEROED fp32 floats of the model's backend (device
 *   memory on cuda), into which the stage ACCUMULATES the gradient of parameter offset o at
 *   window[o - begin] (the same values, op by op, nmt_model_backward adds at grads[o]).
 * close(user, begin, end): the window's gradients are final (on the compute stream: the
 *   ops are enqueued, not necessarily done); the model does not touch the window again. A
 *   later stage's open may come before the sink is done with it.
 * So at most two windows are open at a time (the embedding's and one other); an empty stage
 * (post-LN's ln_f) is never opened.
 * An error from either ends the backward with it. */
typedef struct {
  nmt_status (*open)(void *user, size_t begin, size_t end, float **window);
  nmt_status (*close)(void *user, size_t begin, size_t end);
  void *user;
} nmt_grad_sink;

/* nmt_model_backward with the parameter gradients sent to `sink`'s windows instead of a flat
 * buffer (and no ready calls: a close is the stage's report). The trailing slots are the
 * forward's grad_extra as always. Per stage the gradient values are those nmt_model_backward
 * accumulates into a zeroed flat buffer (bitwise on the reference backend, the embedding's
 * included; on cuda a GEMM may take another algorithm for the window's alignment). Errors:
 * NMT_ERR_INTERNAL for a sink
 * without open or close, or an open that gives no window; the sink's; as
 * nmt_model_backward. */
nmt_status nmt_model_backward_sink(nmt_model *m, const float *params, const nmt_batch *b,
                                   const nmt_grad_sink *sink);

/* The parameter ranges backward finishes in turn, as the nonempty stages of the layout
 * (decoder.ln_f with pre-LN, each decoder layer, encoder.ln_f with pre-LN, each encoder layer,
 * the embedding): stage i covers flat offsets [bounds[i], bounds[i+1]); bounds[0] = 0 and
 * bounds[count] = nmt_model_num_params(cfg). Writes count + 1 offsets to `bounds` (may be
 * NULL) and returns count (dec_layers + enc_layers + 1, + 2 with pre-LN); 0 if the host is out
 * of memory for the parameter table. These are the ranges nmt_model_backward_sink opens and
 * the ready prefixes nmt_model_backward reports are their ends. */
int nmt_model_grad_stages(const nmt_model_cfg *cfg, size_t *bounds);

/* Eval-mode forward (no dropout, no loss) of batch `b` (device memory): *logits points to the
 * model's (n_sent*tgt_len, vocab) fp32 logits in device memory, row (i*tgt_len + t) = the
 * distribution after tgt_in[i, 0..t]. Valid until the next call on m.
 * Errors: NMT_ERR_DATA if the batch exceeds the sizes given at create. */
nmt_status nmt_model_logits(nmt_model *m, const float *params, const nmt_batch *b,
                            const float **logits);

/* Greedy decoding (beam 1) for the sources of `b` (b->src, b->src_lens, n_sent, src_len):
 * out_ids (n_sent, max_out) host int32, PAD after each sentence's end; out_lens (n_sent) host.
 * Generation stops at EOS (not written) or at min(max_out, src_len_i + extra_len,
 * max_positions) tokens. <pad> and <s> are never output (the best other id is taken; they are
 * never training targets). Incremental (see nmt_decoder); allocates a decoder for the call, so
 * loops over many batches should create one and call nmt_decoder_greedy. */
nmt_status nmt_model_greedy(nmt_model *m, const float *params, const nmt_batch *b, int max_out,
                            int extra_len, int32_t *out_ids, int32_t *out_lens);

/* ---- profiling ranges ----
 * Makes every module of nmt_model_forward, nmt_model_backward and nmt_model_logits a range on
 * `track` (include/nmt/prof.h), with the FLOPs and bytes of its ops from the batch's shapes
 * (nmt_prof_cost_*). The track must belong to the thread that runs the model; NULL turns the
 * ranges off (the default). Interns the module names into the track's profiler (at setup, not
 * per step). Incremental decoding (nmt_decoder) has no ranges except the encoder's.
 * Errors: those of nmt_prof_intern (NMT_ERR_NOMEM: the profiler's name table is full). */
nmt_status nmt_model_set_profiler(nmt_model *m, nmt_prof_track *track);

/* The range names of one training pass in the order they are pushed, phase NMT_PROF_FWD
 * (nmt_model_forward, train or not) or NMT_PROF_BWD (nmt_model_backward):
 *   fwd: encoder.embed, encoder.L.{self_attn,ffn} for L = 0.., encoder.final_ln (pre-LN),
 *        decoder.embed, decoder.L.{self_attn,cross_attn,ffn}, decoder.final_ln (pre-LN),
 *        generator.proj, generator.xent
 *   bwd: generator.proj, decoder.final_ln (pre-LN), decoder.L.{ffn,cross_attn,self_attn} for
 *        L = dec_layers-1..0, decoder.embed, encoder.final_ln (pre-LN), encoder.L.{ffn,
 *        self_attn}, encoder.embed  (the loss has no backward range: its gradient is
 *        written by the forward's fused op).
 * Each name once per list, except with cfg.checkpoint_activations: there nmt_model_backward
 * re-runs each layer's forward right before that layer's backward, so the bwd list has
 * decoder.L.{self_attn,cross_attn,ffn} (ranges of phase NMT_PROF_FWD: forward work) before
 * decoder.L.{ffn,cross_attn,self_attn} (phase NMT_PROF_BWD), and likewise encoder.L.
 * nmt_model_logits pushes the fwd list without generator.xent. Writes up to the count to
 * `out` (may be NULL; pointers valid while m lives) and returns the count (what a track
 * needs per forward + backward is the sum of both lists); 0 for NMT_PROF_OTHER. */
int nmt_model_module_names(const nmt_model *m, nmt_prof_phase phase, const char **out);

/* ---- incremental decoding ----
 * Decoder state for one batch of sentences with `beam` hypothesis rows each: the encoder output,
 * each decoder layer's cross-attention keys/values (projected once per batch) and its
 * self-attention keys/values of every position so far (one new row per hypothesis per step).
 * A step costs O(rows * (d_model^2 + t * d_model)) per layer instead of recomputing the whole
 * prefix. Everything goes through the model's backend table: caches are reordered (beam
 * search) and compacted (finished sentences) by the embedding op used as a row gather
 * (scale 1, zero positions), so any backend runs it. Buffers grow on demand and are reused by
 * later batches. */
typedef struct nmt_decoder nmt_decoder;

/* Errors: NMT_ERR_NOMEM. */
nmt_status nmt_decoder_create(nmt_model *m, nmt_decoder **out);
void nmt_decoder_destroy(nmt_decoder *d);

/* The shortest output greedy and beam search may give: EOS is not a candidate (its log p
 * still counts in the normaliser) while a hypothesis has fewer than min_len tokens, so with
 * min_len = 1 no output is empty (fairseq's min_len, whose default is 1); the length limit
 * still ends a hypothesis first. A wide beam reaches an EOS at the first step, and the empty
 * output's single log p often beats every longer hypothesis, even after the length penalty
 * (Stahlberg & Byrne 2019, "On NMT Search Errors and Model Errors: Cat Got Your Tongue?").
 * 0 (the default of a new decoder) allows the empty output. Errors: NMT_ERR_USAGE (min_len < 0). */
nmt_status nmt_decoder_set_min_len(nmt_decoder *d, int min_len);

/* Sizes the decoder's buffers (device arena, pinned host buffers, the context's scratch for
 * the steps' ops) now for batches of up to n_sent sentences of up to src_len source positions,
 * beam rows each, and up to max_steps steps, so that nmt_decoder_begin on such batches
 * allocates nothing. Buffers only grow; without it begin grows them to each batch it meets,
 * and a run of batches sorted by length regrows (and touches fresh memory) at nearly every
 * batch. Errors: NMT_ERR_USAGE (a size < 1, beam or max_steps out of begin's range),
 * NMT_ERR_NOMEM / device errors. */
nmt_status nmt_decoder_reserve(nmt_decoder *d, int n_sent, int beam, int src_len, int max_steps);

/* Ensemble decoding (Marian's --models with --weights, fairseq's --path a:b): d's later
 * batches decode with its own model and those of members[0..n) together. Each step runs every
 * model on the same hypotheses; the candidates are ranked by sum_m w_m log p_m(y | prefix, x),
 * the weighted mean of the models' log-probabilities (Marian's rule; weights[0..n] are d's then
 * the members', normalised to sum to 1; NULL: equal), and that mean is the score greedy and
 * beam search add up. The ids come from logp_topk of sum_m w_m logits_m (the same ranking: the
 * two differ by a constant per row), their scores from each model's logp_at. One model of
 * weight 1, or one model twice at 1/2 each, decodes bitwise as the model alone. A member is
 * another model's decoder (any shape) on the same backend context with the same vocabulary,
 * not itself an ensemble; member_params[i] is its model's parameters (device memory). Both
 * arrays are copied; the decoders and parameters must outlive d's batches (d does not own
 * them). begin, reserve and the steps drive the members too. n = 0 ends the ensemble. Makes
 * d's buffers anew at the next reserve or begin. Errors: NMT_ERR_USAGE (a weight not positive
 * and finite; a member that is NULL, d, an ensemble, or of another context or vocabulary size),
 * NMT_ERR_NOMEM, the backend's synchronize. */
nmt_status nmt_decoder_ensemble(nmt_decoder *d, nmt_decoder *const *members,
                                const float *const *member_params, const float *weights, int n);

/* Starts a batch: encodes b's sources (device memory, as for nmt_model_forward; the target
 * side is not read), projects the cross-attention keys/values of every decoder layer, and
 * sizes the caches for n_sent*beam rows and up to max_steps steps (1 <= max_steps <=
 * max_positions). Errors: NMT_ERR_DATA (batch larger than the model's create sizes),
 * NMT_ERR_USAGE (beam < 1, max_steps out of range), NMT_ERR_NOMEM / device errors. */
nmt_status nmt_decoder_begin(nmt_decoder *d, const float *params, const nmt_batch *b, int beam,
                             int max_steps);

/* One decoder step at position t (= steps taken since begin; BOS is normally fed at t = 0).
 * Rows: n_act active sentences x beam, row r = a*beam + j. act (n_act, host): batch indices of
 * the active sentences, strictly increasing and a subset of the previous step's (all n_sent
 * before the first step). parent (n_act*beam, host): the previous step's row whose prefix
 * row r extends (same sentence; ignored at t = 0): the caches are reordered accordingly.
 * tokens (n_act*beam, host): the token fed at position t. On return *logits points to the
 * (n_act*beam, vocab) fp32 logits in device memory, valid until the next step or begin.
 * Errors: NMT_ERR_USAGE (bad act/parent/token, or more than max_steps steps). */
nmt_status nmt_decoder_step(nmt_decoder *d, const float *params, int n_act, const int32_t *act,
                            const int32_t *parent, const int32_t *tokens, const float **logits);

/* nmt_model_greedy on a reusable decoder (same arguments and results). The best outputtable
 * id of each row is chosen on the device (the backend's logp_topk with k = 1, no
 * log-probabilities); only one id per active sentence comes back per step, into pinned memory
 * with one wait. */
nmt_status nmt_decoder_greedy(nmt_decoder *d, const float *params, const nmt_batch *b,
                              int max_out, int extra_len, int32_t *out_ids, int32_t *out_lens);

/* Beam search (Vaswani et al. 2017 §6.1: beam 4, length penalty alpha 0.6, max output length
 * = input length + 50) over the sources of b (src/model/beam.c); outputs as nmt_model_greedy,
 * plus out_scores (n_sent, host, may be NULL): the chosen hypothesis' length-normalised score.
 * Per sentence: at each step every live hypothesis y is extended by the tokens of highest
 * log p (ties: lower id; never <pad> or <s>, whose log p still count in the normalisation),
 * scored s(y) = sum log p(y_t | y_<t, x) (each log p the fp32 of the backend's logp_topk,
 * summed in double). Which candidates survive is `rule`:
 * - NMT_BEAM_SHRINK: the best k = beam - (number of finished hypotheses) candidates (the beam
 *   shrinks as hypotheses finish, as in Marian); with beam = 1 this is exactly greedy decoding.
 * - NMT_BEAM_FULL: of the best 2 x beam candidates, an EOS within the first beam finishes and
 *   the best beam that do not end live on, so every step keeps beam live hypotheses (fairseq's
 *   sequence generator, CTranslate2).
 * A candidate ending in EOS is finished with the score s(y) / lp(|y|), where |y| counts its
 * tokens including EOS and lp(n) = ((5 + n) / 6)^alpha (Wu et al. 2016, eq. 14); a live
 * hypothesis that reaches the length limit is finished without EOS (|y| = limit). A sentence
 * stops when beam hypotheses have finished (under full as fairseq's `len(finalized) ==
 * beam_size`), or earlier when no live hypothesis can still beat the best finished one
 * (s(y) / lp(limit) bounds what it can reach, log p <= 0 and alpha >= 0), which does not
 * change the result. The output is the finished hypothesis with the
 * highest normalised score (earliest on ties), without EOS. Per step only the selection (R x k
 * ids and log-probabilities, k = beam or 2 x beam) crosses to the host. Errors: as
 * nmt_decoder_begin; NMT_ERR_USAGE (beam outside [1, NMT_TOPK_MAX / 2], alpha outside [0, 100],
 * an unknown rule). */
nmt_status nmt_decoder_beam(nmt_decoder *d, const float *params, const nmt_batch *b, int beam,
                            float alpha, nmt_beam_rule rule, int max_out, int extra_len,
                            int32_t *out_ids, int32_t *out_lens, float *out_scores);

/* nmt_decoder_beam keeping the nbest (1 <= nbest <= beam) finished hypotheses of each sentence,
 * best first (normalised score; earliest on ties): out_ids (n_sent, nbest, max_out), out_lens
 * and out_scores / out_logp (n_sent, nbest; may be NULL): the normalised score s(y) / lp(|y|)
 * and the log-probability s(y) = log p(y | x) in nats (EOS included when it ended the
 * hypothesis); out_n (n_sent; may be NULL): how many were found (nbest except on a vocabulary
 * too small to fill the beam); the rest of each sentence's slots are empty (length 0). The
 * early stop waits until no live hypothesis can enter the nbest, so with nbest = 1 this is
 * nmt_decoder_beam exactly. Errors: as nmt_decoder_beam, NMT_ERR_USAGE (nbest outside
 * [1, beam]). */
nmt_status nmt_decoder_beam_nbest(nmt_decoder *d, const float *params, const nmt_batch *b,
                                  int beam, float alpha, nmt_beam_rule rule, int max_out,
                                  int extra_len, int nbest, int32_t *out_ids, int32_t *out_lens,
                                  int32_t *out_n, float *out_scores, float *out_logp);

#ifdef __cplusplus
}
#endif
#endif /* NMT_MODEL_H */
