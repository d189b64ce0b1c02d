"""A run's Redis user (``buffer.acl``): its rules name its own prefix and ``tether:runs`` only, literally
(glob characters in a run id escaped), no channel, and no admin or dangerous command; the URL ``tether
redis-user`` prints keeps the server and database and carries the user. What Redis makes of the rules is
``tests/integration/test_redis_users.py``."""

from __future__ import annotations

import pytest

from buffer.acl import COMMANDS, glob_escape, run_user, run_user_rules
from buffer.keys import RUNS
from tether.commands.redis_user import run_url


def test_rules_grant_the_runs_prefix_and_the_runs_set_only() -> None:
    rules = run_user_rules("exp-1")
    assert [r for r in rules if r.startswith("~")] == ["~tether:exp-1:*", f"~{RUNS}"]
    assert not any(r.startswith(("&", "%", "allkeys", "allchannels", "+@admin", "+@dangerous")) for r in rules)
    # keys and channels are reset before any is granted; commands: everything, then the exclusions after it
    assert rules.index("resetkeys") < rules.index("~tether:exp-1:*") and "resetchannels" in rules
    assert rules[-len(COMMANDS) :] == list(COMMANDS) and rules.index("-@all") < rules.index("+@all")
    assert (
        COMMANDS.index("+@all") < COMMANDS.index("-@admin") < COMMANDS.index("-script") < COMMANDS.index("+script|load")
    )
    assert run_user("exp-1") == "tether-run-exp-1"


@pytest.mark.parametrize(
    ("run_id", "pattern"),
    [("a*", r"~tether:a\*:*"), ("a?b", r"~tether:a\?b:*"), ("[ab]", r"~tether:\[ab\]:*"), ("a\\b", r"~tether:a\\b:*")],
)
def test_glob_characters_in_a_run_id_are_matched_literally(run_id: str, pattern: str) -> None:
    # ``a*`` unescaped would be ``tether:a*:*``: every run whose id starts with ``a``
    assert run_user_rules(run_id)[2] == pattern
    assert glob_escape("tether:runs") == "tether:runs"


@pytest.mark.parametrize("run_id", ["", "a b", "a\tb", "a\nb", "a\x00b"])
def test_a_run_id_that_cannot_be_an_acl_user_is_refused(run_id: str) -> None:
    with pytest.raises(ValueError, match="run id"):
        run_user_rules(run_id)
    with pytest.raises(ValueError, match="run id"):
        run_user(run_id)


def test_run_url_replaces_the_credentials_and_keeps_the_rest() -> None:
    assert run_url("redis://:admin@h:6379/3", "tether-run-a", "pw") == "redis://tether-run-a:pw@h:6379/3"
    assert run_url("rediss://h:6380/0?ssl_cert_reqs=none", "u", "p") == "rediss://u:p@h:6380/0?ssl_cert_reqs=none"
    assert run_url("redis://admin:x@[::1]:6379", "u", "p@s/s:w") == "redis://u:p%40s%2Fs%3Aw@[::1]:6379"
