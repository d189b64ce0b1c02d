"""A tether process that holds live gRPC channels can start children with ``preexec_fn`` (tether up's supervisor,
benches, tests) without the child aborting between fork and exec (grpc/grpc#43055: with gRPC's fork support on,
3–7 % of such children died of SIGABRT here, "epoll_wait error: Bad file descriptor" — the bench's rollout server
that "exited -6"). Importing :mod:`tether` turns fork support off; this starts 300 children under RPC load."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import subprocess, sys, threading
    import tether  # the rule under test
    import grpc
    from concurrent import futures
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    done = threading.Event()

    def load():
        while not done.is_set():
            stub.Check(health_pb2.HealthCheckRequest())

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    codes = [subprocess.Popen(["/bin/true"], preexec_fn=lambda: None).wait() for _ in range(int(sys.argv[1]))]
    done.set()
    for t in threads:
        t.join()
    server.stop(None)
    print("aborted", sum(c != 0 for c in codes))
    """
)


def test_children_forked_under_grpc_load_all_reach_exec() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", SCRIPT, "300"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "aborted 0"
