"""The router through ordinary trouble:
- a stopped router drains (a rollout, a scale-down): on SIGTERM its /ready fails at once while it keeps
  serving for the drain delay, then it stops accepting connections and lets the requests in flight finish;
- an adapter's only holder that fails a request once (503: restarting, still loading) is tried again: the
  client gets the answer, not a 503 after `--router-unavailable-wait` (the 30-minute soak found that).

Real HTTP on 127.0.0.x: the router's own `serve` (what `lorafleet-router` runs) in front of a stub worker
whose stream the test holds open until after the listener has closed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest_asyncio
from aiohttp import web
from lorafleet_devcluster.nodeagent import AddressBlock
from lorafleet_router.router import Router, RoutingTable, serve

from .conftest import INFER_PORT, MGMT_PORT, REAL_BASE, pod_body

ADAPTER = "org/drain"
RELEASE = web.AppKey("release", asyncio.Event)  # the stub ends its stream when this is set
FLAKY = web.AppKey("flaky", list)  # requests with prompt "flaky" the stub has seen (the first gets a 503)
PORT = 8080
DELAY, TIMEOUT = 3.0, 30.0
UNAVAILABLE_WAIT = 20.0


async def _stub(request: web.Request) -> web.StreamResponse:
    """A holder: non-streamed answers at once (the first "flaky" one a 503); a stream sends one chunk,
    then waits for RELEASE."""
    body = await request.json()
    if body.get("prompt") == "flaky":
        request.app[FLAKY].append(body)
        if len(request.app[FLAKY]) == 1:
            return web.json_response({"error": {"message": "engine restarting"}}, status=503)
    if not body.get("stream"):
        return web.json_response({"object": "text_completion", "choices": [{"index": 0, "text": " now"}]})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices": [{"index": 0, "text": " first"}]}\n\n')
    await request.app[RELEASE].wait()
    await response.write(b'data: {"choices": [{"index": 0, "text": " last"}]}\n\n')
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


@dataclass
class Front:
    router: Router
    url: str
    stop: asyncio.Event
    serving: asyncio.Task[None]
    release: asyncio.Event


@pytest_asyncio.fixture
async def front() -> AsyncIterator[Front]:
    block = AddressBlock()
    worker, host = block.take(), block.take()
    stub = web.Application()
    stub[RELEASE] = asyncio.Event()
    stub[FLAKY] = []
    stub.router.add_post("/v1/completions", _stub)
    runner = web.AppRunner(stub)
    await runner.setup()
    await web.TCPSite(runner, worker, INFER_PORT).start()
    table = RoutingTable(inference_port=INFER_PORT)
    table.on_pod("ADDED", pod_body("worker-0", worker, True, REAL_BASE))
    table.on_model("ADDED", {
        "metadata": {"name": "drain", "namespace": "ns", "uid": "uid-drain", "generation": 1},
        "spec": {"modelName": ADAPTER, "baseModelName": REAL_BASE, "modelType": "lora"},
        "status": {"phase": "Ready", "endpoints": [
            {"address": f"http://{worker}:{MGMT_PORT}", "podName": "worker-0", "ready": True}]},
    })  # fmt: skip
    router, stop = Router(table, timeout=60, unavailable_wait=UNAVAILABLE_WAIT), asyncio.Event()
    serving = asyncio.create_task(serve(router, host, PORT, stop, DELAY, TIMEOUT))
    url = f"http://{host}:{PORT}"
    try:
        await _until(lambda: _status(url, "/health"), lambda got: got == 200, "the router to listen")
        yield Front(router, url, stop, serving, stub[RELEASE])
    finally:
        stub[RELEASE].set()
        stop.set()
        await serving
        await runner.cleanup()
        block.close()


async def _status(url: str, path: str) -> int | None:
    """The status of GET `path`, or None when no connection is accepted."""
    try:
        async with aiohttp.ClientSession() as http, http.get(url + path) as r:
            return r.status
    except aiohttp.ClientConnectionError:
        return None


async def _until(probe: Callable[[], Awaitable[Any]], ok: Callable[[Any], bool], what: str, limit: float = 20) -> Any:
    """Poll `probe` until `ok(result)`; fail after `limit` s."""
    deadline = time.monotonic() + limit
    while True:
        got = await probe()
        if ok(got):
            return got
        assert time.monotonic() < deadline, f"waited {limit} s for {what}; last: {got!r}"
        await asyncio.sleep(0.05)


def _body(stream: bool) -> dict[str, Any]:
    return {"model": ADAPTER, "prompt": "x", "max_tokens": 2, "stream": stream}


async def test_sigterm_drains_the_router(front: Front) -> None:
    assert await _status(front.url, "/ready") == 200
    async with aiohttp.ClientSession() as http:
        stream = await http.post(front.url + "/v1/completions", json=_body(True))
        assert stream.status == 200
        assert b"first" in await stream.content.readline()  # the stream is in flight through the router

        front.stop.set()  # what the SIGTERM handler does
        stopped_at = time.monotonic()
        assert await _until(lambda: _status(front.url, "/ready"), lambda s: s == 503, "/ready to fail") == 503
        # still serving during the drain delay: a new request is answered, not refused
        async with aiohttp.ClientSession() as other, other.post(front.url + "/v1/completions",
                                                                 json=_body(False)) as r:  # fmt: skip
            assert r.status == 200 and (await r.json())["choices"][0]["text"] == " now"
        assert time.monotonic() - stopped_at < DELAY, "the check above ran after the drain delay: inconclusive"
        # then the listener closes while the stream is still open
        await _until(lambda: _status(front.url, "/health"), lambda s: s is None, "the listener to close")
        assert not front.serving.done()  # waiting for the request in flight

        front.release.set()
        rest = (await stream.content.read()).decode()
        assert "last" in rest and rest.rstrip().endswith("data: [DONE]")  # it finished whole
        stream.release()
    await asyncio.wait_for(front.serving, TIMEOUT)


async def test_a_stream_longer_than_the_drain_timeout_is_cut(front: Front) -> None:
    """`serve` gives requests in flight `drain_timeout` s, not forever (the kubelet's SIGKILL would follow)."""
    front.stop.set()
    await asyncio.wait_for(front.serving, DELAY + TIMEOUT + 10)  # the fixture's stream-less serve ends
    block = AddressBlock()
    host = block.take()
    stop = asyncio.Event()
    # the same router, served again with a short drain timeout, and a stream the stub never ends
    serving = asyncio.create_task(serve(front.router, host, PORT, stop, 0.0, 1.0))
    url = f"http://{host}:{PORT}"
    try:
        await _until(lambda: _status(url, "/health"), lambda got: got == 200, "the router to listen")
        async with aiohttp.ClientSession() as http:
            stream = await http.post(url + "/v1/completions", json=_body(True))
            assert b"first" in await stream.content.readline()
            stop.set()
            await asyncio.wait_for(serving, 15)  # ends although the stream never finished
            try:
                rest = await stream.content.read()
            except aiohttp.ClientPayloadError:
                rest = b""
            assert b"[DONE]" not in rest  # cut, not completed
            stream.release()
    finally:
        stop.set()
        await serving
        block.close()


async def test_the_only_holder_failing_once_is_tried_again(front: Front) -> None:
    """Its first answer is a 503; the router tries it again (after 0.2 s) instead of waiting the whole
    `unavailable_wait` for *another* holder and then passing the 503 on."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http, http.post(front.url + "/v1/completions",
                                                           json={**_body(False), "prompt": "flaky"}) as r:  # fmt: skip
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["text"] == " now"
    assert time.monotonic() - t0 < UNAVAILABLE_WAIT / 2  # well before the wait would have run out


def _model(name: str, created: str, status: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "creationTimestamp": created},
            "spec": {"modelName": ADAPTER, "baseModelName": REAL_BASE, "modelType": "lora"},
            "status": status}  # fmt: skip


async def test_a_name_handed_over_waits_for_its_next_owner_a_failed_model_does_not(front: Front) -> None:
    """The owner of a name is deleted before the router sees its successor's endpoints: the successor's
    last status is still the ``ModelNameConflict`` it had as the younger claimant (phase Failed). That is a
    handover in progress, so the request waits for the endpoints instead of failing at once (the e2e
    handover test saw 503s there); a model that failed for another reason is answered 503 at once."""
    table = front.router.table
    owner = next(iter(table.models.values()))
    holder = owner.status["endpoints"]
    conflict = {"phase": "Failed", "conditions": [{"type": "Ready", "status": "False", "reason": "ModelNameConflict"}]}
    table.on_model("DELETED", _model("drain", "2026-01-01T00:00:01Z", {}))
    table.on_model("ADDED", _model("next", "2026-01-01T00:00:02Z", conflict))

    async def publish() -> None:
        await asyncio.sleep(0.5)
        table.on_model("MODIFIED", _model("next", "2026-01-01T00:00:02Z", {"phase": "Ready", "endpoints": holder}))

    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        publishing = asyncio.create_task(publish())
        async with http.post(front.url + "/v1/completions", json=_body(False)) as r:
            assert r.status == 200, await r.text()
        await publishing
        assert 0.5 <= time.monotonic() - t0 < UNAVAILABLE_WAIT / 2

        failed = {"phase": "Failed", "conditions": [{"type": "Ready", "status": "False", "reason": "SyncFailed"}]}
        table.on_model("MODIFIED", _model("next", "2026-01-01T00:00:02Z", failed))
        t0 = time.monotonic()
        async with http.post(front.url + "/v1/completions", json=_body(False)) as r:
            assert r.status == 503 and "no reachable worker" in await r.text()
        assert time.monotonic() - t0 < UNAVAILABLE_WAIT / 2
