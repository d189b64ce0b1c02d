"""Bearer token, TLS and the Prometheus endpoint of a rollout server (served in-process via ``serve``).

In-process keeps this cheap (no second interpreter start); ``serve`` is the same coroutine the
``python -m rollout_server`` process runs, stopped here through its ``stop`` event instead of SIGTERM.
"""

from __future__ import annotations

import asyncio
import datetime
import urllib.request
from pathlib import Path

import grpc
import pytest

from rollout_server.main import serve
from tether.client import AsyncRolloutClient
from tether.config import load_config
from tether.redis_server import free_port

pytestmark = pytest.mark.slow


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


async def _wait_port(port: int) -> None:
    for _ in range(300):
        try:
            _r, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise TimeoutError(port)


async def test_token_tls_and_metrics(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    cert, key = _self_signed(tmp_path)
    monkeypatch.setenv("TETHER_AUTH_TOKEN", "s3cret")  # the token comes from the environment
    port, metrics_port = free_port(), free_port()
    cfg = load_config(
        None,
        [
            "--model.path",
            str(tiny_model_dir),
            "--rollout.port",
            str(port),
            "--rollout.metrics_port",
            str(metrics_port),
            "--rollout.tls_cert",
            str(cert),
            "--rollout.tls_key",
            str(key),
            "--rollout.max_tokens",
            "8",
        ],
    )
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cfg, port=port, server_id="secure", stop=stop))
    await _wait_port(port)
    address = f"localhost:{port}"
    try:
        async with AsyncRolloutClient(address, token="s3cret", tls_ca=str(cert)) as good:
            out = await good.generate(text="hi", n=2, max_tokens=4)
            assert len(out.samples) == 2
            assert (await good.pause()).policy_version == 0
            await good.resume()
        for token in (None, "wrong"):
            async with AsyncRolloutClient(address, token=token, tls_ca=str(cert)) as bad:
                for call in (bad.generate(text="hi"), bad.pause(), bad.status()):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert "token" in err.value.details()
        async with AsyncRolloutClient(f"127.0.0.1:{port}", token="s3cret", timeout_s=2) as plaintext:
            with pytest.raises(grpc.aio.AioRpcError):  # TLS only: a plaintext client cannot talk to it
                await plaintext.status()
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read()
        )
        text = body.decode()
        for name in (
            "tether_rollout_generated_tokens_total",
            "tether_rollout_request_seconds_bucket",
            "tether_rollout_policy_version",
            "tether_rollout_queue_depth",
            "tether_rollout_running_requests",
            "tether_rollout_tokens_per_s",
            'tether_rollout_engine_forward_passes_total{kind="prefill"}',
            'tether_rollout_engine_rows_total{kind="decode"}',
        ):
            assert name in text
        assert 'tether_rollout_requests_total{code="OK",method="Generate"} 1.0' in text
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0
