"""The user story through the Helm chart only: install, DynamoModels (Dynamo's manifest verbatim,
an hf:// adapter synced into the chart's MinIO), answers through the router Service, scaling,
deletion, least-privilege RBAC, upgrade and uninstall.

The operator and router run as pods with the chart's ServiceAccounts (the node agent gives each
pod a token of its ServiceAccount), so a missing permission in the chart fails these tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from lorafleet_devcluster import podman
from lorafleet_devcluster.hfhub import LocalHub
from lorafleet_devcluster.session import TestCluster
from lorafleet_devcluster.stack import BASE_MODEL, Release, deep_merge, default_values, wait_for
from lorafleet_operator import api
from lorafleet_worker_dev.tiny import make_tiny_adapter, make_tiny_model

from tests.e2e.traffic import Load, Sampler

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DYNAMO_EXAMPLE = EXAMPLES / "dynamo-my-lora.yaml"  # s3://my-bucket/my-lora, modelName my-custom-lora
HF_EXAMPLE = EXAMPLES / "hf-lora.yaml"  # hf://lorafleet-demo/support-lora@main, modelName support-adapter


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real PEFT adapters for the tiny qwen3 model the chart's workers generate."""
    root = tmp_path_factory.mktemp("chart-adapters")
    base = make_tiny_model(root / "base", "qwen3")
    return {
        "dynamo": make_tiny_adapter(root / "dynamo", base, rank=8, seed=1, strength=3.0),
        "hf": make_tiny_adapter(root / "hf", base, rank=4, seed=2, strength=3.0),
    }


@pytest.fixture(scope="module")
def hub(
    cluster: TestCluster, tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Path]
) -> Iterator[LocalHub]:
    with LocalHub(tmp_path_factory.mktemp("hub"), host=cluster.test_server_host) as hub:
        hub.commit("lorafleet-demo/support-lora", adapters["hf"])
        yield hub


@pytest.fixture(scope="module")
def release(cluster: TestCluster, hub: LocalHub, adapters: dict[str, Path]) -> Iterator[Release]:
    rel = Release(cluster, cluster.new_namespace("chart"))
    # with an inference API key the operator generates once (auth.apiKey.generate): every client here sends it
    rel.deploy(
        deep_merge(default_values(cluster, workers=2, hf_endpoint=hub.url), {"auth": {"apiKey": {"generate": True}}})
    )
    rel.upload(adapters["dynamo"], "s3://my-bucket/my-lora")
    yield rel
    rel.helm("uninstall", rel.name, check=False)


def test_install_runs_every_component_with_its_service_account(release: Release) -> None:
    expected = {
        "operator": "lf-lorafleet-operator",
        "router": "lf-lorafleet-router",
        "worker": "lf-lorafleet-worker",
        "minio": "default",
    }
    for component, account in expected.items():
        pods = release.pods(component)
        assert pods, f"no {component} pod"
        for pod in pods:
            assert pod["status"]["phase"] == "Running", (component, pod["status"])
            assert pod["spec"].get("serviceAccountName", "default") == account
    assert len(release.pods("worker")) == 2
    notes = release.helm("get", "notes", release.name).stdout
    assert f"kubectl -n {release.namespace} get dm" in notes and "Qwen/Qwen3-0.6B" in notes


def test_dynamo_manifest_verbatim_and_hf_adapter_answer_through_the_router(release: Release) -> None:
    release.apply(DYNAMO_EXAMPLE)
    release.apply(HF_EXAMPLE)
    dm = release.wait_ready("my-lora", total=2)  # unset replicas = the chart's default (2)
    assert all(e["ready"] and e["address"].endswith(":9090") for e in dm["status"]["endpoints"])
    hf = release.wait_ready("support-lora", total=1)
    resolved = hf["status"]["resolvedUri"]
    assert resolved.startswith("s3://lorafleet/") and "lorafleet-demo/support-lora/" in resolved, resolved
    assert hf["status"].get("syncJob")
    names = {"my-custom-lora", "support-adapter", BASE_MODEL}
    wait_for(lambda: names <= release.models(), 60, "the router to list both adapters")  # its watch may lag
    base = release.complete(BASE_MODEL)
    dynamo, synced = release.complete("my-custom-lora"), release.complete("support-adapter")
    assert base and dynamo and synced
    assert dynamo != base and synced != base and dynamo != synced, (base, dynamo, synced)
    # An unknown model is a clean OpenAI-style 404 from the router.
    with pytest.raises(httpx.HTTPStatusError) as err:
        release.complete("no-such-adapter")
    assert err.value.response.status_code == 404


def test_inference_needs_the_api_key_probes_and_metrics_do_not(release: Release) -> None:
    """auth.apiKey on a cluster: the router and a worker pod answer /v1/* without the key with OpenAI's 401
    shape and serve it with the key; health, readiness and metrics stay open; the key is never logged."""
    key = release.api_key()
    assert key and len(key) == 48, "the operator generated the key once"
    router, body = release.router_url(), {"model": BASE_MODEL, "prompt": "x", "max_tokens": 1}
    refused = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 401 and set(refused.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{router}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{router}{path}", timeout=30).status_code == 200, path
    with release.pod_port(release.pods("worker")[0], 8000) as worker:
        assert httpx.get(f"{worker}/v1/models", timeout=30).status_code == 401
        assert httpx.get(f"{worker}/v1/models", headers=release.inference_headers(), timeout=30).status_code == 200
        assert httpx.get(f"{worker}/metrics", timeout=30).status_code == 200
    assert key not in release.operator_log()


def test_the_workers_network_policy_is_in_place(release: Release) -> None:
    """The chart's NetworkPolicy for the workers is accepted by the API server and the fleet serves with it in
    place. Here it is not enforced (the node agent runs pods as processes; single-node kind's ptp CNI has no
    policy agent); that a pod outside its peers is refused is proven on the multi-node kind cluster, whose
    kube-router enforces policies (test_kind_multinode.py, `make e2e-kind-multinode`)."""
    path = f"/apis/networking.k8s.io/v1/namespaces/{release.namespace}/networkpolicies/{release.fullname}-worker"
    policy = release.cluster.get(path)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert sorted(p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]) == [8000, 9090]


def placed(release: Release, name: str) -> set[str]:
    return {e["podName"] for e in release.model(name)["status"]["endpoints"]}


def test_every_lorafleet_container_ran_as_the_node_runtime_says(release: Release) -> None:
    """`make e2e-images` (podman mode): operator, router, workers, sync Job and bucket helper ran from the
    built images; in process mode they ran as local programs. MinIO's server is always a local program
    there. On kind (`make e2e-kind`) every container, MinIO's too, ran in the node's containerd."""
    pods = release.cluster.get(f"/api/v1/namespaces/{release.namespace}/pods")["items"]
    seen: dict[str, set[str]] = {}
    for pod in pods:
        for status in pod["status"].get("initContainerStatuses", []) + pod["status"].get("containerStatuses", []):
            ran = status.get("containerID") or status.get("lastState", {}).get("terminated", {}).get("containerID")
            ran = ran or status.get("state", {}).get("terminated", {}).get("containerID", "")
            seen.setdefault(status["image"], set()).add(ran.split("://")[0])
    lorafleet_images = {image for image in seen if "lorafleet/" in image and "/minio" not in image}
    assert {i.split(":")[0].removeprefix("docker.io/") for i in lorafleet_images} == {
        "lorafleet/operator",
        "lorafleet/worker",
    }, seen
    if not release.cluster.is_local:
        assert all(runtimes == {"containerd"} for runtimes in seen.values()), seen
        return
    want = "podman" if podman.enabled() else "local"
    for image in lorafleet_images:
        assert seen[image] == {want}, (image, seen[image])
    assert all(seen[image] == {"local"} for image in seen if image not in lorafleet_images), seen


def test_scaling_the_workers_moves_placements(release: Release) -> None:
    release.wait_ready("my-lora", total=2)
    values = release.values

    def scale(n: int) -> dict[str, object]:
        return deep_merge(values, {"workers": [dict(values["workers"][0], replicas=n)]})

    # Ordinary change under traffic: a request during the scale-up and the scale-down never fails.
    url, auth = f"{release.router_url()}/v1/completions", release.inference_headers()
    with Load(url, "my-custom-lora", clients=2, pause=0.5, tokens=4, headers=auth) as traffic:
        release.apply_values(scale(3))
        wait_for(lambda: len(release.pods("worker")) == 3, 120, "3 worker pods")
        release.wait_ready("my-lora", total=2)
        release.apply_values(scale(1))
        (survivor,) = wait_for(lambda: (p := release.pods("worker")) and len(p) == 1 and p, 180, "1 worker pod")
        dm = release.wait_ready("my-lora", total=1)
    assert traffic.ok > 0 and not traffic.failures, (traffic.ok, traffic.failures[:5])
    assert placed(release, "my-lora") == {survivor["metadata"]["name"]}
    assert dm["status"]["endpoints"][0]["address"] == f"http://{survivor['status']['podIP']}:9090"
    # Re-placed from a pod that left, if it was there (its status may still name that pod for a moment).
    wait_for(lambda: placed(release, "support-lora") == {survivor["metadata"]["name"]}, 120, "support-lora re-placed")
    release.wait_ready("support-lora", total=1)
    assert {"my-custom-lora", "support-adapter"} <= release.worker_loras(survivor)
    assert release.complete("my-custom-lora") != release.complete(BASE_MODEL)
    release.apply_values(scale(2))
    release.wait_ready("my-lora", total=2)


def test_a_rolled_worker_is_ready_only_once_it_holds_its_adapters(release: Release) -> None:
    """The readiness gate lorafleet.dev/adapters-loaded: a rollout (maxSurge 0) stops the next old worker only
    after the new one holds what the placement gave it, so the adapter always has a ready holder."""
    release.wait_ready("my-lora", total=2)
    old = {p["metadata"]["name"] for p in release.pods("worker")}
    deployment = f"deployment/{release.fullname}-worker-qwen"
    url, auth = f"{release.router_url()}/v1/completions", release.inference_headers()
    holders = Sampler(lambda: (release.model("my-lora").get("status") or {}).get("readyEndpoints", 0))
    with Load(url, "my-custom-lora", clients=2, pause=0.5, tokens=4, headers=auth) as traffic, holders:
        release.kubectl("rollout", "restart", deployment)
        release.kubectl("rollout", "status", deployment, "--timeout=300s")
        release.wait_ready("my-lora", total=2)
    assert traffic.ok > 0 and not traffic.failures, (traffic.ok, traffic.failures[:5])
    assert holders.seen and min(holders.seen) >= 1, holders.seen
    pods = release.pods("worker")
    assert len(pods) == 2 and not old & {p["metadata"]["name"] for p in pods}, (old, pods)
    for pod in pods:
        conditions = {c["type"]: c for c in pod["status"]["conditions"]}
        gate, ready = conditions["lorafleet.dev/adapters-loaded"], conditions["Ready"]
        assert gate["status"] == ready["status"] == "True", conditions
        assert ready["lastTransitionTime"] >= gate["lastTransitionTime"], conditions
        assert "my-custom-lora" in release.worker_loras(pod)


def test_deleting_models_unloads_them(release: Release) -> None:
    release.wait_ready("my-lora")
    release.kubectl("delete", "dm", "my-lora", "support-lora", "--wait=false")
    release.wait_gone("my-lora")
    release.wait_gone("support-lora")
    gone = {"my-custom-lora", "support-adapter"}
    wait_for(
        lambda: all(not (gone & release.worker_loras(p)) for p in release.pods("worker")),
        60,
        "the adapters to be unloaded from every worker",
    )
    # Sync Jobs are owned by their DynamoModel and collected with it.
    wait_for(
        lambda: not release.cluster.get(f"/apis/batch/v1/namespaces/{release.namespace}/jobs")["items"],
        120,
        "sync Jobs garbage-collected",
    )


def test_a_removed_permission_fails_loudly(release: Release) -> None:
    """Drop `list` on pods from the operator's Role: the restarted operator reports the 403."""
    role = f"{release.fullname}-operator"
    rules = release.cluster.get(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{release.namespace}/roles/{role}")[
        "rules"
    ]
    crippled = [dict(r, verbs=[v for v in r["verbs"] if v != "list"]) if "pods" in r["resources"] else r for r in rules]
    release.kubectl("patch", "role", role, "--type=merge", "-p", json.dumps({"rules": crippled}))
    release.kubectl("delete", "pod", "-l", "app.kubernetes.io/component=operator", "--wait=false")

    def forbidden_lines() -> list[str]:
        return [
            line
            for line in release.operator_log().splitlines()
            if "pods" in line and ("forbidden" in line.lower() or "403" in line)
        ]

    lines = wait_for(forbidden_lines, 120, "the operator to log the forbidden pod list")
    assert any(release.namespace in line or "cannot list" in line for line in lines), lines
    release.apply_values(release.values, wait=False)  # helm restores the chart's Role
    restored = release.cluster.get(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{release.namespace}/roles/{role}")
    assert restored["rules"] == rules
    release.kubectl("delete", "pod", "-l", "app.kubernetes.io/component=operator", "--wait=false")
    release.apply(DYNAMO_EXAMPLE)
    release.wait_ready("my-lora")
    release.kubectl("delete", "dm", "my-lora")
    release.wait_gone("my-lora")


def chart_objects(release: Release, namespaces: list[str]) -> list[str]:
    """Every object carrying this release's instance label in `namespaces`, and cluster-wide."""
    selector = f"app.kubernetes.io/instance={release.name}"
    kinds = "deployments,replicasets,pods,services,serviceaccounts,secrets,configmaps,roles,rolebindings,jobs"
    found = []
    for ns in namespaces:
        out = release.cluster.kubectl("-n", ns, "get", kinds, "-l", selector, "-o", "name").stdout
        found += [f"{ns}/{name}" for name in out.split()]
    out = release.cluster.kubectl("get", "clusterroles,clusterrolebindings", "-l", selector, "-o", "name").stdout
    return found + out.split()


def test_upgrade_with_changed_values_then_uninstall_leaves_nothing(release: Release, cluster: TestCluster) -> None:
    """Upgrade: a second watched namespace, no workers, two routers; then uninstall."""
    extra = cluster.new_namespace("chart-extra")
    namespaces = [release.namespace, extra]
    values = deep_merge(release.values, {"rbac": {"watchNamespaces": namespaces}, "router": {"replicas": 2}})
    values["workers"] = []
    release.apply_values(values)
    objects = chart_objects(release, namespaces)
    for ns in namespaces:
        assert f"{ns}/role.rbac.authorization.k8s.io/lf-lorafleet-operator" in objects, objects
        assert f"{ns}/rolebinding.rbac.authorization.k8s.io/lf-lorafleet-router" in objects, objects
    wait_for(lambda: not release.pods("worker"), 120, "worker pods gone after removing the group")
    wait_for(lambda: len(release.pods("router")) == 2, 120, "two router pods")
    assert not any("deployment.apps/lf-lorafleet-worker" in o for o in objects)
    release.uninstall()
    wait_for(lambda: not chart_objects(release, namespaces), 120, "no objects of the release left")
    # The CRD stays (helm never deletes crds/), so users' DynamoModels survive an uninstall.
    assert cluster.exists(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{api.CRD_NAME}")
