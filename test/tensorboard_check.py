#!/usr/bin/env python3
"""Reads a run's TensorBoard event files with the tensorboard package's own reader and checks
every scalar against metrics.jsonl (test_tensorboard.c runs it).

    python3 test/tensorboard_check.py RUN_DIR [EXPECTED_FILES]

Every tag must hold exactly the steps whose metrics.jsonl record has that key (a key that is
null or absent there: no scalar), each value equal to the record's within the record's
printed precision plus float32 rounding. A step logged twice (a run resumed from a checkpoint
older than its last records) counts as its last record, as TensorBoard shows it once the
resumed run's SessionLog START purged the older events. Exit 0 and "ok ..." when all agree;
exit 1 with one line per disagreement otherwise."""
import decimal
import glob
import json
import math
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# tag -> metrics.jsonl key (docs/formats.md "Run directory", tb/); train/ppl is exp(train_nll).
TAGS = {
    "train/loss": "train_loss", "train/nll": "train_nll", "train/lr": "lr",
    "train/grad_norm": "grad_norm", "train/loss_scale": "loss_scale",
    "train/skipped_steps": "skipped_steps", "train/tgt_tokens_per_s": "tgt_tokens_per_s",
    "train/step_ms": "step_ms", "train/mfu": "mfu", "train/peak_mem_mb": "peak_mem_mb",
    "train/epoch": "epoch", "valid/loss": "valid_loss", "valid/nll": "valid_nll",
    "valid/ppl": "valid_ppl", "valid/bleu": "valid_bleu", "valid/chrf": "valid_chrf",
}


def half_ulp(text):
    """Half a unit in the last printed digit of a JSON number ("9.377826" -> 5e-7)."""
    return 0.5 * 10.0 ** decimal.Decimal(text).as_tuple().exponent


def main():
    run = sys.argv[1]
    want_files = int(sys.argv[2]) if len(sys.argv) > 2 else None
    rows = {}
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            # numbers kept as their text, to know the precision they were printed with
            row = json.loads(line, parse_float=str, parse_int=str)
            rows[int(row["step"])] = row
    expect = {}  # tag -> {step: (value, tolerance)}
    for step, row in rows.items():
        for tag, key in TAGS.items():
            if row.get(key) is None:
                continue
            v = float(row[key])
            expect.setdefault(tag, {})[step] = (v, half_ulp(row[key]))
            if key == "train_nll":
                ppl = math.exp(v)
                expect.setdefault("train/ppl", {})[step] = (ppl, ppl * 2 * half_ulp(row[key]))
    files = sorted(glob.glob(os.path.join(run, "tb", "events.out.tfevents.*")))
    bad = []
    if want_files is not None and len(files) != want_files:
        bad.append("%d event files in %s/tb, want %d" % (len(files), run, want_files))
    if not files:
        print("no event files in %s/tb" % run)
        return 1
    acc = EventAccumulator(os.path.join(run, "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    if acc.file_version != 2.0:
        bad.append("file_version %r, want 2.0 (brain.Event:2)" % acc.file_version)
    have = set(acc.Tags()["scalars"])
    for tag in sorted(have - set(expect)):
        bad.append("tag %s is in the event files, not in metrics.jsonl" % tag)
    for tag in sorted(set(expect) - have):
        bad.append("tag %s is in metrics.jsonl, not in the event files" % tag)
    n = 0
    for tag in sorted(have & set(expect)):
        got = {e.step: e.value for e in acc.Scalars(tag)}
        if len(got) != len(acc.Scalars(tag)):
            bad.append("%s: a step twice" % tag)
        if sorted(got) != sorted(expect[tag]):
            bad.append("%s: steps %s, metrics.jsonl has %s" % (tag, sorted(got),
                                                             sorted(expect[tag])))
            continue
        for step, (v, tol) in expect[tag].items():
            n += 1
            # float32 keeps 24 bits: half an ulp is |v| * 2^-24
            if abs(got[step] - v) > tol + abs(v) * 2.0 ** -24:
                bad.append("%s step %d: %r, metrics.jsonl %r (tolerance %g)" %
                           (tag, step, got[step], v, tol + abs(v) * 2.0 ** -24))
    for b in bad:
        print(b)
    if bad:
        return 1
    print("ok: %d scalars in %d tags over %d steps agree with metrics.jsonl (%d files)" %
          (n, len(have), len(rows), len(files)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
