"""The weight store over gRPC (``protos/tether/v1/weights.proto``): serve a :class:`~weight_sync.sources.Provider`,
read one as a :class:`~weight_sync.sources.Source`.

:func:`serve` runs a *synchronous* ``grpc.server`` on its own thread pool, so it sits beside the learner's
synchronous loop or the rollout server's asyncio loop without touching either; the provider's ``chunk`` may
block (a relay fetching upstream, a peer waiting for a chunk it is fetching itself) and only ties up one of
the pool's threads. :class:`RemoteSource` is the reading end: the origin (the learner), a ``tether relay``
or a peer, named ``kind:host:port`` in logs and fetch stats.

Errors map one way in each direction, so a fetch can tell "ask someone else" from "this source is broken":
``VersionMissing`` / a chunk not held ⇄ NOT_FOUND ⇄ ``VersionMissing`` / ``ChunkMissing``; a malformed request
→ INVALID_ARGUMENT; everything else a reader sees (refused, killed mid-stream, past the deadline, a wrong
token) → ``SourceUnavailable`` naming the status, which the :class:`~weight_sync.sources.Fetcher` answers by
skipping the source for the rest of the fetch.

Chunks travel as a stream of pieces of at most 1 MiB (gRPC's 4 MiB message limit never matters). The pieces
are written and read without protobuf message objects (:func:`encode_piece`, :func:`decode_piece`: the same
bytes on the wire as ``ChunkPiece``): a message object copies a piece in and again out, which measured
~440 MB/s against ~550 MB/s for the raw stream on this project's 2-core loopback, the same as gRPC
carrying bare bytes.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tether.grpc_auth import SyncBearerAuth
from tether.logs import get_logger
from tether.v1 import weights_pb2
from weight_sync.manifest import Manifest, ManifestError, WeightVersionError
from weight_sync.sources import Provider, SourceUnavailable
from weight_sync.store import VersionMissing
from weight_sync.versions import ChunkMissing

log = get_logger(__name__)

SERVICE = weights_pb2.DESCRIPTOR.services_by_name["WeightStore"].full_name
PLAN_METHOD = f"/{SERVICE}/GetPlan"
CHUNK_METHOD = f"/{SERVICE}/GetChunk"
PIECE_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 64 << 20
"""Both ends accept messages this big (a plan of a large model is a few MiB of JSON; pieces are 1 MiB)."""
MAX_WAIT_S = 60.0
"""A server never holds a thread longer than this for a chunk it is still fetching, whatever is asked."""
KINDS = ("peer", "relay", "origin")
_HASH = re.compile(r"[0-9a-f]{32}")
_PIECE_TAG = b"\x0a"  # ChunkPiece.data: field 1, wire type 2 (length-delimited)


def _options() -> list[tuple[str, Any]]:
    return [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


# -- the wire format of a piece ------------------------------------------------------------------------------
def encode_piece(piece: memoryview | bytes) -> bytes:
    """A ``ChunkPiece`` on the wire around ``piece``, with one copy of it (see the module docstring)."""
    n, head = len(piece), bytearray(_PIECE_TAG)
    if not n:
        return b""  # as protobuf writes it: an empty field is left out
    while n > 0x7F:
        head.append((n & 0x7F) | 0x80)
        n >>= 7
    head.append(n)
    return b"".join((head, piece))


def decode_piece(raw: bytes) -> memoryview | bytes:
    """The ``data`` of a serialized ``ChunkPiece``, as a view into ``raw`` (no copy) when it holds that field
    alone, as a sender of this module writes it; anything else goes through protobuf."""
    n, shift, i = 0, 0, 1
    if raw[:1] == _PIECE_TAG:
        while i < len(raw) and i <= 10:
            b = raw[i]
            i += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                if i + n == len(raw):
                    return memoryview(raw)[i:]
                break
    return weights_pb2.ChunkPiece.FromString(raw).data


# -- serving -------------------------------------------------------------------------------------------------
class WeightStoreServicer:
    """The ``WeightStore`` service over ``provider`` (register it with :meth:`add_to_server`, not the generated
    ``add_WeightStoreServicer_to_server``: ``GetChunk`` yields raw pieces for :func:`encode_piece`)."""

    def __init__(self, provider: Provider, *, piece_bytes: int = PIECE_BYTES) -> None:
        if not 0 < piece_bytes <= PIECE_BYTES:
            raise ValueError(f"piece_bytes must be in (0, {PIECE_BYTES}], not {piece_bytes}")
        self.provider = provider
        self.piece_bytes = piece_bytes
        self.bytes_out = 0
        """Chunk bytes served in full (what this service sent: the learner's bytes out, for the origin)."""
        self.chunks_out = 0
        self._count = threading.Lock()

    def GetPlan(
        self, request: weights_pb2.GetPlanRequest, context: grpc.ServicerContext
    ) -> weights_pb2.GetPlanResponse:
        held = request.held if request.HasField("held") else None
        if request.version < 0 or (held is not None and held < 0):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"versions are >= 0 (got version={request.version}, "
                          f"held={held})")  # fmt: skip
        try:
            chain = self.provider.plan(request.version if request.HasField("version") else None, held)
        except VersionMissing as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except SourceUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except WeightVersionError as e:  # e.g. a manifest on disk that does not parse
            context.abort(grpc.StatusCode.INTERNAL, str(e))
        return weights_pb2.GetPlanResponse(manifests=[m.to_json() for m in chain])

    def GetChunk(self, request: weights_pb2.GetChunkRequest, context: grpc.ServicerContext) -> Iterator[memoryview]:
        digest = request.hash
        if not _HASH.fullmatch(digest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{digest[:80]!r} is not a chunk hash (32 lowercase hex "
                          "characters, the xxh3_128 of the chunk's stored bytes)")  # fmt: skip
        wait_s = min(request.wait_s, MAX_WAIT_S) if request.wait_s > 0 else 0.0  # NaN and negatives: 0
        remaining = context.time_remaining()
        if remaining is not None:
            wait_s = max(0.0, min(wait_s, remaining))
        try:
            data = self.provider.chunk(digest, wait_s=wait_s)
        except ChunkMissing as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except SourceUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if data is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"chunk {digest} is not held here")
        view = memoryview(data)
        for at in range(0, len(view), self.piece_bytes):
            yield view[at : at + self.piece_bytes]
        with self._count:
            self.bytes_out += len(view)
            self.chunks_out += 1

    def add_to_server(self, server: grpc.Server) -> None:
        handlers = {
            "GetPlan": grpc.unary_unary_rpc_method_handler(
                self.GetPlan,
                request_deserializer=weights_pb2.GetPlanRequest.FromString,
                response_serializer=weights_pb2.GetPlanResponse.SerializeToString,
            ),
            "GetChunk": grpc.unary_stream_rpc_method_handler(
                self.GetChunk,
                request_deserializer=weights_pb2.GetChunkRequest.FromString,
                response_serializer=encode_piece,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)


class ChunkServer:
    """A running :func:`serve`: its :attr:`address`, :meth:`stop`."""

    def __init__(
        self, server: grpc.Server, host: str, port: int, health_servicer: health.HealthServicer,
        servicer: WeightStoreServicer,
    ) -> None:  # fmt: skip
        self._server, self.host, self.port, self._health = server, host, port, health_servicer
        self.servicer = servicer

    def bytes_out(self) -> int:
        """Chunk bytes this service has sent in full."""
        return self.servicer.bytes_out

    @property
    def address(self) -> str:
        """``host:port`` as a client dials it (an IPv6 host in brackets)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    def stop(self, grace: float | None = None) -> None:
        """Refuse new calls, give running ones ``grace`` seconds (None: wait for them), then cancel them."""
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()

    def __enter__(self) -> ChunkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(0)


def serve(
    provider: Provider, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None, threads: int = 8
) -> ChunkServer:
    """Start serving ``provider`` on ``host:port`` (0: a free port) and return at once; ``token``: require it as a
    bearer token (health stays open for probes); ``threads``: calls served at once (each waiting call holds one)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weight-store"),
        interceptors=[SyncBearerAuth(token)] if token else [],
        options=[*_options(), ("grpc.so_reuseport", 0)],
    )
    servicer = WeightStoreServicer(provider)
    servicer.add_to_server(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    except RuntimeError as e:  # grpc raises where older versions returned 0
        raise OSError(f"weight store: cannot listen on {host}:{port} ({e}) — pick another port") from None
    if not bound:
        raise OSError(f"weight store: cannot listen on {host}:{port} — pick another port")
    server.start()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return ChunkServer(server, host, bound, health_servicer, servicer)


# -- reading -------------------------------------------------------------------------------------------------
class RemoteSource:
    """A :class:`~weight_sync.sources.Source` across the network: a ``WeightStore`` service at ``address``.

    ``kind`` (``peer``, ``relay``, ``origin``) only names it (``kind:address``). One channel, opened lazily by
    gRPC and reused by every call; :meth:`close` it when done."""

    def __init__(
        self, address: str, *, kind: str = "peer", token: str | None = None, plan_timeout_s: float = 10.0
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        self.address, self.kind, self.plan_timeout_s = address, kind, plan_timeout_s
        self.name = f"{kind}:{address}"
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._channel = grpc.insecure_channel(address, options=_options())
        self._get_plan = self._channel.unary_unary(
            PLAN_METHOD,
            request_serializer=weights_pb2.GetPlanRequest.SerializeToString,
            response_deserializer=weights_pb2.GetPlanResponse.FromString,
            _registered_method=True,
        )
        self._get_chunk = self._channel.unary_stream(
            CHUNK_METHOD,
            request_serializer=weights_pb2.GetChunkRequest.SerializeToString,
            response_deserializer=decode_piece,
            _registered_method=True,
        )

    def plan(self, version: int | None, held: int | None) -> list[Manifest]:
        request = weights_pb2.GetPlanRequest(version=version, held=held)
        try:
            reply = self._get_plan(request, timeout=self.plan_timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise VersionMissing(f"{self.name}: {e.details()}") from None
            raise self._unavailable("GetPlan", e) from None
        try:
            chain = [Manifest.from_json(m, where=f"{self.name} plan[{k}]") for k, m in enumerate(reply.manifests)]
        except ManifestError as e:
            raise SourceUnavailable(f"{self.name}: sent a plan that does not parse: {e}") from None
        if version is not None and chain and chain[-1].version != version:
            raise SourceUnavailable(f"{self.name}: asked for v{version}, sent a plan ending at v{chain[-1].version}")
        return chain

    def chunk(self, digest: str, *, timeout_s: float) -> bytes:
        # The server may wait for a chunk it is fetching itself, for half the deadline: the other half is left
        # for the transfer, or for asking the next source in time.
        request = weights_pb2.GetChunkRequest(hash=digest, wait_s=timeout_s / 2)
        try:
            return b"".join(self._get_chunk(request, timeout=timeout_s, metadata=self._metadata))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise ChunkMissing(f"{self.name}: {e.details()}") from None
            raise self._unavailable("GetChunk", e) from None

    def _unavailable(self, call: str, e: grpc.RpcError) -> SourceUnavailable:
        code = e.code()
        hint = {
            grpc.StatusCode.UNAUTHENTICATED: " — give this reader the service's bearer token (TETHER_AUTH_TOKEN)",
            grpc.StatusCode.UNAVAILABLE: " (not reachable, or it went away)",
            grpc.StatusCode.DEADLINE_EXCEEDED: " (no answer in time)",
            grpc.StatusCode.INVALID_ARGUMENT: " (the request is malformed: a bug in the caller)",
        }.get(code, "")
        name = code.name if code is not None else "ERROR"
        return SourceUnavailable(f"{self.name}: {call} failed: {name}: {e.details()}{hint}")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RemoteSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
