"""A tiny gRPC health probe for containers: ``python -m tether.healthcheck host:port``.

Exit 0 when the server's standard health service (``grpc.health.v1.Health/Check``) answers SERVING
within the deadline, 1 otherwise, with one line on stderr saying why. Docker healthchecks and other
supervisors that cannot speak gRPC themselves run this; Kubernetes uses its built-in ``grpc:`` probe.

It imports only grpcio and grpcio-health-checking (never torch), so a probe costs a fraction of a
second even inside the heavy GPU image, and a probe against a server busy loading weights fails by its
deadline instead of hanging the container runtime.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

EXIT_SERVING = 0
EXIT_UNHEALTHY = 1


def check(
    address: str,
    *,
    service: str = "",
    timeout_s: float = 3.0,
    tls: bool = False,
    ca_file: str | None = None,
) -> tuple[bool, str]:
    """``(serving, detail)`` of one Health/Check call to ``address`` (``host:port``)."""
    if tls:
        root = Path(ca_file).read_bytes() if ca_file else None
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=root))
    else:
        channel = grpc.insecure_channel(address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        name = code.name if code is not None else "ERROR"
        return False, f"{address}: {name}: {e.details() if hasattr(e, 'details') else e}"
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tether.healthcheck", description="Exit 0 when a gRPC server reports SERVING."
    )
    p.add_argument("address", help="host:port of the gRPC server")
    p.add_argument("--service", default="", help="health service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="deadline of the call in seconds (default 3)")
    p.add_argument("--tls", action="store_true", help="connect with TLS")
    p.add_argument("--ca-file", default=None, help="PEM root certificates for --tls (default: system roots)")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing when serving")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if ":" not in args.address:
        print(f"healthcheck: address {args.address!r}: expected host:port", file=sys.stderr)
        return EXIT_UNHEALTHY
    serving, detail = check(
        args.address, service=args.service, timeout_s=args.timeout, tls=args.tls, ca_file=args.ca_file
    )
    if not serving:
        print(f"healthcheck: not serving: {detail}", file=sys.stderr)
        return EXIT_UNHEALTHY
    if not args.quiet:
        print(f"healthcheck: {detail}")
    return EXIT_SERVING


if __name__ == "__main__":
    sys.exit(main())
