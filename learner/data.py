"""The prompt source of learner rank 0: JSONL rows or a built-in demo task, in a resumable order.

Nothing is tokenized here: rollout servers tokenize with the engine's tokenizer, so a ``Prompt`` carries
the text and a ``reward_context`` (every JSONL key except the prompt, as strings — e.g. the answer).
The source is an iterator whose ``position`` is the index of the next row; the buffer's ``feed`` never
pulls more than it issues, so ``position`` is exactly the dataset position a checkpoint must keep.
A JSONL file is repeated in epochs (row ``i`` is line ``i mod n``); a demo task is an endless stream.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from tether.config import TetherConfig
from tether.tasks import demo_rows
from tether.v1.trajectory_pb2 import Prompt


def read_jsonl(path: str | Path, *, prompt_key: str) -> list[dict]:
    rows = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"learner.data_path: {path}:{lineno} is not JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get(prompt_key), str):
                raise ValueError(f"learner.data_path: {path}:{lineno} has no string field {prompt_key!r}")
            rows.append(row)
    if not rows:
        raise ValueError(f"learner.data_path: {path} has no rows")
    return rows


class PromptSource(Iterator[Prompt]):
    """Endless prompts from ``learner.data_path`` starting at ``start`` (the checkpointed position)."""

    def __init__(self, cfg: TetherConfig, *, start: int = 0) -> None:
        spec = cfg.learner.data_path
        self.prompt_key = cfg.learner.prompt_key
        self.position = start
        if not spec:
            raise ValueError("learner.data_path is empty: give a JSONL file or demo:charclass")
        if spec.startswith("demo:"):
            self._rows: list[dict] | None = None
            self.prompt_key = "prompt"
            self._demo = (spec.split(":", 1)[1], cfg.run.seed)
            self._stream = itertools.islice(demo_rows(self._demo[0], seed=self._demo[1]), start, None)
        else:
            if not Path(spec).is_file():
                raise ValueError(f"learner.data_path: {spec} does not exist")
            self._rows = read_jsonl(spec, prompt_key=self.prompt_key)

    def _row(self) -> dict:
        if self._rows is None:
            return next(self._stream)
        return self._rows[self.position % len(self._rows)]

    def _prompt(self, row: dict, index: int) -> Prompt:
        context = {k: v if isinstance(v, str) else json.dumps(v) for k, v in row.items() if k != self.prompt_key}
        return Prompt(prompt_id=f"p{index}", dataset_index=index, text=row[self.prompt_key], reward_context=context)

    def __next__(self) -> Prompt:
        prompt = self._prompt(self._row(), self.position)
        self.position += 1
        return prompt

    def prompts_at(self, indices: list[int]) -> list[Prompt]:
        """The prompts at these dataset positions, in order (to reissue after a restart), without moving
        ``position``."""
        wanted, out = sorted(set(indices)), []
        if self._rows is not None:
            return [self._prompt(self._rows[i % len(self._rows)], i) for i in wanted]
        rows = demo_rows(self._demo[0], seed=self._demo[1])  # an endless stream: one pass up to the last index
        for i, row in enumerate(itertools.islice(rows, wanted[-1] + 1 if wanted else 0)):
            if i == wanted[len(out)]:
                out.append(self._prompt(row, i))
        return out
