#!/usr/bin/python3
"""pytorch_baseline.py — the PyTorch CPU baseline of bench/cpu-throughput.sh: nmt's model, trained
from nmt's initial weights on the batches `nmt train` uses, timed the same way.

    /usr/bin/python3 bench/pytorch_baseline.py --batches B.bin --params P.bin \
        --config conf/bible-small.ini [section.key=value ...] [--mode eager|compile] \
        [--threads 2] [--warmup 5] [--result R.json] [--check-metrics nmt/metrics.jsonl]

Inputs come from bench/dump_batches (the file formats are in its header comment): the batches
of the first N optimizer steps in the trainer's order, K = devices * accum_steps per step, and
nmt_model_init_params(run.seed) in nmt's flat layout. The training hyperparameters are read
from `nmt config --dump CONFIG overrides...` (the same effective config `nmt train` uses).

Same model (Vaswani et al. 2017 §3, include/nmt/model.h): encoder-decoder, fused QKV and
cross-attention KV projections, ReLU FFN, sinusoidal positions, embeddings scaled by
sqrt(d_model), one embedding matrix tied to the output projection, post-LN (or pre-LN with a
final LayerNorm per stack), dropout on embedding sums, sublayer outputs, attention weights and
FFN activations with the config's rates (torch's own masks: they differ from nmt's Philox
masks, which only matters for the loss check, run with dropout 0). Loss: label-smoothed cross
entropy (torch's definition, PAD ignored) summed over the step's K batches and divided by the
step's target tokens; gradients accumulate over the K micro-batches, then one Adam step
(beta1, beta2, eps from the config; AdamW if weight_decay > 0; clipping if clip_norm > 0) with
the paper's schedule (eq. 3) times lr_scale. Everything fp32, eager, on CPU.

Throughput excludes the first --warmup steps: target tokens of steps [warmup, N) divided by
their wall time. This is the figure bench/RESULTS.md compares with nmt's.
"""
import argparse
import configparser
import contextlib
import importlib.util
import json
import math
import os
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


class Transformer(torch.nn.Module):
    def __init__(self, mcfg, table, flat, drop, attn_drop, relu_drop):
        super().__init__()
        self.cfg = mcfg
        self.C, self.H = mcfg["d_model"], mcfg["n_heads"]
        self.drop, self.attn_drop, self.relu_drop = drop, attn_drop, relu_drop
        self.params = torch.nn.ParameterDict()
        for name, shape, off, numel in table:
            t = torch.from_numpy(flat[off:off + numel].reshape(shape).copy())
            self.params[name.replace(".", "__")] = torch.nn.Parameter(t)
        self.register_buffer("pe", sinusoids(mcfg["max_positions"], self.C))

    def p(self, name):
        return self.params[name.replace(".", "__")]

    def lin(self, x, prefix):
        return F.linear(x, self.p(prefix + ".weight"), self.p(prefix + ".bias"))

    def ln(self, x, prefix):
        return F.layer_norm(x, (self.C,), self.p(prefix + ".weight"), self.p(prefix + ".bias"),
                            self.cfg["ln_eps"])

    def attention(self, q, k, v, mask):
        B, Tq, C = q.shape
        Tk, H = k.shape[1], self.H
        dk = C // H
        q = q.view(B, Tq, H, dk).transpose(1, 2)
        k = k.view(B, Tk, H, dk).transpose(1, 2)
        v = v.view(B, Tk, H, dk).transpose(1, 2)
        s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(dk))
        pr = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
        pr = F.dropout(pr, self.attn_drop, self.training)
        return torch.matmul(pr, v).transpose(1, 2).reshape(B, Tq, C)

    def sub(self, x, fn, ln_prefix):
        if self.cfg["norm"] == 0:
            return self.ln(x + F.dropout(fn(x), self.drop, self.training), ln_prefix)
        return x + F.dropout(fn(self.ln(x, ln_prefix)), self.drop, self.training)

    def self_attn(self, x, prefix, mask):
        C = self.C
        qkv = self.lin(x, prefix + "self_attn.qkv")
        y = self.attention(qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:], mask)
        return self.lin(y, prefix + "self_attn.out")

    def cross_attn(self, x, mem, prefix, mask):
        C = self.C
        q = self.lin(x, prefix + "cross_attn.q")
        kv = self.lin(mem, prefix + "cross_attn.kv")
        y = self.attention(q, kv[..., :C], kv[..., C:], mask)
        return self.lin(y, prefix + "cross_attn.out")

    def ffn(self, x, prefix):
        h = F.dropout(F.relu(self.lin(x, prefix + "ffn.fc1")), self.relu_drop, self.training)
        return self.lin(h, prefix + "ffn.fc2")

    def embed(self, ids):
        E = self.p("embed.weight")
        x = F.embedding(ids, E) * math.sqrt(self.C) + self.pe[:ids.shape[1]]
        return F.dropout(x, self.drop, self.training)

    def forward(self, src, src_lens, tgt_in, tgt_lens, tgt_out, label_smoothing):
        """Summed label-smoothed loss over the batch's non-pad target tokens."""
        Ts, Tt = src.shape[1], tgt_in.shape[1]
        src_mask = (torch.arange(Ts).view(1, 1, 1, Ts) >= src_lens.view(-1, 1, 1, 1))
        causal = torch.arange(Tt).view(1, Tt) > torch.arange(Tt).view(Tt, 1)
        tgt_mask = (torch.arange(Tt).view(1, 1, 1, Tt) >= tgt_lens.view(-1, 1, 1, 1)) | causal
        x = self.embed(src)
        for l in range(self.cfg["enc_layers"]):
            p = "encoder.layers.%d." % l
            x = self.sub(x, lambda y: self.self_attn(y, p, src_mask), p + "ln1")
            x = self.sub(x, lambda y: self.ffn(y, p), p + "ln2")
        if self.cfg["norm"] == 1:
            x = self.ln(x, "encoder.ln_f")
        mem = x
        x = self.embed(tgt_in)
        for l in range(self.cfg["dec_layers"]):
            p = "decoder.layers.%d." % l
            x = self.sub(x, lambda y: self.self_attn(y, p, tgt_mask), p + "ln1")
            x = self.sub(x, lambda y: self.cross_attn(y, mem, p, src_mask), p + "ln2")
            x = self.sub(x, lambda y: self.ffn(y, p), p + "ln3")
        if self.cfg["norm"] == 1:
            x = self.ln(x, "decoder.ln_f")
        logits = F.linear(x, self.p("embed.weight"))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt_out.reshape(-1),
                               ignore_index=PAD, label_smoothing=label_smoothing,
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", required=True)
    ap.add_argument("--params", required=True)
    ap.add_argument("--config", required=True, help="nmt config file (plus overrides)")
    ap.add_argument("overrides", nargs="*", help="section.key=value, as for nmt train")
    ap.add_argument("--nmt", default=os.path.join(ROOT, "build", "nmt"))
    ap.add_argument("--mode", choices=("eager", "compile"), default="eager")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=0, help="0 = every step in the batch file")
    ap.add_argument("--result", help="write the measured figures as JSON here")
    ap.add_argument("--check-metrics", help="nmt metrics.jsonl (log_every=1) to compare "
                    "per-step train_loss with; exit 1 if a step differs by more than --rtol")
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--profile", action="store_true",
                    help="run the last step under torch.autograd.profiler and print its ops")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    torch.manual_seed(0)

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
                        float(g("model", "attn_dropout")), float(g("model", "relu_dropout")))
    model.train()
    params = list(model.parameters())
    if wd > 0:
        opt = torch.optim.AdamW(params, lr=0.0, betas=(b1, b2), eps=adam_eps, weight_decay=wd)
    else:
        opt = torch.optim.Adam(params, lr=0.0, betas=(b1, b2), eps=adam_eps)

    fwd = model
    if args.mode == "compile":
        if not hasattr(torch, "compile"):
            print("compile: torch %s has no torch.compile (added in PyTorch 2.0); skipped"
                  % torch.__version__)
            if args.result:
                with open(args.result, "w") as f:
                    json.dump({"skipped": "torch %s has no torch.compile" % torch.__version__}, f)
            return 0
        try:
            fwd = torch.compile(model)
        except Exception as e:  # noqa: BLE001 - any failure means "no compiled baseline"
            why = "torch.compile failed (%s: %s)" % (type(e).__name__, e)
            print("compile: %s; skipped" % why)
            if args.result:
                with open(args.result, "w") as f:
                    json.dump({"skipped": why}, f)
            return 0

    print("pytorch %s %s fp32 on CPU, %d threads: %d parameters, %d steps x %d batches"
          % (torch.__version__, args.mode, torch.get_num_threads(), len(flat), len(steps),
             hdr["K"]))
    losses, times, tokens = [], [], []
    flops = [sum(train_flops(mcfg, b) for b in batches) for batches in steps]
    for s, batches in enumerate(steps):
        profiled = args.profile and s == len(steps) - 1
        prof = torch.autograd.profiler.profile() if profiled else contextlib.nullcontext()
        t0 = time.perf_counter()
        with prof:
            total = float(sum(b["tgt_tokens"] for b in batches))
            for group in opt.param_groups:
                group["lr"] = lr_at(s + 1, mcfg["d_model"], lr_scale, warmup)
            opt.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for b in batches:
                loss = fwd(b["src"], b["src_lens"], b["tgt_in"], b["tgt_lens"], b["tgt_out"],
                           eps_ls)
                (loss / total).backward()
                loss_sum += loss.item()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
        times.append(time.perf_counter() - t0)
        if profiled:
            print("profile of step %d (%d micro-batches; times include profiler overhead):"
                  % (s + 1, len(batches)))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        losses.append(loss_sum / total)
        tokens.append(total)
        print("step %d: loss %.6f, %d tgt tokens, %.1f ms" % (s + 1, losses[-1], total,
                                                           1e3 * times[-1]), flush=True)

    w = min(args.warmup, len(steps) - 1)
    dt, tok = sum(times[w:]), sum(tokens[w:])
    res = dict(system="pytorch-" + args.mode, torch=torch.__version__, threads=args.threads,
               steps=len(steps) - w, warmup=w, tgt_tokens=tok, seconds=dt,
               tgt_tokens_per_s=tok / dt, step_ms=1e3 * dt / (len(steps) - w),
               model_flops=float(sum(flops[w:])), losses=losses)
    print("pytorch %s: %.0f tgt tok/s, %.1f ms/step over steps %d..%d"
          % (args.mode, res["tgt_tokens_per_s"], res["step_ms"], w + 1, len(steps)))
    ok = True
    if args.check_metrics:
        nmt_loss = {}
        with open(args.check_metrics) as f:
            for line in f:
                r = json.loads(line)
                nmt_loss[r["step"]] = r["train_loss"]
        common = [s for s in range(1, len(losses) + 1) if s in nmt_loss]
        if not common:
            sys.exit("%s: no step of this run found" % args.check_metrics)
        print("%6s %14s %14s %10s" % ("step", "nmt loss", "pytorch loss", "rel diff"))
        worst = 0.0
        for s in common:
            rel = abs(nmt_loss[s] - losses[s - 1]) / abs(losses[s - 1])
            worst = max(worst, rel)
            print("%6d %14.6f %14.6f %10.2e" % (s, nmt_loss[s], losses[s - 1], rel))
        ok = worst <= args.rtol
        print("loss check: worst relative difference %.2e (tolerance %.0e): %s"
              % (worst, args.rtol, "OK" if ok else "MISMATCH"))
        res.update(nmt_losses=[nmt_loss[s] for s in common], loss_check_max_rel=worst,
                   loss_check_ok=ok)
    if args.result:
        with open(args.result, "w") as f:
            json.dump(res, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
