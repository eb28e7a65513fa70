"""The DynamoModel CRD file: structure, documentation, validation rules, Dynamo compatibility.

The API server's own evaluation of the schema and CEL rules is exercised in
tests/e2e/test_operator_crd.py; here the file is checked without a cluster.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from lorafleet_operator import api

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "dynamomodel.yaml"


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(CRD_PATH.read_text())
    return doc


def schema(crd: dict[str, Any]) -> dict[str, Any]:
    version = crd["spec"]["versions"][0]
    out: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return out


def walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, child in (node.get("properties") or {}).items():
        out += walk(child, f"{path}.{name}")
    if "items" in node:
        out += walk(node["items"], f"{path}[]")
    return out


def test_names_scope_and_version(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "dynamomodels.nvidia.com"
    assert spec["group"] == "nvidia.com" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "DynamoModel" and spec["names"]["plural"] == "dynamomodels"
    assert spec["names"]["shortNames"] == ["dm"]
    alpha, beta = spec["versions"]  # both versions NVIDIA Dynamo serves
    assert alpha["name"] == "v1alpha1" and alpha["served"] and alpha["storage"]
    assert alpha["name"] == api.VERSION, "the code reads and writes the storage version"
    assert beta["name"] == "v1beta1" and beta["served"] and not beta["storage"]
    for key in ("schema", "subresources", "additionalPrinterColumns"):
        assert alpha[key] == beta[key], f"{key} differs between the versions: a conversion webhook would be needed"
    assert alpha["subresources"] == {"status": {}}
    assert "conversion" not in spec or spec["conversion"] == {"strategy": "None"}


def test_the_api_module_names_the_crd(crd: dict[str, Any]) -> None:
    """``lorafleet_operator.api`` (what the operator, router, dev cluster and tests import) and the CRD agree."""
    spec, names = crd["spec"], crd["spec"]["names"]
    assert (
        spec["group"],
        names["kind"],
        names["plural"],
        names["singular"],
    ) == (api.GROUP, api.KIND, api.PLURAL, api.SINGULAR)
    assert list(api.SHORT_NAMES) == names["shortNames"] and crd["metadata"]["name"] == api.CRD_NAME
    assert list(api.VERSIONS) == [v["name"] for v in spec["versions"] if v["served"]]
    assert f"{spec['group']}/{api.VERSION}" == api.API_VERSION
    assert api.model_path("ns", "m") == "/apis/nvidia.com/v1alpha1/namespaces/ns/dynamomodels/m"
    assert api.models_path() == "/apis/nvidia.com/v1alpha1/dynamomodels"


def test_printer_columns(crd: dict[str, Any]) -> None:
    all_columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    columns = {c["name"]: c["jsonPath"] for c in all_columns if not c.get("priority")}
    assert list(columns) == ["BaseModel", "Type", "Phase", "Ready", "Total", "Age"]
    assert columns["Ready"] == ".status.readyEndpoints" and columns["Total"] == ".status.totalEndpoints"
    wide = {c["name"]: c["jsonPath"] for c in all_columns if c.get("priority") == 1}  # kubectl get dm -o wide
    assert wide == {"Desired": ".status.desiredReplicas", "Current": ".status.currentReplicas"}


def test_every_field_is_documented_and_structural(crd: dict[str, Any]) -> None:
    for path, node in walk(schema(crd)):
        if path == ".metadata":
            continue
        assert node.get("description"), f"{path or '<root>'} has no description"
        int_or_string = node.get("x-kubernetes-int-or-string") and node.get("anyOf") == [
            {"type": "integer"}, {"type": "string"}
        ]  # fmt: skip
        assert "type" in node or int_or_string, f"{path} has no type (not structural)"
        assert not node.get("x-kubernetes-preserve-unknown-fields"), path


def test_spec_validation_rules(crd: dict[str, Any]) -> None:
    spec = schema(crd)["properties"]["spec"]
    props = spec["properties"]
    assert spec["required"] == ["modelName", "baseModelName"]
    assert set(props) == {"modelName", "baseModelName", "modelType", "source", "replicas", "autoscaling"}
    assert props["modelType"]["enum"] == ["base", "lora", "adapter"] and props["modelType"]["default"] == "base"
    for field in ("baseModelName", "modelType"):
        assert {"rule": "self == oldSelf", "message": f"{field} is immutable"} in props[field][
            "x-kubernetes-validations"
        ]
    assert any("has(self.source)" in r["rule"] for r in spec["x-kubernetes-validations"])
    assert props["replicas"]["minimum"] == 1
    assert props["modelName"]["maxLength"] == 128 and props["modelName"]["minLength"] == 1


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("my-custom-lora", True),
        ("meta-llama/Llama-3.3-70B-Instruct-lora", True),
        ("a.b_c/d-e", True),
        ("bad name", False),
        ("bad:name", False),
        ("", False),
    ],
)
def test_model_name_pattern(crd: dict[str, Any], value: str, ok: bool) -> None:
    prop = schema(crd)["properties"]["spec"]["properties"]["modelName"]
    assert bool(re.fullmatch(prop["pattern"], value)) == ok


@pytest.mark.parametrize(
    ("uri", "ok"),
    [
        ("s3://my-bucket/loras/my-lora", True),
        ("s3://models/support-lora", True),
        ("hf://myorg/qwen-multilingual-lora@v1.0.0", True),
        ("hf://org/repo", True),
        ("file:///models/lora", True),
        ("http://example.com/lora", False),
        ("hf://org", False),
        ("s3://B/upper", False),
        ("file://relative/path", False),
        ("s3://bucket/with space", False),
    ],
)
def test_uri_pattern(crd: dict[str, Any], uri: str, ok: bool) -> None:
    prop = schema(crd)["properties"]["spec"]["properties"]["source"]["properties"]["uri"]
    assert bool(re.fullmatch(prop["pattern"], uri)) == ok


def test_dynamo_status_fields_first(crd: dict[str, Any]) -> None:
    status = list(schema(crd)["properties"]["status"]["properties"])
    assert status[:5] == ["endpoints", "readyEndpoints", "loraFallbackCoveredEndpoints", "totalEndpoints", "conditions"]
    assert {"observedGeneration", "phase", "placement", "resolvedUri", "revision", "syncJob"} <= set(status)


def test_autoscaling_schema(crd: dict[str, Any]) -> None:
    spec = schema(crd)["properties"]["spec"]
    auto = spec["properties"]["autoscaling"]
    assert auto["required"] == ["maxReplicas", "target"]
    assert auto["properties"]["minReplicas"]["default"] == 1 and auto["properties"]["minReplicas"]["minimum"] == 0
    assert auto["properties"]["maxReplicas"]["minimum"] == 1
    assert auto["properties"]["target"]["type"] == "number" and auto["properties"]["target"]["exclusiveMinimum"]
    assert any("self.minReplicas <= self.maxReplicas" in r["rule"] for r in auto["x-kubernetes-validations"])
    assert any(r["rule"] == "!has(self.replicas) || !has(self.autoscaling)" for r in spec["x-kubernetes-validations"])
    status = schema(crd)["properties"]["status"]["properties"]
    assert status["desiredReplicas"]["type"] == status["currentReplicas"]["type"] == "integer"
    assert "ScaledToZero" in status["phase"]["enum"]


@pytest.mark.parametrize(("value", "ok"), [("300", True), ("90s", True), ("5m", True), ("1.5h", True),
                                           ("5 m", False), ("5min", False), ("-3", False), ("", False)])  # fmt: skip
def test_scale_to_zero_after_strings(crd: dict[str, Any], value: str, ok: bool) -> None:
    """The CRD's rule for strings and the operator's parser agree (the API server runs the rule in e2e)."""
    from lorafleet_operator.autoscale import parse_duration

    (rule,) = schema(crd)["properties"]["spec"]["properties"]["autoscaling"]["properties"]["scaleToZeroAfter"][
        "x-kubernetes-validations"
    ]
    pattern = re.search(r"self.matches\('(.+)'\)", rule["rule"])
    assert pattern is not None
    assert bool(re.search(pattern.group(1), value)) == ok
    try:
        parse_duration(value, 0.0)
        parsed = True
    except ValueError:
        parsed = False
    assert parsed == ok
