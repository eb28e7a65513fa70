"""The router when a worker process dies under a request: real worker
processes, one SIGKILLed while it generates a non-streamed answer the router forwarded to it.

The request must come back whole from the other holder (a retry before the client's first byte),
as the same greedy text that holder gives; a stream on the killed worker ends early instead.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import pytest_asyncio
from aiohttp import web
from lorafleet_devcluster.nodeagent import AddressBlock
from lorafleet_router import metrics
from lorafleet_router.router import Router, RoutingTable

from .conftest import INFER_PORT, MGMT_PORT, REAL_BASE, RealWorker

ADAPTER = "org/crash"
LONG = 1500  # tokens (most of the tiny model's context): still running when the poll looks, however fast the CPU


@dataclass
class Pair:
    workers: list[RealWorker]
    addresses: AddressBlock
    adapter: Path

    def revive(self, worker: RealWorker) -> None:
        """Start ``worker`` (again) if it is not running; wait until it is ready and holds ``ADAPTER``."""
        if worker.proc is None or worker.proc.poll() is not None:
            worker.spawn()
        worker.wait_ready()
        body = {"lora_name": ADAPTER, "source": {"uri": f"file://{self.adapter}"}}
        r = httpx.post(f"{worker.mgmt}/v1/loras", json=body, timeout=60)
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def pair(tiny_models: Any, tiny_adapter_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Two real workers holding ``ADAPTER``."""
    model_dir = tiny_models["llama"]
    adapter = tiny_adapter_factory(model_dir, rank=4, seed=11, strength=2.0)
    root = tmp_path_factory.mktemp("router_crash")
    block = AddressBlock()
    workers = []
    for i in range(2):
        (root / f"w{i}").mkdir()
        workers.append(RealWorker(f"worker-{i}", block.take(), model_dir, adapter.parent, root / f"w{i}"))
    pair = Pair(workers, block, adapter)
    try:
        for w in workers:
            w.spawn()
        for w in workers:
            pair.revive(w)
        yield pair
    finally:
        for w in workers:
            w.stop()
        block.close()


def model_body(workers: list[RealWorker]) -> dict[str, Any]:
    endpoints = [{"address": f"http://{w.host}:{MGMT_PORT}", "podName": w.name, "ready": True} for w in workers]
    return {
        "metadata": {"name": "crash", "namespace": "ns", "uid": "uid-crash", "generation": 1},
        "spec": {"modelName": ADAPTER, "baseModelName": REAL_BASE, "modelType": "lora"},
        "status": {"phase": "Ready", "endpoints": endpoints},
    }


@dataclass
class Front:
    router: Router
    url: str
    http: aiohttp.ClientSession


@pytest_asyncio.fixture
async def front(pair: Pair) -> AsyncIterator[Front]:
    table = RoutingTable(inference_port=INFER_PORT)
    for w in pair.workers:
        table.on_pod("ADDED", w.pod_body())
    table.on_model("ADDED", model_body(pair.workers))
    router = Router(table, timeout=120, unavailable_wait=3)
    runner = web.AppRunner(router.app())
    await runner.setup()
    host = pair.addresses.take()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = runner.addresses[0][1]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
        yield Front(router, f"http://{host}:{port}", http)
    await runner.cleanup()


def request(**kw: Any) -> dict[str, Any]:
    return {"model": ADAPTER, "prompt": "Once upon a time", "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, **kw}  # fmt: skip


async def running_on(worker: RealWorker) -> bool:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{worker.mgmt}/metrics", timeout=5)).text
    return any(line.startswith("lorafleet_requests_running_in_engine ") and float(line.split()[1]) >= 1
               for line in text.splitlines())  # fmt: skip


async def kill_when_busy(worker: RealWorker, timeout: float = 60) -> None:
    """SIGKILL ``worker`` (an OOM kill) once a request runs in its engine."""
    deadline = time.monotonic() + timeout
    while not await running_on(worker):
        assert time.monotonic() < deadline, "the request never reached the worker"
        await asyncio.sleep(0.02)
    assert worker.proc is not None
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.proc.wait(30)


async def test_a_killed_worker_costs_a_retry_not_an_error(pair: Pair, front: Front) -> None:
    """Non-streamed: killed mid-generation, the request is answered by the other holder."""
    victim, survivor = pair.workers
    async with front.http.post(f"{survivor.url}/v1/completions", json=request(model=ADAPTER)) as r:
        assert r.status == 200
        expected = (await r.json())["choices"][0]["text"]
    survivor_url = f"http://{survivor.host}:{INFER_PORT}"
    front.router.inflight[survivor_url] += 1  # the victim has fewer in flight: the router picks it first
    retries = metrics.ROUTER_RETRIES._value.get()
    try:
        call = asyncio.create_task(front.http.post(f"{front.url}/v1/completions", json=request()))
        await kill_when_busy(victim)
        async with await call as resp:
            body = await resp.json()
            assert resp.status == 200, body
    finally:
        front.router.inflight[survivor_url] -= 1
    assert body["choices"][0]["text"] == expected
    assert metrics.ROUTER_RETRIES._value.get() == retries + 1


async def test_a_stream_breaks_when_its_worker_dies(pair: Pair, front: Front, caplog: pytest.LogCaptureFixture) -> None:
    """Streamed: bytes already reached the client, so the stream ends early instead of switching;
    the router logs one warning, no traceback (the soak counts tracebacks)."""
    victim = pair.workers[1]
    pair.revive(victim)
    others = [f"http://{w.host}:{INFER_PORT}" for w in pair.workers if w is not victim]
    for url in others:
        front.router.inflight[url] += 1
    try:
        async with front.http.post(f"{front.url}/v1/completions", json=request(stream=True)) as resp:
            assert resp.status == 200
            first = await resp.content.readline()
            assert first.startswith(b"data: ")
            await kill_when_busy(victim)
            with pytest.raises(aiohttp.ClientPayloadError):
                async for _ in resp.content:
                    pass
    finally:
        for url in others:
            front.router.inflight[url] -= 1
    assert any("broke after its first byte" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
