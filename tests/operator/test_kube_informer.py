"""KubeClient and Informer against a small real HTTP server speaking the list/watch protocol."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from lorafleet_operator.api import models_path
from lorafleet_operator.kube import Informer, KubeClient, KubeError


def pod(name: str, rv: int) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": str(rv)}}


class FakeApi:
    """GET list, GET ?watch=true (one scripted stream per call), PATCH /status; records headers."""

    def __init__(self) -> None:
        self.items = [pod("a", 1), pod("b", 2)]
        self.streams: list[list[dict[str, Any]]] = []
        self.auth: list[str | None] = []
        self.patches: list[tuple[str, str, Any]] = []
        self.lists = 0

    async def pods(self, request: web.Request) -> web.StreamResponse:
        self.auth.append(request.headers.get("Authorization"))
        if request.query.get("watch") != "true":
            self.lists += 1
            return web.json_response({"items": self.items, "metadata": {"resourceVersion": "10"}})
        resp = web.StreamResponse()
        await resp.prepare(request)
        for event in self.streams.pop(0) if self.streams else []:
            await resp.write(json.dumps(event).encode() + b"\n")
        return resp

    async def patch(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.patches.append((request.path, request.content_type, body))
        if request.match_info["name"] == "missing":
            return web.json_response({"kind": "Status", "message": "not found"}, status=404)
        return web.json_response({"metadata": {"name": request.match_info["name"]}, **body})


@pytest.fixture
async def api() -> AsyncIterator[tuple[FakeApi, KubeClient]]:
    fake = FakeApi()
    app = web.Application()
    app.add_routes(
        [web.get("/api/v1/pods", fake.pods), web.patch("/apis/g/v1/namespaces/ns/x/{name}/status", fake.patch)]
    )
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    kube = KubeClient(f"http://127.0.0.1:{runner.addresses[0][1]}", False, lambda: "Bearer t0ken")
    yield fake, kube
    await kube.close()
    await runner.cleanup()


async def test_merge_patch_and_errors(api: tuple[FakeApi, KubeClient]) -> None:
    fake, kube = api
    out = await kube.merge_patch("/apis/g/v1/namespaces/ns/x/m/status", {"status": {"phase": "Ready"}})
    assert out["status"] == {"phase": "Ready"}
    assert fake.patches[0][1] == "application/merge-patch+json"
    with pytest.raises(KubeError) as err:
        await kube.merge_patch("/apis/g/v1/namespaces/ns/x/missing/status", {"status": {}})
    assert err.value.status == 404 and "not found" in err.value.message
    assert await kube.get("/apis/g/v1/nothing") is None


async def test_informer_lists_watches_and_relists_after_gone(api: tuple[FakeApi, KubeClient]) -> None:
    fake, kube = api
    fake.streams = [
        [{"type": "ADDED", "object": pod("c", 11)}, {"type": "BOOKMARK", "object": pod("", 12)}],
        [{"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}}],
    ]
    seen: list[tuple[str, str]] = []
    relisted = asyncio.Event()

    def handler(kind: str, obj: dict[str, Any]) -> None:
        seen.append((kind, obj["metadata"]["name"]))
        if fake.lists >= 2 and kind == "DELETED":
            relisted.set()

    informer = Informer(kube, "/api/v1/pods", handler, label_selector="x")
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), 10)
        fake.items = [pod("a", 20)]  # b and c vanished while the watch was broken
        await asyncio.wait_for(relisted.wait(), 20)
    finally:
        task.cancel()
    assert seen[:3] == [("MODIFIED", "a"), ("MODIFIED", "b"), ("ADDED", "c")]
    assert {("DELETED", "b"), ("DELETED", "c")} <= set(seen[3:])
    assert ("MODIFIED", "a") in seen[3:]
    assert set(fake.auth) == {"Bearer t0ken"}


async def test_event_poster_aggregates_what_waits_and_posts_each_object_reason_once() -> None:
    """Events for the same object and reason that pile up behind a slow POST become one Event
    with a count (client-go's EventCorrelator), not one POST each; other objects keep theirs."""
    from lorafleet_operator.kube import EventPoster

    class SlowKube:
        def __init__(self) -> None:
            self.bodies: list[dict[str, Any]] = []
            self.gate = asyncio.Event()

        async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
            await self.gate.wait()
            self.bodies.append(body)
            return body

    fake = SlowKube()
    client: Any = fake
    poster = EventPoster(client, "test")
    task = asyncio.create_task(poster.run())
    try:
        a = {"kind": "DynamoModel", "name": "a", "namespace": "ns", "uid": "uid-a"}
        b = {"kind": "DynamoModel", "name": "b", "namespace": "ns", "uid": "uid-b"}
        poster.post(a, "Warning", "LoadFailed", "first")
        await asyncio.sleep(0)  # the poster takes it and waits on the API server
        for i in range(5):
            poster.post(a, "Warning", "LoadFailed", f"retry {i}")
        poster.post(b, "Normal", "Loaded", "loaded")
        poster.post(a, "Normal", "Loaded", "loaded")
        fake.gate.set()

        async def drained() -> None:
            while poster.pending or len(fake.bodies) < 4:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(drained(), timeout=10)
        got = [(e["involvedObject"]["name"], e["reason"], e["count"], e["message"]) for e in fake.bodies]
        assert got == [
            ("a", "LoadFailed", 1, "first"),
            ("a", "LoadFailed", 5, "retry 4"),
            ("b", "Loaded", 1, "loaded"),
            ("a", "Loaded", 1, "loaded"),
        ]
    finally:
        task.cancel()


def test_event_poster_bounds_what_waits_and_counts_drops() -> None:
    from lorafleet_operator.kube import EventPoster

    unused: Any = None
    poster = EventPoster(unused, "test", maxsize=3)
    for i in range(5):
        poster.post({"name": f"m{i}", "namespace": "ns", "uid": f"u{i}"}, "Normal", "Loaded", "loaded")
    poster.post({"name": "m0", "namespace": "ns", "uid": "u0"}, "Normal", "Loaded", "again")  # joins, not dropped
    assert [k[0] for k in poster.pending] == ["u0", "u1", "u2"]
    assert poster.dropped == 2 and poster.pending[("u0", "Normal", "Loaded")].count == 2


async def test_informer_waits_for_a_resource_that_does_not_exist_yet(caplog: pytest.LogCaptureFixture) -> None:
    """A list answering 404 (the CRD is not installed) is retried, warned about once, and the objects are
    reported as soon as the resource exists: a CRD installed after the operator needs no restart."""
    answers = [404, 404, 200]
    lists: list[int] = []
    stop = asyncio.Event()

    async def models(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") == "true":
            resp = web.StreamResponse()
            await resp.prepare(request)
            await stop.wait()  # a watch that stays open until the test ends
            return resp
        status = answers.pop(0) if answers else 200
        lists.append(status)
        if status == 404:
            return web.json_response(
                {"kind": "Status", "code": 404, "message": "the server could not find"}, status=404
            )
        return web.json_response({"items": [pod("m", 5)], "metadata": {"resourceVersion": "5"}})

    app = web.Application()
    app.add_routes([web.get(models_path(), models)])
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    kube = KubeClient(f"http://127.0.0.1:{runner.addresses[0][1]}", False, lambda: "Bearer t0ken")
    seen: list[tuple[str, str]] = []
    informer = Informer(kube, models_path(), lambda t, o: seen.append((t, o["metadata"]["name"])))
    task = asyncio.create_task(informer.run())
    try:
        with caplog.at_level("WARNING", logger="lorafleet_operator.kube"):
            await asyncio.wait_for(informer.synced.wait(), 10)
        assert lists == [404, 404, 200]
        assert seen == [("MODIFIED", "m")]
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len([w for w in warnings if "CRD installed" in w]) == 1, warnings
        assert any("exists now" in w for w in warnings), warnings
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        stop.set()
        await kube.close()
        await runner.cleanup()
