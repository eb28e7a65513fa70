"""Two operator replicas with --leader-elect on the local control plane.

Exactly one replica acts (holds the Lease, reconciles, writes status); force-deleting it hands
over to the other within 30 s. No workers are needed: a base-model DynamoModel is reconciled
(status Pending/NoWorkers) by whichever replica leads.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import yaml
from lorafleet_devcluster.cluster import wait_until
from lorafleet_devcluster.rawstack import deployment, env_var, install_crd, pod_ready, rbac
from lorafleet_devcluster.session import TestCluster
from lorafleet_operator import api


@pytest.fixture(scope="module")
def ns(cluster: TestCluster) -> Iterator[str]:
    install_crd(cluster)
    name = cluster.new_namespace("ha")
    operator = deployment(
        "operator",
        "lorafleet/operator:dev",
        ["lorafleet-operator", "--namespace", name, "--bind-host", "$(POD_IP)", "--leader-elect"],
        sa="lorafleet-operator",
        replicas=2,
        env=[
            env_var("POD_NAME", field_path="metadata.name"),
            env_var("POD_NAMESPACE", field_path="metadata.namespace"),
        ],
        probe={"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 2},
    )
    docs = [*rbac("lorafleet-operator", "operator", "operator-leader"), operator]
    cluster.kubectl("apply", "-n", name, "-f", "-", input=yaml.safe_dump_all(docs))
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def operator_pods(cluster: TestCluster, ns: str) -> dict[str, str]:
    """name -> pod IP of the Ready, not terminating operator pods."""
    pods = cluster.get(f"/api/v1/namespaces/{ns}/pods", labelSelector="app=operator")["items"]
    return {p["metadata"]["name"]: p["status"]["podIP"] for p in pods
            if pod_ready(p) and not p["metadata"].get("deletionTimestamp")}  # fmt: skip


def holder(cluster: TestCluster, ns: str) -> str:
    path = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/lorafleet-operator"
    return str(cluster.get(path)["spec"].get("holderIdentity") or "") if cluster.exists(path) else ""


def reconciles(ip: str) -> float:
    text = httpx.get(f"http://{ip}:9100/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lorafleet_operator_reconciles_total{"))  # fmt: skip


def base_model(cluster: TestCluster, ns: str, name: str) -> None:
    doc = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name},
           "spec": {"modelName": f"base/{name}", "baseModelName": f"base/{name}"}}  # fmt: skip
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))


def reconciled(cluster: TestCluster, ns: str, name: str) -> bool:
    obj = cluster.get(api.model_path(ns, name))
    return (obj.get("status") or {}).get("phase") == "Pending"


def test_exactly_one_replica_acts_and_a_killed_leader_hands_over(cluster: TestCluster, ns: str) -> None:
    pods = wait_until(lambda: (p := operator_pods(cluster, ns)) and len(p) == 2 and p, 180, "two operator pods")
    leader = wait_until(lambda: holder(cluster, ns) in pods and holder(cluster, ns), 60, "a Lease holder")
    base_model(cluster, ns, "one")
    wait_until(lambda: reconciled(cluster, ns, "one"), 60, "model reconciled")
    (follower,) = set(pods) - {leader}
    assert reconciles(pods[leader]) > 0
    assert reconciles(pods[follower]) == 0  # waiting: no kopf, no queue, no drift pass
    started = time.monotonic()
    cluster.kubectl("delete", "pod", leader, "-n", ns, "--grace-period=0", "--force")
    wait_until(lambda: holder(cluster, ns) == follower, 30, "the follower took the Lease")
    base_model(cluster, ns, "two")
    wait_until(lambda: reconciled(cluster, ns, "two"), 30, "reconciled by the new leader")
    took = time.monotonic() - started
    assert took < 30, took
    assert reconciles(pods[follower]) > 0
    print(f"\nhandover after a killed leader: {took:.1f} s")
