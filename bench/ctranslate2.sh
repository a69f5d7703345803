#!/usr/bin/env bash
# bench/ctranslate2.sh — nmt's decoding next to CTranslate2's on the same weights, the same
# sentences and the same threads: greedy and beam search, CPU seconds, sentences/s, tokens/s,
# and the fraction of greedy outputs that are token-identical (the converter's check).
#
# usage: bench/ctranslate2.sh CKPT [section.key=value ...]   (overrides go to nmt translate)
# env:   BUILD (default build: $BUILD/nmt is made and used; CUDA is passed to make when set),
#        NMT (a built nmt to use instead, nothing made: a GPU pack's), CT2 (default 1; 0: nmt
#        alone, no virtual environment, no conversion, no comparison: the GPU box has no
#        package registry),
#        THREADS (default 2: the CPU threads each system gets, below), DEVICE (cpu (default)
#        or cuda: nmt's parallel.device and CTranslate2's device; cuda runs one GPU each),
#        BEAMS (default "1 4"), RULES (nmt's
#        decode.beam_rule values run for each beam > 1; default "shrink full"), ALPHAS (the
#        length penalties run for each beam > 1, nmt's decode.length_penalty and CTranslate2's
#        length_penalty; default "0.6 0": 0 ranks hypotheses by log p alone, where both searches
#        must end on the same outputs, so that row compares the arithmetic alone), MAX_LEN (the
#        longest output: data.max_len - 1 of the run; default: read from config.ini of the
#        checkpoint's run directory, else 127, conf/bible-small.ini's),
#        REPEAT (default 3: interleaved runs of each system, the best CPU time reported),
#        SRC (default data/bible/test.en), SRC_IDS (SRC already as ids, one sentence a line:
#        no spm_encode needed), SPM (default data/bible/spm.model; its .vocab is read too), WORK (default: a temporary directory, removed at the end; given: kept),
#        CT2_VENV (default $BUILD/ct2-venv), CT2_PIP (default "ctranslate2": the pip
#        requirement; the venv is made and filled once).
#
# 1. a Python virtual environment with CTranslate2 from PyPI (pip), made once;
# 2. `nmt export CKPT` and tools/nmt_to_ct2.py: the same weights as a CTranslate2 model (fp32);
# 3. SRC as SentencePiece ids (spm_encode), the input of both: `nmt translate --ids` and
#    bench/ct2_translate.py (each line's pieces plus </s>, as nmt feeds `x EOS`);
# 4. for each beam, REPEAT rounds of nmt then CTranslate2: CPU seconds (user + system) of the
#    decoding alone, the model loaded — nmt's from its log line ("CPU time X s decoding": the
#    process's CPU clock from the decoders open to the last output written), CTranslate2's
#    from getrusage around translate_batch — and nmt's whole process too (/usr/bin/time:
#    start, reading the checkpoint, opening the decoders included; "process" in the table,
#    process_cpu_s in the JSON), wall seconds (nmt's whole process), and output tokens. THREADS
#    threads, arranged as each system allows: nmt THREADS decoders of one core each
#    (parallel.devices = THREADS); CTranslate2 one batch at a time on THREADS threads
#    (intra_threads, inter_threads 1) and THREADS batches at a time on one thread each
#    (inter_threads, intra_threads 1), with OMP_WAIT_POLICY=PASSIVE: with its OpenMP threads
#    spinning (the default) CTranslate2 took 458 s of CPU for the greedy run on this shared
#    2-core machine instead of 9;
# 5. greedy, and beam search without a length penalty: how many of the outputs are
#    token-identical (without a penalty a finished hypothesis outranks every longer one, so
#    nmt's search, whichever its rule, and CTranslate2's stop on the same best hypothesis).
# Both decode up to data.max_len - 1 tokens per sentence: nmt with decode.max_extra_len large
# enough not to bind first (its per-sentence src + 50 limit has no CTranslate2 counterpart),
# CTranslate2 with max_decoding_length; batches of 64 length-sorted sentences; <pad> and <s>
# never output. Beam with alpha > 0: nmt's length penalty is GNMT's ((5 + n) / 6)^alpha,
# CTranslate2's n^alpha, and CTranslate2 ends a sentence when its best candidate finishes
# (OpenNMT's early exit) where nmt searches on until no live hypothesis can still win, so the
# beams may end differently (their outputs are not compared).
# Prints a table and one JSON row per (system, decoding), appended to bench/results.jsonl, and a
# summary line. Timings decide nothing: the script fails only if a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

if (( $# < 1 )) || [[ $1 == -* ]]; then
  echo "usage: bench/ctranslate2.sh CKPT [section.key=value ...]" >&2
  exit 2
fi
CKPT=$1
shift
OVR=("$@")
BUILD=${BUILD:-build}
THREADS=${THREADS:-2}
DEVICE=${DEVICE:-cpu}
BEAMS=${BEAMS:-1 4}
RULES=${RULES:-shrink full}
ALPHAS=${ALPHAS:-0.6 0}
REPEAT=${REPEAT:-3}
SRC=${SRC:-data/bible/test.en}
SPM=${SPM:-data/bible/spm.model}
CT2_VENV=${CT2_VENV:-$BUILD/ct2-venv}
CT2_PIP=${CT2_PIP:-ctranslate2}
KEEP=1
if [[ -z ${WORK:-} ]]; then
  WORK=$(mktemp -d)
  KEEP=0
fi
mkdir -p "$WORK"
cleanup() { if (( KEEP == 0 )); then rm -rf "$WORK"; fi; }
trap cleanup EXIT

CT2=${CT2:-1}
if [[ -z ${NMT:-} ]]; then
  # CUDA, when set, goes to make as it is (CUDA=0: a CPU-only build stays one).
  make -j2 --no-print-directory "BUILD=$BUILD" ${CUDA:+"CUDA=$CUDA"} "$BUILD/nmt"
  NMT=$BUILD/nmt
fi
PY=python3
CT2_VERSION=-
if (( CT2 )); then
  if [[ ! -x $CT2_VENV/bin/python ]] || ! "$CT2_VENV/bin/python" -c 'import ctranslate2' 2>/dev/null; then
    python3 -m venv "$CT2_VENV"
    "$CT2_VENV/bin/pip" install -q "$CT2_PIP"
  fi
  PY=$CT2_VENV/bin/python
  CT2_VERSION=$("$PY" -c 'import ctranslate2; print(ctranslate2.__version__)')
  "$NMT" export "$CKPT" "$WORK/model.safetensors" 2>/dev/null
  "$PY" tools/nmt_to_ct2.py "$WORK/model.safetensors" "${SPM%.model}.vocab" "$WORK/ct2" >/dev/null
fi
if [[ -n ${SRC_IDS:-} ]]; then
  cp "$SRC_IDS" "$WORK/src.ids"
else
  spm_encode --model "$SPM" --output_format=id <"$SRC" >"$WORK/src.ids"
fi
N_SENT=$(wc -l <"$WORK/src.ids")
# The longest output both may give: data.max_len - 1 (nmt's max_out), from the run's config.
RUN_INI=$(dirname "$(dirname "$CKPT")")/config.ini
if [[ -z ${MAX_LEN:-} && -r $RUN_INI ]]; then
  MAX_LEN=$("$NMT" config --dump "$RUN_INI" "${OVR[@]}" 2>/dev/null | awk -F' *= *' '
    /^\[/ {sec = $0} sec == "[data]" && $1 == "max_len" {print $2 - 1}')
fi
MAX_LEN=${MAX_LEN:-127}
DEV_OVR=(parallel.device="$DEVICE")

# best_of FILE: the row of least cpu_s among FILE's JSON lines
best_of() { "$PY" -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(json.dumps(min(rows, key=lambda r: r["cpu_s"])))' "$1"; }

run_nmt() { # beam rule alpha out -> one JSON line
  local beam=$1 rule=$2 alpha=$3 out=$4 u s w
  /usr/bin/time -o "$WORK/time" -f '%U %S %e' "$NMT" translate "$CKPT" "${OVR[@]}" \
    "${DEV_OVR[@]}" decode.beam="$beam" decode.beam_rule="$rule" \
    decode.length_penalty="$alpha" decode.max_extra_len=100000 \
    --ids --input "$WORK/src.ids" --output "$out" 2>"$WORK/nmt.log"
  read -r u s w <"$WORK/time"
  local dec
  dec=$(sed -n 's/.*CPU time \([0-9.]*\) s decoding.*/\1/p' "$WORK/nmt.log" | tail -1)
  if [[ -z $dec ]]; then
    echo "ctranslate2.sh: no \"CPU time ... s decoding\" in nmt translate's log ($NMT too old?)" >&2
    return 1
  fi
  awk -v u="$u" -v s="$s" -v w="$w" -v d="$dec" -v n="$N_SENT" -v tok="$(wc -w <"$out")" 'BEGIN {
    printf "{\"cpu_s\": %.3f, \"process_cpu_s\": %.3f, \"wall_s\": %.3f, ", d, u + s, w
    printf "\"sentences\": %d, \"tokens\": %d}\n", n, tok }'
}

run_ct2() { # beam inter intra alpha out -> one JSON line
  OMP_WAIT_POLICY=PASSIVE "$PY" bench/ct2_translate.py "$WORK/ct2" "$WORK/src.ids" "$5" "$1" \
    "$2" "$3" "$DEVICE" "$MAX_LEN" "$4"
}

COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
# Dirty = code or config differs from HEAD; this bench's own outputs and docs do not count.
if [[ -n "$(git status --porcelain -- src include cuda bench conf Makefile \
             ':!bench/results.jsonl' ':!bench/*.md' 2>/dev/null)" ]]; then
  COMMIT="$COMMIT-dirty"
fi
DATE=$(date -u +%Y-%m-%dT%H:%MZ)
HOST_CPU=$(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)
# The arrangements of THREADS threads: nmt's decoders (parallel.devices; on the CPU one core
# each), CTranslate2's one batch on THREADS threads (intra) and THREADS batches at once
# (inter). One GPU: one decoder each.
if [[ $DEVICE == cpu ]]; then
  NMT_ARR="$THREADS decoders x 1 thread"
  DEV_OVR+=(parallel.devices="$THREADS")
  CT2_ARRS=("1 $THREADS" "$THREADS 1")
else
  NMT_ARR="1 GPU"
  CT2_ARRS=("1 1")
fi
(( CT2 )) || CT2_ARRS=()
ct2_name() { # inter intra
  if [[ $DEVICE != cpu ]]; then echo "1 GPU"; elif (( $1 == 1 )); then
    echo "1 batch x $2 threads"; else echo "$1 batches x 1 thread"; fi
}
ROWS=()
IDENT=""
IDENT0=""
for beam in $BEAMS; do
  read -r -a rules <<<"$RULES"
  read -r -a alphas <<<"$ALPHAS"
  (( beam == 1 )) && rules=(shrink) && alphas=(0)
  for alpha in "${alphas[@]}"; do
    for rule in "${rules[@]}"; do
      tag=$beam.$rule.$alpha
      : >"$WORK/nmt.$tag.jsonl"
      for arr in "${CT2_ARRS[@]}"; do : >"$WORK/ct2.$beam.$alpha.${arr// /x}.jsonl"; done
      for ((r = 0; r < REPEAT; r++)); do
        run_nmt "$beam" "$rule" "$alpha" "$WORK/nmt.$tag.ids" >>"$WORK/nmt.$tag.jsonl"
        [[ $rule == "${rules[0]}" ]] || continue # CTranslate2 has one rule: once per beam, alpha
        for arr in "${CT2_ARRS[@]}"; do
          read -r inter intra <<<"$arr"
          run_ct2 "$beam" "$inter" "$intra" "$alpha" "$WORK/ct2.$beam.$alpha.ids" \
            >>"$WORK/ct2.$beam.$alpha.${arr// /x}.jsonl"
        done
      done
      ROWS+=("nmt|$NMT_ARR|$beam|$rule|$alpha|$(best_of "$WORK/nmt.$tag.jsonl")")
      if [[ $rule == "${rules[0]}" ]]; then
        for arr in "${CT2_ARRS[@]}"; do
          read -r inter intra <<<"$arr"
          ROWS+=("ctranslate2 $CT2_VERSION|$(ct2_name "$inter" "$intra")|$beam|-|$alpha|$(best_of \
            "$WORK/ct2.$beam.$alpha.${arr// /x}.jsonl")")
        done
      fi
      # Token-identical outputs where both searches must agree: greedy, and a beam without a
      # length penalty (each rule of nmt against CTranslate2's).
      if (( CT2 )) && [[ $alpha == 0 || $alpha == 0.0 ]]; then
        same=$(paste -d '|' "$WORK/nmt.$tag.ids" "$WORK/ct2.$beam.$alpha.ids" |
               awk -F'|' '$1 == $2 {k++} END {printf "%d of %d", k, NR}')
        if (( beam == 1 )); then IDENT=$same; else IDENT0+="${IDENT0:+; }beam $beam $rule: $same"; fi
      fi
    done
  done
done

LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
echo
echo "nmt vs CTranslate2 $CT2_VERSION: $N_SENT sentences of $SRC, $DEVICE, $THREADS threads"
echo "nmt's overrides: ${OVR[*]:-none} (precision.mode applies on a GPU; the CPU infers in fp32)"
echo "checkpoint $CKPT; nmt $COMMIT; $DATE; load average $LOAD; best of $REPEAT (CPU seconds)"
echo "cpu_s: CPU seconds of the decoding alone; process: nmt's whole process"
echo "cpu: $HOST_CPU"
printf '%-20s %-24s %-5s %-7s %-5s %8s %8s %8s %12s %9s %7s\n' system arrangement beam rule \
  alpha cpu_s process wall_s sentences/s tokens/s tokens
for row in "${ROWS[@]}"; do
  IFS='|' read -r sys arr beam rule alpha js <<<"$row"
  "$PY" -c '
import json, sys
sys_, arr, beam, rule, alpha, js = sys.argv[1:7]
r = json.loads(js)
w = r["wall_s"]
proc = "%.2f" % r["process_cpu_s"] if "process_cpu_s" in r else "-"
print("%-20s %-24s %-5s %-7s %-5s %8.2f %8s %8.2f %12.1f %9.1f %7d" % (sys_, arr, beam,
      rule if beam != "1" else "-", alpha if beam != "1" else "-", r["cpu_s"], proc, w,
      r["sentences"] / w, r["tokens"] / w, r["tokens"]))' "$sys" "$arr" "$beam" "$rule" \
    "$alpha" "$js"
  "$PY" -c '
import json, sys
sys_, arr, beam, rule, alpha, js, extra = sys.argv[1:8]
r = json.loads(js)
r.update(json.loads(extra))
r.update({"bench": "ctranslate2", "system": sys_, "arrangement": arr, "beam": int(beam),
          "rule": rule if beam != "1" and rule != "-" else None,
          "length_penalty": float(alpha) if beam != "1" else None})
print(json.dumps(r))' "$sys" "$arr" "$beam" "$rule" "$alpha" "$js" \
    "{\"device\": \"$DEVICE\", \"threads\": $THREADS, \"commit\": \"$COMMIT\", \"date\": \"$DATE\", \"load\": \"$LOAD\", \"ckpt\": \"$CKPT\", \"repeat\": $REPEAT}" \
    >>bench/results.jsonl
done
[[ -n $IDENT ]] && echo "greedy outputs token-identical: $IDENT"
[[ -n $IDENT0 ]] && echo "beam outputs without a length penalty token-identical: $IDENT0"
echo "ctranslate2.sh: done ($N_SENT sentences, beams $BEAMS; rows appended to bench/results.jsonl)"
