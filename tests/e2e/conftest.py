"""E2E fixtures: one cluster per session (local control plane + node agent, or the current kubeconfig).

`LORAFLEET_E2E_CLUSTER=kubeconfig` (set by `make e2e-kind`) runs the same tests
against the cluster of the current kubeconfig. See docs/local-cluster.md.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lorafleet_devcluster.session import TestCluster, shared_cluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[TestCluster]:
    """The session's Kubernetes cluster (`.kubeconfig`, `.kubectl()`, `.client`, `.service_endpoint()`, ...)."""
    with shared_cluster() as handle:
        yield handle


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
