"""LoRA weight updates on a rollout server: adapter tensors in, ``W0 + alpha/rank * B @ A`` into the engine.

With ``model.lora`` the learner sends only the adapters, named as peft saves them
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``): per update ``r * (d_in + d_out)``
numbers per adapted matrix instead of ``d_in * d_out``. The rollout server keeps the base weights
(``W0``, what ``model.path`` holds) and sets each adapted weight to ``W0 + scale * B @ A`` — the merge
peft's ``merge_and_unload`` does, computed in float32 and cast to the engine's dtype. A module trained
whole (``model.lora.modules_to_save``) travels under peft's saved name without the adapter suffix
(``base_model.model.model.norm.weight``) and replaces the weight of that name. Which updates are
adapters follows from the configuration (``model.lora`` is one setting, read by the learner and every
server); the names are checked, and a full update under a LoRA configuration is refused.

These are helpers for the engines' ``load_adapter`` (``rollout_server/engines/``); weight sync only
decides that an update is one of adapters. The transformers engine copies its own ``W0`` of each adapted
weight the first time it is updated (:class:`AdapterApplier`). vLLM workers (and SGLang) instead reload
every weight of the model from ``model.path`` with the adapted ones merged (:func:`merged_checkpoint`):
vLLM's reload fuses q/k/v and gate/up itself, and a whole checkpoint is the input it is built for. Only
adapter bytes cross the network either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


def target_name(name: str) -> tuple[str, str]:
    """``base_model.model.X.lora_A.weight`` -> (``X.weight``, ``"A"``), a saved module's
    ``base_model.model.X.weight`` -> (``X.weight``, ``"whole"``); a clear error for anything else."""
    for suffix, part in ((_A, "A"), (_B, "B")):
        if name.startswith(PREFIX) and name.endswith(suffix):
            return name[len(PREFIX) : -len(suffix)] + ".weight", part
    if name.startswith(PREFIX) and not any(f".{p}" in name for p in ("lora_", "base_layer.", "original_module.")):
        return name[len(PREFIX) :], "whole"
    raise ValueError(
        f"weight update names {name!r}, which is not a LoRA adapter tensor (base_model.model.<module>.lora_A/B.weight)"
        " — model.lora is set here, so the learner must run with the same model.lora"
    )


def adapter_pairs(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """Group an update by the weight it sets: ``{weight name: {"A": A, "B": B}}`` for an adapted weight
    (both present), ``{weight name: {"whole": tensor}}`` for a saved module's."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        weight, part = target_name(name)
        pairs.setdefault(weight, {})[part] = tensor
    incomplete = [w for w, p in pairs.items() if "whole" not in p and len(p) != 2]
    if incomplete:
        raise ValueError(f"LoRA update has lora_A without lora_B (or the reverse) for {incomplete[:3]}")
    return pairs


def row_adapter_pairs(adapter: str, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """:func:`adapter_pairs` of named adapter ``adapter``, applied per request (unmerged): lora_A/lora_B pairs
    only, at least one; a module trained whole (``modules_to_save``) cannot be applied to some rows alone."""
    pairs = adapter_pairs(named)
    for weight, pair in pairs.items():
        if "whole" in pair:
            raise ValueError(
                f"adapter {adapter!r} carries {weight!r} trained whole (modules_to_save), which cannot be applied"
                " per request; only lora_A/lora_B pairs can"
            )
    if not pairs:
        raise ValueError(f"adapter {adapter!r} has no lora_A/lora_B tensors")
    return pairs


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``base + scale * b @ a`` in float32, returned in ``base``'s dtype. base ``[out, in]``, a ``[r, in]``,
    b ``[out, r]``."""
    if a.shape[1] != base.shape[1] or b.shape[0] != base.shape[0] or a.shape[0] != b.shape[1]:
        raise ValueError(f"LoRA shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a {tuple(base.shape)} weight")
    return (base.float() + scale * (b.float() @ a.float())).to(base.dtype)


def updated(base: torch.Tensor, pair: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """The new value of one weight: the saved module's tensor, or ``base`` with the adapter merged."""
    whole = pair.get("whole")
    if whole is None:
        return merge(base, pair["A"].to(base.device), pair["B"].to(base.device), scale)
    if whole.shape != base.shape:
        raise ValueError(f"saved module tensor of shape {tuple(whole.shape)} does not fit a {tuple(base.shape)} weight")
    return whole.to(device=base.device, dtype=base.dtype)


class AdapterApplier:
    """Sets an in-process module's adapted weights to ``W0 + scale * B @ A``, keeping each ``W0``."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self._base: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def load(self, model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(model.named_parameters(remove_duplicate=False))
        for weight, pair in adapter_pairs(named).items():
            target = params.get(weight)
            if target is None:
                raise KeyError(f"LoRA update adapts {weight!r}, which this model does not have (model.path differs?)")
            if "whole" in pair:
                target.copy_(updated(target, pair, self.scale))
                continue
            base = self._base.get(weight)
            if base is None:
                base = self._base[weight] = target.detach().clone()
            target.copy_(updated(base, pair, self.scale))


def merged_checkpoint(
    named: Iterable[tuple[str, torch.Tensor]], base: Callable[[], Iterable[tuple[str, torch.Tensor]]], scale: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the base checkpoint, the adapted ones merged and the saved modules' replaced: what
    a whole-model reload takes."""
    pairs = adapter_pairs(named)
    seen = set()
    for name, tensor in base():
        pair = pairs.get(name)
        if pair is not None:
            seen.add(name)
            tensor = updated(tensor, pair, scale)
        yield name, tensor
    missing = sorted(set(pairs) - seen)
    if missing:
        raise KeyError(f"LoRA update adapts {missing[:3]}, which the base checkpoint (model.path) does not hold")
