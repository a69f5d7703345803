#!/usr/bin/python3
"""load_pytorch.py — build a PyTorch module from an `nmt export` safetensors file and compute
nmt's loss on shard pairs.

    /usr/bin/python3 tools/load_pytorch.py MODEL.safetensors --shard SHARD
        [--max-len 128] [--max-tokens 4096] [--pairs N] [--dtype float32|float64]

Prints the line `nmt eval` prints for the same shard and checkpoint:
    loss L nll N ppl P tokens T pairs K dropped D
(label-smoothed cross entropy and plain NLL per non-pad target token, nats; ppl = exp(nll)),
so the two can be compared (test/test_export.c does, tolerance 1e-4 relative in float32).

Debian's /usr/bin/python3 has torch (python3-torch); the pyenv python3 first on PATH does not.
Nothing here imports nmt code or the `safetensors` package: the file is parsed from the format
description (docs/formats.md "safetensors export"), the model is a torch.nn.Module whose
state_dict keys are exactly the exported tensor names (load_state_dict(strict=True) checks that
every tensor is present with its shape), and the math follows the paper (Vaswani et al. 2017
§3; post-LN as the paper or pre-LN per the file's metadata). Pairs follow nmt's batcher (data.h):
src = x EOS, tgt_in = BOS y, tgt_out = y EOS; pairs with a side longer than max_len - 1 ids are
skipped, like nmt's.
"""
import argparse
import json
import math
import struct
import sys
import zlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

PAD, UNK, BOS, EOS = 0, 1, 2, 3


# ---------------------------------------------------------------------------------------------
# safetensors, from the format description


def read_safetensors(path):
    """(metadata dict, {name: float32 tensor}) with the checks the reference loader makes:
    header inside the file, F32 only, byte ranges matching shapes, tiling the data section."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError("%s: truncated" % path)
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise ValueError("%s: header length %d beyond the file" % (path, n))
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = memoryview(blob)[8 + n:]
    meta = header.pop("__metadata__", {})
    tensors, spans = {}, []
    for name, t in header.items():
        if t["dtype"] != "F32":
            raise ValueError("%s: %s has dtype %s" % (path, name, t["dtype"]))
        begin, end = t["data_offsets"]
        numel = int(np.prod(t["shape"])) if t["shape"] else 1
        if end - begin != 4 * numel or end > len(data):
            raise ValueError("%s: %s: offsets %d..%d do not hold shape %s"
                             % (path, name, begin, end, t["shape"]))
        arr = np.frombuffer(data[begin:end], dtype="<f4").reshape(t["shape"])
        tensors[name] = torch.from_numpy(arr.astype(np.float32))
        spans.append((begin, end, name))
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            raise ValueError("%s: %s starts at %d, expected %d (hole or overlap)"
                             % (path, name, begin, pos))
        pos = end
    if pos != len(data):
        raise ValueError("%s: %d trailing bytes after the last tensor" % (path, len(data) - pos))
    return meta, tensors


# ---------------------------------------------------------------------------------------------
# the model: module names mirror nmt's tensor names (include/nmt/model.h)


class SelfAttention(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)  # rows [W_q; W_k; W_v]
        self.out = nn.Linear(C, C)


class CrossAttention(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.q = nn.Linear(C, C)
        self.kv = nn.Linear(C, 2 * C)  # rows [W_k; W_v]
        self.out = nn.Linear(C, C)


class FFN(nn.Module):
    def __init__(self, C, F_):
        super().__init__()
        self.fc1 = nn.Linear(C, F_)
        self.fc2 = nn.Linear(F_, C)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, C, F_, eps):
        super().__init__()
        self.self_attn = SelfAttention(C)
        self.ln1 = nn.LayerNorm(C, eps=eps)
        self.ffn = FFN(C, F_)
        self.ln2 = nn.LayerNorm(C, eps=eps)


class DecoderLayer(nn.Module):
    def __init__(self, C, F_, eps):
        super().__init__()
        self.self_attn = SelfAttention(C)
        self.ln1 = nn.LayerNorm(C, eps=eps)
        self.cross_attn = CrossAttention(C)
        self.ln2 = nn.LayerNorm(C, eps=eps)
        self.ffn = FFN(C, F_)
        self.ln3 = nn.LayerNorm(C, eps=eps)


class Stack(nn.Module):
    def __init__(self, layers, C, eps, pre):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        if pre:
            self.ln_f = nn.LayerNorm(C, eps=eps)


class Transformer(nn.Module):
    """Encoder-decoder Transformer; shared embedding for source, target and output (§3.4);
    sinusoidal positions (§3.5); eval mode only (the export carries no dropout state)."""

    def __init__(self, meta):
        super().__init__()
        g = lambda k: int(meta[k])
        self.V, self.C, self.H, self.F = g("vocab"), g("d_model"), g("n_heads"), g("d_ff")
        self.pre = meta["norm"] == "pre"
        eps = float(meta["ln_eps"])
        self.embed = nn.Embedding(self.V, self.C)
        self.encoder = Stack([EncoderLayer(self.C, self.F, eps) for _ in range(g("enc_layers"))],
                             self.C, eps, self.pre)
        self.decoder = Stack([DecoderLayer(self.C, self.F, eps) for _ in range(g("dec_layers"))],
                             self.C, eps, self.pre)
        # nmt computes the table in double and stores it in float32
        P = g("max_positions")
        pos = torch.arange(P, dtype=torch.float64).view(-1, 1)
        c = torch.arange(self.C)
        freq = torch.pow(torch.tensor(10000.0, dtype=torch.float64), -(c - c % 2).double() / self.C)
        pe = torch.where(c % 2 == 1, torch.cos(pos * freq), torch.sin(pos * freq)).float()
        self.register_buffer("pe", pe, persistent=False)

    def attention(self, q, k, v, k_lens, causal):
        B, Tq, C = q.shape
        Tk, H = k.shape[1], self.H
        dk = C // H
        q = q.view(B, Tq, H, dk).transpose(1, 2)
        k = k.view(B, Tk, H, dk).transpose(1, 2)
        v = v.view(B, Tk, H, dk).transpose(1, 2)
        S = q @ k.transpose(-1, -2) / math.sqrt(dk)
        j = torch.arange(Tk).view(1, 1, 1, Tk)
        masked = j >= k_lens.view(B, 1, 1, 1)
        if causal:
            masked = masked | (j > torch.arange(Tq).view(1, 1, Tq, 1))
        A = torch.softmax(S.masked_fill(masked, float("-inf")), dim=-1)
        return (A @ v).transpose(1, 2).reshape(B, Tq, C)

    def sub(self, x, fn, ln):
        return ln(x + fn(x)) if not self.pre else x + fn(ln(x))

    def embed_pos(self, ids):
        return self.embed(ids) * math.sqrt(self.C) + self.pe[: ids.shape[1]].to(self.embed.weight.dtype)

    def forward(self, src, src_lens, tgt_in, tgt_lens):
        C = self.C
        x = self.embed_pos(src)
        for L in self.encoder.layers:
            def sa(y, L=L):
                qkv = L.self_attn.qkv(y)
                return L.self_attn.out(self.attention(qkv[..., :C], qkv[..., C:2 * C],
                                                      qkv[..., 2 * C:], src_lens, False))
            x = self.sub(x, sa, L.ln1)
            x = self.sub(x, L.ffn, L.ln2)
        mem = self.encoder.ln_f(x) if self.pre else x
        x = self.embed_pos(tgt_in)
        for L in self.decoder.layers:
            def sa(y, L=L):
                qkv = L.self_attn.qkv(y)
                return L.self_attn.out(self.attention(qkv[..., :C], qkv[..., C:2 * C],
                                                      qkv[..., 2 * C:], tgt_lens, True))

            def ca(y, L=L):
                kv = L.cross_attn.kv(mem)
                return L.cross_attn.out(self.attention(L.cross_attn.q(y), kv[..., :C], kv[..., C:],
                                                       src_lens, False))
            x = self.sub(x, sa, L.ln1)
            x = self.sub(x, ca, L.ln2)
            x = self.sub(x, L.ffn, L.ln3)
        if self.pre:
            x = self.decoder.ln_f(x)
        return x @ self.embed.weight.T


def load(path, dtype=torch.float32):
    meta, tensors = read_safetensors(path)
    model = Transformer(meta)
    model.load_state_dict(tensors, strict=True)
    return model.to(dtype).eval(), meta


# ---------------------------------------------------------------------------------------------
# shards (docs/formats.md "Shard format") and batches


def read_shard(path):
    with open(path, "rb") as f:
        blob = f.read()
    if blob[:8] != b"NMTSHRD1":
        raise ValueError("%s: bad magic" % path)
    version, width, vocab, _ = struct.unpack("<4I", blob[8:24])
    n, T, S_ids, T_ids, size = struct.unpack("<5Q", blob[24:64])
    if version not in (1, 2) or width not in (2, 4) or size != len(blob):
        raise ValueError("%s: unsupported or truncated shard" % path)
    header = 64
    if version == 2:  # the header's and the payload's CRC-32, as nmt_shard_open checks them
        header = 72
        payload_crc, header_crc = struct.unpack("<2I", blob[64:72])
        if zlib.crc32(blob[:68]) != header_crc or zlib.crc32(blob[72:]) != payload_crc:
            raise ValueError("%s: checksum mismatch (the file is damaged)" % path)
    so = np.frombuffer(blob, "<u8", n + 1, header)
    to = np.frombuffer(blob, "<u8", n + 1, T)
    dt = "<u2" if width == 2 else "<u4"
    src = np.frombuffer(blob, dt, int(so[n]), S_ids).astype(np.int64)
    tgt = np.frombuffer(blob, dt, int(to[n]), T_ids).astype(np.int64)
    return vocab, [(src[so[i]:so[i + 1]], tgt[to[i]:to[i + 1]]) for i in range(n)]


def batches(pairs, max_tokens):
    """Length-sorted batches of at most max_tokens padded tokens per side (the order does not
    change the sums)."""
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][0]) + 1, len(pairs[i][1]) + 1))
    cur, longest = [], 0
    for i in order:
        L = max(len(pairs[i][0]), len(pairs[i][1])) + 1
        if cur and (len(cur) + 1) * max(longest, L) > max_tokens:
            yield cur
            cur, longest = [], 0
        cur.append(pairs[i])
        longest = max(longest, L)
    if cur:
        yield cur


def tensors_of(batch):
    B = len(batch)
    Ts = max(len(s) for s, _ in batch) + 1
    Tt = max(len(t) for _, t in batch) + 1
    src = torch.zeros(B, Ts, dtype=torch.long)
    tin = torch.zeros(B, Tt, dtype=torch.long)
    tout = torch.zeros(B, Tt, dtype=torch.long)
    for b, (s, t) in enumerate(batch):
        src[b, :len(s)] = torch.from_numpy(s)
        src[b, len(s)] = EOS
        tin[b, 0] = BOS
        tin[b, 1:len(t) + 1] = torch.from_numpy(t)
        tout[b, :len(t)] = torch.from_numpy(t)
        tout[b, len(t)] = EOS
    sl = torch.tensor([len(s) + 1 for s, _ in batch])
    tl = torch.tensor([len(t) + 1 for _, t in batch])
    return src, sl, tin, tl, tout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="safetensors file from `nmt export`")
    ap.add_argument("--shard", required=True, help="nmt shard (docs/formats.md)")
    ap.add_argument("--max-len", type=int, default=256, help="data.max_len of the run")
    ap.add_argument("--max-tokens", type=int, default=4096, help="padded tokens per batch")
    ap.add_argument("--pairs", type=int, default=0, help="only the first N pairs (0 = all)")
    ap.add_argument("--label-smoothing", type=float, default=None,
                    help="default: the file's metadata (train.label_smoothing)")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    a = ap.parse_args()

    dtype = getattr(torch, a.dtype)
    model, meta = load(a.model, dtype)
    eps = float(meta["label_smoothing"]) if a.label_smoothing is None else a.label_smoothing
    vocab, pairs = read_shard(a.shard)
    if vocab != model.V:
        sys.exit("load_pytorch: shard vocab %d, model vocab %d" % (vocab, model.V))
    if a.pairs > 0:
        pairs = pairs[: a.pairs]
    fit = [p for p in pairs if len(p[0]) + 1 <= a.max_len and len(p[1]) + 1 <= a.max_len]
    loss = nll = tokens = 0.0
    with torch.no_grad():
        for batch in batches(fit, a.max_tokens):
            src, sl, tin, tl, tout = tensors_of(batch)
            logits = model(src, sl, tin, tl).reshape(-1, model.V)
            t = tout.reshape(-1)
            loss += F.cross_entropy(logits, t, ignore_index=PAD, label_smoothing=eps,
                                    reduction="sum").item()
            nll += F.cross_entropy(logits, t, ignore_index=PAD, reduction="sum").item()
            tokens += float((t != PAD).sum())
    print("loss %.6f nll %.6f ppl %.4f tokens %.0f pairs %d dropped %d"
          % (loss / tokens, nll / tokens, math.exp(nll / tokens), tokens, len(fit),
             len(pairs) - len(fit)))


if __name__ == "__main__":
    main()
