"""Filesystem snapshots: complete-or-invisible writes, newest version wins, pruning."""

from __future__ import annotations

from pathlib import Path

import torch

from weight_sync.buckets import empty_bucket, pack_into, plan_layout
from weight_sync.snapshot import SnapshotWriter, latest_snapshot, list_snapshots, read_snapshot, snapshot_dir


def _write(root: Path, version: int, tensors: dict[str, torch.Tensor], *, keep: int = 5, commit: bool = True):
    layout = plan_layout(((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), bucket_size_bytes=1024)
    writer = SnapshotWriter(root, version, layout)
    flats = [empty_bucket(b) for b in layout.buckets]
    for meta in layout.tensors:
        pack_into(flats[meta.bucket], meta, tensors[meta.name])
    for i, flat in enumerate(flats):
        writer.write_bucket(i, flat)
    return writer.commit(keep=keep) if commit else writer


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 10, generator=g), "b": torch.randn(10, generator=g).to(torch.bfloat16)}


def test_snapshot_roundtrip_and_latest(tmp_path: Path) -> None:
    assert latest_snapshot(tmp_path / "missing") is None
    _write(tmp_path, 1, _tensors(1))
    _write(tmp_path, 2, _tensors(2))
    version, path = latest_snapshot(tmp_path)
    assert version == 2 and path == snapshot_dir(tmp_path, 2)
    loaded = dict(read_snapshot(path))
    for name, t in _tensors(2).items():
        torch.testing.assert_close(loaded[name], t, rtol=0, atol=0)


def test_unfinished_snapshot_is_invisible(tmp_path: Path) -> None:
    _write(tmp_path, 1, _tensors(1))
    writer = _write(tmp_path, 2, _tensors(2), commit=False)  # the learner "died" before the rename
    assert writer.tmp.exists()
    assert latest_snapshot(tmp_path)[0] == 1
    (tmp_path / "v00000003").mkdir()  # a folder without a VERSION marker is not a snapshot
    assert latest_snapshot(tmp_path)[0] == 1


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for v in range(1, 5):
        _write(tmp_path, v, _tensors(v), keep=2)
    assert [v for v, _ in list_snapshots(tmp_path)] == [3, 4]
