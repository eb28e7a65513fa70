"""Static checks of the Helm chart: lint, render with several value sets, least-privilege RBAC,
worker labels/ports, the CRD kept in step with crds/, and chart <-> code agreement."""

from __future__ import annotations

import dataclasses
import json
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from lorafleet_sync.ids import BASE_MODEL_HASH_LABEL, base_model_hash

from tests.delivery.helm import CHART, ROOT, Doc, HelmError, containers, env_of, find, helm, one, template, values_args

WORKERS: list[dict[str, Any]] = [
    {
        "name": "qwen",
        "baseModelName": "Qwen/Qwen3-0.6B",
        "replicas": 3,
        "device": "cpu",
        "model": {"generateTiny": True},
    },
    {
        "name": "llama",
        "baseModelName": "meta-llama/Llama-3.1-8B-Instruct",
        "model": {"path": "llama", "volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}},
        "resources": {"limits": {"nvidia.com/gpu": 1}},
    },
]
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "workers": {"workers": WORKERS},
    "cluster-scope": {"rbac": {"scope": "cluster"}, "workers": WORKERS[:1]},
    "multi-namespace": {"rbac": {"watchNamespaces": ["team-a", "team-b"]}},
    "external-store": {
        "store": {"mode": "external", "endpoint": "https://s3.example.com", "existingSecret": "s3-creds"},
        "adminToken": {"existingSecret": "my-token"},
        "huggingface": {"endpoint": "https://hub.example.com", "tokenSecret": "hf"},
    },
    "no-store-no-token": {"store": {"mode": "none"}, "adminToken": {"enabled": False}},
    "pod-ip-persistent-minio": {"listenOnPodIP": True, "minio": {"persistence": {"enabled": True}}},
    "images": {"image": {"operator": {"tag": "dev"}, "worker": {"repository": "r.example.com/w", "tag": "1.2.3"}}},
    "example-gpu-cluster": yaml.safe_load((ROOT / "examples" / "values-gpu-cluster.yaml").read_text()),
    "manifests-dev": yaml.safe_load((ROOT / "manifests" / "values" / "base.yaml").read_text())
    | yaml.safe_load((ROOT / "manifests" / "values" / "dev.yaml").read_text()),
}
# SPEC §7: exactly these (apiGroup, resource) -> verbs for the operator; the router only reads.
OPERATOR_RULES = {
    ("nvidia.com", "dynamomodels"): {"get", "list", "watch", "patch"},
    ("nvidia.com", "dynamomodels/status"): {"get", "patch"},
    ("nvidia.com", "dynamomodels/finalizers"): {"update"},
    ("", "pods"): {"get", "list", "watch"},
    ("batch", "jobs"): {"create", "get", "list", "watch", "delete"},
    ("", "events"): {"create"},
    ("events.k8s.io", "events"): {"create"},
    ("", "configmaps"): {"create", "get", "patch"},  # the ledger lorafleet-adapters (get/patch by name)
    ("coordination.k8s.io", "leases"): {"create", "get", "update"},  # --leader-elect (get/update by name)
}
ROUTER_RULES = {("nvidia.com", "dynamomodels"): {"get", "list", "watch"}, ("", "pods"): {"get", "list", "watch"}}


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    return request.param, template(VALUE_SETS[request.param])


def fullname(value_set: str) -> str:
    return str(VALUE_SETS[value_set].get("fullnameOverride") or "lf-lorafleet")


def rules_by_resource(roles: list[Doc]) -> dict[tuple[str, str], set[str]]:
    merged: dict[tuple[str, str], set[str]] = {}
    for role in roles:
        for rule in role["rules"]:
            assert "resourceNames" not in rule or rule["resources"] in (["secrets"], ["configmaps"], ["leases"])
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    merged.setdefault((group, resource), set()).update(rule["verbs"])
    return merged


def test_lint_is_clean_for_every_value_set() -> None:
    for name, values in VALUE_SETS.items():
        out = helm("lint", "--strict", str(CHART), *values_args(values))
        assert "0 chart(s) failed" in out, f"{name}: {out}"


def test_every_object_is_well_formed(rendered: tuple[str, list[Doc]]) -> None:
    name, docs = rendered
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "Service", "ServiceAccount"} <= kinds, name
    seen = set()
    for d in docs:
        meta = d["metadata"]
        key = (d["kind"], meta.get("namespace"), meta["name"])
        assert key not in seen, f"{name}: duplicate {key}"
        seen.add(key)
        assert len(meta["name"]) <= 63
        if d["kind"] != "CustomResourceDefinition":
            assert meta["labels"]["app.kubernetes.io/part-of"] == "lorafleet"


def test_operator_deployment(rendered: tuple[str, list[Doc]]) -> None:
    name, docs = rendered
    dep = one(docs, "Deployment", f"{fullname(name)}-operator")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]
    assert {p["name"] for p in c["ports"]} == {"metrics", "health"}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    svc = one(docs, "Service", f"{fullname(name)}-router")
    assert svc["spec"]["ports"][0]["port"] == 8000


def test_rbac_is_least_privilege(rendered: tuple[str, list[Doc]]) -> None:
    name, docs = rendered
    cluster = VALUE_SETS[name].get("rbac", {}).get("scope") == "cluster"
    roles = find(docs, "Role") + find(docs, "ClusterRole")
    for role in roles:
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], f"{name}: wildcard in {role['metadata']['name']}: {rule}"
    main_kind = "ClusterRole" if cluster else "Role"
    operator_roles = [r for r in find(docs, main_kind) if r["metadata"]["name"] == f"{fullname(name)}-operator"]
    router_roles = [r for r in find(docs, main_kind) if r["metadata"]["name"] == f"{fullname(name)}-router"]
    watched = VALUE_SETS[name].get("rbac", {}).get("watchNamespaces", ["lorafleet"])
    assert len(operator_roles) == len(router_roles) == (1 if cluster else len(watched))
    if not cluster:
        assert {r["metadata"]["namespace"] for r in operator_roles} == set(watched)
        assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    for role in operator_roles:
        assert rules_by_resource([role]) == OPERATOR_RULES
    for role in router_roles:
        assert rules_by_resource([role]) == ROUTER_RULES
    # Secrets: get only, by name, in the release namespace.
    secret_rules = [(r, rule) for r in roles for rule in r["rules"] if "secrets" in rule["resources"]]
    for role, rule in secret_rules:
        assert role["kind"] == "Role" and role["metadata"]["namespace"] == "lorafleet"
        assert rule["verbs"] == ["get"] and rule["resourceNames"]
    # Every binding points at a role of this chart and a ServiceAccount a Deployment runs as.
    accounts = {d["spec"]["template"]["spec"].get("serviceAccountName") for d in find(docs, "Deployment")}
    role_names = {(r["kind"], r["metadata"]["name"]) for r in roles}
    for binding in find(docs, "RoleBinding") + find(docs, "ClusterRoleBinding"):
        assert (binding["roleRef"]["kind"], binding["roleRef"]["name"]) in role_names
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["name"] in accounts
            assert subject["namespace"] == "lorafleet"


def test_workers_carry_the_base_model_hash_and_both_ports() -> None:
    docs = template({"workers": WORKERS})
    for group in WORKERS:
        dep = one(docs, "Deployment", f"lf-lorafleet-worker-{group['name']}")
        pod = dep["spec"]["template"]
        expected = base_model_hash(str(group["baseModelName"]))
        assert pod["metadata"]["labels"][BASE_MODEL_HASH_LABEL] == expected
        assert dep["spec"]["replicas"] == group.get("replicas", 2)
        worker = next(c for c in pod["spec"]["containers"] if c["name"] == "worker")
        assert {p["containerPort"] for p in worker["ports"]} == {8000, 9090}
        assert f"--served-model-name={group['baseModelName']}" in worker["args"]
        assert worker["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "system"}
        assert pod["spec"]["automountServiceAccountToken"] is False
        env = env_of(worker)
        assert env["DYN_LORA_PATH"] and "LORAFLEET_ADMIN_TOKEN" in env
    qwen = one(docs, "Deployment", "lf-lorafleet-worker-qwen")["spec"]["template"]["spec"]
    (init,) = qwen["initContainers"]
    model_dir = "/models/model"
    assert init["command"][:2] == ["lorafleet-worker", "make-tiny-model"] and model_dir in init["command"]
    assert f"--model={model_dir}" in qwen["containers"][0]["args"]
    llama = one(docs, "Deployment", "lf-lorafleet-worker-llama")["spec"]["template"]["spec"]
    assert any(v.get("persistentVolumeClaim", {}).get("claimName") == "models" for v in llama["volumes"])
    assert llama["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_store_modes() -> None:
    minio = template({})
    config = one(minio, "ConfigMap", "lf-lorafleet-store")["data"]
    assert config["AWS_ENDPOINT_URL_S3"] == "http://lf-lorafleet-minio.lorafleet.svc:9000"
    assert config["AWS_ALLOW_HTTP"] == "true"
    secret = one(minio, "Secret", "lf-lorafleet-store")
    assert set(secret["data"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    minio_env = env_of(one(minio, "Deployment", "lf-lorafleet-minio")["spec"]["template"]["spec"]["containers"][0])
    assert "AWS_ACCESS_KEY_ID" in minio_env["MINIO_ROOT_USER"]
    external = template(VALUE_SETS["external-store"])
    assert not find(external, "Secret") and not find(external, "Deployment", "lf-lorafleet-minio")
    assert one(external, "ConfigMap", "lf-lorafleet-store")["data"]["AWS_ALLOW_HTTP"] == "false"
    none = template(VALUE_SETS["no-store-no-token"])
    assert not find(none, "ConfigMap") and not find(none, "Secret")
    op = one(none, "Deployment", "lf-lorafleet-operator")["spec"]["template"]["spec"]["containers"][0]
    assert "envFrom" not in op and "LORAFLEET_STORE_SECRET" not in env_of(op)


def test_given_secret_values_are_used() -> None:
    docs = template({"adminToken": {"value": "tok-123"}, "store": {"accessKeyId": "ak", "secretAccessKey": "sk"}})
    import base64

    token = one(docs, "Secret", "lf-lorafleet-admin-token")["data"]["token"]
    assert base64.b64decode(token).decode() == "tok-123"
    store = one(docs, "Secret", "lf-lorafleet-store")["data"]
    assert base64.b64decode(store["AWS_ACCESS_KEY_ID"]).decode() == "ak"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"rbac": {"scope": "everywhere"}}, "scope"),
        ({"workers": [{"name": "x"}]}, "baseModelName"),
        ({"workers": [{"name": "Bad_Name", "baseModelName": "m"}]}, "name"),
        ({"store": {"mode": "external"}}, "store.existingSecret"),
        ({"operator": {"defaultAdapterReplicas": 0}}, "defaultAdapterReplicas"),
        ({"routr": {}}, "routr"),
        ({"workers": [{"name": "a", "baseModelName": "m"}, {"name": "a", "baseModelName": "m2"}]}, "unique"),
        (
            {
                "workers": [
                    {"name": "a", "baseModelName": "m", "model": {"generateTiny": True, "volume": {"emptyDir": {}}}}
                ]
            },
            "generateTiny",
        ),
    ],
)
def test_bad_values_fail_with_a_clear_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmError, match=message):
        template(values)


def project_scripts(project: str) -> set[str]:
    return set(tomllib.loads((ROOT / project / "pyproject.toml").read_text())["project"]["scripts"])


def test_container_commands_are_the_image_clis() -> None:
    # The images' venvs hold the projects' scripts and python (MinIO's bucket helper runs python -c).
    image_scripts = {
        "lorafleet/operator": project_scripts("operator") | project_scripts("jobs") | {"python"},
        "lorafleet/worker": project_scripts("worker") | project_scripts("jobs") | {"python"},
    }
    docs = template({"workers": WORKERS})
    checked = 0
    for dep in find(docs, "Deployment"):
        for c in containers(dep):
            repo = c["image"].rsplit(":", 1)[0]
            if repo in image_scripts:
                assert c["command"][0] in image_scripts[repo], f"{c['name']}: {c['command']}"
                checked += 1
    assert checked >= 4


def test_operator_and_router_env_are_real_settings() -> None:
    """Every LORAFLEET_* variable the chart sets is one the operator's Settings reads."""
    from lorafleet_operator.settings import Settings

    known = {f.metadata["env"] for f in dataclasses.fields(Settings)}
    docs = template(VALUE_SETS["external-store"] | {"workers": WORKERS})
    for name in ("lf-lorafleet-operator", "lf-lorafleet-router"):
        (c,) = one(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        used = {k for k in env_of(c) if k.startswith("LORAFLEET_")}
        assert used and used <= known, f"{name}: unknown settings {sorted(used - known)}"
    config = one(docs, "ConfigMap", "lf-lorafleet-store")["data"]
    assert {k for k in config if k.startswith("LORAFLEET_")} <= known


def test_crd_is_the_one_in_crds_and_survives_packaging(tmp_path: Path) -> None:
    source = (ROOT / "crds" / "dynamomodel.yaml").read_bytes()
    assert (CHART / "crds" / "dynamomodel.yaml").read_bytes() == source
    crds = find(template({}), "CustomResourceDefinition")
    assert [c["metadata"]["name"] for c in crds] == ["dynamomodels.nvidia.com"]
    assert crds[0] == yaml.safe_load(source)
    # Helm keeps crds/ on uninstall; the packaged chart must carry the real file, not a link.
    helm("package", str(CHART), "--destination", str(tmp_path))
    (archive,) = tmp_path.glob("lorafleet-*.tgz")
    with tarfile.open(archive) as tar:
        member = tar.getmember("lorafleet/crds/dynamomodel.yaml")
        assert member.isfile()
        extracted = tar.extractfile(member)
        assert extracted is not None and extracted.read() == source
        names = tar.getnames()
    assert "lorafleet/values.schema.json" in names and "lorafleet/templates/NOTES.txt" in names


def test_values_schema_documents_every_default() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(defaults) == set(schema["properties"])
