"""The bearer token every tether gRPC hop shares, resolved in one place.

Rollout servers require it and the learner's weight sender presents it, so both must resolve it the same
way; this lives in ``tether/`` (not in the rollout server's package) so that a library such as
``weight_sync`` can use it without importing a process package.
"""

from __future__ import annotations

import hashlib
import hmac
import os

AUTH_TOKEN_ENV = "TETHER_AUTH_TOKEN"


def auth_token(configured: str) -> str:
    """The bearer token: the config's (``rollout.auth_token``), else ``TETHER_AUTH_TOKEN``; empty means no
    authentication."""
    return configured or os.environ.get(AUTH_TOKEN_ENV, "")


def run_token(secret: str, run_id: str) -> str:
    """A run's own bearer token on a fleet serving several runs (``tether rollout --runs``): HMAC-SHA256 of
    the run id under the fleet's token. The fleet's slot of the run accepts this token only, so a run's
    learner, given its token (``tether run-token``), can reach its own slot and never another run's; the
    fleet needs no table of tokens."""
    if not secret:
        raise ValueError("run_token: the fleet has no token (rollout.auth_token or TETHER_AUTH_TOKEN)")
    return hmac.new(secret.encode(), run_id.encode(), hashlib.sha256).hexdigest()
