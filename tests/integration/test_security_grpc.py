"""Bearer-token authentication and TLS of the rollout server and the reward service, method by method.

test_rollout_security.py checks the token on Generate, Pause and GetStatus through the client; this
sends raw calls to every Rollout and Control method with no token, a wrong one and wrong schemes
(``Basic``, lower-case ``bearer``, a bare token, a prefix of the token, trailing space), over TLS with a
certificate made here for 127.0.0.1 and localhost. Health stays open (probes cannot send metadata).
A garbage body without a token is UNAUTHENTICATED, not INVALID_ARGUMENT: an unauthenticated caller
learns nothing about parsing. Servers run in-process through the same coroutines the processes run.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_server.main import serve
from tether.config import load_config
from tether.redis_server import free_port
from tether.reward_service import RewardService, start_server
from tether.v1 import control_pb2, reward_pb2, rollout_pb2

pytestmark = pytest.mark.slow

TOKEN = "s3cret-Token_42"
SERVICES = [rollout_pb2.DESCRIPTOR.services_by_name["Rollout"], control_pb2.DESCRIPTOR.services_by_name["Control"]]
METHODS = [(f"/{s.full_name}/{m.name}", m.server_streaming) for s in SERVICES for m in s.methods]
BAD_AUTH = [
    None,
    f"Bearer {TOKEN}x",
    f"Bearer {TOKEN[:-1]}",
    f"Basic {TOKEN}",
    f"bearer {TOKEN}",
    TOKEN,
    f"Bearer  {TOKEN}",
    f"Bearer {TOKEN} ",
    "Bearer ",
    "",
]


def make_cert(tmp: Path, *, name: str = "tether-test") -> tuple[Path, Path]:
    """A self-signed certificate valid for localhost and 127.0.0.1; (cert.pem, key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / f"{name}.pem", tmp / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


async def _wait_serving(channel: grpc.aio.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    for _ in range(600):
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.05)
    raise TimeoutError("rollout server did not become SERVING")


async def _code(channel: grpc.aio.Channel, path: str, streaming: bool, auth: str | None, body: bytes = b"") -> str:
    metadata = None if auth is None else (("authorization", auth),)
    try:
        if streaming:
            async for _ in channel.unary_stream(path)(body, metadata=metadata, timeout=30):
                pass
        else:
            await channel.unary_unary(path)(body, metadata=metadata, timeout=30)
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return "OK"


@pytest.fixture
async def tls_server(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[tuple[str, Path, Path]]:
    """(address, cert, tmp) of a TLS rollout server that requires TOKEN."""
    cert, key = make_cert(tmp_path)
    port = free_port()
    cfg = load_config(
        None,
        [
            *("--model.path", str(tiny_model_dir), "--rollout.port", str(port)),
            *("--rollout.tls_cert", str(cert), "--rollout.tls_key", str(key)),
            *("--rollout.auth_token", TOKEN, "--rollout.max_tokens", "4"),
        ],
    )
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cfg, port=port, server_id="secure", stop=stop))
    address = f"127.0.0.1:{port}"
    async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(cert.read_bytes())) as ch:
        await _wait_serving(ch)
    try:
        yield address, cert, tmp_path
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0


async def test_every_method_requires_the_exact_bearer_token(tls_server) -> None:
    address, cert, _ = tls_server
    async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(cert.read_bytes())) as ch:
        for path, streaming in METHODS:
            for auth in BAD_AUTH:
                code = await _code(ch, path, streaming, auth)
                assert code == "UNAUTHENTICATED", (path, auth, code)
            # Garbage without a token: refused for the token, before anything looks at the body.
            assert await _code(ch, path, streaming, None, b"\xff\xff\xff") == "UNAUTHENTICATED"
        # With the token every method gets past authentication (empty requests are then judged on merit).
        good = {path: await _code(ch, path, streaming, f"Bearer {TOKEN}") for path, streaming in METHODS}
        await _code(ch, "/tether.v1.Control/Resume", False, f"Bearer {TOKEN}")
        assert "UNAUTHENTICATED" not in good.values(), good
        assert good["/tether.v1.Rollout/GetStatus"] == good["/tether.v1.Control/Pause"] == "OK"
        assert good["/tether.v1.Rollout/Generate"] == "INVALID_ARGUMENT"
        # Health stays open without a token, so probes and load balancers work.
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_tls_refuses_plaintext_and_untrusted_certificates(tls_server) -> None:
    address, cert, tmp = tls_server
    auth = (("authorization", f"Bearer {TOKEN}"),)
    status = "/tether.v1.Rollout/GetStatus"
    for name in ("127.0.0.1", "localhost"):  # both names are in the certificate
        target = address.replace("127.0.0.1", name)
        async with grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(cert.read_bytes())) as ch:
            await ch.unary_unary(status)(b"", metadata=auth, timeout=10)
    other, _ = make_cert(tmp, name="someone-else")  # a client that trusts another CA: no handshake
    async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(other.read_bytes())) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ch.unary_unary(status)(b"", metadata=auth, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.insecure_channel(address) as ch:  # plaintext to a TLS port: never reaches a handler
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ch.unary_unary(status)(b"", metadata=auth, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


class _Constant(RewardService):
    def score(self, req: reward_pb2.ScoreRequest) -> float:
        return 0.5


async def test_reward_service_requires_the_token_but_health_is_open() -> None:
    server, _health, port = await start_server(_Constant(), port=0, host="127.0.0.1", token=TOKEN)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            for path in ("/tether.v1.Reward/Score", "/tether.v1.Reward/ScoreBatch"):
                for auth in BAD_AUTH:
                    assert await _code(ch, path, False, auth) == "UNAUTHENTICATED", (path, auth)
                assert await _code(ch, path, False, f"Bearer {TOKEN}") == "OK"
                assert await _code(ch, path, False, f"Bearer {TOKEN}", b"\xff\xff") == "INVALID_ARGUMENT"
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(grace=None)
