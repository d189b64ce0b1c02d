"""Hugging Face transformers engine: continuous batching over one KV cache, on CPU or GPU.

A request joins the running batch at the next step instead of waiting for the batch to end: the
scheduler prefills newcomers (up to ``max_num_seqs`` rows in all, a request's ``n`` samples being
``n`` rows) in one left-padded forward pass of their own, appends their rows to the running batch's
``DynamicCache``, and every row leaves the batch the step it finishes (``kv_batch.py`` holds the
per-row cache handling). When nothing runs, a request waits up to ``batch_wait_ms`` for others so a
burst starts as one batch; while rows run, newcomers join once they fill the batch or the first of them
has waited ``batch_wait_ms``, so arrivals a few ms apart share one prefill. A request with
``n > max_num_seqs`` runs alone.

Each step — forward pass, sampling and the copy of tokens and log-probs to Python — is one call into
the engine's own thread, so the gRPC event loop stays responsive; between steps the loop checks the
pause gate, which is how a weight update with ``inflight: keep`` freezes in-flight samples and lets them
continue on the new weights — every token is tagged with ``policy_version`` read at the step that
produced it. ``model`` is the live ``torch.nn.Module``; :meth:`TransformersEngine.load_weights` loads an
update into it on the engine's own thread, so a load never overlaps a forward pass, by adopting the
received buffers as the parameters' storage (no copy; ``weight_sync/adopt.py``). Log-probs are of the
processed (temperature-scaled) distribution (see ``sampling.py``). A request's new tokens are
coalesced per sample until its consumer takes them, so a consumer wakes at most once per step.

Named LoRA adapters (``load_adapter(..., name=...)``, ``SamplingSpec.adapter``) are applied per row,
unmerged (``multi_lora.py``): rows of several adapters and of the base model share one batch, each step
sets which row generates with which, and a row's tokens carry its adapter's version.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rollout_server.engines import decode_attention
from rollout_server.engines.base import (
    FINISH_ABORTED,
    FINISH_LENGTH,
    FINISH_STOP,
    Chunk,
    Engine,
    EngineError,
    EngineRejected,
    SamplingSpec,
)
from rollout_server.engines.kv_batch import RunningBatch, new_cache
from rollout_server.engines.multi_lora import RowAdapters
from rollout_server.engines.sampling import RowParams, sample
from tether.config import TetherConfig
from tether.logs import get_logger

if TYPE_CHECKING:
    from weight_sync.loading import Delivery, LoadResult, Named

log = get_logger(__name__)


@dataclass
class _Request:
    rid: str
    prompt_ids: list[int]
    spec: SamplingSpec
    # New tokens are coalesced per sample until the consumer takes them: one wake-up per engine step
    # (or fewer) for the consumer, however many rows the request has.
    chunks: dict[int, Chunk] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    finished: set[int] = field(default_factory=set)
    closed: bool = False
    aborted: bool = False
    wake_each_step: bool = True  # False: the consumer wants whole samples (generate), woken once at the end
    arrived: float = field(default_factory=time.monotonic)

    @property
    def open_rows(self) -> int:
        return self.spec.n - len(self.finished)

    def put(self, index: int, token: int | None, logprob: float, version: int, finish: int = 0) -> None:
        chunk = self.chunks.get(index)
        if chunk is None:
            chunk = self.chunks[index] = Chunk(index, [], [], [])
        if token is not None:
            chunk.token_ids.append(token)
            chunk.logprobs.append(logprob)
            chunk.versions.append(version)
        if finish:
            chunk.finish_reason = finish
            self.finished.add(index)
        if self.wake_each_step:
            self.ready.set()

    def close(self, finish: int = 0) -> None:
        """End the stream; with ``finish``, the samples still open end with that reason first."""
        if finish:
            for i in range(self.spec.n):
                if i not in self.finished:
                    self.put(i, None, 0.0, 0, finish)
        self.closed = True
        self.ready.set()


@dataclass
class _Row:
    req: _Request
    index: int
    generated: list[int] = field(default_factory=list)


class _NewcomersFailed(RuntimeError):
    """The newcomers' own forward pass failed (a prompt the model cannot take): they end aborted, and the
    rows already running, on a fleet's shared base maybe another run's, go on."""


class TransformersEngine(Engine):
    name = "transformers"
    logprob_source = "processed"

    def __init__(self, cfg: TetherConfig, *, named_adapters: bool = False) -> None:
        """``named_adapters`` changes nothing here: every batch row may carry its own adapter."""
        self.cfg = cfg
        self.ecfg = cfg.rollout.engine
        self.model: Any = None
        self.device: Any = None
        self._adapters: Any = None  # weight_sync.lora.AdapterApplier, made by the first LoRA update
        self._named: RowAdapters | None = None  # named adapters applied per row, made by the first one loaded
        self._waiting: collections.deque[_Request] = collections.deque()  # arrival order; the first may wait for room
        self._arrived = asyncio.Event()
        self._requests: dict[str, _Request] = {}
        self._rows: list[_Row] = []  # the running batch's rows, in cache order
        self._batch: RunningBatch | None = None
        self._admit = asyncio.Event()  # cleared by pause: no new request joins
        self._step_gate = asyncio.Event()  # cleared by pause("keep"): the running batch freezes
        self._forward_idle = asyncio.Event()  # set while no forward pass runs
        self._batch_idle = asyncio.Event()  # set while no row runs or is being admitted
        self._interrupt = threading.Event()  # set by pause/shutdown: the decode burst returns after this step
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._eos: set[int] = set()
        self._counts: collections.Counter[str] = collections.Counter()  # see Engine.step_counts; engine thread
        # The model's own thread: forward passes never wait behind other blocking work (Redis reads,
        # weight receives) in asyncio's small shared default pool, and one model runs one pass at a time.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.model, self.tokenizer, self.device = await asyncio.to_thread(self._load)
        self.max_model_len = self.cfg.model.context_length(self.model.config)
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
        if device.type == "cuda":
            # cuDNN's sdpa builds a plan per shape, and every decode step has a new KV length: on an H200 a
            # step of the 128x2 tiny model took 33-78 ms with it, 2 ms without (flash / efficient kernels).
            torch.backends.cuda.enable_cudnn_sdp(False)
        tokenizer = AutoTokenizer.from_pretrained(mcfg.path, trust_remote_code=mcfg.trust_remote_code)
        # On the CPU: sdpa minus its per-step copy of the KV cache for grouped-query attention
        # (decode_attention.py). On CUDA transformers' own sdpa, the one measured there (decode_attention.py).
        regroup = mcfg.attn_implementation == "sdpa" and device.type == "cpu"
        attn = decode_attention.register() if regroup else mcfg.attn_implementation
        model = AutoModelForCausalLM.from_pretrained(
            mcfg.path,
            dtype=getattr(torch, dtype),
            attn_implementation=attn,
            trust_remote_code=mcfg.trust_remote_code,
        )
        return model.to(device).eval(), tokenizer, device

    async def shutdown(self) -> None:
        self._interrupt.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for req in list(self._requests.values()):
            req.close(FINISH_ABORTED)
        self._requests.clear()
        self.model = None
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- admission -------------------------------------------------------------------------------
    def stream(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        return self._chunks(prompt_ids, spec, request_id=request_id, wake_each_step=True)

    def _stream_whole(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        return self._chunks(prompt_ids, spec, request_id=request_id, wake_each_step=False)

    async def _chunks(
        self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str, wake_each_step: bool
    ) -> AsyncIterator[Chunk]:
        if self._loop_task is None or self._loop_task.done():
            raise EngineError("transformers engine is not running")
        if spec.adapter and (self._named is None or spec.adapter not in self._named):
            known = self._named.names if self._named is not None else []
            raise EngineRejected(f"adapter {spec.adapter!r} is not loaded on this engine (loaded: {known})")
        req = _Request(request_id, list(prompt_ids), spec, wake_each_step=wake_each_step)
        self._requests[request_id] = req
        self._waiting.append(req)
        self._arrived.set()
        try:
            while True:
                await req.ready.wait()
                req.ready.clear()
                chunks, req.chunks = req.chunks, {}
                for chunk in chunks.values():
                    yield chunk
                if req.closed and not req.chunks:
                    return
        finally:
            if req.open_rows:
                req.aborted = True  # the consumer went away: its rows leave the batch at the next step
            self._requests.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            req.aborted = True

    async def pause(self, inflight: Literal["keep", "drain"] = "keep") -> None:
        self._admit.clear()
        if inflight == "keep":
            self._step_gate.clear()
            self._interrupt.set()
            await self._forward_idle.wait()
        else:
            await self._batch_idle.wait()

    async def resume(self) -> None:
        self._admit.set()
        self._step_gate.set()

    @property
    def paused(self) -> bool:
        return not self._admit.is_set()

    async def wait_resumed(self) -> None:
        await self._admit.wait()

    @property
    def running_requests(self) -> int:
        return len(self._requests) - self.queued_requests

    @property
    def queued_requests(self) -> int:
        return len(self._waiting)

    def step_counts(self) -> dict[str, int]:
        return {k: self._counts[k] for k in ("prefill", "prefill_rows", "decode", "decode_rows")}

    @property
    def _running_rows(self) -> int:
        return len(self._rows)

    # --- weights ----------------------------------------------------------------------------------
    async def load_weights(self, named: Named, *, version: int, adoptable: bool = False) -> LoadResult:
        """In place, on the engine's thread: received buffers are adopted (the parameters become views into
        them; every name and shape is checked before the first one changes), snapshot tensors copied as they
        stream in (a failure after the first copy is a ``PartialUpdate``, which the receiver repairs)."""
        from weight_sync.adopt import load_into_module

        return await self._threaded(lambda: load_into_module(self.model, named, adoptable=adoptable))

    async def load_adapter(self, named: Named, *, version: int, scale: float, name: str = "") -> LoadResult:
        """``W0 + scale * B @ A`` into each adapted weight; ``W0`` is copied the first time a weight is adapted.

        With ``name``: adapter ``name`` is added (or replaced whole) and applied, unmerged, to the rows whose
        request names it (``SamplingSpec.adapter``); the weights stay as they are. On the engine's thread, so
        between forward passes, and at the next step without a pause (a running decode burst is interrupted):
        rows of ``name`` already running go on with the new tensors, and their tokens carry ``version`` from
        then on; no forward ever mixes two versions of one adapter, and the other rows run on undisturbed."""
        from weight_sync.loading import LoadResult
        from weight_sync.lora import AdapterApplier

        if name:
            if self._named is None:
                self._named = RowAdapters(self.model)
            adapters = self._named
            self._interrupt.set()  # a decode burst returns after this step, so the load lands at the next one
            await self._threaded(lambda: adapters.load(name, named, scale=scale, version=version))
            return LoadResult()
        if self._adapters is None:
            self._adapters = AdapterApplier(scale)
        await self._threaded(lambda: self._adapters.load(self.model, named))
        return LoadResult()

    async def remove_adapter(self, name: str) -> None:
        """Free named adapter ``name``; its requests end ABORTED (their rows leave at the next step), and a new
        request naming it is refused."""
        if self._named is None or name not in self._named:
            known = self._named.names if self._named is not None else []
            raise EngineError(f"no adapter {name!r} is loaded on this engine (loaded: {known})")
        for req in self._requests.values():
            if req.spec.adapter == name:
                req.aborted = True
        adapters = self._named
        self._interrupt.set()
        await self._threaded(lambda: adapters.remove(name))

    @property
    def adapters(self) -> list[str]:
        """The named adapters loaded now."""
        return self._named.names if self._named is not None else []

    def weight_delivery(self, cfg: TetherConfig) -> Delivery:
        """Received in this process; NCCL receives straight onto the model's device."""
        from weight_sync.inbox import LocalDelivery

        return LocalDelivery(self, cfg, device=lambda: self.device)

    # --- the step loop ---------------------------------------------------------------------------
    async def _scheduler(self) -> None:
        while True:
            joining: list[_Request] = []
            try:
                joining = await self._next_requests()
                if joining:
                    await self._prefill(joining)
                    joining = []
                if self._rows:
                    await self._decode()
            except _NewcomersFailed as e:  # their own forward failed: the running batch never saw them
                log.exception("prefill_failed", error=str(e.__cause__), requests=len(joining))
                for req in joining:
                    req.close(FINISH_ABORTED)
            except Exception as e:  # a backend failure fails the rows it touched, never the server
                log.exception("batch_failed", error=str(e))
                for req in {id(r): r for r in [*(row.req for row in self._rows), *joining]}.values():
                    req.close(FINISH_ABORTED)
                self._rows, self._batch = [], None
            finally:
                if not self._rows:
                    self._batch = None
                    self._batch_idle.set()

    async def _next_requests(self) -> list[_Request]:
        """What joins the batch now: with rows running, whatever waits and fits, without waiting; with
        none, the next request plus what arrives within ``batch_wait_ms``, up to ``max_num_seqs`` rows."""
        limit = self.ecfg.max_num_seqs
        if self._rows:
            if not self._admit.is_set() or (self._batch is not None and not self._batch.joinable):
                return []
            return self._take(limit - len(self._rows))
        await self._admit.wait()
        while not self._waiting:
            self._arrived.clear()
            await self._arrived.wait()
        if not self._admit.is_set():  # paused while we waited for a request: it stays first in line
            return []
        # From here the request counts as in flight: a drain-pause waits for it, a keep-pause freezes it
        # at its first forward pass; either way no forward pass starts after pause() returned.
        self._batch_idle.clear()
        return await self._take_waiting(max(limit, self._waiting[0].spec.n))

    async def _take_waiting(self, room: int) -> list[_Request]:
        deadline = time.monotonic() + self.ecfg.batch_wait_ms / 1000
        taken = self._take(room)
        room -= sum(r.spec.n for r in taken)
        while room > 0 and not self._waiting and (left := deadline - time.monotonic()) > 0:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                break
            more = self._take(room)
            taken += more
            room -= sum(r.spec.n for r in more)
        return taken

    def _take(self, room: int) -> list[_Request]:
        """Requests in arrival order while they fit in ``room`` rows; aborted ones end here, unrun."""
        taken: list[_Request] = []
        while self._waiting:
            req = self._waiting[0]
            if req.aborted:
                self._waiting.popleft().close(FINISH_ABORTED)
                continue
            if req.spec.n > room:
                break  # first in line keeps its place until there is room
            taken.append(self._waiting.popleft())
            room -= req.spec.n
        return taken

    async def _prefill(self, requests: list[_Request]) -> None:
        rows = [_Row(req, i) for req in requests for i in range(req.spec.n)]
        await self._gate()
        version = self.policy_version  # see _decode: fixed while the forward runs
        await self._threaded(lambda: self._prefill_sync(rows, version))

    def _prefill_sync(self, rows: list[_Row], version: int) -> None:
        """The newcomers' forward pass, their first tokens, and their join into the running batch (engine
        thread). Building the inputs and joining the cache (a copy of the whole KV cache) happen here, not on
        the event loop, which meanwhile keeps answering RPCs; the loop does not touch the batch meanwhile."""
        import torch

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
        # A request's n samples share its prompt: it is prefilled once and its cache rows copied n times.
        requests = list({id(r.req): r for r in rows if r.index == 0}.values())
        which = {id(r.req): k for k, r in enumerate(requests)}
        width = max(len(r.req.prompt_ids) for r in requests)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor(
            [[pad] * (width - len(r.req.prompt_ids)) + r.req.prompt_ids for r in requests], device=self.device
        )
        mask = torch.tensor(
            [[0] * (width - len(r.req.prompt_ids)) + [1] * len(r.req.prompt_ids) for r in requests],
            device=self.device,
        )
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        state: dict[str, Any] = {"cache": None, "ids": ids, "mask": mask, "pos": pos, "rows": requests}
        expand = torch.tensor([which[id(r.req)] for r in rows], dtype=torch.long, device=self.device)
        try:
            tokens, logps = self._step_sync(state, params, expand=expand)
        except Exception as e:  # before anything of theirs joined the running batch: it goes on without them
            raise _NewcomersFailed from e
        mask, pos = mask.index_select(0, expand), pos.index_select(0, expand)
        self._counts.update(prefill=1, prefill_rows=len(rows))
        batch = RunningBatch(cache=state["cache"], mask=mask, pos=pos[:, -1] + 1, params=params)
        batch.last = state["next"]
        alive, out = self._advance(rows, tokens, logps, version)
        batch.keep(alive)
        # Rows before tokens: whoever sees a request end sees its rows gone (as in _decode_burst).
        if alive and self._batch is not None and self._rows:
            self._batch.join(batch)
            self._rows = self._rows + [rows[i] for i in alive]
        elif alive:
            self._batch, self._rows = batch, [rows[i] for i in alive]
        self._post(out)

    async def _decode(self) -> None:
        """Decode steps, back to back in the engine's thread, until the loop is needed: every row is done,
        a pause asks for the thread, or a waiting request fits in the batch. Tokens reach their requests
        through the event loop when someone waits for them (a stream, after every step; ``generate``, once
        its request ends); the thread never waits for that."""
        await self._gate()
        # Clear before the burst, with no await in between: a pause from here on interrupts it.
        self._interrupt.clear()
        await self._threaded(self._decode_burst)

    def _decode_burst(self) -> None:
        import torch

        batch = self._batch
        assert batch is not None and batch.last is not None
        limit = self.ecfg.max_num_seqs
        outbox: list = []  # tokens not yet handed to the loop (nobody is waiting for them yet)
        try:
            while True:
                # A weight load happens only while the engine is paused, after this burst returned (pause
                # waits on _forward_idle), so the version read here is the one this step's forward runs with.
                version = self.policy_version
                mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=-1)
                state = {"cache": batch.cache, "ids": batch.last[:, None], "mask": mask, "pos": batch.pos[:, None],
                         "rows": self._rows}  # fmt: skip
                tokens, logps = self._step_sync(state, batch.params)
                self._counts.update(decode=1, decode_rows=len(tokens))
                batch.mask, batch.pos, batch.last = mask, batch.pos + 1, state["next"]
                alive, out = self._advance(self._rows, tokens, logps, version)
                batch.keep(alive)
                self._rows = [self._rows[i] for i in alive]
                outbox += out
                # Wake the loop only when someone waits for these tokens: a request ended, or one streams
                # them. Posted after the rows are updated: whoever sees a request end sees its rows gone.
                if len(alive) < len(out) or any(item[0].wake_each_step for item in out):
                    self._post(outbox)
                    outbox = []
                if not self._rows or self._interrupt.is_set():
                    return
                if self._admit.is_set() and self._should_admit(limit):
                    return
        finally:
            self._post(outbox)  # also on a failure: what was generated reaches its requests before they end

    def _should_admit(self, limit: int) -> bool:
        """Whether the burst should return so waiting requests join (engine thread; the loop appends to
        ``_waiting`` during a burst, never pops). The first in line must fit, and either the waiting ones
        fill the batch or it has waited ``batch_wait_ms``: requests that arrive a few ms apart (the
        clients of one finished batch, over the network) join in one prefill and one copy of the cache
        instead of one each, as they would on the loop that finished them."""
        waiting = self._waiting[0] if self._waiting else None
        if waiting is None or len(self._rows) + waiting.spec.n > limit:
            return False
        if len(self._rows) + len(self._waiting) >= limit:  # each waiting request has at least one row
            return True
        return time.monotonic() - waiting.arrived >= self.ecfg.batch_wait_ms / 1000

    async def _gate(self) -> None:
        while not self._step_gate.is_set():  # re-check: a pause may land between set() and our wake-up
            await self._step_gate.wait()

    async def _threaded(self, fn: Any) -> Any:
        """``fn()`` in the engine's thread; a keep-pause waits until it returns."""
        self._forward_idle.clear()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn)
        finally:
            self._forward_idle.set()

    def _step_sync(
        self, state: dict[str, Any], params: RowParams, *, expand: Any = None
    ) -> tuple[list[int], list[float]]:
        """One forward pass and the sampling of its logits: (tokens, log-probs); the engine's thread.

        ``expand`` (a prefill of shared prompts): for each sampled row, the forward's row it continues; the
        logits and the new cache rows are copied to match."""
        import torch

        with torch.inference_mode():
            logits = self._forward_sync(state)
            if expand is not None and expand.shape[0] != logits.shape[0]:  # else one row per prompt already
                logits = logits.index_select(0, expand)
                state["cache"].batch_select_indices(expand)  # repeats copy a row
            tokens, logps = sample(logits, params)
            state["next"] = tokens  # the next step's input, without a trip through Python
            return tokens.tolist(), logps.tolist()

    def _forward_sync(self, state: dict[str, Any]) -> Any:
        import torch

        with torch.inference_mode():
            if state["cache"] is None:
                # every row ends by max_model_len tokens (_advance): within a window that long, full layers
                state["cache"] = new_cache(self.model.config, longest=self.max_model_len)
            named = self._named
            active = named is not None and named.names
            with named.rows(self._row_adapters(state["rows"])) if active else contextlib.nullcontext():
                out = self.model(
                    input_ids=state["ids"],
                    attention_mask=state["mask"],
                    position_ids=state["pos"],
                    past_key_values=state["cache"],
                    use_cache=True,
                    logits_to_keep=1,
                )
            return out.logits[:, -1, :]

    def _row_adapters(self, rows: list[_Row]) -> list[str]:
        """Each row's named adapter for this step (engine thread). A row whose adapter was removed since it
        was admitted is aborted: it runs this step with none and leaves the batch without its token."""
        assert self._named is not None
        names = []
        for r in rows:
            name = r.req.spec.adapter
            if name and name not in self._named:
                r.req.aborted = True
                name = ""
            names.append(name)
        return names

    def _advance(self, rows: list[_Row], tokens: list[int], logps: list[float], version: int) -> tuple[list[int], list]:
        """Record each row's new token and whether it finished (engine thread): the indices of the rows that
        go on, and what :func:`_deliver` hands to the requests."""
        alive, out = [], []
        named = self._named
        for k, (r, tok, lp) in enumerate(zip(rows, tokens, logps, strict=True)):
            req, spec = r.req, r.req.spec
            if req.aborted:
                out.append((req, r.index, None, 0.0, version, FINISH_ABORTED))
                continue
            # A named adapter's rows carry its version (read on this thread, where adapters load).
            row_version = named.version(spec.adapter) if spec.adapter and named is not None else version
            r.generated.append(tok)
            finish = 0
            if tok in self._eos or (spec.stop and self._hit_stop(r.generated, spec.stop)):
                finish = FINISH_STOP
            elif len(r.generated) >= spec.max_tokens or len(req.prompt_ids) + len(r.generated) >= self.max_model_len:
                finish = FINISH_LENGTH
            out.append((req, r.index, tok, lp, row_version, finish))
            if not finish:
                alive.append(k)
        return alive, out

    def _post(self, out: list) -> None:
        assert self._loop is not None
        if out:
            self._loop.call_soon_threadsafe(_deliver, out)

    def _hit_stop(self, generated: list[int], stop: tuple[str, ...]) -> bool:
        tail = self.tokenizer.decode(generated[-32:], skip_special_tokens=True)
        return any(s in tail for s in stop)


def _deliver(tokens: list[tuple[_Request, int, int | None, float, int, int]]) -> None:
    """On the event loop: one step's tokens into their requests; a request with no open row ends."""
    for req, index, token, logprob, version, finish in tokens:
        req.put(index, token, logprob, version, finish)
        if finish and not req.open_rows:
            req.close()
