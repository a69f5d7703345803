#!/usr/bin/env bash
# WMT14 English-German, as downloaded, -> data/wmt14/ for conf/wmt14-en-de-base.ini.
#
#   tools/prepare-wmt14.sh --raw DOWNLOADS [--valid PREFIX --test PREFIX] [--out data/wmt14]
#
# Download into DOWNLOADS, from the WMT14 translation task's "Parallel data"
# (https://www.statmt.org/wmt14/translation-task.html; the paper's training set, Vaswani et al.
# 2017 §5.1, ~4.5M pairs), these three archives (the de-en files each holds):
#   https://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz
#       training/europarl-v7.de-en.{en,de}
#   https://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz
#       commoncrawl.de-en.{en,de}
#   https://www.statmt.org/wmt14/training-parallel-nc-v9.tgz
#       training/news-commentary-v9.de-en.{en,de}
# Leave the .tgz files as they are (the de-en members are extracted to OUT/raw/extract/) or
# extract them anywhere under DOWNLOADS (found up to 3 directories deep). The three are
# concatenated, in that order, into OUT/raw/train.{en,de}.
#
# Valid = newstest2013, test = newstest2014, each as PREFIX.en / PREFIX.de plain text, one
# sentence per line, taken from the first of:
#   1. --valid PREFIX / --test PREFIX;
#   2. DOWNLOADS/newstest2013.{en,de} / DOWNLOADS/newstest2014.{en,de};
#   3. OUT/raw/newstest2013.{en,de} / OUT/raw/newstest2014.{en,de} (a previous run's);
#   4. sacreBLEU (pip install sacrebleu; needs the network once, then ~/.sacrebleu caches it):
#        sacrebleu -t wmt13 -l en-de --echo src > newstest2013.en   (--echo ref > .de)
#        sacrebleu -t wmt14/full -l en-de --echo src > newstest2014.en   (--echo ref > .de)
#      wmt14/full is newstest2014's 3003 sentences, the set the paper's successors (fairseq,
#      sacreBLEU signatures "test.wmt14/full") score on; --sacrebleu-test wmt14 takes the
#      official 2737-sentence filtered set instead. Offline, run those commands where there is
#      a network, or take newstest2013/2014.{en,de} of the Stanford files
#      (https://nlp.stanford.edu/projects/nmt/, "WMT'14 English-German data"; its
#      newstest2014 is the 2737-sentence set, tokenized), and pass --valid / --test.
# --train PREFIX instead of --raw takes one ready pair PREFIX.en / PREFIX.de (e.g. the Stanford
# train.en / train.de, ~4.5M pairs, already tokenized: BLEU on its test set is then tokenized).
#
# Then tools/prepare-data.sh (its --help) trains the joint SentencePiece model (--vocab, 32000
# by default), writes OUT/{train,valid,test}.shard, OUT/{valid,test}.{en,de} and OUT/data.ini.
# Idempotent, as prepare-data.sh: the concatenation and every later step run only when their
# outputs are missing or older than their inputs, so a second run is quick.
#
# Options (defaults in brackets):
#   --raw DIR               the downloads (above)
#   --train PREFIX          instead of --raw: training text PREFIX.en / PREFIX.de
#   --valid PREFIX          newstest2013 as PREFIX.en / PREFIX.de [found as above]
#   --test PREFIX           newstest2014 as PREFIX.en / PREFIX.de [found as above]
#   --sacrebleu-test NAME   sacreBLEU's name of the test set [wmt14/full]
#   --out DIR               output directory [data/wmt14, where conf/wmt14-en-de-base.ini looks]
#   --vocab N               SentencePiece pieces [32000]
#   --model-type, --max-sentences, --max-line-bytes, --threads, --max-ratio, --nmt
#                           passed to tools/prepare-data.sh (its --help)
# Exit codes, as nmt's (README "Exit codes"): 0 done, 2 usage (bad or missing option, an input
# file missing, sacreBLEU missing or unable to fetch a test set), 3 data (a corpus whose .en and
# .de line counts differ, and prepare-data.sh's), 6 I/O (OUT not writable, a write failed).
set -euo pipefail

die() {
  local code=$1
  shift
  echo "prepare-wmt14: error: $*" >&2
  exit "$code"
}
usage() {
  sed -n '2,53p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
}

here=$(cd "$(dirname "$0")" && pwd)
RAW='' TRAIN='' VALID='' TEST='' OUT=data/wmt14 VOCAB=32000 TEST_SET=wmt14/full
pass=()
while [ $# -gt 0 ]; do
  case "$1" in -h | --help) usage ;; esac
  [ $# -ge 2 ] || die 2 "$1 needs a value (see --help)"
  case "$1" in
    --raw) RAW=$2 ;;
    --train) TRAIN=$2 ;;
    --valid) VALID=$2 ;;
    --test) TEST=$2 ;;
    --sacrebleu-test) TEST_SET=$2 ;;
    --out) OUT=$2 ;;
    --vocab) VOCAB=$2 ;;
    --model-type | --max-sentences | --max-line-bytes | --threads | --max-ratio | --nmt)
      pass+=("$1" "$2") ;;
    *) die 2 "unknown option $1 (see --help)" ;;
  esac
  shift 2
done
[ -n "$RAW" ] || [ -n "$TRAIN" ] ||
  die 2 "--raw DIR (the downloaded WMT14 files) or --train PREFIX is required (see --help)"
[ -z "$RAW" ] || [ -z "$TRAIN" ] || die 2 "--raw and --train are alternatives: give one"
[ -z "$RAW" ] || [ -d "$RAW" ] || die 2 "--raw $RAW: no such directory"
[ -n "$OUT" ] || die 2 "--out needs a directory"

mkdir -p "$OUT/raw" 2>/dev/null && [ -w "$OUT/raw" ] ||
  die 6 "--out $OUT: cannot create or write $OUT/raw"

# newer TARGET DEP...: TARGET exists and is newer than every DEP (as prepare-data.sh's).
newer() {
  local t=$1 d
  shift
  [ -e "$t" ] || return 1
  for d in "$@"; do [ "$d" -nt "$t" ] && return 1; done
  return 0
}
count_lines() { awk 'END { print NR }' "$1"; }
# The first PATH/.../NAME up to 3 directories below PATH, sorted; empty when none.
find_file() { find "$1" -maxdepth 4 -type f -name "$2" 2>/dev/null | LC_ALL=C sort | head -n 1; }

# Corpus NAME, its archive and where the WMT14 page serves it.
corpora=(europarl-v7.de-en commoncrawl.de-en news-commentary-v9.de-en)
declare -A archive=([europarl-v7.de-en]=training-parallel-europarl-v7.tgz
  [commoncrawl.de-en]=training-parallel-commoncrawl.tgz
  [news-commentary-v9.de-en]=training-parallel-nc-v9.tgz)
declare -A url=([europarl-v7.de-en]=https://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz
  [commoncrawl.de-en]=https://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz
  [news-commentary-v9.de-en]=https://www.statmt.org/wmt14/training-parallel-nc-v9.tgz)

# corpus_prefix NAME: DIR/NAME (DIR/NAME.en and DIR/NAME.de exist), extracting them from the
# archive when only it is there; dies naming what is missing and where to get it.
corpus_prefix() {
  local c=$1 en de tgz x=$OUT/raw/extract
  for d in "$RAW" "$x"; do
    en=$(find_file "$d" "$c.en")
    [ -n "$en" ] || continue
    de=${en%.en}.de
    [ -f "$de" ] || die 2 "$de: missing (found $en; --raw $RAW needs both sides)"
    echo "${en%.en}"
    return
  done
  tgz=$(find_file "$RAW" "${archive[$c]}")
  [ -n "$tgz" ] || die 2 "--raw $RAW: missing $c.en / $c.de: download ${url[$c]} into $RAW" \
    "(extracted or not; see --help)"
  echo "prepare-wmt14: extracting $c.{en,de} from $tgz" >&2
  mkdir -p "$x" 2>/dev/null || die 6 "cannot create $x"
  tar -xzf "$tgz" -C "$x" --wildcards --no-anchored "$c.en" "$c.de" 2>"$x/tar.log" ||
    die 3 "$tgz: tar could not extract $c.en and $c.de ($(head -n 1 "$x/tar.log"))"
  en=$(find_file "$x" "$c.en")
  [ -n "$en" ] && [ -f "${en%.en}.de" ] || die 3 "$tgz: holds no $c.en and $c.de"
  echo "${en%.en}"
}

if [ -n "$TRAIN" ]; then
  for l in en de; do
    [ -f "$TRAIN.$l" ] || die 2 "--train $TRAIN: missing file $TRAIN.$l"
  done
  train=$TRAIN
else
  train=$OUT/raw/train
  srcs=()
  for c in "${corpora[@]}"; do srcs+=("$(corpus_prefix "$c")"); done
  inputs=()
  for p in "${srcs[@]}"; do inputs+=("$p.en" "$p.de"); done
  stamp=$OUT/raw/train.sources
  # The stamp holds the inputs' paths: another DOWNLOADS (or the archives extracted since)
  # re-makes the concatenation.
  want=$(printf '%s\n' "${srcs[@]}")
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] || echo "$want" >"$stamp" ||
    die 6 "cannot write $stamp"
  if ! newer "$train.en" "${inputs[@]}" "$stamp" ||
    ! newer "$train.de" "${inputs[@]}" "$stamp"; then
    first=1
    for p in "${srcs[@]}"; do
      ne=$(count_lines "$p.en") nd=$(count_lines "$p.de")
      [ "$ne" = "$nd" ] || die 3 "$(basename "$p"): line counts differ: $p.en has $ne lines," \
        "$p.de has $nd"
      echo "prepare-wmt14: train lines $first..$((first + ne - 1)): $p.{en,de}"
      first=$((first + ne))
    done
    for l in en de; do
      # awk 1 ends every file's last line, so no two corpora's lines run together.
      files=()
      for p in "${srcs[@]}"; do files+=("$p.$l"); done
      tmp=$train.$l.tmp
      { awk 1 "${files[@]}" >"$tmp" && mv -f "$tmp" "$train.$l"; } 2>/dev/null || {
        rm -f "$tmp"
        die 6 "cannot write $train.$l (is the disk full?)"
      }
    done
  fi
fi

# split_prefix OPTION GIVEN NAME SACREBLEU_SET: the PREFIX of NAME.{en,de} (see --help).
split_prefix() {
  local opt=$1 given=$2 name=$3 set=$4 p l side tmp
  if [ -n "$given" ]; then
    for l in en de; do [ -f "$given.$l" ] || die 2 "$opt $given: missing file $given.$l"; done
    echo "$given"
    return
  fi
  for p in ${RAW:+"$RAW/$name"} "$OUT/raw/$name"; do
    [ -f "$p.en" ] && [ -f "$p.de" ] && { echo "$p"; return; }
  done
  p=$OUT/raw/$name
  command -v sacrebleu >/dev/null || die 2 "no $name: pass $opt PREFIX ($name as PREFIX.en and" \
    "PREFIX.de), or install sacreBLEU (pip install sacrebleu) to fetch it (see --help)"
  echo "prepare-wmt14: fetching $name with sacrebleu -t $set -l en-de --echo src|ref" >&2
  for l in en de; do
    side=src
    [ $l = en ] || side=ref
    tmp=$p.$l.tmp
    if ! sacrebleu -t "$set" -l en-de --echo "$side" >"$tmp" 2>"$p.sacrebleu.log"; then
      rm -f "$tmp"
      die 2 "sacrebleu could not fetch $set ($(tail -n 1 "$p.sacrebleu.log"); offline?):" \
        "download $name where there is a network (sacrebleu -t $set -l en-de --echo src >" \
        "$name.en, --echo ref > $name.de) or take the Stanford files' $name.en/.de," \
        "and pass $opt PREFIX (see --help)"
    fi
    mv -f "$tmp" "$p.$l" || die 6 "cannot write $p.$l"
  done
  echo "$p"
}
valid=$(split_prefix --valid "$VALID" newstest2013 wmt13)
test=$(split_prefix --test "$TEST" newstest2014 "$TEST_SET")

rc=0
"$here/prepare-data.sh" --name wmt14 --src en --tgt de --vocab "$VOCAB" --train "$train" \
  --valid "$valid" --test "$test" --out "$OUT" "${pass[@]}" || rc=$?
[ $rc = 0 ] || exit $rc
if [ "$OUT" -ef data/wmt14 ]; then
  echo "prepare-wmt14: the paper's base model on it: nmt train conf/wmt14-en-de-base.ini"
else
  echo "prepare-wmt14: the paper's base model on it: nmt train conf/wmt14-en-de-base.ini" \
    "$OUT/data.ini"
fi
