"""Rank 0's record of what the model generated, for ``tether view``: a bounded sample of the groups each
logged step trained on, and the newest dead letters, in the run folder (files and caps:
:mod:`tether.records`).

Each logged step (every ``learner.log_generations_every`` steps; the interval doubles each time the file is
thinned to stay within ``learner.generations_max_mb``) writes ``learner.log_train_generations`` of the
step's groups, spread evenly over its batch: prompt and completion token ids (the viewer decodes them with
the run's tokenizer, so the learner loads none), each completion token's policy version and behaviour
log-prob, the loss mask where it is not all ones, reward and components, finish reason, the advantage the
completion trained with, the group's staleness, server and learner version, and its data source and
reward context (the dataset row's, looked up by the group's dataset index; a demo task's name).

The advantages are the ones the loss used: the trainer hands over the step's samples
(:attr:`learner.trainer.Trainer.trained_samples`, each knowing its group and trajectory), whatever the
estimator — a whitening one, or a critic's GAE (per token: the record keeps their mean over the trained
tokens). A trajectory the step skipped (aborted, too long, ...) has none. The record is made on a thread of
its own, one step at a time: a step that comes while the last one is still being written is not logged
(the training thread spends ~0.1 ms on a logged step). Only the dataset-row lookup runs on the training
thread, where the prompt feed reads the same dataset.

Dead letters: at most every :data:`DEAD_LOOK_EVERY_S` seconds (on a logged step) and at the end, the
entries the run's dead-letter stream received since the last look, the newest :data:`DEAD_PER_LOOK` of
them, with their reason, where they came from, and what of their group or prompt decodes (completions cut
at :data:`DEAD_TOKENS` tokens).

Best-effort like every telemetry sink: a failure warns once and turns the record off; training goes on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import redis

from buffer import BufferedGroup
from buffer.codec import CODEC_COLUMNAR, decode_group_payload
from buffer.columnar import MAGIC
from buffer.keys import RedisKeys
from buffer.replies import text
from learner.packing import Sample
from tether.config import TetherConfig
from tether.logs import get_logger
from tether.records import (
    DEAD_LETTER_SHARE,
    DEAD_LETTERS,
    GENERATIONS,
    GenerationsFile,
    NewestFile,
    RecordTooLarge,
)
from tether.trajectory import GroupData, TrajectoryData
from tether.v1 import trajectory_pb2 as pb

log = get_logger(__name__)

DEAD_LOOK_EVERY_S = 5.0
"""Seconds between looks at the dead-letter stream at most (one Redis round trip when nothing is new)."""
DEAD_PER_LOOK = 50
"""Dead letters copied per look at most (the newest, when more came)."""
DEAD_TOKENS = 256
"""Completion tokens kept of each dead-lettered trajectory."""
CONTEXT_CHARS = 500
"""Characters kept of each reward-context value (a reference answer, a test case)."""


def spread(n: int, k: int) -> list[int]:
    """``min(n, k)`` indices spread evenly over ``range(n)``, first one included."""
    return [i * n // k for i in range(k)] if k < n else list(range(n))


def finish_name(code: int) -> str:
    try:
        return pb.FinishReason.Name(code).removeprefix("FINISH_REASON_").lower()
    except ValueError:
        return str(code)


def trained_advantages(samples: list[Sample]) -> dict[tuple[int, int], float]:
    """``(group index, trajectory index) -> advantage`` of each sample the step trained on: the mean over its
    trained tokens (one per-token advantage each with a critic's GAE; the sample's one value otherwise)."""
    out: dict[tuple[int, int], float] = {}
    for s in samples:
        adv, mask = np.asarray(s.advantage, dtype=np.float64), s.loss_mask > 0
        out[s.group, s.trajectory] = float(adv[mask].mean()) if adv.ndim and mask.any() else float(np.mean(adv))
    return out


def _sample(t: TrajectoryData, adv: float | None) -> dict[str, Any]:
    versions = t.policy_versions
    rec: dict[str, Any] = {
        "ids": t.completion_token_ids.tolist(),
        # one number when every token has the same version (the usual case): a third of the line saved
        "v": int(versions[0]) if versions.size and (versions == versions[0]).all() else versions.tolist(),
        "lp": np.round(t.behavior_logprobs.astype(np.float64), 3).tolist(),
        "reward": float(t.reward),
        "finish": finish_name(t.finish_reason),
        "adv": None if adv is None else round(adv, 4),
    }
    if t.loss_mask.size and not t.loss_mask.all():
        rec["mask"] = t.loss_mask.tolist()
    if t.reward_components:
        rec["components"] = {k: float(v) for k, v in t.reward_components.items()}
    return rec


class GenerationLog:
    """The sample's writer on learner rank 0 (built once; :meth:`trained` after each step, :meth:`close` at
    the end)."""

    def __init__(self, cfg: TetherConfig, root: Path, *, client: redis.Redis, keys: RedisKeys, source: Any) -> None:
        lc = cfg.learner
        self.cfg, self.client, self.keys = cfg, client, keys
        self.source = source  # learner.data.PromptSource, or None (episodes only)
        self.k = lc.log_train_generations
        cap = int(lc.generations_max_mb * 2**20)
        self.groups = GenerationsFile(root / GENERATIONS, max_bytes=cap, every=lc.log_generations_every)
        self.dead = NewestFile(root / DEAD_LETTERS, max_bytes=cap // DEAD_LETTER_SHARE)
        last = self.dead.last()
        self.dead_after = str(last.get("id", "")) if last else ""  # a resumed run goes on from its last copy
        self.looked_at = -math.inf  # time.monotonic() of the last look at the dead letters
        self.on = self.k > 0
        self.step = 0  # the last step trained
        self.busy_skips = 0
        """Due steps not logged because the previous one was still being written."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generation-log") if self.on else None
        self._job: Future | None = None

    def trained(self, batch: list[BufferedGroup], samples: list[Sample], *, step: int, version: int) -> None:
        """After step ``step`` (trained at learner version ``version``) on ``batch``, whose trained ``samples``
        carry the advantages the loss used: its record, if due."""
        self.step = step
        if not self.on or not batch or not self.groups.due(step):
            return
        if self._job is not None and not self._job.done():
            self.busy_skips += 1
            return
        try:
            self._reap()
            picked = spread(len(batch), self.k)
            contexts = {gi: self._context(batch[gi].group) for gi in picked}
            if time.monotonic() - self.looked_at >= DEAD_LOOK_EVERY_S:
                self.look_at_dead_letters(step=step)
        except Exception as e:  # a record for people: never worth a training step
            self._off(e)
            return
        assert self._pool is not None
        self._job = self._pool.submit(self._write, batch, samples, picked, contexts, step=step, version=version)

    def flush(self) -> None:
        """Wait until the step being written is in the file."""
        if self._job is not None:
            wait([self._job])

    def close(self) -> None:
        """At the learner's end: the step being written, then the dead letters since the last look."""
        if self._pool is None:
            return
        self._pool.shutdown(wait=True)
        if self.on:
            try:
                self._reap()
                self.look_at_dead_letters(step=self.step)
            except Exception as e:
                self._off(e)
        if self.busy_skips:
            log.info("generation_log_busy", steps_not_logged=self.busy_skips)

    def _reap(self) -> None:
        """Raise what the last write raised (its step is lost; the record goes on if it was only too big)."""
        job, self._job = self._job, None
        error = job.exception() if job is not None else None
        if isinstance(error, RecordTooLarge):
            log.warning("generation_log_step_skipped", reason=str(error))
        elif error is not None:
            raise error

    def _off(self, error: BaseException) -> None:
        log.warning("generation_log_disabled", error=repr(error), folder=str(self.groups.path.parent))
        self.on = False

    def _write(
        self, batch: list[BufferedGroup], samples: list[Sample], picked: list[int], contexts: dict[int, dict], *,
        step: int, version: int,
    ) -> None:  # fmt: skip
        """On the writer's thread: the records of the ``picked`` groups of step ``step``."""
        advantages = trained_advantages(samples)
        records = []
        for gi in picked:
            b, context = batch[gi], dict(contexts[gi])
            trajs = b.group.trajectories
            records.append({
                "version": version,
                "staleness": b.staleness,
                "group_id": b.group.group_id,
                "server": trajs[0].server_id if trajs else "",
                "data_source": context.pop("data_source", ""),
                "context": context,
                "meta": dict(b.group.metadata),
                "prompt": trajs[0].prompt_token_ids.tolist() if trajs else [],
                "samples": [_sample(t, advantages.get((gi, ti))) for ti, t in enumerate(trajs)],
            })  # fmt: skip
        written = self.groups.append(step, records)
        if self.groups.thinned:
            log.info("generation_log_thinned", every=self.groups.every, bytes=self.groups.size, written=written)
            self.groups.thinned = 0

    def _context(self, group: GroupData) -> dict[str, str]:
        """The reward context of the dataset row the group answers (data source, reference answer)."""
        index = group.metadata.get("dataset_index")
        if index is None or self.source is None or not index.isdigit():
            return {}
        if self.source.table is None:  # a demo task: rows are generated, not looked up; its name is the source
            return {"data_source": self.cfg.learner.data_path.split(":", 1)[1]}
        (prompt,) = self.source.prompts_at([int(index)])
        return {k: v[:CONTEXT_CHARS] for k, v in sorted(prompt.reward_context.items())[:16]}

    def look_at_dead_letters(self, *, step: int) -> None:
        """Copy the dead letters that came since the last look (the newest :data:`DEAD_PER_LOOK`)."""
        self.looked_at = time.monotonic()
        low = f"({self.dead_after}" if self.dead_after else "-"
        entries = self.client.xrevrange(self.keys.dead_letter, max="+", min=low, count=DEAD_PER_LOOK)
        if not entries:
            return
        self.dead_after = _text(entries[0][0])
        records = [
            dead_record(_text(eid), fields, step=step, context=self._context) for eid, fields in reversed(entries)
        ]
        self.dead.append(records)


def _text(raw: bytes | str | None) -> str:
    """A dead letter's field as text ("" where it is missing), undecodable bytes replaced."""
    return "" if raw is None else text(raw, errors="replace")


def dead_record(
    entry_id: str, fields: dict, *, step: int, context: Callable[[GroupData], dict[str, str]] | None = None
) -> dict[str, Any]:
    """One dead-letter entry as the viewer shows it: reason, origin, and what of its payload decodes (with
    ``context``, a group's data source and reward context, as for a trained group)."""
    f = {_text(k): v for k, v in fields.items()}
    stream = _text(f.get("stream")).rsplit(":", 1)[-1]
    origin = _text(f.get("source")) or " ".join(x for x in (stream, _text(f.get("consumer"))) if x)
    rec: dict[str, Any] = {
        "id": entry_id,
        "step": step,
        "time": int(entry_id.split("-", 1)[0]) / 1000 if entry_id.split("-", 1)[0].isdigit() else None,
        "reason": _text(f.get("reason")),
        "origin": origin,
        "group_id": _text(f.get("g")),
    }
    group, prompt = _payload(f, rec["reason"])
    if group is not None:
        trajs = group.trajectories
        rec["group_id"] = group.group_id or rec["group_id"]
        rec["server"] = trajs[0].server_id if trajs else ""
        if context is not None:
            ctx = context(group)
            rec["data_source"], rec["context"] = ctx.pop("data_source", ""), ctx
        rec["prompt"] = trajs[0].prompt_token_ids.tolist() if trajs else []
        rec["samples"] = [
            {"ids": t.completion_token_ids[:DEAD_TOKENS].tolist(), "reward": float(t.reward),
             "finish": finish_name(t.finish_reason), "cut": max(0, t.num_completion_tokens - DEAD_TOKENS)}
            for t in trajs
        ]  # fmt: skip
    elif prompt is not None:
        rec["prompt_text"] = prompt.text[: 4 * CONTEXT_CHARS]
        if prompt.token_ids:
            rec["prompt"] = list(prompt.token_ids)
        rec["data_source"] = prompt.reward_context.get("data_source", "")
    return rec


def _payload(f: dict, reason: str) -> tuple[GroupData | None, pb.Prompt | None]:
    """The group or prompt a dead letter carries, whichever decodes (neither: an unreadable payload)."""
    try:
        if "c" in f and "d" in f:  # a trajectories-stream entry with its payload
            return decode_group_payload(f["c"], f["d"])[0], None
        raw = f.get("p") or f.get("data")
        if not raw:
            return None, None
        if "p" not in f and "bad prompt" not in reason and raw[:3] == MAGIC:  # a rollout server's group
            try:
                group = decode_group_payload(CODEC_COLUMNAR, raw)[0]
                if group.trajectories:
                    return group, None
            except Exception:  # not a group: read as a prompt below
                pass
        return None, pb.Prompt.FromString(raw)
    except Exception:  # what could not be decoded is shown by its reason alone
        return None, None
