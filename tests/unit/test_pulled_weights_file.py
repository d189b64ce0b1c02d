"""Where vLLM's workers read a pulled version from (issue 44, item 2): /dev/shm only when it has room.

A version too large for /dev/shm (Docker's default is 64 MB) used to be written there anyway: the write
failed and the puller retried forever, or a full tmpfs made the mapping process SIGBUS. Real files in real
folders here; only the free space each folder reports is chosen by the test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rollout_server.engines.base import EngineError
from rollout_server.engines.vllm_engine import SHM_HEADROOM, shared_copy
from weight_sync.versions import flatten


def _weights():  # type: ignore[no-untyped-def]
    return flatten({"w": torch.arange(1000, dtype=torch.float32)}, version=7, dtype="float32")


def test_the_first_folder_with_room_gets_the_bits(tmp_path: Path) -> None:
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir(), disk.mkdir()
    weights = _weights()
    rooms = {shm: SHM_HEADROOM + 1000, disk: 2**40}  # shm: the headroom but not the version's 4,000 bytes
    path = shared_copy(weights, folders=[shm, disk], free=lambda f: rooms[f])
    assert path.parent == disk and not list(shm.iterdir())
    assert np.array_equal(np.fromfile(path, dtype=weights.bits.dtype), weights.bits)
    rooms[shm] = 2**40
    assert shared_copy(weights, folders=[shm, disk], free=lambda f: rooms[f]).parent == shm


def test_no_room_anywhere_is_a_clear_error_naming_the_sizes(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"no room for pulled version 7 .*docker --shm-size"):
        shared_copy(_weights(), folders=[tmp_path], free=lambda f: 10)
    assert not list(tmp_path.iterdir())
