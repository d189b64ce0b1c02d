"""The learner's MFU levers, each behind a switch, give the step the baseline gives.

``learner.shard_single_rank`` (FSDP2 on one rank instead of a plain module) and ``learner.use_torch_compile``
(each decoder block compiled) are run for real on the tiny model in float32 on a one-rank gloo group, against
the same step with the switch off: same loss, same gradients. ``learner.varlen_attention: torch`` needs CUDA
(tests/gpu compares it with the split kernel there); here its argument mapping is checked against a stand-in
kernel that computes attention per sequence. The lengths reach attention from the host: a forward never
reads the boundaries back from the device.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F


def _cfg(model_dir: Path, algorithm: dict | None = None, **learner):
    from tether.config import TetherConfig

    return TetherConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"max_tokens": 24},
            "learner": {"train_batch_size": 4, "lr": 1e-2, "use_remove_padding": True, **learner},
            "algorithm": algorithm or {},
        }
    )


def _step(
    model_dir: Path, algorithm: dict | None = None, **learner
) -> tuple[dict, dict[str, torch.Tensor], torch.nn.Module]:
    from torch.distributed.tensor import DTensor

    from learner.parallelize import load_actor, parallelize
    from learner.synthetic import make_groups
    from learner.trainer import Trainer

    cfg = _cfg(model_dir, algorithm, **learner)
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = parallelize(load_actor(cfg, device), cfg, device)
    trainer = Trainer(cfg, model, device=device, ref_model=None)
    grads: dict[str, torch.Tensor] = {}

    def keep_grads(*_) -> None:
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[n.replace("_orig_mod.", "")] = g.detach().clone()

    trainer.optimizer.register_step_pre_hook(keep_grads)
    metrics = trainer.train_step(make_groups(4, 4, vocab=256, seed=0), version=1)
    return metrics, grads, model


def _assert_same_step(got: tuple, ref: tuple, *, rtol: float) -> None:
    (metrics, grads, _), (ref_metrics, ref_grads, _) = got, ref
    for key in ("loss/pg", "loss/total", "actor/grad_norm"):
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=rtol, abs=1e-6), key
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=rtol, atol=1e-6, msg=name)


def test_shard_single_rank_wraps_in_fsdp2_and_gives_the_plain_modules_step(one_rank: None, model_dir: Path) -> None:
    from torch.distributed.fsdp import FSDPModule

    ref = _step(model_dir)
    got = _step(model_dir, shard_single_rank=True)
    assert not isinstance(ref[2], FSDPModule) and isinstance(got[2], FSDPModule)
    _assert_same_step(got, ref, rtol=1e-4)


def test_compiled_blocks_give_the_eager_step(one_rank: None, model_dir: Path) -> None:
    from learner.parallelize import decoder_blocks

    ref = _step(model_dir)
    got = _step(model_dir, use_torch_compile=True)
    assert all(b._compiled_call_impl is not None for b in decoder_blocks(got[2]))
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in decoder_blocks(ref[2]))
    _assert_same_step(got, ref, rtol=1e-4)


def test_the_torch_kernel_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    from learner.parallelize import varlen_kernel

    cpu = torch.device("cpu")
    assert varlen_kernel(_cfg(tmp_path), cpu) == "split"
    with pytest.raises(RuntimeError, match=r"learner\.varlen_attention: torch needs CUDA"):
        varlen_kernel(_cfg(tmp_path, varlen_attention="torch"), cpu)
    with pytest.raises(RuntimeError, match="param_dtype"):  # float32 compute: the flash kernel has none
        varlen_kernel(_cfg(tmp_path, varlen_attention="torch", param_dtype="float32"), torch.device("cuda"))


def _per_sequence_kernel(calls: list, *, new_api: bool):  # type: ignore[no-untyped-def]
    """A stand-in for torch's varlen kernel, in either release's signature: attention per sequence."""

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, enable_gqa=False):  # type: ignore[no-untyped-def]
        assert q.dim() == 3 and q.shape[1] == (q.shape[1] if enable_gqa else k.shape[1])
        calls.append((cu_q.tolist(), max_q, scale, enable_gqa))
        bounds = cu_q.tolist()
        out = []
        for a, b in itertools.pairwise(bounds):
            x = [t[a:b].transpose(0, 1) for t in (q, k, v)]  # [H, L, D]
            out.append(F.scaled_dot_product_attention(*x, is_causal=True, scale=scale, enable_gqa=enable_gqa))
        return torch.cat(out, dim=1).transpose(0, 1)

    if new_api:

        def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                   enable_gqa=False):  # type: ignore[no-untyped-def]  # fmt: skip
            assert window_size == (-1, 0)  # causal
            return attend(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, enable_gqa=enable_gqa)
    else:

        def kernel(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):  # type: ignore[no-untyped-def]
            assert is_causal
            return attend(q, k, v, cu_q, cu_k, max_q, max_k)

    return kernel


@pytest.mark.parametrize("new_api", [False, True], ids=["torch-2.10-signature", "later-signature"])
def test_the_torch_kernels_arguments_give_the_split_kernels_output(
    monkeypatch: pytest.MonkeyPatch, new_api: bool
) -> None:
    from learner import varlen_attention as va

    calls: list = []
    kernel = _per_sequence_kernel(calls, new_api=new_api)
    monkeypatch.setattr(va, "_torch_varlen", lambda: kernel)
    va._torch_varlen_params.cache_clear()
    try:
        torch.manual_seed(3)
        lengths = [5, 9, 5, 3]
        q, k, v = torch.randn(1, 4, 22, 8), torch.randn(1, 2, 22, 8), torch.randn(1, 2, 22, 8)
        kw = va.cu_seqlens_kwargs(lengths)
        got = va.torch_varlen_sdpa(q, k, v, kw["cu_seq_lens_q"], max(lengths), scale=0.3)
    finally:
        va._torch_varlen_params.cache_clear()
    want = va.varlen_sdpa(q, k, v, lengths, scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls[0][0] == [0, 5, 14, 19, 22] and calls[0][1] == 9  # one launch for the whole row
    assert calls[0][3] == new_api  # GQA natively where the kernel has it, heads repeated where not


def test_a_packed_forward_takes_the_lengths_from_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from learner import varlen_attention as va
    from tests.helpers import tiny_qwen2

    model = tiny_qwen2(va.VARLEN)
    lengths = [7, 4, 9]
    kwargs = va.cu_seqlens_kwargs(lengths)
    ids = torch.randint(0, 64, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]

    def no_readback(self, *a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("the boundaries were read back from the device")

    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos, **kwargs).logits
        monkeypatch.setattr(torch.Tensor, "tolist", no_readback)
        got = model(input_ids=ids, position_ids=pos, **kwargs).logits  # would raise on a .tolist()
    torch.testing.assert_close(got, want)
    assert va.host_lengths(kwargs["cu_seq_lens_q"]) == tuple(lengths)
    other = kwargs["cu_seq_lens_q"].clone()  # same values, not built by cu_seqlens_kwargs: not vouched for
    assert va.host_lengths(other) is None


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01], ids=["entropy-metric", "entropy-in-loss"])
def test_the_fused_lm_head_gives_the_plain_heads_step(
    one_rank: None, model_dir: Path, entropy_coeff: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``learner.use_fused_kernels``: log-probs and entropy chunk by chunk inside the head (chunks of 7 rows
    here, so every micro-batch spans several), the same loss, entropy and gradients as the plain head."""
    from learner import fused_head, logprobs

    monkeypatch.setitem(logprobs.forward_micro_batch.__kwdefaults__, "chunk_size", 7)
    algo = {"entropy_coeff": entropy_coeff}
    ref = _step(model_dir, algorithm=algo)
    got = _step(model_dir, algorithm=algo, use_fused_kernels=True)
    head = fused_head.find(got[2])
    assert isinstance(head, fused_head.FusedHead) and fused_head.find(ref[2]) is None
    assert head.weight is got[2].get_input_embeddings().weight  # the tied weight stays tied
    assert set(got[2].state_dict()) == set(ref[2].state_dict())  # checkpoints and weight sync see no change
    assert got[0]["actor/entropy"] == pytest.approx(ref[0]["actor/entropy"], rel=1e-5)
    _assert_same_step(got, ref, rtol=1e-4)
