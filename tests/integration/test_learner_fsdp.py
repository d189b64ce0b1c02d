"""Real torch.distributed (gloo, spawned processes) and FSDP2: 2 ranks = 1 rank, resume = uninterrupted,
the loss falls on a fixed batch, non-finite input never reaches the weights, the HF export loads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from tests.helpers import leave_group
from tether.redis_server import free_port

pytestmark = pytest.mark.slow

LEARNER = {
    "train_batch_size": 4,
    "ppo_mini_batch_size": 2,
    "lr": 1e-3,
    "lr_warmup_steps": 1,
    "lr_scheduler": "cosine",
    "total_steps": 10,
    "max_token_len_per_gpu": 48,
    "log_prob_max_token_len_per_gpu": 96,
}


def _cfg(model_dir: str, learner: dict | None = None, algorithm: dict | None = None):
    from tether.config import TetherConfig

    return TetherConfig.model_validate(
        {
            "model": {"path": model_dir},
            "rollout": {"max_tokens": 32},
            "learner": {**LEARNER, **(learner or {})},
            "algorithm": {"entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.1, **(algorithm or {})},
        }
    )


def _worker(rank: int, world: int, port: int, model_dir: str, out: str, scenario: str, overrides_json: str) -> None:
    import torch.distributed as dist

    from learner.checkpoint import TrainState, export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
    from learner.parallelize import load_model, parallelize
    from learner.synthetic import make_groups
    from learner.trainer import Trainer

    overrides = json.loads(overrides_json)  # plain strings into the children: nothing pickled but builtins
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = _cfg(model_dir, overrides.get("learner"), overrides.get("algorithm"))
    dev = torch.device("cpu")
    model = parallelize(load_model(cfg, dev, meta=True), cfg, dev)  # as the learner builds it (meta_init)
    ref = parallelize(load_model(cfg, dev, meta=True), cfg, dev, trainable=False) if cfg.algorithm.use_kl_loss else None
    trainer = Trainer(cfg, model, device=dev, ref_model=ref)
    batches = [make_groups(4, 4, vocab=256, seed=s) for s in range(3)]
    if overrides.get("poison"):
        batches[1][0].trajectories[0].reward = math.nan
        batches[1][1].trajectories[1].behavior_logprobs = batches[1][1].trajectories[1].behavior_logprobs * math.inf
        batches[1][2].trajectories[0].loss_mask[:] = 0
    ckpts = Path(out) / "checkpoints"
    results = []
    steps = range(len(batches))
    if scenario == "resume":
        state = load_checkpoint(latest_checkpoint(ckpts), model=model, optimizer=trainer.optimizer,
                                scheduler=trainer.scheduler)  # fmt: skip
        steps = range(state.step, len(batches))
    elif scenario == "fixed":
        batches, steps = [batches[0]] * 8, range(8)
    for step in steps:
        results.append(trainer.train_step(batches[step], version=0))
        if scenario == "save" and step == 0:
            save_checkpoint(ckpts, model=model, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                            state=TrainState(step=1))  # fmt: skip
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if scenario == "export":
        export_hf(model, out_dir=Path(out) / "final", source_dir=model_dir)
    if rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"{scenario}.json").write_text(json.dumps(results))
        tensors = {k: v.contiguous() for k, v in full.items() if k != "lm_head.weight"}  # tied to the embedding
        save_file(tensors, str(Path(out, f"{scenario}.st")))
    del trainer, model, ref, full
    leave_group()


def _spawn(world: int, model_dir: Path, out: Path, scenario: str, **overrides) -> tuple[list[dict], dict]:
    mp.spawn(
        _worker, args=(world, free_port(), str(model_dir), str(out), scenario, json.dumps(overrides)), nprocs=world
    )
    return json.loads((out / f"{scenario}.json").read_text()), load_file(str(out / f"{scenario}.st"))


@pytest.fixture(scope="module")
def one_rank_folder(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-rank run, spawned once, with a checkpoint after its first step (saving changes no number): the
    reference of the two-rank, padded and resumed runs."""
    folder = tmp_path_factory.mktemp("one-rank")
    _spawn(1, tiny_model_dir, folder, "save")
    return folder


@pytest.fixture(scope="module")
def one_rank(one_rank_folder: Path) -> tuple[list[dict], dict]:
    return json.loads((one_rank_folder / "save.json").read_text()), load_file(str(one_rank_folder / "save.st"))


@pytest.fixture(scope="module")
def two_ranks_exported(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict, Path]:
    """The same run on two ranks, spawned once, exported as a Hugging Face folder at its end."""
    folder = tmp_path_factory.mktemp("two-ranks")
    rows, weights = _spawn(2, tiny_model_dir, folder, "export")
    return rows, weights, folder / "final"


def test_two_ranks_match_one_rank(
    one_rank: tuple[list[dict], dict], two_ranks_exported: tuple[list[dict], dict, Path]
) -> None:
    one, w1 = one_rank
    two, w2, _ = two_ranks_exported
    for a, b in zip(one, two, strict=True):
        for key in ("loss/total", "loss/pg", "loss/kl", "loss/entropy", "actor/clipfrac", "actor/grad_norm"):
            assert_close(b[key], a[key], atol=1e-5, rtol=1e-4, msg=key)
    for name in w1:
        assert_close(w2[name], w1[name], atol=1e-5, rtol=1e-4)


def test_resume_gives_the_same_next_losses(
    tiny_model_dir: Path, one_rank_folder: Path, one_rank: tuple[list[dict], dict]
) -> None:
    full, w_full = one_rank
    resumed, w_resumed = _spawn(1, tiny_model_dir, one_rank_folder, "resume")
    assert len(resumed) == len(full) - 1
    for a, b in zip(full[1:], resumed, strict=True):
        assert_close(b["loss/total"], a["loss/total"], rtol=0, atol=0)
    for name in w_full:
        assert_close(w_resumed[name], w_full[name], rtol=0, atol=0)


def test_loss_falls_on_a_fixed_batch(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows, _ = _spawn(1, tiny_model_dir, tmp_path, "fixed", algorithm={"use_kl_loss": False, "entropy_coeff": 0.0})
    # Maximising A * log p on fixed data drives the surrogate down step after step.
    assert rows[-1]["loss/total"] < rows[0]["loss/total"] - 0.05


def test_bad_input_is_skipped_and_weights_stay_finite(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows, weights = _spawn(2, tiny_model_dir, tmp_path, "run", poison=True)
    assert rows[1]["learner/skipped_nonfinite_reward"] == 1
    assert rows[1]["learner/skipped_nonfinite_logprob"] == 1
    assert rows[1]["learner/fully_masked"] == 1
    assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.parametrize("dynamic", [False, True])
def test_padded_matches_packed(
    tiny_model_dir: Path, tmp_path: Path, dynamic: bool, one_rank: tuple[list[dict], dict]
) -> None:
    """Padded micro-batches, fixed-size or by a budget of padded slots (like lengths together), train as
    the packed rows do: the same losses step after step."""
    packed, _ = one_rank
    padded, _ = _spawn(
        2, tiny_model_dir, tmp_path / "b", "run", learner={"use_remove_padding": False, "use_dynamic_bsz": dynamic}
    )
    for a, b in zip(packed, padded, strict=True):
        assert_close(b["loss/total"], a["loss/total"], atol=1e-5, rtol=1e-4)


def test_export_loads_with_from_pretrained(two_ranks_exported: tuple[list[dict], dict, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, weights, final = two_ranks_exported
    model = AutoModelForCausalLM.from_pretrained(final)
    AutoTokenizer.from_pretrained(final)
    for name, value in model.state_dict().items():
        if name in weights:
            assert_close(value, weights[name])
