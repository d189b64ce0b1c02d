"""The bearer token every tether gRPC hop shares, resolved in one place.

Rollout servers require it and the learner's weight sender presents it, so both must resolve it the same
way; this lives in ``tether/`` (not in the rollout server's package) so that a library such as
``weight_sync`` can use it without importing a process package.
"""

from __future__ import annotations

import os

AUTH_TOKEN_ENV = "TETHER_AUTH_TOKEN"


def auth_token(configured: str) -> str:
    """The bearer token: the config's (``rollout.auth_token``), else ``TETHER_AUTH_TOKEN``; empty means no
    authentication."""
    return configured or os.environ.get(AUTH_TOKEN_ENV, "")
