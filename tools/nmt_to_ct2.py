#!/usr/bin/env python3
"""nmt_to_ct2.py: nmt's safetensors export as a CTranslate2 model.

  nmt_to_ct2.py [--quantization Q] MODEL.safetensors SPM.model|SPM.vocab OUT_DIR

`nmt export --format ctranslate2` runs it (src/engine/export_ct2.c), and so does
bench/ctranslate2.sh. MODEL.safetensors is `nmt export CKPT MODEL.safetensors` (layout:
docs/formats.md "safetensors export"); SPM.model is the SentencePiece model the model was
trained with (read with the sentencepiece module), or SPM.vocab its vocabulary (one piece per
line, the id is the line number); ids 0-3 must be <pad> <unk> <s> </s>. OUT_DIR receives the
CTranslate2 model (model.bin, config.json, shared_vocabulary.json), replaced if it exists; Q is
CTranslate2's weight quantization (int8, int8_float32, int8_float16, int8_bfloat16, int16,
float16, bfloat16, float32; default: none, fp32 as exported).
Exit status: 0 done, 2 bad arguments, 9 a Python module missing (ctranslate2, numpy,
sentencepiece: the message names the pip package; nmt's "missing dependency"), 1 any other
failure (the traceback says which).

The model is built with CTranslate2's own converter API: NmtConverter subclasses
ctranslate2.converters.Converter (whose convert() validates, quantizes and writes the model) and
fills a ctranslate2.specs TransformerSpec; no model-specific converter of CTranslate2's fits
nmt's layout. The mapping onto the spec:
- pre-LN (`norm = pre`, Xiong et al. 2020) or post-LN (the paper's §3.1) is `pre_norm`; the
  stacks' final LayerNorms (`{encoder,decoder}.ln_f`, pre-LN only) are the specs' layer_norm;
  LayerNorm epsilon is the export's `ln_eps`.
- one embedding matrix `embed.weight` (V, C) serves as the source embedding, the target
  embedding and the output projection (§3.4): it is given to all three (no output bias), and
  both stacks scale embeddings by sqrt(C) (`scale_embeddings`, the spec's default).
- the positions are nmt's sinusoids exactly (§3.5: PE[pos, 2i] = sin, PE[pos, 2i+1] = cos,
  interleaved, computed in double, stored fp32), given as the spec's `encodings` for positions
  0..max_positions-1: CTranslate2's own sinusoid table is laid out [sin | cos] (its Marian
  converter), which would not match.
- attention: self-attention's fused rows [W_q; W_k; W_v] are linear[0] as they are (the spec
  concatenates q, k, v along the output dimension); cross-attention's q is linear[0] and its
  [W_k; W_v] linear[1]; the output projection is the last linear. Heads are contiguous blocks of
  C / n_heads, scores scaled by 1/sqrt(d_k), as both do.
- feed-forward: fc1 -> ReLU -> fc2 is linear_0, linear_1.
Greedy decoding of both on the same ids is the mapping's test (test/test_export_ct2.c;
bench/ctranslate2.sh reports the fraction of token-identical outputs).
"""
import argparse
import json
import math
import struct
import sys

MISSING_DEPENDENCY = 9  # nmt's exit code for it (include/nmt/status.h)

try:
    import numpy as np
    from ctranslate2.converters.converter import Converter
    from ctranslate2.specs import common_spec, transformer_spec
except ImportError as e:
    sys.stderr.write("nmt_to_ct2: Python module %s missing (%s): install it with "
                     "tools/install-deps.sh --bleu, or pip install ctranslate2\n"
                     % (e.name, sys.executable))
    sys.exit(MISSING_DEPENDENCY)

QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16",
                 "bfloat16", "float32")


def read_safetensors(path):
    """(tensors by name as fp32 numpy arrays, metadata dict) of an nmt export."""
    with open(path, "rb") as f:
        data = bytearray(f.read())  # writable: quantization converts the arrays in place
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    tensors = {}
    for name, t in header.items():
        if t["dtype"] != "F32":
            raise ValueError("%s: tensor %s is %s, expected F32" % (path, name, t["dtype"]))
        b, e = t["data_offsets"]
        tensors[name] = np.frombuffer(data[base + b : base + e], dtype="<f4").reshape(t["shape"])
    return tensors, meta


def sinusoids(max_positions, d_model):
    """nmt's position table, with the expressions of src/model/transformer.c
    (upload_sinusoids) in double through the C library's pow, sin and cos, rounded to fp32."""
    pe = np.zeros((max_positions, d_model), dtype=np.float64)
    for c in range(d_model):
        freq = math.pow(10000.0, -float(c & ~1) / float(d_model))
        trig = math.cos if c & 1 else math.sin
        for pos in range(max_positions):
            pe[pos, c] = trig(float(pos) * freq)
    return pe.astype(np.float32)


def set_linear(spec, w, b):
    spec.weight = np.ascontiguousarray(w)
    if b is not None:
        spec.bias = np.ascontiguousarray(b)


def set_ln(spec, t, name):
    spec.gamma = t[name + ".weight"]
    spec.beta = t[name + ".bias"]


def set_self_attention(att, t, p):
    """Layer prefix p's first LayerNorm and its fused QKV and output projections."""
    set_ln(att.layer_norm, t, p + "ln1")
    set_linear(att.linear[0], t[p + "self_attn.qkv.weight"], t[p + "self_attn.qkv.bias"])
    set_linear(att.linear[1], t[p + "self_attn.out.weight"], t[p + "self_attn.out.bias"])


def read_pieces(path):
    """The pieces by id of a SentencePiece model (*.model) or of its vocabulary (*.vocab)."""
    if path.endswith(".model"):
        try:
            import sentencepiece
        except ImportError:
            sys.stderr.write("nmt_to_ct2: Python module sentencepiece missing (%s): install it "
                             "with tools/install-deps.sh --bleu, or pip install sentencepiece\n"
                             % sys.executable)
            sys.exit(MISSING_DEPENDENCY)
        sp = sentencepiece.SentencePieceProcessor(model_file=path)
        return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    with open(path, encoding="utf-8") as f:
        return [line.split("\t")[0] for line in f if line.strip("\n")]


class NmtConverter(Converter):
    def __init__(self, model_path, vocab_path):
        self.model_path = model_path
        self.vocab_path = vocab_path

    def _load(self):
        t, meta = read_safetensors(self.model_path)
        if meta.get("producer") != "nmt":
            raise ValueError("%s: not an nmt export (producer %r)" % (self.model_path,
                                                                       meta.get("producer")))
        c = int(meta["d_model"])
        heads = int(meta["n_heads"])
        enc_layers, dec_layers = int(meta["enc_layers"]), int(meta["dec_layers"])
        pre = meta["norm"] == "pre"
        pieces = read_pieces(self.vocab_path)
        if len(pieces) != int(meta["vocab"]):
            raise ValueError("%s has %d pieces, the model's vocab is %s"
                             % (self.vocab_path, len(pieces), meta["vocab"]))
        if pieces[:4] != ["<pad>", "<unk>", "<s>", "</s>"]:
            raise ValueError("%s: ids 0-3 are %s, expected <pad> <unk> <s> </s>"
                             % (self.vocab_path, pieces[:4]))
        spec = transformer_spec.TransformerSpec.from_config(
            (enc_layers, dec_layers), heads, pre_norm=pre,
            activation=common_spec.Activation.RELU)
        spec.config.layer_norm_epsilon = float(meta["ln_eps"])
        spec.config.decoder_start_token = "<s>"
        embed = t["embed.weight"]
        pe = sinusoids(int(meta["max_positions"]), c)
        enc, dec = spec.encoder, spec.decoder
        enc.embeddings[0].weight = embed
        dec.embeddings.weight = embed
        dec.projection.weight = embed
        enc.position_encodings.encodings = pe
        dec.position_encodings.encodings = pe
        if pre:
            set_ln(enc.layer_norm, t, "encoder.ln_f")
            set_ln(dec.layer_norm, t, "decoder.ln_f")
        for i, layer in enumerate(enc.layer):
            p = "encoder.layers.%d." % i
            set_self_attention(layer.self_attention, t, p)
            set_ln(layer.ffn.layer_norm, t, p + "ln2")
            set_linear(layer.ffn.linear_0, t[p + "ffn.fc1.weight"], t[p + "ffn.fc1.bias"])
            set_linear(layer.ffn.linear_1, t[p + "ffn.fc2.weight"], t[p + "ffn.fc2.bias"])
        for i, layer in enumerate(dec.layer):
            p = "decoder.layers.%d." % i
            set_self_attention(layer.self_attention, t, p)
            set_ln(layer.attention.layer_norm, t, p + "ln2")
            set_linear(layer.attention.linear[0], t[p + "cross_attn.q.weight"],
                       t[p + "cross_attn.q.bias"])
            set_linear(layer.attention.linear[1], t[p + "cross_attn.kv.weight"],
                       t[p + "cross_attn.kv.bias"])
            set_linear(layer.attention.linear[2], t[p + "cross_attn.out.weight"],
                       t[p + "cross_attn.out.bias"])
            set_ln(layer.ffn.layer_norm, t, p + "ln3")
            set_linear(layer.ffn.linear_0, t[p + "ffn.fc1.weight"], t[p + "ffn.fc1.bias"])
            set_linear(layer.ffn.linear_1, t[p + "ffn.fc2.weight"], t[p + "ffn.fc2.bias"])
        spec.register_source_vocabulary(pieces)
        spec.register_target_vocabulary(pieces)
        return spec


def main(argv):
    ap = argparse.ArgumentParser(prog="nmt_to_ct2.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default=None)
    ap.add_argument("model")
    ap.add_argument("spm")
    ap.add_argument("out_dir")
    a = ap.parse_args(argv[1:])
    NmtConverter(a.model, a.spm).convert(a.out_dir, quantization=a.quantization, force=True)
    print("nmt_to_ct2: %s -> %s (%s)" % (a.model, a.out_dir, a.quantization or "float32"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
