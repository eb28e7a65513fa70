"""Adapters on demand, operator side: the workers' catalogues and what counts as placement.

The runtime against real HTTP management servers (``MgmtWorker``): every Ready pod of a base model
is told the catalogue of its Ready DynamoModels, again when it changes and when a pod becomes
Ready; an older worker (405) is logged once and left alone; adapters a worker loaded on demand
(``"pinned": false``) are neither placement nor drift.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest
from lorafleet_operator.placement import place
from lorafleet_operator.workers import WorkerClient

from .conftest import BASE, Cluster, MgmtWorker, pod_body


async def until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def puts(worker: MgmtWorker) -> int:
    return sum(1 for m, _ in worker.calls if m == "PUT")


async def test_every_ready_pod_is_told_the_catalogue_of_its_base_model(cluster: Cluster) -> None:
    workers = cluster.workers
    await until(lambda: all(w.catalog == [] for w in workers), "the empty catalogue at start")
    cluster.apply("a", "org/a", "s3://bucket/a")
    await cluster.settle()
    await until(lambda: all(w.catalog == [("org/a", "s3://bucket/a")] for w in workers), "org/a catalogued")
    # every pod is told, not only the placed ones: any of them may be a request's rendezvous pod
    assert len(cluster.holders("org/a")) == 2
    cluster.apply("b", "org/b", "s3://bucket/b")
    await cluster.settle()
    both = [("org/a", "s3://bucket/a"), ("org/b", "s3://bucket/b")]
    await until(lambda: all(w.catalog == both for w in workers), "org/b catalogued")
    told = [puts(w) for w in workers]
    # a pass that changes nothing tells nobody anything
    for key in cluster.runtime.index:
        cluster.runtime.queue.add(key)
    await cluster.settle()
    cluster.runtime.catalogs.mark(("ns", cluster.runtime.index.get(("ns", "a")).base_hash))  # type: ignore[union-attr]
    await until(lambda: not cluster.runtime.catalogs._dirty, "the push task idle")
    assert [puts(w) for w in workers] == told
    # a hot swap changes the entry once the new version serves
    cluster.apply("a", "org/a", "s3://bucket/a2")
    await cluster.settle()
    swapped = [("org/a", "s3://bucket/a2"), ("org/b", "s3://bucket/b")]
    await until(lambda: all(w.catalog == swapped for w in workers), "the swapped URI catalogued")
    await cluster.delete("b")
    await until(lambda: all(w.catalog == [("org/a", "s3://bucket/a2")] for w in workers), "org/b gone")


async def test_a_pod_that_becomes_ready_is_told_and_an_older_worker_is_left_alone(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    workers = cluster.workers
    cluster.apply("a", "org/a")
    await cluster.settle()
    await until(lambda: all(w.catalog for w in workers), "catalogued everywhere")
    # worker-4 restarts: unready (forgotten), back empty, Ready again: told at once
    cluster.runtime.on_pod("MODIFIED", pod_body("worker-4", workers[4].host, False, BASE))
    await workers[4].restart()
    assert workers[4].catalog is None
    cluster.runtime.on_pod("MODIFIED", pod_body("worker-4", workers[4].host, True, BASE))
    await until(lambda: workers[4].catalog == [("org/a", "s3://bucket/a")], "the restarted pod told")
    # an older worker answers 405: one warning, no retry loop, the others still told
    workers[3].serves_catalog = False
    cluster.runtime.on_pod("MODIFIED", pod_body("worker-3", workers[3].host, False, BASE))
    cluster.runtime.on_pod("MODIFIED", pod_body("worker-3", workers[3].host, True, BASE))
    with caplog.at_level(logging.WARNING, logger="lorafleet_operator.catalog"):
        cluster.apply("b", "org/b", "s3://bucket/b")
        await cluster.settle()
        both = [("org/a", "s3://bucket/a"), ("org/b", "s3://bucket/b")]
        await until(lambda: all(w.catalog == both for i, w in enumerate(workers) if i != 3), "org/b catalogued")
        await until(lambda: not cluster.runtime.catalogs._dirty, "the push task idle")
    warnings = [r for r in caplog.records if "does not serve adapter catalogues" in r.getMessage()]
    assert len(warnings) == 1 and "worker-3" in warnings[0].getMessage()
    assert cluster.runtime.catalogs._failures == {}  # not an error: nothing to retry


async def test_on_demand_copies_are_not_placement_nor_drift(cluster: Cluster) -> None:
    workers = cluster.workers
    cluster.apply("a", "org/a", replicas=1)
    await cluster.settle()
    names = [f"worker-{i}" for i in range(len(workers))]
    (placed,) = place("org/a", names, 1)
    await until(lambda: all(w.catalog for w in workers), "catalogued")
    # a request on two other pods loads it there on demand (unpinned)
    others = [i for i, n in enumerate(names) if n != placed][:2]
    for i in others:
        assert workers[i].serve("org/a")
    deletes = sum(1 for w in workers for m, _ in w.calls if m == "DELETE")
    cluster.runtime.inventory.invalidate_listings()
    await cluster.runtime.drift()  # lists every pod: the copies are seen, and not corrected
    await cluster.settle()
    assert sum(1 for w in workers for m, _ in w.calls if m == "DELETE") == deletes
    assert cluster.status("a")["placement"] == [placed]
    assert all("org/a" in workers[i].on_demand for i in others)
    # deleting the model unloads it everywhere, on-demand copies included
    await cluster.delete("a")
    assert cluster.holders("org/a") == set()


async def test_older_workers_list_every_adapter_as_pinned(mgmt_workers: list[MgmtWorker]) -> None:
    from aiohttp import web

    async def old_list(_request: web.Request) -> web.Response:  # {name: id}, no "pinned"
        return web.json_response({"status": "success", "loras": {"x": 1, "y": 2}, "count": 2, "capacity": 4})

    async def split_list(_request: web.Request) -> web.Response:  # ids kept, "pinned" beside them (z: gone)
        body = {"loras": {"x": 1, "y": 2}, "pinned": {"x": True, "y": False, "z": False}, "capacity": None}
        return web.json_response({"status": "success", **body})

    client = WorkerClient(call_timeout=2, backoff=0.01)
    try:
        for handler, pinned, on_demand in ((old_list, {"x", "y"}, set()), (split_list, {"x"}, {"y"})):
            app = web.Application()
            app.add_routes([web.get("/v1/loras", handler)])
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            try:
                inv = await client.inventory(f"http://127.0.0.1:{runner.addresses[0][1]}")
            finally:
                await runner.cleanup()
            assert (inv.names, set(inv.on_demand)) == (pinned, on_demand)
    finally:
        await client.close()
