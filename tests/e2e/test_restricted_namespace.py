"""Pod Security `restricted`: the chart, in cluster scope, in namespaces that enforce it.

Two namespaces labelled `pod-security.kubernetes.io/enforce=restricted`: the release's (operator,
router, MinIO, a worker) and a second watched one. An `hf://` DynamoModel in each namespace makes
the operator run a sync Job there; every pod must be admitted by the API server's Pod Security
admission, carry the pull secret and resources, and the Job outside the release namespace gets
the store keys through the operator's copy of the store Secret.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lorafleet_devcluster.hfhub import LocalHub
from lorafleet_devcluster.session import TestCluster
from lorafleet_devcluster.stack import Release, deep_merge, default_values, manifest, wait_for
from lorafleet_operator import api
from lorafleet_worker_dev.tiny import make_tiny_adapter, make_tiny_model

from tests.delivery.helm import restricted_violations

RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
PULL_SECRET = "regcred"
HF_URI = "hf://lorafleet-demo/restricted-lora@main"


def restricted_namespace(cluster: TestCluster, prefix: str) -> str:
    name = cluster.new_namespace(prefix)
    cluster.kubectl("label", "namespace", name, *(f"{k}={v}" for k, v in RESTRICTED.items()))
    return name


@pytest.fixture(scope="module")
def hub(cluster: TestCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHub]:
    root = tmp_path_factory.mktemp("restricted-adapter")
    adapter = make_tiny_adapter(root / "a", make_tiny_model(root / "base", "qwen3"), rank=4, seed=3, strength=3.0)
    with LocalHub(tmp_path_factory.mktemp("hub"), host=cluster.test_server_host) as hub:
        hub.commit("lorafleet-demo/restricted-lora", adapter)
        yield hub


@pytest.fixture(scope="module")
def team(cluster: TestCluster) -> str:
    return restricted_namespace(cluster, "team")


@pytest.fixture(scope="module")
def release(cluster: TestCluster, hub: LocalHub, team: str) -> Iterator[Release]:
    rel = Release(cluster, restricted_namespace(cluster, "restricted"), name="lfr")
    values = deep_merge(
        default_values(cluster, workers=1, hf_endpoint=hub.url),
        {"rbac": {"scope": "cluster"}, "imagePullSecrets": [{"name": PULL_SECRET}]},
    )
    rel.deploy(values)
    yield rel
    for ns in (rel.namespace, team):
        cluster.kubectl("-n", ns, "delete", "dm", "--all", "--wait=true", "--timeout=120s", check=False)
    rel.helm("uninstall", rel.name, "--wait", "--timeout", "180s", check=False)


def test_the_namespace_really_enforces_restricted(release: Release) -> None:
    pod = (
        '{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "unconfined"},'
        ' "spec": {"containers": [{"name": "c", "image": "busybox", "command": ["sleep", "60"]}]}}'
    )
    done = release.kubectl("apply", "-f", "-", input=pod, check=False)
    assert done.returncode != 0 and "violates PodSecurity" in done.stderr, done.stderr


def test_every_chart_pod_is_admitted_with_pull_secrets_and_resources(release: Release) -> None:
    components = {"operator": 1, "router": 1, "minio": 1, "worker": 1}
    for component, count in components.items():
        pods = release.pods(component)
        assert len(pods) == count, component
        for pod in pods:
            assert pod["status"]["phase"] == "Running", (component, pod["status"])
            spec = pod["spec"]
            assert not restricted_violations(spec), (component, restricted_violations(spec))
            assert spec["imagePullSecrets"] == [{"name": PULL_SECRET}], component
            for c in spec.get("initContainers", []) + spec["containers"]:
                assert c.get("resources", {}).get("requests"), (component, c["name"])
    notes = release.helm("get", "notes", release.name).stdout
    commands = [line for line in notes.splitlines() if "kubectl " in line and "crd" not in line]
    assert commands and all(f"kubectl -n {release.namespace} " in line for line in commands), commands


def sync_job(release: Release, namespace: str) -> dict[str, object]:
    items = release.cluster.get(
        f"/apis/batch/v1/namespaces/{namespace}/jobs", labelSelector="app.kubernetes.io/component=sync"
    )["items"]
    return items[0] if items else {}


def job_complete(job: dict[str, object]) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []  # type: ignore[union-attr]
    return any(c["type"] == "Complete" and c["status"] == "True" for c in conditions)


def test_sync_jobs_run_restricted_in_every_watched_namespace(release: Release, team: str) -> None:
    cluster = release.cluster
    # Served names are unique across the watched namespaces (the older DynamoModel owns a name), so
    # the second namespace serves the adapter under a name of its own.
    for ns, served in ((release.namespace, "restricted-lora"), (team, "team-lora")):
        cluster.kubectl("-n", ns, "apply", "-f", "-", input=manifest("restricted", served, HF_URI))
    # The release namespace has the worker: the adapter is synced, loaded and served.
    release.wait_ready("restricted", total=1)
    # The other namespace has no worker: the sync must still complete there (a restricted Job pod
    # reading the operator's copy of the store keys); the model then waits for workers.
    job = wait_for(lambda: job_complete(j := sync_job(release, team)) and j, 240, f"the sync Job in {team}")
    spec = job["spec"]["template"]["spec"]  # type: ignore[index]
    assert not restricted_violations(spec), restricted_violations(spec)
    assert spec["imagePullSecrets"] == [{"name": PULL_SECRET}]
    assert spec["containers"][0]["resources"]["requests"] and spec["containers"][0]["resources"]["limits"]
    store = f"{release.fullname}-store"
    copy = cluster.get(f"/api/v1/namespaces/{team}/secrets/{store}")
    assert copy["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "lorafleet-operator"
    assert copy["data"] == cluster.get(f"/api/v1/namespaces/{release.namespace}/secrets/{store}")["data"]

    def synced() -> dict[str, object] | None:
        status = cluster.get(api.model_path(team, "restricted")).get("status") or {}
        conditions = {c["type"]: c for c in status.get("conditions", [])}
        return status if conditions.get("Synced", {}).get("reason") == "SyncSucceeded" else None

    status = wait_for(synced, 60, f"the DynamoModel in {team} to report the finished sync")
    assert str(status["resolvedUri"]).startswith("s3://lorafleet/lorafleet-demo/restricted-lora/")
    assert status["phase"] == "Pending"  # no worker serves its base model in that namespace


def test_the_chart_pods_pass_without_exemptions(release: Release, team: str) -> None:
    """No pod of the release or its Jobs was refused (ReplicaSet/Job FailedCreate events)."""
    for ns in (release.namespace, team):
        events = release.cluster.get(f"/api/v1/namespaces/{ns}/events")["items"]
        refused = [e["message"] for e in events if e.get("reason") == "FailedCreate"]
        assert not refused, refused
