#!/usr/bin/python3
"""ensemble_ref.py — an independent reference of ensemble decoding, for test/test_ensemble.c.

    /usr/bin/python3 test/ensemble_ref.py --models A.safetensors B.safetensors [--weights 0.7 0.3]
        --src SRC_IDS --greedy NMT_GREEDY --nbest NMT_NBEST
        [--max-len 32] [--max-extra-len 50] [--min-len 1]

The models are PyTorch modules built from `nmt export` files (tools/load_pytorch.py), run in
float64 over the whole prefix at every step (no incremental cache, no code of nmt's decoder).
The ensemble's score of token y after a prefix is sum_m w_m log_softmax(logits_m)[y] with the
weights normalised to sum to 1 (Marian's rule; docs/decoding.md "Ensembles").

NMT_GREEDY: `nmt translate --ids --scores decode.beam=1` of SRC_IDS, lines "ids ||| F0= logp |||
score". Checked: each line's ids are the reference's greedy search (never <pad> or <s>; EOS not
a candidate below --min-len tokens; at most min(len(src) + 1 + max_extra_len, max_len - 1)
tokens, as nmt's decode limit), and F0 is its summed score within 1e-4.
NMT_NBEST: `--nbest K --scores` lines "i ||| ids ||| F0= logp ||| score". Checked: each
hypothesis's F0 is the reference's teacher-forced ensemble log-probability of it (EOS included
unless the hypothesis stopped at the length limit) within 1e-4, and hypotheses come best first.
Prints one line per mismatch and a summary; exits 1 on any mismatch, 0 otherwise.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import load_pytorch  # noqa: E402

PAD, BOS, EOS = load_pytorch.PAD, load_pytorch.BOS, load_pytorch.EOS
TOL = 1e-4


def step_scores(models, weights, src, prefix):
    """The ensemble's score of every next token after `prefix` (BOS first), float64 (V,)."""
    s = torch.tensor([src], dtype=torch.long)
    sl = torch.tensor([len(src)])
    t = torch.tensor([prefix], dtype=torch.long)
    tl = torch.tensor([len(prefix)])
    total = None
    for m, w in zip(models, weights):
        with torch.no_grad():
            lp = torch.log_softmax(m(s, sl, t, tl)[0, -1].double(), dim=-1)
        total = w * lp if total is None else total + w * lp
    return total


def greedy(models, weights, src, limit, min_len):
    out, score = [], 0.0
    while len(out) < limit:
        s = step_scores(models, weights, src, [BOS] + out).clone()
        s[PAD] = s[BOS] = float("-inf")
        if len(out) < min_len:
            s[EOS] = float("-inf")
        y = int(torch.argmax(s))
        score += float(s[y])
        if y == EOS:
            break
        out.append(y)
    return out, score


def forced(models, weights, src, hyp, with_eos):
    score = 0.0
    seq = hyp + ([EOS] if with_eos else [])
    for i, y in enumerate(seq):
        score += float(step_scores(models, weights, src, [BOS] + hyp[:i])[y])
    return score


def parse_scored(line):
    parts = [p.strip() for p in line.split("|||")]
    ids = [int(x) for x in parts[-3].split()] if parts[-3] else []
    return parts, ids, float(parts[-2].split("=")[1]), float(parts[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--weights", nargs="+", type=float)
    ap.add_argument("--src", required=True)
    ap.add_argument("--greedy", required=True)
    ap.add_argument("--nbest", required=True)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--max-extra-len", type=int, default=50)
    ap.add_argument("--min-len", type=int, default=1)
    a = ap.parse_args()
    w = a.weights or [1.0] * len(a.models)
    assert len(w) == len(a.models), "one weight per model"
    w = [x / sum(w) for x in w]
    models = [load_pytorch.load(p, torch.float64)[0] for p in a.models]
    srcs = []
    for line in open(a.src):
        ids = [int(x) for x in line.split()][: a.max_len - 1]
        srcs.append(ids + [EOS])
    bad = 0
    greedy_lines = open(a.greedy).read().splitlines()
    if len(greedy_lines) != len(srcs):
        print(f"greedy: {len(greedy_lines)} lines for {len(srcs)} sources")
        return 1
    for i, (src, line) in enumerate(zip(srcs, greedy_lines)):
        limit = min(len(src) + a.max_extra_len, a.max_len - 1)
        want, score = greedy(models, w, src, limit, a.min_len)
        _, got, f0, _ = parse_scored(line)
        if got != want or abs(f0 - score) > TOL * (1 + abs(score)):
            print(f"greedy line {i}: nmt {got} F0 {f0:.6f}, reference {want} {score:.6f}")
            bad += 1
    n_hyps, last = 0, {}
    for line in open(a.nbest).read().splitlines():
        parts, hyp, f0, rank_score = parse_scored(line)
        i = int(parts[0])
        limit = min(len(srcs[i]) + a.max_extra_len, a.max_len - 1)
        # A hypothesis of `limit` tokens may have stopped there without EOS: either score fits.
        cands = [forced(models, w, srcs[i], hyp, True)]
        if len(hyp) == limit:
            cands.append(forced(models, w, srcs[i], hyp, False))
        if min(abs(f0 - c) for c in cands) > TOL * (1 + abs(cands[0])):
            print(f"nbest line {i} {hyp}: nmt F0 {f0:.6f}, reference {cands}")
            bad += 1
        if i in last and rank_score > last[i] + 1e-6:
            print(f"nbest line {i}: score {rank_score} after {last[i]}: not best first")
            bad += 1
        last[i] = rank_score
        n_hyps += 1
    print(f"ensemble_ref: {len(srcs)} greedy lines, {n_hyps} n-best hypotheses, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
