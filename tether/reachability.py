"""Is anything listening at ``host:port``? A TCP connect with a short deadline, for warnings and clear errors.

gRPC channels wait patiently for a server that is not there (that is right for a server that is still
starting), so a wrong address shows up as a long silence and then a bare timeout. Asking the socket
first lets a command say, within seconds, which address is wrong and which setting names it.
"""

from __future__ import annotations

import socket


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (also ``[v6]:port`` and ``dns:///host:port``) → (host, port); ValueError when malformed."""
    target = address.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


def unreachable_reason(address: str, *, timeout_s: float = 3.0) -> str | None:
    """None when a TCP connection to ``address`` opens within ``timeout_s``; else why not, in a few words."""
    try:
        host, port = split_address(address)
    except ValueError as e:
        return str(e)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer within {timeout_s:g}s"
    except OSError as e:
        return e.strerror or type(e).__name__
