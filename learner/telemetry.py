"""What the learner tells the outside world each step: metrics sinks, Prometheus, the Redis status hash,
a live progress line, MFU, NVTX ranges and profiler traces. Everything here is best-effort — a failing
sink warns once and turns itself off; telemetry never stops training.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from tether import spans
from tether.logs import get_logger

log = get_logger(__name__)

# Dense bf16 peak per GPU (FLOP/s) by device name fragment, for the MFU estimate.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_BF16.items() if k in name), None)


def train_flops(n_params: int, tokens: int, *, forward_passes: int = 0) -> float:
    """6·N per trained token (forward + backward) plus 2·N per token of each forward-only pass."""
    return 6.0 * n_params * tokens + 2.0 * n_params * tokens * forward_passes


class StepPerf:
    """A step's timing and throughput keys: tokens/s over the compute time, and MFU where the GPU's peak is
    known (the actor's FLOPs: 6·N per trained token per epoch, 2·N per token of each forward-only pass)."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device, world: int, ppo_epochs: int,
                 forward_passes: int) -> None:  # fmt: skip
        self.n_params = sum(p.numel() for p in model.parameters())
        self.peak = peak_flops(device)
        self.world, self.ppo_epochs, self.forward_passes = world, ppo_epochs, forward_passes

    def metrics(self, row: Mapping[str, float], *, started: float, wait_data: float, weight_sync: float) -> dict:
        """The keys to add to ``row`` (which holds the trainer's ``timing/compute`` and ``learner/tokens``);
        ``started``: the step's ``time.perf_counter()`` at its start."""
        compute = row.get("timing/compute", 0.0)
        tokens = row.get("learner/tokens", 0.0)
        out = {
            "timing/wait_data": wait_data,
            "timing/weight_sync": weight_sync,
            "timing/step": time.perf_counter() - started,
            "perf/tokens_per_s": tokens / compute if compute else 0.0,
        }
        if self.peak and compute:
            # the tokens the model ran: a prompt its samples share (learner.share_prompts) counts once
            computed = int(row.get("learner/tokens_computed", tokens))
            flops = train_flops(self.n_params, computed * self.ppo_epochs, forward_passes=self.forward_passes)
            out["perf/mfu"] = flops / (compute * self.peak * self.world)
        return out


@contextlib.contextmanager
def nvtx(name: str, **args: object) -> Iterator[None]:
    """A phase of the step: a span of the run's timeline (:mod:`tether.spans`, with ``args``) and, when CUDA
    is in use, an NVTX range of the same name (visible in Nsight)."""
    with spans.span(name, **args):
        if torch.cuda.is_available():
            label = " ".join([name, *(f"{k}={v}" for k, v in args.items())])
            torch.cuda.nvtx.range_push(label)
            try:
                yield
            finally:
                torch.cuda.nvtx.range_pop()
        else:
            yield


class StepProfiler:
    """A torch profiler trace of each chosen step, one file per rank in ``{run}/profile``."""

    def __init__(self, steps: list[int], out_dir: Path, rank: int) -> None:
        self.steps, self.out_dir, self.rank = set(steps), out_dir, rank

    @contextlib.contextmanager
    def __call__(self, step: int) -> Iterator[None]:
        if step not in self.steps:
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts, record_shapes=True, with_stack=False) as prof:
            yield
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"step{step}-rank{self.rank}.json"
        prof.export_chrome_trace(str(path))
        log.info("profile_written", path=str(path))


class LiveStatus:
    """Rank 0: Prometheus gauges, the ``tether:{run}:learner`` hash and a progress bar.

    The hash is for people and ``tether status`` (which samples it every second or two), so it is written
    at most every ``hash_interval_s`` and once more at :meth:`close`: one Redis round trip per step on the
    learner's critical path was ~2 ms of a ~70 ms demo step (issue 23), for updates nobody could read.
    """

    def __init__(self, *, client=None, key: str = "", port: int | None = None, total_steps: int, start_step: int,
                 hash_interval_s: float = 1.0):  # fmt: skip
        self.client, self.key, self.hash_interval_s = client, key, hash_interval_s
        self._fields: dict[str, str] | None = None  # the newest status not yet written to the hash
        self._written = -math.inf  # time.monotonic() of the last write
        self.gauges: dict[str, object] = {}
        self.registry = None
        if port is not None:
            try:
                from prometheus_client import CollectorRegistry, start_http_server

                self.registry = CollectorRegistry()
                server = start_http_server(port, registry=self.registry)
                log.info("prometheus_serving", port=server[0].server_port if isinstance(server, tuple) else port)
            except Exception as e:
                log.warning("prometheus_unavailable", port=port, error=repr(e))
                self.registry = None
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="learner", dynamic_ncols=True, leave=True)
        except Exception:
            self.bar = None
        self._last = time.monotonic()

    def update(self, step: int, version: int, metrics: Mapping[str, float]) -> None:
        self._prometheus(metrics, step, version)
        if self.client is not None:
            fields = {
                "step": step,
                "version": version,
                "reward_mean": metrics.get("reward/mean", 0.0),
                "tokens_per_s": metrics.get("perf/tokens_per_s", 0.0),
                "loss": metrics.get("loss/total", 0.0),
                "updated_at": time.time(),
            }
            self._fields = {k: str(v) for k, v in fields.items()}
            if time.monotonic() - self._written >= self.hash_interval_s:
                self._write_hash()
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(
                v=version,
                reward=f"{metrics.get('reward/mean', 0.0):.3f}",
                loss=f"{metrics.get('loss/total', 0.0):.4f}",
                tok_s=f"{metrics.get('perf/tokens_per_s', 0.0):.0f}",
                refresh=False,
            )

    def _prometheus(self, metrics: Mapping[str, float], step: int, version: int) -> None:
        if self.registry is None:
            return
        from prometheus_client import Gauge

        values = {**metrics, "learner/step": step, "learner/version": version}
        for key, value in values.items():
            name = "tether_" + "".join(c if c.isalnum() else "_" for c in key)
            gauge = self.gauges.get(name)
            if gauge is None:
                gauge = self.gauges[name] = Gauge(name, key, registry=self.registry)
            gauge.set(float(value))  # type: ignore[attr-defined]

    def _write_hash(self) -> None:
        if self.client is None or self._fields is None:
            return
        try:
            self.client.hset(self.key, mapping=self._fields)
        except Exception as e:
            log.warning("status_hash_disabled", error=repr(e))
            self.client = None
        self._fields, self._written = None, time.monotonic()

    def close(self) -> None:
        self._write_hash()  # the last step's status, whenever it came
        if self.bar is not None:
            self.bar.close()
