"""Hugging Face transformers engine: batched decoding with a KV cache, on CPU or GPU.

Static batching with a short gathering window: a request waits up to ``batch_wait_ms`` for others
(up to ``max_num_seqs`` rows, a request's ``n`` samples being ``n`` rows), then the batch is
left-padded, prefilled once and decoded step by step with a ``DynamicCache``. Each step runs in a
worker thread (``asyncio.to_thread``) so the gRPC event loop stays responsive; between steps the loop
checks the pause gate, which is how a weight update with ``inflight: keep`` freezes in-flight samples
and lets them continue on the new weights — every token is tagged with ``policy_version`` read at the
step that produced it. ``model`` is the live ``torch.nn.Module`` weight sync loads into.
Log-probs are of the processed (temperature-scaled) distribution (see ``sampling.py``). A request
with ``n > max_num_seqs`` runs alone in a batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
from tether.logs import get_logger

log = get_logger(__name__)


@dataclass
class _Request:
    rid: str
    prompt_ids: list[int]
    spec: SamplingSpec
    out: asyncio.Queue[Chunk | None] = field(default_factory=asyncio.Queue)
    aborted: bool = False
    open_rows: int = 0


@dataclass
class _Row:
    req: _Request
    index: int
    generated: list[int] = field(default_factory=list)
    done: bool = False


class TransformersEngine(Engine):
    name = "transformers"
    logprob_source = "processed"

    def __init__(self, cfg: TetherConfig) -> None:
        self.cfg = cfg
        self.ecfg = cfg.rollout.engine
        self.model: Any = None
        self.device: Any = None
        self._pending: asyncio.Queue[_Request] = asyncio.Queue()
        self._held: _Request | None = None
        self._requests: dict[str, _Request] = {}
        self._admit = asyncio.Event()  # cleared by pause: no new batch starts
        self._step_gate = asyncio.Event()  # cleared by pause("keep"): the running batch freezes
        self._forward_idle = asyncio.Event()  # set while no forward pass runs
        self._batch_idle = asyncio.Event()  # set while no batch runs
        self._loop_task: asyncio.Task[None] | None = None
        self._running_rows = 0
        self._eos: set[int] = set()
        # The model's own thread: forward passes never wait behind other blocking work (Redis reads,
        # weight receives) in asyncio's small shared default pool, and one model runs one pass at a time.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def start(self) -> None:
        self.model, self.tokenizer, self.device = await asyncio.to_thread(self._load)
        self.max_model_len = self.cfg.model.max_model_len or int(
            getattr(self.model.config, "max_position_embeddings", 2048)
        )
        for e in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            self._eos.update(e if isinstance(e, list) else [] if e is None else [e])
        for ev in (self._admit, self._step_gate, self._forward_idle, self._batch_idle):
            ev.set()
        self._loop_task = asyncio.create_task(self._scheduler(), name="transformers-scheduler")
        log.info("engine_started", engine=self.name, device=str(self.device), dtype=str(self.model.dtype))

    def _load(self) -> tuple[Any, Any, Any]:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        mcfg = self.cfg.model
        if not mcfg.path:
            raise EngineError("model.path is empty: point it at a local Hugging Face model folder")
        want = self.ecfg.device
        device = torch.device(
            "cuda" if want == "auto" and torch.cuda.is_available() else "cpu" if want == "auto" else want
        )
        dtype = mcfg.dtype if mcfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
        tokenizer = AutoTokenizer.from_pretrained(mcfg.path, trust_remote_code=mcfg.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            mcfg.path,
            dtype=getattr(torch, dtype),
            attn_implementation=mcfg.attn_implementation,
            trust_remote_code=mcfg.trust_remote_code,
        )
        return model.to(device).eval(), tokenizer, device

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for req in list(self._requests.values()):
            req.out.put_nowait(None)
        self._requests.clear()
        self.model = None
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- admission -------------------------------------------------------------------------------
    async def stream(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        if self._loop_task is None or self._loop_task.done():
            raise EngineError("transformers engine is not running")
        req = _Request(request_id, list(prompt_ids), spec, open_rows=spec.n)
        self._requests[request_id] = req
        self._pending.put_nowait(req)
        try:
            while (chunk := await req.out.get()) is not None:
                yield chunk
        finally:
            if req.open_rows:
                req.aborted = True  # the consumer went away: stop spending compute on it
            self._requests.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            req.aborted = True

    async def pause(self, inflight: Literal["keep", "drain"] = "keep") -> None:
        self._admit.clear()
        if inflight == "keep":
            self._step_gate.clear()
            await self._forward_idle.wait()
        else:
            await self._batch_idle.wait()

    async def resume(self) -> None:
        self._admit.set()
        self._step_gate.set()

    @property
    def paused(self) -> bool:
        return not self._admit.is_set()

    @property
    def running_requests(self) -> int:
        return len(self._requests) - self.queued_requests

    @property
    def queued_requests(self) -> int:
        return self._pending.qsize() + (self._held is not None)

    # --- the batch loop --------------------------------------------------------------------------
    async def _scheduler(self) -> None:
        limit = self.ecfg.max_num_seqs
        while True:
            await self._admit.wait()
            first = self._held or await self._pending.get()
            self._held = None
            if not self._admit.is_set():  # paused while we waited for a request: keep it for later
                self._held = first
                continue
            batch = [first]
            # From here the batch counts as in flight: a drain-pause waits for it, a keep-pause freezes it
            # at its first forward pass; either way no forward pass starts after pause() returned.
            self._batch_idle.clear()
            try:
                batch = await self._collect(first, limit)
                if batch:
                    await self._run_batch(batch)
            except Exception as e:  # a backend failure fails this batch, never the server
                log.exception("batch_failed", error=str(e))
                for req in batch:
                    for i in range(req.spec.n):
                        req.out.put_nowait(Chunk(i, [], [], [], FINISH_ABORTED))
                    req.out.put_nowait(None)
            finally:
                self._batch_idle.set()

    async def _collect(self, first: _Request, limit: int) -> list[_Request]:
        """``first`` plus what arrives within ``batch_wait_ms``, up to ``limit`` rows; aborted ones dropped."""
        batch, rows = [first], first.spec.n
        deadline = time.monotonic() + self.ecfg.batch_wait_ms / 1000
        while rows < limit:
            try:
                nxt = await asyncio.wait_for(self._pending.get(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                break
            if rows + nxt.spec.n > limit:
                self._held = nxt
                break
            batch.append(nxt)
            rows += nxt.spec.n
        for req in [r for r in batch if r.aborted]:
            req.out.put_nowait(None)  # cancelled while it waited: end its stream without running it
        return [r for r in batch if not r.aborted]

    async def _run_batch(self, batch: list[_Request]) -> None:
        import torch

        from rollout_server.engines.sampling import RowParams

        rows = [_Row(req, i) for req in batch for i in range(req.spec.n)]
        params = RowParams.build(
            [
                (
                    r.req.spec.temperature,
                    r.req.spec.top_p,
                    r.req.spec.top_k,
                    None if r.req.spec.seed is None else (r.req.spec.seed * 65537 + r.index) % 2**63,
                )
                for r in rows
            ],
            self.device,
        )
        width = max(len(r.req.prompt_ids) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor(
            [[pad] * (width - len(r.req.prompt_ids)) + r.req.prompt_ids for r in rows], device=self.device
        )
        mask = torch.tensor(
            [[0] * (width - len(r.req.prompt_ids)) + [1] * len(r.req.prompt_ids) for r in rows], device=self.device
        )
        state: dict[str, Any] = {"cache": None, "ids": ids, "mask": mask, "pos": (mask.cumsum(-1) - 1).clamp(min=0)}
        self._running_rows += len(rows)
        try:
            logits, version = await self._forward(state)
            while True:
                # Sampling reads only these logits, so the token is tagged with the version of the forward
                # pass that produced them, even when a weight update landed since (keep mode).
                tokens, logps = await self._threaded(lambda lg=logits: _sample(lg, params))
                self._emit(rows, tokens, logps, version)
                if all(r.done for r in rows):
                    return
                state["ids"] = torch.tensor(tokens, device=self.device)[:, None]
                state["mask"] = torch.cat([state["mask"], torch.ones_like(state["mask"][:, :1])], dim=-1)
                state["pos"] = state["pos"][:, -1:] + 1
                logits, version = await self._forward(state)
        finally:
            self._running_rows -= len(rows)
            for req in batch:
                req.out.put_nowait(None)

    async def _gate(self) -> None:
        while not self._step_gate.is_set():  # re-check: a pause may land between set() and our wake-up
            await self._step_gate.wait()

    async def _forward(self, state: dict[str, Any]) -> tuple[Any, int]:
        """Logits of the next token, and the policy version of the weights that computed them."""
        await self._gate()
        # A weight load waits for a running forward (pause waits on _forward_idle), so the version read
        # here is the one the whole forward runs with.
        version = self.policy_version
        return await self._threaded(lambda: self._forward_sync(state)), version

    async def _threaded(self, fn: Any) -> Any:
        self._forward_idle.clear()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn)
        finally:
            self._forward_idle.set()

    def _forward_sync(self, state: dict[str, Any]) -> Any:
        import torch
        from transformers import DynamicCache

        with torch.inference_mode():
            if state["cache"] is None:
                state["cache"] = DynamicCache(config=self.model.config)
            out = self.model(
                input_ids=state["ids"],
                attention_mask=state["mask"],
                position_ids=state["pos"],
                past_key_values=state["cache"],
                use_cache=True,
            )
            return out.logits[:, -1, :]

    def _emit(self, rows: list[_Row], tokens: list[int], logps: list[float], version: int) -> None:
        for r, tok, lp in zip(rows, tokens, logps, strict=True):
            if r.done:
                continue
            req, spec = r.req, r.req.spec
            if req.aborted:
                r.done, req.open_rows = True, req.open_rows - 1
                req.out.put_nowait(Chunk(r.index, [], [], [], FINISH_ABORTED))
                continue
            r.generated.append(tok)
            finish = 0
            if tok in self._eos or (spec.stop and self._hit_stop(r.generated, spec.stop)):
                finish = FINISH_STOP
            elif len(r.generated) >= spec.max_tokens or len(req.prompt_ids) + len(r.generated) >= self.max_model_len:
                finish = FINISH_LENGTH
            if finish:
                r.done, req.open_rows = True, req.open_rows - 1
            req.out.put_nowait(Chunk(r.index, [tok], [lp], [version], finish))

    def _hit_stop(self, generated: list[int], stop: tuple[str, ...]) -> bool:
        tail = self.tokenizer.decode(generated[-32:], skip_special_tokens=True)
        return any(s in tail for s in stop)


def _sample(logits: Any, params: Any) -> tuple[list[int], list[float]]:
    from rollout_server.engines.sampling import sample

    tokens, logps = sample(logits, params)
    return tokens.tolist(), logps.tolist()
