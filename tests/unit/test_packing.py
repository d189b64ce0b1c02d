"""Packed and padded micro-batches give the log-probs of each sequence run alone; plans cover every token once."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from learner.logprobs import (
    entropy_from_logits,
    entropy_from_logits_with_chunking,
    forward_micro_batch,
    logprobs_from_logits,
)
from learner.packing import Sample, make_micro_batch, per_token, plan_micro_batches
from learner.varlen_attention import VARLEN
from tests.helpers import tiny_qwen2


def _model(attn: str) -> torch.nn.Module:
    return tiny_qwen2(attn, max_position=128).eval()


def _samples(n: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, t = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        out.append(
            Sample(
                input_ids=rng.integers(0, 64, p + t),
                prompt_len=p,
                behavior_logprobs=np.zeros(t, np.float32),
                loss_mask=np.ones(t, np.uint8),
                advantage=float(rng.normal()),
            )
        )
    return out


def _alone(model: torch.nn.Module, s: Sample) -> torch.Tensor:
    ids = torch.from_numpy(s.input_ids.astype(np.int64))[None]
    logits = model(input_ids=ids).logits[0, s.prompt_len - 1 : -1]
    return torch.log_softmax(logits.double(), -1).gather(-1, ids[0, s.prompt_len :, None]).squeeze(-1).float()


@pytest.mark.parametrize("attn", ["sdpa", "eager", VARLEN])
@pytest.mark.parametrize("packed", [True, False])
def test_micro_batch_logprobs_equal_unpadded_per_sequence(attn: str, packed: bool) -> None:
    """VARLEN is what the learner runs for packed rows; padded rows through it rely on right padding."""
    model, samples = _model(attn), _samples(5)
    reference = _model("sdpa")
    mb = make_micro_batch(samples, [0, 1, 2, 3, 4], packed=packed)
    with torch.no_grad():
        got, ent = forward_micro_batch(model, mb, device=torch.device("cpu"), with_entropy=True, chunk_size=7)
        want = torch.cat([_alone(reference, s) for s in samples])
    assert got.shape == want.shape == ent.shape
    assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packed", [True, False])
def test_per_token_temperature_scales_each_sequence_logits(packed: bool) -> None:
    """Log-probs and entropy of softmax(logits / T) with each sequence's own T (verl's actor convention)."""
    model, samples = _model("sdpa"), _samples(3, seed=5)
    for s, t in zip(samples, (0.7, 1.0, 1.6), strict=True):
        s.temperature = t
    mb = make_micro_batch(samples, [0, 1, 2], packed=packed)
    with torch.no_grad():
        temperature = per_token(samples, [0, 1, 2], "temperature")
        got, ent = forward_micro_batch(
            model, mb, device=torch.device("cpu"), with_entropy=True, temperature=temperature
        )
        want, want_ent = [], []
        for s in samples:
            ids = torch.from_numpy(s.input_ids.astype(np.int64))[None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0, s.prompt_len - 1 : -1].double() / s.temperature, -1)
            want.append(logp.gather(-1, ids[0, s.prompt_len :, None]).squeeze(-1).float())
            want_ent.append(-(logp.exp() * logp).sum(-1).float())
    assert_close(got, torch.cat(want), atol=1e-5, rtol=1e-5)
    assert_close(ent, torch.cat(want_ent), atol=1e-5, rtol=1e-5)


def test_packed_row_has_restarting_positions_and_no_padding() -> None:
    samples = _samples(3)
    mb = make_micro_batch(samples, [0, 1, 2], packed=True)
    assert mb.input_ids.shape == (1, sum(s.length for s in samples))
    starts = (mb.position_ids[0] == 0).nonzero().flatten().tolist()
    assert starts == [0, samples[0].length, samples[0].length + samples[1].length]
    assert mb.seq_lengths == [s.length for s in samples]
    assert mb.seq_ids.tolist() == [k for k, s in enumerate(samples) for _ in range(s.num_completion)]
    assert per_token(samples, [0, 1, 2], "advantage").shape == mb.targets.shape


def test_chunked_entropy_and_logprobs_equal_unchunked() -> None:
    logits = torch.randn(37, 50)
    tgt = torch.randint(0, 50, (37,))
    assert_close(entropy_from_logits_with_chunking(logits, chunk_size=8), entropy_from_logits(logits))
    assert_close(logprobs_from_logits(logits, tgt, chunk_size=5), torch.log_softmax(logits, -1)[torch.arange(37), tgt])
    g = logits.clone().requires_grad_(True)
    entropy_from_logits_with_chunking(g, chunk_size=8, checkpoint=True).sum().backward()
    g2 = logits.clone().requires_grad_(True)
    entropy_from_logits(g2).sum().backward()
    assert_close(g.grad, g2.grad)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dynamic", [True, False])
def test_plan_covers_every_sample_once_with_equal_counts(world: int, dynamic: bool) -> None:
    rng = random.Random(world)
    lengths = [int(16 * 64 ** rng.random()) for _ in range(41)]  # long-tailed, 16..1024
    budget = 1024
    plan = plan_micro_batches(lengths, world_size=world, dynamic=dynamic, max_tokens=budget, micro_batch_size=4)
    assert len(plan) == world and len({len(p) for p in plan}) == 1
    seen = sorted(i for rank in plan for mb in rank for i in mb)
    assert seen == list(range(len(lengths)))
    assert sum(lengths[i] for rank in plan for mb in rank for i in mb) == sum(lengths)
    for rank in plan:
        for mb in rank:
            if dynamic:
                assert len(mb) == 1 or sum(lengths[i] for i in mb) <= budget
            else:
                assert len(mb) <= 4
    if dynamic and world > 1:
        loads = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
        assert max(loads) - min(loads) <= max(lengths)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_padded_dynamic_plan_bounds_padded_slots_and_pads_little(world: int) -> None:
    """Without remove-padding the budget counts padded slots, and like lengths share a micro-batch: the
    token-balanced bins of the packed layout would pad every short sample to a long one."""
    rng = random.Random(world)
    lengths = [int(16 * 64 ** rng.random()) for _ in range(41)]
    budget = 1024
    plan = plan_micro_batches(lengths, world_size=world, dynamic=True, max_tokens=budget, micro_batch_size=4,
                              padded=True)  # fmt: skip
    assert len(plan) == world and len({len(p) for p in plan}) == 1
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(len(lengths)))

    def slots(p: list[list[list[int]]]) -> int:
        return sum(len(mb) * max(lengths[i] for i in mb) for rank in p for mb in rank if mb)

    for rank in plan:
        for mb in rank:
            assert len(mb) <= 1 or len(mb) * max(lengths[i] for i in mb) <= budget
    balanced = plan_micro_batches(lengths, world_size=world, dynamic=True, max_tokens=budget, micro_batch_size=4)
    assert slots(plan) < 0.8 * slots(balanced)


def test_plan_of_nothing_and_of_fewer_samples_than_ranks() -> None:
    assert plan_micro_batches([], world_size=2, dynamic=True, max_tokens=10, micro_batch_size=2) == [[], []]
    plan = plan_micro_batches([5], world_size=2, dynamic=True, max_tokens=10, micro_batch_size=2)
    assert sorted(len(r) for r in plan) == [1, 1] and sorted(sum(map(len, r)) for r in plan) == [0, 1]


def test_read_only_arrays_pack_without_a_warning() -> None:
    """Decoded trajectories are read-only views of the wire bytes (``np.frombuffer``); packing them must
    not make torch warn "The given NumPy array is not writable" (it did, once per batch)."""
    ids = np.frombuffer(np.arange(6, dtype=np.int64).tobytes(), dtype=np.int64)
    logprobs = np.frombuffer(np.zeros(3, dtype=np.float32).tobytes(), dtype=np.float32)
    sample = Sample(input_ids=ids, prompt_len=3, behavior_logprobs=logprobs, loss_mask=np.ones(3, np.float32))
    assert not ids.flags.writeable
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = make_micro_batch([sample], [0], packed=True)
        values = per_token([sample], [0], "behavior_logprobs")
    assert batch.input_ids.tolist() == [list(range(6))]
    assert values.tolist() == [0.0, 0.0, 0.0]
