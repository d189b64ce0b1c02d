"""The compose tests run through ``make test-compose``, which installs podman first and sets
``TETHER_COMPOSE_REQUIRED=1`` so a missing tool fails there. A plain ``pytest`` elsewhere skips them with
the reason instead of failing on a machine without podman."""

from __future__ import annotations

import os
import shutil

import pytest

MISSING = [tool for tool in ("podman", "runc", "mmdebstrap") if shutil.which(tool) is None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not MISSING or os.environ.get("TETHER_COMPOSE_REQUIRED") == "1":
        return
    skip = pytest.mark.skip(reason=f"needs {', '.join(MISSING)}: run `make test-compose` (it installs them)")
    for item in items:
        if "compose" in item.keywords:
            item.add_marker(skip)
