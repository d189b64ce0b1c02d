"""Building the argument list of the SETTLE script, shared by the prompt queue and the trajectory reader.

Both streams end an entry's life the same way — acknowledge, delete, count, and maybe dead-letter —
so both batch their decisions into :class:`Settlement` and send them in a single script call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from buffer.keys import RedisKeys
from buffer.scripts import Scripts


@dataclass
class Settlement:
    """Entries of one stream to settle in one round trip, grouped by the counter they add to."""

    by_counter: dict[str, list[tuple[str, str, str, str]]] = field(default_factory=dict)

    def add(
        self, counter: str, entry_id: str, *, nbytes: int | None = None, lag: int | None = None, reason: str = ""
    ) -> None:
        row = (entry_id, "" if nbytes is None else str(nbytes), "" if lag is None else str(lag), reason)
        self.by_counter.setdefault(counter, []).append(row)

    def __bool__(self) -> bool:
        return any(self.by_counter.values())

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
        """Run one SETTLE per counter in a single pipeline; how many entries each actually settled."""
        counters = list(self.by_counter)
        if not counters and not consumed:
            return {}
        script_keys = [stream, keys.counters, keys.staleness, keys.dead_letter]
        pipe = client.pipeline(transaction=False)
        for i, counter in enumerate(counters or [""]):
            args: list[str | int] = [group, counter, dead_letter_maxlen, consumer, consumed if i == 0 else 0]
            for row in self.by_counter.get(counter, []):
                args.extend(row)
            scripts.settle(keys=script_keys, args=args, client=pipe)
        replies = pipe.execute()
        self.by_counter.clear()
        return {c: int(r) for c, r in zip(counters, replies, strict=False)}
