"""The DynamoModel CRD on a real API server: structural schema, CEL rules, printer columns, explain."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from lorafleet_devcluster.cluster import wait_until
from lorafleet_devcluster.rawstack import install_crd
from lorafleet_devcluster.session import TestCluster

# Dynamo's own example (docs: "Managing Models with DynamoModel"), verbatim but for the namespace.
DYNAMO_MANIFEST = """
apiVersion: nvidia.com/v1alpha1
kind: DynamoModel
metadata:
  name: my-lora
spec:
  modelName: my-custom-lora
  baseModelName: Qwen/Qwen3-0.6B  # Must match modelRef.name in your DGD
  modelType: lora
  source:
    uri: s3://my-bucket/loras/my-lora
"""


@pytest.fixture(scope="module")
def ns(cluster: TestCluster) -> Iterator[str]:
    install_crd(cluster)
    name = cluster.new_namespace("crd")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def apply(cluster: TestCluster, ns: str, manifest: str | dict[str, Any]) -> subprocess.CompletedProcess[str]:
    text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
    return cluster.kubectl("apply", "-n", ns, "-f", "-", input=text, check=False)


def lora(name: str, **spec: Any) -> dict[str, Any]:
    base = {"modelName": name, "baseModelName": "base/model", "modelType": "lora", "source": {"uri": "s3://bucket/x"}}
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoModel",
        "metadata": {"name": name},
        "spec": {**base, **spec},
    }


def test_dynamo_manifest_applies_unchanged_with_defaults(cluster: TestCluster, ns: str) -> None:
    out = apply(cluster, ns, DYNAMO_MANIFEST)
    assert out.returncode == 0, out.stderr
    obj = json.loads(cluster.kubectl("get", "dm", "my-lora", "-n", ns, "-o", "json").stdout)
    assert obj["spec"]["source"]["uri"] == "s3://my-bucket/loras/my-lora"
    base = apply(
        cluster,
        ns,
        {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "DynamoModel",
            "metadata": {"name": "qwen"},
            "spec": {"modelName": "Qwen/Qwen3-0.6B", "baseModelName": "Qwen/Qwen3-0.6B"},
        },
    )
    assert base.returncode == 0, base.stderr
    qwen = json.loads(cluster.kubectl("get", "dynamomodel", "qwen", "-n", ns, "-o", "json").stdout)
    assert qwen["spec"]["modelType"] == "base"
    table = cluster.kubectl("get", "dynamomodels", "-n", ns).stdout.splitlines()[0].split()
    assert table == ["NAME", "BASEMODEL", "TYPE", "PHASE", "READY", "TOTAL", "AGE"]


def test_v1beta1_manifest_is_the_same_object_at_both_versions(cluster: TestCluster, ns: str) -> None:
    out = apply(cluster, ns, DYNAMO_MANIFEST.replace("v1alpha1", "v1beta1").replace("my-lora", "beta-lora"))
    assert out.returncode == 0, out.stderr
    beta = json.loads(cluster.kubectl("get", "dynamomodels.v1beta1.nvidia.com", "beta-lora", "-n", ns,
                                      "-o", "json").stdout)  # fmt: skip
    alpha = json.loads(cluster.kubectl("get", "dynamomodels.v1alpha1.nvidia.com", "beta-lora", "-n", ns,
                                       "-o", "json").stdout)  # fmt: skip
    assert beta["apiVersion"] == "nvidia.com/v1beta1" and alpha["apiVersion"] == "nvidia.com/v1alpha1"
    assert alpha["spec"] == beta["spec"] and alpha["spec"]["modelType"] == "lora"
    assert alpha["metadata"]["uid"] == beta["metadata"]["uid"]
    bad = apply(cluster, ns, {**lora("beta-bad", replicas=0), "apiVersion": "nvidia.com/v1beta1"})
    assert bad.returncode != 0 and "spec.replicas" in bad.stderr  # same validation at v1beta1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"source": None}, "spec.source is required when spec.modelType is lora"),
        ({"source": {"uri": "http://example.com/x"}}, "spec.source.uri"),
        ({"source": {"uri": "s3://bucket/a/../b"}}, "must not contain '..' path segments"),
        ({"modelName": "a/../b"}, "modelName must not contain '..'"),
        ({"modelName": "has space"}, "spec.modelName"),
        ({"modelName": "x" * 129}, "spec.modelName"),
        ({"modelType": "other"}, "spec.modelType"),
        ({"replicas": 0}, "spec.replicas"),
        ({"autoscaling": {"minReplicas": 3, "maxReplicas": 2, "target": 1}}, "must not exceed autoscaling.maxReplicas"),
        ({"autoscaling": {"maxReplicas": 2, "target": 0}}, "spec.autoscaling.target"),
        ({"autoscaling": {"target": 1}}, "spec.autoscaling.maxReplicas"),
        (
            {"replicas": 2, "autoscaling": {"maxReplicas": 2, "target": 1}},
            "spec.replicas and spec.autoscaling are exclusive",
        ),
    ],
    ids=[
        "no-source",
        "bad-scheme",
        "dotdot-uri",
        "dotdot-name",
        "space-name",
        "long-name",
        "bad-type",
        "zero-replicas",
        "autoscaling-min-above-max",
        "autoscaling-zero-target",
        "autoscaling-no-max",
        "replicas-and-autoscaling",
    ],
)
def test_invalid_specs_are_rejected(cluster: TestCluster, ns: str, spec: dict[str, Any], message: str) -> None:
    manifest = lora("bad")
    manifest["spec"] = {k: v for k, v in {**manifest["spec"], **spec}.items() if v is not None}
    out = apply(cluster, ns, manifest)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_autoscaling_is_accepted_with_defaults(cluster: TestCluster, ns: str) -> None:
    manifest = lora("auto")
    manifest["spec"].pop("replicas", None)
    manifest["spec"]["autoscaling"] = {"maxReplicas": 4, "target": 2.5}
    assert apply(cluster, ns, manifest).returncode == 0
    spec = cluster.get(f"/apis/nvidia.com/v1beta1/namespaces/{ns}/dynamomodels/auto")["spec"]
    assert spec["autoscaling"] == {"minReplicas": 1, "maxReplicas": 4, "target": 2.5}


def test_scale_to_zero_is_accepted_and_its_duration_checked(cluster: TestCluster, ns: str) -> None:
    for name, after in (("zero-seconds", 300), ("zero-minutes", "5m")):
        manifest = lora(name)
        manifest["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2, "target": 1, "scaleToZeroAfter": after}
        out = apply(cluster, ns, manifest)
        assert out.returncode == 0, out.stderr
        spec = cluster.get(f"/apis/nvidia.com/v1alpha1/namespaces/{ns}/dynamomodels/{name}")["spec"]
        assert spec["autoscaling"]["minReplicas"] == 0 and spec["autoscaling"]["scaleToZeroAfter"] == after
    for after in ("5 minutes", -1):
        manifest = lora("zero-bad")
        manifest["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2, "target": 1, "scaleToZeroAfter": after}
        out = apply(cluster, ns, manifest)
        assert out.returncode != 0 and "scaleToZeroAfter must be seconds" in out.stderr, out.stderr


def test_credentials_secret_ref_is_accepted_and_its_name_checked(cluster: TestCluster, ns: str) -> None:
    manifest = lora("creds")
    manifest["spec"]["source"] = {"uri": "hf://org/private", "credentialsSecretRef": {"name": "team-hf"}}
    out = apply(cluster, ns, manifest)
    assert out.returncode == 0, out.stderr
    spec = cluster.get(f"/apis/nvidia.com/v1beta1/namespaces/{ns}/dynamomodels/creds")["spec"]
    assert spec["source"]["credentialsSecretRef"] == {"name": "team-hf"}
    manifest["spec"]["source"]["credentialsSecretRef"] = {"name": "Team_HF"}
    out = apply(cluster, ns, manifest)
    assert out.returncode != 0 and "credentialsSecretRef.name" in out.stderr, out.stderr


def test_base_model_and_type_are_immutable(cluster: TestCluster, ns: str) -> None:
    assert apply(cluster, ns, lora("immutable")).returncode == 0
    for patch, field in (({"baseModelName": "other/model"}, "baseModelName"), ({"modelType": "base"}, "modelType")):
        out = cluster.kubectl(
            "patch", "dm", "immutable", "-n", ns, "--type=merge", "-p", json.dumps({"spec": patch}), check=False
        )
        assert out.returncode != 0 and f"{field} is immutable" in out.stderr, out.stderr
    ok = cluster.kubectl(
        "patch",
        "dm",
        "immutable",
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"source": {"uri": "file:///models/new"}, "replicas": 3}}),
        check=False,
    )
    assert ok.returncode == 0, ok.stderr


def test_explain_documents_every_spec_field(cluster: TestCluster) -> None:
    def explain(path: str) -> str:
        return cluster.kubectl("explain", path, check=False).stdout

    # the CRD's schema reaches the published OpenAPI a moment after it is Established
    out = wait_until(lambda: (text := explain("dynamomodel.spec")) and "replicas" in text and text, 60, "explain")
    for field in ("modelName", "baseModelName", "modelType", "source", "replicas", "Immutable"):
        assert field in out
    assert "HRW" in explain("dynamomodel.status.placement")
    assert "hf://org/repo[@revision]" in explain("dynamomodel.spec.source.uri")
