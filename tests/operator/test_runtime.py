"""The operator runtime (index, name ownership, drift pass, ledger) against real HTTP management servers.

DynamoModel and Pod bodies go through the same entry points the kopf handlers call; status
patches are applied to in-memory objects and fed back as watch events.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from lorafleet_operator import api
from lorafleet_operator.controller import Runtime
from lorafleet_operator.ledger import MemoryLedger
from lorafleet_operator.placement import place
from lorafleet_operator.reconcile import Reconciler
from lorafleet_operator.resources import Model
from lorafleet_operator.settings import OperatorSettings
from lorafleet_operator.workers import WorkerClient

from .conftest import BASE, Cluster, MgmtWorker, pod_body, requeue_every_model


def ready_reason(status: dict[str, Any]) -> tuple[str | None, str | None]:
    ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
    return ready.get("status"), ready.get("reason")


async def test_oldest_owns_a_name_the_other_conflicts_and_nothing_flaps(cluster: Cluster) -> None:
    cluster.apply("first", "shared/name", "s3://bucket/one")
    cluster.apply("second", "shared/name", "s3://bucket/two")  # Dynamo's two examples do this
    cluster.apply("third", "shared/name", "s3://bucket/three", ns="other")  # the scope is every watched namespace
    await cluster.settle()
    assert cluster.status("first")["phase"] == "Ready"
    for name, ns in (("second", "ns"), ("third", "other")):
        assert ready_reason(cluster.status(name, ns)) == ("False", "ModelNameConflict")
        ready = next(c for c in cluster.status(name, ns)["conditions"] if c["type"] == "Ready")
        assert "ns/first" in ready["message"]
    assert {w.loras.get("shared/name") for w in cluster.workers} - {None} == {"s3://bucket/one"}
    posts = cluster.posts()
    for _ in range(4):  # several drift intervals: no load, no status change
        cluster.runtime.inventory.invalidate_listings()
        await cluster.runtime.drift()
        requeue_every_model(cluster.runtime)
        await cluster.settle()
    assert cluster.posts() == posts
    # deleting the owner hands the name over, without unloading it in between
    unloads = sum(1 for w in cluster.workers for m, _ in w.calls if m == "DELETE")
    await cluster.delete("first")
    await cluster.settle()
    assert cluster.status("second")["phase"] == "Ready"
    assert ready_reason(cluster.status("third", "other")) == ("False", "ModelNameConflict")
    assert sum(1 for w in cluster.workers for m, _ in w.calls if m == "DELETE") == unloads
    assert {w.loras.get("shared/name") for w in cluster.workers} - {None} == {"s3://bucket/two"}


async def test_deleting_a_conflicting_model_leaves_the_owner_loaded(cluster: Cluster) -> None:
    cluster.apply("owner", "org/x")
    cluster.apply("late", "org/x")
    await cluster.settle()
    await cluster.delete("late")
    await cluster.settle()
    assert cluster.holders("org/x") == set(cluster.status("owner")["placement"])


async def test_rename_unloads_the_old_name(cluster: Cluster) -> None:
    cluster.apply("m", "org/old")
    await cluster.settle()
    old_holders = cluster.holders("org/old")
    assert len(old_holders) == 2
    cluster.apply("m", "org/new")
    await cluster.settle()
    assert cluster.status("m")["phase"] == "Ready" and len(cluster.holders("org/new")) == 2
    await cluster.runtime.drift()
    assert cluster.holders("org/old") == set()
    await cluster.runtime.drift()  # nothing holds it any more: crossed out of the ledger
    model = cluster.runtime.index.get(("ns", "m"))
    assert model is not None
    base_hash = model.base_hash
    assert "org/old" not in await cluster.runtime.reconciler.ledger.names("ns", base_hash)


async def test_orphans_are_unloaded_and_hand_loaded_adapters_left_alone(cluster: Cluster) -> None:
    cluster.apply("gone", "org/gone")
    cluster.apply("kept", "org/kept")
    await cluster.settle()
    cluster.workers[0].loras["by-hand/adapter"] = "s3://elsewhere/x"  # loaded by someone else
    # the DynamoModel vanishes while the operator is down (finalizer removed by hand): no finalize
    body = cluster.objects.pop(("ns", "gone"))
    cluster.runtime.on_model("DELETED", body)
    await cluster.runtime.drift()
    assert cluster.holders("org/gone") == set()
    assert cluster.holders("org/kept") == set(place("org/kept", [f"worker-{i}" for i in range(5)], 2))
    assert cluster.workers[0].loras["by-hand/adapter"] == "s3://elsewhere/x"


async def test_drift_requeues_only_the_model_that_lost_its_adapter(cluster: Cluster) -> None:
    for i in range(6):
        cluster.apply(f"m{i}", f"org/m{i}")
    await cluster.settle()
    victim = cluster.status("m3")["placement"][0]
    worker = cluster.workers[int(victim.split("-")[1])]
    del worker.loras["org/m3"]  # lost (e.g. evicted by hand)
    posts = cluster.posts()
    await cluster.runtime.drift()
    await cluster.settle()
    assert worker.loras.get("org/m3") == "s3://bucket/a"
    assert cluster.posts() == posts + 1
    gets = [sum(1 for m, _ in w.calls if m == "GET") for w in cluster.workers]
    await cluster.runtime.drift()
    await cluster.settle()
    assert [sum(1 for m, _ in w.calls if m == "GET") for w in cluster.workers] == [g + 1 for g in gets]
    assert cluster.posts() == posts + 1


async def test_pod_events_requeue_only_models_whose_placement_changes(cluster: Cluster) -> None:
    names = [f"org/p{i}" for i in range(30)]
    for i, n in enumerate(names):
        cluster.apply(f"p{i}", n)
    cluster.runtime.on_pod("DELETED", pod_body("worker-4", cluster.workers[4].host, True, BASE))
    await cluster.settle()
    four = [f"worker-{i}" for i in range(4)]
    queued: list[tuple[str, str]] = []
    add = cluster.runtime.queue.add
    cluster.runtime.queue.add = lambda key: (queued.append(key), add(key))[1]  # type: ignore[method-assign]
    cluster.runtime.on_pod("ADDED", pod_body("worker-4", cluster.workers[4].host, True, BASE))
    five = [*four, "worker-4"]
    moved = {f"p{i}" for i, n in enumerate(names) if place(n, five, 2) != place(n, four, 2)}
    assert moved and {k[1] for k in queued} == moved
    await cluster.settle()
    for i, n in enumerate(names):
        assert cluster.status(f"p{i}")["placement"] == place(n, five, 2)


async def test_a_new_model_costs_one_pass_and_new_names_are_claimed_in_bulk(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold start's unit of work: one reconcile pass per new model (its status write needs no
    follow-up pass when nothing waits for it), and the ledger claims of many new models in one
    write ahead of their loads."""
    reconciler, ledger = cluster.runtime.reconciler, cluster.runtime.reconciler.ledger
    passes: list[str] = []
    bulk: list[set[str]] = []
    reconcile, claim_many = reconciler.reconcile, ledger.claim_many

    async def counted(model: Model, *args: Any, **kw: Any) -> Any:
        passes.append(model.name)
        return await reconcile(model, *args, **kw)

    async def spied(namespace: str, base_hash: str, names: Any) -> None:
        bulk.append(set(names))
        await claim_many(namespace, base_hash, names)

    monkeypatch.setattr(reconciler, "reconcile", counted)
    monkeypatch.setattr(ledger, "claim_many", spied)
    for i in range(8):
        cluster.apply(f"n{i}", f"org/n{i}")
    await cluster.settle()
    assert all(cluster.status(f"n{i}")["phase"] == "Ready" for i in range(8))
    assert sorted(passes) == [f"n{i}" for i in range(8)], "one pass per new model, no follow-up pass"
    assert bulk == [{f"org/n{i}" for i in range(8)}]
    # a move still gets its follow-up pass: the leaver is unloaded once the new placement is published
    cluster.runtime.on_pod("DELETED", pod_body("worker-4", cluster.workers[4].host, True, BASE))
    await cluster.settle()
    cluster.runtime.on_pod("ADDED", pod_body("worker-4", cluster.workers[4].host, True, BASE))
    await cluster.settle()
    for i in range(8):
        assert cluster.holders(f"org/n{i}") == set(cluster.status(f"n{i}")["placement"])


def test_router_keeps_a_handed_over_name_routable_through_the_deleted_owner() -> None:
    from lorafleet_router.router import RoutingTable

    table = RoutingTable(inference_port=8000)
    owner = {
        "metadata": {
            "name": "old",
            "namespace": "ns",
            "creationTimestamp": "2026-01-01T00:00:01Z",
            "deletionTimestamp": "2026-01-01T01:00:00Z",
        },
        "spec": {"modelName": "org/x", "baseModelName": BASE, "modelType": "lora"},
        "status": {"endpoints": [{"address": "http://127.0.0.9:9090", "podName": "w", "ready": True}]},
    }
    successor = {"metadata": {"name": "new", "namespace": "ns", "creationTimestamp": "2026-01-01T00:00:02Z"},
                 "spec": {"modelName": "org/x", "baseModelName": BASE, "modelType": "lora"},
                 "status": {"phase": "Failed"}}  # fmt: skip
    table.on_model("MODIFIED", owner)
    table.on_model("MODIFIED", successor)
    table.on_pod("ADDED", pod_body("w", "127.0.0.9", True, BASE))
    assert table.resolve("org/x") == ("adapter", ["http://127.0.0.9:8000"])  # until "new" publishes its own


async def test_own_watch_puts_one_finalizer_and_releases_it_after_unloading(
    mgmt_workers: list[MgmtWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a real API server: the runtime's DynamoModel watch (not kopf) adds
    ``nvidia.com/finalizer`` once, writes nothing else to the object but its status, and on
    deletion unloads the adapter before it removes the finalizer."""
    from lorafleet_devcluster.rawstack import install_crd
    from lorafleet_devcluster.session import shared_cluster
    from lorafleet_operator.api import FINALIZER
    from lorafleet_operator.controller import kube_status_writer
    from lorafleet_operator.kube import KubeClient

    with shared_cluster() as kcluster:
        install_crd(kcluster)
        ns = kcluster.new_namespace("own-watch")
        monkeypatch.setenv("KUBECONFIG", str(kcluster.kubeconfig))
        kube = KubeClient.from_environment()
        settings = OperatorSettings(namespaces=(ns,), default_replicas=2, reconcile_workers=2, drift_interval=3600)
        client = WorkerClient(call_timeout=2, load_timeout=5, backoff=0.01)
        reconciler = Reconciler(client, management_port=mgmt_workers[0].port, ledger=MemoryLedger(), unload_grace=0)
        runtime = Runtime(settings, reconciler, kube_status_writer(kube), kube)
        for i, w in enumerate(mgmt_workers):
            runtime.on_pod("ADDED", pod_body(f"worker-{i}", w.host, True, BASE, namespace=ns))
        runtime.start()
        runtime.watch_models()
        path = api.models_path(ns)
        body = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "fin"},
                "spec": {"modelName": "own/fin", "baseModelName": BASE, "modelType": "lora",
                         "source": {"uri": "s3://bucket/fin"}}}  # fmt: skip
        try:
            kcluster.kube.post(path, body)
            placed = set(place("own/fin", [f"worker-{j}" for j in range(5)], 2))

            async def until(check: Any, what: str) -> None:
                deadline = time.monotonic() + 30
                while not check():
                    assert time.monotonic() < deadline, what
                    await asyncio.sleep(0.05)

            def obj() -> dict[str, Any]:
                return kcluster.get(f"{path}/fin")

            await until(lambda: (obj().get("status") or {}).get("phase") == "Ready", "Ready")
            meta = obj()["metadata"]
            assert meta["finalizers"] == [FINALIZER]
            assert not meta.get("annotations"), "no kopf progress or diff-base annotations"
            holders = {f"worker-{i}" for i, w in enumerate(mgmt_workers) if "own/fin" in w.loras}
            assert holders == placed
            await until(runtime.idle, "runtime idle")
            kcluster.kubectl("delete", "dynamomodel", "fin", "-n", ns, "--wait=false")
            await until(lambda: not kcluster.exists(f"{path}/fin"), "object released and gone")
            assert not any("own/fin" in w.loras for w in mgmt_workers), "unloaded before the finalizer went"
            assert sum(1 for w in mgmt_workers for m, n in w.calls if (m, n) == ("DELETE", "own/fin")) == 2
        finally:
            await runtime.stop()
            await kube.close()
            kcluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
