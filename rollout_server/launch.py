"""Start a rollout server as a child process and wait until it serves (tests, the bench, scripts).

A real process, never an in-process fake: what is tested is what ``python -m rollout_server`` runs.
Readiness is the standard gRPC health check reporting SERVING (the server opens its port only after
the engine has loaded). Output goes to a log file whose tail is shown if the server dies on start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class ServerProcess:
    def __init__(self, proc: subprocess.Popen[bytes], address: str, log_path: Path) -> None:
        self.proc = proc
        self.address = address
        self.log_path = log_path

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"rollout server exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"rollout server at {self.address} not serving after {timeout_s}s:\n{self.log_tail()}")

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (graceful drain), then SIGKILL if it does not exit in time; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def spawn_server(
    overrides: list[str],
    *,
    port: int,
    log_path: str | Path,
    config: str | Path | None = None,
    env: dict[str, str] | None = None,
    wait_s: float = 120.0,
    host: str = "127.0.0.1",
) -> ServerProcess:
    """``python -m rollout_server [--config FILE] --rollout.port PORT OVERRIDES...``, started and serving."""
    cmd = [sys.executable, "-m", "rollout_server"]
    if config is not None:
        cmd += ["--config", str(config)]
    cmd += ["--rollout.port", str(port), "--rollout.host", host, *overrides]
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = ServerProcess(proc, f"{host}:{port}", log_path)
    try:
        server.wait_serving(wait_s)
    except BaseException:
        server.terminate(timeout_s=5)
        raise
    return server
