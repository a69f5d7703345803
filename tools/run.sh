#!/usr/bin/env bash
# `make run`'s main job, idempotent, after the Makefile's run target has installed what is
# missing and built `all`:
#   prepare the Bible corpus -> train conf/bible-small.ini (resuming if a checkpoint exists;
#   nothing to do if the run is complete) -> translate the test books -> sacreBLEU with its
#   signature.
# Environment: CONF (default conf/bible-small.ini), NMT (the binary, default build/nmt); extra
# args are config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
CONF=${CONF:-conf/bible-small.ini}
t0=$(date +%s)
# OpenBLAS picks its sgemm kernels per CPU model, and other kernels round differently: the
# losses and the BLEU differ between CPUs (docs/determinism.md). Every CPU with AVX2 and FMA
# (Intel since Haswell, AMD since Zen) can run Haswell's kernels, so pin them there; set
# OPENBLAS_CORETYPE yourself to choose others.
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
  export OPENBLAS_CORETYPE=Haswell
fi
echo "== OpenBLAS kernels: ${OPENBLAS_CORETYPE:-chosen by OpenBLAS for this CPU (no AVX2 and FMA)}"
NMT=${NMT:-build/nmt}
[ -x "$NMT" ] || { echo "tools/run.sh: no $NMT: run \`make run\`, which builds it first" >&2; exit 2; }
export NMT
tools/prepare-bible.sh
# awk reads to the end (no `exit`): an early exit can kill nmt with SIGPIPE mid-write, which
# pipefail turns into a failed run (seen on a loaded machine: make run's Error 141).
out=$("$NMT" config --dump "$CONF" "$@" |
  awk -F' *= *' '/^\[/{s=$0} !found && s=="[run]" && $1=="out_dir"{print $2; found=1}')
out=${out//\"/}
# The time a CPU takes is its own (its FMA peak and free cores): nmt's estimate before the first
# step says it for this machine, so it is pointed at in bold, and the measured time follows.
hi=
lo=
if [ -t 1 ]; then hi=$'\033[1m' lo=$'\033[0m'; fi
echo "== train $CONF -> $out"
echo "${hi}== how long depends on this CPU (its FMA peak and free cores): see nmt's line" \
  "\"estimated at least ... per step\" below${lo}"
"$NMT" train "$CONF" "$@" --resume
# The mean step_ms of metrics.jsonl's log lines (one per train.log_every steps).
if [ -s "$out/metrics.jsonl" ]; then
  awk -F'"step_ms": *' 'NF > 1 { split($2, v, /[,}]/); n++; ms += v[1] }
    END { if (n) printf "%.2f %d\n", ms / n / 1000, n }' "$out/metrics.jsonl" |
    { read -r s n || exit 0
      echo "${hi}== trained at ${s} s per step on this machine (mean of $n log lines of" \
        "$out/metrics.jsonl)${lo}"; } || true
fi
echo "== translate data/bible/test.en"
"$NMT" translate "$CONF" "$@" --input data/bible/test.en --output "$out/test.hyp.es"
echo "== sample (source / reference / hypothesis)"
for i in 1 200 400; do
  printf 'EN : %s\nREF: %s\nHYP: %s\n\n' "$(sed -n ${i}p data/bible/test.en)" \
    "$(sed -n ${i}p data/bible/test.es)" "$(sed -n ${i}p "$out/test.hyp.es")"
done
echo "== BLEU / chrF on the test books ($(wc -l < data/bible/test.en) verses)"
python3 -m sacrebleu data/bible/test.es -i "$out/test.hyp.es" -m bleu chrf -w 2 | tee "$out/test.bleu.json"
echo "== make run finished in $(( $(date +%s) - t0 )) s"
