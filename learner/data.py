"""The prompt source of learner rank 0: dataset rows or a built-in demo task, in a resumable order.

Nothing is tokenized for rollout here: servers tokenize with the engine's tokenizer, so a ``Prompt``
carries the text (chat messages already rendered by :mod:`learner.rows`) and a ``reward_context``; only a
prompt truncated to the prompt limit (``learner.max_prompt_length``, by default ``rollout.max_prompt_len``)
carries its token ids. The source is an iterator whose ``position`` is the index of the next row; the
buffer's ``feed`` never pulls more than it issues, so ``position`` is exactly the dataset position a
checkpoint must keep. A dataset is repeated in epochs (row ``i`` is row ``i mod n``) and streamed from the
position (:mod:`learner.datasets`), never loaded whole; rows filtered for length are stepped over, so the
position stays a row index. A demo task is an endless stream (its prompts are a few tokens: not checked).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from learner.datasets import DataError, open_table
from learner.rows import RowFormat, check_scorers
from tether.config import TetherConfig
from tether.logs import get_logger
from tether.tasks import demo_rows
from tether.v1.trajectory_pb2 import Prompt

log = get_logger(__name__)


def demo_prompt(row: dict[str, str], index: int, *, prompt_id: str) -> Prompt:
    """A built-in task's row as a prompt; a ``max_tokens`` in the row (``demo:longtail``) caps its completions."""
    context = {k: v for k, v in row.items() if k not in ("prompt", "max_tokens")}
    context["data_source"] = row["task"]
    cap = int(row.get("max_tokens", 0))
    return Prompt(prompt_id=prompt_id, dataset_index=index, text=row["prompt"], max_tokens=cap, reward_context=context)


class PromptSource(Iterator[Prompt]):
    """Endless prompts from ``learner.data_path`` starting at ``start`` (the checkpointed position)."""

    def __init__(self, cfg: TetherConfig, *, start: int = 0) -> None:
        spec = cfg.learner.data_path
        self.position = start
        self.overlong = 0
        if not spec:
            raise DataError("learner.data_path is empty: give a dataset file or folder, or demo:charclass")
        if spec.startswith("demo:"):
            self.table = None
            self._demo = (spec.split(":", 1)[1], cfg.run.seed)
            check_scorers(cfg, {self._demo[0]}, what="learner.data_path", spec=spec, source_key="task")
            self._stream = enumerate(itertools.islice(demo_rows(self._demo[0], seed=self._demo[1]), start, None), start)
            return
        what = "learner.data_path"
        self.table = open_table(spec, what=what)
        self.format = RowFormat(cfg, what=what)
        self.format.check_columns(self.table, spec)
        check_scorers(
            cfg, self.format.sources(self.table), what=what, spec=spec, source_key=cfg.learner.data_source_key
        )
        self.kept, self.overlong = self.format.scan(self.table, spec)
        limit, _, words = self.format.limit
        if self.kept is not None and not self.kept.any():
            raise DataError(f"{what}: every prompt of {spec} is over the prompt limit of {limit} ({words}) and "
                             "filtered out (learner.filter_overlong_prompts) — raise the limit")  # fmt: skip
        filtered = 0 if self.kept is None else int((~self.kept).sum())
        log.info("dataset_opened", path=spec, rows=self.table.num_rows, prompts_filtered=filtered,
                 prompts_truncated=self.overlong - filtered, prompt_limit=limit, position=start)  # fmt: skip
        if filtered:
            log.warning("prompts_filtered", path=spec, filtered=filtered, kept=self.table.num_rows - filtered,
                        prompt_limit=limit, limit_set_by=words)  # fmt: skip
        self._stream = self._epochs(start)

    @property
    def filtered(self) -> int:
        """Rows of the dataset never issued because their prompt is over the prompt limit."""
        return 0 if self.table is None or self.kept is None else int((~self.kept).sum())

    def _epochs(self, start: int) -> Iterator[tuple[int, dict[str, Any]]]:
        n, i = self.table.num_rows, start
        while True:
            for row in self.table.rows(i % n):
                yield i, row
                i += 1

    def _prompt(self, row: dict[str, Any], index: int) -> Prompt:
        if self.table is None:
            return demo_prompt(row, index, prompt_id=f"p{index}")
        return self.format.prompt(row, index, prompt_id=f"p{index}")

    def __next__(self) -> Prompt:
        while True:
            index, row = next(self._stream)
            self.position = index + 1
            if self.table is None or self.kept is None or self.kept[index % self.table.num_rows]:
                return self._prompt(row, index)

    def prompts_at(self, indices: list[int]) -> list[Prompt]:
        """The prompts at these dataset positions, in order (to reissue after a restart), without moving
        ``position``."""
        wanted = sorted(set(indices))
        if self.table is not None:
            n = self.table.num_rows
            by_row = sorted(wanted, key=lambda i: i % n)
            rows = dict(zip(by_row, self.table.take([i % n for i in by_row]), strict=True))
            return [self._prompt(rows[i], i) for i in wanted]
        out: list[Prompt] = []
        rows = demo_rows(self._demo[0], seed=self._demo[1])  # an endless stream: one pass up to the last index
        for i, row in enumerate(itertools.islice(rows, wanted[-1] + 1 if wanted else 0)):
            if i == wanted[len(out)]:
                out.append(self._prompt(row, i))
        return out


def check_datasets(cfg: TetherConfig) -> None:
    """What ``tether up`` checks before starting anything: each dataset opens, has its columns, and every
    data source in it has a scorer (the prompt-length rule is left to the learner: it tokenizes every row)."""
    for what, spec in (
        ("learner.data_path", cfg.learner.data_path),
        ("learner.val_data_path", cfg.learner.val_data_path),
    ):
        if not spec:
            continue
        if spec.startswith("demo:"):
            check_scorers(cfg, {spec.split(":", 1)[1]}, what=what, spec=spec, source_key="task")
            continue
        table = open_table(spec, what=what, split="train" if what == "learner.data_path" else "test")
        fmt = RowFormat(cfg, what=what)
        fmt.check_columns(table, spec)
        check_scorers(cfg, fmt.sources(table), what=what, spec=spec, source_key=cfg.learner.data_source_key)
