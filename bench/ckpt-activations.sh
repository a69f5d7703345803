#!/bin/sh
# bench/ckpt-activations.sh — activation checkpointing on CPU workers: step time and peak
# memory with and without train.checkpoint_activations, same batches, same config.
#   bench/ckpt-activations.sh [CONFIG] [STEPS]     (default conf/bible-small.ini, 12 steps)
# Prints one line per setting from metrics.jsonl: the mean step_ms of the records after the
# first (thread start and first-touch faults) and the process's peak RSS (peak_mem_mb).
set -eu
CONFIG=${1:-conf/bible-small.ini}
STEPS=${2:-12}
OUT=${TMPDIR:-/tmp}/nmt-ckpt-act.$$
trap 'rm -rf "$OUT"' EXIT
for ca in off on; do
  build/nmt train "$CONFIG" data.valid= train.valid_every=0 train.save_every=0 train.log_every=4 \
    train.max_steps="$STEPS" train.checkpoint_activations=$ca run.out_dir="$OUT/$ca" \
    >/dev/null 2>&1
  /usr/bin/python3 - "$OUT/$ca/metrics.jsonl" "$ca" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step_ms"' in l]
timed = rows[1:] or rows
ms = sum(r["step_ms"] for r in timed) / len(timed)
print("checkpoint_activations=%-3s step_ms %8.1f  peak_mem_mb %7.1f  loss@%d %.6f"
      % (sys.argv[2], ms, max(r["peak_mem_mb"] for r in rows), rows[-1]["step"], rows[-1]["train_loss"]))
PY
done
