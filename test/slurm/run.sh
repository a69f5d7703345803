#!/usr/bin/env bash
# test/slurm/run.sh: nmt under a real Slurm on this machine (`make test-slurm`, issue 24).
#
#   test/slurm/run.sh [BUILD]        BUILD: the build directory holding nmt (default build)
#
# Starts its own munged, slurmctld and two slurmd (nodes n1 and n2, `slurmd -N`) on loopback,
# with their own ports and every file in one temporary directory (test/slurm/slurm.conf.in),
# runs the documented job script test/slurm/train.sbatch (docs/multinode.md "Slurm") on a
# tiny model and the Bible corpus (data/bible, `make data`), checks job states, exit codes,
# nmt's files and log lines, and stops exactly the daemons it started. Cases:
#   env       what Slurm sets in a batch script and in an srun task (src/engine/world.c reads it)
#   typo      a misspelt key: FAILED, exit 2, the key named
#   tasks     -N1 -n2 (two tasks on one node): FAILED, exit 2, saying one task per node
#   nosrun    nmt without srun in a 2-node batch script: FAILED at once, exit 2, saying srun
#   one       one task: COMPLETED; the reference run of `preempt`
#   two       two nodes: COMPLETED, node 1 took its rank from srun, rendezvous removed
#   preempt   scancel --signal=TERM: exit 75, requeued, resumed from the checkpoint, the same
#             gradient norms at every step as `one`, COMPLETED
#   limit     --time=1 --signal=TERM@50: stopped by the signal before the limit, exit 75,
#             requeued (not TIMEOUT), resumed from the checkpoint
#   kill9     kill -9 of node 1's process: node 0 exits 8 by itself; FAILED
#   stall     node 1 stopped (SIGSTOP): node 0 exits 8 after parallel.timeout_s and srun ends
#             the stopped task after SLURM_WAIT seconds; FAILED instead of RUNNING forever
#   stop      conf/bible-small.ini (the default config) with train.valid_bleu = on: the time
#             from SIGTERM to nmt's exit (printed), a checkpoint at once, no validation at the
#             stop, and the next start resumes from it
# Prints "ok N - case" / "not ok N - case" and "N passed, N failed"; exit 1 when a case
# failed. Prints "# SKIP <why>" and exits 0 where Slurm cannot run: not root (slurmd starts
# jobs as their user), or Slurm not installed and no apt-get to install it (the Makefile runs
# tools/install-deps.sh --slurm first). NMT_SLURM_KEEP=1 keeps the temporary directory;
# NMT_SLURM_CASES="one preempt" runs only those cases (env, typo, tasks, nosrun, one, two,
# preempt, limit, kill9, stall, stop).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-build}
case $BUILD in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
NMT=$BUILD/nmt
T0=$SECONDS

skip() {
  echo "# SKIP $*"
  exit 0
}
die() {
  echo "test-slurm: error: $*" >&2
  exit 1
}

# ---- the documented job script is the one tested --------------------------------------------
# docs/multinode.md and README.md quote test/slurm/train.sbatch; a copy that drifted is an error
# here, before anything needs Slurm.
python3 - "$ROOT" <<'EOF' || exit 1
import sys
root = sys.argv[1]
script = open(f"{root}/test/slurm/train.sbatch").read()
bad = []
for doc in ("docs/multinode.md", "README.md"):
    text, blocks, cur = open(f"{root}/{doc}").read(), [], None
    for line in text.splitlines(keepends=True):
        if cur is None and line.startswith("```sh"):
            cur = []
        elif cur is not None and line.startswith("```"):
            blocks.append("".join(cur))
            cur = None
        elif cur is not None:
            cur.append(line)
    if script not in blocks:
        bad.append(doc)
if bad:
    sys.exit("test-slurm: " + " and ".join(bad) + " must quote test/slurm/train.sbatch as it is "
             "(a ```sh block with the whole file)")
print("# docs/multinode.md and README.md quote test/slurm/train.sbatch as it is")
EOF

# ---- can Slurm run here ---------------------------------------------------------------------
[ "$(id -u)" -eq 0 ] || skip "not root: slurmd must run as root to start jobs"
missing=()
for b in munged slurmctld slurmd sbatch srun scontrol scancel squeue sinfo; do
  command -v "$b" >/dev/null || missing+=("$b")
done
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || skip "Slurm is not installed (${missing[*]}) and there is no apt-get"
  die "${missing[*]} missing: tools/install-deps.sh --slurm installs munge and Slurm"
fi
[ -x "$NMT" ] || die "$NMT missing: make $(basename "$BUILD")/nmt"
for f in train.shard valid.shard spm.model valid.en valid.es; do
  [ -s "$ROOT/data/bible/$f" ] || die "data/bible/$f missing: make data"
done

# ---- the cluster ------------------------------------------------------------------------------
# Nothing of an enclosing Slurm job may leak into ours.
for v in $(env | grep -o '^SLURM_[A-Za-z0-9_]*'); do unset "$v"; done
T=$(mktemp -d "${TMPDIR:-/tmp}/nmt-slurm.XXXXXX") || die "mktemp failed"
chmod 755 "$T"
mkdir -p "$T/munge" "$T/state" "$T/spool" "$T/log" "$T/work"
export SLURM_CONF=$T/slurm.conf
W=$T/work # the jobs' working directory: looks like the repository root
ln -s "$BUILD" "$W/build"
ln -s "$ROOT/conf" "$W/conf"
ln -s "$ROOT/data" "$W/data"
n_fail=0

# Stops one daemon we started, by the pid its pid file names, if that process is still the
# daemon (name checked): SIGTERM, then SIGKILL after 15 s.
stop_daemon() {
  local pidfile=$1 name=$2 pid
  [ -s "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || return 0
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 75); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.2
  done
  kill -KILL "$pid" 2>/dev/null
}

cleanup() {
  set +e
  if [ -s "$T/slurmctld.pid" ]; then
    local jobs
    jobs=$(squeue -h -o %i 2>/dev/null)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086
      scancel $jobs
      for _ in $(seq 1 150); do
        [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
        sleep 0.2
      done
    fi
  fi
  stop_daemon "$T/slurmd-n2.pid" slurmd
  stop_daemon "$T/slurmd-n1.pid" slurmd
  stop_daemon "$T/slurmctld.pid" slurmctld
  stop_daemon "$T/munge/munged.pid" munged
  if [ "${NMT_SLURM_KEEP:-0}" = 1 ] || [ $n_fail -gt 0 ]; then
    echo "# kept $T"
  else
    rm -rf "$T"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Three free ports below the ephemeral range, so that no outgoing connection takes one later.
read -r CTLD_PORT N1_PORT N2_PORT < <(python3 - <<'EOF'
import random, socket
got = []
while len(got) < 3:
    p = random.randrange(20000, 32000)
    s = socket.socket()
    try:
        s.bind(("0.0.0.0", p))
        got.append(p)
    except OSError:
        pass
    finally:
        s.close()
print(*got)
EOF
)
HOST=$(hostname -s)
sed -e "s|@DIR@|$T|g" -e "s|@HOST@|$HOST|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" \
  -e "s|@N1_PORT@|$N1_PORT|g" -e "s|@N2_PORT@|$N2_PORT|g" "$ROOT/test/slurm/slurm.conf.in" \
  >"$T/slurm.conf"
: >"$T/plugstack.conf"
dd if=/dev/urandom of="$T/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$T/munge/munge.key"
munged -f --socket="$T/munge/munge.socket" --key-file="$T/munge/munge.key" \
  --pid-file="$T/munge/munged.pid" --seed-file="$T/munge/munged.seed" \
  --log-file="$T/log/munged.log" || die "munged did not start: $(tail -3 "$T/log/munged.log")"
slurmctld -f "$T/slurm.conf" || die "slurmctld did not start: $(tail -5 "$T/log/slurmctld.log")"
for n in n1 n2; do
  slurmd -f "$T/slurm.conf" -N $n || die "slurmd -N $n did not start: $(tail -5 "$T/log/slurmd-$n.log")"
done
up=0
for _ in $(seq 1 150); do
  [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle$')" -eq 2 ] && up=1 && break
  sleep 0.2
done
[ $up = 1 ] || die "the nodes did not come up: $(sinfo -N 2>&1); $(tail -5 "$T/log/slurmctld.log")"
echo "# Slurm $(sinfo -V | cut -d' ' -f2): slurmctld on port $CTLD_PORT, slurmd n1 on $N1_PORT," \
  "n2 on $N2_PORT, in $T ($((SECONDS - T0)) s to start)"

# ---- helpers ----------------------------------------------------------------------------------
# The tiny model: ~20 ms a step on one CPU worker.
TINY=(model.d_model=32 model.n_heads=2 model.d_ff=64 model.enc_layers=1 model.dec_layers=1
  data.max_len=32 data.max_tokens=256 train.accum_steps=1 train.warmup_steps=50
  train.log_every=1 parallel.device=cpu parallel.devices=1 parallel.iface=lo)

now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" "$1" "$(now)"; }

# field JOB KEY: KEY's value in `scontrol show job -o JOB` ("" when the job is unknown).
field() { scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | grep -m1 "^$2=" | cut -d= -f2-; }
state() { field "$1" JobState; }
ended() {
  case $(state "$1") in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | \
    BOOT_FAIL | DEADLINE | PREEMPTED) return 0 ;; esac
  return 1
}
# wait_for SECONDS CMD...: runs CMD every 0.1 s until it succeeds; 1 after SECONDS.
wait_for() {
  local end=$((SECONDS + $1))
  shift
  until "$@"; do
    [ $SECONDS -ge $end ] && return 1
    sleep 0.1
  done
}
run_dir() { echo "$W/runs/base-$1"; }
out_file() { echo "$W/slurm-$2-$1.out"; } # JOB NAME: the job's output (--output)
last_step() { # RUN_DIR: the last step in metrics.jsonl, 0 before one
  local s
  s=$(tail -n 1 "$1/metrics.jsonl" 2>/dev/null | grep -o '"step": [0-9]*' | grep -o '[0-9]*$')
  echo "${s:-0}"
}
past_step() { [ "$(last_step "$1")" -ge "$2" ]; }
# stop_step OUTPUT: the step the first stop ended at ("at step N of" after the signal's line).
stop_step() {
  sed -n '/signal 15: stopping/,$p' "$1" 2>/dev/null | grep -m1 -o 'at step [0-9]* of' |
    grep -o '[0-9][0-9]*' | head -1
}
json_str() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get(sys.argv[2]))' "$1" "$2" 2>/dev/null; }
# task_pid JOB PROCID: the pid of that task's nmt process on this machine.
task_pid() {
  local d
  for d in /proc/[0-9]*; do
    [ "$(cat "$d/comm" 2>/dev/null)" = nmt ] || continue
    tr '\0' '\n' <"$d/environ" 2>/dev/null | grep -qx "SLURM_JOB_ID=$1" || continue
    tr '\0' '\n' <"$d/environ" 2>/dev/null | grep -qx "SLURM_PROCID=$2" || continue
    echo "${d#/proc/}"
    return 0
  done
  return 1
}
alive() { kill -0 "$1" 2>/dev/null; }
not_alive() { ! kill -0 "$1" 2>/dev/null; }
restarted() { [ "$(field "$1" Restarts)" -ge "$2" ] 2>/dev/null; }
running_again() { restarted "$1" 1 && [ "$(state "$1")" = RUNNING ]; }

# submit NAME [sbatch options] -- [nmt overrides]: the job script as documented; its id.
submit() {
  local name=$1 opts=()
  shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do opts+=("$1") && shift; done
  [ $# -gt 0 ] && shift
  sbatch --parsable -J "$name" --chdir="$W" "${opts[@]}" "$ROOT/test/slurm/train.sbatch" "$@"
}

# A case's checks: `check DESCRIPTION CMD...` runs CMD; a failing one fails the case.
case_ok=1
check() {
  local what=$1
  shift
  if "$@"; then
    echo "#   ok: $what"
  else
    echo "#   FAILED: $what"
    case_ok=0
  fi
}
has() { grep -q -- "$2" "$1" 2>/dev/null; }      # FILE TEXT
lacks() { ! grep -q -- "$2" "$1" 2>/dev/null; }  # FILE TEXT
is() { [ "$1" = "$2" ]; }
n_case=0
# run_case NAME: runs case_NAME, prints its verdict, and on failure the job outputs it names
# in $case_jobs (JOB:NAME ...).
run_case() {
  local name=$1 t=$SECONDS j
  case " ${NMT_SLURM_CASES:-$name} " in *" $name "*) ;; *) return 0 ;; esac
  case_ok=1 case_jobs=""
  n_case=$((n_case + 1))
  echo "# -- $name"
  "case_$name"
  if [ $case_ok = 1 ]; then
    echo "ok $n_case - slurm_$name ($((SECONDS - t)) s)"
  else
    n_fail=$((n_fail + 1))
    for j in $case_jobs; do
      echo "# job ${j%%:*} ($(field "${j%%:*}" JobState) $(field "${j%%:*}" ExitCode)), its output:"
      tail -n 25 "$(out_file "${j%%:*}" "${j#*:}")" 2>/dev/null | sed 's/^/#   /'
    done
    echo "not ok $n_case - slurm_$name ($((SECONDS - t)) s)"
  fi
}

# ---- the cases ------------------------------------------------------------------------------
case_env() {
  cat >"$T/env.sh" <<'EOF'
#!/bin/bash
show='^SLURM_(STEP_ID|STEP_NUM_NODES|STEP_NUM_TASKS|NNODES|NTASKS|NODEID|PROCID|JOB_NUM_NODES)='
echo "batch: $(env | grep -E "$show" | sort | tr '\n' ' ')"
srun bash -c "echo \"task \$SLURM_PROCID: \$(env | grep -E '$show' | sort | tr '\n' ' ')\""
EOF
  local j
  j=$(sbatch --parsable -J env -N2 --ntasks-per-node=1 -c1 --chdir="$W" -o "$W/slurm-env-%j.out" \
    "$T/env.sh")
  case_jobs="$j:env"
  wait_for 60 ended "$j"
  local o
  o=$(out_file "$j" env)
  sed 's/^/#   /' "$o"
  check "COMPLETED" is "$(state "$j")" COMPLETED
  check "the batch script: SLURM_NNODES=2 and no SLURM_STEP_ID" \
    bash -c "grep '^batch:' '$o' | grep -q 'SLURM_NNODES=2' && ! grep '^batch:' '$o' | grep -q SLURM_STEP_"
  check "each srun task: SLURM_STEP_ID, SLURM_STEP_NUM_NODES=2, SLURM_STEP_NUM_TASKS=2" \
    is "$(grep '^task' "$o" | grep 'SLURM_STEP_ID=' | grep 'SLURM_STEP_NUM_NODES=2' |
      grep -c 'SLURM_STEP_NUM_TASKS=2')" 2
}

case_typo() {
  local j
  j=$(submit typo -N1 -c1 -- "${TINY[@]}" train.max_stpes=10)
  case_jobs="$j:typo"
  wait_for 60 ended "$j"
  check "FAILED with exit 2" is "$(state "$j") $(field "$j" ExitCode)" "FAILED 2:0"
  check "the log names the key" has "$(out_file "$j" typo)" "max_stpes"
}

case_tasks() {
  local j
  j=$(submit tasks -N1 -n2 --ntasks-per-node=2 -c1 -- "${TINY[@]}")
  case_jobs="$j:tasks"
  wait_for 60 ended "$j"
  check "FAILED with exit 2" is "$(state "$j") $(field "$j" ExitCode)" "FAILED 2:0"
  check "the log says why and what to do" has "$(out_file "$j" tasks)" \
    "srun started 2 tasks on 1 node(s) (SLURM_STEP_NUM_TASKS = 2, SLURM_STEP_NUM_NODES = 1)"
  check "... naming --ntasks-per-node=1" has "$(out_file "$j" tasks)" "ntasks-per-node=1"
}

case_nosrun() {
  local j t
  t=$(now)
  # A batch script of two nodes that runs nmt itself; parallel.timeout_s = 600: only an error
  # at start ends it within the 60 s waited here.
  j=$(sbatch --parsable -J nosrun -N2 --ntasks-per-node=1 -c1 --chdir="$W" \
    -o "$W/slurm-nosrun-%j.out" --wrap "build/nmt train conf/base.ini \
    'run.out_dir=runs/base-{job}' ${TINY[*]} parallel.timeout_s=600")
  case_jobs="$j:nosrun"
  wait_for 60 ended "$j"
  echo "#   ended after $(since "$t") s"
  check "FAILED with exit 2 (not 8 after parallel.timeout_s)" \
    is "$(state "$j") $(field "$j" ExitCode)" "FAILED 2:0"
  check "the log says to start nmt with srun" has "$(out_file "$j" nosrun)" \
    "not an srun task but the batch script"
}

# `one` is submitted first and checked after `preempt`, which compares with it.
start_one() {
  case " ${NMT_SLURM_CASES:-one} " in *" one "* | *" preempt "*) ;; *) return 0 ;; esac
  ONE_JOB=$(submit one -N1 -c1 -- "${TINY[@]}" train.max_steps=300 train.valid_bleu=on)
}
case_one() {
  local j=${ONE_JOB:-0} r
  case_jobs="$j:one"
  wait_for 240 ended "$j"
  r=$(run_dir "$j")
  check "COMPLETED with exit 0" is "$(state "$j") $(field "$j" ExitCode)" "COMPLETED 0:0"
  check "status.json: done at step 300" is "$(json_str "$r/status.json" state) \
$(json_str "$r/status.json" step)" "done 300"
  check "checkpoints/step_300.ckpt" test -s "$r/checkpoints/step_300.ckpt"
}

case_two() {
  local j
  j=$(submit two -N2 -c1 -- "${TINY[@]}" train.max_steps=40)
  case_jobs="$j:two"
  wait_for 240 ended "$j"
  local r o
  r=$(run_dir "$j") o=$(out_file "$j" two)
  check "COMPLETED with exit 0" is "$(state "$j") $(field "$j" ExitCode)" "COMPLETED 0:0"
  check "node 0 of 2 and node 1 of 2 in the log" \
    bash -c "grep -q 'node 0 of 2: ranks 0..0 of 2' '$o' && grep -q 'node 1 of 2: ranks 1..1 of 2' '$o'"
  check "status.json and status.node1.json: done" is "$(json_str "$r/status.json" state) \
$(json_str "$r/status.node1.json" state)" "done done"
  check "the rendezvous directory was removed" test ! -e "$r/rendezvous"
}

# The gradient norm of every step of two metrics.jsonl, compared; prints the count.
same_grad_norms() {
  python3 - "$1" "$2" <<'EOF'
import json, sys
def norms(path):
    out = {}
    for line in open(path):
        r = json.loads(line)
        out.setdefault(r["step"], set()).add(r["grad_norm"])
    return out
a, b = norms(sys.argv[1]), norms(sys.argv[2])
diff = [s for s in sorted(set(a) | set(b)) if a.get(s) != b.get(s)]
print(f"#   grad_norm at {len(a)} and {len(b)} steps; {len(diff)} differ"
      + (f", first at step {diff[0]}: {a.get(diff[0])} vs {b.get(diff[0])}" if diff else ""))
sys.exit(1 if diff or not a else 0)
EOF
}

case_preempt() {
  local j r o t s
  j=$(submit preempt -N1 -c1 -- "${TINY[@]}" train.max_steps=300 train.valid_bleu=on)
  case_jobs="$j:preempt"
  r=$(run_dir "$j") o=$(out_file "$j" preempt)
  check "training reached step 60" wait_for 120 past_step "$r" 60
  scancel --signal=TERM "$j"
  t=$(now)
  check "requeued and running again" wait_for 90 running_again "$j"
  echo "#   requeued and running again $(since "$t") s after scancel --signal=TERM"
  s=$(stop_step "$o")
  check "the stop: exit 75, the checkpoint of its step ($s)" \
    bash -c "grep -q 'task 0: Exited with exit code 75' '$o' && test -s '$r/checkpoints/step_${s:-x}.ckpt'"
  check "the next start resumed from it" wait_for 60 has "$o" "resuming from .*step_${s:-x}.ckpt (step ${s:-x})"
  wait_for 240 ended "$j"
  check "COMPLETED with exit 0 after 1 restart" \
    is "$(state "$j") $(field "$j" ExitCode) $(field "$j" Restarts)" "COMPLETED 0:0 1"
  check "the completion log has the requeue (JobState=PENDING), then COMPLETED" \
    is "$(grep "^JobId=$j " "$T/jobcomp.txt" | grep -o 'JobState=[A-Z]*' | tr '\n' ' ')" \
    "JobState=PENDING JobState=COMPLETED "
  check "--open-mode=append: the output holds both starts" \
    is "$(grep -c 'no checkpoint in\|resuming from' "$o")" 2
  wait_for 240 ended "${ONE_JOB:-0}"
  check "the gradient norms of every step equal the uninterrupted run's (case one)" \
    same_grad_norms "$(run_dir "${ONE_JOB:-0}")/metrics.jsonl" "$r/metrics.jsonl"
}

# `limit` is submitted before kill9 and stall, and checked after them: most of its time is
# spent waiting for slurmctld's pass over the time limits (every 30 s).
start_limit() {
  case " ${NMT_SLURM_CASES:-limit} " in *" limit "*) ;; *) return 0 ;; esac
  # The script's time limit replaced by one minute, the signal 50 s before it: the signal comes
  # at slurmctld's first pass after 10 s, between 10 s and 40 s in.
  LIMIT_JOB=$(submit limit -N1 -c1 --time=1 --signal=TERM@50 -- "${TINY[@]}" \
    train.max_steps=10000000)
}
case_limit() {
  local j=${LIMIT_JOB:-0} r o s
  case_jobs="$j:limit"
  r=$(run_dir "$j") o=$(out_file "$j" limit)
  check "requeued and running again" wait_for 150 running_again "$j"
  s=$(stop_step "$o")
  check "SIGTERM before the limit: exit 75 and the checkpoint of the stop's step ($s)" \
    bash -c "grep -q 'task 0: Exited with exit code 75' '$o' && test -s '$r/checkpoints/step_${s:-x}.ckpt'"
  check "the completion log has the requeue (JobState=PENDING), no TIMEOUT" \
    bash -c "grep -q '^JobId=$j .*JobState=PENDING' '$T/jobcomp.txt' && \
      ! grep -q '^JobId=$j .*JobState=TIMEOUT' '$T/jobcomp.txt'"
  check "the next start resumed from it" wait_for 60 has "$o" "resuming from .*step_${s:-x}.ckpt (step ${s:-x})"
  check "and trains on" wait_for 60 past_step "$r" $((${s:-0} + 5))
  scancel "$j"
  wait_for 60 ended "$j"
  check "CANCELLED (here, by scancel)" is "$(state "$j")" CANCELLED
}

case_kill9() {
  local j r o p0 p1 t
  j=$(submit kill9 -N2 -c1 -- "${TINY[@]}" train.max_steps=10000000)
  case_jobs="$j:kill9"
  r=$(run_dir "$j") o=$(out_file "$j" kill9)
  check "training reached step 20" wait_for 120 past_step "$r" 20
  p0=$(task_pid "$j" 0) p1=$(task_pid "$j" 1)
  check "both tasks' processes found" test -n "$p0" -a -n "$p1"
  kill -KILL "${p1:-0}"
  t=$(now)
  check "node 0 exits by itself" wait_for 60 not_alive "${p0:-0}"
  echo "#   node 0's process exited $(since "$t") s after kill -9 of node 1's"
  wait_for 60 ended "$j"
  check "FAILED" is "$(state "$j")" FAILED
  check "node 0: exit 8, naming the failed collective" \
    bash -c "grep -q 'task 0: Exited with exit code 8' '$o' && grep -q 'a peer process died' '$o'"
  check "status.json: failed" is "$(json_str "$r/status.json" state)" failed
  # What a SIGKILL cannot change: node 1's own status file; its lock is free.
  check "status.node1.json still says running, and run.node1.lock is not held" \
    bash -c "[ \"\$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[\"state\"])' \
      '$r/status.node1.json')\" = running ] && flock -n '$r/run.node1.lock' true"
}

case_stall() {
  local j r o p0 p1 t
  j=$(submit stall -N2 -c1 --export=ALL,SLURM_WAIT=5 -- "${TINY[@]}" train.max_steps=10000000 \
    parallel.timeout_s=5)
  case_jobs="$j:stall"
  r=$(run_dir "$j") o=$(out_file "$j" stall)
  check "training reached step 20" wait_for 120 past_step "$r" 20
  p0=$(task_pid "$j" 0) p1=$(task_pid "$j" 1)
  check "both tasks' processes found" test -n "$p0" -a -n "$p1"
  kill -STOP "${p1:-0}"
  t=$(now)
  check "the job ends" wait_for 90 ended "$j"
  echo "#   the job ended $(since "$t") s after node 1 was stopped (parallel.timeout_s = 5," \
    "SLURM_WAIT = 5)"
  check "FAILED" is "$(state "$j")" FAILED
  check "node 0 exited 8 on the timeout" \
    bash -c "grep -q 'task 0: Exited with exit code 8' '$o' && grep -q 'parallel.timeout_s' '$o'"
  check "srun ended the stopped task" wait_for 10 not_alive "${p1:-0}"
}

case_stop() {
  local j r o p t s sig_step
  # conf/bible-small.ini as it is (two CPU workers), with validation BLEU.
  j=$(submit stop -N1 -c2 --export=ALL,NMT_CONFIG=conf/bible-small.ini -- train.valid_bleu=on \
    train.log_every=1)
  case_jobs="$j:stop"
  r=$(run_dir "$j") o=$(out_file "$j" stop)
  check "training reached step 2" wait_for 240 past_step "$r" 2
  p=$(task_pid "$j" 0)
  sig_step=$(last_step "$r")
  scancel --signal=TERM "$j"
  t=$(now)
  check "nmt exits" wait_for 120 not_alive "${p:-0}"
  local dt
  dt=$(since "$t")
  s=$(stop_step "$o")
  echo "# SIGTERM to exit: $dt s (conf/bible-small.ini, train.valid_bleu = on; signal after" \
    "step $sig_step, stopped after step ${s:-?}; issue 24 asks under 5 s)"
  check "exit 75 and the stop's checkpoint (step ${s:-?})" \
    bash -c "grep -q 'task 0: Exited with exit code 75' '$o' && test -s '$r/checkpoints/step_${s:-x}.ckpt'"
  check "no validation at the stop (metrics of step ${s:-?} without valid_loss)" \
    python3 -c 'import json,sys
rows = [json.loads(l) for l in open(sys.argv[1]) if json.loads(l)["step"] == int(sys.argv[2])]
sys.exit(0 if rows and all("valid_loss" not in r for r in rows) else 1)' "$r/metrics.jsonl" "${s:-0}"
  check "requeued and running again" wait_for 90 running_again "$j"
  check "the next start resumed from the checkpoint" wait_for 120 has "$o" \
    "resuming from .*step_${s:-x}.ckpt (step ${s:-x})"
  check "and trains on" wait_for 120 past_step "$r" $((${s:-0} + 1))
  scancel --signal=KILL --full "$j"
  wait_for 60 ended "$j"
}

# ---- run them ---------------------------------------------------------------------------------
run_case env
run_case typo
run_case tasks
run_case nosrun
start_one
run_case two
run_case preempt
run_case one
start_limit
run_case kill9
run_case stall
run_case limit
run_case stop # alone, since it measures a time

echo "$((n_case - n_fail)) passed, $n_fail failed ($((SECONDS - T0)) s)"
[ $n_fail -eq 0 ]
