"""The router's side of adapters on demand: a catalogued adapter with no holder (scaled to zero, or
its holders gone, or its listed holders unreachable) goes to its rendezvous pod among the Ready pods of
its base model, the first of the HRW order the operator's placement uses, which loads it from its catalogue.

Real HTTP: the router's app in front of stub workers on their own 127.0.B.x addresses; each stub
answers for what it holds, loads a catalogued adapter on demand, and answers vLLM's 404 otherwise.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from lorafleet_devcluster.nodeagent import AddressBlock
from lorafleet_operator.placement import rank
from lorafleet_operator.resources import ENGINE_LABEL
from lorafleet_router.router import Router, RoutingTable

from .conftest import INFER_PORT, REAL_BASE, pod_body

HELD = web.AppKey("held", set)
CATALOG = {"org/idle"}  # what the operator told every worker


async def _complete(request: web.Request) -> web.Response:
    name = (await request.json())["model"]
    held = request.app[HELD]
    if name not in held and name in CATALOG:
        held.add(name)  # loaded on demand
    if name not in held:
        return web.json_response(
            {"error": {"message": f"The model `{name}` does not exist.", "code": "model_not_found"}}, status=404
        )
    return web.json_response({"object": "text_completion", "model": name, "choices": [{"index": 0, "text": "ok"}]})


@dataclass
class Fleet:
    client: TestClient[Any, Any]
    table: RoutingTable
    held: dict[str, set[str]]  # pod name -> adapters it holds


def model_body(name: str, model_name: str, status: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1},
        "spec": {"modelName": model_name, "baseModelName": REAL_BASE, "modelType": "lora",
                 "source": {"uri": f"s3://bucket/{name}"}},
        "status": status,
    }  # fmt: skip


@pytest_asyncio.fixture
async def fleet() -> AsyncIterator[Fleet]:
    block = AddressBlock()
    runners, held = [], {}
    table = RoutingTable(inference_port=INFER_PORT)
    try:
        for i in range(4):
            host, name = block.take(), f"worker-{i}"
            app = web.Application()
            app[HELD] = held[name] = set()
            app.router.add_post("/v1/completions", _complete)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, host, INFER_PORT).start()
            runners.append(runner)
            table.on_pod("ADDED", pod_body(name, host, i != 3, REAL_BASE))  # worker-3 is not Ready
        table.on_pod("ADDED", pod_body("other-0", block.take(), True, "other/base"))  # another base model
        # scaled to zero: served before (servedUri), no endpoint now
        table.on_model("ADDED", model_body("idle", "org/idle", {"phase": "ScaledToZero", "servedUri": "s3://bucket/idle",
                                                                "endpoints": [], "placement": []}))  # fmt: skip
        # never served (its first load is still to come): not catalogued, nowhere to go
        table.on_model("ADDED", model_body("new", "org/new", {"phase": "Pending", "endpoints": []}))
        router = Router(table, unavailable_wait=0.3)
        async with TestClient(TestServer(router.app())) as client:
            yield Fleet(client, table, held)
    finally:
        for runner in runners:
            await runner.cleanup()
        block.close()


async def test_a_catalogued_adapter_without_holder_goes_to_its_rendezvous_pod(fleet: Fleet) -> None:
    expected = rank("org/idle", ["worker-0", "worker-1", "worker-2"])[0]  # the Ready pods of its base model
    for _ in range(3):  # every request: the same pod, which loaded it once
        resp = await fleet.client.post("/v1/completions", json={"model": "org/idle", "prompt": "hi"})
        assert resp.status == 200, await resp.text()
    assert {pod for pod, held in fleet.held.items() if "org/idle" in held} == {expected}
    assert "org/idle" in {m["id"] for m in (await (await fleet.client.get("/v1/models")).json())["data"]}


async def test_an_adapter_never_served_and_an_unknown_name_are_not_sent_on_demand(fleet: Fleet) -> None:
    resp = await fleet.client.post("/v1/completions", json={"model": "org/new", "prompt": "hi"})
    assert resp.status == 503 and all(not held for held in fleet.held.values())
    resp = await fleet.client.post("/v1/completions", json={"model": "org/unknown", "prompt": "hi"})
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"


async def test_vllm_pods_are_not_rendezvous_pods(fleet: Fleet) -> None:
    """A vLLM worker group's pod loads nothing on demand: the rendezvous skips it, however HRW ranks it."""
    first = rank("org/idle", ["worker-0", "worker-1", "worker-2"])[0]
    body = pod_body(first, fleet.table.pods[("ns", first)].ip, True, REAL_BASE)
    body["metadata"]["labels"][ENGINE_LABEL] = "vllm"
    fleet.table.on_pod("MODIFIED", body)
    expected = rank("org/idle", [n for n in ("worker-0", "worker-1", "worker-2") if n != first])[0]
    resp = await fleet.client.post("/v1/completions", json={"model": "org/idle", "prompt": "hi"})
    assert resp.status == 200, await resp.text()
    assert {pod for pod, held in fleet.held.items() if "org/idle" in held} == {expected}


async def test_a_served_adapter_whose_listed_holders_are_gone_goes_to_its_rendezvous_pod(fleet: Fleet) -> None:
    """A rollout took down the last pod holding it before the operator placed it on a new one: the status
    still lists the old pod (the router trusts the address of a pod it has not seen), which refuses
    connections; after that one try the rendezvous pod loads it on demand, instead of a 503."""
    gone = AddressBlock()
    try:
        dead = gone.take()  # an address nothing listens on
        status = {
            "phase": "Ready",
            "servedUri": "s3://bucket/moved",
            "endpoints": [{"podName": "worker-old", "address": f"http://{dead}:{INFER_PORT}", "ready": True}],
        }
        fleet.table.on_model("ADDED", model_body("moved", "org/moved", status))
        CATALOG.add("org/moved")
        resp = await fleet.client.post("/v1/completions", json={"model": "org/moved", "prompt": "hi"})
        assert resp.status == 200, await resp.text()
        expected = rank("org/moved", ["worker-0", "worker-1", "worker-2"])[0]
        assert {pod for pod, held in fleet.held.items() if "org/moved" in held} == {expected}
    finally:
        CATALOG.discard("org/moved")
        gone.close()
