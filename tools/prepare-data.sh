#!/usr/bin/env bash
# Moses-style parallel text -> one joint SentencePiece model -> binary shards for nmt.
#
#   tools/prepare-data.sh --name wmt14 --src en --tgt de --vocab 32000 \
#       --train data/wmt14/raw/train --valid data/wmt14/raw/newstest2013 \
#       [--test data/wmt14/raw/newstest2014] --out data/wmt14
#
# PREFIX.SRC and PREFIX.TGT are aligned plain-text files, one sentence per line (e.g.
# train.en / train.de). Writes OUT/spm.model, OUT/spm.vocab, OUT/{train,valid,test}.shard
# (docs/formats.md; each records its SentencePiece model, which `nmt train` checks against
# data.spm_model), the raw valid/test text as OUT/{valid,test}.{SRC,TGT} (where `nmt eval
# --split` looks for it) and OUT/data.ini: the corpus' [data] keys and [model] vocab, a config
# to give after a model's, whose keys it replaces (`nmt train conf/bible-small.ini OUT/data.ini
# run.out_dir=runs/NAME`). Training pairs with an empty side or a length ratio above
# --max-ratio are left out, as Moses' clean-corpus-n.perl does, and counted per reason; valid
# and test keep every line (line i is pair i for BLEU). Idempotent: a step runs only when its
# outputs are missing or older than its inputs (or its settings changed), so a second run is
# quick.
#
# Options (defaults in brackets):
#   --model-type unigram|bpe   SentencePiece algorithm [unigram; Kudo 2018]. The paper used
#                              byte-pair encoding (Vaswani et al. 2017 §5.1: BPE, shared 37000
#                              vocabulary for En-De); either works with nmt.
#   --max-sentences N          spm_train samples at most N sentences (shuffled) from the two
#                              training files together [2000000]; 0 = use all lines.
#   --max-line-bytes N         longer training lines are left out of SentencePiece's training
#                              (spm_train --max_sentence_length) and reported with their line
#                              numbers; they are still encoded [4192, spm_train's default]
#   --threads N                spm_train threads [2]
#   --max-ratio R              leave out training pairs whose one side has more than R times
#                              the SentencePiece pieces of the other [9, clean-corpus-n's]
#   --nmt PATH                 the nmt binary that writes shards [build/nmt next to tools/]
# Ids: <pad>=0 <unk>=1 <s>=2 (BOS) </s>=3 (EOS), as include/nmt/config.h expects.
# Input must be UTF-8: a file with an invalid line is refused, naming the file and the lines.
# Exit codes, as nmt's (README "Exit codes"): 0 done, 2 usage (bad or missing option, an input
# file missing, SentencePiece or nmt not found), 3 data (line counts differ, an empty file,
# invalid UTF-8, SentencePiece or `nmt shard` refused the data), 6 I/O (OUT not writable, a
# write failed: a full disk).
set -euo pipefail

# die CODE MESSAGE: one error line, the exit code of nmt's table.
die() {
  local code=$1
  shift
  echo "prepare-data: error: $*" >&2
  exit "$code"
}
warn() { echo "prepare-data: warning: $*" >&2; }
usage() {
  sed -n '2,38p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
}

NAME='' SRC='' TGT='' VOCAB='' TRAIN='' VALID='' TEST='' OUT=''
MODEL_TYPE=unigram MAX_SENTENCES=2000000 THREADS=2 MAX_LINE_BYTES=4192 MAX_RATIO=9
NMT=${NMT:-$(cd "$(dirname "$0")/.." && pwd)/build/nmt}
while [ $# -gt 0 ]; do
  case "$1" in -h | --help) usage ;; esac
  [ $# -ge 2 ] || die 2 "$1 needs a value (see --help)"
  case "$1" in
    --name) NAME=$2 ;;
    --src) SRC=$2 ;;
    --tgt) TGT=$2 ;;
    --vocab) VOCAB=$2 ;;
    --train) TRAIN=$2 ;;
    --valid) VALID=$2 ;;
    --test) TEST=$2 ;;
    --out) OUT=$2 ;;
    --model-type) MODEL_TYPE=$2 ;;
    --max-sentences) MAX_SENTENCES=$2 ;;
    --threads) THREADS=$2 ;;
    --max-line-bytes) MAX_LINE_BYTES=$2 ;;
    --max-ratio) MAX_RATIO=$2 ;;
    --nmt) NMT=$2 ;;
    *) die 2 "unknown option $1 (see --help)" ;;
  esac
  shift 2
done
for v in NAME SRC TGT VOCAB TRAIN VALID OUT; do
  [ -n "${!v}" ] || die 2 "--${v,,} is required (see --help)"
done
if ! [[ "$VOCAB" =~ ^[1-9][0-9]*$ ]] || [ "$VOCAB" -lt 8 ]; then
  die 2 "--vocab $VOCAB: expected an integer >= 8"
fi
[[ "$MAX_SENTENCES" =~ ^[0-9]+$ ]] || die 2 "--max-sentences $MAX_SENTENCES: expected an integer"
[[ "$THREADS" =~ ^[1-9][0-9]*$ ]] || die 2 "--threads $THREADS: expected a positive integer"
[[ "$MAX_LINE_BYTES" =~ ^[1-9][0-9]*$ ]] ||
  die 2 "--max-line-bytes $MAX_LINE_BYTES: expected a positive integer"
[[ "$MAX_RATIO" =~ ^[1-9][0-9]*(\.[0-9]+)?$ ]] ||
  die 2 "--max-ratio $MAX_RATIO: expected a number >= 1"
case "$MODEL_TYPE" in
  unigram | bpe) ;;
  *) die 2 "--model-type $MODEL_TYPE: expected unigram or bpe" ;;
esac
[ "$SRC" != "$TGT" ] || die 2 "--src and --tgt are both '$SRC'"
# spm_train trains the model; nmt encodes with SentencePiece's library (no spm_encode).
command -v spm_train >/dev/null ||
  die 2 "spm_train not found: install SentencePiece (tools/install-deps.sh)"


splits=(train valid)
declare -A prefix=([train]=$TRAIN [valid]=$VALID)
if [ -n "$TEST" ]; then
  splits+=(test)
  prefix[test]=$TEST
fi
for s in "${splits[@]}"; do
  for l in "$SRC" "$TGT"; do
    p=${prefix[$s]}
    if ! [ -f "$p.$l" ] || ! [ -r "$p.$l" ]; then
      die 2 "$s: missing file $p.$l (--$s $p expects $p.$SRC and $p.$TGT)"
    fi
  done
done

# newer TARGET DEP...: TARGET exists and is newer than every DEP.
newer() {
  local t=$1 d
  shift
  [ -e "$t" ] || return 1
  for d in "$@"; do [ "$d" -nt "$t" ] && return 1; done
  return 0
}
# Counts lines like `wc -l`, but also a last line without a newline.
count_lines() { awk 'END { print NR }' "$1"; }

mkdir -p "$OUT" 2>/dev/null && [ -w "$OUT" ] || die 6 "--out $OUT: cannot create or write it"
model=$OUT/spm.model
settings=$OUT/spm.settings
shard_of() { echo "$OUT/$1.shard"; }

# The settings stamp changes (and so forces a retrain) only when a setting does.
want="name=$NAME src=$SRC tgt=$TGT vocab=$VOCAB model_type=$MODEL_TYPE max_sentences=$MAX_SENTENCES"
[ "$MAX_LINE_BYTES" = 4192 ] || want+=" max_line_bytes=$MAX_LINE_BYTES"
[ -f "$settings" ] && [ "$(cat "$settings")" = "$want" ] || echo "$want" >"$settings" ||
  die 6 "cannot write $settings"
# The cleaning stamp: a new --max-ratio re-makes the training shard only.
clean=$OUT/clean.settings
[ -f "$clean" ] && [ "$(cat "$clean")" = "max_ratio=$MAX_RATIO" ] ||
  echo "max_ratio=$MAX_RATIO" >"$clean" || die 6 "cannot write $clean"

train_files=("${prefix[train]}.$SRC" "${prefix[train]}.$TGT")
need_model=1
newer "$model" "${train_files[@]}" "$settings" && newer "$OUT/spm.vocab" "$model" && need_model=0
# Shards this nmt would write otherwise are rewritten (docs/formats.md "Shard format"): one of
# an older format version (header bytes 8..11; version 1 has no checksums, so nmt cannot verify
# it on open), or one from before shards recorded their SentencePiece model's hash (bytes
# 20..23 zero), which nmt train could not check against data.spm_model.
SHARD_VERSION=2 # NMT_SHARD_VERSION in include/nmt/data.h
old_format() {
  local v
  v=$(od -A n -t u4 -j 8 -N 4 "$1" 2>/dev/null | tr -d ' ')
  [ "$v" = "$SHARD_VERSION" ] && return 1
  echo "prepare-data: $NAME: $1: format version ${v:-unknown}, this nmt writes $SHARD_VERSION" \
    "(with checksums): rewriting it"
}
no_model_hash() {
  [ "$(od -A n -t x4 -j 20 -N 4 "$1" 2>/dev/null | tr -d ' ')" = 00000000 ]
}
need_shard=()
for s in "${splits[@]}"; do
  deps=("$model" "${prefix[$s]}.$SRC" "${prefix[$s]}.$TGT")
  [ "$s" != train ] || deps+=("$clean")
  if [ $need_model = 1 ] || ! newer "$(shard_of "$s")" "${deps[@]}" ||
    old_format "$(shard_of "$s")" || no_model_hash "$(shard_of "$s")"; then
    need_shard+=("$s")
  fi
done
# The raw valid/test text next to its shard, where `nmt eval --split` looks (OUT/SPLIT.LANG),
# and OUT/data.ini: cheap, so checked on every run.
place_raw_and_ini() {
  local s l from to
  for s in "${splits[@]}"; do
    [ "$s" != train ] || continue
    for l in "$SRC" "$TGT"; do
      from=${prefix[$s]}.$l to=$OUT/$s.$l
      [ "$from" -ef "$to" ] && continue
      newer "$to" "$from" && continue
      { cp -f "$from" "$to.tmp" && mv -f "$to.tmp" "$to"; } 2>/dev/null || {
        rm -f "$to.tmp"
        die 6 "cannot write $to (the raw $s text for nmt eval --split)"
      }
    done
  done
  local ini=$OUT/data.ini test='""'
  # Without --test, test = "" (none): the model config's own test shard is another corpus's.
  [ -z "$TEST" ] || test="\"$(shard_of test)\""
  {
    echo "; $ini — corpus $NAME ($SRC -> $TGT), written by tools/prepare-data.sh. Give it after a"
    echo "; model config, whose [data] keys and [model] vocab it replaces (paths are relative to"
    echo "; where nmt runs):"
    echo ";   $(train_command)"
    echo "[data]"
    echo "train = \"$(shard_of train)\""
    echo "valid = \"$(shard_of valid)\""
    echo "test = $test"
    echo "spm_model = \"$model\""
    echo
    echo "[model]"
    echo "vocab = $VOCAB"
  } >"$ini.tmp" 2>/dev/null && mv -f "$ini.tmp" "$ini" || {
    rm -f "$ini.tmp"
    die 6 "cannot write $ini"
  }
}

# The command that trains on this corpus: a model config, then OUT/data.ini (later wins).
train_command() { echo "nmt train conf/bible-small.ini $OUT/data.ini run.out_dir=runs/$NAME"; }

if [ $need_model = 0 ] && [ ${#need_shard[@]} = 0 ]; then
  place_raw_and_ini
  echo "prepare-data: $NAME: $OUT is up to date; train with a model config first, e.g."
  echo "  $(train_command)"
  exit 0
fi

# "line 3, 17, 40 (5 lines in all)": the first few of the line numbers on stdin.
some_lines() {
  awk '{ n++; if (n <= 5) l = l (n > 1 ? ", " : "") $1 }
       END { more = (n > 5) ? " ... (" n " lines in all)" : ""
             printf "line%s %s%s", ((n > 1) ? "s" : ""), l, more }'
}

t0=$(date +%s)
# Bad input fails here, before any work: aligned files must have equal line counts, and text
# must be UTF-8 (grep in a UTF-8 locale: -x '.*' cannot match a line with an invalid byte).
declare -A lines
for s in "${splits[@]}"; do
  ns=$(count_lines "${prefix[$s]}.$SRC")
  nt=$(count_lines "${prefix[$s]}.$TGT")
  [ "$ns" = "$nt" ] ||
    die 3 "$s: line counts differ: ${prefix[$s]}.$SRC has $ns lines, ${prefix[$s]}.$TGT has $nt"
  [ "$ns" -gt 0 ] || die 3 "$s: ${prefix[$s]}.$SRC is empty"
  lines[$s]=$ns
  for l in "$SRC" "$TGT"; do
    f=${prefix[$s]}.$l
    bad=$(LC_ALL=C.UTF-8 grep -naxv '.*' "$f" | cut -d: -f1 || true)
    [ -z "$bad" ] || die 3 "$s: $f: invalid UTF-8 on $(some_lines <<<"$bad")"
  done
done
# Lines spm_train would skip: reported, not refused (they are still encoded).
for l in "$SRC" "$TGT"; do
  f=${prefix[train]}.$l
  long=$(LC_ALL=C awk -v max="$MAX_LINE_BYTES" 'length($0) > max { print NR }' "$f")
  [ -z "$long" ] || warn "train: $f: $(some_lines <<<"$long") longer than $MAX_LINE_BYTES bytes" \
    "(--max-line-bytes): left out of SentencePiece's training, still encoded"
done
[ -x "$NMT" ] ||
  die 2 "$NMT not found or not executable: build it first (make build/nmt) or pass --nmt"

if [ $need_model = 1 ]; then
  echo "prepare-data: $NAME: SentencePiece ($MODEL_TYPE, vocab $VOCAB) on ${train_files[*]}"
  tmp=$OUT/.spm-tmp
  spm_args=(--input="${train_files[0]},${train_files[1]}" --model_prefix="$tmp"
    --vocab_size="$VOCAB" --model_type="$MODEL_TYPE" --character_coverage=1.0
    --pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3 --num_threads="$THREADS" --random_seed=1
    --max_sentence_length="$MAX_LINE_BYTES")
  if [ "$MAX_SENTENCES" -gt 0 ] && [ $((lines[train] * 2)) -gt "$MAX_SENTENCES" ]; then
    spm_args+=(--input_sentence_size="$MAX_SENTENCES" --shuffle_input_sentence=true)
  fi
  if ! spm_train "${spm_args[@]}" >"$OUT/spm_train.log" 2>&1; then
    tail -n 5 "$OUT/spm_train.log" >&2
    die 3 "spm_train failed (full log: $OUT/spm_train.log)"
  fi
  # spm_train exits 0 when its writes fail, leaving a model cut short: a full disk must not
  # pass for a data error later, so make sure OUT still takes a few MiB.
  probe=$OUT/.space-probe
  head -c 4194304 /dev/zero 2>/dev/null >"$probe" || {
    rm -f "$probe" "$tmp.model" "$tmp.vocab"
    die 6 "cannot write to $OUT (is the disk full? spm_train does not report failed writes)"
  }
  rm -f "$probe"
  got=$(count_lines "$tmp.vocab")
  [ "$got" = "$VOCAB" ] ||
    die 3 "spm_train made $got pieces, asked for $VOCAB (see $OUT/spm_train.log)"
  mv -f "$tmp.vocab" "$OUT/spm.vocab" && mv -f "$tmp.model" "$model" ||
    die 6 "cannot move the SentencePiece model into $OUT"
fi

for s in "${need_shard[@]}"; do
  # nmt encodes both sides with the SentencePiece library, records the model's hash, leaves out
  # what the cleaning says (training data only) and says what failed (once); its exit code is
  # already the table's (6 for a write that failed, e.g. a full disk).
  opts=()
  [ "$s" != train ] || opts=(--drop-empty --max-ratio "$MAX_RATIO")
  rc=0
  report=$("$NMT" shard --spm "$model" "${opts[@]}" "${prefix[$s]}.$SRC" "${prefix[$s]}.$TGT" \
    "$(shard_of "$s")") || rc=$?
  [ $rc = 0 ] || die $rc "$s: $NMT shard failed (exit $rc)"
  echo "prepare-data: $NAME: $s: $report"
  case "$report" in
    *"kept with an empty side"*)
      warn "$s: pairs with an empty side are kept (valid and test keep every line)" ;;
  esac
done
place_raw_and_ini
echo "prepare-data: $NAME: done in $(($(date +%s) - t0)) s; train with a model config first, e.g."
echo "  $(train_command)"
