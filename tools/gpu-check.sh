#!/usr/bin/env bash
# tools/gpu-check.sh — the CUDA backend's checks on a machine with a GPU, one stage per call of
# the device tool (docs/gpu-runs.md, "How to run the first GPU session").
#
#   tools/gpu-check.sh pack        on a machine WITHOUT a GPU (this repo's dev box; needs nvcc,
#                                  not a GPU): a CUDA build (fat binary sm_80/86/90 + compute_90
#                                  PTX), packed into build/gpu-pack/: nmt, test_nmt and
#                                  bench/dump_batches with their debug sections stripped, the
#                                  shared libraries a bare CUDA image may lack (iniparser,
#                                  OpenBLAS, ...), the Bible shards, COMMIT and BUILD-INFO.
#                                  `make gpu-pack` runs it. Fails if the pack would not fit the
#                                  device tool's 64 MiB carry limit.
#   tools/gpu-check.sh targets BINARY   the GPU code a binary carries (sm_XX ELF, compute_XX PTX)
#   tools/gpu-check.sh memcheck-summary LOG   reads a compute-sanitizer memcheck log brought back:
#                                  errors, leaks and NCCL's own API errors apart; exit 1 on errors
#   tools/gpu-check.sh STAGE...    on the GPU machine, with build/gpu-pack carried:
#       first     THE command of a lent GPU machine: GPU tests in groups, bf16/fp16 training
#                 with a profile, nmt vs PyTorch; ends by itself within $FIRST_SECONDS (540)
#       libs      only the setup every stage starts with (a few seconds): nvidia-smi -L, driver
#                 and runtime versions, where libcublasLt.so.13 and libnccl.so.2 are, ldd
#       test      every GPU test (test_nmt cuda_), then the rest of the suite in the time left
#       sanitize  compute-sanitizer memcheck (leaks read apart from errors), then racecheck, on
#                 the op and model tests; on nvidia-h100-x1 (the H200's runtime refused it)
#       train     nmt train conf/base.ini, $TRAIN_STEPS (200) steps in each of $TRAIN_PRECISIONS
#                 (fp32 tf32 bf16 fp16): loss first -> last, valid loss/ppl, target tokens/s,
#                 step ms, peak device memory, fp16's skipped steps and loss scale
#       train-fp32, train-tf32, train-bf16, train-fp16: one precision
#       all       test sanitize train, one after another (more than one call's 10 minutes)
#
# Each stage is sized to end within $STAGE_SECONDS (default 450 s, under 8 minutes; the device
# tool stops a command at 10): its steps share that budget and a step that would not fit is
# cut (timeout) or left out, and the summary says so. Results go to $OUT (the device tool's
# output folder; default build/gpu-check): summary.txt and one log per step, at most 8 files.
#
# Every stage first checks for a GPU (`nvidia-smi -L`) and stops at once without one, before
# building or running anything: "no GPU: ...", exit 4. With a GPU it exports NMT_EXPECT_GPU=1,
# so a GPU test that prints "SKIP no CUDA device" FAILS (test/runner.c) and the CUDA init
# error is logged at warn level (cuda/context.cu).
#
# Exit codes: 0 every stage passed; 1 a stage failed; 2 usage; 3 cannot run here (no pack and
# no build dependencies, missing shared libraries, pack over the carry limit, no nvcc for
# pack); 4 no GPU.
# Environment: OUT, STAGE_SECONDS, TRAIN_STEPS, TRAIN_PRECISIONS, NVIDIA_SMI (the nvidia-smi to
# ask; tests point it elsewhere), CUDA_HOME (default /usr/local/cuda).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 3
ROOT=$(pwd)
PACK=${GPU_PACK:-build/gpu-pack}
OUT=${OUT:-build/gpu-check}
STAGE_SECONDS=${STAGE_SECONDS:-450}
TRAIN_STEPS=${TRAIN_STEPS:-200}
TRAIN_PRECISIONS=${TRAIN_PRECISIONS:-fp32 tf32 bf16 fp16}
TRAIN_MIN_SECONDS=${TRAIN_MIN_SECONDS:-30}
RUNS=${RUNS:-build}
FIND_SECONDS=${FIND_SECONDS:-15}
NVIDIA_SMI=${NVIDIA_SMI:-nvidia-smi}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CARRY_LIMIT=$((64 * 1024 * 1024))
# What the pack and the tracked files may take: 2 MiB under the carry limit, for the untracked
# files that travel too (a script under test, a log).
PACK_LIMIT=$((62 * 1024 * 1024))
SUMMARY=$OUT/summary.txt

say() { echo "$*" | tee -a "$SUMMARY"; }
# say for several lines of command output, each indented.
say_lines() { sed 's/^/  /' | tee -a "$SUMMARY"; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

usage() {
  echo "usage: tools/gpu-check.sh pack | targets BINARY | memcheck-summary LOG | STAGE... (first, libs, test, sanitize," \
       "train, train-fp32|tf32|bf16|fp16, all)" >&2
  exit 2
}

# ---------------------------------------------------------------------------------------------
# targets: what a binary's fat binary holds, without cuobjdump (the dev box's toolkit has none):
# the .nv_fatbin section, one container per .cu file (header: magic 0xBA55ED50, version,
# header size, payload size), each a list of entries (kind 1 = PTX, 2 = ELF; the architecture
# at byte 28 of the entry's header), as cuobjdump --list-elf --list-ptx would name them.

targets() {
  local bin=$1 tmp rc
  [ -f "$bin" ] || { echo "gpu-check targets: no file $bin" >&2; return 2; }
  if ! command -v objcopy > /dev/null || ! command -v python3 > /dev/null; then
    echo "gpu-check targets: needs objcopy and python3" >&2
    return 3
  fi
  tmp=$(mktemp)
  # Not an ELF file, or no such section: objcopy fails (and may remove tmp): no device code.
  objcopy -O binary --only-section=.nv_fatbin "$bin" "$tmp" 2>/dev/null || : > "$tmp"
  python3 - "$tmp" <<'EOF'
import collections, struct, sys
b = open(sys.argv[1], "rb").read()
seen, off = collections.Counter(), 0
while off + 16 <= len(b):
    magic, _, hsize, size = struct.unpack_from("<IHHQ", b, off)
    if magic != 0xBA55ED50:
        off += 8
        continue
    p, end = off + hsize, off + hsize + size
    while p + 32 <= end:
        kind, _, ehsize, padded = struct.unpack_from("<HHII", b, p)
        arch = struct.unpack_from("<I", b, p + 28)[0]
        seen[("compute_%d PTX" if kind == 1 else "sm_%d ELF") % arch] += 1
        p += ehsize + padded
    off = end
for k in sorted(seen):
    print("%s: %d modules" % (k, seen[k]))
sys.exit(0 if seen else 1)
EOF
  rc=$?
  rm -f "$tmp"
  [ $rc -eq 0 ] || echo "gpu-check targets: no CUDA device code in $bin" >&2
  return $rc
}

# ---------------------------------------------------------------------------------------------
# pack: on the dev box.

pack() {
  local nvcc
  nvcc=$(command -v nvcc 2>/dev/null || ls "$CUDA_HOME/bin/nvcc" 2>/dev/null) ||
    { echo "gpu-check pack: no nvcc (PATH, $CUDA_HOME/bin): pack needs the CUDA toolkit," \
           "not a GPU" >&2; exit 3; }
  make -j"$(nproc)" CUDA=1 build/test_nmt build/nmt build/libnmt.a || exit 1
  rm -rf "$PACK"
  mkdir -p "$PACK/bin" "$PACK/lib" "$PACK/data/bible"
  cp build/test_nmt build/nmt "$PACK/bin/"
  # The benchmark's batch dumper (bench/GPU.md) joins the pack while nmt is still the very
  # build/nmt that bench/gpu-compare.sh pack compares it with; everything is stripped after.
  GPU_PACK=$PACK bench/gpu-compare.sh pack > build/gpu-pack.bench.log 2>&1 ||
    { cat build/gpu-pack.bench.log >&2; echo "gpu-check pack: bench/gpu-compare.sh pack failed" >&2;
      exit 1; }
  # Every shared library except the C runtime and the CUDA toolkit's (the GPU image has those;
  # libcublasLt.so.13 is 540 MB and libnccl.so.2 217 MB, far over the carry limit: setup()
  # finds them there).
  ldd "$PACK"/bin/* | awk '/=> \//{print $3}' | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++.so*|\
      libgcc_s.so*|libcublas*|libcudart*|libnccl*) ;;
      *) cp -L "$lib" "$PACK/lib/" ;;
    esac
  done
  # gpu-compare.sh's copy of dump_batches' libraries may take NCCL along (it is linked while
  # -lnccl is in LDLIBS): never carried, see above.
  rm -f "$PACK"/lib/libnccl* "$PACK"/lib/libcublas* "$PACK"/lib/libcudart*
  # Host debug sections only: the symbol table stays (named frames in compute-sanitizer's host
  # backtraces), and the device code's line table (-lineinfo) lives in .nv_fatbin, which strip
  # keeps, so sanitizer reports still name cuda/*.cu lines.
  local before after
  before=$(du -cb "$PACK"/bin/* | tail -1 | cut -f1)
  strip --strip-debug "$PACK"/bin/*
  after=$(du -cb "$PACK"/bin/* | tail -1 | cut -f1)
  # The GPU machine cannot prepare the corpus (no package registry there): no shards, no pack.
  for f in train.shard valid.shard test.shard spm.model; do
    [ -f "data/bible/$f" ] ||
      { echo "gpu-check pack: data/bible/$f is missing: run 'make data' first (the GPU machine" \
             "cannot build the corpus)" >&2; exit 3; }
    cp "data/bible/$f" "$PACK/data/bible/"
  done
  # The GPU tests' names, for `first`'s groups (one process per group).
  grep -rhoE 'TEST\(cuda_[A-Za-z0-9_]*' test/ | sed 's/^TEST(//' | sort -u > "$PACK/cuda-tests.txt"
  { git rev-parse HEAD 2>/dev/null || echo unknown
    git status --porcelain 2>/dev/null | grep -q . && echo "(with uncommitted changes)"; } > "$PACK/COMMIT"
  { echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n), commit $(head -1 "$PACK/COMMIT")"
    "$nvcc" --version | tail -2
    echo "test_nmt's fat binary (tools/gpu-check.sh targets):"
    targets "$PACK/bin/test_nmt"
  } > "$PACK/BUILD-INFO"
  grep -q 'compute_[0-9]* PTX' "$PACK/BUILD-INFO" ||
    { echo "gpu-check pack: no PTX in test_nmt's fat binary (Makefile CUDA_PTX)" >&2; exit 1; }
  # One count for every target: each cuda/*.cu object was built with all of them.
  if [ "$(grep -oE '(PTX|ELF): [0-9]+ modules' "$PACK/BUILD-INFO" | awk '{print $2}' |
          sort -u | wc -l)" -ne 1 ]; then
    echo "gpu-check pack: some CUDA objects lack a target (BUILD-INFO below): rebuild them" \
         "(rm -rf build/cuda) and pack again" >&2
    cat "$PACK/BUILD-INFO" >&2
    exit 1
  fi
  local total tree
  total=$(du -sb "$PACK" | cut -f1)
  tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  echo "binaries: $(mib "$before") -> $(mib "$after") stripped"
  echo "packed $PACK: $(mib "$total") (+ $(mib "$tree") of tracked files travel with it; carry" \
       "limit $(mib "$CARRY_LIMIT"), the pack's $(mib "$PACK_LIMIT"))"
  if [ $((total + tree)) -gt "$PACK_LIMIT" ]; then
    echo "gpu-check pack: $PACK and the tracked files, $(mib $((total + tree))), exceed" \
         "$(mib "$PACK_LIMIT") (the carry limit of $(mib "$CARRY_LIMIT") less 2 MiB for" \
         "untracked files)" >&2
    exit 3
  fi
  echo "carry it to the GPU machine (carry [\"$PACK\"]) and run tools/gpu-check.sh STAGE there" \
       "(docs/gpu-runs.md)"
}

# ---------------------------------------------------------------------------------------------
# setup: the GPU, the binaries, the libraries; every stage starts with it.

# Stops with exit 4 unless nvidia-smi lists a GPU.
require_gpu() {
  local smi out rc
  if ! smi=$(command -v "$NVIDIA_SMI" 2>/dev/null); then
    say "no GPU: $NVIDIA_SMI not found (no NVIDIA driver here). The stages need a GPU machine;" \
        "here run 'tools/gpu-check.sh pack' and carry build/gpu-pack to it (docs/gpu-runs.md)."
    exit 4
  fi
  out=$("$smi" -L 2>&1)
  rc=$?
  if [ $rc -ne 0 ] || ! grep -q '^GPU [0-9]' <<< "$out"; then
    say "no GPU: '$smi -L' lists no GPU (exit $rc: $(head -1 <<< "$out"))." \
        "The stages need a GPU machine; here run 'tools/gpu-check.sh pack' (docs/gpu-runs.md)."
    exit 4
  fi
  say "nvidia-smi -L:"
  say_lines <<< "$out"
  say "driver: $("$smi" --query-gpu=driver_version,compute_cap,memory.total --format=csv,noheader |
                 head -1) (driver version, compute capability, memory);" \
      "$("$smi" | grep -o 'CUDA Version: [0-9.]*' | head -1) (the newest runtime it supports)"
  export NMT_EXPECT_GPU=1
}

# nmt_find_lib and nmt_cuda_lib_path: the one library search of every script.
# shellcheck source=tools/cuda-libs.sh
. tools/cuda-libs.sh

setup() {
  mkdir -p "$OUT" || exit 3
  : > "$SUMMARY"
  say "gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ), stages: $*"
  require_gpu
  say "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown) (checkout);" \
      "pack: $(tr '\n' ' ' < "$PACK/COMMIT" 2>/dev/null || echo none)"
  export PATH=$PATH:$CUDA_HOME/bin:/usr/local/cuda/bin
  local built
  built=$(sed -n 's/^Cuda compilation tools, //p' "$PACK/BUILD-INFO" 2>/dev/null)
  say "runtime: the pack's build: ${built:-no pack}; toolkit here:" \
      "$(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo "no nvcc")"
  if [ -x "$PACK/bin/test_nmt" ]; then
    BIN=$PACK/bin
    local lib=$PACK/lib
    [ "${lib#/}" != "$lib" ] || lib=$ROOT/$lib
    export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    say "binaries: carried pack ($PACK)"
  elif [ -f /usr/include/iniparser.h ] || [ -f /usr/include/iniparser/iniparser.h ]; then
    make -j"$(nproc)" CUDA=1 build/test_nmt build/nmt > "$OUT/build.log" 2>&1 ||
      { say "build: FAILED (see build.log)"; exit 1; }
    BIN=build
    say "binaries: built here"
  else
    say "cannot run: no $PACK and no build dependencies here: run tools/gpu-check.sh pack on the" \
        "dev box and carry $PACK"
    exit 3
  fi
  # cuBLASLt (linked) and NCCL (linked, or loaded with dlopen when several GPUs are asked for):
  # wherever they are, their directory goes on LD_LIBRARY_PATH, which dlopen honours too.
  local libs
  libs=$(mktemp)
  nmt_cuda_lib_path > "$libs" # not in $( ): its LD_LIBRARY_PATH must reach this shell
  say_lines < "$libs"
  rm -f "$libs"
  say "ldd $BIN/nmt $BIN/test_nmt:"
  ldd "$BIN/nmt" "$BIN/test_nmt" 2>&1 | grep -v '^\s*linux-vdso' | say_lines
  if ldd "$BIN/nmt" "$BIN/test_nmt" | grep -q "not found"; then
    say "cannot run: missing shared libraries (the lines with 'not found' above)"
    exit 3
  fi
  # The tests and the training read data/bible; on the GPU machine data/ is at most a dangling
  # link, and the shards come in the pack.
  if [ ! -f data/bible/train.shard ] && [ -f "$PACK/data/bible/train.shard" ]; then
    { [ -L data ] && [ ! -e data ] && rm -f data; } || true
    [ -e data ] || ln -s "$PACK/data" data
    say "data: $PACK/data (linked as data/)"
  fi
}

# ---------------------------------------------------------------------------------------------
# stages

STAGE_END=0
# Seconds left in the stage, less $1 held back for later steps; at least 1, since timeout(1)
# reads 0 as "no limit" (a step given 1 s is reported as timed out).
left() {
  local l=$((STAGE_END - SECONDS - ${1:-0}))
  echo $((l > 1 ? l : 1))
}
counts() { grep -E '^[0-9]+ passed' "$1" | tail -1; }
# A run cut by timeout(1) ends without the runner's count line: what it got through.
cut_note() {
  [ "$1" -eq 124 ] || [ "$1" -eq 137 ] || return 0
  echo "TIMED OUT after the stage's share of ${2}s; last test line: $(grep -E '^(not )?ok ' "$3" | tail -1)"
}

stage_test() {
  say "--- test (NMT_EXPECT_GPU=1: a GPU test that skips for want of a device fails)"
  local log=$OUT/tests-cuda.log t rc
  t=$(left 60)
  NMT_BUILD_DIR=$BIN timeout -k 10 "$t" "$BIN/test_nmt" cuda_ > "$log" 2>&1
  rc=$?
  say "GPU tests (test_nmt cuda_): rc $rc: $(counts "$log") $(cut_note $rc "$t" "$log")"
  grep -B4 '^not ok' "$log" | head -80 | say_lines
  grep -o '# SKIP .*' "$log" | sort | uniq -c | say_lines
  grep -E '^# .*(rel err|steps|tf32 vs)' "$log" | head -20 | say_lines
  # The rest of the suite, in the time left (the cuda_ tests ran above); informative: the CPU
  # tests are decided on the dev box. embed_example is not packed (it needs libnmt.so beside it).
  t=$(left 10)
  if [ "$t" -lt 30 ]; then
    say "rest of the suite: not run (${t}s left in the stage)"
  else
    NMT_TEST_SKIP=cuda_,embed_example NMT_BUILD_DIR=$BIN timeout -k 10 "$t" "$BIN/test_nmt" \
      > "$OUT/tests-rest.log" 2>&1
    local r=$?
    say "rest of the suite (non-fatal): rc $r: $(counts "$OUT/tests-rest.log")" \
        "$(cut_note $r "$t" "$OUT/tests-rest.log")"
    grep '^not ok' "$OUT/tests-rest.log" | head -20 | say_lines
  fi
  return $rc
}

# memcheck's reports, one kind each: every report starts with a line "========= X" (its
# backtrace frames are indented further). "Leaked N bytes" reports are leaks; an API error whose
# first frame past libcuda is in libnccl is NCCL's own (it probes its kernels with its own static
# runtime, e.g. cudaErrorNoKernelImageForDevice from cudaFuncGetAttributes inside ncclGroupEnd
# on an H100: never nmt's last-error state); the rest are errors, and fail the stage.
memcheck_kinds() {
  awk '
    function flush() {
      if (head == "") return
      kind = head ~ /^Leaked [0-9,]+ bytes/ ? "leak" : \
             (head ~ /^Program hit .* on CUDA API call/ && first ~ /libnccl\.so/) ? "nccl" : "error"
      print kind "\t" head
      head = ""; first = ""
    }
    /^========= [^ ]/ {
      flush()
      h = substr($0, 11)
      if (h !~ /^(COMPUTE-SANITIZER|LEAK SUMMARY|ERROR SUMMARY|Target application returned|Error: process didn)/)
        head = h
      next
    }
    /^=========  +Host Frame:/ { if (first == "" && $0 !~ /libcuda\.so/) first = $0; next }
    END { flush() }' "$1"
}

memcheck_summary() {
  local log=$1 kinds leaks errors nccl
  kinds=$(memcheck_kinds "$log")
  leaks=$(grep -c '^leak' <<< "$kinds")
  nccl=$(grep -c '^nccl' <<< "$kinds")
  errors=$(grep -c '^error' <<< "$kinds")
  say "memcheck errors (not leaks, not NCCL's own): $errors; leaks: $leaks" \
      "($(grep -E '^========= LEAK SUMMARY' "$log" | tail -1 | sed 's/^========= //'));" \
      "NCCL-internal API errors: $nccl;" \
      "$(grep -E '^========= ERROR SUMMARY' "$log" | tail -1 | sed 's/^========= //') (all included)"
  sed -E 's/0x[0-9a-f]+/0x../g; s/[0-9,]+ bytes/N bytes/g' <<< "$kinds" | grep . | sort |
    uniq -c | sort -rn | head -15 | say_lines
  [ "$errors" -eq 0 ]
}

stage_sanitize() {
  say "--- sanitize (compute-sanitizer; the whole-model training tests are left out: too slow)"
  local cs c t rc status=0
  cs=$(command -v compute-sanitizer)
  for c in "$CUDA_HOME"/bin/compute-sanitizer /usr/local/cuda*/bin/compute-sanitizer; do
    [ -n "$cs" ] || { [ -x "$c" ] && cs=$c; }
  done
  [ -n "$cs" ] || { say "compute-sanitizer not found"; return 1; }
  grep -q H100 <<< "$("$NVIDIA_SMI" -L)" ||
    say "note: not an H100; compute-sanitizer refused the H200 kind's runtime before" \
        "(use nvidia-h100-x1)"
  t=$(( $(left 20) * 55 / 100 + 1 ))
  NMT_TEST_CUDA_RESET=1 NMT_TEST_SKIP=cuda_train NMT_BUILD_DIR=$BIN timeout -k 10 "$t" "$cs" \
    --tool memcheck --leak-check full --error-exitcode 99 "$BIN/test_nmt" cuda_ \
    > "$OUT/memcheck.log" 2>&1
  rc=$?
  say "memcheck: rc $rc: $(counts "$OUT/memcheck.log") $(cut_note $rc "$t" "$OUT/memcheck.log")"
  memcheck_summary "$OUT/memcheck.log" || status=1
  grep '^not ok' "$OUT/memcheck.log" | head -20 | say_lines
  # rc 99 (a report, leaks included) hides test_nmt's own exit code: a failed test fails the
  # stage whatever the sanitizer found.
  grep -q '^not ok' "$OUT/memcheck.log" && status=1
  [ "$rc" -eq 0 ] || [ "$rc" -eq 99 ] || status=1
  t=$(left 10)
  NMT_TEST_SKIP=cuda_train,cuda_model,cuda_translate,cuda_scratch_trainer,act_ckpt_cuda \
    NMT_BUILD_DIR=$BIN timeout -k 10 "$t" "$cs" --tool racecheck --racecheck-report analysis --error-exitcode 99 "$BIN/test_nmt" cuda_ \
    > "$OUT/racecheck.log" 2>&1
  rc=$?
  say "racecheck: rc $rc ($(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.log" |
      tail -1 | sed 's/^========= //')): $(counts "$OUT/racecheck.log")" \
      "$(cut_note $rc "$t" "$OUT/racecheck.log")"
  grep -E '^========= (Race|Error|Warning)' "$OUT/racecheck.log" | sort | uniq -c | head -10 |
    say_lines
  [ "$rc" -eq 0 ] || status=1
  return $status
}

# One training run: nmt train conf/base.ini for TRAIN_STEPS steps in precision $1, within $2 s.
train_one() {
  local prec=$1 t=$2 run=$RUNS/gpu-train-$1 data=data/bible smi rc peak
  [ -f $data/train.shard ] || data=$PACK/data/bible
  rm -rf "$run" "$run.mem"
  "$NVIDIA_SMI" --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$run.mem" 2>/dev/null &
  smi=$!
  timeout -k 10 "$t" "$BIN/nmt" train conf/base.ini run.out_dir="$run" \
    parallel.device=cuda parallel.devices=1 precision.mode="$prec" train.max_steps="$TRAIN_STEPS" \
    train.log_every=20 train.valid_every="$TRAIN_STEPS" train.save_every=0 \
    data.train="$data/train.shard" data.valid="$data/valid.shard" data.test="$data/test.shard" \
    data.spm_model="$data/spm.model" "${TRAIN_EXTRA[@]}" > "$OUT/train-$prec.log" 2>&1
  rc=$?
  if [ -f "$run/profile.txt" ]; then
    { echo "===== $run/profile.txt"; cat "$run/profile.txt"; } >> "$OUT/train-$prec.log"
  fi
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  peak=$(sort -n "$run.mem" 2>/dev/null | tail -1)
  say "train $prec: rc $rc, $TRAIN_STEPS steps, peak device memory ${peak:-?} MiB (nvidia-smi)" \
      "$( { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && echo "TIMED OUT after ${t}s")"
  if [ ! -f "$run/metrics.jsonl" ]; then
    say "  no $run/metrics.jsonl; the log ends:"
    tail -5 "$OUT/train-$prec.log" | say_lines
    return 1
  fi
  grep -iE 'error|warn' "$OUT/train-$prec.log" | head -5 | say_lines
  # One metrics file for every precision (each row tagged), to stay under 8 files.
  python3 - "$run/metrics.jsonl" "$prec" "$OUT/metrics.jsonl" <<'EOF' | say_lines || rc=1
import json, sys
rows = []
for line in open(sys.argv[1]):
    try:
        rows.append(json.loads(line))
    except ValueError:
        pass
with open(sys.argv[3], "a") as out:
    for r in rows:
        out.write(json.dumps(dict(r, precision=sys.argv[2])) + "\n")
train = [r for r in rows if "train_loss" in r]
if not train:
    print("no train_loss in metrics.jsonl")
    sys.exit(1)
first, last = train[0], train[-1]
tps = [r["tgt_tokens_per_s"] for r in train[1:] if "tgt_tokens_per_s" in r]
valid = [r for r in rows if "valid_loss" in r]
print("loss %.3f (step %d) -> %.3f (step %d): %s; valid loss %s, ppl %s; tgt tokens/s %s (mean "
      "after the first record); step_ms %s; loss scale %s, skipped steps %s"
      % (first["train_loss"], first["step"], last["train_loss"], last["step"],
         "falling" if last["train_loss"] < first["train_loss"] else "NOT FALLING",
         "%.3f" % valid[-1]["valid_loss"] if valid else "-",
         "%.2f" % valid[-1]["valid_ppl"] if valid and "valid_ppl" in valid[-1] else "-",
         "%.0f" % (sum(tps) / len(tps)) if tps else "-", last.get("step_ms", "-"),
         last.get("loss_scale", "-"), last.get("skipped_steps", "-")))
sys.exit(0 if last["train_loss"] < first["train_loss"] else 1)
EOF
  return $rc
}

# first: the one command of a lent GPU machine (15 minutes of device time in all, 10 per command,
# 8 files back): ends by itself within $FIRST_SECONDS (540) of the script's start and returns,
# in order of priority, (a) every GPU test, in groups of one process and one timeout each, so
# that a hang or a sticky CUDA error costs only its group (tests.log); (b) conf/base.ini in bf16
# and fp16, $TRAIN_STEPS steps each, with a profiling window and its per-module table
# (train.log, metrics.jsonl); (c) bench/gpu-compare.sh in bf16 against PyTorch eager AMP and
# torch.compile in the time left (compare.txt, results.jsonl). Files: summary.txt, tests.log,
# train.log, metrics.jsonl, compare.txt, results.jsonl.
FIRST_SECONDS=${FIRST_SECONDS:-540}
FIRST_TESTS_SECONDS=${FIRST_TESTS_SECONDS:-170}
FIRST_GROUP_SECONDS=${FIRST_GROUP_SECONDS:-90}
FIRST_TRAIN_SECONDS=${FIRST_TRAIN_SECONDS:-150}
FIRST_COMPARE_SECONDS=${FIRST_COMPARE_SECONDS:-120}
GPU_COMPARE=${GPU_COMPARE:-bench/gpu-compare.sh}

# The groups: the GPU tests' names (the pack's list, else the sources') cut after their first
# word (cuda_matmul, cuda_nccl, ...), the op tests first and the long or risky ones last.
first_groups() {
  local list=$PACK/cuda-tests.txt
  { if [ -f "$list" ]; then cat "$list"
    else grep -rhoE 'TEST\(cuda_[A-Za-z0-9_]*' test/ 2>/dev/null | sed 's/^TEST(//'; fi; } |
    awk -F_ '{print $1 "_" $2}' | sort -u |
    awk '{ late = ($0 ~ /^cuda_(model|train|translate|scratch|nccl|multinode|prof)$/);
           print late " " $0 }' | sort -k1,1n -k2 | cut -d' ' -f2
}

stage_first_tests() {
  local end=$((SECONDS + FIRST_TESTS_SECONDS)) g t rc log=$OUT/tests.log part=$OUT/.group.log
  local n=0 pass=0 fail=0 skip=0 hung=0 groups
  groups=$(first_groups)
  : > "$log"
  say "--- (a) GPU tests in groups, one process and one timeout each ($FIRST_TESTS_SECONDS s)"
  for g in $groups; do
    t=$((end - SECONDS))
    if [ "$t" -lt 5 ]; then
      say "  $g: NOT RUN (the tests' ${FIRST_TESTS_SECONDS}s are spent)"
      continue
    fi
    [ "$t" -gt "$FIRST_GROUP_SECONDS" ] && t=$FIRST_GROUP_SECONDS
    NMT_BUILD_DIR=$BIN timeout -k 5 "$t" "$BIN/test_nmt" "$g" > "$part" 2>&1
    rc=$?
    { echo "===== $g: rc $rc"; cat "$part"; } >> "$log"
    n=$((n + 1))
    local c p f k
    c=$(counts "$part")
    p=$(grep -c '^ok .* - [^#]*$' "$part"); f=$(grep -c '^not ok' "$part")
    k=$(grep -c '^ok .*# SKIP' "$part")
    pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + k))
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
      hung=$((hung + 1))
      say "  $g: TIMED OUT after ${t}s; last line: $(grep -E '^(not )?ok ' "$part" | tail -1)"
    elif [ $rc -ne 0 ]; then
      say "  $g: rc $rc: ${c:-no count line (crashed?): $(tail -1 "$part")}"
    fi
    grep -B3 '^not ok' "$part" | head -24 | say_lines
  done
  rm -f "$part"
  say "GPU tests: $pass passed, $fail failed, $skip skipped, $hung groups timed out" \
      "($n groups run)"
  grep -o '# SKIP .*' "$log" | sort | uniq -c | say_lines
  grep -E '^# .*(rel err|steps|tf32 vs)' "$log" | head -12 | say_lines
  [ "$fail" -eq 0 ] && [ "$hung" -eq 0 ]
}

stage_first() {
  local status=0 t
  STAGE_END=$((SECONDS + FIRST_TESTS_SECONDS))
  stage_first_tests || status=1
  # (b) training, with a profiling window inside the run (steps 101-110 of 200).
  local w=$((TRAIN_STEPS / 2 + 1))
  TRAIN_EXTRA=("profile.start_step=$w" "profile.stop_step=$((w + 9))")
  t=$((FIRST_SECONDS - FIRST_COMPARE_SECONDS - SECONDS))
  [ "$t" -gt "$FIRST_TRAIN_SECONDS" ] && t=$FIRST_TRAIN_SECONDS
  STAGE_END=$((SECONDS + t))
  stage_train bf16 fp16 || status=1
  TRAIN_EXTRA=()
  for p in bf16 fp16; do
    [ -f "$OUT/train-$p.log" ] && { echo "===== train $p"; cat "$OUT/train-$p.log"; }
  done > "$OUT/train.log"
  rm -f "$OUT/train-bf16.log" "$OUT/train-fp16.log"
  # (c) nmt vs PyTorch, in what is left (informative: a failure is reported, not fatal).
  t=$((FIRST_SECONDS - 10 - SECONDS))
  say "--- (c) bench/gpu-compare.sh, bf16, ${t}s"
  if [ "$t" -lt "$FIRST_COMPARE_SECONDS" ]; then
    say "  not run (${t}s left)"
  else
    local cmp=$OUT/.compare rc f
    rm -rf "$cmp"; mkdir -p "$cmp"
    # The compiled model (the slowest part: minutes of autotuning) gets 60% of the time left;
    # past it gpu-compare reports the compile as timed out and prints its table without it.
    OUT=$cmp RESULTS='' PRECISION=bf16 GPU_PACK=$PACK COMPILE_DEADLINE_S=$((t * 6 / 10)) \
      timeout -k 5 "$t" "$GPU_COMPARE" \
      > "$cmp/output.txt" 2>&1
    rc=$?
    for f in output.txt logs.txt nmt-metrics.jsonl; do
      [ -f "$cmp/$f" ] && { echo "===== $f"; cat "$cmp/$f"; }
    done > "$OUT/compare.txt"
    [ -f "$cmp/results.jsonl" ] && cp "$cmp/results.jsonl" "$OUT/results.jsonl"
    rm -rf "$cmp"
    say "  gpu-compare: rc $rc$( { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && echo " (TIMED OUT)")"
    grep -E '^(summary:|loss check|nmt |pytorch |torch.compile|peak for MFU|gpu-compare:)' \
      "$OUT/compare.txt" | head -16 | say_lines
  fi
  return $status
}

# Trains each precision of $@, each within an equal share of the time left.
stage_train() {
  say "--- train (conf/base.ini, $TRAIN_STEPS steps each: $*)"
  rm -f "$OUT/metrics.jsonl"
  local n=$# status=0 p t
  for p in "$@"; do
    t=$(( $(left 5) / n ))
    if [ "$t" -lt "$TRAIN_MIN_SECONDS" ]; then
      say "train $p: not run (${t}s left in the stage)"
      status=1
    else
      train_one "$p" "$t" || status=1
    fi
    n=$((n - 1))
  done
  return $status
}

# ---------------------------------------------------------------------------------------------

[ $# -ge 1 ] || usage
if [ "$1" = targets ]; then
  [ $# -eq 2 ] || usage
  targets "$2"
  exit $?
fi
if [ "$1" = memcheck-summary ]; then
  if [ $# -ne 2 ] || [ ! -f "$2" ]; then usage; fi
  SUMMARY=/dev/null
  memcheck_summary "$2"
  exit $?
fi
if [ "$1" = pack ]; then
  [ $# -eq 1 ] || usage
  pack
  exit $?
fi
for s in "$@"; do
  case "$s" in
    libs|first|test|sanitize|train|train-fp32|train-tf32|train-bf16|train-fp16|all) ;;
    *) echo "gpu-check: unknown stage '$s'" >&2; usage ;;
  esac
done
read -r -a PRECS <<< "$TRAIN_PRECISIONS"
TRAIN_EXTRA=()
# The first stage's budget counts the setup too (the find over / can take up to a minute).
STAGE_END=$((SECONDS + STAGE_SECONDS))
setup "$@"
status=0
first=1
for s in "$@"; do
  [ $first -eq 1 ] || STAGE_END=$((SECONDS + STAGE_SECONDS))
  first=0
  case "$s" in
    libs) ;;
    first) stage_first || status=1 ;;
    test) stage_test || status=1 ;;
    sanitize) stage_sanitize || status=1 ;;
    train) stage_train "${PRECS[@]}" || status=1 ;;
    train-*) stage_train "${s#train-}" || status=1 ;;
    all)
      stage_test || status=1
      STAGE_END=$((SECONDS + STAGE_SECONDS)); stage_sanitize || status=1
      STAGE_END=$((SECONDS + STAGE_SECONDS)); stage_train "${PRECS[@]}" || status=1 ;;
  esac
done
n=$(find "$OUT" -type f | wc -l)
[ "$n" -le 8 ] || say "note: $n files under $OUT; the device tool brings back 8"
say "gpu-check done: status $status (results in $OUT)"
exit $status
