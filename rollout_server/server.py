"""Assemble the grpc.aio server: services, health, reflection, bearer auth, TLS, message limits.

Everything a client negotiates with is set here, once: both message-size options (so an oversized
request is refused with RESOURCE_EXHAUSTED instead of silently using gRPC's 4 MiB default), the
auth interceptor (health is always open so load balancers and Kubernetes probes work without the
token), and TLS when a certificate pair is configured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tether.grpc_auth import BearerAuth
from tether.grpc_parse import ParseGuard
from tether.v1 import control_pb2, control_pb2_grpc, rollout_pb2, rollout_pb2_grpc

SERVICE_NAMES = (
    rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name,
    control_pb2.DESCRIPTOR.services_by_name["Control"].full_name,
)


def message_options(max_bytes: int) -> list[tuple[str, Any]]:
    return [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes)]


def build_grpc_server(
    *,
    rollout: rollout_pb2_grpc.RolloutServicer,
    control: control_pb2_grpc.ControlServicer,
    host: str,
    port: int,
    max_message_bytes: int,
    token: str = "",
    tls_cert: str = "",
    tls_key: str = "",
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A started-ready (not yet started) server, the bound port and its health servicer."""
    server = grpc.aio.server(
        # Auth first: an unauthenticated caller learns nothing, not even whether its body parsed.
        interceptors=[*([BearerAuth(token)] if token else []), ParseGuard()],
        options=[*message_options(max_message_bytes), ("grpc.so_reuseport", 0)],
    )
    rollout_pb2_grpc.add_RolloutServicer_to_server(rollout, server)
    control_pb2_grpc.add_ControlServicer_to_server(control, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    address = f"{host}:{port}"
    if tls_cert:
        creds = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    if not bound:
        raise OSError(f"rollout.port: cannot bind {address}")
    return server, bound, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *SERVICE_NAMES):
        await health_servicer.set(name, status)
