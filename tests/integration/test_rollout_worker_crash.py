"""A rollout server whose prompt worker crashes stops by itself with exit code 1 and says why.

Serving on would look alive — heartbeat, registry entry, health SERVING — while generating nothing: the
learner would wait on it and a supervisor (or a fleet, for that run's slot) would never restart it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollout_server.main import serve
from rollout_server.worker import PromptWorker
from tether.config import load_config
from tether.redis_server import free_port


async def test_a_crashed_prompt_worker_stops_the_server_with_exit_1(
    tiny_model_dir: Path, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def crash(self: PromptWorker, index: int) -> None:
        raise RuntimeError("a bug in the prompt worker")

    monkeypatch.setattr(PromptWorker, "_loop", crash)
    port = free_port()
    cfg = load_config(None, ["--model.path", str(tiny_model_dir), "--run.run_id", "crash",
                             "--run.output_dir", str(tmp_path / "runs"), "--buffer.redis_url", redis_url,
                             "--rollout.prompt_workers", "1"])  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cfg, port=port, server_id="crash", stop=stop))
    try:
        assert await asyncio.wait_for(task, 120) == 1  # nobody set stop: the crash did
    finally:
        stop.set()
