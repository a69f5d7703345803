#!/usr/bin/env python3
"""bench/peer_sockeye.py — the Python half of bench/peer-sockeye.sh (nmt next to Sockeye 3).

Runs with the benchmark's virtual environment (build/venv-sockeye/bin/python: Debian's torch
through --system-site-packages, sockeye, sentencepiece and sacrebleu from pip).

  encode SPM_MODEL OUT_DIR SPLIT:SRC_FILE:TGT_FILE...
      raw text -> SentencePiece pieces with the library (encode(out_type=str), what
      `spm_encode --output_format=piece` writes), one sentence per line, pieces separated by a
      space: OUT_DIR/SPLIT.src, OUT_DIR/SPLIT.tgt. Also OUT_DIR/vocab.json, Sockeye's vocabulary
      format (piece -> id) with the SentencePiece model's own ids, so both systems have the same
      ids and the same V-way softmax (<pad> 0, <unk> 1, <s> 2, </s> 3 are Sockeye's ids too),
      and OUT_DIR/counts.json: lines and pieces per file, which the script checks against the
      shards nmt trains on (`nmt shard-info`).
  decode SPM_MODEL IN OUT
      pieces -> text (decode_pieces), for sacreBLEU on detokenized output.
  train --step-log FILE -- SOCKEYE_TRAIN_ARGS...
      sockeye-train itself (sockeye.train.main, arguments unchanged), with one JSON line per
      batch appended to FILE: update, tokens (non-PAD target tokens = the tokens its loss is
      averaged over, EOS included), padded target tokens, sentences, and the time since the end
      of the previous batch (s: the iterator, forward, backward, optimizer; after a checkpoint,
      its validation and saving too), t: seconds since the first batch started. Sockeye's own
      speed log counts padded source tokens, so it is not used.
  nll SCORES TARGET_PIECES
      sockeye-score's per-sentence -log p(y|x) (alpha 0, no penalty) -> JSON {nll, tokens}: the
      unsmoothed NLL per target token, EOS included (what nmt's valid_nll is).
  report WORK_DIR META_JSON RESULTS_JSONL
      reads the runs under WORK_DIR, prints the side-by-side table, appends one JSON row per
      system to RESULTS_JSONL (bench/results.jsonl).
"""
import json
import math
import os
import sys
import time


def cmd_encode(argv):
    import sentencepiece as spm
    model, out = argv[0], argv[1]
    sp = spm.SentencePieceProcessor(model_file=model)
    os.makedirs(out, exist_ok=True)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    if len(vocab) != sp.get_piece_size():
        sys.exit("encode: %s has duplicate pieces" % model)
    for i, sym in enumerate(("<pad>", "<unk>", "<s>", "</s>")):
        if sp.id_to_piece(i) != sym:
            sys.exit("encode: %s: id %d is %r, Sockeye needs %r" % (model, i, sp.id_to_piece(i), sym))
    with open(os.path.join(out, "vocab.json"), "w") as f:
        json.dump(vocab, f, ensure_ascii=False, indent=0)
    counts = {}
    for spec in argv[2:]:
        split, src, tgt = spec.split(":")
        for side, path in (("src", src), ("tgt", tgt)):
            lines = pieces = 0
            with open(path, encoding="utf-8") as fi, \
                    open(os.path.join(out, "%s.%s" % (split, side)), "w", encoding="utf-8") as fo:
                for line in fi:
                    p = sp.encode(line.rstrip("\n"), out_type=str)
                    if any(" " in x for x in p):
                        sys.exit("encode: %s: a piece contains a space" % path)
                    fo.write(" ".join(p) + "\n")
                    lines += 1
                    pieces += len(p)
            counts["%s.%s" % (split, side)] = {"lines": lines, "pieces": pieces}
    with open(os.path.join(out, "counts.json"), "w") as f:
        json.dump(counts, f, indent=1)


def cmd_decode(argv):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=argv[0])
    with open(argv[1], encoding="utf-8") as fi, open(argv[2], "w", encoding="utf-8") as fo:
        for line in fi:
            fo.write(sp.decode_pieces(line.split()) + "\n")


def cmd_train(argv):
    if len(argv) < 3 or argv[0] != "--step-log" or argv[2] != "--":
        sys.exit("usage: peer_sockeye.py train --step-log FILE -- SOCKEYE_TRAIN_ARGS...")
    log = open(argv[1], "a")
    import sockeye.training as training
    from sockeye import train
    step = training.EarlyStoppingTrainer._step
    clock = {}

    def timed_step(self, batch):
        now = time.perf_counter()
        clock.setdefault("t0", now)
        clock.setdefault("prev", now)
        updated = step(self, batch)
        end = time.perf_counter()
        log.write(json.dumps(dict(
            update=self.state.updates, updated=bool(updated),
            tokens=int(batch.target_length.sum()), padded=int(batch.target.numel()),
            sentences=int(batch.samples), s=round(end - clock["prev"], 6),
            t=round(end - clock["t0"], 6))) + "\n")
        log.flush()
        clock["prev"] = end
        return updated

    training.EarlyStoppingTrainer._step = timed_step
    sys.argv = ["sockeye-train"] + argv[3:]
    train.main()


def cmd_nll(argv):
    scores = [float(l.split()[0]) for l in open(argv[0]) if l.strip()]
    tgt = [len(l.split()) + 1 for l in open(argv[1], encoding="utf-8")]  # + EOS
    if len(scores) != len(tgt):
        sys.exit("nll: %d scores for %d target lines" % (len(scores), len(tgt)))
    print(json.dumps(dict(nll=sum(scores) / sum(tgt), tokens=sum(tgt), sentences=len(tgt))))


# ---------------------------------------------------------------------------------- report

def nmt_records(path):
    """metrics.jsonl -> records with the interval's step count k and tokens (tok/s x seconds)."""
    out, prev = [], 0
    for line in open(path):
        r = json.loads(line)
        k = r["step"] - prev
        s = r["step_ms"] * k / 1e3
        out.append(dict(r, k=k, s=s, tokens=r["tgt_tokens_per_s"] * s))
        prev = r["step"]
    return out


def nmt_timing(path, warmup):
    recs = [r for r in nmt_records(path) if r["step"] > warmup]
    s, tok, n = sum(r["s"] for r in recs), sum(r["tokens"] for r in recs), sum(r["k"] for r in recs)
    return dict(tgt_tokens_per_s=tok / s, s_per_update=s / n, updates=n, tokens_per_update=tok / n)


def sockeye_steps(path):
    return [json.loads(l) for l in open(path)]


def sockeye_timing(path, warmup):
    steps = [r for r in sockeye_steps(path) if r["update"] > warmup]
    s, tok = sum(r["s"] for r in steps), sum(r["tokens"] for r in steps)
    n = len({r["update"] for r in steps})
    return dict(tgt_tokens_per_s=tok / s, s_per_update=s / n, updates=n, tokens_per_update=tok / n)


def time_to(curve, target):
    """curve: [(update, elapsed_s, ppl)] in update order -> seconds at which ppl first reaches
    target, linear in log ppl between validations (None if never)."""
    prev = None
    for u, t, p in curve:
        if p <= target:
            if prev is None or prev[2] == p:
                return t
            f = (math.log(prev[2]) - math.log(target)) / (math.log(prev[2]) - math.log(p))
            return prev[1] + f * (t - prev[1])
        prev = (u, t, p)
    return None


def cmd_report(argv):
    work, meta, results = argv[0], json.load(open(argv[1])), argv[2]
    warmup = meta["warmup"]
    rows = {"nmt": {}, "sockeye": {}}
    # -- timing: interleaved short runs, best of REPEAT by target tokens/s
    tdir = os.path.join(work, "timing")
    if os.path.isdir(tdir):
        for sysname, fn, f in (("nmt", nmt_timing, "/metrics.jsonl"),
                               ("sockeye", sockeye_timing, ".steps.jsonl")):
            runs = []
            for r in range(1, meta["repeat"] + 1):
                p = os.path.join(tdir, "%s.%d%s" % (sysname, r, f))
                if os.path.exists(p):
                    runs.append(fn(p, warmup))
            if runs:
                best = max(runs, key=lambda x: x["tgt_tokens_per_s"])
                rows[sysname].update(
                    tgt_tokens_per_s=round(best["tgt_tokens_per_s"], 1),
                    s_per_update=round(best["s_per_update"], 4),
                    timing_tokens_per_update=round(best["tokens_per_update"], 1),
                    timed_updates=best["updates"],
                    runs_tgt_tokens_per_s=[round(x["tgt_tokens_per_s"], 1) for x in runs])
    # -- full runs: valid perplexity at equal updates, effective batch, time to a perplexity
    fdir = os.path.join(work, "full")
    curves = {}
    if os.path.isdir(fdir):
        recs = nmt_records(os.path.join(fdir, "nmt", "metrics.jsonl"))
        t, curve = 0.0, []
        for r in recs:
            t += r["s"]
            if r.get("valid_nll") is not None:
                curve.append((r["step"], t, math.exp(r["valid_nll"])))
        n = recs[-1]["step"]
        rows["nmt"].update(
            tokens_per_update=round(sum(r["tokens"] for r in recs) / n, 1), updates=n,
            train_s=round(t, 1), valid_loss_smoothed={str(r["step"]): round(r["valid_loss"], 4)
                                                      for r in recs if r.get("valid_loss")})
        curves["nmt"] = curve
        steps = sockeye_steps(os.path.join(fdir, "sockeye.steps.jsonl"))
        ends = {}
        for s in steps:
            ends[s["update"]] = s["t"]
        n = max(ends)
        curve = []
        for u, path in sorted((int(x.split(".")[1]), os.path.join(fdir, x))
                              for x in os.listdir(fdir) if x.startswith("sockeye-nll.")):
            curve.append((u, ends[u], math.exp(json.load(open(path))["nll"])))
        own = {}
        mpath = os.path.join(fdir, "sockeye", "metrics")
        if os.path.exists(mpath):  # Sockeye's own perplexity-val: label-smoothed, batch-averaged
            for line in open(mpath):
                kv = dict(x.split("=", 1) for x in line.split()[1:] if "=" in x)
                ck = int(line.split()[0])
                if "perplexity-val" in kv:
                    own[str(ck * meta["valid_every"])] = round(float(kv["perplexity-val"]), 3)
        rows["sockeye"].update(
            tokens_per_update=round(sum(s["tokens"] for s in steps) / n, 1), updates=n,
            train_s=round(ends[n], 1), sockeye_perplexity_val=own)
        curves["sockeye"] = curve
        for sysname, curve in curves.items():
            rows[sysname]["valid_ppl"] = {str(u): round(p, 3) for u, _, p in curve}
            rows[sysname]["valid_elapsed_s"] = {str(u): round(t, 1) for u, t, _ in curve}
        if all(curves.values()):
            target = max(curves["nmt"][-1][2], curves["sockeye"][-1][2])
            for sysname, curve in curves.items():
                tt = time_to(curve, target)
                rows[sysname].update(target_ppl=round(target, 3),
                                     time_to_target_ppl_s=None if tt is None else round(tt, 1))
        for sysname in rows:
            b = os.path.join(fdir, sysname + ".bleu.json")
            if os.path.exists(b):
                res = {m["name"]: m for m in json.load(open(b))}
                rows[sysname].update(test_bleu=res["BLEU"]["score"],
                                     test_chrf2=res["chrF2"]["score"],
                                     bleu_signature=res["BLEU"]["signature"],
                                     chrf_signature=res["chrF2"]["signature"])
            w = os.path.join(fdir, sysname + ".translate_s")
            if os.path.exists(w):
                rows[sysname]["translate_s"] = float(open(w).read())

    def g(sysname, key, fmt="%s", sub=None):
        v = rows[sysname].get(key)
        if sub is not None:
            v = (v or {}).get(sub)
        return "-" if v is None else fmt % v

    lines = [("target tokens/s (best of %d)" % meta["repeat"], "tgt_tokens_per_s", "%.0f", None),
             ("s/update (same run)", "s_per_update", "%.3f", None),
             ("target tokens/update, timed runs", "timing_tokens_per_update", "%.0f", None),
             ("target tokens/update, full run", "tokens_per_update", "%.0f", None)]
    for u in sorted({int(k) for s in rows.values() for k in s.get("valid_ppl", {})}):
        lines.append(("valid ppl (NLL/token) @ %d" % u, "valid_ppl", "%.2f", str(u)))
        lines.append(("  elapsed s @ %d" % u, "valid_elapsed_s", "%.0f", str(u)))
    lines += [("time to valid ppl %s (s)" % g("nmt", "target_ppl", "%.2f"),
               "time_to_target_ppl_s", "%.0f", None),
              ("test BLEU (beam 4)", "test_bleu", "%.2f", None),
              ("test chrF2 (beam 4)", "test_chrf2", "%.2f", None),
              ("test translate wall s", "translate_s", "%.0f", None)]
    print()
    print("%-36s %14s %14s %11s" % ("", "nmt", "sockeye", "nmt/sockeye"))
    for label, key, fmt, sub in lines:
        a, b = g("nmt", key, fmt, sub), g("sockeye", key, fmt, sub)
        try:
            ratio = "%.2fx" % (float(a) / float(b))
        except (ValueError, ZeroDivisionError):
            ratio = ""
        print("%-36s %14s %14s %11s" % (label, a, b, ratio))
    print("(%s; %s threads; load average %s before, %s after; test: %s sentences)"
          % (meta["device"], meta["threads"], meta["load_before"], meta["load_after"],
             meta["test_lines"]))
    sig = rows["nmt"].get("bleu_signature")
    if sig:
        print("sacreBLEU: BLEU %s | chrF2 %s" % (sig, rows["nmt"]["chrf_signature"]))
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(results, "a") as f:
        for sysname, r in rows.items():
            if not r:
                continue
            f.write(json.dumps(dict(
                date=date, commit=meta["commit"], bench="peer-sockeye",
                system="nmt" if sysname == "nmt" else "sockeye " + meta["sockeye_version"],
                variant=meta["variants"][sysname], device=meta["device"], cores=meta["cores"],
                precision="fp32", config=meta["config"], steps=meta["steps"], warmup=warmup,
                repeat=meta["repeat"], valid_every=meta["valid_every"],
                test_lines=meta["test_lines"], loadavg_before=meta["load_before"],
                loadavg_after=meta["load_after"], **r)) + "\n")
    n, s = rows["nmt"], rows["sockeye"]
    parts = []
    if n.get("tgt_tokens_per_s") and s.get("tgt_tokens_per_s"):
        x = n["tgt_tokens_per_s"] / s["tgt_tokens_per_s"]
        parts.append("nmt %.0f vs Sockeye %.0f target tokens/s (%.2fx; goal >= 3x: %s)"
                     % (n["tgt_tokens_per_s"], s["tgt_tokens_per_s"], x,
                        "met" if x >= 3 else "not met"))
    if n.get("valid_ppl") and s.get("valid_ppl"):
        u = max(n["valid_ppl"], key=int)
        if u in s["valid_ppl"]:
            a, b = n["valid_ppl"][u], s["valid_ppl"][u]
            parts.append("valid ppl at %s updates nmt %.2f vs Sockeye %.2f (goal no worse: %s)"
                         % (u, a, b, "met" if a <= b else "not met"))
    if n.get("tokens_per_update") and s.get("tokens_per_update"):
        parts.append("target tokens/update nmt %.0f vs Sockeye %.0f (%+.1f%%)"
                     % (n["tokens_per_update"], s["tokens_per_update"],
                        100 * (n["tokens_per_update"] / s["tokens_per_update"] - 1)))
    print("\nsummary: " + "; ".join(parts) + "; commit " + meta["commit"])


if __name__ == "__main__":
    cmds = dict(encode=cmd_encode, decode=cmd_decode, train=cmd_train, nll=cmd_nll,
                report=cmd_report)
    if len(sys.argv) < 2 or sys.argv[1] not in cmds:
        sys.exit(__doc__)
    cmds[sys.argv[1]](sys.argv[2:])
