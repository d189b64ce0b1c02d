"""Cluster tests: real processes on separate hosts (network namespaces), skipped with the reason where the
machine cannot build them (not root, no TUN device)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.netlab import can_run


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = can_run()
    for item in items:
        if item.get_closest_marker("cluster") and reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def cluster_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's tiny model (64 wide, 2 layers): the cluster tests are about the network, not the model."""
    from tether.commands.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("cluster-model"), hidden=64, layers=2, heads=2, seed=0)


@pytest.fixture
def make_cluster(tmp_path: Path, cluster_model: Path) -> Iterator:
    from tests.cluster.cluster import Cluster

    made: list[Cluster] = []

    def make(**kwargs: object) -> Cluster:
        c = Cluster(tmp_path, cluster_model, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
