"""Static checks of the Helm chart: lint, render with several value sets, least-privilege RBAC,
worker labels/ports, the CRD kept in step with crds/, and chart <-> code agreement."""

from __future__ import annotations

import dataclasses
import json
import re
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from lorafleet_operator import api
from lorafleet_operator.leader import LEASE_NAME
from lorafleet_operator.ledger import CONFIGMAP as LEDGER
from lorafleet_sync.ids import BASE_MODEL_HASH_LABEL, base_model_hash

from tests.delivery.helm import (
    CHART,
    ROOT,
    Doc,
    HelmError,
    containers,
    env_of,
    find,
    helm,
    one,
    restricted_violations,
    template,
    values_args,
)

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
TINY = {"generateTiny": True}
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
    "auth-gateway": {
        "workers": WORKERS[:1],
        "auth": {"apiKey": {"existingSecret": "my-api-key"}},
        "networkPolicy": {"gateway": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}}},
    },
    "manifests-dev": yaml.safe_load((ROOT / "manifests" / "values" / "base.yaml").read_text())
    | yaml.safe_load((ROOT / "manifests" / "values" / "dev.yaml").read_text()),
}
# Least privilege, as properties of whatever the chart renders (its _rbac.tpl is the one list of rules;
# the e2e stacks run the operator and the router with those rules, so a missing grant fails there).
READ = frozenset({"get", "list", "watch"})
MODELS = (api.GROUP, api.PLURAL)
# Everything either process touches, and each resource's most powerful verbs (SPEC §7): the DynamoModel
# is only patched (our finalizer) and its status written; pods are read and only their status patched (the
# readiness gate's condition); Jobs are the only objects
# deleted (our sync Jobs); the ledger ConfigMap, the Lease and Secrets are written by name only.
MAY = {
    MODELS: READ | {"patch"},
    (api.GROUP, f"{api.PLURAL}/status"): {"get", "patch"},
    (api.GROUP, f"{api.PLURAL}/finalizers"): {"update"},
    ("", "pods"): READ,
    ("", "pods/status"): {"patch"},
    ("batch", "jobs"): READ | {"create", "delete"},
    ("", "events"): {"create"},
    ("events.k8s.io", "events"): {"create"},
    ("", "configmaps"): {"create", "get", "patch"},
    ("", "secrets"): {"create", "get", "update"},
    ("coordination.k8s.io", "leases"): {"create", "get", "update"},
}
BY_NAME_ONLY = {("", "configmaps"): [LEDGER], ("coordination.k8s.io", "leases"): [LEASE_NAME], ("", "secrets"): None}


def assert_least_privilege(role: Doc, may: dict[tuple[str, str], set[str] | frozenset[str]]) -> None:
    """No wildcard; no resource or verb beyond ``may``; every verb but ``create`` on a resource of
    ``BY_NAME_ONLY`` limited to its names (create cannot be limited by name)."""
    name = role["metadata"]["name"]
    for rule in role["rules"]:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], f"wildcard in {name}: {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted = set(rule["verbs"])
                assert granted <= may.get((group, resource), set()), f"{name}: {group}/{resource} {sorted(granted)}"
                if (group, resource) in BY_NAME_ONLY and granted != {"create"}:
                    assert rule.get("resourceNames"), f"{name}: {resource} {sorted(granted)} not limited by name"
                    wanted = BY_NAME_ONLY[(group, resource)]
                    assert wanted is None or rule["resourceNames"] == wanted, f"{name}: {rule}"


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


def test_operator_replicas_turn_on_leader_election_with_its_lease_rbac() -> None:
    """operator.replicas > 1: --leader-elect in every pod, a rolling update (never zero pods), and
    the Lease RBAC in the release namespace only (not in the watched ones); 1: none of that."""
    for replicas, watch in ((2, ["team-a", "team-b"]), (3, [])):
        docs = template({"operator": {"replicas": replicas}, "rbac": {"watchNamespaces": watch}})
        dep = one(docs, "Deployment", "lf-lorafleet-operator")
        assert dep["spec"]["replicas"] == replicas
        assert dep["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }
        env = {e["name"]: e for e in operator_env(docs, "default")}
        assert env["LORAFLEET_LEADER_ELECT"]["value"] == "true"
        assert env["POD_NAMESPACE"]["valueFrom"] and env["POD_NAME"]["valueFrom"]  # Lease home and identity
        leader = one(docs, "Role", "lf-lorafleet-operator-leader")
        assert leader["metadata"]["namespace"] == "lorafleet"
        assert_least_privilege(leader, {("coordination.k8s.io", "leases"): MAY[("coordination.k8s.io", "leases")]})
        assert rules_by_resource([leader]) == {("coordination.k8s.io", "leases"): {"create", "get", "update"}}
        assert [r.get("resourceNames") for r in leader["rules"]] == [None, [LEASE_NAME]]
        binding = one(docs, "RoleBinding", "lf-lorafleet-operator-leader")
        assert binding["roleRef"]["name"] == "lf-lorafleet-operator-leader"
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "lf-lorafleet-operator", "namespace": "lorafleet"}
        ]
        others = [r for r in find(docs, "Role") if r["metadata"]["name"] != "lf-lorafleet-operator-leader"]
        assert all(("coordination.k8s.io", "leases") not in rules_by_resource([r]) for r in others)
    docs = template({})
    assert not any(r["metadata"]["name"].endswith("-leader") for r in find(docs, "Role"))
    assert "LORAFLEET_LEADER_ELECT" not in {e["name"] for e in operator_env(docs, "default")}
    with pytest.raises(HelmError, match="minimum"):
        template({"operator": {"replicas": 0}})


def test_rbac_is_least_privilege(rendered: tuple[str, list[Doc]]) -> None:
    name, docs = rendered
    cluster = VALUE_SETS[name].get("rbac", {}).get("scope") == "cluster"
    roles = find(docs, "Role") + find(docs, "ClusterRole")
    for role in roles:
        assert_least_privilege(role, MAY)
    main_kind = "ClusterRole" if cluster else "Role"
    operator_roles = [r for r in find(docs, main_kind) if r["metadata"]["name"] == f"{fullname(name)}-operator"]
    router_roles = [r for r in find(docs, main_kind) if r["metadata"]["name"] == f"{fullname(name)}-router"]
    watched = VALUE_SETS[name].get("rbac", {}).get("watchNamespaces", ["lorafleet"])
    assert len(operator_roles) == len(router_roles) == (1 if cluster else len(watched))
    if not cluster:
        assert {r["metadata"]["namespace"] for r in operator_roles} == set(watched)
        assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    values = VALUE_SETS[name]
    store_secret = values.get("store", {}).get("existingSecret") or f"{fullname(name)}-store"
    elsewhere = cluster or set(watched) - {"lorafleet"}
    copies = elsewhere and values.get("store", {}).get("mode") != "none"
    hf_secret = values.get("huggingface", {}).get("tokenSecret")
    for role in operator_roles:
        rules = rules_by_resource([role])
        if copies:  # the store and HF token Secrets are copied where sync Jobs run: create, get/update by name
            assert rules.pop(("", "secrets")) == {"create", "get", "update"}, name
            named = [r for r in role["rules"] if r.get("resourceNames") and r["resources"] == ["secrets"]]
            assert named == [
                {
                    "apiGroups": [""],
                    "resources": ["secrets"],
                    "resourceNames": [store_secret, *([hf_secret] if hf_secret else [])],
                    "verbs": ["get", "update"],
                }
            ]
        assert ("", "secrets") not in rules and ("coordination.k8s.io", "leases") not in rules, name
        # what the operator cannot work without (the watch, its finalizer and status, worker pods, sync Jobs)
        assert rules[MODELS] >= READ | {"patch"} and rules[("", "pods")] == READ, name
        assert rules[("", "pods/status")] == {"patch"}, name  # the workers' readiness gate
        assert rules[(api.GROUP, f"{api.PLURAL}/status")] >= {"patch"} and ("batch", "jobs") in rules, name
    for role in router_roles:  # the router only reads DynamoModels and worker pods
        assert_least_privilege(role, {MODELS: READ, ("", "pods"): READ})
        assert rules_by_resource([role]) == {MODELS: READ, ("", "pods"): READ}
    # Other Secret rules: get by name, and create (Secrets the operator generates), in the release namespace.
    secret_rules = [
        (r, rule)
        for r in roles
        for rule in r["rules"]
        if "secrets" in rule["resources"] and r not in operator_roles + router_roles
    ]
    for role, rule in secret_rules:
        assert role["kind"] == "Role" and role["metadata"]["namespace"] == "lorafleet"
        assert (rule["verbs"] == ["get"] and rule["resourceNames"]) or rule["verbs"] == ["create"]
    generated = any(e["name"] == "LORAFLEET_GENERATED_SECRETS" for e in operator_env(docs, name))
    assert generated == any(rule["verbs"] == ["create"] for _, rule in secret_rules), name
    # Every binding points at a role of this chart and a ServiceAccount a Deployment runs as.
    accounts = {d["spec"]["template"]["spec"].get("serviceAccountName") for d in find(docs, "Deployment")}
    role_names = {(r["kind"], r["metadata"]["name"]) for r in roles}
    for binding in find(docs, "RoleBinding") + find(docs, "ClusterRoleBinding"):
        assert (binding["roleRef"]["kind"], binding["roleRef"]["name"]) in role_names
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["name"] in accounts
            assert subject["namespace"] == "lorafleet"


def operator_env(docs: list[Doc], value_set: str) -> list[Doc]:
    dep = one(docs, "Deployment", f"{fullname(value_set)}-operator")
    return list(dep["spec"]["template"]["spec"]["containers"][0]["env"])


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
    assert init["command"][:2] == ["lorafleet-dev", "make-tiny-model"] and model_dir in init["command"]
    assert f"--model={model_dir}" in qwen["containers"][0]["args"]
    llama = one(docs, "Deployment", "lf-lorafleet-worker-llama")["spec"]["template"]["spec"]
    assert any(v.get("persistentVolumeClaim", {}).get("claimName") == "models" for v in llama["volumes"])
    assert llama["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_store_modes() -> None:
    minio = template({})
    config = one(minio, "ConfigMap", "lf-lorafleet-store")["data"]
    assert config["AWS_ENDPOINT_URL_S3"] == "http://lf-lorafleet-minio.lorafleet.svc:9000"
    assert config["AWS_ALLOW_HTTP"] == "true"
    minio_env = env_of(one(minio, "Deployment", "lf-lorafleet-minio")["spec"]["template"]["spec"]["containers"][0])
    assert "lf-lorafleet-store" in minio_env["MINIO_ROOT_USER"] and "AWS_ACCESS_KEY_ID" in minio_env["MINIO_ROOT_USER"]
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
        ({"store": {"mode": "external", "accessKeyId": "ak"}}, "both accessKeyId and secretAccessKey"),
        ({"workers": [{"name": "a", "baseModelName": "m"}]}, r"workers\[a\]: the model directory /models/model"),
        ({"workers": [{"name": "a", "baseModelName": "m", "model": {"path": "/models/x"}}]}, "nothing is mounted"),
        ({"image": {"worker": {"repository": "w", "digest": "latest"}}}, "digest"),
        ({"workerDefaults": {"runtimeclassname": "nvidia"}}, "runtimeclassname"),
        ({"operator": {"defaultAdapterReplicas": 0}}, "defaultAdapterReplicas"),
        ({"routr": {}}, "routr"),
        (
            {"workers": [{"name": "a", "baseModelName": "m", "model": TINY}, {"name": "a", "baseModelName": "m2"}]},
            "unique",
        ),
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
    # The images' venvs hold the projects' scripts and python (MinIO's bucket helper runs python -c); the worker's
    # -dev variant also the dev tools' (worker/dev).
    worker = project_scripts("worker") | project_scripts("jobs") | {"python"}
    image_scripts = {
        "lorafleet/operator": project_scripts("operator") | project_scripts("jobs") | {"python"},
        "lorafleet/worker": worker,
        "lorafleet/worker -dev": worker | project_scripts("worker/dev"),
    }
    docs = template({"workers": WORKERS})
    checked = 0
    for dep in find(docs, "Deployment"):
        for c in containers(dep):
            repo = c["image"].rsplit(":", 1)[0] + (" -dev" if c["image"].endswith("-dev") else "")
            if repo in image_scripts:
                assert c["command"][0] in image_scripts[repo], f"{c['name']}: {c['command']}"
                checked += 1
    assert checked >= 4


def test_operator_and_router_env_are_real_settings() -> None:
    """Every LORAFLEET_* variable the chart sets for the operator is one its OperatorSettings reads, and
    every one it sets for the router one the RouterSettings read."""
    from lorafleet_operator.bootstrap_secrets import ADMIN_TOKEN_ENV, SECRETS_ENV
    from lorafleet_operator.settings import OperatorSettings
    from lorafleet_router.settings import RouterSettings

    operator = {f.metadata["env"] for f in dataclasses.fields(OperatorSettings)} | {SECRETS_ENV, ADMIN_TOKEN_ENV}
    router = {f.metadata["env"] for f in dataclasses.fields(RouterSettings)}
    docs = template(VALUE_SETS["external-store"] | {"workers": WORKERS})
    for name, known in (("lf-lorafleet-operator", operator), ("lf-lorafleet-router", router)):
        (c,) = one(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        used = {k for k in env_of(c) if k.startswith("LORAFLEET_")}
        assert used and used <= known, f"{name}: unknown settings {sorted(used - known)}"
    config = one(docs, "ConfigMap", "lf-lorafleet-store")["data"]
    assert {k for k in config if k.startswith("LORAFLEET_")} <= operator


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


# -- GitOps: renders are pure functions of the values -------------------------------------------------
def render_text(values: dict[str, Any]) -> str:
    return helm("template", "lf", str(CHART), "--namespace", "lorafleet", "--include-crds", *values_args(values))


def test_renders_are_byte_identical_and_read_no_cluster_state() -> None:
    """Argo CD / Flux render with `helm template`: the same values must give the same bytes."""
    for name, values in VALUE_SETS.items():
        assert render_text(values) == render_text(values), f"{name}: two renders differ"
    forbidden = (
        "lookup",
        "randAlpha",
        "randNumeric",
        "randAscii",
        "randBytes",
        "uuidv4",
        "now",
        "genCA",
        "genPrivateKey",
    )
    for path in sorted((CHART / "templates").rglob("*")):
        if path.is_file():
            text = path.read_text()
            used = [f for f in forbidden if f"{f} " in text or f"({f}" in text or f"{f})" in text]
            assert not used, f"{path.name}: {used} makes renders depend on time, chance or the cluster"


def test_credentials_are_generated_by_the_operator_not_rendered() -> None:
    from lorafleet_operator.bootstrap_secrets import parse_wanted

    docs = template({"workers": WORKERS})
    assert not find(docs, "Secret"), "generated credentials are never rendered"
    env = env_of(one(docs, "Deployment", "lf-lorafleet-operator")["spec"]["template"]["spec"]["containers"][0])
    assert parse_wanted(env["LORAFLEET_GENERATED_SECRETS"]) == {
        "lf-lorafleet-admin-token": {"token": 48},
        "lf-lorafleet-store": {"AWS_ACCESS_KEY_ID": 20, "AWS_SECRET_ACCESS_KEY": 40},
    }
    assert env["LORAFLEET_ADMIN_TOKEN_SECRET"] == "lf-lorafleet-admin-token/token"
    assert "LORAFLEET_ADMIN_TOKEN" not in env, "the operator must not wait for a Secret it creates"
    worker = one(docs, "Deployment", "lf-lorafleet-worker-qwen")["spec"]["template"]["spec"]["containers"][0]
    assert "lf-lorafleet-admin-token" in env_of(worker)["LORAFLEET_ADMIN_TOKEN"]
    assert {"secretRef": {"name": "lf-lorafleet-store"}} in worker["envFrom"]
    # Given values and existing Secrets are used as they are: nothing left to generate.
    for values in (
        VALUE_SETS["external-store"],
        {"adminToken": {"value": "t"}, "store": {"accessKeyId": "a", "secretAccessKey": "b"}},
    ):
        env = env_of(
            one(template(values), "Deployment", "lf-lorafleet-operator")["spec"]["template"]["spec"]["containers"][0]
        )
        assert "LORAFLEET_GENERATED_SECRETS" not in env and "LORAFLEET_ADMIN_TOKEN" in env


# -- GPU defaults and escape hatches ----------------------------------------------------------------------
def worker_pod(docs: list[Doc], group: str = "g") -> Doc:
    return dict(one(docs, "Deployment", f"lf-lorafleet-worker-{group}")["spec"]["template"])


def gpu_group(**extra: Any) -> dict[str, Any]:
    volume = {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    return {"workers": [{"name": "g", "baseModelName": "m", "model": {"volume": volume}, **extra}]}


def test_cuda_groups_request_one_gpu_unless_told_otherwise() -> None:
    def limits(**extra: Any) -> dict[str, Any]:
        return dict(
            worker_pod(template(gpu_group(**extra)))["spec"]["containers"][0].get("resources", {}).get("limits", {})
        )

    assert limits() == {"nvidia.com/gpu": 1}
    assert limits(resources={"limits": {"nvidia.com/gpu": 2, "memory": "40Gi"}}) == {
        "nvidia.com/gpu": 2,
        "memory": "40Gi",
    }
    assert limits(resources={"limits": {"nvidia.com/gpu": 0}}) == {}
    assert limits(device="cpu") == {}
    args = worker_pod(template(gpu_group()))["spec"]["containers"][0]["args"]
    assert "--device=cuda" in args
    assert not [a for a in args if a.startswith(("--dtype", "--lora-backend"))], (
        "cuda groups use the worker's auto defaults"
    )


def test_worker_escape_hatches() -> None:
    extra = {
        "runtimeClassName": "nvidia",
        "priorityClassName": "gpu-high",
        "strategy": {"type": "Recreate"},
        "shmSize": "8Gi",
        "podLabels": {"team": "ml"},
        "extraVolumes": [{"name": "weights", "persistentVolumeClaim": {"claimName": "w"}}],
        "extraVolumeMounts": [{"name": "weights", "mountPath": "/weights", "readOnly": True}],
        "model": {"path": "/weights/qwen"},  # the model lies on an extra mount: no model.volume needed
    }
    docs = template({"workers": [{"name": "g", "baseModelName": "m", **extra}]})
    dep = one(docs, "Deployment", "lf-lorafleet-worker-g")
    pod = dep["spec"]["template"]
    spec = pod["spec"]
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    assert spec["runtimeClassName"] == "nvidia" and spec["priorityClassName"] == "gpu-high"
    assert pod["metadata"]["labels"]["team"] == "ml"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert volumes["weights"]["persistentVolumeClaim"]["claimName"] == "w" and "model" not in volumes
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["/dev/shm"] == "dshm" and mounts["/weights"] == "weights"
    assert "--model=/weights/qwen" in spec["containers"][0]["args"]
    # A model baked into the image (absolute path outside mountPath) needs no volume either.
    baked = worker_pod(template({"workers": [{"name": "g", "baseModelName": "m", "model": {"path": "/opt/model"}}]}))
    assert "--model=/opt/model" in baked["spec"]["containers"][0]["args"]
    # Defaults: GPU nodes rarely have a spare GPU for a surge pod.
    default = one(template(gpu_group()), "Deployment", "lf-lorafleet-worker-g")
    assert default["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


# -- Pod Security restricted, pull secrets and resources everywhere -------------------------------------------
def pod_specs(docs: list[Doc]) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "Job")}


def test_every_pod_is_restricted_with_pull_secrets_and_resources(rendered: tuple[str, list[Doc]]) -> None:
    name, _ = rendered
    docs = template(VALUE_SETS[name] | {"imagePullSecrets": [{"name": "regcred"}]})
    for pod, spec in pod_specs(docs).items():
        assert not restricted_violations(spec), (name, pod, restricted_violations(spec))
        assert spec["imagePullSecrets"] == [{"name": "regcred"}], (name, pod)
        for c in list(spec.get("initContainers", [])) + spec["containers"]:
            assert c.get("resources", {}).get("requests"), (name, pod, c["name"])


def test_sync_job_pods_are_restricted_with_the_charts_settings() -> None:
    """The operator's Settings, read from the env the chart renders, give restricted sync Job pods."""
    from lorafleet_operator.reconcile import Model
    from lorafleet_operator.settings import OperatorSettings
    from lorafleet_operator.syncjob import job_manifest
    from lorafleet_sync.uris import HfURI

    values = {"imagePullSecrets": [{"name": "regcred"}], "global": {"imagePullSecrets": ["mirror"]}}
    docs = template(values)
    op = one(docs, "Deployment", "lf-lorafleet-operator")["spec"]["template"]["spec"]["containers"][0]
    env = {k: v for k, v in env_of(op).items() if k.startswith("LORAFLEET_") and not v.startswith('{"')}
    env |= {k: v for k, v in one(docs, "ConfigMap", "lf-lorafleet-store")["data"].items() if k.startswith("LORAFLEET_")}
    env["LORAFLEET_SYNC_RESOURCES"] = env_of(op)["LORAFLEET_SYNC_RESOURCES"]
    settings = OperatorSettings.from_sources(env=env)
    model = Model.from_body(
        {
            "metadata": {"name": "m", "namespace": "lorafleet", "uid": "u1", "generation": 1},
            "spec": {"modelName": "m", "baseModelName": "b", "modelType": "lora", "source": {"uri": "hf://o/r"}},
        }
    )
    job = job_manifest(model, HfURI("o", "r", "main"), "0" * 40, settings)
    spec = job["spec"]["template"]["spec"]
    assert not restricted_violations(spec), restricted_violations(spec)
    assert spec["imagePullSecrets"] == [{"name": "mirror"}, {"name": "regcred"}]
    assert spec["serviceAccountName"] == "lf-lorafleet-sync"
    assert spec["containers"][0]["resources"] == {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"memory": "1Gi"},
    }
    sa = one(docs, "ServiceAccount", "lf-lorafleet-sync")
    assert sa["metadata"]["namespace"] == "lorafleet" and sa["automountServiceAccountToken"] is False


# -- workload identity ----------------------------------------------------------------------------------
def test_workload_identity_without_static_keys() -> None:
    role = {"eks.amazonaws.com/role-arn": "arn:aws:iam::111122223333:role/lorafleet"}
    values = {
        "store": {"mode": "external", "endpoint": "https://s3.us-east-1.amazonaws.com"},
        "workerServiceAccount": {"annotations": role},
        "operator": {"syncJob": {"serviceAccount": {"annotations": role}}},
        "rbac": {"watchNamespaces": ["team-a", "team-b"]},
    } | gpu_group()
    docs = template(values)
    assert not find(docs, "Secret")
    assert one(docs, "ServiceAccount", "lf-lorafleet-worker")["metadata"]["annotations"] == role
    sync = [sa for sa in find(docs, "ServiceAccount", "lf-lorafleet-sync")]
    assert {sa["metadata"]["namespace"] for sa in sync} == {"team-a", "team-b"}
    assert all(sa["metadata"]["annotations"] == role for sa in sync)
    worker = worker_pod(docs)["spec"]["containers"][0]
    assert worker["envFrom"] == [{"configMapRef": {"name": "lf-lorafleet-store"}}], "no key Secret: boto3's chain"
    op = env_of(one(docs, "Deployment", "lf-lorafleet-operator")["spec"]["template"]["spec"]["containers"][0])
    assert "LORAFLEET_STORE_SECRET" not in op and op["LORAFLEET_SYNC_SERVICE_ACCOUNT"] == "lf-lorafleet-sync"


# -- conventions of well-kept charts ---------------------------------------------------------------------
def test_conventions() -> None:
    digest = "sha256:" + "a" * 64
    values = {
        "commonLabels": {"cost-center": "ml"},
        "revisionHistoryLimit": 5,
        "image": {"worker": {"repository": "lorafleet/worker", "tag": "1.0", "digest": digest}},
        "global": {"imageRegistry": "mirror.example.com"},
        "minio": {"persistence": {"enabled": True}},
        "metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True, "interval": "15s"}},
    } | gpu_group(replicas=3)
    docs = template(values)
    for d in docs:
        if d["kind"] != "CustomResourceDefinition":
            assert d["metadata"]["labels"]["cost-center"] == "ml", (d["kind"], d["metadata"]["name"])
    for dep in find(docs, "Deployment"):
        assert dep["spec"]["revisionHistoryLimit"] == 5
        for c in containers(dep):
            assert c["image"].startswith("mirror.example.com/"), c["image"]
    assert worker_pod(docs)["spec"]["containers"][0]["image"] == f"mirror.example.com/lorafleet/worker:1.0@{digest}"
    pvc = one(docs, "PersistentVolumeClaim", "lf-lorafleet-minio")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    pdb = one(docs, "PodDisruptionBudget", "lf-lorafleet-worker-g")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= worker_pod(docs)["metadata"]["labels"].items()
    (sm,) = find(docs, "ServiceMonitor")
    metrics_svc = one(docs, "Service", "lf-lorafleet-operator-metrics")
    assert sm["spec"]["selector"]["matchLabels"].items() <= metrics_svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == metrics_svc["spec"]["ports"][0]["name"]
    monitors = {m["metadata"]["name"]: m["spec"] for m in find(docs, "PodMonitor")}
    assert monitors["lf-lorafleet-worker"]["podMetricsEndpoints"] == [
        {"port": "system", "path": "/metrics", "interval": "15s"}
    ]
    assert monitors["lf-lorafleet-router"]["podMetricsEndpoints"][0]["port"] == "http"
    assert not find(template({}), "ServiceMonitor") and not find(template({}), "PodMonitor")


def test_works_as_a_dependency_of_an_umbrella_chart(tmp_path: Path) -> None:
    """`global` is accepted by the schema and read; values reach the chart under its name."""
    umbrella = tmp_path / "platform"
    (umbrella / "charts").mkdir(parents=True)
    (umbrella / "Chart.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v2",
                "name": "platform",
                "version": "1.0.0",
                "dependencies": [{"name": "lorafleet", "version": "0.1.0", "repository": f"file://{CHART}"}],
            }
        )
    )
    (umbrella / "values.yaml").write_text(
        yaml.safe_dump(
            {
                "global": {"imagePullSecrets": [{"name": "org-registry"}], "team": "platform"},
                "lorafleet": {"fullnameOverride": "lorafleet", "router": {"replicas": 2}},
            }
        )
    )
    helm("dependency", "build", str(umbrella))
    docs = [d for d in yaml.safe_load_all(helm("template", "p", str(umbrella), "--namespace", "infra")) if d]
    router = one(docs, "Deployment", "lorafleet-router")
    assert router["spec"]["replicas"] == 2
    assert router["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "org-registry"}]
    assert one(docs, "Role", "lorafleet-operator")["metadata"]["namespace"] == "infra"


@pytest.mark.parametrize(
    ("worker_image", "serving", "generator"),
    [
        ({}, r"lorafleet/worker:\d[^@]*$", r"lorafleet/worker:\d[^@]*-dev$"),
        ({"tag": "1.0-dev"}, "lorafleet/worker:1.0-dev", "lorafleet/worker:1.0-dev"),
        (
            {"tag": "1.0", "digest": "sha256:" + "b" * 64},
            "lorafleet/worker:1.0@sha256:b{64}",
            "lorafleet/worker:1.0-dev",
        ),
    ],
)
def test_tiny_model_generator_runs_the_dev_variant(worker_image: dict[str, str], serving: str, generator: str) -> None:
    """transformers (the generator's need) is only in the -dev image; the worker itself keeps the image as set."""
    values = {"image": {"worker": worker_image}, "workers": [{"name": "g", "baseModelName": "m", "model": TINY}]}
    spec = worker_pod(template(values))["spec"]
    (init,) = spec["initContainers"]
    assert init["name"] == "make-tiny-model" and re.fullmatch(f"(.*/)?{generator}", init["image"]), init["image"]
    assert re.fullmatch(f"(.*/)?{serving}", spec["containers"][0]["image"]), spec["containers"][0]["image"]


# -- Inference API key and NetworkPolicies --------------------------------------------------------------
def container_env(docs: list[Doc], deployment: str) -> dict[str, Any]:
    return env_of(one(docs, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0])


API_KEY_REF = {"secretKeyRef": {"key": "api-key", "name": "lf-lorafleet-api-key"}}


def test_the_api_key_is_off_by_default_and_fed_from_one_secret_when_given() -> None:
    import base64

    group = [{"name": "g", "baseModelName": "m", "device": "cpu", "model": TINY}]
    docs = template({"workers": group})
    for deployment in ("lf-lorafleet-router", "lf-lorafleet-worker-g", "lf-lorafleet-operator"):
        assert "LORAFLEET_API_KEY" not in container_env(docs, deployment)
    assert not find(docs, "Secret")
    # A given value: rendered into <fullname>-api-key, read by the router and the workers (not the operator).
    docs = template({"workers": group, "auth": {"apiKey": {"value": "sk-given"}}})
    assert base64.b64decode(one(docs, "Secret", "lf-lorafleet-api-key")["data"]["api-key"]).decode() == "sk-given"
    for deployment in ("lf-lorafleet-router", "lf-lorafleet-worker-g"):
        assert json.loads(container_env(docs, deployment)["LORAFLEET_API_KEY"]) == API_KEY_REF
    assert "LORAFLEET_API_KEY" not in container_env(docs, "lf-lorafleet-operator")
    assert "sk-given" not in render_text({"workers": group, "auth": {"apiKey": {"value": "sk-given"}}}).replace(
        base64.b64encode(b"sk-given").decode(), ""
    ), "the key appears only base64-encoded in its Secret"
    # A Secret the user names: used as it is, nothing rendered or generated.
    docs = template({"workers": group, "auth": {"apiKey": {"existingSecret": "mine", "key": "k", "value": "x"}}})
    assert not find(docs, "Secret", "lf-lorafleet-api-key")
    want = {"secretKeyRef": {"key": "k", "name": "mine"}}
    assert json.loads(container_env(docs, "lf-lorafleet-worker-g")["LORAFLEET_API_KEY"]) == want
    # generate: the operator creates it once at run time (renders stay identical), and may read that name.
    from lorafleet_operator.bootstrap_secrets import parse_wanted

    docs = template({"workers": group, "auth": {"apiKey": {"generate": True}}})
    assert not find(docs, "Secret", "lf-lorafleet-api-key")
    wanted = parse_wanted(container_env(docs, "lf-lorafleet-operator")["LORAFLEET_GENERATED_SECRETS"])
    assert wanted["lf-lorafleet-api-key"] == {"api-key": 48}
    assert json.loads(container_env(docs, "lf-lorafleet-router")["LORAFLEET_API_KEY"]) == API_KEY_REF
    names = [
        r.get("resourceNames", []) for role in find(docs, "Role") for r in role["rules"] if "secrets" in r["resources"]
    ]
    assert any("lf-lorafleet-api-key" in n for n in names)


def worker_policy(docs: list[Doc]) -> Doc:
    return one(docs, "NetworkPolicy", "lf-lorafleet-worker")


def peers_by_port(policy: Doc) -> dict[int, list[Doc]]:
    out: dict[int, list[Doc]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            assert port["protocol"] == "TCP"
            out.setdefault(port["port"], []).extend(rule["from"])
    return out


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def pod_labels(docs: list[Doc], deployment: str) -> dict[str, str]:
    labels: dict[str, str] = one(docs, "Deployment", deployment)["spec"]["template"]["metadata"]["labels"]
    return labels


def test_network_policies_let_only_the_router_operator_and_gateway_reach_the_workers() -> None:
    group = [{"name": "g", "baseModelName": "m", "device": "cpu", "model": TINY}]
    docs = template({"workers": group})
    policy = worker_policy(docs)
    assert policy["spec"]["policyTypes"] == ["Ingress"], "egress (DNS, the store, the Hub) stays open"
    assert selects(policy["spec"]["podSelector"], pod_labels(docs, "lf-lorafleet-worker-g"))
    for other in ("lf-lorafleet-router", "lf-lorafleet-operator", "lf-lorafleet-minio"):
        assert not selects(policy["spec"]["podSelector"], pod_labels(docs, other)), other
    ports = peers_by_port(policy)
    assert set(ports) == {8000, 9090}
    router, operator = pod_labels(docs, "lf-lorafleet-router"), pod_labels(docs, "lf-lorafleet-operator")

    def admitted(port: int, labels: dict[str, str]) -> bool:  # pods of the release namespace
        return any("namespaceSelector" not in p and selects(p["podSelector"], labels) for p in ports[port])

    assert admitted(8000, router) and admitted(8000, operator)
    assert admitted(9090, operator) and not admitted(9090, router), "only the operator manages workers"
    # No gateway by default; monitoring: Prometheus pods in any namespace, on the system port (/metrics) only.
    assert [p for p in ports[8000] if "namespaceSelector" in p] == []
    assert [p for p in ports[9090] if "namespaceSelector" in p] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    ]
    # A named gateway reaches the inference port, not the management port; no peer ever admits everyone.
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}, "podSelector": {}}
    docs = template({"workers": group, "networkPolicy": {"gateway": gateway, "monitoring": {"podSelector": None}}})
    ports = peers_by_port(worker_policy(docs))
    assert gateway in ports[8000] and gateway not in ports[9090]
    assert all("namespaceSelector" not in p for p in ports[9090]), "monitoring unset: no one"
    for peer in ports[8000] + ports[9090]:
        assert peer.get("podSelector") or peer.get("namespaceSelector"), f"{peer} admits every pod"
    # Off when disabled, and nothing to protect without worker groups.
    assert not find(template({"workers": group, "networkPolicy": {"enabled": False}}), "NetworkPolicy")
    assert not find(template({}), "NetworkPolicy")
