"""The filesystem transport's Prepare runs while the snapshot is written, not before it.

Receivers of a snapshot read it on their own at commit, so nothing has to wait for their Prepare
answers until then. A receiver whose pause (the first thing Prepare does) is held by a gate shows it:
the snapshot's shards are written while that Prepare has not answered — before, the write waited for
every answer — and once the gate opens the update lands whole. A receiver that declines (it holds the
version already) is dropped from the commit with the reason, as with a collective transport.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.integration.test_weight_sync_background import _gated
from tests.integration.test_weight_sync_gloo import _cfg, fleet  # noqa: F401 - the fixture
from tests.weight_receiver import ModelEngine
from tether.commands.tiny_model import make_tiny_model
from weight_sync import snapshot as snapshot_module
from weight_sync.sender import WeightSender

pytestmark = pytest.mark.timeout(120)


def test_the_snapshot_is_written_while_prepare_is_still_out(
    tmp_path: Path,
    tiny_model_dir: Path,
    fleet,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = _cfg(tmp_path, transport={"type": "filesystem", "path": str(tmp_path / "snaps")})
    learner = ModelEngine.from_path(make_tiny_model(tmp_path / "learner", hidden=128, layers=2, heads=4, seed=1)).model
    address, engine = _gated(fleet, tiny_model_dir, cfg)
    written = threading.Event()
    write = snapshot_module.SnapshotWriter.write_bucket

    def recorded(self, bucket: int, flat: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        write(self, bucket, flat)
        written.set()

    monkeypatch.setattr(snapshot_module.SnapshotWriter, "write_bucket", recorded)
    sender = WeightSender(cfg, model=learner, servers=[address])
    try:
        sender.publish(1, background=True)
        assert written.wait(20)  # the shards are on disk ...
        assert engine.pauses == 0 and engine.policy_version == 0  # ... while Prepare has not got past its pause
        engine.gate.set()
        metrics = sender.wait()
        assert metrics["weight_sync/reached"] == 1, sender.last_dropped
        assert engine.policy_version == 1
        for (name, sent), got in zip(learner.named_parameters(), engine.model.parameters(), strict=True):
            torch.testing.assert_close(got, sent, rtol=0, atol=0, msg=name)
        again = sender.publish(1)  # the receiver holds version 1 already: it declines, and is not committed to
        assert again["weight_sync/reached"] == 0 and "declined" in sender.last_dropped[address]
    finally:
        engine.gate.set()
        sender.close()
