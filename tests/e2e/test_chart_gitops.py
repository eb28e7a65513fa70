"""The chart the way Argo CD deploys it: `helm template`, then `kubectl apply --server-side`.

Renders must be byte-identical, a second sync must change nothing, and the credentials the
operator generates at run time (admin token, MinIO keys) must survive re-syncs and the restart
of every pod, with every DynamoModel Ready again on the new pods.

On the local cluster (no Service DNS) the store endpoint is the MinIO pod's address, so the
MinIO restart changes one value, and MinIO's emptyDir loses the uploaded adapter, which the
test uploads again (a real install uses the Service name and `minio.persistence`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from lorafleet_devcluster.session import TestCluster
from lorafleet_devcluster.stack import BASE_MODEL, Release, deep_merge, default_values, manifest, wait_for
from lorafleet_worker_dev.tiny import make_tiny_adapter, make_tiny_model

from tests.delivery.helm import CHART, helm, values_args

ADAPTER_URI = "s3://adapters/support"
GENERATED = ("admin-token", "store")


def render(release: Release, values: Mapping[str, Any]) -> str:
    args = ["template", release.name, str(CHART), "--namespace", release.namespace, "--include-crds"]
    return helm(*args, *values_args(values))


def sync(release: Release, values: Mapping[str, Any]) -> str:
    """Render twice (must be identical), then server-side apply as Argo CD's controller does."""
    text = render(release, values)
    assert render(release, values) == text, "two renders of the same values differ"
    argv = ["apply", "--server-side", "--force-conflicts", "--field-manager=argocd-controller", "-f", "-"]
    release.kubectl(*argv, input=text)
    return text


def applied_versions(release: Release, text: str) -> dict[str, str]:
    """kind/name -> generation (objects with a spec) or resourceVersion of every object of a render."""
    items = json.loads(release.kubectl("get", "-f", "-", "-o", "json", input=text).stdout)["items"]
    return {
        f"{i['kind']}/{i['metadata']['name']}": str(i["metadata"].get("generation") or i["metadata"]["resourceVersion"])
        for i in items
    }


def generated_secrets(release: Release) -> dict[str, tuple[str, dict[str, str]]]:
    """name -> (uid, data) of the Secrets the operator generated."""
    out = {}
    for suffix in GENERATED:
        name = f"{release.fullname}-{suffix}"
        obj = release.cluster.get(f"/api/v1/namespaces/{release.namespace}/secrets/{name}")
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "lorafleet-operator"
        assert "app.kubernetes.io/instance" not in obj["metadata"]["labels"], "Argo CD would prune it"
        out[name] = (obj["metadata"]["uid"], release.secret(name))
    return out


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gitops-adapter")
    return make_tiny_adapter(root / "a", make_tiny_model(root / "base", "qwen3"), rank=4, seed=7, strength=3.0)


@pytest.fixture(scope="module")
def release(cluster: TestCluster) -> Iterator[Release]:
    rel = Release(cluster, cluster.new_namespace("gitops"))
    yield rel
    rel.kubectl("delete", "dm", "--all", "--wait=true", "--timeout=120s", check=False)
    rel.kubectl(
        "delete",
        "deployments,services,serviceaccounts,roles,rolebindings,configmaps,secrets,jobs",
        "--all",
        check=False,
    )


def test_gitops_sync_restart_keeps_credentials_and_models_ready(release: Release, adapter: Path) -> None:
    values = default_values(release.cluster, workers=2)
    # Sync 1: no workers yet (the local cluster needs MinIO's pod address as the store endpoint).
    sync(release, deep_merge(values, {"workers": []}))
    wait_for(release.rolled_out, 180, "operator, router and MinIO ready")
    assert not [
        s
        for s in release.cluster.get(f"/api/v1/namespaces/{release.namespace}/secrets")["items"]
        if s["metadata"].get("labels", {}).get("app.kubernetes.io/instance")
    ], "the chart renders no Secret"

    def with_endpoint() -> dict[str, Any]:
        if not release.cluster.is_local:
            return values
        host, port = release.endpoint(f"{release.fullname}-minio", 9000)
        return deep_merge(values, {"store": {"endpoint": f"http://{host}:{port}"}})

    values = with_endpoint()
    text = sync(release, values)
    wait_for(release.rolled_out, 240, "workers ready")
    secrets = generated_secrets(release)
    token = secrets[f"{release.fullname}-admin-token"][1]["token"]
    assert len(token) == 48

    # Sync 2 with the same values: byte-identical render, nothing changes on the server.
    before = applied_versions(release, text)
    assert sync(release, values) == text
    assert applied_versions(release, text) == before, "a re-sync changed objects"

    release.upload(adapter, ADAPTER_URI)
    release.apply(manifest("support", "support-lora", ADAPTER_URI))
    release.wait_ready("support", total=2)

    # Restart every pod: MinIO first (its emptyDir is lost; upload again), then all the others.
    old = {p["metadata"]["name"] for c in ("operator", "router", "worker", "minio") for p in release.pods(c)}
    release.kubectl("delete", "pod", "-l", "app.kubernetes.io/component=minio", "--wait=false")
    wait_for(
        lambda: not {p["metadata"]["name"] for p in release.pods("minio")} & old and release.rolled_out(),
        180,
        "a new MinIO pod",
    )
    values = with_endpoint()
    sync(release, values)
    release.upload(adapter, ADAPTER_URI)
    others = sorted(old - {n for n in old if "minio" in n})
    release.kubectl("delete", "pod", *others, "--wait=false", "--ignore-not-found")

    def restarted() -> bool:
        now = {p["metadata"]["name"] for c in ("operator", "router", "worker", "minio") for p in release.pods(c)}
        return not now & old and release.rolled_out()

    wait_for(restarted, 300, "every pod replaced and ready")
    assert generated_secrets(release) == secrets, "a restart or re-sync changed the generated credentials"
    new_workers = {p["metadata"]["name"]: p for p in release.pods("worker")}

    def ready_on_new_workers() -> bool:
        dm = release.wait_ready("support", total=2)
        return {e["podName"] for e in dm["status"]["endpoints"]} == set(new_workers)

    wait_for(ready_on_new_workers, 240, "the DynamoModel Ready on the new worker pods")
    for pod in new_workers.values():  # the workers accept the token from the Secret the operator made
        assert "support-lora" in release.worker_loras(pod)
    wait_for(lambda: "support-lora" in release.models(), 60, "the router to list the adapter")
    assert release.complete("support-lora") != release.complete(BASE_MODEL)
