"""``bench/openai_door.py --quick`` runs and reports its figures (HTTP vs gRPC per concurrency, the naive proxy's
wrong-token fraction); what the figures are is never asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_openai_door_bench_quick_reports_its_figures() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "openai_door.py"), "--quick", "--episodes", "2"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for name in ("http_vs_grpc_1clients", "http_vs_grpc_8clients", "http_vs_grpc_64clients",
                 "naive_proxy_wrong_token_fraction"):  # fmt: skip
        assert f"FIGURE openai_door/{name}: " in out.stdout, name
