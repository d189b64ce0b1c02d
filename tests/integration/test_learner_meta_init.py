"""Meta-device init (:mod:`learner.meta_init`) on two real gloo ranks.

- Built on meta and loaded shard by shard, the model equals ``from_pretrained``'s: every parameter
  (``full_tensor``), every buffer (the rotary ``inv_freq`` is recomputed: it is not in the checkpoint), the
  logits, tied embeddings still one parameter, eval mode — sharded and as the plain module one rank runs, for
  Qwen2 from a multi-file float32 checkpoint, Gemma 3 (tied) from a bfloat16 one (as a GGUF-converted folder
  is), and a ``pytorch_model.bin`` folder, which takes the rank-0 broadcast path. LoRA on top keeps the base
  weights and starts from fresh adapters (B = 0); the critic's body is the checkpoint's, its head fresh.
- Memory: loading a ~170 MB float32 model, each rank's peak resident memory grows by about its half, well
  under the whole model; the previous way (``from_pretrained`` on every rank, then ``fully_shard``) grows
  each rank by more than the whole model, which the same bound refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import leave_group
from tether.redis_server import free_port

pytestmark = pytest.mark.slow
IDS = [[5, 17, 3, 42, 9, 60, 1, 33]]
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["embed_tokens"]}


def _cfg(model_dir: str):
    from tether.config import TetherConfig

    return TetherConfig.model_validate({"model": {"path": model_dir}, "rollout": {"max_tokens": 8}})


def _tiny(kind: str) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if kind == "gemma3":
        config = Gemma3TextConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=4, tie_word_embeddings=True,
        )  # fmt: skip
        return Gemma3ForCausalLM(config)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("meta-init")
    qwen2 = _tiny("qwen2")
    qwen2.save_pretrained(root / "qwen2", max_shard_size="20KB")  # several files and an index
    assert (root / "qwen2" / "model.safetensors.index.json").exists()
    _tiny("gemma3").to(torch.bfloat16).save_pretrained(root / "gemma3")  # as a GGUF-converted folder: bf16
    qwen2.save_pretrained(root / "bin")
    torch.save(qwen2.state_dict(), root / "bin" / "pytorch_model.bin")  # transformers 5 writes only safetensors
    (root / "bin" / "model.safetensors").unlink()
    return {name: str(root / name) for name in ("qwen2", "gemma3", "bin")}


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _diffs(model: torch.nn.Module, want: dict[str, torch.Tensor], *, peft: bool = False) -> dict[str, float]:
    """Largest difference of each parameter and buffer of ``model`` (sharded or not) from ``want``'s (for a
    peft model: each base parameter from the plain model's, by its base name)."""
    out = {}
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        assert not t.is_meta, n
        full = _full(t)
        if not (peft and ".lora_" in n):
            out[n] = (full - want[_base_name(n) if peft else n]).abs().max().item()
    return out


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS)).logits


def _equality_worker(rank: int, port: int, dirs_json: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModel, AutoModelForCausalLM

    from learner import lora
    from learner.critic import critic_view, load_value_model
    from learner.parallelize import load_actor, load_model, parallelize
    from tether.config import TetherConfig
    from tether.logs import setup_logging

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    setup_logging(process=f"rank{rank}", log_file=Path(out, f"rank{rank}.log"))
    dev = torch.device("cpu")
    report = {}
    for name, path in json.loads(dirs_json).items():
        cfg = _cfg(path)
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        want = {**ref.state_dict(), **dict(ref.named_buffers())}
        for shard in (True, False):  # two ranks sharded, and the plain module one rank would run
            model = parallelize(load_model(cfg, dev, meta=True), cfg, dev, shard=shard)
            assert isinstance(model, FSDPModule) == shard
            diffs = _diffs(model, want)
            diffs["logits"] = (_logits(model) - _logits(ref)).abs().max().item()
            report[f"{name}/{'sharded' if shard else 'plain'}"] = {
                "diffs": diffs,
                "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                "ref_tied": ref.lm_head.weight is ref.model.embed_tokens.weight,
                "training": model.training,
                "params": sorted(n for n, _ in model.named_parameters()),
                "ref_params": sorted(n for n, _ in ref.named_parameters()),
            }
            del model
        # LoRA (a saved embedding, tied on Gemma), sharded and plain; the critic's body, sharded.
        lcfg = TetherConfig.model_validate({**cfg.model_dump(), "model": {"path": path, "lora": LORA}})
        for shard in (True, False):
            torch.manual_seed(0)
            actor = parallelize(load_actor(lcfg, dev, meta=True), lcfg, dev, shard=shard)
            adapters = {n: _full(p) for n, p in actor.named_parameters() if ".lora_" in n}
            report[f"{name}/lora-{'sharded' if shard else 'plain'}"] = {
                "diffs": _diffs(actor, want, peft=True),
                "logits": (_logits(actor) - _logits(ref)).abs().max().item(),  # B = 0: the base model's output
                "a_nonzero": all(t.abs().sum().item() > 0 for n, t in adapters.items() if ".lora_A." in n),
                "b_zero": all(t.abs().sum().item() == 0 for n, t in adapters.items() if ".lora_B." in n),
                "adapters": len(adapters),
                "is_lora": lora.is_lora(actor),
            }
            del actor
        critic = parallelize(load_value_model(cfg, dev, meta=True), critic_view(cfg), dev)
        body = AutoModel.from_pretrained(path, dtype=torch.float32)
        body = {**body.state_dict(), **dict(body.named_buffers())}
        head = critic.value_head.weight.full_tensor()
        report[f"{name}/critic"] = {
            "diffs": _diffs(critic.model, body),
            "head_std": head.std().item(),
        }
        del critic, ref
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    leave_group()


def _base_name(name: str) -> str:
    """A peft parameter's name in the base model (as test_learner_lora compares them)."""
    name = name.removeprefix("base_model.model.")
    for part in (".base_layer", ".original_module", ".modules_to_save.default"):
        name = name.replace(part, "")
    return name


def test_meta_init_on_two_ranks_equals_from_pretrained(model_dirs: dict[str, str], tmp_path: Path) -> None:
    mp.spawn(_equality_worker, args=(free_port(), json.dumps(model_dirs), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        # How each model was read: every rank its slices, but the .bin folder through rank 0's broadcast.
        events = [json.loads(line) for line in (tmp_path / f"rank{rank}.log").read_text().splitlines()]
        reads = [(Path(e["path"]).name, e["read"]) for e in events if e["event"] == "weights_loaded"]
        assert reads == [(name, "rank0" if name == "bin" else "slices") for name in model_dirs for _ in range(5)]
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert {k.split("/")[0] for k in report} == {"qwen2", "gemma3", "bin"}
        for key, r in report.items():
            name, kind = key.split("/")
            assert {k: v for k, v in r["diffs"].items() if v != 0.0} == {}, (key, rank)
            assert any("rotary_emb" in k for k in r["diffs"]), key  # the buffers were compared
            if kind in ("sharded", "plain"):
                assert r["params"] == r["ref_params"], key
                assert r["tied"] == r["ref_tied"] == (name == "gemma3"), key
                assert r["training"] is False, key  # eval mode, as from_pretrained returns it
                assert r["diffs"]["logits"] == 0.0, key
            elif kind.startswith("lora"):
                assert r["is_lora"] and r["adapters"] == 2 * 2 * 2, key  # q and v, 2 layers, A and B
                assert r["a_nonzero"] and r["b_zero"], key
                assert r["logits"] < 1e-5, key
                assert any(".modules_to_save." in k for k in r["diffs"]), key  # the saved copy holds the weights
            else:
                assert 0.0 < r["head_std"] < 0.1, key  # a fresh head, not left empty


def _memory_models(root: Path) -> tuple[str, str, int]:
    """A ~170 MB float32 Qwen2 saved in bfloat16 (as released models and GGUF-converted folders are), and a
    tiny one of the same kind to warm up with: (big folder, tiny folder, the big one's float32 bytes)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = {"num_attention_heads": 8, "num_key_value_heads": 4, "tie_word_embeddings": False}
    big = Qwen2Config(vocab_size=24000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, **shape)
    tiny = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, **shape)
    Qwen2ForCausalLM(tiny).to(torch.bfloat16).save_pretrained(root / "tiny")
    model = Qwen2ForCausalLM(big)
    size = sum(p.numel() for p in model.parameters()) * 4
    model.to(torch.bfloat16).save_pretrained(root / "big", max_shard_size="2GB")
    return str(root / "big"), str(root / "tiny"), size


def _status(field: str) -> int:
    """A ``/proc/self/status`` size in bytes (VmRSS: resident now, VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _memory_worker(rank: int, port: int, big: str, tiny: str, meta: bool, out: str) -> None:
    import gc

    import torch.distributed as dist

    from learner.parallelize import load_model, parallelize

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dev = torch.device("cpu")
    # The same path on a tiny model first: the modules it imports on first use are not the load's memory.
    warm = parallelize(load_model(_cfg(tiny), dev, meta=meta), _cfg(tiny), dev)
    del warm
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to VmRSS: the peak from here on
    before = _status("VmRSS")
    model = parallelize(load_model(_cfg(big), dev, meta=meta), _cfg(big), dev)
    growth = _status("VmHWM") - before
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    Path(out, f"rank{rank}.json").write_text(json.dumps({"growth": growth, "held": held}))
    del model
    leave_group()


def test_each_rank_holds_about_its_shard_while_loading(tmp_path: Path) -> None:
    big, tiny, size = _memory_models(tmp_path)
    bound = 0.75 * size  # its half, and a quarter of the model for everything else
    growth = {}
    for meta in (True, False):
        out = tmp_path / f"meta-{meta}"
        out.mkdir()
        mp.spawn(_memory_worker, args=(free_port(), big, tiny, meta, str(out)), nprocs=2)
        growth[meta] = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    mb = {meta: [round(r["growth"] / 2**20) for r in rows] for meta, rows in growth.items()}
    print(f"model {size / 2**20:.0f} MB; peak growth per rank (MB): meta init {mb[True]}, from_pretrained {mb[False]}")
    for r in growth[True]:
        assert r["held"] <= 0.55 * size  # the shard a rank keeps
        assert r["growth"] < bound, mb
    for r in growth[False]:  # the previous way refuses the bound: every rank held the whole model
        assert r["growth"] >= size > bound, mb
