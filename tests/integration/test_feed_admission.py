"""The admission metrics a step logs name the bound the last feed was really held to.

A background weight publication feeds the moment its version is committed, on its own thread, so it can
issue the next version's prompts between the step's reading the servers' version and its logging the
admission count. The bound must come with the count it limits (here on a real Redis, the learner's own
feed), or a run's metrics show ``prompts_issued > admission_bound`` where none was issued past its bound.
"""

from __future__ import annotations

from learner.feed import Feed
from tether.config import TetherConfig
from tether.redis_server import connect_redis

B, STALENESS = 2, 1


def test_the_logged_bound_is_the_one_of_the_version_the_feed_counted_from(redis_url: str) -> None:
    cfg = TetherConfig.model_validate(
        {"run": {"run_id": "admission"}, "buffer": {"redis_url": redis_url},
         "learner": {"data_path": "demo:charclass", "train_batch_size": B},
         "algorithm": {"max_staleness": STALENESS}}
    )  # fmt: skip
    client = connect_redis(redis_url)
    feed = Feed(cfg, client, data_position=0)
    assert feed.feed(0) == (STALENESS + 1) * B
    assert feed.admission_metrics()["buffer/admission_bound"] == (STALENESS + 1) * B
    servers_version = 0  # what the step read; then the background publication of version 1 commits and feeds
    assert feed.feed(servers_version + 1) == B
    m = feed.admission_metrics()
    assert m["buffer/prompts_issued"] == (STALENESS + 2) * B == m["buffer/admission_bound"]
    assert m["buffer/prompts_issued"] > (STALENESS + servers_version + 1) * B  # what the step's version bounds
    client.close()
