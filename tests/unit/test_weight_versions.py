"""Weights as versions (issue 33): chunk encodings, manifests, the directory store, its pruning.

Every round trip is checked on raw bit patterns (``torch.equal`` on an integer view), so a float that
comes back merely close, a NaN with another payload or a -0.0 turned into 0.0 fails. The weights change
the way a learner step changes them: a share of elements moved by a small relative step (enough to
flip their bits in the publish dtype), the rest bit-identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from weight_sync.delta import ENCODINGS, Codec, as_bits, decode_chunk, encode_chunk, torch_dtype
from weight_sync.manifest import Manifest, ManifestError
from weight_sync.store import VersionMissing, VersionStore, VersionWriter
from weight_sync.versions import ChunkCorrupt, NotHeld, decode_version, encode_version, flatten

CHUNK = 8 * 1024  # bytes: the model below spans many chunks, and chunks span tensor boundaries


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {
        "embed.weight": torch.randn(97, 64, generator=g) * 0.02,
        "layers.0.q.weight": torch.randn(64, 64, generator=g) * 0.02,
        "layers.0.q.bias": torch.zeros(64),
        "layers.0.norm.weight": torch.ones(64),
        "layers.0.mlp.weight": torch.randn(128, 64, generator=g) * 0.02,
        "odd": torch.randn(3, 5, 7, generator=g),
    }
    w["odd"].view(-1)[:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    return w


def _step(w: dict[str, torch.Tensor], share: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy of ``w`` with ``share`` of its elements moved by 2^-4 relative (always a new bf16/fp32 value)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in w.items():
        moved = torch.rand(t.shape, generator=g) < share
        new = torch.where(moved, t + t.abs() * 2**-4 + 1e-3, t)  # up, never back onto the same bits
        out[name] = new
    return out


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert list(a) == list(b)
    return all(torch.equal(a[k].view(torch.int16 if a[k].element_size() == 2 else torch.int32),
                           b[k].view(torch.int16 if b[k].element_size() == 2 else torch.int32)) for k in a)  # fmt: skip


def _expected(w: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    return {k: t.to(torch_dtype(dtype)) for k, t in w.items()}


def _reader(payloads):
    return lambda manifest: lambda k: payloads[manifest.chunks[k].hash]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("share", [0.0, 0.03, 1.0])
def test_round_trip_is_bit_exact(dtype: str, encoding: str, share: float) -> None:
    w0 = _model()
    w1 = _step(w0, share, seed=1)
    old = flatten(w0, version=4, dtype=dtype)
    new = flatten(w1, version=5, dtype=dtype)
    changed = np.count_nonzero(old.bits != new.bits) / old.bits.size
    assert abs(changed - share) < 0.02  # the change rate the test claims to cover
    manifest, payloads = encode_version(new, old, chunk_bytes=CHUNK, allow=(encoding,))
    assert len(manifest.chunks) > 3 and {c.encoding for c in manifest.chunks} == {encoding}
    manifest = Manifest.from_json(manifest.to_json())  # what a reader sees went through JSON
    snapshot = old.bits.copy()
    got = decode_version(manifest, _reader(payloads)(manifest), old)
    assert got.version == 5 and _bits_equal(got.named_tensors(), _expected(w1, dtype))
    assert np.array_equal(old.bits, snapshot)  # the held weights are not touched

    base, payloads = encode_version(new, None, chunk_bytes=CHUNK)
    assert base.is_base and {c.encoding for c in base.chunks} == {"full"}
    assert _bits_equal(decode_version(base, _reader(payloads)(base), None).named_tensors(), _expected(w1, dtype))


def test_picker_takes_sparse_for_few_changes_xor_for_many_full_for_noise() -> None:
    codec = Codec()
    rng = np.random.default_rng(0)
    weights = torch.from_numpy(rng.normal(0, 0.02, 1 << 20).astype(np.float32))  # a 2 MiB bf16 chunk
    old = as_bits(weights.bfloat16())

    def pick(new_fp32: torch.Tensor) -> str:
        new = as_bits(new_fp32.bfloat16())
        encoding, payload = encode_chunk(new, old, codec)
        sizes = {e: len(encode_chunk(new, old, codec, allow=(e,))[1]) for e in ENCODINGS}
        assert len(payload) == min(sizes.values()), sizes  # the pick is the smallest of the three
        assert np.array_equal(decode_chunk(encoding, payload, old, count=new.size, dtype=new.dtype, codec=codec), new)
        return encoding

    few = weights.clone()
    few[rng.choice(few.numel(), 10_000, replace=False)] *= 1.1  # 1 % of the elements
    assert pick(few) == "sparse"
    many = weights * (1 + 2**-7) + torch.from_numpy(rng.normal(0, 1e-4, weights.numel()).astype(np.float32))
    assert np.count_nonzero(as_bits(many.bfloat16()) != old) > 0.5 * old.size
    assert pick(many) == "xor_zstd"
    noise = torch.from_numpy(rng.integers(0, 2**16, 1 << 20, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    assert pick(noise.float()) == "full"  # random bits: no delta is smaller than the bits themselves


def _publish(root: Path, versions: int, *, base_every: int = 10, share: float = 0.03, dtype: str = "bfloat16"):
    store = VersionStore(root, fsync=False)
    pub = VersionWriter(store, dtype=dtype, base_every=base_every, chunk_bytes=CHUNK)
    w, history = _model(), []
    for v in range(versions):
        if v:
            w = _step(w, share, seed=v)
        pub.publish(v, w)
        history.append(_expected(w, dtype))
    return store, history


def test_new_reader_at_23_reads_base_20_and_deltas_21_to_23(tmp_path: Path) -> None:
    store, history = _publish(tmp_path, 24, base_every=10)
    plan = store.plan(23)
    assert [(m.version, m.kind) for m in plan] == [(20, "base"), (21, "delta"), (22, "delta"), (23, "delta")]
    got = store.fetch(23)
    assert got.version == 23 and _bits_equal(got.named_tensors(), history[23])
    assert got.fetched_bytes == sum(m.stored_bytes for m in plan)
    # A reader that keeps up takes v20 as a delta (published beside the base), never the base.
    at19 = store.fetch(19)
    assert [(m.version, m.kind) for m in store.plan(23, 19)] == [(v, "delta") for v in (20, 21, 22, 23)]
    got = store.fetch(23, held=at19)
    assert _bits_equal(got.named_tensors(), history[23]) and _bits_equal(at19.named_tensors(), history[19])
    assert store.fetch(23, held=got) is got
    # A receiver's second set: the next version lands in the buffer it no longer needs, not a fresh one.
    spare = store.fetch(21)
    got = store.fetch(22, held=at19, reuse=spare)
    assert got.bits is spare.bits and _bits_equal(got.named_tensors(), history[22])
    with pytest.raises(ValueError, match="shares memory with the held v22"):
        store.fetch(23, held=got, reuse=got)


def test_float32_publication(tmp_path: Path) -> None:
    store, history = _publish(tmp_path, 4, base_every=3, dtype="float32")
    assert [(m.version, m.kind) for m in store.plan(2)] == [(0, "base"), (1, "delta"), (2, "delta")]
    for v in range(4):
        assert _bits_equal(store.fetch(v).named_tensors(), history[v])


def test_flipped_byte_in_a_chunk_is_detected_and_named(tmp_path: Path) -> None:
    store, _ = _publish(tmp_path, 2, share=0.5)
    held = store.fetch(0)
    manifest = store.manifest(1, "delta")
    k = 2
    path = store.chunk_path(manifest.chunks[k].hash)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    snapshot = held.bits.copy()
    with pytest.raises(ChunkCorrupt) as err:
        store.fetch(1, held=held)
    msg = str(err.value)
    assert "v1 (delta) chunk 2 of" in msg and manifest.chunks[k].hash in msg
    assert "the stored bytes do not match their hash (2 reads of" in msg  # the store's check, read twice
    names = [t.name for t in manifest.tensors if t.offset < manifest.chunks[k].start + manifest.chunks[k].count
             and t.offset + t.numel > manifest.chunks[k].start]  # fmt: skip
    assert names and names[0] in msg
    assert np.array_equal(held.bits, snapshot)
    with pytest.raises(ChunkCorrupt):  # from nothing too: base 0 then the same delta
        store.fetch(1)
    # The decoder checks the bytes itself before decoding them, whatever the reader callable does.
    with pytest.raises(ChunkCorrupt, match=r"chunk 2 of .*: the stored bytes do not match their hash$"):
        decode_version(manifest, lambda i: store.chunk_path(manifest.chunks[i].hash).read_bytes(), held)


def test_a_torn_read_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, history = _publish(tmp_path, 2, share=0.5)
    torn = store.chunk_path(store.manifest(1, "delta").chunks[1].hash)
    real, reads = Path.read_bytes, []

    def read_bytes(self: Path) -> bytes:
        data = real(self)
        if self == torn:
            reads.append(self)
            if len(reads) == 1:
                return data[: len(data) // 2]  # the first read comes back short
        return data

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    assert _bits_equal(store.fetch(1, held=store.fetch(0)).named_tensors(), history[1]) and len(reads) == 2


def test_delta_against_weights_the_reader_does_not_hold_is_refused(tmp_path: Path) -> None:
    store, _ = _publish(tmp_path, 4)
    delta3 = store.manifest(3, "delta")
    read = store._reader(delta3, retries=0)
    with pytest.raises(NotHeld, match="v3 is a delta against v2, and this reader holds v1"):
        decode_version(delta3, read, store.fetch(1))
    with pytest.raises(NotHeld, match="holds no weights"):
        decode_version(delta3, read, None)
    # Weights that claim to be v2 but are not: the decoded chunks fail their published hash.
    fake = store.fetch(2)
    fake.bits[fake.bits.size // 2] ^= 0x4000
    with pytest.raises(ChunkCorrupt, match="not the published v2"):
        decode_version(delta3, read, fake)


def test_manifest_is_written_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = VersionStore(tmp_path, fsync=False)
    pub = VersionWriter(store, chunk_bytes=CHUNK)

    def crash(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(VersionStore, "_write_manifest", crash)
    with pytest.raises(OSError):
        pub.publish(0, _model())
    assert any(p.is_file() for p in store.chunks_dir.rglob("*"))  # the chunks were written first
    assert store.versions() == [] and store.latest() is None
    with pytest.raises(VersionMissing, match="no version published"):
        store.fetch()
    monkeypatch.undo()

    calls = []

    def chunk_then_crash(self, digest, payload):
        calls.append(digest)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(self, digest, payload)

    real = VersionStore._write_chunk
    monkeypatch.setattr(VersionStore, "_write_chunk", chunk_then_crash)
    with pytest.raises(OSError):
        VersionWriter(store, chunk_bytes=CHUNK).publish(0, _model(1))
    assert store.versions() == []
    store.manifests_dir.mkdir(parents=True, exist_ok=True)
    (store.manifests_dir / ".tmp-v00000000.base.json-1234").write_text("{}")  # a crashed rename
    assert store.versions() == []


def test_prune_keeps_the_bases_later_deltas_need(tmp_path: Path) -> None:
    store, history = _publish(tmp_path, 24, base_every=10)
    store.prune(keep=5)  # 19..23: 19 needs base 10 and deltas 11..19
    assert "base" in store.kinds(10) and store.kinds(0) == set() and store.versions()[0] == 10
    assert _bits_equal(store.fetch(19).named_tensors(), history[19])
    removed, gone = store.prune(keep=2)  # 22, 23: base 20 and deltas 21..23
    assert store.versions() == [20, 21, 22, 23] and store.kinds(20) == {"base"} and removed > 0 and gone > 0
    named = {c.hash for v in store.versions() for kind in store.kinds(v) for c in store.manifest(v, kind).chunks}
    on_disk = {p.name for p in store.chunks_dir.rglob("*") if p.is_file()}
    assert on_disk == named  # every chunk a manifest needs is there, and nothing else
    for v in (22, 23):
        assert _bits_equal(store.fetch(v).named_tensors(), history[v])
    with pytest.raises(VersionMissing, match="v10 is not published"):
        store.fetch(10)


def test_publish_once_and_manifest_errors(tmp_path: Path) -> None:
    store, _ = _publish(tmp_path, 2)
    manifest = store.manifest(1, "delta")
    with pytest.raises(Exception, match="published once"):
        store.write(manifest, {c.hash: store.chunk_path(c.hash).read_bytes() for c in manifest.chunks})
    good = json.loads(manifest.to_json())
    assert Manifest.from_json(json.dumps(good)) == manifest
    for change, msg in (
        ({"format": "tether-weights/0"}, "format"),
        ({"dtype": "int8"}, "publish dtype"),
        ({"chunks": good["chunks"][:-1]}, "chunks cover"),
        ({"base_version": None}, "in a base version"),
        ({"version": -1}, "base_version"),
    ):
        with pytest.raises(ManifestError, match=msg):
            Manifest.from_json(json.dumps({**good, **change}), where="test")
    with pytest.raises(ManifestError, match="not JSON"):
        Manifest.from_json(b"\x00{")
