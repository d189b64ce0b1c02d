"""The client's request builders: exactly one prompt form, optional sampling fields left unset."""

from __future__ import annotations

import pytest

from tether.client import _inflight, generate_request, open_episode_request
from tether.v1 import control_pb2


def test_generate_request_forms() -> None:
    r = generate_request(text="hi", n=2, max_tokens=5)
    assert r.WhichOneof("prompt") == "text" and r.sampling.n == 2 and r.sampling.max_tokens == 5
    assert not r.sampling.HasField("temperature") and not r.sampling.HasField("seed")
    r = generate_request(token_ids=[1, 2], temperature=0.0, seed=0)
    assert list(r.token_ids.ids) == [1, 2]
    assert r.sampling.HasField("temperature") and r.sampling.temperature == 0.0 and r.sampling.HasField("seed")
    r = generate_request(messages=[{"role": "user", "content": "x"}])
    assert r.messages.messages[0].role == "user"
    with pytest.raises(ValueError, match="exactly one"):
        generate_request(text="a", token_ids=[1])
    with pytest.raises(ValueError, match="exactly one"):
        generate_request()


def test_open_episode_request_and_inflight() -> None:
    r = open_episode_request(text="t", group_id="g", group_size=4, metadata={"k": "v"}, max_tokens=3)
    assert r.group_id == "g" and r.group_size == 4 and r.metadata["k"] == "v" and r.sampling.max_tokens == 3
    with pytest.raises(ValueError):
        open_episode_request()
    assert _inflight("keep") == control_pb2.INFLIGHT_POLICY_KEEP and _inflight("") == 0
    with pytest.raises(ValueError):
        _inflight("abort")
