"""LoRA on the actor under FSDP2 with two real gloo ranks: adapters and the saved (tied) embedding train,
the base stays, checkpoints hold both and resume exactly, ``final/`` holds the merged model and
``final/adapter`` the peft adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from tests.helpers import leave_group
from tether.redis_server import free_port

pytestmark = pytest.mark.slow
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "modules_to_save": ["embed_tokens"]}
SAVED = "base_model.model.model.embed_tokens.modules_to_save.default.weight"


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from learner.checkpoint import TrainState, export_hf, load_checkpoint, save_checkpoint
    from learner.parallelize import load_actor, parallelize
    from learner.synthetic import make_groups
    from learner.trainer import Trainer
    from tether.config import TetherConfig

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = TetherConfig.model_validate(
        {
            "model": {"path": model_dir, "lora": LORA},
            "rollout": {"max_tokens": 32},
            "learner": {"train_batch_size": 4, "lr": 1e-2, "max_token_len_per_gpu": 64},
            "algorithm": {"entropy_coeff": 0.0},
        }
    )
    dev = torch.device("cpu")

    def actor() -> tuple[torch.nn.Module, Trainer]:
        torch.manual_seed(0)
        model = parallelize(load_actor(cfg, dev, meta=True), cfg, dev)  # as the learner builds it
        return model, Trainer(cfg, model, device=dev, ref_model=None)

    batches = [make_groups(4, 4, vocab=256, seed=s) for s in range(2)]
    model, trainer = actor()
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    names = [n for n, p in model.named_parameters() if id(p) in in_optimizer]
    trainer.train_step(batches[0], version=0)
    ckpt = save_checkpoint(Path(out, "ckpt"), model=model, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                           state=TrainState(step=1))  # fmt: skip
    row = trainer.train_step(batches[1], version=0)
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    export_hf(model, out_dir=Path(out, "final"), source_dir=model_dir)

    fresh, fresh_trainer = actor()
    load_checkpoint(ckpt, model=fresh, optimizer=fresh_trainer.optimizer, scheduler=fresh_trainer.scheduler)
    resumed = fresh_trainer.train_step(batches[1], version=0)
    if rank == 0:
        stored = sorted(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
        Path(out, "result.json").write_text(json.dumps({"names": names, "stored": stored, "row": row,
                                                         "resumed": resumed}))  # fmt: skip
        save_file({k: v.contiguous() for k, v in full.items()}, str(Path(out, "trained.st")))
    del model, trainer, fresh, fresh_trainer
    leave_group()


def test_lora_trains_adapters_only_and_exports_adapter_and_merged(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    mp.spawn(_worker, args=(free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2)
    result = json.loads((tmp_path / "result.json").read_text())
    trained = load_file(str(tmp_path / "trained.st"))
    # Only the adapters and the saved embedding (one copy, tied to the output layer) are optimised; the
    # base weights are bit-for-bit model.path's.
    assert SAVED in result["names"]
    assert all(".lora_A." in n or ".lora_B." in n for n in result["names"] if n != SAVED)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for name, value in trained.items():
        if ".lora_" not in name and ".modules_to_save." not in name:
            plain = name.replace("base_model.model.", "").replace(".base_layer", "").replace(".original_module", "")
            assert_close(value, base[plain], rtol=0, atol=0)
    assert all(trained[n].abs().sum() > 0 for n in result["names"] if ".lora_B." in n)  # B left its zero init
    assert (trained[SAVED] - base["model.embed_tokens.weight"]).abs().max() > 1e-4  # the saved copy trained
    # A checkpoint holds the adapters and the saved module (and their optimizer state), not the base model.
    model_keys = [k for k in result["stored"] if k.startswith("model.")]
    assert model_keys and all(".lora_" in k or ".modules_to_save." in k for k in model_keys)
    assert any(".modules_to_save." in k for k in model_keys)
    for key in ("loss/total", "loss/pg", "actor/grad_norm"):
        assert_close(result["resumed"][key], result["row"][key], rtol=0, atol=0, msg=key)
    # final/ is the merged model; final/adapter on the base model computes the same.
    ids = torch.tensor([[5, 70, 71, 72, 73, 74]])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    base_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    adapted = PeftModel.from_pretrained(base_model, tmp_path / "final" / "adapter")
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
        assert (want - AutoModelForCausalLM.from_pretrained(tiny_model_dir)(input_ids=ids).logits).abs().max() > 1e-4
