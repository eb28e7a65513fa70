"""One owner per piece of operator state: the object index, the rate-limited
work queue and the worker inventory shared by reconcile and drift, against real HTTP management servers.

Unlike test_runtime.py, status writes here are NOT echoed back as watch events, as with the real
API server before its watch catches up: what the runtime reads must come from the write's answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from lorafleet_operator.controller import Runtime
from lorafleet_operator.index import ModelIndex
from lorafleet_operator.ledger import MemoryLedger
from lorafleet_operator.placement import takes
from lorafleet_operator.reconcile import Reconciler
from lorafleet_operator.resources import Model, Pod
from lorafleet_operator.settings import OperatorSettings
from lorafleet_operator.workers import WorkerClient
from lorafleet_operator.workqueue import WorkQueue

from .conftest import MgmtWorker, pod_body

BASE = "tiny/base"


def lora_body(name: str, model_name: str, created: str, uri: str = "s3://bucket/a") -> dict[str, Any]:
    meta = {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1, "creationTimestamp": created}
    return {
        "metadata": meta,
        "spec": {"modelName": model_name, "baseModelName": BASE, "modelType": "lora", "source": {"uri": uri}},
    }


async def test_workqueue_backs_off_per_key_and_forget_resets_it() -> None:
    q: WorkQueue[str] = WorkQueue(retry_base=0.01, retry_max=0.04)
    assert [q.add_rate_limited("a") for _ in range(4)] == [0.01, 0.02, 0.04, 0.04]  # capped
    assert q.num_requeues("a") == 4 and q.num_requeues("b") == 0
    assert q.add_rate_limited("b") == 0.01  # per key
    assert {await asyncio.wait_for(q.get(), 2), await asyncio.wait_for(q.get(), 2)} == {"a", "b"}
    q.forget("a")  # it succeeded: the next failure starts from the base again
    assert q.num_requeues("a") == 0 and q.add_rate_limited("a") == 0.01
    q.discard("a")  # the object is gone: no retry comes
    q.done("a")
    q.done("b")
    await asyncio.sleep(0.05)  # longer than the discarded timer: it must not fire
    assert len(q) == 0 and q.idle()


def test_index_keeps_one_copy_and_owner_reads_a_written_status() -> None:
    requeued: list[tuple[str, str]] = []
    index = ModelIndex(on_claim_change=requeued.append)
    old, first = index.apply(lora_body("first", "shared", "2026-01-01T00:00:01Z"))
    assert old is None and requeued == [("ns", "first")]
    index.apply(lora_body("second", "shared", "2026-01-01T00:00:02Z"))
    assert sorted(requeued) == [("ns", "first"), ("ns", "first"), ("ns", "second")]  # both claimants move
    owner = index.owner(first)
    assert owner is not None and owner.name == "first"

    written = {**lora_body("first", "shared", "2026-01-01T00:00:01Z"), "status": {"phase": "Ready"}}
    index.refresh(written)  # the answer of a status write: owner() and the next pass see it at once
    owner = index.owner(first)
    assert owner is not None and owner.status == {"phase": "Ready"}
    assert index.body(("ns", "first")) == written

    recreated = {**written, "metadata": {**written["metadata"], "uid": "another"}, "status": {"phase": "Failed"}}
    index.refresh(recreated)  # an answer about another object of that name is not this one's
    assert index.body(("ns", "first")) == written
    index.refresh(None)  # deleted meanwhile
    assert len(index) == 2

    requeued.clear()
    index.remove(("ns", "first"))  # the name goes to the next oldest claimant
    second = index.get(("ns", "second"))
    assert requeued == [("ns", "second")] and second is not None and index.owner(second) is second
    assert index.wanted("ns", second.base_hash, "shared") and not index.wanted("other", second.base_hash, "shared")


@dataclass
class Env:
    runtime: Runtime
    objects: dict[tuple[str, str], dict[str, Any]]

    def add(self, body: dict[str, Any]) -> None:
        self.objects[(body["metadata"]["namespace"], body["metadata"]["name"])] = body
        self.runtime.on_model("ADDED", body)


@pytest.fixture
async def env(mgmt_workers: list[MgmtWorker]) -> AsyncIterator[Env]:
    objects: dict[tuple[str, str], dict[str, Any]] = {}

    async def write_status(model: Model, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        body = objects[model.key]
        status = {k: v for k, v in {**(body.get("status") or {}), **patch}.items() if v is not None}
        body = objects[model.key] = {**body, "status": json.loads(json.dumps(status))}
        return body  # no watch event: the runtime must keep the answer itself

    settings = OperatorSettings(
        default_replicas=2, reconcile_workers=2, drift_interval=3600, retry_base=0.05, retry_max=0.2
    )
    client = WorkerClient(call_timeout=2, load_timeout=5, backoff=0.01)
    reconciler = Reconciler(client, management_port=mgmt_workers[0].port, ledger=MemoryLedger(), unload_grace=0)
    rt = Runtime(settings, reconciler, write_status)
    for i, w in enumerate(mgmt_workers):
        rt.on_pod("ADDED", pod_body(f"worker-{i}", w.host, True, BASE))
    rt.start()
    yield Env(rt, objects)
    await rt.stop()


async def settle(rt: Runtime, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not rt.idle():
        assert time.monotonic() < deadline, "runtime did not settle"
        await asyncio.sleep(0.02)


async def test_written_status_is_what_drift_and_owner_read(env: Env, mgmt_workers: list[MgmtWorker]) -> None:
    rt = env.runtime
    env.add(lora_body("m", "org/a", "2026-01-01T00:00:01Z"))
    await settle(rt)
    model = rt.index.get(("ns", "m"))
    assert model is not None and model.status["phase"] == "Ready"  # no watch echo needed
    assert rt.index.owner(model) == model and len(model.status["placement"]) == 2
    placed = set(model.status["placement"])

    # a worker of the placement restarts empty: drift (reading the index's status, listing through
    # the shared inventory) re-queues the model, which loads it again
    lost = next(w for i, w in enumerate(mgmt_workers) if f"worker-{i}" in placed)
    await lost.restart()
    rt.inventory.invalidate_listings()
    await rt.drift()
    await settle(rt)
    assert "org/a" in lost.loras


async def test_failures_back_off_in_the_queue_and_success_forgets_them(
    env: Env, mgmt_workers: list[MgmtWorker]
) -> None:
    rt = env.runtime
    for w in mgmt_workers:
        w.fail_next = 9  # three passes of three attempts each fail
    env.add(lora_body("m", "org/b", "2026-01-01T00:00:01Z"))
    deadline = time.monotonic() + 20
    while rt.queue.num_requeues(("ns", "m")) < 1:
        assert time.monotonic() < deadline, "the failed pass was not retried through the queue"
        await asyncio.sleep(0.02)
    while (model := rt.index.get(("ns", "m"))) is None or model.status.get("phase") != "Ready":
        assert time.monotonic() < deadline, "the model did not recover"
        await asyncio.sleep(0.02)
    await settle(rt)
    assert rt.queue.num_requeues(("ns", "m")) == 0  # success forgot the failures


async def test_a_model_on_fewer_pods_than_replicas_is_looked_at_again(mgmt_workers: list[MgmtWorker]) -> None:
    """Level-based safety net: Ready on the only 2 pods there are while 3 are wanted, it is re-queued
    after ``retry_max`` even if no pod event comes; with its replicas placed it is not."""
    client = WorkerClient(call_timeout=2, load_timeout=5, backoff=0.01)
    rec = Reconciler(client, management_port=mgmt_workers[0].port, retry_max=7.0, unload_grace=0)
    pods = [Pod.from_body(pod_body(f"worker-{i}", w.host, True, BASE)) for i, w in enumerate(mgmt_workers)]
    try:
        body = lora_body("m", "org/under", "2026-01-01T00:00:01Z")
        body["spec"]["replicas"] = len(pods) + 1
        result = await rec.reconcile(Model.from_body(body), pods)
        assert result.status["phase"] == "Ready" and len(result.status["placement"]) == len(pods)
        assert result.requeue_after == 7.0
        body["spec"]["replicas"] = len(pods)
        for _ in range(3):  # converge (follow-up passes publish, then settle)
            result = await rec.reconcile(Model.from_body(body), pods)
            body["status"] = result.status
        assert result.status["phase"] == "Ready" and result.requeue_after is None
    finally:
        await client.close()


async def test_a_joining_pod_requeues_only_the_models_whose_top_replicas_it_enters(
    mgmt_workers: list[MgmtWorker],
) -> None:
    """The reconcile pass returns the replicas a model wants (``Result.replicas``); the runtime alone
    decides from them which models a pod joining moves (``placement.takes``), asking the reconciler
    nothing. A model with no pass yet is queued anyway."""
    objects: dict[tuple[str, str], dict[str, Any]] = {}

    async def write_status(model: Model, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        body = objects[model.key]
        status = {k: v for k, v in {**(body.get("status") or {}), **patch}.items() if v is not None}
        body = objects[model.key] = {**body, "status": json.loads(json.dumps(status))}
        return body

    settings = OperatorSettings(default_replicas=2, drift_interval=3600, retry_base=0.05, retry_max=0.2)
    client = WorkerClient(call_timeout=2, load_timeout=5, backoff=0.01)
    rt = Runtime(settings, Reconciler(client, management_port=mgmt_workers[0].port, unload_grace=0), write_status)
    try:  # not started: this test takes keys from the queue itself
        for i, w in enumerate(mgmt_workers):
            rt.on_pod("ADDED", pod_body(f"worker-{i}", w.host, True, BASE))
        for i in range(16):
            body = lora_body(f"m{i}", f"org/m{i}", f"2026-01-01T00:00:{i:02d}Z")
            body["spec"]["replicas"] = 1 + i % 2
            objects[("ns", f"m{i}")] = body
            rt.on_model("ADDED", body)
        while len(rt.queue):
            key = await asyncio.wait_for(rt.queue.get(), 20)
            await rt.reconcile_key(key)
            rt.queue.done(key)
        assert rt.replicas == {("ns", f"m{i}"): 1 + i % 2 for i in range(16)}
        rt.on_model("ADDED", lora_body("late", "org/late", "2026-01-01T00:01:00Z"))  # queued, no pass yet
        rt.queue.done(await asyncio.wait_for(rt.queue.get(), 2))  # (taken: the pod below must queue it again)

        rt.on_pod("ADDED", pod_body("worker-5", "127.0.0.250", True, BASE))
        requeued = set()
        while len(rt.queue):
            requeued.add(await asyncio.wait_for(rt.queue.get(), 2))
        entered = {
            key
            for key, model in rt.index.items()
            if key in rt.replicas and takes(model.model_name, model.status["placement"], rt.replicas[key], "worker-5")
        }
        assert entered and len(entered) < 16, "the models should split into moving and staying ones"
        assert requeued == entered | {("ns", "late")}
    finally:
        await rt.stop()
