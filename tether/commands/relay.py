"""``tether relay``: a weight-store relay between the learner's chunk service and a group of rollout servers.

    tether relay --listen 0.0.0.0:7700 --upstream learner-0:7600 [--upstream learner-1:7600] [--cache-mb 1024]

It serves the ``WeightStore`` service (``protos/tether/v1/weights.proto``) from chunks it keeps in memory,
fetching each from the first upstream that serves bytes matching its hash (``weight_sync.relay``). The
bearer token (``--token-env``, default ``TETHER_AUTH_TOKEN``) is both required of its readers and presented
upstream: one token for every tether hop. It runs until SIGTERM or SIGINT, logging its counters every
``--stats-every-s`` seconds and once more on the way out. Arguments are checked before anything heavy
is imported.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

from tether.auth import AUTH_TOKEN_ENV
from tether.config import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("relay", help="serve published weight versions to rollout servers from a cache in memory")
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to serve on (port 0: a free one)")
    p.add_argument("--upstream", required=True, action="append", metavar="HOST:PORT",
                   help="the learner's chunk service (repeat for more; asked in order)")  # fmt: skip
    p.add_argument("--cache-mb", type=int, default=1024, help="chunks kept in memory, MiB (default 1024)")
    p.add_argument("--token-env", default=AUTH_TOKEN_ENV, metavar="NAME",
                   help=f"variable holding the bearer token (default {AUTH_TOKEN_ENV}; unset: no auth)")  # fmt: skip
    p.add_argument("--chunk-timeout-s", type=float, default=30.0, help="deadline of one upstream chunk (default 30)")
    p.add_argument("--threads", type=int, default=16, help="requests served at once (default 16)")
    p.add_argument("--stats-every-s", type=float, default=60.0, help="log the counters this often (default 60)")
    p.add_argument("--log-level", default="info", help="debug, info, warning (default info)")


def split_address(text: str, flag: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) → (host, port), or a :class:`ConfigError` naming ``flag``."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{flag} {text!r}: expected HOST:PORT, e.g. 0.0.0.0:7700")
    return host, int(port)


def cmd_relay(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"relay: unexpected arguments {' '.join(overrides)}")
    host, port = split_address(args.listen, "--listen")
    for upstream in args.upstream:
        split_address(upstream, "--upstream")
    if args.cache_mb < 1 or args.threads < 1 or args.chunk_timeout_s <= 0 or args.stats_every_s <= 0:
        raise ConfigError("--cache-mb and --threads must be >= 1, --chunk-timeout-s and --stats-every-s > 0")
    token = os.environ.get(args.token_env, "") or None

    from tether.logs import get_logger, setup_logging
    from weight_sync.chunk_service import RemoteSource, serve
    from weight_sync.relay import CachingProvider

    setup_logging(process="relay", level=args.log_level)
    log = get_logger("tether.relay")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sources = [RemoteSource(u, kind="origin", token=token) for u in args.upstream]
    provider = CachingProvider(sources, cache_bytes=args.cache_mb << 20, chunk_timeout_s=args.chunk_timeout_s)
    try:
        server = serve(provider, host=host, port=port, token=token, threads=args.threads)
    except OSError as e:
        raise ConfigError(f"--listen {args.listen}: {e}") from None
    log.info("relay_serving", address=server.address, upstream=args.upstream, cache_mb=args.cache_mb,
             auth=token is not None)  # fmt: skip
    try:
        while not stop.wait(args.stats_every_s):
            log.info("relay_counters", **provider.counters)
    finally:
        server.stop(grace=2.0)
        for source in sources:
            source.close()
        log.info("relay_stopped", **provider.counters)
    return 0
