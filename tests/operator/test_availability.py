"""Make-before-break and failed swaps, against real HTTP management servers.

The ``progress`` callback sees the status the operator publishes *while* loads run, which is
what a router reads at that moment: every published status must route the adapter somewhere
as soon as it was served once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lorafleet_operator import status as st
from lorafleet_operator.placement import place
from lorafleet_operator.resources import Model, Pod

from .conftest import MgmtWorker
from .test_reconcile import FakeSync, cond, converge, holders, lora, make, pods_for


def routable(status: dict[str, Any], holders_now: set[str]) -> set[str]:
    """Pods a router would send to: ready endpoints whose pod really holds the adapter."""
    return {e["podName"] for e in status.get("endpoints") or [] if e["ready"]} & holders_now


class Recorder:
    """A progress sink that records, for every status published mid-pass, who was routable."""

    def __init__(self, workers: list[MgmtWorker], name: str) -> None:
        self.workers, self.name = workers, name
        self.seen: list[set[str]] = []

    async def __call__(self, status: dict[str, Any]) -> None:
        self.seen.append(routable(status, holders(self.workers, self.name)))


async def passes(rec: Any, model: Model, pods: list[Pod], rec_sink: Recorder, n: int = 6) -> Model:
    """Publish ``n`` passes like the kopf layer (progress writes included); check each status routes."""
    for _ in range(n):
        result = await rec.reconcile(model, pods, progress=rec_sink)
        rec_sink.seen.append(routable(result.status, holders(rec_sink.workers, rec_sink.name)))
        model = dataclasses.replace(model, status=result.status)
    return model


async def test_moving_the_only_replica_keeps_the_old_holder_routable(mgmt_workers: list[MgmtWorker]) -> None:
    rec, events = make(mgmt_workers)
    pods = pods_for(mgmt_workers)
    name = "org/mover"
    # find a 4-pod set whose best pod is the 5th one, so adding it moves the single replica
    order = place(name, [p.name for p in pods], 5)
    first, newcomer = order[1], order[0]
    before = [p for p in pods if p.name != newcomer]
    model, result = await converge(rec, lora(name, replicas=1), before)
    assert result.status["placement"] == [first]
    sink = Recorder(mgmt_workers, name)
    model = await passes(rec, model, pods, sink)
    assert all(sink.seen), f"a published status routed {name} nowhere: {sink.seen}"
    assert sink.seen[0] == {first}  # mid-load: the new pod is not ready, the old holder still is
    assert model.status["placement"] == [newcomer] and holders(mgmt_workers, name) == {newcomer}
    assert events.reasons().count("Unloaded") == 1


async def test_scale_down_restart_and_replicas_change_always_route(mgmt_workers: list[MgmtWorker]) -> None:
    rec, _ = make(mgmt_workers)
    pods = pods_for(mgmt_workers)
    name = "org/steady"
    model, result = await converge(rec, lora(name, replicas=2), pods)
    sink = Recorder(mgmt_workers, name)
    # the first holder's pod restarts: not Ready, then Ready again and empty
    victim = result.status["placement"][0]
    index = int(victim.split("-")[1])
    down = [dataclasses.replace(p, ready=False) if p.name == victim else p for p in pods]
    model = await passes(rec, model, down, sink)
    await mgmt_workers[index].restart()
    rec.inventory.forget_pod(pods[index].uid)
    model = await passes(rec, model, pods, sink)
    # replicas 2 -> 3 -> 1, then scale down to two pods
    model = await passes(rec, dataclasses.replace(model, replicas=3, generation=2), pods, sink)
    model = await passes(rec, dataclasses.replace(model, replicas=1, generation=3), pods, sink)
    model = await passes(rec, model, pods[:2], sink)
    assert all(sink.seen), sink.seen
    assert model.status["phase"] == "Ready"
    want = set(place(name, ["worker-0", "worker-1"], 1))
    assert holders(mgmt_workers, name) == set(model.status["placement"]) == want


async def test_hot_swap_endpoints_stay_ready_while_loading(mgmt_workers: list[MgmtWorker]) -> None:
    rec, _ = make(mgmt_workers)
    pods = pods_for(mgmt_workers)
    model, _ = await converge(rec, lora(uri="s3://bucket/v1"), pods)
    seen: list[dict[str, Any]] = []

    async def progress(status: dict[str, Any]) -> None:
        seen.append(status)

    result = await rec.reconcile(dataclasses.replace(model, uri="s3://bucket/v2", generation=2), pods, progress)
    assert seen and all(e["ready"] for e in seen[0]["endpoints"]), seen
    assert cond(seen[0], "Ready")["status"] == "True"  # still routable while the swap runs
    assert result.status["phase"] == "Ready" and result.status["servedUri"] == "s3://bucket/v2"


async def test_leavers_wait_for_the_unload_grace(mgmt_workers: list[MgmtWorker]) -> None:
    rec, _ = make(mgmt_workers, unload_grace=30.0)
    pods = pods_for(mgmt_workers)
    model, result = await converge(rec, lora(replicas=3), pods)
    model = dataclasses.replace(model, replicas=1, generation=2)
    model, result = await converge(rec, model, pods)
    assert len(holders(mgmt_workers, "org/adapter-a")) == 3  # published, but routers may lag: not yet
    assert result.requeue_after is not None and 0 < result.requeue_after <= 30
    rec.unload_grace = 0.0
    await rec.reconcile(model, pods)
    assert holders(mgmt_workers, "org/adapter-a") == set(model.status["placement"])


async def test_failed_swap_keeps_serving_the_last_good_version(mgmt_workers: list[MgmtWorker]) -> None:
    rec, events = make(mgmt_workers)
    pods = pods_for(mgmt_workers)
    good = "s3://bucket/good"
    model, result = await converge(rec, lora(uri=good), pods)
    placed = result.status["placement"]
    model, result = await converge(rec, dataclasses.replace(model, uri="s3://bucket/invalid-v2", generation=2), pods)
    s = result.status
    assert s["phase"] == "Degraded" and s["servedUri"] == good and s["resolvedUri"] == "s3://bucket/invalid-v2"
    assert cond(s, "Ready")["status"] == "True"
    degraded = cond(s, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "SwapFailed"
    assert "max-lora-rank" in degraded["message"]
    assert [e["podName"] for e in s["endpoints"] if e["ready"]] == placed
    assert {w.loras.get("org/adapter-a") for w in mgmt_workers} - {None} == {good}
    assert "AdapterInvalid" in events.reasons()
    # no retry of the rejected version, by this operator or a restarted one
    posts = sum(w.posts("org/adapter-a") for w in mgmt_workers)
    await rec.reconcile(model, pods)
    fresh, _ = make(mgmt_workers)
    again = await fresh.reconcile(model, pods)
    assert st.status_patch(again.status, model.status) == {}
    assert sum(w.posts("org/adapter-a") for w in mgmt_workers) == posts
    # a holder restarts meanwhile: it gets the last good version back
    index = int(placed[0].split("-")[1])
    await mgmt_workers[index].restart()
    rec.inventory.forget_pod(pods[index].uid)
    model, result = await converge(rec, model, pods)
    assert mgmt_workers[index].loras.get("org/adapter-a") == good
    # fixing the source completes the swap
    model, result = await converge(rec, dataclasses.replace(model, uri="s3://bucket/v3", generation=3), pods)
    assert result.status["phase"] == "Ready" and cond(result.status, "Degraded")["status"] == "False"
    assert {w.loras.get("org/adapter-a") for w in mgmt_workers} - {None} == {"s3://bucket/v3"}


async def test_failed_resync_keeps_serving_the_last_good_version(mgmt_workers: list[MgmtWorker]) -> None:
    sync = FakeSync()
    sync.state = "succeeded"
    rec, _ = make(mgmt_workers, sync=sync)
    pods = pods_for(mgmt_workers)
    model, result = await converge(rec, lora(uri="hf://org/repo@main"), pods)
    served = result.status["servedUri"]
    sync.state = "running"  # a new source (or a moved branch) syncs: keep serving meanwhile
    model = dataclasses.replace(model, uri="hf://org/repo@v2", generation=2)
    model, result = await converge(rec, model, pods)
    assert result.status["phase"] == "Syncing" and cond(result.status, "Ready")["status"] == "True"
    assert result.status["readyEndpoints"] == 2
    sync.state = "failed"
    model, result = await converge(rec, model, pods)
    s = result.status
    assert s["phase"] == "Degraded" and cond(s, "Ready")["status"] == "True"
    assert cond(s, "Degraded")["reason"] == "SwapFailed" and cond(s, "Synced")["reason"] == "SyncFailed"
    assert s["servedUri"] == served and s["readyEndpoints"] == 2
    assert {w.loras.get("org/adapter-a") for w in mgmt_workers} - {None} == {served}
