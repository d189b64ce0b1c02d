"""Checkpoints (torch.distributed.checkpoint) that resume exactly, and the final Hugging Face export.

``{run}/checkpoints/step_N/`` holds the sharded model (with LoRA: the adapters only) and optimizer
(DCP: every rank writes its own shards, no gather), the critic's model and optimizer when the run has
one (PPO with GAE), ``rng_rank{r}.json`` per rank and ``trainer_state.json`` (step, policy version,
dataset position, scheduler). ``trainer_state.json`` is written last, after a barrier, so a folder
without it is an interrupted save and is never resumed from. The small states are JSON, not pickles.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from learner import lora
from tether.logs import get_logger

log = get_logger(__name__)

STATE_FILE = "trainer_state.json"


@dataclass
class TrainState:
    step: int = 0
    """Learner steps done."""
    version: int = 0
    """Policy version published so far."""
    data_position: int = 0
    """Prompts issued from the dataset (the next prompt's index)."""
    updates: int = 0
    """Optimizer updates done."""
    ledger: dict | None = None
    """The buffer's books at the checkpoint (:class:`buffer.ledger.LedgerSnapshot` as JSON; rank 0 only)."""


def rng_state() -> dict:
    np_state = np.random.get_state()
    out = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *map(float, np_state[2:])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state().tolist()
    return out


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), int(n[2]), int(n[3]), float(n[4])))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def _state_dicts(model, optimizer, critic) -> dict:  # type: ignore[no-untyped-def]
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    out = {"model": _trainable(model, model_sd), "optim": optim_sd}
    if critic is not None:
        out["critic"], out["critic_optim"] = get_state_dict(critic.model, critic.optimizer)
    return out


def save_checkpoint(folder: Path, *, model, optimizer, scheduler, state: TrainState, critic=None) -> Path:  # type: ignore[no-untyped-def]
    """Collective: every rank calls it. ``critic``: a :class:`learner.critic.Critic`, saved alongside."""
    path = Path(folder) / f"step_{state.step}"
    rank = dist.get_rank()
    dcp.save(_state_dicts(model, optimizer, critic), checkpoint_id=str(path))
    (path / f"rng_rank{rank}.json").write_text(json.dumps(rng_state()))
    dist.barrier()
    if rank == 0:
        body = {"state": asdict(state), "scheduler": scheduler.state_dict()}
        tmp = path / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(path / STATE_FILE)
        log.info("checkpoint_saved", path=str(path), step=state.step)
    dist.barrier()
    return path


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint folder (``step_<n>``)."""
    return int(path.name.split("_")[1])


def latest_checkpoint(folder: Path) -> Path | None:
    done = [p for p in Path(folder).glob("step_*") if (p / STATE_FILE).exists()]
    return max(done, key=checkpoint_step, default=None)


def load_checkpoint(path: Path, *, model, optimizer, scheduler, critic=None) -> TrainState:  # type: ignore[no-untyped-def]
    """Collective: restore model, optimizer, scheduler, the critic if given, and this rank's RNG; returns
    the trainer state."""
    sd = _state_dicts(model, optimizer, critic)
    try:
        dcp.load(sd, checkpoint_id=str(path))
    except Exception as e:  # DCP names the missing keys; say what that means here
        if critic is not None and "critic" in str(e):
            raise RuntimeError(f"{path} holds no critic (saved by a run without adv_estimator: gae?) — resume "
                               "it with the algorithm it was trained with") from e  # fmt: skip
        raise
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                   options=_options(model))  # fmt: skip
    if critic is not None:
        set_state_dict(critic.model, critic.optimizer, model_state_dict=sd["critic"],
                       optim_state_dict=sd["critic_optim"])  # fmt: skip
    body = json.loads((path / STATE_FILE).read_text())
    scheduler.load_state_dict(body["scheduler"])
    rng_file = path / f"rng_rank{dist.get_rank()}.json"
    if rng_file.exists():  # a different world size: ranks without a file keep their fresh seed
        set_rng_state(json.loads(rng_file.read_text()))
    log.info("checkpoint_loaded", path=str(path), **body["state"])
    return TrainState(**body["state"])


def _options(model) -> StateDictOptions | None:
    # LoRA: the frozen base weights are model.path's; a checkpoint holds the adapters and their optimizer.
    # Loading is then not strict about the base keys it leaves alone; dcp.load itself still fails when
    # the checkpoint lacks an adapter key.
    return StateDictOptions(ignore_frozen_params=True, strict=False) if lora.is_lora(model) else None


def _trainable(model, model_sd: dict) -> dict:
    """LoRA: the adapters alone (``ignore_frozen_params`` keeps a frozen weight tied under a second name)."""
    if not lora.is_lora(model):
        return model_sd
    keep = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model_sd.items() if k in keep}


def export_hf(model, *, out_dir: Path, source_dir: str) -> None:
    """Collective: gather full weights and write ``out_dir`` so ``from_pretrained`` loads it (rank 0 writes).

    With LoRA ``out_dir`` holds the merged weights and ``out_dir/adapter`` the peft adapter."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if lora.is_lora(model):
            plain = lora.export(model, sd, out_dir=out_dir)
        else:
            plain = AutoModelForCausalLM.from_config(model.config)
            plain.load_state_dict(sd)
        plain.save_pretrained(out_dir, safe_serialization=True)
        # The tokenizer and generation files come from the source folder unchanged.
        for f in Path(source_dir).iterdir():
            weights = f.suffix in (".safetensors", ".bin") or f.name.endswith(".index.json")
            if f.is_file() and not weights and f.name != "config.json" and not (out_dir / f.name).exists():
                shutil.copy2(f, out_dir / f.name)
        log.info("hf_exported", path=str(out_dir))
    dist.barrier()
