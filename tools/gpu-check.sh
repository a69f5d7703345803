#!/usr/bin/env bash
# tools/gpu-check.sh — the CUDA backend's checks on a machine with a GPU, one stage per call of
# the device tool (docs/gpu-runs.md, "The one command").
#
#   tools/gpu-check.sh pack        on a machine WITHOUT a GPU (this repo's dev box; needs nvcc,
#                                  not a GPU): a CUDA build (fat binary sm_80/86/90 + compute_90
#                                  PTX), packed into build/gpu-pack/: nmt, test_nmt and
#                                  bench/dump_batches with their debug sections stripped, the
#                                  shared libraries a bare CUDA image may lack (iniparser,
#                                  OpenBLAS, ...), the Bible shards and the valid split's raw
#                                  text, sacreBLEU's Python packages, COMMIT and BUILD-INFO.
#                                  `make gpu-pack` runs it. Fails if the pack would not fit the
#                                  device tool's 64 MiB carry limit.
#   tools/gpu-check.sh targets BINARY   the GPU code a binary carries (sm_XX ELF, compute_XX PTX)
#   tools/gpu-check.sh memcheck-summary LOG   reads a compute-sanitizer memcheck log brought back:
#                                  errors, leaks and NCCL's own API errors apart; exit 1 on errors
#   tools/gpu-check.sh STAGE...    on the GPU machine, with build/gpu-pack carried:
#       first     THE command of a lent GPU machine: GPU tests in groups, training of both
#                 activation storages (bf16, two batch shapes) and fp16, each profiled, nmt vs
#                 PyTorch; ends by itself within $FIRST_SECONDS (540)
#       libs      only the setup every stage starts with (a few seconds): nvidia-smi -L, driver
#                 and runtime versions, where libcublasLt.so.13 and libnccl.so.2 are, ldd
#       test      every GPU test (test_nmt cuda_), then the rest of the suite in the time left
#       memcheck  compute-sanitizer memcheck (leaks read apart from errors) on the op tests only
#                 (first's late groups left out): the short second call after `first`
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
  echo "usage: tools/gpu-check.sh pack | targets BINARY | memcheck-summary LOG | STAGE... (first, libs, test," \
       "memcheck, sanitize, train, train-fp32|tf32|bf16|fp16, all)" >&2
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
  make -j"$(nproc)" CUDA=1 build/test_nmt build/nmt build/libnmt.a build/bench/attention_fused ||
    exit 1
  rm -rf "$PACK"
  mkdir -p "$PACK/bin" "$PACK/lib" "$PACK/data/bible"
  cp build/test_nmt build/nmt build/bench/attention_fused "$PACK/bin/"
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
  # The libraries over 1 MiB travel gzip'd (OpenBLAS alone is 36 MB, 10 MB so): the pack and
  # the tracked files must fit the carry limit. setup() unpacks them on the GPU machine.
  local lib
  for lib in "$PACK"/lib/*; do
    [ "$(stat -c %s "$lib")" -le 1048576 ] || gzip -9 "$lib" || exit 1
  done
  # Host debug sections only: the symbol table stays (named frames in compute-sanitizer's host
  # backtraces), and the device code's line table (-lineinfo) lives in .nv_fatbin, which strip
  # keeps, so sanitizer reports still name cuda/*.cu lines.
  local before after
  before=$(du -cb "$PACK"/bin/* | tail -1 | cut -f1)
  strip --strip-debug "$PACK"/bin/*
  after=$(du -cb "$PACK"/bin/* | tail -1 | cut -f1)
  # The GPU machine cannot prepare the corpus (no package registry there): no shards, no pack.
  # Part (b)'s validation BLEU also reads the valid split's raw text and its languages next to
  # the shard (nmt_eval_split_text: spm.settings, valid.SRC, valid.TGT; 70 KB).
  local sl tl f
  sl=$(sed -n 's/.*\bsrc=\([^ ]*\).*/\1/p' data/bible/spm.settings 2>/dev/null)
  tl=$(sed -n 's/.*\btgt=\([^ ]*\).*/\1/p' data/bible/spm.settings 2>/dev/null)
  for f in train.shard valid.shard test.shard spm.model spm.settings "valid.${sl:-SRC}" \
           "valid.${tl:-TGT}"; do
    [ -f "data/bible/$f" ] ||
      { echo "gpu-check pack: data/bible/$f is missing: run 'make data' first (the GPU machine" \
             "cannot build the corpus)" >&2; exit 3; }
    cp "data/bible/$f" "$PACK/data/bible/"
  done
  pack_sacrebleu || exit 1
  # The GPU tests' names, for `first`'s groups (one process per group, each test named
  # exactly): the binary's own list (every cuda_ test, reported as excluded by NMT_TEST_SKIP,
  # none run), which has the names a macro makes too.
  NMT_TEST_SKIP=cuda_ "$PACK/bin/test_nmt" cuda_ 2>/dev/null |
    sed -n 's/^ok [0-9]* - \(cuda_[A-Za-z0-9_]*\) # SKIP.*/\1/p' | sort -u > "$PACK/cuda-tests.txt"
  [ -s "$PACK/cuda-tests.txt" ] ||
    { echo "gpu-check pack: $PACK/bin/test_nmt lists no cuda_ test" >&2; exit 1; }
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
  # The binaries travel gzip'd too (each fat binary, sm_80/86/90 + PTX, is about 20 MB
  # stripped and a quarter of that gzip'd); setup() unpacks them, as the libraries.
  local b
  for b in "$PACK"/bin/*; do
    [ "$(stat -c %s "$b")" -le 1048576 ] || gzip -9 "$b" || exit 1
  done
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

# sacreBLEU for part (b)'s validation BLEU, which nmt scores with `python3 -m sacrebleu`: the GPU
# machine has no package registry and may lack it. Its package and the pure-Python ones it
# imports for BLEU and chrF (portalocker, tabulate, colorama), from this machine's python3
# (tools/install-deps.sh --bleu), without bytecode, into $PACK/python (about 1 MiB); and a
# stand-in for lxml in $PACK/python-lxml: sacreBLEU 2.x imports lxml.etree when it starts, for
# its WMT test sets, which scoring two files never reads, and lxml is compiled for one Python
# version. `first` uses the machine's own sacreBLEU where it has one, the stand-in only where
# lxml.etree cannot be imported (find_sacrebleu). Without sacreBLEU here the pack carries none
# and says so; `first` then trains without validation BLEU and says that.
pack_sacrebleu() {
  rm -rf "$PACK/python" "$PACK/python-lxml"
  python3 - "$PACK" <<'PY'
import importlib, os, shutil, sys
pack = sys.argv[1]
try:
    mods = [importlib.import_module(m) for m in ("sacrebleu", "portalocker", "tabulate", "colorama")]
except ImportError as e:
    print("gpu-check pack: note: no sacreBLEU here (%s): none packed, so part (b) of `first` runs "
          "without validation BLEU unless the GPU machine's python3 has it "
          "(tools/install-deps.sh --bleu, then pack again)" % e)
    sys.exit(0)
dst = os.path.join(pack, "python")
os.makedirs(dst)
for m in mods:
    f = m.__file__
    if os.path.basename(f) == "__init__.py":
        shutil.copytree(os.path.dirname(f), os.path.join(dst, m.__name__),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "tests"))
    else:
        shutil.copy(f, dst)
shim = os.path.join(pack, "python-lxml", "lxml")
os.makedirs(shim)
with open(os.path.join(shim, "__init__.py"), "w") as f:
    f.write("# A stand-in for lxml (tools/gpu-check.sh pack_sacrebleu): sacreBLEU imports\n"
            "# lxml.etree for its WMT test sets only.\n")
with open(os.path.join(shim, "etree.py"), "w") as f:
    f.write("from xml.etree.ElementTree import *  # noqa: F401,F403\n")
print("sacreBLEU %s packed with %s" % (mods[0].__version__,
                                       ", ".join(m.__name__ for m in mods[1:])))
PY
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
  # The binaries and libraries that travel gzip'd (pack), unpacked beside their archives once
  # (a binary keeps its execute bit).
  local z
  for z in "$PACK"/bin/*.gz "$PACK"/lib/*.gz; do
    { [ -e "$z" ] && [ ! -s "${z%.gz}" ]; } || continue
    if ! gzip -dc "$z" > "${z%.gz}.part" || ! mv "${z%.gz}.part" "${z%.gz}"; then
      say "cannot run: cannot unpack $z (gzip)"
      exit 3
    fi
    case $z in "$PACK"/bin/*) chmod +x "${z%.gz}" ;; esac
  done
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

# compute-sanitizer: on PATH, else the toolkit's; empty where there is none.
find_sanitizer() {
  local cs c
  cs=$(command -v compute-sanitizer)
  for c in "$CUDA_HOME"/bin/compute-sanitizer /usr/local/cuda*/bin/compute-sanitizer; do
    [ -n "$cs" ] || { [ -x "$c" ] && cs=$c; }
  done
  echo "$cs"
}

sanitizer_note() {
  grep -q H100 <<< "$("$NVIDIA_SMI" -L)" ||
    say "note: not an H100; compute-sanitizer refused the H200 kind's runtime before" \
        "(use nvidia-h100-x1)"
}

# memcheck (sanitizer $1) with leaks on test_nmt cuda_, the tests whose names contain one of the
# comma-separated $2 left out, within $3 s: memcheck.log and its reading in the summary.
# Returns 1 on a memcheck error (not a leak, not NCCL's own) or a failed test.
run_memcheck() {
  local cs=$1 skip=$2 t=$3 rc status=0
  NMT_TEST_CUDA_RESET=1 NMT_TEST_SKIP=$skip NMT_BUILD_DIR=$BIN timeout -k 10 "$t" "$cs" \
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
  return $status
}

# memcheck: the short second call after `first` (docs/gpu-runs.md), memcheck on the op tests
# alone: first's late groups (the whole model, training, decoding, NCCL, the profiler, several
# nodes) are left out, which is what makes it fit about 150 s (STAGE_SECONDS).
stage_memcheck() {
  say "--- memcheck (compute-sanitizer, leaks read apart, on the op tests; left out:" \
      "${FIRST_LATE_GROUPS// /, })"
  local cs
  cs=$(find_sanitizer)
  [ -n "$cs" ] || { say "compute-sanitizer not found"; return 1; }
  sanitizer_note
  run_memcheck "$cs" "${FIRST_LATE_GROUPS// /,}" "$(left 10)"
}

stage_sanitize() {
  say "--- sanitize (compute-sanitizer; the whole-model training tests are left out: too slow)"
  local cs t rc status=0
  cs=$(find_sanitizer)
  [ -n "$cs" ] || { say "compute-sanitizer not found"; return 1; }
  sanitizer_note
  t=$(( $(left 20) * 55 / 100 + 1 ))
  run_memcheck "$cs" cuda_train "$t" || status=1
  t=$(left 10)
  NMT_TEST_SKIP=cuda_train,cuda_model,cuda_translate,cuda_scratch_trainer,cuda_act_ckpt \
    NMT_BUILD_DIR=$BIN timeout -k 10 "$t" "$cs" --tool racecheck --racecheck-report analysis \
    --error-exitcode 99 "$BIN/test_nmt" cuda_ > "$OUT/racecheck.log" 2>&1
  rc=$?
  say "racecheck: rc $rc ($(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.log" |
      tail -1 | sed 's/^========= //')): $(counts "$OUT/racecheck.log")" \
      "$(cut_note $rc "$t" "$OUT/racecheck.log")"
  grep -E '^========= (Race|Error|Warning)' "$OUT/racecheck.log" | sort | uniq -c | head -10 |
    say_lines
  [ "$rc" -eq 0 ] || status=1
  return $status
}

# The figures of one training run, from its metrics.jsonl ($1), for the summary: run $2 in
# precision $3, rows appended to $4 tagged with both (and precision.activations), the run's
# exit code $5, planned steps $6, nvidia-smi's peak MiB $7, its rows for first's table appended
# to $8 (none when empty); then the run's overrides (the profiling window's intervals are left
# out of the speed figures). Exit 1 when there is no loss or it does not fall.
TRAIN_REPORT_PY='
import json, sys
(metrics, name, prec, out, rc, planned, peak, table), ovr = sys.argv[1:9], sys.argv[9:]
ovr = dict(a.split("=", 1) for a in ovr if "=" in a)
act = ovr.get("precision.activations")
rows = []
for line in open(metrics):
    try:
        rows.append(json.loads(line))
    except ValueError:
        pass
with open(out, "a") as f:
    for r in rows:
        f.write(json.dumps(dict(r, run=name, precision=prec, activations=act)) + "\n")
train = [r for r in rows if "train_loss" in r]
row = dict(run=name, precision=prec, activations=act, max_tokens=ovr.get("data.max_tokens"),
           accum_steps=ovr.get("train.accum_steps"), planned=int(planned), rc=int(rc),
           peak_mib=float(peak) if peak.replace(".", "", 1).isdigit() else None)
if not train:
    print("no train_loss in metrics.jsonl")
    row["status"] = "no loss logged (rc %s)" % rc
    if table:
        open(table, "a").write(json.dumps(row) + "\n")
    sys.exit(1)
# Speed over the logged intervals after the first (start-up: cuBLASLt loading, the first
# steps) and outside the profiling window (its ranges and events cost time), weighted by time.
w0, w1 = int(ovr.get("profile.start_step", 0)), int(ovr.get("profile.stop_step", 0))
timed, prev = [], 0
for i, r in enumerate(train):
    lo, prev = prev + 1, r["step"]
    if i > 0 and not (w0 and lo <= w1 and r["step"] >= w0):
        timed.append((r, r["step"] - lo + 1))
timed = timed or [(r, 1) for r in train[1:] or train]
def mean(key):
    num = den = 0.0
    for r, k in timed:
        if r.get(key) is None:
            continue
        dt = (r.get("step_ms") or 1.0) * k
        num, den = num + r[key] * dt, den + dt
    return num / den if den else None
first, last = train[0], train[-1]
valid = [r for r in rows if "valid_loss" in r]
v = valid[-1] if valid else {}
row.update(last_step=last["step"], loss_first=first["train_loss"], loss_first_step=first["step"],
           loss_last=last["train_loss"], tok_s=mean("tgt_tokens_per_s"), step_ms=mean("step_ms"),
           mfu=mean("mfu"), intervals=len(timed), valid_loss=v.get("valid_loss"),
           valid_ppl=v.get("valid_ppl"), valid_bleu=v.get("valid_bleu"),
           valid_chrf=v.get("valid_chrf"), loss_scale=last.get("loss_scale"),
           skipped_steps=last.get("skipped_steps"),
           falling=last["train_loss"] < first["train_loss"])
f = lambda x, fmt: "-" if x is None else fmt % x  # noqa: E731
print("loss %.3f (step %d) -> %.3f (step %d): %s; valid loss %s, ppl %s%s; tgt tokens/s %s, "
      "step %s ms, MFU %s (%d logged intervals: after the first, outside the profiling window); "
      "loss scale %s, skipped steps %s"
      % (first["train_loss"], first["step"], last["train_loss"], last["step"],
         "falling" if row["falling"] else "NOT FALLING", f(row["valid_loss"], "%.3f"),
         f(row["valid_ppl"], "%.2f"),
         "" if row["valid_bleu"] is None else
         "; valid BLEU %.2f, chrF2 %s" % (row["valid_bleu"], f(row["valid_chrf"], "%.2f")),
         f(row["tok_s"], "%.0f"), f(row["step_ms"], "%.1f"),
         f(None if row["mfu"] is None else 100 * row["mfu"], "%.1f%%"), len(timed),
         last.get("loss_scale", "-"), last.get("skipped_steps", "-")))
if table:
    open(table, "a").write(json.dumps(row) + "\n")
sys.exit(0 if row["falling"] else 1)
'

# One training run of conf/base.ini on one GPU within $3 s: run $1 in precision $2 for $4 steps,
# validating at the last when $5 is 1; the rest of the arguments are more overrides (after
# TRAIN_EXTRA's), TRAIN_ENV assignments for its environment. Its log, with its profile.txt,
# goes to $OUT/train-$1.log; its metrics rows to $OUT/metrics.jsonl; its figures to the
# summary, and to $TRAIN_TABLE (a JSON line) when that is set.
TRAIN_ENV=()
TRAIN_TABLE=
train_one() {
  local name=$1 prec=$2 t=$3 steps=$4 valid=$5 run=$RUNS/gpu-train-$1 data=data/bible smi rc peak
  shift 5
  local log=$OUT/train-$name.log every=$(( steps / 10 > 0 ? steps / 10 : 1 )) ve=0
  [ "$valid" = 1 ] && ve=$steps
  [ -f $data/train.shard ] || data=$PACK/data/bible
  rm -rf "$run" "$run.mem"
  mkdir -p "$RUNS"
  "$NVIDIA_SMI" --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$run.mem" 2>/dev/null &
  smi=$!
  local ovr=(train.log_every="$every" "${TRAIN_EXTRA[@]}" "$@")
  timeout -k 10 "$t" env "${TRAIN_ENV[@]}" "$BIN/nmt" train conf/base.ini run.out_dir="$run" \
    parallel.device=cuda parallel.devices=1 precision.mode="$prec" train.max_steps="$steps" \
    train.valid_every="$ve" train.save_every=0 \
    data.train="$data/train.shard" data.valid="$data/valid.shard" data.test="$data/test.shard" \
    data.spm_model="$data/spm.model" "${ovr[@]}" > "$log" 2>&1
  rc=$?
  if [ -f "$run/profile.txt" ]; then
    { echo "===== $run/profile.txt"; cat "$run/profile.txt"; } >> "$log"
  fi
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  peak=$(sort -n "$run.mem" 2>/dev/null | tail -1)
  say "train $name: rc $rc, $steps steps, peak device memory ${peak:-?} MiB (nvidia-smi)" \
      "$( { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && echo "TIMED OUT after ${t}s")"
  if [ ! -f "$run/metrics.jsonl" ]; then
    say "  no $run/metrics.jsonl; the log ends:"
    tail -5 "$log" | say_lines
    [ -n "$TRAIN_TABLE" ] &&
      printf '{"run": "%s", "status": "no metrics (rc %s)"}\n' "$name" "$rc" >> "$TRAIN_TABLE"
    return 1
  fi
  grep -iE 'error|warn' "$log" | head -5 | say_lines
  grep -E 'validation BLEU: rank 0 decoded|[|] valid BLEU ' "$log" | head -3 | say_lines
  grep -E '^# (GEMM calls|device kernels) per micro-batch' "$run/profile.txt" 2>/dev/null |
    say_lines
  python3 -c "$TRAIN_REPORT_PY" "$run/metrics.jsonl" "$name" "$prec" "$OUT/metrics.jsonl" "$rc" \
    "$steps" "${peak:--}" "$TRAIN_TABLE" "${ovr[@]}" | say_lines || rc=1
  # The checkpoint a finished run writes (hundreds of MiB for base) is not needed here.
  rm -rf "$run/checkpoints"
  return $rc
}

# first: the one command of a lent GPU machine (15 minutes of device time in all, 10 per command,
# 8 files back): ends by itself within $FIRST_SECONDS (540) of the script's start and returns,
# in order of priority, (a) every GPU test, in groups of one process and one timeout each, so
# that a hang or a sticky CUDA error costs only its group (tests.log); (b) conf/base.ini trained
# in both activation storages (precision.activations = half, the default, and fp32, the
# earlier path) in bf16 at two batch shapes, the half storage with kernels.attention = fused
# beside unfused at both (issue 35), and fp16 with the half storage, each run with a
# profiling window and its per-module table, side by side in one table (train.log,
# metrics.jsonl); (c) bench/gpu-compare.sh in bf16, nmt against PyTorch eager AMP and
# torch.compile, in the time left (compare.txt, results.jsonl). Files: summary.txt, tests.log,
# train.log, metrics.jsonl, compare.txt, results.jsonl.
FIRST_SECONDS=${FIRST_SECONDS:-540}
FIRST_TESTS_SECONDS=${FIRST_TESTS_SECONDS:-210}
FIRST_GROUP_SECONDS=${FIRST_GROUP_SECONDS:-90}
# cuda_multiworker (two workers sharing GPU 0 through parallel.comm = host: the multi-GPU
# engine's paths short of NCCL) gets at most this of the group timeout; FIRST_TESTS_SECONDS
# grew by as much for it (150 -> 210), which (b) and (c) still fit after.
FIRST_MULTIWORKER_SECONDS=${FIRST_MULTIWORKER_SECONDS:-60}
FIRST_TRAIN_SECONDS=${FIRST_TRAIN_SECONDS:-170}
FIRST_COMPARE_SECONDS=${FIRST_COMPARE_SECONDS:-120}
FIRST_BIG_STEPS=${FIRST_BIG_STEPS:-60}
GPU_COMPARE=${GPU_COMPARE:-bench/gpu-compare.sh}
# Part (b)'s runs, in order of priority, each
# PRECISION:ACTIVATIONS:MAX_TOKENS:ACCUM:STEPS:VALID[:ATTENTION] (VALID: bleu = a validation at
# the last step with validation BLEU, valid = one without, none; ATTENTION: kernels.attention,
# unfused when left out): the half storage at the config's 4 micro-batches of 6250 tokens (the
# 2026-11-26 curve's) with each attention (issue 35: fused against unfused, the same batches),
# then at one micro-batch of 25000 for fewer steps with each, then the fp32 storage at both
# shapes, then fp16 with the half storage.
FIRST_TRAIN_PLAN=${FIRST_TRAIN_PLAN:-"bf16:half:6250:4:$TRAIN_STEPS:bleu
bf16:half:6250:4:$TRAIN_STEPS:valid:fused bf16:half:25000:1:$FIRST_BIG_STEPS:none
bf16:half:25000:1:$FIRST_BIG_STEPS:none:fused bf16:fp32:6250:4:$TRAIN_STEPS:valid
bf16:fp32:25000:1:$FIRST_BIG_STEPS:none fp16:half:6250:4:$TRAIN_STEPS:valid"}
# The late groups of (a), in the order they run after the op tests (alphabetical): the whole
# model, training (one worker, then two on one GPU: cuda_multiworker) and decoding first
# (cuda_translate is the one device test of the whole decoding path, cuda_valid its
# validation rig), then NCCL, the profiler and several nodes,
# the groups that have hung or run long before. The memcheck stage leaves them all out.
FIRST_LATE_GROUPS="cuda_model cuda_act cuda_scratch cuda_train cuda_trainer cuda_multiworker
cuda_translate cuda_valid cuda_nccl cuda_prof cuda_multinode"
FIRST_LATE_GROUPS=${FIRST_LATE_GROUPS//$'\n'/ } # one line

# The groups, one line each: its name, then its tests. The GPU tests' names (the pack's list,
# else the sources') grouped by their first two words (cuda_matmul, cuda_nccl, ...), the op
# tests first in name order, then FIRST_LATE_GROUPS in their order.
first_groups() {
  local list=$PACK/cuda-tests.txt
  { if [ -f "$list" ]; then cat "$list"
    else grep -rhoE 'TEST\(cuda_[A-Za-z0-9_]*' test/ 2>/dev/null | sed 's/^TEST(//'; fi; } |
    sort -u | awk -v late="$FIRST_LATE_GROUPS" '
      BEGIN { n = split(late, l, " "); for (i = 1; i <= n; i++) rank[l[i]] = i }
      NF { split($1, w, "_"); g = w[1] "_" w[2]; names[g] = names[g] " " $1 }
      END { for (g in names) printf "%d %s%s\n", (g in rank) ? rank[g] : 0, g, names[g] }' |
    sort -k1,1n -k2,2 | cut -d' ' -f2-
}

stage_first_tests() {
  local end=$((SECONDS + FIRST_TESTS_SECONDS)) g names x t rc log=$OUT/tests.log
  local part=$OUT/.group.log n=0 pass=0 fail=0 skip=0 hung=0 groups
  groups=$(first_groups)
  : > "$log"
  say "--- (a) GPU tests in groups, one process and one timeout each, every test named exactly" \
      "($FIRST_TESTS_SECONDS s)"
  while read -r g names; do
    [ -n "$g" ] || continue
    t=$((end - SECONDS))
    if [ "$t" -lt 5 ]; then
      say "  $g: NOT RUN (the tests' ${FIRST_TESTS_SECONDS}s are spent)"
      continue
    fi
    [ "$t" -gt "$FIRST_GROUP_SECONDS" ] && t=$FIRST_GROUP_SECONDS
    [ "$g" = cuda_multiworker ] && [ "$t" -gt "$FIRST_MULTIWORKER_SECONDS" ] &&
      t=$FIRST_MULTIWORKER_SECONDS
    # Exact names (test/runner.c: a trailing '$'), so that each test runs once: cuda_train as
    # a substring would also run cuda_trainer_device_selection.
    local args=()
    for x in $names; do args+=("$x\$"); done
    NMT_BUILD_DIR=$BIN timeout -k 5 "$t" "$BIN/test_nmt" "${args[@]}" > "$part" 2>&1 < /dev/null
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
  done <<< "$groups"
  rm -f "$part"
  say "GPU tests: $pass passed, $fail failed, $skip skipped, $hung groups timed out" \
      "($n groups run)"
  grep -o '# SKIP .*' "$log" | sort | uniq -c | say_lines
  grep -E '^# .*(rel err|steps|tf32 vs)' "$log" | head -12 | say_lines
  # Which cuBLASLt epilogues the half-storage GEMMs took on this GPU (test_cuda_matmul.c).
  grep -E '^# .*linear_half.*: (mask (not )?written, )?(un)?fused$' "$log" | head -24 | say_lines
  # Which paths of the multi-GPU engine ran on this one GPU (cuda_multiworker: two workers on
  # GPU 0, parallel.comm = host); NCCL with several ranks needs a machine with 2+ GPUs.
  say "multi-worker engine on one GPU (2 workers, parallel.comm = host):$(awk '
    /^===== / { in_g = ($2 == "cuda_multiworker:") }
    in_g && / - cuda_multiworker_/ {
      n = $0; sub(/.* - cuda_multiworker_/, "", n); sub(/ .*/, "", n)
      if ($0 ~ /^not ok/) f = f " " n; else if ($0 ~ /# SKIP/) k = k " " n; else p = p " " n
      seen = 1 }
    END { if (!seen) { print " not run"; exit }
          if (p != "") printf " passed:%s;", p
          if (f != "") printf " FAILED:%s;", f
          if (k != "") printf " skipped:%s;", k
          print "" }' "$log")"
  [ "$fail" -eq 0 ] && [ "$hung" -eq 0 ]
}

# Where `python3 -m sacrebleu` runs for part (b)'s validation BLEU, tried on two lines: the
# machine's python3 as it is, else with the pack's copy on PYTHONPATH, else with the copy and
# its lxml stand-in (pack_sacrebleu). Sets BLEU_PATH to the PYTHONPATH nmt needs (empty: none)
# and BLEU_HOW to what was found; returns 1 when none runs.
find_sacrebleu() {
  local f p pk=$PACK
  BLEU_PATH='' BLEU_HOW=
  [ "${pk#/}" != "$pk" ] || pk=$ROOT/$pk
  mkdir -p "$RUNS" || return 1
  f=$RUNS/.sacrebleu-probe.txt
  printf 'in the beginning\nand the earth\n' > "$f"
  for p in - "$pk/python" "$pk/python:$pk/python-lxml"; do
    if [ "$p" != - ] && [ ! -d "${p%%:*}" ]; then continue; fi
    [ "$p" = - ] && p=
    if PYTHONPATH="$p${PYTHONPATH:+${p:+:}$PYTHONPATH}" timeout 15 python3 -m sacrebleu "$f" \
         -i "$f" -m bleu chrf -w 2 -f text > /dev/null 2>&1; then
      BLEU_PATH=$p
      case "$p" in
        '') BLEU_HOW="the machine's python3" ;;
        *python-lxml) BLEU_HOW="the pack's copy with its lxml stand-in" ;;
        *) BLEU_HOW="the pack's copy" ;;
      esac
      rm -f "$f"
      return 0
    fi
  done
  rm -f "$f"
  return 1
}

# The table of part (b)'s runs, from TRAIN_TABLE, in the plan's order ($@: the run names), with
# the new/old tokens/s ratio per precision and batch and the 2026-11-26 curve beside.
FIRST_TABLE_PY='
import json, sys
table, names = sys.argv[1], sys.argv[2:]
rows = {}
for line in open(table):
    r = json.loads(line)
    rows[r["run"]] = r
f = lambda x, fmt: "-" if x is None else fmt % x  # noqa: E731
fmt = "%-20s %10s %8s %6s %21s %-22s %8s"
print(fmt % ("run", "tgt tok/s", "step ms", "MFU", "loss first -> last", "valid", "peak MiB"))
for n in names:
    r = rows.get(n, {"status": "not run"})
    if "tok_s" not in r:
        print("%-20s %s" % (n, r.get("status", "no figures")))
        continue
    valid = "-" if r.get("valid_loss") is None else "%.3f" % r["valid_loss"]
    if r.get("valid_bleu") is not None:
        valid += " BLEU %.2f" % r["valid_bleu"]
    steps = "%d" % r["last_step"] + ("" if r["last_step"] == r["planned"] else
                                      " of %d" % r["planned"])
    print(fmt % (n, f(r["tok_s"], "%.0f"), f(r["step_ms"], "%.1f"),
                 f(None if r.get("mfu") is None else 100 * r["mfu"], "%.1f%%"),
                 "%.3f -> %.3f (%s)" % (r["loss_first"], r["loss_last"], steps), valid,
                 f(r.get("peak_mib"), "%.0f")))
    if r.get("loss_scale") is not None and r["precision"] == "fp16":
        print("%-20s loss scale %s, skipped steps %s" % ("", r["loss_scale"], r.get("skipped_steps")))
for n in names:
    o = n.replace("-half-", "-fp32-")
    if "-half-" not in n or o not in names:
        continue
    r, old = rows.get(n, {}), rows.get(o, {})
    if r.get("tok_s") and old.get("tok_s"):
        print("new/old tgt tok/s, %s %s: %.2fx (half %.0f, fp32 %.0f; step %.1f vs %.1f ms)"
              % (n.split("-")[0], n.split("-")[-1], r["tok_s"] / old["tok_s"], r["tok_s"],
                 old["tok_s"], r["step_ms"] or 0, old["step_ms"] or 0))
    else:
        print("new/old tgt tok/s, %s %s: - (a run has no figures)"
              % (n.split("-")[0], n.split("-")[-1]))
ref = [r for r in rows.values() if r.get("precision") == "bf16" and r.get("max_tokens") == "6250"
       and r.get("accum_steps") == "4" and "loss_last" in r]
print("2026-11-26 (H100, bf16, 4x6250, fp32 activations): loss 9.386 (first record) -> 6.430 "
      "(step 200), valid 6.515; 236821 tgt tok/s, 86.5 ms per step"
      + "".join("; %s: %.3f -> %.3f (step %d), valid %s"
                % (r["run"], r["loss_first"], r["loss_last"], r["last_step"],
                   f(r.get("valid_loss"), "%.3f")) for r in ref))
'

# A run's expected seconds: start-up and validation ~15, its steps (max_tokens $1 x accum $2 x
# $3 steps) at 250000 target tokens/s, validation BLEU ($4 = bleu) ~10.
run_weight() {
  local w=$((15 + $3 * $1 * $2 / 250000))
  [ "$4" = bleu ] && w=$((w + 10))
  echo "$w"
}

# Part (b): FIRST_TRAIN_PLAN's runs within the stage's time (STAGE_END), in order. A run gets up
# to 1.5 times its expected length (run_weight) while each run after it keeps
# FIRST_RUN_MIN_SECONDS plus FIRST_RUN_GAP_SECONDS (what a run's report and the next one's
# start take, outside its timeout: without it a run that hangs left the next one just under
# its minimum), and at least its share of the time left in proportion to the expected
# lengths: time a run leaves goes to the next, a slow start-up does not cut a run that would
# have finished, and a run that hangs costs a bounded part. Under FIRST_RUN_MIN_SECONDS a run
# is NOT RUN, and the summary and the table say so.
FIRST_RUN_MIN_SECONDS=${FIRST_RUN_MIN_SECONDS:-15}
FIRST_RUN_GAP_SECONDS=${FIRST_RUN_GAP_SECONDS:-3}
stage_first_train() {
  local plan=() e prec act tok acc steps val name w total=0 t status=0 valid names=() left_s
  local share n_left
  read -r -a plan <<< "${FIRST_TRAIN_PLAN//$'\n'/ }"
  for e in "${plan[@]}"; do
    IFS=: read -r prec act tok acc steps val _ <<< "$e"
    total=$((total + $(run_weight "$tok" "$acc" "$steps" "$val")))
  done
  say "--- (b) training: conf/base.ini on one GPU, ${#plan[@]} runs in $((STAGE_END - SECONDS)) s" \
      "(precision.activations half = the new storage, fp32 = the earlier path)"
  TRAIN_TABLE=$RUNS/gpu-first-runs.jsonl
  mkdir -p "$RUNS"
  rm -f "$OUT/metrics.jsonl" "$TRAIN_TABLE"
  local bleu_ok=${BLEU_OK:-0}
  if [ "$bleu_ok" -eq 1 ]; then
    say "validation BLEU: sacreBLEU from $BLEU_HOW"
  else
    say "validation BLEU: NOT RUN (no python3 -m sacrebleu here or in the pack: tools/install-deps.sh" \
        "--bleu on the dev box, then make gpu-pack)"
  fi
  n_left=${#plan[@]}
  local att
  for e in "${plan[@]}"; do
    IFS=: read -r prec act tok acc steps val att <<< "$e"
    att=${att:-unfused}
    name=$prec-$act-${acc}x$tok
    [ "$att" = unfused ] || name=$name-$att
    names+=("$name")
    w=$(run_weight "$tok" "$acc" "$steps" "$val")
    left_s=$((STAGE_END - SECONDS - 2))
    share=$((left_s * w / total))
    t=$((w * 3 / 2))
    n_left=$((n_left - 1))
    [ "$t" -le $((left_s - n_left * (FIRST_RUN_MIN_SECONDS + FIRST_RUN_GAP_SECONDS))) ] ||
      t=$((left_s - n_left * (FIRST_RUN_MIN_SECONDS + FIRST_RUN_GAP_SECONDS)))
    [ "$t" -ge "$share" ] || t=$share
    total=$((total - w))
    if [ "$t" -lt "$FIRST_RUN_MIN_SECONDS" ]; then
      say "train $name: NOT RUN (${t}s of part (b) left for it)"
      printf '{"run": "%s", "status": "not run (%ss left)"}\n' "$name" "$t" >> "$TRAIN_TABLE"
      status=1
      continue
    fi
    valid=1 TRAIN_ENV=()
    local extra=(precision.activations="$act" kernels.attention="$att" data.max_tokens="$tok"
                 train.accum_steps="$acc"
                 profile.start_step=$((steps / 2 + 1)) profile.stop_step=$((steps / 2 + 10)))
    [ "$val" = none ] && valid=0
    if [ "$val" = bleu ] && [ $bleu_ok -eq 1 ]; then
      extra+=(train.valid_bleu=on)
      [ -n "$BLEU_PATH" ] && TRAIN_ENV=("PYTHONPATH=$BLEU_PATH${PYTHONPATH:+:$PYTHONPATH}")
    fi
    train_one "$name" "$prec" "$t" "$steps" "$valid" "${extra[@]}" || status=1
  done
  TRAIN_ENV=()
  say "(b) side by side (tgt tok/s, step ms, MFU: logged intervals after the first, outside" \
      "the profiling window, weighted by time; peak MiB: nvidia-smi):"
  python3 -c "$FIRST_TABLE_PY" "$TRAIN_TABLE" "${names[@]}" | say_lines
  TRAIN_TABLE=
  local f=$OUT/train.log
  : > "$f"
  for name in "${names[@]}"; do
    [ -f "$OUT/train-$name.log" ] || continue
    { echo "===== train $name"; cat "$OUT/train-$name.log"; } >> "$f"
    rm -f "$OUT/train-$name.log"
  done
  return $status
}

# Fused attention (SIMT and mma) against the unfused path (bench/attention_fused.c: bf16, six
# shapes, about 8 s; at most 30): the table into the summary, everything into tests.log (informative: a
# failure is reported, not fatal; nothing here decides a test).
stage_first_attention_bench() {
  local b=$BIN/attention_fused rc f=$OUT/.attention_fused
  [ -x "$b" ] || b=$BIN/bench/attention_fused
  say "--- attention fwd+bwd, unfused vs fused SIMT / mma (bench/attention_fused.c, bf16, <= 30 s)"
  if [ ! -x "$b" ]; then
    say "  not run: no attention_fused binary in $BIN"
    return 0
  fi
  timeout -k 2 30 "$b" > "$f" 2>&1 < /dev/null
  rc=$?
  grep -v '^{' "$f" | say_lines
  say "  attention_fused: rc $rc$( { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && echo " (TIMED OUT)")"
  { echo "===== bench attention_fused: rc $rc"; cat "$f"; } >> "$OUT/tests.log"
  rm -f "$f"
  return 0
}

stage_first() {
  local status=0 t
  STAGE_END=$((SECONDS + FIRST_TESTS_SECONDS))
  stage_first_tests || status=1
  stage_first_attention_bench
  # (b) training, each run with a profiling window inside it (steps S/2+1 .. S/2+10 of S).
  # sacreBLEU is probed first (a few seconds of python start-up), outside part (b)'s clock,
  # so that its runs' shares do not depend on how fast python starts.
  BLEU_OK=0
  find_sacrebleu && BLEU_OK=1
  t=$((FIRST_SECONDS - FIRST_COMPARE_SECONDS - SECONDS))
  [ "$t" -gt "$FIRST_TRAIN_SECONDS" ] && t=$FIRST_TRAIN_SECONDS
  STAGE_END=$((SECONDS + t))
  TRAIN_EXTRA=()
  stage_first_train || status=1
  # (c) nmt vs PyTorch, in what is left (informative: a failure is reported, not fatal).
  t=$((FIRST_SECONDS - 10 - SECONDS))
  say "--- (c) bench/gpu-compare.sh, bf16, ${t}s: nmt (precision.activations: the default)" \
      "vs PyTorch eager AMP and torch.compile (mode default, dynamic=True, no compiled loss" \
      "check: one compilation, in all the time the rest leaves)"
  if [ "$t" -lt "$FIRST_COMPARE_SECONDS" ]; then
    say "  not run (${t}s left)"
  else
    local cmp=$OUT/.compare rc f
    rm -rf "$cmp"; mkdir -p "$cmp"
    # torch.compile is the slowest part (it compiled for 129 s on 2026-11-26, two graphs of the
    # default mode): one compilation (COMPILE_CHECK=none: the timed graph only, in the default
    # mode, which does not autotune), given until 8 s before this part's end (the table needs
    # them); past it gpu-compare reports the compile as cut and prints nmt and eager. An eager
    # loss check that disagrees is reported and the timing goes on (CHECK_FATAL=0).
    OUT=$cmp RESULTS='' PRECISION=bf16 GPU_PACK=$PACK COMPILE_MODE=default COMPILE_CHECK=none \
      COMPILE_DEADLINE_S=$t COMPILE_END_EPOCH=$(( $(date +%s) + t - 8 )) CHECK_FATAL=0 \
      timeout -k 5 "$t" "$GPU_COMPARE" > "$cmp/output.txt" 2>&1
    rc=$?
    for f in output.txt logs.txt nmt-metrics.jsonl; do
      [ -f "$cmp/$f" ] && { echo "===== $f"; cat "$cmp/$f"; }
    done > "$OUT/compare.txt"
    [ -f "$cmp/results.jsonl" ] && cp "$cmp/results.jsonl" "$OUT/results.jsonl"
    rm -rf "$cmp"
    say "  gpu-compare: rc $rc$( { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && echo " (TIMED OUT)")"
    grep -E '^(summary:|loss check|eager loss|nmt |pytorch |torch.compile|peak for MFU|gpu-compare:)' \
      "$OUT/compare.txt" | head -20 | say_lines
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
      train_one "$p" "$p" "$t" "$TRAIN_STEPS" 1 || status=1
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
    libs|first|test|memcheck|sanitize|train|train-fp32|train-tf32|train-bf16|train-fp16|all) ;;
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
    memcheck) stage_memcheck || status=1 ;;
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
