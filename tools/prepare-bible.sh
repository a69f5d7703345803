#!/usr/bin/env bash
# The embedded corpus: English (World English Bible, 2015) -> Spanish (Reina-Valera 1909),
# both public domain, from the SWORD modules the Debian packages sword-text-web and
# sword-text-sparv install (tools/install-deps.sh).
#
#   tools/prepare-bible.sh [--vocab 8000]
#
#   mod2imp -> data/bible/raw/*.imp -> tools/prepare-bible.py -> data/bible/{train,valid,test}.
#   {en,es,ref} -> tools/prepare-data.sh -> data/bible/spm.model, {train,valid,test}.shard
#
# Idempotent: each step runs only when its outputs are missing or stale; when everything is in
# place it returns in well under two seconds. `make data`, `make test` and `make run` call it.
set -euo pipefail
cd "$(dirname "$0")/.."

die() {
  echo "prepare-bible: error: $*" >&2
  exit 1
}

VOCAB=8000
while [ $# -gt 0 ]; do
  case "$1" in
    --vocab)
      [ $# -ge 2 ] || die "--vocab needs a value"
      VOCAB=$2
      shift 2
      ;;
    -h | --help)
      sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *) die "unknown option $1 (usage: tools/prepare-bible.sh [--vocab N])" ;;
  esac
done

OUT=data/bible
RAW=$OUT/raw
PY=$(command -v python3 || true)
[ -n "$PY" ] || die "python3 not found"
mkdir -p "$RAW"

# 1. Export the two modules (raw OSIS fragments, one "$$$Book C:V" entry per verse).
for mod in engWEB2015eb spaRV1909eb; do
  imp=$RAW/$mod.imp
  [ -s "$imp" ] && continue
  command -v mod2imp >/dev/null ||
    die "mod2imp not found: run tools/install-deps.sh (libsword-utils)"
  echo "prepare-bible: mod2imp $mod > $imp"
  if ! mod2imp "$mod" >"$imp.tmp" 2>"$imp.err" || ! [ -s "$imp.tmp" ]; then
    cat "$imp.err" "$imp.tmp" >&2
    rm -f "$imp.tmp" "$imp.err"
    die "mod2imp $mod failed: is the module installed? (tools/install-deps.sh installs" \
      "sword-text-web and sword-text-sparv)"
  fi
  rm -f "$imp.err"
  mv -f "$imp.tmp" "$imp"
done

# 2. Extract aligned verses. The stamp records a successful run; the script rewrites only the
# files whose content changes, so a new script version does not force a retrain by itself.
stamp=$OUT/.extracted
stale=0
newer_than_stamp=("$RAW/engWEB2015eb.imp" "$RAW/spaRV1909eb.imp" tools/prepare-bible.py)
[ -e "$stamp" ] || stale=1
for f in "${newer_than_stamp[@]}"; do [ "$f" -nt "$stamp" ] && stale=1; done
for s in train valid test; do
  for e in en es ref; do [ -e "$OUT/$s.$e" ] || stale=1; done
done
if [ $stale = 1 ]; then
  "$PY" tools/prepare-bible.py --en "$RAW/engWEB2015eb.imp" --es "$RAW/spaRV1909eb.imp" \
    --out "$OUT"
  touch "$stamp"
fi

# 3. SentencePiece and shards. The shard writer is `nmt shard`.
if [ ! -x build/nmt ] && [ -z "${NMT:-}" ]; then
  echo "prepare-bible: build/nmt missing; make build/nmt"
  make --no-print-directory build/nmt >&2
fi
tools/prepare-data.sh --name bible --src en --tgt es --vocab "$VOCAB" \
  --train "$OUT/train" --valid "$OUT/valid" --test "$OUT/test" --out "$OUT"
