"""Groups to samples: bad trajectories skipped and counted, never trained on; fully masked ones kept for their
group's baseline and then left out of training; the advantages come from the one estimator pass."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.testing import assert_close

from learner.advantages import assign_advantages
from learner.batch import build_samples
from learner.synthetic import make_groups
from tether.config import AlgorithmConfig


def _with_advantages(groups, **algorithm):
    samples, skipped = build_samples(groups, current_version=0)
    assign_advantages(samples, AlgorithmConfig(**algorithm))
    return samples, skipped


def test_bad_trajectories_are_skipped_and_counted() -> None:
    groups = make_groups(2, 4, vocab=50, seed=0, version=2)
    groups[0].trajectories[0].reward = math.inf
    groups[0].trajectories[1].behavior_logprobs = np.full(groups[0].trajectories[1].num_completion_tokens, np.nan)
    groups[1].trajectories[0].loss_mask = np.zeros_like(groups[1].trajectories[0].loss_mask)
    samples, skipped = build_samples(groups, current_version=3)
    assert skipped == {"nonfinite_reward": 1, "nonfinite_logprob": 1, "fully_masked": 1}
    assert len(samples) == 6 and sum(s.num_trained > 0 for s in samples) == 5
    assert all(s.staleness == 1 for s in samples)


def test_a_fully_masked_sample_counts_in_its_groups_baseline_and_has_no_advantage() -> None:
    """verl scores every response of a group, whatever its loss mask: a fully masked one (all environment
    tokens) still moves its group's mean and std. Before, the learner left it out of the trainer's baseline."""
    groups = make_groups(2, 4, vocab=50, seed=0)
    groups[1].trajectories[0].loss_mask = np.zeros_like(groups[1].trajectories[0].loss_mask)
    samples, _ = _with_advantages(groups)
    rewards = groups[1].rewards().astype(np.float64)
    want = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    got = [float(s.advantage[0]) for s in samples if s.group == 1]
    assert_close(torch.tensor(got[1:]), torch.tensor(want[1:], dtype=torch.float32))
    masked = next(s for s in samples if s.group == 1)
    assert not masked.advantage.any()


def test_an_all_bad_batch_gives_no_samples() -> None:
    groups = make_groups(1, 2, vocab=50, seed=1)
    for t in groups[0].trajectories:
        t.reward = math.nan
    samples, skipped = build_samples(groups, current_version=0)
    assert samples == [] and skipped == {"nonfinite_reward": 2}


def test_aborted_samples_are_not_trained_and_leave_the_baseline() -> None:
    from tether.v1.trajectory_pb2 import FINISH_REASON_ABORTED

    groups = make_groups(1, 4, vocab=50, seed=2)
    groups[0].trajectories[1].finish_reason = FINISH_REASON_ABORTED
    samples, skipped = _with_advantages(groups, norm_adv_by_std_in_grpo=False)
    assert skipped == {"aborted": 1} and len(samples) == 3
    rewards = groups[0].rewards()[[0, 2, 3]]
    assert_close(torch.tensor([s.advantage[0] for s in samples]), torch.tensor(rewards - rewards.mean()).float())


def test_groups_left_with_one_sample_are_counted_and_keep_their_reward() -> None:
    """verl's GRPO gives a group of one mean 0 and std 1: its advantage is the raw reward (over 1 + eps)."""
    groups = make_groups(3, 2, vocab=50, seed=3)
    groups[0].trajectories[0].reward = math.nan  # group 0 keeps one sample
    groups[2] = type(groups[2])("solo", groups[2].trajectories[:1])  # a group of one from the start
    samples, skipped = _with_advantages(groups)
    assert skipped == {"nonfinite_reward": 1, "single_sample_groups": 2}
    solo = [s for s in samples if s.group != 1]
    want = torch.tensor([s.reward / (1 + 1e-6) for s in solo], dtype=torch.float32)
    assert_close(torch.tensor([float(s.advantage[0]) for s in solo]), want)


def test_groups_with_all_equal_rewards_are_counted_against_a_loop() -> None:
    # A collapsed policy gives every sample of a prompt the same reward: no advantage, no gradient.
    rng = np.random.default_rng(5)
    groups = make_groups(12, 4, vocab=50, seed=5)
    for g in groups:
        if rng.random() < 0.5:
            for t in g.trajectories:
                t.reward = 0.25
    groups[0].trajectories[0].reward = math.nan  # the survivors still agree (or not) among themselves
    groups[1] = type(groups[1])("solo", groups[1].trajectories[:1])  # one sample: counted apart
    samples, skipped = _with_advantages(groups)
    want = 0
    for g in groups:
        rewards = [t.reward for t in g.trajectories if math.isfinite(t.reward)]
        want += len(rewards) > 1 and max(rewards) == min(rewards)
    assert 0 < want < len(groups) - 1
    assert skipped["zero_std_groups"] == want and skipped["single_sample_groups"] == 1
    flat = [g for g in {s.group for s in samples} if len({s.reward for s in samples if s.group == g}) == 1 and g != 1]
    assert all(np.abs(s.advantage).max() < 1e-9 for s in samples if s.group in flat)


def test_each_sample_carries_the_temperature_it_was_sampled_at() -> None:
    from tether.trajectory import TEMPERATURE_KEY

    groups = make_groups(1, 6, vocab=50, seed=4)
    t = groups[0].trajectories
    for x in t:
        x.logprob_source = "processed"
    t[0].metadata = {TEMPERATURE_KEY: "0.7"}
    t[1].metadata = {}  # not recorded: the configured rollout.temperature
    t[2].metadata = {TEMPERATURE_KEY: "0.0"}  # greedy: log-probs of T = 1
    t[3].metadata, t[3].logprob_source = {TEMPERATURE_KEY: "0.7"}, "raw"  # raw log-probs are of T = 1
    t[4].metadata = {TEMPERATURE_KEY: "hot"}
    t[5].metadata = {TEMPERATURE_KEY: "-1"}
    samples, skipped = build_samples(groups, current_version=0, default_temperature=0.5)
    assert skipped == {"bad_temperature": 2}
    assert [s.temperature for s in samples] == [0.7, 0.5, 1.0, 1.0]


def same_group(a, b) -> None:
    """``a`` equals ``b`` field for field, arrays by dtype and bytes."""
    assert (a.group_id, a.prompt_id, a.metadata) == (b.group_id, b.prompt_id, b.metadata)
    for ta, tb in zip(a.trajectories, b.trajectories, strict=True):
        for name, value in vars(tb).items():
            if isinstance(value, np.ndarray):
                assert getattr(ta, name).dtype == value.dtype and getattr(ta, name).tobytes() == value.tobytes()
            else:
                assert getattr(ta, name) == value, name


def test_rank_broadcast_payload_is_columnar_and_round_trips_every_field() -> None:
    """What rank 0 packs is the columnar payload, nothing else (each group's bytes are what the buffer's
    codec writes), and what the other ranks unpack equals what was sent, field for field (rich groups:
    reward components, metadata, timestamps)."""
    from buffer.columnar import MAGIC, encode_columnar
    from learner.batch import pack_groups, unpack_groups
    from tests.unit.test_buffer_codec import make_group

    sent = [make_group(rich=True, seed=s, tokens=16 * (s + 1)) for s in range(3)]
    header, raw = pack_groups(sent, stop=7)
    got, stop = unpack_groups(header.clone(), bytes(raw))
    assert stop == 7 and len(got) == len(sent)
    offset = 0
    for a, b, n in zip(got, sent, header[2:].tolist(), strict=True):
        assert raw[offset : offset + 3] == MAGIC  # a second codec on this path fails here
        assert bytes(raw[offset : offset + n]) == encode_columnar(b)[0]
        offset += n
        same_group(a, b)
        assert not a.trajectories[0].completion_token_ids.flags.writeable  # views into the received bytes
    assert unpack_groups(*pack_groups([], stop=0)) == ([], 0)


def test_rank_broadcast_sends_the_bytes_read_as_they_are() -> None:
    """Payloads handed in (the reader's :attr:`BufferedGroup.columnar`) go out unchanged, not re-encoded; a
    group without one is encoded in the same codec; bytes of another codec are refused, not forwarded."""
    import zlib

    import pytest

    from buffer.codec import CODEC_COLUMNAR, decode_group_columnar, encode_payload
    from learner.batch import pack_groups
    from tests.unit.test_buffer_codec import make_group

    sent = [make_group(seed=s) for s in range(3)]
    read = [encode_payload(g)[1] for g in sent[:2]]
    groups = [decode_group_columnar(CODEC_COLUMNAR, p)[0] for p in read] + [sent[2]]
    # A group whose arrays no longer match its payload would be re-encoded differently: the bytes win.
    marker = bytearray(read[0])
    marker[-1] ^= 1  # the last loss-mask byte, 0 <-> 1: still a valid group
    read[0] = bytes(marker)
    header, raw = pack_groups(groups, payloads=[*read, b""], stop=0)
    assert bytes(raw) == read[0] + read[1] + encode_payload(sent[2])[1]
    assert header.tolist() == [0, 3, *map(len, [read[0], read[1], encode_payload(sent[2])[1]])]
    with pytest.raises(ValueError, match="not a columnar group"):  # e.g. a compressed payload not inflated
        pack_groups(sent[:1], payloads=[zlib.compress(encode_payload(sent[0])[1])])
    with pytest.raises(ValueError, match="2 payloads for 1 groups"):
        pack_groups(sent[:1], payloads=read)


_RANK = """
import sys

import torch
import torch.distributed as dist

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
from buffer.codec import CODEC_COLUMNAR, decode_group_columnar, encode_payload
from learner.batch import broadcast_groups
from tests.unit.test_buffer_codec import make_group
from tests.unit.test_learner_batch import same_group

wire = []  # every uint8 tensor broadcast: the groups' bytes as they cross between the processes
_broadcast = dist.broadcast
def spy(tensor, src, *args, **kwargs):
    out = _broadcast(tensor, src, *args, **kwargs)
    if tensor.dtype == torch.uint8:
        wire.append(bytes(tensor.numpy()))
    return out
dist.broadcast = spy

sent = [make_group(rich=True, seed=s, tokens=8 * (s + 1)) for s in range(3)]
for g in sent:  # the same ids in both processes (a trajectory's default id is random)
    for i, t in enumerate(g.trajectories):
        t.id = f"{g.group_id}/{i}"
read = [encode_payload(g)[1] for g in sent]  # what the buffer's reader hands rank 0
if rank == 0:
    groups = [decode_group_columnar(CODEC_COLUMNAR, p)[0] for p in read[:2]] + [sent[2]]
    got, stop = broadcast_groups(groups, payloads=[*read[:2], b""], device=torch.device("cpu"), stop=0)
else:
    got, stop = broadcast_groups(None, device=torch.device("cpu"))
assert stop == 0 and len(got) == 3, (stop, len(got))
for a, b in zip(got, sent, strict=True):
    same_group(a, b)
assert wire == [b"".join(read)], "the broadcast carried other bytes than the columnar payloads"
got, stop = broadcast_groups([] if rank == 0 else None, device=torch.device("cpu"), stop=3)
assert (got, stop) == ([], 3)
dist.destroy_process_group()
print("rank", rank, "ok")
"""


def test_broadcast_between_two_gloo_ranks_carries_the_columnar_bytes() -> None:
    """Two real processes over gloo: rank 1 gets every group field for field, and the only bytes that
    crossed are the columnar payloads rank 0 read (none re-encoded, no second codec, no pickle)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tether.redis_server import free_port

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), port],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = []
    try:
        for p in ranks:
            outputs.append(p.communicate(timeout=120)[0])
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in ranks]
    report = "\n".join(f"rank {r} exited {c}:\n{o}" for r, (c, o) in enumerate(zip(codes, outputs, strict=True)))
    assert codes == [0, 0], report
    assert all(f"rank {r} ok" in out for r, out in enumerate(outputs)), report
