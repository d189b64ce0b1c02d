"""The learner's side of the trajectories stream: at-least-once delivery, acknowledged after training.

The learner reads with consumer group ``learner`` and acknowledges an entry only after the optimizer
step that used it, so a learner killed in between gets the entry again: :meth:`TrajectoryReader.recover`
takes back its own unacknowledged entries on restart, and entries left pending by a consumer that
vanished are claimed (XAUTOCLAIM) once idle for ``claim_idle_ms``. Every entry ends in exactly one
counter — ``acknowledged``, ``dropped_stale`` (groups of prompts the learner issued, whose drop gives
an admission slot back), ``dropped_stale_env`` (other groups: custom environments' episodes, which no
prompt admitted) or ``dead_letter`` — so produced = those + what is still in the stream, and nothing is
lost silently. Stale groups are dropped from their header alone, before
any fetching or decoding. A read is one XREADGROUP for the small entry headers and one MGET for the
payloads worth decoding (:mod:`buffer.scripts` says why payloads live in their own keys); an ack is
one script call that also deletes the payloads, with the ``consumed`` bookkeeping piggy-backed on it.

What is available is taken oldest first (by the header's oldest policy version), not in arrival order: a
long completion arrives after shorter ones admitted later, and read in arrival order it waited behind
them until it was too old to train on. Groups a caller read but did not use (:meth:`give_back`) come back
on the next read, checked for staleness again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import redis

from buffer.codec import F_DATA, EntryHeader, decode_group_columnar, read_header
from buffer.keys import LEARNER_GROUP, RedisKeys
from buffer.lengths import clean_counts, encode_counts
from buffer.policy import stale_counter, staleness_of
from buffer.replies import text
from buffer.scripts import Scripts, ensure_group
from buffer.settle import Settlement
from tether.config.buffer import BufferConfig
from tether.logs import get_logger
from tether.trajectory import GroupData, InvalidTrajectory

log = get_logger(__name__)


_RECOVER_PAGE = 256

Entry = tuple[str, dict[bytes, bytes] | None, int]  # (id, fields, times delivered)


@dataclass
class BufferedGroup:
    entry_id: str
    group: GroupData
    staleness: int
    # The group's columnar payload as read (its arrays are views into it): what the learner's rank 0
    # forwards to its other ranks without encoding again; b"" for a group not read from the buffer.
    columnar: bytes = b""


def _oldest_of(fields: dict[bytes, bytes] | None) -> int:
    """The header's oldest version, for ranking; unknown ranks first (it is settled or decoded at once)."""
    head = read_header(fields) if fields else None
    return -1 if head is None or head.oldest_version is None else head.oldest_version


class TrajectoryReader:
    def __init__(self, client: redis.Redis, keys: RedisKeys, cfg: BufferConfig, *, consumer: str = "learner-0") -> None:
        self.client = client
        self.keys = keys
        self.cfg = cfg
        self.consumer = consumer
        self._scripts = Scripts(client)
        self._backlog: deque[Entry] = deque()
        self._queued: set[str] = set()  # ids in _backlog: a reclaim must not queue one twice
        self._held: list[BufferedGroup] = []  # read, handed out, given back unused (still pending here)
        # entry id -> (payload bytes, staleness, nonce, lengths): what its ack books
        self._inflight: dict[str, tuple[int, int, str, str]] = {}
        self._consumed = 0  # delivered since the last flush; sent with the next settle (no extra round trip)
        self._next_claim = 0.0
        self._claim_every_s = min(1.0, cfg.claim_idle_ms / 2000)
        ensure_group(client, keys.trajectories, LEARNER_GROUP)

    # -- taking entries back -------------------------------------------------------------------------
    def recover(self) -> int:
        """Queue this consumer's read-but-unacknowledged entries, then idle ones of vanished consumers,
        to be returned by the next reads before anything new; how many were queued."""
        queued = 0
        start = "0"
        while True:
            reply = self.client.xreadgroup(
                LEARNER_GROUP, self.consumer, {self.keys.trajectories: start}, count=_RECOVER_PAGE
            )
            entries = reply[0][1] if reply else []
            if not entries:
                break
            queued += self._queue_with_deliveries(entries)
            start = text(entries[-1][0])
        queued += self._autoclaim()
        if queued:
            log.info("buffer_recovered", consumer=self.consumer, entries=queued)
        return queued

    def _autoclaim(self) -> int:
        self._next_claim = time.monotonic() + self._claim_every_s
        queued, start = 0, "0-0"
        while True:
            reply = self.client.xautoclaim(
                self.keys.trajectories, LEARNER_GROUP, self.consumer, self.cfg.claim_idle_ms, start, count=_RECOVER_PAGE
            )
            # Redis 6.2 reports entries deleted while pending as (None, None); 7.x drops them from the PEL.
            entries = [(i, f) for i, f in reply[1] if i is not None]
            queued += self._queue_with_deliveries(entries)
            start = text(reply[0])
            if start == "0-0":
                return queued

    def _queue_with_deliveries(self, entries: list[tuple[bytes, dict[bytes, bytes] | None]]) -> int:
        if not entries:
            return 0
        # An entry this reader already handed out (a learner step longer than claim_idle_ms) is in use,
        # not abandoned: queueing it again would train on it twice.
        entries = [(i, f) for i, f in entries if text(i) not in self._inflight and text(i) not in self._queued]
        if not entries:
            return 0
        ids = [text(i) for i, _ in entries]
        pending = self.client.xpending_range(
            self.keys.trajectories, LEARNER_GROUP, min=ids[0], max=ids[-1], count=len(ids), consumername=self.consumer
        )
        deliveries = {text(p["message_id"]): int(p["times_delivered"]) for p in pending}
        for eid, (_, fields) in zip(ids, entries, strict=True):
            self._backlog.append((eid, fields, deliveries.get(eid, 1)))
            self._queued.add(eid)
        return len(entries)

    # -- reading ---------------------------------------------------------------------------------------
    def read(
        self, n_groups: int, *, current_version: int, max_staleness: int, block_ms: int = 1000
    ) -> list[BufferedGroup]:
        """Up to ``n_groups`` usable groups, waiting at most about ``block_ms`` for them to arrive.

        Stale groups are acknowledged and counted as ``dropped_stale``; undecodable ones, and ones
        delivered more than ``max_deliveries`` times, go to the dead-letter stream with the reason.
        """
        out: list[BufferedGroup] = []
        try:
            self._read_into(out, n_groups, current_version=current_version, max_staleness=max_staleness,
                            block_ms=block_ms)  # fmt: skip
        except (redis.ConnectionError, redis.TimeoutError):
            # Groups already taken are in self._inflight, where reclaiming skips them: hand them over now,
            # or they would stay pending and unused for the life of this reader. The error shows again on
            # the next call if Redis is still away.
            if out:
                return out
            raise
        return out

    def _read_into(
        self, out: list[BufferedGroup], n_groups: int, *, current_version: int, max_staleness: int, block_ms: int
    ) -> None:
        deadline = time.monotonic() + block_ms / 1000
        while len(out) < n_groups:
            if time.monotonic() >= self._next_claim:  # entries a vanished consumer left pending
                self._autoclaim()
            self._pull(block_ms=None)  # everything already there, so the oldest can be taken first
            if not self._backlog and not self._held:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms < 1 or not self._pull(block_ms=remaining_ms):  # BLOCK 0 would wait forever
                    break
            held, batch = self._oldest(n_groups - len(out), current_version=current_version,
                                       max_staleness=max_staleness)  # fmt: skip
            out.extend(held)
            out.extend(self._accept(batch, current_version=current_version, max_staleness=max_staleness))

    def _pull(self, *, block_ms: int | None) -> int:
        """Queue the new entries (up to the stream's bound at once), waiting up to ``block_ms`` (None: not at all)."""
        reply = self.client.xreadgroup(
            LEARNER_GROUP, self.consumer, {self.keys.trajectories: ">"}, count=self.cfg.max_trajectory_groups,
            block=block_ms,
        )  # fmt: skip
        entries = reply[0][1] if reply else []
        for i, fields in entries:
            eid = text(i)
            self._backlog.append((eid, fields, 1))
            self._queued.add(eid)
        return len(entries)

    def _oldest(
        self, want: int, *, current_version: int, max_staleness: int
    ) -> tuple[list[BufferedGroup], list[Entry]]:
        """The ``want`` oldest of the held groups and the queued entries (by oldest policy version, then
        arrival): the held ones ready to hand out, the entries still to accept. Held groups that went stale
        meanwhile are settled as stale first."""
        if self._held:
            self._drop_stale_held(current_version, max_staleness)
        ranked = [(_oldest_of(fields), 0, i) for i, (_, fields, _) in enumerate(self._backlog)]
        ranked += [(b.group.oldest_version, 1, i) for i, b in enumerate(self._held)]
        chosen = sorted(ranked)[:want]
        entries = {i for _, kind, i in chosen if kind == 0}
        held_ids = {i for _, kind, i in chosen if kind == 1}
        held = [b for i, b in enumerate(self._held) if i in held_ids]
        self._held = [b for i, b in enumerate(self._held) if i not in held_ids]
        batch = [e for i, e in enumerate(self._backlog) if i in entries]
        self._backlog = deque(e for i, e in enumerate(self._backlog) if i not in entries)
        for eid, _, _ in batch:
            self._queued.discard(eid)
        for b in held:
            b.staleness = staleness_of(b.group.oldest_version, current_version)
            nbytes, _, nonce, lengths = self._inflight[b.entry_id]
            self._inflight[b.entry_id] = (nbytes, b.staleness, nonce, lengths)
        self._consumed += len(held)
        return held, batch

    def _drop_stale_held(self, current_version: int, max_staleness: int) -> None:
        stale = [b for b in self._held if staleness_of(b.group.oldest_version, current_version) > max_staleness]
        if not stale:
            return
        settle = Settlement()
        for b in stale:
            nbytes, _, nonce, lengths = self._inflight[b.entry_id]
            settle.add(stale_counter(b.group.group_id), b.entry_id, nbytes=nbytes, nonce=nonce, lengths=lengths)
        self._send(settle)
        gone = {b.entry_id for b in stale}
        for eid in gone:
            self._inflight.pop(eid, None)
        self._held = [b for b in self._held if b.entry_id not in gone]

    def give_back(self, groups: list[BufferedGroup]) -> None:
        """Groups :meth:`read` handed out that the caller will not train on now: a later read hands them out
        again (before newer ones when they are older), or drops them as stale if they aged past the bound."""
        self._held.extend(groups)
        self._consumed -= len(groups)

    def _accept(self, batch: list[Entry], *, current_version: int, max_staleness: int) -> list[BufferedGroup]:
        good: list[BufferedGroup] = []
        settle = Settlement()
        wanted: list[tuple[str, EntryHeader, bytes | None]] = []  # (id, header, inline payload)
        for eid, fields, delivered in batch:
            if not fields:  # deleted while pending (only by hand): nothing to deliver, just release it
                settle.add("", eid, nbytes=0)
                continue
            head = read_header(fields)
            lengths = clean_counts(head.lengths)
            if delivered > self.cfg.max_deliveries:
                reason = f"delivered {delivered} times (buffer.max_deliveries {self.cfg.max_deliveries})"
                settle.add("dead_letter", eid, nbytes=head.nbytes, reason=reason, nonce=head.nonce, lengths=lengths)
                continue
            if head.oldest_version is not None and staleness_of(head.oldest_version, current_version) > max_staleness:
                counter = stale_counter(head.group_id)  # never fetched
                settle.add(counter, eid, nbytes=head.nbytes, nonce=head.nonce, lengths=lengths)
                continue
            wanted.append((eid, head, None if head.nonce else fields.get(F_DATA, b"")))
        # The payloads of everything worth decoding, in one round trip.
        nonces = [head.nonce for _, head, inline in wanted if inline is None]
        fetched = iter(self.client.mget([self.keys.payload(n) for n in nonces]) if nonces else ())
        for eid, head, inline in wanted:
            payload = next(fetched) if inline is None else inline
            try:
                if payload is None:
                    raise InvalidTrajectory(f"payload key {self.keys.payload(head.nonce)} is gone (evicted?)")
                group, oldest, columnar = decode_group_columnar(head.codec, payload)
            except InvalidTrajectory as e:
                reason = f"undecodable: {e}"[:500]
                settle.add("dead_letter", eid, nbytes=head.nbytes, reason=reason, nonce=head.nonce,
                           lengths=clean_counts(head.lengths))  # fmt: skip
                continue
            # The payload is what counts: a header that lied or was missing says nothing here.
            lengths = encode_counts(t.num_completion_tokens for t in group.trajectories)
            lag = staleness_of(oldest, current_version)
            if lag > max_staleness:
                settle.add(stale_counter(head.group_id), eid, nbytes=head.nbytes, nonce=head.nonce, lengths=lengths)
                continue
            self._inflight[eid] = (head.nbytes, lag, head.nonce, lengths)
            good.append(BufferedGroup(entry_id=eid, group=group, staleness=lag, columnar=columnar))
        self._consumed += len(good)
        if settle:
            reasons = settle.counters.get("dead_letter", [])
            try:
                done = self._send(settle)
            except (redis.ConnectionError, redis.TimeoutError):
                # Not handed out after all: leave them pending for the reclaim pass to find and deliver again.
                for b in good:
                    self._inflight.pop(b.entry_id, None)
                self._consumed -= len(good)
                raise
            if done.get("dead_letter"):
                log.warning(
                    "buffer_dead_lettered", consumer=self.consumer, entries=done["dead_letter"], first_reason=reasons[0]
                )
        return good

    def release(self) -> int:
        """Put back, undelivered, what this reader took from the stream and never handed out or handed out
        and got back (:meth:`give_back`): queued to rank oldest first, or held for a later step. A learner
        that ends between steps calls it, so nothing it did not train stays pending on it; the next reader,
        of a resumed run or not, reads them like any new group (under new entry ids, at the stream's end).
        How many went back."""
        ids = [eid for eid, _, _ in self._backlog] + [b.entry_id for b in self._held]
        self._send(Settlement())  # the consumed count, less what was given back, before this reader goes
        released = 0
        for s in range(0, len(ids), _RECOVER_PAGE):
            released += int(
                self._scripts.release(keys=[self.keys.trajectories], args=[LEARNER_GROUP, *ids[s : s + _RECOVER_PAGE]])
            )
        for b in self._held:
            self._inflight.pop(b.entry_id, None)
        self._backlog.clear()
        self._queued.clear()
        self._held = []
        return released

    # -- acknowledging ---------------------------------------------------------------------------------
    def ack(self, entry_ids: list[str]) -> None:
        """Acknowledge (and delete) entries after the optimizer step that used them; repeats are no-ops."""
        settle = Settlement()
        for eid in entry_ids:
            nbytes, lag, nonce, lengths = self._inflight.get(eid, (None, None, "", ""))
            settle.add("acknowledged", eid, nbytes=nbytes, lag=lag, nonce=nonce, lengths=lengths)
        self._send(settle)
        # Forgotten only once Redis has them: an ack that failed (Redis away) can be retried with the
        # same sizes and payload keys.
        for eid in entry_ids:
            self._inflight.pop(eid, None)

    def _send(self, settle: Settlement) -> dict[str, int]:
        consumed, self._consumed = self._consumed, 0
        try:
            return settle.send(
                self.client,
                self._scripts,
                self.keys,
                stream=self.keys.trajectories,
                group=LEARNER_GROUP,
                consumer=self.consumer,
                dead_letter_maxlen=self.cfg.dead_letter_maxlen,
                consumed=consumed,
            )
        except BaseException:
            self._consumed += consumed
            raise

    def unacknowledged(self) -> int:
        """Entries this reader has handed out and not yet acknowledged."""
        return len(self._inflight)
