"""The chart's InferencePools (Gateway API Inference Extension, ``inferencePool.*``): off by default;
when on, one per worker group selecting exactly that group's pods on the inference port, with the
Endpoint Picker reference as the extension's v1 API defines it. Each rendered pool is checked against
the openAPIV3Schema of the extension's own CRD (vendored under tests/data with its source); the API
server's evaluation of it (defaults, CEL rules) is in tests/e2e/test_chart_inferencepool.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.delivery.helm import ROOT, Doc, HelmError, find, one, template

POOL_CRD = ROOT / "tests" / "data" / "gateway-api-inference-extension" / "inferencepools-v1.6.0.yaml"
WORKERS = [
    {"name": "qwen", "baseModelName": "Qwen/Qwen3-0.6B", "device": "cpu", "model": {"generateTiny": True}},
    {"name": "llama", "baseModelName": "meta-llama/Llama-3.1-8B-Instruct", "device": "cpu",
     "model": {"generateTiny": True}},
]  # fmt: skip


def pool_schema(path: Path = POOL_CRD) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def violations(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """What ``value`` breaks of a structural openAPIV3Schema (types, required, enums, bounds, patterns),
    including fields the API server would prune as unknown. CEL rules are left to the API server."""
    out: list[str] = []
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool}
    if kind in types and not isinstance(value, types[kind]):
        return [f"{path}: {value!r} is not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", len(value)) or len(value) < schema.get("minLength", 0):
            out.append(f"{path}: length of {value!r} out of bounds")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, int) and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        out.append(f"{path}: {value} out of bounds")
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            out.append(f"{path}: {len(value)} items out of bounds")
        for i, item in enumerate(value):
            out += violations(item, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties")
        out += [f"{path}.{name}: required" for name in schema.get("required", []) if name not in value]
        for name, item in value.items():
            if props is not None and name in props:
                out += violations(item, props[name], f"{path}.{name}")
            elif isinstance(schema.get("additionalProperties"), dict):
                out += violations(item, schema["additionalProperties"], f"{path}.{name}")
            elif props is not None and path != ".metadata":
                out.append(f"{path}.{name}: unknown field (the API server would drop it)")
    return out


def pools(values: dict[str, Any]) -> list[Doc]:
    return find(template(values), "InferencePool")


def test_off_by_default() -> None:
    assert pools({"workers": WORKERS}) == []


def test_one_pool_per_worker_group_selects_its_pods_on_the_inference_port() -> None:
    docs = template({"workers": WORKERS, "inferencePool": {"enabled": True}})
    schema = pool_schema()
    rendered = find(docs, "InferencePool")
    assert [p["metadata"]["name"] for p in rendered] == ["lf-lorafleet-qwen", "lf-lorafleet-llama"]
    for pool, group in zip(rendered, WORKERS, strict=True):
        assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
        assert violations(pool, schema) == []
        deployment = one(docs, "Deployment", f"lf-lorafleet-worker-{group['name']}")
        pod = deployment["spec"]["template"]
        # the pool's selector is the Deployment's own: exactly this group's pods
        assert pool["spec"]["selector"] == {"matchLabels": deployment["spec"]["selector"]["matchLabels"]}
        assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        (worker,) = [c for c in pod["spec"]["containers"] if c["name"] == "worker"]
        http = {p["name"]: p["containerPort"] for p in worker["ports"]}["http"]
        assert pool["spec"]["targetPorts"] == [{"number": http}]
        assert pool["spec"]["appProtocol"] == "http"
        assert pool["spec"]["endpointPickerRef"] == {
            "kind": "Service",
            "name": f"lf-lorafleet-{group['name']}-epp",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        }
        assert pool["metadata"]["annotations"]["lorafleet.dev/base-model-name"] == group["baseModelName"]


def test_vllm_worker_groups_get_pools_too() -> None:
    vllm = {"name": "vq", "baseModelName": "Qwen/Qwen3-0.6B", "model": {"path": "Qwen/Qwen3-0.6B"}}
    docs = template({"workers": WORKERS[:1], "vllmWorkers": [vllm], "inferencePool": {"enabled": True}})
    pool = one(docs, "InferencePool", "lf-lorafleet-vq")
    deployment = one(docs, "Deployment", "lf-lorafleet-vllm-vq")
    assert pool["spec"]["selector"] == {"matchLabels": deployment["spec"]["selector"]["matchLabels"]}
    (vllm_container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    assert {"number": vllm_container["ports"][0]["containerPort"]} == pool["spec"]["targetPorts"][0]
    assert violations(pool, pool_schema()) == []


def test_endpoint_picker_values() -> None:
    picker = {"name": "my-epp", "port": 9010, "failureMode": "FailOpen", "group": "", "kind": "Service"}
    values = {"workers": WORKERS[:1], "inferencePool": {"enabled": True, "appProtocol": "kubernetes.io/h2c",
                                                        "endpointPicker": picker, "labels": {"team": "a"}}}  # fmt: skip
    (pool,) = pools(values)
    assert violations(pool, pool_schema()) == []
    assert pool["spec"]["appProtocol"] == "kubernetes.io/h2c" and pool["metadata"]["labels"]["team"] == "a"
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service", "name": "my-epp", "port": {"number": 9010}, "failureMode": "FailOpen"
    }  # fmt: skip
    (bare,) = pools({"workers": WORKERS[:1], "inferencePool": {"enabled": True, "endpointPicker": {"enabled": False}}})
    assert "endpointPickerRef" not in bare["spec"] and violations(bare, pool_schema()) == []


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"endpointPicker": {"failureMode": "Sometimes"}}, "failureMode"),
        ({"appProtocol": "grpc"}, "appProtocol"),
        ({"endpointPicker": {"port": None}}, "port is required when its kind is Service"),
    ],
)
def test_bad_pool_values_fail_clearly(pool: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmError, match=message):
        template({"workers": WORKERS[:1], "inferencePool": {"enabled": True, **pool}})


def test_the_vendored_crd_says_where_it_comes_from() -> None:
    head = POOL_CRD.read_text().splitlines()[:3]
    assert any("github.com/kubernetes-sigs/gateway-api-inference-extension/blob/v1.6.0/" in line for line in head)
    crd = yaml.safe_load(POOL_CRD.read_text())
    assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == "v1.6.0"
    # the checker is not vacuous: it finds what the API server would reject or drop
    broken = {"spec": {"selector": {"matchLabels": {}}, "targetPorts": [], "endpointPickerRef": {"name": "x",
              "failureMode": "Never"}, "extra": 1}}  # fmt: skip
    found = violations(broken, pool_schema())
    assert any("targetPorts" in v for v in found) and any("failureMode" in v for v in found)
    assert any("extra: unknown field" in v for v in found)
