"""vLLM worker extension: the receiving end of a weight update inside each vLLM worker process.

vLLM runs the model in worker processes the rollout server cannot reach directly, so the worker itself
joins the weight-sync group and loads what it receives: the engine is created with
``worker_extension_cls="weight_sync.vllm_worker.WeightSyncWorker"``, vLLM mixes this class into its
worker, and the rollout server calls the ``tether_*`` methods with ``AsyncLLM.collective_rpc``. Only
plain values cross that boundary: the plan travels as serialized protobuf bytes, results as dicts of
numbers.

``tether_prepare`` starts the receive in a background thread and returns at once (the learner broadcasts
only after every receiver answered Prepare); ``tether_commit`` waits for it with a timeout and calls
``model_runner.reload_weights`` (vLLM's in-place reload: ``model.load_weights`` plus re-running the
kernels' post-load processing; plain ``model.load_weights`` on older vLLM), which knows the model's own
layout (fused qkv / gate-up projections, tensor parallel shards, tied embeddings) — this is why vLLM
receives full, unsharded HF-named tensors.

With ``model.lora`` (``lora_scale`` > 0) an update holds adapter tensors only: the worker reloads the
whole model from ``model.path``'s safetensors with the adapted weights merged (:mod:`weight_sync.lora`).

Limitation: with ``tensor_parallel_size > 1`` each worker would need its own rank in the group; the plan
carries one rank per server, so collective transports support TP=1 and larger TP uses ``filesystem``.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tether.v1 import control_pb2
from weight_sync.buckets import Layout, checksum, unpack
from weight_sync.collective import CollectiveReceive
from weight_sync.lora import merged_checkpoint, received
from weight_sync.snapshot import read_snapshot


class WeightSyncWorker:
    """Mixed into vLLM's ``Worker``: ``self.model_runner`` and ``self.device`` come from vLLM."""

    def _tether(self) -> dict:
        state = getattr(self, "_tether_state", None)
        if state is None:
            state = {
                "receive": CollectiveReceive(),
                "pool": concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="tether-ws"),
                "pending": {},
            }
            self._tether_state = state
        return state

    def tether_prepare(self, plan_bytes: bytes, transfer_timeout_s: float, go_timeout_s: float) -> bool:
        plan = control_pb2.WeightUpdatePlan.FromString(plan_bytes)
        state = self._tether()
        state["pending"].clear()
        future = None
        if plan.HasField("collective"):
            receive: CollectiveReceive = state["receive"]
            receive.go_timeout_s = go_timeout_s
            nccl = plan.collective.backend == "nccl"
            receive.device = torch.device(getattr(self, "device", "cpu")) if nccl else torch.device("cpu")
            future = state["pool"].submit(receive.receive, plan, timeout_s=transfer_timeout_s)
        state["pending"][plan.update_id] = (plan, future)
        return True

    def tether_commit(self, update_id: str, timeout_s: float, sums: bool, lora_scale: float = 0.0) -> dict:
        pending = self._tether()["pending"].pop(update_id, None)
        if pending is None:
            raise RuntimeError(f"update {update_id!r} was not prepared in this worker")
        plan, future = pending
        if future is None:
            return self._tether_load(read_snapshot(plan.filesystem.path), sums, lora_scale)
        flats = future.result(timeout=timeout_s)
        members = Layout.from_plan(plan).bucket_members()
        named = [pair for flat, group in zip(flats, members, strict=True) for pair in unpack(flat, group)]
        return self._tether_load(named, sums, lora_scale)

    def tether_load_snapshot(self, path: str, sums: bool, lora_scale: float = 0.0) -> dict:
        return self._tether_load(read_snapshot(path), sums, lora_scale)

    def tether_abort(self) -> bool:
        self._tether()["pending"].clear()
        return True

    def tether_checksums(self) -> dict[str, float]:
        """Float64 sums of the live model's parameters under vLLM's own names (tests compare them)."""
        return {name: checksum(p) for name, p in self.model_runner.model.named_parameters()}

    def _tether_base(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The base checkpoint (``model.path``'s safetensors), read lazily for a whole-model reload."""
        folder = Path(self.vllm_config.model_config.model)
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    yield name, f.get_tensor(name)

    def _tether_load(self, named: Iterable[tuple[str, torch.Tensor]], sums: bool, lora_scale: float = 0.0) -> dict:
        if lora_scale:
            adapters = list(named)
            self._tether_load(merged_checkpoint(adapters, self._tether_base, lora_scale), False)
            nbytes, checksums = received(adapters, sums=sums)
            return {"bytes": nbytes, "checksums": checksums}
        totals = {"bytes": 0, "checksums": {}}

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                totals["bytes"] += tensor.numel() * tensor.element_size()
                if sums:
                    totals["checksums"][name] = checksum(tensor)
                yield name, tensor

        runner = self.model_runner
        if hasattr(runner, "reload_weights"):
            # vLLM >= 0.3x: load_weights plus redoing process_weights_after_loading layer by layer; a bare
            # load_weights fails once the CPU / quantized kernels have repacked the original Parameters.
            tied = _tied_groups(runner.model)
            runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
            _retie_and_reprocess(tied)
        else:
            runner.model.load_weights(weights=counted())
        return totals


def _tied_groups(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """Modules sharing one weight tensor (a tied ``lm_head`` and ``embed_tokens``), owner first."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            owners.setdefault(id(weight), []).append(module)
    return [modules for modules in owners.values() if len(modules) > 1]


def _retie_and_reprocess(groups: list[list[torch.nn.Module]]) -> None:
    """Re-tie and redo post-load processing for every module of a tied weight, not just the first.

    vLLM's layerwise reload processes a tied weight through one parent only (its documented limitation)
    and may swap the owner's Parameter; on CPU the tied ``lm_head`` then keeps a prepacked GEMM copy of
    the *old* embedding, so logits come from stale weights while the embedding's sums look right.
    """
    for owner, *others in groups:
        for module in others:
            module.weight = owner.weight
        for module in (owner, *others):
            method = getattr(module, "quant_method", None)
            if hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
