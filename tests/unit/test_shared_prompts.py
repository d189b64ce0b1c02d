"""Shared prompts (``learner.share_prompts``): a prompt several samples of a micro-batch share runs through the
model once and each completion attends to it — the same per-token log-probs and gradients as one copy of
the prompt per sample, for every family of ``test_model_families_packed`` (sliding windows reaching into the
prompt, Gemma 2's softcap, gpt-oss's sinks).

Groups have prompts longer than the window, completions of several lengths (some equal: one sdpa batch), an
empty completion and a prompt only one sample has. The reference is transformers' padded eager forward on
each sample whole; the check fails when the completions do not see their prompt (the layout read as plain
segments, which is what flash_attention_2 would make of it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from learner.logprobs import forward_micro_batch
from learner.packing import Sample, make_micro_batch, row_tokens, shared_prompt_units
from learner.varlen_attention import cu_seqlens_kwargs, register
from tests.unit.test_model_families_packed import FAMILIES, VOCAB, WINDOW, _model, _padded_eager

CPU = torch.device("cpu")
PROMPTS = [13, 4, 11]  # longer and shorter than the window of 8
COMPLETIONS = [[5, 9, 5, 1, 0, 12], [3], [7, 7, 2]]  # group 1 has one sample: nothing to share


def _samples() -> list[Sample]:
    rng = np.random.default_rng(1)
    out = []
    for g, (p, cs) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        prompt = rng.integers(0, VOCAB, p)
        for c in cs:
            ids = np.concatenate([prompt, rng.integers(0, VOCAB, c)])
            out.append(
                Sample(input_ids=ids, prompt_len=p, behavior_logprobs=np.zeros(c), loss_mask=np.ones(c), group=g)
            )
    order = np.random.default_rng(2).permutation(len(out))  # groups interleaved in the micro-batch
    return [out[i] for i in order]


def _reference(model: torch.nn.Module, samples: list[Sample]) -> torch.Tensor:
    """Completion log-probs of each sample whole (its own prompt copy), padded eager."""
    full = _padded_eager(model, [s.input_ids for s in samples])  # every position after the first
    out, at = [], 0
    for s in samples:
        out.append(full[at + s.prompt_len - 1 : at + s.length - 1])
        at += s.length - 1
    return torch.cat(out)


def _shared(model: torch.nn.Module, samples: list[Sample]) -> torch.Tensor:
    model.set_attn_implementation(register())
    mb = make_micro_batch(samples, list(range(len(samples))), packed=True, share_prompts=True)
    assert mb.prompt_tree is not None
    return forward_micro_batch(model, mb, device=CPU)[0]


def test_the_row_holds_each_shared_prompt_once() -> None:
    samples = _samples()
    mb = make_micro_batch(samples, list(range(len(samples))), packed=True, share_prompts=True)
    plain = make_micro_batch(samples, list(range(len(samples))), packed=True)
    assert mb.input_ids.shape[1] == sum(PROMPTS) + sum(map(sum, COMPLETIONS))
    assert row_tokens(samples, list(range(len(samples))), share_prompts=True) == mb.input_ids.shape[1]
    assert row_tokens(samples, list(range(len(samples))), share_prompts=False) == plain.input_ids.shape[1]
    assert plain.input_ids.shape[1] == sum(p * len(cs) + sum(cs) for p, cs in zip(PROMPTS, COMPLETIONS, strict=True))
    # the per-token fields keep the samples' order: the same targets and owners as the plain row
    assert torch.equal(mb.targets, plain.targets) and torch.equal(mb.seq_ids, plain.seq_ids)
    tree = sorted((p, sorted(cs)) for p, cs in mb.prompt_tree)
    assert tree == [(7, []), (11, [2, 7, 7]), (13, [1, 5, 5, 9, 12])]  # the empty completion adds no segment


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shared_prompt_logprobs_equal_one_copy_per_sample(family: str) -> None:
    model, samples = _model(family), _samples()
    with torch.no_grad():
        want = _reference(model, samples)
        got = _shared(model, samples)
    assert got.shape == want.shape == (sum(map(sum, COMPLETIONS)),)
    assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "gpt-oss"])
def test_the_check_fails_when_completions_do_not_see_their_prompt(family: str) -> None:
    model, samples = _model(family), _samples()
    model.set_attn_implementation(register())
    mb = make_micro_batch(samples, list(range(len(samples))), packed=True, share_prompts=True)
    kwargs = {"use_cache": False, **cu_seqlens_kwargs(mb.seq_lengths, CPU)}  # segments, no tree
    with torch.no_grad():
        want = _reference(model, samples)
        hidden = model(input_ids=mb.input_ids, position_ids=mb.position_ids, **kwargs).logits[0]
        wrong = hidden[mb.logit_index].float().log_softmax(-1).gather(-1, mb.targets[:, None])[:, 0]
    assert float((wrong - want).abs().max()) > 1e-2


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3", "gpt-oss"])
def test_shared_prompt_gradients_equal_one_copy_per_sample(family: str) -> None:
    """The prompt's tokens collect the gradient of every completion that reads them, as the copies would."""
    model, samples = _model(family), _samples()
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.linspace(-1.0, 1.0, sum(map(sum, COMPLETIONS)))  # advantage-like, signs differ per token
    want = torch.autograd.grad((_reference(model, samples) * weights).sum(), params)
    got = torch.autograd.grad((_shared(model, samples) * weights).sum(), params)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, g, w in zip(names, got, want, strict=True):
        assert_close(g, w, atol=1e-4, rtol=1e-4, msg=name)


def test_units_keep_a_prompts_samples_together_within_the_budget() -> None:
    samples = _samples()
    index = list(range(len(samples)))
    units, costs = shared_prompt_units(samples, index, budget=30)
    assert sorted(i for u in units for i in u) == index
    for unit, cost in zip(units, costs, strict=True):
        assert len({samples[i].group for i in unit}) == 1
        p = samples[unit[0]].prompt_len
        assert cost == p + sum(samples[i].num_completion for i in unit)
        assert cost <= 30 or len(unit) == 1
    # group 0 (prompt 13, completions 32 tokens) does not fit 30 whole: it is cut, never mixed
    assert sum(1 for u in units if samples[u[0]].group == 0) >= 2


def test_windows_reach_into_the_prompt() -> None:
    """The inputs exercise what matters: windowed layers whose completions sit past the window's reach."""
    assert max(PROMPTS) > WINDOW and max(max(cs) for cs in COMPLETIONS) > WINDOW


def test_a_training_step_with_shared_prompts_equals_one_with_copies(one_rank: None, model_dir) -> None:  # type: ignore[no-untyped-def]
    """Two steps of the real trainer (one gloo rank, FSDP2) on the same groups: the losses, the gradient norm and
    the weights after them agree with the knob on and off (float32; only the order of sums differs)."""
    from tests.unit.test_trainer_lean_step import _steps

    shared, shared_weights = _steps(model_dir, share_prompts=True)
    copies, copy_weights = _steps(model_dir, share_prompts=False)
    for a, b in zip(shared, copies, strict=True):
        assert a["learner/tokens_computed"] < b["learner/tokens_computed"] == b["learner/tokens"]
        for key in ("loss/total", "actor/grad_norm", "actor/entropy", "actor/ppo_kl"):
            assert_close(a[key], b[key], atol=1e-5, rtol=1e-4, msg=key)
    # Adam divides by the gradient's own size: where a gradient is ~0, rounding alone moves a weight by a
    # fraction of lr (3e-3): 1.2e-5 seen; a layout that changed the gradients would move them by ~lr.
    for name, weight in copy_weights.items():
        assert_close(shared_weights[name], weight, atol=1e-4, rtol=1e-4, msg=name)
