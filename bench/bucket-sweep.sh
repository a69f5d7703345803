#!/usr/bin/env bash
# bench/bucket-sweep.sh — parallel.bucket_mb = auto against a sweep of fixed sizes on CPU
# workers, in one run (docs/scaling.md, "bucket_mb = auto").
#
# usage: bench/bucket-sweep.sh [section.key=value ...]
# env:   CONF (default conf/bible-small.ini), DEVICES (default 2), STEPS (default 20), WARMUP
#        (default 5: steps left out of the mean), SIZES (default "1 4 25 100"), REPEAT (default
#        3: rounds, each running auto and every size once, interleaved)
#
# Each run trains STEPS steps from step 0 (no validation, no intermediate checkpoint) in its
# own directory; its step time is the mean step_ms of metrics.jsonl over steps WARMUP+1..STEPS
# (log_every = 1). A size's figure is the least mean over the rounds (the run least disturbed
# by the rest of the machine). auto's row names the size it chose (config.ini) and its log
# line. Prints a table and whether auto is within 5% of the best fixed size. Timings never
# decide anything here: the script fails only if a run fails.
set -euo pipefail
cd "$(dirname "$0")/.."

CONF=${CONF:-conf/bible-small.ini}
DEVICES=${DEVICES:-2}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-5}
SIZES=${SIZES:-1 4 25 100}
REPEAT=${REPEAT:-3}
NMT=${NMT:-build/nmt}
OVR=("$@")
[ -x "$NMT" ] || make -s "$NMT"
OUT=$(mktemp -d "${TMPDIR:-/tmp}/nmt-bucket-sweep.XXXXXX")
trap 'rm -rf "$OUT"' EXIT

mean_ms() { # metrics.jsonl -> mean step_ms over steps > WARMUP
  /usr/bin/python3 - "$1" "$WARMUP" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ms = [r["step_ms"] for r in rows if r["step"] > int(sys.argv[2])]
print(f"{sum(ms) / len(ms):.1f}")
EOF
}

declare -A best
chosen=""
line=""
for round in $(seq "$REPEAT"); do
  for size in auto $SIZES; do
    dir="$OUT/$size"
    "$NMT" train "$CONF" "${OVR[@]}" parallel.devices="$DEVICES" parallel.bucket_mb="$size" \
      train.max_steps="$STEPS" train.log_every=1 train.valid_every=0 train.save_every=0 \
      train.valid_bleu=false run.out_dir="$dir" --overwrite >"$OUT/log" 2>&1 ||
      { cat "$OUT/log" >&2; echo "bucket-sweep: the run at bucket_mb = $size failed" >&2; exit 1; }
    ms=$(mean_ms "$dir/metrics.jsonl")
    if [ "$size" = auto ]; then
      chosen=$(sed -n 's/^bucket_mb = //p' "$dir/config.ini")
      line=$(grep -o 'parallel.bucket_mb = auto = .*' "$OUT/log" | head -1)
    fi
    if [ -z "${best[$size]:-}" ] || awk "BEGIN{exit !($ms < ${best[$size]})}"; then
      best[$size]=$ms
    fi
    echo "# round $round: bucket_mb = $size: $ms ms/step" >&2
  done
done

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "# bench/bucket-sweep.sh: $CONF ${OVR[*]} parallel.devices=$DEVICES, $STEPS steps (mean"
echo "# of steps $((WARMUP + 1))..$STEPS, least of $REPEAT interleaved rounds); commit $commit,"
echo "# $(date -u +%Y-%m-%d), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# auto's log: $line"
printf '%-12s %12s %10s\n' bucket_mb ms_per_step vs_best
fixed_best=""
for size in $SIZES; do
  if [ -z "$fixed_best" ] || awk "BEGIN{exit !(${best[$size]} < $fixed_best)}"; then
    fixed_best=${best[$size]}
  fi
done
for size in $SIZES auto; do
  label=$size
  [ "$size" = auto ] && label="auto ($chosen)"
  printf '%-12s %12s %9.1f%%\n' "$label" "${best[$size]}" \
    "$(awk "BEGIN{print 100 * (${best[$size]} / $fixed_best - 1)}")"
done
# The chosen size, when the sweep ran it as a fixed size too: the same buckets without the
# start-up probe, so a second figure of the choice under the same noise.
if [ -n "${best[$chosen]:-}" ]; then
  echo "# auto's choice, $chosen MiB, run as a fixed size: $(awk "BEGIN{printf \"%.1f\", 100 * (${best[$chosen]} / $fixed_best - 1)}")% from the best fixed size"
fi
if awk "BEGIN{exit !(${best[auto]} <= 1.05 * $fixed_best)}"; then
  echo "# auto within 5% of the best fixed size: yes"
else
  echo "# auto within 5% of the best fixed size: NO"
fi
