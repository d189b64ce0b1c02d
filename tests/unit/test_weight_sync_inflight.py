"""The Control proto's in-flight policy has one mapping (``weight_sync.loading``), used by the learner's
sender, the receiver and the rollout server's Pause RPC alike."""

from __future__ import annotations

import pytest

from tether.v1 import control_pb2
from weight_sync.loading import inflight_message, inflight_policy


@pytest.mark.parametrize("policy", ["keep", "drain"])
def test_each_policy_travels_and_comes_back_as_itself(policy: str) -> None:
    message = inflight_message(policy)  # type: ignore[arg-type]
    assert message != control_pb2.INFLIGHT_POLICY_UNSPECIFIED
    assert inflight_policy(message, "keep" if policy == "drain" else "drain") == policy


@pytest.mark.parametrize("default", ["keep", "drain"])
def test_an_unset_or_unknown_policy_is_the_servers_own(default: str) -> None:
    assert inflight_policy(control_pb2.INFLIGHT_POLICY_UNSPECIFIED, default) == default  # type: ignore[arg-type]
    assert inflight_policy(99, default) == default  # type: ignore[arg-type]


def test_a_policy_the_proto_has_no_value_for_is_refused() -> None:
    with pytest.raises(ValueError, match="expected keep or drain"):
        inflight_message("wait")  # type: ignore[arg-type]
