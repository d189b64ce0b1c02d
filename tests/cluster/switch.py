"""A userspace IP switch between network namespaces, with per-link delay, jitter, loss and cuts.

The test hosts (``tests/cluster/netlab.py``) are network namespaces. The natural way to give their links
delay and loss is ``tc qdisc ... netem``, but the kernels this project runs on (CI's included) are built
without the netem and tbf queueing disciplines ("Specified qdisc kind is unknown"). So each host gets a
TUN device (``tun0``, its only interface besides loopback) and this process moves every IPv4 packet
between them: it reads a packet from the sender's TUN, looks up the rule for the (sender, receiver) link,
drops it (a cut link, or with the link's loss probability) or delivers it to the receiver's TUN after
the link's delay plus uniform jitter — in order per link, as a real link keeps order. Every protocol the
hosts speak (Redis, gRPC, gloo, torchrun's rendezvous) rides on it unchanged.

Rules live in a JSON file the lab rewrites (``{"learner0>rollout0": {"delay_ms": 25, "jitter_ms": 5,
"loss": 0.01, "cut": false}, "*": {...}}``; the most specific of ``a>b``, ``a>*``, ``*>b``, ``*`` wins),
re-read whenever it changes. Counters go to a JSON stats file once a second.

    python -m tests.cluster.switch --host redis=tlab-1-redis=198.18.0.2 ... --rules R.json --stats S.json

Root only (it enters namespaces to open their TUN devices). It exits when its parent dies.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import heapq
import itertools
import json
import os
import random
import selectors
import signal
import socket
import struct
import sys
import time
from pathlib import Path

_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_PR_SET_PDEATHSIG = 1


def open_tun_in(netns: str, name: str = "tun0") -> int:
    """A TUN device named ``name`` inside the network namespace ``netns``; its file descriptor here.

    A child process enters the namespace (``setns`` changes the calling process), opens the device there
    and passes the descriptor back over a socket pair: the device stays in that namespace, the descriptor
    works from anywhere.
    """
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    pid = os.fork()
    if pid == 0:  # child: never returns
        code = 1
        try:
            parent.close()
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            with open(f"/var/run/netns/{netns}", "rb") as ns:
                if libc.setns(ns.fileno(), _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({netns})")
            fd = os.open("/dev/net/tun", os.O_RDWR)
            fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI))
            socket.send_fds(child, [b"tun"], [fd])
            code = 0
        finally:
            os._exit(code)
    child.close()
    try:
        _, fds, _, _ = socket.recv_fds(parent, 16, 1)
    finally:
        parent.close()
        os.waitpid(pid, 0)
    if not fds:
        raise RuntimeError(f"could not open a TUN device in namespace {netns}")
    os.set_blocking(fds[0], False)
    return fds[0]


class Rules:
    def __init__(self, path: Path) -> None:
        self.path, self._mtime, self.links = path, -1.0, {}

    def refresh(self) -> None:
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            self.links, self._mtime = {}, -1.0
            return
        if mtime != self._mtime:
            self._mtime = mtime
            # Half-written: the lab replaces the file atomically, so the next look sees it whole.
            with contextlib.suppress(json.JSONDecodeError):
                self.links = json.loads(self.path.read_text() or "{}")

    def rule(self, src: str, dst: str) -> dict:
        for key in (f"{src}>{dst}", f"{src}>*", f"*>{dst}", "*"):
            if key in self.links:
                return self.links[key]
        return {}


def serve(hosts: dict[str, tuple[str, str]], rules_path: Path, stats_path: Path | None) -> None:
    """``hosts``: name -> (namespace, IPv4 address)."""
    fds = {name: open_tun_in(ns) for name, (ns, _) in hosts.items()}
    by_ip = {socket.inet_aton(ip): name for name, (_, ip) in hosts.items()}
    rules = Rules(rules_path)
    sel = selectors.DefaultSelector()
    for name, fd in fds.items():
        sel.register(fd, selectors.EVENT_READ, name)
    queue: list[tuple[float, int, str, bytes]] = []
    last_due: dict[tuple[str, str], float] = {}
    seq = itertools.count()
    stats = {"forwarded": 0, "dropped_loss": 0, "dropped_cut": 0, "dropped_other": 0}
    next_refresh = next_stats = 0.0
    print("switch: ready", flush=True)
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, dst, packet = heapq.heappop(queue)
            _write(fds[dst], packet, stats)
        if now >= next_refresh:
            rules.refresh()
            next_refresh = now + 0.05
        if stats_path is not None and now >= next_stats:
            tmp = stats_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(stats))
            tmp.replace(stats_path)
            next_stats = now + 1.0
        timeout = max(0.0, min(queue[0][0] - now if queue else 0.05, 0.05))
        for key, _ in sel.select(timeout):
            src = key.data
            for _ in range(64):  # drain a burst without going back to select for every packet
                try:
                    packet = os.read(key.fd, 65535)
                except BlockingIOError:
                    break
                if len(packet) < 20 or packet[0] >> 4 != 4:
                    stats["dropped_other"] += 1  # IPv6 router solicitations and the like
                    continue
                dst = by_ip.get(packet[16:20])
                if dst is None:
                    stats["dropped_other"] += 1
                    continue
                rule = rules.rule(src, dst)
                if rule.get("cut"):
                    stats["dropped_cut"] += 1
                    continue
                if rule.get("loss") and random.random() < rule["loss"]:
                    stats["dropped_loss"] += 1
                    continue
                delay = (rule.get("delay_ms", 0) + random.uniform(-1, 1) * rule.get("jitter_ms", 0)) / 1000
                link = (src, dst)
                due = max(time.monotonic() + max(0.0, delay), last_due.get(link, 0.0))
                last_due[link] = due
                if due <= time.monotonic() and not queue:
                    _write(fds[dst], packet, stats)
                else:
                    heapq.heappush(queue, (due, next(seq), dst, packet))


def _write(fd: int, packet: bytes, stats: dict) -> None:
    try:
        os.write(fd, packet)
        stats["forwarded"] += 1
    except (BlockingIOError, OSError):
        stats["dropped_other"] += 1  # the receiver's queue is full: a real link drops too


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", action="append", default=[], help="NAME=NETNS=IPV4 (repeat per host)")
    p.add_argument("--rules", type=Path, required=True)
    p.add_argument("--stats", type=Path)
    args = p.parse_args(argv)
    ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    hosts = {}
    for spec in args.host:
        name, ns, ip = spec.split("=")
        hosts[name] = (ns, ip)
    serve(hosts, args.rules, args.stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
