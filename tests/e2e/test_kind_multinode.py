"""The chart on a kind cluster of several worker nodes (`make e2e-kind-multinode`): worker pods spread over
the nodes by the chart's default topology spread, an adapter placed and served across nodes, and the chart's
NetworkPolicy enforced by the cluster's network plugin (kube-router): a pod outside its peers is refused on
the workers' inference and system ports, while the router's and the operator's labels are let in.

`tools/kind-e2e.sh` names the worker nodes in LORAFLEET_E2E_KIND_WORKERS and says whether the network plugin
enforces NetworkPolicy in LORAFLEET_E2E_NETWORK_POLICY; elsewhere these tests skip.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from lorafleet_devcluster.session import TestCluster
from lorafleet_devcluster.stack import BASE_MODEL, JSON, Release, deep_merge, default_values, manifest, wait_for
from lorafleet_worker_dev.tiny import make_tiny_adapter, make_tiny_model

from tests.e2e.kind_fleet import connect, delete_probe, probe_pod

KIND_WORKERS = os.environ.get("LORAFLEET_E2E_KIND_WORKERS", "").split()
ADAPTER, SERVED = "spread-lora", "spread-adapter"


def node_of(pod: JSON) -> str:
    return str(pod["spec"]["nodeName"])


@pytest.fixture(scope="module")
def release(cluster: TestCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    if len(KIND_WORKERS) < 2:
        pytest.skip("needs a kind cluster with 2 or more worker nodes (make e2e-kind-multinode)")
    root = tmp_path_factory.mktemp("multinode")
    adapter = make_tiny_adapter(root / "a", make_tiny_model(root / "base", "qwen3"), rank=4, seed=5, strength=3.0)
    rel = Release(cluster, cluster.new_namespace("multinode"))
    rel.deploy(deep_merge(default_values(cluster, workers=2), {"auth": {"apiKey": {"generate": True}}}))
    rel.upload(adapter, "s3://multinode/spread")
    rel.apply(manifest(ADAPTER, SERVED, "s3://multinode/spread", replicas=2))
    rel.wait_ready(ADAPTER, total=2)
    yield rel
    rel.helm("uninstall", rel.name, check=False)


def test_worker_pods_spread_over_the_worker_nodes(release: Release) -> None:
    """The chart's default topology spread (one pod per node preferred) puts the two workers on two nodes."""
    workers = release.pods("worker")
    assert len(workers) == 2
    assert {node_of(p) for p in workers} == set(KIND_WORKERS[:2]), [node_of(p) for p in workers]


def test_an_adapter_is_placed_and_served_across_nodes(release: Release) -> None:
    """The operator reaches a worker on another node (placement over the management port), and the router
    forwards to workers on both nodes: pod-to-pod traffic between nodes, through the workers' policy."""
    dm = release.model(ADAPTER)
    placed = {e["podName"] for e in dm["status"]["endpoints"]}
    workers = {p["metadata"]["name"]: node_of(p) for p in release.pods("worker")}
    assert placed == set(workers), (placed, workers)
    (operator,) = release.pods("operator")
    assert set(workers.values()) - {node_of(operator)}, "every worker is on the operator's node"
    answers = {release.complete(SERVED) for _ in range(4)}
    assert answers and release.complete(BASE_MODEL) not in answers


@pytest.fixture
def probe(release: Release) -> Iterator[str]:
    """A pod of the worker image in the release's namespace, matching no NetworkPolicy peer."""
    yield probe_pod(release)
    delete_probe(release)


def reach(release: Release, pod: str, targets: list[tuple[str, int]]) -> dict[tuple[str, int], bool]:
    return {(ip, port): connect(release, pod, ip, port) == "open" for ip, port in targets}


def component_labels(release: Release, component: str) -> list[str]:
    return [
        "app.kubernetes.io/name=lorafleet",
        f"app.kubernetes.io/instance={release.name}",
        f"app.kubernetes.io/component={component}",
    ]


def test_network_policy_refuses_a_pod_outside_it_and_admits_router_and_operator(release: Release, probe: str) -> None:
    if os.environ.get("LORAFLEET_E2E_NETWORK_POLICY") != "enforced":
        pytest.skip("this cluster's network plugin does not enforce NetworkPolicy")
    workers = release.pods("worker")
    (router,) = release.pods("router")
    inference = [(w["status"]["podIP"], 8000) for w in workers]
    system = [(w["status"]["podIP"], 9090) for w in workers]
    # The probe reaches pods without a policy (the router), on its own node and on the other one ...
    assert connect(release, probe, router["status"]["podIP"], 8000) == "open"
    # ... but no worker port: the chart's policy admits only its peers.
    assert reach(release, probe, inference + system) == dict.fromkeys(inference + system, False)
    # The same pod with the router's labels: the inference port opens, the system port stays shut.
    release.kubectl("label", "pod", probe, "--overwrite", *component_labels(release, "router"))
    want = dict.fromkeys(inference, True) | dict.fromkeys(system, False)
    wait_for(lambda: reach(release, probe, inference + system) == want, 60, "the router's labels to be admitted")
    # With the operator's labels: both ports.
    release.kubectl("label", "pod", probe, "--overwrite", *component_labels(release, "operator"))
    want = dict.fromkeys(inference + system, True)
    wait_for(lambda: reach(release, probe, inference + system) == want, 60, "the operator's labels to be admitted")
    # And back outside: refused again.
    release.kubectl("label", "pod", probe, "app.kubernetes.io/component-", "app.kubernetes.io/instance-")
    want = dict.fromkeys(inference + system, False)
    wait_for(lambda: reach(release, probe, inference + system) == want, 60, "the probe to be refused again")


def test_the_fleet_still_serves_with_the_policy_enforced(release: Release) -> None:
    """Router -> workers (inference port) and operator -> workers (management port) are the policy's peers."""
    release.kubectl("delete", "dm", ADAPTER)
    release.wait_gone(ADAPTER)
    release.apply(manifest(ADAPTER, SERVED, "s3://multinode/spread", replicas=2))
    release.wait_ready(ADAPTER, total=2)
    assert release.complete(SERVED) != release.complete(BASE_MODEL)
    assert all(SERVED in release.worker_loras(p) for p in release.pods("worker"))


def test_nothing_of_the_probe_is_left(release: Release) -> None:
    wait_for(
        lambda: not release.cluster.exists(f"/api/v1/namespaces/{release.namespace}/pods/probe"), 60, "probe deleted"
    )
