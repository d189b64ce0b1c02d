"""The prompt source: JSONL rows and the demo task, text plus reward context, resumable by position."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from learner.data import PromptSource
from tether.config import TetherConfig


def _cfg(data_path: str) -> TetherConfig:
    return TetherConfig.model_validate({"learner": {"data_path": data_path}})


def test_jsonl_rows_become_prompts_with_reward_context_and_repeat_in_epochs(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i), "level": i}) for i in range(3)))
    src = PromptSource(_cfg(str(path)))
    got = list(itertools.islice(src, 4))
    assert [p.text for p in got] == ["q0", "q1", "q2", "q0"]
    assert dict(got[1].reward_context) == {"answer": "1", "level": "1"}
    assert [p.dataset_index for p in got] == [0, 1, 2, 3] and src.position == 4


def test_resuming_at_a_position_continues_the_same_order() -> None:
    full = [p.text for p in itertools.islice(PromptSource(_cfg("demo:charclass")), 10)]
    resumed = PromptSource(_cfg("demo:charclass"), start=6)
    assert [p.text for p in itertools.islice(resumed, 4)] == full[6:]
    assert dict(next(resumed).reward_context)["answer"] in {"digits", "lower", "upper"}


def test_bad_data_path_says_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        PromptSource(_cfg(str(tmp_path / "nope.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="has no column 'prompt'"):
        PromptSource(_cfg(str(bad)))
