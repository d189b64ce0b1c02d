"""The GPU suite itself, on the CPU: it is collected, its verdict refuses an empty run on a GPU machine, and
its one-GPU tests pass as a dry run on the CPU (so their code cannot rot between the rare GPU runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.verdict import verdict

REPO = Path(__file__).resolve().parents[2]


def test_verdict_fails_a_gpu_machine_where_nothing_ran() -> None:
    assert verdict(cuda=True, passed=0, failed=0)[0] == 1
    assert verdict(cuda=True, passed=3, failed=0)[0] == 0
    assert verdict(cuda=True, passed=3, failed=1)[0] == 1
    assert verdict(cuda=False, passed=0, failed=0)[0] == 0  # no GPU: skipping is the expected outcome
    assert "nothing about CUDA" in verdict(cuda=False, passed=8, failed=0, dry_run=True)[1]


def _pytest(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.gpu.verdict", "-m", "gpu or gpu2", "tests/gpu", *args],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_the_suite_is_collected_on_the_cpu() -> None:
    out = _pytest("--collect-only", "-q")
    listed = [line for line in out.stdout.splitlines() if "::test_" in line]
    assert len(listed) >= 10, out.stdout
    assert any("nccl" in line for line in listed) and any("bf16" in line for line in listed)


@pytest.mark.slow
def test_one_gpu_tests_pass_as_a_dry_run_on_the_cpu() -> None:
    out = _pytest("-q", env={"TETHER_GPU_SUITE_ON_CPU": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "gpu verdict: dry run on the CPU" in out.stdout
    passed = [line for line in out.stdout.splitlines() if line.startswith("  passed")]
    assert len(passed) >= 8, out.stdout


def _gpu_check(results: Path, tmp_path: Path, **env_extra: str) -> subprocess.CompletedProcess:
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}", "GPU_CHECK_WHEELS": str(tmp_path / "none"),
           **env_extra}  # fmt: skip
    env.pop("OUT", None)
    return subprocess.run(["bash", str(REPO / "deploy" / "gpu-check.sh"), str(results)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.mark.slow
def test_gpu_check_script_runs_end_to_end_and_fails_without_a_gpu(tmp_path: Path) -> None:
    """The one command for a lent GPU machine, run here: the suite skips, the MFU matrix and the 0.5B run
    refuse, the demo runs but on the CPU (no GPU evidence, so not ok), the results folder is written within
    what a lent machine sends back, and the exit status says the check did not pass."""
    results = tmp_path / "results"
    proc = _gpu_check(results, tmp_path, GPU_CHECK_DEMO_STEPS="3")  # the stage runs; learning is the GPU's to show
    assert proc.returncode != 0  # no GPU: the MFU bench cannot run, so the check cannot pass
    summary = json.loads((results / "summary.json").read_text())
    exits = {name: s["exit"] for name, s in summary["stages"].items()}
    assert exits == {"gpu-tests": 0, "mfu": 2, "up-0.5b": 2, "demo": 0}, exits
    assert "gpu verdict: no CUDA device" in (results / "gpu-tests.log").read_text()
    assert (results / "gpu-junit.xml").exists()
    assert "needs a CUDA GPU" in (results / "mfu.log").read_text() and summary["mfu"] == []
    demo = summary["demo"]
    assert demo["steps"] > 0 and not demo["ok"]
    assert set(demo["devices"].values()) == {"cpu"}  # the learner's and the engine's own log lines say where
    assert len(list(results.iterdir())) <= 8  # a lent machine sends back at most eight files


def test_gpu_check_skips_what_its_budget_cannot_hold_and_says_so(tmp_path: Path) -> None:
    """Every stage runs under what is left of GPU_CHECK_BUDGET_S: with too little left a stage is skipped
    (exit 125) rather than cut mid-way, summary.json names each stage's outcome, and the check fails."""
    results = tmp_path / "results"
    proc = _gpu_check(results, tmp_path, GPU_CHECK_BUDGET_S="19")
    assert proc.returncode != 0
    summary = json.loads((results / "summary.json").read_text())
    assert {name: s["exit"] for name, s in summary["stages"].items()} == dict.fromkeys(
        ("gpu-tests", "mfu", "up-0.5b", "demo"), 125
    )
    assert "gpu-tests: skipped" in proc.stdout


def test_nccl_receive_buffers_go_to_the_gpu_whatever_the_receiver_was_built_with() -> None:
    """The transformers target and the vLLM worker build their receiver with the CPU default; NCCL moves CUDA
    memory only, so its buffers must follow the backend (gloo keeps the configured device)."""
    import torch

    from weight_sync.collective import CollectiveReceive

    receive = CollectiveReceive()
    assert receive._device_for("gloo") == torch.device("cpu")
    if torch.cuda.is_available():
        assert receive._device_for("nccl").type == "cuda"
    else:
        with pytest.raises((RuntimeError, AssertionError)):  # asks CUDA for the current device
            receive._device_for("nccl")
