"""The chart's vLLM worker groups (`vllmWorkers`): vLLM's server and the sidecar in one pod that the operator and
the router take for a worker (labels, ports), flags each program really has, one shared adapter volume, restricted
Pod Security, the network policy, and a fleet that mixes them with lorafleet worker groups."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest
from lorafleet_sidecar.cli import build_parser
from lorafleet_sync.ids import BASE_MODEL_HASH_LABEL, base_model_hash

from tests.delivery.dockerfile import Dockerfile
from tests.delivery.helm import ROOT, Doc, HelmError, containers, env_of, find, one, restricted_violations, template

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
VLLM_GROUP = {
    "name": "smol-vllm",
    "baseModelName": BASE,
    "maxLoras": 4,
    "model": {"path": "SmolLM2", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
    "args": ["--dtype=bfloat16"],
}
LORAFLEET_GROUP = {"name": "qwen", "baseModelName": "Qwen/Qwen3-0.6B", "device": "cpu", "model": {"generateTiny": True}}


def by_name(dep: Doc) -> dict[str, Doc]:
    return {c["name"]: c for c in containers(dep)}


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    values = {"vllmWorkers": [VLLM_GROUP], "workers": [LORAFLEET_GROUP], "auth": {"apiKey": {"generate": True}}}
    return template(values)


def test_the_vllm_pod_is_a_worker_of_its_base_model(docs: list[Doc]) -> None:
    dep = one(docs, "Deployment", "lf-lorafleet-vllm-smol-vllm")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels[BASE_MODEL_HASH_LABEL] == base_model_hash(BASE)
    assert labels["app.kubernetes.io/component"] == "worker"  # the router's and the network policy's selector
    assert dep["spec"]["replicas"] == 2
    vllm, sidecar = by_name(dep)["vllm"], by_name(dep)["lorafleet-sidecar"]
    # the router sends inference to <podIP>:8000 (vLLM), the operator manages <podIP>:9090 (the sidecar)
    assert [p["containerPort"] for p in vllm["ports"]] == [8000]
    assert [p["containerPort"] for p in sidecar["ports"]] == [9090]
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "system"}
    assert vllm["command"] == ["vllm", "serve"]
    assert vllm["args"] == [
        "/models/SmolLM2",
        f"--served-model-name={BASE}",
        "--host=0.0.0.0",
        "--port=8000",
        "--enable-lora",
        "--max-loras=4",
        "--max-cpu-loras=64",
        "--max-lora-rank=64",
        "--shutdown-timeout=20",  # a stopping pod lets its requests in flight finish (vLLM's default aborts them)
        "--dtype=bfloat16",
    ]
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 35  # longer than that wait
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = env_of(vllm)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert '"name": "lf-lorafleet-api-key"' in env["VLLM_API_KEY"]  # vLLM's --api-key, the router's key
    assert '"name": "lf-lorafleet-api-key"' in env_of(sidecar)["VLLM_API_KEY"]  # sent on its load calls


def test_the_sidecar_runs_the_operator_image_with_real_flags(docs: list[Doc]) -> None:
    sidecar = by_name(one(docs, "Deployment", "lf-lorafleet-vllm-smol-vllm"))["lorafleet-sidecar"]
    assert sidecar["image"].startswith("lorafleet/operator:")
    scripts = tomllib.loads((ROOT / "sidecar" / "pyproject.toml").read_text())["project"]["scripts"]
    assert sidecar["command"] == ["lorafleet-vllm-sidecar"] and sidecar["command"][0] in scripts
    assert "sidecar" in {s.strip("./") for s in Dockerfile.parse(ROOT / "Dockerfile.operator").copy_sources()}
    args = build_parser().parse_args(sidecar["args"])
    assert (args.vllm_url, args.system_port, args.max_loaded_loras) == ("http://127.0.0.1:8000", 9090, 64)
    env = env_of(sidecar)
    assert env["DYN_LORA_PATH"] == "/var/cache/lorafleet/loras"
    assert "LORAFLEET_ADMIN_TOKEN" in env
    assert sidecar["envFrom"], "the sidecar reads the object store's settings and keys"


def test_both_containers_share_the_adapter_volume_and_pass_restricted(docs: list[Doc]) -> None:
    dep = one(docs, "Deployment", "lf-lorafleet-vllm-smol-vllm")
    spec = dep["spec"]["template"]["spec"]
    mounts = {c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in containers(dep)}
    assert mounts["vllm"]["lora-cache"]["mountPath"] == mounts["lorafleet-sidecar"]["lora-cache"]["mountPath"]
    assert mounts["vllm"]["lora-cache"].get("readOnly") is True
    assert "readOnly" not in mounts["lorafleet-sidecar"]["lora-cache"]
    assert not restricted_violations(spec), restricted_violations(spec)


def test_a_mixed_fleet_renders_both_kinds_under_one_network_policy(docs: list[Doc]) -> None:
    names = {d["metadata"]["name"] for d in find(docs, "Deployment")}
    assert {"lf-lorafleet-worker-qwen", "lf-lorafleet-vllm-smol-vllm"} <= names
    only_vllm = template({"vllmWorkers": [VLLM_GROUP]})
    policy = one(only_vllm, "NetworkPolicy", "lf-lorafleet-worker")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"vllmWorkers": [VLLM_GROUP], "workers": [{**LORAFLEET_GROUP, "name": "smol-vllm"}]}, "appears twice"),
        ({"vllmWorkers": [{**VLLM_GROUP, "maxLoraRank": 48}]}, "maxLoraRank"),
        ({"vllmWorkers": [{**VLLM_GROUP, "engine": "sglang"}]}, "engine"),
    ],
)
def test_bad_values_fail_to_render(values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmError, match=message):
        template(values)


def test_without_a_volume_a_relative_path_is_a_hub_id_and_cpu_asks_no_gpu() -> None:
    group = {"name": "hub", "baseModelName": BASE, "device": "cpu", "model": {"path": BASE}}
    vllm = by_name(one(template({"vllmWorkers": [group]}), "Deployment", "lf-lorafleet-vllm-hub"))["vllm"]
    assert vllm["args"][0] == BASE
    assert "nvidia.com/gpu" not in (vllm.get("resources", {}).get("limits") or {})


def test_listen_on_pod_ip_binds_both_servers_there() -> None:
    dep = one(
        template({"vllmWorkers": [VLLM_GROUP], "listenOnPodIP": True}), "Deployment", "lf-lorafleet-vllm-smol-vllm"
    )
    vllm, sidecar = by_name(dep)["vllm"], by_name(dep)["lorafleet-sidecar"]
    assert "--host=$(POD_IP)" in vllm["args"] and "--host=$(POD_IP)" in sidecar["args"]
    assert "--vllm-url=http://$(POD_IP):8000" in sidecar["args"]


def test_shutdown_timeout_zero_keeps_vllms_default() -> None:
    group = {**VLLM_GROUP, "shutdownTimeout": 0}
    dep = one(template({"vllmWorkers": [group]}), "Deployment", "lf-lorafleet-vllm-smol-vllm")
    vllm = by_name(dep)["vllm"]
    assert not [a for a in vllm["args"] if a.startswith("--shutdown-timeout")]
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 15
