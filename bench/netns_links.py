"""Hosts joined by rate-limited links for the weight-service bench: network namespaces on a Linux bridge.

    switch namespace  tws-<pid>-sw:  bridge br0, one veth end per host (v<k>), each with a tbf on its egress
    host namespaces   tws-<pid>-<h>: lo + eth0 (the veth's other end, 198.18.0.<10+k>/15), a tbf on its egress

Each host's port is limited both ways, as a NIC on a switch is: ``tbf`` on the host's ``eth0`` limits
what it sends, ``tbf`` on the switch's end limits what it receives (from all senders together). tbf and
htb work in namespaces here, netem does not, so links have a rate and no added delay. The bridge lives in
a namespace of its own, so everything the lab makes is a namespace: the root namespace gets no interface,
and deleting the namespaces removes every link. 198.18.0.0/15 is the block reserved for benchmarking.

Processes run inside a host with ``ip netns exec`` (:meth:`Links.run`). :meth:`Links.close` always runs
(context manager, and on SIGTERM the ``with`` body is left through ``SystemExit``): it stops the processes
it started, kills whatever else still runs in its namespaces, and deletes them. Namespaces left by a lab
whose process died are swept at the next start. Root only; :func:`can_run` says why not otherwise.

A lab can be handed to a child process (:meth:`Links.describe` / :meth:`Links.attach`): the bench runs its
learner side inside the ``learner`` host and starts the other hosts' processes and changes the link rates
from there (``ip -n`` reaches named namespaces from any namespace).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tether.orphans import die_with_parent

REPO = Path(__file__).resolve().parents[1]
PREFIX = "tws-"
SWITCH = "sw"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")


def can_run() -> str | None:
    """None when links can be built here, else the reason (for a skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            return f"cannot add a network namespace: {made.stderr.strip()}"
        bridge = subprocess.run(
            ["ip", "-n", probe, "link", "add", "br0", "type", "bridge"], capture_output=True, text=True
        )
        if bridge.returncode != 0:
            return f"cannot add a bridge: {bridge.stderr.strip()}"
        shaped = subprocess.run(
            ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "br0", "root", "tbf", "rate", "1gbit",
             "burst", "256kb", "latency", "50ms"], capture_output=True, text=True,
        )  # fmt: skip
        if shaped.returncode != 0:  # some kernels are built without tbf (tests/cluster/switch.py)
            return f"this kernel cannot rate-limit a link with tbf: {shaped.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still running in ``ns`` (only ever a lab's own namespace)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in out.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def sweep_orphans() -> list[str]:
    """Delete the namespaces of labs whose process is gone (and kill what still runs in them)."""
    swept = []
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            swept.append(ns)
    return swept


def _run(*argv: str) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def rate_bits(rate: str) -> int:
    """``1gbit`` / ``10gbit`` / ``100mbit`` in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"link rate {rate!r}: write it as tc does, e.g. 1gbit, 10gbit, 100mbit")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])


class Links:
    """``hosts`` (names) on one switch; ``with Links(["redis", "learner", "s0"]) as lab: lab.ip["s0"]``."""

    def __init__(self, hosts: list[str], *, folder: str | Path, owner: int | None = None) -> None:
        if SWITCH in hosts:
            raise ValueError(f"host name {SWITCH!r} is the switch's")
        self.hosts = list(hosts)
        self.owner = owner or os.getpid()
        self.folder = Path(folder)
        self.ns = {h: f"{PREFIX}{self.owner}-{h}" for h in [*hosts, SWITCH]}
        self.ip = {h: f"198.18.0.{10 + k}" for k, h in enumerate(hosts)}
        self.rate: str | None = None
        self.procs: list[subprocess.Popen] = []
        self._built = False

    # -- building ------------------------------------------------------------------------------------------
    def start(self) -> Links:
        sweep_orphans()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._built = True  # from here on close() has something to undo
        sw = self.ns[SWITCH]
        _run("ip", "netns", "add", sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for k, host in enumerate(self.hosts):
            ns = self.ns[host]
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"v{k}", "netns", sw)
            _run("ip", "-n", sw, "link", "set", f"v{k}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip[host]}/15", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
        return self

    def set_rate(self, rate: str | None) -> None:
        """Every host's port limited to ``rate`` (``1gbit``, ``10gbit``) each way; None: no limit."""
        for k, host in enumerate(self.hosts):
            for ns, dev in ((self.ns[host], "eth0"), (self.ns[SWITCH], f"v{k}")):
                if rate is None:
                    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                                   capture_output=True)  # fmt: skip
                    continue
                # A burst of ~1 ms at the rate (at least 256 KiB: veth hands tbf 64 KiB GSO packets), a queue
                # of 20 ms: TCP fills the link without the drops of a shallow queue.
                burst = max(256 * 1024, rate_bits(rate) // 8 // 1000)
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", str(burst), "latency", "20ms")  # fmt: skip
        self.rate = rate

    # -- processes -----------------------------------------------------------------------------------------
    def run(
        self, host: str, argv: list[str], *, log: str | Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` (its own session; output to ``log``, else inherited)."""
        out = open(log, "ab") if log is not None else None  # noqa: SIM115 (handed to the child)
        try:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns[host], *argv],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        finally:
            if out is not None:
                out.close()
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, *, timeout_s: float = 30.0) -> int | None:
        """SIGTERM ``proc``'s session, SIGKILL after ``timeout_s``; its exit code."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        with contextlib.suppress(ValueError):
            self.procs.remove(proc)
        return proc.returncode

    # -- handing the lab to a child ------------------------------------------------------------------------
    def describe(self) -> str:
        return json.dumps({"hosts": self.hosts, "owner": self.owner, "folder": str(self.folder), "rate": self.rate})

    @classmethod
    def attach(cls, description: str) -> Links:
        """The lab a parent built (this side only starts processes and sets rates; the parent closes it)."""
        d = json.loads(description)
        lab = cls(d["hosts"], folder=d["folder"], owner=d["owner"])
        lab.rate = d["rate"]
        return lab

    # -- teardown ------------------------------------------------------------------------------------------
    def close(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in reversed(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.procs.clear()
        if not self._built:
            return
        for ns in self.ns.values():
            _kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._built = False

    def __enter__(self) -> Links:
        previous = signal.getsignal(signal.SIGTERM)
        if previous in (signal.SIG_DFL, None):  # a SIGTERM leaves the `with` through SystemExit: close() runs
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
