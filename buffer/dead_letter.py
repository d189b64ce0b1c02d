"""Dead letters written by producers: work a rollout server could not finish, parked where people look.

The learner's reader and the prompt queue dead-letter entries of their own streams inside the SETTLE
script (:mod:`buffer.scripts`). A rollout server has no stream entry to settle — a prompt it cannot
tokenize, a group whose reward service kept failing — so it calls :func:`dead_letter`: the record goes
to the run's dead-letter stream and :data:`ROLLOUT_DEAD_LETTER` is counted in the same transaction. The
counter is not only for ``tether status``: the prompt feed gives one admission slot back per count
(:mod:`buffer.prompts`), since a group that will never arrive must not hold a slot forever.
"""

from __future__ import annotations

import time

import redis

from buffer.keys import RedisKeys
from buffer.replies import text

ROLLOUT_DEAD_LETTER = "rollout_dead_letter"
"""Counter of groups (or prompts) a rollout server dead-lettered."""

MAX_REASON_CHARS = 500


def dead_letter(
    client: redis.Redis,
    keys: RedisKeys,
    *,
    source: str,
    reason: str,
    data: bytes,
    maxlen: int = 1000,
    counter: str = ROLLOUT_DEAD_LETTER,
) -> str:
    """Append ``data`` (a serialized prompt or group) with ``source`` and ``reason`` to the dead-letter
    stream (capped at about ``maxlen`` entries) and count it under ``counter``; the new entry's id. Work that
    never held a prompt's admission slot (an episode nobody closed) is counted under its own counter, so no
    slot is given back for it."""
    fields = {"source": source, "reason": reason[:MAX_REASON_CHARS], "data": data, "time": repr(time.time())}
    pipe = client.pipeline(transaction=True)
    pipe.xadd(keys.dead_letter, fields, maxlen=maxlen, approximate=True)
    pipe.hincrby(keys.counters, counter, 1)
    entry_id, _ = pipe.execute()
    return text(entry_id)
