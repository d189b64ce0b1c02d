"""Named LoRA adapters on one vLLM engine, applied per request (vLLM's multi-LoRA serving; issue 36 item 2).

A fleet serving several LoRA runs of one base model starts one vLLM engine with ``enable_lora``
(``rollout.engine.max_loras`` / ``max_lora_rank``) and gives each run's requests its adapter as a
``LoRARequest``: vLLM batches rows of different adapters (and of none) in one step, each with its own.

An update of adapter ``name`` is written as a peft folder (``adapter_model.safetensors`` under peft's
names, as the learner sends them, and ``adapter_config.json`` with ``lora_alpha = scale * r``) and added
under a fresh ``lora_int_id``: vLLM caches adapters by id, so a new version is a new adapter. Requests
generate with the version current when they start, to their end (a vLLM request cannot change adapter),
and every token is tagged with that version; the version it replaced is removed from vLLM, and its
folder deleted, once its last request has ended. The prefix cache keys blocks by adapter, so no version
reuses another's KV.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollout_server.engines.base import EngineError
from weight_sync.lora import PREFIX, row_adapter_pairs

_MODULE = re.compile(r"\.([A-Za-z0-9_]+)\.weight$")


@dataclass
class Lora:
    """One version of one named adapter as vLLM holds it."""

    name: str
    version: int
    request: Any  # vllm.lora.request.LoRARequest
    folder: Path
    requests: set[str] = field(default_factory=set)
    retired: bool = False  # a newer version replaced it, or the adapter was removed


class VllmAdapters:
    """The named adapters of one vLLM engine (``llm``, an AsyncLLM started with ``enable_lora``)."""

    def __init__(self, llm: Any, *, max_rank: int) -> None:
        self.llm = llm
        self.max_rank = max_rank
        self.current: dict[str, Lora] = {}
        self._ids = itertools.count(1)
        self._root = Path(tempfile.mkdtemp(prefix="tether-loras-"))

    @property
    def names(self) -> list[str]:
        return list(self.current)

    async def load(self, name: str, named: list[tuple[str, torch.Tensor]], *, scale: float, version: int) -> None:
        """Add adapter ``name`` or replace it with a new version; checked before vLLM sees anything."""
        from vllm.lora.request import LoRARequest

        if not name:
            raise EngineError("a named adapter needs a non-empty name")
        lora_id = next(self._ids)
        folder = self._write(name, named, scale=scale, version=version, lora_id=lora_id)
        request = LoRARequest(lora_name=f"{name}@v{version}#{lora_id}", lora_int_id=lora_id, lora_path=str(folder))
        try:
            if not await self.llm.add_lora(request):
                raise EngineError(f"vLLM did not add adapter {name!r} version {version}")
        except Exception:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        old = self.current.get(name)
        self.current[name] = Lora(name, version, request, folder)
        if old is not None:
            await self._retire(old)

    def _write(
        self, name: str, named: list[tuple[str, torch.Tensor]], *, scale: float, version: int, lora_id: int
    ) -> Path:
        from safetensors.torch import save_file

        try:
            pairs = row_adapter_pairs(name, named)
        except ValueError as e:
            raise EngineError(str(e)) from None
        ranks = {int(p["A"].shape[0]) for p in pairs.values()}
        if len(ranks) != 1:
            raise EngineError(f"adapter {name!r} mixes ranks {sorted(ranks)}; one rank per adapter")
        (rank,) = ranks
        if rank > self.max_rank:
            raise EngineError(
                f"adapter {name!r} has rank {rank}, above this engine's rollout.engine.max_lora_rank {self.max_rank}"
            )
        modules = sorted({m.group(1) for w in pairs if (m := _MODULE.search(w))})
        tensors = {}
        for weight, pair in pairs.items():
            stem = PREFIX + weight.removesuffix(".weight")
            tensors[stem + ".lora_A.weight"] = pair["A"].detach().to("cpu").contiguous()
            tensors[stem + ".lora_B.weight"] = pair["B"].detach().to("cpu").contiguous()
        folder = self._root / f"{lora_id}-v{version}"
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": scale * rank, "target_modules": modules,
                  "bias": "none", "lora_dropout": 0.0, "modules_to_save": None}  # fmt: skip
        (folder / "adapter_config.json").write_text(json.dumps(config))
        return folder

    def begin(self, name: str, request_id: str) -> Lora:
        """The version request ``request_id`` generates with, to its end."""
        lora = self.current.get(name)
        if lora is None:
            raise EngineError(f"no adapter {name!r} is loaded on this engine (loaded: {self.names})")
        lora.requests.add(request_id)
        return lora

    async def end(self, lora: Lora, request_id: str) -> None:
        lora.requests.discard(request_id)
        if lora.retired and not lora.requests:
            await self._drop(lora)

    async def remove(self, name: str) -> None:
        """Free adapter ``name``: its requests are aborted, then vLLM forgets it."""
        lora = self.current.pop(name, None)
        if lora is None:
            raise EngineError(f"no adapter {name!r} is loaded on this engine (loaded: {self.names})")
        if lora.requests:
            await self.llm.abort(list(lora.requests))
        await self._retire(lora)

    async def _retire(self, lora: Lora) -> None:
        lora.retired = True
        if not lora.requests:
            await self._drop(lora)

    async def _drop(self, lora: Lora) -> None:
        try:
            await self.llm.remove_lora(lora.request.lora_int_id)
        finally:
            shutil.rmtree(lora.folder, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)
