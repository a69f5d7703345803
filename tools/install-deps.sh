#!/usr/bin/env bash
# Installs what nmt needs and is missing; quick and silent when everything is there.
#   tools/install-deps.sh          build + data + test dependencies (Debian packages); V=1 shows
#                                  apt-get's and dpkg's output (otherwise only on failure)
#   tools/install-deps.sh --bleu   also sacreBLEU (pip) for scoring, tensorboard (pip): the
#                                  test that reads the event files back with its reader, and
#                                  CTranslate2 with SentencePiece's Python module (pip): `nmt
#                                  export --format ctranslate2` (tools/nmt_to_ct2.py), its test
#   tools/install-deps.sh --fuzz   also clang with libFuzzer (`make fuzz`)
#   tools/install-deps.sh --slurm  also munge and Slurm: slurmctld, slurmd and the client
#                                  commands (`make test-slurm` starts its own daemons; where
#                                  apt starts the packaged services, they stay off its ports)
# Debian packages: iniparser (config), OpenBLAS (CPU reference GEMMs; it also replaces the slow
# reference libblas.so.3), zlib (checkpoint CRC), SentencePiece (libsentencepiece-dev: the library
# translate and eval encode and decode with in process; sentencepiece: spm_train for data), the
# SWORD tools and the two public-domain Bible modules the embedded corpus is built from;
# python3-torch (PyTorch 1.13 for Debian's /usr/bin/python3) for the golden-fixture script,
# the PyTorch baseline of bench/ and the export test (tools/load_pytorch.py). It is the big
# one: libtorch1.13 (29 MB download, 131 MB installed) plus python3-torch and libtorch-test
# (16 MB); on the CI image the apt log shows 34 s from start to end of that install (231
# packages with recommends; this script skips recommends). python3-matplotlib draws the training
# curves (tools/plot); without recommends it brings 36 packages, scipy and numpy among them.
# g++ and libgloo-dev (Gloo 0.5, git 2022-05-18: the C++ collective library PyTorch uses for
# CPU tensors) build the communicator across processes (src/comm/gloo.cc, docs/multinode.md);
# libgloo0 brings libhiredis and libibverbs (Debian builds Gloo with Redis and InfiniBand).
# TensorBoard event files (src/util/tensorboard.c): libprotobuf-c-dev and protobuf-c-compiler
# (protoc-c generates the Event messages' C at build time) and libisal-dev (ISA-L's CRC-32C;
# Debian 12 has no libcrc32c package).
set -euo pipefail
pkgs=(gcc g++ make python3 libiniparser-dev libopenblas-dev zlib1g-dev libgloo-dev sentencepiece
      libsentencepiece-dev libsword-utils sword-text-web sword-text-sparv python3-torch
      python3-matplotlib libprotobuf-c-dev protobuf-c-compiler libisal-dev)
[ "${1:-}" = "--fuzz" ] && pkgs+=(clang libclang-rt-14-dev)  # Debian 12: libFuzzer is only recommended
[ "${1:-}" = "--slurm" ] && pkgs+=(munge slurmctld slurmd slurm-client)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
# apt-get and dpkg print a line per package and step even with -qq: their output goes to a log,
# printed in full if they fail; V=1 (`make run V=1`) shows it as it comes.
quietly() {
  if [ "${V:-0}" = 1 ]; then
    "$@" >&2
    return
  fi
  local log rc=0
  log=$(mktemp "${TMPDIR:-/tmp}/nmt-install-deps.XXXXXX")
  "$@" >"$log" 2>&1 || rc=$?
  if [ $rc -ne 0 ]; then
    cat "$log" >&2
    echo "install-deps: failed (exit $rc): $*" >&2
  fi
  rm -f "$log"
  return $rc
}
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]} (apt-get; V=1 shows its output)" >&2
  SUDO=
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  quietly $SUDO apt-get update -qq
  quietly $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends "${missing[@]}"
fi
if [ "${1:-}" = "--bleu" ]; then
  if ! python3 -c 'import sacrebleu' 2>/dev/null; then
    echo "install-deps: installing sacrebleu (pip)" >&2
    quietly python3 -m pip install -q sacrebleu
  fi
  if ! python3 -c 'import tensorboard' 2>/dev/null; then
    echo "install-deps: installing tensorboard (pip)" >&2
    quietly python3 -m pip install -q tensorboard
  fi
  # CTranslate2 4.8.5 is the version the export was checked with (docs/formats.md).
  if ! python3 -c 'import ctranslate2' 2>/dev/null; then
    echo "install-deps: installing ctranslate2 (pip)" >&2
    quietly python3 -m pip install -q 'ctranslate2==4.8.5'
  fi
  if ! python3 -c 'import sentencepiece' 2>/dev/null; then
    echo "install-deps: installing sentencepiece (pip)" >&2
    quietly python3 -m pip install -q sentencepiece
  fi
fi
