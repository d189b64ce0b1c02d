"""Batched sampling with per-row temperature / top-k / top-p / seed, and the behaviour log-probs.

Kept apart from the engine so it is a pure function of tensors (unit-tested against a closed form).
When a row of the batch truncates (top-k / top-p), every row is sorted once and top-k and top-p are
masks over the sorted logits, so rows with different settings share one kernel launch sequence; when
none does (every training rollout: truncation is refused there), the sort is skipped and sampling is
one ``log_softmax`` and one exponential race over the batch (uniforms, not ``multinomial``'s slower
``exponential_``), plus the gather of the log-prob. Log-probs are **processed**: the log-probability of the
sampled token under the distribution it was actually drawn from — ``log_softmax(logits / T)``
restricted to (and renormalised over) the tokens top-k / top-p keep, as vLLM's ``processed_logprobs``.
The learner recomputes ``log_softmax(logits / T)`` (verl's actor convention), so at temperature T with
top-p/top-k off the importance ratio is 1 for on-policy tokens; training rollouts therefore refuse
top-p/top-k (``rollout.top_p``/``top_k`` validation). Greedy rows (T = 0) have no distribution to
sample from: their log-probs are of the T = 1 distribution, as vLLM reports them, and the learner
uses T = 1 for them (:func:`tether.trajectory.logprob_temperature`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowParams:
    """Sampling parameters of a batch, one entry per row."""

    temperature: torch.Tensor  # float32 [B]; 0 means greedy
    top_p: torch.Tensor  # float32 [B]
    top_k: torch.Tensor  # int64 [B]; <= 0 disables
    generators: list[torch.Generator | None]

    @classmethod
    def build(cls, rows: list[tuple[float, float, int, int | None]], device: torch.device) -> RowParams:
        """``rows``: (temperature, top_p, top_k, seed) per row."""
        gens: list[torch.Generator | None] = []
        for *_, seed in rows:
            if seed is None:
                gens.append(None)
            else:
                g = torch.Generator(device=device)
                g.manual_seed(int(seed))
                gens.append(g)
        return cls(
            temperature=torch.tensor([r[0] for r in rows], dtype=torch.float32, device=device),
            top_p=torch.tensor([r[1] for r in rows], dtype=torch.float32, device=device),
            top_k=torch.tensor([r[2] for r in rows], dtype=torch.int64, device=device),
            generators=gens,
        )

    def __post_init__(self) -> None:
        # Decided once per batch, not per step (no device sync in the decode loop): whether any row restricts
        # its support (top-k / top-p: the sorted path), whether any row is greedy.
        self.truncates = bool(((self.top_k > 0) | (self.top_p < 1)).any())
        self.has_greedy = bool((self.temperature <= 0).any())

    def select(self, keep: torch.Tensor) -> RowParams:
        idx = keep.tolist()
        return RowParams(self.temperature[keep], self.top_p[keep], self.top_k[keep], [self.generators[i] for i in idx])

    def concat(self, other: RowParams) -> RowParams:
        """These rows followed by ``other``'s (a batch that new rows joined)."""
        return RowParams(
            torch.cat([self.temperature, other.temperature]),
            torch.cat([self.top_p, other.top_p]),
            torch.cat([self.top_k, other.top_k]),
            self.generators + other.generators,
        )


@torch.no_grad()
def sample(logits: torch.Tensor, params: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [B, V] -> (tokens int64 [B], processed log-probs float32 [B] of those tokens)."""
    logits = logits.float()
    greedy = params.temperature <= 0
    temp = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    if not params.truncates:
        return _sample_full_support(logits, temp, greedy if params.has_greedy else None, params.generators)
    sorted_logits, order = torch.sort(logits / temp[:, None], dim=-1, descending=True)
    vocab = logits.shape[-1]
    positions = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(params.top_k > 0, params.top_k, torch.full_like(params.top_k, vocab))
    sorted_logits = sorted_logits.masked_fill(positions >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass before it already reaches top_p; the first token always stays.
    before = probs.cumsum(dim=-1) - probs
    dropped = before >= params.top_p[:, None]
    probs = probs.masked_fill(dropped, 0.0)
    # The distribution actually sampled from, renormalised over the kept tokens (sorted order).
    processed = torch.log_softmax(sorted_logits.masked_fill(dropped, float("-inf")), dim=-1)
    picked = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    unseeded = [i for i, g in enumerate(params.generators) if g is None]
    if unseeded:
        idx = torch.tensor(unseeded, device=logits.device)
        picked[idx] = _exponential_race(processed[idx])
    for i, g in enumerate(params.generators):
        if g is not None:
            picked[i] = torch.multinomial(probs[i], 1, generator=g).squeeze(-1)
    picked = torch.where(greedy, torch.zeros_like(picked), picked)  # sorted position 0 is the argmax
    tokens = order.gather(-1, picked[:, None]).squeeze(-1)
    logp = processed.gather(-1, picked[:, None]).squeeze(-1)
    if bool(greedy.any()):
        raw = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        logp = torch.where(greedy, raw, logp)
    return tokens, logp


def _sample_full_support(
    logits: torch.Tensor, temp: torch.Tensor, greedy: torch.Tensor | None, generators: list[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample` for a batch in which no row truncates: no sort, the same distributions."""
    logp = torch.log_softmax(logits / temp[:, None], dim=-1)  # greedy rows: temp 1, their reported log-probs
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        tokens = _exponential_race(logp)
    elif unseeded:
        idx = torch.tensor(unseeded, device=logits.device)
        tokens[idx] = _exponential_race(logp[idx])
    for i, g in enumerate(generators):
        if g is not None:
            tokens[i] = torch.multinomial(logp[i].exp(), 1, generator=g).squeeze(-1)
    if greedy is not None:
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _exponential_race(logp: torch.Tensor) -> torch.Tensor:
    """One draw per row from ``exp(logp)`` [B, V]: argmax of p / E with E ~ Exp(1) picks token i with
    probability p_i (the exponential race; Gumbel-max in another form). Taken in log space,
    ``argmax(log p - log E)``, straight from the log-probs the caller reports anyway (no ``exp``), with
    E = -log U from uniforms: torch's CPU ``exponential_`` (what ``torch.multinomial`` draws for one sample)
    costs about 3x ``rand`` plus the two logs. U is kept off 0 (E finite) so no token is ever excluded."""
    u = torch.rand_like(logp).clamp_(min=torch.finfo(logp.dtype).tiny)
    return (logp - u.log_().neg_().log_()).argmax(dim=-1)
