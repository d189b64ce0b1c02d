"""Batched sampling with per-row temperature / top-k / top-p / seed, and the behaviour log-probs.

Kept apart from the engine so it is a pure function of tensors (unit-tested against a closed form).
Every row is sorted once; top-k and top-p are masks over the sorted logits, so rows with different
settings share one kernel launch sequence. Log-probs are **processed**: the log-probability of the
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

    def select(self, keep: torch.Tensor) -> RowParams:
        idx = keep.tolist()
        return RowParams(self.temperature[keep], self.top_p[keep], self.top_k[keep], [self.generators[i] for i in idx])


@torch.no_grad()
def sample(logits: torch.Tensor, params: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [B, V] -> (tokens int64 [B], processed log-probs float32 [B] of those tokens)."""
    logits = logits.float()
    greedy = params.temperature <= 0
    temp = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
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
        picked[idx] = torch.multinomial(probs[idx], 1).squeeze(-1)
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
