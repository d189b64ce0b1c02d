"""The config a fleet's slot serves a run with (``rollout_server.fleet.slot_config``): the run's published
config, the fleet's machine-bound settings, the run's own token, and refusals naming the run."""

from __future__ import annotations

import pytest

from buffer.run_config import published_copy
from rollout_server.fleet import slot_config
from tether.auth import run_token
from tether.config import load_config


def _run(**overrides: str) -> dict:
    args = ["--run.run_id", "r1", "--buffer.redis_url", "redis://learner-host:6379/0", "--rollout.n", "3",
            "--rollout.max_tokens", "17", "--rollout.share", "2.5", "--rollout.auth_token", "learner-secret",
            "--rollout.engine.max_num_seqs", "8"]  # fmt: skip
    for k, v in overrides.items():
        args += [f"--{k}", v]
    return published_copy(load_config(None, args).model_dump(mode="json"))


def _fleet(*args: str):
    return load_config(None, ["--buffer.redis_url", "redis://fleet-host:6380/1", "--rollout.engine.max_num_seqs", "64",
                              *args])  # fmt: skip


def test_the_run_keeps_its_sampling_and_share_and_the_fleet_its_machine():
    published = _run()
    assert "redis_url" not in published["buffer"] and "auth_token" not in published["rollout"]  # never published
    cfg = slot_config(_fleet(), "r1", published)
    assert (cfg.rollout.n, cfg.rollout.max_tokens, cfg.rollout.share) == (3, 17, 2.5)
    assert cfg.buffer.redis_url == "redis://fleet-host:6380/1" and cfg.rollout.engine.max_num_seqs == 64
    assert cfg.run.run_id == "r1" and cfg.rollout.port == 0 and cfg.rollout.auth_token == ""


def test_with_a_fleet_token_the_slot_takes_the_runs_own():
    cfg = slot_config(_fleet("--rollout.auth_token", "fleet-secret"), "r1", _run())
    assert cfg.rollout.auth_token == run_token("fleet-secret", "r1") != run_token("fleet-secret", "r2")
    assert cfg.rollout.auth_token not in ("fleet-secret", "learner-secret")


def test_a_run_asking_to_run_its_models_code_is_refused_unless_the_fleet_allows_it():
    published = _run(**{"model.trust_remote_code": "true"})
    with pytest.raises(ValueError, match=r"run 'r1' asks for model.trust_remote_code"):
        slot_config(_fleet(), "r1", published)
    assert slot_config(_fleet("--model.trust_remote_code", "true"), "r1", published).model.trust_remote_code


def test_a_config_that_does_not_load_names_the_run():
    published = _run()
    published["rollout"]["n"] = 0
    with pytest.raises(ValueError, match=r"run 'r1': its published config does not load here"):
        slot_config(_fleet(), "r1", published)
