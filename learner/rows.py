"""Dataset rows to prompts: the columns mapped by config, chat messages through the chat template, and the
prompt-length rule (verl's ``max_prompt_length``, ``truncation``, ``filter_overlong_prompts``).

A row's prompt column is a string (sent as it is) or a list of ``{role, content}`` messages, rendered
with the policy tokenizer's chat template and the generation prompt. Rollout servers encode either text by
the one rule of :mod:`tether.prompts` (BOS where the tokenizer adds one and the text does not already spell
it, never a trailing EOS); the learner counts and truncates by the same rule. The reward context is every other
column as a string (JSON for lists and structs, as verl's ``reward_model``/``extra_info``), plus
``answer`` (``learner.answer_key``; by default ``answer``, else ``reward_model.ground_truth``) and
``data_source`` (``learner.data_source_key``), the two keys scorers and evaluation read.

**The prompt limit** is the one rollout servers enforce: ``learner.max_prompt_length``, empty meaning
``rollout.max_prompt_len`` (:attr:`TetherConfig.prompt_limit`), capped at the model's context - 1 as
servers cap it (``model.max_model_len``, else the model config's ``max_position_embeddings``), so nothing the
learner issues is refused for its length. Every prompt is rendered and tokenized once at start
(:meth:`RowFormat.scan`; counted by :func:`tether.prompts.count_prompt_tokens` through the fast tokenizer's own
``encode_batch``): about 0.2 ms a GSM8K-sized row on 2 busy cores (docs/DATA.md). Left truncation keeps the
leading BOS: the prompt loses its oldest text, not the token the model expects first.

The tokenizer is loaded from ``model.path`` only when a row needs it (chat messages, the length check).
Without a model path (tools reading a dataset alone; no learner runs so) the followed limit is not checked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import numpy as np

from learner.datasets import DataError, Table
from tether.config import TetherConfig
from tether.prompts import count_prompt_tokens, encode_prompt, prompt_prefix, render_chat
from tether.scorers import unrouted
from tether.v1.trajectory_pb2 import Prompt

DEFAULT_ANSWER_KEYS = ("answer", "reward_model.ground_truth")
SCAN_ROWS = 1024


def lookup(row: dict[str, Any], key: str) -> Any:
    """``row[key]``; ``a.b`` reads field ``b`` of a struct column ``a``; None when absent."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def model_context(cfg: TetherConfig) -> int:
    """Prompt + completion tokens the model takes, as the transformers engine reads it
    (:meth:`ModelConfig.context_length`); the model folder's config is read only when it is needed."""
    if cfg.model.max_model_len:
        return cfg.model.max_model_len
    from transformers import AutoConfig

    m = cfg.model
    return m.context_length(AutoConfig.from_pretrained(m.path, trust_remote_code=m.trust_remote_code))


def prompt_limit(cfg: TetherConfig) -> tuple[int, str, str]:
    """The longest prompt the rollout servers accept — ``min(limit, context - 1)``, as
    :func:`rollout_server.validation.check_length` computes it — the setting that sets it, and words saying so."""
    limit, key = cfg.prompt_limit
    context = model_context(cfg)
    if context - 1 < limit:
        key = "model.max_model_len"
        source = key if cfg.model.max_model_len else f"the max_position_embeddings of {cfg.model.path}"
        return context - 1, key, f"the model's context of {context} tokens ({source}) less one"
    if key == "rollout.max_prompt_len":
        return limit, key, "rollout.max_prompt_len; learner.max_prompt_length follows it"
    return limit, key, key


class RowFormat:
    def __init__(self, cfg: TetherConfig, *, what: str) -> None:
        lc = cfg.learner
        self.what, self.model_path = what, cfg.model.path
        self.prompt_key, self.answer_key, self.source_key = lc.prompt_key, lc.answer_key, lc.data_source_key
        self.truncation, self.filter = lc.truncation, lc.filter_overlong_prompts
        self._cfg = cfg
        self._tokenizer: Any = None

    @cached_property
    def limit(self) -> tuple[int | None, str, str]:
        """The prompt limit: tokens (:func:`prompt_limit`, read from the model folder at first use), the setting
        that sets them and words for a message; ``(None, "", "")`` when not checked (no model path and no
        ``learner.max_prompt_length`` asked for)."""
        cfg = self._cfg
        if cfg.model.path:
            return prompt_limit(cfg)
        if cfg.learner.max_prompt_length is not None:  # asked for: the missing tokenizer is an error
            limit, key = cfg.prompt_limit
            return limit, key, key
        return None, "", ""

    @property
    def max_len(self) -> int | None:
        return self.limit[0]

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if not self.model_path:
                raise DataError(f"{self.what}: chat-message prompts and the prompt-length check "
                             "(learner.max_prompt_length) need the policy's tokenizer — set model.path")  # fmt: skip
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    def check_columns(self, table: Table, spec: str) -> None:
        missing = [
            k.split(".")[0] for k in (self.prompt_key, self.answer_key) if k and k.split(".")[0] not in table.columns
        ]
        if missing:
            raise DataError(f"{self.what}: {spec} has no column {missing[0]!r} (columns: {', '.join(table.columns)}) "
                             "— set learner.prompt_key / learner.answer_key")  # fmt: skip

    def text(self, row: dict[str, Any], index: int) -> str:
        value = row.get(self.prompt_key)
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in value):  # fmt: skip
            tok = self.tokenizer
            if not getattr(tok, "chat_template", None):
                raise DataError(f"{self.what}: row {index}: the prompt is chat messages but the tokenizer of "
                                 f"{self.model_path} has no chat template — add one (chat_template in "
                                 "tokenizer_config.json) or give the prompts as text")  # fmt: skip
            return render_chat(tok, value)
        raise DataError(f"{self.what}: row {index}: {self.prompt_key!r} is {type(value).__name__}, not a string "
                         "or a list of chat messages ({role, content})")  # fmt: skip

    def context(self, row: dict[str, Any]) -> dict[str, str]:
        ctx = {k: as_text(v) for k, v in row.items() if k != self.prompt_key and v is not None}
        for key in (self.answer_key,) if self.answer_key else DEFAULT_ANSWER_KEYS:
            answer = lookup(row, key)
            if answer is not None:
                ctx["answer"] = as_text(answer)
                break
        source = row.get(self.source_key)
        if source is not None:
            ctx["data_source"] = as_text(source)
        return ctx

    def ids(self, text: str) -> list[int]:
        """``text``'s ids as rollout servers encode a prompt (:func:`tether.prompts.encode_prompt`)."""
        return encode_prompt(self.tokenizer, text)

    def prompt(self, row: dict[str, Any], index: int, *, prompt_id: str) -> Prompt:
        text = self.text(row, index)
        token_ids: list[int] = []
        # Only truncation can leave an overlong prompt here: scan() refused or filtered the others.
        if self.max_len is not None and self.truncation != "error" and not self.filter:
            ids = self.ids(text)
            if len(ids) > self.max_len:  # only reached with truncation left/right: scan() refused the rest
                token_ids = self.truncate(ids)
        return Prompt(prompt_id=prompt_id, dataset_index=index, text=text, token_ids=token_ids,
                      reward_context=self.context(row))  # fmt: skip

    def truncate(self, ids: list[int]) -> list[int]:
        """An overlong prompt cut to ``max_len`` on the configured side; from the left, the leading BOS (the
        tokenizer's prompt prefix) stays and the text after it is cut."""
        assert self.max_len is not None
        if self.truncation != "left":
            return ids[: self.max_len]
        prefix = prompt_prefix(self.tokenizer)
        keep = len(prefix) if prefix and tuple(ids[: len(prefix)]) == prefix and len(prefix) < self.max_len else 0
        return ids[:keep] + ids[len(ids) - (self.max_len - keep) :]

    def lengths(self, texts: list[str]) -> list[int]:
        """Token counts of ``texts`` as the servers encode them (:func:`tether.prompts.count_prompt_tokens`)."""
        return count_prompt_tokens(self.tokenizer, texts)

    def scan(self, table: Table, spec: str) -> tuple[np.ndarray | None, int]:
        """Check every prompt against the limit once, at start: ``(kept, overlong)`` — ``kept`` a mask of the
        rows to use (None: all) and the count of prompts over the limit. With truncation ``error`` (and no
        filtering) the first overlong row is an error that names it and the setting."""
        if self.max_len is None:
            return None, 0
        kept = np.ones(table.num_rows, dtype=bool) if self.filter else None
        overlong = 0
        for lo, rows in _chunks(table.rows(0)):
            lengths = self.lengths([self.text(r, lo + j) for j, r in enumerate(rows)])
            for j, n in enumerate(lengths):
                if n <= self.max_len:
                    continue
                overlong += 1
                if kept is not None:
                    kept[lo + j] = False
                elif self.truncation == "error":
                    raise DataError(f"{self.what}: row {lo + j} of {spec} is {n} tokens, over the prompt limit "
                                     f"of {self.max_len} ({self.limit[2]}) — raise {self.limit[1]}"
                                     ", or set learner.truncation: left or right, or learner.filter_overlong_prompts:"
                                     " true")  # fmt: skip
        return kept, overlong

    def sources(self, table: Table) -> set[str]:
        if self.source_key not in table.columns:
            return set()
        return {as_text(v) for v in table.column(self.source_key) if v is not None}


def _chunks(rows: Iterator[dict[str, Any]]) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    lo, chunk = 0, []
    for row in rows:
        chunk.append(row)
        if len(chunk) == SCAN_ROWS:
            yield lo, chunk
            lo, chunk = lo + len(chunk), []
    if chunk:
        yield lo, chunk


def check_scorers(cfg: TetherConfig, sources: set[str], *, what: str, spec: str, source_key: str) -> None:
    """With rewards routed by data source, every source of the dataset needs a scorer: fail at start."""
    reward = cfg.rollout.reward
    if reward.type != "data_source":
        return
    if not sources:
        raise DataError(f"{what}: {spec} has no {source_key!r} column (learner.data_source_key), but "
                         "rollout.reward.type is data_source — set the column or another reward type")  # fmt: skip
    missing = unrouted(sources, reward.scorers)
    if missing:
        raise DataError(f"{what}: no scorer for data_source {missing[0]!r}"
                         f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''} — add it to "
                         f"rollout.reward.scorers, e.g. {{{missing[0]!r}: math}} (gsm8k, math, math_any, "
                         "exact_match, demo or remote)")  # fmt: skip
