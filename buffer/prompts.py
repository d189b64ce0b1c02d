"""The prompts stream: learner rank 0 feeds it in dataset order, rollout servers share it.

Admission control lives here because the feed is the one place that sees both the data order and
the policy version: the total ever issued stays ≤ (max_staleness + version + 1)·B (AReaL's rule), so
no prompt can come back more than ``max_staleness`` versions late and ``max_staleness: 0`` is
synchronous. The issued total is a Redis counter, written in the same transaction as the entries, so
it is the dataset position a checkpoint records. Rollout servers read with consumer group
``rollout``; prompts a dead server held are reclaimed after ``claim_idle_ms`` (XAUTOCLAIM).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import redis
from google.protobuf.message import DecodeError

from buffer.dead_letter import ROLLOUT_DEAD_LETTER
from buffer.keys import PROMPT_GROUP, RedisKeys
from buffer.policy import DROPPED_STALE, admission_allowance
from buffer.replies import text
from buffer.scripts import Scripts, ensure_group
from buffer.settle import Settlement
from tether.logs import get_logger
from tether.v1.trajectory_pb2 import Prompt

log = get_logger(__name__)

_F_PROMPT = b"p"
_F_VERSION = b"v"  # the version the prompt was issued at (also inside the prompt): read without parsing it
_ISSUED = "prompts_issued"
# Counters of prompts (or their groups) that ended without training data; see ``feed``.
# ROLLOUT_DEAD_LETTER: groups a rollout server dead-lettered (reward failed, bad prompt).
_WASTED = (DROPPED_STALE, "dead_letter", "prompts_dead_letter", ROLLOUT_DEAD_LETTER)


def _issued_at(fields: dict[bytes, bytes] | None) -> int:
    """The version an entry was issued at; one without it (written by hand) counts as never old."""
    raw = fields.get(_F_VERSION) if fields else None
    return int(raw) if raw is not None and raw.isdigit() else 2**62


class PromptQueue:
    def __init__(
        self,
        client: redis.Redis,
        keys: RedisKeys,
        *,
        claim_idle_ms: int = 60_000,
        max_deliveries: int | None = None,
        dead_letter_maxlen: int = 1000,
    ) -> None:
        self.client = client
        self.keys = keys
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self.dead_letter_maxlen = dead_letter_maxlen
        self._scripts = Scripts(client)
        self._claim_cursor = "0-0"
        self.admission: dict[str, int] = {}
        """After each :meth:`feed`: the issued total, the prompts given back to admission and the version
        the feed counted from (a background publication feeds at a newer one than the step's)."""
        ensure_group(client, keys.prompts, PROMPT_GROUP)

    # -- learner rank 0 ----------------------------------------------------------------------------------
    def issued(self) -> int:
        """Prompts issued in this run so far (the dataset position to checkpoint)."""
        return int(self.client.hget(self.keys.counters, _ISSUED) or 0)

    def feed(self, prompts: Iterator[Prompt], *, version: int, prompts_per_version: int, max_staleness: int) -> int:
        """Issue as many prompts from ``prompts`` as admission allows now (never pulling more from the
        iterator than it issues); how many were issued. Only one feeder per run (learner rank 0)."""
        # A prompt whose group was dropped as stale or dead-lettered will never be trained on, yet it
        # was counted as issued: left there, every such loss would shrink the prompts in flight for good,
        # and after (max_staleness + 1)·B of them the learner would wait forever for data. So those
        # prompts are given back to admission (the bound on prompts outstanding stays the same).
        raw = self.client.hmget(self.keys.counters, _ISSUED, *_WASTED)
        issued, wasted = int(raw[0] or 0), sum(int(v or 0) for v in raw[1:])
        allowed = admission_allowance(
            max(0, issued - wasted), version=version, prompts_per_version=prompts_per_version,
            max_staleness=max_staleness,
        )  # fmt: skip
        batch = list(itertools.islice(prompts, allowed))
        self.admission = {"prompts_issued": issued + len(batch), "prompts_given_back": wasted, "version": version}
        if not batch:
            return 0
        pipe = self.client.pipeline(transaction=True)  # entries and the issued counter move together
        for prompt in batch:
            if not prompt.issued_at_version:
                prompt.issued_at_version = version
            pipe.xadd(self.keys.prompts, {_F_PROMPT: prompt.SerializeToString(), _F_VERSION: prompt.issued_at_version})
        pipe.hincrby(self.keys.counters, _ISSUED, len(batch))
        pipe.execute()
        return len(batch)

    def reissue(self, prompts: list[Prompt], *, version: int) -> int:
        """Put back prompts that were issued before a restart and lost with Redis (see
        :func:`buffer.ledger.restore`): they are already in the issued count, so they do not count again."""
        if not prompts:
            return 0
        pipe = self.client.pipeline(transaction=True)
        for prompt in prompts:
            prompt.issued_at_version = version
            pipe.xadd(self.keys.prompts, {_F_PROMPT: prompt.SerializeToString(), _F_VERSION: version})
        pipe.hincrby(self.keys.counters, "prompts_reissued", len(prompts))
        pipe.execute()
        return len(prompts)

    def generating(self, *, issued_by: int) -> int:
        """Prompts issued at version ``issued_by`` or before that a rollout server has taken and not finished:
        their groups are being generated (or their server died and they wait to be reclaimed). An entry
        leaves the stream once its group is in the trajectories stream or it was dead-lettered; one never
        taken yet is left out (a server takes it with newer weights). The stream holds only what admission
        let out, so this is one short XRANGE and XPENDING."""
        entries = self.client.xrange(self.keys.prompts)
        old = {text(eid) for eid, fields in entries if _issued_at(fields) <= issued_by}
        if not old:
            return 0
        pending = self.client.xpending_range(self.keys.prompts, PROMPT_GROUP, min="-", max="+", count=len(entries))
        return sum(text(p["message_id"]) in old for p in pending)

    # -- rollout servers ----------------------------------------------------------------------------------
    def read(self, consumer: str, *, count: int = 1, block_ms: int = 1000) -> list[tuple[str, Prompt]]:
        """Up to ``count`` prompts: first ones a dead consumer left idle, then new ones (waiting ≤ block_ms)."""
        # XAUTOCLAIM scans a bounded slice of the pending list per call; keep the cursor so idle entries
        # deep in a long list are found over successive reads instead of rescanning the head forever.
        reply = self.client.xautoclaim(
            self.keys.prompts, PROMPT_GROUP, consumer, self.claim_idle_ms, self._claim_cursor, count=count
        )
        self._claim_cursor = text(reply[0])
        entries = [(text(i), f) for i, f in reply[1] if i is not None]
        if entries and self.max_deliveries is not None:
            entries = self._drop_over_delivered(consumer, entries)
        if not entries:
            got = self.client.xreadgroup(
                PROMPT_GROUP, consumer, {self.keys.prompts: ">"}, count=count, block=block_ms if block_ms > 0 else None
            )
            entries = [(text(i), f) for i, f in got[0][1]] if got else []
        out: list[tuple[str, Prompt]] = []
        bad = Settlement()
        for eid, fields in entries:
            prompt = Prompt()
            try:
                prompt.ParseFromString(fields[_F_PROMPT])
            except (DecodeError, KeyError, ValueError, TypeError) as e:  # not a Prompt: dead-letter, carry on
                bad.add("prompts_dead_letter", eid, nbytes=0, reason=f"undecodable prompt: {e!r}"[:500])
                continue
            out.append((eid, prompt))
        if bad:
            self._settle(bad, consumer)
        return out

    def _drop_over_delivered(self, consumer: str, entries: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
        pending = self.client.xpending_range(
            self.keys.prompts,
            PROMPT_GROUP,
            min=entries[0][0],
            max=entries[-1][0],
            count=len(entries),
            consumername=consumer,
        )
        counts = {text(p["message_id"]): int(p["times_delivered"]) for p in pending}
        keep, bad = [], Settlement()
        for eid, fields in entries:
            n = counts.get(eid, 1)
            if n > self.max_deliveries:
                bad.add("prompts_dead_letter", eid, nbytes=0, reason=f"delivered {n} times (max {self.max_deliveries})")
            else:
                keep.append((eid, fields))
        if bad:
            self._settle(bad, consumer)
        return keep

    def ack(self, entry_ids: list[str]) -> None:
        """Done with these prompts (their groups are in the trajectories stream): acknowledge and delete."""
        done = Settlement()
        for eid in entry_ids:
            done.add("prompts_done", eid, nbytes=0)
        self._settle(done, "")

    def _settle(self, settlement: Settlement, consumer: str) -> None:
        settlement.send(
            self.client,
            self._scripts,
            self.keys,
            stream=self.keys.prompts,
            group=PROMPT_GROUP,
            consumer=consumer,
            dead_letter_maxlen=self.dead_letter_maxlen,
        )
