"""Building the argument list of the SETTLE script, shared by the prompt queue and the trajectory reader.

Both streams end an entry's life the same way — acknowledge, delete, count, and maybe dead-letter —
so both batch their decisions into :class:`Settlement` and send them as one EVALSHA: one round trip
per batch whatever mix of counters it holds. (Not a redis-py pipeline: a pipeline that runs a
registered script first asks ``SCRIPT EXISTS``, a second round trip on every ack.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from buffer.keys import RedisKeys
from buffer.replies import text
from buffer.scripts import Scripts


@dataclass
class Settlement:
    """Entries of one stream to settle in one round trip, each with the counter it adds to."""

    rows: list[str] = field(default_factory=list)
    counters: dict[str, list[str]] = field(default_factory=dict)  # counter -> reasons (for logging)

    def add(
        self,
        counter: str,
        entry_id: str,
        *,
        nbytes: int | None = None,
        lag: int | None = None,
        reason: str = "",
        nonce: str = "",
        lengths: str = "",
    ) -> None:
        """``nbytes=None`` makes the script look the size (and the payload nonce) up in the entry;
        ``lengths`` (:func:`buffer.lengths.clean_counts`) is booked under ``counter`` by length."""
        self.rows += (entry_id, counter, "" if nbytes is None else str(nbytes), "" if lag is None else str(lag))
        self.rows += (reason, nonce, lengths)
        self.counters.setdefault(counter, []).append(reason)

    def __bool__(self) -> bool:
        return bool(self.rows)

    def send(
        self,
        client: redis.Redis,
        scripts: Scripts,
        keys: RedisKeys,
        *,
        stream: str,
        group: str,
        consumer: str,
        dead_letter_maxlen: int,
        consumed: int = 0,
    ) -> dict[str, int]:
        """Settle everything in one script call; how many entries each counter actually settled."""
        if not self.rows and not consumed:
            return {}
        script_keys = [stream, keys.counters, keys.staleness, keys.dead_letter, keys.lengths]
        args = [group, dead_letter_maxlen, consumer, consumed, keys.payload(""), *self.rows]
        reply = scripts.settle(keys=script_keys, args=args)
        self.rows = []
        self.counters = {}
        it = iter(reply)
        return {text(c): int(n) for c, n in zip(it, it, strict=True)}
