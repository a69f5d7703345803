#!/usr/bin/env bash
# Installs what nmt needs and is missing; quick and silent when everything is there.
#   tools/install-deps.sh          build + data + test dependencies (Debian packages)
#   tools/install-deps.sh --bleu   also sacreBLEU (pip) for scoring
# Debian packages: iniparser (config), OpenBLAS (CPU reference GEMMs; it also replaces the slow
# reference libblas.so.3), zlib (checkpoint CRC), SentencePiece (spm_train/encode/decode), the
# SWORD tools and the two public-domain Bible modules the embedded corpus is built from.
set -euo pipefail
pkgs=(gcc make python3 libiniparser-dev libopenblas-dev zlib1g-dev sentencepiece libsword-utils
      sword-text-web sword-text-sparv)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}" >&2
  SUDO=
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
if [ "${1:-}" = "--bleu" ]; then
  if ! python3 -c 'import sacrebleu' 2>/dev/null; then
    echo "install-deps: installing sacrebleu (pip)" >&2
    python3 -m pip install -q sacrebleu >&2
  fi
fi
