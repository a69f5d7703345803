#!/usr/bin/env bash
# bench/cpu-throughput.sh — nmt's CPU training throughput next to PyTorch CPU eager, on the same
# model, the same initial weights and the same batches, measured in one run (`make bench`).
#
# usage: bench/cpu-throughput.sh [--breakdown] [section.key=value ...]
# env:   CONF (default conf/bible-small.ini), STEPS (default 30), WARMUP (default 5),
#        THREADS (PyTorch intra-op threads; default: the machine's cores), REPEAT (default 1:
#        interleaved runs of each system, the best one reported), PEAK_GFLOPS (fp32 peak of
#        the whole machine for MFU; default: measured, see below)
#
# 1. builds build/nmt, build/libnmt.a and build/bench/dump_batches;
# 2. dumps the batches of steps [0, STEPS) in the trainer's order and nmt's initial parameters;
# 3. loss check: 3 steps of nmt and of PyTorch with every dropout at 0 from the same weights; the
#    per-step train_loss must agree to 1e-4 relative (validates "same model, same batches");
# 4. nmt train for STEPS steps (log_every = WARMUP, no validation, no intermediate checkpoint):
#    target tokens/s over steps WARMUP+1..STEPS from metrics.jsonl;
# 5. PyTorch eager (and torch.compile where the installed torch has it) on the same batches;
# 6. --breakdown adds nmt with 1 worker (same batches per step via accum_steps) and PyTorch with
#    1 thread, to show how each scales from one core to two, then per-op profiles of both
#    (bench/op_profile.c on nmt's ref backend, torch.autograd.profiler on PyTorch).
# Prints a table, appends one JSON row per system to bench/results.jsonl, ends with a summary.
# Timings never decide anything here: the script fails only if a step fails or the loss check
# disagrees.
set -euo pipefail
cd "$(dirname "$0")/.."

CONF=${CONF:-conf/bible-small.ini}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-5}
CORES=$(nproc)
THREADS=${THREADS:-$CORES}
REPEAT=${REPEAT:-1}
PY=/usr/bin/python3 # Debian's python3-torch; the pyenv python3 on PATH has no torch
BREAKDOWN=0
OVR=()
for a in "$@"; do
  case $a in
    --breakdown) BREAKDOWN=1 ;;
    *=*) OVR+=("$a") ;;
    *) echo "usage: bench/cpu-throughput.sh [--breakdown] [section.key=value ...]" >&2; exit 2 ;;
  esac
done
if (( WARMUP < 1 || STEPS <= WARMUP )); then
  echo "cpu-throughput: need 1 <= WARMUP < STEPS (got WARMUP=$WARMUP STEPS=$STEPS)" >&2
  exit 2
fi

make -j2 --no-print-directory build/nmt build/libnmt.a
# The bench tools link build/libnmt.a with the Makefile's own link line (it grows CUDA libraries
# when the CUDA backend is built), read from make without a rule in the Makefile.
# shellcheck disable=SC2016 # $(LDLIBS) is make syntax, expanded by make
LDLIBS=$(echo 'print-ldlibs: ; @echo $(LDLIBS)' |
         make -s --no-print-directory -f Makefile -f - print-ldlibs)
build_tool() { # name
  mkdir -p build/bench
  # shellcheck disable=SC2086 # LDLIBS is a list of flags
  gcc -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Werror -Iinclude -pthread \
    "bench/$1.c" build/libnmt.a -o "build/bench/$1" $LDLIBS
}
build_tool dump_batches
# Peak fp32 FLOP/s for MFU: cores x one core's measured FMA throughput (op_profile --peak: it
# runs at the clock the core sustains, boost included). op_profile wraps the backend table, so
# if it does not build against a changed table, fall back to a nominal cores x 32 FLOP/cycle x
# the clock /proc/cpuinfo reports, and say so. PEAK_GFLOPS overrides both.
PEAK_SRC="PEAK_GFLOPS"
if [[ -z "${PEAK_GFLOPS:-}" ]]; then
  if build_tool op_profile 2> build/bench/op_profile.log; then
    PEAK_GFLOPS=$(awk -v c="$CORES" -v g="$(build/bench/op_profile --peak)" \
                  'BEGIN{printf "%.0f", c*g}')
    PEAK_SRC="measured FMA peak x $CORES cores"
  else
    echo "cpu-throughput: warning: bench/op_profile.c does not build (see" \
         "build/bench/op_profile.log); MFU uses a nominal peak" >&2
    mhz=$(awk -F': *' '/^cpu MHz/{print $2; exit}' /proc/cpuinfo)
    PEAK_GFLOPS=$(awk -v c="$CORES" -v m="${mhz:-0}" 'BEGIN{printf "%.0f", c*32*m/1000}')
    PEAK_SRC="nominal: $CORES cores x 32 FLOP/cycle x ${mhz:-?} MHz"
  fi
fi
if [[ ! -f data/bible/train.shard ]]; then
  tools/prepare-bible.sh
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/nmt-bench.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
NODROP=(model.dropout=0 model.attn_dropout=0 model.relu_dropout=0)
# No validation and only the final checkpoint, which is written after the last timed step.
QUIET=(train.valid_every=0 train.save_every=0)

echo "== dump $STEPS steps of $CONF ${OVR[*]:-}"
build/bench/dump_batches "$CONF" "${OVR[@]}" --steps "$STEPS" --out "$tmp/batches.bin" \
  --params "$tmp/params.bin"

echo "== loss check: 3 steps, dropout 0, same initial weights"
CHECK_STEPS=3
(( CHECK_STEPS > STEPS )) && CHECK_STEPS=$STEPS
build/nmt train "$CONF" "${OVR[@]}" "${NODROP[@]}" "${QUIET[@]}" train.max_steps="$CHECK_STEPS" \
  train.log_every=1 run.out_dir="$tmp/check" 2> "$tmp/check.log" \
  || { cat "$tmp/check.log" >&2; exit 1; }
OMP_WAIT_POLICY=PASSIVE $PY bench/pytorch_baseline.py --batches "$tmp/batches.bin" --params "$tmp/params.bin" \
  --config "$CONF" "${OVR[@]}" "${NODROP[@]}" --steps "$CHECK_STEPS" --warmup 1 \
  --threads "$THREADS" --check-metrics "$tmp/check/metrics.jsonl" --result "$tmp/check.json" \
  | tee "$tmp/check.out" | sed -n '/^ *step  *nmt/,$p'

run_nmt() { # name, extra overrides...
  local name=$1
  shift
  echo "== nmt train ($name): $STEPS steps"
  build/nmt train "$CONF" "${OVR[@]}" "${QUIET[@]}" "$@" train.max_steps="$STEPS" \
    train.log_every="$WARMUP" run.out_dir="$tmp/$name" 2> "$tmp/$name.log" \
    || { cat "$tmp/$name.log" >&2; exit 1; }
  grep -E "step +[0-9]+/" "$tmp/$name.log" | sed 's/^/  /' || true
}
run_torch() { # name, mode, threads, extra args...
  local name=$1 mode=$2 threads=$3
  shift 3
  echo "== pytorch $mode, $threads thread(s) ($name): $STEPS steps"
  # torch's GEMMs go to the system BLAS (OpenBLAS on Debian), whose thread pool
  # torch.set_num_threads does not size: pin both. OMP_WAIT_POLICY=PASSIVE: with GNU OpenMP's
  # default spin-wait, torch's idle OpenMP workers spin on the cores OpenBLAS's threads need
  # (measured 3x slower steps on a loaded 2-core machine); passive waiting is torch's best case.
  OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads \
    $PY bench/pytorch_baseline.py \
    --batches "$tmp/batches.bin" --params "$tmp/params.bin" --config "$CONF" "${OVR[@]}" \
    --mode "$mode" --threads "$threads" --warmup "$WARMUP" --result "$tmp/$name.json" "$@" \
    > "$tmp/$name.out" || { cat "$tmp/$name.out" >&2; exit 1; }
  grep -v "^step " "$tmp/$name.out" | sed 's/^/  /'
}

dump_key() { # section key
  build/nmt config --dump "$CONF" "${OVR[@]}" |
    awk -F' *= *' -v sec="[$1]" -v key="$2" '/^\[/{s=$0} s==sec && $1==key{print $2}'
}
DEVICES=$(dump_key parallel devices)
ACCUM=$(dump_key train accum_steps)
read -r LOAD1 _ < /proc/loadavg
if awk -v l="$LOAD1" 'BEGIN{exit !(l > 0.5)}'; then
  echo "cpu-throughput: warning: load average $LOAD1 before timing: other processes share" \
       "the cores, the figures below will be low and noisy" >&2
fi
# Interleaved repeats, so slow drift in the machine's load hits every system alike; the report
# keeps each system's best run and lists all of them in results.jsonl.
for r in $(seq 1 "$REPEAT"); do
  run_nmt "nmt.$r"
  run_torch "torch-eager.$r" eager "$THREADS"
  if (( BREAKDOWN )); then
    if (( DEVICES > 1 )); then
      run_nmt "nmt-1worker.$r" parallel.devices=1 train.accum_steps=$((DEVICES * ACCUM))
    fi
    if (( THREADS > 1 )); then run_torch "torch-eager-1thread.$r" eager 1; fi
  fi
done
run_torch torch-compile.1 compile "$THREADS"
read -r LOAD1_AFTER _ < /proc/loadavg
if (( BREAKDOWN )); then
  echo "== where nmt's time goes: one thread, the same steps as one worker with accum_steps = K"
  if build_tool op_profile 2> build/bench/op_profile.log; then
    build/bench/op_profile "$CONF" "${OVR[@]}" --batches "$tmp/batches.bin" \
      --params "$tmp/params.bin" --warmup "$WARMUP" | sed 's/^/  /'
  else
    echo "  bench/op_profile.c does not build against this backend table: see" \
         "build/bench/op_profile.log"
  fi
  echo "== where PyTorch's time goes: one step under torch.autograd.profiler, $THREADS thread(s)"
  OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS \
    $PY bench/pytorch_baseline.py \
    --batches "$tmp/batches.bin" --params "$tmp/params.bin" --config "$CONF" "${OVR[@]}" \
    --threads "$THREADS" --steps "$((WARMUP + 1))" --warmup "$WARMUP" --profile \
    | sed -n '/^---/,/^Self CPU/p' | sed 's/^/  /'
fi

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
# Dirty = code or config differs from HEAD; this bench's own outputs and docs do not count.
if [[ -n "$(git status --porcelain -- src include cuda bench conf Makefile \
             ':!bench/results.jsonl' ':!bench/*.md' 2>/dev/null)" ]]; then
  commit="$commit-dirty"
fi
cpu=$(awk -F': *' '/^model name/{print $2; exit}' /proc/cpuinfo)

$PY - "$tmp" "$CONF" "$STEPS" "$WARMUP" "$THREADS" "$DEVICES" "$ACCUM" "$commit" "$cpu" \
  "$CORES" "${OVR[*]:-}" "$PEAK_GFLOPS" "$LOAD1" "$LOAD1_AFTER" "$PEAK_SRC" <<'EOF'
import datetime, glob, json, os, sys

(tmp, conf, steps, warmup, threads, devices, accum, commit, cpu, cores, ovr, peak, load0,
 load1, peak_src) = sys.argv[1:]
peak = float(peak) * 1e9
steps, warmup, threads, devices, accum = map(int, (steps, warmup, threads, devices, accum))
date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
device = "%s, %s cores" % (cpu, cores)
config = os.path.splitext(os.path.basename(conf))[0] + ("" if not ovr else " " + ovr)
check = json.load(open(os.path.join(tmp, "check.json")))
eager = json.load(open(os.path.join(tmp, "torch-eager.1.json")))
tok_per_step = eager["tgt_tokens"] / eager["steps"]
flops_per_tok = eager["model_flops"] / eager["tgt_tokens"]  # same batches for every system


def nmt_run(path):
    recs = [json.loads(l) for l in open(os.path.join(path, "metrics.jsonl"))]
    prev, dt, tok, n = 0, 0.0, 0.0, 0
    for r in recs:
        k = r["step"] - prev
        if r["step"] > warmup:
            s = r["step_ms"] * k / 1e3
            dt += s
            tok += r["tgt_tokens_per_s"] * s
            n += k
        prev = r["step"]
    # The dump holds the same batches: the token counts must agree (up to metrics rounding).
    if abs(tok - eager["tgt_tokens"]) > 0.005 * eager["tgt_tokens"]:
        sys.exit("%s measured %.0f target tokens, the dumped batches %.0f: not the same batches"
                 % (path, tok, eager["tgt_tokens"]))
    return dict(tgt_tokens_per_s=tok / dt, step_ms=1e3 * dt / n, steps=n, threads=0)


def plural(n, word):
    return "%d %s%s" % (n, word, "" if n == 1 else "s")


rows = []
for name, workers in (("nmt", devices), ("nmt-1worker", 1)):
    runs = [nmt_run(p) for p in sorted(glob.glob(os.path.join(tmp, name + ".[0-9]*")))
            if os.path.isdir(p)]
    if runs:
        best = max(runs, key=lambda r: r["tgt_tokens_per_s"])
        rows.append(dict(best, system="nmt", runs=[round(r["tgt_tokens_per_s"], 1) for r in runs],
                         variant="%s x 1 BLAS thread" % plural(workers, "worker")))
for name in ("torch-eager", "torch-eager-1thread", "torch-compile"):
    runs = []
    for p in sorted(glob.glob(os.path.join(tmp, name + ".[0-9]*.json"))):
        r = json.load(open(p))
        if "skipped" in r:
            print("pytorch %s: %s" % (name.split("-")[1], r["skipped"]))
            break
        runs.append(r)
    if runs:
        best = max(runs, key=lambda r: r["tgt_tokens_per_s"])
        rows.append(dict(system="pytorch " + best["torch"], steps=best["steps"],
                         tgt_tokens_per_s=best["tgt_tokens_per_s"], step_ms=best["step_ms"],
                         threads=best["threads"],
                         runs=[round(r["tgt_tokens_per_s"], 1) for r in runs],
                         variant="%s, %s" % (name.split("-")[1], plural(best["threads"], "thread"))))

base = next(r for r in rows if r["variant"].startswith("eager") and r["threads"] == threads)
base = base["tgt_tokens_per_s"]
hdr = ("system", "variant", "device", "precision", "config", "tgt tok/step", "steps",
       "tgt tok/s", "step ms", "GFLOP/s", "MFU", "vs torch eager")
fmt = "%-18s %-28s %-22s %-9s %-16s %12s %6s %10s %9s %8s %6s %14s"
print()
print(fmt % hdr)
with open("bench/results.jsonl", "a") as f:
    for r in rows:
        ratio = r["tgt_tokens_per_s"] / base
        gflops = r["tgt_tokens_per_s"] * flops_per_tok / 1e9
        mfu = gflops * 1e9 / peak if peak > 0 else float("nan")
        print(fmt % (r["system"], r["variant"], device[:22], "fp32", config[:16],
                     "%.0f" % tok_per_step, r["steps"], "%.0f" % r["tgt_tokens_per_s"],
                     "%.1f" % r["step_ms"], "%.1f" % gflops, "%.1f%%" % (100 * mfu),
                     "%.2fx" % ratio))
        row = dict(date=date, commit=commit, bench="cpu-throughput", system=r["system"],
                   variant=r["variant"], device=cpu, cores=int(cores), precision="fp32",
                   config=conf, overrides=ovr, devices=devices, accum_steps=accum,
                   tgt_tokens_per_step=round(tok_per_step, 1), steps=r["steps"], warmup=warmup,
                   tgt_tokens_per_s=round(r["tgt_tokens_per_s"], 1),
                   step_ms=round(r["step_ms"], 2), ratio_vs_torch_eager=round(ratio, 3),
                   model_gflops_per_s=round(gflops, 2), peak_gflops=peak / 1e9,
                   peak_source=peak_src,
                   mfu=round(mfu, 4), runs_tgt_tokens_per_s=r["runs"],
                   loadavg_before=float(load0), loadavg_after=float(load1),
                   loss_check_max_rel=check.get("loss_check_max_rel"))
        f.write(json.dumps(row) + "\n")
print("(GFLOP/s: %.3f GFLOP of GEMM work per target token, padded shapes, fwd+bwd; MFU against "
      "an fp32 peak of %.0f GFLOP/s, %s; best of %d run(s); load average %s before, %s after)"
      % (flops_per_tok / 1e9, peak / 1e9, peak_src, len(rows[0]["runs"]), load0, load1))
n = rows[0]
print("\nsummary: nmt %.0f tgt tok/s vs PyTorch eager %.0f tgt tok/s (%.2fx) on %s, fp32, %s, "
      "%.0f tgt tokens/step, commit %s; step-1..%d loss check max rel diff %.1e"
      % (n["tgt_tokens_per_s"], base, n["tgt_tokens_per_s"] / base, device, config,
         tok_per_step, commit, len(check["losses"]), check.get("loss_check_max_rel", float("nan"))))
EOF
