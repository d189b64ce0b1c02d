"""The run's books across lifetimes: what a checkpoint remembers of the buffer, and how a resume uses it.

Redis holds the books (counters, the staleness histogram, the streams) and usually outlives a learner
restart — an external Redis, or the embedded one, which saves its data when ``tether up`` stops. When
it does not (``tether up`` killed outright, a flushed or restored-from-backup Redis), the books and the
prompts in flight would be gone, and with them the admission count: a resumed run would issue a whole
bound's worth of prompts at once and race ahead of its staleness bound. So every checkpoint carries a
:class:`LedgerSnapshot` — the cumulative counters, the histogram, the lifetimes so far, and the dataset
indices of every prompt still outstanding (waiting in the prompts stream, or answered by a group not yet
trained on) — and :func:`restore` puts it back when Redis is missing the run or is older than the
checkpoint. The outstanding prompts are reissued exactly once (by the feed: counted as
``prompts_reissued`` in the new lifetime, not as issued again (they already are), so the bound
``issued − given back ≤ (max_staleness + version + 1)·B`` holds across the restart; the groups that
were in the lost stream are counted as ``lost_in_restart``, so the books still balance.

Each learner start is a *lifetime* (a JSON entry in the ``lifetimes`` list with the counters at its
start), so the books report the run's totals and each lifetime's share of them.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import redis
from google.protobuf.message import DecodeError

from buffer.codec import F_DATA, decode_group_payload, read_header
from buffer.dead_letter import ROLLOUT_DEAD_LETTER
from buffer.keys import RedisKeys
from buffer.replies import int_hash
from tether.logs import get_logger
from tether.trajectory import InvalidTrajectory
from tether.v1.trajectory_pb2 import Prompt

log = get_logger(__name__)

GAUGES = ("bytes",)
"""Counters-hash fields that describe the streams' present contents, not history: never restored."""


@dataclass
class LedgerSnapshot:
    """What a checkpoint keeps of the buffer (plain JSON in ``trainer_state.json``)."""

    counters: dict[str, int] = field(default_factory=dict)
    staleness: dict[str, int] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)
    """The length book (:mod:`buffer.lengths`); empty in a checkpoint written before it existed."""
    lifetimes: list[dict] = field(default_factory=list)
    outstanding: list[int] = field(default_factory=list)
    """Dataset indices issued and not yet settled (trained on, dropped or dead-lettered)."""
    in_stream: int = 0
    """Groups in the trajectories stream at the time (lost with it if Redis does not survive)."""

    @classmethod
    def from_json(cls, raw: dict | None) -> LedgerSnapshot | None:
        return cls(**raw) if raw else None

    def to_json(self) -> dict:
        return asdict(self)


def read_counters(client: redis.Redis, keys: RedisKeys) -> dict[str, int]:
    return int_hash(client.hgetall(keys.counters))


def _consistent_view(
    client: redis.Redis, keys: RedisKeys
) -> tuple[dict[str, int], dict[str, int], dict[str, int], list, list]:
    """``(counters, staleness histogram, length book, prompts-stream entries, trajectories-stream entries)``
    read in one MULTI/EXEC: a put (``produced`` and its entry) or a settle (its counter and the entry's removal) lands
    wholly before or after it. Read one after the other, a group put in between was in the stream but not
    in ``produced``, and a restore counted it lost: the run's books stopped balancing (seen once in this
    project's CI, in the resume test). Both streams are bounded (``max_trajectory_groups``, the admission
    bound) and hold headers only, so they are read whole."""
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(keys.counters)
    pipe.hgetall(keys.staleness)
    pipe.hgetall(keys.lengths)
    pipe.xrange(keys.prompts, "-", "+")
    pipe.xrange(keys.trajectories, "-", "+")
    counters, staleness, lengths, prompts, trajectories = pipe.execute()
    return int_hash(counters), int_hash(staleness), int_hash(lengths), prompts, trajectories


def outstanding_indices(client: redis.Redis, keys: RedisKeys, prompts: list, trajectories: list) -> list[int]:
    """Dataset indices of unsettled prompts, from the entries of :func:`_consistent_view`: prompts waiting in
    the prompts stream (acknowledged ones are deleted) plus the prompts whose groups are in the
    trajectories stream (acknowledged or dropped ones are deleted). Groups of custom environments have
    no dataset index."""
    indices: list[int] = []
    for _, fields in prompts:
        prompt = Prompt()
        try:
            prompt.ParseFromString(fields.get(b"p", b""))
        except DecodeError:
            continue  # the reader dead-letters it; it will never be trained on
        indices.append(int(prompt.dataset_index))
    heads = [(read_header(fields), fields.get(F_DATA)) for _, fields in trajectories]
    payload_keys = [keys.payload(h.nonce) for h, _ in heads if h.nonce]
    fetched = iter(client.mget(payload_keys) if payload_keys else ())
    for head, inline in heads:
        payload = next(fetched) if head.nonce else inline
        if payload is None:
            continue
        try:
            group, _ = decode_group_payload(head.codec, payload)
        except InvalidTrajectory:
            continue
        index = group.metadata.get("dataset_index")
        if group.prompt_id and index is not None and index.lstrip("-").isdigit():
            indices.append(int(index))
    return sorted(set(indices))


def take_snapshot(client: redis.Redis, keys: RedisKeys) -> LedgerSnapshot:
    """The buffer's books as they stand (learner rank 0, at checkpoint time), counters and streams as of
    one moment."""
    counters, staleness, lengths, prompts, trajectories = _consistent_view(client, keys)
    return LedgerSnapshot(
        counters={k: v for k, v in counters.items() if k not in GAUGES},
        staleness=staleness,
        lengths=lengths,
        lifetimes=lifetimes(client, keys),
        outstanding=outstanding_indices(client, keys, prompts, trajectories),
        in_stream=len(trajectories),
    )


_PROGRESS = ("prompts_issued", "produced", "acknowledged")


def redis_is_behind(current: dict[str, int], snap: LedgerSnapshot) -> bool:
    """Redis lacks what the checkpoint already counted: it lost the run (restarted without its data, or
    was restored from an older backup)."""
    return any(current.get(k, 0) < snap.counters.get(k, 0) for k in _PROGRESS)


def _wipe(client: redis.Redis, keys: RedisKeys) -> int:
    deleted = 0
    for batch in _batched(client.scan_iter(match=keys.prefix + "*", count=1000), 500):
        deleted += client.delete(*batch)
    return deleted


def _batched(it, n: int):
    batch = []
    for item in it:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def restore(client: redis.Redis, keys: RedisKeys, snap: LedgerSnapshot | None) -> list[int]:
    """Make the buffer's books agree with a checkpoint; the dataset indices to reissue (empty when
    Redis kept the run). Call on learner rank 0 before any prompt is fed."""
    if snap is None:
        return []
    current = read_counters(client, keys)
    if not redis_is_behind(current, snap):
        return []
    if current:
        log.warning(
            "buffer_older_than_checkpoint",
            redis={k: current.get(k, 0) for k in _PROGRESS},
            checkpoint={k: snap.counters.get(k, 0) for k in _PROGRESS},
            action="its keys for this run are replaced by the checkpoint's books",
        )
        _wipe(client, keys)
    counters = dict(snap.counters)
    counters["lost_in_restart"] = counters.get("lost_in_restart", 0) + snap.in_stream
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.counters, mapping={k: v for k, v in counters.items() if v})
    if snap.staleness:
        pipe.hset(keys.staleness, mapping=snap.staleness)
    if snap.lengths:
        pipe.hset(keys.lengths, mapping=snap.lengths)
    for entry in snap.lifetimes:
        pipe.rpush(keys.lifetimes, json.dumps(entry))
    pipe.execute()
    log.warning(
        "buffer_restored_from_checkpoint",
        reason="Redis did not keep this run's books (restarted without its data?)",
        reissued_prompts=len(snap.outstanding),
        lost_groups=snap.in_stream,
    )
    return list(snap.outstanding)


# -- lifetimes and the books ---------------------------------------------------------------------------


def begin_lifetime(client: redis.Redis, keys: RedisKeys, *, step: int, version: int) -> int:
    """Record that a learner lifetime starts here; its number (1 for the first)."""
    entry = {"started_unix": round(time.time(), 3), "step": step, "version": version}
    entry["counters"] = {k: v for k, v in read_counters(client, keys).items() if k not in GAUGES}
    return int(client.rpush(keys.lifetimes, json.dumps(entry, sort_keys=True)))


def lifetimes(client: redis.Redis, keys: RedisKeys) -> list[dict]:
    return [json.loads(raw) for raw in client.lrange(keys.lifetimes, 0, -1)]


BOOK_TERMS = ("acknowledged", "dropped_stale", "dropped_stale_env", "dead_letter", "lost_in_restart")
"""Where every produced group ends: produced = Σ these + groups still in the stream."""


def books(counters: dict[str, int], *, in_stream: int) -> dict[str, int | bool]:
    """The balance sheet of trajectory groups (and the prompt counts beside it)."""
    out: dict[str, int | bool] = {"produced": counters.get("produced", 0)}
    for k in BOOK_TERMS:
        out[k] = counters.get(k, 0)
    out["in_stream"] = in_stream
    out["balanced"] = out["produced"] == sum(out[k] for k in BOOK_TERMS) + in_stream
    for k in ("prompts_issued", "prompts_reissued", "prompts_dead_letter", ROLLOUT_DEAD_LETTER, "duplicates"):
        out[k] = counters.get(k, 0)
    return out


def run_books(client: redis.Redis, keys: RedisKeys) -> dict:
    """The whole run's books plus each lifetime's figures (counters at its end minus at its start)."""
    pipe = client.pipeline(transaction=True)  # counters and stream length as of one moment (see above)
    pipe.hgetall(keys.counters)
    pipe.xlen(keys.trajectories)
    raw, in_stream = pipe.execute()
    now = {k: v for k, v in int_hash(raw).items() if k not in GAUGES}
    lives = lifetimes(client, keys)
    per_life = []
    for i, life in enumerate(lives):
        end = lives[i + 1]["counters"] if i + 1 < len(lives) else now
        start = life["counters"]
        delta = {k: end.get(k, 0) - start.get(k, 0) for k in set(end) | set(start)}
        row = {"lifetime": i + 1, "start_step": life["step"], "start_version": life["version"]}
        row.update({k: delta.get(k, 0) for k in ("produced", "prompts_issued", *BOOK_TERMS, "prompts_reissued")})
        per_life.append(row)
    return {"run": books(now, in_stream=in_stream), "lifetimes": per_life}


def format_books(report: dict) -> list[str]:
    """The books as a person reads them (``tether status`` and the end of ``tether up`` print these)."""
    b = report["run"]
    lines = [
        f"books: produced {b['produced']} = trained {b['acknowledged']} + dropped stale "
        f"{b['dropped_stale'] + b['dropped_stale_env']} + "
        f"dead-lettered {b['dead_letter']} + lost in restarts {b['lost_in_restart']} + in the buffer "
        f"{b['in_stream']}  ({'balanced' if b['balanced'] else 'NOT BALANCED'})",
        f"prompts: issued {b['prompts_issued']}, reissued after a restart {b['prompts_reissued']}, "
        f"dead-lettered {b['prompts_dead_letter'] + b['rollout_dead_letter']}",
    ]
    for life in report["lifetimes"]:
        lines.append(
            f"  lifetime {life['lifetime']} (from step {life['start_step']}): produced {life['produced']}, "
            f"trained {life['acknowledged']}, dropped stale {life['dropped_stale']}, "
            f"issued {life['prompts_issued']}, reissued {life['prompts_reissued']}"
        )
    return lines


def write_books(client: redis.Redis, keys: RedisKeys, path) -> None:  # type: ignore[no-untyped-def]
    """``buffer_stats.json`` in the run folder: the flat ``buffer/...`` stats plus ``books`` (run and
    lifetimes). Best effort: a run never fails for its diagnostics."""
    from pathlib import Path

    from buffer.stats import buffer_stats

    try:
        body = dict(buffer_stats(client, keys))
        body["books"] = run_books(client, keys)
        Path(path).write_text(json.dumps(body, indent=1, sort_keys=True))
    except Exception as e:  # diagnostics only
        log.warning("buffer_books_not_saved", error=repr(e))
