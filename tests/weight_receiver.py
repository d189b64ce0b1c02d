"""A bare weight receiver for tests and benchmarks: a Control gRPC server around a transformers model,
without the rollout server. Not shipped with tether (it was ``weight_sync/standalone.py``): only tests and
``bench/`` import it (the bench scripts put the repository root on ``sys.path``).

Weight sync is tested and benchmarked against real processes on real ports, and its receiving side must
not depend on the rollout server being finished (or on its generation code) to be measured. This is the
smallest real host for ``WeightReceiver``: a model with the one loading method an engine has
(``load_weights``, by adoption as the transformers engine does; ``load_adapter`` for LoRA), a version,
pause/resume that only record state, and the five Control RPCs. It is not a rollout server — it serves
no generation.

    python -m tests.weight_receiver --config FILE --model DIR --port 0 --port-file PATH [overrides]

(``tests`` importable: the repository root on ``PYTHONPATH``, as :class:`ReceiverProcess` sets it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path

import grpc

from tether.config import TetherConfig
from tether.v1 import control_pb2, control_pb2_grpc
from weight_sync.loading import inflight_policy

REPO = Path(__file__).resolve().parents[1]


class ModelEngine:
    """The smallest :class:`~weight_sync.loading.WeightLoader`: a live module it loads into itself. It has no
    engine ``name``: weight sync reads nothing of a loader beyond that protocol (``tests/unit/test_layering.py``)."""

    def __init__(self, model) -> None:
        self.model = model
        self.policy_version = 0
        self.paused: str | None = None
        self.pauses = 0
        self._adapters = None

    async def pause(self, inflight: str) -> None:
        self.paused = inflight
        self.pauses += 1

    async def resume(self) -> None:
        self.paused = None

    async def load_weights(self, named, *, version: int, adoptable: bool = False):  # type: ignore[no-untyped-def]
        """As the transformers engine does: adopt received buckets, copy a snapshot's tensors."""
        from weight_sync.adopt import load_into_module

        return await asyncio.to_thread(load_into_module, self.model, named, adoptable=adoptable)

    async def load_adapter(self, named, *, version: int, scale: float):  # type: ignore[no-untyped-def]
        from weight_sync.loading import LoadResult
        from weight_sync.lora import AdapterApplier

        if self._adapters is None:
            self._adapters = AdapterApplier(scale)
        await asyncio.to_thread(self._adapters.load, self.model, named)
        return LoadResult()

    def weight_delivery(self, cfg: TetherConfig):  # type: ignore[no-untyped-def]
        """Received here; NCCL receives onto the device the model is on at each update."""
        from weight_sync.inbox import LocalDelivery

        return LocalDelivery(self, cfg, device=self._device)

    def _device(self):  # type: ignore[no-untyped-def]
        first = next(self.model.parameters(), None)
        return first.device if first is not None else None

    @classmethod
    def from_path(cls, path: str | Path) -> ModelEngine:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        return cls(model.eval())


class ControlServicer(control_pb2_grpc.ControlServicer):
    """Delegates the weight-update RPCs to a ``WeightReceiver``; errors become gRPC statuses."""

    def __init__(self, receiver, loader) -> None:
        self.receiver, self.loader = receiver, loader

    async def Pause(self, request, context):
        await self.loader.pause(inflight_policy(request.inflight, self.receiver.wcfg.inflight))
        return control_pb2.PauseResponse(policy_version=self.loader.policy_version)

    async def Resume(self, request, context):
        await self.loader.resume()
        return control_pb2.ResumeResponse(policy_version=self.loader.policy_version)

    async def PrepareWeightUpdate(self, request, context):
        try:
            return await self.receiver.prepare(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def CommitWeightUpdate(self, request, context):
        try:
            return await self.receiver.commit(request)
        except Exception as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    async def AbortWeightUpdate(self, request, context):
        return await self.receiver.abort(request)


async def serve(cfg: TetherConfig, model_dir: str, *, port: int = 0, port_file: str | None = None) -> None:
    from weight_sync.receiver import WeightReceiver

    model = ModelEngine.from_path(model_dir)
    receiver = WeightReceiver(model, cfg, delivery=model.weight_delivery(cfg))
    await receiver.catch_up()
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
    )
    control_pb2_grpc.add_ControlServicer_to_server(ControlServicer(receiver, model), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    if port_file:  # written last and atomically: a reader that sees it can connect
        tmp = Path(f"{port_file}.tmp")
        tmp.write_text(f"{bound} {model.policy_version}\n")
        tmp.rename(port_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)


class ReceiverProcess:
    """A standalone receiver in a subprocess (tests and bench): ``address``, ``version`` at start, ``kill()``."""

    def __init__(self, *, config: str | Path, model: str | Path, workdir: str | Path, timeout_s: float = 60.0) -> None:
        import os
        import subprocess
        import sys
        import time
        import uuid

        self.port_file = Path(workdir) / f"receiver-{uuid.uuid4().hex[:8]}.port"
        self.log_file = self.port_file.with_suffix(".log")
        cmd = [
            sys.executable,
            "-m",
            "tests.weight_receiver",
            "--config",
            str(config),
            "--model",
            str(model),
            "--port-file",
            str(self.port_file),
        ]
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": path}
        with open(self.log_file, "wb") as log_out:
            self.proc = subprocess.Popen(cmd, stdout=log_out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"standalone receiver did not start: {self.log_file.read_text()[-2000:]}")
            time.sleep(0.05)
        port, version = self.port_file.read_text().split()
        self.address = f"127.0.0.1:{port}"
        self.start_version = int(version)

    def kill(self) -> None:
        import signal as _signal

        if self.proc.poll() is None:
            self.proc.send_signal(_signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:
                self.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="tether YAML config (weight_sync and run sections)")
    parser.add_argument("--model", required=True, help="model folder to start from (version 0)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", default=None, help="write 'PORT VERSION' here once serving")
    args, overrides = parser.parse_known_args(argv)
    from tether.config.loader import load_config

    cfg = load_config(args.config, overrides)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(cfg, args.model, port=args.port, port_file=args.port_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
