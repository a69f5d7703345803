#!/usr/bin/env bash
# bench/peer-sockeye.sh — nmt next to Sockeye 3.1.34 (PyTorch 1.13, CPU) on the same machine, the
# same SentencePiece pieces of the Bible corpus and the same model and schedule
# (conf/bible-small.ini), as a user of each would run it (`make bench-sockeye`).
#
# usage: bench/peer-sockeye.sh
# env:   UPDATES (default 480: updates of the full comparison), VALID_EVERY (default 120:
#        validations and checkpoints of the full runs; must divide UPDATES), STEPS (default 30)
#        and WARMUP (default 5): the timed runs' updates and the first ones left out of the
#        figure, REPEAT (default 1: interleaved timed runs of each system, the best reported),
#        THREADS (Sockeye's torch/OpenBLAS threads; default: the machine's cores), TEST_LINES
#        (default 0 = all 649 test verses), SOCKEYE_BATCH (default 4416: --batch-size, max-word;
#        the issue's 4096 gives ~7% fewer target tokens per update than nmt's bible-small,
#        4416 ~1% fewer: bench/README.md, "effective batch"),
#        PARTS (default "timing full"), OUT (default build/peer-sockeye), VENV (default
#        build/venv-sockeye), RESULTS (default bench/results.jsonl; /dev/null for a smoke test)
#
# 1. installs what is missing: Debian's python3-torch (1.13.1; Sockeye 3.1.34 wants torch < 1.14)
#    and a venv made from /usr/bin/python3 with --system-site-packages holding sockeye==3.1.34
#    and sentencepiece (pip); builds build/nmt and prepares data/bible if needed;
# 2. encodes the Bible splits with the SentencePiece library into pieces (as spm_encode
#    --output_format=piece) with the project's model, checks lines and pieces against the
#    shards nmt trains on, writes a Sockeye vocabulary with the same 8000 ids, and runs
#    sockeye-prepare-data once (cached in OUT/data, keyed by the model and the raw text);
# 3. timing (PARTS has "timing"): REPEAT x (nmt, then Sockeye) runs of STEPS updates each, no
#    validation in between; target tokens/s and s/update over updates WARMUP+1..STEPS;
# 4. full (PARTS has "full"): one run of each for UPDATES updates, validating and saving every
#    VALID_EVERY; valid perplexity = exp(unsmoothed NLL per target token, EOS included) for both
#    (nmt: valid_ppl of metrics.jsonl; Sockeye: sockeye-score of each checkpoint, because its own
#    perplexity-val is label-smoothed and averaged per batch); elapsed training seconds at each
#    validation, the time each needs to reach the worse of the two final perplexities; test
#    translation with beam 4 and GNMT's length penalty (alpha 0.6, beta 5) from the last
#    update, detokenized, scored by sacreBLEU (BLEU, chrF2);
# 5. prints the side-by-side table and appends one JSON row per system to RESULTS.
# Everything is in bench/README.md ("peer-sockeye.sh"): the flag mapping, what differs, the
# effective batch. Timings never decide anything: the script fails only if a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

CONF=conf/bible-small.ini
UPDATES=${UPDATES:-480}
VALID_EVERY=${VALID_EVERY:-120}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-5}
REPEAT=${REPEAT:-1}
CORES=$(nproc)
THREADS=${THREADS:-$CORES}
TEST_LINES=${TEST_LINES:-0}
SOCKEYE_BATCH=${SOCKEYE_BATCH:-4416}
PARTS=${PARTS:-"timing full"}
OUT=${OUT:-build/peer-sockeye}
VENV=${VENV:-build/venv-sockeye}
RESULTS=${RESULTS:-bench/results.jsonl}
SOCKEYE_VERSION=3.1.34
D=data/bible

if [[ $# -gt 0 ]]; then
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
if (( WARMUP < 1 || STEPS <= WARMUP )); then
  echo "peer-sockeye: need 1 <= WARMUP < STEPS (got WARMUP=$WARMUP STEPS=$STEPS)" >&2
  exit 2
fi
if (( VALID_EVERY < 1 || UPDATES % VALID_EVERY != 0 )); then
  echo "peer-sockeye: VALID_EVERY=$VALID_EVERY must divide UPDATES=$UPDATES" >&2
  exit 2
fi
has_part() { [[ " $PARTS " == *" $1 "* ]]; }

# -- 1. install
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "== installing python3-torch (apt)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-torch
fi
VPY=$VENV/bin/python
if ! "$VPY" -c "import sockeye, sentencepiece, sacrebleu
assert sockeye.__version__ == '$SOCKEYE_VERSION'" 2>/dev/null; then
  echo "== installing sockeye==$SOCKEYE_VERSION and sentencepiece into $VENV (pip)"
  /usr/bin/python3 -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" install -q "sockeye==$SOCKEYE_VERSION" sentencepiece
fi
TORCH_VERSION=$("$VPY" -c 'import torch; print(torch.__version__)')
make -j2 --no-print-directory build/nmt
if [[ ! -f $D/train.shard ]]; then
  tools/prepare-bible.sh
fi

# -- 2. pieces, vocabulary, Sockeye's prepared data (cached)
P=$OUT/data
key=$(cat $D/spm.model $D/{train,valid,test}.{en,es} bench/peer_sockeye.py | md5sum |
      cut -d' ' -f1)
if [[ "$(cat "$P/key" 2>/dev/null)" != "$key" ]]; then
  echo "== SentencePiece pieces of $D (library encode, out_type=str) -> $P"
  rm -rf "$P"
  "$VPY" bench/peer_sockeye.py encode $D/spm.model "$P" "train:$D/train.en:$D/train.es" \
    "valid:$D/valid.en:$D/valid.es" "test:$D/test.en:$D/test.es"
  # The pieces must be the ids nmt trains on: same lines and pieces as the shards.
  for s in train valid test; do
    want=$(build/nmt shard-info $D/$s.shard | head -n 1 |
           sed -E 's/.*: ([0-9]+) pairs.* ([0-9]+) source ids, ([0-9]+) target ids/\1 \2 \3/')
    got=$("$VPY" -c "import json; c = json.load(open('$P/counts.json'))
print(c['$s.src']['lines'], c['$s.src']['pieces'], c['$s.tgt']['pieces'])")
    if [[ "$want" != "$got" ]]; then
      echo "peer-sockeye: $s: pieces (lines, src, tgt) $got, $D/$s.shard has $want" >&2
      exit 1
    fi
  done
  echo "== sockeye-prepare-data"
  OMP_NUM_THREADS=1 "$VENV/bin/sockeye-prepare-data" --source "$P/train.src" \
    --target "$P/train.tgt" --shared-vocab --source-vocab "$P/vocab.json" \
    --target-vocab "$P/vocab.json" --max-seq-len 127:127 --seed 1 --output "$P/prepared" \
    > "$P/prepare.log" 2>&1 || { tail -20 "$P/prepare.log" >&2; exit 1; }
  echo "$key" > "$P/key"
fi

W=$OUT/run
rm -rf "$W"
mkdir -p "$W"
if (( TEST_LINES > 0 )); then
  head -n "$TEST_LINES" $D/test.en > "$W/test.en"
  head -n "$TEST_LINES" $D/test.es > "$W/test.es"
  head -n "$TEST_LINES" "$P/test.src" > "$W/test.src"
  head -n "$TEST_LINES" "$P/test.tgt" > "$W/test.tgt"
else
  cp $D/test.en $D/test.es "$W/"
  cp "$P/test.src" "$P/test.tgt" "$W/"
fi

# conf/bible-small.ini as Sockeye flags (bench/README.md has the table and what differs).
SOCKEYE_MODEL=(--use-cpu --seed 1 --shared-vocab --weight-tying-type src_trg_softmax
  --num-layers 3:3 --transformer-model-size 256 --transformer-attention-heads 4
  --transformer-feed-forward-num-hidden 1024 --num-embed 256
  --transformer-positional-embedding-type fixed --transformer-preprocess n
  --transformer-postprocess dr --transformer-dropout-prepost 0.1
  --transformer-dropout-attention 0 --transformer-dropout-act 0 --max-seq-len 127:127
  --batch-type max-word --batch-size "$SOCKEYE_BATCH" --optimizer-betas 0.9:0.98
  --optimizer-eps 1e-9 --gradient-clipping-type none --initial-learning-rate 0.0625
  --learning-rate-scheduler-type inv-sqrt-decay --learning-rate-warmup 250
  --label-smoothing 0.1 --label-smoothing-impl torch
  --decode-and-evaluate 0)  # nmt validates with the loss only (train.valid_bleu = false)
# torch's GEMMs go to Debian's OpenBLAS, whose pool torch.set_num_threads does not size: pin
# both; OMP_WAIT_POLICY=PASSIVE keeps torch's idle OpenMP workers off the cores OpenBLAS needs
# (bench/README.md, cpu-throughput.sh's fairness notes): Sockeye's better case.
SOCKEYE_ENV=(env OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS="$THREADS"
  OPENBLAS_NUM_THREADS="$THREADS")

run_nmt() { # dir, overrides...
  local dir=$1
  shift
  build/nmt train "$CONF" run.out_dir="$dir" "$@" 2> "$dir.log" ||
    { tail -20 "$dir.log" >&2; exit 1; }
}
run_sockeye() { # dir, updates, checkpoint interval
  local dir=$1
  mkdir -p "$dir"
  # The step log sits next to the model directory: --overwrite-output empties the directory.
  "${SOCKEYE_ENV[@]}" "$VPY" bench/peer_sockeye.py train --step-log "$dir.steps.jsonl" -- \
    "${SOCKEYE_MODEL[@]}" --prepared-data "$P/prepared" --validation-source "$P/valid.src" \
    --validation-target "$P/valid.tgt" --output "$dir" --overwrite-output \
    --max-updates "$2" --checkpoint-interval "$3" > "$dir.log" 2>&1 ||
    { tail -20 "$dir.log" >&2; exit 1; }
}
tail_bucket_info() { # sockeye log: its batch sizes per bucket, once
  echo "  Sockeye's batches per bucket (training data, then validation data):"
  grep -E "Bucket \([0-9]+, [0-9]+\)" "$1" | sed -E 's/^\[[^]]*\] //; s/^/  /' | head -16 || true
}

read -r LOAD1 _ < /proc/loadavg
if awk -v l="$LOAD1" 'BEGIN{exit !(l > 0.5)}'; then
  echo "peer-sockeye: warning: load average $LOAD1 before timing: other processes share" \
       "the cores, the figures below will be low and noisy" >&2
fi

# -- 3. timing: interleaved, so slow drift in the machine's load hits both alike
if has_part timing; then
  mkdir -p "$W/timing"
  for r in $(seq 1 "$REPEAT"); do
    echo "== timing $r/$REPEAT: nmt, $STEPS updates"
    run_nmt "$W/timing/nmt.$r" train.max_steps="$STEPS" train.log_every="$WARMUP" \
      train.valid_every=0 train.save_every=0
    echo "== timing $r/$REPEAT: sockeye, $STEPS updates"
    run_sockeye "$W/timing/sockeye.$r" "$STEPS" "$STEPS"
    (( r == 1 )) && tail_bucket_info "$W/timing/sockeye.1.log"
  done
fi

# -- 4. full comparison: one run each
if has_part full; then
  F=$W/full
  mkdir -p "$F"
  echo "== full: nmt, $UPDATES updates, validation every $VALID_EVERY"
  t0=$(date +%s)
  run_nmt "$F/nmt" train.max_steps="$UPDATES" train.log_every=1 \
    train.valid_every="$VALID_EVERY" train.save_every="$VALID_EVERY"
  echo "  $(( $(date +%s) - t0 )) s wall"
  echo "== full: sockeye, $UPDATES updates, checkpoint every $VALID_EVERY"
  t0=$(date +%s)
  run_sockeye "$F/sockeye" "$UPDATES" "$VALID_EVERY"
  echo "  $(( $(date +%s) - t0 )) s wall"
  has_part timing || tail_bucket_info "$F/sockeye.log"
  echo "== sockeye-score: unsmoothed NLL of the valid set at each checkpoint"
  for (( ck = 1; ck <= UPDATES / VALID_EVERY; ck++ )); do
    # sockeye-score loads DIR/params.best: a directory whose params.best is checkpoint ck.
    m=$F/sockeye-ck.$ck
    mkdir -p "$m"
    for f in "$F"/sockeye/*; do
      case ${f##*/} in params.*|training_state|decode.*|log) ;; *) ln -s "$(realpath "$f")" "$m/" ;; esac
    done
    ln -s "$(realpath "$(printf '%s/sockeye/params.%05d' "$F" "$ck")")" "$m/params.best"
    "${SOCKEYE_ENV[@]}" "$VENV/bin/sockeye-score" --use-cpu -m "$m" --source "$P/valid.src" \
      --target "$P/valid.tgt" --length-penalty-alpha 0 --length-penalty-beta 0 \
      --score-type neglogprob --output-type score --batch-size 64 --output "$m.scores" \
      > "$m.log" 2>&1 || { tail -20 "$m.log" >&2; exit 1; }
    "$VPY" bench/peer_sockeye.py nll "$m.scores" "$P/valid.tgt" \
      > "$F/sockeye-nll.$(( ck * VALID_EVERY ))"
  done
  echo "== translate $(wc -l < "$W/test.en") test verses, beam 4, length penalty 0.6 (GNMT)"
  t0=$(date +%s.%N)
  build/nmt translate "$CONF" run.out_dir="$F/nmt" --input "$W/test.en" \
    --output "$F/nmt.hyp" 2> "$F/nmt.translate.log" || { tail "$F/nmt.translate.log" >&2; exit 1; }
  awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f\n", b-a}' > "$F/nmt.translate_s"
  t0=$(date +%s.%N)
  "${SOCKEYE_ENV[@]}" "$VENV/bin/sockeye-translate" --use-cpu -m "$F/sockeye" \
    --checkpoints $(( UPDATES / VALID_EVERY )) --beam-size 4 --length-penalty-alpha 0.6 \
    --length-penalty-beta 5 --batch-size 64 --output-type translation \
    --input "$W/test.src" --output "$F/sockeye.hyp.pieces" > "$F/sockeye.translate.log" 2>&1 ||
    { tail "$F/sockeye.translate.log" >&2; exit 1; }
  awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f\n", b-a}' > "$F/sockeye.translate_s"
  "$VPY" bench/peer_sockeye.py decode $D/spm.model "$F/sockeye.hyp.pieces" "$F/sockeye.hyp"
  for s in nmt sockeye; do
    "$VENV/bin/sacrebleu" "$W/test.es" -i "$F/$s.hyp" -m bleu chrf -w 2 > "$F/$s.bleu.json"
  done
  for i in 1 2; do
    printf '  EN : %s\n  REF: %s\n  nmt: %s\n  sockeye: %s\n' "$(sed -n ${i}p "$W/test.en")" \
      "$(sed -n ${i}p "$W/test.es")" "$(sed -n ${i}p "$F/nmt.hyp")" \
      "$(sed -n ${i}p "$F/sockeye.hyp")"
  done
fi
read -r LOAD1_AFTER _ < /proc/loadavg

# -- 5. report
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [[ -n "$(git status --porcelain -- src include cuda bench conf Makefile \
             ':!bench/results.jsonl' ':!bench/*.md' 2>/dev/null)" ]]; then
  commit="$commit-dirty"
fi
cpu=$(awk -F': *' '/^model name/{print $2; exit}' /proc/cpuinfo)
DEVICES=$(build/nmt config --dump "$CONF" |
  awk -F' *= *' '/^\[/{s=$0} s=="[parallel]" && $1=="devices"{v=$2} END{print v}')
"$VPY" - "$W/meta.json" <<EOF
import json, sys
json.dump(dict(commit="$commit", device="$cpu, $CORES cores", cores=$CORES, threads=$THREADS,
               config="$CONF", steps=$STEPS, warmup=$WARMUP, repeat=$REPEAT,
               valid_every=$VALID_EVERY, updates=$UPDATES,
               test_lines=$(wc -l < "$W/test.en"), load_before=$LOAD1, load_after=$LOAD1_AFTER,
               sockeye_version="$SOCKEYE_VERSION (torch $TORCH_VERSION)",
               variants=dict(nmt="$DEVICES workers x 1 BLAS thread",
                             sockeye="--use-cpu, $THREADS torch/OpenBLAS threads, max-word $SOCKEYE_BATCH")),
          open(sys.argv[1], "w"))
EOF
"$VPY" bench/peer_sockeye.py report "$W" "$W/meta.json" "$RESULTS"
