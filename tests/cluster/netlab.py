"""Hosts for the cluster tests and bench/cluster.py: network namespaces on 198.18.0.0/15 joined by a switch.

Each host is a network namespace ``tlab-<pid>-<name>`` with loopback and one ``tun0`` interface
carrying its address in 198.18.0.0/16 (the block reserved for network benchmarking, so nothing collides
with a real network); :mod:`tests.cluster.switch` moves packets between the hosts with the delay, loss
and cuts the test sets per link. Processes run inside a host with ``ip netns exec`` — the same commands a
person runs on a real host. Everything is torn down by :meth:`Lab.close` (processes, the switch, the
namespaces), also when a test fails; namespaces left by a lab whose process died are removed at the next
start. Root only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tether.orphans import die_with_parent

REPO = Path(__file__).resolve().parents[2]
PREFIX = "tlab-"


def can_run() -> str | None:
    """None when labs can be built here, else the reason (for a skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not Path("/dev/net/tun").exists():
        return "no /dev/net/tun"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    return None


def _sweep_orphans() -> None:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


class Lab:
    def __init__(self, folder: Path, hosts: dict[str, str]) -> None:
        """``hosts``: name -> IPv4 address in 198.18.0.0/16."""
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.hosts = dict(hosts)
        self.ns = {name: f"{PREFIX}{os.getpid()}-{name}" for name in hosts}
        self.rules_file = self.folder / "links.json"
        self.stats_file = self.folder / "switch-stats.json"
        self.links: dict[str, dict] = {}
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.switch: subprocess.Popen | None = None

    # -- building ------------------------------------------------------------------------------------
    def start(self) -> Lab:
        _sweep_orphans()
        for ns in self.ns.values():
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        self._write_rules()
        cmd = [sys.executable, "-m", "tests.cluster.switch", "--rules", str(self.rules_file),
               "--stats", str(self.stats_file)]  # fmt: skip
        for name, ip in self.hosts.items():
            cmd += ["--host", f"{name}={self.ns[name]}={ip}"]
        log = (self.folder / "switch.log").open("w")
        self.switch = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
        self._wait_for(lambda: "ready" in (self.folder / "switch.log").read_text(), "the switch to start")
        for name, ip in self.hosts.items():
            _ip("-n", self.ns[name], "addr", "add", f"{ip}/16", "dev", "tun0")
            _ip("-n", self.ns[name], "link", "set", "tun0", "up")
        return self

    def _wait_for(self, ready, what: str, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.switch is not None and self.switch.poll() is not None:
                raise RuntimeError(f"switch exited: {(self.folder / 'switch.log').read_text()[-2000:]}")
            if ready():
                return
            time.sleep(0.05)
        raise TimeoutError(f"timed out waiting for {what}")

    # -- processes -----------------------------------------------------------------------------------
    def run(self, host: str, argv: list[str], *, name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``argv`` inside ``host``; output to ``<folder>/<name>.log``."""
        log = (self.folder / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns[host], *argv],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        log.close()
        self.procs.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def log(self, name: str) -> str:
        path = self.folder / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- links ---------------------------------------------------------------------------------------
    def set_link(self, src: str = "*", dst: str = "*", *, both: bool = True, **rule: object) -> None:
        """Delay (``delay_ms``, ``jitter_ms``, one way), ``loss`` (probability) or ``cut`` for src→dst
        (and dst→src unless ``both`` is false); an empty rule restores the default."""
        for a, b in [(src, dst), (dst, src)] if both else [(src, dst)]:
            key = "*" if a == b == "*" else f"{a}>{b}"
            if rule:
                self.links[key] = dict(rule)
            else:
                self.links.pop(key, None)
        self._write_rules()

    def isolate(self, host: str, cut: bool = True) -> None:
        """Cut (or heal) every link of ``host``: a partition."""
        self.set_link(host, "*", **({"cut": True} if cut else {}))

    def _write_rules(self) -> None:
        tmp = self.rules_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.links))
        tmp.replace(self.rules_file)

    def switch_stats(self) -> dict:
        try:
            return json.loads(self.stats_file.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    # -- teardown ------------------------------------------------------------------------------------
    def close(self) -> None:
        for _, proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 1  # the test has its figures: a process still draining is killed
        for _, proc in reversed(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if self.switch is not None:
            self.switch.kill()
            self.switch.wait(timeout=10)
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
