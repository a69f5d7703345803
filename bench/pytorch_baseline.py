#!/usr/bin/python3
"""pytorch_baseline.py — the PyTorch baseline of bench/cpu-throughput.sh (CPU) and
bench/gpu-compare.sh (GPU): nmt's model, trained from nmt's initial weights on the batches
`nmt train` uses, timed the same way.

    python3 bench/pytorch_baseline.py --batches B.bin --params P.bin \
        --config conf/bible-small.ini [section.key=value ...] [--mode eager|compile] \
        [--compile-mode max-autotune-no-cudagraphs] [--attention auto|sdpa|manual] \
        [--device cpu|cuda] [--precision fp32|tf32|fp16|bf16] [--threads 2] [--warmup 5] \
        [--result R.json] [--check-metrics nmt/metrics.jsonl] [--mem-cap-gib 24]

Inputs come from bench/dump_batches (the file formats are in its header comment): the batches
of the first N optimizer steps in the trainer's order, K = devices * accum_steps per step, and
nmt_model_init_params(run.seed) in nmt's flat layout. The training hyperparameters are read
from `nmt config --dump CONFIG overrides...` (the same effective config `nmt train` uses).

Same model (Vaswani et al. 2017 §3, include/nmt/model.h): encoder-decoder, fused QKV and
cross-attention KV projections, ReLU FFN, sinusoidal positions, embeddings scaled by
sqrt(d_model), one embedding matrix tied to the output projection, post-LN (or pre-LN with a
final LayerNorm per stack), dropout on embedding sums, sublayer outputs, attention weights and
FFN activations with the config's rates (torch's own masks: they differ from nmt's Philox
masks, which only matters for the loss check, run with dropout 0). Attention: where torch has
F.scaled_dot_product_attention (>= 2.0; fused flash / memory-efficient kernels on CUDA), the
encoder and cross-attention pass the source key-padding mask and the decoder's self-attention
is_causal=True alone (see Transformer.forward for why that is exact); on older torch (Debian's
1.13 on the dev box) the hand-written matmul, masked_fill, softmax, matmul (--attention).
Parameters are resolved once at setup into tuples the forward unpacks. Loss: label-smoothed
cross entropy (torch's definition, PAD ignored, always computed in fp32) summed over the step's
K batches and divided by the step's target tokens; gradients accumulate over the K
micro-batches, then one Adam step (beta1, beta2, eps from the config; AdamW if weight_decay >
0; clipping if clip_norm > 0) with the paper's schedule (eq. 3) times lr_scale.

Device and precision (defaults: --device cpu --precision fp32, everything fp32, eager):
  fp32  fp32 everywhere; on CUDA with TF32 off (torch.set_float32_matmul_precision("highest")).
  tf32  CUDA: float32 matmuls on TF32 tensor cores (set_float32_matmul_precision("high"));
        CPU: same as fp32 (nmt's CPU reference also computes tf32 as fp32).
  fp16  CUDA only: eager AMP, torch.autocast(device_type="cuda", dtype=torch.float16) around
        the forward and loss, fp32 master weights, and a GradScaler with nmt's precision.*
        keys: init_scale = loss_scale, growth_interval, backoff_factor = backoff, growth x2.
  bf16  torch.autocast(dtype=torch.bfloat16) on CUDA or CPU, no scaler.
On CUDA, Adam/AdamW use fused=True where the installed torch has it, batches are copied from
pinned host memory each micro-batch (non_blocking), and steps are timed with CUDA events
around each step, synchronising once at the end of the run (losses are read then, so no
step waits for the host). --mode compile wraps the model (forward + loss) in
torch.compile(mode=--compile-mode, dynamic=True, fullgraph=True); compilation happens in the
first steps, which --warmup must cover: the result's compile_s estimates it (warmup steps'
time minus warmup x the median timed step), and dynamo's counters are snapshotted at the end
of the warmup and compared after the timed steps (recompiles_in_timed_steps, printed as a
WARNING when not 0). A compile that fails (at torch.compile or inside a step) writes
{"failed": why} to --result and exits 3.
Peak memory: CUDA torch.cuda.max_memory_allocated (and _reserved); CPU the process's peak
resident set (getrusage), as nmt reports on CPU workers.

Throughput excludes the first --warmup steps: target tokens of steps [warmup, N) divided by
their wall time. This is the figure bench/RESULTS.md compares with nmt's.

Loss check (--check-metrics): per-step train_loss against nmt's metrics.jsonl (log_every=1),
to --rtol (default 1e-4, relative; bench/gpu-compare.sh passes 1e-6) in fp32, and to --atol
(default 5e-2 nats, absolute) in tf32/fp16/bf16, where the comparison is with nmt run in the
same precision (rounding sites differ: autocast also runs attention's batched matmuls in half,
nmt only its GEMMs); and each step's grad_norm (the global L2 norm of the per-token gradient
before clipping, unscaled; here in float64) to --grad-rtol at step 1 (default 2e-5 in fp32,
5e-2 otherwise) and --grad-rtol-later after (1e-4, 5e-2). Run it with train.warmup_steps=1 and
lr_scale / sqrt(the config's warmup_steps), as bench/gpu-compare.sh does, so that step 1 makes
a full-size update at the schedule's peak lr and steps 2.. show a wrong gradient.

Exit status: 0 done (or --mode compile skipped: torch < 2.0), 1 loss check mismatch or error,
2 usage (e.g. --device cuda without a CUDA device: "no CUDA device"), 3 torch.compile failed
(--mode compile), 4 out of memory (torch.cuda.OutOfMemoryError; the --biggest-batch search
of bench/gpu-compare.sh reads it as nmt's exit code 4).
"""
import argparse
import configparser
import contextlib
import importlib.util
import json
import math
import os
import resource
import statistics
import struct
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

PAD = 0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------
# inputs


def read_params(path):
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"NMTPARM1":
        sys.exit("%s: bad magic (expected NMTPARM1)" % path)
    (version,) = struct.unpack_from("<I", data, 8)
    if version != 1:
        sys.exit("%s: version %d, expected 1" % (path, version))
    off = 12
    keys = ("vocab", "d_model", "n_heads", "d_ff", "enc_layers", "dec_layers", "max_positions",
            "norm", "n_tensors")
    cfg = dict(zip(keys, struct.unpack_from("<9i", data, off)))
    off += 36
    (cfg["ln_eps"],) = struct.unpack_from("<f", data, off)
    off += 4
    (cfg["seed"],) = struct.unpack_from("<Q", data, off)
    off += 8
    table = []
    for _ in range(cfg["n_tensors"]):
        name = data[off:off + 80].rstrip(b"\0").decode()
        ndim, s0, s1, toff, numel = struct.unpack_from("<3iQQ", data, off + 80)
        off += 80 + 28
        table.append((name, (s0,) if ndim == 1 else (s0, s1), toff, numel))
    (n_params,) = struct.unpack_from("<Q", data, off)
    off += 8
    flat = np.frombuffer(data, dtype="<f4", count=n_params, offset=off).copy()
    if off + 4 * n_params != len(data):
        sys.exit("%s: %d trailing bytes" % (path, len(data) - off - 4 * n_params))
    return cfg, table, flat


def read_batches(path):
    """Returns (header dict, steps): steps[s] is a list of K dicts of int64 tensors."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"NMTBTCH1":
        sys.exit("%s: bad magic (expected NMTBTCH1)" % path)
    (version,) = struct.unpack_from("<I", data, 8)
    if version != 1:
        sys.exit("%s: version %d, expected 1" % (path, version))
    keys = ("n_steps", "K", "devices", "accum_steps", "max_tokens", "max_len", "vocab")
    hdr = dict(zip(keys, struct.unpack_from("<7i", data, 12)))
    (hdr["seed"],) = struct.unpack_from("<Q", data, 40)
    off = 48
    steps = []
    for s in range(hdr["n_steps"]):
        step = []
        for k in range(hdr["K"]):
            ns, sl, tl, kk = struct.unpack_from("<4i", data, off)
            st, ep, idx, bid, src_tok, tgt_tok = struct.unpack_from("<6q", data, off + 16)
            off += 64
            if kk != k or st != s:
                sys.exit("%s: record (step %d, k %d) found where (%d, %d) was expected"
                         % (path, st, kk, s, k))

            def take(n, shape):
                nonlocal off
                a = np.frombuffer(data, dtype="<i4", count=n, offset=off)
                off += 4 * n
                return torch.from_numpy(a.astype(np.int64).reshape(shape))

            b = dict(src=take(ns * sl, (ns, sl)), tgt_in=take(ns * tl, (ns, tl)),
                     tgt_out=take(ns * tl, (ns, tl)), src_lens=take(ns, (ns,)),
                     tgt_lens=take(ns, (ns,)), tgt_tokens=tgt_tok, src_tokens=src_tok,
                     epoch=ep, index=idx, batch_id=bid)
            if int((b["tgt_out"] != PAD).sum()) != tgt_tok:
                sys.exit("%s: step %d batch %d: %d non-pad targets, header says %d"
                         % (path, s, k, int((b["tgt_out"] != PAD).sum()), tgt_tok))
            step.append(b)
        steps.append(step)
    if off != len(data):
        sys.exit("%s: %d trailing bytes" % (path, len(data) - off))
    return hdr, steps


def effective_config(nmt, conf, overrides):
    """The config `nmt train CONF overrides` would run with, from `nmt config --dump`."""
    out = subprocess.run([nmt, "config", "--dump", conf] + overrides, check=True,
                         stdout=subprocess.PIPE, universal_newlines=True).stdout
    cp = configparser.ConfigParser(comment_prefixes=(";",), inline_comment_prefixes=None)
    cp.read_string(out)
    return cp


def fixture_module():
    """tools/make-fixture.py (the golden test's independent PyTorch twin), or None."""
    path = os.path.join(ROOT, "tools", "make-fixture.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("make_fixture", path)
    mf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mf)
    return mf


# ---------------------------------------------------------------------------------------------
# the model


def sinusoids(n_pos, C):
    """§3.5 in float64, stored in float32 as nmt stores it."""
    pos = torch.arange(n_pos, dtype=torch.float64).view(-1, 1)
    c = torch.arange(C)
    freq = torch.pow(torch.tensor(10000.0, dtype=torch.float64), -(c - c % 2).double() / C)
    ang = pos * freq
    return torch.where(c % 2 == 1, torch.cos(ang), torch.sin(ang)).float()


# torch >= 2.0: one fused attention op (flash / memory-efficient kernels on CUDA).
HAVE_SDPA = hasattr(F, "scaled_dot_product_attention")

ENC_SUBLAYERS = ("self_attn.qkv", "self_attn.out", "ffn.fc1", "ffn.fc2", "ln1", "ln2")
DEC_SUBLAYERS = ("self_attn.qkv", "self_attn.out", "cross_attn.q", "cross_attn.kv",
                 "cross_attn.out", "ffn.fc1", "ffn.fc2", "ln1", "ln2", "ln3")


class Transformer(torch.nn.Module):
    def __init__(self, mcfg, table, flat, drop, attn_drop, relu_drop, label_smoothing,
                 device, sdpa):
        super().__init__()
        self.cfg = mcfg
        self.C, self.H = mcfg["d_model"], mcfg["n_heads"]
        self.drop, self.attn_drop, self.relu_drop = drop, attn_drop, relu_drop
        self.label_smoothing = label_smoothing
        self.sdpa = sdpa
        # Created on the device: the resolved lists below hold these very Parameter objects.
        self.params = torch.nn.ParameterDict()
        for name, shape, off, numel in table:
            t = torch.from_numpy(flat[off:off + numel].reshape(shape).copy()).to(device)
            self.params[name.replace(".", "__")] = torch.nn.Parameter(t)
        self.register_buffer("pe", sinusoids(mcfg["max_positions"], self.C).to(device))
        # Every parameter resolved once: the forward unpacks tuples of (weight, bias) pairs in
        # ENC_SUBLAYERS / DEC_SUBLAYERS order and looks up no name (a plain dict, so that
        # nn.Module does not register the tensors a second time).
        p = self.params

        def wb(prefix):
            return (p[prefix.replace(".", "__") + "__weight"],
                    p[prefix.replace(".", "__") + "__bias"])

        self.w = dict(
            embed=p["embed__weight"],
            enc=[tuple(wb("encoder.layers.%d.%s" % (l, s)) for s in ENC_SUBLAYERS)
                 for l in range(mcfg["enc_layers"])],
            dec=[tuple(wb("decoder.layers.%d.%s" % (l, s)) for s in DEC_SUBLAYERS)
                 for l in range(mcfg["dec_layers"])],
            enc_ln_f=wb("encoder.ln_f") if mcfg["norm"] == 1 else None,
            dec_ln_f=wb("decoder.ln_f") if mcfg["norm"] == 1 else None)

    def ln(self, x, w):
        return F.layer_norm(x, (self.C,), w[0], w[1], self.cfg["ln_eps"])

    def attention(self, q, k, v, mask, causal):
        """mask: the hand-written path's (B|1, 1, Tq|1, Tk) True = masked out (key padding,
        and for the decoder's self-attention key padding | causal); SDPA's (B, 1, 1, Tk)
        True = takes part, or None with causal (see forward)."""
        B, Tq, C = q.shape
        Tk, H = k.shape[1], self.H
        dk = C // H
        q = q.view(B, Tq, H, dk).transpose(1, 2)
        k = k.view(B, Tk, H, dk).transpose(1, 2)
        v = v.view(B, Tk, H, dk).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.attn_drop if self.training else 0.0,
                is_causal=causal)
            return y.transpose(1, 2).reshape(B, Tq, C)
        s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(dk))
        pr = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
        pr = F.dropout(pr, self.attn_drop, self.training)
        return torch.matmul(pr, v).transpose(1, 2).reshape(B, Tq, C)

    def sub(self, x, fn, ln_w):
        if self.cfg["norm"] == 0:
            return self.ln(x + F.dropout(fn(x), self.drop, self.training), ln_w)
        return x + F.dropout(fn(self.ln(x, ln_w)), self.drop, self.training)

    def self_attn(self, x, qkv_w, out_w, mask, causal):
        C = self.C
        qkv = F.linear(x, *qkv_w)
        y = self.attention(qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:], mask, causal)
        return F.linear(y, *out_w)

    def cross_attn(self, x, mem, q_w, kv_w, out_w, mask):
        C = self.C
        q = F.linear(x, *q_w)
        kv = F.linear(mem, *kv_w)
        y = self.attention(q, kv[..., :C], kv[..., C:], mask, False)
        return F.linear(y, *out_w)

    def ffn(self, x, fc1_w, fc2_w):
        h = F.dropout(F.relu(F.linear(x, *fc1_w)), self.relu_drop, self.training)
        return F.linear(h, *fc2_w)

    def embed(self, ids):
        x = F.embedding(ids, self.w["embed"]) * math.sqrt(self.C) + self.pe[:ids.shape[1]]
        return F.dropout(x, self.drop, self.training)

    def forward(self, src, src_lens, tgt_in, tgt_lens, tgt_out):
        """Summed label-smoothed loss over the batch's non-pad target tokens."""
        Ts, Tt, dev = src.shape[1], tgt_in.shape[1], src.device
        if self.sdpa:
            # Key padding for the encoder and the cross-attention; the decoder's
            # self-attention is causal alone. Targets are right-padded, so a non-pad query i <
            # tgt_len sees keys j <= i < tgt_len, all non-pad: the same rows as nmt's
            # key-padding | causal mask (src/ref/attention.c key_limit). Pad query rows differ
            # (they see pad keys), but they feed nothing: the loss ignores them, they are keys
            # only of later pad rows, and their gradient is exactly zero.
            # The mask is made Ts8 = Ts rounded up to a multiple of 8 wide and sliced to Ts:
            # its rows then start at multiples of 8 elements whatever Ts is. The
            # memory-efficient kernel wants the bias's row stride aligned: a mask Ts wide, Ts
            # not a multiple of 8, can fail there with "attn_bias is not correctly aligned" or,
            # under torch.compile(dynamic=True), make the graph recompile for the padding.
            Ts8 = (Ts + 7) // 8 * 8
            src_mask = (torch.arange(Ts8, device=dev).view(1, 1, 1, Ts8) <
                        src_lens.view(-1, 1, 1, 1))[..., :Ts]
            tgt_mask = None
        else:
            src_pad = (torch.arange(Ts, device=dev).view(1, 1, 1, Ts) >=
                       src_lens.view(-1, 1, 1, 1))
            causal = (torch.arange(Tt, device=dev).view(1, Tt) >
                      torch.arange(Tt, device=dev).view(Tt, 1))
            src_mask = src_pad
            tgt_mask = ((torch.arange(Tt, device=dev).view(1, 1, 1, Tt) >=
                         tgt_lens.view(-1, 1, 1, 1)) | causal)
        w = self.w
        x = self.embed(src)
        for qkv, out, fc1, fc2, ln1, ln2 in w["enc"]:
            x = self.sub(x, lambda y: self.self_attn(y, qkv, out, src_mask, False), ln1)
            x = self.sub(x, lambda y: self.ffn(y, fc1, fc2), ln2)
        if w["enc_ln_f"] is not None:
            x = self.ln(x, w["enc_ln_f"])
        mem = x
        x = self.embed(tgt_in)
        for qkv, out, xq, xkv, xout, fc1, fc2, ln1, ln2, ln3 in w["dec"]:
            x = self.sub(x, lambda y: self.self_attn(y, qkv, out, tgt_mask, self.sdpa), ln1)
            x = self.sub(x, lambda y: self.cross_attn(y, mem, xq, xkv, xout, src_mask), ln2)
            x = self.sub(x, lambda y: self.ffn(y, fc1, fc2), ln3)
        if w["dec_ln_f"] is not None:
            x = self.ln(x, w["dec_ln_f"])
        # The loss in fp32 whatever the autocast dtype (a no-op in fp32): a half-precision sum
        # over thousands of tokens would lose the digits the loss check compares.
        logits = F.linear(x, w["embed"]).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt_out.reshape(-1),
                               ignore_index=PAD, label_smoothing=self.label_smoothing,
                               reduction="sum")


def train_flops(mcfg, b):
    """Model FLOPs of one training pass (forward + backward) over batch b: 3x the forward's
    matrix-multiply FLOPs (2*M*K*N each; backward = 2x forward) on the padded shapes, as
    nmt and this baseline both compute every padded position. Elementwise work is left out
    (the usual MFU convention; Kaplan et al. 2020 §2.1, Chowdhery et al. 2022 App. B)."""
    B, Ts = b["src"].shape
    Tt = b["tgt_in"].shape[1]
    C, Fd, V = mcfg["d_model"], mcfg["d_ff"], mcfg["vocab"]
    ns, nt = B * Ts, B * Tt
    enc = 2 * ns * C * 3 * C + 2 * ns * C * C + 4 * B * Ts * Ts * C + 4 * ns * C * Fd
    dec = (2 * nt * C * 3 * C + 2 * nt * C * C + 4 * B * Tt * Tt * C          # self-attention
           + 2 * nt * C * C + 2 * ns * C * 2 * C + 2 * nt * C * C + 4 * B * Tt * Ts * C  # cross
           + 4 * nt * C * Fd)                                                  # FFN
    fwd = mcfg["enc_layers"] * enc + mcfg["dec_layers"] * dec + 2 * nt * C * V
    return 3 * fwd


def lr_at(step, d_model, lr_scale, warmup):
    """Vaswani et al. 2017 eq. 3 times lr_scale (nmt_lr_at); step >= 1."""
    s, w = max(step, 1), max(warmup, 1)
    return lr_scale / math.sqrt(d_model) * min(s ** -0.5, s * w ** -1.5)


# ---------------------------------------------------------------------------------------------


def oom_types():
    """Exception types that mean "out of memory" on the installed torch (CUDA and host)."""
    t = [MemoryError]
    if hasattr(torch.cuda, "OutOfMemoryError"):  # torch >= 1.13
        t.append(torch.cuda.OutOfMemoryError)
    return tuple(t)


def is_oom(e):
    if isinstance(e, oom_types()):
        return True
    # Older torch raises a plain RuntimeError from the CUDA caching allocator; the CPU
    # allocator always does ("DefaultCPUAllocator: can't allocate memory").
    return isinstance(e, RuntimeError) and ("out of memory" in str(e)
                                            or "can't allocate memory" in str(e))


def make_grad_scaler(init_scale, growth_interval, backoff):
    """PyTorch's dynamic loss scaler with nmt's precision.* settings (nmt doubles the scale
    after growth_interval clean steps and multiplies it by backoff on overflow)."""
    kw = dict(init_scale=init_scale, growth_factor=2.0, backoff_factor=backoff,
              growth_interval=growth_interval)
    amp = getattr(torch, "amp", None)
    if amp is not None and hasattr(amp, "GradScaler"):  # torch >= 2.3
        return amp.GradScaler("cuda", **kw)
    return torch.cuda.amp.GradScaler(**kw)


def write_result(path, obj):
    if path:
        with open(path, "w") as f:
            json.dump(obj, f)


def compile_model(model, mode):
    """torch.compile for the whole forward + loss: one graph (fullgraph=True: a graph break is
    an error, not a silent split), dynamic shapes from the first call (dynamic=True: every
    micro-batch has its own (B, Ts, Tt), so a static graph would recompile until dynamo turned
    dynamic by itself), and `mode` (max-autotune-no-cudagraphs: autotuned GEMM and fusion
    choices; no CUDA graphs, which would record one graph per shape). Returns (the compiled
    module, the settings applied)."""
    import torch._dynamo
    settings = dict(mode=mode, dynamic=True, fullgraph=True)
    # Past the recompile limit dynamo runs the frame eagerly, silently: make that an error, so
    # that a "compiled" figure is never eager's.
    for key in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, True)
            settings[key] = True
            break
    # Shapes symbolic, but not Python floats: with dynamic=True dynamo would also make the
    # module's dropout rates, LayerNorm eps and label smoothing graph inputs, and a dropout
    # whose rate is not known to be 0 at compile time draws its random mask anyway.
    if hasattr(torch._dynamo.config, "specialize_float"):
        torch._dynamo.config.specialize_float = True
        settings["specialize_float"] = True
    # Duck shaping gives equal sizes of the first call one symbol (Ts == Tt, or B == Ts, is
    # common in length-bucketed batches) and guards on the equality, so a later batch where
    # they differ recompiles. One symbol per dimension instead.
    try:
        import torch.fx.experimental._config as fx_config
        if hasattr(fx_config, "use_duck_shape"):
            fx_config.use_duck_shape = False
            settings["use_duck_shape"] = False
    except ImportError:
        pass
    return torch.compile(model, mode=mode, dynamic=True, fullgraph=True), settings


def dynamo_counters():
    """A copy of dynamo's counters ({group: {name: count}}); {} where there are none."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {str(k): {str(kk): int(vv) for kk, vv in v.items()} for k, v in counters.items()}


def counters_delta(before, after):
    d = {}
    for k, v in after.items():
        for kk, vv in v.items():
            n = vv - before.get(k, {}).get(kk, 0)
            if n:
                d.setdefault(k, {})[kk] = n
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", required=True)
    ap.add_argument("--params", required=True)
    ap.add_argument("--config", required=True, help="nmt config file (plus overrides)")
    ap.add_argument("overrides", nargs="*", help="section.key=value, as for nmt train")
    ap.add_argument("--nmt", default=os.path.join(ROOT, "build", "nmt"))
    ap.add_argument("--mode", choices=("eager", "compile"), default="eager")
    ap.add_argument("--compile-mode", default="max-autotune-no-cudagraphs",
                    help="torch.compile's mode with --mode compile (default "
                    "max-autotune-no-cudagraphs; \"default\" for inductor's default)")
    ap.add_argument("--attention", choices=("auto", "sdpa", "manual"), default="auto",
                    help="sdpa: F.scaled_dot_product_attention; manual: matmul, masked_fill, "
                    "softmax; auto (default): sdpa where the installed torch has it (>= 2.0)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--precision", choices=("fp32", "tf32", "fp16", "bf16"), default="fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=0, help="0 = every step in the batch file")
    ap.add_argument("--result", help="write the measured figures as JSON here")
    ap.add_argument("--check-metrics", help="nmt metrics.jsonl (log_every=1) to compare "
                    "per-step train_loss with; exit 1 if a step differs by more than --rtol "
                    "(fp32) or --atol (tf32, fp16, bf16)")
    ap.add_argument("--rtol", type=float, default=1e-4,
                    help="fp32 loss check: relative tolerance (default 1e-4)")
    ap.add_argument("--atol", type=float, default=5e-2,
                    help="tf32/fp16/bf16 loss check: absolute tolerance in nats (default 5e-2)")
    ap.add_argument("--grad-rtol", type=float,
                    help="loss check: relative tolerance on step 1's grad_norm (default 2e-5 "
                    "in fp32, where nmt's %%.6g print alone rounds by up to 5e-6; 5e-2 in "
                    "tf32/fp16/bf16)")
    ap.add_argument("--grad-rtol-later", type=float,
                    help="loss check: relative tolerance on the grad_norm of steps 2.. "
                    "(default 1e-4 in fp32, 5e-2 in tf32/fp16/bf16)")
    ap.add_argument("--mem-cap-gib", type=float, default=0,
                    help="CUDA: cap this process's allocations at this many GiB "
                    "(torch.cuda.set_per_process_memory_fraction), to emulate a smaller card")
    ap.add_argument("--profile", action="store_true",
                    help="run the last step under torch.autograd.profiler and print its ops (CPU)")
    args = ap.parse_args()
    # Step 1 compares the gradients of identical parameters: nmt's 6-digit print (up to 5e-6)
    # plus summation order (torch.compile's fp32 on the CPU: 6.4e-6 at step 1). From step 2 on
    # the parameters differ by Adam's first update, which amplifies rounding differences where
    # a gradient element is near adam_eps (update lr * g / (|g| + eps)): measured 1.5e-5 in
    # fp32 on the CPU (bible-small, steps 2-3), hence the looser bound there.
    if args.grad_rtol is None:
        args.grad_rtol = 2e-5 if args.precision == "fp32" else 5e-2
    if args.grad_rtol_later is None:
        args.grad_rtol_later = 1e-4 if args.precision == "fp32" else 5e-2

    cuda = args.device == "cuda"
    if args.attention == "sdpa" and not HAVE_SDPA:
        print("pytorch_baseline: --attention sdpa: torch %s has no "
              "F.scaled_dot_product_attention (PyTorch >= 2.0)" % torch.__version__,
              file=sys.stderr)
        return 2
    sdpa = args.attention == "sdpa" or (args.attention == "auto" and HAVE_SDPA)
    if cuda and not torch.cuda.is_available():
        print("pytorch_baseline: no CUDA device (torch %s: torch.cuda.is_available() is false)"
              % torch.__version__, file=sys.stderr)
        return 2
    if not cuda and args.precision == "fp16":
        print("pytorch_baseline: fp16 (autocast + GradScaler) is the CUDA recipe; on the CPU "
              "use --precision bf16", file=sys.stderr)
        return 2
    if not cuda and args.mem_cap_gib:
        print("pytorch_baseline: --mem-cap-gib needs --device cuda", file=sys.stderr)
        return 2
    if cuda and args.profile:
        print("pytorch_baseline: --profile is for the CPU; on a GPU use nsys or ncu "
              "(docs/profiling.md)", file=sys.stderr)
        return 2

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    torch.manual_seed(0)
    dev = torch.device(args.device)
    if cuda:
        # fp32 means IEEE fp32 GEMMs, as nmt's precision.mode = fp32 (CUBLAS_COMPUTE_32F).
        torch.set_float32_matmul_precision("high" if args.precision == "tf32" else "highest")
        if args.mem_cap_gib:
            total_mem = torch.cuda.get_device_properties(dev).total_memory
            frac = args.mem_cap_gib * 2 ** 30 / total_mem
            if frac < 1:
                torch.cuda.set_per_process_memory_fraction(frac, dev)
            print("memory cap: %.1f GiB of the device's %.1f GiB (fraction %.4f)"
                  % (args.mem_cap_gib, total_mem / 2 ** 30, min(frac, 1.0)))

    cp = effective_config(args.nmt, args.config, args.overrides)
    g = lambda sec, key: cp.get(sec, key).strip('"')  # noqa: E731
    mcfg, table, flat = read_params(args.params)
    hdr, steps = read_batches(args.batches)
    if args.steps:
        steps = steps[:args.steps]
    for key in ("vocab", "d_model", "n_heads", "d_ff", "enc_layers", "dec_layers",
                "max_positions"):
        if int(g("model", key)) != mcfg[key]:
            sys.exit("params file has %s = %d, config %s" % (key, mcfg[key], g("model", key)))
    if g("model", "norm") != ("post", "pre")[mcfg["norm"]]:
        sys.exit("params file norm %d, config %s" % (mcfg["norm"], g("model", "norm")))
    # nmt's tensor table must equal make-fixture.py's independent one, so the names this
    # script trusts mean what they say.
    mf = fixture_module()
    if mf is None:
        print("note: tools/make-fixture.py not found: parameter layout not cross-checked")
    else:
        ref_table, ref_n = mf.param_table(mcfg)
        if [(n, tuple(s), o, e) for n, s, o, e in ref_table] != \
                [(n, tuple(s), o, e) for n, s, o, e in table] or ref_n != len(flat):
            sys.exit("nmt's parameter table differs from tools/make-fixture.py's param_table")

    eps_ls = float(g("train", "label_smoothing"))
    lr_scale, warmup = float(g("train", "lr_scale")), int(g("train", "warmup_steps"))
    b1, b2 = float(g("train", "adam_beta1")), float(g("train", "adam_beta2"))
    adam_eps, wd = float(g("train", "adam_eps")), float(g("train", "weight_decay"))
    clip = float(g("train", "clip_norm"))
    model = Transformer(mcfg, table, flat, float(g("model", "dropout")),
                        float(g("model", "attn_dropout")), float(g("model", "relu_dropout")),
                        eps_ls, dev, sdpa)
    model.train()
    params = list(model.parameters())
    opt_cls, opt_kw = torch.optim.Adam, dict(lr=0.0, betas=(b1, b2), eps=adam_eps)
    if wd > 0:
        opt_cls, opt_kw = torch.optim.AdamW, dict(opt_kw, weight_decay=wd)
    fused = False
    if cuda:
        try:  # one kernel for the whole update (torch >= 2.0; Adam only in 1.13)
            opt = opt_cls(params, fused=True, **opt_kw)
            fused = True
        except (TypeError, RuntimeError) as e:
            print("note: %s(fused=True) not available (%s); default implementation"
                  % (opt_cls.__name__, e))
    if not fused:
        opt = opt_cls(params, **opt_kw)

    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.precision)
    scaler = None
    if args.precision == "fp16":
        scaler = make_grad_scaler(float(g("precision", "loss_scale")),
                                  int(g("precision", "growth_interval")),
                                  float(g("precision", "backoff")))

    def autocast():
        if amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=args.device, dtype=amp_dtype)

    fwd, compile_settings = model, None
    if args.mode == "compile":
        if not hasattr(torch, "compile"):
            print("compile: torch %s has no torch.compile (added in PyTorch 2.0); skipped"
                  % torch.__version__)
            write_result(args.result, {"skipped": "torch %s has no torch.compile"
                                       % torch.__version__})
            return 0
        try:
            fwd, compile_settings = compile_model(model, args.compile_mode)
            print("pytorch compile: settings %s" % compile_settings)
        except Exception as e:  # noqa: BLE001 - any failure means "no compiled baseline"
            why = "torch.compile failed (%s: %s)" % (type(e).__name__, str(e).split("\n")[0])
            print("compile: %s" % why)
            write_result(args.result, {"failed": why, "compile_mode": args.compile_mode})
            return 3

    if cuda:
        dev_name = torch.cuda.get_device_name(dev)
        where = "%s (%s)" % (dev, dev_name)
        # Pinned host copies, so each micro-batch's upload is an asynchronous DMA, as a
        # DataLoader with pin_memory=True gives.
        for batches in steps:
            for b in batches:
                for k in ("src", "src_lens", "tgt_in", "tgt_lens", "tgt_out"):
                    b[k] = b[k].pin_memory()
    else:
        dev_name, where = "CPU", "CPU"
    prec_desc = {"fp32": "fp32", "tf32": "tf32" if cuda else "tf32 (= fp32 on CPU)",
                 "fp16": "fp16 (autocast + GradScaler)", "bf16": "bf16 (autocast)"}
    attn_desc = "F.scaled_dot_product_attention" if sdpa else "hand-written attention"
    print("pytorch %s %s %s on %s, %d threads: %d parameters, %d steps x %d batches, %s%s"
          % (torch.__version__, args.mode, prec_desc[args.precision], where,
             torch.get_num_threads(), len(flat), len(steps), hdr["K"], attn_desc,
             "" if compile_settings is None else
             ", torch.compile(mode=%s, dynamic=True, fullgraph=True)" % args.compile_mode))
    losses, times, tokens = [], [], []
    events, loss_dev = [], []
    # The loss check also compares each step's gradient norm (nmt's grad_norm: the global L2
    # norm of the per-token gradient, before clipping, unscaled), in float64.
    gnorm_dev = [] if args.check_metrics else None
    flops = [sum(train_flops(mcfg, b) for b in batches) for batches in steps]
    w = min(args.warmup, len(steps) - 1)
    counters_warm = None
    s = 0
    try:
        for s, batches in enumerate(steps):
            profiled = args.profile and s == len(steps) - 1
            prof = torch.autograd.profiler.profile() if profiled else contextlib.nullcontext()
            if cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            t0 = time.perf_counter()
            with prof:
                total = float(sum(b["tgt_tokens"] for b in batches))
                for group in opt.param_groups:
                    group["lr"] = lr_at(s + 1, mcfg["d_model"], lr_scale, warmup)
                opt.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for b in batches:
                    x = b
                    if cuda:
                        x = {k: b[k].to(dev, non_blocking=True)
                             for k in ("src", "src_lens", "tgt_in", "tgt_lens", "tgt_out")}
                    with autocast():
                        loss = fwd(x["src"], x["src_lens"], x["tgt_in"], x["tgt_lens"],
                                   x["tgt_out"])
                    scaled = loss / total
                    if scaler is not None:
                        scaled = scaler.scale(scaled)
                    scaled.backward()
                    if cuda:
                        loss_sum = loss_sum + loss.detach()  # stays on the device: no sync
                    else:
                        loss_sum += loss.item()
                if scaler is not None and (clip > 0 or gnorm_dev is not None):
                    scaler.unscale_(opt)
                if gnorm_dev is not None:
                    gnorm_dev.append(torch.stack([p.grad.double().pow(2).sum() for p in params
                                                  if p.grad is not None]).sum().sqrt())
                if scaler is not None:
                    if clip > 0:
                        torch.nn.utils.clip_grad_norm_(params, clip)
                    scaler.step(opt)  # skips the update on inf/NaN, like nmt's scaler
                    scaler.update()
                else:
                    if clip > 0:
                        torch.nn.utils.clip_grad_norm_(params, clip)
                    opt.step()
            if cuda:
                ev[1].record()
                events.append(ev)
                loss_dev.append(loss_sum)
            times.append(time.perf_counter() - t0)
            if profiled:
                print("profile of step %d (%d micro-batches; times include profiler overhead):"
                      % (s + 1, len(batches)))
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
            tokens.append(total)
            if s == w - 1 and compile_settings is not None:
                # Compilation is done on the host by the time the step's calls return.
                counters_warm = dynamo_counters()
            if not cuda:
                losses.append(loss_sum / total)
                print("step %d: loss %.6f, %d tgt tokens, %.1f ms" % (s + 1, losses[-1], total,
                                                                   1e3 * times[-1]), flush=True)
        if cuda:
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - only out-of-memory is handled, the rest re-raised
        if not is_oom(e):
            if compile_settings is None:
                raise
            # Compilation runs inside the first call: its failure is "no compiled baseline".
            import traceback
            traceback.print_exc()
            why = "step %d: %s: %s" % (s + 1, type(e).__name__, str(e).split("\n")[0][:300])
            print("pytorch compile: failed at %s" % why, flush=True)
            write_result(args.result, dict(failed=why, compile_mode=args.compile_mode,
                                           compile_settings=compile_settings,
                                           dynamo_counters=dynamo_counters()))
            return 3
        print("pytorch %s: out of memory at step %d (%s: %s)"
              % (args.mode, s + 1, type(e).__name__, str(e).split("\n")[0]), flush=True)
        write_result(args.result, dict(system="pytorch-" + args.mode, torch=torch.__version__,
                                       device=args.device, precision=args.precision, oom=True,
                                       oom_step=s + 1, max_tokens=hdr["max_tokens"],
                                       mem_cap_gib=args.mem_cap_gib or None))
        return 4
    if cuda:
        times = [a.elapsed_time(b) / 1e3 for a, b in events]
        losses = [float(l) / t for l, t in zip(loss_dev, tokens)]
        for i, (l, t, dt) in enumerate(zip(losses, tokens, times)):
            print("step %d: loss %.6f, %d tgt tokens, %.1f ms" % (i + 1, l, t, 1e3 * dt))

    if cuda:
        # From the first timed step's start to the last one's end on the GPU's clock: the
        # host's work between steps counts, as in nmt's interval wall time.
        dt = events[w][0].elapsed_time(events[-1][1]) / 1e3
    else:
        dt = sum(times[w:])
    tok = sum(tokens[w:])
    res = dict(system="pytorch-" + args.mode, torch=torch.__version__, threads=args.threads,
               steps=len(steps) - w, warmup=w, tgt_tokens=tok, seconds=dt,
               tgt_tokens_per_s=tok / dt, step_ms=1e3 * dt / (len(steps) - w),
               model_flops=float(sum(flops[w:])), losses=losses)
    median = statistics.median(times[w:])
    res.update(device=args.device, device_name=dev_name, precision=args.precision,
               step_ms_median=1e3 * median, warmup_s=sum(times[:w]), max_tokens=hdr["max_tokens"])
    if cuda:
        res.update(peak_mem_mb=torch.cuda.max_memory_allocated(dev) / 2 ** 20,
                   peak_mem_reserved_mb=torch.cuda.max_memory_reserved(dev) / 2 ** 20,
                   fused_adam=fused, mem_cap_gib=args.mem_cap_gib or None)
    else:
        res.update(peak_mem_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
    if scaler is not None:
        res.update(loss_scale=float(scaler.get_scale()))
    res.update(attention="sdpa" if sdpa else "manual")
    if compile_settings is not None:
        # Compilation runs inside the first steps (and again when a new shape needs a new
        # graph); what the warmup steps took beyond their share of a timed step estimates it.
        # Dynamo's counters at the end of the warmup and now: a graph compiled during the
        # timed steps means their time includes compilation (and the warmup was too short).
        end = dynamo_counters()
        delta = counters_delta(counters_warm or {}, end)
        recompiles = max(delta.get("stats", {}).get("unique_graphs", 0),
                         sum(delta.get("recompiles", {}).values()))
        res.update(compile_s=max(0.0, sum(times[:w]) - w * median),
                   compile_mode=args.compile_mode, compile_settings=compile_settings,
                   compile_stats={k: v for k, v in end.items()
                                  if k in ("stats", "recompiles", "frames", "graph_break")},
                   compile_counters_warmup=counters_warm,
                   compile_counters_timed_delta=delta,
                   recompiles_in_timed_steps=recompiles)
        if recompiles:
            print("pytorch compile: WARNING: %d graph(s) compiled during the timed steps %d..%d "
                  "(dynamo counters grew by %s): the figure includes compilation"
                  % (recompiles, w + 1, len(steps), delta), flush=True)
    print("pytorch %s: %.0f tgt tok/s, %.1f ms/step over steps %d..%d"
          % (args.mode, res["tgt_tokens_per_s"], res["step_ms"], w + 1, len(steps)))
    if cuda or args.precision != "fp32":
        print("pytorch %s: %s on %s, peak memory %.0f MiB%s%s"
              % (args.mode, prec_desc[args.precision], dev_name, res["peak_mem_mb"],
                 " allocated (%.0f MiB reserved)" % res["peak_mem_reserved_mb"] if cuda else
                 " (peak RSS)",
                 "; compile %.1f s (estimate)" % res["compile_s"] if "compile_s" in res else ""))
    ok = True
    if args.check_metrics:
        nmt_rec = {}
        with open(args.check_metrics) as f:
            for line in f:
                r = json.loads(line)
                nmt_rec[r["step"]] = r
        common = [s for s in range(1, len(losses) + 1) if s in nmt_rec]
        if not common:
            sys.exit("%s: no step of this run found" % args.check_metrics)
        gnorms = [float(g) for g in gnorm_dev]
        has_gnorm = all("grad_norm" in nmt_rec[s] for s in common)
        # fp32: both compute the same fp32 arithmetic up to summation order, so a tight
        # relative bound. Otherwise the two round at different sites (autocast rounds more
        # than nmt's GEMM inputs, and TF32 kernels differ), so an absolute bound in nats.
        exact = args.precision == "fp32"
        print("%6s %14s %14s %10s%s%s" % ("step", "nmt loss", "pytorch loss", "rel diff",
                                          "" if exact else " %10s" % "abs diff",
                                          " %13s %13s %10s" % ("nmt gnorm", "pytorch gnorm",
                                                               "rel diff") if has_gnorm else ""))
        worst, worst_abs, worst_g, g_ok = 0.0, 0.0, 0.0, True
        for s in common:
            nl = nmt_rec[s]["train_loss"]
            d = abs(nl - losses[s - 1])
            rel = d / abs(losses[s - 1])
            worst, worst_abs = max(worst, rel), max(worst_abs, d)
            gcol = ""
            if has_gnorm:
                # nmt writes null for a non-finite norm (an fp16 step it skipped).
                ng, tg = nmt_rec[s]["grad_norm"], gnorms[s - 1]
                if ng is None or not math.isfinite(tg):
                    rg = 0.0 if ng is None and not math.isfinite(tg) else float("inf")
                else:
                    rg = abs(ng - tg) / abs(tg) if tg else abs(ng - tg)
                worst_g = max(worst_g, rg)
                g_ok = g_ok and rg <= (args.grad_rtol if s == 1 else args.grad_rtol_later)
                gcol = " %13s %13.6g %10.2e" % ("null" if ng is None else "%.6g" % ng, tg, rg)
            print("%6d %14.6f %14.6f %10.2e%s%s" % (s, nl, losses[s - 1], rel,
                                                    "" if exact else " %10.2e" % d, gcol))
        if exact:
            ok = worst <= args.rtol
            print("loss check: worst relative difference %.2e (tolerance %.0e): %s"
                  % (worst, args.rtol, "OK" if ok else "MISMATCH"))
        else:
            ok = worst_abs <= args.atol
            print("loss check (%s): worst absolute difference %.2e nats, relative %.2e "
                  "(tolerance %.0e absolute): %s" % (args.precision, worst_abs, worst, args.atol,
                                                     "OK" if ok else "MISMATCH"))
        if has_gnorm:
            print("grad_norm check%s: worst relative difference %.2e (tolerance %.0e at step 1, "
                  "%.0e after): %s" % ("" if exact else " (%s)" % args.precision, worst_g,
                                       args.grad_rtol, args.grad_rtol_later,
                                       "OK" if g_ok else "MISMATCH"))
        else:
            print("grad_norm check: %s has no grad_norm: not compared" % args.check_metrics)
        res.update(nmt_losses=[nmt_rec[s]["train_loss"] for s in common],
                   loss_check_max_rel=worst, loss_check_max_abs=worst_abs,
                   loss_check_loss_ok=ok, loss_check_tol=args.rtol if exact else args.atol,
                   loss_check_tol_kind="relative" if exact else "absolute",
                   grad_norms=gnorms, loss_check_steps=len(common),
                   lr_warmup_steps=warmup, lr_scale=lr_scale)
        if has_gnorm:
            res.update(nmt_grad_norms=[nmt_rec[s]["grad_norm"] for s in common],
                       grad_norm_check_max_rel=worst_g,
                       grad_norm_check_tol=[args.grad_rtol, args.grad_rtol_later],
                       grad_norm_check_ok=g_ok)
        ok = ok and g_ok
        res.update(loss_check_ok=ok)
    write_result(args.result, res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
