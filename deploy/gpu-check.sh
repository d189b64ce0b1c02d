#!/usr/bin/env bash
# The whole GPU check in one command, sized for one 10-minute call on a lent GPU machine:
#   bash deploy/gpu-check.sh [RESULTS_DIR]     (default: $OUT if set, else gpu-results/)
# From the repository root of a checkout, with the wheels of deploy/gpu-wheels.sh in .whl/ when the
# machine's image lacks them. Installs them aside (/tmp/tether-site), runs the GPU suite (tests/gpu: fails
# when CUDA is present and no test passed) and the MFU bench (bench/learner_mfu.py), and writes into
# RESULTS_DIR: gpu-tests.log, gpu-junit.xml, mfu.log, mfu.json and summary.json. Exit status: non-zero when
# either failed.
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
need = ["torch", "transformers", "grpc", "google.protobuf", "redis", "pydantic", "structlog", "pytest", "pytest_asyncio"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
if [ -n "$missing" ]; then
  echo "gpu-check: missing Python packages: $missing — run deploy/gpu-wheels.sh where pip works, carry .whl/" >&2
  exit 2
fi
(nvidia-smi -L || echo "no nvidia-smi") >"$results/gpus.txt" 2>&1
start=$(date +%s)
timeout 400 python3 -m pytest -p tests.gpu.verdict -m "gpu or gpu2" tests/gpu -rA -p no:cacheprovider \
  --junitxml "$results/gpu-junit.xml" 2>&1 | tee "$results/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 150 python3 bench/learner_mfu.py --json "$results/mfu.json" 2>&1 | tee "$results/mfu.log"
mfu_rc=${PIPESTATUS[0]}
python3 - "$results" "$tests_rc" "$mfu_rc" "$(( $(date +%s) - start ))" <<'PY'
import json, pathlib, sys
import torch
out, tests_rc, mfu_rc, seconds = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mfu = json.loads((out / "mfu.json").read_text()) if (out / "mfu.json").exists() else None
summary = {
    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "torch": torch.__version__,
    "gpu_tests_exit": tests_rc,
    "mfu_bench_exit": mfu_rc,
    "mfu": mfu,
    "seconds": seconds,
}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
PY
[ "$tests_rc" -eq 0 ] && [ "$mfu_rc" -eq 0 ]
