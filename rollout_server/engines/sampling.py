"""Batched sampling with per-row temperature / top-k / top-p / seed, and the behaviour log-probs.

Kept apart from the engine so it is a pure function of tensors (unit-tested against a closed form).
Every row is sorted once; top-k and top-p are masks over the sorted logits, so rows with different
settings share one kernel launch sequence. Log-probs are **raw**: ``log_softmax`` of the unmodified
model logits, whatever the temperature or top-p — the same quantity the learner recomputes, so the
importance ratio is exactly 1 for on-policy tokens at temperature 1 (the RL default).
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
    """``logits`` [B, V] -> (tokens int64 [B], raw log-probs float32 [B] of those tokens)."""
    logits = logits.float()
    raw_logp = torch.log_softmax(logits, dim=-1)
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
    probs = probs.masked_fill(before >= params.top_p[:, None], 0.0)
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
    return tokens, raw_logp.gather(-1, tokens[:, None]).squeeze(-1)
