"""Capacity-aware reconcile against real HTTP management servers that report and enforce a capacity."""

from __future__ import annotations

from collections import Counter

from lorafleet_operator import status as st
from lorafleet_operator.placement import rank

from .conftest import MgmtWorker
from .test_reconcile import _close_clients, cond, converge, lora, make, pods_for, reason  # noqa: F401 (fixture)


async def test_full_pods_are_skipped_and_what_does_not_fit_is_insufficient_capacity(
    mgmt_workers: list[MgmtWorker],
) -> None:
    workers = mgmt_workers[:3]
    for w, cap in zip(workers, (2, 2, 1), strict=True):
        w.capacity = cap
    pods = pods_for(workers)
    rec, _ = make(workers)
    models = [lora(f"org/adapter-{i}", f"s3://bucket/{i}", replicas=2) for i in range(4)]
    results = {}
    for model in models:  # 8 replicas asked for, room for 5
        _, results[model.model_name] = await converge(rec, model, pods)

    held = Counter(n for w in workers for n in w.loras)
    assert all(len(w.loras) <= w.capacity for w in workers if w.capacity)  # never above what a pod holds
    assert sum(held.values()) == 5
    full_after = {m: r for m, r in results.items() if held[m] < 2}
    assert sorted(held[m] for m in full_after) == [0, 1], held  # the third on one pod, the fourth nowhere
    for name, result in full_after.items():
        status = result.status
        if held[name] == 0:
            assert status["phase"] == st.PENDING
            assert reason(status, "EndpointsReady") == st.INSUFFICIENT_CAPACITY
            assert "full" in cond(status, "EndpointsReady")["message"]
        else:
            assert status["phase"] == st.DEGRADED
            assert reason(status, "Degraded") == st.INSUFFICIENT_CAPACITY
            assert reason(status, "Ready") == st.SERVING  # its one replica serves
        assert result.failed  # looks again for room, with backoff

    # a placed model keeps the pods of its HRW order that had room, best first
    first = models[0].model_name
    assert results[first].status["placement"] == rank(first, [p.name for p in pods])[:2]

    # room appears (a pod's cap is raised): the next pass places the missing replicas
    for w in workers:
        w.capacity = 3
    rec.inventory.invalidate_listings()
    for name in full_after:
        model = next(m for m in models if m.model_name == name)
        _, result = await converge(rec, model, pods)
        assert result.status["phase"] == st.READY
    assert all(len(w.loras) <= 3 for w in workers)


async def test_a_507_from_a_worker_reads_insufficient_capacity_not_a_load_loop(
    mgmt_workers: list[MgmtWorker],
) -> None:
    """A worker that fills up behind the operator's back (stale listing) answers 507."""
    workers = mgmt_workers[:2]
    pods = pods_for(workers)
    rec, _ = make(workers, listing_ttl=3600)
    model = lora("org/late", replicas=1)
    await rec.inventory.listing(pods[0]), await rec.inventory.listing(pods[1])  # cached: both look empty and unlimited
    for w in workers:
        w.capacity = 1
        w.loras["someone-else"] = "s3://bucket/other"
    result = await rec.reconcile(model, pods)
    assert result.status["phase"] == st.DEGRADED
    assert reason(result.status, "EndpointsReady") == st.INSUFFICIENT_CAPACITY
    assert result.failed
    # each 507 drops that pod's stale listing: soon every pod is known full and nothing is posted
    for _ in range(2):
        result = await rec.reconcile(model, pods)
    posts = sum(w.posts("org/late") for w in workers)
    for _ in range(3):
        result = await rec.reconcile(model, pods)
        assert result.status["phase"] == st.PENDING
        assert reason(result.status, "EndpointsReady") == st.INSUFFICIENT_CAPACITY
    assert sum(w.posts("org/late") for w in workers) == posts  # no 507 loop
