"""``tether redis-user``: a run's own Redis user, so the run can reach its keys and no other run's.

    tether redis-user --run a --redis-url redis://:ADMIN_PW@redis:6379/0 [--password PW]

Creates (or resets) the ACL user ``tether-run-{run}`` with the rules of :func:`buffer.acl.run_user_rules`
through the admin connection the URL names, and prints the run's URL — the same server and database with
that user and its password (generated when not given) — to give the run's learner and rollout servers as
``buffer.redis_url``. A fleet serving several runs keeps an admin (or its own) user: it writes the fleets'
keys and every run's.
"""

from __future__ import annotations

import argparse
import secrets
from urllib.parse import quote, urlsplit, urlunsplit

from tether.config import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("redis-user", help="create a run's own Redis user (its keys only) and print its redis_url")
    p.add_argument("--run", required=True, metavar="RUN", help="the run id (run.run_id)")
    p.add_argument("--redis-url", required=True, metavar="URL", help="the Redis, as a user allowed ACL SETUSER")
    p.add_argument("--password", default="", help="the run user's password (default: a new random one)")


def run_url(admin_url: str, user: str, password: str) -> str:
    """``admin_url`` with ``user:password`` in place of its credentials (host, port, database kept)."""
    parts = urlsplit(admin_url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"))


def cmd_redis_user(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"redis-user: unexpected arguments {' '.join(overrides)}")
    from pydantic import ValidationError

    from tether.config.run import RunConfig

    try:
        RunConfig(run_id=args.run)
    except ValidationError as e:
        raise ConfigError(f"--run {args.run!r}: {e.errors()[0]['msg']}") from None
    import redis

    from buffer.acl import create_run_user
    from tether.redis_server import RedisUnavailable, connect_redis, redacted

    password = args.password or secrets.token_urlsafe(24)
    try:
        client = connect_redis(args.redis_url, timeout_s=3.0)
    except RedisUnavailable as e:
        raise ConfigError(str(e).replace("buffer.redis_url", "--redis-url")) from None
    try:
        user = create_run_user(client, args.run, password)
    except redis.exceptions.NoPermissionError as e:
        raise ConfigError(
            f"--redis-url {redacted(args.redis_url)}: this user may not create users ({e}) — give an admin's URL"
        ) from None
    except redis.ResponseError as e:
        raise ConfigError(f"--redis-url {redacted(args.redis_url)}: ACL SETUSER failed ({e}) — tether's run users "
                          "need Redis 6.2 or later") from None  # fmt: skip
    finally:
        client.close()
    print(run_url(args.redis_url, user, password))
    return 0
