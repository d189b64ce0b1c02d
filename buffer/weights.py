"""The ``store`` weight transport's two Redis records: the announced version, and what each server holds.

The learner announces a version once its manifest is in the store (:func:`announce_weights`); each server
reads the announcement (:func:`read_announcement`), pulls, swaps, and records the version it now serves
with the address its chunk service answers peers on (:func:`record_held`). The learner waits until every
live server holds the version (:func:`held_versions` of the registry's live servers) and servers pick
peers from the same records. JSON, never pickle; a record that does not parse reads as absent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis

from buffer.keys import RedisKeys
from buffer.replies import text


@dataclass(frozen=True)
class Held:
    version: int
    peer: str
    """``host:port`` of the server's chunk service (empty: it serves no peers)."""


def announce_weights(client: redis.Redis, keys: RedisKeys, info: dict) -> None:
    """Make ``info`` (``version``, ``origin``, ...) the announced version."""
    if int(info.get("version", -1)) < 0:
        raise ValueError(f"announcement without a version >= 0: {info!r}")
    client.set(keys.weights, json.dumps(info))


def read_announcement(client: redis.Redis, keys: RedisKeys) -> dict | None:
    raw = client.get(keys.weights)
    if raw is None:
        return None
    try:
        info = json.loads(raw)
        int(info["version"])
    except (ValueError, TypeError, KeyError):
        return None
    return info


def record_held(client: redis.Redis, keys: RedisKeys, server_id: str, held: Held) -> None:
    client.hset(keys.weights_held, server_id, json.dumps({"version": held.version, "peer": held.peer}))


def forget_held(client: redis.Redis, keys: RedisKeys, server_id: str) -> None:
    client.hdel(keys.weights_held, server_id)


def held_versions(client: redis.Redis, keys: RedisKeys, server_ids: list[str] | None = None) -> dict[str, Held]:
    """What each server (of ``server_ids``, default all that recorded one) holds; a server with no record
    reads as version -1 (it has loaded nothing from the store yet, not even the starting version)."""
    raw = client.hgetall(keys.weights_held)
    out: dict[str, Held] = {}
    for k, v in raw.items():
        sid = text(k)
        try:
            body = json.loads(v)
            out[sid] = Held(int(body["version"]), str(body.get("peer", "")))
        except (ValueError, TypeError, KeyError):
            continue
    if server_ids is None:
        return out
    return {sid: out.get(sid, Held(-1, "")) for sid in server_ids}
