"""Filesystem snapshots: complete-or-invisible writes, newest version wins, pruning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
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


def test_a_shard_is_written_from_the_bucket_without_a_copy_and_reads_as_safetensors_own(tmp_path: Path) -> None:
    """``write_shard`` builds the file from the bucket's bytes: safetensors' own reader (and ``safe_open``'s
    header) gives back every tensor bit for bit, of every dtype and at offsets not aligned to 8."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "embed": torch.randn(512, 4096, generator=g),
        "norm": torch.randn(7, generator=g).to(torch.bfloat16),  # odd sizes: the offsets are not aligned to 8
        "step": torch.tensor([3], dtype=torch.int64),
        "scale": torch.randn(3, 5, generator=g).half(),
    }
    layout = plan_layout(((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), bucket_size_bytes=64 << 20)
    flats = [empty_bucket(b) for b in layout.buckets]  # a bucket per dtype
    for meta in layout.tensors:
        pack_into(flats[meta.bucket], meta, tensors[meta.name])
    writer = SnapshotWriter(tmp_path, 1, layout)
    for i, flat in enumerate(flats):
        writer.write_bucket(i, flat)
    loaded = {}
    for shard in writer.tmp.glob("*.safetensors"):
        loaded.update(load_file(str(shard)))
        with safe_open(str(shard), framework="pt") as f:
            assert set(f.keys()) <= set(tensors)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    # The embedding's shard against safetensors' own writer: both the header and the data, no padding between.
    embed = tensors["embed"]
    shard = writer.tmp / writer._shard_name(next(m.bucket for m in layout.tensors if m.name == "embed"))
    save_file({"embed": embed.clone()}, str(tmp_path / "own.safetensors"))
    data = embed.numel() * embed.element_size()
    own_header = int.from_bytes((tmp_path / "own.safetensors").read_bytes()[:8], "little")
    ours_header = int.from_bytes(shard.read_bytes()[:8], "little")
    assert (tmp_path / "own.safetensors").stat().st_size == 8 + own_header + data
    assert shard.stat().st_size == 8 + ours_header + data and (8 + ours_header) % 8 == 0


_WRITE_BIG_BUCKET = """
import sys, torch
from weight_sync.buckets import empty_bucket, pack_into, plan_layout
from weight_sync.snapshot import SnapshotWriter
tensors = {"embed": torch.randn(16384, 4096)}  # 256 MB
layout = plan_layout(((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), bucket_size_bytes=1 << 20)
flat = empty_bucket(layout.buckets[0])
pack_into(flat, layout.tensors[0], tensors["embed"])
def hwm():
    return int(next(x for x in open("/proc/self/status") if x.startswith("VmHWM")).split()[1]) * 1024
before = hwm()
SnapshotWriter(sys.argv[1], 1, layout).write_bucket(0, flat)
print(hwm() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the process's peak RSS from /proc")
def test_writing_a_shard_costs_no_copy_of_its_bucket(tmp_path: Path) -> None:
    """A fresh process holding a 256 MB bucket writes its shard: its peak RSS grows by far less than the bucket
    (safetensors' ``save_file`` after a clone per tensor: by the whole bucket, measured +270 MB)."""
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _WRITE_BIG_BUCKET, str(tmp_path)], cwd=repo, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) < 64 << 20, out.stdout
