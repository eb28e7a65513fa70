"""The reconcile core against real HTTP management servers (no Kubernetes)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
from lorafleet_operator import status as st
from lorafleet_operator.placement import place
from lorafleet_operator.reconcile import Reconciler, Result, SyncResult
from lorafleet_operator.resources import Model, Pod
from lorafleet_operator.workers import WorkerClient
from lorafleet_sync.ids import base_model_hash
from lorafleet_sync.uris import HfURI

from .conftest import MgmtWorker

BASE = "tiny/base"


def pods_for(workers: list[MgmtWorker], ready: list[bool] | None = None) -> list[Pod]:
    ready = ready or [True] * len(workers)
    return [
        Pod("ns", f"worker-{i}", f"uid-{i}", w.host, r, base_model_hash(BASE))
        for i, (w, r) in enumerate(zip(workers, ready, strict=True))
    ]


def lora(name: str = "org/adapter-a", uri: str = "s3://bucket/a", replicas: int | None = 2, **kw: Any) -> Model:
    return Model("ns", name.replace("/", "-"), "uid-" + name, 1, name, BASE, "lora", uri, replicas, **kw)


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[str, str, str]] = []

    def __call__(self, model: Model, kind: str, reason: str, message: str) -> None:
        self.items.append((kind, reason, message))

    def reasons(self) -> list[str]:
        return [r for _, r, _ in self.items]


_clients: list[WorkerClient] = []


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _clients:
        await _clients.pop().close()


def make(workers: list[MgmtWorker], **kw: Any) -> tuple[Reconciler, Events]:
    events = Events()
    client = WorkerClient(call_timeout=2, load_timeout=5, backoff=0.01, token=kw.pop("token", None))
    _clients.append(client)
    kw.setdefault("unload_grace", 0.0)
    return Reconciler(client, management_port=workers[0].port, emit=events, **kw), events


async def converge(rec: Reconciler, model: Model, pods: list[Pod], passes: int = 5) -> tuple[Model, Result]:
    """Run passes, publishing each status like the kopf layer does, until the status is stable."""
    result = await rec.reconcile(model, pods)
    for _ in range(passes):
        if not st.status_patch(result.status, model.status):
            return model, result
        model = dataclasses.replace(model, status=result.status)
        result = await rec.reconcile(model, pods)
    raise AssertionError(f"status did not settle: {result.status}")


def cond(status: dict[str, Any], type_: str) -> Mapping[str, Any]:
    found = st.condition(status, type_)
    assert found is not None, f"no {type_} condition in {status}"
    return found


def reason(status: dict[str, Any], type_: str) -> str:
    return str(cond(status, type_)["reason"])


def holders(workers: list[MgmtWorker], name: str) -> set[str]:
    return {f"worker-{i}" for i, w in enumerate(workers) if name in w.loras}


async def test_loads_on_hrw_placement_and_is_idempotent(mgmt_workers: list[MgmtWorker]) -> None:
    rec, events = make(mgmt_workers)
    pods = pods_for(mgmt_workers)
    model, result = await converge(rec, lora(), pods)
    expected = place("org/adapter-a", [p.name for p in pods], 2)
    s = result.status
    assert s["phase"] == "Ready" and s["placement"] == expected
    assert holders(mgmt_workers, "org/adapter-a") == set(expected)
    assert s["readyEndpoints"] == s["totalEndpoints"] == 2
    assert [e["podName"] for e in s["endpoints"]] == expected
    assert all(e["address"].endswith(f":{mgmt_workers[0].port}") for e in s["endpoints"])
    assert {c["type"]: c["status"] for c in s["conditions"]} == {
        "Synced": "True",
        "EndpointsReady": "True",
        "Degraded": "False",
        "Ready": "True",
    }
    assert all(c["observedGeneration"] == 1 for c in s["conditions"])
    # one Event for the pass, naming both pods (not one POST per load)
    loaded = [m for _, r, m in events.items if r == "Loaded"]
    assert len(loaded) == 1 and all(pod in loaded[0] for pod in expected), loaded
    # further passes: no more loads, identical status (no patch)
    before = sum(w.posts("org/adapter-a") for w in mgmt_workers)
    again = await rec.reconcile(model, pods)
    assert st.status_patch(again.status, model.status) == {}
    assert sum(w.posts("org/adapter-a") for w in mgmt_workers) == before == 2


async def test_only_ready_pods_and_replicas_above_pod_count(mgmt_workers: list[MgmtWorker]) -> None:
    rec, _ = make(mgmt_workers)
    pods = pods_for(mgmt_workers, [True, False, True, False, False])
    _, result = await converge(rec, lora(replicas=4), pods)
    assert sorted(result.status["placement"]) == ["worker-0", "worker-2"]
    assert holders(mgmt_workers, "org/adapter-a") == {"worker-0", "worker-2"}


async def test_scale_moves_minimally_loads_first_then_unloads(mgmt_workers: list[MgmtWorker]) -> None:
    rec, events = make(mgmt_workers)
    names = [f"org/lora-{i}" for i in range(12)]
    all_pods = pods_for(mgmt_workers)
    three = all_pods[:3]
    models = {}
    for n in names:
        models[n], _ = await converge(rec, lora(n), three)
    posts_before = {n: sum(w.posts(n) for w in mgmt_workers) for n in names}
    for n in names:
        first = await rec.reconcile(models[n], all_pods)  # 3 -> 5 pods
        want = place(n, [p.name for p in all_pods], 2)
        assert first.status["placement"] == want
        old = set(models[n].status["placement"])
        # new holders loaded, leavers still hold it until the new status is published
        assert holders(mgmt_workers, n) == old | set(want)
        models[n], _final = await converge(rec, dataclasses.replace(models[n], status=first.status), all_pods)
        assert holders(mgmt_workers, n) == set(want)
        assert sum(w.posts(n) for w in mgmt_workers) - posts_before[n] == len(set(want) - old)
    assert "Unloaded" in events.reasons()


async def test_invalid_adapter_fails_without_retry_and_others_keep_serving(mgmt_workers: list[MgmtWorker]) -> None:
    rec, events = make(mgmt_workers)
    pods = pods_for(mgmt_workers)
    _good, _ = await converge(rec, lora("org/good"), pods)
    bad, result = await converge(rec, lora("org/bad", uri="s3://bucket/invalid-rank"), pods)
    s = result.status
    assert s["phase"] == "Failed"
    ready = st.condition(s, "Ready")
    assert ready is not None and ready["reason"] == "AdapterInvalid" and "max-lora-rank" in ready["message"]
    assert result.requeue_after is None
    assert "AdapterInvalid" in events.reasons()
    posts = sum(w.posts("org/bad") for w in mgmt_workers)
    await rec.reconcile(bad, pods)
    # a restarted operator reads the verdict from the status: still no retry
    rec2, _ = make(mgmt_workers)
    again = await rec2.reconcile(bad, pods)
    assert again.status["phase"] == "Failed"
    assert sum(w.posts("org/bad") for w in mgmt_workers) == posts
    assert len(holders(mgmt_workers, "org/good")) == 2
    # fixing the source recovers
    _fixed, result = await converge(rec, dataclasses.replace(bad, uri="s3://bucket/ok", generation=2), pods)
    assert result.status["phase"] == "Ready" and result.status["observedGeneration"] == 2


async def test_transient_failures_back_off_then_recover(mgmt_workers: list[MgmtWorker]) -> None:
    rec, events = make(mgmt_workers)
    pods = pods_for(mgmt_workers)
    for w in mgmt_workers:
        w.fail_next = 6  # twice the client's attempts: two passes fail
    model = lora()
    first = await rec.reconcile(model, pods)
    assert first.status["phase"] == "Degraded"
    assert reason(first.status, "EndpointsReady") == "LoadFailed"
    assert first.failed  # the work queue retries it with backoff (test_workqueue_backs_off_per_key)
    second = await rec.reconcile(dataclasses.replace(model, status=first.status), pods)
    assert second.failed and "LoadFailed" in events.reasons()
    for w in mgmt_workers:
        w.fail_next = 0
    _, result = await converge(rec, dataclasses.replace(model, status=second.status), pods)
    assert result.status["phase"] == "Ready" and result.requeue_after is None and not result.failed


async def test_partial_load_is_degraded(mgmt_workers: list[MgmtWorker]) -> None:
    rec, _ = make(mgmt_workers)
    pods = pods_for(mgmt_workers)
    placed = place("org/adapter-a", [p.name for p in pods], 2)
    mgmt_workers[int(placed[1].split("-")[1])].fail_next = 10
    result = await rec.reconcile(lora(), pods)
    assert result.status["phase"] == "Degraded"
    assert result.status["readyEndpoints"] == 1
    assert reason(result.status, "EndpointsReady") == "PartiallyLoaded"


async def test_drift_after_worker_restart_is_repaired(mgmt_workers: list[MgmtWorker]) -> None:
    rec, _ = make(mgmt_workers, listing_ttl=3600)
    pods = pods_for(mgmt_workers)
    model, result = await converge(rec, lora(), pods)
    victim = mgmt_workers[int(result.status["placement"][0].split("-")[1])]
    await victim.restart()
    assert "org/adapter-a" not in victim.loras
    rec.inventory.invalidate_listings()  # what the drift timer does
    await rec.reconcile(model, pods)
    assert "org/adapter-a" in victim.loras


async def test_hot_swap_on_uri_change(mgmt_workers: list[MgmtWorker]) -> None:
    rec, events = make(mgmt_workers)
    pods = pods_for(mgmt_workers)
    model, _ = await converge(rec, lora(uri="s3://bucket/v1"), pods)
    model, result = await converge(rec, dataclasses.replace(model, uri="file:///models/v2", generation=2), pods)
    assert result.status["resolvedUri"] == "file:///models/v2"
    assert {w.loras.get("org/adapter-a") for w in mgmt_workers} - {None} == {"file:///models/v2"}
    swapped = [m for _, r, m in events.items if r == "HotSwapped"]
    assert len(swapped) == 1 and all(pod in swapped[0] for pod in result.status["placement"]), swapped
    assert "file:///models/v2" in swapped[0]


async def test_restarted_operator_does_not_load_again(mgmt_workers: list[MgmtWorker]) -> None:
    rec, _ = make(mgmt_workers)
    pods = pods_for(mgmt_workers)
    model, _ = await converge(rec, lora(), pods)
    posts = sum(w.posts("org/adapter-a") for w in mgmt_workers)
    fresh, _ = make(mgmt_workers)
    result = await fresh.reconcile(model, pods)
    assert st.status_patch(result.status, model.status) == {}
    assert sum(w.posts("org/adapter-a") for w in mgmt_workers) == posts


async def test_no_workers_is_pending(mgmt_workers: list[MgmtWorker]) -> None:
    rec, _ = make(mgmt_workers)
    result = await rec.reconcile(lora(), pods_for(mgmt_workers, [False] * 5))
    assert result.status["phase"] == "Pending"
    assert reason(result.status, "Ready") == "NoWorkers"


async def test_base_model_tracks_pods(mgmt_workers: list[MgmtWorker]) -> None:
    rec, _ = make(mgmt_workers)
    base = Model("ns", "base", "uid-base", 1, BASE, BASE, "base")
    result = await rec.reconcile(base, pods_for(mgmt_workers, [True, True, False, True, True]))
    assert result.status["phase"] == "Ready"
    assert result.status["totalEndpoints"] == 5 and result.status["readyEndpoints"] == 4
    assert all(not w.calls for w in mgmt_workers)


async def test_invalid_source_uri_fails(mgmt_workers: list[MgmtWorker]) -> None:
    rec, _ = make(mgmt_workers)
    result = await rec.reconcile(lora(uri="s3://bucket/../etc"), pods_for(mgmt_workers))
    assert result.status["phase"] == "Failed"
    assert reason(result.status, "Synced") == "InvalidSource"


async def test_admin_token_is_sent(mgmt_workers: list[MgmtWorker]) -> None:
    for w in mgmt_workers:
        w.token = "s3cret"
    rec, _ = make(mgmt_workers, token="s3cret")
    _, result = await converge(rec, lora(), pods_for(mgmt_workers))
    assert result.status["phase"] == "Ready"
    rec_bad, _ = make(mgmt_workers, token="wrong")
    bad = await rec_bad.reconcile(lora("org/other"), pods_for(mgmt_workers))
    assert bad.status["phase"] == "Degraded" and "401" in cond(bad.status, "Ready")["message"]


class FakeSync:
    """A SyncBackend whose Job finishes when told to (the Job itself is tested in e2e)."""

    def __init__(self) -> None:
        self.state = "running"
        self.calls = 0

    async def ensure(self, model: Model, source: HfURI) -> SyncResult:
        self.calls += 1
        sha = "a" * 40
        resolved = f"s3://store/{source.org}/{source.repo}/{sha}" if self.state == "succeeded" else None
        return SyncResult(self.state, "lorafleet-sync-x", resolved, sha, f"Job {self.state}")


async def test_hf_source_waits_for_sync_then_loads_store_copy(mgmt_workers: list[MgmtWorker]) -> None:
    sync = FakeSync()
    rec, _ = make(mgmt_workers, sync=sync)
    pods = pods_for(mgmt_workers)
    model = lora(uri="hf://org/repo@main")
    result = await rec.reconcile(model, pods)
    assert result.status["phase"] == "Syncing" and result.requeue_after
    assert reason(result.status, "Synced") == "SyncJobRunning"
    assert result.status["syncJob"] == "lorafleet-sync-x"
    assert not any(w.loras for w in mgmt_workers)
    sync.state = "succeeded"
    _, result = await converge(rec, dataclasses.replace(model, status=result.status), pods)
    assert result.status["phase"] == "Ready"
    assert result.status["resolvedUri"] == f"s3://store/org/repo/{'a' * 40}"
    assert result.status["revision"] == "a" * 40
    assert {w.loras.get("org/adapter-a") for w in mgmt_workers} - {None} == {result.status["resolvedUri"]}
    sync.state = "failed"
    failed = await rec.reconcile(lora("org/other", uri="hf://org/missing"), pods)
    assert failed.status["phase"] == "Failed"
    assert reason(failed.status, "Synced") == "SyncFailed"


async def test_finalize_unloads_and_a_vanished_pod_does_not_block(mgmt_workers: list[MgmtWorker]) -> None:
    rec, events = make(mgmt_workers)
    pods = pods_for(mgmt_workers)
    model, result = await converge(rec, lora(replicas=3), pods)
    placed = result.status["placement"]
    gone = int(placed[0].split("-")[1])
    await mgmt_workers[gone].stop()  # pod vanished without notice: connection refused
    started = time.monotonic()
    unloaded = await rec.finalize(model, pods, timeout=5)
    assert time.monotonic() - started < 5
    assert sorted(unloaded) == sorted(placed[1:])
    assert holders(mgmt_workers, "org/adapter-a") <= {f"worker-{gone}"}
    assert "UnloadFailed" in events.reasons()
