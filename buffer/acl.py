"""A Redis user per run, so a run's processes can reach its own keys and no other run's.

Every key of a run lives under ``tether:{run_id}:`` (:class:`buffer.keys.RedisKeys`), so one ACL key pattern
fences it: the run's user (``tether-run-{run_id}``) may touch that prefix and the one global key a run writes,
:data:`buffer.keys.RUNS` (its learner adds the run there for the fleets that serve every run), and nothing
else: not another run's streams, weights or config, nor a fleet's state (``tether:fleet:*``, written by a
fleet serving several runs under its own credentials). No pub/sub channel is used, so none is granted. The
buffer's scripts touch only keys under the prefix they are given, and Redis checks a script's every call
against the caller's user. Commands: all but the admin and dangerous ones (ACL, CONFIG, FLUSHALL, KEYS,
CLIENT KILL, ...) and of ``SCRIPT`` only ``LOAD`` and ``EXISTS`` (what redis-py's scripts send), so a run
cannot flush the script cache every run shares. The rules hold on Redis 6.2 and 7 alike (no selectors).
SCAN still lists every key's name (it takes no key), never a value.
"""

from __future__ import annotations

import redis

from buffer.keys import RUNS, RedisKeys

COMMANDS = ("+@all", "-@admin", "-@dangerous", "-script", "+script|load", "+script|exists")
"""Command rules of a run's user, in order (a later rule overrides an earlier one)."""


def run_user(run_id: str) -> str:
    """The name of ``run_id``'s Redis user."""
    _check(run_id)
    return f"tether-run-{run_id}"


def glob_escape(text: str) -> str:
    """``text`` matched literally by a Redis glob pattern (``*``, ``?``, ``[``, ``]`` and ``\\`` escaped)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def run_user_rules(run_id: str) -> list[str]:
    """The ``ACL SETUSER`` rules of ``run_id``'s user, password and on/off aside: its keys, no channel, and
    :data:`COMMANDS`."""
    _check(run_id)
    keys = [f"~{glob_escape(RedisKeys(run_id).prefix)}*", f"~{glob_escape(RUNS)}"]
    return ["resetkeys", "resetchannels", *keys, "-@all", *COMMANDS]


def create_run_user(client: redis.Redis, run_id: str, password: str) -> str:
    """Create or replace ``run_id``'s user (``reset`` first: whatever it had before is gone) with
    ``password`` as its only one; ``client`` must be allowed ``ACL SETUSER``. Returns the user's name."""
    if not password:
        raise ValueError("create_run_user: empty password")
    name = run_user(run_id)
    client.execute_command("ACL", "SETUSER", name, "reset", f">{password}", *run_user_rules(run_id), "on")
    return name


def _check(run_id: str) -> None:
    if not run_id or any(c.isspace() or not c.isprintable() for c in run_id):
        raise ValueError(f"run id {run_id!r}: empty, or has spaces or control characters (not an ACL user)")
