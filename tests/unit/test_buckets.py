"""Bucketing: layout rules, and bucketed transfer gives exactly the per-tensor result."""

from __future__ import annotations

import torch

from tether.v1 import control_pb2
from weight_sync.buckets import (
    BufferPool,
    Layout,
    as_bytes,
    bucket_ready_order,
    empty_bucket,
    pack_into,
    plan_layout,
    plan_segments,
    tensor_bytes,
    unpack,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(64, 32, generator=g),
        "norm": torch.randn(32, generator=g).to(torch.bfloat16),
        "q": torch.randn(32, 32, generator=g),
        "step": torch.tensor([7, 8, 9], dtype=torch.int64),
        "k": torch.randn(16, 32, generator=g).to(torch.bfloat16),
        "big": torch.randn(300, 32, generator=g),
        "scalar": torch.tensor(3.5),
    }


def _roundtrip(tensors: dict[str, torch.Tensor], bucket_size_bytes: int) -> dict[str, torch.Tensor]:
    layout = plan_layout(
        ((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), bucket_size_bytes=bucket_size_bytes
    )
    # What travels: the plan as protobuf bytes, then one flat buffer per bucket.
    plan = control_pb2.WeightUpdatePlan.FromString(
        control_pb2.WeightUpdatePlan(tensors=layout.tensors, buckets=layout.buckets).SerializeToString()
    )
    flats = [empty_bucket(b) for b in layout.buckets]
    for meta in layout.tensors:
        pack_into(flats[meta.bucket], meta, tensors[meta.name])
    received = Layout.from_plan(plan)
    out = {}
    for flat, members in zip(flats, received.bucket_members(), strict=True):
        out.update({name: t.clone() for name, t in unpack(flat.clone(), members)})
    return out


def test_bucketed_and_per_tensor_transfer_give_identical_tensors() -> None:
    tensors = _tensors()
    bucketed = _roundtrip(tensors, bucket_size_bytes=8 << 10)
    per_tensor = _roundtrip(tensors, bucket_size_bytes=1)  # every tensor alone in its bucket
    assert set(bucketed) == set(per_tensor) == set(tensors)
    for name, t in tensors.items():
        torch.testing.assert_close(bucketed[name], t, rtol=0, atol=0)
        torch.testing.assert_close(per_tensor[name], t, rtol=0, atol=0)
        assert bucketed[name].dtype == t.dtype and bucketed[name].shape == t.shape


def test_layout_respects_bucket_size_alignment_and_dtype() -> None:
    tensors = _tensors()
    size = 8 << 10
    layout = plan_layout(((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), bucket_size_bytes=size)
    for meta in layout.tensors:
        bucket = layout.buckets[meta.bucket]
        assert meta.dtype == bucket.dtype
        assert meta.offset_bytes % 16 == 0
        nbytes = tensors[meta.name].numel() * tensors[meta.name].element_size()
        assert meta.offset_bytes + nbytes <= bucket.num_bytes
    for bucket, members in zip(layout.buckets, layout.bucket_members(), strict=True):
        # Only a tensor bigger than the bucket size gets a bigger bucket, and then it is alone.
        assert bucket.num_bytes <= size or len(members) == 1
    assert len(layout.buckets) == len({m.bucket for m in layout.tensors})


def test_buckets_are_numbered_in_the_order_they_fill() -> None:
    # Interleaved dtypes: the float32 bucket opened first fills last; it must not block the bf16 one.
    metas = [("a", torch.float32, (4,)), ("b", torch.bfloat16, (4,)), ("c", torch.bfloat16, (4,))]
    metas += [("d", torch.float32, (4,))]
    layout = plan_layout(metas, bucket_size_bytes=64)
    assert [m.bucket for m in layout.tensors] == [1, 0, 0, 1]
    last = bucket_ready_order(layout)
    assert last == sorted(last) == [2, 3]


def test_buffer_pool_reuses_slots_it_was_given_back() -> None:
    pool = BufferPool(64)
    a, b = pool.take(), pool.take()
    assert pool.allocated == 2 and a.numel() == b.numel() == 64
    pool.give(a)
    assert pool.take().data_ptr() == a.data_ptr()  # the warm slot, not a fresh allocation
    assert pool.allocated == 2


def test_buffer_pool_gives_each_bucket_back_the_slot_it_warmed() -> None:
    """A staged publication takes one slot per bucket, one bucket much larger than the rest; given back and
    taken again in any order, each size gets a slot already warm for it, so the bytes ever touched stay the
    sum of the buckets instead of drifting towards slots x the largest."""
    pool = BufferPool(100)
    sizes = [30, 100, 30, 30]
    slots = [pool.take(n) for n in sizes]
    for _ in range(4):
        for slot in reversed(slots):  # returned last-taken first: a plain stack would hand the big slot to 30
            pool.give(slot)
        slots = [pool.take(n) for n in sizes]
        assert pool.allocated == 4
        assert sum(pool._warm.values()) == sum(sizes)
    pool.give(slots[0])
    assert pool.take().data_ptr() == slots[0].data_ptr()  # no size asked: the capacity


def test_segments_cover_each_tensor_once_in_the_order_they_fill() -> None:
    tensors = _tensors()
    layout = plan_layout(((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), bucket_size_bytes=8 << 10)
    whole = plan_segments(layout, min_bytes=0)  # the old protocol: one broadcast per bucket, in bucket order
    assert [(s.bucket, s.start, s.end) for s in whole] == [(b, 0, x.num_bytes) for b, x in enumerate(layout.buckets)]
    segments = plan_segments(layout, min_bytes=1024)
    assert sorted(i for s in segments for i in s.members) == list(range(len(layout.tensors)))
    assert [s.members[-1] for s in segments] == sorted(s.members[-1] for s in segments)
    for s in segments:
        sizes = [tensor_bytes(layout.tensors[i]) for i in s.members]
        assert {layout.tensors[i].bucket for i in s.members} == {s.bucket}
        assert s.direct == (sizes[0] >= 1024) and (len(sizes) == 1 or not s.direct)
        assert all(size < 1024 for size in sizes) or s.direct
        assert s.start == layout.tensors[s.members[0]].offset_bytes and s.end <= layout.buckets[s.bucket].num_bytes
    assert {s.direct for s in segments} == {True, False}


def test_segmented_transfer_gives_identical_tensors() -> None:
    # The sender's bytes per segment: a direct tensor's own memory, or the packed run; the receiver puts
    # each segment into its byte range of the bucket and views the tensors there.
    tensors = _tensors()
    layout = plan_layout(((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), bucket_size_bytes=8 << 10)
    packed = [empty_bucket(b) for b in layout.buckets]
    for meta in layout.tensors:
        pack_into(packed[meta.bucket], meta, tensors[meta.name])
    received = [torch.zeros(b.num_bytes, dtype=torch.uint8) for b in layout.buckets]
    for s in plan_segments(layout, min_bytes=1024):
        meta = layout.tensors[s.members[0]]
        sent = as_bytes(meta, tensors[meta.name]) if s.direct else packed[s.bucket][s.start : s.end]
        received[s.bucket][s.start : s.end].copy_(sent)
    for flat, members in zip(received, layout.bucket_members(), strict=True):
        for name, t in unpack(flat, members):
            torch.testing.assert_close(t, tensors[name], rtol=0, atol=0)
            assert t.dtype == tensors[name].dtype
