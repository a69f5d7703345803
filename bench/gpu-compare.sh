#!/usr/bin/env bash
# bench/gpu-compare.sh — nmt training on one GPU next to PyTorch eager AMP and torch.compile, on
# the same model, the same initial weights and the same batches, measured in one run on the same
# GPU (`make bench-compare`; issue 6). How to run it with the device tool: bench/GPU.md.
#
# usage: bench/gpu-compare.sh [--biggest-batch] [section.key=value ...]
#        bench/gpu-compare.sh pack     on the dev box, after `tools/gpu-check.sh pack`: adds
#                                      build/bench/dump_batches to build/gpu-pack/bin
#                                      (GPU_PACK= names another pack folder)
# env:   CONFIG (default conf/base.ini), STEPS (default 40), WARMUP (default 10), PRECISION
#        (fp32|tf32|fp16|bf16, default fp16), PEAK_TFLOPS (one GPU's peak for MFU; default:
#        measured, below), CHECK_FP32 (default 1: also the strict fp32 loss check), THREADS
#        (PyTorch host threads, default: cores), RESULTS (rows appended here, default
#        bench/results.jsonl), OUT (also write summary.txt, results.jsonl, logs.txt and nmt's
#        metrics there: the device tool's output folder), PY (a python3 with torch; default the
#        first of python3, /usr/bin/python3 that has it), DEVICE (default cuda; `cpu` runs the
#        whole harness on the CPU as a self-test where there is no GPU: not a benchmark, rows go
#        to $OUT only, never to bench/results.jsonl unless RESULTS is set), BUILD (the build
#        folder made and used when there is no pack, default build), NO_PACK (set: ignore a
#        pack), ATTENTION (pytorch_baseline.py --attention: auto, the default, is
#        F.scaled_dot_product_attention where torch has it; manual).
#        CHECK_FATAL (default 1: an eager loss check that disagrees or fails stops the script;
#        0: it is reported, in the table's notes and the summary line, and the timing goes on,
#        as tools/gpu-check.sh first runs it).
#        torch.compile: COMPILE_MODE (default max-autotune-no-cudagraphs; always dynamic=True,
#        fullgraph=True), COMPILE_DEADLINE_S (default 240: the compiled loss check and the
#        compiled timed run together; 0 skips torch.compile), COMPILE_END_EPOCH (a Unix time
#        the compile phase must end by, whatever COMPILE_DEADLINE_S allows: a caller's own
#        limit; default none), COMPILE_CHECK (the precisions of the compiled loss check, default
#        PRECISION; "none" skips it: one compilation, of the timed graph).
#        --biggest-batch: MEM_CAP_GIB (default 24, the RTX 3090's memory; 0 = the whole card),
#        CAP_METHOD (split: PyTorch capped by set_per_process_memory_fraction, nmt by a ballast
#        process; ballast: both by the ballast), NMT_CAP_OVR (overrides that cap nmt's device
#        memory once nmt has such a key; replaces the ballast for nmt), BIGGEST_SYSTEMS (default
#        "nmt eager"; add "compile"), MAX_TOKENS_LIMIT (default 1048576), RES_PCT (default 3).
#
# Binaries: build/gpu-pack (tools/gpu-check.sh pack + `bench/gpu-compare.sh pack`, carried to
# the GPU machine; its libraries go on LD_LIBRARY_PATH as tools/gpu-check.sh does) when it has
# nmt and NO_PACK is unset, else $BUILD (default build/, made here with `make BUILD=$BUILD`:
# needs the build dependencies). Data: data/bible, else the pack's.
#
# 1. checks for a CUDA device first and stops at once without one ("no CUDA device");
# 2. dumps the batches of steps [0, STEPS) in the trainer's order and nmt's initial parameters
#    (bench/dump_batches.c), with parallel.devices = 1;
# 3. loss checks, 3 steps with every dropout at 0, train.warmup_steps = 1 and lr_scale /
#    sqrt(warmup_steps) (step 1 makes a full-size update at the schedule's peak lr) from the
#    same weights, per-step train_loss and grad_norm: fp32 (nmt vs PyTorch eager, loss 1e-6
#    relative, grad_norm 2e-5 at step 1 and 1e-4 after: same model, batches, schedule) and
#    PRECISION (nmt vs PyTorch AMP in the same precision, loss 5e-2 nats absolute, grad_norm
#    5e-2 relative: nothing broken in the mixed-precision paths); a mismatch stops the script
#    (CHECK_FATAL=0: it is reported and the timing goes on);
# 4. times nmt train (parallel.device = cuda, precision.mode = PRECISION, log_every = WARMUP:
#    target tokens/s over steps WARMUP+1..STEPS from metrics.jsonl) and PyTorch eager AMP
#    (bench/pytorch_baseline.py --device cuda --precision PRECISION), sampling nvidia-smi's
#    memory.used during each;
# 5. torch.compile within COMPILE_DEADLINE_S (and before COMPILE_END_EPOCH): the loss check of
#    step 3 on the compiled model (COMPILE_CHECK), then the timed run; the summary line says
#    which mode ran, dynamic or not, and whether the compiled loss check ran. A compile that fails or runs out of time, a compiled
#    loss check that disagrees, a graph compiled during the timed steps, or a SIGTERM from the
#    caller's own time limit (tools/gpu-check.sh runs this script under `timeout`) is reported
#    in the table's notes, the rows and the summary, and is not fatal;
# 6. prints a table (system, precision, tgt tok/s, step ms, MFU, peak MiB, ratio vs eager AMP),
#    appends one JSON row per system to RESULTS (and $OUT/results.jsonl) and a summary line.
# --biggest-batch instead binary-searches, per system, the largest data.max_tokens (one
# micro-batch per step: train.accum_steps = 1) that trains 3 steps without running out of
# memory under a MEM_CAP_GIB memory cap: nmt's exit code 4 with "out of memory", PyTorch's
# torch.cuda.OutOfMemoryError (pytorch_baseline.py exits 4).
# Timings never decide anything: the script fails only if an nmt or eager step fails or an eager
# loss check disagrees (unless CHECK_FATAL=0).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PACK=${GPU_PACK:-build/gpu-pack}

CONFIG=${CONFIG:-conf/base.ini}
STEPS=${STEPS:-40}
WARMUP=${WARMUP:-10}
PRECISION=${PRECISION:-fp16}
DEVICE=${DEVICE:-cuda}
CHECK_FP32=${CHECK_FP32:-1}
THREADS=${THREADS:-$(nproc)}
MEM_CAP_GIB=${MEM_CAP_GIB:-24}
CAP_METHOD=${CAP_METHOD:-split}
BIGGEST_SYSTEMS=${BIGGEST_SYSTEMS:-nmt eager}
MAX_TOKENS_LIMIT=${MAX_TOKENS_LIMIT:-1048576}
RES_PCT=${RES_PCT:-3}
BUILD=${BUILD:-build}
COMPILE_MODE=${COMPILE_MODE:-max-autotune-no-cudagraphs}
COMPILE_DEADLINE_S=${COMPILE_DEADLINE_S:-240}
COMPILE_CHECK=${COMPILE_CHECK:-$PRECISION}
COMPILE_END_EPOCH=${COMPILE_END_EPOCH:-}
CHECK_FATAL=${CHECK_FATAL:-1}
ATTENTION=${ATTENTION:-auto}
if [[ -z "${RESULTS+x}" ]]; then
  if [[ $DEVICE == cuda ]]; then RESULTS=bench/results.jsonl; else RESULTS=; fi
fi
CHECK_STEPS=3

die() { # code message...: the script's one way to stop on an error
  local code=$1
  shift
  echo "gpu-compare: $*" >&2
  exit "$code"
}

usage() {
  echo "usage: bench/gpu-compare.sh [--biggest-batch] [section.key=value ...]" >&2
  echo "       bench/gpu-compare.sh pack" >&2
  exit 2
}

# ---------------------------------------------------------------------------------------------
# pack: the batch dumper travels with the binaries (the GPU machine may lack iniparser's headers
# and cannot fetch them), linked from the same build/libnmt.a as the pack's nmt.
pack() {
  [[ -x $PACK/bin/nmt ]] || die 1 "pack: no $PACK/bin/nmt: run tools/gpu-check.sh pack first"
  make -j"$(nproc)" --no-print-directory build/nmt build/libnmt.a
  if ! cmp -s build/nmt "$PACK/bin/nmt"; then
    die 1 "pack: $PACK/bin/nmt differs from build/nmt: rerun tools/gpu-check.sh pack"
  fi
  local ldlibs
  # shellcheck disable=SC2016 # $(LDLIBS) is make syntax, expanded by make
  ldlibs=$(echo 'print-ldlibs: ; @echo $(LDLIBS)' |
           make -s --no-print-directory -f Makefile -f - print-ldlibs)
  mkdir -p build/bench
  # shellcheck disable=SC2086 # ldlibs is a list of flags
  gcc -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Werror -Iinclude -pthread \
    bench/dump_batches.c build/libnmt.a -o build/bench/dump_batches $ldlibs
  cp build/bench/dump_batches "$PACK/bin/"
  ldd build/bench/dump_batches | awk '/=> \//{print $3}' | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++.so*|\
      libgcc_s.so*|libcublas*|libcudart*) ;;
      *) [[ -f $PACK/lib/$(basename "$lib") ]] || cp -L "$lib" "$PACK/lib/" ;;
    esac
  done
  du -sh "$PACK"
  echo "packed $PACK/bin/dump_batches: carry $PACK and run bench/gpu-compare.sh there (bench/GPU.md)"
}

BIGGEST=0
OVR=()
case "${1:-}" in
  pack) (( $# == 1 )) || usage; pack; exit 0 ;;
esac
for a in "$@"; do
  case $a in
    --biggest-batch) BIGGEST=1 ;;
    *=*) OVR+=("$a") ;;
    *) usage ;;
  esac
done
case $PRECISION in
  fp32|tf32|fp16|bf16) ;;
  *) die 2 "PRECISION=$PRECISION: expected fp32, tf32, fp16 or bf16" ;;
esac
case $DEVICE in cuda|cpu) ;; *) die 2 "DEVICE=$DEVICE: expected cuda or cpu" ;; esac
case $CAP_METHOD in split|ballast) ;; *) die 2 "CAP_METHOD=$CAP_METHOD: expected split or ballast" ;; esac
case $ATTENTION in auto|sdpa|manual) ;; *) die 2 "ATTENTION=$ATTENTION: expected auto, sdpa or manual" ;; esac
[[ $COMPILE_DEADLINE_S =~ ^[0-9]+$ ]] || die 2 "COMPILE_DEADLINE_S=$COMPILE_DEADLINE_S: expected seconds"
[[ -z $COMPILE_END_EPOCH || $COMPILE_END_EPOCH =~ ^[0-9]+$ ]] ||
  die 2 "COMPILE_END_EPOCH=$COMPILE_END_EPOCH: expected a Unix time in seconds"
case $CHECK_FATAL in 0|1) ;; *) die 2 "CHECK_FATAL=$CHECK_FATAL: expected 0 or 1" ;; esac
[[ $COMPILE_CHECK == none ]] && COMPILE_CHECK=
for p in $COMPILE_CHECK; do
  case $p in fp32|tf32|fp16|bf16) ;; *) die 2 "COMPILE_CHECK=$COMPILE_CHECK: expected precisions or none" ;; esac
done
if (( BIGGEST == 0 && (WARMUP < 1 || STEPS <= WARMUP) )); then
  die 2 "need 1 <= WARMUP < STEPS (got WARMUP=$WARMUP STEPS=$STEPS)"
fi
if [[ $DEVICE == cpu && $PRECISION == fp16 ]]; then
  die 2 "DEVICE=cpu: PyTorch's fp16 recipe (autocast + GradScaler) is CUDA-only; use PRECISION=bf16"
fi

# A python3 with torch: the GPU image's python3 has it, the dev box's is /usr/bin/python3.
if [[ -z "${PY:-}" ]]; then
  for c in python3 /usr/bin/python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import torch' 2>/dev/null; then PY=$c; break; fi
  done
fi
[[ -n "${PY:-}" ]] || die 1 "no python3 with torch found (set PY=)"

# Fail fast, before building or dumping anything.
if [[ $DEVICE == cuda ]]; then
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    smi="not found"
    command -v nvidia-smi >/dev/null 2>&1 && smi=$(nvidia-smi -L 2>&1 | head -1)
    tv=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
    die 1 "no CUDA device (torch $tv in $PY: torch.cuda.is_available() is false;" \
      "nvidia-smi: ${smi:-no output}). Run it on the GPU machine (bench/GPU.md), or DEVICE=cpu" \
      "for a self-test of the harness."
  fi
fi

main() {
  local tmp
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/nmt-gpu-compare.XXXXXX")
  TMP=$tmp
  trap 'cleanup' EXIT
  echo "gpu-compare $(date -u +%Y-%m-%dT%H:%M:%SZ): $DEVICE, $PRECISION, $CONFIG ${OVR[*]:-}"

  # Binaries: the carried pack, or $BUILD (building it where the dependencies are).
  export PATH=$PATH:/usr/local/cuda/bin
  if [[ -x $PACK/bin/nmt && -z "${NO_PACK:-}" ]]; then
    BIN=$PACK/bin
    # The pack's libraries over 1 MiB travel gzip'd: unpacked beside their archives once, as
    # tools/gpu-check.sh's setup does (it has done so already when it runs this script).
    local z
    for z in "$PACK"/lib/*.gz; do
      [[ -e $z && ! -s ${z%.gz} ]] || continue
      { gzip -dc "$z" > "${z%.gz}.part" && mv "${z%.gz}.part" "${z%.gz}"; } ||
        die 1 "cannot unpack $z (gzip)"
    done
    local lib=$PACK/lib
    [[ $lib == /* ]] || lib=$ROOT/$lib
    export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    [[ -x $BIN/dump_batches ]] || die 1 "$BIN/dump_batches missing: run bench/gpu-compare.sh" \
      "pack on the dev box (after tools/gpu-check.sh pack) and carry $PACK again"
    echo "binaries: carried pack ($PACK, $(tr '\n' ' ' < "$PACK/COMMIT" 2>/dev/null))"
  else
    make -j"$(nproc)" --no-print-directory BUILD="$BUILD" "$BUILD/nmt" "$BUILD/libnmt.a" \
      > "$tmp/build.log" 2>&1 || { cat "$tmp/build.log" >&2; exit 1; }
    local ldlibs
    # shellcheck disable=SC2016 # $(LDLIBS) is make syntax, expanded by make
    ldlibs=$(echo 'print-ldlibs: ; @echo $(LDLIBS)' |
             make -s --no-print-directory BUILD="$BUILD" -f Makefile -f - print-ldlibs)
    mkdir -p "$BUILD/bench"
    # shellcheck disable=SC2086 # ldlibs is a list of flags
    gcc -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Werror -Iinclude -pthread \
      bench/dump_batches.c "$BUILD/libnmt.a" -o "$BUILD/bench/dump_batches" $ldlibs
    BIN=$BUILD
    DUMP_BIN=$BUILD/bench/dump_batches
    echo "binaries: $BUILD/ (made here)"
  fi
  DUMP_BIN=${DUMP_BIN:-$BIN/dump_batches}
  # cuBLASLt and NCCL, found as every script of nmt finds them (tools/cuda-libs.sh: loader
  # cache, toolkit, the CUDA 13 wheels' nvidia/cu13/lib, a bounded find); only on a GPU.
  if [[ $DEVICE == cuda ]]; then
    # shellcheck source=tools/cuda-libs.sh
    . tools/cuda-libs.sh
    local libs
    libs=$(mktemp)
    nmt_cuda_lib_path > "$libs" # not in $( ): its LD_LIBRARY_PATH must reach this shell
    sed 's/^/  /' "$libs"
    rm -f "$libs"
  fi
  if ldd "$BIN/nmt" "$DUMP_BIN" | grep "not found"; then
    echo "gpu-compare: missing shared libraries (above)" >&2
    exit 1
  fi

  # Data: the repo's shards, else the pack's (the GPU machine gets data/ only through the pack).
  BASE_OVR=(parallel.device="$DEVICE")
  if [[ ! -f data/bible/train.shard ]]; then
    if [[ -f $PACK/data/bible/train.shard ]]; then
      local d=$PACK/data/bible
      BASE_OVR+=("data.train=$d/train.shard" "data.valid=$d/valid.shard"
                 "data.test=$d/test.shard" "data.spm_model=$d/spm.model")
    else
      tools/prepare-bible.sh
    fi
  fi
  # One GPU: nmt refuses devices > 1 with device = cuda until the NCCL communicator exists, and
  # the dump must hold the batches of the same K = devices x accum_steps.
  [[ $DEVICE == cuda ]] && BASE_OVR+=(parallel.devices=1)
  NODROP=(model.dropout=0 model.attn_dropout=0 model.relu_dropout=0)
  QUIET=(train.valid_every=0 train.save_every=0)

  # Peak for MFU: PEAK_TFLOPS, else measured here in the run's precision.
  if [[ -z "${PEAK_TFLOPS:-}" ]]; then
    read -r PEAK_TFLOPS PEAK_SRC < <(measure_peak) || true
    [[ -n "${PEAK_TFLOPS:-}" ]] || die 1 "measuring the peak failed; set PEAK_TFLOPS"
  else
    PEAK_SRC="PEAK_TFLOPS"
  fi
  echo "peak for MFU: $PEAK_TFLOPS TFLOP/s ($PEAK_SRC)"
  SMI_IDLE=$(smi_used)

  if (( BIGGEST )); then
    biggest
  else
    compare
  fi
}

cleanup() {
  [[ -n "${TORCH_PID:-}" ]] && kill "$TORCH_PID" 2>/dev/null
  [[ -n "${BALLAST_PID:-}" ]] && kill "$BALLAST_PID" 2>/dev/null
  [[ -n "${SMI_PID:-}" ]] && kill "$SMI_PID" 2>/dev/null
  if [[ -n "${OUT:-}" && -d "${TMP:-}" ]]; then
    # Every log in one file: the device tool brings back at most 8 files.
    for f in "$TMP"/*.log "$TMP"/*.out; do
      [[ -f $f ]] && { echo "===== $(basename "$f")"; cat "$f"; }
    done > "$OUT/logs.txt" 2>/dev/null
  fi
  [[ -d "${TMP:-}" ]] && rm -rf "$TMP"
  return 0
}

# One GPU's dense peak in TFLOP/s and where it comes from: the mean of 10 timed 8192^3 products
# after 3 warm-ups, bf16 for fp16/bf16 runs (the two have the same tensor-core rate on Ampere and
# Hopper), fp32 with TF32 on for tf32, IEEE fp32 for fp32. DEVICE=cpu: a 1024^3 fp32 product.
measure_peak() {
  "$PY" - "$DEVICE" "$PRECISION" <<'EOF'
import sys, time, torch
dev, prec = sys.argv[1], sys.argv[2]
if dev == "cuda":
    n = 8192
    dt = torch.bfloat16 if prec in ("fp16", "bf16") else torch.float32
    torch.set_float32_matmul_precision("high" if prec == "tf32" else "highest")
    a = torch.randn(n, n, device="cuda", dtype=dt)
    b = torch.randn(n, n, device="cuda", dtype=dt)
    for _ in range(3):
        a @ b
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        a @ b
    e1.record()
    torch.cuda.synchronize()
    t = e0.elapsed_time(e1) / 1e3 / 10
    name = {torch.bfloat16: "bf16", torch.float32: "tf32" if prec == "tf32" else "fp32"}[dt]
else:
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    t = (time.perf_counter() - t0) / 10
    name = "fp32 CPU"
print("%.4g measured: torch %s %d^3 matmul, mean of 10 after 3 warm-ups"
      % (2 * n ** 3 / t / 1e12, name, n))
EOF
}

smi_used() { # MiB in use on GPU 0 now (empty on the CPU or without nvidia-smi)
  [[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | head -1
  return 0
}
smi_start() { # name: sample memory.used every 100 ms into $TMP/name.smi
  SMI_PID=
  if [[ $DEVICE == cuda ]] && command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 100 \
      > "$TMP/$1.smi" 2>/dev/null &
    SMI_PID=$!
  fi
}
smi_stop() {
  if [[ -n "${SMI_PID:-}" ]]; then kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null || true; fi
  SMI_PID=
}

# nmt train: name precision steps log_every [overrides...]; returns nmt's exit code.
run_nmt() {
  local name=$1 prec=$2 steps=$3 every=$4 rc=0
  shift 4
  smi_start "$name"
  "$BIN/nmt" train "$CONFIG" "${BASE_OVR[@]}" "${OVR[@]}" "${QUIET[@]}" "$@" \
    precision.mode="$prec" profile.peak_tflops="$PEAK_TFLOPS" train.max_steps="$steps" \
    train.log_every="$every" run.out_dir="$TMP/$name" > "$TMP/$name.log" 2>&1 || rc=$?
  smi_stop
  return $rc
}

# PyTorch: name mode precision batches [flags...]; the overrides are XOVR (set by the caller)
# after the common ones. Returns the script's exit code (4 = out of memory, 3 = torch.compile
# failed). With TORCH_DEADLINE_S > 0, it runs under `timeout` that long (124 = out of time).
# It runs in the background and is waited for, so that a SIGTERM to this script (on_term) is
# handled at once rather than when the child exits.
XOVR=()
TORCH_DEADLINE_S=0
TORCH_PID=
run_torch() {
  local name=$1 mode=$2 prec=$3 batches=$4 rc=0 lim=()
  shift 4
  (( TORCH_DEADLINE_S > 0 )) && lim=(timeout -k 5 "$TORCH_DEADLINE_S")
  smi_start "$name"
  OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1 "${lim[@]}" "$PY" bench/pytorch_baseline.py \
    --nmt "$BIN/nmt" --batches "$batches" --params "$TMP/params.bin" --config "$CONFIG" \
    "${BASE_OVR[@]}" "${OVR[@]}" "${XOVR[@]}" \
    --device "$DEVICE" --precision "$prec" --mode "$mode" --threads "$THREADS" \
    --attention "$ATTENTION" --compile-mode "$COMPILE_MODE" \
    --result "$TMP/$name.json" "$@" > "$TMP/$name.out" 2>&1 &
  TORCH_PID=$!
  wait "$TORCH_PID" || rc=$?
  # A trapped signal ends `wait` early: on_term has signalled the child; reap it.
  while kill -0 "$TORCH_PID" 2>/dev/null; do rc=0; wait "$TORCH_PID" || rc=$?; done
  TORCH_PID=
  smi_stop
  return $rc
}

# SIGTERM (the caller's `timeout`, e.g. tools/gpu-check.sh's stage budget): during the
# torch.compile phase, stop it and still print the table of nmt and eager; before it, stop.
IN_COMPILE=0
TERMINATED=0
on_term() {
  TERMINATED=1
  if (( IN_COMPILE )); then
    echo "gpu-compare: SIGTERM during torch.compile: stopping it; reporting nmt and eager" >&2
    [[ -n "${TORCH_PID:-}" ]] && kill -TERM "$TORCH_PID" 2>/dev/null
    return 0
  fi
  echo "gpu-compare: SIGTERM: stopped" >&2
  [[ -n "${TORCH_PID:-}" ]] && kill -TERM "$TORCH_PID" 2>/dev/null
  exit 124
}

# The loss check of precision p: nmt (once per precision) against PyTorch MODE (eager, compile)
# for CHECK_STEPS steps with CHECK_OVR. Returns pytorch_baseline.py's exit code.
CHECK_OVR=()
loss_check() { # mode precision
  local mode=$1 p=$2 rc=0 name=check-$2
  [[ $mode == compile ]] && name=check-compile-$2
  if [[ ! -f $TMP/check-$p/metrics.jsonl ]]; then
    run_nmt "check-$p" "$p" "$CHECK_STEPS" 1 "${CHECK_OVR[@]}" ||
      { cat "$TMP/check-$p.log" >&2; die 1 "nmt failed in the $p loss check"; }
  fi
  XOVR=("${CHECK_OVR[@]}")
  local tol=()
  [[ $p == fp32 ]] && tol=(--rtol 1e-6)
  run_torch "$name" "$mode" "$p" "$TMP/batches.bin" --steps "$CHECK_STEPS" --warmup 1 \
    "${tol[@]}" --check-metrics "$TMP/check-$p/metrics.jsonl" || rc=$?
  XOVR=()
  sed -n '/^ *step  *nmt/,$p' "$TMP/$name.out" | sed 's/^/  /'
  return $rc
}

# ---------------------------------------------------------------------------------------------
compare() {
  trap on_term TERM
  echo "== dump $STEPS steps"
  "$DUMP_BIN" "$CONFIG" "${BASE_OVR[@]}" "${OVR[@]}" --steps "$STEPS" --out "$TMP/batches.bin" \
    --params "$TMP/params.bin" 2> "$TMP/dump.log" || { cat "$TMP/dump.log" >&2; exit 1; }
  sed 's/^/  /' "$TMP/dump.log"

  # warmup_steps = 1 and lr_scale / sqrt(warmup_steps): step 1 makes a full-size update at the
  # schedule's peak lr (eq. 3 peaks at step = warmup_steps with lr_scale * d_model^-0.5 *
  # warmup_steps^-0.5), so steps 2 and 3 show a wrong gradient; at step 1 of a 4000-step
  # warmup the update is too small to move the loss. warmup_steps = 1 alone would make it
  # sqrt(4000) = 63x the peak: on bible-small (16x) the loss rose 9.78 -> 11.15 and the
  # rounding noise grew to 2e-5 (fp32 grad_norm) and 3e-2 (bf16 grad_norm), near the bounds.
  local lr_scale warm
  lr_scale=$(dump_key train lr_scale)
  warm=$(dump_key train warmup_steps)
  CHECK_LR_SCALE=$(awk -v s="$lr_scale" -v w="$warm" 'BEGIN{printf "%.9g", s / sqrt(w < 1 ? 1 : w)}')
  CHECK_OVR=("${NODROP[@]}" train.warmup_steps=1 train.lr_scale="$CHECK_LR_SCALE")
  local precs=("$PRECISION") p rc
  [[ $CHECK_FP32 == 1 && $PRECISION != fp32 ]] && precs=(fp32 "$PRECISION")
  CHECK_PROBLEMS=''
  for p in "${precs[@]}"; do
    echo "== loss check $p: $CHECK_STEPS steps, dropout 0, warmup_steps 1, lr_scale" \
         "$CHECK_LR_SCALE (step 1 at the peak lr), same initial weights"
    rc=0
    loss_check eager "$p" || rc=$?
    if (( rc != 0 )); then
      cat "$TMP/check-$p.out" >&2
      (( CHECK_FATAL )) && die 1 "loss check $p failed (rc $rc)"
      # Reported (the notes and the summary line), and the timing goes on: a first run's
      # figures are worth having next to the mismatch that explains them.
      local what="FAILED (rc $rc)"
      grep -q '"loss_check_ok": false' "$TMP/check-$p.json" 2>/dev/null && what=MISMATCH
      CHECK_PROBLEMS+="${CHECK_PROBLEMS:+; }loss check $p $what"
      echo "gpu-compare: loss check $p failed (rc $rc): reported, not fatal (CHECK_FATAL=0);" \
           "the timing goes on" >&2
    fi
  done

  ACCUM=$(dump_key train accum_steps)
  DEVICES=$(dump_key parallel devices)
  ACTIVATIONS=$(dump_key precision activations)
  read -r LOAD0 _ < /proc/loadavg
  echo "== nmt train: $STEPS steps, $PRECISION"
  run_nmt nmt "$PRECISION" "$STEPS" "$WARMUP" || { cat "$TMP/nmt.log" >&2; exit 1; }
  grep -E "step +[0-9]+/" "$TMP/nmt.log" | tail -3 | sed 's/^/  /' || true
  [[ -n "${OUT:-}" ]] && cp "$TMP/nmt/metrics.jsonl" "$OUT/nmt-metrics.jsonl"
  echo "== pytorch eager: $STEPS steps, $PRECISION"
  run_torch torch-eager eager "$PRECISION" "$TMP/batches.bin" --warmup "$WARMUP" ||
    { cat "$TMP/torch-eager.out" >&2; exit 1; }
  grep -v "^step " "$TMP/torch-eager.out" | sed 's/^/  /'
  compile_phase
  read -r LOAD1 _ < /proc/loadavg
  report_compare
}

# What happened to a torch.compile run (name, its exit code): "ok", "skipped: ...",
# "mismatch", "timeout", "terminated by SIGTERM ...", "out of memory" or "failed: ...".
compile_outcome() {
  local name=$1 rc=$2 f=$TMP/$1.json
  if (( TERMINATED )); then echo "terminated by SIGTERM (the caller's time limit)"
  elif (( rc == 124 || rc == 137 )); then echo "timeout"
  elif (( rc == 0 )) && [[ -f $f ]] && grep -q '"skipped"' "$f"; then
    echo "skipped: $("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["skipped"])' "$f")"
  elif (( rc == 0 )); then echo "ok"
  elif (( rc == 1 )) && [[ -f $f ]] && grep -q '"loss_check_ok": false' "$f"; then echo "mismatch"
  elif (( rc == 4 )); then echo "out of memory"
  elif (( rc == 3 )) && [[ -f $f ]]; then
    echo "failed: $("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["failed"])' "$f")"
  else echo "failed: rc $rc: $(grep -v '^ *$' "$TMP/$name.out" | tail -1 | cut -c1-200)"
  fi
}

# torch.compile: the compiled loss check(s), then the timed run, all within COMPILE_DEADLINE_S.
# Sets COMPILE_STATUS (ok, skipped: ..., not run: ..., timeout after N s, terminated by
# SIGTERM ..., failed: ..., out of memory); a compiled loss check that disagrees does not stop
# the timed run (the report flags it from its result file). Never fails the script.
compile_phase() {
  COMPILE_STATUS=''
  if (( COMPILE_DEADLINE_S == 0 )); then
    COMPILE_STATUS="not run: COMPILE_DEADLINE_S=0"
    echo "== pytorch compile: not run (COMPILE_DEADLINE_S=0)"
    return 0
  fi
  local t0=$SECONDS end=$((SECONDS + COMPILE_DEADLINE_S)) p rc o
  if [[ -n $COMPILE_END_EPOCH ]]; then
    local by=$((SECONDS + COMPILE_END_EPOCH - $(date +%s)))
    (( by < end )) && end=$by
  fi
  echo "== pytorch compile plan: mode $COMPILE_MODE, dynamic=True, fullgraph=True; compiled" \
       "loss check: ${COMPILE_CHECK:-none}; $((end - SECONDS)) s for it all"
  IN_COMPILE=1
  for p in $COMPILE_CHECK; do
    TORCH_DEADLINE_S=$((end - SECONDS))
    (( TORCH_DEADLINE_S < 5 )) && { COMPILE_STATUS=timeout; break; }
    echo "== loss check $p on torch.compile (mode $COMPILE_MODE): $CHECK_STEPS steps," \
         "${TORCH_DEADLINE_S}s left of COMPILE_DEADLINE_S=$COMPILE_DEADLINE_S"
    rc=0
    loss_check compile "$p" || rc=$?
    o=$(compile_outcome "check-compile-$p" $rc)
    echo "  compiled loss check $p: $o"
    case $o in
      ok|mismatch) ;;
      *) COMPILE_STATUS=$o; break ;;
    esac
  done
  if [[ -z $COMPILE_STATUS ]]; then
    TORCH_DEADLINE_S=$((end - SECONDS))
    if (( TORCH_DEADLINE_S < 5 )); then
      COMPILE_STATUS=timeout
    else
      echo "== pytorch compile (mode $COMPILE_MODE): $STEPS steps, $PRECISION," \
           "${TORCH_DEADLINE_S}s left of COMPILE_DEADLINE_S=$COMPILE_DEADLINE_S"
      rc=0
      run_torch torch-compile compile "$PRECISION" "$TMP/batches.bin" --warmup "$WARMUP" || rc=$?
      # Its own lines only: max-autotune prints a table per GEMM it tunes (in logs.txt).
      grep -E "^(pytorch |compile:)" "$TMP/torch-compile.out" | sed 's/^/  /' || true
      COMPILE_STATUS=$(compile_outcome torch-compile $rc)
    fi
  fi
  TORCH_DEADLINE_S=0
  IN_COMPILE=0
  if [[ $COMPILE_STATUS == timeout ]]; then
    COMPILE_STATUS="timeout after $((SECONDS - t0)) s"
    echo "  torch.compile: $COMPILE_STATUS"
  else
    echo "  torch.compile: $COMPILE_STATUS ($((SECONDS - t0)) s)"
  fi
  if [[ $COMPILE_STATUS != ok && $COMPILE_STATUS != skipped* ]]; then
    echo "  (not fatal: the table has nmt and eager; the compiled run's output is in logs.txt)"
  fi
}

dump_key() { # section key: the effective config's value
  "$BIN/nmt" config --dump "$CONFIG" "${BASE_OVR[@]}" "${OVR[@]}" |
    awk -F' *= *' -v sec="[$1]" -v key="$2" '/^\[/{s=$0} s==sec && $1==key{print $2}'
}

git_commit() {
  local c
  # The carried pack's binaries were built at the commit it names (plus "(with uncommitted
  # changes)"); the checkout on a GPU machine may report another HEAD.
  if [[ $BIN == "$PACK/bin" && -f $PACK/COMMIT ]]; then
    c=$(head -c 7 "$PACK/COMMIT")
    grep -q uncommitted "$PACK/COMMIT" && c="$c-dirty"
  elif c=$(git rev-parse --short HEAD 2>/dev/null); then
    # Dirty = code or config differs from HEAD; the bench's own outputs and docs do not count.
    if [[ -n "$(git status --porcelain -- src include cuda bench conf Makefile \
                 ':!bench/results.jsonl' ':!bench/*.md' 2>/dev/null)" ]]; then
      c="$c-dirty"
    fi
  else
    c=$(head -c 7 "$PACK/COMMIT" 2>/dev/null || echo unknown)
  fi
  echo "$c"
}

report_compare() {
  "$PY" - "$TMP" "$CONFIG" "$STEPS" "$WARMUP" "$PRECISION" "$(git_commit)" "$(nproc)" \
    "${OVR[*]:-}" "$PEAK_TFLOPS" "$PEAK_SRC" "$LOAD0" "$LOAD1" "${RESULTS:-}" "${OUT:-}" \
    "$DEVICE" "${SMI_IDLE:-}" "$ACCUM" "$DEVICES" "$COMPILE_MODE" "$COMPILE_DEADLINE_S" \
    "$COMPILE_STATUS" "${COMPILE_CHECK:-none}" "${CHECK_PROBLEMS:-}" "${ACTIVATIONS:-}" <<'EOF'
import datetime, json, os, sys

(tmp, conf, steps, warmup, prec, commit, cores, ovr, peak, peak_src, load0, load1, results,
 out, device, smi_idle, accum, devices, compile_mode, compile_deadline,
 compile_status, compile_check, check_problems, activations) = sys.argv[1:]
# How the compiled opponent ran, for the notes, every row and the summary line.
compile_plan = "mode %s, dynamic=True, fullgraph=True, compiled loss check %s" % (
    compile_mode, "not run" if compile_check == "none" else compile_check)
steps, warmup, peak = int(steps), int(warmup), float(peak) * 1e12
date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
config = os.path.splitext(os.path.basename(conf))[0] + ("" if not ovr else " " + ovr)
load = lambda name: json.load(open(os.path.join(tmp, name)))  # noqa: E731
eager = load("torch-eager.json")


def load_if(name):
    try:
        return load(name)
    except (OSError, ValueError):
        return {}


# Loss checks that ran to a verdict: eager's by precision, the compiled model's by precision.
checks = {p: c for p in ("fp32", prec) for c in [load_if("check-%s.json" % p)]
          if "loss_check_ok" in c}
compiled_checks = {p: c for p in ("fp32", "tf32", "fp16", "bf16")
                   for c in [load_if("check-compile-%s.json" % p)] if "loss_check_ok" in c}
tok_per_step = eager["tgt_tokens"] / eager["steps"]
flops_per_tok = eager["model_flops"] / eager["tgt_tokens"]  # same batches for every system
gpu = eager.get("device_name", device)


def smi_peak(name):
    try:
        vals = [float(l) for l in open(os.path.join(tmp, name + ".smi")) if l.strip()]
    except (OSError, ValueError):
        return None
    return max(vals) if vals else None


def nmt_run():
    recs = [json.loads(l) for l in open(os.path.join(tmp, "nmt", "metrics.jsonl"))]
    prev, dt, tok, n, mfu_t, mem = 0, 0.0, 0.0, 0, 0.0, None
    for r in recs:
        k = r["step"] - prev
        if r["step"] > warmup:
            s = r["step_ms"] * k / 1e3
            dt += s
            tok += r["tgt_tokens_per_s"] * s
            n += k
            if r.get("mfu") is not None:
                mfu_t += r["mfu"] * s
        if r.get("peak_mem_mb") is not None:
            mem = max(mem or 0.0, r["peak_mem_mb"])
        prev = r["step"]
    if abs(tok - eager["tgt_tokens"]) > 0.005 * eager["tgt_tokens"]:
        sys.exit("nmt measured %.0f target tokens, the dumped batches %.0f: not the same batches"
                 % (tok, eager["tgt_tokens"]))
    return dict(system="nmt", variant="%s x %s, precision.mode=%s%s"
                % (device, devices, prec,
                   ", activations %s" % activations if activations and prec in ("fp16", "bf16")
                   else ""),
                tgt_tokens_per_s=tok / dt, step_ms=1e3 * dt / n, steps=n, peak_mem_mb=mem,
                peak_mem_smi_mb=smi_peak("nmt"), nmt_reported_mfu=mfu_t / dt if mfu_t else None)


amp = {"fp32": "fp32", "tf32": "TF32 matmuls", "fp16": "AMP fp16 + GradScaler",
       "bf16": "AMP bf16"}[prec]
rows, notes = [nmt_run()], []
# The torch.compile phase's verdict, for the notes, every row and the summary: ok, or what went
# wrong (timeout, failed, terminated, a compiled loss check that disagrees, a graph compiled
# during the timed steps).
problems = []
# skipped (a torch without torch.compile) and not run (COMPILE_DEADLINE_S=0) are not problems.
skipped = compile_status.startswith(("skipped", "not run"))
if compile_status != "ok" and not skipped:
    problems.append(compile_status)
for p, c in sorted(compiled_checks.items()):
    if not c["loss_check_ok"]:
        problems.append("compiled loss check %s MISMATCH" % p)
for mode in ("eager", "compile"):
    r = load_if("torch-%s.json" % mode)
    if "skipped" in r:
        notes.append("pytorch %s: %s" % (mode, r["skipped"]))
        continue
    if "tgt_tokens_per_s" not in r:
        continue
    v = "%s, %s%s%s" % ("eager" if mode == "eager" else "torch.compile (%s)" % compile_mode, amp,
                        ", SDPA" if r.get("attention") == "sdpa" else "",
                        ", fused Adam" if r.get("fused_adam") else "")
    row = dict(system="pytorch " + r["torch"], variant=v, tgt_tokens_per_s=r["tgt_tokens_per_s"],
               step_ms=r["step_ms"], steps=r["steps"], peak_mem_mb=r.get("peak_mem_mb"),
               peak_mem_smi_mb=smi_peak("torch-" + mode), mode=mode,
               attention=r.get("attention"))
    if mode == "compile":
        row["compile_s"] = round(r["compile_s"], 1)
        row["recompiles_in_timed_steps"] = r.get("recompiles_in_timed_steps")
        row["compile_counters_timed_delta"] = r.get("compile_counters_timed_delta")
        notes.append("torch.compile (mode %s, dynamic=True, fullgraph=True): %.0f s of "
                     "compilation (estimate) in the %d warmup steps; dynamo stats %s"
                     % (compile_mode, r["compile_s"], warmup,
                        r.get("compile_stats", {}).get("stats", {})))
        if r.get("recompiles_in_timed_steps"):
            problems.append("RECOMPILED %d graph(s) in the timed steps"
                            % r["recompiles_in_timed_steps"])
            notes.append("torch.compile: WARNING: %d graph(s) compiled during the timed steps "
                         "(dynamo counters grew by %s): its figure includes compilation"
                         % (r["recompiles_in_timed_steps"], r.get("compile_counters_timed_delta")))
    rows.append(row)
if skipped and not any(n.startswith("pytorch compile:") for n in notes):
    notes.append("pytorch compile: %s" % compile_status)
if not any(r.get("mode") == "compile" for r in rows) and not skipped:
    notes.append("torch.compile (mode %s, COMPILE_DEADLINE_S=%s): %s: no compiled row"
                 % (compile_mode, compile_deadline, compile_status))
if problems:
    notes.append("torch.compile: NOT OK: %s (not fatal; its output is in logs.txt)"
                 % "; ".join(problems))
compile_verdict = "; ".join(problems) if problems else compile_status
# The eager loss checks that did not pass (with CHECK_FATAL=0 the timing went on after them).
eager_problems = [x for x in check_problems.split("; ") if x]
for p, c in checks.items():
    if not c["loss_check_ok"] and not any(x.startswith("loss check %s " % p) for x in eager_problems):
        eager_problems.append("loss check %s MISMATCH" % p)
if eager_problems:
    notes.append("eager loss checks NOT OK: %s (CHECK_FATAL=0: reported, the timing went on; "
                 "the figures compare models that may differ)" % "; ".join(eager_problems))
# Without a compiled loss check, the compiled timed run's own losses next to eager's on the same
# batches from the same weights: each draws its own dropout masks, so only a gross difference
# (a broken compiled graph) shows; informative, never a verdict.
ce = load_if("torch-compile.json")
if ce.get("losses") and eager.get("losses"):
    k = min(len(ce["losses"]), len(eager["losses"]))
    d = max(abs(a - b) for a, b in zip(ce["losses"][:k], eager["losses"][:k]))
    notes.append("torch.compile's timed-run losses vs eager's, steps 1..%d (same batches and "
                 "weights, their own dropout masks: informative): max |diff| %.3g nats" % (k, d))

base = eager["tgt_tokens_per_s"]
hdr = ("system", "variant", "precision", "tgt tok/s", "step ms", "MFU", "peak MiB", "smi MiB",
       "vs eager")
fmt = "%-20s %-62s %-9s %10s %9s %7s %9s %8s %9s"
print()
print(fmt % hdr)
f_mb = lambda v: "-" if v is None else "%.0f" % v  # noqa: E731
lines = []
for r in rows:
    ratio = r["tgt_tokens_per_s"] / base
    gflops = r["tgt_tokens_per_s"] * flops_per_tok / 1e9
    mfu = gflops * 1e9 / peak if peak > 0 else float("nan")
    print(fmt % (r["system"][:20], r["variant"][:62], prec, "%.0f" % r["tgt_tokens_per_s"],
                 "%.1f" % r["step_ms"], "%.1f%%" % (100 * mfu), f_mb(r.get("peak_mem_mb")),
                 f_mb(r.get("peak_mem_smi_mb")), "%.2fx" % ratio))
    c32, cp = checks.get("fp32", {}), checks.get(prec, {})
    row = dict(date=date, commit=commit, bench="gpu-compare", system=r["system"],
               variant=r["variant"], device=gpu, cores=int(cores), precision=prec, config=conf,
               overrides=ovr, devices=int(devices), accum_steps=int(accum),
               tgt_tokens_per_step=round(tok_per_step, 1), steps=r["steps"], warmup=warmup,
               tgt_tokens_per_s=round(r["tgt_tokens_per_s"], 1), step_ms=round(r["step_ms"], 2),
               ratio_vs_torch_eager=round(ratio, 3), model_gflops_per_s=round(gflops, 2),
               peak_gflops=round(peak / 1e9, 1), peak_source=peak_src, mfu=round(mfu, 4),
               runs_tgt_tokens_per_s=[round(r["tgt_tokens_per_s"], 1)],
               loadavg_before=float(load0), loadavg_after=float(load1),
               loss_check_max_rel=c32.get("loss_check_max_rel"),
               # fields added by gpu-compare.sh (older rows lack them)
               max_tokens=eager.get("max_tokens"),
               peak_mem_mb=None if r.get("peak_mem_mb") is None else round(r["peak_mem_mb"], 1),
               peak_mem_smi_mb=r.get("peak_mem_smi_mb"),
               smi_idle_mb=float(smi_idle) if smi_idle else None,
               loss_check_precision=prec if cp else None,
               loss_check_precision_max_abs=cp.get("loss_check_max_abs"),
               # added with the grad_norm check, the warmup_steps=1 checks and the compiled run's
               # status (older rows lack them)
               loss_check_grad_norm_max_rel=c32.get("grad_norm_check_max_rel"),
               loss_check_precision_grad_norm_max_rel=cp.get("grad_norm_check_max_rel"),
               loss_check_warmup_steps=(c32 or cp).get("lr_warmup_steps"),
               loss_check_lr_scale=(c32 or cp).get("lr_scale"),
               compile_mode=compile_mode, compile_status=compile_verdict,
               # added with the compile plan and CHECK_FATAL (older rows lack them)
               compile_dynamic=True, compile_check=compile_check,
               loss_check_problems="; ".join(eager_problems) or None,
               loss_check_compile={p: dict(ok=c["loss_check_ok"],
                                           max_rel=c.get("loss_check_max_rel"),
                                           max_abs=c.get("loss_check_max_abs"),
                                           grad_norm_max_rel=c.get("grad_norm_check_max_rel"))
                                   for p, c in sorted(compiled_checks.items())} or None)
    for k in ("compile_s", "nmt_reported_mfu"):
        if r.get(k) is not None:
            row[k] = round(r[k], 4)
    for k in ("attention", "recompiles_in_timed_steps", "compile_counters_timed_delta"):
        if r.get(k) is not None:
            row[k] = r[k]
    lines.append(json.dumps(row))
print("(MFU: %.3f GFLOP of GEMM work per target token, padded shapes, fwd+bwd "
      "(bench/README.md \"model FLOPs\") x tgt tok/s / %.4g TFLOP/s, %s; peak MiB: %s"
      % (flops_per_tok / 1e9, peak / 1e12, peak_src,
         "nmt's metrics peak_mem_mb (null until the CUDA backend reports it), PyTorch's "
         "max_memory_allocated; smi MiB: nvidia-smi memory.used peak during the run, CUDA "
         "context and allocator cache included, %s MiB before any run)" % (smi_idle or "?")
         if device == "cuda" else "peak resident set of each process)"))
for n in notes:
    print(n)
if rows[0].get("nmt_reported_mfu") is not None:
    print("nmt's own metrics MFU over the same steps: %.1f%%" % (100 * rows[0]["nmt_reported_mfu"]))


def check_line(label, p, c):
    g = c.get("grad_norm_check_max_rel")
    return ("loss check %s%s (%d steps, dropout 0, warmup_steps %s, lr_scale %.4g): loss max "
            "rel %.1e, max abs %.1e nats; grad_norm max rel %s: %s"
            % (p, label, c.get("loss_check_steps", 3), c.get("lr_warmup_steps", "?"),
               c.get("lr_scale", float("nan")),
               c["loss_check_max_rel"], c["loss_check_max_abs"],
               "-" if g is None else "%.1e" % g, "OK" if c["loss_check_ok"] else "MISMATCH"))


for p, c in checks.items():
    print(check_line("", p, c))
for p, c in sorted(compiled_checks.items()):
    print(check_line(" torch.compile", p, c))
for path in filter(None, (results, out and os.path.join(out, "results.jsonl"))):
    with open(path, "a") as f:
        f.write("".join(l + "\n" for l in lines))
    print("rows appended to %s" % path)
n = rows[0]
comp = [r for r in rows if r.get("mode") == "compile"]
if comp:
    ctext = "".join(", torch.compile (%s) %.0f (%.2fx)"
                    % (compile_plan, r["tgt_tokens_per_s"], r["tgt_tokens_per_s"] / base)
                    for r in comp)
    if problems:
        ctext += " [torch.compile NOT OK: %s]" % "; ".join(problems)
elif skipped:
    ctext = ", torch.compile %s (%s)" % tuple(compile_status.split(": ", 1))
else:
    ctext = ", torch.compile (%s) NOT OK: %s" % (compile_plan, compile_verdict)
if eager_problems:
    ctext += " [eager %s]" % "; ".join(eager_problems)
print("\nsummary: nmt %.0f tgt tok/s vs PyTorch eager %s %.0f tgt tok/s (%.2fx)%s on %s, %s, %s, "
      "%.0f tgt tokens/step, commit %s"
      % (n["tgt_tokens_per_s"], amp, base, n["tgt_tokens_per_s"] / base, ctext[:400],
         gpu, prec, config, tok_per_step, commit))
EOF
}

# ---------------------------------------------------------------------------------------------
# --biggest-batch

# The memory cap for nmt until it has its own key: a process that takes all but MEM_CAP_GIB of
# the free device memory and holds it while nmt runs, so nmt sees a card with MEM_CAP_GIB free
# (its own CUDA context and cuBLASLt workspace come out of it, as on a real 24 GiB card).
ballast_start() {
  rm -f "$TMP/ballast.ready"
  "$PY" - "$MEM_CAP_GIB" "$TMP/ballast.ready" > "$TMP/ballast.log" 2>&1 <<'EOF' &
import sys, time, torch
cap = float(sys.argv[1]) * 2 ** 30
free, total = torch.cuda.mem_get_info()
n = int(free - cap)
x = torch.empty(max(n, 0), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
free2, _ = torch.cuda.mem_get_info()
with open(sys.argv[2], "w") as f:
    f.write("%.2f %.2f\n" % (max(n, 0) / 2 ** 30, free2 / 2 ** 30))
while True:
    time.sleep(3600)
EOF
  BALLAST_PID=$!
  for _ in $(seq 1 120); do
    [[ -s $TMP/ballast.ready ]] && break
    kill -0 "$BALLAST_PID" 2>/dev/null || { cat "$TMP/ballast.log" >&2; exit 1; }
    sleep 0.5
  done
  [[ -s $TMP/ballast.ready ]] || { echo "gpu-compare: ballast process did not start" >&2; exit 1; }
  read -r held free < "$TMP/ballast.ready"
  echo "  ballast process holds $held GiB: $free GiB free for the system under test"
}
ballast_stop() {
  if [[ -n "${BALLAST_PID:-}" ]]; then kill "$BALLAST_PID" 2>/dev/null; wait "$BALLAST_PID" 2>/dev/null || true; fi
  BALLAST_PID=
}

# The batches of 3 steps with one micro-batch of at most T padded tokens per side.
dump_for() { # T
  local f=$TMP/bb-$1.bin
  if [[ ! -f $f ]]; then
    "$DUMP_BIN" "$CONFIG" "${BASE_OVR[@]}" "${OVR[@]}" data.max_tokens="$1" train.accum_steps=1 \
      --steps "$CHECK_STEPS" --out "$f" 2> "$TMP/dump.log" || { cat "$TMP/dump.log" >&2; exit 1; }
  fi
  echo "$f"
}

# probe SYSTEM T: prints "fit PEAK_MIB" or "oom -"; any other failure stops the script.
probe() {
  local sys=$1 T=$2 rc=0 name=probe-$1-$2 peak=-
  if [[ $sys == nmt ]]; then
    local cap=()
    # shellcheck disable=SC2206 # NMT_CAP_OVR is a list of overrides
    [[ -n "${NMT_CAP_OVR:-}" ]] && cap=($NMT_CAP_OVR)
    with_cpu_cap run_nmt "$name" "$PRECISION" "$CHECK_STEPS" 1 "${cap[@]}" data.max_tokens="$T" \
      train.accum_steps=1 || rc=$?
    if (( rc == 4 )) && grep -q "out of memory" "$TMP/$name.log"; then echo "oom -"; return; fi
    if (( rc != 0 )); then tail -20 "$TMP/$name.log" >&2; die 1 "nmt failed at max_tokens=$T (rc $rc)"; fi
    local m
    m=$(sort -n "$TMP/$name.smi" 2>/dev/null | tail -1 || true)
    # What nmt added to the device's memory.used (the ballast, if any, is in the baseline).
    [[ -n $m && -n "${SMI_BASE:-}" ]] && peak=$(( m - SMI_BASE ))
    [[ $peak == - ]] && peak=$("$PY" - "$TMP/$name/metrics.jsonl" <<'EOF'
import json, sys
v = [json.loads(l).get("peak_mem_mb") for l in open(sys.argv[1])]
v = [x for x in v if x is not None]
print("%.0f" % max(v) if v else "-")
EOF
)
  else
    local batches capflag=()
    batches=$(dump_for "$T")
    if [[ $DEVICE == cuda && $CAP_METHOD == split && $MEM_CAP_GIB != 0 ]]; then
      capflag=(--mem-cap-gib "$MEM_CAP_GIB")
    fi
    XOVR=(data.max_tokens="$T" train.accum_steps=1)
    with_cpu_cap run_torch "$name" "$sys" "$PRECISION" "$batches" --steps "$CHECK_STEPS" --warmup 1 \
      "${capflag[@]}" || rc=$?
    XOVR=()
    if (( rc == 4 )); then echo "oom -"; return; fi
    if (( rc != 0 )); then tail -20 "$TMP/$name.out" >&2; die 1 "pytorch $sys failed at max_tokens=$T (rc $rc)"; fi
    peak=$("$PY" -c 'import json,sys; print("%.0f" % json.load(open(sys.argv[1]))["peak_mem_mb"])' "$TMP/$name.json")
  fi
  rm -rf "${TMP:?}/$name" "$TMP/$name.json"
  echo "fit $peak"
}

# DEVICE=cpu self-test: the cap is an address-space limit (ulimit -v) on the probe, so that the
# search logic and both systems' out-of-memory exits run without a GPU.
with_cpu_cap() {
  if [[ $DEVICE == cpu && $MEM_CAP_GIB != 0 ]]; then
    ( ulimit -v "$(awk -v g="$MEM_CAP_GIB" 'BEGIN{printf "%d", g*1048576}')"; "$@" )
  else
    "$@"
  fi
}

# search SYSTEM: doubling from the config's data.max_tokens to the first failure, then bisection
# to RES_PCT percent (multiples of 64 tokens). Appends "T fit|oom peak" lines to $TMP/bb-SYSTEM.txt.
search() {
  local sys=$1 lo=0 hi=0 T st pk
  T=$(dump_key data max_tokens)
  : > "$TMP/bb-$sys.txt"
  try() {
    read -r st pk < <(probe "$sys" "$1")
    [[ -n ${st:-} ]] || { echo "gpu-compare: probe $sys max_tokens=$1 failed" >&2; exit 1; }
    echo "$1 $st $pk" >> "$TMP/bb-$sys.txt"
    printf "  %-8s max_tokens %8d: %s%s\n" "$sys" "$1" "$st" "$([[ $st == fit ]] && echo " (peak $pk MiB)")"
    [[ $st == fit ]]
  }
  if try "$T"; then
    lo=$T
    while (( hi == 0 )); do
      T=$(( lo * 2 ))
      if (( T > MAX_TOKENS_LIMIT )); then break; fi
      if try "$T"; then lo=$T; else hi=$T; fi
    done
  else
    hi=$T
    while (( lo == 0 )); do
      T=$(( hi / 2 / 64 * 64 ))
      if (( T < 64 )); then return 0; fi
      if try "$T"; then lo=$T; else hi=$T; fi
    done
  fi
  while (( hi > 0 && hi - lo > 64 && (hi - lo) * 100 > RES_PCT * lo )); do
    T=$(( (lo + hi) / 2 / 64 * 64 ))
    (( T <= lo )) && break
    if try "$T"; then lo=$T; else hi=$T; fi
  done
}

biggest() {
  echo "== largest data.max_tokens that trains $CHECK_STEPS steps (train.accum_steps=1)," \
       "$PRECISION, cap $MEM_CAP_GIB GiB"
  # Initial weights do not depend on max_tokens; the dump at the config's own size provides them.
  "$DUMP_BIN" "$CONFIG" "${BASE_OVR[@]}" "${OVR[@]}" --steps 1 --out "$TMP/unused.bin" \
    --params "$TMP/params.bin" 2> "$TMP/dump.log" || { cat "$TMP/dump.log" >&2; exit 1; }
  local sys nmt_cap=none torch_cap=none
  if [[ $DEVICE == cuda && $MEM_CAP_GIB != 0 ]]; then
    if [[ -n "${NMT_CAP_OVR:-}" ]]; then nmt_cap="overrides: $NMT_CAP_OVR"; else nmt_cap=ballast; fi
    if [[ $CAP_METHOD == split ]]; then torch_cap=set_per_process_memory_fraction; else torch_cap=ballast; fi
  elif [[ $DEVICE == cpu && $MEM_CAP_GIB != 0 ]]; then
    nmt_cap="ulimit -v" torch_cap="ulimit -v"
  fi
  read -r LOAD0 _ < /proc/loadavg
  for sys in $BIGGEST_SYSTEMS; do
    case $sys in nmt|eager|compile) ;; *) die 2 "BIGGEST_SYSTEMS: unknown $sys (nmt, eager, compile)" ;; esac
    local how=$torch_cap
    [[ $sys == nmt ]] && how=$nmt_cap
    echo "-- $sys (memory cap: $how)"
    [[ $how == ballast ]] && ballast_start
    SMI_BASE=$(smi_used)
    search "$sys"
    ballast_stop
  done
  read -r LOAD1 _ < /proc/loadavg
  "$PY" - "$TMP" "$CONFIG" "$PRECISION" "$(git_commit)" "$(nproc)" "${OVR[*]:-}" \
    "$MEM_CAP_GIB" "$nmt_cap" "$torch_cap" "${RESULTS:-}" "${OUT:-}" "$DEVICE" "$LOAD0" \
    "$LOAD1" "$BIGGEST_SYSTEMS" "$("$PY" -c 'import torch; print(torch.__version__)')" \
    "$([[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=name --format=csv,noheader -i 0 | head -1 || echo CPU)" <<'EOF'
import datetime, json, os, sys

(tmp, conf, prec, commit, cores, ovr, cap, nmt_cap, torch_cap, results, out, device, load0,
 load1, systems, torch_v, gpu) = sys.argv[1:]
date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
fmt = "%-20s %-9s %-34s %14s %14s %9s %7s"
print()
print(fmt % ("system", "precision", "memory cap", "largest fits", "smallest OOM", "peak MiB",
             "probes"))
lines = []
for s in systems.split():
    probes = [l.split() for l in open(os.path.join(tmp, "bb-%s.txt" % s)) if l.strip()]
    fits = [(int(t), pk) for t, st, pk in probes if st == "fit"]
    ooms = [int(t) for t, st, pk in probes if st == "oom"]
    best = max(fits) if fits else (None, "-")
    first_oom = min(ooms) if ooms else None
    system = "nmt" if s == "nmt" else "pytorch " + torch_v
    c = "%s GiB, %s" % (cap, nmt_cap if s == "nmt" else torch_cap) if cap != "0" else "none"
    print(fmt % ("nmt" if s == "nmt" else "pytorch " + s, prec, c[:34],
                 best[0] if best[0] else "none", first_oom or "> limit", best[1], len(probes)))
    lines.append(json.dumps(dict(
        date=date, commit=commit, bench="gpu-biggest-batch", system=system,
        variant="nmt" if s == "nmt" else s, device=gpu, cores=int(cores), precision=prec,
        config=conf, overrides=ovr, devices=1, accum_steps=1, steps=3,
        loadavg_before=float(load0), loadavg_after=float(load1),
        max_tokens_fits=best[0], max_tokens_oom=first_oom,
        peak_mem_mb=None if best[1] == "-" else float(best[1]), mem_cap_gib=float(cap),
        cap_method=nmt_cap if s == "nmt" else torch_cap,
        probes=[[int(t), st] for t, st, pk in probes])))
print("(largest data.max_tokens, padded tokens per side of one micro-batch, whose first 3 "
      "batches train without running out of memory; peak MiB at that size: %s)"
      % ("nvidia-smi memory.used for nmt, max_memory_allocated for PyTorch" if device == "cuda"
         else "peak resident set"))
for path in filter(None, (results, out and os.path.join(out, "results.jsonl"))):
    with open(path, "a") as f:
        f.write("".join(l + "\n" for l in lines))
    print("rows appended to %s" % path)
EOF
}

if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  # On SIGTERM (a caller's `timeout` signals the whole process group) main reports what it has
  # (on_term): this shell waits for it (a trapped signal is handled after the pipeline ends),
  # and tee ignores the signal so that the report still reaches summary.txt.
  trap : TERM
  main 2>&1 | (trap '' TERM; exec tee "$OUT/summary.txt")
  exit "${PIPESTATUS[0]}"
fi
main
