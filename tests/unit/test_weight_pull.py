"""The store transport's pieces that need no model: the fan-out tree, the source order, the Redis records,
the config and the publish dtype."""

from __future__ import annotations

import pytest
import redis
import torch

from buffer import RedisKeys
from buffer.weights import Held, announce_weights, held_versions, read_announcement, record_held
from tether.config import TetherConfig
from weight_sync.publication import publish_dtype
from weight_sync.puller import Member, Puller, tree_parent


def test_the_tree_has_fanout_roots_and_each_node_at_most_fanout_children() -> None:
    assert [tree_parent(r, 2) for r in range(8)] == [None, None, 0, 0, 1, 1, 2, 2]
    assert [tree_parent(r, 1) for r in range(4)] == [None, 0, 1, 2]
    assert [tree_parent(r, 0) for r in range(3)] == [None, None, None]  # no peers: all from the origin
    for k in (1, 2, 3, 5):
        children: dict[int, int] = {}
        for r in range(200):
            parent = tree_parent(r, k)
            if parent is not None:
                assert parent < r  # a parent comes first: no cycle in one ordering
                children[parent] = children.get(parent, 0) + 1
        assert max(children.values()) == k


class _Loader:
    policy_version = 0

    async def pause(self, inflight: str) -> None: ...

    async def resume(self) -> None: ...


def _cfg(**transport) -> TetherConfig:
    return TetherConfig.model_validate({"weight_sync": {"transport": {"type": "store", **transport}}})


def test_sources_go_parent_then_a_holder_then_relays_then_the_origin() -> None:
    cfg = _cfg(fanout=1, relays=["10.0.0.9:7000"])
    puller = Puller(_Loader(), cfg, delivery=None, fleet=None, server_id="c")  # type: ignore[arg-type]
    try:
        members = [Member("a", 5, "10.0.0.1:1"), Member("b", 4, "10.0.0.2:1"), Member("c", 4, "10.0.0.3:1")]
        names = [s.name for s in puller.sources(5, "10.0.0.8:9", members)]
        # sorted ids a, b, c: c is node 2, fanout 1 -> its parent is node 1 (b); a already holds v5
        assert names == ["peer:10.0.0.2:1", "peer:10.0.0.1:1", "relay:10.0.0.9:7000", "origin:10.0.0.8:9"]
    finally:
        puller.close()
    alone = Puller(_Loader(), _cfg(fanout=0), delivery=None, fleet=None, server_id="c")  # type: ignore[arg-type]
    try:
        assert [s.name for s in alone.sources(5, "o:1", members)] == ["origin:o:1"]  # fanout 0: no peers at all
    finally:
        alone.close()


def test_the_redis_records_round_trip_and_bad_ones_read_as_absent(redis_client: redis.Redis) -> None:
    keys = RedisKeys("pull")
    assert read_announcement(redis_client, keys) is None
    announce_weights(redis_client, keys, {"version": 3, "origin": "1.2.3.4:5"})
    assert read_announcement(redis_client, keys) == {"version": 3, "origin": "1.2.3.4:5"}
    with pytest.raises(ValueError, match="version"):
        announce_weights(redis_client, keys, {"origin": "x"})
    redis_client.set(keys.weights, b"{not json")
    assert read_announcement(redis_client, keys) is None
    record_held(redis_client, keys, "s0", Held(3, "1.2.3.4:6"))
    redis_client.hset(keys.weights_held, "s1", b"garbage")
    assert held_versions(redis_client, keys) == {"s0": Held(3, "1.2.3.4:6")}
    # a live server with no (readable) record holds nothing from the store yet: what the learner waits on
    assert held_versions(redis_client, keys, ["s0", "s1", "s2"]) == {
        "s0": Held(3, "1.2.3.4:6"), "s1": Held(-1, ""), "s2": Held(-1, "")
    }  # fmt: skip


def test_the_store_transport_config_and_the_publish_dtype() -> None:
    cfg = _cfg(port=7100, fanout=3, relays=["r:1"])
    t = cfg.weight_sync.transport
    assert (t.type, t.port, t.fanout, t.relays, t.base_every) == ("store", 7100, 3, ["r:1"], 10)
    with pytest.raises(ValueError, match="fanout"):
        _cfg(fanout=-1)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert publish_dtype(cfg, cpu) == "float32" and publish_dtype(cfg, cuda) == "bfloat16"
    served = TetherConfig.model_validate(
        {"model": {"dtype": "bfloat16"}, "weight_sync": {"transport": {"type": "store"}}}
    )
    assert publish_dtype(served, cpu) == "bfloat16"  # what the engines serve
    forced = TetherConfig.model_validate({"weight_sync": {"publish_dtype": "float16", "transport": {"type": "store"}}})
    assert publish_dtype(forced, cuda) == "float16"
