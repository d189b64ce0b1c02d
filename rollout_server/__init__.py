"""Rollout server: gRPC generation service, engines, prompt worker, episodes, rewards (issue 4).

Entry point: ``python -m rollout_server --config FILE`` → :func:`rollout_server.main.run`.
Importing this package is cheap (no torch): heavy modules are imported where they are used.
"""

import tether  # noqa: F401  (first: its process-wide gRPC fork rule, tether/__init__.py)
