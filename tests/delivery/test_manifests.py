"""The kustomize base/overlays: generated from the chart and in sync with it, and buildable
by the pinned kubectl (`kubectl kustomize`, what `kubectl apply -k` runs)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from lorafleet_devcluster.cluster import tool_path

from tests.delivery.helm import ROOT, Doc, env_of, find, one

MANIFESTS = ROOT / "manifests"
GENERATED = ("base/lorafleet.yaml", "overlays/dev/generated.yaml")


def kustomize(overlay: str | Path) -> list[Doc]:
    done = subprocess.run(
        [str(tool_path("kubectl")), "kustomize", str(MANIFESTS / overlay)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"kubectl kustomize {overlay}: {done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def dev() -> list[Doc]:
    return kustomize("overlays/dev")


@pytest.fixture(scope="module")
def production() -> list[Doc]:
    return kustomize("overlays/production")


def test_generated_files_match_the_chart(tmp_path: Path) -> None:
    """`make manifests` output equals what is committed (rerun it after changing the chart)."""
    env = os.environ | {"HELM": str(tool_path("helm"))}
    subprocess.run([str(MANIFESTS / "render.sh"), str(tmp_path)], check=True, env=env, timeout=120)
    for rel in GENERATED:
        fresh, committed = (tmp_path / rel).read_text(), (MANIFESTS / rel).read_text()
        assert fresh == committed, f"manifests/{rel} is stale: run `make manifests`"


def test_base_builds_and_holds_the_crd_from_crds() -> None:
    base = kustomize("base")
    (crd,) = find(base, "CustomResourceDefinition")
    assert crd == yaml.safe_load((ROOT / "crds" / "dynamomodel.yaml").read_text())
    assert {"Namespace", "Deployment", "Role", "RoleBinding", "ServiceAccount", "ConfigMap"} <= {
        d["kind"] for d in base
    }
    assert not find(base, "Secret"), "the base must not carry credentials"


def test_dev_overlay_runs_minio_and_a_tiny_worker(dev: list[Doc]) -> None:
    assert {
        d["metadata"].get("namespace") for d in dev if d["kind"] not in ("Namespace", "CustomResourceDefinition")
    } == {"lorafleet"}
    minio = one(dev, "Deployment", "lorafleet-minio")
    secret_refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for e in minio["spec"]["template"]["spec"]["containers"][0]["env"]
        if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
    }
    assert secret_refs == {"lorafleet-store"}
    assert {s["metadata"]["name"] for s in find(dev, "Secret")} == {"lorafleet-store", "lorafleet-admin-token"}
    store = one(dev, "ConfigMap", "lorafleet-store")["data"]
    assert store["AWS_ENDPOINT_URL_S3"] == "http://lorafleet-minio:9000"
    worker = one(dev, "Deployment", "lorafleet-worker-tiny")["spec"]["template"]["spec"]
    assert worker["initContainers"][0]["command"][:2] == ["lorafleet-dev", "make-tiny-model"]
    operator = one(dev, "Deployment", "lorafleet-operator")["spec"]["template"]["spec"]["containers"][0]
    assert env_of(operator)["LORAFLEET_STORE_SECRET"] == "lorafleet-store"
    # The chart's NetworkPolicy comes with the worker: only the router and the operator reach it.
    policy = one(dev, "NetworkPolicy", "lorafleet-worker")
    labels = one(dev, "Deployment", "lorafleet-worker-tiny")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    components = {p["podSelector"]["matchLabels"].get("app.kubernetes.io/component")
                  for rule in policy["spec"]["ingress"] for p in rule["from"]}  # fmt: skip
    assert components == {"router", "operator", None}  # None: the monitoring selector


def test_production_overlay_uses_the_external_store(production: list[Doc]) -> None:
    assert not find(production, "Secret"), "production Secrets are created by the user, never committed"
    assert not find(production, "Deployment", "lorafleet-minio")
    store = one(production, "ConfigMap", "lorafleet-store")["data"]
    assert store["AWS_ENDPOINT_URL_S3"].startswith("https://") and store["AWS_ALLOW_HTTP"] == "false"
    operator = one(production, "Deployment", "lorafleet-operator")["spec"]["template"]["spec"]["containers"][0]
    assert operator["image"] == env_of(operator)["LORAFLEET_SYNC_IMAGE"], "sync Jobs must run the operator image"
    assert not find(production, "ClusterRole")


@pytest.mark.parametrize("overlay", ["overlays/dev", "overlays/production"])
def test_a_namespace_override_moves_everything(overlay: str, tmp_path: Path) -> None:
    """A kustomization with `namespace: team-x` over an overlay: every object, binding subject, watch
    setting and in-cluster address follows; nothing still points at the namespace "lorafleet"."""
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({"namespace": "team-x", "resources": [os.path.relpath(MANIFESTS / overlay, tmp_path)]})
    )
    docs = kustomize(tmp_path)
    for d in docs:
        if d["kind"] == "Namespace":
            assert d["metadata"]["name"] == "team-x"
        elif d["kind"] not in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"):
            assert d["metadata"]["namespace"] == "team-x", (d["kind"], d["metadata"]["name"])
        for subject in d.get("subjects", []):
            assert subject["namespace"] == "team-x", (d["metadata"]["name"], subject)
    text = yaml.safe_dump_all([d for d in docs if d["kind"] != "CustomResourceDefinition"])
    assert "lorafleet.svc" not in text and "namespace: lorafleet\n" not in text
    for name in ("lorafleet-operator", "lorafleet-router"):
        env = env_of(one(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0])
        assert "LORAFLEET_NAMESPACES" not in env, "the watched namespace is the pod's own (POD_NAMESPACE)"
        assert "metadata.namespace" in env["POD_NAMESPACE"]
