"""Bucketing: the layout of an update (names, dtypes, shapes → bucket and byte offset) and flat buffers.

Sending one collective per tensor pays a round trip per tensor (hundreds for a 7B model), so tensors of
one dtype are packed back to back into flat ``uint8`` buffers of at most ``bucket_size_mb``. The layout
is computed from metadata alone (a DTensor knows its global shape and dtype without gathering), so the
learner announces the whole plan before it gathers anything, and the receiver can allocate and later
slice each bucket without any further metadata. A tensor larger than the bucket size gets a bucket of
its own. Offsets are aligned to 16 bytes so every view is aligned for any dtype.

Everything here is pure tensor code: the same functions pack on the learner, unpack on a receiver, and
write/read filesystem snapshots.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tether.v1 import control_pb2

_ALIGN = 16


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the proto's spelling)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a weight-update plan")
    return dtype


@dataclass(frozen=True)
class Layout:
    """Where each tensor of an update lives: ``tensors[i].bucket`` / ``offset_bytes`` into ``buckets``."""

    tensors: list[control_pb2.TensorMeta]
    buckets: list[control_pb2.Bucket]

    @property
    def num_bytes(self) -> int:
        return sum(b.num_bytes for b in self.buckets)

    def bucket_members(self) -> list[list[control_pb2.TensorMeta]]:
        members: list[list[control_pb2.TensorMeta]] = [[] for _ in self.buckets]
        for meta in self.tensors:
            members[meta.bucket].append(meta)
        return members

    @staticmethod
    def from_plan(plan: control_pb2.WeightUpdatePlan) -> Layout:
        return Layout(tensors=list(plan.tensors), buckets=list(plan.buckets))


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * dtype.itemsize


def plan_layout(metas: Iterable[tuple[str, torch.dtype, Sequence[int]]], *, bucket_size_bytes: int) -> Layout:
    """Assign each ``(name, dtype, shape)`` a bucket and an offset, keeping the input order per dtype.

    The input order is the gather order, so buckets fill and can be sent in the order tensors are
    gathered; one open bucket per dtype keeps the packing independent of how dtypes interleave.
    """
    if bucket_size_bytes <= 0:
        raise ValueError("bucket_size_bytes must be positive")
    tensors: list[control_pb2.TensorMeta] = []
    buckets: list[control_pb2.Bucket] = []
    open_bucket: dict[torch.dtype, int] = {}
    for name, dtype, shape in metas:
        size = _nbytes(shape, dtype)
        index = open_bucket.get(dtype)
        if index is not None:
            start = -(-buckets[index].num_bytes // _ALIGN) * _ALIGN
            if start + size > bucket_size_bytes:
                index = None
        if index is None:
            index = len(buckets)
            buckets.append(control_pb2.Bucket(dtype=dtype_name(dtype), num_bytes=0))
            open_bucket[dtype] = index
            start = 0
        buckets[index].num_bytes = start + size
        tensors.append(
            control_pb2.TensorMeta(
                name=name, dtype=dtype_name(dtype), shape=list(shape), bucket=index, offset_bytes=start
            )
        )
    # Renumber buckets in the order they complete (their last member), so the sender can send bucket
    # k as soon as it is full and receivers take them in index order even when dtypes interleave.
    last = {meta.bucket: i for i, meta in enumerate(tensors)}
    order = sorted(range(len(buckets)), key=lambda b: last[b])
    renumber = {old: new for new, old in enumerate(order)}
    for meta in tensors:
        meta.bucket = renumber[meta.bucket]
    return Layout(tensors=tensors, buckets=[buckets[old] for old in order])


def bucket_ready_order(layout: Layout) -> list[int]:
    """After the i-th tensor (gather order) is packed, which buckets are complete: index of the last member."""
    last: dict[int, int] = {}
    for i, meta in enumerate(layout.tensors):
        last[meta.bucket] = i
    return [last.get(b, -1) for b in range(len(layout.buckets))]


@dataclass(frozen=True)
class Segment:
    """One broadcast of an update: bytes ``[start, end)`` of ``bucket``, holding tensors ``members``
    (indices into ``Layout.tensors``); ``direct``: one tensor, sent straight from where it was gathered."""

    bucket: int
    start: int
    end: int
    members: tuple[int, ...]
    direct: bool

    @property
    def num_bytes(self) -> int:
        return self.end - self.start


def plan_segments(layout: Layout, *, min_bytes: int) -> list[Segment]:
    """Cut each bucket into the broadcasts that carry it, in the order sender and receivers issue them.

    A tensor of at least ``min_bytes`` is a segment of its own, so the learner broadcasts the gathered
    tensor itself (no copy into a bucket) and the receiver receives it into its place in the bucket
    (which the receiver then adopts as the parameter); a run of consecutive smaller tensors of one bucket
    is one segment, packed as before. ``min_bytes`` 0 makes every bucket one segment (whole-bucket
    broadcasts). Segments are ordered by their last tensor's place in the gather order, which is when
    the sender can send them; both sides compute the same list from the plan.
    """
    segments: list[tuple[int, Segment]] = []
    for bucket, members in enumerate(_member_indices(layout)):
        run: list[int] = []
        for i in members:
            if min_bytes > 0 and tensor_bytes(layout.tensors[i]) >= min_bytes:
                if run:
                    segments.append(_segment(layout, bucket, run, direct=False))
                    run = []
                segments.append(_segment(layout, bucket, [i], direct=True))
            else:
                run.append(i)
        if run:
            segments.append(_segment(layout, bucket, run, direct=False))
    return [segment for _, segment in sorted(segments, key=lambda pair: pair[0])]


def _member_indices(layout: Layout) -> list[list[int]]:
    members: list[list[int]] = [[] for _ in layout.buckets]
    for i, meta in enumerate(layout.tensors):
        members[meta.bucket].append(i)
    return members


def tensor_bytes(meta: control_pb2.TensorMeta) -> int:
    """Bytes of the tensor ``meta`` describes."""
    return _nbytes(meta.shape, dtype_from_name(meta.dtype))


def _segment(layout: Layout, bucket: int, members: list[int], *, direct: bool) -> tuple[int, Segment]:
    first, last = layout.tensors[members[0]], layout.tensors[members[-1]]
    end = last.offset_bytes + tensor_bytes(last)
    return members[-1], Segment(bucket, first.offset_bytes, end, tuple(members), direct)


def empty_bucket(bucket: control_pb2.Bucket, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(int(bucket.num_bytes), dtype=torch.uint8, device=device)


class BufferPool:
    """Bucket-sized flat buffers that outlive an update, so the next one packs into warm memory.

    A fresh CPU buffer of hundreds of MB is a fresh ``mmap``: every page faults (and is zeroed) on first
    touch, which made packing run at ~1 GB/s instead of memcpy speed (~6 GB/s, measured on the 2-core
    CI box) — slower than the wire it feeds. Every slot has the capacity of the largest bucket of the
    layout, so any bucket fits any slot (a bucket is the prefix ``slot[:num_bytes]``). The pool only
    grows when every slot is busy; the sender keeps at most two buckets' worth on the wire plus one open
    bucket per dtype, which bounds it at a few buckets, never the whole model (a background publication
    stages every bucket at once: then one slot per bucket).

    A slot's memory is resident only as far as it was ever written (its pages fault in on first touch), so
    :meth:`take` hands out the free slot already warm for ``nbytes`` with the least to spare, else the warmest:
    each bucket comes back to the slot it used before. Taken in turn, a slot that once held the largest
    bucket would hold a small one and a small one's slot the largest — on Gemma 3 (a 671 MB embedding bucket
    among 256 MB ones) the learner's RSS between steps grew 5.5 -> 6.0 -> 6.3 GB over three background
    publications; now it stays at 5.4.
    """

    def __init__(self, capacity_bytes: int, device: torch.device | str = "cpu") -> None:
        self.capacity = int(capacity_bytes)
        self.device = torch.device(device)
        self._free: list[torch.Tensor] = []
        self._warm: dict[int, int] = {}  # slot's data_ptr -> the most bytes of it ever handed out
        self.allocated = 0
        """Slots created so far (each ``capacity`` bytes)."""

    def take(self, nbytes: int | None = None) -> torch.Tensor:
        """A free slot for a bucket of ``nbytes`` (default: the capacity)."""
        need = self.capacity if nbytes is None else int(nbytes)
        if self._free:
            warm = [self._warm[s.data_ptr()] for s in self._free]
            fits = [i for i, w in enumerate(warm) if w >= need]
            i = min(fits, key=warm.__getitem__) if fits else max(range(len(warm)), key=warm.__getitem__)
            slot = self._free.pop(i)
        else:
            self.allocated += 1
            slot = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        self._warm[slot.data_ptr()] = max(self._warm.get(slot.data_ptr(), 0), need)
        return slot

    def give(self, slot: torch.Tensor) -> None:
        """Return a slot once nothing reads it any more (its broadcast finished, its shard is written)."""
        self._free.append(slot)


def view(flat: torch.Tensor, meta: control_pb2.TensorMeta) -> torch.Tensor:
    """The tensor ``meta`` describes, as a view into its bucket's flat ``uint8`` buffer (no copy)."""
    dtype = dtype_from_name(meta.dtype)
    shape = [int(s) for s in meta.shape]
    size = _nbytes(shape, dtype)
    chunk = flat[meta.offset_bytes : meta.offset_bytes + size]
    return chunk.view(dtype).view(shape)


def pack_into(flat: torch.Tensor, meta: control_pb2.TensorMeta, tensor: torch.Tensor) -> None:
    target = view(flat, meta)
    _check(meta, tensor)
    target.copy_(tensor)


def as_bytes(meta: control_pb2.TensorMeta, tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous ``tensor``'s own memory as the flat ``uint8`` bytes its segment carries (no copy)."""
    _check(meta, tensor)
    return tensor.reshape(-1).view(torch.uint8)


def _check(meta: control_pb2.TensorMeta, tensor: torch.Tensor) -> None:
    shape = tuple(int(s) for s in meta.shape)
    if tuple(tensor.shape) != shape or dtype_name(tensor.dtype) != meta.dtype:
        raise ValueError(f"{meta.name}: tensor is {tuple(tensor.shape)} {tensor.dtype}, plan says {shape} {meta.dtype}")


def unpack(flat: torch.Tensor, members: Iterable[control_pb2.TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    return [(meta.name, view(flat, meta)) for meta in members]


def checksum(tensor: torch.Tensor) -> float:
    """Sum in float64: equal tensors give equal sums on every process (the proto's verification value)."""
    return float(tensor.detach().to(torch.float64).sum().item())
