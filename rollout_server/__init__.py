"""Rollout server: gRPC generation service, engines, prompt worker, episodes, rewards (issue 4).

Entry point: ``python -m rollout_server --config FILE`` → :func:`rollout_server.main.run`.
Importing this package is cheap (no torch): heavy modules are imported where they are used.
"""
