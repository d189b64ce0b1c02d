"""Seeded inputs of the reference suite: the awkward batches tether must agree with the references on.

A batch is ``S`` samples padded to ``T`` completion tokens, the layout verl's ``core_algos`` takes, plus each
sample's length ``L_i`` (tokens after ``L_i`` are padding). Its rows mix:

- right-padded completions (mask 1 on the first ``L_i`` tokens), one of them a single token, one full width;
- multi-turn completions whose mask has holes inside ``L_i`` (environment tokens, mask 0), e.g.
  ``[1, 1, 0, 0, 1, 1, 1, 0, ...]``;
- fully-masked samples (``L_i`` tokens, every one mask 0);

and its groups mix groups of one, a group whose rewards are all equal, and ordinary groups. Sample order is
shuffled, so no group's samples sit next to each other.

tether's losses take the packed layout (:func:`pack`): the first ``L_i`` positions of each row, one row
after another, holes included, with :func:`seq_ids` naming each packed token's row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

WIDTH = 16
NORM_LEN = 20.0
"""Dr.GRPO's constant length (``seq-mean-token-sum-norm``): verl's ``loss_scale_factor``, tether's ``norm_len``."""

# One entry per group: its rewards ("equal": one reward for all its samples) and its samples' kinds.
_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("random", ("padded",)),
    ("random", ("holes", "padded", "empty", "holes")),
    ("equal", ("padded", "holes", "full")),
    ("random", ("holes",)),
    ("random", ("padded", "holes", "one", "empty", "padded")),
    ("random", ("holes", "padded")),
    ("random", ("padded", "holes", "holes", "padded")),
)

TOLERANCE = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
}


@dataclass(frozen=True)
class Batch:
    mask: Tensor
    """[S, T] 1.0 on trained tokens."""
    lengths: Tensor
    """[S] long: tokens of each sample (holes included); positions from ``L_i`` on are padding."""
    group_ids: Tensor
    """[S] long, dense ``0..G-1``: the prompt each sample answers."""
    rewards: Tensor
    """[S] each sample's scalar reward (0 for a fully-masked sample: it has no trained token to carry one)."""
    token_rewards: Tensor
    """[S, T] the reward on the sample's last trained token, 0 elsewhere."""
    kinds: tuple[str, ...]

    @property
    def tokens(self) -> float:
        return float(self.mask.sum())

    @property
    def trained_seqs(self) -> float:
        """Samples with at least one trained token (verl's seq-mean denominator)."""
        return float((self.mask.sum(-1) > 0).sum())


def make_batch(seed: int, *, dtype: torch.dtype = torch.float64, width: int = WIDTH) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    kinds: list[str] = []
    groups: list[int] = []
    rewards: list[float] = []
    for g, (reward_kind, members) in enumerate(_GROUPS):
        equal = float(torch.randn((), generator=gen))
        for kind in members:
            kinds.append(kind)
            groups.append(g)
            rewards.append(equal if reward_kind == "equal" else float(torch.randn((), generator=gen)))
    order = torch.randperm(len(kinds), generator=gen).tolist()
    kinds = [kinds[i] for i in order]
    group_ids = torch.tensor([groups[i] for i in order])
    reward = torch.tensor([rewards[i] for i in order], dtype=dtype)

    mask = torch.zeros(len(kinds), width, dtype=dtype)
    lengths = torch.zeros(len(kinds), dtype=torch.long)
    for row, kind in enumerate(kinds):
        n = _length(kind, width, gen)
        lengths[row] = n
        if kind in ("padded", "one", "full"):
            mask[row, :n] = 1
        elif kind == "holes":
            mask[row, :n] = _turns(n, gen)
    reward = torch.where(mask.sum(-1) > 0, reward, torch.zeros_like(reward))
    token_rewards = torch.zeros_like(mask)
    for row in range(len(kinds)):
        trained = torch.nonzero(mask[row]).flatten()
        if trained.numel():
            token_rewards[row, trained[-1]] = reward[row]
    return Batch(mask, lengths, group_ids, reward, token_rewards, tuple(kinds))


def _length(kind: str, width: int, gen: torch.Generator) -> int:
    if kind == "one":
        return 1
    if kind == "full":
        return width
    low = 6 if kind == "holes" else 2
    return int(torch.randint(low, width + 1, (), generator=gen))


def _turns(n: int, gen: torch.Generator) -> Tensor:
    """A multi-turn mask of ``n`` tokens: runs of 1-3 model tokens (1) and environment tokens (0), starting
    with a model turn, with at least one hole between two model tokens."""
    out: list[float] = []
    model = True
    while len(out) < n:
        out += [1.0 if model else 0.0] * int(torch.randint(1, 4, (), generator=gen))
        model = not model
    mask = torch.tensor(out[:n])
    mask[n // 2], mask[n // 2 + 1] = 0.0, 1.0
    return mask


def per_token(batch: Batch, seed: int, *, scale: float = 1.0, shift: float = 0.0) -> Tensor:
    """A seeded ``[S, T]`` tensor of the batch's dtype: ``shift + scale * N(0, 1)``."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch.mask.shape, generator=gen, dtype=torch.float64)
    return (shift + scale * noise).to(batch.mask.dtype)


def pack(x: Tensor, lengths: Tensor) -> Tensor:
    """``[S, T, ...]`` padded rows -> ``[N, ...]`` packed: the first ``L_i`` positions of each row in turn."""
    return torch.cat([x[row, : int(n)] for row, n in enumerate(lengths)])


def seq_ids(lengths: Tensor) -> Tensor:
    """``[N]``: each packed token's row."""
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


def agg_scale(mode: str, dtype: torch.dtype) -> float:
    """Tolerance scale for a loss aggregated by ``mode``: verl's seq-mean-token-mean divides each sequence's
    sum by its token count + 1e-8 (tether: by the count), a relative difference of up to 1e-8 that float64
    sees and float32 does not."""
    return 200.0 if mode == "seq-mean-token-mean" and dtype == torch.float64 else 1.0


RECORDED: list[tuple[str, str, str, float]] = []
"""Every comparison :func:`check` made in this session: ``(what, reference, dtype, max abs diff)``; the suite
prints the largest difference of each at the end (``conftest.pytest_terminal_summary``)."""


def check(
    actual: object, expected: object, *, what: str, reference: str, dtype: torch.dtype, scale: float = 1.0
) -> None:
    """``assert_close`` at the tolerance of ``dtype`` (``scale`` widens it), the max abs diff in the message."""
    actual, expected = _as_float64(actual), _as_float64(expected)
    tol = {k: v * scale for k, v in TOLERANCE[dtype].items()}
    diff = (actual - expected).abs().max().item() if actual.shape == expected.shape and actual.numel() else float("nan")

    def message(default: str) -> str:
        return f"{what}: tether vs {reference}, max abs diff {diff:.3e} ({dtype}, {tol})\n{default}"

    RECORDED.append((what, reference, str(dtype).removeprefix("torch."), diff))

    torch.testing.assert_close(actual, expected, msg=message, **tol)


def _as_float64(x: object) -> Tensor:
    # A Python float is a double: torch.as_tensor would round it to float32 first.
    return x.detach().to(torch.float64) if isinstance(x, Tensor) else torch.tensor(x, dtype=torch.float64)
