"""``weight_sync.transport.mirrors``: copies of the store a fleet pulls from, by URL scheme (weight_sync.mirrors).

The URL's form is checked when the config loads, its scheme when the puller starts (the config imports no
library); the built-in ``file`` scheme reads a directory in the store's layout; a :class:`LayoutMirror`
plans exactly as the store does, reading each manifest it walks once and listing nothing. The whole recipe, with a toy
scheme and a real puller, is in ``tests/integration/test_extending.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.test_weight_pull import _cfg, _Loader
from tether.config import ConfigError, load_config
from weight_sync.mirrors import MIRRORS, LayoutMirror, mirror_source
from weight_sync.puller import Member, Puller
from weight_sync.sources import Fetcher
from weight_sync.store import VersionMissing, VersionStore, VersionWriter


def _publish(root: Path, versions: int, *, base_every: int) -> tuple[VersionStore, list[dict[str, torch.Tensor]]]:
    store = VersionStore(root, fsync=False)
    writer = VersionWriter(store, dtype="float32", base_every=base_every, chunk_bytes=4096)
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(64, 48, generator=g), "b": torch.randn(300, generator=g)}
    history = []
    for v in range(versions):
        if v:
            w = {n: t + (torch.rand(t.shape, generator=g) < 0.05) * 1e-3 for n, t in w.items()}
        writer.publish(v, w)
        history.append({n: t.clone() for n, t in w.items()})
    return store, history


def test_a_mirror_is_a_url_when_the_config_loads() -> None:
    with pytest.raises(ConfigError, match=r"mirrors.*'10\.0\.0\.9:7000' is not a URL.*goes in relays"):
        load_config(None, ["--weight_sync.transport", "{type: store, mirrors: ['10.0.0.9:7000']}"])
    t = _cfg(mirrors=["file:///mnt/weights", "s3://bucket/run"]).weight_sync.transport
    assert t.mirrors == ["file:///mnt/weights", "s3://bucket/run"]  # the schemes are checked at start


def test_an_unknown_scheme_stops_the_puller_at_start_naming_the_known_ones() -> None:
    cfg = _cfg(mirrors=["s3://bucket/run"])
    with pytest.raises(ValueError, match=r"'s3://bucket/run' has no known scheme \(known: file\).*MIRRORS"):
        Puller(_Loader(), cfg, delivery=None, fleet=None, server_id="a")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a file mirror is file:///absolute/path"):
        mirror_source("file://relative/weights")


def test_mirrors_are_asked_after_the_peers_and_before_the_relays(tmp_path: Path) -> None:
    url = tmp_path.as_uri()
    cfg = _cfg(fanout=1, mirrors=[url], relays=["10.0.0.9:7000"])
    puller = Puller(_Loader(), cfg, delivery=None, fleet=None, server_id="c")  # type: ignore[arg-type]
    try:
        members = [Member("a", 5, "10.0.0.1:1"), Member("b", 4, "10.0.0.2:1"), Member("c", 4, "10.0.0.3:1")]
        names = [s.name for s in puller.sources(5, "10.0.0.8:9", members)]
        assert names == ["peer:10.0.0.2:1", "peer:10.0.0.1:1", f"mirror:{url}", "relay:10.0.0.9:7000",
                         "origin:10.0.0.8:9"]  # fmt: skip
    finally:
        puller.close()


def test_a_file_mirror_reads_a_copy_of_the_store_bit_for_bit(tmp_path: Path) -> None:
    store, history = _publish(tmp_path / "copy", 5, base_every=3)
    mirror = mirror_source((tmp_path / "copy").as_uri())
    assert mirror.name == f"mirror:{(tmp_path / 'copy').as_uri()}"
    assert mirror.plan(4, None) == store.plan(4)
    held, _ = Fetcher([mirror]).fetch(2)
    weights, stats = Fetcher([mirror]).fetch(4, held=held)
    assert stats.chain == ("v3.delta", "v4.delta") and stats.bytes_by_source.keys() == {mirror.name}
    for name, tensor in weights.named_tensors().items():
        assert torch.equal(tensor.view(torch.int32), history[4][name].view(torch.int32)), name
    with pytest.raises(VersionMissing):
        mirror_source((tmp_path / "empty").as_uri()).plan(0, None)


class _FilesMirror(LayoutMirror):
    """A layout mirror over a dict of the store's files (its relative path -> bytes), recording its reads."""

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__("mem://store")
        self.files, self.reads = files, []

    def read(self, path: str, *, timeout_s: float) -> bytes | None:
        self.reads.append(path)
        return self.files.get(path)


def test_a_layout_mirror_plans_as_the_store_does_reading_each_manifest_once(tmp_path: Path) -> None:
    store, _ = _publish(tmp_path, 12, base_every=5)
    files = {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    mirror = _FilesMirror(files)
    for version in range(12):
        for held in (None, 0, version - 1, version - 3, version):
            assert mirror.plan(version, held) == store.plan(version, held), (version, held)
    mirror.reads.clear()
    assert [(m.version, m.kind) for m in mirror.plan(11, None)] == [(10, "base"), (11, "delta")]
    assert len(mirror.reads) == len(set(mirror.reads))  # each manifest read once per plan, no listing, no chunk
    assert all(path.startswith("manifests/") for path in mirror.reads), mirror.reads
    with pytest.raises(VersionMissing, match="mirror:mem://store: v12 is not published"):
        mirror.plan(12, None)
    with pytest.raises(VersionMissing, match="by its number"):
        mirror.plan(None, None)
    assert "file" in MIRRORS
