"""Weight versions encoded and decoded on a pool of threads: the same manifest as one thread, bit-exact round
trips, and a bad chunk still fails the whole decode with the held weights untouched.

The model and the learner-like step are those of ``test_weight_versions.py``; chunks are 1 KiB so the
model spans dozens of them and every worker gets several.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tests.unit.test_weight_versions import _bits_equal, _expected, _model, _step
from weight_sync import versions
from weight_sync.delta import ENCODINGS, Codec, as_bits, decode_chunk, encode_chunk
from weight_sync.manifest import Manifest
from weight_sync.versions import ChunkCorrupt, ChunkMissing, decode_version, encode_version, flatten

THREADS = 3  # more than this machine's cores is fine: the result must not depend on it
CHUNK = 1024  # bytes: the model spans 37 (bfloat16) to 74 (float32) chunks, several per worker


def _pool_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("weight-chunks")]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("share", [0.0, 0.03, 0.4, 1.0])
def test_threaded_manifest_is_the_one_thread_manifest_and_round_trips(dtype: str, share: float) -> None:
    w0 = _model()
    w1 = _step(w0, share, seed=1)
    old = flatten(w0, version=4, dtype=dtype)
    new = flatten(w1, version=5, dtype=dtype)
    for prev in (old, None):  # a delta, then a base
        one, p_one = encode_version(new, prev, chunk_bytes=CHUNK, threads=1)
        many, p_many = encode_version(new, prev, chunk_bytes=CHUNK, threads=THREADS)
        assert len(one.chunks) > 3 * THREADS
        assert many.chunks == one.chunks  # start, count, encoding, size, both hashes, in the same order
        assert {h: bytes(p) for h, p in p_many.items()} == {h: bytes(p) for h, p in p_one.items()}
        manifest = Manifest.from_json(many.to_json())
        snapshot = old.bits.copy()
        for threads in (1, THREADS, None):
            got = decode_version(manifest, lambda k, m=manifest, p=p_many: p[m.chunks[k].hash], prev, threads=threads)
            assert got.version == 5 and _bits_equal(got.named_tensors(), _expected(w1, dtype))
        assert np.array_equal(old.bits, snapshot)  # the held weights are not touched
    assert not _pool_threads()  # every pool is shut down when its call returns


def test_a_corrupt_chunk_in_a_threaded_decode_raises_and_leaves_held_untouched() -> None:
    held = flatten(_model(), version=0, dtype="bfloat16")
    cur = flatten(_step(_model(), 0.5, seed=1), version=1, dtype="bfloat16")
    manifest, payloads = encode_version(cur, held, chunk_bytes=CHUNK, threads=THREADS)
    snapshot = held.bits.copy()
    last = len(manifest.chunks) - 1
    for k in (0, 5, last):
        bad = dict(payloads)
        data = bytearray(bad[manifest.chunks[k].hash])
        data[len(data) // 2] ^= 0x01
        bad[manifest.chunks[k].hash] = bytes(data)
        spare = flatten(_model(7), version=0, dtype="bfloat16")
        with pytest.raises(ChunkCorrupt, match=rf"chunk {k} of .*: the stored bytes do not match their hash$"):
            decode_version(manifest, lambda i, b=bad: b[manifest.chunks[i].hash], held, reuse=spare, threads=THREADS)
        assert np.array_equal(held.bits, snapshot)
        assert not _pool_threads()  # no worker is left writing into ``spare`` after the error

    # Held weights that are not the version the delta is against: every chunk decodes, the bits do not hash.
    fake = flatten(_model(), version=0, dtype="bfloat16")
    fake.bits[fake.bits.size // 2] ^= 0x4000
    fake_snapshot = fake.bits.copy()
    with pytest.raises(ChunkCorrupt, match="not the published v0"):
        decode_version(manifest, lambda i: payloads[manifest.chunks[i].hash], fake, threads=THREADS)
    assert np.array_equal(fake.bits, fake_snapshot)


def test_threaded_decode_reports_the_first_bad_chunk_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A corrupt chunk 2 still being checked on a worker when the reader fails at chunk 4: chunk 2 is the
    error, as with one thread; the reader is called on the calling thread, in order, and never past the
    failure."""
    held = flatten(_model(), version=0, dtype="bfloat16")
    cur = flatten(_step(_model(), 0.5, seed=1), version=1, dtype="bfloat16")
    manifest, payloads = encode_version(cur, held, chunk_bytes=CHUNK)
    data = bytearray(payloads[manifest.chunks[2].hash])
    data[-1] ^= 0xFF
    corrupt = bytes(data)
    real_hash = versions.content_hash

    def slow_on_the_corrupt_chunk(payload: bytes | memoryview) -> str:
        if payload is corrupt:  # still running when the reader fails at chunk 4
            time.sleep(0.2)
        return real_hash(payload)

    monkeypatch.setattr(versions, "content_hash", slow_on_the_corrupt_chunk)
    calls: list[tuple[int, str]] = []

    def read(k: int) -> bytes:
        calls.append((k, threading.current_thread().name))
        if k == 4:
            raise ChunkMissing(f"chunk {k} is gone")
        return corrupt if k == 2 else payloads[manifest.chunks[k].hash]

    for threads in (1, THREADS):
        calls.clear()
        with pytest.raises(ChunkCorrupt, match="chunk 2 of"):
            decode_version(manifest, read, held, threads=threads)
        assert [k for k, _ in calls] == list(range(len(calls))) and calls[-1][0] <= 4
        assert {name for _, name in calls} == {threading.current_thread().name}
        assert not _pool_threads()
    with pytest.raises(ChunkMissing, match="chunk 4 is gone"):  # nothing bad before it: the reader's error
        decode_version(
            manifest, lambda k: read(k) if k != 2 else payloads[manifest.chunks[2].hash], held, threads=THREADS
        )


def test_threads_must_be_a_positive_count() -> None:
    weights = flatten(_model(), version=0, dtype="bfloat16")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads must be an integer >= 1"):
            encode_version(weights, None, chunk_bytes=CHUNK, threads=bad)  # type: ignore[arg-type]


def test_clustered_changes_still_get_the_smallest_encoding() -> None:
    """Below XOR_MIN_SHARE only sparse is tried for spread changes; a run of changed elements (a whole tensor
    in a chunk of otherwise unchanged ones) is where xor_zstd can be the smaller, so it is tried there too."""
    codec = Codec()
    rng = np.random.default_rng(0)
    weights = torch.from_numpy(rng.normal(0, 0.02, 1 << 20).astype(np.float32))
    old = as_bits(weights.bfloat16())
    for lo, hi in ((0, 10_000), (500_000, 560_000)):  # 1 % and 6 %, each one run
        moved = weights.clone()
        moved[lo:hi] *= 1.01
        new = as_bits(moved.bfloat16())
        encoding, payload = encode_chunk(new, old, codec)
        sizes = {e: len(encode_chunk(new, old, codec, allow=(e,))[1]) for e in ENCODINGS}
        assert len(payload) == min(sizes.values()), sizes
        back = decode_chunk(encoding, payload, old, count=new.size, dtype=new.dtype, codec=codec)
        assert np.array_equal(back, new)
