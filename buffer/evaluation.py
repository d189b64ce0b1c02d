"""Evaluation traffic: held-out prompts out to rollout servers, scored samples back to learner rank 0.

Evaluation must never change what is trained or how training is counted, so it has its own two streams
(``RedisKeys.val_prompts`` / ``val_results``) and touches neither the prompts stream (admission control),
the trajectories stream nor the counters hash. Rollout servers read ``val_prompts`` with their own consumer
group (``rollout-val``) before each training prompt, so evaluation is not starved by training work. A
server writes one result per prompt — the rewards of its ``n`` samples and the policy versions that made
them, as JSON — and acknowledges the prompt in the same transaction. The learner reads results with XRANGE
and deletes what it read: it is the only reader, and a round that never completes is closed by the
learner's timeout with the missing prompts counted, so nothing here needs a pending list on that side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import redis
from google.protobuf.message import DecodeError

from buffer.keys import VALIDATION_GROUP, RedisKeys
from buffer.replies import text
from buffer.scripts import ensure_group
from tether.v1.trajectory_pb2 import Prompt

_F_PROMPT, _F_ROUND, _F_VERSION, _F_N, _F_TEMP, _F_MAXTOK = b"p", b"r", b"v", b"n", b"t", b"m"


@dataclass
class ValPrompt:
    """One evaluation prompt as a rollout server sees it: sample ``n`` at ``temperature``, score, report."""

    entry_id: str
    prompt: Prompt
    round: int
    version: int
    n: int
    temperature: float
    max_tokens: int


@dataclass
class ValResult:
    """Scored samples of one evaluation prompt (``rewards`` empty and ``error`` set when it failed)."""

    round: int
    index: int
    version: int
    rewards: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tokens: int = 0
    server_id: str = ""
    error: str = ""

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, raw: bytes | str) -> ValResult:
        return cls(**json.loads(raw))


class ValidationQueue:
    def __init__(self, client: redis.Redis, keys: RedisKeys, *, claim_idle_ms: int = 60_000) -> None:
        self.client = client
        self.keys = keys
        self.claim_idle_ms = claim_idle_ms
        ensure_group(client, keys.val_prompts, VALIDATION_GROUP)

    # -- learner rank 0 ----------------------------------------------------------------------------------
    def issue(self, prompts: list[Prompt], *, round_id: int, version: int, n: int, temperature: float,
              max_tokens: int) -> None:  # fmt: skip
        """Put one evaluation round on the stream; ``Prompt.dataset_index`` is the index within the round."""
        pipe = self.client.pipeline(transaction=True)
        for prompt in prompts:
            fields = {_F_PROMPT: prompt.SerializeToString(), _F_ROUND: round_id, _F_VERSION: version, _F_N: n,
                      _F_TEMP: repr(float(temperature)), _F_MAXTOK: max_tokens}  # fmt: skip
            pipe.xadd(self.keys.val_prompts, fields)
        pipe.execute()

    def take_results(self, count: int = 1000) -> list[ValResult]:
        """Every result written so far (up to ``count``), removed from the stream as it is returned."""
        entries = self.client.xrange(self.keys.val_results, "-", "+", count=count)
        if not entries:
            return []
        self.client.xdel(self.keys.val_results, *[eid for eid, _ in entries])
        out = []
        for _, fields in entries:
            try:
                out.append(ValResult.from_json(fields[b"j"]))
            except (KeyError, TypeError, ValueError):
                continue  # not ours to interpret; a round missing it is counted as missing
        return out

    def pending_prompts(self) -> int:
        return int(self.client.xlen(self.keys.val_prompts))

    # -- rollout servers ----------------------------------------------------------------------------------
    def read(self, consumer: str, *, count: int = 1, block_ms: int = 0) -> list[ValPrompt]:
        """Up to ``count`` evaluation prompts: ones a dead server left idle, then new ones. ``block_ms`` 0
        returns at once (the worker checks here before every training prompt)."""
        reply = self.client.xautoclaim(
            self.keys.val_prompts, VALIDATION_GROUP, consumer, self.claim_idle_ms, "0-0", count=count
        )
        entries = [(i, f) for i, f in reply[1] if i is not None]
        if not entries:
            got = self.client.xreadgroup(VALIDATION_GROUP, consumer, {self.keys.val_prompts: ">"}, count=count,
                                         block=block_ms if block_ms > 0 else None)  # fmt: skip
            entries = list(got[0][1]) if got else []
        out = []
        for eid, f in entries:
            try:
                prompt = Prompt()
                prompt.ParseFromString(f[_F_PROMPT])
                item = ValPrompt(text(eid), prompt, int(f[_F_ROUND]), int(f[_F_VERSION]), int(f[_F_N]),
                                 float(f[_F_TEMP]), int(f[_F_MAXTOK]))  # fmt: skip
            except (DecodeError, KeyError, ValueError, TypeError):
                self.client.xack(self.keys.val_prompts, VALIDATION_GROUP, eid)  # unusable: the learner counts it
                self.client.xdel(self.keys.val_prompts, eid)
                continue
            out.append(item)
        return out

    def finish(self, item: ValPrompt, result: ValResult) -> None:
        """Report ``result`` and acknowledge (and delete) its prompt, atomically."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.keys.val_results, {b"j": result.to_json()})
        pipe.xack(self.keys.val_prompts, VALIDATION_GROUP, item.entry_id)
        pipe.xdel(self.keys.val_prompts, item.entry_id)
        pipe.execute()
