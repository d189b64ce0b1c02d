"""The weight store over gRPC (issue 33): real servers on free loopback ports, real stores written by VersionWriter.

Every fetch is compared bit for bit with :meth:`VersionStore.fetch` of the same store (integer bit patterns,
so a NaN payload or a -0.0 that came back different fails). A corrupt byte is made in transit by a provider
that flips one byte of one chunk; a stream broken mid-chunk by a TCP proxy that cuts the connection.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tether.healthcheck import check
from tether.redis_server import free_port
from tether.v1 import weights_pb2
from weight_sync.chunk_service import ChunkServer, RemoteSource, decode_piece, encode_piece, serve
from weight_sync.sources import DirSource, Fetcher, ProviderSource, SourceUnavailable
from weight_sync.store import VersionMissing, VersionStore, VersionWriter
from weight_sync.versions import ChunkCorrupt, ChunkMissing, Weights

CHUNK = 32 * 1024  # the model below spans ~13 chunks per version
TOKEN = "s3cret-weights"


def _model(seed: int, rows: int = 300) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(rows, 256, generator=g) * 0.02,
        "norm.weight": torch.ones(256),
        "mlp.weight": torch.randn(256, rows, generator=g) * 0.02,
        "odd": torch.randn(3, 5, 7, generator=g),
    }


def _step(w: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A learner step: 10% of elements moved enough to change their bf16 bits, the rest identical."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.where(torch.rand(t.shape, generator=g) < 0.1, t + t.abs() * 2**-4 + 1e-3, t) for k, t in w.items()}


def publish(
    root: Path, versions: int = 6, *, chunk_bytes: int = CHUNK, base_every: int = 4, rows: int = 300
) -> VersionStore:
    """v1 base, v2–v3 deltas, v4 base and delta, v5–v6 deltas (with the defaults); ``rows``: the model's size
    (2 · rows · 256 elements and a few)."""
    store = VersionStore(root, fsync=False)
    publisher = VersionWriter(store, dtype="bfloat16", base_every=base_every, chunk_bytes=chunk_bytes)
    w = _model(0, rows)
    for v in range(1, versions + 1):
        publisher.publish(v, w)
        w = _step(w, v)
    return store


def unique_chunk(store: VersionStore, version: int, kind: str) -> str:
    """A chunk of that manifest that no other manifest of the store names (a flip of it is met once)."""
    named = [c.hash for v in store.versions() for k in store.kinds(v) for c in store.manifest(v, k).chunks]
    return next(c.hash for c in store.manifest(version, kind).chunks if named.count(c.hash) == 1)


def same_bits(a: Weights, b: Weights) -> bool:
    return a.version == b.version and a.layout() == b.layout() and np.array_equal(a.bits, b.bits)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> VersionStore:
    """Read only: no test here changes it."""
    return publish(tmp_path_factory.mktemp("store"))


@pytest.fixture(scope="module")
def origin(store: VersionStore) -> Iterator[ChunkServer]:
    with serve(DirSource(store.root)) as server:
        yield server


@pytest.fixture
def remote(origin: ChunkServer) -> Iterator[RemoteSource]:
    with RemoteSource(origin.address, kind="origin") as source:
        yield source


class Flipping:
    """A provider that flips one byte of one chunk on its way out (what a bad NIC or a buggy peer does)."""

    def __init__(self, inner: DirSource, digest: str) -> None:
        self.inner, self.digest = inner, digest

    def plan(self, version, held):
        return self.inner.plan(version, held)

    def chunk(self, digest: str, *, wait_s: float = 0.0) -> bytes | None:
        data = self.inner.chunk(digest, wait_s=wait_s)
        if data is None or digest != self.digest:
            return data
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0x01
        return bytes(flipped)


# -- round trips -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("version", "held"), [(6, None), (6, 5), (6, 2), (6, 6), (3, None), (None, None), (None, 4)])
def test_plans_round_trip(store: VersionStore, remote: RemoteSource, version: int | None, held: int | None) -> None:
    assert remote.plan(version, held) == DirSource(store.root).plan(version, held)


def test_fetch_rebuilds_the_published_bits(store: VersionStore, remote: RemoteSource) -> None:
    fetcher = Fetcher([remote])
    got, stats = fetcher.fetch(6)
    assert stats.chain == ("v4.base", "v5.delta", "v6.delta")  # a base and the deltas after it, over the wire
    assert same_bits(got, store.fetch(6))
    assert stats.bytes_by_source == {remote.name: got.fetched_bytes} and stats.corrupt == stats.missing == 0

    held = store.fetch(5)
    before = held.bits.copy()
    got, stats = fetcher.fetch(6, held=held)
    assert stats.chain == ("v6.delta",)
    assert same_bits(got, store.fetch(6))
    assert stats.bytes == store.manifest(6, "delta").stored_bytes
    assert np.array_equal(held.bits, before) and held.version == 5

    latest, _ = fetcher.fetch(None, held=got)
    assert latest is got  # already current: nothing fetched


def test_chunks_bigger_than_grpcs_message_limit(tmp_path: Path) -> None:
    """A 5 MiB chunk (gRPC refuses messages over 4 MiB by default) travels as 1 MiB pieces."""
    big = publish(tmp_path / "big", versions=1, chunk_bytes=5 * 2**20 + 6, rows=12_000)
    manifest = big.manifest(1, "base")
    assert max(c.size for c in manifest.chunks) > 4 * 2**20
    with serve(DirSource(big.root)) as server, RemoteSource(server.address) as source:
        for c in manifest.chunks:
            assert source.chunk(c.hash, timeout_s=30) == big.chunk_path(c.hash).read_bytes()
        got, _ = Fetcher([source]).fetch(1)
    assert same_bits(got, big.fetch(1))


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, 2**20])
def test_piece_encoding_is_protobufs(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert encode_piece(memoryview(data)) == weights_pb2.ChunkPiece(data=data).SerializeToString()
    assert weights_pb2.ChunkPiece.FromString(encode_piece(data)).data == data
    assert bytes(decode_piece(weights_pb2.ChunkPiece(data=data).SerializeToString())) == data


def test_piece_decoding_falls_back_to_protobuf() -> None:
    """A piece with another field beside the data (a newer sender) still decodes."""
    raw = weights_pb2.ChunkPiece(data=b"abc").SerializeToString() + b"\x10\x05"  # field 2 (varint) = 5
    assert bytes(decode_piece(raw)) == b"abc"


# -- corruption in transit -------------------------------------------------------------------------------------
def test_a_byte_flipped_in_transit_is_fetched_again_elsewhere(store: VersionStore, remote: RemoteSource) -> None:
    bad = unique_chunk(store, 6, "delta")
    with serve(Flipping(DirSource(store.root), bad)) as server, RemoteSource(server.address, kind="peer") as peer:
        got, stats = Fetcher([peer, remote]).fetch(6)
    assert same_bits(got, store.fetch(6))
    assert stats.corrupt == 1
    assert stats.bytes_by_source[remote.name] == store.chunk_path(bad).stat().st_size
    assert peer.name not in stats.failed_sources  # a bad chunk is refetched, the source stays in use


def test_a_byte_flipped_in_transit_with_no_other_source_leaves_the_held_weights(store: VersionStore) -> None:
    bad = unique_chunk(store, 6, "delta")
    held = store.fetch(5)
    before = held.bits.copy()
    with (
        serve(Flipping(DirSource(store.root), bad)) as server,
        RemoteSource(server.address) as peer,
        pytest.raises(ChunkCorrupt, match=r"no source served it.*fail their hash"),
    ):
        Fetcher([peer]).fetch(6, held=held)
    assert held.version == 5 and np.array_equal(held.bits, before)


# -- errors ----------------------------------------------------------------------------------------------------
def test_missing_versions_and_chunks(remote: RemoteSource) -> None:
    with pytest.raises(VersionMissing, match=r"origin:.*v99 is not published"):
        remote.plan(99, None)
    with pytest.raises(ChunkMissing, match="not held"):
        remote.chunk("0" * 32, timeout_s=10)


@pytest.mark.parametrize("digest", ["", "xyz", "A" * 32, "0" * 31, "0" * 33, "0" * 32 + "\n", "../" * 11])
def test_a_malformed_hash_is_invalid_argument(remote: RemoteSource, digest: str) -> None:
    with pytest.raises(SourceUnavailable, match=r"GetChunk failed: INVALID_ARGUMENT: .*is not a chunk hash"):
        remote.chunk(digest, timeout_s=10)


def test_bearer_token(store: VersionStore) -> None:
    with serve(DirSource(store.root), token=TOKEN) as server:
        with (
            RemoteSource(server.address) as anonymous,
            pytest.raises(SourceUnavailable, match=r"UNAUTHENTICATED: missing .*Bearer <token>.*bearer token"),
        ):
            anonymous.plan(6, None)
        with (
            RemoteSource(server.address, token="wrong") as wrong,
            pytest.raises(SourceUnavailable, match="UNAUTHENTICATED: wrong bearer token"),
        ):
            wrong.chunk(store.manifest(6, "delta").chunks[0].hash, timeout_s=10)
        with RemoteSource(server.address, token=TOKEN) as right:
            got, _ = Fetcher([right]).fetch(6)
        assert check(server.address)[0]  # health stays open for probes, which send no token
    assert same_bits(got, store.fetch(6))


def test_a_source_nobody_serves_is_unavailable() -> None:
    with RemoteSource(f"127.0.0.1:{free_port()}", kind="relay") as gone:
        with pytest.raises(SourceUnavailable, match=r"relay:127\.0\.0\.1:\d+: GetPlan failed: UNAVAILABLE"):
            gone.plan(None, None)
        with pytest.raises(SourceUnavailable, match="GetChunk failed: UNAVAILABLE"):
            gone.chunk("0" * 32, timeout_s=10)


class Stalled:
    """A provider that never has the chunk in time, and remembers how long it was asked to wait."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.release = threading.Event()

    def plan(self, version, held):
        raise VersionMissing("nothing here")

    def chunk(self, digest: str, *, wait_s: float = 0.0) -> bytes | None:
        self.waits.append(wait_s)
        self.release.wait(30)
        return None


def test_past_the_deadline_is_unavailable_and_the_wait_is_half_of_it() -> None:
    stalled = Stalled()
    with serve(stalled) as server, RemoteSource(server.address) as source:
        try:
            with pytest.raises(SourceUnavailable, match="GetChunk failed: DEADLINE_EXCEEDED"):
                source.chunk("0" * 32, timeout_s=0.4)
        finally:
            stalled.release.set()
    assert len(stalled.waits) == 1 and 0 < stalled.waits[0] <= 0.2


class CuttingProxy:
    """Forwards TCP connections to ``port`` and cuts each after ``cut_after`` bytes from the server."""

    def __init__(self, port: int, cut_after: int) -> None:
        self.port, self.cut_after, self.forwarded = port, cut_after, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.port))
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.cut_after), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                if limit is not None:
                    data = data[: limit - sent]
                dst.sendall(data)
                sent += len(data)
                if limit is not None:
                    self.forwarded = sent
                    if sent >= limit:
                        break
        except OSError:
            pass
        for s in (src, dst):  # shutdown, not just close: it wakes the other pump's recv and sends the FIN now
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.listener.close()


def test_a_stream_broken_mid_chunk_is_unavailable(tmp_path: Path) -> None:
    big = publish(tmp_path / "big", versions=1, chunk_bytes=5 * 2**20, rows=12_000)
    digest = big.manifest(1, "base").chunks[0].hash
    with serve(DirSource(big.root)) as server:
        proxy = CuttingProxy(int(server.address.rsplit(":", 1)[1]), cut_after=3 * 2**20 // 2)
        try:
            with (
                RemoteSource(proxy.address) as source,
                pytest.raises(SourceUnavailable, match=r"GetChunk failed: (UNAVAILABLE|INTERNAL|CANCELLED)"),
            ):
                source.chunk(digest, timeout_s=30)
        finally:
            proxy.close()
    assert proxy.forwarded == proxy.cut_after  # the cut came in the middle of the chunk's pieces


def test_a_fetch_falls_back_when_a_source_is_gone(store: VersionStore, remote: RemoteSource) -> None:
    with RemoteSource(f"127.0.0.1:{free_port()}", kind="peer") as gone:
        got, stats = Fetcher([gone, ProviderSource(DirSource(store.root)), remote]).fetch(6)
    assert same_bits(got, store.fetch(6))
    assert list(stats.failed_sources) == [gone.name] and "UNAVAILABLE" in stats.failed_sources[gone.name]
