"""Two settings behind the MFU figures: bench/learner_mfu.py's warm-up (untimed steps until one compiles no new
graph, so a row's timed steps never include a recompile) and the learner's CUDA allocator default."""

from __future__ import annotations

from torch._dynamo.utils import counters

from bench.learner_mfu import compiled_graphs, warm_up


class CompilingTrainer:
    """Counts its steps; each of the first ``compiles`` steps adds one graph to dynamo's counter."""

    def __init__(self, compiles: int) -> None:
        self.compiles, self.steps = compiles, 0

    def train_step(self, groups, version: int) -> None:  # type: ignore[no-untyped-def]
        self.steps += 1
        if self.steps <= self.compiles:
            counters["stats"]["unique_graphs"] += 1


def test_compiled_rows_warm_up_until_a_step_compiles_nothing() -> None:
    before = compiled_graphs()
    trainer = CompilingTrainer(compiles=3)
    assert warm_up(trainer, lambda seed: [], compiled=True) == 4 == trainer.steps
    assert compiled_graphs() == before + 3


def test_two_steps_at_least_with_compile_one_when_eager_and_a_bound() -> None:
    assert warm_up(CompilingTrainer(compiles=0), lambda seed: [], compiled=True) == 2
    assert warm_up(CompilingTrainer(compiles=5), lambda seed: [], compiled=False) == 1
    assert warm_up(CompilingTrainer(compiles=100), lambda seed: [], compiled=True, max_steps=6) == 6


def test_the_learner_sets_expandable_segments_unless_the_user_chose(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import os

    from learner.distributed import cuda_allocator_defaults

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cuda_allocator_defaults()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    cuda_allocator_defaults()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
