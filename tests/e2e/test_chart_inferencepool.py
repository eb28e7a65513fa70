"""The chart's InferencePools on a real API server: the Gateway API Inference Extension's own CRD
(vendored under tests/data with its source and version) accepts them as rendered, with its defaults."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml
from lorafleet_devcluster.cluster import wait_until
from lorafleet_devcluster.helm import ROOT, template
from lorafleet_devcluster.session import TestCluster

POOL_CRD = ROOT / "tests" / "data" / "gateway-api-inference-extension" / "inferencepools-v1.6.0.yaml"
WORKERS = [{"name": "qwen", "baseModelName": "Qwen/Qwen3-0.6B", "device": "cpu", "model": {"generateTiny": True}}]


@pytest.fixture(scope="module")
def ns(cluster: TestCluster) -> Iterator[str]:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(POOL_CRD))
    path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/inferencepools.inference.networking.k8s.io"

    def established() -> bool:
        conditions = (cluster.get(path).get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

    wait_until(established, 60, "the InferencePool CRD to be Established")
    name = cluster.new_namespace("pool")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_rendered_pools_are_accepted_with_the_extensions_defaults(cluster: TestCluster, ns: str) -> None:
    for values, name in (
        ({"workers": WORKERS, "inferencePool": {"enabled": True}}, "lf-lorafleet-qwen"),
        ({"workers": WORKERS, "inferencePool": {"enabled": True, "endpointPicker": {"enabled": False}}},
         "bare-lorafleet-qwen"),
    ):  # fmt: skip
        release = name.split("-")[0]
        docs = [d for d in template(values, release=release, namespace=ns) if d["kind"] == "InferencePool"]
        out = cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(docs), check=False)
        assert out.returncode == 0, out.stderr
        pool = cluster.get(f"/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}")
        assert pool["spec"]["targetPorts"] == [{"number": 8000}] and pool["spec"]["appProtocol"] == "http"
        assert pool["spec"]["selector"]["matchLabels"]["lorafleet.dev/worker-group"] == "qwen"
    ref = cluster.get(f"/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/lf-lorafleet-qwen")
    assert ref["spec"]["endpointPickerRef"] == {
        "group": "", "kind": "Service", "name": "lf-lorafleet-qwen-epp", "port": {"number": 9002},
        "failureMode": "FailClose",
    }  # fmt: skip
