"""``learner.param_dtype: bfloat16`` computes in bf16 on CPU too, with float32 master weights and grads.

TRL's ``bf16=True`` default runs its CPU training under bf16 autocast; tether's learner offers the same,
through FSDP2's mixed precision where the model is sharded and through autocast where one rank runs it
unsharded (the default at world size 1). The reference for the numbers is the same step in float32 on the
same model and groups: a real one-rank gloo group and the real tiny model, both ways.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def _cfg(model_dir: Path, param_dtype: str):
    from tether.config import TetherConfig

    return TetherConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"max_tokens": 24},
            "learner": {"train_batch_size": 4, "lr": 1e-2, "lr_warmup_steps": 0, "param_dtype": param_dtype},
            "algorithm": {"max_staleness": 1},
        }
    )


def test_auto_is_bf16_on_gpu_float32_on_cpu_and_an_explicit_bf16_applies_on_cpu(tmp_path: Path) -> None:
    from learner.parallelize import compute_dtype, mixed_precision_policy

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compute_dtype(_cfg(tmp_path, "auto"), cpu) == torch.float32
    assert compute_dtype(_cfg(tmp_path, "auto"), cuda) == torch.bfloat16
    assert compute_dtype(_cfg(tmp_path, "float32"), cuda) == torch.float32
    policy = mixed_precision_policy(_cfg(tmp_path, "bfloat16"), cpu)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy(_cfg(tmp_path, "auto"), cpu).param_dtype == torch.float32
    on_gpu = _cfg(tmp_path, "float32")
    on_gpu.learner.reduce_dtype = "bfloat16"  # on GPU a float32 step still reduces as configured
    assert mixed_precision_policy(on_gpu, cuda).reduce_dtype == torch.bfloat16


def _step(
    model_dir: Path, param_dtype: str, shard: bool | None
) -> tuple[dict, dict[str, torch.Tensor], set[torch.dtype], dict]:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from learner.parallelize import load_actor, parallelize
    from learner.synthetic import make_groups
    from learner.trainer import Trainer

    cfg = _cfg(model_dir, param_dtype)
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = parallelize(load_actor(cfg, device), cfg, device, shard=shard)
    assert isinstance(model, FSDPModule) == bool(shard)  # one rank, nothing offloaded: unsharded by default
    trainer = Trainer(cfg, model, device=device, ref_model=None)
    seen: set[torch.dtype] = set()
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
    grads: dict[str, torch.Tensor] = {}

    def keep_grads(*_) -> None:
        full = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
        grads.update({n: g.detach().clone() for n, g in full.items()})

    trainer.optimizer.register_step_pre_hook(keep_grads)
    metrics = trainer.train_step(make_groups(4, 4, vocab=256, seed=0), version=1)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    return metrics, grads, seen, dtypes


@pytest.mark.parametrize("shard", [None, True], ids=["unsharded-autocast", "fsdp2-mixed-precision"])
def test_a_bf16_step_on_cpu_computes_in_bf16_and_agrees_with_float32(
    one_rank: None, model_dir: Path, shard: bool | None
) -> None:
    ref, ref_grads, ref_seen, _ = _step(model_dir, "float32", shard)
    got, grads, seen, dtypes = _step(model_dir, "bfloat16", shard)
    assert ref_seen == {torch.float32}
    assert seen == {torch.bfloat16}  # the matmuls ran in bf16 ...
    assert set(dtypes.values()) == {torch.float32}  # ... the master weights stayed float32 ...
    assert grads.keys() == ref_grads.keys() and grads
    cos = []
    for name, g in grads.items():
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), name  # ... and so did the gradients
        cos.append(torch.nn.functional.cosine_similarity(g.flatten(), ref_grads[name].flatten(), dim=0))
    # bf16 keeps 8 bits of mantissa: the step's numbers agree with float32's to about 1 %, the gradients'
    # directions nearly exactly; a step that ignored the setting would give identical numbers (checked above
    # through the dtypes), a broken one numbers far off.
    for key in ("loss/pg", "loss/total", "actor/iw_mean"):
        assert abs(got[key] - ref[key]) <= 0.02 * abs(ref[key]) + 1e-3, (key, got[key], ref[key])
    assert min(cos) > 0.98, min(cos)
    assert abs(got["actor/grad_norm"] - ref["actor/grad_norm"]) <= 0.03 * ref["actor/grad_norm"]
