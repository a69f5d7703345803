#!/usr/bin/python3
"""make-fixture.py — golden fixtures for test/test_model.c, computed by PyTorch in float64.

Regenerate (Debian's /usr/bin/python3 has torch; the pyenv python3 on PATH does not):
    /usr/bin/python3 tools/make-fixture.py [out_dir]        # default out_dir: test/fixtures
Output is deterministic (fixed torch/numpy seeds). Commit the .bin files together with any
change to the model's parameter layout, its dropout site ids or this script.

The model is built by hand here from the paper (Vaswani et al. 2017 §3), independently of
src/model/: post-LN  x = LN(x + Dropout(S(x)))  or pre-LN  x = x + Dropout(S(LN(x))) with a
final LN per stack; embeddings E[id]*sqrt(C) + sinusoids (§3.5), dropout; tied output
projection logits = h E^T; label-smoothed cross entropy as torch.nn.CrossEntropyLoss
(ignore PAD). Parameters are random (not nmt's init), rounded to float32 so that C and Python
start from identical values; everything after that is float64.

Dropout masks are nmt's counter-based ones, re-implemented here (Philox4x32-10, Salmon et al.
2011; element e of stream s is kept iff uniform(seed, s, e) >= p), with nmt's site ids
(src/model/transformer.c): site = stack << 20 | layer << 4 | place; stack 0 = embeddings
(place 0 source, 1 target), 1 = encoder, 2 = decoder; place = 4*sublayer + {0 attention
weights, 1 sublayer output, 2 FFN hidden}; stream = step << 24 | site.

File layout (little endian):
    char  magic[8] = "NMTFIXT1"
    u32   version = 1
    i32   vocab, d_model, n_heads, d_ff, enc_layers, dec_layers, max_positions,
          norm (0 post, 1 pre), n_sent, src_len, tgt_len, n_tensors
    f32   dropout, attn_dropout, relu_dropout, label_smoothing, ln_eps
    u64   seed, step                     (dropout streams of the training forward)
    i32   src[n_sent*src_len], tgt_in[n_sent*tgt_len], tgt_out[n_sent*tgt_len],
          src_lens[n_sent], tgt_lens[n_sent]
    n_tensors x { char name[80] (NUL padded), i32 ndim, i32 shape[2], u64 offset, u64 numel }
    u64   n_params
    f32   params[n_params]               (nmt's flat layout)
    f64   loss_sum, tokens, nll_sum, loss_mean   (smoothed sum, non-pad targets, plain NLL sum)
    f32   grads[n_params]                (d loss_mean / d params, float64 rounded to float32)
"""
import os
import struct
import sys

import numpy as np
import torch

PAD, UNK, BOS, EOS = 0, 1, 2, 3
MAGIC = b"NMTFIXT1"
VERSION = 1

# ---------------------------------------------------------------------------------------------
# nmt's flat parameter layout (include/nmt/model.h; src/model/params.c)


def param_table(cfg):
    C, F, V = cfg["d_model"], cfg["d_ff"], cfg["vocab"]
    names = []

    def lin(prefix, out_f, in_f):
        names.append((prefix + ".weight", (out_f, in_f)))
        names.append((prefix + ".bias", (out_f,)))

    def ln(prefix):
        names.append((prefix + ".weight", (C,)))
        names.append((prefix + ".bias", (C,)))

    pre = cfg["norm"] == 1
    if pre:
        ln("decoder.ln_f")
    for l in reversed(range(cfg["dec_layers"])):
        p = "decoder.layers.%d." % l
        lin(p + "self_attn.qkv", 3 * C, C)
        lin(p + "self_attn.out", C, C)
        ln(p + "ln1")
        lin(p + "cross_attn.q", C, C)
        lin(p + "cross_attn.kv", 2 * C, C)
        lin(p + "cross_attn.out", C, C)
        ln(p + "ln2")
        lin(p + "ffn.fc1", F, C)
        lin(p + "ffn.fc2", C, F)
        ln(p + "ln3")
    if pre:
        ln("encoder.ln_f")
    for l in reversed(range(cfg["enc_layers"])):
        p = "encoder.layers.%d." % l
        lin(p + "self_attn.qkv", 3 * C, C)
        lin(p + "self_attn.out", C, C)
        ln(p + "ln1")
        lin(p + "ffn.fc1", F, C)
        lin(p + "ffn.fc2", C, F)
        ln(p + "ln2")
    names.append(("embed.weight", (V, C)))
    table, off = [], 0
    for name, shape in names:
        numel = int(np.prod(shape))
        table.append((name, shape, off, numel))
        off += numel
    return table, off


# ---------------------------------------------------------------------------------------------
# Philox4x32-10 and nmt's dropout masks (include/nmt/rng.h)

M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
U32 = np.uint64(0xFFFFFFFF)


def philox(c0, c1, c2, c3, k0, k1):
    """Vectorised over counters (uint64 arrays holding 32-bit values); 10 rounds."""
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for r in range(10):
        if r:
            k0 = (k0 + np.uint64(W0)) & U32
            k1 = (k1 + np.uint64(W1)) & U32
        p0 = np.uint64(M0) * c0
        p1 = np.uint64(M1) * c2
        hi0, lo0 = p0 >> np.uint64(32), p0 & U32
        hi1, lo1 = p1 >> np.uint64(32), p1 & U32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def keep_scale(seed, step, site, n, p):
    """Float64 vector of length n: 1/(1-p) where nmt keeps element e, else 0."""
    p32 = float(np.float32(p))
    if p32 == 0.0:
        return None
    stream = (step << 24) | (site & 0xFFFFFF)
    idx = np.arange(n, dtype=np.uint64)
    blk = idx >> np.uint64(2)
    z = np.zeros_like(blk)
    words = philox(blk & U32, blk >> np.uint64(32), z + np.uint64(stream & 0xFFFFFFFF),
                   z + np.uint64(stream >> 32), seed & 0xFFFFFFFF, seed >> 32)
    w = np.choose((idx & np.uint64(3)).astype(np.int64), words)
    u = (w >> np.uint64(8)).astype(np.float64) * 2.0**-24
    scale = float(np.float32(1.0) / (np.float32(1.0) - np.float32(p)))
    return torch.tensor(np.where(u >= p32, scale, 0.0), dtype=torch.float64)


def site(stack, layer, place):
    return stack << 20 | layer << 4 | place


# ---------------------------------------------------------------------------------------------
# the model, by hand


class Model:
    def __init__(self, cfg, P, train, seed, step):
        self.cfg, self.P, self.train, self.seed, self.step = cfg, P, train, seed, step
        self.C, self.H = cfg["d_model"], cfg["n_heads"]

    def drop(self, x, p, s):
        if not self.train:
            return x
        m = keep_scale(self.seed, self.step, s, x.numel(), p)
        return x if m is None else x * m.view(x.shape)

    def ln(self, x, prefix):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.cfg["ln_eps"]) * self.P[prefix + ".weight"] \
            + self.P[prefix + ".bias"]

    def lin(self, x, prefix):
        return x @ self.P[prefix + ".weight"].T + self.P[prefix + ".bias"]

    def attention(self, q, k, v, k_lens, causal, s):
        B, Tq, C = q.shape
        Tk, H = k.shape[1], self.H
        dk = C // H
        q = q.view(B, Tq, H, dk).transpose(1, 2)
        k = k.view(B, Tk, H, dk).transpose(1, 2)
        v = v.view(B, Tk, H, dk).transpose(1, 2)
        S = q @ k.transpose(-1, -2) / np.sqrt(dk)
        j = torch.arange(Tk).view(1, 1, 1, Tk)
        i = torch.arange(Tq).view(1, 1, Tq, 1)
        masked = j >= torch.tensor(k_lens).view(B, 1, 1, 1)
        if causal:
            masked = masked | (j > i)
        Pr = torch.softmax(S.masked_fill(masked, float("-inf")), dim=-1)
        Pr = self.drop(Pr, self.cfg["attn_dropout"], s)
        return (Pr @ v).transpose(1, 2).reshape(B, Tq, C)

    def self_attn(self, x, prefix, lens, causal, s):
        qkv = self.lin(x, prefix + "self_attn.qkv")
        C = self.C
        y = self.attention(qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:], lens, causal, s)
        return self.lin(y, prefix + "self_attn.out")

    def cross_attn(self, x, mem, prefix, src_lens, s):
        q = self.lin(x, prefix + "cross_attn.q")
        kv = self.lin(mem, prefix + "cross_attn.kv")
        C = self.C
        y = self.attention(q, kv[..., :C], kv[..., C:], src_lens, False, s)
        return self.lin(y, prefix + "cross_attn.out")

    def ffn(self, x, prefix, s):
        h = torch.relu(self.lin(x, prefix + "ffn.fc1"))
        h = self.drop(h, self.cfg["relu_dropout"], s)
        return self.lin(h, prefix + "ffn.fc2")

    def sub(self, x, fn, ln_prefix, s_out):
        if self.cfg["norm"] == 0:
            return self.ln(x + self.drop(fn(x), self.cfg["dropout"], s_out), ln_prefix)
        return x + self.drop(fn(self.ln(x, ln_prefix)), self.cfg["dropout"], s_out)

    def embed(self, ids, place):
        T = ids.shape[1]
        C = self.C
        pe = torch.zeros(self.cfg["max_positions"], C, dtype=torch.float64)
        pos = torch.arange(self.cfg["max_positions"], dtype=torch.float64).view(-1, 1)
        c = torch.arange(C)
        freq = torch.pow(torch.tensor(10000.0, dtype=torch.float64), -(c - c % 2).double() / C)
        ang = pos * freq
        pe = torch.where(c % 2 == 1, torch.cos(ang), torch.sin(ang))
        pe = pe.float().double()  # nmt stores the table in float32
        x = self.P["embed.weight"][ids] * np.sqrt(C) + pe[:T]
        return self.drop(x, self.cfg["dropout"], site(0, 0, place))

    def forward(self, src, src_lens, tgt_in, tgt_lens):
        cfg = self.cfg
        x = self.embed(src, 0)
        for l in range(cfg["enc_layers"]):
            p = "encoder.layers.%d." % l
            x = self.sub(x, lambda y: self.self_attn(y, p, src_lens, False, site(1, l, 0)),
                         p + "ln1", site(1, l, 1))
            x = self.sub(x, lambda y: self.ffn(y, p, site(1, l, 6)), p + "ln2", site(1, l, 5))
        if cfg["norm"] == 1:
            x = self.ln(x, "encoder.ln_f")
        mem = x
        x = self.embed(tgt_in, 1)
        for l in range(cfg["dec_layers"]):
            p = "decoder.layers.%d." % l
            x = self.sub(x, lambda y: self.self_attn(y, p, tgt_lens, True, site(2, l, 0)),
                         p + "ln1", site(2, l, 1))
            x = self.sub(x, lambda y: self.cross_attn(y, mem, p, src_lens, site(2, l, 4)),
                         p + "ln2", site(2, l, 5))
            x = self.sub(x, lambda y: self.ffn(y, p, site(2, l, 10)), p + "ln3", site(2, l, 9))
        if cfg["norm"] == 1:
            x = self.ln(x, "decoder.ln_f")
        return x @ self.P["embed.weight"].T


def losses(logits, tgt_out, eps):
    """Per-token smoothed loss and NLL, zero on PAD targets (§5.4; torch's definition)."""
    V = logits.shape[-1]
    logp = torch.log_softmax(logits.reshape(-1, V), dim=-1)
    t = tgt_out.reshape(-1)
    nll = -logp.gather(1, t.view(-1, 1)).squeeze(1)
    smooth = (1 - eps) * nll + eps * (-logp.mean(-1))
    mask = (t != PAD).double()
    # Independent check against torch's own implementation.
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, V), t, ignore_index=PAD,
                                            label_smoothing=eps, reduction="sum")
    assert torch.allclose((smooth * mask).sum(), ref, rtol=1e-12, atol=0), "xent mismatch"
    return (smooth * mask).sum(), (nll * mask).sum()


# ---------------------------------------------------------------------------------------------


def make_batch(rng, V, src_lens, tgt_lens):
    B, Ts, Tt = len(src_lens), max(src_lens), max(tgt_lens)
    src = np.zeros((B, Ts), np.int32)
    tgt_in = np.zeros((B, Tt), np.int32)
    tgt_out = np.zeros((B, Tt), np.int32)
    for b in range(B):
        x = rng.integers(4, V, src_lens[b] - 1)
        y = rng.integers(4, V, tgt_lens[b] - 1)
        src[b, :src_lens[b]] = list(x) + [EOS]
        tgt_in[b, :tgt_lens[b]] = [BOS] + list(y)
        tgt_out[b, :tgt_lens[b]] = list(y) + [EOS]
    return src, tgt_in, tgt_out


def random_params(rng, table, n_params):
    flat = np.zeros(n_params, np.float32)
    for name, shape, off, numel in table:
        if name == "embed.weight":
            v = rng.normal(0, 0.3, numel)
        elif name.endswith(".weight") and len(shape) == 2:
            v = rng.normal(0, 1.0 / np.sqrt(shape[1]), numel)
        elif ".ln" in name and name.endswith(".weight"):
            v = 1.0 + rng.normal(0, 0.1, numel)
        else:
            v = rng.normal(0, 0.1, numel)
        flat[off:off + numel] = v.astype(np.float32)
    return flat


def write_fixture(path, cfg, seed, step, src_lens, tgt_lens, data_seed):
    rng = np.random.default_rng(data_seed)
    table, n_params = param_table(cfg)
    src, tgt_in, tgt_out = make_batch(rng, cfg["vocab"], src_lens, tgt_lens)
    params32 = random_params(rng, table, n_params)

    flat = torch.tensor(params32.astype(np.float64), requires_grad=True)
    P = {name: flat[off:off + numel].view(shape) for name, shape, off, numel in table}
    model = Model(cfg, P, train=True, seed=seed, step=step)
    logits = model.forward(torch.tensor(src, dtype=torch.long), list(src_lens),
                           torch.tensor(tgt_in, dtype=torch.long), list(tgt_lens))
    loss_sum, nll_sum = losses(logits, torch.tensor(tgt_out, dtype=torch.long),
                               cfg["label_smoothing"])
    tokens = float(sum(tgt_lens))
    loss_mean = loss_sum / tokens
    loss_mean.backward()
    grads = flat.grad.numpy().astype(np.float32)

    B, Ts, Tt = len(src_lens), src.shape[1], tgt_in.shape[1]
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<I", VERSION))
        f.write(struct.pack("<12i", cfg["vocab"], cfg["d_model"], cfg["n_heads"], cfg["d_ff"],
                            cfg["enc_layers"], cfg["dec_layers"], cfg["max_positions"],
                            cfg["norm"], B, Ts, Tt, len(table)))
        f.write(struct.pack("<5f", cfg["dropout"], cfg["attn_dropout"], cfg["relu_dropout"],
                            cfg["label_smoothing"], cfg["ln_eps"]))
        f.write(struct.pack("<QQ", seed, step))
        for a in (src, tgt_in, tgt_out, np.array(src_lens, np.int32),
                  np.array(tgt_lens, np.int32)):
            f.write(a.astype("<i4").tobytes())
        for name, shape, off, numel in table:
            s = list(shape) + [0] * (2 - len(shape))
            f.write(name.encode().ljust(80, b"\0"))
            f.write(struct.pack("<3iQQ", len(shape), s[0], s[1], off, numel))
        f.write(struct.pack("<Q", n_params))
        f.write(params32.astype("<f4").tobytes())
        f.write(struct.pack("<4d", loss_sum.item(), tokens, nll_sum.item(), loss_mean.item()))
        f.write(grads.astype("<f4").tobytes())
    print("%s: %d tensors, %d params, loss_sum %.9g tokens %d nll_sum %.9g, max|grad| %.3g"
          % (path, len(table), n_params, loss_sum.item(), tokens, nll_sum.item(),
             float(np.abs(grads).max())))


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "test/fixtures"
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    base = dict(vocab=37, d_model=16, n_heads=2, d_ff=24, enc_layers=2, dec_layers=2,
                max_positions=32, norm=0, dropout=0.0, attn_dropout=0.0, relu_dropout=0.0,
                label_smoothing=0.1, ln_eps=1e-5)
    # Padding on both sides: source rows of 7, 4, 5 ids and target rows of 5, 6, 3.
    src_lens, tgt_lens = [7, 4, 5], [5, 6, 3]
    drop = dict(dropout=0.1, attn_dropout=0.15, relu_dropout=0.2)
    write_fixture(os.path.join(out_dir, "model_post.bin"), dict(base, norm=0), 0, 0,
                  src_lens, tgt_lens, 1)
    write_fixture(os.path.join(out_dir, "model_pre.bin"), dict(base, norm=1), 0, 0,
                  src_lens, tgt_lens, 2)
    write_fixture(os.path.join(out_dir, "model_post_dropout.bin"), dict(base, norm=0, **drop),
                  1234, 7, src_lens, tgt_lens, 3)
    # label smoothing 0 exercises the single-pass loss path
    write_fixture(os.path.join(out_dir, "model_pre_dropout.bin"),
                  dict(base, norm=1, label_smoothing=0.0, **drop), 0x9E3779B97F4A7C15, 3,
                  src_lens, tgt_lens, 4)


if __name__ == "__main__":
    main()
