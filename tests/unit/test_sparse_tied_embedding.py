"""The tied embedding's sparse gradient (learner.parallelize.sparse_tied_embedding_grad): the same gradient as
the dense lookup's, left dense on the parameter, and only where the head shares the weight and a micro-batch
holds fewer tokens than the vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.parallelize import sparse_tied_embedding_grad


def _model(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _grads(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_sparse_lookup_gives_the_dense_gradient_and_leaves_it_dense(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    emb = model.get_input_embeddings()
    assert model.get_output_embeddings().weight is emb.weight  # the tiny model ties its head
    ids = torch.randint(0, emb.num_embeddings, (3, 17), generator=torch.Generator().manual_seed(0))
    dense = _grads(model, ids)
    assert sparse_tied_embedding_grad(model, token_budget=64) and emb.sparse
    sparse = _grads(model, ids)
    assert set(sparse) == set(dense)
    for name, g in sparse.items():
        assert g.layout == torch.strided, name  # AdamW (fused), clipping and FSDP2 read a dense .grad
        torch.testing.assert_close(g, dense[name], rtol=1e-5, atol=1e-6, msg=name)
    # a step of fused AdamW takes it as it took the dense one
    torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True).step()


@pytest.mark.parametrize("case", ["untied", "frozen", "budget_not_below_vocab"])
def test_it_is_left_dense_where_it_would_not_help(tiny_model_dir: Path, case: str) -> None:
    model = _model(tiny_model_dir)
    emb = model.get_input_embeddings()
    budget = 64
    if case == "untied":
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    elif case == "frozen":
        emb.weight.requires_grad_(False)
    else:
        budget = emb.num_embeddings
    assert not sparse_tied_embedding_grad(model, token_budget=budget)
    assert not emb.sparse
