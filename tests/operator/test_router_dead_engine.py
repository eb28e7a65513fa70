"""The router in front of a worker whose engine loop died: the process is alive and its pod
still listed as ready, but every request it gets ends before its first byte with 503, which the router
retries on another holder, streamed or not. The client sees a success.

The dead worker is real (the tiny llama, served in this process on the pods' inference port), its step
loop killed as in tests/worker/test_health.py; the other holder is a stub answering every request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from lorafleet_devcluster.nodeagent import AddressBlock
from lorafleet_router import metrics
from lorafleet_router.router import Router, RoutingTable
from lorafleet_worker.api.app import http_server
from lorafleet_worker.api.inference import build_inference_app
from lorafleet_worker.service import WorkerService, WorkerSettings

from .conftest import INFER_PORT, MGMT_PORT, REAL_BASE, pod_body

ADAPTER = "org/dead-engine"
SEEN = web.AppKey("seen", list)  # the request bodies the stub got


class _Killed(BaseException):
    """Not an Exception: it ends the engine's step loop, as a fatal error would."""


@dataclass
class Fleet:
    dead: str  # the dead-engine worker's address
    live: str  # the stub's address
    router: Router
    url: str  # the router's
    http: aiohttp.ClientSession
    live_requests: list[dict[str, Any]]


async def _stub(request: web.Request) -> web.StreamResponse:
    """A live holder: a fixed completion, streamed (two chunks, then [DONE]) or whole."""
    body = await request.json()
    request.app[SEEN].append(body)
    if not body.get("stream"):
        return web.json_response({"object": "text_completion", "choices": [{"index": 0, "text": " live"}]})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices": [{"index": 0, "text": " live"}]}\n\n')
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def _model(holders: dict[str, str]) -> dict[str, Any]:
    endpoints = [
        {"address": f"http://{ip}:{MGMT_PORT}", "podName": name, "ready": True} for name, ip in holders.items()
    ]
    return {
        "metadata": {"name": "dead-engine", "namespace": "ns", "uid": "uid-dead-engine", "generation": 1},
        "spec": {"modelName": ADAPTER, "baseModelName": REAL_BASE, "modelType": "lora"},
        "status": {"phase": "Ready", "endpoints": endpoints},
    }


@pytest_asyncio.fixture
async def fleet(tiny_models: Any, tiny_adapter_factory: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Fleet]:
    model_dir = tiny_models["llama"]
    adapter = tiny_adapter_factory(model_dir, rank=4, seed=11, strength=2.0)
    monkeypatch.setenv("LORAFLEET_FILE_ROOTS", str(adapter.parent))
    service = WorkerService(WorkerSettings(model_dir=model_dir, served_model_name=REAL_BASE, max_lora_rank=16))
    await service.start()
    await service.load_adapter(ADAPTER, f"file://{adapter}")

    def die(plan: Any) -> None:
        raise _Killed("engine thread killed by the test")

    monkeypatch.setattr(service.engine, "_step", die)
    block = AddressBlock()
    dead, live, front = block.take(), block.take(), block.take()
    server = http_server(build_inference_app(service), dead, INFER_PORT)
    serving = asyncio.create_task(server.serve())
    stub = web.Application()
    stub[SEEN] = []
    stub.router.add_post("/v1/completions", _stub)
    runners = [await _serve(stub, live, INFER_PORT)]
    table = RoutingTable(inference_port=INFER_PORT)
    for name, ip in (("worker-dead", dead), ("worker-live", live)):
        table.on_pod("ADDED", pod_body(name, ip, True, REAL_BASE))
    table.on_model("ADDED", _model({"worker-dead": dead, "worker-live": live}))
    router = Router(table, timeout=60, unavailable_wait=3)
    runners.append(await _serve(router.app(), front, 8080))
    try:
        while not server.started:
            assert not serving.done(), "the in-process worker did not start"
            await asyncio.sleep(0.02)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            yield Fleet(dead, live, router, f"http://{front}:8080", http, stub[SEEN])
    finally:
        for runner in runners:
            await runner.cleanup()
        server.should_exit = True
        await serving
        await service.stop()
        block.close()


def _request(stream: bool) -> dict[str, Any]:
    return {"model": ADAPTER, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": stream}


async def test_a_dead_engine_costs_a_retry_not_an_error(fleet: Fleet) -> None:
    """The router prefers the dead-engine holder (fewer in flight); its 503 comes before any byte, so
    each request, streamed or not, is answered by the live holder after one retry."""
    for stream in (False, True):
        async with fleet.http.post(f"http://{fleet.dead}:{INFER_PORT}/v1/completions", json=_request(stream)) as r:
            body = await r.json()
        assert r.status == 503 and body["error"]["code"] == "engine_unavailable", body  # the worker itself: not 500
    live_url = f"http://{fleet.live}:{INFER_PORT}"
    fleet.router.inflight[live_url] += 1  # the dead holder has fewer in flight: the router picks it first
    try:
        for stream in (False, True):
            retries = metrics.ROUTER_RETRIES._value.get()
            async with fleet.http.post(f"{fleet.url}/v1/completions", json=_request(stream)) as r:
                text = await r.text()
            assert r.status == 200, (stream, text)
            assert text.endswith("data: [DONE]\n\n") if stream else json.loads(text)["choices"][0]["text"] == " live"
            assert metrics.ROUTER_RETRIES._value.get() == retries + 1, stream
    finally:
        fleet.router.inflight[live_url] -= 1
    assert [b["stream"] for b in fleet.live_requests] == [False, True]  # each reached the live holder once
