"""Prompts in flight follow the step, threads follow the phase; a user's explicit setting wins."""

from __future__ import annotations

import pytest

from tether.config import TetherConfig
from tether.resources import prompt_workers, thread_counts, thread_env, with_prompt_workers


def _cfg(*, batch: int = 8, staleness: int = 1, n: int = 8, seqs: int = 64, servers: int = 1, learners: int = 1,
         workers: int | None = None) -> TetherConfig:  # fmt: skip
    rollout = {"n": n, "num_servers": servers, "engine": {"type": "transformers", "max_num_seqs": seqs}}
    if workers is not None:
        rollout["prompt_workers"] = workers
    return TetherConfig.model_validate(
        {
            "rollout": rollout,
            "learner": {"train_batch_size": batch, "nproc_per_node": learners},
            "algorithm": {"max_staleness": staleness},
        }
    )


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # the demo: 8 prompts x 8 samples fill the 64-row batch in sync mode ...
        ({"staleness": 0}, 8),
        # ... and async mode would want 16 prompts, but only 8 groups of 8 fit the engine's batch
        ({"staleness": 1}, 8),
        ({"staleness": 1, "seqs": 256}, 16),
        ({"staleness": 3, "seqs": 1024, "batch": 32}, 128),
        # two local servers share the step's prompts
        ({"staleness": 1, "seqs": 256, "servers": 2}, 8),
        ({"staleness": 0, "batch": 5, "seqs": 256, "servers": 2}, 3),
        # a group larger than the engine's batch still gets one prompt at a time
        ({"n": 128, "seqs": 64}, 1),
    ],
)
def test_prompt_workers_follow_the_step(kwargs: dict, expected: int) -> None:
    cfg = _cfg(**kwargs)
    assert cfg.rollout.prompt_workers is None  # the default is "derive"
    assert prompt_workers(cfg) == expected
    assert with_prompt_workers(cfg).rollout.prompt_workers == expected


@pytest.mark.parametrize("workers", [0, 3, 100])
def test_explicit_prompt_workers_win(workers: int) -> None:
    cfg = _cfg(staleness=1, seqs=256, workers=workers)
    assert prompt_workers(cfg) == workers
    assert with_prompt_workers(cfg) is cfg


@pytest.mark.parametrize(
    ("kwargs", "cores", "expected"),
    [
        # sync: the learner's phase gets the whole machine, rollout keeps its even share
        ({"staleness": 0}, 2, {"learner": 2, "rollout": 1}),
        ({"staleness": 0}, 16, {"learner": 16, "rollout": 8}),
        ({"staleness": 0, "learners": 2, "servers": 2}, 16, {"learner": 8, "rollout": 4}),
        # async: both phases run at once, so the cores are split
        ({"staleness": 1}, 2, {"learner": 1, "rollout": 1}),
        ({"staleness": 2, "learners": 2, "servers": 2}, 16, {"learner": 4, "rollout": 4}),
        ({"staleness": 1, "servers": 3}, 2, {"learner": 1, "rollout": 1}),
    ],
)
def test_threads_per_mode(kwargs: dict, cores: int, expected: dict) -> None:
    cfg = _cfg(**kwargs)
    assert thread_counts(cfg, cores=cores) == expected
    for role, n in expected.items():
        assert thread_env(cfg, role, cores=cores, environ={}) == {"OMP_NUM_THREADS": str(n)}


@pytest.mark.parametrize(("hidden", "learner"), [(64, 1), (255, 1), (256, 2), (None, 2)])
def test_a_narrow_model_keeps_its_even_share_in_sync_mode(tmp_path, hidden: int | None, learner: int) -> None:
    """Two learner threads made the 64-wide sync step slower and the 256-wide one faster; a model whose
    width cannot be read counts as wide (the sync default)."""
    (tmp_path / "config.json").write_text("{}" if hidden is None else f'{{"hidden_size": {hidden}}}')
    cfg = _cfg(staleness=0).model_copy(update={"model": _cfg().model.model_copy(update={"path": str(tmp_path)})})
    assert thread_counts(cfg, cores=2) == {"learner": learner, "rollout": 1}
    assert thread_counts(cfg.model_copy(update={"algorithm": _cfg(staleness=1).algorithm}), cores=2)["learner"] == 1


def test_users_omp_num_threads_wins() -> None:
    for staleness in (0, 1):
        cfg = _cfg(staleness=staleness)
        for role in ("learner", "rollout"):
            assert thread_env(cfg, role, cores=16, environ={"OMP_NUM_THREADS": "3"}) == {}


def test_prompt_workers_config_accepts_null_and_rejects_negative() -> None:
    from tether.config import ConfigError

    assert TetherConfig.model_validate({"rollout": {"prompt_workers": None}}).rollout.prompt_workers is None
    with pytest.raises((ConfigError, ValueError), match="prompt_workers"):
        TetherConfig.model_validate({"rollout": {"prompt_workers": -1}})
