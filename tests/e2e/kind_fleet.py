"""The multi-node kind fleet the node-fault tests and the kind soak share (`make e2e-kind-multinode`,
`make soak-kind`): the operator, router, MinIO and CoreDNS on the first worker node (the second is cordoned
while they are scheduled), two workers spread over both nodes, an adapter with two replicas on both, and
clients of non-streamed completions through the router."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import pytest
from lorafleet_devcluster.session import TestCluster
from lorafleet_devcluster.stack import JSON, Release, deep_merge, default_values, manifest, wait_for
from lorafleet_worker_dev.tiny import make_tiny_adapter, make_tiny_model

from tests.e2e.traffic import Load

KIND_WORKERS = os.environ.get("LORAFLEET_E2E_KIND_WORKERS", "").split()
ENGINE = os.environ.get("LORAFLEET_E2E_KIND_ENGINE", "podman")
ADAPTER, SERVED, URI = "fault-lora", "fault-adapter", "s3://faults/lora"
TOLERATION = 20  # seconds a worker pod stays bound to an unreachable / not-ready node
# The node controller marks a silent node after node-monitor-grace-period (50 s), evicts its pods after
# TOLERATION, the replacement worker starts (tiny model, about a minute on a busy machine) and is placed.
NODE_LOSS_BOUND = 240


# One TCP connection attempt from inside a pod: "open", or the error's name (refused, timed out, ...).
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("open")
except OSError as e:
    print(type(e).__name__)
"""


def probe_pod(release: Release, name: str = "probe", node: str | None = None) -> str:
    """Start a pod of the worker image (it has Python) in the release's namespace, matching no NetworkPolicy
    peer, on `node` if given; returns its name once it is Ready (delete it with `delete_probe`)."""
    image = release.values["image"]["worker"]
    spec: JSON = {
        "containers": [
            {
                "name": "probe",
                "image": f"{image['repository']}:{image['tag']}",
                "imagePullPolicy": image["pullPolicy"],
                "command": ["sleep", "infinity"],
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
            }
        ],
        "terminationGracePeriodSeconds": 0,
    }
    if node:
        spec["nodeName"] = node
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "probe"}}, "spec": spec}
    release.kubectl("apply", "-f", "-", input=json.dumps(pod))
    release.kubectl("wait", "--for=condition=Ready", f"pod/{name}", "--timeout=120s")
    return name


def delete_probe(release: Release, name: str = "probe") -> None:
    release.kubectl("delete", "pod", name, "--wait=false", check=False)


def connect(release: Release, pod: str, ip: str, port: int) -> str:
    """What one TCP connection from `pod` to ip:port gives ("open", or the error's name)."""
    return release.kubectl("exec", pod, "--", "python3", "-c", CONNECT, ip, str(port)).stdout.strip()


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


def traffic(release: Release, router: str | None = None) -> Load:
    """Two clients of non-streamed completions through the router (``router``: its base URL; default the
    router Service as the test cluster reaches it, a port-forward through the API server on kind)."""
    url = f"{router or release.router_url()}/v1/completions"
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


def spread_again(release: Release) -> None:
    """A rollout after the node is back: the chart's topology spread puts one worker on each node."""
    deployment = f"deployment/{release.fullname}-worker-qwen"
    release.kubectl("rollout", "restart", deployment)
    release.kubectl("rollout", "status", deployment, "--timeout=300s")
    wait_for(lambda: converged(release), 240, "the adapter on both workers after the rollout")
    nodes = {node_of(p) for p in release.pods("worker")}
    assert nodes == set(KIND_WORKERS[:2]), nodes
