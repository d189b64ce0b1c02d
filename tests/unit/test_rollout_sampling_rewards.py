"""Sampling numerics against closed forms, the built-in rewards, and the SGLang adapter's missing-package error."""

from __future__ import annotations

import pytest
import torch

from rollout_server.engines.sampling import RowParams, sample
from tether.scorers import last_boxed, math_equal, math_reward, normalize_answer


def _params(rows: list[tuple[float, float, int, int | None]]) -> RowParams:
    return RowParams.build(rows, torch.device("cpu"))


def _processed_reference(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """log-probs [V] of the distribution sampled from, row by row: softmax(logits / T) restricted to the top-k,
    then to the smallest prefix (by probability) whose mass reaches top_p, renormalised; T = 0: T = 1."""
    z = logits / (temperature if temperature > 0 else 1.0)
    if temperature > 0:
        order = z.argsort(descending=True)
        keep = torch.zeros_like(z, dtype=torch.bool)
        mass, probs = 0.0, torch.softmax(z.masked_fill(z < z[order[top_k - 1]], float("-inf")) if top_k > 0 else z, -1)
        for rank, v in enumerate(order.tolist()):
            if (top_k > 0 and rank >= top_k) or mass >= top_p:
                break
            keep[v], mass = True, mass + float(probs[v])
        z = z.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(z, -1)


def test_logprobs_are_of_the_processed_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    rows = [(0.7, 1.0, -1, None), (1.0, 1.0, -1, 3), (0.0, 1.0, 0, None), (2.0, 0.5, 5, 1), (0.5, 0.8, 0, 2)]
    for _ in range(20):  # many draws: tokens deep in the support too
        tokens, logps = sample(logits, _params(rows))
        for i, (t, p, k, _) in enumerate(rows):
            want = _processed_reference(logits[i], t, p, k)[tokens[i]]
            torch.testing.assert_close(logps[i], want, atol=1e-5, rtol=1e-5)
    # Temperature 0.7 without truncation is exactly log_softmax(logits / 0.7), not the raw (T = 1) log-probs.
    tokens, logps = sample(logits[:1].repeat(200, 1), _params([rows[0]] * 200))
    scaled = torch.log_softmax(logits[0] / 0.7, -1)[tokens]
    torch.testing.assert_close(logps, scaled, atol=1e-5, rtol=1e-5)
    assert (logps - torch.log_softmax(logits[0], -1)[tokens]).abs().max() > 0.1


def test_greedy_top_k_1_and_tiny_top_p_pick_the_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 100)
    tokens, _ = sample(logits, _params([(0.0, 1.0, 0, None), (1.0, 1.0, 1, None), (1.0, 1e-6, 0, None)]))
    assert tokens.tolist() == [int(logits[i].argmax()) for i in range(3)]


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(400, 1)
    tokens, _ = sample(logits, _params([(1.0, 1.0, 2, None)] * 400))
    assert set(tokens.tolist()) <= {0, 1}
    probs = torch.softmax(logits[0], -1)  # [0.636, 0.234, 0.086, ...]: top_p 0.8 keeps tokens 0 and 1
    assert probs[0] < 0.8 < probs[0] + probs[1]
    tokens, _ = sample(logits, _params([(1.0, 0.8, 0, None)] * 400))
    assert set(tokens.tolist()) == {0, 1}


def test_full_support_path_draws_from_the_distribution_it_reports() -> None:
    """No row truncates (the sort-free path): token frequencies follow softmax(logits / T) within 4 sigma,
    log-probs are exactly its log_softmax, and greedy rows in the same batch take the argmax with T = 1
    log-probs."""
    torch.manual_seed(2)
    logits, draws = torch.randn(6) * 2, 20000
    params = _params([(0.8, 1.0, 0, None)] * draws + [(0.0, 1.0, 0, None)] * 3)
    assert not params.truncates and params.has_greedy
    tokens, logps = sample(logits.repeat(draws + 3, 1), params)
    want = torch.softmax(logits / 0.8, -1)
    freq = torch.bincount(tokens[:draws], minlength=6).float() / draws
    torch.testing.assert_close(freq, want, atol=4 * (0.25 / draws) ** 0.5, rtol=0)
    torch.testing.assert_close(logps[:draws], torch.log_softmax(logits / 0.8, -1)[tokens[:draws]])
    assert tokens[draws:].tolist() == [int(logits.argmax())] * 3
    torch.testing.assert_close(logps[draws:], torch.log_softmax(logits, -1)[logits.argmax()].repeat(3))


def test_batched_rows_follow_their_own_softmax_down_to_the_tail() -> None:
    """What a training step samples: many rows, each its own peaked distribution over the tiny model's
    320 tokens. A pooled chi-square over (row, token) cells stays within 4 sigma of its degrees of freedom,
    and a near-collapsed row (one token at ~0.997) draws its tail as often as the tail's mass: a sampler
    that favoured the argmax, dropped rare tokens or mixed rows up would fail one of the two."""
    torch.manual_seed(3)
    rows, vocab, reps = 32, 320, 150
    logits = torch.randn(rows, vocab) * 4
    params = _params([(1.0, 1.0, 0, None)] * rows)
    counts = torch.zeros(rows, vocab)
    for _ in range(reps):
        tokens, logps = sample(logits, params)
        counts[torch.arange(rows), tokens] += 1
        torch.testing.assert_close(logps, torch.log_softmax(logits, -1)[torch.arange(rows), tokens])
    expected = torch.softmax(logits, -1) * reps
    chi2, dof = 0.0, 0
    for e, o in zip(expected, counts, strict=True):
        big = e >= 5  # the rest pooled into one cell per row
        pooled = (o[~big].sum() - e[~big].sum()) ** 2 / e[~big].sum()
        chi2 += float(((o[big] - e[big]) ** 2 / e[big]).sum() + pooled)
        dof += int(big.sum())  # cells (big ones + the pooled one) minus one
    assert abs(chi2 - dof) < 4 * (2 * dof) ** 0.5, (chi2, dof)

    draws = 20000
    tail = torch.randn(vocab) - 4.0
    tail[7] = 8.0
    tokens, _ = sample(tail.repeat(draws, 1), _params([(1.0, 1.0, 0, None)] * draws))
    mass = float(1 - torch.softmax(tail, -1)[7])
    assert abs(float((tokens != 7).float().mean()) - mass) < 5 * (mass / draws) ** 0.5, mass


def test_seeded_rows_are_reproducible() -> None:
    logits = torch.zeros(2, 1000)
    a, _ = sample(logits, _params([(1.0, 1.0, 0, 7), (1.0, 1.0, 0, 8)]))
    b, _ = sample(logits, _params([(1.0, 1.0, 0, 7), (1.0, 1.0, 0, 8)]))
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize(
    ("completion", "reference", "correct"),
    [
        ("so the answer is \\boxed{42}", "42", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{-\\frac{3}{4}}", "-0.75", True),
        ("\\boxed{1,000}", "1000", True),
        ("\\boxed{1{,}000}", "1000", False),
        ("we get 3/6 at the end", "1/2", True),
        ("\\boxed{2.50}", "5/2", True),
        ("\\boxed{-7}", "7", False),
        ("first \\boxed{3} then \\boxed{4}", "4", True),
        ("\\boxed{x+1}", "x + 1", True),
        ("no answer here", "3", False),
        ("\\boxed{\\text{12}}.", "12", True),
    ],
)
def test_math_reward(completion: str, reference: str, correct: bool) -> None:
    reward, parts = math_reward(completion, reference)
    assert reward == float(correct) and parts["correct"] == float(correct)


def test_math_helpers_and_format_bonus() -> None:
    assert last_boxed("\\boxed{\\frac{a}{b}} x") == "\\frac{a}{b}"
    assert last_boxed("\\boxed{unclosed") is None
    assert normalize_answer(" $1,234,567$ ") == "1234567"
    assert math_equal("0.125", "1/8") and not math_equal("1,2", "12")
    assert math_reward("\\boxed{5}", "6", format_bonus=0.1)[0] == 0.1
    assert math_reward("5", "6", format_bonus=0.1)[0] == 0.0


async def test_local_rewards_by_config() -> None:
    from rollout_server.rewards import RewardError, ScoreItem, build_reward
    from tether.config import load_config

    def item(text: str, ctx: dict[str, str]) -> ScoreItem:
        return ScoreItem("p", text, [1], [2], ctx, "t")

    exact = build_reward(load_config(None, ["--rollout.reward.type", "exact_match"]))
    assert await exact.score([item(" 42\n", {"answer": "42"}), item("41", {"answer": "42"})]) == [(1.0, {}), (0.0, {})]
    with pytest.raises(RewardError, match="answer"):
        await exact.score([item("42", {})])
    demo = build_reward(load_config(None, []))
    assert (await demo.score([item("1234", {"answer": "digits"})]))[0][0] == 1.0


def test_sglang_missing_package_is_a_clear_error() -> None:
    pytest.importorskip("torch")
    try:
        import sglang  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("sglang is installed here")
    from rollout_server.engines import EngineError, build_engine
    from tether.config import load_config

    with pytest.raises(EngineError, match="needs the 'sglang' package"):
        build_engine(load_config(None, ["--rollout.engine.type", "sglang"]))
