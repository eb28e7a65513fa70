"""Node faults under router traffic on a multi-node kind cluster (`make e2e-kind-multinode`).

The operator, router, MinIO and CoreDNS run off the fault node (it is cordoned while they are
scheduled); the two workers spread over both nodes, and an adapter with two replicas is placed on both.
Then, with clients sending non-streamed completions through the router the whole time:

- drain: `kubectl drain` of the fault node. The PodDisruptionBudget holds (at least one worker Ready at
  every sample), the adapter is placed again on the replacement pod while the other copy serves, and no
  request fails;
- node lost: the fault node's container is stopped (`podman stop -t 0`: the kubelet stops answering, its
  pods stay Running in the API until the node controller marks the node). No request fails after the
  router's retries, and the adapter is on two Ready workers again within NODE_LOSS_BOUND seconds. The
  workers tolerate an unreachable node for TOLERATION seconds (Kubernetes' default is 300);
- node returning: the container is started again; the node turns Ready, the evicted pod is gone, a rollout
  spreads the workers over both nodes again, and the placements then hold still (no flapping).

Times from each fault to converged are printed (and written to LORAFLEET_E2E_REPORT when set).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import pytest
from lorafleet_devcluster.session import TestCluster
from lorafleet_devcluster.stack import JSON, Release, deep_merge, default_values, manifest, wait_for
from lorafleet_worker_dev.tiny import make_tiny_adapter, make_tiny_model

from tests.e2e.traffic import Load, Sampler

KIND_WORKERS = os.environ.get("LORAFLEET_E2E_KIND_WORKERS", "").split()
ENGINE = os.environ.get("LORAFLEET_E2E_KIND_ENGINE", "podman")
ADAPTER, SERVED, URI = "fault-lora", "fault-adapter", "s3://faults/lora"
TOLERATION = 20  # seconds a worker pod stays bound to an unreachable / not-ready node
# The node controller marks a silent node after node-monitor-grace-period (50 s), evicts its pods after
# TOLERATION, the replacement worker starts (tiny model, about a minute on a busy machine) and is placed.
NODE_LOSS_BOUND = 240


def node_of(pod: JSON) -> str:
    return str(pod["spec"]["nodeName"])


def ready(obj: JSON) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (obj.get("status") or {}).get("conditions", []))


def report(what: str, **times: float) -> None:
    line = json.dumps({"fault": what, **{k: round(v, 1) for k, v in times.items()}})
    print(f"\n[node-faults] {line}")
    if path := os.environ.get("LORAFLEET_E2E_REPORT"):
        with open(path, "a") as out:
            out.write(line + "\n")


@pytest.fixture(scope="module")
def fleet(cluster: TestCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    if len(KIND_WORKERS) < 2:
        pytest.skip("needs a kind cluster with 2 or more worker nodes (make e2e-kind-multinode)")
    infra, fault = KIND_WORKERS[:2]
    root = tmp_path_factory.mktemp("node-faults")
    adapter = make_tiny_adapter(root / "a", make_tiny_model(root / "base", "qwen3"), rank=4, seed=6, strength=3.0)
    rel = Release(cluster, cluster.new_namespace("faults"))
    tolerations = [
        {"key": f"node.kubernetes.io/{t}", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": TOLERATION}
        for t in ("unreachable", "not-ready")
    ]
    values = deep_merge(
        default_values(cluster, workers=2),
        {"auth": {"apiKey": {"generate": True}}, "workerDefaults": {"tolerations": tolerations}},
    )
    # operator, router, MinIO and CoreDNS off the fault node: cordon it while they are scheduled
    cluster.kubectl("cordon", fault)
    try:
        cluster.kubectl("-n", "kube-system", "rollout", "restart", "deployment/coredns")
        cluster.kubectl("-n", "kube-system", "rollout", "status", "deployment/coredns", "--timeout=180s")
        rel.apply_values(deep_merge(values, {"workers": []}))
    finally:
        cluster.kubectl("uncordon", fault)
    rel.apply_values(values)
    assert {node_of(p) for p in rel.pods("worker")} == {infra, fault}
    rel.upload(adapter, URI)
    rel.apply(manifest(ADAPTER, SERVED, URI, replicas=2))
    rel.wait_ready(ADAPTER, total=2)
    yield rel
    cluster.kubectl("uncordon", fault, check=False)
    subprocess.run([ENGINE, "start", fault], capture_output=True, check=False)
    rel.helm("uninstall", rel.name, check=False)


def traffic(release: Release) -> Load:
    url = f"{release.router_url()}/v1/completions"
    return Load(url, SERVED, clients=2, pause=0.2, tokens=4, headers=release.inference_headers())


def converged(release: Release, avoid: str | None = None) -> bool:
    """Two Ready workers (none on `avoid`), the adapter Ready on exactly those two."""
    workers = [p for p in release.pods("worker") if ready(p)]
    if len(workers) != 2 or (avoid and any(node_of(p) == avoid for p in workers)):
        return False
    dm = release.model(ADAPTER)
    status = dm.get("status") or {}
    placed = {e["podName"] for e in status.get("endpoints", [])}
    return status.get("phase") == "Ready" and placed == {p["metadata"]["name"] for p in workers}


def ready_workers(release: Release) -> int:
    return sum(ready(p) for p in release.pods("worker"))


def test_drain_honours_the_budget_and_fails_no_request(fleet: Release) -> None:
    fault = KIND_WORKERS[1]
    with traffic(fleet) as load, Sampler(lambda: ready_workers(fleet)) as workers_ready:
        start = time.monotonic()
        fleet.cluster.kubectl("drain", fault, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=240s")
        drained = time.monotonic() - start
        wait_for(lambda: converged(fleet, avoid=fault), 240, "the adapter on two Ready workers off the drained node")
        done = time.monotonic() - start
    report("drain", drained_s=drained, converged_s=done, requests=load.ok)
    assert load.ok > 0 and not load.failures, (load.ok, load.failures[:5])
    assert workers_ready.seen and min(workers_ready.seen) >= 1, workers_ready.seen  # maxUnavailable: 1 of 2
    fleet.cluster.kubectl("uncordon", fault)


def spread_again(release: Release) -> None:
    """A rollout after the node is back: the chart's topology spread puts one worker on each node."""
    deployment = f"deployment/{release.fullname}-worker-qwen"
    release.kubectl("rollout", "restart", deployment)
    release.kubectl("rollout", "status", deployment, "--timeout=300s")
    wait_for(lambda: converged(release), 240, "the adapter on both workers after the rollout")
    nodes = {node_of(p) for p in release.pods("worker")}
    assert nodes == set(KIND_WORKERS[:2]), nodes


def test_a_lost_node_fails_no_request_and_its_adapters_are_placed_again(fleet: Release) -> None:
    fault = KIND_WORKERS[1]
    spread_again(fleet)
    (lost,) = [p["metadata"]["name"] for p in fleet.pods("worker") if node_of(p) == fault]
    node_path = f"/api/v1/nodes/{fault}"
    with traffic(fleet) as load:
        start = time.monotonic()
        subprocess.run([ENGINE, "stop", "-t", "0", fault], check=True, capture_output=True)
        wait_for(lambda: not ready(fleet.cluster.get(node_path)), 120, f"{fault} NotReady")
        not_ready = time.monotonic() - start
        wait_for(
            lambda: fleet.cluster.get(f"/api/v1/namespaces/{fleet.namespace}/pods/{lost}")["metadata"].get(
                "deletionTimestamp"
            ),
            120,
            f"the node controller to evict {lost}",
        )
        evicted = time.monotonic() - start
        wait_for(lambda: converged(fleet, avoid=fault), NODE_LOSS_BOUND, "the adapter on two Ready workers again")
        done = time.monotonic() - start
    report("node-lost", not_ready_s=not_ready, evicted_s=evicted, converged_s=done, requests=load.ok)
    assert load.ok > 0 and not load.failures, (load.ok, load.failures[:5])
    assert done <= NODE_LOSS_BOUND


def test_the_node_returns_and_placements_hold_still(fleet: Release) -> None:
    fault = KIND_WORKERS[1]
    node_path = f"/api/v1/nodes/{fault}"
    with traffic(fleet) as load:
        start = time.monotonic()
        subprocess.run([ENGINE, "start", fault], check=True, capture_output=True)
        wait_for(lambda: ready(fleet.cluster.get(node_path)), 240, f"{fault} Ready again")
        back = time.monotonic() - start
        # the evicted pod is gone once its kubelet answers again
        wait_for(lambda: len(fleet.pods("worker")) == 2 and all(map(ready, fleet.pods("worker"))), 180, "2 workers")
        wait_for(
            lambda: (
                not [
                    p
                    for p in fleet.cluster.get(f"/api/v1/namespaces/{fleet.namespace}/pods")["items"]
                    if p["metadata"].get("deletionTimestamp")
                ]
            ),
            180,
            "the evicted pod removed",
        )
        spread_again(fleet)
        done = time.monotonic() - start
        # no flapping: the placements stay what they converged to while traffic goes on
        placed = {e["podName"] for e in fleet.model(ADAPTER)["status"]["endpoints"]}
        with Sampler(lambda: frozenset(e["podName"] for e in fleet.model(ADAPTER)["status"]["endpoints"])) as seen:
            wait_for(lambda: len(seen.seen) >= 40, 60, "20 s of placement samples")
    report("node-returned", ready_s=back, rebalanced_s=done, requests=load.ok)
    assert load.ok > 0 and not load.failures, (load.ok, load.failures[:5])
    assert set(seen.seen) == {frozenset(placed)}, set(seen.seen)
