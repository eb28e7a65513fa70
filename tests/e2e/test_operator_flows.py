"""The operator and router on the local control plane, with real workers as pods.

One stack per module, built from plain manifests (not the chart): the CRD, a worker Deployment
(`lorafleet/worker:dev`, tiny llama), the operator and the router as pods (`lorafleet/operator:dev`)
with their own ServiceAccounts and least-privilege Roles, a MinIO for s3:// sources and sync
Jobs, and a local Hugging Face hub. The tests run in file order; each leaves the stack usable.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet_devcluster.cluster import wait_until
from lorafleet_devcluster.hfhub import LocalHub
from lorafleet_devcluster.minio import MinioServer
from lorafleet_devcluster.rawstack import (
    BASE,
    BUCKET,
    PROMPT,
    READY_S,
    RawStack,
    deployment,
    env_var,
    install_crd,
    pod_ready,
    rbac,
    worker_deployment,
)
from lorafleet_devcluster.session import TestCluster
from lorafleet_operator.ledger import CONFIGMAP as LEDGER
from lorafleet_operator.placement import place
from lorafleet_sync.ids import BASE_MODEL_HASH_LABEL, base_model_hash


@dataclass
class Stack(RawStack):
    """The module's stack plus the object store, the hub and the adapters its tests load."""

    minio: MinioServer
    hub: LocalHub
    adapters: dict[str, Path]
    hf_sha: str


@pytest.fixture(scope="module")
def stack(
    cluster: TestCluster, tiny_models: Any, tiny_adapter_factory: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    install_crd(cluster)
    model_dir = tiny_models["llama"]
    adapters = {
        "a": tiny_adapter_factory(model_dir, rank=4, seed=101, strength=2.0),
        "b": tiny_adapter_factory(model_dir, rank=4, seed=102, strength=2.0),
        "hf": tiny_adapter_factory(model_dir, rank=4, seed=103, strength=2.0),
        "bad": tiny_adapter_factory(model_dir, rank=32, seed=104),
    }
    root = tmp_path_factory.mktemp("op-e2e")
    minio = MinioServer(root / "minio").start()
    minio.make_bucket(BUCKET)
    minio.upload_dir(BUCKET, "adapters/a", adapters["a"])
    minio.upload_dir(BUCKET, "adapters/b", adapters["b"])
    hub = LocalHub(root / "hub").start()
    sha = hub.commit("org/hf-lora", adapters["hf"])
    ns = cluster.new_namespace("op")
    stack = Stack(cluster, ns, minio, hub, adapters, sha)
    store_env = [
        env_var("AWS_ENDPOINT_URL_S3", minio.url),
        env_var("AWS_ALLOW_HTTP", "true"),
        env_var("AWS_REGION", "us-east-1"),
        env_var("AWS_ACCESS_KEY_ID", secret="store-creds"),
        env_var("AWS_SECRET_ACCESS_KEY", secret="store-creds"),
    ]
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "store-creds"},
        "stringData": {"AWS_ACCESS_KEY_ID": minio.access_key, "AWS_SECRET_ACCESS_KEY": minio.secret_key},
    }
    workers = worker_deployment(
        str(model_dir),
        BASE,
        {BASE_MODEL_HASH_LABEL: base_model_hash(BASE)},
        ["--max-cpu-loras", "128"],
        [env_var("LORAFLEET_FILE_ROOTS", str(adapters["a"].parent)), *store_env],
    )
    operator = deployment(
        "operator",
        "lorafleet/operator:dev",
        [
            "lorafleet-operator",
            "--namespace",
            ns,
            "--bind-host",
            "$(POD_IP)",
            "--drift-interval",
            "5",
            "--store-bucket",
            BUCKET,
            "--store-prefix",
            "synced",
            "--store-endpoint",
            minio.url,
            "--store-secret",
            "store-creds",
            "--hf-endpoint",
            hub.url,
            "--sync-image",
            "lorafleet/operator:dev",
            "--retry-max",
            "5",
            "--call-timeout",
            "5",
            "--delete-timeout",
            "10",
        ],
        sa="lorafleet-operator",
        probe={"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 2},
    )
    router = deployment(
        "router",
        "lorafleet/operator:dev",
        ["lorafleet-router", "--namespace", ns, "--bind-host", "$(POD_IP)", "--router-port", "8000"],
        sa="lorafleet-router",
        probe={"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
    )
    stack.apply(secret, *rbac("lorafleet-operator", "operator"), *rbac("lorafleet-router", "router"))
    stack.apply(workers, operator, router)
    try:
        for app in ("operator", "router"):
            wait_until(partial(_any_ready, stack, app), 180, f"{app} pod Ready")
        wait_until(lambda: len(stack.ready_workers()) == 3, READY_S, "3 Ready workers")
        yield stack
    except BaseException:
        for app in ("operator", "router"):
            for p in stack.pods(app):
                print(f"--- {p['metadata']['name']}\n{cluster.logs(ns, p['metadata']['name'])[-4000:]}")
        raise
    finally:
        cluster.kubectl("delete", "dynamomodels", "--all", "-n", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        hub.stop()
        minio.close()


def _any_ready(stack: Stack, app: str) -> bool:
    return any(pod_ready(p) for p in stack.pods(app))


class Traffic:
    """Requests for Ready adapters through the router in a background thread; counts failures."""

    def __init__(self, stack: Stack, models: list[str]) -> None:
        self.stack, self.models = stack, models
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        router = self.stack.router
        with httpx.Client(timeout=60) as http:
            while not self._stop.is_set():
                for model in self.models:
                    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
                    try:
                        r = http.post(f"{router}/v1/completions", json=body)
                        if r.status_code == 200:
                            self.ok += 1
                        else:
                            self.failures.append(f"{model}: {r.status_code} {r.text[:200]}")
                    except httpx.HTTPError as e:
                        self.failures.append(f"{model}: {e!r}")

    def __enter__(self) -> Traffic:
        self._thread.start()
        # the change under test starts only once traffic flows: a quick change (a hot swap of a tiny
        # adapter) could otherwise finish before the first answer and the test would count nothing
        wait_until(lambda: self.ok or self.failures, 120, "a first answer through the router")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)


def phase_reason(obj: dict) -> tuple[str | None, str | None]:
    st = obj.get("status") or {}
    ready: dict[str, Any] = next((c for c in st.get("conditions", []) if c["type"] == "Ready"), {})
    return st.get("phase"), ready.get("reason")


SOURCES = ("src-s3", "src-file", "src-hf")


def test_sources_reach_ready_and_answer_through_router(stack: Stack) -> None:
    stack.apply(
        stack.dm_doc("base", BASE, "s3://unused/x") | {"spec": {"modelName": BASE, "baseModelName": BASE}},
        stack.dm_doc("src-s3", "org/s3-lora", f"s3://{BUCKET}/adapters/a"),
        stack.dm_doc("src-file", "org/file-lora", f"file://{stack.adapters['b']}"),
        stack.dm_doc("src-hf", "org/hf-lora", "hf://org/hf-lora@main"),
    )
    stack.wait_converged(list(SOURCES), timeout=600)
    hf = stack.dm("src-hf")["status"]
    assert hf["revision"] == stack.hf_sha
    assert hf["resolvedUri"] == f"s3://{BUCKET}/synced/org/hf-lora/{stack.hf_sha}"
    synced = next(c for c in hf["conditions"] if c["type"] == "Synced")
    assert synced["status"] == "True" and synced["reason"] == "SyncSucceeded"
    jobs = stack.cluster.get(f"/apis/batch/v1/namespaces/{stack.ns}/jobs")["items"]
    assert [j["metadata"]["name"] for j in jobs] == [hf["syncJob"]]
    assert jobs[0]["metadata"]["ownerReferences"][0]["uid"] == stack.dm("src-hf")["metadata"]["uid"]
    for name in SOURCES:
        st = stack.dm(name)["status"]
        assert st["totalEndpoints"] == st["readyEndpoints"] == 2
        assert all(c["observedGeneration"] == 1 for c in st["conditions"])
        assert all(e["address"].endswith(":9090") for e in st["endpoints"])
    answers = {m: stack.text(m) for m in (BASE, "org/s3-lora", "org/file-lora", "org/hf-lora")}
    assert len(set(answers.values())) == 4, answers
    listed = {m["id"] for m in stack.http.get(f"{stack.router}/v1/models").json()["data"]}
    assert {BASE, "org/s3-lora", "org/file-lora", "org/hf-lora"} <= listed
    unknown = stack.complete("org/unknown")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    events = stack.cluster.get(f"/api/v1/namespaces/{stack.ns}/events")["items"]
    reasons = {e["reason"] for e in events if e["involvedObject"].get("kind") == "DynamoModel"}
    assert {"Loaded", "SyncSucceeded"} <= reasons, reasons


def test_invalid_adapter_fails_while_others_keep_serving(stack: Stack) -> None:
    stack.apply(stack.dm_doc("bad", "org/bad-lora", f"file://{stack.adapters['bad']}"))
    obj = wait_until(lambda: (o := stack.dm("bad")) and phase_reason(o)[0] == "Failed" and o, 180, "bad Failed")
    assert phase_reason(obj) == ("Failed", "AdapterInvalid")
    message = next(c["message"] for c in obj["status"]["conditions"] if c["type"] == "Ready")
    assert "rank" in message.lower(), message
    assert stack.complete("org/s3-lora").status_code == 200
    assert all("org/bad-lora" not in stack.loras(ip) for ip in stack.ready_workers().values())


def test_source_change_hot_swaps_everywhere(stack: Stack) -> None:
    before, other = stack.text("org/s3-lora"), stack.text("org/file-lora")
    with Traffic(stack, ["org/s3-lora"]) as traffic:
        _swap_s3_lora(stack)
    assert traffic.ok > 0 and not traffic.failures, traffic.failures[:5]
    after = stack.text("org/s3-lora")
    assert after != before and after == other  # same adapter files as src-file now
    assert stack.dm("src-s3")["status"]["resolvedUri"] == f"file://{stack.adapters['b']}"


def _swap_s3_lora(stack: Stack) -> None:
    stack.cluster.kubectl(
        "patch",
        "dm",
        "src-s3",
        "-n",
        stack.ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"source": {"uri": f"file://{stack.adapters['b']}"}}}),
    )
    wait_until(
        lambda: (
            (st := stack.dm("src-s3").get("status") or {}).get("observedGeneration") == 2 and st.get("phase") == "Ready"
        ),
        180,
        "hot swap",
    )


def test_scale_up_to_5_moves_only_what_hrw_requires(stack: Stack) -> None:
    old_fleet = set(stack.ready_workers())
    old = {n: stack.dm(n)["status"]["placement"] for n in SOURCES}
    with Traffic(stack, ["org/file-lora", "org/hf-lora"]) as traffic:
        workers = stack.scale(5)
        stack.wait_converged(timeout=300)
    assert not traffic.failures, traffic.failures[:5]
    assert traffic.ok > 0
    new_pods = set(workers) - old_fleet
    for name in SOURCES:
        new = stack.dm(name)["status"]["placement"]
        assert new == place(stack.dm(name)["spec"]["modelName"], workers, 2)
        # HRW: a model only moves onto pods new to the fleet; the old pods it keeps stay
        assert set(new) - set(old[name]) <= new_pods, (name, old[name], new)
        assert len(set(old[name]) - set(new)) == len(set(new) - set(old[name]))


def test_deleted_worker_pod_is_replaced_and_gets_back_its_share(stack: Stack) -> None:
    placed = stack.dm("src-hf")["status"]["placement"]
    victim = placed[0]
    with Traffic(stack, ["org/hf-lora"]) as traffic:  # the other holder serves throughout
        stack.cluster.kubectl("delete", "pod", victim, "-n", stack.ns, "--wait=false")
        wait_until(
            lambda: victim not in stack.ready_workers() and len(stack.ready_workers()) == 5,
            READY_S,
            "replacement worker Ready",
        )
        stack.wait_converged(timeout=300)
    assert traffic.ok > 0 and not traffic.failures, traffic.failures[:5]
    workers = stack.ready_workers()
    for ip_name, ip in workers.items():
        expected = {
            o["spec"]["modelName"]
            for o in stack.dms().values()
            if o["spec"]["modelType"] == "lora" and ip_name in (o.get("status") or {}).get("placement", [])
        }
        assert stack.loras(ip) == expected, ip_name


def test_200_models_over_5_workers_all_ready(stack: Stack) -> None:
    docs = [
        stack.dm_doc(f"bulk-{i:03d}", f"bulk/lora-{i:03d}", f"file://{stack.adapters['a']}", labels={"group": "bulk"})
        for i in range(200)
    ]
    started = time.monotonic()
    stack.apply(*docs)
    wait_until(
        lambda: sum(phase_reason(o)[0] == "Ready" for o in stack.dms("group=bulk").values()) == 200,
        900,
        "200 models Ready",
        interval=1,
    )
    took = time.monotonic() - started
    stack.wait_converged(timeout=120)
    print(f"\n200 DynamoModels over 5 workers: all Ready in {took:.1f}s")
    started = time.monotonic()
    stack.cluster.kubectl("delete", "dm", "-n", stack.ns, "-l", "group=bulk", "--wait=false")
    wait_until(lambda: not stack.dms("group=bulk"), 600, "bulk models deleted", interval=1)
    print(f"200 DynamoModels deleted (unloaded) in {time.monotonic() - started:.1f}s")
    for ip in stack.ready_workers().values():
        assert not {n for n in stack.loras(ip) if n.startswith("bulk/")}


def test_operator_restart_mid_reconcile_converges_without_duplicates(stack: Stack) -> None:
    loads_before = stack.loads()
    docs = [
        stack.dm_doc(f"restart-{i:02d}", f"restart/lora-{i:02d}", f"file://{stack.adapters['a']}") for i in range(30)
    ]
    docs += [stack.dm_doc("restart-hf", "restart/hf-lora", "hf://org/hf-lora@main")]
    stack.apply(*docs)
    wait_until(
        lambda: (
            sum(
                phase_reason(o)[0] == "Ready"
                for o in stack.dms().values()
                if o["metadata"]["name"].startswith("restart-")
            )
            >= 3
        ),
        300,
        "a few Ready",
    )
    (old_pod,) = [p["metadata"]["name"] for p in stack.pods("operator")]
    stack.cluster.kubectl("delete", "pod", old_pod, "-n", stack.ns, "--grace-period=0", "--force")
    wait_until(
        lambda: any(pod_ready(p) and p["metadata"]["name"] != old_pod for p in stack.pods("operator")),
        180,
        "new operator pod",
    )
    names = [d["metadata"]["name"] for d in docs]
    stack.wait_converged(names, timeout=600)
    jobs = stack.cluster.get(f"/apis/batch/v1/namespaces/{stack.ns}/jobs")["items"]
    owners = [j["metadata"]["ownerReferences"][0]["name"] for j in jobs]
    assert sorted(owners) == ["restart-hf", "src-hf"], owners
    assert stack.loads() - loads_before == 2 * len(docs)  # each (model, pod) loaded exactly once


def test_delete_model_also_when_a_placed_pod_vanished(stack: Stack) -> None:
    stack.apply(stack.dm_doc("vanish", "org/vanish-lora", f"s3://{BUCKET}/adapters/a"))
    stack.wait_converged(["vanish"], timeout=180)
    placed = stack.dm("vanish")["status"]["placement"]
    survivor_ip = stack.ready_workers()[placed[1]]
    stack.cluster.kubectl("delete", "pod", placed[0], "-n", stack.ns, "--grace-period=0", "--force")
    stack.cluster.kubectl("delete", "dm", "vanish", "-n", stack.ns, "--wait=false")
    wait_until(lambda: "vanish" not in stack.dms(), 60, "DynamoModel gone")
    assert "org/vanish-lora" not in stack.loras(survivor_ip)
    wait_until(lambda: len(stack.ready_workers()) == 5, READY_S, "replacement worker")


def test_scale_down_to_2_unloads_leavers_without_failed_requests(stack: Stack) -> None:
    stack.wait_converged(timeout=300)
    with Traffic(stack, ["org/file-lora", "org/hf-lora", "org/s3-lora"]) as traffic:
        workers = stack.scale(2)
        stack.wait_converged(timeout=300)
    assert traffic.ok > 0
    assert not traffic.failures, traffic.failures[:5]
    for name in SOURCES:
        assert sorted(stack.dm(name)["status"]["placement"]) == sorted(workers)


def test_deleting_a_model_unloads_it(stack: Stack) -> None:
    ips = list(stack.ready_workers().values())
    stack.cluster.kubectl("delete", "dm", "src-file", "-n", stack.ns, "--timeout=60s")
    assert all("org/file-lora" not in stack.loras(ip) for ip in ips)
    wait_until(lambda: stack.complete("org/file-lora").status_code == 404, 30, "router forgot the model")


def _patch(stack: Stack, name: str, spec: dict, version: str = "v1alpha1") -> None:
    stack.cluster.kubectl("patch", f"dynamomodels.{version}.nvidia.com", name, "-n", stack.ns, "--type=merge",
                          "-p", json.dumps({"spec": spec}))  # fmt: skip


def _caught_up(obj: dict, phase: str) -> bool:
    status = obj.get("status") or {}
    return status.get("observedGeneration") == obj["metadata"]["generation"] and status.get("phase") == phase


def _condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def test_v1beta1_model_is_served_and_replicas_change_under_traffic(stack: Stack) -> None:
    doc = stack.dm_doc("beta", "org/beta-lora", f"s3://{BUCKET}/adapters/a", replicas=1)
    stack.apply({**doc, "apiVersion": "nvidia.com/v1beta1"})
    stack.wait_converged(["beta"], timeout=180)
    beta = stack.cluster.get(f"/apis/nvidia.com/v1beta1/namespaces/{stack.ns}/dynamomodels/beta")
    assert beta["apiVersion"] == "nvidia.com/v1beta1" and beta["status"] == stack.dm("beta")["status"]
    assert stack.text("org/beta-lora")
    with Traffic(stack, ["org/beta-lora"]) as traffic:
        for replicas in (3, 1, 2):
            _patch(stack, "beta", {"replicas": replicas}, "v1beta1")
            wait_until(lambda r=replicas: stack.dm("beta")["spec"].get("replicas") == r, 30, "patched")
            stack.wait_converged(["beta"], timeout=180)
    assert traffic.ok > 0 and not traffic.failures, traffic.failures[:5]


def test_failed_swap_keeps_serving_the_last_good_version(stack: Stack) -> None:
    before = stack.text("org/beta-lora")
    with Traffic(stack, ["org/beta-lora"]) as traffic:
        _patch(stack, "beta", {"source": {"uri": f"file://{stack.adapters['bad']}"}})
        obj = wait_until(lambda: (o := stack.dm("beta")) and _condition(o, "Degraded").get("status") == "True" and o,
                         180, "beta Degraded")  # fmt: skip
        assert _condition(obj, "Degraded")["reason"] == "SwapFailed"
        assert "rank" in _condition(obj, "Degraded")["message"].lower()
        assert _condition(obj, "Ready")["status"] == "True"
        assert obj["status"]["servedUri"] == f"s3://{BUCKET}/adapters/a"
        assert stack.text("org/beta-lora") == before
        _patch(stack, "beta", {"source": {"uri": f"file://{stack.adapters['b']}"}})  # fixing the source
        wait_until(lambda: _caught_up(stack.dm("beta"), "Ready"), 180, "swap completed")
    assert _condition(stack.dm("beta"), "Degraded")["status"] == "False"
    assert stack.text("org/beta-lora") == stack.text("org/s3-lora")  # src-s3 was swapped to adapter b too
    assert traffic.ok > 0 and not traffic.failures, traffic.failures[:5]


def test_one_owner_per_name_no_flapping_and_handover(stack: Stack) -> None:
    uri = f"s3://{BUCKET}/adapters/a"
    stack.apply(stack.dm_doc("dup-1", "org/dup", uri))
    stack.wait_converged(["dup-1"], timeout=180)
    stack.apply(stack.dm_doc("dup-2", "org/dup", uri))  # created later (or in the same second: then by name)
    obj = wait_until(lambda: (o := stack.dm("dup-2")) and phase_reason(o)[1] == "ModelNameConflict" and o,
                     60, "conflict reported")  # fmt: skip
    assert "dup-1" in _condition(obj, "Ready")["message"] and _condition(obj, "Ready")["status"] == "False"
    loads = stack.loads()
    window = time.monotonic() + 3 * 5 + 1  # three drift intervals of the operator (--drift-interval 5)
    while time.monotonic() < window:
        assert stack.loads() == loads, "a worker loaded again in a steady state"
        time.sleep(1)
    with Traffic(stack, ["org/dup"]) as traffic:
        stack.cluster.kubectl("delete", "dm", "dup-1", "-n", stack.ns, "--timeout=60s")
        stack.wait_converged(["dup-2"], timeout=120)
    assert traffic.ok > 0 and not traffic.failures, traffic.failures[:5]
    assert stack.loads() == loads  # same URI: handed over without reloading


def test_rename_and_orphans_are_unloaded_hand_loaded_ones_kept(stack: Stack) -> None:
    workers = stack.ready_workers()
    ip = next(iter(workers.values()))
    body = {"lora_name": "hand/loaded", "source": {"uri": f"file://{stack.adapters['a']}"}}
    assert stack.http.post(f"http://{ip}:9090/v1/loras", json=body).status_code == 200
    _patch(stack, "dup-2", {"modelName": "org/dup-renamed"})
    stack.wait_converged(["dup-2"], timeout=120)
    wait_until(lambda: all("org/dup" not in stack.loras(i) for i in stack.ready_workers().values()), 60,
               "old name unloaded by the drift pass")  # fmt: skip
    assert "hand/loaded" in stack.loras(ip)
    ledger = stack.cluster.get(f"/api/v1/namespaces/{stack.ns}/configmaps/{LEDGER}")
    names = set("".join(ledger["data"].values()).split())
    assert "org/dup-renamed" in names and "hand/loaded" not in names


def test_operator_and_router_logged_no_unhandled_errors(stack: Stack) -> None:
    for app in ("operator", "router"):
        for pod in stack.pods(app):
            log = stack.cluster.logs(stack.ns, pod["metadata"]["name"])
            assert log, f"no log captured for {app}"
            assert "Traceback" not in log, log[-3000:]
            # least-privilege RBAC has no cluster-scoped reads: kopf must not try (it retried each
            # 403 for ~54 s before watching anything, so the first model waited a minute)
            assert "APIForbiddenError" not in log, log[:3000]


def test_operator_liveness_and_metrics_endpoints(stack: Stack) -> None:
    (pod,) = [p for p in stack.pods("operator") if pod_ready(p)]
    ip = pod["status"]["podIP"]
    assert stack.http.get(f"http://{ip}:8080/healthz").status_code == 200
    text = stack.http.get(f"http://{ip}:9100/metrics").text
    for metric in (
        "lorafleet_operator_reconciles_total",
        "lorafleet_operator_worker_calls_total",
        "lorafleet_operator_worker_call_seconds_bucket",
        "lorafleet_operator_placement_changes_total",
    ):
        assert metric in text, metric
    router = stack.http.get(f"{stack.router}/metrics").text
    assert 'lorafleet_router_requests_total{code="200",kind="adapter"}' in router
