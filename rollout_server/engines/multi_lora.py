"""Named LoRA adapters applied per row of one batch, unmerged: several runs share one base model.

The merge path (``weight_sync/lora.py``'s :class:`~weight_sync.lora.AdapterApplier`) writes
``W0 + scale * B @ A`` into the weights, so a model holds one adapter at a time. Here each adapted
``nn.Linear`` keeps ``W0`` and gets a forward hook that adds ``scale_k * (x @ A_kᵀ) @ B_kᵀ`` to row ``b``'s
output, ``k`` the adapter that row generates with (none: no delta). A batch may mix rows of several
adapters and of the base model; a row's output is the merged model's up to rounding.

Per module the adapters that target it are concatenated along the rank: ``A`` ``[R, in]`` and ``B``
``[out, R]`` with ``R`` the sum of their ranks. A forward computes ``h = x @ Aᵀ`` for every adapter at
once, zeroes (and scales) the rank columns that are not the row's own adapter with a ``[batch, R]`` mask,
and adds ``h @ Bᵀ``: two small matmuls per module whatever the mix of rows, no per-row loop and no per-row
gather of adapter weights. The mask depends only on the rows and on which adapters target the module, so
modules with the same targets share one per forward. Rows are the batch dimension of the module's input
(the transformers engine prefills left-padded rows, never packed sequences); the engine sets them around
each forward with :meth:`RowAdapters.rows`, and outside that the hooks add nothing (a plain
``model(...)`` call is the model as loaded). With no adapter loaded no hook is installed at all.

Adapter tensors arrive named as peft saves them; the names map to modules as on the merge path
(:func:`weight_sync.lora.row_adapter_pairs`). A module trained whole (``modules_to_save``) cannot be applied
per row and is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from weight_sync.lora import row_adapter_pairs


@dataclass
class _Adapter:
    version: int
    scale: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A [r, in], B [out, r])


@dataclass
class _Site:
    """One adapted Linear: its adapters' A and B concatenated along the rank, and the hook that adds them."""

    a: torch.Tensor  # [R, in]
    b: torch.Tensor  # [out, R]
    owner: torch.Tensor  # long [R]: the adapter slot of each rank column
    scale: torch.Tensor  # [R]: that adapter's scale
    key: tuple[str, ...]  # the adapters that target this module, in slot order
    handle: Any = field(default=None, repr=False)


class RowAdapters:
    """The named adapters of one model and the row -> adapter assignment of the forward in progress."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._adapters: dict[str, _Adapter] = {}
        self._sites: dict[str, _Site] = {}
        self._idx: torch.Tensor | None = None  # long [batch]: each row's adapter slot, -1 for none
        self._masks: dict[tuple[str, ...], torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    @property
    def names(self) -> list[str]:
        return list(self._adapters)

    def version(self, name: str) -> int:
        return self._adapters[name].version

    @torch.no_grad()
    def load(self, name: str, named: Iterable[tuple[str, torch.Tensor]], *, scale: float, version: int) -> None:
        """Add adapter ``name`` or replace it whole; everything is checked before anything changes."""
        if not name:
            raise ValueError("a named adapter needs a non-empty name")
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for weight, pair in row_adapter_pairs(name, named).items():
            module_name = weight.removesuffix(".weight")
            module = self._linear(module_name, weight)
            a, b = pair["A"], pair["B"]
            w = module.weight
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != w.shape[1] or b.shape[0] != w.shape[0]:
                shapes = f"A {tuple(a.shape)}, B {tuple(b.shape)}"
                raise ValueError(f"LoRA shapes {shapes} do not fit {weight!r} of shape {tuple(w.shape)}")
            if a.shape[0] != b.shape[1]:
                raise ValueError(f"LoRA ranks of A {tuple(a.shape)} and B {tuple(b.shape)} differ for {weight!r}")
            pairs[module_name] = (a.to(w.device, w.dtype).clone(), b.to(w.device, w.dtype).clone())
        self._adapters[name] = _Adapter(version, float(scale), pairs)
        self._rebuild()

    def remove(self, name: str) -> None:
        if name not in self._adapters:
            raise KeyError(f"no adapter {name!r} is loaded (loaded: {self.names})")
        del self._adapters[name]
        self._rebuild()

    @contextlib.contextmanager
    def rows(self, names: list[str]) -> Iterator[None]:
        """Within the block, row ``i`` of every forward's batch generates with adapter ``names[i]`` (``""`` or
        a name not loaded: none)."""
        slots = {n: i for i, n in enumerate(self._adapters)}
        idx = [slots.get(n, -1) for n in names]
        if not self._sites or all(i < 0 for i in idx):
            yield
            return
        device = next(iter(self._sites.values())).a.device
        self._idx, self._masks = torch.tensor(idx, dtype=torch.long, device=device), {}
        try:
            yield
        finally:
            self._idx, self._masks = None, {}

    def _linear(self, module_name: str, weight: str) -> torch.nn.Linear:
        try:
            module = self.model.get_submodule(module_name)
        except AttributeError:
            module = None
        if module is None:
            raise KeyError(f"LoRA update adapts {weight!r}, which this model does not have (model.path differs?)")
        if not isinstance(module, torch.nn.Linear):
            kind = type(module).__name__
            raise ValueError(f"{module_name!r} is a {kind}; named adapters apply to Linear modules only")
        return module

    def _rebuild(self) -> None:
        """Concatenate each module's adapters anew; hook the modules some adapter targets, unhook the rest."""
        slots = {n: i for i, n in enumerate(self._adapters)}
        targets: dict[str, list[str]] = {}
        for name, adapter in self._adapters.items():
            for module_name in adapter.pairs:
                targets.setdefault(module_name, []).append(name)
        for module_name in set(self._sites) - set(targets):
            handle = self._sites.pop(module_name).handle
            if handle is not None:
                handle.remove()
        for module_name, names in targets.items():
            parts = [self._adapters[n].pairs[module_name] for n in names]
            a = torch.cat([p[0] for p in parts])
            ranks = [p[0].shape[0] for p in parts]
            owner = torch.tensor([slots[n] for n, r in zip(names, ranks, strict=True) for _ in range(r)])
            scale = torch.tensor([self._adapters[n].scale for n, r in zip(names, ranks, strict=True) for _ in range(r)])
            b = torch.cat([p[1] for p in parts], dim=1)
            site = _Site(a, b, owner.to(a.device), scale.to(a.device, a.dtype), tuple(names))
            old = self._sites.get(module_name)
            site.handle = old.handle if old is not None else None
            self._sites[module_name] = site
            if site.handle is None:
                site.handle = self.model.get_submodule(module_name).register_forward_hook(self._hook(module_name))

    def _hook(self, module_name: str) -> Any:
        def add_delta(module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
            idx = self._idx
            if idx is None:
                return None
            site = self._sites[module_name]
            x = args[0]
            if x.shape[0] != idx.shape[0]:
                raise RuntimeError(
                    f"{module_name!r} saw a batch of {x.shape[0]} while {idx.shape[0]} rows were set: named adapters"
                    " need the rows on the input's first dimension"
                )
            mask = self._masks.get(site.key)
            if mask is None:
                mask = self._masks[site.key] = (idx[:, None] == site.owner[None, :]).to(site.scale.dtype) * site.scale
            h = F.linear(x.to(site.a.dtype), site.a) * mask.view(mask.shape[0], *([1] * (x.dim() - 2)), -1)
            return out + F.linear(h, site.b).to(out.dtype)

        return add_delta
