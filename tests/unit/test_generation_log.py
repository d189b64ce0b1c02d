"""The learner's side of the viewer (:mod:`learner.generation_log`): which groups of a step it keeps and what it
keeps of them (the advantage each completion trained with — from the samples the trainer trained, as GRPO's
closed form gives it, a critic's per-token GAE as its mean; nothing for a trajectory the step skipped), and
the dead letters it copies from a real Redis — each once, across a restart too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import redis

from buffer import BufferedGroup, dead_letter
from buffer.codec import encode_payload
from buffer.keys import RedisKeys
from learner.advantages import assign_advantages
from learner.batch import build_samples
from learner.data import PromptSource
from learner.generation_log import DEAD_TOKENS, GenerationLog, spread, trained_advantages
from learner.synthetic import make_groups
from tether.config import load_config
from tether.records import DEAD_LETTERS, GENERATIONS, read_records
from tether.v1.trajectory_pb2 import FINISH_REASON_ABORTED, Prompt


def _cfg(*overrides: str):
    return load_config(None, ["--run.run_id", "view", "--learner.data_path", "demo:charclass", *overrides])


def _log(tmp_path: Path, client: redis.Redis, *overrides: str) -> GenerationLog:
    cfg = _cfg(*overrides)
    return GenerationLog(cfg, tmp_path, client=client, keys=RedisKeys("view"), source=PromptSource(cfg))


def _batch(version: int = 2) -> list[BufferedGroup]:
    groups = make_groups(5, 4, vocab=300, seed=3, version=version)
    for g in groups:
        g.metadata = {"dataset_index": "7"}
    aborted = groups[2].trajectories[1]
    aborted.finish_reason = FINISH_REASON_ABORTED
    mixed = groups[0].trajectories[0]
    mixed.policy_versions = np.arange(mixed.num_completion_tokens, dtype=np.int32) % 2 + version - 1
    return [BufferedGroup(entry_id=f"{i}-0", group=g, staleness=1) for i, g in enumerate(groups)]


def _with_samples(batch: list[BufferedGroup], *overrides: str) -> tuple[list[BufferedGroup], list]:
    """The batch and its samples as the trainer trains them (what ``Trainer.train_step`` runs before the loss)."""
    cfg = _cfg(*overrides)
    samples, _ = build_samples([b.group for b in batch], current_version=3, max_len=cfg.model.max_model_len)
    assign_advantages(samples, cfg.algorithm)
    return batch, samples


def test_spread_takes_evenly_from_the_batch() -> None:
    assert spread(5, 2) == [0, 2] and spread(8, 4) == [0, 2, 4, 6] and spread(3, 5) == [0, 1, 2]


def test_a_logged_step_keeps_its_groups_with_their_advantages(tmp_path: Path, redis_client: redis.Redis) -> None:
    log = _log(tmp_path, redis_client)
    batch = _batch()
    log.trained(*_with_samples(batch), step=1, version=3)
    log.close()  # written on a thread of its own
    records, bad = read_records(tmp_path / GENERATIONS)
    assert bad == 0 and [r["group_id"] for r in records] == [batch[0].group.group_id, batch[2].group.group_id]
    for rec, b in zip(records, (batch[0], batch[2]), strict=True):
        assert (rec["step"], rec["version"], rec["staleness"], rec["data_source"]) == (1, 3, 1, "charclass")
        assert rec["prompt"] == b.group.trajectories[0].prompt_token_ids.tolist()
        trained = [t.finish_reason != FINISH_REASON_ABORTED for t in b.group.trajectories]
        rewards = np.array([t.reward for t, ok in zip(b.group.trajectories, trained, strict=True) if ok])
        want = iter((rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6))  # GRPO, the default estimator
        for s, t, ok in zip(rec["samples"], b.group.trajectories, trained, strict=True):
            assert s["ids"] == t.completion_token_ids.tolist() and s["reward"] == pytest.approx(t.reward)
            assert s["lp"] == pytest.approx(t.behavior_logprobs.tolist(), abs=5e-4)
            assert s["mask"] == t.loss_mask.tolist()  # make_groups masks one middle token
            if ok:
                assert s["adv"] == pytest.approx(float(next(want)), abs=1e-4)
            else:
                assert s["adv"] is None and s["finish"] == "aborted"  # never trained on
    assert records[0]["samples"][0]["v"] == batch[0].group.trajectories[0].policy_versions.tolist()
    assert records[0]["samples"][1]["v"] == 2  # one version for every token: one number


def test_only_due_steps_are_logged_and_zero_logs_nothing(tmp_path: Path, redis_client: redis.Redis) -> None:
    (tmp_path / "a").mkdir()
    log = _log(tmp_path / "a", redis_client, "--learner.log_generations_every", "2")
    for step in (1, 2, 3, 4):
        log.trained(*_with_samples(_batch()), step=step, version=3)
        log.flush()
    assert sorted({r["step"] for r in read_records(tmp_path / "a" / GENERATIONS)[0]}) == [2, 4]
    (tmp_path / "b").mkdir()
    off = _log(tmp_path / "b", redis_client, "--learner.log_train_generations", "0")
    off.trained(*_with_samples(_batch()), step=1, version=3)
    dead_letter(redis_client, RedisKeys("view"), source="rollout-0", reason="x", data=b"")
    off.close()
    assert not list((tmp_path / "b").iterdir())


def test_dead_letters_are_copied_once_with_their_reason_and_payload(tmp_path: Path, redis_client: redis.Redis) -> None:
    keys = RedisKeys("view")
    group = _batch()[1].group
    long = group.trajectories[0]
    long.completion_token_ids = np.arange(DEAD_TOKENS + 10, dtype=np.int32) % 250
    n = long.num_completion_tokens
    long.behavior_logprobs, long.loss_mask = np.zeros(n, np.float32), np.ones(n, np.uint8)
    long.policy_versions = np.full(n, 2, np.int32)
    dead_letter(redis_client, keys, source="rollout-0", reason=f"{group.group_id}: reward failed: boom",
                data=encode_payload(group)[1])  # fmt: skip  # a rollout server's: columnar
    prompt = Prompt(prompt_id="p9", dataset_index=9, text="upper:", reward_context={"data_source": "charclass"})
    dead_letter(
        redis_client, keys, source="rollout-1", reason="p9: bad prompt: 99 tokens", data=prompt.SerializeToString()
    )
    log = _log(tmp_path, redis_client)
    log.trained(*_with_samples(_batch()), step=4, version=3)
    records, _ = read_records(tmp_path / DEAD_LETTERS)
    assert [r["reason"] for r in records] == [f"{group.group_id}: reward failed: boom", "p9: bad prompt: 99 tokens"]
    first, second = records
    assert (first["origin"], first["group_id"], first["step"], first["data_source"]) == (
        "rollout-0", group.group_id, 4, "charclass")  # fmt: skip
    assert first["prompt"] == group.trajectories[0].prompt_token_ids.tolist()
    assert first["samples"][0]["ids"] == long.completion_token_ids[:DEAD_TOKENS].tolist()
    assert first["samples"][0]["cut"] == 10
    assert (second["prompt_text"], second["data_source"], second["origin"]) == ("upper:", "charclass", "rollout-1")
    dead_letter(redis_client, keys, source="rollout-0", reason="later", data=b"\xff not a payload")
    log.close()
    again = _log(tmp_path, redis_client)  # a resumed learner: goes on after the last copied entry
    again.close()
    records, _ = read_records(tmp_path / DEAD_LETTERS)
    assert [r["reason"] for r in records][-2:] == ["p9: bad prompt: 99 tokens", "later"] and len(records) == 3


def test_a_step_due_while_the_last_is_being_written_is_not_logged(tmp_path: Path, redis_client: redis.Redis) -> None:
    from concurrent.futures import Future

    log = _log(tmp_path, redis_client)
    log._job = Future()  # the previous step, still being written: the next is skipped, never queued
    log.trained(*_with_samples(_batch()), step=1, version=3)
    assert log.busy_skips == 1 and log._job is not None and not log._job.done()
    log._job.set_result(None)
    log.trained(*_with_samples(_batch()), step=2, version=3)
    log.close()
    assert sorted({r["step"] for r in read_records(tmp_path / GENERATIONS)[0]}) == [2]


def test_a_per_token_advantage_is_recorded_as_its_mean_over_trained_tokens() -> None:
    """A critic's GAE gives one advantage per completion token; the record keeps their mean over the tokens the
    loss used (a masked token's advantage is not in it)."""
    batch, samples = _with_samples(_batch())
    s = samples[0]
    per_token = np.arange(s.num_completion, dtype=np.float64)
    s.advantage, s.loss_mask = per_token, np.ones(s.num_completion, dtype=np.float32)
    s.loss_mask[0] = 0
    got = trained_advantages(samples)
    assert got[s.group, s.trajectory] == pytest.approx(per_token[1:].mean())
    assert (2, 1) not in got  # the aborted trajectory: never trained
    assert len(got) == len(samples) == sum(len(b.group.trajectories) for b in batch) - 1
