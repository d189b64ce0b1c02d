"""The watchdog's finding from real open-span files (two processes' recorders, :mod:`tether.spans`): a span
that waits on another part of the run is named only when nothing that works is open, however long it waits."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tether.commands.watchdog import stuck_stage
from tether.spans import Recorder, _Span


@pytest.mark.parametrize("wait", ["wait_data", "wait_stale", "weight_sync_wait", "buffer_put"])
def test_the_working_span_is_named_before_an_older_wait(tmp_path: Path, wait: str) -> None:
    learner = Recorder(tmp_path, process="learner-rank0", flush_s=3600)
    rollout = Recorder(tmp_path, process="rollout-0", flush_s=3600)
    try:
        with _Span(learner, wait, {}):
            time.sleep(0.05)  # the wait began first: it is the older span
            with _Span(rollout, "redis", {"address": "127.0.0.1:6379", "op": "xadd"}):
                learner.flush(), rollout.flush()
                found = stuck_stage(tmp_path, now=time.time() + 1)
        assert found is not None and found.startswith("rollout-0: redis to 127.0.0.1:6379 open for"), found
    finally:
        learner.close(), rollout.close()


def test_a_wait_alone_is_named_and_a_silent_process_comes_first(tmp_path: Path, monkeypatch) -> None:
    import types

    import tether.spans

    learner = Recorder(tmp_path, process="learner-rank0", flush_s=3600)
    rollout = Recorder(tmp_path, process="rollout-0", flush_s=3600)
    try:
        with _Span(learner, "wait_stale", {}), _Span(rollout, "generate", {}):
            learner.flush(), rollout.flush()
            assert stuck_stage(tmp_path, now=time.time() + 1).startswith("rollout-0: generate open for")
            rollout.open.clear()  # the working span ended: only the wait is open
            rollout.flush()
            assert stuck_stage(tmp_path, now=time.time() + 1).startswith("learner-rank0: wait stale open for")
            # 10 s on, the learner's flusher still writes and the rollout's has stopped
            later = time.time() + 10
            monkeypatch.setattr(tether.spans, "time", types.SimpleNamespace(time=lambda: later))
            learner.flush()
            found = stuck_stage(tmp_path, now=later + 1)
            assert found is not None and found.startswith("rollout-0: not responding for 1"), found
    finally:
        learner.close(), rollout.close()
