"""Fixtures of the infrastructure tests: the session's shared local cluster (see lorafleet_devcluster.session)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from lorafleet_devcluster.session import TestCluster, shared_cluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[TestCluster]:
    if os.environ.get("LORAFLEET_E2E_CLUSTER") == "kubeconfig":
        pytest.skip("the infrastructure tests exercise the local control plane itself")
    with shared_cluster() as handle:
        yield handle
