#!/usr/bin/env bash
# tools/gpu-check.sh — the CUDA backend's checks on a machine with a GPU, in one command.
#
#   tools/gpu-check.sh pack        on a machine WITHOUT a GPU (this repo's dev box): builds with
#                                  CUDA (fat binary sm_80/86/90) and packs build/gpu-pack/: the two
#                                  binaries, the shared libraries they need that a bare CUDA image
#                                  may lack (iniparser, OpenBLAS, ...), the Bible shards, COMMIT.
#   tools/gpu-check.sh [STAGE...]  on the GPU machine; stages (default: all three, in order):
#       test      every GPU test: build/test_nmt cuda_ (ops vs the CPU reference, fixtures,
#                 20 steps GPU vs CPU, bitwise repeat), then the whole suite (non-fatal)
#       sanitize  compute-sanitizer memcheck and racecheck on the op and model tests
#       train     nmt train conf/base.ini on the Bible corpus for $TRAIN_STEPS (default 200)
#                 steps in fp32 and tf32 (stages train-fp32, train-tf32): loss curve, target
#                 tokens/s, peak device memory
#
# Where the GPU machine has the build dependencies (iniparser, OpenBLAS headers) and no pack
# was carried, `make` builds there instead. Results go to $OUT (the device tool's output
# folder; default build/gpu-check): summary.txt plus one log per step, at most 8 files.
#
# With the device tool (docs/cuda.md "Running the GPU checks"): run `tools/gpu-check.sh pack`
# here, then `run` with carry ["build/gpu-pack"] and command `tools/gpu-check.sh test`, then
# `... sanitize`, `... train-fp32`, `... train-tf32`: one call each keeps every call inside the
# 10-minute limit and under the 8 files that come back (`all` may exceed both).
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PACK=build/gpu-pack
OUT=${OUT:-build/gpu-check}
TRAIN_STEPS=${TRAIN_STEPS:-200}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt

say() { echo "$*" | tee -a "$SUMMARY"; }

# ---------------------------------------------------------------------------------------------
pack() {
  command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] ||
    { echo "gpu-check pack: no nvcc here; pack needs the CUDA toolkit (not a GPU)" >&2; exit 1; }
  make -j"$(nproc)" CUDA=1 build/test_nmt build/nmt || exit 1
  rm -rf "$PACK"
  mkdir -p "$PACK/bin" "$PACK/lib" "$PACK/data/bible"
  cp build/test_nmt build/nmt "$PACK/bin/"
  # Every shared library except the C runtime and the CUDA toolkit's (the GPU image has those;
  # libnccl.so.2 is 217 MB, over the carry limit: the image has NCCL, found at run time below).
  ldd build/test_nmt build/nmt | awk '/=> \//{print $3}' | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*|libcublas*|libcudart*|libnccl*) ;;
      *) cp -L "$lib" "$PACK/lib/" ;;
    esac
  done
  for f in train.shard valid.shard test.shard spm.model; do
    [ -f "data/bible/$f" ] && cp "data/bible/$f" "$PACK/data/bible/"
  done
  { git rev-parse HEAD 2>/dev/null || echo unknown; git status --porcelain 2>/dev/null | grep -q . && echo "(with uncommitted changes)"; } > "$PACK/COMMIT"
  du -sh "$PACK"
  echo "packed $PACK: carry it to the GPU machine and run tools/gpu-check.sh there"
}

# ---------------------------------------------------------------------------------------------
# Binaries: the carried pack, or a build here. Sets BIN (directory of nmt and test_nmt).
setup() {
  : > "$SUMMARY"
  say "gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  say "commit: $(git rev-parse HEAD 2>/dev/null || tr '\n' ' ' < "$PACK/COMMIT" 2>/dev/null || echo unknown)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    say "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
  else
    say "device: nvidia-smi not found"
  fi
  export PATH=$PATH:/usr/local/cuda/bin
  if [ -x "$PACK/bin/test_nmt" ]; then
    BIN=$PACK/bin
    export LD_LIBRARY_PATH=$ROOT/$PACK/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    say "binaries: carried pack ($PACK)"
  elif [ -f /usr/include/iniparser.h ] || [ -f /usr/include/iniparser/iniparser.h ]; then
    make -j"$(nproc)" CUDA=1 build/test_nmt build/nmt > "$OUT/build.log" 2>&1 ||
      { say "build: FAILED (see build.log)"; exit 1; }
    BIN=build
    say "binaries: built here ($(nvcc --version | tail -1))"
  else
    say "no build/gpu-pack and no build dependencies here: run tools/gpu-check.sh pack on the dev box and carry build/gpu-pack"
    exit 1
  fi
  # cuBLASLt and NCCL come from the toolkit through the rpath; elsewhere (e.g. the pip packages
  # nvidia-cublas, nvidia-nccl-cu13 of the GPU image's python3), look for them.
  for want in libcublasLt.so.13:cublas libnccl.so.2:nccl; do
    lib=${want%%:*} mod=${want##*:}
    ldd "$BIN/test_nmt" | grep -q "$lib => not found" || continue
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
             $(ls -d /usr/local/cuda-*/lib64 2>/dev/null) \
             $(python3 -c "import nvidia.$mod, os; print(os.path.join(nvidia.$mod.__path__[0], 'lib'))" 2>/dev/null); do
      [ -e "$d/$lib" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d && break
    done
  done
  if ldd "$BIN/test_nmt" | grep "not found" | tee -a "$SUMMARY" | grep -q .; then
    say "missing shared libraries (above): cannot run"
    exit 1
  fi
}

counts() { grep -E '^[0-9]+ passed' "$1" | tail -1; }

stage_test() {
  say "--- test"
  local log=$OUT/tests-cuda.log
  NMT_BUILD_DIR=$BIN timeout 420 "$BIN/test_nmt" cuda_ > "$log" 2>&1
  local rc=$?
  say "GPU tests (test_nmt cuda_): rc $rc: $(counts "$log")"
  grep -E '^not ok|^# .*(rel err|steps|tf32 vs)' "$log" | tee -a "$SUMMARY" > /dev/null
  if [ "$rc" -eq 0 ]; then
    NMT_BUILD_DIR=$BIN timeout 150 "$BIN/test_nmt" > "$OUT/tests-all.log" 2>&1
    say "whole suite (test_nmt, data-dependent tests may fail without data/bible): rc $?: $(counts "$OUT/tests-all.log")"
  fi
  return $rc
}

stage_sanitize() {
  say "--- sanitize"
  local cs
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null) ||
    { say "compute-sanitizer not found"; return 1; }
  # The training tests run whole models for 20 steps: too slow under the sanitizer.
  NMT_TEST_SKIP=cuda_train NMT_BUILD_DIR=$BIN timeout 270 "$cs" --tool memcheck \
    --leak-check full --error-exitcode 99 "$BIN/test_nmt" cuda_ > "$OUT/memcheck.log" 2>&1
  say "memcheck: rc $? ($(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)): $(counts "$OUT/memcheck.log")"
  NMT_TEST_SKIP=cuda_train,cuda_model NMT_BUILD_DIR=$BIN timeout 270 "$cs" --tool racecheck \
    --racecheck-report analysis --error-exitcode 99 "$BIN/test_nmt" cuda_ > "$OUT/racecheck.log" 2>&1
  say "racecheck: rc $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/racecheck.log" | tail -1)): $(counts "$OUT/racecheck.log")"
}

# One training run: nmt train conf/base.ini for TRAIN_STEPS steps in precision $1.
train_one() {
  local prec=$1 run=build/gpu-train-$1 data=data/bible
  [ -f $data/train.shard ] || data=$PACK/data/bible
  rm -rf "$run"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$run.mem" 2>/dev/null &
  local smi=$!
  timeout "${TRAIN_TIMEOUT:-480}" "$BIN/nmt" train conf/base.ini run.out_dir="$run" \
    parallel.device=cuda precision.mode="$prec" train.max_steps="$TRAIN_STEPS" \
    train.log_every=20 train.valid_every="$TRAIN_STEPS" train.save_every=0 \
    data.train=$data/train.shard data.valid=$data/valid.shard data.test=$data/test.shard \
    data.spm_model=$data/spm.model > "$OUT/train-$prec.log" 2>&1
  local rc=$?
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  local peak
  peak=$(sort -n "$run.mem" 2>/dev/null | tail -1)
  [ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "$OUT/metrics-$prec.jsonl"
  say "train $prec: rc $rc, $TRAIN_STEPS steps, peak device memory ${peak:-?} MiB (nvidia-smi)"
  if [ -f "$run/metrics.jsonl" ]; then
    python3 - "$run/metrics.jsonl" <<'EOF' | tee -a "$SUMMARY"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
if rows:
    first, last = rows[0], rows[-1]
    tps = [r["tgt_tokens_per_s"] for r in rows[1:]] or [first["tgt_tokens_per_s"]]
    print("  loss %.3f (step %d) -> %.3f (step %d); valid loss %s; tgt tokens/s %.0f (mean after "
          "the first record); step_ms %.1f"
          % (first["train_loss"], first["step"], last["train_loss"], last["step"],
             "%.3f" % last["valid_loss"] if "valid_loss" in last else "-", sum(tps) / len(tps),
             last["step_ms"]))
EOF
  fi
  return $rc
}

stage_train() {
  say "--- train (conf/base.ini, $TRAIN_STEPS steps)"
  local rc=0
  train_one fp32 || rc=1
  train_one tf32 || rc=1
  return $rc
}

case "${1:-all}" in
  pack) pack; exit $? ;;
esac
setup
status=0
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(all)
for s in "${stages[@]}"; do
  case "$s" in
    test) stage_test || status=1 ;;
    sanitize) stage_sanitize || status=1 ;;
    train) stage_train || status=1 ;;
    train-fp32) say "--- train (conf/base.ini, $TRAIN_STEPS steps)"; train_one fp32 || status=1 ;;
    train-tf32) say "--- train (conf/base.ini, $TRAIN_STEPS steps)"; train_one tf32 || status=1 ;;
    all) stage_test || status=1; stage_sanitize || status=1; stage_train || status=1 ;;
    *) echo "gpu-check: unknown stage $s (pack, test, sanitize, train[-fp32|-tf32], all)" >&2; exit 2 ;;
  esac
done
say "gpu-check done: status $status (results in $OUT)"
exit $status
