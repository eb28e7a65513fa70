"""The chaos soak on a multi-node kind cluster (`make soak-kind`): a seeded series of the faults a real
cluster has, under router traffic the whole time, each followed by convergence within a bound.

The fleet is `kind_fleet.fleet` (operator, router and MinIO on the first worker node, two workers over
both nodes, an adapter with two replicas); the clients reach the router through a NodePort on the first
worker node, so that their path does not go through the API server. Every fault kind runs once (in a
seeded order), then seeded picks follow until SOAK_MINUTES are up:

- worker-kill: a worker pod deleted with no grace (`--force --grace-period=0`);
- operator-kill: the operator pod deleted the same way;
- store-outage: MinIO unreachable for STORE_DOWN seconds (a NetworkPolicy that admits nothing to it,
  enforced by the cluster's network plugin; its data stays), and a worker killed meanwhile: the
  replacement cannot load the adapter until the store is back, so its readiness gate keeps it un-Ready
  while the other holder serves;
- api-outage: the kube-apiserver static pod stopped for API_DOWN seconds (its manifest moved out of the
  control plane's manifests directory and back); serving goes on from the routers' watch caches;
- node-loss: the second worker node's container stopped (`podman stop -t 0`) until its pods are evicted
  and the adapter is on two Ready workers again, then started again (a rollout first puts a worker on it
  when none is there).

After each fault the fleet must converge (two Ready workers, the adapter Ready on exactly them, the
operator Ready) within its bound, and no non-streamed request may fail at any time (the router retries
before the first byte). Each fault's times and request counts are printed as `[node-faults]` lines and
appended to LORAFLEET_E2E_REPORT.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections.abc import Callable

from lorafleet_devcluster.stack import JSON, Release, deep_merge, wait_for

from tests.e2e.kind_fleet import (
    ENGINE,
    KIND_WORKERS,
    NODE_LOSS_BOUND,
    connect,
    converged,
    delete_probe,
    fleet,
    node_of,
    probe_pod,
    ready,
    report,
    spread_again,
    traffic,
)

__all__ = ["fleet"]  # the module's fixture

SOAK_MINUTES = float(os.environ.get("SOAK_MINUTES", "8"))
SOAK_SEED = int(os.environ.get("SOAK_SEED", "0"))
CONTROL_PLANE = f"{os.environ.get('KIND_CLUSTER', 'lorafleet-e2e')}-control-plane"
STORE_DOWN, API_DOWN = 30.0, 15.0
BOUND = {"worker-kill": 180, "operator-kill": 180, "store-outage": 240, "api-outage": 240,
         "node-loss": NODE_LOSS_BOUND}  # fmt: skip


def force_delete(release: Release, pod: str) -> None:
    release.kubectl("delete", "pod", pod, "--force", "--grace-period=0", "--wait=false")


def worker_kill(release: Release, rng: random.Random) -> dict[str, object]:
    victim = rng.choice(sorted(p["metadata"]["name"] for p in release.pods("worker")))
    force_delete(release, victim)
    return {"pod": victim}


def operator_kill(release: Release, rng: random.Random) -> dict[str, object]:
    (victim,) = [p["metadata"]["name"] for p in release.pods("operator")]
    force_delete(release, victim)
    return {"pod": victim}


def store_outage(release: Release, rng: random.Random) -> dict[str, object]:
    deny = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "soak-store-outage", "namespace": release.namespace},
        "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "minio"}},
                 "policyTypes": ["Ingress"], "ingress": []},
    }  # fmt: skip
    release.kubectl("apply", "-f", "-", input=json.dumps(deny))
    try:
        details = worker_kill(release, rng)
        time.sleep(STORE_DOWN)  # the outage's length (a fault's duration, not synchronisation)
    finally:
        release.kubectl("delete", "networkpolicy", "soak-store-outage", "--wait=false")
    return details


def api_outage(release: Release, rng: random.Random) -> dict[str, object]:
    manifests = "/etc/kubernetes/manifests/kube-apiserver.yaml"
    subprocess.run([ENGINE, "exec", CONTROL_PLANE, "mv", manifests, "/etc/kubernetes/kube-apiserver.yaml.off"],
                   check=True, capture_output=True)  # fmt: skip
    try:
        wait_for(lambda: not api_answers(release), 120, "the API server to stop")
        time.sleep(API_DOWN)  # the outage's length
    finally:
        subprocess.run([ENGINE, "exec", CONTROL_PLANE, "mv", "/etc/kubernetes/kube-apiserver.yaml.off", manifests],
                       check=True, capture_output=True)  # fmt: skip
    wait_for(lambda: api_answers(release), 240, "the API server back")
    return {}


def api_answers(release: Release) -> bool:
    try:
        release.cluster.get("/version")
    except Exception:
        return False
    return True


def node_loss(release: Release, rng: random.Random) -> dict[str, object]:
    fault = KIND_WORKERS[1]
    if all(node_of(p) != fault for p in release.pods("worker")):
        spread_again(release)
    node_path = f"/api/v1/nodes/{fault}"
    address = node_address(release.cluster.get(node_path))
    subprocess.run([ENGINE, "stop", "-t", "0", fault], check=True, capture_output=True)
    try:
        wait_for(lambda: not ready(release.cluster.get(node_path)), 120, f"{fault} NotReady")
        wait_for(lambda: converged(release, avoid=fault), NODE_LOSS_BOUND, "the adapter on two Ready workers again")
    finally:
        subprocess.run([ENGINE, "start", fault], check=True, capture_output=True)
    wait_for(lambda: ready(release.cluster.get(node_path)), 240, f"{fault} Ready again")
    # podman may give the started container another address (kube-router's --routes-sync-period covers it)
    now = node_address(release.cluster.get(node_path))
    print(f"\n[node-faults] {fault}: address {address} before the loss, {now} now")
    # The node turns Ready as soon as its kubelet answers (its CNI config survived the stop), before its
    # network plugin runs again: until then pods scheduled there (the next fault's operator) cannot reach
    # the API server. A real node that returns from a reboot waits for its CNI in the same way.
    wait_for(lambda: network_plugin_ready(release, fault), 240, f"kube-router Ready on {fault}")
    # kube-router Ready is not yet a working pod network: the routes back to the node's pod subnet come
    # from its peers' BGP sessions, so a pod there may not hear from the API server for a while longer.
    probe = probe_pod(release, "soak-probe", node=fault)
    try:
        api = release.cluster.get("/api/v1/namespaces/default/services/kubernetes")["spec"]["clusterIP"]
        wait_for(lambda: connect(release, probe, api, 443) == "open", 240, f"a pod on {fault} reaching the API")
    finally:
        delete_probe(release, probe)
    return {"node": fault}


def node_address(node: JSON) -> str:
    return next((a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"), "?")


def network_plugin_ready(release: Release, node: str) -> bool:
    pods = release.cluster.get("/api/v1/namespaces/kube-system/pods", labelSelector="k8s-app=kube-router")["items"]
    return any(node_of(p) == node and ready(p) for p in pods)


FAULTS: dict[str, Callable[[Release, random.Random], dict[str, object]]] = {
    "worker-kill": worker_kill,
    "operator-kill": operator_kill,
    "store-outage": store_outage,
    "api-outage": api_outage,
    "node-loss": node_loss,
}


def router_by_node_port(release: Release) -> str:
    """The router through a NodePort of the first worker node (kube-proxy there): a path that needs no API
    server, where the port-forward `Release.router_url` gives on kind goes through it."""
    release.apply_values(deep_merge(release.values, {"router": {"service": {"type": "NodePort"}}}))
    service = release.cluster.get(f"/api/v1/namespaces/{release.namespace}/services/{release.fullname}-router")
    port = next(p["nodePort"] for p in service["spec"]["ports"] if p.get("name") == "http")
    node = release.cluster.get(f"/api/v1/nodes/{KIND_WORKERS[0]}")
    address = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
    return f"http://{address}:{port}"


def settled(release: Release) -> bool:
    """Converged, the operator Ready, and no pod of the release still terminating."""
    pods = release.cluster.get(f"/api/v1/namespaces/{release.namespace}/pods")["items"]
    operators = release.pods("operator")
    return (
        converged(release)
        and len(operators) == 1
        and ready(operators[0])
        and not [p for p in pods if p["metadata"].get("deletionTimestamp")]
    )


def test_the_soak_fails_no_request_and_converges_after_every_fault(fleet: Release) -> None:
    rng = random.Random(SOAK_SEED)
    first = list(FAULTS)
    rng.shuffle(first)
    deadline = time.monotonic() + SOAK_MINUTES * 60
    done: list[str] = []
    with traffic(fleet, router_by_node_port(fleet)) as load:
        while first or time.monotonic() < deadline:
            kind = first.pop(0) if first else rng.choice(list(FAULTS))
            failed_before, ok_before, start = len(load.failures), load.ok, time.monotonic()
            details = FAULTS[kind](fleet, rng)
            wait_for(lambda: settled(fleet), BOUND[kind], f"the fleet converged after {kind} {details}")
            took = time.monotonic() - start
            report(f"soak/{kind}", converged_s=took, requests=load.ok - ok_before,
                   failed=len(load.failures) - failed_before)  # fmt: skip
            assert load.failures[failed_before:] == [], (kind, details, load.failures[failed_before:][:5])
            done.append(kind)
    assert set(done) == set(FAULTS) and load.ok > 0, (done, load.ok)
