"""``tether relay`` as a real process (issue 33): it serves a fleet from memory, stops cleanly on SIGTERM, and
a relay killed (SIGKILL) in the middle of a fetch costs the reader nothing but a fallback to the origin.

The origin is the learner's chunk service over a store written by VersionWriter, in this process; the relay runs
``python -m tether relay`` against it, both requiring the same bearer token.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import wait_gone
from tests.unit.test_chunk_service import publish, same_bits
from tether.healthcheck import check
from tether.redis_server import free_port
from weight_sync.chunk_service import ChunkServer, RemoteSource, serve
from weight_sync.sources import DirSource, Fetcher
from weight_sync.store import VersionStore

TOKEN = "relay-s3cret"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> VersionStore:
    return publish(tmp_path_factory.mktemp("store"), versions=3, chunk_bytes=16 * 1024)


@pytest.fixture(scope="module")
def origin(store: VersionStore) -> Iterator[ChunkServer]:
    with serve(DirSource(store.root), token=TOKEN) as server:
        yield server


class RelayProcess:
    def __init__(self, upstream: str) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        env = {**os.environ, "TETHER_AUTH_TOKEN": TOKEN}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tether", "relay", "--listen", self.address, "--upstream", upstream,
             "--cache-mb", "64", "--stats-every-s", "0.5"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 120  # the relay imports torch (weight_sync.versions) on a busy machine
        while not check(self.address, timeout_s=1.0)[0]:
            if self.proc.poll() is not None:
                raise AssertionError(f"tether relay exited {self.proc.returncode}: {self.proc.stdout.read().decode()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"tether relay did not serve within 120 s: {self.proc.stdout.read().decode()}")
            time.sleep(0.1)

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            raise AssertionError(f"tether relay ignored SIGTERM: {out.decode()}") from None
        return self.proc.returncode, out.decode()


@pytest.fixture
def relay(origin: ChunkServer) -> Iterator[RelayProcess]:
    process = RelayProcess(origin.address)
    yield process
    if process.proc.poll() is None:
        process.proc.kill()
        process.proc.wait()


def test_the_relay_serves_the_fleet_from_memory_and_stops_cleanly(store: VersionStore, relay: RelayProcess) -> None:
    with RemoteSource(relay.address, kind="relay", token=TOKEN) as source:
        first, stats = Fetcher([source]).fetch(3)
        second, _ = Fetcher([source]).fetch(3, held=store.fetch(2))
    assert same_bits(first, store.fetch(3)) and same_bits(second, first)
    assert stats.bytes_by_source == {source.name: first.fetched_bytes}
    with RemoteSource(relay.address, kind="relay") as anonymous, pytest.raises(Exception, match="token"):
        anonymous.plan(None, None)
    rc, out = relay.stop()
    assert rc == 0, out
    assert "relay_serving" in out and "relay_stopped" in out
    stopped = next(line for line in out.splitlines() if "relay_stopped" in line)
    counts = dict(re.findall(r"(\w+)=(\S+)", stopped))
    assert int(counts["upstream_bytes"]) == first.fetched_bytes  # the origin sent each chunk once
    assert int(counts["served_bytes"]) == first.fetched_bytes + second.fetched_bytes
    assert int(counts["hits"]) == len(store.plan(3, 2)[0].chunks)  # the second reader's delta came from memory
    assert counts["corrupt"] == "0"


def test_a_relay_killed_mid_fetch_costs_a_fallback_to_the_origin(
    store: VersionStore, origin: ChunkServer, relay: RelayProcess
) -> None:
    base = store.plan(3)[0]
    assert base.is_base and len(base.chunks) > 3  # a multi-chunk base, so the kill comes in the middle of it
    pid = relay.proc.pid
    fetched: list[str] = []

    def kill_after_the_first(digest: str, data: bytes) -> None:
        fetched.append(digest)
        if len(fetched) == 1:
            os.kill(pid, signal.SIGKILL)
            assert wait_gone(pid)

    with (
        RemoteSource(relay.address, kind="relay", token=TOKEN) as via_relay,
        RemoteSource(origin.address, kind="origin", token=TOKEN) as via_origin,
    ):
        got, stats = Fetcher([via_relay, via_origin], on_chunk=kill_after_the_first).fetch(3)
    assert same_bits(got, store.fetch(3))
    assert list(stats.failed_sources) == [via_relay.name] and "UNAVAILABLE" in stats.failed_sources[via_relay.name]
    # The relay served the first chunk, and whatever was already on the wire when it died (one CI run got
    # two chunks from it); the origin served the rest, and no byte was counted twice.
    from_relay = stats.bytes_by_source[via_relay.name]
    assert base.chunks[0].size <= from_relay < got.fetched_bytes
    assert from_relay + stats.bytes_by_source[via_origin.name] == got.fetched_bytes
    assert stats.corrupt == 0
    relay.proc.wait()
    assert relay.proc.returncode == -signal.SIGKILL


def test_bad_arguments_fail_before_anything_starts(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tether", "relay", "--listen", "nowhere", "--upstream", "a:1"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "--listen 'nowhere': expected HOST:PORT" in out.stderr
