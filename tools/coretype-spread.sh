#!/usr/bin/env bash
# The first STEPS (60) steps of make run's training under each OpenBLAS core type given (default:
# this CPU's own, then Haswell Zen SkylakeX Sandybridge Nehalem), then which runs end with the
# same parameters as an earlier one, bitwise (docs/determinism.md "The spread, measured").
# Usage: tools/coretype-spread.sh [CORETYPE...]   (Environment: NMT (build/nmt), STEPS, OUT.)
# A core type whose kernels need instructions this CPU lacks dies with SIGILL and is reported.
set -uo pipefail
cd "$(dirname "$0")/.."
NMT=${NMT:-build/nmt}
STEPS=${STEPS:-60}
OUT=${OUT:-runs/coretype-spread}
[ $# -gt 0 ] || set -- default Haswell Zen SkylakeX Sandybridge Nehalem
mkdir -p "$OUT"
seen=()
for ct in "$@"; do
  d=$OUT/$ct
  rm -rf "$d"
  if [ "$ct" = default ]; then env=(env -u OPENBLAS_CORETYPE); else env=(env OPENBLAS_CORETYPE="$ct"); fi
  if ! "${env[@]}" "$NMT" train conf/bible-small.ini run.out_dir="$d" train.max_steps="$STEPS" \
      train.valid_every=0 train.save_every=0 > "$d.log" 2>&1 ||
     ! "$NMT" export "$d/checkpoints/step_$STEPS.ckpt" "$d/model.safetensors" >> "$d.log" 2>&1; then
    echo "$ct: failed (see $d.log)"
    continue
  fi
  kern=$(grep -o 'OpenBLAS kernels: [A-Za-z0-9]*' "$d.log" | cut -d' ' -f3)
  losses=$(grep -o '"train_loss": [0-9.]*' "$d/metrics.jsonl" | cut -d' ' -f2 | tr '\n' ' ')
  same="differ from every run above"
  for e in "${seen[@]}"; do
    if cmp -s "$OUT/$e/model.safetensors" "$d/model.safetensors"; then same="bitwise $e's"; break; fi
  done
  seen+=("$ct")
  echo "$ct ($kern): losses $losses| parameters after step $STEPS $same"
done
