"""deploy/gpu-check.sh's summary.json, rewritten after every stage from what the stages left behind.

    python3 deploy/gpu_check_summary.py [--verdict]

Reads ``$GPU_CHECK_WORK`` (stages.tsv: name, exit code, seconds per finished stage; the runs' folders) and
``$GPU_CHECK_RESULTS`` (mfu.jsonl), writes ``$GPU_CHECK_RESULTS/summary.json`` and prints a short table.
``--verdict``: exit 1 unless every stage passed (the demo must also have learned on CUDA).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def stages(work: Path) -> dict[str, dict]:
    out = {}
    for line in (work / "stages.tsv").read_text().splitlines():
        name, rc, seconds = line.split("\t")
        out[name] = {"exit": int(rc), "seconds": int(seconds)}
    return out


def rows(results: Path) -> list[dict]:
    path = results / "mfu.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def run_folder(root: Path) -> Path | None:
    found = sorted(root.glob("run-*")) if root.is_dir() else []
    return found[0] if found else None


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def devices(run: Path) -> dict[str, str]:
    """Where each process ran, by its own start-up log line."""
    found = {}
    for log in (run / "logs").glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if '"device"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") in ("engine_started", "model_unsharded", "model_sharded"):
                found[rec.get("process", log.stem)] = rec["device"]
    return found


def demo_verdict(work: Path, exit_code: int | None) -> dict:
    run = run_folder(work / "demo-runs")
    if run is None:
        return {"ok": False, "why": "no run folder"}
    rewards = [r["reward/mean"] for r in metrics(run) if "reward/mean" in r]
    where = devices(run)
    last = rewards[-10:]
    mean_last = sum(last) / len(last) if last else 0.0
    on_gpu = bool(where) and all(d.startswith("cuda") for d in where.values())
    ok = exit_code == 0 and mean_last >= 0.5 and on_gpu
    first = rewards[0] if rewards else None
    return {"ok": ok, "steps": len(rewards), "reward_first": first, "reward_last10_mean": mean_last, "devices": where}


def up_figures(work: Path) -> dict:
    """The 0.5B run: each update's seconds (the learner's ``timing/weight_sync``), step seconds, GPU memory."""
    run = run_folder(work / "up-runs")
    out: dict = {}
    if run is not None:
        rows_ = metrics(run)
        for key in ("timing/weight_sync", "timing/weight_sync_wait", "timing/step", "perf/tokens_per_s"):
            vals = [r[key] for r in rows_ if key in r]
            if vals:
                out[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
        out["steps"] = sum(1 for r in rows_ if "timing/step" in r)
        out["devices"] = devices(run)
    mem = work / "gpu-memory.csv"
    if mem.exists():
        used = [int(x) for x in mem.read_text().split() if x.strip().isdigit()]
        if used:
            out["gpu_memory_mib"] = {"max": max(used), "first": used[0], "samples": len(used)}
    return out


def main() -> int:
    work, results = Path(os.environ["GPU_CHECK_WORK"]), Path(os.environ["GPU_CHECK_RESULTS"])
    done = stages(work)
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        version = torch.__version__
    except ImportError:
        device, version = None, None
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False) if device else None
    summary = {
        "device": device,
        "gpus": smi.stdout.strip() if smi else "",
        "torch": version,
        "stages": done,
        "mfu": rows(results),
        "up_0_5b": up_figures(work) if "up-0.5b" in done else None,
        "demo": demo_verdict(work, done["demo"]["exit"]) if "demo" in done else None,
    }
    (results / "summary.json").write_text(json.dumps(summary, indent=1))
    for name, s in done.items():
        print(f"   stage {name:<10} exit {s['exit']:>3}  {s['seconds']:>4} s")
    if "--verdict" in sys.argv:
        print(json.dumps(summary, indent=1))
        ok = all(s["exit"] == 0 for s in done.values()) and bool(summary["demo"] and summary["demo"]["ok"])
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
