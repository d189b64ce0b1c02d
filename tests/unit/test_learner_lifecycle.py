"""Which version a resumed learner continues from, reissuing prompts by position, and the stop signal."""

from __future__ import annotations

import json
import os
import signal

import pytest

from learner.data import PromptSource
from learner.lifecycle import StopSignal, plan_resume_version
from tether.config import TetherConfig


def test_resume_version_never_goes_back() -> None:
    # Redis and the snapshot agree with the checkpoint (a clean stop): carry on, nothing to publish.
    plan = plan_resume_version(12, published=12, snapshot=12)
    assert (plan.version, plan.publish) == (12, False)
    # Versions were published after the checkpoint: continue after the newest, with the checkpoint's weights.
    plan = plan_resume_version(12, published=15, snapshot=14)
    assert (plan.version, plan.publish) == (16, True)
    plan = plan_resume_version(12, published=0, snapshot=13)  # Redis lost it, the snapshot did not
    assert (plan.version, plan.publish) == (14, True)
    # No snapshot of the checkpoint's version for fresh servers to catch up from: write one.
    plan = plan_resume_version(12, published=12, snapshot=None)
    assert (plan.version, plan.publish) == (12, True)
    plan = plan_resume_version(0, published=0, snapshot=None)  # nothing trained yet: base weights are right
    assert (plan.version, plan.publish) == (0, False)


@pytest.mark.parametrize("source", ["demo", "jsonl"])
def test_prompts_at_returns_what_iteration_returned(tmp_path, source: str) -> None:
    if source == "jsonl":
        path = tmp_path / "data.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(5)))
        spec = str(path)
    else:
        spec = "demo:charclass"
    cfg = TetherConfig.model_validate({"learner": {"data_path": spec}})
    it = PromptSource(cfg)
    walked = [next(it) for _ in range(12)]
    again = PromptSource(cfg, start=12).prompts_at([11, 3, 7])
    assert [p.dataset_index for p in again] == [3, 7, 11]
    for p in again:
        assert p.text == walked[p.dataset_index].text
        assert dict(p.reward_context) == dict(walked[p.dataset_index].reward_context)


def test_first_signal_asks_to_stop_second_interrupts() -> None:
    stop = StopSignal()
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.received == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is not stop._handle
