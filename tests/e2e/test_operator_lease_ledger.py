"""The operator's Lease election and ConfigMap ledger against the real API server."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from lorafleet_devcluster.session import TestCluster
from lorafleet_operator.kube import KubeClient
from lorafleet_operator.leader import LeaderElector
from lorafleet_operator.ledger import CONFIGMAP, ConfigMapLedger


@pytest.fixture(scope="module")
def ns(cluster: TestCluster) -> Iterator[str]:
    name = cluster.new_namespace("lease")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
async def kube(cluster: TestCluster) -> AsyncIterator[KubeClient]:
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    client = KubeClient.from_environment()
    yield client
    await client.close()


async def test_one_leader_and_an_expired_lease_is_taken_over(kube: KubeClient, ns: str) -> None:
    a = LeaderElector(kube, ns, "lorafleet-operator", "replica-a", duration_s=3, renew_s=1)
    b = LeaderElector(kube, ns, "lorafleet-operator", "replica-b", duration_s=3, renew_s=1)
    results = await asyncio.gather(a.try_acquire(), b.try_acquire())
    assert sorted(results) == [False, True]  # resourceVersion: one winner per round
    leader, follower = (a, b) if results[0] else (b, a)
    assert await leader.try_acquire() and not await follower.try_acquire()
    started = time.monotonic()  # the leader stops renewing (killed): the follower waits out the Lease
    await asyncio.wait_for(follower.acquire(), timeout=10)
    assert 2 <= time.monotonic() - started < 6
    assert not await leader.try_acquire()
    await follower.release()  # a clean shutdown hands over at once
    assert await leader.try_acquire()


async def test_ledger_group_commits_and_survives_a_restart(kube: KubeClient, cluster: TestCluster, ns: str) -> None:
    ledger = ConfigMapLedger(kube)
    names = [f"org/lora-{i:03d}" for i in range(60)]
    await asyncio.gather(*(ledger.claim(ns, "abcd1234", n) for n in names))
    assert ledger.writes < 10, ledger.writes  # 60 concurrent claims, a handful of writes
    fresh = ConfigMapLedger(kube)  # a restarted operator reads the record back
    assert await fresh.names(ns, "abcd1234") == set(names)
    await fresh.release(ns, "abcd1234", names[0])
    stored = cluster.get(f"/api/v1/namespaces/{ns}/configmaps/{CONFIGMAP}")["data"]["abcd1234"]
    assert stored.split() == sorted(names[1:])
